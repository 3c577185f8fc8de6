//! AMQP 0-9-1 framing: splits the byte stream into frames (without copying
//! payloads) and writes outbound frames. Method payloads are decoded and
//! encoded with `amq-protocol`; content headers stay raw bytes so message
//! properties reach consumers exactly as published.

use amq_protocol::frame::{gen_frame, AMQPFrame, WriteContext};
use amq_protocol::protocol::AMQPClass;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use spillway_proto::amqp::nesting::{self, NestingError};
use tokio_util::codec::Decoder;

pub const FRAME_METHOD: u8 = 1;
pub const FRAME_HEADER: u8 = 2;
pub const FRAME_BODY: u8 = 3;
pub const FRAME_HEARTBEAT: u8 = 8;
pub const FRAME_END: u8 = 0xCE;
/// Type, channel and size before the payload, and the end octet after it.
pub const FRAME_OVERHEAD: usize = 8;
/// The smallest frame-max a peer may negotiate (spec 4.2.3).
pub const MIN_FRAME_MAX: u32 = 4096;
pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";

/// One frame off the wire, payload not yet decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct RawFrame {
    pub kind: u8,
    pub channel: u16,
    pub payload: Bytes,
}

/// Why the byte stream cannot be read as frames. Each maps to the
/// connection-close the spec asks for.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FrameError {
    #[error("frame of {size} bytes exceeds the negotiated frame-max of {max}")]
    TooLarge { size: usize, max: usize },
    #[error("frame does not end with 0xCE")]
    BadFrameEnd,
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    #[error("i/o: {0}")]
    Io(String),
}

impl From<std::io::Error> for FrameError {
    fn from(error: std::io::Error) -> Self {
        FrameError::Io(error.to_string())
    }
}

/// Splits the inbound stream into [`RawFrame`]s, enforcing frame-max.
pub struct FrameDecoder {
    /// Largest whole frame accepted (payload + overhead).
    pub frame_max: usize,
}

impl Decoder for FrameDecoder {
    type Item = RawFrame;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<RawFrame>, FrameError> {
        if src.len() < 7 {
            return Ok(None);
        }
        let kind = src[0];
        if !matches!(
            kind,
            FRAME_METHOD | FRAME_HEADER | FRAME_BODY | FRAME_HEARTBEAT
        ) {
            return Err(FrameError::UnknownType(kind));
        }
        let channel = u16::from_be_bytes([src[1], src[2]]);
        let size = u32::from_be_bytes([src[3], src[4], src[5], src[6]]) as usize;
        let total = size.saturating_add(FRAME_OVERHEAD);
        if total > self.frame_max {
            return Err(FrameError::TooLarge {
                size: total,
                max: self.frame_max,
            });
        }
        if src.len() < total {
            src.reserve(total - src.len());
            return Ok(None);
        }
        if src[total - 1] != FRAME_END {
            return Err(FrameError::BadFrameEnd);
        }
        src.advance(7);
        let payload = src.split_to(size).freeze();
        src.advance(1);
        Ok(Some(RawFrame {
            kind,
            channel,
            payload,
        }))
    }
}

/// A content header's fields; `properties` are kept raw.
#[derive(Debug, Clone)]
pub struct ContentHeader {
    pub class_id: u16,
    pub body_size: u64,
    pub properties: Bytes,
}

pub fn parse_content_header(payload: &Bytes) -> Option<ContentHeader> {
    if payload.len() < 14 {
        return None;
    }
    let class_id = u16::from_be_bytes([payload[0], payload[1]]);
    let mut size = [0u8; 8];
    size.copy_from_slice(&payload[4..12]);
    Some(ContentHeader {
        class_id,
        body_size: u64::from_be_bytes(size),
        properties: payload.slice(12..),
    })
}

/// Why a method frame could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MethodError {
    /// Its field tables nest deeper than [`nesting::MAX_NESTING`]: refused
    /// before the (recursive) parser runs, so no stack can overflow.
    TooDeep,
    /// Not a method amq-protocol can parse.
    Unparsable,
}

pub fn parse_method(payload: &[u8]) -> Result<AMQPClass, MethodError> {
    match nesting::check_method(payload, nesting::MAX_NESTING) {
        Ok(()) => {}
        Err(NestingError::TooDeep { .. }) => return Err(MethodError::TooDeep),
        Err(NestingError::Malformed) => return Err(MethodError::Unparsable),
    }
    match amq_protocol::protocol::parse_class(payload) {
        Ok((_, class)) => Ok(class),
        Err(_) => Err(MethodError::Unparsable),
    }
}

/// The error for field tables nested past the limit, in a method or in a
/// content header's `headers`.
pub fn too_deep_text() -> String {
    NestingError::TooDeep {
        limit: nesting::MAX_NESTING,
    }
    .to_string()
}

/// Outbound frames accumulate here until the connection flushes them.
#[derive(Default)]
pub struct FrameWriter {
    buffer: Vec<u8>,
}

impl FrameWriter {
    pub fn is_empty(&self) -> bool {
        self.buffer.is_empty()
    }

    pub fn take(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.buffer))
    }

    pub fn method(&mut self, channel: u16, method: AMQPClass) {
        let frame = AMQPFrame::Method(channel, method);
        let context = WriteContext::from(std::mem::take(&mut self.buffer));
        let result = gen_frame(&frame)(context);
        match result {
            Ok(context) => self.buffer = context.write,
            // Generating into a Vec only fails on a string over 255 bytes,
            // which every caller's input is bounded by.
            Err(error) => tracing::error!(%error, "could not encode a method frame"),
        }
    }

    /// A content header with raw properties, then the body in frames of at
    /// most `frame_max` bytes.
    pub fn content(&mut self, channel: u16, properties: &[u8], body: &[u8], frame_max: usize) {
        let header_size = 12 + properties.len();
        self.buffer
            .reserve(FRAME_OVERHEAD * 2 + header_size + body.len());
        self.frame_start(FRAME_HEADER, channel, header_size);
        self.buffer.put_u16(60);
        self.buffer.put_u16(0);
        self.buffer.put_u64(body.len() as u64);
        self.buffer.put_slice(properties);
        self.buffer.put_u8(FRAME_END);
        let chunk = frame_max.saturating_sub(FRAME_OVERHEAD).max(1);
        for part in body.chunks(chunk) {
            self.frame_start(FRAME_BODY, channel, part.len());
            self.buffer.put_slice(part);
            self.buffer.put_u8(FRAME_END);
        }
    }

    pub fn heartbeat(&mut self) {
        self.buffer
            .extend_from_slice(&[FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END]);
    }

    fn frame_start(&mut self, kind: u8, channel: u16, size: usize) {
        self.buffer.put_u8(kind);
        self.buffer.put_u16(channel);
        self.buffer.put_u32(size as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::{basic, AMQPClass};

    fn decode_all(bytes: &[u8], frame_max: usize) -> Result<Vec<RawFrame>, FrameError> {
        let mut decoder = FrameDecoder { frame_max };
        let mut src = BytesMut::from(bytes);
        let mut frames = Vec::new();
        while let Some(frame) = decoder.decode(&mut src)? {
            frames.push(frame);
        }
        Ok(frames)
    }

    #[test]
    fn content_round_trips_through_amq_protocol() {
        let mut writer = FrameWriter::default();
        writer.method(
            3,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "x".into(),
                routing_key: "k".into(),
                ..Default::default()
            })),
        );
        let properties = basic::AMQPProperties::default().with_delivery_mode(2);
        let mut raw_properties = Vec::new();
        let context = WriteContext::from(raw_properties);
        raw_properties = basic::gen_properties(&properties)(context)
            .expect("encode properties")
            .write;
        writer.content(3, &raw_properties, &[7u8; 10_000], 4096);
        let bytes = writer.take();
        let frames = decode_all(&bytes, 4096).expect("frames");
        assert_eq!(frames.len(), 2 + 3, "method, header, three body frames");
        let header = parse_content_header(&frames[1].payload).expect("header");
        assert_eq!(header.body_size, 10_000);
        assert_eq!(&header.properties[..], &raw_properties[..]);
        // amq-protocol, the reference, reads the same bytes the same way.
        let (_, parsed) = amq_protocol::frame::parse_frame(&bytes[..]).expect("reference parse");
        assert!(matches!(parsed, AMQPFrame::Method(3, _)));
        let body: usize = frames[2..].iter().map(|f| f.payload.len()).sum();
        assert_eq!(body, 10_000);
    }

    #[test]
    fn oversized_and_malformed_frames_are_rejected() {
        let mut frame = vec![FRAME_BODY, 0, 1, 0, 0, 0x20, 0];
        frame.extend(vec![0u8; 0x2000]);
        frame.push(FRAME_END);
        assert!(matches!(
            decode_all(&frame, 4096),
            Err(FrameError::TooLarge { .. })
        ));
        let bad_end = [FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, 0x00];
        assert_eq!(decode_all(&bad_end, 4096), Err(FrameError::BadFrameEnd));
        assert_eq!(
            decode_all(b"GET / HTTP/1.1\r\n", 4096),
            Err(FrameError::UnknownType(b'G'))
        );
    }
}
