//! Messages between AMQP 1.0's sections and what the engine keeps (0-9-1
//! basic properties and a body), following RabbitMQ 4's conversion table:
//!
//! | AMQP 1.0                              | AMQP 0-9-1                        |
//! |---------------------------------------|-----------------------------------|
//! | header `durable`                      | `delivery-mode` 2 (else 1)        |
//! | header `priority`                     | `priority`                        |
//! | header `ttl`                          | `expiration` (ms)                 |
//! | properties `message-id`               | `message-id`                      |
//! | properties `user-id`                  | `user-id`                         |
//! | properties `subject`                  | `type`                            |
//! | properties `reply-to`                 | `reply-to`                        |
//! | properties `correlation-id`           | `correlation-id`                  |
//! | properties `content-type`, `-encoding`| `content-type`, `content-encoding`|
//! | properties `creation-time` (ms)       | `timestamp` (s)                   |
//! | application-properties                | `headers`                         |
//! | one `data` section                    | the body                          |
//!
//! An `amqp-value` holding bytes or a string (what Qpid Proton sends for
//! Python `bytes` and `str`) becomes the body as it is, with the header
//! `x-amqp-1.0-body` saying so, and goes back to a 1.0 consumer as the
//! same `amqp-value`. Any other body (another `amqp-value`, an
//! `amqp-sequence`, several `data` sections) is kept as its encoded
//! sections, named by the same header, so that a 1.0 consumer gets back
//! the same sections; a 0-9-1 consumer sees the encoded bytes. A message ID that is not a string (ulong, uuid, binary) goes to
//! `message-id` as text and comes back typed from the header
//! `x-amqp-1.0-message-id-type`; likewise `correlation-id`.

use amq_protocol::protocol::basic::{gen_properties, parse_properties, AMQPProperties};
use amq_protocol::types::{AMQPValue, ByteArray, FieldTable, LongString, ShortString};
use bytes::Bytes;
use fe2o3_amqp_types::messaging::{
    AmqpValue, ApplicationProperties, Batch, Body, Data, Header, Message, MessageId, Properties,
};
use fe2o3_amqp_types::primitives::{Binary, OrderedMap, SimpleValue, Symbol, Timestamp, Value};

use super::guard;

/// The header that marks a body kept as encoded 1.0 sections.
pub const BODY_HEADER: &str = "x-amqp-1.0-body";
/// Its values for an amqp-value holding bytes or text, kept as the body.
const VALUE_BINARY: &str = "amqp-value-binary";
const VALUE_STRING: &str = "amqp-value-string";
/// The headers that keep the type of a non-string message or correlation ID.
pub const MESSAGE_ID_TYPE_HEADER: &str = "x-amqp-1.0-message-id-type";
pub const CORRELATION_ID_TYPE_HEADER: &str = "x-amqp-1.0-correlation-id-type";

/// A 1.0 message as the engine takes it.
#[derive(Debug, PartialEq)]
pub struct Published {
    /// 0-9-1 basic properties, encoded.
    pub properties: Bytes,
    pub body: Bytes,
    pub persistent: bool,
    pub expiration_ms: Option<u64>,
    /// `properties.subject`: the routing key of `/exchanges/X` targets.
    pub subject: Option<String>,
    /// `properties.to`: the address of a message sent to the null target.
    pub to: Option<String>,
    /// `properties.user-id`, which must name the user who logged in.
    pub user_id: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MappingError {
    #[error("{0} longer than 255 bytes")]
    TooLong(&'static str),
    #[error("{0} is not UTF-8")]
    NotText(&'static str),
    #[error("message properties do not encode: {0}")]
    Encoding(String),
}

/// A 1.0 message, as received on a link, for the engine.
pub fn from_amqp1(message: Message<Body<Value>>) -> Result<Published, MappingError> {
    let mut props = AMQPProperties::default();
    let mut headers = FieldTable::default();
    let mut persistent = false;
    let mut expiration_ms = None;
    if let Some(header) = &message.header {
        persistent = header.durable;
        props = props
            .with_delivery_mode(if header.durable { 2 } else { 1 })
            .with_priority(header.priority.0);
        if let Some(ttl) = header.ttl {
            expiration_ms = Some(u64::from(ttl));
            props = props.with_expiration(ShortString::from(ttl.to_string()));
        }
    }
    let mut subject = None;
    let mut to = None;
    let mut user_id = None;
    if let Some(properties) = message.properties {
        if let Some(id) = properties.message_id {
            let (text, kind) = id_text(id);
            props = props.with_message_id(short(text, "message-id")?);
            if let Some(kind) = kind {
                headers.insert(MESSAGE_ID_TYPE_HEADER.into(), long_string(kind));
            }
        }
        if let Some(id) = properties.correlation_id {
            let (text, kind) = id_text(id);
            props = props.with_correlation_id(short(text, "correlation-id")?);
            if let Some(kind) = kind {
                headers.insert(CORRELATION_ID_TYPE_HEADER.into(), long_string(kind));
            }
        }
        if let Some(user) = properties.user_id {
            let user =
                String::from_utf8(user.into_vec()).map_err(|_| MappingError::NotText("user-id"))?;
            props = props.with_user_id(short(user.clone(), "user-id")?);
            user_id = Some(user);
        }
        if let Some(value) = properties.subject {
            props = props.with_type(short(value.clone(), "subject")?);
            subject = Some(value);
        }
        if let Some(value) = properties.reply_to {
            props = props.with_reply_to(short(value, "reply-to")?);
        }
        if let Some(value) = properties.content_type {
            props = props.with_content_type(short(value.into_inner(), "content-type")?);
        }
        if let Some(value) = properties.content_encoding {
            props = props.with_content_encoding(short(value.into_inner(), "content-encoding")?);
        }
        if let Some(created) = properties.creation_time {
            let seconds = u64::try_from(created.milliseconds()).unwrap_or(0) / 1000;
            props = props.with_timestamp(seconds);
        }
        to = properties.to;
    }
    if let Some(application) = message.application_properties {
        for (key, value) in application.0 {
            if key.len() > 255 {
                return Err(MappingError::TooLong("application property name"));
            }
            headers.insert(ShortString::from(key), field_value(value));
        }
    }
    let body = match message.body {
        Body::Data(sections) => {
            let mut sections = sections.into_inner();
            if sections.is_empty() {
                // No section at all: an empty body, as `Body::Empty`.
                Bytes::new()
            } else if sections.len() == 1 {
                Bytes::from(sections.remove(0).0.into_vec())
            } else {
                headers.insert(BODY_HEADER.into(), long_string("data"));
                encoded(&Body::<Value>::Data(Batch::new(sections)))?
            }
        }
        Body::Empty => Bytes::new(),
        Body::Sequence(sequences) if sequences.is_empty() => Bytes::new(),
        // Bytes or text as an amqp-value (what Qpid Proton sends for a
        // Python `bytes` or `str` body): the body itself for 0-9-1
        // consumers, and an amqp-value again for 1.0 ones.
        Body::Value(AmqpValue(Value::Binary(bytes))) => {
            headers.insert(BODY_HEADER.into(), long_string(VALUE_BINARY));
            Bytes::from(bytes.into_vec())
        }
        Body::Value(AmqpValue(Value::String(text))) => {
            headers.insert(BODY_HEADER.into(), long_string(VALUE_STRING));
            Bytes::from(text.into_bytes())
        }
        other => {
            let kind = match &other {
                Body::Value(_) => "amqp-value",
                _ => "amqp-sequence",
            };
            headers.insert(BODY_HEADER.into(), long_string(kind));
            encoded(&other)?
        }
    };
    if !headers.inner().is_empty() {
        props = props.with_headers(headers);
    }
    let properties = encode_properties(&props)?;
    Ok(Published {
        properties,
        body,
        persistent,
        expiration_ms,
        subject,
        to,
        user_id,
    })
}

/// A message the engine delivers, for a 1.0 receiver. `redelivered` is
/// the engine's flag; `x-delivery-count` (set by queues that count
/// deliveries) becomes the header's `delivery-count`.
pub fn to_amqp1(properties: &[u8], body: Bytes, redelivered: bool) -> Message<Body<Value>> {
    let props = match parse_properties(properties) {
        Ok((_, props)) => props,
        Err(_) => AMQPProperties::default(),
    };
    let mut headers = props.headers().clone().unwrap_or_default();
    let body_kind = take_text(&mut headers, BODY_HEADER);
    let message_id_kind = take_text(&mut headers, MESSAGE_ID_TYPE_HEADER);
    let correlation_id_kind = take_text(&mut headers, CORRELATION_ID_TYPE_HEADER);
    let delivery_count = match headers.inner().get("x-delivery-count") {
        Some(value) => integer(value)
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(0),
        None => u32::from(redelivered),
    };
    let header = Header {
        durable: props.delivery_mode() == &Some(2),
        priority: props.priority().unwrap_or(4).into(),
        ttl: props
            .expiration()
            .as_ref()
            .and_then(|text| text.as_str().parse::<u32>().ok()),
        first_acquirer: !redelivered,
        delivery_count,
    };
    let text = |value: &Option<ShortString>| value.as_ref().map(|v| v.as_str().to_string());
    let properties = Properties {
        message_id: text(props.message_id()).map(|id| typed_id(id, message_id_kind.as_deref())),
        user_id: text(props.user_id()).map(|user| Binary::from(user.into_bytes())),
        to: None,
        subject: text(props.kind()),
        reply_to: text(props.reply_to()),
        correlation_id: text(props.correlation_id())
            .map(|id| typed_id(id, correlation_id_kind.as_deref())),
        content_type: text(props.content_type()).map(Symbol::from),
        content_encoding: text(props.content_encoding()).map(Symbol::from),
        absolute_expiry_time: None,
        creation_time: props
            .timestamp()
            .and_then(|seconds| i64::try_from(seconds.saturating_mul(1000)).ok())
            .map(Timestamp::from_milliseconds),
        group_id: None,
        group_sequence: None,
        reply_to_group_id: None,
    };
    let mut application = OrderedMap::new();
    for (key, value) in headers.inner() {
        if let Some(value) = simple_value(value) {
            application.insert(key.as_str().to_string(), value);
        }
    }
    let body = match body_kind.as_deref() {
        Some(VALUE_BINARY) => Body::Value(AmqpValue(Value::Binary(body.to_vec().into()))),
        Some(VALUE_STRING) => match String::from_utf8(body.to_vec()) {
            Ok(text) => Body::Value(AmqpValue(Value::String(text))),
            Err(_) => data_body(body),
        },
        Some(_) => decoded(&body).unwrap_or_else(|| data_body(body.clone())),
        None => data_body(body),
    };
    Message {
        header: Some(header),
        delivery_annotations: None,
        message_annotations: None,
        properties: Some(properties),
        application_properties: (!application.is_empty())
            .then_some(ApplicationProperties(application)),
        body,
        footer: None,
    }
}

fn data_body(body: Bytes) -> Body<Value> {
    if body.is_empty() {
        // An empty data section, not an absent body: receivers that read
        // `data` get an empty payload rather than a decode error.
        return Body::Data(Batch::new(vec![Data(Binary::from(Vec::new()))]));
    }
    Body::Data(Batch::new(vec![Data(Binary::from(body.to_vec()))]))
}

/// A body as encoded sections. serde_amqp 0.18 panics (`unreachable!`)
/// writing some values it decoded itself (a map whose timestamp key comes
/// before a binary value, found by fuzzing): such a body is refused with
/// an error, not a panic in a link task.
fn encoded(body: &Body<Value>) -> Result<Bytes, MappingError> {
    match std::panic::catch_unwind(|| serde_amqp::to_vec(body)) {
        Ok(Ok(bytes)) => Ok(Bytes::from(bytes)),
        Ok(Err(error)) => Err(MappingError::Encoding(error.to_string())),
        Err(_) => Err(MappingError::Encoding(
            "a value the AMQP 1.0 encoder cannot write".to_string(),
        )),
    }
}

/// Stored sections as a 1.0 body, if they decode and can be written again
/// (what was stored came from a client: a 0-9-1 publisher may set
/// [`BODY_HEADER`] too). The nesting is bounded before serde_amqp recurses.
fn decoded(bytes: &[u8]) -> Option<Body<Value>> {
    guard::nesting_depth(bytes).ok()?;
    let body = serde_amqp::from_slice::<Body<Value>>(bytes).ok()?;
    encoded(&body).ok()?;
    Some(body)
}

fn encode_properties(props: &AMQPProperties) -> Result<Bytes, MappingError> {
    let context = amq_protocol::frame::WriteContext::from(Vec::new());
    gen_properties(props)(context)
        .map(|context| Bytes::from(context.write))
        .map_err(|error| MappingError::Encoding(error.to_string()))
}

fn short(text: String, what: &'static str) -> Result<ShortString, MappingError> {
    if text.len() > 255 {
        return Err(MappingError::TooLong(what));
    }
    Ok(ShortString::from(text))
}

fn long_string(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.to_string()))
}

fn take_text(headers: &mut FieldTable, key: &str) -> Option<String> {
    let value = headers.inner().get(key).cloned()?;
    let mut kept = FieldTable::default();
    for (name, value) in headers.inner() {
        if name.as_str() != key {
            kept.insert(name.clone(), value.clone());
        }
    }
    *headers = kept;
    match value {
        AMQPValue::LongString(text) => Some(String::from_utf8_lossy(text.as_bytes()).into_owned()),
        AMQPValue::ShortString(text) => Some(text.as_str().to_string()),
        _ => None,
    }
}

/// A message or correlation ID as text, and its 1.0 type when that is not
/// a string.
fn id_text(id: MessageId) -> (String, Option<&'static str>) {
    match id {
        MessageId::String(text) => (text, None),
        MessageId::Ulong(n) => (n.to_string(), Some("ulong")),
        MessageId::Uuid(uuid) => (hex(uuid.as_inner()), Some("uuid")),
        MessageId::Binary(bytes) => (hex(bytes.as_ref()), Some("binary")),
    }
}

fn typed_id(text: String, kind: Option<&str>) -> MessageId {
    match kind {
        Some("ulong") => text
            .parse()
            .map(MessageId::Ulong)
            .unwrap_or(MessageId::String(text)),
        Some("uuid") => match unhex(&text).and_then(|bytes| <[u8; 16]>::try_from(bytes).ok()) {
            Some(bytes) => MessageId::Uuid(fe2o3_amqp_types::primitives::Uuid::from(bytes)),
            None => MessageId::String(text),
        },
        Some("binary") => match unhex(&text) {
            Some(bytes) => MessageId::Binary(Binary::from(bytes)),
            None => MessageId::String(text),
        },
        _ => MessageId::String(text),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// An application property as a 0-9-1 header value.
fn field_value(value: SimpleValue) -> AMQPValue {
    match value {
        SimpleValue::Null => AMQPValue::Void,
        SimpleValue::Bool(b) => AMQPValue::Boolean(b),
        SimpleValue::Ubyte(n) => AMQPValue::ShortShortUInt(n),
        SimpleValue::Ushort(n) => AMQPValue::ShortUInt(n),
        SimpleValue::Uint(n) => AMQPValue::LongUInt(n),
        SimpleValue::Ulong(n) => match i64::try_from(n) {
            Ok(n) => AMQPValue::LongLongInt(n),
            Err(_) => long_string(&n.to_string()),
        },
        SimpleValue::Byte(n) => AMQPValue::ShortShortInt(n),
        SimpleValue::Short(n) => AMQPValue::ShortInt(n),
        SimpleValue::Int(n) => AMQPValue::LongInt(n),
        SimpleValue::Long(n) => AMQPValue::LongLongInt(n),
        SimpleValue::Float(n) => AMQPValue::Float(n.into_inner()),
        SimpleValue::Double(n) => AMQPValue::Double(n.into_inner()),
        SimpleValue::Char(c) => long_string(&c.to_string()),
        SimpleValue::Timestamp(t) => {
            AMQPValue::Timestamp(u64::try_from(t.milliseconds()).unwrap_or(0) / 1000)
        }
        SimpleValue::Uuid(uuid) => long_string(&hex(uuid.as_inner())),
        SimpleValue::Binary(bytes) => AMQPValue::ByteArray(ByteArray::from(bytes.into_vec())),
        SimpleValue::String(text) => long_string(&text),
        SimpleValue::Symbol(symbol) => long_string(symbol.as_str()),
        // Decimals are rare in headers; kept as their text.
        other => long_string(&format!("{other:?}")),
    }
}

/// A 0-9-1 header value as an application property; None for tables and
/// arrays, which 1.0's application-properties cannot hold.
fn simple_value(value: &AMQPValue) -> Option<SimpleValue> {
    Some(match value {
        AMQPValue::Boolean(b) => SimpleValue::Bool(*b),
        AMQPValue::ShortShortInt(n) => SimpleValue::Byte(*n),
        AMQPValue::ShortShortUInt(n) => SimpleValue::Ubyte(*n),
        AMQPValue::ShortInt(n) => SimpleValue::Short(*n),
        AMQPValue::ShortUInt(n) => SimpleValue::Ushort(*n),
        AMQPValue::LongInt(n) => SimpleValue::Int(*n),
        AMQPValue::LongUInt(n) => SimpleValue::Uint(*n),
        AMQPValue::LongLongInt(n) => SimpleValue::Long(*n),
        AMQPValue::Float(n) => SimpleValue::Float((*n).into()),
        AMQPValue::Double(n) => SimpleValue::Double((*n).into()),
        AMQPValue::ShortString(text) => SimpleValue::String(text.as_str().to_string()),
        AMQPValue::LongString(text) => match std::str::from_utf8(text.as_bytes()) {
            Ok(text) => SimpleValue::String(text.to_string()),
            Err(_) => SimpleValue::Binary(text.as_bytes().to_vec().into()),
        },
        AMQPValue::Timestamp(seconds) => SimpleValue::Timestamp(Timestamp::from_milliseconds(
            i64::try_from(seconds.saturating_mul(1000)).unwrap_or(i64::MAX),
        )),
        AMQPValue::ByteArray(bytes) => SimpleValue::Binary(bytes.as_slice().to_vec().into()),
        AMQPValue::Void => SimpleValue::Null,
        AMQPValue::DecimalValue(_) | AMQPValue::FieldArray(_) | AMQPValue::FieldTable(_) => {
            return None
        }
    })
}

fn integer(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongLongInt(n) => Some(*n),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fe2o3_amqp_types::messaging::AmqpSequence;

    /// An amqp-value map {timestamp: binary, ...} the fuzzer found: serde_amqp
    /// decodes it and then panics writing it back.
    const UNWRITABLE_VALUE: &[u8] = &[
        0x00, 0x53, 0x77, 0xc1, 0x0c, 0x02, 0x83, 0x53, 0x97, 0x53, 0x97, 0x53, 0x72, 0x01, 0x6b,
        0xa0, 0x00,
    ];

    #[test]
    fn a_body_the_encoder_cannot_write_is_refused_not_a_panic() {
        let body: Body<Value> = serde_amqp::from_slice(UNWRITABLE_VALUE).expect("decodes");
        let mut message = full_message(body);
        message.properties = None;
        let refused = from_amqp1(message).map(|_| ());
        assert!(
            matches!(refused, Err(MappingError::Encoding(_))),
            "{refused:?}"
        );
    }

    #[test]
    fn stored_sections_that_cannot_be_written_again_go_out_as_data() {
        let mut headers = FieldTable::default();
        headers.insert(BODY_HEADER.into(), long_string("amqp-value"));
        let props = AMQPProperties::default().with_headers(headers);
        let properties = encode_properties(&props).expect("properties");
        let unwritable = Bytes::from_static(UNWRITABLE_VALUE);
        let message = to_amqp1(&properties, unwritable.clone(), false);
        assert_eq!(message.body, data_body(unwritable));
        // Nesting deeper than the guard allows is not decoded at all.
        let nested = Bytes::from(nested_list_value(guard::MAX_NESTING + 1));
        let message = to_amqp1(&properties, nested.clone(), false);
        assert_eq!(message.body, data_body(nested));
    }

    /// An amqp-value section of `depth` lists, each holding the next.
    fn nested_list_value(depth: usize) -> Vec<u8> {
        let mut value = vec![0x45]; // list0
        for _ in 0..depth {
            let size = (value.len() + 4) as u32;
            let mut outer = vec![0xd0];
            outer.extend_from_slice(&size.to_be_bytes());
            outer.extend_from_slice(&1u32.to_be_bytes());
            outer.extend_from_slice(&value);
            value = outer;
        }
        let mut section = vec![0x00, 0x53, 0x77];
        section.extend_from_slice(&value);
        section
    }

    fn full_message(body: Body<Value>) -> Message<Body<Value>> {
        let mut application = OrderedMap::new();
        application.insert("region".to_string(), SimpleValue::String("eu".into()));
        application.insert("attempt".to_string(), SimpleValue::Long(3));
        application.insert("urgent".to_string(), SimpleValue::Bool(true));
        Message {
            header: Some(Header {
                durable: true,
                priority: 7.into(),
                ttl: Some(60_000),
                first_acquirer: false,
                delivery_count: 0,
            }),
            delivery_annotations: None,
            message_annotations: None,
            properties: Some(Properties {
                message_id: Some(MessageId::Ulong(42)),
                user_id: Some(Binary::from(b"guest".to_vec())),
                to: None,
                subject: Some("orders.eu".into()),
                reply_to: Some("/queues/replies".into()),
                correlation_id: Some(MessageId::String("c-1".into())),
                content_type: Some(Symbol::from("application/json")),
                content_encoding: Some(Symbol::from("utf-8")),
                absolute_expiry_time: None,
                creation_time: Some(Timestamp::from_milliseconds(1_700_000_000_000)),
                group_id: None,
                group_sequence: None,
                reply_to_group_id: None,
            }),
            application_properties: Some(ApplicationProperties(application)),
            body,
            footer: None,
        }
    }

    #[test]
    fn a_data_message_maps_field_by_field_and_back() {
        let sent = full_message(Body::Data(Batch::new(vec![Data(Binary::from(
            b"{\"id\":1}".to_vec(),
        ))])));
        let published = from_amqp1(sent.clone()).expect("maps");
        assert!(published.persistent);
        assert_eq!(published.expiration_ms, Some(60_000));
        assert_eq!(published.subject.as_deref(), Some("orders.eu"));
        assert_eq!(published.user_id.as_deref(), Some("guest"));
        assert_eq!(&published.body[..], b"{\"id\":1}");
        let (_, props) = parse_properties(&published.properties[..]).expect("parses");
        assert_eq!(props.delivery_mode(), &Some(2));
        assert_eq!(props.priority(), &Some(7));
        assert_eq!(
            props.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert_eq!(props.kind().as_ref().map(|s| s.as_str()), Some("orders.eu"));
        assert_eq!(props.timestamp(), &Some(1_700_000_000));
        let headers = props.headers().clone().unwrap_or_default();
        assert_eq!(
            headers.inner().get("attempt"),
            Some(&AMQPValue::LongLongInt(3))
        );

        let back = to_amqp1(&published.properties, published.body.clone(), false);
        assert_eq!(back.body, sent.body);
        // The same entries; 0-9-1's headers table keeps them sorted by name.
        let entries = |properties: Option<ApplicationProperties>| {
            let mut entries: Vec<_> = properties.unwrap_or_default().0.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            entries
        };
        assert_eq!(
            entries(back.application_properties.clone()),
            entries(sent.application_properties.clone())
        );
        let (sent_props, back_props) = (
            sent.properties.unwrap_or_default(),
            back.properties.unwrap_or_default(),
        );
        assert_eq!(
            back_props.message_id, sent_props.message_id,
            "typed id comes back"
        );
        assert_eq!(back_props.correlation_id, sent_props.correlation_id);
        assert_eq!(back_props.subject, sent_props.subject);
        assert_eq!(back_props.reply_to, sent_props.reply_to);
        assert_eq!(back_props.content_type, sent_props.content_type);
        assert_eq!(back_props.creation_time, sent_props.creation_time);
        let header = back.header.unwrap_or_default();
        assert!(header.durable);
        assert_eq!(header.priority.0, 7);
        assert_eq!(header.ttl, Some(60_000));
        assert!(header.first_acquirer);
    }

    #[test]
    fn value_and_sequence_bodies_come_back_as_sent() {
        for body in [
            Body::Value(AmqpValue(Value::String("hello".into()))),
            Body::Value(AmqpValue(Value::Binary(b"raw".to_vec().into()))),
            Body::Value(AmqpValue(Value::Long(-5))),
            Body::Sequence(Batch::new(vec![AmqpSequence(vec![
                Value::Int(1),
                Value::Int(2),
            ])])),
            Body::Data(Batch::new(vec![
                Data(Binary::from(b"a".to_vec())),
                Data(Binary::from(b"b".to_vec())),
            ])),
        ] {
            let published = from_amqp1(full_message(body.clone())).expect("maps");
            let back = to_amqp1(&published.properties, published.body, true);
            assert_eq!(back.body, body);
            assert!(!back.header.unwrap_or_default().first_acquirer);
            let application = back.application_properties.unwrap_or_default().0;
            assert!(application.get(BODY_HEADER).is_none(), "marker not shown");
        }
    }

    #[test]
    fn a_0_9_1_message_arrives_as_one_data_section() {
        let props = AMQPProperties::default()
            .with_content_type("text/plain".into())
            .with_delivery_mode(1);
        let encoded = encode_properties(&props).expect("encodes");
        let message = to_amqp1(&encoded, Bytes::from_static(b"hi"), false);
        assert_eq!(
            message.body,
            Body::Data(Batch::new(vec![Data(Binary::from(b"hi".to_vec()))]))
        );
        assert!(!message.header.unwrap_or_default().durable);
        // Properties that do not parse give a message without them, not a panic.
        let message = to_amqp1(b"\xff\xff\xff", Bytes::from_static(b"x"), false);
        assert!(message.application_properties.is_none());
    }

    #[test]
    fn fields_too_long_for_0_9_1_are_refused() {
        let mut message = full_message(Body::Empty);
        if let Some(properties) = message.properties.as_mut() {
            properties.subject = Some("s".repeat(256));
        }
        assert_eq!(from_amqp1(message), Err(MappingError::TooLong("subject")));
    }
}
