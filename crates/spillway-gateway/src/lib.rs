//! The protocol gateway: owns client sockets, AMQP 0-9-1 framing, the
//! connection and channel state machines, authentication and heartbeats. It
//! turns frames into engine commands and engine events into frames, and holds
//! no message beyond the one being assembled per channel.
//!
//! Layers, each in its own module:
//! - bytes ⇄ frames (no protocol state) is `spillway_amqp::codec`, a crate
//!   of its own, shared with the load generator and the fuzz targets;
//! - [`connection`]: the handshake and the connection/channel state machines
//!   (no I/O);
//! - [`server`]: the TCP listeners (plain and TLS) and the per-connection
//!   I/O loop, with [`read_room`] sizing its reads and its buffer's
//!   allocations;
//! - [`body_loans`]: one-frame bodies handed on as slices of the read buffer
//!   instead of copies, within a gateway-wide bound;
//! - [`tls`]: the AMQPS server configuration from PEM files, and the client
//!   certificate's CN for SASL EXTERNAL;
//! - [`heartbeat`]: when a silent client counts as gone;
//! - [`limits`]: `gateway.max_connections` and the negotiated `channel_max`
//!   (the vhost, user and per-connection limits are the engine's);
//! - [`metrics`]: the connection, channel and message counts the I/O loop
//!   keeps for `/metrics`.
//!
//! - [`amqp1`]: AMQP 1.0 on the same listeners, chosen by the protocol
//!   header, over the same engine (`fe2o3-amqp`'s state machines).
//!
//! The engine is reached through [`spillway_proto::engine::EngineApi`]: in-process
//! in the all-in-one broker, over gRPC when the gateway runs alone.

pub mod amqp091;
pub mod amqp1;
pub mod auth;
pub mod body_loans;
pub mod heartbeat;
pub mod limits;
mod listener;
pub mod metrics;
pub mod read_room;
pub mod server;
pub mod tls;

pub use metrics::GatewayMetrics;
pub use server::{AmqpServer, Listeners};

/// Gateway settings (the `[gateway]` section of the configuration).
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(default)]
pub struct GatewayConfig {
    /// Largest frame offered to clients, bytes.
    pub frame_max: u32,
    /// Highest channel number offered to clients.
    pub channel_max: u16,
    /// Heartbeat interval offered to clients, seconds (0 = off).
    pub heartbeat: u16,
    /// Shortest heartbeat interval a client may choose in `tune-ok`,
    /// seconds; 0 = no minimum. A shorter one is refused with 530.
    pub min_heartbeat: u16,
    /// Longest heartbeat interval a client may choose, seconds; 0 = no
    /// maximum. When set, turning heartbeats off (0) is refused too.
    pub max_heartbeat: u16,
    /// Largest message body accepted, bytes; larger publishes get 406.
    pub max_message_size: u64,
    /// Body bytes a connection blocked by producer flow control may still
    /// publish before the gateway stops reading its socket.
    pub blocked_overdraft: u64,
    /// How long a client has from connecting to `connection.open-ok`
    /// (RabbitMQ's default, 10 s); then it is closed, logged in or not.
    pub handshake_timeout: std::time::Duration,
    /// Most connections this gateway holds open at once; 0 = no maximum.
    pub max_connections: usize,
    /// How long a write to a client's socket may make no progress before
    /// the connection is dropped (RabbitMQ's `send_timeout`, 15 s); zero
    /// waits for ever.
    pub write_timeout: std::time::Duration,
    /// Bytes of message bodies a connection may have partly received, over
    /// all its channels, before it is closed with 506 RESOURCE_ERROR.
    pub max_unfinished_content: u64,
    /// Message compression (`gateway.message_compression_enabled`): bodies
    /// longer than this many bytes
    /// (`gateway.message_compression_threshold_size`) are compressed as
    /// they are published when that makes them at least an eighth smaller,
    /// and decoded as they are delivered. None: off.
    pub compress_above: Option<u64>,
    /// The user an AMQP 1.0 client logs in as with SASL ANONYMOUS (or
    /// without SASL); None, the default: ANONYMOUS is not offered.
    pub amqp1_anonymous_user: Option<String>,
    /// Time as the gateway reads it (when a connection was blocked, login
    /// throttling and the rate of refusal log lines); the wiring hands it
    /// the process's clock. Socket deadlines and heartbeats run on tokio's
    /// timers, which tests pause and advance.
    #[serde(skip, default = "spillway_proto::util::clock::SystemClock::shared")]
    pub clock: spillway_proto::util::clock::SharedClock,
}

impl GatewayConfig {
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

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            frame_max: 131_072,
            channel_max: 2047,
            heartbeat: 60,
            min_heartbeat: 0,
            max_heartbeat: 0,
            max_message_size: 128 * 1024 * 1024,
            blocked_overdraft: 1024 * 1024,
            handshake_timeout: std::time::Duration::from_secs(10),
            max_connections: 0,
            write_timeout: std::time::Duration::from_secs(15),
            max_unfinished_content: 128 * 1024 * 1024,
            compress_above: None,
            amqp1_anonymous_user: None,
            clock: spillway_proto::util::clock::SystemClock::shared(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::GatewayConfig;

    #[test]
    fn heartbeats_outside_the_bounds_are_refused_naming_the_bound() {
        let unbounded = GatewayConfig::default();
        for heartbeat in [0, 1, 60, u16::MAX] {
            assert_eq!(unbounded.heartbeat_refusal(heartbeat), None, "{heartbeat}");
        }
        let bounded = GatewayConfig {
            min_heartbeat: 5,
            max_heartbeat: 120,
            ..GatewayConfig::default()
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
