//! A channel's transaction (`tx.select` .. `tx.commit`/`tx.rollback`): the
//! publishes and settles it holds, when it opened and was last used, and
//! the broker-wide transaction settings and timeouts. What commit and
//! rollback do is the broker's (`broker/tx.rs`).

use foldhash::{HashMap, HashMapExt};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spillway_proto::management as m;
use tokio::sync::Notify;

use crate::model::*;

/// `engine.max_transaction_bytes` by default: 16 MiB of bodies.
pub const DEFAULT_MAX_TRANSACTION_BYTES: u64 = 16 << 20;

/// A vhost's producer transaction timeouts (zero = off).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TxTimeouts {
    pub open_warn: Duration,
    pub open_close: Duration,
    pub idle_warn: Duration,
    pub idle_close: Duration,
}

impl TxTimeouts {
    pub(crate) fn any(&self) -> bool {
        !(self.open_warn.is_zero()
            && self.open_close.is_zero()
            && self.idle_warn.is_zero()
            && self.idle_close.is_zero())
    }

    pub(crate) fn view(&self, vhost: &str) -> m::TransactionTimeouts {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        m::TransactionTimeouts {
            vhost: vhost.to_string(),
            open_warn_ms: ms(self.open_warn),
            open_close_ms: ms(self.open_close),
            idle_warn_ms: ms(self.idle_warn),
            idle_close_ms: ms(self.idle_close),
        }
    }
}

/// The transaction settings from configuration.
#[derive(Clone, Debug)]
pub struct TxConfig {
    /// Message bytes one transaction may hold, counted as the memory budget
    /// counts them (`engine.max_transaction_bytes`).
    pub max_bytes: u64,
    /// An unroutable mandatory publish in a transaction closes the
    /// connection with 312 (`engine.close_when_no_route`), as Qpid does;
    /// false: basic.return, as RabbitMQ does.
    pub close_when_no_route: bool,
    /// Every vhost's timeouts unless management set its own
    /// (`broker.default_transaction_*`).
    pub default_timeouts: TxTimeouts,
}

impl Default for TxConfig {
    fn default() -> Self {
        Self {
            max_bytes: DEFAULT_MAX_TRANSACTION_BYTES,
            close_when_no_route: true,
            default_timeouts: TxTimeouts::default(),
        }
    }
}

/// The broker's transaction state: settings, and the channels whose
/// transaction is open (for the timer).
pub struct TxState {
    pub(crate) config: TxConfig,
    /// Management's per-vhost timeouts.
    pub(crate) vhost_timeouts: HashMap<String, TxTimeouts>,
    /// Channels with an open transaction (work held since its first publish
    /// or ack).
    pub(crate) open: BTreeSet<(SessionId, ChannelId)>,
    /// Wakes the timer task: a transaction opened, or timeouts changed.
    pub(crate) wake: Arc<Notify>,
}

impl TxState {
    pub fn new(config: TxConfig) -> Self {
        Self {
            config,
            vhost_timeouts: HashMap::new(),
            open: BTreeSet::new(),
            wake: Arc::new(Notify::new()),
        }
    }

    /// What the timer task waits on besides the clock.
    pub fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// Channels whose transaction is open now.
    pub fn open_count(&self) -> usize {
        self.open.len()
    }

    pub(crate) fn timeouts(&self, vhost: &str) -> TxTimeouts {
        self.vhost_timeouts
            .get(vhost)
            .copied()
            .unwrap_or(self.config.default_timeouts)
    }
}

/// A channel's uncommitted work (the channel is transactional while its
/// `ChannelState::tx` is `Some`).
#[derive(Default)]
pub struct Transaction {
    pub(crate) publishes: Vec<HeldPublish>,
    pub(crate) settles: Vec<HeldSettle>,
    /// Bytes of the held publishes, as the memory budget counts them.
    pub(crate) bytes: u64,
    /// The first publish or ack since the last commit or rollback: the
    /// transaction is open.
    pub(crate) opened_at: Option<Instant>,
    /// The last publish or ack in it.
    pub(crate) last_activity: Option<Instant>,
    /// When `CHN-1007` / `CHN-1008` were last logged for it.
    pub(crate) open_warned: Option<Instant>,
    pub(crate) idle_warned: Option<Instant>,
}

impl Transaction {
    pub(crate) fn is_open(&self) -> bool {
        self.opened_at.is_some()
    }

    /// Publish or ack: opens the transaction if needed; true if it did.
    pub(crate) fn touch(&mut self, now: Instant) -> bool {
        self.last_activity = Some(now);
        self.idle_warned = None;
        if self.opened_at.is_none() {
            self.opened_at = Some(now);
            return true;
        }
        false
    }

    /// Takes the work out, leaving an empty transaction (the channel stays
    /// transactional).
    pub(crate) fn take(&mut self) -> Transaction {
        std::mem::take(self)
    }
}

pub(crate) struct HeldPublish {
    pub(crate) targets: Vec<String>,
    pub(crate) message: Arc<Message>,
    /// The message's `expiration`, if any.
    pub(crate) message_ttl: Option<u64>,
}

/// Deliveries settled in the transaction, and how.
pub(crate) struct HeldSettle {
    pub unacked: Vec<Unacked>,
    pub action: Settle,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settle {
    Ack,
    Nack { requeue: bool },
}
