//! Message compression through lapin, in both wirings
//! (`gateway.message_compression_enabled`, docs/compression.md): random and
//! compressible binary bodies, below, at and above the threshold, come back
//! byte-identical through memory, through flow to disk, across a restart,
//! through basic.get, dead-lettering and management's peek; compressible
//! bodies take fewer resident and stored bytes than with compression off.

use std::time::Duration;

use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicQosOptions, BasicRejectOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use spillway_integration_tests::{
    both_wirings, eventually, next_delivery, publish, Component, Sandbox, Wiring,
};
use spillway_proto::management::PeekMessagesRequest;

both_wirings!(
    own_sandbox, timeout_secs = 240;
    bodies_round_trip_through_memory_flow_to_disk_and_a_restart,
    compressible_bodies_take_fewer_resident_and_stored_bytes,
    gets_dead_letters_and_peeks_see_the_published_bytes,
);

const WAIT: Duration = Duration::from_secs(30);
const THRESHOLD: usize = 16 * 1024;

fn config(compression: bool, flow_to_disk_threshold: &str) -> String {
    format!(
        "[gateway]\nmessage_compression_enabled = {compression}\n\
         message_compression_threshold_size = \"16KiB\"\n\
         [engine]\nflow_to_disk_threshold = \"{flow_to_disk_threshold}\"\n\
         housekeeping_interval = \"100ms\"\n"
    )
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    /// Text-like: lz4 makes it several times smaller.
    Compressible,
    /// xorshift noise: lz4 cannot shrink it, so it is kept as published.
    Random,
}

/// Bodies below, at and above the threshold, of both kinds.
const SET: [(Kind, usize); 10] = [
    (Kind::Random, 0),
    (Kind::Random, 1000),
    (Kind::Compressible, 1000),
    (Kind::Compressible, THRESHOLD),
    (Kind::Compressible, THRESHOLD + 1),
    (Kind::Random, THRESHOLD + 1),
    (Kind::Random, 20_000),
    (Kind::Compressible, 65_536),
    (Kind::Random, 65_536),
    (Kind::Compressible, 300_000),
];

/// Body number `seq`: its kind and size from [`SET`], its bytes from `seq`
/// (so a mix-up shows).
fn body(seq: usize) -> Vec<u8> {
    let (kind, len) = SET[seq % SET.len()];
    make(kind, len, seq as u64)
}

fn make(kind: Kind, len: usize, seed: u64) -> Vec<u8> {
    match kind {
        Kind::Compressible => {
            let mut bytes = Vec::with_capacity(len + 100);
            let mut line = 0u64;
            while bytes.len() < len {
                bytes.extend_from_slice(
                    format!(
                        "message {seed} line {line}: {{\"status\": \"ok\", \"queue\": \"orders\", \"amount\": {}}}\n",
                        line % 97
                    )
                    .as_bytes(),
                );
                line += 1;
            }
            bytes.truncate(len);
            bytes
        }
        Kind::Random => {
            let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect()
        }
    }
}

async fn declare(channel: &Channel, queue: &str, arguments: FieldTable) -> anyhow::Result<()> {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            arguments,
        )
        .await?;
    Ok(())
}

fn properties(seq: usize, persistent: bool) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(seq.to_string().into())
        .with_delivery_mode(if persistent { 2 } else { 1 })
}

/// Publishes bodies `seqs` to `queue` with confirms.
async fn publish_bodies(
    sandbox: &Sandbox,
    queue: &str,
    seqs: std::ops::Range<usize>,
    persistent: bool,
) -> anyhow::Result<()> {
    let connection = sandbox.connect().await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    declare(&channel, queue, FieldTable::default()).await?;
    for seq in seqs {
        let confirm = publish(&channel, "", queue, &body(seq), properties(seq, persistent)).await?;
        anyhow::ensure!(confirm.is_ack(), "publish {seq} to {queue} was nacked");
    }
    connection.close(200, "published".into()).await?;
    Ok(())
}

/// Consumes `queue` and checks it holds exactly bodies `seqs`, in order,
/// byte-identical; acks each.
async fn drain_and_check(
    sandbox: &Sandbox,
    queue: &str,
    seqs: std::ops::Range<usize>,
) -> anyhow::Result<()> {
    let connection = sandbox.connect().await?;
    let channel = connection.create_channel().await?;
    channel.basic_qos(20, BasicQosOptions::default()).await?;
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "check".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    for seq in seqs {
        let delivery = next_delivery(&mut consumer, WAIT).await?;
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string())
            .unwrap_or_default();
        anyhow::ensure!(id == seq.to_string(), "{queue}: expected {seq}, got {id}");
        let want = body(seq);
        anyhow::ensure!(
            delivery.data == want,
            "{queue}: body {seq} ({:?}, {} bytes) came back different ({} bytes)",
            SET[seq % SET.len()].0,
            want.len(),
            delivery.data.len()
        );
        delivery.acker.ack(BasicAckOptions::default()).await?;
    }
    anyhow::ensure!(
        next_delivery(&mut consumer, Duration::from_millis(300))
            .await
            .is_err(),
        "{queue} delivered more than was published"
    );
    connection.close(200, "drained".into()).await?;
    Ok(())
}

async fn bodies_round_trip_through_memory_flow_to_disk_and_a_restart(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let mut sandbox = Sandbox::start_with_config(wiring, &config(true, "2MiB")).await?;
    // Through memory: one set (under 0.5 MB) stays under the threshold.
    let one = 0..SET.len();
    publish_bodies(&sandbox, "in-memory", one.clone(), false).await?;
    let compressed = sandbox
        .metric(Component::Gateway, "spillway_messages_compressed_total")
        .await?;
    // Above the threshold and compressible: 16 KiB + 1, 64 KiB, 300 KB.
    anyhow::ensure!(compressed == 3.0, "{compressed} bodies compressed, not 3");
    drain_and_check(&sandbox, "in-memory", one).await?;

    // Through flow to disk: 40 sets, 2.9 MB of random bodies alone, over
    // a 2 MiB threshold; transient, so any record in the store spilled.
    let spill = 100..100 + 40 * SET.len();
    publish_bodies(&sandbox, "spilled", spill.clone(), false).await?;
    eventually(WAIT, || async {
        let status = sandbox.store_status(true).await?;
        anyhow::ensure!(
            status.message_records > 0,
            "nothing flowed to disk: {status:?}"
        );
        Ok(())
    })
    .await?;
    drain_and_check(&sandbox, "spilled", spill).await?;
    // Acked: the spilled records go (the stored bytes below are the kept
    // messages' alone).
    eventually(WAIT, || async {
        let status = sandbox.store_status(true).await?;
        anyhow::ensure!(status.message_records == 0, "records left: {status:?}");
        Ok(())
    })
    .await?;

    // Across a restart: persistent on a durable queue, read back from disk.
    let kept = 1000..1000 + 3 * SET.len();
    publish_bodies(&sandbox, "kept", kept.clone(), true).await?;
    let published: u64 = kept.clone().map(|seq| body(seq).len() as u64).sum();
    let status = sandbox.store_status(true).await?;
    anyhow::ensure!(
        status.message_record_bytes < published * 3 / 4,
        "stored records take {} bytes for {published} bytes published",
        status.message_record_bytes
    );
    sandbox.restart().await?;
    sandbox.wait_for_recovery().await?;
    drain_and_check(&sandbox, "kept", kept).await?;
    Ok(())
}

/// Resident message bytes (engine metric) and stored record bytes with
/// 100 compressible 64 KiB bodies, persistent on a durable queue.
async fn footprint(wiring: Wiring, compression: bool) -> anyhow::Result<(f64, u64)> {
    let sandbox = Sandbox::start_with_config(wiring, &config(compression, "1GiB")).await?;
    let connection = sandbox.connect().await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    declare(&channel, "footprint", FieldTable::default()).await?;
    let bodies: Vec<Vec<u8>> = (0..100)
        .map(|seed| make(Kind::Compressible, 65_536, seed))
        .collect();
    for (seq, body) in bodies.iter().enumerate() {
        let confirm = publish(&channel, "", "footprint", body, properties(seq, true)).await?;
        anyhow::ensure!(confirm.is_ack(), "publish {seq} was nacked");
    }
    let resident = sandbox
        .engine_metric("spillway_broker_resident_message_bytes")
        .await?;
    let stored = sandbox.store_status(true).await?.message_record_bytes;
    // And they come back as published.
    for (seq, body) in bodies.iter().enumerate() {
        let got = channel
            .basic_get("footprint".into(), BasicGetOptions { no_ack: true })
            .await?
            .ok_or_else(|| anyhow::anyhow!("message {seq} missing"))?;
        anyhow::ensure!(&got.delivery.data == body, "body {seq} came back different");
    }
    connection.close(200, "done".into()).await?;
    Ok((resident, stored))
}

async fn compressible_bodies_take_fewer_resident_and_stored_bytes(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let (resident_off, stored_off) = footprint(wiring, false).await?;
    let (resident_on, stored_on) = footprint(wiring, true).await?;
    println!(
        "{wiring:?}: 100 compressible 64 KiB bodies: resident {resident_off} B without \
         compression, {resident_on} B with; stored records {stored_off} B without, {stored_on} B with"
    );
    anyhow::ensure!(
        resident_off >= 6_553_600.0,
        "resident bytes without compression ({resident_off}) below the bodies' size"
    );
    anyhow::ensure!(
        resident_on * 4.0 < resident_off,
        "resident bytes did not drop: {resident_on} with compression, {resident_off} without"
    );
    anyhow::ensure!(
        stored_on * 4 < stored_off,
        "stored bytes did not drop: {stored_on} with compression, {stored_off} without"
    );
    Ok(())
}

async fn gets_dead_letters_and_peeks_see_the_published_bytes(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox = Sandbox::start_with_config(wiring, &config(true, "1GiB")).await?;
    let connection = sandbox.connect().await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    arguments.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString("parked".into()),
    );
    declare(&channel, "parked", FieldTable::default()).await?;
    declare(&channel, "work", arguments).await?;
    let bodies = [
        make(Kind::Compressible, 100_000, 1),
        make(Kind::Random, 40_000, 2),
        make(Kind::Compressible, 200, 3),
    ];
    for (seq, body) in bodies.iter().enumerate() {
        let confirm = publish(&channel, "", "work", body, properties(seq, true)).await?;
        anyhow::ensure!(confirm.is_ack(), "publish {seq} was nacked");
    }

    // Management's peek shows the bodies as published.
    let mut management = sandbox.management().await?;
    let peeked = management
        .peek_messages(PeekMessagesRequest {
            vhost: "/".into(),
            queue: "work".into(),
            count: 3,
        })
        .await?
        .into_inner()
        .messages;
    anyhow::ensure!(peeked.len() == 3, "peeked {} messages", peeked.len());
    for (seq, (peeked, body)) in peeked.iter().zip(&bodies).enumerate() {
        anyhow::ensure!(
            peeked.body[..] == body[..] && peeked.body_size == body.len() as u64,
            "peeked body {seq} differs ({} bytes, body_size {})",
            peeked.body.len(),
            peeked.body_size
        );
    }

    // basic.get, then a reject without requeue: dead-lettered to `parked`.
    for (seq, body) in bodies.iter().enumerate() {
        let got = eventually(WAIT, || async {
            channel
                .basic_get("work".into(), BasicGetOptions { no_ack: false })
                .await
                .ok()
                .flatten()
        })
        .await?;
        anyhow::ensure!(&got.delivery.data == body, "basic.get {seq} differs");
        got.delivery
            .acker
            .reject(BasicRejectOptions { requeue: false })
            .await?;
    }
    for (seq, body) in bodies.iter().enumerate() {
        let got = eventually(WAIT, || async {
            channel
                .basic_get("parked".into(), BasicGetOptions { no_ack: false })
                .await
                .ok()
                .flatten()
        })
        .await?;
        anyhow::ensure!(
            &got.delivery.data == body,
            "dead-lettered body {seq} differs ({} bytes)",
            got.delivery.data.len()
        );
        got.delivery.acker.ack(BasicAckOptions::default()).await?;
    }
    connection.close(200, "done".into()).await?;
    Ok(())
}
