//! The queue engine: owns vhosts, exchanges, bindings, queues, consumers,
//! unacknowledged deliveries and the order of every queue. It never touches
//! the disk: what must survive a restart goes to the storage node through
//! [`StorageApi`], in order, group-committed.
//!
//! - [`Engine`] is the in-process [`EngineApi`]: the all-in-one broker's
//!   gateway calls it directly.
//! - [`EngineService`] serves the same engine over gRPC to gateways in other
//!   processes.
//!
//! [`Engine::queue_stats`] reads every queue's figures under the lock, and
//! [`Engine::register_metrics`] puts them on `/metrics`.
//!
//! It also owns the memory budget for message bytes: past
//! `engine.flow_to_disk_threshold` payloads flow to the storage node and are
//! read back ahead of their consumers ([`budget`], `broker/flow_to_disk.rs`).
//! [`EngineAdminService`] serves the engine's side of the management API
//! (`admin/`, a module per resource) to a management service in another process; in-process,
//! [`Engine`] is the management service's `EngineAdminApi` itself.
//!
//! The limits on what clients may open (per vhost, per user, per
//! connection) are checked under the same lock (`limits.rs`, [`LimitConfig`];
//! the checks in `broker/limits.rs`).
//!
//! Inside, from the top down:
//! - `engine.rs` starts the engine and runs its background tasks;
//!   `shared.rs` is what every session and task shares (the broker behind
//!   its one lock, the store writer, users); `recovery.rs` the start-up from
//!   what the store kept; `session.rs` one task per client connection, which
//!   applies its commands in order and sends replies and deliveries back as
//!   events;
//! - `broker/`: the `Broker`, every operation a session can perform, one
//!   file per concern;
//! - the state the broker is made of, each part in its own file that no
//!   lower one imports: `routing.rs`, `vhost.rs`, `exchange.rs` and
//!   `bindings.rs`, `channels.rs` (sessions and channels), `queue.rs` (and
//!   its ready messages in priority order, `ready.rs`), `transaction.rs`,
//!   `pacing.rs`, `limits.rs`, and policies (`policy.rs`: what one is, what
//!   it matches, how its keys combine with a queue's arguments);
//! - at the bottom, plain data (`model.rs`), the memory budget
//!   (`budget.rs`), delivery credit (`credit.rs`) and the ordered pipe to
//!   the store (`persistence.rs`).
//!
//! [`StorageApi`]: spillway_proto::storage::StorageApi
//! [`EngineApi`]: spillway_proto::engine::EngineApi

pub mod access;
mod admin;
mod alarms;
mod argument_values;
mod bindings;
mod broker;
pub mod budget;
mod channels;
mod config;
mod credit;
mod engine;
mod exchange;
mod format;
mod limits;
mod model;
mod pacing;
mod persistence;
mod policy;
mod queue;
mod ready;
mod recovery;
mod routing;
mod service;
mod session;
mod settings;
mod shared;
mod stats;
#[cfg(test)]
mod tests;
mod transaction;
mod vhost;
mod walk;

pub use admin::EngineAdminService;
pub use broker::flow_to_disk::FlowStatus;
pub use broker::producer_flow::BlockedChannel;
pub use config::{EngineConfig, DEFAULT_LEASE_TTL, DEFAULT_MAX_MESSAGE_SIZE};
pub use engine::{Engine, EngineError};
pub use format::thousands;
pub use limits::LimitConfig;
pub use pacing::{PacingConfig, PacingStats, DEFAULT_PACING_STALL, DEFAULT_PACING_WINDOW};
pub use persistence::{
    StoreFailure, WriterLimits, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_QUEUED_WRITES,
};
pub use service::EngineService;
pub use settings::{
    EngineSettings, SeedUser, DEFAULT_CONSUMER_TIMEOUT, DEFAULT_SESSION_CREDIT_BYTES,
};
pub use stats::QueueStats;
pub use transaction::{TxConfig, TxTimeouts, DEFAULT_MAX_TRANSACTION_BYTES};
