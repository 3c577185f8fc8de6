//! AMQP 0-9-1 framing: splits the byte stream into frames (without copying
//! payloads) and writes outbound frames. Method payloads are decoded and
//! encoded with `amq-protocol`; content headers stay raw bytes so message
//! properties reach consumers exactly as published.

use crate::nesting::{self, NestingError};
use amq_protocol::frame::{gen_frame, AMQPFrame, WriteContext};
use amq_protocol::protocol::AMQPClass;
use bytes::{Buf, BufMut, Bytes, BytesMut};
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
    match parse_per_message_method(payload) {
        Some(method) => Ok(method),
        None => parse_method_by_amq_protocol(payload),
    }
}

/// The nesting check, then amq-protocol's parser: every method but the
/// per-message ones [`parse_method`] reads itself, and the reference those
/// are checked against (the tests here, the `connection` fuzz target).
pub fn parse_method_by_amq_protocol(payload: &[u8]) -> Result<AMQPClass, MethodError> {
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

/// basic.publish and basic.ack, the methods that come with every message,
/// read without amq-protocol's parser: it builds each string a byte at a
/// time and its flags by name, 4% of the broker's CPU per 16 KiB message.
/// Only a payload that is exactly one well-formed method is taken (they
/// carry no field table, so the nesting check has nothing to look at);
/// anything else, a trailing byte included, is left to amq-protocol, so
/// the answer is the same as its (checked by the tests below and by the
/// `connection` fuzz target).
fn parse_per_message_method(payload: &[u8]) -> Option<AMQPClass> {
    use amq_protocol::protocol::basic;
    match payload {
        // basic.publish: reserved short, exchange, routing key, flags.
        [0, 60, 0, 40, _, _, rest @ ..] => {
            let (exchange, rest) = split_short_str(rest)?;
            let (routing_key, rest) = split_short_str(rest)?;
            let [flags] = rest else { return None };
            Some(AMQPClass::Basic(basic::AMQPMethod::Publish(
                basic::Publish {
                    exchange: exchange.into(),
                    routing_key: routing_key.into(),
                    mandatory: flags & 1 != 0,
                    immediate: flags & 2 != 0,
                },
            )))
        }
        // basic.ack: delivery tag, flags.
        [0, 60, 0, 80, tag @ .., flags] => {
            let tag: [u8; 8] = tag.try_into().ok()?;
            Some(AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: u64::from_be_bytes(tag),
                multiple: flags & 1 != 0,
            })))
        }
        _ => None,
    }
}

/// The `prefetch-size` of a basic.qos method frame's payload, which
/// amq-protocol's parser reads and drops (None for any other method).
/// RabbitMQ refuses a non-zero one; the gateway does the same.
pub fn qos_prefetch_size(payload: &[u8]) -> Option<u32> {
    match payload {
        [0, 60, 0, 10, a, b, c, d, ..] => Some(u32::from_be_bytes([*a, *b, *c, *d])),
        _ => None,
    }
}

/// A short string (length byte, UTF-8 text) off the front of `input`, and
/// what follows it.
fn split_short_str(input: &[u8]) -> Option<(&str, &[u8])> {
    let (&len, rest) = input.split_first()?;
    if rest.len() < usize::from(len) {
        return None;
    }
    let (text, rest) = rest.split_at(usize::from(len));
    Some((std::str::from_utf8(text).ok()?, rest))
}

/// The longest prefix of `text` that fits a short string (255 bytes),
/// ending on a character boundary.
pub fn short_str_prefix(text: &str) -> &str {
    let mut end = text.len().min(255);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The error for field tables nested past the limit, in a method or in a
/// content header's `headers`.
pub fn too_deep_text() -> String {
    NestingError::TooDeep {
        limit: nesting::MAX_NESTING,
    }
    .to_string()
}

/// Body parts at least this long are sent as their own `Bytes` (one more
/// iovec of a vectored write) instead of being copied into the frame buffer;
/// below it, the copy costs less than the extra buffer.
pub const SHARE_BODY_MIN: usize = 2048;
/// A run of small frames between two shared bodies is copied into a segment
/// of its own size when it is at most this long (the frame buffer keeps its
/// capacity); a longer run is handed over as it is.
const COPY_RUN_MAX: usize = 1024;

/// Outbound frames accumulate here until the connection flushes them. Small
/// frames are encoded into one byte buffer; a large body is not copied but
/// kept as a segment of its own, a `Bytes` sharing the engine's allocation
/// ([`FrameWriter::content_shared`]). The bytes to send are then the
/// segments in order ([`FrameWriter::take_segments`]), written with
/// vectored writes.
#[derive(Default)]
pub struct FrameWriter {
    /// Whole segments, in order, before what `buffer` holds.
    segments: Vec<Bytes>,
    /// Frames (or frame heads and ends) not yet sealed into a segment.
    buffer: Vec<u8>,
}

impl FrameWriter {
    pub fn is_empty(&self) -> bool {
        self.buffer.is_empty() && self.segments.is_empty()
    }

    /// Bytes queued, over every segment.
    pub fn len(&self) -> usize {
        self.buffer.len() + self.segments.iter().map(Bytes::len).sum::<usize>()
    }

    /// Everything queued as one contiguous `Bytes` (copied together when
    /// bodies were shared): for the handshake, tests and the load generator.
    pub fn take(&mut self) -> Bytes {
        if self.segments.is_empty() {
            return Bytes::from(std::mem::take(&mut self.buffer));
        }
        let mut all = Vec::with_capacity(self.len());
        for segment in self.segments.drain(..) {
            all.extend_from_slice(&segment);
        }
        all.extend_from_slice(&self.buffer);
        self.buffer.clear();
        Bytes::from(all)
    }

    /// Everything queued, as segments to write in order (none empty).
    pub fn take_segments(&mut self) -> Vec<Bytes> {
        if !self.buffer.is_empty() {
            let rest = Bytes::from(std::mem::take(&mut self.buffer));
            self.segments.push(rest);
        }
        std::mem::take(&mut self.segments)
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

    /// A basic.deliver method frame, written here rather than by
    /// amq-protocol's generator, which allocates its flags by name on every
    /// call (one delivery per message). Strings past 255 bytes are cut at a
    /// character boundary, as [`short_str_prefix`] does.
    pub fn basic_deliver(&mut self, channel: u16, deliver: &BasicDeliver<'_>) {
        let consumer_tag = short_str_prefix(deliver.consumer_tag);
        let exchange = short_str_prefix(deliver.exchange);
        let routing_key = short_str_prefix(deliver.routing_key);
        let size = 4 + 1 + consumer_tag.len() + 8 + 1 + 1 + exchange.len() + 1 + routing_key.len();
        self.buffer.reserve(FRAME_OVERHEAD + size);
        self.frame_start(FRAME_METHOD, channel, size);
        self.buffer.put_u16(60);
        self.buffer.put_u16(60);
        put_short_str(&mut self.buffer, consumer_tag);
        self.buffer.put_u64(deliver.delivery_tag);
        self.buffer.put_u8(u8::from(deliver.redelivered));
        put_short_str(&mut self.buffer, exchange);
        put_short_str(&mut self.buffer, routing_key);
        self.buffer.put_u8(FRAME_END);
    }

    /// A basic.ack method frame (a publisher confirm), written by hand for
    /// the same reason as [`FrameWriter::basic_deliver`].
    pub fn basic_ack(&mut self, channel: u16, delivery_tag: u64, multiple: bool) {
        self.buffer.reserve(FRAME_OVERHEAD + 13);
        self.frame_start(FRAME_METHOD, channel, 13);
        self.buffer.put_u16(60);
        self.buffer.put_u16(80);
        self.buffer.put_u64(delivery_tag);
        self.buffer.put_u8(u8::from(multiple));
        self.buffer.put_u8(FRAME_END);
    }

    /// A content header with raw properties, then the body in frames of at
    /// most `frame_max` bytes, the body copied into the buffer.
    pub fn content(&mut self, channel: u16, properties: &[u8], body: &[u8], frame_max: usize) {
        self.content_header(channel, properties, body.len(), body.len());
        let chunk = body_frame_payload(frame_max);
        for part in body.chunks(chunk) {
            self.frame_start(FRAME_BODY, channel, part.len());
            self.buffer.put_slice(part);
            self.buffer.put_u8(FRAME_END);
        }
    }

    /// As [`FrameWriter::content`], but each body frame's payload of at
    /// least [`SHARE_BODY_MIN`] bytes is a slice of `body`, not a copy.
    pub fn content_shared(
        &mut self,
        channel: u16,
        properties: &[u8],
        body: &Bytes,
        frame_max: usize,
    ) {
        let chunk = body_frame_payload(frame_max);
        let last = body.len() % chunk;
        let copied = if chunk < SHARE_BODY_MIN {
            body.len()
        } else if last < SHARE_BODY_MIN {
            last
        } else {
            0
        };
        self.content_header(channel, properties, body.len(), copied);
        let mut start = 0;
        while start < body.len() {
            let end = body.len().min(start + chunk);
            self.frame_start(FRAME_BODY, channel, end - start);
            if end - start >= SHARE_BODY_MIN {
                self.seal();
                self.segments.push(body.slice(start..end));
            } else {
                self.buffer.put_slice(&body[start..end]);
            }
            self.buffer.put_u8(FRAME_END);
            start = end;
        }
    }

    pub fn heartbeat(&mut self) {
        self.buffer
            .extend_from_slice(&[FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END]);
    }

    /// The content header frame; room is made for the header, the body
    /// frames' heads and ends and the `copied` body bytes that follow.
    fn content_header(&mut self, channel: u16, properties: &[u8], body_len: usize, copied: usize) {
        let header_size = 12 + properties.len();
        self.buffer
            .reserve(FRAME_OVERHEAD * 2 + header_size + copied);
        self.frame_start(FRAME_HEADER, channel, header_size);
        self.buffer.put_u16(60);
        self.buffer.put_u16(0);
        self.buffer.put_u64(body_len as u64);
        self.buffer.put_slice(properties);
        self.buffer.put_u8(FRAME_END);
    }

    /// Ends the current run of buffered bytes as a segment, before a shared
    /// one. A short run is copied out so the buffer keeps its capacity.
    fn seal(&mut self) {
        if self.buffer.is_empty() {
            return;
        }
        let run = if self.buffer.len() <= COPY_RUN_MAX {
            let run = Bytes::copy_from_slice(&self.buffer);
            self.buffer.clear();
            run
        } else {
            Bytes::from(std::mem::take(&mut self.buffer))
        };
        self.segments.push(run);
    }

    fn frame_start(&mut self, kind: u8, channel: u16, size: usize) {
        self.buffer.put_u8(kind);
        self.buffer.put_u16(channel);
        self.buffer.put_u32(size as u32);
    }
}

/// The fields of a basic.deliver ([`FrameWriter::basic_deliver`]).
pub struct BasicDeliver<'a> {
    pub consumer_tag: &'a str,
    pub delivery_tag: u64,
    pub redelivered: bool,
    pub exchange: &'a str,
    pub routing_key: &'a str,
}

/// A short string whose length is known to fit (at most 255 bytes).
fn put_short_str(buffer: &mut Vec<u8>, text: &str) {
    debug_assert!(
        text.len() <= 255,
        "short strings are cut before they are put"
    );
    buffer.put_u8(text.len() as u8);
    buffer.put_slice(text.as_bytes());
}

/// The largest body frame payload under `frame_max`.
fn body_frame_payload(frame_max: usize) -> usize {
    frame_max.saturating_sub(FRAME_OVERHEAD).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::{basic, AMQPClass};

    /// The payload of the one method frame amq-protocol encodes for `method`.
    fn method_payload(method: AMQPClass) -> Vec<u8> {
        let mut out = FrameWriter::default();
        out.method(1, method);
        let bytes = out.take();
        bytes[7..bytes.len() - 1].to_vec()
    }

    fn strings() -> Vec<String> {
        vec![
            String::new(),
            "amq.direct".into(),
            "orders.eu-west.1".into(),
            "ünïcödé ✓".into(),
            "k".repeat(255),
        ]
    }

    /// Every variant of the two methods, and every way of breaking them:
    /// cut short, a byte too many, flags with unknown bits, text that is not
    /// UTF-8. Each gets the answer amq-protocol gives.
    #[test]
    fn publish_and_ack_read_by_hand_as_amq_protocol_reads_them() {
        let mut payloads = Vec::new();
        for exchange in strings() {
            for routing_key in strings() {
                for (mandatory, immediate) in
                    [(false, false), (true, false), (false, true), (true, true)]
                {
                    payloads.push(method_payload(AMQPClass::Basic(
                        basic::AMQPMethod::Publish(basic::Publish {
                            exchange: exchange.as_str().into(),
                            routing_key: routing_key.as_str().into(),
                            mandatory,
                            immediate,
                        }),
                    )));
                }
            }
        }
        for delivery_tag in [0, 1, 0x0102_0304_0506_0708, u64::MAX] {
            for multiple in [false, true] {
                payloads.push(method_payload(AMQPClass::Basic(basic::AMQPMethod::Ack(
                    basic::Ack {
                        delivery_tag,
                        multiple,
                    },
                ))));
            }
        }
        let mut broken = Vec::new();
        for payload in &payloads {
            for len in 0..payload.len() {
                broken.push(payload[..len].to_vec());
            }
            let mut longer = payload.clone();
            longer.push(0);
            broken.push(longer);
            let mut flags = payload.clone();
            if let Some(last) = flags.last_mut() {
                *last = 0xff;
            }
            broken.push(flags);
        }
        // An exchange name that is not UTF-8.
        broken.push(vec![0, 60, 0, 40, 0, 0, 2, 0xc3, 0x28, 0, 0]);
        let mut taken = 0;
        for payload in payloads.iter().chain(&broken) {
            if parse_per_message_method(payload).is_some() {
                taken += 1;
            }
            assert_eq!(
                parse_method(payload),
                parse_method_by_amq_protocol(payload),
                "payload {payload:?}"
            );
        }
        // The well-formed ones (and those with unknown flag bits) take the
        // short way, or this test proves nothing about it.
        assert!(taken >= payloads.len() * 2, "only {taken} read by hand");
    }

    #[test]
    fn deliver_and_ack_written_by_hand_as_amq_protocol_writes_them() {
        let long = format!("{}é", "x".repeat(254));
        let mut texts = strings();
        texts.push(long);
        for text in &texts {
            for (delivery_tag, redelivered) in [(1, false), (u64::MAX, true)] {
                let mut by_hand = FrameWriter::default();
                by_hand.basic_deliver(
                    7,
                    &BasicDeliver {
                        consumer_tag: text,
                        delivery_tag,
                        redelivered,
                        exchange: text,
                        routing_key: "rk",
                    },
                );
                let mut generated = FrameWriter::default();
                generated.method(
                    7,
                    AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                        consumer_tag: short_str_prefix(text).into(),
                        delivery_tag,
                        redelivered,
                        exchange: short_str_prefix(text).into(),
                        routing_key: "rk".into(),
                    })),
                );
                assert_eq!(by_hand.take(), generated.take(), "deliver of {text:?}");
            }
        }
        // Cut at a character boundary: 254 bytes, not half of the é.
        assert_eq!(short_str_prefix(&texts[texts.len() - 1]).len(), 254);
        for (delivery_tag, multiple) in [(0, false), (42, true), (u64::MAX, false)] {
            let mut by_hand = FrameWriter::default();
            by_hand.basic_ack(3, delivery_tag, multiple);
            let mut generated = FrameWriter::default();
            generated.method(
                3,
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag,
                    multiple,
                })),
            );
            assert_eq!(by_hand.take(), generated.take());
        }
    }

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

    fn encoded_properties(properties: &basic::AMQPProperties) -> Vec<u8> {
        basic::gen_properties(properties)(WriteContext::from(Vec::new()))
            .expect("encode properties")
            .write
    }

    fn deliver(writer: &mut FrameWriter, channel: u16, tag: u64) {
        writer.method(
            channel,
            AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: "c".into(),
                delivery_tag: tag,
                redelivered: false,
                exchange: "".into(),
                routing_key: "q".into(),
            })),
        );
    }

    /// Every frame of `bytes` as amq-protocol, the reference, reads it.
    fn reference_frames(mut bytes: &[u8]) -> Vec<AMQPFrame> {
        let mut frames = Vec::new();
        while !bytes.is_empty() {
            let (rest, frame) =
                amq_protocol::frame::parse_frame(bytes).expect("amq-protocol parses the frame");
            bytes = rest;
            frames.push(frame);
        }
        frames
    }

    fn pattern(len: usize, seed: u8) -> Bytes {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<u8>>()
            .into()
    }

    /// Deliveries whose bodies are empty, small, one frame, exactly
    /// frame-max, one byte either side of it and several frames, written
    /// with shared bodies: amq-protocol reads the same deliveries back, no
    /// body frame is over frame-max, and the segments are the same bytes as
    /// the copying writer's.
    #[test]
    fn shared_bodies_round_trip_through_amq_protocol() {
        let properties = basic::AMQPProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/octet-stream".into());
        let raw_properties = encoded_properties(&properties);
        for frame_max in [4096usize, 8192, 131_072] {
            let chunk = frame_max - FRAME_OVERHEAD;
            let sizes = [
                0,
                1,
                SHARE_BODY_MIN - 1,
                SHARE_BODY_MIN,
                chunk - 1,
                chunk,
                chunk + 1,
                chunk + SHARE_BODY_MIN,
                3 * chunk,
                3 * chunk + 7,
                16 * 1024,
            ];
            let bodies: Vec<Bytes> = sizes
                .iter()
                .enumerate()
                .map(|(i, &len)| pattern(len, i as u8))
                .collect();
            let mut shared = FrameWriter::default();
            let mut copied = FrameWriter::default();
            for (tag, body) in bodies.iter().enumerate() {
                for writer in [&mut shared, &mut copied] {
                    deliver(writer, 5, tag as u64 + 1);
                }
                shared.content_shared(5, &raw_properties, body, frame_max);
                copied.content(5, &raw_properties, body, frame_max);
                if tag % 3 == 0 {
                    shared.heartbeat();
                    copied.heartbeat();
                }
            }
            let segments = shared.take_segments();
            assert!(shared.is_empty());
            assert!(segments.iter().all(|segment| !segment.is_empty()));
            let joined: Vec<u8> = segments.iter().flat_map(|s| s.iter().copied()).collect();
            assert_eq!(joined, &copied.take()[..], "frame_max {frame_max}");
            // Parts of at least SHARE_BODY_MIN are the bodies' own memory.
            let shared_parts = segments
                .iter()
                .filter(|segment| {
                    bodies.iter().any(|body| {
                        let range = body.as_ptr_range();
                        range.contains(&segment.as_ptr())
                    })
                })
                .count();
            let expected: usize = bodies
                .iter()
                .map(|body| {
                    body.chunks(chunk)
                        .filter(|part| part.len() >= SHARE_BODY_MIN)
                        .count()
                })
                .sum();
            assert_eq!(shared_parts, expected, "frame_max {frame_max}");
            assert!(expected > 0);

            let mut frames = reference_frames(&joined).into_iter();
            for (tag, body) in bodies.iter().enumerate() {
                let mut frame = frames.next().expect("deliver");
                if matches!(frame, AMQPFrame::Heartbeat) {
                    frame = frames.next().expect("deliver");
                }
                match frame {
                    AMQPFrame::Method(5, AMQPClass::Basic(basic::AMQPMethod::Deliver(deliver))) => {
                        assert_eq!(deliver.delivery_tag, tag as u64 + 1)
                    }
                    other => panic!("expected basic.deliver, got {other:?}"),
                }
                match frames.next().expect("header") {
                    AMQPFrame::Header(5, header) => {
                        assert_eq!(header.body_size, body.len() as u64);
                        assert_eq!(header.properties, properties);
                    }
                    other => panic!("expected a content header, got {other:?}"),
                }
                let mut received = Vec::new();
                while received.len() < body.len() {
                    match frames.next().expect("body frame") {
                        AMQPFrame::Body(5, payload) => {
                            assert!(!payload.is_empty());
                            assert!(payload.len() <= chunk, "body frame over frame_max");
                            received.extend_from_slice(&payload);
                        }
                        other => panic!("expected a body frame, got {other:?}"),
                    }
                }
                assert_eq!(received, &body[..], "body of {} bytes", body.len());
            }
            let rest: Vec<AMQPFrame> = frames.collect();
            assert!(
                rest.iter()
                    .all(|frame| matches!(frame, AMQPFrame::Heartbeat)),
                "{rest:?}"
            );
        }
    }

    /// `take` joins shared segments into the same bytes, and a writer with
    /// nothing shared hands over its one buffer.
    #[test]
    fn take_joins_segments_and_small_frames_stay_one_buffer() {
        let body = pattern(20_000, 9);
        let mut writer = FrameWriter::default();
        deliver(&mut writer, 1, 1);
        writer.content_shared(1, &[0, 0], &body, 8192);
        let len = writer.len();
        let joined = writer.take();
        assert_eq!(joined.len(), len);
        assert!(writer.is_empty());
        let frames = decode_all(&joined, 8192).expect("frames");
        let received: Vec<u8> = frames[2..]
            .iter()
            .flat_map(|frame| frame.payload.iter().copied())
            .collect();
        assert_eq!(received, &body[..]);

        let small = pattern(SHARE_BODY_MIN - 1, 1);
        for tag in 0..10 {
            deliver(&mut writer, 1, tag);
            writer.content_shared(1, &[0, 0], &small, 131_072);
        }
        assert_eq!(
            writer.take_segments().len(),
            1,
            "nothing shared, one segment"
        );
        assert!(writer.take_segments().is_empty());
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
