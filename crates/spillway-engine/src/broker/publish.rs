//! basic.publish: route the message, hand it to every queue it reaches
//! (within their length limits), write what must be stored, and tell the
//! session when to confirm.

use spillway_amqp::reply_code;
use spillway_proto::engine::{self as pb, session_event::Event, AmqpError};
use std::sync::Arc;

use spillway_proto::storage::{self as store, write_op, Durability, WriteOp};
use tokio::sync::oneshot;

use super::dead_letter::DeadLetterJob;
use super::direct_reply::ReplyOutcome;
use super::{find_exchange, op, Broker, OpResult};
use crate::broker::flow_to_disk::discard;
use crate::model::*;
use crate::routing::route;
use crate::vhost::VHost;

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
    /// Whether `cmd` would reach a queue now (management's publish answers
    /// `routed`, as RabbitMQ's HTTP API does).
    pub(crate) fn routes_anywhere(&self, vhost_name: &str, cmd: &pb::Publish) -> OpResult<bool> {
        let vhost = self.vhosts.get(vhost_name).ok_or_else(|| {
            AmqpError::new(
                reply_code::NOT_ALLOWED,
                format!("vhost '{vhost_name}' not found"),
            )
        })?;
        Ok(!publish_targets(vhost, vhost_name, cmd)?.is_empty())
    }
}

/// The queues `cmd` reaches from its exchange: what a publish routes to,
/// now or (in a transaction) at commit. An internal exchange refuses it.
pub(super) fn publish_targets(
    vhost: &VHost,
    vhost_name: &str,
    cmd: &pb::Publish,
) -> OpResult<Vec<String>> {
    let exchange = find_exchange(vhost, &cmd.exchange, vhost_name)?;
    if exchange.internal {
        return Err(AmqpError::new(
            reply_code::ACCESS_REFUSED,
            format!("cannot publish to internal exchange '{}'", cmd.exchange),
        ));
    }
    route(vhost, exchange, cmd)
}

impl Broker {
    pub fn publish(
        &mut self,
        session: SessionId,
        mut cmd: pb::Publish,
    ) -> OpResult<PublishOutcome> {
        // Direct reply-to: a reply goes straight to its client, and a
        // request gets its channel's reply-to name.
        match self.deliver_reply(&cmd) {
            ReplyOutcome::NotAReply => {}
            ReplyOutcome::Handled => return Ok(PublishOutcome::Done),
            ReplyOutcome::NoRoute => {
                if cmd.mandatory {
                    self.send(session, no_route(cmd));
                }
                return Ok(PublishOutcome::Done);
            }
        }
        self.resolve_reply_to(session, &mut cmd)?;
        let vhost_name = self.session_vhost(session)?;
        if let Some(delay_ms) = self.publish_delay(&vhost_name, &cmd)? {
            if self.in_tx(session, cmd.channel) {
                return Err(AmqpError::new(
                    reply_code::NOT_IMPLEMENTED,
                    "delayed messages cannot be published in a transaction",
                ));
            }
            return self.publish_delayed(session, &vhost_name, cmd, delay_ms);
        }
        if self.in_tx(session, cmd.channel) {
            // Held until tx.commit (`tx.rs`).
            return self.tx_publish(session, cmd).map(|()| PublishOutcome::Done);
        }
        // Read (and a bad one refused) by the gateway.
        let message_ttl = cmd.expiration_ms;
        let store_failure = self.alarms.store_failure().map(str::to_string);
        let vhost = self.vhost_mut(&vhost_name)?;
        let targets = publish_targets(vhost, &vhost_name, &cmd)?;
        let confirm_seq = cmd.confirm_seq;
        let channel = cmd.channel;
        if targets.is_empty() {
            if cmd.mandatory {
                self.send(session, no_route(cmd));
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
        let body = cmd.body();
        let message = Message::new(
            &self.budget,
            cmd.exchange,
            cmd.routing_key,
            cmd.properties,
            body,
            cmd.persistent,
        );
        let mut ops = Vec::new();
        let now = self.clock.unix_millis();
        let enqueued = self.enqueue_routed(
            &vhost_name,
            &targets,
            &message,
            id,
            (now, message_ttl),
            &mut ops,
            true,
        );
        if let Some(index) = enqueued.paced {
            self.note_paced(session, &targets[index]);
        }
        let rejected = enqueued.rejected;
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
        // After the publish's own write: a dead letter's batch deletes
        // what it held.
        let dead_lettered = self.dead_letter(&vhost_name, enqueued.dead_letters);
        if !self.flow_active && self.budget.over_threshold() {
            // Turned on here, not by waking the housekeeping task: under
            // load the task may run late, and every publish until then would
            // stay resident over the threshold.
            self.housekeeping();
        }
        let mut dead_lettered = dead_lettered;
        for name in &targets {
            self.spill_arrival(&vhost_name, name, id);
            self.dispatch_at(&vhost_name, name, now);
            if enqueued.zero_ttl {
                // TTL 0: delivered at once to a consumer that could take
                // it, else expired now (if it is the head; behind others
                // it expires when it gets there).
                dead_lettered.extend(self.expire_head(&vhost_name, name, now.saturating_add(1)));
            }
            self.after_publish(session, channel, &vhost_name, name);
        }
        self.dispatch_all(&vhost_name, dead_lettered);
        self.note_producer(session);
        if stored_now {
            self.note_persistent_producer(session);
        }
        Ok(outcome)
    }
}

/// What handing a message to its queues did.
#[derive(Default)]
pub(super) struct Enqueued {
    /// A queue's `reject-publish` (or `reject-publish-dlx`) limit refused it.
    pub rejected: bool,
    /// To dead-letter (reason `maxlen`): what drop-head queues with a
    /// dead-letter exchange pushed out, and the message itself where a
    /// `reject-publish-dlx` queue refused it.
    pub dead_letters: Vec<DeadLetterJob>,
    /// A queue holds it with a TTL of 0: deliver it at once or expire it.
    pub zero_ttl: bool,
    /// With `pace`: the index in the targets of a queue whose publisher
    /// pacing credit this message spent the last of.
    pub paced: Option<usize>,
}

impl Broker {
    /// Hands message `id`, routed to `targets`, to each of them within its
    /// length limits, adding what the store must write to `ops`. The one
    /// path for publishes and dead letters. `(now, message_ttl)`: when it is
    /// enqueued (ms since the epoch) and its `expiration`, from which (and
    /// each queue's `x-message-ttl`) its expiry in each queue is fixed.
    /// `pace`: a publisher's message, which spends the publisher pacing
    /// credit of the queues with consumers (`pacing.rs`); dead letters do
    /// not.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn enqueue_routed(
        &mut self,
        vhost_name: &str,
        targets: &[String],
        message: &Arc<Message>,
        id: u64,
        (now, message_ttl): (u64, Option<u64>),
        ops: &mut Vec<WriteOp>,
        pace: bool,
    ) -> Enqueued {
        let mut enqueued = Enqueued::default();
        let mut holders = 0u32;
        let shared = targets.len() > 1;
        let pace = pace && self.pacing.window > 0;
        let Self {
            vhosts,
            shared_refs,
            expiry,
            ..
        } = self;
        let Some(vhost) = vhosts.get_mut(vhost_name) else {
            return enqueued;
        };
        for (index, name) in targets.iter().enumerate() {
            let Some(queue) = vhost.queues.get_mut(name) else {
                continue;
            };
            let body_len = message.body.size();
            if queue.limits.overflow != Overflow::DropHead && queue.would_overflow(body_len) {
                enqueued.rejected = true;
                if queue.limits.overflow == Overflow::RejectPublishDlx
                    && queue.dead_letter.is_some()
                {
                    enqueued.dead_letters.push(DeadLetterJob {
                        queue: name.clone(),
                        entry: QueuedMessage::resident(id, message.clone()),
                        reason: DeathReason::Maxlen,
                        release: false,
                    });
                }
                continue;
            }
            let stores = queue.stores_messages();
            let priority = queue.priority_of(&message.properties);
            let expires_at = super::expiry::expires_at(now, message_ttl, queue.limits.message_ttl);
            if expires_at == now {
                enqueued.zero_ttl = true;
            }
            if message.persistent && stores {
                if message.stored_seq() == 0 {
                    ops.push(op(write_op::Op::PutMessage(message.record(id))));
                    message.mark_stored(u64::MAX);
                }
                ops.push(op(write_op::Op::PutQueueEntry(store::QueueEntry {
                    vhost: vhost_name.to_string(),
                    queue: name.clone(),
                    id,
                    body_size: body_len,
                    redelivered: false,
                    delivery_count: 0,
                    expires_at_ms: expires_at,
                    priority: u32::from(priority),
                })));
            }
            let mut entry = QueuedMessage::resident(id, message.clone());
            entry.priority = priority;
            entry.shared = shared;
            entry.expires_at = expires_at;
            holders += 1;
            if pace && !queue.consumers.is_empty() && queue.pacing.spend() {
                enqueued.paced.get_or_insert(index);
            }
            let dropped = queue.enqueue(entry);
            if expires_at != 0 {
                expiry.schedule(vhost_name, queue, expires_at.saturating_add(1));
            }
            let dead_letters = queue.dead_letter.is_some();
            for entry in dropped {
                if dead_letters {
                    enqueued.dead_letters.push(DeadLetterJob {
                        queue: name.clone(),
                        entry,
                        reason: DeathReason::Maxlen,
                        release: true,
                    });
                } else {
                    queue
                        .dead_letter_counts
                        .count_discarded(DeathReason::Maxlen);
                    discard(shared_refs, vhost_name, name, stores, &entry, ops);
                }
            }
        }
        if holders > 1 {
            shared_refs.insert(id, holders);
        }
        enqueued
    }
}

/// The `basic.return` of a mandatory message no queue took, its body as
/// published (compressed or not).
pub(super) fn no_route(cmd: pb::Publish) -> Event {
    Event::Returned(pb::Return {
        channel: cmd.channel,
        reply_code: u32::from(reply_code::NO_ROUTE),
        reply_text: "NO_ROUTE".to_string(),
        exchange: cmd.exchange,
        routing_key: cmd.routing_key,
        properties: cmd.properties,
        body: cmd.body,
        body_encoding: cmd.body_encoding,
        body_size: cmd.body_size,
    })
}
