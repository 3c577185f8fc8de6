use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use spillway_proto::storage::storage_server::Storage;
use spillway_proto::storage::{
    Definitions, LoadDefinitionsRequest, LoadMessagesRequest, StatusRequest, StoreStatus,
    StoredMessageChunk, WriteAck, WriteBatch,
};
use spillway_proto::StorageApi;
use tonic::{Request, Response, Status};

use crate::RocksStore;

/// Messages per chunk when streaming a queue's stored messages.
const LOAD_CHUNK: usize = 512;

/// The storage node's gRPC service, for an engine in another process.
pub struct StorageService {
    store: RocksStore,
}

impl StorageService {
    pub fn new(store: RocksStore) -> Self {
        Self { store }
    }

    pub fn into_server(self) -> spillway_proto::storage::storage_server::StorageServer<Self> {
        spillway_proto::storage::storage_server::StorageServer::new(self)
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX)
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<StoredMessageChunk, Status>> + Send>>;

#[tonic::async_trait]
impl Storage for StorageService {
    async fn write(&self, request: Request<WriteBatch>) -> Result<Response<WriteAck>, Status> {
        self.store.write(Arc::new(request.into_inner())).await?;
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
        let messages = self
            .store
            .load_messages(&request.vhost, &request.queue)
            .await
            .map_err(Status::from)?;
        let mut chunks = Vec::with_capacity(messages.len() / LOAD_CHUNK + 1);
        let mut messages = messages.into_iter().peekable();
        while messages.peek().is_some() {
            let chunk: Vec<_> = messages.by_ref().take(LOAD_CHUNK).collect();
            chunks.push(Ok(StoredMessageChunk { messages: chunk }));
        }
        Ok(Response::new(Box::pin(futures::stream::iter(chunks))))
    }

    async fn status(
        &self,
        _request: Request<StatusRequest>,
    ) -> Result<Response<StoreStatus>, Status> {
        let status = StorageApi::status(&self.store).await;
        Ok(Response::new(status?))
    }
}
