//! Alternate exchanges, as RabbitMQ documents them: an exchange declared
//! with `alternate-exchange` hands every message that matches none of its
//! bindings to that exchange; a mandatory publish the alternate exchange
//! routes is not returned; alternates of alternates are followed, and loops
//! among them end; an exchange reached by an exchange-to-exchange binding
//! uses its own alternate. Declaring one checks the argument's type and a
//! redeclare must repeat it. (The permission it needs is in
//! `permission_escapes.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, ExchangeKind};
use spillway_integration_tests::amqp::{
    amqp_code, fanout_to_queue, get, message_count, s, table, text,
};
use spillway_integration_tests::{both_wirings, Sandbox};

both_wirings!(
    timeout_secs = 60;
    unroutable_messages_go_to_the_alternate_exchange,
    alternates_of_alternates_are_followed_and_loops_end,
    an_exchange_reached_by_a_binding_uses_its_own_alternate,
    the_argument_is_checked_and_must_be_repeated,
    a_durable_exchange_keeps_its_alternate_across_a_restart,
);

async fn declare_exchange(
    ch: &Channel,
    name: &str,
    kind: ExchangeKind,
    alternate: Option<&str>,
) -> anyhow::Result<()> {
    let arguments = match alternate {
        Some(alternate) => table(&[("alternate-exchange", text(alternate))]),
        None => FieldTable::default(),
    };
    ch.exchange_declare(s(name), kind, ExchangeDeclareOptions::default(), arguments)
        .await?;
    Ok(())
}

async fn bind(ch: &Channel, queue: &str, exchange: &str, key: &str) -> anyhow::Result<()> {
    ch.queue_declare(
        s(queue),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.queue_bind(
        s(queue),
        s(exchange),
        s(key),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

/// Publishes with `mandatory` on a confirm channel; true when the broker
/// returned the message (no queue took it).
async fn returned(ch: &Channel, exchange: &str, key: &str, body: &[u8]) -> anyhow::Result<bool> {
    let confirmation = ch
        .basic_publish(
            s(exchange),
            s(key),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            body,
            BasicProperties::default(),
        )
        .await?
        .await?;
    match confirmation {
        Confirmation::Ack(returned) => Ok(returned.is_some()),
        other => anyhow::bail!("publish not acked: {other:?}"),
    }
}

async fn unroutable_messages_go_to_the_alternate_exchange(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    fanout_to_queue(&ch, "ae.unrouted", "ae.unrouted.q").await?;
    declare_exchange(&ch, "ae.orders", ExchangeKind::Direct, Some("ae.unrouted")).await?;
    bind(&ch, "ae.orders.q", "ae.orders", "order").await?;

    assert!(!returned(&ch, "ae.orders", "order", b"routed").await?);
    assert!(
        !returned(&ch, "ae.orders", "refund", b"unrouted").await?,
        "a mandatory publish the alternate exchange routes is not returned"
    );
    assert_eq!(get(&ch, "ae.orders.q").await?.delivery.data, b"routed");
    assert_eq!(get(&ch, "ae.unrouted.q").await?.delivery.data, b"unrouted");
    assert_eq!(message_count(&ch, "ae.orders.q").await?, 0);
    assert_eq!(message_count(&ch, "ae.unrouted.q").await?, 0);

    // A routed message does not also go to the alternate.
    assert!(!returned(&ch, "ae.orders", "order", b"routed again").await?);
    assert_eq!(message_count(&ch, "ae.unrouted.q").await?, 0);

    // The alternate gone: the message is returned again.
    ch.exchange_delete(s("ae.unrouted"), ExchangeDeleteOptions::default())
        .await?;
    assert!(returned(&ch, "ae.orders", "refund", b"nowhere").await?);

    // The alternate declared again by name is used again.
    fanout_to_queue(&ch, "ae.unrouted", "ae.unrouted.q").await?;
    assert!(!returned(&ch, "ae.orders", "refund", b"back").await?);
    assert_eq!(get(&ch, "ae.unrouted.q").await?.delivery.data, b"back");
    Ok(())
}

async fn alternates_of_alternates_are_followed_and_loops_end(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    // chain.a → (no match) chain.b → (no match) chain.c (fanout) → chain.q
    fanout_to_queue(&ch, "chain.c", "chain.q").await?;
    declare_exchange(&ch, "chain.b", ExchangeKind::Direct, Some("chain.c")).await?;
    bind(&ch, "chain.b.q", "chain.b", "b-key").await?;
    declare_exchange(&ch, "chain.a", ExchangeKind::Topic, Some("chain.b")).await?;

    assert!(!returned(&ch, "chain.a", "b-key", b"stops at b").await?);
    assert!(!returned(&ch, "chain.a", "other", b"reaches c").await?);
    assert_eq!(get(&ch, "chain.b.q").await?.delivery.data, b"stops at b");
    assert_eq!(get(&ch, "chain.q").await?.delivery.data, b"reaches c");

    // loop.x and loop.y name each other and route nothing: the message is
    // returned, once, and the connection lives on.
    declare_exchange(&ch, "loop.x", ExchangeKind::Direct, Some("loop.y")).await?;
    declare_exchange(&ch, "loop.y", ExchangeKind::Direct, Some("loop.x")).await?;
    assert!(returned(&ch, "loop.x", "k", b"round and round").await?);
    // A loop that passes a queue on the way delivers there once.
    bind(&ch, "loop.y.q", "loop.y", "k").await?;
    assert!(!returned(&ch, "loop.x", "k", b"once").await?);
    assert_eq!(get(&ch, "loop.y.q").await?.delivery.data, b"once");
    assert_eq!(message_count(&ch, "loop.y.q").await?, 0);
    assert!(conn.status().connected());
    Ok(())
}

async fn an_exchange_reached_by_a_binding_uses_its_own_alternate(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    fanout_to_queue(&ch, "e2e.ae", "e2e.ae.q").await?;
    fanout_to_queue(&ch, "e2e.source.ae", "e2e.source.ae.q").await?;
    declare_exchange(&ch, "e2e.inner", ExchangeKind::Direct, Some("e2e.ae")).await?;
    declare_exchange(
        &ch,
        "e2e.source",
        ExchangeKind::Topic,
        Some("e2e.source.ae"),
    )
    .await?;
    ch.exchange_bind(
        s("e2e.inner"),
        s("e2e.source"),
        s("app.#"),
        ExchangeBindOptions::default(),
        FieldTable::default(),
    )
    .await?;

    // e2e.source matched (its binding to e2e.inner), so its own alternate
    // is not used; e2e.inner matched nothing, so its alternate is.
    assert!(!returned(&ch, "e2e.source", "app.x", b"inner's alternate").await?);
    assert_eq!(
        get(&ch, "e2e.ae.q").await?.delivery.data,
        b"inner's alternate"
    );
    assert_eq!(message_count(&ch, "e2e.source.ae.q").await?, 0);
    // Nothing matched at e2e.source: its own alternate.
    assert!(!returned(&ch, "e2e.source", "other", b"source's alternate").await?);
    assert_eq!(
        get(&ch, "e2e.source.ae.q").await?.delivery.data,
        b"source's alternate"
    );
    Ok(())
}

async fn the_argument_is_checked_and_must_be_repeated(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;

    let ch = conn.create_channel().await?;
    let refused = ch
        .exchange_declare(
            s("ae.bad-type"),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            table(&[("alternate-exchange", AMQPValue::LongInt(7))]),
        )
        .await
        .expect_err("an alternate-exchange that is not a string is refused");
    assert_eq!(amqp_code(&refused), Some(406));

    let ch = conn.create_channel().await?;
    declare_exchange(&ch, "ae.kept", ExchangeKind::Fanout, Some("ae.one")).await?;
    // The same argument again is fine.
    declare_exchange(&ch, "ae.kept", ExchangeKind::Fanout, Some("ae.one")).await?;
    let refused = ch
        .exchange_declare(
            s("ae.kept"),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            table(&[("alternate-exchange", text("ae.two"))]),
        )
        .await
        .expect_err("a redeclare naming another alternate is refused");
    assert_eq!(amqp_code(&refused), Some(406));
    let ch = conn.create_channel().await?;
    let refused = ch
        .exchange_declare(
            s("ae.kept"),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect_err("a redeclare leaving the alternate out is refused");
    assert_eq!(amqp_code(&refused), Some(406));
    Ok(())
}

async fn a_durable_exchange_keeps_its_alternate_across_a_restart(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.exchange_declare(
        s("ae.durable.alt"),
        ExchangeKind::Fanout,
        durable,
        FieldTable::default(),
    )
    .await?;
    ch.queue_declare(
        s("ae.durable.q"),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_bind(
        s("ae.durable.q"),
        s("ae.durable.alt"),
        s(""),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.exchange_declare(
        s("ae.durable"),
        ExchangeKind::Direct,
        durable,
        table(&[("alternate-exchange", text("ae.durable.alt"))]),
    )
    .await?;
    conn.close(200, s("bye")).await?;

    sb.restart().await?;

    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    assert!(!returned(&ch, "ae.durable", "anything", b"after restart").await?);
    assert_eq!(
        get(&ch, "ae.durable.q").await?.delivery.data,
        b"after restart"
    );
    Ok(())
}
