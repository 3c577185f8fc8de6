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
//! The same service answers RabbitMQ's management HTTP API ([`http`]):
//! each HTTP endpoint calls the gRPC method with the caller that the same
//! authenticator found.

use std::sync::Arc;

use spillway_proto::management::management_server::{Management, ManagementServer};
use spillway_proto::management::{self as m};
use spillway_proto::permissions::{
    alternate_exchange_requirements, dead_letter_requirements, Access, Requirement,
};
use spillway_proto::{
    engine::EngineAdminApi, management::MANAGEMENT_DESCRIPTOR, storage::StorageApi, ServiceError,
};
use spillway_telemetry::Metrics;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

mod auth;
pub mod authorize;
pub mod http;

pub use auth::{AuthConfig, Authenticated, Authenticator, Caller, ManagementUser};
use authorize::{authorize, caller_of, Need};

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

    /// Ready and unacknowledged messages of each vhost the caller sees
    /// (of `vhost` alone when given), for the HTTP API's vhosts. Not a gRPC
    /// method: the public API shows the same figures per queue.
    pub async fn vhost_message_totals(
        &self,
        caller: &Caller,
        vhost: Option<&str>,
    ) -> Result<Vec<spillway_proto::engine::VhostMessageTotals>, Status> {
        match vhost {
            Some(vhost) => authorize(caller, &[Need::See { vhost }])?,
            None => authorize(caller, &[Need::Overview])?,
        }
        let request = spillway_proto::engine::VhostMessageTotalsRequest {
            vhost: vhost.unwrap_or_default().to_string(),
        };
        let mut totals = self.engine.vhost_message_totals(request).await?.vhosts;
        totals.retain(|totals| authorize::sees_vhost(caller, &totals.vhost));
        Ok(totals)
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

impl ManagementService {
    /// Replaces the broker's totals with those of the vhosts `caller` sees,
    /// for a caller without `monitoring` (RabbitMQ's overview sums only the
    /// vhosts such a user may access): vhosts, queues, connections,
    /// channels, consumers, messages and their bytes, spilled messages,
    /// blocked channels. Flow to disk's threshold, state and resident bytes
    /// and the store's figures stay the broker's: they are the broker's
    /// health, not what is in a vhost.
    async fn count_visible_vhosts_only(
        &self,
        caller: &Caller,
        status: &mut m::BrokerStatus,
    ) -> Result<(), Status> {
        let vhosts: Vec<m::Vhost> = self
            .engine
            .list_vhosts(m::ListVhostsRequest {})
            .await?
            .vhosts
            .into_iter()
            .filter(|vhost| authorize::sees_vhost(caller, &vhost.name))
            .collect();
        status.vhosts = vhosts.len() as u32;
        status.queues = vhosts.iter().map(|vhost| vhost.queues).sum();
        status.connections = vhosts.iter().map(|vhost| vhost.connections).sum();
        status.messages_ready = 0;
        status.messages_unacked = 0;
        status.message_bytes = 0;
        status.consumers = 0;
        status.spilled_messages = 0;
        status.spilled_bytes = 0;
        for vhost in &vhosts {
            let queues = self
                .engine
                .list_queues(m::ListQueuesRequest {
                    vhost: vhost.name.clone(),
                })
                .await?
                .queues;
            for queue in queues.iter().filter_map(|queue| queue.status.as_ref()) {
                status.messages_ready += queue.messages;
                status.messages_unacked += queue.unacked;
                status.message_bytes += queue.bytes;
                status.consumers += queue.consumers as u32;
                status.spilled_messages += queue.spilled_messages;
                status.spilled_bytes += queue.spilled_bytes;
            }
        }
        let channels = self
            .engine
            .list_channels(m::ListChannelsRequest::default())
            .await?
            .channels;
        let visible = channels
            .iter()
            .filter(|channel| vhosts.iter().any(|vhost| vhost.name == channel.vhost));
        status.channels = visible.clone().count() as u32;
        status.blocked_channels = visible.filter(|channel| channel.blocked).count() as u32;
        Ok(())
    }
}

/// What the management service serves: its gRPC routes and its HTTP API.
pub struct Served {
    pub grpc: Routes,
    pub http: http::HttpApi,
}

fn not_found(what: &str, name: &str, vhost: &str) -> Status {
    Status::not_found(format!("no {what} '{name}' in vhost '{vhost}'"))
}

fn answer<T>(result: Result<T, ServiceError>) -> Result<Response<T>, Status> {
    result.map(Response::new).map_err(Status::from)
}

fn configure<'a>(vhost: &'a str, kind: &'static str, name: &'a str) -> Need<'a> {
    Need::Permission {
        vhost,
        access: Access::Configure,
        kind,
        name,
    }
}

fn read_queue<'a>(vhost: &'a str, name: &'a str) -> Need<'a> {
    Need::Permission {
        vhost,
        access: Access::Read,
        kind: "queue",
        name,
    }
}

fn write_queue<'a>(vhost: &'a str, name: &'a str) -> Need<'a> {
    Need::Permission {
        vhost,
        access: Access::Write,
        kind: "queue",
        name,
    }
}

fn write_exchange<'a>(vhost: &'a str, name: &'a str) -> Need<'a> {
    Need::Permission {
        vhost,
        access: Access::Write,
        kind: "exchange",
        name,
    }
}

/// A binding needs write on its destination and read on its source, as
/// queue.bind and exchange.bind do over AMQP.
fn bind(binding: Option<&m::Binding>) -> Result<[Need<'_>; 2], Status> {
    let binding = binding.ok_or_else(|| Status::invalid_argument("binding is required"))?;
    Ok([
        Need::Permission {
            vhost: &binding.vhost,
            access: Access::Write,
            kind: if binding.destination_is_exchange {
                "exchange"
            } else {
                "queue"
            },
            name: &binding.destination,
        },
        Need::Permission {
            vhost: &binding.vhost,
            access: Access::Read,
            kind: "exchange",
            name: &binding.source,
        },
    ])
}

/// One more permission a declare's arguments need (a dead-letter or an
/// alternate exchange), as a [`Need`].
fn requirement<'a>(vhost: &'a str, requirement: &'a Requirement) -> Need<'a> {
    Need::Permission {
        vhost,
        access: requirement.access,
        kind: requirement.resource.as_str(),
        name: &requirement.name,
    }
}

/// A string argument of a management declare; other types are the
/// engine's to refuse.
fn string_argument<'a>(
    arguments: &'a std::collections::HashMap<String, m::ArgumentValue>,
    key: &str,
) -> Option<&'a str> {
    match arguments.get(key)?.value.as_ref()? {
        m::argument_value::Value::StringValue(text) | m::argument_value::Value::Text(text) => {
            Some(text)
        }
        _ => None,
    }
}

/// `x-qpid-dlq-enabled` as the engine reads it: true, or the string `true`.
fn qpid_dlq_enabled(arguments: &std::collections::HashMap<String, m::ArgumentValue>) -> bool {
    match arguments
        .get("x-qpid-dlq-enabled")
        .and_then(|value| value.value.as_ref())
    {
        Some(m::argument_value::Value::BoolValue(enabled)) => *enabled,
        Some(m::argument_value::Value::StringValue(text)) => text == "true",
        _ => false,
    }
}

/// The calls answered by the engine as they are, each with what its caller
/// needs (`|request| [needs]`).
macro_rules! management_impl {
    ($($method:ident($request:ident) -> $response:ident, |$r:ident| $needs:expr;)*) => {
        #[tonic::async_trait]
        impl Management for ManagementService {
            $(
                async fn $method(
                    &self,
                    request: Request<m::$request>,
                ) -> Result<Response<m::$response>, Status> {
                    let caller = caller_of(&request)?;
                    let $r = request.into_inner();
                    authorize(&caller, &$needs)?;
                    answer(self.engine.$method($r).await)
                }
            )*

            /// Configure on the queue, and what its dead-letter arguments
            /// need (as `queue.declare` over AMQP).
            async fn create_queue(
                &self,
                request: Request<m::CreateQueueRequest>,
            ) -> Result<Response<m::Queue>, Status> {
                let caller = caller_of(&request)?;
                let r = request.into_inner();
                let extra = dead_letter_requirements(
                    &r.name,
                    string_argument(&r.arguments, "x-dead-letter-exchange"),
                    qpid_dlq_enabled(&r.arguments),
                );
                let mut needs = vec![configure(&r.vhost, "queue", &r.name)];
                needs.extend(extra.iter().map(|need| requirement(&r.vhost, need)));
                authorize(&caller, &needs)?;
                drop(needs);
                answer(self.engine.create_queue(r).await)
            }

            /// Configure on the exchange, and what its alternate exchange
            /// needs (as `exchange.declare` over AMQP).
            async fn create_exchange(
                &self,
                request: Request<m::CreateExchangeRequest>,
            ) -> Result<Response<m::Exchange>, Status> {
                let caller = caller_of(&request)?;
                let r = request.into_inner();
                let extra = alternate_exchange_requirements(
                    &r.name,
                    string_argument(&r.arguments, "alternate-exchange"),
                );
                let mut needs = vec![configure(&r.vhost, "exchange", &r.name)];
                needs.extend(extra.iter().map(|need| requirement(&r.vhost, need)));
                authorize(&caller, &needs)?;
                drop(needs);
                answer(self.engine.create_exchange(r).await)
            }

            async fn list_vhosts(
                &self,
                request: Request<m::ListVhostsRequest>,
            ) -> Result<Response<m::ListVhostsResponse>, Status> {
                let caller = caller_of(&request)?;
                authorize(&caller, &[Need::Overview])?;
                let mut list = self.engine.list_vhosts(request.into_inner()).await?;
                list.vhosts.retain(|v| authorize::sees_vhost(&caller, &v.name));
                Ok(Response::new(list))
            }

            async fn list_connections(
                &self,
                request: Request<m::ListConnectionsRequest>,
            ) -> Result<Response<m::ListConnectionsResponse>, Status> {
                let caller = caller_of(&request)?;
                authorize(&caller, &[Need::Overview])?;
                let mut list = self.engine.list_connections(request.into_inner()).await?;
                list.connections
                    .retain(|c| authorize::sees_connections_of(&caller, &c.user));
                Ok(Response::new(list))
            }

            async fn list_channels(
                &self,
                request: Request<m::ListChannelsRequest>,
            ) -> Result<Response<m::ListChannelsResponse>, Status> {
                let caller = caller_of(&request)?;
                authorize(&caller, &[Need::Overview])?;
                let mut list = self.engine.list_channels(request.into_inner()).await?;
                list.channels
                    .retain(|c| authorize::sees_connections_of(&caller, &c.user));
                Ok(Response::new(list))
            }

            /// Consumers of the vhosts the caller sees.
            async fn list_consumers(
                &self,
                request: Request<m::ListConsumersRequest>,
            ) -> Result<Response<m::ListConsumersResponse>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                if request.vhost.is_empty() {
                    authorize(&caller, &[Need::Overview])?;
                } else {
                    authorize(&caller, &[Need::See { vhost: &request.vhost }])?;
                }
                let mut list = self.engine.list_consumers(request).await?;
                list.consumers
                    .retain(|c| authorize::sees_vhost(&caller, &c.vhost));
                Ok(Response::new(list))
            }

            async fn close_connection(
                &self,
                request: Request<m::CloseConnectionRequest>,
            ) -> Result<Response<m::CloseConnectionResponse>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                // An administrator may close any connection, others only
                // their own (as in RabbitMQ).
                if authorize(&caller, &[Need::Administrator]).is_err() {
                    authorize(&caller, &[Need::Overview])?;
                    let connections = self
                        .engine
                        .list_connections(m::ListConnectionsRequest::default())
                        .await?;
                    let own = connections
                        .connections
                        .iter()
                        .any(|c| c.id == request.id && c.user == caller.name());
                    if !own {
                        return Err(Status::permission_denied(format!(
                            "user '{}' may only close its own connections",
                            caller.name()
                        )));
                    }
                }
                let id = request.id;
                let response = self.engine.close_connection(request).await?;
                tracing::info!(connection = id, by = caller.name(), "connection closed by management");
                Ok(Response::new(response))
            }

            async fn get_vhost(
                &self,
                request: Request<m::GetVhostRequest>,
            ) -> Result<Response<m::Vhost>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::See { vhost: &request.name }])?;
                answer(self.engine.get_vhost(request).await)
            }

            async fn get_exchange(
                &self,
                request: Request<m::GetExchangeRequest>,
            ) -> Result<Response<m::Exchange>, Status> {
                let caller = caller_of(&request)?;
                let m::GetExchangeRequest { vhost, name } = request.into_inner();
                authorize(&caller, &[Need::See { vhost: &vhost }])?;
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
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::See { vhost: &request.vhost }])?;
                // One lookup in the engine, not a list of the vhost's queues.
                answer(self.engine.get_queue(request).await)
            }

            async fn get_binding(
                &self,
                request: Request<m::GetBindingRequest>,
            ) -> Result<Response<m::Binding>, Status> {
                let caller = caller_of(&request)?;
                let wanted = request
                    .into_inner()
                    .binding
                    .ok_or_else(|| Status::invalid_argument("binding is required"))?;
                authorize(&caller, &[Need::See { vhost: &wanted.vhost }])?;
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
                let caller = caller_of(&request)?;
                authorize(&caller, &[Need::Overview])?;
                let mut status = self.engine.get_broker_status(request.into_inner()).await?;
                if authorize(&caller, &[Need::Monitoring]).is_err() {
                    self.count_visible_vhosts_only(&caller, &mut status).await?;
                }
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
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::Administrator])?;
                let logged = format!("{request:?}");
                let response = self.engine.set_broker_settings(request).await?;
                tracing::info!(settings = %logged, "broker settings changed by management");
                Ok(Response::new(response))
            }

            async fn update_queue(
                &self,
                request: Request<m::UpdateQueueRequest>,
            ) -> Result<Response<m::UpdateQueueResponse>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::Policy { vhost: &request.vhost }])?;
                let logged = format!("{request:?}");
                let response = self.engine.update_queue(request).await?;
                tracing::info!(settings = %logged, "queue settings changed by management");
                Ok(Response::new(response))
            }

            async fn set_limits(
                &self,
                request: Request<m::SetLimitsRequest>,
            ) -> Result<Response<m::Limits>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::Administrator])?;
                let logged = format!("{request:?}");
                let response = self.engine.set_limits(request).await?;
                tracing::info!(limits = %logged, "limits changed by management");
                Ok(Response::new(response))
            }

            async fn clear_limits(
                &self,
                request: Request<m::ClearLimitsRequest>,
            ) -> Result<Response<m::ClearLimitsResponse>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::Administrator])?;
                let logged = format!("{request:?}");
                let response = self.engine.clear_limits(request).await?;
                tracing::info!(limits = %logged, "limits cleared by management");
                Ok(Response::new(response))
            }

            async fn put_user(
                &self,
                request: Request<m::PutUserRequest>,
            ) -> Result<Response<m::User>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::Administrator])?;
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
                authorize(&caller_of(&request)?, &[Need::Administrator])?;
                let user = request.get_ref().name.clone();
                let response = self.engine.delete_user(request.into_inner()).await?;
                tracing::info!(user, closed_connections = response.closed_connections, "user deleted by management");
                Ok(Response::new(response))
            }

            async fn set_permissions(
                &self,
                request: Request<m::SetPermissionsRequest>,
            ) -> Result<Response<m::Permission>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::Administrator])?;
                let logged = format!("{request:?}");
                let response = self.engine.set_permissions(request).await?;
                tracing::info!(permissions = %logged, "permissions set by management");
                Ok(Response::new(response))
            }

            async fn clear_permissions(
                &self,
                request: Request<m::ClearPermissionsRequest>,
            ) -> Result<Response<m::ClearPermissionsResponse>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::Administrator])?;
                let logged = format!("{request:?}");
                let response = self.engine.clear_permissions(request).await?;
                tracing::info!(permissions = %logged, "permissions cleared by management");
                Ok(Response::new(response))
            }

            async fn set_store_quota(
                &self,
                request: Request<m::SetStoreQuotaRequest>,
            ) -> Result<Response<m::SetStoreQuotaResponse>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::Administrator])?;
                let logged = format!("{request:?}");
                self.storage.set_quota(request).await?;
                tracing::info!(quota = %logged, "store quota changed by management");
                Ok(Response::new(m::SetStoreQuotaResponse {}))
            }

            async fn get_storage_group(
                &self,
                request: Request<m::GetStorageGroupRequest>,
            ) -> Result<Response<m::StorageGroup>, Status> {
                let caller = caller_of(&request)?;
                authorize(&caller, &[Need::Administrator])?;
                let status = self.storage.group_status().await?;
                Ok(Response::new(storage_group(status)))
            }

            async fn add_storage_member(
                &self,
                request: Request<m::AddStorageMemberRequest>,
            ) -> Result<Response<m::StorageGroup>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::Administrator])?;
                if request.id == 0 || request.address.is_empty() {
                    return Err(Status::invalid_argument(
                        "a storage member needs an id above 0 and an address",
                    ));
                }
                let status = self
                    .storage
                    .add_member(request.id, request.address.clone())
                    .await?;
                tracing::info!(id = request.id, address = %request.address, "storage member added by management");
                Ok(Response::new(storage_group(status)))
            }

            async fn remove_storage_member(
                &self,
                request: Request<m::RemoveStorageMemberRequest>,
            ) -> Result<Response<m::StorageGroup>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::Administrator])?;
                let status = self.storage.remove_member(request.id).await?;
                tracing::info!(id = request.id, "storage member removed by management");
                Ok(Response::new(storage_group(status)))
            }

            async fn set_policy(
                &self,
                request: Request<m::SetPolicyRequest>,
            ) -> Result<Response<m::Policy>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                let policy = request
                    .policy
                    .as_ref()
                    .ok_or_else(|| Status::invalid_argument("policy is required"))?;
                authorize(&caller, &[policy_need(&policy.vhost, policy.operator)])?;
                let response = self.engine.set_policy(request).await?;
                tracing::info!(policy = ?response, "policy set by management");
                Ok(Response::new(response))
            }

            async fn clear_policy(
                &self,
                request: Request<m::ClearPolicyRequest>,
            ) -> Result<Response<m::ClearPolicyResponse>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[policy_need(&request.vhost, request.operator)])?;
                let logged = format!("{request:?}");
                let response = self.engine.clear_policy(request).await?;
                tracing::info!(policy = %logged, "policy cleared by management");
                Ok(Response::new(response))
            }

            async fn set_transaction_timeouts(
                &self,
                request: Request<m::SetTransactionTimeoutsRequest>,
            ) -> Result<Response<m::TransactionTimeouts>, Status> {
                let caller = caller_of(&request)?;
                let request = request.into_inner();
                authorize(&caller, &[Need::Administrator])?;
                let response = self.engine.set_transaction_timeouts(request).await?;
                tracing::info!(timeouts = ?response, "transaction timeouts changed by management");
                Ok(Response::new(response))
            }
        }
    };
}

management_impl! {
    create_vhost(CreateVhostRequest) -> Vhost, |r| [Need::Administrator];
    delete_vhost(DeleteVhostRequest) -> DeleteVhostResponse, |r| [Need::Administrator];
    list_exchanges(ListExchangesRequest) -> ListExchangesResponse, |r| [Need::See { vhost: &r.vhost }];
    delete_exchange(DeleteExchangeRequest) -> DeleteExchangeResponse, |r| [configure(&r.vhost, "exchange", &r.name)];
    list_queues(ListQueuesRequest) -> ListQueuesResponse, |r| [Need::See { vhost: &r.vhost }];
    delete_queue(DeleteQueueRequest) -> DeleteQueueResponse, |r| [configure(&r.vhost, "queue", &r.name)];
    purge_queue(PurgeQueueRequest) -> PurgeQueueResponse, |r| [read_queue(&r.vhost, &r.name)];
    peek_messages(PeekMessagesRequest) -> PeekMessagesResponse, |r| [read_queue(&r.vhost, &r.queue)];
    get_messages(GetMessagesRequest) -> PeekMessagesResponse, |r| [read_queue(&r.vhost, &r.queue)];
    move_messages(MoveMessagesRequest) -> MoveMessagesResponse,
        |r| [read_queue(&r.vhost, &r.source), write_queue(&r.vhost, &r.destination)];
    publish_message(PublishMessageRequest) -> PublishMessageResponse,
        |r| [write_exchange(&r.vhost, &r.exchange)];
    create_binding(CreateBindingRequest) -> Binding, |r| bind(r.binding.as_ref())?;
    list_bindings(ListBindingsRequest) -> ListBindingsResponse, |r| [Need::See { vhost: &r.vhost }];
    delete_binding(DeleteBindingRequest) -> DeleteBindingResponse, |r| bind(r.binding.as_ref())?;
    list_limits(ListLimitsRequest) -> ListLimitsResponse, |r| [Need::Monitoring];
    list_policies(ListPoliciesRequest) -> ListPoliciesResponse, |r| policy_list_needs(&r.vhost, r.operator);
    list_users(ListUsersRequest) -> ListUsersResponse, |r| [Need::Administrator];
    list_permissions(ListPermissionsRequest) -> ListPermissionsResponse, |r| [Need::Administrator];
    export_definitions(ExportDefinitionsRequest) -> Definitions, |r| [Need::Administrator];
    import_definitions(ImportDefinitionsRequest) -> ImportDefinitionsResponse, |r| [Need::Administrator];
}

/// Policies are the policymaker's (in vhosts it has permissions in),
/// operator policies the administrator's, as in RabbitMQ.
fn policy_need(vhost: &str, operator: bool) -> Need<'_> {
    if operator {
        Need::Administrator
    } else {
        Need::Policy { vhost }
    }
}

/// Reading policies needs `policymaker` (and sight of the vhost), reading
/// operator policies `administrator`, as RabbitMQ's `/api/policies` and
/// `/api/operator-policies`.
fn policy_list_needs(vhost: &str, operator: bool) -> [Need<'_>; 2] {
    if operator {
        return [Need::Administrator, Need::Administrator];
    }
    [Need::Policymaker, Need::See { vhost }]
}

/// The storage group as management shows it.
fn storage_group(status: spillway_proto::storage::GroupStatus) -> m::StorageGroup {
    m::StorageGroup {
        leader: status.leader,
        term: status.term,
        committed_index: status.committed_index,
        members: status
            .members
            .into_iter()
            .map(|member| m::StorageMember {
                id: member.id,
                address: member.address,
                role: member.role,
                applied_index: member.applied_index,
                lag: member.lag,
            })
            .collect(),
    }
}
