//! Publisher pacing through lapin, in both wirings
//! (docs/flow-control.md#publisher-pacing): a publisher running flat out
//! into a queue whose consumer acks slowly is held to the consumer's pace,
//! so the queue stays within the window; a consumer that stopped taking
//! messages does not hold it; a connection that publishes and consumes on
//! itself does not deadlock; window 0 is the old behaviour.
//!
//! Pacing is TCP back-pressure only: no connection.blocked, no
//! channel.flow, so lapin keeps writing (its acks included) and simply
//! waits on the socket.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use spillway_integration_tests::{both_wirings, eventually, Sandbox, Wiring};

both_wirings!(
    own_sandbox, timeout_secs = 180;
    a_slow_consumer_keeps_the_queue_within_the_window,
    a_consumer_that_stopped_does_not_hold_the_publisher,
    publishing_and_consuming_on_one_connection_does_not_deadlock,
    window_zero_does_not_pace,
);

const WINDOW: u64 = 100;
const PREFETCH: u16 = 20;
const SIZE: usize = 256;

/// Window 100; a stall long enough that a consumer descheduled on a busy
/// machine does not suspend pacing (the depth bound would not hold then).
const PACED: &str = "[engine]\npublisher_pacing_window = 100\npublisher_pacing_stall = \"3s\"\n";
/// Window 100, the default stall (100 ms).
const PACED_DEFAULT_STALL: &str = "[engine]\npublisher_pacing_window = 100\n";
const OFF: &str = "[engine]\npublisher_pacing_window = 0\n";

async fn declare(connection: &Connection, queue: &str) -> anyhow::Result<()> {
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    channel.close(200, "declared".into()).await?;
    Ok(())
}

/// Publishes `count` numbered messages with confirms, as fast as lapin
/// writes them, and waits for every confirm.
async fn publish_numbered(channel: Channel, queue: String, count: u64) -> anyhow::Result<()> {
    spillway_integration_tests::amqp::publish_numbered(channel, queue, count, SIZE).await
}

/// A consumer on `channel` with prefetch [`PREFETCH`] that checks the order
/// and acks each message, after `delay` when given; returns after `count`.
async fn consume_in_order(
    channel: Channel,
    queue: String,
    count: u64,
    delay: Option<Duration>,
) -> anyhow::Result<()> {
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            queue.as_str().into(),
            "paced".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    for expected in 0..count {
        let delivery = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
            .await
            .map_err(|_| anyhow::anyhow!("stalled at message {expected}"))?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
        let seq = u64::from_be_bytes(delivery.data[..8].try_into()?);
        anyhow::ensure!(seq == expected, "expected message {expected}, got {seq}");
        if let Some(delay) = delay {
            // The slow consumer itself, not a wait for a condition.
            tokio::time::sleep(delay).await;
        }
        delivery.acker.ack(BasicAckOptions::default()).await?;
    }
    Ok(())
}

fn queue_gauge(name: &str, queue: &str) -> String {
    format!("{name}{{vhost=\"/\",queue=\"{queue}\"}}")
}

/// Ready + unacked messages of `queue`, from the engine's metrics.
async fn depth(sandbox: &Sandbox, queue: &str) -> anyhow::Result<u64> {
    let ready = sandbox
        .engine_metric(&queue_gauge("spillway_queue_messages", queue))
        .await?;
    let unacked = sandbox
        .engine_metric(&queue_gauge("spillway_queue_unacked_messages", queue))
        .await?;
    Ok((ready + unacked) as u64)
}

async fn a_slow_consumer_keeps_the_queue_within_the_window(wiring: Wiring) -> anyhow::Result<()> {
    const MESSAGES: u64 = 2000;
    let sandbox = Sandbox::start_with_config(wiring, PACED).await?;
    let setup = sandbox.connect().await?;
    declare(&setup, "slow").await?;
    let consumer = sandbox.connect().await?;
    let consuming = tokio::spawn(consume_in_order(
        consumer.create_channel().await?,
        "slow".into(),
        MESSAGES,
        Some(Duration::from_millis(1)),
    ));
    // The consumer is attached before the first publish.
    eventually(Duration::from_secs(10), || async {
        sandbox
            .engine_metric(&queue_gauge("spillway_queue_consumers", "slow"))
            .await
            .ok()
            .filter(|consumers| *consumers == 1.0)
    })
    .await?;
    let producer = sandbox.connect().await?;
    let publishing = tokio::spawn(publish_numbered(
        producer.create_channel().await?,
        "slow".into(),
        MESSAGES,
    ));

    // Sampled while both run: the queue never holds much more than the
    // window plus the consumer's prefetch.
    let mut deepest = 0;
    let mut samples = 0u32;
    while !consuming.is_finished() {
        if let Ok(depth) = depth(&sandbox, "slow").await {
            deepest = deepest.max(depth);
            samples += 1;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    consuming.await??;
    tokio::time::timeout(Duration::from_secs(30), publishing)
        .await
        .map_err(|_| anyhow::anyhow!("the producer never finished"))???;
    // A few publishes in flight on the session as the credit runs out.
    let bound = WINDOW + u64::from(PREFETCH) + 10;
    anyhow::ensure!(
        deepest <= bound,
        "the queue held {deepest} messages (bound {bound}, {samples} samples)"
    );
    let waits = sandbox
        .engine_metric("spillway_publisher_pacing_waits_total")
        .await?;
    anyhow::ensure!(waits >= 1.0, "the publisher was never paced");
    let stalls = sandbox
        .engine_metric("spillway_publisher_pacing_stalls_total")
        .await?;
    anyhow::ensure!(stalls == 0.0, "{stalls} stalls with a live consumer");
    Ok(())
}

async fn a_consumer_that_stopped_does_not_hold_the_publisher(wiring: Wiring) -> anyhow::Result<()> {
    const MESSAGES: u64 = 3000;
    let sandbox = Sandbox::start_with_config(wiring, PACED_DEFAULT_STALL).await?;
    let setup = sandbox.connect().await?;
    declare(&setup, "stuck").await?;
    // Takes its prefetch and never acks.
    let consumer = sandbox.connect().await?;
    let channel = consumer.create_channel().await?;
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await?;
    let _deliveries = channel
        .basic_consume(
            "stuck".into(),
            "stuck".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let producer = sandbox.connect().await?;
    let started = Instant::now();
    // Held at most one stall period (100 ms) per run of deliveries, and
    // the consumer delivers nothing after its prefetch: far below
    // MESSAGES × 100 ms.
    tokio::time::timeout(
        Duration::from_secs(30),
        publish_numbered(producer.create_channel().await?, "stuck".into(), MESSAGES),
    )
    .await
    .map_err(|_| anyhow::anyhow!("the publisher was held by a consumer that stopped"))??;
    let took = started.elapsed();
    anyhow::ensure!(took < Duration::from_secs(20), "took {took:?}");
    let depth = depth(&sandbox, "stuck").await?;
    anyhow::ensure!(depth == MESSAGES, "{depth} messages in the queue");
    let stalls = sandbox
        .engine_metric("spillway_publisher_pacing_stalls_total")
        .await?;
    anyhow::ensure!(stalls >= 1.0, "no stall counted");
    Ok(())
}

async fn publishing_and_consuming_on_one_connection_does_not_deadlock(
    wiring: Wiring,
) -> anyhow::Result<()> {
    const MESSAGES: u64 = 3000;
    let sandbox = Sandbox::start_with_config(wiring, PACED_DEFAULT_STALL).await?;
    let connection = sandbox.connect().await?;
    declare(&connection, "both").await?;
    let consuming = tokio::spawn(consume_in_order(
        connection.create_channel().await?,
        "both".into(),
        MESSAGES,
        None,
    ));
    eventually(Duration::from_secs(10), || async {
        sandbox
            .engine_metric(&queue_gauge("spillway_queue_consumers", "both"))
            .await
            .ok()
            .filter(|consumers| *consumers == 1.0)
    })
    .await?;
    let publishing = publish_numbered(connection.create_channel().await?, "both".into(), MESSAGES);
    tokio::time::timeout(Duration::from_secs(60), publishing)
        .await
        .map_err(|_| anyhow::anyhow!("the publisher deadlocked"))??;
    tokio::time::timeout(Duration::from_secs(60), consuming)
        .await
        .map_err(|_| anyhow::anyhow!("the consumer deadlocked"))???;
    Ok(())
}

async fn window_zero_does_not_pace(wiring: Wiring) -> anyhow::Result<()> {
    const MESSAGES: u64 = 2000;
    let sandbox = Sandbox::start_with_config(wiring, OFF).await?;
    let setup = sandbox.connect().await?;
    declare(&setup, "free").await?;
    let consumer = sandbox.connect().await?;
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let consuming = {
        let channel = consumer.create_channel().await?;
        let (acked, stop) = (acked.clone(), stop.clone());
        tokio::spawn(async move {
            channel
                .basic_qos(PREFETCH, BasicQosOptions::default())
                .await?;
            let mut deliveries = channel
                .basic_consume(
                    "free".into(),
                    "free".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            // Slow: one ack every 20 ms, until told to stop.
            while !stop.load(Ordering::Relaxed) {
                let Ok(Some(delivery)) =
                    tokio::time::timeout(Duration::from_millis(200), deliveries.next()).await
                else {
                    continue;
                };
                tokio::time::sleep(Duration::from_millis(20)).await;
                delivery?.acker.ack(BasicAckOptions::default()).await?;
                acked.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        })
    };
    let producer = sandbox.connect().await?;
    tokio::time::timeout(
        Duration::from_secs(30),
        publish_numbered(producer.create_channel().await?, "free".into(), MESSAGES),
    )
    .await
    .map_err(|_| anyhow::anyhow!("the publisher was held with pacing off"))??;
    stop.store(true, Ordering::Relaxed);
    consuming.await??;
    // Everything but what the slow consumer took is in the queue (once its
    // last acks are in).
    let taken = acked.load(Ordering::Relaxed);
    let depth = eventually(Duration::from_secs(10), || async {
        depth(&sandbox, "free")
            .await
            .ok()
            .filter(|depth| depth + taken == MESSAGES)
    })
    .await?;
    anyhow::ensure!(depth > WINDOW * 2, "only {depth} in the queue");
    let waits = sandbox
        .engine_metric("spillway_publisher_pacing_waits_total")
        .await?;
    anyhow::ensure!(waits == 0.0, "paced {waits} times with pacing off");
    Ok(())
}
