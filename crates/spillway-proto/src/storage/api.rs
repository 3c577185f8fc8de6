//! [`StorageApi`]: what the queue engine needs from the storage node, the
//! boundary on the message path between them. It has an in-process
//! implementation (the storage node's own crate), a remote one over tonic
//! ([`super::RemoteStorage`]) and the client of a storage group
//! ([`super::GroupStorage`]); callers hold an `Arc<dyn StorageApi>` and never
//! know which they have.

use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use futures::Stream;

use crate::storage::{
    AcquireLeaseRequest, Definitions, GroupStatus, Lease, MessageRecord, QueueEntry, QuotaState,
    StoreStatus, WriteBatch,
};
use crate::ServiceError;

/// What the queue engine needs from the storage node.
#[async_trait]
pub trait StorageApi: Send + Sync + 'static {
    /// Applies the batch atomically, as durably as it asks, before returning.
    async fn write(&self, batch: Arc<WriteBatch>) -> Result<(), ServiceError>;
    async fn load_definitions(&self) -> Result<Definitions, ServiceError>;
    /// The entries of one durable queue, oldest first.
    async fn load_messages(
        &self,
        vhost: &str,
        queue: &str,
    ) -> Result<Vec<QueueEntry>, ServiceError>;
    /// The message records of `ids` that exist, in the order asked.
    async fn read_messages(&self, ids: Vec<u64>) -> Result<Vec<MessageRecord>, ServiceError>;
    /// Disk usage; with `count_records`, exact record counts (a scan).
    async fn status(&self, count_records: bool) -> Result<StoreStatus, ServiceError>;
    /// Deletes every message record with an id below `below_id` that no
    /// durable queue entry references; returns how many. Only an engine
    /// that is recovering may ask, with the epoch of the lease it holds
    /// (another epoch is refused) and the first id it gives out itself.
    async fn remove_orphans(&self, epoch: u64, below_id: u64) -> Result<u64, ServiceError>;
    /// Takes (epoch 0) or renews (the current epoch) the store's one engine
    /// lease; refused with `FailedPrecondition` while another engine holds
    /// it, or when the epoch is stale.
    async fn acquire_lease(&self, request: AcquireLeaseRequest) -> Result<Lease, ServiceError>;
    /// Ends the lease of `epoch` (clean shutdown): the next engine need not
    /// wait for it to expire.
    async fn release_lease(&self, epoch: u64) -> Result<(), ServiceError>;
    /// The disk quota's state now, then on every change. The stream ends
    /// (or fails) when the storage node goes away: watch again.
    async fn watch_quota(&self) -> Result<QuotaStream, ServiceError>;

    /// Management's runtime store quota (`storage.overfull_size`,
    /// `storage.underfull_size`).
    async fn set_quota(
        &self,
        request: crate::management::SetStoreQuotaRequest,
    ) -> Result<(), ServiceError>;

    /// Delayed messages due by `request.due_until_ms` (or, with
    /// `count_below_id`, how many wait per exchange), and when the next is
    /// due. A store that keeps none answers an empty batch.
    async fn scan_delayed(
        &self,
        _request: crate::storage::ScanDelayedRequest,
    ) -> Result<crate::storage::DelayedBatch, ServiceError> {
        Ok(crate::storage::DelayedBatch::default())
    }

    /// The storage group as its leader (else the member asked) sees it.
    /// A single store has no group: FAILED_PRECONDITION.
    async fn group_status(&self) -> Result<GroupStatus, ServiceError> {
        Err(not_a_group())
    }

    /// Adds node `id` at `address` to the storage group (the leader does).
    async fn add_member(&self, _id: u64, _address: String) -> Result<GroupStatus, ServiceError> {
        Err(not_a_group())
    }

    /// Removes node `id` from the storage group (the leader does).
    async fn remove_member(&self, _id: u64) -> Result<GroupStatus, ServiceError> {
        Err(not_a_group())
    }
}

/// What a store outside any group answers the group's calls.
pub(crate) fn not_a_group() -> ServiceError {
    ServiceError::FailedPrecondition(
        "the store is a single storage node, not a storage group (storage.members is not set)"
            .into(),
    )
}

/// The storage node's disk quota state, as it changes.
pub type QuotaStream = Pin<Box<dyn Stream<Item = Result<QuotaState, ServiceError>> + Send>>;
