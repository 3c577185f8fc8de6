//! spillway-loadgen: an AMQP 0-9-1 (and 1.0) load generator and end-to-end checker built on
//! lapin, with a lean 0-9-1 client of its own (`--client raw`) and an AMQP 1.0 client on
//! `fe2o3-amqp` (`--client amqp1`).
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
//! Fault mode (`--reconnect`): producers and consumers that lose their connection reconnect
//! with backoff, redeclare and resume. Messages whose confirm never came are "in doubt";
//! redeliveries of unacked messages are legitimate, so duplicates and reordering are reported
//! but only the loss of a *confirmed* message (or corruption) fails the run.
//!
//! `--plan FILE` runs a JSON plan: steps one after another, each step a set of runs (argument
//! lists, as on this command line) started together; one JSON line sums up every run.
//! SIGINT/SIGTERM stops publishing: the consumers drain and the run is judged as usual.
//!
//! Exit codes: 0 ok · 1 verification failed or a producer/consumer failed · 2 the run could
//! not start (bad arguments, connection refused, queue declare failed).

mod amqp1;
mod message;
mod raw;
mod verify;

use std::{
    collections::{BTreeMap, BTreeSet, HashSet, VecDeque},
    path::PathBuf,
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
    types::{AMQPValue, FieldTable},
    BasicProperties, Confirmation, Connection, ConnectionProperties, Event, PublisherConfirm,
};
use serde::{Deserialize, Serialize};
use tokio::{sync::watch, task::JoinHandle};

use crate::{
    message::{encode_into, now_ns, BodyKind, Header, HEADER_LEN},
    verify::{confirmed_lost, judge, merged_seen, BitSet, Expected, Tally},
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
    /// AMQP URL the consumers use (default: --url), e.g. a second gateway.
    #[arg(long, env = "SPILLWAY_LOADGEN_CONSUMER_URL")]
    consumer_url: Option<String>,
    /// PEM file of the CA that signed the broker's AMQPS certificate: trusted (instead
    /// of the public roots) for amqps:// URLs. The lapin client only.
    #[arg(long, env = "SPILLWAY_LOADGEN_TLS_CA", value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// A name for this run, echoed in the summary.
    #[arg(long)]
    name: Option<String>,
    /// Run a JSON plan of steps (see the crate docs); --url and --consumer-url apply to
    /// every run of the plan unless a run sets its own.
    #[arg(long)]
    plan: Option<PathBuf>,
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
    /// Queue declare argument KEY=VALUE (repeatable): integers are sent as signed 64-bit,
    /// true/false as booleans, anything else as a string. E.g. x-qpid-capacity=1048576.
    #[arg(long = "queue-arg", value_name = "KEY=VALUE")]
    queue_args: Vec<String>,
    /// Publish with priorities 0..N (spread over the sequence; 0 = no priority property)
    /// and declare the queues with x-max-priority N-1. Order is then checked per priority,
    /// and `priority_inversions` counts deliveries of a higher priority than the one before.
    #[arg(long, default_value_t = 0)]
    priorities: u8,
    /// Message body size in bytes (at least 24: the header).
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// What fills a body past its header: one byte repeated (`fill`), text that compresses
    /// several times (`compressible`), or noise that does not (`random`).
    #[arg(long = "body", value_enum, default_value_t = BodyKind::Fill)]
    body: BodyKind,
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
    /// Declare durable queues even for transient messages (--persistent implies it).
    #[arg(long)]
    durable: bool,
    /// Use publisher confirms.
    #[arg(long)]
    confirm: bool,
    /// Outstanding confirms per producer before it waits for the oldest.
    #[arg(long, default_value_t = 256)]
    confirm_window: usize,
    /// Transactions: tx.select, then tx.commit after every N publishes (and after the
    /// last), waiting for commit-ok; committed messages count as confirmed.
    #[arg(long, value_name = "N", conflicts_with = "confirm",
          value_parser = clap::value_parser!(u64).range(1..))]
    tx_every: Option<u64>,
    /// The AMQP client for producers and consumers: lapin, or `raw`, a lean client on the
    /// gateway's frame codec that batches writes (for benchmarks: it costs far less CPU per
    /// message than lapin; no --reconnect or fault injection), or `amqp1`: AMQP 1.0 links
    /// through fe2o3-amqp on the same URL (see src/amqp1.rs for what each option becomes).
    /// Queues are declared and purged through lapin (0-9-1) either way.
    #[arg(long, value_enum, default_value_t = Client::Lapin)]
    client: Client,
    /// `--client amqp1`: link addresses are this prefix followed by the queue name.
    /// `/amq/queue/` (an existing queue) is read by RabbitMQ 3's rabbitmq_amqp1_0 plugin
    /// and by Spillway; `/queues/` is RabbitMQ 4's form.
    #[arg(long, default_value = "/amq/queue/")]
    amqp1_prefix: String,
    /// Open this many idle connections (one channel each, raw client), print one JSON line
    /// when all are open, hold them until SIGTERM/SIGINT or --duration, then close them.
    /// Nothing is published or consumed.
    #[arg(long, conflicts_with_all = ["plan", "declare_queues"])]
    idle_connections: Option<u32>,
    /// Declare this many empty queues (--queue NAME gives NAME-0 ..), print one JSON line
    /// and exit, leaving them. Nothing is published or consumed.
    #[arg(long, conflicts_with = "plan")]
    declare_queues: Option<u32>,
    /// Consumers take deliveries without acknowledging them (basic.consume no-ack).
    #[arg(long)]
    auto_ack: bool,
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
    /// Per-consumer delivery rate limit, messages per second (a slow consumer).
    #[arg(long)]
    consume_rate: Option<f64>,
    /// Fault mode: reconnect (with backoff) after a lost connection, redeclare, resume;
    /// fail only when a confirmed message is never consumed.
    #[arg(long)]
    reconnect: bool,
    /// Fault mode: give up after failing to reconnect for this many seconds.
    #[arg(long, default_value_t = 180.0)]
    reconnect_timeout: f64,
    /// Print a progress line on stderr every this many seconds.
    #[arg(long)]
    progress: Option<f64>,
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
enum Client {
    Lapin,
    Raw,
    /// AMQP 1.0 through fe2o3-amqp.
    Amqp1,
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

    /// Queues are declared durable with --durable or --persistent.
    fn durable_queues(&self) -> bool {
        self.durable || self.persistent
    }

    fn consumer_url(&self) -> &str {
        self.consumer_url.as_deref().unwrap_or(&self.url)
    }

    /// The --queue-arg list as a field table.
    fn declare_arguments(&self) -> Result<FieldTable> {
        let mut table = FieldTable::default();
        if self.priorities > 0 {
            table.insert(
                "x-max-priority".into(),
                AMQPValue::LongLongInt(i64::from(self.priorities) - 1),
            );
        }
        for arg in &self.queue_args {
            let Some((key, value)) = arg.split_once('=') else {
                bail!("--queue-arg {arg:?}: expected KEY=VALUE");
            };
            if key.is_empty() || key.len() > 255 {
                bail!("--queue-arg {arg:?}: the key must be 1 to 255 bytes");
            }
            let value = if let Ok(n) = value.parse::<i64>() {
                AMQPValue::LongLongInt(n)
            } else if let Ok(b) = value.parse::<bool>() {
                AMQPValue::Boolean(b)
            } else {
                AMQPValue::LongString(value.to_string().into())
            };
            table.insert(key.to_string().into(), value);
        }
        Ok(table)
    }

    fn reconnect_limit(&self) -> Duration {
        Duration::from_secs_f64(self.reconnect_timeout.max(0.0))
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
        if self.consume_rate.is_some_and(|r| r.is_nan() || r <= 0.0) {
            bail!("--consume-rate must be positive");
        }
        self.declare_arguments()?;
        if self.duration.is_some_and(|d| d.is_nan() || d <= 0.0) {
            bail!("--duration must be positive");
        }
        if self.inject_every == 0 {
            bail!("--inject-every must be at least 1");
        }
        if self.client == Client::Raw && (self.reconnect || self.inject_fault.is_some()) {
            bail!("--client raw supports neither --reconnect nor --inject-fault");
        }
        if self.client == Client::Amqp1 {
            if self.reconnect || self.tx_every.is_some() {
                bail!("--client amqp1 supports neither --reconnect nor --tx-every");
            }
            if !self.no_consume && self.consumers < self.queues {
                bail!("--client amqp1: one queue per consumer (--consumers at least --queues)");
            }
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
    /// Connection losses survived in fault mode (first ones kept for the summary).
    reconnect_events: Mutex<Vec<String>>,
    reconnects: AtomicU64,
    published: AtomicU64,
    confirmed: AtomicU64,
    consumed: AtomicU64,
    next_conn: AtomicUsize,
    stop: watch::Receiver<bool>,
    /// Set by SIGINT/SIGTERM: producers stop publishing, the run drains and is judged.
    stop_publishing: watch::Receiver<bool>,
}

/// Reconnect events kept in the summary; the count goes on.
const MAX_EVENTS: usize = 50;

impl Shared {
    fn error(&self, e: String) {
        tracing::error!("{e}");
        lock(&self.errors).push(e);
    }

    /// A connection-level failure: fatal unless in fault mode.
    fn connection_error(&self, e: String) {
        if self.args.reconnect {
            tracing::warn!("{e}");
        } else {
            self.error(e);
        }
    }

    fn reconnecting(&self, e: String) {
        tracing::warn!("reconnecting: {e}");
        self.reconnects.fetch_add(1, Ordering::Relaxed);
        let mut events = lock(&self.reconnect_events);
        if events.len() < MAX_EVENTS {
            events.push(e);
        }
    }

    fn publishing_stopped(&self) -> bool {
        *self.stop_publishing.borrow()
    }
}

/// Exponential backoff between reconnect attempts (100 ms doubling to 2 s), giving up after
/// `--reconnect-timeout` of uninterrupted failure.
struct Retry {
    delay: Duration,
    failing_since: Option<Instant>,
}

impl Retry {
    fn new() -> Self {
        Self {
            delay: Duration::from_millis(100),
            failing_since: None,
        }
    }

    fn connected(&mut self) {
        self.delay = Duration::from_millis(100);
        self.failing_since = None;
    }

    async fn wait(&mut self, limit: Duration) -> Result<()> {
        let since = *self.failing_since.get_or_insert_with(Instant::now);
        if since.elapsed() > limit {
            bail!("gave up reconnecting after {:.0} s", limit.as_secs_f64());
        }
        tokio::time::sleep(self.delay).await;
        self.delay = (self.delay * 2).min(Duration::from_secs(2));
        Ok(())
    }
}

/// How often a consumer acks what waits for `--ack-every`.
const ACK_FLUSH: Duration = Duration::from_millis(50);

/// A consumer's acks: one basic.ack (multiple) per `--ack-every` deliveries, and what is
/// left every [`ACK_FLUSH`]. None with `--auto-ack`.
struct Acks {
    auto_ack: bool,
    every: u64,
    /// Delivery tags are per channel; with several consumers on one channel deliveries
    /// may come slightly out of tag order, so acks always go up to the highest.
    max_tag: u64,
    acked: u64,
    pending: u64,
}

impl Acks {
    fn new(args: &Args) -> Self {
        Self {
            auto_ack: args.auto_ack,
            every: args.ack_every(),
            max_tag: 0,
            acked: 0,
            pending: 0,
        }
    }

    /// Records a delivery; the tag to ack (multiple) when one is due.
    fn delivered(&mut self, tag: u64) -> Option<u64> {
        self.max_tag = self.max_tag.max(tag);
        self.pending += 1;
        if self.pending < self.every {
            return None;
        }
        self.outstanding()
    }

    /// The tag to ack (multiple) for everything delivered and not acked yet.
    fn outstanding(&mut self) -> Option<u64> {
        if self.auto_ack || self.max_tag <= self.acked {
            return None;
        }
        self.acked = self.max_tag;
        self.pending = 0;
        Some(self.max_tag)
    }
}

/// Holds a consumer to `--consume-rate` (a slow consumer), if set.
struct Pacer {
    rate: Option<f64>,
    from: Instant,
    delivered: u64,
}

impl Pacer {
    fn new(rate: Option<f64>) -> Self {
        Self {
            rate,
            from: Instant::now(),
            delivered: 0,
        }
    }

    /// Counts one delivery and sleeps until the rate allows the next.
    async fn delivered(&mut self) {
        let Some(rate) = self.rate else { return };
        self.delivered += 1;
        let due = self.from + Duration::from_secs_f64(self.delivered as f64 / rate);
        if due > Instant::now() + Duration::from_millis(1) {
            tokio::time::sleep_until(due.into()).await;
        }
    }
}

/// Opens a connection and starts a task that follows its blocked/unblocked/error events.
/// How long opening a connection, or a channel with its declares, may take
/// before the attempt counts as failed (and, with --reconnect, is made
/// again). lapin has no such bound of its own; a broker answers in
/// milliseconds, and within its own handshake timeout (10 s) when it cannot.
const SETUP_LIMIT: Duration = Duration::from_secs(30);

/// `setup`, or an error naming `what` once it took longer than [`SETUP_LIMIT`].
async fn within<T>(what: &str, setup: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    match tokio::time::timeout(SETUP_LIMIT, setup).await {
        Ok(result) => result,
        Err(_) => bail!("{what}: no answer within {} s", SETUP_LIMIT.as_secs()),
    }
}

async fn connect(
    shared: &Arc<Shared>,
    name: &str,
    url: &str,
) -> Result<(Connection, JoinHandle<()>)> {
    let props = ConnectionProperties::default().with_connection_name(name.to_string().into());
    let opening = async {
        if url.starts_with("amqps://") {
            let tls = tls_config(shared.args.tls_ca.as_deref())?;
            let runtime = lapin::runtime::default_runtime().context("lapin's runtime")?;
            Ok(Connection::connect_with_config(url, props, tls, runtime).await?)
        } else {
            Ok(Connection::connect(url, props).await?)
        }
    };
    let conn = within(&format!("{name}: connecting to {url}"), opening)
        .await
        .with_context(|| format!("{name}: cannot connect to {url}"))?;
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
                Event::Error(e) => {
                    // A dead connection is no longer blocked.
                    sh.blocked.unblock(id);
                    sh.connection_error(format!("{name}: connection error: {e}"));
                }
                _ => {}
            }
        }
        sh.blocked.unblock(id);
    });
    Ok((conn, watcher))
}

/// lapin's TLS settings for amqps:// URLs: trust the CA in `ca_file` when given (the
/// public roots otherwise); no client certificate.
fn tls_config(ca_file: Option<&std::path::Path>) -> Result<lapin::tcp::OwnedTLSConfig> {
    let cert_chain = match ca_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("--tls-ca: cannot read {}", path.display()))?,
        ),
        None => None,
    };
    Ok(lapin::tcp::OwnedTLSConfig {
        identity: None,
        cert_chain,
    })
}

async fn close(conn: Connection, watcher: JoinHandle<()>) {
    watcher.abort();
    // Bounded: a connection the broker already closed must not hold us.
    match tokio::time::timeout(
        Duration::from_secs(5),
        conn.close(200, "loadgen done".into()),
    )
    .await
    {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!("close: {e}"),
        Err(_) => tracing::debug!("close: no close-ok within 5 s"),
    }
}

/// Declares one of the run's queues (durable with --durable or --persistent, with the
/// --queue-arg list).
async fn declare_queue(channel: &lapin::Channel, args: &Args, name: &str) -> Result<()> {
    let opts = QueueDeclareOptions {
        durable: args.durable_queues(),
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(name.into(), opts, args.declare_arguments()?)
        .await
        .with_context(|| {
            format!(
                "queue.declare {name} (durable={}): an existing queue with other \
                 properties needs deleting first",
                args.durable_queues()
            )
        })?;
    Ok(())
}

#[derive(Debug, Default)]
struct ProducerOutcome {
    id: u32,
    published: u64,
    /// Sequence numbers handed out: the consumers must see 0..next_seq.
    next_seq: u64,
    confirmed: u64,
    /// Sequence numbers the broker confirmed (ack): these must all be consumed.
    confirmed_seqs: BitSet,
    nacked: u64,
    returned: u64,
    /// Published, but the connection died before the confirm came.
    in_doubt: u64,
    started: Option<Instant>,
    finished: Option<Instant>,
}

impl ProducerOutcome {
    /// The broker confirmed message `seq` (an ack, a commit, `accepted`).
    fn count_confirmed(&mut self, shared: &Shared, seq: u64) {
        self.confirmed += 1;
        self.confirmed_seqs.insert(seq);
        shared.confirmed.fetch_add(1, Ordering::Relaxed);
    }
}

struct Publisher {
    channel: lapin::Channel,
    queue: String,
    props: BasicProperties,
    buf: Vec<u8>,
    window: VecDeque<(u64, PublisherConfirm)>,
    /// --tx-every: sequence numbers published since the last commit.
    uncommitted: Vec<u64>,
}

impl Publisher {
    async fn publish(
        &mut self,
        shared: &Shared,
        out: &mut ProducerOutcome,
        seq: u64,
    ) -> Result<()> {
        let args = &shared.args;
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
                if args.priorities > 0 {
                    self.props
                        .clone()
                        .with_priority(message::priority_of(seq, args.priorities))
                } else {
                    self.props.clone()
                },
            )
            .await
            .context("basic.publish")?;
        out.published += 1;
        shared.published.fetch_add(1, Ordering::Relaxed);
        if args.confirm {
            self.window.push_back((seq, confirm));
            while self.window.len() >= args.confirm_window.max(1) {
                self.settle_one(shared, out).await?;
            }
        } else {
            confirm.await.context("basic.publish")?;
        }
        if let Some(every) = args.tx_every {
            self.uncommitted.push(seq);
            if self.uncommitted.len() as u64 >= every {
                self.commit(shared, out).await?;
            }
        }
        Ok(())
    }

    /// tx.commit; once it is answered, what it held counts as confirmed.
    async fn commit(&mut self, shared: &Shared, out: &mut ProducerOutcome) -> Result<()> {
        if self.uncommitted.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.channel.tx_commit().await {
            out.in_doubt += self.uncommitted.len() as u64;
            self.uncommitted.clear();
            return Err(e).context("tx.commit");
        }
        for seq in self.uncommitted.drain(..) {
            out.count_confirmed(shared, seq);
        }
        Ok(())
    }

    async fn settle_one(&mut self, shared: &Shared, out: &mut ProducerOutcome) -> Result<()> {
        if let Some((seq, c)) = self.window.pop_front() {
            // A broker that neither confirms nor closes the channel must not
            // hang the run: past --timeout it is an error of the run.
            let limit = Duration::from_secs_f64(shared.args.timeout.max(1.0));
            let confirmation = match tokio::time::timeout(limit, c).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    out.in_doubt += 1;
                    return Err(e).context("waiting for a publisher confirm");
                }
                Err(_) => {
                    out.in_doubt += 1;
                    let e = format!(
                        "producer {}: no confirm for message {seq} within {:.0} s, and the \
                         channel is still open",
                        out.id,
                        limit.as_secs_f64()
                    );
                    shared.error(e.clone());
                    bail!(e);
                }
            };
            match confirmation {
                Confirmation::Ack(ret) => {
                    out.count_confirmed(shared, seq);
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

/// Where a producer stops: a count, or a deadline.
struct Budget {
    count: u64,
    deadline: Option<Instant>,
    started: Instant,
}

impl Budget {
    /// Whether the producer is done: every message handed out, the deadline passed, or
    /// publishing stopped.
    fn spent(&self, shared: &Shared, out: &ProducerOutcome) -> bool {
        out.next_seq >= self.count
            || self.deadline.is_some_and(|d| Instant::now() >= d)
            || shared.publishing_stopped()
    }

    /// When the next message is due under `--rate`, if that is later than now.
    fn not_before(&self, args: &Args, out: &ProducerOutcome) -> Option<Instant> {
        let rate = args.rate?;
        let due = self.started + Duration::from_secs_f64(out.published as f64 / rate);
        (due > Instant::now() + Duration::from_millis(1)).then_some(due)
    }

    /// Waits until the next message is due under `--rate`.
    async fn pace(&self, args: &Args, out: &ProducerOutcome) {
        if let Some(due) = self.not_before(args, out) {
            tokio::time::sleep_until(due.into()).await;
        }
    }

    /// The sequence numbers to send next, in order: the next one, or at each
    /// `--inject-every`th with `--inject-fault`, none (skip), it twice (dup), or it and the
    /// one after swapped. `out.next_seq` moves past them before they are sent: if the
    /// connection dies during the sends, they are in doubt, not forgotten.
    fn next_seqs(
        &self,
        args: &Args,
        out: &mut ProducerOutcome,
    ) -> std::iter::Take<std::array::IntoIter<u64, 2>> {
        let seq = out.next_seq;
        let every = args.inject_every;
        let faulty = seq % every == every - 1;
        let (seqs, sends, advance) = match args.inject_fault {
            Some(Fault::Skip) if faulty => ([seq, seq], 0, 1),
            Some(Fault::Dup) if faulty => ([seq, seq], 2, 1),
            Some(Fault::Swap) if faulty && seq + 1 < self.count => ([seq + 1, seq], 2, 2),
            _ => ([seq, seq], 1, 1),
        };
        out.next_seq += advance;
        seqs.into_iter().take(sends)
    }
}

async fn producer(shared: &Arc<Shared>, queue: &str, out: &mut ProducerOutcome) -> Result<()> {
    let args = &shared.args;
    let started = Instant::now();
    out.started = Some(started);
    let budget = Budget {
        count: match args.duration {
            Some(_) => u64::MAX,
            None => args.count.unwrap_or(DEFAULT_COUNT),
        },
        deadline: args.duration.map(|d| started + Duration::from_secs_f64(d)),
        started,
    };
    let mut retry = Retry::new();
    loop {
        match producer_session(shared, queue, out, &budget, &mut retry).await {
            Ok(()) => return Ok(()),
            Err(e) if args.reconnect => {
                if budget.spent(shared, out) {
                    // Only the confirms of the last window were missing: they stay in doubt.
                    return Ok(());
                }
                shared.reconnecting(format!("producer {}: {e:#}", out.id));
                retry.wait(args.reconnect_limit()).await?;
            }
            Err(e) => return Err(e),
        }
    }
}

/// One connection's worth of publishing; in fault mode the caller reconnects after an error.
async fn producer_session(
    shared: &Arc<Shared>,
    queue: &str,
    out: &mut ProducerOutcome,
    budget: &Budget,
    retry: &mut Retry,
) -> Result<()> {
    let args = &shared.args;
    match args.client {
        Client::Raw => return raw::producer_session(shared, queue, out, budget).await,
        Client::Amqp1 => return amqp1::producer_session(shared, queue, out, budget).await,
        Client::Lapin => {}
    }
    let (conn, watcher) =
        connect(shared, &format!("loadgen-producer-{}", out.id), &args.url).await?;
    let mut p = None;
    let result: Result<()> = async {
        let setup = async {
            let channel = conn.create_channel().await.context("channel.open")?;
            if args.reconnect {
                // The broker may have restarted: make sure the queue is there.
                declare_queue(&channel, args, queue).await?;
            }
            if args.confirm {
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
                    .context("confirm.select")?;
            }
            if args.tx_every.is_some() {
                channel.tx_select().await.context("tx.select")?;
            }
            Ok(channel)
        };
        let channel = within("opening the producer's channel", setup).await?;
        retry.connected();
        let p = p.insert(Publisher {
            channel,
            queue: queue.to_string(),
            props: BasicProperties::default().with_delivery_mode(if args.persistent {
                2
            } else {
                1
            }),
            buf: Vec::with_capacity(args.size),
            window: VecDeque::with_capacity(args.confirm_window),
            uncommitted: Vec::new(),
        });
        publish_loop(shared, p, out, budget).await?;
        p.commit(shared, out).await?;
        while !p.window.is_empty() {
            p.settle_one(shared, out).await?;
        }
        Ok(())
    }
    .await;
    match (&result, p) {
        (Ok(()), Some(p)) => {
            out.finished = Some(Instant::now());
            let _ = p.channel.close(200, "done".into()).await;
        }
        (Err(_), Some(p)) => out.in_doubt += p.window.len() as u64,
        _ => {}
    }
    close(conn, watcher).await;
    result
}

async fn publish_loop(
    shared: &Arc<Shared>,
    p: &mut Publisher,
    out: &mut ProducerOutcome,
    budget: &Budget,
) -> Result<()> {
    let args = &shared.args;
    while !budget.spent(shared, out) {
        budget.pace(args, out).await;
        for seq in budget.next_seqs(args, out) {
            p.publish(shared, out, seq).await?;
        }
    }
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
    out.tally.priorities = shared.args.priorities;
    let mut ready = Some(ready);
    let mut retry = Retry::new();
    loop {
        match consumer_session(&shared, id, &queues, &mut out, &mut ready, &mut retry).await {
            Ok(()) => break,
            Err(e) if shared.args.reconnect && !*shared.stop.borrow() => {
                shared.reconnecting(format!("consumer {id}: {e:#}"));
                if let Err(e) = retry.wait(shared.args.reconnect_limit()).await {
                    shared.error(format!("consumer {id}: {e:#}"));
                    break;
                }
            }
            Err(e) => {
                shared.error(format!("consumer {id}: {e:#}"));
                break;
            }
        }
    }
    out
}

async fn consumer_session(
    shared: &Arc<Shared>,
    id: u32,
    queues: &[String],
    out: &mut ConsumerOutcome,
    ready: &mut Option<tokio::sync::mpsc::Sender<()>>,
    retry: &mut Retry,
) -> Result<()> {
    let args = &shared.args;
    match args.client {
        Client::Raw => return raw::consumer_session(shared, id, queues, out, ready).await,
        Client::Amqp1 => return amqp1::consumer_session(shared, id, queues, out, ready).await,
        Client::Lapin => {}
    }
    let (conn, watcher) = connect(
        shared,
        &format!("loadgen-consumer-{id}"),
        args.consumer_url(),
    )
    .await?;
    let setup = async {
        let channel = conn.create_channel().await.context("channel.open")?;
        channel
            .basic_qos(args.prefetch, BasicQosOptions::default())
            .await
            .context("basic.qos")?;
        let mut streams = Vec::with_capacity(queues.len());
        for q in queues {
            if args.reconnect {
                declare_queue(&channel, args, q).await?;
            }
            let c = channel
                .basic_consume(
                    q.as_str().into(),
                    format!("loadgen-c{id}-{q}").into(),
                    BasicConsumeOptions {
                        no_ack: args.auto_ack,
                        ..BasicConsumeOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .with_context(|| format!("basic.consume on {q}"))?;
            streams.push(c);
        }
        Ok((channel, streams))
    };
    let (channel, streams) = match within("opening the consumer's channel", setup).await {
        Ok(opened) => opened,
        Err(e) => {
            close(conn, watcher).await;
            return Err(e);
        }
    };
    retry.connected();
    let mut deliveries = futures::stream::select_all(streams);
    out.subscribed.get_or_insert_with(Instant::now);
    if let Some(ready) = ready.take() {
        let _ = ready.send(()).await;
    }

    let size = Some(args.size);
    let mut stop = shared.stop.clone();
    let mut flush = tokio::time::interval(ACK_FLUSH);
    let mut pacer = Pacer::new(args.consume_rate);
    let mut acks = Acks::new(args);
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
                        shared.consumed.fetch_add(1, Ordering::Relaxed);
                        if let Some(tag) = acks.delivered(d.delivery_tag) {
                            channel
                                .basic_ack(tag, BasicAckOptions { multiple: true })
                                .await
                                .context("basic.ack")?;
                        }
                        pacer.delivered().await;
                    }
                },
                _ = flush.tick() => {
                    if let Some(tag) = acks.outstanding() {
                        channel
                            .basic_ack(tag, BasicAckOptions { multiple: true })
                            .await
                            .context("basic.ack")?;
                    }
                }
            }
        }
    }
    .await;
    if let (Ok(()), Some(tag)) = (&result, acks.outstanding()) {
        channel
            .basic_ack(tag, BasicAckOptions { multiple: true })
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
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    published: u64,
    confirmed: u64,
    nacked: u64,
    returned: u64,
    consumed: u64,
    expected: u64,
    lost: u64,
    duplicated: u64,
    out_of_order: u64,
    priority_inversions: u64,
    corrupt: u64,
    unexpected: u64,
    redelivered: u64,
    /// Confirmed by the broker and never consumed: always a failure.
    confirmed_lost: u64,
    /// Handed out but never confirmed (connection lost, or publish failed).
    unconfirmed: u64,
    /// Fault mode: reconnections, and why (the first few).
    reconnect: bool,
    reconnects: u64,
    reconnect_events: Vec<String>,
    queue_args: Vec<String>,
    publish_rate: f64,
    consume_rate: f64,
    /// The most messages published and not yet consumed at once, sampled
    /// every 5 ms (0 without both producers and consumers).
    max_backlog: u64,
    /// Payload megabytes (10^6 bytes) per second: consumed if consuming, else published.
    mb_per_s: f64,
    latency_p50_ms: Option<f64>,
    latency_p99_ms: Option<f64>,
    latency_max_ms: Option<f64>,
    elapsed_s: f64,
    publish_elapsed_s: f64,
    consume_elapsed_s: f64,
    size: usize,
    /// What padded the bodies (`--body`).
    body: BodyKind,
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

/// Fault mode: the same question on a connection of its own (the admin one may be gone).
async fn queues_empty_fresh(shared: &Arc<Shared>) -> bool {
    let probe = async {
        let (conn, watcher) = connect(shared, "loadgen-probe", &shared.args.url).await?;
        let ch = conn.create_channel().await.context("channel.open")?;
        let empty = queues_empty(&ch, &shared.args).await;
        let _ = ch.close(200, "done".into()).await;
        close(conn, watcher).await;
        anyhow::Ok(empty)
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(5), probe).await,
        Ok(Ok(true))
    )
}

async fn run(args: Args, stop_publishing: watch::Receiver<bool>) -> Result<(Summary, bool)> {
    args.validate()?;
    let t0 = Instant::now();
    let (stop_tx, stop_rx) = watch::channel(false);
    let shared = Arc::new(Shared {
        args: args.clone(),
        blocked: BlockedClock::default(),
        errors: Mutex::new(Vec::new()),
        reconnect_events: Mutex::new(Vec::new()),
        reconnects: AtomicU64::new(0),
        published: AtomicU64::new(0),
        confirmed: AtomicU64::new(0),
        consumed: AtomicU64::new(0),
        next_conn: AtomicUsize::new(0),
        stop: stop_rx,
        stop_publishing,
    });

    // Declare (and purge) the queues. The admin connection stays open: the drain phase uses
    // it to tell "slow" from "lost" (passive declares report the ready-message count).
    let (admin_conn, admin_watcher) = connect(&shared, "loadgen-admin", &args.url).await?;
    let admin = admin_conn.create_channel().await.context("channel.open")?;
    {
        let ch = &admin;
        for q in 0..args.queues {
            let name = args.queue_name(q);
            declare_queue(ch, &args, &name).await?;
            if !args.no_purge && !args.consume_only {
                ch.queue_purge(name.as_str().into(), QueuePurgeOptions::default())
                    .await
                    .with_context(|| format!("queue.purge {name}"))?;
            }
        }
    }

    let progress = args.progress.filter(|p| *p > 0.0).map(|every| {
        let sh = shared.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(every));
            tick.tick().await;
            loop {
                tick.tick().await;
                let (blocked, _, _) = sh.blocked.summary();
                eprintln!(
                    "spillway-loadgen: progress t={:.1}s published={} confirmed={} consumed={} \
                     reconnects={} blocked_ms={}",
                    t0.elapsed().as_secs_f64(),
                    sh.published.load(Ordering::Relaxed),
                    sh.confirmed.load(Ordering::Relaxed),
                    sh.consumed.load(Ordering::Relaxed),
                    sh.reconnects.load(Ordering::Relaxed),
                    blocked.as_millis()
                );
            }
        })
    });
    let consuming = !args.no_consume;
    let publishing = !args.consume_only;
    let mut consumers = Vec::new();
    if consuming && !args.phased {
        consumers = spawn_consumers(&shared).await;
    }

    // The backlog (published and not yet consumed) at its highest, sampled
    // every 5 ms from the counters the clients keep anyway: whether the
    // queues stay short at steady state.
    let max_backlog = Arc::new(AtomicU64::new(0));
    let backlog_sampler = (publishing && consuming).then(|| {
        let (sh, max) = (shared.clone(), max_backlog.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(5));
            loop {
                tick.tick().await;
                let backlog = sh
                    .published
                    .load(Ordering::Relaxed)
                    .saturating_sub(sh.consumed.load(Ordering::Relaxed));
                max.fetch_max(backlog, Ordering::Relaxed);
            }
        })
    });

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
                // Fault mode: duplicates make the count meaningless and in-doubt messages
                // may never come; drain until idle with every queue empty.
                Some(_) if args.reconnect => {
                    if idle_for >= idle && last_probe.elapsed() >= Duration::from_millis(500) {
                        last_probe = Instant::now();
                        if queues_empty_fresh(&shared).await {
                            break;
                        }
                    }
                }
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
        if let Some(sampler) = &backlog_sampler {
            sampler.abort();
        }
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
    if let Some(progress) = progress {
        progress.abort();
    }
    let _ = admin.close(200, "done".into()).await;
    close(admin_conn, admin_watcher).await;
    let verdict = if consuming {
        judge(&tallies, &expected)
    } else {
        verify::Verdict::default()
    };
    let confirmed_seqs: BTreeMap<u32, BitSet> = producers
        .iter()
        .map(|p| (p.id, p.confirmed_seqs.clone()))
        .collect();
    let lost_confirmed = if consuming {
        confirmed_lost(&merged_seen(&tallies), &confirmed_seqs)
    } else {
        0
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
    let confirmed: u64 = producers.iter().map(|p| p.confirmed).sum();
    let handed_out: u64 = producers.iter().map(|p| p.next_seq).sum();
    let mut summary = Summary {
        name: args.name.clone(),
        published,
        confirmed,
        nacked,
        returned: producers.iter().map(|p| p.returned).sum(),
        consumed: verdict.consumed,
        expected: if consuming { verdict.expected } else { 0 },
        lost: verdict.lost,
        duplicated: verdict.duplicated,
        out_of_order: verdict.out_of_order,
        priority_inversions: verdict.priority_inversions,
        corrupt: verdict.corrupt,
        unexpected: verdict.unexpected,
        redelivered: verdict.redelivered,
        confirmed_lost: lost_confirmed,
        unconfirmed: if args.confirm {
            handed_out.saturating_sub(confirmed + nacked)
        } else {
            0
        },
        reconnect: args.reconnect,
        reconnects: shared.reconnects.load(Ordering::Relaxed),
        reconnect_events: lock(&shared.reconnect_events).clone(),
        queue_args: args.queue_args.clone(),
        publish_rate: rate(published, publish_elapsed),
        consume_rate: rate(verdict.consumed, consume_elapsed),
        max_backlog: max_backlog.load(Ordering::Relaxed),
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
        body: args.body,
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
    summary.ok = if args.reconnect {
        // Redeliveries after a reconnect are legitimate (duplicates, reordering), and a
        // message whose confirm never came may or may not have made it.
        lost_confirmed == 0
            && verdict.corrupt == 0
            && verdict.unexpected == 0
            && summary.errors.is_empty()
    } else {
        verdict.ok() && summary.errors.is_empty() && nacked == 0
    };
    let ok = summary.ok;
    Ok((summary, ok))
}

/// A JSON plan: steps run one after another, the runs of a step together.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Plan {
    steps: Vec<Step>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Step {
    name: String,
    /// Each run is an argument list, as on the command line (without the program name).
    runs: Vec<Vec<String>>,
}

#[derive(Debug, Serialize)]
struct StepSummary {
    name: String,
    ok: bool,
    elapsed_s: f64,
    runs: Vec<Summary>,
}

#[derive(Debug, Serialize)]
struct PlanSummary {
    plan: String,
    ok: bool,
    elapsed_s: f64,
    /// Totals over every run of every step that ran.
    published: u64,
    confirmed: u64,
    consumed: u64,
    lost: u64,
    confirmed_lost: u64,
    duplicated: u64,
    blocked_ms: u64,
    steps: Vec<StepSummary>,
}

fn failed_summary(args: &Args, e: &anyhow::Error) -> Summary {
    Summary {
        name: args.name.clone(),
        size: args.size,
        persistent: args.persistent,
        errors: vec![format!("{e:#}")],
        ..Summary::default()
    }
}

/// Parses a plan run's arguments; the plan's --url/--consumer-url come first so that a run
/// may override them.
fn plan_run_args(top: &Args, step: &str, i: usize, run: &[String]) -> Result<Args> {
    let mut argv = vec![
        "spillway-loadgen".to_string(),
        "--url".to_string(),
        top.url.clone(),
        "--name".to_string(),
        format!("{step}/{i}"),
    ];
    if let Some(url) = &top.consumer_url {
        argv.extend(["--consumer-url".to_string(), url.clone()]);
    }
    if let Some(ca) = &top.tls_ca {
        argv.extend(["--tls-ca".to_string(), ca.display().to_string()]);
    }
    argv.extend(run.iter().cloned());
    let args = Args::try_parse_from(&argv)
        .with_context(|| format!("plan step {step:?}, run {i}: {}", run.join(" ")))?;
    if args.plan.is_some() {
        bail!("plan step {step:?}, run {i}: plans do not nest");
    }
    args.validate()
        .with_context(|| format!("plan step {step:?}, run {i}"))?;
    Ok(args)
}

async fn run_plan(
    top: &Args,
    path: &std::path::Path,
    stop: watch::Receiver<bool>,
) -> Result<PlanSummary> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the plan {}", path.display()))?;
    let plan: Plan =
        serde_json::from_str(&text).with_context(|| format!("{}: not a plan", path.display()))?;
    // Check every run's arguments before starting anything.
    let mut parsed = Vec::with_capacity(plan.steps.len());
    for step in &plan.steps {
        let runs = step
            .runs
            .iter()
            .enumerate()
            .map(|(i, run)| plan_run_args(top, &step.name, i, run))
            .collect::<Result<Vec<_>>>()?;
        parsed.push((step.name.clone(), runs));
    }
    let t0 = Instant::now();
    let mut steps = Vec::new();
    for (name, runs) in parsed {
        let t = Instant::now();
        eprintln!("spillway-loadgen: step {name}: {} run(s)", runs.len());
        let handles: Vec<_> = runs
            .into_iter()
            .map(|args| {
                let stop = stop.clone();
                tokio::spawn(async move {
                    match run(args.clone(), stop).await {
                        Ok((summary, _)) => summary,
                        Err(e) => failed_summary(&args, &e),
                    }
                })
            })
            .collect();
        let mut summaries = Vec::new();
        for h in handles {
            summaries.push(h.await.context("run task panicked")?);
        }
        let ok = summaries.iter().all(|s| s.ok);
        let step = StepSummary {
            name,
            ok,
            elapsed_s: round(t.elapsed().as_secs_f64(), 3),
            runs: summaries,
        };
        eprintln!(
            "spillway-loadgen: step {} {} in {:.1} s: {}",
            step.name,
            if ok { "ok" } else { "FAILED" },
            step.elapsed_s,
            step.runs
                .iter()
                .map(|s| format!(
                    "[{}: published {} confirmed {} consumed {} lost {} dup {} blocked {} ms]",
                    s.name.as_deref().unwrap_or("-"),
                    s.published,
                    s.confirmed,
                    s.consumed,
                    s.lost,
                    s.duplicated,
                    s.blocked_ms
                ))
                .collect::<Vec<_>>()
                .join(" ")
        );
        steps.push(step);
        if !ok {
            break;
        }
    }
    let all = || steps.iter().flat_map(|s| s.runs.iter());
    Ok(PlanSummary {
        plan: path.display().to_string(),
        ok: steps.len() == plan.steps.len() && steps.iter().all(|s| s.ok),
        elapsed_s: round(t0.elapsed().as_secs_f64(), 3),
        published: all().map(|s| s.published).sum(),
        confirmed: all().map(|s| s.confirmed).sum(),
        consumed: all().map(|s| s.consumed).sum(),
        lost: all().map(|s| s.lost).sum(),
        confirmed_lost: all().map(|s| s.confirmed_lost).sum(),
        duplicated: all().map(|s| s.duplicated).sum(),
        blocked_ms: all().map(|s| s.blocked_ms).sum(),
        steps,
    })
}

/// SIGINT or SIGTERM: stop publishing, then drain and judge as usual.
fn stop_on_signal() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut term), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) else {
                tracing::warn!("cannot install signal handlers");
                return;
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        #[cfg(not(unix))]
        if tokio::signal::ctrl_c().await.is_err() {
            return;
        }
        eprintln!("spillway-loadgen: signal: publishing stops, draining");
        let _ = tx.send(true);
    });
    rx
}

/// `stop`, or set after `after`.
fn stop_after(mut stop: watch::Receiver<bool>, after: Duration) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let _ = tokio::time::timeout(after, stop.wait_for(|stopped| *stopped)).await;
        let _ = tx.send(true);
    });
    rx
}

/// Exit status of the modes that only set something up (2: it could not).
fn exit_with(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("spillway-loadgen: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn print_json<T: Serialize>(value: &T) {
    println!(
        "{}",
        serde_json::to_string(value).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    );
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
    message::set_body_kind(args.body);
    let stop = stop_on_signal();
    if let Some(count) = args.idle_connections {
        let stop = match args.duration {
            Some(seconds) => stop_after(stop, Duration::from_secs_f64(seconds.max(0.0))),
            None => stop,
        };
        return exit_with(raw::hold_idle_connections(&args.url, count, stop, print_json).await);
    }
    if let Some(count) = args.declare_queues {
        return exit_with(
            raw::declare_queues(&args.url, &args.queue, count)
                .await
                .map(|declared| print_json(&declared)),
        );
    }
    if let Some(plan) = args.plan.clone() {
        return match run_plan(&args, &plan, stop).await {
            Ok(summary) => {
                print_json(&summary);
                if summary.ok {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(1)
                }
            }
            Err(e) => {
                eprintln!("spillway-loadgen: {e:#}");
                print_json(&failed_summary(&args, &e));
                ExitCode::from(2)
            }
        };
    }
    match run(args.clone(), stop).await {
        Ok((summary, ok)) => {
            print_json(&summary);
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("spillway-loadgen: {e:#}");
            print_json(&failed_summary(&args, &e));
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> Args {
        let mut argv = vec!["spillway-loadgen"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).expect("arguments parse")
    }

    #[test]
    fn queues_are_durable_with_durable_or_persistent() {
        assert!(!parse(&[]).durable_queues());
        let durable = parse(&["--durable"]);
        assert!(durable.durable_queues());
        assert!(!durable.persistent, "--durable keeps messages transient");
        assert!(parse(&["--persistent"]).durable_queues());
        assert!(parse(&["--durable", "--persistent"]).durable_queues());
    }

    /// Every sequence number the producer sends, in order, for `count` messages.
    fn sent(args: &Args, count: u64) -> Vec<u64> {
        let budget = Budget {
            count,
            deadline: None,
            started: Instant::now(),
        };
        let mut out = ProducerOutcome::default();
        let mut sent = Vec::new();
        while out.next_seq < count {
            sent.extend(budget.next_seqs(args, &mut out));
        }
        sent
    }

    #[test]
    fn injected_faults_skip_duplicate_or_swap_every_nth_message() {
        assert_eq!(sent(&parse(&[]), 5), [0, 1, 2, 3, 4]);
        let every = ["--inject-every", "3", "--inject-fault"];
        let with = |fault| [&every[..], &[fault]].concat();
        assert_eq!(sent(&parse(&with("skip")), 7), [0, 1, 3, 4, 6]);
        assert_eq!(sent(&parse(&with("dup")), 6), [0, 1, 2, 2, 3, 4, 5, 5]);
        assert_eq!(sent(&parse(&with("swap")), 7), [0, 1, 3, 2, 4, 6, 5]);
        // The last message has nothing to swap with.
        assert_eq!(sent(&parse(&with("swap")), 3), [0, 1, 2]);
    }

    #[test]
    fn the_amqp1_client_refuses_what_it_cannot_do() {
        assert!(parse(&["--client", "amqp1", "--confirm", "--persistent"])
            .validate()
            .is_ok());
        for refused in [
            &["--client", "amqp1", "--tx-every", "10"][..],
            &["--client", "amqp1", "--reconnect"],
            &["--client", "amqp1", "--queues", "4", "--consumers", "2"],
        ] {
            assert!(parse(refused).validate().is_err(), "{refused:?}");
        }
        // Publishing only: no consumer to give queues to.
        assert!(
            parse(&["--client", "amqp1", "--queues", "4", "--no-consume"])
                .validate()
                .is_ok()
        );
    }
}
