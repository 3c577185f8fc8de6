//! The management service's calls, one module per resource: [`vhosts`],
//! [`exchanges`], [`queues`], [`bindings`], [`messages`] (peek, get, move,
//! publish), [`connections`] (with channels and consumers), [`limits`],
//! [`users`] (with permissions), [`policies`] (with queue settings),
//! [`definitions`], [`overview`] (the broker's status and runtime
//! settings) and [`storage`] (the store quota and the storage group).
//!
//! Each call is a method of [`ManagementService`] of the same name as its
//! gRPC method, taking the [`Caller`] and the request: it checks what the
//! caller needs ([`crate::authorize`]), asks the engine or the storage node,
//! and logs what it changed. The gRPC service and the HTTP API both call
//! these methods; this file only hands the tonic trait to them, from the
//! one list of calls below, which the compiler checks against
//! `management.proto` (a call missing from it leaves the trait
//! unimplemented).

use spillway_proto::management::management_server::Management;
use spillway_proto::management::{self as m};
use spillway_proto::ServiceError;
use tonic::{Request, Response, Status};

use crate::authorize::caller_of;
use crate::ManagementService;

mod bindings;
mod connections;
mod definitions;
mod exchanges;
mod limits;
mod messages;
mod overview;
mod policies;
mod queues;
mod storage;
mod users;
mod vhosts;

/// Every call of `spillway.management.v1.Management` with its request and
/// answer, grouped by resource as the modules are.
macro_rules! for_each_management_call {
    ($callback:ident) => {
        $callback! {
            create_vhost(CreateVhostRequest) -> Vhost;
            delete_vhost(DeleteVhostRequest) -> DeleteVhostResponse;
            list_vhosts(ListVhostsRequest) -> ListVhostsResponse;
            get_vhost(GetVhostRequest) -> Vhost;
            create_exchange(CreateExchangeRequest) -> Exchange;
            delete_exchange(DeleteExchangeRequest) -> DeleteExchangeResponse;
            list_exchanges(ListExchangesRequest) -> ListExchangesResponse;
            get_exchange(GetExchangeRequest) -> Exchange;
            create_queue(CreateQueueRequest) -> Queue;
            delete_queue(DeleteQueueRequest) -> DeleteQueueResponse;
            purge_queue(PurgeQueueRequest) -> PurgeQueueResponse;
            list_queues(ListQueuesRequest) -> ListQueuesResponse;
            get_queue(GetQueueRequest) -> Queue;
            update_queue(UpdateQueueRequest) -> UpdateQueueResponse;
            create_binding(CreateBindingRequest) -> Binding;
            delete_binding(DeleteBindingRequest) -> DeleteBindingResponse;
            list_bindings(ListBindingsRequest) -> ListBindingsResponse;
            get_binding(GetBindingRequest) -> Binding;
            peek_messages(PeekMessagesRequest) -> PeekMessagesResponse;
            get_messages(GetMessagesRequest) -> PeekMessagesResponse;
            move_messages(MoveMessagesRequest) -> MoveMessagesResponse;
            publish_message(PublishMessageRequest) -> PublishMessageResponse;
            list_connections(ListConnectionsRequest) -> ListConnectionsResponse;
            close_connection(CloseConnectionRequest) -> CloseConnectionResponse;
            list_channels(ListChannelsRequest) -> ListChannelsResponse;
            list_consumers(ListConsumersRequest) -> ListConsumersResponse;
            set_limits(SetLimitsRequest) -> Limits;
            clear_limits(ClearLimitsRequest) -> ClearLimitsResponse;
            list_limits(ListLimitsRequest) -> ListLimitsResponse;
            put_user(PutUserRequest) -> User;
            delete_user(DeleteUserRequest) -> DeleteUserResponse;
            list_users(ListUsersRequest) -> ListUsersResponse;
            set_permissions(SetPermissionsRequest) -> Permission;
            clear_permissions(ClearPermissionsRequest) -> ClearPermissionsResponse;
            list_permissions(ListPermissionsRequest) -> ListPermissionsResponse;
            set_policy(SetPolicyRequest) -> Policy;
            clear_policy(ClearPolicyRequest) -> ClearPolicyResponse;
            list_policies(ListPoliciesRequest) -> ListPoliciesResponse;
            export_definitions(ExportDefinitionsRequest) -> Definitions;
            import_definitions(ImportDefinitionsRequest) -> ImportDefinitionsResponse;
            get_broker_status(GetBrokerStatusRequest) -> BrokerStatus;
            set_broker_settings(SetBrokerSettingsRequest) -> SetBrokerSettingsResponse;
            set_transaction_timeouts(SetTransactionTimeoutsRequest) -> TransactionTimeouts;
            set_store_quota(SetStoreQuotaRequest) -> SetStoreQuotaResponse;
            get_storage_group(GetStorageGroupRequest) -> StorageGroup;
            add_storage_member(AddStorageMemberRequest) -> StorageGroup;
            remove_storage_member(RemoveStorageMemberRequest) -> StorageGroup;
        }
    };
}

/// The gRPC service: each method is [`ManagementService`]'s own method of
/// that name, with the caller the authenticating layer found.
macro_rules! grpc_calls {
    ($($method:ident($request:ident) -> $response:ident;)*) => {
        #[tonic::async_trait]
        impl Management for ManagementService {
            $(
                async fn $method(
                    &self,
                    request: Request<m::$request>,
                ) -> Result<Response<m::$response>, Status> {
                    let caller = caller_of(&request)?;
                    let answer = ManagementService::$method(self, &caller, request.into_inner()).await?;
                    Ok(Response::new(answer))
                }
            )*
        }
    };
}

for_each_management_call!(grpc_calls);

/// An engine's or a storage node's answer as management gives it.
fn answer<T>(result: Result<T, ServiceError>) -> Result<T, Status> {
    result.map_err(Status::from)
}

fn not_found(what: &str, name: &str, vhost: &str) -> Status {
    Status::not_found(format!("no {what} '{name}' in vhost '{vhost}'"))
}
