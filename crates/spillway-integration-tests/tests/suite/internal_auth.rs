//! The internal gRPC services (the engine's `Engine` session stream and
//! `EngineAdmin`, the storage node's `Storage`) serve only callers that
//! present the cluster secret, in the separate-process wiring, over real
//! sockets with the generated tonic clients:
//!
//! - no secret or a wrong one: UNAUTHENTICATED, counted in
//!   `spillway_grpc_auth_failures_total{service}`, logged once per peer, and
//!   the secret never appears in a log;
//! - the right one: served, and AMQP clients are served through the gateway;
//! - a separate role refuses to listen beyond loopback without per-role
//!   secrets (one shared secret is not enough), and a secret that is too
//!   short or given twice stops start-up;
//! - a gRPC message over the limit derived from `gateway.max_message_size`
//!   is refused, while messages larger than one batch still flow.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use spillway_integration_tests::amqp::confirmed_round_trip;
use spillway_integration_tests::{
    eventually, http_get, metric_value, spillway_bin, Component, Sandbox, Wiring,
};
use spillway_proto::cluster::{ClusterRole, ROLE_METADATA_KEY, SECRET_METADATA_KEY};
use spillway_proto::engine::engine_admin_client::EngineAdminClient;
use spillway_proto::engine::engine_client::EngineClient;
use spillway_proto::engine::SessionCommand;
use spillway_proto::management::{CreateVhostRequest, ListVhostsRequest};
use spillway_proto::storage::storage_client::StorageClient;
use spillway_proto::storage::{write_op, MessageRecord, StatusRequest, WriteBatch, WriteOp};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request};

/// Each case's bound: start-up of four processes and a few calls.
const CASE_DEADLINE: Duration = Duration::from_secs(120);

/// What a test client presents.
#[derive(Clone, Copy, Debug)]
enum Credentials<'a> {
    Nothing,
    Wrong,
    Secret(&'a str),
}

/// `message` with `credentials`, calling as `role`.
fn request_as<T>(message: T, role: ClusterRole, credentials: Credentials<'_>) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert(ROLE_METADATA_KEY, role.as_str().parse().expect("ascii"));
    let value = match credentials {
        Credentials::Nothing => return request,
        Credentials::Wrong => "not-the-cluster-secret-at-all",
        Credentials::Secret(secret) => secret,
    };
    request
        .metadata_mut()
        .insert(SECRET_METADATA_KEY, value.parse().expect("ascii"));
    request
}

async fn channel(addr: std::net::SocketAddr) -> anyhow::Result<Channel> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?)
}

/// One call of each internal service (the session stream included) with
/// `credentials`: each one's status code, `None` when it was served.
async fn call_every_service(
    sandbox: &Sandbox,
    credentials: Credentials<'_>,
) -> anyhow::Result<Vec<(&'static str, Option<Code>)>> {
    let storage_addr = sandbox.storage_addr().expect("separate wiring");
    let engine_addr = sandbox.engine_addr().expect("separate wiring");
    let mut storage = StorageClient::new(channel(storage_addr).await?);
    let mut engine = EngineClient::new(channel(engine_addr).await?);
    let mut admin = EngineAdminClient::new(channel(engine_addr).await?);

    // Each call as the role that makes it.
    let status = storage
        .status(request_as(
            StatusRequest::default(),
            ClusterRole::Engine,
            credentials,
        ))
        .await;
    let vhosts = admin
        .list_vhosts(request_as(
            ListVhostsRequest {},
            ClusterRole::Management,
            credentials,
        ))
        .await;
    // A session that sends nothing: the stream is open once the engine
    // answers with its headers.
    let commands = futures::stream::pending::<SessionCommand>();
    let session = engine
        .session(request_as(commands, ClusterRole::Gateway, credentials))
        .await;
    Ok(vec![
        ("storage", status.err().map(|s| s.code())),
        ("engine_admin", vhosts.err().map(|s| s.code())),
        ("engine", session.err().map(|s| s.code())),
    ])
}

async fn metric(sandbox: &Sandbox, component: Component, name: &str) -> anyhow::Result<f64> {
    let (status, text) = http_get(sandbox.metrics_addr(component)?, "/metrics").await?;
    anyhow::ensure!(status == 200, "/metrics answered {status}");
    metric_value(&text, name).ok_or_else(|| anyhow::anyhow!("{name} not in /metrics"))
}

async fn separate(config: &str) -> anyhow::Result<Sandbox> {
    Sandbox::start_with_config(Wiring::Separate, config).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_internal_service_refuses_a_missing_or_wrong_secret() {
    let sandbox = separate("").await.expect("sandbox");
    let result = tokio::time::timeout(CASE_DEADLINE, async {
        for credentials in [Credentials::Nothing, Credentials::Wrong] {
            let answers = call_every_service(&sandbox, credentials).await?;
            for (service, code) in answers {
                anyhow::ensure!(
                    code == Some(Code::Unauthenticated),
                    "{service} with {credentials:?}: {code:?}"
                );
            }
        }
        // Refusals are counted per service, in the process that refused.
        let failures =
            |service| format!("spillway_grpc_auth_failures_total{{service=\"{service}\"}}");
        for (component, service) in [
            (Component::Storage, "storage"),
            (Component::Engine, "engine"),
            (Component::Engine, "engine_admin"),
        ] {
            let count = metric(&sandbox, component, &failures(service)).await?;
            anyhow::ensure!(count == 2.0, "{service}: {count} failures counted");
        }
        // Four refusals in each process from one address: one warning each.
        let logs = sandbox.logs();
        let warnings = logs
            .lines()
            .filter(|line| line.contains("internal grpc call refused: the caller"))
            .count();
        anyhow::ensure!(warnings == 2, "{warnings} warnings:\n{logs}");
        anyhow::ensure!(logs.contains("peer=127.0.0.1:"), "no peer address:\n{logs}");
        let secret = String::from_utf8_lossy(sandbox.cluster_secret().expose()).into_owned();
        anyhow::ensure!(!logs.contains(&secret), "the secret is in a log");
        Ok(())
    })
    .await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(error)) => panic!("{error:#}\n{}", sandbox.logs()),
        Err(_) => panic!("timed out\n{}", sandbox.logs()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_secret_every_service_and_amqp_clients_are_served() {
    let sandbox = separate("").await.expect("sandbox");
    let result = tokio::time::timeout(CASE_DEADLINE, async {
        let secret = String::from_utf8_lossy(sandbox.cluster_secret().expose()).into_owned();
        let answers = call_every_service(&sandbox, Credentials::Secret(&secret)).await?;
        for (service, code) in answers {
            anyhow::ensure!(code.is_none(), "{service} refused the secret: {code:?}");
        }
        // The sandbox's own internal client (RemoteStorage) gets in too.
        sandbox.store_status(false).await?;

        // gateway -> engine -> storage, each hop with the secret.
        let conn = sandbox.connect().await?;
        confirmed_round_trip(&conn, "internal-auth", 10).await?;
        conn.close(200, "bye".into()).await?;

        let failures = "spillway_grpc_auth_failures_total{service=\"engine\"}";
        let count = metric(&sandbox, Component::Engine, failures).await;
        anyhow::ensure!(
            count.as_ref().ok().is_none_or(|n| *n == 0.0),
            "{failures}: {count:?}"
        );
        Ok(())
    })
    .await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(error)) => panic!("{error:#}\n{}", sandbox.logs()),
        Err(_) => panic!("timed out\n{}", sandbox.logs()),
    }
}

/// How one run of the binary ended.
struct Exit {
    code: Option<i32>,
    stderr: String,
    ready: bool,
}

/// Runs `spillway ROLE` with `env` in `dir` and waits (with a deadline) for
/// it to exit on its own.
async fn run_until_exit(dir: &Path, role: &str, env: &[(&str, String)]) -> anyhow::Result<Exit> {
    let ready = dir.join(format!("{role}.ready"));
    let mut command = tokio::process::Command::new(spillway_bin()?);
    command
        .arg("--ready-file")
        .arg(&ready)
        .arg(role)
        .current_dir(dir)
        .env("SPILLWAY_ENGINE__LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_STORAGE__LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_TELEMETRY__METRICS_LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_STORAGE__DATA_DIR", dir.join("data"))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = command.spawn()?;
    let output = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .map_err(|_| anyhow::anyhow!("spillway {role} still running after 20 s"))??;
    Ok(Exit {
        code: output.status.code(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        ready: ready.exists(),
    })
}

fn assert_refused(exit: &Exit, what: &str, expected: &[&str]) {
    assert!(
        exit.code.is_some_and(|code| code != 0) && !exit.ready,
        "{what}: exited with {:?}, ready file {}:\n{}",
        exit.code,
        exit.ready,
        exit.stderr
    );
    for text in expected {
        assert!(
            exit.stderr.contains(text),
            "{what}: `{text}` not on stderr:\n{}",
            exit.stderr
        );
    }
}

#[tokio::test]
async fn a_separate_role_will_not_listen_beyond_loopback_without_a_secret() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    for (role, key, var) in [
        ("engine", "engine.listen", "SPILLWAY_ENGINE__LISTEN"),
        ("storage", "storage.listen", "SPILLWAY_STORAGE__LISTEN"),
    ] {
        let exit = run_until_exit(dir.path(), role, &[(var, "0.0.0.0:0".into())]).await?;
        assert_refused(
            &exit,
            role,
            &[
                &format!("`{key}` is not a loopback address"),
                "cluster.secret_file",
                "SPILLWAY_CLUSTER__SECRET_FILE",
            ],
        );
    }
    Ok(())
}

/// Environment variables for one run.
type Env = [(&'static str, String)];

#[tokio::test]
async fn a_secret_that_is_too_short_missing_or_given_twice_stops_start_up() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("secret");
    std::fs::write(&file, "0123456789abcdef0123456789\n")?;
    let missing = dir.path().join("no-such-secret");
    let cases: [(&Env, &[&str]); 3] = [
        (
            &[("SPILLWAY_CLUSTER__SECRET", "too-short".into())],
            &["`cluster.secret` = (not shown, 9 bytes) (in environment variable SPILLWAY_CLUSTER__SECRET) is out of range: at least 16"],
        ),
        (
            &[
                ("SPILLWAY_CLUSTER__SECRET", "0123456789abcdef0123".into()),
                ("SPILLWAY_CLUSTER__SECRET_FILE", file.display().to_string()),
            ],
            &["`cluster.secret_file`", "give one of the two"],
        ),
        (
            &[("SPILLWAY_CLUSTER__SECRET_FILE", missing.display().to_string())],
            &["`cluster.secret_file`", "a readable file holding the secret"],
        ),
    ];
    for (env, expected) in cases {
        let exit = run_until_exit(dir.path(), "storage", env).await?;
        assert_refused(&exit, &format!("{env:?}"), expected);
        assert!(
            !exit.stderr.contains("0123456789abcdef0123"),
            "{}",
            exit.stderr
        );
    }
    Ok(())
}

/// One shared secret proves only that the caller is the broker's, not which
/// role: beyond loopback it is refused; per-role secrets are enough.
#[tokio::test]
async fn a_shared_secret_alone_will_not_listen_beyond_loopback() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("secret");
    std::fs::write(&file, "0123456789abcdef0123456789\n")?;
    let env = [
        ("SPILLWAY_STORAGE__LISTEN", "0.0.0.0:0".to_string()),
        ("SPILLWAY_CLUSTER__SECRET_FILE", file.display().to_string()),
    ];
    let exit = run_until_exit(dir.path(), "storage", &env).await?;
    assert_refused(
        &exit,
        "a shared secret beyond loopback",
        &[
            "`storage.listen` is not a loopback address",
            "one shared cluster secret would let every role make every call",
            "cluster.verifiers",
        ],
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_per_role_secrets_a_separate_role_listens_beyond_loopback() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let secrets = spillway_integration_tests::RoleSecrets::new(dir.path())?;
    let ready = dir.path().join("storage.ready");
    let mut child = tokio::process::Command::new(spillway_bin()?)
        .arg("--ready-file")
        .arg(&ready)
        .arg("storage")
        .current_dir(dir.path())
        .env("SPILLWAY_STORAGE__LISTEN", "0.0.0.0:0")
        .env("SPILLWAY_TELEMETRY__METRICS_LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_STORAGE__DATA_DIR", dir.path().join("data"))
        .envs(secrets.env(ClusterRole::Storage))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let started = eventually(Duration::from_secs(60), || {
        let outcome = match child.try_wait() {
            Ok(Some(status)) => Err(anyhow::anyhow!("spillway storage exited with {status}")),
            _ if ready.exists() => Ok(()),
            _ => Err(anyhow::anyhow!("not ready yet")),
        };
        async move { outcome }
    })
    .await;
    child.kill().await?;
    started
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_in_one_opens_no_internal_port() {
    let sandbox = Sandbox::start(Wiring::AllInOneProcess)
        .await
        .expect("sandbox");
    assert!(sandbox.storage_addr().is_none() && sandbox.engine_addr().is_none());
    let metrics = sandbox.metrics_addr(Component::Engine).expect("metrics");
    let (_, text) = http_get(metrics, "/metrics").await.expect("scrape");
    assert!(!text.contains("spillway_grpc_auth_failures"), "{text}");
}

/// The limit with `max_message_size` = 1 MiB: 16 MiB (a batch) + 128 KiB
/// (a frame) + 4 MiB. A 24 MiB message is over it on every service.
const SMALL_LIMIT_CONFIG: &str = "[gateway]\nmax_message_size = 1048576\n";
const OVERSIZE: usize = 24 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_grpc_message_is_refused() {
    let sandbox = separate(SMALL_LIMIT_CONFIG).await.expect("sandbox");
    let result = tokio::time::timeout(CASE_DEADLINE, async {
        let secret = String::from_utf8_lossy(sandbox.cluster_secret().expose()).into_owned();
        let credentials = Credentials::Secret(&secret);
        let storage_addr = sandbox.storage_addr().expect("separate wiring");
        let engine_addr = sandbox.engine_addr().expect("separate wiring");
        // Clients that would send anything: the servers must refuse.
        let mut storage =
            StorageClient::new(channel(storage_addr).await?).max_encoding_message_size(usize::MAX);
        let mut admin = EngineAdminClient::new(channel(engine_addr).await?)
            .max_encoding_message_size(usize::MAX);

        let record = MessageRecord {
            id: u64::MAX - 1,
            body: vec![b'x'; OVERSIZE].into(),
            ..Default::default()
        };
        let batch = WriteBatch {
            ops: vec![WriteOp {
                op: Some(write_op::Op::PutMessage(record)),
            }],
            durability: 0,
            // Refused for its size before any epoch is looked at.
            epoch: 0,
            sequence: 0,
        };
        let written = storage
            .write(request_as(batch, ClusterRole::Engine, credentials))
            .await;
        let code = written.as_ref().err().map(|status| status.code());
        anyhow::ensure!(
            matches!(code, Some(Code::OutOfRange | Code::ResourceExhausted)),
            "storage took a {OVERSIZE}-byte message: {written:?}"
        );
        let created = admin
            .create_vhost(request_as(
                CreateVhostRequest {
                    name: "v".repeat(OVERSIZE),
                },
                ClusterRole::Management,
                credentials,
            ))
            .await;
        let code = created.as_ref().err().map(|status| status.code());
        anyhow::ensure!(
            matches!(code, Some(Code::OutOfRange | Code::ResourceExhausted)),
            "the engine took a {OVERSIZE}-byte message: {:?}",
            created.map(|_| ())
        );
        // Both still serve calls within the limit.
        storage
            .status(request_as(
                StatusRequest::default(),
                ClusterRole::Engine,
                credentials,
            ))
            .await?;
        admin
            .list_vhosts(request_as(
                ListVhostsRequest {},
                ClusterRole::Management,
                credentials,
            ))
            .await?;
        Ok(())
    })
    .await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(error)) => panic!("{error:#}\n{}", sandbox.logs()),
        Err(_) => panic!("timed out\n{}", sandbox.logs()),
    }
}

/// Bodies larger than one batch (16 MiB) but within `max_message_size`
/// travel every hop: each goes in a gRPC message of its own, to storage
/// (persistent), back (peek) and to the consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_larger_than_a_batch_still_flow() {
    let sandbox = separate("").await.expect("sandbox");
    let result = tokio::time::timeout(CASE_DEADLINE, async {
        const BODY: usize = 20 << 20;
        const COUNT: u8 = 3;
        let conn = sandbox.connect().await?;
        let channel = conn.create_channel().await?;
        channel
            .queue_declare(
                "large".into(),
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
        let mut confirms = Vec::new();
        for i in 0..COUNT {
            confirms.push(
                channel
                    .basic_publish(
                        "".into(),
                        "large".into(),
                        BasicPublishOptions::default(),
                        &vec![b'a' + i; BODY],
                        BasicProperties::default().with_delivery_mode(2),
                    )
                    .await?,
            );
        }
        for confirm in confirms {
            anyhow::ensure!(confirm.await?.is_ack(), "a large message was not confirmed");
        }
        let mut consumer = channel
            .basic_consume(
                "large".into(),
                "large-consumer".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        for i in 0..COUNT {
            let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
                .await?
                .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
            anyhow::ensure!(
                delivery.data.len() == BODY && delivery.data.iter().all(|b| *b == b'a' + i),
                "message {i} came back wrong ({} bytes)",
                delivery.data.len()
            );
        }
        channel.close(200, "bye".into()).await?;
        conn.close(200, "bye".into()).await?;
        Ok(())
    })
    .await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(error)) => panic!("{error:#}\n{}", sandbox.logs()),
        Err(_) => panic!("timed out\n{}", sandbox.logs()),
    }
}

/// On loopback with no secret and no mutual TLS configured, a separate role
/// still trusts no other local process: it makes (or reads) the secret in
/// `<storage.data_dir>/cluster-secret`, readable by its owner only, and a
/// call without it is UNAUTHENTICATED; with it, served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_configured_secret_a_separate_role_uses_the_local_one() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let ready = dir.path().join("storage.ready");
    let mut child = tokio::process::Command::new(spillway_bin()?)
        .arg("--ready-file")
        .arg(&ready)
        .arg("storage")
        .current_dir(dir.path())
        .env("SPILLWAY_STORAGE__LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_TELEMETRY__METRICS_LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_STORAGE__DATA_DIR", &data)
        .env_remove("SPILLWAY_CLUSTER__SECRET")
        .env_remove("SPILLWAY_CLUSTER__SECRET_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let outcome = async {
        eventually(Duration::from_secs(60), || {
            let started = match child.try_wait() {
                Ok(Some(status)) => Err(anyhow::anyhow!("spillway storage exited with {status}")),
                _ if ready.exists() => Ok(()),
                _ => Err(anyhow::anyhow!("not ready yet")),
            };
            async move { started }
        })
        .await?;
        let addresses: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ready)?)?;
        let addr: std::net::SocketAddr = addresses["storage"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("no storage address in {addresses}"))?
            .parse()?;
        let file = data.join("cluster-secret");
        let mode = std::fs::metadata(&file)?.permissions().mode() & 0o777;
        anyhow::ensure!(mode == 0o600, "the local secret is mode {mode:o}");
        let secret = std::fs::read_to_string(&file)?;
        let mut storage = StorageClient::new(channel(addr).await?);
        for credentials in [Credentials::Nothing, Credentials::Wrong] {
            let refused = storage
                .status(request_as(
                    StatusRequest::default(),
                    ClusterRole::Engine,
                    credentials,
                ))
                .await
                .err()
                .map(|status| status.code());
            anyhow::ensure!(
                refused == Some(Code::Unauthenticated),
                "{credentials:?}: {refused:?}"
            );
        }
        storage
            .status(request_as(
                StatusRequest::default(),
                ClusterRole::Engine,
                Credentials::Secret(secret.trim()),
            ))
            .await?;
        Ok(())
    }
    .await;
    child.kill().await?;
    outcome
}
