//! Routing: which queues a published message reaches, and the matchers
//! behind it (direct keys, topic patterns, headers tables).

use amq_protocol_types::{AMQPValue, FieldTable};
use spillway_amqp::reply_code;
use spillway_proto::engine::{self as pb, AmqpError};

use crate::argument_values::as_integer;
use crate::exchange::Exchange;
use crate::model::Destination;
pub use crate::model::ExchangeKind;
use crate::vhost::VHost;

/// The queues a message reaches from `exchange`, following exchange-to-
/// exchange bindings (each exchange visited once, so cycles end). An
/// exchange none of whose bindings match hands the message to its
/// alternate exchange, if it names one that exists (RabbitMQ's rule: per
/// exchange, so an alternate's own alternate is followed too, and the
/// visited set ends loops among them).
pub fn route(
    vhost: &VHost,
    exchange: &Exchange,
    cmd: &pb::Publish,
) -> Result<Vec<String>, AmqpError> {
    if exchange.name.is_empty() {
        return Ok(if vhost.queues.contains_key(&cmd.routing_key) {
            vec![cmd.routing_key.clone()]
        } else {
            Vec::new()
        });
    }
    let mut headers: Option<Option<FieldTable>> = None;
    let mut targets = Vec::new();
    let mut visited = vec![exchange.name.as_str()];
    let mut pending = vec![exchange];
    while let Some(exchange) = pending.pop() {
        if exchange.kind == ExchangeKind::Headers && headers.is_none() {
            headers = Some(message_headers(&cmd.properties)?);
        }
        let mut matched = false;
        // Direct and topic bindings come out of the index already matched.
        for binding in exchange
            .bindings
            .candidates(exchange.kind, &cmd.routing_key)
        {
            if exchange.kind == ExchangeKind::Headers
                && !headers_match(
                    &binding.arguments,
                    headers.as_ref().and_then(Option::as_ref),
                )
            {
                continue;
            }
            matched = true;
            match &binding.destination {
                Destination::Queue(queue) => targets.push(queue.clone()),
                Destination::Exchange(next) => {
                    if visited.contains(&next.as_str()) {
                        continue;
                    }
                    if let Some(next) = vhost.exchanges.get(next) {
                        visited.push(next.name.as_str());
                        pending.push(next);
                    }
                }
            }
        }
        if matched {
            continue;
        }
        let Some(alternate) = exchange.alternate_exchange() else {
            continue;
        };
        if visited.contains(&alternate) {
            continue;
        }
        if let Some(alternate) = vhost.exchanges.get(alternate) {
            visited.push(alternate.name.as_str());
            pending.push(alternate);
        }
    }
    targets.sort();
    targets.dedup();
    Ok(targets)
}

/// The `headers` property of a message, for headers-exchange routing.
fn message_headers(properties: &[u8]) -> Result<Option<FieldTable>, AmqpError> {
    match amq_protocol::protocol::basic::parse_properties(properties) {
        Ok((_, parsed)) => Ok(parsed.headers().clone()),
        Err(_) => Err(AmqpError::new(
            reply_code::SYNTAX_ERROR,
            "malformed message properties",
        )),
    }
}

/// How a headers binding matches, from its `x-match` argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HeadersMatch {
    All,
    Any,
    AllWithX,
    AnyWithX,
}

/// Does a headers-exchange binding (its arguments) match a message's headers?
pub fn headers_match(binding: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let mode = match binding.inner().get("x-match") {
        Some(AMQPValue::LongString(s)) if s.as_bytes() == b"any" => HeadersMatch::Any,
        Some(AMQPValue::LongString(s)) if s.as_bytes() == b"all-with-x" => HeadersMatch::AllWithX,
        Some(AMQPValue::LongString(s)) if s.as_bytes() == b"any-with-x" => HeadersMatch::AnyWithX,
        Some(AMQPValue::ShortString(s)) if s.as_str() == "any" => HeadersMatch::Any,
        _ => HeadersMatch::All,
    };
    let with_x = matches!(mode, HeadersMatch::AllWithX | HeadersMatch::AnyWithX);
    let wanted = binding.inner().iter().filter(|(key, _)| {
        key.as_str() != "x-match" && (with_x || !key.as_str().starts_with("x-"))
    });
    let empty = FieldTable::default();
    let headers = headers.unwrap_or(&empty).inner();
    let mut one = |(key, value): (&amq_protocol_types::ShortString, &AMQPValue)| match (
        headers.get(key),
        value,
    ) {
        (Some(_), AMQPValue::Void) => true,
        (Some(actual), expected) => values_equal(actual, expected),
        (None, _) => false,
    };
    match mode {
        HeadersMatch::All | HeadersMatch::AllWithX => wanted.into_iter().all(&mut one),
        HeadersMatch::Any | HeadersMatch::AnyWithX => wanted.into_iter().any(&mut one),
    }
}

/// Header values compare by meaning, not by AMQP type: a client that sends
/// `1` as a short int matches a binding that holds `1` as a long int, and a
/// short string matches the same long string.
pub fn values_equal(a: &AMQPValue, b: &AMQPValue) -> bool {
    if let (Some(x), Some(y)) = (as_integer(a), as_integer(b)) {
        return x == y;
    }
    if let (Some(x), Some(y)) = (as_bytes(a), as_bytes(b)) {
        return x == y;
    }
    a == b
}

fn as_bytes(value: &AMQPValue) -> Option<&[u8]> {
    match value {
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes()),
        AMQPValue::LongString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
        let mut table = FieldTable::default();
        for (key, value) in entries {
            table.insert((*key).into(), value.clone());
        }
        table
    }

    #[test]
    fn headers_all_and_any() {
        let all = table(&[
            ("x-match", AMQPValue::LongString("all".into())),
            ("a", AMQPValue::LongInt(1)),
            ("b", AMQPValue::LongString("x".into())),
        ]);
        let any = table(&[
            ("x-match", AMQPValue::LongString("any".into())),
            ("a", AMQPValue::LongInt(1)),
            ("b", AMQPValue::LongString("x".into())),
        ]);
        let both = table(&[
            ("a", AMQPValue::ShortShortInt(1)),
            ("b", AMQPValue::ShortString("x".into())),
        ]);
        let one = table(&[("a", AMQPValue::LongLongInt(1))]);
        assert!(headers_match(&all, Some(&both)));
        assert!(!headers_match(&all, Some(&one)));
        assert!(headers_match(&any, Some(&one)));
        assert!(!headers_match(&any, None));
        let default_all = table(&[("a", AMQPValue::LongInt(2))]);
        assert!(!headers_match(&default_all, Some(&one)));
    }
}
