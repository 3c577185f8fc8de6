//! One client connection: the handshake, then the connection and channel
//! state machines that turn frames into engine commands and engine events
//! into frames. No I/O happens here: frames come in through [`Connection::on_frame`],
//! events through [`Connection::on_event`], and outbound frames collect in a
//! [`FrameWriter`] that the I/O loop (`server.rs`) flushes.

use std::collections::HashMap;
use std::net::SocketAddr;

use amq_protocol::protocol::{
    access, basic, channel as chan, confirm, connection as conn, exchange, queue, AMQPClass,
};
use amq_protocol::types::{AMQPValue, FieldTable, ShortString};
use bytes::{Bytes, BytesMut};
use spillway_proto::engine::{self as pb, reply, session_command::Command, session_event::Event};
use spillway_proto::engine::{SessionCommand, SessionEvent};

use crate::auth;
use crate::codec::{self, FrameWriter, RawFrame};
use crate::GatewayConfig;

/// AMQP reply codes the gateway itself raises.
pub mod codes {
    pub const CONNECTION_FORCED: u16 = 320;
    pub const ACCESS_REFUSED: u16 = 403;
    pub const PRECONDITION_FAILED: u16 = 406;
    pub const FRAME_ERROR: u16 = 501;
    pub const SYNTAX_ERROR: u16 = 502;
    pub const COMMAND_INVALID: u16 = 503;
    pub const CHANNEL_ERROR: u16 = 504;
    pub const UNEXPECTED_FRAME: u16 = 505;
    pub const NOT_ALLOWED: u16 = 530;
    pub const NOT_IMPLEMENTED: u16 = 540;
}

/// Codes that close only the channel; every other code closes the connection.
fn is_channel_error(code: u16) -> bool {
    matches!(code, 311 | 312 | 313 | 403 | 404 | 405 | 406)
}

/// An error that closes the whole connection.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnectionError {
    pub code: u16,
    pub text: String,
    pub class_id: u16,
    pub method_id: u16,
}

impl ConnectionError {
    pub fn new(code: u16, text: impl Into<String>) -> Self {
        Self {
            code,
            text: text.into(),
            class_id: 0,
            method_id: 0,
        }
    }

    fn on(mut self, class_id: u16, method_id: u16) -> Self {
        self.class_id = class_id;
        self.method_id = method_id;
        self
    }
}

/// What the I/O loop should do after a frame or event.
#[derive(Debug, PartialEq)]
pub enum Next {
    Continue,
    /// The client asked to close; close-ok is queued: flush and hang up.
    Closed,
}

/// What the client said it understands (connection.start-ok capabilities).
#[derive(Debug, Default, Clone, Copy)]
pub struct Capabilities {
    pub consumer_cancel_notify: bool,
    pub connection_blocked: bool,
}

/// The negotiated connection, ready for channels. Produced by the handshake.
pub struct Negotiated {
    pub user: String,
    pub vhost: String,
    pub client_properties: FieldTable,
    pub capabilities: Capabilities,
    pub frame_max: u32,
    pub channel_max: u16,
    pub heartbeat: u16,
}

// ----------------------------------------------------------------- handshake

/// The server side of connection.start … connection.open, one frame at a time.
pub struct Handshake<'a> {
    config: &'a GatewayConfig,
    peer: SocketAddr,
    stage: Stage,
    user: String,
    client_properties: FieldTable,
    tuned: (u16, u32, u16),
}

enum Stage {
    StartOk,
    TuneOk,
    Open,
}

pub enum HandshakeStep {
    Continue,
    /// connection.open received: open the engine session for this vhost.
    Open(Negotiated),
}

impl<'a> Handshake<'a> {
    pub fn new(config: &'a GatewayConfig, peer: SocketAddr) -> Self {
        Self {
            config,
            peer,
            stage: Stage::StartOk,
            user: String::new(),
            client_properties: FieldTable::default(),
            tuned: (0, 0, 0),
        }
    }

    pub fn start(&self, out: &mut FrameWriter) {
        let mut capabilities = FieldTable::default();
        for capability in [
            "publisher_confirms",
            "exchange_exchange_bindings",
            "basic.nack",
            "consumer_cancel_notify",
            "connection.blocked",
            "per_consumer_qos",
            "authentication_failure_close",
        ] {
            capabilities.insert(capability.into(), AMQPValue::Boolean(true));
        }
        let mut properties = FieldTable::default();
        properties.insert("product".into(), long_string("Spillway"));
        properties.insert("version".into(), long_string(env!("CARGO_PKG_VERSION")));
        properties.insert("platform".into(), long_string("Rust"));
        properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
        out.method(
            0,
            AMQPClass::Connection(conn::AMQPMethod::Start(conn::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: properties,
                mechanisms: auth::MECHANISMS.into(),
                locales: "en_US".into(),
            })),
        );
    }

    pub fn on_frame(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
    ) -> Result<HandshakeStep, ConnectionError> {
        match frame.kind {
            codec::FRAME_HEARTBEAT => return Ok(HandshakeStep::Continue),
            codec::FRAME_METHOD if frame.channel == 0 => {}
            _ => {
                return Err(ConnectionError::new(
                    codes::UNEXPECTED_FRAME,
                    "expected a connection method on channel 0 during the handshake",
                ))
            }
        }
        let Some(AMQPClass::Connection(method)) = codec::parse_method(&frame.payload) else {
            return Err(ConnectionError::new(
                codes::COMMAND_INVALID,
                "expected a connection method during the handshake",
            ));
        };
        match (&self.stage, method) {
            (Stage::StartOk, conn::AMQPMethod::StartOk(start_ok)) => {
                let peer_ip = self.peer.ip();
                let user = auth::authenticate(
                    &self.config.users,
                    start_ok.mechanism.as_str(),
                    start_ok.response.as_bytes(),
                    peer_ip,
                )
                .map_err(|error| {
                    tracing::info!(peer = %self.peer, %error, "authentication refused");
                    ConnectionError::new(codes::ACCESS_REFUSED, format!("ACCESS_REFUSED - {error}"))
                        .on(10, 11)
                })?;
                self.user = user;
                self.client_properties = start_ok.client_properties;
                self.stage = Stage::TuneOk;
                out.method(
                    0,
                    AMQPClass::Connection(conn::AMQPMethod::Tune(conn::Tune {
                        channel_max: self.config.channel_max,
                        frame_max: self.config.frame_max,
                        heartbeat: self.config.heartbeat,
                    })),
                );
                Ok(HandshakeStep::Continue)
            }
            (Stage::TuneOk, conn::AMQPMethod::TuneOk(tune_ok)) => {
                let frame_max = match tune_ok.frame_max {
                    0 => self.config.frame_max,
                    n => n.min(self.config.frame_max),
                };
                if frame_max < codec::MIN_FRAME_MAX {
                    return Err(ConnectionError::new(
                        codes::NOT_ALLOWED,
                        format!(
                            "frame_max {frame_max} below the minimum {}",
                            codec::MIN_FRAME_MAX
                        ),
                    )
                    .on(10, 31));
                }
                let channel_max = match tune_ok.channel_max {
                    0 => self.config.channel_max,
                    n => n.min(self.config.channel_max),
                };
                self.tuned = (channel_max, frame_max, tune_ok.heartbeat);
                self.stage = Stage::Open;
                Ok(HandshakeStep::Continue)
            }
            (Stage::Open, conn::AMQPMethod::Open(open)) => {
                let (channel_max, frame_max, heartbeat) = self.tuned;
                let capabilities = client_capabilities(&self.client_properties);
                Ok(HandshakeStep::Open(Negotiated {
                    user: std::mem::take(&mut self.user),
                    vhost: open.virtual_host.as_str().to_string(),
                    client_properties: std::mem::take(&mut self.client_properties),
                    capabilities,
                    frame_max,
                    channel_max,
                    heartbeat,
                }))
            }
            _ => Err(ConnectionError::new(
                codes::COMMAND_INVALID,
                "connection method out of order during the handshake",
            )),
        }
    }
}

fn client_capabilities(properties: &FieldTable) -> Capabilities {
    let Some(AMQPValue::FieldTable(capabilities)) = properties.inner().get("capabilities") else {
        return Capabilities::default();
    };
    let flag = |name: &str| {
        matches!(
            capabilities.inner().get(name),
            Some(AMQPValue::Boolean(true))
        )
    };
    Capabilities {
        consumer_cancel_notify: flag("consumer_cancel_notify"),
        connection_blocked: flag("connection.blocked"),
    }
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

// ---------------------------------------------------------------- connection

/// A publish waiting for its content header and body.
struct PendingPublish {
    exchange: String,
    routing_key: String,
    mandatory: bool,
    header: Option<codec::ContentHeader>,
    body: BytesMut,
}

#[derive(PartialEq)]
enum ChannelPhase {
    Open,
    /// We sent channel.close; waiting for the client's close-ok.
    ClosingByServer,
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
    class_id: u16,
    method_id: u16,
    nowait: bool,
    answer: Answer,
}

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
    /// Body bytes the client may still publish while blocked before the
    /// gateway stops reading its socket.
    overdraft_left: u64,
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
            overdraft_left: 0,
        }
    }

    /// Blocked by producer flow control and out of overdraft: stop reading
    /// the socket (TCP back-pressure) until unblocked.
    pub fn reading_paused(&self) -> bool {
        self.flow_blocked.is_some() && self.overdraft_left == 0
    }

    /// Since when, and why, the connection is blocked.
    pub fn blocked(&self) -> Option<(&str, std::time::Instant)> {
        self.flow_blocked
            .as_ref()
            .map(|(reason, since)| (reason.as_str(), *since))
    }

    fn on_flow_control(&mut self, flow: pb::FlowControl, out: &mut FrameWriter) {
        let tell = self.negotiated.capabilities.connection_blocked;
        match (flow.blocked, self.flow_blocked.is_some()) {
            (true, false) => {
                tracing::debug!(peer = %self.peer, reason = %flow.reason, "connection blocked");
                self.overdraft_left = self.config.blocked_overdraft;
                if tell {
                    out.method(
                        0,
                        AMQPClass::Connection(conn::AMQPMethod::Blocked(conn::Blocked {
                            reason: short(&flow.reason),
                        })),
                    );
                }
                self.flow_blocked = Some((flow.reason, std::time::Instant::now()));
            }
            (false, true) => {
                tracing::debug!(peer = %self.peer, "connection unblocked");
                if tell {
                    out.method(
                        0,
                        AMQPClass::Connection(conn::AMQPMethod::Unblocked(conn::Unblocked {})),
                    );
                }
                self.flow_blocked = None;
            }
            _ => {}
        }
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
        let request_id = self.track(0, 10, 40, false, Answer::Session);
        let mut client_properties = Vec::new();
        encode_table(&self.negotiated.client_properties, &mut client_properties);
        command(Command::Open(pb::OpenSession {
            request_id,
            vhost: self.negotiated.vhost.clone(),
            user: self.negotiated.user.clone(),
            client_address: self.peer.to_string(),
            client_properties: client_properties.into(),
        }))
    }

    fn track(
        &mut self,
        channel: u16,
        class_id: u16,
        method_id: u16,
        nowait: bool,
        answer: Answer,
    ) -> u64 {
        let request_id = self.next_request;
        self.next_request += 1;
        self.pending.insert(
            request_id,
            Pending {
                channel,
                class_id,
                method_id,
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
                        codes::FRAME_ERROR,
                        "heartbeat frame on a non-zero channel",
                    ));
                }
                Ok(Next::Continue)
            }
            codec::FRAME_METHOD => {
                let Some(method) = codec::parse_method(&frame.payload) else {
                    return Err(unparsable_method(&frame.payload));
                };
                if frame.channel == 0 {
                    return self.on_connection_method(method, out);
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
                codes::FRAME_ERROR,
                format!("unknown frame type {other}"),
            )),
        }
    }

    fn on_connection_method(
        &mut self,
        method: AMQPClass,
        out: &mut FrameWriter,
    ) -> Result<Next, ConnectionError> {
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
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
            AMQPClass::Connection(conn::AMQPMethod::UpdateSecret(_)) => Err(ConnectionError::new(
                codes::NOT_IMPLEMENTED,
                "connection.update-secret is not supported",
            )
            .on(class_id, method_id)),
            AMQPClass::Connection(_) => Err(ConnectionError::new(
                codes::COMMAND_INVALID,
                "connection method not allowed after the handshake",
            )
            .on(class_id, method_id)),
            _ => Err(ConnectionError::new(
                codes::COMMAND_INVALID,
                "only connection methods may use channel 0",
            )
            .on(class_id, method_id)),
        }
    }

    fn on_channel_method(
        &mut self,
        channel_id: u16,
        method: AMQPClass,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
        if let AMQPClass::Connection(_) = method {
            return Err(ConnectionError::new(
                codes::COMMAND_INVALID,
                "connection methods must use channel 0",
            )
            .on(class_id, method_id));
        }
        let Some(channel) = self.channels.get_mut(&channel_id) else {
            if let AMQPClass::Channel(chan::AMQPMethod::Open(_)) = method {
                return self.open_channel(channel_id, commands);
            }
            return Err(ConnectionError::new(
                codes::CHANNEL_ERROR,
                format!("expected 'channel.open' on channel {channel_id}"),
            )
            .on(class_id, method_id));
        };
        match channel.phase {
            ChannelPhase::ClosingByServer => {
                match method {
                    AMQPClass::Channel(chan::AMQPMethod::CloseOk(_)) => {
                        self.channels.remove(&channel_id);
                    }
                    AMQPClass::Channel(chan::AMQPMethod::Close(_)) => {
                        // Both sides closed at once: answer and forget the channel.
                        out.method(
                            channel_id,
                            AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {})),
                        );
                        self.channels.remove(&channel_id);
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
                codes::UNEXPECTED_FRAME,
                format!("expected content header or body on channel {channel_id}, got a method"),
            )
            .on(class_id, method_id));
        }
        let ch = u32::from(channel_id);
        let cmd = match method {
            AMQPClass::Channel(chan::AMQPMethod::Open(_)) => {
                return Err(ConnectionError::new(
                    codes::CHANNEL_ERROR,
                    format!("channel {channel_id} is already open"),
                )
                .on(class_id, method_id));
            }
            AMQPClass::Channel(chan::AMQPMethod::Close(_)) => {
                channel.phase = ChannelPhase::ClosingByClient;
                let request_id = self.track(
                    channel_id,
                    class_id,
                    method_id,
                    false,
                    Answer::ChannelCloseByClient,
                );
                *self.releasing.entry(channel_id).or_default() += 1;
                Command::ChannelClose(pb::ChannelClose {
                    request_id,
                    channel: ch,
                })
            }
            AMQPClass::Channel(chan::AMQPMethod::CloseOk(_)) => return Ok(()),
            AMQPClass::Channel(chan::AMQPMethod::Flow(flow)) => {
                // Client-initiated flow control: acknowledged; deliveries are
                // paced by prefetch and TCP back-pressure instead.
                out.method(
                    channel_id,
                    AMQPClass::Channel(chan::AMQPMethod::FlowOk(chan::FlowOk {
                        active: flow.active,
                    })),
                );
                return Ok(());
            }
            AMQPClass::Channel(chan::AMQPMethod::FlowOk(_)) => return Ok(()),
            AMQPClass::Access(access::AMQPMethod::Request(_)) => {
                out.method(
                    channel_id,
                    AMQPClass::Access(access::AMQPMethod::RequestOk(access::RequestOk {})),
                );
                return Ok(());
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(m)) => {
                let request_id = self.track(
                    channel_id,
                    class_id,
                    method_id,
                    m.nowait,
                    Answer::ExchangeDeclare,
                );
                Command::ExchangeDeclare(pb::ExchangeDeclare {
                    request_id,
                    channel: ch,
                    exchange: m.exchange.to_string(),
                    kind: m.kind.to_string(),
                    passive: m.passive,
                    durable: m.durable,
                    auto_delete: m.auto_delete,
                    internal: m.internal,
                    arguments: table_bytes(&m.arguments),
                })
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Delete(m)) => {
                let request_id = self.track(
                    channel_id,
                    class_id,
                    method_id,
                    m.nowait,
                    Answer::ExchangeDelete,
                );
                Command::ExchangeDelete(pb::ExchangeDelete {
                    request_id,
                    channel: ch,
                    exchange: m.exchange.to_string(),
                    if_unused: m.if_unused,
                })
            }
            AMQPClass::Queue(queue::AMQPMethod::Declare(m)) => {
                let request_id = self.track(
                    channel_id,
                    class_id,
                    method_id,
                    m.nowait,
                    Answer::QueueDeclare,
                );
                Command::QueueDeclare(pb::QueueDeclare {
                    request_id,
                    channel: ch,
                    queue: m.queue.to_string(),
                    passive: m.passive,
                    durable: m.durable,
                    exclusive: m.exclusive,
                    auto_delete: m.auto_delete,
                    arguments: table_bytes(&m.arguments),
                })
            }
            AMQPClass::Queue(queue::AMQPMethod::Bind(m)) => {
                let request_id =
                    self.track(channel_id, class_id, method_id, m.nowait, Answer::QueueBind);
                Command::QueueBind(pb::QueueBind {
                    request_id,
                    channel: ch,
                    queue: m.queue.to_string(),
                    exchange: m.exchange.to_string(),
                    routing_key: m.routing_key.to_string(),
                    arguments: table_bytes(&m.arguments),
                })
            }
            AMQPClass::Queue(queue::AMQPMethod::Unbind(m)) => {
                let request_id =
                    self.track(channel_id, class_id, method_id, false, Answer::QueueUnbind);
                Command::QueueUnbind(pb::QueueBind {
                    request_id,
                    channel: ch,
                    queue: m.queue.to_string(),
                    exchange: m.exchange.to_string(),
                    routing_key: m.routing_key.to_string(),
                    arguments: table_bytes(&m.arguments),
                })
            }
            AMQPClass::Queue(queue::AMQPMethod::Purge(m)) => {
                let request_id = self.track(
                    channel_id,
                    class_id,
                    method_id,
                    m.nowait,
                    Answer::QueuePurge,
                );
                Command::QueuePurge(pb::QueuePurge {
                    request_id,
                    channel: ch,
                    queue: m.queue.to_string(),
                })
            }
            AMQPClass::Queue(queue::AMQPMethod::Delete(m)) => {
                let request_id = self.track(
                    channel_id,
                    class_id,
                    method_id,
                    m.nowait,
                    Answer::QueueDelete,
                );
                Command::QueueDelete(pb::QueueDelete {
                    request_id,
                    channel: ch,
                    queue: m.queue.to_string(),
                    if_unused: m.if_unused,
                    if_empty: m.if_empty,
                })
            }
            AMQPClass::Basic(basic::AMQPMethod::Qos(m)) => {
                let request_id = self.track(channel_id, class_id, method_id, false, Answer::Qos);
                Command::Qos(pb::Qos {
                    request_id,
                    channel: ch,
                    prefetch_count: u32::from(m.prefetch_count),
                    global: m.global,
                })
            }
            AMQPClass::Basic(basic::AMQPMethod::Consume(m)) => {
                let request_id =
                    self.track(channel_id, class_id, method_id, m.nowait, Answer::Consume);
                Command::Consume(pb::Consume {
                    request_id,
                    channel: ch,
                    queue: m.queue.to_string(),
                    consumer_tag: m.consumer_tag.to_string(),
                    no_ack: m.no_ack,
                    exclusive: m.exclusive,
                    arguments: table_bytes(&m.arguments),
                })
            }
            AMQPClass::Basic(basic::AMQPMethod::Cancel(m)) => {
                let tag = m.consumer_tag.to_string();
                let request_id = self.track(
                    channel_id,
                    class_id,
                    method_id,
                    m.nowait,
                    Answer::Cancel(tag.clone()),
                );
                Command::Cancel(pb::Cancel {
                    request_id,
                    channel: ch,
                    consumer_tag: tag,
                })
            }
            AMQPClass::Basic(basic::AMQPMethod::Publish(m)) => {
                channel.publish = Some(PendingPublish {
                    exchange: m.exchange.to_string(),
                    routing_key: m.routing_key.to_string(),
                    mandatory: m.mandatory,
                    header: None,
                    body: BytesMut::new(),
                });
                return Ok(());
            }
            AMQPClass::Basic(basic::AMQPMethod::Get(m)) => {
                let request_id = self.track(channel_id, class_id, method_id, false, Answer::Get);
                Command::Get(pb::Get {
                    request_id,
                    channel: ch,
                    queue: m.queue.to_string(),
                    no_ack: m.no_ack,
                })
            }
            AMQPClass::Basic(basic::AMQPMethod::Ack(m)) => Command::Ack(pb::Ack {
                channel: ch,
                delivery_tag: m.delivery_tag,
                multiple: m.multiple,
            }),
            AMQPClass::Basic(basic::AMQPMethod::Nack(m)) => Command::Nack(pb::Nack {
                channel: ch,
                delivery_tag: m.delivery_tag,
                multiple: m.multiple,
                requeue: m.requeue,
            }),
            AMQPClass::Basic(basic::AMQPMethod::Reject(m)) => Command::Nack(pb::Nack {
                channel: ch,
                delivery_tag: m.delivery_tag,
                multiple: false,
                requeue: m.requeue,
            }),
            AMQPClass::Basic(basic::AMQPMethod::Recover(m)) => {
                let request_id =
                    self.track(channel_id, class_id, method_id, false, Answer::Recover);
                Command::Recover(pb::Recover {
                    request_id,
                    channel: ch,
                    requeue: m.requeue,
                })
            }
            AMQPClass::Basic(basic::AMQPMethod::RecoverAsync(m)) => {
                let request_id = self.track(channel_id, class_id, method_id, true, Answer::Recover);
                Command::Recover(pb::Recover {
                    request_id,
                    channel: ch,
                    requeue: m.requeue,
                })
            }
            AMQPClass::Confirm(confirm::AMQPMethod::Select(m)) => {
                channel.confirm = true;
                let request_id = self.track(
                    channel_id,
                    class_id,
                    method_id,
                    m.nowait,
                    Answer::ConfirmSelect,
                );
                Command::ConfirmSelect(pb::ConfirmSelect {
                    request_id,
                    channel: ch,
                })
            }
            AMQPClass::Tx(_) => {
                return Err(ConnectionError::new(
                    codes::NOT_IMPLEMENTED,
                    "transactions are not supported yet",
                )
                .on(class_id, method_id));
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Bind(m)) => {
                let request_id = self.track(
                    channel_id,
                    class_id,
                    method_id,
                    m.nowait,
                    Answer::ExchangeBind,
                );
                Command::ExchangeBind(pb::ExchangeBind {
                    request_id,
                    channel: ch,
                    destination: m.destination.to_string(),
                    source: m.source.to_string(),
                    routing_key: m.routing_key.to_string(),
                    arguments: table_bytes(&m.arguments),
                })
            }
            AMQPClass::Exchange(exchange::AMQPMethod::Unbind(m)) => {
                let request_id = self.track(
                    channel_id,
                    class_id,
                    method_id,
                    m.nowait,
                    Answer::ExchangeUnbind,
                );
                Command::ExchangeUnbind(pb::ExchangeBind {
                    request_id,
                    channel: ch,
                    destination: m.destination.to_string(),
                    source: m.source.to_string(),
                    routing_key: m.routing_key.to_string(),
                    arguments: table_bytes(&m.arguments),
                })
            }
            _ => {
                return Err(ConnectionError::new(
                    codes::COMMAND_INVALID,
                    "method not valid from a client",
                )
                .on(class_id, method_id));
            }
        };
        commands.push(command(cmd));
        Ok(())
    }

    fn open_channel(
        &mut self,
        channel_id: u16,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        if channel_id > self.negotiated.channel_max {
            return Err(ConnectionError::new(
                codes::CHANNEL_ERROR,
                format!(
                    "channel {channel_id} above channel_max {}",
                    self.negotiated.channel_max
                ),
            )
            .on(20, 10));
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
        let request_id = self.track(channel_id, 20, 10, false, Answer::ChannelOpen);
        commands.push(command(Command::ChannelOpen(pb::ChannelOpen {
            request_id,
            channel: u32::from(channel_id),
        })));
        Ok(())
    }

    fn on_content_header(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let channel_id = frame.channel;
        let max_message_size = self.config.max_message_size;
        let channel = self.content_channel(channel_id)?;
        let Some(channel) = channel else {
            return Ok(());
        };
        let Some(publish) = channel.publish.as_mut() else {
            return Err(ConnectionError::new(
                codes::UNEXPECTED_FRAME,
                format!("content header on channel {channel_id} without a basic.publish"),
            ));
        };
        if publish.header.is_some() {
            return Err(ConnectionError::new(
                codes::UNEXPECTED_FRAME,
                format!("second content header on channel {channel_id}"),
            ));
        }
        let Some(header) = codec::parse_content_header(&frame.payload) else {
            return Err(ConnectionError::new(
                codes::FRAME_ERROR,
                "malformed content header",
            ));
        };
        if header.class_id != 60 {
            return Err(ConnectionError::new(
                codes::FRAME_ERROR,
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
                codes::PRECONDITION_FAILED,
                &text,
                60,
                40,
                out,
                commands,
            );
            return Ok(());
        }
        // Bounded by max_message_size above; reserve lazily for huge bodies.
        publish
            .body
            .reserve((header.body_size as usize).min(1 << 20));
        let complete = header.body_size == 0;
        publish.header = Some(header);
        if complete {
            self.finish_publish(channel_id, out, commands)?;
        }
        Ok(())
    }

    fn on_content_body(
        &mut self,
        frame: RawFrame,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let channel_id = frame.channel;
        let Some(channel) = self.content_channel(channel_id)? else {
            return Ok(());
        };
        let Some(PendingPublish {
            header: Some(header),
            body,
            ..
        }) = channel.publish.as_mut()
        else {
            return Err(ConnectionError::new(
                codes::UNEXPECTED_FRAME,
                format!("content body on channel {channel_id} without a content header"),
            ));
        };
        if (body.len() + frame.payload.len()) as u64 > header.body_size {
            return Err(ConnectionError::new(
                codes::FRAME_ERROR,
                format!("content body on channel {channel_id} longer than its header's size"),
            ));
        }
        body.extend_from_slice(&frame.payload);
        if body.len() as u64 == header.body_size {
            self.finish_publish(channel_id, out, commands)?;
        }
        Ok(())
    }

    /// The channel a content frame belongs to; None when the frame is to be
    /// discarded (the channel is closing).
    fn content_channel(
        &mut self,
        channel_id: u16,
    ) -> Result<Option<&mut Channel>, ConnectionError> {
        match self.channels.get_mut(&channel_id) {
            None => Err(ConnectionError::new(
                codes::CHANNEL_ERROR,
                format!("content frame on channel {channel_id}, which is not open"),
            )),
            Some(channel) if channel.phase != ChannelPhase::Open => Ok(None),
            Some(channel) => Ok(Some(channel)),
        }
    }

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
            body,
        }) = channel.publish.take()
        else {
            return Ok(());
        };
        if self.flow_blocked.is_some() {
            self.overdraft_left = self.overdraft_left.saturating_sub(header.body_size.max(1));
        }
        let properties = match basic::parse_properties(&header.properties[..]) {
            Ok(([], properties)) => properties,
            _ => {
                self.close_channel(
                    channel_id,
                    codes::SYNTAX_ERROR,
                    "malformed message properties",
                    60,
                    40,
                    out,
                    commands,
                );
                return Ok(());
            }
        };
        if let Some(user_id) = properties.user_id() {
            if user_id.as_str() != self.negotiated.user {
                let text = format!(
                    "user_id property set to '{}' but authenticated user was '{}'",
                    user_id, self.negotiated.user
                );
                self.close_channel(
                    channel_id,
                    codes::PRECONDITION_FAILED,
                    &text,
                    60,
                    40,
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
        let span = tracing::trace_span!(target: spillway_proto::trace::TARGET, "publish",
            exchange = %exchange, routing_key = %routing_key);
        commands.push(command(Command::Publish(pb::Publish {
            trace_context: spillway_proto::trace::carrier(&span),
            channel: u32::from(channel_id),
            exchange,
            routing_key,
            mandatory,
            // The header's properties are a slice of the socket's read
            // buffer: copied, so a queued message does not keep it alive.
            properties: Bytes::copy_from_slice(&header.properties),
            body: body.freeze(),
            confirm_seq,
            persistent: properties.delivery_mode() == &Some(2),
        })));
        Ok(())
    }

    /// Server-initiated channel close: tell the client, release the channel
    /// in the engine (its unacked messages are requeued).
    #[allow(clippy::too_many_arguments)]
    fn close_channel(
        &mut self,
        channel_id: u16,
        code: u16,
        text: &str,
        class_id: u16,
        method_id: u16,
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
                reply_text: short(&format!("{} - {text}", reply_name(code))),
                class_id,
                method_id,
            })),
        );
        let request_id = self.track(channel_id, 20, 40, true, Answer::ChannelReleased);
        *self.releasing.entry(channel_id).or_default() += 1;
        commands.push(command(Command::ChannelClose(pb::ChannelClose {
            request_id,
            channel: u32::from(channel_id),
        })));
    }

    // ------------------------------------------------------------ events

    /// Handles one engine event. `Err` closes the connection.
    pub fn on_event(
        &mut self,
        event: SessionEvent,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let Some(event) = event.event else {
            return Ok(());
        };
        match event {
            Event::Reply(reply) => self.on_reply(reply, out, commands),
            Event::FlowControl(flow) => {
                self.on_flow_control(flow, out);
                Ok(())
            }
            Event::Batch(batch) => {
                for event in batch.events {
                    self.on_event(event, out, commands)?;
                }
                Ok(())
            }
            Event::Deliver(deliver) => {
                let span = tracing::trace_span!(target: spillway_proto::trace::TARGET, "deliver",
                    consumer_tag = %deliver.consumer_tag);
                spillway_proto::trace::set_parent(&span, &deliver.trace_context);
                let _entered = span.enter();
                let channel_id = deliver.channel as u16;
                if !self.is_live(channel_id) {
                    // The engine requeues it when it releases the channel.
                    return Ok(());
                }
                out.method(
                    channel_id,
                    AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                        consumer_tag: short(&deliver.consumer_tag),
                        delivery_tag: deliver.delivery_tag,
                        redelivered: deliver.redelivered,
                        exchange: short(&deliver.exchange),
                        routing_key: short(&deliver.routing_key),
                    })),
                );
                out.content(
                    channel_id,
                    &deliver.properties,
                    &deliver.body,
                    self.negotiated.frame_max as usize,
                );
                self.deliveries += 1;
                Ok(())
            }
            Event::Confirm(confirm) => {
                let channel_id = confirm.channel as u16;
                if !self.is_live(channel_id) {
                    return Ok(());
                }
                let method = if confirm.ack {
                    basic::AMQPMethod::Ack(basic::Ack {
                        delivery_tag: confirm.seq,
                        multiple: false,
                    })
                } else {
                    basic::AMQPMethod::Nack(basic::Nack {
                        delivery_tag: confirm.seq,
                        multiple: false,
                        requeue: false,
                    })
                };
                out.method(channel_id, AMQPClass::Basic(method));
                Ok(())
            }
            Event::Returned(returned) => {
                let channel_id = returned.channel as u16;
                if !self.is_live(channel_id) {
                    return Ok(());
                }
                out.method(
                    channel_id,
                    AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                        reply_code: returned.reply_code as u16,
                        reply_text: short(&returned.reply_text),
                        exchange: short(&returned.exchange),
                        routing_key: short(&returned.routing_key),
                    })),
                );
                out.content(
                    channel_id,
                    &returned.properties,
                    &returned.body,
                    self.negotiated.frame_max as usize,
                );
                Ok(())
            }
            Event::ConsumerCancelled(cancelled) => {
                let channel_id = cancelled.channel as u16;
                if self.is_live(channel_id) && self.negotiated.capabilities.consumer_cancel_notify {
                    out.method(
                        channel_id,
                        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                            consumer_tag: short(&cancelled.consumer_tag),
                            nowait: true,
                        })),
                    );
                }
                Ok(())
            }
            Event::ChannelError(channel_error) => {
                let channel_id = channel_error.channel as u16;
                if !self.is_live(channel_id) {
                    return Ok(());
                }
                let error = channel_error.error.unwrap_or_default();
                let class_id = u16::try_from(error.class_id).unwrap_or_default();
                let method_id = u16::try_from(error.method_id).unwrap_or_default();
                self.raise(channel_id, error, class_id, method_id, out, commands)
            }
            // The broker closes the connection (management, vhost deleted).
            Event::ConnectionClose(close) => {
                Err(ConnectionError::new(codes::CONNECTION_FORCED, close.reason))
            }
        }
    }

    fn on_reply(
        &mut self,
        reply: pb::Reply,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let Some(pending) = self.pending.remove(&reply.request_id) else {
            tracing::warn!(request = reply.request_id, "reply to an unknown request");
            return Ok(());
        };
        let channel_id = pending.channel;
        if matches!(
            pending.answer,
            Answer::ChannelReleased | Answer::ChannelCloseByClient
        ) {
            if let Some(count) = self.releasing.get_mut(&channel_id) {
                *count -= 1;
                if *count == 0 {
                    self.releasing.remove(&channel_id);
                }
            }
        }
        let result = reply.result.unwrap_or(reply::Result::Ok(pb::Empty {}));
        if let reply::Result::Error(error) = result {
            if let Answer::Session = pending.answer {
                return Err(ConnectionError::new(error.code as u16, error.text).on(10, 40));
            }
            if !self.is_live(channel_id) {
                return Ok(());
            }
            return self.raise(
                channel_id,
                error,
                pending.class_id,
                pending.method_id,
                out,
                commands,
            );
        }
        let answer = match pending.answer {
            Answer::Session => {
                out.method(
                    0,
                    AMQPClass::Connection(conn::AMQPMethod::OpenOk(conn::OpenOk {})),
                );
                return Ok(());
            }
            Answer::ChannelReleased => return Ok(()),
            Answer::ChannelCloseByClient => {
                self.channels.remove(&channel_id);
                out.method(
                    channel_id,
                    AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {})),
                );
                return Ok(());
            }
            _ if !self.is_live(channel_id) => return Ok(()),
            _ if pending.nowait => return Ok(()),
            answer => answer,
        };
        let method = match (answer, result) {
            (Answer::ChannelOpen, _) => {
                AMQPClass::Channel(chan::AMQPMethod::OpenOk(chan::OpenOk {}))
            }
            (Answer::ExchangeDeclare, _) => {
                AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {}))
            }
            (Answer::ExchangeDelete, _) => {
                AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {}))
            }
            (Answer::ExchangeBind, _) => {
                AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {}))
            }
            (Answer::ExchangeUnbind, _) => {
                AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {}))
            }
            (Answer::QueueDeclare, reply::Result::QueueDeclareOk(ok)) => {
                AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                    queue: short(&ok.queue),
                    message_count: ok.message_count,
                    consumer_count: ok.consumer_count,
                }))
            }
            (Answer::QueueBind, _) => AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
            (Answer::QueueUnbind, _) => {
                AMQPClass::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {}))
            }
            (Answer::QueuePurge, reply::Result::CountOk(ok)) => {
                AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk {
                    message_count: ok.message_count,
                }))
            }
            (Answer::QueueDelete, reply::Result::CountOk(ok)) => {
                AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                    message_count: ok.message_count,
                }))
            }
            (Answer::Consume, reply::Result::ConsumeOk(ok)) => {
                AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                    consumer_tag: short(&ok.consumer_tag),
                }))
            }
            (Answer::Cancel(tag), _) => {
                AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                    consumer_tag: short(&tag),
                }))
            }
            (Answer::Recover, _) => {
                AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {}))
            }
            (Answer::Qos, _) => AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
            (Answer::Get, reply::Result::GetOk(ok)) => {
                out.method(
                    channel_id,
                    AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
                        delivery_tag: ok.delivery_tag,
                        redelivered: ok.redelivered,
                        exchange: short(&ok.exchange),
                        routing_key: short(&ok.routing_key),
                        message_count: ok.message_count,
                    })),
                );
                out.content(
                    channel_id,
                    &ok.properties,
                    &ok.body,
                    self.negotiated.frame_max as usize,
                );
                return Ok(());
            }
            (Answer::Get, _) => AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
            (Answer::ConfirmSelect, _) => {
                AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {}))
            }
            (_, other) => {
                tracing::error!(?other, "engine answered with an unexpected reply");
                return Err(ConnectionError::new(
                    codes::CONNECTION_FORCED,
                    "internal error",
                ));
            }
        };
        out.method(channel_id, method);
        Ok(())
    }

    /// An engine error for a channel: channel-level codes close the channel,
    /// the rest close the connection.
    fn raise(
        &mut self,
        channel_id: u16,
        error: pb::AmqpError,
        class_id: u16,
        method_id: u16,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let code = u16::try_from(error.code).unwrap_or(codes::CONNECTION_FORCED);
        if is_channel_error(code) {
            self.close_channel(
                channel_id,
                code,
                &error.text,
                class_id,
                method_id,
                out,
                commands,
            );
            return Ok(());
        }
        Err(ConnectionError::new(code, error.text).on(class_id, method_id))
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
            reply_code: error.code,
            reply_text: short(&format!("{} - {}", reply_name(error.code), error.text)),
            class_id: error.class_id,
            method_id: error.method_id,
        })),
    );
}

/// RabbitMQ's names for reply codes, which clients print.
fn reply_name(code: u16) -> &'static str {
    match code {
        200 => "REPLY_SUCCESS",
        311 => "CONTENT_TOO_LARGE",
        312 => "NO_ROUTE",
        313 => "NO_CONSUMERS",
        320 => "CONNECTION_FORCED",
        402 => "INVALID_PATH",
        403 => "ACCESS_REFUSED",
        404 => "NOT_FOUND",
        405 => "RESOURCE_LOCKED",
        406 => "PRECONDITION_FAILED",
        501 => "FRAME_ERROR",
        502 => "SYNTAX_ERROR",
        503 => "COMMAND_INVALID",
        504 => "CHANNEL_ERROR",
        505 => "UNEXPECTED_FRAME",
        506 => "RESOURCE_ERROR",
        530 => "NOT_ALLOWED",
        540 => "NOT_IMPLEMENTED",
        541 => "INTERNAL_ERROR",
        _ => "ERROR",
    }
}

/// Text from the engine may exceed a short string; cut it at a char boundary.
fn short(text: &str) -> ShortString {
    let mut end = text.len().min(255);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    ShortString::from(&text[..end])
}

fn unparsable_method(payload: &[u8]) -> ConnectionError {
    let class_id = payload
        .get(..2)
        .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
    let method_id = payload
        .get(2..4)
        .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
    let known = matches!(class_id, 10 | 20 | 30 | 40 | 50 | 60 | 85 | 90);
    if known {
        ConnectionError::new(codes::SYNTAX_ERROR, "malformed method frame").on(class_id, method_id)
    } else {
        ConnectionError::new(codes::COMMAND_INVALID, format!("unknown class {class_id}"))
            .on(class_id, method_id)
    }
}

fn command(command: Command) -> SessionCommand {
    SessionCommand {
        command: Some(command),
    }
}

fn table_bytes(table: &FieldTable) -> Bytes {
    if table.inner().is_empty() {
        return Bytes::new();
    }
    let mut buffer = Vec::new();
    encode_table(table, &mut buffer);
    buffer.into()
}

fn encode_table(table: &FieldTable, buffer: &mut Vec<u8>) {
    let context = amq_protocol::frame::WriteContext::from(std::mem::take(buffer));
    let result = amq_protocol::types::generation::gen_field_table(table)(context);
    match result {
        Ok(context) => *buffer = context.write,
        Err(error) => tracing::error!(%error, "could not encode a field table"),
    }
}
