//! AMQP 1.0 addresses as RabbitMQ 4 defines them (its "v2" addresses), and
//! the older forms RabbitMQ 3's `rabbitmq_amqp1_0` plugin took, so clients
//! written for either work unchanged:
//!
//! | address                      | as a target                        | as a source   |
//! |------------------------------|------------------------------------|---------------|
//! | `/exchanges/X/KEY`           | exchange X, routing key KEY        | refused       |
//! | `/exchanges/X`               | exchange X, key = message subject  | refused       |
//! | `/queues/Q`                  | default exchange, key Q            | queue Q       |
//! | null                         | each message's `to`, one of above  | refused       |
//! | `/exchange/X/KEY`, `/queue/Q`, `/amq/queue/Q`, `/topic/KEY` | as RabbitMQ 3 | `/queue/Q`, `/amq/queue/Q` |
//!
//! Names are percent-encoded (RFC 3986); a name is at most 255 bytes once
//! decoded, as in 0-9-1.

/// Where a message sent to a target goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destination {
    /// An exchange, with the routing key fixed by the address, or taken
    /// from each message's `subject` when None.
    Exchange {
        exchange: String,
        routing_key: Option<String>,
    },
    /// A queue, through the default exchange.
    Queue(String),
}

impl Destination {
    /// The exchange and routing key of one message, whose subject is
    /// `subject`.
    pub fn route(&self, subject: Option<&str>) -> (String, String) {
        match self {
            Destination::Queue(queue) => (String::new(), queue.clone()),
            Destination::Exchange {
                exchange,
                routing_key: Some(key),
            } => (exchange.clone(), key.clone()),
            Destination::Exchange {
                exchange,
                routing_key: None,
            } => (exchange.clone(), subject.unwrap_or_default().to_string()),
        }
    }
}

/// Longest exchange or queue name, as in AMQP 0-9-1 (a short string).
pub const MAX_NAME: usize = 255;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    #[error("address '{0}' is not of the form /exchanges/X/KEY, /exchanges/X or /queues/Q")]
    Unknown(String),
    #[error("address '{0}' is not percent-encoded correctly")]
    Encoding(String),
    #[error("name in address '{0}' is longer than 255 bytes")]
    TooLong(String),
    #[error("the default exchange is addressed as /queues/Q, not '{0}'")]
    DefaultExchange(String),
}

/// The destination of a target address.
pub fn parse_target(address: &str) -> Result<Destination, AddressError> {
    let segments = segments(address)?;
    let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
    let destination = match segments.as_slice() {
        ["exchanges", exchange] | ["exchange", exchange] => Destination::Exchange {
            exchange: exchange.to_string(),
            routing_key: None,
        },
        ["exchanges", exchange, key] | ["exchange", exchange, key] => Destination::Exchange {
            exchange: exchange.to_string(),
            routing_key: Some(key.to_string()),
        },
        ["queues", queue] | ["queue", queue] | ["amq", "queue", queue] => {
            Destination::Queue(queue.to_string())
        }
        ["topic", key] => Destination::Exchange {
            exchange: "amq.topic".into(),
            routing_key: Some(key.to_string()),
        },
        _ => return Err(AddressError::Unknown(address.to_string())),
    };
    if let Destination::Exchange { exchange, .. } = &destination {
        if exchange.is_empty() || exchange == "amq.default" {
            return Err(AddressError::DefaultExchange(address.to_string()));
        }
    }
    Ok(destination)
}

/// The queue a source address names.
pub fn parse_source(address: &str) -> Result<String, AddressError> {
    let segments = segments(address)?;
    let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
    match segments.as_slice() {
        ["queues", queue] | ["queue", queue] | ["amq", "queue", queue] => Ok(queue.to_string()),
        _ => Err(AddressError::Unknown(address.to_string())),
    }
}

/// The decoded path segments of an address that starts with `/`. An
/// address is at most a few names long: anything longer than three names
/// and their separators is refused before it is decoded.
fn segments(address: &str) -> Result<Vec<String>, AddressError> {
    if address.len() > 3 * (3 * MAX_NAME + 1) + 16 {
        return Err(AddressError::TooLong(short(address)));
    }
    let Some(path) = address.strip_prefix('/') else {
        return Err(AddressError::Unknown(address.to_string()));
    };
    let mut decoded = Vec::new();
    for raw in path.split('/') {
        if decoded.len() == 3 {
            return Err(AddressError::Unknown(address.to_string()));
        }
        let name =
            percent_decode(raw).ok_or_else(|| AddressError::Encoding(address.to_string()))?;
        if name.len() > MAX_NAME {
            return Err(AddressError::TooLong(short(address)));
        }
        decoded.push(name);
    }
    Ok(decoded)
}

fn short(address: &str) -> String {
    let mut end = address.len().min(64);
    while !address.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &address[..end])
}

/// RFC 3986 percent-decoding into UTF-8; None for a bad escape or bytes
/// that are not UTF-8.
fn percent_decode(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let text = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(text, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Percent-encodes a name for an address (what management shows).
pub fn percent_encode(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rabbitmq_4_targets_and_sources() {
        assert_eq!(
            parse_target("/exchanges/amq.topic/orders.eu"),
            Ok(Destination::Exchange {
                exchange: "amq.topic".into(),
                routing_key: Some("orders.eu".into())
            })
        );
        assert_eq!(
            parse_target("/exchanges/logs"),
            Ok(Destination::Exchange {
                exchange: "logs".into(),
                routing_key: None
            })
        );
        assert_eq!(
            parse_target("/queues/my%20queue%2Fone"),
            Ok(Destination::Queue("my queue/one".into()))
        );
        assert_eq!(parse_source("/queues/q%C3%A9"), Ok("qé".into()));
        // An empty key is a key.
        assert_eq!(
            parse_target("/exchanges/x/"),
            Ok(Destination::Exchange {
                exchange: "x".into(),
                routing_key: Some(String::new())
            })
        );
    }

    #[test]
    fn rabbitmq_3_forms_are_understood() {
        assert_eq!(parse_target("/queue/q"), Ok(Destination::Queue("q".into())));
        assert_eq!(
            parse_target("/amq/queue/q"),
            Ok(Destination::Queue("q".into()))
        );
        assert_eq!(parse_source("/queue/q"), Ok("q".into()));
        assert_eq!(
            parse_target("/topic/a.b"),
            Ok(Destination::Exchange {
                exchange: "amq.topic".into(),
                routing_key: Some("a.b".into())
            })
        );
    }

    #[test]
    fn bad_addresses_are_refused_with_a_reason() {
        for bad in [
            "",
            "queues/q",
            "/queues",
            "/queues/a/b",
            "/elsewhere/x",
            "/exchanges/a/b/c",
        ] {
            assert!(
                matches!(parse_target(bad), Err(AddressError::Unknown(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            parse_target("/queues/%zz"),
            Err(AddressError::Encoding(_))
        ));
        assert!(matches!(
            parse_target("/queues/%ff"),
            Err(AddressError::Encoding(_))
        ));
        assert!(matches!(
            parse_target("/queues/%4"),
            Err(AddressError::Encoding(_))
        ));
        let long = format!("/queues/{}", "a".repeat(256));
        assert!(matches!(parse_target(&long), Err(AddressError::TooLong(_))));
        let huge = format!("/queues/{}", "%41".repeat(10_000));
        assert!(matches!(parse_target(&huge), Err(AddressError::TooLong(_))));
        assert!(matches!(
            parse_target("/exchanges/amq.default/q"),
            Err(AddressError::DefaultExchange(_))
        ));
        assert!(matches!(
            parse_source("/exchanges/x"),
            Err(AddressError::Unknown(_))
        ));
    }

    #[test]
    fn names_encode_and_decode_back() {
        for name in ["plain", "with space", "a/b", "é%", ""] {
            let address = format!("/queues/{}", percent_encode(name));
            assert_eq!(parse_source(&address), Ok(name.to_string()), "{address}");
        }
    }

    #[test]
    fn the_routing_key_comes_from_the_subject_when_the_address_has_none() {
        let fanout = parse_target("/exchanges/events").expect("valid");
        assert_eq!(fanout.route(Some("k")), ("events".into(), "k".into()));
        assert_eq!(fanout.route(None), ("events".into(), String::new()));
        let queue = parse_target("/queues/q").expect("valid");
        assert_eq!(queue.route(Some("ignored")), (String::new(), "q".into()));
    }
}
