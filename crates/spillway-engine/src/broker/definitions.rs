//! Definitions: declaring and deleting exchanges and queues, binding and
//! unbinding, purging. Durable definitions reach the store (synced) before
//! the client hears they happened.

use rand::distr::{Alphanumeric, SampleString};
use spillway_amqp::{self as amqp, reply_code};
use spillway_proto::engine::{self as pb, session_event::Event, AmqpError};
use spillway_proto::storage::{self as store, write_op, WriteOp};

use super::arguments::{
    check_exchange_arguments, check_queue_type, dead_letter_exchange_name, dead_letter_queue_name,
    dead_letter_target, delayed_type, dlq_enabled, first_inequivalent_argument,
    inequivalent_exchange_argument, max_priority, queue_limits, single_active_consumer,
};
use super::{
    check_exclusive, event, find_exchange, find_queue, find_queue_mut, op, Broker, OpResult,
};
use crate::broker::flow_to_disk::discard;
use crate::exchange::{Exchange, DELAYED_MESSAGE};
use crate::model::ExchangeKind;
use crate::model::*;
use crate::queue::Queue;
use crate::vhost::VHost;

impl Broker {
    pub fn declare_exchange(
        &mut self,
        session: SessionId,
        cmd: &pb::ExchangeDeclare,
    ) -> OpResult<()> {
        let vhost_name = self.session_vhost(session)?;
        if cmd.exchange.is_empty() {
            return Err(AmqpError::new(
                reply_code::ACCESS_REFUSED,
                "operation not permitted on the default exchange",
            ));
        }
        let vhost = self.vhost_mut(&vhost_name)?;
        if let Some(existing) = vhost.exchanges.get(&cmd.exchange) {
            if cmd.passive {
                return Ok(());
            }
            if existing.kind_name() != cmd.kind {
                return Err(AmqpError::new(
                    reply_code::PRECONDITION_FAILED,
                    format!(
                        "inequivalent arg 'type' for exchange '{}' in vhost '{}': received '{}' but current is '{}'",
                        cmd.exchange, vhost_name, cmd.kind, existing.kind_name()
                    ),
                ));
            }
            if existing.durable != cmd.durable && !existing.is_builtin() {
                return Err(inequivalent(
                    "durable",
                    "exchange",
                    &cmd.exchange,
                    &vhost_name,
                    cmd.durable,
                    existing.durable,
                ));
            }
            if existing.auto_delete != cmd.auto_delete && !existing.is_builtin() {
                return Err(inequivalent(
                    "auto_delete",
                    "exchange",
                    &cmd.exchange,
                    &vhost_name,
                    cmd.auto_delete,
                    existing.auto_delete,
                ));
            }
            let arguments = amqp::decode_table(&cmd.arguments)?;
            if let Some(key) = inequivalent_exchange_argument(&existing.arguments, &arguments) {
                return Err(AmqpError::new(
                    reply_code::PRECONDITION_FAILED,
                    format!(
                        "inequivalent arg '{key}' for exchange '{}' in vhost '{vhost_name}'",
                        cmd.exchange
                    ),
                ));
            }
            return Ok(());
        }
        if cmd.passive {
            return Err(AmqpError::new(
                reply_code::NOT_FOUND,
                format!("no exchange '{}' in vhost '{}'", cmd.exchange, vhost_name),
            ));
        }
        let delayed = cmd.kind == DELAYED_MESSAGE;
        let plain_kind = ExchangeKind::parse(&cmd.kind);
        if plain_kind.is_none() && !delayed {
            return Err(AmqpError::invalid_argument(
                reply_code::COMMAND_INVALID,
                format!("invalid exchange type '{}'", cmd.kind),
            ));
        }
        if cmd.exchange.starts_with("amq.") {
            return Err(AmqpError::new(
                reply_code::ACCESS_REFUSED,
                format!(
                    "exchange name '{}' contains reserved prefix 'amq.*'",
                    cmd.exchange
                ),
            ));
        }
        let arguments = amqp::decode_table(&cmd.arguments)?;
        check_exchange_arguments(&arguments, &cmd.exchange, &vhost_name)?;
        // A delayed exchange routes as its `x-delayed-type` once a message
        // is due.
        let kind = match plain_kind {
            Some(kind) => kind,
            None => delayed_type(&arguments)?,
        };
        self.admit_exchange(&vhost_name, &cmd.exchange)?;
        let mut exchange = Exchange::new(&cmd.exchange, kind, cmd.durable);
        exchange.auto_delete = cmd.auto_delete;
        exchange.internal = cmd.internal;
        exchange.arguments = arguments;
        exchange.delayed = delayed;
        if exchange.durable {
            self.persist.submit_synced(
                vec![op(write_op::Op::PutExchange(store::ExchangeDefinition {
                    vhost: vhost_name.clone(),
                    name: exchange.name.clone(),
                    kind: cmd.kind.clone(),
                    auto_delete: exchange.auto_delete,
                    internal: exchange.internal,
                    arguments: amqp::encode_table(&exchange.arguments),
                }))],
                None,
            );
        }
        let vhost = self.vhost_mut(&vhost_name)?;
        vhost.exchanges.insert(cmd.exchange.clone(), exchange);
        self.apply_policies_to_new_exchange(&vhost_name, &cmd.exchange);
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
            return Err(AmqpError::new(
                reply_code::ACCESS_REFUSED,
                format!("operation not permitted on exchange '{}'", cmd.exchange),
            ));
        }
        if cmd.if_unused && !exchange.bindings.is_empty() {
            return Err(AmqpError::new(
                reply_code::PRECONDITION_FAILED,
                format!(
                    "exchange '{}' in vhost '{}' in use",
                    cmd.exchange, vhost_name
                ),
            ));
        }
        self.remove_exchange(&vhost_name, &cmd.exchange);
        Ok(())
    }

    pub(crate) fn remove_exchange(&mut self, vhost_name: &str, name: &str) {
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
        if exchange.delayed {
            // What waited for it is dropped when due.
            self.delayed.forget(vhost_name, Some(name));
        }
    }

    // --------------------------------------------------------------- queues

    pub fn declare_queue(
        &mut self,
        session: SessionId,
        cmd: &pb::QueueDeclare,
    ) -> OpResult<pb::QueueDeclareOk> {
        let vhost_name = self.session_vhost(session)?;
        let reply_name_is_live = cmd.passive && self.reply_name_is_live(&cmd.queue);
        let vhost = self.vhost_mut(&vhost_name)?;
        let name = if cmd.queue.is_empty() {
            if cmd.passive {
                return Err(AmqpError::new(
                    reply_code::NOT_FOUND,
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
                    return Err(inequivalent(
                        "durable",
                        "queue",
                        &name,
                        &vhost_name,
                        cmd.durable,
                        existing.durable,
                    ));
                }
                if existing.exclusive_owner.is_some() != cmd.exclusive {
                    return Err(inequivalent(
                        "exclusive",
                        "queue",
                        &name,
                        &vhost_name,
                        cmd.exclusive,
                        existing.exclusive_owner.is_some(),
                    ));
                }
                if existing.auto_delete != cmd.auto_delete {
                    return Err(inequivalent(
                        "auto_delete",
                        "queue",
                        &name,
                        &vhost_name,
                        cmd.auto_delete,
                        existing.auto_delete,
                    ));
                }
                let arguments = amqp::decode_table(&cmd.arguments)?;
                if let Some(key) = first_inequivalent_argument(&existing.arguments, &arguments) {
                    return Err(AmqpError::new(
                        reply_code::PRECONDITION_FAILED,
                        format!(
                            "inequivalent arg '{key}' for queue '{name}' in vhost '{vhost_name}'"
                        ),
                    ));
                }
            }
            let ok = pb::QueueDeclareOk {
                message_count: existing.messages.len() as u32,
                consumer_count: existing.consumers.len() as u32,
                queue: name,
            };
            // A declare (passive too) is a use, for `x-expires`.
            self.touch_queue(&vhost_name, &ok.queue);
            return Ok(ok);
        }
        if reply_name_is_live {
            // A direct reply-to name whose client is there, as RabbitMQ
            // answers it.
            return Ok(pb::QueueDeclareOk {
                queue: name,
                message_count: 0,
                consumer_count: 1,
            });
        }
        if cmd.passive {
            return Err(AmqpError::new(
                reply_code::NOT_FOUND,
                format!("no queue '{name}' in vhost '{vhost_name}'"),
            ));
        }
        if name.starts_with("amq.") && !cmd.queue.is_empty() {
            return Err(AmqpError::new(
                reply_code::ACCESS_REFUSED,
                format!("queue name '{name}' contains reserved prefix 'amq.*'"),
            ));
        }
        let arguments = amqp::decode_table(&cmd.arguments)?;
        check_queue_type(
            &arguments,
            cmd.durable,
            cmd.exclusive,
            cmd.auto_delete,
            &name,
            &vhost_name,
        )?;
        let limits = queue_limits(&arguments, &name, &vhost_name)?;
        let dead_letter = dead_letter_target(&arguments, &name, &vhost_name)?;
        let single_active = single_active_consumer(&arguments, &name, &vhost_name)?;
        let max_priority = max_priority(&arguments, &name, &vhost_name)?;
        let qpid_dlq = dlq_enabled(&arguments) == Some(true);
        let mut new_queues = 1;
        if qpid_dlq {
            // `<queue>_DLQ` is created, or an existing one bound: never
            // another connection's exclusive queue.
            match vhost.queues.get(&dead_letter_queue_name(&name)) {
                Some(dlq) => check_exclusive(dlq, session, &vhost_name)?,
                None => new_queues += 1,
            }
        }
        self.admit_queue(session, &vhost_name, &name, new_queues)?;
        if qpid_dlq {
            self.admit_qpid_dlq_routing(&vhost_name, &name)?;
        }
        let mut queue = Queue::new(
            name.clone(),
            cmd.durable,
            cmd.auto_delete,
            cmd.exclusive.then_some(session),
        );
        queue.arguments = arguments;
        queue.limits = limits;
        queue.dead_letter = dead_letter;
        queue.single_active_consumer = single_active;
        queue.set_max_priority(max_priority);
        queue.created_by = Some(session);
        let durable = queue.durable;
        if queue.stores_messages() {
            self.persist.submit_synced(
                vec![op(write_op::Op::PutQueue(store::QueueDefinition {
                    vhost: vhost_name.clone(),
                    name: name.clone(),
                    auto_delete: queue.auto_delete,
                    arguments: amqp::encode_table(&queue.arguments),
                }))],
                None,
            );
        }
        let vhost = self.vhost_mut(&vhost_name)?;
        vhost.insert_queue(queue);
        self.apply_policies_to_queue(&vhost_name, &name);
        self.touch_queue(&vhost_name, &name);
        if qpid_dlq {
            self.ensure_qpid_dlq(session, &vhost_name, &name, durable);
        }
        // Every queue is bound to the default exchange by its name.
        Ok(pb::QueueDeclareOk {
            queue: name,
            message_count: 0,
            consumer_count: 0,
        })
    }

    /// `x-qpid-dlq-enabled` may add `<queue>_DLE` and its binding to
    /// `<queue>_DLQ`: each counts against the vhost's exchange and binding
    /// limits, as if the client had declared it.
    fn admit_qpid_dlq_routing(&self, vhost_name: &str, queue: &str) -> OpResult<()> {
        let exchange_name = dead_letter_exchange_name(queue);
        let Some(vhost) = self.vhosts.get(vhost_name) else {
            return Ok(());
        };
        match vhost.exchanges.get(&exchange_name) {
            None => {
                self.admit_exchange(vhost_name, &exchange_name)?;
                self.admit_binding(vhost_name)
            }
            Some(exchange) if !exchange.bindings.contains(&qpid_dlq_binding(queue)) => {
                self.admit_binding(vhost_name)
            }
            Some(_) => Ok(()),
        }
    }

    /// Qpid's `x-qpid-dlq-enabled`: `<queue>_DLE` (fanout) and `<queue>_DLQ`
    /// bound to it, durable when the queue is; what exists already is kept.
    fn ensure_qpid_dlq(
        &mut self,
        session: SessionId,
        vhost_name: &str,
        queue: &str,
        durable: bool,
    ) {
        let exchange_name = dead_letter_exchange_name(queue);
        let queue_name = dead_letter_queue_name(queue);
        let mut ops = Vec::new();
        let Some(vhost) = self.vhosts.get_mut(vhost_name) else {
            return;
        };
        if !vhost.exchanges.contains_key(&exchange_name) {
            let exchange = Exchange::new(&exchange_name, ExchangeKind::Fanout, durable);
            if durable {
                ops.push(op(write_op::Op::PutExchange(store::ExchangeDefinition {
                    vhost: vhost_name.to_string(),
                    name: exchange_name.clone(),
                    kind: ExchangeKind::Fanout.as_str().to_string(),
                    auto_delete: false,
                    internal: false,
                    arguments: amqp::encode_table(&exchange.arguments),
                })));
            }
            vhost.exchanges.insert(exchange_name.clone(), exchange);
            if let Some(exchange) = vhost.exchanges.get_mut(&exchange_name) {
                exchange.set_policy(vhost.policies.for_exchange(&exchange_name));
            }
        }
        let new_dlq = !vhost.queues.contains_key(&queue_name);
        if new_dlq {
            let mut dlq = Queue::new(queue_name.clone(), durable, false, None);
            dlq.created_by = Some(session);
            if durable {
                ops.push(op(write_op::Op::PutQueue(store::QueueDefinition {
                    vhost: vhost_name.to_string(),
                    name: queue_name.clone(),
                    auto_delete: false,
                    arguments: amqp::encode_table(&dlq.arguments),
                })));
            }
            vhost.insert_queue(dlq);
        }
        let binding = qpid_dlq_binding(queue);
        let exchange_durable = vhost
            .exchanges
            .get(&exchange_name)
            .is_some_and(|exchange| exchange.durable);
        let queue_durable = vhost
            .queues
            .get(binding.destination.name())
            .is_some_and(|queue| queue.stores_messages());
        if let Some(exchange) = vhost.exchanges.get_mut(&exchange_name) {
            if !exchange.bindings.contains(&binding) {
                if exchange_durable && queue_durable {
                    ops.push(op(write_op::Op::PutBinding(binding_definition(
                        vhost_name,
                        &exchange_name,
                        &binding,
                    ))));
                }
                exchange.bindings.insert(binding);
            }
        }
        if !ops.is_empty() {
            self.persist.submit_synced(ops, None);
        }
        if new_dlq {
            self.apply_policies_to_queue(vhost_name, &queue_name);
        }
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
    pub(super) fn check_destination(
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
    pub(super) fn binding_request(
        &mut self,
        session: SessionId,
        destination: Destination,
        source: &str,
        routing_key: &str,
        arguments: &bytes::Bytes,
    ) -> OpResult<(String, Binding, bool)> {
        let vhost_name = self.session_vhost(session)?;
        let arguments = amqp::decode_table(arguments)?;
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
            arguments,
        };
        Ok((vhost_name, binding, durable))
    }

    pub(super) fn bind(
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
            .is_some_and(|x| x.bindings.contains(&binding));
        if exists {
            return Ok(());
        }
        self.admit_binding(&vhost_name)?;
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
            exchange.bindings.insert(binding);
        }
        Ok(())
    }

    pub(super) fn unbind(
        &mut self,
        session: SessionId,
        destination: Destination,
        source: &str,
        routing_key: &str,
        arguments: &bytes::Bytes,
    ) -> OpResult<()> {
        // RabbitMQ answers unbind-ok when either end is already gone (an
        // auto-delete queue that went with its consumer, say): there is no
        // binding left to remove. The default exchange is still refused.
        let vhost_name = self.session_vhost(session)?;
        if source.is_empty() {
            return Err(default_exchange_refused());
        }
        let vhost = self.vhost_mut(&vhost_name)?;
        let destination_gone = match &destination {
            Destination::Queue(name) => !vhost.queues.contains_key(name),
            Destination::Exchange(name) => !name.is_empty() && !vhost.exchanges.contains_key(name),
        };
        let source_gone = !vhost.exchanges.contains_key(source);
        if destination_gone || source_gone {
            amqp::decode_table(arguments)?;
            return Ok(());
        }
        let (vhost_name, probe, durable) =
            self.binding_request(session, destination, source, routing_key, arguments)?;
        let vhost = self.vhost_mut(&vhost_name)?;
        let Some(exchange) = vhost.exchanges.get_mut(source) else {
            return Ok(());
        };
        let Some(removed) = exchange.bindings.remove(&probe) else {
            return Ok(());
        };
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
        // A client's purge waits for it (`Session::wait_for_recovery`);
        // management's is refused.
        if queue.recovering {
            return Err(still_recovering(&cmd.queue, &vhost_name));
        }
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
        // Synced: a purge answered is a purge a crash does not undo.
        self.persist.submit_synced(ops, None);
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
            return Err(AmqpError::new(
                reply_code::PRECONDITION_FAILED,
                format!("queue '{}' in vhost '{}' in use", cmd.queue, vhost_name),
            ));
        }
        if cmd.if_empty && queue.recovering {
            return Err(still_recovering(&cmd.queue, &vhost_name));
        }
        if cmd.if_empty && !queue.messages.is_empty() {
            return Err(AmqpError::new(
                reply_code::PRECONDITION_FAILED,
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
    pub(crate) fn remove_queue(&mut self, vhost_name: &str, name: &str) {
        let Some(vhost) = self.vhosts.get_mut(vhost_name) else {
            return;
        };
        let Some(queue) = vhost.remove_queue(name) else {
            return;
        };
        if queue.recovering {
            self.abandon_recovery(vhost_name, name);
        }
        let Some(vhost) = self.vhosts.get_mut(vhost_name) else {
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
        for entry in queue.messages.iter() {
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

    /// Deletes an auto-delete queue whose last consumer has gone (cancelled,
    /// or its channel closed). A queue that never had a consumer is kept:
    /// RabbitMQ's rule, so that a basic.get client that disconnects with
    /// unacked messages finds them requeued, not deleted.
    pub(super) fn auto_delete_if_unused(&mut self, vhost_name: &str, name: &str) {
        let unused = self
            .queue_mut_opt(vhost_name, name)
            .is_some_and(|q| q.auto_delete && q.had_consumers && q.consumers.is_empty());
        if unused {
            self.remove_queue(vhost_name, name);
        }
    }
}

/// What a queue whose stored messages are still being read at start-up
/// answers where it cannot wait.
pub(crate) fn still_recovering(queue: &str, vhost: &str) -> AmqpError {
    AmqpError::new(
        reply_code::RESOURCE_LOCKED,
        format!("queue '{queue}' in vhost '{vhost}' is still being recovered, try again"),
    )
}

fn inequivalent(
    arg: &str,
    kind: &str,
    name: &str,
    vhost: &str,
    received: bool,
    current: bool,
) -> AmqpError {
    AmqpError::new(
        reply_code::PRECONDITION_FAILED,
        format!(
            "inequivalent arg '{arg}' for {kind} '{name}' in vhost '{vhost}': received '{received}' but current is '{current}'"
        ),
    )
}

fn default_exchange_refused() -> AmqpError {
    AmqpError::new(
        reply_code::ACCESS_REFUSED,
        "operation not permitted on the default exchange",
    )
}

fn binding_definition(vhost: &str, exchange: &str, binding: &Binding) -> store::BindingDefinition {
    store::BindingDefinition {
        vhost: vhost.to_string(),
        exchange: exchange.to_string(),
        queue: binding.destination.name().to_string(),
        routing_key: binding.routing_key.clone(),
        arguments: amqp::encode_table(&binding.arguments),
        to_exchange: matches!(binding.destination, Destination::Exchange(_)),
    }
}

/// The binding `x-qpid-dlq-enabled` makes from `<queue>_DLE` to `<queue>_DLQ`.
fn qpid_dlq_binding(queue: &str) -> Binding {
    Binding {
        destination: Destination::Queue(dead_letter_queue_name(queue)),
        routing_key: String::new(),
        arguments: Default::default(),
    }
}
