//! Message and queue TTL: the `expiration` property, `x-message-ttl` and
//! `x-expires`.
//!
//! A message's expiry is fixed when it is enqueued (the lower of its
//! `expiration` and the queue's `x-message-ttl`, from that moment) and kept
//! with its queue entry: across requeues and, for persistent messages on
//! durable queues, in the store, so a restart keeps it.
//!
//! Expiry works from the head, as RabbitMQ's does: a message whose time has
//! passed leaves its queue when it is at the head — dead-lettered with
//! reason `expired`, or discarded, and what the store holds for it deleted.
//! Nothing is ever delivered (basic.deliver or basic.get-ok) past its time:
//! dispatch and basic.get look at each head before handing it out.
//!
//! One timer for the whole broker: a set of (when, vhost, queue), at most
//! one entry per queue (the earliest asked for), served by the engine's
//! expiry task ([`Broker::run_expiry`]), which sleeps until the first is
//! due. A queue is scheduled when a message with an expiry is enqueued or
//! requeued and, for `x-expires`, whenever it becomes unused; when its time
//! comes the queue is looked at again and scheduled for what is next.

use std::collections::BTreeSet;
use std::sync::Arc;

use tokio::sync::Notify;

use super::Broker;
use crate::model::*;
use crate::queue::Queue;

/// Expired messages let go of per queue in one pass under the broker lock;
/// more are left to the next pass, at once.
const EXPIRE_BATCH: usize = 4096;

/// The broker's one expiry timer.
#[derive(Default)]
pub struct ExpiryTimers {
    /// (when, vhost, queue): the queues to look at, earliest first.
    due: BTreeSet<(u64, String, String)>,
    /// Wakes the expiry task when a new earliest time is scheduled.
    wake: Arc<Notify>,
}

impl ExpiryTimers {
    /// What the expiry task waits on besides the clock.
    pub fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// Asks for `queue` to be looked at by `when` (ms since the epoch); an
    /// earlier time already asked for stands.
    pub(crate) fn schedule(&mut self, vhost: &str, queue: &mut Queue, when: u64) {
        if queue.expiry_check_at != 0 && queue.expiry_check_at <= when {
            return;
        }
        if queue.expiry_check_at != 0 {
            self.due
                .remove(&(queue.expiry_check_at, vhost.to_string(), queue.name.clone()));
        }
        let earliest = self.due.first().is_none_or(|(first, _, _)| when < *first);
        queue.expiry_check_at = when;
        self.due
            .insert((when, vhost.to_string(), queue.name.clone()));
        if earliest {
            self.wake.notify_one();
        }
    }

    /// Takes the queues due by `now`.
    fn take_due(&mut self, now: u64) -> Vec<(String, String)> {
        let mut taken = Vec::new();
        while let Some(first) = self.due.first() {
            if first.0 > now {
                break;
            }
            if let Some((_, vhost, queue)) = self.due.pop_first() {
                taken.push((vhost, queue));
            }
        }
        taken
    }

    fn next(&self) -> Option<u64> {
        self.due.first().map(|(when, _, _)| *when)
    }
}

/// When the queue must next be looked at, for its head's expiry and its
/// own `x-expires` (None: nothing to wait for).
pub(super) fn next_check(queue: &Queue) -> Option<u64> {
    let head = queue
        .messages
        .front()
        .filter(|head| head.expires_at != 0)
        // Expired the millisecond after its last deliverable one.
        .map(|head| head.expires_at.saturating_add(1));
    let unused = queue
        .limits
        .expires
        .filter(|_| queue.consumers.is_empty())
        .map(|expires| queue.last_used.saturating_add(expires));
    match (head, unused) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The expiry of a message enqueued `now` with `message_ttl` (its
/// `expiration`) on a queue with `queue_ttl` (`x-message-ttl`): the lower
/// wins; 0 = never.
pub(crate) fn expires_at(now: u64, message_ttl: Option<u64>, queue_ttl: Option<u64>) -> u64 {
    let ttl = match (message_ttl, queue_ttl) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => match a.or(b) {
            Some(ttl) => ttl,
            None => return 0,
        },
    };
    // 0 means never: a message due at the epoch's first millisecond is
    // due at the second.
    now.saturating_add(ttl).max(1)
}

impl Broker {
    /// The expiry task's pass: looks at every queue whose time has come —
    /// expires its head, deletes it if unused past `x-expires` — and
    /// returns when the next is due.
    pub fn run_expiry(&mut self, now: u64) -> Option<u64> {
        for (vhost, queue) in self.expiry.take_due(now) {
            let Some(entry) = self.queue_mut_opt(&vhost, &queue) else {
                continue;
            };
            entry.expiry_check_at = 0;
            let unused_since = entry
                .limits
                .expires
                .filter(|_| entry.consumers.is_empty())
                .filter(|expires| now >= entry.last_used.saturating_add(*expires))
                .map(|expires| (expires, entry.messages.len()));
            if let Some((expires, depth)) = unused_since {
                tracing::info!(
                    code = "QUE-1002",
                    vhost = %vhost,
                    queue = %queue,
                    expires_ms = expires,
                    messages = depth,
                    "QUE-1002 : Deleted : Queue {} : unused for {} ms (x-expires)",
                    queue,
                    crate::format::thousands(expires)
                );
                self.remove_queue(&vhost, &queue);
                continue;
            }
            let touched = self.expire_head(&vhost, &queue, now);
            self.dispatch_all(&vhost, touched);
            self.reschedule_expiry(&vhost, &queue);
        }
        self.expiry.next()
    }

    /// Schedules the queue for its head's expiry and its `x-expires`.
    pub(crate) fn reschedule_expiry(&mut self, vhost: &str, queue: &str) {
        let Self { vhosts, expiry, .. } = self;
        let Some(queue) = vhosts.get_mut(vhost).and_then(|v| v.queues.get_mut(queue)) else {
            return;
        };
        if let Some(when) = next_check(queue) {
            expiry.schedule(vhost, queue, when);
        }
    }

    /// The queue was used (declared, read with basic.get, left by its last
    /// consumer): its `x-expires` starts again from now.
    pub(crate) fn touch_queue(&mut self, vhost: &str, queue: &str) {
        let now = self.clock.unix_millis();
        let Some(entry) = self.queue_mut_opt(vhost, queue) else {
            return;
        };
        entry.last_used = now;
        if entry.limits.expires.is_some() {
            self.reschedule_expiry(vhost, queue);
        }
    }

    /// Schedules every queue after recovery: recovered messages keep their
    /// expiry, and `x-expires` counts from the start.
    pub(crate) fn schedule_recovered_expiries(&mut self) {
        let now = self.clock.unix_millis();
        let mut names = Vec::new();
        for vhost in self.vhosts.values_mut() {
            for queue in vhost.queues.values_mut() {
                queue.last_used = now;
                names.push((vhost.name.clone(), queue.name.clone()));
            }
        }
        for (vhost, queue) in names {
            self.reschedule_expiry(&vhost, &queue);
        }
    }

    /// Lets go of the queue's expired messages at its head (as of `now`),
    /// at most a batch of them (the rest at once, by the timer): dead-letters
    /// them (reason `expired`) or discards them. Returns the queues that
    /// received dead letters, to dispatch.
    pub(crate) fn expire_head(&mut self, vhost: &str, queue_name: &str, now: u64) -> Vec<String> {
        let Self { vhosts, expiry, .. } = self;
        let Some(queue) = vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(queue_name))
        else {
            return Vec::new();
        };
        let mut expired = Vec::new();
        while expired.len() < EXPIRE_BATCH && queue.messages.front().is_some_and(|m| m.expired(now))
        {
            if let Some(entry) = queue.dequeue() {
                expired.push(entry);
            }
        }
        if queue.messages.front().is_some_and(|m| m.expired(now)) {
            // More than a batch: the rest on the timer's next pass.
            expiry.schedule(vhost, queue, now);
        }
        self.let_expired_go(vhost, queue_name, expired)
    }

    /// Dead-letters (reason `expired`) or discards messages taken off the
    /// queue because their time passed; logs `QUE-1103` once for them.
    pub(crate) fn let_expired_go(
        &mut self,
        vhost: &str,
        queue_name: &str,
        expired: Vec<QueuedMessage>,
    ) -> Vec<String> {
        if expired.is_empty() {
            return Vec::new();
        }
        let count = expired.len();
        let Some(queue) = self.queue_mut_opt(vhost, queue_name) else {
            return Vec::new();
        };
        match queue.dead_letter.as_ref().map(|t| t.exchange.clone()) {
            Some(exchange) => tracing::info!(
                code = "QUE-1103",
                vhost,
                queue = queue_name,
                messages = count,
                exchange = %exchange,
                "QUE-1103 : Expired : {} messages of queue {} : dead-lettered to exchange {}",
                crate::format::thousands(count as u64),
                queue_name,
                exchange
            ),
            None => tracing::info!(
                code = "QUE-1103",
                vhost,
                queue = queue_name,
                messages = count,
                "QUE-1103 : Expired : {} messages of queue {} : discarded",
                crate::format::thousands(count as u64),
                queue_name
            ),
        }
        let touched = self.let_go(vhost, queue_name, expired, DeathReason::Expired);
        self.check_underfull(vhost, queue_name);
        touched
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lower_ttl_wins() {
        assert_eq!(expires_at(1000, None, None), 0);
        assert_eq!(expires_at(1000, Some(50), None), 1050);
        assert_eq!(expires_at(1000, None, Some(70)), 1070);
        assert_eq!(expires_at(1000, Some(50), Some(20)), 1020);
        assert_eq!(expires_at(1000, Some(0), Some(20)), 1000);
    }
}
