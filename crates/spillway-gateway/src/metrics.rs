//! The gateway's metrics: open connections and channels (and AMQP 1.0
//! sessions and links), the messages that crossed it, and the connections
//! and channels it refused by limit (`gateway.max_connections`,
//! `channel_max`). Counted by the 0-9-1 I/O loop (`amqp091/io.rs`) and the AMQP 1.0
//! links (`amqp1/`); registered into the process's [`Metrics`] by whoever
//! starts the gateway.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use spillway_proto::engine::{session_command::Command, SessionCommand};
use spillway_telemetry::prometheus_client;
use spillway_telemetry::{LimitRefusals, Metrics};

/// The gateway's counters and gauges. Cheap to clone; clones share them.
/// [`GatewayMetrics::default`] counts into no registry until
/// [`GatewayMetrics::register`] is called.
#[derive(Clone, Debug, Default)]
pub struct GatewayMetrics {
    connections: Gauge,
    channels: Gauge,
    amqp1_connections: Gauge,
    amqp1_sessions: Gauge,
    amqp1_links: Gauge,
    published: Counter,
    compressed: Counter,
    compression_saved_bytes: Counter,
    delivered: Counter,
    acknowledged: Counter,
    blocked: Gauge,
    paused: Gauge,
    blocked_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    write_timeouts: Counter,
    unfinished_content: Gauge,
    unfinished_content_closes: Counter,
    lent_read_bytes: Gauge,
    refusals: LimitRefusals,
    tls_handshake_failures: TlsFailures,
    login_refusals: LoginRefusals,
}

/// `spillway_login_refusals_total{reason}`.
type LoginRefusals = Family<Vec<(&'static str, &'static str)>, Counter>;

/// `spillway_tls_handshake_failures_total{listener}`.
type TlsFailures = Family<Vec<(&'static str, &'static str)>, Counter>;

/// The gateway's labels in `spillway_limit_refusals_total`.
pub const MAX_CONNECTIONS: &str = "max_connections";
pub const CHANNEL_MAX: &str = "channel_max";
/// Not a count: the process's memory ceiling (`engine.memory_high_watermark`).
pub const MEMORY_HIGH_WATERMARK: &str = "memory_high_watermark";

impl GatewayMetrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// The gauge of read-buffer bytes lent bodies keep alive
    /// ([`crate::body_loans::BodyLoans`] keeps it).
    pub fn lent_read_bytes(&self) -> Gauge {
        self.lent_read_bytes.clone()
    }

    /// Adds these metrics to `metrics` (once per process).
    pub fn register(&self, metrics: &Metrics) {
        metrics.register(
            "spillway_connections",
            "Open AMQP connections (handshake done, engine session open)",
            self.connections.clone(),
        );
        metrics.register(
            "spillway_channels",
            "Open AMQP channels, over all connections",
            self.channels.clone(),
        );
        metrics.register(
            "spillway_amqp1_connections",
            "Open AMQP 1.0 connections (counted in spillway_connections too)",
            self.amqp1_connections.clone(),
        );
        metrics.register(
            "spillway_amqp1_sessions",
            "Open AMQP 1.0 sessions, over all connections",
            self.amqp1_sessions.clone(),
        );
        metrics.register(
            "spillway_amqp1_links",
            "Attached AMQP 1.0 links, over all sessions (each carried by an engine channel; not counted in spillway_channels)",
            self.amqp1_links.clone(),
        );
        metrics.register(
            "spillway_messages_published",
            "Messages published by clients and handed to the engine (basic.publish with its content)",
            self.published.clone(),
        );
        metrics.register(
            "spillway_messages_compressed",
            "Published bodies the gateway compressed (gateway.message_compression_enabled; bodies over the threshold that lz4 made at least an eighth smaller)",
            self.compressed.clone(),
        );
        metrics.register(
            "spillway_compression_saved_bytes",
            "Body bytes compression saved at publish: published size minus compressed size, summed",
            self.compression_saved_bytes.clone(),
        );
        metrics.register(
            "spillway_messages_delivered",
            "Messages written to consumers' sockets (basic.deliver; basic.get is not counted)",
            self.delivered.clone(),
        );
        metrics.register(
            "spillway_messages_acknowledged",
            "basic.ack, basic.nack and basic.reject methods received from consumers and handed to the engine (one per method, also when multiple is set)",
            self.acknowledged.clone(),
        );
        // The same figures under the names of RabbitMQ's Prometheus
        // plugin, for the dashboards made for it.
        metrics.register(
            "rabbitmq_connections",
            "Connections currently open",
            self.connections.clone(),
        );
        metrics.register(
            "rabbitmq_channels",
            "Channels currently open",
            self.channels.clone(),
        );
        metrics.register(
            "rabbitmq_global_messages_received",
            "Total number of messages received from publishers",
            self.published.clone(),
        );
        metrics.register(
            "rabbitmq_global_messages_delivered",
            "Total number of messages delivered to consumers (basic.get not counted)",
            self.delivered.clone(),
        );
        metrics.register(
            "rabbitmq_global_messages_acknowledged",
            "Total number of acknowledgement methods received from consumers",
            self.acknowledged.clone(),
        );
        metrics.register(
            "spillway_blocked_connections",
            "Connections blocked by producer flow control (an overfull queue or the store quota)",
            self.blocked.clone(),
        );
        metrics.register(
            "spillway_paused_connections",
            "Blocked connections whose overdraft is spent: the gateway is not reading their socket",
            self.paused.clone(),
        );
        metrics.register(
            "spillway_blocked_seconds",
            "Time connections have spent blocked by producer flow control, summed over connections (counted when each block ends)",
            self.blocked_seconds.clone(),
        );
        self.refusals
            .declare(&[MAX_CONNECTIONS, CHANNEL_MAX, MEMORY_HIGH_WATERMARK]);
        metrics.register_limit_refusals(self.refusals.clone());
        metrics.register(
            "spillway_write_timeouts",
            "Connections dropped because the client read nothing for gateway.write_timeout",
            self.write_timeouts.clone(),
        );
        metrics.register(
            "spillway_unfinished_content_bytes",
            "Bytes of partly received message bodies held by the gateway, over all connections",
            self.unfinished_content.clone(),
        );
        metrics.register(
            "spillway_unfinished_content_closes",
            "Connections closed (506) for holding more than gateway.max_unfinished_content of partly received bodies",
            self.unfinished_content_closes.clone(),
        );
        metrics.register(
            "spillway_lent_read_buffer_bytes",
            "Bytes of connections' read buffers kept alive by message bodies handed on without a copy, over all connections (at most 32 MiB; docs/limits.md)",
            self.lent_read_bytes.clone(),
        );
        metrics.register(
            "spillway_tls_handshake_failures",
            "Connections to a TLS listener that failed before the TLS handshake finished (not TLS, a refused or missing client certificate, the handshake timeout), by listener",
            self.tls_handshake_failures.clone(),
        );
        // The usual reasons show at 0 before their first refusal.
        for reason in ["invalid_credentials", "loopback_only"] {
            let _ = self.login_refusals.get_or_create(&vec![("reason", reason)]);
        }
        metrics.register(
            "spillway_login_refusals",
            "Logins refused at connection.start-ok, by reason (invalid_credentials: an unknown user or a wrong password; loopback_only; malformed; mechanism)",
            self.login_refusals.clone(),
        );
    }

    pub(crate) fn count_login_refusal(&self, reason: &'static str) {
        self.login_refusals
            .get_or_create(&vec![("reason", reason)])
            .inc();
    }

    /// Shows `listener` in `spillway_tls_handshake_failures_total` (at 0
    /// until its first failure): called when a TLS listener starts.
    pub(crate) fn declare_tls_listener(&self, listener: &'static str) {
        let _ = self
            .tls_handshake_failures
            .get_or_create(&vec![("listener", listener)]);
    }

    pub(crate) fn count_tls_handshake_failure(&self, listener: &'static str) {
        self.tls_handshake_failures
            .get_or_create(&vec![("listener", listener)])
            .inc();
    }

    /// TLS handshakes that failed on `listener` so far.
    pub fn tls_handshake_failures(&self, listener: &'static str) -> u64 {
        self.tls_handshake_failures
            .get_or_create(&vec![("listener", listener)])
            .get()
    }

    pub fn write_timeouts(&self) -> u64 {
        self.write_timeouts.get()
    }

    pub fn unfinished_content(&self) -> i64 {
        self.unfinished_content.get()
    }

    pub fn unfinished_content_closes(&self) -> u64 {
        self.unfinished_content_closes.get()
    }

    pub(crate) fn count_write_timeout(&self) {
        self.write_timeouts.inc();
    }

    pub(crate) fn count_unfinished_content_close(&self) {
        self.unfinished_content_closes.inc();
    }

    /// One connection or channel refused by `limit`.
    pub(crate) fn count_refusal(&self, limit: &'static str) {
        self.refusals.count(limit);
    }

    /// Refusals by `limit` so far.
    pub fn refusals(&self, limit: &str) -> u64 {
        self.refusals.get(limit)
    }

    pub fn blocked(&self) -> i64 {
        self.blocked.get()
    }

    pub fn connections(&self) -> i64 {
        self.connections.get()
    }

    pub fn channels(&self) -> i64 {
        self.channels.get()
    }

    pub fn published(&self) -> u64 {
        self.published.get()
    }

    pub fn delivered(&self) -> u64 {
        self.delivered.get()
    }

    pub fn acknowledged(&self) -> u64 {
        self.acknowledged.get()
    }

    /// Counts one open AMQP 1.0 connection until the guard is dropped
    /// (beside [`Self::connection_opened`]).
    pub(crate) fn amqp1_connection_opened(&self) -> Held {
        Held::new(&self.amqp1_connections)
    }

    /// Counts one begun AMQP 1.0 session until the guard is dropped.
    pub(crate) fn amqp1_session_begun(&self) -> Held {
        Held::new(&self.amqp1_sessions)
    }

    /// Counts one attached AMQP 1.0 link until the guard is dropped.
    pub(crate) fn amqp1_link_attached(&self) -> Held {
        Held::new(&self.amqp1_links)
    }

    /// A message an AMQP 1.0 client sent, handed to the engine (a 0-9-1
    /// publish is counted by [`Self::counter_for`]).
    pub(crate) fn count_published(&self) {
        self.published.inc();
    }

    /// A settlement an AMQP 1.0 client sent, handed to the engine as an
    /// ack or a nack.
    pub(crate) fn count_acknowledged(&self) {
        self.acknowledged.inc();
    }

    pub fn amqp1_connections(&self) -> i64 {
        self.amqp1_connections.get()
    }

    pub fn amqp1_sessions(&self) -> i64 {
        self.amqp1_sessions.get()
    }

    pub fn amqp1_links(&self) -> i64 {
        self.amqp1_links.get()
    }

    /// Counts one open connection until the guard is dropped.
    pub(crate) fn connection_opened(&self) -> OpenConnection {
        self.connections.inc();
        OpenConnection {
            connections: self.connections.clone(),
            channels: self.channels.clone(),
            open_channels: 0,
            blocked_gauge: self.blocked.clone(),
            paused_gauge: self.paused.clone(),
            blocked_seconds: self.blocked_seconds.clone(),
            blocked_since: None,
            paused: false,
            unfinished_gauge: self.unfinished_content.clone(),
            unfinished: 0,
        }
    }

    /// The counter a command sent to the engine adds to, if any.
    pub(crate) fn counter_for(&self, command: &SessionCommand) -> Option<&Counter> {
        match command.command.as_ref()? {
            Command::Publish(_) => Some(&self.published),
            Command::Ack(_) | Command::Nack(_) => Some(&self.acknowledged),
            _ => None,
        }
    }

    /// A publish whose body the gateway compressed: one more, and the bytes
    /// it saved.
    pub(crate) fn count_compression(&self, command: &SessionCommand) {
        if let Some(Command::Publish(publish)) = command.command.as_ref() {
            if publish.body_encoding != spillway_proto::body::ENCODING_IDENTITY {
                self.compressed.inc();
                self.compression_saved_bytes
                    .inc_by(publish.body_size.saturating_sub(publish.body.len() as u64));
            }
        }
    }

    pub fn compressed(&self) -> u64 {
        self.compressed.get()
    }

    /// `count` deliveries reached a client's socket.
    pub(crate) fn count_delivered(&self, count: u32) {
        self.delivered.inc_by(u64::from(count));
    }
}

/// One in a gauge until dropped.
pub(crate) struct Held(Gauge);

impl Held {
    fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One open connection in the gauges; dropping it takes the connection and
/// the channels it still counts out of them.
pub(crate) struct OpenConnection {
    connections: Gauge,
    channels: Gauge,
    open_channels: i64,
    blocked_gauge: Gauge,
    paused_gauge: Gauge,
    blocked_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    blocked_since: Option<std::time::Instant>,
    paused: bool,
    unfinished_gauge: Gauge,
    unfinished: i64,
}

impl OpenConnection {
    /// The connection now holds `bytes` of partly received bodies.
    pub(crate) fn set_unfinished(&mut self, bytes: u64) {
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        if bytes != self.unfinished {
            self.unfinished_gauge.inc_by(bytes - self.unfinished);
            self.unfinished = bytes;
        }
    }

    /// The connection now has `open` channels.
    pub(crate) fn set_channels(&mut self, open: usize) {
        let open = i64::try_from(open).unwrap_or(i64::MAX);
        if open != self.open_channels {
            self.channels.inc_by(open - self.open_channels);
            self.open_channels = open;
        }
    }
}

impl OpenConnection {
    /// The connection's flow-control state after a step: blocked since when
    /// (if it is), and whether its socket is left unread.
    pub(crate) fn set_flow(&mut self, blocked_since: Option<std::time::Instant>, paused: bool) {
        match (self.blocked_since, blocked_since) {
            (None, Some(_)) => {
                self.blocked_gauge.inc();
            }
            (Some(since), None) => {
                self.blocked_gauge.dec();
                self.blocked_seconds.inc_by(since.elapsed().as_secs_f64());
            }
            _ => {}
        }
        self.blocked_since = blocked_since;
        if paused != self.paused {
            if paused {
                self.paused_gauge.inc();
            } else {
                self.paused_gauge.dec();
            }
            self.paused = paused;
        }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.set_flow(None, false);
        self.set_unfinished(0);
        self.channels.dec_by(self.open_channels);
        self.connections.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spillway_proto::engine as pb;

    #[test]
    fn connection_guard_keeps_the_gauges_exact() {
        let metrics = GatewayMetrics::new();
        let mut first = metrics.connection_opened();
        let mut second = metrics.connection_opened();
        first.set_channels(3);
        second.set_channels(1);
        first.set_channels(2);
        assert_eq!((metrics.connections(), metrics.channels()), (2, 3));
        drop(first);
        assert_eq!((metrics.connections(), metrics.channels()), (1, 1));
        drop(second);
        assert_eq!((metrics.connections(), metrics.channels()), (0, 0));
    }

    #[test]
    fn publish_and_acks_pick_their_counters() {
        let metrics = GatewayMetrics::new();
        let command = |command| SessionCommand {
            command: Some(command),
        };
        for sent in [
            command(Command::Publish(pb::Publish::default())),
            command(Command::Ack(pb::Ack::default())),
            command(Command::Nack(pb::Nack::default())),
            command(Command::Qos(pb::Qos::default())),
        ] {
            if let Some(counter) = metrics.counter_for(&sent) {
                counter.inc();
            }
        }
        metrics.count_delivered(5);
        assert_eq!(
            (
                metrics.published(),
                metrics.acknowledged(),
                metrics.delivered()
            ),
            (1, 2, 5)
        );
        let registry = Metrics::new();
        metrics.register(&registry);
        let text = registry.encode().unwrap();
        for line in [
            "spillway_connections 0\n",
            "spillway_channels 0\n",
            "spillway_messages_published_total 1\n",
            "spillway_messages_delivered_total 5\n",
            "spillway_messages_acknowledged_total 2\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
