//! `spillway-delayed-bench`: many delayed messages, due evenly over a
//! window, through an `x-delayed-message` exchange (RabbitMQ's
//! delayed-message interface), and how late each is routed.
//!
//! Publishers send `--messages` messages of `--size` bytes (persistent,
//! confirmed) as fast as they can, message `i` due at
//! `start + --base-secs + --spread-secs * i / messages`, its `x-delay` the
//! time left until then. One consumer (auto-ack) takes them as they come
//! and records each one's lateness (arrival minus due time; the due time
//! is in the body). Prints one JSON line: publish rate, received, lost,
//! early (arrived before due: must be 0), lateness p50/p99/p99.9/max in ms.
//! The broker's memory is measured by the script around it
//! (`scripts/bench-delayed.sh`).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::Parser;
use futures::StreamExt as _;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};

#[derive(Parser)]
#[command(
    name = "spillway-delayed-bench",
    about = "Delayed messages due over a window, and how late they arrive"
)]
struct Args {
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    url: String,
    #[arg(long, default_value_t = 1_000_000)]
    messages: u64,
    #[arg(long, default_value_t = 100)]
    size: usize,
    /// The due times spread evenly over this many seconds ...
    #[arg(long, default_value_t = 600.0)]
    spread_secs: f64,
    /// ... starting this long after the start.
    #[arg(long, default_value_t = 5.0)]
    base_secs: f64,
    #[arg(long, default_value_t = 2)]
    publishers: u64,
    /// Unconfirmed publishes per publisher.
    #[arg(long, default_value_t = 2_000)]
    window: usize,
    /// How long to wait past the last due time for stragglers.
    #[arg(long, default_value_t = 30.0)]
    grace_secs: f64,
}

const EXCHANGE: &str = "bench.delayed";
const QUEUE: &str = "bench.delayed.q";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn s(text: &str) -> ShortString {
    text.into()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.size >= 16,
        "--size is at least 16 (the due time and sequence)"
    );
    anyhow::ensure!(args.messages > 0 && args.publishers > 0);
    let setup = Connection::connect(&args.url, ConnectionProperties::default())
        .await
        .context("connecting")?;
    let ch = setup.create_channel().await?;
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-delayed-type".into(),
        AMQPValue::LongString("fanout".into()),
    );
    ch.exchange_declare(
        s(EXCHANGE),
        ExchangeKind::Custom("x-delayed-message".into()),
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        arguments,
    )
    .await?;
    ch.queue_declare(
        s(QUEUE),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_purge(s(QUEUE), QueuePurgeOptions::default())
        .await?;
    ch.queue_bind(
        s(QUEUE),
        s(EXCHANGE),
        s(""),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;

    let start_ms = now_ms();
    let base_ms = (args.base_secs * 1000.0) as u64;
    let spread_ms = (args.spread_secs * 1000.0) as u64;
    let due_of = move |i: u64, n: u64| {
        start_ms + base_ms + (u128::from(spread_ms) * u128::from(i) / u128::from(n)) as u64
    };
    let last_due = due_of(args.messages - 1, args.messages);

    // The consumer first: it records lateness from the first arrival on.
    let consumer_conn = Connection::connect(&args.url, ConnectionProperties::default()).await?;
    let consumer_ch = consumer_conn.create_channel().await?;
    consumer_ch
        .basic_qos(5_000, BasicQosOptions::default())
        .await?;
    let mut deliveries = consumer_ch
        .basic_consume(
            s(QUEUE),
            s("bench"),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let expected = args.messages;
    let deadline_ms = last_due + (args.grace_secs * 1000.0) as u64;
    let consumer = tokio::spawn(async move {
        let mut lateness: Vec<i64> = Vec::with_capacity(expected as usize);
        let mut dues: Vec<u64> = Vec::with_capacity(expected as usize);
        let mut seen = vec![false; expected as usize];
        let mut duplicates = 0u64;
        while (lateness.len() as u64) < expected {
            let left = deadline_ms.saturating_sub(now_ms());
            let next =
                tokio::time::timeout(Duration::from_millis(left.max(1)), deliveries.next()).await;
            let Ok(Some(Ok(delivery))) = next else { break };
            let arrived = now_ms() as i64;
            let data = &delivery.data;
            if data.len() < 16 {
                continue;
            }
            let due = u64::from_le_bytes(data[..8].try_into().unwrap_or_default());
            let seq = u64::from_le_bytes(data[8..16].try_into().unwrap_or_default());
            match seen.get_mut(seq as usize) {
                Some(flag) if !*flag => *flag = true,
                _ => {
                    duplicates += 1;
                    continue;
                }
            }
            lateness.push(arrived - due as i64);
            dues.push(due);
        }
        (lateness, dues, duplicates)
    });

    let published_at = Instant::now();
    let mut publishers = Vec::new();
    for p in 0..args.publishers {
        let url = args.url.clone();
        let (n, size, window, count) = (args.messages, args.size, args.window, args.publishers);
        publishers.push(tokio::spawn(async move {
            let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
            let ch = conn.create_channel().await?;
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
            let mut pending = std::collections::VecDeque::new();
            let mut i = p;
            while i < n {
                let due = due_of(i, n);
                let delay = due.saturating_sub(now_ms()).max(1);
                let mut body = vec![0x5a; size];
                body[..8].copy_from_slice(&due.to_le_bytes());
                body[8..16].copy_from_slice(&i.to_le_bytes());
                let mut headers = FieldTable::default();
                headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay as i64));
                let confirm = ch
                    .basic_publish(
                        s(EXCHANGE),
                        s(""),
                        BasicPublishOptions::default(),
                        &body,
                        BasicProperties::default()
                            .with_delivery_mode(2)
                            .with_headers(headers),
                    )
                    .await?;
                pending.push_back(confirm);
                while pending.len() >= window {
                    if let Some(confirm) = pending.pop_front() {
                        anyhow::ensure!(confirm.await?.is_ack(), "publish nacked");
                    }
                }
                i += count;
            }
            for confirm in pending {
                anyhow::ensure!(confirm.await?.is_ack(), "publish nacked");
            }
            conn.close(200, "done".into()).await.ok();
            anyhow::Ok(())
        }));
    }
    for publisher in publishers {
        publisher.await??;
    }
    let publish_secs = published_at.elapsed().as_secs_f64();
    let publish_end_ms = now_ms();
    let (mut lateness, dues, duplicates) = consumer.await?;
    // Split by whether the message came due while the publishers were
    // still sending (the machine shared with them) or after.
    let mut during: Vec<i64> = Vec::new();
    let mut after: Vec<i64> = Vec::new();
    for (late, due) in lateness.iter().zip(&dues) {
        if *due < publish_end_ms {
            during.push(*late);
        } else {
            after.push(*late);
        }
    }
    during.sort_unstable();
    after.sort_unstable();
    let p99 = |sorted: &[i64]| -> i64 {
        if sorted.is_empty() {
            return -1;
        }
        sorted[((0.99 * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
    };
    let received = lateness.len() as u64;
    let early = lateness.iter().filter(|l| **l < 0).count();
    lateness.sort_unstable();
    let at = |q: f64| -> i64 {
        if lateness.is_empty() {
            return -1;
        }
        let index = ((q * lateness.len() as f64).ceil() as usize).clamp(1, lateness.len()) - 1;
        lateness[index]
    };
    println!(
        "{}",
        serde_json::json!({
            "messages": args.messages,
            "size": args.size,
            "spread_secs": args.spread_secs,
            "publish_secs": publish_secs,
            "publish_rate": args.messages as f64 / publish_secs.max(1e-9),
            "received": received,
            "lost": args.messages - received,
            "duplicates": duplicates,
            "early": early,
            "lateness_ms_p50": at(0.5),
            "lateness_ms_p99": at(0.99),
            "lateness_ms_p999": at(0.999),
            "lateness_ms_max": lateness.last().copied().unwrap_or(-1),
            "due_while_publishing": during.len(),
            "lateness_ms_p99_while_publishing": p99(&during),
            "lateness_ms_p99_after_publishing": p99(&after),
        })
    );
    consumer_conn.close(200, "done".into()).await.ok();
    setup.close(200, "done".into()).await.ok();
    Ok(())
}
