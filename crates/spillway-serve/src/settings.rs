//! Configuration: built-in defaults ← `spillway.toml` (or `--config FILE`) ←
//! environment (`SPILLWAY_<SECTION>__<KEY>`, e.g.
//! `SPILLWAY_GATEWAY__AMQP_LISTEN=127.0.0.1:5672`). Every key is documented
//! in `docs/configuration.md`.
//!
//! Loading also refuses a configuration that cannot be meant: a key no
//! setting reads (named with where it was set and the nearest known key) and
//! a value out of its range. The known keys are the settings structs' own
//! fields, found through their `Deserialize` impls ([`keys`]), never a list.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use spillway_engine::EngineSettings;
use spillway_gateway::{GatewaySettings, TlsSettings};
use spillway_telemetry::formats::{durations, list_or_commas, sizes};

/// The largest `gateway.max_message_size`: RabbitMQ's own limit (512 MiB).
/// The engine keeps a queued body's size in 32 bits.
const MAX_MESSAGE_SIZE_LIMIT: u64 = 512 * 1024 * 1024;

pub mod aliases;

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct Settings {
    pub gateway: GatewaySettings,
    pub engine: EngineSettings,
    pub storage: StorageSettings,
    pub management: ManagementSettings,
    pub telemetry: TelemetrySettings,
    pub cluster: ClusterSettings,
}

/// How the separate processes of one broker recognise each other on the
/// internal gRPC services (`docs/security.md`). Not read by all-in-one.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ClusterSettings {
    /// Sent by every internal client: with `verifiers` set, the secret of
    /// this process's role; without, one secret every process shares (its
    /// role is then believed, so a separate role serves so on loopback
    /// only). After loading, this holds the secret read from `secret_file`
    /// too.
    pub secret: Option<spillway_proto::cluster::ClusterSecret>,
    /// A file holding the secret (surrounding whitespace ignored): what
    /// compose uses, so the secret appears in no environment.
    pub secret_file: Option<PathBuf>,
    /// Each role's verifier: the SHA-256 of its secret, in hex. Set on
    /// every process (they are not secret); a server checks each caller's
    /// secret against its role's.
    pub verifiers: ClusterVerifiers,
    /// Mutual TLS on every internal gRPC connection.
    pub tls: ClusterTlsSettings,
}

/// `cluster.verifiers`: per role, the SHA-256 of its secret (64 hex
/// digits). Unset: the role is proven another way, or not at all.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ClusterVerifiers {
    pub gateway: Option<String>,
    pub engine: Option<String>,
    pub storage: Option<String>,
    pub management: Option<String>,
}

impl ClusterVerifiers {
    fn get(&self, role: spillway_proto::cluster::ClusterRole) -> Option<&String> {
        use spillway_proto::cluster::ClusterRole;
        match role {
            ClusterRole::Gateway => self.gateway.as_ref(),
            ClusterRole::Engine => self.engine.as_ref(),
            ClusterRole::Storage => self.storage.as_ref(),
            ClusterRole::Management => self.management.as_ref(),
        }
    }

    /// The verifiers set, by role (values checked by the settings).
    pub fn table(
        &self,
    ) -> std::collections::BTreeMap<spillway_proto::cluster::ClusterRole, [u8; 32]> {
        spillway_proto::cluster::ClusterRole::ALL
            .into_iter()
            .filter_map(|role| {
                let verifier = crate::cluster::parse_verifier(self.get(role)?)?;
                Some((role, verifier))
            })
            .collect()
    }

    /// Whether any is set: per-role secrets are in force.
    pub fn any(&self) -> bool {
        spillway_proto::cluster::ClusterRole::ALL
            .into_iter()
            .any(|role| self.get(role).is_some())
    }
}

/// Mutual TLS between the separate processes (`cluster.tls`): PEM files, all
/// three or none. With them, the engine and storage serve internal gRPC over
/// TLS only and require a client certificate signed by `ca_file`; every
/// internal client presents `cert_file` and checks the server's certificate
/// against `ca_file`. Not read by all-in-one (it has no internal port).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ClusterTlsSettings {
    /// This process's certificate chain, leaf first: presented as a server
    /// and as a client, so it needs both extended key usages (serverAuth,
    /// clientAuth) and, as SANs, the host names the others dial it by.
    pub cert_file: Option<PathBuf>,
    /// Its private key.
    pub key_file: Option<PathBuf>,
    /// The cluster CA: every peer's certificate must chain to it.
    pub ca_file: Option<PathBuf>,
}

impl ClusterTlsSettings {
    /// Whether any of the three is set (then all three must be).
    pub fn is_set(&self) -> bool {
        self.cert_file.is_some() || self.key_file.is_some() || self.ca_file.is_some()
    }

    /// What is wrong with `cluster.tls`: a missing file, or one that cannot
    /// be used (each is read and checked as the servers will use it).
    fn check(&self) -> Vec<Range> {
        let mut found = Vec::new();
        if !self.is_set() {
            return found;
        }
        for (name, path) in [
            ("cert_file", &self.cert_file),
            ("key_file", &self.key_file),
            ("ca_file", &self.ca_file),
        ] {
            if path.is_none() {
                found.push(Range {
                    key: format!("cluster.tls.{name}"),
                    value: "unset".into(),
                    allowed: "a PEM file: cluster.tls needs cert_file, key_file and ca_file \
                              together"
                        .into(),
                });
            }
        }
        let (Some(cert_file), Some(key_file), Some(ca_file)) =
            (&self.cert_file, &self.key_file, &self.ca_file)
        else {
            return found;
        };
        let files = spillway_gateway::tls::TlsFiles {
            cert_file: cert_file.clone(),
            key_file: key_file.clone(),
            ca_file: Some(ca_file.clone()),
            verify_peer: true,
        };
        if let Err(error) = spillway_gateway::tls::server_config(&files) {
            use spillway_gateway::tls::TlsKey;
            let path = match error.key {
                TlsKey::CertFile | TlsKey::VerifyPeer => cert_file,
                TlsKey::KeyFile => key_file,
                TlsKey::CaFile => ca_file,
            };
            let name = match error.key {
                TlsKey::VerifyPeer => "cert_file",
                key => key.as_str(),
            };
            found.push(Range {
                key: format!("cluster.tls.{name}"),
                value: Quoted(&path.display().to_string()).to_string(),
                allowed: format!("a usable PEM file: {}", error.reason),
            });
        }
        found
    }

    /// The files' contents, for the internal servers and clients; `None`
    /// when `cluster.tls` is not set.
    pub fn load(&self) -> anyhow::Result<Option<spillway_proto::cluster::ClusterTls>> {
        use anyhow::Context;
        if !self.is_set() {
            return Ok(None);
        }
        let read = |name: &str, path: &Option<PathBuf>| -> anyhow::Result<Vec<u8>> {
            let path = path
                .as_ref()
                .with_context(|| format!("cluster.tls.{name} is not set"))?;
            std::fs::read(path)
                .with_context(|| format!("cluster.tls.{name}: cannot read {}", path.display()))
        };
        Ok(Some(spillway_proto::cluster::ClusterTls::new(
            read("ca_file", &self.ca_file)?,
            read("cert_file", &self.cert_file)?,
            read("key_file", &self.key_file)?,
        )))
    }
}

impl ClusterSettings {
    /// Checks the secret, reads it from `secret_file` when that is set, and
    /// returns what is wrong. Never shows the secret.
    fn resolve(&mut self) -> Vec<Range> {
        use spillway_proto::cluster::{ClusterSecret, MIN_SECRET_LEN};
        let allowed = format!("at least {MIN_SECRET_LEN} visible ASCII characters");
        let mut found = Vec::new();
        match (self.secret.clone(), self.secret_file.clone()) {
            (Some(_), Some(path)) => found.push(Range {
                key: "cluster.secret_file".into(),
                value: Quoted(&path.display().to_string()).to_string(),
                allowed: "unset while cluster.secret is set: give one of the two".into(),
            }),
            (Some(secret), None) => {
                let text = String::from_utf8_lossy(secret.expose()).into_owned();
                if let Err(error) = ClusterSecret::new(&text) {
                    found.push(Range {
                        key: "cluster.secret".into(),
                        value: format!("(not shown, {} bytes)", text.len()),
                        allowed: format!("{allowed}; {error}"),
                    });
                }
            }
            (None, Some(path)) => {
                let value = Quoted(&path.display().to_string()).to_string();
                match std::fs::read_to_string(path) {
                    Err(error) => found.push(Range {
                        key: "cluster.secret_file".into(),
                        value,
                        allowed: format!("a readable file holding the secret ({error})"),
                    }),
                    Ok(text) => match ClusterSecret::new(&text) {
                        Ok(secret) => self.secret = Some(secret),
                        Err(error) => found.push(Range {
                            key: "cluster.secret_file".into(),
                            value,
                            allowed: format!("a file holding {allowed}; in this one {error}"),
                        }),
                    },
                }
            }
            (None, None) => {}
        }
        for role in spillway_proto::cluster::ClusterRole::ALL {
            let Some(verifier) = self.verifiers.get(role) else {
                continue;
            };
            if crate::cluster::parse_verifier(verifier).is_none() {
                found.push(Range {
                    key: format!("cluster.verifiers.{role}"),
                    value: Quoted(verifier).to_string(),
                    allowed: format!(
                        "64 hex digits: the SHA-256 of the {role} role's secret \
                         (`tr -d '[:space:]' < SECRET_FILE | sha256sum`)"
                    ),
                });
            }
        }
        if self.verifiers.any() && self.secret.is_none() && self.secret_file.is_none() {
            found.push(Range {
                key: "cluster.secret_file".into(),
                value: "unset".into(),
                allowed: "this role's own secret, since cluster.verifiers is set".into(),
            });
        }
        found
    }
}

/// A listener's TLS (`gateway.tls`, `management.tls`) checked as the
/// listener will use it.
trait TlsCheck {
    fn check(&self, section: &str, needed_by: Option<&str>) -> Vec<Range>;
}

impl TlsCheck for TlsSettings {
    /// What is wrong with `section.tls` (`needed_by`: the setting that
    /// needs a certificate, if any). Every file is read and checked as the
    /// listener will use it, so a bad one stops start-up in every role.
    fn check(&self, section: &str, needed_by: Option<&str>) -> Vec<Range> {
        let key = |name: &str| format!("{section}.tls.{name}");
        let path = |path: &Option<PathBuf>| {
            path.as_ref().map_or("unset".to_string(), |path| {
                Quoted(&path.display().to_string()).to_string()
            })
        };
        let mut found = Vec::new();
        if !self.is_set() && needed_by.is_none() {
            return found;
        }
        if self.cert_file.is_none() {
            let why = match needed_by {
                Some(setting) => format!("{setting} is set"),
                None => format!("{section}.tls is set"),
            };
            found.push(Range {
                key: key("cert_file"),
                value: "unset".into(),
                allowed: format!("a PEM certificate file ({why})"),
            });
        }
        if self.key_file.is_none() && self.cert_file.is_some() {
            found.push(Range {
                key: key("key_file"),
                value: "unset".into(),
                allowed: format!("the PEM private key of {}", key("cert_file")),
            });
        }
        if self.verify_peer && self.ca_file.is_none() {
            found.push(Range {
                key: key("verify_peer"),
                value: "true".into(),
                allowed: format!(
                    "false unless {} is set (the CAs client certificates are checked against)",
                    key("ca_file")
                ),
            });
        }
        if !found.is_empty() {
            return found;
        }
        if let Some(files) = self.files() {
            if let Err(error) = spillway_gateway::tls::server_config(&files) {
                use spillway_gateway::tls::TlsKey;
                let value = match error.key {
                    TlsKey::CertFile => path(&self.cert_file),
                    TlsKey::KeyFile => path(&self.key_file),
                    TlsKey::CaFile => path(&self.ca_file),
                    TlsKey::VerifyPeer => self.verify_peer.to_string(),
                };
                found.push(Range {
                    key: key(error.key.as_str()),
                    value,
                    allowed: format!("a usable PEM file: {}", error.reason),
                });
            }
        }
        found
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct StorageSettings {
    /// The storage node's gRPC address for the engine, when it runs alone.
    pub listen: String,
    /// Where RocksDB keeps its files.
    pub data_dir: PathBuf,
    /// Create a new store when `data_dir` holds none. False: refuse to
    /// start (a data volume that is not mounted must not look like an
    /// empty broker).
    pub create_if_missing: bool,
    /// The disk quota (Qpid's `store.*` names): bytes on disk above which
    /// every producer is blocked (`MST-1008`). Unset: none.
    #[serde(deserialize_with = "sizes::optional")]
    pub overfull_size: Option<u64>,
    /// Bytes on disk below which they are released again (`MST-1009`).
    /// Unset: the overfull size.
    #[serde(deserialize_with = "sizes::optional")]
    pub underfull_size: Option<u64>,
    /// This node's id in its storage group (`docs/replication.md`); unique
    /// in the group, not 0.
    pub node_id: u64,
    /// The storage group's initial members: node id → the address the
    /// others reach that node's `storage.listen` at (`http://host:port`).
    /// Every member gets the same table. Empty: a single store, no group.
    pub members: BTreeMap<String, String>,
    /// How often a group's leader tells the others it leads; they elect
    /// another after four to eight of these without word.
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub group_heartbeat: Duration,
    /// Log entries between a group's snapshots (the log is purged up to
    /// one; a member far behind catches up from it).
    pub group_snapshot_entries: u64,
    /// This node joins a storage group that runs already (added with
    /// `spillctl storage add-member`): it does not form one from
    /// `storage.members`, which then needs to name only this node.
    pub join: bool,
}

impl StorageSettings {
    /// The storage group this node belongs to, if `storage.members` is set.
    pub fn group(&self) -> Result<Option<spillway_storage::GroupSettings>, String> {
        if self.members.is_empty() {
            return Ok(None);
        }
        let mut members = BTreeMap::new();
        for (id, address) in &self.members {
            let id: u64 = id.parse().map_err(|_| {
                format!("storage.members: `{id}` is not a node id (a positive integer)")
            })?;
            if id == 0 {
                return Err("storage.members: node id 0 is not allowed".into());
            }
            members.insert(id, address.clone());
        }
        if !members.contains_key(&self.node_id) {
            return Err(format!(
                "storage.node_id {} is not one of storage.members ({})",
                self.node_id,
                members
                    .keys()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Ok(Some(spillway_storage::GroupSettings {
            node_id: self.node_id,
            members,
            heartbeat: self.group_heartbeat,
            snapshot_entries: self.group_snapshot_entries,
            join: self.join,
        }))
    }
}

impl Default for StorageSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50071".into(),
            data_dir: PathBuf::from("./data"),
            create_if_missing: true,
            overfull_size: None,
            underfull_size: None,
            node_id: 0,
            members: BTreeMap::new(),
            group_heartbeat: Duration::from_millis(250),
            group_snapshot_entries: 5_000,
            join: false,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct ManagementSettings {
    /// The public management gRPC API.
    pub listen: String,
    /// RabbitMQ's management HTTP API (`/api/...`, docs/http-api.md);
    /// empty: not served. RabbitMQ's port is 15672.
    pub http_listen: String,
    /// How often the HTTP API samples message rates (RabbitMQ's
    /// `collect_statistics_interval`).
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub http_sample_interval: Duration,
    /// The storage node's gRPC address, when management runs alone.
    pub storage_addr: String,
    /// Every member of a storage group, as `engine.storage_addrs`.
    #[serde(deserialize_with = "list_or_commas")]
    pub storage_addrs: Vec<String>,
    /// The engine's gRPC address (its admin API), when management runs alone.
    pub engine_addr: String,
    /// Every engine, when several run: calls go to the one that answers,
    /// as `gateway.engine_addrs`. Empty: `engine_addr` alone.
    #[serde(deserialize_with = "list_or_commas")]
    pub engine_addrs: Vec<String>,
    /// A bearer token accepted from anywhere (`authorization: Bearer
    /// <token>`). Unset: no token is accepted.
    pub token: Option<String>,
    /// Operators accepted with HTTP basic credentials, besides the stored
    /// users. Default: none (the stored guest, loopback only, is the
    /// default login, and goes when it is deleted).
    pub users: Vec<spillway_management::ManagementUser>,
    /// TLS for the management API: set a certificate and key and it serves
    /// only TLS (`https://`).
    pub tls: TlsSettings,
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
            http_listen: "127.0.0.1:15672".into(),
            http_sample_interval: Duration::from_secs(5),
            storage_addr: "http://127.0.0.1:50071".into(),
            storage_addrs: Vec::new(),
            engine_addr: "http://127.0.0.1:50061".into(),
            engine_addrs: Vec::new(),
            token: None,
            // None: the stored users (the configuration's guest seeds an
            // empty store) are management's users, so deleting or changing
            // the stored guest is the whole story.
            users: Vec::new(),
            tls: TlsSettings::default(),
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
            log_level: "info,openraft=warn".into(),
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

/// The name every configuration environment variable starts with (case
/// does not matter, as for the rest of the name).
const ENV_PREFIX: &str = "SPILLWAY_";
/// Between section and key in a configuration environment variable; a
/// `SPILLWAY_` variable without it is some other program's (`SPILLWAY_BIN`).
const ENV_SEPARATOR: &str = "__";

/// A configuration Spillway refuses to start with.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A layer could not be read at all: a missing `--config` file, a TOML
    /// syntax error, a variable whose value is not Unicode.
    #[error("reading the configuration from {origin}: {error}")]
    Read {
        origin: Origin,
        error: Box<config::ConfigError>,
    },
    /// The layers could not be combined (should not happen once each layer
    /// read on its own).
    #[error("invalid configuration: {0}")]
    Merge(Box<config::ConfigError>),
    /// Every problem found, unknown keys and bad values alike.
    #[error("invalid configuration:{}", problem_list(.0))]
    Invalid(Vec<Problem>),
}

fn problem_list(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|problem| format!("\n  - {problem}"))
        .collect()
}

/// Where a value was set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    File(PathBuf),
    /// The environment variable's name exactly as set.
    Env(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File(path) => write!(f, "{}", path.display()),
            Origin::Env(name) => write!(f, "environment variable {name}"),
        }
    }
}

/// One thing wrong with the configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// A key (or a whole section) that no setting reads.
    UnknownKey {
        /// The full key: `gateway.heartbeat_timout`, `gateway.users[1].nme`.
        key: String,
        origin: Origin,
        /// The nearest known key, when one is close.
        suggestion: Option<String>,
    },
    /// A value of the wrong type or format (`frame_max = "big"`, `12 parsecs`).
    BadValue { origin: Origin, error: String },
    /// One key set under its name and under an alias of it in one layer
    /// (`broker.consumer_timeout` and `engine.consumer_timeout`).
    SetTwice {
        alias: String,
        name: String,
        origin: Origin,
    },
    /// A value of the right type outside what the setting allows.
    OutOfRange {
        key: String,
        value: String,
        allowed: String,
        /// Where it was set (none: the layers do not say, e.g. a list entry
        /// whose index moved).
        origin: Option<Origin>,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::UnknownKey {
                key,
                origin,
                suggestion,
            } => {
                let what = if key.contains(['.', '[']) {
                    "key"
                } else {
                    "section"
                };
                write!(f, "unknown {what} `{key}` in {origin}")?;
                match (suggestion, origin) {
                    (None, _) => Ok(()),
                    (Some(known), Origin::Env(_)) => {
                        write!(f, "; did you mean {} (`{known}`)?", env_name(known))
                    }
                    (Some(known), Origin::File(_)) => write!(f, "; did you mean `{known}`?"),
                }
            }
            Problem::BadValue { origin, error } => write!(f, "in {origin}: {error}"),
            Problem::SetTwice {
                alias,
                name,
                origin,
            } => {
                match origin {
                    Origin::File(path) => {
                        write!(f, "`{alias}` and `{name}` both set in {}", path.display())?
                    }
                    Origin::Env(_) => write!(
                        f,
                        "environment variables {} and {} both set",
                        env_name(alias),
                        env_name(name)
                    )?,
                }
                write!(
                    f,
                    ": `{alias}` is another name of `{name}`; set one of them"
                )
            }
            Problem::OutOfRange {
                key,
                value,
                allowed,
                origin,
            } => {
                write!(f, "`{key}` = {value}")?;
                if let Some(origin) = origin {
                    write!(f, " (in {origin})")?;
                }
                write!(f, " is out of range: {allowed}")
            }
        }
    }
}

/// `gateway.heartbeat` → `SPILLWAY_GATEWAY__HEARTBEAT`.
fn env_name(key: &str) -> String {
    format!(
        "{ENV_PREFIX}{}",
        key.split('.')
            .map(str::to_ascii_uppercase)
            .collect::<Vec<_>>()
            .join(ENV_SEPARATOR)
    )
}

/// A configuration environment variable: its name as set, its key
/// (`gateway.heartbeat`) and its value.
struct EnvVar {
    name: String,
    key: String,
    value: OsString,
}

/// The `SPILLWAY_<SECTION>__<KEY>` variables among `vars`; any other
/// (`SPILLWAY_BIN`, `SPILLWAY_REGENERATE_PROTO`, `PATH`) is not configuration.
fn config_vars(vars: impl IntoIterator<Item = (OsString, OsString)>) -> Vec<EnvVar> {
    vars.into_iter()
        .filter_map(|(name, value)| {
            let name = name.into_string().ok()?;
            let prefix = name.get(..ENV_PREFIX.len())?;
            let rest = name.get(ENV_PREFIX.len()..)?;
            if !prefix.eq_ignore_ascii_case(ENV_PREFIX) || !rest.contains(ENV_SEPARATOR) {
                return None;
            }
            let key = rest.to_lowercase().replace(ENV_SEPARATOR, ".");
            Some(EnvVar { name, key, value })
        })
        .collect()
}

/// The `config` source for `vars`, read the way the documentation says.
fn env_source<'a>(vars: impl IntoIterator<Item = &'a EnvVar>) -> config::Environment {
    let mut map = config::Map::new();
    for var in vars {
        // Lossy only for a value already reported as not Unicode.
        map.insert(var.name.clone(), var.value.to_string_lossy().into_owned());
    }
    config::Environment::with_prefix("SPILLWAY")
        .prefix_separator("_")
        .separator(ENV_SEPARATOR)
        .try_parsing(true)
        .source(Some(map))
}

/// One layer, built (sections as tables) and its aliases moved to their own
/// names.
fn canonical_layer(
    source: impl config::Source + Send + Sync + 'static,
    origin: &Origin,
) -> Result<aliases::Canonical, SettingsError> {
    let read_error = |error| SettingsError::Read {
        origin: origin.clone(),
        error: Box::new(error),
    };
    let layer = config::Config::builder()
        .add_source(source)
        .build()
        .map_err(read_error)?;
    Ok(aliases::canonical(
        config::Source::collect(&layer).map_err(read_error)?,
    ))
}

/// Reads one layer on its own, its aliases moved to their own names
/// ([`aliases`]): a [`Problem`] for each key in it no setting reads, for a
/// key it sets under two names, and for a value that does not deserialise.
/// The unknown keys come back as the layer wrote them.
fn check_layer(
    source: impl config::Source + Send + Sync + 'static,
    origin: &Origin,
    problems: &mut Vec<Problem>,
) -> Result<(aliases::Canonical, Vec<String>), SettingsError> {
    let layer = canonical_layer(source, origin)?;
    for twice in &layer.twice {
        problems.push(Problem::SetTwice {
            alias: twice.alias.clone(),
            name: twice.name.clone(),
            origin: origin.clone(),
        });
    }
    let mut ignored = Vec::new();
    let read: Result<Settings, _> = serde_ignored::deserialize(layer.value(), |path| {
        ignored.push(keys::render(&keys::segments(&path)))
    });
    if let Err(error) = read {
        problems.push(Problem::BadValue {
            origin: origin.clone(),
            error: error.to_string(),
        });
    }
    let ignored = ignored.iter().map(|key| layer.as_written(key)).collect();
    Ok((layer, ignored))
}

/// `key` (as written, aliases included) as an unknown key of `origin`, with
/// the nearest known key written the same way.
fn unknown_key(key: &str, origin: &Origin) -> Problem {
    let (name, alias) = aliases::resolve(key);
    let suggestion = keys::suggest::<Settings>(&keys::parse(&name)).map(|known| {
        let known = keys::render(&known);
        match alias {
            Some((alias, name)) => aliases::written_as(&known, name, alias),
            None => known,
        }
    });
    Problem::UnknownKey {
        key: key.to_string(),
        origin: origin.clone(),
        suggestion,
    }
}

impl Settings {
    /// Defaults ← the file (when given, or `spillway.toml` when present) ←
    /// `SPILLWAY_<SECTION>__<KEY>` environment variables; refused with every
    /// unknown key and out-of-range value named.
    pub fn load(file: Option<&Path>) -> Result<Self, SettingsError> {
        Self::load_with_env(file, std::env::vars_os())
    }

    /// [`Settings::load`] with these environment variables instead of the
    /// process's.
    pub fn load_with_env(
        file: Option<&Path>,
        vars: impl IntoIterator<Item = (OsString, OsString)>,
    ) -> Result<Self, SettingsError> {
        let mut problems = Vec::new();
        let (file_path, file_source) = match file {
            Some(path) => (
                path.to_path_buf(),
                config::File::from(path)
                    .format(config::FileFormat::Toml)
                    .required(true),
            ),
            None => {
                let path = PathBuf::from("spillway.toml");
                let source = config::File::from(path.as_path())
                    .format(config::FileFormat::Toml)
                    .required(false);
                (path, source)
            }
        };
        let file_origin = Origin::File(file_path);
        let (file_layer, mut ignored) = check_layer(file_source, &file_origin, &mut problems)?;
        // The `config` crate keeps keys in a hash map: sorted, the report
        // does not change from one start to the next.
        ignored.sort();
        for key in &ignored {
            problems.push(unknown_key(key, &file_origin));
        }

        let vars = config_vars(vars);
        for var in &vars {
            let origin = Origin::Env(var.name.clone());
            if var.value.to_str().is_none() {
                problems.push(Problem::BadValue {
                    origin,
                    error: "the value is not valid Unicode".into(),
                });
                continue;
            }
            let (_, ignored) = check_layer(env_source([var]), &origin, &mut problems)?;
            if !ignored.is_empty() {
                // The variable's own key, not the ignored part of it: for
                // `SPILLWAY_GATWAY__HEARTBEAT` that is `gatway.heartbeat`,
                // whose nearest known key is `gateway.heartbeat`.
                problems.push(unknown_key(&var.key, &origin));
            }
        }
        // Two variables naming one key under its two names.
        let env_layer = canonical_layer(env_source(&vars), &Origin::Env(ENV_PREFIX.into()))?;
        for twice in &env_layer.twice {
            problems.push(Problem::SetTwice {
                alias: twice.alias.clone(),
                name: twice.name.clone(),
                origin: Origin::Env(ENV_PREFIX.into()),
            });
        }
        if !problems.is_empty() {
            return Err(SettingsError::Invalid(problems));
        }

        let file_layer = config::Config::builder()
            .add_source(file_layer)
            .build()
            .map_err(|error| SettingsError::Merge(Box::new(error)))?;
        let settings: Settings = config::Config::builder()
            .add_source(file_layer.clone())
            .add_source(env_layer)
            .build()
            .and_then(config::Config::try_deserialize)
            .map_err(|error| SettingsError::Merge(Box::new(error)))?;
        let origin_of = |key: &str| {
            vars.iter()
                .rev()
                .find(|var| aliases::resolve(&var.key).0 == key)
                .map(|var| Origin::Env(var.name.clone()))
                .or_else(|| {
                    file_layer
                        .get::<config::Value>(key)
                        .is_ok()
                        .then(|| file_origin.clone())
                })
        };
        let mut settings = settings;
        let mut ranges = settings.out_of_range();
        ranges.extend(settings.cluster.resolve());
        let problems: Vec<_> = ranges
            .into_iter()
            .map(|range| Problem::OutOfRange {
                origin: origin_of(&range.key),
                key: range.key,
                value: range.value,
                allowed: range.allowed,
            })
            .collect();
        if !problems.is_empty() {
            return Err(SettingsError::Invalid(problems));
        }
        Ok(settings)
    }

    /// Every value outside what its setting allows. Only what the
    /// documentation gives no meaning: `0` stays valid where it means "off".
    fn out_of_range(&self) -> Vec<Range> {
        let mut found = Vec::new();
        let mut check = |ok: bool, key: &str, value: &dyn fmt::Display, allowed: &str| {
            if !ok {
                found.push(Range {
                    key: key.to_string(),
                    value: value.to_string(),
                    allowed: allowed.to_string(),
                });
            }
        };
        let gateway = &self.gateway;
        match (gateway.amqp_listen(), gateway.amqps_listen()) {
            (None, None) => check(
                false,
                "gateway.amqp_listen",
                &Quoted(&gateway.amqp_listen),
                "a literal IP:port, e.g. \"0.0.0.0:5672\" (empty only with \
                 gateway.amqps_listen set)",
            ),
            (None, Some(_)) => {}
            (Some(listen), _) => check(
                listen.parse::<SocketAddr>().is_ok(),
                "gateway.amqp_listen",
                &Quoted(&gateway.amqp_listen),
                "a literal IP:port, e.g. \"0.0.0.0:5672\"",
            ),
        }
        if let Some(listen) = gateway.amqps_listen() {
            check(
                listen.parse::<SocketAddr>().is_ok(),
                "gateway.amqps_listen",
                &Quoted(listen),
                "a literal IP:port, e.g. \"0.0.0.0:5671\"",
            );
        }
        check(
            gateway.frame_max >= spillway_amqp::codec::MIN_FRAME_MAX,
            "gateway.frame_max",
            &gateway.frame_max,
            "at least 4096 (AMQP's smallest frame)",
        );
        check(
            gateway.channel_max >= 1,
            "gateway.channel_max",
            &gateway.channel_max,
            "1 to 65535",
        );
        check(
            gateway.max_heartbeat == 0 || gateway.min_heartbeat <= gateway.max_heartbeat,
            "gateway.min_heartbeat",
            &gateway.min_heartbeat,
            "at most gateway.max_heartbeat",
        );
        check(
            gateway.heartbeat_refusal(gateway.heartbeat).is_none(),
            "gateway.heartbeat",
            &gateway.heartbeat,
            "within gateway.min_heartbeat and gateway.max_heartbeat (0 = off only without a maximum)",
        );
        check(
            (1..=MAX_MESSAGE_SIZE_LIMIT).contains(&gateway.max_message_size),
            "gateway.max_message_size",
            &gateway.max_message_size,
            "from 1 byte to 512 MiB (RabbitMQ's limit)",
        );
        check(
            !gateway.handshake_timeout.is_zero(),
            "gateway.handshake_timeout",
            &Millis(gateway.handshake_timeout),
            "more than 0",
        );
        check_users(
            "engine.users",
            self.engine.users.iter().map(|user| user.name.as_str()),
            &mut check,
        );
        check(
            self.engine.flow_to_disk_threshold != Some(0),
            "engine.flow_to_disk_threshold",
            &0,
            "at least 1 byte, or unset for 40% of the memory available",
        );
        if let Some(watermark) = self.engine.memory_high_watermark.filter(|w| *w != 0) {
            let threshold = self.engine.flow_to_disk_threshold();
            check(
                watermark > threshold,
                "engine.memory_high_watermark",
                &watermark,
                &format!(
                    "above engine.flow_to_disk_threshold ({threshold} bytes), so that \
                     payloads flow to disk before publishers are blocked; 0 turns it off"
                ),
            );
        }
        check(
            !self.engine.publisher_pacing_stall.is_zero(),
            "engine.publisher_pacing_stall",
            &Millis(self.engine.publisher_pacing_stall),
            "more than 0",
        );
        check(
            self.engine.store_writer_max_writes >= 1,
            "engine.store_writer_max_writes",
            &self.engine.store_writer_max_writes,
            "at least 1",
        );
        check(
            self.engine.store_writer_max_bytes >= 1024,
            "engine.store_writer_max_bytes",
            &self.engine.store_writer_max_bytes,
            "at least 1024 bytes",
        );
        check(
            !self.storage.data_dir.as_os_str().is_empty(),
            "storage.data_dir",
            &"\"\"",
            "a directory",
        );
        check_users(
            "management.users",
            self.management.users.iter().map(|user| user.name.as_str()),
            &mut check,
        );
        let telemetry = &self.telemetry;
        check(
            ["text", "json"].contains(&telemetry.log_format.as_str()),
            "telemetry.log_format",
            &Quoted(&telemetry.log_format),
            "\"text\" or \"json\"",
        );
        if let Some(listen) = &telemetry.metrics_listen {
            check(
                listen.parse::<SocketAddr>().is_ok(),
                "telemetry.metrics_listen",
                &Quoted(listen),
                "a literal IP:port, e.g. \"127.0.0.1:9471\"",
            );
        }
        found.extend(self.addresses_out_of_range());
        let needed_by = gateway.amqps_listen().map(|_| "gateway.amqps_listen");
        found.extend(gateway.tls.check("gateway", needed_by));
        found.extend(self.management.tls.check("management", None));
        found.extend(self.cluster.tls.check());
        found
    }
}

/// What a dialled address must look like, for the refusal's text.
const DIALLED: &str = "an address with its scheme, http://host:port (https://host:port with \
                       cluster.tls), e.g. \"http://127.0.0.1:50061\"";

/// What a gRPC listen address must look like, for the refusal's text.
const LISTENED: &str = "host:port (an IP address or a host name, and a port; no scheme), \
                        e.g. \"127.0.0.1:50061\"";

impl Settings {
    /// Every address a role dials (another component, a storage group
    /// member, the OTLP collector) and every gRPC listen address, checked
    /// for its form before anything starts: an address without its scheme
    /// (`127.0.0.1:5000` for `http://127.0.0.1:5000`) would otherwise be
    /// accepted and fail every second for ever as a transport error.
    fn addresses_out_of_range(&self) -> Vec<Range> {
        let mut found = Vec::new();
        let mut dialled = |key: String, addr: &str, needs_port: bool| {
            if dialled_address_is_usable(addr, needs_port) {
                return;
            }
            let allowed = if needs_port {
                DIALLED
            } else {
                "an http:// or https:// URL, e.g. \"http://127.0.0.1:4317\""
            };
            found.push(Range {
                key,
                value: Quoted(addr).to_string(),
                allowed: allowed.to_string(),
            });
        };
        // One address, or a list that replaces it when not empty.
        let one_or_list = [
            (
                "gateway.engine_addr",
                &self.gateway.engine_addr,
                "gateway.engine_addrs",
                &self.gateway.engine_addrs,
            ),
            (
                "engine.storage_addr",
                &self.engine.storage_addr,
                "engine.storage_addrs",
                &self.engine.storage_addrs,
            ),
            (
                "management.storage_addr",
                &self.management.storage_addr,
                "management.storage_addrs",
                &self.management.storage_addrs,
            ),
            (
                "management.engine_addr",
                &self.management.engine_addr,
                "management.engine_addrs",
                &self.management.engine_addrs,
            ),
        ];
        for (one_key, one, list_key, list) in one_or_list {
            if list.is_empty() {
                dialled(one_key.to_string(), one, true);
            }
            for addr in list {
                dialled(list_key.to_string(), addr, true);
            }
        }
        for (id, addr) in &self.storage.members {
            dialled(format!("storage.members.{id}"), addr, true);
        }
        if let Some(endpoint) = self.telemetry.otlp_endpoint() {
            dialled("telemetry.otlp_endpoint".to_string(), endpoint, false);
        }
        for (key, listen) in [
            ("engine.listen", &self.engine.listen),
            ("storage.listen", &self.storage.listen),
            ("management.listen", &self.management.listen),
        ] {
            if !listen_address_is_usable(listen) {
                found.push(Range {
                    key: key.to_string(),
                    value: Quoted(listen).to_string(),
                    allowed: LISTENED.to_string(),
                });
            }
        }
        let http_listen = self.management.http_listen.trim();
        if !http_listen.is_empty() && http_listen.parse::<SocketAddr>().is_err() {
            found.push(Range {
                key: "management.http_listen".to_string(),
                value: Quoted(&self.management.http_listen).to_string(),
                allowed: "a literal IP:port, e.g. \"127.0.0.1:15672\", or empty for none"
                    .to_string(),
            });
        }
        found
    }
}

/// Whether `addr` is a URI a gRPC client can dial: scheme `http` or
/// `https`, a host, (with `needs_port`) a port, and no path beyond `/`.
fn dialled_address_is_usable(addr: &str, needs_port: bool) -> bool {
    let Ok(uri) = addr.trim().parse::<tonic::codegen::http::Uri>() else {
        return false;
    };
    let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
    let Some(authority) = uri.authority() else {
        return false;
    };
    let host_ok = !authority.host().is_empty() && !authority.as_str().contains('@');
    let port_ok = !needs_port || authority.port_u16().is_some_and(|port| port != 0);
    let path_ok = matches!(uri.path(), "" | "/") && uri.query().is_none();
    scheme_ok && host_ok && port_ok && path_ok
}

/// Whether `listen` is `host:port` as a listener binds it (the host an IP
/// address, `[v6]`, or a name to resolve; port 0 picks one).
fn listen_address_is_usable(listen: &str) -> bool {
    if listen.parse::<SocketAddr>().is_ok() {
        return true;
    }
    let Some((host, port)) = listen.rsplit_once(':') else {
        return false;
    };
    let host_ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'));
    host_ok && port.parse::<u16>().is_ok()
}

/// Each user's name must be set and used once.
fn check_users<'a>(
    list: &str,
    names: impl Iterator<Item = &'a str>,
    check: &mut impl FnMut(bool, &str, &dyn fmt::Display, &str),
) {
    let mut seen: Vec<&str> = Vec::new();
    for (index, name) in names.enumerate() {
        let key = format!("{list}[{index}].name");
        check(!name.is_empty(), &key, &Quoted(name), "a name");
        if let Some(first) = seen.iter().position(|seen| *seen == name) {
            check(
                false,
                &key,
                &Quoted(name),
                &format!("a name not already given to {list}[{first}]"),
            );
        }
        seen.push(name);
    }
}

/// An out-of-range value, before its origin is looked up.
struct Range {
    key: String,
    value: String,
    allowed: String,
}

struct Quoted<'a>(&'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

struct Millis(Duration);

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.as_millis())
    }
}

/// The keys the settings read, found by walking the settings structs'
/// `Deserialize` impls: each struct hands serde its field names, so a new
/// field is a known key without anything else to update.
pub mod keys {
    use std::cell::Cell;
    use std::fmt;

    use serde::de::value::StrDeserializer;
    use serde::de::{self, DeserializeOwned, Visitor};

    /// One step of a key: a field, or an entry of a list.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub enum Segment {
        Key(String),
        /// An entry of a list; `None` is any entry.
        Index(Option<usize>),
    }

    /// `gateway.users[1].name`.
    pub fn render(path: &[Segment]) -> String {
        let mut out = String::new();
        for segment in path {
            match segment {
                Segment::Key(key) => {
                    if !out.is_empty() {
                        out.push('.');
                    }
                    out.push_str(key);
                }
                Segment::Index(Some(index)) => out.push_str(&format!("[{index}]")),
                Segment::Index(None) => out.push_str("[]"),
            }
        }
        out
    }

    /// The steps of a rendered key: the reverse of [`render`].
    pub fn parse(key: &str) -> Vec<Segment> {
        let mut out = Vec::new();
        for part in key.split('.') {
            let mut pieces = part.split('[');
            if let Some(name) = pieces.next().filter(|name| !name.is_empty()) {
                out.push(Segment::Key(name.to_string()));
            }
            for index in pieces {
                let index = index.trim_end_matches(']');
                out.push(Segment::Index(index.parse().ok()));
            }
        }
        out
    }

    /// The steps of a path `serde_ignored` reports.
    pub fn segments(path: &serde_ignored::Path<'_>) -> Vec<Segment> {
        let mut out = match path {
            serde_ignored::Path::Root => return Vec::new(),
            serde_ignored::Path::Seq { parent, .. }
            | serde_ignored::Path::Map { parent, .. }
            | serde_ignored::Path::Some { parent }
            | serde_ignored::Path::NewtypeStruct { parent }
            | serde_ignored::Path::NewtypeVariant { parent } => segments(parent),
        };
        match path {
            serde_ignored::Path::Seq { index, .. } => out.push(Segment::Index(Some(*index))),
            serde_ignored::Path::Map { key, .. } => out.push(Segment::Key(key.clone())),
            _ => {}
        }
        out
    }

    /// The fields of the struct `T` has at `path`, if it has one there.
    pub fn fields_at<T: DeserializeOwned>(path: &[Segment]) -> Option<&'static [&'static str]> {
        let found = Cell::new(None);
        let _ = T::deserialize(Walker {
            rest: path,
            found: &found,
        });
        found.get()
    }

    /// `path` with each unknown step replaced by the closest known one at
    /// its place, when every unknown step has a close one.
    pub fn suggest<T: DeserializeOwned>(path: &[Segment]) -> Option<Vec<Segment>> {
        let mut known = Vec::new();
        for segment in path {
            match segment {
                Segment::Index(_) => known.push(segment.clone()),
                Segment::Key(key) => {
                    let fields = fields_at::<T>(&known)?;
                    let nearest = if fields.contains(&key.as_str()) {
                        key.as_str()
                    } else {
                        nearest(key, fields)?
                    };
                    known.push(Segment::Key(nearest.to_string()));
                }
            }
        }
        (known != path).then_some(known)
    }

    /// The field most like `key`, if it is alike enough to be a slip.
    fn nearest<'a>(key: &str, fields: &[&'a str]) -> Option<&'a str> {
        let key = key.to_lowercase();
        fields
            .iter()
            .map(|field| (strsim::jaro_winkler(&key, field), *field))
            .filter(|(likeness, _)| *likeness >= 0.8)
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, field)| field)
    }

    /// Presents `T` a document that holds only `rest`, and notes the fields
    /// of the struct found at its end. Every path ends in an error: no value
    /// is ever made, so no setting's type or validation matters.
    struct Walker<'a> {
        rest: &'a [Segment],
        found: &'a Cell<Option<&'static [&'static str]>>,
    }

    #[derive(Debug)]
    struct Stop;

    impl fmt::Display for Stop {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("walked")
        }
    }

    impl std::error::Error for Stop {}

    impl de::Error for Stop {
        fn custom<T: fmt::Display>(_: T) -> Self {
            Stop
        }
    }

    impl<'de> de::Deserializer<'de> for Walker<'_> {
        type Error = Stop;

        fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Stop> {
            match self.rest.split_first() {
                Some((Segment::Key(key), rest)) => visitor.visit_map(Entry {
                    key: Some(key.as_str()),
                    value: Some(Walker {
                        rest,
                        found: self.found,
                    }),
                }),
                Some((Segment::Index(_), rest)) => visitor.visit_seq(Element(Some(Walker {
                    rest,
                    found: self.found,
                }))),
                None => Err(Stop),
            }
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            visitor: V,
        ) -> Result<V::Value, Stop> {
            if self.rest.is_empty() {
                self.found.set(Some(fields));
                return Err(Stop);
            }
            self.deserialize_any(visitor)
        }

        fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Stop> {
            visitor.visit_some(self)
        }

        fn deserialize_newtype_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            visitor: V,
        ) -> Result<V::Value, Stop> {
            visitor.visit_newtype_struct(self)
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf unit unit_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }

    struct Entry<'a> {
        key: Option<&'a str>,
        value: Option<Walker<'a>>,
    }

    impl<'de> de::MapAccess<'de> for Entry<'_> {
        type Error = Stop;

        fn next_key_seed<K: de::DeserializeSeed<'de>>(
            &mut self,
            seed: K,
        ) -> Result<Option<K::Value>, Stop> {
            match self.key.take() {
                Some(key) => seed
                    .deserialize(StrDeserializer::<Stop>::new(key))
                    .map(Some),
                None => Ok(None),
            }
        }

        fn next_value_seed<V: de::DeserializeSeed<'de>>(
            &mut self,
            seed: V,
        ) -> Result<V::Value, Stop> {
            match self.value.take() {
                Some(walker) => seed.deserialize(walker),
                None => Err(Stop),
            }
        }
    }

    struct Element<'a>(Option<Walker<'a>>);

    impl<'de> de::SeqAccess<'de> for Element<'_> {
        type Error = Stop;

        fn next_element_seed<T: de::DeserializeSeed<'de>>(
            &mut self,
            seed: T,
        ) -> Result<Option<T::Value>, Stop> {
            match self.0.take() {
                Some(walker) => seed.deserialize(walker).map(Some),
                None => Ok(None),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_section_reads_from_a_file_with_units() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("spillway.toml");
        std::fs::write(
            &file,
            "[engine]\nflow_to_disk_threshold = \"32MiB\"\nhousekeeping_interval = \"250ms\"\n",
        )?;
        let settings = Settings::load(Some(&file))?;
        assert_eq!(settings.engine.flow_to_disk_threshold, Some(32 << 20));
        assert_eq!(
            settings.engine.housekeeping_interval,
            Duration::from_millis(250)
        );
        std::fs::write(
            &file,
            "[engine]\nflow_to_disk_threshold = 1048576\nhousekeeping_interval = 100\n",
        )?;
        let settings = Settings::load(Some(&file))?;
        assert_eq!(settings.engine.flow_to_disk_threshold, Some(1 << 20));
        assert_eq!(
            settings.engine.housekeeping_interval,
            Duration::from_millis(100)
        );
        Ok(())
    }

    #[test]
    fn qpid_section_names_are_read_as_the_owning_sections() -> anyhow::Result<()> {
        let (_, result) = load(
            "[broker]\nflow_to_disk_threshold = \"32MiB\"\nconsumer_timeout = \"5s\"\n\
             [store]\noverfull_size = \"1GiB\"\n\
             [[gateway.users]]\nname = \"app\"\npassword = \"p\"\n",
            &[
                ("SPILLWAY_BROKER__SESSION_CREDIT", "7"),
                ("SPILLWAY_STORE__UNDERFULL_SIZE", "1000"),
            ],
        );
        let settings = result?;
        assert_eq!(settings.engine.flow_to_disk_threshold, Some(32 << 20));
        assert_eq!(settings.engine.consumer_timeout, Duration::from_secs(5));
        assert_eq!(settings.engine.session_credit, 7);
        assert_eq!(settings.storage.overfull_size, Some(1 << 30));
        assert_eq!(settings.storage.underfull_size, Some(1000));
        let users: Vec<_> = settings.engine.users.iter().map(|u| &u.name).collect();
        assert_eq!(users, ["app"]);
        Ok(())
    }

    #[test]
    fn a_key_set_under_both_its_names_in_one_layer_is_refused() {
        let (file, result) = load(
            "[broker]\nconsumer_timeout = 5\n[engine]\nconsumer_timeout = 6\n",
            &[
                ("SPILLWAY_STORE__OVERFULL_SIZE", "1"),
                ("SPILLWAY_STORAGE__OVERFULL_SIZE", "2"),
            ],
        );
        let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
        assert_eq!(
            lines,
            [
                format!(
                    "`broker.consumer_timeout` and `engine.consumer_timeout` both set in {}: \
                     `broker.consumer_timeout` is another name of `engine.consumer_timeout`; \
                     set one of them",
                    file.display()
                ),
                "environment variables SPILLWAY_STORE__OVERFULL_SIZE and \
                 SPILLWAY_STORAGE__OVERFULL_SIZE both set: `store.overfull_size` is another \
                 name of `storage.overfull_size`; set one of them"
                    .to_string(),
            ]
        );
        // Across layers the environment wins, whichever name each uses.
        let (_, result) = load(
            "[engine]\nconsumer_timeout = 6\n",
            &[("SPILLWAY_BROKER__CONSUMER_TIMEOUT", "5")],
        );
        assert_eq!(
            result.map(|s| s.engine.consumer_timeout).ok(),
            Some(Duration::from_millis(5))
        );
    }

    #[test]
    fn an_unknown_key_under_an_alias_is_named_and_suggested_as_written() {
        let (file, result) = load(
            "[broker]\nconsumer_timout = 5\n\
             [[gateway.users]]\nname = \"a\"\npassword = \"p\"\nnme = \"b\"\n",
            &[("SPILLWAY_STORE__OVERFUL_SIZE", "1")],
        );
        let origin = Origin::File(file);
        assert_eq!(
            problems(result),
            [
                unknown(
                    "broker.consumer_timout",
                    origin.clone(),
                    Some("broker.consumer_timeout")
                ),
                unknown(
                    "gateway.users[0].nme",
                    origin,
                    Some("gateway.users[0].name")
                ),
                unknown(
                    "store.overful_size",
                    Origin::Env("SPILLWAY_STORE__OVERFUL_SIZE".into()),
                    Some("store.overfull_size")
                ),
            ]
        );
    }

    #[test]
    fn publisher_pacing_is_on_by_default_and_can_be_set_or_turned_off() -> anyhow::Result<()> {
        let (_, result) = load("", &[]);
        let pacing = result?.engine.pacing();
        assert_eq!(pacing, spillway_engine::PacingConfig::default());
        assert_eq!(pacing.window, spillway_engine::DEFAULT_PACING_WINDOW);
        let (_, result) = load(
            "[engine]\npublisher_pacing_window = 500\npublisher_pacing_stall = \"250ms\"\n",
            &[("SPILLWAY_ENGINE__PUBLISHER_PACING_WINDOW", "0")],
        );
        let pacing = result?.engine.pacing();
        assert_eq!(pacing.window, 0, "the environment wins");
        assert_eq!(pacing.stall, Duration::from_millis(250));
        let (_, result) = load("[engine]\npublisher_pacing_stall = 0\n", &[]);
        let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].starts_with("`engine.publisher_pacing_stall` = "),
            "{lines:?}"
        );
        Ok(())
    }

    #[test]
    fn message_compression_is_off_by_default_and_takes_its_threshold() -> anyhow::Result<()> {
        let (_, result) = load("", &[]);
        let settings = result?;
        assert_eq!(settings.gateway.compress_above(), None);
        assert_eq!(
            settings.gateway.message_compression_threshold_size,
            16 * 1024
        );
        let (_, result) = load(
            "[gateway]\nmessage_compression_enabled = true\n\
             message_compression_threshold_size = \"32KiB\"\n",
            &[],
        );
        assert_eq!(result?.gateway.compress_above(), Some(32 * 1024));
        // Qpid's names, as the design brief first gave them.
        let (_, result) = load(
            "",
            &[
                ("SPILLWAY_BROKER__MESSAGE_COMPRESSION_ENABLED", "true"),
                (
                    "SPILLWAY_CONNECTION__MESSAGE_COMPRESSION_THRESHOLD_SIZE",
                    "1024",
                ),
            ],
        );
        assert_eq!(result?.gateway.compress_above(), Some(1024));
        Ok(())
    }

    /// Loads `toml` from a file, with `vars` as the environment.
    fn load(toml: &str, vars: &[(&str, &str)]) -> (PathBuf, Result<Settings, SettingsError>) {
        let dir = match tempfile::tempdir() {
            Ok(dir) => dir,
            Err(error) => panic!("no temp dir: {error}"),
        };
        let file = dir.path().join("spillway.toml");
        if let Err(error) = std::fs::write(&file, toml) {
            panic!("writing {}: {error}", file.display());
        }
        let vars = vars
            .iter()
            .map(|(name, value)| (OsString::from(name), OsString::from(value)));
        let result = Settings::load_with_env(Some(&file), vars);
        (file, result)
    }

    fn problems(result: Result<Settings, SettingsError>) -> Vec<Problem> {
        match result {
            Err(SettingsError::Invalid(problems)) => problems,
            Err(other) => panic!("expected problems, got {other}"),
            Ok(settings) => panic!("expected problems, loaded {settings:?}"),
        }
    }

    fn unknown(key: &str, origin: Origin, suggestion: Option<&str>) -> Problem {
        Problem::UnknownKey {
            key: key.into(),
            origin,
            suggestion: suggestion.map(Into::into),
        }
    }

    #[test]
    fn an_unknown_key_in_the_file_names_the_file_and_the_nearest_key() {
        let (file, result) = load("[gateway]\nheartbeat_timout = 30\nfram_max = 8192\n", &[]);
        let problems = problems(result);
        let origin = Origin::File(file.clone());
        assert_eq!(
            problems,
            [
                unknown(
                    "gateway.fram_max",
                    origin.clone(),
                    Some("gateway.frame_max")
                ),
                unknown(
                    "gateway.heartbeat_timout",
                    origin,
                    Some("gateway.heartbeat")
                ),
            ]
        );
        assert_eq!(
            problems[1].to_string(),
            format!(
                "unknown key `gateway.heartbeat_timout` in {}; did you mean `gateway.heartbeat`?",
                file.display()
            )
        );
    }

    #[test]
    fn an_unknown_section_and_a_key_far_from_any_are_refused_too() {
        let (file, result) = load("[gatway]\nheartbeat = 30\n[gateway]\nzzz = 1\n", &[]);
        let origin = Origin::File(file.clone());
        assert_eq!(
            problems(result),
            [
                unknown("gateway.zzz", origin.clone(), None),
                unknown("gatway", origin, Some("gateway")),
            ]
        );
        let (_, result) = load("[gatway]\n", &[]);
        assert!(problems(result)[0]
            .to_string()
            .starts_with("unknown section `gatway` in "));
    }

    #[test]
    fn keys_inside_list_entries_are_checked() {
        let toml = "[[engine.users]]\nname = \"a\"\npassword = \"p\"\n\
                    [[engine.users]]\nname = \"b\"\npassword = \"p\"\nloopback_onyl = true\n\
                    [[management.users]]\nname = \"m\"\npassword = \"p\"\nrole = \"admin\"\n";
        let (file, result) = load(toml, &[]);
        let origin = Origin::File(file);
        assert_eq!(
            problems(result),
            [
                unknown(
                    "engine.users[1].loopback_onyl",
                    origin.clone(),
                    Some("engine.users[1].loopback_only")
                ),
                unknown("management.users[0].role", origin, None),
            ]
        );
    }

    #[test]
    fn an_unknown_environment_variable_is_named_as_set() {
        let (_, result) = load(
            "",
            &[
                ("SPILLWAY_GATEWAY__HEARTBEAT_TIMOUT", "30"),
                ("spillway_Gatway__Frame_Max", "8192"),
                ("SPILLWAY_TELEMETRY__NOPE", "x"),
            ],
        );
        let problems = problems(result);
        assert_eq!(
            problems,
            [
                unknown(
                    "gateway.heartbeat_timout",
                    Origin::Env("SPILLWAY_GATEWAY__HEARTBEAT_TIMOUT".into()),
                    Some("gateway.heartbeat")
                ),
                unknown(
                    "gatway.frame_max",
                    Origin::Env("spillway_Gatway__Frame_Max".into()),
                    Some("gateway.frame_max")
                ),
                unknown(
                    "telemetry.nope",
                    Origin::Env("SPILLWAY_TELEMETRY__NOPE".into()),
                    None
                ),
            ]
        );
        assert_eq!(
            problems[0].to_string(),
            "unknown key `gateway.heartbeat_timout` in environment variable \
             SPILLWAY_GATEWAY__HEARTBEAT_TIMOUT; did you mean SPILLWAY_GATEWAY__HEARTBEAT \
             (`gateway.heartbeat`)?"
        );
    }

    #[test]
    fn other_programs_spillway_variables_are_not_configuration() -> anyhow::Result<()> {
        // Read by the test scripts, the proto test, compose and the loadgen:
        // no double underscore after the prefix.
        let (_, result) = load(
            "",
            &[
                ("SPILLWAY_REGENERATE_PROTO", "1"),
                ("SPILLWAY_BIN", "/usr/bin/spillway"),
                ("SPILLWAY_MANAGEMENT_TOKEN", "secret"),
                ("SPILLWAY_AMQP_ADDR", "127.0.0.1:5672"),
                ("SPILLWAY_LOADGEN_URL", "amqp://localhost"),
                ("SPILLWAY", "x"),
                ("PATH", "/bin"),
                ("SPILLWAY_GATEWAY__HEARTBEAT", "7"),
            ],
        );
        let settings = result?;
        assert_eq!(settings.gateway.heartbeat, 7);
        assert_eq!(settings.management.token, None);
        Ok(())
    }

    #[test]
    fn a_value_of_the_wrong_type_names_its_variable() {
        let (_, result) = load("", &[("SPILLWAY_GATEWAY__FRAME_MAX", "lots")]);
        let problems = problems(result);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(matches!(
            &problems[0],
            Problem::BadValue { origin: Origin::Env(name), error }
                if name == "SPILLWAY_GATEWAY__FRAME_MAX" && error.contains("lots")
        ));
    }

    #[test]
    fn out_of_range_values_name_key_value_origin_and_range() {
        let toml = "[gateway]\nchannel_max = 0\nhandshake_timeout = 0\nmax_message_size = 0\n\
                    amqp_listen = \"localhost:5672\"\n\
                    [engine]\nflow_to_disk_threshold = 0\n\
                    [[engine.users]]\nname = \"app\"\npassword = \"p\"\n\
                    [[engine.users]]\nname = \"app\"\npassword = \"q\"\n\
                    [[engine.users]]\nname = \"\"\npassword = \"q\"\n\
                    [storage]\ndata_dir = \"\"\n\
                    [telemetry]\nlog_format = \"jsno\"\nmetrics_listen = \"metrics:9471\"\n";
        let (file, result) = load(toml, &[("SPILLWAY_GATEWAY__FRAME_MAX", "1024")]);
        let problems = problems(result);
        let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
        let file = file.display();
        assert_eq!(
            lines,
            [
                format!(
                    "`gateway.amqp_listen` = \"localhost:5672\" (in {file}) is out of range: \
                     a literal IP:port, e.g. \"0.0.0.0:5672\""
                ),
                "`gateway.frame_max` = 1024 (in environment variable \
                 SPILLWAY_GATEWAY__FRAME_MAX) is out of range: at least 4096 (AMQP's \
                 smallest frame)"
                    .to_string(),
                format!("`gateway.channel_max` = 0 (in {file}) is out of range: 1 to 65535"),
                format!(
                    "`gateway.max_message_size` = 0 (in {file}) is out of range: from 1 byte to 512 MiB (RabbitMQ's limit)"
                ),
                format!("`gateway.handshake_timeout` = 0 (in {file}) is out of range: more than 0"),
                format!(
                    "`engine.users[1].name` = \"app\" (in {file}) is out of range: a name \
                     not already given to engine.users[0]"
                ),
                format!("`engine.users[2].name` = \"\" (in {file}) is out of range: a name"),
                format!(
                    "`engine.flow_to_disk_threshold` = 0 (in {file}) is out of range: at \
                     least 1 byte, or unset for 40% of the memory available"
                ),
                format!("`storage.data_dir` = \"\" (in {file}) is out of range: a directory"),
                format!(
                    "`telemetry.log_format` = \"jsno\" (in {file}) is out of range: \"text\" \
                     or \"json\""
                ),
                format!(
                    "`telemetry.metrics_listen` = \"metrics:9471\" (in {file}) is out of \
                     range: a literal IP:port, e.g. \"127.0.0.1:9471\""
                ),
            ]
        );
    }

    #[test]
    fn an_address_without_its_scheme_or_port_is_refused_naming_the_key() {
        let toml = "[storage]\nnode_id = 1\nlisten = \"http://0.0.0.0:50071\"\n\
                    [storage.members]\n1 = \"127.0.0.1:5000\"\n2 = \"http://127.0.0.1:5001\"\n\
                    [management]\nengine_addr = \"http://engine\"\nhttp_listen = \"\"\n\
                    listen = \"50051\"\n";
        let vars = [
            ("SPILLWAY_GATEWAY__ENGINE_ADDRS", "http://e1:50061,e2:50061"),
            ("SPILLWAY_ENGINE__STORAGE_ADDR", "storage:50071"),
            ("SPILLWAY_TELEMETRY__OTLP_ENDPOINT", "collector:4317"),
        ];
        let (file, result) = load(toml, &vars);
        let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
        let file = file.display();
        let dialled = "is out of range: an address with its scheme, http://host:port \
                       (https://host:port with cluster.tls), e.g. \"http://127.0.0.1:50061\"";
        let listened = "is out of range: host:port (an IP address or a host name, and a \
                        port; no scheme), e.g. \"127.0.0.1:50061\"";
        assert_eq!(
            lines,
            [
                format!(
                    "`gateway.engine_addrs` = \"e2:50061\" (in environment variable \
                     SPILLWAY_GATEWAY__ENGINE_ADDRS) {dialled}"
                ),
                format!(
                    "`engine.storage_addr` = \"storage:50071\" (in environment variable \
                     SPILLWAY_ENGINE__STORAGE_ADDR) {dialled}"
                ),
                format!("`management.engine_addr` = \"http://engine\" (in {file}) {dialled}"),
                format!("`storage.members.1` = \"127.0.0.1:5000\" (in {file}) {dialled}"),
                "`telemetry.otlp_endpoint` = \"collector:4317\" (in environment variable \
                 SPILLWAY_TELEMETRY__OTLP_ENDPOINT) is out of range: an http:// or https:// \
                 URL, e.g. \"http://127.0.0.1:4317\""
                    .to_string(),
                format!("`storage.listen` = \"http://0.0.0.0:50071\" (in {file}) {listened}"),
                format!("`management.listen` = \"50051\" (in {file}) {listened}"),
            ]
        );
        // The forms that work: with the scheme; listening on a name.
        let good = "[gateway]\nengine_addrs = [\"https://engine-1:50061\"]\n\
                    [engine]\nlisten = \"localhost:0\"\nstorage_addr = \"http://[::1]:50071/\"\n\
                    [storage]\nlisten = \"[::]:50071\"\n\
                    [telemetry]\notlp_endpoint = \"https://collector.example\"\n";
        let (_, result) = load(good, &[]);
        assert!(result.is_ok(), "{result:?}");
    }

    #[test]
    fn heartbeat_bounds_must_hold_the_offered_heartbeat() {
        let (file, result) = load("[gateway]\nmin_heartbeat = 10\nmax_heartbeat = 5\n", &[]);
        let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
        let file = file.display();
        assert_eq!(
            lines,
            [
                format!(
                    "`gateway.min_heartbeat` = 10 (in {file}) is out of range: at most \
                     gateway.max_heartbeat"
                ),
                "`gateway.heartbeat` = 60 is out of range: within \
                 gateway.min_heartbeat and gateway.max_heartbeat (0 = off only without a \
                 maximum)"
                    .to_string(),
            ]
        );
        let (_, result) = load(
            "[gateway]\nheartbeat = 30\nmin_heartbeat = 5\nmax_heartbeat = 120\n",
            &[],
        );
        let settings = result.expect("bounds around the offered heartbeat load");
        assert_eq!(settings.gateway.heartbeat_refusal(30), None);
        assert!(settings.gateway.heartbeat_refusal(0).is_some());
    }

    /// A CA, and a server certificate and key it signed, as PEM files.
    fn tls_files(dir: &Path) -> anyhow::Result<(PathBuf, PathBuf, PathBuf)> {
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = rcgen::CertifiedIssuer::self_signed(ca, rcgen::KeyPair::generate()?)?;
        let key = rcgen::KeyPair::generate()?;
        let cert =
            rcgen::CertificateParams::new(vec!["localhost".to_string()])?.signed_by(&key, &*ca)?;
        let paths = (
            dir.join("server.pem"),
            dir.join("server.key"),
            dir.join("ca.pem"),
        );
        std::fs::write(&paths.0, cert.pem())?;
        std::fs::write(&paths.1, key.serialize_pem())?;
        std::fs::write(&paths.2, ca.pem())?;
        Ok(paths)
    }

    #[test]
    fn tls_settings_load_from_the_file_and_the_environment() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let (cert, key, ca) = tls_files(dir.path())?;
        let toml = format!(
            "[gateway]\namqps_listen = \"127.0.0.1:5671\"\namqp_listen = \"\"\n\
             [gateway.tls]\ncert_file = {:?}\nkey_file = {:?}\n",
            cert.display().to_string(),
            key.display().to_string()
        );
        let ca_text = ca.display().to_string();
        let (_, result) = load(
            &toml,
            &[
                ("SPILLWAY_GATEWAY__TLS__CA_FILE", &ca_text),
                ("SPILLWAY_GATEWAY__TLS__VERIFY_PEER", "true"),
                (
                    "SPILLWAY_MANAGEMENT__TLS__CERT_FILE",
                    &cert.display().to_string(),
                ),
                (
                    "SPILLWAY_MANAGEMENT__TLS__KEY_FILE",
                    &key.display().to_string(),
                ),
            ],
        );
        let settings = result?;
        let gateway = &settings.gateway;
        assert_eq!(gateway.amqp_listen(), None);
        assert_eq!(gateway.amqps_listen(), Some("127.0.0.1:5671"));
        let files = gateway
            .tls
            .files()
            .ok_or_else(|| anyhow::anyhow!("no TLS"))?;
        assert_eq!(files.ca_file.as_deref(), Some(ca.as_path()));
        assert!(files.verify_peer);
        assert!(settings.management.tls.files().is_some());
        // Unset by default; an empty amqps_listen is unset too.
        let (_, result) = load("", &[("SPILLWAY_GATEWAY__AMQPS_LISTEN", "")]);
        let settings = result?;
        assert_eq!(settings.gateway.amqps_listen(), None);
        assert!(settings.gateway.tls.files().is_none());
        Ok(())
    }

    #[test]
    fn tls_problems_name_their_key() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let (cert, key, _) = tls_files(dir.path())?;
        let cert = cert.display().to_string();
        let key = key.display().to_string();
        let missing = dir.path().join("missing.pem").display().to_string();
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n")?;
        let garbage = garbage.display().to_string();
        let cases: Vec<(Vec<(&str, &str)>, String)> = vec![
            (
                vec![("SPILLWAY_GATEWAY__TLS__CERT_FILE", cert.as_str())],
                "`gateway.tls.key_file` = unset is out of range: the PEM private key of \
                      gateway.tls.cert_file"
                    .into(),
            ),
            (
                vec![("SPILLWAY_GATEWAY__AMQPS_LISTEN", "127.0.0.1:5671")],
                "`gateway.tls.cert_file` = unset is out of range: a PEM certificate file \
                      (gateway.amqps_listen is set)"
                    .into(),
            ),
            (
                vec![
                    ("SPILLWAY_MANAGEMENT__TLS__CERT_FILE", cert.as_str()),
                    ("SPILLWAY_MANAGEMENT__TLS__KEY_FILE", key.as_str()),
                    ("SPILLWAY_MANAGEMENT__TLS__VERIFY_PEER", "true"),
                ],
                "`management.tls.verify_peer` = true (in environment variable \
                      SPILLWAY_MANAGEMENT__TLS__VERIFY_PEER) is out of range: false unless \
                      management.tls.ca_file is set (the CAs client certificates are checked \
                      against)"
                    .into(),
            ),
            (
                vec![
                    ("SPILLWAY_GATEWAY__TLS__CERT_FILE", missing.as_str()),
                    ("SPILLWAY_GATEWAY__TLS__KEY_FILE", key.as_str()),
                ],
                format!(
                    "`gateway.tls.cert_file` = {missing:?} (in environment variable \
                     SPILLWAY_GATEWAY__TLS__CERT_FILE) is out of range: a usable PEM file: \
                     cannot read {missing}: No such file or directory (os error 2)"
                ),
            ),
            (
                vec![
                    ("SPILLWAY_GATEWAY__TLS__CERT_FILE", cert.as_str()),
                    ("SPILLWAY_GATEWAY__TLS__KEY_FILE", garbage.as_str()),
                ],
                format!(
                    "`gateway.tls.key_file` = {garbage:?} (in environment variable \
                     SPILLWAY_GATEWAY__TLS__KEY_FILE) is out of range: a usable PEM file: \
                     {garbage} holds no usable PEM private key (no items found)"
                ),
            ),
            (
                vec![
                    ("SPILLWAY_GATEWAY__TLS__CERT_FILE", cert.as_str()),
                    ("SPILLWAY_GATEWAY__TLS__KEY_FILE", key.as_str()),
                    ("SPILLWAY_GATEWAY__TLS__CA_FILE", garbage.as_str()),
                ],
                format!(
                    "`gateway.tls.ca_file` = {garbage:?} (in environment variable \
                     SPILLWAY_GATEWAY__TLS__CA_FILE) is out of range: a usable PEM file: \
                     {garbage} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
                ),
            ),
            (
                vec![("SPILLWAY_GATEWAY__AMQP_LISTEN", "")],
                "`gateway.amqp_listen` = \"\" (in environment variable \
                      SPILLWAY_GATEWAY__AMQP_LISTEN) is out of range: a literal IP:port, e.g. \
                      \"0.0.0.0:5672\" (empty only with gateway.amqps_listen set)"
                    .into(),
            ),
        ];
        for (vars, expected) in cases {
            let (_, result) = load("", &vars);
            let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
            assert_eq!(lines, [expected], "{vars:?}");
        }
        Ok(())
    }

    #[test]
    fn cluster_tls_needs_all_three_files_and_names_a_bad_one() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let (cert, key, ca) = tls_files(dir.path())?;
        let (cert, key, ca) = (
            cert.display().to_string(),
            key.display().to_string(),
            ca.display().to_string(),
        );
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n")?;
        let garbage = garbage.display().to_string();

        let all = [
            ("SPILLWAY_CLUSTER__TLS__CERT_FILE", cert.as_str()),
            ("SPILLWAY_CLUSTER__TLS__KEY_FILE", key.as_str()),
            ("SPILLWAY_CLUSTER__TLS__CA_FILE", ca.as_str()),
        ];
        let (_, result) = load("", &all);
        let settings = result?;
        assert!(settings.cluster.tls.load()?.is_some());
        assert!(Settings::default().cluster.tls.load()?.is_none());

        let (_, result) = load("", &all[..1]);
        let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
        let needs = "is out of range: a PEM file: cluster.tls needs cert_file, key_file and \
                     ca_file together";
        assert_eq!(
            lines,
            [
                format!("`cluster.tls.key_file` = unset {needs}"),
                format!("`cluster.tls.ca_file` = unset {needs}"),
            ]
        );

        let (_, result) = load(
            &format!(
                "[cluster.tls]\ncert_file = {cert:?}\nkey_file = {key:?}\nca_file = {garbage:?}\n"
            ),
            &[],
        );
        let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].starts_with(&format!("`cluster.tls.ca_file` = {garbage:?} (in "))
                && lines[0].ends_with("holds no PEM certificate (-----BEGIN CERTIFICATE-----)"),
            "{lines:?}"
        );
        Ok(())
    }

    #[test]
    fn the_cluster_secret_is_checked_read_from_its_file_and_never_shown() -> anyhow::Result<()> {
        const SECRET: &str = "0123456789abcdef0123";
        let (_, result) = load("[cluster]\nsecret = \"0123456789abcdef0123\"\n", &[]);
        let settings = result?;
        assert_eq!(
            settings.cluster.secret.as_ref().map(|s| s.expose()),
            Some(SECRET.as_bytes())
        );
        assert!(!format!("{settings:?}").contains(SECRET));

        let dir = tempfile::tempdir()?;
        let file = dir.path().join("secret");
        std::fs::write(&file, format!("{SECRET}\n"))?;
        let path = file.display().to_string();
        let (_, result) = load("", &[("SPILLWAY_CLUSTER__SECRET_FILE", &path)]);
        let settings = result?;
        assert_eq!(
            settings.cluster.secret.as_ref().map(|s| s.expose()),
            Some(SECRET.as_bytes())
        );

        // All digits arrive from the environment as a number.
        let (_, result) = load("", &[("SPILLWAY_CLUSTER__SECRET", "12345678901234567")]);
        assert_eq!(
            result?.cluster.secret.as_ref().map(|s| s.expose()),
            Some(&b"12345678901234567"[..])
        );

        let (_, result) = load("", &[]);
        assert!(result?.cluster.secret.is_none());
        Ok(())
    }

    #[test]
    fn a_short_doubled_or_unreadable_secret_is_refused() -> anyhow::Result<()> {
        let (file, result) = load("[cluster]\nsecret = \"short one\"\n", &[]);
        let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
        assert_eq!(
            lines,
            [format!(
                "`cluster.secret` = (not shown, 9 bytes) (in {}) is out of range: at least 16 \
                 visible ASCII characters; it may hold only visible ASCII characters (no spaces \
                 or control characters)",
                file.display()
            )]
        );
        let (_, result) = load("", &[("SPILLWAY_CLUSTER__SECRET", "")]);
        let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
        assert!(lines[0].ends_with("; it is empty"), "{lines:?}");

        let dir = tempfile::tempdir()?;
        let short = dir.path().join("short");
        std::fs::write(&short, "abc\n")?;
        let missing = dir.path().join("missing");
        for (vars, expected) in [
            (
                vec![("SPILLWAY_CLUSTER__SECRET_FILE", short.display().to_string())],
                "in this one it is 3 bytes long; at least 16 are needed",
            ),
            (
                vec![(
                    "SPILLWAY_CLUSTER__SECRET_FILE",
                    missing.display().to_string(),
                )],
                "a readable file holding the secret (",
            ),
            (
                vec![
                    (
                        "SPILLWAY_CLUSTER__SECRET",
                        "0123456789abcdef0123".to_string(),
                    ),
                    ("SPILLWAY_CLUSTER__SECRET_FILE", short.display().to_string()),
                ],
                "unset while cluster.secret is set: give one of the two",
            ),
        ] {
            let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let (_, result) = load("", &vars);
            let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
            assert_eq!(lines.len(), 1, "{lines:?}");
            assert!(
                lines[0].starts_with("`cluster.secret_file` = ")
                    && lines[0].contains("(in environment variable SPILLWAY_CLUSTER__SECRET_FILE)")
                    && lines[0].contains(expected),
                "{lines:?}"
            );
            assert!(!lines[0].contains("0123456789abcdef0123"));
        }
        Ok(())
    }

    #[test]
    fn the_edges_of_each_range_and_documented_zeros_load() -> anyhow::Result<()> {
        let toml = "[gateway]\nframe_max = 4096\nchannel_max = 1\nheartbeat = 0\n\
                    max_message_size = 1\nblocked_overdraft = 0\nhandshake_timeout = 1\n\
                    max_connections = 0\n\
                    [engine]\nsession_credit = 0\n\
                    flow_to_disk_threshold = 1\nhousekeeping_interval = 0\n\
                    consumer_timeout = 0\n\
                    [storage]\noverfull_size = 0\nunderfull_size = 0\n\
                    [telemetry]\nlog_format = \"json\"\n";
        let (_, result) = load(toml, &[("SPILLWAY_GATEWAY__CHANNEL_MAX", "65535")]);
        let settings = result?;
        assert_eq!(settings.gateway.frame_max, 4096);
        assert_eq!(settings.gateway.channel_max, 65535);
        assert_eq!(settings.engine.consumer_timeout, Duration::ZERO);
        Ok(())
    }

    /// The example in `docs/configuration.md` sets every key: it loads, and
    /// so do the files and variables the repository ships.
    #[test]
    fn the_documented_example_and_the_shipped_configuration_load() -> anyhow::Result<()> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let doc = std::fs::read_to_string(root.join("docs/configuration.md"))?;
        let example = doc
            .split("## Example `spillway.toml`")
            .nth(1)
            .and_then(|rest| rest.split("```toml\n").nth(1))
            .and_then(|rest| rest.split("```").next())
            .ok_or_else(|| anyhow::anyhow!("no example in docs/configuration.md"))?;
        let (_, result) = load(example, &[]);
        let settings = result?;
        assert_eq!(settings.storage.underfull_size, Some(8 << 30));
        assert_eq!(settings.engine.users.len(), 2);

        // deploy/users.toml is made on each machine by
        // deploy/admin-credentials.sh: the file it writes, with a password.
        let script = std::fs::read_to_string(root.join("deploy/admin-credentials.sh"))?;
        let users = script
            .split("users.toml\" <<TOML\n")
            .nth(1)
            .and_then(|rest| rest.split("\nTOML\n").next())
            .ok_or_else(|| anyhow::anyhow!("no users.toml in deploy/admin-credentials.sh"))?
            .replace("$password", "made-on-this-machine")
            .replace("\\`", "`");
        let (_, result) = load(&users, &[]);
        let seeded = result?.engine.users;
        assert_eq!(seeded[0].name, "spillway");
        assert_eq!(seeded[0].password, "made-on-this-machine");
        Ok(())
    }

    /// Every `SPILLWAY_<SECTION>__<KEY>` the scripts, compose file, image,
    /// Python suite, test harness and README set is a key the settings read.
    #[test]
    fn every_variable_the_repository_sets_is_a_known_key() -> anyhow::Result<()> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut files = vec![
            root.join("README.md"),
            root.join("docker-compose.yml"),
            root.join("deploy/Dockerfile"),
            root.join("crates/spillway-integration-tests/src/lib.rs"),
        ];
        for dir in ["scripts", "scripts/lib", "tests/python"] {
            for entry in std::fs::read_dir(root.join(dir))? {
                let path = entry?.path();
                if path.is_file() {
                    files.push(path);
                }
            }
        }
        // Settings that are tables of free keys.
        const TABLES: &[&str] = &["storage.members"];
        let mut seen = 0;
        for file in files {
            let text = std::fs::read_to_string(&file)?;
            for (at, _) in text.match_indices(ENV_PREFIX) {
                let name: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let vars = config_vars([(OsString::from(&name), OsString::new())]);
                let Some(var) = vars.first() else { continue };
                // Aliases (`broker.*`) are known keys too.
                let mut path = keys::parse(&aliases::resolve(&var.key).0);
                // A table's own keys (`storage.members.1`): the table is
                // the setting.
                let table = keys::render(&path[..path.len().saturating_sub(1)]);
                if TABLES.contains(&table.as_str()) {
                    path.pop();
                }
                let known = (1..=path.len()).all(|len| {
                    let (parent, last) = path[..len].split_at(len - 1);
                    matches!((keys::fields_at::<Settings>(parent), &last[0]),
                        (Some(fields), keys::Segment::Key(key)) if fields.contains(&key.as_str()))
                });
                assert!(known, "{name} in {} is not a setting", file.display());
                seen += 1;
            }
        }
        assert!(seen > 20, "only {seen} variables found");
        Ok(())
    }

    #[test]
    fn the_known_keys_come_from_the_structs() {
        let sections = keys::fields_at::<Settings>(&[]).unwrap_or_default();
        assert!(sections.contains(&"gateway") && sections.contains(&"telemetry"));
        let gateway = keys::fields_at::<Settings>(&[keys::Segment::Key("gateway".into())]);
        assert!(gateway.unwrap_or_default().contains(&"handshake_timeout"));
        let users = keys::fields_at::<Settings>(&[
            keys::Segment::Key("management".into()),
            keys::Segment::Key("users".into()),
            keys::Segment::Index(None),
        ]);
        assert_eq!(users, Some(&["name", "password", "loopback_only"][..]));
        let leaf = keys::fields_at::<Settings>(&[
            keys::Segment::Key("gateway".into()),
            keys::Segment::Key("frame_max".into()),
        ]);
        assert_eq!(leaf, None);
    }
}
