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
    /// The link has spent half of its floor once: it may borrow.
    busy: bool,
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
            busy: false,
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

    /// The credit to grant a link that has `credit` left and `in_flight`
    /// messages waiting for their confirm, if it is time: once half of what
    /// it could hold (its share and what the pool has free) is spent, and
    /// only a top-up of a quarter of that or more, so a busy link hears a
    /// `flow` every few hundred messages, not after each confirm.
    pub fn top_up(&mut self, credit: u32, in_flight: u32) -> Option<u32> {
        if !self.busy {
            if credit.saturating_mul(2) > self.floor {
                return None;
            }
            self.busy = true;
        }
        let reach = (self.share() + self.pool.free()).min(self.most);
        let smallest_top_up = (reach / 4).max(1);
        let grant_at_reach = reach.saturating_sub(in_flight);
        if credit.saturating_mul(2) > reach
            || grant_at_reach < credit.saturating_add(smallest_top_up)
        {
            return None;
        }
        // Borrowed only for a grant that goes out, so a link near its
        // share does not take from the pool and give back at each confirm.
        self.borrowed += self.pool.take(reach.saturating_sub(self.share()));
        let grant = self.share().saturating_sub(in_flight);
        (grant > credit).then_some(grant)
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
        // Half of the 200 granted at attach is not spent yet: no more.
        assert_eq!(link.top_up(101, 99), None);
        assert_eq!(pool.free(), 1000);
        // Spent 150: topped up from the pool.
        assert_eq!(link.top_up(50, 150), Some(1050));
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
    fn a_top_up_comes_every_few_hundred_messages_not_after_each_confirm() {
        let pool = CreditPool::new(1000);
        let mut link = LinkCredit::new(pool.clone(), 200, 1200);
        assert_eq!(link.top_up(100, 100), Some(1100));
        // 1000 waiting, 200 credit: confirms come one at a time.
        let mut grants = 0;
        let mut credit = 200;
        for in_flight in (0..1000u32).rev() {
            link.settle(in_flight + credit);
            if let Some(grant) = link.top_up(credit, in_flight) {
                assert!(grant >= credit + 300, "a top-up of {grant} over {credit}");
                credit = grant;
                grants += 1;
            }
        }
        assert!(
            (1..=3).contains(&grants),
            "{grants} flows for a thousand confirms"
        );
        assert!(link.share() <= 1200);
    }

    #[test]
    fn a_second_link_keeps_its_floor_while_the_first_holds_the_pool() {
        let pool = CreditPool::new(1000);
        let mut first = LinkCredit::new(pool.clone(), 200, 1200);
        let mut second = LinkCredit::new(pool.clone(), 200, 1200);
        assert_eq!(first.top_up(100, 100), Some(1100));
        assert_eq!(second.top_up(101, 99), None);
        // The pool is lent: the second link's reach is its floor.
        assert_eq!(second.top_up(100, 0), Some(200));
        first.settle(700);
        assert_eq!(pool.free(), 500);
        assert_eq!(second.top_up(100, 100), Some(600));
        assert_eq!(pool.free(), 0);
        // Never more than the floors and the pool, together.
        assert_eq!(first.share() + second.share(), 200 + 200 + 1000);
    }

    #[test]
    fn a_link_never_holds_more_than_its_most() {
        let pool = CreditPool::new(5000);
        let mut link = LinkCredit::new(pool.clone(), 200, 1200);
        assert_eq!(link.top_up(0, 200), Some(1000));
        assert_eq!(link.top_up(0, 1200), None);
        assert_eq!(pool.free(), 4000);
    }
}
