//! A hand-driven AMQP client for tests that play a client no library would
//! be: one that stops reading, sends half a message, or sends bytes no
//! client should. Frames are encoded and decoded with amq-protocol (the
//! reference codec lapin uses) or written byte by byte with [`raw_frame`].

use std::time::Duration;

use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame, WriteContext};
use amq_protocol::protocol::{channel, connection, AMQPClass};
use amq_protocol::types::FieldTable;
use anyhow::Context;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::Sandbox;

/// The AMQP 0-9-1 protocol header.
pub const HEADER: &[u8] = b"AMQP\x00\x00\x09\x01";

/// How long one frame may take to arrive.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

pub const FRAME_METHOD: u8 = 1;
pub const FRAME_HEADER: u8 = 2;
pub const FRAME_BODY: u8 = 3;

/// `frame` in wire bytes.
pub fn encode(frame: AMQPFrame) -> anyhow::Result<Vec<u8>> {
    let context = gen_frame(&frame)(WriteContext::from(Vec::new()))
        .map_err(|error| anyhow::anyhow!("encoding a frame: {error:?}"))?;
    Ok(context.write)
}

/// A method frame on `channel`, in wire bytes.
pub fn method(channel: u16, method: AMQPClass) -> anyhow::Result<Vec<u8>> {
    encode(AMQPFrame::Method(channel, method))
}

/// A frame of any `kind` with `payload` as it is (no checks at all).
pub fn raw_frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![kind];
    frame.extend_from_slice(&channel.to_be_bytes());
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload);
    frame.push(0xCE);
    frame
}

/// `basic.publish` to the default exchange with `routing_key`.
pub fn publish_frame(channel: u16, routing_key: &str) -> Vec<u8> {
    let mut payload = vec![0, 60, 0, 40, 0, 0, 0];
    payload.push(routing_key.len() as u8);
    payload.extend_from_slice(routing_key.as_bytes());
    payload.push(0);
    raw_frame(FRAME_METHOD, channel, &payload)
}

/// A content header announcing `body_size` bytes, no properties.
pub fn content_header_frame(channel: u16, body_size: u64) -> Vec<u8> {
    let mut payload = vec![0, 60, 0, 0];
    payload.extend_from_slice(&body_size.to_be_bytes());
    payload.extend_from_slice(&[0, 0]);
    raw_frame(FRAME_HEADER, channel, &payload)
}

/// Reads one frame.
pub async fn read_frame<R: AsyncRead + Unpin>(socket: &mut R) -> anyhow::Result<AMQPFrame> {
    let mut head = [0u8; 7];
    tokio::time::timeout(READ_TIMEOUT, socket.read_exact(&mut head))
        .await
        .context("no frame in time")??;
    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
    let mut rest = vec![0u8; size + 1];
    tokio::time::timeout(READ_TIMEOUT, socket.read_exact(&mut rest))
        .await
        .context("no whole frame in time")??;
    let mut whole = head.to_vec();
    whole.extend(rest);
    let (_, frame) =
        parse_frame(&whole[..]).map_err(|e| anyhow::anyhow!("unparsable frame: {e:?}"))?;
    Ok(frame)
}

/// Connects as guest and completes the handshake with `frame_max`, no
/// heartbeats, and `channel_max` channels.
pub async fn open_connection(
    sandbox: &Sandbox,
    frame_max: u32,
    channel_max: u16,
) -> anyhow::Result<TcpStream> {
    handshake(sandbox, frame_max, Some(channel_max)).await
}

/// As [`open_connection`], taking the channel_max the broker offers.
pub async fn open_connection_as_offered(
    sandbox: &Sandbox,
    frame_max: u32,
) -> anyhow::Result<TcpStream> {
    handshake(sandbox, frame_max, None).await
}

/// Sends the protocol header and waits for connection.start.
pub async fn await_start(socket: &mut TcpStream) -> anyhow::Result<()> {
    socket.write_all(HEADER).await?;
    let AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Start(_))) =
        read_frame(socket).await?
    else {
        anyhow::bail!("expected connection.start");
    };
    Ok(())
}

async fn handshake(
    sandbox: &Sandbox,
    frame_max: u32,
    channel_max: Option<u16>,
) -> anyhow::Result<TcpStream> {
    let mut socket = send_handshake(sandbox, frame_max, channel_max, 0).await?;
    let AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))) =
        read_frame(&mut socket).await?
    else {
        anyhow::bail!("expected connection.open-ok");
    };
    Ok(socket)
}

/// Connects as guest and sends everything up to connection.open with the
/// given tuning (`channel_max` None: the broker's), without waiting for
/// open-ok: for tests of a refused handshake.
pub async fn send_handshake(
    sandbox: &Sandbox,
    frame_max: u32,
    channel_max: Option<u16>,
    heartbeat: u16,
) -> anyhow::Result<TcpStream> {
    let mut socket = TcpStream::connect(sandbox.amqp_addr()).await?;
    await_start(&mut socket).await?;
    let start_ok = connection::StartOk {
        client_properties: FieldTable::default(),
        mechanism: "PLAIN".into(),
        response: "\0guest\0guest".into(),
        locale: "en_US".into(),
    };
    send_method(
        &mut socket,
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
    )
    .await?;
    let AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Tune(tune))) =
        read_frame(&mut socket).await?
    else {
        anyhow::bail!("expected connection.tune");
    };
    let tune_ok = connection::TuneOk {
        channel_max: channel_max.unwrap_or(tune.channel_max),
        frame_max,
        heartbeat,
    };
    let open = connection::Open {
        virtual_host: "/".into(),
    };
    let mut bytes = method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok)),
    )?;
    bytes.extend(method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(open)),
    )?);
    socket.write_all(&bytes).await?;
    Ok(socket)
}

/// Writes one method frame.
pub async fn send_method(
    socket: &mut TcpStream,
    channel: u16,
    method_: AMQPClass,
) -> anyhow::Result<()> {
    socket.write_all(&method(channel, method_)?).await?;
    Ok(())
}

/// Sends channel.open for `id` without waiting for the answer.
pub async fn send_channel_open(socket: &mut TcpStream, id: u16) -> anyhow::Result<()> {
    send_method(
        socket,
        id,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
    .await
}

/// Opens channels `1..=count` and waits for every open-ok.
pub async fn open_channels(socket: &mut TcpStream, count: u16) -> anyhow::Result<()> {
    let mut bytes = Vec::new();
    for id in 1..=count {
        bytes.extend(method(
            id,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )?);
    }
    socket.write_all(&bytes).await?;
    for _ in 1..=count {
        let AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))) =
            read_frame(socket).await?
        else {
            anyhow::bail!("expected channel.open-ok");
        };
    }
    Ok(())
}

/// Reads until a connection.close arrives, answers close-ok, and returns its
/// reply code and text.
pub async fn expect_connection_close(socket: &mut TcpStream) -> anyhow::Result<(u16, String)> {
    let closed = read_until_connection_close(socket).await?;
    let close_ok = method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
    )?;
    let _ = socket.write_all(&close_ok).await;
    Ok(closed)
}

/// Reads until a connection.close arrives (skipping everything else) and
/// returns its reply code and text, without answering.
pub async fn read_until_connection_close<R: AsyncRead + Unpin>(
    socket: &mut R,
) -> anyhow::Result<(u16, String)> {
    loop {
        if let AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(close))) =
            read_frame(socket).await?
        {
            return Ok((close.reply_code, close.reply_text.to_string()));
        }
    }
}

/// Reads (and drops) until the broker closes the socket, at most `limit`;
/// returns when that was.
pub async fn closed_within<R: AsyncRead + Unpin>(
    socket: &mut R,
    limit: Duration,
) -> anyhow::Result<std::time::Instant> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut sink = vec![0u8; 64 * 1024];
    loop {
        match tokio::time::timeout_at(deadline, socket.read(&mut sink)).await {
            Err(_) => anyhow::bail!("still open after {limit:?}"),
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(std::time::Instant::now()),
            Ok(Ok(_)) => {}
        }
    }
}

/// Everything the broker sends until it closes the socket (within the
/// read timeout).
pub async fn read_to_end(socket: &mut TcpStream) -> anyhow::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    tokio::time::timeout(READ_TIMEOUT, socket.read_to_end(&mut bytes))
        .await
        .context("the broker did not close in time")??;
    Ok(bytes)
}
