//! Configuration: built-in defaults ← `spillway.toml` (or `--config FILE`) ←
//! environment (`SPILLWAY_<SECTION>__<KEY>`, e.g.
//! `SPILLWAY_GATEWAY__AMQP_LISTEN=127.0.0.1:5672`). Every key is documented
//! in `docs/configuration.md`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use serde::Deserialize;
use spillway_gateway::GatewayConfig;

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct Settings {
    pub gateway: GatewaySettings,
    pub broker: BrokerSettings,
    pub engine: EngineSettings,
    pub storage: StorageSettings,
    pub store: StoreSettings,
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
    /// Body bytes a connection blocked by producer flow control may still
    /// publish before the gateway stops reading it.
    #[serde(deserialize_with = "sizes::required")]
    pub blocked_overdraft: u64,
    /// From accept to `connection.open-ok`: `10s`, or plain milliseconds.
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub handshake_timeout: Duration,
    /// Most connections this gateway holds open at once; 0 = no maximum.
    pub max_connections: usize,
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
            blocked_overdraft: protocol.blocked_overdraft,
            handshake_timeout: protocol.handshake_timeout,
            max_connections: protocol.max_connections,
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
            blocked_overdraft: self.blocked_overdraft,
            handshake_timeout: self.handshake_timeout,
            max_connections: self.max_connections,
        }
    }
}

/// The queue engine's memory budget (Qpid's `broker.*` names).
#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct BrokerSettings {
    /// Resident message bytes above which payloads flow to disk. Unset: 40%
    /// of the memory available to the process (its cgroup limit, else
    /// physical memory). Plain bytes or with a unit: `268435456`, `256MiB`.
    #[serde(deserialize_with = "sizes::optional")]
    pub flow_to_disk_threshold: Option<u64>,
    /// How often flow to disk is re-evaluated: `1s`, `250ms`, or plain
    /// milliseconds.
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub housekeeping_interval: Duration,
    /// How long a delivery may stay unacked before its channel is closed
    /// with 406 and its messages requeued: `30m`, or plain milliseconds;
    /// 0 turns it off.
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub consumer_timeout: Duration,
    /// Limits (docs/limits.md); 0 = no limit. Vhost and user limits are
    /// defaults that management can override per vhost or user.
    pub default_vhost_max_connections: u32,
    pub default_vhost_max_queues: u32,
    pub default_user_max_connections: u32,
    pub default_user_max_channels: u32,
    pub max_consumers_per_connection: u32,
    pub max_queues_per_connection: u32,
}

impl BrokerSettings {
    pub fn limits(&self) -> spillway_engine::LimitConfig {
        spillway_engine::LimitConfig {
            vhost_max_connections: self.default_vhost_max_connections,
            vhost_max_queues: self.default_vhost_max_queues,
            user_max_connections: self.default_user_max_connections,
            user_max_channels: self.default_user_max_channels,
            max_consumers_per_connection: self.max_consumers_per_connection,
            max_queues_per_connection: self.max_queues_per_connection,
        }
    }
}

impl Default for BrokerSettings {
    fn default() -> Self {
        Self {
            flow_to_disk_threshold: None,
            housekeeping_interval: Duration::from_secs(1),
            consumer_timeout: spillway_engine::DEFAULT_CONSUMER_TIMEOUT,
            default_vhost_max_connections: 0,
            default_vhost_max_queues: 0,
            default_user_max_connections: 0,
            default_user_max_channels: 0,
            max_consumers_per_connection: 0,
            max_queues_per_connection: 0,
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

/// The storage node's disk quota (Qpid's `store.*` names). Unset: none.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct StoreSettings {
    /// Bytes on disk above which every producer is blocked (`MST-1008`).
    #[serde(deserialize_with = "sizes::optional")]
    pub overfull_size: Option<u64>,
    /// Bytes on disk below which they are released again (`MST-1009`).
    /// Unset: the overfull size.
    #[serde(deserialize_with = "sizes::optional")]
    pub underfull_size: Option<u64>,
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
    /// An OpenTelemetry collector's OTLP/gRPC endpoint, e.g.
    /// `http://127.0.0.1:4317`: spans of every publish and delivery are
    /// exported there. Unset (or empty): nothing is exported.
    pub otlp_endpoint: Option<String>,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        Self {
            log_format: "text".into(),
            log_level: "info".into(),
            metrics_listen: None,
            otlp_endpoint: None,
        }
    }
}

impl TelemetrySettings {
    /// The OTLP endpoint, when one is set and not empty.
    pub fn otlp_endpoint(&self) -> Option<&str> {
        self.otlp_endpoint
            .as_deref()
            .map(str::trim)
            .filter(|endpoint| !endpoint.is_empty())
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

/// Sizes as plain bytes or with a unit (`256MiB`, `1 GB`).
pub mod sizes {
    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Number(u64),
        Text(String),
    }

    pub fn required<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        match Raw::deserialize(deserializer)? {
            Raw::Number(bytes) => Ok(bytes),
            Raw::Text(text) => parse(&text).map_err(serde::de::Error::custom),
        }
    }

    pub fn optional<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
        match Option::<Raw>::deserialize(deserializer)? {
            None => Ok(None),
            Some(Raw::Number(bytes)) => Ok(Some(bytes)),
            Some(Raw::Text(text)) => parse(&text).map(Some).map_err(serde::de::Error::custom),
        }
    }

    /// `"268435456"`, `"256MiB"`, `"1.5 GB"`, `"64k"` (binary units for
    /// `KiB`/`MiB`/`GiB`/`k`/`m`/`g`, decimal for `KB`/`MB`/`GB`).
    ///
    /// By hand, not bytesize: its serde support does not take the integers
    /// the `config` crate hands over for environment variables.
    pub fn parse(text: &str) -> Result<u64, String> {
        let text = text.trim();
        let split = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let number: f64 = number
            .parse()
            .map_err(|_| format!("'{text}' is not a size (e.g. 268435456 or 256MiB)"))?;
        let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" => 1 << 10,
            "m" | "mib" => 1 << 20,
            "g" | "gib" => 1 << 30,
            "t" | "tib" => 1 << 40,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            other => return Err(format!("unknown size unit '{other}' in '{text}'")),
        };
        Ok((number * multiplier as f64) as u64)
    }
}

/// Durations as plain milliseconds or text (`1s`, `250ms`).
pub mod durations {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Millis(u64),
        Text(String),
    }

    pub fn millis_or_text<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Duration, D::Error> {
        match Raw::deserialize(deserializer)? {
            Raw::Millis(millis) => Ok(Duration::from_millis(millis)),
            Raw::Text(text) => match text.trim().parse::<u64>() {
                Ok(millis) => Ok(Duration::from_millis(millis)),
                Err(_) => humantime::parse_duration(text.trim()).map_err(serde::de::Error::custom),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_plain_bytes_and_units() {
        assert_eq!(sizes::parse("268435456"), Ok(268_435_456));
        assert_eq!(sizes::parse("256MiB"), Ok(256 << 20));
        assert_eq!(sizes::parse("256 mib"), Ok(256 << 20));
        assert_eq!(sizes::parse("1GB"), Ok(1_000_000_000));
        assert_eq!(sizes::parse("1.5k"), Ok(1536));
        assert!(sizes::parse("lots").is_err());
        assert!(sizes::parse("12 parsecs").is_err());
    }

    #[test]
    fn the_broker_section_reads_from_a_file_with_units() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("spillway.toml");
        std::fs::write(
            &file,
            "[broker]\nflow_to_disk_threshold = \"32MiB\"\nhousekeeping_interval = \"250ms\"\n",
        )?;
        let settings = Settings::load(Some(&file))?;
        assert_eq!(settings.broker.flow_to_disk_threshold, Some(32 << 20));
        assert_eq!(
            settings.broker.housekeeping_interval,
            Duration::from_millis(250)
        );
        std::fs::write(
            &file,
            "[broker]\nflow_to_disk_threshold = 1048576\nhousekeeping_interval = 100\n",
        )?;
        let settings = Settings::load(Some(&file))?;
        assert_eq!(settings.broker.flow_to_disk_threshold, Some(1 << 20));
        assert_eq!(
            settings.broker.housekeeping_interval,
            Duration::from_millis(100)
        );
        Ok(())
    }
}
