//! What the broker reads of a published message's properties, parsed once
//! where the message comes in (the gateway): whether it is persistent, the
//! `user_id` to check against the login, and its `expiration`. The engine
//! gets these as fields of the publish and keeps the properties as the
//! client sent them, parsing them again only where it must: a headers
//! exchange routing on `headers`, and dead-lettering, which rewrites them.

use amq_protocol::protocol::basic::parse_properties;

use crate::reply_code;

/// RabbitMQ's largest TTL (`rabbit_misc:check_expiry`): 2^32 - 1 ms.
pub const MAX_EXPIRY_MS: u64 = u32::MAX as u64;

/// The properties of one published message, as the broker uses them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PublishProperties {
    /// `delivery-mode` 2.
    pub persistent: bool,
    /// `user-id`, which must name the user who logged in.
    pub user_id: Option<String>,
    /// `expiration`, milliseconds.
    pub expiration_ms: Option<u64>,
}

/// Properties a publish cannot carry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PropertiesError {
    /// Not a basic content header's property list.
    #[error("malformed message properties")]
    Malformed,
    /// An `expiration` that is not a number of milliseconds, in RabbitMQ's
    /// words (`invalid expiration 'abc': no_integer`).
    #[error("invalid expiration '{text}': {why}")]
    InvalidExpiration { text: String, why: String },
}

impl PropertiesError {
    /// The reply code that closes the publishing channel, as RabbitMQ's.
    pub fn reply_code(&self) -> u16 {
        match self {
            PropertiesError::Malformed => reply_code::SYNTAX_ERROR,
            PropertiesError::InvalidExpiration { .. } => reply_code::PRECONDITION_FAILED,
        }
    }
}

impl PublishProperties {
    /// Parses a content header's property list (flags first), all of it.
    pub fn read(bytes: &[u8]) -> Result<Self, PropertiesError> {
        let properties = match parse_properties(bytes) {
            Ok(([], properties)) => properties,
            _ => return Err(PropertiesError::Malformed),
        };
        let expiration_ms = match properties.expiration() {
            None => None,
            Some(text) => Some(parse_expiration(text.as_str()).map_err(|why| {
                PropertiesError::InvalidExpiration {
                    text: text.as_str().to_string(),
                    why,
                }
            })?),
        };
        Ok(Self {
            persistent: properties.delivery_mode() == &Some(2),
            user_id: properties.user_id().clone().map(String::from),
            expiration_ms,
        })
    }
}

/// The `expiration` property: a string of digits, milliseconds. Refused
/// as RabbitMQ refuses it (`rabbit_basic:parse_expiration`), the text
/// after `invalid expiration '…': `.
pub fn parse_expiration(text: &str) -> Result<u64, String> {
    // Erlang's string:to_integer: an optional sign, then digits.
    let digits_start = usize::from(text.starts_with(['-', '+']));
    let digits_end = text[digits_start..]
        .find(|c: char| !c.is_ascii_digit())
        .map_or(text.len(), |end| digits_start + end);
    if digits_end == digits_start {
        return Err("no_integer".to_string());
    }
    let leftover = &text[digits_end..];
    if !leftover.is_empty() {
        return Err(format!("{{leftover_string,{leftover:?}}}"));
    }
    let number: i128 = match text[..digits_end].trim_start_matches('+').parse() {
        Ok(n) => n,
        Err(_) => return Err(format!("{{value_too_large,{}}}", &text[..digits_end])),
    };
    if number < 0 {
        return Err(format!("{{value_negative,{number}}}"));
    }
    match u64::try_from(number) {
        Ok(ms) if ms <= MAX_EXPIRY_MS => Ok(ms),
        _ => Err(format!("{{value_too_large,{number}}}")),
    }
}

/// The `priority` property of a content header's property list (flags
/// first), read without parsing the rest: the engine asks for it only for
/// priority queues, on every message they take. None when it is absent or
/// the list is cut short; the gateway has refused malformed lists already.
pub fn priority(bytes: &[u8]) -> Option<u8> {
    const CONTENT_TYPE: u16 = 1 << 15;
    const CONTENT_ENCODING: u16 = 1 << 14;
    const HEADERS: u16 = 1 << 13;
    const DELIVERY_MODE: u16 = 1 << 12;
    const PRIORITY: u16 = 1 << 11;
    let flags = u16::from_be_bytes([*bytes.first()?, *bytes.get(1)?]);
    if flags & PRIORITY == 0 {
        return None;
    }
    let mut at = 2usize;
    for flag in [CONTENT_TYPE, CONTENT_ENCODING] {
        if flags & flag != 0 {
            at = at.checked_add(1 + usize::from(*bytes.get(at)?))?;
        }
    }
    if flags & HEADERS != 0 {
        let len = u32::from_be_bytes(bytes.get(at..at.checked_add(4)?)?.try_into().ok()?);
        at = at.checked_add(4)?.checked_add(usize::try_from(len).ok()?)?;
    }
    if flags & DELIVERY_MODE != 0 {
        at = at.checked_add(1)?;
    }
    bytes.get(at).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::WriteContext;
    use amq_protocol::protocol::basic::{gen_properties, AMQPProperties};
    use amq_protocol::types::ShortString;

    fn encoded(properties: &AMQPProperties) -> Vec<u8> {
        match gen_properties(properties)(WriteContext::from(Vec::new())) {
            Ok(context) => context.write,
            Err(error) => panic!("properties not encoded: {error:?}"),
        }
    }

    #[test]
    fn persistence_user_and_expiration_are_read_in_one_pass() {
        let properties = AMQPProperties::default()
            .with_delivery_mode(2)
            .with_user_id(ShortString::from("app"))
            .with_expiration(ShortString::from("60000"));
        assert_eq!(
            PublishProperties::read(&encoded(&properties)),
            Ok(PublishProperties {
                persistent: true,
                user_id: Some("app".into()),
                expiration_ms: Some(60_000),
            })
        );
        assert_eq!(
            PublishProperties::read(&[0, 0]),
            Ok(PublishProperties::default())
        );
    }

    #[test]
    fn bad_properties_are_refused_with_rabbitmq_codes() {
        let bad = AMQPProperties::default().with_expiration(ShortString::from("soon"));
        let error = PublishProperties::read(&encoded(&bad));
        assert_eq!(
            error.as_ref().map_err(ToString::to_string),
            Err("invalid expiration 'soon': no_integer".to_string())
        );
        assert_eq!(error.map_err(|e| e.reply_code()), Err(406));
        // Flags announcing a property that is not there, and trailing bytes.
        assert_eq!(
            PublishProperties::read(&[0x01, 0x00]).map_err(|e| e.reply_code()),
            Err(502)
        );
        assert_eq!(
            PublishProperties::read(&[0, 0, 7]),
            Err(PropertiesError::Malformed)
        );
    }

    #[test]
    fn expirations_are_read_and_refused_as_rabbitmq_does() {
        assert_eq!(parse_expiration("0"), Ok(0));
        assert_eq!(parse_expiration("60000"), Ok(60_000));
        assert_eq!(parse_expiration("abc").err().as_deref(), Some("no_integer"));
        assert_eq!(parse_expiration("").err().as_deref(), Some("no_integer"));
        assert_eq!(
            parse_expiration("10x").err().as_deref(),
            Some("{leftover_string,\"x\"}")
        );
        assert_eq!(
            parse_expiration("-1").err().as_deref(),
            Some("{value_negative,-1}")
        );
        assert_eq!(
            parse_expiration("4294967296").err().as_deref(),
            Some("{value_too_large,4294967296}")
        );
    }

    #[test]
    fn priority_is_read_past_the_fields_before_it() {
        use amq_protocol::types::{AMQPValue, FieldTable};
        let mut headers = FieldTable::default();
        headers.insert("k".into(), AMQPValue::LongString("v".into()));
        let cases = [
            AMQPProperties::default(),
            AMQPProperties::default().with_priority(7),
            AMQPProperties::default()
                .with_content_type(ShortString::from("text/plain"))
                .with_content_encoding(ShortString::from("gzip"))
                .with_headers(headers)
                .with_delivery_mode(2)
                .with_priority(200)
                .with_correlation_id(ShortString::from("c")),
            AMQPProperties::default()
                .with_delivery_mode(1)
                .with_expiration(ShortString::from("5")),
        ];
        for properties in cases {
            let bytes = encoded(&properties);
            assert_eq!(priority(&bytes), *properties.priority());
            // Cut short anywhere: no answer, no panic.
            for end in 0..bytes.len() {
                let _ = priority(&bytes[..end]);
            }
        }
    }
}
