//! The management service: Spillway's one public control API (gRPC,
//! `spillway.management.v1.Management`), never on the message path.
//!
//! It owns authentication (a tonic interceptor, [`Authenticator`]), server
//! reflection, and the composition of answers: definitions, inspection,
//! messages and connections come from the queue engine through
//! [`EngineAdminApi`] (in-process, or the engine's `EngineAdmin` gRPC
//! service), store figures and the store quota from the storage node through
//! [`StorageApi`].

use std::sync::Arc;

use spillway_proto::management::management_server::{Management, ManagementServer};
use spillway_proto::management::{self as m};
use spillway_proto::{EngineAdminApi, ServiceError, StorageApi, MANAGEMENT_DESCRIPTOR};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

mod auth;

pub use auth::{AuthConfig, Authenticator, ManagementUser};

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
    /// open: it only describes the public schema), ready to serve.
    pub fn routes(self, auth: AuthConfig) -> Result<Routes, ManagementError> {
        let service =
            InterceptedService::new(ManagementServer::new(self), Authenticator::new(auth));
        let reflection_v1 = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(MANAGEMENT_DESCRIPTOR)
            .build_v1()?;
        let reflection_v1alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(MANAGEMENT_DESCRIPTOR)
            .build_v1alpha()?;
        Ok(Routes::new(service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha))
    }
}

fn not_found(what: &str, name: &str, vhost: &str) -> Status {
    Status::not_found(format!("no {what} '{name}' in vhost '{vhost}'"))
}

fn answer<T>(result: Result<T, ServiceError>) -> Result<Response<T>, Status> {
    result.map(Response::new).map_err(Status::from)
}

/// The calls answered by the engine as they are.
macro_rules! management_impl {
    ($($method:ident($request:ident) -> $response:ident;)*) => {
        #[tonic::async_trait]
        impl Management for ManagementService {
            $(
                async fn $method(
                    &self,
                    request: Request<m::$request>,
                ) -> Result<Response<m::$response>, Status> {
                    answer(self.engine.$method(request.into_inner()).await)
                }
            )*

            async fn get_vhost(
                &self,
                request: Request<m::GetVhostRequest>,
            ) -> Result<Response<m::Vhost>, Status> {
                let name = request.into_inner().name;
                let vhosts = self.engine.list_vhosts(m::ListVhostsRequest {}).await?;
                vhosts
                    .vhosts
                    .into_iter()
                    .find(|v| v.name == name)
                    .map(Response::new)
                    .ok_or_else(|| Status::not_found(format!("vhost '{name}' not found")))
            }

            async fn get_exchange(
                &self,
                request: Request<m::GetExchangeRequest>,
            ) -> Result<Response<m::Exchange>, Status> {
                let m::GetExchangeRequest { vhost, name } = request.into_inner();
                let list = self
                    .engine
                    .list_exchanges(m::ListExchangesRequest { vhost: vhost.clone() })
                    .await?;
                list.exchanges
                    .into_iter()
                    .find(|x| x.name == name)
                    .map(Response::new)
                    .ok_or_else(|| not_found("exchange", &name, &vhost))
            }

            async fn get_queue(
                &self,
                request: Request<m::GetQueueRequest>,
            ) -> Result<Response<m::Queue>, Status> {
                let m::GetQueueRequest { vhost, name } = request.into_inner();
                let list = self
                    .engine
                    .list_queues(m::ListQueuesRequest { vhost: vhost.clone() })
                    .await?;
                list.queues
                    .into_iter()
                    .find(|q| q.name == name)
                    .map(Response::new)
                    .ok_or_else(|| not_found("queue", &name, &vhost))
            }

            async fn get_binding(
                &self,
                request: Request<m::GetBindingRequest>,
            ) -> Result<Response<m::Binding>, Status> {
                let wanted = request
                    .into_inner()
                    .binding
                    .ok_or_else(|| Status::invalid_argument("binding is required"))?;
                let list = self
                    .engine
                    .list_bindings(m::ListBindingsRequest {
                        vhost: wanted.vhost.clone(),
                        source: wanted.source.clone(),
                        destination: wanted.destination.clone(),
                    })
                    .await?;
                list.bindings
                    .into_iter()
                    .find(|b| {
                        b.destination_is_exchange == wanted.destination_is_exchange
                            && b.routing_key == wanted.routing_key
                            && b.arguments == wanted.arguments
                    })
                    .map(Response::new)
                    .ok_or_else(|| {
                        Status::not_found(format!(
                            "no binding from '{}' to '{}' with key '{}' in vhost '{}'",
                            wanted.source, wanted.destination, wanted.routing_key, wanted.vhost
                        ))
                    })
            }

            async fn get_broker_status(
                &self,
                request: Request<m::GetBrokerStatusRequest>,
            ) -> Result<Response<m::BrokerStatus>, Status> {
                let mut status = self.engine.get_broker_status(request.into_inner()).await?;
                let store = self.storage.status(false).await?;
                status.store_disk_bytes = store.disk_bytes;
                status.stored_messages = store.estimated_keys;
                // The first state of the quota stream is the one in force.
                let mut quota = self.storage.watch_quota().await?;
                if let Some(Ok(state)) = futures::StreamExt::next(&mut quota).await {
                    status.store_quota_bytes = Some(state.overfull_size);
                    status.store_underfull_bytes = state.underfull_size;
                    status.store_overfull = state.overfull;
                }
                Ok(Response::new(status))
            }

            async fn set_broker_settings(
                &self,
                request: Request<m::SetBrokerSettingsRequest>,
            ) -> Result<Response<m::SetBrokerSettingsResponse>, Status> {
                let request = request.into_inner();
                let logged = format!("{request:?}");
                let response = self.engine.set_broker_settings(request).await?;
                tracing::info!(settings = %logged, "broker settings changed by management");
                Ok(Response::new(response))
            }

            async fn update_queue(
                &self,
                request: Request<m::UpdateQueueRequest>,
            ) -> Result<Response<m::UpdateQueueResponse>, Status> {
                let request = request.into_inner();
                let logged = format!("{request:?}");
                let response = self.engine.update_queue(request).await?;
                tracing::info!(settings = %logged, "queue settings changed by management");
                Ok(Response::new(response))
            }

            async fn set_limits(
                &self,
                request: Request<m::SetLimitsRequest>,
            ) -> Result<Response<m::Limits>, Status> {
                let request = request.into_inner();
                let logged = format!("{request:?}");
                let response = self.engine.set_limits(request).await?;
                tracing::info!(limits = %logged, "limits changed by management");
                Ok(Response::new(response))
            }

            async fn clear_limits(
                &self,
                request: Request<m::ClearLimitsRequest>,
            ) -> Result<Response<m::ClearLimitsResponse>, Status> {
                let request = request.into_inner();
                let logged = format!("{request:?}");
                let response = self.engine.clear_limits(request).await?;
                tracing::info!(limits = %logged, "limits cleared by management");
                Ok(Response::new(response))
            }

            async fn put_user(
                &self,
                request: Request<m::PutUserRequest>,
            ) -> Result<Response<m::User>, Status> {
                let request = request.into_inner();
                // Never the password in the log.
                let (user, password_set, tags) = (
                    request.name.clone(),
                    request.password.is_some(),
                    request.tags.join(","),
                );
                let response = self.engine.put_user(request).await?;
                tracing::info!(user, password_set, tags, "user stored by management");
                Ok(Response::new(response))
            }

            async fn delete_user(
                &self,
                request: Request<m::DeleteUserRequest>,
            ) -> Result<Response<m::DeleteUserResponse>, Status> {
                let user = request.get_ref().name.clone();
                let response = self.engine.delete_user(request.into_inner()).await?;
                tracing::info!(user, closed_connections = response.closed_connections, "user deleted by management");
                Ok(Response::new(response))
            }

            async fn set_permissions(
                &self,
                request: Request<m::SetPermissionsRequest>,
            ) -> Result<Response<m::Permission>, Status> {
                let request = request.into_inner();
                let logged = format!("{request:?}");
                let response = self.engine.set_permissions(request).await?;
                tracing::info!(permissions = %logged, "permissions set by management");
                Ok(Response::new(response))
            }

            async fn clear_permissions(
                &self,
                request: Request<m::ClearPermissionsRequest>,
            ) -> Result<Response<m::ClearPermissionsResponse>, Status> {
                let request = request.into_inner();
                let logged = format!("{request:?}");
                let response = self.engine.clear_permissions(request).await?;
                tracing::info!(permissions = %logged, "permissions cleared by management");
                Ok(Response::new(response))
            }

            async fn set_store_quota(
                &self,
                request: Request<m::SetStoreQuotaRequest>,
            ) -> Result<Response<m::SetStoreQuotaResponse>, Status> {
                let request = request.into_inner();
                let logged = format!("{request:?}");
                self.storage.set_quota(request).await?;
                tracing::info!(quota = %logged, "store quota changed by management");
                Ok(Response::new(m::SetStoreQuotaResponse {}))
            }

            async fn set_transaction_timeouts(
                &self,
                request: Request<m::SetTransactionTimeoutsRequest>,
            ) -> Result<Response<m::TransactionTimeouts>, Status> {
                let request = request.into_inner();
                let response = self.engine.set_transaction_timeouts(request).await?;
                tracing::info!(timeouts = ?response, "transaction timeouts changed by management");
                Ok(Response::new(response))
            }
        }
    };
}

management_impl! {
    create_vhost(CreateVhostRequest) -> Vhost;
    list_vhosts(ListVhostsRequest) -> ListVhostsResponse;
    delete_vhost(DeleteVhostRequest) -> DeleteVhostResponse;
    create_exchange(CreateExchangeRequest) -> Exchange;
    list_exchanges(ListExchangesRequest) -> ListExchangesResponse;
    delete_exchange(DeleteExchangeRequest) -> DeleteExchangeResponse;
    create_queue(CreateQueueRequest) -> Queue;
    list_queues(ListQueuesRequest) -> ListQueuesResponse;
    delete_queue(DeleteQueueRequest) -> DeleteQueueResponse;
    purge_queue(PurgeQueueRequest) -> PurgeQueueResponse;
    peek_messages(PeekMessagesRequest) -> PeekMessagesResponse;
    move_messages(MoveMessagesRequest) -> MoveMessagesResponse;
    create_binding(CreateBindingRequest) -> Binding;
    list_bindings(ListBindingsRequest) -> ListBindingsResponse;
    delete_binding(DeleteBindingRequest) -> DeleteBindingResponse;
    list_connections(ListConnectionsRequest) -> ListConnectionsResponse;
    list_channels(ListChannelsRequest) -> ListChannelsResponse;
    close_connection(CloseConnectionRequest) -> CloseConnectionResponse;
    list_limits(ListLimitsRequest) -> ListLimitsResponse;
    list_users(ListUsersRequest) -> ListUsersResponse;
    list_permissions(ListPermissionsRequest) -> ListPermissionsResponse;
}
