//! Bad bytes on the socket get the answer the spec asks for, and the broker
//! keeps serving everyone else. The client side is hand-written frames,
//! encoded and decoded with amq-protocol as the reference codec.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{channel, queue, AMQPClass};
use spillway_integration_tests::raw;
use spillway_integration_tests::{both_wirings, eventually, run_wiring_case, Sandbox, Wiring};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

both_wirings!(timeout_secs = 300; malformed_input, hostile_nesting);

// One `both_wirings!` per file: these two need their own configured sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_silent_clients_are_closed_at_the_handshake_timeout() {
    run_wiring_case(Wiring::InProcess, Duration::from_secs(60), |wiring| {
        silent_clients_are_closed_at_the_handshake_timeout(wiring)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_processes_silent_clients_are_closed_at_the_handshake_timeout() {
    run_wiring_case(Wiring::Separate, Duration::from_secs(60), |wiring| {
        silent_clients_are_closed_at_the_handshake_timeout(wiring)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_connections_past_max_connections_are_refused() {
    run_wiring_case(Wiring::InProcess, Duration::from_secs(60), |wiring| {
        connections_past_max_connections_are_refused(wiring)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_processes_connections_past_max_connections_are_refused() {
    run_wiring_case(Wiring::Separate, Duration::from_secs(60), |wiring| {
        connections_past_max_connections_are_refused(wiring)
    })
    .await
}

async fn malformed_input(sandbox: &mut Sandbox) -> anyhow::Result<()> {
    // Garbage instead of a protocol header: the spec's answer is our header, then close.
    let mut socket = TcpStream::connect(sandbox.amqp_addr()).await?;
    socket
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await?;
    assert_eq!(raw::read_to_end(&mut socket).await?, raw::HEADER);
    sandbox.serves_a_fresh_client().await?;

    // A protocol header for another version: same answer.
    let mut socket = TcpStream::connect(sandbox.amqp_addr()).await?;
    socket.write_all(b"AMQP\x01\x01\x00\x0a").await?;
    assert_eq!(raw::read_to_end(&mut socket).await?, raw::HEADER);

    // A frame larger than the negotiated frame-max: 501 FRAME_ERROR.
    let mut socket = raw::open_connection(sandbox, 4096, 16).await?;
    let mut oversized = vec![3u8, 0, 1];
    oversized.extend_from_slice(&100_000u32.to_be_bytes());
    oversized.extend(vec![0u8; 100_000]);
    oversized.push(0xCE);
    let _ = socket.write_all(&oversized).await;
    assert_eq!(raw::expect_connection_close(&mut socket).await?.0, 501);

    // A method on a channel that was never opened: 504 CHANNEL_ERROR.
    let mut socket = raw::open_connection(sandbox, 4096, 16).await?;
    let declare = queue::Declare {
        queue: "q".into(),
        ..Default::default()
    };
    socket
        .write_all(&raw::method(
            5,
            AMQPClass::Queue(queue::AMQPMethod::Declare(declare)),
        )?)
        .await?;
    assert_eq!(raw::expect_connection_close(&mut socket).await?.0, 504);

    // A frame whose end octet is not 0xCE: 501.
    let mut socket = raw::open_connection(sandbox, 4096, 16).await?;
    socket.write_all(&[8, 0, 0, 0, 0, 0, 0, 0x00]).await?;
    assert_eq!(raw::expect_connection_close(&mut socket).await?.0, 501);

    // A content body with no publish before it: 505 UNEXPECTED_FRAME.
    let mut socket = raw::open_connection(sandbox, 4096, 16).await?;
    raw::open_channels(&mut socket, 1).await?;
    socket
        .write_all(&raw::encode(AMQPFrame::Body(1, b"orphan".to_vec()))?)
        .await?;
    assert_eq!(raw::expect_connection_close(&mut socket).await?.0, 505);

    // An unknown frame type: 501.
    let mut socket = raw::open_connection(sandbox, 4096, 16).await?;
    socket.write_all(&[42, 0, 0, 0, 0, 0, 0, 0xCE]).await?;
    assert_eq!(raw::expect_connection_close(&mut socket).await?.0, 501);

    // Truncated garbage mid-connection and an abrupt disconnect: nothing breaks.
    let mut socket = raw::open_connection(sandbox, 4096, 16).await?;
    socket.write_all(&[1, 0, 1, 0, 0, 0, 200, 0, 10]).await?;
    drop(socket);

    random_frames(sandbox).await?;
    sandbox.serves_a_fresh_client().await
}

/// Well-framed but random payloads (method ids, content headers, bodies on
/// random channels) and raw noise: whatever the broker answers, it must
/// answer without dying. A cheap fuzz pass over the state machines.
async fn random_frames(sandbox: &Sandbox) -> anyhow::Result<()> {
    let mut seed: u64 = 0x5eed_1234_abcd_0001;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for _ in 0..40 {
        let mut socket = raw::open_connection(sandbox, 4096, 16).await?;
        let _ = socket
            .write_all(&raw::method(
                1,
                AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
            )?)
            .await;
        let mut bytes = Vec::new();
        for _ in 0..(next() % 8 + 1) {
            let kind = [1u8, 1, 2, 3, 8][(next() % 5) as usize];
            let channel = (next() % 3) as u16;
            let len = (next() % 64) as usize;
            let mut payload: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if kind == 1 && payload.len() >= 4 {
                // Mostly real class ids, so parsing goes past the first bytes.
                let class = [10u16, 20, 40, 50, 60, 85, 90][(next() % 7) as usize];
                payload[..2].copy_from_slice(&class.to_be_bytes());
                payload[2..4].copy_from_slice(&((next() % 130) as u16).to_be_bytes());
            }
            bytes.push(kind);
            bytes.extend_from_slice(&channel.to_be_bytes());
            bytes.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            bytes.extend_from_slice(&payload);
            bytes.push(0xCE);
        }
        if next() % 4 == 0 {
            bytes.extend((0..(next() % 32)).map(|_| next() as u8));
        }
        let _ = socket.write_all(&bytes).await;
        // Read whatever comes back until the broker closes or goes quiet.
        let mut sink = [0u8; 4096];
        while let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(50), socket.read(&mut sink)).await
        {
            if n == 0 {
                break;
            }
        }
    }
    Ok(())
}

/// A field table nested `depth` levels deep (each level one entry "k"
/// holding the next table), written straight out: amq-protocol's encoder
/// recurses as its parser does.
fn deep_table(depth: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(7 * depth);
    for level in (2..=depth).rev() {
        bytes.extend_from_slice(&(7 * (level - 1) as u32).to_be_bytes());
        bytes.extend_from_slice(&[1, b'k', b'F']);
    }
    bytes.extend_from_slice(&[0, 0, 0, 0]);
    bytes
}

/// A connection.start-ok whose client properties are `properties`.
fn start_ok_with(properties: &[u8]) -> Vec<u8> {
    let mut payload = vec![0, 10, 0, 11];
    payload.extend_from_slice(properties);
    payload.extend_from_slice(&[5, b'P', b'L', b'A', b'I', b'N']);
    let response = b"\0guest\0guest";
    payload.extend_from_slice(&(response.len() as u32).to_be_bytes());
    payload.extend_from_slice(response);
    payload.extend_from_slice(&[5, b'e', b'n', b'_', b'U', b'S']);
    raw::raw_frame(1, 0, &payload)
}

/// Field tables nested thousands deep, where a client can put them, once
/// aborted the whole broker (the recursive parser overflowed its stack).
/// Each now closes that one connection with 501, and the broker serves on.
async fn hostile_nesting(sandbox: &mut Sandbox) -> anyhow::Result<()> {
    // Before login: 18,000 levels in one 126 KB start-ok. Frames past 4096
    // bytes are refused until tune-ok.
    let mut socket = TcpStream::connect(sandbox.amqp_addr()).await?;
    raw::await_start(&mut socket).await?;
    let _ = socket.write_all(&start_ok_with(&deep_table(18_000))).await;
    let (code, text) = raw::expect_connection_close(&mut socket).await?;
    anyhow::ensure!(code == 501 && text.contains("4096"), "{code} {text}");
    sandbox.serves_a_fresh_client().await?;

    // Before login, within 4096 bytes: 500 levels, refused by depth.
    let mut socket = TcpStream::connect(sandbox.amqp_addr()).await?;
    raw::await_start(&mut socket).await?;
    let _ = socket.write_all(&start_ok_with(&deep_table(500))).await;
    let (code, text) = raw::expect_connection_close(&mut socket).await?;
    anyhow::ensure!(
        code == 501 && text.contains("nested deeper than 64"),
        "{code} {text}"
    );

    // After login with a 128 KiB frame-max: queue.declare arguments 18,000
    // levels deep.
    let mut socket = raw::open_connection(sandbox, 131_072, 16).await?;
    raw::open_channels(&mut socket, 1).await?;
    let mut declare = vec![0, 50, 0, 10, 0, 0, 1, b'q', 0];
    declare.extend_from_slice(&deep_table(18_000));
    let _ = socket.write_all(&raw::raw_frame(1, 1, &declare)).await;
    let (code, text) = raw::expect_connection_close(&mut socket).await?;
    anyhow::ensure!(
        code == 501 && text.contains("nested deeper than 64"),
        "{code} {text}"
    );

    // After login, a server method sent by the client: connection.start,
    // whose server-properties table nests 18,000 levels (found by the fuzzer:
    // it aborted the broker).
    let mut socket = raw::open_connection(sandbox, 131_072, 16).await?;
    let mut start = vec![0, 10, 0, 10, 0, 9];
    start.extend_from_slice(&deep_table(18_000));
    start.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]);
    let _ = socket.write_all(&raw::raw_frame(1, 0, &start)).await;
    let (code, text) = raw::expect_connection_close(&mut socket).await?;
    anyhow::ensure!(
        code == 501 && text.contains("nested deeper than 64"),
        "{code} {text}"
    );

    // A publish whose headers property nests 18,000 levels.
    let mut socket = raw::open_connection(sandbox, 131_072, 16).await?;
    raw::open_channels(&mut socket, 1).await?;
    // basic.publish: reserved short, exchange "", routing key "q", flags.
    let publish = [0, 60, 0, 40, 0, 0, 0, 1, b'q', 0];
    // content header: class 60, weight 0, body size 1, flags: headers only.
    let mut header = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0x20, 0x00];
    header.extend_from_slice(&deep_table(18_000));
    let mut bytes = raw::raw_frame(1, 1, &publish);
    bytes.extend(raw::raw_frame(2, 1, &header));
    let _ = socket.write_all(&bytes).await;
    let (code, text) = raw::expect_connection_close(&mut socket).await?;
    anyhow::ensure!(
        code == 501 && text.contains("nested deeper than 64"),
        "{code} {text}"
    );

    sandbox.serves_a_fresh_client().await
}

/// A client that connects and says nothing, or stops after the protocol
/// header, is closed once `gateway.handshake_timeout` has passed, not kept.
async fn silent_clients_are_closed_at_the_handshake_timeout(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox =
        Sandbox::start_with_config(wiring, "[gateway]\nhandshake_timeout = \"1s\"\n").await?;
    let connected = std::time::Instant::now();
    let mut silent = TcpStream::connect(sandbox.amqp_addr()).await?;
    let mut after_header = TcpStream::connect(sandbox.amqp_addr()).await?;
    raw::await_start(&mut after_header).await?;
    for socket in [&mut silent, &mut after_header] {
        let took = raw::closed_within(socket, Duration::from_secs(10)).await? - connected;
        // Counted from connect: the second must have passed, give or take.
        anyhow::ensure!(took >= Duration::from_millis(900), "closed after {took:?}");
    }
    sandbox.serves_a_fresh_client().await
}

/// `gateway.max_connections`: sockets count from accept (two silent ones
/// hold both slots), a client past the maximum is refused with 530 naming
/// the limit, at most `REFUSALS_AT_ONCE` are told so at once and the next
/// is closed unanswered; the connections already open keep working, and a
/// slot freed by a close can be taken again.
async fn connections_past_max_connections_are_refused(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox = Sandbox::start_with_config(wiring, "[gateway]\nmax_connections = 2\n").await?;
    // First, on a gateway nobody has connected to yet: sockets count from
    // accept, before they log in. Two that say nothing take both slots
    // (accepted in the order they connected), and a client is refused at
    // open, in AMQP.
    let addr = sandbox.amqp_addr();
    let silent = [
        TcpStream::connect(addr).await?,
        TcpStream::connect(addr).await?,
    ];
    let refused = match sandbox.connect().await {
        Ok(_) => anyhow::bail!("a client was served beside two silent sockets"),
        Err(error) => error.to_string(),
    };
    anyhow::ensure!(
        refused.contains("connection limit (2)"),
        "the reason does not name the limit: {refused}"
    );
    // Past the slots, a few sockets at once are told why (each within the
    // handshake timeout); past those, a socket is closed unanswered.
    let mut waiting = Vec::new();
    for _ in 0..spillway_gateway::limits::REFUSALS_AT_ONCE {
        waiting.push(TcpStream::connect(addr).await?);
    }
    let mut unanswered = TcpStream::connect(addr).await?;
    raw::closed_within(&mut unanswered, Duration::from_secs(5)).await?;
    // Silent sockets that go give their slots back.
    drop(waiting);
    drop(silent);

    let first = eventually(Duration::from_secs(10), || sandbox.connect()).await?;
    let second = eventually(Duration::from_secs(10), || sandbox.connect()).await?;
    let refused = match sandbox.connect().await {
        Ok(_) => anyhow::bail!("a third connection was accepted past max_connections = 2"),
        Err(error) => error.to_string(),
    };
    anyhow::ensure!(
        refused.contains("530") || refused.contains("NOT_ALLOWED"),
        "not a 530: {refused}"
    );
    anyhow::ensure!(
        refused.contains("connection limit (2)"),
        "the reason does not name the limit: {refused}"
    );
    let channel = second.create_channel().await?;
    channel
        .queue_declare(
            "still-served".into(),
            Default::default(),
            Default::default(),
        )
        .await?;
    first.close(200, "bye".into()).await?;
    // The slot is given back when the broker side of the first connection
    // ends, just after close-ok.
    let third = eventually(Duration::from_secs(10), || sandbox.connect()).await?;
    third.close(200, "bye".into()).await?;
    second.close(200, "bye".into()).await?;
    Ok(())
}
