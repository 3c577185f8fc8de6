//! The storage node's services: `Storage` (the engine's store) and
//! `StorageGroup` (a group's membership and its members' Raft traffic).
//!
//! Beside the generated types and services, the hand-written code of this
//! boundary:
//! - `api.rs`: [`StorageApi`], the engine's view of the store, and
//!   [`QuotaStream`];
//! - `remote.rs`: [`RemoteStorage`], one storage node over gRPC;
//! - `group.rs`: [`GroupStorage`], the client of a storage group that
//!   follows its leader, beside the group's contract it follows.

mod generated {
    #![allow(clippy::all, missing_docs)]
    include!("../generated/spillway.storage.v1.rs");
}
pub use generated::*;

mod api;
mod group;
mod remote;

pub use api::{QuotaStream, StorageApi};
pub use group::GroupStorage;
pub use remote::RemoteStorage;
