//! Policies and operator policies, as RabbitMQ defines them: set through
//! management (the gRPC API and spillctl), applied at once to the queues
//! and exchanges they match — including queues already holding messages —
//! combined with the queues' own arguments by RabbitMQ's rules, stored,
//! and guarded by the policymaker and administrator tags.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, ExchangeKind};
use spillway_integration_tests::amqp::{
    deaths, declare, fanout_to_queue, field, get, message_count, s, table, text,
};
use spillway_integration_tests::{both_wirings, eventually, Management, Sandbox, MANAGEMENT_TOKEN};
use spillway_proto::management::{self as m, argument_value};
use std::time::Duration;

both_wirings!(
    timeout_secs = 90;
    a_policy_applies_at_once_to_existing_and_new_queues,
    a_policy_trims_a_backlog_that_flowed_to_disk,
    arguments_policies_and_operator_policies_combine_as_in_rabbitmq,
    dead_lettering_and_ttl_by_policy,
    an_alternate_exchange_by_policy,
    policies_survive_a_restart,
    policies_are_checked_and_need_the_right_tags,
    spillctl_sets_lists_shows_and_clears_policies,
    spillctl_acts_on_the_vhost_it_is_given,
);

async fn set_policy(
    admin: &mut Management,
    name: &str,
    pattern: &str,
    definition: &str,
    priority: i32,
    apply_to: &str,
    operator: bool,
) -> Result<m::Policy, tonic::Status> {
    admin
        .set_policy(m::SetPolicyRequest {
            policy: Some(m::Policy {
                vhost: "/".into(),
                name: name.into(),
                pattern: pattern.into(),
                apply_to: apply_to.into(),
                priority,
                definition: definition.into(),
                operator,
            }),
        })
        .await
        .map(|r| r.into_inner())
}

async fn queue_info(admin: &mut Management, name: &str) -> anyhow::Result<m::Queue> {
    Ok(admin
        .get_queue(m::GetQueueRequest {
            vhost: "/".into(),
            name: name.into(),
        })
        .await?
        .into_inner())
}

/// An integer argument in force on a queue.
fn in_force(queue: &m::Queue, key: &str) -> Option<i64> {
    match queue.effective_arguments.get(key)?.value.as_ref()? {
        argument_value::Value::IntValue(n) => Some(*n),
        _ => None,
    }
}

fn text_in_force(queue: &m::Queue, key: &str) -> Option<String> {
    match queue.effective_arguments.get(key)?.value.as_ref()? {
        argument_value::Value::StringValue(text) => Some(text.clone()),
        _ => None,
    }
}

/// Publishes `count` messages `{prefix}0`, `{prefix}1`, … to `queue`,
/// confirmed.
async fn publish(ch: &Channel, queue: &str, prefix: &str, count: usize) -> anyhow::Result<()> {
    for n in 0..count {
        let confirm = ch
            .basic_publish(
                s(""),
                s(queue),
                BasicPublishOptions::default(),
                format!("{prefix}{n}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await?
            .await?;
        anyhow::ensure!(confirm.is_ack(), "publish to {queue} not acked");
    }
    Ok(())
}

async fn bodies(ch: &Channel, queue: &str) -> anyhow::Result<Vec<String>> {
    let mut bodies = Vec::new();
    while let Some(message) = ch
        .basic_get(s(queue), BasicGetOptions { no_ack: true })
        .await?
    {
        bodies.push(String::from_utf8(message.delivery.data.clone())?);
    }
    Ok(bodies)
}

async fn confirm_channel(sb: &Sandbox) -> anyhow::Result<(lapin::Connection, Channel)> {
    let conn = sb.connect().await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok((conn, ch))
}

async fn a_policy_applies_at_once_to_existing_and_new_queues(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let mut admin = sb.management().await?;
    let (_conn, ch) = confirm_channel(sb).await?;
    declare(&ch, "orders.eu", false, FieldTable::default()).await?;
    declare(&ch, "billing", false, FieldTable::default()).await?;
    publish(&ch, "orders.eu", "m", 10).await?;
    publish(&ch, "billing", "b", 10).await?;

    set_policy(
        &mut admin,
        "cap",
        r"^orders\.",
        r#"{"max-length": 3}"#,
        0,
        "queues",
        false,
    )
    .await?;
    // Applied at once: the oldest go (drop-head), as RabbitMQ does.
    assert_eq!(message_count(&ch, "orders.eu").await?, 3);
    assert_eq!(message_count(&ch, "billing").await?, 10, "not matched");
    let info = queue_info(&mut admin, "orders.eu").await?;
    assert_eq!(info.policy, "cap");
    assert_eq!(in_force(&info, "x-max-length"), Some(3));
    assert!(info.arguments.is_empty(), "its own arguments are unchanged");
    assert_eq!(bodies(&ch, "orders.eu").await?, ["m7", "m8", "m9"]);

    // A queue declared later gets it too; a redeclare with the client's own
    // (empty) arguments is still equivalent.
    declare(&ch, "orders.us", false, FieldTable::default()).await?;
    publish(&ch, "orders.us", "u", 5).await?;
    assert_eq!(message_count(&ch, "orders.us").await?, 3);
    declare(&ch, "orders.us", false, FieldTable::default()).await?;

    // Replaced: the new definition applies; cleared: nothing does.
    set_policy(
        &mut admin,
        "cap",
        r"^orders\.",
        r#"{"max-length": 1}"#,
        0,
        "queues",
        false,
    )
    .await?;
    assert_eq!(message_count(&ch, "orders.us").await?, 1);
    admin
        .clear_policy(m::ClearPolicyRequest {
            vhost: "/".into(),
            name: "cap".into(),
            operator: false,
        })
        .await?;
    publish(&ch, "orders.us", "v", 5).await?;
    assert_eq!(message_count(&ch, "orders.us").await?, 6);
    let info = queue_info(&mut admin, "orders.us").await?;
    assert_eq!(info.policy, "");
    assert_eq!(in_force(&info, "x-max-length"), None);
    Ok(())
}

/// A lower `max-length` on a queue whose backlog flowed to disk drops the
/// oldest messages at once, dead-lettering them in order (payloads read
/// back from the store), and the newest stay readable.
async fn a_policy_trims_a_backlog_that_flowed_to_disk(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut admin = sb.management().await?;
    let (_conn, ch) = confirm_channel(sb).await?;
    fanout_to_queue(&ch, "spill.dlx", "spill.dead").await?;
    declare(&ch, "spill.q", true, FieldTable::default()).await?;
    let total = 256u32;
    for n in 0..total {
        let mut body = vec![7u8; 16 * 1024];
        body[..4].copy_from_slice(&n.to_be_bytes());
        let confirm = ch
            .basic_publish(
                s(""),
                s("spill.q"),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default().with_delivery_mode(2),
            )
            .await?
            .await?;
        anyhow::ensure!(confirm.is_ack(), "publish {n} not acked");
    }
    admin
        .set_broker_settings(m::SetBrokerSettingsRequest {
            flow_to_disk_threshold: Some(1 << 20),
        })
        .await?;
    eventually(Duration::from_secs(10), || {
        let mut admin = admin.clone();
        async move {
            let queue = queue_info(&mut admin, "spill.q").await.ok()?;
            let status = queue.status?;
            (status.spilled_messages > 100).then_some(())
        }
    })
    .await?;
    set_policy(
        &mut admin,
        "trim",
        r"^spill\.q$",
        r#"{"max-length": 10, "dead-letter-exchange": "spill.dlx"}"#,
        0,
        "queues",
        false,
    )
    .await?;
    assert_eq!(message_count(&ch, "spill.q").await?, 10);
    let seq = |data: &[u8]| u32::from_be_bytes([data[0], data[1], data[2], data[3]]);
    for expected in (total - 10)..total {
        let message = get(&ch, "spill.q").await?;
        assert_eq!(seq(&message.delivery.data), expected);
        assert_eq!(message.delivery.data.len(), 16 * 1024);
        message
            .delivery
            .acker
            .ack(BasicAckOptions::default())
            .await?;
    }
    for expected in 0..(total - 10) {
        let message = get(&ch, "spill.dead").await?;
        assert_eq!(
            seq(&message.delivery.data),
            expected,
            "dead letters in order"
        );
        let death = deaths(&message.delivery.properties);
        assert_eq!(field(&death[0], "reason").as_deref(), Some("maxlen"));
        message
            .delivery
            .acker
            .ack(BasicAckOptions::default())
            .await?;
    }
    admin
        .set_broker_settings(m::SetBrokerSettingsRequest {
            flow_to_disk_threshold: Some(1 << 30),
        })
        .await?;
    Ok(())
}

async fn arguments_policies_and_operator_policies_combine_as_in_rabbitmq(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let mut admin = sb.management().await?;
    let (_conn, ch) = confirm_channel(sb).await?;
    let own = table(&[
        ("x-max-length", AMQPValue::LongInt(2)),
        ("x-overflow", text("drop-head")),
    ]);
    declare(&ch, "mix.own", false, own).await?;
    declare(&ch, "mix.plain", false, FieldTable::default()).await?;
    set_policy(
        &mut admin,
        "low",
        "^mix",
        r#"{"max-length": 50, "overflow": "reject-publish"}"#,
        1,
        "queues",
        false,
    )
    .await?;
    set_policy(
        &mut admin,
        "high",
        "^mix",
        r#"{"max-length": 5}"#,
        7,
        "all",
        false,
    )
    .await?;
    // The highest priority applies, one policy per queue; a number in force
    // is the lowest of argument and policy; other keys: the argument wins
    // (and `high` sets no overflow at all).
    let own = queue_info(&mut admin, "mix.own").await?;
    assert_eq!(own.policy, "high");
    assert_eq!(in_force(&own, "x-max-length"), Some(2));
    assert_eq!(
        text_in_force(&own, "x-overflow").as_deref(),
        Some("drop-head")
    );
    let plain = queue_info(&mut admin, "mix.plain").await?;
    assert_eq!(in_force(&plain, "x-max-length"), Some(5));
    assert_eq!(text_in_force(&plain, "x-overflow"), None);

    // An operator policy is a ceiling over both.
    set_policy(
        &mut admin,
        "ops",
        "^mix",
        r#"{"max-length": 4}"#,
        0,
        "queues",
        true,
    )
    .await?;
    let plain = queue_info(&mut admin, "mix.plain").await?;
    assert_eq!(plain.operator_policy, "ops");
    assert_eq!(in_force(&plain, "x-max-length"), Some(4));
    let own = queue_info(&mut admin, "mix.own").await?;
    assert_eq!(
        in_force(&own, "x-max-length"),
        Some(2),
        "the argument is lower"
    );
    publish(&ch, "mix.plain", "p", 9).await?;
    assert_eq!(message_count(&ch, "mix.plain").await?, 4);

    // The lower-priority policy takes over when the higher one goes.
    admin
        .clear_policy(m::ClearPolicyRequest {
            vhost: "/".into(),
            name: "high".into(),
            operator: false,
        })
        .await?;
    let plain = queue_info(&mut admin, "mix.plain").await?;
    assert_eq!(plain.policy, "low");
    assert_eq!(
        in_force(&plain, "x-max-length"),
        Some(4),
        "operator ceiling"
    );
    assert_eq!(
        text_in_force(&plain, "x-overflow").as_deref(),
        Some("reject-publish")
    );
    // reject-publish now: a publish over the limit is nacked.
    let nacked = ch
        .basic_publish(
            s(""),
            s("mix.plain"),
            BasicPublishOptions::default(),
            b"over",
            BasicProperties::default(),
        )
        .await?
        .await?;
    assert!(
        nacked.is_nack(),
        "over the limit with reject-publish: {nacked:?}"
    );
    Ok(())
}

async fn dead_lettering_and_ttl_by_policy(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut admin = sb.management().await?;
    let (_conn, ch) = confirm_channel(sb).await?;
    fanout_to_queue(&ch, "policy.dlx", "policy.dead").await?;
    // The application declares plain queues, as it did against RabbitMQ
    // where an operator set these by policy.
    declare(&ch, "jobs", false, FieldTable::default()).await?;
    declare(&ch, "jobs.ttl", false, FieldTable::default()).await?;
    set_policy(
        &mut admin,
        "dlx",
        "^jobs",
        r#"{"dead-letter-exchange": "policy.dlx"}"#,
        0,
        "queues",
        false,
    )
    .await?;
    set_policy(
        &mut admin,
        "ttl",
        r"^jobs\.ttl$",
        r#"{"dead-letter-exchange": "policy.dlx", "message-ttl": 200}"#,
        5,
        "queues",
        false,
    )
    .await?;
    publish(&ch, "jobs", "rejected", 1).await?;
    let message = get(&ch, "jobs").await?;
    message
        .delivery
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await?;
    let dead = get(&ch, "policy.dead").await?;
    assert_eq!(dead.delivery.data, b"rejected0");
    let death = deaths(&dead.delivery.properties);
    assert_eq!(field(&death[0], "reason").as_deref(), Some("rejected"));

    publish(&ch, "jobs.ttl", "late", 1).await?;
    let dead = get(&ch, "policy.dead").await?;
    assert_eq!(dead.delivery.data, b"late0");
    let death = deaths(&dead.delivery.properties);
    assert_eq!(field(&death[0], "reason").as_deref(), Some("expired"));
    assert_eq!(field(&death[0], "queue").as_deref(), Some("jobs.ttl"));

    // `expires` by policy deletes an unused queue.
    declare(&ch, "jobs.temp", false, FieldTable::default()).await?;
    set_policy(
        &mut admin,
        "gone",
        r"^jobs\.temp$",
        r#"{"expires": 300}"#,
        9,
        "queues",
        false,
    )
    .await?;
    eventually(Duration::from_secs(10), || async {
        let list = admin
            .clone()
            .list_queues(m::ListQueuesRequest { vhost: "/".into() })
            .await
            .ok()?
            .into_inner();
        (!list.queues.iter().any(|q| q.name == "jobs.temp")).then_some(())
    })
    .await?;
    Ok(())
}

async fn an_alternate_exchange_by_policy(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut admin = sb.management().await?;
    let (_conn, ch) = confirm_channel(sb).await?;
    fanout_to_queue(&ch, "ae.by-policy", "ae.unrouted").await?;
    fanout_to_queue(&ch, "ae.by-argument", "ae.own").await?;
    ch.exchange_declare(
        s("ae.source"),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.exchange_declare(
        s("ae.source-own"),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        table(&[("alternate-exchange", text("ae.by-argument"))]),
    )
    .await?;
    set_policy(
        &mut admin,
        "ae",
        r"^ae\.source",
        r#"{"alternate-exchange": "ae.by-policy"}"#,
        0,
        "exchanges",
        false,
    )
    .await?;
    let publish_to = |exchange: &'static str, body: &'static [u8]| {
        let ch = ch.clone();
        async move {
            let confirm = ch
                .basic_publish(
                    s(exchange),
                    s("nowhere"),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    body,
                    BasicProperties::default(),
                )
                .await?
                .await?;
            anyhow::Ok(confirm)
        }
    };
    match publish_to("ae.source", b"to-policy-ae").await? {
        Confirmation::Ack(returned) => {
            assert!(returned.is_none(), "routed by the alternate: not returned")
        }
        other => anyhow::bail!("publish not acked: {other:?}"),
    }
    assert_eq!(
        get(&ch, "ae.unrouted").await?.delivery.data,
        b"to-policy-ae"
    );
    // The exchange's own argument wins over the policy.
    publish_to("ae.source-own", b"to-own-ae").await?;
    assert_eq!(get(&ch, "ae.own").await?.delivery.data, b"to-own-ae");
    assert_eq!(message_count(&ch, "ae.unrouted").await?, 0);
    let list = admin
        .list_exchanges(m::ListExchangesRequest { vhost: "/".into() })
        .await?
        .into_inner();
    let source = list.exchanges.iter().find(|x| x.name == "ae.source");
    assert_eq!(source.map(|x| x.policy.as_str()), Some("ae"));
    // A policy for queues does not touch exchanges.
    let queue_info = queue_info(&mut admin, "ae.unrouted").await?;
    assert_eq!(queue_info.policy, "");
    Ok(())
}

async fn policies_survive_a_restart(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut admin = sb.management().await?;
    {
        let (conn, ch) = confirm_channel(sb).await?;
        declare(&ch, "kept", true, FieldTable::default()).await?;
        set_policy(
            &mut admin,
            "keep",
            "^kept$",
            r#"{"max-length": 2}"#,
            3,
            "queues",
            false,
        )
        .await?;
        set_policy(
            &mut admin,
            "ceiling",
            "",
            r#"{"max-length": 100}"#,
            0,
            "queues",
            true,
        )
        .await?;
        publish(&ch, "kept", "k", 5).await?;
        conn.close(200, "bye".into()).await?;
    }
    sb.restart().await?;
    let mut admin = sb.management().await?;
    let policies = admin
        .list_policies(m::ListPoliciesRequest {
            vhost: "/".into(),
            operator: false,
        })
        .await?
        .into_inner()
        .policies;
    assert_eq!(policies.len(), 1);
    assert_eq!(policies[0].name, "keep");
    assert_eq!(policies[0].priority, 3);
    assert_eq!(policies[0].definition, r#"{"max-length": 2}"#);
    let operator = admin
        .list_policies(m::ListPoliciesRequest {
            vhost: "/".into(),
            operator: true,
        })
        .await?
        .into_inner()
        .policies;
    assert_eq!(operator.len(), 1);
    let (_conn, ch) = confirm_channel(sb).await?;
    assert_eq!(bodies(&ch, "kept").await?, ["k3", "k4"]);
    publish(&ch, "kept", "after", 4).await?;
    assert_eq!(
        message_count(&ch, "kept").await?,
        2,
        "still capped after the restart"
    );
    let info = queue_info(&mut admin, "kept").await?;
    assert_eq!(
        (info.policy.as_str(), info.operator_policy.as_str()),
        ("keep", "ceiling")
    );
    Ok(())
}

async fn policies_are_checked_and_need_the_right_tags(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut admin = sb.management().await?;
    let refused = |result: Result<m::Policy, tonic::Status>| match result {
        Ok(policy) => panic!("accepted: {policy:?}"),
        Err(status) => (status.code(), status.message().to_string()),
    };
    let (code, text) = refused(
        set_policy(
            &mut admin,
            "p",
            ".*",
            r#"{"max-priority": 10}"#,
            0,
            "all",
            false,
        )
        .await,
    );
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(text.contains("'max-priority'"), "{text}");
    let (code, text) = refused(
        set_policy(
            &mut admin,
            "p",
            ".*",
            r#"{"message-ttl": "soon"}"#,
            0,
            "all",
            false,
        )
        .await,
    );
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(text.contains("message-ttl"), "{text}");
    let (_, text) = refused(
        set_policy(
            &mut admin,
            "p",
            "(",
            r#"{"max-length": 1}"#,
            0,
            "all",
            false,
        )
        .await,
    );
    assert!(text.contains("invalid pattern"), "{text}");
    let (_, text) = refused(set_policy(&mut admin, "p", ".*", "not json", 0, "all", false).await);
    assert!(text.contains("JSON"), "{text}");
    let (_, text) = refused(
        set_policy(
            &mut admin,
            "p",
            ".*",
            r#"{"dead-letter-exchange": "x"}"#,
            0,
            "queues",
            true,
        )
        .await,
    );
    assert!(text.contains("operator policy settings"), "{text}");
    let missing = admin
        .set_policy(m::SetPolicyRequest {
            policy: Some(m::Policy {
                vhost: "no-such-vhost".into(),
                name: "p".into(),
                pattern: ".*".into(),
                apply_to: "all".into(),
                definition: r#"{"max-length": 1}"#.into(),
                ..Default::default()
            }),
        })
        .await;
    assert_eq!(missing.err().map(|s| s.code()), Some(tonic::Code::NotFound));

    // Tags: management alone may not set policies, policymaker may (not
    // operator policies: those are the administrator's).
    for (name, tags) in [
        ("viewer", vec!["management"]),
        ("maker", vec!["policymaker"]),
    ] {
        admin
            .put_user(m::PutUserRequest {
                name: name.into(),
                password: Some(format!("{name}-pw")),
                tags: tags.into_iter().map(String::from).collect(),
                loopback_only: false,
            })
            .await?;
        admin
            .set_permissions(m::SetPermissionsRequest {
                user: name.into(),
                vhost: "/".into(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            })
            .await?;
    }
    let mut viewer = sb.management_as("viewer", "viewer-pw").await?;
    let denied = set_policy(
        &mut viewer,
        "v",
        ".*",
        r#"{"max-length": 1}"#,
        0,
        "all",
        false,
    )
    .await;
    assert_eq!(
        denied.err().map(|s| s.code()),
        Some(tonic::Code::PermissionDenied)
    );
    // Reading policies is the policymaker's too, as RabbitMQ's
    // `/api/policies`.
    let listed = viewer
        .list_policies(m::ListPoliciesRequest {
            vhost: "/".into(),
            operator: false,
        })
        .await;
    assert_eq!(
        listed.err().map(|s| s.code()),
        Some(tonic::Code::PermissionDenied),
        "a management user reads no policies"
    );
    let mut maker = sb.management_as("maker", "maker-pw").await?;
    set_policy(
        &mut maker,
        "made",
        "^made$",
        r#"{"max-length": 1}"#,
        0,
        "queues",
        false,
    )
    .await?;
    let listed = maker
        .list_policies(m::ListPoliciesRequest {
            vhost: "/".into(),
            operator: false,
        })
        .await?
        .into_inner()
        .policies;
    assert!(
        listed.iter().any(|policy| policy.name == "made"),
        "{listed:?}"
    );
    let denied = maker
        .list_policies(m::ListPoliciesRequest {
            vhost: "/".into(),
            operator: true,
        })
        .await;
    assert_eq!(
        denied.err().map(|s| s.code()),
        Some(tonic::Code::PermissionDenied),
        "operator policies are the administrator's to read"
    );
    let denied = set_policy(
        &mut maker,
        "op",
        ".*",
        r#"{"max-length": 1}"#,
        0,
        "queues",
        true,
    )
    .await;
    assert_eq!(
        denied.err().map(|s| s.code()),
        Some(tonic::Code::PermissionDenied)
    );
    let denied = maker
        .clear_policy(m::ClearPolicyRequest {
            vhost: "/".into(),
            name: "made".into(),
            operator: true,
        })
        .await;
    assert_eq!(
        denied.err().map(|s| s.code()),
        Some(tonic::Code::PermissionDenied)
    );
    maker
        .clear_policy(m::ClearPolicyRequest {
            vhost: "/".into(),
            name: "made".into(),
            operator: false,
        })
        .await?;
    let gone = maker
        .clear_policy(m::ClearPolicyRequest {
            vhost: "/".into(),
            name: "made".into(),
            operator: false,
        })
        .await;
    assert_eq!(gone.err().map(|s| s.code()), Some(tonic::Code::NotFound));
    Ok(())
}

async fn spillctl_sets_lists_shows_and_clears_policies(sb: &mut Sandbox) -> anyhow::Result<()> {
    let (_conn, ch) = confirm_channel(sb).await?;
    declare(&ch, "ctl.q", false, FieldTable::default()).await?;
    sb.spillctl(&[
        "policy",
        "set",
        "ctl-limit",
        "^ctl\\.",
        r#"{"max-length": 7, "overflow": "reject-publish"}"#,
        "--priority",
        "2",
        "--apply-to",
        "queues",
    ])?;
    sb.spillctl(&[
        "operator-policy",
        "set",
        "ctl-ops",
        ".*",
        r#"{"max-length-bytes": 100000}"#,
    ])?;
    let listed = sb.spillctl(&["policy", "list"])?;
    assert!(
        listed.contains("ctl-limit") && listed.contains("queues"),
        "{listed}"
    );
    let shown = sb.spillctl(&["queue", "show", "ctl.q"])?;
    assert!(shown.contains("policy: ctl-limit"), "{shown}");
    assert!(shown.contains("operator policy: ctl-ops"), "{shown}");
    assert!(shown.contains("x-max-length=7"), "{shown}");
    assert!(shown.contains("x-max-length-bytes=100000"), "{shown}");
    let json = sb.spillctl(&["--output", "json", "operator-policy", "list"])?;
    let parsed: serde_json::Value = serde_json::from_str(&json)?;
    assert_eq!(parsed["policies"][0]["name"], "ctl-ops");
    let (ok, _, stderr) = sb.spillctl_as(
        MANAGEMENT_TOKEN,
        &["policy", "set", "bad", ".*", r#"{"x-max-length": 1}"#],
    )?;
    assert!(!ok);
    assert!(stderr.contains("not recognised"), "{stderr}");
    sb.spillctl(&["policy", "clear", "ctl-limit"])?;
    sb.spillctl(&["operator-policy", "clear", "ctl-ops"])?;
    let shown = sb.spillctl(&["queue", "show", "ctl.q"])?;
    assert!(shown.contains("policy: none"), "{shown}");
    Ok(())
}

/// The (vhost, name) of each policy `spillctl policy list` shows, with
/// `--vhost` when given.
fn listed_policies(sb: &Sandbox, vhost: Option<&str>) -> anyhow::Result<Vec<(String, String)>> {
    let mut args = vec!["--output", "json"];
    if let Some(vhost) = vhost {
        args.extend(["--vhost", vhost]);
    }
    args.extend(["policy", "list"]);
    let parsed: serde_json::Value = serde_json::from_str(&sb.spillctl(&args)?)?;
    Ok(parsed["policies"]
        .as_array()
        .map(|policies| {
            policies
                .iter()
                .map(|p| {
                    let field = |key: &str| p[key].as_str().unwrap_or_default().to_string();
                    (field("vhost"), field("name"))
                })
                .collect()
        })
        .unwrap_or_default())
}

/// `spillctl --vhost V policy set|list|clear` acts on V, and without
/// `--vhost` on `/`: a queue of the same name in each vhost shows which.
async fn spillctl_acts_on_the_vhost_it_is_given(sb: &mut Sandbox) -> anyhow::Result<()> {
    sb.spillctl(&["vhost", "create", "ctl-v"])?;
    // A new vhost has no permissions, as in RabbitMQ.
    sb.spillctl(&[
        "--vhost",
        "ctl-v",
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
    let (_root_conn, root) = confirm_channel(sb).await?;
    declare(&root, "vq", false, FieldTable::default()).await?;
    let v_uri = format!("amqp://guest:guest@{}/ctl-v", sb.amqp_addr());
    let v_conn = lapin::Connection::connect(&v_uri, lapin::ConnectionProperties::default()).await?;
    let v = v_conn.create_channel().await?;
    v.confirm_select(ConfirmSelectOptions::default()).await?;
    declare(&v, "vq", false, FieldTable::default()).await?;

    sb.spillctl(&[
        "--vhost",
        "ctl-v",
        "policy",
        "set",
        "one-only",
        "^vq$",
        r#"{"max-length": 1}"#,
        "--apply-to",
        "queues",
    ])?;
    let one_only = ("ctl-v".to_string(), "one-only".to_string());
    assert_eq!(listed_policies(sb, Some("ctl-v"))?, vec![one_only.clone()]);
    assert_eq!(listed_policies(sb, None)?, vec![]);
    let shown = sb.spillctl(&["--vhost", "ctl-v", "queue", "show", "vq"])?;
    assert!(shown.contains("policy: one-only"), "{shown}");
    let shown = sb.spillctl(&["queue", "show", "vq"])?;
    assert!(shown.contains("policy: none"), "{shown}");
    // In force in ctl-v only.
    publish(&v, "vq", "v", 3).await?;
    publish(&root, "vq", "r", 3).await?;
    assert_eq!(message_count(&v, "vq").await?, 1);
    assert_eq!(message_count(&root, "vq").await?, 3);

    // Without --vhost, clear looks in `/`: not there, and ctl-v's stays.
    let wrong = sb.spillctl(&["policy", "clear", "one-only"]);
    assert!(wrong.is_err(), "cleared in `/`: {wrong:?}");
    assert_eq!(listed_policies(sb, Some("ctl-v"))?, vec![one_only.clone()]);
    // A policy of the same name in `/` is another policy.
    sb.spillctl(&["policy", "set", "one-only", "^vq$", r#"{"max-length": 2}"#])?;
    let shown = sb.spillctl(&["queue", "show", "vq"])?;
    assert!(shown.contains("x-max-length=2"), "{shown}");
    let shown = sb.spillctl(&["--vhost", "ctl-v", "queue", "show", "vq"])?;
    assert!(shown.contains("x-max-length=1"), "{shown}");

    // Cleared in ctl-v, it stops applying there; `/`'s is untouched.
    sb.spillctl(&["--vhost", "ctl-v", "policy", "clear", "one-only"])?;
    assert_eq!(listed_policies(sb, Some("ctl-v"))?, vec![]);
    assert_eq!(
        listed_policies(sb, None)?,
        vec![("/".to_string(), "one-only".to_string())]
    );
    let shown = sb.spillctl(&["--vhost", "ctl-v", "queue", "show", "vq"])?;
    assert!(shown.contains("policy: none"), "{shown}");
    publish(&v, "vq", "v-after", 2).await?;
    assert_eq!(message_count(&v, "vq").await?, 3);
    let shown = sb.spillctl(&["queue", "show", "vq"])?;
    assert!(shown.contains("policy: one-only"), "{shown}");
    assert_eq!(message_count(&root, "vq").await?, 2);
    v_conn.close(200, s("bye")).await?;
    Ok(())
}
