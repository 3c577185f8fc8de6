//! `--client raw`: a lean AMQP client for the producers and consumers, on the gateway's
//! own frame codec.
//!
//! lapin runs its own I/O loop and hands every frame across a channel; on a VM where a
//! context switch is expensive it spends more CPU per message than the broker under test
//! (about 40 µs against the broker's 20 µs, measured on the 2-core CI machine), so a
//! benchmark through it measures lapin. This client batches instead: a producer encodes
//! many publishes and writes them with one syscall, a consumer handles every frame one
//! read returned and answers them (acks) with one write. RabbitMQ and Spillway are
//! measured through the same client.
//!
//! It covers what the benchmarks need: publish (transient or persistent, with or without
//! confirms, optionally rate-limited), consume (acks with `multiple`, or `--auto-ack`),
//! connection.blocked/unblocked. Not fault mode (`--reconnect`) or fault injection: those
//! stay with lapin, whose reconnect handling the compose drills rely on.
//!
//! Hand-written rather than a library: the point is a client whose cost per message is
//! well below the broker's; lapin (the library) is what costs too much. Framing and the
//! non-hot methods go through `spillway_amqp::codec` and amq-protocol; only
//! basic.publish, basic.deliver and basic.ack/nack are encoded or read by hand.

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::protocol::{basic, channel, confirm, connection, queue, tx, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};
use amq_protocol::uri::AMQPUri;
use anyhow::{anyhow, bail, Context, Result};
use bytes::{BufMut, Bytes, BytesMut};
use futures::{StreamExt, TryStreamExt};
use serde::Serialize;
use spillway_amqp::codec::{
    parse_content_header, parse_method, FrameDecoder, FrameWriter, RawFrame, FRAME_BODY, FRAME_END,
    FRAME_HEADER, FRAME_METHOD, MIN_FRAME_MAX, PROTOCOL_HEADER,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{watch, Notify};
use tokio_util::codec::Decoder;

use crate::message::{encode_append, encode_into, now_ns, Header, HEADER_LEN};
use crate::verify::BitSet;
use crate::{Acks, Budget, ConsumerOutcome, Pacer, ProducerOutcome, Shared, ACK_FLUSH};

/// The frame size this client asks for (RabbitMQ's default).
const FRAME_MAX: u32 = 131_072;
/// Bytes of publishes encoded before they are written.
const WRITE_BATCH: usize = 64 * 1024;
/// How long a clean close may take. The close-ok comes after the broker has
/// read every publish before it, and a broker that paces publishers by
/// reading their sockets slowly (RabbitMQ's credit flow) can take as long
/// as its backlog takes to drain: 5 s lost RabbitMQ's last publishes of
/// case g once, with a 6.5 s p99 latency.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(30);
/// The one channel this client opens.
const CHANNEL: u16 = 1;

/// Frames off one socket.
struct FrameReader {
    socket: OwnedReadHalf,
    buffer: BytesMut,
    decoder: FrameDecoder,
    /// Free space kept for one read: large for throughput, small for idle connections.
    read_size: usize,
}

impl FrameReader {
    /// The next whole frame already read, if any.
    fn buffered(&mut self) -> Result<Option<RawFrame>> {
        self.decoder
            .decode(&mut self.buffer)
            .map_err(|e| anyhow!("bad frame from the broker: {e}"))
    }

    /// Reads more bytes; fails when the broker closed the socket.
    async fn fill(&mut self) -> Result<()> {
        if self.buffer.capacity() - self.buffer.len() < self.read_size / 4 {
            self.buffer.reserve(self.read_size);
        }
        let n = self.socket.read_buf(&mut self.buffer).await?;
        if n == 0 {
            bail!("the broker closed the connection");
        }
        Ok(())
    }

    async fn next(&mut self) -> Result<RawFrame> {
        loop {
            if let Some(frame) = self.buffered()? {
                return Ok(frame);
            }
            self.fill().await?;
        }
    }

    /// The next method (heartbeats skipped); a close from the broker is an error
    /// naming its reply.
    async fn method(&mut self) -> Result<AMQPClass> {
        loop {
            let frame = self.next().await?;
            if frame.kind != FRAME_METHOD {
                continue;
            }
            let method = parse_method(&frame.payload)
                .map_err(|e| anyhow!("unreadable method from the broker: {e:?}"))?;
            closed_by_broker(&method)?;
            return Ok(method);
        }
    }
}

/// An error for a connection.close or channel.close from the broker.
fn closed_by_broker(method: &AMQPClass) -> Result<()> {
    match method {
        AMQPClass::Connection(connection::AMQPMethod::Close(close)) => bail!(
            "connection closed by the broker: {} {}",
            close.reply_code,
            close.reply_text
        ),
        AMQPClass::Channel(channel::AMQPMethod::Close(close)) => bail!(
            "channel closed by the broker: {} {}",
            close.reply_code,
            close.reply_text
        ),
        _ => Ok(()),
    }
}

/// An open connection with channel 1 open.
struct RawConnection {
    reader: FrameReader,
    writer: OwnedWriteHalf,
    out: FrameWriter,
    frame_max: usize,
}

/// Read buffer of a connection that carries load.
const BUSY_READ: usize = 64 * 1024;
/// Read buffer of a connection held idle (`--idle-connections`): ten thousand of them.
const IDLE_READ: usize = 4 * 1024;

impl RawConnection {
    async fn open(url: &str, name: &str) -> Result<Self> {
        Self::open_with(url, name, BUSY_READ).await
    }

    async fn open_with(url: &str, name: &str, read_size: usize) -> Result<Self> {
        let uri: AMQPUri = url.parse().map_err(|e: String| anyhow!("{url}: {e}"))?;
        if uri.scheme == amq_protocol::uri::AMQPScheme::AMQPS {
            bail!("{url}: the raw client speaks plain AMQP only; use --client lapin for amqps://");
        }
        let authority = &uri.authority;
        let socket = TcpStream::connect((authority.host.as_str(), authority.port))
            .await
            .with_context(|| format!("{name}: cannot connect to {url}"))?;
        socket.set_nodelay(true)?;
        let (read_half, write_half) = socket.into_split();
        let mut conn = Self {
            reader: FrameReader {
                socket: read_half,
                buffer: BytesMut::with_capacity(read_size),
                decoder: FrameDecoder {
                    frame_max: FRAME_MAX as usize,
                },
                read_size,
            },
            writer: write_half,
            out: FrameWriter::default(),
            frame_max: MIN_FRAME_MAX as usize,
        };
        conn.writer.write_all(PROTOCOL_HEADER).await?;
        match conn.reader.method().await? {
            AMQPClass::Connection(connection::AMQPMethod::Start(_)) => {}
            other => bail!("{name}: expected connection.start, got {other:?}"),
        }
        let mut properties = FieldTable::default();
        properties.insert(
            "connection_name".into(),
            AMQPValue::LongString(name.to_string().into()),
        );
        properties.insert(
            "product".into(),
            AMQPValue::LongString("spillway-loadgen (raw)".into()),
        );
        // A broker tells only clients that ask when it blocks their
        // publishes; without this, blocked time would not be reported.
        let mut capabilities = FieldTable::default();
        for capability in ["connection.blocked", "publisher_confirms"] {
            capabilities.insert(capability.into(), AMQPValue::Boolean(true));
        }
        properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
        let user = &authority.userinfo;
        conn.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: properties,
                mechanism: "PLAIN".into(),
                response: format!("\0{}\0{}", user.username, user.password).into(),
                locale: "en_US".into(),
            })),
        )
        .await?;
        let tune = match conn.reader.method().await? {
            AMQPClass::Connection(connection::AMQPMethod::Tune(tune)) => tune,
            other => bail!("{name}: expected connection.tune, got {other:?}"),
        };
        let frame_max = match tune.frame_max {
            0 => FRAME_MAX,
            offered => offered.min(FRAME_MAX),
        };
        conn.out.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: tune.channel_max,
                frame_max,
                heartbeat: 0,
            })),
        );
        conn.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: uri.vhost.clone().into(),
            })),
        )
        .await?;
        match conn.reader.method().await? {
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)) => {}
            other => bail!("{name}: expected connection.open-ok, got {other:?}"),
        }
        conn.frame_max = frame_max as usize;
        conn.send(
            CHANNEL,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await?;
        match conn.reader.method().await? {
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)) => {}
            other => bail!("{name}: expected channel.open-ok, got {other:?}"),
        }
        Ok(conn)
    }

    /// Writes `method` and whatever was queued before it.
    async fn send(&mut self, channel: u16, method: AMQPClass) -> Result<()> {
        self.out.method(channel, method);
        self.flush().await
    }

    async fn flush(&mut self) -> Result<()> {
        if !self.out.is_empty() {
            self.writer.write_all(&self.out.take()).await?;
        }
        Ok(())
    }

    /// Sends `method` and waits for the next method, which must satisfy `expected`.
    async fn call(
        &mut self,
        method: AMQPClass,
        what: &str,
        expected: impl Fn(&AMQPClass) -> bool,
    ) -> Result<()> {
        self.send(CHANNEL, method).await?;
        let reply = self.reader.method().await.context(what.to_string())?;
        if !expected(&reply) {
            bail!("{what}: unexpected reply {reply:?}");
        }
        Ok(())
    }
}

/// Sends connection.close and waits (bounded) for close-ok: a clean goodbye.
async fn close(writer: &mut OwnedWriteHalf, reader: Option<&mut FrameReader>) {
    let mut out = FrameWriter::default();
    out.method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "loadgen done".into(),
            class_id: 0,
            method_id: 0,
        })),
    );
    if writer.write_all(&out.take()).await.is_err() {
        return;
    }
    if let Some(reader) = reader {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, async {
            while let Ok(frame) = reader.next().await {
                if frame.kind == FRAME_METHOD
                    && matches!(
                        parse_method(&frame.payload),
                        Ok(AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))
                    )
                {
                    return;
                }
            }
        })
        .await;
    }
}

/// The frames every publish of a run shares: the basic.publish method frame and the
/// content header (the body size is fixed per run).
/// With `priority`, the header carries a priority property too, as the prefix's
/// second-to-last byte ([`set_priority`] changes it per message).
fn publish_prefix(queue: &str, persistent: bool, size: usize, priority: bool) -> Result<Vec<u8>> {
    let mut out = FrameWriter::default();
    out.method(
        CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: queue.to_string().into(),
            mandatory: false,
            immediate: false,
        })),
    );
    let mut prefix = out.take().to_vec();
    if prefix.is_empty() {
        bail!("queue name {queue:?} cannot be encoded (over 255 bytes?)");
    }
    // Content header: class 60, weight 0, body size, flags (delivery-mode, and priority
    // with `priority`), mode (and priority).
    let header_payload = 2 + 2 + 8 + 2 + 1 + u32::from(priority);
    prefix.put_u8(FRAME_HEADER);
    prefix.put_u16(CHANNEL);
    prefix.put_u32(header_payload);
    prefix.put_u16(60);
    prefix.put_u16(0);
    prefix.put_u64(size as u64);
    prefix.put_u16(if priority { 0x1800 } else { 0x1000 });
    prefix.put_u8(if persistent { 2 } else { 1 });
    if priority {
        prefix.put_u8(0);
    }
    prefix.put_u8(FRAME_END);
    Ok(prefix)
}

/// Sets the priority byte of a prefix made with `priority`.
fn set_priority(prefix: &mut [u8], priority: u8) {
    if let Some(at) = prefix.len().checked_sub(2) {
        prefix[at] = priority;
    }
}

/// Confirms seen by a producer's reader; the publisher waits on `settled`.
#[derive(Default)]
struct Window {
    /// Every delivery tag up to this one is settled (acked or nacked).
    settled: AtomicU64,
    changed: Notify,
    /// --tx-every: the last tag of each tx.commit sent and not yet answered, in order;
    /// commit-ok settles the publishes up to it.
    commits: std::sync::Mutex<VecDeque<u64>>,
}

/// What a producer's reader counted.
#[derive(Default)]
struct ConfirmTally {
    confirmed: u64,
    confirmed_seqs: BitSet,
    nacked: u64,
}

/// Reads a producer's socket: confirms, flow control, and the broker's close.
struct ConfirmReader {
    window: Arc<Window>,
    shared: Arc<Shared>,
    connection_id: usize,
    /// Sequence number of delivery tag 1.
    first_seq: u64,
    /// Lowest tag not yet settled, and settled tags above it.
    low: u64,
    above: BTreeSet<u64>,
    tally: ConfirmTally,
}

impl ConfirmReader {
    async fn run(mut self, mut reader: FrameReader) -> Result<ConfirmTally> {
        loop {
            let frame = reader.next().await?;
            if frame.kind != FRAME_METHOD {
                continue;
            }
            let p = &frame.payload;
            if p.len() >= 13 && p[0..2] == [0, 60] && (p[2..4] == [0, 80] || p[2..4] == [0, 120]) {
                // basic.ack / basic.nack: delivery tag, then the multiple bit.
                let mut tag = [0u8; 8];
                tag.copy_from_slice(&p[4..12]);
                self.settle(u64::from_be_bytes(tag), p[12] & 1 == 1, p[3] == 80);
                continue;
            }
            let method = parse_method(p).map_err(|e| anyhow!("unreadable method: {e:?}"))?;
            match method {
                AMQPClass::Connection(connection::AMQPMethod::Blocked(blocked)) => {
                    self.shared
                        .blocked
                        .block(self.connection_id, blocked.reason.to_string());
                }
                AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)) => {
                    self.shared.blocked.unblock(self.connection_id);
                }
                AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => {
                    self.shared.blocked.unblock(self.connection_id);
                    return Ok(self.tally);
                }
                AMQPClass::Tx(tx::AMQPMethod::CommitOk(_)) => {
                    let last = self
                        .window
                        .commits
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .pop_front();
                    if let Some(last) = last {
                        self.settle(last, true, true);
                    }
                }
                other => {
                    if let Err(e) = closed_by_broker(&other) {
                        self.shared.blocked.unblock(self.connection_id);
                        return Err(e);
                    }
                }
            }
        }
    }

    fn settle(&mut self, tag: u64, multiple: bool, ack: bool) {
        if multiple {
            for t in self.low..=tag {
                if !self.above.remove(&t) {
                    self.count(t, ack);
                }
            }
            self.low = self.low.max(tag.saturating_add(1));
        } else if tag >= self.low && self.above.insert(tag) {
            self.count(tag, ack);
        }
        while self.above.remove(&self.low) {
            self.low += 1;
        }
        self.window.settled.store(self.low - 1, Ordering::Release);
        self.window.changed.notify_one();
    }

    fn count(&mut self, tag: u64, ack: bool) {
        if ack {
            self.tally.confirmed += 1;
            self.tally
                .confirmed_seqs
                .insert(self.first_seq + tag.saturating_sub(1));
            self.shared.confirmed.fetch_add(1, Ordering::Relaxed);
        } else {
            self.tally.nacked += 1;
        }
    }
}

/// One producer connection: publishes `budget`'s messages to `queue` in batches.
pub(crate) async fn producer_session(
    shared: &Arc<Shared>,
    queue: &str,
    out: &mut ProducerOutcome,
    budget: &Budget,
) -> Result<()> {
    let args = &shared.args;
    let mut conn = RawConnection::open(&args.url, &format!("loadgen-producer-{}", out.id)).await?;
    if args.confirm {
        conn.call(
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
            "confirm.select",
            |m| matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))),
        )
        .await?;
    }
    if args.tx_every.is_some() {
        conn.call(
            AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})),
            "tx.select",
            |m| matches!(m, AMQPClass::Tx(tx::AMQPMethod::SelectOk(_))),
        )
        .await?;
    }
    let RawConnection {
        reader,
        mut writer,
        frame_max,
        ..
    } = conn;
    let window = Arc::new(Window::default());
    let mut confirms = tokio::spawn(
        ConfirmReader {
            window: window.clone(),
            shared: shared.clone(),
            connection_id: shared.next_conn.fetch_add(1, Ordering::Relaxed),
            first_seq: out.next_seq,
            low: 1,
            above: BTreeSet::new(),
            tally: ConfirmTally::default(),
        }
        .run(reader),
    );
    let result = publish(
        shared,
        &mut writer,
        &window,
        &mut confirms,
        out,
        budget,
        queue,
        frame_max,
    )
    .await;
    let tally = match result {
        Ok(()) => {
            out.finished = Some(Instant::now());
            close(&mut writer, None).await;
            match tokio::time::timeout(CLOSE_TIMEOUT, &mut confirms).await {
                Ok(Ok(Ok(tally))) => Ok(tally),
                Ok(Ok(Err(e))) => Err(e),
                Ok(Err(e)) => Err(anyhow!("confirm reader: {e}")),
                Err(_) => Err(anyhow!("no close-ok from the broker")),
            }
        }
        Err(e) => {
            confirms.abort();
            Err(e)
        }
    };
    match tally {
        Ok(tally) => {
            out.confirmed += tally.confirmed;
            out.nacked += tally.nacked;
            out.confirmed_seqs = tally.confirmed_seqs;
            Ok(())
        }
        Err(e) => {
            if args.confirm {
                out.in_doubt += out.published.saturating_sub(out.confirmed + out.nacked);
            }
            Err(e)
        }
    }
}

type ConfirmTask = tokio::task::JoinHandle<Result<ConfirmTally>>;

/// The publish loop: encodes up to [`WRITE_BATCH`] bytes of publishes (fewer when the
/// confirm window or the rate says so) and writes them at once.
#[allow(clippy::too_many_arguments)]
async fn publish(
    shared: &Arc<Shared>,
    writer: &mut OwnedWriteHalf,
    window: &Window,
    confirms: &mut ConfirmTask,
    out: &mut ProducerOutcome,
    budget: &Budget,
    queue: &str,
    frame_max: usize,
) -> Result<()> {
    let args = &shared.args;
    let mut prefix = publish_prefix(queue, args.persistent, args.size, args.priorities > 0)?;
    let chunk = frame_max.saturating_sub(8).max(1);
    let body_len = args.size.max(HEADER_LEN);
    let mut body = Vec::new();
    let mut batch: Vec<u8> = Vec::with_capacity(WRITE_BATCH + prefix.len() + args.size + 64);
    let window_size = args.confirm_window.max(1) as u64;
    let tx_every = args.tx_every.unwrap_or(0);
    let commit = {
        let mut out = FrameWriter::default();
        out.method(
            CHANNEL,
            AMQPClass::Tx(tx::AMQPMethod::Commit(tx::Commit {})),
        );
        out.take()
    };
    let push_commit = |batch: &mut Vec<u8>, last: u64| {
        batch.extend_from_slice(&commit);
        window
            .commits
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push_back(last);
    };
    let mut tag = 0u64;
    // A tx.commit is in the batch being written.
    let mut committing = false;
    let done = |out: &ProducerOutcome| budget.spent(shared, out);
    while !done(out) {
        if args.confirm {
            wait_for_room(window, confirms, tag, window_size).await?;
        }
        while !done(out) && batch.len() < WRITE_BATCH {
            if args.confirm && tag - window.settled.load(Ordering::Acquire) >= window_size {
                break;
            }
            if let Some(due) = budget.not_before(args, out) {
                if !batch.is_empty() {
                    break;
                }
                tokio::time::sleep_until(due.into()).await;
            }
            let seq = out.next_seq;
            let header = Header {
                producer: out.id,
                seq,
                sent_ns: now_ns(),
            };
            if args.priorities > 0 {
                set_priority(
                    &mut prefix,
                    crate::message::priority_of(seq, args.priorities),
                );
            }
            batch.extend_from_slice(&prefix);
            if body_len <= chunk {
                // One body frame: the body is made in place, not copied.
                batch.put_u8(FRAME_BODY);
                batch.put_u16(CHANNEL);
                batch.put_u32(body_len as u32);
                encode_append(&mut batch, args.size, header);
                batch.put_u8(FRAME_END);
            } else {
                encode_into(&mut body, args.size, header);
                for part in body.chunks(chunk) {
                    batch.put_u8(FRAME_BODY);
                    batch.put_u16(CHANNEL);
                    batch.put_u32(part.len() as u32);
                    batch.extend_from_slice(part);
                    batch.put_u8(FRAME_END);
                }
            }
            out.next_seq += 1;
            out.published += 1;
            tag += 1;
            shared.published.fetch_add(1, Ordering::Relaxed);
            if tx_every > 0 && (tag % tx_every == 0 || done(out)) {
                push_commit(&mut batch, tag);
                committing = true;
                break;
            }
        }
        if !batch.is_empty() {
            writer
                .write_all(&batch)
                .await
                .context("basic.publish (write)")?;
            batch.clear();
        }
        if committing {
            // tx.commit is synchronous: commit-ok before the next publish.
            wait_for_room(window, confirms, tag, 1).await?;
            committing = false;
        }
    }
    if tx_every > 0 && window.settled.load(Ordering::Acquire) < tag {
        // Stopped (deadline) with publishes not committed yet.
        push_commit(&mut batch, tag);
        writer
            .write_all(&batch)
            .await
            .context("tx.commit (write)")?;
        batch.clear();
        wait_for_room(window, confirms, tag, 1).await?;
    }
    if args.confirm {
        wait_for_room(window, confirms, tag, 1).await?;
    }
    Ok(())
}

/// Waits until fewer than `limit` of the `published` tags are unsettled; fails when the
/// reader stopped (the broker closed the connection).
async fn wait_for_room(
    window: &Window,
    confirms: &mut ConfirmTask,
    published: u64,
    limit: u64,
) -> Result<()> {
    loop {
        let changed = window.changed.notified();
        if published - window.settled.load(Ordering::Acquire) < limit {
            return Ok(());
        }
        tokio::select! {
            () = changed => {}
            ended = &mut *confirms => {
                return match ended {
                    Ok(Err(e)) => Err(e),
                    Ok(Ok(_)) => Err(anyhow!("connection closed while confirms were outstanding")),
                    Err(e) => Err(anyhow!("confirm reader: {e}")),
                };
            }
        }
    }
}

/// A delivery whose content is still arriving.
struct Incoming {
    tag: u64,
    redelivered: bool,
    size: usize,
    body: IncomingBody,
}

/// A delivery's body as its frames arrive: a body in one frame is that
/// frame's payload, not a copy of it.
#[derive(Default)]
enum IncomingBody {
    #[default]
    Empty,
    Whole(Bytes),
    Parts(BytesMut),
}

impl IncomingBody {
    fn append(&mut self, payload: Bytes) {
        *self = match std::mem::take(self) {
            IncomingBody::Empty => IncomingBody::Whole(payload),
            IncomingBody::Whole(first) => {
                let mut parts = BytesMut::with_capacity(first.len() + payload.len());
                parts.extend_from_slice(&first);
                parts.extend_from_slice(&payload);
                IncomingBody::Parts(parts)
            }
            IncomingBody::Parts(mut parts) => {
                parts.extend_from_slice(&payload);
                IncomingBody::Parts(parts)
            }
        };
    }

    fn len(&self) -> usize {
        self.bytes().len()
    }

    fn bytes(&self) -> &[u8] {
        match self {
            IncomingBody::Empty => &[],
            IncomingBody::Whole(bytes) => bytes,
            IncomingBody::Parts(parts) => parts,
        }
    }
}

/// One consumer connection: consumes `queues` until the run stops.
pub(crate) async fn consumer_session(
    shared: &Arc<Shared>,
    id: u32,
    queues: &[String],
    out: &mut ConsumerOutcome,
    ready: &mut Option<tokio::sync::mpsc::Sender<()>>,
) -> Result<()> {
    let args = &shared.args;
    let mut conn =
        RawConnection::open(args.consumer_url(), &format!("loadgen-consumer-{id}")).await?;
    conn.call(
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: args.prefetch,
            global: false,
        })),
        "basic.qos",
        |m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_))),
    )
    .await?;
    for q in queues {
        conn.call(
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: q.clone().into(),
                consumer_tag: format!("loadgen-c{id}-{q}").into(),
                no_local: false,
                no_ack: args.auto_ack,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
            "basic.consume",
            |m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_))),
        )
        .await
        .with_context(|| format!("basic.consume on {q}"))?;
    }
    out.subscribed.get_or_insert_with(Instant::now);
    if let Some(ready) = ready.take() {
        let _ = ready.send(()).await;
    }
    let result = consume(shared, &mut conn, out).await;
    if result.is_ok() {
        close(&mut conn.writer, Some(&mut conn.reader)).await;
    }
    result
}

async fn consume(
    shared: &Arc<Shared>,
    conn: &mut RawConnection,
    out: &mut ConsumerOutcome,
) -> Result<()> {
    let args = &shared.args;
    let size = Some(args.size);
    let mut stop = shared.stop.clone();
    let mut flush = tokio::time::interval(ACK_FLUSH);
    let mut pacer = Pacer::new(args.consume_rate);
    let mut acks = Acks::new(args);
    let mut incoming: Option<Incoming> = None;
    let mut ack_frames = BytesMut::new();
    loop {
        if *stop.borrow() {
            break;
        }
        let mut tick = false;
        tokio::select! {
            biased;
            changed = stop.changed() => {
                if changed.is_err() {
                    break;
                }
                continue;
            }
            read = conn.reader.fill() => read?,
            _ = flush.tick() => tick = true,
        }
        while let Some(frame) = conn.reader.buffered()? {
            let delivered = match frame.kind {
                FRAME_METHOD => {
                    incoming = on_method(&frame.payload)?;
                    None
                }
                FRAME_HEADER => {
                    let header =
                        parse_content_header(&frame.payload).context("malformed content header")?;
                    match incoming.as_mut() {
                        Some(d) if header.body_size == 0 => {
                            d.size = 0;
                            incoming.take()
                        }
                        Some(d) => {
                            d.size = usize::try_from(header.body_size).context("body size")?;
                            None
                        }
                        None => bail!("content header without a delivery"),
                    }
                }
                FRAME_BODY => match incoming.as_mut() {
                    Some(d) => {
                        d.body.append(frame.payload);
                        if d.body.len() >= d.size {
                            incoming.take()
                        } else {
                            None
                        }
                    }
                    None => bail!("content body without a delivery"),
                },
                _ => None,
            };
            let Some(d) = delivered else { continue };
            out.tally
                .record(d.body.bytes(), size, d.redelivered, now_ns());
            out.last = Some(Instant::now());
            shared.consumed.fetch_add(1, Ordering::Relaxed);
            if let Some(tag) = acks.delivered(d.tag) {
                put_ack(&mut ack_frames, tag);
            }
            pacer.delivered().await;
        }
        // As the lapin consumer: what waits for `--ack-every` is acked every 50 ms.
        if let Some(tag) = if tick { acks.outstanding() } else { None } {
            put_ack(&mut ack_frames, tag);
        }
        if !ack_frames.is_empty() {
            conn.writer
                .write_all(&ack_frames.split().freeze())
                .await
                .context("basic.ack (write)")?;
        }
    }
    if let Some(tag) = acks.outstanding() {
        put_ack(&mut ack_frames, tag);
        conn.writer.write_all(&ack_frames.split().freeze()).await?;
    }
    Ok(())
}

/// Starts a delivery for basic.deliver; an error for the broker's close or a cancel.
fn on_method(payload: &Bytes) -> Result<Option<Incoming>> {
    let p = &payload[..];
    if p.len() >= 5 && p[0..4] == [0, 60, 0, 60] {
        // basic.deliver: consumer-tag (short string), delivery-tag, redelivered bit.
        let tag_end = 5 + usize::from(p[4]);
        if p.len() < tag_end + 9 {
            bail!("malformed basic.deliver");
        }
        let mut tag = [0u8; 8];
        tag.copy_from_slice(&p[tag_end..tag_end + 8]);
        return Ok(Some(Incoming {
            tag: u64::from_be_bytes(tag),
            redelivered: p[tag_end + 8] & 1 == 1,
            size: usize::MAX,
            body: IncomingBody::Empty,
        }));
    }
    let method = parse_method(p).map_err(|e| anyhow!("unreadable method: {e:?}"))?;
    closed_by_broker(&method)?;
    if let AMQPClass::Basic(basic::AMQPMethod::Cancel(_)) = method {
        bail!("consumer cancelled by the broker");
    }
    Ok(None)
}

/// Appends a basic.ack (multiple) frame for `tag`.
fn put_ack(buf: &mut BytesMut, tag: u64) {
    buf.put_u8(FRAME_METHOD);
    buf.put_u16(CHANNEL);
    buf.put_u32(13);
    buf.put_u16(60);
    buf.put_u16(80);
    buf.put_u64(tag);
    buf.put_u8(1);
    buf.put_u8(FRAME_END);
}

/// What `--idle-connections` reports once every connection is open.
#[derive(Serialize)]
pub(crate) struct IdleConnections {
    idle_connections: u32,
    opened_s: f64,
}

/// `--idle-connections N`: opens N connections with one channel each (64 handshakes at a
/// time), reports them with `report` once all are open, holds them until `stop`, then
/// closes them. For measuring what an idle connection costs the broker.
pub(crate) async fn hold_idle_connections(
    url: &str,
    count: u32,
    mut stop: watch::Receiver<bool>,
    report: impl FnOnce(&IdleConnections),
) -> Result<()> {
    let started = Instant::now();
    let mut connections: Vec<RawConnection> = futures::stream::iter(0..count)
        .map(|i| async move {
            RawConnection::open_with(url, &format!("loadgen-idle-{i}"), IDLE_READ).await
        })
        .buffer_unordered(64)
        .try_collect()
        .await?;
    report(&IdleConnections {
        idle_connections: count,
        opened_s: crate::round(started.elapsed().as_secs_f64(), 3),
    });
    while !*stop.borrow() {
        if stop.changed().await.is_err() {
            break;
        }
    }
    futures::stream::iter(connections.iter_mut())
        .for_each_concurrent(256, |conn| async move {
            close(&mut conn.writer, None).await;
        })
        .await;
    Ok(())
}

/// What `--declare-queues` reports.
#[derive(Serialize)]
pub(crate) struct DeclaredQueues {
    declared_queues: u32,
    declared_s: f64,
}

/// `--declare-queues N`: declares N empty queues `<prefix>-0` .. `<prefix>-{N-1}` on one
/// connection, 100 in flight at a time, and leaves them. For measuring what a queue costs.
pub(crate) async fn declare_queues(url: &str, prefix: &str, count: u32) -> Result<DeclaredQueues> {
    let started = Instant::now();
    let mut conn = RawConnection::open(url, "loadgen-declare").await?;
    let mut next = 0u32;
    while next < count {
        let batch = (count - next).min(100);
        for i in next..next + batch {
            conn.out.method(
                CHANNEL,
                AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                    queue: format!("{prefix}-{i}").into(),
                    passive: false,
                    durable: false,
                    exclusive: false,
                    auto_delete: false,
                    nowait: false,
                    arguments: FieldTable::default(),
                })),
            );
        }
        conn.flush().await?;
        for _ in 0..batch {
            match conn.reader.method().await? {
                AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_)) => {}
                other => bail!("queue.declare: unexpected reply {other:?}"),
            }
        }
        next += batch;
    }
    close(&mut conn.writer, Some(&mut conn.reader)).await;
    Ok(DeclaredQueues {
        declared_queues: count,
        declared_s: crate::round(started.elapsed().as_secs_f64(), 3),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The content header's property list in a prefix: after the method frame and the
    /// header frame's type, channel, size, class, weight and body size.
    fn properties(prefix: &[u8]) -> &[u8] {
        let method_len =
            7 + u32::from_be_bytes([prefix[3], prefix[4], prefix[5], prefix[6]]) as usize + 1;
        let header = &prefix[method_len..];
        &header[7 + 12..header.len() - 1]
    }

    #[test]
    fn the_prefix_carries_the_priority_set_per_message() {
        let plain = publish_prefix("q", true, 100, false).unwrap();
        assert_eq!(
            spillway_amqp::properties::priority(properties(&plain)),
            None
        );
        let mut prefix = publish_prefix("q", true, 100, true).unwrap();
        for priority in [0, 5, 9] {
            set_priority(&mut prefix, priority);
            assert_eq!(
                spillway_amqp::properties::priority(properties(&prefix)),
                Some(priority)
            );
        }
    }
}
