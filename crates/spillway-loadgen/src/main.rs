//! spillway-loadgen: an AMQP 0-9-1 load generator and end-to-end checker built on lapin.
//!
//! Producers publish numbered messages (producer id, sequence number and send timestamp in
//! a 24-byte body prefix, padded to `--size`) to the default exchange; consumers ack them,
//! check that every message arrived exactly once and in order per producer, and measure
//! end-to-end latency. One line of JSON is printed on stdout at the end; the exit code is
//! 0 only if nothing was lost, duplicated, reordered or corrupted and no connection failed.
//!
//! Logs go to stderr (RUST_LOG; default `warn,lapin=off`: lapin reports every socket closed
//! by the peer as an error, while real failures reach the summary anyway).
//!
//! Exit codes: 0 ok · 1 verification failed or a producer/consumer failed · 2 the run could
//! not start (bad arguments, connection refused, queue declare failed).

mod message;
mod verify;

use std::{
    collections::{BTreeMap, BTreeSet, HashSet, VecDeque},
    process::ExitCode,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use futures::StreamExt;
use lapin::{
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
        ConfirmSelectOptions, QueueDeclareOptions, QueuePurgeOptions,
    },
    types::FieldTable,
    BasicProperties, Confirmation, Connection, ConnectionProperties, Event, PublisherConfirm,
};
use serde::Serialize;
use tokio::{sync::watch, task::JoinHandle};

use crate::{
    message::{encode_into, now_ns, Header, HEADER_LEN},
    verify::{judge, Expected, Tally},
};

/// Messages per producer when neither --count nor --duration is given.
const DEFAULT_COUNT: u64 = 10_000;

#[derive(Parser, Debug, Clone)]
#[command(name = "spillway-loadgen", version, about)]
struct Args {
    /// AMQP URL of the broker.
    #[arg(
        long,
        env = "SPILLWAY_LOADGEN_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    url: String,
    /// Number of producers (one connection each).
    #[arg(long, default_value_t = 1)]
    producers: u32,
    /// Number of consumers (one connection each).
    #[arg(long, default_value_t = 1)]
    consumers: u32,
    /// Queue name (with --queues K > 1: NAME-0 .. NAME-{K-1}).
    #[arg(long, default_value = "loadgen")]
    queue: String,
    /// Number of queues; producer p publishes to queue p % K.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    queues: u32,
    /// Message body size in bytes (at least 24: the header).
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// Messages per producer (default 10000). With --consume-only: the backlog to expect
    /// (producers x count); without it the drain stops after --idle-timeout of silence.
    #[arg(long, conflicts_with = "duration")]
    count: Option<u64>,
    /// Publish for this many seconds instead of a fixed count.
    #[arg(long)]
    duration: Option<f64>,
    /// Persistent messages (delivery-mode 2) and a durable queue.
    #[arg(long)]
    persistent: bool,
    /// Use publisher confirms.
    #[arg(long)]
    confirm: bool,
    /// Outstanding confirms per producer before it waits for the oldest.
    #[arg(long, default_value_t = 256)]
    confirm_window: usize,
    /// Consumer prefetch (basic.qos prefetch-count).
    #[arg(long, default_value_t = 100)]
    prefetch: u16,
    /// Ack (multiple) every N deliveries (default: max(1, prefetch / 4)); pending acks
    /// are also flushed every 50 ms.
    #[arg(long)]
    ack_every: Option<u64>,
    /// Only publish (leave a backlog for a later --consume-only run).
    #[arg(long, conflicts_with = "consume_only")]
    no_consume: bool,
    /// Only consume and verify an existing backlog (implies --no-purge).
    #[arg(long)]
    consume_only: bool,
    /// Publish everything first, then start the consumers (backlog drain in one run).
    #[arg(long, conflicts_with_all = ["no_consume", "consume_only"])]
    phased: bool,
    /// Per-producer publish rate limit, messages per second.
    #[arg(long)]
    rate: Option<f64>,
    /// Seconds the drain phase (after publishing ends) may take before giving up.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Drain: with --consume-only and no --count, stop after this many seconds without a
    /// delivery; otherwise give up early (counting the rest lost) when nothing arrived for
    /// this long and every queue reports no ready message.
    #[arg(long, default_value_t = 2.0)]
    idle_timeout: f64,
    /// Do not purge the queues at start.
    #[arg(long)]
    no_purge: bool,
    /// Testing the checker: make producers skip, duplicate or swap sequence numbers.
    #[arg(long, value_enum, hide = true)]
    inject_fault: Option<Fault>,
    /// Testing the checker: inject a fault every N sequence numbers.
    #[arg(long, default_value_t = 1000, hide = true)]
    inject_every: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Fault {
    /// Never publish every N-th sequence number (simulates loss).
    Skip,
    /// Publish every N-th sequence number twice (simulates duplication).
    Dup,
    /// Publish every N-th sequence number after its successor (simulates reordering).
    Swap,
}

impl Args {
    fn queue_name(&self, q: u32) -> String {
        if self.queues == 1 {
            self.queue.clone()
        } else {
            format!("{}-{q}", self.queue)
        }
    }

    /// Queues consumer `c` subscribes to: every queue has at least one consumer.
    fn consumer_queues(&self, c: u32) -> Vec<String> {
        if self.consumers >= self.queues {
            vec![self.queue_name(c % self.queues)]
        } else {
            (0..self.queues)
                .filter(|q| q % self.consumers == c)
                .map(|q| self.queue_name(q))
                .collect()
        }
    }

    fn ack_every(&self) -> u64 {
        self.ack_every
            .unwrap_or(u64::from(self.prefetch) / 4)
            .max(1)
    }

    fn validate(&self) -> Result<()> {
        if self.size < HEADER_LEN {
            bail!("--size must be at least {HEADER_LEN} bytes (the message header)");
        }
        if !self.consume_only && self.producers == 0 {
            bail!("--producers must be at least 1");
        }
        if !self.no_consume && self.consumers == 0 {
            bail!("--consumers must be at least 1 (or use --no-consume)");
        }
        if self.rate.is_some_and(|r| r.is_nan() || r <= 0.0) {
            bail!("--rate must be positive");
        }
        if self.duration.is_some_and(|d| d.is_nan() || d <= 0.0) {
            bail!("--duration must be positive");
        }
        if self.inject_every == 0 {
            bail!("--inject-every must be at least 1");
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wall-clock time during which at least one of our connections was blocked by the broker.
#[derive(Default)]
struct BlockedClock {
    state: Mutex<BlockedState>,
}

#[derive(Default)]
struct BlockedState {
    blocked: HashSet<usize>,
    since: Option<Instant>,
    total: Duration,
    events: u64,
    reasons: BTreeSet<String>,
}

impl BlockedClock {
    fn block(&self, conn: usize, reason: String) {
        let mut st = lock(&self.state);
        if st.blocked.insert(conn) {
            st.events += 1;
            if st.blocked.len() == 1 {
                st.since = Some(Instant::now());
            }
        }
        st.reasons.insert(reason);
    }

    fn unblock(&self, conn: usize) {
        let mut st = lock(&self.state);
        if st.blocked.remove(&conn) && st.blocked.is_empty() {
            if let Some(since) = st.since.take() {
                st.total += since.elapsed();
            }
        }
    }

    fn summary(&self) -> (Duration, u64, Vec<String>) {
        let st = lock(&self.state);
        let ongoing = st.since.map(|s| s.elapsed()).unwrap_or_default();
        (
            st.total + ongoing,
            st.events,
            st.reasons.iter().cloned().collect(),
        )
    }
}

struct Shared {
    args: Args,
    blocked: BlockedClock,
    errors: Mutex<Vec<String>>,
    consumed: AtomicU64,
    next_conn: AtomicUsize,
    stop: watch::Receiver<bool>,
}

impl Shared {
    fn error(&self, e: String) {
        tracing::error!("{e}");
        lock(&self.errors).push(e);
    }
}

/// Opens a connection and starts a task that follows its blocked/unblocked/error events.
async fn connect(shared: &Arc<Shared>, name: &str) -> Result<(Connection, JoinHandle<()>)> {
    let props = ConnectionProperties::default().with_connection_name(name.to_string().into());
    let conn = Connection::connect(&shared.args.url, props)
        .await
        .with_context(|| format!("{name}: cannot connect to {}", shared.args.url))?;
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let mut events = conn.events_listener();
    let sh = shared.clone();
    let name = name.to_string();
    let watcher = tokio::spawn(async move {
        while let Some(ev) = events.next().await {
            match ev {
                Event::ConnectionBlocked(reason) => {
                    tracing::warn!(connection = %name, %reason, "connection blocked by the broker");
                    sh.blocked.block(id, reason);
                }
                Event::ConnectionUnblocked => {
                    tracing::info!(connection = %name, "connection unblocked");
                    sh.blocked.unblock(id);
                }
                Event::Error(e) => sh.error(format!("{name}: connection error: {e}")),
                _ => {}
            }
        }
    });
    Ok((conn, watcher))
}

async fn close(conn: Connection, watcher: JoinHandle<()>) {
    watcher.abort();
    if let Err(e) = conn.close(200, "loadgen done".into()).await {
        tracing::debug!("close: {e}");
    }
}

#[derive(Debug, Default)]
struct ProducerOutcome {
    id: u32,
    published: u64,
    /// Sequence numbers handed out: the consumers must see 0..next_seq.
    next_seq: u64,
    confirmed: u64,
    nacked: u64,
    returned: u64,
    started: Option<Instant>,
    finished: Option<Instant>,
}

struct Publisher {
    channel: lapin::Channel,
    queue: String,
    props: BasicProperties,
    buf: Vec<u8>,
    window: VecDeque<PublisherConfirm>,
}

impl Publisher {
    async fn publish(&mut self, args: &Args, out: &mut ProducerOutcome, seq: u64) -> Result<()> {
        encode_into(
            &mut self.buf,
            args.size,
            Header {
                producer: out.id,
                seq,
                sent_ns: now_ns(),
            },
        );
        let confirm = self
            .channel
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                BasicPublishOptions::default(),
                &self.buf,
                self.props.clone(),
            )
            .await
            .context("basic.publish")?;
        out.published += 1;
        if args.confirm {
            self.window.push_back(confirm);
            while self.window.len() >= args.confirm_window.max(1) {
                self.settle_one(out).await?;
            }
        } else {
            confirm.await.context("basic.publish")?;
        }
        Ok(())
    }

    async fn settle_one(&mut self, out: &mut ProducerOutcome) -> Result<()> {
        if let Some(c) = self.window.pop_front() {
            match c.await.context("waiting for a publisher confirm")? {
                Confirmation::Ack(ret) => {
                    out.confirmed += 1;
                    out.returned += u64::from(ret.is_some());
                }
                Confirmation::Nack(ret) => {
                    out.nacked += 1;
                    out.returned += u64::from(ret.is_some());
                }
                Confirmation::NotRequested => {}
            }
        }
        Ok(())
    }
}

async fn run_producer(shared: Arc<Shared>, id: u32, queue: String) -> ProducerOutcome {
    let mut out = ProducerOutcome {
        id,
        ..ProducerOutcome::default()
    };
    if let Err(e) = producer(&shared, &queue, &mut out).await {
        shared.error(format!("producer {id}: {e:#}"));
    }
    out.finished.get_or_insert_with(Instant::now);
    out
}

async fn producer(shared: &Arc<Shared>, queue: &str, out: &mut ProducerOutcome) -> Result<()> {
    let args = &shared.args;
    let (conn, watcher) = connect(shared, &format!("loadgen-producer-{}", out.id)).await?;
    let channel = conn.create_channel().await.context("channel.open")?;
    if args.confirm {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .context("confirm.select")?;
    }
    let mut p = Publisher {
        channel,
        queue: queue.to_string(),
        props: BasicProperties::default().with_delivery_mode(if args.persistent { 2 } else { 1 }),
        buf: Vec::with_capacity(args.size),
        window: VecDeque::with_capacity(args.confirm_window),
    };
    let count = match args.duration {
        Some(_) => u64::MAX,
        None => args.count.unwrap_or(DEFAULT_COUNT),
    };
    let started = Instant::now();
    out.started = Some(started);
    let deadline = args.duration.map(|d| started + Duration::from_secs_f64(d));
    let every = args.inject_every;
    while out.next_seq < count {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        if let Some(rate) = args.rate {
            let due = started + Duration::from_secs_f64(out.published as f64 / rate);
            if due > Instant::now() + Duration::from_millis(1) {
                tokio::time::sleep_until(due.into()).await;
            }
        }
        let seq = out.next_seq;
        let faulty = seq % every == every - 1;
        match args.inject_fault {
            Some(Fault::Skip) if faulty => {
                out.next_seq += 1;
            }
            Some(Fault::Dup) if faulty => {
                p.publish(args, out, seq).await?;
                p.publish(args, out, seq).await?;
                out.next_seq += 1;
            }
            Some(Fault::Swap) if faulty && seq + 1 < count => {
                p.publish(args, out, seq + 1).await?;
                p.publish(args, out, seq).await?;
                out.next_seq += 2;
            }
            _ => {
                p.publish(args, out, seq).await?;
                out.next_seq += 1;
            }
        }
    }
    while !p.window.is_empty() {
        p.settle_one(out).await?;
    }
    out.finished = Some(Instant::now());
    let _ = p.channel.close(200, "done".into()).await;
    close(conn, watcher).await;
    Ok(())
}

#[derive(Debug, Default)]
struct ConsumerOutcome {
    tally: Tally,
    subscribed: Option<Instant>,
    last: Option<Instant>,
}

async fn run_consumer(
    shared: Arc<Shared>,
    id: u32,
    queues: Vec<String>,
    ready: tokio::sync::mpsc::Sender<()>,
) -> ConsumerOutcome {
    let mut out = ConsumerOutcome::default();
    if let Err(e) = consumer(&shared, id, &queues, &mut out, ready).await {
        shared.error(format!("consumer {id}: {e:#}"));
    }
    out
}

async fn consumer(
    shared: &Arc<Shared>,
    id: u32,
    queues: &[String],
    out: &mut ConsumerOutcome,
    ready: tokio::sync::mpsc::Sender<()>,
) -> Result<()> {
    let args = &shared.args;
    let (conn, watcher) = connect(shared, &format!("loadgen-consumer-{id}")).await?;
    let channel = conn.create_channel().await.context("channel.open")?;
    channel
        .basic_qos(args.prefetch, BasicQosOptions::default())
        .await
        .context("basic.qos")?;
    let mut streams = Vec::with_capacity(queues.len());
    for q in queues {
        let c = channel
            .basic_consume(
                q.as_str().into(),
                format!("loadgen-c{id}-{q}").into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("basic.consume on {q}"))?;
        streams.push(c);
    }
    let mut deliveries = futures::stream::select_all(streams);
    out.subscribed = Some(Instant::now());
    let _ = ready.send(()).await;
    drop(ready);

    let ack_every = args.ack_every();
    let size = Some(args.size);
    let mut stop = shared.stop.clone();
    let mut flush = tokio::time::interval(Duration::from_millis(50));
    // Delivery tags are per channel; with several consumers on one channel the merged
    // stream may yield them slightly out of tag order, so always ack up to the highest.
    let mut max_tag = 0u64;
    let mut acked = 0u64;
    let mut pending = 0u64;
    let result: Result<()> = async {
        loop {
            if *stop.borrow() {
                return Ok(());
            }
            tokio::select! {
                biased;
                changed = stop.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                }
                next = deliveries.next() => match next {
                    None => bail!("consumer cancelled by the broker"),
                    Some(Err(e)) => return Err(e).context("delivery"),
                    Some(Ok(d)) => {
                        out.tally.record(&d.data, size, d.redelivered, now_ns());
                        out.last = Some(Instant::now());
                        max_tag = max_tag.max(d.delivery_tag);
                        pending += 1;
                        shared.consumed.fetch_add(1, Ordering::Relaxed);
                        if pending >= ack_every {
                            channel
                                .basic_ack(max_tag, BasicAckOptions { multiple: true })
                                .await
                                .context("basic.ack")?;
                            acked = max_tag;
                            pending = 0;
                        }
                    }
                },
                _ = flush.tick() => {
                    if max_tag > acked {
                        channel
                            .basic_ack(max_tag, BasicAckOptions { multiple: true })
                            .await
                            .context("basic.ack")?;
                        acked = max_tag;
                        pending = 0;
                    }
                }
            }
        }
    }
    .await;
    if result.is_ok() && max_tag > acked {
        channel
            .basic_ack(max_tag, BasicAckOptions { multiple: true })
            .await
            .context("basic.ack")?;
    }
    if result.is_ok() {
        let _ = channel.close(200, "done".into()).await;
    }
    close(conn, watcher).await;
    result
}

#[derive(Debug, Serialize, Default)]
struct Summary {
    published: u64,
    confirmed: u64,
    nacked: u64,
    returned: u64,
    consumed: u64,
    expected: u64,
    lost: u64,
    duplicated: u64,
    out_of_order: u64,
    corrupt: u64,
    unexpected: u64,
    redelivered: u64,
    publish_rate: f64,
    consume_rate: f64,
    /// Payload megabytes (10^6 bytes) per second: consumed if consuming, else published.
    mb_per_s: f64,
    latency_p50_ms: Option<f64>,
    latency_p99_ms: Option<f64>,
    latency_max_ms: Option<f64>,
    elapsed_s: f64,
    publish_elapsed_s: f64,
    consume_elapsed_s: f64,
    size: usize,
    persistent: bool,
    confirm: bool,
    producers: u32,
    consumers: u32,
    queues: u32,
    blocked_ms: u64,
    blocked_events: u64,
    blocked_reasons: Vec<String>,
    timed_out: bool,
    errors: Vec<String>,
    ok: bool,
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

fn rate(n: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        round(n as f64 / secs, 1)
    } else {
        0.0
    }
}

async fn spawn_consumers(shared: &Arc<Shared>) -> Vec<JoinHandle<ConsumerOutcome>> {
    let args = &shared.args;
    let (tx, mut rx) = tokio::sync::mpsc::channel(args.consumers.max(1) as usize);
    let handles: Vec<_> = (0..args.consumers)
        .map(|c| {
            tokio::spawn(run_consumer(
                shared.clone(),
                c,
                args.consumer_queues(c),
                tx.clone(),
            ))
        })
        .collect();
    drop(tx);
    // Every consumer either signals once subscribed or drops its sender on failure.
    while rx.recv().await.is_some() {}
    handles
}

/// True when every queue reports no ready message (passive declare); false on any error.
async fn queues_empty(admin: &lapin::Channel, args: &Args) -> bool {
    for q in 0..args.queues {
        let opts = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        match admin
            .queue_declare(
                args.queue_name(q).as_str().into(),
                opts,
                FieldTable::default(),
            )
            .await
        {
            Ok(queue) if queue.message_count() == 0 => {}
            _ => return false,
        }
    }
    true
}

async fn run(args: Args) -> Result<(Summary, bool)> {
    args.validate()?;
    let t0 = Instant::now();
    let (stop_tx, stop_rx) = watch::channel(false);
    let shared = Arc::new(Shared {
        args: args.clone(),
        blocked: BlockedClock::default(),
        errors: Mutex::new(Vec::new()),
        consumed: AtomicU64::new(0),
        next_conn: AtomicUsize::new(0),
        stop: stop_rx,
    });

    // Declare (and purge) the queues. The admin connection stays open: the drain phase uses
    // it to tell "slow" from "lost" (passive declares report the ready-message count).
    let (admin_conn, admin_watcher) = connect(&shared, "loadgen-admin").await?;
    let admin = admin_conn.create_channel().await.context("channel.open")?;
    {
        let ch = &admin;
        for q in 0..args.queues {
            let name = args.queue_name(q);
            let opts = QueueDeclareOptions {
                durable: args.persistent,
                ..QueueDeclareOptions::default()
            };
            ch.queue_declare(name.as_str().into(), opts, FieldTable::default())
                .await
                .with_context(|| {
                    format!(
                        "queue.declare {name} (durable={}): an existing queue with other \
                         properties needs deleting first",
                        args.persistent
                    )
                })?;
            if !args.no_purge && !args.consume_only {
                ch.queue_purge(name.as_str().into(), QueuePurgeOptions::default())
                    .await
                    .with_context(|| format!("queue.purge {name}"))?;
            }
        }
    }

    let consuming = !args.no_consume;
    let publishing = !args.consume_only;
    let mut consumers = Vec::new();
    if consuming && !args.phased {
        consumers = spawn_consumers(&shared).await;
    }

    let mut producers = Vec::new();
    if publishing {
        let handles: Vec<_> = (0..args.producers)
            .map(|p| {
                tokio::spawn(run_producer(
                    shared.clone(),
                    p,
                    args.queue_name(p % args.queues),
                ))
            })
            .collect();
        for h in handles {
            producers.push(h.await.context("producer task panicked")?);
        }
    }

    if consuming && args.phased {
        consumers = spawn_consumers(&shared).await;
    }

    let mut timed_out = false;
    let mut tallies = Vec::new();
    let mut consume_start: Option<Instant> = None;
    let mut consume_end: Option<Instant> = None;
    if consuming {
        let expected_total = if publishing {
            Some(producers.iter().map(|p| p.next_seq).sum::<u64>())
        } else {
            args.count.map(|c| c * u64::from(args.producers))
        };
        let drain_start = Instant::now();
        let timeout = Duration::from_secs_f64(args.timeout.max(0.0));
        let idle = Duration::from_secs_f64(args.idle_timeout.max(0.0));
        let mut last_seen = (shared.consumed.load(Ordering::Relaxed), Instant::now());
        let mut last_probe = Instant::now();
        loop {
            let consumed = shared.consumed.load(Ordering::Relaxed);
            if consumed != last_seen.0 {
                last_seen = (consumed, Instant::now());
            }
            let idle_for = last_seen.1.elapsed();
            match expected_total {
                Some(e) if consumed >= e => break,
                Some(_) => {
                    // Nothing arrived for a while and the queues hold nothing ready: what is
                    // missing will not come (lost); no need to sit out the whole --timeout.
                    if idle_for >= idle && last_probe.elapsed() >= Duration::from_millis(500) {
                        last_probe = Instant::now();
                        if queues_empty(&admin, &args).await {
                            break;
                        }
                    }
                }
                None => {
                    if idle_for >= idle {
                        break;
                    }
                }
            }
            if drain_start.elapsed() >= timeout {
                timed_out = true;
                break;
            }
            if consumers.iter().all(|h| h.is_finished()) {
                break; // every consumer failed
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = stop_tx.send(true);
        for h in consumers {
            let o = h.await.context("consumer task panicked")?;
            consume_start = match (consume_start, o.subscribed) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            consume_end = consume_end.max(o.last);
            tallies.push(o.tally);
        }
    }

    let expected = if publishing {
        Expected::Known(producers.iter().map(|p| (p.id, p.next_seq)).collect())
    } else if let Some(c) = args.count {
        Expected::Known(
            (0..args.producers)
                .map(|p| (p, c))
                .collect::<BTreeMap<_, _>>(),
        )
    } else {
        Expected::Inferred
    };
    let _ = admin.close(200, "done".into()).await;
    close(admin_conn, admin_watcher).await;
    let verdict = if consuming {
        judge(&tallies, &expected)
    } else {
        verify::Verdict::default()
    };

    let pub_start = producers.iter().filter_map(|p| p.started).min();
    let pub_end = producers.iter().filter_map(|p| p.finished).max();
    let publish_elapsed = match (pub_start, pub_end) {
        (Some(a), Some(b)) => b.saturating_duration_since(a).as_secs_f64(),
        _ => 0.0,
    };
    let consume_elapsed = match (consume_start, consume_end) {
        (Some(a), Some(b)) => b.saturating_duration_since(a).as_secs_f64(),
        _ => 0.0,
    };
    let published: u64 = producers.iter().map(|p| p.published).sum();
    let (blocked, blocked_events, blocked_reasons) = shared.blocked.summary();
    let errors = lock(&shared.errors).clone();
    let ms = |us: Option<f64>| us.map(|u| round(u / 1000.0, 3));
    let (bytes, secs) = if consuming {
        (verdict.bytes, consume_elapsed)
    } else {
        (published * args.size as u64, publish_elapsed)
    };
    let mb_per_s = if secs > 0.0 {
        bytes as f64 / secs / 1e6
    } else {
        0.0
    };
    let nacked: u64 = producers.iter().map(|p| p.nacked).sum();
    let mut summary = Summary {
        published,
        confirmed: producers.iter().map(|p| p.confirmed).sum(),
        nacked,
        returned: producers.iter().map(|p| p.returned).sum(),
        consumed: verdict.consumed,
        expected: if consuming { verdict.expected } else { 0 },
        lost: verdict.lost,
        duplicated: verdict.duplicated,
        out_of_order: verdict.out_of_order,
        corrupt: verdict.corrupt,
        unexpected: verdict.unexpected,
        redelivered: verdict.redelivered,
        publish_rate: rate(published, publish_elapsed),
        consume_rate: rate(verdict.consumed, consume_elapsed),
        mb_per_s: round(mb_per_s, 3),
        latency_p50_ms: ms(verdict.latency_us.quantile(0.50)),
        latency_p99_ms: ms(verdict.latency_us.quantile(0.99)),
        latency_max_ms: ms(
            (verdict.latency_us.count() > 0).then(|| verdict.latency_us.max() as f64)
        ),
        elapsed_s: round(t0.elapsed().as_secs_f64(), 3),
        publish_elapsed_s: round(publish_elapsed, 3),
        consume_elapsed_s: round(consume_elapsed, 3),
        size: args.size,
        persistent: args.persistent,
        confirm: args.confirm,
        producers: if publishing { args.producers } else { 0 },
        consumers: if consuming { args.consumers } else { 0 },
        queues: args.queues,
        blocked_ms: blocked.as_millis() as u64,
        blocked_events,
        blocked_reasons,
        timed_out,
        errors,
        ok: false,
    };
    summary.ok = verdict.ok() && summary.errors.is_empty() && nacked == 0;
    let ok = summary.ok;
    Ok((summary, ok))
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,lapin=off")),
        )
        .init();
    let args = Args::parse();
    let size = args.size;
    let persistent = args.persistent;
    match run(args).await {
        Ok((summary, ok)) => {
            println!(
                "{}",
                serde_json::to_string(&summary)
                    .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
            );
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            let msg = format!("{e:#}");
            eprintln!("spillway-loadgen: {msg}");
            let summary = Summary {
                size,
                persistent,
                errors: vec![msg],
                ..Summary::default()
            };
            println!(
                "{}",
                serde_json::to_string(&summary)
                    .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
            );
            ExitCode::from(2)
        }
    }
}
