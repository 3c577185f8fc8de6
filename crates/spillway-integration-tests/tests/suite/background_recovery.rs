//! Background recovery through lapin and management, in both wirings: a
//! store left with a million messages on a thousand durable queues (written
//! straight into RocksDB, as a previous run leaves it) serves a client at
//! once. While the queues still load, a publish to a recovering queue is
//! confirmed, a basic.get waits for its queue, and nothing published now
//! overtakes what a queue held. A message stored once for two queues keeps
//! its payload when the first queue's copy is acked before the second queue
//! is read; payloads nothing references are deleted.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use spillway_integration_tests::{
    both_wirings, eventually, next_delivery, publish, Management, Sandbox, Wiring,
};
use spillway_proto::management::{GetBrokerStatusRequest, RecoveryStatus};
use spillway_proto::storage::{
    write_op, Durability, MessageRecord, QueueDefinition, QueueEntry, WriteBatch, WriteOp,
};
use spillway_storage::RocksStore;

both_wirings!(
    own_sandbox, timeout_secs = 300;
    a_restart_with_a_million_messages_serves_at_once_and_keeps_order,
);

/// Filler queues and messages on each: together a million messages,
/// enough that reading them takes far longer than a client's connect.
const QUEUES: u64 = 1_000;
const PER_QUEUE: u64 = 1_000;
/// Messages stored once and held by both [`FIRST`] and `zz-shared`: the
/// first is read before the filler queues, the second after (the store
/// keeps queues in order of name length, then name).
const SHARED: u64 = 100;
const FIRST: &str = "a-shrd";
/// Records no queue entry references (a crash's garbage).
const ORPHANS: u64 = 50;

const WAIT: Duration = Duration::from_secs(60);

fn filler(index: u64) -> String {
    format!("q-{index:04}")
}

fn body(queue: &str, index: u64) -> Vec<u8> {
    format!("{queue}/{index:04}").into_bytes()
}

fn op(op: write_op::Op) -> WriteOp {
    WriteOp { op: Some(op) }
}

fn record(id: u64, body: Vec<u8>) -> WriteOp {
    op(write_op::Op::PutMessage(MessageRecord {
        id,
        exchange: String::new(),
        routing_key: String::new(),
        // Encoded AMQP properties: no flag set.
        properties: vec![0, 0].into(),
        body: body.into(),
        persistent: true,
        ..Default::default()
    }))
}

fn entry(queue: &str, id: u64, body_size: usize) -> WriteOp {
    op(write_op::Op::PutQueueEntry(QueueEntry {
        vhost: "/".into(),
        queue: queue.into(),
        id,
        body_size: body_size as u64,
        ..Default::default()
    }))
}

fn queue(name: &str) -> WriteOp {
    op(write_op::Op::PutQueue(QueueDefinition {
        vhost: "/".into(),
        name: name.into(),
        ..Default::default()
    }))
}

/// Writes what a previous run would have left: the shared messages (ids
/// 1..=SHARED) on [`FIRST`] and `zz-shared`, orphaned records after them,
/// then the filler queues. Returns how many message records it wrote.
fn seed(dir: &Path) -> anyhow::Result<u64> {
    let store = RocksStore::open(dir)?;
    let write = |ops: Vec<WriteOp>| {
        store.write_batch(&WriteBatch {
            ops,
            durability: Durability::Logged.into(),
            epoch: 0,
            sequence: 0,
        })
    };
    let mut ops = vec![queue(FIRST), queue("zz-shared")];
    for id in 1..=SHARED {
        let body = body("shared", id);
        ops.push(entry(FIRST, id, body.len()));
        ops.push(entry("zz-shared", id, body.len()));
        ops.push(record(id, body));
    }
    for id in SHARED + 1..=SHARED + ORPHANS {
        ops.push(record(id, body("orphan", id)));
    }
    write(ops)?;
    let mut id = 1_000;
    for index in 0..QUEUES {
        let name = filler(index);
        let mut ops = vec![queue(&name)];
        for n in 0..PER_QUEUE {
            id += 1;
            let body = body(&name, n);
            ops.push(entry(&name, id, body.len()));
            ops.push(record(id, body));
        }
        write(ops)?;
    }
    Ok(SHARED + ORPHANS + QUEUES * PER_QUEUE)
}

async fn recovery(management: &mut Management) -> anyhow::Result<RecoveryStatus> {
    let status = management
        .get_broker_status(GetBrokerStatusRequest {})
        .await?
        .into_inner();
    status
        .recovery
        .ok_or_else(|| anyhow::anyhow!("the broker status has no recovery"))
}

/// Fails when recovery already finished: the step before it was meant to
/// happen while queues were still loading.
async fn still_recovering(management: &mut Management, step: &str) -> anyhow::Result<()> {
    let status = recovery(management).await?;
    anyhow::ensure!(
        !status.complete,
        "recovery finished before {step} ({status:?}): the test proves nothing"
    );
    Ok(())
}

/// Consumes `count` messages of `queue` with manual acks, in order.
async fn drain(channel: &Channel, queue: &str, count: u64) -> anyhow::Result<Vec<Vec<u8>>> {
    channel.basic_qos(200, BasicQosOptions::default()).await?;
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            format!("drain-{queue}").as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut bodies = Vec::new();
    for _ in 0..count {
        let delivery = next_delivery(&mut consumer, WAIT).await?;
        bodies.push(delivery.data.clone());
        delivery.ack(BasicAckOptions::default()).await?;
    }
    channel
        .basic_cancel(
            format!("drain-{queue}").as_str().into(),
            BasicCancelOptions::default(),
        )
        .await?;
    Ok(bodies)
}

async fn a_restart_with_a_million_messages_serves_at_once_and_keeps_order(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    let seeding = Instant::now();
    let records = seed(data.path())?;
    println!(
        "{wiring:?}: seeded {records} records on {} queues in {} ms",
        QUEUES + 2,
        seeding.elapsed().as_millis()
    );

    let started = Instant::now();
    let sandbox = Sandbox::start_recovering(wiring, data.path().to_path_buf()).await?;
    let result = exercise(&sandbox, started, records).await;
    result.map_err(|error| anyhow::anyhow!("{error:#}\n{}", sandbox.logs()))
}

async fn exercise(sandbox: &Sandbox, started: Instant, records: u64) -> anyhow::Result<()> {
    let wiring = sandbox.wiring();
    let conn: Connection = sandbox.connect().await?;
    let first_connection = started.elapsed();
    let mut management = sandbox.management().await?;
    still_recovering(&mut management, "the first client connected").await?;

    // The first queue read (after the orphans are gone): its messages,
    // acked while the rest load.
    let ch = conn.create_channel().await?;
    let shared = drain(&ch, FIRST, SHARED).await?;
    let expected: Vec<Vec<u8>> = (1..=SHARED).map(|id| body("shared", id)).collect();
    anyhow::ensure!(shared == expected, "{FIRST} came back out of order");
    still_recovering(&mut management, "the first shared queue was acked").await?;

    // A queue still loading takes a publish (confirmed) ...
    let late = filler(QUEUES - 1);
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let confirmation = publish(
        &ch,
        "",
        &late,
        b"published during recovery",
        BasicProperties::default().with_delivery_mode(2),
    )
    .await?;
    anyhow::ensure!(confirmation.is_ack(), "not confirmed: {confirmation:?}");
    // ... and a basic.get on the last queue read waits for it: its payload
    // is still there although the first queue's copy is gone.
    let got = ch
        .basic_get("zz-shared".into(), BasicGetOptions { no_ack: true })
        .await?
        .ok_or_else(|| anyhow::anyhow!("zz-shared answered get-empty"))?;
    anyhow::ensure!(
        got.delivery.data == body("shared", 1),
        "zz-shared's head is {:?}",
        String::from_utf8_lossy(&got.delivery.data)
    );

    let status = eventually(WAIT, || {
        let mut management = management.clone();
        async move {
            recovery(&mut management)
                .await
                .ok()
                .filter(|status| status.complete)
        }
    })
    .await?;
    let total = QUEUES as u32 + 2;
    anyhow::ensure!(
        status.queues_total == total && status.queues_recovered == total,
        "{status:?}"
    );
    anyhow::ensure!(
        status.messages_recovered == 2 * SHARED + QUEUES * PER_QUEUE,
        "{status:?}"
    );
    println!(
        "{wiring:?}: first connection accepted after {} ms; recovery of {} messages complete after {} ms",
        first_connection.as_millis(),
        status.messages_recovered,
        status.elapsed_ms
    );

    // The rest of zz-shared, then the late queue: what it held first, the
    // message published during recovery last.
    let rest = drain(&ch, "zz-shared", SHARED - 1).await?;
    anyhow::ensure!(rest == expected[1..], "zz-shared came back out of order");
    let bodies = drain(&ch, &late, PER_QUEUE + 1).await?;
    let mut expected: Vec<Vec<u8>> = (0..PER_QUEUE).map(|n| body(&late, n)).collect();
    expected.push(b"published during recovery".to_vec());
    anyhow::ensure!(bodies == expected, "{late} came back out of order");

    // Orphans and the shared records are gone, the filler stays: every
    // record but those, less the late queue's drained ones.
    let wanted = records - SHARED - ORPHANS - PER_QUEUE;
    eventually(WAIT, || async {
        sandbox
            .store_status(true)
            .await
            .ok()
            .filter(|status| status.message_records == wanted)
    })
    .await
    .map_err(|error| anyhow::anyhow!("store records never came to {wanted}: {error:#}"))?;
    ch.close(200, "bye".into()).await?;
    conn.close(200, "bye".into()).await?;
    Ok(())
}
