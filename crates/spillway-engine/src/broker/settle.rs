//! Settling deliveries: ack, nack and reject (requeue or drop), recover, and
//! putting a delivery back on its queue (or letting it go when the queue is
//! gone).

use spillway_amqp::reply_code;
use spillway_proto::engine::{self as pb, AmqpError};
use spillway_proto::storage::{self as store, write_op, Durability, WriteOp};

use super::dead_letter::DeadLetterJob;
use super::{op, Broker, OpResult};
use crate::broker::flow_to_disk::discard;
use crate::model::*;
use crate::transaction::Settle;

impl Broker {
    pub fn ack(&mut self, session: SessionId, cmd: &pb::Ack) -> OpResult<()> {
        let vhost_name = self.session_vhost(session)?;
        let settled = self.settle(session, cmd.channel, cmd.delivery_tag, cmd.multiple)?;
        if self.in_tx(session, cmd.channel) {
            return self.tx_hold_settled(session, cmd.channel, settled, Settle::Ack);
        }
        let mut ops = Vec::new();
        let mut touched = Vec::new();
        let mut dead_letters = Vec::new();
        self.apply_settled(
            &vhost_name,
            settled,
            Settle::Ack,
            &mut ops,
            &mut touched,
            &mut dead_letters,
        );
        self.persist.submit(ops, Durability::Logged, None);
        self.dispatch_all(&vhost_name, touched);
        Ok(())
    }

    /// basic.nack and basic.reject: requeue (or dead-letter, reason
    /// `delivery_limit`, once the queue's delivery limit is reached), or
    /// drop (dead-letter, reason `rejected`, when the queue has a
    /// dead-letter exchange).
    pub fn nack(&mut self, session: SessionId, cmd: &pb::Nack) -> OpResult<()> {
        let vhost_name = self.session_vhost(session)?;
        let settled = self.settle(session, cmd.channel, cmd.delivery_tag, cmd.multiple)?;
        let action = Settle::Nack {
            requeue: cmd.requeue,
        };
        if self.in_tx(session, cmd.channel) {
            return self.tx_hold_settled(session, cmd.channel, settled, action);
        }
        let mut ops = Vec::new();
        let mut touched = Vec::new();
        let mut dead_letters = Vec::new();
        self.apply_settled(
            &vhost_name,
            settled,
            action,
            &mut ops,
            &mut touched,
            &mut dead_letters,
        );
        self.persist.submit(ops, Durability::Logged, None);
        touched.extend(self.dead_letter(&vhost_name, dead_letters));
        self.dispatch_all(&vhost_name, touched);
        Ok(())
    }

    /// Applies an ack or a nack to the deliveries it settled (at once, or
    /// at a transaction's commit): what the store must write goes to `ops`,
    /// queues to dispatch to `touched`, dead letters to `dead_letters`.
    pub(super) fn apply_settled(
        &mut self,
        vhost_name: &str,
        settled: Vec<Unacked>,
        action: Settle,
        ops: &mut Vec<WriteOp>,
        touched: &mut Vec<String>,
        dead_letters: &mut Vec<DeadLetterJob>,
    ) {
        let requeue = match action {
            Settle::Ack => {
                for unacked in settled {
                    // A queue deleted meanwhile took its stored entries with it.
                    let stores = self
                        .queue_mut_opt(vhost_name, &unacked.queue)
                        .is_some_and(|queue| queue.stores_messages());
                    discard(
                        &mut self.shared_refs,
                        vhost_name,
                        &unacked.queue,
                        stores,
                        &unacked.message,
                        ops,
                    );
                    if unacked.consumer_tag.is_some() {
                        touched.push(unacked.queue);
                    }
                }
                return;
            }
            Settle::Nack { requeue } => requeue,
        };
        for unacked in settled.into_iter().rev() {
            if requeue {
                self.return_delivery(vhost_name, unacked, ops, touched, dead_letters);
                continue;
            }
            let Self {
                vhosts,
                shared_refs,
                ..
            } = self;
            let queue = vhosts
                .get_mut(vhost_name)
                .and_then(|v| v.queues.get_mut(&unacked.queue));
            match queue {
                Some(queue) if queue.dead_letter.is_some() => {
                    dead_letters.push(DeadLetterJob {
                        queue: unacked.queue.clone(),
                        entry: unacked.message,
                        reason: DeathReason::Rejected,
                        release: true,
                    });
                }
                Some(queue) => {
                    queue
                        .dead_letter_counts
                        .count_discarded(DeathReason::Rejected);
                    let stores = queue.stores_messages();
                    discard(
                        shared_refs,
                        vhost_name,
                        &unacked.queue,
                        stores,
                        &unacked.message,
                        ops,
                    );
                }
                None => {
                    discard(
                        shared_refs,
                        vhost_name,
                        &unacked.queue,
                        false,
                        &unacked.message,
                        ops,
                    );
                    continue;
                }
            }
            touched.push(unacked.queue);
        }
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
        let mut dead_letters = Vec::new();
        for (_, entry) in unacked.into_iter().rev() {
            self.return_delivery(
                &vhost_name,
                entry,
                &mut ops,
                &mut touched,
                &mut dead_letters,
            );
        }
        self.persist.submit(ops, Durability::Logged, None);
        touched.extend(self.dead_letter(&vhost_name, dead_letters));
        Ok(touched)
    }

    /// Returns a delivery to its queue (requeued, or added to `dead_letters`
    /// once it has had as many deliveries as the queue allows); if the queue
    /// is gone, lets go of what the store holds for it.
    pub(super) fn return_delivery(
        &mut self,
        vhost: &str,
        unacked: Unacked,
        ops: &mut Vec<WriteOp>,
        touched: &mut Vec<String>,
        dead_letters: &mut Vec<DeadLetterJob>,
    ) {
        let limit = self
            .vhosts
            .get(vhost)
            .and_then(|v| v.queues.get(&unacked.queue))
            .and_then(|queue| self.max_deliveries(queue));
        let Self {
            vhosts,
            shared_refs,
            expiry,
            ..
        } = self;
        match vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(&unacked.queue))
        {
            Some(_)
                if limit.is_some_and(|max| u64::from(unacked.message.delivery_count) >= max) =>
            {
                dead_letters.push(DeadLetterJob {
                    queue: unacked.queue,
                    entry: unacked.message,
                    reason: DeathReason::DeliveryLimit,
                    release: true,
                });
            }
            Some(queue) => {
                let entry = &unacked.message;
                if entry.persistent && queue.stores_messages() {
                    // The redelivered flag and the count outlive a restart.
                    ops.push(op(write_op::Op::PutQueueEntry(store::QueueEntry {
                        vhost: vhost.to_string(),
                        queue: unacked.queue.clone(),
                        id: entry.id,
                        body_size: entry.body_size(),
                        redelivered: true,
                        delivery_count: entry.delivery_count,
                        expires_at_ms: entry.expires_at,
                        priority: u32::from(entry.priority),
                    })));
                }
                // Its expiry stands: one that passed while it was out
                // expires now (dispatch, basic.get or the timer).
                let expires_at = entry.expires_at;
                queue.requeue(unacked.message);
                if expires_at != 0 {
                    expiry.schedule(vhost, queue, expires_at.saturating_add(1));
                }
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

    /// Removes the deliveries an ack/nack/reject names from the channel.
    pub(super) fn settle(
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
            return Err(AmqpError::new(
                reply_code::PRECONDITION_FAILED,
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
}
