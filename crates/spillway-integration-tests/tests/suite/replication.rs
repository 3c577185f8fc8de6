//! A storage group of three: a confirm means a majority has the message on
//! disk, so it survives losing the leader, and without a majority nothing
//! is confirmed (`docs/replication.md`). Separate processes on loopback;
//! the engine is killed and restarted at the end of each case, so that what
//! is consumed comes from the group's disks, not the engine's memory.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, PublisherConfirm};
use spillway_integration_tests::group::GroupSandbox;

const QUEUE: &str = "replicated";

async fn durable_confirming_channel(conn: &lapin::Connection) -> anyhow::Result<Channel> {
    let channel = conn.create_channel().await?;
    channel
        .queue_declare(
            QUEUE.into(),
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
    Ok(channel)
}

/// Publishes persistent message `seq` (its body is the number) to the
/// queue; the confirm to come.
async fn publish_persistent(channel: &Channel, seq: u64) -> anyhow::Result<PublisherConfirm> {
    Ok(channel
        .basic_publish(
            "".into(),
            QUEUE.into(),
            BasicPublishOptions::default(),
            &seq.to_be_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await?)
}

/// Publishes persistent messages numbered `from..to` and waits for every
/// confirm (each must be an ack).
async fn publish_confirmed(channel: &Channel, from: u64, to: u64) -> anyhow::Result<()> {
    let mut confirms = Vec::new();
    for seq in from..to {
        confirms.push(publish_persistent(channel, seq).await?);
    }
    for (seq, confirm) in (from..to).zip(confirms) {
        let confirmation = tokio::time::timeout(Duration::from_secs(60), confirm)
            .await
            .with_context(|| format!("message {seq} not confirmed within 60 s"))??;
        anyhow::ensure!(confirmation.is_ack(), "message {seq} nacked");
    }
    Ok(())
}

/// Publishes persistent message `seq` and checks that no confirm comes
/// within `quiet` (`why`: what an answer would mean); returns the confirm
/// still to come.
async fn publish_unanswered(
    channel: &Channel,
    seq: u64,
    quiet: Duration,
    why: &str,
) -> anyhow::Result<std::pin::Pin<Box<PublisherConfirm>>> {
    let mut pending = Box::pin(publish_persistent(channel, seq).await?);
    let early = tokio::time::timeout(quiet, &mut pending).await;
    anyhow::ensure!(early.is_err(), "a message was answered ({early:?}) {why}");
    Ok(pending)
}

/// Consumes (and acks) until every message 0..expected came back; how
/// many came twice.
async fn consume_every_one(conn: &lapin::Connection, expected: u64) -> anyhow::Result<u64> {
    let channel = conn.create_channel().await?;
    let mut consumer = channel
        .basic_consume(
            QUEUE.into(),
            "check".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut seen = BTreeSet::new();
    let mut duplicates = 0;
    while (seen.len() as u64) < expected {
        let delivery = tokio::time::timeout(Duration::from_secs(60), consumer.next())
            .await
            .with_context(|| format!("only {} of {expected} messages came back", seen.len()))?
            .context("the consumer ended")??;
        let seq = u64::from_be_bytes(
            delivery
                .data
                .as_slice()
                .try_into()
                .context("a body that is not a sequence number")?,
        );
        if !seen.insert(seq) {
            duplicates += 1;
        }
        delivery.ack(BasicAckOptions::default()).await?;
    }
    anyhow::ensure!(
        seen == (0..expected).collect(),
        "the messages back are not 0..{expected}"
    );
    // Closed here, not dropped: lapin closes a dropped channel in the
    // background, and a connection closed meanwhile fails with "invalid
    // channel state: Closing".
    channel.close(200, "done".into()).await?;
    Ok(duplicates)
}

/// Every confirmed message once, none twice, and nothing more.
async fn consume_all(group: &GroupSandbox, expected: u64) -> anyhow::Result<()> {
    let conn = group.connect().await?;
    let duplicates = consume_every_one(&conn, expected).await?;
    anyhow::ensure!(duplicates == 0, "{duplicates} messages delivered twice");
    let getter = conn.create_channel().await?;
    let extra = getter
        .basic_get(QUEUE.into(), BasicGetOptions { no_ack: true })
        .await?;
    anyhow::ensure!(extra.is_none(), "a message more than was published");
    conn.close(200, "bye".into()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_messages_survive_the_storage_leader_dying() -> anyhow::Result<()> {
    let mut group = GroupSandbox::start(3).await?;
    let result = leader_dies(&mut group).await;
    result.with_context(|| group.logs())
}

async fn leader_dies(group: &mut GroupSandbox) -> anyhow::Result<()> {
    let conn = group.connect().await?;
    let channel = durable_confirming_channel(&conn).await?;
    publish_confirmed(&channel, 0, 100).await?;
    let leader = group.leader().await?;
    group.kill_member(leader).await?;
    // Confirms wait for the new leader; none is lost on the way.
    publish_confirmed(&channel, 100, 200).await?;
    let new_leader = group.leader().await?;
    anyhow::ensure!(new_leader != leader, "the dead member still leads");
    drop(channel);
    conn.close(200, "bye".into()).await.ok();
    // The old leader comes back and catches up.
    group.start_member(leader).await?;
    let committed = group.status_of(new_leader).await?.committed_index;
    group.wait_applied(leader, committed).await?;
    // What a new engine finds in the group is every confirmed message.
    group.kill_and_restart_engine().await?;
    consume_all(group, 200).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_majority_nothing_is_confirmed_until_a_member_returns() -> anyhow::Result<()> {
    let mut group = GroupSandbox::start(3).await?;
    let result = majority_lost(&mut group).await;
    result.with_context(|| group.logs())
}

async fn majority_lost(group: &mut GroupSandbox) -> anyhow::Result<()> {
    let conn = group.connect().await?;
    let channel = durable_confirming_channel(&conn).await?;
    publish_confirmed(&channel, 0, 10).await?;
    let leader = group.leader().await?;
    let follower = (1..=3).find(|id| *id != leader).context("no follower")?;
    group.kill_member(leader).await?;
    group.kill_member(follower).await?;
    // One member of three cannot commit: no confirm may come.
    let pending = publish_unanswered(
        &channel,
        10,
        Duration::from_secs(3),
        "with two of three members down",
    )
    .await?;
    group.start_member(follower).await?;
    let confirmation = tokio::time::timeout(Duration::from_secs(60), pending)
        .await
        .context("not confirmed within 60 s of a majority returning")??;
    anyhow::ensure!(confirmation.is_ack(), "nacked once a majority returned");
    drop(channel);
    conn.close(200, "bye".into()).await.ok();
    group.start_member(leader).await?;
    group.kill_and_restart_engine().await?;
    consume_all(group, 11).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_lost_its_disk_catches_up_from_a_snapshot() -> anyhow::Result<()> {
    // Snapshots every 20 entries, so that the log no longer holds the
    // start of the history the wiped member needs.
    let mut group =
        GroupSandbox::start_with(3, &[("SPILLWAY_STORAGE__GROUP_SNAPSHOT_ENTRIES", "20")]).await?;
    let result = disk_lost(&mut group).await;
    result.with_context(|| group.logs())
}

async fn disk_lost(group: &mut GroupSandbox) -> anyhow::Result<()> {
    let conn = group.connect().await?;
    let channel = durable_confirming_channel(&conn).await?;
    let leader = group.leader().await?;
    let follower = (1..=3).find(|id| *id != leader).context("no follower")?;
    group.kill_member(follower).await?;
    group.wipe_member(follower)?;
    // One confirm at a time: one log entry each, well past two snapshots.
    for seq in 0..60 {
        publish_confirmed(&channel, seq, seq + 1).await?;
    }
    group.start_member(follower).await?;
    let committed = group.status_of(leader).await?.committed_index;
    group.wait_applied(follower, committed).await?;
    // The rejoined member can carry the group: the other follower goes.
    let other = (1..=3)
        .find(|id| *id != leader && *id != follower)
        .context("no third member")?;
    group.kill_member(other).await?;
    publish_confirmed(&channel, 60, 70).await?;
    drop(channel);
    conn.close(200, "bye".into()).await.ok();
    group.kill_and_restart_engine().await?;
    consume_all(group, 70).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_lost_its_disk_while_in_step_rejoins_and_carries_the_group(
) -> anyhow::Result<()> {
    // The leader had replicated to the member up to the end of its log and
    // purged only part of it: the member's restart reverts a log the leader
    // counted as matching. It used to make the leader send entries after a
    // purged hole, and the member died applying them.
    let mut group =
        GroupSandbox::start_with(3, &[("SPILLWAY_STORAGE__GROUP_SNAPSHOT_ENTRIES", "20")]).await?;
    let result = disk_lost_in_step(&mut group).await;
    result.with_context(|| group.logs())
}

async fn disk_lost_in_step(group: &mut GroupSandbox) -> anyhow::Result<()> {
    let conn = group.connect().await?;
    let channel = durable_confirming_channel(&conn).await?;
    for seq in 0..60 {
        publish_confirmed(&channel, seq, seq + 1).await?;
    }
    let leader = group.leader().await?;
    let follower = (1..=3).find(|id| *id != leader).context("no follower")?;
    let committed = group.status_of(leader).await?.committed_index;
    group.wait_applied(follower, committed).await?;
    group.kill_member(follower).await?;
    group.wipe_member(follower)?;
    group.start_member(follower).await?;
    publish_confirmed(&channel, 60, 80).await?;
    let committed = group.status_of(leader).await?.committed_index;
    group.wait_applied(follower, committed).await?;
    let other = (1..=3)
        .find(|id| *id != leader && *id != follower)
        .context("no third member")?;
    group.kill_member(other).await?;
    publish_confirmed(&channel, 80, 90).await?;
    drop(channel);
    conn.close(200, "bye".into()).await.ok();
    group.kill_and_restart_engine().await?;
    consume_all(group, 90).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_lost_its_disk_gives_no_vote_until_it_has_caught_up() -> anyhow::Result<()> {
    let mut group = GroupSandbox::start(3).await?;
    let result = no_vote_while_empty(&mut group).await;
    result.with_context(|| group.logs())
}

async fn no_vote_while_empty(group: &mut GroupSandbox) -> anyhow::Result<()> {
    let conn = group.connect().await?;
    let channel = durable_confirming_channel(&conn).await?;
    publish_confirmed(&channel, 0, 20).await?;
    let leader = group.leader().await?;
    // Every member holds the log first: a member that never received any
    // of it could not tell the group ran (docs/replication.md).
    let committed = group.status_of(leader).await?.committed_index;
    for id in 1..=3 {
        group.wait_applied(id, committed).await?;
    }
    let wiped = (1..=3).find(|id| *id != leader).context("no follower")?;
    let other = (1..=3)
        .find(|id| *id != leader && *id != wiped)
        .context("no third member")?;
    group.kill_member(wiped).await?;
    group.wipe_member(wiped)?;
    group.kill_member(leader).await?;
    group.start_member(wiped).await?;
    // The remaining member and the empty one are two of three, but the
    // empty one may have held the only other copy of what was committed:
    // they must not elect a leader, so nothing is confirmed.
    let pending = publish_unanswered(
        &channel,
        20,
        Duration::from_secs(4),
        "by a group whose only voters are one member and an empty one",
    )
    .await?;
    for id in [wiped, other] {
        let status = group.status_of(id).await?;
        anyhow::ensure!(
            status.leader != wiped && status.leader != other,
            "member {id} names {} leader without the member that holds the log",
            status.leader
        );
    }
    // The old leader returns: the group leads again, the empty member
    // catches up, and everything confirmed is there.
    group.start_member(leader).await?;
    let confirmation = tokio::time::timeout(Duration::from_secs(60), pending)
        .await
        .context("not confirmed within 60 s of the old leader returning")??;
    anyhow::ensure!(confirmation.is_ack(), "nacked once the group had a leader");
    let new_leader = group.leader().await?;
    let committed = group.status_of(new_leader).await?.committed_index;
    group.wait_applied(wiped, committed).await?;
    drop(channel);
    conn.close(200, "bye".into()).await.ok();
    group.kill_and_restart_engine().await?;
    consume_all(group, 21).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_started_empty_votes_for_one_that_holds_what_the_leader_held(
) -> anyhow::Result<()> {
    let mut group = GroupSandbox::start(3).await?;
    let result = empty_member_votes_with_a_floor(&mut group).await;
    result.with_context(|| group.logs())
}

/// What CI saw once: a member that started empty while its group ran (at
/// the group's first start, a member that came up a moment late) withheld
/// every vote until it had caught up, and a leader that died before then
/// left the survivors without a majority. Started while the leader
/// answers, it learns the leader's last log id, and votes for a survivor
/// that holds it.
async fn empty_member_votes_with_a_floor(group: &mut GroupSandbox) -> anyhow::Result<()> {
    let conn = group.connect().await?;
    let channel = durable_confirming_channel(&conn).await?;
    publish_confirmed(&channel, 0, 20).await?;
    let leader = group.leader().await?;
    let committed = group.status_of(leader).await?.committed_index;
    for id in 1..=3 {
        group.wait_applied(id, committed).await?;
    }
    let wiped = (1..=3).find(|id| *id != leader).context("no follower")?;
    group.kill_member(wiped).await?;
    group.wipe_member(wiped)?;
    group.start_member(wiped).await?;
    // At once: the empty member may not have caught up yet.
    group.kill_member(leader).await?;
    publish_confirmed(&channel, 20, 30).await?;
    let new_leader = group.leader().await?;
    anyhow::ensure!(new_leader != leader, "the dead member still leads");
    drop(channel);
    conn.close(200, "bye".into()).await.ok();
    group.start_member(leader).await?;
    group.kill_and_restart_engine().await?;
    consume_all(group, 30).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_member_reports_one_leader_and_how_far_it_applied() -> anyhow::Result<()> {
    let group = GroupSandbox::start(3).await?;
    let leader = group.leader().await?;
    let status = group.status_of(leader).await?;
    anyhow::ensure!(status.members.len() == 3, "members: {:?}", status.members);
    let leaders: Vec<_> = status
        .members
        .iter()
        .filter(|member| member.role == "leader")
        .collect();
    anyhow::ensure!(leaders.len() == 1 && leaders[0].id == leader, "{status:?}");
    for id in 1..=3 {
        let seen = group.status_of(id).await?;
        anyhow::ensure!(seen.node_id == id, "{seen:?}");
        anyhow::ensure!(seen
            .members
            .iter()
            .all(|m| m.address.starts_with("http://127.")));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spillctl_shows_the_group_and_adds_and_removes_a_member() -> anyhow::Result<()> {
    let mut group = GroupSandbox::start(3).await?;
    let result = membership(&mut group).await;
    result.with_context(|| group.logs())
}

async fn membership(group: &mut GroupSandbox) -> anyhow::Result<()> {
    let conn = group.connect().await?;
    let channel = durable_confirming_channel(&conn).await?;
    publish_confirmed(&channel, 0, 50).await?;
    let status = spillctl_json(group, &["storage", "status"])?;
    let leader = status["leader"]
        .as_u64()
        .context("no leader in the status")?;
    let members = status["members"].as_array().context("no members")?;
    anyhow::ensure!(members.len() == 3, "{status}");
    anyhow::ensure!(
        members
            .iter()
            .filter(|member| member["role"] == "leader")
            .all(|member| member["id"].as_u64() == Some(leader)),
        "{status}"
    );
    anyhow::ensure!(
        members
            .iter()
            .all(|member| member["applied_index"].as_u64().is_some()),
        "{status}"
    );
    // A fourth node joins: a learner that catches up, then a voter.
    let address = group.start_joining_member(4).await?;
    let added = spillctl_json(
        group,
        &["storage", "add-member", "4", &format!("http://{address}")],
    )?;
    let fourth = added["members"]
        .as_array()
        .and_then(|members| members.iter().find(|member| member["id"] == 4))
        .cloned()
        .context("member 4 not in the group")?;
    anyhow::ensure!(fourth["role"] == "follower", "{added}");
    let committed = group.status_of(leader).await?.committed_index;
    group.wait_applied(4, committed).await?;
    // Removing one: three voters again, and writes go on.
    let follower = (1..=3).find(|id| *id != leader).context("no follower")?;
    let removed = spillctl_json(group, &["storage", "remove-member", &follower.to_string()])?;
    let ids: Vec<u64> = removed["members"]
        .as_array()
        .context("no members")?
        .iter()
        .filter_map(|member| member["id"].as_u64())
        .collect();
    anyhow::ensure!(!ids.contains(&follower) && ids.contains(&4), "{removed}");
    group.kill_member(follower).await?;
    publish_confirmed(&channel, 50, 60).await?;
    // Bad input: a clear refusal, not a crash.
    let (ok, _, stderr) = group.spillctl(&["storage", "remove-member", "99"])?;
    anyhow::ensure!(
        !ok && stderr.contains("99"),
        "removing a stranger: {stderr}"
    );
    drop(channel);
    conn.close(200, "bye".into()).await.ok();
    group.kill_and_restart_engine().await?;
    consume_all(group, 60).await
}

fn spillctl_json(group: &GroupSandbox, args: &[&str]) -> anyhow::Result<serde_json::Value> {
    let mut all = vec!["--output", "json"];
    all.extend_from_slice(args);
    let (ok, stdout, stderr) = group.spillctl(&all)?;
    anyhow::ensure!(ok, "spillctl {args:?} failed: {stderr}");
    Ok(serde_json::from_str(&stdout)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_engine_takes_over_and_publishers_that_retry_lose_nothing() -> anyhow::Result<()>
{
    let mut group = GroupSandbox::start_with_standby(3).await?;
    let result = engine_failover(&mut group).await;
    result.with_context(|| group.logs())
}

/// A publisher that, when its connection is closed under it, connects
/// again and publishes every message not yet confirmed: the way RabbitMQ
/// clients are told to handle `320 CONNECTION_FORCED`.
async fn engine_failover(group: &mut GroupSandbox) -> anyhow::Result<()> {
    const TOTAL: u64 = 400;
    let mut confirmed = BTreeSet::new();
    let mut killed = false;
    let mut reconnections = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while (confirmed.len() as u64) < TOTAL {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "{} of {TOTAL} confirmed after 90 s",
            confirmed.len()
        );
        let Ok(conn) = group.connect().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(channel) = durable_confirming_channel(&conn).await else {
            continue;
        };
        reconnections += 1;
        let unconfirmed: Vec<u64> = (0..TOTAL).filter(|seq| !confirmed.contains(seq)).collect();
        for batch in unconfirmed.chunks(50) {
            let mut confirms = Vec::new();
            for seq in batch {
                match publish_persistent(&channel, *seq).await {
                    Ok(confirm) => confirms.push((*seq, confirm)),
                    Err(_) => break,
                }
            }
            for (seq, confirm) in confirms {
                if let Ok(Ok(confirmation)) =
                    tokio::time::timeout(Duration::from_secs(30), confirm).await
                {
                    if confirmation.is_ack() {
                        confirmed.insert(seq);
                    }
                }
            }
            // Half way through, the active engine dies.
            if !killed && confirmed.len() as u64 >= TOTAL / 2 {
                group.kill_engine().await?;
                killed = true;
            }
            if !conn.status().connected() {
                break;
            }
        }
    }
    anyhow::ensure!(killed, "the engine was never killed");
    anyhow::ensure!(reconnections >= 2, "the publisher never had to reconnect");
    group.wait_for_standby().await?;
    consume_at_least_once(group, TOTAL).await
}

/// Every message 0..expected comes back; ones published twice (their
/// first confirm lost with the engine) may come twice.
async fn consume_at_least_once(group: &GroupSandbox, expected: u64) -> anyhow::Result<()> {
    let conn = group.connect().await?;
    let duplicates = consume_every_one(&conn, expected).await?;
    println!("engine failover: {expected} confirmed, 0 lost, {duplicates} duplicated");
    conn.close(200, "bye".into()).await.ok();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_lost_its_lease_steps_down_and_the_standby_serves() -> anyhow::Result<()> {
    let mut group = GroupSandbox::start_with_standby(3).await?;
    let result = step_down(&mut group).await;
    result.with_context(|| group.logs())
}

/// The active engine stops answering (SIGSTOP) past its lease's TTL: the
/// standby takes the lease and serves. When the old one runs again it must
/// not serve on: it exits non-zero, its clients' connections are closed,
/// and they carry on against the new engine with nothing lost.
async fn step_down(group: &mut GroupSandbox) -> anyhow::Result<()> {
    let before = group.connect().await?;
    let channel = durable_confirming_channel(&before).await?;
    publish_confirmed(&channel, 0, 100).await?;

    group.pause_engine(true)?;
    group.wait_for_standby().await?;
    group.pause_engine(false)?;
    let status = group.wait_engine_exit(Duration::from_secs(30)).await?;
    anyhow::ensure!(
        !status.success(),
        "the deposed engine exited with {status}, not as a failure"
    );
    anyhow::ensure!(
        group.logs().contains("stepped down"),
        "the deposed engine did not say why it stopped"
    );
    // Its client's connection is closed under it (320 from the gateway).
    spillway_integration_tests::eventually(Duration::from_secs(30), || {
        let connected = before.status().connected();
        async move { !connected }
    })
    .await
    .context("the old engine's client connection stayed open")?;

    let after = group.connect().await?;
    let channel = durable_confirming_channel(&after).await?;
    publish_confirmed(&channel, 100, 200).await?;
    after.close(200, "bye".into()).await.ok();
    // Management follows the active engine too (`management.engine_addrs`).
    let (ok, stdout, stderr) = group.spillctl(&["queue", "list"])?;
    anyhow::ensure!(
        ok && stdout.contains(QUEUE),
        "spillctl queue list: {stdout} {stderr}"
    );
    consume_all(group, 200).await
}
