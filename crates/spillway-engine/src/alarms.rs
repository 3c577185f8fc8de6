//! The broker-wide conditions that hold producers back, each with when it
//! began (management shows how long a channel has been blocked): the store
//! over its disk quota (`MST-1008`), the store failed (`MST-1101`), and the
//! process over its memory ceiling (`BRK-1101`). Plain state: the broker
//! sets them, and when one turns on or off it tells the sessions it holds
//! (`broker/producer_flow.rs`).

use std::time::Instant;

use spillway_telemetry::OverCeiling;

#[derive(Debug, Default)]
pub struct Alarms {
    store_overfull_since: Option<Instant>,
    /// Why the store failed, and since when.
    store_failure: Option<(String, Instant)>,
    /// The latest figures while the ceiling is passed, and since when.
    memory: Option<(OverCeiling, Instant)>,
}

impl Alarms {
    pub fn store_overfull(&self) -> bool {
        self.store_overfull_since.is_some()
    }

    pub fn store_overfull_since(&self) -> Option<Instant> {
        self.store_overfull_since
    }

    /// Returns whether the store's quota state changed.
    pub fn set_store_overfull(&mut self, overfull: bool, now: Instant) -> bool {
        if overfull == self.store_overfull() {
            return false;
        }
        self.store_overfull_since = overfull.then_some(now);
        true
    }

    pub fn store_failure(&self) -> Option<&str> {
        self.store_failure.as_ref().map(|(why, _)| why.as_str())
    }

    pub fn store_failed_since(&self) -> Option<Instant> {
        self.store_failure.as_ref().map(|(_, since)| *since)
    }

    /// Returns whether the store went from working to failed or back; a
    /// new reason while failed is kept without a change (nor a new start).
    pub fn set_store_failure(&mut self, failure: Option<String>, now: Instant) -> bool {
        set_keeping_start(&mut self.store_failure, failure, now)
    }

    /// The figures of a passed memory ceiling.
    pub fn memory(&self) -> Option<OverCeiling> {
        self.memory.as_ref().map(|(over, _)| *over)
    }

    pub fn memory_since(&self) -> Option<Instant> {
        self.memory.as_ref().map(|(_, since)| *since)
    }

    /// Returns whether the ceiling went from passed to not or back; while
    /// passed, the figures follow the latest check.
    pub fn set_memory(&mut self, over: Option<OverCeiling>, now: Instant) -> bool {
        set_keeping_start(&mut self.memory, over, now)
    }
}

/// Sets an alarm that carries a value: a new value while it is on replaces
/// the old one and keeps its start; returns whether it turned on or off.
fn set_keeping_start<T>(slot: &mut Option<(T, Instant)>, value: Option<T>, now: Instant) -> bool {
    match (slot.as_mut(), value) {
        (Some((held, _)), Some(value)) => {
            *held = value;
            false
        }
        (None, None) => false,
        (_, value) => {
            *slot = value.map(|value| (value, now));
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn an_alarm_changes_only_when_it_turns_on_or_off_and_keeps_its_start() {
        let start = Instant::now();
        let later = start + Duration::from_secs(5);
        let mut alarms = Alarms::default();
        assert!(!alarms.set_store_overfull(false, start));
        assert!(alarms.set_store_overfull(true, start));
        assert!(!alarms.set_store_overfull(true, later));
        assert_eq!(alarms.store_overfull_since(), Some(start));
        assert!(alarms.set_store_overfull(false, later));
        assert!(!alarms.store_overfull());

        assert!(alarms.set_store_failure(Some("disk".into()), start));
        assert!(!alarms.set_store_failure(Some("still disk".into()), later));
        assert_eq!(alarms.store_failure(), Some("still disk"));
        assert_eq!(alarms.store_failed_since(), Some(start));
        assert!(alarms.set_store_failure(None, later));
        assert_eq!(alarms.store_failed_since(), None);

        let over = |held| OverCeiling {
            held,
            high_watermark: 100,
        };
        assert!(alarms.set_memory(Some(over(150)), start));
        assert!(!alarms.set_memory(Some(over(180)), later));
        assert_eq!(alarms.memory().map(|o| o.held), Some(180));
        assert_eq!(alarms.memory_since(), Some(start));
        assert!(alarms.set_memory(None, later));
        assert!(!alarms.set_memory(None, later));
    }
}
