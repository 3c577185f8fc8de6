//! basic.publish: route the message, hand it to every queue it reaches
//! (within their length limits), write what must be stored, and tell the
//! session when to confirm.

use spillway_proto::amqp::reply_code;
use spillway_proto::engine::{self as pb, session_event::Event, AmqpError};
use spillway_proto::storage::{self as store, write_op, Durability};
use tokio::sync::oneshot;

use super::{find_exchange, op, Broker, OpResult};
use crate::flow::discard;
use crate::model::*;
use crate::routing::route;

/// What publishing did, for the session to confirm.
pub enum PublishOutcome {
    /// Nothing to wait for.
    Done,
    /// Confirm once this fires: the message is on disk (or nack: the
    /// store failed it).
    AfterWrite(oneshot::Receiver<crate::persistence::WriteOutcome>),
    /// A queue's `x-overflow: reject-publish` refused it: nack the publisher.
    Rejected,
}

impl Broker {
    pub fn publish(&mut self, session: SessionId, cmd: pb::Publish) -> OpResult<PublishOutcome> {
        let vhost_name = self.session_vhost(session)?;
        let store_failure = self.store_failure.clone();
        let vhost = self.vhost_mut(&vhost_name)?;
        let exchange = find_exchange(vhost, &cmd.exchange, &vhost_name)?;
        if exchange.internal {
            return Err(AmqpError::new(
                reply_code::ACCESS_REFUSED,
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
                        reply_code: u32::from(reply_code::NO_ROUTE),
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
        if let Some(failure) = store_failure {
            let stored = cmd.persistent
                && targets.iter().any(|name| {
                    vhost
                        .queues
                        .get(name)
                        .is_some_and(|queue| queue.stores_messages())
                });
            if stored {
                // Refused before it touches any queue: the publisher hears
                // it at once, and is blocked like the disk quota's.
                self.note_persistent_producer(session);
                if confirm_seq > 0 {
                    return Ok(PublishOutcome::Rejected);
                }
                return Err(AmqpError::new(
                    reply_code::RESOURCE_ERROR,
                    format!(
                        "store failure ({failure}): persistent messages to durable queues \
                         are refused until it clears"
                    ),
                ));
            }
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
            AmqpError::new(
                reply_code::NOT_ALLOWED,
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
        if stored_now {
            self.note_persistent_producer(session);
        }
        Ok(outcome)
    }
}
