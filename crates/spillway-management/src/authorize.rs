//! What a caller may do through management, by RabbitMQ's user tags
//! (the management plugin's rules, for the calls Spillway has):
//!
//! | tag | may |
//! |---|---|
//! | `administrator` | everything |
//! | `monitoring` | see everything (every vhost, every connection, the broker), plus what `management` may |
//! | `policymaker` | what `management` may, plus list, set and clear policies and change queue settings (`UpdateQueue`) in vhosts it has permissions in (operator policies are the administrator's) |
//! | `management` | see the vhosts it has permissions in (their queues, exchanges and bindings, not their policies) and its own connections and channels; declare, delete, bind, purge, peek and move there as its configure/write/read patterns allow, as over AMQP; the broker status with the totals of those vhosts only |
//! | none of these | nothing: PERMISSION_DENIED |
//!
//! Users, permissions, vhosts, limits, broker settings, the store quota and
//! transaction timeouts are the administrator's. Operators (the token and
//! `[[management.users]]`) may do everything.

use spillway_proto::permissions::{Access, Requirement};
use tonic::{Request, Status};

use crate::auth::{Caller, StoredUser};

/// The tags that give access to management at all.
const MANAGEMENT_TAGS: [&str; 4] = ["administrator", "monitoring", "policymaker", "management"];

/// What one call needs.
#[derive(Clone, Copy, Debug)]
pub enum Need<'a> {
    /// Users, permissions, vhosts, limits and broker-wide settings.
    Administrator,
    /// Broker-wide figures that name nothing of a vhost.
    Overview,
    /// Everything in every vhost (limits, every connection).
    Monitoring,
    /// To see one vhost's definitions and queues.
    See { vhost: &'a str },
    /// One of the three permissions on a named queue or exchange.
    Permission {
        vhost: &'a str,
        access: Access,
        kind: &'static str,
        name: &'a str,
    },
    /// Queue settings (RabbitMQ's policies).
    Policy { vhost: &'a str },
    /// The `policymaker` tag alone: to read policies, as RabbitMQ's
    /// management plugin allows (with [`Need::See`] for the vhost).
    Policymaker,
}

impl<'a> Need<'a> {
    /// Configure on a queue or an exchange: to declare or delete it.
    pub fn configure(vhost: &'a str, kind: &'static str, name: &'a str) -> Self {
        Need::Permission {
            vhost,
            access: Access::Configure,
            kind,
            name,
        }
    }

    /// Read on a queue: to purge it or take its messages.
    pub fn read_queue(vhost: &'a str, name: &'a str) -> Self {
        Need::Permission {
            vhost,
            access: Access::Read,
            kind: "queue",
            name,
        }
    }

    /// Write on a queue: to move messages into it.
    pub fn write_queue(vhost: &'a str, name: &'a str) -> Self {
        Need::Permission {
            vhost,
            access: Access::Write,
            kind: "queue",
            name,
        }
    }

    /// Write on an exchange: to publish through it.
    pub fn write_exchange(vhost: &'a str, name: &'a str) -> Self {
        Need::Permission {
            vhost,
            access: Access::Write,
            kind: "exchange",
            name,
        }
    }

    /// What a declare needs: configure on what it declares, and each
    /// permission its arguments need (a dead-letter or an alternate
    /// exchange), as over AMQP.
    pub fn declare(
        vhost: &'a str,
        kind: &'static str,
        name: &'a str,
        arguments_need: &'a [Requirement],
    ) -> Vec<Self> {
        let extra = arguments_need.iter().map(|requirement| Need::Permission {
            vhost,
            access: requirement.access,
            kind: requirement.resource.as_str(),
            name: &requirement.name,
        });
        std::iter::once(Need::configure(vhost, kind, name))
            .chain(extra)
            .collect()
    }

    /// Policies are the policymaker's (in vhosts it has permissions in),
    /// operator policies the administrator's, as in RabbitMQ.
    pub fn policy(vhost: &'a str, operator: bool) -> Self {
        if operator {
            Need::Administrator
        } else {
            Need::Policy { vhost }
        }
    }
}

/// The caller the authenticating service put on the request. A request
/// without one (the service not in front: a wiring mistake) is refused.
pub fn caller_of<T>(request: &Request<T>) -> Result<Caller, Status> {
    request
        .extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::unauthenticated("missing credentials"))
}

/// Whether `caller` may make a call with these needs.
pub fn authorize(caller: &Caller, needs: &[Need<'_>]) -> Result<(), Status> {
    let Caller::User(user) = caller else {
        return Ok(());
    };
    if !MANAGEMENT_TAGS.iter().any(|tag| user.has_tag(tag)) {
        return Err(Status::permission_denied(format!(
            "user '{}' may not use management: it has none of the tags {}",
            user.name,
            MANAGEMENT_TAGS.join(", ")
        )));
    }
    if user.has_tag("administrator") {
        return Ok(());
    }
    needs.iter().try_for_each(|need| check(user, *need))
}

fn check(user: &StoredUser, need: Need<'_>) -> Result<(), Status> {
    let monitoring = user.has_tag("monitoring");
    match need {
        Need::Administrator => Err(Status::permission_denied(format!(
            "user '{}' is not an administrator",
            user.name
        ))),
        Need::Overview => Ok(()),
        Need::Monitoring if monitoring => Ok(()),
        Need::Monitoring => Err(Status::permission_denied(format!(
            "user '{}' needs the monitoring or administrator tag",
            user.name
        ))),
        Need::See { vhost } if monitoring || user.permissions.contains_key(vhost) => Ok(()),
        Need::See { vhost } => Err(no_access_to_vhost(user, vhost)),
        Need::Permission {
            vhost,
            access,
            kind,
            name,
        } => {
            let granted = user
                .permissions
                .get(vhost)
                .ok_or_else(|| no_access_to_vhost(user, vhost))?;
            // RabbitMQ checks the default exchange as `amq.default`.
            let name = match (kind, name) {
                ("exchange", "") => "amq.default",
                _ => name,
            };
            if granted.allows(access, name) {
                return Ok(());
            }
            // RabbitMQ's words, as over AMQP.
            Err(Status::permission_denied(format!(
                "ACCESS_REFUSED - {} access to {kind} '{name}' in vhost '{vhost}' refused for user '{}'",
                access.as_str(),
                user.name
            )))
        }
        Need::Policy { vhost } => {
            check(user, Need::Policymaker)?;
            if !user.permissions.contains_key(vhost) {
                return Err(no_access_to_vhost(user, vhost));
            }
            Ok(())
        }
        Need::Policymaker if user.has_tag("policymaker") => Ok(()),
        Need::Policymaker => Err(Status::permission_denied(format!(
            "user '{}' needs the policymaker or administrator tag",
            user.name
        ))),
    }
}

fn no_access_to_vhost(user: &StoredUser, vhost: &str) -> Status {
    Status::permission_denied(format!(
        "access to vhost '{vhost}' refused for user '{}'",
        user.name
    ))
}

/// Whether `caller` may see the vhost (for filtering lists).
pub fn sees_vhost(caller: &Caller, vhost: &str) -> bool {
    authorize(caller, &[Need::See { vhost }]).is_ok()
}

/// Whether `caller` may see a connection or channel of `owner`: monitoring
/// users and administrators see all, others their own.
pub fn sees_connections_of(caller: &Caller, owner: &str) -> bool {
    authorize(caller, &[Need::Monitoring]).is_ok() || caller.name() == owner
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::HashMap;
    use std::sync::Arc;

    use spillway_proto::permissions::Permissions;

    use super::*;

    fn user(tags: &[&str], permissions: &[(&str, [&str; 3])]) -> Caller {
        Caller::User(Arc::new(StoredUser {
            name: "u".into(),
            tags: tags.iter().map(|t| t.to_string()).collect(),
            permissions: permissions
                .iter()
                .map(|(vhost, [c, w, r])| (vhost.to_string(), Permissions::new(c, w, r).unwrap()))
                .collect::<HashMap<_, _>>(),
        }))
    }

    fn declare<'a>(vhost: &'a str, name: &'a str) -> Need<'a> {
        Need::Permission {
            vhost,
            access: Access::Configure,
            kind: "queue",
            name,
        }
    }

    #[test]
    fn tags_decide_what_a_stored_user_may_do() {
        let admin = user(&["administrator"], &[]);
        let monitor = user(&["monitoring"], &[]);
        let app = user(&["management"], &[("/", ["^app\\.", "^app\\.", "^app\\."])]);
        let plain = user(&[], &[("/", [".*", ".*", ".*"])]);
        let operator = Caller::Operator {
            name: "token".into(),
        };

        for caller in [&admin, &operator] {
            assert!(authorize(caller, &[Need::Administrator]).is_ok());
            assert!(authorize(caller, &[declare("other", "x")]).is_ok());
        }
        assert!(authorize(&monitor, &[Need::See { vhost: "any" }]).is_ok());
        assert!(authorize(&monitor, &[Need::Monitoring]).is_ok());
        assert!(authorize(&monitor, &[declare("/", "x")]).is_err());
        assert!(authorize(&monitor, &[Need::Administrator]).is_err());

        assert!(authorize(&app, &[Need::See { vhost: "/" }]).is_ok());
        assert!(authorize(&app, &[Need::See { vhost: "other" }]).is_err());
        assert!(authorize(&app, &[declare("/", "app.orders")]).is_ok());
        let refused = authorize(&app, &[declare("/", "other")]).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(refused.message().contains("ACCESS_REFUSED"), "{refused:?}");
        assert!(authorize(&app, &[Need::Monitoring]).is_err());
        assert!(authorize(&app, &[Need::Policy { vhost: "/" }]).is_err());
        assert!(authorize(&app, &[Need::Policymaker]).is_err());
        assert!(authorize(&monitor, &[Need::Policymaker]).is_err());
        let maker = user(&["policymaker"], &[("/", [".*", ".*", ".*"])]);
        assert!(authorize(&maker, &[Need::Policymaker, Need::See { vhost: "/" }]).is_ok());
        assert!(authorize(&maker, &[Need::Policy { vhost: "/" }]).is_ok());
        assert!(authorize(&maker, &[Need::Policy { vhost: "other" }]).is_err());
        assert!(sees_connections_of(&app, "u"));
        assert!(!sees_connections_of(&app, "someone"));
        assert!(sees_connections_of(&monitor, "someone"));

        let refused = authorize(&plain, &[Need::Overview]).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    }
}
