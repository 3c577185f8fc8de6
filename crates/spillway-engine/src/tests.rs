//! Unit tests that drive the engine the way a gateway does: open a session,
//! send commands, read replies and deliveries, on an in-memory store
//! ([`MemoryStore`]) since RocksDB is not what they test.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use amq_protocol_types::{AMQPValue, FieldTable, ShortString};
use bytes::Bytes;
use spillway_amqp::{self as amqp, reply_code};
use spillway_proto::engine::{
    self as pb, reply, session_command::Command, session_event::Event, ErrorKind,
};
use spillway_proto::engine::{EngineApi, SessionStreams};
use spillway_storage::MemoryStore;

use crate::{Engine, EngineConfig, EngineSettings};

/// How long a test waits for an event before it fails.
const PATIENCE: Duration = Duration::from_secs(10);

/// A gateway session: commands out, events in, replies matched by request id.
struct Client {
    session: SessionStreams,
    next_request: u64,
    /// Events read while waiting for a reply, in order.
    pending: VecDeque<Event>,
}

impl Client {
    /// Opens a session on vhost `/` with channel 1 open.
    async fn open(engine: &Engine) -> Self {
        let session = engine.open_session().await.expect("in-process session");
        let mut client = Self {
            session,
            next_request: 1,
            pending: VecDeque::new(),
        };
        let open = client
            .request(|request_id| {
                Command::Open(pb::OpenSession {
                    request_id,
                    vhost: "/".into(),
                    user: "guest".into(),
                    ..Default::default()
                })
            })
            .await;
        assert!(matches!(open, reply::Result::Ok(_)), "{open:?}");
        let channel = client
            .request(|request_id| {
                Command::ChannelOpen(pb::ChannelOpen {
                    request_id,
                    channel: 1,
                    amqp1_link: None,
                })
            })
            .await;
        assert!(matches!(channel, reply::Result::Ok(_)), "{channel:?}");
        client
    }

    async fn send(&self, command: Command) {
        let command = pb::SessionCommand {
            command: Some(command),
        };
        self.session
            .commands
            .send(command)
            .await
            .expect("the session takes commands");
    }

    async fn next_event(&mut self) -> Event {
        let event = tokio::time::timeout(PATIENCE, self.session.events.recv())
            .await
            .expect("an event in time")
            .expect("the session is open");
        event.event.expect("an event with a body")
    }

    /// Sends a command that has a reply and waits for it; other events
    /// that arrive meanwhile are kept for [`Client::event`].
    async fn request(&mut self, command: impl FnOnce(u64) -> Command) -> reply::Result {
        let request_id = self.next_request;
        self.next_request += 1;
        self.send(command(request_id)).await;
        loop {
            match self.next_event().await {
                Event::Reply(reply) if reply.request_id == request_id => {
                    return reply.result.expect("a reply with a result");
                }
                other => self.pending.push_back(other),
            }
        }
    }

    /// The next event that is not a reply.
    async fn event(&mut self) -> Event {
        if let Some(event) = self.pending.pop_front() {
            return event;
        }
        self.next_event().await
    }

    async fn deliveries(&mut self, count: usize) -> Vec<pb::Deliver> {
        let mut deliveries = Vec::with_capacity(count);
        while deliveries.len() < count {
            match self.event().await {
                Event::Deliver(deliver) => deliveries.push(deliver),
                other => panic!("expected a delivery, got {other:?}"),
            }
        }
        deliveries
    }

    async fn declare(
        &mut self,
        queue: &str,
        durable: bool,
        arguments: &FieldTable,
    ) -> reply::Result {
        let arguments = amqp::encode_table(arguments);
        self.request(|request_id| {
            Command::QueueDeclare(pb::QueueDeclare {
                request_id,
                channel: 1,
                queue: queue.into(),
                durable,
                arguments,
                ..Default::default()
            })
        })
        .await
    }

    async fn publish(&self, queue: &str, body: &'static [u8], persistent: bool, confirm_seq: u64) {
        self.send(Command::Publish(pb::Publish {
            channel: 1,
            routing_key: queue.into(),
            properties: Bytes::from_static(&[0, 0]),
            body: Bytes::from_static(body),
            persistent,
            confirm_seq,
            ..Default::default()
        }))
        .await;
    }

    async fn consume(&mut self, queue: &str) -> String {
        self.start_consumer(queue, false).await
    }

    /// `credit_limited`: deliveries only within a `ConsumerCredit`'s limit
    /// (an AMQP 1.0 link's consumer).
    async fn start_consumer(&mut self, queue: &str, credit_limited: bool) -> String {
        let result = self
            .request(|request_id| {
                Command::Consume(pb::Consume {
                    request_id,
                    channel: 1,
                    queue: queue.into(),
                    credit_limited,
                    ..Default::default()
                })
            })
            .await;
        match result {
            reply::Result::ConsumeOk(ok) => ok.consumer_tag,
            other => panic!("expected consume-ok, got {other:?}"),
        }
    }

    async fn get(&mut self, queue: &str) -> reply::Result {
        self.request(|request_id| {
            Command::Get(pb::Get {
                request_id,
                channel: 1,
                queue: queue.into(),
                no_ack: true,
            })
        })
        .await
    }
}

async fn engine_on(store: &MemoryStore) -> Engine {
    Engine::start(Arc::new(store.clone()), EngineConfig::default())
        .await
        .expect("the engine starts on a memory store")
}

fn bodies(deliveries: &[pb::Deliver]) -> Vec<&[u8]> {
    deliveries.iter().map(|d| d.body.as_ref()).collect()
}

fn error_of(result: reply::Result) -> pb::AmqpError {
    match result {
        reply::Result::Error(error) => error,
        other => panic!("expected an error, got {other:?}"),
    }
}

#[tokio::test]
async fn consumers_get_messages_in_order_and_acks_settle_them() {
    let store = MemoryStore::new();
    let engine = engine_on(&store).await;
    let mut client = Client::open(&engine).await;
    client.declare("work", false, &FieldTable::default()).await;
    for body in [&b"one"[..], b"two", b"three"] {
        client.publish("work", body, false, 0).await;
    }
    let tag = client.consume("work").await;
    let delivered = client.deliveries(3).await;
    assert_eq!(bodies(&delivered), vec![&b"one"[..], b"two", b"three"]);
    assert!(delivered
        .iter()
        .all(|d| d.consumer_tag == tag && !d.redelivered));
    let tags: Vec<u64> = delivered.iter().map(|d| d.delivery_tag).collect();
    assert_eq!(tags, vec![1, 2, 3]);

    // Ack the first two at once; the third stays unacked.
    client
        .send(Command::Ack(pb::Ack {
            channel: 1,
            delivery_tag: 2,
            multiple: true,
        }))
        .await;
    client.declare("work", false, &FieldTable::default()).await;
    let stats = engine.queue_stats();
    let work = stats
        .iter()
        .find(|s| s.queue == "work")
        .expect("work's stats");
    assert_eq!((work.messages, work.unacked, work.consumers), (0, 1, 1));

    // An unknown tag closes the channel with an error naming basic.ack.
    client
        .send(Command::Ack(pb::Ack {
            channel: 1,
            delivery_tag: 99,
            multiple: false,
        }))
        .await;
    match client.event().await {
        Event::ChannelError(pb::ChannelError {
            channel: 1,
            error: Some(error),
        }) => {
            assert_eq!(error.reply_code(), reply_code::PRECONDITION_FAILED);
            assert_eq!((error.class_id, error.method_id), (60, 80));
        }
        other => panic!("expected a channel error, got {other:?}"),
    }
}

#[tokio::test]
async fn nacked_deliveries_come_back_in_queue_order_marked_redelivered() {
    let store = MemoryStore::new();
    let engine = engine_on(&store).await;
    let mut client = Client::open(&engine).await;
    client.declare("q", false, &FieldTable::default()).await;
    for body in [&b"a"[..], b"b", b"c"] {
        client.publish("q", body, false, 0).await;
    }
    client.consume("q").await;
    let first = client.deliveries(3).await;
    // Reject the middle one alone, then the rest at once: requeued
    // messages go back in id order, ahead of nothing newer.
    client
        .send(Command::Nack(pb::Nack {
            channel: 1,
            delivery_tag: first[1].delivery_tag,
            multiple: false,
            requeue: true,
        }))
        .await;
    let again = client.deliveries(1).await;
    assert_eq!(bodies(&again), vec![&b"b"[..]]);
    assert!(again[0].redelivered);
    client
        .send(Command::Nack(pb::Nack {
            channel: 1,
            delivery_tag: 0,
            multiple: true,
            requeue: true,
        }))
        .await;
    let redelivered = client.deliveries(3).await;
    assert_eq!(bodies(&redelivered), vec![&b"a"[..], b"b", b"c"]);
    assert!(redelivered.iter().all(|d| d.redelivered));
    // Delivery tags keep counting on the channel.
    assert_eq!(redelivered[0].delivery_tag, 5);
}

#[tokio::test]
async fn purge_empties_the_queue_and_counts_what_went() {
    let store = MemoryStore::new();
    let engine = engine_on(&store).await;
    let mut client = Client::open(&engine).await;
    client.declare("q", false, &FieldTable::default()).await;
    for body in [&b"a"[..], b"b", b"c"] {
        client.publish("q", body, false, 0).await;
    }
    let purged = client
        .request(|request_id| {
            Command::QueuePurge(pb::QueuePurge {
                request_id,
                channel: 1,
                queue: "q".into(),
            })
        })
        .await;
    assert!(
        matches!(
            purged,
            reply::Result::CountOk(pb::CountOk { message_count: 3 })
        ),
        "{purged:?}"
    );
    assert!(matches!(client.get("q").await, reply::Result::GetEmpty(_)));
}

#[tokio::test]
async fn durable_messages_survive_a_restart_on_the_same_store() {
    let store = MemoryStore::new();
    let engine = engine_on(&store).await;
    let mut client = Client::open(&engine).await;
    client.declare("kept", true, &FieldTable::default()).await;
    client
        .request(|request_id| {
            Command::ConfirmSelect(pb::ConfirmSelect {
                request_id,
                channel: 1,
            })
        })
        .await;
    client.publish("kept", b"persistent", true, 1).await;
    client.publish("kept", b"transient", false, 2).await;
    // The transient one needs no write: its confirm may come first.
    let mut confirmed = Vec::new();
    for _ in 0..2 {
        match client.event().await {
            Event::Confirm(confirm) if confirm.ack => confirmed.push(confirm.seq),
            other => panic!("expected a positive confirm, got {other:?}"),
        }
    }
    confirmed.sort_unstable();
    assert_eq!(confirmed, vec![1, 2]);
    drop(client);
    engine.shutdown().await;

    let engine = engine_on(&store).await;
    let mut client = Client::open(&engine).await;
    // Only the persistent message was stored; its payload is read back.
    match client.get("kept").await {
        reply::Result::GetOk(ok) => {
            assert_eq!(ok.body.as_ref(), b"persistent");
            assert_eq!(ok.message_count, 0);
        }
        other => panic!("expected get-ok, got {other:?}"),
    }
    assert!(matches!(
        client.get("kept").await,
        reply::Result::GetEmpty(_)
    ));
}

#[tokio::test]
async fn refused_arguments_say_the_caller_got_them_wrong() {
    let store = MemoryStore::new();
    let engine = engine_on(&store).await;
    let mut client = Client::open(&engine).await;
    let mut arguments = FieldTable::default();
    arguments.insert(
        ShortString::from("x-max-length"),
        AMQPValue::LongString("many".into()),
    );
    let error = error_of(client.declare("bad", false, &arguments).await);
    assert_eq!(error.reply_code(), reply_code::PRECONDITION_FAILED);
    assert_eq!(error.effective_kind(), ErrorKind::InvalidArgument);

    // The channel is closed by the gateway after an error; open another.
    let mut client = Client::open(&engine).await;
    let error = error_of(
        client
            .request(|request_id| {
                Command::ExchangeDeclare(pb::ExchangeDeclare {
                    request_id,
                    channel: 1,
                    exchange: "odd".into(),
                    kind: "no-such-type".into(),
                    ..Default::default()
                })
            })
            .await,
    );
    assert_eq!(error.reply_code(), reply_code::COMMAND_INVALID);
    assert_eq!(error.effective_kind(), ErrorKind::InvalidArgument);

    // Redeclaring with other arguments is a precondition, not a bad argument.
    let mut limited = FieldTable::default();
    limited.insert(ShortString::from("x-max-length"), AMQPValue::LongInt(5));
    client.declare("limited", false, &limited).await;
    let error = error_of(
        client
            .declare("limited", false, &FieldTable::default())
            .await,
    );
    assert_eq!(error.effective_kind(), ErrorKind::FailedPrecondition);
}

/// basic.get answers are charged to the delivery credit like deliveries:
/// with the credit spent, later gets wait (and the commands behind them,
/// in order) until the gateway reports deliveries written.
#[tokio::test]
async fn gets_wait_for_delivery_credit_and_later_commands_keep_their_order() {
    let store = MemoryStore::new();
    let config = EngineConfig {
        settings: EngineSettings {
            session_credit: 2,
            ..EngineSettings::default()
        },
        ..EngineConfig::default()
    };
    let engine = Engine::start(Arc::new(store.clone()), config)
        .await
        .expect("the engine starts on a memory store");
    let mut client = Client::open(&engine).await;
    client.declare("q", false, &FieldTable::default()).await;
    for body in [&b"1"[..], b"2", b"3", b"4", b"5"] {
        client.publish("q", body, false, 0).await;
    }
    for request_id in 100..105 {
        client
            .send(Command::Get(pb::Get {
                request_id,
                channel: 1,
                queue: "q".into(),
                no_ack: false,
            }))
            .await;
    }
    client
        .send(Command::Qos(pb::Qos {
            request_id: 200,
            channel: 1,
            prefetch_count: 10,
            ..Default::default()
        }))
        .await;
    let mut answered = Vec::new();
    let got = |event: Event, answered: &mut Vec<(u64, Vec<u8>)>| match event {
        Event::Reply(pb::Reply {
            request_id,
            result: Some(reply::Result::GetOk(ok)),
        }) => answered.push((request_id, ok.body.to_vec())),
        Event::Reply(pb::Reply { request_id, .. }) => answered.push((request_id, Vec::new())),
        other => panic!("expected a reply, got {other:?}"),
    };
    for _ in 0..2 {
        let event = client.event().await;
        got(event, &mut answered);
    }
    assert_eq!(answered, vec![(100, b"1".to_vec()), (101, b"2".to_vec())]);
    // An absence: a wrong engine answers within microseconds, a right one
    // never does.
    let silent = tokio::time::timeout(Duration::from_millis(200), client.event()).await;
    assert!(
        silent.is_err(),
        "a get was answered beyond the credit: {silent:?}"
    );

    let written = |count| Command::DeliveriesWritten(pb::DeliveriesWritten { count });
    client.send(written(1)).await;
    let event = client.event().await;
    got(event, &mut answered);
    assert_eq!(answered[2], (102, b"3".to_vec()));
    client.send(written(2)).await;
    for _ in 0..3 {
        let event = client.event().await;
        got(event, &mut answered);
    }
    let order: Vec<u64> = answered.iter().map(|(id, _)| *id).collect();
    assert_eq!(
        order,
        vec![100, 101, 102, 103, 104, 200],
        "qos answered after the gets"
    );
    assert_eq!(answered[4], (104, b"5".to_vec()));
}

/// `x-message-ttl` on a durable queue: the expiry is stored with the
/// persistent message, so after a restart it still expires (from the head,
/// on the timer, with nobody asking), and the store keeps nothing of it.
#[tokio::test]
async fn persistent_messages_expire_after_a_restart_and_leave_the_store() {
    use spillway_proto::storage::StorageApi;

    let store = MemoryStore::new();
    let engine = engine_on(&store).await;
    let mut client = Client::open(&engine).await;
    let mut arguments = FieldTable::default();
    arguments.insert(ShortString::from("x-message-ttl"), AMQPValue::LongInt(300));
    client.declare("fleeting", true, &arguments).await;
    client
        .request(|request_id| {
            Command::ConfirmSelect(pb::ConfirmSelect {
                request_id,
                channel: 1,
            })
        })
        .await;
    client.publish("fleeting", b"brief", true, 1).await;
    match client.event().await {
        Event::Confirm(confirm) => assert!(confirm.ack),
        other => panic!("expected a confirm, got {other:?}"),
    }
    let entries = store
        .load_messages("/", "fleeting")
        .await
        .expect("the store answers");
    assert_eq!(entries.len(), 1);
    assert!(entries[0].expires_at_ms > 0, "the expiry is stored");
    drop(client);
    engine.shutdown().await;

    let engine = engine_on(&store).await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let status = store.status(true).await.expect("the store answers");
        if status.message_records == 0 && status.queue_entries == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the expired message is still stored: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut client = Client::open(&engine).await;
    assert!(matches!(
        client.get("fleeting").await,
        reply::Result::GetEmpty(_)
    ));
}

/// A body the gateway compressed stays compressed through the engine: the
/// budget counts its compressed size, and delivery, basic.get and a restart
/// hand over the same bytes, encoding and published size.
#[tokio::test]
async fn compressed_bodies_pass_through_as_held_and_count_their_compressed_size() {
    use spillway_proto::body::{Body, ENCODING_LZ4};

    let published: Bytes = b"a body the gateway compressed; "
        .iter()
        .copied()
        .cycle()
        .take(64 * 1024)
        .collect::<Vec<u8>>()
        .into();
    let body = Body::compress_above(published.clone(), 1024);
    assert!(body.is_compressed());
    let store = MemoryStore::new();
    let engine = engine_on(&store).await;
    let mut client = Client::open(&engine).await;
    client.declare("kept", true, &FieldTable::default()).await;
    let mut publish = pb::Publish {
        channel: 1,
        routing_key: "kept".into(),
        properties: Bytes::from_static(&[0, 0]),
        persistent: true,
        ..Default::default()
    };
    publish.set_body(&body);
    let before = engine.shared.budget.resident_bytes();
    client.send(Command::Publish(publish.clone())).await;
    client.send(Command::Publish(publish)).await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while engine.shared.budget.resident_bytes() == before {
        assert!(tokio::time::Instant::now() < deadline, "never counted");
        tokio::task::yield_now().await;
    }
    let counted = engine.shared.budget.resident_bytes() - before;
    assert!(
        counted < 2 * (body.stored_len() + 1024),
        "{counted} bytes counted for two bodies of {} bytes compressed",
        body.stored_len()
    );
    match client.get("kept").await {
        reply::Result::GetOk(ok) => {
            assert_eq!(ok.body(), body);
            assert_eq!(ok.body().decode(u64::MAX).ok(), Some(published.clone()));
        }
        other => panic!("expected get-ok, got {other:?}"),
    }
    drop(client);
    engine.shutdown().await;

    let engine = engine_on(&store).await;
    let mut client = Client::open(&engine).await;
    client.consume("kept").await;
    // The get took one (no_ack); the other comes back from the store.
    let delivered = client.deliveries(1).await;
    for deliver in &delivered {
        assert_eq!(deliver.body_encoding, ENCODING_LZ4);
        assert_eq!(deliver.body_size, published.len() as u64);
        assert_eq!(deliver.body(), body);
    }
}

fn tx(command: fn(pb::TxMethod) -> Command) -> impl FnOnce(u64) -> Command {
    move |request_id| {
        command(pb::TxMethod {
            request_id,
            channel: 1,
        })
    }
}

/// A transaction holds its publishes and acks until commit; rollback drops
/// the publishes and returns the acked messages, redelivered.
#[tokio::test]
async fn transactions_hold_publishes_and_acks_until_commit() {
    let store = MemoryStore::new();
    let engine = engine_on(&store).await;
    let mut client = Client::open(&engine).await;
    client.declare("q", false, &FieldTable::default()).await;
    client.publish("q", b"before", false, 0).await;
    let selected = client.request(tx(Command::TxSelect)).await;
    assert!(matches!(selected, reply::Result::Ok(_)), "{selected:?}");
    client.publish("q", b"held", false, 0).await;
    client.consume("q").await;
    let first = client.deliveries(1).await;
    assert_eq!(bodies(&first), vec![&b"before"[..]]);
    client
        .send(Command::Ack(pb::Ack {
            channel: 1,
            delivery_tag: first[0].delivery_tag,
            multiple: false,
        }))
        .await;
    // Nothing of the transaction is visible, and the ack is held.
    client.declare("q", false, &FieldTable::default()).await;
    let stats = engine.queue_stats();
    let q = stats.iter().find(|s| s.queue == "q").expect("q's stats");
    assert_eq!((q.messages, q.unacked), (0, 0));
    assert_eq!(engine.open_transactions(), 1);

    let rolled_back = client.request(tx(Command::TxRollback)).await;
    assert!(
        matches!(rolled_back, reply::Result::Ok(_)),
        "{rolled_back:?}"
    );
    assert_eq!(engine.open_transactions(), 0);
    let again = client.deliveries(1).await;
    assert_eq!(bodies(&again), vec![&b"before"[..]]);
    assert!(again[0].redelivered);

    client
        .send(Command::Ack(pb::Ack {
            channel: 1,
            delivery_tag: again[0].delivery_tag,
            multiple: false,
        }))
        .await;
    client.publish("q", b"committed", false, 0).await;
    let committed = client.request(tx(Command::TxCommit)).await;
    assert!(matches!(committed, reply::Result::Ok(_)), "{committed:?}");
    let delivered = client.deliveries(1).await;
    assert_eq!(bodies(&delivered), vec![&b"committed"[..]]);
    assert!(!delivered[0].redelivered);
}

/// The transaction timer closes the connection of a transaction left idle.
/// An engine on a memory store that closes a connection whose transaction
/// has been idle for `idle_close`, by `clock`.
async fn engine_closing_idle_transactions(
    idle_close: Duration,
    clock: spillway_proto::util::clock::SharedClock,
) -> Engine {
    let config = EngineConfig {
        settings: EngineSettings {
            default_transaction_idle_close: idle_close,
            ..EngineSettings::default()
        },
        clock,
        ..EngineConfig::default()
    };
    Engine::start(Arc::new(MemoryStore::new()), config)
        .await
        .expect("the engine starts on a memory store")
}

#[tokio::test]
async fn an_idle_transaction_closes_its_connection_with_506() {
    let engine = engine_closing_idle_transactions(
        Duration::from_millis(50),
        spillway_proto::util::clock::SystemClock::shared(),
    )
    .await;
    let mut client = Client::open(&engine).await;
    client.declare("q", false, &FieldTable::default()).await;
    client.request(tx(Command::TxSelect)).await;
    client.publish("q", b"left", false, 0).await;
    match client.event().await {
        Event::ConnectionClose(close) => {
            assert_eq!(close.reply_code, u32::from(reply_code::RESOURCE_ERROR));
            assert_eq!(close.reason, "Idle transaction timed out");
        }
        other => panic!("expected the connection's close, got {other:?}"),
    }
    // Rolled back at once.
    assert_eq!(engine.open_transactions(), 0);
    assert!(matches!(client.get("q").await, reply::Result::GetEmpty(_)));
}

/// Transaction timeouts follow the engine's clock: an hour of idleness
/// passes on a manual clock without any real time going by.
#[tokio::test]
async fn an_idle_transaction_times_out_on_the_engine_clock() {
    use spillway_proto::util::clock::ManualClock;

    let clock = ManualClock::new();
    let hour = Duration::from_secs(3600);
    let engine = engine_closing_idle_transactions(hour, clock.clone()).await;
    let mut client = Client::open(&engine).await;
    client.declare("q", false, &FieldTable::default()).await;
    client.request(tx(Command::TxSelect)).await;
    client.publish("q", b"held", false, 0).await;
    // Answered after the publish: the transaction is open by now.
    client.declare("after", false, &FieldTable::default()).await;
    assert_eq!(engine.open_transactions(), 1);

    clock.advance(hour + Duration::from_millis(1));
    // The timer sleeps on tokio's time; wake it to look at the clock again.
    engine.shared.tx_timer.notify_one();
    match client.event().await {
        Event::ConnectionClose(close) => {
            assert_eq!(close.reply_code, u32::from(reply_code::RESOURCE_ERROR));
            assert_eq!(close.reason, "Idle transaction timed out");
        }
        other => panic!("expected the connection's close, got {other:?}"),
    }
    assert_eq!(engine.open_transactions(), 0);
}

/// An engine with publisher pacing at `window` messages and `stall`.
async fn paced_engine(window: u32, stall: Duration) -> Engine {
    let config = EngineConfig {
        settings: EngineSettings {
            publisher_pacing_window: window,
            publisher_pacing_stall: stall,
            ..EngineSettings::default()
        },
        ..EngineConfig::default()
    };
    Engine::start(Arc::new(MemoryStore::new()), config)
        .await
        .expect("the engine starts on a memory store")
}

impl Client {
    async fn prefetch(&mut self, count: u32) {
        let qos = self
            .request(|request_id| {
                Command::Qos(pb::Qos {
                    request_id,
                    channel: 1,
                    prefetch_count: count,
                    global: false,
                })
            })
            .await;
        assert!(matches!(qos, reply::Result::Ok(_)), "{qos:?}");
    }

    async fn ack(&self, delivery_tag: u64) {
        self.send(Command::Ack(pb::Ack {
            channel: 1,
            delivery_tag,
            multiple: false,
        }))
        .await;
    }

    /// Sends a queue.declare and says whether its reply came within `wait`:
    /// every command sent before it has been applied by then. A reply that
    /// comes later is left for [`Client::answered`].
    async fn answered_within(&mut self, queue: &str, wait: Duration) -> Option<u64> {
        let request_id = self.next_request;
        self.next_request += 1;
        self.send(Command::QueueDeclare(pb::QueueDeclare {
            request_id,
            channel: 1,
            queue: queue.into(),
            ..Default::default()
        }))
        .await;
        let until = tokio::time::Instant::now() + wait;
        loop {
            match tokio::time::timeout_at(until, self.session.events.recv()).await {
                Err(_) => return Some(request_id),
                Ok(event) => match event.and_then(|e| e.event) {
                    Some(Event::Reply(reply)) if reply.request_id == request_id => return None,
                    Some(other) => self.pending.push_back(other),
                    None => panic!("the session ended"),
                },
            }
        }
    }

    /// Waits for the reply to `request_id`.
    async fn answered(&mut self, request_id: u64) {
        loop {
            match self.next_event().await {
                Event::Reply(reply) if reply.request_id == request_id => return,
                other => self.pending.push_back(other),
            }
        }
    }
}

fn ready(engine: &Engine, queue: &str) -> u64 {
    engine
        .queue_stats()
        .iter()
        .find(|s| s.queue == queue)
        .map_or(0, |s| s.messages)
}

const NUMBERS: [&[u8]; 30] = [
    b"0", b"1", b"2", b"3", b"4", b"5", b"6", b"7", b"8", b"9", b"10", b"11", b"12", b"13", b"14",
    b"15", b"16", b"17", b"18", b"19", b"20", b"21", b"22", b"23", b"24", b"25", b"26", b"27",
    b"28", b"29",
];

/// A publisher to a queue whose consumer is slow is held once it is a
/// window ahead (its later commands wait too), and goes on as the consumer
/// takes messages; every message arrives, in order.
#[tokio::test]
async fn a_publisher_waits_for_a_slow_consumer_and_the_backlog_stays_within_the_window() {
    let engine = paced_engine(8, Duration::from_secs(30)).await;
    let mut consumer = Client::open(&engine).await;
    consumer.declare("q", false, &FieldTable::default()).await;
    consumer.prefetch(1).await;
    consumer.consume("q").await;
    let mut publisher = Client::open(&engine).await;
    for body in NUMBERS {
        publisher.publish("q", body, false, 0).await;
    }
    let pending = publisher
        .answered_within("q", Duration::from_millis(300))
        .await
        .expect("the publisher is held: its declare waits behind its publishes");
    // One delivered (unacked), a window's worth ready.
    assert_eq!(ready(&engine, "q"), 8);
    assert_eq!(engine.pacing_stats().stalls, 0);

    let mut received = Vec::new();
    while received.len() < NUMBERS.len() {
        let delivery = consumer.deliveries(1).await.remove(0);
        assert!(ready(&engine, "q") <= 8, "the backlog passed the window");
        consumer.ack(delivery.delivery_tag).await;
        received.push(delivery.body);
    }
    assert_eq!(received, NUMBERS.to_vec());
    publisher.answered(pending).await;
    let stats = engine.pacing_stats();
    assert!(stats.waits >= 1, "{stats:?}");
    assert_eq!(stats.stalls, 0, "{stats:?}");
}

/// A consumer that stops taking messages (its prefetch is full) holds a
/// publisher one stall period at most: then pacing is suspended for the
/// queue until its next delivery.
#[tokio::test]
async fn a_consumer_that_stopped_holds_a_publisher_one_stall_period_at_most() {
    let engine = paced_engine(4, Duration::from_millis(100)).await;
    let mut consumer = Client::open(&engine).await;
    consumer.declare("q", false, &FieldTable::default()).await;
    consumer.prefetch(1).await;
    consumer.consume("q").await;
    let mut publisher = Client::open(&engine).await;
    let started = std::time::Instant::now();
    for body in NUMBERS {
        publisher.publish("q", body, false, 0).await;
    }
    assert_eq!(
        publisher.answered_within("q", PATIENCE).await,
        None,
        "the publisher goes on"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(ready(&engine, "q"), 29);
    let stats = engine.pacing_stats();
    assert_eq!((stats.waits, stats.stalls), (1, 1), "{stats:?}");

    // Its next delivery resumes pacing with a full window.
    let first = consumer.deliveries(1).await.remove(0);
    consumer.ack(first.delivery_tag).await;
    assert_eq!(consumer.deliveries(1).await[0].body, NUMBERS[1]);
    for body in &NUMBERS[..3] {
        publisher.publish("q", body, false, 0).await;
    }
    assert_eq!(
        publisher.answered_within("q", PATIENCE).await,
        None,
        "three of a window of four"
    );
}

/// A session that publishes and consumes goes on acking while it is paced:
/// the ack is applied, the delivery it allows earns credit back, and the
/// session goes on well before any stall.
#[tokio::test]
async fn acks_on_a_paced_connection_are_applied_while_it_waits() {
    let engine = paced_engine(4, Duration::from_secs(30)).await;
    let mut client = Client::open(&engine).await;
    client.declare("q", false, &FieldTable::default()).await;
    client.prefetch(1).await;
    client.consume("q").await;
    // One delivered, four spend the window: the session waits.
    for body in &NUMBERS[..5] {
        client.publish("q", body, false, 0).await;
    }
    let first = client.deliveries(1).await.remove(0);
    client.ack(first.delivery_tag).await;
    assert_eq!(
        client.answered_within("q", Duration::from_secs(5)).await,
        None,
        "the ack was applied while the session was paced"
    );
    assert_eq!(client.deliveries(1).await[0].body, NUMBERS[1]);
    assert_eq!(engine.pacing_stats().stalls, 0);
}

/// Window 0: no pacing, as before; nor does a queue without consumers ever
/// pace.
#[tokio::test]
async fn no_pacing_with_window_zero_or_without_consumers() {
    let engine = paced_engine(0, Duration::from_secs(30)).await;
    let mut consumer = Client::open(&engine).await;
    consumer.declare("q", false, &FieldTable::default()).await;
    consumer.prefetch(1).await;
    consumer.consume("q").await;
    let mut publisher = Client::open(&engine).await;
    for body in NUMBERS {
        publisher.publish("q", body, false, 0).await;
    }
    assert_eq!(publisher.answered_within("q", PATIENCE).await, None);
    assert_eq!(engine.pacing_stats(), crate::PacingStats::default());

    let engine = paced_engine(2, Duration::from_secs(30)).await;
    let mut publisher = Client::open(&engine).await;
    publisher
        .declare("idle", false, &FieldTable::default())
        .await;
    for body in NUMBERS {
        publisher.publish("idle", body, false, 0).await;
    }
    assert_eq!(publisher.answered_within("idle", PATIENCE).await, None);
    assert_eq!(ready(&engine, "idle"), 30);
    assert_eq!(engine.pacing_stats(), crate::PacingStats::default());
}

static KIB_BODY: [u8; 1024] = [7; 1024];

/// An engine whose flow-to-disk threshold is `threshold` bytes, with
/// housekeeping every `interval`.
async fn engine_with_threshold(store: &MemoryStore, threshold: u64, interval: Duration) -> Engine {
    let config = EngineConfig {
        settings: EngineSettings {
            flow_to_disk_threshold: Some(threshold),
            housekeeping_interval: interval,
            ..EngineSettings::default()
        },
        ..EngineConfig::default()
    };
    Engine::start(Arc::new(store.clone()), config)
        .await
        .expect("the engine starts on a memory store")
}

/// Under flow to disk, a delivered, unacknowledged payload stays in memory
/// for half a housekeeping interval: a consumer that acks within that never
/// makes the broker write what it is about to delete. Held longer, the
/// payload moves to the store and leaves the budget.
#[tokio::test]
async fn unacked_payloads_move_to_the_store_only_after_half_a_housekeeping_interval() {
    use spillway_proto::storage::StorageApi;
    const MESSAGES: usize = 8;
    for (interval, moved) in [
        (Duration::from_secs(600), false),
        (Duration::from_millis(2), true),
    ] {
        let store = MemoryStore::new();
        let engine = engine_with_threshold(&store, 4096, interval).await;
        let mut client = Client::open(&engine).await;
        client.declare("q", false, &FieldTable::default()).await;
        client.consume("q").await;
        // Each is delivered at once (no prefetch) and stays unacked; the
        // fourth takes resident bytes over the threshold.
        for _ in 0..MESSAGES {
            client.publish("q", &KIB_BODY, false, 0).await;
        }
        let deliveries = client.deliveries(MESSAGES).await;
        assert!(deliveries.iter().all(|d| d.body.as_ref() == KIB_BODY));
        let deadline = tokio::time::Instant::now() + PATIENCE;
        if moved {
            // Every payload leaves memory; the store has each record.
            while engine.flow_status().resident_bytes > 0 {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "unacked payloads stayed resident: {:?}",
                    engine.flow_status()
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let status = store.status(true).await.expect("memory store status");
            assert_eq!(status.message_records, MESSAGES as u64);
        } else {
            // Setting the threshold runs housekeeping at once; it has run
            // since the deliveries once it counts them, and moved none.
            engine.set_flow_to_disk_threshold(4096);
            while !(engine.flow_status().active
                && engine.flow_status().bookkeeping_bytes
                    >= MESSAGES as u64 * crate::budget::UNACKED_ENTRY_BYTES)
            {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "housekeeping did not run: {:?}",
                    engine.flow_status()
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let status = engine.flow_status();
            assert!(
                status.resident_bytes >= (MESSAGES * KIB_BODY.len()) as u64,
                "payloads left memory within the grace period: {status:?}"
            );
            let stored = store.status(true).await.expect("memory store status");
            assert_eq!(stored.message_records, 0, "payloads were written");
        }
    }
}

#[tokio::test]
async fn unacked_counts_follow_each_queue_when_one_channel_consumes_several() {
    let store = MemoryStore::new();
    let engine = engine_on(&store).await;
    let mut client = Client::open(&engine).await;
    client.declare("left", false, &FieldTable::default()).await;
    client.declare("right", false, &FieldTable::default()).await;
    client.consume("left").await;
    client.consume("right").await;
    // Interleaved on the channel: runs of one queue, then the other, and back.
    for (queue, body) in [
        ("left", &b"l1"[..]),
        ("left", b"l2"),
        ("right", b"r1"),
        ("left", b"l3"),
        ("right", b"r2"),
        ("right", b"r3"),
        ("right", b"r4"),
    ] {
        client.publish(queue, body, false, 0).await;
    }
    let delivered = client.deliveries(7).await;
    assert_eq!(delivered.len(), 7);
    client.declare("left", false, &FieldTable::default()).await;
    let stats = engine.queue_stats();
    let unacked = |name: &str| {
        stats
            .iter()
            .find(|s| s.queue == name)
            .map(|s| s.unacked)
            .expect("the queue's stats")
    };
    assert_eq!((unacked("left"), unacked("right")), (3, 4));
}

/// Time is the engine's clock, handed to it: with a manual clock an hour's
/// TTL passes at once. A message within its TTL is delivered; one whose TTL
/// the clock has passed is not, though no real time went by.
#[tokio::test]
async fn message_ttl_follows_the_engine_clock_not_the_wall() {
    use spillway_proto::util::clock::ManualClock;

    let store = MemoryStore::new();
    let clock = ManualClock::new();
    let config = EngineConfig {
        clock: clock.clone(),
        ..EngineConfig::default()
    };
    let engine = Engine::start(Arc::new(store.clone()), config)
        .await
        .expect("the engine starts on a memory store");
    let mut client = Client::open(&engine).await;
    let mut arguments = FieldTable::default();
    let hour = 3_600_000;
    arguments.insert(ShortString::from("x-message-ttl"), AMQPValue::LongInt(hour));
    client.declare("hourly", false, &arguments).await;
    client.publish("hourly", b"fresh", false, 0).await;
    client.publish("hourly", b"stale", false, 0).await;
    match client.get("hourly").await {
        reply::Result::GetOk(ok) => assert_eq!(&ok.body[..], b"fresh"),
        other => panic!("expected the message within its TTL, got {other:?}"),
    }
    clock.advance(Duration::from_millis(u64::from(hour.unsigned_abs()) + 1));
    assert!(matches!(
        client.get("hourly").await,
        reply::Result::GetEmpty(_)
    ));
}

impl Client {
    /// The bodies delivered up to now: a round trip makes sure every
    /// delivery a command before it caused has been sent (the session
    /// dispatches as it applies each command).
    async fn delivered_by_now(&mut self) -> Vec<Vec<u8>> {
        self.declare("sync", false, &FieldTable::default()).await;
        let mut bodies = Vec::new();
        while let Some(event) = self.pending.pop_front() {
            match event {
                Event::Deliver(deliver) => bodies.push(deliver.body.to_vec()),
                other => panic!("expected a delivery, got {other:?}"),
            }
        }
        bodies
    }

    async fn credit(&self, consumer_tag: &str, delivery_limit: u64) {
        self.send(Command::ConsumerCredit(pb::ConsumerCredit {
            channel: 1,
            consumer_tag: consumer_tag.into(),
            delivery_limit,
        }))
        .await;
    }
}

#[tokio::test]
async fn a_credit_limited_consumer_is_handed_what_its_credit_allows() {
    let store = MemoryStore::new();
    let engine = engine_on(&store).await;
    let mut client = Client::open(&engine).await;
    client.declare("q", false, &FieldTable::default()).await;
    for body in [&b"1"[..], b"2", b"3", b"4", b"5"] {
        client.publish("q", body, false, 0).await;
    }
    let tag = client.start_consumer("q", true).await;
    let none: Vec<Vec<u8>> = Vec::new();
    assert_eq!(client.delivered_by_now().await, none, "no credit yet");

    client.credit(&tag, 2).await;
    assert_eq!(client.delivered_by_now().await, [b"1", b"2"]);
    // Acks free no credit (they would free a prefetch).
    client.ack(1).await;
    client.ack(2).await;
    assert_eq!(client.delivered_by_now().await, none);

    client.credit(&tag, 4).await;
    assert_eq!(client.delivered_by_now().await, [b"3", b"4"]);
    // A released message is the next one handed over, once there is credit.
    client
        .send(Command::Nack(pb::Nack {
            channel: 1,
            delivery_tag: 4,
            multiple: false,
            requeue: true,
        }))
        .await;
    assert_eq!(client.delivered_by_now().await, none);
    client.credit(&tag, 5).await;
    assert_eq!(client.delivered_by_now().await, [b"4"]);

    // A limit below what was delivered (the client drained) is no error;
    // nothing is handed over until the limit passes the deliveries.
    client.credit(&tag, 3).await;
    client.publish("q", b"6", false, 0).await;
    assert_eq!(client.delivered_by_now().await, none);
    client.credit(&tag, 6).await;
    assert_eq!(client.delivered_by_now().await, [b"5"]);

    // Credit for a consumer that is gone is no error; for one that was
    // not started credit-limited, it is.
    client.credit("nobody", 10).await;
    assert_eq!(client.delivered_by_now().await, none);
    let counted = client.consume("sync").await;
    client.credit(&counted, 10).await;
    match client.event().await {
        Event::ChannelError(error) => {
            let error = error.error.expect("the channel error's reason");
            assert_eq!(error.reply_code(), reply_code::PRECONDITION_FAILED);
        }
        other => panic!("expected a channel error, got {other:?}"),
    }
}
