//! The engine's plain data: messages and their place in a queue, where a
//! binding leads, a queue's limits, why a message died, and a delivery
//! awaiting its ack. A leaf: the parts that own state (queues, exchanges,
//! vhosts, sessions and channels, transactions) are built from these.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use amq_protocol_types::FieldTable;
use bytes::Bytes;
use spillway_proto::body::Body;
use spillway_proto::storage::MessageRecord;

use crate::budget::{MemoryBudget, MESSAGE_OVERHEAD_BYTES};

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
    pub trace: Option<Box<spillway_proto::util::trace::SpanContext>>,
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
        let trace = spillway_proto::util::trace::current().map(Box::new);
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
        trace: Option<Box<spillway_proto::util::trace::SpanContext>>,
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
    /// Engine-wide, increasing: a queue is ordered by it (within a
    /// priority), and it keys the message in the store.
    pub id: u64,
    /// Its `priority` property as this queue took it: at most the queue's
    /// `x-max-priority`; 0 on a queue without priorities.
    pub priority: u8,
    /// The payload, or `None` once it flowed to disk: read back before
    /// delivery.
    pub message: Option<Arc<Message>>,
    /// Of the body as published (compressed or not): what queue limits
    /// (`x-max-length-bytes`) and queue depth in bytes count. 32 bits keep
    /// an entry at 40 bytes with its priority (`gateway.max_message_size`
    /// is at most 512 MiB); read it with [`QueuedMessage::body_size`].
    body_len: u32,
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

/// A body size as an entry keeps it; bodies are bounded far below 4 GiB by
/// `gateway.max_message_size` (and the gRPC message limit).
fn body_len(size: u64) -> u32 {
    debug_assert!(size <= u64::from(u32::MAX));
    u32::try_from(size).unwrap_or(u32::MAX)
}

// A queue entry's size is what a backlog of millions costs: keep it at 40.
const _: () = assert!(std::mem::size_of::<QueuedMessage>() <= 40);

impl QueuedMessage {
    pub fn resident(id: u64, message: Arc<Message>) -> Self {
        Self {
            id,
            priority: 0,
            body_len: body_len(message.body.size()),
            persistent: message.persistent,
            message: Some(message),
            delivery_count: 0,
            redelivered: false,
            shared: false,
            loading: false,
            expires_at: 0,
        }
    }

    /// A queued entry whose payload is only in the store (recovered).
    pub fn stored(id: u64, body_size: u64) -> Self {
        Self {
            id,
            priority: 0,
            message: None,
            body_len: body_len(body_size),
            delivery_count: 0,
            redelivered: false,
            persistent: true,
            shared: false,
            loading: false,
            expires_at: 0,
        }
    }

    /// Of the body as published (compressed or not).
    pub fn body_size(&self) -> u64 {
        u64::from(self.body_len)
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

/// The exchange types a client may declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExchangeKind {
    Direct,
    Fanout,
    Topic,
    Headers,
}

impl ExchangeKind {
    pub fn parse(kind: &str) -> Option<Self> {
        match kind {
            "direct" => Some(Self::Direct),
            "fanout" => Some(Self::Fanout),
            "topic" => Some(Self::Topic),
            "headers" => Some(Self::Headers),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Fanout => "fanout",
            Self::Topic => "topic",
            Self::Headers => "headers",
        }
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

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConsumerRef {
    pub session: SessionId,
    pub channel: ChannelId,
    pub tag: String,
    /// The consume's `x-priority` (0 without it): the queue offers a
    /// message to lower priorities only while every higher one is full.
    pub priority: i32,
}

/// A delivery awaiting its ack.
pub struct Unacked {
    pub queue: String,
    pub message: QueuedMessage,
    /// None for basic.get.
    pub consumer_tag: Option<String>,
    /// When it was handed to the session, for `engine.consumer_timeout`.
    pub delivered_at: Instant,
}
