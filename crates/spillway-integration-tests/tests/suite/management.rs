//! The management API through its real gRPC server, against both wirings
//! (in-process all-in-one, and storage/engine/management/gateway as separate
//! processes): every call, refused credentials, not-found and
//! invalid-argument answers, server reflection, closing a connection seen by
//! a lapin client, and `spillctl` end to end (table and JSON output).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;
use spillway_integration_tests::{both_wirings, eventually, Sandbox, Wiring, MANAGEMENT_TOKEN};
use spillway_proto::management::management_client::ManagementClient;
use spillway_proto::management::{self as m, argument_value};
use tonic::transport::Channel;
use tonic::Code;

both_wirings!(
    timeout_secs = 90;
    definitions_lifecycle,
    vhosts_survive_a_restart,
    not_found_and_invalid_argument,
    refused_credentials,
    peek_move_purge_keep_messages,
    connections_listed_and_closed,
    status_settings_and_reflection,
    runtime_settings_take_effect,
    spillctl_end_to_end,
);

/// Adds `authorization` (when given) to every call. Cloneable, so probes of
/// `eventually` can each take a clone of a client.
#[derive(Clone)]
struct AddCredentials(Option<String>);

impl tonic::service::Interceptor for AddCredentials {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            let value = value
                .parse()
                .map_err(|_| tonic::Status::internal("unprintable authorization"))?;
            request.metadata_mut().insert("authorization", value);
        }
        Ok(request)
    }
}

type Client =
    ManagementClient<tonic::service::interceptor::InterceptedService<Channel, AddCredentials>>;

async fn client_with(sb: &Sandbox, authorization: Option<String>) -> anyhow::Result<Client> {
    let channel = Channel::from_shared(format!("http://{}", sb.management_addr()))?
        .connect()
        .await?;
    Ok(ManagementClient::with_interceptor(
        channel,
        AddCredentials(authorization),
    ))
}

async fn client(sb: &Sandbox) -> anyhow::Result<Client> {
    client_with(sb, Some(format!("Bearer {MANAGEMENT_TOKEN}"))).await
}

fn int(i: i64) -> m::ArgumentValue {
    m::ArgumentValue {
        value: Some(argument_value::Value::IntValue(i)),
    }
}

fn string(text: &str) -> m::ArgumentValue {
    m::ArgumentValue {
        value: Some(argument_value::Value::StringValue(text.into())),
    }
}

fn code<T: std::fmt::Debug>(result: Result<T, tonic::Status>) -> Code {
    result.expect_err("the call should fail").code()
}

fn queue_request(vhost: &str, name: &str) -> m::CreateQueueRequest {
    m::CreateQueueRequest {
        vhost: vhost.into(),
        name: name.into(),
        durable: true,
        ..Default::default()
    }
}

async fn definitions_lifecycle(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut c = client(sb).await?;
    let vhost = c
        .create_vhost(m::CreateVhostRequest { name: "ops".into() })
        .await?
        .into_inner();
    assert_eq!(vhost.name, "ops");
    let names: Vec<String> = c
        .list_vhosts(m::ListVhostsRequest {})
        .await?
        .into_inner()
        .vhosts
        .into_iter()
        .map(|v| v.name)
        .collect();
    assert_eq!(names, ["/", "ops"]);
    assert_eq!(
        c.get_vhost(m::GetVhostRequest { name: "ops".into() })
            .await?
            .into_inner()
            .name,
        "ops"
    );

    let exchange = c
        .create_exchange(m::CreateExchangeRequest {
            vhost: "ops".into(),
            name: "events".into(),
            kind: "topic".into(),
            durable: true,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!((exchange.kind.as_str(), exchange.durable), ("topic", true));
    let exchanges = c
        .list_exchanges(m::ListExchangesRequest {
            vhost: "ops".into(),
        })
        .await?
        .into_inner()
        .exchanges;
    assert!(exchanges.iter().any(|x| x.name == "amq.topic" && x.builtin));
    let got = c
        .get_exchange(m::GetExchangeRequest {
            vhost: "ops".into(),
            name: "events".into(),
        })
        .await?
        .into_inner();
    assert_eq!(got, exchange);

    let arguments: HashMap<String, m::ArgumentValue> = [
        ("x-max-length".to_string(), int(100)),
        ("x-max-length-bytes".to_string(), int(1 << 20)),
        ("x-overflow".to_string(), string("reject-publish")),
        ("x-qpid-capacity".to_string(), int(10_000)),
        ("x-qpid-flow-resume-capacity".to_string(), int(8_000)),
        ("qpid.max_count".to_string(), int(50)),
    ]
    .into();
    let queue = c
        .create_queue(m::CreateQueueRequest {
            arguments: arguments.clone(),
            ..queue_request("ops", "orders")
        })
        .await?
        .into_inner();
    assert_eq!(queue.arguments, arguments);
    assert!(queue.durable && !queue.auto_delete && !queue.exclusive);
    let listed = c
        .list_queues(m::ListQueuesRequest {
            vhost: "ops".into(),
        })
        .await?
        .into_inner()
        .queues;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].status, Some(m::QueueStatus::default()));

    let binding = m::Binding {
        vhost: "ops".into(),
        source: "events".into(),
        destination: "orders".into(),
        routing_key: "order.*".into(),
        ..Default::default()
    };
    c.create_binding(m::CreateBindingRequest {
        binding: Some(binding.clone()),
    })
    .await?;
    let bindings = c
        .list_bindings(m::ListBindingsRequest {
            vhost: "ops".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .bindings;
    assert_eq!(bindings, std::slice::from_ref(&binding));
    assert_eq!(
        c.get_binding(m::GetBindingRequest {
            binding: Some(binding.clone())
        })
        .await?
        .into_inner(),
        binding
    );
    c.delete_binding(m::DeleteBindingRequest {
        binding: Some(binding.clone()),
    })
    .await?;
    assert_eq!(
        code(
            c.get_binding(m::GetBindingRequest {
                binding: Some(binding.clone())
            })
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.delete_binding(m::DeleteBindingRequest {
                binding: Some(binding)
            })
            .await
        ),
        Code::NotFound
    );

    // The definitions are the broker's: a client sees them, once it may
    // use the new vhost (a vhost starts with no permissions, as in RabbitMQ).
    c.set_permissions(m::SetPermissionsRequest {
        user: "guest".into(),
        vhost: "ops".into(),
        configure: ".*".into(),
        write: ".*".into(),
        read: ".*".into(),
    })
    .await?;
    let conn = lapin::Connection::connect(
        &format!("amqp://guest:guest@{}/ops", sb.amqp_addr()),
        lapin::ConnectionProperties::default(),
    )
    .await?;
    let ch = conn.create_channel().await?;
    ch.queue_declare(
        "orders".into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    conn.close(200, "bye".into()).await?;

    c.delete_queue(m::DeleteQueueRequest {
        vhost: "ops".into(),
        name: "orders".into(),
        ..Default::default()
    })
    .await?;
    c.delete_exchange(m::DeleteExchangeRequest {
        vhost: "ops".into(),
        name: "events".into(),
        ..Default::default()
    })
    .await?;
    c.delete_vhost(m::DeleteVhostRequest { name: "ops".into() })
        .await?;
    assert_eq!(
        code(c.get_vhost(m::GetVhostRequest { name: "ops".into() }).await),
        Code::NotFound
    );
    Ok(())
}

/// Vhosts made through management are stored: an empty one and one with a
/// durable queue are there after a restart, one deleted before it is not.
async fn vhosts_survive_a_restart(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut c = client(sb).await?;
    for name in ["empty", "busy", "dropped"] {
        c.create_vhost(m::CreateVhostRequest { name: name.into() })
            .await?;
    }
    c.create_queue(queue_request("busy", "orders")).await?;
    for vhost in ["empty", "dropped"] {
        c.set_permissions(m::SetPermissionsRequest {
            user: "guest".into(),
            vhost: vhost.into(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        })
        .await?;
    }
    c.delete_vhost(m::DeleteVhostRequest {
        name: "dropped".into(),
    })
    .await?;
    sb.restart().await?;

    let mut c = client(sb).await?;
    let names: Vec<String> = c
        .list_vhosts(m::ListVhostsRequest {})
        .await?
        .into_inner()
        .vhosts
        .into_iter()
        .map(|v| v.name)
        .collect();
    anyhow::ensure!(
        names == ["/", "busy", "empty"],
        "after a restart: {names:?}"
    );
    let queues = c
        .list_queues(m::ListQueuesRequest {
            vhost: "busy".into(),
        })
        .await?
        .into_inner()
        .queues;
    anyhow::ensure!(
        queues.len() == 1 && queues[0].name == "orders",
        "{queues:?}"
    );
    // A client opens the empty one (its permission was kept too); the
    // deleted one is gone for clients, and so is the permission in it.
    let conn = lapin::Connection::connect(
        &format!("amqp://guest:guest@{}/empty", sb.amqp_addr()),
        lapin::ConnectionProperties::default(),
    )
    .await?;
    conn.close(200, "bye".into()).await?;
    let refused = lapin::Connection::connect(
        &format!("amqp://guest:guest@{}/dropped", sb.amqp_addr()),
        lapin::ConnectionProperties::default(),
    )
    .await
    .err()
    .map(|e| e.to_string())
    .ok_or_else(|| anyhow::anyhow!("the deleted vhost opened after a restart"))?;
    anyhow::ensure!(refused.contains("NOT_ALLOWED"), "{refused}");
    let kept = c
        .list_permissions(m::ListPermissionsRequest {
            user: "guest".into(),
            vhost: String::new(),
        })
        .await?
        .into_inner()
        .permissions;
    let vhosts: Vec<&str> = kept.iter().map(|p| p.vhost.as_str()).collect();
    anyhow::ensure!(vhosts == ["/", "empty"], "{kept:?}");
    Ok(())
}

async fn not_found_and_invalid_argument(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut c = client(sb).await?;
    let missing = m::GetQueueRequest {
        vhost: "/".into(),
        name: "nope".into(),
    };
    assert_eq!(code(c.get_queue(missing).await), Code::NotFound);
    assert_eq!(
        code(c.create_queue(queue_request("no-such-vhost", "q")).await),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.get_exchange(m::GetExchangeRequest {
                vhost: "/".into(),
                name: "nope".into()
            })
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.delete_queue(m::DeleteQueueRequest {
                vhost: "/".into(),
                name: "nope".into(),
                ..Default::default()
            })
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.purge_queue(m::PurgeQueueRequest {
                vhost: "/".into(),
                name: "nope".into()
            })
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.peek_messages(m::PeekMessagesRequest {
                vhost: "/".into(),
                queue: "nope".into(),
                count: 1
            })
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.close_connection(m::CloseConnectionRequest {
                id: 987_654,
                reason: String::new()
            })
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(c.create_queue(queue_request("/", "")).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.create_exchange(m::CreateExchangeRequest {
                vhost: "/".into(),
                name: "odd".into(),
                kind: "no-such-type".into(),
                ..Default::default()
            })
            .await
        ),
        Code::InvalidArgument
    );
    let bad_length = m::CreateQueueRequest {
        arguments: [("x-max-length".to_string(), string("many"))].into(),
        ..queue_request("/", "bad")
    };
    assert_eq!(
        code(c.create_queue(bad_length).await),
        Code::InvalidArgument
    );
    c.create_queue(queue_request("/", "same")).await?;
    assert_eq!(
        code(
            c.move_messages(m::MoveMessagesRequest {
                vhost: "/".into(),
                source: "same".into(),
                destination: "same".into(),
                max_messages: 0
            })
            .await
        ),
        Code::InvalidArgument
    );
    // Redeclaring with other properties is refused as RabbitMQ does.
    let transient = m::CreateQueueRequest {
        durable: false,
        ..queue_request("/", "same")
    };
    assert_eq!(
        code(c.create_queue(transient).await),
        Code::FailedPrecondition
    );
    assert_eq!(
        code(
            c.delete_exchange(m::DeleteExchangeRequest {
                vhost: "/".into(),
                name: "amq.direct".into(),
                if_unused: false
            })
            .await
        ),
        Code::PermissionDenied
    );
    assert_eq!(
        code(
            c.create_vhost(m::CreateVhostRequest { name: "/".into() })
                .await
        ),
        Code::AlreadyExists
    );
    assert_eq!(
        code(
            c.delete_vhost(m::DeleteVhostRequest { name: "/".into() })
                .await
        ),
        Code::FailedPrecondition
    );
    Ok(())
}

async fn refused_credentials(sb: &mut Sandbox) -> anyhow::Result<()> {
    let request = || m::ListVhostsRequest {};
    let mut none = client_with(sb, None).await?;
    assert_eq!(
        code(none.list_vhosts(request()).await),
        Code::Unauthenticated
    );
    let mut wrong = client_with(sb, Some("Bearer not-the-token".into())).await?;
    assert_eq!(
        code(wrong.list_vhosts(request()).await),
        Code::Unauthenticated
    );
    let mut bad_password = client_with(sb, Some(basic("guest", "wrong"))).await?;
    assert_eq!(
        code(bad_password.list_vhosts(request()).await),
        Code::Unauthenticated
    );
    let mut garbage = client_with(sb, Some("Digest abc".into())).await?;
    assert_eq!(
        code(
            garbage
                .get_broker_status(m::GetBrokerStatusRequest {})
                .await
        ),
        Code::Unauthenticated
    );
    // The default guest user is accepted from loopback, like on the AMQP port.
    let mut guest = client_with(sb, Some(basic("guest", "guest"))).await?;
    guest.list_vhosts(request()).await?;
    Ok(())
}

fn basic(user: &str, password: &str) -> String {
    use base64::Engine as _;
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
    )
}

async fn publish_to(ch: &lapin::Channel, queue: &str, body: &[u8], props: BasicProperties) {
    ch.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        body,
        props,
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

async fn depth(c: &mut Client, queue: &str) -> anyhow::Result<u64> {
    let q = c
        .get_queue(m::GetQueueRequest {
            vhost: "/".into(),
            name: queue.into(),
        })
        .await?
        .into_inner();
    Ok(q.status.unwrap_or_default().messages)
}

async fn peek_move_purge_keep_messages(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut c = client(sb).await?;
    c.create_queue(queue_request("/", "work")).await?;
    c.create_queue(queue_request("/", "work.dlq")).await?;
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from("x-death-reason"),
        AMQPValue::LongString("expired".into()),
    );
    for i in 0..5u8 {
        let props = BasicProperties::default()
            .with_delivery_mode(if i % 2 == 0 { 2 } else { 1 })
            .with_content_type("text/plain".into())
            .with_headers(headers.clone());
        publish_to(&ch, "work.dlq", format!("m{i}").as_bytes(), props).await;
    }
    // One already in the source: moved messages go after it.
    publish_to(
        &ch,
        "work",
        b"first",
        BasicProperties::default().with_delivery_mode(2),
    )
    .await;

    let peeked = c
        .peek_messages(m::PeekMessagesRequest {
            vhost: "/".into(),
            queue: "work.dlq".into(),
            count: 2,
        })
        .await?
        .into_inner()
        .messages;
    assert_eq!(peeked.len(), 2);
    assert_eq!(&peeked[0].body[..], b"m0");
    assert_eq!(&peeked[1].body[..], b"m1");
    assert_eq!(peeked[0].content_type, "text/plain");
    assert!(peeked[0].persistent && !peeked[1].persistent);
    assert!(!peeked[0].redelivered);
    assert_eq!(
        peeked[0].headers.get("x-death-reason"),
        Some(&string("expired"))
    );
    assert_eq!(depth(&mut c, "work.dlq").await?, 5, "peek consumes nothing");

    let moved = c
        .move_messages(m::MoveMessagesRequest {
            vhost: "/".into(),
            source: "work.dlq".into(),
            destination: "work".into(),
            max_messages: 0,
        })
        .await?
        .into_inner();
    assert_eq!((moved.moved, moved.remaining), (5, 0));
    assert!(moved.stopped_reason.is_empty());
    conn.close(200, "bye".into()).await?;

    // Persistent messages are where the move put them after a restart.
    sb.restart().await?;
    let mut c = client(sb).await?;
    assert_eq!(depth(&mut c, "work.dlq").await?, 0);
    assert_eq!(
        depth(&mut c, "work").await?,
        4,
        "first, m0, m2, m4 are persistent"
    );
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut bodies = Vec::new();
    while let Some(message) = ch
        .basic_get("work".into(), BasicGetOptions { no_ack: true })
        .await?
    {
        assert_eq!(
            message
                .properties
                .content_type()
                .as_ref()
                .map(|s| s.as_str()),
            (message.data != b"first").then_some("text/plain")
        );
        bodies.push(String::from_utf8(message.data.clone())?);
    }
    assert_eq!(bodies, ["first", "m0", "m2", "m4"]);

    // Transient messages move too, within a running broker; then purge.
    for i in 0..3u8 {
        publish_to(&ch, "work.dlq", &[i], BasicProperties::default()).await;
    }
    let moved = c
        .move_messages(m::MoveMessagesRequest {
            vhost: "/".into(),
            source: "work.dlq".into(),
            destination: "work".into(),
            max_messages: 2,
        })
        .await?
        .into_inner();
    assert_eq!((moved.moved, moved.remaining), (2, 1));
    let purged = c
        .purge_queue(m::PurgeQueueRequest {
            vhost: "/".into(),
            name: "work".into(),
        })
        .await?
        .into_inner();
    assert_eq!(purged.messages_purged, 2);
    assert_eq!(depth(&mut c, "work").await?, 0);

    // A full destination stops the move; nothing is lost.
    c.create_queue(m::CreateQueueRequest {
        arguments: [("x-max-length".to_string(), int(0))].into(),
        ..queue_request("/", "tiny")
    })
    .await?;
    let moved = c
        .move_messages(m::MoveMessagesRequest {
            vhost: "/".into(),
            source: "work.dlq".into(),
            destination: "tiny".into(),
            max_messages: 0,
        })
        .await?
        .into_inner();
    assert_eq!((moved.moved, moved.remaining), (0, 1));
    assert!(moved.stopped_reason.contains("full"), "{moved:?}");
    Ok(())
}

async fn connections_listed_and_closed(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut c = client(sb).await?;
    let conn = lapin::Connection::connect(
        &sb.amqp_uri(),
        lapin::ConnectionProperties::default().with_connection_name("billing-worker".into()),
    )
    .await?;
    let ch = conn.create_channel().await?;
    ch.queue_declare(
        "jobs".into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let mut consumer = ch
        .basic_consume(
            "jobs".into(),
            "worker".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    publish_to(&ch, "jobs", b"x", BasicProperties::default()).await;
    consumer
        .next()
        .await
        .unwrap()?
        .ack(BasicAckOptions::default())
        .await?;

    // The gateway reports deliveries written a moment after writing them.
    let connections = eventually(Duration::from_secs(10), || {
        let mut c = c.clone();
        async move {
            let connections = c
                .list_connections(m::ListConnectionsRequest::default())
                .await?
                .into_inner()
                .connections;
            if connections.iter().all(|c| c.messages_delivered == 1) {
                return Ok(connections);
            }
            Err(anyhow::anyhow!(
                "not every delivery counted yet: {connections:?}"
            ))
        }
    })
    .await?;
    assert_eq!(connections.len(), 1, "{connections:?}");
    let listed = &connections[0];
    assert_eq!(
        (listed.user.as_str(), listed.vhost.as_str()),
        ("guest", "/")
    );
    assert!(listed.client_address.starts_with("127.0.0.1:"));
    assert_eq!(
        listed.client_properties.get("connection_name"),
        Some(&string("billing-worker"))
    );
    assert_eq!(listed.messages_published, 1);
    assert_eq!(listed.messages_delivered, 1);
    let channels = c
        .list_channels(m::ListChannelsRequest::default())
        .await?
        .into_inner()
        .channels;
    assert_eq!(channels.len(), 1);
    assert_eq!(
        (channels[0].connection_id, channels[0].consumers),
        (listed.id, 1)
    );

    c.close_connection(m::CloseConnectionRequest {
        id: listed.id,
        reason: "maintenance window".into(),
    })
    .await?;
    // The client is told why: its consumer ends with the broker's close.
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
        None => {
            // The stream may end without the error: ask the connection.
            ch.queue_declare(
                "x".into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect_err("the connection is closed")
        }
    };
    let text = error.to_string();
    assert!(
        text.contains("CONNECTION_FORCED") && text.contains("maintenance window"),
        "{text}"
    );
    match error.kind() {
        lapin::ErrorKind::ProtocolError(e) => assert_eq!(e.get_id(), 320),
        other => panic!("not a protocol error: {other:?}"),
    }
    assert!(!conn.status().connected());
    eventually(Duration::from_secs(10), || {
        let mut c = c.clone();
        async move {
            let left = c
                .list_connections(m::ListConnectionsRequest::default())
                .await?
                .into_inner()
                .connections;
            anyhow::ensure!(left.is_empty(), "still listed: {left:?}");
            Ok(())
        }
    })
    .await
    .map_err(|error| error.context("the closed connection is no longer listed"))?;
    Ok(())
}

async fn status_settings_and_reflection(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut c = client(sb).await?;
    c.create_queue(queue_request("/", "counted")).await?;
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    for _ in 0..3 {
        publish_to(
            &ch,
            "counted",
            b"abc",
            BasicProperties::default().with_delivery_mode(2),
        )
        .await;
    }
    let status = c
        .get_broker_status(m::GetBrokerStatusRequest {})
        .await?
        .into_inner();
    assert!(!status.version.is_empty());
    assert_eq!((status.queues, status.messages_ready), (1, 3));
    assert_eq!((status.connections, status.channels), (1, 1));
    // The store's figure is RocksDB's key estimate: at least the messages.
    assert!(status.stored_messages >= 3, "{status:?}");
    assert!(status.store_disk_bytes > 0);
    conn.close(200, "bye".into()).await?;

    // Server reflection, without credentials (what `grpcurl list` does).
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let channel = Channel::from_shared(format!("http://{}", sb.management_addr()))?
        .connect()
        .await?;
    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(futures::stream::iter([request]))
        .await?
        .into_inner();
    let response = responses.message().await?.expect("a reflection answer");
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer {response:?}");
    };
    let services: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        services.contains(&"spillway.management.v1.Management".to_string()),
        "{services:?}"
    );
    Ok(())
}

/// Runs spillctl against the sandbox; returns (success, stdout, stderr).
async fn spillctl_end_to_end(sb: &mut Sandbox) -> anyhow::Result<()> {
    let ok = |args: &[&str]| -> anyhow::Result<String> {
        let (success, stdout, stderr) = sb.spillctl_as(MANAGEMENT_TOKEN, args)?;
        anyhow::ensure!(success, "spillctl {args:?} failed: {stderr}");
        Ok(stdout)
    };
    ok(&[
        "queue",
        "create",
        "invoices",
        "--durable",
        "--arg",
        "x-max-length=500",
    ])?;
    ok(&[
        "exchange",
        "create",
        "billing",
        "--type",
        "fanout",
        "--durable",
    ])?;
    ok(&["binding", "create", "billing", "invoices"])?;
    let table = ok(&["queue", "list"])?;
    assert!(
        table.contains("invoices") && table.contains("x-max-length=500"),
        "{table}"
    );
    assert!(table.contains("ready"), "a table with a header: {table}");

    let json = ok(&["--output", "json", "queue", "get", "invoices"])?;
    let value: serde_json::Value = serde_json::from_str(&json)?;
    assert_eq!(value["name"], "invoices");
    assert_eq!(value["durable"], true);
    assert_eq!(value["arguments"]["x-max-length"], 500);
    assert_eq!(value["status"]["messages"], 0);

    let json = ok(&["-o", "json", "binding", "list"])?;
    let value: serde_json::Value = serde_json::from_str(&json)?;
    assert_eq!(value["bindings"][0]["source"], "billing");

    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    publish_to(&ch, "invoices", b"{\"n\":1}", BasicProperties::default()).await;
    let peek = ok(&["queue", "peek", "invoices"])?;
    assert!(peek.contains("{\"n\":1}"), "{peek}");
    let json = ok(&["-o", "json", "queue", "peek", "invoices"])?;
    let value: serde_json::Value = serde_json::from_str(&json)?;
    assert_eq!(value["messages"][0]["body"], "eyJuIjoxfQ==", "base64 body");
    let connections = ok(&["connection", "list"])?;
    assert!(connections.contains("guest"), "{connections}");
    let status = ok(&["status"])?;
    assert!(status.contains("version"), "{status}");
    ok(&["queue", "purge", "invoices"])?;
    ok(&["binding", "delete", "billing", "invoices"])?;
    ok(&["queue", "delete", "invoices"])?;
    conn.close(200, "bye".into()).await?;

    // Failures: non-zero exit, the server's reason on stderr.
    let (success, _, stderr) = sb.spillctl_as(MANAGEMENT_TOKEN, &["queue", "get", "invoices"])?;
    assert!(!success);
    assert!(
        stderr.contains("NotFound") && stderr.contains("no queue 'invoices'"),
        "{stderr}"
    );
    let (success, _, stderr) = sb.spillctl_as("wrong", &["vhost", "list"])?;
    assert!(!success);
    assert!(stderr.contains("Unauthenticated"), "{stderr}");
    let (success, _, stderr) = sb.spillctl_as(
        MANAGEMENT_TOKEN,
        &["settings", "--flow-to-disk-threshold", "1000000"],
    )?;
    assert!(success, "{stderr}");
    let (success, stdout, stderr) =
        sb.spillctl_as(MANAGEMENT_TOKEN, &["status", "--output", "json"])?;
    assert!(success, "{stderr}");
    assert!(stdout.contains("1000000"), "{stdout}");
    Ok(())
}

/// The runtime settings act at once: lowering the flow-to-disk threshold
/// spills (BRK-1014), raising it again ends flow to disk (BRK-1015); a
/// queue capacity lowered below its depth blocks the next publish and is
/// refused with its resume capacity above it; the store quota changes.
async fn runtime_settings_take_effect(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut c = client(sb).await?;
    c.create_queue(queue_request("/", "backlog")).await?;
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let body = vec![5u8; 16 * 1024];
    for _ in 0..256 {
        publish_to(&ch, "backlog", &body, BasicProperties::default()).await;
    }
    let status = c
        .get_broker_status(m::GetBrokerStatusRequest {})
        .await?
        .into_inner();
    assert_eq!(status.flow_to_disk_active, Some(false), "{status:?}");
    assert!(
        status.resident_message_bytes.unwrap_or(0) > 4 << 20,
        "{status:?}"
    );

    // Lower the threshold under the 4 MiB backlog: flow to disk starts.
    c.set_broker_settings(m::SetBrokerSettingsRequest {
        flow_to_disk_threshold: Some(1 << 20),
    })
    .await?;
    let spilled = eventually(Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let status = c
                .get_broker_status(m::GetBrokerStatusRequest {})
                .await?
                .into_inner();
            let settled = status.resident_message_bytes.unwrap_or(u64::MAX) <= 2 << 20;
            if status.flow_to_disk_active == Some(true) && status.spilled_messages > 0 && settled {
                return Ok(status);
            }
            Err(anyhow::anyhow!("last status: {status:?}"))
        }
    })
    .await
    .map_err(|error| error.context("flow to disk did not start after lowering the threshold"))?;
    assert_eq!(spilled.flow_to_disk_threshold, Some(1 << 20));
    assert!(
        spilled.resident_message_bytes.unwrap_or(u64::MAX) <= 2 << 20,
        "{spilled:?}"
    );
    let queue = c
        .get_queue(m::GetQueueRequest {
            vhost: "/".into(),
            name: "backlog".into(),
        })
        .await?
        .into_inner();
    let queue_status = queue.status.expect("queue status");
    assert!(queue_status.spilled_messages > 0, "{queue_status:?}");
    assert_eq!(queue_status.messages, 256);

    // Raise it above the backlog: flow to disk ends.
    c.set_broker_settings(m::SetBrokerSettingsRequest {
        flow_to_disk_threshold: Some(1 << 30),
    })
    .await?;
    eventually(Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let status = c
                .get_broker_status(m::GetBrokerStatusRequest {})
                .await?
                .into_inner();
            anyhow::ensure!(
                status.flow_to_disk_active == Some(false),
                "last status: {status:?}"
            );
            Ok(())
        }
    })
    .await
    .map_err(|error| error.context("flow to disk stayed active after raising the threshold"))?;
    if sb.wiring() == Wiring::Separate {
        let logs = sb.logs();
        assert!(
            logs.contains("BRK-1014 : Message flow to disk active : Message memory use "),
            "{logs}"
        );
        assert!(
            logs.contains("BRK-1015 : Message flow to disk inactive : Message memory use "),
            "{logs}"
        );
    }

    // A capacity below the queue's depth: the next publish finds it
    // overfull; a resume capacity above the capacity is refused.
    let refused = c
        .update_queue(m::UpdateQueueRequest {
            vhost: "/".into(),
            name: "backlog".into(),
            capacity: Some(1000),
            resume_capacity: Some(2000),
            ..Default::default()
        })
        .await;
    assert_eq!(code(refused), Code::FailedPrecondition);
    c.update_queue(m::UpdateQueueRequest {
        vhost: "/".into(),
        name: "backlog".into(),
        capacity: Some(1 << 20),
        ..Default::default()
    })
    .await?;
    publish_to(&ch, "backlog", b"one more", BasicProperties::default()).await;
    let queue = c
        .get_queue(m::GetQueueRequest {
            vhost: "/".into(),
            name: "backlog".into(),
        })
        .await?
        .into_inner();
    let queue_status = queue.status.expect("queue status");
    assert!(queue_status.overfull, "{queue_status:?}");
    assert_eq!(queue_status.blocked_channels, 1, "{queue_status:?}");
    assert!(
        matches!(
            queue
                .arguments
                .get("x-qpid-capacity")
                .and_then(|v| v.value.clone()),
            Some(argument_value::Value::IntValue(1048576))
        ),
        "{:?}",
        queue.arguments
    );
    let channels = c
        .list_channels(m::ListChannelsRequest::default())
        .await?
        .into_inner()
        .channels;
    assert!(
        channels
            .iter()
            .any(|c| c.blocked && c.blocked_reason.contains("backlog")),
        "{channels:?}"
    );
    // Purged: underfull, released.
    c.purge_queue(m::PurgeQueueRequest {
        vhost: "/".into(),
        name: "backlog".into(),
    })
    .await?;
    let channels = c
        .list_channels(m::ListChannelsRequest::default())
        .await?
        .into_inner()
        .channels;
    assert!(channels.iter().all(|c| !c.blocked), "{channels:?}");

    // The store quota.
    c.set_store_quota(m::SetStoreQuotaRequest {
        overfull_size: Some(1 << 30),
        underfull_size: Some(1 << 29),
    })
    .await?;
    let status = c
        .get_broker_status(m::GetBrokerStatusRequest {})
        .await?
        .into_inner();
    assert_eq!(status.store_quota_bytes, Some(1 << 30), "{status:?}");
    assert_eq!(status.store_underfull_bytes, 1 << 29, "{status:?}");
    assert!(!status.store_overfull);
    conn.close(200, "bye".into()).await?;
    Ok(())
}
