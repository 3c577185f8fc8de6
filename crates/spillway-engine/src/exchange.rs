//! An exchange: its kind, its flags and arguments, and its bindings
//! (indexed in `bindings.rs`).

use amq_protocol_types::{AMQPValue, FieldTable};

use crate::argument_values::ALTERNATE_EXCHANGE;
use crate::bindings::Bindings;
use crate::model::ExchangeKind;
use crate::policy::Policy;

/// The exchange type of RabbitMQ's delayed-message exchange, and the
/// argument naming the type it routes as once a message is due.
pub const DELAYED_MESSAGE: &str = "x-delayed-message";
pub const DELAYED_TYPE: &str = "x-delayed-type";

pub struct Exchange {
    pub name: String,
    pub kind: ExchangeKind,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
    pub bindings: Bindings,
    /// An `x-delayed-message` exchange: a message with an `x-delay` header
    /// waits in the store until due, then routes as `kind` (its
    /// `x-delayed-type`).
    pub delayed: bool,
    /// The policy that applies to it, and the alternate exchange that
    /// policy names (`policy.rs`).
    pub policy: Option<String>,
    policy_alternate: Option<String>,
}

impl Exchange {
    pub fn new(name: &str, kind: ExchangeKind, durable: bool) -> Self {
        Self {
            name: name.to_string(),
            kind,
            durable,
            auto_delete: false,
            internal: false,
            arguments: FieldTable::default(),
            bindings: Bindings::new(kind),
            delayed: false,
            policy: None,
            policy_alternate: None,
        }
    }

    /// Its type as declared: `x-delayed-message` for a delayed exchange.
    pub fn kind_name(&self) -> &'static str {
        if self.delayed {
            DELAYED_MESSAGE
        } else {
            self.kind.as_str()
        }
    }

    /// Puts it under a policy (None: no policy applies).
    pub fn set_policy(&mut self, policy: Option<&Policy>) {
        self.policy = policy.map(|p| p.name.clone());
        self.policy_alternate = policy
            .and_then(Policy::alternate_exchange)
            .map(str::to_string);
    }

    /// Where messages that match none of this exchange's bindings go: the
    /// `alternate-exchange` argument (a string, checked at declare), else
    /// the one its policy names (RabbitMQ: the argument wins).
    pub fn alternate_exchange(&self) -> Option<&str> {
        match self.arguments.inner().get(ALTERNATE_EXCHANGE) {
            Some(AMQPValue::LongString(name)) => std::str::from_utf8(name.as_bytes()).ok(),
            Some(AMQPValue::ShortString(name)) => Some(name.as_str()),
            _ => self.policy_alternate.as_deref(),
        }
    }

    /// Built-in exchanges (the default one and `amq.*`) cannot be declared,
    /// deleted or (the default one) bound by clients.
    pub fn is_builtin(&self) -> bool {
        self.name.is_empty() || self.name.starts_with("amq.")
    }
}
