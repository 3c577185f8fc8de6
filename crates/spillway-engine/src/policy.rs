//! Policies and operator policies, as RabbitMQ defines them: a named,
//! prioritised pattern that sets queue and exchange settings by name
//! instead of in every client's declare. This module owns the policy as a
//! value — its checks, which objects it matches, and how its keys combine
//! with a queue's own arguments into the arguments in force; the broker
//! (`broker/policies.rs`) keeps them per vhost and applies them.
//!
//! Combining (RabbitMQ 3.10's classic queue rules, `docs/policies.md`):
//! of the policies that match an object, the one with the highest priority
//! applies (equal priorities: the first name); of the operator policies,
//! likewise. A numeric key (`message-ttl`, `expires`, `max-length`,
//! `max-length-bytes`, `delivery-limit`) in force is the lowest of the
//! queue's argument, the policy's value and the operator policy's value;
//! for every other key the queue's argument wins over the policy.

use std::collections::BTreeMap;

use amq_protocol_types::{AMQPValue, FieldTable, ShortString};
use regex::{Regex, RegexBuilder};
use serde_json::Value;
use spillway_proto::permissions::MAX_PATTERN_LEN;
use spillway_proto::storage::PolicyDefinition;

/// An argument table being merged.
type Arguments = BTreeMap<ShortString, AMQPValue>;

/// The longest definition (JSON text) accepted.
pub const MAX_DEFINITION_LEN: usize = 16 * 1024;
/// The most policies (and, apart, operator policies) one vhost holds.
pub const MAX_POLICIES_PER_VHOST: usize = 1024;
/// The most bytes a compiled pattern may take (`regex`'s size limit).
const PATTERN_SIZE_LIMIT: usize = 1 << 20;

/// What kind of objects a policy applies to (`--apply-to`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyTo {
    Queues,
    Exchanges,
    All,
}

impl ApplyTo {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "" | "all" => Some(Self::All),
            "queues" => Some(Self::Queues),
            "exchanges" => Some(Self::Exchanges),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queues => "queues",
            Self::Exchanges => "exchanges",
            Self::All => "all",
        }
    }

    fn queues(self) -> bool {
        self != Self::Exchanges
    }

    fn exchanges(self) -> bool {
        self != Self::Queues
    }
}

/// How a key combines with a queue's argument and an operator policy.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A non-negative integer; the lowest value in force wins.
    Lowest { at_least: u64 },
    /// A non-negative integer; the queue's argument wins (Qpid's
    /// capacities, which management can also change at runtime).
    Count,
    /// A string; the queue's argument wins.
    Text,
    /// `drop-head`, `reject-publish` or `reject-publish-dlx`; the queue's
    /// argument wins.
    Overflow,
}

/// A policy key: its name, the queue argument it stands for, how it
/// combines, and whether operator policies may set it.
struct Key {
    name: &'static str,
    argument: &'static str,
    kind: Kind,
    operator: bool,
    exchange: bool,
}

const KEYS: &[Key] = &[
    Key {
        name: "message-ttl",
        argument: "x-message-ttl",
        kind: Kind::Lowest { at_least: 0 },
        operator: true,
        exchange: false,
    },
    Key {
        name: "expires",
        argument: "x-expires",
        kind: Kind::Lowest { at_least: 1 },
        operator: true,
        exchange: false,
    },
    Key {
        name: "max-length",
        argument: "x-max-length",
        kind: Kind::Lowest { at_least: 0 },
        operator: true,
        exchange: false,
    },
    Key {
        name: "max-length-bytes",
        argument: "x-max-length-bytes",
        kind: Kind::Lowest { at_least: 0 },
        operator: true,
        exchange: false,
    },
    Key {
        name: "delivery-limit",
        argument: "x-delivery-limit",
        kind: Kind::Lowest { at_least: 0 },
        operator: true,
        exchange: false,
    },
    Key {
        name: "overflow",
        argument: "x-overflow",
        kind: Kind::Overflow,
        operator: false,
        exchange: false,
    },
    Key {
        name: "dead-letter-exchange",
        argument: "x-dead-letter-exchange",
        kind: Kind::Text,
        operator: false,
        exchange: false,
    },
    Key {
        name: "dead-letter-routing-key",
        argument: "x-dead-letter-routing-key",
        kind: Kind::Text,
        operator: false,
        exchange: false,
    },
    Key {
        name: "qpid-capacity",
        argument: "x-qpid-capacity",
        kind: Kind::Count,
        operator: false,
        exchange: false,
    },
    Key {
        name: "qpid-flow-resume-capacity",
        argument: "x-qpid-flow-resume-capacity",
        kind: Kind::Count,
        operator: false,
        exchange: false,
    },
    Key {
        name: "alternate-exchange",
        argument: crate::argument_values::ALTERNATE_EXCHANGE,
        kind: Kind::Text,
        operator: false,
        exchange: true,
    },
];

fn key(name: &str) -> Option<&'static Key> {
    KEYS.iter().find(|key| key.name == name)
}

/// A checked value of one key.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Setting {
    Number(u64),
    Text(String),
}

/// A policy or operator policy, checked.
#[derive(Clone, Debug)]
pub struct Policy {
    pub name: String,
    pub operator: bool,
    pub pattern: String,
    regex: Regex,
    pub apply_to: ApplyTo,
    pub priority: i32,
    /// The definition as given (JSON), for views and the store.
    pub definition: String,
    settings: BTreeMap<&'static str, Setting>,
}

/// Why a policy was refused (management answers InvalidArgument).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct InvalidPolicy(pub String);

fn invalid(text: impl Into<String>) -> InvalidPolicy {
    InvalidPolicy(text.into())
}

impl Policy {
    /// Checks a policy as RabbitMQ's validators do: a known key with a
    /// value of its type, an operator policy only the keys operators may
    /// set and only on queues.
    pub fn new(
        name: &str,
        operator: bool,
        pattern: &str,
        apply_to: &str,
        priority: i32,
        definition: &str,
    ) -> Result<Self, InvalidPolicy> {
        if name.is_empty() || name.len() > 255 {
            return Err(invalid("a policy name is 1 to 255 bytes"));
        }
        if pattern.len() > MAX_PATTERN_LEN {
            return Err(invalid(format!(
                "a policy pattern is at most {MAX_PATTERN_LEN} bytes"
            )));
        }
        let regex = RegexBuilder::new(pattern)
            .size_limit(PATTERN_SIZE_LIMIT)
            .build()
            .map_err(|error| invalid(format!("invalid pattern '{pattern}': {error}")))?;
        let apply_to = ApplyTo::parse(apply_to).ok_or_else(|| {
            invalid(format!(
                "invalid apply-to '{apply_to}': queues, exchanges or all"
            ))
        })?;
        if operator && apply_to != ApplyTo::Queues {
            return Err(invalid("an operator policy applies to queues only"));
        }
        if definition.len() > MAX_DEFINITION_LEN {
            return Err(invalid(format!(
                "a policy definition is at most {MAX_DEFINITION_LEN} bytes"
            )));
        }
        // serde_json bounds its nesting depth (128) itself.
        let parsed: Value = serde_json::from_str(definition)
            .map_err(|error| invalid(format!("the definition is not valid JSON: {error}")))?;
        let Value::Object(object) = parsed else {
            return Err(invalid(
                "the definition must be a JSON object of keys and values",
            ));
        };
        if object.is_empty() {
            return Err(invalid("the definition sets no key"));
        }
        let unknown: Vec<&str> = object
            .keys()
            .filter(|name| key(name).is_none_or(|key| operator && !key.operator))
            .map(String::as_str)
            .collect();
        if !unknown.is_empty() {
            let what = if operator {
                "operator policy settings"
            } else {
                "policy settings"
            };
            return Err(invalid(format!(
                "{} are not recognised {what}",
                unknown
                    .iter()
                    .map(|name| format!("'{name}'"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let mut settings = BTreeMap::new();
        for (name, value) in &object {
            let Some(key) = key(name) else { continue };
            settings.insert(key.name, setting(key, value)?);
        }
        Ok(Self {
            name: name.to_string(),
            operator,
            pattern: pattern.to_string(),
            regex,
            apply_to,
            priority,
            definition: definition.to_string(),
            settings,
        })
    }

    /// A stored policy (checked when it was set).
    pub fn from_definition(def: &PolicyDefinition) -> Result<Self, InvalidPolicy> {
        Self::new(
            &def.name,
            def.operator,
            &def.pattern,
            &def.apply_to,
            def.priority,
            &def.definition,
        )
    }

    pub fn definition(&self, vhost: &str) -> PolicyDefinition {
        PolicyDefinition {
            vhost: vhost.to_string(),
            name: self.name.clone(),
            operator: self.operator,
            pattern: self.pattern.clone(),
            apply_to: self.apply_to.as_str().to_string(),
            priority: self.priority,
            definition: self.definition.clone(),
        }
    }

    fn matches(&self, name: &str) -> bool {
        self.regex.is_match(name)
    }

    /// The alternate exchange it sets, if any.
    pub fn alternate_exchange(&self) -> Option<&str> {
        match self.settings.get("alternate-exchange")? {
            Setting::Text(name) => Some(name),
            Setting::Number(_) => None,
        }
    }
}

fn setting(key: &Key, value: &Value) -> Result<Setting, InvalidPolicy> {
    let refuse = |what: &str| {
        invalid(format!(
            "{value} is not a valid value for '{}': {what}",
            key.name
        ))
    };
    match key.kind {
        Kind::Lowest { at_least } => match value.as_u64() {
            Some(n) if n >= at_least => {
                if matches!(key.name, "message-ttl" | "expires")
                    && n > spillway_amqp::properties::MAX_EXPIRY_MS
                {
                    return Err(refuse("at most 4294967295 milliseconds"));
                }
                Ok(Setting::Number(n))
            }
            _ if at_least > 0 => Err(refuse("an integer of at least 1")),
            _ => Err(refuse("a non-negative integer")),
        },
        Kind::Count => value
            .as_u64()
            .map(Setting::Number)
            .ok_or_else(|| refuse("a non-negative integer")),
        Kind::Text => match value {
            Value::String(text) if text.len() <= 255 => Ok(Setting::Text(text.clone())),
            _ => Err(refuse("a string of at most 255 bytes")),
        },
        Kind::Overflow => match value.as_str() {
            Some(text @ ("drop-head" | "reject-publish" | "reject-publish-dlx")) => {
                Ok(Setting::Text(text.to_string()))
            }
            _ => Err(refuse("drop-head, reject-publish or reject-publish-dlx")),
        },
    }
}

/// A vhost's policies, or its operator policies, by name.
#[derive(Clone, Debug, Default)]
pub struct PolicySet {
    by_name: BTreeMap<String, Policy>,
}

impl PolicySet {
    pub fn insert(&mut self, policy: Policy) {
        self.by_name.insert(policy.name.clone(), policy);
    }

    pub fn remove(&mut self, name: &str) -> Option<Policy> {
        self.by_name.remove(name)
    }

    pub fn get(&self, name: &str) -> Option<&Policy> {
        self.by_name.get(name)
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Policy> {
        self.by_name.values()
    }

    /// The policy that applies to a queue of this name: the highest
    /// priority of those that match (equal: the first name).
    pub fn for_queue(&self, name: &str) -> Option<&Policy> {
        self.best(|policy| policy.apply_to.queues() && policy.matches(name))
    }

    /// The policy that applies to an exchange of this name.
    pub fn for_exchange(&self, name: &str) -> Option<&Policy> {
        self.best(|policy| policy.apply_to.exchanges() && policy.matches(name))
    }

    fn best(&self, applies: impl Fn(&Policy) -> bool) -> Option<&Policy> {
        // In name order, replaced only by a strictly higher priority: of
        // equal priorities the first name stays.
        self.by_name.values().filter(|policy| applies(policy)).fold(
            None,
            |best: Option<&Policy>, policy| match best {
                Some(best) if best.priority >= policy.priority => Some(best),
                _ => Some(policy),
            },
        )
    }
}

/// The arguments in force for a queue declared with `declared`: the
/// policy's and operator policy's keys merged in as x-arguments by the
/// rules in this module's documentation. Returns None when neither
/// policy sets a queue key (the declared arguments are in force).
pub fn effective_queue_arguments(
    declared: &FieldTable,
    policy: Option<&Policy>,
    operator: Option<&Policy>,
) -> Option<FieldTable> {
    let sets_queue_keys = |policy: Option<&Policy>| {
        policy.is_some_and(|p| {
            p.settings
                .keys()
                .any(|name| key(name).is_some_and(|k| !k.exchange))
        })
    };
    if !sets_queue_keys(policy) && !sets_queue_keys(operator) {
        return None;
    }
    let mut table: Arguments = declared.inner().clone();
    for policy in [policy, operator].into_iter().flatten() {
        for (name, setting) in &policy.settings {
            let Some(key) = key(name) else { continue };
            if key.exchange {
                continue;
            }
            let current = argument(&table, key);
            let value = match (key.kind, setting, current) {
                (_, Setting::Number(n), None) => AMQPValue::LongLongInt(clamp_i64(*n)),
                (Kind::Lowest { .. }, Setting::Number(n), Some(current)) => {
                    match crate::argument_values::as_integer(current) {
                        Some(arg) if arg >= 0 && (arg as u128) <= u128::from(*n) => continue,
                        _ => AMQPValue::LongLongInt(clamp_i64(*n)),
                    }
                }
                // An operator policy's capacity is a ceiling too.
                (Kind::Count, Setting::Number(n), Some(current)) if policy.operator => {
                    match crate::argument_values::as_integer(current) {
                        Some(arg) if arg >= 0 && (arg as u128) <= u128::from(*n) => continue,
                        _ => AMQPValue::LongLongInt(clamp_i64(*n)),
                    }
                }
                (_, Setting::Text(text), None) => AMQPValue::LongString(text.as_str().into()),
                // The queue's own argument wins.
                (_, _, Some(_)) => continue,
            };
            if key.argument == "x-qpid-capacity" {
                // The alias must not keep an older value in force.
                table.remove("qpid.max_size");
            }
            table.insert(key.argument.into(), value);
        }
    }
    reconcile(&mut table);
    Some(FieldTable::from(table))
}

/// The queue's value of a key's argument (Qpid's capacity has an alias).
fn argument<'a>(table: &'a Arguments, key: &Key) -> Option<&'a AMQPValue> {
    table.get(key.argument).or_else(|| {
        (key.argument == "x-qpid-capacity")
            .then(|| table.get("qpid.max_size"))
            .flatten()
    })
}

/// Keys set apart that make no sense together are made to: a resume
/// capacity above the capacity is the capacity, a dead-letter routing key
/// without an exchange (from a policy) has nothing to apply to.
fn reconcile(table: &mut Arguments) {
    let number = |table: &Arguments, name: &str| {
        table.get(name).and_then(crate::argument_values::as_integer)
    };
    let capacity = number(table, "x-qpid-capacity").or_else(|| number(table, "qpid.max_size"));
    if let (Some(capacity), Some(resume)) = (capacity, number(table, "x-qpid-flow-resume-capacity"))
    {
        if capacity > 0 && resume > capacity {
            table.insert(
                "x-qpid-flow-resume-capacity".into(),
                AMQPValue::LongLongInt(i64::try_from(capacity).unwrap_or(i64::MAX)),
            );
        }
    }
    if !table.contains_key("x-dead-letter-exchange") {
        table.remove("x-dead-letter-routing-key");
    }
}

fn clamp_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(name: &str, pattern: &str, priority: i32, definition: &str) -> Policy {
        match Policy::new(name, false, pattern, "all", priority, definition) {
            Ok(policy) => policy,
            Err(error) => panic!("policy refused: {error}"),
        }
    }

    fn number(table: &FieldTable, name: &str) -> Option<i128> {
        table
            .inner()
            .get(name)
            .and_then(crate::argument_values::as_integer)
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused() {
        let refused = |operator: bool, apply_to: &str, definition: &str| {
            Policy::new("p", operator, ".*", apply_to, 0, definition)
                .err()
                .map(|e| e.0)
                .unwrap_or_default()
        };
        assert_eq!(
            refused(false, "all", r#"{"max-priority": 10}"#),
            "'max-priority' are not recognised policy settings"
        );
        assert!(refused(false, "all", r#"{"max-length": -1}"#).contains("non-negative"));
        assert!(refused(false, "all", r#"{"expires": 0}"#).contains("at least 1"));
        assert!(refused(false, "all", r#"{"overflow": "drop-tail"}"#).contains("drop-head"));
        assert!(refused(false, "all", r#"[1]"#).contains("JSON object"));
        assert!(refused(false, "all", "{}").contains("no key"));
        assert!(refused(false, "sideways", r#"{"max-length": 1}"#).contains("apply-to"));
        assert_eq!(
            refused(true, "queues", r#"{"dead-letter-exchange": "x"}"#),
            "'dead-letter-exchange' are not recognised operator policy settings"
        );
        assert!(refused(true, "all", r#"{"max-length": 1}"#).contains("queues only"));
        assert!(Policy::new("p", false, "(", "all", 0, r#"{"max-length": 1}"#).is_err());
    }

    #[test]
    fn the_highest_priority_then_the_first_name_applies() {
        let mut set = PolicySet::default();
        set.insert(policy("b", "^orders", 5, r#"{"max-length": 1}"#));
        set.insert(policy("a", "^orders", 5, r#"{"max-length": 2}"#));
        set.insert(policy("c", "^orders", 1, r#"{"max-length": 3}"#));
        set.insert(policy("z", "^other", 9, r#"{"max-length": 4}"#));
        assert_eq!(
            set.for_queue("orders.eu").map(|p| p.name.as_str()),
            Some("a")
        );
        assert!(set.for_queue("none").is_none());
        let mut only_exchanges = PolicySet::default();
        only_exchanges.insert(
            Policy::new(
                "x",
                false,
                "",
                "exchanges",
                0,
                r#"{"alternate-exchange": "ae"}"#,
            )
            .unwrap_or_else(|e| panic!("{e}")),
        );
        assert!(only_exchanges.for_queue("q").is_none());
        assert_eq!(
            only_exchanges
                .for_exchange("anything")
                .and_then(Policy::alternate_exchange),
            Some("ae")
        );
    }

    #[test]
    fn numbers_take_the_lowest_and_arguments_win_otherwise() {
        let mut declared = FieldTable::default();
        declared.insert("x-max-length".into(), AMQPValue::LongInt(10));
        declared.insert("x-message-ttl".into(), AMQPValue::LongInt(100));
        declared.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("mine".into()),
        );
        let user = policy(
            "p",
            "",
            0,
            r#"{"max-length": 5, "message-ttl": 500, "dead-letter-exchange": "theirs",
                "dead-letter-routing-key": "k", "overflow": "reject-publish"}"#,
        );
        let operator = Policy::new("o", true, "", "queues", 0, r#"{"message-ttl": 50}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        let table =
            effective_queue_arguments(&declared, Some(&user), Some(&operator)).unwrap_or_default();
        assert_eq!(number(&table, "x-max-length"), Some(5));
        assert_eq!(number(&table, "x-message-ttl"), Some(50));
        assert_eq!(
            table.inner().get("x-dead-letter-exchange"),
            Some(&AMQPValue::LongString("mine".into()))
        );
        assert_eq!(
            table.inner().get("x-dead-letter-routing-key"),
            Some(&AMQPValue::LongString("k".into()))
        );
        assert_eq!(
            table.inner().get("x-overflow"),
            Some(&AMQPValue::LongString("reject-publish".into()))
        );
    }

    #[test]
    fn capacities_are_reconciled() {
        let mut declared = FieldTable::default();
        declared.insert("qpid.max_size".into(), AMQPValue::LongInt(1000));
        let user = policy("p", "", 0, r#"{"qpid-flow-resume-capacity": 5000}"#);
        let table = effective_queue_arguments(&declared, Some(&user), None).unwrap_or_default();
        assert_eq!(number(&table, "x-qpid-flow-resume-capacity"), Some(1000));
        let routing_key_alone = policy("p", "", 0, r#"{"dead-letter-routing-key": "k"}"#);
        let table =
            effective_queue_arguments(&FieldTable::default(), Some(&routing_key_alone), None)
                .unwrap_or_default();
        assert!(table.inner().get("x-dead-letter-routing-key").is_none());
        let exchange_only = policy("p", "", 0, r#"{"alternate-exchange": "ae"}"#);
        assert!(effective_queue_arguments(&declared, Some(&exchange_only), None).is_none());
    }
}
