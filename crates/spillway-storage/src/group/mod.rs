//! A storage group: several storage nodes that replicate one store through a
//! Raft log, with openraft 0.9 doing the consensus.
//!
//! - A log entry is a [`Command`]: one engine write batch, or a change of
//!   the engine lease. It is committed once a majority of the members has it
//!   on disk (`log.rs` appends with an fsync), then every member applies it
//!   to its own RocksDB (`machine.rs`), in log order.
//! - The node the engine talks to answers a write once the batch is
//!   committed and applied there, so a confirm never rests on one disk.
//! - The lease and its epoch are log entries, and every batch's epoch is
//!   checked as it is applied: the same decision on every member, so a
//!   deposed engine's batch is refused everywhere, whoever leads.
//! - A member that starts empty after its group ran (a lost disk) rejoins
//!   under its own id, but votes only once it has caught up (`rejoin.rs`).
//! - Members talk to each other over the `StorageGroup` gRPC service
//!   (`network.rs`, `service.rs`), with the cluster's secret or mutual TLS.
//!   That is one [`GroupTransport`]; the simulation (`spillway-sim`) brings
//!   its own, and seeds the election timeouts (`runtime.rs`).
//!
//! [`StorageGroup`] is the node's handle: the [`StorageApi`] the storage
//! service serves when `storage.members` is set.
//!
//! [`StorageApi`]: spillway_proto::storage::StorageApi

// openraft's traits fix the error type, `StorageError` (over 200 bytes);
// it is only ever built on the way to a failed member.
#[allow(clippy::result_large_err)]
mod log;
#[allow(clippy::result_large_err)]
mod machine;
mod network;
pub(crate) mod node;
mod rejoin;
pub mod runtime;
mod service;
mod transport;
mod types;

pub use node::{GroupError, GroupSettings, LogLevels, LoggedEntry, StorageGroup, VoteWithheld};
pub use service::StorageGroupService;
pub use transport::{GroupTransport, GrpcTransport};
pub use types::{Command, GroupConfig, Outcome};
