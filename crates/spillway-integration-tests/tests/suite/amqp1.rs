//! AMQP 1.0 through the `fe2o3-amqp` client on the 0-9-1 port, in both
//! wirings: messages cross between the protocols over the same queues,
//! producer flow control holds back only the links that publish to an
//! overfull queue (their credit), releasing them below resume capacity, and
//! a receiver granting little credit drains a backlog that flowed to disk
//! within the memory budget; a hand-driven client that sends a transfer
//! with no credit is detached with `amqp:link:transfer-limit-exceeded`, a
//! busy sending link borrows credit from its connection's pool, and a
//! receiver that settles ranges of deliveries at once drains its queue.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::receiver::CreditMode;
use fe2o3_amqp::sasl_profile::SaslProfile;
use fe2o3_amqp::{Connection, Receiver, Sender, Session};
use fe2o3_amqp_types::messaging::{Body, Message, Outcome};
use fe2o3_amqp_types::primitives::{Binary, Value};
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use spillway_integration_tests::{both_wirings, Sandbox, Wiring};

both_wirings!(
    own_sandbox, timeout_secs = 120;
    messages_cross_between_amqp_1_0_and_0_9_1,
    a_full_queue_holds_back_only_the_links_that_publish_to_it,
    a_low_credit_receiver_drains_a_spilled_backlog_within_the_budget,
    a_transfer_past_the_credit_detaches_the_link,
    a_busy_sender_borrows_from_its_connections_credit_pool,
    a_receiver_settling_ranges_drains_its_queue,
);

async fn connect(sandbox: &Sandbox, name: &str) -> anyhow::Result<ConnectionHandle<()>> {
    let url = format!("amqp://{}", sandbox.amqp_addr());
    let connection = Connection::builder()
        .container_id(name)
        .hostname("vhost:/")
        .sasl_profile(SaslProfile::Plain {
            username: "guest".into(),
            password: "guest".into(),
        })
        .open(url.as_str())
        .await?;
    Ok(connection)
}

fn data(body: Vec<u8>) -> Message<Body<Value>> {
    Message::builder()
        .body(Body::Data(
            vec![fe2o3_amqp_types::messaging::Data(Binary::from(body))].into(),
        ))
        .build()
}

fn payload(body: &Body<Value>) -> Vec<u8> {
    match body {
        Body::Data(sections) => sections
            .iter()
            .flat_map(|section| section.0.to_vec())
            .collect(),
        _ => Vec::new(),
    }
}

async fn messages_cross_between_amqp_1_0_and_0_9_1(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox = Sandbox::start(wiring).await?;
    let amqp091 = sandbox.connect().await?;
    let channel = amqp091.create_channel().await?;
    let queue = "cross";
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;

    let mut connection = connect(&sandbox, "crossing").await?;
    let mut session = Session::begin(&mut connection).await?;
    let mut sender = Sender::attach(&mut session, "to-queue", "/queues/cross").await?;
    for i in 0..100u32 {
        let outcome = sender.send(data(format!("one-{i}").into_bytes())).await?;
        anyhow::ensure!(
            matches!(outcome, Outcome::Accepted(_)),
            "message {i}: {outcome:?}"
        );
    }
    // Read back over 0-9-1, in order.
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    for i in 0..100u32 {
        let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
        anyhow::ensure!(
            delivery.data == format!("one-{i}").into_bytes(),
            "message {i} out of order"
        );
        delivery.ack(BasicAckOptions::default()).await?;
    }
    channel.basic_cancel("c".into(), Default::default()).await?;

    // And the other way.
    let mut headers = FieldTable::default();
    headers.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    for i in 0..20u32 {
        channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("two-{i}").as_bytes(),
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_headers(headers.clone())
                    .with_message_id(format!("id-{i}").into()),
            )
            .await?
            .await?;
    }
    let mut receiver = Receiver::attach(&mut session, "from-queue", "/queues/cross").await?;
    for i in 0..20u32 {
        let delivery =
            tokio::time::timeout(Duration::from_secs(10), receiver.recv::<Body<Value>>()).await??;
        anyhow::ensure!(
            payload(delivery.body()) == format!("two-{i}").into_bytes(),
            "delivery {i}"
        );
        let message = delivery.message();
        let header = message.header.clone().unwrap_or_default();
        anyhow::ensure!(header.durable, "delivery mode 2 is durable");
        let tenant = message
            .application_properties
            .as_ref()
            .and_then(|properties| properties.0.get("tenant").cloned());
        anyhow::ensure!(
            tenant
                == Some(fe2o3_amqp_types::primitives::SimpleValue::String(
                    "acme".into()
                )),
            "headers become application-properties: {tenant:?}"
        );
        receiver.accept(&delivery).await?;
    }
    receiver.close().await?;
    sender.close().await?;
    session.end().await?;
    connection.close().await?;
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    anyhow::ensure!(declared.message_count() == 0, "accepted is acknowledged");
    Ok(())
}

async fn a_full_queue_holds_back_only_the_links_that_publish_to_it(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let sandbox = Sandbox::start(wiring).await?;
    held_and_released(&sandbox, wiring)
        .await
        .map_err(|error| anyhow::anyhow!("{error:#}\n{}", sandbox.logs()))
}

async fn held_and_released(sandbox: &Sandbox, wiring: Wiring) -> anyhow::Result<()> {
    let amqp091 = sandbox.connect().await?;
    let channel = amqp091.create_channel().await?;
    let mut capacity = FieldTable::default();
    capacity.insert("x-qpid-capacity".into(), AMQPValue::LongLongInt(64 * 1024));
    capacity.insert(
        "x-qpid-flow-resume-capacity".into(),
        AMQPValue::LongLongInt(32 * 1024),
    );
    channel
        .queue_declare("small".into(), QueueDeclareOptions::default(), capacity)
        .await?;
    channel
        .queue_declare(
            "roomy".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;

    let mut connection = connect(sandbox, "flow").await?;
    let mut session = Session::begin(&mut connection).await?;
    let mut to_small = Sender::attach(&mut session, "to-small", "/queues/small").await?;
    let mut to_roomy = Sender::attach(&mut session, "to-roomy", "/queues/roomy").await?;

    // Publish 1 KiB messages to the small queue until a send waits for
    // credit: the queue passed its capacity and the link's credit was taken
    // back. Nothing waits before the capacity is passed.
    let mut sent = 0u32;
    let held = loop {
        let send = to_small.send(data(vec![b's'; 1024]));
        match tokio::time::timeout(Duration::from_secs(3), send).await {
            Ok(outcome) => {
                anyhow::ensure!(
                    matches!(outcome?, Outcome::Accepted(_)),
                    "accepted while not held"
                );
                sent += 1;
                anyhow::ensure!(
                    sent < 2_000,
                    "2,000 KiB sent to a 64 KiB queue without being held"
                );
            }
            Err(_) => break sent,
        }
    };
    anyhow::ensure!(
        held >= 64,
        "held after {held} KiB, before the 64 KiB capacity"
    );
    // Another link of the same connection, to another queue, is not held.
    for i in 0..50 {
        let outcome = tokio::time::timeout(
            Duration::from_secs(5),
            to_roomy.send(data(vec![b'r'; 1024])),
        )
        .await
        .map_err(|_| anyhow::anyhow!("the roomy queue's link was held too (message {i})"))??;
        anyhow::ensure!(matches!(outcome, Outcome::Accepted(_)));
    }
    // Draining the small queue below its resume capacity releases the link.
    let mut consumer = channel
        .basic_consume(
            "small".into(),
            "drain".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let released = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            tokio::select! {
                outcome = to_small.send(data(vec![b'a'; 1024])) => return outcome,
                _ = consumer.next() => {}
            }
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("still held after the queue drained"))??;
    anyhow::ensure!(matches!(released, Outcome::Accepted(_)));
    if wiring == Wiring::Separate {
        // Logged as for 0-9-1 (the in-process sandbox keeps no log file).
        let logs = sandbox.logs();
        for line in [
            "CHN-1005 : Flow Control Enforced (Queue small)",
            "CHN-1006 : Flow Control Removed",
        ] {
            anyhow::ensure!(logs.contains(line), "'{line}' not logged:\n{logs}");
        }
    }
    to_small
        .close()
        .await
        .context("closing the small queue's link")?;
    to_roomy
        .close()
        .await
        .context("closing the roomy queue's link")?;
    session.end().await.context("ending the session")?;
    connection.close().await.context("closing the connection")?;
    Ok(())
}

const MIB: u64 = 1 << 20;

/// A backlog five times the flow-to-disk threshold, published over 0-9-1,
/// drained by a 1.0 receiver that grants 5 credits at a time: the consumer's
/// prefetch follows the credit, so what the engine holds resident stays
/// within the threshold and one spill window, and every message comes back
/// once, in order.
async fn a_low_credit_receiver_drains_a_spilled_backlog_within_the_budget(
    wiring: Wiring,
) -> anyhow::Result<()> {
    const THRESHOLD: u64 = 8 * MIB;
    const BODY: usize = 64 * 1024;
    const COUNT: u64 = 5 * THRESHOLD / BODY as u64;
    // As flow_to_disk.rs: one spill window (an eighth of the threshold, at
    // least 1 MiB) and one message past a full window.
    const ONE_BATCH: u64 = MIB + MIB + 4096;
    let config = format!(
        "[engine]\nflow_to_disk_threshold = {THRESHOLD}\nhousekeeping_interval = \"100ms\"\n"
    );
    let sandbox = Arc::new(Sandbox::start_with_config(wiring, &config).await?);
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = super::flow_to_disk::sample_resident(sandbox.clone(), stop.clone());

    let queue = "spilled-for-1.0";
    let publisher = sandbox.connect().await?;
    let channel = publisher.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let body = |seq: u64| -> Vec<u8> {
        let mut body = vec![(seq % 251) as u8; BODY];
        body[..8].copy_from_slice(&seq.to_be_bytes());
        body
    };
    let mut pending = Vec::new();
    for seq in 0..COUNT {
        pending.push(
            channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    &body(seq),
                    BasicProperties::default(),
                )
                .await?,
        );
        if pending.len() >= 64 {
            for confirm in pending.drain(..) {
                anyhow::ensure!(confirm.await?.is_ack(), "a publish was nacked");
            }
        }
    }
    for confirm in pending {
        anyhow::ensure!(confirm.await?.is_ack(), "a publish was nacked");
    }
    publisher.close(200, "done".into()).await?;
    let spilled = sandbox
        .engine_metric("spillway_broker_resident_message_bytes")
        .await?;
    anyhow::ensure!(
        (spilled as u64) < COUNT * BODY as u64,
        "the backlog did not flow to disk: {spilled} bytes resident"
    );

    let mut connection = connect(&sandbox, "low-credit").await?;
    let mut session = Session::begin(&mut connection).await?;
    let mut receiver = Receiver::builder()
        .name("low-credit")
        .source(format!("/queues/{queue}"))
        .credit_mode(CreditMode::Auto(5))
        .attach(&mut session)
        .await?;
    for seq in 0..COUNT {
        let delivery =
            tokio::time::timeout(Duration::from_secs(30), receiver.recv::<Body<Value>>())
                .await
                .with_context(|| format!("message {seq} did not come"))??;
        anyhow::ensure!(payload(delivery.body()) == body(seq), "message {seq}");
        receiver.accept(&delivery).await?;
    }
    receiver.close().await?;
    session.end().await?;
    connection.close().await?;
    stop.store(true, Ordering::Relaxed);
    let highest = sampler.await?;
    anyhow::ensure!(
        highest <= THRESHOLD + ONE_BATCH,
        "resident bytes reached {highest}, over {THRESHOLD} + {ONE_BATCH}"
    );
    println!("{wiring:?}: {COUNT} messages drained over 1.0 with 5 credits, highest resident {highest} bytes (threshold {THRESHOLD})");
    Ok(())
}

/// A client that sends a transfer its link has no credit for is detached
/// with `amqp:link:transfer-limit-exceeded`, and the broker takes nothing
/// from it. To have a link whose credit runs out for good, the store's
/// quota holds every connection that has published: a second link of a
/// connection that has published gets no credit from the gateway beyond
/// what the library grants at attach.
async fn a_transfer_past_the_credit_detaches_the_link(wiring: Wiring) -> anyhow::Result<()> {
    use fe2o3_amqp_types::definitions::{ErrorCondition, LinkError};
    use fe2o3_amqp_types::performatives::Performative;
    use spillway_integration_tests::amqp1_raw::RawAmqp1;
    use spillway_integration_tests::eventually;
    use spillway_proto::management as m;

    let sandbox = Sandbox::start(wiring).await?;
    let amqp = sandbox.connect().await?;
    let channel = amqp.create_channel().await?;
    channel
        .queue_declare(
            "credit".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut admin = sandbox.management().await?;
    admin
        .set_store_quota(m::SetStoreQuotaRequest {
            overfull_size: Some(1),
            underfull_size: Some(1),
        })
        .await?;
    eventually(Duration::from_secs(20), || {
        let sandbox = &sandbox;
        async move {
            let status = sandbox
                .management()
                .await?
                .get_broker_status(m::GetBrokerStatusRequest {})
                .await?
                .into_inner();
            anyhow::ensure!(status.store_overfull, "store not overfull yet");
            anyhow::Ok(())
        }
    })
    .await?;

    let mut client = RawAmqp1::connect(sandbox.amqp_addr(), "guest", "guest", "/").await?;
    client.attach_sender(0, "/queues/credit").await?;
    client
        .until(|p| matches!(p, Performative::Flow(f) if f.handle.as_ref().is_some_and(|h| h.0 == 0) && f.link_credit.unwrap_or(0) > 0))
        .await
        .context("the first link got no credit")?;
    // The first publish makes the connection a producer, which the store's
    // quota holds: the engine says so (FlowControl) while it handles that
    // publish, so by the second one's outcome the gateway has heard it (the
    // session's events come in order). The first outcome alone may come
    // before it.
    for body in [&b"within the credit"[..], b"within the credit too"] {
        client.transfer_accepted(0, body).await?;
    }

    // fe2o3's link acceptor grants its default credit (200) at every attach,
    // held or not, and has no setting to turn that off; the gateway grants
    // a held link nothing more. So the second link may send what that first
    // flow allows, and the transfer after that is past its credit.
    client.attach_sender(1, "/queues/credit").await?;
    let granted = client
        .until(
            |p| matches!(p, Performative::Flow(f) if f.handle.as_ref().is_some_and(|h| h.0 == 1)),
        )
        .await?;
    let Performative::Flow(granted) = granted else {
        unreachable!("until answers what it was asked for");
    };
    let granted = granted.link_credit.unwrap_or(0);
    anyhow::ensure!(granted <= 1000, "a held link was granted {granted}");
    for n in 0..=granted {
        client
            .transfer(1, format!("message {n}").as_bytes())
            .await?;
    }
    let answer = client
        .until(|p| match p {
            Performative::Detach(d) => d.handle.0 == 1,
            Performative::Flow(f) => {
                f.handle.as_ref().is_some_and(|h| h.0 == 1) && f.link_credit.unwrap_or(0) > 0
            }
            _ => false,
        })
        .await?;
    let Performative::Detach(detach) = answer else {
        anyhow::bail!("the held link was granted more credit, so nothing was exceeded: {answer:?}");
    };
    let condition = detach.error.as_ref().map(|error| &error.condition);
    anyhow::ensure!(
        matches!(
            condition,
            Some(ErrorCondition::LinkError(LinkError::TransferLimitExceeded))
        ),
        "detached with {:?}, not amqp:link:transfer-limit-exceeded",
        detach.error
    );

    // The messages sent within the credit were taken, the one past it not.
    admin
        .set_store_quota(m::SetStoreQuotaRequest {
            overfull_size: Some(0),
            underfull_size: Some(0),
        })
        .await?;
    queue_holds(&channel, "credit", 2 + granted).await?;
    Ok(())
}

/// A sending link that spends its credit borrows from its connection's
/// pool, so one busy sender may have more messages waiting for the store
/// than its floor (as a 0-9-1 publisher's confirm window), while a second
/// link of the same connection still gets its floor and no link ever more
/// than its floor and the whole pool.
async fn a_busy_sender_borrows_from_its_connections_credit_pool(
    wiring: Wiring,
) -> anyhow::Result<()> {
    use fe2o3_amqp_types::performatives::Performative;
    use spillway_gateway::amqp1::credit::{CONNECTION_POOL, LINK_FLOOR};
    use spillway_integration_tests::amqp1_raw::RawAmqp1;

    let sandbox = Sandbox::start(wiring).await?;
    let amqp = sandbox.connect().await?;
    let channel = amqp.create_channel().await?;
    spillway_integration_tests::amqp::declare(&channel, "pool", false, FieldTable::default())
        .await?;
    let mut client = RawAmqp1::connect(sandbox.amqp_addr(), "guest", "guest", "/").await?;
    let link_credit = |handle: u32| {
        move |p: &Performative| -> Option<u32> {
            match p {
                Performative::Flow(f) if f.handle.as_ref().is_some_and(|h| h.0 == handle) => {
                    f.link_credit
                }
                _ => None,
            }
        }
    };

    client.attach_sender(0, "/queues/pool").await?;
    let first = client
        .until(|p| link_credit(0)(p).is_some_and(|credit| credit > 0))
        .await
        .context("the link got no credit")?;
    let first = link_credit(0)(&first).unwrap_or(0);
    anyhow::ensure!(
        first <= LINK_FLOOR,
        "a link that has sent nothing was granted {first}, past its floor {LINK_FLOOR}"
    );

    // Past half of the floor, the gateway tops the link up from the pool.
    let mut last_sent = 0;
    for n in 0..LINK_FLOOR * 3 / 4 {
        last_sent = client
            .transfer(0, format!("message {n}").as_bytes())
            .await?;
    }
    let topped_up = client
        .until(|p| link_credit(0)(p).is_some_and(|credit| credit > LINK_FLOOR))
        .await
        .context("a link that spent its credit was never granted more than its floor")?;
    let topped_up = link_credit(0)(&topped_up).unwrap_or(0);
    anyhow::ensure!(
        topped_up <= LINK_FLOOR + CONNECTION_POOL,
        "one link was granted {topped_up}, past its floor and the whole pool"
    );

    // A second link of the same connection still has its floor.
    client.attach_sender(1, "/queues/pool").await?;
    let second = client
        .until(|p| link_credit(1)(p).is_some_and(|credit| credit > 0))
        .await
        .context("a second link got no credit while the first held the pool")?;
    let second = link_credit(1)(&second).unwrap_or(0);
    anyhow::ensure!(second <= LINK_FLOOR, "the second link was granted {second}");
    let sent = client.transfer_accepted(1, b"on the second link").await?;
    anyhow::ensure!(last_sent < sent, "delivery ids run on over the session");

    // Everything sent on both links was taken.
    queue_holds(&channel, "pool", LINK_FLOOR * 3 / 4 + 1).await?;
    Ok(())
}

/// A receiver that settles fifty deliveries with one disposition (a range
/// of delivery ids, as `accept_all` sends it) with 100 credits topped up by
/// the library: every message comes, in order, and all are acknowledged.
/// It holds up to 50 unsettled deliveries: while a link's consumer counted
/// unacked messages against a prefetch of 1 instead of deliveries against
/// the client's credit, one message came per flush of the client's
/// settlements (about 20 a second).
async fn a_receiver_settling_ranges_drains_its_queue(wiring: Wiring) -> anyhow::Result<()> {
    use fe2o3_amqp::link::delivery::DeliveryInfo;
    const COUNT: u64 = 6_000;
    const TOGETHER: usize = 50;
    let sandbox = Sandbox::start(wiring).await?;
    let amqp = sandbox.connect().await?;
    let channel = amqp.create_channel().await?;
    let queue = "settled-in-ranges";
    spillway_integration_tests::amqp::declare(&channel, queue, false, FieldTable::default())
        .await?;
    let publishing = amqp.create_channel().await?;
    spillway_integration_tests::amqp::publish_numbered(publishing, queue.into(), COUNT, 64).await?;

    let mut connection = connect(&sandbox, "ranges").await?;
    let mut session = Session::begin(&mut connection).await?;
    let mut receiver = Receiver::builder()
        .name("ranges")
        .source(format!("/queues/{queue}"))
        .credit_mode(CreditMode::Auto(100))
        .attach(&mut session)
        .await?;
    let mut pending: Vec<DeliveryInfo> = Vec::new();
    let mut came = 0;
    let draining = async {
        for seq in 0..COUNT {
            came = seq;
            let delivery = receiver.recv::<Body<Value>>().await?;
            let body = payload(delivery.body());
            anyhow::ensure!(
                body.get(..8) == Some(&seq.to_be_bytes()[..]),
                "message {seq} came out of order"
            );
            pending.push(DeliveryInfo::from(&delivery));
            if pending.len() == TOGETHER {
                receiver.accept_all(pending.drain(..)).await?;
            }
        }
        receiver.accept_all(pending.drain(..)).await?;
        anyhow::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(30), draining)
        .await
        .with_context(|| format!("the receiver stalled after {came} of {COUNT} messages"))??;
    receiver.close().await?;
    session.end().await?;
    connection.close().await?;
    // Unsettled deliveries would be back in the queue by now.
    queue_holds(&channel, queue, 0).await?;
    Ok(())
}

/// Waits (10 s at most) until `queue` holds `expected` messages. Publishes
/// of one connection reach the engine in order, but another connection's
/// question may overtake the last of them: asked until so.
async fn queue_holds(channel: &lapin::Channel, queue: &str, expected: u32) -> anyhow::Result<()> {
    spillway_integration_tests::eventually(Duration::from_secs(10), || async move {
        let depth = spillway_integration_tests::amqp::message_count(channel, queue).await?;
        anyhow::ensure!(
            depth == expected,
            "{queue} holds {depth} messages, not {expected}"
        );
        anyhow::Ok(())
    })
    .await
}
