//! `/metrics` and `/healthz` over real sockets, in both wirings: lapin
//! publishes and consumes, then the test scrapes the Prometheus text and
//! checks the gateway's counters and the engine's per-queue gauges. In the
//! separate wiring they come from different processes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use spillway_integration_tests::{both_wirings, eventually, http_get, Component, Sandbox, Wiring};

const QUEUE: &str = "metrics-q";
const PUBLISHED: usize = 7;
const CONSUMED: usize = 3;

both_wirings!(
    timeout_secs = 60;
    counters_and_gauges_are_served,
    rabbitmq_names_are_served_summed_and_per_object,
);

/// One sample of the text format: name, labels, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the Prometheus text format: `name{k="v",…} value` lines, comments
/// skipped, label values unescaped.
fn parse(text: &str) -> anyhow::Result<Vec<Sample>> {
    let mut samples = Vec::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .ok_or_else(|| anyhow::anyhow!("no value in {line:?}"))?;
        let value: f64 = value.parse()?;
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((name, rest)) => {
                let rest = rest
                    .strip_suffix('}')
                    .ok_or_else(|| anyhow::anyhow!("unclosed labels in {line:?}"))?;
                (name.to_string(), parse_labels(rest)?)
            }
        };
        samples.push(Sample {
            name,
            labels,
            value,
        });
    }
    Ok(samples)
}

fn parse_labels(mut rest: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    while !rest.is_empty() {
        let (key, after) = rest
            .split_once("=\"")
            .ok_or_else(|| anyhow::anyhow!("bad labels {rest:?}"))?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, other)) => value.push(other),
                    None => anyhow::bail!("bad escape in {after:?}"),
                },
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
                None => anyhow::bail!("unterminated label value in {after:?}"),
            }
        };
        labels.insert(key.to_string(), value);
        rest = after[end + 1..].trim_start_matches(',');
    }
    Ok(labels)
}

/// The value of the one sample named `name` whose labels include `labels`.
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let matching: Vec<&Sample> = samples
        .iter()
        .filter(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .collect();
    match matching.as_slice() {
        [one] => Some(one.value),
        _ => None,
    }
}

async fn scrape(sandbox: &Sandbox, component: Component) -> anyhow::Result<Vec<Sample>> {
    scrape_path(sandbox, component, "/metrics").await
}

async fn scrape_path(
    sandbox: &Sandbox,
    component: Component,
    path: &str,
) -> anyhow::Result<Vec<Sample>> {
    let addr = sandbox.metrics_addr(component)?;
    let (status, body) = http_get(addr, path).await?;
    anyhow::ensure!(status == 200, "GET {path} from {addr}: {status} {body}");
    parse(&body)
}

/// Scrapes until `check` passes (figures can trail the client by a moment:
/// a delivery is counted once the gateway's write returns), or fails with
/// the last scrape.
async fn scrape_until(
    sandbox: &Sandbox,
    component: Component,
    what: &str,
    check: impl Fn(&[Sample]) -> bool,
) -> anyhow::Result<Vec<Sample>> {
    eventually(Duration::from_secs(10), || async {
        let samples = scrape(sandbox, component).await?;
        if check(&samples) {
            return Ok(samples);
        }
        Err(anyhow::anyhow!("last scrape:\n{samples:#?}"))
    })
    .await
    .map_err(|error| error.context(format!("{what}: not seen on {component:?}'s /metrics")))
}

fn queue_value(samples: &[Sample], name: &str) -> Option<f64> {
    value(samples, name, &[("vhost", "/"), ("queue", QUEUE)])
}

async fn counters_and_gauges_are_served(sandbox: &mut Sandbox) -> anyhow::Result<()> {
    let separate = sandbox.wiring() == Wiring::Separate;
    for component in [Component::Gateway, Component::Engine, Component::Storage] {
        let addr = sandbox.metrics_addr(component)?;
        let (status, body) = http_get(addr, "/healthz").await?;
        anyhow::ensure!(
            (status, body.as_str()) == (200, "ok\n"),
            "{component:?} /healthz: {status} {body:?}"
        );
        let (status, _) = http_get(addr, "/nothing-here").await?;
        anyhow::ensure!(status == 404, "{component:?} /nothing-here: {status}");
    }
    if separate {
        anyhow::ensure!(
            sandbox.metrics_addr(Component::Gateway)? != sandbox.metrics_addr(Component::Engine)?,
            "gateway and engine should be separate processes"
        );
    }

    let conn = sandbox.connect().await?;
    let publisher = conn.create_channel().await?;
    publisher
        .queue_declare(
            QUEUE.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for i in 0..PUBLISHED {
        publisher
            .basic_publish(
                "".into(),
                QUEUE.into(),
                BasicPublishOptions::default(),
                format!("message-{i}").as_bytes(),
                BasicProperties::default(),
            )
            .await?
            .await?;
    }

    // Confirmed: the engine holds all seven, and the gateway counted them.
    let engine = scrape(sandbox, Component::Engine).await?;
    anyhow::ensure!(
        queue_value(&engine, "spillway_queue_messages") == Some(PUBLISHED as f64),
        "spillway_queue_messages after publishing: {:?}",
        queue_value(&engine, "spillway_queue_messages")
    );
    anyhow::ensure!(queue_value(&engine, "spillway_queue_unacked_messages") == Some(0.0));
    anyhow::ensure!(queue_value(&engine, "spillway_queue_consumers") == Some(0.0));
    let bytes_before = queue_value(&engine, "spillway_queue_bytes").unwrap_or_default();
    anyhow::ensure!(
        bytes_before >= (PUBLISHED * "message-0".len()) as f64,
        "spillway_queue_bytes {bytes_before}"
    );
    let gateway = scrape(sandbox, Component::Gateway).await?;
    let published = value(&gateway, "spillway_messages_published_total", &[]);
    anyhow::ensure!(
        published.is_some_and(|n| n >= PUBLISHED as f64),
        "spillway_messages_published_total {published:?}"
    );
    anyhow::ensure!(value(&gateway, "spillway_connections", &[]).is_some_and(|n| n >= 1.0));
    anyhow::ensure!(value(&gateway, "spillway_channels", &[]).is_some_and(|n| n >= 1.0));
    let storage = scrape(sandbox, Component::Storage).await?;
    anyhow::ensure!(
        value(&storage, "spillway_store_disk_bytes", &[]).is_some_and(|n| n > 0.0),
        "spillway_store_disk_bytes missing or zero"
    );
    if separate {
        // Each process shows the metrics of what it runs, and only those.
        anyhow::ensure!(value(&gateway, "spillway_queue_messages", &[("queue", QUEUE)]).is_none());
        anyhow::ensure!(value(&engine, "spillway_messages_published_total", &[]).is_none());
        anyhow::ensure!(value(&engine, "spillway_store_disk_bytes", &[]).is_none());
    }

    // Three deliveries held unacked (prefetch 3) by a consumer.
    let consumer_channel = conn.create_channel().await?;
    consumer_channel
        .basic_qos(CONSUMED as u16, BasicQosOptions::default())
        .await?;
    let mut consumer = consumer_channel
        .basic_consume(
            QUEUE.into(),
            "metrics-consumer".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut deliveries = Vec::new();
    while deliveries.len() < CONSUMED {
        let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
        deliveries.push(delivery);
    }
    scrape_until(
        sandbox,
        Component::Engine,
        "3 unacked, 4 ready, 1 consumer",
        |s| {
            queue_value(s, "spillway_queue_messages") == Some((PUBLISHED - CONSUMED) as f64)
                && queue_value(s, "spillway_queue_unacked_messages") == Some(CONSUMED as f64)
                && queue_value(s, "spillway_queue_consumers") == Some(1.0)
        },
    )
    .await?;
    scrape_until(sandbox, Component::Gateway, "3 delivered", |s| {
        value(s, "spillway_messages_delivered_total", &[]).is_some_and(|n| n >= CONSUMED as f64)
    })
    .await?;

    // Cancel first so that the acks free no room for more deliveries.
    consumer_channel
        .basic_cancel("metrics-consumer".into(), BasicCancelOptions::default())
        .await?;
    for delivery in &deliveries {
        delivery.ack(BasicAckOptions::default()).await?;
    }
    let engine = scrape_until(sandbox, Component::Engine, "4 ready, none unacked", |s| {
        queue_value(s, "spillway_queue_messages") == Some((PUBLISHED - CONSUMED) as f64)
            && queue_value(s, "spillway_queue_unacked_messages") == Some(0.0)
            && queue_value(s, "spillway_queue_consumers") == Some(0.0)
    })
    .await?;
    // Every message has the same size: four sevenths of the bytes remain.
    let bytes_after = queue_value(&engine, "spillway_queue_bytes").unwrap_or_default();
    anyhow::ensure!(
        bytes_after * PUBLISHED as f64 == bytes_before * (PUBLISHED - CONSUMED) as f64,
        "spillway_queue_bytes went from {bytes_before} to {bytes_after}"
    );
    scrape_until(sandbox, Component::Gateway, "3 acknowledged", |s| {
        value(s, "spillway_messages_acknowledged_total", &[]).is_some_and(|n| n >= CONSUMED as f64)
    })
    .await?;

    // A deleted queue leaves the scrape; closed channels and connections
    // leave the gauges.
    publisher
        .queue_delete(QUEUE.into(), QueueDeleteOptions::default())
        .await?;
    scrape_until(sandbox, Component::Engine, "the queue gone", |s| {
        queue_value(s, "spillway_queue_messages").is_none()
    })
    .await?;
    conn.close(200, "bye".into()).await?;
    scrape_until(sandbox, Component::Gateway, "no connection open", |s| {
        value(s, "spillway_connections", &[]) == Some(0.0)
            && value(s, "spillway_channels", &[]) == Some(0.0)
    })
    .await?;
    Ok(())
}

/// RabbitMQ's Prometheus names, as its plugin serves them: `/metrics` sums
/// the per-queue families over the queues, `/metrics/per-object` has one
/// sample per queue; the identity series names the node.
async fn rabbitmq_names_are_served_summed_and_per_object(
    sandbox: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sandbox.connect().await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for (queue, count) in [("rabbit-a", 3), ("rabbit-b", 4)] {
        channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await?;
        for _ in 0..count {
            channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    b"x",
                    BasicProperties::default(),
                )
                .await?
                .await?;
        }
    }
    let summed = scrape(sandbox, Component::Engine).await?;
    let unlabelled = |name: &str| {
        summed
            .iter()
            .find(|s| s.name == name && s.labels.is_empty())
            .map(|s| s.value)
    };
    anyhow::ensure!(unlabelled("rabbitmq_queue_messages_ready") == Some(7.0));
    anyhow::ensure!(unlabelled("rabbitmq_queue_messages") == Some(7.0));
    anyhow::ensure!(unlabelled("rabbitmq_queue_messages_unacked") == Some(0.0));
    anyhow::ensure!(unlabelled("rabbitmq_queues") == Some(2.0));
    anyhow::ensure!(
        !summed
            .iter()
            .any(|s| s.name.starts_with("rabbitmq_queue_") && s.labels.contains_key("queue")),
        "/metrics has per-queue rabbitmq_queue_* samples"
    );

    let per_object = scrape_path(sandbox, Component::Engine, "/metrics/per-object").await?;
    for (queue, count) in [("rabbit-a", 3.0), ("rabbit-b", 4.0)] {
        let ready = value(
            &per_object,
            "rabbitmq_queue_messages_ready",
            &[("vhost", "/"), ("queue", queue)],
        );
        anyhow::ensure!(ready == Some(count), "{queue}: {ready:?}");
    }
    // The rest of the registry is served there too, once.
    anyhow::ensure!(
        per_object
            .iter()
            .filter(|s| s.name == "rabbitmq_queues")
            .count()
            == 1
    );

    // /metrics/detailed: the asked families only, renamed as RabbitMQ's plugin.
    let detailed = scrape_path(
        sandbox,
        Component::Engine,
        "/metrics/detailed?vhost=%2F&family=queue_coarse_metrics",
    )
    .await?;
    let ready = value(
        &detailed,
        "rabbitmq_detailed_queue_messages_ready",
        &[("vhost", "/"), ("queue", "rabbit-b")],
    );
    anyhow::ensure!(ready == Some(4.0), "detailed: {ready:?}");
    anyhow::ensure!(
        detailed
            .iter()
            .all(|s| s.name.starts_with("rabbitmq_detailed_queue_messages")),
        "detailed serves only the asked family"
    );
    let none = scrape_path(sandbox, Component::Engine, "/metrics/detailed").await?;
    anyhow::ensure!(none.is_empty(), "no family asked, none served");

    let gateway = scrape(sandbox, Component::Gateway).await?;
    let received = value(&gateway, "rabbitmq_global_messages_received_total", &[]);
    anyhow::ensure!(received == Some(7.0), "received: {received:?}");
    anyhow::ensure!(value(&gateway, "rabbitmq_connections", &[]) == Some(1.0));
    anyhow::ensure!(value(&gateway, "rabbitmq_channels", &[]) == Some(1.0));
    let identity = gateway
        .iter()
        .find(|s| s.name == "rabbitmq_identity_info")
        .context("no rabbitmq_identity_info")?;
    anyhow::ensure!(identity.value == 1.0);
    anyhow::ensure!(
        identity
            .labels
            .get("rabbitmq_node")
            .is_some_and(|node| node.starts_with("spillway@"))
            && identity.labels.contains_key("rabbitmq_cluster"),
        "{:?}",
        identity.labels
    );
    conn.close(200, "bye".into()).await?;
    Ok(())
}
