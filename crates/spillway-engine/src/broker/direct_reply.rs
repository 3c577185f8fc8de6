//! Direct reply-to, as RabbitMQ documents it: an RPC client consumes from
//! the pseudo-queue `amq.rabbitmq.reply-to` (no-ack only) and publishes its
//! requests with `reply_to: amq.rabbitmq.reply-to`; the broker rewrites that
//! to `amq.rabbitmq.reply-to.<token>`, a name for this channel; a server's
//! reply to that name on the default exchange goes straight to the client's
//! consumer. No queue is declared and nothing is stored.
//!
//! A reply to a name whose channel is gone (or never was) is unroutable:
//! returned if mandatory, as RabbitMQ 3.10 does, else dropped; confirmed to
//! its publisher either way. A reply to a client that is not reading what
//! it was sent (its delivery credit spent) is dropped: replies are not
//! queued for it, which keeps what one slow client costs bounded (RabbitMQ
//! buffers them in the client's channel process). The token is random, so a name cannot be guessed from
//! another.

use amq_protocol::protocol::basic::{parse_properties, AMQPProperties};
use rand::distr::{Alphanumeric, SampleString};
use spillway_amqp::reply_code;
use spillway_proto::engine::{self as pb, session_event::Event, AmqpError};

use super::{event, Broker, OpResult};
use crate::channels::DirectReplyConsumer;
use crate::model::{ChannelId, SessionId};

/// The pseudo-queue an RPC client consumes from, and the `reply_to` it
/// publishes with.
pub const PSEUDO_QUEUE: &str = "amq.rabbitmq.reply-to";
/// How the name the broker hands out begins: the pseudo-queue and a dot.
const NAME_PREFIX: &str = "amq.rabbitmq.reply-to.";
/// The `reply-to` bit of a content header's property flags.
const REPLY_TO_FLAG: u16 = 0x0200;

/// What became of a publish to the default exchange, for direct reply-to.
pub(super) enum ReplyOutcome {
    /// Not addressed to a reply-to name: routed as usual.
    NotAReply,
    /// Delivered to its client, or dropped because the client is not reading.
    Handled,
    /// No live reply-to name: returned if mandatory, as RabbitMQ does.
    NoRoute,
}

impl Broker {
    /// basic.consume on [`PSEUDO_QUEUE`]: no-ack only, one per channel.
    pub(super) fn consume_direct_reply(
        &mut self,
        session: SessionId,
        cmd: &pb::Consume,
        tag: String,
    ) -> OpResult<String> {
        if !cmd.no_ack {
            return Err(AmqpError::new(
                reply_code::PRECONDITION_FAILED,
                "reply consumer cannot acknowledge",
            ));
        }
        let channel = self.channel_mut(session, cmd.channel)?;
        if channel.direct_reply.is_some() {
            return Err(AmqpError::new(
                reply_code::PRECONDITION_FAILED,
                "reply consumer already set",
            ));
        }
        let token = Alphanumeric.sample_string(&mut rand::rng(), 24);
        channel.direct_reply = Some(DirectReplyConsumer {
            tag: tag.clone(),
            token: token.clone(),
        });
        self.reply_routes.insert(token, (session, cmd.channel));
        Ok(tag)
    }

    /// basic.cancel of the channel's direct reply-to consumer: true if it
    /// was that one.
    pub(super) fn cancel_direct_reply(
        &mut self,
        session: SessionId,
        channel: ChannelId,
        tag: &str,
    ) -> bool {
        let Ok(state) = self.channel_mut(session, channel) else {
            return false;
        };
        if state.direct_reply.as_ref().is_none_or(|c| c.tag != tag) {
            return false;
        }
        if let Some(consumer) = state.direct_reply.take() {
            self.reply_routes.remove(&consumer.token);
        }
        true
    }

    /// Forgets a closed channel's reply-to name.
    pub(super) fn forget_direct_reply(&mut self, consumer: Option<DirectReplyConsumer>) {
        if let Some(consumer) = consumer {
            self.reply_routes.remove(&consumer.token);
        }
    }

    /// A publish with `reply_to: amq.rabbitmq.reply-to` gets this channel's
    /// name in its place; without a reply consumer on the channel it is
    /// refused (406, RabbitMQ's words).
    pub(super) fn resolve_reply_to(
        &self,
        session: SessionId,
        cmd: &mut pb::Publish,
    ) -> OpResult<()> {
        let Some(properties) = asks_direct_reply(&cmd.properties) else {
            return Ok(());
        };
        let token = self
            .sessions
            .get(&session)
            .and_then(|s| s.channels.get(&cmd.channel))
            .and_then(|c| c.direct_reply.as_ref())
            .map(|c| c.token.as_str());
        let Some(token) = token else {
            return Err(AmqpError::new(
                reply_code::PRECONDITION_FAILED,
                "fast reply consumer does not exist",
            ));
        };
        let properties = properties.with_reply_to(format!("{NAME_PREFIX}{token}").into());
        if let Some(encoded) = super::dead_letter::encode_properties(&properties) {
            cmd.properties = encoded;
        }
        Ok(())
    }

    /// A publish to a reply-to name on the default exchange: handed to the
    /// channel's reply consumer, or dropped, or (no such name) unroutable.
    pub(super) fn deliver_reply(&mut self, cmd: &pb::Publish) -> ReplyOutcome {
        if !cmd.exchange.is_empty() {
            return ReplyOutcome::NotAReply;
        }
        let Some(token) = cmd.routing_key.strip_prefix(NAME_PREFIX) else {
            return ReplyOutcome::NotAReply;
        };
        let Some(&(session, channel)) = self.reply_routes.get(token) else {
            return ReplyOutcome::NoRoute;
        };
        let Some(state) = self.sessions.get_mut(&session) else {
            return ReplyOutcome::NoRoute;
        };
        if !state.credit.has_room() {
            tracing::debug!(
                session,
                channel,
                "direct reply dropped: the client is not reading"
            );
            return ReplyOutcome::Handled;
        }
        let Some(channel_state) = state.channels.get_mut(&channel) else {
            return ReplyOutcome::NoRoute;
        };
        let Some(consumer_tag) = channel_state.direct_reply.as_ref().map(|c| c.tag.clone()) else {
            return ReplyOutcome::NoRoute;
        };
        let body = cmd.body();
        state.credit.spend(body.size() as usize);
        let delivery_tag = channel_state.take_delivery_tag();
        let deliver = pb::Deliver {
            trace_context: Default::default(),
            channel,
            consumer_tag,
            delivery_tag,
            redelivered: false,
            exchange: String::new(),
            routing_key: cmd.routing_key.clone(),
            properties: cmd.properties.clone(),
            body: cmd.body.clone(),
            body_encoding: cmd.body_encoding,
            body_size: cmd.body_size,
        };
        let _ = state.events.send(event(Event::Deliver(deliver)));
        ReplyOutcome::Handled
    }

    /// Whether `name` is the pseudo-queue or a live reply-to name (a
    /// passive declare of it succeeds while its consumer is there, as in
    /// RabbitMQ).
    pub(super) fn reply_name_is_live(&self, name: &str) -> bool {
        name == PSEUDO_QUEUE
            || name
                .strip_prefix(NAME_PREFIX)
                .is_some_and(|token| self.reply_routes.contains_key(token))
    }
}

/// The parsed properties of a publish whose `reply_to` is the pseudo-queue;
/// None for every other (most are told by one flag bit, unparsed).
fn asks_direct_reply(properties: &[u8]) -> Option<AMQPProperties> {
    let flags = u16::from_be_bytes([*properties.first()?, *properties.get(1)?]);
    if flags & REPLY_TO_FLAG == 0 {
        return None;
    }
    let (_, parsed) = parse_properties(properties).ok()?;
    (parsed.reply_to().as_ref()?.as_str() == PSEUDO_QUEUE).then_some(parsed)
}
