//! `--client amqp1`: producers and consumers over AMQP 1.0, through `fe2o3-amqp`'s client,
//! on the same port as 0-9-1 (Spillway's gateway, RabbitMQ 3's `rabbitmq_amqp1_0` plugin).
//!
//! The run is the one the other clients make: queues are declared and purged through lapin
//! (0-9-1) first, so both brokers get the same queue, then every producer and consumer is
//! one 1.0 connection with one session and one link on `--amqp1-prefix` + the queue name
//! (`/amq/queue/Q` by default: an existing queue, read by RabbitMQ 3.x and by Spillway).
//! Bodies carry the same header as every other client's (one `data` section), so the
//! exactly-once and order checks and the latency are the same.
//!
//! What the 0-9-1 options become:
//! - without `--confirm`, the sender's transfers are pre-settled (sender settle mode
//!   `settled`): nothing comes back, as a publish without confirms;
//! - `--confirm`: unsettled transfers, each counted confirmed when its outcome is
//!   `accepted`, with up to `--confirm-window` outcomes outstanding; `rejected`,
//!   `released` and `modified` count as nacked (`released` also as returned: it routed
//!   nowhere);
//! - `--persistent`: the message header's `durable` (delivery mode 2);
//! - `--auto-ack`: the receiver asks for sender settle mode `settled` (at-most-once),
//!   otherwise each delivery is settled with `accepted` as it is recorded: one disposition
//!   each, as `fe2o3-amqp`'s `accept` sends it, unless `--ack-every N` is given, which
//!   settles N deliveries at once (a disposition per range of consecutive ids, as
//!   `accept_all` sends them) and what waits every 50 ms;
//! - `--prefetch N`: the receiving link's credit, topped back up to N once half is used
//!   (`fe2o3-amqp`'s automatic credit; 0 means 1000).
//!
//! Not covered: `--reconnect`, `--tx-every` (no 1.0 transactions here), amqps://, and
//! a consumer on several queues (`--consumers` must be at least `--queues`). 1.0 has no
//! `connection.blocked`: a broker holds a sender back by withholding credit, which the
//! summary does not count as blocked time.
//!
//! The library sends each frame with its own write (and flush), so this client costs more
//! CPU per message than `--client raw`; both brokers are measured through the same client.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use amq_protocol::uri::{AMQPScheme, AMQPUri};
use anyhow::{anyhow, bail, Context, Result};
use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::delivery::{DeliveryFut, DeliveryInfo};
use fe2o3_amqp::link::{CreditMode, SendError};
use fe2o3_amqp::sasl_profile::SaslProfile;
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::definitions::{ReceiverSettleMode, SenderSettleMode};
use fe2o3_amqp::types::messaging::{Data, Message, Outcome, Priority};
use fe2o3_amqp::types::primitives::Binary;
use fe2o3_amqp::{Connection, Receiver, Sender, Session};
use tokio::net::TcpStream;

use crate::message::{encode_into, now_ns, priority_of, Header};
use crate::{within, Budget, ConsumerOutcome, Pacer, ProducerOutcome, Shared, ACK_FLUSH};

/// How long closing a link, the session and the connection may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Link credit for `--prefetch 0` (0-9-1's "no limit"; Spillway caps a link's at 1000).
const UNLIMITED_CREDIT: u32 = 1000;

/// One 1.0 connection with one session.
struct Amqp1Connection {
    connection: ConnectionHandle<()>,
    session: SessionHandle<()>,
}

impl Amqp1Connection {
    /// Connects to the host, port, user and vhost of an `amqp://` URL: SASL PLAIN, the vhost
    /// as the open frame's hostname `vhost:NAME` (RabbitMQ's convention, and Spillway's).
    async fn open(url: &str, name: &str) -> Result<Self> {
        let uri: AMQPUri = url.parse().map_err(|e: String| anyhow!("{url}: {e}"))?;
        if uri.scheme == AMQPScheme::AMQPS {
            bail!("{url}: --client amqp1 speaks plain AMQP only");
        }
        let authority = &uri.authority;
        let opening = async {
            let socket = TcpStream::connect((authority.host.as_str(), authority.port))
                .await
                .with_context(|| format!("{name}: cannot connect to {url}"))?;
            // The library writes and flushes each frame on its own: without this, Nagle's
            // algorithm holds a small frame back until the previous one is acknowledged.
            socket.set_nodelay(true)?;
            let hostname = format!("vhost:{}", uri.vhost);
            let mut connection = Connection::builder()
                .container_id(name)
                .hostname(hostname.as_str())
                .sasl_profile(SaslProfile::Plain {
                    username: authority.userinfo.username.clone(),
                    password: authority.userinfo.password.clone(),
                })
                .open_with_stream(socket)
                .await
                .with_context(|| format!("{name}: AMQP 1.0 open on {url}"))?;
            let session = match Session::begin(&mut connection).await {
                Ok(session) => session,
                Err(e) => {
                    let _ = connection.close().await;
                    return Err(e).context("begin");
                }
            };
            anyhow::Ok(Self {
                connection,
                session,
            })
        };
        within(&format!("{name}: connecting to {url}"), opening).await
    }

    /// Ends the session and closes the connection, each within [`CLOSE_TIMEOUT`].
    async fn close(mut self) {
        if let Ok(Err(e)) = tokio::time::timeout(CLOSE_TIMEOUT, self.session.end()).await {
            tracing::debug!("end: {e}");
        }
        if let Ok(Err(e)) = tokio::time::timeout(CLOSE_TIMEOUT, self.connection.close()).await {
            tracing::debug!("close: {e}");
        }
    }
}

/// The link address of `queue`.
fn address(shared: &Shared, queue: &str) -> String {
    format!("{}{queue}", shared.args.amqp1_prefix)
}

/// Outcomes not heard yet, oldest first.
type Window = VecDeque<(u64, DeliveryFut<Result<Outcome, SendError>>)>;

/// One producer connection: sends `budget`'s messages to `queue`.
pub(crate) async fn producer_session(
    shared: &Arc<Shared>,
    queue: &str,
    out: &mut ProducerOutcome,
    budget: &Budget,
) -> Result<()> {
    let args = &shared.args;
    let name = format!("loadgen-producer-{}", out.id);
    let mut conn = Amqp1Connection::open(&args.url, &name).await?;
    let target = address(shared, queue);
    let attaching = async {
        Sender::builder()
            .name(name.as_str())
            .target(target.as_str())
            .sender_settle_mode(if args.confirm {
                SenderSettleMode::Unsettled
            } else {
                SenderSettleMode::Settled
            })
            .attach(&mut conn.session)
            .await
            .with_context(|| format!("attaching a sender to {target}"))
    };
    let mut sender = match within("attaching the producer's link", attaching).await {
        Ok(sender) => sender,
        Err(e) => {
            conn.close().await;
            return Err(e);
        }
    };
    let mut window = Window::new();
    let result = send_all(shared, &mut sender, &mut window, out, budget).await;
    match &result {
        Ok(()) => {
            out.finished = Some(Instant::now());
            if let Ok(Err(e)) = tokio::time::timeout(CLOSE_TIMEOUT, sender.close()).await {
                tracing::debug!("detach: {e}");
            }
        }
        Err(_) => {
            if args.confirm {
                out.in_doubt += window.len() as u64;
            }
        }
    }
    conn.close().await;
    result
}

/// The send loop: `--rate`, the confirm window and the checker's fault injection as the
/// lapin client has them.
async fn send_all(
    shared: &Arc<Shared>,
    sender: &mut Sender,
    window: &mut Window,
    out: &mut ProducerOutcome,
    budget: &Budget,
) -> Result<()> {
    let args = &shared.args;
    while !budget.spent(shared, out) {
        budget.pace(args, out).await;
        for seq in budget.next_seqs(args, out) {
            send(shared, sender, window, out, seq).await?;
        }
    }
    while !window.is_empty() {
        settle_one(shared, window, out).await?;
    }
    Ok(())
}

/// Sends message `seq` (waiting for credit when the broker gave none), then waits for the
/// oldest outcome while the window is full.
async fn send(
    shared: &Shared,
    sender: &mut Sender,
    window: &mut Window,
    out: &mut ProducerOutcome,
    seq: u64,
) -> Result<()> {
    let args = &shared.args;
    let mut body = Vec::with_capacity(args.size);
    encode_into(
        &mut body,
        args.size,
        Header {
            producer: out.id,
            seq,
            sent_ns: now_ns(),
        },
    );
    // No header at all for a plain transient message: the spec's defaults.
    let header =
        (args.persistent || args.priorities > 0).then(|| fe2o3_amqp::types::messaging::Header {
            durable: args.persistent,
            priority: if args.priorities > 0 {
                Priority(priority_of(seq, args.priorities))
            } else {
                Priority::default()
            },
            ..Default::default()
        });
    let message = Message::builder()
        .header(header)
        .data(Binary::from(body))
        .build();
    let outcome = sender.send_batchable(message).await.context("transfer")?;
    out.published += 1;
    shared.published.fetch_add(1, Ordering::Relaxed);
    if args.confirm {
        window.push_back((seq, outcome));
        while window.len() >= args.confirm_window.max(1) {
            settle_one(shared, window, out).await?;
        }
    }
    Ok(())
}

/// Waits for the oldest outstanding outcome (at most `--timeout`) and counts it.
async fn settle_one(shared: &Shared, window: &mut Window, out: &mut ProducerOutcome) -> Result<()> {
    let Some((seq, outcome)) = window.pop_front() else {
        return Ok(());
    };
    let limit = Duration::from_secs_f64(shared.args.timeout.max(1.0));
    let outcome = match tokio::time::timeout(limit, outcome).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(e)) => {
            out.in_doubt += 1;
            return Err(e).context("waiting for a transfer's outcome");
        }
        Err(_) => {
            out.in_doubt += 1;
            let e = format!(
                "producer {}: no outcome for message {seq} within {:.0} s, and the link is \
                 still attached",
                out.id,
                limit.as_secs_f64()
            );
            shared.error(e.clone());
            bail!(e);
        }
    };
    match outcome {
        Outcome::Accepted(_) => out.count_confirmed(shared, seq),
        Outcome::Released(_) => {
            out.nacked += 1;
            out.returned += 1;
        }
        other => {
            tracing::warn!(producer = out.id, seq, outcome = ?other, "message not accepted");
            out.nacked += 1;
        }
    }
    Ok(())
}

/// One consumer connection: receives from `queues` (one) until the run stops.
pub(crate) async fn consumer_session(
    shared: &Arc<Shared>,
    id: u32,
    queues: &[String],
    out: &mut ConsumerOutcome,
    ready: &mut Option<tokio::sync::mpsc::Sender<()>>,
) -> Result<()> {
    let args = &shared.args;
    let [queue] = queues else {
        bail!(
            "--client amqp1: consumer {id} has {} queues; one each",
            queues.len()
        );
    };
    let name = format!("loadgen-consumer-{id}");
    let mut conn = Amqp1Connection::open(args.consumer_url(), &name).await?;
    let source = address(shared, queue);
    let credit = match u32::from(args.prefetch) {
        0 => UNLIMITED_CREDIT,
        n => n,
    };
    let attaching = async {
        Receiver::builder()
            .name(format!("loadgen-c{id}-{queue}"))
            .source(source.as_str())
            .sender_settle_mode(if args.auto_ack {
                SenderSettleMode::Settled
            } else {
                SenderSettleMode::Unsettled
            })
            .receiver_settle_mode(ReceiverSettleMode::First)
            .credit_mode(CreditMode::Auto(credit))
            .attach(&mut conn.session)
            .await
            .with_context(|| format!("attaching a receiver to {source}"))
    };
    let mut receiver = match within("attaching the consumer's link", attaching).await {
        Ok(receiver) => receiver,
        Err(e) => {
            conn.close().await;
            return Err(e);
        }
    };
    out.subscribed.get_or_insert_with(Instant::now);
    if let Some(ready) = ready.take() {
        let _ = ready.send(()).await;
    }
    let result = receive(shared, &mut receiver, out).await;
    if result.is_ok() {
        if let Ok(Err(e)) = tokio::time::timeout(CLOSE_TIMEOUT, receiver.close()).await {
            tracing::debug!("detach: {e}");
        }
    }
    conn.close().await;
    result
}

async fn receive(
    shared: &Arc<Shared>,
    receiver: &mut Receiver,
    out: &mut ConsumerOutcome,
) -> Result<()> {
    let args = &shared.args;
    let size = Some(args.size);
    let mut stop = shared.stop.clone();
    let mut pacer = Pacer::new(args.consume_rate);
    // --ack-every N: deliveries settled together; otherwise each as it comes.
    let together = match args.ack_every {
        Some(n) if n > 1 && !args.auto_ack => usize::try_from(n).unwrap_or(usize::MAX),
        _ => 1,
    };
    let mut pending: Vec<DeliveryInfo> = Vec::new();
    let mut flush = tokio::time::interval(ACK_FLUSH);
    let result = loop {
        if *stop.borrow() {
            break Ok(());
        }
        let delivery = tokio::select! {
            biased;
            changed = stop.changed() => {
                if changed.is_err() {
                    break Ok(());
                }
                continue;
            }
            delivery = receiver.recv::<Data>() => match delivery {
                Ok(delivery) => delivery,
                Err(e) => break Err(e).context("receiving a delivery"),
            },
            _ = flush.tick(), if !pending.is_empty() => {
                if let Err(e) = receiver.accept_all(pending.drain(..)).await {
                    break Err(e).context("disposition (accepted)");
                }
                continue;
            }
        };
        let redelivered = delivery
            .message()
            .header
            .as_ref()
            .is_some_and(|h| h.delivery_count > 0);
        out.tally
            .record(&delivery.body().0, size, redelivered, now_ns());
        out.last = Some(Instant::now());
        shared.consumed.fetch_add(1, Ordering::Relaxed);
        // Settles an unsettled delivery with `accepted`; for a pre-settled one (--auto-ack)
        // nothing is sent, but the library counts it towards topping the credit up.
        let settled = if together > 1 {
            pending.push(DeliveryInfo::from(&delivery));
            if pending.len() < together {
                Ok(())
            } else {
                receiver.accept_all(pending.drain(..)).await
            }
        } else {
            receiver.accept(&delivery).await
        };
        if let Err(e) = settled {
            break Err(e).context("disposition (accepted)");
        }
        pacer.delivered().await;
    };
    if result.is_ok() && !pending.is_empty() {
        receiver
            .accept_all(pending)
            .await
            .context("disposition (accepted)")?;
    }
    result
}
