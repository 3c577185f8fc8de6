//! What a configuration Spillway refuses to start with is reported as.

use std::fmt;
use std::path::PathBuf;

use super::env::env_name;

/// A configuration Spillway refuses to start with.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A layer could not be read at all: a missing `--config` file, a TOML
    /// syntax error, a variable whose value is not Unicode.
    #[error("reading the configuration from {origin}: {error}")]
    Read {
        origin: Origin,
        error: Box<config::ConfigError>,
    },
    /// The layers could not be combined (should not happen once each layer
    /// read on its own).
    #[error("invalid configuration: {0}")]
    Merge(Box<config::ConfigError>),
    /// Every problem found, unknown keys and bad values alike.
    #[error("invalid configuration:{}", problem_list(.0))]
    Invalid(Vec<Problem>),
}

fn problem_list(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|problem| format!("\n  - {problem}"))
        .collect()
}

/// Where a value was set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    File(PathBuf),
    /// The environment variable's name exactly as set.
    Env(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File(path) => write!(f, "{}", path.display()),
            Origin::Env(name) => write!(f, "environment variable {name}"),
        }
    }
}

/// One thing wrong with the configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// A key (or a whole section) that no setting reads.
    UnknownKey {
        /// The full key: `gateway.heartbeat_timout`, `gateway.users[1].nme`.
        key: String,
        origin: Origin,
        /// The nearest known key, when one is close.
        suggestion: Option<String>,
    },
    /// A value of the wrong type or format (`frame_max = "big"`, `12 parsecs`).
    BadValue { origin: Origin, error: String },
    /// One key set under its name and under an alias of it in one layer
    /// (`broker.consumer_timeout` and `engine.consumer_timeout`).
    SetTwice {
        alias: String,
        name: String,
        origin: Origin,
    },
    /// A value of the right type outside what the setting allows.
    OutOfRange {
        key: String,
        value: String,
        allowed: String,
        /// Where it was set (none: the layers do not say, e.g. a list entry
        /// whose index moved).
        origin: Option<Origin>,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::UnknownKey {
                key,
                origin,
                suggestion,
            } => {
                let what = if key.contains(['.', '[']) {
                    "key"
                } else {
                    "section"
                };
                write!(f, "unknown {what} `{key}` in {origin}")?;
                match (suggestion, origin) {
                    (None, _) => Ok(()),
                    (Some(known), Origin::Env(_)) => {
                        write!(f, "; did you mean {} (`{known}`)?", env_name(known))
                    }
                    (Some(known), Origin::File(_)) => write!(f, "; did you mean `{known}`?"),
                }
            }
            Problem::BadValue { origin, error } => write!(f, "in {origin}: {error}"),
            Problem::SetTwice {
                alias,
                name,
                origin,
            } => {
                match origin {
                    Origin::File(path) => {
                        write!(f, "`{alias}` and `{name}` both set in {}", path.display())?
                    }
                    Origin::Env(_) => write!(
                        f,
                        "environment variables {} and {} both set",
                        env_name(alias),
                        env_name(name)
                    )?,
                }
                write!(
                    f,
                    ": `{alias}` is another name of `{name}`; set one of them"
                )
            }
            Problem::OutOfRange {
                key,
                value,
                allowed,
                origin,
            } => {
                write!(f, "`{key}` = {value}")?;
                if let Some(origin) = origin {
                    write!(f, " (in {origin})")?;
                }
                write!(f, " is out of range: {allowed}")
            }
        }
    }
}
