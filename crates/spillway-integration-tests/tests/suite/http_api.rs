//! RabbitMQ's management HTTP API through its real HTTP server, against
//! both wirings (in-process all-in-one, and the management service as its
//! own process calling the engine over gRPC): what an operator's tool
//! declares is what a lapin client finds, figures follow the client's
//! messages, a connection closed over HTTP is closed for its client, and
//! hostile requests meet the server's bounds.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use futures::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use serde_json::{json, Value};
use spillway_integration_tests::{both_wirings, eventually, Sandbox};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

both_wirings!(
    timeout_secs = 90;
    queues_declared_over_http_serve_amqp_clients,
    messages_published_over_http_reach_amqp_consumers,
    connections_close_over_http,
    hostile_requests_meet_the_bounds,
    definitions_move_a_topology_whole_or_not_at_all,
    cross_site_requests_and_bodies_that_are_not_json_are_refused,
    a_management_user_sees_the_totals_of_its_vhosts_only,
);

/// One HTTP/1.1 request over a fresh connection, as guest unless
/// `authorization` says otherwise; the status and the body.
async fn request(
    sb: &Sandbox,
    method: &str,
    path: &str,
    body: Option<&Value>,
    authorization: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    let body = body.map(Value::to_string).unwrap_or_default();
    let guest = "Basic Z3Vlc3Q6Z3Vlc3Q="; // guest:guest
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\nauthorization: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        authorization.unwrap_or(guest),
        body.len()
    );
    raw(sb, format!("{head}{body}").as_bytes()).await
}

/// Sends `bytes` as they are; the status and body of the answer.
async fn raw(sb: &Sandbox, bytes: &[u8]) -> anyhow::Result<(u16, String)> {
    let (status, _head, body) = raw_answer(sb, bytes).await?;
    Ok((status, body))
}

/// Sends `bytes` as they are; the status, head and body of the answer.
async fn raw_answer(sb: &Sandbox, bytes: &[u8]) -> anyhow::Result<(u16, String, String)> {
    let mut stream = tokio::net::TcpStream::connect(sb.management_http_addr()).await?;
    // The server may answer and close before it has read everything.
    let _ = stream.write_all(bytes).await;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut answer)).await??;
    let answer = String::from_utf8_lossy(&answer).to_string();
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("no HTTP answer: {answer:?}"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|status| status.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no status in {head:?}"))?;
    Ok((status, head.to_string(), body.to_string()))
}

async fn get_json(sb: &Sandbox, path: &str) -> anyhow::Result<Value> {
    let (status, body) = request(sb, "GET", path, None, None).await?;
    anyhow::ensure!(status == 200, "GET {path}: {status} {body}");
    Ok(serde_json::from_str(&body)?)
}

async fn queues_declared_over_http_serve_amqp_clients(sb: &mut Sandbox) -> anyhow::Result<()> {
    let path = "/api/queues/%2F/http.orders";
    let declare = json!({"durable": true, "arguments": {"x-max-length": 1000}});
    let (status, body) = request(sb, "PUT", path, Some(&declare), None).await?;
    assert_eq!(status, 201, "{body}");
    let (status, _) = request(sb, "PUT", path, Some(&declare), None).await?;
    assert_eq!(status, 204);

    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    // The queue the tool declared is the one the client finds.
    let found = ch
        .queue_declare(
            "http.orders".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    assert_eq!(found.message_count(), 0);
    for i in 0..5u8 {
        ch.basic_publish(
            "".into(),
            "http.orders".into(),
            BasicPublishOptions::default(),
            &[i],
            BasicProperties::default().with_delivery_mode(2),
        )
        .await?
        .await?;
    }
    let queue = get_json(sb, path).await?;
    assert_eq!(queue["messages_ready"], 5, "{queue}");
    assert_eq!(queue["messages"], 5);
    assert_eq!(queue["arguments"], json!({"x-max-length": 1000}));
    assert_eq!(queue["durable"], true);
    // Spillway's own figures beside RabbitMQ's.
    assert_eq!(queue["message_bytes"], 5);
    assert!(queue["resident_bytes"].as_u64().is_some(), "{queue}");

    // A consumer's unacknowledged deliveries are counted as RabbitMQ does.
    let delivered = ch
        .basic_get("http.orders".into(), BasicGetOptions::default())
        .await?
        .expect("a message");
    let queue = get_json(sb, path).await?;
    assert_eq!(
        (
            queue["messages_ready"].clone(),
            queue["messages_unacknowledged"].clone()
        ),
        (json!(4), json!(1)),
        "{queue}"
    );
    // The vhost's totals (summed by the engine, not from a list of its
    // queues), alone and in the list of vhosts.
    let vhost = get_json(sb, "/api/vhosts/%2F").await?;
    let in_list = get_json(sb, "/api/vhosts").await?;
    let in_list = in_list
        .as_array()
        .and_then(|vhosts| vhosts.iter().find(|v| v["name"] == "/"))
        .cloned()
        .unwrap_or_default();
    for vhost in [&vhost, &in_list] {
        assert_eq!(
            (
                vhost["messages"].clone(),
                vhost["messages_ready"].clone(),
                vhost["messages_unacknowledged"].clone()
            ),
            (json!(5), json!(4), json!(1)),
            "{vhost}"
        );
    }
    assert_eq!(
        get_json(sb, "/api/aliveness-test/%2F").await?,
        json!({"status": "ok"})
    );
    let (status, _) = request(sb, "GET", "/api/aliveness-test/nowhere", None, None).await?;
    assert_eq!(status, 404);
    delivered.ack(BasicAckOptions::default()).await?;

    let page = get_json(sb, "/api/queues/%2F?page=1&page_size=10&name=orders").await?;
    assert_eq!(page["filtered_count"], 1, "{page}");
    assert_eq!(page["items"][0]["name"], "http.orders");

    let (status, body) = request(sb, "DELETE", &format!("{path}/contents"), None, None).await?;
    assert_eq!(status, 204, "{body}");
    let count = ch
        .queue_declare(
            "http.orders".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?
        .message_count();
    assert_eq!(count, 0);
    let (status, _) = request(sb, "DELETE", path, None, None).await?;
    assert_eq!(status, 204);
    let (status, body) = request(sb, "GET", path, None, None).await?;
    assert_eq!(status, 404);
    assert_eq!(
        serde_json::from_str::<Value>(&body)?["error"],
        "Object Not Found"
    );
    conn.close(200, "bye".into()).await?;
    Ok(())
}

async fn connections_close_over_http(sb: &mut Sandbox) -> anyhow::Result<()> {
    let conn = lapin::Connection::connect(
        &sb.amqp_uri(),
        lapin::ConnectionProperties::default().with_connection_name("http-billing".into()),
    )
    .await?;
    let ch = conn.create_channel().await?;
    // A consumer hears the broker's close, with its reason (a later call on
    // the channel may only see lapin's "invalid channel state").
    ch.queue_declare(
        "http-billing".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let mut consumer = ch
        .basic_consume(
            "http-billing".into(),
            "worker".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let connection = eventually(Duration::from_secs(10), || async {
        let listed = get_json(sb, "/api/connections").await?;
        listed
            .as_array()
            .and_then(|list| {
                list.iter()
                    .find(|c| c["client_properties"]["connection_name"] == "http-billing")
            })
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("not listed yet: {listed}"))
    })
    .await?;
    assert_eq!(connection["user"], "guest");
    assert_eq!(connection["channels"], 1);
    // Its consumer, on its channel.
    let consumers = get_json(sb, "/api/consumers/%2F").await?;
    let worker = consumers
        .as_array()
        .and_then(|list| list.iter().find(|c| c["consumer_tag"] == "worker"))
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no consumer 'worker' in {consumers}"))?;
    assert_eq!(
        worker["queue"],
        json!({"name": "http-billing", "vhost": "/"})
    );
    assert_eq!(worker["ack_required"], true);
    assert_eq!(worker["active"], true);
    assert_eq!(
        worker["channel_details"]["connection_name"],
        connection["name"]
    );
    let name = connection["name"].as_str().unwrap().to_string();
    let encoded: String = name
        .bytes()
        .map(|byte| match byte {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'.' | b'-' | b'_' => {
                (byte as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect();
    let channels = get_json(sb, &format!("/api/connections/{encoded}/channels")).await?;
    assert_eq!(channels.as_array().map(Vec::len), Some(1), "{channels}");

    let mut head = format!(
        "DELETE /api/connections/{encoded} HTTP/1.1\r\nhost: test\r\nconnection: close\r\nauthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\n"
    );
    head.push_str("x-reason: maintenance window\r\n\r\n");
    let (status, body) = raw(sb, head.as_bytes()).await?;
    assert_eq!(status, 204, "{body}");
    let error = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match consumer.next().await {
                Some(Err(error)) => return Some(error),
                Some(Ok(_)) => continue,
                None => return None,
            }
        }
    })
    .await?;
    let error = match error {
        Some(error) => error,
        // The stream may end without the error: ask the channel.
        None => ch
            .queue_declare(
                "after-close".into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect_err("the connection is closed"),
    };
    let text = error.to_string();
    assert!(
        text.contains("CONNECTION_FORCED") && text.contains("maintenance window"),
        "{text}"
    );
    // The engine closes it a moment after answering; then it is gone.
    let path = format!("/api/connections/{encoded}");
    eventually(Duration::from_secs(10), || async {
        let (status, body) = request(sb, "GET", &path, None, None).await?;
        anyhow::ensure!(status == 404, "still there: {status} {body}");
        Ok(())
    })
    .await
}

async fn hostile_requests_meet_the_bounds(sb: &mut Sandbox) -> anyhow::Result<()> {
    // No credentials, wrong ones: 401.
    let (status, body) = raw(
        sb,
        b"GET /api/overview HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n",
    )
    .await?;
    assert_eq!(status, 401, "{body}");
    let wrong = "Basic Z3Vlc3Q6d3Jvbmc="; // guest:wrong
    let (status, _) = request(sb, "GET", "/api/overview", None, Some(wrong)).await?;
    assert_eq!(status, 401);
    // Headers are not read past the buffer's bound (64 KiB, or what one
    // read brought in): a megabyte of them is refused.
    let huge = format!(
        "GET /api/overview HTTP/1.1\r\nhost: t\r\nx-pad: {}\r\n\r\n",
        "a".repeat(1024 * 1024)
    );
    // Or the connection is simply closed (an error here).
    if let Ok((status, _)) = raw(sb, huge.as_bytes()).await {
        assert_eq!(status, 431);
    }
    // A body past 1 MiB is refused before it is used.
    let big = json!({"durable": true, "arguments": {"x-pad": "b".repeat(2 * 1024 * 1024)}});
    let (status, _) = request(sb, "PUT", "/api/queues/%2F/big", Some(&big), None).await?;
    assert_eq!(status, 413);
    let (status, _) = request(sb, "GET", "/api/queues/%2F/big", None, None).await?;
    assert_eq!(status, 404);
    // Malformed JSON, nested arguments, a wrong page: 400 with a reason.
    for (method, path, body) in [
        ("PUT", "/api/queues/%2F/bad", "{not json"),
        (
            "PUT",
            "/api/queues/%2F/bad",
            r#"{"arguments": {"x": {"y": 1}}}"#,
        ),
        ("GET", "/api/queues?page=0", ""),
    ] {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\nauthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let (status, answer) = raw(sb, head.as_bytes()).await?;
        assert_eq!(status, 400, "{method} {path}: {answer}");
        assert_eq!(
            serde_json::from_str::<Value>(&answer)?["error"],
            "bad_request"
        );
    }
    // A path nobody serves.
    let (status, _) = request(sb, "GET", "/api/nothing-here", None, None).await?;
    assert_eq!(status, 404);
    Ok(())
}

async fn messages_published_over_http_reach_amqp_consumers(sb: &mut Sandbox) -> anyhow::Result<()> {
    let (status, body) = request(
        sb,
        "PUT",
        "/api/queues/%2F/http.inbox",
        Some(&json!({"durable": true})),
        None,
    )
    .await?;
    assert_eq!(status, 201, "{body}");
    let publish = json!({
        "routing_key": "http.inbox",
        "payload": "aGVsbG8=",
        "payload_encoding": "base64",
        "properties": {"delivery_mode": 2, "message_id": "m-7", "headers": {"tenant": "acme"}},
    });
    let (status, body) = request(
        sb,
        "POST",
        "/api/exchanges/%2F/amq.default/publish",
        Some(&publish),
        None,
    )
    .await?;
    assert_eq!((status, body.as_str()), (200, r#"{"routed":true}"#));
    let nowhere = json!({"routing_key": "nobody", "payload": "x", "payload_encoding": "string"});
    let (_, body) = request(
        sb,
        "POST",
        "/api/exchanges/%2F/amq.default/publish",
        Some(&nowhere),
        None,
    )
    .await?;
    assert_eq!(body, r#"{"routed":false}"#);

    // Routed (and, persistent, written) before the answer: it is there.
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    let got = ch
        .basic_get("http.inbox".into(), BasicGetOptions { no_ack: true })
        .await?
        .expect("the published message");
    assert_eq!(got.delivery.data, b"hello");
    let properties = &got.delivery.properties;
    assert_eq!(properties.delivery_mode(), &Some(2));
    assert_eq!(
        properties.message_id().as_ref().map(|id| id.as_str()),
        Some("m-7")
    );
    let tenant = properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.inner().get("tenant").cloned());
    assert_eq!(
        tenant,
        Some(lapin::types::AMQPValue::LongString("acme".into()))
    );
    conn.close(200, "bye".into()).await?;
    Ok(())
}

/// Each path answers 404.
async fn none_of(sb: &Sandbox, paths: &[&str]) -> anyhow::Result<()> {
    for path in paths {
        let (status, body) = request(sb, "GET", path, None, None).await?;
        anyhow::ensure!(status == 404, "GET {path}: {status} {body}");
    }
    Ok(())
}

/// The items of `definitions[key]` in `vhost` (every item when the vhost
/// is None), sorted, for comparing two exports.
fn items_of(definitions: &Value, key: &str, vhost: Option<&str>) -> Vec<Value> {
    let mut items: Vec<Value> = definitions[key]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|item| vhost.is_none_or(|v| item["vhost"] == v || item["name"] == v))
        .collect();
    items.sort_by_key(|item| item.to_string());
    items
}

/// A topology made over HTTP, exported, and imported into the broker again
/// after it was deleted, comes back the same (and persists across a
/// restart): an AMQP client logs in with the imported user's password and
/// its messages take the imported routes. An import with one refused item
/// changes nothing, not even after a restart (nothing reached the store).
async fn definitions_move_a_topology_whole_or_not_at_all(sb: &mut Sandbox) -> anyhow::Result<()> {
    let put = |path: &'static str, body: Value| (path, body);
    for (path, body) in [
        put("/api/vhosts/shop", json!({})),
        put(
            "/api/users/shop-app",
            json!({"password": "s3cret", "tags": "management"}),
        ),
        put(
            "/api/permissions/shop/shop-app",
            json!({"configure": ".*", "write": ".*", "read": ".*"}),
        ),
        put(
            "/api/exchanges/shop/shop.events",
            json!({"type": "topic", "durable": true}),
        ),
        put(
            "/api/queues/shop/orders",
            json!({"durable": true, "arguments": {"x-max-priority": 5}}),
        ),
        put(
            "/api/policies/shop/orders-ttl",
            json!({"pattern": "^orders$", "definition": {"message-ttl": 60000}, "apply-to": "queues"}),
        ),
    ] {
        let (status, body) = request(sb, "PUT", path, Some(&body), None).await?;
        assert!(
            status == 201 || status == 204,
            "PUT {path}: {status} {body}"
        );
    }
    let binding = json!({"routing_key": "order.*"});
    let (status, body) = request(
        sb,
        "POST",
        "/api/bindings/shop/e/shop.events/q/orders",
        Some(&binding),
        None,
    )
    .await?;
    assert_eq!(status, 201, "{body}");

    let exported = get_json(sb, "/api/definitions").await?;
    let user = items_of(&exported, "users", Some("shop-app"));
    assert_eq!(user.len(), 1, "{exported}");
    assert_eq!(
        user[0]["hashing_algorithm"],
        "rabbit_password_hashing_sha256"
    );
    assert_eq!(user[0]["tags"], json!(["management"]));
    let shop = |definitions: &Value| {
        [
            "vhosts",
            "permissions",
            "exchanges",
            "queues",
            "bindings",
            "policies",
        ]
        .map(|key| (key, items_of(definitions, key, Some("shop"))))
    };
    assert_eq!(
        items_of(&exported, "bindings", Some("shop")),
        vec![
            json!({"source": "shop.events", "vhost": "shop", "destination": "orders",
            "destination_type": "queue", "routing_key": "order.*", "arguments": {}})
        ]
    );

    // One refused item (a queue that exists with other arguments) and
    // nothing of the rest is made.
    let mut refused = json!({
        "vhosts": [{"name": "shop-2"}],
        "users": [{"name": "other", "password_hash": user[0]["password_hash"], "tags": []}],
        "permissions": [{"user": "other", "vhost": "shop-2", "configure": ".*", "write": ".*", "read": ".*"}],
        "exchanges": [{"name": "x2", "vhost": "shop", "type": "fanout", "durable": true}],
        "queues": [
            {"name": "fresh", "vhost": "shop-2", "durable": true},
            {"name": "orders", "vhost": "shop", "durable": true, "arguments": {"x-max-priority": 9}},
        ],
        "bindings": [{"source": "x2", "vhost": "shop", "destination": "orders", "destination_type": "queue", "routing_key": ""}],
    });
    let (status, body) = request(sb, "POST", "/api/definitions", Some(&refused), None).await?;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("inequivalent arg 'x-max-priority'") && body.contains("orders"),
        "{body}"
    );
    let refused_items = [
        "/api/vhosts/shop-2",
        "/api/users/other",
        "/api/exchanges/shop/x2",
    ];
    none_of(sb, &refused_items).await?;
    sb.restart().await?;
    none_of(sb, &refused_items).await?;
    // Without the refused item, the same definitions go in.
    refused["queues"].as_array_mut().unwrap().pop();
    refused["bindings"] = json!([]);
    let (status, body) = request(sb, "POST", "/api/definitions", Some(&refused), None).await?;
    assert_eq!(status, 204, "{body}");
    assert_eq!(
        get_json(sb, "/api/queues/shop-2/fresh").await?["durable"],
        true
    );

    // Deleted, then imported back from the export: the same topology.
    for path in ["/api/vhosts/shop", "/api/users/shop-app"] {
        let (status, body) = request(sb, "DELETE", path, None, None).await?;
        assert_eq!(status, 204, "DELETE {path}: {body}");
    }
    let (status, body) = request(sb, "POST", "/api/definitions", Some(&exported), None).await?;
    assert_eq!(status, 204, "{body}");
    let imported = get_json(sb, "/api/definitions").await?;
    assert_eq!(shop(&imported), shop(&exported));
    assert_eq!(items_of(&imported, "users", Some("shop-app")), user);
    let queue = get_json(sb, "/api/queues/shop/orders").await?;
    assert_eq!(queue["policy"], "orders-ttl", "{queue}");

    // The imported user logs in with its password; the imported routes route.
    let uri = format!("amqp://shop-app:s3cret@{}/shop", sb.amqp_addr());
    let conn = lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    ch.basic_publish(
        "shop.events".into(),
        "order.created".into(),
        BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        },
        b"order 1",
        BasicProperties::default().with_delivery_mode(2),
    )
    .await?
    .await?;
    let got = ch
        .basic_get("orders".into(), BasicGetOptions { no_ack: true })
        .await?
        .expect("the message routed by the imported binding");
    assert_eq!(got.delivery.data, b"order 1");
    conn.close(200, "bye".into()).await?;

    // Stored: the same after a restart; one vhost's export holds its items.
    sb.restart().await?;
    assert_eq!(
        shop(&get_json(sb, "/api/definitions").await?),
        shop(&exported)
    );
    let one = get_json(sb, "/api/definitions/shop").await?;
    assert!(one.get("users").is_none(), "{one}");
    assert_eq!(one["queues"][0]["name"], "orders", "{one}");
    assert!(one["queues"][0].get("vhost").is_none(), "{one}");

    // spillctl moves the same file over gRPC: exported, the vhost deleted,
    // imported back into it.
    let file = sb.data_dir().with_file_name("shop-definitions.json");
    let file_arg = file.to_string_lossy().to_string();
    sb.spillctl(&["definitions", "export", &file_arg, "--only-vhost", "shop"])?;
    let (status, body) = request(sb, "DELETE", "/api/vhosts/shop", None, None).await?;
    assert_eq!(status, 204, "{body}");
    let (status, body) = request(sb, "PUT", "/api/vhosts/shop", Some(&json!({})), None).await?;
    assert_eq!(status, 201, "{body}");
    let answer = sb.spillctl(&["definitions", "import", &file_arg, "--only-vhost", "shop"])?;
    assert!(answer.contains("1 queues"), "{answer}");
    let _ = std::fs::remove_file(&file);
    let back = get_json(sb, "/api/definitions").await?;
    for key in ["exchanges", "queues", "bindings", "policies"] {
        assert_eq!(
            items_of(&back, key, Some("shop")),
            items_of(&exported, key, Some("shop")),
            "{key}"
        );
    }

    // Only an administrator.
    let monitor = json!({"password": "watch", "tags": "monitoring"});
    let (status, _) = request(sb, "PUT", "/api/users/watcher", Some(&monitor), None).await?;
    assert_eq!(status, 201);
    let watcher = "Basic d2F0Y2hlcjp3YXRjaA=="; // watcher:watch
    let (status, _) = request(sb, "GET", "/api/definitions", None, Some(watcher)).await?;
    assert_eq!(status, 401);
    let (status, _) = request(
        sb,
        "POST",
        "/api/definitions",
        Some(&exported),
        Some(watcher),
    )
    .await?;
    assert_eq!(status, 401);
    Ok(())
}

/// A request as a browser sends it for another site's page: guest's
/// credentials (as a browser that cached them would add), `headers` added
/// to the head, the body sent as it is.
async fn from_a_browser(
    sb: &Sandbox,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> anyhow::Result<(u16, String, String)> {
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: broker.test:15672\r\nconnection: close\r\nauthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\n{headers}content-length: {}\r\n\r\n{body}",
        body.len()
    );
    raw_answer(sb, head.as_bytes()).await
}

async fn cross_site_requests_and_bodies_that_are_not_json_are_refused(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let (status, body) =
        request(sb, "PUT", "/api/queues/%2F/csrf.q", Some(&json!({})), None).await?;
    assert_eq!(status, 201, "{body}");
    let binding = "/api/bindings/%2F/e/amq.direct/q/csrf.q";
    let json_type = "content-type: application/json\r\n";
    // What a form on another site sends: text/plain, and its origin.
    let form = r#"{"routing_key": "stolen", "ignored": "="}"#;
    for (headers, expected) in [
        ("content-type: text/plain\r\n".to_string(), 415),
        (
            "content-type: application/x-www-form-urlencoded\r\n".into(),
            415,
        ),
        ("content-type: text/plain\r\norigin: null\r\n".into(), 403),
        (format!("{json_type}origin: http://evil.example\r\n"), 403),
        (format!("{json_type}origin: null\r\n"), 403),
        (
            format!("{json_type}origin: http://broker.test:8080\r\n"),
            403,
        ),
        (format!("{json_type}sec-fetch-site: cross-site\r\n"), 403),
        (format!("{json_type}sec-fetch-site: same-site\r\n"), 403),
        // A body without a content type, from a browser (its fetch can
        // send one without asking first).
        ("origin: http://broker.test:15672\r\n".into(), 415),
        ("sec-fetch-site: same-origin\r\n".into(), 415),
    ] {
        let (status, _, answer) = from_a_browser(sb, "POST", binding, &headers, form).await?;
        assert_eq!(status, expected, "{headers:?}: {answer}");
        let error: Value = serde_json::from_str(&answer)?;
        assert!(error["reason"].as_str().is_some(), "{answer}");
    }
    let bindings = get_json(sb, "/api/queues/%2F/csrf.q/bindings").await?;
    assert!(
        !bindings.to_string().contains("stolen"),
        "a refused request made a binding: {bindings}"
    );
    // An administrator through /api/definitions: refused, nobody made.
    let definitions =
        r#"{"users": [{"name": "csrf-admin", "password_hash": "", "tags": "administrator"}]}"#;
    for headers in [
        "content-type: text/plain\r\n",
        "content-type: application/json\r\norigin: http://evil.example\r\n",
    ] {
        let (status, _, answer) =
            from_a_browser(sb, "POST", "/api/definitions", headers, definitions).await?;
        assert!(
            status == 415 || status == 403,
            "{headers:?}: {status} {answer}"
        );
    }
    let (status, _) = request(sb, "GET", "/api/users/csrf-admin", None, None).await?;
    assert_eq!(status, 404);
    // Reading the API from another site is refused too; opening the
    // console from a link is not.
    let (status, _, _) = from_a_browser(
        sb,
        "GET",
        "/api/overview",
        "origin: http://evil.example\r\n",
        "",
    )
    .await?;
    assert_eq!(status, 403);
    let (status, _, _) =
        from_a_browser(sb, "GET", "/", "sec-fetch-site: cross-site\r\n", "").await?;
    assert_eq!(status, 200);

    // The console's own requests: same origin (with or without the
    // default port), or a browser that says so.
    for (i, headers) in [
        format!("{json_type}origin: http://broker.test:15672\r\n"),
        format!("{json_type}origin: http://BROKER.test:15672\r\nsec-fetch-site: same-origin\r\n"),
        "content-type: application/json; charset=utf-8\r\n".to_string(),
    ]
    .iter()
    .enumerate()
    {
        let mine = json!({ "routing_key": format!("mine.{i}") }).to_string();
        let (status, _, answer) = from_a_browser(sb, "POST", binding, headers, &mine).await?;
        assert_eq!(status, 201, "{headers:?}: {answer}");
    }
    // A tool's body without a content type is read as JSON (pyrabbit2's
    // publish sends none; RabbitMQ reads it).
    let (status, _, answer) =
        from_a_browser(sb, "POST", binding, "", r#"{"routing_key": "tool"}"#).await?;
    assert_eq!(status, 201, "{answer}");
    // No body needs no content type (curl -X DELETE, rabbitmqadmin).
    let (status, _, answer) =
        from_a_browser(sb, "DELETE", "/api/queues/%2F/csrf.q", "", "").await?;
    assert_eq!(status, 204, "{answer}");

    // A refused login carries no Basic challenge a browser would answer
    // with its own dialog (and then cache).
    let (status, head, _) = raw_answer(
        sb,
        b"GET /api/overview HTTP/1.1\r\nhost: t\r\nconnection: close\r\nauthorization: Basic Z3Vlc3Q6d3Jvbmc=\r\n\r\n",
    )
    .await?;
    assert_eq!(status, 401);
    assert!(
        !head.to_ascii_lowercase().contains("www-authenticate"),
        "{head}"
    );
    Ok(())
}

async fn a_management_user_sees_the_totals_of_its_vhosts_only(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    // Five queues and four messages in the user's vhost; more of both
    // in the default vhost, which it may not see.
    let (status, body) = request(sb, "PUT", "/api/vhosts/tenant", None, None).await?;
    assert_eq!(status, 201, "{body}");
    let user = json!({"password": "tenant-pw", "tags": "management"});
    let (status, body) = request(sb, "PUT", "/api/users/tenant", Some(&user), None).await?;
    assert_eq!(status, 201, "{body}");
    let all = json!({"configure": ".*", "write": ".*", "read": ".*"});
    let (status, body) = request(
        sb,
        "PUT",
        "/api/permissions/tenant/tenant",
        Some(&all),
        None,
    )
    .await?;
    assert_eq!(status, 201, "{body}");
    for (vhost, queues, messages) in [("tenant", 5, 4), ("%2F", 8, 7)] {
        for i in 0..queues {
            let path = format!("/api/queues/{vhost}/totals.{i}");
            let (status, body) = request(sb, "PUT", &path, Some(&json!({})), None).await?;
            assert_eq!(status, 201, "{path}: {body}");
        }
        for _ in 0..messages {
            let publish =
                json!({"routing_key": "totals.0", "payload": "x", "payload_encoding": "string"});
            let path = format!("/api/exchanges/{vhost}/amq.default/publish");
            let (status, body) = request(sb, "POST", &path, Some(&publish), None).await?;
            assert_eq!((status, body.as_str()), (200, r#"{"routed":true}"#));
        }
    }
    let tenant = "Basic dGVuYW50OnRlbmFudC1wdw=="; // tenant:tenant-pw
    let (status, body) = request(sb, "GET", "/api/overview", None, Some(tenant)).await?;
    assert_eq!(status, 200, "{body}");
    let overview: Value = serde_json::from_str(&body)?;
    assert_eq!(overview["object_totals"]["queues"], 5, "{overview}");
    assert_eq!(overview["queue_totals"]["messages"], 4, "{overview}");
    assert_eq!(overview["queue_totals"]["messages_ready"], 4, "{overview}");
    let (_, body) = request(sb, "GET", "/api/exchanges", None, Some(tenant)).await?;
    let exchanges: Value = serde_json::from_str(&body)?;
    assert_eq!(
        overview["object_totals"]["exchanges"],
        exchanges.as_array().map(Vec::len).unwrap_or_default(),
        "{overview}"
    );
    // guest, an administrator, sees both vhosts.
    let overview = get_json(sb, "/api/overview").await?;
    assert!(
        overview["object_totals"]["queues"].as_u64() >= Some(13),
        "{overview}"
    );
    assert!(
        overview["queue_totals"]["messages"].as_u64() >= Some(11),
        "{overview}"
    );
    // As in RabbitMQ: nodes are the monitoring user's, policies the
    // policymaker's, operator policies the administrator's.
    for path in [
        "/api/nodes",
        "/api/policies",
        "/api/policies/tenant",
        "/api/operator-policies",
    ] {
        let (status, body) = request(sb, "GET", path, None, Some(tenant)).await?;
        assert_eq!(status, 401, "{path}: {body}");
    }
    let user = json!({"password": "tenant-pw", "tags": "policymaker"});
    let (status, body) = request(sb, "PUT", "/api/users/tenant", Some(&user), None).await?;
    assert_eq!(status, 204, "{body}");
    let (status, body) = request(sb, "GET", "/api/policies", None, Some(tenant)).await?;
    assert_eq!((status, body.as_str()), (200, "[]"));
    let (status, _) = request(sb, "GET", "/api/nodes", None, Some(tenant)).await?;
    assert_eq!(status, 401);
    Ok(())
}
