//! RabbitMQ's permissions as one domain type, used by the engine (AMQP
//! commands) and by management (its own calls): per user and vhost three
//! regular expressions, `configure` (declare and delete queues and
//! exchanges), `write` (publish to an exchange, bind to a queue or
//! exchange) and `read` (consume, get and purge a queue, bind from an
//! exchange).

use regex::{Regex, RegexBuilder};

use crate::storage::PermissionDefinition;

/// The longest permission pattern accepted.
pub const MAX_PATTERN_LEN: usize = 4096;
/// The most bytes a compiled pattern may take (`regex`'s size limit).
const PATTERN_SIZE_LIMIT: usize = 1 << 20;

/// The three kinds of access RabbitMQ checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Configure,
    Write,
    Read,
}

impl Access {
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Configure => "configure",
            Access::Write => "write",
            Access::Read => "read",
        }
    }
}

/// A pattern that is too long or does not compile.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct InvalidPattern(pub String);

/// A compiled permission pattern with its source.
#[derive(Clone, Debug)]
pub struct Pattern {
    source: String,
    /// None for the empty pattern, which RabbitMQ reads as "nothing".
    regex: Option<Regex>,
}

impl Pattern {
    pub fn new(source: &str) -> Result<Self, InvalidPattern> {
        if source.len() > MAX_PATTERN_LEN {
            return Err(InvalidPattern(format!(
                "a permission pattern is at most {MAX_PATTERN_LEN} bytes"
            )));
        }
        let regex = if source.is_empty() {
            None
        } else {
            Some(
                RegexBuilder::new(source)
                    .size_limit(PATTERN_SIZE_LIMIT)
                    .build()
                    .map_err(|error| {
                        InvalidPattern(format!("invalid pattern '{source}': {error}"))
                    })?,
            )
        };
        Ok(Self {
            source: source.to_string(),
            regex,
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// RabbitMQ's rule: the pattern is searched in the name (anchor it
    /// with `^…$` to match whole names); the empty pattern matches nothing.
    pub fn allows(&self, name: &str) -> bool {
        self.regex
            .as_ref()
            .is_some_and(|regex| regex.is_match(name))
    }
}

/// One user's permissions in one vhost.
#[derive(Clone, Debug)]
pub struct Permissions {
    pub configure: Pattern,
    pub write: Pattern,
    pub read: Pattern,
}

impl Permissions {
    pub fn new(configure: &str, write: &str, read: &str) -> Result<Self, InvalidPattern> {
        Ok(Self {
            configure: Pattern::new(configure)?,
            write: Pattern::new(write)?,
            read: Pattern::new(read)?,
        })
    }

    /// Everything: `.*` three times.
    pub fn all() -> Self {
        Self::new(".*", ".*", ".*").unwrap_or_else(|_| unreachable!(".* compiles"))
    }

    pub fn pattern(&self, access: Access) -> &Pattern {
        match access {
            Access::Configure => &self.configure,
            Access::Write => &self.write,
            Access::Read => &self.read,
        }
    }

    /// Whether `access` to the resource `name` is granted.
    pub fn allows(&self, access: Access, name: &str) -> bool {
        self.pattern(access).allows(name)
    }

    pub fn definition(&self, user: &str, vhost: &str) -> PermissionDefinition {
        PermissionDefinition {
            vhost: vhost.to_string(),
            user: user.to_string(),
            configure: self.configure.source.clone(),
            write: self.write.source.clone(),
            read: self.read.source.clone(),
        }
    }
}

/// What a permission is checked on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    Queue,
    Exchange,
}

impl Resource {
    pub fn as_str(self) -> &'static str {
        match self {
            Resource::Queue => "queue",
            Resource::Exchange => "exchange",
        }
    }
}

/// The name a permission is checked under: RabbitMQ checks the default
/// exchange (`""`) as `amq.default`.
pub fn checked_name(resource: Resource, name: &str) -> &str {
    match (resource, name) {
        (Resource::Exchange, "") => "amq.default",
        _ => name,
    }
}

/// Qpid's dead-letter exchange of `queue` (`x-qpid-dlq-enabled`).
pub fn qpid_dead_letter_exchange(queue: &str) -> String {
    format!("{queue}_DLE")
}

/// Qpid's dead-letter queue of `queue` (`x-qpid-dlq-enabled`).
pub fn qpid_dead_letter_queue(queue: &str) -> String {
    format!("{queue}_DLQ")
}

/// One permission a declare needs besides configure on what it declares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requirement {
    pub access: Access,
    pub resource: Resource,
    pub name: String,
}

impl Requirement {
    fn new(access: Access, resource: Resource, name: impl Into<String>) -> Self {
        Self {
            access,
            resource,
            name: name.into(),
        }
    }
}

/// What declaring `queue` with these dead-letter arguments needs beyond
/// configure on the queue, so that dead-lettering cannot reach what its
/// declarer may not publish to:
/// - `x-dead-letter-exchange` (RabbitMQ's rule): read on the queue, write
///   on the dead-letter exchange;
/// - `x-qpid-dlq-enabled`: the declare creates `<queue>_DLE` and
///   `<queue>_DLQ` and binds them, so configure on both, write on the DLQ
///   and read on the DLE (the bind); without an explicit dead-letter
///   exchange, dead letters go to `<queue>_DLE`: read on the queue, write on
///   `<queue>_DLE`.
pub fn dead_letter_requirements(
    queue: &str,
    dead_letter_exchange: Option<&str>,
    qpid_dlq: bool,
) -> Vec<Requirement> {
    use Access::{Configure, Read, Write};
    let mut needs = Vec::new();
    let dle = qpid_dead_letter_exchange(queue);
    if qpid_dlq {
        let dlq = qpid_dead_letter_queue(queue);
        needs.push(Requirement::new(Configure, Resource::Exchange, &dle));
        needs.push(Requirement::new(Configure, Resource::Queue, &dlq));
        needs.push(Requirement::new(Write, Resource::Queue, dlq));
        needs.push(Requirement::new(Read, Resource::Exchange, &dle));
    }
    let target = match dead_letter_exchange {
        Some(exchange) => Some(exchange.to_string()),
        None if qpid_dlq => Some(dle),
        None => None,
    };
    if let Some(target) = target {
        needs.push(Requirement::new(Read, Resource::Queue, queue));
        needs.push(Requirement::new(Write, Resource::Exchange, target));
    }
    needs
}

/// What declaring `exchange` with an `alternate-exchange` needs beyond
/// configure on it (RabbitMQ's rule): read on the exchange, write on the
/// alternate exchange.
pub fn alternate_exchange_requirements(
    exchange: &str,
    alternate: Option<&str>,
) -> Vec<Requirement> {
    match alternate {
        None => Vec::new(),
        Some(alternate) => vec![
            Requirement::new(Access::Read, Resource::Exchange, exchange),
            Requirement::new(Access::Write, Resource::Exchange, alternate),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_search_and_empty_matches_nothing() {
        let p = Permissions::new("^app\\.", "", "orders").unwrap_or_else(|e| panic!("{e}"));
        assert!(p.allows(Access::Configure, "app.x"));
        assert!(!p.allows(Access::Configure, "other"));
        assert!(!p.allows(Access::Write, "app.x"));
        assert!(p.allows(Access::Read, "my-orders-queue"));
        assert!(Permissions::new("(", ".*", ".*").is_err());
        assert!(Pattern::new(&"a".repeat(MAX_PATTERN_LEN + 1)).is_err());
    }

    #[test]
    fn dead_letter_and_alternate_exchanges_need_write_on_where_messages_go() {
        use Access::{Configure, Read, Write};
        let need = |access, resource, name: &str| Requirement::new(access, resource, name);
        assert!(dead_letter_requirements("q", None, false).is_empty());
        assert_eq!(
            dead_letter_requirements("q", Some(""), false),
            [
                need(Read, Resource::Queue, "q"),
                need(Write, Resource::Exchange, "")
            ]
        );
        assert_eq!(
            dead_letter_requirements("q", None, true),
            [
                need(Configure, Resource::Exchange, "q_DLE"),
                need(Configure, Resource::Queue, "q_DLQ"),
                need(Write, Resource::Queue, "q_DLQ"),
                need(Read, Resource::Exchange, "q_DLE"),
                need(Read, Resource::Queue, "q"),
                need(Write, Resource::Exchange, "q_DLE"),
            ]
        );
        assert!(
            dead_letter_requirements("q", Some("dlx"), true).contains(&need(
                Write,
                Resource::Exchange,
                "dlx"
            ))
        );
        assert_eq!(
            alternate_exchange_requirements("x", Some("ae")),
            [
                need(Read, Resource::Exchange, "x"),
                need(Write, Resource::Exchange, "ae")
            ]
        );
        assert_eq!(checked_name(Resource::Exchange, ""), "amq.default");
        assert_eq!(checked_name(Resource::Queue, ""), "");
    }
}
