//! Exponential backoff for retry loops that wait out a component that is not
//! there yet (a storage node starting, a store that failed a write): each
//! wait doubles, up to a ceiling, and starts small again after a success.
//! Deterministic on purpose: the waits are what the logs report.

use std::time::Duration;

/// Waits that double from `min` up to `max`.
#[derive(Clone, Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        debug_assert!(
            min <= max,
            "backoff minimum {min:?} above its maximum {max:?}"
        );
        Self {
            min,
            max,
            next: min,
        }
    }

    /// The wait to make now; the one after it is twice as long (at most `max`).
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    /// The wait [`Backoff::next_delay`] will return, without taking it.
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// Waits the next delay.
    pub async fn wait(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }

    /// After a success: the next wait is `min` again.
    pub fn reset(&mut self) {
        self.next = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_ceiling_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_millis(300));
        let waits: Vec<u128> = (0..5).map(|_| backoff.next_delay().as_millis()).collect();
        assert_eq!(waits, vec![50, 100, 200, 300, 300]);
        backoff.reset();
        assert_eq!(backoff.peek(), Duration::from_millis(50));
    }
}
