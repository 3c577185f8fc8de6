//! The management boundary: what the management service needs from the queue
//! engine. Like the message-path boundaries it is a trait with an in-process
//! implementation (`spillway_engine::Engine`, no serialization) and a remote
//! one over tonic ([`RemoteEngineAdmin`]). The calls carry the public API's
//! own messages (`crate::management`).

use crate::cluster::lazy_channel;
use crate::cluster::{ClusterChannel, ClusterClient};
use crate::engine as pb;
use crate::engine::engine_admin_client::EngineAdminClient;
use crate::management as m;
use crate::util::rotation::{Attempts, Rotation};
use crate::ServiceError;
use async_trait::async_trait;

/// Calls `$m! { method(m::Request) -> m::Response; ... }` with every engine
/// admin call (`m` is `spillway_proto::management`, `pb` is
/// `spillway_proto::engine`, both imported where the macro is used), so the remote client and the engine's gRPC server stay in step with
/// the trait (a macro writes each whole `impl`, attribute included).
#[macro_export]
macro_rules! for_each_engine_admin_call {
    ($m:ident) => {
        $m! {
            create_vhost(m::CreateVhostRequest) -> m::Vhost;
            list_vhosts(m::ListVhostsRequest) -> m::ListVhostsResponse;
            delete_vhost(m::DeleteVhostRequest) -> m::DeleteVhostResponse;
            create_exchange(m::CreateExchangeRequest) -> m::Exchange;
            list_exchanges(m::ListExchangesRequest) -> m::ListExchangesResponse;
            delete_exchange(m::DeleteExchangeRequest) -> m::DeleteExchangeResponse;
            create_queue(m::CreateQueueRequest) -> m::Queue;
            list_queues(m::ListQueuesRequest) -> m::ListQueuesResponse;
            get_queue(m::GetQueueRequest) -> m::Queue;
            get_vhost(m::GetVhostRequest) -> m::Vhost;
            vhost_message_totals(pb::VhostMessageTotalsRequest) -> pb::VhostMessageTotalsResponse;
            delete_queue(m::DeleteQueueRequest) -> m::DeleteQueueResponse;
            purge_queue(m::PurgeQueueRequest) -> m::PurgeQueueResponse;
            peek_messages(m::PeekMessagesRequest) -> m::PeekMessagesResponse;
            get_messages(m::GetMessagesRequest) -> m::PeekMessagesResponse;
            move_messages(m::MoveMessagesRequest) -> m::MoveMessagesResponse;
            publish_message(m::PublishMessageRequest) -> m::PublishMessageResponse;
            create_binding(m::CreateBindingRequest) -> m::Binding;
            list_bindings(m::ListBindingsRequest) -> m::ListBindingsResponse;
            delete_binding(m::DeleteBindingRequest) -> m::DeleteBindingResponse;
            get_broker_status(m::GetBrokerStatusRequest) -> m::BrokerStatus;
            list_connections(m::ListConnectionsRequest) -> m::ListConnectionsResponse;
            list_channels(m::ListChannelsRequest) -> m::ListChannelsResponse;
            list_consumers(m::ListConsumersRequest) -> m::ListConsumersResponse;
            close_connection(m::CloseConnectionRequest) -> m::CloseConnectionResponse;
            set_broker_settings(m::SetBrokerSettingsRequest) -> m::SetBrokerSettingsResponse;
            update_queue(m::UpdateQueueRequest) -> m::UpdateQueueResponse;
            set_limits(m::SetLimitsRequest) -> m::Limits;
            clear_limits(m::ClearLimitsRequest) -> m::ClearLimitsResponse;
            list_limits(m::ListLimitsRequest) -> m::ListLimitsResponse;
            list_users(m::ListUsersRequest) -> m::ListUsersResponse;
            put_user(m::PutUserRequest) -> m::User;
            delete_user(m::DeleteUserRequest) -> m::DeleteUserResponse;
            set_permissions(m::SetPermissionsRequest) -> m::Permission;
            clear_permissions(m::ClearPermissionsRequest) -> m::ClearPermissionsResponse;
            list_permissions(m::ListPermissionsRequest) -> m::ListPermissionsResponse;
            set_transaction_timeouts(m::SetTransactionTimeoutsRequest) -> m::TransactionTimeouts;
            set_policy(m::SetPolicyRequest) -> m::Policy;
            list_policies(m::ListPoliciesRequest) -> m::ListPoliciesResponse;
            clear_policy(m::ClearPolicyRequest) -> m::ClearPolicyResponse;
            export_definitions(m::ExportDefinitionsRequest) -> m::Definitions;
            import_definitions(m::ImportDefinitionsRequest) -> m::ImportDefinitionsResponse;
            authenticate_user(pb::AuthenticateUserRequest) -> pb::AuthenticateUserResponse;
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
    /// One queue, looked up alone.
    async fn get_queue(&self, request: m::GetQueueRequest) -> Result<m::Queue, ServiceError>;
    /// One vhost, looked up alone.
    async fn get_vhost(&self, request: m::GetVhostRequest) -> Result<m::Vhost, ServiceError>;
    /// Ready and unacknowledged messages per vhost (every vhost, or the one
    /// asked).
    async fn vhost_message_totals(
        &self,
        request: pb::VhostMessageTotalsRequest,
    ) -> Result<pb::VhostMessageTotalsResponse, ServiceError>;
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
    async fn get_messages(
        &self,
        request: m::GetMessagesRequest,
    ) -> Result<m::PeekMessagesResponse, ServiceError>;
    async fn move_messages(
        &self,
        request: m::MoveMessagesRequest,
    ) -> Result<m::MoveMessagesResponse, ServiceError>;
    async fn publish_message(
        &self,
        request: m::PublishMessageRequest,
    ) -> Result<m::PublishMessageResponse, ServiceError>;
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
    async fn list_consumers(
        &self,
        request: m::ListConsumersRequest,
    ) -> Result<m::ListConsumersResponse, ServiceError>;
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
    /// Adds or replaces a policy or operator policy (stored before it
    /// answers) and applies it to the vhost's queues and exchanges.
    async fn set_policy(&self, request: m::SetPolicyRequest) -> Result<m::Policy, ServiceError>;
    async fn list_policies(
        &self,
        request: m::ListPoliciesRequest,
    ) -> Result<m::ListPoliciesResponse, ServiceError>;
    /// Removes a policy; what it set stops applying at once.
    async fn clear_policy(
        &self,
        request: m::ClearPolicyRequest,
    ) -> Result<m::ClearPolicyResponse, ServiceError>;
    /// The broker's definitions (or one vhost's), password hashes included.
    async fn export_definitions(
        &self,
        request: m::ExportDefinitionsRequest,
    ) -> Result<m::Definitions, ServiceError>;
    /// Applies definitions all at once, or not at all.
    async fn import_definitions(
        &self,
        request: m::ImportDefinitionsRequest,
    ) -> Result<m::ImportDefinitionsResponse, ServiceError>;
    /// Checks a stored user's password for management; an accepted answer
    /// carries the user's tags and permissions.
    async fn authenticate_user(
        &self,
        request: pb::AuthenticateUserRequest,
    ) -> Result<pb::AuthenticateUserResponse, ServiceError>;
}

/// The engine's admin API over gRPC (management running in its own process).
#[derive(Clone)]
pub struct RemoteEngineAdmin {
    /// Every engine's address and client: one, or several of which one is
    /// active and the others stand by without listening. The one that
    /// answered last is asked first (shared by clones).
    engines: Rotation<EngineAdminClient<ClusterChannel>>,
}

impl RemoteEngineAdmin {
    /// `cluster`: the secret sent with every call and the message limit.
    pub fn connect_lazy(addr: &str, cluster: &ClusterClient) -> Result<Self, ServiceError> {
        Self::connect_lazy_all(&[addr.to_string()], cluster)
    }

    /// Clients of several engines (`management.engine_addrs`): a call goes
    /// to the engine that answered last, and to the next one when that one
    /// cannot be reached, once round the list (as the gateway's
    /// `FailoverEngine`).
    pub fn connect_lazy_all(
        addrs: &[String],
        cluster: &ClusterClient,
    ) -> Result<Self, ServiceError> {
        let engines = addrs
            .iter()
            .map(|addr| {
                let client = EngineAdminClient::new(lazy_channel(addr, cluster)?)
                    .max_decoding_message_size(cluster.max_message_bytes)
                    .max_encoding_message_size(cluster.max_message_bytes);
                Ok((addr.clone(), client))
            })
            .collect::<Result<Vec<_>, ServiceError>>()?;
        Ok(Self {
            engines: Rotation::new("engine", engines)?,
        })
    }
}

macro_rules! remote_impl {
    ($($method:ident($request:ty) -> $response:ty;)*) => {
        #[async_trait]
        impl EngineAdminApi for RemoteEngineAdmin {
            $(
                async fn $method(&self, request: $request) -> Result<$response, ServiceError> {
                    self.engines
                        .call(Attempts::ONE_ROUND, |client| {
                            let mut client = client.clone();
                            let request = request.clone();
                            Box::pin(async move {
                                client
                                    .$method(request)
                                    .await
                                    .map(tonic::Response::into_inner)
                                    .map_err(ServiceError::from)
                            })
                        })
                        .await
                }
            )*
        }
    };
}

for_each_engine_admin_call!(remote_impl);
