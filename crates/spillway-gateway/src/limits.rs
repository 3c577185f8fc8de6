//! Limits the gateway enforces itself: `gateway.max_connections`, the most
//! connections one gateway process holds open at once (RabbitMQ's
//! `connection_max`), and the negotiated `channel_max`.
//!
//! A connection takes a slot when its socket is accepted, before it logs in,
//! and gives it back when it ends, however it ends: sockets that never log
//! in count too, so a stranger cannot make the gateway hold more than
//! `max_connections` sockets (each for `gateway.handshake_timeout` at most).
//! A socket accepted with every slot taken is still told why, in AMQP: it
//! goes through the handshake and is refused at `connection.open` with 530,
//! as RabbitMQ refuses past `connection_max`. At most
//! [`REFUSALS_AT_ONCE`] such refusals run at once; past that, a socket is
//! closed as soon as it is accepted.
//!
//! The vhost, user and per-connection limits are the engine's
//! (`spillway_engine`'s `limits.rs`): only it sees every gateway's sessions.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use spillway_amqp::{reply_code, MethodId};

use crate::amqp091::connection::error::{ConnectionError, Enforced};
use crate::metrics::CHANNEL_MAX;

/// The refusal of a channel.open past the negotiated `channel_max`: 530, in
/// RabbitMQ's words when `open` channels already reach it. RabbitMQ only
/// counts channels; Spillway also refuses a channel number above
/// `channel_max` (the spec's meaning of it), which no client library sends.
pub fn channel_max(channel: u16, open: usize, channel_max: u16) -> Option<ConnectionError> {
    let text = if open >= usize::from(channel_max) {
        format!("number of channels opened ({open}) has reached the negotiated channel_max ({channel_max})")
    } else if channel > channel_max {
        format!("channel number ({channel}) exceeds the negotiated channel_max ({channel_max})")
    } else {
        return None;
    };
    Some(
        ConnectionError::new(reply_code::NOT_ALLOWED, text)
            .on(MethodId::CHANNEL_OPEN)
            .enforcing(Enforced::Limit(CHANNEL_MAX)),
    )
}

/// Sockets accepted past `gateway.max_connections` that are being told so
/// (handshake, then 530 at `connection.open`) at once; more are closed
/// unanswered.
pub const REFUSALS_AT_ONCE: usize = 16;

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
    fn channel_max_refuses_past_the_count_or_the_number() {
        assert!(channel_max(2, 1, 2).is_none());
        let Some(full) = channel_max(3, 2, 2) else {
            panic!("a third channel past channel_max 2 was allowed");
        };
        assert_eq!(full.code(), reply_code::NOT_ALLOWED);
        assert_eq!(full.method(), MethodId::CHANNEL_OPEN);
        assert_eq!(full.enforced, Some(Enforced::Limit(CHANNEL_MAX)));
        assert_eq!(
            full.text(),
            "number of channels opened (2) has reached the negotiated channel_max (2)"
        );
        let Some(above) = channel_max(17, 1, 16) else {
            panic!("channel 17 past channel_max 16 was allowed");
        };
        assert_eq!(
            above.text(),
            "channel number (17) exceeds the negotiated channel_max (16)"
        );
    }

    #[test]
    fn zero_means_no_maximum() {
        let slots = ConnectionSlots::new(0);
        let held: Vec<_> = (0..1000).filter_map(|_| slots.take()).collect();
        assert_eq!(held.len(), 1000);
    }
}
