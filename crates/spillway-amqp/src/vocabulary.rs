//! The AMQP 0-9-1 vocabulary every component shares: reply codes and
//! RabbitMQ's names for them, which codes close only a channel, class and
//! method ids, and field-table encoding. Nothing else in the workspace keeps
//! a second table of these.

use amq_protocol::types::FieldTable;
use bytes::Bytes;

use crate::nesting;

/// AMQP 0-9-1 reply codes, as RabbitMQ users know them.
pub mod reply_code {
    pub const REPLY_SUCCESS: u16 = 200;
    pub const CONTENT_TOO_LARGE: u16 = 311;
    pub const NO_ROUTE: u16 = 312;
    pub const NO_CONSUMERS: u16 = 313;
    pub const CONNECTION_FORCED: u16 = 320;
    pub const INVALID_PATH: u16 = 402;
    pub const ACCESS_REFUSED: u16 = 403;
    pub const NOT_FOUND: u16 = 404;
    pub const RESOURCE_LOCKED: u16 = 405;
    pub const PRECONDITION_FAILED: u16 = 406;
    pub const FRAME_ERROR: u16 = 501;
    pub const SYNTAX_ERROR: u16 = 502;
    pub const COMMAND_INVALID: u16 = 503;
    pub const CHANNEL_ERROR: u16 = 504;
    pub const UNEXPECTED_FRAME: u16 = 505;
    pub const RESOURCE_ERROR: u16 = 506;
    pub const NOT_ALLOWED: u16 = 530;
    pub const NOT_IMPLEMENTED: u16 = 540;
    pub const INTERNAL_ERROR: u16 = 541;
}

/// RabbitMQ's name for a reply code, which clients print in front of the text
/// (`NOT_FOUND - no queue 'q' in vhost '/'`).
pub fn reply_name(code: u16) -> &'static str {
    use reply_code::*;
    match code {
        REPLY_SUCCESS => "REPLY_SUCCESS",
        CONTENT_TOO_LARGE => "CONTENT_TOO_LARGE",
        NO_ROUTE => "NO_ROUTE",
        NO_CONSUMERS => "NO_CONSUMERS",
        CONNECTION_FORCED => "CONNECTION_FORCED",
        INVALID_PATH => "INVALID_PATH",
        ACCESS_REFUSED => "ACCESS_REFUSED",
        NOT_FOUND => "NOT_FOUND",
        RESOURCE_LOCKED => "RESOURCE_LOCKED",
        PRECONDITION_FAILED => "PRECONDITION_FAILED",
        FRAME_ERROR => "FRAME_ERROR",
        SYNTAX_ERROR => "SYNTAX_ERROR",
        COMMAND_INVALID => "COMMAND_INVALID",
        CHANNEL_ERROR => "CHANNEL_ERROR",
        UNEXPECTED_FRAME => "UNEXPECTED_FRAME",
        RESOURCE_ERROR => "RESOURCE_ERROR",
        NOT_ALLOWED => "NOT_ALLOWED",
        NOT_IMPLEMENTED => "NOT_IMPLEMENTED",
        INTERNAL_ERROR => "INTERNAL_ERROR",
        _ => "ERROR",
    }
}

/// The reply text a client sees: RabbitMQ's name, then the reason. A text
/// that already starts with the name is not prefixed twice.
pub fn reply_text(code: u16, text: &str) -> String {
    let name = reply_name(code);
    match text.strip_prefix(name) {
        Some(rest) if rest.starts_with(" - ") => text.to_string(),
        _ => format!("{name} - {text}"),
    }
}

/// The spec's soft errors close only the channel they happened on; every
/// other code closes the whole connection.
pub fn closes_only_the_channel(code: u16) -> bool {
    use reply_code::*;
    matches!(
        code,
        CONTENT_TOO_LARGE
            | NO_ROUTE
            | NO_CONSUMERS
            | ACCESS_REFUSED
            | NOT_FOUND
            | RESOURCE_LOCKED
            | PRECONDITION_FAILED
    )
}

/// A method's (class id, method id), as `connection.close` and
/// `channel.close` report the method that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MethodId {
    pub class_id: u16,
    pub method_id: u16,
}

impl MethodId {
    /// No method: the failure was not caused by one.
    pub const NONE: Self = Self::new(0, 0);
    pub const CONNECTION_START: Self = Self::new(10, 10);
    pub const CONNECTION_START_OK: Self = Self::new(10, 11);
    pub const CONNECTION_SECURE_OK: Self = Self::new(10, 21);
    pub const CONNECTION_TUNE_OK: Self = Self::new(10, 31);
    pub const CONNECTION_OPEN: Self = Self::new(10, 40);
    pub const CONNECTION_CLOSE: Self = Self::new(10, 50);
    pub const CONNECTION_UPDATE_SECRET: Self = Self::new(10, 70);
    pub const CHANNEL_OPEN: Self = Self::new(20, 10);
    pub const CHANNEL_FLOW: Self = Self::new(20, 20);
    pub const CHANNEL_CLOSE: Self = Self::new(20, 40);
    pub const EXCHANGE_DECLARE: Self = Self::new(40, 10);
    pub const EXCHANGE_DELETE: Self = Self::new(40, 20);
    pub const EXCHANGE_BIND: Self = Self::new(40, 30);
    pub const EXCHANGE_UNBIND: Self = Self::new(40, 40);
    pub const QUEUE_DECLARE: Self = Self::new(50, 10);
    pub const QUEUE_BIND: Self = Self::new(50, 20);
    pub const QUEUE_PURGE: Self = Self::new(50, 30);
    pub const QUEUE_DELETE: Self = Self::new(50, 40);
    pub const QUEUE_UNBIND: Self = Self::new(50, 50);
    pub const BASIC_QOS: Self = Self::new(60, 10);
    pub const BASIC_CONSUME: Self = Self::new(60, 20);
    pub const BASIC_CANCEL: Self = Self::new(60, 30);
    pub const BASIC_PUBLISH: Self = Self::new(60, 40);
    pub const BASIC_GET: Self = Self::new(60, 70);
    pub const BASIC_ACK: Self = Self::new(60, 80);
    pub const BASIC_REJECT: Self = Self::new(60, 90);
    pub const BASIC_RECOVER_ASYNC: Self = Self::new(60, 100);
    pub const BASIC_RECOVER: Self = Self::new(60, 110);
    pub const BASIC_NACK: Self = Self::new(60, 120);
    pub const CONFIRM_SELECT: Self = Self::new(85, 10);
    pub const TX_SELECT: Self = Self::new(90, 10);
    pub const TX_COMMIT: Self = Self::new(90, 20);
    pub const TX_ROLLBACK: Self = Self::new(90, 30);

    pub const fn new(class_id: u16, method_id: u16) -> Self {
        Self {
            class_id,
            method_id,
        }
    }

    /// The ids at the start of a method frame's payload, if it has four bytes.
    pub fn from_payload(payload: &[u8]) -> Option<Self> {
        match payload {
            [c0, c1, m0, m1, ..] => Some(Self::new(
                u16::from_be_bytes([*c0, *c1]),
                u16::from_be_bytes([*m0, *m1]),
            )),
            _ => None,
        }
    }

    /// Whether the class is one of AMQP 0-9-1's (connection, channel,
    /// access, exchange, queue, basic, confirm, tx).
    pub fn is_known_class(self) -> bool {
        matches!(self.class_id, 10 | 20 | 30 | 40 | 50 | 60 | 85 | 90)
    }
}

/// Encodes a field table as it travels between components (empty table =
/// empty bytes).
pub fn encode_table(table: &FieldTable) -> Bytes {
    if table.inner().is_empty() {
        return Bytes::new();
    }
    let context = amq_protocol::frame::WriteContext::from(Vec::new());
    match amq_protocol::types::generation::gen_field_table(table)(context) {
        Ok(context) => context.write.into(),
        Err(error) => {
            // Writing into a Vec cannot run out of room; a failure here is a
            // bug in the encoder, not something a client can cause.
            debug_assert!(false, "could not encode a field table: {error}");
            tracing::error!(%error, "could not encode a field table");
            Bytes::new()
        }
    }
}

/// Why bytes are not a field table. Either way the reply is 502
/// SYNTAX_ERROR ([`TableError::REPLY_CODE`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    /// Nested past [`nesting::MAX_NESTING`]: refused before parsing.
    #[error(transparent)]
    TooDeep(#[from] nesting::NestingError),
    #[error("malformed field table")]
    Malformed,
}

impl TableError {
    pub const REPLY_CODE: u16 = reply_code::SYNTAX_ERROR;
}

/// Decodes a field table encoded by [`encode_table`] or sent by a client
/// (empty bytes = empty table).
pub fn decode_table(bytes: &[u8]) -> Result<FieldTable, TableError> {
    if bytes.is_empty() {
        return Ok(FieldTable::default());
    }
    // The parser recurses: bytes from the wire are bounded before it runs.
    match nesting::check_table(bytes, nesting::MAX_NESTING) {
        Err(error @ nesting::NestingError::TooDeep { .. }) => return Err(error.into()),
        Err(_) => return Err(TableError::Malformed),
        Ok(_) => {}
    }
    match amq_protocol::types::parsing::parse_field_table(bytes) {
        Ok(([], table)) => Ok(table),
        _ => Err(TableError::Malformed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::{AMQPValue, ShortString};

    #[test]
    fn reply_texts_carry_the_name_once() {
        assert_eq!(
            reply_text(reply_code::NOT_FOUND, "no queue 'q' in vhost '/'"),
            "NOT_FOUND - no queue 'q' in vhost '/'"
        );
        assert_eq!(
            reply_text(
                reply_code::ACCESS_REFUSED,
                "ACCESS_REFUSED - Login was refused"
            ),
            "ACCESS_REFUSED - Login was refused"
        );
    }

    #[test]
    fn soft_errors_close_the_channel_hard_ones_the_connection() {
        for code in [311, 312, 313, 403, 404, 405, 406] {
            assert!(closes_only_the_channel(code), "{code}");
        }
        for code in [320, 402, 501, 502, 503, 504, 505, 506, 530, 540, 541] {
            assert!(!closes_only_the_channel(code), "{code}");
        }
    }

    #[test]
    fn tables_round_trip() {
        let mut table = FieldTable::default();
        table.insert(ShortString::from("x-max-length"), AMQPValue::LongInt(5));
        let bytes = encode_table(&table);
        assert_eq!(decode_table(&bytes).ok(), Some(table));
        assert_eq!(decode_table(&[]).ok(), Some(FieldTable::default()));
        assert_eq!(
            decode_table(&[0, 0, 0, 9, 1]).err(),
            Some(TableError::Malformed)
        );
    }

    #[test]
    fn method_ids_come_from_the_payload() {
        assert_eq!(
            MethodId::from_payload(&[0, 60, 0, 40, 9]),
            Some(MethodId::BASIC_PUBLISH)
        );
        assert_eq!(MethodId::from_payload(&[0, 60]), None);
        assert!(!MethodId::new(99, 1).is_known_class());
    }
}
