//! Small lapin helpers the end-to-end tests share: building argument
//! tables, declaring and reading queues, and reading the headers the broker
//! writes (`x-delivery-count`, `x-death`).

use std::time::Duration;

use lapin::message::BasicGetMessage;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};

use crate::eventually;

/// How long [`get`] waits for a message to arrive.
pub const WAIT: Duration = Duration::from_secs(10);

pub fn s(text: &str) -> ShortString {
    text.into()
}

/// A field table of `entries`, as queue arguments or headers.
pub fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut table = FieldTable::default();
    for (key, value) in entries {
        table.insert(s(key), value.clone());
    }
    table
}

/// The AMQP reply code that closed the channel or connection, for an error
/// the broker sent (None for any other failure).
pub fn amqp_code(error: &lapin::Error) -> Option<u16> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(e) => Some(e.get_id()),
        _ => None,
    }
}

/// The reply text that closed the channel or connection (RabbitMQ's
/// `NAME - reason`), for an error the broker sent (None for any other
/// failure).
pub fn amqp_text(error: &lapin::Error) -> Option<String> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(e) => Some(e.get_message().as_str().to_string()),
        _ => None,
    }
}

/// A long-string field value.
pub fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(value.into())
}

/// Declares `name` (durable or not) with `args`.
pub async fn declare(
    ch: &Channel,
    name: &str,
    durable: bool,
    args: FieldTable,
) -> anyhow::Result<lapin::Queue> {
    Ok(ch
        .queue_declare(
            s(name),
            QueueDeclareOptions {
                durable,
                ..Default::default()
            },
            args,
        )
        .await?)
}

/// Declares fanout `exchange` and non-durable `queue` bound to it (a
/// dead-letter exchange and where its messages land, say).
pub async fn fanout_to_queue(ch: &Channel, exchange: &str, queue: &str) -> anyhow::Result<()> {
    ch.exchange_declare(
        s(exchange),
        lapin::ExchangeKind::Fanout,
        lapin::options::ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    declare(ch, queue, false, FieldTable::default()).await?;
    ch.queue_bind(
        s(queue),
        s(exchange),
        s(""),
        lapin::options::QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

/// The next message of `queue` (unacked), waiting up to [`WAIT`] for it to
/// arrive.
pub async fn get(ch: &Channel, queue: &str) -> anyhow::Result<BasicGetMessage> {
    eventually(WAIT, || async {
        ch.basic_get(s(queue), BasicGetOptions { no_ack: false })
            .await
            .ok()
            .flatten()
    })
    .await
}

/// The ready-message count of `queue`, from a passive declare.
pub async fn message_count(ch: &Channel, queue: &str) -> anyhow::Result<u32> {
    let queue = ch
        .queue_declare(
            s(queue),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(queue.message_count())
}

/// The header `key` of a message.
pub fn header<'a>(props: &'a BasicProperties, key: &str) -> Option<&'a AMQPValue> {
    props.headers().as_ref()?.inner().get(key)
}

/// A field value as an integer, whichever integer type carries it.
pub fn integer(value: Option<&AMQPValue>) -> Option<i64> {
    match value? {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        _ => None,
    }
}

/// A field value as a string (long or short).
pub fn string(value: Option<&AMQPValue>) -> Option<String> {
    match value? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// The `x-death` tables of a dead letter, most recent first.
pub fn deaths(props: &BasicProperties) -> Vec<FieldTable> {
    match header(props, "x-death") {
        Some(AMQPValue::FieldArray(array)) => array
            .as_slice()
            .iter()
            .filter_map(|value| match value {
                AMQPValue::FieldTable(table) => Some(table.clone()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// A string field of one `x-death` table.
pub fn field(death: &FieldTable, key: &str) -> Option<String> {
    string(death.inner().get(key))
}

/// The `routing-keys` of one `x-death` table.
pub fn routing_keys(death: &FieldTable) -> Vec<String> {
    match death.inner().get("routing-keys") {
        Some(AMQPValue::FieldArray(keys)) => keys
            .as_slice()
            .iter()
            .filter_map(|k| string(Some(k)))
            .collect(),
        _ => Vec::new(),
    }
}

/// Closes the channel, then the connection, cleanly.
pub async fn close(ch: Channel, conn: Connection) -> anyhow::Result<()> {
    ch.close(200, s("bye")).await?;
    conn.close(200, s("bye")).await?;
    Ok(())
}

/// Publishes `count` messages of `size` bytes (at least 8), each carrying
/// its sequence number big-endian in its first 8 bytes, with confirms on
/// `channel`, as fast as lapin writes them; returns once every one is
/// confirmed. The caller keeps the connection: lapin closes a connection
/// whose last handle is dropped.
pub async fn publish_numbered(
    channel: Channel,
    queue: String,
    count: u64,
    size: usize,
) -> anyhow::Result<()> {
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut confirms = Vec::new();
    for seq in 0..count {
        let mut body = vec![0u8; size.max(8)];
        body[..8].copy_from_slice(&seq.to_be_bytes());
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default(),
            )
            .await?;
        confirms.push(confirm);
    }
    for confirm in confirms {
        anyhow::ensure!(confirm.await?.is_ack(), "publish nacked");
    }
    Ok(())
}

/// The confirmed round trip through every hop: declares durable `queue` on
/// a channel of its own, publishes `count` persistent messages (`m0`, `m1`,
/// …), each confirmed before the next, then consumes and acks them,
/// checking they come back in order, and closes the channel.
pub async fn confirmed_round_trip(
    conn: &Connection,
    queue: &str,
    count: usize,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    let channel = conn.create_channel().await?;
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
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for i in 0..count {
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("m{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await?
            .await?;
        anyhow::ensure!(confirm.is_ack(), "publish {i} to {queue} not confirmed");
    }
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "round-trip".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    for i in 0..count {
        let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .map_err(|_| anyhow::anyhow!("message {i} of {queue} not delivered within 10 s"))?
            .ok_or_else(|| anyhow::anyhow!("the consumer of {queue} ended"))??;
        anyhow::ensure!(
            delivery.data == format!("m{i}").as_bytes(),
            "message {i} of {queue} came back as {:?}",
            String::from_utf8_lossy(&delivery.data)
        );
        delivery.ack(BasicAckOptions::default()).await?;
    }
    channel.close(200, s("bye")).await?;
    Ok(())
}
