//! The error that closes a whole connection, and what rule of the
//! gateway's own it enforces (for the metrics).

use spillway_amqp::MethodId;
use spillway_proto::engine::AmqpError;

/// An error that closes the whole connection: the AMQP error every
/// component uses ([`AmqpError`]: reply code, text, failed method, kind)
/// and, when it is one, the gateway's own rule that it enforces.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnectionError {
    pub error: AmqpError,
    /// What the gateway enforced with it, for its metrics (None: a protocol
    /// error, or the engine's own close).
    pub enforced: Option<Enforced>,
}

/// A rule of the gateway's own that closes a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Enforced {
    /// A limit, as `spillway_limit_refusals_total` labels it.
    Limit(&'static str),
    /// `gateway.max_unfinished_content`: too many partly received bodies.
    UnfinishedContent,
}

impl ConnectionError {
    pub fn new(code: u16, text: impl Into<String>) -> Self {
        AmqpError::new(code, text).into()
    }

    /// Names the method that failed.
    pub fn on(mut self, method: MethodId) -> Self {
        self.error = self.error.on(method);
        self
    }

    /// Names the gateway's rule it enforces.
    pub fn enforcing(mut self, enforced: Enforced) -> Self {
        self.enforced = Some(enforced);
        self
    }

    /// The reply code `connection.close` carries.
    pub fn code(&self) -> u16 {
        self.error.reply_code()
    }

    pub fn text(&self) -> &str {
        &self.error.text
    }

    /// The method that failed ([`MethodId::NONE`] when none did).
    pub fn method(&self) -> MethodId {
        self.error.method()
    }
}

impl From<AmqpError> for ConnectionError {
    fn from(error: AmqpError) -> Self {
        Self {
            error,
            enforced: None,
        }
    }
}
