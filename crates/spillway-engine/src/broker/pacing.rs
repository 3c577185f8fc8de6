//! Publisher pacing: a queue that is busy delivering holds its publishers to
//! the rate it delivers at, so that at steady state its backlog stays short
//! (`broker.publisher_pacing_window`, docs/flow-control.md#publisher-pacing).
//!
//! A queue with at least one consumer has a credit of messages. Every
//! message published to it spends one; every first delivery from it (to a
//! consumer; not a basic.get, not the redelivery of a requeued message)
//! earns one back, up to the window. A publish that leaves the credit at 0
//! or below makes its session wait (and with it, through the bounded
//! command queue, the client's socket) until the credit is back to a
//! quarter of the window. A queue without consumers never paces: its
//! backlog is only disk usage (flow to disk).
//!
//! Stall rule: a queue that makes no delivery at all for `stall` while a
//! publisher waits on it is *suspended* — publishes spend nothing — until
//! its next delivery, which resets the credit to the window. A consumer that
//! stopped taking messages costs a publisher one stall period at most.

use std::time::Duration;

use tokio::sync::oneshot;

use super::Broker;
use crate::model::SessionId;

/// Messages a queue with consumers may be ahead of its deliveries before
/// its publishers wait, by default.
pub const DEFAULT_PACING_WINDOW: u32 = 2000;

/// How long a queue may deliver nothing while a publisher waits on it
/// before pacing is suspended for it, by default.
pub const DEFAULT_PACING_STALL: Duration = Duration::from_millis(100);

/// `broker.publisher_pacing_window` and `broker.publisher_pacing_stall`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PacingConfig {
    /// Messages; 0 turns pacing off.
    pub window: u32,
    pub stall: Duration,
}

impl Default for PacingConfig {
    fn default() -> Self {
        Self {
            window: DEFAULT_PACING_WINDOW,
            stall: DEFAULT_PACING_STALL,
        }
    }
}

impl PacingConfig {
    fn window(&self) -> i64 {
        i64::from(self.window)
    }

    /// The credit at which waiting publishers go on: a quarter of the
    /// window, so that one wakeup carries many publishes.
    fn resume_at(&self) -> i64 {
        (self.window() / 4).max(1)
    }
}

/// One queue's pacing state.
#[derive(Debug, Default)]
pub struct QueuePacing {
    /// Messages publishers may still route here before they wait; below 0
    /// when several publishers spent the last of it at once.
    credit: i64,
    /// No delivery for a stall period while a publisher waited: publishes
    /// spend nothing until the next delivery.
    suspended: bool,
    /// Deliveries so far: a waiting publisher tells a stalled queue from a
    /// slow one by it.
    deliveries: u64,
    /// Sessions waiting for credit: woken when it is back, when pacing is
    /// suspended, when the last consumer leaves; dropped with the queue.
    waiters: Vec<oneshot::Sender<()>>,
}

impl QueuePacing {
    /// A consumer appeared on a queue that had none: a full window.
    pub(crate) fn reset(&mut self, config: &PacingConfig) {
        self.credit = config.window();
        self.suspended = false;
    }

    /// One message routed here (the queue has consumers). True when that
    /// spent the credit: the publisher waits.
    #[inline]
    pub(crate) fn spend(&mut self) -> bool {
        if self.suspended {
            return false;
        }
        self.credit -= 1;
        self.credit <= 0
    }

    /// One delivery to a consumer; `first`: not a requeued message's
    /// redelivery (those earn nothing: they were paid for once).
    #[inline]
    pub(crate) fn delivered(&mut self, first: bool, config: &PacingConfig) {
        self.deliveries += 1;
        if self.suspended {
            self.suspended = false;
            self.credit = config.window();
        } else if first && self.credit < config.window() {
            self.credit += 1;
        }
    }

    /// After deliveries: wakes the waiting publishers once there is enough
    /// credit for them to go on.
    #[inline]
    pub(crate) fn wake_if_room(&mut self, config: &PacingConfig) {
        if !self.waiters.is_empty() && self.credit >= config.resume_at() {
            self.wake_all();
        }
    }

    /// Wakes every waiting publisher (each looks at the queue again).
    pub(crate) fn wake_all(&mut self) {
        for waiter in self.waiters.drain(..) {
            let _ = waiter.send(());
        }
    }
}

/// Counted for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PacingStats {
    /// Publishes after which the session waited for a queue's credit.
    pub waits: u64,
    /// Time sessions spent waiting so, in microseconds.
    pub waited_micros: u64,
    /// Times a queue delivered nothing for a stall period while a publisher
    /// waited on it, so that pacing was suspended for it.
    pub stalls: u64,
}

/// What a paced publisher waits for.
pub struct PacingWait {
    /// Fires when the queue's credit is back (or it must be looked at
    /// again); dropped with the queue.
    pub room: oneshot::Receiver<()>,
    /// The queue's deliveries when the wait began.
    pub deliveries: u64,
    pub stall: Duration,
}

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
