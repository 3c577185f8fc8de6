//! The limits checked against the broker's state: admitting a session, a
//! channel, a queue, an exchange, a binding or a consumer, and management's
//! view and changes of the limits. The limits themselves are `crate::limits`.

use std::collections::BTreeSet;

use spillway_amqp::reply_code;
use spillway_proto::engine::{self as pb};
use spillway_proto::management as m;
use spillway_proto::ServiceError;

use super::{Broker, OpResult};
use crate::channels::SessionState;
use crate::limits::*;
use crate::model::SessionId;

impl Broker {
    /// At connection.open: the vhost's and the user's connection limits
    /// (RabbitMQ checks them in this order, with these words).
    pub(crate) fn admit_session(&self, open: &pb::OpenSession) -> OpResult<()> {
        if !self.vhosts.contains_key(&open.vhost) {
            // `open_session` refuses it, saying why.
            return Ok(());
        }
        let limits = &self.limits;
        // Checked afresh: housekeeping may not have seen the last growth.
        if let Some(over) = self.memory_ceiling.over() {
            return Err(limits.refuse(
                MEMORY_HIGH_WATERMARK,
                reply_code::RESOURCE_ERROR,
                format!("connection refused: {over}"),
            ));
        }
        let vhost_limit = limits.vhost_max_connections(&open.vhost);
        if vhost_limit != Limit::Unlimited {
            let open_now = self
                .sessions
                .values()
                .filter(|s| s.vhost == open.vhost)
                .count();
            if let Some(max) = vhost_limit.reached(open_now) {
                return Err(limits.refuse(
                    VHOST_MAX_CONNECTIONS,
                    reply_code::NOT_ALLOWED,
                    format!(
                        "access to vhost '{}' refused for user '{}': connection limit ({max}) is reached",
                        open.vhost, open.user
                    ),
                ));
            }
        }
        let user_limit = limits.user_max_connections(&open.user);
        if user_limit != Limit::Unlimited {
            let open_now = self
                .sessions
                .values()
                .filter(|s| s.user == open.user)
                .count();
            if let Some(max) = user_limit.reached(open_now) {
                return Err(limits.refuse(
                    USER_MAX_CONNECTIONS,
                    reply_code::NOT_ALLOWED,
                    format!(
                        "connection refused for user '{}': user connection limit ({max}) is reached",
                        open.user
                    ),
                ));
            }
        }
        Ok(())
    }

    /// At channel.open: the user's channel limit, over all their
    /// connections (530, which closes the connection, as in RabbitMQ).
    pub(crate) fn admit_channel(&self, session: SessionId) -> OpResult<()> {
        let Some(user) = self.sessions.get(&session).map(|s| s.user.as_str()) else {
            return Ok(());
        };
        let limit = self.limits.user_max_channels(user);
        if limit == Limit::Unlimited {
            return Ok(());
        }
        let open_now: usize = self
            .sessions
            .values()
            .filter(|s| s.user == user)
            .map(|s| s.channels.len())
            .sum();
        match limit.reached(open_now) {
            Some(max) => Err(self.limits.refuse(
                USER_MAX_CHANNELS,
                reply_code::NOT_ALLOWED,
                format!(
                    "number of channels opened for user '{user}' has reached the maximum allowed user limit of {max}"
                ),
            )),
            None => Ok(()),
        }
    }

    /// Before a declare creates `new_queues` queues (one, or two with
    /// Qpid's `<queue>_DLQ`; not at a redeclare or a passive declare): the
    /// vhost's queue limit and the connection's, with every queue it
    /// creates counted.
    pub(crate) fn admit_queue(
        &self,
        session: SessionId,
        vhost_name: &str,
        queue: &str,
        new_queues: usize,
    ) -> OpResult<()> {
        debug_assert!(
            new_queues >= 1,
            "a declare that creates no queue is not admitted"
        );
        let before_last = new_queues.saturating_sub(1);
        let Some(vhost) = self.vhosts.get(vhost_name) else {
            return Ok(());
        };
        if let Some(max) = self
            .limits
            .vhost_max_queues(vhost_name)
            .reached(vhost.queues.len() + before_last)
        {
            return Err(self.limits.refuse(
                VHOST_MAX_QUEUES,
                reply_code::PRECONDITION_FAILED,
                format!(
                    "cannot declare queue '{queue}': queue limit in vhost '{vhost_name}' ({max}) is reached"
                ),
            ));
        }
        let limit = Limit::from_config(self.limits.config.max_queues_per_connection);
        if limit != Limit::Unlimited {
            let created = vhost
                .queues
                .values()
                .filter(|q| q.created_by == Some(session))
                .count();
            if let Some(max) = limit.reached(created + before_last) {
                return Err(self.limits.refuse(
                    MAX_QUEUES_PER_CONNECTION,
                    reply_code::PRECONDITION_FAILED,
                    format!(
                        "cannot declare queue '{queue}': queue limit per connection ({max}) is reached"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Before a declare creates an exchange: the vhost's exchange limit,
    /// counting the exchanges clients declared (not the built-in ones).
    pub(crate) fn admit_exchange(&self, vhost_name: &str, exchange: &str) -> OpResult<()> {
        let limit = self.limits.vhost_max_exchanges(vhost_name);
        let Some(vhost) = self.vhosts.get(vhost_name) else {
            return Ok(());
        };
        if limit == Limit::Unlimited {
            return Ok(());
        }
        match limit.reached(declared_exchanges(vhost)) {
            Some(max) => Err(self.limits.refuse(
                VHOST_MAX_EXCHANGES,
                reply_code::PRECONDITION_FAILED,
                format!(
                    "cannot declare exchange '{exchange}': exchange limit in vhost '{vhost_name}' ({max}) is reached"
                ),
            )),
            None => Ok(()),
        }
    }

    /// Before a bind adds a binding (not one that exists): the vhost's
    /// binding limit.
    pub(crate) fn admit_binding(&self, vhost_name: &str) -> OpResult<()> {
        let limit = self.limits.vhost_max_bindings(vhost_name);
        let Some(vhost) = self.vhosts.get(vhost_name) else {
            return Ok(());
        };
        if limit == Limit::Unlimited {
            return Ok(());
        }
        match limit.reached(bindings(vhost)) {
            Some(max) => Err(self.limits.refuse(
                VHOST_MAX_BINDINGS,
                reply_code::PRECONDITION_FAILED,
                format!("cannot bind: binding limit in vhost '{vhost_name}' ({max}) is reached"),
            )),
            None => Ok(()),
        }
    }

    /// At basic.consume: the connection's consumer limit (in the words of
    /// RabbitMQ's `consumer_max_per_channel`, but 406 on the channel), then
    /// the vhost's and the user's.
    pub(crate) fn admit_consumer(&self, session: SessionId) -> OpResult<()> {
        let Some(state) = self.sessions.get(&session) else {
            return Ok(());
        };
        let limits = &self.limits;
        let limit = Limit::from_config(limits.config.max_consumers_per_connection);
        if let Some(max) = limit.reached(consumers_of(state)) {
            return Err(limits.refuse(
                MAX_CONSUMERS_PER_CONNECTION,
                reply_code::PRECONDITION_FAILED,
                format!("reached maximum ({max}) of consumers per connection"),
            ));
        }
        let vhost_limit = limits.vhost_max_consumers(&state.vhost);
        if vhost_limit != Limit::Unlimited {
            let open_now = self.consumers_where(|s| s.vhost == state.vhost);
            if let Some(max) = vhost_limit.reached(open_now) {
                return Err(limits.refuse(
                    VHOST_MAX_CONSUMERS,
                    reply_code::PRECONDITION_FAILED,
                    format!(
                        "cannot consume: consumer limit in vhost '{}' ({max}) is reached",
                        state.vhost
                    ),
                ));
            }
        }
        let user_limit = limits.user_max_consumers(&state.user);
        if user_limit != Limit::Unlimited {
            let open_now = self.consumers_where(|s| s.user == state.user);
            if let Some(max) = user_limit.reached(open_now) {
                return Err(limits.refuse(
                    USER_MAX_CONSUMERS,
                    reply_code::PRECONDITION_FAILED,
                    format!(
                        "cannot consume: consumer limit of user '{}' ({max}) is reached",
                        state.user
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Consumers on the sessions `which` picks.
    fn consumers_where(&self, which: impl Fn(&SessionState) -> bool) -> usize {
        self.sessions
            .values()
            .filter(|s| which(s))
            .map(consumers_of)
            .sum()
    }
}

// ------------------------------------------------------------ management

/// Whose limits a management call is about.
enum Target {
    Vhost(String),
    User(String),
}

fn target(vhost: &str, user: &str) -> Result<Target, ServiceError> {
    match (vhost.is_empty(), user.is_empty()) {
        (false, true) => Ok(Target::Vhost(vhost.to_string())),
        (true, false) if user.len() <= 255 => Ok(Target::User(user.to_string())),
        (true, false) => Err(ServiceError::InvalidArgument(
            "user name must be 1 to 255 bytes".into(),
        )),
        _ => Err(ServiceError::InvalidArgument(
            "give exactly one of vhost and user".into(),
        )),
    }
}

fn vhost_exists(broker: &Broker, vhost: &str) -> Result<(), ServiceError> {
    if broker.vhosts.contains_key(vhost) {
        return Ok(());
    }
    Err(ServiceError::NotFound(format!("vhost '{vhost}' not found")))
}

/// Management's SetLimits: overrides one vhost's or user's limits.
pub(crate) fn set(
    broker: &mut Broker,
    request: &m::SetLimitsRequest,
) -> Result<m::Limits, ServiceError> {
    let limit = |what: &str, value: Option<i64>| -> Result<Option<Limit>, ServiceError> {
        value
            .map(|value| Limit::from_management(what, value))
            .transpose()
    };
    let max_connections = limit("max_connections", request.max_connections)?;
    let max_queues = limit("max_queues", request.max_queues)?;
    let max_channels = limit("max_channels", request.max_channels)?;
    let max_exchanges = limit("max_exchanges", request.max_exchanges)?;
    let max_bindings = limit("max_bindings", request.max_bindings)?;
    let max_consumers = limit("max_consumers", request.max_consumers)?;
    match target(&request.vhost, &request.user)? {
        Target::Vhost(vhost) => {
            vhost_exists(broker, &vhost)?;
            if max_channels.is_some() {
                return Err(ServiceError::InvalidArgument(
                    "max_channels is a user limit; a vhost has max_connections, max_queues, \
                     max_exchanges, max_bindings and max_consumers"
                        .into(),
                ));
            }
            let overrides = broker.limits.vhosts.entry(vhost.clone()).or_default();
            overrides.max_connections = max_connections.or(overrides.max_connections);
            overrides.max_queues = max_queues.or(overrides.max_queues);
            overrides.max_exchanges = max_exchanges.or(overrides.max_exchanges);
            overrides.max_bindings = max_bindings.or(overrides.max_bindings);
            overrides.max_consumers = max_consumers.or(overrides.max_consumers);
            tracing::info!(vhost = %vhost, ?max_connections, ?max_queues, ?max_exchanges, ?max_bindings, ?max_consumers, "vhost limits set");
            Ok(vhost_view(broker, &vhost))
        }
        Target::User(user) => {
            if max_queues.is_some() || max_exchanges.is_some() || max_bindings.is_some() {
                return Err(ServiceError::InvalidArgument(
                    "max_queues, max_exchanges and max_bindings are vhost limits; a user has \
                     max_connections, max_channels and max_consumers"
                        .into(),
                ));
            }
            let overrides = broker.limits.users.entry(user.clone()).or_default();
            overrides.max_connections = max_connections.or(overrides.max_connections);
            overrides.max_channels = max_channels.or(overrides.max_channels);
            overrides.max_consumers = max_consumers.or(overrides.max_consumers);
            tracing::info!(user = %user, ?max_connections, ?max_channels, ?max_consumers, "user limits set");
            Ok(user_view(broker, &user))
        }
    }
}

/// Management's ClearLimits: the defaults apply again.
pub(crate) fn clear(
    broker: &mut Broker,
    request: &m::ClearLimitsRequest,
) -> Result<(), ServiceError> {
    match target(&request.vhost, &request.user)? {
        Target::Vhost(vhost) => {
            vhost_exists(broker, &vhost)?;
            broker.limits.vhosts.remove(&vhost);
            tracing::info!(vhost = %vhost, "vhost limits cleared");
        }
        Target::User(user) => {
            broker.limits.users.remove(&user);
            tracing::info!(user = %user, "user limits cleared");
        }
    }
    Ok(())
}

/// Management's ListLimits: every vhost, then every user with an override
/// or an open connection, each sorted by name.
pub(crate) fn list(broker: &Broker) -> m::ListLimitsResponse {
    let vhosts: BTreeSet<&String> = broker.vhosts.keys().collect();
    let users: BTreeSet<&String> = broker
        .limits
        .users
        .keys()
        .chain(broker.sessions.values().map(|s| &s.user))
        .collect();
    let mut limits: Vec<m::Limits> = vhosts.into_iter().map(|v| vhost_view(broker, v)).collect();
    limits.extend(users.into_iter().map(|u| user_view(broker, u)));
    let config = &broker.limits.config;
    m::ListLimitsResponse {
        limits,
        connection_max_consumers: Limit::from_config(config.max_consumers_per_connection)
            .as_management(),
        connection_max_queues: Limit::from_config(config.max_queues_per_connection).as_management(),
    }
}

fn vhost_view(broker: &Broker, vhost: &str) -> m::Limits {
    let limits = &broker.limits;
    m::Limits {
        kind: "vhost".into(),
        name: vhost.to_string(),
        max_connections: Some(limits.vhost_max_connections(vhost).as_management()),
        max_queues: Some(limits.vhost_max_queues(vhost).as_management()),
        max_channels: None,
        max_exchanges: Some(limits.vhost_max_exchanges(vhost).as_management()),
        max_bindings: Some(limits.vhost_max_bindings(vhost).as_management()),
        exchanges: broker.vhosts.get(vhost).map_or(0, declared_exchanges) as u64,
        bindings: broker.vhosts.get(vhost).map_or(0, bindings) as u64,
        max_consumers: Some(limits.vhost_max_consumers(vhost).as_management()),
        consumers: broker.consumers_where(|s| s.vhost == vhost) as u64,
        connections: broker
            .sessions
            .values()
            .filter(|s| s.vhost == vhost)
            .count() as u64,
        queues: broker.vhosts.get(vhost).map_or(0, |v| v.queues.len()) as u64,
        channels: broker
            .sessions
            .values()
            .filter(|s| s.vhost == vhost)
            .map(|s| s.channels.len() as u64)
            .sum(),
        overridden: limits.vhost(vhost).names(),
    }
}

/// The exchanges clients declared in `vhost` (the built-in ones, the
/// default exchange and `amq.*`, are not counted).
fn declared_exchanges(vhost: &crate::vhost::VHost) -> usize {
    vhost.exchanges.values().filter(|x| !x.is_builtin()).count()
}

/// Consumers on all of one session's channels.
fn consumers_of(session: &SessionState) -> usize {
    session.channels.values().map(|c| c.consumers.len()).sum()
}

/// The bindings between `vhost`'s exchanges and its queues or exchanges
/// (every queue's implicit binding to the default exchange is not one).
fn bindings(vhost: &crate::vhost::VHost) -> usize {
    vhost.exchanges.values().map(|x| x.bindings.len()).sum()
}

fn user_view(broker: &Broker, user: &str) -> m::Limits {
    let limits = &broker.limits;
    let sessions = || broker.sessions.values().filter(|s| s.user == user);
    m::Limits {
        kind: "user".into(),
        name: user.to_string(),
        max_connections: Some(limits.user_max_connections(user).as_management()),
        max_queues: None,
        max_channels: Some(limits.user_max_channels(user).as_management()),
        max_exchanges: None,
        max_bindings: None,
        exchanges: 0,
        bindings: 0,
        max_consumers: Some(limits.user_max_consumers(user).as_management()),
        consumers: broker.consumers_where(|s| s.user == user) as u64,
        connections: sessions().count() as u64,
        queues: 0,
        channels: sessions().map(|s| s.channels.len() as u64).sum(),
        overridden: limits.user(user).names(),
    }
}
