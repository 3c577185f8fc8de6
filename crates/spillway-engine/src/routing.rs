//! Which bindings of an exchange match a published message.

use amq_protocol_types::{AMQPValue, FieldTable};

/// The exchange types a client may declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExchangeKind {
    Direct,
    Fanout,
    Topic,
    Headers,
}

impl ExchangeKind {
    pub fn parse(kind: &str) -> Option<Self> {
        match kind {
            "direct" => Some(Self::Direct),
            "fanout" => Some(Self::Fanout),
            "topic" => Some(Self::Topic),
            "headers" => Some(Self::Headers),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Fanout => "fanout",
            Self::Topic => "topic",
            Self::Headers => "headers",
        }
    }
}

/// Does a topic binding pattern (`*` = one word, `#` = zero or more words)
/// match a routing key? Words are separated by dots.
pub fn topic_matches(pattern: &str, routing_key: &str) -> bool {
    // As in RabbitMQ, an empty key has no words (but "a..b" has an empty one).
    fn words(s: &str) -> Vec<&str> {
        if s.is_empty() {
            Vec::new()
        } else {
            s.split('.').collect()
        }
    }
    let (pattern, key) = (words(pattern), words(routing_key));
    // matches[i][j]: pattern[i..] matches key[j..]; computed backwards.
    let (p, k) = (pattern.len(), key.len());
    let mut next = vec![false; k + 1];
    next[k] = true;
    for i in (0..p).rev() {
        let mut current = vec![false; k + 1];
        for j in (0..=k).rev() {
            current[j] = match pattern[i] {
                "#" => next[j] || (j < k && current[j + 1]),
                "*" => j < k && next[j + 1],
                word => j < k && key[j] == word && next[j + 1],
            };
        }
        next = current;
    }
    next[0]
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

    #[test]
    fn topic_patterns() {
        assert!(topic_matches("a.b", "a.b"));
        assert!(!topic_matches("a.b", "a.b.c"));
        assert!(topic_matches("a.*", "a.b"));
        assert!(!topic_matches("a.*", "a"));
        assert!(!topic_matches("a.*", "a.b.c"));
        assert!(topic_matches("#", ""));
        assert!(topic_matches("#", "a.b.c"));
        assert!(topic_matches("a.#", "a"));
        assert!(topic_matches("a.#", "a.b.c"));
        assert!(topic_matches("a.#.b", "a.b"));
        assert!(topic_matches("a.#.b", "a.x.y.b"));
        assert!(!topic_matches("a.#.b", "a.x.y.c"));
        assert!(topic_matches("*.*.c", "a.b.c"));
        assert!(topic_matches("#.c", "c"));
        assert!(!topic_matches("*", ""));
        assert!(topic_matches("", ""));
        assert!(!topic_matches("", "a"));
    }

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
