//! AMQP transactions through lapin, in both wirings: commit makes publishes
//! visible and rollback discards them; acks take effect only at commit, and
//! a rollback returns acked messages to their queue (redelivered, Qpid's
//! behaviour); a closed channel rolls back; committed persistent messages
//! survive a restart, and a SIGKILL between two commits leaves all of the
//! first and none of the second; `engine.max_transaction_bytes` (406);
//! an unroutable mandatory message in a transaction closes the connection
//! (312); the open and idle timeouts close it with 506 and log CHN-1007,
//! CHN-1008 and CHN-1003.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use spillway_integration_tests::amqp::{self, amqp_code, get, s};
use spillway_integration_tests::{eventually, Sandbox, Wiring};
use spillway_proto::management::SetTransactionTimeoutsRequest;

const WAIT: Duration = Duration::from_secs(10);

mod default_sandbox {
    use super::*;
    spillway_integration_tests::both_wirings!(
        timeout_secs = 90;
        commit_makes_publishes_visible_and_rollback_discards_them,
        acks_take_effect_only_at_commit,
        rollback_requeues_acked_messages_redelivered,
        a_rollback_counts_as_a_delivery_attempt,
        closing_the_channel_rolls_back,
        committed_persistent_messages_survive_a_restart,
        commit_without_select_and_mixing_with_confirms_are_refused,
        unroutable_mandatory_in_a_transaction_closes_the_connection,
    );
}

mod own_sandbox {
    use super::*;
    spillway_integration_tests::both_wirings!(
        own_sandbox, timeout_secs = 120;
        sigkill_between_two_commits_leaves_all_of_the_first_and_none_of_the_second,
        a_transaction_past_max_transaction_bytes_closes_the_channel,
        unroutable_mandatory_is_returned_when_close_when_no_route_is_off,
        an_open_transaction_times_out_with_506,
        an_idle_transaction_times_out_with_506,
    );
}

fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

async fn declare(ch: &Channel, name: &str, durable: bool) -> anyhow::Result<()> {
    amqp::declare(ch, name, durable, FieldTable::default()).await?;
    Ok(())
}

async fn publish(
    ch: &Channel,
    queue: &str,
    body: &[u8],
    props: BasicProperties,
) -> anyhow::Result<()> {
    ch.basic_publish(s(""), s(queue), BasicPublishOptions::default(), body, props)
        .await?
        .await?;
    Ok(())
}

async fn message_count(conn: &Connection, queue: &str) -> anyhow::Result<u32> {
    let ch = conn.create_channel().await?;
    let count = amqp::message_count(&ch, queue).await?;
    ch.close(200, s("bye")).await?;
    Ok(count)
}

/// Every message of `queue` now, acked: their bodies.
async fn drain(conn: &Connection, queue: &str) -> anyhow::Result<Vec<Vec<u8>>> {
    let ch = conn.create_channel().await?;
    let mut bodies = Vec::new();
    while let Some(message) = ch
        .basic_get(s(queue), BasicGetOptions { no_ack: true })
        .await?
    {
        bodies.push(message.delivery.data.clone());
    }
    ch.close(200, s("bye")).await?;
    Ok(bodies)
}

/// A consumer whose stream ends with the connection's close: how a lapin
/// client hears a connection.close the broker sends on its own.
async fn watcher(conn: &Connection) -> anyhow::Result<lapin::Consumer> {
    witness(&conn.create_channel().await?).await
}

/// A consumer on `ch` whose stream ends with the channel's close (lapin
/// tells a channel's consumers why it was closed).
async fn witness(ch: &Channel) -> anyhow::Result<lapin::Consumer> {
    let queue = ch
        .queue_declare(
            s(""),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(ch
        .basic_consume(
            s(queue.name().as_str()),
            s("watcher"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?)
}

/// Waits for the broker to close the connection; returns its error.
async fn closed_by_broker(
    conn: &Connection,
    watcher: &mut lapin::Consumer,
    within: Duration,
) -> anyhow::Result<lapin::Error> {
    let error = tokio::time::timeout(within, async {
        loop {
            match watcher.next().await {
                Some(Err(error)) => return Some(error),
                Some(Ok(_)) => continue,
                None => return None,
            }
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("the connection was not closed within {within:?}"))?;
    match error {
        Some(error) => Ok(error),
        None => {
            // The stream may end without the error: ask the connection.
            let ch = conn.create_channel().await;
            match ch {
                Err(error) => Ok(error),
                Ok(_) => anyhow::bail!("the connection is still open"),
            }
        }
    }
}

async fn commit_makes_publishes_visible_and_rollback_discards_them(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "tx-visible", true).await?;
    ch.tx_select().await?;
    for i in 0..10u8 {
        publish(&ch, "tx-visible", &[i], persistent()).await?;
    }
    // A round trip on the same connection: the publishes reached the engine.
    anyhow::ensure!(
        message_count(&conn, "tx-visible").await? == 0,
        "visible before commit"
    );
    anyhow::ensure!(sb.engine_metric("spillway_open_transactions").await? == 1.0);
    ch.tx_commit().await?;
    anyhow::ensure!(message_count(&conn, "tx-visible").await? == 10);
    anyhow::ensure!(sb.engine_metric("spillway_open_transactions").await? == 0.0);

    for i in 10..15u8 {
        publish(&ch, "tx-visible", &[i], BasicProperties::default()).await?;
    }
    ch.tx_rollback().await?;
    // A commit after the rollback commits nothing of it.
    ch.tx_commit().await?;
    let bodies = drain(&conn, "tx-visible").await?;
    let expected: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i]).collect();
    anyhow::ensure!(bodies == expected, "got {bodies:?}");
    conn.close(200, s("bye")).await?;
    Ok(())
}

async fn acks_take_effect_only_at_commit(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "tx-acks", false).await?;
    for i in 0..3u8 {
        publish(&ch, "tx-acks", &[i], BasicProperties::default()).await?;
    }
    let tx = conn.create_channel().await?;
    tx.tx_select().await?;
    let mut tags = Vec::new();
    for _ in 0..3 {
        tags.push(get(&tx, "tx-acks").await?.delivery.delivery_tag);
    }
    tx.basic_ack(tags[1], BasicAckOptions { multiple: true })
        .await?;
    // Held: the first two are neither ready nor gone for good.
    anyhow::ensure!(message_count(&conn, "tx-acks").await? == 0);
    tx.tx_commit().await?;
    // Closing the channel returns only what was never acked.
    tx.close(200, s("bye")).await?;
    let left = eventually(WAIT, || async {
        message_count(&conn, "tx-acks")
            .await
            .ok()
            .filter(|n| *n == 1)
    })
    .await?;
    anyhow::ensure!(left == 1);
    anyhow::ensure!(drain(&conn, "tx-acks").await? == vec![vec![2u8]]);
    conn.close(200, s("bye")).await?;
    Ok(())
}

async fn rollback_requeues_acked_messages_redelivered(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "tx-rollback", true).await?;
    publish(&ch, "tx-rollback", b"once", persistent()).await?;
    ch.tx_select().await?;
    let first = get(&ch, "tx-rollback").await?;
    anyhow::ensure!(!first.delivery.redelivered);
    ch.basic_ack(first.delivery.delivery_tag, BasicAckOptions::default())
        .await?;
    ch.tx_rollback().await?;
    // Qpid's behaviour: the ack is undone and the message is back, a
    // delivery attempt counted.
    let again = get(&ch, "tx-rollback").await?;
    anyhow::ensure!(again.delivery.data == b"once");
    anyhow::ensure!(again.delivery.redelivered, "not flagged redelivered");
    ch.basic_ack(again.delivery.delivery_tag, BasicAckOptions::default())
        .await?;
    ch.tx_commit().await?;
    anyhow::ensure!(message_count(&conn, "tx-rollback").await? == 0);
    conn.close(200, s("bye")).await?;
    Ok(())
}

async fn a_rollback_counts_as_a_delivery_attempt(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "tx-limit-dead", false).await?;
    let mut args = FieldTable::default();
    args.insert(
        s("x-qpid-maximum-delivery-count"),
        lapin::types::AMQPValue::LongInt(1),
    );
    args.insert(
        s("x-dead-letter-exchange"),
        lapin::types::AMQPValue::LongString("".into()),
    );
    args.insert(
        s("x-dead-letter-routing-key"),
        lapin::types::AMQPValue::LongString("tx-limit-dead".into()),
    );
    ch.queue_declare(s("tx-limit"), QueueDeclareOptions::default(), args)
        .await?;
    publish(&ch, "tx-limit", b"poison", BasicProperties::default()).await?;
    ch.tx_select().await?;
    let got = get(&ch, "tx-limit").await?;
    ch.basic_ack(got.delivery.delivery_tag, BasicAckOptions::default())
        .await?;
    ch.tx_rollback().await?;
    // Delivered once, the limit: back from the rollback, it is dead-lettered.
    let dead = get(&ch, "tx-limit-dead").await?;
    anyhow::ensure!(dead.delivery.data == b"poison");
    anyhow::ensure!(message_count(&conn, "tx-limit").await? == 0);
    conn.close(200, s("bye")).await?;
    Ok(())
}

async fn closing_the_channel_rolls_back(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "tx-closed", false).await?;
    publish(&ch, "tx-closed", b"old", BasicProperties::default()).await?;
    let tx = conn.create_channel().await?;
    tx.tx_select().await?;
    let got = get(&tx, "tx-closed").await?;
    tx.basic_ack(got.delivery.delivery_tag, BasicAckOptions::default())
        .await?;
    publish(&tx, "tx-closed", b"new", BasicProperties::default()).await?;
    tx.close(200, s("bye")).await?;
    // The publish is gone, the acked message back.
    let back = get(&ch, "tx-closed").await?;
    anyhow::ensure!(back.delivery.data == b"old");
    anyhow::ensure!(back.delivery.redelivered);
    ch.basic_ack(back.delivery.delivery_tag, BasicAckOptions::default())
        .await?;
    anyhow::ensure!(message_count(&conn, "tx-closed").await? == 0);

    // A dropped connection likewise.
    let other = sb.connect().await?;
    let tx = other.create_channel().await?;
    tx.tx_select().await?;
    publish(&tx, "tx-closed", b"never", BasicProperties::default()).await?;
    anyhow::ensure!(message_count(&other, "tx-closed").await? == 0);
    other.close(200, s("bye")).await?;
    anyhow::ensure!(message_count(&conn, "tx-closed").await? == 0);
    conn.close(200, s("bye")).await?;
    Ok(())
}

async fn committed_persistent_messages_survive_a_restart(sb: &mut Sandbox) -> anyhow::Result<()> {
    {
        let conn = sb.connect().await?;
        let ch = conn.create_channel().await?;
        declare(&ch, "tx-durable", true).await?;
        ch.tx_select().await?;
        for i in 0..20u8 {
            publish(&ch, "tx-durable", &[i], persistent()).await?;
        }
        ch.tx_commit().await?;
        // Five acked in a committed transaction, then five more in an
        // uncommitted one.
        for _ in 0..5 {
            let got = get(&ch, "tx-durable").await?;
            ch.basic_ack(got.delivery.delivery_tag, BasicAckOptions::default())
                .await?;
        }
        ch.tx_commit().await?;
        for _ in 0..5 {
            let got = get(&ch, "tx-durable").await?;
            ch.basic_ack(got.delivery.delivery_tag, BasicAckOptions::default())
                .await?;
        }
        publish(&ch, "tx-durable", b"uncommitted", persistent()).await?;
        anyhow::ensure!(message_count(&conn, "tx-durable").await? == 10);
    }
    sb.restart().await?;
    let conn = sb.connect().await?;
    let bodies = drain(&conn, "tx-durable").await?;
    let expected: Vec<Vec<u8>> = (5..20u8).map(|i| vec![i]).collect();
    anyhow::ensure!(bodies == expected, "got {bodies:?}");
    conn.close(200, s("bye")).await?;
    Ok(())
}

async fn commit_without_select_and_mixing_with_confirms_are_refused(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    let error = ch.tx_commit().await.expect_err("commit without select");
    anyhow::ensure!(amqp_code(&error) == Some(406), "{error}");
    anyhow::ensure!(error.to_string().contains("not transactional"), "{error}");

    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let error = ch.tx_select().await.expect_err("tx on a confirm channel");
    anyhow::ensure!(amqp_code(&error) == Some(406), "{error}");

    let ch = conn.create_channel().await?;
    ch.tx_select().await?;
    let error = ch
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect_err("confirms on a tx channel");
    anyhow::ensure!(amqp_code(&error) == Some(406), "{error}");
    conn.close(200, s("bye")).await?;
    Ok(())
}

async fn unroutable_mandatory_in_a_transaction_closes_the_connection(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let conn = sb.connect().await?;
    let mut watching = watcher(&conn).await?;
    let ch = conn.create_channel().await?;
    ch.tx_select().await?;
    ch.basic_publish(
        s(""),
        s("no-such-queue"),
        BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        },
        b"lost",
        BasicProperties::default(),
    )
    .await?;
    let error = closed_by_broker(&conn, &mut watching, WAIT).await?;
    anyhow::ensure!(amqp_code(&error) == Some(312), "{error}");
    anyhow::ensure!(error.to_string().contains("No route"), "{error}");
    Ok(())
}

/// The in-process wiring's logs are the test process's: a case that reads
/// the broker's logs runs the all-in-one broker as a child process instead
/// (the same in-process boundaries).
fn with_logs(wiring: Wiring) -> Wiring {
    match wiring {
        Wiring::InProcess => Wiring::AllInOneProcess,
        other => other,
    }
}

async fn sigkill_between_two_commits_leaves_all_of_the_first_and_none_of_the_second(
    wiring: Wiring,
) -> anyhow::Result<()> {
    // The test's own process cannot be SIGKILLed.
    let mut sb = Sandbox::start(with_logs(wiring)).await?;
    {
        let conn = sb.connect().await?;
        let ch = conn.create_channel().await?;
        declare(&ch, "tx-crash", true).await?;
        ch.tx_select().await?;
        for i in 0..10u8 {
            publish(&ch, "tx-crash", &[b'a', i], persistent()).await?;
        }
        ch.tx_commit().await?;
        // First: acks of a0..a4 and b0..b49, committed.
        for _ in 0..5 {
            let got = get(&ch, "tx-crash").await?;
            ch.basic_ack(got.delivery.delivery_tag, BasicAckOptions::default())
                .await?;
        }
        for i in 0..50u8 {
            publish(&ch, "tx-crash", &[b'b', i], persistent()).await?;
        }
        ch.tx_commit().await?;
        // Second: acks of a5..a9 and c0..c49, not committed.
        for _ in 0..5 {
            let got = get(&ch, "tx-crash").await?;
            ch.basic_ack(got.delivery.delivery_tag, BasicAckOptions::default())
                .await?;
        }
        for i in 0..50u8 {
            publish(&ch, "tx-crash", &[b'c', i], persistent()).await?;
        }
        // A round trip: everything above reached the engine.
        message_count(&conn, "tx-crash").await?;
        sb.kill_and_restart().await?;
    }
    let conn = sb.connect().await?;
    let bodies = eventually(WAIT, || async {
        let bodies = drain(&conn, "tx-crash").await.ok()?;
        (!bodies.is_empty()).then_some(bodies)
    })
    .await?;
    let mut expected: Vec<Vec<u8>> = (5..10u8).map(|i| vec![b'a', i]).collect();
    expected.extend((0..50u8).map(|i| vec![b'b', i]));
    anyhow::ensure!(bodies == expected, "after the SIGKILL: {bodies:?}");
    conn.close(200, s("bye")).await?;
    Ok(())
}

async fn a_transaction_past_max_transaction_bytes_closes_the_channel(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let sb = Sandbox::start_with_config(wiring, "[engine]\nmax_transaction_bytes = 2000\n").await?;
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "tx-big", false).await?;
    let mut witness = witness(&ch).await?;
    ch.tx_select().await?;
    // Each counts its body, names and 192 bytes, as in the memory budget.
    publish(&ch, "tx-big", &[1u8; 900], BasicProperties::default()).await?;
    publish(&ch, "tx-big", &[2u8; 900], BasicProperties::default()).await?;
    let closed = tokio::time::timeout(WAIT, witness.next())
        .await
        .map_err(|_| anyhow::anyhow!("the channel was not closed"))?;
    let error = match closed {
        Some(Err(error)) => error,
        other => anyhow::bail!("the channel's consumer saw {other:?}, not its close"),
    };
    anyhow::ensure!(amqp_code(&error) == Some(406), "{error}");
    let text = error.to_string();
    anyhow::ensure!(
        text.contains("PRECONDITION_FAILED") && text.contains("engine.max_transaction_bytes"),
        "{text}"
    );
    // Rolled back with the channel; the connection goes on.
    anyhow::ensure!(message_count(&conn, "tx-big").await? == 0);
    let ch = conn.create_channel().await?;
    ch.tx_select().await?;
    publish(&ch, "tx-big", &[3u8; 1500], BasicProperties::default()).await?;
    ch.tx_commit().await?;
    anyhow::ensure!(message_count(&conn, "tx-big").await? == 1);
    conn.close(200, s("bye")).await?;
    Ok(())
}

async fn unroutable_mandatory_is_returned_when_close_when_no_route_is_off(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let sb = Sandbox::start_with_config(wiring, "[engine]\nclose_when_no_route = false\n").await?;
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "tx-routed", false).await?;
    ch.tx_select().await?;
    ch.basic_publish(
        s(""),
        s("no-such-queue"),
        BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        },
        b"returned",
        BasicProperties::default(),
    )
    .await?;
    publish(&ch, "tx-routed", b"kept", BasicProperties::default()).await?;
    ch.tx_commit().await?;
    anyhow::ensure!(conn.status().connected());
    anyhow::ensure!(drain(&conn, "tx-routed").await? == vec![b"kept".to_vec()]);
    conn.close(200, s("bye")).await?;
    Ok(())
}

async fn an_open_transaction_times_out_with_506(wiring: Wiring) -> anyhow::Result<()> {
    let wiring = with_logs(wiring);
    let sb = Sandbox::start(wiring).await?;
    // Set through management for the vhost.
    let mut management = sb.management().await?;
    let set = management
        .set_transaction_timeouts(SetTransactionTimeoutsRequest {
            vhost: "/".into(),
            open_warn_ms: Some(300),
            open_close_ms: Some(2000),
            idle_warn_ms: None,
            idle_close_ms: None,
        })
        .await?
        .into_inner();
    anyhow::ensure!((set.open_warn_ms, set.open_close_ms, set.idle_close_ms) == (300, 2000, 0));
    let conn = sb.connect().await?;
    let mut watching = watcher(&conn).await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "tx-open", false).await?;
    ch.tx_select().await?;
    let started = Instant::now();
    // Busy, never idle, never committed.
    let publishing = async {
        let mut i = 0u32;
        loop {
            if publish(&ch, "tx-open", &i.to_be_bytes(), BasicProperties::default())
                .await
                .is_err()
            {
                return;
            }
            i += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let closed = tokio::select! {
        error = closed_by_broker(&conn, &mut watching, Duration::from_secs(20)) => Some(error),
        () = publishing => None,
    };
    let error = match closed {
        Some(error) => error?,
        // A publish failed first: the close is on its way.
        None => closed_by_broker(&conn, &mut watching, WAIT).await?,
    };
    let elapsed = started.elapsed();
    anyhow::ensure!(amqp_code(&error) == Some(506), "{error}");
    anyhow::ensure!(
        error.to_string().contains("Open transaction timed out"),
        "{error}"
    );
    anyhow::ensure!(
        elapsed >= Duration::from_millis(1900),
        "closed after {elapsed:?}"
    );
    let again = sb.connect().await?;
    anyhow::ensure!(
        message_count(&again, "tx-open").await? == 0,
        "not rolled back"
    );
    again.close(200, s("bye")).await?;
    eventually(WAIT, || async {
        let logs = sb.logs();
        for line in [
            "CHN-1007 : Open Transaction : ",
            "CHN-1003 : Close : Open transaction timed out",
        ] {
            anyhow::ensure!(logs.contains(line), "'{line}' not logged:\n{logs}");
        }
        // Repeated once per warn period while open.
        let warnings = logs.matches("CHN-1007 : Open Transaction : ").count();
        anyhow::ensure!(warnings >= 3, "{warnings} CHN-1007 warnings:\n{logs}");
        anyhow::ensure!(!logs.contains("CHN-1008"), "idle warnings are off:\n{logs}");
        Ok(())
    })
    .await?;
    Ok(())
}

async fn an_idle_transaction_times_out_with_506(wiring: Wiring) -> anyhow::Result<()> {
    let wiring = with_logs(wiring);
    let config = "[engine]\ndefault_transaction_idle_warn = 300\n\
                  default_transaction_idle_close = \"1500ms\"\n";
    let sb = Sandbox::start_with_config(wiring, config).await?;
    let conn = sb.connect().await?;
    let mut watching = watcher(&conn).await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "tx-idle", false).await?;
    ch.tx_select().await?;
    // A transaction with nothing in it is not open: it never times out.
    tokio::time::sleep(Duration::from_millis(1800)).await;
    anyhow::ensure!(conn.status().connected(), "an empty transaction timed out");
    let started = Instant::now();
    publish(&ch, "tx-idle", b"left", BasicProperties::default()).await?;
    let error = closed_by_broker(&conn, &mut watching, WAIT).await?;
    let elapsed = started.elapsed();
    anyhow::ensure!(amqp_code(&error) == Some(506), "{error}");
    anyhow::ensure!(
        error.to_string().contains("Idle transaction timed out"),
        "{error}"
    );
    anyhow::ensure!(
        elapsed >= Duration::from_millis(1400),
        "closed after {elapsed:?}"
    );
    let again = sb.connect().await?;
    anyhow::ensure!(
        message_count(&again, "tx-idle").await? == 0,
        "not rolled back"
    );
    again.close(200, s("bye")).await?;
    eventually(WAIT, || async {
        let logs = sb.logs();
        for line in [
            "CHN-1008 : Idle Transaction : ",
            "CHN-1003 : Close : Idle transaction timed out",
        ] {
            anyhow::ensure!(logs.contains(line), "'{line}' not logged:\n{logs}");
        }
        Ok(())
    })
    .await?;
    Ok(())
}
