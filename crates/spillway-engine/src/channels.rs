//! Sessions (one per client connection) and their channels: consumers,
//! unacknowledged deliveries, prefetch, confirm and transaction mode, and
//! what the session was last told about flow.

use foldhash::HashMap;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use bytes::Bytes;
use spillway_proto::engine::SessionEvent;
use tokio::sync::{mpsc, oneshot};

use crate::credit::DeliveryCredit;
use crate::model::*;
use crate::transaction::Transaction;

pub struct Consumer {
    pub queue: String,
    pub no_ack: bool,
    /// 0 = unlimited.
    pub prefetch: u32,
    pub unacked: u32,
    /// Set for a consumer that takes deliveries only within credit (an
    /// AMQP 1.0 sending link): `basic.qos` caps what it holds, this what
    /// it is handed.
    pub credit: Option<CreditWindow>,
}

/// A credit-limited consumer's deliveries against its limit, both counted
/// from when it started (`ConsumerCredit` in the engine protocol).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CreditWindow {
    pub delivered: u64,
    pub limit: u64,
}

impl CreditWindow {
    pub fn has_room(&self) -> bool {
        self.delivered < self.limit
    }
}

/// A channel's direct reply-to consumer (`broker/direct_reply.rs`).
pub struct DirectReplyConsumer {
    pub tag: String,
    /// What follows `amq.rabbitmq.reply-to.` in this channel's reply-to
    /// name: random, so that one client cannot guess another's.
    pub token: String,
}

#[derive(Default)]
pub struct ChannelState {
    pub next_delivery_tag: u64,
    pub unacked: BTreeMap<u64, Unacked>,
    pub consumers: HashMap<String, Consumer>,
    /// Its consumer on `amq.rabbitmq.reply-to`, if it has one.
    pub direct_reply: Option<DirectReplyConsumer>,
    /// basic.qos global=false: applies to consumers started afterwards.
    pub consumer_prefetch: u32,
    /// basic.qos global=true: unacked limit for the whole channel, shared by
    /// its consumers (0 = none). A later global=false qos lifts it, as in
    /// RabbitMQ.
    pub channel_prefetch: u32,
    pub confirm: bool,
    /// Overfull queues this channel published to: blocked while not empty.
    pub blocked_on: BTreeSet<String>,
    pub blocked_since: Option<Instant>,
    /// An unacked delivery outlived `engine.consumer_timeout`: the channel
    /// was told to close and is not told again while it closes.
    pub ack_timed_out: bool,
    /// tx.select was sent: the uncommitted work (`broker/tx.rs`).
    pub tx: Option<Transaction>,
    /// The AMQP 1.0 link this channel carries, as management shows it
    /// (the gateway bounds its strings).
    pub amqp1_link: Option<spillway_proto::management::Amqp1Link>,
}

impl ChannelState {
    /// Calls `visit` with each run of its unacknowledged deliveries that
    /// came from one queue: `(queue, how many)`. A channel's deliveries
    /// mostly come from one queue, so a count by queue costs one lookup per
    /// run rather than one per delivery (a consumer with no prefetch can
    /// hold hundreds of thousands, and counts are taken under the broker
    /// lock).
    pub fn unacked_runs<'a>(&'a self, mut visit: impl FnMut(&'a str, u64)) {
        let mut run: Option<(&str, u64)> = None;
        for delivery in self.unacked.values() {
            let queue = delivery.queue.as_str();
            match &mut run {
                Some((current, count)) if *current == queue => *count += 1,
                _ => {
                    if let Some((finished, count)) = run.replace((queue, 1)) {
                        visit(finished, count);
                    }
                }
            }
        }
        if let Some((finished, count)) = run {
            visit(finished, count);
        }
    }

    pub fn take_delivery_tag(&mut self) -> u64 {
        self.next_delivery_tag += 1;
        self.next_delivery_tag
    }

    pub fn has_room(&self, consumer: &Consumer) -> bool {
        if consumer.credit.is_some_and(|credit| !credit.has_room()) {
            return false;
        }
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
    pub credit: DeliveryCredit,
    /// basic.gets waiting for room in `credit`; woken when the gateway
    /// reports deliveries written.
    pub credit_waiters: Vec<oneshot::Sender<()>>,
    /// What the gateway was last told: blocked (and why), or not.
    pub flow_blocked: Option<String>,
    /// What the gateway was last told of which channels are held, and
    /// whether all are (see `FlowControl.blocked_channels`).
    pub flow_channels: (Vec<ChannelId>, bool),
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
