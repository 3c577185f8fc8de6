//! Delivery credit: how much one gateway session may have in flight, i.e.
//! handed to the gateway but not yet written to the client's socket. It is
//! bounded twice, in deliveries (`engine.session_credit`) and in bytes
//! (`engine.session_credit_bytes`), so a client that reads slowly holds at
//! most that much of the broker's memory in outbound buffers, whatever the
//! size of its messages.
//!
//! The gateway reports writes as a count, in the order the deliveries were
//! handed over; the sizes of the deliveries in flight are kept in that order
//! so a count can be turned back into bytes.

use std::collections::VecDeque;

/// The bytes a delivery is charged beyond its body: method and content
/// header frames, names and properties, roughly.
pub const DELIVERY_OVERHEAD: u64 = 128;

#[derive(Debug)]
pub struct DeliveryCredit {
    max_deliveries: u32,
    max_bytes: u64,
    /// Sizes of the deliveries in flight, oldest first.
    in_flight: VecDeque<u64>,
    bytes_in_flight: u64,
}

impl DeliveryCredit {
    /// `max_deliveries` and `max_bytes` of 0 are treated as 1.
    pub fn new(max_deliveries: u32, max_bytes: u64) -> Self {
        Self {
            max_deliveries: max_deliveries.max(1),
            max_bytes: max_bytes.max(1),
            in_flight: VecDeque::new(),
            bytes_in_flight: 0,
        }
    }

    /// Whether one more delivery may be handed over. A single delivery
    /// larger than the byte bound still goes when nothing else is in
    /// flight, or a large message could never be delivered.
    pub fn has_room(&self) -> bool {
        if self.in_flight.is_empty() {
            return true;
        }
        (self.in_flight.len() as u64) < u64::from(self.max_deliveries)
            && self.bytes_in_flight < self.max_bytes
    }

    /// A delivery of `body_len` bytes was handed to the gateway.
    pub fn spend(&mut self, body_len: usize) {
        debug_assert!(self.has_room(), "delivery credit spent without room");
        let size = body_len as u64 + DELIVERY_OVERHEAD;
        self.in_flight.push_back(size);
        self.bytes_in_flight += size;
    }

    /// The gateway wrote the `count` oldest deliveries in flight. Returns
    /// whether that made room where there was none.
    pub fn written(&mut self, count: u32) -> bool {
        let was_full = !self.has_room();
        for _ in 0..count {
            let Some(size) = self.in_flight.pop_front() else {
                break;
            };
            self.bytes_in_flight -= size;
        }
        was_full && self.has_room()
    }

    #[cfg(test)]
    pub fn bytes_in_flight(&self) -> u64 {
        self.bytes_in_flight
    }

    #[cfg(test)]
    pub fn deliveries_in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_bound_holds_for_small_deliveries() {
        let mut credit = DeliveryCredit::new(3, 1 << 20);
        for _ in 0..3 {
            assert!(credit.has_room());
            credit.spend(10);
        }
        assert!(!credit.has_room());
        assert!(credit.written(1));
        assert!(credit.has_room());
    }

    #[test]
    fn the_byte_bound_holds_for_large_deliveries() {
        let mut credit = DeliveryCredit::new(2048, 1000);
        credit.spend(600);
        assert!(credit.has_room(), "728 of 1000 bytes in flight");
        credit.spend(600);
        assert!(!credit.has_room(), "1456 of 1000 bytes in flight");
        assert_eq!(credit.deliveries_in_flight(), 2);
        assert!(!credit.written(0));
        assert!(credit.written(1));
        assert_eq!(credit.bytes_in_flight(), 728);
    }

    #[test]
    fn one_delivery_larger_than_the_bound_still_goes_alone() {
        let mut credit = DeliveryCredit::new(2048, 1000);
        assert!(credit.has_room());
        credit.spend(1 << 20);
        assert!(!credit.has_room());
        assert!(credit.written(1));
        assert_eq!(credit.bytes_in_flight(), 0);
    }

    #[test]
    fn a_count_beyond_what_is_in_flight_is_harmless() {
        let mut credit = DeliveryCredit::new(1, 1);
        credit.spend(5);
        assert!(credit.written(7));
        assert_eq!(credit.deliveries_in_flight(), 0);
        assert!(!credit.written(3), "there was room already");
    }
}
