//! The management service: Spillway's one public control API (gRPC,
//! `spillway.management.v1.Management`), never on the message path.
//!
//! It owns authentication (a tower service in front of the gRPC service,
//! [`Authenticated`]), authorization by RabbitMQ's user tags and permissions
//! ([`authorize`]), server reflection, and the composition of answers: definitions, inspection,
//! messages and connections come from the queue engine through
//! [`EngineAdminApi`] (in-process, or the engine's `EngineAdmin` gRPC
//! service), store figures and the store quota from the storage node through
//! [`StorageApi`].
//!
//! Its calls live by resource in `service/` (one module each: vhosts,
//! exchanges, queues, bindings, messages, connections, limits, users,
//! policies, definitions, the overview, the storage node), each a method of
//! [`ManagementService`] taking the caller. The same service answers
//! RabbitMQ's management HTTP API ([`http`], again one module per
//! resource): each HTTP endpoint calls the same method with the caller that
//! the same authenticator found.

use std::sync::Arc;

use spillway_proto::management::management_server::ManagementServer;
use spillway_proto::{
    engine::EngineAdminApi, management::MANAGEMENT_DESCRIPTOR, storage::StorageApi,
};
use spillway_telemetry::Metrics;
use tonic::service::Routes;

mod auth;
pub mod authorize;
pub mod http;
mod service;

pub use auth::{AuthConfig, Authenticated, Authenticator, Caller, ManagementUser};

#[derive(Debug, thiserror::Error)]
pub enum ManagementError {
    #[error("cannot build the reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

pub struct ManagementService {
    engine: Arc<dyn EngineAdminApi>,
    storage: Arc<dyn StorageApi>,
}

impl ManagementService {
    pub fn new(engine: Arc<dyn EngineAdminApi>, storage: Arc<dyn StorageApi>) -> Self {
        Self { engine, storage }
    }

    /// The authenticated management service plus server reflection (left
    /// open: it only describes the public schema), ready to serve, and the
    /// HTTP API over the same service and authenticator (served only when
    /// `management.http_listen` is set). Refused logins of both are counted
    /// in `metrics`; `node` names this node in HTTP answers.
    pub fn routes(
        self,
        auth: AuthConfig,
        metrics: &Metrics,
        node: &str,
    ) -> Result<Served, ManagementError> {
        let authenticator = Arc::new(Authenticator::new(auth, self.engine.clone()));
        authenticator.register_metrics(metrics);
        let service = Arc::new(self);
        let grpc = Authenticated::new(
            ManagementServer::from_arc(service.clone()),
            authenticator.clone(),
        );
        let reflection_v1 = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(MANAGEMENT_DESCRIPTOR)
            .build_v1()?;
        let reflection_v1alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(MANAGEMENT_DESCRIPTOR)
            .build_v1alpha()?;
        let grpc = Routes::new(grpc)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha);
        let http = http::HttpApi {
            service,
            authenticator,
            node: node.to_string(),
            listeners: Vec::new(),
            rates: http::rates::Rates::default(),
            sample_every: http::DEFAULT_SAMPLE_INTERVAL,
            list_slots: tokio::sync::Semaphore::new(http::LIST_SLOTS),
        };
        Ok(Served { grpc, http })
    }
}

/// What the management service serves: its gRPC routes and its HTTP API.
pub struct Served {
    pub grpc: Routes,
    pub http: http::HttpApi,
}
