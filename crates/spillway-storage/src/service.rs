//! `StorageService`: the storage node's gRPC face. Every call is a thin
//! translation onto a `StorageApi` (the `RocksStore`, or the `StorageGroup`
//! member over it), so the engine sees the same behaviour through either
//! wiring.
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use spillway_proto::storage::storage_server::Storage;
use spillway_proto::storage::StorageApi;
use spillway_proto::storage::{
    Definitions, LoadDefinitionsRequest, LoadMessagesRequest, QueueEntryChunk, QuotaState,
    ReadMessagesRequest, ReadMessagesResponse, StatusRequest, StoreStatus, WatchQuotaRequest,
    WriteAck, WriteBatch,
};
use tonic::{Request, Response, Status};

use crate::group::node::StorageGroup;
use crate::store::RocksStore;

/// The request header of a read: the log index of the caller's last write
/// (see `StorageGroup` in storage.proto).
pub const MIN_APPLIED_HEADER: &str = "spillway-min-applied";

/// Entries per chunk when streaming a durable queue's entries.
const LOAD_CHUNK: usize = 4096;

/// The storage node's gRPC service, for an engine in another process.
pub struct StorageService {
    store: RocksStore,
    /// Set when the node is a member of a storage group: writes, the lease
    /// and orphan removal then go through its log.
    group: Option<StorageGroup>,
    /// Ends the long-lived quota streams at shutdown: a graceful gRPC
    /// shutdown waits for every open stream.
    stop: Option<tokio::sync::watch::Receiver<bool>>,
}

impl StorageService {
    pub fn new(store: RocksStore) -> Self {
        Self {
            store,
            group: None,
            stop: None,
        }
    }

    /// The service of a storage group member.
    pub fn grouped(group: StorageGroup) -> Self {
        Self {
            store: group.store().clone(),
            group: Some(group),
            stop: None,
        }
    }

    /// The store, or the group member over it.
    fn api(&self) -> &dyn StorageApi {
        match &self.group {
            Some(group) => group,
            None => &self.store,
        }
    }

    /// In a group, waits until this member has applied the caller's last
    /// write (the `spillway-min-applied` header).
    async fn fence<T>(&self, request: &Request<T>) -> Result<(), Status> {
        let Some(group) = &self.group else {
            return Ok(());
        };
        let index = request
            .metadata()
            .get(MIN_APPLIED_HEADER)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.parse::<u64>().ok())
            .unwrap_or(0);
        group.wait_applied(index).await?;
        Ok(())
    }

    /// Quota streams end when `stop` turns true.
    pub fn with_shutdown(mut self, stop: tokio::sync::watch::Receiver<bool>) -> Self {
        self.stop = Some(stop);
        self
    }

    /// The server, sending and accepting messages of up to
    /// `max_message_bytes` (`spillway_proto::cluster::grpc_message_limit`).
    pub fn into_server(
        self,
        max_message_bytes: usize,
    ) -> spillway_proto::storage::storage_server::StorageServer<Self> {
        spillway_proto::storage::storage_server::StorageServer::new(self)
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes)
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<QueueEntryChunk, Status>> + Send>>;
type QuotaStateStream = Pin<Box<dyn Stream<Item = Result<QuotaState, Status>> + Send>>;

#[tonic::async_trait]
impl Storage for StorageService {
    async fn write(&self, request: Request<WriteBatch>) -> Result<Response<WriteAck>, Status> {
        let (metadata, _, batch) = request.into_parts();
        if let Some(group) = &self.group {
            let write = group.write_at(&batch);
            let applied_index =
                spillway_proto::util::trace::with_remote_parent(&metadata, write).await?;
            return Ok(Response::new(WriteAck { applied_index }));
        }
        let write = self.store.write(Arc::new(batch));
        spillway_proto::util::trace::with_remote_parent(&metadata, write).await?;
        Ok(Response::new(WriteAck::default()))
    }

    async fn load_definitions(
        &self,
        request: Request<LoadDefinitionsRequest>,
    ) -> Result<Response<Definitions>, Status> {
        self.fence(&request).await?;
        Ok(Response::new(self.api().load_definitions().await?))
    }

    type LoadMessagesStream = ChunkStream;

    async fn load_messages(
        &self,
        request: Request<LoadMessagesRequest>,
    ) -> Result<Response<Self::LoadMessagesStream>, Status> {
        self.fence(&request).await?;
        let request = request.into_inner();
        let entries = self
            .api()
            .load_messages(&request.vhost, &request.queue)
            .await
            .map_err(Status::from)?;
        let mut chunks = Vec::with_capacity(entries.len() / LOAD_CHUNK + 1);
        let mut entries = entries.into_iter().peekable();
        while entries.peek().is_some() {
            let chunk: Vec<_> = entries.by_ref().take(LOAD_CHUNK).collect();
            chunks.push(Ok(QueueEntryChunk { entries: chunk }));
        }
        Ok(Response::new(Box::pin(futures::stream::iter(chunks))))
    }

    async fn read_messages(
        &self,
        request: Request<ReadMessagesRequest>,
    ) -> Result<Response<ReadMessagesResponse>, Status> {
        self.fence(&request).await?;
        let messages = self.api().read_messages(request.into_inner().ids).await?;
        Ok(Response::new(ReadMessagesResponse { messages }))
    }

    async fn scan_delayed(
        &self,
        request: Request<spillway_proto::storage::ScanDelayedRequest>,
    ) -> Result<Response<spillway_proto::storage::DelayedBatch>, Status> {
        self.fence(&request).await?;
        let batch = self.api().scan_delayed(request.into_inner()).await?;
        Ok(Response::new(batch))
    }

    async fn set_quota(
        &self,
        request: Request<spillway_proto::storage::SetQuotaRequest>,
    ) -> Result<Response<QuotaState>, Status> {
        let request = request.into_inner();
        StorageApi::set_quota(
            self.api(),
            spillway_proto::management::SetStoreQuotaRequest {
                overfull_size: request.overfull_size,
                underfull_size: request.underfull_size,
            },
        )
        .await?;
        let (overfull_size, underfull_size) = self.store.quota_limits();
        Ok(Response::new(QuotaState {
            overfull_size,
            underfull_size,
            ..Default::default()
        }))
    }

    async fn remove_orphans(
        &self,
        request: Request<spillway_proto::storage::RemoveOrphansRequest>,
    ) -> Result<Response<spillway_proto::storage::RemoveOrphansResponse>, Status> {
        let request = request.into_inner();
        // 0: no bound (an engine that predates the bound).
        let below_id = match request.below_id {
            0 => u64::MAX,
            below_id => below_id,
        };
        if let Some(group) = &self.group {
            let removed = StorageApi::remove_orphans(group, request.epoch, below_id).await?;
            return Ok(Response::new(
                spillway_proto::storage::RemoveOrphansResponse {
                    removed,
                    removed_bytes: 0,
                },
            ));
        }
        let store = self.store.clone();
        let cleanup = tokio::task::spawn_blocking(move || {
            store.remove_orphans_leased(request.epoch, below_id)
        })
        .await
        .map_err(|error| Status::internal(error.to_string()))?
        .map_err(|error| Status::from(spillway_proto::ServiceError::from(error)))?;
        Ok(Response::new(
            spillway_proto::storage::RemoveOrphansResponse {
                removed: cleanup.orphaned_messages,
                removed_bytes: cleanup.orphaned_bytes,
            },
        ))
    }

    async fn acquire_lease(
        &self,
        request: Request<spillway_proto::storage::AcquireLeaseRequest>,
    ) -> Result<Response<spillway_proto::storage::Lease>, Status> {
        let lease = self.api().acquire_lease(request.into_inner()).await?;
        Ok(Response::new(lease))
    }

    async fn release_lease(
        &self,
        request: Request<spillway_proto::storage::ReleaseLeaseRequest>,
    ) -> Result<Response<spillway_proto::storage::ReleaseLeaseResponse>, Status> {
        self.api().release_lease(request.into_inner().epoch).await?;
        Ok(Response::new(
            spillway_proto::storage::ReleaseLeaseResponse {},
        ))
    }

    type WatchQuotaStream = QuotaStateStream;

    async fn watch_quota(
        &self,
        _request: Request<WatchQuotaRequest>,
    ) -> Result<Response<Self::WatchQuotaStream>, Status> {
        use futures::StreamExt;
        let states = self.store.watch_quota().await?;
        let states = states.map(|state| state.map_err(Status::from));
        let Some(mut stop) = self.stop.clone() else {
            return Ok(Response::new(Box::pin(states)));
        };
        let stopped = async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        };
        Ok(Response::new(Box::pin(states.take_until(stopped))))
    }

    async fn status(
        &self,
        request: Request<StatusRequest>,
    ) -> Result<Response<StoreStatus>, Status> {
        self.fence(&request).await?;
        let count_records = request.into_inner().count_records;
        let status = self.api().status(count_records).await;
        Ok(Response::new(status?))
    }
}
