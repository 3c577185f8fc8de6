//! The storage node: the one component that touches the disk.
//!
//! It owns a RocksDB database holding durable exchanges, queues and bindings
//! and the messages the engine hands over (persistent messages on durable
//! queues). It knows nothing of AMQP: it stores what the engine sends, in the
//! order the engine sends it, and reports disk usage against its quota
//! (`storage.overfull_size`, `MST-1008`/`MST-1009`), streamed to the engine.
//!
//! - [`RocksStore`]: the database and the in-process [`StorageApi`] the
//!   all-in-one broker calls directly.
//! - [`StorageService`]: the same store served over gRPC for the engine when
//!   the components run as separate processes.
//! - [`RocksStore::register_metrics`]: its disk usage on `/metrics`.
//! - [`StorageSettings`]: the `[storage]` section of the configuration.
//! - [`MemoryStore`]: the same [`StorageApi`] kept in memory, for tests of
//!   the engine where RocksDB is not what is being tested.
//! - [`group`]: several storage nodes replicating the store through a Raft
//!   log ([`StorageGroup`], served by [`StorageService::grouped`] and
//!   [`StorageGroupService`]).
//!
//! [`StorageApi`]: spillway_proto::storage::StorageApi

mod delayed;
pub mod group;
mod keys;
mod lease;
mod memory;
mod metrics;
mod quota;
mod service;
mod settings;
mod store;
#[cfg(test)]
mod test_ops;

pub use group::{GroupSettings, StorageGroup, StorageGroupService};
pub use memory::MemoryStore;
pub use service::{StorageService, MIN_APPLIED_HEADER};
pub use settings::StorageSettings;
pub use store::{RocksStore, StoreError, StoreMemory, BLOCK_CACHE_BYTES, MEMTABLE_BYTES};
