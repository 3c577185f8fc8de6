//! The engine's in-memory model: vhosts hold exchanges and queues; sessions
//! (one per client connection) hold channels, consumers and unacknowledged
//! deliveries. Everything here is plain data guarded by the broker lock.

use foldhash::{HashMap, HashMapExt};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use amq_protocol_types::FieldTable;
use bytes::Bytes;
use spillway_proto::body::Body;
use spillway_proto::engine::SessionEvent;
use spillway_proto::storage::MessageRecord;
use tokio::sync::{mpsc, oneshot};

use crate::budget::{MemoryBudget, MESSAGE_OVERHEAD_BYTES};
use crate::routing::ExchangeKind;

pub type SessionId = u64;
pub type ChannelId = u32;

/// A message whose payload is in memory. Shared (not copied) by every queue
/// and delivery that holds it; counted in the [`MemoryBudget`] from the
/// moment it is made until its last reference drops.
#[derive(Debug)]
pub struct Message {
    pub exchange: String,
    pub routing_key: String,
    /// The content header's property flags and list, exactly as published.
    pub properties: Bytes,
    /// As the gateway handed it over: compressed when it was worth it
    /// (`docs/compression.md`). Memory, the budget and the store hold it
    /// so; only the gateway decodes it.
    pub body: Body,
    /// delivery-mode 2: stored when it lands on a durable queue.
    pub persistent: bool,
    /// The store writer's sequence number of the write that stores this
    /// message's record; 0 while the store has no copy.
    stored_seq: AtomicU64,
    /// The engine's `publish` span, when traces are exported: deliveries
    /// join its trace.
    pub trace: Option<Box<spillway_proto::trace::SpanContext>>,
    accounted: u64,
    budget: Arc<MemoryBudget>,
}

impl Message {
    /// A message published now: in the trace of the current span (the
    /// engine's `publish`), if one is exported.
    pub fn new(
        budget: &Arc<MemoryBudget>,
        exchange: String,
        routing_key: String,
        properties: Bytes,
        body: Body,
        persistent: bool,
    ) -> Arc<Self> {
        let trace = spillway_proto::trace::current().map(Box::new);
        Self::build(
            budget,
            (exchange, routing_key, properties, body),
            persistent,
            trace,
        )
    }

    fn build(
        budget: &Arc<MemoryBudget>,
        (exchange, routing_key, properties, body): (String, String, Bytes, Body),
        persistent: bool,
        trace: Option<Box<spillway_proto::trace::SpanContext>>,
    ) -> Arc<Self> {
        // The body as held: a compressed body counts its compressed size.
        let accounted = (exchange.len() + routing_key.len() + properties.len()) as u64
            + body.stored_len()
            + MESSAGE_OVERHEAD_BYTES;
        budget.add_resident(accounted);
        Arc::new(Self {
            exchange,
            routing_key,
            properties,
            body,
            persistent,
            stored_seq: AtomicU64::new(0),
            trace,
            accounted,
            budget: budget.clone(),
        })
    }

    /// A message read back from the store (its publish's trace is not).
    pub fn from_record(budget: &Arc<MemoryBudget>, record: MessageRecord) -> Arc<Self> {
        let body = record.body();
        let message = Self::build(
            budget,
            (record.exchange, record.routing_key, record.properties, body),
            record.persistent,
            None,
        );
        message.mark_stored(STORED_EARLIER);
        message
    }

    /// What this message counts for in the memory budget.
    pub fn accounted_size(&self) -> u64 {
        self.accounted
    }

    pub fn stored_seq(&self) -> u64 {
        self.stored_seq.load(Ordering::Relaxed)
    }

    pub fn mark_stored(&self, seq: u64) {
        self.stored_seq.store(seq, Ordering::Relaxed);
    }

    pub fn record(&self, id: u64) -> MessageRecord {
        let (body, body_encoding, body_size) = self.body.wire();
        MessageRecord {
            id,
            exchange: self.exchange.clone(),
            routing_key: self.routing_key.clone(),
            properties: self.properties.clone(),
            body,
            persistent: self.persistent,
            body_encoding,
            body_size,
        }
    }
}

impl Drop for Message {
    fn drop(&mut self) {
        self.budget.remove_resident(self.accounted);
    }
}

/// The `stored_seq` of records written before this engine started (read
/// back, or recovered): older than any write of this run.
pub const STORED_EARLIER: u64 = 1;

/// A message's place in one queue. 40 bytes: a backlog that flowed to disk
/// costs this much memory per message.
#[derive(Clone, Debug)]
pub struct QueuedMessage {
    /// Engine-wide, increasing: a queue is ordered by it, and it keys the
    /// message in the store.
    pub id: u64,
    /// The payload, or `None` once it flowed to disk: read back before
    /// delivery.
    pub message: Option<Arc<Message>>,
    /// Of the body as published (compressed or not): what queue limits
    /// (`x-max-length-bytes`) and queue depth in bytes count.
    pub body_size: u64,
    /// Deliveries so far (basic.deliver and basic.get-ok): the next one
    /// carries it as `x-delivery-count`, and the delivery limit counts it.
    pub delivery_count: u32,
    pub redelivered: bool,
    pub persistent: bool,
    /// Routed to more than one queue: the broker counts its holders.
    pub shared: bool,
    /// Its payload is being read back from the store.
    pub loading: bool,
    /// When it expires in this queue, in milliseconds since the Unix epoch
    /// (0 = never): its `expiration` or the queue's `x-message-ttl`,
    /// whichever is lower, counted from when it was enqueued. Kept across
    /// requeues and, for persistent messages, restarts.
    pub expires_at: u64,
}

impl QueuedMessage {
    pub fn resident(id: u64, message: Arc<Message>) -> Self {
        Self {
            id,
            body_size: message.body.size(),
            persistent: message.persistent,
            message: Some(message),
            delivery_count: 0,
            redelivered: false,
            shared: false,
            loading: false,
            expires_at: 0,
        }
    }

    /// Expired at `now` (milliseconds since the Unix epoch)? A message is
    /// deliverable up to and including its `expires_at` millisecond.
    pub fn expired(&self, now: u64) -> bool {
        self.expires_at != 0 && now > self.expires_at
    }

    /// Bytes this entry holds resident, for its queue's share of the budget.
    pub fn resident_size(&self) -> u64 {
        self.message.as_ref().map_or(0, |m| m.accounted_size())
    }
}

pub struct Exchange {
    pub name: String,
    pub kind: ExchangeKind,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
    pub bindings: crate::bindings::Bindings,
}

impl Exchange {
    pub fn new(name: &str, kind: ExchangeKind, durable: bool) -> Self {
        Self {
            name: name.to_string(),
            kind,
            durable,
            auto_delete: false,
            internal: false,
            arguments: FieldTable::default(),
            bindings: crate::bindings::Bindings::new(kind),
        }
    }

    /// Built-in exchanges (the default one and `amq.*`) cannot be declared,
    /// deleted or (the default one) bound by clients.
    pub fn is_builtin(&self) -> bool {
        self.name.is_empty() || self.name.starts_with("amq.")
    }
}

/// Where a binding leads: a queue, or another exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destination {
    Queue(String),
    Exchange(String),
}

impl Destination {
    pub fn name(&self) -> &str {
        match self {
            Destination::Queue(name) | Destination::Exchange(name) => name,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Binding {
    pub destination: Destination,
    pub routing_key: String,
    /// What a headers exchange matches; part of the binding's identity for
    /// every kind (a bind with other arguments is another binding).
    pub arguments: FieldTable,
}

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
    pub arguments: FieldTable,
    pub limits: QueueLimits,
    /// Where its dead letters go (`x-dead-letter-exchange`, or
    /// `<queue>_DLE` with `x-qpid-dlq-enabled`); None: they are dropped.
    pub dead_letter: Option<DeadLetterTarget>,
    /// Messages dead-lettered from it and dropped for want of a
    /// destination, by reason (for `/metrics`).
    pub dead_letter_counts: DeadLetterCounts,
    /// Ready messages, ordered by id. Changed only through the methods below,
    /// which keep `ready_bytes` and `resident_bytes` exact.
    pub messages: VecDeque<QueuedMessage>,
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
    /// Every ready message with an id at or above this one has flowed to
    /// disk (or is being read back): eviction starts below it.
    pub spilled_from: u64,
    /// Every ready message with an id below this one is resident or being
    /// read back: read-ahead continues from it.
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
    pub pacing: crate::broker::QueuePacing,
}

/// RabbitMQ's queue length limits (`x-max-length`, `x-max-length-bytes`,
/// `x-overflow`), counted over ready messages as RabbitMQ does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueLimits {
    pub max_length: Option<u64>,
    pub max_bytes: Option<u64>,
    pub overflow: Overflow,
    /// Qpid's producer flow control: overfull above `capacity` bytes or
    /// `max_count` messages (ready, resident or on disk), underfull again
    /// below `resume_capacity` bytes and `max_count` messages.
    pub capacity: Option<u64>,
    pub resume_capacity: Option<u64>,
    pub max_count: Option<u64>,
    /// Deliveries after which a message that comes back is dead-lettered
    /// instead of requeued (`x-qpid-maximum-delivery-count`, or RabbitMQ's
    /// `x-delivery-limit` + 1). None: the broker's default applies.
    pub max_deliveries: Option<u64>,
    /// `x-message-ttl`: milliseconds a message may wait in the queue.
    pub message_ttl: Option<u64>,
    /// `x-expires`: milliseconds the queue may stay unused before it is
    /// deleted.
    pub expires: Option<u64>,
}

/// A queue's dead-letter exchange and the routing key its dead letters are
/// republished with (None: their own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetterTarget {
    pub exchange: String,
    pub routing_key: Option<String>,
}

/// Why a message was dead-lettered: RabbitMQ's reasons, as written in
/// `x-death`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeathReason {
    /// basic.reject or basic.nack with requeue=false.
    Rejected,
    /// Came back after as many deliveries as the queue allows.
    DeliveryLimit,
    /// Dropped (drop-head) or refused (reject-publish-dlx) by a length limit.
    Maxlen,
    /// Its `expiration` or the queue's `x-message-ttl` passed.
    Expired,
}

impl DeathReason {
    pub const ALL: [DeathReason; 4] = [
        Self::Rejected,
        Self::DeliveryLimit,
        Self::Maxlen,
        Self::Expired,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rejected => "rejected",
            Self::DeliveryLimit => "delivery_limit",
            Self::Maxlen => "maxlen",
            Self::Expired => "expired",
        }
    }

    fn index(self) -> usize {
        match self {
            Self::Rejected => 0,
            Self::DeliveryLimit => 1,
            Self::Maxlen => 2,
            Self::Expired => 3,
        }
    }
}

/// Per reason: messages republished to the dead-letter exchange, and
/// messages dropped instead (no dead-letter exchange, a missing one, a
/// cycle, or no queue bound to it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeadLetterCounts {
    dead_lettered: [u64; 4],
    discarded: [u64; 4],
}

impl DeadLetterCounts {
    pub fn count_dead_lettered(&mut self, reason: DeathReason) {
        self.dead_lettered[reason.index()] += 1;
    }

    pub fn count_discarded(&mut self, reason: DeathReason) {
        self.discarded[reason.index()] += 1;
    }

    pub fn dead_lettered(&self, reason: DeathReason) -> u64 {
        self.dead_lettered[reason.index()]
    }

    pub fn discarded(&self, reason: DeathReason) -> u64 {
        self.discarded[reason.index()]
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overflow {
    /// Drop the oldest (dead-lettered, reason `maxlen`, when the queue has
    /// a dead-letter exchange).
    #[default]
    DropHead,
    /// Refuse the newest: nacked under publisher confirms.
    RejectPublish,
    /// As RejectPublish, and dead-letter the refused message (reason
    /// `maxlen`), as RabbitMQ does.
    RejectPublishDlx,
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
            limits: QueueLimits::default(),
            dead_letter: None,
            dead_letter_counts: DeadLetterCounts::default(),
            messages: VecDeque::new(),
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
            exclusive_consumer: false,
            overfull: false,
            blocked_channels: BTreeSet::new(),
            recovering: false,
            expiry_check_at: 0,
            last_used: 0,
            pacing: crate::broker::QueuePacing::default(),
        }
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
        self.count_in(&message);
        if message.message.is_some() {
            // The tail is resident again: eviction must look at it.
            self.spilled_from = u64::MAX;
        }
        self.messages.push_back(message);
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
        if message.message.is_some() && message.id >= self.spilled_from {
            self.spilled_from = message.id.saturating_add(1);
        }
        if message.message.is_none() {
            // Its payload went to the store while it was unacknowledged:
            // read-ahead must look at it again.
            message.loading = false;
            self.read_ahead_until = self.read_ahead_until.min(message.id);
        }
        let position = self.messages.partition_point(|m| m.id < message.id);
        self.messages.insert(position, message);
    }

    /// Puts the messages recovered from the store (oldest first, payloads
    /// in the store) ahead of those published while they were being read,
    /// which all have later ids.
    pub fn prepend_recovered(&mut self, recovered: Vec<QueuedMessage>) {
        let Some(first) = recovered.first().map(|m| m.id) else {
            return;
        };
        debug_assert!(recovered.windows(2).all(|pair| pair[0].id < pair[1].id));
        debug_assert!(recovered
            .last()
            .zip(self.messages.front())
            .is_none_or(|(last, front)| last.id < front.id));
        // Nothing resident behind them: eviction may start at them.
        let tail_spilled = self
            .messages
            .front()
            .is_none_or(|front| front.id >= self.spilled_from);
        for message in &recovered {
            self.count_in(message);
        }
        for message in recovered.into_iter().rev() {
            self.messages.push_front(message);
        }
        if tail_spilled {
            self.spilled_from = first;
        }
        // Read-ahead starts again at the new head.
        self.read_ahead_until = self.read_ahead_until.min(first);
    }

    pub fn purge(&mut self) -> Vec<QueuedMessage> {
        self.ready_bytes = 0;
        self.resident_bytes = 0;
        self.spilled_count = 0;
        self.spilled_bytes = 0;
        self.spilled_from = u64::MAX;
        self.messages.drain(..).collect()
    }

    /// The position of the ready message `id`, if it is still here.
    pub fn position(&self, id: u64) -> Option<usize> {
        let position = self.messages.partition_point(|m| m.id < id);
        (self.messages.get(position)?.id == id).then_some(position)
    }

    /// Drops the payload of the ready message at `position` from memory (its
    /// record is in the store, or on its way there).
    pub fn evict_at(&mut self, position: usize) {
        let Some(entry) = self.messages.get_mut(position) else {
            return;
        };
        let Some(message) = entry.message.take() else {
            return;
        };
        self.resident_bytes -= message.accounted_size();
        self.spilled_count += 1;
        self.spilled_bytes += entry.body_size;
    }

    /// Puts a payload read back from the store into the ready message `id`.
    pub fn install(&mut self, id: u64, message: Arc<Message>) -> bool {
        let Some(position) = self.position(id) else {
            return false;
        };
        let entry = &mut self.messages[position];
        entry.loading = false;
        if entry.message.is_some() {
            return false;
        }
        self.resident_bytes += message.accounted_size();
        self.spilled_count -= 1;
        self.spilled_bytes -= entry.body_size;
        entry.message = Some(message);
        if id >= self.spilled_from {
            self.spilled_from = id.saturating_add(1);
        }
        true
    }

    fn count_in(&mut self, message: &QueuedMessage) {
        self.ready_bytes += message.body_size;
        self.resident_bytes += message.resident_size();
        if message.message.is_none() {
            self.spilled_count += 1;
            self.spilled_bytes += message.body_size;
        }
    }

    fn count_out(&mut self, message: &QueuedMessage) {
        self.ready_bytes -= message.body_size;
        self.resident_bytes -= message.resident_size();
        if message.message.is_none() {
            self.spilled_count -= 1;
            self.spilled_bytes -= message.body_size;
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConsumerRef {
    pub session: SessionId,
    pub channel: ChannelId,
    pub tag: String,
}

pub struct VHost {
    pub name: String,
    pub exchanges: HashMap<String, Exchange>,
    pub queues: HashMap<String, Queue>,
}

impl VHost {
    pub fn new(name: &str) -> Self {
        let mut exchanges = HashMap::new();
        for (exchange_name, kind) in [
            ("", ExchangeKind::Direct),
            ("amq.direct", ExchangeKind::Direct),
            ("amq.fanout", ExchangeKind::Fanout),
            ("amq.topic", ExchangeKind::Topic),
            ("amq.headers", ExchangeKind::Headers),
            ("amq.match", ExchangeKind::Headers),
        ] {
            exchanges.insert(
                exchange_name.to_string(),
                Exchange::new(exchange_name, kind, true),
            );
        }
        Self {
            name: name.to_string(),
            exchanges,
            queues: HashMap::new(),
        }
    }
}

pub struct Consumer {
    pub queue: String,
    pub no_ack: bool,
    /// 0 = unlimited.
    pub prefetch: u32,
    pub unacked: u32,
}

/// A delivery awaiting its ack.
pub struct Unacked {
    pub queue: String,
    pub message: QueuedMessage,
    /// None for basic.get.
    pub consumer_tag: Option<String>,
    /// When it was handed to the session, for `broker.consumer_timeout`.
    pub delivered_at: Instant,
}

#[derive(Default)]
pub struct ChannelState {
    pub next_delivery_tag: u64,
    pub unacked: BTreeMap<u64, Unacked>,
    pub consumers: HashMap<String, Consumer>,
    /// basic.qos global=false: applies to consumers started afterwards.
    pub consumer_prefetch: u32,
    /// basic.qos global=true: unacked limit for the whole channel (0 = none).
    pub channel_prefetch: u32,
    pub confirm: bool,
    /// Overfull queues this channel published to: blocked while not empty.
    pub blocked_on: BTreeSet<String>,
    pub blocked_since: Option<Instant>,
    /// An unacked delivery outlived `broker.consumer_timeout`: the channel
    /// was told to close and is not told again while it closes.
    pub ack_timed_out: bool,
    /// tx.select was sent: the uncommitted work (`broker/tx.rs`).
    pub tx: Option<crate::broker::Transaction>,
}

impl ChannelState {
    pub fn take_delivery_tag(&mut self) -> u64 {
        self.next_delivery_tag += 1;
        self.next_delivery_tag
    }

    pub fn has_room(&self, consumer: &Consumer) -> bool {
        let consumer_room = consumer.prefetch == 0 || consumer.unacked < consumer.prefetch;
        let channel_room = self.channel_prefetch == 0
            || (self.unacked.len() as u64) < u64::from(self.channel_prefetch);
        consumer.no_ack || (consumer_room && channel_room)
    }
}

pub struct SessionState {
    pub vhost: String,
    pub user: String,
    pub client_address: String,
    /// The client's AMQP-encoded client-properties (for management).
    pub client_properties: Bytes,
    /// Messages published and deliveries written since the session opened
    /// (for management).
    pub published: u64,
    pub delivered: u64,
    pub events: mpsc::UnboundedSender<SessionEvent>,
    pub channels: HashMap<ChannelId, ChannelState>,
    /// What the gateway may still receive before it reports some written.
    pub credit: crate::credit::DeliveryCredit,
    /// basic.gets waiting for room in `credit`; woken when the gateway
    /// reports deliveries written.
    pub credit_waiters: Vec<oneshot::Sender<()>>,
    /// What the gateway was last told: blocked (and why), or not.
    pub flow_blocked: Option<String>,
    /// Has published: the store quota blocks producers only, so consumers
    /// can go on freeing space.
    pub has_published: bool,
    /// Has published a message the store had to keep: a store failure
    /// (`MST-1101`) blocks these producers only, so transient traffic goes
    /// on.
    pub has_published_persistent: bool,
    /// Its last publish (or commit) spent the last of this queue's pacing
    /// credit: the session waits on it before its next command.
    pub paced_on: Option<String>,
}
