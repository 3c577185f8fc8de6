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
//! `broker.flow_to_disk_threshold` payloads flow to the storage node and are
//! read back ahead of their consumers ([`budget`], `flow`).
//! [`EngineAdminService`] serves the engine's side of the management API
//! (`admin.rs`) to a management service in another process; in-process,
//! [`Engine`] is the management service's `EngineAdminApi` itself.
//!
//! The limits on what clients may open (per vhost, per user, per
//! connection) are checked under the same lock (`limits.rs`, [`LimitConfig`]).
//!
//! Inside, one lock guards the [`broker::Broker`] state; each client
//! connection is a session task (`session.rs`) that applies its commands in
//! order and sends replies and deliveries back as events. `engine.rs` holds
//! the shared state and its background tasks, `recovery.rs` the start-up
//! from what the store kept.
//!
//! [`StorageApi`]: spillway_proto::StorageApi
//! [`EngineApi`]: spillway_proto::EngineApi

pub mod access;
mod access_admin;
mod admin;
mod bindings;
pub mod broker;
pub mod budget;
mod credit;
mod engine;
mod flow;
mod limits;
mod model;
mod persistence;
mod producer_flow;
mod recovery;
pub mod routing;
mod service;
mod session;
mod stats;
#[cfg(test)]
mod tests;

pub use admin::EngineAdminService;
pub use broker::{
    PacingConfig, PacingStats, TxConfig, TxTimeouts, DEFAULT_MAX_TRANSACTION_BYTES,
    DEFAULT_PACING_STALL, DEFAULT_PACING_WINDOW,
};
pub use engine::{
    Engine, EngineConfig, EngineError, SeedUser, DEFAULT_CONSUMER_TIMEOUT, DEFAULT_LEASE_TTL,
    DEFAULT_SESSION_CREDIT_BYTES,
};
pub use flow::FlowStatus;
pub use limits::LimitConfig;
pub use persistence::{
    StoreFailure, WriterLimits, DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_QUEUED_WRITES,
};
pub use producer_flow::{thousands, BlockedChannel};
pub use service::EngineService;
pub use stats::QueueStats;
