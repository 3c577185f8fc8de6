//! One engine per store: the lease an engine holds on the store, and the
//! epoch every write carries.
//!
//! The store's epoch is stored (synced) and goes up by one with every new
//! lease. A lease lasts its TTL unless renewed; while it is live another
//! engine is refused. Writes and `RemoveOrphans` must carry the current
//! epoch, so an engine that lost its lease (another one took the store
//! after it expired) cannot write any more. Liveness is kept in memory: a
//! storage node that restarts has no live lease, and the running engine
//! renews its own (same epoch) at its next renewal.

use std::time::Duration;

use spillway_proto::ServiceError;
// tokio's clock is the system's, except in a simulation that runs on a
// paused clock, where a lease must expire in simulated time.
use tokio::time::Instant;

/// What [`LeaseState::acquire`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Grant {
    /// A new lease with this epoch: store the epoch, then
    /// [`LeaseState::commit`] it.
    New(u64),
    /// The holder's lease, renewed.
    Renewed(u64),
}

#[derive(Debug)]
pub(crate) struct LeaseState {
    /// The current epoch (0: no engine ever took the store).
    epoch: u64,
    holder: String,
    /// When the current lease runs out; None: released (or never taken
    /// since the storage node started).
    expires: Option<Instant>,
}

impl LeaseState {
    pub(crate) fn new(epoch: u64) -> Self {
        Self {
            epoch,
            holder: String::new(),
            expires: None,
        }
    }

    /// Decides on a lease request (`epoch` 0: a new lease; else a renewal)
    /// made at `now`. `store` names the store in refusals.
    pub(crate) fn acquire(
        &mut self,
        epoch: u64,
        ttl: Duration,
        now: Instant,
        store: &str,
    ) -> Result<Grant, ServiceError> {
        if epoch == 0 {
            if let Some(expires) = self.expires.filter(|at| *at > now) {
                return Err(ServiceError::FailedPrecondition(format!(
                    "the store {store} is in use by another engine ({}, lease epoch {}, \
                     expires in {} ms unless renewed): one engine per store",
                    self.holder,
                    self.epoch,
                    expires.saturating_duration_since(now).as_millis()
                )));
            }
            return Ok(Grant::New(self.epoch + 1));
        }
        self.check(epoch, store)?;
        self.expires = Some(now + ttl);
        Ok(Grant::Renewed(epoch))
    }

    /// Makes a new lease current, once its epoch is stored.
    pub(crate) fn commit(&mut self, epoch: u64, holder: &str, ttl: Duration, now: Instant) {
        debug_assert!(epoch > self.epoch, "epochs only go up");
        self.epoch = epoch;
        self.holder = holder.to_string();
        self.expires = Some(now + ttl);
    }

    /// The current epoch (0: no engine ever took the store).
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Keeps the lease of `epoch` live for `ttl` from `now` (a storage
    /// group applying a renewal); a stale epoch changes nothing.
    pub(crate) fn renew(&mut self, epoch: u64, ttl: Duration, now: Instant) -> bool {
        if epoch == 0 || epoch != self.epoch {
            return false;
        }
        self.expires = Some(now + ttl);
        true
    }

    /// Ends the lease of `epoch`; a stale epoch changes nothing.
    pub(crate) fn release(&mut self, epoch: u64) -> bool {
        if epoch != self.epoch || self.expires.is_none() {
            return false;
        }
        self.expires = None;
        true
    }

    /// Whether a write (or `RemoveOrphans`) with `epoch` may go ahead.
    pub(crate) fn check(&self, epoch: u64, store: &str) -> Result<(), ServiceError> {
        if epoch == 0 {
            return Err(ServiceError::FailedPrecondition(format!(
                "the store {store} refuses a write without a lease epoch"
            )));
        }
        if epoch != self.epoch {
            return Err(ServiceError::FailedPrecondition(format!(
                "lease epoch {epoch} is stale: the store {store} is at epoch {} \
                 (another engine took it, or this is another store)",
                self.epoch
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(5);

    #[test]
    fn a_second_engine_is_refused_while_the_lease_is_live() {
        let now = Instant::now();
        let mut lease = LeaseState::new(0);
        assert_eq!(lease.acquire(0, TTL, now, "s"), Ok(Grant::New(1)));
        lease.commit(1, "engine-a", TTL, now);
        let refused = lease.acquire(0, TTL, now + Duration::from_secs(1), "s");
        match refused {
            Err(ServiceError::FailedPrecondition(text)) => {
                assert!(text.contains("engine-a") && text.contains("one engine per store"))
            }
            other => panic!("unexpected {other:?}"),
        }
        // Renewing keeps it live past the first TTL.
        let later = now + Duration::from_secs(4);
        assert_eq!(lease.acquire(1, TTL, later, "s"), Ok(Grant::Renewed(1)));
        assert!(lease
            .acquire(0, TTL, now + Duration::from_secs(8), "s")
            .is_err());
    }

    #[test]
    fn an_expired_or_released_lease_goes_to_the_next_engine_with_a_new_epoch() {
        let now = Instant::now();
        let mut lease = LeaseState::new(6);
        assert_eq!(lease.acquire(0, TTL, now, "s"), Ok(Grant::New(7)));
        lease.commit(7, "a", TTL, now);
        let expired = now + TTL + Duration::from_millis(1);
        assert_eq!(lease.acquire(0, TTL, expired, "s"), Ok(Grant::New(8)));
        lease.commit(8, "b", TTL, expired);
        // The deposed engine can neither renew nor write.
        assert!(matches!(
            lease.acquire(7, TTL, expired, "s"),
            Err(ServiceError::FailedPrecondition(_))
        ));
        assert!(lease.check(7, "s").is_err());
        assert!(lease.check(8, "s").is_ok());
        assert!(!lease.release(7));
        assert!(lease.release(8));
        assert_eq!(lease.acquire(0, TTL, expired, "s"), Ok(Grant::New(9)));
    }

    #[test]
    fn writes_without_an_epoch_are_refused() {
        let lease = LeaseState::new(0);
        assert!(lease.check(0, "s").is_err());
    }

    #[test]
    fn a_storage_restart_lets_the_running_engine_renew_its_epoch() {
        // The epoch is stored; liveness is not.
        let now = Instant::now();
        let mut lease = LeaseState::new(3);
        assert_eq!(lease.acquire(3, TTL, now, "s"), Ok(Grant::Renewed(3)));
        assert!(lease.check(3, "s").is_ok());
    }
}
