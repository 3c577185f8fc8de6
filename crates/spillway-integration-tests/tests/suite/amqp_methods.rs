//! Every AMQP method a client uses, through lapin over a real socket, against
//! both wirings: in-process, and storage/engine/gateway as separate processes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use futures::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ExchangeKind};
use spillway_integration_tests::amqp::amqp_code;
use spillway_integration_tests::{both_wirings, eventually, publish, Component, Sandbox, Wiring};

both_wirings!(
    timeout_secs = 60;
    publish_consume_keeps_properties_and_order,
    direct_fanout_topic_headers_exchanges_route,
    exchange_to_exchange_bindings_route,
    nack_reject_requeue_and_redelivered_flag,
    prefetch_limits_unacked_and_round_robins,
    get_and_get_empty,
    publisher_confirms_transient_and_persistent,
    mandatory_unroutable_is_returned,
    channel_errors_carry_rabbitmq_codes,
    invalid_exchange_type_closes_connection,
    queue_lifecycle_exclusive_auto_delete_purge_delete,
    deleting_a_queue_cancels_its_consumers,
    recover_requeues_unacked,
    large_messages_span_frames,
    bodies_read_together_come_out_intact_queued_or_delivered,
    persistent_messages_survive_restart,
    max_length_drops_the_oldest,
    overflow_reject_publish_nacks,
    crossing_channel_closes_keep_the_connection,
);

fn s(text: &str) -> ShortString {
    text.into()
}

async fn channel(conn: &Connection) -> anyhow::Result<Channel> {
    Ok(conn.create_channel().await?)
}

async fn declare(ch: &Channel, name: &str) -> anyhow::Result<lapin::Queue> {
    Ok(ch
        .queue_declare(
            s(name),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?)
}

/// Takes `n` deliveries from a consumer, acking each.
async fn take(
    consumer: &mut lapin::Consumer,
    n: usize,
) -> anyhow::Result<Vec<lapin::message::Delivery>> {
    let mut out = Vec::new();
    while out.len() < n {
        let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
        out.push(delivery);
    }
    Ok(out)
}

async fn bodies_via_get(ch: &Channel, queue: &str) -> anyhow::Result<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    while let Some(message) = ch
        .basic_get(s(queue), BasicGetOptions { no_ack: true })
        .await?
    {
        out.push(message.delivery.data.clone());
    }
    Ok(out)
}

async fn publish_consume_keeps_properties_and_order(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    declare(&ch, "props").await?;
    let mut headers = FieldTable::default();
    headers.insert(s("int"), AMQPValue::LongInt(-7));
    headers.insert(s("text"), AMQPValue::LongString("héllo".into()));
    let mut nested = FieldTable::default();
    nested.insert(s("flag"), AMQPValue::Boolean(true));
    headers.insert(s("nested"), AMQPValue::FieldTable(nested));
    let props = BasicProperties::default()
        .with_content_type(s("application/json"))
        .with_correlation_id(s("corr-1"))
        .with_reply_to(s("replies"))
        .with_message_id(s("m-1"))
        .with_timestamp(1_700_000_000)
        .with_priority(3)
        .with_app_id(s("tests"))
        .with_headers(headers);
    for i in 0..20u8 {
        publish(&ch, "", "props", &[i], props.clone()).await?;
    }
    let mut consumer = ch
        .basic_consume(
            s("props"),
            s("c1"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let deliveries = take(&mut consumer, 20).await?;
    for (i, delivery) in deliveries.iter().enumerate() {
        assert_eq!(delivery.data, vec![i as u8], "FIFO order");
        assert_eq!(delivery.properties, props, "properties round-trip");
        assert!(!delivery.redelivered);
        assert_eq!(delivery.routing_key.as_str(), "props");
        delivery.ack(BasicAckOptions::default()).await?;
    }
    Ok(())
}

async fn direct_fanout_topic_headers_exchanges_route(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    for (name, kind) in [
        ("x.direct", ExchangeKind::Direct),
        ("x.fanout", ExchangeKind::Fanout),
        ("x.topic", ExchangeKind::Topic),
        ("x.headers", ExchangeKind::Headers),
    ] {
        ch.exchange_declare(
            s(name),
            kind,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    }
    for q in ["qa", "qb", "qt1", "qt2", "qh"] {
        declare(&ch, q).await?;
    }
    let bind = |q: &'static str, x: &'static str, k: &'static str, args: FieldTable| {
        let ch = ch.clone();
        async move {
            ch.queue_bind(s(q), s(x), s(k), QueueBindOptions::default(), args)
                .await
        }
    };
    bind("qa", "x.direct", "a", FieldTable::default()).await?;
    bind("qa", "x.fanout", "", FieldTable::default()).await?;
    bind("qb", "x.fanout", "", FieldTable::default()).await?;
    bind("qt1", "x.topic", "stock.*.nyse", FieldTable::default()).await?;
    bind("qt2", "x.topic", "stock.#", FieldTable::default()).await?;
    let mut match_any = FieldTable::default();
    match_any.insert(s("x-match"), AMQPValue::LongString("any".into()));
    match_any.insert(s("format"), AMQPValue::LongString("pdf".into()));
    match_any.insert(s("type"), AMQPValue::LongString("report".into()));
    bind("qh", "x.headers", "", match_any).await?;

    publish(
        &ch,
        "x.direct",
        "a",
        b"direct-a",
        BasicProperties::default(),
    )
    .await?;
    publish(
        &ch,
        "x.direct",
        "b",
        b"direct-b",
        BasicProperties::default(),
    )
    .await?;
    publish(
        &ch,
        "x.fanout",
        "whatever",
        b"fan",
        BasicProperties::default(),
    )
    .await?;
    publish(
        &ch,
        "x.topic",
        "stock.ibm.nyse",
        b"t1",
        BasicProperties::default(),
    )
    .await?;
    publish(
        &ch,
        "x.topic",
        "stock.ibm.lse.extra",
        b"t2",
        BasicProperties::default(),
    )
    .await?;
    let mut pdf = FieldTable::default();
    pdf.insert(s("format"), AMQPValue::LongString("pdf".into()));
    publish(
        &ch,
        "x.headers",
        "",
        b"h1",
        BasicProperties::default().with_headers(pdf),
    )
    .await?;
    let mut other = FieldTable::default();
    other.insert(s("format"), AMQPValue::LongString("zip".into()));
    publish(
        &ch,
        "x.headers",
        "",
        b"h2",
        BasicProperties::default().with_headers(other),
    )
    .await?;

    assert_eq!(
        bodies_via_get(&ch, "qa").await?,
        vec![b"direct-a".to_vec(), b"fan".to_vec()]
    );
    assert_eq!(bodies_via_get(&ch, "qb").await?, vec![b"fan".to_vec()]);
    assert_eq!(bodies_via_get(&ch, "qt1").await?, vec![b"t1".to_vec()]);
    assert_eq!(
        bodies_via_get(&ch, "qt2").await?,
        vec![b"t1".to_vec(), b"t2".to_vec()]
    );
    assert_eq!(bodies_via_get(&ch, "qh").await?, vec![b"h1".to_vec()]);
    Ok(())
}

async fn exchange_to_exchange_bindings_route(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    ch.exchange_declare(
        s("e2e.src"),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.exchange_declare(
        s("e2e.dst"),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    declare(&ch, "e2e.q").await?;
    ch.queue_bind(
        s("e2e.q"),
        s("e2e.dst"),
        s(""),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.exchange_bind(
        s("e2e.dst"),
        s("e2e.src"),
        s("a.#"),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    // A cycle must not loop.
    ch.exchange_bind(
        s("e2e.src"),
        s("e2e.dst"),
        s(""),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    publish(&ch, "e2e.src", "a.b", b"routed", BasicProperties::default()).await?;
    publish(
        &ch,
        "e2e.src",
        "b.a",
        b"dropped",
        BasicProperties::default(),
    )
    .await?;
    assert_eq!(
        bodies_via_get(&ch, "e2e.q").await?,
        vec![b"routed".to_vec()]
    );
    Ok(())
}

async fn nack_reject_requeue_and_redelivered_flag(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    declare(&ch, "nacks").await?;
    for i in 0..4u8 {
        publish(&ch, "", "nacks", &[i], BasicProperties::default()).await?;
    }
    let mut consumer = ch
        .basic_consume(
            s("nacks"),
            s("c"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let first = take(&mut consumer, 4).await?;
    // 0: reject requeue, 1: reject drop, 2 and 3: nack multiple requeue.
    first[0]
        .reject(BasicRejectOptions { requeue: true })
        .await?;
    first[1]
        .reject(BasicRejectOptions { requeue: false })
        .await?;
    first[3]
        .nack(BasicNackOptions {
            multiple: true,
            requeue: true,
        })
        .await?;
    let again = take(&mut consumer, 3).await?;
    let bodies: Vec<u8> = again.iter().map(|d| d.data[0]).collect();
    assert_eq!(
        bodies,
        vec![0, 2, 3],
        "requeued in original order, rejected one gone"
    );
    assert!(again.iter().all(|d| d.redelivered), "redelivered flag set");
    for delivery in &again {
        delivery.ack(BasicAckOptions::default()).await?;
    }
    ch.basic_cancel(s("c"), BasicCancelOptions::default())
        .await?;
    assert!(bodies_via_get(&ch, "nacks").await?.is_empty());
    Ok(())
}

async fn prefetch_limits_unacked_and_round_robins(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    declare(&ch, "prefetch").await?;
    for i in 0..10u8 {
        publish(&ch, "", "prefetch", &[i], BasicProperties::default()).await?;
    }
    let c1 = channel(&conn).await?;
    let c2 = channel(&conn).await?;
    c1.basic_qos(2, BasicQosOptions::default()).await?;
    c2.basic_qos(2, BasicQosOptions::default()).await?;
    let mut k1 = c1
        .basic_consume(
            s("prefetch"),
            s("k1"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut k2 = c2
        .basic_consume(
            s("prefetch"),
            s("k2"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let d1 = take(&mut k1, 2).await?;
    let d2 = take(&mut k2, 2).await?;
    // Nothing more arrives while both are at their prefetch limit.
    assert!(tokio::time::timeout(Duration::from_millis(300), k1.next())
        .await
        .is_err());
    let queue = ch
        .queue_declare(
            s("prefetch"),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    assert_eq!(queue.message_count(), 6);
    assert_eq!(queue.consumer_count(), 2);
    d1[0].ack(BasicAckOptions::default()).await?;
    let more = take(&mut k1, 1).await?;
    let mut seen: Vec<u8> = d1
        .iter()
        .chain(&d2)
        .chain(&more)
        .map(|d| d.data[0])
        .collect();
    seen.sort();
    assert_eq!(seen, vec![0, 1, 2, 3, 4]);
    Ok(())
}

async fn get_and_get_empty(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    declare(&ch, "gets").await?;
    assert!(ch
        .basic_get(s("gets"), BasicGetOptions::default())
        .await?
        .is_none());
    publish(&ch, "", "gets", b"one", BasicProperties::default()).await?;
    publish(&ch, "", "gets", b"two", BasicProperties::default()).await?;
    let got = ch
        .basic_get(s("gets"), BasicGetOptions::default())
        .await?
        .expect("a message");
    assert_eq!(got.delivery.data, b"one");
    assert_eq!(got.message_count, 1);
    got.delivery.ack(BasicAckOptions::default()).await?;
    let got = ch
        .basic_get(s("gets"), BasicGetOptions::default())
        .await?
        .expect("a message");
    got.delivery
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await?;
    let again = ch
        .basic_get(s("gets"), BasicGetOptions { no_ack: true })
        .await?
        .expect("requeued");
    assert!(again.delivery.redelivered);
    assert_eq!(again.delivery.data, b"two");
    Ok(())
}

async fn publisher_confirms_transient_and_persistent(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    ch.queue_declare(
        s("durable-q"),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    let mut pending = Vec::new();
    for i in 0..200u32 {
        let props = BasicProperties::default().with_delivery_mode(if i % 2 == 0 { 2 } else { 1 });
        pending.push(
            ch.basic_publish(
                s(""),
                s("durable-q"),
                BasicPublishOptions::default(),
                &i.to_be_bytes(),
                props,
            )
            .await?,
        );
    }
    for confirm in pending {
        assert!(matches!(confirm.await?, Confirmation::Ack(None)));
    }
    let queue = ch
        .queue_declare(
            s("durable-q"),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    assert_eq!(queue.message_count(), 200);
    Ok(())
}

async fn mandatory_unroutable_is_returned(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let confirm = ch
        .basic_publish(
            s(""),
            s("no-such-queue"),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"lost?",
            BasicProperties::default(),
        )
        .await?
        .await?;
    let Confirmation::Ack(Some(returned)) = confirm else {
        anyhow::bail!("expected an ack carrying the returned message, got {confirm:?}");
    };
    assert_eq!(returned.reply_code, 312);
    assert_eq!(returned.delivery.data, b"lost?");
    Ok(())
}

async fn channel_errors_carry_rabbitmq_codes(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let ch = channel(&conn).await?;
    let error = ch
        .queue_declare(s("missing"), passive, FieldTable::default())
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&error), Some(404), "{error}");

    let ch = channel(&conn).await?;
    declare(&ch, "plain").await?;
    let error = ch
        .queue_declare(
            s("plain"),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&error), Some(406), "{error}");

    let ch = channel(&conn).await?;
    let error = ch
        .exchange_declare(
            s("amq.mine"),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&error), Some(403), "{error}");

    let ch = channel(&conn).await?;
    ch.exchange_declare(
        s("typed"),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let error = ch
        .exchange_declare(
            s("typed"),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&error), Some(406), "{error}");

    let ch = channel(&conn).await?;
    ch.queue_declare(
        s("mine"),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    let other = sb.connect().await?;
    let och = channel(&other).await?;
    let error = och
        .basic_consume(
            s("mine"),
            s(""),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&error), Some(405), "{error}");

    let ch = channel(&conn).await?;
    ch.basic_ack(999, BasicAckOptions::default()).await?;
    // The 406 closes the channel asynchronously.
    eventually(Duration::from_secs(10), || async {
        !ch.status().connected()
    })
    .await
    .map_err(|error| error.context("unknown delivery tag closes the channel"))?;

    // A publish to a missing exchange (no confirms: nothing answers the
    // publish itself) closes the channel with 404. lapin tells a channel's
    // consumers why it was closed, so a consumer is the witness.
    let ch = channel(&conn).await?;
    let witness = ch
        .queue_declare(
            s(""),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let mut witness = ch
        .basic_consume(
            witness.name().clone(),
            s("witness"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    publish(
        &ch,
        "no-such-exchange",
        "k",
        b"x",
        BasicProperties::default(),
    )
    .await?;
    let closed = tokio::time::timeout(Duration::from_secs(10), witness.next())
        .await
        .map_err(|_| anyhow::anyhow!("publish to a missing exchange did not close the channel"))?;
    let error = match closed {
        Some(Err(error)) => error,
        other => panic!("the channel's consumer saw {other:?}, not the channel's close"),
    };
    assert_eq!(amqp_code(&error), Some(404), "{error}");
    eventually(Duration::from_secs(10), || async {
        !ch.status().connected()
    })
    .await
    .map_err(|error| error.context("publish to a missing exchange closes the channel"))?;

    // The connection survived every channel error.
    let ch = channel(&conn).await?;
    declare(&ch, "still-fine").await?;
    Ok(())
}

async fn invalid_exchange_type_closes_connection(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    let error = ch
        .exchange_declare(
            s("odd"),
            ExchangeKind::Custom("no-such-type".into()),
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&error), Some(503), "{error}");
    eventually(Duration::from_secs(10), || async {
        !conn.status().connected()
    })
    .await
    .map_err(|error| error.context("503 is a connection error"))?;
    Ok(())
}

async fn queue_lifecycle_exclusive_auto_delete_purge_delete(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    let named = ch
        .queue_declare(
            s(""),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    assert!(named.name().as_str().starts_with("amq.gen-"));
    let exclusive_name = named.name().to_string();

    ch.queue_declare(
        s("auto"),
        QueueDeclareOptions {
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.basic_consume(
        s("auto"),
        s("auto-c"),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.basic_cancel(s("auto-c"), BasicCancelOptions::default())
        .await?;

    declare(&ch, "purge-me").await?;
    for _ in 0..5 {
        publish(&ch, "", "purge-me", b"x", BasicProperties::default()).await?;
    }
    let error = ch
        .queue_delete(
            s("purge-me"),
            QueueDeleteOptions {
                if_empty: true,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&error), Some(406), "{error}");
    let ch = channel(&conn).await?;
    assert_eq!(
        ch.queue_purge(s("purge-me"), QueuePurgeOptions::default())
            .await?,
        5
    );
    publish(&ch, "", "purge-me", b"x", BasicProperties::default()).await?;
    assert_eq!(
        ch.queue_delete(s("purge-me"), QueueDeleteOptions::default())
            .await?,
        1
    );
    conn.close(200, s("bye")).await?;

    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    for gone in [exclusive_name.as_str(), "auto", "purge-me"] {
        let ch = channel(&conn).await?;
        let error = ch
            .queue_declare(s(gone), passive, FieldTable::default())
            .await
            .unwrap_err();
        assert_eq!(
            amqp_code(&error),
            Some(404),
            "{gone} should be gone: {error}"
        );
    }
    drop(ch);
    Ok(())
}

async fn deleting_a_queue_cancels_its_consumers(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    declare(&ch, "doomed").await?;
    let mut consumer = ch
        .basic_consume(
            s("doomed"),
            s("victim"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let admin = channel(&conn).await?;
    admin
        .queue_delete(s("doomed"), QueueDeleteOptions::default())
        .await?;
    // lapin ends the consumer stream when the server cancels it.
    let next = tokio::time::timeout(Duration::from_secs(5), consumer.next()).await?;
    assert!(next.is_none(), "consumer cancelled by the server");
    Ok(())
}

async fn recover_requeues_unacked(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    declare(&ch, "recover").await?;
    publish(&ch, "", "recover", b"r", BasicProperties::default()).await?;
    let mut consumer = ch
        .basic_consume(
            s("recover"),
            s("rc"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let first = take(&mut consumer, 1).await?;
    assert!(!first[0].redelivered);
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await?;
    let again = take(&mut consumer, 1).await?;
    assert!(again[0].redelivered);
    assert_eq!(again[0].data, b"r");
    Ok(())
}

async fn large_messages_span_frames(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    declare(&ch, "large").await?;
    let body: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    publish(&ch, "", "large", &body, BasicProperties::default()).await?;
    publish(&ch, "", "large", b"", BasicProperties::default()).await?;
    assert_eq!(bodies_via_get(&ch, "large").await?, vec![body, Vec::new()]);
    Ok(())
}

/// Bodies of one frame are handed on as slices of the gateway's read buffer
/// (`body_loans.rs`): a burst of them, several per read, must come out
/// byte for byte, whether they wait in a queue while the buffer is read
/// into again or go straight to a consumer.
async fn bodies_read_together_come_out_intact_queued_or_delivered(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    const SIZES: [usize; 7] = [4096, 5000, 16384, 100, 65536, 20000, 4095];
    let body = |i: usize| -> Vec<u8> {
        (0..SIZES[i % SIZES.len()])
            .map(|j| ((i * 7 + j) % 251) as u8)
            .collect()
    };
    let burst = |ch: Channel, range: std::ops::Range<usize>| async move {
        // Not waiting between publishes: lapin writes them back to back.
        for i in range {
            ch.basic_publish(
                s(""),
                s("lent"),
                BasicPublishOptions::default(),
                &body(i),
                BasicProperties::default(),
            )
            .await?;
        }
        anyhow::Ok(())
    };
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    declare(&ch, "lent").await?;

    burst(ch.clone(), 0..300).await?;
    eventually(Duration::from_secs(10), || {
        let ch = ch.clone();
        async move {
            let declared = ch
                .queue_declare(
                    s("lent"),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            anyhow::ensure!(
                declared.message_count() == 300,
                "{} queued",
                declared.message_count()
            );
            Ok(())
        }
    })
    .await?;
    let lent = || sb.metric(Component::Gateway, "spillway_lent_read_buffer_bytes");
    if sb.wiring() == Wiring::InProcess {
        // Queued in the same process, the lent bodies keep read buffers.
        let held = lent().await?;
        assert!(held > 0.0, "no body was lent");
        assert!(held <= (32 << 20) as f64, "{held} bytes lent");
    }
    let queued = bodies_via_get(&ch, "lent").await?;
    assert_eq!(queued.len(), 300);
    for (i, got) in queued.iter().enumerate() {
        assert!(got == &body(i), "queued message {i} differs");
    }

    let consuming = channel(&conn).await?;
    let mut consumer = consuming
        .basic_consume(
            s("lent"),
            s("c"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let publisher = channel(&conn).await?;
    let sending = tokio::spawn(burst(publisher, 300..600));
    let delivered = take(&mut consumer, 300).await?;
    sending.await??;
    for (n, delivery) in delivered.iter().enumerate() {
        assert!(
            delivery.data == body(300 + n),
            "delivered message {} differs",
            300 + n
        );
        delivery.ack(BasicAckOptions::default()).await?;
    }
    // Every message is gone: so is every loan.
    eventually(Duration::from_secs(10), || async {
        let held = lent().await?;
        anyhow::ensure!(held == 0.0, "{held} bytes still lent");
        Ok(())
    })
    .await?;
    Ok(())
}

async fn persistent_messages_survive_restart(sb: &mut Sandbox) -> anyhow::Result<()> {
    {
        let conn = sb.connect().await?;
        let ch = channel(&conn).await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        ch.exchange_declare(
            s("keep.x"),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        ch.queue_declare(
            s("keep"),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        ch.queue_declare(
            s("forget"),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
        ch.queue_bind(
            s("keep"),
            s("keep.x"),
            s("k"),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        for i in 0..50u8 {
            publish(
                &ch,
                "keep.x",
                "k",
                &[i],
                BasicProperties::default().with_delivery_mode(2),
            )
            .await?;
        }
        publish(&ch, "keep.x", "k", b"transient", BasicProperties::default()).await?;
        // One consumed and acked before the restart: it must stay gone.
        let got = ch
            .basic_get(s("keep"), BasicGetOptions::default())
            .await?
            .expect("message");
        got.delivery.ack(BasicAckOptions::default()).await?;
        let _ = conn.close(200, s("bye")).await;
    }
    sb.restart().await?;
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let bodies = bodies_via_get(&ch, "keep").await?;
    let expected: Vec<Vec<u8>> = (1..50u8).map(|i| vec![i]).collect();
    assert_eq!(
        bodies, expected,
        "persistent messages back in order, transient and acked ones gone"
    );
    // The durable binding came back too.
    publish(&ch, "keep.x", "k", b"after", BasicProperties::default()).await?;
    assert_eq!(bodies_via_get(&ch, "keep").await?, vec![b"after".to_vec()]);
    let error = ch
        .queue_declare(
            s("forget"),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        amqp_code(&error),
        Some(404),
        "non-durable queue gone after restart"
    );
    Ok(())
}

fn limits(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut table = FieldTable::default();
    for (key, value) in entries {
        table.insert(s(key), value.clone());
    }
    table
}

async fn max_length_drops_the_oldest(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let args = limits(&[("x-max-length", AMQPValue::LongInt(3))]);
    ch.queue_declare(
        s("capped"),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await?;
    for i in 1..=5u8 {
        let props = BasicProperties::default().with_delivery_mode(2);
        assert!(matches!(
            publish(&ch, "", "capped", &[i], props).await?,
            Confirmation::Ack(_)
        ));
    }
    let args = limits(&[("x-max-length-bytes", AMQPValue::LongLongInt(10))]);
    ch.queue_declare(s("capped-bytes"), QueueDeclareOptions::default(), args)
        .await?;
    for i in 1..=5u8 {
        publish(&ch, "", "capped-bytes", &[i; 4], BasicProperties::default()).await?;
    }
    assert_eq!(
        bodies_via_get(&ch, "capped-bytes").await?,
        vec![vec![4u8; 4], vec![5u8; 4]]
    );
    // The dropped persistent messages are gone from the store too.
    let _ = conn.close(200, s("bye")).await;
    sb.restart().await?;
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    assert_eq!(
        bodies_via_get(&ch, "capped").await?,
        vec![vec![3], vec![4], vec![5]]
    );
    Ok(())
}

async fn overflow_reject_publish_nacks(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = channel(&conn).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let args = limits(&[
        ("x-max-length", AMQPValue::ShortShortInt(2)),
        ("x-overflow", AMQPValue::LongString("reject-publish".into())),
    ]);
    ch.queue_declare(s("strict"), QueueDeclareOptions::default(), args)
        .await?;
    let mut outcomes = Vec::new();
    for i in 1..=4u8 {
        outcomes.push(publish(&ch, "", "strict", &[i], BasicProperties::default()).await?);
    }
    assert!(matches!(outcomes[0], Confirmation::Ack(_)));
    assert!(matches!(outcomes[1], Confirmation::Ack(_)));
    assert!(
        matches!(outcomes[2], Confirmation::Nack(_)),
        "{:?}",
        outcomes[2]
    );
    assert!(matches!(outcomes[3], Confirmation::Nack(_)));
    assert_eq!(bodies_via_get(&ch, "strict").await?, vec![vec![1], vec![2]]);
    // Room again: accepted again.
    assert!(matches!(
        publish(&ch, "", "strict", &[9], BasicProperties::default()).await?,
        Confirmation::Ack(_)
    ));

    let bad = limits(&[("x-overflow", AMQPValue::LongString("bogus".into()))]);
    let error = ch
        .queue_declare(s("bad-overflow"), QueueDeclareOptions::default(), bad)
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&error), Some(406), "{error}");
    let ch = channel(&conn).await?;
    let bad = limits(&[("x-max-length", AMQPValue::LongInt(-1))]);
    let error = ch
        .queue_declare(s("bad-length"), QueueDeclareOptions::default(), bad)
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&error), Some(406), "{error}");
    Ok(())
}

/// A channel.close from the client that crosses the broker's own (a
/// publish to a missing exchange, 404) closes that channel only, in both
/// orders, as RabbitMQ does; a raw client plays each interleaving exactly.
async fn crossing_channel_closes_keep_the_connection(sb: &mut Sandbox) -> anyhow::Result<()> {
    use amq_protocol::protocol::{basic, channel, AMQPClass};
    use spillway_integration_tests::raw;
    use tokio::io::AsyncWriteExt;

    let close = |code: u16| {
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: code,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        }))
    };
    let close_ok = || AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}));
    let publish_to_nowhere = || -> anyhow::Result<Vec<u8>> {
        let mut bytes = raw::method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "no-such-exchange".into(),
                routing_key: "k".into(),
                mandatory: false,
                immediate: false,
            })),
        )?;
        bytes.extend(raw::content_header_frame(1, 0));
        Ok(bytes)
    };
    // The broker's close first: the client, not yet having read it, sends
    // its own; then it reads the broker's and answers close-ok (amqp091-go
    // and the spec), or takes the broker's close-ok as the end and opens the
    // channel again (both are seen in clients).
    for answers_close_ok in [true, false] {
        let mut socket = raw::open_connection(sb, 131_072, 16).await?;
        raw::open_channels(&mut socket, 2).await?;
        socket.write_all(&publish_to_nowhere()?).await?;
        let (id, method) = crossing_read_method(&mut socket).await?;
        let AMQPClass::Channel(channel::AMQPMethod::Close(closed)) = method else {
            anyhow::bail!("expected the broker's channel.close, got {method:?}");
        };
        anyhow::ensure!(id == 1 && closed.reply_code == 404, "{id} {closed:?}");
        raw::send_method(&mut socket, 1, close(200)).await?;
        let (id, method) = crossing_read_method(&mut socket).await?;
        anyhow::ensure!(
            id == 1 && method == close_ok(),
            "the crossing close got {method:?} on {id}, not channel.close-ok"
        );
        if answers_close_ok {
            raw::send_method(&mut socket, 1, close_ok()).await?;
        }
        raw::send_channel_open(&mut socket, 1).await?;
        let (id, method) = crossing_read_method(&mut socket).await?;
        anyhow::ensure!(
            id == 1 && matches!(method, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))),
            "reopening channel 1 got {method:?} on {id}"
        );
        crossing_still_serves(&mut socket, "crossing-a").await?;
    }

    // The client's close first, in the same write as the publish: the
    // broker answers close-ok, and whatever the engine then says of the
    // publish does not close anything else.
    let mut socket = raw::open_connection(sb, 131_072, 16).await?;
    raw::open_channels(&mut socket, 2).await?;
    let mut bytes = publish_to_nowhere()?;
    bytes.extend(raw::method(1, close(200))?);
    socket.write_all(&bytes).await?;
    loop {
        let (id, method) = crossing_read_method(&mut socket).await?;
        anyhow::ensure!(id == 1, "{method:?} on channel {id}");
        if method == close_ok() {
            break;
        }
        // The broker's own close may still cross ours: answer it.
        anyhow::ensure!(
            matches!(method, AMQPClass::Channel(channel::AMQPMethod::Close(_))),
            "{method:?}"
        );
        raw::send_method(&mut socket, 1, close_ok()).await?;
    }
    crossing_still_serves(&mut socket, "crossing-b").await?;
    Ok(())
}

/// Channel 2 of a crossing-close test stays open through it all and must
/// still work after.
async fn crossing_still_serves(
    socket: &mut tokio::net::TcpStream,
    queue_name: &str,
) -> anyhow::Result<()> {
    use amq_protocol::frame::AMQPFrame;
    use amq_protocol::protocol::{queue, AMQPClass};
    use spillway_integration_tests::raw;
    raw::send_method(
        socket,
        2,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: queue_name.into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: true,
            nowait: false,
            arguments: Default::default(),
        })),
    )
    .await?;
    match raw::read_frame(socket).await? {
        AMQPFrame::Method(2, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))) => Ok(()),
        other => anyhow::bail!("channel 2 no longer serves: {other:?}"),
    }
}

/// The next frame, which must be a method.
async fn crossing_read_method(
    socket: &mut tokio::net::TcpStream,
) -> anyhow::Result<(u16, amq_protocol::protocol::AMQPClass)> {
    use amq_protocol::frame::AMQPFrame;
    match spillway_integration_tests::raw::read_frame(socket).await? {
        AMQPFrame::Method(id, method) => Ok((id, method)),
        other => anyhow::bail!("expected a method, got {other:?}"),
    }
}
