//! Priority queues (`x-max-priority`), as RabbitMQ documents them: higher
//! priorities are delivered first, equal priorities in publish order; a
//! priority above the maximum counts as the maximum, none as 0. They flow to
//! disk like any queue, read-ahead bringing the highest priorities back
//! first, and persistent messages keep their priority across a restart. The
//! argument is checked with RabbitMQ's refusals.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use futures::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use spillway_integration_tests::amqp::{amqp_code, get, s, table, text};
use spillway_integration_tests::{both_wirings, eventually, Sandbox, Wiring};
use spillway_proto::management as m;

both_wirings!(
    own_sandbox, timeout_secs = 240;
    higher_priorities_go_first_and_equal_ones_in_order,
    the_maximum_is_checked_as_rabbitmq_checks_it,
    persistent_messages_keep_their_priority_across_a_restart,
    a_spilled_backlog_drains_highest_priority_first,
);

const MIB: u64 = 1 << 20;

fn max_priority(max: i64) -> FieldTable {
    table(&[("x-max-priority", AMQPValue::LongLongInt(max))])
}

async fn declare(ch: &Channel, name: &str, durable: bool, max: i64) -> anyhow::Result<()> {
    ch.queue_declare(
        s(name),
        QueueDeclareOptions {
            durable,
            ..Default::default()
        },
        max_priority(max),
    )
    .await?;
    Ok(())
}

/// Publishes `body` with `priority` (None: no priority property) and waits
/// for its confirm.
async fn publish(
    ch: &Channel,
    queue: &str,
    body: &[u8],
    priority: Option<u8>,
    persistent: bool,
) -> anyhow::Result<()> {
    let mut properties = BasicProperties::default();
    if let Some(priority) = priority {
        properties = properties.with_priority(priority);
    }
    if persistent {
        properties = properties.with_delivery_mode(2);
    }
    let confirm = ch
        .basic_publish(
            s(""),
            s(queue),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await?
        .await?;
    anyhow::ensure!(confirm.is_ack(), "publish nacked");
    Ok(())
}

/// Takes every message of `queue` with basic.get (acked), in order.
async fn drain(ch: &Channel, queue: &str, count: usize) -> anyhow::Result<Vec<Vec<u8>>> {
    let mut bodies = Vec::new();
    for _ in 0..count {
        let message = get(ch, queue).await?;
        message.delivery.ack(BasicAckOptions::default()).await?;
        bodies.push(message.delivery.data);
    }
    Ok(bodies)
}

fn bodies(names: &[&str]) -> Vec<Vec<u8>> {
    names.iter().map(|name| name.as_bytes().to_vec()).collect()
}

/// The order a priority queue with maximum 10 gives these, as RabbitMQ
/// gives it.
const PUBLISHED: [(&str, Option<u8>); 8] = [
    ("none-1", None),
    ("p5-1", Some(5)),
    ("p10-1", Some(10)),
    ("p200", Some(200)),
    ("p0", Some(0)),
    ("p5-2", Some(5)),
    ("p3", Some(3)),
    ("none-2", None),
];
const DELIVERED: [&str; 8] = [
    "p10-1", "p200", "p5-1", "p5-2", "p3", "none-1", "p0", "none-2",
];

async fn higher_priorities_go_first_and_equal_ones_in_order(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox = Sandbox::start(wiring).await?;
    let conn = sandbox.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    declare(&ch, "prio.order", false, 10).await?;
    for (body, priority) in PUBLISHED {
        publish(&ch, "prio.order", body.as_bytes(), priority, false).await?;
    }
    assert_eq!(drain(&ch, "prio.order", 8).await?, bodies(&DELIVERED));

    // A consumer with prefetch 1 busy on one message: what is published
    // meanwhile comes to it by priority, not by arrival.
    publish(&ch, "prio.order", b"first", Some(1), false).await?;
    let consumer_ch = conn.create_channel().await?;
    consumer_ch.basic_qos(1, BasicQosOptions::default()).await?;
    let mut consumer = consumer_ch
        .basic_consume(
            s("prio.order"),
            s("c"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let first = consumer.next().await.expect("a delivery")?;
    assert_eq!(first.data, b"first");
    for (body, priority) in [("low", 1), ("high", 9), ("mid", 4)] {
        publish(&ch, "prio.order", body.as_bytes(), Some(priority), false).await?;
    }
    first.ack(BasicAckOptions::default()).await?;
    let mut order = Vec::new();
    for _ in 0..3 {
        let delivery = consumer.next().await.expect("a delivery")?;
        order.push(String::from_utf8(delivery.data.clone())?);
        delivery.ack(BasicAckOptions::default()).await?;
    }
    assert_eq!(order, ["high", "mid", "low"]);
    conn.close(200, s("bye")).await?;
    Ok(())
}

async fn the_maximum_is_checked_as_rabbitmq_checks_it(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox = Sandbox::start(wiring).await?;
    let conn = sandbox.connect().await?;
    for (name, argument) in [
        ("prio.too-high", AMQPValue::LongLongInt(256)),
        ("prio.negative", AMQPValue::LongInt(-1)),
        ("prio.text", text("5")),
    ] {
        let ch = conn.create_channel().await?;
        let refused = ch
            .queue_declare(
                s(name),
                QueueDeclareOptions::default(),
                table(&[("x-max-priority", argument)]),
            )
            .await
            .expect_err("refused");
        assert_eq!(amqp_code(&refused), Some(406), "{name}");
    }
    let ch = conn.create_channel().await?;
    declare(&ch, "prio.kept", false, 255).await?;
    declare(&ch, "prio.kept", false, 255).await?;
    let refused = ch
        .queue_declare(
            s("prio.kept"),
            QueueDeclareOptions::default(),
            max_priority(5),
        )
        .await
        .expect_err("a redeclare with another maximum is refused");
    assert_eq!(amqp_code(&refused), Some(406));
    Ok(())
}

async fn persistent_messages_keep_their_priority_across_a_restart(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let mut sandbox = Sandbox::start(wiring).await?;
    let conn = sandbox.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    declare(&ch, "prio.durable", true, 10).await?;
    for (body, priority) in PUBLISHED {
        publish(&ch, "prio.durable", body.as_bytes(), priority, true).await?;
    }
    // Taken and requeued: back in its place, priority and all.
    let taken = get(&ch, "prio.durable").await?;
    assert_eq!(taken.delivery.data, b"p10-1");
    taken
        .delivery
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await?;
    conn.close(200, s("bye")).await?;

    if wiring == Wiring::InProcess {
        sandbox.restart().await?;
    } else {
        sandbox.kill_and_restart().await?;
    }
    sandbox.wait_for_recovery().await?;

    let conn = sandbox.connect().await?;
    let ch = conn.create_channel().await?;
    // Published after the restart, behind the recovered ones of its priority.
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    publish(&ch, "prio.durable", b"p5-after", Some(5), true).await?;
    let mut expected = bodies(&DELIVERED);
    expected.insert(4, b"p5-after".to_vec());
    assert_eq!(drain(&ch, "prio.durable", 9).await?, expected);
    Ok(())
}

/// Each message's body: its sequence number and priority, then padding.
fn numbered(seq: u32, priority: u8, size: usize) -> Vec<u8> {
    let mut body = vec![priority; size];
    body[..4].copy_from_slice(&seq.to_be_bytes());
    body
}

async fn a_spilled_backlog_drains_highest_priority_first(wiring: Wiring) -> anyhow::Result<()> {
    const THRESHOLD: u64 = 8 * MIB;
    const SIZE: usize = 8 * 1024;
    const COUNT: u32 = 5_000; // 40 MiB: five times the threshold
    let config = format!(
        "[engine]\nflow_to_disk_threshold = {THRESHOLD}\nhousekeeping_interval = \"100ms\"\n"
    );
    let sandbox = Sandbox::start_with_config(wiring, &config).await?;
    let conn = sandbox.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    declare(&ch, "prio.spill", false, 9).await?;
    let mut confirms = Vec::new();
    for seq in 0..COUNT {
        // A spread of priorities, not in any order.
        let priority = ((seq * 7 + seq / 13) % 10) as u8;
        let confirm = ch
            .basic_publish(
                s(""),
                s("prio.spill"),
                BasicPublishOptions::default(),
                &numbered(seq, priority, SIZE),
                BasicProperties::default().with_priority(priority),
            )
            .await?;
        confirms.push(confirm);
    }
    for confirm in confirms {
        anyhow::ensure!(confirm.await?.is_ack(), "publish nacked");
    }
    let management = sandbox.management().await?;
    let spilled = eventually(Duration::from_secs(10), || async {
        let queue = management
            .clone()
            .get_queue(m::GetQueueRequest {
                vhost: "/".into(),
                name: "prio.spill".into(),
            })
            .await
            .ok()?
            .into_inner();
        let status = queue.status?;
        (status.spilled_bytes > 4 * THRESHOLD).then_some(status.spilled_bytes)
    })
    .await?;
    assert!(spilled > 0);

    let consumer_ch = conn.create_channel().await?;
    consumer_ch
        .basic_qos(50, BasicQosOptions::default())
        .await?;
    let mut consumer = consumer_ch
        .basic_consume(
            s("prio.spill"),
            s("drain"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut last: Option<(u8, u32)> = None;
    for _ in 0..COUNT {
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await?
            .expect("a delivery")?;
        let seq = u32::from_be_bytes(delivery.data[..4].try_into()?);
        let priority = delivery.data[SIZE - 1];
        assert_eq!(delivery.data.len(), SIZE);
        assert_eq!(delivery.properties.priority(), &Some(priority));
        if let Some((last_priority, last_seq)) = last {
            assert!(
                priority < last_priority || (priority == last_priority && seq > last_seq),
                "message {seq} (priority {priority}) after {last_seq} (priority {last_priority})"
            );
        }
        last = Some((priority, seq));
        delivery.ack(BasicAckOptions::default()).await?;
    }
    assert_eq!(last.map(|(priority, _)| priority), Some(0));
    conn.close(200, s("bye")).await?;
    Ok(())
}
