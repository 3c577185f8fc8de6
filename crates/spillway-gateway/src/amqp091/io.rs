//! An AMQP 0-9-1 connection's I/O: one loop per connection reads frames,
//! feeds them to the [`Connection`] state machine, forwards its commands to
//! the engine, turns engine events into frames, and hands outbound bytes to
//! a writer task. The writer reports how many deliveries reached the
//! socket, which is the engine's credit: a client that stops reading stops
//! receiving deliveries instead of growing a buffer.
//!
//! The loop is generic over the socket ([`ClientStream`]): plain TCP is
//! split into its owned halves, TLS with `tokio::io::split`.

use std::io::IoSlice;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use spillway_amqp::reply_code;
use spillway_proto::engine::{
    session_command::Command, DeliveriesWritten, SessionCommand, SessionEvent,
};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::codec::{Decoder, FramedRead};

use crate::amqp091::connection::{
    write_connection_close, Connection, ConnectionError, Enforced, Handshake, HandshakeStep,
    Negotiated, Next,
};
use crate::heartbeat::SilenceClock;
use crate::listener::{
    log_login_refusal, refusal_at_open, Admission, ClientStream, ConnectionContext, CountedBytes,
    CLOSE_TIMEOUT,
};
use crate::metrics::GatewayMetrics;
use crate::read_room::{MeasuredRead, ReadRoom};
use spillway_amqp::codec::{FrameDecoder, FrameError, FrameWriter, MIN_FRAME_MAX, PROTOCOL_HEADER};

/// A publisher held back by the memory ceiling looks again this often.
const MEMORY_RECHECK: Duration = Duration::from_millis(100);

/// Engine events handled before outbound bytes are flushed.
const EVENTS_PER_FLUSH: usize = 256;

/// Client frames handled in one turn of a connection's loop: those one read
/// brought in are decoded straight from the read buffer, so a batch of
/// publishes costs one turn (clock reads, command hand-over, flush), not
/// three per publish.
const FRAMES_PER_TURN: usize = 256;

/// Buffers handed to one vectored write (Linux takes up to 1024; a
/// delivery with a shared body is two).
const MAX_IOVECS: usize = 64;

/// Outbound chunks queued for the writer before the loop waits.
const WRITER_QUEUE: usize = 64;

/// One flush of the I/O loop: its segments (small frames coalesced, large
/// bodies shared with the engine, see [`FrameWriter`]) and the deliveries
/// among them.
struct Outbound {
    segments: Vec<Bytes>,
    deliveries: u32,
}

/// Serves one AMQP 0-9-1 client from its protocol header (read by the
/// listener, `server.rs`) to its close, in three steps: [`handshake`]
/// (login, tune, open; one deadline from accept), admission at
/// `connection.open` (the listener's [`refusal_at_open`]), then the engine
/// session and [`read_loop`].
pub(crate) async fn serve<S: ClientStream>(
    stream: S,
    header: [u8; 8],
    peer: SocketAddr,
    deadline: Instant,
    admission: Admission,
    context: ConnectionContext,
    stopped: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut read_buffer = CountedBytes::new(context.read_buffers.clone());
    let Some(opened) =
        handshake(stream, header, peer, deadline, &context, &mut read_buffer).await?
    else {
        return Ok(());
    };
    let Opened {
        mut frames,
        mut write_half,
        negotiated,
        mut out,
    } = opened;
    if let Some(error) = refusal_at_open(&admission, &context, peer) {
        close_unopened(&error.into(), &mut out, write_half, &mut frames).await;
        return Ok(());
    }
    frames.decoder_mut().frame_max = negotiated.frame_max as usize;
    // Bounded like the handshake: an engine that does not answer (starting,
    // or stopped but still connected) must not hold the client forever.
    let opening = tokio::time::timeout(
        context.config.settings.handshake_timeout,
        context.engine.open_session(),
    );
    let session = match opening.await.unwrap_or_else(|_| {
        Err(spillway_proto::ServiceError::Unavailable(
            "the engine did not open a session within gateway.handshake_timeout".into(),
        ))
    }) {
        Ok(session) => session,
        Err(error) => {
            tracing::warn!(%peer, %error, "engine unavailable");
            let error = ConnectionError::new(reply_code::CONNECTION_FORCED, "engine unavailable");
            write_connection_close(&error, &mut out);
            send(&mut write_half, &out.take()).await?;
            return Ok(());
        }
    };
    let config = &context.config;
    let commands = session.commands;
    let mut connection = Connection::new(config.clone(), negotiated, peer);
    connection.lend_bodies(context.body_loans.clone());
    connection.count_unfinished_in(context.unfinished.clone());
    if commands.send(connection.open_session()).await.is_err() {
        return Ok(());
    }
    let (writer_tx, writer_rx) = mpsc::channel::<Outbound>(WRITER_QUEUE);
    let writer = tokio::spawn(write_loop(
        write_half,
        writer_rx,
        commands.clone(),
        context.metrics.clone(),
        WriteDeadline {
            peer,
            timeout: Some(config.settings.write_timeout).filter(|t| !t.is_zero()),
        },
    ));
    let mut io = ConnectionIo {
        peer,
        frames,
        out,
        read_buffer,
        writer_tx,
        commands,
        events: session.events,
    };
    let closing = read_loop(&mut io, &mut connection, &context, stopped).await;
    if let Some(error) = closing {
        tracing::debug!(%peer, code = error.code(), text = %error.text(), "closing connection");
        match error.enforced {
            Some(Enforced::UnfinishedContent) => {
                tracing::warn!(%peer, text = %error.text(), "closing a connection holding too much unfinished content");
                context.metrics.count_unfinished_content_close();
            }
            Some(Enforced::Limit(limit)) => {
                tracing::warn!(%peer, limit, reason = %error.text(), "refused by a limit");
                context.metrics.count_refusal(limit);
            }
            None => {}
        }
        write_connection_close(&error, &mut io.out);
        flush(&mut io.out, &mut connection, &io.writer_tx).await;
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, drain_until_close_ok(&mut io.frames)).await;
    }
    drop(io);
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, writer).await;
    Ok(())
}

type Frames<R> = FramedRead<MeasuredRead<R>, FrameDecoder>;

/// A client that finished the handshake: it sent `connection.open`.
struct Opened<R, W> {
    frames: Frames<R>,
    write_half: W,
    negotiated: Negotiated,
    out: FrameWriter,
}

/// The protocol header, the login and the tuning, within
/// `gateway.handshake_timeout` of accept. None: the client went, was too
/// slow, or was refused (and told so).
async fn handshake<S: ClientStream>(
    mut stream: S,
    header: [u8; 8],
    peer: SocketAddr,
    deadline: Instant,
    context: &ConnectionContext,
    read_buffer: &mut CountedBytes,
) -> std::io::Result<Option<Opened<S::Reader, S::Writer>>> {
    let config = &context.config;
    let login_throttle = &context.login_throttle;
    let engine = &context.engine;
    // One deadline from accept to open-ok, whatever the client does or
    // fails to do meanwhile (RabbitMQ's handshake_timeout).
    let deadline = tokio::time::sleep_until(deadline);
    tokio::pin!(deadline);
    if &header != PROTOCOL_HEADER {
        // Spec 4.2.2: answer with the protocol we speak, then close.
        tracing::debug!(%peer, ?header, "wrong protocol header");
        stream.write_all(PROTOCOL_HEADER).await?;
        stream.shutdown().await?;
        return Ok(None);
    }
    let certificate_user = stream.certificate_user();
    let (read_half, mut write_half) = stream.into_halves();
    // Until tune-ok, frames are held to the spec's minimum frame-max (as
    // RabbitMQ does): a peer that has not logged in gets no large buffers.
    let mut frames = FramedRead::new(
        MeasuredRead::new(read_half),
        FrameDecoder {
            frame_max: MIN_FRAME_MAX as usize,
        },
    );
    // Counted before login too: a flood of sockets that never log in is
    // seen by the memory ceiling (and refused at open past it).
    read_buffer.set(frames.read_buffer().capacity() as u64);
    let mut out = FrameWriter::default();

    // Written directly, before the writer task exists.
    let mut handshake = Handshake::new(config, peer).with_certificate_user(certificate_user);
    handshake.start(&mut out);
    send(&mut write_half, &out.take()).await?;
    let negotiated = loop {
        let frame = tokio::select! {
            _ = &mut deadline => {
                tracing::info!(%peer, timeout = ?config.settings.handshake_timeout, "handshake not finished in time, closing");
                return Ok(None);
            }
            frame = frames.next() => frame,
        };
        let mut step = match frame {
            None => return Ok(None),
            Some(Err(error)) => Err(frame_error(error)),
            Some(Ok(frame)) => handshake.on_frame(frame),
        };
        if let Ok(HandshakeStep::Authenticate(request)) = step {
            // An address that keeps failing waits its turn, within the
            // same deadline.
            let wait = login_throttle.wait(peer.ip(), config.clock.now());
            if !wait.is_zero() {
                tokio::select! {
                    _ = &mut deadline => {
                        tracing::info!(%peer, "login throttled past the handshake timeout, closing");
                        return Ok(None);
                    }
                    () = tokio::time::sleep(wait) => {}
                }
            }
            // The engine holds the users; within the same deadline.
            let answer = tokio::select! {
                _ = &mut deadline => {
                    tracing::info!(%peer, timeout = ?config.settings.handshake_timeout, "login not checked in time, closing");
                    return Ok(None);
                }
                answer = engine.authenticate(request) => answer,
            };
            step = handshake.on_login(answer, &mut out);
        }
        match step {
            Ok(HandshakeStep::Continue) => {}
            Ok(HandshakeStep::Authenticate(_)) => {
                debug_assert!(false, "the login was answered above");
            }
            Ok(HandshakeStep::Open(negotiated)) => {
                login_throttle.succeeded(peer.ip(), &negotiated.user);
                break negotiated;
            }
            Err(error) => {
                if let Some(refusal) = handshake.take_refusal() {
                    log_login_refusal(context, peer, &refusal);
                    let user = refusal.user().unwrap_or("");
                    if login_throttle.failed(peer.ip(), user, config.clock.now()) {
                        tracing::warn!(
                            %peer,
                            failures = spillway_telemetry::FREE_LOGIN_FAILURES,
                            "logins from this address are throttled to one a second after {} failures that no success of the same user forgave",
                            spillway_telemetry::FREE_LOGIN_FAILURES
                        );
                    }
                }
                close_unopened(&error, &mut out, write_half, &mut frames).await;
                return Ok(None);
            }
        }
        if !out.is_empty() {
            send(&mut write_half, &out.take()).await?;
        }
    };
    Ok(Some(Opened {
        frames,
        write_half,
        negotiated,
        out,
    }))
}

/// Closes a connection that has no engine session (yet): `connection.close`
/// written directly, the client's `close-ok` awaited briefly, then the
/// socket shut (TLS: close_notify, then FIN).
async fn close_unopened<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    error: &ConnectionError,
    out: &mut FrameWriter,
    mut write_half: W,
    frames: &mut Frames<R>,
) {
    write_connection_close(error, out);
    if send(&mut write_half, &out.take()).await.is_err() {
        return;
    }
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, drain_until_close_ok(frames)).await;
    let _ = write_half.shutdown().await;
}

/// What the read loop works with once the engine session is open.
struct ConnectionIo<R> {
    peer: SocketAddr,
    frames: Frames<R>,
    out: FrameWriter,
    read_buffer: CountedBytes,
    writer_tx: mpsc::Sender<Outbound>,
    commands: spillway_proto::engine::CommandSender,
    events: mpsc::UnboundedReceiver<SessionEvent>,
}

/// The connection's life: frames from the client to the engine, events
/// from the engine to the client, heartbeats, flow control and the memory
/// ceiling, until either side closes. Some(error): the broker closes the
/// connection with it.
async fn read_loop<R: AsyncRead + Unpin>(
    io: &mut ConnectionIo<R>,
    connection: &mut Connection,
    context: &ConnectionContext,
    mut stopped: watch::Receiver<bool>,
) -> Option<ConnectionError> {
    let ConnectionIo {
        peer,
        frames,
        out,
        read_buffer,
        writer_tx,
        commands,
        events,
    } = io;
    let peer = *peer;
    let metrics = &context.metrics;
    let memory = &context.memory;
    let mut open = metrics.connection_opened();
    let heartbeat = connection.heartbeat();
    let beat_every = Duration::from_secs(u64::from(heartbeat.max(1))) / 2;
    let mut ticker = tokio::time::interval(beat_every);
    ticker.tick().await;
    let mut silence = SilenceClock::new(heartbeat, tokio::time::Instant::now());
    let mut pending_commands: Vec<SessionCommand> = Vec::new();

    let mut read_room = ReadRoom::default();

    let closing: Option<ConnectionError> = loop {
        // Past the memory ceiling a publisher is blocked as by the engine's
        // flow control; while it is, the ceiling is looked at again every
        // MEMORY_RECHECK even if nothing else happens.
        if connection.has_published() {
            connection.set_memory_blocked(memory.over(), out);
            // The news goes out now: a client told it is blocked sends
            // nothing until it hears otherwise.
            if !flush(out, connection, writer_tx).await {
                break None;
            }
        }
        let memory_blocked = connection.memory_blocked();
        let paused = connection.reading_paused();
        let last_read = frames.get_mut().take_last();
        read_room.prepare(last_read, frames.read_buffer_mut());
        read_buffer.set(frames.read_buffer().capacity() as u64);
        // A client that was told it is blocked, or that we do not read, may
        // be silent for as long as that lasts.
        silence.set_suspended(
            paused || connection.client_told_blocked(),
            tokio::time::Instant::now(),
        );
        let step: Result<Next, ConnectionError> = tokio::select! {
            // Producer flow control: a blocked connection that spent its
            // overdraft is not read (TCP back-pressure) until unblocked.
            frame = frames.next(), if !paused => match frame {
                None => break None,
                Some(Err(FrameError::Io(_))) => break None,
                Some(Err(error)) => Err(frame_error(error)),
                Some(Ok(frame)) => {
                    silence.heard(tokio::time::Instant::now());
                    connection.set_read_chunk(read_room.chunk_of(frames.read_buffer()));
                    let mut step = connection.on_frame(frame, out, &mut pending_commands);
                    for _ in 1..FRAMES_PER_TURN {
                        if !matches!(step, Ok(Next::Continue)) || connection.reading_paused() {
                            break;
                        }
                        step = match buffered_frame(frames) {
                            Ok(Some(frame)) => {
                                connection.set_read_chunk(read_room.chunk_of(frames.read_buffer()));
                                connection.on_frame(frame, out, &mut pending_commands)
                            }
                            Ok(None) => break,
                            Err(error) => Err(frame_error(error)),
                        };
                    }
                    step
                }
            },
            event = events.recv() => match event {
                None => Err(ConnectionError::new(reply_code::CONNECTION_FORCED, "engine session ended")),
                Some(event) => handle_events(connection, event, events, out, &mut pending_commands)
                    .map(|()| Next::Continue),
            },
            _ = ticker.tick(), if heartbeat > 0 => {
                if silence.expired(tokio::time::Instant::now()) {
                    tracing::info!(%peer, "missed heartbeats from client, closing");
                    break None;
                }
                out.heartbeat();
                Ok(Next::Continue)
            },
            _ = stopped.changed() => Err(ConnectionError::new(reply_code::CONNECTION_FORCED, "broker shutdown")),
            () = tokio::time::sleep(MEMORY_RECHECK), if memory_blocked => Ok(Next::Continue),
            // The writer gave up on a client that does not read (or the
            // socket failed): nothing more can reach it.
            _ = writer_tx.closed() => break None,
        };
        for command in pending_commands.drain(..) {
            let counter = metrics.counter_for(&command);
            metrics.count_compression(&command);
            if commands.send(command).await.is_err() {
                break;
            }
            if let Some(counter) = counter {
                counter.inc();
            }
        }
        open.set_channels(connection.channel_count());
        open.set_unfinished(connection.unfinished_content());
        open.set_flow(
            connection.blocked().map(|(_, since)| since),
            connection.reading_paused(),
        );
        match step {
            Ok(Next::Continue) => {}
            Ok(Next::Closed) => {
                flush(out, connection, writer_tx).await;
                break None;
            }
            Err(error) => break Some(error),
        }
        if !flush(out, connection, writer_tx).await {
            break None;
        }
    };
    closing
}

/// Handles one event and whatever else is ready, up to a flush's worth.
fn handle_events(
    connection: &mut Connection,
    first: SessionEvent,
    events: &mut mpsc::UnboundedReceiver<SessionEvent>,
    out: &mut FrameWriter,
    commands: &mut Vec<SessionCommand>,
) -> Result<(), ConnectionError> {
    connection.on_event(first, out, commands)?;
    for _ in 1..EVENTS_PER_FLUSH {
        let Ok(event) = events.try_recv() else { break };
        connection.on_event(event, out, commands)?;
    }
    Ok(())
}

async fn flush(
    out: &mut FrameWriter,
    connection: &mut Connection,
    writer: &mpsc::Sender<Outbound>,
) -> bool {
    if out.is_empty() {
        return true;
    }
    let outbound = Outbound {
        segments: out.take_segments(),
        deliveries: std::mem::take(&mut connection.deliveries),
    };
    writer.send(outbound).await.is_ok()
}

/// Writes `bytes` and flushes: a TLS stream may keep the tail of a write
/// in its buffer until flushed (plain TCP's flush does nothing).
async fn send<W: AsyncWrite + Unpin>(socket: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    socket.write_all(bytes).await?;
    socket.flush().await
}

/// How long a write may make no progress (`gateway.write_timeout`).
struct WriteDeadline {
    peer: SocketAddr,
    timeout: Option<Duration>,
}

impl WriteDeadline {
    /// Writes all of `segments`, in order, failing when one write makes no
    /// progress within the timeout: a client that stops reading cannot hold
    /// its connection task (and the heartbeat check) for ever. A slow reader
    /// that keeps taking bytes is not cut off. Vectored writes where the
    /// socket takes them (TCP, and rustls, which encrypts them together);
    /// else one segment after the other.
    async fn write_all<W: AsyncWrite + Unpin>(
        &self,
        socket: &mut W,
        segments: &[Bytes],
    ) -> std::io::Result<()> {
        let vectored = socket.is_write_vectored();
        // The first segment not yet written whole, and how much of it is.
        let mut index = 0;
        let mut offset = 0;
        loop {
            while index < segments.len() && offset == segments[index].len() {
                index += 1;
                offset = 0;
            }
            if index == segments.len() {
                return Ok(());
            }
            let mut slices = [IoSlice::new(&[]); MAX_IOVECS];
            let mut count = 0;
            if vectored {
                for (n, segment) in segments[index..].iter().enumerate() {
                    if count == MAX_IOVECS {
                        break;
                    }
                    let from = if n == 0 { offset } else { 0 };
                    if from < segment.len() {
                        slices[count] = IoSlice::new(&segment[from..]);
                        count += 1;
                    }
                }
            } else {
                slices[0] = IoSlice::new(&segments[index][offset..]);
                count = 1;
            }
            let write = socket.write_vectored(&slices[..count]);
            let written = match self.timeout {
                None => write.await?,
                Some(timeout) => match tokio::time::timeout(timeout, write).await {
                    Ok(written) => written?,
                    Err(_) => {
                        tracing::info!(peer = %self.peer, ?timeout, "client did not read for the write timeout, closing");
                        return Err(std::io::ErrorKind::TimedOut.into());
                    }
                },
            };
            if written == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            // Past what was written, which may end inside a segment.
            let mut left = written;
            while left > 0 && index < segments.len() {
                let rest = segments[index].len() - offset;
                if left < rest {
                    offset += left;
                    left = 0;
                } else {
                    left -= rest;
                    index += 1;
                    offset = 0;
                }
            }
        }
    }

    /// Flushes what a TLS stream still buffers, under the same timeout.
    /// Plain TCP's flush is ready at once: no timer is armed for it.
    async fn flush<W: AsyncWrite + Unpin>(&self, socket: &mut W) -> std::io::Result<()> {
        use futures::FutureExt;
        let flush = socket.flush();
        tokio::pin!(flush);
        if let Some(flushed) = flush.as_mut().now_or_never() {
            return flushed;
        }
        match self.timeout {
            None => flush.await,
            Some(timeout) => match tokio::time::timeout(timeout, flush).await {
                Ok(flushed) => flushed,
                Err(_) => {
                    tracing::info!(peer = %self.peer, ?timeout, "client did not read for the write timeout, closing");
                    Err(std::io::ErrorKind::TimedOut.into())
                }
            },
        }
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut socket: W,
    mut outbound: mpsc::Receiver<Outbound>,
    commands: spillway_proto::engine::CommandSender,
    metrics: GatewayMetrics,
    deadline: WriteDeadline,
) {
    let mut ready = Vec::with_capacity(WRITER_QUEUE);
    let mut segments: Vec<Bytes> = Vec::new();
    while outbound.recv_many(&mut ready, WRITER_QUEUE).await > 0 {
        let mut deliveries = 0;
        segments.clear();
        for chunk in ready.drain(..) {
            deliveries += chunk.deliveries;
            segments.extend(chunk.segments);
        }
        // Every chunk taken, written in as few syscalls as the socket allows.
        if let Err(error) = deadline.write_all(&mut socket, &segments).await {
            if error.kind() == std::io::ErrorKind::TimedOut {
                metrics.count_write_timeout();
            }
            return;
        }
        segments.clear();
        if let Err(error) = deadline.flush(&mut socket).await {
            if error.kind() == std::io::ErrorKind::TimedOut {
                metrics.count_write_timeout();
            }
            return;
        }
        if deliveries > 0 {
            metrics.count_delivered(deliveries);
            let written = SessionCommand {
                command: Some(Command::DeliveriesWritten(DeliveriesWritten {
                    count: deliveries,
                })),
            };
            // The session may already be gone; the credit no longer matters then.
            let _ = commands.send(written).await;
        }
    }
    let _ = socket.shutdown().await;
}

/// The next frame already in `frames`' read buffer, decoded without
/// reading the socket; `None` when the buffer holds no whole frame (the
/// stream then reads when next polled, as it would have).
fn buffered_frame<R>(
    frames: &mut FramedRead<R, FrameDecoder>,
) -> Result<Option<spillway_amqp::codec::RawFrame>, FrameError> {
    let mut buffer = std::mem::take(frames.read_buffer_mut());
    let frame = frames.decoder_mut().decode(&mut buffer);
    *frames.read_buffer_mut() = buffer;
    frame
}

async fn drain_until_close_ok<R>(frames: &mut FramedRead<R, FrameDecoder>)
where
    R: tokio::io::AsyncRead + Unpin,
{
    use amq_protocol::protocol::{connection as conn, AMQPClass};
    while let Some(Ok(frame)) = frames.next().await {
        if frame.kind != spillway_amqp::codec::FRAME_METHOD || frame.channel != 0 {
            continue;
        }
        if let Ok(AMQPClass::Connection(
            conn::AMQPMethod::CloseOk(_) | conn::AMQPMethod::Close(_),
        )) = spillway_amqp::codec::parse_method(&frame.payload)
        {
            return;
        }
    }
}

fn frame_error(error: FrameError) -> ConnectionError {
    ConnectionError::new(reply_code::FRAME_ERROR, error.to_string())
}

#[cfg(test)]
mod tests {
    use amq_protocol::protocol::{connection as conn, AMQPClass};
    use spillway_amqp::codec::{parse_method, FRAME_METHOD};
    use spillway_amqp::MethodId;
    use tokio::io::{duplex, AsyncReadExt};

    use super::*;

    const PEER: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
        std::net::Ipv4Addr::LOCALHOST,
        40000,
    ));

    fn frames<R: AsyncRead>(read: R) -> Frames<R> {
        FramedRead::new(
            MeasuredRead::new(read),
            FrameDecoder {
                frame_max: MIN_FRAME_MAX as usize,
            },
        )
    }

    fn deadline(timeout: Duration) -> WriteDeadline {
        WriteDeadline {
            peer: PEER,
            timeout: Some(timeout),
        }
    }

    /// The methods on channel 0 a client receives, until the broker shuts
    /// the socket.
    async fn methods_until_eof<R: AsyncRead + Unpin>(read: R) -> Vec<AMQPClass> {
        let mut frames = frames(read);
        let mut methods = Vec::new();
        while let Some(Ok(frame)) = frames.next().await {
            if frame.kind == FRAME_METHOD && frame.channel == 0 {
                if let Ok(method) = parse_method(&frame.payload) {
                    methods.push(method);
                }
            }
        }
        methods
    }

    #[tokio::test]
    async fn segments_arrive_whole_and_in_order_through_partial_writes() {
        // An 8-byte pipe: every write is partial, most end inside a segment.
        let (mut broker, mut client) = duplex(8);
        let segments: Vec<Bytes> = (0..20u8)
            .map(|n| Bytes::from(vec![n; usize::from(n % 7) + 1]))
            .collect();
        let expected: Vec<u8> = segments.iter().flat_map(|s| s.to_vec()).collect();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let _ = client.read_to_end(&mut got).await;
            got
        });
        let written = deadline(Duration::from_secs(5))
            .write_all(&mut broker, &segments)
            .await;
        assert!(written.is_ok(), "{written:?}");
        drop(broker);
        assert_eq!(reader.await.ok(), Some(expected));
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_reads_nothing_times_out_but_a_slow_one_does_not() {
        let segments = [Bytes::from(vec![7u8; 64])];
        let (mut broker, _client) = duplex(16);
        let written = deadline(Duration::from_secs(5))
            .write_all(&mut broker, &segments)
            .await;
        assert_eq!(
            written.map_err(|e| e.kind()),
            Err(std::io::ErrorKind::TimedOut)
        );

        // Eight bytes a second: the whole write takes longer than the
        // timeout, but no single write waits that long.
        let (mut broker, mut client) = duplex(16);
        let reader = tokio::spawn(async move {
            let mut got = 0;
            let mut buffer = [0u8; 8];
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                match client.read(&mut buffer).await {
                    Ok(0) | Err(_) => return got,
                    Ok(n) => got += n,
                }
            }
        });
        let started = tokio::time::Instant::now();
        let written = deadline(Duration::from_secs(5))
            .write_all(&mut broker, &segments)
            .await;
        assert!(written.is_ok(), "{written:?}");
        assert!(started.elapsed() > Duration::from_secs(5));
        drop(broker);
        assert_eq!(reader.await.ok(), Some(64));
    }

    #[tokio::test(start_paused = true)]
    async fn an_unopened_connection_is_closed_with_its_error_then_shut() {
        let error =
            ConnectionError::new(reply_code::NOT_ALLOWED, "no room").on(MethodId::CONNECTION_OPEN);
        // A client that answers close-ok.
        let (broker, client) = duplex(4096);
        let (broker_read, broker_write) = tokio::io::split(broker);
        let (client_read, mut client_write) = tokio::io::split(client);
        let client = tokio::spawn(async move {
            let mut frames = frames(client_read);
            let mut out = FrameWriter::default();
            let mut seen = Vec::new();
            while let Some(Ok(frame)) = frames.next().await {
                let Ok(method) = parse_method(&frame.payload) else {
                    continue;
                };
                if matches!(method, AMQPClass::Connection(conn::AMQPMethod::Close(_))) {
                    out.method(
                        0,
                        AMQPClass::Connection(conn::AMQPMethod::CloseOk(conn::CloseOk {})),
                    );
                    let _ = client_write.write_all(&out.take()).await;
                }
                seen.push(method);
            }
            seen
        });
        let started = tokio::time::Instant::now();
        let mut out = FrameWriter::default();
        close_unopened(&error, &mut out, broker_write, &mut frames(broker_read)).await;
        assert!(
            started.elapsed() < CLOSE_TIMEOUT,
            "waited past the close-ok"
        );
        let seen = client.await.unwrap_or_default();
        let [AMQPClass::Connection(conn::AMQPMethod::Close(close))] = seen.as_slice() else {
            panic!("the client saw {seen:?}");
        };
        assert_eq!(close.reply_code, reply_code::NOT_ALLOWED);
        assert_eq!(close.reply_text.as_str(), "NOT_ALLOWED - no room");
        assert_eq!(
            (close.class_id, close.method_id),
            (
                MethodId::CONNECTION_OPEN.class_id,
                MethodId::CONNECTION_OPEN.method_id
            )
        );

        // A client that never answers: shut after the close timeout.
        let (broker, client) = duplex(4096);
        let (broker_read, broker_write) = tokio::io::split(broker);
        let (client_read, _client_write) = tokio::io::split(client);
        let client = tokio::spawn(methods_until_eof(client_read));
        let started = tokio::time::Instant::now();
        let mut out = FrameWriter::default();
        close_unopened(&error, &mut out, broker_write, &mut frames(broker_read)).await;
        assert!(started.elapsed() >= CLOSE_TIMEOUT);
        assert_eq!(client.await.map(|m| m.len()).ok(), Some(1));
    }
}
