//! The connection state machines driven with frames, as the I/O loop drives
//! them, without a socket or an engine: frames are built and read back with
//! the codec (amq-protocol underneath).

use std::net::SocketAddr;
use std::sync::Arc;

use amq_protocol::protocol::{basic, channel as chan, connection as conn, AMQPClass};
use amq_protocol::types::FieldTable;
use bytes::BytesMut;
use spillway_amqp::{reply_code, MethodId};
use spillway_proto::engine::{self as pb, reply, session_command::Command, session_event::Event};
use spillway_proto::engine::{LoginResult, SessionCommand, SessionEvent};
use tokio_util::codec::Decoder;

use super::*;
use crate::GatewaySettings;
use spillway_amqp::codec::{FrameDecoder, FRAME_BODY, FRAME_HEADER, FRAME_METHOD};

fn peer() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 5672))
}

/// Everything written so far, split back into frames.
fn written(out: &mut FrameWriter) -> Vec<RawFrame> {
    let mut decoder = FrameDecoder { frame_max: 1 << 20 };
    let mut bytes = BytesMut::from(&out.take()[..]);
    let mut frames = Vec::new();
    while let Ok(Some(frame)) = decoder.decode(&mut bytes) {
        frames.push(frame);
    }
    assert!(bytes.is_empty(), "trailing bytes that are not a frame");
    frames
}

/// The methods among `frames`, parsed.
fn methods(frames: &[RawFrame]) -> Vec<(u16, AMQPClass)> {
    frames
        .iter()
        .filter(|frame| frame.kind == FRAME_METHOD)
        .filter_map(|frame| Some((frame.channel, codec::parse_method(&frame.payload).ok()?)))
        .collect()
}

fn method_frame(channel: u16, method: AMQPClass) -> RawFrame {
    let mut out = FrameWriter::default();
    out.method(channel, method);
    let mut frames = written(&mut out);
    assert_eq!(frames.len(), 1);
    frames.remove(0)
}

fn start_ok(user: &str, password: &str) -> RawFrame {
    method_frame(
        0,
        AMQPClass::Connection(conn::AMQPMethod::StartOk(conn::StartOk {
            client_properties: FieldTable::default(),
            mechanism: "PLAIN".into(),
            response: format!("\0{user}\0{password}").into(),
            locale: "en_US".into(),
        })),
    )
}

/// Runs the handshake as a client would, up to connection.open.
fn negotiate(config: &GatewayConfig) -> Negotiated {
    let mut out = FrameWriter::default();
    let mut handshake = Handshake::new(config, peer());
    handshake.start(&mut out);
    let sent = methods(&written(&mut out));
    assert!(matches!(
        sent.as_slice(),
        [(0, AMQPClass::Connection(conn::AMQPMethod::Start(_)))]
    ));

    let step = handshake.on_frame(start_ok("guest", "guest"));
    let Ok(HandshakeStep::Authenticate(login)) = step else {
        panic!("start-ok did not ask for the login to be checked");
    };
    assert_eq!(
        (login.user.as_str(), login.password.as_deref()),
        ("guest", Some("guest"))
    );
    assert!(
        written(&mut out).is_empty(),
        "nothing sent before the login is checked"
    );
    let step = handshake.on_login(Ok(LoginResult::Accepted), &mut out);
    assert!(matches!(step, Ok(HandshakeStep::Continue)));
    let sent = methods(&written(&mut out));
    let [(0, AMQPClass::Connection(conn::AMQPMethod::Tune(tune)))] = sent.as_slice() else {
        panic!("expected connection.tune, got {sent:?}");
    };
    assert_eq!(tune.frame_max, config.settings.frame_max);

    let tune_ok = method_frame(
        0,
        AMQPClass::Connection(conn::AMQPMethod::TuneOk(conn::TuneOk {
            channel_max: 0,
            frame_max: 8192,
            heartbeat: 30,
        })),
    );
    assert!(matches!(
        handshake.on_frame(tune_ok),
        Ok(HandshakeStep::Continue)
    ));
    let open = method_frame(
        0,
        AMQPClass::Connection(conn::AMQPMethod::Open(conn::Open {
            virtual_host: "/".into(),
        })),
    );
    match handshake.on_frame(open) {
        Ok(HandshakeStep::Open(negotiated)) => negotiated,
        Ok(HandshakeStep::Continue | HandshakeStep::Authenticate(_)) => {
            panic!("connection.open did not finish the handshake")
        }
        Err(error) => panic!("handshake failed: {error:?}"),
    }
}

/// The request ids of the commands that carry one, in order.
fn request_id(command: &SessionCommand) -> u64 {
    match &command.command {
        Some(Command::Open(open)) => open.request_id,
        Some(Command::ChannelOpen(open)) => open.request_id,
        other => panic!("not a request this test expects: {other:?}"),
    }
}

fn ok_reply(request_id: u64) -> SessionEvent {
    SessionEvent {
        event: Some(Event::Reply(pb::Reply {
            request_id,
            result: Some(reply::Result::Ok(pb::Empty {})),
        })),
    }
}

/// A connection through the handshake, with its session open and channel 1
/// open, and nothing left to read in `out`.
fn open_connection(config: GatewayConfig) -> (Connection, FrameWriter) {
    let config = Arc::new(config);
    let negotiated = negotiate(&config);
    assert_eq!(negotiated.user, "guest");
    assert_eq!(negotiated.vhost, "/");
    assert_eq!(negotiated.frame_max, 8192);
    assert_eq!(negotiated.heartbeat, 30);
    let mut connection = Connection::new(config, negotiated, peer());
    let mut out = FrameWriter::default();
    let mut commands = Vec::new();

    let open = connection.open_session();
    connection
        .on_event(ok_reply(request_id(&open)), &mut out, &mut commands)
        .expect("session opened");
    let sent = methods(&written(&mut out));
    assert!(matches!(
        sent.as_slice(),
        [(0, AMQPClass::Connection(conn::AMQPMethod::OpenOk(_)))]
    ));

    open_channel(&mut connection, &mut out, 1);
    (connection, out)
}

/// Opens channel `id` on an open connection, answering for the engine.
fn open_channel(connection: &mut Connection, out: &mut FrameWriter, id: u16) {
    let mut commands = Vec::new();
    let channel_open = method_frame(
        id,
        AMQPClass::Channel(chan::AMQPMethod::Open(chan::Open {})),
    );
    assert_eq!(
        connection.on_frame(channel_open, out, &mut commands),
        Ok(Next::Continue)
    );
    let [command] = commands.as_slice() else {
        panic!("expected one channel.open command, got {commands:?}");
    };
    let reply = ok_reply(request_id(command));
    commands.clear();
    connection
        .on_event(reply, out, &mut commands)
        .expect("channel opened");
    let sent = methods(&written(out));
    assert!(
        matches!(
            sent.as_slice(),
            [(channel, AMQPClass::Channel(chan::AMQPMethod::OpenOk(_)))] if *channel == id
        ),
        "expected channel.open-ok on {id}, got {sent:?}"
    );
    assert!(commands.is_empty());
}

/// basic.publish and a content header announcing `body_size` on `channel`.
fn start_publish(channel: u16, body_size: u64) -> Vec<RawFrame> {
    let mut frames = FrameWriter::default();
    frames.method(
        channel,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            routing_key: "q".into(),
            ..Default::default()
        })),
    );
    let mut frames = written(&mut frames);
    let mut header = BytesMut::new();
    header.extend_from_slice(&[0, 60, 0, 0]);
    header.extend_from_slice(&body_size.to_be_bytes());
    header.extend_from_slice(&[0, 0]);
    frames.push(RawFrame {
        kind: FRAME_HEADER,
        channel,
        payload: header.freeze(),
    });
    frames
}

fn body_frame(channel: u16, len: usize) -> RawFrame {
    RawFrame {
        kind: FRAME_BODY,
        channel,
        payload: vec![1u8; len].into(),
    }
}

#[test]
fn unfinished_bodies_are_counted_over_channels_until_finished_or_dropped() {
    let config = GatewayConfig {
        settings: GatewaySettings {
            max_message_size: 4000,
            max_unfinished_content: 6000,
            ..Default::default()
        },
        ..Default::default()
    };
    let (mut connection, mut out) = open_connection(config);
    open_channel(&mut connection, &mut out, 2);
    let mut commands = Vec::new();
    let mut feed = |connection: &mut Connection, frames: Vec<RawFrame>| {
        for frame in frames {
            assert_eq!(
                connection.on_frame(frame, &mut out, &mut commands),
                Ok(Next::Continue)
            );
        }
    };
    // Announcing reserves nothing.
    feed(&mut connection, start_publish(1, 4000));
    feed(&mut connection, start_publish(2, 4000));
    assert_eq!(connection.unfinished_content(), 0);
    feed(
        &mut connection,
        vec![body_frame(1, 1000), body_frame(2, 1500)],
    );
    assert_eq!(connection.unfinished_content(), 2500);
    // Growing doubles, but never past the announced size.
    feed(
        &mut connection,
        vec![body_frame(1, 1000), body_frame(1, 1000)],
    );
    assert_eq!(connection.unfinished_content(), 4000 + 1500);
    feed(&mut connection, vec![body_frame(1, 1000)]);
    assert_eq!(
        connection.unfinished_content(),
        1500,
        "channel 1's message is done"
    );
    assert_eq!(commands.len(), 1);
    assert!(matches!(&commands[0].command, Some(Command::Publish(p)) if p.body.len() == 4000));

    // Past the limit: 506, naming it.
    let mut frames = start_publish(1, 4000);
    frames.push(body_frame(1, 3000));
    frames.push(body_frame(2, 2000));
    let mut result = Ok(Next::Continue);
    for frame in frames {
        result = connection.on_frame(frame, &mut out, &mut commands);
    }
    let error = result.expect_err("3000 + 3500 unfinished bytes pass 6000");
    assert_eq!(error.code(), reply_code::RESOURCE_ERROR);
    assert_eq!(error.enforced, Some(super::Enforced::UnfinishedContent));
    assert!(
        error.text().contains("gateway.max_unfinished_content"),
        "{}",
        error.text()
    );
}

#[test]
fn a_message_cut_off_by_a_method_gives_its_bytes_back() {
    let (mut connection, mut out) = open_connection(GatewayConfig::default());
    let mut commands = Vec::new();
    let mut frames = start_publish(1, 10_000);
    frames.push(body_frame(1, 3000));
    for frame in frames {
        assert_eq!(
            connection.on_frame(frame, &mut out, &mut commands),
            Ok(Next::Continue)
        );
    }
    assert_eq!(connection.unfinished_content(), 3000);
    let close = method_frame(
        1,
        AMQPClass::Channel(chan::AMQPMethod::Close(chan::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    );
    let error = connection
        .on_frame(close, &mut out, &mut commands)
        .expect_err("a method in the middle of a message");
    assert_eq!(error.code(), reply_code::UNEXPECTED_FRAME);
    // The connection closes; what its half-received body held goes with it.
    let unfinished = connection.unfinished.clone();
    drop(connection);
    assert_eq!(unfinished.bytes(), 0);
}

#[test]
fn the_handshake_and_channel_open_reach_open_ok() {
    let (connection, _) = open_connection(GatewayConfig::default());
    assert_eq!(connection.channel_count(), 1);
}

#[test]
fn a_refused_login_names_access_refused_once() {
    let config = GatewayConfig::default();
    let mut out = FrameWriter::default();
    let mut handshake = Handshake::new(&config, peer());
    let Ok(HandshakeStep::Authenticate(_)) = handshake.on_frame(start_ok("guest", "wrong")) else {
        panic!("start-ok did not ask for the login to be checked");
    };
    let Err(error) = handshake.on_login(Ok(LoginResult::InvalidCredentials), &mut out) else {
        panic!("a refused login went on");
    };
    assert_eq!(error.code(), reply_code::ACCESS_REFUSED);
    assert_eq!(error.method(), MethodId::CONNECTION_START_OK);
    write_connection_close(&error, &mut out);
    let sent = methods(&written(&mut out));
    let [(0, AMQPClass::Connection(conn::AMQPMethod::Close(close)))] = sent.as_slice() else {
        panic!("expected connection.close, got {sent:?}");
    };
    assert_eq!(
        close.reply_text.as_str(),
        "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. \
         For details see the broker logfile."
    );
    assert_eq!(
        handshake.take_refusal(),
        Some(crate::auth::AuthError::Refused("guest".into()))
    );
    assert_eq!((close.class_id, close.method_id), (10, 11));
}

#[test]
fn a_publish_over_method_header_and_two_body_frames_is_one_command() {
    let (mut connection, mut out) = open_connection(GatewayConfig::default());
    let mut commands = Vec::new();
    let body = b"hello, world";
    let mut frames = FrameWriter::default();
    frames.method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "x".into(),
            routing_key: "k".into(),
            mandatory: true,
            ..Default::default()
        })),
    );
    let properties = basic::AMQPProperties::default().with_delivery_mode(2);
    let context = amq_protocol::frame::WriteContext::from(Vec::new());
    let raw_properties = basic::gen_properties(&properties)(context)
        .expect("encode properties")
        .write;
    // Body frames of at most 8 bytes: two of them for 12 bytes.
    frames.content(1, &raw_properties, body, codec::FRAME_OVERHEAD + 8);
    let frames = written(&mut frames);
    let kinds: Vec<u8> = frames.iter().map(|frame| frame.kind).collect();
    assert_eq!(kinds, [FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_BODY]);

    for frame in frames {
        assert!(commands.is_empty(), "a command before the last body frame");
        assert_eq!(
            connection.on_frame(frame, &mut out, &mut commands),
            Ok(Next::Continue)
        );
    }
    let [SessionCommand {
        command: Some(Command::Publish(publish)),
    }] = commands.as_slice()
    else {
        panic!("expected one publish, got {commands:?}");
    };
    assert_eq!(publish.channel, 1);
    assert_eq!(publish.exchange, "x");
    assert_eq!(publish.routing_key, "k");
    assert!(publish.mandatory);
    assert!(publish.persistent);
    assert_eq!(publish.confirm_seq, 0, "no confirms selected");
    assert_eq!(&publish.body[..], body);
    assert_eq!(&publish.properties[..], &raw_properties[..]);
    assert!(out.is_empty(), "nothing to tell the client");
}

#[test]
fn a_method_on_an_unopened_channel_is_a_channel_error() {
    let (mut connection, mut out) = open_connection(GatewayConfig::default());
    let mut commands = Vec::new();
    let qos = method_frame(
        7,
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: 10,
            ..Default::default()
        })),
    );
    let Err(error) = connection.on_frame(qos, &mut out, &mut commands) else {
        panic!("a method on channel 7 was accepted");
    };
    assert_eq!(error.code(), reply_code::CHANNEL_ERROR);
    assert_eq!(error.method(), MethodId::BASIC_QOS);
    assert!(commands.is_empty());
}

#[test]
fn a_delivery_is_rendered_as_deliver_header_and_body_frames() {
    let (mut connection, mut out) = open_connection(GatewayConfig::default());
    let mut commands = Vec::new();
    // Larger than one frame (frame_max 8192): two body frames.
    let body = vec![7u8; 10_000];
    let deliver = SessionEvent {
        event: Some(Event::Deliver(pb::Deliver {
            channel: 1,
            consumer_tag: "ctag".into(),
            delivery_tag: 5,
            redelivered: true,
            exchange: "x".into(),
            routing_key: "k".into(),
            properties: bytes::Bytes::from_static(&[0, 0]),
            body: body.clone().into(),
            ..Default::default()
        })),
    };
    connection
        .on_event(deliver, &mut out, &mut commands)
        .expect("delivered");
    assert_eq!(connection.deliveries, 1);
    let frames = written(&mut out);
    let kinds: Vec<u8> = frames.iter().map(|frame| frame.kind).collect();
    assert_eq!(kinds, [FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_BODY]);
    let sent = methods(&frames);
    let [(1, AMQPClass::Basic(basic::AMQPMethod::Deliver(deliver)))] = sent.as_slice() else {
        panic!("expected basic.deliver, got {sent:?}");
    };
    assert_eq!(deliver.consumer_tag.as_str(), "ctag");
    assert_eq!(deliver.delivery_tag, 5);
    assert!(deliver.redelivered);
    let header = codec::parse_content_header(&frames[1].payload).expect("content header");
    assert_eq!(header.body_size, body.len() as u64);
    assert_eq!(&header.properties[..], &[0, 0]);
    let received: Vec<u8> = frames[2..]
        .iter()
        .flat_map(|frame| frame.payload.iter().copied())
        .collect();
    assert_eq!(received, body);
    assert!(commands.is_empty());
}

#[test]
fn an_unparsable_method_names_its_class() {
    let known = unparsable_method(&[0, 60, 0, 40, 1]);
    assert_eq!(known.code(), reply_code::SYNTAX_ERROR);
    assert_eq!(known.method(), MethodId::BASIC_PUBLISH);
    let unknown = unparsable_method(&[0, 99, 0, 1]);
    assert_eq!(unknown.code(), reply_code::COMMAND_INVALID);
    assert_eq!(unknown.method(), MethodId::new(99, 1));
    let short = unparsable_method(&[0, 60]);
    assert_eq!(short.code(), reply_code::SYNTAX_ERROR);
    assert_eq!(short.method(), MethodId::new(60, 0));
}

#[test]
fn a_delivery_to_a_channel_that_is_not_open_still_counts_as_written() {
    let (mut connection, mut out) = open_connection(GatewayConfig::default());
    let mut commands = Vec::new();
    // Channel 9 was never opened (or is being released): the delivery is
    // dropped, and the engine requeues it when it releases the channel.
    let deliver = SessionEvent {
        event: Some(Event::Deliver(pb::Deliver {
            channel: 9,
            consumer_tag: "ctag".into(),
            delivery_tag: 1,
            body: vec![1u8; 100].into(),
            ..Default::default()
        })),
    };
    connection
        .on_event(deliver, &mut out, &mut commands)
        .expect("dropped quietly");
    assert!(written(&mut out).is_empty(), "nothing reaches the client");
    // Reported with the next write, so the engine's credit does not keep a
    // delivery in flight for ever.
    assert_eq!(connection.deliveries, 1);
}

#[test]
fn compression_shrinks_large_publishes_and_deliveries_come_out_as_published() {
    let config = GatewayConfig {
        settings: GatewaySettings {
            message_compression_enabled: true,
            message_compression_threshold_size: 1000,
            ..Default::default()
        },
        ..Default::default()
    };
    let (mut connection, mut out) = open_connection(config);
    let mut commands = Vec::new();
    for (size, compressed) in [(900usize, false), (4000, true)] {
        let mut frames = start_publish(1, size as u64);
        frames.push(body_frame(1, size));
        for frame in frames {
            assert_eq!(
                connection.on_frame(frame, &mut out, &mut commands),
                Ok(Next::Continue)
            );
        }
        let Some(Command::Publish(publish)) = commands.pop().and_then(|c| c.command) else {
            panic!("expected a publish");
        };
        assert_eq!(publish.body_size, size as u64);
        assert_eq!(publish.body().is_compressed(), compressed, "{size} bytes");
        if compressed {
            assert!(
                publish.body.len() < size / 4,
                "{} bytes",
                publish.body.len()
            );
        }
        // Delivered as the engine holds it: the client gets the published bytes.
        let deliver = SessionEvent {
            event: Some(Event::Deliver(pb::Deliver {
                channel: 1,
                consumer_tag: "ctag".into(),
                delivery_tag: 1,
                properties: bytes::Bytes::from_static(&[0, 0]),
                body: publish.body.clone(),
                body_encoding: publish.body_encoding,
                body_size: publish.body_size,
                ..Default::default()
            })),
        };
        connection
            .on_event(deliver, &mut out, &mut commands)
            .expect("delivered");
        let frames = written(&mut out);
        let header = codec::parse_content_header(&frames[1].payload).expect("content header");
        assert_eq!(header.body_size, size as u64);
        let received: Vec<u8> = frames[2..]
            .iter()
            .flat_map(|frame| frame.payload.iter().copied())
            .collect();
        assert_eq!(received, vec![1u8; size]);
    }
    // A compressed body that does not decode never reaches the client.
    let corrupt = SessionEvent {
        event: Some(Event::Deliver(pb::Deliver {
            channel: 1,
            body: vec![0xf0; 40].into(),
            body_encoding: spillway_proto::body::ENCODING_LZ4,
            body_size: 5000,
            ..Default::default()
        })),
    };
    let error = connection
        .on_event(corrupt, &mut out, &mut commands)
        .expect_err("a corrupt body closes the connection");
    assert_eq!(error.code(), reply_code::INTERNAL_ERROR);
    let frames = written(&mut out);
    assert!(
        frames.iter().all(|frame| frame.kind != FRAME_BODY),
        "no body was written"
    );
}

#[test]
fn a_body_in_one_frame_is_lent_and_charged_until_the_message_is_dropped() {
    use crate::body_loans::{BodyLoans, MIN_LENT_BODY};
    use crate::read_room::ReadChunk;

    let (mut connection, mut out) = open_connection(GatewayConfig::default());
    let loans = BodyLoans::new(1 << 20, Default::default());
    connection.lend_bodies(loans.clone());
    let chunk = ReadChunk {
        id: 1,
        bytes: 300_000,
    };
    let size = 2 * MIN_LENT_BODY;
    let publish_with = |connection: &mut Connection, out: &mut FrameWriter, bodies: &[usize]| {
        let mut commands = Vec::new();
        let mut frames = start_publish(1, size as u64);
        frames.extend(bodies.iter().map(|len| body_frame(1, *len)));
        for frame in frames {
            assert_eq!(
                connection.on_frame(frame, out, &mut commands),
                Ok(Next::Continue)
            );
        }
        let [SessionCommand {
            command: Some(Command::Publish(publish)),
        }] = commands.as_slice()
        else {
            panic!("expected one publish, got {commands:?}");
        };
        assert_eq!(&publish.body[..], &vec![1u8; size][..]);
        commands
    };

    // Where the frame came from is not known: copied.
    let copied = publish_with(&mut connection, &mut out, &[size]);
    assert_eq!(loans.lent_bytes(), 0);
    // From a known allocation, in one frame: lent, the allocation charged once.
    connection.set_read_chunk(Some(chunk));
    let lent = publish_with(&mut connection, &mut out, &[size]);
    let also_lent = publish_with(&mut connection, &mut out, &[size]);
    assert_eq!(loans.lent_bytes(), chunk.bytes);
    // In two frames: copied.
    let split = publish_with(&mut connection, &mut out, &[size / 2, size / 2]);
    assert_eq!(loans.lent_bytes(), chunk.bytes);
    drop((copied, split, lent));
    assert_eq!(
        loans.lent_bytes(),
        chunk.bytes,
        "a lent body is still alive"
    );
    drop(also_lent);
    assert_eq!(loans.lent_bytes(), 0);
    assert_eq!(connection.unfinished_content(), 0);
}

fn flow_control(blocked: bool, reason: &str) -> SessionEvent {
    SessionEvent {
        event: Some(Event::FlowControl(pb::FlowControl {
            blocked,
            reason: reason.into(),
            ..Default::default()
        })),
    }
}

#[test]
fn the_memory_ceiling_holds_back_publishers_only_and_lets_go_when_back_under() {
    use spillway_proto::util::clock::Clock as _;
    let clock = spillway_proto::util::clock::ManualClock::new();
    let config = GatewayConfig {
        settings: GatewaySettings {
            blocked_overdraft: 0,
            ..GatewaySettings::default()
        },
        clock: clock.clone(),
    };
    let (mut connection, mut out) = open_connection(config);
    let mut commands = Vec::new();
    let over = Some(spillway_telemetry::OverCeiling {
        held: 11,
        high_watermark: 10,
    });
    connection.set_memory_blocked(over, &mut out);
    assert!(
        !connection.memory_blocked() && !connection.reading_paused(),
        "a connection that never published is held back"
    );

    let frames = start_publish(1, 4).into_iter().chain([body_frame(1, 4)]);
    for frame in frames {
        assert_eq!(
            connection.on_frame(frame, &mut out, &mut commands),
            Ok(Next::Continue)
        );
    }
    assert!(connection.has_published());
    clock.advance(std::time::Duration::from_secs(7));
    connection.set_memory_blocked(over, &mut out);
    assert!(connection.memory_blocked() && connection.reading_paused());
    let (reason, since) = connection.blocked().expect("blocked");
    assert_eq!(
        since,
        clock.now(),
        "blocked since, as the gateway's clock says"
    );
    assert!(
        reason.contains("memory high watermark reached") && reason.contains("11 bytes"),
        "{reason}"
    );

    // The engine blocks it too: the ceiling clearing leaves the engine's
    // block, and only both clearing frees it.
    connection
        .on_event(
            flow_control(true, "queue 'q' is overfull"),
            &mut out,
            &mut commands,
        )
        .expect("flow event");
    connection.set_memory_blocked(None, &mut out);
    assert!(!connection.memory_blocked() && connection.reading_paused());
    assert_eq!(
        connection.blocked().map(|(reason, _)| reason),
        Some("queue 'q' is overfull")
    );
    connection
        .on_event(flow_control(false, ""), &mut out, &mut commands)
        .expect("flow event");
    assert!(!connection.reading_paused() && connection.blocked().is_none());
}

/// The broker closes channel 1 (a publish to a missing exchange) while the
/// client closes it too: the client's close is answered with close-ok, and
/// its close-ok to the broker's close, or a new channel.open, ends the
/// channel; neither is a 504 that kills the connection (amqp091-go's
/// TestChannelExceptionWithCloseIssue43, RabbitMQ's reader).
#[test]
fn a_crossing_channel_close_is_answered_and_closes_only_the_channel() {
    for then_reopen in [false, true] {
        let (mut connection, mut out) = open_connection(GatewayConfig::default());
        let mut commands = Vec::new();
        let not_found = SessionEvent {
            event: Some(Event::ChannelError(pb::ChannelError {
                channel: 1,
                error: Some(pb::AmqpError {
                    code: u32::from(reply_code::NOT_FOUND),
                    text: "no exchange 'x' in vhost '/'".into(),
                    class_id: 60,
                    method_id: 40,
                    kind: 0,
                }),
            })),
        };
        connection
            .on_event(not_found, &mut out, &mut commands)
            .expect("a channel error closes the channel only");
        let [SessionCommand {
            command: Some(Command::ChannelClose(release)),
        }] = commands.as_slice()
        else {
            panic!("expected the channel's release, got {commands:?}");
        };
        let release = release.request_id;
        let sent = methods(&written(&mut out));
        assert!(
            matches!(sent.as_slice(), [(1, AMQPClass::Channel(chan::AMQPMethod::Close(c)))] if c.reply_code == reply_code::NOT_FOUND),
            "{sent:?}"
        );
        let client_close = method_frame(
            1,
            AMQPClass::Channel(chan::AMQPMethod::Close(chan::Close {
                reply_code: 200,
                reply_text: "bye".into(),
                class_id: 0,
                method_id: 0,
            })),
        );
        assert_eq!(
            connection.on_frame(client_close, &mut out, &mut commands),
            Ok(Next::Continue)
        );
        let sent = methods(&written(&mut out));
        assert!(
            matches!(
                sent.as_slice(),
                [(1, AMQPClass::Channel(chan::AMQPMethod::CloseOk(_)))]
            ),
            "{sent:?}"
        );
        commands.clear();
        // The engine releases the channel (its reply comes before any
        // other of the channel's, as the session's events are in order).
        connection
            .on_event(ok_reply(release), &mut out, &mut commands)
            .expect("released");
        assert!(commands.is_empty() && written(&mut out).is_empty());
        if then_reopen {
            // A client that took the close-ok as the end opens channel 1 anew.
            open_channel(&mut connection, &mut out, 1);
            continue;
        }
        let close_ok = method_frame(
            1,
            AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {})),
        );
        assert_eq!(
            connection.on_frame(close_ok, &mut out, &mut commands),
            Ok(Next::Continue),
            "the client's close-ok to the broker's close is not a channel error"
        );
        assert!(written(&mut out).is_empty());
        // The channel is gone now: a method on it is the usual 504.
        let qos = method_frame(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: 1,
                ..Default::default()
            })),
        );
        let Err(error) = connection.on_frame(qos, &mut out, &mut commands) else {
            panic!("a method on the closed channel was accepted");
        };
        assert_eq!(error.code(), reply_code::CHANNEL_ERROR);
    }
}
