//! Delivery limits and dead-lettering through lapin, in both wirings:
//! delivery counts (`x-delivery-count`) and the redelivered flag, Qpid's
//! `x-qpid-maximum-delivery-count` with `x-qpid-dlq-enabled`, RabbitMQ's
//! `x-delivery-limit`, `x-dead-letter-exchange` and `x-death`, length
//! limits that dead-letter (`drop-head`, `reject-publish-dlx`), and what
//! survives a restart.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use futures::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Confirmation, ExchangeKind};
use spillway_integration_tests::amqp::*;
use spillway_integration_tests::{both_wirings, eventually, publish, Sandbox};
use spillway_proto::management::PeekMessagesRequest;

both_wirings!(
    timeout_secs = 90;
    a_poison_message_ends_in_the_qpid_dlq_after_the_delivery_limit,
    dropped_connections_count_towards_the_rabbitmq_delivery_limit,
    rejected_messages_go_to_the_dead_letter_exchange_with_x_death,
    length_limits_dead_letter_the_dropped_and_the_refused,
    delivery_counts_and_dead_letters_survive_a_restart,
    bad_dead_letter_arguments_are_refused,
    a_dead_letter_whose_payload_flowed_to_disk_is_read_back,
    the_broker_default_limit_counts_recovers,
    a_nack_of_many_dead_letters_them_in_publish_order,
);

fn delivery_count(props: &BasicProperties) -> Option<i64> {
    integer(header(props, "x-delivery-count"))
}

fn count(death: &FieldTable) -> Option<i64> {
    integer(death.inner().get("count"))
}

/// Qpid's dialect: a consumer that always rejects with requeue sees the
/// message `x-qpid-maximum-delivery-count` times, `x-delivery-count` rising,
/// then it is in `<queue>_DLQ` (through `<queue>_DLE`).
async fn a_poison_message_ends_in_the_qpid_dlq_after_the_delivery_limit(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    let args = table(&[
        ("x-qpid-dlq-enabled", AMQPValue::Boolean(true)),
        ("x-qpid-maximum-delivery-count", AMQPValue::ShortInt(3)),
    ]);
    declare(&ch, "poison", false, args).await?;
    // The DLQ and its exchange exist, bound: a publish to the DLE lands there.
    ch.exchange_declare(
        s("poison_DLE"),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    assert_eq!(message_count(&ch, "poison_DLQ").await?, 0);

    publish(&ch, "", "poison", b"bad", BasicProperties::default()).await?;
    let mut consumer = ch
        .basic_consume(
            s("poison"),
            s("c"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut seen = Vec::new();
    for _ in 0..3 {
        let delivery = tokio::time::timeout(WAIT, consumer.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
        seen.push((delivery.redelivered, delivery_count(&delivery.properties)));
        delivery
            .reject(BasicRejectOptions { requeue: true })
            .await?;
    }
    assert_eq!(
        seen,
        vec![(false, None), (true, Some(1)), (true, Some(2))],
        "x-delivery-count counts the earlier deliveries"
    );
    let dead = get(&ch, "poison_DLQ").await?;
    assert_eq!(dead.delivery.data, b"bad");
    assert_eq!(dead.delivery.exchange.as_str(), "poison_DLE");
    let death = deaths(&dead.delivery.properties);
    assert_eq!(death.len(), 1, "{death:?}");
    assert_eq!(
        field(&death[0], "reason").as_deref(),
        Some("delivery_limit")
    );
    assert_eq!(field(&death[0], "queue").as_deref(), Some("poison"));
    // Not delivered a fourth time.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), consumer.next())
            .await
            .is_err()
    );
    assert_eq!(message_count(&ch, "poison").await?, 0);
    let metric =
        "spillway_dead_lettered_total{vhost=\"/\",queue=\"poison\",reason=\"delivery_limit\"}";
    assert_eq!(sb.engine_metric(metric).await?, 1.0);
    close(ch, conn).await
}

/// RabbitMQ's dialect: `x-delivery-limit: 1` allows two deliveries; a
/// consumer whose connection closes without acking returns the message
/// like a reject with requeue does.
async fn dropped_connections_count_towards_the_rabbitmq_delivery_limit(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    fanout_to_queue(&ch, "dlx", "dead").await?;
    let args = table(&[
        ("x-delivery-limit", AMQPValue::LongLongInt(1)),
        ("x-dead-letter-exchange", text("dlx")),
    ]);
    declare(&ch, "crashy", false, args).await?;
    publish(&ch, "", "crashy", b"m", BasicProperties::default()).await?;

    let mut counts = Vec::new();
    for attempt in 0..2 {
        let consumer_conn = sb.connect().await?;
        let consumer_ch = consumer_conn.create_channel().await?;
        let mut consumer = consumer_ch
            .basic_consume(
                s("crashy"),
                s(&format!("c{attempt}")),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let delivery = tokio::time::timeout(WAIT, consumer.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
        counts.push(delivery_count(&delivery.properties));
        // Gone without an ack.
        consumer_conn.close(200, s("crash")).await?;
    }
    assert_eq!(counts, vec![None, Some(1)]);
    let dead = get(&ch, "dead").await?;
    assert_eq!(dead.delivery.data, b"m");
    let props = &dead.delivery.properties;
    assert_eq!(
        string(header(props, "x-first-death-reason")).as_deref(),
        Some("delivery_limit")
    );
    assert_eq!(
        string(header(props, "x-first-death-queue")).as_deref(),
        Some("crashy")
    );
    assert_eq!(message_count(&ch, "crashy").await?, 0);
    close(ch, conn).await
}

/// basic.reject with requeue=false on a queue with a dead-letter exchange:
/// republished with the given routing key and RabbitMQ's headers; rejected
/// again after a retry, its `x-death` entry counts 2. Without a dead-letter
/// exchange the message is dropped.
async fn rejected_messages_go_to_the_dead_letter_exchange_with_x_death(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.exchange_declare(
        s("dlx-direct"),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    declare(&ch, "parked", false, FieldTable::default()).await?;
    ch.queue_bind(
        s("parked"),
        s("dlx-direct"),
        s("park"),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let args = table(&[
        ("x-dead-letter-exchange", text("dlx-direct")),
        ("x-dead-letter-routing-key", text("park")),
    ]);
    declare(&ch, "work", false, args).await?;
    let props = BasicProperties::default()
        .with_content_type(s("text/plain"))
        .with_expiration(s("60000"))
        .with_headers(table(&[("app", text("kept"))]));
    publish(&ch, "", "work", b"job", props).await?;
    let got = get(&ch, "work").await?;
    got.delivery
        .reject(BasicRejectOptions { requeue: false })
        .await?;

    let dead = get(&ch, "parked").await?;
    assert_eq!(dead.delivery.data, b"job");
    assert_eq!(dead.delivery.exchange.as_str(), "dlx-direct");
    assert_eq!(dead.delivery.routing_key.as_str(), "park");
    let props = &dead.delivery.properties;
    assert_eq!(
        props.content_type().as_ref().map(|t| t.as_str()),
        Some("text/plain")
    );
    assert_eq!(props.expiration(), &None, "expiration moves into x-death");
    assert_eq!(string(header(props, "app")).as_deref(), Some("kept"));
    let death = deaths(props);
    assert_eq!(death.len(), 1, "{death:?}");
    assert_eq!(count(&death[0]), Some(1));
    assert_eq!(field(&death[0], "reason").as_deref(), Some("rejected"));
    assert_eq!(field(&death[0], "queue").as_deref(), Some("work"));
    assert_eq!(field(&death[0], "exchange").as_deref(), Some(""));
    assert_eq!(routing_keys(&death[0]), vec!["work".to_string()]);
    assert_eq!(
        field(&death[0], "original-expiration").as_deref(),
        Some("60000")
    );
    assert!(matches!(
        death[0].inner().get("time"),
        Some(AMQPValue::Timestamp(t)) if *t > 0
    ));
    for (key, value) in [
        ("x-first-death-reason", "rejected"),
        ("x-first-death-queue", "work"),
        ("x-first-death-exchange", ""),
        ("x-last-death-reason", "rejected"),
        ("x-last-death-queue", "work"),
        ("x-last-death-exchange", ""),
    ] {
        assert_eq!(string(header(props, key)).as_deref(), Some(value), "{key}");
    }

    // A retry: the client publishes it back with its headers; rejected
    // again, the same (queue, reason) entry counts 2.
    dead.delivery.ack(BasicAckOptions::default()).await?;
    publish(&ch, "", "work", b"job", props.clone()).await?;
    let got = get(&ch, "work").await?;
    got.delivery
        .reject(BasicRejectOptions { requeue: false })
        .await?;
    let dead = get(&ch, "parked").await?;
    let death = deaths(&dead.delivery.properties);
    assert_eq!(death.len(), 1, "{death:?}");
    assert_eq!(count(&death[0]), Some(2));
    dead.delivery.ack(BasicAckOptions::default()).await?;

    // No dead-letter exchange: rejected without requeue is dropped.
    declare(&ch, "plain", false, FieldTable::default()).await?;
    publish(&ch, "", "plain", b"x", BasicProperties::default()).await?;
    let got = get(&ch, "plain").await?;
    got.delivery
        .reject(BasicRejectOptions { requeue: false })
        .await?;
    assert_eq!(message_count(&ch, "plain").await?, 0);
    let metric = "spillway_dead_lettered_total{vhost=\"/\",queue=\"work\",reason=\"rejected\"}";
    assert_eq!(sb.engine_metric(metric).await?, 2.0);
    let metric = "spillway_discarded_total{vhost=\"/\",queue=\"plain\",reason=\"rejected\"}";
    assert_eq!(sb.engine_metric(metric).await?, 1.0);
    close(ch, conn).await
}

/// `x-max-length` with drop-head dead-letters the oldest; with
/// `reject-publish-dlx` the refused message (nacked to its publisher).
async fn length_limits_dead_letter_the_dropped_and_the_refused(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    ch.exchange_declare(
        s("overflow-dlx"),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    declare(&ch, "overflowed", false, FieldTable::default()).await?;
    ch.queue_bind(
        s("overflowed"),
        s("overflow-dlx"),
        s(""),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let head = table(&[
        ("x-max-length", AMQPValue::LongInt(1)),
        ("x-dead-letter-exchange", text("overflow-dlx")),
    ]);
    declare(&ch, "drop-head", false, head).await?;
    let refuse = table(&[
        ("x-max-length", AMQPValue::LongInt(1)),
        ("x-overflow", text("reject-publish-dlx")),
        ("x-dead-letter-exchange", text("overflow-dlx")),
    ]);
    declare(&ch, "refusing", false, refuse).await?;

    for body in [b"h1", b"h2"] {
        let outcome = publish(&ch, "", "drop-head", body, BasicProperties::default()).await?;
        assert!(matches!(outcome, Confirmation::Ack(_)));
    }
    let outcome = publish(&ch, "", "refusing", b"r1", BasicProperties::default()).await?;
    assert!(matches!(outcome, Confirmation::Ack(_)));
    let outcome = publish(&ch, "", "refusing", b"r2", BasicProperties::default()).await?;
    assert!(matches!(outcome, Confirmation::Nack(_)), "{outcome:?}");

    let first = get(&ch, "overflowed").await?;
    assert_eq!(first.delivery.data, b"h1", "the oldest was dropped");
    let death = deaths(&first.delivery.properties);
    assert_eq!(field(&death[0], "reason").as_deref(), Some("maxlen"));
    assert_eq!(field(&death[0], "queue").as_deref(), Some("drop-head"));
    let second = get(&ch, "overflowed").await?;
    assert_eq!(second.delivery.data, b"r2", "the refused one");
    let death = deaths(&second.delivery.properties);
    assert_eq!(field(&death[0], "reason").as_deref(), Some("maxlen"));
    assert_eq!(field(&death[0], "queue").as_deref(), Some("refusing"));
    let get_ok = ch
        .basic_get(s("drop-head"), BasicGetOptions { no_ack: true })
        .await?
        .ok_or_else(|| anyhow::anyhow!("drop-head is empty"))?;
    assert_eq!(get_ok.delivery.data, b"h2");
    close(ch, conn).await
}

/// A persistent message on a durable queue keeps its delivery count and
/// redelivered flag across a restart; one dead-lettered from a durable
/// queue to another (through the default exchange) is there after it.
async fn delivery_counts_and_dead_letters_survive_a_restart(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    {
        let conn = sb.connect().await?;
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        declare(&ch, "kept", true, FieldTable::default()).await?;
        declare(&ch, "graveyard", true, FieldTable::default()).await?;
        let args = table(&[
            ("x-dead-letter-exchange", text("")),
            ("x-dead-letter-routing-key", text("graveyard")),
        ]);
        declare(&ch, "mortal", true, args).await?;
        let persistent = BasicProperties::default().with_delivery_mode(2);
        for queue in ["kept", "mortal"] {
            let outcome = publish(&ch, "", queue, queue.as_bytes(), persistent.clone()).await?;
            assert!(matches!(outcome, Confirmation::Ack(_)));
        }
        for _ in 0..2 {
            let got = get(&ch, "kept").await?;
            got.delivery
                .nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await?;
        }
        let got = get(&ch, "mortal").await?;
        got.delivery
            .reject(BasicRejectOptions { requeue: false })
            .await?;
        eventually(WAIT, || async {
            message_count(&ch, "graveyard")
                .await
                .ok()
                .filter(|n| *n == 1)
        })
        .await?;
        close(ch, conn).await?;
    }
    sb.restart().await?;
    // Management shows the count before anyone takes the message.
    let mut management = sb.management().await?;
    let peeked = management
        .peek_messages(PeekMessagesRequest {
            vhost: "/".into(),
            queue: "kept".into(),
            count: 1,
        })
        .await?
        .into_inner()
        .messages;
    assert_eq!(peeked.len(), 1);
    assert!(peeked[0].redelivered);
    assert_eq!(peeked[0].delivery_count, 2);
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    let kept = get(&ch, "kept").await?;
    assert!(kept.delivery.redelivered, "the flag survived the restart");
    assert_eq!(delivery_count(&kept.delivery.properties), Some(2));
    let dead = get(&ch, "graveyard").await?;
    assert_eq!(dead.delivery.data, b"mortal");
    assert_eq!(dead.delivery.properties.delivery_mode(), &Some(2));
    let death = deaths(&dead.delivery.properties);
    assert_eq!(field(&death[0], "queue").as_deref(), Some("mortal"));
    assert_eq!(message_count(&ch, "mortal").await?, 0);
    close(ch, conn).await
}

/// A delivery limit that is not a non-negative integer, a dead-letter
/// routing key without an exchange, a non-boolean `x-qpid-dlq-enabled`:
/// 406 PRECONDITION_FAILED, as RabbitMQ answers.
async fn bad_dead_letter_arguments_are_refused(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let cases = [
        (
            "x-delivery-limit",
            AMQPValue::LongInt(-1),
            "x-delivery-limit",
        ),
        ("x-delivery-limit", text("five"), "x-delivery-limit"),
        (
            "x-qpid-maximum-delivery-count",
            AMQPValue::ShortShortInt(-3),
            "x-qpid-maximum-delivery-count",
        ),
        (
            "x-dead-letter-routing-key",
            text("k"),
            "x-dead-letter-routing-key",
        ),
        (
            "x-dead-letter-exchange",
            AMQPValue::LongInt(1),
            "x-dead-letter-exchange",
        ),
        ("x-qpid-dlq-enabled", text("perhaps"), "x-qpid-dlq-enabled"),
    ];
    for (key, value, named) in cases {
        let ch = conn.create_channel().await?;
        let error = declare(&ch, "bad", false, table(&[(key, value.clone())]))
            .await
            .expect_err(key);
        let code = match error.downcast_ref::<lapin::Error>().map(lapin::Error::kind) {
            Some(lapin::ErrorKind::ProtocolError(e)) => Some(e.get_id()),
            _ => None,
        };
        assert_eq!(code, Some(406), "{key}: {error}");
        let message = error.to_string();
        assert!(
            message.contains(&format!("invalid arg '{named}' for queue 'bad'")),
            "{key}: {message}"
        );
    }
    conn.close(200, s("bye")).await?;
    Ok(())
}

/// Under flow to disk a delivered persistent message's payload leaves memory
/// (the store has it); rejected, it is read back from the store and
/// dead-lettered whole.
async fn a_dead_letter_whose_payload_flowed_to_disk_is_read_back(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let config = "[engine]\nflow_to_disk_threshold = 65536\nhousekeeping_interval = \"100ms\"\n";
    let sandbox = Sandbox::start_with_config(sb.wiring(), config).await?;
    let conn = sandbox.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    declare(&ch, "heavy-dead", true, FieldTable::default()).await?;
    let args = table(&[
        ("x-dead-letter-exchange", text("")),
        ("x-dead-letter-routing-key", text("heavy-dead")),
    ]);
    declare(&ch, "heavy", true, args).await?;
    let persistent = BasicProperties::default().with_delivery_mode(2);
    for i in 0..64u8 {
        let outcome = publish(&ch, "", "heavy", &[i; 8192], persistent.clone()).await?;
        assert!(matches!(outcome, Confirmation::Ack(_)));
    }
    eventually(WAIT, || async {
        sandbox
            .engine_metric("spillway_broker_flow_to_disk_active")
            .await
            .ok()
            .filter(|active| *active == 1.0)
    })
    .await?;
    let got = get(&ch, "heavy").await?;
    assert_eq!(got.delivery.data, vec![0u8; 8192]);
    got.delivery
        .reject(BasicRejectOptions { requeue: false })
        .await?;
    let dead = get(&ch, "heavy-dead").await?;
    assert_eq!(
        dead.delivery.data,
        vec![0u8; 8192],
        "the payload came back whole"
    );
    let death = deaths(&dead.delivery.properties);
    assert_eq!(field(&death[0], "queue").as_deref(), Some("heavy"));
    assert_eq!(field(&death[0], "reason").as_deref(), Some("rejected"));
    assert_eq!(message_count(&ch, "heavy").await?, 63);
    close(ch, conn).await
}

/// `engine.default_maximum_delivery_count` applies to a queue without a
/// limit of its own; `basic.recover` returns count like rejects.
async fn the_broker_default_limit_counts_recovers(sb: &mut Sandbox) -> anyhow::Result<()> {
    let config = "[engine]\ndefault_maximum_delivery_count = 2\n";
    let sandbox = Sandbox::start_with_config(sb.wiring(), config).await?;
    let conn = sandbox.connect().await?;
    let ch = conn.create_channel().await?;
    let args = table(&[("x-qpid-dlq-enabled", AMQPValue::Boolean(true))]);
    declare(&ch, "defaulted", false, args).await?;
    publish(&ch, "", "defaulted", b"d", BasicProperties::default()).await?;
    for expected in [None, Some(1)] {
        let got = get(&ch, "defaulted").await?;
        assert_eq!(delivery_count(&got.delivery.properties), expected);
        ch.basic_recover(BasicRecoverOptions { requeue: true })
            .await?;
    }
    let dead = get(&ch, "defaulted_DLQ").await?;
    assert_eq!(dead.delivery.data, b"d");
    let death = deaths(&dead.delivery.properties);
    assert_eq!(
        field(&death[0], "reason").as_deref(),
        Some("delivery_limit")
    );
    assert_eq!(message_count(&ch, "defaulted").await?, 0);
    close(ch, conn).await
}

/// `basic.nack` with `multiple` and no requeue: the dead-letter queue gets
/// the messages in the order they were published, not the reverse; so does
/// a channel that closes with deliveries at their delivery limit.
async fn a_nack_of_many_dead_letters_them_in_publish_order(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "ordered_dead", false, FieldTable::default()).await?;
    let args = table(&[
        ("x-dead-letter-exchange", text("")),
        ("x-dead-letter-routing-key", text("ordered_dead")),
        ("x-delivery-limit", AMQPValue::ShortInt(0)),
    ]);
    declare(&ch, "ordered", false, args).await?;
    let bodies: Vec<String> = (0..20).map(|i| format!("m{i}")).collect();
    for body in &bodies {
        publish(
            &ch,
            "",
            "ordered",
            body.as_bytes(),
            BasicProperties::default(),
        )
        .await?;
    }
    let mut consumer = ch
        .basic_consume(
            s("ordered"),
            s("c"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut last = None;
    for _ in 0..10 {
        let delivery = tokio::time::timeout(WAIT, consumer.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
        last = Some(delivery);
    }
    let last = last.ok_or_else(|| anyhow::anyhow!("no delivery"))?;
    last.nack(BasicNackOptions {
        multiple: true,
        requeue: false,
    })
    .await?;
    eventually(WAIT, || async {
        message_count(&ch, "ordered_dead")
            .await
            .ok()
            .filter(|n| *n == 10)
    })
    .await?;
    // The other ten are delivered, unacked, and go back when the channel
    // closes: at their delivery limit (x-delivery-limit 0 allows one
    // delivery), so to the dead-letter queue, again in order.
    for _ in 0..10 {
        tokio::time::timeout(WAIT, consumer.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
    }
    ch.close(200, s("bye")).await?;
    let ch = conn.create_channel().await?;
    eventually(WAIT, || async {
        message_count(&ch, "ordered_dead")
            .await
            .ok()
            .filter(|n| *n == 20)
    })
    .await?;
    let mut dead = Vec::new();
    for _ in 0..20 {
        let got = get(&ch, "ordered_dead").await?;
        dead.push(String::from_utf8(got.delivery.data.clone())?);
        got.delivery.ack(BasicAckOptions::default()).await?;
    }
    assert_eq!(dead, bodies, "dead letters in publish order");
    close(ch, conn).await
}
