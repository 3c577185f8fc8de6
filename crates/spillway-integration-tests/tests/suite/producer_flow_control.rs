//! Producer flow control through lapin, in both wirings: a queue over its
//! capacity blocks the connections publishing to it (connection.blocked),
//! a consumer draining it below its resume capacity releases them, nothing
//! is lost; a producer to another queue is not slowed; a resume capacity
//! above the capacity is refused; the store's disk quota blocks everyone
//! until space is freed.
//!
//! A blocked lapin connection writes nothing (not even heartbeats) until it
//! is unblocked, so a publish in flight when the block lands is held: the
//! expected state here, not a hang. Producers run as tasks and every wait
//! has a deadline.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, Event};
use spillway_integration_tests::{both_wirings, eventually, Sandbox, Wiring};

both_wirings!(
    own_sandbox, timeout_secs = 120;
    an_overfull_queue_blocks_its_producer_until_drained,
    a_resume_capacity_above_the_capacity_is_refused,
    the_store_quota_blocks_every_producer_until_space_is_freed,
    a_blocked_producer_outlives_its_heartbeat_timeout,
);

const CAPACITY: i64 = 64 * 1024;
const RESUME: i64 = 32 * 1024;
/// More than a blocked producer can get accepted whatever the timing: until
/// the block reaches the gateway at most the session's 1024 queued commands
/// are in flight, and after it the 1 MiB overdraft, so 4000 messages of
/// 1 KiB cannot all be confirmed while the 64 KiB queue is overfull. (With
/// 400, all of them could be read before the block landed on a loaded
/// machine, and the producer finished.)
const MESSAGES: u64 = 4000;
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

/// Publishes `count` numbered messages with confirms on `channel`; returns
/// when all are confirmed. The caller keeps the connection: lapin closes a
/// connection whose last handle is dropped.
async fn publish_numbered(channel: Channel, queue: String, count: u64) -> anyhow::Result<()> {
    spillway_integration_tests::amqp::publish_numbered(channel, queue, count, SIZE).await
}

/// Waits up to `deadline` for a blocked (`true`) or unblocked (`false`)
/// event; returns the block's reason.
async fn wait_for(
    events: &mut (impl futures::Stream<Item = Event> + Unpin),
    blocked: bool,
    deadline: Duration,
) -> anyhow::Result<Option<String>> {
    let wanted = if blocked { "blocked" } else { "unblocked" };
    let until = tokio::time::Instant::now() + deadline;
    loop {
        let event = tokio::time::timeout_at(until, events.next())
            .await
            .map_err(|_| anyhow::anyhow!("no connection.{wanted} within {deadline:?}"))?
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
    // Spawned: once blocked it is held (lapin stops writing), the expected
    // state until a consumer drains the queue.
    let mut publishing = tokio::spawn(publish_numbered(
        producer.create_channel().await?,
        "capped".into(),
        MESSAGES,
    ));

    let reason = wait_for(&mut events, true, Duration::from_secs(20)).await?;
    let reason = reason.unwrap_or_default();
    anyhow::ensure!(reason.contains("capped"), "blocked for '{reason}'");
    // Held: it cannot finish 4000 KiB into a 64 KiB queue, however long it
    // is given (here 300 ms).
    let held = tokio::time::timeout(Duration::from_millis(300), &mut publishing).await;
    anyhow::ensure!(held.is_err(), "the blocked producer finished: {held:?}");

    // Another producer, to another queue, is not held.
    let other = sandbox.connect().await?;
    let started = Instant::now();
    tokio::time::timeout(
        Duration::from_secs(10),
        publish_numbered(other.create_channel().await?, "free".into(), 200),
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
        wait_for(&mut events, false, Duration::from_secs(20)).await?;
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

/// The store quota the test configures: small, so 64 KiB messages fill it
/// quickly.
const STORE_QUOTA: &str = "[storage]\noverfull_size = \"4MiB\"\nunderfull_size = \"3MiB\"\n";
/// Most messages of 64 KiB published before the quota must have blocked.
const FILL_LIMIT: u64 = 2000;

/// 64 KiB of pseudo-random bytes per call (xorshift from a fixed seed).
fn noise() -> impl FnMut() -> Vec<u8> + Send {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    move || {
        (0..64 * 1024)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect()
    }
}

/// Publishes persistent 64 KiB messages to `durable`, each confirmed before
/// the next, until `stop` is set; returns how many it published.
///
/// Once the broker blocks the connection, lapin writes nothing more (not
/// even heartbeats), so the publish in flight is held until the connection
/// is unblocked: run this as a task and expect it to be held, never await it
/// without a deadline. It owns `connection` so the connection lives as long
/// as it publishes.
async fn fill_until_stopped(
    connection: Connection,
    channel: Channel,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<u64> {
    let mut noise = noise();
    let persistent = BasicProperties::default().with_delivery_mode(2);
    let mut published = 0u64;
    while !stop.load(Ordering::SeqCst) {
        anyhow::ensure!(
            published < FILL_LIMIT,
            "no block after {published} messages of 64 KiB"
        );
        let confirm = channel
            .basic_publish(
                "".into(),
                "durable".into(),
                BasicPublishOptions::default(),
                &noise(),
                persistent.clone(),
            )
            .await?;
        confirm.await?;
        published += 1;
        if published.is_multiple_of(16) {
            // Pacing, not a wait for a condition: bursts of 1 MiB leave the
            // store's quota check time to see the disk fill.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    drop(connection);
    Ok(published)
}

/// A small disk quota: persistent messages fill it, every producer is
/// blocked (a connection that only consumes is not, so it can free space);
/// a purge frees the space (the store flushes and compacts while overfull)
/// and releases them. Bodies are pseudo-random: compression alone cannot
/// bring the store back under its quota.
///
/// A blocked producer is held by design (see [`fill_until_stopped`]), so
/// both producers run as tasks and the test only ever waits with a deadline.
async fn the_store_quota_blocks_every_producer_until_space_is_freed(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let sandbox = Sandbox::start_with_config(wiring, STORE_QUOTA).await?;
    let filler = sandbox.connect().await?;
    let mut events = Box::pin(filler.events_listener());
    let channel = filler.create_channel().await?;
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
    let stop = Arc::new(AtomicBool::new(false));
    let mut filling = tokio::spawn(fill_until_stopped(filler, channel, stop.clone()));

    let blocked = tokio::select! {
        blocked = wait_for(&mut events, true, Duration::from_secs(60)) => blocked?,
        ended = &mut filling => anyhow::bail!("the producer ended before it was blocked: {ended:?}"),
    };
    // Held now, or at its next publish: it stops after the one it is on.
    stop.store(true, Ordering::SeqCst);
    let blocked = blocked.unwrap_or_default();
    anyhow::ensure!(blocked.contains("store"), "blocked for '{blocked}'");

    // Every producer is blocked, not only the one that filled the disk: one
    // that publishes now is told as soon as it does.
    let other = sandbox.connect().await?;
    let other_channel = other.create_channel().await?;
    let other_publish = tokio::spawn(async move {
        other_channel
            .basic_publish(
                "".into(),
                "durable".into(),
                BasicPublishOptions::default(),
                b"one",
                BasicProperties::default(),
            )
            .await
    });
    eventually(Duration::from_secs(10), || async {
        other.status().blocked()
    })
    .await
    .map_err(|error| error.context("a second producer was not blocked"))?;

    // A connection that only consumes is not blocked: it purges, which
    // frees the space and releases both producers.
    let consumer = sandbox.connect().await?;
    let admin = consumer.create_channel().await?;
    anyhow::ensure!(
        !consumer.status().blocked(),
        "a consumer-only connection was blocked"
    );
    tokio::time::timeout(
        Duration::from_secs(10),
        admin.queue_purge("durable".into(), QueuePurgeOptions::default()),
    )
    .await
    .map_err(|_| anyhow::anyhow!("the consumer-only connection's purge was held"))??;
    wait_for(&mut events, false, Duration::from_secs(30)).await?;
    eventually(Duration::from_secs(10), || async {
        !other.status().blocked()
    })
    .await
    .map_err(|error| error.context("the second producer was not released"))?;
    // Released, both held publishes complete.
    let published = tokio::time::timeout(Duration::from_secs(20), filling)
        .await
        .map_err(|_| anyhow::anyhow!("the released producer's publish did not complete"))???;
    tokio::time::timeout(Duration::from_secs(10), other_publish)
        .await
        .map_err(|_| anyhow::anyhow!("the second producer's publish did not complete"))???;
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

/// lapin writes nothing, heartbeats included, while it is blocked. The
/// gateway suspends heartbeat expiry for a blocked connection (as RabbitMQ
/// pauses its heartbeat monitor), so a producer held far longer than two
/// heartbeat intervals is still connected, and finishes once released.
async fn a_blocked_producer_outlives_its_heartbeat_timeout(wiring: Wiring) -> anyhow::Result<()> {
    const HEARTBEAT_SECS: u64 = 1;
    // Less than the 1 MiB overdraft: the gateway never stops reading this
    // producer, so it is the block alone that must suspend expiry.
    const COUNT: u64 = 400;
    let sandbox = Sandbox::start(wiring).await?;
    let setup = sandbox.connect().await?;
    declare(&setup, "capped", capacity_arguments(CAPACITY, RESUME)).await?;
    let uri = format!("{}?heartbeat={HEARTBEAT_SECS}", sandbox.amqp_uri());
    let producer = Connection::connect(&uri, lapin::ConnectionProperties::default()).await?;
    let mut events = Box::pin(producer.events_listener());
    let publishing = tokio::spawn(publish_numbered(
        producer.create_channel().await?,
        "capped".into(),
        COUNT,
    ));
    wait_for(&mut events, true, Duration::from_secs(20)).await?;

    // Blocked, lapin is silent for four heartbeat intervals: twice what
    // would count as dead if the block did not suspend expiry. What is
    // checked is that nothing happens meanwhile, so this wait is a fixed one.
    tokio::time::sleep(Duration::from_secs(4 * HEARTBEAT_SECS)).await;
    anyhow::ensure!(
        producer.status().connected() && producer.status().blocked(),
        "the blocked producer was dropped: {:?}",
        producer.status()
    );

    // Drained, it is released and finishes on the same connection.
    let consumer = sandbox.connect().await?;
    let channel = consumer.create_channel().await?;
    let mut deliveries = channel
        .basic_consume(
            "capped".into(),
            "drain".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    for expected in 0..COUNT {
        tokio::time::timeout(Duration::from_secs(20), deliveries.next())
            .await
            .map_err(|_| anyhow::anyhow!("stalled at message {expected}"))?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
    }
    tokio::time::timeout(Duration::from_secs(20), publishing)
        .await
        .map_err(|_| anyhow::anyhow!("the producer never finished"))???;
    anyhow::ensure!(
        producer.status().connected(),
        "disconnected after release: {:?}",
        producer.status()
    );
    // Whether lapin's close succeeds races its own close of the dropped
    // publishing channel; it is not what this test is about.
    let _ = producer.close(200, "done".into()).await;
    Ok(())
}
