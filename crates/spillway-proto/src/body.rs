//! Message bodies as the broker holds them: the bytes, how they are encoded
//! (as published, or lz4-compressed) and the size the client published.
//!
//! The gateway compresses a large body as it is published
//! (`gateway.message_compression_enabled`, above
//! `gateway.message_compression_threshold_size`; see
//! `docs/compression.md`) and decompresses it as it is delivered, so clients
//! see exactly the bytes they published. In between, the engine, its memory
//! budget, flow to disk and the storage node carry the compressed bytes as
//! they are: on the gRPC boundaries and in stored records a body is three
//! fields, `body`, `body_encoding` and `body_size` ([`Body::from_wire`],
//! [`Body::wire`]).
//!
//! Decoding is bounded and never panics: the declared size is checked against
//! the caller's largest message size (and against what lz4 can expand the
//! bytes to) before anything is allocated, and the output must be exactly
//! the declared size.

use bytes::Bytes;

/// `body_encoding` on the wire and in stored records: the body is the
/// published bytes. What records written before compression existed read as
/// (the field's default).
pub const ENCODING_IDENTITY: u32 = 0;
/// `body_encoding`: an lz4 block (no frame, no size prefix) that decodes to
/// exactly `body_size` bytes.
pub const ENCODING_LZ4: u32 = 1;

/// A body is compressed only when that saves at least 1/`MIN_SAVING_DIVISOR`
/// of it: a smaller saving is not worth decompressing at every delivery.
const MIN_SAVING_DIVISOR: usize = 8;

/// The most an lz4 block expands: each byte of a block yields at most 255
/// bytes of output (a match length byte of 255), plus the literals of the
/// last sequence. A declared size beyond this cannot be right, and is refused
/// before allocating.
const LZ4_MAX_RATIO: u64 = 255;

/// How a body is held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Encoding {
    /// As published.
    #[default]
    Identity,
    /// An lz4 block.
    Lz4,
    /// A value this build does not know (a newer peer, or corruption):
    /// decoding it is an error.
    Unknown(u32),
}

impl Encoding {
    pub fn from_wire(value: u32) -> Self {
        match value {
            ENCODING_IDENTITY => Self::Identity,
            ENCODING_LZ4 => Self::Lz4,
            other => Self::Unknown(other),
        }
    }

    pub fn wire(self) -> u32 {
        match self {
            Self::Identity => ENCODING_IDENTITY,
            Self::Lz4 => ENCODING_LZ4,
            Self::Unknown(other) => other,
        }
    }
}

/// Why a body could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BodyError {
    #[error("compressed body declares {size} bytes, over the largest message size {max}")]
    TooLarge { size: u64, max: u64 },
    #[error("compressed body of {stored} bytes cannot decode to the {size} bytes it declares")]
    Implausible { stored: u64, size: u64 },
    #[error("corrupt compressed body: {0}")]
    Corrupt(String),
    #[error("compressed body decoded to {actual} bytes, not the {size} it declares")]
    SizeMismatch { size: u64, actual: u64 },
    #[error("unknown body encoding {0}")]
    UnknownEncoding(u32),
}

/// A message body: its bytes as held, their encoding, and the size of the
/// body as published (what `decode` gives back).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Body {
    bytes: Bytes,
    encoding: Encoding,
    size: u64,
}

impl Body {
    /// A body held as published.
    pub fn identity(bytes: Bytes) -> Self {
        Self {
            size: bytes.len() as u64,
            bytes,
            encoding: Encoding::Identity,
        }
    }

    /// From the three wire fields. An identity body's size is its length,
    /// whatever `size` says (records written before compression existed
    /// have none); a compressed body's declared size is checked when it is
    /// decoded.
    pub fn from_wire(bytes: Bytes, encoding: u32, size: u64) -> Self {
        match Encoding::from_wire(encoding) {
            Encoding::Identity => Self::identity(bytes),
            encoding => Self {
                bytes,
                encoding,
                size,
            },
        }
    }

    /// The three wire fields: bytes as held, encoding, size as published.
    pub fn wire(&self) -> (Bytes, u32, u64) {
        (self.bytes.clone(), self.encoding.wire(), self.size)
    }

    /// `published` compressed with lz4 when it is longer than `threshold`
    /// bytes and that makes it at least an eighth smaller; otherwise as it
    /// is. The compressed bytes are in an allocation of their own, of their
    /// own size.
    pub fn compress_above(published: Bytes, threshold: u64) -> Self {
        if published.len() as u64 <= threshold || published.len() < MIN_SAVING_DIVISOR {
            return Self::identity(published);
        }
        let mut compressed = lz4_flex::block::compress(&published);
        let worth = compressed.len() <= published.len() - published.len() / MIN_SAVING_DIVISOR;
        if !worth {
            return Self::identity(published);
        }
        compressed.shrink_to_fit();
        Self {
            size: published.len() as u64,
            bytes: Bytes::from(compressed),
            encoding: Encoding::Lz4,
        }
    }

    /// The bytes as held (compressed or not): what memory and disk hold.
    pub fn stored(&self) -> &Bytes {
        &self.bytes
    }

    /// Length of the bytes as held.
    pub fn stored_len(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// The size of the body as published (declared, for a compressed body).
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn encoding(&self) -> Encoding {
        self.encoding
    }

    pub fn is_compressed(&self) -> bool {
        self.encoding != Encoding::Identity
    }

    /// The body as published. A compressed body must declare at most
    /// `max_size` bytes and decode to exactly what it declares.
    pub fn decode(&self, max_size: u64) -> Result<Bytes, BodyError> {
        match self.encoding {
            Encoding::Identity => Ok(self.bytes.clone()),
            Encoding::Unknown(other) => Err(BodyError::UnknownEncoding(other)),
            Encoding::Lz4 => {
                let size = self.size;
                if size > max_size {
                    return Err(BodyError::TooLarge {
                        size,
                        max: max_size,
                    });
                }
                let stored = self.stored_len();
                if size > stored.saturating_mul(LZ4_MAX_RATIO).saturating_add(16) {
                    return Err(BodyError::Implausible { stored, size });
                }
                let len =
                    usize::try_from(size).map_err(|_| BodyError::Implausible { stored, size })?;
                let mut out = vec![0u8; len];
                let written = lz4_flex::block::decompress_into(&self.bytes, &mut out)
                    .map_err(|error| BodyError::Corrupt(error.to_string()))?;
                if written != len {
                    return Err(BodyError::SizeMismatch {
                        size,
                        actual: written as u64,
                    });
                }
                Ok(Bytes::from(out))
            }
        }
    }
}

impl crate::engine::Publish {
    /// The published body, with its encoding.
    pub fn body(&self) -> Body {
        Body::from_wire(self.body.clone(), self.body_encoding, self.body_size)
    }

    /// Sets the three body fields.
    pub fn set_body(&mut self, body: &Body) {
        (self.body, self.body_encoding, self.body_size) = body.wire();
    }
}

impl crate::engine::Deliver {
    pub fn body(&self) -> Body {
        Body::from_wire(self.body.clone(), self.body_encoding, self.body_size)
    }
}

impl crate::engine::GetOk {
    pub fn body(&self) -> Body {
        Body::from_wire(self.body.clone(), self.body_encoding, self.body_size)
    }
}

impl crate::engine::Return {
    pub fn body(&self) -> Body {
        Body::from_wire(self.body.clone(), self.body_encoding, self.body_size)
    }
}

impl crate::storage::MessageRecord {
    /// The stored body, with its encoding; a record written before
    /// compression existed reads as identity.
    pub fn body(&self) -> Body {
        Body::from_wire(self.body.clone(), self.body_encoding, self.body_size)
    }

    /// Sets the three body fields.
    pub fn set_body(&mut self, body: &Body) {
        (self.body, self.body_encoding, self.body_size) = body.wire();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: u64 = 128 << 20;

    fn compressible(len: usize) -> Bytes {
        (0..len)
            .map(|i| b"spillway compresses this "[i % 25])
            .collect::<Vec<u8>>()
            .into()
    }

    /// xorshift: bytes lz4 cannot shrink.
    fn random(len: usize, mut seed: u64) -> Bytes {
        (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect::<Vec<u8>>()
            .into()
    }

    #[test]
    fn compressible_bodies_above_the_threshold_shrink_and_round_trip() {
        let published = compressible(64 * 1024);
        let body = Body::compress_above(published.clone(), 16 * 1024);
        assert_eq!(body.encoding(), Encoding::Lz4);
        assert!(body.stored_len() < published.len() as u64 / 10);
        assert_eq!(body.size(), published.len() as u64);
        assert_eq!(body.decode(MAX), Ok(published.clone()));
        let (bytes, encoding, size) = body.wire();
        assert_eq!(Body::from_wire(bytes, encoding, size), body);
    }

    #[test]
    fn small_and_incompressible_bodies_stay_as_published() {
        let small = compressible(1000);
        let body = Body::compress_above(small.clone(), 16 * 1024);
        assert_eq!(body, Body::identity(small.clone()));
        assert_eq!(body.decode(MAX), Ok(small));
        let noise = random(64 * 1024, 7);
        let body = Body::compress_above(noise.clone(), 16 * 1024);
        assert!(!body.is_compressed());
        assert_eq!(body.stored(), &noise);
        assert_eq!(
            Body::compress_above(Bytes::new(), 0).decode(0),
            Ok(Bytes::new())
        );
    }

    #[test]
    fn identity_records_without_size_read_as_published() {
        let body = Body::from_wire(Bytes::from_static(b"old"), 0, 0);
        assert_eq!(body.size(), 3);
        assert_eq!(body.decode(0), Ok(Bytes::from_static(b"old")));
    }

    #[test]
    fn bad_compressed_bodies_are_errors() {
        let published = compressible(20_000);
        let good = Body::compress_above(published.clone(), 0);
        let (bytes, _, size) = good.wire();
        // Over the largest message size: refused before decoding.
        assert!(matches!(
            good.decode(size - 1),
            Err(BodyError::TooLarge { .. })
        ));
        // A declared size the bytes cannot reach.
        let huge = Body::from_wire(bytes.clone(), ENCODING_LZ4, u64::MAX);
        assert!(matches!(
            huge.decode(u64::MAX),
            Err(BodyError::Implausible { .. })
        ));
        // Declared too small or too large by one.
        for wrong in [size - 1, size + 1] {
            let body = Body::from_wire(bytes.clone(), ENCODING_LZ4, wrong);
            assert!(body.decode(MAX).is_err(), "size {wrong} accepted");
        }
        // Truncated and garbled.
        let cut = Body::from_wire(bytes.slice(..bytes.len() / 2), ENCODING_LZ4, size);
        assert!(cut.decode(MAX).is_err());
        let garbage = Body::from_wire(random(300, 3), ENCODING_LZ4, 5000);
        assert!(garbage.decode(MAX).is_err());
        let unknown = Body::from_wire(bytes, 9, size);
        assert_eq!(unknown.decode(MAX), Err(BodyError::UnknownEncoding(9)));
    }
}
