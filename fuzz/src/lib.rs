//! What Spillway's fuzz targets assert, shared by the fuzzer and by `cargo test`.
//!
//! Each `check_*` takes the fuzzer's bytes, drives one parser of client input
//! the way the gateway drives it, and panics when something that must hold
//! does not: no panic inside the parser, field tables never parsed deeper than
//! [`nesting::MAX_NESTING`] (the nesting check runs before every recursive
//! parse), errors are AMQP errors a client recognises, and everything the
//! server writes back is well-formed. The fuzz targets (`fuzz/fuzz_targets/`)
//! call them; `crates/spillway-gateway/tests/fuzz_regressions.rs` includes
//! this file and replays every saved crash (`fuzz/regressions/<target>/`) and
//! every seed (`fuzz/corpus-seeds/<target>/`, made by [`seeds`]) through them
//! on stable Rust, without the fuzzer.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use amq_protocol::frame::WriteContext;
use amq_protocol::protocol::{basic, channel as chan, connection as conn, exchange, queue};
use amq_protocol::protocol::{confirm, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString};
use bytes::{Bytes, BytesMut};
use spillway_amqp::codec::{self, FrameDecoder, FrameError, FrameWriter, RawFrame};
use spillway_amqp::codec::{FRAME_BODY, FRAME_END, FRAME_HEADER, FRAME_HEARTBEAT, FRAME_METHOD};
use spillway_amqp::codec::{FRAME_OVERHEAD, MIN_FRAME_MAX, PROTOCOL_HEADER};
use spillway_amqp::{self as amqp, closes_only_the_channel, nesting, reply_code, reply_name};
use spillway_gateway::amqp091::connection::{write_connection_close, Capabilities, Connection};
use spillway_gateway::amqp091::connection::{
    ConnectionError, Handshake, HandshakeStep, Negotiated, Next,
};
use spillway_gateway::auth;
use spillway_gateway::{GatewayConfig, GatewaySettings};
use spillway_proto::body::{Body, BodyError};
use spillway_proto::engine::{self as pb, reply, session_command::Command, session_event::Event};
use spillway_proto::engine::{AuthenticateRequest, LoginResult, SessionCommand, SessionEvent};
use tokio_util::codec::Decoder;

/// The fuzz targets, each named after the directory of its seeds and
/// regression cases.
pub const TARGETS: [&str; 6] = [
    "frame_decoder",
    "handshake",
    "connection",
    "tables",
    "bodies",
    "amqp1",
];

/// Runs the check of `target` on `data`; returns what happened, for the
/// seeds' expectations. `None` for a target that does not exist.
pub fn run(target: &str, data: &[u8]) -> Option<String> {
    Some(match target {
        "frame_decoder" => format!("{:?}", check_frame_decoder(data)),
        "handshake" => format!("{:?}", check_handshake(data)),
        "connection" => format!("{:?}", check_connection(data)),
        "tables" => format!("{:?}", check_tables(data)),
        "bodies" => format!("{:?}", check_bodies(data)),
        "amqp1" => format!("{:?}", check_amqp1(data)),
        _ => return None,
    })
}

// ------------------------------------------------------------ frame_decoder

/// How a byte stream ended for the frame decoder.
#[derive(Debug, PartialEq)]
pub enum StreamEnd {
    /// Every byte was a whole frame.
    Clean,
    /// The last frame is not complete yet.
    Incomplete,
    Error(FrameError),
}

#[derive(Debug)]
pub struct FrameOutcome {
    pub frames: usize,
    pub end: StreamEnd,
}

/// The frame-max values the decoder is tried with: below any frame, the
/// spec's minimum, and the default offered to clients.
const FRAME_MAXES: [usize; 5] = [
    7,
    64,
    MIN_FRAME_MAX as usize,
    131_072,
    FRAME_OVERHEAD + 1000,
];

/// `data[0]` picks the frame-max, `data[1]` how the stream is cut into reads
/// (0 = one read), the rest is the stream. The decoder must split it as the
/// spec says (checked against a plain reading of spec 4.2.3 below), however
/// the reads fall.
pub fn check_frame_decoder(data: &[u8]) -> FrameOutcome {
    let [pick, cut, stream @ ..] = data else {
        return FrameOutcome {
            frames: 0,
            end: StreamEnd::Incomplete,
        };
    };
    let frame_max = FRAME_MAXES[usize::from(*pick) % FRAME_MAXES.len()];
    let (expected, expected_end) = reference_frames(stream, frame_max);

    let mut decoder = FrameDecoder { frame_max };
    let mut buffer = BytesMut::new();
    let mut frames = Vec::new();
    let mut end = StreamEnd::Incomplete;
    let read = if *cut == 0 {
        stream.len().max(1)
    } else {
        usize::from(*cut)
    };
    'reads: for chunk in stream.chunks(read) {
        buffer.extend_from_slice(chunk);
        loop {
            match decoder.decode(&mut buffer) {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break,
                Err(error) => {
                    end = StreamEnd::Error(error);
                    break 'reads;
                }
            }
        }
    }
    if end == StreamEnd::Incomplete && buffer.is_empty() {
        end = StreamEnd::Clean;
    }
    assert_eq!(
        frames, expected,
        "frames differ from the spec's reading (frame-max {frame_max}, reads of {read})"
    );
    assert_eq!(end, expected_end, "the stream ended differently");
    for frame in &frames {
        assert!(
            frame.payload.len() + FRAME_OVERHEAD <= frame_max,
            "a frame larger than frame-max got through"
        );
    }
    if end != StreamEnd::Clean {
        return FrameOutcome {
            frames: frames.len(),
            end,
        };
    }
    // At the end of the stream, nothing may be left over.
    match decoder.decode_eof(&mut buffer) {
        Ok(None) => {}
        other => panic!("decode_eof on an empty buffer gave {other:?}"),
    }
    FrameOutcome {
        frames: frames.len(),
        end,
    }
}

/// Spec 4.2.3, read plainly: type, channel, size, payload, 0xCE; the frame
/// types of 0-9-1; nothing larger than frame-max.
fn reference_frames(stream: &[u8], frame_max: usize) -> (Vec<RawFrame>, StreamEnd) {
    let mut frames = Vec::new();
    let mut rest = stream;
    loop {
        if rest.is_empty() {
            return (frames, StreamEnd::Clean);
        }
        let Some(header) = rest.get(..7) else {
            return (frames, StreamEnd::Incomplete);
        };
        let kind = header[0];
        if ![FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT].contains(&kind) {
            return (frames, StreamEnd::Error(FrameError::UnknownType(kind)));
        }
        let channel = u16::from_be_bytes([header[1], header[2]]);
        let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
        if size + FRAME_OVERHEAD > frame_max {
            return (
                frames,
                StreamEnd::Error(FrameError::TooLarge {
                    size: size + FRAME_OVERHEAD,
                    max: frame_max,
                }),
            );
        }
        let Some(whole) = rest.get(..size + FRAME_OVERHEAD) else {
            return (frames, StreamEnd::Incomplete);
        };
        if whole[size + 7] != FRAME_END {
            return (frames, StreamEnd::Error(FrameError::BadFrameEnd));
        }
        frames.push(RawFrame {
            kind,
            channel,
            payload: bytes::Bytes::copy_from_slice(&whole[7..7 + size]),
        });
        rest = &rest[size + FRAME_OVERHEAD..];
    }
}

// ------------------------------------------------------------ handshake

#[derive(Debug, PartialEq)]
pub enum HandshakeOutcome {
    /// Not the AMQP 0-9-1 protocol header: the server answers with its own
    /// and closes.
    NotAmqp,
    /// The input ended before connection.open.
    Incomplete,
    /// The byte stream is not frames; the server closes with 501.
    FrameError,
    /// The server closed the connection with this reply code.
    Refused(u16),
    /// connection.open arrived: the connection is up for `user`.
    Opened { user: String },
}

const FUZZ_USER: &str = "fuzz";
const FUZZ_PASSWORD: &str = "fuzz-secret";
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const REMOTE: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));

/// The gateway's defaults.
fn fuzz_config() -> GatewayConfig {
    GatewayConfig::default()
}

/// A user the fuzzed engine knows.
struct FuzzUser {
    name: &'static str,
    password: &'static str,
    loopback_only: bool,
}

/// Two users: guest (loopback only, as configured out of the box) and one
/// that may log in from anywhere.
fn fuzz_users() -> [FuzzUser; 2] {
    [
        FuzzUser {
            name: "guest",
            password: "guest",
            loopback_only: true,
        },
        FuzzUser {
            name: FUZZ_USER,
            password: FUZZ_PASSWORD,
            loopback_only: false,
        },
    ]
}

/// The engine's answer to a login, by its rules (the engine's own check is
/// unit-tested in `spillway-engine`'s `access.rs`): a known name with its
/// password (or EXTERNAL, no password), loopback-only users from loopback.
fn fuzz_login(request: &AuthenticateRequest) -> LoginResult {
    let users = fuzz_users();
    let Some(user) = users.iter().find(|u| u.name == request.user) else {
        return LoginResult::InvalidCredentials;
    };
    if request
        .password
        .as_deref()
        .is_some_and(|password| password != user.password)
    {
        return LoginResult::InvalidCredentials;
    }
    if user.loopback_only && !request.peer_is_loopback {
        return LoginResult::LoopbackOnly;
    }
    LoginResult::Accepted
}

/// `data[0]` bit 0 picks the peer (0 = loopback, 1 = remote); the rest is
/// what the client sends, from the protocol header on. The handshake runs as
/// `server.rs` runs it: frames held to the spec's minimum frame-max until
/// tune-ok. Nobody may log in without their password, guest never from a
/// remote peer, negotiated limits stay within the server's, and every error
/// becomes one well-formed connection.close.
pub fn check_handshake(data: &[u8]) -> HandshakeOutcome {
    let Some((options, wire)) = data.split_first() else {
        return HandshakeOutcome::Incomplete;
    };
    let peer_ip = if options & 1 == 0 { LOOPBACK } else { REMOTE };
    let peer = SocketAddr::new(peer_ip, 40_000);
    let config = fuzz_config();
    let Some(header) = wire.get(..8) else {
        return HandshakeOutcome::Incomplete;
    };
    if header != PROTOCOL_HEADER {
        return HandshakeOutcome::NotAmqp;
    }
    let mut decoder = FrameDecoder {
        frame_max: MIN_FRAME_MAX as usize,
    };
    let mut buffer = BytesMut::from(&wire[8..]);
    let mut out = FrameWriter::default();
    let mut handshake = Handshake::new(&config, peer);
    handshake.start(&mut out);
    // The response of the start-ok the handshake accepted.
    let mut accepted_response = None;
    let outcome = loop {
        let frame = match decoder.decode(&mut buffer) {
            Ok(Some(frame)) => frame,
            Ok(None) => break HandshakeOutcome::Incomplete,
            Err(_) => break HandshakeOutcome::FrameError,
        };
        let response = start_ok_response(&frame);
        let mut step = handshake.on_frame(frame);
        if let Ok(HandshakeStep::Authenticate(request)) = &step {
            let answer = fuzz_login(request);
            step = handshake.on_login(Ok(answer), &mut out);
        }
        match step {
            Ok(HandshakeStep::Authenticate(_)) => panic!("a login answered twice"),
            Ok(HandshakeStep::Continue) => {
                if response.is_some() {
                    accepted_response = response;
                }
            }
            Ok(HandshakeStep::Open(negotiated)) => {
                check_negotiated(&config, &negotiated, peer_ip, accepted_response.as_deref());
                break HandshakeOutcome::Opened {
                    user: negotiated.user,
                };
            }
            Err(error) => {
                check_error(&error, true);
                write_connection_close(&error, &mut out);
                break HandshakeOutcome::Refused(error.code());
            }
        }
    };
    // Before tune-ok the client has agreed to no frame-max: what the server
    // sends must fit the spec's minimum.
    let written = server_frames(&out.take(), MIN_FRAME_MAX as usize);
    let mut methods = written.iter().map(|(channel, method)| {
        assert_eq!(*channel, 0, "a handshake method off channel 0");
        match method {
            AMQPClass::Connection(conn::AMQPMethod::Start(_)) => 's',
            AMQPClass::Connection(conn::AMQPMethod::Tune(_)) => 't',
            AMQPClass::Connection(conn::AMQPMethod::Close(_)) => 'c',
            other => panic!("the handshake wrote {other:?}"),
        }
    });
    let sequence: String = methods.by_ref().collect();
    let expected = match &outcome {
        HandshakeOutcome::Refused(_) => ["sc", "stc"].as_slice(),
        HandshakeOutcome::Opened { .. } => ["st"].as_slice(),
        _ => ["s", "st"].as_slice(),
    };
    assert!(
        expected.contains(&sequence.as_str()),
        "the server wrote {sequence:?} for {outcome:?}"
    );
    outcome
}

/// The SASL response of a frame that is a connection.start-ok.
fn start_ok_response(frame: &RawFrame) -> Option<Vec<u8>> {
    if frame.kind != FRAME_METHOD {
        return None;
    }
    match parse_method_checked(&frame.payload) {
        Some(AMQPClass::Connection(conn::AMQPMethod::StartOk(start_ok))) => {
            Some(start_ok.response.as_bytes().to_vec())
        }
        _ => None,
    }
}

fn check_negotiated(
    config: &GatewayConfig,
    negotiated: &Negotiated,
    peer: IpAddr,
    response: Option<&[u8]>,
) {
    let users = fuzz_users();
    let Some(user) = users.iter().find(|u| u.name == negotiated.user) else {
        panic!("logged in as unknown user {:?}", negotiated.user);
    };
    let Some(response) = response else {
        panic!("connection.open accepted without an accepted start-ok");
    };
    assert!(
        user.password.is_empty()
            || response
                .windows(user.password.len())
                .any(|w| w == user.password.as_bytes()),
        "{} logged in with a response that does not hold their password",
        user.name
    );
    assert!(
        !user.loopback_only || peer.is_loopback(),
        "{} logged in from a remote peer",
        user.name
    );
    assert!(
        (MIN_FRAME_MAX..=config.settings.frame_max).contains(&negotiated.frame_max),
        "negotiated frame-max {} outside {MIN_FRAME_MAX}..={}",
        negotiated.frame_max,
        config.settings.frame_max
    );
    assert!(
        (1..=config.settings.channel_max).contains(&negotiated.channel_max),
        "negotiated channel-max {} outside 1..={}",
        negotiated.channel_max,
        config.settings.channel_max
    );
}

/// An error that closes the connection carries a code a RabbitMQ client
/// knows, and one that is a connection error (soft codes close channels).
/// `in_handshake`: a refused login closes with 403.
fn check_error(error: &ConnectionError, in_handshake: bool) {
    assert_ne!(
        reply_name(error.code()),
        "ERROR",
        "unknown reply code {}",
        error.code()
    );
    let soft_allowed = in_handshake && error.code() == reply_code::ACCESS_REFUSED;
    assert!(
        !closes_only_the_channel(error.code()) || soft_allowed,
        "the connection closed with the channel-level code {} ({})",
        error.code(),
        error.text()
    );
    let mut out = FrameWriter::default();
    write_connection_close(error, &mut out);
    let written = server_frames(&out.take(), MIN_FRAME_MAX as usize);
    let [(0, AMQPClass::Connection(conn::AMQPMethod::Close(close)))] = written.as_slice() else {
        panic!("the error {error:?} did not become one connection.close: {written:?}");
    };
    assert_eq!(close.reply_code, error.code());
    assert!(
        close
            .reply_text
            .as_str()
            .starts_with(reply_name(error.code())),
        "reply text {:?} does not start with the code's name",
        close.reply_text
    );
}

// ------------------------------------------------------------ connection

#[derive(Debug, Default)]
pub struct ConnectionOutcome {
    /// Engine commands the frames became.
    pub commands: usize,
    /// Messages published.
    pub publishes: usize,
    /// How it ended: the client closed, the server closed with a code, or
    /// the input ran out.
    pub end: ConnectionEnd,
}

#[derive(Debug, Default, PartialEq)]
pub enum ConnectionEnd {
    #[default]
    Open,
    ClosedByClient,
    FrameError,
    Closed(u16),
}

/// Error codes the simulated engine answers with, soft and hard.
const ENGINE_ERRORS: [u16; 12] = [
    reply_code::NO_ROUTE,
    reply_code::ACCESS_REFUSED,
    reply_code::NOT_FOUND,
    reply_code::RESOURCE_LOCKED,
    reply_code::PRECONDITION_FAILED,
    reply_code::CONTENT_TOO_LARGE,
    reply_code::NOT_ALLOWED,
    reply_code::COMMAND_INVALID,
    reply_code::CHANNEL_ERROR,
    reply_code::RESOURCE_ERROR,
    reply_code::NOT_IMPLEMENTED,
    reply_code::INTERNAL_ERROR,
];

const CHANNEL_MAXES: [u16; 4] = [1, 2, 16, 2047];

/// The largest message the fuzzed connection accepts (small, so that the
/// fuzzer reaches the limit).
const FUZZ_MAX_MESSAGE: u64 = 20_000;

/// A connection after the handshake, fed frames. `data[0]`: bit 0 consumer
/// cancel notifications, bit 1 connection.blocked understood, bits 2-3 how
/// the simulated engine answers requests (0 at once with success, 1 never,
/// 2 with an error, 3 alternately), bit 4 producer flow control blocks the
/// connection after the first publish, bit 5 frame-max 131072 instead of
/// 4096, bits 6-7 channel-max (1, 2, 16, 2047). `data[1]`: bits 0-4 which
/// error code the engine uses, bit 5 the engine cancels each new consumer,
/// bit 6 it raises a channel error after each publish, bit 7 message
/// compression is on (bodies over 64 bytes). The rest: frames, as
/// after connection.open.
pub fn check_connection(data: &[u8]) -> ConnectionOutcome {
    let [options, engine_options, wire @ ..] = data else {
        return ConnectionOutcome::default();
    };
    let frame_max: u32 = if options & 0x20 != 0 { 131_072 } else { 4096 };
    let channel_max = CHANNEL_MAXES[usize::from(options >> 6)];
    let config = Arc::new(GatewayConfig {
        settings: GatewaySettings {
            max_message_size: FUZZ_MAX_MESSAGE,
            blocked_overdraft: 10_000,
            // Compressed publishes come back through basic.return decoded.
            message_compression_enabled: engine_options & 0x80 != 0,
            message_compression_threshold_size: 64,
            ..fuzz_config().settings
        },
        ..fuzz_config()
    });
    let negotiated = Negotiated {
        user: "guest".into(),
        vhost: "/".into(),
        client_properties: FieldTable::default(),
        capabilities: Capabilities {
            consumer_cancel_notify: options & 1 != 0,
            connection_blocked: options & 2 != 0,
        },
        frame_max,
        channel_max,
        heartbeat: 0,
    };
    let mut engine = FakeEngine {
        policy: (options >> 2) & 3,
        error_code: ENGINE_ERRORS[usize::from(engine_options & 0x1f) % ENGINE_ERRORS.len()],
        cancel_consumers: engine_options & 0x20 != 0,
        channel_errors: engine_options & 0x40 != 0,
        block_after_publish: options & 0x10 != 0,
        channel_max,
        confirm_seqs: HashMap::new(),
        answered: 0,
        // No property set: the flags alone.
        last_properties: vec![0, 0],
        outcome: ConnectionOutcome::default(),
    };
    let peer = SocketAddr::new(LOOPBACK, 40_000);
    let mut connection = Connection::new(config, negotiated, peer);
    let mut out = FrameWriter::default();
    let open = connection.open_session();
    let mut result = engine.settle(&mut connection, &mut out, vec![open]);
    let mut decoder = FrameDecoder {
        frame_max: frame_max as usize,
    };
    let mut buffer = BytesMut::from(wire);
    while result.is_ok() && engine.outcome.end == ConnectionEnd::Open {
        let frame = match decoder.decode(&mut buffer) {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(_) => {
                engine.outcome.end = ConnectionEnd::FrameError;
                break;
            }
        };
        if frame.kind == FRAME_METHOD {
            // The frame as the connection parses it: nothing deeper than
            // the limit may come out of the parser.
            parse_method_checked(&frame.payload);
        }
        let mut commands = Vec::new();
        match connection.on_frame(frame, &mut out, &mut commands) {
            Ok(Next::Continue) => {}
            Ok(Next::Closed) => engine.outcome.end = ConnectionEnd::ClosedByClient,
            Err(error) => {
                check_error(&error, false);
                engine.outcome.end = ConnectionEnd::Closed(error.code());
                break;
            }
        }
        result = engine.settle(&mut connection, &mut out, commands);
        assert!(
            connection.channel_count() <= usize::from(channel_max),
            "{} channels open with channel-max {channel_max}",
            connection.channel_count()
        );
    }
    if let Err(error) = result {
        // Only what the engine said may close the connection from its side.
        assert_eq!(
            error.code(),
            engine.error_code,
            "the connection closed with {error:?} after the engine said {}",
            engine.error_code
        );
        check_error(&error, false);
        engine.outcome.end = ConnectionEnd::Closed(error.code());
    }
    check_output(&out.take(), frame_max as usize);
    engine.outcome
}

/// An engine that answers every request as the real one could, so the
/// connection's state machines get past the first request.
struct FakeEngine {
    policy: u8,
    error_code: u16,
    cancel_consumers: bool,
    channel_errors: bool,
    block_after_publish: bool,
    channel_max: u16,
    /// The last confirm sequence number per channel.
    confirm_seqs: HashMap<u32, u64>,
    answered: u64,
    /// The properties of the last publish, delivered back.
    last_properties: Vec<u8>,
    outcome: ConnectionOutcome,
}

impl FakeEngine {
    /// Answers commands until the connection has nothing more to ask.
    fn settle(
        &mut self,
        connection: &mut Connection,
        out: &mut FrameWriter,
        commands: Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let mut todo = VecDeque::from(commands);
        let mut rounds = 0;
        while let Some(command) = todo.pop_front() {
            rounds += 1;
            assert!(
                rounds < 10_000,
                "the engine and the connection feed each other without end"
            );
            let Some(command) = command.command else {
                panic!("a session command without a command");
            };
            self.outcome.commands += 1;
            for event in self.answer(command) {
                let mut more = Vec::new();
                connection.on_event(event, out, &mut more)?;
                todo.extend(more);
            }
        }
        Ok(())
    }

    fn answer(&mut self, command: Command) -> Vec<SessionEvent> {
        let mut events = Vec::new();
        let (request_id, channel, success) = match command {
            Command::Open(open) => {
                // The session itself always opens.
                events.push(reply_event(
                    open.request_id,
                    reply::Result::Ok(pb::Empty {}),
                ));
                return events;
            }
            Command::ChannelOpen(m) => {
                self.check_channel(m.channel);
                self.confirm_seqs.remove(&m.channel);
                (m.request_id, m.channel, ok())
            }
            Command::ChannelClose(m) => (m.request_id, m.channel, ok()),
            Command::ExchangeDeclare(m) => (m.request_id, m.channel, ok()),
            Command::ExchangeDelete(m) => (m.request_id, m.channel, ok()),
            Command::ExchangeBind(m) | Command::ExchangeUnbind(m) => {
                (m.request_id, m.channel, ok())
            }
            Command::QueueBind(m) | Command::QueueUnbind(m) => (m.request_id, m.channel, ok()),
            Command::QueueDeclare(m) => {
                let queue = if m.queue.is_empty() {
                    "amq.gen-fuzz".to_string()
                } else {
                    m.queue
                };
                let result = reply::Result::QueueDeclareOk(pb::QueueDeclareOk {
                    queue,
                    message_count: 3,
                    consumer_count: 1,
                });
                (m.request_id, m.channel, result)
            }
            Command::QueuePurge(m) => (m.request_id, m.channel, count()),
            Command::QueueDelete(m) => (m.request_id, m.channel, count()),
            Command::Qos(m) => (m.request_id, m.channel, ok()),
            Command::Recover(m) => (m.request_id, m.channel, ok()),
            Command::ConfirmSelect(m) => (m.request_id, m.channel, ok()),
            // Transactions: the engine answers select, commit and rollback.
            Command::TxSelect(m) | Command::TxCommit(m) | Command::TxRollback(m) => {
                (m.request_id, m.channel, ok())
            }
            Command::Cancel(m) => (m.request_id, m.channel, ok()),
            Command::Consume(m) => {
                self.check_channel(m.channel);
                let tag = if m.consumer_tag.is_empty() {
                    "amq.ctag-fuzz".to_string()
                } else {
                    m.consumer_tag
                };
                let result = reply::Result::ConsumeOk(pb::ConsumeOk {
                    consumer_tag: tag.clone(),
                });
                let id = m.request_id;
                if self.succeeds() {
                    events.push(reply_event(id, result));
                    // A message for the new consumer, in more than one body
                    // frame at the smallest frame-max.
                    events.push(SessionEvent {
                        event: Some(Event::Deliver(pb::Deliver {
                            channel: m.channel,
                            consumer_tag: tag.clone(),
                            delivery_tag: 1,
                            exchange: "amq.direct".into(),
                            routing_key: "k".repeat(300),
                            properties: self.last_properties.clone().into(),
                            body: vec![7u8; 5000].into(),
                            ..Default::default()
                        })),
                    });
                    if self.cancel_consumers {
                        events.push(SessionEvent {
                            event: Some(Event::ConsumerCancelled(pb::ConsumerCancelled {
                                channel: m.channel,
                                consumer_tag: tag,
                            })),
                        });
                    }
                } else if let Some(event) = self.error_reply(id) {
                    events.push(event);
                }
                return events;
            }
            Command::Get(m) => {
                let result = if self.answered & 1 == 0 {
                    reply::Result::GetOk(pb::GetOk {
                        delivery_tag: 2,
                        exchange: "x".into(),
                        routing_key: "r".into(),
                        message_count: 1,
                        properties: self.last_properties.clone().into(),
                        body: vec![1u8; 9000].into(),
                        ..Default::default()
                    })
                } else {
                    reply::Result::GetEmpty(pb::Empty {})
                };
                (m.request_id, m.channel, result)
            }
            Command::Publish(publish) => {
                self.on_publish(publish, &mut events);
                return events;
            }
            Command::Ack(m) => {
                self.check_channel(m.channel);
                return events;
            }
            Command::Nack(m) => {
                self.check_channel(m.channel);
                return events;
            }
            other => panic!("the connection sent the engine {other:?}"),
        };
        self.check_channel(channel);
        if self.succeeds() {
            events.push(reply_event(request_id, success));
        } else if let Some(event) = self.error_reply(request_id) {
            events.push(event);
        }
        events
    }

    fn on_publish(&mut self, publish: pb::Publish, events: &mut Vec<SessionEvent>) {
        self.check_channel(publish.channel);
        self.outcome.publishes += 1;
        assert!(
            publish.body.len() as u64 <= FUZZ_MAX_MESSAGE,
            "a message of {} bytes passed max_message_size",
            publish.body.len()
        );
        // Compressed or not, the body decodes to the size it declares.
        match publish.body().decode(FUZZ_MAX_MESSAGE) {
            Ok(decoded) => assert_eq!(decoded.len() as u64, publish.body_size),
            Err(error) => panic!("the gateway published a body that does not decode: {error}"),
        }
        let properties = match basic::parse_properties(&publish.properties[..]) {
            Ok(([], properties)) => properties,
            other => panic!("published properties that do not parse: {other:?}"),
        };
        if let Some(headers) = properties.headers() {
            assert_within_nesting(&AMQPValue::FieldTable(headers.clone()));
        }
        assert_eq!(
            publish.persistent,
            properties.delivery_mode() == &Some(2),
            "persistent does not follow delivery-mode"
        );
        if let Some(user_id) = properties.user_id() {
            assert_eq!(user_id.as_str(), "guest", "a user_id other than the user's");
        }
        if publish.confirm_seq > 0 {
            let last = self.confirm_seqs.entry(publish.channel).or_default();
            assert_eq!(
                publish.confirm_seq,
                *last + 1,
                "confirm numbers skip or repeat"
            );
            *last = publish.confirm_seq;
            events.push(SessionEvent {
                event: Some(Event::Confirm(pb::Confirm {
                    channel: publish.channel,
                    seq: publish.confirm_seq,
                    ack: publish.confirm_seq & 3 != 0,
                })),
            });
        }
        if publish.mandatory {
            events.push(SessionEvent {
                event: Some(Event::Returned(pb::Return {
                    channel: publish.channel,
                    reply_code: u32::from(reply_code::NO_ROUTE),
                    reply_text: "NO_ROUTE".into(),
                    exchange: publish.exchange.clone(),
                    routing_key: publish.routing_key.clone(),
                    properties: publish.properties.clone(),
                    body: publish.body.clone(),
                    body_encoding: publish.body_encoding,
                    body_size: publish.body_size,
                })),
            });
        }
        self.last_properties = publish.properties.to_vec();
        if self.block_after_publish {
            events.push(SessionEvent {
                event: Some(Event::FlowControl(pb::FlowControl {
                    blocked: self.outcome.publishes & 3 != 0,
                    reason: "fuzz".into(),
                    ..Default::default()
                })),
            });
        }
        if self.channel_errors {
            events.push(SessionEvent {
                event: Some(Event::ChannelError(pb::ChannelError {
                    channel: publish.channel,
                    error: Some(
                        pb::AmqpError::new(self.error_code, "fuzz engine error")
                            .on(amqp::MethodId::BASIC_PUBLISH),
                    ),
                })),
            });
        }
    }

    /// Whether this request is answered with success (else with an error,
    /// or not at all).
    fn succeeds(&mut self) -> bool {
        self.answered += 1;
        match self.policy {
            0 => true,
            3 => self.answered & 1 == 0,
            _ => false,
        }
    }

    fn error_reply(&self, request_id: u64) -> Option<SessionEvent> {
        if self.policy == 1 {
            return None;
        }
        Some(reply_event(
            request_id,
            reply::Result::Error(pb::AmqpError::new(self.error_code, "fuzz engine refused")),
        ))
    }

    fn check_channel(&self, channel: u32) {
        assert!(
            (1..=u32::from(self.channel_max)).contains(&channel),
            "a command for channel {channel} with channel-max {}",
            self.channel_max
        );
    }
}

fn ok() -> reply::Result {
    reply::Result::Ok(pb::Empty {})
}

fn count() -> reply::Result {
    reply::Result::CountOk(pb::CountOk { message_count: 2 })
}

fn reply_event(request_id: u64, result: reply::Result) -> SessionEvent {
    SessionEvent {
        event: Some(Event::Reply(pb::Reply {
            request_id,
            result: Some(result),
        })),
    }
}

/// Everything the server wrote is frames within frame-max; methods parse;
/// a method with content is followed by one content header and body frames
/// that add up to its size.
fn check_output(bytes: &[u8], frame_max: usize) {
    let mut decoder = FrameDecoder { frame_max };
    let mut buffer = BytesMut::from(bytes);
    // Per channel: body bytes still expected, or None for "a header next".
    let mut content: HashMap<u16, Option<u64>> = HashMap::new();
    loop {
        let frame = match decoder.decode(&mut buffer) {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(error) => panic!("the server wrote something that is not a frame: {error}"),
        };
        match frame.kind {
            FRAME_METHOD => {
                assert!(
                    !content.contains_key(&frame.channel),
                    "a method inside content on channel {}",
                    frame.channel
                );
                let Some(method) = parse_method_checked(&frame.payload) else {
                    panic!("the server wrote a method it cannot parse");
                };
                if matches!(
                    method,
                    AMQPClass::Basic(
                        basic::AMQPMethod::Deliver(_)
                            | basic::AMQPMethod::GetOk(_)
                            | basic::AMQPMethod::Return(_)
                    )
                ) {
                    content.insert(frame.channel, None);
                }
            }
            FRAME_HEADER => {
                let Some(None) = content.get(&frame.channel) else {
                    panic!("a content header on channel {} out of place", frame.channel);
                };
                let Some(header) = codec::parse_content_header(&frame.payload) else {
                    panic!("the server wrote a malformed content header");
                };
                if header.body_size == 0 {
                    content.remove(&frame.channel);
                } else {
                    content.insert(frame.channel, Some(header.body_size));
                }
            }
            FRAME_BODY => {
                let Some(Some(left)) = content.get_mut(&frame.channel) else {
                    panic!("a body frame on channel {} out of place", frame.channel);
                };
                let size = frame.payload.len() as u64;
                assert!(size > 0 && size <= *left, "body frames overrun the size");
                *left -= size;
                if *left == 0 {
                    content.remove(&frame.channel);
                }
            }
            _ => {}
        }
    }
    assert!(buffer.is_empty(), "the server wrote half a frame");
    assert!(content.is_empty(), "content left unfinished: {content:?}");
}

// ------------------------------------------------------------ tables

#[derive(Debug, PartialEq)]
pub enum TablesOutcome {
    Empty,
    Table(Result<usize, nesting::NestingError>),
    Method(Result<(), codec::MethodError>),
    ContentHeader(Result<(), nesting::NestingError>),
    Amqplain(Result<String, auth::AuthError>),
}

/// Inputs up to this size are parsed even when the nesting check refuses
/// them, to compare the check with the parser: they cannot nest deeper than
/// a few hundred levels (each level takes at least 5 bytes), which no stack
/// minds.
const COMPARE_BELOW: usize = 1024;

/// `data[0] % 4` picks the parser, the rest is its input: 0 a field table
/// (the nesting check, then `amqp::decode_table`), 1 a method frame's
/// payload (`codec::parse_method`), 2 a content header's payload (the nesting
/// check and the properties parser), 3 an AMQPLAIN response.
pub fn check_tables(data: &[u8]) -> TablesOutcome {
    let Some((which, bytes)) = data.split_first() else {
        return TablesOutcome::Empty;
    };
    match which % 4 {
        0 => TablesOutcome::Table(check_field_table(bytes)),
        1 => TablesOutcome::Method(check_method_payload(bytes)),
        2 => TablesOutcome::ContentHeader(check_content_header(bytes)),
        _ => TablesOutcome::Amqplain(check_amqplain(bytes)),
    }
}

fn check_field_table(bytes: &[u8]) -> Result<usize, nesting::NestingError> {
    let checked = nesting::check_table(bytes, nesting::MAX_NESTING);
    // What the engine does with table bytes it is sent: refuse or decode,
    // never more than MAX_NESTING deep.
    if let Ok(table) = amqp::decode_table(bytes) {
        let depth = assert_within_nesting(&AMQPValue::FieldTable(table.clone()));
        // Re-encoding gives a table that decodes to the same bytes again.
        let encoded = amqp::encode_table(&table);
        match amqp::decode_table(&encoded) {
            Ok(again) => assert_eq!(
                amqp::encode_table(&again),
                encoded,
                "a table does not survive encode and decode"
            ),
            Err(error) => panic!("an encoded table does not decode: {error:?}"),
        }
        if !bytes.is_empty() {
            // The check agrees on the length and never counts less depth
            // than the parser produced (it may count more: a repeated key
            // keeps only its last value in the parsed table).
            assert_eq!(checked, Ok(bytes.len()), "check and parser disagree");
            assert_eq!(
                nesting::check_table(bytes, depth - 1),
                Err(nesting::NestingError::TooDeep { limit: depth - 1 }),
                "the check counts less than depth {depth}"
            );
        }
    }
    match checked {
        Ok(length) => {
            let prefix = bytes
                .get(..4)
                .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
            assert_eq!(prefix.map(|p| p as usize + 4), Some(length));
            // Safe to parse: the check bounded the depth.
            if let Ok((rest, table)) =
                amq_protocol::types::parsing::parse_field_table(&bytes[..length])
            {
                assert!(rest.is_empty(), "the parser stopped inside the table");
                assert_within_nesting(&AMQPValue::FieldTable(table));
            }
        }
        Err(_) if bytes.len() < COMPARE_BELOW => {
            // The check never calls malformed what the parser reads.
            if amq_protocol::types::parsing::parse_field_table(bytes).is_ok() {
                assert_eq!(
                    checked,
                    Err(nesting::NestingError::TooDeep {
                        limit: nesting::MAX_NESTING
                    }),
                    "the check refused a table the parser reads"
                );
            }
        }
        Err(_) => {}
    }
    checked
}

fn check_method_payload(bytes: &[u8]) -> Result<(), codec::MethodError> {
    match codec::parse_method(bytes) {
        Ok(method) => {
            for table in method_tables(&method) {
                assert_within_nesting(&AMQPValue::FieldTable(table.clone()));
            }
            Ok(())
        }
        Err(error) => Err(error),
    }
}

fn check_content_header(bytes: &[u8]) -> Result<(), nesting::NestingError> {
    let checked = nesting::check_content_header(bytes, nesting::MAX_NESTING);
    // What the gateway does: a header that is not too deep goes on to the
    // properties parser when its message is complete.
    if matches!(checked, Err(nesting::NestingError::TooDeep { .. })) {
        return checked;
    }
    let Some(header) = codec::parse_content_header(&bytes::Bytes::copy_from_slice(bytes)) else {
        return checked;
    };
    // The engine reads a priority queue's message priority by hand: never a
    // panic, whatever the bytes, and on a property list the gateway accepts
    // (the parser takes all of it) the same answer as the parser.
    let priority = spillway_amqp::properties::priority(&header.properties);
    if let Ok((rest, properties)) = basic::parse_properties(&header.properties[..]) {
        if rest.is_empty() {
            assert_eq!(
                priority,
                *properties.priority(),
                "the hand-read priority differs from the parser's"
            );
        }
        if let Some(headers) = properties.headers() {
            assert_within_nesting(&AMQPValue::FieldTable(headers.clone()));
        }
    }
    checked
}

fn check_amqplain(bytes: &[u8]) -> Result<String, auth::AuthError> {
    let users = fuzz_users();
    let result = auth::login_request("AMQPLAIN", bytes, LOOPBACK, None)
        .and_then(|request| auth::login_outcome(request.user.clone(), fuzz_login(&request)));
    if let Ok(user) = &result {
        let Some(user) = users.iter().find(|u| u.name == user) else {
            panic!("AMQPLAIN logged in unknown user {user:?}");
        };
        assert!(
            user.password.is_empty()
                || bytes
                    .windows(user.password.len())
                    .any(|w| w == user.password.as_bytes()),
            "AMQPLAIN accepted {} without their password",
            user.name
        );
    }
    result
}

/// The field tables a parsed method carries.
fn method_tables(method: &AMQPClass) -> Vec<&FieldTable> {
    match method {
        AMQPClass::Connection(conn::AMQPMethod::Start(m)) => vec![&m.server_properties],
        AMQPClass::Connection(conn::AMQPMethod::StartOk(m)) => vec![&m.client_properties],
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(m)) => vec![&m.arguments],
        AMQPClass::Exchange(exchange::AMQPMethod::Bind(m)) => vec![&m.arguments],
        AMQPClass::Exchange(exchange::AMQPMethod::Unbind(m)) => vec![&m.arguments],
        AMQPClass::Queue(queue::AMQPMethod::Declare(m)) => vec![&m.arguments],
        AMQPClass::Queue(queue::AMQPMethod::Bind(m)) => vec![&m.arguments],
        AMQPClass::Queue(queue::AMQPMethod::Unbind(m)) => vec![&m.arguments],
        AMQPClass::Basic(basic::AMQPMethod::Consume(m)) => vec![&m.arguments],
        _ => Vec::new(),
    }
}

/// `codec::parse_method`, and the check that whatever it parsed nests within
/// the limit.
fn parse_method_checked(payload: &[u8]) -> Option<AMQPClass> {
    // basic.publish and basic.ack are read by hand: always as amq-protocol
    // reads them, behind the same nesting check.
    let method = codec::parse_method(payload);
    let reference = codec::parse_method_by_amq_protocol(payload);
    // Compared as text where `==` says no: a float argument may be NaN,
    // which equals nothing, not even the same NaN read by the other path.
    if method != reference {
        assert_eq!(
            format!("{method:?}"),
            format!("{reference:?}"),
            "parse_method differs from amq-protocol"
        );
    }
    let method = method.ok()?;
    for table in method_tables(&method) {
        assert_within_nesting(&AMQPValue::FieldTable(table.clone()));
    }
    Some(method)
}

/// How deep tables and arrays nest in `value` (a table alone is 1), counted
/// without recursion.
fn nesting_depth(value: &AMQPValue) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((value, depth)) = stack.pop() {
        match value {
            AMQPValue::FieldTable(table) => {
                deepest = deepest.max(depth + 1);
                stack.extend(table.inner().values().map(|v| (v, depth + 1)));
            }
            AMQPValue::FieldArray(array) => {
                deepest = deepest.max(depth + 1);
                stack.extend(array.as_slice().iter().map(|v| (v, depth + 1)));
            }
            _ => {}
        }
    }
    deepest
}

/// Panics if a parsed value nests deeper than the limit: the recursive
/// parser ran on something the nesting check should have refused first.
fn assert_within_nesting(value: &AMQPValue) -> usize {
    let depth = nesting_depth(value);
    assert!(
        depth <= nesting::MAX_NESTING,
        "a table {depth} deep reached the recursive parser (limit {})",
        nesting::MAX_NESTING
    );
    depth
}

/// Reads frames the server wrote: each within `frame_max`, each method
/// parsed.
fn server_frames(bytes: &[u8], frame_max: usize) -> Vec<(u16, AMQPClass)> {
    let mut decoder = FrameDecoder { frame_max };
    let mut buffer = BytesMut::from(bytes);
    let mut methods = Vec::new();
    loop {
        match decoder.decode(&mut buffer) {
            Ok(Some(frame)) if frame.kind == FRAME_METHOD => {
                let Some(method) = parse_method_checked(&frame.payload) else {
                    panic!("the server wrote a method it cannot parse");
                };
                methods.push((frame.channel, method));
            }
            Ok(Some(frame)) => panic!("the server wrote a non-method frame {frame:?}"),
            Ok(None) => break,
            Err(error) => panic!("the server wrote something that is not a frame: {error}"),
        }
    }
    assert!(buffer.is_empty(), "the server wrote half a frame");
    methods
}

// ------------------------------------------------------------ bodies

#[derive(Debug, PartialEq)]
pub enum BodiesOutcome {
    Empty,
    /// A compressed body from anywhere (a store record, the engine): decoded
    /// to this many bytes, or refused.
    Decoded(Result<usize, BodyError>),
    /// A published body compressed and decoded again: compressed or kept.
    RoundTrip {
        compressed: bool,
    },
}

/// The largest body the `bodies` target lets a declared size claim.
const FUZZ_BODY_MAX: u64 = 1 << 20;

/// `data[0] % 2` picks: 0 decode `data[6..]` as held bytes with encoding
/// `data[1]` (0 identity, 1 lz4, other unknown) and the declared size
/// `data[2..6]` (u32 LE): never a panic; a success is exactly the declared
/// size, within [`FUZZ_BODY_MAX`]. 1 compress `data[2..]` above the
/// threshold `data[1]` × 16 bytes and decode it again: the same bytes.
pub fn check_bodies(data: &[u8]) -> BodiesOutcome {
    match data {
        [mode, encoding, size @ ..] if mode % 2 == 0 && size.len() >= 4 => {
            let declared = u64::from(u32::from_le_bytes([size[0], size[1], size[2], size[3]]));
            let held = Bytes::copy_from_slice(&size[4..]);
            let body = Body::from_wire(held.clone(), u32::from(*encoding), declared);
            let decoded = body.decode(FUZZ_BODY_MAX);
            if let Ok(bytes) = &decoded {
                assert!(bytes.len() as u64 <= FUZZ_BODY_MAX.max(held.len() as u64));
                assert_eq!(bytes.len() as u64, body.size(), "decoded to another size");
                if !body.is_compressed() {
                    assert_eq!(bytes, &held, "an identity body changed");
                }
            }
            BodiesOutcome::Decoded(decoded.map(|bytes| bytes.len()))
        }
        [mode, threshold, published @ ..] if mode % 2 == 1 => {
            let published = Bytes::copy_from_slice(published);
            let body = Body::compress_above(published.clone(), u64::from(*threshold) * 16);
            assert_eq!(body.size(), published.len() as u64);
            assert!(
                body.stored_len() <= published.len() as u64,
                "compression grew a body"
            );
            match body.decode(published.len() as u64) {
                Ok(bytes) => assert_eq!(bytes, published, "a body did not round-trip"),
                Err(error) => panic!("a body the gateway compressed does not decode: {error}"),
            }
            BodiesOutcome::RoundTrip {
                compressed: body.is_compressed(),
            }
        }
        _ => BodiesOutcome::Empty,
    }
}

// ------------------------------------------------------------ seeds

/// One committed seed: real traffic for a target to start from, and what
/// its check must report for it (a substring of the outcome's `Debug`), so
/// a seed that stops reaching deep states fails the regression test.
pub struct Seed {
    pub target: &'static str,
    pub name: &'static str,
    pub bytes: Vec<u8>,
    pub expect: &'static str,
}

/// The seeds under `fuzz/corpus-seeds/`, made with amq-protocol's encoder.
/// Headers for the priority seed: one entry before the priority to skip.
fn headers_for_priority() -> FieldTable {
    let mut headers = FieldTable::default();
    headers.insert("k".into(), AMQPValue::LongString("v".into()));
    headers
}

pub fn seeds() -> Vec<Seed> {
    let guest_plain = start_ok("PLAIN", b"\0guest\0guest", FieldTable::default());
    let mut login = Vec::new();
    login.extend_from_slice(&short_string_entry("LOGIN", FUZZ_USER));
    login.extend_from_slice(&short_string_entry("PASSWORD", FUZZ_PASSWORD));
    let fuzz_amqplain = start_ok("AMQPLAIN", &login, client_properties());
    let tune_ok = method(
        0,
        AMQPClass::Connection(conn::AMQPMethod::TuneOk(conn::TuneOk {
            channel_max: 0,
            frame_max: 131_072,
            heartbeat: 60,
        })),
    );
    let open = method(
        0,
        AMQPClass::Connection(conn::AMQPMethod::Open(conn::Open {
            virtual_host: "/".into(),
        })),
    );
    let handshake = |options: u8, start_ok: &[u8]| {
        let mut bytes = vec![options];
        bytes.extend_from_slice(PROTOCOL_HEADER);
        bytes.extend_from_slice(start_ok);
        bytes.extend_from_slice(&tune_ok);
        bytes.extend_from_slice(&open);
        bytes
    };
    let wrong = start_ok("PLAIN", b"\0guest\0wrong", FieldTable::default());

    let channel_open = method(1, AMQPClass::Channel(chan::AMQPMethod::Open(chan::Open {})));
    let confirm_select = method(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    );
    let mut declare_arguments = FieldTable::default();
    declare_arguments.insert("x-max-length".into(), AMQPValue::LongInt(10));
    declare_arguments.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let declare = method(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q".into(),
            durable: true,
            arguments: declare_arguments,
            ..Default::default()
        })),
    );
    let consume = method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: "q".into(),
            consumer_tag: "c".into(),
            ..Default::default()
        })),
    );
    let publish = method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "q".into(),
            mandatory: true,
            ..Default::default()
        })),
    );
    let mut headers = FieldTable::default();
    headers.insert("h".into(), AMQPValue::LongString("v".into()));
    let properties = basic::AMQPProperties::default()
        .with_content_type("text/plain".into())
        .with_headers(headers)
        .with_delivery_mode(2)
        .with_user_id("guest".into());
    let mut content = FrameWriter::default();
    content.content(1, &encoded_properties(&properties), &[b'x'; 5000], 4096);
    let content = content.take().to_vec();
    let get = method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "q".into(),
            no_ack: false,
        })),
    );
    let ack = method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 1,
            multiple: false,
        })),
    );
    let channel_close = method(
        1,
        AMQPClass::Channel(chan::AMQPMethod::Close(chan::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    );
    let connection_close = method(
        0,
        AMQPClass::Connection(conn::AMQPMethod::Close(conn::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    );
    let session: Vec<u8> = [
        &channel_open[..],
        &confirm_select,
        &declare,
        &consume,
        &publish,
        &content,
        &get,
        &ack,
        &channel_close,
        &connection_close,
    ]
    .concat();
    let mut session_seed = vec![0x20, 0];
    session_seed.extend_from_slice(&session);
    let mut refusing_seed = vec![0x0b, 4];
    refusing_seed.extend_from_slice(&session);

    let deep = deep_table(nesting::MAX_NESTING + 1);
    let fine = deep_table(nesting::MAX_NESTING);
    let mut deep_start_ok = vec![0, 10, 0, 11];
    deep_start_ok.extend_from_slice(&deep);
    let mut header = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0x20, 0];
    header.extend_from_slice(&fine);
    // A property list with the fields before `priority` that the engine's
    // hand reader skips (content type, headers, delivery mode).
    let mut priority_header = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5];
    priority_header.extend_from_slice(&encoded_properties(
        &basic::AMQPProperties::default()
            .with_content_type("text/plain".into())
            .with_headers(headers_for_priority())
            .with_delivery_mode(2)
            .with_priority(7),
    ));
    let mut deep_frames = vec![2, 0];
    deep_frames.extend_from_slice(&frame(FRAME_METHOD, 0, &deep_start_ok));
    deep_frames.extend_from_slice(&frame(FRAME_HEARTBEAT, 0, &[]));

    let with = |tag: u8, bytes: &[u8]| [&[tag][..], bytes].concat();
    // 4000 bytes of text, and the lz4 block the gateway makes of it.
    let text: Vec<u8> = b"spillway holds large bodies compressed; "
        .iter()
        .copied()
        .cycle()
        .take(4000)
        .collect();
    let (lz4, _, _) = Body::compress_above(Bytes::from(text.clone()), 0).wire();
    let mut seeds = vec![
        Seed {
            target: "frame_decoder",
            name: "publish-header-body",
            bytes: [&[3, 0][..], &publish, &content].concat(),
            expect: "frames: 4, end: Clean",
        },
        Seed {
            target: "frame_decoder",
            name: "deep-start-ok-in-small-reads",
            bytes: [&[3, 5][..], &deep_frames[2..]].concat(),
            expect: "frames: 2, end: Clean",
        },
        Seed {
            target: "handshake",
            name: "guest-plain",
            bytes: handshake(0, &guest_plain),
            expect: "Opened { user: \"guest\" }",
        },
        Seed {
            target: "handshake",
            name: "amqplain-from-remote",
            bytes: handshake(1, &fuzz_amqplain),
            expect: "Opened { user: \"fuzz\" }",
        },
        Seed {
            target: "handshake",
            name: "guest-from-remote",
            bytes: handshake(1, &guest_plain),
            expect: "Refused(403)",
        },
        Seed {
            target: "handshake",
            name: "wrong-password",
            bytes: handshake(0, &wrong),
            expect: "Refused(403)",
        },
        Seed {
            target: "connection",
            name: "publish-consume-get",
            bytes: session_seed,
            expect: "publishes: 1, end: ClosedByClient",
        },
        Seed {
            target: "connection",
            name: "engine-refuses",
            bytes: refusing_seed,
            expect: "publishes: 0, end: ClosedByClient",
        },
        Seed {
            target: "tables",
            name: "table-at-the-limit",
            bytes: with(0, &fine),
            expect: "Table(Ok(",
        },
        Seed {
            target: "tables",
            name: "table-past-the-limit",
            bytes: with(0, &deep),
            expect: "TooDeep",
        },
        Seed {
            target: "tables",
            name: "deep-start-ok",
            bytes: with(1, &deep_start_ok),
            expect: "Method(Err(TooDeep))",
        },
        Seed {
            target: "tables",
            name: "declare",
            bytes: with(1, &declare[7..declare.len() - 1]),
            expect: "Method(Ok(()))",
        },
        Seed {
            target: "tables",
            name: "content-header",
            bytes: with(2, &header),
            expect: "ContentHeader(Ok(()))",
        },
        Seed {
            target: "tables",
            name: "content-header-priority",
            bytes: with(2, &priority_header),
            expect: "ContentHeader(Ok(()))",
        },
        Seed {
            target: "tables",
            name: "amqplain",
            bytes: with(3, &login),
            expect: "Amqplain(Ok(\"fuzz\"))",
        },
        Seed {
            target: "bodies",
            name: "lz4-body",
            bytes: held_body(1, text.len() as u32, &lz4),
            expect: "Decoded(Ok(4000))",
        },
        Seed {
            target: "bodies",
            name: "lz4-body-declared-one-short",
            bytes: held_body(1, text.len() as u32 - 1, &lz4),
            expect: "Decoded(Err(",
        },
        Seed {
            target: "bodies",
            name: "lz4-body-truncated",
            bytes: held_body(1, text.len() as u32, &lz4[..lz4.len() / 2]),
            expect: "Decoded(Err(",
        },
        Seed {
            target: "bodies",
            name: "identity-body",
            bytes: held_body(0, 0, b"as published"),
            expect: "Decoded(Ok(12))",
        },
        Seed {
            target: "bodies",
            name: "compress-text",
            bytes: [&[1, 1][..], &text[..]].concat(),
            expect: "RoundTrip { compressed: true }",
        },
    ];
    seeds.extend(amqp1_seeds());
    seeds
}

/// A `bodies` input that decodes `held` as `encoding` declaring `size`.
fn held_body(encoding: u8, size: u32, held: &[u8]) -> Vec<u8> {
    [&[0, encoding][..], &size.to_le_bytes()[..], held].concat()
}

fn method(channel: u16, method: AMQPClass) -> Vec<u8> {
    let mut out = FrameWriter::default();
    out.method(channel, method);
    out.take().to_vec()
}

fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut bytes = vec![kind];
    bytes.extend_from_slice(&channel.to_be_bytes());
    bytes.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    bytes.extend_from_slice(payload);
    bytes.push(FRAME_END);
    bytes
}

fn start_ok(mechanism: &str, response: &[u8], client_properties: FieldTable) -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(conn::AMQPMethod::StartOk(conn::StartOk {
            client_properties,
            mechanism: mechanism.into(),
            response: LongString::from(response.to_vec()),
            locale: "en_US".into(),
        })),
    )
}

/// Client properties as lapin sends them, capabilities included.
fn client_properties() -> FieldTable {
    let mut capabilities = FieldTable::default();
    for name in [
        "consumer_cancel_notify",
        "connection.blocked",
        "publisher_confirms",
    ] {
        capabilities.insert(name.into(), AMQPValue::Boolean(true));
    }
    let mut properties = FieldTable::default();
    properties.insert("product".into(), AMQPValue::LongString("lapin".into()));
    properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
    properties.insert(
        "list".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::ShortInt(1)])),
    );
    properties
}

fn short_string_entry(name: &str, value: &str) -> Vec<u8> {
    let mut bytes = vec![name.len() as u8];
    bytes.extend_from_slice(name.as_bytes());
    bytes.push(b'S');
    bytes.extend_from_slice(&(value.len() as u32).to_be_bytes());
    bytes.extend_from_slice(value.as_bytes());
    bytes
}

fn encoded_properties(properties: &basic::AMQPProperties) -> Vec<u8> {
    match basic::gen_properties(properties)(WriteContext::from(Vec::new())) {
        Ok(context) => context.write,
        Err(error) => panic!("could not encode properties: {error}"),
    }
}

/// A table nested `depth` levels deep, written straight out: each level one
/// entry named "k" holding the next table.
fn deep_table(depth: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(7 * depth);
    for level in (2..=depth).rev() {
        let content = 7 * (level - 1) as u32;
        bytes.extend_from_slice(&content.to_be_bytes());
        bytes.extend_from_slice(&[1, b'k', b'F']);
    }
    bytes.extend_from_slice(&[0, 0, 0, 0]);
    bytes
}

// ------------------------------------------------------------ amqp1

/// What one `amqp1` input did.
#[derive(Debug)]
pub enum Amqp1Outcome {
    SaslInit(Result<String, String>),
    Open(Result<String, String>),
    Address { target: bool, source: bool },
    Message(Result<usize, String>),
    Delivered { application_properties: usize },
    Guarded { passed: bool },
    Empty,
}

/// `data[0] % 6` picks what the rest is: a `sasl-init` body, an `open`
/// body, an address, an encoded 1.0 message (mapped to 0-9-1 and back),
/// 0-9-1 properties delivered to a 1.0 client, or a frame stream through
/// the frame guard. Nothing may panic; what maps must map back; values the
/// decoder sees nest no deeper than the guard allows.
pub fn check_amqp1(data: &[u8]) -> Amqp1Outcome {
    use fe2o3_amqp_types::messaging::{AmqpValue, Body, Message};
    use fe2o3_amqp_types::primitives::Value;
    use spillway_gateway::amqp1::{address, guard, handshake, mapping};
    let Some((mode, rest)) = data.split_first() else {
        return Amqp1Outcome::Empty;
    };
    // serde_amqp recurses once per nesting level: deep input is refused
    // before it decodes (what the gateway's frame guard does for frames).
    if mode % 6 == 5 {
        // A byte stream after the protocol header, through the frame guard
        // in pieces of `rest[0]` bytes: what passes must be whole frames.
        let Some((piece, stream)) = rest.split_first() else {
            return Amqp1Outcome::Empty;
        };
        let mut frames = guard::FrameGuard::new(tokio::io::empty(), 4096);
        let mut passed = true;
        let mut header = b"AMQP\x00\x01\x00\x00".to_vec();
        header.extend_from_slice(stream);
        for chunk in header.chunks(usize::from(*piece).max(1)) {
            if frames.absorb(chunk).is_err() {
                passed = false;
                break;
            }
        }
        return Amqp1Outcome::Guarded { passed };
    }
    // Encoded 1.0 values reach the decoder only after the guard's scan.
    let encoded = matches!(mode % 6, 0 | 1 | 3);
    if encoded && guard::nesting_depth(rest).is_err() {
        return Amqp1Outcome::Empty;
    }
    match mode % 6 {
        0 => Amqp1Outcome::SaslInit(
            handshake::decode_init(rest)
                .map(|init| init.mechanism)
                .map_err(|error| error.to_string()),
        ),
        1 => Amqp1Outcome::Open(
            handshake::decode_open(rest)
                .map(|open| {
                    let vhost = handshake::vhost_of(open.hostname.as_deref()).to_string();
                    assert!(
                        vhost == "/"
                            || open
                                .hostname
                                .as_deref()
                                .is_some_and(|h| h.ends_with(&vhost))
                    );
                    vhost
                })
                .map_err(|error| error.to_string()),
        ),
        2 => {
            let text = String::from_utf8_lossy(rest);
            let target = address::parse_target(&text);
            let source = address::parse_source(&text);
            if let Ok(queue) = &source {
                assert!(queue.len() <= address::MAX_NAME);
                let again =
                    address::parse_source(&format!("/queues/{}", address::percent_encode(queue)));
                assert_eq!(again.as_ref(), Ok(queue), "a queue name did not round-trip");
            }
            Amqp1Outcome::Address {
                target: target.is_ok(),
                source: source.is_ok(),
            }
        }
        3 => {
            use fe2o3_amqp_types::messaging::message::__private::Deserializable;
            quiet_serde_amqp_panics();
            let Ok(Deserializable(message)) =
                serde_amqp::from_slice::<Deserializable<Message<Body<Value>>>>(rest)
            else {
                return Amqp1Outcome::Message(Err("does not decode".into()));
            };
            let sent = message.body.clone();
            match mapping::from_amqp1(message) {
                Ok(published) => {
                    let back =
                        mapping::to_amqp1(&published.properties, published.body.clone(), false);
                    // No body, or a data batch of no sections, comes back
                    // as one empty data section.
                    // Bodies carried as bytes must come back exactly. Other
                    // amqp-values are re-encoded by serde_amqp, whose
                    // round trip changes some types in odd maps (a long
                    // beside a timestamp key came back a timestamp):
                    // docs/amqp-1.0.md says so.
                    let exact = match &sent {
                        Body::Data(sections) => !sections.is_empty(),
                        Body::Value(AmqpValue(Value::Binary(_) | Value::String(_))) => true,
                        _ => false,
                    };
                    if exact {
                        assert_eq!(back.body, sent, "a body did not come back as sent");
                    }
                    Amqp1Outcome::Message(Ok(published.body.len()))
                }
                Err(error) => Amqp1Outcome::Message(Err(error.to_string())),
            }
        }
        _ => {
            let message = mapping::to_amqp1(rest, Bytes::from_static(b"body"), true);
            Amqp1Outcome::Delivered {
                application_properties: message
                    .application_properties
                    .map_or(0, |properties| properties.0.len()),
            }
        }
    }
}

/// serde_amqp panics on some values it decoded itself; the gateway catches
/// that panic (`mapping::encoded`) and refuses the message. libFuzzer's
/// panic hook aborts on every panic, caught or not, so panics raised in
/// serde_amqp go quiet here; any other still aborts through the old hook,
/// and one serde_amqp panic the gateway did not catch still ends the run
/// (it cannot unwind out of the fuzzer's entry point).
fn quiet_serde_amqp_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let aborting = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let in_serde_amqp = info
                .location()
                .is_some_and(|location| location.file().contains("serde_amqp"));
            if !in_serde_amqp {
                aborting(info);
            }
        }));
    });
}

fn amqp1_seeds() -> Vec<Seed> {
    use fe2o3_amqp_types::messaging::message::__private::Serializable;
    use fe2o3_amqp_types::messaging::{
        AmqpValue, ApplicationProperties, Body, Data, Header, Message, Properties,
    };
    use fe2o3_amqp_types::performatives::Open;
    use fe2o3_amqp_types::primitives::{Binary, OrderedMap, SimpleValue, Symbol, Value};
    use fe2o3_amqp_types::sasl::SaslInit;
    let encode = |value: &dyn erased::Encode| value.encode();
    let init = SaslInit {
        mechanism: Symbol::from("PLAIN"),
        initial_response: Some(Binary::from(b"\0guest\0guest".to_vec())),
        hostname: None,
    };
    let open = Open {
        container_id: "fuzz".into(),
        hostname: Some("vhost:shop".into()),
        max_frame_size: 65536.into(),
        channel_max: 16.into(),
        idle_time_out: Some(30_000),
        outgoing_locales: None,
        incoming_locales: None,
        offered_capabilities: None,
        desired_capabilities: None,
        properties: None,
    };
    let mut application = OrderedMap::new();
    application.insert("region".to_string(), SimpleValue::String("eu".into()));
    application.insert("n".to_string(), SimpleValue::Long(3));
    let message: Message<Body<Value>> = Message {
        header: Some(Header {
            durable: true,
            priority: 5.into(),
            ttl: Some(1000),
            first_acquirer: false,
            delivery_count: 0,
        }),
        delivery_annotations: None,
        message_annotations: None,
        properties: Some(Properties {
            message_id: Some("m-1".to_string().into()),
            subject: Some("orders".into()),
            content_type: Some(Symbol::from("text/plain")),
            ..Default::default()
        }),
        application_properties: Some(ApplicationProperties(application)),
        body: Body::Data(vec![Data(Binary::from(b"hello".to_vec()))].into()),
        footer: None,
    };
    let value_message: Message<Body<Value>> = Message::builder()
        .body(Body::Value(AmqpValue(Value::List(vec![
            Value::Int(1),
            Value::String("two".into()),
        ]))))
        .build();
    let headers = {
        let mut table = FieldTable::default();
        table.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        table.insert("x-delivery-count".into(), AMQPValue::LongLongInt(2));
        basic::AMQPProperties::default()
            .with_headers(table)
            .with_delivery_mode(2)
    };
    vec![
        Seed {
            target: "amqp1",
            name: "sasl-init-plain",
            bytes: [&[0][..], &encode(&init)].concat(),
            expect: "SaslInit(Ok(\"PLAIN\"))",
        },
        Seed {
            target: "amqp1",
            name: "open-vhost",
            bytes: [&[1][..], &encode(&open)].concat(),
            expect: "Open(Ok(\"shop\"))",
        },
        Seed {
            target: "amqp1",
            name: "address-queue",
            bytes: [&[2][..], b"/queues/my%20queue"].concat(),
            expect: "Address { target: true, source: true }",
        },
        Seed {
            target: "amqp1",
            name: "address-exchange",
            bytes: [&[2][..], b"/exchanges/amq.topic/a.b"].concat(),
            expect: "Address { target: true, source: false }",
        },
        Seed {
            target: "amqp1",
            name: "message-data",
            bytes: [&[3][..], &encode(&Serializable(message))].concat(),
            expect: "Message(Ok(5))",
        },
        Seed {
            target: "amqp1",
            name: "message-value",
            bytes: [&[3][..], &encode(&Serializable(value_message))].concat(),
            expect: "Message(Ok(",
        },
        Seed {
            target: "amqp1",
            name: "delivered-properties",
            bytes: [&[4][..], &encoded_properties(&headers)].concat(),
            expect: "Delivered { application_properties: 2 }",
        },
    ]
}

/// Encoding the seeds' 1.0 values through one signature.
mod erased {
    pub trait Encode {
        fn encode(&self) -> Vec<u8>;
    }

    impl<T: serde::Serialize> Encode for T {
        fn encode(&self) -> Vec<u8> {
            match serde_amqp::to_vec(self) {
                Ok(bytes) => bytes,
                Err(error) => panic!("a seed does not encode: {error}"),
            }
        }
    }
}
