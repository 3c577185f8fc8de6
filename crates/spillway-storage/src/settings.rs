//! The storage node's settings: the configuration's `[storage]` section,
//! declared here once (keys, defaults, accepted formats, what each means)
//! and read by the wiring as is. What the group takes from them
//! ([`GroupSettings`]: member ids as numbers, checked) is derived here too.
//! A leaf: it imports none of the store's state.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use spillway_telemetry::formats::{durations, sizes};

use crate::group::GroupSettings;

/// The storage node: where it listens and keeps its files, its disk quota,
/// and its place in a storage group.
#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct StorageSettings {
    /// The storage node's gRPC address for the engine, when it runs alone.
    pub listen: String,
    /// Where RocksDB keeps its files.
    pub data_dir: PathBuf,
    /// Create a new store when `data_dir` holds none. False: refuse to
    /// start (a data volume that is not mounted must not look like an
    /// empty broker).
    pub create_if_missing: bool,
    /// The disk quota (Qpid's `store.*` names): bytes on disk above which
    /// every producer is blocked (`MST-1008`). Unset: none.
    #[serde(deserialize_with = "sizes::optional")]
    pub overfull_size: Option<u64>,
    /// Bytes on disk below which they are released again (`MST-1009`).
    /// Unset: the overfull size.
    #[serde(deserialize_with = "sizes::optional")]
    pub underfull_size: Option<u64>,
    /// This node's id in its storage group (`docs/replication.md`); unique
    /// in the group, not 0.
    pub node_id: u64,
    /// The storage group's initial members: node id → the address the
    /// others reach that node's `storage.listen` at (`http://host:port`).
    /// Every member gets the same table. Empty: a single store, no group.
    pub members: BTreeMap<String, String>,
    /// How often a group's leader tells the others it leads; they elect
    /// another after four to eight of these without word.
    #[serde(deserialize_with = "durations::millis_or_text")]
    pub group_heartbeat: Duration,
    /// Log entries between a group's snapshots (the log is purged up to
    /// one; a member far behind catches up from it).
    pub group_snapshot_entries: u64,
    /// This node joins a storage group that runs already (added with
    /// `spillctl storage add-member`): it does not form one from
    /// `storage.members`, which then needs to name only this node.
    pub join: bool,
}

impl StorageSettings {
    /// The storage group this node belongs to, if `storage.members` is set;
    /// a refusal names the setting.
    pub fn group(&self) -> Result<Option<GroupSettings>, String> {
        if self.members.is_empty() {
            return Ok(None);
        }
        let mut members = BTreeMap::new();
        for (id, address) in &self.members {
            let id: u64 = id.parse().map_err(|_| {
                format!("storage.members: `{id}` is not a node id (a positive integer)")
            })?;
            if id == 0 {
                return Err("storage.members: node id 0 is not allowed".into());
            }
            members.insert(id, address.clone());
        }
        if !members.contains_key(&self.node_id) {
            return Err(format!(
                "storage.node_id {} is not one of storage.members ({})",
                self.node_id,
                members
                    .keys()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Ok(Some(GroupSettings {
            node_id: self.node_id,
            members,
            heartbeat: self.group_heartbeat,
            snapshot_entries: self.group_snapshot_entries,
            join: self.join,
        }))
    }
}

impl Default for StorageSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50071".into(),
            data_dir: PathBuf::from("./data"),
            create_if_missing: true,
            overfull_size: None,
            underfull_size: None,
            node_id: 0,
            members: BTreeMap::new(),
            group_heartbeat: Duration::from_millis(250),
            group_snapshot_entries: 5_000,
            join: false,
        }
    }
}
