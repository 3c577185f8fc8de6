//! Connection limits the gateway enforces itself: `gateway.max_connections`,
//! the most connections one gateway process holds open at once (RabbitMQ's
//! `connection_max`). A connection takes a slot when it asks to open a vhost
//! and gives it back when it ends, however it ends.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Open connections counted against a maximum (0 = no maximum).
#[derive(Clone, Debug)]
pub struct ConnectionSlots {
    open: Arc<AtomicUsize>,
    max: usize,
}

/// One open connection's slot; dropping it frees the slot.
#[derive(Debug)]
pub struct Slot {
    open: Arc<AtomicUsize>,
}

impl ConnectionSlots {
    pub fn new(max: usize) -> Self {
        Self {
            open: Arc::new(AtomicUsize::new(0)),
            max,
        }
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Takes a slot, or `None` when every slot is taken.
    pub fn take(&self) -> Option<Slot> {
        let taken = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (self.max == 0 || open < self.max).then_some(open + 1)
            })
            .is_ok();
        taken.then(|| Slot {
            open: self.open.clone(),
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let previous = self.open.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(previous > 0, "a slot was given back twice");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_run_out_at_the_maximum_and_come_back_when_dropped() {
        let slots = ConnectionSlots::new(2);
        let first = slots.take();
        let second = slots.take();
        assert!(first.is_some() && second.is_some());
        assert!(slots.take().is_none());
        drop(first);
        assert!(slots.take().is_some());
    }

    #[test]
    fn zero_means_no_maximum() {
        let slots = ConnectionSlots::new(0);
        let held: Vec<_> = (0..1000).filter_map(|_| slots.take()).collect();
        assert_eq!(held.len(), 1000);
    }
}
