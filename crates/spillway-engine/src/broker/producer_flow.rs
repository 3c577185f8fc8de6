//! Producer flow control: per-queue capacity (Qpid's `x-qpid-capacity`,
//! `x-qpid-flow-resume-capacity`, `qpid.max_count`) and the store's disk
//! quota.
//!
//! A queue over its capacity is overfull (`QUE-1003`). Every channel that
//! publishes to an overfull queue is blocked on it (`CHN-1005`); when the
//! queue falls below its resume capacity it is underfull again (`QUE-1004`)
//! and the channels blocked only on underfull queues are released
//! (`CHN-1006`). While the store is over its quota, or the process's memory
//! ceiling is passed (`BRK-1101`, [`Broker::check_memory_ceiling`]), every
//! connection that has published is blocked. The gateway hears one [`FlowControl`] event per connection
//! whenever that connection's state changes: it tells clients that
//! understand `connection.blocked`, and stops reading connections that keep
//! publishing past their overdraft. The message that finds a queue overfull
//! is accepted: flow control slows producers down, it never drops.
//!
//! [`FlowControl`]: spillway_proto::engine::FlowControl

use std::time::Duration;

use spillway_proto::engine::{self as pb, session_event::Event};

use crate::broker::{event, Broker};
use crate::format::thousands;
use crate::model::{ChannelId, SessionId};

/// A channel held back by flow control, for management and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockedChannel {
    pub session: SessionId,
    pub channel: ChannelId,
    pub user: String,
    pub client_address: String,
    pub vhost: String,
    /// The overfull queues it published to; empty when only the store
    /// quota or the memory ceiling holds it.
    pub queues: Vec<String>,
    pub store_overfull: bool,
    /// Held by the memory ceiling (`engine.memory_high_watermark`).
    pub memory_alarm: bool,
    pub blocked_for: Duration,
}

impl Broker {
    /// After a publish from `channel` landed on `queue`: the queue may have
    /// become overfull, and a channel publishing to an overfull queue is
    /// blocked on it.
    pub(crate) fn after_publish(
        &mut self,
        session: SessionId,
        channel: ChannelId,
        vhost: &str,
        queue_name: &str,
    ) {
        // A drop-head limit may have taken it below its resume capacity.
        self.check_underfull(vhost, queue_name);
        let now = self.clock.now();
        let Some(queue) = self.queue_mut_opt(vhost, queue_name) else {
            return;
        };
        if !queue.overfull && queue.over_capacity() {
            queue.overfull = true;
            match (queue.limits.capacity, queue.limits.max_count) {
                (Some(capacity), _) if queue.ready_bytes > capacity => tracing::info!(
                    code = "QUE-1003",
                    vhost,
                    queue = queue_name,
                    size = queue.ready_bytes,
                    capacity,
                    "QUE-1003 : Overfull : Size : {} bytes, Capacity : {}",
                    thousands(queue.ready_bytes),
                    thousands(capacity)
                ),
                (_, Some(max_count)) => tracing::info!(
                    code = "QUE-1003",
                    vhost,
                    queue = queue_name,
                    size = queue.messages.len(),
                    capacity = max_count,
                    "QUE-1003 : Overfull : Size : {} messages, Capacity : {}",
                    thousands(queue.messages.len() as u64),
                    thousands(max_count)
                ),
                _ => {}
            }
        }
        if !queue.overfull || !queue.blocked_channels.insert((session, channel)) {
            return;
        }
        let Some(state) = self
            .sessions
            .get_mut(&session)
            .and_then(|s| s.channels.get_mut(&channel))
        else {
            return;
        };
        let was_free = state.blocked_on.is_empty();
        state.blocked_on.insert(queue_name.to_string());
        if was_free {
            state.blocked_since = Some(now);
            tracing::info!(
                code = "CHN-1005",
                session,
                channel,
                vhost,
                queue = queue_name,
                "CHN-1005 : Flow Control Enforced (Queue {queue_name})"
            );
        }
        self.update_session_flow(session);
    }

    /// After messages left `queue`: an overfull queue below its resume
    /// capacity becomes underfull and releases its channels.
    pub(crate) fn check_underfull(&mut self, vhost: &str, queue_name: &str) {
        let Some(queue) = self.queue_mut_opt(vhost, queue_name) else {
            return;
        };
        if !queue.overfull || !queue.under_resume_capacity() {
            return;
        }
        queue.overfull = false;
        tracing::info!(
            code = "QUE-1004",
            vhost,
            queue = queue_name,
            size = queue.ready_bytes,
            resume_capacity = queue.limits.resume_capacity.unwrap_or(0),
            "QUE-1004 : Underfull : Size : {} bytes, Resume Capacity : {}",
            thousands(queue.ready_bytes),
            thousands(queue.limits.resume_capacity.unwrap_or(0))
        );
        let blocked = std::mem::take(&mut queue.blocked_channels);
        self.release(vhost, queue_name, blocked);
    }

    /// A deleted queue lets its blocked channels go.
    pub(crate) fn release(
        &mut self,
        vhost: &str,
        queue_name: &str,
        blocked: std::collections::BTreeSet<(SessionId, ChannelId)>,
    ) {
        let mut sessions = Vec::new();
        for (session, channel) in blocked {
            let Some(state) = self
                .sessions
                .get_mut(&session)
                .and_then(|s| s.channels.get_mut(&channel))
            else {
                continue;
            };
            if !state.blocked_on.remove(queue_name) || !state.blocked_on.is_empty() {
                continue;
            }
            state.blocked_since = None;
            tracing::info!(
                code = "CHN-1006",
                session,
                channel,
                vhost,
                "CHN-1006 : Flow Control Removed"
            );
            sessions.push(session);
        }
        sessions.dedup();
        for session in sessions {
            self.update_session_flow(session);
        }
    }

    /// A closing channel is no longer blocked on anything.
    pub(crate) fn forget_blocked_channel(
        &mut self,
        session: SessionId,
        channel: ChannelId,
        vhost: &str,
        queues: &std::collections::BTreeSet<String>,
    ) {
        for name in queues {
            if let Some(queue) = self.queue_mut_opt(vhost, name) {
                queue.blocked_channels.remove(&(session, channel));
            }
        }
        self.update_session_flow(session);
    }

    /// A session's first publish makes it a producer: the store quota
    /// holds it from then on.
    pub(crate) fn note_producer(&mut self, session: SessionId) {
        let Some(state) = self.sessions.get_mut(&session) else {
            return;
        };
        if state.has_published {
            return;
        }
        state.has_published = true;
        if self.alarms.store_overfull() || self.alarms.memory().is_some() {
            self.update_session_flow(session);
        }
    }

    /// The storage node's disk quota state: while overfull, every
    /// connection that publishes is blocked (connections that only consume
    /// go on, so that they can free space).
    pub fn set_store_overfull(&mut self, overfull: bool) {
        if !self.alarms.set_store_overfull(overfull, self.clock.now()) {
            return;
        }
        tracing::info!(store_overfull = overfull, "store quota state changed");
        let sessions: Vec<SessionId> = self.sessions.keys().copied().collect();
        for session in sessions {
            self.update_session_flow(session);
        }
    }

    /// Compares what the process holds for clients with
    /// `engine.memory_high_watermark` (after each publish, and at each
    /// housekeeping). Passing it blocks every connection that has published
    /// (`BRK-1101`) until it is back under (`BRK-1102`); while passed, new
    /// connections are refused ([`Broker::admit_session`]).
    pub(crate) fn check_memory_ceiling(&mut self) {
        let over = self.memory_ceiling.over();
        if !self.alarms.set_memory(over, self.clock.now()) {
            return;
        }
        match over {
            Some(over) => tracing::warn!(
                code = "BRK-1101",
                held_bytes = over.held,
                high_watermark_bytes = over.high_watermark,
                "BRK-1101 : Memory high watermark reached : {} bytes held for clients, watermark {} : publishers blocked, new connections refused",
                thousands(over.held),
                thousands(over.high_watermark)
            ),
            None => tracing::info!(
                code = "BRK-1102",
                held_bytes = self.memory_ceiling.held(),
                high_watermark_bytes = self.memory_ceiling.high_watermark(),
                "BRK-1102 : Memory high watermark cleared : {} bytes held for clients, watermark {}",
                thousands(self.memory_ceiling.held()),
                thousands(self.memory_ceiling.high_watermark())
            ),
        }
        let sessions: Vec<SessionId> = self.sessions.keys().copied().collect();
        for session in sessions {
            self.update_session_flow(session);
        }
    }

    /// The store's permanent failure state (`MST-1101`/`MST-1102`): while
    /// failed, every connection that published persistent messages is
    /// blocked, as the disk quota blocks producers; transient traffic goes
    /// on.
    pub fn set_store_failure(&mut self, failure: Option<String>) {
        if !self.alarms.set_store_failure(failure, self.clock.now()) {
            return;
        }
        tracing::info!(
            store_failed = self.alarms.store_failure().is_some(),
            "store failure state changed"
        );
        let sessions: Vec<SessionId> = self.sessions.keys().copied().collect();
        for session in sessions {
            self.update_session_flow(session);
        }
    }

    /// A session that has published a message the store keeps: a store
    /// failure blocks it from now on.
    pub(crate) fn note_persistent_producer(&mut self, session: SessionId) {
        let Some(state) = self.sessions.get_mut(&session) else {
            return;
        };
        if state.has_published_persistent {
            return;
        }
        state.has_published_persistent = true;
        if self.alarms.store_failure().is_some() {
            self.update_session_flow(session);
        }
    }

    /// Tells the gateway when the connection's flow state changed.
    pub(crate) fn update_session_flow(&mut self, session: SessionId) {
        let store_overfull = self.alarms.store_overfull();
        let memory_alarm = self.alarms.memory();
        let store_failure = self.alarms.store_failure().map(str::to_string);
        let Some(state) = self.sessions.get_mut(&session) else {
            return;
        };
        // Held whatever they publish to: the store or the memory ceiling.
        let all = (store_overfull || memory_alarm.is_some()) && state.has_published
            || store_failure.is_some() && state.has_published_persistent;
        let queues: Vec<&String> = state
            .channels
            .values()
            .flat_map(|c| c.blocked_on.iter())
            .collect();
        let reason = if let Some(queue) = queues.first() {
            Some(format!("queue '{queue}' is overfull"))
        } else if let Some(over) = memory_alarm.filter(|_| state.has_published) {
            Some(over.to_string())
        } else if store_overfull && state.has_published {
            Some("store overfull".to_string())
        } else {
            store_failure
                .filter(|_| state.has_published_persistent)
                .map(|failure| format!("store failure: {failure}"))
        };
        let mut channels: Vec<ChannelId> = state
            .channels
            .iter()
            .filter(|(_, channel)| !channel.blocked_on.is_empty())
            .map(|(id, _)| *id)
            .collect();
        channels.sort_unstable();
        let held = (channels, all);
        if reason == state.flow_blocked && held == state.flow_channels {
            return;
        }
        let blocked = reason.is_some();
        // The change from free to blocked and back is news to a 0-9-1
        // client (which ignores a repeat); which channels are held is news
        // to a 1.0 client, whose links are held one by one.
        let news = state.flow_blocked.is_some() != blocked || held != state.flow_channels;
        state.flow_blocked = reason.clone();
        state.flow_channels = held.clone();
        if news {
            let _ = state.events.send(event(Event::FlowControl(pb::FlowControl {
                blocked,
                reason: reason.unwrap_or_default(),
                blocked_channels: held.0.clone(),
                all_channels: held.1,
            })));
        }
    }

    /// Every channel held back right now, and why.
    pub fn blocked_channels(&self) -> Vec<BlockedChannel> {
        let now = self.clock.now();
        let mut blocked = Vec::new();
        for (id, session) in &self.sessions {
            let overfull_since = self
                .alarms
                .store_overfull_since()
                .filter(|_| session.has_published);
            let memory_since = self.alarms.memory_since().filter(|_| session.has_published);
            let failed_since = self
                .alarms
                .store_failed_since()
                .filter(|_| session.has_published_persistent);
            let store_since = [overfull_since, failed_since, memory_since]
                .into_iter()
                .flatten()
                .min();
            for (channel_id, channel) in &session.channels {
                let since = match (channel.blocked_since, store_since) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let Some(since) = since else {
                    continue;
                };
                blocked.push(BlockedChannel {
                    session: *id,
                    channel: *channel_id,
                    user: session.user.clone(),
                    client_address: session.client_address.clone(),
                    vhost: session.vhost.clone(),
                    queues: channel.blocked_on.iter().cloned().collect(),
                    store_overfull: overfull_since.is_some(),
                    memory_alarm: memory_since.is_some(),
                    blocked_for: now.saturating_duration_since(since),
                });
            }
        }
        blocked.sort_by_key(|b| (b.session, b.channel));
        blocked
    }
}
