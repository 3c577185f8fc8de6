//! What every management call of the engine shares: the internal session
//! management's declarations run on, the mapping of broker errors to
//! service errors, names and argument tables checked and shown.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use amq_protocol_types::{AMQPValue, FieldTable, ShortString};
use bytes::Bytes;
use spillway_amqp as amqp;
use spillway_proto::engine::{self as pb, AmqpError, ErrorKind};
use spillway_proto::management::{self as m, argument_value};
use spillway_proto::ServiceError;

use crate::argument_values::as_integer;
use crate::broker::{Broker, OpResult};
use crate::engine::Engine;
use crate::model::SessionId;
use crate::queue::Queue;
use crate::vhost::VHost;

/// The user name management's internal sessions run as. They are opened and
/// closed under one broker lock, so no listing ever sees them.
const MANAGEMENT_USER: &str = "management";

/// The channel management's internal sessions use.
pub(crate) const CHANNEL: u32 = 1;

impl Engine {
    /// Runs `op` on a fresh internal session of `vhost` with channel 1 open,
    /// under the broker lock; the session is closed before the lock goes.
    pub(super) fn with_session<T>(
        &self,
        vhost_name: &str,
        op: impl FnOnce(&mut Broker, SessionId) -> Result<T, ServiceError>,
    ) -> Result<T, ServiceError> {
        let mut broker = self.shared.broker.lock();
        let id = self.open_internal_session(&mut broker, vhost_name)?;
        let result = op(&mut broker, id);
        broker.close_session(id);
        result
    }

    /// Opens an internal session of `vhost` with channel 1 open, for
    /// management's own declarations and gets; the caller closes it.
    pub(crate) fn open_internal_session(
        &self,
        broker: &mut Broker,
        vhost_name: &str,
    ) -> Result<SessionId, ServiceError> {
        vhost(broker, vhost_name)?;
        let id = self.shared.next_session.fetch_add(1, Ordering::Relaxed);
        // Events for the internal session (none expected) are dropped.
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        let open = pb::OpenSession {
            request_id: 0,
            vhost: vhost_name.to_string(),
            user: MANAGEMENT_USER.to_string(),
            client_address: MANAGEMENT_USER.to_string(),
            client_properties: Bytes::new(),
        };
        broker
            .open_session(id, &open, events)
            .map_err(service_error)?;
        if let Err(error) = broker.open_channel(id, CHANNEL, None) {
            broker.close_session(id);
            return Err(service_error(error));
        }
        Ok(id)
    }
}

/// An AMQP error from a broker operation as a gRPC-mappable service error,
/// by what failed (its kind), never by its text.
pub(crate) fn service_error(error: AmqpError) -> ServiceError {
    let kind = error.effective_kind();
    let text = error.text;
    match kind {
        ErrorKind::NotFound => ServiceError::NotFound(text),
        ErrorKind::AccessRefused => ServiceError::PermissionDenied(text),
        ErrorKind::InvalidArgument => ServiceError::InvalidArgument(text),
        ErrorKind::FailedPrecondition => ServiceError::FailedPrecondition(text),
        ErrorKind::Internal | ErrorKind::Unspecified => ServiceError::Internal(text),
    }
}

pub(super) fn not_found(what: &str, name: &str, vhost: &str) -> ServiceError {
    ServiceError::NotFound(format!("no {what} '{name}' in vhost '{vhost}'"))
}

pub(super) fn vhost<'a>(broker: &'a Broker, name: &str) -> Result<&'a VHost, ServiceError> {
    broker
        .vhosts
        .get(name)
        .ok_or_else(|| ServiceError::NotFound(format!("vhost '{name}' not found")))
}

/// An exclusive queue belongs to the connection that declared it:
/// management may not read or move its messages (RabbitMQ answers 405
/// RESOURCE_LOCKED).
pub(super) fn not_exclusive(queue: &Queue, vhost: &str) -> Result<(), ServiceError> {
    if queue.exclusive_owner.is_none() {
        return Ok(());
    }
    Err(ServiceError::FailedPrecondition(format!(
        "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue '{}' in vhost '{vhost}'",
        queue.name
    )))
}

pub(crate) fn check_name(what: &str, name: &str) -> Result<(), ServiceError> {
    if name.is_empty() || name.len() > 255 {
        return Err(ServiceError::InvalidArgument(format!(
            "{what} name must be 1 to 255 bytes"
        )));
    }
    Ok(())
}

/// Management's argument map as the AMQP field table the broker checks.
pub(crate) fn encode_arguments(
    arguments: &HashMap<String, m::ArgumentValue>,
) -> Result<Bytes, ServiceError> {
    if arguments.is_empty() {
        return Ok(Bytes::new());
    }
    let mut table = FieldTable::default();
    let mut keys: Vec<&String> = arguments.keys().collect();
    keys.sort();
    for key in keys {
        if key.len() > 255 {
            return Err(ServiceError::InvalidArgument(format!(
                "argument name '{key}' is longer than 255 bytes"
            )));
        }
        let value = match arguments.get(key).and_then(|v| v.value.as_ref()) {
            Some(argument_value::Value::StringValue(s)) => AMQPValue::LongString(s.as_str().into()),
            Some(argument_value::Value::IntValue(i)) => AMQPValue::LongLongInt(*i),
            Some(argument_value::Value::BoolValue(b)) => AMQPValue::Boolean(*b),
            Some(argument_value::Value::DoubleValue(d)) => AMQPValue::Double(*d),
            Some(argument_value::Value::Text(_)) | None => {
                return Err(ServiceError::InvalidArgument(format!(
                    "argument '{key}' needs a string, integer, boolean or double value"
                )))
            }
        };
        table.insert(ShortString::from(key.as_str()), value);
    }
    Ok(amqp::encode_table(&table))
}

fn argument_value(value: &AMQPValue) -> m::ArgumentValue {
    use argument_value::Value;
    let value = match value {
        AMQPValue::LongString(s) => {
            Value::StringValue(String::from_utf8_lossy(s.as_bytes()).into())
        }
        AMQPValue::ShortString(s) => Value::StringValue(s.as_str().to_string()),
        AMQPValue::Boolean(b) => Value::BoolValue(*b),
        AMQPValue::Float(f) => Value::DoubleValue(f64::from(*f)),
        AMQPValue::Double(d) => Value::DoubleValue(*d),
        other => match as_integer(other).and_then(|i| i64::try_from(i).ok()) {
            Some(i) => Value::IntValue(i),
            None => Value::Text(format!("{other:?}")),
        },
    };
    m::ArgumentValue { value: Some(value) }
}

/// An AMQP-encoded table as management shows it (client properties).
pub(super) fn decoded_map(bytes: &[u8]) -> HashMap<String, m::ArgumentValue> {
    amqp::decode_table(bytes)
        .map(|table| argument_map(&table))
        .unwrap_or_default()
}

pub(crate) fn argument_map(table: &FieldTable) -> HashMap<String, m::ArgumentValue> {
    table
        .inner()
        .iter()
        .map(|(key, value)| (key.as_str().to_string(), argument_value(value)))
        .collect()
}

pub(super) fn ok<T>(result: OpResult<T>) -> Result<T, ServiceError> {
    result.map_err(service_error)
}
