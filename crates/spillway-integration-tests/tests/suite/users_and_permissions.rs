//! Users and permissions, through lapin and the management API,
//! in both wirings:
//!
//! - the configuration's guest is the seed of an empty store;
//! - a user limited to `^app\.` may use `app.*` and gets RabbitMQ's 403
//!   for anything else: declaring, publishing, consuming, getting,
//!   binding;
//! - a user without permissions in a vhost cannot open it (530);
//! - a permission change is seen by connections already open, and
//!   deleting a user closes their connections;
//! - users, password hashes and permissions survive a restart;
//! - `spillctl user` / `spillctl permissions` do the same from a shell;
//! - stored users log in to management with their password, and their
//!   tags decide what they may do there (monitoring lists, administrator
//!   changes, management acts within its permissions).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use spillway_integration_tests::amqp::{declare, s};
use spillway_integration_tests::{both_wirings, eventually, spillctl_bin, Management, Sandbox};
use spillway_proto::management as m;

both_wirings!(
    timeout_secs = 90;
    the_configured_guest_is_stored_as_administrator,
    a_limited_user_is_refused_outside_its_patterns,
    a_user_without_permissions_cannot_open_the_vhost,
    changes_reach_open_connections,
    users_and_permissions_survive_a_restart,
    spillctl_manages_users_and_permissions,
    management_follows_user_tags,
);

const WAIT: Duration = Duration::from_secs(10);

async fn connect_as(
    sb: &Sandbox,
    user: &str,
    password: &str,
    vhost: &str,
) -> anyhow::Result<Connection> {
    let vhost = if vhost == "/" { "%2f" } else { vhost };
    Ok(Connection::connect(
        &format!("amqp://{user}:{password}@{}/{vhost}", sb.amqp_addr()),
        ConnectionProperties::default(),
    )
    .await?)
}

/// The error text of a connection attempt that must fail.
async fn refused_connection(
    sb: &Sandbox,
    user: &str,
    password: &str,
    vhost: &str,
) -> anyhow::Result<String> {
    match connect_as(sb, user, password, vhost).await {
        Ok(_) => anyhow::bail!("{user} opened vhost {vhost}"),
        Err(error) => Ok(error.to_string()),
    }
}

async fn add_user(
    c: &mut Management,
    name: &str,
    password: &str,
    tags: &[&str],
) -> anyhow::Result<m::User> {
    Ok(c.put_user(m::PutUserRequest {
        name: name.into(),
        password: Some(password.into()),
        tags: tags.iter().map(|t| t.to_string()).collect(),
        loopback_only: false,
    })
    .await?
    .into_inner())
}

async fn grant(
    c: &mut Management,
    user: &str,
    vhost: &str,
    [configure, write, read]: [&str; 3],
) -> anyhow::Result<()> {
    c.set_permissions(m::SetPermissionsRequest {
        user: user.into(),
        vhost: vhost.into(),
        configure: configure.into(),
        write: write.into(),
        read: read.into(),
    })
    .await?;
    Ok(())
}

/// RabbitMQ's words for a refused operation.
fn refused(kind: &str, name: &str, user: &str) -> String {
    format!("ACCESS_REFUSED - access to {kind} '{name}' in vhost '/' refused for user '{user}'")
}

async fn the_configured_guest_is_stored_as_administrator(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut c = sb.management().await?;
    let users = c
        .list_users(m::ListUsersRequest {})
        .await?
        .into_inner()
        .users;
    anyhow::ensure!(users.len() == 1, "{users:?}");
    let guest = &users[0];
    anyhow::ensure!(
        guest.name == "guest"
            && guest.tags == ["administrator"]
            && guest.loopback_only
            && guest.has_password,
        "{guest:?}"
    );
    let permissions = c
        .list_permissions(m::ListPermissionsRequest::default())
        .await?
        .into_inner()
        .permissions;
    anyhow::ensure!(
        permissions
            == [m::Permission {
                user: "guest".into(),
                vhost: "/".into(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            }],
        "{permissions:?}"
    );
    Ok(())
}

async fn a_limited_user_is_refused_outside_its_patterns(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut c = sb.management().await?;
    add_user(&mut c, "app", "app-secret", &[]).await?;
    grant(&mut c, "app", "/", ["^app\\.", "^app\\.", "^app\\."]).await?;
    // What the app may not touch, made by guest.
    let admin = sb.connect().await?;
    let ach = admin.create_channel().await?;
    declare(&ach, "other", false, FieldTable::default()).await?;
    ach.exchange_declare(
        s("other.events"),
        lapin::ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;

    let conn = connect_as(sb, "app", "app-secret", "/").await?;
    let ch = conn.create_channel().await?;
    // Its own names: declare, bind, publish, get.
    declare(&ch, "app.orders", false, FieldTable::default()).await?;
    ch.exchange_declare(
        s("app.events"),
        lapin::ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.queue_bind(
        s("app.orders"),
        s("app.events"),
        s(""),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    ch.basic_publish(
        s("app.events"),
        s(""),
        BasicPublishOptions::default(),
        b"mine",
        BasicProperties::default(),
    )
    .await?
    .await?;
    let got = eventually(WAIT, || async {
        ch.basic_get(s("app.orders"), BasicGetOptions { no_ack: true })
            .await
            .ok()
            .flatten()
    })
    .await?;
    anyhow::ensure!(got.delivery.data == b"mine");
    // A passive declare needs no permission.
    ch.queue_declare(
        s("other"),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;

    // Each refusal closes its channel with RabbitMQ's 403.
    let cases: [(&str, String); 6] = [
        ("declare", refused("queue", "other", "app")),
        ("consume", refused("queue", "other", "app")),
        ("get", refused("queue", "other", "app")),
        ("publish", refused("exchange", "other.events", "app")),
        (
            "default exchange",
            refused("exchange", "amq.default", "app"),
        ),
        ("bind from", refused("exchange", "other.events", "app")),
    ];
    for (what, expected) in cases {
        let ch = conn.create_channel().await?;
        let error = match what {
            "declare" => declare(&ch, "other", false, FieldTable::default())
                .await
                .err(),
            "consume" => ch
                .basic_consume(
                    s("other"),
                    s(""),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .err()
                .map(anyhow::Error::from),
            "get" => ch
                .basic_get(s("other"), BasicGetOptions::default())
                .await
                .err()
                .map(anyhow::Error::from),
            "publish" | "default exchange" => {
                let exchange = if what == "publish" {
                    "other.events"
                } else {
                    ""
                };
                ch.confirm_select(ConfirmSelectOptions::default()).await?;
                let published = ch
                    .basic_publish(
                        s(exchange),
                        s("app.orders"),
                        BasicPublishOptions::default(),
                        b"not mine",
                        BasicProperties::default(),
                    )
                    .await;
                match published {
                    Err(error) => Some(error.into()),
                    Ok(confirm) => confirm.await.err().map(anyhow::Error::from),
                }
            }
            _ => ch
                .queue_bind(
                    s("app.orders"),
                    s("other.events"),
                    s(""),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .err()
                .map(anyhow::Error::from),
        };
        let error = error
            .map(|e| e.to_string())
            .ok_or_else(|| anyhow::anyhow!("{what} was allowed"))?;
        anyhow::ensure!(error.contains(&expected), "{what}: {error}");
    }
    // Nothing of the refused publishes arrived.
    let other = ach
        .queue_declare(
            s("other"),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    anyhow::ensure!(other.message_count() == 0);
    conn.close(200, s("bye")).await?;
    admin.close(200, s("bye")).await?;
    Ok(())
}

async fn a_user_without_permissions_cannot_open_the_vhost(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut c = sb.management().await?;
    c.create_vhost(m::CreateVhostRequest { name: "ops".into() })
        .await?;
    add_user(&mut c, "ops-only", "pw", &[]).await?;
    grant(&mut c, "ops-only", "ops", [".*", ".*", ".*"]).await?;
    connect_as(sb, "ops-only", "pw", "ops")
        .await?
        .close(200, s("bye"))
        .await?;
    let error = refused_connection(sb, "ops-only", "pw", "/").await?;
    anyhow::ensure!(
        error.contains("NOT_ALLOWED - access to vhost '/' refused for user 'ops-only'"),
        "{error}"
    );
    // guest has no permissions in ops either.
    let error = refused_connection(sb, "guest", "guest", "ops").await?;
    anyhow::ensure!(
        error.contains("access to vhost 'ops' refused for user 'guest'"),
        "{error}"
    );
    Ok(())
}

async fn changes_reach_open_connections(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut c = sb.management().await?;
    add_user(&mut c, "app", "pw", &[]).await?;
    grant(&mut c, "app", "/", ["^app\\.", "", ""]).await?;
    let conn = connect_as(sb, "app", "pw", "/").await?;
    let ch = conn.create_channel().await?;
    declare(&ch, "app.one", false, FieldTable::default()).await?;
    // Widened while connected: the next declare sees it.
    grant(&mut c, "app", "/", [".*", "", ""]).await?;
    declare(&ch, "wider", false, FieldTable::default()).await?;
    // Cleared: refused, on a new channel of the same connection.
    c.clear_permissions(m::ClearPermissionsRequest {
        user: "app".into(),
        vhost: "/".into(),
    })
    .await?;
    let ch2 = conn.create_channel().await?;
    let error = declare(&ch2, "app.two", false, FieldTable::default())
        .await
        .err()
        .map(|e| e.to_string())
        .ok_or_else(|| anyhow::anyhow!("declared after the permissions were cleared"))?;
    anyhow::ensure!(
        error.contains(&refused("queue", "app.two", "app")),
        "{error}"
    );

    // Deleting the user closes their connections.
    let deleted = c
        .delete_user(m::DeleteUserRequest { name: "app".into() })
        .await?
        .into_inner();
    anyhow::ensure!(deleted.closed_connections == 1, "{deleted:?}");
    eventually(WAIT, || async {
        Some(()).filter(|()| !conn.status().connected())
    })
    .await?;
    let error = refused_connection(sb, "app", "pw", "/").await?;
    anyhow::ensure!(error.contains("Login was refused"), "{error}");
    Ok(())
}

async fn users_and_permissions_survive_a_restart(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut c = sb.management().await?;
    add_user(&mut c, "kept", "kept-pw", &["monitoring"]).await?;
    grant(&mut c, "kept", "/", ["^kept\\.", ".*", ".*"]).await?;
    add_user(&mut c, "gone", "gone-pw", &[]).await?;
    grant(&mut c, "gone", "/", [".*", ".*", ".*"]).await?;
    c.delete_user(m::DeleteUserRequest {
        name: "gone".into(),
    })
    .await?;
    // guest's password changed: the stored one counts, not the seed.
    c.put_user(m::PutUserRequest {
        name: "guest".into(),
        password: Some("changed".into()),
        tags: vec!["administrator".into()],
        loopback_only: true,
    })
    .await?;
    sb.restart().await?;

    let mut c = sb.management().await?;
    let users = c
        .list_users(m::ListUsersRequest {})
        .await?
        .into_inner()
        .users;
    let names: Vec<&str> = users.iter().map(|u| u.name.as_str()).collect();
    anyhow::ensure!(names == ["guest", "kept"], "{users:?}");
    anyhow::ensure!(users[1].tags == ["monitoring"], "{users:?}");
    let kept = connect_as(sb, "kept", "kept-pw", "/").await?;
    let ch = kept.create_channel().await?;
    declare(&ch, "kept.q", false, FieldTable::default()).await?;
    let error = declare(&ch, "elsewhere", false, FieldTable::default())
        .await
        .err()
        .map(|e| e.to_string())
        .ok_or_else(|| anyhow::anyhow!("the permission was lost in the restart"))?;
    anyhow::ensure!(
        error.contains(&refused("queue", "elsewhere", "kept")),
        "{error}"
    );
    kept.close(200, s("bye")).await?;
    for (user, password) in [("gone", "gone-pw"), ("kept", "wrong"), ("guest", "guest")] {
        let error = refused_connection(sb, user, password, "/").await?;
        anyhow::ensure!(error.contains("Login was refused"), "{user}: {error}");
    }
    connect_as(sb, "guest", "changed", "/")
        .await?
        .close(200, s("bye"))
        .await?;
    Ok(())
}

async fn spillctl_manages_users_and_permissions(sb: &mut Sandbox) -> anyhow::Result<()> {
    sb.spillctl(&[
        "user",
        "add",
        "ci",
        "first-pw",
        "--tags",
        "monitoring,management",
    ])?;
    sb.spillctl(&[
        "permissions",
        "set",
        "ci",
        "--configure",
        "^ci\\.",
        "--write",
        "^ci\\.",
        "--read",
        ".*",
    ])?;
    let users = sb.spillctl(&["user", "list"])?;
    anyhow::ensure!(
        users.contains("ci") && users.contains("monitoring,management"),
        "{users}"
    );
    anyhow::ensure!(!users.contains("first-pw"), "a password listed: {users}");
    let json = sb.spillctl(&["-o", "json", "permissions", "list", "ci"])?;
    let value: serde_json::Value = serde_json::from_str(&json)?;
    anyhow::ensure!(value["permissions"][0]["configure"] == "^ci\\.", "{json}");

    sb.spillctl(&["user", "passwd", "ci", "second-pw"])?;
    let error = refused_connection(sb, "ci", "first-pw", "/").await?;
    anyhow::ensure!(error.contains("Login was refused"), "{error}");
    connect_as(sb, "ci", "second-pw", "/")
        .await?
        .close(200, s("bye"))
        .await?;
    // The tags stayed through the password change.
    let json = sb.spillctl(&["-o", "json", "user", "list"])?;
    anyhow::ensure!(json.contains("management"), "{json}");

    sb.spillctl(&["permissions", "clear", "ci"])?;
    let error = refused_connection(sb, "ci", "second-pw", "/").await?;
    anyhow::ensure!(error.contains("NOT_ALLOWED"), "{error}");
    sb.spillctl(&["user", "delete", "ci"])?;
    let users = sb.spillctl(&["user", "list"])?;
    anyhow::ensure!(!users.contains("ci"), "{users}");
    Ok(())
}

/// A management call's refusal: its code and message.
fn denied<T: std::fmt::Debug>(
    result: Result<tonic::Response<T>, tonic::Status>,
) -> anyhow::Result<(tonic::Code, String)> {
    match result {
        Ok(answer) => anyhow::bail!("allowed: {answer:?}"),
        Err(status) => Ok((status.code(), status.message().to_string())),
    }
}

fn queue_request(vhost: &str, name: &str) -> m::CreateQueueRequest {
    m::CreateQueueRequest {
        vhost: vhost.into(),
        name: name.into(),
        ..Default::default()
    }
}

async fn management_follows_user_tags(sb: &mut Sandbox) -> anyhow::Result<()> {
    use tonic::Code;
    let mut admin = sb.management().await?;
    admin
        .create_vhost(m::CreateVhostRequest {
            name: "hidden".into(),
        })
        .await?;
    admin.create_queue(queue_request("/", "orders")).await?;
    add_user(&mut admin, "mon", "mon-pw", &["monitoring"]).await?;
    add_user(&mut admin, "app", "app-pw", &["management"]).await?;
    grant(&mut admin, "app", "/", ["^app\\.", "^app\\.", "^app\\."]).await?;
    add_user(&mut admin, "plain", "plain-pw", &[]).await?;
    grant(&mut admin, "plain", "/", [".*", ".*", ".*"]).await?;
    add_user(&mut admin, "boss", "boss-pw", &["administrator"]).await?;

    // Wrong passwords and unknown users read the same.
    for (user, password) in [("mon", "wrong"), ("nobody", "mon-pw")] {
        let mut c = sb.management_as(user, password).await?;
        let (code, message) = denied(c.list_vhosts(m::ListVhostsRequest {}).await)?;
        anyhow::ensure!(
            code == Code::Unauthenticated && message == "invalid user or password",
            "{user}: {code:?} {message}"
        );
    }

    // monitoring: sees every vhost and queue, changes nothing.
    let mut mon = sb.management_as("mon", "mon-pw").await?;
    let vhosts = mon.list_vhosts(m::ListVhostsRequest {}).await?.into_inner();
    anyhow::ensure!(vhosts.vhosts.len() == 2, "{vhosts:?}");
    let queues = mon
        .list_queues(m::ListQueuesRequest { vhost: "/".into() })
        .await?
        .into_inner();
    anyhow::ensure!(
        queues.queues.iter().any(|q| q.name == "orders"),
        "{queues:?}"
    );
    mon.list_queues(m::ListQueuesRequest {
        vhost: "hidden".into(),
    })
    .await?;
    mon.get_broker_status(m::GetBrokerStatusRequest {}).await?;
    mon.list_limits(m::ListLimitsRequest {}).await?;
    let (code, message) = denied(
        mon.delete_queue(m::DeleteQueueRequest {
            vhost: "/".into(),
            name: "orders".into(),
            ..Default::default()
        })
        .await,
    )?;
    anyhow::ensure!(
        code == Code::PermissionDenied && message.contains("refused for user 'mon'"),
        "{code:?} {message}"
    );
    for result in [
        denied(mon.list_users(m::ListUsersRequest {}).await)?,
        denied(
            mon.create_vhost(m::CreateVhostRequest {
                name: "mine".into(),
            })
            .await,
        )?,
    ] {
        anyhow::ensure!(
            result.0 == Code::PermissionDenied && result.1.contains("not an administrator"),
            "{result:?}"
        );
    }

    // management: its own vhost, within its patterns.
    let mut app = sb.management_as("app", "app-pw").await?;
    let vhosts = app.list_vhosts(m::ListVhostsRequest {}).await?.into_inner();
    let names: Vec<&str> = vhosts.vhosts.iter().map(|v| v.name.as_str()).collect();
    anyhow::ensure!(names == ["/"], "{names:?}");
    let (code, _) = denied(
        app.list_queues(m::ListQueuesRequest {
            vhost: "hidden".into(),
        })
        .await,
    )?;
    anyhow::ensure!(code == Code::PermissionDenied, "{code:?}");
    app.create_queue(queue_request("/", "app.jobs")).await?;
    let (code, message) = denied(app.create_queue(queue_request("/", "other")).await)?;
    anyhow::ensure!(
        code == Code::PermissionDenied
            && message
                == "ACCESS_REFUSED - configure access to queue 'other' in vhost '/' refused for user 'app'",
        "{code:?} {message}"
    );
    let (code, _) = denied(
        app.purge_queue(m::PurgeQueueRequest {
            vhost: "/".into(),
            name: "orders".into(),
        })
        .await,
    )?;
    anyhow::ensure!(code == Code::PermissionDenied, "{code:?}");
    let (code, _) = denied(
        app.update_queue(m::UpdateQueueRequest {
            vhost: "/".into(),
            name: "app.jobs".into(),
            capacity: Some(10),
            ..Default::default()
        })
        .await,
    )?;
    anyhow::ensure!(code == Code::PermissionDenied, "{code:?}");
    app.delete_queue(m::DeleteQueueRequest {
        vhost: "/".into(),
        name: "app.jobs".into(),
        ..Default::default()
    })
    .await?;

    // No management tag: no management at all, whatever its permissions.
    let mut plain = sb.management_as("plain", "plain-pw").await?;
    let (code, message) = denied(plain.list_vhosts(m::ListVhostsRequest {}).await)?;
    anyhow::ensure!(
        code == Code::PermissionDenied && message.contains("none of the tags"),
        "{code:?} {message}"
    );

    // administrator: everything.
    let mut boss = sb.management_as("boss", "boss-pw").await?;
    boss.list_users(m::ListUsersRequest {}).await?;
    boss.delete_vhost(m::DeleteVhostRequest {
        name: "hidden".into(),
    })
    .await?;

    // spillctl with a stored user's password says why it was refused.
    let output = std::process::Command::new(spillctl_bin()?)
        .args(["--addr", &sb.management_addr().to_string()])
        .args([
            "--user",
            "mon",
            "--password",
            "mon-pw",
            "queue",
            "delete",
            "orders",
        ])
        .env_remove("SPILLCTL_TOKEN")
        .output()?;
    let stderr = String::from_utf8(output.stderr)?;
    anyhow::ensure!(
        !output.status.success() && stderr.contains("PermissionDenied"),
        "{stderr}"
    );
    let output = std::process::Command::new(spillctl_bin()?)
        .args(["--addr", &sb.management_addr().to_string()])
        .args(["--user", "mon", "--password", "mon-pw", "queue", "list"])
        .env_remove("SPILLCTL_TOKEN")
        .output()?;
    let stdout = String::from_utf8(output.stdout)?;
    anyhow::ensure!(
        output.status.success() && stdout.contains("orders"),
        "{stdout}"
    );
    Ok(())
}
