//! Time as Spillway's components read it, handed to them by the wiring.
//!
//! Two readings, for two purposes:
//! - [`Clock::now`], a monotonic instant: deadlines and durations that live
//!   only as long as the process (consumer and transaction timeouts, how
//!   long a connection has been blocked, the grace of an unacked delivery);
//! - [`Clock::unix_millis`], wall time in milliseconds since the Unix epoch:
//!   what outlives the process or crosses to clients (message and queue
//!   TTLs, the `time` of an `x-death` record).
//!
//! Production uses [`SystemClock`]. Tests use [`ManualClock`], which moves
//! only when told, so TTLs and timeouts are tested without waiting for them
//! (and a simulation can replay the same history twice).

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A source of time; shared by the components of one process.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Monotonic time.
    fn now(&self) -> Instant;
    /// Milliseconds since the Unix epoch (0 before it).
    fn unix_millis(&self) -> u64;
}

/// How components hold their clock.
pub type SharedClock = Arc<dyn Clock>;

/// The operating system's clocks.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl SystemClock {
    pub fn shared() -> SharedClock {
        Arc::new(SystemClock)
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn unix_millis(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| {
                u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
            })
    }
}

/// A clock that stands still until [`ManualClock::advance`] moves it. Both
/// readings move together; it starts at the system's time of its making.
#[derive(Debug)]
pub struct ManualClock {
    start: Instant,
    unix_start: u64,
    elapsed: Mutex<Duration>,
}

impl ManualClock {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            start: Instant::now(),
            unix_start: SystemClock.unix_millis(),
            elapsed: Mutex::new(Duration::ZERO),
        })
    }

    /// Moves time forward by `by`.
    pub fn advance(&self, by: Duration) {
        let mut elapsed = self.elapsed.lock().unwrap_or_else(PoisonError::into_inner);
        *elapsed = elapsed.saturating_add(by);
    }

    fn elapsed(&self) -> Duration {
        *self.elapsed.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.start + self.elapsed()
    }

    fn unix_millis(&self) -> u64 {
        let elapsed = u64::try_from(self.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.unix_start.saturating_add(elapsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told_and_both_readings_together() {
        let clock = ManualClock::new();
        let (instant, millis) = (clock.now(), clock.unix_millis());
        assert_eq!((clock.now(), clock.unix_millis()), (instant, millis));
        clock.advance(Duration::from_millis(1500));
        assert_eq!(clock.now() - instant, Duration::from_millis(1500));
        assert_eq!(clock.unix_millis() - millis, 1500);
    }

    #[test]
    fn the_system_clock_reads_after_the_epoch() {
        assert!(SystemClock.unix_millis() > 1_600_000_000_000);
    }
}
