//! Queue arguments: the `x-*` (and Qpid) arguments that set a queue's
//! limits, how they are checked, and when a redeclare's arguments agree with
//! the queue's.

use amq_protocol_types::{AMQPValue, FieldTable};
use spillway_proto::amqp::reply_code;
use spillway_proto::engine::AmqpError;

use super::OpResult;
use crate::model::{Overflow, QueueLimits};
use crate::routing::{as_integer, values_equal};

/// Reads and checks `x-max-length`, `x-max-length-bytes` and `x-overflow`.
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
    Ok(QueueLimits {
        max_length: count("x-max-length")?,
        max_bytes: count("x-max-length-bytes")?,
        overflow,
        capacity,
        resume_capacity: capacity.map(|capacity| resume_capacity.unwrap_or(capacity)),
        max_count: count("qpid.max_count")?.filter(|count| *count > 0),
    })
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
        if !equivalent_argument(a, b) {
            return Some(key.as_str().to_string());
        }
    }
    None
}

fn equivalent_argument(a: Option<&AMQPValue>, b: Option<&AMQPValue>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => values_equal(a, b),
        (None, None) => true,
        _ => false,
    }
}
