//! Settling deliveries: ack, nack and reject (requeue or drop), recover, and
//! putting a delivery back on its queue (or letting it go when the queue is
//! gone).

use spillway_proto::amqp::reply_code;
use spillway_proto::engine::{self as pb, AmqpError};
use spillway_proto::storage::{Durability, WriteOp};

use super::{Broker, OpResult};
use crate::flow::discard;
use crate::model::*;

impl Broker {
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
    pub(super) fn requeue_or_discard(
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
