//! Configuration: built-in defaults ← `spillway.toml` (or `--config FILE`) ←
//! environment (`SPILLWAY_<SECTION>__<KEY>`, e.g.
//! `SPILLWAY_GATEWAY__AMQP_LISTEN=127.0.0.1:5672`). Every key is documented
//! in `docs/configuration.md`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Deserialize;
use spillway_gateway::GatewayConfig;

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct Settings {
    pub gateway: GatewaySettings,
    pub engine: EngineSettings,
    pub storage: StorageSettings,
    pub management: ManagementSettings,
    pub telemetry: TelemetrySettings,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct GatewaySettings {
    /// Where AMQP clients connect.
    pub amqp_listen: String,
    /// The engine's gRPC address when the gateway runs alone.
    pub engine_addr: String,
    pub frame_max: u32,
    pub channel_max: u16,
    pub heartbeat: u16,
    pub max_message_size: u64,
    pub users: Vec<spillway_gateway::User>,
}

impl Default for GatewaySettings {
    fn default() -> Self {
        let protocol = GatewayConfig::default();
        Self {
            amqp_listen: "0.0.0.0:5672".into(),
            engine_addr: "http://127.0.0.1:50061".into(),
            frame_max: protocol.frame_max,
            channel_max: protocol.channel_max,
            heartbeat: protocol.heartbeat,
            max_message_size: protocol.max_message_size,
            users: protocol.users,
        }
    }
}

impl GatewaySettings {
    pub fn protocol(&self) -> GatewayConfig {
        GatewayConfig {
            frame_max: self.frame_max,
            channel_max: self.channel_max,
            heartbeat: self.heartbeat,
            max_message_size: self.max_message_size,
            users: self.users.clone(),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct EngineSettings {
    /// The engine's gRPC address for gateways, when it runs alone.
    pub listen: String,
    /// The storage node's gRPC address, when the engine runs alone.
    pub storage_addr: String,
    /// Deliveries in flight to one connection before the engine waits for the
    /// gateway to write them.
    pub session_credit: u32,
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50061".into(),
            storage_addr: "http://127.0.0.1:50071".into(),
            session_credit: 2048,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct StorageSettings {
    /// The storage node's gRPC address for the engine, when it runs alone.
    pub listen: String,
    /// Where RocksDB keeps its files.
    pub data_dir: PathBuf,
}

impl Default for StorageSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50071".into(),
            data_dir: PathBuf::from("./data"),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct ManagementSettings {
    /// The public management gRPC API.
    pub listen: String,
    /// The storage node's gRPC address, when management runs alone.
    pub storage_addr: String,
    /// The engine's gRPC address (its admin API), when management runs alone.
    pub engine_addr: String,
    /// A bearer token accepted from anywhere (`authorization: Bearer
    /// <token>`). Unset: no token is accepted.
    pub token: Option<String>,
    /// Users accepted with HTTP basic credentials. Default: `guest`/`guest`
    /// from loopback only, as on the AMQP port; setting `users` replaces it.
    pub users: Vec<spillway_management::ManagementUser>,
}

impl ManagementSettings {
    pub fn auth(&self) -> spillway_management::AuthConfig {
        spillway_management::AuthConfig {
            token: self.token.clone().filter(|t| !t.is_empty()),
            users: self.users.clone(),
        }
    }
}

impl Default for ManagementSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50051".into(),
            storage_addr: "http://127.0.0.1:50071".into(),
            engine_addr: "http://127.0.0.1:50061".into(),
            token: None,
            users: vec![spillway_management::ManagementUser::guest()],
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct TelemetrySettings {
    /// `text` or `json`.
    pub log_format: String,
    /// A tracing filter, e.g. `info` or `spillway_gateway=debug,info`
    /// (`RUST_LOG` wins when set).
    pub log_level: String,
    /// Where HTTP `/metrics` and `/healthz` are served (`IP:port`; port 0
    /// picks one). Unset: the role's default, `127.0.0.1:9471` for
    /// all-in-one (`Role::default_metrics_listen`).
    pub metrics_listen: Option<String>,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        Self {
            log_format: "text".into(),
            log_level: "info".into(),
            metrics_listen: None,
        }
    }
}

impl Settings {
    /// Defaults ← the file (when given, or `spillway.toml` when present) ←
    /// `SPILLWAY_*` environment variables.
    pub fn load(file: Option<&Path>) -> anyhow::Result<Self> {
        let mut builder = config::Config::builder();
        match file {
            Some(path) => {
                builder = builder.add_source(
                    config::File::from(path)
                        .format(config::FileFormat::Toml)
                        .required(true),
                );
            }
            None => {
                builder = builder.add_source(config::File::with_name("spillway").required(false));
            }
        }
        builder = builder.add_source(
            config::Environment::with_prefix("SPILLWAY")
                .prefix_separator("_")
                .separator("__")
                .try_parsing(true),
        );
        let settings = builder
            .build()
            .context("reading the configuration")?
            .try_deserialize()
            .context("invalid configuration")?;
        Ok(settings)
    }
}
