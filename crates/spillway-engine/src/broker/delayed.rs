//! Delayed messages, the interface of RabbitMQ's delayed-message exchange:
//! a message published to an `x-delayed-message` exchange with an `x-delay`
//! header (milliseconds, above 0) is not routed but written whole to the
//! store, keyed by its due time, and confirmed once written (synced when
//! persistent). The engine keeps only how many wait per exchange and when
//! the next is due — nothing of the message — so a backlog of delayed
//! messages costs disk, not memory. The engine's delayed timer
//! (`engine.rs`) reads the due ones back from the store in bounded batches
//! and hands them to [`Broker::route_delayed`], which routes each as the
//! exchange's `x-delayed-type` through the publish path (a new id, the
//! queues' limits, dead letters) and deletes its record in the same store
//! batch: after a crash a message is either still delayed or in its queues.

use std::collections::VecDeque;
use std::sync::Arc;

use foldhash::{HashMap, HashMapExt};
use spillway_amqp::reply_code;
use spillway_proto::engine::{self as pb, AmqpError};
use spillway_proto::storage::{self as store, write_op, DelayedCount, DelayedMessage, Durability};
use tokio::sync::{oneshot, Notify};

use super::publish::PublishOutcome;
use super::{op, Broker, OpResult};
use crate::argument_values::as_integer;
use crate::model::*;
use crate::routing::route;

/// The header that delays a message, in milliseconds.
pub const X_DELAY: &str = "x-delay";

/// The longest delay: RabbitMQ's largest TTL, 2^32 - 1 ms (about 49 days);
/// a longer `x-delay` waits this long.
const MAX_DELAY_MS: u64 = spillway_amqp::properties::MAX_EXPIRY_MS;

/// What the broker knows of the delayed messages in the store.
pub struct DelayedState {
    /// How many wait, per (vhost, exchange).
    counts: HashMap<(String, String), u64>,
    /// No delayed message waits before this (due time, id) (None: none is
    /// known to wait): where the timer's next scan starts. The timer
    /// takes it when it is due; a publish lowers it.
    next_due: Option<(u64, u64)>,
    /// Wakes the timer when a message due earlier than it sleeps for
    /// arrives.
    waker: Arc<Notify>,
    /// Delayed messages submitted to the store writer and perhaps not
    /// written yet: (write sequence, due time), in sequence order. The
    /// timer waits for a write only when one of these is due; at most as
    /// many as the writer's queue holds.
    unwritten: VecDeque<(u64, u64)>,
}

impl Default for DelayedState {
    fn default() -> Self {
        Self {
            counts: HashMap::new(),
            next_due: None,
            waker: Arc::new(Notify::new()),
            unwritten: VecDeque::new(),
        }
    }
}

/// What the delayed timer is to do now.
#[derive(Debug, PartialEq, Eq)]
pub enum DelayedDue {
    /// Read the messages due by now, from this (due time, id) on.
    Now { from: (u64, u64) },
    /// Sleep until then (or until woken).
    At(u64),
    /// Nothing waits: sleep until woken.
    Idle,
}

impl DelayedState {
    pub fn waker(&self) -> Arc<Notify> {
        self.waker.clone()
    }

    /// Messages waiting for one exchange.
    pub fn count(&self, vhost: &str, exchange: &str) -> u64 {
        self.counts
            .get(&(vhost.to_string(), exchange.to_string()))
            .copied()
            .unwrap_or(0)
    }

    /// The timer's turn: when something is due by `now`, it is claimed
    /// (publishes from now on lower `next_due` again).
    pub fn due(&mut self, now: u64) -> DelayedDue {
        match self.next_due {
            Some(from) if from.0 <= now => {
                self.next_due = None;
                DelayedDue::Now { from }
            }
            Some((due, _)) => DelayedDue::At(due),
            None => DelayedDue::Idle,
        }
    }

    /// The store write the timer must wait for before it looks for what
    /// is due by `now`: the last of the unwritten delayed messages due by
    /// then (None: every one due is in the store already). Forgets those
    /// written.
    pub fn write_to_wait_for(&mut self, now: u64, written: impl Fn(u64) -> bool) -> Option<u64> {
        while self.unwritten.front().is_some_and(|(seq, _)| written(*seq)) {
            self.unwritten.pop_front();
        }
        self.unwritten
            .iter()
            .filter(|(_, due)| *due <= now)
            .map(|(seq, _)| *seq)
            .max()
    }

    /// A message is due at `due` (published, or found in the store).
    pub fn note_due(&mut self, due: u64) {
        self.note_next((due, 0));
    }

    /// Nothing waits before `from` (due time, id) that is not known yet.
    pub fn note_next(&mut self, from: (u64, u64)) {
        if self.next_due.is_none_or(|next| from < next) {
            self.next_due = Some(from);
            self.waker.notify_one();
        }
    }

    /// What the store held at start-up, counted below this run's first id.
    pub fn recovered(&mut self, counts: Vec<DelayedCount>, next_due_ms: u64) {
        for count in counts {
            *self
                .counts
                .entry((count.vhost, count.exchange))
                .or_default() += count.count;
        }
        if next_due_ms > 0 {
            self.note_due(next_due_ms);
        }
    }

    fn add(&mut self, vhost: &str, exchange: &str) {
        *self
            .counts
            .entry((vhost.to_string(), exchange.to_string()))
            .or_default() += 1;
    }

    fn remove(&mut self, vhost: &str, exchange: &str) {
        let key = (vhost.to_string(), exchange.to_string());
        if let Some(count) = self.counts.get_mut(&key) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.counts.remove(&key);
            }
        }
    }

    /// An exchange (or a vhost, with `exchange` None) was deleted: what
    /// waited for it is no longer shown; each message is dropped when due.
    pub fn forget(&mut self, vhost: &str, exchange: Option<&str>) {
        self.counts
            .retain(|(v, x), _| !(v == vhost && exchange.is_none_or(|e| e == x)));
    }
}

/// A message's `x-delay`, when it is delayed: an integer above 0 (a longer
/// one than [`MAX_DELAY_MS`] waits that long). Anything else routes at once,
/// as in RabbitMQ's plugin.
fn delay_of(properties: &[u8]) -> Result<Option<u64>, AmqpError> {
    let parsed = match amq_protocol::protocol::basic::parse_properties(properties) {
        Ok((_, parsed)) => parsed,
        Err(_) => {
            return Err(AmqpError::new(
                reply_code::SYNTAX_ERROR,
                "malformed message properties",
            ))
        }
    };
    let Some(headers) = parsed.headers() else {
        return Ok(None);
    };
    let delay = headers.inner().get(X_DELAY).and_then(as_integer);
    Ok(delay
        .filter(|ms| *ms > 0)
        .map(|ms| u64::try_from(ms).unwrap_or(u64::MAX).min(MAX_DELAY_MS)))
}

impl Broker {
    /// The delay of a publish to a delayed exchange (None: not delayed).
    pub(super) fn publish_delay(
        &self,
        vhost_name: &str,
        cmd: &pb::Publish,
    ) -> OpResult<Option<u64>> {
        let delayed = self
            .vhosts
            .get(vhost_name)
            .and_then(|vhost| vhost.exchanges.get(&cmd.exchange))
            .is_some_and(|exchange| exchange.delayed && !exchange.internal);
        if !delayed {
            return Ok(None);
        }
        delay_of(&cmd.properties)
    }

    /// Writes a delayed message to the store; the publisher's confirm
    /// waits for the write (synced when persistent). Nothing of it stays
    /// in memory.
    pub(super) fn publish_delayed(
        &mut self,
        session: SessionId,
        vhost_name: &str,
        cmd: pb::Publish,
        delay_ms: u64,
    ) -> OpResult<PublishOutcome> {
        if let Some(failure) = self.alarms.store_failure().map(str::to_string) {
            // Delayed messages live in the store: refused while it fails.
            self.note_persistent_producer(session);
            if cmd.confirm_seq > 0 {
                return Ok(PublishOutcome::Rejected);
            }
            return Err(AmqpError::new(
                reply_code::RESOURCE_ERROR,
                format!("store failure ({failure}): delayed messages are refused until it clears"),
            ));
        }
        let id = self.next_message_id;
        self.next_message_id += 1;
        let due_ms = self.clock.unix_millis().saturating_add(delay_ms);
        let durability = if cmd.persistent {
            Durability::Synced
        } else {
            Durability::Logged
        };
        let confirm = cmd.confirm_seq > 0;
        self.delayed.add(vhost_name, &cmd.exchange);
        let message = DelayedMessage {
            vhost: vhost_name.to_string(),
            exchange: cmd.exchange,
            routing_key: cmd.routing_key,
            properties: cmd.properties,
            body: cmd.body,
            persistent: cmd.persistent,
            body_encoding: cmd.body_encoding,
            body_size: cmd.body_size,
            due_ms,
            id,
            expiration_ms: cmd.expiration_ms,
        };
        let ops = vec![op(write_op::Op::PutDelayed(message))];
        let (seq, outcome) = if confirm {
            let (done, wait) = oneshot::channel();
            let seq = self.persist.submit(ops, durability, Some(done));
            (seq, PublishOutcome::AfterWrite(wait))
        } else {
            let seq = self.persist.submit(ops, durability, None);
            (seq, PublishOutcome::Done)
        };
        let written = |seq| self.persist.is_written(seq);
        // Those written already go first: the queue holds what is in flight.
        while self
            .delayed
            .unwritten
            .front()
            .is_some_and(|(seq, _)| written(*seq))
        {
            self.delayed.unwritten.pop_front();
        }
        self.delayed.unwritten.push_back((seq, due_ms));
        self.delayed.note_due(due_ms);
        self.note_producer(session);
        if cmd.persistent {
            self.note_persistent_producer(session);
        }
        Ok(outcome)
    }

    /// Routes delayed messages that are due, read from the store in due
    /// order, and deletes their records in the same batch. `next`: the
    /// (due time, id) of the first one not read (due 0: none waits).
    pub(crate) fn route_delayed(&mut self, messages: Vec<DelayedMessage>, next: (u64, u64)) {
        if next.0 > 0 {
            // Exactly where this batch stopped: those routed here (whose
            // deletes may not be written yet) are not read again.
            self.delayed.note_next(next);
        }
        if messages.is_empty() {
            return;
        }
        let now = self.clock.unix_millis();
        let mut ops = Vec::with_capacity(messages.len() * 2);
        let mut stored = Vec::new();
        let mut routed: Vec<(String, Vec<String>, u64)> = Vec::new();
        let mut dead_letters: Vec<(String, Vec<super::DeadLetterJob>)> = Vec::new();
        for delayed in messages {
            ops.push(op(write_op::Op::DeleteDelayed(store::DelayedKey {
                due_ms: delayed.due_ms,
                id: delayed.id,
            })));
            self.delayed.remove(&delayed.vhost, &delayed.exchange);
            let cmd = pb::Publish {
                exchange: delayed.exchange,
                routing_key: delayed.routing_key,
                properties: delayed.properties,
                body: delayed.body,
                body_encoding: delayed.body_encoding,
                body_size: delayed.body_size,
                persistent: delayed.persistent,
                ..Default::default()
            };
            // Its exchange may be gone: then so is the message.
            let targets = match self
                .vhosts
                .get(&delayed.vhost)
                .and_then(|vhost| Some((vhost, vhost.exchanges.get(&cmd.exchange)?)))
            {
                Some((vhost, exchange)) => route(vhost, exchange, &cmd).unwrap_or_default(),
                None => Vec::new(),
            };
            if targets.is_empty() {
                continue;
            }
            let id = self.next_message_id;
            self.next_message_id += 1;
            let body = cmd.body();
            let message = Message::new(
                &self.budget,
                cmd.exchange,
                cmd.routing_key,
                cmd.properties,
                body,
                cmd.persistent,
            );
            let enqueued = self.enqueue_routed(
                &delayed.vhost,
                &targets,
                &message,
                id,
                (now, delayed.expiration_ms),
                &mut ops,
                false,
            );
            if message.stored_seq() != 0 {
                stored.push(message);
            }
            if !enqueued.dead_letters.is_empty() {
                dead_letters.push((delayed.vhost.clone(), enqueued.dead_letters));
            }
            routed.push((delayed.vhost, targets, id));
        }
        // Atomic: each message is either still delayed or in its queues.
        let seq = self.persist.submit(ops, Durability::Logged, None);
        for message in stored {
            message.mark_stored(seq);
        }
        let mut touched: Vec<(String, String)> = Vec::new();
        for (vhost, jobs) in dead_letters {
            for queue in self.dead_letter(&vhost, jobs) {
                touched.push((vhost.clone(), queue));
            }
        }
        if !self.flow_active && self.budget.over_threshold() {
            self.housekeeping();
        }
        for (vhost, targets, id) in routed {
            for queue in targets {
                self.spill_arrival(&vhost, &queue, id);
                touched.push((vhost.clone(), queue));
            }
        }
        touched.sort();
        touched.dedup();
        for (vhost, queue) in touched {
            self.dispatch_at(&vhost, &queue, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timer_claims_what_is_due_and_publishes_lower_it() {
        let mut state = DelayedState::default();
        assert_eq!(state.due(100), DelayedDue::Idle);
        state.note_due(500);
        state.note_due(300);
        assert_eq!(state.due(100), DelayedDue::At(300));
        assert_eq!(state.due(300), DelayedDue::Now { from: (300, 0) });
        assert_eq!(state.due(300), DelayedDue::Idle, "claimed");
        state.note_due(400);
        assert_eq!(state.due(350), DelayedDue::At(400));
        state.note_next((400, 7));
        assert_eq!(
            state.due(400),
            DelayedDue::Now { from: (400, 0) },
            "the lower key"
        );
        state.note_next((400, 7));
        assert_eq!(state.due(400), DelayedDue::Now { from: (400, 7) });
    }

    #[test]
    fn the_timer_waits_only_for_writes_of_messages_due() {
        let mut state = DelayedState::default();
        state
            .unwritten
            .extend([(1, 900), (2, 100), (3, 5_000), (4, 200)]);
        assert_eq!(state.write_to_wait_for(50, |_| false), None);
        assert_eq!(state.write_to_wait_for(250, |_| false), Some(4));
        assert_eq!(state.write_to_wait_for(250, |seq| seq <= 2), Some(4));
        assert_eq!(state.unwritten.len(), 2, "written ones forgotten");
        assert_eq!(state.write_to_wait_for(1_000, |seq| seq <= 4), None);
    }

    #[test]
    fn counts_go_with_their_exchange() {
        let mut state = DelayedState::default();
        state.add("/", "a");
        state.add("/", "a");
        state.add("v", "a");
        assert_eq!(state.count("/", "a"), 2);
        state.remove("/", "a");
        assert_eq!(state.count("/", "a"), 1);
        state.forget("v", None);
        assert_eq!(state.count("v", "a"), 0);
        assert_eq!(state.count("/", "a"), 1);
    }
}
