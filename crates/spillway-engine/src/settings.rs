//! The engine's settings: the configuration's `[engine]` section, declared
//! here once (keys, defaults, accepted formats, what each means) and handed
//! to [`Engine::start`](crate::Engine::start) as read, inside
//! [`EngineConfig`](crate::EngineConfig). What the engine derives from them
//! (the flow-to-disk threshold in force, limits, pacing, transactions, the
//! store writer's bound) is derived here too, in one place. A leaf: it
//! imports none of the engine's state.
//!
//! The addresses and `standby` are read by the wiring that starts the
//! engine (where it listens, which storage node it dials, whether it stands
//! by), not by the engine itself; they are declared here all the same, so
//! the section has one home.

use std::time::Duration;

use serde::Deserialize;
use spillway_telemetry::formats::{durations, list_or_commas, sizes};

use crate::budget;
use crate::limits::LimitConfig;
use crate::pacing::{PacingConfig, DEFAULT_PACING_STALL, DEFAULT_PACING_WINDOW};
use crate::persistence::{WriterLimits, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_QUEUED_WRITES};
use crate::transaction::{TxConfig, TxTimeouts, DEFAULT_MAX_TRANSACTION_BYTES};

/// The queue engine: its addresses, its sessions' credit, the memory budget
/// (flow to disk), limits, transactions, publisher pacing and the seed users.
/// Qpid's `broker.*` names are read as these (the wiring's aliases).
#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct EngineSettings {
    /// The engine's gRPC address for gateways, when it runs alone.
    pub listen: String,
    /// The storage node's gRPC address, when the engine runs alone.
    pub storage_addr: String,
    /// Every member of a storage group (`docs/replication.md`): the engine
    /// finds the leader among them. A list, or one comma-separated string
    /// (`SPILLWAY_ENGINE__STORAGE_ADDRS`). Empty: `storage_addr` alone.
    #[serde(deserialize_with = "list_or_commas")]
    pub storage_addrs: Vec<String>,
    /// Stand by while another engine holds the store's lease, however
    /// long, and take over when it lapses (several engines for one store,
    /// `docs/replication.md`). False: give up after twice the lease's TTL
    /// (one engine per store; another one there is a mistake).
    pub standby: bool,
    /// Deliveries in flight to one connection (not yet written to the
    /// client's socket) before the engine waits for the gateway to write
    /// them.
    pub session_credit: u32,
    /// The same bound in bytes: bodies plus a fixed overhead per delivery;
    /// a size (`8MiB`).
    #[serde(deserialize_with = "sizes::required")]
    pub session_credit_bytes: u64,
    /// Writes queued for the storage node at most before publishers wait.
    pub store_writer_max_writes: u64,
    /// The same bound in encoded bytes: a size (`64MiB`).
    #[serde(deserialize_with = "sizes::required")]
    pub store_writer_max_bytes: u64,
    /// The seed of the user database: stored by the engine when its store
    /// has no users, each with every permission in the default vhost.
    pub users: Vec<SeedUser>,
    /// Resident message bytes above which payloads flow to disk. Unset: 40%
    /// of the memory available to the process (its cgroup limit, else
    /// physical memory). Plain bytes or with a unit: `268435456`, `256MiB`.
    #[serde(deserialize_with = "sizes::optional")]
    pub flow_to_disk_threshold: Option<u64>,
    /// The process's memory ceiling: above this many bytes held for clients
    /// (message bytes, transactions, partly received bodies, read buffers),
    /// every connection that publishes is blocked and new connections are
    /// refused. Unset: 60% of the memory available, and never below one and
    /// a half times the flow-to-disk threshold; `0` turns it off.
    #[serde(deserialize_with = "sizes::optional")]
    pub memory_high_watermark: Option<u64>,
    /// How often flow to disk is re-evaluated: `1s`, `250ms`, or plain
    /// milliseconds.
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub housekeeping_interval: Duration,
    /// How long a delivery may stay unacked before its channel is closed
    /// with 406 and its messages requeued: `30m`, or plain milliseconds;
    /// 0 turns it off.
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub consumer_timeout: Duration,
    /// Deliveries after which a message that comes back (rejected or nacked
    /// with requeue, recovered, or returned by a closed channel) is
    /// dead-lettered instead of requeued, for queues that set no limit of
    /// their own (Qpid's `queue.maximumDeliveryAttempts`); 0 = no limit.
    pub default_maximum_delivery_count: u64,
    /// Limits (docs/limits.md); 0 = no limit. Vhost and user limits are
    /// defaults that management can override per vhost or user.
    pub default_vhost_max_connections: u32,
    pub default_vhost_max_queues: u32,
    pub default_vhost_max_exchanges: u32,
    pub default_vhost_max_bindings: u32,
    pub default_vhost_max_consumers: u32,
    pub default_user_max_connections: u32,
    pub default_user_max_channels: u32,
    pub default_user_max_consumers: u32,
    pub max_consumers_per_connection: u32,
    pub max_queues_per_connection: u32,
    /// Message bytes one transaction may hold before commit (as the memory
    /// budget counts them: body, properties, names, 192 bytes each); a publish
    /// that would pass it closes the channel with 406 (docs/transactions.md).
    #[serde(deserialize_with = "sizes::required")]
    pub max_transaction_bytes: u64,
    /// An unroutable mandatory message published in a transaction closes
    /// the connection with 312 NO_ROUTE, as Qpid does; false: basic.return,
    /// as RabbitMQ does.
    pub close_when_no_route: bool,
    /// Producer transaction timeouts for every vhost (management can set a
    /// vhost's own): warn (`CHN-1007`) / close (506) a transaction open this
    /// long, warn (`CHN-1008`) / close one idle this long. Plain
    /// milliseconds or `30s`; 0 = off.
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub default_transaction_open_warn: Duration,
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub default_transaction_open_close: Duration,
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub default_transaction_idle_warn: Duration,
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub default_transaction_idle_close: Duration,
    /// Publisher pacing (docs/flow-control.md#publisher-pacing): messages a
    /// queue with consumers may get ahead of its deliveries before its
    /// publishers wait for it; 0 turns pacing off.
    pub publisher_pacing_window: u32,
    /// How long a queue may deliver nothing while a publisher waits on it
    /// before pacing is suspended for it (until its next delivery): `100ms`,
    /// or plain milliseconds.
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub publisher_pacing_stall: Duration,
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50061".into(),
            storage_addr: "http://127.0.0.1:50071".into(),
            storage_addrs: Vec::new(),
            standby: false,
            session_credit: 2048,
            session_credit_bytes: DEFAULT_SESSION_CREDIT_BYTES,
            store_writer_max_writes: DEFAULT_MAX_QUEUED_WRITES,
            store_writer_max_bytes: DEFAULT_MAX_QUEUED_BYTES,
            users: vec![SeedUser::guest()],
            flow_to_disk_threshold: None,
            memory_high_watermark: None,
            housekeeping_interval: Duration::from_secs(1),
            consumer_timeout: DEFAULT_CONSUMER_TIMEOUT,
            default_maximum_delivery_count: 0,
            default_vhost_max_connections: 0,
            default_vhost_max_queues: 0,
            default_vhost_max_exchanges: 0,
            default_vhost_max_bindings: 0,
            default_vhost_max_consumers: 0,
            default_user_max_consumers: 0,
            default_user_max_connections: 0,
            default_user_max_channels: 0,
            max_consumers_per_connection: 0,
            max_queues_per_connection: 0,
            max_transaction_bytes: DEFAULT_MAX_TRANSACTION_BYTES,
            close_when_no_route: true,
            default_transaction_open_warn: Duration::ZERO,
            default_transaction_open_close: Duration::ZERO,
            default_transaction_idle_warn: Duration::ZERO,
            default_transaction_idle_close: Duration::ZERO,
            publisher_pacing_window: DEFAULT_PACING_WINDOW,
            publisher_pacing_stall: DEFAULT_PACING_STALL,
        }
    }
}

impl EngineSettings {
    /// The flow-to-disk threshold in force: the configured one, else 40% of
    /// the memory available.
    pub fn flow_to_disk_threshold(&self) -> u64 {
        self.flow_to_disk_threshold
            .unwrap_or_else(budget::default_threshold)
    }

    /// The memory ceiling in force (0: none): the configured one, else 60%
    /// of the memory available but at least one and a half times the
    /// flow-to-disk threshold, so that flow to disk acts first.
    pub fn memory_high_watermark(&self) -> u64 {
        self.memory_high_watermark.unwrap_or_else(|| {
            let threshold = self.flow_to_disk_threshold();
            let available = budget::available_memory().unwrap_or(threshold / 2 * 5);
            (available / 5 * 3).max(threshold.saturating_add(threshold / 2))
        })
    }

    /// The consumer timeout in force; None: off (`0`).
    pub fn consumer_timeout(&self) -> Option<Duration> {
        Some(self.consumer_timeout).filter(|timeout| !timeout.is_zero())
    }

    pub fn transactions(&self) -> TxConfig {
        TxConfig {
            max_bytes: self.max_transaction_bytes,
            close_when_no_route: self.close_when_no_route,
            default_timeouts: TxTimeouts {
                open_warn: self.default_transaction_open_warn,
                open_close: self.default_transaction_open_close,
                idle_warn: self.default_transaction_idle_warn,
                idle_close: self.default_transaction_idle_close,
            },
        }
    }

    pub fn pacing(&self) -> PacingConfig {
        PacingConfig {
            window: self.publisher_pacing_window,
            stall: self.publisher_pacing_stall,
        }
    }

    pub fn limits(&self) -> LimitConfig {
        LimitConfig {
            vhost_max_connections: self.default_vhost_max_connections,
            vhost_max_queues: self.default_vhost_max_queues,
            vhost_max_exchanges: self.default_vhost_max_exchanges,
            vhost_max_bindings: self.default_vhost_max_bindings,
            vhost_max_consumers: self.default_vhost_max_consumers,
            user_max_consumers: self.default_user_max_consumers,
            user_max_connections: self.default_user_max_connections,
            user_max_channels: self.default_user_max_channels,
            max_consumers_per_connection: self.max_consumers_per_connection,
            max_queues_per_connection: self.max_queues_per_connection,
        }
    }

    /// The bound of the store writer's queue.
    pub fn writer_limits(&self) -> WriterLimits {
        WriterLimits {
            max_writes: self.store_writer_max_writes,
            max_bytes: self.store_writer_max_bytes,
        }
    }
}

/// A user of the configuration (`[[engine.users]]`), stored when the store
/// has no users yet, then managed through management.
#[derive(Clone, Debug, Deserialize)]
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

/// Delivery bytes in flight to one connection, by default: 8 MiB.
pub const DEFAULT_SESSION_CREDIT_BYTES: u64 = 8 * 1024 * 1024;

/// RabbitMQ's default `consumer_timeout`: 30 minutes.
pub const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);
