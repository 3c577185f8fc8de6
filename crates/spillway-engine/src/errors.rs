//! AMQP reply codes and the engine's error constructors. The engine answers a
//! failed command with an [`AmqpError`]; the gateway closes the channel (the
//! spec's soft errors: 311–313, 403–406) or else the connection with it.

use amq_protocol_types::FieldTable;
use spillway_proto::engine::AmqpError;

/// AMQP 0-9-1 reply codes, as RabbitMQ users know them.
pub mod codes {
    pub const NO_ROUTE: u16 = 312;
    pub const ACCESS_REFUSED: u16 = 403;
    pub const NOT_FOUND: u16 = 404;
    pub const RESOURCE_LOCKED: u16 = 405;
    pub const PRECONDITION_FAILED: u16 = 406;
    pub const SYNTAX_ERROR: u16 = 502;
    pub const COMMAND_INVALID: u16 = 503;
    pub const CHANNEL_ERROR: u16 = 504;
    pub const NOT_ALLOWED: u16 = 530;
    pub const NOT_IMPLEMENTED: u16 = 540;
}

pub fn error(code: u16, text: impl Into<String>) -> AmqpError {
    AmqpError::new(code, text)
}

pub fn inequivalent(
    arg: &str,
    kind: &str,
    name: &str,
    vhost: &str,
    received: bool,
    current: bool,
) -> AmqpError {
    error(
        codes::PRECONDITION_FAILED,
        format!(
            "inequivalent arg '{arg}' for {kind} '{name}' in vhost '{vhost}': received '{received}' but current is '{current}'"
        ),
    )
}

/// Decodes an AMQP field table sent by the gateway (empty bytes = empty table).
pub fn decode_table(bytes: &[u8]) -> Result<FieldTable, AmqpError> {
    if bytes.is_empty() {
        return Ok(FieldTable::default());
    }
    match amq_protocol_types::parsing::parse_field_table(bytes) {
        Ok(([], table)) => Ok(table),
        _ => Err(error(codes::SYNTAX_ERROR, "malformed field table")),
    }
}
