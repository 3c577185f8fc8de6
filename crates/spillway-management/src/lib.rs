//! The management service: the one public control API, never on the message
//! path. For now it answers broker status from the storage node; the
//! management issue grows it into the full API (declare, inspect, runtime
//! settings, connections) with authentication and server reflection.

use std::sync::Arc;

use spillway_proto::management::management_server::{Management, ManagementServer};
use spillway_proto::management::{BrokerStatus, GetBrokerStatusRequest};
use spillway_proto::StorageApi;
use tonic::{Request, Response, Status};

pub struct ManagementService {
    storage: Arc<dyn StorageApi>,
}

impl ManagementService {
    pub fn new(storage: Arc<dyn StorageApi>) -> Self {
        Self { storage }
    }

    pub fn into_server(self) -> ManagementServer<Self> {
        ManagementServer::new(self)
    }
}

#[tonic::async_trait]
impl Management for ManagementService {
    async fn get_broker_status(
        &self,
        _request: Request<GetBrokerStatusRequest>,
    ) -> Result<Response<BrokerStatus>, Status> {
        let store = self.storage.status(false).await?;
        Ok(Response::new(BrokerStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            store_disk_bytes: store.disk_bytes,
            stored_messages: store.estimated_keys,
        }))
    }
}
