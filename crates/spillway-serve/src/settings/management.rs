//! `[management]`: the management APIs, who may call them, and where the
//! engine and the store are when management runs alone.

use std::time::Duration;

use serde::Deserialize;
use spillway_gateway::TlsSettings;
use spillway_telemetry::formats::{durations, list_or_commas};

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
