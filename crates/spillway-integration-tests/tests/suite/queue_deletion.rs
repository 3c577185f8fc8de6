//! When a queue goes away by itself, and when a delete is refused, as
//! RabbitMQ documents it:
//! - auto-delete: deleted when its last `basic.consume` consumer is
//!   cancelled or its channel closes; a queue that never had a consumer
//!   (read with `basic.get` only) is never auto-deleted, and the messages a
//!   `basic.get` client left unacked are requeued when it goes; a durable
//!   auto-delete queue is kept across a restart until a consumer comes and
//!   leaves;
//! - exclusive: deleted with the connection that declared it, locked (405)
//!   to every other;
//! - `x-expires`: `basic.get` renews the lease as a consumer does (the
//!   expiry itself is in `expiry.rs`);
//! - `if-unused` counts consumers only, `if-empty` ready messages only.
//!
//! And `basic.publish` with `immediate=true`, which RabbitMQ removed and
//! refuses with a connection error 540; and unbinds and deletes of what is
//! already gone, which RabbitMQ answers with ok (aio-pika's RPC pattern
//! unbinds its auto-delete reply queue after cancelling its consumer).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use spillway_integration_tests::amqp::{amqp_code, amqp_text, get, message_count, s, table, WAIT};
use spillway_integration_tests::{both_wirings, eventually, publish, Sandbox};
use spillway_proto::management::ListQueuesRequest;

both_wirings!(
    timeout_secs = 90;
    auto_delete_queue_read_with_get_keeps_its_unacked_message,
    auto_delete_queue_goes_with_its_last_consumer_and_its_messages,
    durable_auto_delete_queue_outlives_a_restart_until_a_consumer_leaves,
    exclusive_queue_goes_with_its_connection_and_is_locked_to_others,
    basic_get_renews_the_x_expires_lease,
    if_unused_counts_consumers_and_if_empty_ready_messages,
    immediate_publish_closes_the_connection_with_540,
    unbinding_or_deleting_what_is_gone_answers_ok,
);

async fn declare_auto_delete(ch: &Channel, name: &str, durable: bool) -> anyhow::Result<()> {
    ch.queue_declare(
        s(name),
        QueueDeclareOptions {
            durable,
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

/// The reply code of a passive declare of `name` on a fresh channel of
/// `conn`: None when the queue exists.
async fn passive_error(conn: &Connection, name: &str) -> anyhow::Result<Option<u16>> {
    let ch = conn.create_channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match ch
        .queue_declare(s(name), passive, FieldTable::default())
        .await
    {
        Ok(_) => {
            ch.close(200, s("bye")).await?;
            Ok(None)
        }
        Err(error) => Ok(Some(amqp_code(&error).unwrap_or(0))),
    }
}

async fn wait_until_gone(conn: &Connection, name: &str) -> anyhow::Result<()> {
    eventually(WAIT, || async {
        matches!(passive_error(conn, name).await, Ok(Some(404)))
    })
    .await
    .map_err(|error| error.context(format!("queue '{name}' should have been deleted")))
}

fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

/// A former bug (the queue was deleted, and its unacked message with it):
/// a durable auto-delete queue, one message taken with basic.get and not
/// acked, the connection closed. The queue never had a consumer, so it
/// stays, and the message is requeued.
async fn auto_delete_queue_read_with_get_keeps_its_unacked_message(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let owner = sb.connect().await?;
    let ch = owner.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    declare_auto_delete(&ch, "ad-get", true).await?;
    publish(&ch, "", "ad-get", b"kept", persistent()).await?;
    let taken = get(&ch, "ad-get").await?;
    assert_eq!(taken.delivery.data, b"kept");
    owner.close(200, s("bye")).await?;

    let conn = sb.connect().await?;
    // The close is handled when the requeued message is counted again; a
    // deleted queue answers 404 instead, and fails at once.
    eventually(WAIT, || async {
        let ch = conn.create_channel().await.ok()?;
        match message_count(&ch, "ad-get").await {
            Ok(1) => Some(Ok(())),
            Ok(_) => None,
            Err(error) => Some(Err(error)),
        }
    })
    .await??;
    let ch = conn.create_channel().await?;
    let again = get(&ch, "ad-get").await?;
    assert_eq!(again.delivery.data, b"kept");
    assert!(
        again.delivery.redelivered,
        "a requeued message is redelivered"
    );
    again.delivery.ack(BasicAckOptions::default()).await?;
    ch.close(200, s("bye")).await?;
    assert_eq!(passive_error(&conn, "ad-get").await?, None);
    conn.close(200, s("bye")).await?;
    Ok(())
}

/// Two consumers: cancelling one keeps the queue; closing the channel of
/// the last, which holds unacked deliveries, deletes the queue, and the
/// deliveries go with it (RabbitMQ does not bring them back anywhere).
async fn auto_delete_queue_goes_with_its_last_consumer_and_its_messages(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let first = conn.create_channel().await?;
    let last = conn.create_channel().await?;
    declare_auto_delete(&first, "ad-consumed", true).await?;
    // Kept until cancelled below: lapin cancels a consumer it drops, which
    // would delete the queue before the second consumer comes.
    let _first_consumer = first
        .basic_consume(
            s("ad-consumed"),
            s("first"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut consumer = last
        .basic_consume(
            s("ad-consumed"),
            s("last"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    first
        .basic_cancel(s("first"), BasicCancelOptions::default())
        .await?;
    assert_eq!(
        passive_error(&conn, "ad-consumed").await?,
        None,
        "a consumer is left: the queue stays"
    );

    let publisher = conn.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for body in [&b"one"[..], &b"two"[..]] {
        publish(&publisher, "", "ad-consumed", body, persistent()).await?;
    }
    for _ in 0..2 {
        tokio::time::timeout(WAIT, consumer.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("the consumer ended"))??;
    }
    last.close(200, s("bye")).await?;
    wait_until_gone(&conn, "ad-consumed").await?;

    // Declared again, it is a new, empty queue: the unacked deliveries went
    // with the old one, in memory and in the store.
    let ch = conn.create_channel().await?;
    declare_auto_delete(&ch, "ad-consumed", true).await?;
    assert_eq!(message_count(&ch, "ad-consumed").await?, 0);
    ch.queue_delete(s("ad-consumed"), QueueDeleteOptions::default())
        .await?;
    conn.close(200, s("bye")).await?;
    sb.restart().await?;
    let conn = sb.connect().await?;
    assert_eq!(passive_error(&conn, "ad-consumed").await?, Some(404));
    conn.close(200, s("bye")).await?;
    Ok(())
}

/// A durable auto-delete queue comes back after a restart with its
/// persistent messages, with no consumer yet, so it stays; once a consumer
/// has come and been cancelled it goes, for good.
async fn durable_auto_delete_queue_outlives_a_restart_until_a_consumer_leaves(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    declare_auto_delete(&ch, "ad-durable", true).await?;
    publish(&ch, "", "ad-durable", b"stored", persistent()).await?;
    conn.close(200, s("bye")).await?;

    sb.restart().await?;
    sb.wait_for_recovery().await?;
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    assert_eq!(message_count(&ch, "ad-durable").await?, 1);
    let mut consumer = ch
        .basic_consume(
            s("ad-durable"),
            s("visitor"),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let delivery = tokio::time::timeout(WAIT, consumer.next())
        .await?
        .ok_or_else(|| anyhow::anyhow!("the consumer ended"))??;
    assert_eq!(delivery.data, b"stored");
    ch.basic_cancel(s("visitor"), BasicCancelOptions::default())
        .await?;
    wait_until_gone(&conn, "ad-durable").await?;
    conn.close(200, s("bye")).await?;

    sb.restart().await?;
    let conn = sb.connect().await?;
    assert_eq!(passive_error(&conn, "ad-durable").await?, Some(404));
    conn.close(200, s("bye")).await?;
    Ok(())
}

/// An exclusive queue is the declaring connection's: another connection
/// gets 405 RESOURCE_LOCKED for it; it goes when its connection closes,
/// with the messages it held, unacked ones too.
async fn exclusive_queue_goes_with_its_connection_and_is_locked_to_others(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let owner = sb.connect().await?;
    let ch = owner.create_channel().await?;
    ch.queue_declare(
        s("ex-owned"),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    for body in [&b"held"[..], &b"ready"[..]] {
        publish(&ch, "", "ex-owned", body, BasicProperties::default()).await?;
    }
    let held = get(&ch, "ex-owned").await?;
    assert_eq!(held.delivery.data, b"held");

    let other = sb.connect().await?;
    assert_eq!(passive_error(&other, "ex-owned").await?, Some(405));
    let och = other.create_channel().await?;
    let error = och
        .basic_get(s("ex-owned"), BasicGetOptions { no_ack: true })
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&error), Some(405), "{error}");

    owner.close(200, s("bye")).await?;
    wait_until_gone(&other, "ex-owned").await?;
    other.close(200, s("bye")).await?;
    Ok(())
}

/// `x-expires` deletes a queue unused for that long; basic.get is a use, as
/// a consumer or a redeclare is. Read every 100 ms for twice its lease, the
/// queue is there at each read; left alone, it goes.
async fn basic_get_renews_the_x_expires_lease(sb: &mut Sandbox) -> anyhow::Result<()> {
    const LEASE: Duration = Duration::from_millis(2000);
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    let args = table(&[("x-expires", AMQPValue::LongInt(LEASE.as_millis() as i32))]);
    ch.queue_declare(s("xe-got"), QueueDeclareOptions::default(), args)
        .await?;
    let started = Instant::now();
    while started.elapsed() < LEASE * 2 {
        // A queue that expired answers 404 and fails the test here.
        ch.basic_get(s("xe-got"), BasicGetOptions { no_ack: true })
            .await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Watched through management, which is not a use (a passive declare
    // would renew the lease).
    let management = sb.management().await?;
    eventually(LEASE + WAIT, || {
        let mut management = management.clone();
        async move {
            management
                .list_queues(ListQueuesRequest { vhost: "/".into() })
                .await
                .is_ok_and(|list| !list.get_ref().queues.iter().any(|q| q.name == "xe-got"))
        }
    })
    .await?;
    conn.close(200, s("bye")).await?;
    Ok(())
}

/// if-unused refuses a queue with a consumer (406) but not one whose only
/// reader is a basic.get client; if-empty refuses ready messages (406) but
/// not unacked ones, which RabbitMQ does not count either.
async fn if_unused_counts_consumers_and_if_empty_ready_messages(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    for name in ["del-consumed", "del-got", "del-ready"] {
        ch.queue_declare(
            s(name),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
        publish(&ch, "", name, b"x", BasicProperties::default()).await?;
    }
    let if_unused = QueueDeleteOptions {
        if_unused: true,
        ..Default::default()
    };
    let if_empty = QueueDeleteOptions {
        if_empty: true,
        ..Default::default()
    };

    let consumer_ch = conn.create_channel().await?;
    // Kept: lapin cancels a consumer it drops.
    let _busy = consumer_ch
        .basic_consume(
            s("del-consumed"),
            s("busy"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let refused = conn.create_channel().await?;
    let error = refused
        .queue_delete(s("del-consumed"), if_unused)
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&error), Some(406), "{error}");
    assert_eq!(passive_error(&conn, "del-consumed").await?, None);

    let taken = get(&ch, "del-got").await?;
    assert_eq!(taken.delivery.data, b"x");
    assert_eq!(ch.queue_delete(s("del-got"), if_unused).await?, 0);
    let refused = conn.create_channel().await?;
    let error = refused
        .queue_delete(s("del-ready"), if_empty)
        .await
        .unwrap_err();
    assert_eq!(amqp_code(&error), Some(406), "{error}");
    let taken = get(&ch, "del-ready").await?;
    assert_eq!(taken.delivery.data, b"x");
    assert_eq!(ch.queue_delete(s("del-ready"), if_empty).await?, 0);
    for gone in ["del-got", "del-ready"] {
        assert_eq!(passive_error(&conn, gone).await?, Some(404), "{gone}");
    }
    conn.close(200, s("bye")).await?;
    Ok(())
}

/// RabbitMQ removed `immediate`: a publish with it closes the connection
/// with `540 NOT_IMPLEMENTED - immediate=true`, and the message is not
/// enqueued.
async fn immediate_publish_closes_the_connection_with_540(sb: &mut Sandbox) -> anyhow::Result<()> {
    let setup = sb.connect().await?;
    let ch = setup.create_channel().await?;
    ch.queue_declare(
        s("imm"),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;

    let conn = sb.connect().await?;
    let mut events = Box::pin(conn.events_listener());
    let pch = conn.create_channel().await?;
    // The publish itself is only written; the answer is the close.
    let _ = pch
        .basic_publish(
            s(""),
            s("imm"),
            BasicPublishOptions {
                immediate: true,
                ..Default::default()
            },
            b"now or never",
            BasicProperties::default(),
        )
        .await;
    let error = tokio::time::timeout(WAIT, async {
        while let Some(event) = events.next().await {
            if let lapin::Event::Error(error) = event {
                return Some(error);
            }
        }
        None
    })
    .await?
    .expect("the connection is closed with an error");
    assert_eq!(amqp_code(&error), Some(540));
    assert_eq!(
        amqp_text(&error).as_deref(),
        Some("NOT_IMPLEMENTED - immediate=true"),
        "RabbitMQ's words (py-amqp's integration tests pin them)"
    );
    eventually(WAIT, || async { !conn.status().connected() }).await?;
    assert_eq!(message_count(&ch, "imm").await?, 0);
    setup.close(200, s("bye")).await?;
    Ok(())
}

/// The auto-delete queue went with its consumer; unbinding it afterwards,
/// unbinding from an exchange that is gone, and deleting either again all
/// answer ok, as RabbitMQ does. The default exchange is still refused.
async fn unbinding_or_deleting_what_is_gone_answers_ok(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.exchange_declare(
        s("gone.x"),
        lapin::ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    declare_auto_delete(&ch, "gone.reply", false).await?;
    ch.queue_bind(
        s("gone.reply"),
        s("gone.x"),
        s("rpc"),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let consumer = ch
        .basic_consume(
            s("gone.reply"),
            s("rpc-consumer"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    ch.basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await?;
    wait_until_gone(&conn, "gone.reply").await?;

    let unbind = |queue: &'static str, exchange: &'static str| {
        let ch = ch.clone();
        async move {
            ch.queue_unbind(s(queue), s(exchange), s("rpc"), FieldTable::default())
                .await
        }
    };
    unbind("gone.reply", "gone.x").await?;
    unbind("never.there", "never.there.x").await?;
    ch.exchange_unbind(
        s("gone.x"),
        s("never.there.x"),
        s("k"),
        ExchangeUnbindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.queue_delete(s("gone.reply"), QueueDeleteOptions::default())
        .await?;
    ch.exchange_delete(s("gone.x"), ExchangeDeleteOptions::default())
        .await?;
    ch.exchange_delete(s("gone.x"), ExchangeDeleteOptions::default())
        .await?;
    unbind("gone.reply", "gone.x").await?;

    // Both ends there, no such binding: ok too.
    declare_auto_delete(&ch, "gone.other", false).await?;
    ch.queue_unbind(
        s("gone.other"),
        s("amq.direct"),
        s("none"),
        FieldTable::default(),
    )
    .await?;
    // The default exchange stays off limits.
    let refused = ch
        .queue_unbind(
            s("gone.other"),
            s(""),
            s("gone.other"),
            FieldTable::default(),
        )
        .await
        .expect_err("unbinding from the default exchange is refused");
    assert_eq!(amqp_code(&refused), Some(403));
    conn.close(200, s("bye")).await?;
    Ok(())
}
