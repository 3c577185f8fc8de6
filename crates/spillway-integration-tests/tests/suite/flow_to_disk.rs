//! Flow to disk through real clients: a backlog ten times the threshold stays
//! within the memory budget, comes back whole and in order, and leaves
//! nothing on disk once acked; a crash with a spilled backlog leaves no
//! garbage after the restart. Both wirings.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use spillway_integration_tests::{both_wirings, eventually, Sandbox, Wiring};

both_wirings!(
    own_sandbox, timeout_secs = 300;
    ten_times_the_threshold_stays_bounded_and_comes_back_whole,
);

const MIB: u64 = 1 << 20;
const THRESHOLD: u64 = 32 * MIB;
/// What resident bytes may exceed the threshold by: one spill window (an
/// eighth of the threshold, at least 1 MiB: publishers wait while more is
/// on its way to the store) plus the one message that may be published
/// into a full window (the largest, 1 MiB, with its accounted overhead).
const ONE_BATCH: u64 = THRESHOLD / 8 + MIB + 4096;

const QUEUES: [&str; 3] = ["spill-a", "spill-b", "spill-c"];
/// Body sizes, 1 B to 1 MiB, cycled through per queue.
const SIZES: [usize; 8] = [1, 512, 4096, 16384, 65536, 131072, 262144, 1 << 20];

fn config(threshold: u64) -> String {
    format!("[engine]\nflow_to_disk_threshold = {threshold}\nhousekeeping_interval = \"100ms\"\n")
}

/// The body of message `seq` of queue number `queue`: its size from
/// `SIZES`, its bytes from both numbers, so any mix-up shows.
fn body(queue: usize, seq: u64) -> Vec<u8> {
    let size = SIZES[(seq as usize * 3 + queue) % SIZES.len()];
    (0..size)
        .map(|i| (seq as usize).wrapping_mul(31).wrapping_add(i * 7 + queue) as u8)
        .collect()
}

fn message_id(queue: usize, seq: u64) -> String {
    format!("{queue}-{seq}")
}

/// Samples the engine's resident message bytes until told to stop; returns
/// the highest figure seen.
pub(crate) fn sample_resident(
    sandbox: Arc<Sandbox>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut highest = 0u64;
        while !stop.load(Ordering::Relaxed) {
            if let Ok(value) = sandbox
                .engine_metric("spillway_broker_resident_message_bytes")
                .await
            {
                highest = highest.max(value as u64);
            }
            // Sampling rate, not a wait for a condition.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        highest
    })
}

/// Publishes `bytes` of messages, spread over `QUEUES`, with confirms;
/// returns how many went to each queue.
async fn publish_backlog(
    sandbox: &Sandbox,
    bytes: u64,
    persistent: bool,
) -> anyhow::Result<Vec<u64>> {
    let connection = sandbox.connect().await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for queue in QUEUES {
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
    }
    let mut counts = vec![0u64; QUEUES.len()];
    let mut published = 0u64;
    let mut pending = Vec::new();
    let mut turn = 0usize;
    while published < bytes {
        let queue = turn % QUEUES.len();
        turn += 1;
        let seq = counts[queue];
        let payload = body(queue, seq);
        published += payload.len() as u64;
        let properties = BasicProperties::default()
            .with_message_id(message_id(queue, seq).into())
            .with_delivery_mode(if persistent { 2 } else { 1 });
        let confirm = channel
            .basic_publish(
                "".into(),
                QUEUES[queue].into(),
                BasicPublishOptions::default(),
                &payload,
                properties,
            )
            .await?;
        pending.push(confirm);
        counts[queue] += 1;
        if pending.len() >= 64 {
            for confirm in pending.drain(..) {
                anyhow::ensure!(confirm.await?.is_ack(), "a publish was nacked");
            }
        }
    }
    for confirm in pending {
        anyhow::ensure!(confirm.await?.is_ack(), "a publish was nacked");
    }
    connection.close(200, "done".into()).await?;
    Ok(counts)
}

/// Consumes every queue to the end: each message exactly once, in order,
/// byte-identical, acked one by one.
async fn drain_and_check(sandbox: &Sandbox, counts: &[u64]) -> anyhow::Result<()> {
    let connection = sandbox.connect().await?;
    for (queue, expected) in counts.iter().enumerate() {
        let channel = connection.create_channel().await?;
        channel.basic_qos(50, BasicQosOptions::default()).await?;
        let mut consumer = channel
            .basic_consume(
                QUEUES[queue].into(),
                "drain".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        for seq in 0..*expected {
            let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
                .await
                .map_err(|_| {
                    anyhow::anyhow!("queue {queue} stalled at message {seq} of {expected}")
                })?
                .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
            let id = delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string())
                .unwrap_or_default();
            anyhow::ensure!(
                id == message_id(queue, seq),
                "queue {queue}: expected message {seq}, got {id}"
            );
            anyhow::ensure!(
                delivery.data == body(queue, seq),
                "queue {queue}: message {seq} came back different ({} bytes)",
                delivery.data.len()
            );
            delivery.acker.ack(BasicAckOptions::default()).await?;
        }
        // Nothing more: exactly once.
        let extra = tokio::time::timeout(Duration::from_millis(300), consumer.next()).await;
        anyhow::ensure!(
            extra.is_err(),
            "queue {queue} delivered more than was published"
        );
        channel.close(200, "drained".into()).await?;
    }
    connection.close(200, "done".into()).await?;
    Ok(())
}

async fn wait_for_no_records(sandbox: &Sandbox, want_records: u64) -> anyhow::Result<()> {
    eventually(Duration::from_secs(10), || async {
        let status = sandbox.store_status(true).await?;
        anyhow::ensure!(
            status.message_records == want_records,
            "store still holds records: {status:?}"
        );
        Ok(())
    })
    .await
}

async fn ten_times_the_threshold_stays_bounded_and_comes_back_whole(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let sandbox = Arc::new(Sandbox::start_with_config(wiring, &config(THRESHOLD)).await?);
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_resident(sandbox.clone(), stop.clone());

    let counts = publish_backlog(&sandbox, 10 * THRESHOLD, false).await?;

    // Housekeeping settles what the last arrivals left over. The queues
    // share the threshold less the bookkeeping and the spill reserve (an
    // eighth of it, kept for payloads on their way to the store), and each
    // keeps its head resident whatever its target.
    let settled = THRESHOLD - THRESHOLD / 8 + QUEUES.len() as u64 * (MIB + 4096);
    eventually(Duration::from_secs(10), || async {
        anyhow::ensure!(
            sandbox
                .engine_metric("spillway_broker_flow_to_disk_active")
                .await?
                == 1.0,
            "flow to disk is not active with a backlog ten times the threshold"
        );
        let resident = sandbox
            .engine_metric("spillway_broker_resident_message_bytes")
            .await? as u64;
        let bookkeeping = sandbox
            .engine_metric("spillway_broker_bookkeeping_bytes")
            .await? as u64;
        anyhow::ensure!(
            resident + bookkeeping <= settled,
            "resident {resident} + bookkeeping {bookkeeping} after housekeeping, above {settled}"
        );
        Ok(())
    })
    .await?;
    let spilled: f64 = {
        let mut total = 0.0;
        for queue in QUEUES {
            total += sandbox
                .engine_metric(&format!(
                    "spillway_queue_spilled_bytes{{vhost=\"/\",queue=\"{queue}\"}}"
                ))
                .await?;
        }
        total
    };
    anyhow::ensure!(
        spilled as u64 >= 8 * THRESHOLD,
        "only {spilled} bytes flowed to disk"
    );
    let stored = sandbox.store_status(true).await?;
    anyhow::ensure!(
        stored.message_records > 0 && stored.queue_entries == 0,
        "transient payloads on disk: {stored:?}"
    );

    drain_and_check(&sandbox, &counts).await?;
    stop.store(true, Ordering::Relaxed);
    let highest = sampler.await?;
    anyhow::ensure!(
        highest <= THRESHOLD + ONE_BATCH,
        "resident bytes reached {highest}, over {THRESHOLD} + {ONE_BATCH}"
    );
    // Every payload that flowed is deleted once acked.
    wait_for_no_records(&sandbox, 0).await?;
    println!(
        "{wiring:?}: {} messages, highest resident {highest} bytes (threshold {THRESHOLD})",
        counts.iter().sum::<u64>()
    );
    Ok(())
}

/// SIGKILL with transient payloads on disk: as the engine starts again it
/// has the storage node remove every record no durable queue references,
/// and the persistent messages are all still there.
async fn a_crash_with_a_spilled_backlog_leaves_no_garbage(wiring: Wiring) -> anyhow::Result<()> {
    let threshold = 4 * MIB;
    let mut sandbox = Sandbox::start_with_config(wiring, &config(threshold)).await?;
    let persistent = publish_backlog(&sandbox, 2 * MIB, true).await?;
    let persistent_total: u64 = persistent.iter().sum();
    let transient = publish_backlog(&sandbox, 96 * MIB, false).await?;
    eventually(Duration::from_secs(10), || async {
        let spilled = sandbox
            .engine_metric("spillway_queue_spilled_messages{vhost=\"/\",queue=\"spill-a\"}")
            .await?;
        anyhow::ensure!(spilled > 0.0, "nothing flowed to disk");
        Ok(())
    })
    .await?;
    let exact = wiring == Wiring::Separate;
    if exact {
        let before = sandbox.store_status(true).await?;
        anyhow::ensure!(
            before.message_records > persistent_total,
            "nothing flowed to disk: {before:?}"
        );
    }

    sandbox.kill_and_restart().await?;

    let logs = sandbox.logs();
    let removed: u64 = logs
        .lines()
        .filter(|line| line.contains("unreferenced message records removed"))
        .filter_map(|line| line.split("orphaned_messages=").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .max()
        .unwrap_or(0);
    anyhow::ensure!(
        removed > 0,
        "the start-up clean-up removed nothing:\n{logs}"
    );
    if exact {
        let after = sandbox.store_status(true).await?;
        anyhow::ensure!(
            after.message_records == persistent_total && after.queue_entries == persistent_total,
            "after the restart the store holds {after:?}, want {persistent_total} records"
        );
    }
    // The persistent messages come back whole; the transient ones are gone.
    drain_and_check(&sandbox, &persistent).await?;
    if exact {
        wait_for_no_records(&sandbox, 0).await?;
    }
    println!(
        "{wiring:?}: {} transient and {persistent_total} persistent before the crash; {removed} records removed at start-up",
        transient.iter().sum::<u64>(),
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_in_one_process_a_crash_with_a_spilled_backlog_leaves_no_garbage() -> anyhow::Result<()>
{
    a_crash_with_a_spilled_backlog_leaves_no_garbage(Wiring::AllInOneProcess).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_a_crash_with_a_spilled_backlog_leaves_no_garbage() -> anyhow::Result<()> {
    a_crash_with_a_spilled_backlog_leaves_no_garbage(Wiring::Separate).await
}
