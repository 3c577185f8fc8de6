//! `x-queue-type` as RabbitMQ users write it, in both wirings: `classic`
//! and `quorum` are served, a quorum queue has RabbitMQ 4's delivery limit
//! of 20 unless one is set and must be durable, `stream` is refused with a
//! 406 until streams exist.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use spillway_integration_tests::amqp::*;
use spillway_integration_tests::{both_wirings, publish, Sandbox};

both_wirings!(
    timeout_secs = 90;
    quorum_and_classic_queues_are_declared_and_stream_is_refused,
    a_quorum_queue_dead_letters_after_twenty_redeliveries,
);

fn queue_type(kind: &str) -> FieldTable {
    table(&[("x-queue-type", text(kind))])
}

/// The reply code and text a refused declare closed its channel with.
fn refusal(error: anyhow::Error) -> (Option<u16>, String) {
    let code = match error.downcast_ref::<lapin::Error>().map(lapin::Error::kind) {
        Some(lapin::ErrorKind::ProtocolError(e)) => Some(e.get_id()),
        _ => None,
    };
    (code, error.to_string())
}

async fn quorum_and_classic_queues_are_declared_and_stream_is_refused(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "orders", true, queue_type("quorum")).await?;
    declare(&ch, "events", true, queue_type("classic")).await?;
    declare(&ch, "scratch", false, queue_type("classic")).await?;
    // Redeclared alike: fine (no type is classic); as another type:
    // inequivalent.
    declare(&ch, "orders", true, queue_type("quorum")).await?;
    declare(&ch, "events", true, FieldTable::default()).await?;
    let error = declare(&ch, "orders", true, queue_type("classic"))
        .await
        .expect_err("redeclared as classic");
    let (code, text) = refusal(error);
    assert_eq!(code, Some(406), "{text}");
    assert!(text.contains("inequivalent arg 'x-queue-type'"), "{text}");
    let cases: [(&str, bool, FieldTable, &str); 4] = [
        (
            "log",
            true,
            queue_type("stream"),
            "stream queues are not supported",
        ),
        ("odd", true, queue_type("lazy"), "unknown queue type 'lazy'"),
        (
            "typed",
            true,
            table(&[("x-queue-type", AMQPValue::LongInt(1))]),
            "expected longstr",
        ),
        (
            "fleeting",
            false,
            queue_type("quorum"),
            "invalid property 'non-durable' for queue 'fleeting'",
        ),
    ];
    for (name, durable, args, expected) in cases {
        let ch = conn.create_channel().await?;
        let error = declare(&ch, name, durable, args).await.expect_err(name);
        let (code, text) = refusal(error);
        assert_eq!(code, Some(406), "{name}: {text}");
        assert!(text.contains(expected), "{name}: {text}");
    }
    // The connection is fine, and the refused queues do not exist.
    let ch = conn.create_channel().await?;
    let error = ch
        .queue_declare(
            s("log"),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect_err("a refused queue exists");
    assert!(
        error.to_string().contains("404") || error.to_string().contains("NOT_FOUND"),
        "{error}"
    );
    conn.close(200, s("bye")).await?;
    Ok(())
}

/// RabbitMQ 4: a quorum queue without `x-delivery-limit` allows 20
/// redeliveries, so the 21st reject dead-letters the message.
async fn a_quorum_queue_dead_letters_after_twenty_redeliveries(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    fanout_to_queue(&ch, "dlx", "dead").await?;
    let args = table(&[
        ("x-queue-type", text("quorum")),
        ("x-dead-letter-exchange", text("dlx")),
    ]);
    declare(&ch, "work", true, args).await?;
    publish(&ch, "", "work", b"poison", BasicProperties::default()).await?;
    let mut deliveries = 0;
    loop {
        let message = ch.basic_get(s("work"), BasicGetOptions::default()).await?;
        let Some(message) = message else {
            break;
        };
        deliveries += 1;
        assert!(deliveries <= 21, "delivered more than 21 times");
        message
            .delivery
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await?;
    }
    assert_eq!(deliveries, 21, "one delivery and twenty redeliveries");
    let dead = get(&ch, "dead").await?;
    assert_eq!(dead.delivery.data, b"poison");
    conn.close(200, s("bye")).await?;
    Ok(())
}
