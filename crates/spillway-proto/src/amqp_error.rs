//! How an [`AmqpError`] (the engine's error, as it crosses gRPC) is built
//! and classified, in the AMQP vocabulary of `spillway_amqp`.

use spillway_amqp::{reply_code, MethodId, TableError};

use crate::engine::{AmqpError, ErrorKind};

impl AmqpError {
    /// An error whose kind follows from its code (see [`AmqpError::effective_kind`]).
    pub fn new(code: u16, text: impl Into<String>) -> Self {
        Self {
            code: u32::from(code),
            text: text.into(),
            class_id: 0,
            method_id: 0,
            kind: ErrorKind::Unspecified as i32,
        }
    }

    /// A 406 for an argument the caller got wrong (management answers it
    /// with INVALID_ARGUMENT, not FAILED_PRECONDITION).
    pub fn invalid_argument(code: u16, text: impl Into<String>) -> Self {
        Self::new(code, text).with_kind(ErrorKind::InvalidArgument)
    }

    pub fn with_kind(mut self, kind: ErrorKind) -> Self {
        self.set_kind(kind);
        self
    }

    /// Names the method that failed.
    pub fn on(mut self, method: MethodId) -> Self {
        self.class_id = u32::from(method.class_id);
        self.method_id = u32::from(method.method_id);
        self
    }

    /// The method that failed ([`MethodId::NONE`] when none is named).
    pub fn method(&self) -> MethodId {
        MethodId {
            class_id: u16::try_from(self.class_id).unwrap_or(0),
            method_id: u16::try_from(self.method_id).unwrap_or(0),
        }
    }

    /// The reply code as AMQP carries it (a code that does not fit is an
    /// internal error).
    pub fn reply_code(&self) -> u16 {
        u16::try_from(self.code).unwrap_or(reply_code::INTERNAL_ERROR)
    }

    /// What failed: the kind set when the error was made, else the one its
    /// reply code implies.
    pub fn effective_kind(&self) -> ErrorKind {
        use reply_code::*;
        match self.kind() {
            ErrorKind::Unspecified => match self.reply_code() {
                NOT_FOUND | NOT_ALLOWED => ErrorKind::NotFound,
                ACCESS_REFUSED => ErrorKind::AccessRefused,
                RESOURCE_LOCKED | PRECONDITION_FAILED => ErrorKind::FailedPrecondition,
                SYNTAX_ERROR | COMMAND_INVALID => ErrorKind::InvalidArgument,
                _ => ErrorKind::Internal,
            },
            kind => kind,
        }
    }
}

/// A field table that cannot be read: 502 SYNTAX_ERROR, saying why.
impl From<TableError> for AmqpError {
    fn from(error: TableError) -> Self {
        AmqpError::new(TableError::REPLY_CODE, error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_the_code_unless_set() {
        assert_eq!(
            AmqpError::new(404, "x").effective_kind(),
            ErrorKind::NotFound
        );
        assert_eq!(
            AmqpError::new(406, "x").effective_kind(),
            ErrorKind::FailedPrecondition
        );
        assert_eq!(
            AmqpError::invalid_argument(406, "x").effective_kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            AmqpError::new(541, "x").effective_kind(),
            ErrorKind::Internal
        );
    }

    #[test]
    fn an_unreadable_table_is_a_syntax_error() {
        let error: AmqpError = TableError::Malformed.into();
        assert_eq!(error.reply_code(), reply_code::SYNTAX_ERROR);
    }
}
