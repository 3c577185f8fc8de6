//! Publisher pacing, what the broker does: a publish spends its queues'
//! credit, a delivery earns it back, a waiting publisher is woken or its
//! queue suspended. The state and the rule are in `crate::pacing`.

use std::time::Duration;

use tokio::sync::oneshot;

use super::Broker;
use crate::model::SessionId;
use crate::pacing::*;

impl Broker {
    /// Whether session `session`'s publisher must (still) wait on `queue`
    /// of its vhost: None once it has credit again, is suspended, has no
    /// consumers or is gone.
    pub fn pacing_wait(&mut self, session: SessionId, queue: &str) -> Option<PacingWait> {
        let config = self.pacing;
        if config.window == 0 {
            return None;
        }
        let vhost = self.sessions.get(&session)?.vhost.as_str();
        let queue = self.vhosts.get_mut(vhost)?.queues.get_mut(queue)?;
        let pacing = &mut queue.pacing;
        if queue.consumers.is_empty() || pacing.suspended || pacing.credit >= config.resume_at() {
            return None;
        }
        // Those of earlier waits that timed out are gone.
        pacing.waiters.retain(|waiter| !waiter.is_closed());
        let (waiter, room) = oneshot::channel();
        pacing.waiters.push(waiter);
        Some(PacingWait {
            room,
            deliveries: pacing.deliveries,
            stall: config.stall,
        })
    }

    /// A publisher waited a stall period on `queue`. When the queue made no
    /// delivery at all meanwhile (its consumers stopped taking messages),
    /// pacing is suspended for it until its next delivery and every
    /// publisher waiting on it goes on: true. False when it delivered (it is
    /// slow, not stalled: wait on).
    pub fn pacing_stalled(&mut self, session: SessionId, queue: &str, deliveries: u64) -> bool {
        let Some(vhost) = self.sessions.get(&session).map(|s| s.vhost.as_str()) else {
            return true;
        };
        let Some(entry) = self
            .vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(queue))
        else {
            return true;
        };
        if entry.pacing.deliveries != deliveries {
            return false;
        }
        entry.pacing.suspended = true;
        entry.pacing.wake_all();
        self.pacing_stats.stalls += 1;
        tracing::debug!(
            queue,
            vhost,
            stall_ms = self.pacing.stall.as_millis() as u64,
            "publisher pacing suspended: the queue delivered nothing while a publisher waited"
        );
        true
    }

    /// A session waited `waited` for credit after one publish.
    pub fn pacing_waited(&mut self, waited: Duration) {
        self.pacing_stats.waits += 1;
        self.pacing_stats.waited_micros += waited.as_micros() as u64;
    }

    pub fn pacing_stats(&self) -> PacingStats {
        self.pacing_stats
    }

    /// Records that `session`'s last publish (or commit) spent the last of
    /// `queue`'s credit: the session waits before its next command.
    pub(super) fn note_paced(&mut self, session: SessionId, queue: &str) {
        if let Some(state) = self.sessions.get_mut(&session) {
            if state.paced_on.is_none() {
                state.paced_on = Some(queue.to_string());
            }
        }
    }

    /// The queue `session` must wait on after its last command, if any.
    pub fn take_paced(&mut self, session: SessionId) -> Option<String> {
        self.sessions.get_mut(&session)?.paced_on.take()
    }
}
