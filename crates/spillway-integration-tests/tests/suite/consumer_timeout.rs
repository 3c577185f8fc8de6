//! `engine.consumer_timeout` through lapin, in both wirings: a consumer that
//! leaves deliveries unacknowledged past the timeout has its channel closed
//! with 406 PRECONDITION_FAILED, as RabbitMQ does, and the messages go back
//! to the queue for the next consumer, flagged redelivered. A consumer that
//! acks in time is not touched.

use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use spillway_integration_tests::{both_wirings, consumer_timed_out, Sandbox, Wiring};

both_wirings!(
    own_sandbox, timeout_secs = 60;
    unacked_deliveries_past_the_consumer_timeout_close_the_channel,
);

const TIMEOUT: Duration = Duration::from_secs(1);

async fn unacked_deliveries_past_the_consumer_timeout_close_the_channel(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let config = "[engine]\nconsumer_timeout = \"1s\"\nhousekeeping_interval = \"100ms\"\n";
    let sandbox = Sandbox::start_with_config(wiring, config).await?;
    let connection = sandbox.connect().await?;
    let setup = connection.create_channel().await?;
    for queue in ["stuck", "prompt"] {
        setup
            .queue_declare(queue.into(), Default::default(), FieldTable::default())
            .await?;
        for n in 0..3u8 {
            setup
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    &[n],
                    BasicProperties::default(),
                )
                .await?;
        }
    }

    // A consumer that acks each delivery at once, on its own channel.
    let prompt = connection.create_channel().await?;
    let mut prompt_deliveries = prompt
        .basic_consume(
            "prompt".into(),
            "prompt".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;

    // A consumer that never acks.
    let stuck = connection.create_channel().await?;
    let mut deliveries = stuck
        .basic_consume(
            "stuck".into(),
            "stuck".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut first_delivered = None;
    for _ in 0..3 {
        tokio::time::timeout(Duration::from_secs(10), deliveries.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
        first_delivered.get_or_insert_with(Instant::now);
    }
    for _ in 0..3 {
        let delivery = tokio::time::timeout(Duration::from_secs(10), prompt_deliveries.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("prompt consumer ended"))??;
        delivery.acker.ack(BasicAckOptions::default()).await?;
    }

    // The stuck channel is closed with 406 once the timeout has passed.
    consumer_timed_out(&mut deliveries, Duration::from_secs(10)).await?;
    let waited = first_delivered.map(|at| at.elapsed()).unwrap_or_default();
    anyhow::ensure!(waited >= TIMEOUT, "closed {waited:?} after delivery");

    // The prompt consumer's channel is still open and served.
    anyhow::ensure!(
        prompt.status().connected(),
        "the prompt channel was closed too"
    );

    // The three come back to the next consumer, flagged redelivered.
    let again = connection.create_channel().await?;
    let mut redeliveries = again
        .basic_consume(
            "stuck".into(),
            "again".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    for n in 0..3u8 {
        let delivery = tokio::time::timeout(Duration::from_secs(10), redeliveries.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
        anyhow::ensure!(
            delivery.data == [n],
            "message {n} came back as {:?}",
            delivery.data
        );
        anyhow::ensure!(delivery.redelivered, "message {n} not flagged redelivered");
        delivery.acker.ack(BasicAckOptions::default()).await?;
    }
    connection.close(200, "bye".into()).await?;
    Ok(())
}
