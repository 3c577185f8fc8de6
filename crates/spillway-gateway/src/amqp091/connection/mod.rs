//! One client connection after the handshake: the connection and channel
//! state machines that turn frames into engine commands and engine events
//! into frames. No I/O happens here: frames come in through
//! [`Connection::on_frame`], events through [`Connection::on_event`], and
//! outbound frames collect in a [`FrameWriter`] that the I/O loop
//! (`amqp091/io.rs`) flushes.
//!
//! This module owns the channel table, the requests waiting for the engine,
//! and producer flow-control state. The parts live beside it:
//! - [`handshake`]: connection.start … connection.open;
//! - `commands`: which engine command each channel method becomes;
//! - `publish`: assembling publish + content header + body into one message;
//! - `render`: engine events and replies → frames.

mod commands;
pub mod error;
pub mod handshake;
mod publish;
mod render;

#[cfg(test)]
mod tests;

use foldhash::{HashMap, HashMapExt};
use std::net::SocketAddr;

use amq_protocol::protocol::{channel as chan, connection as conn, AMQPClass};
use amq_protocol::types::ShortString;
use spillway_amqp::{closes_only_the_channel, encode_table, reply_code, reply_text, MethodId};
use spillway_proto::engine::{self as pb, session_command::Command, SessionCommand};

use crate::GatewayConfig;
use commands::Translation;
pub use error::{ConnectionError, Enforced};
pub use handshake::{Capabilities, Handshake, HandshakeStep, Negotiated};
use publish::{PendingPublish, UnfinishedContent};
use spillway_amqp::codec::{self, FrameWriter, RawFrame};

/// What the I/O loop should do after a frame or event.
#[derive(Debug, PartialEq)]
pub enum Next {
    Continue,
    /// The client asked to close; close-ok is queued: flush and hang up.
    Closed,
}

#[derive(PartialEq)]
enum ChannelPhase {
    Open,
    /// We sent channel.close; waiting for the client's close-ok.
    ClosingByServer,
    /// Our channel.close and the client's crossed, and we answered the
    /// client's with close-ok. The spec (and RabbitMQ) still wait for the
    /// client's close-ok to ours; a client that took our close-ok as the
    /// end may instead open the channel again, which starts it anew.
    ClosingCrossed,
    /// The client sent channel.close; waiting for the engine before close-ok.
    ClosingByClient,
}

struct Channel {
    phase: ChannelPhase,
    publish: Option<PendingPublish>,
    confirm: bool,
    confirm_seq: u64,
}

/// What a request sent to the engine is waiting to answer.
#[derive(Clone)]
struct Pending {
    channel: u16,
    /// The method that asked, named if the engine refuses it.
    method: MethodId,
    nowait: bool,
    answer: Answer,
}

/// How to answer the client once the engine replies to a request.
#[derive(Clone)]
enum Answer {
    Session,
    ChannelOpen,
    ChannelCloseByClient,
    /// The engine released a channel we closed; nothing to tell the client.
    ChannelReleased,
    ExchangeDeclare,
    ExchangeDelete,
    ExchangeBind,
    ExchangeUnbind,
    QueueDeclare,
    QueueBind,
    QueueUnbind,
    QueuePurge,
    QueueDelete,
    Consume,
    Cancel(String),
    Recover,
    Qos,
    Get,
    ConfirmSelect,
    TxSelect,
    TxCommit,
    TxRollback,
}

pub struct Connection {
    config: std::sync::Arc<GatewayConfig>,
    negotiated: Negotiated,
    peer: SocketAddr,
    channels: HashMap<u16, Channel>,
    pending: HashMap<u64, Pending>,
    next_request: u64,
    /// Channels whose engine-side release is still under way: events for
    /// them belong to the closed incarnation and are dropped.
    releasing: HashMap<u16, u32>,
    /// Deliveries written into `out` since the last flush (engine credit).
    pub deliveries: u32,
    /// Producer flow control: why the engine blocks this connection, and
    /// since when.
    flow_blocked: Option<(String, std::time::Instant)>,
    /// The gateway's own process is past its memory ceiling and this
    /// connection publishes ([`Connection::set_memory_blocked`]): why, and
    /// since when. Blocks like the engine's flow control; the client hears
    /// one `connection.blocked` for both.
    memory_blocked: Option<(String, std::time::Instant)>,
    /// Body bytes the client may still publish while blocked before the
    /// gateway stops reading its socket.
    overdraft_left: u64,
    /// Bytes held by partly received message bodies, over all channels.
    unfinished: UnfinishedContent,
    /// The client has sent a `basic.publish`: past the memory ceiling its
    /// socket is not read ([`Connection::has_published`]).
    has_published: bool,
    /// Lends one-frame bodies out of the read buffer (none by default).
    lender: crate::body_loans::BodyLender,
    /// The read-buffer allocation the frame being handled was split from,
    /// when known ([`Connection::set_read_chunk`]).
    read_chunk: Option<crate::read_room::ReadChunk>,
}

impl Connection {
    pub fn new(
        config: std::sync::Arc<GatewayConfig>,
        negotiated: Negotiated,
        peer: SocketAddr,
    ) -> Self {
        Self {
            config,
            negotiated,
            peer,
            channels: HashMap::new(),
            pending: HashMap::new(),
            next_request: 1,
            releasing: HashMap::new(),
            deliveries: 0,
            flow_blocked: None,
            memory_blocked: None,
            overdraft_left: 0,
            unfinished: UnfinishedContent::default(),
            has_published: false,
            lender: crate::body_loans::BodyLender::default(),
            read_chunk: None,
        }
    }

    /// Lends bodies that come in one frame instead of copying them, within
    /// the gateway-wide limit of `loans` ([`crate::body_loans`]).
    pub fn lend_bodies(&mut self, loans: std::sync::Arc<crate::body_loans::BodyLoans>) {
        self.lender = crate::body_loans::BodyLender::new(loans);
    }

    /// Counts partly received bodies in `gateway` too (the gateway-wide
    /// figure the memory ceiling reads), from now on.
    pub fn count_unfinished_in(&mut self, gateway: std::sync::Arc<std::sync::atomic::AtomicU64>) {
        debug_assert_eq!(self.unfinished.bytes(), 0, "counted before any body");
        self.unfinished = UnfinishedContent::counted_in(gateway);
    }

    /// The client has published: a producer, which the memory ceiling
    /// holds back (RabbitMQ's memory alarm blocks publishing connections
    /// the same way, and lets the others read and ack).
    pub fn has_published(&self) -> bool {
        self.has_published
    }

    /// The read-buffer allocation the next frames handled were split from;
    /// `None` when not known (their bodies are copied).
    pub fn set_read_chunk(&mut self, chunk: Option<crate::read_room::ReadChunk>) {
        self.read_chunk = chunk;
    }

    /// Bytes held by partly received message bodies, over all channels.
    pub fn unfinished_content(&self) -> u64 {
        self.unfinished.bytes()
    }

    /// Blocked by producer flow control and out of overdraft: stop reading
    /// the socket (TCP back-pressure) until unblocked.
    pub fn reading_paused(&self) -> bool {
        self.is_blocked() && self.overdraft_left == 0
    }

    fn is_blocked(&self) -> bool {
        self.flow_blocked.is_some() || self.memory_blocked.is_some()
    }

    /// Since when, and why, the connection is blocked (the engine's reason
    /// first).
    pub fn blocked(&self) -> Option<(&str, std::time::Instant)> {
        self.flow_blocked
            .as_ref()
            .or(self.memory_blocked.as_ref())
            .map(|(reason, since)| (reason.as_str(), *since))
    }

    /// Held back by the gateway's memory ceiling (its socket is looked at
    /// again until this clears).
    pub fn memory_blocked(&self) -> bool {
        self.memory_blocked.is_some()
    }

    /// The gateway process's memory ceiling, as it stands now: past it, a
    /// connection that has published is blocked as by the engine's flow
    /// control (told so, a last overdraft, then not read); back under, it
    /// is released unless the engine still blocks it.
    pub fn set_memory_blocked(
        &mut self,
        over: Option<spillway_telemetry::OverCeiling>,
        out: &mut FrameWriter,
    ) {
        let over = over.filter(|_| self.has_published);
        if over.is_some() == self.memory_blocked.is_some() {
            return;
        }
        let reason = over.map(|over| over.to_string());
        self.change_blocked(out, |connection| {
            let now = connection.config.clock.now();
            connection.memory_blocked = reason.map(|reason| (reason, now));
        });
    }

    /// Applies `change` to the blocking state and tells the client when the
    /// connection as a whole went from free to blocked or back.
    fn change_blocked(&mut self, out: &mut FrameWriter, change: impl FnOnce(&mut Self)) {
        let was_blocked = self.is_blocked();
        change(self);
        let tell = self.negotiated.capabilities.connection_blocked;
        match (
            was_blocked,
            self.blocked().map(|(reason, _)| reason.to_string()),
        ) {
            (false, Some(reason)) => {
                tracing::debug!(peer = %self.peer, %reason, "connection blocked");
                self.overdraft_left = self.config.settings.blocked_overdraft;
                if tell {
                    out.method(
                        0,
                        AMQPClass::Connection(conn::AMQPMethod::Blocked(conn::Blocked {
                            reason: short(&reason),
                        })),
                    );
                }
            }
            (true, None) => {
                tracing::debug!(peer = %self.peer, "connection unblocked");
                if tell {
                    out.method(
                        0,
                        AMQPClass::Connection(conn::AMQPMethod::Unblocked(conn::Unblocked {})),
                    );
                }
            }
            _ => {}
        }
    }

    /// The client was sent connection.blocked and not yet connection.unblocked.
    /// Clients such as lapin then send nothing at all, heartbeats included.
    pub fn client_told_blocked(&self) -> bool {
        self.is_blocked() && self.negotiated.capabilities.connection_blocked
    }

    fn on_flow_control(&mut self, flow: pb::FlowControl, out: &mut FrameWriter) {
        if flow.blocked == self.flow_blocked.is_some() {
            return;
        }
        self.change_blocked(out, |connection| {
            let now = connection.config.clock.now();
            connection.flow_blocked = flow.blocked.then_some((flow.reason, now));
        });
    }

    pub fn frame_max(&self) -> u32 {
        self.negotiated.frame_max
    }

    pub fn heartbeat(&self) -> u16 {
        self.negotiated.heartbeat
    }

    /// Channels open on this connection, including ones being closed.
    pub fn channel_count(&self) -> usize {
        self.channels.len()
    }

    /// The first command of the session.
    pub fn open_session(&mut self) -> SessionCommand {
        let request_id = self.track(0, MethodId::CONNECTION_OPEN, false, Answer::Session);
        command(Command::Open(pb::OpenSession {
            request_id,
            vhost: self.negotiated.vhost.clone(),
            user: self.negotiated.user.clone(),
            client_address: self.peer.to_string(),
            client_properties: encode_table(&self.negotiated.client_properties),
        }))
    }

    /// Records a request about to be sent; returns its id.
    fn track(&mut self, channel: u16, method: MethodId, nowait: bool, answer: Answer) -> u64 {
        let request_id = self.next_request;
        self.next_request += 1;
        self.pending.insert(
            request_id,
            Pending {
                channel,
                method,
                nowait,
                answer,
            },
        );
        request_id
    }

    /// Handles one inbound frame; returns the commands for the engine.
    pub fn on_frame(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<Next, ConnectionError> {
        match frame.kind {
            codec::FRAME_HEARTBEAT => {
                if frame.channel != 0 {
                    return Err(ConnectionError::new(
                        reply_code::FRAME_ERROR,
                        "heartbeat frame on a non-zero channel",
                    ));
                }
                Ok(Next::Continue)
            }
            codec::FRAME_METHOD => {
                let method = match codec::parse_method(&frame.payload) {
                    Ok(method) => method,
                    Err(codec::MethodError::TooDeep) => return Err(too_deep(&frame.payload)),
                    Err(codec::MethodError::Unparsable) => {
                        return Err(unparsable_method(&frame.payload))
                    }
                };
                if frame.channel == 0 {
                    return self.on_connection_method(method, out);
                }
                // RabbitMQ implements no byte prefetch and refuses one;
                // accepting it would promise a limit that is not kept.
                if let Some(size @ 1..) = codec::qos_prefetch_size(&frame.payload) {
                    return Err(ConnectionError::new(
                        reply_code::NOT_IMPLEMENTED,
                        format!("prefetch_size!=0 ({size})"),
                    )
                    .on(MethodId::BASIC_QOS));
                }
                self.on_channel_method(frame.channel, method, out, commands)?;
                Ok(Next::Continue)
            }
            codec::FRAME_HEADER => {
                self.on_content_header(frame, out, commands)?;
                Ok(Next::Continue)
            }
            codec::FRAME_BODY => {
                self.on_content_body(frame, out, commands)?;
                Ok(Next::Continue)
            }
            other => Err(ConnectionError::new(
                reply_code::FRAME_ERROR,
                format!("unknown frame type {other}"),
            )),
        }
    }

    fn on_connection_method(
        &mut self,
        method: AMQPClass,
        out: &mut FrameWriter,
    ) -> Result<Next, ConnectionError> {
        let id = method_id(&method);
        match method {
            AMQPClass::Connection(conn::AMQPMethod::Close(close)) => {
                tracing::debug!(peer = %self.peer, code = close.reply_code, text = %close.reply_text, "client closed the connection");
                out.method(
                    0,
                    AMQPClass::Connection(conn::AMQPMethod::CloseOk(conn::CloseOk {})),
                );
                Ok(Next::Closed)
            }
            AMQPClass::Connection(conn::AMQPMethod::CloseOk(_)) => Ok(Next::Closed),
            AMQPClass::Connection(
                conn::AMQPMethod::Blocked(_) | conn::AMQPMethod::Unblocked(_),
            ) => Ok(Next::Continue),
            AMQPClass::Connection(conn::AMQPMethod::UpdateSecret(update)) => {
                // RabbitMQ's extension: a client refreshes its password or token without
                // reconnecting. Users from configuration have no secret that expires, so,
                // as RabbitMQ's internal user database does, the new one is taken without
                // a check: the connection was authenticated at open and the secret plays
                // no further part. Its length is bounded by the frame.
                tracing::info!(peer = %self.peer, user = %self.negotiated.user, reason = %update.reason, "connection secret updated");
                out.method(
                    0,
                    AMQPClass::Connection(conn::AMQPMethod::UpdateSecretOk(
                        conn::UpdateSecretOk {},
                    )),
                );
                Ok(Next::Continue)
            }
            AMQPClass::Connection(_) => Err(ConnectionError::new(
                reply_code::COMMAND_INVALID,
                "connection method not allowed after the handshake",
            )
            .on(id)),
            _ => Err(ConnectionError::new(
                reply_code::COMMAND_INVALID,
                "only connection methods may use channel 0",
            )
            .on(id)),
        }
    }

    fn on_channel_method(
        &mut self,
        channel_id: u16,
        method: AMQPClass,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let id = method_id(&method);
        if let AMQPClass::Connection(_) = method {
            return Err(ConnectionError::new(
                reply_code::COMMAND_INVALID,
                "connection methods must use channel 0",
            )
            .on(id));
        }
        let Some(channel) = self.channels.get_mut(&channel_id) else {
            if let AMQPClass::Channel(chan::AMQPMethod::Open(_)) = method {
                return self.open_channel(channel_id, commands);
            }
            return Err(ConnectionError::new(
                reply_code::CHANNEL_ERROR,
                format!("expected 'channel.open' on channel {channel_id}"),
            )
            .on(id));
        };
        match channel.phase {
            ChannelPhase::ClosingByServer | ChannelPhase::ClosingCrossed => {
                // Spec 2.2.5 (and RabbitMQ): after our channel.close, every
                // method but close and close-ok is dropped.
                match method {
                    AMQPClass::Channel(chan::AMQPMethod::CloseOk(_)) => {
                        self.channels.remove(&channel_id);
                    }
                    AMQPClass::Channel(chan::AMQPMethod::Close(_)) => {
                        // Both sides closed at once: answer, and keep the
                        // channel until the client's close-ok to ours, so
                        // that close-ok is not taken for a method on a
                        // channel that was never opened (504).
                        out.method(
                            channel_id,
                            AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {})),
                        );
                        channel.phase = ChannelPhase::ClosingCrossed;
                    }
                    AMQPClass::Channel(chan::AMQPMethod::Open(_))
                        if channel.phase == ChannelPhase::ClosingCrossed =>
                    {
                        self.channels.remove(&channel_id);
                        return self.open_channel(channel_id, commands);
                    }
                    _ => {}
                }
                return Ok(());
            }
            ChannelPhase::ClosingByClient => return Ok(()),
            ChannelPhase::Open => {}
        }
        if channel.publish.is_some() {
            return Err(ConnectionError::new(
                reply_code::UNEXPECTED_FRAME,
                format!("expected content header or body on channel {channel_id}, got a method"),
            )
            .on(id));
        }
        // The id the command carries if it is a request; taken only then.
        let request_id = self.next_request;
        match commands::translate(method, channel_id, request_id)? {
            Translation::Request {
                command: cmd,
                answer,
                nowait,
            } => {
                match answer {
                    Answer::ChannelCloseByClient => {
                        channel.phase = ChannelPhase::ClosingByClient;
                        *self.releasing.entry(channel_id).or_default() += 1;
                    }
                    Answer::ConfirmSelect => channel.confirm = true,
                    _ => {}
                }
                let tracked = self.track(channel_id, id, nowait, answer);
                debug_assert_eq!(tracked, request_id, "the command carries its own id");
                commands.push(command(cmd));
            }
            Translation::Notify(cmd) => commands.push(command(cmd)),
            Translation::Reply(reply) => out.method(channel_id, reply),
            Translation::Publish(method) => {
                // RabbitMQ dropped `immediate` and refuses it with a
                // connection error; accepting it silently would promise a
                // check that is never made.
                if method.immediate {
                    return Err(ConnectionError::new(
                        reply_code::NOT_IMPLEMENTED,
                        "immediate=true",
                    )
                    .on(id));
                }
                channel.publish = Some(PendingPublish::new(method, self.unfinished.clone()));
                self.has_published = true;
            }
            Translation::Ignore => {}
        }
        Ok(())
    }

    fn open_channel(
        &mut self,
        channel_id: u16,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        if let Some(error) =
            crate::limits::channel_max(channel_id, self.channels.len(), self.negotiated.channel_max)
        {
            return Err(error);
        }
        self.channels.insert(
            channel_id,
            Channel {
                phase: ChannelPhase::Open,
                publish: None,
                confirm: false,
                confirm_seq: 0,
            },
        );
        let request_id = self.track(
            channel_id,
            MethodId::CHANNEL_OPEN,
            false,
            Answer::ChannelOpen,
        );
        commands.push(command(Command::ChannelOpen(pb::ChannelOpen {
            request_id,
            channel: u32::from(channel_id),
            amqp1_link: None,
        })));
        Ok(())
    }

    /// Server-initiated channel close: tell the client, release the channel
    /// in the engine (its unacked messages are requeued).
    fn close_channel(
        &mut self,
        channel_id: u16,
        code: u16,
        text: &str,
        failed: MethodId,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) {
        let Some(channel) = self.channels.get_mut(&channel_id) else {
            return;
        };
        if channel.phase != ChannelPhase::Open {
            return;
        }
        channel.phase = ChannelPhase::ClosingByServer;
        channel.publish = None;
        tracing::debug!(peer = %self.peer, channel = channel_id, code, text, "closing channel");
        out.method(
            channel_id,
            AMQPClass::Channel(chan::AMQPMethod::Close(chan::Close {
                reply_code: code,
                reply_text: short(&reply_text(code, text)),
                class_id: failed.class_id,
                method_id: failed.method_id,
            })),
        );
        let request_id = self.track(
            channel_id,
            MethodId::CHANNEL_CLOSE,
            true,
            Answer::ChannelReleased,
        );
        *self.releasing.entry(channel_id).or_default() += 1;
        commands.push(command(Command::ChannelClose(pb::ChannelClose {
            request_id,
            channel: u32::from(channel_id),
        })));
    }

    /// The engine finished releasing one incarnation of `channel_id`.
    fn released(&mut self, channel_id: u16) {
        let Some(count) = self.releasing.get_mut(&channel_id) else {
            return;
        };
        debug_assert!(*count > 0, "a release counted below zero");
        *count -= 1;
        if *count == 0 {
            self.releasing.remove(&channel_id);
        }
    }

    /// An engine error for a channel: channel-level codes close the channel,
    /// the rest close the connection.
    fn raise(
        &mut self,
        channel_id: u16,
        error: pb::AmqpError,
        failed: MethodId,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let code = error.reply_code();
        if closes_only_the_channel(code) {
            self.close_channel(channel_id, code, &error.text, failed, out, commands);
            return Ok(());
        }
        Err(error.on(failed).into())
    }

    fn is_live(&self, channel_id: u16) -> bool {
        !self.releasing.contains_key(&channel_id)
            && self
                .channels
                .get(&channel_id)
                .is_some_and(|c| c.phase == ChannelPhase::Open)
    }
}

/// The connection.close frame for a fatal error.
pub fn write_connection_close(error: &ConnectionError, out: &mut FrameWriter) {
    out.method(
        0,
        AMQPClass::Connection(conn::AMQPMethod::Close(conn::Close {
            reply_code: error.code(),
            reply_text: short(&reply_text(error.code(), error.text())),
            class_id: error.method().class_id,
            method_id: error.method().method_id,
        })),
    );
}

fn method_id(method: &AMQPClass) -> MethodId {
    MethodId::new(method.get_amqp_class_id(), method.get_amqp_method_id())
}

/// Text from the engine may exceed a short string; cut it at a char boundary.
fn short(text: &str) -> ShortString {
    ShortString::from(spillway_amqp::codec::short_str_prefix(text))
}

/// The error for a method frame amq-protocol cannot parse: a known class is
/// a malformed frame, an unknown one an invalid command.
/// Field tables nested past the limit close the connection: the frame is
/// hostile, not a mistake a channel can recover from.
fn too_deep(payload: &[u8]) -> ConnectionError {
    let failed = MethodId::from_payload(payload).unwrap_or(MethodId::NONE);
    ConnectionError::new(reply_code::FRAME_ERROR, codec::too_deep_text()).on(failed)
}

fn unparsable_method(payload: &[u8]) -> ConnectionError {
    let failed = MethodId::from_payload(payload).unwrap_or_else(|| {
        // Fewer than four bytes: the class, if there is one, and no method.
        let class_id = match payload {
            [c0, c1, ..] => u16::from_be_bytes([*c0, *c1]),
            _ => 0,
        };
        MethodId::new(class_id, 0)
    });
    if failed.is_known_class() {
        return ConnectionError::new(reply_code::SYNTAX_ERROR, "malformed method frame").on(failed);
    }
    ConnectionError::new(
        reply_code::COMMAND_INVALID,
        format!("unknown class {}", failed.class_id),
    )
    .on(failed)
}

fn command(command: Command) -> SessionCommand {
    SessionCommand {
        command: Some(command),
    }
}
