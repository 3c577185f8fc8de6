//! Declare arguments: the `x-*` (and Qpid) arguments that set a queue's
//! limits, an exchange's `alternate-exchange`, how they are checked, and
//! when a redeclare's arguments agree with the queue's or exchange's.

use amq_protocol_types::{AMQPValue, FieldTable};
use spillway_amqp::reply_code;
use spillway_proto::engine::AmqpError;

use super::OpResult;
use crate::argument_values::{as_integer, ALTERNATE_EXCHANGE};
use crate::exchange::DELAYED_TYPE;

/// The queue argument that makes a priority queue, and its highest priority.
pub const MAX_PRIORITY: &str = "x-max-priority";
/// The queue argument that makes one consumer at a time receive.
pub const SINGLE_ACTIVE_CONSUMER: &str = "x-single-active-consumer";
/// The consume argument that ranks a consumer among a queue's others.
pub const CONSUMER_PRIORITY: &str = "x-priority";
use crate::model::{DeadLetterTarget, ExchangeKind, Overflow, QueueLimits};
use crate::routing::values_equal;

/// A queue argument refused as RabbitMQ refuses it (406): `invalid arg
/// '{arg}' for queue '{queue}' in vhost '{vhost}': {why}`.
fn invalid_queue_arg(arg: &str, queue: &str, vhost: &str, why: &str) -> AmqpError {
    AmqpError::invalid_argument(
        reply_code::PRECONDITION_FAILED,
        format!("invalid arg '{arg}' for queue '{queue}' in vhost '{vhost}': {why}"),
    )
}

/// Reads and checks `x-max-length`, `x-max-length-bytes`, `x-overflow`,
/// Qpid's flow-control limits and the delivery limits.
pub(super) fn queue_limits(
    arguments: &FieldTable,
    queue: &str,
    vhost: &str,
) -> OpResult<QueueLimits> {
    let invalid = |arg: &str| {
        AmqpError::invalid_argument(
            reply_code::PRECONDITION_FAILED,
            format!("invalid arg '{arg}' for queue '{queue}' in vhost '{vhost}'"),
        )
    };
    let count = |arg: &str| -> OpResult<Option<u64>> {
        match arguments.inner().get(arg) {
            None => Ok(None),
            Some(value) => match as_integer(value).map(u64::try_from) {
                Some(Ok(n)) => Ok(Some(n)),
                _ => Err(invalid(arg)),
            },
        }
    };
    let overflow = match arguments.inner().get("x-overflow") {
        None => Overflow::DropHead,
        Some(AMQPValue::LongString(s)) => match s.as_bytes() {
            b"drop-head" => Overflow::DropHead,
            b"reject-publish" => Overflow::RejectPublish,
            b"reject-publish-dlx" => Overflow::RejectPublishDlx,
            _ => return Err(invalid("x-overflow")),
        },
        Some(_) => return Err(invalid("x-overflow")),
    };
    // Qpid's producer flow control; 0 means no limit.
    let capacity = match count("x-qpid-capacity")? {
        Some(bytes) => Some(bytes),
        None => count("qpid.max_size")?,
    }
    .filter(|bytes| *bytes > 0);
    let resume_capacity = count("x-qpid-flow-resume-capacity")?;
    if let (Some(resume), Some(capacity)) = (resume_capacity, capacity) {
        if resume > capacity {
            return Err(AmqpError::new(
                reply_code::PRECONDITION_FAILED,
                format!(
                    "x-qpid-flow-resume-capacity ({resume}) exceeds x-qpid-capacity ({capacity}) \
                     for queue '{queue}' in vhost '{vhost}'"
                ),
            ));
        }
    }
    // Qpid counts deliveries (0 = no limit); RabbitMQ counts redeliveries
    // (`x-delivery-limit: 0` allows one delivery). Both given: the stricter.
    let qpid_deliveries = count("x-qpid-maximum-delivery-count")?.filter(|n| *n > 0);
    let rabbit_deliveries = count("x-delivery-limit")?.map(|n| n.saturating_add(1));
    let max_deliveries = match (qpid_deliveries, rabbit_deliveries) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    // A quorum queue has RabbitMQ 4's delivery limit unless one is set.
    let max_deliveries = match queue_type(arguments) {
        Some(QUORUM) => max_deliveries.or(Some(QUORUM_DELIVERY_LIMIT + 1)),
        _ => max_deliveries,
    };
    Ok(QueueLimits {
        max_deliveries,
        message_ttl: ttl_argument(arguments, "x-message-ttl", queue, vhost)?,
        expires: ttl_argument(arguments, "x-expires", queue, vhost)?,
        max_length: count("x-max-length")?,
        max_bytes: count("x-max-length-bytes")?,
        overflow,
        capacity,
        resume_capacity: capacity.map(|capacity| resume_capacity.unwrap_or(capacity)),
        max_count: count("qpid.max_count")?.filter(|count| *count > 0),
    })
}

const QUORUM: &[u8] = b"quorum";
/// RabbitMQ 4's default `x-delivery-limit` of a quorum queue.
pub(crate) const QUORUM_DELIVERY_LIMIT: u64 = 20;

fn queue_type(arguments: &FieldTable) -> Option<&[u8]> {
    match arguments.inner().get("x-queue-type") {
        Some(AMQPValue::LongString(kind)) => Some(kind.as_bytes()),
        _ => None,
    }
}

/// `x-queue-type` as RabbitMQ users write it: `classic` and `quorum` are
/// served (a quorum queue must be durable, not exclusive and not
/// auto-delete, as in RabbitMQ; every durable queue is replicated when the
/// store is a storage group); `stream` is refused until streams exist.
pub(super) fn check_queue_type(
    arguments: &FieldTable,
    durable: bool,
    exclusive: bool,
    auto_delete: bool,
    queue: &str,
    vhost: &str,
) -> OpResult<()> {
    let Some(value) = arguments.inner().get("x-queue-type") else {
        return Ok(());
    };
    let refuse = |why: &str| invalid_queue_arg("x-queue-type", queue, vhost, why);
    let AMQPValue::LongString(kind) = value else {
        return Err(refuse(&format!(
            "\"expected longstr, got {}\"",
            rabbit_type_name(value)
        )));
    };
    match kind.as_bytes() {
        b"classic" => Ok(()),
        QUORUM => {
            let property = if !durable {
                Some("non-durable")
            } else if exclusive {
                Some("exclusive-owner")
            } else if auto_delete {
                Some("auto-delete")
            } else {
                None
            };
            match property {
                Some(property) => Err(AmqpError::new(
                    reply_code::PRECONDITION_FAILED,
                    format!("invalid property '{property}' for queue '{queue}' in vhost '{vhost}'"),
                )),
                None => Ok(()),
            }
        }
        b"stream" => Err(refuse(
            "stream queues are not supported yet; declare a classic or quorum queue",
        )),
        other => Err(refuse(&format!(
            "unknown queue type '{}' (classic or quorum)",
            String::from_utf8_lossy(other)
        ))),
    }
}

/// RabbitMQ's largest TTL (`rabbit_misc:check_expiry`): 2^32 - 1 ms.
pub(crate) const MAX_EXPIRY: u64 = spillway_amqp::properties::MAX_EXPIRY_MS;

/// `x-message-ttl` (a non-negative integer) or `x-expires` (a positive
/// one), milliseconds, refused in RabbitMQ's (3.10) words: `invalid arg
/// 'x-expires' for queue 'q' in vhost '/': {value_zero,0}`, `… "expected
/// integer, got longstr"`.
fn ttl_argument(
    arguments: &FieldTable,
    arg: &str,
    queue: &str,
    vhost: &str,
) -> OpResult<Option<u64>> {
    let Some(value) = arguments.inner().get(arg) else {
        return Ok(None);
    };
    let refuse = |why: String| invalid_queue_arg(arg, queue, vhost, &why);
    let n = match value {
        AMQPValue::Timestamp(_) => None,
        other => as_integer(other),
    };
    let Some(n) = n else {
        return Err(refuse(format!(
            "\"expected integer, got {}\"",
            rabbit_type_name(value)
        )));
    };
    if n < 0 {
        return Err(refuse(format!("{{value_negative,{n}}}")));
    }
    if n == 0 && arg == "x-expires" {
        return Err(refuse("{value_zero,0}".to_string()));
    }
    match u64::try_from(n) {
        Ok(ms) if ms <= MAX_EXPIRY => Ok(Some(ms)),
        _ => Err(refuse(format!("{{value_too_large,{n}}}"))),
    }
}

/// `x-max-priority`: an integer from 0 to 255, as in RabbitMQ (406
/// otherwise, in its words); 0 or absent is a queue without priorities.
pub(super) fn max_priority(
    arguments: &FieldTable,
    queue: &str,
    vhost: &str,
) -> Result<u8, AmqpError> {
    let Some(value) = arguments.inner().get(MAX_PRIORITY) else {
        return Ok(0);
    };
    let refuse = |why: String| invalid_queue_arg(MAX_PRIORITY, queue, vhost, &why);
    let Some(n) = as_integer(value) else {
        return Err(refuse(format!(
            "\"expected integer, got {}\"",
            rabbit_type_name(value)
        )));
    };
    if n < 0 {
        return Err(refuse(format!("{{value_negative,{n}}}")));
    }
    u8::try_from(n).map_err(|_| refuse(format!("{{max_value_exceeded,{n}}}")))
}

/// A recovered queue's `x-max-priority`, checked when it was declared.
pub fn recovered_max_priority(arguments: &FieldTable) -> u8 {
    max_priority(arguments, "", "").unwrap_or_default()
}

/// `x-single-active-consumer`: a boolean, as in RabbitMQ (406 otherwise).
pub(super) fn single_active_consumer(
    arguments: &FieldTable,
    queue: &str,
    vhost: &str,
) -> Result<bool, AmqpError> {
    match arguments.inner().get(SINGLE_ACTIVE_CONSUMER) {
        None => Ok(false),
        Some(AMQPValue::Boolean(on)) => Ok(*on),
        Some(other) => Err(invalid_queue_arg(
            SINGLE_ACTIVE_CONSUMER,
            queue,
            vhost,
            &format!("{{unacceptable_type,{}}}", rabbit_type_name(other)),
        )),
    }
}

/// A recovered queue's `x-single-active-consumer`, checked when it was
/// declared.
pub fn recovered_single_active_consumer(arguments: &FieldTable) -> bool {
    single_active_consumer(arguments, "", "").unwrap_or_default()
}

/// A consume's `x-priority`: an integer (406 otherwise), 0 without it.
/// RabbitMQ takes any integer type; values beyond `i32` are clamped.
pub(super) fn consumer_priority(arguments: &FieldTable) -> Result<i32, AmqpError> {
    let Some(value) = arguments.inner().get(CONSUMER_PRIORITY) else {
        return Ok(0);
    };
    match as_integer(value) {
        Some(n) => Ok(n.clamp(i128::from(i32::MIN), i128::from(i32::MAX)) as i32),
        None => Err(AmqpError::invalid_argument(
            reply_code::PRECONDITION_FAILED,
            format!(
                "invalid arg '{CONSUMER_PRIORITY}': {{unacceptable_type,{}}}",
                rabbit_type_name(value)
            ),
        )),
    }
}

/// Checks an exchange declare's arguments as RabbitMQ does: an
/// `alternate-exchange` must be a string (406 otherwise).
pub(super) fn check_exchange_arguments(
    arguments: &FieldTable,
    exchange: &str,
    vhost: &str,
) -> Result<(), AmqpError> {
    match arguments.inner().get(ALTERNATE_EXCHANGE) {
        None | Some(AMQPValue::LongString(_)) | Some(AMQPValue::ShortString(_)) => Ok(()),
        Some(other) => Err(AmqpError::invalid_argument(
            reply_code::PRECONDITION_FAILED,
            format!(
                "invalid type '{}' for arg '{ALTERNATE_EXCHANGE}' in exchange '{exchange}' in vhost '{vhost}'",
                rabbit_type_name(other)
            ),
        )),
    }
}

/// The exchange arguments a redeclare must repeat: RabbitMQ compares only
/// `alternate-exchange` (and a delayed exchange's `x-delayed-type` here).
/// Returns the one that differs.
pub(super) fn inequivalent_exchange_argument(
    current: &FieldTable,
    received: &FieldTable,
) -> Option<&'static str> {
    [ALTERNATE_EXCHANGE, DELAYED_TYPE]
        .into_iter()
        .find(|key| !equivalent_argument(current.inner().get(*key), received.inner().get(*key)))
}

/// A delayed exchange's `x-delayed-type`: the type it routes as once a
/// message is due (406 otherwise, in the plugin's words).
pub(crate) fn delayed_type(arguments: &FieldTable) -> Result<ExchangeKind, AmqpError> {
    let name = match arguments.inner().get(DELAYED_TYPE) {
        Some(AMQPValue::LongString(name)) => std::str::from_utf8(name.as_bytes()).ok(),
        Some(AMQPValue::ShortString(name)) => Some(name.as_str()),
        _ => None,
    };
    name.and_then(ExchangeKind::parse).ok_or_else(|| {
        AmqpError::invalid_argument(
            reply_code::PRECONDITION_FAILED,
            "Invalid argument, 'x-delayed-type' must be an existing exchange type",
        )
    })
}

/// RabbitMQ's name of a field's type, as its refusals print it.
fn rabbit_type_name(value: &AMQPValue) -> &'static str {
    match value {
        AMQPValue::Boolean(_) => "bool",
        AMQPValue::ShortShortInt(_) => "byte",
        AMQPValue::ShortShortUInt(_) => "unsignedbyte",
        AMQPValue::ShortInt(_) => "short",
        AMQPValue::ShortUInt(_) => "unsignedshort",
        AMQPValue::LongInt(_) => "signedint",
        AMQPValue::LongUInt(_) => "unsignedint",
        AMQPValue::LongLongInt(_) => "long",
        AMQPValue::Float(_) => "float",
        AMQPValue::Double(_) => "double",
        AMQPValue::DecimalValue(_) => "decimal",
        AMQPValue::ShortString(_) => "shortstr",
        AMQPValue::LongString(_) => "longstr",
        AMQPValue::FieldArray(_) => "array",
        AMQPValue::Timestamp(_) => "timestamp",
        AMQPValue::FieldTable(_) => "table",
        AMQPValue::ByteArray(_) => "binary",
        AMQPValue::Void => "void",
    }
}

/// The stored arguments of a recovered queue were checked when it was declared.
pub fn recovered_limits(arguments: &FieldTable) -> QueueLimits {
    queue_limits(arguments, "", "").unwrap_or_default()
}

/// Producer flow-control limits can be changed at runtime (management), so
/// a redeclare with the arguments the queue was created with still succeeds
/// and keeps the current limits, as Qpid does.
pub(crate) const RUNTIME_ARGUMENTS: [&str; 4] = [
    "x-qpid-capacity",
    "qpid.max_size",
    "x-qpid-flow-resume-capacity",
    "qpid.max_count",
];

pub(super) fn first_inequivalent_argument(
    current: &FieldTable,
    received: &FieldTable,
) -> Option<String> {
    let keys = current.inner().keys().chain(received.inner().keys());
    for key in keys {
        if RUNTIME_ARGUMENTS.contains(&key.as_str()) {
            continue;
        }
        let (a, b) = (current.inner().get(key), received.inner().get(key));
        // No `x-queue-type` is a classic queue, as in RabbitMQ.
        if key.as_str() == "x-queue-type" && queue_type_name(a) == queue_type_name(b) {
            continue;
        }
        if !equivalent_argument(a, b) {
            return Some(key.as_str().to_string());
        }
    }
    None
}

fn queue_type_name(value: Option<&AMQPValue>) -> Option<&[u8]> {
    match value {
        None => Some(b"classic"),
        Some(AMQPValue::LongString(kind)) => Some(kind.as_bytes()),
        Some(_) => None,
    }
}

fn equivalent_argument(a: Option<&AMQPValue>, b: Option<&AMQPValue>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => values_equal(a, b),
        (None, None) => true,
        _ => false,
    }
}

/// Reads and checks the dead-letter arguments: RabbitMQ's
/// `x-dead-letter-exchange` and `x-dead-letter-routing-key`, and Qpid's
/// `x-qpid-dlq-enabled` (dead letters go to `<queue>_DLE`). An explicit
/// `x-dead-letter-exchange` wins over `x-qpid-dlq-enabled`.
pub(super) fn dead_letter_target(
    arguments: &FieldTable,
    queue: &str,
    vhost: &str,
) -> OpResult<Option<DeadLetterTarget>> {
    let invalid = |arg: &str, why: &str| invalid_queue_arg(arg, queue, vhost, why);
    let text = |arg: &str| -> OpResult<Option<String>> {
        match arguments.inner().get(arg) {
            None => Ok(None),
            Some(AMQPValue::LongString(s)) => {
                Ok(Some(String::from_utf8_lossy(s.as_bytes()).into_owned()))
            }
            Some(AMQPValue::ShortString(s)) => Ok(Some(s.as_str().to_string())),
            Some(_) => Err(invalid(arg, "unacceptable type")),
        }
    };
    let exchange = text("x-dead-letter-exchange")?;
    let routing_key = text("x-dead-letter-routing-key")?;
    let qpid_dlq =
        dlq_enabled(arguments).ok_or_else(|| invalid("x-qpid-dlq-enabled", "not a boolean"))?;
    match (exchange, routing_key) {
        (Some(exchange), routing_key) => Ok(Some(DeadLetterTarget {
            exchange,
            routing_key,
        })),
        (None, Some(_)) => Err(invalid(
            "x-dead-letter-routing-key",
            "Key x-dead-letter-routing-key should be specified together with x-dead-letter-exchange",
        )),
        (None, None) if qpid_dlq => Ok(Some(DeadLetterTarget {
            exchange: dead_letter_exchange_name(queue),
            routing_key: None,
        })),
        (None, None) => Ok(None),
    }
}

/// `x-qpid-dlq-enabled`: a boolean, or the strings `true`/`false` (Qpid's
/// clients send either). Absent: false; None: neither.
pub(crate) fn dlq_enabled(arguments: &FieldTable) -> Option<bool> {
    let text = match arguments.inner().get("x-qpid-dlq-enabled") {
        None => return Some(false),
        Some(AMQPValue::Boolean(b)) => return Some(*b),
        Some(AMQPValue::LongString(s)) => s.as_bytes(),
        Some(AMQPValue::ShortString(s)) => s.as_str().as_bytes(),
        Some(_) => return None,
    };
    match text {
        b"true" => Some(true),
        b"false" => Some(false),
        _ => None,
    }
}

/// Qpid's dead-letter exchange and queue of a queue, named in one place
/// for the declare and its permission checks.
pub(crate) use spillway_proto::permissions::{
    qpid_dead_letter_exchange as dead_letter_exchange_name,
    qpid_dead_letter_queue as dead_letter_queue_name,
};

/// The stored arguments of a recovered queue were checked when it was declared.
pub fn recovered_dead_letter(queue: &str, arguments: &FieldTable) -> Option<DeadLetterTarget> {
    dead_letter_target(arguments, queue, "").ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_arguments_are_checked() {
        let mut args = FieldTable::default();
        args.insert("x-message-ttl".into(), AMQPValue::LongInt(0));
        args.insert("x-expires".into(), AMQPValue::LongLongInt(5000));
        let limits = queue_limits(&args, "q", "/").unwrap_or_default();
        assert_eq!(limits.message_ttl, Some(0));
        assert_eq!(limits.expires, Some(5000));
        let refused = |key: &str, value: AMQPValue| {
            let mut args = FieldTable::default();
            args.insert(key.into(), value);
            queue_limits(&args, "q", "/")
                .err()
                .map(|error| error.text)
                .unwrap_or_default()
        };
        assert_eq!(
            refused("x-message-ttl", AMQPValue::LongInt(-1)),
            "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': {value_negative,-1}"
        );
        assert_eq!(
            refused("x-message-ttl", AMQPValue::LongString("10".into())),
            "invalid arg 'x-message-ttl' for queue 'q' in vhost '/': \"expected integer, got longstr\""
        );
        assert_eq!(
            refused("x-expires", AMQPValue::LongInt(0)),
            "invalid arg 'x-expires' for queue 'q' in vhost '/': {value_zero,0}"
        );
    }
}
