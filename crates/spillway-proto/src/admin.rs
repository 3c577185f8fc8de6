//! The management boundary: what the management service needs from the queue
//! engine. Like the message-path boundaries it is a trait with an in-process
//! implementation (`spillway_engine::Engine`, no serialization) and a remote
//! one over tonic ([`RemoteEngineAdmin`]). The calls carry the public API's
//! own messages (`crate::management`).

use crate::boundary::lazy_channel;
use crate::cluster::{ClusterChannel, ClusterClient};
use crate::engine::engine_admin_client::EngineAdminClient;
use crate::management as m;
use crate::ServiceError;
use async_trait::async_trait;

/// Calls `$m! { method(Request) -> Response; ... }` with every engine admin
/// call, so the remote client and the engine's gRPC server stay in step with
/// the trait (a macro writes each whole `impl`, attribute included).
#[macro_export]
macro_rules! for_each_engine_admin_call {
    ($m:ident) => {
        $m! {
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
            get_broker_status(GetBrokerStatusRequest) -> BrokerStatus;
            list_connections(ListConnectionsRequest) -> ListConnectionsResponse;
            list_channels(ListChannelsRequest) -> ListChannelsResponse;
            close_connection(CloseConnectionRequest) -> CloseConnectionResponse;
            set_broker_settings(SetBrokerSettingsRequest) -> SetBrokerSettingsResponse;
            update_queue(UpdateQueueRequest) -> UpdateQueueResponse;
            set_limits(SetLimitsRequest) -> Limits;
            clear_limits(ClearLimitsRequest) -> ClearLimitsResponse;
            list_limits(ListLimitsRequest) -> ListLimitsResponse;
            list_users(ListUsersRequest) -> ListUsersResponse;
            put_user(PutUserRequest) -> User;
            delete_user(DeleteUserRequest) -> DeleteUserResponse;
            set_permissions(SetPermissionsRequest) -> Permission;
            clear_permissions(ClearPermissionsRequest) -> ClearPermissionsResponse;
            list_permissions(ListPermissionsRequest) -> ListPermissionsResponse;
            set_transaction_timeouts(SetTransactionTimeoutsRequest) -> TransactionTimeouts;
        }
    };
}

/// What the management service needs from the queue engine. Every call is
/// answered by the engine alone; `get_broker_status` leaves the store
/// figures to the caller.
#[async_trait]
pub trait EngineAdminApi: Send + Sync + 'static {
    async fn create_vhost(&self, request: m::CreateVhostRequest) -> Result<m::Vhost, ServiceError>;
    async fn list_vhosts(
        &self,
        request: m::ListVhostsRequest,
    ) -> Result<m::ListVhostsResponse, ServiceError>;
    async fn delete_vhost(
        &self,
        request: m::DeleteVhostRequest,
    ) -> Result<m::DeleteVhostResponse, ServiceError>;
    async fn create_exchange(
        &self,
        request: m::CreateExchangeRequest,
    ) -> Result<m::Exchange, ServiceError>;
    async fn list_exchanges(
        &self,
        request: m::ListExchangesRequest,
    ) -> Result<m::ListExchangesResponse, ServiceError>;
    async fn delete_exchange(
        &self,
        request: m::DeleteExchangeRequest,
    ) -> Result<m::DeleteExchangeResponse, ServiceError>;
    async fn create_queue(&self, request: m::CreateQueueRequest) -> Result<m::Queue, ServiceError>;
    async fn list_queues(
        &self,
        request: m::ListQueuesRequest,
    ) -> Result<m::ListQueuesResponse, ServiceError>;
    async fn delete_queue(
        &self,
        request: m::DeleteQueueRequest,
    ) -> Result<m::DeleteQueueResponse, ServiceError>;
    async fn purge_queue(
        &self,
        request: m::PurgeQueueRequest,
    ) -> Result<m::PurgeQueueResponse, ServiceError>;
    async fn peek_messages(
        &self,
        request: m::PeekMessagesRequest,
    ) -> Result<m::PeekMessagesResponse, ServiceError>;
    async fn move_messages(
        &self,
        request: m::MoveMessagesRequest,
    ) -> Result<m::MoveMessagesResponse, ServiceError>;
    async fn create_binding(
        &self,
        request: m::CreateBindingRequest,
    ) -> Result<m::Binding, ServiceError>;
    async fn list_bindings(
        &self,
        request: m::ListBindingsRequest,
    ) -> Result<m::ListBindingsResponse, ServiceError>;
    async fn delete_binding(
        &self,
        request: m::DeleteBindingRequest,
    ) -> Result<m::DeleteBindingResponse, ServiceError>;
    async fn get_broker_status(
        &self,
        request: m::GetBrokerStatusRequest,
    ) -> Result<m::BrokerStatus, ServiceError>;
    async fn list_connections(
        &self,
        request: m::ListConnectionsRequest,
    ) -> Result<m::ListConnectionsResponse, ServiceError>;
    async fn list_channels(
        &self,
        request: m::ListChannelsRequest,
    ) -> Result<m::ListChannelsResponse, ServiceError>;
    async fn close_connection(
        &self,
        request: m::CloseConnectionRequest,
    ) -> Result<m::CloseConnectionResponse, ServiceError>;
    async fn set_broker_settings(
        &self,
        request: m::SetBrokerSettingsRequest,
    ) -> Result<m::SetBrokerSettingsResponse, ServiceError>;
    async fn update_queue(
        &self,
        request: m::UpdateQueueRequest,
    ) -> Result<m::UpdateQueueResponse, ServiceError>;
    /// Overrides one vhost's or user's limits (RabbitMQ's
    /// `set_vhost_limits` / `set_user_limits`).
    async fn set_limits(&self, request: m::SetLimitsRequest) -> Result<m::Limits, ServiceError>;
    /// Drops one vhost's or user's overrides: the defaults apply again.
    async fn clear_limits(
        &self,
        request: m::ClearLimitsRequest,
    ) -> Result<m::ClearLimitsResponse, ServiceError>;
    async fn list_limits(
        &self,
        request: m::ListLimitsRequest,
    ) -> Result<m::ListLimitsResponse, ServiceError>;
    async fn list_users(
        &self,
        request: m::ListUsersRequest,
    ) -> Result<m::ListUsersResponse, ServiceError>;
    /// Adds or changes a user (stored before it answers).
    async fn put_user(&self, request: m::PutUserRequest) -> Result<m::User, ServiceError>;
    /// Deletes a user and their permissions, closing their connections.
    async fn delete_user(
        &self,
        request: m::DeleteUserRequest,
    ) -> Result<m::DeleteUserResponse, ServiceError>;
    async fn set_permissions(
        &self,
        request: m::SetPermissionsRequest,
    ) -> Result<m::Permission, ServiceError>;
    async fn clear_permissions(
        &self,
        request: m::ClearPermissionsRequest,
    ) -> Result<m::ClearPermissionsResponse, ServiceError>;
    async fn list_permissions(
        &self,
        request: m::ListPermissionsRequest,
    ) -> Result<m::ListPermissionsResponse, ServiceError>;
    /// Sets one vhost's producer transaction timeouts.
    async fn set_transaction_timeouts(
        &self,
        request: m::SetTransactionTimeoutsRequest,
    ) -> Result<m::TransactionTimeouts, ServiceError>;
}

/// The engine's admin API over gRPC (management running in its own process).
#[derive(Clone)]
pub struct RemoteEngineAdmin {
    client: EngineAdminClient<ClusterChannel>,
}

impl RemoteEngineAdmin {
    /// `cluster`: the secret sent with every call and the message limit.
    pub fn connect_lazy(addr: &str, cluster: &ClusterClient) -> Result<Self, ServiceError> {
        let client = EngineAdminClient::new(lazy_channel(addr, cluster)?)
            .max_decoding_message_size(cluster.max_message_bytes)
            .max_encoding_message_size(cluster.max_message_bytes);
        Ok(Self { client })
    }
}

macro_rules! remote_impl {
    ($($method:ident($request:ident) -> $response:ident;)*) => {
        #[async_trait]
        impl EngineAdminApi for RemoteEngineAdmin {
            $(
                async fn $method(&self, request: m::$request) -> Result<m::$response, ServiceError> {
                    Ok(self.client.clone().$method(request).await?.into_inner())
                }
            )*
        }
    };
}

for_each_engine_admin_call!(remote_impl);
