//! The engine's side of the management API: definitions (vhosts, exchanges,
//! queues, bindings), inspection (queues, connections, channels, status),
//! purge, peek, move, closing a connection, the runtime settings, and the
//! vhost and user limits (whose rules live in `limits.rs`).
//!
//! Declarations, deletions, bindings and purges go through the broker's own
//! session operations on a short-lived internal session (user `management`)
//! opened and closed under one lock, so validation and persistence live in
//! one place (`broker/`). Peek and move are the only code here that reads
//! or moves messages themselves; they are kept together at the end of the
//! file (section "messages").
//!
//! Why one file of ~1,280 lines: it is one `impl EngineAdminApi` of 24 calls
//! plus its gRPC adapter, off the message path, and each call is a short
//! sequence of broker operations; splitting it by call family (definitions,
//! inspection, messages, settings) is the next step when it grows.
//!
//! [`EngineAdminService`] serves the same calls over gRPC (`EngineAdmin` in
//! `proto/spillway/engine/v1/admin.proto`).
//!
//! What one queue or one vhost is asked about costs one lookup under the
//! broker lock. What looks at every queue of a vhost (lists, consumers,
//! message totals, the broker's status) walks them a chunk at a time,
//! letting the lock go between chunks (`walk.rs`): such answers are not a
//! snapshot, as RabbitMQ's are not.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use amq_protocol_types::{AMQPValue, FieldTable, ShortString};
use async_trait::async_trait;
use bytes::Bytes;
use spillway_amqp as amqp;
use spillway_proto::cluster::BATCH_BYTES;
use spillway_proto::engine::engine_admin_server::{EngineAdmin, EngineAdminServer};
use spillway_proto::engine::{self as pb, session_event::Event, AmqpError, ErrorKind};
use spillway_proto::management::{self as m, argument_value};
use spillway_proto::storage::{self as store, write_op, WriteOp};
use spillway_proto::{EngineAdminApi, ServiceError};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use crate::broker::{event, policy_view, Broker, GetOutcome, OpResult, RUNTIME_ARGUMENTS};
use crate::engine::Engine;
use crate::model::{Destination, QueuedMessage, SessionId};
use crate::persistence::{await_written, store_op};
use crate::policy::Policy;
use crate::queue::Queue;
use crate::routing::as_integer;
use crate::vhost::VHost;
use crate::walk::walk_queues;

/// The user name management's internal sessions run as. They are opened and
/// closed under one broker lock, so no listing ever sees them.
const MANAGEMENT_USER: &str = "management";
/// The channel management's internal sessions use.
pub(crate) const CHANNEL: u32 = 1;
/// Peek's default count.
const DEFAULT_PEEK: u32 = 10;
/// Peek's largest count.
const MAX_PEEK: u32 = 10_000;

// ------------------------------------------------------------ error mapping

/// An AMQP error from a broker operation as a gRPC-mappable service error,
/// by what failed (its kind), never by its text.
pub(crate) fn service_error(error: AmqpError) -> ServiceError {
    let kind = error.effective_kind();
    let text = error.text;
    match kind {
        ErrorKind::NotFound => ServiceError::NotFound(text),
        ErrorKind::AccessRefused => ServiceError::PermissionDenied(text),
        ErrorKind::InvalidArgument => ServiceError::InvalidArgument(text),
        ErrorKind::FailedPrecondition => ServiceError::FailedPrecondition(text),
        ErrorKind::Internal | ErrorKind::Unspecified => ServiceError::Internal(text),
    }
}

fn not_found(what: &str, name: &str, vhost: &str) -> ServiceError {
    ServiceError::NotFound(format!("no {what} '{name}' in vhost '{vhost}'"))
}

fn vhost<'a>(broker: &'a Broker, name: &str) -> Result<&'a VHost, ServiceError> {
    broker
        .vhosts
        .get(name)
        .ok_or_else(|| ServiceError::NotFound(format!("vhost '{name}' not found")))
}

/// An exclusive queue belongs to the connection that declared it:
/// management may not read or move its messages (RabbitMQ answers 405
/// RESOURCE_LOCKED).
fn not_exclusive(queue: &Queue, vhost: &str) -> Result<(), ServiceError> {
    if queue.exclusive_owner.is_none() {
        return Ok(());
    }
    Err(ServiceError::FailedPrecondition(format!(
        "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue '{}' in vhost '{vhost}'",
        queue.name
    )))
}

pub(crate) fn check_name(what: &str, name: &str) -> Result<(), ServiceError> {
    if name.is_empty() || name.len() > 255 {
        return Err(ServiceError::InvalidArgument(format!(
            "{what} name must be 1 to 255 bytes"
        )));
    }
    Ok(())
}

// ------------------------------------------------------------ arguments

/// Management's argument map as the AMQP field table the broker checks.
pub(crate) fn encode_arguments(
    arguments: &HashMap<String, m::ArgumentValue>,
) -> Result<Bytes, ServiceError> {
    if arguments.is_empty() {
        return Ok(Bytes::new());
    }
    let mut table = FieldTable::default();
    let mut keys: Vec<&String> = arguments.keys().collect();
    keys.sort();
    for key in keys {
        if key.len() > 255 {
            return Err(ServiceError::InvalidArgument(format!(
                "argument name '{key}' is longer than 255 bytes"
            )));
        }
        let value = match arguments.get(key).and_then(|v| v.value.as_ref()) {
            Some(argument_value::Value::StringValue(s)) => AMQPValue::LongString(s.as_str().into()),
            Some(argument_value::Value::IntValue(i)) => AMQPValue::LongLongInt(*i),
            Some(argument_value::Value::BoolValue(b)) => AMQPValue::Boolean(*b),
            Some(argument_value::Value::DoubleValue(d)) => AMQPValue::Double(*d),
            Some(argument_value::Value::Text(_)) | None => {
                return Err(ServiceError::InvalidArgument(format!(
                    "argument '{key}' needs a string, integer, boolean or double value"
                )))
            }
        };
        table.insert(ShortString::from(key.as_str()), value);
    }
    Ok(amqp::encode_table(&table))
}

fn argument_value(value: &AMQPValue) -> m::ArgumentValue {
    use argument_value::Value;
    let value = match value {
        AMQPValue::LongString(s) => {
            Value::StringValue(String::from_utf8_lossy(s.as_bytes()).into())
        }
        AMQPValue::ShortString(s) => Value::StringValue(s.as_str().to_string()),
        AMQPValue::Boolean(b) => Value::BoolValue(*b),
        AMQPValue::Float(f) => Value::DoubleValue(f64::from(*f)),
        AMQPValue::Double(d) => Value::DoubleValue(*d),
        other => match as_integer(other).and_then(|i| i64::try_from(i).ok()) {
            Some(i) => Value::IntValue(i),
            None => Value::Text(format!("{other:?}")),
        },
    };
    m::ArgumentValue { value: Some(value) }
}

/// An AMQP-encoded table as management shows it (client properties).
fn decoded_map(bytes: &[u8]) -> HashMap<String, m::ArgumentValue> {
    amqp::decode_table(bytes)
        .map(|table| argument_map(&table))
        .unwrap_or_default()
}

pub(crate) fn argument_map(table: &FieldTable) -> HashMap<String, m::ArgumentValue> {
    table
        .inner()
        .iter()
        .map(|(key, value)| (key.as_str().to_string(), argument_value(value)))
        .collect()
}

// ------------------------------------------------------------ views

fn exchange_view(
    vhost: &str,
    exchange: &crate::exchange::Exchange,
    delayed: &crate::broker::delayed::DelayedState,
) -> m::Exchange {
    m::Exchange {
        vhost: vhost.to_string(),
        name: exchange.name.clone(),
        kind: exchange.kind_name().to_string(),
        delayed_messages: delayed.count(vhost, &exchange.name),
        durable: exchange.durable,
        auto_delete: exchange.auto_delete,
        internal: exchange.internal,
        arguments: argument_map(&exchange.arguments),
        builtin: exchange.is_builtin(),
        policy: exchange.policy.clone().unwrap_or_default(),
    }
}

/// One queue as management shows it, with `unacked` deliveries of it
/// counted by the caller.
fn queue_view(vhost: &str, queue: &Queue, unacked: u64) -> m::Queue {
    #[cfg(test)]
    crate::walk::hooks::count_queue_view();
    m::Queue {
        vhost: vhost.to_string(),
        name: queue.name.clone(),
        durable: queue.durable,
        auto_delete: queue.auto_delete,
        exclusive: queue.exclusive_owner.is_some(),
        arguments: argument_map(&queue.arguments),
        policy: queue.policy.clone().unwrap_or_default(),
        operator_policy: queue.operator_policy.clone().unwrap_or_default(),
        effective_arguments: argument_map(
            queue
                .effective_arguments
                .as_ref()
                .unwrap_or(&queue.arguments),
        ),
        status: Some(m::QueueStatus {
            messages: queue.messages.len() as u64,
            unacked,
            consumers: queue.consumers.len() as u64,
            bytes: queue.ready_bytes,
            resident_bytes: queue.resident_bytes,
            spilled_messages: queue.spilled_count,
            spilled_bytes: queue.spilled_bytes,
            overfull: queue.overfull,
            blocked_channels: queue.blocked_channels.len() as u32,
            recovering: queue.recovering,
            arrived_total: queue.arrived_total,
            delivered_total: queue.delivered_total,
            active_consumer: queue
                .consumers
                .first()
                .filter(|_| queue.single_active_consumer)
                .map(|c| c.tag.clone())
                .unwrap_or_default(),
        }),
    }
}

/// The bindings of `exchange` (in `vhost_name`) to `destination` (to any
/// when empty), as management shows them. Only those asked for are built.
fn binding_views(
    vhost_name: &str,
    exchange: &crate::exchange::Exchange,
    destination: &str,
    into: &mut Vec<m::Binding>,
) {
    let wanted = exchange
        .bindings
        .iter()
        .filter(|binding| destination.is_empty() || binding.destination.name() == destination);
    into.extend(wanted.map(|binding| m::Binding {
        vhost: vhost_name.to_string(),
        source: exchange.name.clone(),
        destination: binding.destination.name().to_string(),
        destination_is_exchange: matches!(binding.destination, Destination::Exchange(_)),
        routing_key: binding.routing_key.clone(),
        arguments: argument_map(&binding.arguments),
    }));
}

fn binding_request(binding: Option<m::Binding>) -> Result<(m::Binding, Bytes), ServiceError> {
    let binding =
        binding.ok_or_else(|| ServiceError::InvalidArgument("binding is required".into()))?;
    check_name("source exchange", &binding.source)?;
    check_name("destination", &binding.destination)?;
    let arguments = encode_arguments(&binding.arguments)?;
    Ok((binding, arguments))
}

// ------------------------------------------------------------ the engine

impl Engine {
    /// Runs `op` on a fresh internal session of `vhost` with channel 1 open,
    /// under the broker lock; the session is closed before the lock goes.
    fn with_session<T>(
        &self,
        vhost_name: &str,
        op: impl FnOnce(&mut Broker, SessionId) -> Result<T, ServiceError>,
    ) -> Result<T, ServiceError> {
        let mut broker = self.shared.broker.lock();
        let id = self.open_internal_session(&mut broker, vhost_name)?;
        let result = op(&mut broker, id);
        broker.close_session(id);
        result
    }

    /// Opens an internal session of `vhost` with channel 1 open, for
    /// management's own declarations and gets; the caller closes it.
    pub(crate) fn open_internal_session(
        &self,
        broker: &mut Broker,
        vhost_name: &str,
    ) -> Result<SessionId, ServiceError> {
        vhost(broker, vhost_name)?;
        let id = self.shared.next_session.fetch_add(1, Ordering::Relaxed);
        // Events for the internal session (none expected) are dropped.
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        let open = pb::OpenSession {
            request_id: 0,
            vhost: vhost_name.to_string(),
            user: MANAGEMENT_USER.to_string(),
            client_address: MANAGEMENT_USER.to_string(),
            client_properties: Bytes::new(),
        };
        broker
            .open_session(id, &open, events)
            .map_err(service_error)?;
        if let Err(error) = broker.open_channel(id, CHANNEL, None) {
            broker.close_session(id);
            return Err(service_error(error));
        }
        Ok(id)
    }

    /// One queue: one lookup, and its unacknowledged deliveries counted on
    /// the vhost's channels. No other queue is looked at.
    fn queue_info(&self, vhost_name: &str, name: &str) -> Result<m::Queue, ServiceError> {
        let broker = self.shared.broker.lock();
        let queue = vhost(&broker, vhost_name)?
            .queues
            .get(name)
            .ok_or_else(|| not_found("queue", name, vhost_name))?;
        let unacked = unacked_by_queue(&broker, vhost_name, Some(name))
            .get(name)
            .copied()
            .unwrap_or_default();
        Ok(queue_view(vhost_name, queue, unacked))
    }

    /// Closes every client connection of `vhost` with `reason`.
    fn close_connections(
        broker: &Broker,
        vhost: Option<&str>,
        id: Option<SessionId>,
        reason: &str,
    ) -> usize {
        let mut closed = 0;
        for (session_id, session) in &broker.sessions {
            let matches =
                vhost.is_none_or(|v| session.vhost == v) && id.is_none_or(|i| i == *session_id);
            if matches {
                let _ = session
                    .events
                    .send(event(Event::ConnectionClose(pb::ConnectionClose {
                        reason: reason.to_string(),
                        reply_code: 0,
                    })));
                closed += 1;
            }
        }
        closed
    }
}

/// Unacknowledged deliveries per queue of `vhost_name` (of the queue `only`
/// when given), counted on the vhost's channels a run at a time: a pass
/// over deliveries, not over queues.
fn unacked_by_queue(broker: &Broker, vhost_name: &str, only: Option<&str>) -> HashMap<String, u64> {
    let mut counts: HashMap<String, u64> = HashMap::new();
    for session in broker.sessions.values().filter(|s| s.vhost == vhost_name) {
        for channel in session.channels.values() {
            channel.unacked_runs(|queue, count| {
                if only.is_some_and(|only| only != queue) {
                    return;
                }
                match counts.get_mut(queue) {
                    Some(total) => *total += count,
                    None => {
                        counts.insert(queue.to_string(), count);
                    }
                }
            });
        }
    }
    counts
}

/// Unacknowledged deliveries per vhost, of queues that still exist (a
/// deleted queue's deliveries stay on their channels until settled, and
/// no queue list counts them).
fn unacked_by_vhost(broker: &Broker) -> HashMap<String, u64> {
    let mut counts: HashMap<String, u64> = HashMap::new();
    for session in broker.sessions.values() {
        let Some(vhost) = broker.vhosts.get(&session.vhost) else {
            continue;
        };
        let mut held = 0u64;
        for channel in session.channels.values() {
            channel.unacked_runs(|queue, count| {
                if vhost.queues.contains_key(queue) {
                    held += count;
                }
            });
        }
        *counts.entry(session.vhost.clone()).or_default() += held;
    }
    counts
}

/// The broker status's figures summed over queues.
#[derive(Default)]
struct QueueTotals {
    queues: u32,
    messages: u64,
    bytes: u64,
    consumers: u32,
}

impl QueueTotals {
    fn add(&mut self, queue: &Queue) {
        self.queues += 1;
        self.messages += queue.messages.len() as u64;
        self.bytes += queue.ready_bytes;
        self.consumers += queue.consumers.len() as u32;
    }
}

fn ok<T>(result: OpResult<T>) -> Result<T, ServiceError> {
    result.map_err(service_error)
}

#[async_trait]
impl EngineAdminApi for Engine {
    async fn create_vhost(&self, request: m::CreateVhostRequest) -> Result<m::Vhost, ServiceError> {
        check_name("vhost", &request.name)?;
        let (done, written) = oneshot::channel();
        let view = {
            let mut broker = self.shared.broker.lock();
            if broker.vhosts.contains_key(&request.name) {
                return Err(ServiceError::AlreadyExists(format!(
                    "vhost '{}' already exists",
                    request.name
                )));
            }
            broker
                .vhosts
                .insert(request.name.clone(), VHost::new(&request.name));
            // On disk before the caller hears of it: the vhost survives a
            // restart.
            self.shared.writer.submit_synced(
                vec![store_op(write_op::Op::PutVhost(store::VhostDefinition {
                    name: request.name.clone(),
                }))],
                Some(done),
            );
            vhost_view(&broker, vhost(&broker, &request.name)?)
        };
        await_written(written, "the vhost").await?;
        tracing::info!(vhost = %request.name, "vhost created by management");
        Ok(view)
    }

    async fn list_vhosts(
        &self,
        _request: m::ListVhostsRequest,
    ) -> Result<m::ListVhostsResponse, ServiceError> {
        let broker = self.shared.broker.lock();
        let mut vhosts: Vec<m::Vhost> = broker
            .vhosts
            .values()
            .map(|v| vhost_view(&broker, v))
            .collect();
        vhosts.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(m::ListVhostsResponse { vhosts })
    }

    async fn delete_vhost(
        &self,
        request: m::DeleteVhostRequest,
    ) -> Result<m::DeleteVhostResponse, ServiceError> {
        if request.name == "/" {
            return Err(ServiceError::FailedPrecondition(
                "the default vhost '/' cannot be deleted".into(),
            ));
        }
        let name = request.name.clone();
        self.with_session(&request.name, |broker, session| {
            let reason = format!("vhost '{name}' deleted");
            Engine::close_connections(broker, Some(&name), None, &reason);
            let Some(vhost) = broker.vhosts.get(&name) else {
                return Ok(());
            };
            let queues: Vec<String> = vhost.queues.keys().cloned().collect();
            let exchanges: Vec<String> = vhost
                .exchanges
                .values()
                .filter(|x| !x.is_builtin())
                .map(|x| x.name.clone())
                .collect();
            for queue in queues {
                // Exclusive queues belong to connections being closed.
                let _ = broker.delete_queue(
                    session,
                    &pb::QueueDelete {
                        channel: CHANNEL,
                        queue,
                        ..Default::default()
                    },
                );
            }
            for exchange in exchanges {
                ok(broker.delete_exchange(
                    session,
                    &pb::ExchangeDelete {
                        channel: CHANNEL,
                        exchange,
                        ..Default::default()
                    },
                ))?;
            }
            Ok(())
        })?;
        let (done, written) = oneshot::channel();
        {
            let mut broker = self.shared.broker.lock();
            // Its policies go with it.
            let policies: Vec<WriteOp> = broker
                .vhosts
                .get(&request.name)
                .map(|vhost| {
                    vhost
                        .policies
                        .iter()
                        .chain(vhost.operator_policies.iter())
                        .map(|policy| {
                            store_op(write_op::Op::DeletePolicy(policy.definition(&request.name)))
                        })
                        .collect()
                })
                .unwrap_or_default();
            broker.vhosts.remove(&request.name);
            broker.limits.forget_vhost(&request.name);
            broker.delayed.forget(&request.name, None);
            let mut ops = vec![store_op(write_op::Op::DeleteVhost(
                store::VhostDefinition {
                    name: request.name.clone(),
                },
            ))];
            ops.extend(policies);
            // Nobody keeps permissions in a vhost that is gone.
            ops.extend(crate::access_admin::forget_vhost(
                &self.shared,
                &request.name,
            ));
            self.shared.writer.submit_synced(ops, Some(done));
        }
        await_written(written, "the vhost's deletion").await?;
        tracing::info!(vhost = %request.name, "vhost deleted by management");
        Ok(m::DeleteVhostResponse {})
    }

    async fn create_exchange(
        &self,
        request: m::CreateExchangeRequest,
    ) -> Result<m::Exchange, ServiceError> {
        check_name("exchange", &request.name)?;
        let arguments = encode_arguments(&request.arguments)?;
        self.with_session(&request.vhost, |broker, session| {
            ok(broker.declare_exchange(
                session,
                &pb::ExchangeDeclare {
                    request_id: 0,
                    channel: CHANNEL,
                    exchange: request.name.clone(),
                    kind: request.kind.clone(),
                    passive: false,
                    durable: request.durable,
                    auto_delete: request.auto_delete,
                    internal: request.internal,
                    arguments,
                },
            ))?;
            let vhost = vhost(broker, &request.vhost)?;
            let exchange = vhost
                .exchanges
                .get(&request.name)
                .ok_or_else(|| not_found("exchange", &request.name, &request.vhost))?;
            Ok(exchange_view(&request.vhost, exchange, &broker.delayed))
        })
    }

    async fn list_exchanges(
        &self,
        request: m::ListExchangesRequest,
    ) -> Result<m::ListExchangesResponse, ServiceError> {
        let broker = self.shared.broker.lock();
        let vhost = vhost(&broker, &request.vhost)?;
        let mut exchanges: Vec<m::Exchange> = vhost
            .exchanges
            .values()
            .map(|x| exchange_view(&request.vhost, x, &broker.delayed))
            .collect();
        exchanges.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(m::ListExchangesResponse { exchanges })
    }

    async fn delete_exchange(
        &self,
        request: m::DeleteExchangeRequest,
    ) -> Result<m::DeleteExchangeResponse, ServiceError> {
        self.with_session(&request.vhost, |broker, session| {
            if !vhost(broker, &request.vhost)?
                .exchanges
                .contains_key(&request.name)
            {
                return Err(not_found("exchange", &request.name, &request.vhost));
            }
            ok(broker.delete_exchange(
                session,
                &pb::ExchangeDelete {
                    request_id: 0,
                    channel: CHANNEL,
                    exchange: request.name.clone(),
                    if_unused: request.if_unused,
                },
            ))
        })?;
        Ok(m::DeleteExchangeResponse {})
    }

    async fn create_queue(&self, request: m::CreateQueueRequest) -> Result<m::Queue, ServiceError> {
        check_name("queue", &request.name)?;
        let arguments = encode_arguments(&request.arguments)?;
        self.with_session(&request.vhost, |broker, session| {
            ok(broker.declare_queue(
                session,
                &pb::QueueDeclare {
                    request_id: 0,
                    channel: CHANNEL,
                    queue: request.name.clone(),
                    passive: false,
                    durable: request.durable,
                    exclusive: false,
                    auto_delete: request.auto_delete,
                    arguments,
                },
            ))
        })?;
        self.queue_info(&request.vhost, &request.name)
    }

    /// Every queue of the vhost, in name order, built a chunk at a time
    /// ([`walk_queues`]).
    async fn list_queues(
        &self,
        request: m::ListQueuesRequest,
    ) -> Result<m::ListQueuesResponse, ServiceError> {
        let unacked = {
            let broker = self.shared.broker.lock();
            vhost(&broker, &request.vhost)?;
            unacked_by_queue(&broker, &request.vhost, None)
        };
        let mut queues = Vec::new();
        walk_queues(&self.shared, &request.vhost, |_, queue| {
            let unacked = unacked.get(queue.name.as_str()).copied();
            queues.push(queue_view(
                &request.vhost,
                queue,
                unacked.unwrap_or_default(),
            ));
        })
        .await?;
        Ok(m::ListQueuesResponse { queues })
    }

    async fn get_queue(&self, request: m::GetQueueRequest) -> Result<m::Queue, ServiceError> {
        self.queue_info(&request.vhost, &request.name)
    }

    async fn get_vhost(&self, request: m::GetVhostRequest) -> Result<m::Vhost, ServiceError> {
        let broker = self.shared.broker.lock();
        Ok(vhost_view(&broker, vhost(&broker, &request.name)?))
    }

    /// Ready messages summed over each vhost's queues a chunk at a time;
    /// unacknowledged ones counted on its channels.
    async fn vhost_message_totals(
        &self,
        request: pb::VhostMessageTotalsRequest,
    ) -> Result<pb::VhostMessageTotalsResponse, ServiceError> {
        let (names, mut unacked) = {
            let broker = self.shared.broker.lock();
            let names: Vec<String> = if request.vhost.is_empty() {
                broker.vhosts.keys().cloned().collect()
            } else {
                vec![vhost(&broker, &request.vhost)?.name.clone()]
            };
            (names, unacked_by_vhost(&broker))
        };
        let mut vhosts = Vec::with_capacity(names.len());
        for name in names {
            let mut ready = 0u64;
            let walked = walk_queues(&self.shared, &name, |_, queue| {
                ready += queue.messages.len() as u64;
            })
            .await;
            // Deleted meanwhile: not in the answer, unless it was the one asked.
            if let Err(error) = walked {
                if request.vhost.is_empty() {
                    continue;
                }
                return Err(error);
            }
            vhosts.push(pb::VhostMessageTotals {
                messages_unacked: unacked.remove(&name).unwrap_or_default(),
                vhost: name,
                messages_ready: ready,
            });
        }
        vhosts.sort_by(|a, b| a.vhost.cmp(&b.vhost));
        Ok(pb::VhostMessageTotalsResponse { vhosts })
    }

    async fn delete_queue(
        &self,
        request: m::DeleteQueueRequest,
    ) -> Result<m::DeleteQueueResponse, ServiceError> {
        let deleted = self.with_session(&request.vhost, |broker, session| {
            if !vhost(broker, &request.vhost)?
                .queues
                .contains_key(&request.name)
            {
                return Err(not_found("queue", &request.name, &request.vhost));
            }
            ok(broker.delete_queue(
                session,
                &pb::QueueDelete {
                    request_id: 0,
                    channel: CHANNEL,
                    queue: request.name.clone(),
                    if_unused: request.if_unused,
                    if_empty: request.if_empty,
                },
            ))
        })?;
        Ok(m::DeleteQueueResponse {
            messages_deleted: u64::from(deleted),
        })
    }

    async fn purge_queue(
        &self,
        request: m::PurgeQueueRequest,
    ) -> Result<m::PurgeQueueResponse, ServiceError> {
        let purged = self.with_session(&request.vhost, |broker, session| {
            ok(broker.purge_queue(
                session,
                &pb::QueuePurge {
                    request_id: 0,
                    channel: CHANNEL,
                    queue: request.name.clone(),
                },
            ))
        })?;
        tracing::info!(vhost = %request.vhost, queue = %request.name, purged, "queue purged by management");
        Ok(m::PurgeQueueResponse {
            messages_purged: u64::from(purged),
        })
    }

    async fn peek_messages(
        &self,
        request: m::PeekMessagesRequest,
    ) -> Result<m::PeekMessagesResponse, ServiceError> {
        peek_messages(self, request).await
    }

    async fn get_messages(
        &self,
        request: m::GetMessagesRequest,
    ) -> Result<m::PeekMessagesResponse, ServiceError> {
        get_messages(self, request).await
    }

    async fn move_messages(
        &self,
        request: m::MoveMessagesRequest,
    ) -> Result<m::MoveMessagesResponse, ServiceError> {
        move_messages(self, request).await
    }

    async fn publish_message(
        &self,
        request: m::PublishMessageRequest,
    ) -> Result<m::PublishMessageResponse, ServiceError> {
        publish_message(self, request).await
    }

    async fn create_binding(
        &self,
        request: m::CreateBindingRequest,
    ) -> Result<m::Binding, ServiceError> {
        let (binding, arguments) = binding_request(request.binding)?;
        self.with_session(&binding.vhost, |broker, session| {
            let result = if binding.destination_is_exchange {
                broker.bind_exchange(
                    session,
                    &pb::ExchangeBind {
                        request_id: 0,
                        channel: CHANNEL,
                        destination: binding.destination.clone(),
                        source: binding.source.clone(),
                        routing_key: binding.routing_key.clone(),
                        arguments,
                    },
                )
            } else {
                broker.bind_queue(
                    session,
                    &pb::QueueBind {
                        request_id: 0,
                        channel: CHANNEL,
                        queue: binding.destination.clone(),
                        exchange: binding.source.clone(),
                        routing_key: binding.routing_key.clone(),
                        arguments,
                    },
                )
            };
            ok(result)
        })?;
        Ok(binding)
    }

    /// The vhost's bindings (of one source, to one destination, when
    /// asked), an exchange at a time: the lock is held for one exchange's
    /// bindings, then let go, so a vhost with 100,000 bindings spread over
    /// its exchanges never holds up publishers for all of them.
    async fn list_bindings(
        &self,
        request: m::ListBindingsRequest,
    ) -> Result<m::ListBindingsResponse, ServiceError> {
        let sources: Vec<String> = {
            let broker = self.shared.broker.lock();
            let vhost = vhost(&broker, &request.vhost)?;
            if request.source.is_empty() {
                let mut names: Vec<String> = vhost.exchanges.keys().cloned().collect();
                names.sort();
                names
            } else {
                vec![request.source.clone()]
            }
        };
        let mut bindings = Vec::new();
        for source in &sources {
            {
                let broker = self.shared.broker.lock();
                // A vhost deleted meanwhile has no bindings left.
                let Some(vhost) = broker.vhosts.get(&request.vhost) else {
                    break;
                };
                if let Some(exchange) = vhost.exchanges.get(source) {
                    let before = bindings.len();
                    binding_views(
                        &request.vhost,
                        exchange,
                        &request.destination,
                        &mut bindings,
                    );
                    bindings[before..].sort_by(|a, b| {
                        (&a.destination, &a.routing_key).cmp(&(&b.destination, &b.routing_key))
                    });
                }
                parking_lot::MutexGuard::unlock_fair(broker);
            }
            if sources.len() > 1 {
                tokio::task::yield_now().await;
            }
        }
        Ok(m::ListBindingsResponse { bindings })
    }

    async fn delete_binding(
        &self,
        request: m::DeleteBindingRequest,
    ) -> Result<m::DeleteBindingResponse, ServiceError> {
        let (binding, arguments) = binding_request(request.binding)?;
        let table = amqp::decode_table(&arguments).map_err(|error| service_error(error.into()))?;
        self.with_session(&binding.vhost, |broker, session| {
            let destination = if binding.destination_is_exchange {
                Destination::Exchange(binding.destination.clone())
            } else {
                Destination::Queue(binding.destination.clone())
            };
            let exists = vhost(broker, &binding.vhost)?
                .exchanges
                .get(&binding.source)
                .is_some_and(|x| {
                    x.bindings.iter().any(|b| {
                        b.destination == destination
                            && b.routing_key == binding.routing_key
                            && b.arguments == table
                    })
                });
            if !exists {
                return Err(ServiceError::NotFound(format!(
                    "no binding from '{}' to '{}' with key '{}' in vhost '{}'",
                    binding.source, binding.destination, binding.routing_key, binding.vhost
                )));
            }
            let result = if binding.destination_is_exchange {
                broker.unbind_exchange(
                    session,
                    &pb::ExchangeBind {
                        request_id: 0,
                        channel: CHANNEL,
                        destination: binding.destination.clone(),
                        source: binding.source.clone(),
                        routing_key: binding.routing_key.clone(),
                        arguments,
                    },
                )
            } else {
                broker.unbind_queue(
                    session,
                    &pb::QueueBind {
                        request_id: 0,
                        channel: CHANNEL,
                        queue: binding.destination.clone(),
                        exchange: binding.source.clone(),
                        routing_key: binding.routing_key.clone(),
                        arguments,
                    },
                )
            };
            ok(result)
        })?;
        Ok(m::DeleteBindingResponse {})
    }

    async fn get_broker_status(
        &self,
        _request: m::GetBrokerStatusRequest,
    ) -> Result<m::BrokerStatus, ServiceError> {
        // Every queue's figures, a chunk at a time; then the rest at once.
        let names: Vec<String> = self.shared.broker.lock().vhosts.keys().cloned().collect();
        let mut totals = QueueTotals::default();
        for name in &names {
            // A vhost deleted meanwhile adds nothing.
            let _ = walk_queues(&self.shared, name, |_, queue| totals.add(queue)).await;
        }
        let broker = self.shared.broker.lock();
        let connections = broker.sessions.len() as u32;
        let channels: usize = broker.sessions.values().map(|s| s.channels.len()).sum();
        let unacked: u64 = unacked_by_vhost(&broker).values().sum();
        let flow = broker.flow_status();
        Ok(m::BrokerStatus {
            flow_to_disk_threshold: Some(flow.threshold_bytes),
            flow_to_disk_active: Some(flow.active),
            resident_message_bytes: Some(flow.resident_bytes),
            spilled_messages: flow.spilled_messages,
            spilled_bytes: flow.spilled_bytes,
            store_overfull: broker.alarms.store_overfull(),
            blocked_channels: broker.blocked_channels().len() as u32,
            version: env!("CARGO_PKG_VERSION").to_string(),
            vhosts: broker.vhosts.len() as u32,
            queues: totals.queues,
            messages_ready: totals.messages,
            messages_unacked: unacked,
            message_bytes: totals.bytes,
            consumers: totals.consumers,
            connections,
            channels: channels as u32,
            recovery: Some(crate::broker::recovery::status(&broker.recovery)),
            ..Default::default()
        })
    }

    async fn list_connections(
        &self,
        request: m::ListConnectionsRequest,
    ) -> Result<m::ListConnectionsResponse, ServiceError> {
        let broker = self.shared.broker.lock();
        let mut connections: Vec<m::Connection> = broker
            .sessions
            .iter()
            .filter(|(_, s)| request.vhost.is_empty() || s.vhost == request.vhost)
            .map(|(id, s)| m::Connection {
                id: *id,
                client_address: s.client_address.clone(),
                user: s.user.clone(),
                vhost: s.vhost.clone(),
                client_properties: decoded_map(&s.client_properties),
                channels: s.channels.len() as u32,
                messages_published: s.published,
                messages_delivered: s.delivered,
            })
            .collect();
        connections.sort_by_key(|c| c.id);
        Ok(m::ListConnectionsResponse { connections })
    }

    async fn list_channels(
        &self,
        request: m::ListChannelsRequest,
    ) -> Result<m::ListChannelsResponse, ServiceError> {
        let broker = self.shared.broker.lock();
        let blocked: HashMap<(u64, u32), crate::broker::producer_flow::BlockedChannel> = broker
            .blocked_channels()
            .into_iter()
            .map(|b| ((b.session, b.channel), b))
            .collect();
        let blocked = &blocked;
        let mut channels: Vec<m::Channel> = broker
            .sessions
            .iter()
            .filter(|(_, s)| request.vhost.is_empty() || s.vhost == request.vhost)
            .filter(|(id, _)| request.connection_id == 0 || **id == request.connection_id)
            .flat_map(|(id, s)| {
                s.channels.iter().map(move |(number, channel)| {
                    let held = blocked.get(&(*id, *number));
                    m::Channel {
                        connection_id: *id,
                        number: *number,
                        client_address: s.client_address.clone(),
                        user: s.user.clone(),
                        vhost: s.vhost.clone(),
                        consumers: channel.consumers.len() as u32,
                        unacked: channel.unacked.len() as u64,
                        prefetch_count: channel.consumer_prefetch.max(channel.channel_prefetch),
                        confirm: channel.confirm,
                        blocked: held.is_some(),
                        blocked_reason: held.map(blocked_reason).unwrap_or_default(),
                        blocked_ms: held.map_or(0, |b| b.blocked_for.as_millis() as u64),
                        amqp1_link: channel.amqp1_link.clone(),
                    }
                })
            })
            .collect();
        channels.sort_by_key(|c| (c.connection_id, c.number));
        Ok(m::ListChannelsResponse { channels })
    }

    async fn list_consumers(
        &self,
        request: m::ListConsumersRequest,
    ) -> Result<m::ListConsumersResponse, ServiceError> {
        let names: Vec<String> = {
            let broker = self.shared.broker.lock();
            if request.vhost.is_empty() {
                broker.vhosts.keys().cloned().collect()
            } else {
                vec![vhost(&broker, &request.vhost)?.name.clone()]
            }
        };
        let mut consumers = Vec::new();
        for vhost_name in &names {
            // Every queue is looked at, a chunk at a time; a vhost deleted
            // meanwhile has none left.
            let _ = walk_queues(&self.shared, vhost_name, |broker, queue| {
                for (position, consumer) in queue.consumers.iter().enumerate() {
                    let Some(session) = broker.sessions.get(&consumer.session) else {
                        continue;
                    };
                    let Some(on_channel) = session
                        .channels
                        .get(&consumer.channel)
                        .and_then(|channel| channel.consumers.get(&consumer.tag))
                    else {
                        continue;
                    };
                    consumers.push(m::Consumer {
                        vhost: vhost_name.clone(),
                        queue: queue.name.clone(),
                        consumer_tag: consumer.tag.clone(),
                        connection_id: consumer.session,
                        channel: consumer.channel,
                        client_address: session.client_address.clone(),
                        user: session.user.clone(),
                        ack_required: !on_channel.no_ack,
                        prefetch_count: on_channel.prefetch,
                        unacked: on_channel.unacked,
                        priority: consumer.priority,
                        // A single-active-consumer queue delivers to its first.
                        active: !queue.single_active_consumer || position == 0,
                        exclusive: queue.exclusive_consumer,
                    });
                }
            })
            .await;
        }
        consumers.sort_by(|a, b| (&a.vhost, &a.queue).cmp(&(&b.vhost, &b.queue)));
        Ok(m::ListConsumersResponse { consumers })
    }

    async fn close_connection(
        &self,
        request: m::CloseConnectionRequest,
    ) -> Result<m::CloseConnectionResponse, ServiceError> {
        let reason = if request.reason.is_empty() {
            "closed by management".to_string()
        } else {
            request.reason
        };
        let broker = self.shared.broker.lock();
        if Engine::close_connections(&broker, None, Some(request.id), &reason) == 0 {
            return Err(ServiceError::NotFound(format!(
                "no connection {}",
                request.id
            )));
        }
        tracing::info!(connection = request.id, %reason, "connection closed by management");
        Ok(m::CloseConnectionResponse {})
    }

    async fn set_broker_settings(
        &self,
        request: m::SetBrokerSettingsRequest,
    ) -> Result<m::SetBrokerSettingsResponse, ServiceError> {
        runtime::set_broker_settings(self, request)
    }

    async fn update_queue(
        &self,
        request: m::UpdateQueueRequest,
    ) -> Result<m::UpdateQueueResponse, ServiceError> {
        runtime::update_queue(self, request)
    }

    async fn set_limits(&self, request: m::SetLimitsRequest) -> Result<m::Limits, ServiceError> {
        crate::broker::limits::set(&mut self.shared.broker.lock(), &request)
    }

    async fn clear_limits(
        &self,
        request: m::ClearLimitsRequest,
    ) -> Result<m::ClearLimitsResponse, ServiceError> {
        crate::broker::limits::clear(&mut self.shared.broker.lock(), &request)?;
        Ok(m::ClearLimitsResponse {})
    }

    async fn list_limits(
        &self,
        _request: m::ListLimitsRequest,
    ) -> Result<m::ListLimitsResponse, ServiceError> {
        Ok(crate::broker::limits::list(&self.shared.broker.lock()))
    }

    async fn list_users(
        &self,
        _request: m::ListUsersRequest,
    ) -> Result<m::ListUsersResponse, ServiceError> {
        Ok(crate::access_admin::list_users(&self.shared))
    }

    async fn put_user(&self, request: m::PutUserRequest) -> Result<m::User, ServiceError> {
        crate::access_admin::put_user(&self.shared, request).await
    }

    async fn delete_user(
        &self,
        request: m::DeleteUserRequest,
    ) -> Result<m::DeleteUserResponse, ServiceError> {
        crate::access_admin::delete_user(&self.shared, request).await
    }

    async fn set_permissions(
        &self,
        request: m::SetPermissionsRequest,
    ) -> Result<m::Permission, ServiceError> {
        crate::access_admin::set_permissions(&self.shared, request).await
    }

    async fn clear_permissions(
        &self,
        request: m::ClearPermissionsRequest,
    ) -> Result<m::ClearPermissionsResponse, ServiceError> {
        crate::access_admin::clear_permissions(&self.shared, request).await
    }

    async fn list_permissions(
        &self,
        request: m::ListPermissionsRequest,
    ) -> Result<m::ListPermissionsResponse, ServiceError> {
        Ok(crate::access_admin::list_permissions(&self.shared, request))
    }

    async fn set_policy(&self, request: m::SetPolicyRequest) -> Result<m::Policy, ServiceError> {
        let wanted = request
            .policy
            .ok_or_else(|| ServiceError::InvalidArgument("policy is required".into()))?;
        let policy = Policy::new(
            &wanted.name,
            wanted.operator,
            &wanted.pattern,
            &wanted.apply_to,
            wanted.priority,
            &wanted.definition,
        )
        .map_err(|invalid| ServiceError::InvalidArgument(invalid.0))?;
        let (done, written) = oneshot::channel();
        let view = {
            let mut broker = self.shared.broker.lock();
            let view = policy_view(&wanted.vhost, &policy);
            let definition = policy.definition(&wanted.vhost);
            let touched = broker.set_policy(&wanted.vhost, policy)?;
            // Under the lock: stored in the order of the changes.
            self.shared.writer.submit_synced(
                vec![store_op(write_op::Op::PutPolicy(definition))],
                Some(done),
            );
            for queue in touched {
                broker.dispatch(&wanted.vhost, &queue);
            }
            view
        };
        await_written(written, "the policy").await?;
        Ok(view)
    }

    async fn list_policies(
        &self,
        request: m::ListPoliciesRequest,
    ) -> Result<m::ListPoliciesResponse, ServiceError> {
        let broker = self.shared.broker.lock();
        Ok(m::ListPoliciesResponse {
            policies: broker.list_policies(&request.vhost, request.operator)?,
        })
    }

    async fn clear_policy(
        &self,
        request: m::ClearPolicyRequest,
    ) -> Result<m::ClearPolicyResponse, ServiceError> {
        let (done, written) = oneshot::channel();
        {
            let mut broker = self.shared.broker.lock();
            let (removed, touched) =
                broker.clear_policy(&request.vhost, &request.name, request.operator)?;
            self.shared.writer.submit_synced(
                vec![store_op(write_op::Op::DeletePolicy(
                    removed.definition(&request.vhost),
                ))],
                Some(done),
            );
            for queue in touched {
                broker.dispatch(&request.vhost, &queue);
            }
        }
        await_written(written, "the policy's removal").await?;
        Ok(m::ClearPolicyResponse {})
    }

    async fn export_definitions(
        &self,
        request: m::ExportDefinitionsRequest,
    ) -> Result<m::Definitions, ServiceError> {
        crate::definitions_admin::export(&self.shared, &request).await
    }

    async fn import_definitions(
        &self,
        request: m::ImportDefinitionsRequest,
    ) -> Result<m::ImportDefinitionsResponse, ServiceError> {
        crate::definitions_admin::import(self, request).await
    }

    async fn set_transaction_timeouts(
        &self,
        request: m::SetTransactionTimeoutsRequest,
    ) -> Result<m::TransactionTimeouts, ServiceError> {
        let answer = ok(self.shared.broker.lock().set_transaction_timeouts(&request))?;
        // Shorter timeouts may be due at once.
        self.shared.tx_timer.notify_one();
        Ok(answer)
    }

    async fn authenticate_user(
        &self,
        request: pb::AuthenticateUserRequest,
    ) -> Result<pb::AuthenticateUserResponse, ServiceError> {
        Ok(crate::access_admin::authenticate_user(
            &self.shared,
            request,
        ))
    }
}

fn vhost_view(broker: &Broker, vhost: &VHost) -> m::Vhost {
    m::Vhost {
        name: vhost.name.clone(),
        exchanges: vhost.exchanges.len() as u32,
        queues: vhost.queues.len() as u32,
        connections: broker
            .sessions
            .values()
            .filter(|s| s.vhost == vhost.name)
            .count() as u32,
    }
}

fn blocked_reason(blocked: &crate::broker::producer_flow::BlockedChannel) -> String {
    let mut reasons: Vec<String> = blocked
        .queues
        .iter()
        .map(|q| format!("queue '{q}' is overfull"))
        .collect();
    if blocked.store_overfull {
        reasons.push("store overfull".to_string());
    }
    if blocked.memory_alarm {
        reasons.push("memory high watermark reached".to_string());
    }
    reasons.join(", ")
}

// ------------------------------------------------------------ runtime settings

/// Runtime settings: they take effect at once and are logged (here, and by
/// management with who asked).
mod runtime {
    use super::*;

    pub(super) fn set_broker_settings(
        engine: &Engine,
        request: m::SetBrokerSettingsRequest,
    ) -> Result<m::SetBrokerSettingsResponse, ServiceError> {
        if let Some(threshold) = request.flow_to_disk_threshold {
            if threshold == 0 {
                return Err(ServiceError::InvalidArgument(
                    "flow_to_disk_threshold must be above 0".into(),
                ));
            }
            engine.set_flow_to_disk_threshold(threshold);
        }
        Ok(m::SetBrokerSettingsResponse {})
    }

    /// Changes a queue's producer flow-control limits, in its arguments too
    /// (so a durable queue keeps them across restarts). A queue now under
    /// its resume capacity releases its producers at once; one now over its
    /// capacity blocks them at their next publish.
    pub(super) fn update_queue(
        engine: &Engine,
        request: m::UpdateQueueRequest,
    ) -> Result<m::UpdateQueueResponse, ServiceError> {
        let mut broker = engine.shared.broker.lock();
        let queue = broker
            .vhosts
            .get_mut(&request.vhost)
            .ok_or_else(|| not_found("vhost", &request.vhost, &request.vhost))?
            .queues
            .get_mut(&request.name)
            .ok_or_else(|| not_found("queue", &request.name, &request.vhost))?;
        let mut limits = queue.limits;
        if let Some(capacity) = request.capacity {
            limits.capacity = (capacity > 0).then_some(capacity);
            if request.resume_capacity.is_none() {
                limits.resume_capacity = limits.capacity;
            }
        }
        if let Some(resume) = request.resume_capacity {
            limits.resume_capacity = Some(resume);
        }
        if let Some(max_count) = request.max_count {
            limits.max_count = (max_count > 0).then_some(max_count);
        }
        match (limits.capacity, limits.resume_capacity) {
            (Some(capacity), Some(resume)) if resume > capacity => {
                return Err(ServiceError::FailedPrecondition(format!(
                    "resume capacity {resume} exceeds capacity {capacity}"
                )));
            }
            (None, _) => limits.resume_capacity = None,
            _ => {}
        }
        queue.limits = limits;
        let mut table = FieldTable::default();
        for (key, value) in queue.arguments.inner() {
            if !RUNTIME_ARGUMENTS.contains(&key.as_str()) {
                table.insert(key.clone(), value.clone());
            }
        }
        let long = |v: u64| AMQPValue::LongLongInt(i64::try_from(v).unwrap_or(i64::MAX));
        if let Some(capacity) = limits.capacity {
            table.insert("x-qpid-capacity".into(), long(capacity));
        }
        if let (Some(_), Some(resume)) = (limits.capacity, limits.resume_capacity) {
            table.insert("x-qpid-flow-resume-capacity".into(), long(resume));
        }
        if let Some(max_count) = limits.max_count {
            table.insert("qpid.max_count".into(), long(max_count));
        }
        queue.arguments = table;
        if queue.stores_messages() {
            let definition = store::QueueDefinition {
                vhost: request.vhost.clone(),
                name: request.name.clone(),
                auto_delete: queue.auto_delete,
                arguments: amqp::encode_table(&queue.arguments),
            };
            engine
                .shared
                .writer
                .submit_synced(vec![store_op(write_op::Op::PutQueue(definition))], None);
        }
        // A policy's keys combine with the new arguments (an operator
        // policy's capacity stays a ceiling).
        broker.apply_policies_to_queue(&request.vhost, &request.name);
        tracing::info!(
            vhost = %request.vhost,
            queue = %request.name,
            capacity = ?limits.capacity,
            resume_capacity = ?limits.resume_capacity,
            max_count = ?limits.max_count,
            "queue flow-control limits changed"
        );
        broker.check_underfull(&request.vhost, &request.name);
        Ok(m::UpdateQueueResponse {})
    }
}

// ------------------------------------------------------------ messages (peek, move)

/// The first ready messages of a queue, decoded enough to show; nothing is
/// consumed. Payloads that flowed to disk are read back for the answer
/// (they stay on disk).
/// Management's publish: the publish path of a client with confirms, on a
/// session of its own; answers once routed, and written when persistent.
async fn publish_message(
    engine: &Engine,
    request: m::PublishMessageRequest,
) -> Result<m::PublishMessageResponse, ServiceError> {
    let properties = request.properties.unwrap_or_default();
    let expiration_ms = match properties.expiration.as_str() {
        "" => None,
        text => {
            Some(amqp::properties::parse_expiration(text).map_err(ServiceError::InvalidArgument)?)
        }
    };
    let persistent = properties.delivery_mode == 2;
    let encoded = crate::broker::dead_letter::encode_properties(&amqp_properties(&properties)?)
        .ok_or_else(|| ServiceError::InvalidArgument("the properties cannot be encoded".into()))?;
    let body = request.body;
    let cmd = pb::Publish {
        channel: CHANNEL,
        exchange: request.exchange,
        routing_key: request.routing_key,
        properties: encoded,
        body_size: body.len() as u64,
        body,
        confirm_seq: 1,
        persistent,
        expiration_ms,
        ..Default::default()
    };
    let (routed, outcome) = engine.with_session(&request.vhost, |broker, session| {
        let routed = broker
            .routes_anywhere(&request.vhost, &cmd)
            .map_err(service_error)?;
        let outcome = broker.publish(session, cmd).map_err(service_error)?;
        Ok((routed, outcome))
    })?;
    match outcome {
        crate::broker::PublishOutcome::Done => {}
        crate::broker::PublishOutcome::AfterWrite(written) => {
            await_written(written, "the message").await?;
        }
        crate::broker::PublishOutcome::Rejected => return Err(ServiceError::FailedPrecondition(
            "the message was rejected: a queue it routes to is full (x-overflow reject-publish)"
                .into(),
        )),
    }
    Ok(m::PublishMessageResponse { routed })
}

/// AMQP basic properties from management's.
fn amqp_properties(
    properties: &m::MessageProperties,
) -> Result<amq_protocol::protocol::basic::AMQPProperties, ServiceError> {
    use amq_protocol::protocol::basic::AMQPProperties;
    let mut out = AMQPProperties::default();
    let text = |value: &str| ShortString::from(value.to_string());
    if !properties.headers.is_empty() {
        let mut table = FieldTable::default();
        for (key, value) in &properties.headers {
            if key.len() > 255 {
                return Err(ServiceError::InvalidArgument(
                    "a header name is at most 255 bytes".into(),
                ));
            }
            let value = match &value.value {
                Some(argument_value::Value::StringValue(v))
                | Some(argument_value::Value::Text(v)) => AMQPValue::LongString(v.clone().into()),
                Some(argument_value::Value::IntValue(v)) => AMQPValue::LongLongInt(*v),
                Some(argument_value::Value::BoolValue(v)) => AMQPValue::Boolean(*v),
                Some(argument_value::Value::DoubleValue(v)) => AMQPValue::Double(*v),
                None => AMQPValue::Void,
            };
            table.insert(ShortString::from(key.clone()), value);
        }
        out = out.with_headers(table);
    }
    if properties.delivery_mode != 0 {
        let mode = u8::try_from(properties.delivery_mode)
            .ok()
            .filter(|mode| *mode <= 2)
            .ok_or_else(|| ServiceError::InvalidArgument("delivery_mode must be 1 or 2".into()))?;
        out = out.with_delivery_mode(mode);
    }
    if let Some(priority) = properties.priority {
        let priority = u8::try_from(priority)
            .map_err(|_| ServiceError::InvalidArgument("priority must be 0 to 255".into()))?;
        out = out.with_priority(priority);
    }
    for (value, set) in [
        (
            &properties.content_type,
            AMQPProperties::with_content_type as fn(AMQPProperties, ShortString) -> AMQPProperties,
        ),
        (
            &properties.content_encoding,
            AMQPProperties::with_content_encoding,
        ),
        (
            &properties.correlation_id,
            AMQPProperties::with_correlation_id,
        ),
        (&properties.reply_to, AMQPProperties::with_reply_to),
        (&properties.expiration, AMQPProperties::with_expiration),
        (&properties.message_id, AMQPProperties::with_message_id),
        (&properties.r#type, AMQPProperties::with_type),
        (&properties.user_id, AMQPProperties::with_user_id),
        (&properties.app_id, AMQPProperties::with_app_id),
    ] {
        if !value.is_empty() {
            if value.len() > 255 {
                return Err(ServiceError::InvalidArgument(
                    "a property's text is at most 255 bytes".into(),
                ));
            }
            out = set(out, text(value));
        }
    }
    if let Some(timestamp) = properties.timestamp {
        out = out.with_timestamp(timestamp);
    }
    Ok(out)
}

async fn peek_messages(
    engine: &Engine,
    request: m::PeekMessagesRequest,
) -> Result<m::PeekMessagesResponse, ServiceError> {
    let count = match request.count {
        0 => DEFAULT_PEEK,
        n => n.min(MAX_PEEK),
    } as usize;
    let taken: Vec<QueuedMessage> = {
        let broker = engine.shared.broker.lock();
        let queue = vhost(&broker, &request.vhost)?
            .queues
            .get(&request.queue)
            .ok_or_else(|| not_found("queue", &request.queue, &request.vhost))?;
        not_exclusive(queue, &request.vhost)?;
        queue.messages.iter().take(count).cloned().collect()
    };
    let missing: Vec<u64> = taken
        .iter()
        .filter(|q| q.message.is_none())
        .map(|q| q.id)
        .collect();
    let max_message_size = engine.shared.max_message_size;
    let mut records: HashMap<u64, store::MessageRecord> = HashMap::new();
    if !missing.is_empty() {
        for record in crate::shared::load(&engine.shared, &missing).await {
            records.insert(record.id, record);
        }
    }
    let messages = taken
        .into_iter()
        .enumerate()
        .filter_map(|(position, queued)| {
            let (exchange, routing_key, properties, body, persistent) = match &queued.message {
                Some(message) => (
                    message.exchange.clone(),
                    message.routing_key.clone(),
                    message.properties.clone(),
                    message.body.clone(),
                    message.persistent,
                ),
                None => {
                    // Acked meanwhile: its record may be gone; leave it out.
                    let record = records.remove(&queued.id)?;
                    let body = record.body();
                    (
                        record.exchange,
                        record.routing_key,
                        record.properties,
                        body,
                        record.persistent,
                    )
                }
            };
            // Shown as published: a compressed body is decoded here (bounded
            // by the largest message size); one that does not decode is
            // shown empty with its declared size, and logged.
            let body_size = body.size();
            let body = body.decode(max_message_size).unwrap_or_else(|error| {
                tracing::warn!(
                    vhost = %request.vhost,
                    queue = %request.queue,
                    message_id = queued.id,
                    %error,
                    "peeked message body does not decode"
                );
                Bytes::new()
            });
            let mut peeked = m::PeekedMessage {
                position: position as u64,
                exchange,
                routing_key,
                redelivered: queued.redelivered,
                delivery_count: queued.delivery_count,
                persistent,
                body_size,
                body,
                ..Default::default()
            };
            show_properties(&mut peeked, &properties);
            Some(peeked)
        })
        .collect();
    Ok(m::PeekMessagesResponse {
        messages: within_batch_bytes(messages),
    })
}

/// The first of `messages` that fit into [`BATCH_BYTES`] encoded (at least
/// one): a peek answer must fit into one gRPC message, so a peek of large
/// messages returns fewer than asked.
/// The properties management shows of a message, from their AMQP
/// encoding; `persistent` from the delivery mode when `set_persistent`.
fn show_properties(peeked: &mut m::PeekedMessage, properties: &[u8]) {
    let Ok((_, properties)) = amq_protocol::protocol::basic::parse_properties(properties) else {
        return;
    };
    let text = |s: &Option<ShortString>| {
        s.as_ref()
            .map(|s| s.as_str().to_string())
            .unwrap_or_default()
    };
    peeked.content_type = text(properties.content_type());
    peeked.content_encoding = text(properties.content_encoding());
    peeked.message_id = text(properties.message_id());
    peeked.correlation_id = text(properties.correlation_id());
    if let Some(headers) = properties.headers() {
        peeked.headers = argument_map(headers);
    }
}

/// The longest a get waits for a message's body to come back from the
/// store before it answers with what it has.
const GET_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Takes messages from the head of a queue as basic.get does, on an
/// internal session: acknowledged at once, or rejected without requeue
/// (dead-lettered as the queue says). Stops at `count`, at an empty queue,
/// or at the answer's batch bound.
async fn get_messages(
    engine: &Engine,
    request: m::GetMessagesRequest,
) -> Result<m::PeekMessagesResponse, ServiceError> {
    let count = request.count.clamp(1, MAX_PEEK) as usize;
    let session = {
        let mut broker = engine.shared.broker.lock();
        let queue = vhost(&broker, &request.vhost)?
            .queues
            .get(&request.queue)
            .ok_or_else(|| not_found("queue", &request.queue, &request.vhost))?;
        not_exclusive(queue, &request.vhost)?;
        engine.open_internal_session(&mut broker, &request.vhost)?
    };
    let taken = take_messages(engine, session, &request, count).await;
    // Nothing is left unacked: closing requeues nothing.
    engine.shared.broker.lock().close_session(session);
    Ok(m::PeekMessagesResponse { messages: taken? })
}

async fn take_messages(
    engine: &Engine,
    session: SessionId,
    request: &m::GetMessagesRequest,
    count: usize,
) -> Result<Vec<m::PeekedMessage>, ServiceError> {
    let get = pb::Get {
        request_id: 0,
        channel: CHANNEL,
        queue: request.queue.clone(),
        no_ack: !request.reject,
    };
    let mut messages = Vec::new();
    let mut bytes = 0usize;
    while messages.len() < count && bytes < BATCH_BYTES / 2 {
        let outcome = {
            let mut broker = engine.shared.broker.lock();
            let outcome = broker.get(session, &get, true).map_err(service_error)?;
            if let (GetOutcome::Got(ok), true) = (&outcome, request.reject) {
                broker
                    .nack(
                        session,
                        &pb::Nack {
                            channel: CHANNEL,
                            delivery_tag: ok.delivery_tag,
                            multiple: false,
                            requeue: false,
                        },
                    )
                    .map_err(service_error)?;
            }
            outcome
        };
        let ok = match outcome {
            GetOutcome::Got(ok) => ok,
            GetOutcome::Empty => break,
            GetOutcome::Wait(wait) | GetOutcome::WaitForCredit(wait) => {
                if tokio::time::timeout(GET_WAIT, wait).await.is_err() {
                    break;
                }
                continue;
            }
        };
        let body_size = ok.body_size;
        let body = ok
            .body()
            .decode(engine.shared.max_message_size)
            .unwrap_or_else(|error| {
                tracing::warn!(vhost = %request.vhost, queue = %request.queue, %error, "taken message body does not decode");
                Bytes::new()
            });
        bytes += body.len();
        let mut taken = m::PeekedMessage {
            position: messages.len() as u64,
            redelivered: ok.redelivered,
            body_size,
            body,
            ..Default::default()
        };
        show_properties(&mut taken, &ok.properties);
        if let Ok((_, properties)) =
            amq_protocol::protocol::basic::parse_properties(&ok.properties[..])
        {
            taken.persistent = *properties.delivery_mode() == Some(2);
        }
        taken.exchange = ok.exchange;
        taken.routing_key = ok.routing_key;
        let last = ok.message_count == 0;
        messages.push(taken);
        if last {
            break;
        }
    }
    Ok(messages)
}

fn within_batch_bytes(mut messages: Vec<m::PeekedMessage>) -> Vec<m::PeekedMessage> {
    let mut bytes = 0;
    let keep = messages
        .iter()
        .position(|message| {
            bytes += prost::Message::encoded_len(message);
            bytes > BATCH_BYTES
        })
        .map_or(messages.len(), |over| over.max(1));
    messages.truncate(keep);
    messages
}

/// Moves ready messages from the head of `source` to the tail of
/// `destination`, in order. Each moved message gets a new id (the
/// destination is ordered by id) and, when persistent on a durable
/// destination, a new record: its put into the destination and its removal
/// from the source go to the store in one batch, so a crash keeps it in
/// exactly one of the two. A message whose payload flowed to disk is read
/// back first (the move waits for it, as basic.get does). Returns once the
/// last batch is durable.
async fn move_messages(
    engine: &Engine,
    request: m::MoveMessagesRequest,
) -> Result<m::MoveMessagesResponse, ServiceError> {
    let m::MoveMessagesRequest {
        vhost: vhost_name,
        source,
        destination,
        max_messages,
    } = request;
    if source == destination {
        return Err(ServiceError::InvalidArgument(
            "source and destination are the same queue".into(),
        ));
    }
    let mut progress = MoveProgress::default();
    let remaining = loop {
        match move_round(
            engine,
            &vhost_name,
            &source,
            &destination,
            max_messages,
            &mut progress,
        )? {
            MoveRound::Done(remaining) => break remaining,
            MoveRound::Again => {}
            // Dropped if the queue goes: the next round says so.
            MoveRound::Wait(payload) => {
                let _ = payload.await;
            }
        }
    };
    let MoveProgress {
        moved,
        stopped_reason,
        last_write,
        ..
    } = progress;
    tracing::info!(vhost = %vhost_name, %source, %destination, moved, "messages moved by management");
    if let Some(written) = last_write {
        written
            .await
            .map_err(|_| ServiceError::Unavailable("the engine is shutting down".into()))?
            .map_err(|failure| ServiceError::ResourceExhausted(failure.to_string()))?;
    }
    Ok(m::MoveMessagesResponse {
        moved,
        remaining,
        stopped_reason,
    })
}

#[derive(Default)]
struct MoveProgress {
    moved: u64,
    wanted: Option<u64>,
    stopped_reason: String,
    last_write: Option<oneshot::Receiver<crate::persistence::WriteOutcome>>,
}

enum MoveRound {
    /// Finished: this many ready messages are left in the source.
    Done(u64),
    /// The source's head is on disk: wait for it, then go on.
    Wait(oneshot::Receiver<()>),
    /// This round's batch is full (`BATCH_BYTES`): go on with the next.
    Again,
}

/// One round of a move, under the lock: moves resident messages from the
/// head until done, full, or the head's payload is on disk.
fn move_round(
    engine: &Engine,
    vhost_name: &str,
    source: &str,
    destination: &str,
    max_messages: u64,
    progress: &mut MoveProgress,
) -> Result<MoveRound, ServiceError> {
    let mut broker = engine.shared.broker.lock();
    let vhost = vhost(&broker, vhost_name)?;
    for name in [source, destination] {
        let queue = vhost
            .queues
            .get(name)
            .ok_or_else(|| not_found("queue", name, vhost_name))?;
        not_exclusive(queue, vhost_name)?;
    }
    // Its head is not in yet: moving would take later messages first.
    if vhost.queues.get(source).is_some_and(|q| q.recovering) {
        return Err(service_error(crate::broker::still_recovering(
            source, vhost_name,
        )));
    }
    let available = vhost
        .queues
        .get(source)
        .map_or(0, |q| q.messages.len() as u64);
    let wanted = *progress.wanted.get_or_insert(if max_messages == 0 {
        available
    } else {
        max_messages.min(available)
    });
    let budget = broker.budget.clone();
    let Broker {
        vhosts,
        shared_refs,
        ..
    } = &mut *broker;
    let queues = &mut vhosts
        .get_mut(vhost_name)
        .ok_or_else(|| not_found("vhost", vhost_name, vhost_name))?
        .queues;
    let mut ops: Vec<WriteOp> = Vec::new();
    let mut wait_for_payload = None;
    let mut batch: Vec<QueuedMessage> = Vec::new();
    let mut batch_full = false;
    // The destination's room, checked as if each moved message were there.
    let mut target = queues
        .remove(destination)
        .ok_or_else(|| not_found("queue", destination, vhost_name))?;
    if let Some(from) = queues.get_mut(source) {
        let source_stores = from.stores_messages();
        while progress.moved + (batch.len() as u64) < wanted {
            let Some(front) = from.messages.front() else {
                break;
            };
            if front.message.is_none() {
                let (waiter, wait) = oneshot::channel();
                from.get_waiters.push(waiter);
                wait_for_payload = Some(wait);
                break;
            }
            let pending_bytes: u64 = batch.iter().map(|m| m.body_size()).sum();
            // One round's write stays within one gRPC message to a remote
            // storage node; the next round moves the rest.
            if !batch.is_empty() && pending_bytes + front.body_size() > BATCH_BYTES as u64 {
                batch_full = true;
                break;
            }
            let fits_count = target
                .limits
                .max_length
                .is_none_or(|max| target.messages.len() as u64 + (batch.len() as u64) < max);
            let fits_bytes = target
                .limits
                .max_bytes
                .is_none_or(|max| target.ready_bytes + pending_bytes + front.body_size() <= max);
            if !(fits_count && fits_bytes) {
                progress.stopped_reason =
                    format!("queue '{destination}' is full (x-max-length / x-max-length-bytes)");
                break;
            }
            let Some(old) = from.dequeue() else { break };
            crate::broker::flow_to_disk::discard(
                shared_refs,
                vhost_name,
                source,
                source_stores,
                &old,
                &mut ops,
            );
            batch.push(old);
        }
    }
    let remaining = queues.get(source).map_or(0, |q| q.messages.len() as u64);
    let target_stores = target.stores_messages();
    let count = batch.len() as u64;
    let first_id = broker.reserve_message_ids(count);
    for (offset, old) in batch.into_iter().enumerate() {
        let body_size = old.body_size();
        let Some(message) = old.message else { continue };
        let id = first_id + offset as u64;
        let copy = crate::model::Message::new(
            &budget,
            message.exchange.clone(),
            message.routing_key.clone(),
            message.properties.clone(),
            message.body.clone(),
            message.persistent,
        );
        let priority = target.priority_of(&copy.properties);
        if copy.persistent && target_stores {
            ops.push(store_op(write_op::Op::PutMessage(copy.record(id))));
            ops.push(store_op(write_op::Op::PutQueueEntry(store::QueueEntry {
                vhost: vhost_name.to_string(),
                queue: destination.to_string(),
                id,
                body_size,
                redelivered: old.redelivered,
                delivery_count: old.delivery_count,
                expires_at_ms: old.expires_at,
                priority: u32::from(priority),
            })));
            copy.mark_stored(u64::MAX);
        }
        let mut entry = QueuedMessage::resident(id, copy);
        entry.priority = priority;
        entry.redelivered = old.redelivered;
        entry.delivery_count = old.delivery_count;
        // A moved message keeps its expiry.
        entry.expires_at = old.expires_at;
        // Within limits (checked above): nothing is dropped.
        target.enqueue(entry);
    }
    if let Some(vhost) = broker.vhosts.get_mut(vhost_name) {
        vhost.insert_queue(target);
    }
    broker.reschedule_expiry(vhost_name, destination);
    progress.moved += count;
    let (done, written) = oneshot::channel();
    engine.shared.writer.submit_synced(ops, Some(done));
    progress.last_write = Some(written);
    broker.dispatch(vhost_name, destination);
    broker.check_underfull(vhost_name, source);
    match wait_for_payload {
        Some(wait) if progress.moved < wanted && progress.stopped_reason.is_empty() => {
            broker.read_ahead(vhost_name, source);
            Ok(MoveRound::Wait(wait))
        }
        _ if batch_full && progress.moved < wanted && progress.stopped_reason.is_empty() => {
            Ok(MoveRound::Again)
        }
        _ => Ok(MoveRound::Done(remaining)),
    }
}

// ------------------------------------------------------------ gRPC

/// The engine's admin API over gRPC, for a management service in another
/// process.
pub struct EngineAdminService {
    engine: Engine,
}

impl EngineAdminService {
    pub fn new(engine: Engine) -> Self {
        Self { engine }
    }

    /// The server, sending and accepting messages of up to
    /// `max_message_bytes` (`spillway_proto::cluster::grpc_message_limit`).
    pub fn into_server(self, max_message_bytes: usize) -> EngineAdminServer<Self> {
        EngineAdminServer::new(self)
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes)
    }
}

macro_rules! serve_calls {
    ($($method:ident($request:ty) -> $response:ty;)*) => {
        #[tonic::async_trait]
        impl EngineAdmin for EngineAdminService {
            $(
                async fn $method(
                    &self,
                    request: Request<$request>,
                ) -> Result<Response<$response>, Status> {
                    let answer = EngineAdminApi::$method(&self.engine, request.into_inner()).await?;
                    Ok(Response::new(answer))
                }
            )*
        }
    };
}

spillway_proto::for_each_engine_admin_call!(serve_calls);

#[cfg(test)]
mod batch_tests {
    use super::*;

    fn peeked(body: usize) -> m::PeekedMessage {
        m::PeekedMessage {
            body: vec![0; body].into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_peek_answer_stops_at_the_batch_budget_but_keeps_one_message() {
        let mb = 1 << 20;
        let kept = within_batch_bytes(vec![peeked(6 * mb), peeked(6 * mb), peeked(6 * mb)]);
        assert_eq!(kept.len(), 2);
        let kept = within_batch_bytes(vec![peeked(20 * mb), peeked(1)]);
        assert_eq!(kept.len(), 1);
        let kept = within_batch_bytes((0..10).map(|_| peeked(10)).collect());
        assert_eq!(kept.len(), 10);
    }
}
