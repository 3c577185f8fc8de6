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
}
