//! What the wiring hands the engine: [`EngineConfig`], built once from the
//! settings and held by the engine and its broker, and the users a new
//! store starts with ([`SeedUser`]). A leaf: it imports none of the
//! engine's state.

use std::sync::Arc;
use std::time::Duration;

use spillway_proto::util::clock::{SharedClock, SystemClock};
use spillway_telemetry::MemoryCeiling;

use crate::budget;
use crate::persistence::WriterLimits;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Deliveries one gateway session may have in flight (not yet written to
    /// the client's socket) before the engine pauses its consumers.
    pub session_credit: u32,
    /// The same bound in bytes (`engine.session_credit_bytes`): bodies plus
    /// a fixed overhead per delivery.
    pub session_credit_bytes: u64,
    /// Message bytes the engine keeps in memory before payloads flow to
    /// disk (`engine.flow_to_disk_threshold`).
    pub flow_to_disk_threshold: u64,
    /// How often flow to disk is re-evaluated (`engine.housekeeping_interval`).
    pub housekeeping_interval: Duration,
    /// How long a delivery may stay unacked before its channel is closed
    /// (`engine.consumer_timeout`; None = for ever).
    pub consumer_timeout: Option<Duration>,
    /// Deliveries after which a message that comes back is dead-lettered,
    /// for queues without a delivery limit of their own
    /// (`engine.default_maximum_delivery_count`; 0 = no limit).
    pub default_max_deliveries: u64,
    /// Vhost, user and per-connection limits (`engine.default_vhost_max_connections`, ...).
    pub limits: crate::limits::LimitConfig,
    /// The bound of the store writer's queue (`engine.store_writer_max_writes`,
    /// `engine.store_writer_max_bytes`).
    pub writer_limits: WriterLimits,
    /// How long the engine's lease on the store lasts unless renewed; it is
    /// renewed every fifth of that.
    pub lease_ttl: Duration,
    /// Transactions: their size limit, unroutable mandatory messages in
    /// them, and the default timeouts (`engine.max_transaction_bytes`, ...).
    pub transactions: crate::transaction::TxConfig,
    /// Publisher pacing (`engine.publisher_pacing_window`,
    /// `engine.publisher_pacing_stall`; docs/flow-control.md).
    pub pacing: crate::pacing::PacingConfig,
    /// The largest message body (`gateway.max_message_size`): a compressed
    /// body that declares more is not decoded (management's peek).
    pub max_message_size: u64,
    /// The users a store without any gets on its first start (the
    /// configuration's `[[engine.users]]`), each with every permission in
    /// the default vhost.
    pub seed_users: Vec<SeedUser>,
    /// The process's memory ceiling (`engine.memory_high_watermark`): the
    /// engine counts its message bytes against it, and above it blocks
    /// publishers and refuses new connections.
    pub memory_ceiling: Arc<MemoryCeiling>,
    /// Time as the broker reads it: TTLs, timeouts, blocked durations
    /// (the system's; a manual one in tests).
    pub clock: SharedClock,
}

/// A user of the configuration (`[[engine.users]]`), stored when the store
/// has no users yet, then managed through management.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct SeedUser {
    pub name: String,
    /// Plain text here; stored as a salted hash.
    pub password: String,
    /// RabbitMQ's user tags (`administrator`, `monitoring`, `management`).
    #[serde(default)]
    pub tags: Vec<String>,
    /// Like RabbitMQ's guest: only accepted from a loopback address.
    #[serde(default)]
    pub loopback_only: bool,
}

impl SeedUser {
    /// RabbitMQ's default user: guest/guest, administrator, from loopback only.
    pub fn guest() -> Self {
        Self {
            name: "guest".into(),
            password: "guest".into(),
            tags: vec!["administrator".into()],
            loopback_only: true,
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            session_credit: 2048,
            session_credit_bytes: DEFAULT_SESSION_CREDIT_BYTES,
            flow_to_disk_threshold: budget::default_threshold(),
            housekeeping_interval: Duration::from_secs(1),
            consumer_timeout: Some(DEFAULT_CONSUMER_TIMEOUT),
            default_max_deliveries: 0,
            limits: crate::limits::LimitConfig::default(),
            writer_limits: WriterLimits::default(),
            lease_ttl: DEFAULT_LEASE_TTL,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            seed_users: vec![SeedUser::guest()],
            transactions: crate::transaction::TxConfig::default(),
            pacing: crate::pacing::PacingConfig::default(),
            memory_ceiling: MemoryCeiling::unlimited(),
            clock: SystemClock::shared(),
        }
    }
}

/// The largest message body by default, as the gateway's: 128 MiB.
pub const DEFAULT_MAX_MESSAGE_SIZE: u64 = 128 * 1024 * 1024;

/// How long an engine's lease on its store lasts unless renewed.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);

/// Delivery bytes in flight to one connection, by default: 8 MiB.
pub const DEFAULT_SESSION_CREDIT_BYTES: u64 = 8 * 1024 * 1024;

/// RabbitMQ's default `consumer_timeout`: 30 minutes.
pub const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);
