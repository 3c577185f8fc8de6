//! AMQP transactions (`tx.select`, `tx.commit`, `tx.rollback`) and Qpid's
//! producer transaction timeouts. See docs/transactions.md.
//!
//! A channel in transactional mode holds its work in a [`Transaction`]
//! until commit:
//!
//! - publishes are routed when they arrive (an unknown exchange fails
//!   then), and their message is made then, counted in the memory budget,
//!   but no queue sees it until commit;
//! - acks, nacks and rejects take their deliveries off the channel (the tag
//!   is settled, prefetch room freed) and are held.
//!
//! Commit applies all of it under the broker lock: every publish is
//! enqueued (ids given out now, in order) and every held settle applied, and
//! what the store must write for all of them — persistent messages, their
//! queue entries, the acks' deletes — goes to the store writer as one
//! request, which is never split: one RocksDB batch, synced. The session
//! answers commit-ok once that write has landed. Rollback drops the
//! publishes and returns the held deliveries to their queues (redelivered;
//! a delivery attempt, as Qpid counts it). Closing the channel or the
//! connection rolls back.
//!
//! Timeouts: one timer for the whole broker ([`Broker::check_transactions`],
//! run by the engine's transaction task) looks at the channels whose
//! transaction is open: `open` counts from its first publish or ack,
//! `idle` from its last one. Warnings (`CHN-1007`, `CHN-1008`) repeat once
//! per warn period; a close sends the connection `connection.close` 506.

use std::sync::Arc;
use std::time::{Duration, Instant};

use spillway_amqp::reply_code;
use spillway_proto::engine::{self as pb, session_event::Event, AmqpError};
use spillway_proto::management as m;
use spillway_proto::storage::Durability;

use super::{Broker, OpResult};
use crate::format::thousands;
use crate::model::*;
use crate::transaction::*;

/// Why the timer closes a connection.
#[derive(Clone, Copy)]
enum Expired {
    Open,
    Idle,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Broker {
    /// Whether `channel` is transactional.
    pub(super) fn in_tx(&self, session: SessionId, channel: ChannelId) -> bool {
        self.sessions
            .get(&session)
            .and_then(|s| s.channels.get(&channel))
            .is_some_and(|c| c.tx.is_some())
    }

    fn tx_mut(&mut self, session: SessionId, channel: ChannelId) -> OpResult<&mut Transaction> {
        self.channel_mut(session, channel)?
            .tx
            .as_mut()
            .ok_or_else(|| {
                AmqpError::new(
                    reply_code::PRECONDITION_FAILED,
                    "channel is not transactional",
                )
            })
    }

    /// Notes a publish or ack in the channel's transaction.
    fn tx_touch(&mut self, session: SessionId, channel: ChannelId) {
        let vhost = self.session_vhost(session).unwrap_or_default();
        let now = self.clock.now();
        let opened = match self.tx_mut(session, channel) {
            Ok(tx) => tx.touch(now),
            Err(_) => return,
        };
        if opened {
            self.tx.open.insert((session, channel));
            if self.tx.timeouts(&vhost).any() {
                self.tx.wake.notify_one();
            }
        }
    }

    pub fn tx_select(&mut self, session: SessionId, channel: ChannelId) -> OpResult<()> {
        let state = self.channel_mut(session, channel)?;
        if state.confirm {
            return Err(AmqpError::new(
                reply_code::PRECONDITION_FAILED,
                "cannot switch from confirm to tx mode",
            ));
        }
        if state.tx.is_none() {
            state.tx = Some(Transaction::default());
        }
        Ok(())
    }

    /// basic.publish on a transactional channel: routed now, held until
    /// commit.
    pub(super) fn tx_publish(&mut self, session: SessionId, cmd: pb::Publish) -> OpResult<()> {
        let vhost_name = self.session_vhost(session)?;
        let message_ttl = cmd.expiration_ms;
        let vhost = self.vhost_mut(&vhost_name)?;
        let targets = super::publish::publish_targets(vhost, &vhost_name, &cmd)?;
        let channel = cmd.channel;
        let max_bytes = self.tx.config.max_bytes;
        // Counted as the memory budget counts it (and close to what the
        // commit's store batch carries): body, properties, names and a
        // fixed overhead.
        let size =
            (cmd.exchange.len() + cmd.routing_key.len() + cmd.properties.len() + cmd.body.len())
                as u64
                + crate::budget::MESSAGE_OVERHEAD_BYTES;
        let held = self.tx_mut(session, channel)?.bytes;
        if held.saturating_add(size) > max_bytes {
            return Err(AmqpError::new(
                reply_code::PRECONDITION_FAILED,
                format!(
                    "transaction too large: {} bytes held and {} more would pass \
                     engine.max_transaction_bytes ({} bytes); commit more often",
                    thousands(held),
                    thousands(size),
                    thousands(max_bytes)
                ),
            ));
        }
        self.tx_touch(session, channel);
        if targets.is_empty() {
            if cmd.mandatory {
                if self.tx.config.close_when_no_route {
                    let reason = format!(
                        "No route for message with exchange '{}' and routing key '{}' \
                         in a transaction",
                        cmd.exchange, cmd.routing_key
                    );
                    tracing::info!(
                        session,
                        channel,
                        vhost = %vhost_name,
                        exchange = %cmd.exchange,
                        routing_key = %cmd.routing_key,
                        "unroutable mandatory message in a transaction: closing the connection"
                    );
                    self.close_connection(session, reply_code::NO_ROUTE, reason);
                    return Ok(());
                }
                self.send(session, super::publish::no_route(cmd));
            }
            return Ok(());
        }
        // Held as published: compressed when the gateway compressed it.
        let body = cmd.body();
        let message = Message::new(
            &self.budget,
            cmd.exchange,
            cmd.routing_key,
            cmd.properties,
            body,
            cmd.persistent,
        );
        let tx = self.tx_mut(session, channel)?;
        tx.bytes += size;
        tx.publishes.push(HeldPublish {
            targets,
            message,
            message_ttl,
        });
        self.note_producer(session);
        Ok(())
    }

    /// Holds deliveries acked, nacked or rejected on a transactional
    /// channel until commit. Their consumers' prefetch room is free again.
    pub(super) fn tx_hold_settled(
        &mut self,
        session: SessionId,
        channel: ChannelId,
        unacked: Vec<Unacked>,
        action: Settle,
    ) -> OpResult<()> {
        let vhost = self.session_vhost(session)?;
        self.tx_touch(session, channel);
        let touched: Vec<String> = unacked
            .iter()
            .filter(|u| u.consumer_tag.is_some())
            .map(|u| u.queue.clone())
            .collect();
        if !unacked.is_empty() {
            self.tx_mut(session, channel)?
                .settles
                .push(HeldSettle { unacked, action });
        }
        self.dispatch_all(&vhost, touched);
        Ok(())
    }

    /// tx.commit: applies the transaction's work. Everything the store must
    /// write goes in one synced request (one batch); the session answers
    /// commit-ok once it has landed.
    pub fn tx_commit(&mut self, session: SessionId, channel: ChannelId) -> OpResult<()> {
        let vhost_name = self.session_vhost(session)?;
        let work = self.tx_mut(session, channel)?.take();
        self.tx.open.remove(&(session, channel));
        if let Some(failure) = self.alarms.store_failure().map(str::to_string) {
            if work.publishes.iter().any(|p| p.message.persistent) {
                let touched = self.tx_undo(&vhost_name, work);
                self.dispatch_all(&vhost_name, touched);
                return Err(AmqpError::new(
                    reply_code::RESOURCE_ERROR,
                    format!(
                        "store failure ({failure}): the transaction was rolled back, \
                         persistent messages are refused until it clears"
                    ),
                ));
            }
        }
        let now = self.clock.unix_millis();
        let mut ops = Vec::new();
        let mut dead_letters = Vec::new();
        let mut zero_ttl = Vec::new();
        let mut published = Vec::with_capacity(work.publishes.len());
        for held in work.publishes {
            let id = self.next_message_id;
            self.next_message_id += 1;
            let enqueued = self.enqueue_routed(
                &vhost_name,
                &held.targets,
                &held.message,
                id,
                (now, held.message_ttl),
                &mut ops,
                true,
            );
            if let Some(index) = enqueued.paced {
                // Paced at commit: the session waits after commit-ok.
                self.note_paced(session, &held.targets[index]);
            }
            dead_letters.extend(enqueued.dead_letters);
            if enqueued.zero_ttl {
                zero_ttl.extend(held.targets.iter().cloned());
            }
            published.push((id, held.targets, held.message));
        }
        let mut touched = Vec::new();
        for held in work.settles {
            self.apply_settled(
                &vhost_name,
                held.unacked,
                held.action,
                &mut ops,
                &mut touched,
                &mut dead_letters,
            );
        }
        let stored: Vec<&Arc<Message>> = published
            .iter()
            .map(|(_, _, message)| message)
            .filter(|message| message.stored_seq() != 0)
            .collect();
        if !ops.is_empty() {
            let seq = self.persist.submit(ops, Durability::Synced, None);
            for message in &stored {
                message.mark_stored(seq);
            }
        }
        let stored_any = !stored.is_empty();
        // After the commit's own write: a dead letter's batch deletes what
        // it held.
        touched.extend(self.dead_letter(&vhost_name, dead_letters));
        if !self.flow_active && self.budget.over_threshold() {
            self.housekeeping();
        }
        for (id, targets, message) in published {
            drop(message);
            for name in &targets {
                self.spill_arrival(&vhost_name, name, id);
                self.dispatch_at(&vhost_name, name, now);
                self.after_publish(session, channel, &vhost_name, name);
            }
        }
        zero_ttl.sort();
        zero_ttl.dedup();
        for name in &zero_ttl {
            touched.extend(self.expire_head(&vhost_name, name, now.saturating_add(1)));
        }
        self.dispatch_all(&vhost_name, touched);
        if stored_any {
            self.note_persistent_producer(session);
        }
        Ok(())
    }

    /// tx.rollback: drops the held publishes and returns the held
    /// deliveries to their queues. Returns the queues to dispatch once
    /// rollback-ok has been sent.
    pub fn tx_rollback(&mut self, session: SessionId, channel: ChannelId) -> OpResult<Vec<String>> {
        let vhost_name = self.session_vhost(session)?;
        let work = self.tx_mut(session, channel)?.take();
        self.tx.open.remove(&(session, channel));
        Ok(self.tx_undo(&vhost_name, work))
    }

    /// Undoes a transaction's work: publishes dropped (their bytes leave
    /// the budget), held deliveries back on their queues, redelivered (or
    /// dead-lettered once at their delivery limit). Returns the queues to
    /// dispatch.
    pub(super) fn tx_undo(&mut self, vhost: &str, work: Transaction) -> Vec<String> {
        drop(work.publishes);
        let mut ops = Vec::new();
        let mut touched = Vec::new();
        let mut dead_letters = Vec::new();
        for held in work.settles.into_iter().rev() {
            for unacked in held.unacked.into_iter().rev() {
                self.return_delivery(vhost, unacked, &mut ops, &mut touched, &mut dead_letters);
            }
        }
        self.persist.submit(ops, Durability::Logged, None);
        touched.extend(self.dead_letter(vhost, dead_letters));
        touched
    }

    /// A closing channel's transaction: rolled back.
    pub(super) fn tx_close(
        &mut self,
        session: SessionId,
        channel: ChannelId,
        vhost: &str,
        tx: Option<Transaction>,
    ) -> Vec<String> {
        self.tx.open.remove(&(session, channel));
        match tx {
            Some(work) => self.tx_undo(vhost, work),
            None => Vec::new(),
        }
    }

    /// Tells the gateway to close the session's connection with `code`.
    pub(crate) fn close_connection(&self, session: SessionId, code: u16, reason: String) {
        self.send(
            session,
            Event::ConnectionClose(pb::ConnectionClose {
                reason,
                reply_code: u32::from(code),
            }),
        );
    }

    /// Management's SetTransactionTimeouts.
    pub fn set_transaction_timeouts(
        &mut self,
        request: &m::SetTransactionTimeoutsRequest,
    ) -> OpResult<m::TransactionTimeouts> {
        if !self.vhosts.contains_key(&request.vhost) {
            return Err(AmqpError::new(
                reply_code::NOT_FOUND,
                format!("no vhost '{}'", request.vhost),
            ));
        }
        let mut timeouts = self.tx.timeouts(&request.vhost);
        let set = |field: &mut Duration, value: Option<u64>| {
            if let Some(ms) = value {
                *field = Duration::from_millis(ms);
            }
        };
        set(&mut timeouts.open_warn, request.open_warn_ms);
        set(&mut timeouts.open_close, request.open_close_ms);
        set(&mut timeouts.idle_warn, request.idle_warn_ms);
        set(&mut timeouts.idle_close, request.idle_close_ms);
        self.tx
            .vhost_timeouts
            .insert(request.vhost.clone(), timeouts);
        tracing::info!(
            vhost = %request.vhost,
            open_warn_ms = millis(timeouts.open_warn),
            open_close_ms = millis(timeouts.open_close),
            idle_warn_ms = millis(timeouts.idle_warn),
            idle_close_ms = millis(timeouts.idle_close),
            "transaction timeouts set"
        );
        self.tx.wake.notify_one();
        Ok(timeouts.view(&request.vhost))
    }

    /// The timer's pass over open transactions: warns (`CHN-1007`,
    /// `CHN-1008`, once per warn period) and closes the connections of
    /// those past a close timeout (506, `CHN-1003`). Returns when the next
    /// check is due (None: nothing to wait for).
    pub fn check_transactions(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut due = |at: Instant| {
            next = Some(next.map_or(at, |n| n.min(at)));
        };
        let mut expired = Vec::new();
        let open: Vec<(SessionId, ChannelId)> = self.tx.open.iter().copied().collect();
        for (session_id, channel_id) in open {
            let Some(session) = self.sessions.get_mut(&session_id) else {
                self.tx.open.remove(&(session_id, channel_id));
                continue;
            };
            let timeouts = self.tx.timeouts(&session.vhost);
            let Some(tx) = session
                .channels
                .get_mut(&channel_id)
                .and_then(|c| c.tx.as_mut())
                .filter(|tx| tx.is_open())
            else {
                self.tx.open.remove(&(session_id, channel_id));
                continue;
            };
            let (Some(opened_at), Some(last)) = (tx.opened_at, tx.last_activity) else {
                continue;
            };
            let open_for = now.saturating_duration_since(opened_at);
            let idle_for = now.saturating_duration_since(last);
            if !timeouts.open_close.is_zero() && open_for >= timeouts.open_close {
                expired.push((session_id, channel_id, Expired::Open, open_for));
                continue;
            }
            if !timeouts.idle_close.is_zero() && idle_for >= timeouts.idle_close {
                expired.push((session_id, channel_id, Expired::Idle, idle_for));
                continue;
            }
            if !timeouts.open_close.is_zero() {
                due(opened_at + timeouts.open_close);
            }
            if !timeouts.idle_close.is_zero() {
                due(last + timeouts.idle_close);
            }
            if !timeouts.open_warn.is_zero() {
                let warn_at = tx
                    .open_warned
                    .map_or(opened_at + timeouts.open_warn, |at| at + timeouts.open_warn);
                if now >= warn_at {
                    tx.open_warned = Some(now);
                    tracing::warn!(
                        code = "CHN-1007",
                        session = session_id,
                        channel = channel_id,
                        vhost = %session.vhost,
                        open_ms = millis(open_for),
                        "CHN-1007 : Open Transaction : {} ms",
                        thousands(millis(open_for))
                    );
                    due(now + timeouts.open_warn);
                } else {
                    due(warn_at);
                }
            }
            if !timeouts.idle_warn.is_zero() {
                let warn_at = tx
                    .idle_warned
                    .map_or(last + timeouts.idle_warn, |at| at + timeouts.idle_warn);
                if now >= warn_at {
                    tx.idle_warned = Some(now);
                    tracing::warn!(
                        code = "CHN-1008",
                        session = session_id,
                        channel = channel_id,
                        vhost = %session.vhost,
                        idle_ms = millis(idle_for),
                        "CHN-1008 : Idle Transaction : {} ms",
                        thousands(millis(idle_for))
                    );
                    due(now + timeouts.idle_warn);
                } else {
                    due(warn_at);
                }
            }
        }
        for (session, channel, why, elapsed) in expired {
            let (text, field) = match why {
                Expired::Open => ("Open transaction timed out", "open"),
                Expired::Idle => ("Idle transaction timed out", "idle"),
            };
            let vhost = self.session_vhost(session).unwrap_or_default();
            tracing::warn!(
                code = "CHN-1003",
                session,
                channel,
                vhost = %vhost,
                reason = text,
                elapsed_ms = millis(elapsed),
                timeout = field,
                "CHN-1003 : Close : {text}"
            );
            // Rolled back now: a commit racing the close commits nothing.
            let work = self
                .tx_mut(session, channel)
                .map(Transaction::take)
                .unwrap_or_default();
            self.tx.open.remove(&(session, channel));
            let touched = self.tx_undo(&vhost, work);
            self.dispatch_all(&vhost, touched);
            self.close_connection(session, reply_code::RESOURCE_ERROR, text.to_string());
        }
        next
    }
}
