//! Which consumer a message goes to, beyond round robin, as RabbitMQ
//! documents it:
//! - consumer priorities (`x-priority` on basic.consume): a queue offers a
//!   message to a lower priority only while every higher one has no room
//!   (prefetch or credit); equal priorities share round robin;
//! - single active consumer (`x-single-active-consumer` on the queue): one
//!   consumer receives, the earliest; when it cancels, its channel closes or
//!   its connection goes, the next in line takes over and receives what the
//!   gone one left unacked. Management names the active one;
//! - global prefetch (`basic.qos` with `global=true`), as RabbitMQ 3.x reads
//!   it: one limit on the unacked deliveries of all the channel's consumers
//!   together, alongside each consumer's own (`global=false`, for consumers
//!   started afterwards); a later `global=false` qos lifts the channel-wide
//!   one (`tests/python/test_rabbitmq_features.py` checks both orders
//!   against RabbitMQ).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use futures::stream::{BoxStream, StreamExt};
use lapin::message::Delivery;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, Consumer};
use spillway_integration_tests::amqp::{amqp_code, s, table, text};
use spillway_integration_tests::{both_wirings, eventually, next_delivery, publish, Sandbox};
use spillway_proto::management as m;

both_wirings!(
    timeout_secs = 60;
    higher_priority_consumers_are_served_first,
    a_consumer_priority_must_be_an_integer,
    single_active_consumer_hands_over_in_arrival_order,
    a_global_prefetch_is_shared_by_the_channels_consumers,
    a_later_per_consumer_qos_lifts_the_global_one,
);

const QUIET: Duration = Duration::from_millis(300);

async fn consume(
    conn: &Connection,
    queue: &str,
    tag: &str,
    prefetch: u16,
    arguments: FieldTable,
) -> anyhow::Result<(Channel, Consumer)> {
    let ch = conn.create_channel().await?;
    ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
    let consumer = ch
        .basic_consume(s(queue), s(tag), BasicConsumeOptions::default(), arguments)
        .await?;
    Ok((ch, consumer))
}

fn priority(value: i32) -> FieldTable {
    table(&[("x-priority", AMQPValue::LongInt(value))])
}

async fn publish_numbered(
    ch: &Channel,
    queue: &str,
    range: std::ops::Range<u32>,
) -> anyhow::Result<()> {
    for n in range {
        publish(
            ch,
            "",
            queue,
            n.to_string().as_bytes(),
            BasicProperties::default(),
        )
        .await?;
    }
    Ok(())
}

/// The next `count` deliveries of `consumer`, as numbers.
async fn take(consumer: &mut Consumer, count: usize) -> anyhow::Result<Vec<(u32, Delivery)>> {
    let mut taken = Vec::new();
    for _ in 0..count {
        let delivery = next_delivery(consumer, Duration::from_secs(10)).await?;
        let n: u32 = std::str::from_utf8(&delivery.data)?.parse()?;
        taken.push((n, delivery));
    }
    Ok(taken)
}

/// Nothing more arrives for a while (after everything published was
/// confirmed and the others' shares were counted, so this is not a wait for
/// something in flight).
async fn nothing_more(consumer: &mut Consumer) -> anyhow::Result<()> {
    if let Ok(delivery) = next_delivery(consumer, QUIET).await {
        anyhow::bail!(
            "unexpected delivery {:?}",
            String::from_utf8_lossy(&delivery.data)
        );
    }
    Ok(())
}

fn numbers(taken: &[(u32, Delivery)]) -> Vec<u32> {
    taken.iter().map(|(n, _)| *n).collect()
}

async fn higher_priority_consumers_are_served_first(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    ch.queue_declare(
        s("prio.c"),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    // Registered lowest first, so arrival order would favour them.
    let (_low_ch, mut low) = consume(&conn, "prio.c", "low", 100, priority(-5)).await?;
    let (_mid_ch, mut mid) = consume(&conn, "prio.c", "mid", 3, FieldTable::default()).await?;
    let (_high_a_ch, mut high_a) = consume(&conn, "prio.c", "high-a", 2, priority(10)).await?;
    let (_high_b_ch, mut high_b) = consume(&conn, "prio.c", "high-b", 2, priority(10)).await?;

    publish_numbered(&ch, "prio.c", 0..12).await?;
    // The two highest share the first four, round robin; the default
    // priority takes the next three; the lowest the rest.
    let a = take(&mut high_a, 2).await?;
    let b = take(&mut high_b, 2).await?;
    let mut highest = [numbers(&a), numbers(&b)].concat();
    highest.sort_unstable();
    assert_eq!(highest, vec![0, 1, 2, 3]);
    assert_eq!(numbers(&take(&mut mid, 3).await?), vec![4, 5, 6]);
    assert_eq!(numbers(&take(&mut low, 5).await?), vec![7, 8, 9, 10, 11]);
    nothing_more(&mut high_a).await?;

    // Room again at the top: the next message goes there, not to the
    // lowest, which still has room.
    a[0].1.ack(BasicAckOptions::default()).await?;
    publish_numbered(&ch, "prio.c", 12..13).await?;
    assert_eq!(numbers(&take(&mut high_a, 1).await?), vec![12]);
    nothing_more(&mut low).await?;
    Ok(())
}

async fn a_consumer_priority_must_be_an_integer(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.queue_declare(
        s("prio.bad"),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let refused = ch
        .basic_consume(
            s("prio.bad"),
            s("c"),
            BasicConsumeOptions::default(),
            table(&[("x-priority", text("high"))]),
        )
        .await
        .expect_err("a string x-priority is refused");
    assert_eq!(amqp_code(&refused), Some(406));

    let ch = conn.create_channel().await?;
    let refused = ch
        .queue_declare(
            s("sac.bad"),
            QueueDeclareOptions::default(),
            table(&[("x-single-active-consumer", text("yes"))]),
        )
        .await
        .expect_err("a string x-single-active-consumer is refused");
    assert_eq!(amqp_code(&refused), Some(406));
    Ok(())
}

async fn active_consumer(sb: &Sandbox, queue: &str) -> anyhow::Result<String> {
    let mut management = sb.management().await?;
    let queue = management
        .get_queue(m::GetQueueRequest {
            vhost: "/".into(),
            name: queue.into(),
        })
        .await?
        .into_inner();
    Ok(queue.status.unwrap_or_default().active_consumer)
}

async fn single_active_consumer_hands_over_in_arrival_order(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let publisher = sb.connect().await?;
    let ch = publisher.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    ch.queue_declare(
        s("sac.q"),
        QueueDeclareOptions::default(),
        table(&[("x-single-active-consumer", AMQPValue::Boolean(true))]),
    )
    .await?;

    let (conn_a, conn_b, conn_c, conn_d) = (
        sb.connect().await?,
        sb.connect().await?,
        sb.connect().await?,
        sb.connect().await?,
    );
    let (ch_a, mut a) = consume(&conn_a, "sac.q", "a", 0, FieldTable::default()).await?;
    // A higher priority does not make a later consumer active.
    let (ch_b, mut b) = consume(&conn_b, "sac.q", "b", 0, priority(10)).await?;
    let (_ch_c, mut c) = consume(&conn_c, "sac.q", "c", 0, FieldTable::default()).await?;
    assert_eq!(active_consumer(sb, "sac.q").await?, "a");

    publish_numbered(&ch, "sac.q", 0..3).await?;
    let first = take(&mut a, 3).await?;
    assert_eq!(numbers(&first), vec![0, 1, 2]);
    for (_, delivery) in &first {
        delivery.ack(BasicAckOptions::default()).await?;
    }
    nothing_more(&mut b).await?;

    // The active one cancels: the next in arrival order takes over.
    ch_a.basic_cancel(s("a"), BasicCancelOptions::default())
        .await?;
    assert_eq!(active_consumer(sb, "sac.q").await?, "b");
    publish_numbered(&ch, "sac.q", 3..5).await?;
    assert_eq!(numbers(&take(&mut b, 2).await?), vec![3, 4]);
    nothing_more(&mut c).await?;

    // Its channel closes with two unacked: c takes over and gets them.
    ch_b.close(200, s("bye")).await?;
    let handed = take(&mut c, 2).await?;
    assert_eq!(numbers(&handed), vec![3, 4]);
    assert!(handed.iter().all(|(_, d)| d.redelivered));
    assert_eq!(active_consumer(sb, "sac.q").await?, "c");

    // d arrives; c's connection goes with those two unacked: d gets them.
    let (_ch_d, mut d) = consume(&conn_d, "sac.q", "d", 0, FieldTable::default()).await?;
    conn_c.close(200, s("bye")).await?;
    let handed = take(&mut d, 2).await?;
    assert_eq!(numbers(&handed), vec![3, 4]);
    eventually(Duration::from_secs(10), || async {
        matches!(active_consumer(sb, "sac.q").await.as_deref(), Ok("d"))
    })
    .await?;
    publish_numbered(&ch, "sac.q", 5..6).await?;
    assert_eq!(numbers(&take(&mut d, 1).await?), vec![5]);
    for conn in [conn_a, conn_b, conn_d, publisher] {
        conn.close(200, s("bye")).await?;
    }
    Ok(())
}

/// Deliveries of one channel's consumers, each with the index of the queue
/// it came from.
type Held = BoxStream<'static, (usize, lapin::Result<Delivery>)>;

/// Ten messages in each of `queues`, declared afresh.
async fn ten_in_each(conn: &Connection, queues: &[&str]) -> anyhow::Result<()> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    for queue in queues {
        ch.queue_declare(
            s(queue),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
        publish_numbered(&ch, queue, 0..10).await?;
    }
    ch.close(200, s("bye")).await?;
    Ok(())
}

/// One channel with the `qos` calls (prefetch, global) made in order, then
/// a consumer on each of `queues`: their deliveries, merged.
async fn consume_each(
    conn: &Connection,
    qos: &[(u16, bool)],
    queues: &[&str],
) -> anyhow::Result<(Channel, Held)> {
    let ch = conn.create_channel().await?;
    for &(prefetch, global) in qos {
        ch.basic_qos(prefetch, BasicQosOptions { global }).await?;
    }
    let mut held: Held = futures::stream::empty().boxed();
    for (index, queue) in queues.iter().enumerate() {
        let consumer = ch
            .basic_consume(
                s(queue),
                s(&format!("c{index}")),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let tagged = consumer.map(move |delivery| (index, delivery));
        held = futures::stream::select(held, tagged).boxed();
    }
    Ok((ch, held))
}

/// The next `count` deliveries of the channel, with their queue's index.
async fn take_held(held: &mut Held, count: usize) -> anyhow::Result<Vec<(usize, Delivery)>> {
    let mut taken = Vec::new();
    for _ in 0..count {
        let (index, delivery) = tokio::time::timeout(Duration::from_secs(10), held.next())
            .await
            .map_err(|_| anyhow::anyhow!("{} delivered, not {count}", taken.len()))?
            .ok_or_else(|| anyhow::anyhow!("the consumers ended"))?;
        taken.push((index, delivery?));
    }
    Ok(taken)
}

/// The channel gets nothing more for a while (everything it may hold has
/// arrived, so this is the check that nothing beyond the limit does).
async fn nothing_more_held(held: &mut Held) -> anyhow::Result<()> {
    if let Ok(Some((index, delivery))) = tokio::time::timeout(QUIET, held.next()).await {
        let body = delivery.map(|d| String::from_utf8_lossy(&d.data).into_owned());
        anyhow::bail!("unexpected delivery from queue {index}: {body:?}");
    }
    Ok(())
}

/// How many of `taken` came from each of `queues` queues.
fn per_queue(taken: &[(usize, Delivery)], queues: usize) -> Vec<usize> {
    (0..queues)
        .map(|q| taken.iter().filter(|(index, _)| *index == q).count())
        .collect()
}

/// basic.qos global=true limits the channel's unacked deliveries across all
/// its consumers; global=false limits each consumer started afterwards. Set
/// in this order (RabbitMQ's documented example), both hold at once.
async fn a_global_prefetch_is_shared_by_the_channels_consumers(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let queues = ["global.a", "global.b"];
    ten_in_each(&conn, &queues).await?;
    let (_ch, mut held) = consume_each(&conn, &[(2, false), (3, true)], &queues).await?;

    // Three in all (the channel's limit), at most two from either queue
    // (each consumer's).
    let taken = take_held(&mut held, 3).await?;
    nothing_more_held(&mut held).await?;
    let counts = per_queue(&taken, queues.len());
    assert!(counts.iter().all(|&n| n <= 2), "per queue: {counts:?}");

    // One ack frees one place on the channel, and one only.
    taken[0].1.ack(BasicAckOptions::default()).await?;
    let more = take_held(&mut held, 1).await?;
    nothing_more_held(&mut held).await?;
    let mut unacked: Vec<(usize, Delivery)> = taken.into_iter().skip(1).collect();
    unacked.extend(more);
    let counts = per_queue(&unacked, queues.len());
    assert_eq!(counts.iter().sum::<usize>(), 3, "per queue: {counts:?}");
    assert!(counts.iter().all(|&n| n <= 2), "per queue: {counts:?}");

    // Acking them all lets the channel take three again.
    for (_, delivery) in &unacked {
        delivery.ack(BasicAckOptions::default()).await?;
    }
    take_held(&mut held, 3).await?;
    nothing_more_held(&mut held).await?;
    conn.close(200, s("bye")).await?;
    Ok(())
}

/// RabbitMQ's reading, kept: basic.qos global=false after global=true turns
/// the channel-wide limit off (rabbit_channel's unlimit_prefetch), leaving
/// each consumer's.
async fn a_later_per_consumer_qos_lifts_the_global_one(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let queues = ["lifted.a", "lifted.b"];
    ten_in_each(&conn, &queues).await?;
    let (_ch, mut held) = consume_each(&conn, &[(3, true), (2, false)], &queues).await?;
    let taken = take_held(&mut held, 4).await?;
    nothing_more_held(&mut held).await?;
    assert_eq!(per_queue(&taken, queues.len()), vec![2, 2]);
    conn.close(200, s("bye")).await?;
    Ok(())
}
