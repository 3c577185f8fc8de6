//! The holes a hostile user with permissions `^app\.` found,
//! closed as RabbitMQ closes them, in both wirings:
//! - a dead-letter exchange needs write on it (and read on the queue): the
//!   default exchange, `amq.direct` or another user's exchange are refused
//!   with 403, over AMQP and through management's `CreateQueue`;
//! - `x-qpid-dlq-enabled` needs configure on `<queue>_DLE` and
//!   `<queue>_DLQ`, never binds another connection's exclusive queue (405),
//!   and counts the queue it creates in the vhost's queue limit;
//! - an `alternate-exchange` needs write on it;
//! - management may not peek into or move from an exclusive queue (405
//!   RESOURCE_LOCKED, a failed precondition over gRPC);
//! - deleting the stored guest removes it from management too (no second,
//!   configured guest is checked first), and a store that had users is
//!   never seeded with the configuration's users again;
//! - a password guesser is slowed, over AMQP and management: after
//!   `FREE_LOGIN_FAILURES` refusals in a row from one address, its attempts
//!   take turns one a second, and the right password still gets in; a
//!   guesser that logs in with an account of its own between guesses (over
//!   AMQP 0-9-1, 1.0 or management) is slowed all the same.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use spillway_integration_tests::amqp::{amqp_code, declare, get, message_count, s, table, text};
use spillway_integration_tests::{both_wirings, publish, Management, Sandbox};
use spillway_proto::management as m;

both_wirings!(
    timeout_secs = 90;
    dead_letter_exchanges_need_write_permission,
    qpid_dead_letter_queues_need_configure_and_respect_exclusivity_and_limits,
    alternate_exchanges_need_write_permission,
    management_cannot_peek_or_move_an_exclusive_queue,
    a_password_guesser_is_slowed_and_the_user_still_gets_in,
    a_guessers_own_logins_do_not_reset_its_throttle,
    deleting_the_stored_guest_removes_it_from_management_too,
);

/// RabbitMQ's words for a refused operation.
fn refused(kind: &str, name: &str, user: &str) -> String {
    format!("ACCESS_REFUSED - access to {kind} '{name}' in vhost '/' refused for user '{user}'")
}

/// A user `name` (password `name-pw`) with the `management` tag and these
/// configure/write/read patterns in `/`.
async fn limited_user(
    admin: &mut Management,
    name: &str,
    [configure, write, read]: [&str; 3],
) -> anyhow::Result<()> {
    admin
        .put_user(m::PutUserRequest {
            name: name.into(),
            password: Some(format!("{name}-pw")),
            tags: vec!["management".into()],
            loopback_only: false,
        })
        .await?;
    admin
        .set_permissions(m::SetPermissionsRequest {
            user: name.into(),
            vhost: "/".into(),
            configure: configure.into(),
            write: write.into(),
            read: read.into(),
        })
        .await?;
    Ok(())
}

async fn connect_as(sb: &Sandbox, user: &str) -> anyhow::Result<Connection> {
    Ok(Connection::connect(
        &format!("amqp://{user}:{user}-pw@{}/%2f", sb.amqp_addr()),
        ConnectionProperties::default(),
    )
    .await?)
}

/// Declares `queue` with `arguments` on a fresh channel and expects the
/// refusal `code` with `text` (the channel is closed by it).
async fn declare_refused(
    conn: &Connection,
    queue: &str,
    arguments: FieldTable,
    code: u16,
    text: &str,
) -> anyhow::Result<()> {
    let ch = conn.create_channel().await?;
    let error = ch
        .queue_declare(s(queue), QueueDeclareOptions::default(), arguments)
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("declaring {queue} was accepted"))?;
    anyhow::ensure!(amqp_code(&error) == Some(code), "{queue}: {error}");
    anyhow::ensure!(error.to_string().contains(text), "{queue}: {error}");
    Ok(())
}

fn dead_letter_to(exchange: &str, routing_key: Option<&str>) -> FieldTable {
    let mut entries = vec![("x-dead-letter-exchange", text(exchange))];
    if let Some(key) = routing_key {
        entries.push(("x-dead-letter-routing-key", text(key)));
    }
    table(&entries)
}

/// What the hostile user tried: dead-lettering its own messages into a
/// queue it may not touch, through the default exchange, `amq.direct` or
/// another user's exchange. Each declare is refused with 403 naming the
/// exchange, so nothing can reach `secret`; a dead-letter exchange of its
/// own works as before.
async fn dead_letter_exchanges_need_write_permission(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut admin = sb.management().await?;
    limited_user(&mut admin, "app", ["^app\\.", "^app\\.", "^app\\."]).await?;
    let owner = sb.connect().await?;
    let och = owner.create_channel().await?;
    declare(&och, "secret", false, FieldTable::default()).await?;
    och.queue_bind(
        s("secret"),
        s("amq.direct"),
        s("secret"),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    och.exchange_declare(
        s("other.events"),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;

    let conn = connect_as(sb, "app").await?;
    for (exchange, refused_as) in [
        ("", "amq.default"),
        ("amq.direct", "amq.direct"),
        ("other.events", "other.events"),
    ] {
        declare_refused(
            &conn,
            "app.q",
            dead_letter_to(exchange, Some("secret")),
            403,
            &refused("exchange", refused_as, "app"),
        )
        .await?;
    }
    // Read on the queue is needed too (RabbitMQ's rule).
    limited_user(&mut admin, "writer", ["^app\\.", "^app\\.", "^$"]).await?;
    let writer = connect_as(sb, "writer").await?;
    declare_refused(
        &writer,
        "app.w",
        dead_letter_to("app.dlx", None),
        403,
        &refused("queue", "app.w", "writer"),
    )
    .await?;
    writer.close(200, s("bye")).await?;

    // The same through management.
    let mut app = sb.management_as("app", "app-pw").await?;
    let arguments = [(
        "x-dead-letter-exchange".to_string(),
        m::ArgumentValue {
            value: Some(m::argument_value::Value::StringValue(String::new())),
        },
    )]
    .into_iter()
    .collect();
    let status = app
        .create_queue(m::CreateQueueRequest {
            vhost: "/".into(),
            name: "app.m".into(),
            arguments,
            ..Default::default()
        })
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("management created app.m"))?;
    anyhow::ensure!(
        status.code() == tonic::Code::PermissionDenied
            && status.message().contains(
                "write access to exchange 'amq.default' in vhost '/' refused for user 'app'"
            ),
        "{status:?}"
    );

    // Its own dead-letter exchange is allowed, and dead letters arrive.
    let ch = conn.create_channel().await?;
    ch.exchange_declare(
        s("app.dlx"),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    declare(&ch, "app.dead", false, FieldTable::default()).await?;
    ch.queue_bind(
        s("app.dead"),
        s("app.dlx"),
        s(""),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    declare(&ch, "app.q", false, dead_letter_to("app.dlx", None)).await?;
    // In through its own exchange: the default one is not the user's.
    ch.exchange_declare(
        s("app.in"),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.queue_bind(
        s("app.q"),
        s("app.in"),
        s(""),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    publish(&ch, "app.in", "", b"rejected", BasicProperties::default()).await?;
    let taken = get(&ch, "app.q").await?;
    taken
        .delivery
        .reject(BasicRejectOptions { requeue: false })
        .await?;
    let dead = get(&ch, "app.dead").await?;
    anyhow::ensure!(dead.delivery.data == b"rejected");
    anyhow::ensure!(message_count(&och, "secret").await? == 0);
    conn.close(200, s("bye")).await?;
    owner.close(200, s("bye")).await?;
    Ok(())
}

/// Qpid's DLQ declares `<queue>_DLE` and `<queue>_DLQ` for its declarer:
/// configure on both is needed; an existing `<queue>_DLQ` that is another
/// connection's exclusive queue is refused (405); and the DLQ counts in the
/// vhost's `max-queues`.
async fn qpid_dead_letter_queues_need_configure_and_respect_exclusivity_and_limits(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let qpid_dlq = || table(&[("x-qpid-dlq-enabled", AMQPValue::Boolean(true))]);
    let mut admin = sb.management().await?;
    limited_user(
        &mut admin,
        "narrow",
        ["^app\\.orders$", "^app\\.", "^app\\."],
    )
    .await?;
    let narrow = connect_as(sb, "narrow").await?;
    declare_refused(
        &narrow,
        "app.orders",
        qpid_dlq(),
        403,
        &refused("exchange", "app.orders_DLE", "narrow"),
    )
    .await?;
    narrow.close(200, s("bye")).await?;

    // Another connection's exclusive queue under the DLQ's name.
    let squatter = sb.connect().await?;
    let sch = squatter.create_channel().await?;
    sch.queue_declare(
        s("jobs_DLQ"),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    let conn = sb.connect().await?;
    declare_refused(&conn, "jobs", qpid_dlq(), 405, "jobs_DLQ").await?;

    // max-queues: one short of room for the queue and its DLQ.
    let existing = admin
        .list_queues(m::ListQueuesRequest { vhost: "/".into() })
        .await?
        .into_inner()
        .queues
        .len() as i64;
    admin
        .set_limits(m::SetLimitsRequest {
            vhost: "/".into(),
            max_queues: Some(existing + 1),
            ..Default::default()
        })
        .await?;
    declare_refused(&conn, "tasks", qpid_dlq(), 406, "queue limit").await?;
    admin
        .set_limits(m::SetLimitsRequest {
            vhost: "/".into(),
            max_queues: Some(existing + 2),
            ..Default::default()
        })
        .await?;
    let ch: Channel = conn.create_channel().await?;
    declare(&ch, "tasks", false, qpid_dlq()).await?;
    anyhow::ensure!(message_count(&ch, "tasks_DLQ").await? == 0);
    conn.close(200, s("bye")).await?;
    squatter.close(200, s("bye")).await?;
    Ok(())
}

/// `alternate-exchange` needs write on the alternate exchange (and read on
/// the one declared), over AMQP and through management.
async fn alternate_exchanges_need_write_permission(sb: &mut Sandbox) -> anyhow::Result<()> {
    let mut admin = sb.management().await?;
    limited_user(&mut admin, "app", ["^app\\.", "^app\\.", "^app\\."]).await?;
    let owner = sb.connect().await?;
    let och = owner.create_channel().await?;
    och.exchange_declare(
        s("other.events"),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let conn = connect_as(sb, "app").await?;
    let ch = conn.create_channel().await?;
    let error = ch
        .exchange_declare(
            s("app.x"),
            ExchangeKind::Topic,
            ExchangeDeclareOptions::default(),
            table(&[("alternate-exchange", text("other.events"))]),
        )
        .await
        .unwrap_err();
    anyhow::ensure!(amqp_code(&error) == Some(403), "{error}");
    anyhow::ensure!(
        error
            .to_string()
            .contains(&refused("exchange", "other.events", "app")),
        "{error}"
    );

    let mut app = sb.management_as("app", "app-pw").await?;
    let status = app
        .create_exchange(m::CreateExchangeRequest {
            vhost: "/".into(),
            name: "app.y".into(),
            kind: "topic".into(),
            arguments: [(
                "alternate-exchange".to_string(),
                m::ArgumentValue {
                    value: Some(m::argument_value::Value::StringValue("other.events".into())),
                },
            )]
            .into_iter()
            .collect(),
            ..Default::default()
        })
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("management created app.y"))?;
    anyhow::ensure!(status.code() == tonic::Code::PermissionDenied, "{status:?}");

    let ch = conn.create_channel().await?;
    ch.exchange_declare(
        s("app.x"),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        table(&[("alternate-exchange", text("app.ae"))]),
    )
    .await?;
    conn.close(200, s("bye")).await?;
    owner.close(200, s("bye")).await?;
    Ok(())
}

/// An exclusive queue is its connection's: management's peek and move are
/// refused (RabbitMQ's 405 RESOURCE_LOCKED), the messages stay.
async fn management_cannot_peek_or_move_an_exclusive_queue(sb: &mut Sandbox) -> anyhow::Result<()> {
    let owner = sb.connect().await?;
    let ch = owner.create_channel().await?;
    ch.queue_declare(
        s("private"),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    declare(&ch, "public", false, FieldTable::default()).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    publish(&ch, "", "private", b"mine", BasicProperties::default()).await?;

    let mut admin = sb.management().await?;
    let peek = admin
        .peek_messages(m::PeekMessagesRequest {
            vhost: "/".into(),
            queue: "private".into(),
            count: 1,
        })
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("peeked into an exclusive queue"))?;
    let moved = admin
        .move_messages(m::MoveMessagesRequest {
            vhost: "/".into(),
            source: "private".into(),
            destination: "public".into(),
            max_messages: 0,
        })
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("moved from an exclusive queue"))?;
    for status in [peek, moved] {
        anyhow::ensure!(
            status.code() == tonic::Code::FailedPrecondition
                && status.message().contains("RESOURCE_LOCKED"),
            "{status:?}"
        );
    }
    anyhow::ensure!(message_count(&ch, "private").await? == 1);
    anyhow::ensure!(message_count(&ch, "public").await? == 0);
    owner.close(200, s("bye")).await?;
    Ok(())
}

/// Ten wrong passwords go at full speed; then three guesses made at once
/// take turns a second apart, and the right password, after its turn, gets
/// in. The same for management's basic credentials.
async fn a_password_guesser_is_slowed_and_the_user_still_gets_in(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    use spillway_telemetry::{FREE_LOGIN_FAILURES, THROTTLED_LOGIN_INTERVAL};
    let addr = sb.amqp_addr();
    let guess = |password: &str| {
        let uri = format!("amqp://guest:{password}@{addr}/%2f");
        async move { Connection::connect(&uri, ConnectionProperties::default()).await }
    };
    for n in 0..FREE_LOGIN_FAILURES {
        anyhow::ensure!(guess(&format!("wrong-{n}")).await.is_err());
    }
    let started = Instant::now();
    let (a, b, c) = tokio::join!(guess("wrong-a"), guess("wrong-b"), guess("wrong-c"));
    anyhow::ensure!(a.is_err() && b.is_err() && c.is_err());
    let took = started.elapsed();
    anyhow::ensure!(
        took >= THROTTLED_LOGIN_INTERVAL * 2 - Duration::from_millis(50),
        "three throttled guesses took {took:?}"
    );
    let conn = guess("guest").await?;
    conn.close(200, s("bye")).await?;

    let mut admin = sb.management().await?;
    limited_user(&mut admin, "ops", [".*", ".*", ".*"]).await?;
    for n in 0..FREE_LOGIN_FAILURES {
        let mut wrong = sb.management_as("ops", &format!("wrong-{n}")).await?;
        anyhow::ensure!(wrong
            .list_vhosts(m::ListVhostsRequest {})
            .await
            .is_err_and(|status| status.code() == tonic::Code::Unauthenticated));
    }
    let mut wrong = sb.management_as("ops", "wrong").await?;
    let started = Instant::now();
    for _ in 0..3 {
        anyhow::ensure!(wrong.list_vhosts(m::ListVhostsRequest {}).await.is_err());
    }
    let took = started.elapsed();
    anyhow::ensure!(
        took >= THROTTLED_LOGIN_INTERVAL * 2 - Duration::from_millis(50),
        "three throttled management calls took {took:?}"
    );
    let mut right = sb.management_as("ops", "ops-pw").await?;
    right.list_vhosts(m::ListVhostsRequest {}).await?;
    Ok(())
}

/// A guesser holding an account of its own (no tags, so no management
/// rights) logs in with it after nine wrong guesses at another user's
/// password, over AMQP 0-9-1, AMQP 1.0 and management: its own success
/// forgives only its own failures, so the tenth guess still starts the
/// throttle and three more take turns a second apart.
async fn a_guessers_own_logins_do_not_reset_its_throttle(sb: &mut Sandbox) -> anyhow::Result<()> {
    use spillway_telemetry::{FREE_LOGIN_FAILURES, THROTTLED_LOGIN_INTERVAL};
    let mut admin = sb.management().await?;
    admin
        .put_user(m::PutUserRequest {
            name: "mallory".into(),
            password: Some("mallory-pw".into()),
            tags: vec![],
            loopback_only: false,
        })
        .await?;
    admin
        .set_permissions(m::SetPermissionsRequest {
            user: "mallory".into(),
            vhost: "/".into(),
            configure: "^mallory\\.".into(),
            write: "^mallory\\.".into(),
            read: "^mallory\\.".into(),
        })
        .await?;
    let addr = sb.amqp_addr();
    let login = |user: &str, password: &str| {
        let uri = format!("amqp://{user}:{password}@{addr}/%2f");
        async move { Connection::connect(&uri, ConnectionProperties::default()).await }
    };
    let amqp1_login = || async move {
        fe2o3_amqp::Connection::builder()
            .container_id("mallory-1.0")
            .hostname("vhost:/")
            .sasl_profile(fe2o3_amqp::sasl_profile::SaslProfile::Plain {
                username: "mallory".into(),
                password: "mallory-pw".into(),
            })
            .open(format!("amqp://{addr}").as_str())
            .await
    };
    // Over AMQP: nine guesses, its own 0-9-1 login, nine more, its own 1.0
    // login, one more: nineteen failures, two successes of someone else.
    for n in 0..FREE_LOGIN_FAILURES - 1 {
        anyhow::ensure!(login("guest", &format!("wrong-{n}")).await.is_err());
    }
    login("mallory", "mallory-pw")
        .await?
        .close(200, s("bye"))
        .await?;
    for n in 0..FREE_LOGIN_FAILURES - 1 {
        anyhow::ensure!(login("guest", &format!("again-{n}")).await.is_err());
    }
    amqp1_login().await?.close().await?;
    anyhow::ensure!(login("guest", "one-more").await.is_err());
    let started = Instant::now();
    let (a, b, c) = tokio::join!(
        login("guest", "wrong-a"),
        login("guest", "wrong-b"),
        login("guest", "wrong-c")
    );
    anyhow::ensure!(a.is_err() && b.is_err() && c.is_err());
    let took = started.elapsed();
    anyhow::ensure!(
        took >= THROTTLED_LOGIN_INTERVAL * 2 - Duration::from_millis(50),
        "three guesses after the guesser's own logins took {took:?}: its logins forgave its guesses"
    );

    // Over management: a call of its own (authenticated, then refused for
    // want of tags) between the guesses forgives nothing either.
    let mut own = sb.management_as("mallory", "mallory-pw").await?;
    let mut wrong = sb.management_as("guest", "wrong").await?;
    for _ in 0..FREE_LOGIN_FAILURES - 1 {
        anyhow::ensure!(wrong
            .list_vhosts(m::ListVhostsRequest {})
            .await
            .is_err_and(|status| status.code() == tonic::Code::Unauthenticated));
    }
    anyhow::ensure!(own
        .list_vhosts(m::ListVhostsRequest {})
        .await
        .is_err_and(|status| status.code() == tonic::Code::PermissionDenied));
    anyhow::ensure!(wrong.list_vhosts(m::ListVhostsRequest {}).await.is_err());
    let started = Instant::now();
    for _ in 0..3 {
        anyhow::ensure!(wrong.list_vhosts(m::ListVhostsRequest {}).await.is_err());
    }
    let took = started.elapsed();
    anyhow::ensure!(
        took >= THROTTLED_LOGIN_INTERVAL * 2 - Duration::from_millis(50),
        "three management guesses after the guesser's own call took {took:?}"
    );
    Ok(())
}

/// The stored guest is management's default login; deleted, it is gone
/// from management as from AMQP, as a RabbitMQ operator expects.
async fn deleting_the_stored_guest_removes_it_from_management_too(
    sb: &mut Sandbox,
) -> anyhow::Result<()> {
    let mut guest = sb.management_as("guest", "guest").await?;
    guest.list_vhosts(m::ListVhostsRequest {}).await?;
    let mut admin = sb.management().await?;
    admin
        .delete_user(m::DeleteUserRequest {
            name: "guest".into(),
        })
        .await?;
    let status = guest
        .list_vhosts(m::ListVhostsRequest {})
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("the deleted guest still uses management"))?;
    anyhow::ensure!(status.code() == tonic::Code::Unauthenticated, "{status:?}");
    anyhow::ensure!(
        sb.connect().await.is_err(),
        "the deleted guest still connects"
    );
    // A store that had users is never seeded again: the configuration's
    // guest does not come back with a restart.
    sb.restart().await?;
    let mut admin = sb.management().await?;
    let users = admin
        .list_users(m::ListUsersRequest {})
        .await?
        .into_inner()
        .users;
    anyhow::ensure!(users.is_empty(), "seeded again: {users:?}");
    anyhow::ensure!(sb.connect().await.is_err(), "guest is back after a restart");
    Ok(())
}
