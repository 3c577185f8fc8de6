//! Publish assembly: a basic.publish method, then its content header, then
//! body frames, become one engine `Publish` command. Here the gateway
//! enforces the largest message size, checks the `user_id` property against
//! the authenticated user, numbers publisher confirms, and spends the
//! overdraft a connection blocked by producer flow control has left.
//!
//! Nothing is reserved from the size a content header announces: a body
//! grows as its frames arrive (doubling, never past the announced size), and
//! what the bodies of all channels hold is counted per connection, which is
//! closed with 506 RESOURCE_ERROR past `gateway.max_unfinished_content`.

use amq_protocol::protocol::basic;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use foldhash::HashMap;
use spillway_amqp::nesting::{self, NestingError};
use spillway_amqp::properties::PublishProperties;
use spillway_amqp::{reply_code, MethodId};
use spillway_proto::body::{Body, ENCODING_IDENTITY};
use spillway_proto::engine::{self as pb, session_command::Command, SessionCommand};

use super::{command, Channel, ChannelPhase, Connection, ConnectionError, Enforced};
use spillway_amqp::codec::{self, FrameWriter, RawFrame};

/// The class id content headers carry for basic (the only class with content).
const BASIC_CLASS: u16 = MethodId::BASIC_PUBLISH.class_id;

/// A publish waiting for its content header and body.
pub(super) struct PendingPublish {
    exchange: String,
    routing_key: String,
    mandatory: bool,
    header: Option<codec::ContentHeader>,
    body: PendingBody,
}

impl PendingPublish {
    pub(super) fn new(method: basic::Publish, unfinished: UnfinishedContent) -> Self {
        Self {
            exchange: method.exchange.into(),
            routing_key: method.routing_key.into(),
            mandatory: method.mandatory,
            header: None,
            body: PendingBody::new(unfinished),
        }
    }
}

/// Bytes held by the partly received bodies of one connection, and of the
/// whole gateway. Shared by the connection's pending publishes, each of
/// which takes its own bytes out again when it is finished or dropped (a
/// channel closed mid-message).
#[derive(Clone, Debug, Default)]
pub(super) struct UnfinishedContent {
    connection: Arc<AtomicU64>,
    /// Every connection's, counted against the memory ceiling.
    gateway: Arc<AtomicU64>,
}

impl UnfinishedContent {
    pub(super) fn counted_in(gateway: Arc<AtomicU64>) -> Self {
        Self {
            connection: Arc::default(),
            gateway,
        }
    }

    pub(super) fn bytes(&self) -> u64 {
        self.connection.load(Ordering::Relaxed)
    }

    fn add(&self, bytes: u64) {
        self.connection.fetch_add(bytes, Ordering::Relaxed);
        self.gateway.fetch_add(bytes, Ordering::Relaxed);
    }

    fn sub(&self, bytes: u64) {
        self.connection.fetch_sub(bytes, Ordering::Relaxed);
        self.gateway.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// A body being received, counted in its connection's [`UnfinishedContent`]
/// by what it has allocated.
struct PendingBody {
    /// A whole body lent from the read buffer instead of copied.
    lent: Option<Bytes>,
    bytes: Vec<u8>,
    counted: u64,
    unfinished: UnfinishedContent,
}

impl PendingBody {
    fn new(unfinished: UnfinishedContent) -> Self {
        Self {
            lent: None,
            bytes: Vec::new(),
            counted: 0,
            unfinished,
        }
    }

    fn len(&self) -> usize {
        match &self.lent {
            Some(lent) => lent.len(),
            None => self.bytes.len(),
        }
    }

    /// Appends one frame's payload. The buffer doubles as frames arrive but
    /// never grows past `body_size`, so it holds at most twice what was
    /// received (plus a frame), whatever size was announced.
    fn append(&mut self, payload: &[u8], body_size: u64) {
        let needed = self.bytes.len() + payload.len();
        if needed > self.bytes.capacity() {
            let announced = usize::try_from(body_size).unwrap_or(usize::MAX);
            let target = needed.max(announced.min(self.bytes.capacity().saturating_mul(2)));
            self.bytes.reserve_exact(target - self.bytes.len());
        }
        self.bytes.extend_from_slice(payload);
        self.recount();
    }

    /// The body, no longer counted as unfinished.
    fn finish(&mut self) -> Bytes {
        if let Some(lent) = self.lent.take() {
            return lent;
        }
        let bytes = std::mem::take(&mut self.bytes);
        self.recount();
        Bytes::from(bytes)
    }

    fn recount(&mut self) {
        let now = self.bytes.capacity() as u64;
        if now >= self.counted {
            self.unfinished.add(now - self.counted);
        } else {
            self.unfinished.sub(self.counted - now);
        }
        self.counted = now;
    }
}

impl Drop for PendingBody {
    fn drop(&mut self) {
        self.unfinished.sub(self.counted);
    }
}

impl Connection {
    pub(super) fn on_content_header(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let channel_id = frame.channel;
        let max_message_size = self.config.settings.max_message_size;
        let Some(channel) = content_channel(&mut self.channels, channel_id)? else {
            return Ok(());
        };
        let Some(publish) = channel.publish.as_mut() else {
            return Err(ConnectionError::new(
                reply_code::UNEXPECTED_FRAME,
                format!("content header on channel {channel_id} without a basic.publish"),
            ));
        };
        if publish.header.is_some() {
            return Err(ConnectionError::new(
                reply_code::UNEXPECTED_FRAME,
                format!("second content header on channel {channel_id}"),
            ));
        }
        let Some(header) = codec::parse_content_header(&frame.payload) else {
            return Err(ConnectionError::new(
                reply_code::FRAME_ERROR,
                "malformed content header",
            ));
        };
        if let Err(NestingError::TooDeep { .. }) =
            nesting::check_content_header(&frame.payload, nesting::MAX_NESTING)
        {
            return Err(ConnectionError::new(
                reply_code::FRAME_ERROR,
                codec::too_deep_text(),
            ));
        }
        if header.class_id != BASIC_CLASS {
            return Err(ConnectionError::new(
                reply_code::FRAME_ERROR,
                "content header for a class other than basic",
            ));
        }
        if header.body_size > max_message_size {
            let text = format!(
                "message size {} is larger than configured max size {}",
                header.body_size, max_message_size
            );
            channel.publish = None;
            self.close_channel(
                channel_id,
                reply_code::PRECONDITION_FAILED,
                &text,
                MethodId::BASIC_PUBLISH,
                out,
                commands,
            );
            return Ok(());
        }
        let complete = header.body_size == 0;
        publish.header = Some(header);
        if complete {
            self.finish_publish(channel_id, out, commands)?;
        }
        Ok(())
    }

    pub(super) fn on_content_body(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let channel_id = frame.channel;
        let Some(channel) = content_channel(&mut self.channels, channel_id)? else {
            return Ok(());
        };
        let Some(PendingPublish {
            header: Some(header),
            body,
            ..
        }) = channel.publish.as_mut()
        else {
            return Err(ConnectionError::new(
                reply_code::UNEXPECTED_FRAME,
                format!("content body on channel {channel_id} without a content header"),
            ));
        };
        if (body.len() + frame.payload.len()) as u64 > header.body_size {
            return Err(ConnectionError::new(
                reply_code::FRAME_ERROR,
                format!("content body on channel {channel_id} longer than its header's size"),
            ));
        }
        // A body in one frame may be lent rather than copied: it is whole,
        // so it is never counted as unfinished.
        let whole = body.len() == 0 && frame.payload.len() as u64 == header.body_size;
        match whole
            .then(|| self.lender.lend(&frame.payload, self.read_chunk))
            .flatten()
        {
            Some(lent) => body.lent = Some(lent),
            None => body.append(&frame.payload, header.body_size),
        }
        let complete = body.len() as u64 == header.body_size;
        let unfinished = self.unfinished.bytes();
        // One message of the largest size always fits.
        let limit = self
            .config
            .settings
            .max_unfinished_content
            .max(self.config.settings.max_message_size);
        if !complete && unfinished > limit {
            return Err(ConnectionError::new(
                reply_code::RESOURCE_ERROR,
                format!(
                    "partly received message bodies on this connection take {unfinished} bytes, over the limit of {limit} (gateway.max_unfinished_content)"
                ),
            )
            .on(MethodId::BASIC_PUBLISH)
            .enforcing(Enforced::UnfinishedContent));
        }
        if complete {
            self.finish_publish(channel_id, out, commands)?;
        }
        Ok(())
    }

    /// The whole message is in: check it and hand it to the engine.
    fn finish_publish(
        &mut self,
        channel_id: u16,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let Some(channel) = self.channels.get_mut(&channel_id) else {
            return Ok(());
        };
        let Some(PendingPublish {
            exchange,
            routing_key,
            mandatory,
            header: Some(header),
            mut body,
        }) = channel.publish.take()
        else {
            return Ok(());
        };
        if self.is_blocked() {
            self.overdraft_left = self.overdraft_left.saturating_sub(header.body_size.max(1));
        }
        let properties = match PublishProperties::read(&header.properties) {
            Ok(properties) => properties,
            Err(error) => {
                self.close_channel(
                    channel_id,
                    error.reply_code(),
                    &error.to_string(),
                    MethodId::BASIC_PUBLISH,
                    out,
                    commands,
                );
                return Ok(());
            }
        };
        if let Some(user_id) = properties.user_id {
            if user_id != self.negotiated.user {
                let text = format!(
                    "user_id property set to '{}' but authenticated user was '{}'",
                    user_id, self.negotiated.user
                );
                self.close_channel(
                    channel_id,
                    reply_code::PRECONDITION_FAILED,
                    &text,
                    MethodId::BASIC_PUBLISH,
                    out,
                    commands,
                );
                return Ok(());
            }
        }
        let Some(channel) = self.channels.get_mut(&channel_id) else {
            return Ok(());
        };
        let confirm_seq = if channel.confirm {
            channel.confirm_seq += 1;
            channel.confirm_seq
        } else {
            0
        };
        let span = tracing::trace_span!(target: spillway_proto::util::trace::TARGET, "publish",
            exchange = %exchange, routing_key = %routing_key);
        // Compressed here, once, when it is large and worth it: the engine,
        // its budget, flow to disk and the store then hold fewer bytes.
        let body = body.finish();
        let (body, body_encoding, body_size) = match self.config.settings.compress_above() {
            Some(threshold) => Body::compress_above(body, threshold).wire(),
            None => {
                let size = body.len() as u64;
                (body, ENCODING_IDENTITY, size)
            }
        };
        commands.push(command(Command::Publish(pb::Publish {
            trace_context: spillway_proto::util::trace::carrier(&span),
            channel: u32::from(channel_id),
            exchange,
            routing_key,
            mandatory,
            // The header's properties are a slice of the socket's read
            // buffer: copied, so a queued message does not keep it alive.
            properties: Bytes::copy_from_slice(&header.properties),
            body,
            body_encoding,
            body_size,
            confirm_seq,
            persistent: properties.persistent,
            expiration_ms: properties.expiration_ms,
        })));
        Ok(())
    }
}

/// The channel a content frame belongs to; None when the frame is to be
/// discarded (the channel is closing). A function of the channels alone, so
/// that the caller may use the connection's other fields meanwhile.
fn content_channel(
    channels: &mut HashMap<u16, Channel>,
    channel_id: u16,
) -> Result<Option<&mut Channel>, ConnectionError> {
    match channels.get_mut(&channel_id) {
        None => Err(ConnectionError::new(
            reply_code::CHANNEL_ERROR,
            format!("content frame on channel {channel_id}, which is not open"),
        )),
        Some(channel) if channel.phase != ChannelPhase::Open => Ok(None),
        Some(channel) => Ok(Some(channel)),
    }
}
