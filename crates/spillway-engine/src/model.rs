//! The engine's in-memory model: vhosts hold exchanges and queues; sessions
//! (one per client connection) hold channels, consumers and unacknowledged
//! deliveries. Everything here is plain data guarded by the broker lock.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use amq_protocol_types::FieldTable;
use bytes::Bytes;
use spillway_proto::engine::SessionEvent;
use tokio::sync::mpsc;

use crate::routing::ExchangeKind;

pub type SessionId = u64;
pub type ChannelId = u32;

/// A published message. Shared (not copied) by every queue it was routed to.
#[derive(Debug)]
pub struct Message {
    pub exchange: String,
    pub routing_key: String,
    /// The content header's property flags and list, exactly as published.
    pub properties: Bytes,
    pub body: Bytes,
    /// delivery-mode 2: stored when it lands on a durable queue.
    pub persistent: bool,
}

/// A message's place in one queue.
#[derive(Clone, Debug)]
pub struct QueuedMessage {
    /// Engine-wide, increasing: a queue is ordered by it, and it keys the
    /// message in the store.
    pub id: u64,
    pub message: Arc<Message>,
    pub redelivered: bool,
}

pub struct Exchange {
    pub name: String,
    pub kind: ExchangeKind,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    /// AMQP-encoded, as declared.
    pub arguments: Bytes,
    pub bindings: Vec<Binding>,
}

impl Exchange {
    pub fn new(name: &str, kind: ExchangeKind, durable: bool) -> Self {
        Self {
            name: name.to_string(),
            kind,
            durable,
            auto_delete: false,
            internal: false,
            arguments: Bytes::new(),
            bindings: Vec::new(),
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
    pub arguments: Bytes,
    /// Decoded `arguments`, for headers exchanges.
    pub argument_table: FieldTable,
}

pub struct Queue {
    pub name: String,
    pub durable: bool,
    pub auto_delete: bool,
    /// Set for exclusive queues: only this session may use the queue, and the
    /// queue goes when the session does.
    pub exclusive_owner: Option<SessionId>,
    pub arguments: Bytes,
    pub argument_table: FieldTable,
    pub limits: QueueLimits,
    /// Ready messages, ordered by id. Changed only through the methods below,
    /// which keep `ready_bytes` exact.
    pub messages: VecDeque<QueuedMessage>,
    /// Body bytes of the ready messages.
    pub ready_bytes: u64,
    pub consumers: Vec<ConsumerRef>,
    /// Round-robin position in `consumers`.
    pub next_consumer: usize,
    /// Set once an exclusive (basic.consume exclusive) consumer holds it.
    pub exclusive_consumer: bool,
}

/// RabbitMQ's queue length limits (`x-max-length`, `x-max-length-bytes`,
/// `x-overflow`), counted over ready messages as RabbitMQ does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueLimits {
    pub max_length: Option<u64>,
    pub max_bytes: Option<u64>,
    pub overflow: Overflow,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overflow {
    /// Drop (or, once dead-lettering exists, dead-letter) the oldest.
    #[default]
    DropHead,
    /// Refuse the newest: nacked under publisher confirms.
    RejectPublish,
    /// As RejectPublish, and dead-letter the refused message (dead-letter
    /// exchanges are not built yet, so for now the same as RejectPublish).
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
            arguments: Bytes::new(),
            argument_table: FieldTable::default(),
            limits: QueueLimits::default(),
            messages: VecDeque::new(),
            ready_bytes: 0,
            consumers: Vec::new(),
            next_consumer: 0,
            exclusive_consumer: false,
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

    /// Appends a message; with drop-head, returns the oldest messages dropped
    /// to keep within the limits.
    pub fn enqueue(&mut self, message: QueuedMessage) -> Vec<QueuedMessage> {
        self.ready_bytes += message.message.body.len() as u64;
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
        self.ready_bytes -= message.message.body.len() as u64;
        Some(message)
    }

    /// Puts requeued messages back in id order, ahead of later arrivals.
    pub fn requeue(&mut self, mut message: QueuedMessage) {
        message.redelivered = true;
        self.ready_bytes += message.message.body.len() as u64;
        let position = self.messages.partition_point(|m| m.id < message.id);
        self.messages.insert(position, message);
    }

    /// Appends a message read back from the store at start-up, as it was.
    pub fn push_recovered(&mut self, message: QueuedMessage) {
        self.ready_bytes += message.message.body.len() as u64;
        self.messages.push_back(message);
    }

    pub fn purge(&mut self) -> Vec<QueuedMessage> {
        self.ready_bytes = 0;
        self.messages.drain(..).collect()
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
    /// Deliveries the gateway may still receive before it reports some written.
    pub credit: u32,
}
