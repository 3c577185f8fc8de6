//! A deterministic simulation of the storage group, the engine's storage
//! client and the lease, under seeded faults (`make sim`, docs/replication.md).
//!
//! What runs is the real code: three members, each openraft over the
//! group's own log and state machine (`spillway_storage::group`) on a
//! RocksDB held in memory ([`RocksStore::open_in_memory`]), and engines
//! that write through the engine's own client of the group
//! ([`spillway_proto::storage::GroupStorage`]). What is simulated:
//!
//! - the network ([`network`]): every message delayed, some lost, cuts
//!   between hosts; the members reach each other through the same
//!   handlers the gRPC service calls;
//! - the clock: tokio's, paused, so simulated seconds pass as fast as the
//!   work allows and every timer fires in a fixed order;
//! - chance: the fault schedule, the network's draws, openraft's election
//!   timeouts and tokio's own choices all come from the seed, so a seed
//!   replays exactly (the run's history digest is the same).
//!
//! A run: the faults of its schedule for a while (members crashed and
//! restarted, hosts cut off and reconnected, engines killed and replaced),
//! then every fault healed and every member caught up. The [`oracle`]
//! checks after every step; a broken guarantee ends the run with its seed.
//!
//! [`RocksStore::open_in_memory`]: spillway_storage::RocksStore::open_in_memory

pub mod engine;
pub mod history;
pub mod network;
pub mod oracle;
mod run;
pub mod transport;

pub use oracle::Violation;
pub use run::{run_seed, Failure, Report, Settings};
