//! [`GroupStorage`]: the engine's client of a storage group. It knows every
//! member (`engine.storage_addrs`), finds the leader by itself and follows
//! it when it changes.
//!
//! A call goes to the member it last found leading. A member that does not
//! lead answers with the leader's address (`ServiceError::NotLeader`); one
//! that cannot be reached is passed over for the next. Calls are tried
//! again like this, with a short backoff, until [`CALL_DEADLINE`] (an
//! election takes one to two seconds); past it the last error is returned,
//! transient, and the engine's writer keeps its batch and tries again.
//!
//! A write retried on another member after its first member died may have
//! been committed already: batches carry their number
//! (`WriteBatch.sequence`) and the group applies a number once. Reads carry
//! the log index of the last write answered (the shared fence), so no
//! member answers from a state older than the engine's own writes.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::api::{QuotaStream, StorageApi};
use super::remote::RemoteStorage;
use crate::cluster::ChannelTimeouts;
use crate::cluster::ClusterClient;
use crate::storage::{
    AcquireLeaseRequest, Definitions, GroupStatus, Lease, MessageRecord, QueueEntry, StoreStatus,
    WriteBatch,
};
use crate::util::rotation::{Attempts, Rotation};
use crate::ServiceError;

/// How long one call keeps looking for a leader that answers.
pub const CALL_DEADLINE: Duration = Duration::from_secs(10);
/// Most calls: until [`CALL_DEADLINE`].
const CALL: Attempts = Attempts::until(CALL_DEADLINE);
/// A write: one member may take 4 s before the next is asked (a leader
/// that died mid-call may leave its connection silent rather than closed).
/// A commit takes milliseconds; a retry is safe, as the group applies a
/// batch once.
const WRITE: Attempts = CALL.each_within(Duration::from_secs(4));
/// A lease call: renewed every few seconds, it must not wait as long.
const LEASE: Attempts = Attempts::until(Duration::from_secs(3)).each_within(Duration::from_secs(2));
/// A status call: a member busy catching up on loaded cores can take a few
/// seconds to answer.
const STATUS: Attempts = CALL.each_within(Duration::from_secs(5));

/// Every member of a storage group, as the engine reaches them: over gRPC
/// ([`RemoteStorage`]), or in the simulation over its faulty network.
pub struct GroupStorage<M = RemoteStorage> {
    /// The addresses as configured and a client of each; calls go first
    /// to the leader, as last found.
    members: Rotation<M>,
}

impl GroupStorage<RemoteStorage> {
    /// Clients of every address in `addrs` (connected lazily).
    pub fn connect_lazy(addrs: &[String], cluster: &ClusterClient) -> Result<Self, ServiceError> {
        let fence = Arc::new(AtomicU64::new(0));
        let members = addrs
            .iter()
            .map(|addr| {
                let client = RemoteStorage::connect_lazy_within(
                    addr,
                    cluster,
                    ChannelTimeouts::GROUP_MEMBER,
                )?
                .with_fence(fence.clone());
                Ok((addr.clone(), client))
            })
            .collect::<Result<Vec<_>, ServiceError>>()?;
        Self::over(members)
    }
}

impl<M: StorageApi> GroupStorage<M> {
    /// The group's members as (address, client), the address as the
    /// members name it in a redirection to their leader.
    pub fn over(members: Vec<(String, M)>) -> Result<Self, ServiceError> {
        Ok(Self {
            members: Rotation::new("storage group member", members)?,
        })
    }
}

#[async_trait]
impl<M: StorageApi> StorageApi for GroupStorage<M> {
    async fn write(&self, batch: Arc<WriteBatch>) -> Result<(), ServiceError> {
        self.members
            .call(WRITE, |member| {
                let batch = batch.clone();
                Box::pin(async move { member.write(batch).await })
            })
            .await
    }

    async fn load_definitions(&self) -> Result<Definitions, ServiceError> {
        self.members
            .call(CALL, |member| Box::pin(member.load_definitions()))
            .await
    }

    async fn load_messages(
        &self,
        vhost: &str,
        queue: &str,
    ) -> Result<Vec<QueueEntry>, ServiceError> {
        self.members
            .call(CALL, |member| Box::pin(member.load_messages(vhost, queue)))
            .await
    }

    async fn read_messages(&self, ids: Vec<u64>) -> Result<Vec<MessageRecord>, ServiceError> {
        self.members
            .call(CALL, |member| Box::pin(member.read_messages(ids.clone())))
            .await
    }

    async fn scan_delayed(
        &self,
        request: crate::storage::ScanDelayedRequest,
    ) -> Result<crate::storage::DelayedBatch, ServiceError> {
        self.members
            .call(CALL, |member| Box::pin(member.scan_delayed(request)))
            .await
    }

    async fn status(&self, count_records: bool) -> Result<StoreStatus, ServiceError> {
        self.members
            .call(CALL, |member| Box::pin(member.status(count_records)))
            .await
    }

    async fn remove_orphans(&self, epoch: u64, below_id: u64) -> Result<u64, ServiceError> {
        self.members
            .call(CALL, |member| {
                Box::pin(member.remove_orphans(epoch, below_id))
            })
            .await
    }

    async fn acquire_lease(&self, request: AcquireLeaseRequest) -> Result<Lease, ServiceError> {
        self.members
            .call(LEASE, |member| {
                Box::pin(member.acquire_lease(request.clone()))
            })
            .await
    }

    async fn release_lease(&self, epoch: u64) -> Result<(), ServiceError> {
        self.members
            .call(LEASE, |member| Box::pin(member.release_lease(epoch)))
            .await
    }

    async fn watch_quota(&self) -> Result<QuotaStream, ServiceError> {
        self.members
            .call(CALL, |member| Box::pin(member.watch_quota()))
            .await
    }

    /// The leader's view (lag included) when a member names one that
    /// answers, else the first member's that does.
    async fn group_status(&self) -> Result<GroupStatus, ServiceError> {
        let seen = self
            .members
            .call(STATUS, |member| Box::pin(member.group_status()))
            .await?;
        let mut seen = seen;
        if seen.leader == 0 {
            // A member that has not heard from the leader yet (one started
            // after the others) knows none: another may.
            for index in 0..self.members.len() {
                match self.members.get(index).1.group_status().await {
                    Ok(other) if other.leader != 0 => {
                        seen = other;
                        break;
                    }
                    _ => {}
                }
            }
        }
        let leader = seen
            .members
            .iter()
            .find(|member| member.id == seen.leader && seen.node_id != seen.leader)
            .and_then(|member| self.members.position(&member.address));
        let Some(leader) = leader else {
            return Ok(seen);
        };
        Ok(self
            .members
            .get(leader)
            .1
            .group_status()
            .await
            .unwrap_or(seen))
    }

    async fn add_member(&self, id: u64, address: String) -> Result<GroupStatus, ServiceError> {
        self.members
            .call(CALL, |member| {
                Box::pin(member.add_member(id, address.clone()))
            })
            .await
    }

    async fn remove_member(&self, id: u64) -> Result<GroupStatus, ServiceError> {
        self.members
            .call(CALL, |member| Box::pin(member.remove_member(id)))
            .await
    }

    async fn set_quota(
        &self,
        request: crate::management::SetStoreQuotaRequest,
    ) -> Result<(), ServiceError> {
        // Every member measures its own disk: each gets the quota.
        for index in 0..self.members.len() {
            let (addr, member) = self.members.get(index);
            if let Err(error) = member.set_quota(request).await {
                tracing::warn!(member = %addr, %error, "storage group member did not take the quota");
            }
        }
        Ok(())
    }
}
