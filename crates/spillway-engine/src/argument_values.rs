//! Arguments as the engine reads them wherever they appear (declarations,
//! policies, headers): an integer of any AMQP width, and the argument names
//! more than one part of the engine knows. A leaf: it imports nothing of
//! the engine.

use amq_protocol_types::AMQPValue;

/// The exchange argument (and policy key) naming the alternate exchange,
/// as RabbitMQ spells it.
pub const ALTERNATE_EXCHANGE: &str = "alternate-exchange";

/// An integer argument of whatever width the client chose (RabbitMQ
/// accepts any), or `None` for a value of another type.
pub fn as_integer(value: &AMQPValue) -> Option<i128> {
    Some(match value {
        AMQPValue::ShortShortInt(v) => i128::from(*v),
        AMQPValue::ShortShortUInt(v) => i128::from(*v),
        AMQPValue::ShortInt(v) => i128::from(*v),
        AMQPValue::ShortUInt(v) => i128::from(*v),
        AMQPValue::LongInt(v) => i128::from(*v),
        AMQPValue::LongUInt(v) => i128::from(*v),
        AMQPValue::LongLongInt(v) => i128::from(*v),
        AMQPValue::Timestamp(v) => i128::from(*v),
        _ => return None,
    })
}
