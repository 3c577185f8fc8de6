//! Limits on what clients may open, enforced by the engine because it sees
//! every gateway's sessions (with two gateways, a vhost's or a user's limit
//! is still one count):
//!
//! - per vhost, RabbitMQ's `max-connections` and `max-queues`, and the
//!   exchanges and bindings declared in it (what one user can make every
//!   publish and every listing walk);
//! - per user, RabbitMQ's `max-connections` and `max-channels`;
//! - per connection, the consumers it has and the queues it created that
//!   still exist.
//!
//! Vhost and user limits default to the configuration
//! (`engine.default_vhost_max_connections`, ...) and can be overridden per
//! vhost or user through management; like vhosts created through
//! management, overrides are not persisted. Per-connection limits come from
//! the configuration only. Each check runs under the broker lock when
//! something is opened, counting what is open right now; a limit that is not
//! set costs nothing. Lowering a limit closes nothing already open.
//!
//! Refusals use RabbitMQ's codes and words (530 NOT_ALLOWED for connections
//! and channels, 406 PRECONDITION_FAILED for queues and consumers), are
//! logged, and are counted in `spillway_limit_refusals_total`.

use foldhash::{HashMap, HashMapExt};

use spillway_proto::engine::AmqpError;
use spillway_proto::ServiceError;
use spillway_telemetry::LimitRefusals;

/// The label of each limit in `spillway_limit_refusals_total`.
pub const VHOST_MAX_CONNECTIONS: &str = "vhost_max_connections";
pub const VHOST_MAX_QUEUES: &str = "vhost_max_queues";
pub const VHOST_MAX_EXCHANGES: &str = "vhost_max_exchanges";
pub const VHOST_MAX_BINDINGS: &str = "vhost_max_bindings";
pub const USER_MAX_CONNECTIONS: &str = "user_max_connections";
pub const USER_MAX_CHANNELS: &str = "user_max_channels";
pub const MAX_CONSUMERS_PER_CONNECTION: &str = "max_consumers_per_connection";
pub const MAX_QUEUES_PER_CONNECTION: &str = "max_queues_per_connection";
pub const VHOST_MAX_CONSUMERS: &str = "vhost_max_consumers";
pub const USER_MAX_CONSUMERS: &str = "user_max_consumers";
/// Not a count: the process's memory ceiling (`engine.memory_high_watermark`).
pub const MEMORY_HIGH_WATERMARK: &str = "memory_high_watermark";

const ENGINE_LIMITS: [&str; 11] = [
    VHOST_MAX_CONNECTIONS,
    VHOST_MAX_QUEUES,
    VHOST_MAX_EXCHANGES,
    VHOST_MAX_BINDINGS,
    USER_MAX_CONNECTIONS,
    USER_MAX_CHANNELS,
    MAX_CONSUMERS_PER_CONNECTION,
    MAX_QUEUES_PER_CONNECTION,
    MEMORY_HIGH_WATERMARK,
    VHOST_MAX_CONSUMERS,
    USER_MAX_CONSUMERS,
];

/// The configuration's limits; 0 = no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitConfig {
    /// Connections open at once to one vhost (`engine.default_vhost_max_connections`).
    pub vhost_max_connections: u32,
    /// Queues in one vhost (`engine.default_vhost_max_queues`).
    pub vhost_max_queues: u32,
    /// Exchanges declared in one vhost, the built-in ones not counted
    /// (`engine.default_vhost_max_exchanges`).
    pub vhost_max_exchanges: u32,
    /// Bindings in one vhost (`engine.default_vhost_max_bindings`).
    pub vhost_max_bindings: u32,
    /// Consumers on one vhost's queues (`engine.default_vhost_max_consumers`).
    pub vhost_max_consumers: u32,
    /// Consumers on all of one user's connections
    /// (`engine.default_user_max_consumers`).
    pub user_max_consumers: u32,
    /// Connections open at once by one user (`engine.default_user_max_connections`).
    pub user_max_connections: u32,
    /// Channels open at once by one user, over all their connections
    /// (`engine.default_user_max_channels`).
    pub user_max_channels: u32,
    /// Consumers on one connection (`engine.max_consumers_per_connection`).
    pub max_consumers_per_connection: u32,
    /// Queues one connection created that still exist
    /// (`engine.max_queues_per_connection`).
    pub max_queues_per_connection: u32,
}

/// A limit in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    Unlimited,
    /// At most this many (0: none at all, as in RabbitMQ).
    Max(u64),
}

impl Limit {
    /// The configuration's convention: 0 = no limit.
    pub(crate) fn from_config(value: u32) -> Self {
        match value {
            0 => Limit::Unlimited,
            n => Limit::Max(u64::from(n)),
        }
    }

    /// RabbitMQ's convention, used by management: -1 = no limit, 0 = none
    /// allowed, N = at most N.
    pub(crate) fn from_management(what: &str, value: i64) -> Result<Self, ServiceError> {
        match value {
            -1 => Ok(Limit::Unlimited),
            n => u64::try_from(n).map(Limit::Max).map_err(|_| {
                ServiceError::InvalidArgument(format!(
                    "{what} must be -1 (no limit), 0 or more, not {n}"
                ))
            }),
        }
    }

    pub(crate) fn as_management(self) -> i64 {
        match self {
            Limit::Unlimited => -1,
            Limit::Max(n) => i64::try_from(n).unwrap_or(i64::MAX),
        }
    }

    /// The maximum, when `open` already reaches it (one more is refused).
    pub(crate) fn reached(self, open: usize) -> Option<u64> {
        match self {
            Limit::Max(max) if open as u64 >= max => Some(max),
            _ => None,
        }
    }
}

/// One vhost's or user's limits set through management; `None` = the
/// configuration's default.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Overrides {
    pub(crate) max_connections: Option<Limit>,
    pub(crate) max_queues: Option<Limit>,
    pub(crate) max_channels: Option<Limit>,
    pub(crate) max_exchanges: Option<Limit>,
    pub(crate) max_bindings: Option<Limit>,
    pub(crate) max_consumers: Option<Limit>,
}

impl Overrides {
    pub(crate) fn names(&self) -> Vec<String> {
        [
            ("max_connections", self.max_connections),
            ("max_queues", self.max_queues),
            ("max_channels", self.max_channels),
            ("max_exchanges", self.max_exchanges),
            ("max_bindings", self.max_bindings),
            ("max_consumers", self.max_consumers),
        ]
        .into_iter()
        .filter(|(_, limit)| limit.is_some())
        .map(|(name, _)| name.to_string())
        .collect()
    }
}

/// The limits in force and the refusals they caused.
#[derive(Debug)]
pub struct Limits {
    pub(crate) config: LimitConfig,
    pub(crate) vhosts: HashMap<String, Overrides>,
    pub(crate) users: HashMap<String, Overrides>,
    pub(crate) refusals: LimitRefusals,
}

impl Limits {
    pub fn new(config: LimitConfig) -> Self {
        Self {
            config,
            vhosts: HashMap::new(),
            users: HashMap::new(),
            refusals: LimitRefusals::new(&ENGINE_LIMITS),
        }
    }

    /// The engine's refusal counts, for `/metrics`.
    pub fn refusals(&self) -> LimitRefusals {
        self.refusals.clone()
    }

    pub(crate) fn vhost(&self, vhost: &str) -> Overrides {
        self.vhosts.get(vhost).copied().unwrap_or_default()
    }

    pub(crate) fn user(&self, user: &str) -> Overrides {
        self.users.get(user).copied().unwrap_or_default()
    }

    pub(crate) fn vhost_max_connections(&self, vhost: &str) -> Limit {
        self.vhost(vhost)
            .max_connections
            .unwrap_or(Limit::from_config(self.config.vhost_max_connections))
    }

    pub(crate) fn vhost_max_queues(&self, vhost: &str) -> Limit {
        self.vhost(vhost)
            .max_queues
            .unwrap_or(Limit::from_config(self.config.vhost_max_queues))
    }

    pub(crate) fn vhost_max_exchanges(&self, vhost: &str) -> Limit {
        self.vhost(vhost)
            .max_exchanges
            .unwrap_or(Limit::from_config(self.config.vhost_max_exchanges))
    }

    pub(crate) fn vhost_max_bindings(&self, vhost: &str) -> Limit {
        self.vhost(vhost)
            .max_bindings
            .unwrap_or(Limit::from_config(self.config.vhost_max_bindings))
    }

    pub(crate) fn vhost_max_consumers(&self, vhost: &str) -> Limit {
        self.vhost(vhost)
            .max_consumers
            .unwrap_or(Limit::from_config(self.config.vhost_max_consumers))
    }

    pub(crate) fn user_max_consumers(&self, user: &str) -> Limit {
        self.user(user)
            .max_consumers
            .unwrap_or(Limit::from_config(self.config.user_max_consumers))
    }

    pub(crate) fn user_max_connections(&self, user: &str) -> Limit {
        self.user(user)
            .max_connections
            .unwrap_or(Limit::from_config(self.config.user_max_connections))
    }

    pub(crate) fn user_max_channels(&self, user: &str) -> Limit {
        self.user(user)
            .max_channels
            .unwrap_or(Limit::from_config(self.config.user_max_channels))
    }

    /// A vhost deleted through management takes its overrides with it.
    pub(crate) fn forget_vhost(&mut self, vhost: &str) {
        self.vhosts.remove(vhost);
    }

    pub(crate) fn refuse(&self, limit: &'static str, code: u16, text: String) -> AmqpError {
        self.refusals.count(limit);
        tracing::warn!(limit, reply_code = code, reason = %text, "refused by a limit");
        AmqpError::new(code, text)
    }
}

// ------------------------------------------------------------ enforcement

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn config_zero_is_no_limit_and_management_minus_one_is_no_limit() {
        assert_eq!(Limit::from_config(0), Limit::Unlimited);
        assert_eq!(Limit::from_config(3), Limit::Max(3));
        assert_eq!(Limit::from_management("x", -1).ok(), Some(Limit::Unlimited));
        assert_eq!(Limit::from_management("x", 0).ok(), Some(Limit::Max(0)));
        assert!(Limit::from_management("x", -2).is_err());
        assert_eq!(Limit::Max(0).reached(0), Some(0));
        assert_eq!(Limit::Max(2).reached(1), None);
        assert_eq!(Limit::Max(2).reached(2), Some(2));
        assert_eq!(Limit::Unlimited.reached(usize::MAX), None);
    }
}
