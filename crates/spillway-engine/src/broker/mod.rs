//! The broker: every operation a session can perform, as methods on the state
//! behind the engine's one lock. Methods never wait: what must reach the disk
//! is handed to the [`StoreWriter`] in order, what must reach a client is sent
//! on its session's event channel.
//!
//! This file holds the [`Broker`] itself, sessions and channels, and the
//! small lookups every operation shares. The operations live beside it, one
//! file per concern, each an `impl Broker` block:
//!
//! - `definitions`: declare and delete exchanges and queues, bind, unbind, purge;
//! - `publish`: basic.publish, from routing to the store writes;
//! - `settle`: ack, nack, reject, recover, and putting deliveries back;
//! - `dispatch`: consumers (consume, cancel, qos), handing messages to them,
//!   the gateway's written-deliveries credit, basic.get;
//! - `arguments`: what `x-*` queue arguments mean and when two agree;
//! - `expiry`: message TTL (`expiration`, `x-message-ttl`) and queue TTL
//!   (`x-expires`), on one timer;
//! - `tx`: transactions (tx.select/commit/rollback) and their timeouts;
//! - `pacing`: publisher pacing, a queue's publishers held to the rate it
//!   delivers at;
//! - `flow_to_disk`: the memory budget's side: moving payloads to the store,
//!   reading them back ahead of consumers, housekeeping;
//! - `producer_flow`: blocking publishers on full queues, the store quota,
//!   a store failure and the memory ceiling;
//! - `limits`: admitting sessions, channels, queues, exchanges, bindings
//!   and consumers against the configured limits, and management's view;
//! - `recovery`: start-up recovery's progress, and installing what it read;
//! - `delayed`: delayed messages (`x-delayed-message` exchanges), kept in
//!   the store until due, then routed;
//! - `policies`: which policies apply to each queue and exchange, and what
//!   a policy change does to queues holding messages.
//!
//! The state these work on is owned by the parts outside `broker/`, none of
//! which imports it: queues (`queue.rs`), exchanges and their bindings
//! (`exchange.rs`, `bindings.rs`), vhosts (`vhost.rs`), sessions and
//! channels (`channels.rs`), transactions (`transaction.rs`), pacing
//! (`pacing.rs`), the limits (`limits.rs`) and the plain data of
//! `model.rs`. No `impl Broker` lives outside this folder.

mod arguments;
pub(crate) mod dead_letter;
mod definitions;
pub(crate) mod delayed;
pub(crate) mod direct_reply;
mod dispatch;
mod expiry;
pub(crate) mod flow_to_disk;
pub(crate) mod limits;
mod pacing;
mod policies;
pub(crate) mod producer_flow;
mod publish;
pub(crate) mod recovery;
mod settle;
mod timeouts;
mod tx;

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;

use spillway_amqp::reply_code;
use spillway_proto::engine::{self as pb, session_event::Event, AmqpError, SessionEvent};
use spillway_proto::storage::Durability;
use tokio::sync::mpsc;

use crate::budget::MemoryBudget;
use crate::channels::*;
use crate::exchange::Exchange;
use crate::model::*;
use crate::pacing::{PacingConfig, PacingStats};
use crate::persistence::StoreWriter;
use crate::queue::Queue;
use crate::transaction::TxState;
use crate::vhost::VHost;
use flow_to_disk::LoadRequest;

pub(crate) use arguments::{
    delayed_type, dlq_enabled, recovered_dead_letter, recovered_limits, recovered_max_priority,
    recovered_single_active_consumer, RUNTIME_ARGUMENTS,
};
pub use dead_letter::DeadLetterJob;
pub(crate) use definitions::still_recovering;
pub use dispatch::GetOutcome;
pub(crate) use policies::policy_view;
pub use publish::PublishOutcome;

pub type OpResult<T> = Result<T, AmqpError>;

pub struct Broker {
    pub vhosts: HashMap<String, VHost>,
    pub sessions: HashMap<SessionId, SessionState>,
    next_message_id: u64,
    pub(crate) persist: StoreWriter,
    /// Deliveries in flight to one gateway session before it must report
    /// them written.
    session_credit: u32,
    /// The same in bytes (bodies plus a fixed overhead per delivery).
    session_credit_bytes: u64,
    pub(crate) budget: Arc<MemoryBudget>,
    /// Whether flow to disk is on (see [`flow_to_disk`]).
    pub(crate) flow_active: bool,
    /// Unacknowledged deliveries are past their share of the memory budget:
    /// channels holding many get no more until they ack (`flow_to_disk`).
    pub(crate) unacked_pressure: bool,
    /// How long a delivery may stay unacknowledged before housekeeping
    /// moves its payload to the store (`flow_to_disk`): half the
    /// housekeeping interval.
    pub(crate) unacked_grace: std::time::Duration,
    /// Holders of each message routed to more than one queue; a message
    /// held by one queue is not listed.
    pub(crate) shared_refs: HashMap<u64, u32>,
    /// To the loader task: payloads to read back from the store.
    pub(crate) loads: mpsc::UnboundedSender<LoadRequest>,
    /// The store over its quota or failed, the memory ceiling passed: what
    /// holds producers back broker-wide (`crate::alarms`).
    pub(crate) alarms: crate::alarms::Alarms,
    /// The process's memory ceiling: what it holds for clients, checked
    /// after each publish and at each housekeeping.
    pub(crate) memory_ceiling: Arc<spillway_telemetry::MemoryCeiling>,
    /// Time as the broker reads it ([`spillway_proto::util::clock`]).
    pub(crate) clock: spillway_proto::util::clock::SharedClock,
    pub(crate) consumer_timeout: Option<std::time::Duration>,
    /// `engine.default_maximum_delivery_count` (0 = no limit).
    pub(crate) default_max_deliveries: u64,
    /// Vhost, user and per-connection limits (`crate::limits`).
    pub(crate) limits: crate::limits::Limits,
    /// Start-up recovery's progress (`recovery`).
    pub(crate) recovery: recovery::Recovery,
    /// Message and queue TTL: the queues to look at, and when.
    pub(crate) expiry: expiry::ExpiryTimers,
    /// Transactions: settings, timeouts, the channels with one open.
    pub(crate) tx: TxState,
    /// Publisher pacing (`pacing.rs`): its settings and counts.
    pub(crate) pacing: PacingConfig,
    pacing_stats: PacingStats,
    /// Direct reply-to: each live reply-to name's token, and the channel
    /// whose consumer its replies go to (`direct_reply.rs`).
    reply_routes: HashMap<String, (SessionId, ChannelId)>,
    /// Delayed messages: how many wait per exchange, when the next is due
    /// (`delayed.rs`).
    pub(crate) delayed: delayed::DelayedState,
}

/// What the broker needs from the engine around it besides its
/// configuration: the store writer, the budget it shares with the writer
/// and housekeeping, and the loader task's inbox.
pub struct BrokerParts {
    pub persist: StoreWriter,
    pub budget: Arc<MemoryBudget>,
    pub loads: mpsc::UnboundedSender<LoadRequest>,
}

impl Broker {
    /// A broker with only the default vhost. Each part of the state takes
    /// its own piece of `config` (the one the wiring built); nothing is
    /// copied on the way.
    pub fn new(config: &crate::config::EngineConfig, parts: BrokerParts) -> Self {
        let mut vhosts = HashMap::new();
        vhosts.insert("/".to_string(), VHost::new("/"));
        Self {
            vhosts,
            sessions: HashMap::new(),
            next_message_id: 1,
            persist: parts.persist,
            session_credit: config.settings.session_credit.max(1),
            session_credit_bytes: config.settings.session_credit_bytes.max(1),
            budget: parts.budget,
            flow_active: false,
            unacked_pressure: false,
            unacked_grace: config.settings.housekeeping_interval / 2,
            shared_refs: HashMap::new(),
            loads: parts.loads,
            alarms: crate::alarms::Alarms::default(),
            memory_ceiling: config.memory_ceiling.clone(),
            clock: config.clock.clone(),
            consumer_timeout: config.settings.consumer_timeout(),
            default_max_deliveries: config.settings.default_maximum_delivery_count,
            limits: crate::limits::Limits::new(config.settings.limits()),
            recovery: recovery::Recovery::none(),
            expiry: expiry::ExpiryTimers::default(),
            tx: TxState::new(config.settings.transactions()),
            pacing: config.settings.pacing(),
            pacing_stats: PacingStats::default(),
            reply_routes: HashMap::new(),
            delayed: delayed::DelayedState::default(),
        }
    }

    pub fn set_next_message_id(&mut self, next: u64) {
        self.next_message_id = self.next_message_id.max(next);
    }

    /// Reserves `count` consecutive message ids (management's move);
    /// returns the first.
    pub(crate) fn reserve_message_ids(&mut self, count: u64) -> u64 {
        let first = self.next_message_id;
        self.next_message_id += count;
        first
    }

    // ------------------------------------------------------------ sessions

    pub fn open_session(
        &mut self,
        id: SessionId,
        open: &pb::OpenSession,
        events: tokio::sync::mpsc::UnboundedSender<SessionEvent>,
    ) -> OpResult<()> {
        if !self.vhosts.contains_key(&open.vhost) {
            return Err(AmqpError::new(
                reply_code::NOT_ALLOWED,
                format!("vhost '{}' not found", open.vhost),
            ));
        }
        self.sessions.insert(
            id,
            SessionState {
                vhost: open.vhost.clone(),
                user: open.user.clone(),
                client_address: open.client_address.clone(),
                client_properties: open.client_properties.clone(),
                published: 0,
                delivered: 0,
                events,
                channels: HashMap::new(),
                credit: crate::credit::DeliveryCredit::new(
                    self.session_credit,
                    self.session_credit_bytes,
                ),
                credit_waiters: Vec::new(),
                flow_blocked: None,
                flow_channels: (Vec::new(), false),
                has_published: false,
                has_published_persistent: false,
                paced_on: None,
            },
        );
        tracing::debug!(session = id, vhost = %open.vhost, user = %open.user, "session opened");
        // Told at once when the store is over its quota.
        self.update_session_flow(id);
        Ok(())
    }

    pub fn close_session(&mut self, id: SessionId) {
        let Some(session) = self.sessions.get(&id) else {
            return;
        };
        let channels: Vec<ChannelId> = session.channels.keys().copied().collect();
        let vhost = session.vhost.clone();
        for channel in channels {
            self.close_channel(id, channel);
        }
        let exclusive: Vec<String> = self
            .vhosts
            .get(&vhost)
            .map(|v| {
                v.queues
                    .values()
                    .filter(|q| q.exclusive_owner == Some(id))
                    .map(|q| q.name.clone())
                    .collect()
            })
            .unwrap_or_default();
        for queue in exclusive {
            self.remove_queue(&vhost, &queue);
        }
        self.sessions.remove(&id);
    }

    pub fn open_channel(
        &mut self,
        session: SessionId,
        channel: ChannelId,
        amqp1_link: Option<spillway_proto::management::Amqp1Link>,
    ) -> OpResult<()> {
        let state = self.session_mut(session)?;
        if state.channels.contains_key(&channel) {
            return Err(AmqpError::new(
                reply_code::CHANNEL_ERROR,
                format!("channel {channel} already open"),
            ));
        }
        state.channels.insert(
            channel,
            ChannelState {
                amqp1_link,
                ..ChannelState::default()
            },
        );
        Ok(())
    }

    /// Cancels the channel's consumers, rolls back its transaction and
    /// requeues its unacked deliveries.
    pub fn close_channel(&mut self, session: SessionId, channel: ChannelId) {
        let Some(state) = self.sessions.get_mut(&session) else {
            return;
        };
        let vhost = state.vhost.clone();
        let Some(mut channel_state) = state.channels.remove(&channel) else {
            return;
        };
        self.forget_direct_reply(channel_state.direct_reply.take());
        if !channel_state.blocked_on.is_empty() {
            self.forget_blocked_channel(session, channel, &vhost, &channel_state.blocked_on);
        }
        // An open transaction is rolled back: its held deliveries go back.
        let mut touched = self.tx_close(session, channel, &vhost, channel_state.tx);
        for (tag, consumer) in &channel_state.consumers {
            self.detach_consumer(&vhost, &consumer.queue, session, channel, tag);
            touched.push(consumer.queue.clone());
        }
        let mut ops = Vec::new();
        let mut dead_letters = Vec::new();
        for (_, unacked) in channel_state.unacked.into_iter().rev() {
            self.return_delivery(&vhost, unacked, &mut ops, &mut touched, &mut dead_letters);
        }
        self.persist.submit(ops, Durability::Logged, None);
        let dead_lettered = self.dead_letter(&vhost, dead_letters);
        touched.sort();
        touched.dedup();
        for queue in &touched {
            self.auto_delete_if_unused(&vhost, queue);
            self.dispatch(&vhost, queue);
        }
        self.dispatch_all(&vhost, dead_lettered);
    }

    pub fn confirm_select(&mut self, session: SessionId, channel: ChannelId) -> OpResult<()> {
        let state = self.channel_mut(session, channel)?;
        if state.tx.is_some() {
            return Err(AmqpError::new(
                reply_code::PRECONDITION_FAILED,
                "cannot switch from tx to confirm mode",
            ));
        }
        state.confirm = true;
        Ok(())
    }

    // -------------------------------------------------------------- helpers

    fn send(&self, session: SessionId, event_body: Event) {
        if let Some(state) = self.sessions.get(&session) {
            let _ = state.events.send(event(event_body));
        }
    }

    fn session_mut(&mut self, session: SessionId) -> OpResult<&mut SessionState> {
        self.sessions
            .get_mut(&session)
            .ok_or_else(|| AmqpError::new(reply_code::CHANNEL_ERROR, "session not open"))
    }

    fn session_vhost(&self, session: SessionId) -> OpResult<String> {
        self.sessions
            .get(&session)
            .map(|s| s.vhost.clone())
            .ok_or_else(|| AmqpError::new(reply_code::CHANNEL_ERROR, "session not open"))
    }

    fn channel_mut(
        &mut self,
        session: SessionId,
        channel: ChannelId,
    ) -> OpResult<&mut ChannelState> {
        self.session_mut(session)?
            .channels
            .get_mut(&channel)
            .ok_or_else(|| {
                AmqpError::new(
                    reply_code::CHANNEL_ERROR,
                    format!("expected 'channel.open' on channel {channel}"),
                )
            })
    }

    fn vhost_mut(&mut self, name: &str) -> OpResult<&mut VHost> {
        self.vhosts.get_mut(name).ok_or_else(|| {
            AmqpError::new(reply_code::NOT_ALLOWED, format!("vhost '{name}' not found"))
        })
    }

    pub(crate) fn queue_mut_opt(&mut self, vhost: &str, queue: &str) -> Option<&mut Queue> {
        self.vhosts.get_mut(vhost)?.queues.get_mut(queue)
    }
}

fn find_queue<'a>(vhost: &'a VHost, name: &str, vhost_name: &str) -> OpResult<&'a Queue> {
    vhost.queues.get(name).ok_or_else(|| {
        AmqpError::new(
            reply_code::NOT_FOUND,
            format!("no queue '{name}' in vhost '{vhost_name}'"),
        )
    })
}

fn find_queue_mut<'a>(
    vhost: &'a mut VHost,
    name: &str,
    vhost_name: &str,
) -> OpResult<&'a mut Queue> {
    vhost.queues.get_mut(name).ok_or_else(|| {
        AmqpError::new(
            reply_code::NOT_FOUND,
            format!("no queue '{name}' in vhost '{vhost_name}'"),
        )
    })
}

fn find_exchange<'a>(vhost: &'a VHost, name: &str, vhost_name: &str) -> OpResult<&'a Exchange> {
    vhost.exchanges.get(name).ok_or_else(|| {
        AmqpError::new(
            reply_code::NOT_FOUND,
            format!("no exchange '{name}' in vhost '{vhost_name}'"),
        )
    })
}

fn check_exclusive(queue: &Queue, session: SessionId, vhost_name: &str) -> OpResult<()> {
    match queue.exclusive_owner {
        Some(owner) if owner != session => Err(AmqpError::new(
            reply_code::RESOURCE_LOCKED,
            format!(
                "cannot obtain exclusive access to locked queue '{}' in vhost '{}'",
                queue.name, vhost_name
            ),
        )),
        _ => Ok(()),
    }
}

pub(crate) use crate::persistence::store_op as op;

pub fn event(event: Event) -> SessionEvent {
    SessionEvent { event: Some(event) }
}
