//! Credit for the links a client sends on: how many messages each may have
//! on their way to the engine's confirm.
//!
//! Every sending link may always hold [`LINK_FLOOR`] (what fe2o3's link
//! acceptor grants with the attach, and what each link had before the pool
//! existed). A link that has used its credit may borrow more from its
//! connection's [`CreditPool`] of [`CONNECTION_POOL`] messages, so one busy
//! sender may have as many messages waiting for the store as a 0-9-1
//! publisher's confirm window while the connection's bound stays
//! `links × LINK_FLOOR + CONNECTION_POOL` messages. What a link borrowed goes
//! back to the pool as the engine confirms, and all of it when the link ends.
//!
//! A link borrows only when it tops up credit it has spent, never at attach:
//! a sender that attaches and sends nothing holds its floor and no more.
//! Credit granted is never taken back (transfers may be on the wire), so a
//! link that borrowed and then went quiet keeps what it borrowed until it
//! sends it or ends; the other links still have their floor.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// Credit a sending link always may hold (fe2o3's default grant at attach).
pub const LINK_FLOOR: u32 = 200;
/// Credit a connection's sending links may borrow beyond their floors,
/// together.
pub const CONNECTION_POOL: u32 = 1000;

/// A connection's credit beyond its links' floors.
#[derive(Debug)]
pub struct CreditPool {
    free: AtomicU32,
}

impl CreditPool {
    pub fn new(capacity: u32) -> Arc<Self> {
        Arc::new(Self {
            free: AtomicU32::new(capacity),
        })
    }

    /// Credit no link has borrowed.
    pub fn free(&self) -> u32 {
        self.free.load(Ordering::Acquire)
    }

    /// Takes up to `wanted`; returns what was taken.
    fn take(&self, wanted: u32) -> u32 {
        let mut free = self.free.load(Ordering::Acquire);
        loop {
            let taken = free.min(wanted);
            if taken == 0 {
                return 0;
            }
            match self.free.compare_exchange_weak(
                free,
                free - taken,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return taken,
                Err(now) => free = now,
            }
        }
    }

    fn give(&self, returned: u32) {
        if returned > 0 {
            self.free.fetch_add(returned, Ordering::AcqRel);
        }
    }
}

/// One sending link's share: its floor and what it borrowed.
#[derive(Debug)]
pub struct LinkCredit {
    pool: Arc<CreditPool>,
    floor: u32,
    /// Most this link may hold, floor included.
    most: u32,
    borrowed: u32,
}

impl LinkCredit {
    /// A link that may hold `floor` of its own and borrow up to
    /// `most - floor` from `pool`.
    pub fn new(pool: Arc<CreditPool>, floor: u32, most: u32) -> Self {
        debug_assert!(floor <= most);
        Self {
            pool,
            floor,
            most: most.max(floor),
            borrowed: 0,
        }
    }

    /// What the link may hold now without borrowing more.
    pub fn share(&self) -> u32 {
        self.floor + self.borrowed
    }

    /// Returns to the pool what the link no longer needs: `held` is what it
    /// holds (messages waiting for the confirm plus credit the client has).
    pub fn settle(&mut self, held: u32) {
        let needed = held.saturating_sub(self.floor);
        if self.borrowed > needed {
            self.pool.give(self.borrowed - needed);
            self.borrowed = needed;
        }
    }

    /// Whether a link that has `credit` left should be topped up: once half
    /// of its share is spent (with what it borrowed given back as confirms
    /// came, once as many messages wait for a confirm as it has credit).
    pub fn wants_more(&self, credit: u32) -> bool {
        credit.saturating_mul(2) <= self.share()
    }

    /// Borrows what the pool lets the link have, and returns the credit to
    /// grant with `in_flight` messages waiting for their confirm.
    pub fn grant(&mut self, in_flight: u32) -> u32 {
        let wanted = self.most.saturating_sub(self.share());
        self.borrowed += self.pool.take(wanted);
        self.share().saturating_sub(in_flight)
    }
}

impl Drop for LinkCredit {
    fn drop(&mut self) {
        self.pool.give(self.borrowed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_link_borrows_the_pool_and_gives_it_back_as_it_settles() {
        let pool = CreditPool::new(1000);
        let mut link = LinkCredit::new(pool.clone(), 200, 1200);
        assert_eq!(link.share(), 200);
        // Half of the 200 granted at attach is not spent yet: no more.
        assert!(!link.wants_more(101));
        // Spent 150: time to top up, from the pool.
        assert!(link.wants_more(50));
        assert_eq!(link.grant(150), 1050);
        assert_eq!(pool.free(), 0);
        // 150 in flight and 1050 credit: all of it held.
        link.settle(1200);
        assert_eq!(pool.free(), 0);
        // The client sent 900 more (150 credit left, 1050 in flight) and
        // the engine confirmed 950: 250 held, 50 of them borrowed.
        link.settle(250);
        assert_eq!(pool.free(), 950);
        assert_eq!(link.share(), 250);
        drop(link);
        assert_eq!(pool.free(), 1000);
    }

    #[test]
    fn a_second_link_keeps_its_floor_while_the_first_holds_the_pool() {
        let pool = CreditPool::new(1000);
        let mut first = LinkCredit::new(pool.clone(), 200, 1200);
        let mut second = LinkCredit::new(pool.clone(), 200, 1200);
        assert_eq!(first.grant(0), 1200);
        assert!(second.wants_more(100));
        assert!(!second.wants_more(101));
        assert_eq!(second.grant(100), 100);
        first.settle(700);
        assert_eq!(pool.free(), 500);
        assert_eq!(second.grant(100), 600);
        assert_eq!(pool.free(), 0);
        // Never more than the floors and the pool, together.
        assert_eq!(first.share() + second.share(), 200 + 200 + 1000);
    }

    #[test]
    fn a_link_never_holds_more_than_its_most() {
        let pool = CreditPool::new(5000);
        let mut link = LinkCredit::new(pool.clone(), 200, 1200);
        assert_eq!(link.grant(0), 1200);
        assert_eq!(link.grant(1200), 0);
        assert_eq!(pool.free(), 4000);
    }
}
