//! The memory ceiling (`engine.memory_high_watermark`, docs/limits.md) through
//! real clients in both wirings. Publishes held by an open transaction cannot
//! flow to disk, so they take what the broker holds for clients over the
//! watermark: every connection that has published is blocked (lapin hears
//! `connection.blocked`), a new connection is refused with 506 naming the
//! watermark, and a connection that only consumes goes on. Closing the
//! transaction's connection rolls it back: the ceiling clears, publishers are
//! unblocked and new connections are served again.

use std::time::Duration;

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use spillway_integration_tests::{
    both_wirings, eventually, http_get, metric_value, Component, Sandbox, Wiring,
};
use spillway_proto::management as m;

both_wirings!(
    own_sandbox, timeout_secs = 90;
    past_the_watermark_publishers_are_blocked_and_connections_refused,
);

/// Flow to disk from 1 MiB, the ceiling at 4 MiB: three uncommitted 1.5 MiB
/// publishes pass it, two do not.
const CONFIG: &str = "[engine]\n\
    flow_to_disk_threshold = \"1MiB\"\n\
    memory_high_watermark = \"4MiB\"\n\
    housekeeping_interval = \"100ms\"\n";

const QUEUE: &str = "ceiling.work";

async fn metrics_of(sandbox: &Sandbox, component: Component) -> anyhow::Result<String> {
    let (status, text) = http_get(sandbox.metrics_addr(component)?, "/metrics").await?;
    anyhow::ensure!(status == 200, "/metrics answered {status}");
    Ok(text)
}

async fn past_the_watermark_publishers_are_blocked_and_connections_refused(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let sandbox = Sandbox::start_with_config(wiring, CONFIG).await?;
    // A connection that only consumes, and one that publishes small
    // confirmed messages.
    let consumer = sandbox.connect().await?;
    let consuming = consumer.create_channel().await?;
    consuming
        .queue_declare(
            QUEUE.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let publisher = sandbox.connect().await?;
    let publishing = publisher.create_channel().await?;
    publishing
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let confirm = publishing
        .basic_publish(
            "".into(),
            QUEUE.into(),
            BasicPublishOptions::default(),
            b"before the ceiling",
            BasicProperties::default(),
        )
        .await?
        .await?;
    anyhow::ensure!(confirm.is_ack(), "the first publish was not confirmed");

    // The transaction holds 4.5 MiB that cannot be spilled.
    let holder = lapin::Connection::connect(
        &sandbox.amqp_uri(),
        lapin::ConnectionProperties::default().with_connection_name("ceiling-holder".into()),
    )
    .await?;
    let held = holder.create_channel().await?;
    held.tx_select().await?;
    let body = vec![7u8; 3 << 19];
    for _ in 0..3 {
        held.basic_publish(
            "".into(),
            QUEUE.into(),
            BasicPublishOptions::default(),
            &body,
            BasicProperties::default(),
        )
        .await?;
    }

    // Every connection that has published is blocked, and told so.
    eventually(Duration::from_secs(10), || async {
        publisher.status().blocked() && holder.status().blocked()
    })
    .await?;
    anyhow::ensure!(
        !consumer.status().blocked(),
        "a connection that never published was blocked"
    );
    let engine_metrics = metrics_of(&sandbox, Component::Engine).await?;
    anyhow::ensure!(
        metric_value(&engine_metrics, "spillway_memory_alarm") == Some(1.0),
        "the alarm is not shown:\n{engine_metrics}"
    );
    // What the alarm compares with the watermark is the sum over the
    // process's parts. In-process that includes the gateway's, so the third
    // held publish may still be on its way through the gateway (its body
    // unfinished) when every publisher is blocked: then the engine holds two
    // of them. Apart, the engine's process counts only its messages, so all
    // three have reached it.
    let held: f64 = engine_metrics
        .lines()
        .filter(|line| line.starts_with("spillway_memory_held_bytes{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    anyhow::ensure!(
        held > f64::from(4u32 << 20),
        "bytes held for clients: {held}, with the alarm on:\n{engine_metrics}"
    );
    let messages = metric_value(
        &engine_metrics,
        "spillway_memory_held_bytes{part=\"messages\"}",
    )
    .unwrap_or_default();
    let held_publishes = match wiring {
        Wiring::Separate => 3,
        Wiring::InProcess | Wiring::AllInOneProcess => 2,
    };
    anyhow::ensure!(
        messages >= f64::from(held_publishes * (3u32 << 19)),
        "message bytes held: {messages}, not the {held_publishes} held publishes"
    );

    // A new connection is refused, saying why.
    let refused = match sandbox.connect().await {
        Ok(_) => anyhow::bail!("a connection was accepted past the memory ceiling"),
        Err(error) => format!("{error:#}"),
    };
    anyhow::ensure!(
        refused.contains("RESOURCE_ERROR")
            && refused.contains("memory high watermark reached")
            && refused.contains("engine.memory_high_watermark"),
        "refused with: {refused}"
    );
    // Counted by the process that refused: the gateway in-process, the
    // engine when apart (the gateway's own ceiling holds little).
    let refusals = metrics_of(&sandbox, Component::Engine).await?
        + &metrics_of(&sandbox, Component::Gateway).await?;
    let counted: f64 = refusals
        .lines()
        .filter(|line| {
            line.starts_with("spillway_limit_refusals_total{limit=\"memory_high_watermark\"}")
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    anyhow::ensure!(counted >= 1.0, "the refusal is not counted:\n{refusals}");

    // The consumer goes on: it takes and acks the confirmed message.
    let got = consuming
        .basic_get(QUEUE.into(), BasicGetOptions::default())
        .await?
        .ok_or_else(|| anyhow::anyhow!("the consumer got nothing during the alarm"))?;
    anyhow::ensure!(got.delivery.data == b"before the ceiling");
    got.delivery.ack(BasicAckOptions::default()).await?;

    // Closing the transaction's connection rolls it back: the ceiling
    // clears and everyone is served again.
    let mut management = sandbox.management().await?;
    let connections = management
        .list_connections(m::ListConnectionsRequest::default())
        .await?
        .into_inner()
        .connections;
    let holder_id = connections
        .iter()
        .find(|c| {
            c.client_properties
                .get("connection_name")
                .and_then(|v| v.value.as_ref())
                == Some(&m::argument_value::Value::StringValue(
                    "ceiling-holder".into(),
                ))
        })
        .map(|c| c.id)
        .ok_or_else(|| anyhow::anyhow!("the holder is not listed: {connections:?}"))?;
    management
        .close_connection(m::CloseConnectionRequest {
            id: holder_id,
            reason: "memory ceiling test".into(),
        })
        .await?;
    eventually(Duration::from_secs(10), || async {
        !publisher.status().blocked()
    })
    .await?;
    let confirm = publishing
        .basic_publish(
            "".into(),
            QUEUE.into(),
            BasicPublishOptions::default(),
            b"after the ceiling",
            BasicProperties::default(),
        )
        .await?
        .await?;
    anyhow::ensure!(
        confirm.is_ack(),
        "the publish after the alarm was not confirmed"
    );
    let later = eventually(Duration::from_secs(10), || sandbox.connect()).await?;
    let engine_metrics = metrics_of(&sandbox, Component::Engine).await?;
    anyhow::ensure!(
        metric_value(&engine_metrics, "spillway_memory_alarm") == Some(0.0),
        "the alarm is still shown:\n{engine_metrics}"
    );
    for connection in [later, publisher, consumer] {
        connection.close(200, "bye".into()).await?;
    }
    Ok(())
}
