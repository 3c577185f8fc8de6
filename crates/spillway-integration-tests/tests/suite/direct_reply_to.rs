//! Direct reply-to with lapin, as RabbitMQ documents it (pika checks the
//! same against both brokers in `tests/python/test_rabbitmq_features.py`):
//! an RPC client consumes the pseudo-queue `amq.rabbitmq.reply-to` in
//! no-ack mode and publishes its requests with that `reply_to`; the broker
//! hands the server a name for the client's channel instead, and a reply
//! published to that name on the default exchange goes straight to the
//! client's consumer. No queue is declared. Consuming in ack mode is
//! refused with RabbitMQ's 406; a reply to a channel that has gone is
//! dropped: confirmed to the server, returned only if mandatory, and held
//! by no queue.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use lapin::message::Delivery;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, Consumer};
use spillway_integration_tests::amqp::{amqp_code, amqp_text, declare, message_count, s, WAIT};
use spillway_integration_tests::{both_wirings, eventually, next_delivery, publish, Sandbox};
use spillway_proto::management as m;

both_wirings!(
    timeout_secs = 60;
    an_rpc_round_trip_over_direct_reply_to,
    direct_reply_to_is_consumed_in_no_ack_mode_only,
    a_reply_to_a_gone_channel_is_dropped,
);

/// The pseudo-queue, and the `reply_to` a client asks for.
const REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// Consumes the pseudo-queue on `ch` in no-ack mode, as tag `tag`.
async fn consume_replies(ch: &Channel, tag: &str) -> lapin::Result<Consumer> {
    ch.basic_consume(
        s(REPLY_TO),
        s(tag),
        BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
}

/// Publishes a request to `queue` asking for a direct reply, with
/// correlation id `id` (confirmed when `ch` is in confirm mode).
async fn request(ch: &Channel, queue: &str, id: &str, body: &[u8]) -> anyhow::Result<()> {
    let properties = BasicProperties::default()
        .with_reply_to(s(REPLY_TO))
        .with_correlation_id(s(id));
    let confirmation = publish(ch, "", queue, body, properties).await?;
    anyhow::ensure!(!confirmation.is_nack(), "request {id} nacked");
    Ok(())
}

/// The server's side: a channel in confirm mode consuming `queue`.
async fn server(sb: &Sandbox, queue: &str) -> anyhow::Result<(Connection, Channel, Consumer)> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    declare(&ch, queue, false, FieldTable::default()).await?;
    let requests = ch
        .basic_consume(
            s(queue),
            s("server"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((conn, ch, requests))
}

/// Serves the next request: replies `re: <body>` with its correlation id to
/// the name in its `reply_to`, acks it, and answers that name.
async fn answer(ch: &Channel, requests: &mut Consumer) -> anyhow::Result<String> {
    let request = next_delivery(requests, WAIT).await?;
    let name = request
        .properties
        .reply_to()
        .as_ref()
        .map(|name| name.as_str().to_string())
        .ok_or_else(|| anyhow::anyhow!("a request without reply_to"))?;
    let mut body = b"re: ".to_vec();
    body.extend_from_slice(&request.data);
    let mut properties = BasicProperties::default();
    if let Some(id) = request.properties.correlation_id() {
        properties = properties.with_correlation_id(id.clone());
    }
    let confirmation = publish(ch, "", &name, &body, properties).await?;
    anyhow::ensure!(
        confirmation.is_ack() && confirmation.take_message().is_none(),
        "the reply to {name} was not confirmed as routed"
    );
    request.ack(BasicAckOptions::default()).await?;
    Ok(name)
}

/// A reply's correlation id and body.
fn reply_of(delivery: &Delivery) -> (String, String) {
    let id = delivery
        .properties
        .correlation_id()
        .as_ref()
        .map(|id| id.as_str().to_string())
        .unwrap_or_default();
    (id, String::from_utf8_lossy(&delivery.data).into_owned())
}

/// The queues of `/` as (name, ready, unacked), once none holds anything
/// unacked (the server's acks are on their way).
async fn queues(sb: &Sandbox) -> anyhow::Result<Vec<(String, u64, u64)>> {
    let management = sb.management().await?;
    eventually(WAIT, || {
        let mut management = management.clone();
        async move {
            let list = management
                .list_queues(m::ListQueuesRequest { vhost: "/".into() })
                .await
                .ok()?
                .into_inner();
            let queues: Vec<(String, u64, u64)> = list
                .queues
                .into_iter()
                .map(|q| {
                    let status = q.status.unwrap_or_default();
                    (q.name, status.messages, status.unacked)
                })
                .collect();
            queues
                .iter()
                .all(|(_, _, unacked)| *unacked == 0)
                .then_some(queues)
        }
    })
    .await
}

async fn an_rpc_round_trip_over_direct_reply_to(sb: &mut Sandbox) -> anyhow::Result<()> {
    let (server_conn, server_ch, mut requests) = server(sb, "rpc.requests").await?;

    let client_conn = sb.connect().await?;
    let client = client_conn.create_channel().await?;
    client
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut replies = consume_replies(&client, "replies").await?;
    for n in 0..3 {
        request(
            &client,
            "rpc.requests",
            &n.to_string(),
            format!("q{n}").as_bytes(),
        )
        .await?;
    }
    let mut names = Vec::new();
    for _ in 0..3 {
        names.push(answer(&server_ch, &mut requests).await?);
    }
    let mut got = Vec::new();
    for _ in 0..3 {
        let reply = next_delivery(&mut replies, WAIT).await?;
        // Delivered as from the default exchange, to the name the server used.
        assert_eq!(reply.exchange.as_str(), "");
        assert_eq!(reply.routing_key.as_str(), names[0]);
        got.push(reply_of(&reply));
    }
    got.sort();
    let expected: Vec<(String, String)> = (0..3)
        .map(|n| (n.to_string(), format!("re: q{n}")))
        .collect();
    assert_eq!(got, expected);

    // The server saw a name for the channel, the same for every request:
    // the pseudo-queue's and a suffix.
    names.dedup();
    assert_eq!(names.len(), 1, "{names:?}");
    let name = &names[0];
    assert!(
        name.starts_with("amq.rabbitmq.reply-to.") && name.len() > REPLY_TO.len() + 1,
        "{name}"
    );

    // Another channel of the same client has a name of its own, and its
    // reply goes to it only.
    let other = client_conn.create_channel().await?;
    let mut other_replies = consume_replies(&other, "other-replies").await?;
    request(&other, "rpc.requests", "other", b"again").await?;
    let other_name = answer(&server_ch, &mut requests).await?;
    assert_ne!(&other_name, name);
    let reply = next_delivery(&mut other_replies, WAIT).await?;
    assert_eq!(
        reply_of(&reply),
        ("other".to_string(), "re: again".to_string())
    );
    // The first channel's next reply is its own, not the other's.
    request(&client, "rpc.requests", "3", b"q3").await?;
    answer(&server_ch, &mut requests).await?;
    let reply = next_delivery(&mut replies, WAIT).await?;
    assert_eq!(reply_of(&reply), ("3".to_string(), "re: q3".to_string()));

    // No queue was declared for the replies, and nothing is left anywhere.
    assert_eq!(queues(sb).await?, vec![("rpc.requests".to_string(), 0, 0)]);
    client_conn.close(200, s("bye")).await?;
    server_conn.close(200, s("bye")).await?;
    Ok(())
}

async fn direct_reply_to_is_consumed_in_no_ack_mode_only(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = sb.connect().await?;

    // In ack mode: the channel is closed with RabbitMQ's 406 and words.
    let ch = conn.create_channel().await?;
    let refused = ch
        .basic_consume(
            s(REPLY_TO),
            s("acking"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect_err("an ack-mode reply consumer is refused");
    assert_eq!(amqp_code(&refused), Some(406));
    assert_eq!(
        amqp_text(&refused).as_deref(),
        Some("PRECONDITION_FAILED - reply consumer cannot acknowledge")
    );
    assert!(conn.status().connected(), "only the channel is closed");

    // In no-ack mode it is accepted, once per channel.
    let ch = conn.create_channel().await?;
    let _replies = consume_replies(&ch, "first").await?;
    let refused = consume_replies(&ch, "second")
        .await
        .expect_err("a second reply consumer on the channel is refused");
    assert_eq!(amqp_code(&refused), Some(406));
    assert_eq!(
        amqp_text(&refused).as_deref(),
        Some("PRECONDITION_FAILED - reply consumer already set")
    );

    // Asking for a direct reply before consuming the pseudo-queue is
    // refused, and the request is not enqueued.
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    declare(&ch, "rpc.nobody", false, FieldTable::default()).await?;
    let refused = request(&ch, "rpc.nobody", "0", b"who answers?")
        .await
        .expect_err("a request before the reply consumer is refused");
    let refused = refused
        .downcast_ref::<lapin::Error>()
        .expect("refused by the broker");
    assert_eq!(amqp_code(refused), Some(406));
    assert_eq!(
        amqp_text(refused).as_deref(),
        Some("PRECONDITION_FAILED - fast reply consumer does not exist")
    );
    let ch = conn.create_channel().await?;
    assert_eq!(message_count(&ch, "rpc.nobody").await?, 0);
    conn.close(200, s("bye")).await?;
    Ok(())
}

/// Publishes a reply to `name` as the server would; whether it came back
/// returned (it must be confirmed either way).
async fn reply_returned(
    server_ch: &Channel,
    name: &str,
    mandatory: bool,
    body: &[u8],
) -> anyhow::Result<bool> {
    let confirmation = server_ch
        .basic_publish(
            s(""),
            s(name),
            BasicPublishOptions {
                mandatory,
                ..Default::default()
            },
            body,
            BasicProperties::default().with_correlation_id(s("late")),
        )
        .await?
        .await?;
    anyhow::ensure!(confirmation.is_ack(), "the reply to {name} was not acked");
    Ok(confirmation.take_message().is_some())
}

async fn a_reply_to_a_gone_channel_is_dropped(sb: &mut Sandbox) -> anyhow::Result<()> {
    let (server_conn, server_ch, mut requests) = server(sb, "rpc.gone").await?;

    // Three requesting channels: one will close, one's connection will go,
    // one stays.
    let client_conn = sb.connect().await?;
    let closing = client_conn.create_channel().await?;
    let _closing_replies = consume_replies(&closing, "closing").await?;
    let leaving_conn = sb.connect().await?;
    let leaving = leaving_conn.create_channel().await?;
    let _leaving_replies = consume_replies(&leaving, "leaving").await?;
    let staying = client_conn.create_channel().await?;
    let mut staying_replies = consume_replies(&staying, "staying").await?;

    // The server learns each one's name from a request, and serves the
    // requests later: the clients are gone by then.
    let mut names = Vec::new();
    for (ch, id) in [(&closing, "closing"), (&leaving, "leaving")] {
        request(ch, "rpc.gone", id, b"slow").await?;
        let delivery = next_delivery(&mut requests, WAIT).await?;
        let name = delivery
            .properties
            .reply_to()
            .as_ref()
            .map(|name| name.as_str().to_string())
            .expect("reply_to");
        delivery.ack(BasicAckOptions::default()).await?;
        names.push(name);
    }
    closing.close(200, s("bye")).await?;
    leaving_conn.close(200, s("bye")).await?;

    for name in &names {
        // Unroutable now: returned when mandatory, as RabbitMQ 3.10 does
        // (asked again until the broker has seen the client go).
        eventually(WAIT, || async {
            reply_returned(&server_ch, name, true, b"too late")
                .await
                .ok()
                .filter(|returned| *returned)
        })
        .await?;
        // Otherwise dropped: confirmed, not returned, and no error for the
        // server, whose channel goes on.
        assert!(!reply_returned(&server_ch, name, false, b"too late, dropped").await?);
        assert!(
            server_ch.status().connected(),
            "the server's channel is open"
        );
    }

    // The channel that stays gets its own reply next: none of the dropped
    // ones went to it.
    request(&staying, "rpc.gone", "staying", b"still here?").await?;
    answer(&server_ch, &mut requests).await?;
    let reply = next_delivery(&mut staying_replies, WAIT).await?;
    assert_eq!(
        reply_of(&reply),
        ("staying".to_string(), "re: still here?".to_string())
    );

    // Nothing was queued for the gone channels.
    assert_eq!(queues(sb).await?, vec![("rpc.gone".to_string(), 0, 0)]);
    client_conn.close(200, s("bye")).await?;
    server_conn.close(200, s("bye")).await?;
    Ok(())
}
