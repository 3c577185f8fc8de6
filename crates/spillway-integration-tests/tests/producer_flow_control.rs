//! Producer flow control through lapin, in both wirings: a queue over its
//! capacity blocks the connections publishing to it (connection.blocked),
//! a consumer draining it below its resume capacity releases them, nothing
//! is lost; a producer to another queue is not slowed; a resume capacity
//! above the capacity is refused; the store's disk quota blocks everyone
//! until space is freed.

use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, Event};
use spillway_integration_tests::{Sandbox, Wiring};

const CAPACITY: i64 = 64 * 1024;
const RESUME: i64 = 32 * 1024;
const MESSAGES: u64 = 400;
const SIZE: usize = 1024;

fn capacity_arguments(capacity: i64, resume: i64) -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert("x-qpid-capacity".into(), AMQPValue::LongLongInt(capacity));
    arguments.insert(
        "x-qpid-flow-resume-capacity".into(),
        AMQPValue::LongLongInt(resume),
    );
    arguments
}

async fn declare(
    connection: &Connection,
    queue: &str,
    arguments: FieldTable,
) -> anyhow::Result<()> {
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::default(), arguments)
        .await?;
    channel.close(200, "declared".into()).await?;
    Ok(())
}

/// Publishes `count` numbered messages with confirms; returns when all are
/// confirmed.
async fn publish_numbered(connection: Connection, queue: String, count: u64) -> anyhow::Result<()> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut confirms = Vec::new();
    for seq in 0..count {
        let mut body = vec![0u8; SIZE];
        body[..8].copy_from_slice(&seq.to_be_bytes());
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default(),
            )
            .await?;
        confirms.push(confirm);
    }
    for confirm in confirms {
        anyhow::ensure!(confirm.await?.is_ack(), "publish nacked");
    }
    Ok(())
}

/// Waits for a blocked (`true`) or unblocked (`false`) event.
async fn wait_for(
    events: &mut (impl futures::Stream<Item = Event> + Unpin),
    blocked: bool,
) -> anyhow::Result<Option<String>> {
    let deadline = Duration::from_secs(20);
    loop {
        let event = tokio::time::timeout(deadline, events.next())
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "no connection.{} within {deadline:?}",
                    if blocked { "blocked" } else { "unblocked" }
                )
            })?
            .ok_or_else(|| anyhow::anyhow!("event stream ended"))?;
        match event {
            Event::ConnectionBlocked(reason) if blocked => return Ok(Some(reason)),
            Event::ConnectionUnblocked if !blocked => return Ok(None),
            _ => {}
        }
    }
}

async fn an_overfull_queue_blocks_its_producer_until_drained(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox = Sandbox::start(wiring).await?;
    let setup = sandbox.connect().await?;
    declare(&setup, "capped", capacity_arguments(CAPACITY, RESUME)).await?;
    declare(&setup, "free", FieldTable::default()).await?;

    let producer = sandbox.connect().await?;
    let mut events = Box::pin(producer.events_listener());
    let publishing = tokio::spawn(publish_numbered(producer, "capped".into(), MESSAGES));

    let reason = wait_for(&mut events, true).await?;
    let reason = reason.unwrap_or_default();
    anyhow::ensure!(reason.contains("capped"), "blocked for '{reason}'");
    // Held: it cannot have finished 400 KiB into a 64 KiB queue.
    tokio::time::sleep(Duration::from_millis(300)).await;
    anyhow::ensure!(!publishing.is_finished(), "the blocked producer finished");

    // Another producer, to another queue, is not held.
    let other = sandbox.connect().await?;
    let started = Instant::now();
    tokio::time::timeout(
        Duration::from_secs(10),
        publish_numbered(other, "free".into(), 200),
    )
    .await
    .map_err(|_| anyhow::anyhow!("the unrelated producer was held"))??;
    let unrelated = started.elapsed();
    anyhow::ensure!(
        !publishing.is_finished(),
        "unblocked before anyone consumed"
    );

    // A consumer drains; the producer is released and finishes.
    let consumer = sandbox.connect().await?;
    let channel = consumer.create_channel().await?;
    let mut deliveries = channel
        .basic_consume(
            "capped".into(),
            "drain".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut saw_unblocked = false;
    for expected in 0..MESSAGES {
        let delivery = tokio::time::timeout(Duration::from_secs(20), deliveries.next())
            .await
            .map_err(|_| anyhow::anyhow!("stalled at message {expected}"))?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
        let seq = u64::from_be_bytes(delivery.data[..8].try_into()?);
        anyhow::ensure!(seq == expected, "expected message {expected}, got {seq}");
        delivery.acker.ack(BasicAckOptions::default()).await?;
        if !saw_unblocked {
            if let Some(Some(Event::ConnectionUnblocked)) = events.next().now_or_never() {
                saw_unblocked = true;
            }
        }
    }
    tokio::time::timeout(Duration::from_secs(20), publishing)
        .await
        .map_err(|_| anyhow::anyhow!("the producer never finished"))???;
    if !saw_unblocked {
        wait_for(&mut events, false).await?;
    }
    let extra = tokio::time::timeout(Duration::from_millis(300), deliveries.next()).await;
    anyhow::ensure!(extra.is_err(), "more delivered than published");

    if wiring == Wiring::Separate {
        let logs = sandbox.logs();
        for line in [
            "QUE-1003 : Overfull : Size : ",
            " bytes, Capacity : 65,536",
            "CHN-1005 : Flow Control Enforced (Queue capped)",
            "QUE-1004 : Underfull : Size : ",
            " bytes, Resume Capacity : 32,768",
            "CHN-1006 : Flow Control Removed",
        ] {
            anyhow::ensure!(logs.contains(line), "'{line}' not logged:\n{logs}");
        }
    }
    println!("{wiring:?}: unrelated producer published 200 confirmed in {unrelated:?} while the other was blocked");
    Ok(())
}

use futures::FutureExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_an_overfull_queue_blocks_its_producer_until_drained() -> anyhow::Result<()> {
    an_overfull_queue_blocks_its_producer_until_drained(Wiring::InProcess).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_an_overfull_queue_blocks_its_producer_until_drained() -> anyhow::Result<()> {
    an_overfull_queue_blocks_its_producer_until_drained(Wiring::Separate).await
}

async fn a_resume_capacity_above_the_capacity_is_refused(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox = Sandbox::start(wiring).await?;
    let connection = sandbox.connect().await?;
    let channel = connection.create_channel().await?;
    let refused = channel
        .queue_declare(
            "inverted".into(),
            QueueDeclareOptions::default(),
            capacity_arguments(1000, 2000),
        )
        .await;
    let error = refused.err().ok_or_else(|| anyhow::anyhow!("declared"))?;
    let text = error.to_string();
    anyhow::ensure!(
        text.contains("406") || text.contains("PRECONDITION_FAILED"),
        "not a 406: {text}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_a_resume_capacity_above_the_capacity_is_refused() -> anyhow::Result<()> {
    a_resume_capacity_above_the_capacity_is_refused(Wiring::InProcess).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_a_resume_capacity_above_the_capacity_is_refused() -> anyhow::Result<()> {
    a_resume_capacity_above_the_capacity_is_refused(Wiring::Separate).await
}

/// A small disk quota: persistent messages fill it, every producer is
/// blocked (a connection that only consumes is not, so it can free space);
/// a purge frees the space (the store flushes and compacts while overfull)
/// and releases them. Bodies are pseudo-random: compression alone cannot
/// bring the store back under its quota.
async fn the_store_quota_blocks_every_producer_until_space_is_freed(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let config = "[store]\noverfull_size = \"4MiB\"\nunderfull_size = \"3MiB\"\n";
    let sandbox = Sandbox::start_with_config(wiring, config).await?;
    let connection = sandbox.connect().await?;
    let mut events = Box::pin(connection.events_listener());
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            "durable".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut noise = move || {
        (0..64 * 1024)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect::<Vec<u8>>()
    };
    let persistent = BasicProperties::default().with_delivery_mode(2);
    let mut published = 0u64;
    let blocked = loop {
        if let Some(Some(Event::ConnectionBlocked(reason))) = events.next().now_or_never() {
            break reason;
        }
        anyhow::ensure!(
            published < 2000,
            "no block after {published} messages of 64 KiB"
        );
        let body = noise();
        let confirm = channel
            .basic_publish(
                "".into(),
                "durable".into(),
                BasicPublishOptions::default(),
                &body,
                persistent.clone(),
            )
            .await?;
        confirm.await?;
        published += 1;
        if published.is_multiple_of(16) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    anyhow::ensure!(blocked.contains("store"), "blocked for '{blocked}'");
    // Every producer is blocked, not only the one that filled the disk: one
    // that publishes now is told as soon as it does.
    let other = sandbox.connect().await?;
    let other_channel = other.create_channel().await?;
    other_channel
        .basic_publish(
            "".into(),
            "durable".into(),
            BasicPublishOptions::default(),
            b"one",
            BasicProperties::default(),
        )
        .await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !other.status().blocked() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "a second producer was not blocked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A connection that only consumes is not blocked: it purges, which
    // frees the space and releases both producers.
    let consumer = sandbox.connect().await?;
    let admin = consumer.create_channel().await?;
    anyhow::ensure!(
        !consumer.status().blocked(),
        "a consumer-only connection was blocked"
    );
    admin
        .queue_purge("durable".into(), QueuePurgeOptions::default())
        .await?;
    wait_for(&mut events, false).await?;
    if wiring == Wiring::Separate {
        let logs = sandbox.logs();
        for line in [
            "MST-1008 : Store overfull, flow control will be enforced",
            "MST-1009 : Store overfull condition cleared",
        ] {
            anyhow::ensure!(logs.contains(line), "'{line}' not logged:\n{logs}");
        }
    }
    println!("{wiring:?}: blocked after {published} persistent messages of 64 KiB");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_the_store_quota_blocks_every_producer_until_space_is_freed(
) -> anyhow::Result<()> {
    the_store_quota_blocks_every_producer_until_space_is_freed(Wiring::InProcess).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_the_store_quota_blocks_every_producer_until_space_is_freed() -> anyhow::Result<()>
{
    the_store_quota_blocks_every_producer_until_space_is_freed(Wiring::Separate).await
}
