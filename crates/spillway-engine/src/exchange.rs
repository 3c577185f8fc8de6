//! An exchange: its kind, its flags and arguments, and its bindings
//! (indexed in `bindings.rs`).

use amq_protocol_types::{AMQPValue, FieldTable};

use crate::bindings::Bindings;
use crate::model::ExchangeKind;

/// The exchange argument naming the alternate exchange, as RabbitMQ spells it.
pub const ALTERNATE_EXCHANGE: &str = "alternate-exchange";

pub struct Exchange {
    pub name: String,
    pub kind: ExchangeKind,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
    pub bindings: Bindings,
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
        }
    }

    /// Where messages that match none of this exchange's bindings go: the
    /// `alternate-exchange` argument (a string, checked at declare).
    pub fn alternate_exchange(&self) -> Option<&str> {
        match self.arguments.inner().get(ALTERNATE_EXCHANGE)? {
            AMQPValue::LongString(name) => std::str::from_utf8(name.as_bytes()).ok(),
            AMQPValue::ShortString(name) => Some(name.as_str()),
            _ => None,
        }
    }

    /// Built-in exchanges (the default one and `amq.*`) cannot be declared,
    /// deleted or (the default one) bound by clients.
    pub fn is_builtin(&self) -> bool {
        self.name.is_empty() || self.name.starts_with("amq.")
    }
}
