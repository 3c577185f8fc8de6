//! When a silent client counts as gone: the spec's "two missed heartbeats",
//! suspended while the client has a reason to be silent that is ours.
//!
//! Two such reasons, both from producer flow control:
//! - the connection was sent connection.blocked: clients such as lapin then
//!   send nothing at all, heartbeats included, until connection.unblocked
//!   (RabbitMQ pauses its heartbeat monitor the same way);
//! - the gateway stopped reading the socket: whatever the client sent,
//!   heartbeats too, waits unread in it.
//!
//! When the reason ends the silence clock restarts, so the client gets a
//! full two intervals to be heard again.

use std::time::Duration;

use tokio::time::Instant;

/// Tracks when the client was last heard and decides when it is gone.
#[derive(Debug)]
pub struct SilenceClock {
    /// Silence longer than this ends the connection (two heartbeats).
    limit: Duration,
    last_heard: Instant,
    suspended: bool,
}

impl SilenceClock {
    /// A clock for a negotiated `heartbeat` interval in seconds, started
    /// `now`.
    pub fn new(heartbeat: u16, now: Instant) -> Self {
        Self {
            limit: Duration::from_secs(u64::from(heartbeat) * 2),
            last_heard: now,
            suspended: false,
        }
    }

    /// A frame arrived.
    pub fn heard(&mut self, now: Instant) {
        self.last_heard = now;
    }

    /// Whether the client may be silent now for a reason of ours (blocked,
    /// or not being read). Ending a suspension restarts the clock.
    pub fn set_suspended(&mut self, suspended: bool, now: Instant) {
        if self.suspended && !suspended {
            self.last_heard = now;
        }
        self.suspended = suspended;
    }

    /// The client has been silent too long, and not for a reason of ours.
    pub fn expired(&self, now: Instant) -> bool {
        !self.suspended && now.saturating_duration_since(self.last_heard) > self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEARTBEAT: u16 = 60;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn two_silent_intervals_expire() {
        let start = Instant::now();
        let mut clock = SilenceClock::new(HEARTBEAT, start);
        assert!(!clock.expired(start + secs(120)));
        assert!(clock.expired(start + secs(121)));
        clock.heard(start + secs(100));
        assert!(!clock.expired(start + secs(220)));
        assert!(clock.expired(start + secs(221)));
    }

    #[test]
    fn a_blocked_client_may_stay_silent_and_gets_two_intervals_after() {
        let start = Instant::now();
        let mut clock = SilenceClock::new(HEARTBEAT, start);
        clock.set_suspended(true, start + secs(10));
        // Blocked for ten minutes without a byte: still alive.
        assert!(!clock.expired(start + secs(600)));
        clock.set_suspended(true, start + secs(600));
        assert!(!clock.expired(start + secs(610)));
        // Unblocked at 610 s: the silence counts from there.
        clock.set_suspended(false, start + secs(610));
        assert!(!clock.expired(start + secs(730)));
        assert!(clock.expired(start + secs(731)));
    }

    #[test]
    fn staying_unsuspended_does_not_restart_the_clock() {
        let start = Instant::now();
        let mut clock = SilenceClock::new(HEARTBEAT, start);
        clock.set_suspended(false, start + secs(100));
        assert!(clock.expired(start + secs(121)));
    }
}
