//! [`RemoteStorage`]: the storage node over gRPC, the remote side of
//! [`StorageApi`].

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;

use super::api::{not_a_group, QuotaStream, StorageApi};
use crate::cluster::{lazy_channel_within, ChannelTimeouts, ClusterChannel, ClusterClient};
use crate::storage::{
    AcquireLeaseRequest, AddMemberRequest, Definitions, GroupStatus, GroupStatusRequest, Lease,
    LoadDefinitionsRequest, LoadMessagesRequest, MessageRecord, QueueEntry, RemoveMemberRequest,
    StatusRequest, StoreStatus, WatchQuotaRequest, WriteBatch,
};
use crate::ServiceError;

/// A lease call that takes longer than this has failed (the lease itself
/// lasts seconds).
const LEASE_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// The storage node over gRPC. The channel connects lazily and reconnects by
/// itself, so a storage node that restarts is picked up again.
#[derive(Clone)]
pub struct RemoteStorage {
    client: crate::storage::storage_client::StorageClient<ClusterChannel>,
    /// The node's `StorageGroup` service (a member of a group).
    group: crate::storage::storage_group_client::StorageGroupClient<ClusterChannel>,
    /// The same channel, for `Write`: see [`SharedWriteBatch`].
    writes: tonic::client::Grpc<ClusterChannel>,
    /// The highest storage group log index a write was answered at; reads
    /// send it (`spillway-min-applied`), so that a group member answers
    /// them only once it has applied that far. Shared by the clients of
    /// one group ([`super::GroupStorage`]); 0 for a single store.
    fence: Arc<AtomicU64>,
}

impl RemoteStorage {
    /// `cluster`: the secret sent with every call and the message limit.
    pub fn connect_lazy(addr: &str, cluster: &ClusterClient) -> Result<Self, ServiceError> {
        Self::connect_lazy_within(addr, cluster, ChannelTimeouts::DEFAULT)
    }

    /// [`RemoteStorage::connect_lazy`] with timeouts of its own.
    pub(crate) fn connect_lazy_within(
        addr: &str,
        cluster: &ClusterClient,
        timeouts: ChannelTimeouts,
    ) -> Result<Self, ServiceError> {
        let channel = lazy_channel_within(addr, cluster, timeouts)?;
        let client = crate::storage::storage_client::StorageClient::new(channel.clone())
            .max_decoding_message_size(cluster.max_message_bytes)
            .max_encoding_message_size(cluster.max_message_bytes);
        let group = crate::storage::storage_group_client::StorageGroupClient::new(channel.clone())
            .max_decoding_message_size(cluster.max_message_bytes)
            .max_encoding_message_size(cluster.max_message_bytes);
        let writes = tonic::client::Grpc::new(channel)
            .max_decoding_message_size(cluster.max_message_bytes)
            .max_encoding_message_size(cluster.max_message_bytes);
        Ok(Self {
            client,
            group,
            writes,
            fence: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Shares `fence` with the other members' clients of one group.
    pub(crate) fn with_fence(mut self, fence: Arc<AtomicU64>) -> Self {
        self.fence = fence;
        self
    }

    /// A read's request, with the fence when there is one.
    fn read_request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        let fence = self.fence.load(Ordering::Acquire);
        if fence > 0 {
            request.metadata_mut().insert(
                MIN_APPLIED_HEADER,
                tonic::metadata::MetadataValue::from(fence),
            );
        }
        request
    }
}

/// The request header a read carries in a storage group (storage.proto).
const MIN_APPLIED_HEADER: &str = "spillway-min-applied";

/// The path of `Storage/Write`, as the generated client has it.
const WRITE_PATH: &str = "/spillway.storage.v1.Storage/Write";

/// A `WriteBatch` that encodes straight from the writer's `Arc`.
///
/// The generated client takes its request by value, and the engine's
/// writer keeps every batch until it lands (to retry it, then to clear its
/// pending records), so sending through it deep-cloned each batch: every
/// vhost, queue, exchange and routing-key `String` of every op, on every
/// persistent message's path. This wrapper encodes the shared batch in
/// place; decoding (never done on this side) copies on write.
#[derive(Clone, Debug, Default)]
struct SharedWriteBatch(Arc<WriteBatch>);

impl prost::Message for SharedWriteBatch {
    fn encode_raw(&self, buf: &mut impl bytes::BufMut) {
        self.0.encode_raw(buf)
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        Arc::make_mut(&mut self.0).merge_field(tag, wire_type, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.0.encoded_len()
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

#[async_trait]
impl StorageApi for RemoteStorage {
    async fn write(&self, batch: Arc<WriteBatch>) -> Result<(), ServiceError> {
        let mut request = tonic::Request::new(SharedWriteBatch(batch));
        crate::util::trace::inject_metadata(request.metadata_mut());
        request
            .extensions_mut()
            .insert(tonic::codegen::GrpcMethod::new(
                "spillway.storage.v1.Storage",
                "Write",
            ));
        let mut grpc = self.writes.clone();
        grpc.ready()
            .await
            .map_err(|err| tonic::Status::unknown(format!("storage node not ready: {err}")))?;
        let codec =
            tonic_prost::ProstCodec::<SharedWriteBatch, crate::storage::WriteAck>::default();
        let ack = grpc
            .unary(
                request,
                tonic::codegen::http::uri::PathAndQuery::from_static(WRITE_PATH),
                codec,
            )
            .await?;
        self.fence
            .fetch_max(ack.into_inner().applied_index, Ordering::AcqRel);
        Ok(())
    }

    async fn load_definitions(&self) -> Result<Definitions, ServiceError> {
        let response = self
            .client
            .clone()
            .load_definitions(self.read_request(LoadDefinitionsRequest {}))
            .await?;
        Ok(response.into_inner())
    }

    async fn load_messages(
        &self,
        vhost: &str,
        queue: &str,
    ) -> Result<Vec<QueueEntry>, ServiceError> {
        let request = LoadMessagesRequest {
            vhost: vhost.to_string(),
            queue: queue.to_string(),
        };
        let mut stream = self
            .client
            .clone()
            .load_messages(self.read_request(request))
            .await?
            .into_inner();
        let mut entries = Vec::new();
        while let Some(chunk) = stream.message().await? {
            entries.extend(chunk.entries);
        }
        Ok(entries)
    }

    async fn read_messages(&self, ids: Vec<u64>) -> Result<Vec<MessageRecord>, ServiceError> {
        // An answer too large for one gRPC message (many large bodies) is
        // asked for again in halves, in order, down to one message each.
        let mut chunks = VecDeque::from([ids]);
        let mut messages = Vec::new();
        while let Some(ids) = chunks.pop_front() {
            let request = crate::storage::ReadMessagesRequest { ids: ids.clone() };
            match self
                .client
                .clone()
                .read_messages(self.read_request(request))
                .await
            {
                Ok(response) => messages.extend(response.into_inner().messages),
                Err(status) if too_large(&status) && ids.len() > 1 => {
                    let (first, second) = ids.split_at(ids.len() / 2);
                    chunks.push_front(second.to_vec());
                    chunks.push_front(first.to_vec());
                }
                Err(status) => return Err(status.into()),
            }
        }
        Ok(messages)
    }

    async fn scan_delayed(
        &self,
        request: crate::storage::ScanDelayedRequest,
    ) -> Result<crate::storage::DelayedBatch, ServiceError> {
        Ok(self
            .client
            .clone()
            .scan_delayed(self.read_request(request))
            .await?
            .into_inner())
    }

    async fn status(&self, count_records: bool) -> Result<StoreStatus, ServiceError> {
        Ok(self
            .client
            .clone()
            .status(self.read_request(StatusRequest { count_records }))
            .await?
            .into_inner())
    }

    async fn set_quota(
        &self,
        request: crate::management::SetStoreQuotaRequest,
    ) -> Result<(), ServiceError> {
        self.client
            .clone()
            .set_quota(crate::storage::SetQuotaRequest {
                overfull_size: request.overfull_size,
                underfull_size: request.underfull_size,
            })
            .await?;
        Ok(())
    }

    async fn remove_orphans(&self, epoch: u64, below_id: u64) -> Result<u64, ServiceError> {
        let response = self
            .client
            .clone()
            .remove_orphans(crate::storage::RemoveOrphansRequest { epoch, below_id })
            .await?;
        Ok(response.into_inner().removed)
    }

    async fn acquire_lease(&self, request: AcquireLeaseRequest) -> Result<Lease, ServiceError> {
        let mut call = tonic::Request::new(request);
        call.set_timeout(LEASE_CALL_TIMEOUT);
        Ok(self.client.clone().acquire_lease(call).await?.into_inner())
    }

    async fn release_lease(&self, epoch: u64) -> Result<(), ServiceError> {
        let mut call = tonic::Request::new(crate::storage::ReleaseLeaseRequest { epoch });
        call.set_timeout(LEASE_CALL_TIMEOUT);
        self.client.clone().release_lease(call).await?;
        Ok(())
    }

    async fn group_status(&self) -> Result<GroupStatus, ServiceError> {
        let mut call = tonic::Request::new(GroupStatusRequest {});
        call.set_timeout(LEASE_CALL_TIMEOUT);
        Ok(self
            .group
            .clone()
            .get_group_status(call)
            .await
            .map_err(group_call_error)?
            .into_inner())
    }

    async fn add_member(&self, id: u64, address: String) -> Result<GroupStatus, ServiceError> {
        let request = AddMemberRequest { id, address };
        Ok(self
            .group
            .clone()
            .add_member(request)
            .await
            .map_err(group_call_error)?
            .into_inner())
    }

    async fn remove_member(&self, id: u64) -> Result<GroupStatus, ServiceError> {
        let request = RemoveMemberRequest { id };
        Ok(self
            .group
            .clone()
            .remove_member(request)
            .await
            .map_err(group_call_error)?
            .into_inner())
    }

    async fn watch_quota(&self) -> Result<QuotaStream, ServiceError> {
        let stream = self
            .client
            .clone()
            .watch_quota(WatchQuotaRequest {})
            .await?
            .into_inner();
        Ok(Box::pin(
            stream.map(|state| state.map_err(ServiceError::from)),
        ))
    }
}

/// A node that serves no `StorageGroup` is a single store.
fn group_call_error(status: tonic::Status) -> ServiceError {
    if status.code() == tonic::Code::Unimplemented {
        return not_a_group();
    }
    status.into()
}

/// Whether a call failed because a message was over the gRPC message limit
/// (tonic says so with OUT_OF_RANGE on either end; RESOURCE_EXHAUSTED is what
/// other gRPC implementations use).
fn too_large(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_write_batch_is_the_same_bytes_as_the_batch_and_decodes_back() {
        use crate::storage::{write_op, WriteOp};
        use prost::Message as _;
        let batch = WriteBatch {
            ops: vec![WriteOp {
                op: Some(write_op::Op::PutMessage(MessageRecord {
                    id: 7,
                    exchange: "amq.direct".into(),
                    routing_key: "jobs".into(),
                    body: vec![1; 100].into(),
                    persistent: true,
                    ..Default::default()
                })),
            }],
            durability: 1,
            epoch: 3,
            sequence: 12,
        };
        let shared = SharedWriteBatch(Arc::new(batch.clone()));
        let bytes = shared.encode_to_vec();
        assert_eq!(bytes, batch.encode_to_vec());
        assert_eq!(shared.encoded_len(), bytes.len());
        let decoded = SharedWriteBatch::decode(bytes.as_slice()).map(|shared| shared.0);
        assert_eq!(decoded.ok().as_deref(), Some(&batch));
    }
}
