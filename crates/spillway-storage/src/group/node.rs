//! [`StorageGroup`]: one member of a storage group, and the [`StorageApi`]
//! the storage service serves on it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use openraft::error::{ClientWriteError, Infallible, InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, ChangeMembers, Raft, ServerState};
use spillway_proto::cluster::ClusterClient;
use spillway_proto::management::SetStoreQuotaRequest;
use spillway_proto::storage::{
    write_op, AcquireLeaseRequest, Definitions, GroupMember, GroupStatus, Lease, MessageId,
    MessageRecord, QueueEntry, StoreStatus, WriteBatch, WriteOp,
};
use spillway_proto::{storage::StorageApi, ServiceError};

use tokio::time::Instant;

use super::log::GroupLog;
use super::machine::GroupMachine;
use super::rejoin::Rejoin;
use super::transport::{GroupTransport, GrpcTransport};
use super::types::{Command, GroupConfig, Outcome};
use crate::lease::Grant;
use crate::store::RocksStore;

/// How long a read waits for this member to apply the caller's last write.
const APPLY_WAIT: Duration = Duration::from_secs(5);
/// How long a new member may take to catch up before it is made a voter.
const CATCH_UP_WAIT: Duration = Duration::from_secs(120);
/// Deletes per log entry when orphans are removed.
const ORPHAN_DELETES_PER_ENTRY: usize = 10_000;

/// A member's place in its group (`storage.node_id`, `storage.members`).
#[derive(Clone, Debug)]
pub struct GroupSettings {
    /// This node's id, unique in the group.
    pub node_id: u64,
    /// The initial members: id → the address the others reach it at
    /// (`http://host:port`). Every member is started with the same table.
    pub members: BTreeMap<u64, String>,
    /// How often the leader tells the others it leads; an election starts
    /// after four to eight of these without word from it.
    pub heartbeat: Duration,
    /// Log entries between snapshots: the log is purged up to a snapshot
    /// (keeping a fifth of this many entries for members a little behind);
    /// a member further behind gets the snapshot.
    pub snapshot_entries: u64,
    /// The node joins a group that runs already: it never forms one, and
    /// waits until the leader adds it (`spillctl storage add-member`).
    pub join: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    #[error("storage.node_id {0} is not one of storage.members")]
    NotAMember(u64),
    #[error("storage.node_id must not be 0")]
    NodeIdZero,
    #[error("the storage group's settings are not valid: {0}")]
    Settings(String),
    #[error("the storage group's log or state cannot be read: {0}")]
    State(String),
}

/// How far a member's log reaches ([`StorageGroup::log_levels`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogLevels {
    /// It leads the group.
    pub leads: bool,
    /// Its log's last index.
    pub last_log: Option<u64>,
    /// The last index it applied.
    pub applied: Option<u64>,
}

/// One entry of a member's log ([`StorageGroup::applied_entries`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggedEntry {
    pub index: u64,
    /// The term of the leader that appended it.
    pub term: u64,
    /// None: a new leader's blank entry, or a membership change.
    pub command: Option<Command>,
}

/// A vote this member withholds: it started empty and has not caught up
/// (`rejoin.rs`). The caller answers UNAVAILABLE.
#[derive(Debug, thiserror::Error)]
#[error("this storage group member started empty and votes once it has caught up")]
pub struct VoteWithheld;

/// One member of a storage group. Cheap to clone.
#[derive(Clone)]
pub struct StorageGroup {
    inner: Arc<Inner>,
}

struct Inner {
    node_id: u64,
    raft: Raft<GroupConfig>,
    store: RocksStore,
    machine: GroupMachine,
    rejoin: Rejoin,
}

impl StorageGroup {
    /// Starts this member over `store` and, when the store has never been
    /// in a group, forms the group from `settings.members` (every member
    /// does so with the same table: openraft makes that safe).
    pub async fn start(
        store: RocksStore,
        settings: GroupSettings,
        cluster: ClusterClient,
    ) -> Result<Self, GroupError> {
        Self::start_over(store, settings, GrpcTransport::new(cluster)).await
    }

    /// [`StorageGroup::start`], reaching the other members through
    /// `transport` (the simulation's network, or gRPC).
    pub async fn start_over(
        store: RocksStore,
        settings: GroupSettings,
        transport: impl GroupTransport,
    ) -> Result<Self, GroupError> {
        if settings.node_id == 0 {
            return Err(GroupError::NodeIdZero);
        }
        if !settings.members.contains_key(&settings.node_id) {
            return Err(GroupError::NotAMember(settings.node_id));
        }
        let heartbeat = settings.heartbeat.as_millis().max(10) as u64;
        let config = openraft::Config {
            cluster_name: "spillway-storage".into(),
            heartbeat_interval: heartbeat,
            election_timeout_min: heartbeat * 4,
            election_timeout_max: heartbeat * 8,
            // Building a snapshot only records how far it reaches
            // (machine.rs); it lets the log be purged.
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(
                settings.snapshot_entries.max(10),
            ),
            max_in_snapshot_log_to_keep: settings.snapshot_entries.max(10) / 5,
            // Entries are write batches of up to a few MiB, and openraft
            // gives one AppendEntries a heartbeat's time: a member catching
            // up gets a few at a time, or it never gets there on loaded
            // cores.
            max_payload_entries: 8,
            // One snapshot chunk's time, the last one's (which installs the
            // snapshot: the member's records replaced) included. openraft's
            // 200 ms is no time for that, and a member that never finishes
            // never catches up.
            install_snapshot_timeout: 30_000,
            snapshot_max_chunk_size: 1024 * 1024,
            ..Default::default()
        };
        let config = Arc::new(
            config
                .validate()
                .map_err(|error| GroupError::Settings(error.to_string()))?,
        );
        let snapshots = store.path.join("snapshots");
        let machine = GroupMachine::open(store.clone(), Path::new(&snapshots))
            .map_err(|error| GroupError::State(error.to_string()))?;
        let starts_empty = machine.applied_nothing()
            && super::log::holds_nothing(&store)
                .map_err(|error| GroupError::State(error.to_string()))?;
        let others: Vec<String> = settings
            .members
            .iter()
            .filter(|(id, _)| **id != settings.node_id)
            .map(|(_, address)| address.clone())
            .collect();
        // Empty, while the others run a group: it was formed without this
        // member, or this member lost its disk. Either way it must not form
        // the group again, and it votes only once caught up (`rejoin.rs`).
        // Empty while none runs one: the group's first start.
        let running = if starts_empty && !settings.join {
            super::rejoin::running_group(&others, &transport).await
        } else {
            super::rejoin::RunningGroup::default()
        };
        let runs_already = running.runs;
        let state_error = |error: openraft::StorageError<u64>| GroupError::State(error.to_string());
        let rejoin = if !runs_already {
            Rejoin::settled()
        } else if super::log::marked_empty_start(&store).map_err(state_error)? {
            // It started empty before on this same store and has held
            // nothing since: it acknowledged nothing, so it lost nothing.
            tracing::info!(
                node_id = settings.node_id,
                "the storage group runs already: this member waits for its leader (it never held anything, so it votes)"
            );
            Rejoin::settled()
        } else {
            super::log::mark_empty_start(&store).map_err(state_error)?;
            tracing::info!(
                node_id = settings.node_id,
                floor = ?running.floor,
                "the storage group runs already: this member starts empty and waits for its leader"
            );
            Rejoin::catching_up(running.floor)
        };
        let raft = Raft::new(
            settings.node_id,
            config,
            transport.network(),
            GroupLog::new(store.clone()),
            machine.clone(),
        )
        .await
        .map_err(|error| GroupError::State(error.to_string()))?;
        let initialized = raft
            .is_initialized()
            .await
            .map_err(|error| GroupError::State(error.to_string()))?;
        if !initialized && !settings.join && !runs_already {
            let members: BTreeMap<u64, BasicNode> = settings
                .members
                .iter()
                .map(|(id, addr)| (*id, BasicNode::new(addr)))
                .collect();
            tracing::info!(node_id = settings.node_id, members = ?settings.members, "forming the storage group");
            if let Err(error) = raft.initialize(members).await {
                // Another member formed it first and reached this one.
                tracing::info!(%error, "storage group already formed");
            }
        }
        if settings.join && !initialized {
            tracing::info!(
                node_id = settings.node_id,
                "waiting to be added to a storage group"
            );
        }
        tokio::spawn(
            rejoin
                .clone()
                .watch(raft.metrics(), settings.node_id, transport),
        );
        tracing::info!(node_id = settings.node_id, "storage group member started");
        Ok(Self {
            inner: Arc::new(Inner {
                node_id: settings.node_id,
                raft,
                store,
                machine,
                rejoin,
            }),
        })
    }

    /// openraft's AppendEntries from the leader.
    pub async fn on_append_entries(
        &self,
        request: AppendEntriesRequest<GroupConfig>,
    ) -> Result<AppendEntriesResponse<u64>, RaftError<u64, Infallible>> {
        self.inner.raft.append_entries(request).await
    }

    /// openraft's RequestVote from a candidate; withheld while this member
    /// catches up after starting empty (`rejoin.rs`).
    pub async fn on_vote(
        &self,
        request: VoteRequest<u64>,
    ) -> Result<Result<VoteResponse<u64>, RaftError<u64, Infallible>>, VoteWithheld> {
        let candidate_term = request.vote.leader_id().term;
        let candidate_last_log = request
            .last_log_id
            .map(|log_id| (log_id.leader_id.term, log_id.index));
        if self
            .inner
            .rejoin
            .withholds_vote_for(candidate_term, candidate_last_log)
        {
            tracing::debug!(
                candidate = request.vote.leader_id().voted_for().unwrap_or(0),
                candidate_term,
                candidate_last_log = ?candidate_last_log,
                "vote withheld: this member started empty and has not caught up"
            );
            return Err(VoteWithheld);
        }
        Ok(self.inner.raft.vote(request).await)
    }

    /// openraft's InstallSnapshot (one chunk) from the leader.
    pub async fn on_install_snapshot(
        &self,
        request: InstallSnapshotRequest<GroupConfig>,
    ) -> Result<InstallSnapshotResponse<u64>, RaftError<u64, InstallSnapshotError>> {
        self.inner.raft.install_snapshot(request).await
    }

    /// How far this member's log reaches and how far it has applied it.
    pub fn log_levels(&self) -> LogLevels {
        let metrics = self.inner.raft.metrics().borrow().clone();
        LogLevels {
            leads: metrics.state == ServerState::Leader,
            last_log: metrics.last_log_index,
            applied: metrics.last_applied.map(|log_id| log_id.index),
        }
    }

    /// This member's id.
    pub fn node_id(&self) -> u64 {
        self.inner.node_id
    }

    /// The log entries this member has applied, from `from` on, in order:
    /// what an oracle compares between members. An entry purged since
    /// (behind a snapshot) is not among them.
    pub async fn applied_entries(&self, from: u64) -> Result<Vec<LoggedEntry>, GroupError> {
        // From the machine itself: a write is answered once applied there,
        // before openraft's metrics say so.
        let Some(applied) = self.inner.machine.last_applied() else {
            return Ok(Vec::new());
        };
        if from > applied {
            return Ok(Vec::new());
        }
        self.logged(from..=applied).await
    }

    /// The entries of this member's log after the last one it applied
    /// (appended, not known to be committed here yet).
    pub async fn unapplied_entries(&self) -> Result<Vec<LoggedEntry>, GroupError> {
        let from = self
            .inner
            .machine
            .last_applied()
            .map_or(0, |index| index + 1);
        self.logged(from..).await
    }

    async fn logged(
        &self,
        range: impl std::ops::RangeBounds<u64> + Clone + std::fmt::Debug + Send + Sync,
    ) -> Result<Vec<LoggedEntry>, GroupError> {
        use openraft::RaftLogReader as _;
        let mut log = GroupLog::new(self.inner.store.clone());
        let entries = log
            .try_get_log_entries(range)
            .await
            .map_err(|error| GroupError::State(error.to_string()))?;
        Ok(entries
            .into_iter()
            .map(|entry| LoggedEntry {
                index: entry.log_id.index,
                term: entry.log_id.leader_id.term,
                command: match entry.payload {
                    openraft::EntryPayload::Normal(command) => Some(command),
                    _ => None,
                },
            })
            .collect())
    }

    /// This member's store.
    pub fn store(&self) -> &RocksStore {
        &self.inner.store
    }

    /// Stops taking part in the group.
    pub async fn shutdown(&self) {
        if let Err(error) = self.inner.raft.shutdown().await {
            tracing::warn!(%error, "storage group member did not stop cleanly");
        }
    }

    /// Appends `command` to the log and waits until it is committed (on a
    /// majority's disks) and applied here: its log index and outcome.
    async fn propose(&self, command: Command) -> Result<(u64, Outcome), ServiceError> {
        match self.inner.raft.client_write(command).await {
            Ok(response) => Ok((response.log_id.index, response.data)),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(forward))) => Err(
                ServiceError::NotLeader(forward.leader_node.map(|n| n.addr).unwrap_or_default()),
            ),
            Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(error))) => {
                Err(ServiceError::FailedPrecondition(error.to_string()))
            }
            Err(RaftError::Fatal(error)) => Err(ServiceError::Unavailable(format!(
                "this storage group member has stopped: {error}"
            ))),
        }
    }

    /// Writes `batch` through the log: its log index once it is committed
    /// and applied here. A batch whose lease epoch is not the group's is
    /// refused (FAILED_PRECONDITION), the same on every member.
    pub async fn write_at(&self, batch: &WriteBatch) -> Result<u64, ServiceError> {
        use prost::Message as _;
        let started = Instant::now();
        let (index, outcome) = self.propose(Command::Write(batch.encode_to_vec())).await?;
        tracing::debug!(
            index,
            ops = batch.ops.len(),
            elapsed_us = started.elapsed().as_micros() as u64,
            "storage group write committed"
        );
        match outcome.refused {
            Some(reason) => Err(ServiceError::FailedPrecondition(reason)),
            None => Ok(index),
        }
    }

    /// Waits until this member has applied the log up to `index`, so that
    /// a read sees every write its caller was answered for.
    pub async fn wait_applied(&self, index: u64) -> Result<(), ServiceError> {
        if index == 0 {
            return Ok(());
        }
        self.inner
            .raft
            .wait(Some(APPLY_WAIT))
            .applied_index_at_least(Some(index), "a read behind its caller's writes")
            .await
            .map(|_| ())
            .map_err(|error| {
                ServiceError::Unavailable(format!(
                    "this storage group member has not applied up to log index {index}: {error}"
                ))
            })
    }

    /// The group as this member sees it.
    pub fn status(&self) -> GroupStatus {
        let metrics = self.inner.raft.metrics().borrow().clone();
        let leader = metrics.current_leader.unwrap_or(0);
        let last_log = metrics.last_log_index.unwrap_or(0);
        let membership = metrics.membership_config.membership();
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let replication = metrics.replication.clone().unwrap_or_default();
        let members = membership
            .nodes()
            .map(|(id, node)| {
                let role = if *id == leader {
                    "leader"
                } else if voters.contains(id) {
                    "follower"
                } else {
                    "learner"
                };
                let applied_index = if *id == self.inner.node_id {
                    metrics.last_applied.map(|log_id| log_id.index).unwrap_or(0)
                } else {
                    replication
                        .get(id)
                        .and_then(|matched| matched.map(|log_id| log_id.index))
                        .unwrap_or(0)
                };
                let lag = if metrics.state == ServerState::Leader {
                    last_log.saturating_sub(applied_index)
                } else {
                    0
                };
                GroupMember {
                    id: *id,
                    address: node.addr.clone(),
                    role: role.to_string(),
                    applied_index,
                    lag,
                }
            })
            .collect();
        GroupStatus {
            leader,
            members,
            node_id: self.inner.node_id,
            term: metrics.current_term,
            committed_index: metrics.last_applied.map(|log_id| log_id.index).unwrap_or(0),
            last_log_index: last_log,
        }
    }

    /// Adds node `id` at `address`: as a learner first, which catches up
    /// from a snapshot and the log, then as a voter.
    pub async fn add_member(&self, id: u64, address: &str) -> Result<GroupStatus, ServiceError> {
        if id == 0 {
            return Err(ServiceError::InvalidArgument(
                "a member id must not be 0".into(),
            ));
        }
        self.wait_membership_committed().await?;
        let node = BasicNode::new(address);
        self.change(self.inner.raft.add_learner(id, node, false).await)?;
        let started = Instant::now();
        loop {
            let metrics = self.inner.raft.metrics().borrow().clone();
            let last = metrics.last_log_index.unwrap_or(0);
            let matched = metrics
                .replication
                .as_ref()
                .and_then(|replication| replication.get(&id).cloned().flatten())
                .map(|log_id| log_id.index);
            if matched.is_some_and(|matched| last.saturating_sub(matched) < 64) {
                break;
            }
            if started.elapsed() > CATCH_UP_WAIT {
                return Err(ServiceError::Unavailable(format!(
                    "member {id} did not catch up within {} s (it stays a learner)",
                    CATCH_UP_WAIT.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let voters = ChangeMembers::AddVoterIds(BTreeSet::from([id]));
        self.change(self.inner.raft.change_membership(voters, true).await)?;
        tracing::info!(id, address, "storage group member added");
        Ok(self.status())
    }

    /// Removes node `id` from the group.
    pub async fn remove_member(&self, id: u64) -> Result<GroupStatus, ServiceError> {
        self.wait_membership_committed().await?;
        let membership = self.inner.raft.metrics().borrow().membership_config.clone();
        let membership = membership.membership();
        if membership.get_node(&id).is_none() {
            return Err(ServiceError::NotFound(format!(
                "no member {id} in the storage group"
            )));
        }
        if membership.voter_ids().any(|voter| voter == id) {
            let voters = ChangeMembers::RemoveVoters(BTreeSet::from([id]));
            self.change(self.inner.raft.change_membership(voters, false).await)?;
        } else {
            let nodes = ChangeMembers::RemoveNodes(BTreeSet::from([id]));
            self.change(self.inner.raft.change_membership(nodes, false).await)?;
        }
        tracing::info!(id, "storage group member removed");
        Ok(self.status())
    }

    /// Waits until the membership in force is committed: a leader elected
    /// a moment ago refuses a change until its first entry commits ("the
    /// cluster is already undergoing a configuration change").
    async fn wait_membership_committed(&self) -> Result<(), ServiceError> {
        self.inner
            .raft
            .wait(Some(APPLY_WAIT))
            .metrics(
                |metrics| {
                    let membership = metrics
                        .membership_config
                        .log_id()
                        .map(|log_id| log_id.index);
                    let applied = metrics.last_applied.map(|log_id| log_id.index);
                    applied >= membership
                },
                "the membership in force committed",
            )
            .await
            .map(|_| ())
            .map_err(|error| {
                ServiceError::Unavailable(format!(
                    "the storage group's membership is not committed yet: {error}"
                ))
            })
    }

    fn change<T>(
        &self,
        result: Result<T, RaftError<u64, ClientWriteError<u64, BasicNode>>>,
    ) -> Result<T, ServiceError> {
        match result {
            Ok(value) => Ok(value),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(forward))) => Err(
                ServiceError::NotLeader(forward.leader_node.map(|n| n.addr).unwrap_or_default()),
            ),
            Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(error))) => {
                Err(ServiceError::FailedPrecondition(error.to_string()))
            }
            Err(RaftError::Fatal(error)) => Err(ServiceError::Unavailable(error.to_string())),
        }
    }

    /// Refuses a change on a member that does not lead (a read is fine
    /// anywhere once applied far enough).
    fn leader_only(&self) -> Result<(), ServiceError> {
        let metrics = self.inner.raft.metrics().borrow().clone();
        if metrics.state == ServerState::Leader {
            return Ok(());
        }
        let leader = metrics
            .current_leader
            .and_then(|id| {
                metrics
                    .membership_config
                    .membership()
                    .get_node(&id)
                    .cloned()
            })
            .map(|node| node.addr)
            .unwrap_or_default();
        Err(ServiceError::NotLeader(leader))
    }
}

#[async_trait]
impl StorageApi for StorageGroup {
    async fn write(&self, batch: Arc<WriteBatch>) -> Result<(), ServiceError> {
        self.write_at(&batch).await.map(|_| ())
    }

    // Reads are this member's own records (the storage service has waited
    // until it applied the caller's last write).
    async fn load_definitions(&self) -> Result<Definitions, ServiceError> {
        self.inner.store.load_definitions().await
    }

    async fn load_messages(
        &self,
        vhost: &str,
        queue: &str,
    ) -> Result<Vec<QueueEntry>, ServiceError> {
        self.inner.store.load_messages(vhost, queue).await
    }

    async fn read_messages(&self, ids: Vec<u64>) -> Result<Vec<MessageRecord>, ServiceError> {
        StorageApi::read_messages(&self.inner.store, ids).await
    }

    async fn status(&self, count_records: bool) -> Result<StoreStatus, ServiceError> {
        StorageApi::status(&self.inner.store, count_records).await
    }

    async fn scan_delayed(
        &self,
        request: spillway_proto::storage::ScanDelayedRequest,
    ) -> Result<spillway_proto::storage::DelayedBatch, ServiceError> {
        StorageApi::scan_delayed(&self.inner.store, request).await
    }

    /// The orphans are found in this member's records, and deleted through
    /// the log with the caller's epoch (refused everywhere if stale).
    async fn remove_orphans(&self, epoch: u64, below_id: u64) -> Result<u64, ServiceError> {
        self.leader_only()?;
        let store = self.inner.store.clone();
        let orphans = store
            .clone()
            .off_runtime(move || store.orphan_ids(below_id))
            .await
            .map_err(crate::store::StoreError::from)??;
        let removed = orphans.len() as u64;
        for chunk in orphans.chunks(ORPHAN_DELETES_PER_ENTRY) {
            let ops = chunk
                .iter()
                .map(|id| WriteOp {
                    op: Some(write_op::Op::DeleteMessage(MessageId { id: *id })),
                })
                .collect();
            let batch = WriteBatch {
                ops,
                epoch,
                ..Default::default()
            };
            self.write_at(&batch).await?;
        }
        tracing::info!(
            orphaned_messages = removed,
            "unreferenced message records removed"
        );
        Ok(removed)
    }

    async fn acquire_lease(&self, request: AcquireLeaseRequest) -> Result<Lease, ServiceError> {
        self.leader_only()?;
        let ttl = Duration::from_millis(request.ttl_ms.clamp(100, 600_000));
        let grant = {
            let mut lease = self.inner.store.meta.lease.write();
            lease.acquire(request.epoch, ttl, Instant::now(), "the storage group")?
        };
        let ttl_ms = ttl.as_millis() as u64;
        let command = match grant {
            Grant::New(epoch) => Command::Lease {
                epoch,
                holder: request.holder.clone(),
                ttl_ms,
            },
            Grant::Renewed(epoch) => Command::Renew { epoch, ttl_ms },
        };
        let (_, outcome) = self.propose(command).await?;
        if let Some(reason) = outcome.refused {
            return Err(ServiceError::FailedPrecondition(reason));
        }
        Ok(Lease {
            epoch: outcome.epoch,
            store_id: self.inner.machine.group_id(),
            ttl_ms,
        })
    }

    async fn release_lease(&self, epoch: u64) -> Result<(), ServiceError> {
        self.propose(Command::Release { epoch }).await.map(|_| ())
    }

    async fn watch_quota(&self) -> Result<spillway_proto::storage::QuotaStream, ServiceError> {
        Ok(self.inner.store.quota.watch())
    }

    async fn set_quota(&self, request: SetStoreQuotaRequest) -> Result<(), ServiceError> {
        StorageApi::set_quota(&self.inner.store, request).await
    }

    async fn group_status(&self) -> Result<GroupStatus, ServiceError> {
        Ok(self.status())
    }

    async fn add_member(&self, id: u64, address: String) -> Result<GroupStatus, ServiceError> {
        StorageGroup::add_member(self, id, &address).await
    }

    async fn remove_member(&self, id: u64) -> Result<GroupStatus, ServiceError> {
        StorageGroup::remove_member(self, id).await
    }
}
