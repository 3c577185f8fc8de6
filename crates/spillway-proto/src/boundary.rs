//! The two boundaries on the message path, each a trait with an in-process
//! implementation (in the component's own crate) and a remote one (here, over
//! tonic). Callers hold an `Arc<dyn …>` and never know which they have.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;

use crate::cluster::{ClusterChannel, ClusterClient, BATCH_BYTES};
use crate::command_queue::{command_queue, CommandReceiver, CommandSender};
use crate::engine::{session_command, session_event, CommandBatch, EventBatch};
use crate::engine::{SessionCommand, SessionEvent};
use crate::storage::{
    AcquireLeaseRequest, AddMemberRequest, Definitions, GroupStatus, GroupStatusRequest, Lease,
    LoadDefinitionsRequest, LoadMessagesRequest, MessageRecord, QueueEntry, QuotaState,
    RemoveMemberRequest, StatusRequest, StoreStatus, WatchQuotaRequest, WriteBatch,
};
use crate::ServiceError;

/// A lease call that takes longer than this has failed (the lease itself
/// lasts seconds).
const LEASE_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// How many ready messages one gRPC stream message carries at most.
const MAX_STREAM_BATCH: usize = 256;

// ------------------------------------------------------------------ storage

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
    /// one group ([`crate::GroupStorage`]); 0 for a single store.
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
        crate::trace::inject_metadata(request.metadata_mut());
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

// ------------------------------------------------------------------- engine

/// One client connection's conversation with the engine.
pub struct SessionStreams {
    /// Commands, in the order the client sent them (bounded in count and
    /// bytes, see [`crate::command_queue`]).
    pub commands: CommandSender,
    /// Replies and asynchronous events, in order. Ends when the engine ends
    /// the session (or the remote engine is lost).
    pub events: mpsc::UnboundedReceiver<SessionEvent>,
}

/// What the gateway needs from the queue engine.
#[async_trait]
pub trait EngineApi: Send + Sync + 'static {
    async fn open_session(&self) -> Result<SessionStreams, ServiceError>;
    /// Checks a client's login against the engine's users.
    async fn authenticate(
        &self,
        request: crate::engine::AuthenticateRequest,
    ) -> Result<crate::engine::LoginResult, ServiceError>;
}

/// The queue engine over gRPC: one bidirectional stream per session, with
/// whatever is ready packed into one stream message each way.
#[derive(Clone)]
pub struct RemoteEngine {
    client: crate::engine::engine_client::EngineClient<ClusterChannel>,
}

impl RemoteEngine {
    /// `cluster`: the secret sent with every call and the message limit.
    pub fn connect_lazy(addr: &str, cluster: &ClusterClient) -> Result<Self, ServiceError> {
        let channel = lazy_channel(addr, cluster)?;
        let client = crate::engine::engine_client::EngineClient::new(channel)
            .max_decoding_message_size(cluster.max_message_bytes)
            .max_encoding_message_size(cluster.max_message_bytes);
        Ok(Self { client })
    }
}

#[async_trait]
impl EngineApi for RemoteEngine {
    async fn open_session(&self) -> Result<SessionStreams, ServiceError> {
        let (command_tx, command_rx) = command_queue();
        let (outbound_tx, outbound_rx) = mpsc::channel(16);
        tokio::spawn(batch_commands(command_rx, outbound_tx));
        // A batch's commands keep their bytes in the queue's bound until the
        // transport takes the batch.
        let outbound = ReceiverStream::new(outbound_rx).map(|(batch, _bytes)| batch);
        let response = self.client.clone().session(outbound).await?;
        let (event_tx, event_rx) = mpsc::unbounded_channel();
        tokio::spawn(forward_events(response.into_inner(), event_tx));
        Ok(SessionStreams {
            commands: command_tx,
            events: event_rx,
        })
    }

    async fn authenticate(
        &self,
        request: crate::engine::AuthenticateRequest,
    ) -> Result<crate::engine::LoginResult, ServiceError> {
        let response = self.client.clone().authenticate(request).await?;
        Ok(response.into_inner().result())
    }
}

async fn batch_commands(
    mut commands: CommandReceiver,
    outbound: mpsc::Sender<(SessionCommand, Vec<tokio::sync::OwnedSemaphorePermit>)>,
) {
    let mut ready = Vec::with_capacity(MAX_STREAM_BATCH);
    while commands.recv_many(&mut ready, MAX_STREAM_BATCH).await > 0 {
        let (batch, bytes): (Vec<_>, Vec<_>) = ready.drain(..).map(|c| c.into_parts()).unzip();
        if outbound.send((pack_commands(batch), bytes)).await.is_err() {
            return;
        }
    }
}

async fn forward_events(
    mut inbound: tonic::Streaming<SessionEvent>,
    events: mpsc::UnboundedSender<SessionEvent>,
) {
    loop {
        match inbound.message().await {
            Ok(Some(event)) => {
                if !unbatch_event(event, &events) {
                    return;
                }
            }
            Ok(None) => return,
            Err(status) => {
                tracing::warn!(%status, "engine session stream failed");
                return;
            }
        }
    }
}

fn unbatch_event(event: SessionEvent, events: &mpsc::UnboundedSender<SessionEvent>) -> bool {
    match event.event {
        Some(session_event::Event::Batch(batch)) => batch
            .events
            .into_iter()
            .all(|event| events.send(event).is_ok()),
        _ => events.send(event).is_ok(),
    }
}

/// Serves one remote session on the engine side: unpacks command batches into
/// `commands` and packs ready events into batches.
pub fn serve_remote_session(
    mut inbound: tonic::Streaming<SessionCommand>,
    session: SessionStreams,
) -> Pin<Box<dyn Stream<Item = Result<SessionEvent, tonic::Status>> + Send>> {
    let SessionStreams { commands, events } = session;
    tokio::spawn(async move {
        loop {
            let command = match inbound.message().await {
                Ok(Some(command)) => command,
                Ok(None) => return,
                Err(status) => {
                    tracing::debug!(%status, "gateway session stream ended");
                    return;
                }
            };
            let batch = match command.command {
                Some(session_command::Command::Batch(batch)) => batch.commands,
                _ => vec![command],
            };
            for mut command in batch {
                // A decoded body is a slice of the whole gRPC message: kept
                // as it is, one queued message would pin the batch it came in
                // (memory the engine's budget cannot see).
                if let Some(session_command::Command::Publish(publish)) = &mut command.command {
                    publish.properties = bytes::Bytes::copy_from_slice(&publish.properties);
                    publish.body = bytes::Bytes::copy_from_slice(&publish.body);
                }
                if commands.send(command).await.is_err() {
                    return;
                }
            }
        }
    });
    // Events taken from the channel that did not fit into the last stream
    // message wait here for the next one.
    let carried = VecDeque::new();
    let stream =
        futures::stream::unfold((events, carried), |(mut events, mut carried)| async move {
            if carried.is_empty() {
                let mut ready = Vec::with_capacity(MAX_STREAM_BATCH);
                if events.recv_many(&mut ready, MAX_STREAM_BATCH).await == 0 {
                    return None;
                }
                carried.extend(ready);
            }
            let batch = take_batch(&mut carried);
            Some((Ok(pack_events(batch)), (events, carried)))
        });
    Box::pin(stream)
}

/// The first items of `ready` that go into one stream message: at most
/// [`MAX_STREAM_BATCH`] of them and [`BATCH_BYTES`] encoded, except that the
/// first always goes (alone, if need be), so that a stream message stays
/// within the gRPC message limit ([`crate::cluster::grpc_message_limit`]).
fn take_batch<T: prost::Message>(ready: &mut VecDeque<T>) -> Vec<T> {
    let mut batch = Vec::new();
    let mut bytes = 0;
    while let Some(next) = ready.front() {
        let len = next.encoded_len();
        if !batch.is_empty() && (bytes + len > BATCH_BYTES || batch.len() == MAX_STREAM_BATCH) {
            break;
        }
        bytes += len;
        batch.extend(ready.pop_front());
    }
    batch
}

fn pack_events(mut ready: Vec<SessionEvent>) -> SessionEvent {
    match (ready.len(), ready.pop()) {
        (1, Some(event)) => event,
        (_, last) => {
            ready.extend(last);
            SessionEvent {
                event: Some(session_event::Event::Batch(EventBatch { events: ready })),
            }
        }
    }
}

fn pack_commands(mut ready: Vec<SessionCommand>) -> SessionCommand {
    match (ready.len(), ready.pop()) {
        (1, Some(command)) => command,
        (_, last) => {
            ready.extend(last);
            SessionCommand {
                command: Some(session_command::Command::Batch(CommandBatch {
                    commands: ready,
                })),
            }
        }
    }
}

/// A lazily connecting channel to `addr` that adds the cluster secret to
/// every call, over mutual TLS when the cluster has it (`http://` is then
/// dialled as `https://`; the server's certificate must name the address's
/// host).
pub fn lazy_channel(addr: &str, cluster: &ClusterClient) -> Result<ClusterChannel, ServiceError> {
    lazy_channel_within(addr, cluster, ChannelTimeouts::DEFAULT)
}

/// A channel to a storage group's member ([`ChannelTimeouts::GROUP_MEMBER`]):
/// for the members' own Raft traffic and for their clients.
pub fn lazy_member_channel(
    addr: &str,
    cluster: &ClusterClient,
) -> Result<ClusterChannel, ServiceError> {
    lazy_channel_within(addr, cluster, ChannelTimeouts::GROUP_MEMBER)
}

/// How long a channel waits to connect, and how soon it finds a connection
/// dead (HTTP/2 PING every `keep_alive`, answered within `keep_alive_timeout`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChannelTimeouts {
    pub(crate) connect: Duration,
    pub(crate) keep_alive: Duration,
    pub(crate) keep_alive_timeout: Duration,
}

impl ChannelTimeouts {
    /// One peer, nothing else to ask: patient.
    pub(crate) const DEFAULT: Self = Self {
        connect: Duration::from_secs(5),
        keep_alive: Duration::from_secs(10),
        keep_alive_timeout: Duration::from_secs(20),
    };
    /// A storage group's member: another can be asked, so one that cannot
    /// be reached is given up on within a second (a dead container's
    /// address answers nothing). A silent connection is found dead within
    /// 12 s: shorter, and a member busy catching up (a snapshot, on two
    /// loaded cores) is cut off in the middle of it, again and again. Calls
    /// that must not wait that long bound their attempts themselves
    /// (`GroupStorage`).
    pub(crate) const GROUP_MEMBER: Self = Self {
        connect: Duration::from_secs(1),
        keep_alive: Duration::from_secs(2),
        keep_alive_timeout: Duration::from_secs(10),
    };
}

/// [`lazy_channel`], with timeouts of its own.
pub(crate) fn lazy_channel_within(
    addr: &str,
    cluster: &ClusterClient,
    timeouts: ChannelTimeouts,
) -> Result<ClusterChannel, ServiceError> {
    let uri = crate::cluster::cluster_uri(addr, cluster.tls.is_some())
        .map_err(ServiceError::InvalidArgument)?;
    let mut endpoint = Endpoint::from_shared(uri)
        .map_err(|err| ServiceError::InvalidArgument(format!("bad address {addr}: {err}")))?
        .connect_timeout(timeouts.connect)
        .tcp_nodelay(true)
        .max_frame_size(crate::cluster::HTTP2_MAX_FRAME_BYTES)
        .http2_keep_alive_interval(timeouts.keep_alive)
        .keep_alive_timeout(timeouts.keep_alive_timeout)
        .keep_alive_while_idle(true);
    if let Some(tls) = &cluster.tls {
        endpoint = endpoint.tls_config(tls.client_config()).map_err(|err| {
            ServiceError::InvalidArgument(format!(
                "cluster.tls cannot be used to reach {addr}: {err}"
            ))
        })?;
    }
    Ok(ClusterChannel::new(
        endpoint.connect_lazy(),
        cluster.credentials(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Deliver;

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

    fn delivery(body: usize) -> SessionEvent {
        SessionEvent {
            event: Some(session_event::Event::Deliver(Deliver {
                body: vec![0; body].into(),
                ..Default::default()
            })),
        }
    }

    #[test]
    fn a_batch_stops_at_its_byte_budget_but_a_large_event_goes_alone() {
        let mut ready: VecDeque<_> = [
            delivery(BATCH_BYTES / 2),
            delivery(BATCH_BYTES / 2),
            delivery(10),
            delivery(BATCH_BYTES * 2),
            delivery(10),
        ]
        .into();
        let sizes = |batch: Vec<SessionEvent>| batch.len();
        assert_eq!(
            sizes(take_batch(&mut ready)),
            1,
            "two halves plus framing overflow"
        );
        assert_eq!(sizes(take_batch(&mut ready)), 2);
        assert_eq!(sizes(take_batch(&mut ready)), 1, "the large one alone");
        assert_eq!(sizes(take_batch(&mut ready)), 1);
        assert!(ready.is_empty());

        let mut many: VecDeque<_> = (0..MAX_STREAM_BATCH + 1).map(|_| delivery(1)).collect();
        assert_eq!(take_batch(&mut many).len(), MAX_STREAM_BATCH);
        assert_eq!(take_batch(&mut many).len(), 1);
    }
}
