//! Clients that misbehave on purpose, played by hand-driven sockets
//! (`spillway_integration_tests::raw`), in both wirings: each may cost the
//! broker only a bounded amount of memory and time, loses nobody else's
//! messages, and the broker serves a fresh client afterwards.
//!
//! - A consumer that never reads its socket: the gateway holds at most the
//!   delivery credit in bytes for it, drops it at `gateway.write_timeout`,
//!   and its deliveries go back to the queue. The same for pipelined
//!   basic.gets, whose answers are charged to the same credit.
//! - A publisher that starts hundreds of huge messages and never finishes
//!   them: closed with 506 once its unfinished bodies pass
//!   `gateway.max_unfinished_content`.
//! - Hundreds of sockets that stop in the handshake, or in a frame header:
//!   all closed at `gateway.handshake_timeout`.
//! - A password guesser: told only RabbitMQ's "Login was refused …",
//!   counted in `spillway_login_refusals_total`, logged once a minute.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use spillway_integration_tests::raw::{self, FRAME_BODY};
use spillway_integration_tests::{
    both_wirings, consumer_timed_out, eventually, http_get, metric_value, Component, Sandbox,
    Wiring,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

both_wirings!(
    own_sandbox, timeout_secs = 120;
    a_consumer_that_never_reads_is_dropped_and_its_deliveries_requeued,
    pipelined_gets_that_are_never_read_are_bounded_and_requeued,
    a_consumer_that_never_acks_a_spilled_backlog_stays_within_the_budget,
    unfinished_bodies_past_the_limit_close_the_connection,
    hundreds_of_stalled_handshakes_are_closed_at_the_timeout,
    a_password_guesser_is_counted_and_logged_once,
);

const MIB: usize = 1024 * 1024;

/// A gateway metric (the gateway process's, or the one process's).
async fn gateway_metric(sandbox: &Sandbox, name: &str) -> anyhow::Result<f64> {
    let (_, text) = http_get(sandbox.metrics_addr(Component::Gateway)?, "/metrics").await?;
    metric_value(&text, name).ok_or_else(|| anyhow::anyhow!("no metric {name}"))
}

async fn ready_messages(channel: &lapin::Channel, queue: &str) -> anyhow::Result<u32> {
    let options = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declared = channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await?;
    Ok(declared.message_count())
}

/// 150 one-MiB messages and a consumer (no prefetch) that never reads: the
/// engine hands the gateway at most `engine.session_credit_bytes` (8 MiB)
/// that the socket has not taken, the gateway gives up on the socket after
/// `gateway.write_timeout` without progress, and every message is back in
/// the queue. Before the byte credit, all 150 MiB went to the gateway.
async fn a_consumer_that_never_reads_is_dropped_and_its_deliveries_requeued(
    wiring: Wiring,
) -> anyhow::Result<()> {
    // basic.consume "unread", tag "", no-local/no-ack/exclusive/no-wait off,
    // no arguments.
    let mut consume = vec![0, 60, 0, 20, 0, 0, 6];
    consume.extend_from_slice(b"unread");
    consume.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    a_reader_that_never_reads(wiring, &raw::raw_frame(raw::FRAME_METHOD, 1, &consume)).await
}

/// The same with 150 pipelined basic.gets (acknowledged mode) instead of a
/// consumer: get-ok answers are charged to the same credit. Before they
/// were, the engine answered all 150 and the separate gateway buffered
/// 150 MiB for a client that read nothing.
async fn pipelined_gets_that_are_never_read_are_bounded_and_requeued(
    wiring: Wiring,
) -> anyhow::Result<()> {
    // basic.get "unread", no-ack off.
    let mut get = vec![0, 60, 0, 70, 0, 0, 6];
    get.extend_from_slice(b"unread");
    get.push(0);
    let frame = raw::raw_frame(raw::FRAME_METHOD, 1, &get);
    a_reader_that_never_reads(wiring, &frame.repeat(150)).await
}

/// Fills "unread" with 150 one-MiB messages, then opens a raw connection
/// that sends `request` on channel 1 and reads nothing more.
async fn a_reader_that_never_reads(wiring: Wiring, request: &[u8]) -> anyhow::Result<()> {
    const MESSAGES: u32 = 150;
    let sandbox = Sandbox::start_with_config(wiring, "[gateway]\nwrite_timeout = \"1s\"\n").await?;
    let connection = sandbox.connect().await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_declare("unread".into(), Default::default(), FieldTable::default())
        .await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let body = vec![7u8; MIB];
    for _ in 0..MESSAGES {
        channel
            .basic_publish(
                "".into(),
                "unread".into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default(),
            )
            .await?
            .await?;
    }

    let mut reader = raw::open_connection(&sandbox, 131_072, 16).await?;
    raw::open_channels(&mut reader, 1).await?;
    reader.write_all(request).await?;

    eventually(Duration::from_secs(10), || async {
        let ready = ready_messages(&channel, "unread").await.ok();
        ready.filter(|n| *n < MESSAGES)
    })
    .await?;
    // Dropped at the write timeout; its unacked deliveries requeued.
    eventually(Duration::from_secs(30), || async {
        let ready = ready_messages(&channel, "unread").await.ok();
        ready.filter(|n| *n == MESSAGES)
    })
    .await?;
    let timeouts = gateway_metric(&sandbox, "spillway_write_timeouts_total").await?;
    anyhow::ensure!(timeouts >= 1.0, "write timeouts counted: {timeouts}");
    if let Some(peak) = sandbox.peak_rss("gateway") {
        anyhow::ensure!(
            peak < 96 * MIB as u64,
            "the gateway's peak RSS was {} MiB for a reader of 150 MiB that read nothing",
            peak / MIB as u64
        );
    }
    raw::closed_within(&mut reader, Duration::from_secs(10)).await?;
    channel.close(200, "bye".into()).await?;
    connection.close(200, "bye".into()).await?;
    sandbox.serves_a_fresh_client().await
}

/// A 150 MiB backlog flowed to disk under a 16 MiB threshold, and a
/// consumer (no prefetch) that takes all of it and never acks: its
/// unacknowledged payloads leave memory as they are delivered (the store
/// has them), so resident message bytes stay near the threshold instead of
/// the backlog's size; the consumer timeout then closes its channel with
/// 406, and all 600 messages are ready again, in order.
async fn a_consumer_that_never_acks_a_spilled_backlog_stays_within_the_budget(
    wiring: Wiring,
) -> anyhow::Result<()> {
    const MESSAGES: u32 = 600;
    const SIZE: usize = 256 * 1024;
    const THRESHOLD: u64 = 16 * MIB as u64;
    let config = "[engine]\nflow_to_disk_threshold = \"16MiB\"\nconsumer_timeout = \"20s\"\n\
                  housekeeping_interval = \"100ms\"\n";
    let sandbox = Sandbox::start_with_config(wiring, config).await?;
    let connection = sandbox.connect().await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_declare("backlog".into(), Default::default(), FieldTable::default())
        .await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for n in 0..MESSAGES {
        let mut body = vec![0u8; SIZE];
        body[..4].copy_from_slice(&n.to_be_bytes());
        channel
            .basic_publish(
                "".into(),
                "backlog".into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default(),
            )
            .await?
            .await?;
    }

    let hoarder = sandbox.connect().await?;
    let hoarding = hoarder.create_channel().await?;
    let mut deliveries = hoarding
        .basic_consume(
            "backlog".into(),
            "hoarder".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut taken = 0;
    while taken < MESSAGES {
        tokio::time::timeout(Duration::from_secs(30), deliveries.next())
            .await
            .map_err(|_| anyhow::anyhow!("only {taken} of {MESSAGES} delivered"))?
            .ok_or_else(|| anyhow::anyhow!("consumer ended after {taken}"))??;
        taken += 1;
    }
    // All 150 MiB delivered and unacknowledged: what stays resident is
    // the threshold's worth at most (plus one housekeeping pass of slack).
    let resident = eventually(Duration::from_secs(10), || async {
        let bytes = sandbox
            .engine_metric("spillway_broker_resident_message_bytes")
            .await
            .ok();
        bytes.filter(|b| *b <= (THRESHOLD + 4 * MIB as u64) as f64)
    })
    .await;
    anyhow::ensure!(
        resident.is_ok(),
        "resident message bytes stayed above the threshold with {MESSAGES} unacked: {:?}",
        sandbox
            .engine_metric("spillway_broker_resident_message_bytes")
            .await
    );
    if let Some(peak) = sandbox.peak_rss("engine") {
        anyhow::ensure!(
            peak < THRESHOLD + 112 * MIB as u64,
            "the engine's peak RSS was {} MiB for a 16 MiB threshold",
            peak / MIB as u64
        );
    }

    // The consumer timeout closes the hoarder's channel; all come back.
    consumer_timed_out(&mut deliveries, Duration::from_secs(30)).await?;
    eventually(Duration::from_secs(10), || async {
        let ready = ready_messages(&channel, "backlog").await.ok();
        ready.filter(|n| *n == MESSAGES)
    })
    .await?;
    // In order, flagged redelivered, payloads intact.
    let mut n = 0u32;
    while n < MESSAGES {
        let got = channel
            .basic_get(
                "backlog".into(),
                lapin::options::BasicGetOptions { no_ack: true },
            )
            .await?
            .ok_or_else(|| anyhow::anyhow!("queue empty after {n}"))?;
        let delivery = got.delivery;
        anyhow::ensure!(
            delivery.data.len() == SIZE && delivery.data[..4] == n.to_be_bytes(),
            "message {n} came back wrong"
        );
        anyhow::ensure!(delivery.redelivered, "message {n} not flagged redelivered");
        n += 1;
    }
    hoarder.close(200, "bye".into()).await.ok();
    channel.close(200, "bye".into()).await?;
    connection.close(200, "bye".into()).await?;
    sandbox.serves_a_fresh_client().await
}

/// 500 channels each announce a 100 MiB message and send its body 128 KiB
/// at a time, round robin, never finishing one: with the default limits
/// (128 MiB) the connection is closed with 506 after about 128 MiB, not
/// after the 50 GB announced, and the gateway's memory stays bounded.
async fn unfinished_bodies_past_the_limit_close_the_connection(
    wiring: Wiring,
) -> anyhow::Result<()> {
    const CHANNELS: u16 = 500;
    const GIVE_UP_AFTER: usize = 400 * MIB;
    let sandbox = Sandbox::start(wiring).await?;
    let mut socket = raw::open_connection(&sandbox, 131_072, CHANNELS).await?;
    raw::open_channels(&mut socket, CHANNELS).await?;
    let mut starts = Vec::new();
    for channel in 1..=CHANNELS {
        starts.extend(raw::publish_frame(channel, "nowhere"));
        starts.extend(raw::content_header_frame(channel, 100 * MIB as u64));
    }
    socket.write_all(&starts).await?;

    let (mut read_half, mut write_half) = socket.into_split();
    let sent = Arc::new(AtomicUsize::new(0));
    let writer = tokio::spawn({
        let sent = sent.clone();
        async move {
            let payload = vec![0u8; 131_072 - 8];
            while sent.load(Ordering::Relaxed) < GIVE_UP_AFTER {
                for channel in 1..=CHANNELS {
                    let frame = raw::raw_frame(FRAME_BODY, channel, &payload);
                    if write_half.write_all(&frame).await.is_err() {
                        return;
                    }
                    sent.fetch_add(payload.len(), Ordering::Relaxed);
                }
            }
        }
    });
    let (code, text) = raw::read_until_connection_close(&mut read_half).await?;
    // After close the gateway reads on (discarding) until close-ok: what
    // counts is how much it had taken when it closed.
    let sent_at_close = sent.load(Ordering::Relaxed);
    writer.abort();
    anyhow::ensure!(
        code == 506 && text.contains("gateway.max_unfinished_content"),
        "{code} {text}"
    );
    anyhow::ensure!(
        sent_at_close < 192 * MIB,
        "the connection was closed only after {sent_at_close} bytes"
    );
    eventually(Duration::from_secs(10), || async {
        let bytes = gateway_metric(&sandbox, "spillway_unfinished_content_bytes").await;
        bytes.ok().filter(|bytes| *bytes == 0.0)
    })
    .await?;
    let closes = gateway_metric(&sandbox, "spillway_unfinished_content_closes_total").await?;
    anyhow::ensure!(closes == 1.0, "closes counted: {closes}");
    if let Some(peak) = sandbox.peak_rss("gateway") {
        anyhow::ensure!(
            peak < 256 * MIB as u64,
            "the gateway's peak RSS was {} MiB",
            peak / MIB as u64
        );
    }
    sandbox.serves_a_fresh_client().await
}

/// 100 sockets that say nothing, 100 that stop after the protocol header and
/// 20 that stop in the middle of a frame header: every one is closed once
/// `gateway.handshake_timeout` has passed, and a real client is served.
async fn hundreds_of_stalled_handshakes_are_closed_at_the_timeout(
    wiring: Wiring,
) -> anyhow::Result<()> {
    let sandbox =
        Sandbox::start_with_config(wiring, "[gateway]\nhandshake_timeout = \"1s\"\n").await?;
    let mut sockets = Vec::new();
    for n in 0..220 {
        let mut socket = TcpStream::connect(sandbox.amqp_addr()).await?;
        if n >= 100 {
            socket.write_all(raw::HEADER).await?;
        }
        if n >= 200 {
            // Three bytes of a start-ok's frame header, then nothing.
            socket.write_all(&[1, 0, 0]).await?;
        }
        sockets.push(socket);
    }
    sandbox.serves_a_fresh_client().await?;
    for socket in &mut sockets {
        raw::closed_within(socket, Duration::from_secs(15)).await?;
    }
    sandbox.serves_a_fresh_client().await
}

/// Five wrong passwords for guest and one unknown user: each is refused
/// with RabbitMQ's words (which do not tell a wrong password from an
/// unknown name), each is counted, and the log has one line per user and
/// address, not one per attempt.
async fn a_password_guesser_is_counted_and_logged_once(wiring: Wiring) -> anyhow::Result<()> {
    const REFUSED: &str = "ACCESS_REFUSED - Login was refused using authentication mechanism \
                           PLAIN. For details see the broker logfile.";
    let sandbox = Sandbox::start(wiring).await?;
    let counted = "spillway_login_refusals_total{reason=\"invalid_credentials\"}";
    anyhow::ensure!(gateway_metric(&sandbox, counted).await? == 0.0);
    let addr = sandbox.amqp_addr();
    let mut texts = Vec::new();
    for (user, password) in std::iter::repeat_n(("guest", "wrong"), 5).chain([("nobody", "guest")])
    {
        let uri = format!("amqp://{user}:{password}@{addr}/%2f");
        let refused =
            lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()).await;
        let error = refused.err().map(|e| e.to_string());
        texts.push(error.ok_or_else(|| anyhow::anyhow!("{user} logged in with {password}"))?);
    }
    for text in &texts {
        anyhow::ensure!(text.contains(REFUSED), "{text}");
    }
    anyhow::ensure!(gateway_metric(&sandbox, counted).await? == 6.0);
    sandbox.serves_a_fresh_client().await?;
    if wiring == Wiring::Separate {
        let logs = sandbox.logs();
        let lines = |user: &str| {
            logs.lines()
                .filter(|line| {
                    line.contains("CON-1101 : Login refused : user '")
                        && line.contains(&format!("'{user}'"))
                })
                .count()
        };
        anyhow::ensure!(
            lines("guest") == 1,
            "guest logged {} times:\n{logs}",
            lines("guest")
        );
        anyhow::ensure!(
            lines("nobody") == 1,
            "nobody logged {} times:\n{logs}",
            lines("nobody")
        );
        anyhow::ensure!(
            !logs.contains("wrong"),
            "a password reached the log:\n{logs}"
        );
    }
    Ok(())
}
