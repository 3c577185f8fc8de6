//! The error that closes a whole connection, and what rule of the
//! gateway's own it enforces (for the metrics).

use spillway_amqp::MethodId;

/// An error that closes the whole connection.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnectionError {
    pub code: u16,
    pub text: String,
    /// The method that failed ([`MethodId::NONE`] when none did).
    pub method: MethodId,
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
        Self {
            code,
            text: text.into(),
            method: MethodId::NONE,
            enforced: None,
        }
    }

    /// Names the method that failed.
    pub fn on(mut self, method: MethodId) -> Self {
        self.method = method;
        self
    }

    /// Names the gateway's rule it enforces.
    pub fn enforcing(mut self, enforced: Enforced) -> Self {
        self.enforced = Some(enforced);
        self
    }
}
