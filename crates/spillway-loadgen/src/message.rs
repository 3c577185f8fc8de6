//! Message body layout.
//!
//! Every body starts with a fixed 24-byte little-endian header and is padded to `--size`
//! bytes with a byte derived from the producer id and the sequence number, so that a
//! truncated, mixed-up or corrupted body is detected on the consumer side.
//!
//! ```text
//! 0..4    magic "SPLG" (0x474c5053 little-endian)
//! 4..8    producer id (u32)
//! 8..16   sequence number (u64), 0-based, per producer
//! 16..24  send timestamp, nanoseconds since the Unix epoch (u64)
//! 24..    padding: fill_byte(producer, seq) repeated
//! ```

use std::time::{SystemTime, UNIX_EPOCH};

/// "SPLG" read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"SPLG");
/// Bytes taken by the header; the smallest valid `--size`.
pub const HEADER_LEN: usize = 24;
/// Highest sequence number accepted on decode (guards the bookkeeping against garbage).
pub const MAX_SEQ: u64 = 1 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub producer: u32,
    pub seq: u64,
    pub sent_ns: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    TooShort,
    BadMagic,
    WrongSize,
    BadPadding,
    SeqOutOfRange,
}

fn fill_byte(producer: u32, seq: u64) -> u8 {
    (seq as u8) ^ (producer as u8).rotate_left(3) ^ 0xA5
}

/// Nanoseconds since the Unix epoch (wall clock, comparable across processes on one host).
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Writes a complete body of `size` bytes (at least `HEADER_LEN`) into `buf`.
pub fn encode_into(buf: &mut Vec<u8>, size: usize, header: Header) {
    let size = size.max(HEADER_LEN);
    buf.clear();
    buf.reserve(size);
    buf.extend_from_slice(&MAGIC.to_le_bytes());
    buf.extend_from_slice(&header.producer.to_le_bytes());
    buf.extend_from_slice(&header.seq.to_le_bytes());
    buf.extend_from_slice(&header.sent_ns.to_le_bytes());
    buf.resize(size, fill_byte(header.producer, header.seq));
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// Decodes and checks a body. `expected_size`, when given, must match the body length.
pub fn decode(body: &[u8], expected_size: Option<usize>) -> Result<Header, DecodeError> {
    if body.len() < HEADER_LEN {
        return Err(DecodeError::TooShort);
    }
    if le_u32(&body[0..4]) != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    if let Some(size) = expected_size {
        if body.len() != size.max(HEADER_LEN) {
            return Err(DecodeError::WrongSize);
        }
    }
    let header = Header {
        producer: le_u32(&body[4..8]),
        seq: le_u64(&body[8..16]),
        sent_ns: le_u64(&body[16..24]),
    };
    if header.seq > MAX_SEQ {
        return Err(DecodeError::SeqOutOfRange);
    }
    let fill = fill_byte(header.producer, header.seq);
    if !body[HEADER_LEN..].iter().all(|&b| b == fill) {
        return Err(DecodeError::BadPadding);
    }
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_padding() {
        let mut buf = Vec::new();
        let h = Header {
            producer: 7,
            seq: 123_456,
            sent_ns: 42,
        };
        encode_into(&mut buf, 1024, h);
        assert_eq!(buf.len(), 1024);
        assert_eq!(decode(&buf, Some(1024)), Ok(h));
        assert_eq!(decode(&buf, None), Ok(h));
        assert_eq!(decode(&buf, Some(512)), Err(DecodeError::WrongSize));
    }

    #[test]
    fn minimum_size_is_header() {
        let mut buf = Vec::new();
        let h = Header {
            producer: 1,
            seq: 2,
            sent_ns: 3,
        };
        encode_into(&mut buf, 0, h);
        assert_eq!(buf.len(), HEADER_LEN);
        assert_eq!(decode(&buf, Some(0)), Ok(h));
    }

    #[test]
    fn detects_corruption() {
        let mut buf = Vec::new();
        encode_into(
            &mut buf,
            100,
            Header {
                producer: 3,
                seq: 9,
                sent_ns: 1,
            },
        );
        let mut bad = buf.clone();
        bad[99] ^= 1;
        assert_eq!(decode(&bad, Some(100)), Err(DecodeError::BadPadding));
        let mut bad = buf.clone();
        bad[0] = b'X';
        assert_eq!(decode(&bad, Some(100)), Err(DecodeError::BadMagic));
        // A body whose header says seq 10 but whose padding was made for seq 9.
        let mut bad = buf.clone();
        bad[8] = 10;
        assert_eq!(decode(&bad, Some(100)), Err(DecodeError::BadPadding));
        assert_eq!(decode(&buf[..10], None), Err(DecodeError::TooShort));
    }
}
