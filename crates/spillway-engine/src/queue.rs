//! A queue: its ready messages in order (resident or flowed to disk), its
//! consumers, its limits and dead-letter target, and the state flow to
//! disk, producer flow control, expiry and pacing keep on it. The methods
//! here keep its byte counts exact; what happens across queues is the
//! broker's (`broker/`).

use std::collections::BTreeSet;
use std::sync::Arc;

use amq_protocol_types::FieldTable;
use tokio::sync::oneshot;

use crate::model::*;
use crate::pacing::QueuePacing;
use crate::ready::ReadyMessages;

pub struct Queue {
    pub name: String,
    pub durable: bool,
    pub auto_delete: bool,
    /// Set for exclusive queues: only this session may use the queue, and the
    /// queue goes when the session does.
    pub exclusive_owner: Option<SessionId>,
    /// The session whose queue.declare created it (None: recovered, or
    /// created by management): counted in its per-connection queue limit.
    pub created_by: Option<SessionId>,
    /// The arguments it was declared with (what a redeclare must repeat).
    pub arguments: FieldTable,
    /// The policy and operator policy that apply to it (`policy.rs`).
    pub policy: Option<String>,
    pub operator_policy: Option<String>,
    /// The arguments in force when a policy sets some: `arguments` merged
    /// with the policies' keys; None: `arguments` are.
    pub effective_arguments: Option<FieldTable>,
    /// Its limits, from the arguments in force.
    pub limits: QueueLimits,
    /// Where its dead letters go (`x-dead-letter-exchange`, or
    /// `<queue>_DLE` with `x-qpid-dlq-enabled`); None: they are dropped.
    pub dead_letter: Option<DeadLetterTarget>,
    /// Messages dead-lettered from it and dropped for want of a
    /// destination, by reason (for `/metrics`).
    pub dead_letter_counts: DeadLetterCounts,
    /// Messages that arrived in the queue (published, dead-lettered or
    /// moved here; not requeued) and messages delivered from it (to a
    /// consumer or `basic.get`) since it was declared or recovered: the
    /// counts RabbitMQ's management rates are computed from.
    pub arrived_total: u64,
    pub delivered_total: u64,
    /// Ready messages, in delivery order: by priority (`x-max-priority`),
    /// then id (`ready.rs`). Changed only through the methods below, which
    /// keep `ready_bytes` and `resident_bytes` exact.
    pub messages: ReadyMessages,
    /// Body bytes of the ready messages, resident or not.
    pub ready_bytes: u64,
    /// Accounted bytes of the ready messages whose payload is resident.
    pub resident_bytes: u64,
    /// Ready messages whose payload is only in the store, and their body
    /// bytes.
    pub spilled_count: u64,
    pub spilled_bytes: u64,
    /// This queue's share of the flow-to-disk threshold while flow to disk
    /// is active (`u64::MAX` otherwise): resident bytes above it go to disk.
    pub target_bytes: u64,
    /// Every ready message ranked at or above this one (its rank: see
    /// `ready.rs`; the id, for a queue without priorities) has flowed to
    /// disk (or is being read back): spilling starts below it.
    pub spilled_from: u64,
    /// Every ready message ranked below this one is resident or being read
    /// back: read-ahead continues from it.
    pub read_ahead_until: u64,
    /// basic.get callers waiting for the head's payload.
    pub get_waiters: Vec<oneshot::Sender<()>>,
    pub consumers: Vec<ConsumerRef>,
    /// Set by the first basic.consume since the queue was declared or
    /// recovered. An auto-delete queue goes only when its last consumer does,
    /// so one that never had a consumer (read with basic.get only) stays, as
    /// in RabbitMQ.
    pub had_consumers: bool,
    /// Round-robin position in `consumers`.
    pub next_consumer: usize,
    /// `x-single-active-consumer`: only the first consumer in `consumers`
    /// (the earliest still there) receives; the next takes over when it
    /// goes. `consumers` is then in arrival order, not by priority.
    pub single_active_consumer: bool,
    /// Set once an exclusive (basic.consume exclusive) consumer holds it.
    pub exclusive_consumer: bool,
    /// Over its capacity: channels publishing to it are blocked.
    pub overfull: bool,
    /// The channels blocked on this queue.
    pub blocked_channels: BTreeSet<(SessionId, ChannelId)>,
    /// A durable queue whose stored entries are still being read at
    /// start-up (`crate::recovery`): it takes publishes but delivers
    /// nothing, so that nothing published now overtakes what it held.
    pub recovering: bool,
    /// When the expiry timer next looks at this queue (milliseconds since
    /// the Unix epoch; 0 = not scheduled): see `broker/expiry.rs`.
    pub expiry_check_at: u64,
    /// Last declared, read with basic.get, or left by its last consumer
    /// (milliseconds since the Unix epoch), for `x-expires`.
    pub last_used: u64,
    /// Publisher pacing: the credit its publishers spend and its deliveries
    /// earn back (`broker/pacing.rs`).
    pub pacing: QueuePacing,
}

impl Queue {
    pub fn new(
        name: String,
        durable: bool,
        auto_delete: bool,
        exclusive_owner: Option<SessionId>,
    ) -> Self {
        Self {
            name,
            durable,
            auto_delete,
            exclusive_owner,
            created_by: None,
            arguments: FieldTable::default(),
            policy: None,
            operator_policy: None,
            effective_arguments: None,
            limits: QueueLimits::default(),
            dead_letter: None,
            dead_letter_counts: DeadLetterCounts::default(),
            arrived_total: 0,
            delivered_total: 0,
            messages: ReadyMessages::new(0),
            ready_bytes: 0,
            resident_bytes: 0,
            spilled_count: 0,
            spilled_bytes: 0,
            target_bytes: u64::MAX,
            spilled_from: u64::MAX,
            read_ahead_until: 0,
            get_waiters: Vec::new(),
            consumers: Vec::new(),
            had_consumers: false,
            next_consumer: 0,
            single_active_consumer: false,
            exclusive_consumer: false,
            overfull: false,
            blocked_channels: BTreeSet::new(),
            recovering: false,
            expiry_check_at: 0,
            last_used: 0,
            pacing: QueuePacing::default(),
        }
    }

    /// Makes this a priority queue (`x-max-priority`), before it holds
    /// anything.
    pub fn set_max_priority(&mut self, max_priority: u8) {
        debug_assert!(self.messages.is_empty());
        self.messages = ReadyMessages::new(max_priority);
    }

    /// The priority a message with these properties has here: its
    /// `priority` property, at most the queue's maximum (RabbitMQ's rule);
    /// 0 on a queue without priorities, which never reads it.
    pub fn priority_of(&self, properties: &[u8]) -> u8 {
        let max = self.max_priority();
        if max == 0 {
            return 0;
        }
        spillway_amqp::properties::priority(properties).map_or(0, |p| p.min(max))
    }

    /// A priority queue's `x-max-priority` (0: not one).
    pub fn max_priority(&self) -> u8 {
        self.messages.max_priority()
    }

    /// Whether persistent messages on this queue are written to the store.
    pub fn stores_messages(&self) -> bool {
        self.durable && self.exclusive_owner.is_none()
    }

    /// Would one more message of `body_len` bytes exceed a limit?
    pub fn would_overflow(&self, body_len: u64) -> bool {
        let too_long = self
            .limits
            .max_length
            .is_some_and(|max| self.messages.len() as u64 + 1 > max);
        let too_big = self
            .limits
            .max_bytes
            .is_some_and(|max| self.ready_bytes + body_len > max);
        too_long || too_big
    }

    fn over_limit(&self) -> bool {
        self.limits
            .max_length
            .is_some_and(|max| self.messages.len() as u64 > max)
            || self
                .limits
                .max_bytes
                .is_some_and(|max| self.ready_bytes > max)
    }

    /// Over its producer flow-control limits now?
    pub fn over_capacity(&self) -> bool {
        self.limits
            .capacity
            .is_some_and(|capacity| self.ready_bytes > capacity)
            || self
                .limits
                .max_count
                .is_some_and(|max| self.messages.len() as u64 > max)
    }

    /// Back under the resume capacity (and the count limit)?
    pub fn under_resume_capacity(&self) -> bool {
        let bytes_ok = self
            .limits
            .resume_capacity
            .is_none_or(|resume| self.ready_bytes < resume || self.ready_bytes == 0);
        let count_ok = self
            .limits
            .max_count
            .is_none_or(|max| (self.messages.len() as u64) < max || self.messages.is_empty());
        bytes_ok && count_ok
    }

    /// Appends a message; with drop-head, returns the oldest messages dropped
    /// to keep within the limits.
    pub fn enqueue(&mut self, message: QueuedMessage) -> Vec<QueuedMessage> {
        self.arrived_total += 1;
        self.count_in(&message);
        let rank = self.messages.rank(&message);
        if message.message.is_some() && rank >= self.spilled_from {
            // Resident where everything was spilled (the tail, or a priority
            // level's end): spilling must look at it.
            self.spilled_from = rank.saturating_add(1);
        }
        if message.message.is_none() {
            self.read_ahead_until = self.read_ahead_until.min(rank);
        }
        self.messages.push_back(message);
        self.trim_to_length()
    }

    /// Takes the oldest messages off while the queue is over its length
    /// limits (after they were lowered).
    pub fn trim_to_length(&mut self) -> Vec<QueuedMessage> {
        let mut dropped = Vec::new();
        while self.over_limit() {
            let Some(oldest) = self.dequeue() else { break };
            dropped.push(oldest);
        }
        dropped
    }

    pub fn dequeue(&mut self) -> Option<QueuedMessage> {
        let message = self.messages.pop_front()?;
        self.count_out(&message);
        Some(message)
    }

    /// Puts requeued messages back in id order, ahead of later arrivals.
    pub fn requeue(&mut self, mut message: QueuedMessage) {
        message.redelivered = true;
        self.count_in(&message);
        let rank = self.messages.rank(&message);
        if message.message.is_some() && rank >= self.spilled_from {
            self.spilled_from = rank.saturating_add(1);
        }
        if message.message.is_none() {
            // Its payload went to the store while it was unacknowledged:
            // read-ahead must look at it again.
            message.loading = false;
            self.read_ahead_until = self.read_ahead_until.min(rank);
        }
        self.messages.insert_by_id(message);
    }

    /// Puts the messages recovered from the store (oldest first, payloads
    /// in the store) ahead of those published while they were being read,
    /// which all have later ids.
    pub fn prepend_recovered(&mut self, recovered: Vec<QueuedMessage>) {
        let Some(lowest) = recovered.iter().map(|m| self.messages.rank(m)).min() else {
            return;
        };
        debug_assert!(recovered.windows(2).all(|pair| pair[0].id < pair[1].id));
        // Nothing resident here yet: spilling may start anywhere.
        let all_spilled = self.spilled_count == self.messages.len() as u64;
        for message in &recovered {
            self.count_in(message);
        }
        self.messages.prepend(recovered);
        if all_spilled {
            if let Some(front) = self.messages.front() {
                self.spilled_from = self.messages.rank(front);
            }
        }
        // Read-ahead starts again at the first of them.
        self.read_ahead_until = self.read_ahead_until.min(lowest);
    }

    pub fn purge(&mut self) -> Vec<QueuedMessage> {
        self.ready_bytes = 0;
        self.resident_bytes = 0;
        self.spilled_count = 0;
        self.spilled_bytes = 0;
        self.spilled_from = u64::MAX;
        self.messages.drain_all()
    }

    /// The position of the ready message `id`, if it is still here.
    pub fn position(&self, id: u64) -> Option<usize> {
        self.messages.position_of_id(id)
    }

    /// Drops the payload of the ready message at `position` from memory (its
    /// record is in the store, or on its way there).
    pub fn spill_at(&mut self, position: usize) {
        let Some(entry) = self.messages.get_mut(position) else {
            return;
        };
        let Some(message) = entry.message.take() else {
            return;
        };
        self.resident_bytes -= message.accounted_size();
        self.spilled_count += 1;
        self.spilled_bytes += entry.body_size();
    }

    /// Puts a payload read back from the store into the ready message `id`.
    pub fn install(&mut self, id: u64, message: Arc<Message>) -> bool {
        let Some(position) = self.position(id) else {
            return false;
        };
        let Some(entry) = self.messages.get_mut(position) else {
            return false;
        };
        entry.loading = false;
        if entry.message.is_some() {
            return false;
        }
        self.resident_bytes += message.accounted_size();
        self.spilled_count -= 1;
        self.spilled_bytes -= entry.body_size();
        entry.message = Some(message);
        let priority = entry.priority;
        let rank = self.messages.rank_of(priority, id);
        if rank >= self.spilled_from {
            self.spilled_from = rank.saturating_add(1);
        }
        true
    }

    fn count_in(&mut self, message: &QueuedMessage) {
        self.ready_bytes += message.body_size();
        self.resident_bytes += message.resident_size();
        if message.message.is_none() {
            self.spilled_count += 1;
            self.spilled_bytes += message.body_size();
        }
    }

    fn count_out(&mut self, message: &QueuedMessage) {
        self.ready_bytes -= message.body_size();
        self.resident_bytes -= message.resident_size();
        if message.message.is_none() {
            self.spilled_count -= 1;
            self.spilled_bytes -= message.body_size();
        }
    }
}
