//! Publisher pacing: a queue that is busy delivering holds its publishers to
//! the rate it delivers at, so that at steady state its backlog stays short
//! (`engine.publisher_pacing_window`, docs/flow-control.md#publisher-pacing).
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

/// Messages a queue with consumers may be ahead of its deliveries before
/// its publishers wait, by default.
pub const DEFAULT_PACING_WINDOW: u32 = 2000;

/// How long a queue may deliver nothing while a publisher waits on it
/// before pacing is suspended for it, by default.
pub const DEFAULT_PACING_STALL: Duration = Duration::from_millis(100);

/// `engine.publisher_pacing_window` and `engine.publisher_pacing_stall`.
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
    pub(crate) fn window(&self) -> i64 {
        i64::from(self.window)
    }

    /// The credit at which waiting publishers go on: a quarter of the
    /// window, so that one wakeup carries many publishes.
    pub(crate) fn resume_at(&self) -> i64 {
        (self.window() / 4).max(1)
    }
}

/// One queue's pacing state.
#[derive(Debug, Default)]
pub struct QueuePacing {
    /// Messages publishers may still route here before they wait; below 0
    /// when several publishers spent the last of it at once.
    pub(crate) credit: i64,
    /// No delivery for a stall period while a publisher waited: publishes
    /// spend nothing until the next delivery.
    pub(crate) suspended: bool,
    /// Deliveries so far: a waiting publisher tells a stalled queue from a
    /// slow one by it.
    pub(crate) deliveries: u64,
    /// Sessions waiting for credit: woken when it is back, when pacing is
    /// suspended, when the last consumer leaves; dropped with the queue.
    pub(crate) waiters: Vec<oneshot::Sender<()>>,
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
