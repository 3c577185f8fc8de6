//! `StorageService`: the storage node's gRPC face. Every call is a thin
//! translation onto a `StorageApi` (a `RocksStore` in practice), so the
//! engine sees the same behaviour through either wiring.
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use spillway_proto::storage::storage_server::Storage;
use spillway_proto::storage::{
    Definitions, LoadDefinitionsRequest, LoadMessagesRequest, QueueEntryChunk, QuotaState,
    ReadMessagesRequest, ReadMessagesResponse, StatusRequest, StoreStatus, WatchQuotaRequest,
    WriteAck, WriteBatch,
};
use spillway_proto::StorageApi;
use tonic::{Request, Response, Status};

use crate::RocksStore;

/// Entries per chunk when streaming a durable queue's entries.
const LOAD_CHUNK: usize = 4096;

/// The storage node's gRPC service, for an engine in another process.
pub struct StorageService {
    store: RocksStore,
    /// Ends the long-lived quota streams at shutdown: a graceful gRPC
    /// shutdown waits for every open stream.
    stop: Option<tokio::sync::watch::Receiver<bool>>,
}

impl StorageService {
    pub fn new(store: RocksStore) -> Self {
        Self { store, stop: None }
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
        let write = self.store.write(Arc::new(batch));
        spillway_proto::trace::with_remote_parent(&metadata, write).await?;
        Ok(Response::new(WriteAck {}))
    }

    async fn load_definitions(
        &self,
        _request: Request<LoadDefinitionsRequest>,
    ) -> Result<Response<Definitions>, Status> {
        Ok(Response::new(self.store.load_definitions().await?))
    }

    type LoadMessagesStream = ChunkStream;

    async fn load_messages(
        &self,
        request: Request<LoadMessagesRequest>,
    ) -> Result<Response<Self::LoadMessagesStream>, Status> {
        let request = request.into_inner();
        let entries = self
            .store
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
        let messages = StorageApi::read_messages(&self.store, request.into_inner().ids).await?;
        Ok(Response::new(ReadMessagesResponse { messages }))
    }

    async fn set_quota(
        &self,
        request: Request<spillway_proto::storage::SetQuotaRequest>,
    ) -> Result<Response<QuotaState>, Status> {
        let request = request.into_inner();
        StorageApi::set_quota(
            &self.store,
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
        let store = self.store.clone();
        let request = request.into_inner();
        // 0: no bound (an engine that predates the bound).
        let below_id = match request.below_id {
            0 => u64::MAX,
            below_id => below_id,
        };
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
        let lease = StorageApi::acquire_lease(&self.store, request.into_inner()).await?;
        Ok(Response::new(lease))
    }

    async fn release_lease(
        &self,
        request: Request<spillway_proto::storage::ReleaseLeaseRequest>,
    ) -> Result<Response<spillway_proto::storage::ReleaseLeaseResponse>, Status> {
        self.store.release_lease(request.into_inner().epoch);
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
        let count_records = request.into_inner().count_records;
        let status = StorageApi::status(&self.store, count_records).await;
        Ok(Response::new(status?))
    }
}
