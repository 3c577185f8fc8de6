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
//! - `settings.rs`: the `[gateway]` section ([`GatewaySettings`]), handed
//!   over as read inside [`GatewayConfig`];
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
mod settings;
pub mod tls;

pub use metrics::GatewayMetrics;
pub use server::{AmqpServer, Listeners};
pub use settings::{GatewaySettings, TlsSettings, DEFAULT_COMPRESSION_THRESHOLD};

/// What the wiring hands the gateway: the configuration's `[gateway]`
/// section as read ([`GatewaySettings`], declared in `settings.rs`) and the
/// process's clock.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// The `[gateway]` section.
    pub settings: GatewaySettings,
    /// Time as the gateway reads it (when a connection was blocked, login
    /// throttling and the rate of refusal log lines); the wiring hands it
    /// the process's clock. Socket deadlines and heartbeats run on tokio's
    /// timers, which tests pause and advance.
    pub clock: spillway_proto::util::clock::SharedClock,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            settings: GatewaySettings::default(),
            clock: spillway_proto::util::clock::SystemClock::shared(),
        }
    }
}
