//! Message bodies lent from the read buffer instead of copied out of it.
//!
//! A body that came in one frame is already a slice of the connection's read
//! buffer. Handing that slice on saves a copy and an allocation per message
//! (for 16 KiB bodies, a sixth of the broker's CPU), but the slice keeps its
//! whole allocation alive (up to [`crate::read_room::MAX_READ_ROOM`] plus a
//! frame) for as long as the message lives, while the engine's memory
//! budget counts only the body. So lending is bounded: every allocation a
//! lent body keeps alive is charged, whole, against one gateway-wide limit
//! ([`MAX_LENT_READ_BYTES`]) until the last body lent from it is dropped;
//! past the limit, and for bodies under [`MIN_LENT_BODY`], bodies are copied
//! as before. What the broker holds beyond its counted bytes because of
//! lending is therefore at most [`MAX_LENT_READ_BYTES`] (`docs/limits.md`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use bytes::Bytes;
use spillway_telemetry::prometheus_client::metrics::gauge::Gauge;

use crate::read_room::ReadChunk;

/// The most bytes of read buffers that lent bodies keep alive at once, over
/// every connection of the gateway.
pub const MAX_LENT_READ_BYTES: usize = 32 << 20;

/// Smaller bodies are copied: the copy is cheap, and a small body kept
/// waiting in a queue would hold a whole read buffer for little.
pub const MIN_LENT_BODY: usize = 4 * 1024;

/// The gateway-wide count of read-buffer bytes kept alive by lent bodies.
#[derive(Debug)]
pub struct BodyLoans {
    limit: usize,
    lent: AtomicUsize,
    /// `spillway_lent_read_buffer_bytes`.
    gauge: Gauge,
}

impl BodyLoans {
    pub fn new(limit: usize, gauge: Gauge) -> Arc<Self> {
        Arc::new(Self {
            limit,
            lent: AtomicUsize::new(0),
            gauge,
        })
    }

    /// Read-buffer bytes lent bodies keep alive now.
    pub fn lent_bytes(&self) -> usize {
        self.lent.load(Ordering::Relaxed)
    }

    /// Charges `bytes` if they fit under the limit.
    fn charge(self: &Arc<Self>, bytes: usize) -> Option<Arc<Charge>> {
        self.lent
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |lent| {
                lent.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .ok()?;
        self.gauge.inc_by(bytes as i64);
        Some(Arc::new(Charge {
            bytes,
            loans: self.clone(),
        }))
    }
}

/// One read-buffer allocation charged against the limit; released when the
/// last body lent from it is dropped.
#[derive(Debug)]
struct Charge {
    bytes: usize,
    loans: Arc<BodyLoans>,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.loans.lent.fetch_sub(self.bytes, Ordering::AcqRel);
        self.loans.gauge.dec_by(self.bytes as i64);
    }
}

/// A lent body: the slice, and the charge of the allocation it keeps alive.
struct LentBody {
    body: Bytes,
    _charge: Arc<Charge>,
}

impl AsRef<[u8]> for LentBody {
    fn as_ref(&self) -> &[u8] {
        &self.body
    }
}

/// One connection's side of lending: which of its read-buffer allocations
/// is charged now.
#[derive(Debug, Default)]
pub struct BodyLender {
    loans: Option<Arc<BodyLoans>>,
    /// The allocation the last body was lent from, while a body still
    /// keeps its charge.
    current: Option<(u64, Weak<Charge>)>,
}

impl BodyLender {
    pub fn new(loans: Arc<BodyLoans>) -> Self {
        Self {
            loans: Some(loans),
            current: None,
        }
    }

    /// `payload`, a whole body just split off the read buffer allocation
    /// `chunk`, lent if the limit allows; `None`: copy it.
    pub fn lend(&mut self, payload: &Bytes, chunk: Option<ReadChunk>) -> Option<Bytes> {
        let loans = self.loans.as_ref()?;
        let chunk = chunk?;
        if payload.len() < MIN_LENT_BODY {
            return None;
        }
        let charged = match &self.current {
            Some((id, charge)) if *id == chunk.id => charge.upgrade(),
            _ => None,
        };
        let charge = match charged {
            Some(charge) => charge,
            None => {
                let charge = loans.charge(chunk.bytes)?;
                self.current = Some((chunk.id, Arc::downgrade(&charge)));
                charge
            }
        };
        Some(Bytes::from_owner(LentBody {
            body: payload.clone(),
            _charge: charge,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(id: u64, bytes: usize) -> Option<ReadChunk> {
        Some(ReadChunk { id, bytes })
    }

    #[test]
    fn an_allocation_is_charged_once_until_its_last_body_is_dropped() {
        let loans = BodyLoans::new(1 << 20, Gauge::default());
        let mut lender = BodyLender::new(loans.clone());
        let body = Bytes::from(vec![1u8; MIN_LENT_BODY]);
        let first = lender.lend(&body, chunk(1, 300_000)).unwrap();
        let second = lender.lend(&body, chunk(1, 300_000)).unwrap();
        assert_eq!(&first[..], &body[..]);
        assert_eq!(loans.lent_bytes(), 300_000);
        let third = lender.lend(&body, chunk(2, 200_000)).unwrap();
        assert_eq!(loans.lent_bytes(), 500_000);
        drop(first);
        assert_eq!(loans.lent_bytes(), 500_000);
        drop(second);
        assert_eq!(loans.lent_bytes(), 200_000);
        drop(third);
        assert_eq!(loans.lent_bytes(), 0);
    }

    #[test]
    fn past_the_limit_small_bodies_or_unknown_allocations_are_copied() {
        let loans = BodyLoans::new(500_000, Gauge::default());
        let mut lender = BodyLender::new(loans.clone());
        let body = Bytes::from(vec![1u8; MIN_LENT_BODY]);
        let kept = lender.lend(&body, chunk(1, 400_000)).unwrap();
        assert!(lender.lend(&body, chunk(2, 400_000)).is_none());
        assert!(lender.lend(&body, None).is_none());
        let small = Bytes::from(vec![1u8; MIN_LENT_BODY - 1]);
        assert!(lender.lend(&small, chunk(1, 400_000)).is_none());
        // Another connection shares the limit.
        let mut other = BodyLender::new(loans.clone());
        assert!(other.lend(&body, chunk(1, 200_000)).is_none());
        drop(kept);
        assert!(other.lend(&body, chunk(1, 200_000)).is_some());
        assert!(BodyLender::default().lend(&body, chunk(1, 1)).is_none());
    }
}
