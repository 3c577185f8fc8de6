//! Credit for the links the broker sends on: how many messages the engine
//! may hand a link's consumer, from the credit the client grants.
//!
//! The client counts transfers (the link's delivery-count, a serial number
//! from the broker's initial 0); the engine counts its deliveries to the
//! consumer, and some of those never become transfers (a stored body that
//! does not decode is dropped). [`DeliveryLimit`] keeps the two apart: the
//! engine may hand over what the link has taken from it, plus the transfers
//! the client's last flow still allows. A delivery the engine makes beyond
//! the client's credit would wait in the gateway, unacknowledged, and a
//! message the client releases would come back behind it.
//!
//! A drain: the library advances the link's delivery-count to the flow's
//! limit at once, so the transfers it allowed are spent. The jump is taken
//! when the link sees the flow; a transfer the library sends between the
//! guard reading the flow and the library applying it counts once too many
//! here, and the engine then hands over one message fewer than the client
//! allows until the client's next drain.

use super::guard::ClientCredit;

/// A sending link's count of the engine's deliveries against the client's
/// credit.
#[derive(Clone, Debug, Default)]
pub struct DeliveryLimit {
    /// The delivery-count the library gives the next transfer.
    next_transfer: u32,
    /// Drains taken into account.
    drains: u64,
    /// The engine's deliveries the link has taken: sent on, or dropped.
    taken: u64,
    /// The limit the engine was last given.
    told: u64,
}

impl DeliveryLimit {
    /// A delivery went to the client as a transfer.
    pub fn sent(&mut self) {
        self.taken += 1;
        self.next_transfer = self.next_transfer.wrapping_add(1);
    }

    /// A delivery was dropped without a transfer.
    pub fn dropped(&mut self) {
        self.taken += 1;
    }

    /// The engine's delivery limit given the client's flows so far, when
    /// it is not what the engine was last told.
    pub fn update(&mut self, client: &ClientCredit) -> Option<u64> {
        if client.drains != self.drains {
            self.drains = client.drains;
            if serial_ahead(client.drained_to, self.next_transfer) > 0 {
                self.next_transfer = client.drained_to;
            }
        }
        let allowed = serial_ahead(client.limit, self.next_transfer);
        let limit = self.taken + u64::from(allowed);
        if limit == self.told {
            return None;
        }
        self.told = limit;
        Some(limit)
    }
}

/// How far serial number `a` is ahead of `b` (RFC 1982 arithmetic, as
/// AMQP 1.0's sequence numbers); 0 when it is not ahead.
fn serial_ahead(a: u32, b: u32) -> u32 {
    let ahead = a.wrapping_sub(b);
    if ahead < 1 << 31 {
        ahead
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(limit: u32) -> ClientCredit {
        ClientCredit {
            limit,
            ..ClientCredit::default()
        }
    }

    #[test]
    fn the_engine_may_hand_over_what_the_client_allows_beyond_what_it_sent() {
        let mut credit = DeliveryLimit::default();
        assert_eq!(credit.update(&flow(0)), None, "no credit, nothing to say");
        assert_eq!(credit.update(&flow(10)), Some(10));
        for _ in 0..4 {
            credit.sent();
        }
        // The same flow allows the same total.
        assert_eq!(credit.update(&flow(10)), None);
        // The client tops up: delivery-count 4, credit 10.
        assert_eq!(credit.update(&flow(14)), Some(14));
    }

    #[test]
    fn a_dropped_delivery_gives_the_engine_one_more() {
        let mut credit = DeliveryLimit::default();
        assert_eq!(credit.update(&flow(2)), Some(2));
        credit.dropped();
        assert_eq!(credit.update(&flow(2)), Some(3));
        credit.sent();
        credit.sent();
        assert_eq!(credit.update(&flow(2)), None);
    }

    #[test]
    fn a_client_behind_the_transfers_allows_nothing_more() {
        let mut credit = DeliveryLimit::default();
        assert_eq!(credit.update(&flow(3)), Some(3));
        for _ in 0..3 {
            credit.sent();
        }
        // A flow sent before the client saw the transfers: delivery-count
        // 1, credit 1 is a limit the link has passed.
        assert_eq!(credit.update(&flow(2)), None);
    }

    #[test]
    fn a_drain_spends_what_the_flow_allowed() {
        let mut credit = DeliveryLimit::default();
        assert_eq!(credit.update(&flow(5)), Some(5));
        credit.sent();
        let drained = ClientCredit {
            limit: 5,
            drains: 1,
            drained_to: 5,
        };
        // The library jumped to 5: the engine keeps the one it handed over.
        assert_eq!(credit.update(&drained), Some(1));
        // New credit counts from the jump.
        let topped_up = ClientCredit {
            limit: 7,
            ..drained
        };
        assert_eq!(credit.update(&topped_up), Some(3));
    }

    #[test]
    fn counts_wrap_as_serial_numbers() {
        let mut credit = DeliveryLimit {
            next_transfer: u32::MAX - 1,
            ..DeliveryLimit::default()
        };
        assert_eq!(credit.update(&flow(3)), Some(5));
        for _ in 0..5 {
            credit.sent();
        }
        assert_eq!(credit.next_transfer, 3);
        assert_eq!(credit.update(&flow(3)), None);
    }
}
