//! Message and queue TTL through lapin, in both wirings: the `expiration`
//! property and `x-message-ttl` (the lower wins), expired messages
//! dead-lettered with reason `expired` and RabbitMQ's `x-death`
//! (`original-expiration`), TTL 0, unacked messages that do not expire and
//! requeued ones that do, expiry of payloads that flowed to disk and of
//! persistent messages across a restart (nothing left in the store),
//! `x-expires`, and the arguments refused.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use spillway_integration_tests::amqp::*;
use spillway_integration_tests::{both_wirings, eventually, next_delivery, publish, Sandbox};
use spillway_proto::management::{argument_value, ListQueuesRequest};

both_wirings!(
    timeout_secs = 90;
    per_message_ttl_dead_letters_with_x_death_reason_expired,
    queue_ttl_expires_and_the_lower_ttl_wins,
    ttl_zero_is_delivered_at_once_or_expires,
    unacked_messages_do_not_expire_and_requeued_ones_do,
    expired_payloads_that_flowed_to_disk_leave_the_store,
    persistent_expiry_survives_a_restart,
    x_expires_deletes_an_unused_queue,
    bad_ttl_arguments_and_expirations_are_refused,
);

/// Dead letters of the queue go to `target` through the default exchange.
fn dead_letters_to(target: &str) -> Vec<(&'static str, AMQPValue)> {
    vec![
        ("x-dead-letter-exchange", text("")),
        ("x-dead-letter-routing-key", text(target)),
    ]
}

/// Checks the single `x-death` entry of a message that expired in `queue`.
fn assert_expired_in(props: &BasicProperties, queue: &str, original_expiration: Option<&str>) {
    let death = deaths(props);
    assert_eq!(death.len(), 1, "one death: {death:?}");
    assert_eq!(field(&death[0], "reason").as_deref(), Some("expired"));
    assert_eq!(field(&death[0], "queue").as_deref(), Some(queue));
    assert_eq!(integer(death[0].inner().get("count")), Some(1));
    assert_eq!(field(&death[0], "exchange").as_deref(), Some(""));
    assert_eq!(routing_keys(&death[0]), vec![queue.to_string()]);
    assert!(
        matches!(death[0].inner().get("time"), Some(AMQPValue::Timestamp(_))),
        "time is a timestamp"
    );
    assert_eq!(
        field(&death[0], "original-expiration").as_deref(),
        original_expiration
    );
    // RabbitMQ removes the expiration from the dead letter.
    assert_eq!(props.expiration(), &None);
    assert_eq!(
        string(header(props, "x-first-death-reason")).as_deref(),
        Some("expired")
    );
    assert_eq!(
        string(header(props, "x-first-death-queue")).as_deref(),
        Some(queue)
    );
}

/// The queue as management shows it (None: it does not exist). Asking
/// management is not a use of the queue, for `x-expires`.
async fn queue_info(
    sb: &Sandbox,
    name: &str,
) -> anyhow::Result<Option<spillway_proto::management::Queue>> {
    let mut management = sb.management().await?;
    let queues = management
        .list_queues(ListQueuesRequest { vhost: "/".into() })
        .await?
        .into_inner()
        .queues;
    Ok(queues.into_iter().find(|queue| queue.name == name))
}

/// A message with an `expiration` that nobody consumes is dead-lettered
/// with reason `expired`; its `x-death` keeps the expiration as
/// `original-expiration` and the dead letter has none.
async fn per_message_ttl_dead_letters_with_x_death_reason_expired(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "pm-dead", false, FieldTable::default()).await?;
    declare(&ch, "pm-ttl", false, table(&dead_letters_to("pm-dead"))).await?;
    let mut headers = FieldTable::default();
    headers.insert(s("app"), text("kept"));
    let props = BasicProperties::default()
        .with_expiration(s("150"))
        .with_headers(headers)
        .with_content_type(s("text/plain"));
    publish(&ch, "", "pm-ttl", b"short-lived", props).await?;
    // One without an expiration stays.
    publish(&ch, "", "pm-ttl", b"lasting", BasicProperties::default()).await?;
    let dead = get(&ch, "pm-dead").await?;
    assert_eq!(dead.delivery.data, b"short-lived");
    assert_expired_in(&dead.delivery.properties, "pm-ttl", Some("150"));
    assert_eq!(
        dead.delivery
            .properties
            .content_type()
            .as_ref()
            .map(|t| t.as_str()),
        Some("text/plain")
    );
    assert_eq!(
        string(header(&dead.delivery.properties, "app")).as_deref(),
        Some("kept")
    );
    dead.delivery.ack(BasicAckOptions::default()).await?;
    assert_eq!(message_count(&ch, "pm-ttl").await?, 1);
    let lasting = get(&ch, "pm-ttl").await?;
    assert_eq!(lasting.delivery.data, b"lasting");
    close(ch, conn).await
}

/// `x-message-ttl` expires what waits too long; with an `expiration` too,
/// the lower wins either way. Management shows the arguments, and the
/// queue's depth and bytes drop.
async fn queue_ttl_expires_and_the_lower_ttl_wins(sb: &mut Sandbox) -> anyhow::Result<()> {
    let sb: &Sandbox = sb;
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "qt-dead", false, FieldTable::default()).await?;
    let mut short = dead_letters_to("qt-dead");
    short.push(("x-message-ttl", AMQPValue::LongInt(200)));
    declare(&ch, "qt-short", false, table(&short)).await?;
    let mut long = dead_letters_to("qt-dead");
    long.push(("x-message-ttl", AMQPValue::LongInt(600_000)));
    declare(&ch, "qt-long", false, table(&long)).await?;
    let info = queue_info(sb, "qt-short").await?.expect("qt-short exists");
    let ttl = info
        .arguments
        .get("x-message-ttl")
        .and_then(|value| value.value.clone());
    assert_eq!(ttl, Some(argument_value::Value::IntValue(200)));

    // Queue TTL 200 ms below the message's 10 minutes.
    publish(
        &ch,
        "",
        "qt-short",
        &[7u8; 1000],
        BasicProperties::default().with_expiration(s("600000")),
    )
    .await?;
    // Message TTL 100 ms below the queue's 10 minutes.
    publish(
        &ch,
        "",
        "qt-long",
        b"by-message",
        BasicProperties::default().with_expiration(s("100")),
    )
    .await?;
    let first = get(&ch, "qt-dead").await?;
    let second = get(&ch, "qt-dead").await?;
    let mut dead = [first, second];
    dead.sort_by_key(|got| got.delivery.data.len());
    assert_eq!(dead[0].delivery.data, b"by-message");
    assert_expired_in(&dead[0].delivery.properties, "qt-long", Some("100"));
    assert_eq!(dead[1].delivery.data, vec![7u8; 1000]);
    assert_expired_in(&dead[1].delivery.properties, "qt-short", Some("600000"));
    for got in dead {
        got.delivery.ack(BasicAckOptions::default()).await?;
    }
    let status = queue_info(sb, "qt-short")
        .await?
        .and_then(|queue| queue.status)
        .expect("qt-short has a status");
    assert_eq!((status.messages, status.bytes), (0, 0));
    // Counted in the metrics.
    let metric = "spillway_dead_lettered_total{vhost=\"/\",queue=\"qt-short\",reason=\"expired\"}";
    eventually(WAIT, || async {
        sb.engine_metric(metric)
            .await
            .ok()
            .filter(|count| *count == 1.0)
    })
    .await?;
    close(ch, conn).await
}

/// TTL 0: a consumer that can take the message gets it; with nobody to
/// take it at once it expires (dead-lettered), and basic.get never sees it.
async fn ttl_zero_is_delivered_at_once_or_expires(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "z-dead", false, FieldTable::default()).await?;
    declare(&ch, "z-ttl", false, table(&dead_letters_to("z-dead"))).await?;
    let zero = BasicProperties::default().with_expiration(s("0"));
    publish(&ch, "", "z-ttl", b"nobody", zero.clone()).await?;
    let got = ch
        .basic_get(s("z-ttl"), BasicGetOptions { no_ack: true })
        .await?;
    assert!(got.is_none(), "an expired message was handed out");
    let dead = get(&ch, "z-dead").await?;
    assert_eq!(dead.delivery.data, b"nobody");
    assert_expired_in(&dead.delivery.properties, "z-ttl", Some("0"));
    dead.delivery.ack(BasicAckOptions::default()).await?;

    let consumer_ch = conn.create_channel().await?;
    let mut consumer = consumer_ch
        .basic_consume(
            s("z-ttl"),
            s("z"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    publish(&ch, "", "z-ttl", b"taken", zero).await?;
    let delivery = next_delivery(&mut consumer, WAIT).await?;
    assert_eq!(delivery.data, b"taken");
    // As published: the expiration is still there.
    assert_eq!(
        delivery
            .properties
            .expiration()
            .as_ref()
            .map(|e| e.as_str()),
        Some("0")
    );
    delivery.ack(BasicAckOptions::default()).await?;
    assert_eq!(message_count(&ch, "z-dead").await?, 0);
    consumer_ch.close(200, s("bye")).await?;
    close(ch, conn).await
}

/// A delivered, unacknowledged message does not expire; requeued after its
/// time, it expires at once (RabbitMQ's rule).
async fn unacked_messages_do_not_expire_and_requeued_ones_do(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "u-dead", false, FieldTable::default()).await?;
    let mut args = dead_letters_to("u-dead");
    args.push(("x-message-ttl", AMQPValue::LongInt(300)));
    declare(&ch, "u-ttl", false, table(&args)).await?;
    publish(&ch, "", "u-ttl", b"held", BasicProperties::default()).await?;
    publish(&ch, "", "u-ttl", b"waiting", BasicProperties::default()).await?;
    let held = get(&ch, "u-ttl").await?;
    assert_eq!(held.delivery.data, b"held");
    // The one left in the queue expires...
    let dead = get(&ch, "u-dead").await?;
    assert_eq!(dead.delivery.data, b"waiting");
    dead.delivery.ack(BasicAckOptions::default()).await?;
    // ... the held one is still ours (its time has passed by now).
    assert_eq!(message_count(&ch, "u-ttl").await?, 0);
    held.delivery
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await?;
    let dead = get(&ch, "u-dead").await?;
    assert_eq!(dead.delivery.data, b"held");
    assert_expired_in(&dead.delivery.properties, "u-ttl", None);
    assert_eq!(message_count(&ch, "u-ttl").await?, 0);
    close(ch, conn).await
}

/// Messages whose payloads flowed to disk expire too: the queue empties,
/// and what the store held for them — transient payloads that were spilled
/// and persistent records with their queue entries — is deleted.
async fn expired_payloads_that_flowed_to_disk_leave_the_store(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let config = "[engine]\nflow_to_disk_threshold = 65536\nhousekeeping_interval = \"100ms\"\n";
    let sandbox = Sandbox::start_with_config(sb.wiring(), config).await?;
    let conn = sandbox.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let transient_args = table(&[("x-message-ttl", AMQPValue::LongInt(4000))]);
    declare(&ch, "spill-transient", false, transient_args).await?;
    let durable_args = table(&[("x-message-ttl", AMQPValue::LongInt(4000))]);
    declare(&ch, "spill-durable", true, durable_args).await?;
    for i in 0..48u8 {
        publish(
            &ch,
            "",
            "spill-transient",
            &[i; 8192],
            BasicProperties::default(),
        )
        .await?;
        publish(
            &ch,
            "",
            "spill-durable",
            &[i; 8192],
            BasicProperties::default().with_delivery_mode(2),
        )
        .await?;
    }
    // Both flowed to disk (transient payloads spilled, persistent ones
    // stored and spilled) before their time.
    let spilled = |queue: &'static str| {
        format!("spillway_queue_spilled_bytes{{vhost=\"/\",queue=\"{queue}\"}}")
    };
    eventually(WAIT, || async {
        let transient = sandbox.engine_metric(&spilled("spill-transient")).await;
        let durable = sandbox.engine_metric(&spilled("spill-durable")).await;
        matches!((transient, durable), (Ok(t), Ok(d)) if t > 0.0 && d > 0.0)
    })
    .await?;
    let stored = sandbox.store_status(true).await?;
    assert!(
        stored.message_records > 0 && stored.queue_entries > 0,
        "{stored:?}"
    );
    // Then they expire: nothing left in the queues or the store.
    eventually(Duration::from_secs(20), || async {
        let mut empty = true;
        for queue in ["spill-transient", "spill-durable"] {
            let status = queue_info(&sandbox, queue)
                .await
                .ok()
                .flatten()
                .and_then(|queue| queue.status);
            empty &= status.is_some_and(|status| {
                status.messages == 0 && status.bytes == 0 && status.spilled_bytes == 0
            });
        }
        empty
    })
    .await?;
    eventually(WAIT, || async {
        sandbox
            .store_status(true)
            .await
            .ok()
            .filter(|status| status.message_records == 0 && status.queue_entries == 0)
    })
    .await?;
    let discarded =
        "spillway_discarded_total{vhost=\"/\",queue=\"spill-durable\",reason=\"expired\"}";
    assert_eq!(sandbox.engine_metric(discarded).await?, 48.0);
    close(ch, conn).await
}

/// A persistent message keeps its expiry in the store: after a restart it
/// still expires (dead-lettered, from durable queue to durable queue), and
/// one without an expiry is still there.
async fn persistent_expiry_survives_a_restart(sb: &mut Sandbox) -> anyhow::Result<()> {
    {
        let conn = sb.connect().await?;
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        declare(&ch, "r-dead", true, FieldTable::default()).await?;
        declare(&ch, "r-ttl", true, table(&dead_letters_to("r-dead"))).await?;
        let persistent = BasicProperties::default().with_delivery_mode(2);
        publish(
            &ch,
            "",
            "r-ttl",
            b"mortal",
            persistent.clone().with_expiration(s("2000")),
        )
        .await?;
        publish(&ch, "", "r-ttl", b"lasting", persistent).await?;
        close(ch, conn).await?;
    }
    sb.restart().await?;
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    let dead = get(&ch, "r-dead").await?;
    assert_eq!(dead.delivery.data, b"mortal");
    assert_eq!(dead.delivery.properties.delivery_mode(), &Some(2));
    assert_expired_in(&dead.delivery.properties, "r-ttl", Some("2000"));
    dead.delivery.ack(BasicAckOptions::default()).await?;
    assert_eq!(message_count(&ch, "r-ttl").await?, 1);
    // In the store: the one left, nothing of the dead-lettered one (the
    // ack's delete is not waited for).
    let sb: &Sandbox = sb;
    eventually(WAIT, || async {
        sb.store_status(true)
            .await
            .ok()
            .filter(|stored| (stored.message_records, stored.queue_entries) == (1, 1))
    })
    .await?;
    let lasting = get(&ch, "r-ttl").await?;
    assert_eq!(lasting.delivery.data, b"lasting");
    close(ch, conn).await
}

/// `x-expires`: a queue nobody uses for that long is deleted (a durable
/// one from the store too); a consumer keeps it, and it goes once the
/// consumer has left.
async fn x_expires_deletes_an_unused_queue(sb: &mut Sandbox) -> anyhow::Result<()> {
    let sb: &Sandbox = sb;
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    let args = table(&[("x-expires", AMQPValue::LongInt(1500))]);
    declare(&ch, "xe-unused", true, args.clone()).await?;
    declare(&ch, "xe-consumed", false, args.clone()).await?;
    publish(
        &ch,
        "",
        "xe-unused",
        b"gone with it",
        BasicProperties::default(),
    )
    .await?;
    let consumer_ch = conn.create_channel().await?;
    // Kept: lapin cancels a consumer it drops.
    let consumer = consumer_ch
        .basic_consume(
            s("xe-consumed"),
            s("keeper"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let info = queue_info(sb, "xe-unused")
        .await?
        .expect("xe-unused exists");
    assert_eq!(
        info.arguments
            .get("x-expires")
            .and_then(|value| value.value.clone()),
        Some(argument_value::Value::IntValue(1500))
    );
    eventually(WAIT, || async {
        queue_info(sb, "xe-unused")
            .await
            .is_ok_and(|queue| queue.is_none())
    })
    .await?;
    // Deleted from the store too (the write follows at once).
    let store = sb.storage_api()?;
    eventually(WAIT, || async {
        store
            .load_definitions()
            .await
            .is_ok_and(|definitions| !definitions.queues.iter().any(|q| q.name == "xe-unused"))
    })
    .await?;
    // The consumed one outlived it; without its consumer it goes too.
    assert!(queue_info(sb, "xe-consumed").await?.is_some());
    consumer_ch
        .basic_cancel(s("keeper"), BasicCancelOptions::default())
        .await?;
    drop(consumer);
    eventually(WAIT, || async {
        queue_info(sb, "xe-consumed")
            .await
            .is_ok_and(|queue| queue.is_none())
    })
    .await?;
    consumer_ch.close(200, s("bye")).await?;
    close(ch, conn).await
}

/// TTL arguments that are not what RabbitMQ accepts, and an `expiration`
/// that is not a non-negative integer, are refused with 406 in RabbitMQ's
/// words.
async fn bad_ttl_arguments_and_expirations_are_refused(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let cases = [
        (
            "x-message-ttl",
            AMQPValue::LongInt(-1),
            "invalid arg 'x-message-ttl' for queue 'bad' in vhost '/': {value_negative,-1}",
        ),
        (
            "x-message-ttl",
            text("1000"),
            "invalid arg 'x-message-ttl' for queue 'bad' in vhost '/': \"expected integer, got longstr\"",
        ),
        (
            "x-expires",
            AMQPValue::LongInt(0),
            "invalid arg 'x-expires' for queue 'bad' in vhost '/': {value_zero,0}",
        ),
        (
            "x-expires",
            AMQPValue::LongLongInt(-5),
            "invalid arg 'x-expires' for queue 'bad' in vhost '/': {value_negative,-5}",
        ),
    ];
    for (key, value, wanted) in cases {
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
        assert!(message.contains(wanted), "{key}: {message}");
    }
    for (expiration, wanted) in [
        ("soon", "invalid expiration 'soon': no_integer"),
        ("-1", "invalid expiration '-1': {value_negative,-1}"),
        ("10s", "invalid expiration '10s': {leftover_string,\"s\"}"),
    ] {
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        declare(&ch, "ttl-target", false, FieldTable::default()).await?;
        let published = publish(
            &ch,
            "",
            "ttl-target",
            b"x",
            BasicProperties::default().with_expiration(s(expiration)),
        )
        .await;
        // The channel is closed with 406 (the publish, or the next call on
        // the channel, reports it).
        let error = match published {
            Err(error) => error,
            Ok(_) => declare(&ch, "ttl-target", false, FieldTable::default())
                .await
                .expect_err("the channel was closed"),
        };
        let message = error.to_string();
        assert!(
            message.contains("406") || message.contains("PRECONDITION_FAILED"),
            "{expiration}: {message}"
        );
        assert!(message.contains(wanted), "{expiration}: {message}");
    }
    let ch = conn.create_channel().await?;
    assert_eq!(message_count(&ch, "ttl-target").await?, 0);
    close(ch, conn).await
}
