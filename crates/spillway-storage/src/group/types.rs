//! What the group's Raft log carries, and openraft's type configuration.

use std::fmt;

use serde::{Deserialize, Serialize};

openraft::declare_raft_types!(
    /// The storage group's Raft types: [`Command`]s in the log, members
    /// named by their `storage.node_id` and reached at their address,
    /// snapshots streamed through a file.
    pub GroupConfig:
        D = Command,
        R = Outcome,
        NodeId = u64,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<GroupConfig>,
        SnapshotData = tokio::fs::File,
        AsyncRuntime = super::runtime::GroupRuntime,
);

/// One entry of the group's log.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum Command {
    /// An engine's write batch, as it sent it (an encoded `WriteBatch`).
    Write(#[serde(with = "serde_bytes")] Vec<u8>),
    /// A new lease: applied only if `epoch` is one above the store's.
    Lease {
        epoch: u64,
        holder: String,
        ttl_ms: u64,
    },
    /// The holder of `epoch` renews its lease.
    Renew { epoch: u64, ttl_ms: u64 },
    /// The holder of `epoch` ends its lease.
    Release { epoch: u64 },
}

impl fmt::Debug for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // A batch may be megabytes: its size says enough in a log.
            Command::Write(batch) => write!(f, "Write({} bytes)", batch.len()),
            Command::Lease { epoch, holder, .. } => write!(f, "Lease({epoch}, {holder})"),
            Command::Renew { epoch, .. } => write!(f, "Renew({epoch})"),
            Command::Release { epoch } => write!(f, "Release({epoch})"),
        }
    }
}

/// What applying a [`Command`] decided, the same on every member.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Outcome {
    /// Why it was refused (a stale lease epoch, a lease taken meanwhile);
    /// None: applied.
    pub refused: Option<String>,
    /// The lease epoch after it (lease commands).
    pub epoch: u64,
}
