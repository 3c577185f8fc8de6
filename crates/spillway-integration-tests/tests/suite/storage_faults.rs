//! Storage faults, end to end: real lapin clients over real sockets, the
//! real gRPC hop to a real RocksDB store, no mocks.
//!
//! - the storage process SIGKILLed under a stream of confirmed persistent
//!   publishes, then started again: every confirmed message is there;
//! - the engine restarted while storage stays up: the new engine takes the
//!   lease at once (the old one released it) and recovers the messages;
//! - a second engine on the same store is refused; a write or
//!   `RemoveOrphans` without the current lease epoch is refused;
//! - a full disk (the store on a small tmpfs): `MST-1101`, publishes nacked
//!   and producers blocked, transient traffic unaffected, confirmed
//!   messages intact; the tmpfs grown, it clears (`MST-1102`);
//! - a corrupt message record: skipped, counted, deleted; the queue's other
//!   messages delivered.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use futures::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use spillway_integration_tests::{eventually, Component, Sandbox, Wiring};
use spillway_proto::storage::{write_op, Durability, MessageId, WriteBatch, WriteOp};
use spillway_proto::ServiceError;

/// Numbers shared with a publishing task (no lock is held across an
/// await).
type Shared = Arc<Mutex<Vec<u32>>>;

/// Runs `case` against `sandbox` with an overall deadline; panics with the
/// error and the broker's logs if it fails or does not finish in time.
macro_rules! run {
    ($sandbox:ident, $secs:literal, $case:expr) => {{
        let deadline = Duration::from_secs($secs);
        let wiring = $sandbox.wiring();
        let result = tokio::time::timeout(deadline, $case).await;
        match result {
            Ok(Ok(())) => {}
            Ok(Err(error)) => panic!("{wiring:?}: {error:#}\n{}", $sandbox.logs()),
            Err(_) => panic!(
                "{wiring:?}: timed out after {deadline:?}\n{}",
                $sandbox.logs()
            ),
        }
    }};
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

/// A body that starts with `n` and is `size` bytes long.
fn body(n: u32, size: usize) -> Vec<u8> {
    let mut body = vec![0u8; size.max(4)];
    body[..4].copy_from_slice(&n.to_be_bytes());
    body
}

fn number(body: &[u8]) -> anyhow::Result<u32> {
    let head: [u8; 4] = body
        .get(..4)
        .and_then(|head| head.try_into().ok())
        .context("a body shorter than 4 bytes")?;
    Ok(u32::from_be_bytes(head))
}

/// Closes the channel, then the connection (a dropped channel closes
/// itself in the background, and a connection close racing that fails).
async fn close(channel: Channel, conn: Connection) -> anyhow::Result<()> {
    channel.close(200, "bye".into()).await?;
    conn.close(200, "bye".into()).await?;
    Ok(())
}

/// Connects, retrying until the broker answers (after a restart).
async fn connect(sandbox: &Sandbox) -> anyhow::Result<Connection> {
    eventually(Duration::from_secs(30), || sandbox.connect()).await
}

/// Publishes `numbers` as persistent messages with confirms, waiting for
/// each confirm: the numbers acked and the first one nacked, if any (the
/// publishing stops there).
async fn publish_until_nacked(
    channel: &Channel,
    queue: &str,
    numbers: std::ops::Range<u32>,
    size: usize,
) -> anyhow::Result<(Vec<u32>, Option<u32>)> {
    let mut acked = Vec::new();
    for n in numbers {
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &body(n, size),
                persistent(),
            )
            .await?;
        let confirmation = tokio::time::timeout(Duration::from_secs(30), confirm)
            .await
            .with_context(|| format!("no confirm for message {n} in 30 s"))??;
        match confirmation {
            Confirmation::Ack(_) => acked.push(n),
            Confirmation::Nack(_) => return Ok((acked, Some(n))),
            Confirmation::NotRequested => bail!("confirms were not on"),
        }
    }
    Ok((acked, None))
}

/// Consumes every message `queue` holds now (no-ack): their numbers, in
/// delivery order.
async fn drain(sandbox: &Sandbox, queue: &str) -> anyhow::Result<Vec<u32>> {
    drain_n(sandbox, queue, None).await
}

/// Consumes `expected` messages of `queue` (None: as many as it holds now).
async fn drain_n(
    sandbox: &Sandbox,
    queue: &str,
    expected: Option<u32>,
) -> anyhow::Result<Vec<u32>> {
    let conn = connect(sandbox).await?;
    let channel = conn.create_channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        durable: true,
        ..Default::default()
    };
    let count = channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await?
        .message_count();
    let count = expected.unwrap_or(count);
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "drain".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let mut numbers = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let delivery = tokio::time::timeout(Duration::from_secs(20), consumer.next())
            .await
            .with_context(|| format!("{} of {count} delivered, then nothing", numbers.len()))?
            .context("the consumer ended")??;
        numbers.push(number(&delivery.data)?);
    }
    close(channel, conn).await?;
    Ok(numbers)
}

/// Every number of `confirmed` is in `delivered`, and the confirmed ones
/// come in the order they were published.
fn check_confirmed_delivered(confirmed: &[u32], delivered: &[u32]) -> anyhow::Result<()> {
    let set: std::collections::HashSet<u32> = delivered.iter().copied().collect();
    let missing: Vec<u32> = confirmed
        .iter()
        .copied()
        .filter(|n| !set.contains(n))
        .collect();
    ensure!(
        missing.is_empty(),
        "{} confirmed messages lost, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    let confirmed_set: std::collections::HashSet<u32> = confirmed.iter().copied().collect();
    let order: Vec<u32> = delivered
        .iter()
        .copied()
        .filter(|n| confirmed_set.contains(n))
        .collect();
    ensure!(
        order.windows(2).all(|pair| pair[0] < pair[1]),
        "confirmed messages out of order or duplicated"
    );
    Ok(())
}

// ------------------------------------------------ storage killed mid-batch

/// The storage process is SIGKILLed while a stream of confirmed persistent
/// publishes is under way, then started again on the same data. The
/// engine retries the batch that was in flight; every confirmed message is
/// there afterwards, in order, and nothing hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_killed_mid_batch_keeps_every_confirmed_message() {
    let mut sandbox = Sandbox::start(Wiring::Separate).await.expect("sandbox");
    run!(sandbox, 180, storage_killed_mid_batch(&mut sandbox));
}

async fn storage_killed_mid_batch(sandbox: &mut Sandbox) -> anyhow::Result<()> {
    {
        const MESSAGES: u32 = 3000;
        const WINDOW: usize = 64;
        let conn = sandbox.connect().await?;
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        channel
            .queue_declare("stream".into(), durable(), FieldTable::default())
            .await?;
        let confirmed: Shared = Default::default();
        let nacked: Shared = Default::default();
        let publishing = {
            let (channel, confirmed, nacked) = (channel.clone(), confirmed.clone(), nacked.clone());
            tokio::spawn(async move {
                let mut window = Vec::with_capacity(WINDOW);
                for n in 0..MESSAGES {
                    let confirm = channel
                        .basic_publish(
                            "".into(),
                            "stream".into(),
                            BasicPublishOptions::default(),
                            &body(n, 256),
                            persistent(),
                        )
                        .await?;
                    window.push((n, confirm));
                    if window.len() < WINDOW && n + 1 < MESSAGES {
                        continue;
                    }
                    for (n, confirm) in window.drain(..) {
                        // The storage node is down for a while: a confirm
                        // may wait that long, not for ever.
                        let confirmation = tokio::time::timeout(Duration::from_secs(60), confirm)
                            .await
                            .with_context(|| format!("no confirm for {n} in 60 s"))??;
                        let list = match confirmation {
                            Confirmation::Ack(_) => &confirmed,
                            _ => &nacked,
                        };
                        list.lock().expect("lock").push(n);
                    }
                }
                anyhow::Ok(())
            })
        };
        eventually(Duration::from_secs(30), || async {
            confirmed.lock().expect("lock").len() >= 500
        })
        .await
        .context("the stream did not get going")?;
        let at_kill = confirmed.lock().expect("lock").len();
        sandbox.kill_storage().await?;
        let down = Instant::now();
        sandbox.start_storage().await?;
        let restarted_after = down.elapsed();
        tokio::time::timeout(Duration::from_secs(120), publishing)
            .await
            .context("the publisher did not finish")???;
        let confirmed = confirmed.lock().expect("lock").clone();
        let nacked = nacked.lock().expect("lock").clone();
        close(channel, conn).await?;
        let delivered = drain(sandbox, "stream").await?;
        check_confirmed_delivered(&confirmed, &delivered)?;
        println!(
            "storage killed after {at_kill} confirms, back after {restarted_after:?}: \
             {} confirmed, {} nacked, {} delivered",
            confirmed.len(),
            nacked.len(),
            delivered.len()
        );
        ensure!(
            confirmed.len() + nacked.len() == MESSAGES as usize,
            "every publish was answered"
        );
        Ok(())
    }
}

// ------------------------------------------ engine restarted, storage up

/// A clean engine restart with the storage node left running: the old
/// engine released its lease, so the new one takes it at once (well under
/// the 5 s it would otherwise wait) and recovers every message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_takes_the_lease_at_once_and_recovers() {
    let mut sandbox = Sandbox::start(Wiring::Separate).await.expect("sandbox");
    run!(sandbox, 120, engine_restart(&mut sandbox));
}

async fn engine_restart(sandbox: &mut Sandbox) -> anyhow::Result<()> {
    {
        let conn = sandbox.connect().await?;
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        channel
            .queue_declare("kept".into(), durable(), FieldTable::default())
            .await?;
        let (acked, nacked) = publish_until_nacked(&channel, "kept", 0..200, 512).await?;
        ensure!(nacked.is_none(), "a healthy store nacked {nacked:?}");
        close(channel, conn).await?;
        let took = sandbox.restart_engine().await?;
        println!("engine restarted with storage up: ready in {took:?}");
        let logs = sandbox.logs();
        ensure!(
            logs.contains("store lease released")
                && !logs.contains("store leased to another engine"),
            "the new engine waited for the old lease ({took:?}): it was not released"
        );
        let delivered = drain(sandbox, "kept").await?;
        ensure!(
            delivered == acked,
            "recovered {} of {}",
            delivered.len(),
            acked.len()
        );
        Ok(())
    }
}

// ------------------------------------------------ one engine per store

/// A second engine pointed at a store another engine holds exits with an
/// error naming the reason (after waiting out one lease, in case the holder
/// was its own killed predecessor); the first engine is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_engine_on_the_same_store_is_refused() {
    let sandbox = Sandbox::start(Wiring::Separate).await.expect("sandbox");
    run!(sandbox, 90, second_engine(&sandbox));
}

async fn second_engine(sandbox: &Sandbox) -> anyhow::Result<()> {
    {
        let started = Instant::now();
        let (status, log) = sandbox.run_extra_engine(Duration::from_secs(60)).await?;
        let status = status.context("the second engine was still running after 60 s")?;
        ensure!(
            !status.success(),
            "the second engine exited successfully:\n{log}"
        );
        ensure!(
            log.contains("one engine per store") && log.contains("another engine holds this store"),
            "the refusal does not say why:\n{log}"
        );
        println!("second engine refused after {:?}", started.elapsed());
        still_works(sandbox).await
    }
}

/// A write or `RemoveOrphans` without the lease's epoch, and a new lease
/// while the engine's is live, are refused with FAILED_PRECONDITION; the
/// broker goes on.
async fn stale_epochs_are_refused(wiring: Wiring) {
    let sandbox = Sandbox::start(wiring).await.expect("sandbox");
    run!(sandbox, 60, stale_epochs(&sandbox));
}

async fn stale_epochs(sandbox: &Sandbox) -> anyhow::Result<()> {
    {
        let storage = sandbox.storage_api()?;
        for epoch in [0, u64::MAX] {
            match storage.remove_orphans(epoch, u64::MAX).await {
                Err(ServiceError::FailedPrecondition(text)) => {
                    ensure!(text.contains("epoch"), "unclear refusal: {text}")
                }
                other => bail!("RemoveOrphans with epoch {epoch}: {other:?}"),
            }
            let batch = WriteBatch {
                ops: vec![WriteOp {
                    op: Some(write_op::Op::DeleteMessage(MessageId { id: u64::MAX })),
                }],
                durability: Durability::Synced.into(),
                epoch,
                sequence: 0,
            };
            match storage.write(Arc::new(batch)).await {
                Err(ServiceError::FailedPrecondition(_)) => {}
                other => bail!("a write with epoch {epoch}: {other:?}"),
            }
        }
        let request = spillway_proto::storage::AcquireLeaseRequest {
            epoch: 0,
            ttl_ms: 5_000,
            holder: "a test".into(),
        };
        match storage.acquire_lease(request).await {
            Err(ServiceError::FailedPrecondition(text)) => ensure!(
                text.contains("one engine per store"),
                "unclear refusal: {text}"
            ),
            other => bail!("a second lease: {other:?}"),
        }
        still_works(sandbox).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_epochs_are_refused_in_process() {
    stale_epochs_are_refused(Wiring::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_epochs_are_refused_separate_processes() {
    stale_epochs_are_refused(Wiring::Separate).await;
}

/// A persistent message is confirmed and comes back.
async fn still_works(sandbox: &Sandbox) -> anyhow::Result<()> {
    let conn = sandbox.connect().await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    channel
        .queue_declare("after".into(), durable(), FieldTable::default())
        .await?;
    let (acked, nacked) = publish_until_nacked(&channel, "after", 7..8, 16).await?;
    ensure!(acked == [7] && nacked.is_none(), "not confirmed");
    close(channel, conn).await?;
    ensure!(drain(sandbox, "after").await? == [7], "not delivered");
    Ok(())
}

// ------------------------------------------------- a wrong data directory

/// The storage node comes back on an empty data directory (another store
/// id, epoch 0) under a running engine: the engine must not carry on as an
/// empty broker. Its lease renewal is refused, the store counts as failed
/// (`MST-1101`) and persistent publishes are nacked; back on the right
/// directory, the lease renews, the failure clears and the messages are
/// all there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_data_dir_is_a_store_failure_not_an_empty_broker() {
    let mut sandbox = Sandbox::start(Wiring::Separate).await.expect("sandbox");
    run!(sandbox, 120, wrong_data_dir(&mut sandbox));
}

async fn store_failed(sandbox: &Sandbox, failed: bool) -> anyhow::Result<()> {
    let want = if failed { 1.0 } else { 0.0 };
    eventually(Duration::from_secs(30), || async {
        sandbox
            .metric(Component::Engine, "spillway_store_failed")
            .await
            .ok()
            .filter(|value| *value == want)
    })
    .await
    .with_context(|| format!("spillway_store_failed did not become {want}"))?;
    Ok(())
}

async fn wrong_data_dir(sandbox: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sandbox.connect().await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    channel
        .queue_declare("precious".into(), durable(), FieldTable::default())
        .await?;
    let (acked, nacked) = publish_until_nacked(&channel, "precious", 0..20, 128).await?;
    ensure!(acked.len() == 20 && nacked.is_none(), "not all confirmed");
    close(channel, conn).await?;

    let empty = tempfile::tempdir()?;
    sandbox.kill_storage().await?;
    sandbox.start_storage_on(empty.path()).await?;
    store_failed(sandbox, true).await?;
    let conn = sandbox.connect().await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let (taken, refused) = publish_until_nacked(&channel, "precious", 100..101, 128).await?;
    ensure!(
        taken.is_empty() && refused.is_some(),
        "a persistent publish was taken"
    );
    // Refused, it is blocked now: lapin sends nothing (a close included)
    // until it is released.
    let logs = sandbox.logs();
    ensure!(
        logs.contains("MST-1101 : Store failure : ") && logs.contains("stale"),
        "no MST-1101 naming the stale lease"
    );

    sandbox.kill_storage().await?;
    sandbox.start_storage().await?;
    store_failed(sandbox, false).await?;
    eventually(Duration::from_secs(10), || async {
        !conn.status().blocked()
    })
    .await
    .context("the refused producer was not released")?;
    close(channel, conn).await?;
    let delivered = drain(sandbox, "precious").await?;
    ensure!(delivered == acked, "delivered {delivered:?}");
    Ok(())
}

// ------------------------------------------------------------ a full disk

/// A tmpfs mounted for one test, unmounted when dropped (also when the test
/// fails). Needs root, as these tests run.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .context("running mount")?;
        ensure!(
            status.success(),
            "mount -t tmpfs failed ({status}): these tests need root"
        );
        Ok(Self { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn resize(&self, size: &str) -> anyhow::Result<()> {
        let status = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(self.dir.path())
            .status()?;
        ensure!(status.success(), "remount to {size} failed: {status}");
        Ok(())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazy: a store still open in this process must not keep it.
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// The store on an 8 MiB tmpfs, filled with 64 KiB persistent messages:
/// the store fails (`MST-1101`), the publish that hit it and every later
/// persistent one are nacked, the producer is blocked; a connection that
/// only moves transient messages works as before. Grown to 256 MiB, the
/// store's probe lands: `MST-1102`, the producer is released, publishes are
/// confirmed again, and every message confirmed before is there.
async fn a_full_disk_fails_the_store_and_clears(wiring: Wiring) {
    let tmpfs = Tmpfs::mount("8m").expect("tmpfs");
    let data: PathBuf = tmpfs.path().join("data");
    let sandbox = Sandbox::start_on(wiring, "", Some(data))
        .await
        .expect("sandbox");
    run!(sandbox, 180, full_disk(&sandbox, &tmpfs));
    drop(sandbox);
    drop(tmpfs);
}

async fn full_disk(sandbox: &Sandbox, tmpfs: &Tmpfs) -> anyhow::Result<()> {
    let wiring = sandbox.wiring();
    {
        let producer = sandbox.connect().await?;
        let channel = producer.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        channel
            .queue_declare("full".into(), durable(), FieldTable::default())
            .await?;
        let (mut confirmed, nacked) =
            publish_until_nacked(&channel, "full", 0..1000, 64 * 1024).await?;
        let first_nack = nacked.context("8 MiB took 1000 messages of 64 KiB")?;
        println!(
            "{wiring:?}: the store failed after {} confirmed messages of 64 KiB",
            confirmed.len()
        );
        eventually(Duration::from_secs(10), || async {
            sandbox
                .metric(Component::Engine, "spillway_store_failed")
                .await
                .ok()
                .filter(|value| *value == 1.0)
        })
        .await
        .context("spillway_store_failed is not 1")?;
        eventually(Duration::from_secs(10), || async {
            producer.status().blocked()
        })
        .await
        .context("the producer was not blocked")?;
        // A new producer (lapin sends nothing on a blocked connection) is
        // refused at once, not queued behind the failure, and blocked.
        let late = sandbox.connect().await?;
        let late_channel = late.create_channel().await?;
        late_channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let (acked, refused) =
            publish_until_nacked(&late_channel, "full", first_nack + 1..first_nack + 2, 16).await?;
        ensure!(
            acked.is_empty() && refused.is_some(),
            "a persistent publish was taken"
        );
        eventually(Duration::from_secs(10), || async {
            late.status().blocked()
        })
        .await
        .context("the refused producer was not blocked")?;
        // Without confirms: the connection is closed (506 RESOURCE_ERROR).
        let unconfirmed = sandbox.connect().await?;
        let unconfirmed_channel = unconfirmed.create_channel().await?;
        unconfirmed_channel
            .basic_publish(
                "".into(),
                "full".into(),
                BasicPublishOptions::default(),
                &body(u32::MAX, 16),
                persistent(),
            )
            .await?;
        eventually(Duration::from_secs(10), || async {
            !unconfirmed.status().connected()
        })
        .await
        .context("a persistent publish without confirms was not refused")?;

        // Transient traffic does not touch the store: it goes on.
        let other = sandbox.connect().await?;
        let transient = other.create_channel().await?;
        transient
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        transient
            .queue_declare(
                "scratch".into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await?;
        for n in 0..20u32 {
            let confirm = transient
                .basic_publish(
                    "".into(),
                    "scratch".into(),
                    BasicPublishOptions::default(),
                    &body(n, 1024),
                    BasicProperties::default(),
                )
                .await?;
            let confirmation = tokio::time::timeout(Duration::from_secs(10), confirm).await??;
            ensure!(
                matches!(confirmation, Confirmation::Ack(_)),
                "transient {n} nacked"
            );
        }
        let got = tokio::time::timeout(
            Duration::from_secs(10),
            transient.basic_get("scratch".into(), BasicGetOptions { no_ack: true }),
        )
        .await??;
        ensure!(got.is_some(), "a transient message was not delivered");
        ensure!(
            !other.status().blocked(),
            "a transient-only producer was blocked"
        );

        // Space again: the probe lands and everything resumes.
        tmpfs.resize("256m")?;
        eventually(Duration::from_secs(60), || async {
            sandbox
                .metric(Component::Engine, "spillway_store_failed")
                .await
                .ok()
                .filter(|value| *value == 0.0)
        })
        .await
        .context("the store failure did not clear")?;
        eventually(Duration::from_secs(10), || async {
            !producer.status().blocked()
        })
        .await
        .context("the producer was not released")?;
        let (acked, nacked) = publish_until_nacked(&channel, "full", 5000..5010, 1024).await?;
        ensure!(nacked.is_none(), "nacked after the failure cleared");
        confirmed.extend(acked);
        close(transient, other).await?;
        close(late_channel, late).await?;
        close(channel, producer).await?;
        let delivered = drain(sandbox, "full").await?;
        check_confirmed_delivered(&confirmed, &delivered)?;
        if wiring == Wiring::Separate {
            let logs = sandbox.logs();
            for line in [
                "MST-1101 : Store failure : ",
                "MST-1102 : Store failure cleared",
            ] {
                ensure!(logs.contains(line), "'{line}' not logged");
            }
        }
        println!(
            "{wiring:?}: {} confirmed, {} delivered after the failure cleared",
            confirmed.len(),
            delivered.len()
        );
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_the_store_and_clears_in_process() {
    a_full_disk_fails_the_store_and_clears(Wiring::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_the_store_and_clears_separate_processes() {
    a_full_disk_fails_the_store_and_clears(Wiring::Separate).await;
}

// ---------------------------------------------------------- a corrupt record

/// One message record overwritten with garbage while the broker is down:
/// after the restart the queue's other messages are delivered, the corrupt
/// one is counted (`spillway_store_corrupt_records_total`) and gone from
/// the store, queue entry and all.
async fn a_corrupt_record_is_skipped_counted_and_deleted(wiring: Wiring) {
    let mut sandbox = Sandbox::start(wiring).await.expect("sandbox");
    run!(sandbox, 120, corrupt_record(&mut sandbox));
}

async fn corrupt_record(sandbox: &mut Sandbox) -> anyhow::Result<()> {
    {
        let conn = sandbox.connect().await?;
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        channel
            .queue_declare("damaged".into(), durable(), FieldTable::default())
            .await?;
        let (acked, nacked) = publish_until_nacked(&channel, "damaged", 0..10, 100).await?;
        ensure!(acked.len() == 10 && nacked.is_none(), "not all confirmed");
        close(channel, conn).await?;
        sandbox.stop_all().await;
        let data = sandbox.data_dir();
        // The stopped store's last handle may take a moment to go.
        let corrupted = eventually(Duration::from_secs(10), || async {
            corrupt_fifth_message_record(&data)
        })
        .await?;
        sandbox.start_again().await?;
        let delivered = drain_n(sandbox, "damaged", Some(9)).await?;
        let expected: Vec<u32> = (0..10).filter(|n| *n != 4).collect();
        ensure!(
            delivered == expected,
            "delivered {delivered:?} after corrupting record {corrupted}"
        );
        let counted = sandbox
            .metric(Component::Storage, "spillway_store_corrupt_records_total")
            .await?;
        ensure!(
            counted == 1.0,
            "spillway_store_corrupt_records_total = {counted}"
        );
        eventually(Duration::from_secs(10), || async {
            sandbox
                .store_status(true)
                .await
                .ok()
                .filter(|status| status.message_records == 0 && status.queue_entries == 0)
        })
        .await
        .context("the corrupt record or its queue entry stayed in the store")?;
        Ok(())
    }
}

/// Overwrites the fifth message record (`p` + id, ids in publish order)
/// with bytes that do not decode; returns its id.
fn corrupt_fifth_message_record(data: &Path) -> anyhow::Result<u64> {
    let db = rocksdb::DB::open_default(data).context("opening the store directly")?;
    let mut keys = Vec::new();
    for entry in db.prefix_iterator(b"p") {
        let (key, _) = entry?;
        if key.len() != 9 || key[0] != b'p' {
            break;
        }
        keys.push(key.to_vec());
    }
    ensure!(keys.len() == 10, "{} message records, not 10", keys.len());
    let key = &keys[4];
    // A length-delimited field 1 where a varint is expected, 200 bytes
    // announced and 1 there.
    db.put(key, [0x0a, 0xc8, 0x01, 0x01])?;
    db.flush()?;
    let id = u64::from_be_bytes(key[1..].try_into()?);
    Ok(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_record_is_skipped_counted_and_deleted_in_process() {
    a_corrupt_record_is_skipped_counted_and_deleted(Wiring::InProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_record_is_skipped_counted_and_deleted_separate_processes() {
    a_corrupt_record_is_skipped_counted_and_deleted(Wiring::Separate).await;
}
