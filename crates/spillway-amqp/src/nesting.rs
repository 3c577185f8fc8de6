//! Bounds the nesting of AMQP field tables and arrays *before* a recursive
//! parser sees them.
//!
//! amq-protocol parses a field table by recursion, one stack frame chain per
//! nested table or array. A client that nests tables 18,000 deep in one
//! `connection.start-ok` overflows the worker's stack and aborts the whole
//! process. The checks here walk the same bytes with an explicit stack, so
//! their cost does not depend on the nesting, and refuse anything deeper than
//! a limit. They decide depth and structure only; what the values mean is left
//! to the real parser.
//!
//! Every place a client can put a field table is covered: the method
//! arguments of `start-ok` (client properties), `start` (a server's method,
//! which the parser reads from a client all the same), `exchange.declare`/`bind`/
//! `unbind`, `queue.declare`/`bind`/`unbind` and `basic.consume`
//! ([`check_method`]); the `headers` property of a content header
//! ([`check_content_header`]); and an AMQPLAIN response, a table without its
//! length prefix ([`check_table_entries`]). `crate::decode_table` runs
//! [`check_table`] on the table bytes components send each other.

use super::MethodId;

/// How deep tables and arrays may nest (the outermost table is level 1).
/// RabbitMQ's own clients never go past a handful of levels.
pub const MAX_NESTING: usize = 64;

/// Why a field table was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NestingError {
    #[error("field tables nested deeper than {limit} levels")]
    TooDeep { limit: usize },
    #[error("malformed field table")]
    Malformed,
}

/// Checks the field table that the method in `payload` carries, if it
/// carries one. `payload` is a method frame's payload: class id, method id,
/// then the arguments. A payload too short to reach its table is left to the
/// method parser, which refuses it without recursing.
pub fn check_method(payload: &[u8], limit: usize) -> Result<(), NestingError> {
    let Some(method) = MethodId::from_payload(payload) else {
        return Ok(());
    };
    // Where the table starts: the fields before it, in order.
    use Field::*;
    let before: &[Field] = match method {
        // A server's method, but amq-protocol parses it from a client too.
        MethodId::CONNECTION_START => &[Octet, Octet],
        MethodId::CONNECTION_START_OK => &[],
        MethodId::EXCHANGE_DECLARE => &[Short, ShortString, ShortString, Octet],
        MethodId::EXCHANGE_BIND | MethodId::EXCHANGE_UNBIND | MethodId::QUEUE_BIND => {
            &[Short, ShortString, ShortString, ShortString, Octet]
        }
        MethodId::QUEUE_UNBIND => &[Short, ShortString, ShortString, ShortString],
        MethodId::QUEUE_DECLARE => &[Short, ShortString, Octet],
        MethodId::BASIC_CONSUME => &[Short, ShortString, ShortString, Octet],
        _ => return Ok(()),
    };
    let mut reader = Reader::new(payload, 4);
    for field in before {
        if reader.skip(*field).is_err() {
            return Ok(());
        }
    }
    check_table(&payload[reader.position..], limit).map(|_| ())
}

/// Checks the `headers` property of a content header frame's payload (class
/// id, weight, body size, property flags, properties).
pub fn check_content_header(payload: &[u8], limit: usize) -> Result<(), NestingError> {
    const CONTENT_TYPE: u16 = 1 << 15;
    const CONTENT_ENCODING: u16 = 1 << 14;
    const HEADERS: u16 = 1 << 13;
    let mut reader = Reader::new(payload, 12);
    let Ok(flags) = reader.u16() else {
        return Ok(());
    };
    if flags & HEADERS == 0 {
        return Ok(());
    }
    for (flag, field) in [
        (CONTENT_TYPE, Field::ShortString),
        (CONTENT_ENCODING, Field::ShortString),
    ] {
        if flags & flag != 0 && reader.skip(field).is_err() {
            return Ok(());
        }
    }
    check_table(&payload[reader.position..], limit).map(|_| ())
}

/// Checks a field table that starts with its 4-byte length; returns how many
/// bytes it takes.
pub fn check_table(bytes: &[u8], limit: usize) -> Result<usize, NestingError> {
    let mut reader = Reader::new(bytes, 0);
    let length = reader.u32()?;
    let end = reader.advance(length)?;
    walk(bytes, 4, end, limit)?;
    Ok(end)
}

/// Checks the entries of a field table given without its length prefix (the
/// form an AMQPLAIN response takes).
pub fn check_table_entries(bytes: &[u8], limit: usize) -> Result<(), NestingError> {
    walk(bytes, 0, bytes.len(), limit)
}

#[derive(Debug, Clone, Copy)]
enum Field {
    Octet,
    Short,
    ShortString,
}

/// One table or array being walked: where it ends and whether its entries
/// have names.
struct Level {
    end: usize,
    named: bool,
}

/// Walks the entries of a table from `start` to `end` without recursion.
fn walk(bytes: &[u8], start: usize, end: usize, limit: usize) -> Result<(), NestingError> {
    if limit == 0 {
        return Err(NestingError::TooDeep { limit });
    }
    let mut levels = vec![Level { end, named: true }];
    let mut reader = Reader::new(&bytes[..end], start);
    while let Some(level) = levels.last() {
        if reader.position == level.end {
            levels.pop();
            continue;
        }
        let level_end = level.end;
        if level.named {
            reader.skip(Field::ShortString)?;
        }
        let value_type = reader.u8()?;
        let fixed = match value_type {
            b'V' => 0,
            b't' | b'b' | b'B' => 1,
            b's' | b'U' | b'u' => 2,
            b'I' | b'i' | b'f' => 4,
            b'D' => 5,
            b'L' | b'l' | b'd' | b'T' => 8,
            b'S' | b'x' => {
                let length = reader.u32()?;
                reader.advance(length)?;
                0
            }
            b'F' | b'A' => {
                let length = reader.u32()?;
                let inner_end = reader.position + length as usize;
                if inner_end > level_end {
                    return Err(NestingError::Malformed);
                }
                if levels.len() >= limit {
                    return Err(NestingError::TooDeep { limit });
                }
                levels.push(Level {
                    end: inner_end,
                    named: value_type == b'F',
                });
                0
            }
            _ => return Err(NestingError::Malformed),
        };
        reader.advance(fixed)?;
        if reader.position > level_end {
            return Err(NestingError::Malformed);
        }
    }
    Ok(())
}

/// A cursor that never reads past the end of its bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    position: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], position: usize) -> Self {
        Self { bytes, position }
    }

    /// Moves past `count` bytes; returns the new position.
    fn advance(&mut self, count: impl TryInto<usize>) -> Result<usize, NestingError> {
        let count = count.try_into().map_err(|_| NestingError::Malformed)?;
        let next = self
            .position
            .checked_add(count)
            .filter(|next| *next <= self.bytes.len())
            .ok_or(NestingError::Malformed)?;
        self.position = next;
        Ok(next)
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], NestingError> {
        let start = self.position;
        self.advance(N)?;
        let mut out = [0; N];
        out.copy_from_slice(&self.bytes[start..start + N]);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, NestingError> {
        Ok(self.take::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, NestingError> {
        Ok(u16::from_be_bytes(self.take()?))
    }

    fn u32(&mut self) -> Result<u32, NestingError> {
        Ok(u32::from_be_bytes(self.take()?))
    }

    fn skip(&mut self, field: Field) -> Result<(), NestingError> {
        match field {
            Field::Octet => self.advance(1usize),
            Field::Short => self.advance(2usize),
            Field::ShortString => {
                let length = self.u8()?;
                self.advance(length)
            }
        }
        .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};

    fn encoded(table: &FieldTable) -> Vec<u8> {
        let context = amq_protocol::frame::WriteContext::from(Vec::new());
        match amq_protocol::types::generation::gen_field_table(table)(context) {
            Ok(context) => context.write,
            Err(error) => panic!("encode: {error}"),
        }
    }

    /// A table nested `depth` levels deep, alternating tables and arrays.
    fn nested(depth: usize) -> FieldTable {
        let mut value = AMQPValue::LongString(LongString::from("leaf"));
        for level in 1..depth {
            value = if level % 2 == 0 {
                let mut inner = FieldTable::default();
                inner.insert(ShortString::from("k"), value);
                AMQPValue::FieldTable(inner)
            } else {
                AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Boolean(true), value]))
            };
        }
        let mut table = FieldTable::default();
        table.insert(ShortString::from("top"), value);
        table
    }

    /// Bytes of a table nested `depth` deep, written straight out (the
    /// encoder, like the parser, recurses): each level is one entry named
    /// "k" holding the next table.
    fn deep_bytes(depth: usize) -> Vec<u8> {
        // A table of level i takes 4 + 7 * (i - 1) bytes.
        let mut bytes = Vec::with_capacity(7 * depth);
        for level in (2..=depth).rev() {
            let content = 7 * (level - 1) as u32;
            bytes.extend_from_slice(&content.to_be_bytes());
            bytes.extend_from_slice(&[1, b'k', b'F']);
        }
        bytes.extend_from_slice(&[0, 0, 0, 0]);
        bytes
    }

    #[test]
    fn tables_within_the_limit_pass_and_report_their_length() {
        for depth in [1, 2, 10, MAX_NESTING] {
            let bytes = encoded(&nested(depth));
            assert_eq!(check_table(&bytes, MAX_NESTING), Ok(bytes.len()), "{depth}");
        }
    }

    #[test]
    fn tables_past_the_limit_are_refused_without_recursion() {
        let too_deep = encoded(&nested(MAX_NESTING + 1));
        assert_eq!(
            check_table(&too_deep, MAX_NESTING),
            Err(NestingError::TooDeep { limit: MAX_NESTING })
        );
        // Deep enough to overflow any recursive parser.
        let bytes = deep_bytes(200_000);
        assert_eq!(
            check_table(&bytes, MAX_NESTING),
            Err(NestingError::TooDeep { limit: MAX_NESTING })
        );
    }

    #[test]
    fn lengths_that_overrun_are_malformed() {
        let mut bytes = encoded(&nested(3));
        let last = bytes.len() - 1;
        bytes.truncate(last);
        assert_eq!(
            check_table(&bytes, MAX_NESTING),
            Err(NestingError::Malformed)
        );
        assert_eq!(
            check_table(&[0, 0], MAX_NESTING),
            Err(NestingError::Malformed)
        );
        // An inner table that claims more than its parent holds.
        let bad = [0, 0, 0, 7, 1, b'k', b'F', 0, 0, 0, 9];
        assert_eq!(check_table(&bad, MAX_NESTING), Err(NestingError::Malformed));
        let unknown_type = [0, 0, 0, 3, 1, b'k', b'?'];
        assert_eq!(
            check_table(&unknown_type, MAX_NESTING),
            Err(NestingError::Malformed)
        );
    }

    #[test]
    fn methods_are_checked_where_their_table_is() {
        let deep = deep_bytes(1000);
        // start-ok: client properties come first.
        let mut start_ok = vec![0, 10, 0, 11];
        start_ok.extend_from_slice(&deep);
        assert!(check_method(&start_ok, MAX_NESTING).is_err());
        // queue.declare: reserved short, queue name, flags, arguments.
        // start: a server's method, yet parsed when a client sends it.
        let mut start = vec![0, 10, 0, 10, 0, 9];
        start.extend_from_slice(&deep);
        assert!(check_method(&start, MAX_NESTING).is_err());
        let mut declare = vec![0, 50, 0, 10, 0, 0, 1, b'q', 0];
        declare.extend_from_slice(&deep);
        assert!(check_method(&declare, MAX_NESTING).is_err());
        let mut fine = vec![0, 50, 0, 10, 0, 0, 1, b'q', 0];
        fine.extend_from_slice(&encoded(&nested(5)));
        assert_eq!(check_method(&fine, MAX_NESTING), Ok(()));
        // A method without a table, and one too short to reach it.
        assert_eq!(check_method(&[0, 60, 0, 40, 0, 0], MAX_NESTING), Ok(()));
        assert_eq!(check_method(&[0, 50, 0, 10, 0], MAX_NESTING), Ok(()));
    }

    #[test]
    fn content_headers_are_checked_after_type_and_encoding() {
        let deep = deep_bytes(1000);
        let mut header = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5];
        header.extend_from_slice(&(0xE000u16).to_be_bytes());
        header.extend_from_slice(&[4, b't', b'e', b'x', b't', 0]);
        let mut refused = header.clone();
        refused.extend_from_slice(&deep);
        assert!(check_content_header(&refused, MAX_NESTING).is_err());
        let mut fine = header;
        fine.extend_from_slice(&encoded(&nested(3)));
        assert_eq!(check_content_header(&fine, MAX_NESTING), Ok(()));
        // No headers property: nothing to check.
        let plain = [0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0x10, 0, 2];
        assert_eq!(check_content_header(&plain, MAX_NESTING), Ok(()));
    }

    #[test]
    fn amqplain_entries_are_checked_without_a_length() {
        let deep = deep_bytes(1000);
        assert!(check_table_entries(&deep[4..], MAX_NESTING).is_err());
        let fine = encoded(&nested(4));
        assert_eq!(check_table_entries(&fine[4..], MAX_NESTING), Ok(()));
    }

    /// Random mutations of valid tables: the checker never panics, and
    /// whatever it accepts the real parser can parse without running deep.
    #[test]
    fn random_bytes_never_panic_and_accepted_tables_parse() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let samples: Vec<Vec<u8>> = (1..12).map(|depth| encoded(&nested(depth))).collect();
        for round in 0..20_000 {
            let mut bytes = samples[round % samples.len()].clone();
            for _ in 0..(next() % 4 + 1) {
                let at = (next() as usize) % bytes.len();
                bytes[at] = next() as u8;
            }
            if next() % 5 == 0 {
                let keep = (next() as usize) % bytes.len();
                bytes.truncate(keep);
            }
            if check_table(&bytes, 16).is_ok() {
                // Accepted bytes nest at most 16 deep: parsing them is safe.
                let _ = amq_protocol::types::parsing::parse_field_table(&bytes[..]);
            }
        }
    }
}
