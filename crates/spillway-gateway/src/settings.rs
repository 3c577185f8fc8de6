//! The gateway's settings: the configuration's `[gateway]` section,
//! declared here once (keys, defaults, accepted formats, what each means)
//! and handed to the gateway as read, inside
//! [`GatewayConfig`](crate::GatewayConfig). What the gateway derives from
//! them (the compression bound, the anonymous user, whether a heartbeat is
//! allowed) is derived here too.
//!
//! The listen addresses, `tls` and the engine's addresses are read by the
//! wiring that starts the gateway (which sockets to bind, which engine to
//! dial); they are declared here all the same, so the section has one home.
//! [`TlsSettings`] is also the shape of `management.tls`.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use spillway_telemetry::formats::{durations, list_or_commas, sizes};

#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct GatewaySettings {
    /// Where AMQP clients connect. Empty: no plain AMQP (only with
    /// `amqps_listen` set).
    pub amqp_listen: String,
    /// Where AMQPS (AMQP over TLS) clients connect. Unset or empty: no AMQPS.
    pub amqps_listen: Option<String>,
    /// AMQPS's certificate, key and client CAs.
    pub tls: TlsSettings,
    /// The engine's gRPC address when the gateway runs alone.
    pub engine_addr: String,
    /// Every engine, when several run (one active, the others standing
    /// by): sessions go to the one that answers (`docs/replication.md`).
    /// A list, or one comma-separated string. Empty: `engine_addr` alone.
    #[serde(deserialize_with = "list_or_commas")]
    pub engine_addrs: Vec<String>,
    /// Largest frame offered to clients, bytes.
    pub frame_max: u32,
    /// Highest channel number offered to clients.
    pub channel_max: u16,
    /// Heartbeat interval offered to clients, seconds (0 = off).
    pub heartbeat: u16,
    /// Shortest heartbeat a client may choose in `tune-ok`, seconds; 0 = no
    /// minimum. A shorter one is refused with 530.
    pub min_heartbeat: u16,
    /// Longest heartbeat a client may choose, seconds; 0 = no maximum.
    /// When set, turning heartbeats off (0) is refused too.
    pub max_heartbeat: u16,
    /// Largest message body accepted, bytes; larger publishes get 406.
    pub max_message_size: u64,
    /// Compress message bodies above `message_compression_threshold_size`
    /// as they are published (lz4; kept only when at least an eighth
    /// smaller), hold them so in memory and on disk, and decode them on
    /// delivery (Qpid's `broker.messageCompressionEnabled`). docs/compression.md.
    pub message_compression_enabled: bool,
    /// Bodies longer than this are compressed when
    /// `message_compression_enabled` is on: a size (`16KiB`; Qpid's
    /// `connection.messageCompressionThresholdSize`).
    #[serde(deserialize_with = "sizes::required")]
    pub message_compression_threshold_size: u64,
    /// Body bytes a connection blocked by producer flow control may still
    /// publish before the gateway stops reading its socket: a size.
    #[serde(deserialize_with = "sizes::required")]
    pub blocked_overdraft: u64,
    /// How long a client has from connecting to `connection.open-ok`
    /// (RabbitMQ's default, 10 s); then it is closed, logged in or not:
    /// `10s`, or plain milliseconds.
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub handshake_timeout: Duration,
    /// Most connections this gateway holds open at once; 0 = no maximum.
    pub max_connections: usize,
    /// How long a write to a client's socket may make no progress before
    /// the connection is dropped (RabbitMQ's `send_timeout`): `15s`, or
    /// plain milliseconds; 0 waits for ever.
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub write_timeout: Duration,
    /// Bytes of message bodies a connection may have partly received, over
    /// all its channels, before it is closed with 506 RESOURCE_ERROR: a
    /// size.
    #[serde(deserialize_with = "sizes::required")]
    pub max_unfinished_content: u64,
    /// The user an AMQP 1.0 client logs in as with SASL ANONYMOUS (or
    /// without SASL; RabbitMQ 4's `anonymous_login_user`). Unset (or
    /// empty), the default: ANONYMOUS is not offered and a 1.0 client must
    /// log in.
    pub amqp1_anonymous_user: Option<String>,
}

impl Default for GatewaySettings {
    fn default() -> Self {
        Self {
            amqp_listen: "0.0.0.0:5672".into(),
            amqps_listen: None,
            tls: TlsSettings::default(),
            engine_addr: "http://127.0.0.1:50061".into(),
            engine_addrs: Vec::new(),
            frame_max: 131_072,
            channel_max: 2047,
            heartbeat: 60,
            min_heartbeat: 0,
            max_heartbeat: 0,
            max_message_size: 128 * 1024 * 1024,
            message_compression_enabled: false,
            message_compression_threshold_size: DEFAULT_COMPRESSION_THRESHOLD,
            blocked_overdraft: 1024 * 1024,
            handshake_timeout: Duration::from_secs(10),
            max_connections: 0,
            write_timeout: Duration::from_secs(15),
            max_unfinished_content: 128 * 1024 * 1024,
            amqp1_anonymous_user: None,
        }
    }
}

/// `gateway.message_compression_threshold_size` by default: 16 KiB.
pub const DEFAULT_COMPRESSION_THRESHOLD: u64 = 16 * 1024;

impl GatewaySettings {
    /// The AMQPS address, when one is set (and not empty).
    pub fn amqps_listen(&self) -> Option<&str> {
        self.amqps_listen
            .as_deref()
            .map(str::trim)
            .filter(|listen| !listen.is_empty())
    }

    /// The plain AMQP address, unless it is empty (off).
    pub fn amqp_listen(&self) -> Option<&str> {
        Some(self.amqp_listen.trim()).filter(|listen| !listen.is_empty())
    }

    /// Message compression in force: bodies longer than this many bytes
    /// are compressed as they are published when that makes them at least
    /// an eighth smaller, and decoded as they are delivered. None: off.
    pub fn compress_above(&self) -> Option<u64> {
        self.message_compression_enabled
            .then_some(self.message_compression_threshold_size)
    }

    /// The user SASL ANONYMOUS logs in as, when one is set (and not empty).
    pub fn amqp1_anonymous_user(&self) -> Option<&str> {
        self.amqp1_anonymous_user
            .as_deref()
            .filter(|user| !user.is_empty())
    }

    /// Why a client's chosen heartbeat interval (seconds, 0 = off) is not
    /// allowed, if it is not.
    pub fn heartbeat_refusal(&self, heartbeat: u16) -> Option<String> {
        if heartbeat == 0 && self.max_heartbeat > 0 {
            return Some(format!(
                "heartbeat 0 (off) not allowed: at most {} s (gateway.max_heartbeat)",
                self.max_heartbeat
            ));
        }
        if heartbeat > 0 && heartbeat < self.min_heartbeat {
            return Some(format!(
                "heartbeat {heartbeat} s below the minimum {} s (gateway.min_heartbeat)",
                self.min_heartbeat
            ));
        }
        if self.max_heartbeat > 0 && heartbeat > self.max_heartbeat {
            return Some(format!(
                "heartbeat {heartbeat} s above the maximum {} s (gateway.max_heartbeat)",
                self.max_heartbeat
            ));
        }
        None
    }
}

/// A listener's TLS (`gateway.tls`, `management.tls`): PEM files.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct TlsSettings {
    /// The server's certificate chain, leaf first.
    pub cert_file: Option<PathBuf>,
    /// Its private key.
    pub key_file: Option<PathBuf>,
    /// The CAs client certificates are verified against. Set: a client
    /// may present a certificate (and log in with SASL EXTERNAL on AMQPS).
    pub ca_file: Option<PathBuf>,
    /// Require a client certificate (needs `ca_file`).
    pub verify_peer: bool,
}

impl TlsSettings {
    /// The files, when a certificate and key are set (TLS is on).
    pub fn files(&self) -> Option<crate::tls::TlsFiles> {
        Some(crate::tls::TlsFiles {
            cert_file: self.cert_file.clone()?,
            key_file: self.key_file.clone()?,
            ca_file: self.ca_file.clone(),
            verify_peer: self.verify_peer,
        })
    }

    /// Whether any of it is set.
    pub fn is_set(&self) -> bool {
        self.cert_file.is_some()
            || self.key_file.is_some()
            || self.ca_file.is_some()
            || self.verify_peer
    }
}

#[cfg(test)]
mod tests {
    use super::GatewaySettings;

    #[test]
    fn heartbeats_outside_the_bounds_are_refused_naming_the_bound() {
        let unbounded = GatewaySettings::default();
        for heartbeat in [0, 1, 60, u16::MAX] {
            assert_eq!(unbounded.heartbeat_refusal(heartbeat), None, "{heartbeat}");
        }
        let bounded = GatewaySettings {
            min_heartbeat: 5,
            max_heartbeat: 120,
            ..GatewaySettings::default()
        };
        for heartbeat in [5, 60, 120] {
            assert_eq!(bounded.heartbeat_refusal(heartbeat), None, "{heartbeat}");
        }
        for (heartbeat, bound) in [
            (0, "gateway.max_heartbeat"),
            (4, "gateway.min_heartbeat"),
            (121, "gateway.max_heartbeat"),
        ] {
            let refusal = bounded.heartbeat_refusal(heartbeat).unwrap_or_default();
            assert!(refusal.contains(bound), "{heartbeat}: {refusal}");
        }
    }
}
