//! The limits operators expect (docs/limits.md), through real clients in
//! both wirings: per-vhost and per-user connection limits (530 in
//! RabbitMQ's words, a freed slot taken again), the vhost queue limit and
//! the per-connection queue and consumer limits (406 on the channel, the
//! connection lives on), the negotiated channel_max and the user channel
//! limit (530), the vhost exchange and binding limits (406, the built-in
//! exchanges and existing bindings not counted), the vhost and user
//! consumer limits (406, over every connection), limits set and cleared at runtime with `spillctl`, on the
//! default vhost and on one created through management, and
//! `spillway_limit_refusals_total` counting each refusal in the process that
//! refused it.

use std::time::Duration;

use anyhow::Context;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{channel, AMQPClass};
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use spillway_integration_tests::raw;
use spillway_integration_tests::{
    both_wirings, eventually, http_get, metric_value, Component, Sandbox, Wiring,
};

both_wirings!(
    own_sandbox, timeout_secs = 90;
    vhost_and_user_connection_limits,
    queue_and_consumer_limits,
    channel_limits,
    heartbeat_bounds,
    exchange_and_binding_limits,
    vhost_and_user_consumer_limits,
);

/// `spillway_limit_refusals_total{limit="…"}` of the process running
/// `component`.
async fn refusals(sandbox: &Sandbox, component: Component, limit: &str) -> anyhow::Result<f64> {
    let (status, text) = http_get(sandbox.metrics_addr(component)?, "/metrics").await?;
    anyhow::ensure!(status == 200, "/metrics answered {status}");
    let name = format!("spillway_limit_refusals_total{{limit=\"{limit}\"}}");
    metric_value(&text, &name).ok_or_else(|| anyhow::anyhow!("{name} not in /metrics:\n{text}"))
}

/// One entry of `spillctl limits list --output json`.
fn limits_of(sandbox: &Sandbox, kind: &str, name: &str) -> anyhow::Result<serde_json::Value> {
    let list: serde_json::Value =
        serde_json::from_str(&sandbox.spillctl(&["--output", "json", "limits", "list"])?)?;
    list["limits"]
        .as_array()
        .and_then(|limits| {
            limits
                .iter()
                .find(|l| l["kind"] == kind && l["name"] == name)
                .cloned()
        })
        .ok_or_else(|| anyhow::anyhow!("no {kind} '{name}' in {list}"))
}

async fn connect_to(sandbox: &Sandbox, vhost: &str) -> lapin::Result<lapin::Connection> {
    let uri = format!("amqp://guest:guest@{}/{vhost}", sandbox.amqp_addr());
    lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()).await
}

/// The error a refused step ended with, or a failure if it was not refused.
fn refused<T, E: std::fmt::Display>(result: Result<T, E>, what: &str) -> anyhow::Result<String> {
    match result {
        Ok(_) => anyhow::bail!("{what} was not refused"),
        Err(error) => Ok(format!("{error:#}")),
    }
}

fn ensure_refusal(error: &str, code: &str, text: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        error.contains(code) && error.contains(text),
        "expected {code} with '{text}', got: {error}"
    );
    Ok(())
}

/// `engine.default_vhost_max_connections = 2`: the third connection to `/`
/// is refused with 530 in RabbitMQ's words, and a slot freed by a close is
/// taken again. Then, at runtime through spillctl: the vhost limit is
/// lifted and a per-user limit set (a fourth connection of guest refused,
/// then allowed once the user limit is cleared).
async fn vhost_and_user_connection_limits(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox =
        Sandbox::start_with_config(wiring, "[engine]\ndefault_vhost_max_connections = 2\n").await?;
    let first = sandbox.connect().await?;
    let second = sandbox.connect().await?;
    let error = refused(sandbox.connect().await, "a third connection to '/'")?;
    ensure_refusal(
        &error,
        "NOT_ALLOWED",
        "access to vhost '/' refused for user 'guest': connection limit (2) is reached",
    )?;
    anyhow::ensure!(
        refusals(&sandbox, Component::Engine, "vhost_max_connections").await? >= 1.0,
        "the vhost refusal is not counted"
    );
    // The open ones are untouched; a closed one frees its slot.
    second.create_channel().await?;
    first.close(200, "bye".into()).await?;
    let third = eventually(Duration::from_secs(10), || sandbox.connect()).await?;

    // Runtime: lift the vhost's limit, limit the user to 3 connections.
    sandbox.spillctl(&["limits", "set", "--max-connections", "-1"])?;
    sandbox.spillctl(&[
        "limits",
        "set",
        "--for-user",
        "guest",
        "--max-connections",
        "3",
    ])?;
    let guest = limits_of(&sandbox, "user", "guest")?;
    anyhow::ensure!(
        guest["max_connections"] == 3
            && guest["connections"] == 2
            && guest["overridden"] == serde_json::json!(["max_connections"]),
        "limits list shows for guest: {guest}"
    );
    let root = limits_of(&sandbox, "vhost", "/")?;
    anyhow::ensure!(
        root["max_connections"] == -1 && root["connections"] == 2,
        "limits list shows for '/': {root}"
    );
    let fourth = sandbox.connect().await?;
    let before = refusals(&sandbox, Component::Engine, "user_max_connections").await?;
    let error = refused(sandbox.connect().await, "a fourth connection of guest")?;
    ensure_refusal(
        &error,
        "NOT_ALLOWED",
        "connection refused for user 'guest': user connection limit (3) is reached",
    )?;
    let after = refusals(&sandbox, Component::Engine, "user_max_connections").await?;
    anyhow::ensure!(after == before + 1.0, "user refusals {before} → {after}");

    sandbox.spillctl(&["limits", "clear", "--for-user", "guest"])?;
    let fifth = sandbox.connect().await?;
    for connection in [second, third, fourth, fifth] {
        connection.close(200, "bye".into()).await?;
    }
    Ok(())
}

/// `gateway.min_heartbeat = 5` and `max_heartbeat = 120`: a client that
/// chooses 1 s, 600 s or no heartbeat in tune-ok is refused with 530 naming
/// the bound; lapin choosing 10 s is served.
async fn heartbeat_bounds(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox = Sandbox::start_with_config(
        wiring,
        "[gateway]\nheartbeat = 30\nmin_heartbeat = 5\nmax_heartbeat = 120\n",
    )
    .await?;
    for (heartbeat, expected) in [
        (
            1,
            "heartbeat 1 s below the minimum 5 s (gateway.min_heartbeat)",
        ),
        (
            600,
            "heartbeat 600 s above the maximum 120 s (gateway.max_heartbeat)",
        ),
        (
            0,
            "heartbeat 0 (off) not allowed: at most 120 s (gateway.max_heartbeat)",
        ),
    ] {
        let mut socket = raw::send_handshake(&sandbox, 4096, None, heartbeat).await?;
        let (code, text) = raw::expect_connection_close(&mut socket).await?;
        anyhow::ensure!(
            code == 530 && text.contains(expected),
            "heartbeat {heartbeat}: {code} {text}"
        );
    }
    let uri = format!("{}?heartbeat=10", sandbox.amqp_uri());
    let connection =
        lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            "heartbeat-bounds".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    channel.close(200, "bye".into()).await?;
    connection.close(200, "bye".into()).await?;
    Ok(())
}

/// `engine.max_queues_per_connection = 2` and
/// `engine.max_consumers_per_connection = 2`: the third of each is refused
/// with 406 on its channel and the connection serves on; a deleted queue no
/// longer counts, and another connection has its own allowance. A vhost
/// created through management with `max-queues 1` set by spillctl refuses
/// its second queue, and with `max-connections 0` every connection.
async fn queue_and_consumer_limits(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox = Sandbox::start_with_config(
        wiring,
        "[engine]\nmax_queues_per_connection = 2\nmax_consumers_per_connection = 2\n",
    )
    .await?;
    let connection = sandbox.connect().await?;
    let declare = |channel: lapin::Channel, name: &'static str| async move {
        channel
            .queue_declare(
                name.into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
    };
    let channel = connection.create_channel().await?;
    declare(channel.clone(), "q1").await?;
    declare(channel.clone(), "q2").await?;
    let error = refused(declare(channel, "q3").await, "a third queue")?;
    ensure_refusal(
        &error,
        "PRECONDITION_FAILED",
        "cannot declare queue 'q3': queue limit per connection (2) is reached",
    )?;
    // Redeclaring is not creating; a deleted queue no longer counts.
    let channel = connection.create_channel().await?;
    declare(channel.clone(), "q1").await?;
    channel
        .queue_delete("q1".into(), QueueDeleteOptions::default())
        .await?;
    declare(channel.clone(), "q3").await?;

    let consume = |channel: lapin::Channel, tag: &'static str| async move {
        channel
            .basic_consume(
                "q2".into(),
                tag.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
    };
    let _c1 = consume(channel.clone(), "c1").await?;
    let other = connection.create_channel().await?;
    let _c2 = consume(other.clone(), "c2").await?;
    let error = refused(consume(other, "c3").await, "a third consumer")?;
    ensure_refusal(
        &error,
        "PRECONDITION_FAILED",
        "reached maximum (2) of consumers per connection",
    )?;
    anyhow::ensure!(
        connection.status().connected(),
        "a 406 closed the connection"
    );
    let neighbour = sandbox.connect().await?;
    let _n1 = consume(neighbour.create_channel().await?, "n1").await?;

    // A vhost made through management, limited at runtime.
    sandbox.spillctl(&["vhost", "create", "limited"])?;
    // A new vhost has no permissions, as in RabbitMQ.
    sandbox.spillctl(&[
        "--vhost",
        "limited",
        "permissions",
        "set",
        "guest",
        "--configure",
        ".*",
        "--write",
        ".*",
        "--read",
        ".*",
    ])?;
    sandbox.spillctl(&["--vhost", "limited", "limits", "set", "--max-queues", "1"])?;
    let limited = connect_to(&sandbox, "limited").await?;
    let channel = limited.create_channel().await?;
    declare(channel.clone(), "a").await?;
    let error = refused(declare(channel, "b").await, "a second queue in 'limited'")?;
    ensure_refusal(
        &error,
        "PRECONDITION_FAILED",
        "cannot declare queue 'b': queue limit in vhost 'limited' (1) is reached",
    )?;
    sandbox.spillctl(&[
        "--vhost",
        "limited",
        "limits",
        "set",
        "--max-connections",
        "0",
    ])?;
    let error = refused(
        connect_to(&sandbox, "limited").await,
        "a connection to 'limited'",
    )?;
    ensure_refusal(&error, "NOT_ALLOWED", "connection limit (0) is reached")?;

    for (limit, expected) in [
        ("max_queues_per_connection", 1.0),
        ("max_consumers_per_connection", 1.0),
        ("vhost_max_queues", 1.0),
        ("vhost_max_connections", 1.0),
        ("user_max_channels", 0.0),
    ] {
        let counted = refusals(&sandbox, Component::Engine, limit).await?;
        anyhow::ensure!(
            counted == expected,
            "{limit}: {counted} refusals, expected {expected}"
        );
    }
    for connection in [connection, neighbour, limited] {
        connection.close(200, "bye".into()).await?;
    }
    Ok(())
}

/// `gateway.channel_max = 2`: a third channel is refused with 530 in
/// RabbitMQ's words (lapin never asks past channel_max, so a raw client
/// does), counted by the gateway. A user channel limit set by spillctl
/// counts over all the user's connections and closes the connection that
/// asks for one more with 530.
async fn channel_limits(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox = Sandbox::start_with_config(wiring, "[gateway]\nchannel_max = 2\n").await?;
    sandbox.spillctl(&[
        "limits",
        "set",
        "--for-user",
        "guest",
        "--max-channels",
        "3",
    ])?;
    let first = sandbox.connect().await?;
    let second = sandbox.connect().await?;
    let _a = first.create_channel().await?;
    let _b = first.create_channel().await?;
    let _c = second.create_channel().await?;
    let error = refused(second.create_channel().await, "a fourth channel of guest")?;
    ensure_refusal(
        &error,
        "NOT_ALLOWED",
        "number of channels opened for user 'guest' has reached the maximum allowed user limit of 3",
    )?;
    eventually(Duration::from_secs(10), || async {
        !second.status().connected()
    })
    .await?;
    anyhow::ensure!(
        first.status().connected(),
        "the other connection was closed"
    );
    anyhow::ensure!(
        refusals(&sandbox, Component::Engine, "user_max_channels").await? == 1.0,
        "the user channel refusal is not counted"
    );
    // The closed connection's channel no longer counts (lapin itself keeps
    // each connection within channel_max 2, so a third connection asks).
    eventually(Duration::from_secs(10), || async {
        limits_of(&sandbox, "user", "guest").is_ok_and(|g| g["channels"] == 2)
    })
    .await?;
    let third = sandbox.connect().await?;
    let _d = third.create_channel().await?;
    sandbox.spillctl(&["limits", "clear", "--for-user", "guest"])?;
    first.close(200, "bye".into()).await?;
    third.close(200, "bye".into()).await?;

    let mut socket = raw::open_connection_as_offered(&sandbox, 4096).await?;
    for channel in [1, 2] {
        raw::send_channel_open(&mut socket, channel).await?;
        let AMQPFrame::Method(n, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_))) =
            raw::read_frame(&mut socket).await?
        else {
            anyhow::bail!("channel {channel} was not opened");
        };
        anyhow::ensure!(n == channel, "open-ok on channel {n}");
    }
    raw::send_channel_open(&mut socket, 3).await?;
    let (code, text) = raw::expect_connection_close(&mut socket).await?;
    anyhow::ensure!(
        code == 530
            && text.contains(
                "number of channels opened (2) has reached the negotiated channel_max (2)"
            ),
        "{code} {text}"
    );
    anyhow::ensure!(
        refusals(&sandbox, Component::Gateway, "channel_max").await? == 1.0,
        "the channel_max refusal is not counted"
    );
    Ok(())
}

/// One user cannot fill a vhost with exchanges or bindings past its limits:
/// with `--max-exchanges 2 --max-bindings 2`, a third exchange and a third
/// binding are refused with 406 in the limit's words (the built-in
/// exchanges do not count, binding again what exists is no new binding),
/// counted, listed by spillctl; lifted with -1, they are taken again.
async fn exchange_and_binding_limits(wiring: Wiring) -> anyhow::Result<()> {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
    use lapin::ExchangeKind;
    let sandbox = Sandbox::start(wiring).await?;
    sandbox.spillctl(&[
        "limits",
        "set",
        "--max-exchanges",
        "2",
        "--max-bindings",
        "2",
    ])?;
    let connection = sandbox.connect().await?;
    let exchange = |channel: lapin::Channel, name: &'static str| async move {
        channel
            .exchange_declare(
                name.into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
    };
    let bind = |channel: lapin::Channel, key: &'static str| async move {
        channel
            .queue_bind(
                "bound".into(),
                "x1".into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
    };
    let channel = connection.create_channel().await.context("channel 1")?;
    exchange(channel.clone(), "x1").await.context("x1")?;
    exchange(channel.clone(), "x2").await.context("x2")?;
    let error = refused(exchange(channel, "x3").await, "a third exchange in '/'")?;
    ensure_refusal(
        &error,
        "PRECONDITION_FAILED",
        "cannot declare exchange 'x3': exchange limit in vhost '/' (2) is reached",
    )?;
    let channel = connection.create_channel().await.context("channel 2")?;
    // A redeclare is not a new exchange.
    exchange(channel.clone(), "x1").await.context("x1 again")?;
    channel
        .queue_declare(
            "bound".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .context("bound")?;
    bind(channel.clone(), "a.*").await.context("a.*")?;
    bind(channel.clone(), "b.#").await.context("b.#")?;
    bind(channel.clone(), "a.*").await.context("a.* again")?;
    let error = refused(bind(channel, "c").await, "a third binding in '/'")?;
    ensure_refusal(
        &error,
        "PRECONDITION_FAILED",
        "cannot bind: binding limit in vhost '/' (2) is reached",
    )?;
    // Qpid's DLQ adds an exchange and a binding: both count, and nothing of
    // the refused declare is left.
    let channel = connection.create_channel().await.context("channel dlq")?;
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-qpid-dlq-enabled".into(),
        lapin::types::AMQPValue::Boolean(true),
    );
    let declared = channel
        .queue_declare("orders".into(), QueueDeclareOptions::default(), arguments)
        .await;
    let error = refused(declared, "a queue whose DLQ passes the exchange limit")?;
    ensure_refusal(
        &error,
        "PRECONDITION_FAILED",
        "cannot declare exchange 'orders_DLE': exchange limit in vhost '/' (2) is reached",
    )?;
    let root = limits_of(&sandbox, "vhost", "/")?;
    anyhow::ensure!(
        root["exchanges"] == 2
            && root["bindings"] == 2
            && root["max_exchanges"] == 2
            && root["queues"] == 1,
        "limits list shows for '/': {root}"
    );
    for (limit, expected) in [("vhost_max_exchanges", 2.0), ("vhost_max_bindings", 1.0)] {
        let counted = refusals(&sandbox, Component::Engine, limit).await?;
        anyhow::ensure!(counted == expected, "{limit}: {counted} refusals");
    }
    sandbox.spillctl(&[
        "limits",
        "set",
        "--max-exchanges",
        "-1",
        "--max-bindings",
        "-1",
    ])?;
    let channel = connection.create_channel().await.context("channel 3")?;
    exchange(channel.clone(), "x3").await.context("x3 lifted")?;
    // Kept until the connection closes: lapin closes a channel whose last
    // handle is dropped, and a connection closing meanwhile fails.
    bind(channel.clone(), "c").await.context("c lifted")?;
    connection.close(200, "bye".into()).await.context("close")?;
    Ok(())
}

/// Consumers are bounded per vhost and per user over all their connections,
/// not only per connection: with `--max-consumers 2` on `/`, a third
/// consumer (on another connection) is refused with 406 and the channel
/// closed; with the vhost's limit lifted and guest limited to 3, a fourth is
/// refused in the user's words. Each refusal is counted, spillctl lists
/// what is counted.
async fn vhost_and_user_consumer_limits(wiring: Wiring) -> anyhow::Result<()> {
    let sandbox = Sandbox::start(wiring).await?;
    sandbox.spillctl(&["limits", "set", "--max-consumers", "2"])?;
    let first = sandbox.connect().await?;
    let second = sandbox.connect().await?;
    let setup = first.create_channel().await?;
    setup
        .queue_declare(
            "consumed".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let consume = |channel: lapin::Channel, tag: &'static str| async move {
        channel
            .basic_consume(
                "consumed".into(),
                tag.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
    };
    // Kept: lapin cancels a consumer whose handle is dropped.
    let mut consumers = Vec::new();
    let first_channel = first.create_channel().await?;
    consumers.push(consume(first_channel.clone(), "a").await?);
    let second_channel = second.create_channel().await?;
    consumers.push(consume(second_channel.clone(), "b").await?);
    let error = refused(
        consume(second.create_channel().await?, "c").await,
        "a third consumer in '/'",
    )?;
    ensure_refusal(
        &error,
        "PRECONDITION_FAILED",
        "cannot consume: consumer limit in vhost '/' (2) is reached",
    )?;
    anyhow::ensure!(second.status().connected(), "the connection was closed");
    let root = limits_of(&sandbox, "vhost", "/")?;
    anyhow::ensure!(
        root["max_consumers"] == 2 && root["consumers"] == 2,
        "limits list shows for '/': {root}"
    );

    sandbox.spillctl(&["limits", "set", "--max-consumers", "-1"])?;
    sandbox.spillctl(&[
        "limits",
        "set",
        "--for-user",
        "guest",
        "--max-consumers",
        "3",
    ])?;
    consumers.push(consume(first_channel.clone(), "c").await?);
    let error = refused(
        consume(second.create_channel().await?, "d").await,
        "a fourth consumer of guest",
    )?;
    ensure_refusal(
        &error,
        "PRECONDITION_FAILED",
        "cannot consume: consumer limit of user 'guest' (3) is reached",
    )?;
    let guest = limits_of(&sandbox, "user", "guest")?;
    anyhow::ensure!(
        guest["max_consumers"] == 3 && guest["consumers"] == 3,
        "limits list shows for guest: {guest}"
    );
    for limit in ["vhost_max_consumers", "user_max_consumers"] {
        let counted = refusals(&sandbox, Component::Engine, limit).await?;
        anyhow::ensure!(counted == 1.0, "{limit}: {counted} refusals");
    }
    // A cancelled consumer no longer counts.
    let cancelled = consumers.pop().map(|c| c.tag());
    if let Some(tag) = cancelled {
        first_channel.basic_cancel(tag, Default::default()).await?;
    }
    consumers.push(consume(second_channel.clone(), "e").await?);
    drop(consumers);
    first.close(200, "bye".into()).await?;
    second.close(200, "bye".into()).await?;
    Ok(())
}
