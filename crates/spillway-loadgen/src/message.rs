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
//! 24..    padding, by `--body` (one kind per process, [`set_body_kind`]):
//!         fill          fill_byte(producer, seq) repeated (the default)
//!         compressible  a 4 KiB text of JSON-like lines, cycled, from an offset
//!                       given by the sequence number (lz4 makes it several times
//!                       smaller, as it would a real text payload)
//!         random        xorshift64 bytes seeded by producer and sequence number
//!                       (incompressible)
//! ```

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// What pads a body past its header (`--body`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BodyKind {
    /// One byte repeated: compresses to almost nothing.
    #[default]
    Fill,
    /// Text-like: compresses several times, as JSON or log lines do.
    Compressible,
    /// Noise: does not compress.
    Random,
}

static BODY_KIND: OnceLock<BodyKind> = OnceLock::new();

/// Sets the padding of every body this process makes and checks (once, at
/// start; later calls are ignored).
pub fn set_body_kind(kind: BodyKind) {
    let _ = BODY_KIND.set(kind);
}

pub fn body_kind() -> BodyKind {
    BODY_KIND.get().copied().unwrap_or_default()
}

/// The compressible padding's period.
const TEXT_LEN: usize = 4096;

/// 4 KiB of JSON-like lines with varying numbers and words.
fn text() -> &'static [u8] {
    static TEXT: OnceLock<Vec<u8>> = OnceLock::new();
    TEXT.get_or_init(|| {
        const WORDS: [&str; 8] = [
            "orders", "payments", "invoices", "shipping", "refunds", "stock", "audit", "mail",
        ];
        let mut text = Vec::with_capacity(TEXT_LEN + 128);
        let mut line = 0u64;
        while text.len() < TEXT_LEN {
            let word = WORDS[(line * 7 % 8) as usize];
            text.extend_from_slice(
                format!(
                    "{{\"line\": {line}, \"queue\": \"{word}\", \"status\": \"ok\", \"amount\": {}.{:02}}}\n",
                    line * 37 % 1000,
                    line * 13 % 100
                )
                .as_bytes(),
            );
            line += 1;
        }
        text.truncate(TEXT_LEN);
        text
    })
}

/// The random padding's generator for one body.
fn xorshift(producer: u32, seq: u64) -> impl Iterator<Item = u8> {
    let mut state = (u64::from(producer) << 40 ^ seq).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    std::iter::repeat_with(move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state.to_le_bytes()
    })
    .flatten()
}

/// Appends `len` bytes of the padding of body (`producer`, `seq`).
fn pad(kind: BodyKind, buf: &mut Vec<u8>, len: usize, producer: u32, seq: u64) {
    match kind {
        BodyKind::Fill => buf.resize(buf.len() + len, fill_byte(producer, seq)),
        BodyKind::Compressible => {
            let text = text();
            buf.extend(text.iter().cycle().skip((seq % 64) as usize * 61).take(len));
        }
        BodyKind::Random => buf.extend(xorshift(producer, seq).take(len)),
    }
}

/// Is `padding` the padding of body (`producer`, `seq`)?
fn padding_matches(kind: BodyKind, padding: &[u8], producer: u32, seq: u64) -> bool {
    match kind {
        BodyKind::Fill => {
            // Folded a chunk at a time rather than `all`, whose early exit
            // keeps the compiler from checking many bytes at once.
            let fill = fill_byte(producer, seq);
            padding
                .chunks(256)
                .all(|chunk| chunk.iter().fold(0u8, |seen, &b| seen | (b ^ fill)) == 0)
        }
        BodyKind::Compressible => padding
            .iter()
            .zip(text().iter().cycle().skip((seq % 64) as usize * 61))
            .all(|(a, b)| a == b),
        BodyKind::Random => padding
            .iter()
            .zip(xorshift(producer, seq))
            .all(|(a, b)| *a == b),
    }
}

/// "SPLG" read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"SPLG");
/// Bytes taken by the header; the smallest valid `--size`.
pub const HEADER_LEN: usize = 24;
/// Highest sequence number accepted on decode (guards the bookkeeping against garbage).
pub const MAX_SEQ: u64 = 1 << 30;

/// The priority `--priorities N` gives message `seq`: spread over 0..N, in no order a
/// queue would keep by itself. Consumers recompute it from the sequence number.
pub fn priority_of(seq: u64, priorities: u8) -> u8 {
    if priorities == 0 {
        return 0;
    }
    ((seq.wrapping_mul(7).wrapping_add(seq / 13)) % u64::from(priorities)) as u8
}

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
    buf.clear();
    encode_append(buf, size, header);
}

/// Appends a complete body of `size` bytes (at least `HEADER_LEN`) to `buf`:
/// the raw client writes it straight into its outbound batch.
pub fn encode_append(buf: &mut Vec<u8>, size: usize, header: Header) {
    let size = size.max(HEADER_LEN);
    buf.reserve(size);
    buf.extend_from_slice(&MAGIC.to_le_bytes());
    buf.extend_from_slice(&header.producer.to_le_bytes());
    buf.extend_from_slice(&header.seq.to_le_bytes());
    buf.extend_from_slice(&header.sent_ns.to_le_bytes());
    pad(
        body_kind(),
        buf,
        size - HEADER_LEN,
        header.producer,
        header.seq,
    );
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
    if !padding_matches(
        body_kind(),
        &body[HEADER_LEN..],
        header.producer,
        header.seq,
    ) {
        return Err(DecodeError::BadPadding);
    }
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_padding_round_trips_and_a_changed_byte_shows() {
        for kind in [BodyKind::Fill, BodyKind::Compressible, BodyKind::Random] {
            for seq in [0u64, 1, 77, 1 << 20] {
                let mut padding = Vec::new();
                pad(kind, &mut padding, 5000, 3, seq);
                assert_eq!(padding.len(), 5000);
                assert!(padding_matches(kind, &padding, 3, seq), "{kind:?} {seq}");
                padding[4321] ^= 1;
                assert!(!padding_matches(kind, &padding, 3, seq), "{kind:?} {seq}");
            }
        }
        assert_eq!(text().len(), TEXT_LEN);
    }

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
