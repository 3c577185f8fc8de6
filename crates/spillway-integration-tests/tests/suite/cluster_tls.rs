//! Mutual TLS between the separate processes (`cluster.tls`), over real
//! sockets with certificates made by the test:
//!
//! - storage, engine, gateway and management run with a cluster CA and a
//!   component certificate each (and the cluster secret): AMQP clients are
//!   served through the gateway, persistent messages reach storage;
//! - every internal service (`Engine` session stream, `EngineAdmin`,
//!   `Storage`) refuses a caller without a client certificate, with one from
//!   another CA, and a plaintext caller, even one that presents the right
//!   secret, while a caller with a certificate of the cluster CA is served;
//! - cluster TLS alone lets a separate role listen beyond loopback, and a
//!   missing or unusable file stops start-up with the setting named.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use spillway_integration_tests::amqp::confirmed_round_trip;
use spillway_integration_tests::pki::{Identity, Pki};
use spillway_integration_tests::{eventually, spillway_bin, Sandbox, Wiring};
use spillway_proto::cluster::{ClusterRole, ROLE_METADATA_KEY, SECRET_METADATA_KEY};
use spillway_proto::engine::engine_admin_client::EngineAdminClient;
use spillway_proto::engine::engine_client::EngineClient;
use spillway_proto::engine::SessionCommand;
use spillway_proto::management::ListVhostsRequest;
use spillway_proto::storage::storage_client::StorageClient;
use spillway_proto::storage::StatusRequest;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request};

/// Each case's bound: start-up of four processes and a few calls.
const CASE_DEADLINE: Duration = Duration::from_secs(120);

/// The sandbox's processes, all with one component certificate of `pki`'s
/// CA (SANs `localhost`, `127.0.0.1`) and the cluster secret.
async fn mtls_sandbox(pki: &Pki) -> anyhow::Result<Sandbox> {
    let component = pki.component("spillway")?;
    Sandbox::start_with_config(Wiring::Separate, &pki.cluster_tls_toml(&component)).await
}

/// How a test client reaches an internal server.
#[derive(Clone, Copy, Debug)]
enum Transport<'a> {
    /// Plaintext HTTP/2, as before cluster TLS.
    Plaintext,
    /// TLS trusting the cluster CA, presenting `Some` certificate or none.
    Tls(Option<&'a Identity>),
}

fn channel(
    pki: &Pki,
    addr: std::net::SocketAddr,
    transport: Transport<'_>,
) -> anyhow::Result<Channel> {
    let endpoint = match transport {
        Transport::Plaintext => Endpoint::from_shared(format!("http://{addr}"))?,
        Transport::Tls(identity) => {
            let mut tls = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(std::fs::read(&pki.ca_file)?));
            if let Some(identity) = identity {
                tls = tls.identity(tonic::transport::Identity::from_pem(
                    std::fs::read(&identity.cert)?,
                    std::fs::read(&identity.key)?,
                ));
            }
            Endpoint::from_shared(format!("https://{addr}"))?.tls_config(tls)?
        }
    };
    // Lazy: a refused handshake shows up as the call's error.
    Ok(endpoint
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect_lazy())
}

/// `message` with the sandbox's secret, calling as `role`.
fn with_secret<T>(message: T, role: ClusterRole, sandbox: &Sandbox) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert(ROLE_METADATA_KEY, role.as_str().parse().expect("ascii"));
    let secret = String::from_utf8_lossy(sandbox.cluster_secret().expose()).into_owned();
    request
        .metadata_mut()
        .insert(SECRET_METADATA_KEY, secret.parse().expect("ascii"));
    request
}

/// One call of each internal service (the session stream included), each
/// with the right secret, over `transport`: `Ok` when served, the status
/// otherwise.
async fn call_every_service(
    sandbox: &Sandbox,
    pki: &Pki,
    transport: Transport<'_>,
) -> anyhow::Result<Vec<(&'static str, Result<(), tonic::Status>)>> {
    let storage_addr = sandbox.storage_addr().expect("separate wiring");
    let engine_addr = sandbox.engine_addr().expect("separate wiring");
    let mut storage = StorageClient::new(channel(pki, storage_addr, transport)?);
    let mut engine = EngineClient::new(channel(pki, engine_addr, transport)?);
    let mut admin = EngineAdminClient::new(channel(pki, engine_addr, transport)?);

    let status = storage
        .status(with_secret(
            StatusRequest::default(),
            ClusterRole::Engine,
            sandbox,
        ))
        .await;
    let vhosts = admin
        .list_vhosts(with_secret(
            ListVhostsRequest {},
            ClusterRole::Management,
            sandbox,
        ))
        .await;
    // A session that sends nothing: the stream is open once the engine
    // answers with its headers.
    let commands = futures::stream::pending::<SessionCommand>();
    let session = engine
        .session(with_secret(commands, ClusterRole::Gateway, sandbox))
        .await;
    Ok(vec![
        ("storage", status.map(drop)),
        ("engine_admin", vhosts.map(drop)),
        ("engine", session.map(drop)),
    ])
}

fn report<T>(result: Result<T, anyhow::Error>, sandbox: &Sandbox) -> T {
    match result {
        Ok(value) => value,
        Err(error) => panic!("{error:#}\n{}", sandbox.logs()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_processes_serve_amqp_over_cluster_mtls() {
    let pki = Pki::new().expect("pki");
    let sandbox = mtls_sandbox(&pki).await.expect("sandbox");
    let result = tokio::time::timeout(CASE_DEADLINE, async {
        // The sandbox's own internal client, over mutual TLS.
        sandbox.store_status(false).await?;

        // gateway -> engine -> storage, each hop over mutual TLS.
        let conn = sandbox.connect().await?;
        confirmed_round_trip(&conn, "cluster-tls", 20).await?;
        conn.close(200, "bye".into()).await?;

        // The persistent messages went through storage (over TLS) and are
        // acked; management reaches the engine over TLS as well.
        let mut management = sandbox.management().await?;
        let vhosts = management
            .list_vhosts(ListVhostsRequest {})
            .await?
            .into_inner();
        anyhow::ensure!(
            vhosts.vhosts.iter().any(|vhost| vhost.name == "/"),
            "{vhosts:?}"
        );
        let logs = sandbox.logs();
        anyhow::ensure!(
            !logs.contains("BEGIN PRIVATE KEY"),
            "a key is in a log:\n{logs}"
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_internal_service_refuses_callers_without_a_cluster_certificate() {
    let pki = Pki::new().expect("pki");
    let sandbox = mtls_sandbox(&pki).await.expect("sandbox");
    let result = tokio::time::timeout(CASE_DEADLINE, async {
        // A certificate of the cluster CA (not the processes' own): served.
        let member = pki.component("operator-tool")?;
        for (service, answer) in
            call_every_service(&sandbox, &pki, Transport::Tls(Some(&member))).await?
        {
            anyhow::ensure!(
                answer.is_ok(),
                "{service} refused a cluster certificate: {answer:?}"
            );
        }
        // Every call below presents the right secret: only TLS refuses.
        let stranger = pki.stranger_component("intruder")?;
        for transport in [
            Transport::Tls(None),
            Transport::Tls(Some(&stranger)),
            Transport::Plaintext,
        ] {
            for (service, answer) in call_every_service(&sandbox, &pki, transport).await? {
                let Err(status) = answer else {
                    anyhow::bail!("{service} served a caller with {transport:?}");
                };
                // Refused at the transport: never reached the interceptor.
                anyhow::ensure!(
                    status.code() != Code::Unauthenticated && status.code() != Code::Ok,
                    "{service} with {transport:?}: {status:?}"
                );
            }
        }
        // Nothing got as far as the secret check.
        let failures = sandbox
            .metric(
                spillway_integration_tests::Component::Engine,
                "spillway_grpc_auth_failures_total{service=\"engine\"}",
            )
            .await;
        anyhow::ensure!(
            failures.as_ref().ok().is_none_or(|n| *n == 0.0),
            "{failures:?}"
        );
        // And the broker still serves its own components.
        sandbox.serves_a_fresh_client().await?;
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

/// Runs `spillway ROLE` with `env` (and no cluster secret) in `dir` and
/// waits, with a deadline, for it to exit on its own.
async fn run_until_exit(dir: &Path, role: &str, env: &[(&str, String)]) -> anyhow::Result<Exit> {
    let ready = dir.join(format!("{role}.ready"));
    let child = tokio::process::Command::new(spillway_bin()?)
        .arg("--ready-file")
        .arg(&ready)
        .arg(role)
        .current_dir(dir)
        .env("SPILLWAY_ENGINE__LISTEN", "0.0.0.0:0")
        .env("SPILLWAY_STORAGE__LISTEN", "0.0.0.0:0")
        .env("SPILLWAY_TELEMETRY__METRICS_LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_STORAGE__DATA_DIR", dir.join("data"))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let output = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .map_err(|_| anyhow::anyhow!("spillway {role} still running after 20 s"))??;
    Ok(Exit {
        code: output.status.code(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        ready: ready.exists(),
    })
}

/// Environment variables for one run.
type Env = Vec<(&'static str, String)>;

fn tls_env(cert: &Path, key: &Path, ca: &Path) -> Env {
    vec![
        (
            "SPILLWAY_CLUSTER__TLS__CERT_FILE",
            cert.display().to_string(),
        ),
        ("SPILLWAY_CLUSTER__TLS__KEY_FILE", key.display().to_string()),
        ("SPILLWAY_CLUSTER__TLS__CA_FILE", ca.display().to_string()),
    ]
}

#[tokio::test]
async fn unusable_cluster_tls_files_stop_start_up_naming_the_setting() -> anyhow::Result<()> {
    let pki = Pki::new()?;
    let member = pki.component("storage")?;
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("missing.pem");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not pem at all\n")?;
    let only_cert = vec![(
        "SPILLWAY_CLUSTER__TLS__CERT_FILE",
        member.cert.display().to_string(),
    )];
    let cases: Vec<(Env, Vec<String>)> = vec![
        (
            only_cert,
            vec![
                "`cluster.tls.key_file` = unset".into(),
                "`cluster.tls.ca_file` = unset".into(),
            ],
        ),
        (
            tls_env(&missing, &member.key, &pki.ca_file),
            vec![
                "`cluster.tls.cert_file`".into(),
                "SPILLWAY_CLUSTER__TLS__CERT_FILE".into(),
                format!("cannot read {}", missing.display()),
            ],
        ),
        (
            tls_env(&member.cert, &garbage, &pki.ca_file),
            vec![
                "`cluster.tls.key_file`".into(),
                "holds no usable PEM private key".into(),
            ],
        ),
        (
            tls_env(&member.cert, &member.key, &garbage),
            vec![
                "`cluster.tls.ca_file`".into(),
                "holds no PEM certificate".into(),
            ],
        ),
    ];
    for role in ["storage", "engine", "gateway"] {
        for (env, expected) in &cases {
            let exit = run_until_exit(dir.path(), role, env).await?;
            let what = format!("{role} with {env:?}");
            assert!(
                exit.code.is_some_and(|code| code != 0) && !exit.ready,
                "{what}: exited with {:?}, ready file {}:\n{}",
                exit.code,
                exit.ready,
                exit.stderr
            );
            assert!(
                !exit.stderr.contains("panicked"),
                "{what}:\n{}",
                exit.stderr
            );
            for text in expected {
                assert!(
                    exit.stderr.contains(text.as_str()),
                    "{what}: `{text}` not on stderr:\n{}",
                    exit.stderr
                );
            }
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_cluster_tls_and_no_secret_a_separate_role_listens_beyond_loopback(
) -> anyhow::Result<()> {
    let pki = Pki::new()?;
    let member = pki.component("storage")?;
    let dir = tempfile::tempdir()?;
    let ready = dir.path().join("storage.ready");
    let mut child = tokio::process::Command::new(spillway_bin()?)
        .arg("--ready-file")
        .arg(&ready)
        .arg("storage")
        .current_dir(dir.path())
        .env("SPILLWAY_STORAGE__LISTEN", "0.0.0.0:0")
        .env("SPILLWAY_TELEMETRY__METRICS_LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_STORAGE__DATA_DIR", dir.path().join("data"))
        .envs(tls_env(&member.cert, &member.key, &pki.ca_file))
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
    // The store's client is an engine: its certificate names that role.
    let engine = pki.component("engine")?;
    let served = match &started {
        Ok(()) => storage_serves_over_tls(&pki, &engine, &ready).await,
        Err(_) => Ok(()),
    };
    child.kill().await?;
    started?;
    served
}

/// The storage node of `ready` answers a status call over mutual TLS with
/// no secret (it has none), and refuses one without a certificate.
async fn storage_serves_over_tls(pki: &Pki, member: &Identity, ready: &Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(ready)?;
    let addresses: std::collections::BTreeMap<String, String> = serde_json::from_str(&text)?;
    let port: std::net::SocketAddr = addresses
        .get("storage")
        .ok_or_else(|| anyhow::anyhow!("no storage address in {text}"))?
        .parse()?;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port.port()));
    let mut client = StorageClient::new(channel(pki, addr, Transport::Tls(Some(member)))?);
    client.status(StatusRequest::default()).await?;
    let mut anonymous = StorageClient::new(channel(pki, addr, Transport::Tls(None))?);
    let refused = anonymous.status(StatusRequest::default()).await;
    anyhow::ensure!(refused.is_err(), "served a caller without a certificate");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_in_one_ignores_cluster_tls() {
    let pki = Pki::new().expect("pki");
    let member = pki.component("all-in-one").expect("certificate");
    let sandbox =
        Sandbox::start_with_config(Wiring::AllInOneProcess, &pki.cluster_tls_toml(&member))
            .await
            .expect("sandbox");
    assert!(sandbox.storage_addr().is_none() && sandbox.engine_addr().is_none());
    report(sandbox.serves_a_fresh_client().await, &sandbox);
}
