//! The broker: every operation a session can perform, as methods on the state
//! behind the engine's one lock. Methods never wait: what must reach the disk
//! is handed to the [`StoreWriter`] in order, what must reach a client is sent
//! on its session's event channel.

use std::collections::HashMap;
use std::sync::Arc;

use amq_protocol_types::{AMQPValue, FieldTable};
use rand::distr::{Alphanumeric, SampleString};
use spillway_proto::engine::{self as pb, session_event::Event, AmqpError, SessionEvent};
use spillway_proto::storage::{self as store, write_op, Durability, WriteOp};
use tokio::sync::{mpsc, oneshot};

use crate::budget::MemoryBudget;
use crate::errors::{self, codes};
use crate::flow::{discard, LoadRequest};
use crate::model::*;
use crate::persistence::StoreWriter;
use crate::routing::{as_integer, headers_match, topic_matches, values_equal, ExchangeKind};

pub type OpResult<T> = Result<T, AmqpError>;

pub struct Broker {
    pub vhosts: HashMap<String, VHost>,
    pub sessions: HashMap<SessionId, SessionState>,
    next_message_id: u64,
    pub(crate) persist: StoreWriter,
    /// Deliveries in flight to one gateway session before it must report
    /// them written.
    session_credit: u32,
    pub(crate) budget: Arc<MemoryBudget>,
    /// Whether flow to disk is on (see [`crate::flow`]).
    pub(crate) flow_active: bool,
    /// Holders of each message routed to more than one queue; a message
    /// held by one queue is not listed.
    pub(crate) shared_refs: HashMap<u64, u32>,
    /// To the loader task: payloads to read back from the store.
    pub(crate) loads: mpsc::UnboundedSender<LoadRequest>,
    /// The storage node is over its disk quota: every producer is blocked.
    pub(crate) store_overfull: bool,
    pub(crate) store_overfull_since: Option<std::time::Instant>,
}

/// What the broker needs from the engine around it.
pub struct BrokerContext {
    pub persist: StoreWriter,
    pub session_credit: u32,
    pub budget: Arc<MemoryBudget>,
    pub loads: mpsc::UnboundedSender<LoadRequest>,
}

/// What publishing did, for the session to confirm.
pub enum PublishOutcome {
    /// Nothing to wait for.
    Done,
    /// Confirm once this fires: the message is on disk.
    AfterWrite(oneshot::Receiver<()>),
    /// A queue's `x-overflow: reject-publish` refused it: nack the publisher.
    Rejected,
}

/// What basic.get found.
pub enum GetOutcome {
    Got(pb::GetOk),
    Empty,
    /// The head's payload is being read back from the store: ask again once
    /// this fires.
    Wait(oneshot::Receiver<()>),
}

impl Broker {
    pub fn new(context: BrokerContext) -> Self {
        let mut vhosts = HashMap::new();
        vhosts.insert("/".to_string(), VHost::new("/"));
        Self {
            vhosts,
            sessions: HashMap::new(),
            next_message_id: 1,
            persist: context.persist,
            session_credit: context.session_credit.max(1),
            budget: context.budget,
            flow_active: false,
            shared_refs: HashMap::new(),
            loads: context.loads,
            store_overfull: false,
            store_overfull_since: None,
        }
    }

    pub fn set_next_message_id(&mut self, next: u64) {
        self.next_message_id = self.next_message_id.max(next);
    }

    /// Reserves `count` consecutive message ids (management's move);
    /// returns the first.
    pub(crate) fn reserve_message_ids(&mut self, count: u64) -> u64 {
        let first = self.next_message_id;
        self.next_message_id += count;
        first
    }

    // ------------------------------------------------------------ sessions

    pub fn open_session(
        &mut self,
        id: SessionId,
        open: &pb::OpenSession,
        events: tokio::sync::mpsc::UnboundedSender<SessionEvent>,
    ) -> OpResult<()> {
        if !self.vhosts.contains_key(&open.vhost) {
            return Err(errors::error(
                codes::NOT_ALLOWED,
                format!("vhost '{}' not found", open.vhost),
            ));
        }
        self.sessions.insert(
            id,
            SessionState {
                vhost: open.vhost.clone(),
                user: open.user.clone(),
                client_address: open.client_address.clone(),
                client_properties: open.client_properties.clone(),
                published: 0,
                delivered: 0,
                events,
                channels: HashMap::new(),
                credit: self.session_credit,
                flow_blocked: None,
                has_published: false,
            },
        );
        tracing::debug!(session = id, vhost = %open.vhost, user = %open.user, "session opened");
        // Told at once when the store is over its quota.
        self.update_session_flow(id);
        Ok(())
    }

    pub fn close_session(&mut self, id: SessionId) {
        let Some(session) = self.sessions.get(&id) else {
            return;
        };
        let channels: Vec<ChannelId> = session.channels.keys().copied().collect();
        let vhost = session.vhost.clone();
        for channel in channels {
            self.close_channel(id, channel);
        }
        let exclusive: Vec<String> = self
            .vhosts
            .get(&vhost)
            .map(|v| {
                v.queues
                    .values()
                    .filter(|q| q.exclusive_owner == Some(id))
                    .map(|q| q.name.clone())
                    .collect()
            })
            .unwrap_or_default();
        for queue in exclusive {
            self.remove_queue(&vhost, &queue);
        }
        self.sessions.remove(&id);
    }

    pub fn open_channel(&mut self, session: SessionId, channel: ChannelId) -> OpResult<()> {
        let state = self.session_mut(session)?;
        if state.channels.contains_key(&channel) {
            return Err(errors::error(
                codes::CHANNEL_ERROR,
                format!("channel {channel} already open"),
            ));
        }
        state.channels.insert(channel, ChannelState::default());
        Ok(())
    }

    /// Cancels the channel's consumers and requeues its unacked deliveries.
    pub fn close_channel(&mut self, session: SessionId, channel: ChannelId) {
        let Some(state) = self.sessions.get_mut(&session) else {
            return;
        };
        let vhost = state.vhost.clone();
        let Some(channel_state) = state.channels.remove(&channel) else {
            return;
        };
        if !channel_state.blocked_on.is_empty() {
            self.forget_blocked_channel(session, channel, &vhost, &channel_state.blocked_on);
        }
        let mut touched = Vec::new();
        for (tag, consumer) in &channel_state.consumers {
            self.detach_consumer(&vhost, &consumer.queue, session, channel, tag);
            touched.push(consumer.queue.clone());
        }
        let mut ops = Vec::new();
        for (_, unacked) in channel_state.unacked.into_iter().rev() {
            self.requeue_or_discard(&vhost, unacked, &mut ops, &mut touched);
        }
        self.persist.submit(ops, Durability::Logged, None);
        touched.sort();
        touched.dedup();
        for queue in &touched {
            self.auto_delete_if_unused(&vhost, queue);
            self.dispatch(&vhost, queue);
        }
    }

    // ------------------------------------------------------------ exchanges

    pub fn declare_exchange(
        &mut self,
        session: SessionId,
        cmd: &pb::ExchangeDeclare,
    ) -> OpResult<()> {
        let vhost_name = self.session_vhost(session)?;
        if cmd.exchange.is_empty() {
            return Err(errors::error(
                codes::ACCESS_REFUSED,
                "operation not permitted on the default exchange",
            ));
        }
        let vhost = self.vhost_mut(&vhost_name)?;
        if let Some(existing) = vhost.exchanges.get(&cmd.exchange) {
            if cmd.passive {
                return Ok(());
            }
            if existing.kind.as_str() != cmd.kind {
                return Err(errors::error(
                    codes::PRECONDITION_FAILED,
                    format!(
                        "inequivalent arg 'type' for exchange '{}' in vhost '{}': received '{}' but current is '{}'",
                        cmd.exchange, vhost_name, cmd.kind, existing.kind.as_str()
                    ),
                ));
            }
            if existing.durable != cmd.durable && !existing.is_builtin() {
                return Err(errors::inequivalent(
                    "durable",
                    "exchange",
                    &cmd.exchange,
                    &vhost_name,
                    cmd.durable,
                    existing.durable,
                ));
            }
            if existing.auto_delete != cmd.auto_delete && !existing.is_builtin() {
                return Err(errors::inequivalent(
                    "auto_delete",
                    "exchange",
                    &cmd.exchange,
                    &vhost_name,
                    cmd.auto_delete,
                    existing.auto_delete,
                ));
            }
            return Ok(());
        }
        if cmd.passive {
            return Err(errors::error(
                codes::NOT_FOUND,
                format!("no exchange '{}' in vhost '{}'", cmd.exchange, vhost_name),
            ));
        }
        let Some(kind) = ExchangeKind::parse(&cmd.kind) else {
            return Err(errors::error(
                codes::COMMAND_INVALID,
                format!("invalid exchange type '{}'", cmd.kind),
            ));
        };
        if cmd.exchange.starts_with("amq.") {
            return Err(errors::error(
                codes::ACCESS_REFUSED,
                format!(
                    "exchange name '{}' contains reserved prefix 'amq.*'",
                    cmd.exchange
                ),
            ));
        }
        errors::decode_table(&cmd.arguments)?;
        let exchange = Exchange {
            name: cmd.exchange.clone(),
            kind,
            durable: cmd.durable,
            auto_delete: cmd.auto_delete,
            internal: cmd.internal,
            arguments: cmd.arguments.clone(),
            bindings: Vec::new(),
        };
        if exchange.durable {
            self.persist.submit_synced(
                vec![op(write_op::Op::PutExchange(store::ExchangeDefinition {
                    vhost: vhost_name.clone(),
                    name: exchange.name.clone(),
                    kind: cmd.kind.clone(),
                    auto_delete: exchange.auto_delete,
                    internal: exchange.internal,
                    arguments: exchange.arguments.clone(),
                }))],
                None,
            );
        }
        let vhost = self.vhost_mut(&vhost_name)?;
        vhost.exchanges.insert(cmd.exchange.clone(), exchange);
        Ok(())
    }

    pub fn delete_exchange(
        &mut self,
        session: SessionId,
        cmd: &pb::ExchangeDelete,
    ) -> OpResult<()> {
        let vhost_name = self.session_vhost(session)?;
        let vhost = self.vhost_mut(&vhost_name)?;
        let Some(exchange) = vhost.exchanges.get(&cmd.exchange) else {
            return Ok(());
        };
        if exchange.is_builtin() {
            return Err(errors::error(
                codes::ACCESS_REFUSED,
                format!("operation not permitted on exchange '{}'", cmd.exchange),
            ));
        }
        if cmd.if_unused && !exchange.bindings.is_empty() {
            return Err(errors::error(
                codes::PRECONDITION_FAILED,
                format!(
                    "exchange '{}' in vhost '{}' in use",
                    cmd.exchange, vhost_name
                ),
            ));
        }
        self.remove_exchange(&vhost_name, &cmd.exchange);
        Ok(())
    }

    fn remove_exchange(&mut self, vhost_name: &str, name: &str) {
        let Some(vhost) = self.vhosts.get_mut(vhost_name) else {
            return;
        };
        let Some(exchange) = vhost.exchanges.remove(name) else {
            return;
        };
        let mut ops: Vec<WriteOp> = Vec::new();
        if exchange.durable {
            ops.extend(exchange.bindings.iter().map(|b| {
                op(write_op::Op::DeleteBinding(binding_definition(
                    vhost_name, name, b,
                )))
            }));
            ops.push(op(write_op::Op::DeleteExchange(store::ExchangeKey {
                vhost: vhost_name.to_string(),
                name: name.to_string(),
            })));
        }
        // Bindings from other exchanges to this one go with it.
        let target = Destination::Exchange(name.to_string());
        for source in vhost.exchanges.values_mut() {
            let source_name = source.name.clone();
            let source_durable = source.durable;
            source.bindings.retain(|b| {
                let keep = b.destination != target;
                if !keep && source_durable && exchange.durable {
                    ops.push(op(write_op::Op::DeleteBinding(binding_definition(
                        vhost_name,
                        &source_name,
                        b,
                    ))));
                }
                keep
            });
        }
        self.persist.submit_synced(ops, None);
    }

    // --------------------------------------------------------------- queues

    pub fn declare_queue(
        &mut self,
        session: SessionId,
        cmd: &pb::QueueDeclare,
    ) -> OpResult<pb::QueueDeclareOk> {
        let vhost_name = self.session_vhost(session)?;
        let vhost = self.vhost_mut(&vhost_name)?;
        let name = if cmd.queue.is_empty() {
            if cmd.passive {
                return Err(errors::error(
                    codes::NOT_FOUND,
                    "no queue named '' (passive declare)",
                ));
            }
            format!(
                "amq.gen-{}",
                Alphanumeric.sample_string(&mut rand::rng(), 22)
            )
        } else {
            cmd.queue.clone()
        };
        if let Some(existing) = vhost.queues.get(&name) {
            check_exclusive(existing, session, &vhost_name)?;
            if !cmd.passive {
                if existing.durable != cmd.durable {
                    return Err(errors::inequivalent(
                        "durable",
                        "queue",
                        &name,
                        &vhost_name,
                        cmd.durable,
                        existing.durable,
                    ));
                }
                if existing.exclusive_owner.is_some() != cmd.exclusive {
                    return Err(errors::inequivalent(
                        "exclusive",
                        "queue",
                        &name,
                        &vhost_name,
                        cmd.exclusive,
                        existing.exclusive_owner.is_some(),
                    ));
                }
                if existing.auto_delete != cmd.auto_delete {
                    return Err(errors::inequivalent(
                        "auto_delete",
                        "queue",
                        &name,
                        &vhost_name,
                        cmd.auto_delete,
                        existing.auto_delete,
                    ));
                }
                let arguments = errors::decode_table(&cmd.arguments)?;
                if let Some(key) = first_inequivalent_argument(&existing.argument_table, &arguments)
                {
                    return Err(errors::error(
                        codes::PRECONDITION_FAILED,
                        format!(
                            "inequivalent arg '{key}' for queue '{name}' in vhost '{vhost_name}'"
                        ),
                    ));
                }
            }
            return Ok(pb::QueueDeclareOk {
                queue: name,
                message_count: existing.messages.len() as u32,
                consumer_count: existing.consumers.len() as u32,
            });
        }
        if cmd.passive {
            return Err(errors::error(
                codes::NOT_FOUND,
                format!("no queue '{name}' in vhost '{vhost_name}'"),
            ));
        }
        if name.starts_with("amq.") && !cmd.queue.is_empty() {
            return Err(errors::error(
                codes::ACCESS_REFUSED,
                format!("queue name '{name}' contains reserved prefix 'amq.*'"),
            ));
        }
        let argument_table = errors::decode_table(&cmd.arguments)?;
        let limits = queue_limits(&argument_table, &name, &vhost_name)?;
        let mut queue = Queue::new(
            name.clone(),
            cmd.durable,
            cmd.auto_delete,
            cmd.exclusive.then_some(session),
        );
        queue.arguments = cmd.arguments.clone();
        queue.argument_table = argument_table;
        queue.limits = limits;
        if queue.stores_messages() {
            self.persist.submit_synced(
                vec![op(write_op::Op::PutQueue(store::QueueDefinition {
                    vhost: vhost_name.clone(),
                    name: name.clone(),
                    auto_delete: queue.auto_delete,
                    arguments: queue.arguments.clone(),
                }))],
                None,
            );
        }
        let vhost = self.vhost_mut(&vhost_name)?;
        vhost.queues.insert(name.clone(), queue);
        // Every queue is bound to the default exchange by its name.
        Ok(pb::QueueDeclareOk {
            queue: name,
            message_count: 0,
            consumer_count: 0,
        })
    }

    pub fn bind_queue(&mut self, session: SessionId, cmd: &pb::QueueBind) -> OpResult<()> {
        let target = Destination::Queue(cmd.queue.clone());
        self.bind(
            session,
            target,
            &cmd.exchange,
            &cmd.routing_key,
            &cmd.arguments,
        )
    }

    pub fn unbind_queue(&mut self, session: SessionId, cmd: &pb::QueueBind) -> OpResult<()> {
        let target = Destination::Queue(cmd.queue.clone());
        self.unbind(
            session,
            target,
            &cmd.exchange,
            &cmd.routing_key,
            &cmd.arguments,
        )
    }

    pub fn bind_exchange(&mut self, session: SessionId, cmd: &pb::ExchangeBind) -> OpResult<()> {
        let target = Destination::Exchange(cmd.destination.clone());
        self.bind(
            session,
            target,
            &cmd.source,
            &cmd.routing_key,
            &cmd.arguments,
        )
    }

    pub fn unbind_exchange(&mut self, session: SessionId, cmd: &pb::ExchangeBind) -> OpResult<()> {
        let target = Destination::Exchange(cmd.destination.clone());
        self.unbind(
            session,
            target,
            &cmd.source,
            &cmd.routing_key,
            &cmd.arguments,
        )
    }

    /// Checks that a binding's destination exists and may be used; returns
    /// whether it is durable (the binding is stored when both ends are).
    fn check_destination(
        vhost: &VHost,
        destination: &Destination,
        session: SessionId,
        vhost_name: &str,
    ) -> OpResult<bool> {
        match destination {
            Destination::Queue(name) => {
                let queue = find_queue(vhost, name, vhost_name)?;
                check_exclusive(queue, session, vhost_name)?;
                Ok(queue.stores_messages())
            }
            Destination::Exchange(name) => {
                let exchange = find_exchange(vhost, name, vhost_name)?;
                if exchange.name.is_empty() {
                    return Err(default_exchange_refused());
                }
                Ok(exchange.durable)
            }
        }
    }

    /// Checks a bind/unbind request (both ends exist and may be used, the
    /// source is not the default exchange) and builds the binding it names.
    /// Returns the vhost, the binding, and whether it is stored (both ends
    /// durable).
    fn binding_request(
        &mut self,
        session: SessionId,
        destination: Destination,
        source: &str,
        routing_key: &str,
        arguments: &bytes::Bytes,
    ) -> OpResult<(String, Binding, bool)> {
        let vhost_name = self.session_vhost(session)?;
        let argument_table = errors::decode_table(arguments)?;
        let vhost = self.vhost_mut(&vhost_name)?;
        let destination_durable =
            Self::check_destination(vhost, &destination, session, &vhost_name)?;
        let exchange = find_exchange(vhost, source, &vhost_name)?;
        if exchange.name.is_empty() {
            return Err(default_exchange_refused());
        }
        let durable = exchange.durable && destination_durable;
        let binding = Binding {
            destination,
            routing_key: routing_key.to_string(),
            arguments: arguments.clone(),
            argument_table,
        };
        Ok((vhost_name, binding, durable))
    }

    fn bind(
        &mut self,
        session: SessionId,
        destination: Destination,
        source: &str,
        routing_key: &str,
        arguments: &bytes::Bytes,
    ) -> OpResult<()> {
        let (vhost_name, binding, durable) =
            self.binding_request(session, destination, source, routing_key, arguments)?;
        let vhost = self.vhost_mut(&vhost_name)?;
        let exists = vhost
            .exchanges
            .get(source)
            .is_some_and(|x| x.bindings.iter().any(|b| same_binding(b, &binding)));
        if exists {
            return Ok(());
        }
        if durable {
            self.persist.submit_synced(
                vec![op(write_op::Op::PutBinding(binding_definition(
                    &vhost_name,
                    source,
                    &binding,
                )))],
                None,
            );
        }
        let vhost = self.vhost_mut(&vhost_name)?;
        if let Some(exchange) = vhost.exchanges.get_mut(source) {
            exchange.bindings.push(binding);
        }
        Ok(())
    }

    fn unbind(
        &mut self,
        session: SessionId,
        destination: Destination,
        source: &str,
        routing_key: &str,
        arguments: &bytes::Bytes,
    ) -> OpResult<()> {
        let (vhost_name, probe, durable) =
            self.binding_request(session, destination, source, routing_key, arguments)?;
        let vhost = self.vhost_mut(&vhost_name)?;
        let Some(exchange) = vhost.exchanges.get_mut(source) else {
            return Ok(());
        };
        let Some(position) = exchange
            .bindings
            .iter()
            .position(|b| same_binding(b, &probe))
        else {
            return Ok(());
        };
        let removed = exchange.bindings.remove(position);
        let now_unused = exchange.auto_delete && exchange.bindings.is_empty();
        if durable {
            self.persist.submit_synced(
                vec![op(write_op::Op::DeleteBinding(binding_definition(
                    &vhost_name,
                    source,
                    &removed,
                )))],
                None,
            );
        }
        if now_unused {
            self.remove_exchange(&vhost_name, source);
        }
        Ok(())
    }

    pub fn purge_queue(&mut self, session: SessionId, cmd: &pb::QueuePurge) -> OpResult<u32> {
        let vhost_name = self.session_vhost(session)?;
        let vhost = self.vhost_mut(&vhost_name)?;
        let queue = find_queue_mut(vhost, &cmd.queue, &vhost_name)?;
        check_exclusive(queue, session, &vhost_name)?;
        let purged = queue.purge();
        let stores = queue.stores_messages();
        let mut ops = Vec::new();
        for entry in &purged {
            discard(
                &mut self.shared_refs,
                &vhost_name,
                &cmd.queue,
                stores,
                entry,
                &mut ops,
            );
        }
        self.persist.submit(ops, Durability::Logged, None);
        self.check_underfull(&vhost_name, &cmd.queue);
        Ok(purged.len() as u32)
    }

    pub fn delete_queue(&mut self, session: SessionId, cmd: &pb::QueueDelete) -> OpResult<u32> {
        let vhost_name = self.session_vhost(session)?;
        let vhost = self.vhost_mut(&vhost_name)?;
        let Some(queue) = vhost.queues.get(&cmd.queue) else {
            return Ok(0);
        };
        check_exclusive(queue, session, &vhost_name)?;
        if cmd.if_unused && !queue.consumers.is_empty() {
            return Err(errors::error(
                codes::PRECONDITION_FAILED,
                format!("queue '{}' in vhost '{}' in use", cmd.queue, vhost_name),
            ));
        }
        if cmd.if_empty && !queue.messages.is_empty() {
            return Err(errors::error(
                codes::PRECONDITION_FAILED,
                format!(
                    "queue '{}' in vhost '{}' is not empty",
                    cmd.queue, vhost_name
                ),
            ));
        }
        let count = queue.messages.len() as u32;
        self.remove_queue(&vhost_name, &cmd.queue);
        Ok(count)
    }

    /// Deletes a queue: its consumers are cancelled (clients told), its
    /// bindings removed, its stored messages dropped.
    fn remove_queue(&mut self, vhost_name: &str, name: &str) {
        let Some(vhost) = self.vhosts.get_mut(vhost_name) else {
            return;
        };
        let Some(queue) = vhost.queues.remove(name) else {
            return;
        };
        let mut ops = Vec::new();
        let mut emptied_auto_delete = Vec::new();
        for exchange in vhost.exchanges.values_mut() {
            let before = exchange.bindings.len();
            let durable = exchange.durable;
            let exchange_name = exchange.name.clone();
            exchange.bindings.retain(|b| {
                let keep = b.destination != Destination::Queue(name.to_string());
                if !keep && durable && queue.stores_messages() {
                    ops.push(op(write_op::Op::DeleteBinding(binding_definition(
                        vhost_name,
                        &exchange_name,
                        b,
                    ))));
                }
                keep
            });
            if before > 0 && exchange.bindings.is_empty() && exchange.auto_delete {
                emptied_auto_delete.push(exchange_name);
            }
        }
        if queue.stores_messages() {
            ops.push(op(write_op::Op::DeleteQueue(store::QueueKey {
                vhost: vhost_name.to_string(),
                name: name.to_string(),
            })));
        }
        // The queue's entries went with DeleteQueue; the records of messages
        // no other queue holds go one by one.
        for entry in &queue.messages {
            discard(
                &mut self.shared_refs,
                vhost_name,
                name,
                false,
                entry,
                &mut ops,
            );
        }
        self.persist.submit_synced(ops, None);
        self.release(vhost_name, name, queue.blocked_channels.clone());
        for consumer in &queue.consumers {
            if let Some(session) = self.sessions.get_mut(&consumer.session) {
                if let Some(channel) = session.channels.get_mut(&consumer.channel) {
                    channel.consumers.remove(&consumer.tag);
                }
                let _ =
                    session
                        .events
                        .send(event(Event::ConsumerCancelled(pb::ConsumerCancelled {
                            channel: consumer.channel,
                            consumer_tag: consumer.tag.clone(),
                        })));
            }
        }
        for exchange in emptied_auto_delete {
            self.remove_exchange(vhost_name, &exchange);
        }
    }

    fn auto_delete_if_unused(&mut self, vhost_name: &str, name: &str) {
        let unused = self
            .queue_mut_opt(vhost_name, name)
            .is_some_and(|q| q.auto_delete && q.consumers.is_empty());
        if unused {
            self.remove_queue(vhost_name, name);
        }
    }

    // ------------------------------------------------------------ consumers

    pub fn consume(&mut self, session: SessionId, cmd: &pb::Consume) -> OpResult<String> {
        let vhost_name = self.session_vhost(session)?;
        errors::decode_table(&cmd.arguments)?;
        let tag = if cmd.consumer_tag.is_empty() {
            format!(
                "amq.ctag-{}",
                Alphanumeric.sample_string(&mut rand::rng(), 22)
            )
        } else {
            cmd.consumer_tag.clone()
        };
        let channel = self.channel_mut(session, cmd.channel)?;
        if channel.consumers.contains_key(&tag) {
            return Err(errors::error(
                codes::NOT_ALLOWED,
                format!("attempt to reuse consumer tag '{tag}'"),
            ));
        }
        let prefetch = channel.consumer_prefetch;
        let vhost = self.vhost_mut(&vhost_name)?;
        let queue = find_queue_mut(vhost, &cmd.queue, &vhost_name)?;
        check_exclusive(queue, session, &vhost_name)?;
        if queue.exclusive_consumer || (cmd.exclusive && !queue.consumers.is_empty()) {
            return Err(errors::error(
                codes::ACCESS_REFUSED,
                format!(
                    "queue '{}' in vhost '{}' in exclusive use",
                    cmd.queue, vhost_name
                ),
            ));
        }
        queue.exclusive_consumer = cmd.exclusive;
        queue.consumers.push(ConsumerRef {
            session,
            channel: cmd.channel,
            tag: tag.clone(),
        });
        let channel = self.channel_mut(session, cmd.channel)?;
        channel.consumers.insert(
            tag.clone(),
            Consumer {
                queue: cmd.queue.clone(),
                no_ack: cmd.no_ack,
                prefetch,
                unacked: 0,
            },
        );
        Ok(tag)
    }

    pub fn cancel(&mut self, session: SessionId, cmd: &pb::Cancel) -> OpResult<()> {
        let vhost_name = self.session_vhost(session)?;
        let channel = self.channel_mut(session, cmd.channel)?;
        let Some(consumer) = channel.consumers.remove(&cmd.consumer_tag) else {
            return Ok(());
        };
        self.detach_consumer(
            &vhost_name,
            &consumer.queue,
            session,
            cmd.channel,
            &cmd.consumer_tag,
        );
        self.auto_delete_if_unused(&vhost_name, &consumer.queue);
        Ok(())
    }

    fn detach_consumer(
        &mut self,
        vhost: &str,
        queue: &str,
        session: SessionId,
        channel: ChannelId,
        tag: &str,
    ) {
        if let Some(queue) = self.queue_mut_opt(vhost, queue) {
            queue
                .consumers
                .retain(|c| !(c.session == session && c.channel == channel && c.tag == tag));
            if queue.consumers.is_empty() {
                queue.exclusive_consumer = false;
            }
        }
    }

    pub fn qos(&mut self, session: SessionId, cmd: &pb::Qos) -> OpResult<()> {
        let vhost = self.session_vhost(session)?;
        let channel = self.channel_mut(session, cmd.channel)?;
        if cmd.global {
            channel.channel_prefetch = cmd.prefetch_count;
        } else {
            channel.consumer_prefetch = cmd.prefetch_count;
        }
        let queues: Vec<String> = channel
            .consumers
            .values()
            .map(|c| c.queue.clone())
            .collect();
        for queue in queues {
            self.dispatch(&vhost, &queue);
        }
        Ok(())
    }

    pub fn confirm_select(&mut self, session: SessionId, channel: ChannelId) -> OpResult<()> {
        self.channel_mut(session, channel)?.confirm = true;
        Ok(())
    }

    // ------------------------------------------------------------ messages

    pub fn publish(&mut self, session: SessionId, cmd: pb::Publish) -> OpResult<PublishOutcome> {
        let vhost_name = self.session_vhost(session)?;
        let vhost = self.vhost_mut(&vhost_name)?;
        let exchange = find_exchange(vhost, &cmd.exchange, &vhost_name)?;
        if exchange.internal {
            return Err(errors::error(
                codes::ACCESS_REFUSED,
                format!("cannot publish to internal exchange '{}'", cmd.exchange),
            ));
        }
        let targets = route(vhost, exchange, &cmd)?;
        let confirm_seq = cmd.confirm_seq;
        let channel = cmd.channel;
        if targets.is_empty() {
            if cmd.mandatory {
                self.send(
                    session,
                    Event::Returned(pb::Return {
                        channel,
                        reply_code: u32::from(codes::NO_ROUTE),
                        reply_text: "NO_ROUTE".to_string(),
                        exchange: cmd.exchange,
                        routing_key: cmd.routing_key,
                        properties: cmd.properties,
                        body: cmd.body,
                    }),
                );
            }
            return Ok(PublishOutcome::Done);
        }
        let id = self.next_message_id;
        self.next_message_id += 1;
        // The body arrives in an allocation of its own: the gateway assembles
        // it, and the remote session copies it out of its gRPC message.
        let message = Message::new(
            &self.budget,
            cmd.exchange,
            cmd.routing_key,
            cmd.properties,
            cmd.body,
            cmd.persistent,
        );
        let mut ops = Vec::new();
        let mut rejected = false;
        let mut holders = 0u32;
        let shared = targets.len() > 1;
        let Self {
            vhosts,
            shared_refs,
            ..
        } = self;
        let vhost = vhosts.get_mut(&vhost_name).ok_or_else(|| {
            errors::error(
                codes::NOT_ALLOWED,
                format!("vhost '{vhost_name}' not found"),
            )
        })?;
        for name in &targets {
            let Some(queue) = vhost.queues.get_mut(name) else {
                continue;
            };
            let body_len = message.body.len() as u64;
            if queue.limits.overflow != Overflow::DropHead && queue.would_overflow(body_len) {
                rejected = true;
                continue;
            }
            let stores = queue.stores_messages();
            if message.persistent && stores {
                if message.stored_seq() == 0 {
                    ops.push(op(write_op::Op::PutMessage(message.record(id))));
                    message.mark_stored(u64::MAX);
                }
                ops.push(op(write_op::Op::PutQueueEntry(store::QueueEntry {
                    vhost: vhost_name.clone(),
                    queue: name.clone(),
                    id,
                    body_size: body_len,
                    redelivered: false,
                })));
            }
            let mut entry = QueuedMessage::resident(id, message.clone());
            entry.shared = shared;
            holders += 1;
            let dropped = queue.enqueue(entry);
            for entry in &dropped {
                discard(shared_refs, &vhost_name, name, stores, entry, &mut ops);
            }
        }
        if holders > 1 {
            self.shared_refs.insert(id, holders);
        }
        let stored_now = message.stored_seq() != 0;
        let outcome = if rejected && confirm_seq > 0 {
            self.persist.submit(ops, Durability::Synced, None);
            PublishOutcome::Rejected
        } else if ops.is_empty() {
            PublishOutcome::Done
        } else if confirm_seq > 0 {
            let (done, wait) = oneshot::channel();
            let seq = self.persist.submit(ops, Durability::Synced, Some(done));
            if stored_now {
                message.mark_stored(seq);
            }
            PublishOutcome::AfterWrite(wait)
        } else {
            let seq = self.persist.submit(ops, Durability::Synced, None);
            if stored_now {
                message.mark_stored(seq);
            }
            PublishOutcome::Done
        };
        drop(message);
        if !self.flow_active && self.budget.over_threshold() {
            // Turned on here, not by waking the housekeeping task: under
            // load the task may run late, and every publish until then would
            // stay resident over the threshold.
            self.housekeeping();
        }
        for name in &targets {
            self.spill_arrival(&vhost_name, name, id);
            self.dispatch(&vhost_name, name);
            self.after_publish(session, channel, &vhost_name, name);
        }
        self.note_producer(session);
        Ok(outcome)
    }

    pub fn get(&mut self, session: SessionId, cmd: &pb::Get) -> OpResult<GetOutcome> {
        let vhost_name = self.session_vhost(session)?;
        self.channel_mut(session, cmd.channel)?;
        let vhost = self.vhost_mut(&vhost_name)?;
        let queue = find_queue_mut(vhost, &cmd.queue, &vhost_name)?;
        check_exclusive(queue, session, &vhost_name)?;
        let Some(head) = queue.messages.front() else {
            return Ok(GetOutcome::Empty);
        };
        if head.message.is_none() {
            let (waiter, wait) = oneshot::channel();
            queue.get_waiters.push(waiter);
            self.read_ahead(&vhost_name, &cmd.queue);
            return Ok(GetOutcome::Wait(wait));
        }
        let Some(entry) = queue.dequeue() else {
            return Ok(GetOutcome::Empty);
        };
        let Some(message) = entry.message.clone() else {
            return Ok(GetOutcome::Empty);
        };
        let message_count = queue.messages.len() as u32;
        let stores = queue.stores_messages();
        let channel = self.channel_mut(session, cmd.channel)?;
        let delivery_tag = channel.take_delivery_tag();
        let get_ok = pb::GetOk {
            delivery_tag,
            redelivered: entry.redelivered,
            exchange: message.exchange.clone(),
            routing_key: message.routing_key.clone(),
            message_count,
            properties: message.properties.clone(),
            body: message.body.clone(),
        };
        if cmd.no_ack {
            let mut ops = Vec::new();
            discard(
                &mut self.shared_refs,
                &vhost_name,
                &cmd.queue,
                stores,
                &entry,
                &mut ops,
            );
            self.persist.submit(ops, Durability::Logged, None);
        } else {
            channel.unacked.insert(
                delivery_tag,
                Unacked {
                    queue: cmd.queue.clone(),
                    message: entry,
                    consumer_tag: None,
                },
            );
        }
        self.read_ahead(&vhost_name, &cmd.queue);
        self.check_underfull(&vhost_name, &cmd.queue);
        Ok(GetOutcome::Got(get_ok))
    }

    pub fn ack(&mut self, session: SessionId, cmd: &pb::Ack) -> OpResult<()> {
        let vhost_name = self.session_vhost(session)?;
        let settled = self.settle(session, cmd.channel, cmd.delivery_tag, cmd.multiple)?;
        let mut ops = Vec::new();
        let mut touched = Vec::new();
        for unacked in settled {
            // A queue deleted meanwhile took its stored entries with it.
            let stores = self
                .queue_mut_opt(&vhost_name, &unacked.queue)
                .is_some_and(|queue| queue.stores_messages());
            discard(
                &mut self.shared_refs,
                &vhost_name,
                &unacked.queue,
                stores,
                &unacked.message,
                &mut ops,
            );
            if unacked.consumer_tag.is_some() {
                touched.push(unacked.queue);
            }
        }
        self.persist.submit(ops, Durability::Logged, None);
        self.dispatch_all(&vhost_name, touched);
        Ok(())
    }

    /// basic.nack and basic.reject: requeue, or drop.
    pub fn nack(&mut self, session: SessionId, cmd: &pb::Nack) -> OpResult<()> {
        let vhost_name = self.session_vhost(session)?;
        let settled = self.settle(session, cmd.channel, cmd.delivery_tag, cmd.multiple)?;
        let mut ops = Vec::new();
        let mut touched = Vec::new();
        for unacked in settled.into_iter().rev() {
            let Self {
                vhosts,
                shared_refs,
                ..
            } = self;
            let queue = vhosts
                .get_mut(&vhost_name)
                .and_then(|v| v.queues.get_mut(&unacked.queue));
            match queue {
                Some(queue) if cmd.requeue => queue.requeue(unacked.message),
                Some(queue) => {
                    let stores = queue.stores_messages();
                    discard(
                        shared_refs,
                        &vhost_name,
                        &unacked.queue,
                        stores,
                        &unacked.message,
                        &mut ops,
                    );
                }
                None => {
                    discard(
                        shared_refs,
                        &vhost_name,
                        &unacked.queue,
                        false,
                        &unacked.message,
                        &mut ops,
                    );
                    continue;
                }
            }
            touched.push(unacked.queue);
        }
        self.persist.submit(ops, Durability::Logged, None);
        self.dispatch_all(&vhost_name, touched);
        Ok(())
    }

    /// basic.recover: every unacked delivery of the channel goes back to its
    /// queue (redelivered), with or without `requeue` — the spec allows the
    /// server to requeue in both cases.
    ///
    /// Returns the queues to dispatch once recover-ok has been sent: clients
    /// (lapin) drop deliveries that arrive before it.
    pub fn recover(&mut self, session: SessionId, cmd: &pb::Recover) -> OpResult<Vec<String>> {
        let vhost_name = self.session_vhost(session)?;
        let channel = self.channel_mut(session, cmd.channel)?;
        let unacked = std::mem::take(&mut channel.unacked);
        for consumer in channel.consumers.values_mut() {
            consumer.unacked = 0;
        }
        let mut touched = Vec::new();
        let mut ops = Vec::new();
        for (_, entry) in unacked.into_iter().rev() {
            self.requeue_or_discard(&vhost_name, entry, &mut ops, &mut touched);
        }
        self.persist.submit(ops, Durability::Logged, None);
        Ok(touched)
    }

    /// Returns a delivery to its queue; if the queue is gone, lets go of
    /// what the store holds for it.
    fn requeue_or_discard(
        &mut self,
        vhost: &str,
        unacked: Unacked,
        ops: &mut Vec<WriteOp>,
        touched: &mut Vec<String>,
    ) {
        let Self {
            vhosts,
            shared_refs,
            ..
        } = self;
        match vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(&unacked.queue))
        {
            Some(queue) => {
                queue.requeue(unacked.message);
                touched.push(unacked.queue);
            }
            None => discard(
                shared_refs,
                vhost,
                &unacked.queue,
                false,
                &unacked.message,
                ops,
            ),
        }
    }

    /// Dispatches the given queues of the session's vhost.
    pub fn dispatch_queues(&mut self, session: SessionId, queues: Vec<String>) {
        if let Ok(vhost) = self.session_vhost(session) {
            self.dispatch_all(&vhost, queues);
        }
    }

    /// The gateway wrote `count` deliveries to its socket.
    pub fn deliveries_written(&mut self, session: SessionId, count: u32) {
        let Some(state) = self.sessions.get_mut(&session) else {
            return;
        };
        let was_starved = state.credit == 0;
        state.credit = state.credit.saturating_add(count).min(self.session_credit);
        if !was_starved {
            return;
        }
        let vhost = state.vhost.clone();
        let queues: Vec<String> = state
            .channels
            .values()
            .flat_map(|c| c.consumers.values().map(|consumer| consumer.queue.clone()))
            .collect();
        self.dispatch_all(&vhost, queues);
    }

    /// Removes the deliveries an ack/nack/reject names from the channel.
    fn settle(
        &mut self,
        session: SessionId,
        channel: ChannelId,
        tag: u64,
        multiple: bool,
    ) -> OpResult<Vec<Unacked>> {
        let state = self.channel_mut(session, channel)?;
        let tags: Vec<u64> = if multiple {
            let upto = if tag == 0 { u64::MAX } else { tag };
            state.unacked.range(..=upto).map(|(t, _)| *t).collect()
        } else if state.unacked.contains_key(&tag) {
            vec![tag]
        } else {
            Vec::new()
        };
        if tags.is_empty() && !(multiple && tag == 0) {
            return Err(errors::error(
                codes::PRECONDITION_FAILED,
                format!("unknown delivery tag {tag}"),
            ));
        }
        let mut settled = Vec::with_capacity(tags.len());
        for tag in tags {
            if let Some(entry) = state.unacked.remove(&tag) {
                if let Some(consumer) = entry
                    .consumer_tag
                    .as_ref()
                    .and_then(|t| state.consumers.get_mut(t))
                {
                    consumer.unacked = consumer.unacked.saturating_sub(1);
                }
                settled.push(entry);
            }
        }
        Ok(settled)
    }

    // ------------------------------------------------------------- dispatch

    fn dispatch_all(&mut self, vhost: &str, mut queues: Vec<String>) {
        queues.sort();
        queues.dedup();
        for queue in &queues {
            self.dispatch(vhost, queue);
        }
    }

    /// Hands ready messages to consumers with room, round robin. Stops at a
    /// message whose payload is still in the store: read-ahead brings it
    /// back and dispatches again.
    pub fn dispatch(&mut self, vhost_name: &str, queue_name: &str) {
        let Self {
            vhosts,
            sessions,
            persist,
            shared_refs,
            ..
        } = self;
        let Some(queue) = vhosts
            .get_mut(vhost_name)
            .and_then(|v| v.queues.get_mut(queue_name))
        else {
            return;
        };
        if queue.consumers.is_empty() {
            return;
        }
        let mut ops = Vec::new();
        while queue.messages.front().is_some_and(|m| m.message.is_some()) {
            let count = queue.consumers.len();
            let mut chosen = None;
            for step in 0..count {
                let index = (queue.next_consumer + step) % count;
                let consumer_ref = &queue.consumers[index];
                let Some(session) = sessions.get(&consumer_ref.session) else {
                    continue;
                };
                if session.credit == 0 {
                    continue;
                }
                let Some(channel) = session.channels.get(&consumer_ref.channel) else {
                    continue;
                };
                let Some(consumer) = channel.consumers.get(&consumer_ref.tag) else {
                    continue;
                };
                if channel.has_room(consumer) {
                    chosen = Some(index);
                    break;
                }
            }
            let Some(index) = chosen else {
                break;
            };
            queue.next_consumer = (index + 1) % count;
            let consumer_ref = queue.consumers[index].clone();
            let Some(entry) = queue.dequeue() else {
                break;
            };
            let Some(message) = entry.message.as_ref() else {
                break;
            };
            let Some(session) = sessions.get_mut(&consumer_ref.session) else {
                break;
            };
            session.credit -= 1;
            let Some(channel) = session.channels.get_mut(&consumer_ref.channel) else {
                break;
            };
            let delivery_tag = channel.take_delivery_tag();
            let no_ack = channel
                .consumers
                .get(&consumer_ref.tag)
                .is_none_or(|consumer| consumer.no_ack);
            let trace_context = message
                .trace
                .as_deref()
                .map(deliver_trace_context)
                .unwrap_or_default();
            let deliver = pb::Deliver {
                trace_context,
                channel: consumer_ref.channel,
                consumer_tag: consumer_ref.tag.clone(),
                delivery_tag,
                redelivered: entry.redelivered,
                exchange: message.exchange.clone(),
                routing_key: message.routing_key.clone(),
                properties: message.properties.clone(),
                body: message.body.clone(),
            };
            if no_ack {
                let stores = queue.stores_messages();
                discard(
                    shared_refs,
                    vhost_name,
                    queue_name,
                    stores,
                    &entry,
                    &mut ops,
                );
            } else {
                if let Some(consumer) = channel.consumers.get_mut(&consumer_ref.tag) {
                    consumer.unacked += 1;
                }
                channel.unacked.insert(
                    delivery_tag,
                    Unacked {
                        queue: queue_name.to_string(),
                        message: entry,
                        consumer_tag: Some(consumer_ref.tag.clone()),
                    },
                );
            }
            let _ = session.events.send(event(Event::Deliver(deliver)));
        }
        persist.submit(ops, Durability::Logged, None);
        self.read_ahead(vhost_name, queue_name);
        self.check_underfull(vhost_name, queue_name);
    }

    // -------------------------------------------------------------- helpers

    fn send(&self, session: SessionId, event_body: Event) {
        if let Some(state) = self.sessions.get(&session) {
            let _ = state.events.send(event(event_body));
        }
    }

    fn session_mut(&mut self, session: SessionId) -> OpResult<&mut SessionState> {
        self.sessions
            .get_mut(&session)
            .ok_or_else(|| errors::error(codes::CHANNEL_ERROR, "session not open"))
    }

    fn session_vhost(&self, session: SessionId) -> OpResult<String> {
        self.sessions
            .get(&session)
            .map(|s| s.vhost.clone())
            .ok_or_else(|| errors::error(codes::CHANNEL_ERROR, "session not open"))
    }

    fn channel_mut(
        &mut self,
        session: SessionId,
        channel: ChannelId,
    ) -> OpResult<&mut ChannelState> {
        self.session_mut(session)?
            .channels
            .get_mut(&channel)
            .ok_or_else(|| {
                errors::error(
                    codes::CHANNEL_ERROR,
                    format!("expected 'channel.open' on channel {channel}"),
                )
            })
    }

    fn vhost_mut(&mut self, name: &str) -> OpResult<&mut VHost> {
        self.vhosts
            .get_mut(name)
            .ok_or_else(|| errors::error(codes::NOT_ALLOWED, format!("vhost '{name}' not found")))
    }

    pub(crate) fn queue_mut_opt(&mut self, vhost: &str, queue: &str) -> Option<&mut Queue> {
        self.vhosts.get_mut(vhost)?.queues.get_mut(queue)
    }
}

/// The queues a message reaches from `exchange`, following exchange-to-
/// exchange bindings (each exchange visited once, so cycles end).
/// The engine's `deliver` span (in the trace of the message's publish) as it
/// hands a message to a consumer, and its context for the gateway.
fn deliver_trace_context(
    publish: &spillway_proto::trace::SpanContext,
) -> spillway_proto::trace::Carrier {
    let span = tracing::trace_span!(target: spillway_proto::trace::TARGET, "deliver");
    spillway_proto::trace::set_parent_and_links(&span, publish, &[]);
    spillway_proto::trace::carrier(&span)
}

fn route(vhost: &VHost, exchange: &Exchange, cmd: &pb::Publish) -> OpResult<Vec<String>> {
    if exchange.name.is_empty() {
        return Ok(if vhost.queues.contains_key(&cmd.routing_key) {
            vec![cmd.routing_key.clone()]
        } else {
            Vec::new()
        });
    }
    let mut headers: Option<Option<FieldTable>> = None;
    let mut targets = Vec::new();
    let mut visited = vec![exchange.name.as_str()];
    let mut pending = vec![exchange];
    while let Some(exchange) = pending.pop() {
        if exchange.kind == ExchangeKind::Headers && headers.is_none() {
            headers = Some(message_headers(&cmd.properties)?);
        }
        for binding in &exchange.bindings {
            let matched = match exchange.kind {
                ExchangeKind::Direct => binding.routing_key == cmd.routing_key,
                ExchangeKind::Fanout => true,
                ExchangeKind::Topic => topic_matches(&binding.routing_key, &cmd.routing_key),
                ExchangeKind::Headers => headers_match(
                    &binding.argument_table,
                    headers.as_ref().and_then(Option::as_ref),
                ),
            };
            if !matched {
                continue;
            }
            match &binding.destination {
                Destination::Queue(queue) => targets.push(queue.clone()),
                Destination::Exchange(next) => {
                    if visited.contains(&next.as_str()) {
                        continue;
                    }
                    if let Some(next) = vhost.exchanges.get(next) {
                        visited.push(next.name.as_str());
                        pending.push(next);
                    }
                }
            }
        }
    }
    targets.sort();
    targets.dedup();
    Ok(targets)
}

/// Reads and checks `x-max-length`, `x-max-length-bytes` and `x-overflow`.
fn queue_limits(arguments: &FieldTable, queue: &str, vhost: &str) -> OpResult<QueueLimits> {
    let invalid = |arg: &str| {
        errors::error(
            codes::PRECONDITION_FAILED,
            format!("invalid arg '{arg}' for queue '{queue}' in vhost '{vhost}'"),
        )
    };
    let count = |arg: &str| -> OpResult<Option<u64>> {
        match arguments.inner().get(arg) {
            None => Ok(None),
            Some(value) => match as_integer(value).map(u64::try_from) {
                Some(Ok(n)) => Ok(Some(n)),
                _ => Err(invalid(arg)),
            },
        }
    };
    let overflow = match arguments.inner().get("x-overflow") {
        None => Overflow::DropHead,
        Some(AMQPValue::LongString(s)) => match s.as_bytes() {
            b"drop-head" => Overflow::DropHead,
            b"reject-publish" => Overflow::RejectPublish,
            b"reject-publish-dlx" => Overflow::RejectPublishDlx,
            _ => return Err(invalid("x-overflow")),
        },
        Some(_) => return Err(invalid("x-overflow")),
    };
    // Qpid's producer flow control; 0 means no limit.
    let capacity = match count("x-qpid-capacity")? {
        Some(bytes) => Some(bytes),
        None => count("qpid.max_size")?,
    }
    .filter(|bytes| *bytes > 0);
    let resume_capacity = count("x-qpid-flow-resume-capacity")?;
    if let (Some(resume), Some(capacity)) = (resume_capacity, capacity) {
        if resume > capacity {
            return Err(errors::error(
                codes::PRECONDITION_FAILED,
                format!(
                    "x-qpid-flow-resume-capacity ({resume}) exceeds x-qpid-capacity ({capacity}) \
                     for queue '{queue}' in vhost '{vhost}'"
                ),
            ));
        }
    }
    Ok(QueueLimits {
        max_length: count("x-max-length")?,
        max_bytes: count("x-max-length-bytes")?,
        overflow,
        capacity,
        resume_capacity: capacity.map(|capacity| resume_capacity.unwrap_or(capacity)),
        max_count: count("qpid.max_count")?.filter(|count| *count > 0),
    })
}

/// The stored arguments of a recovered queue were checked when it was declared.
pub fn recovered_limits(arguments: &FieldTable) -> QueueLimits {
    queue_limits(arguments, "", "").unwrap_or_default()
}

/// The `headers` property of a message, for headers-exchange routing.
fn message_headers(properties: &[u8]) -> OpResult<Option<FieldTable>> {
    match amq_protocol::protocol::basic::parse_properties(properties) {
        Ok((_, parsed)) => Ok(parsed.headers().clone()),
        Err(_) => Err(errors::error(
            codes::SYNTAX_ERROR,
            "malformed message properties",
        )),
    }
}

fn find_queue<'a>(vhost: &'a VHost, name: &str, vhost_name: &str) -> OpResult<&'a Queue> {
    vhost.queues.get(name).ok_or_else(|| {
        errors::error(
            codes::NOT_FOUND,
            format!("no queue '{name}' in vhost '{vhost_name}'"),
        )
    })
}

fn find_queue_mut<'a>(
    vhost: &'a mut VHost,
    name: &str,
    vhost_name: &str,
) -> OpResult<&'a mut Queue> {
    vhost.queues.get_mut(name).ok_or_else(|| {
        errors::error(
            codes::NOT_FOUND,
            format!("no queue '{name}' in vhost '{vhost_name}'"),
        )
    })
}

fn find_exchange<'a>(vhost: &'a VHost, name: &str, vhost_name: &str) -> OpResult<&'a Exchange> {
    vhost.exchanges.get(name).ok_or_else(|| {
        errors::error(
            codes::NOT_FOUND,
            format!("no exchange '{name}' in vhost '{vhost_name}'"),
        )
    })
}

fn check_exclusive(queue: &Queue, session: SessionId, vhost_name: &str) -> OpResult<()> {
    match queue.exclusive_owner {
        Some(owner) if owner != session => Err(errors::error(
            codes::RESOURCE_LOCKED,
            format!(
                "cannot obtain exclusive access to locked queue '{}' in vhost '{}'",
                queue.name, vhost_name
            ),
        )),
        _ => Ok(()),
    }
}

fn default_exchange_refused() -> AmqpError {
    errors::error(
        codes::ACCESS_REFUSED,
        "operation not permitted on the default exchange",
    )
}

fn same_binding(a: &Binding, b: &Binding) -> bool {
    a.destination == b.destination
        && a.routing_key == b.routing_key
        && a.argument_table == b.argument_table
}

/// Producer flow-control limits can be changed at runtime (management), so
/// a redeclare with the arguments the queue was created with still succeeds
/// and keeps the current limits, as Qpid does.
const RUNTIME_ARGUMENTS: [&str; 4] = [
    "x-qpid-capacity",
    "qpid.max_size",
    "x-qpid-flow-resume-capacity",
    "qpid.max_count",
];

fn first_inequivalent_argument(current: &FieldTable, received: &FieldTable) -> Option<String> {
    let keys = current.inner().keys().chain(received.inner().keys());
    for key in keys {
        if RUNTIME_ARGUMENTS.contains(&key.as_str()) {
            continue;
        }
        let (a, b) = (current.inner().get(key), received.inner().get(key));
        if !equivalent_argument(a, b) {
            return Some(key.as_str().to_string());
        }
    }
    None
}

fn equivalent_argument(a: Option<&AMQPValue>, b: Option<&AMQPValue>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => values_equal(a, b),
        (None, None) => true,
        _ => false,
    }
}

fn binding_definition(vhost: &str, exchange: &str, binding: &Binding) -> store::BindingDefinition {
    store::BindingDefinition {
        vhost: vhost.to_string(),
        exchange: exchange.to_string(),
        queue: binding.destination.name().to_string(),
        routing_key: binding.routing_key.clone(),
        arguments: binding.arguments.clone(),
        to_exchange: matches!(binding.destination, Destination::Exchange(_)),
    }
}

fn op(op: write_op::Op) -> WriteOp {
    WriteOp { op: Some(op) }
}

pub fn event(event: Event) -> SessionEvent {
    SessionEvent { event: Some(event) }
}

/// A durable queue's entry as recovered at start-up: its payload stays in
/// the store until a consumer needs it.
pub fn recovered(entry: store::QueueEntry) -> QueuedMessage {
    QueuedMessage {
        id: entry.id,
        message: None,
        body_size: entry.body_size,
        redelivered: entry.redelivered,
        persistent: true,
        shared: false,
        loading: false,
    }
}
