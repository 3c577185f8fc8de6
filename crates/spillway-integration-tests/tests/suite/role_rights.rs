//! Each role may make only the internal calls its component makes
//! (`docs/security.md`), over real sockets against separate processes:
//!
//! - with per-role secrets (`cluster.verifiers`), a storage group, two
//!   engines' worth of roles, a gateway and management: the gateway's secret
//!   reaches the engine's session stream only (not `EngineAdmin`, not the
//!   store, not the storage group's Raft or membership calls), the engine's
//!   reaches the store as a client only, and a secret never proves another
//!   role than its own; the right roles still serve AMQP clients;
//! - with cluster TLS alone, the role a certificate names: a gateway's
//!   certificate is refused by storage's group service, a storage member's
//!   is let in, and a certificate of the cluster CA that names no role is
//!   refused.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use spillway_integration_tests::amqp::confirmed_round_trip;
use spillway_integration_tests::group::GroupSandbox;
use spillway_integration_tests::pki::{Identity, Pki};
use spillway_integration_tests::{eventually, spillway_bin};
use spillway_proto::cluster::{ClusterRole, ROLE_METADATA_KEY, SECRET_METADATA_KEY};
use spillway_proto::engine::engine_admin_client::EngineAdminClient;
use spillway_proto::engine::engine_client::EngineClient;
use spillway_proto::engine::SessionCommand;
use spillway_proto::management::ListVhostsRequest;
use spillway_proto::storage::storage_client::StorageClient;
use spillway_proto::storage::storage_group_client::StorageGroupClient;
use spillway_proto::storage::{
    AddMemberRequest, GroupStatusRequest, RaftPayload, RemoveMemberRequest, StatusRequest,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Request};

/// Each case's bound: start-up of the processes and a few calls.
const CASE_DEADLINE: Duration = Duration::from_secs(180);

/// `message` calling as `role` with `secret`.
fn as_role<T>(message: T, role: &str, secret: &str) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert(ROLE_METADATA_KEY, role.parse().expect("ascii"));
    request
        .metadata_mut()
        .insert(SECRET_METADATA_KEY, secret.parse().expect("ascii"));
    request
}

fn plaintext(addr: SocketAddr) -> anyhow::Result<Channel> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect_lazy())
}

/// A Raft message that is not one: a caller let through gets
/// INVALID_ARGUMENT, never a change to the group.
fn garbage() -> RaftPayload {
    RaftPayload {
        data: vec![0xff; 8].into(),
    }
}

/// The status code of a call: `None` when served.
fn code<T>(answer: Result<T, tonic::Status>) -> Option<Code> {
    answer.err().map(|status| status.code())
}

/// What each role's secret gets from every internal service of a running
/// group (member 1 and the engine): one line per call that was not as
/// expected.
async fn wrong_answers(group: &GroupSandbox) -> anyhow::Result<Vec<String>> {
    let secrets = group.secrets();
    let member = group.member_addr(1)?;
    let engine = group.engine_addr();
    let mut wrong = Vec::new();
    let mut expect = |what: String, got: Option<Code>, want: Option<Code>| {
        if got != want {
            wrong.push(format!("{what}: got {got:?}, expected {want:?}"));
        }
    };
    let denied = Some(Code::PermissionDenied);
    for caller in ClusterRole::ALL {
        let secret = secrets.text(caller)?;
        let name = caller.as_str();
        let mut members = StorageGroupClient::new(plaintext(member)?);
        let mut storage = StorageClient::new(plaintext(member)?);
        let mut admin = EngineAdminClient::new(plaintext(engine)?);
        let mut sessions = EngineClient::new(plaintext(engine)?);

        // Raft between members: the storage role only (a member lets the
        // message through to be decoded, and refuses it as garbage).
        let got = code(
            members
                .append_entries(as_role(garbage(), name, &secret))
                .await,
        );
        let want = match caller {
            ClusterRole::Storage => Some(Code::InvalidArgument),
            _ => denied,
        };
        expect(format!("{name} append_entries"), got, want);
        let got = code(members.vote(as_role(garbage(), name, &secret)).await);
        expect(format!("{name} vote"), got, want);
        let got = code(
            members
                .install_snapshot(as_role(garbage(), name, &secret))
                .await,
        );
        expect(format!("{name} install_snapshot"), got, want);

        // Membership: management only. A node id and address that nothing
        // serves; management's own call is left to the replication suite
        // (spillctl storage add-member), so nothing changes here.
        if caller != ClusterRole::Management {
            let add = AddMemberRequest {
                id: 99,
                address: "http://127.0.0.1:9".into(),
            };
            let got = code(members.add_member(as_role(add, name, &secret)).await);
            expect(format!("{name} add_member"), got, denied);
            let remove = RemoveMemberRequest { id: 1 };
            let got = code(members.remove_member(as_role(remove, name, &secret)).await);
            expect(format!("{name} remove_member"), got, denied);
        }
        let got = code(
            members
                .get_group_status(as_role(GroupStatusRequest {}, name, &secret))
                .await,
        );
        let want = match caller {
            ClusterRole::Storage | ClusterRole::Management => None,
            _ => denied,
        };
        expect(format!("{name} get_group_status"), got, want);

        // The store as a client: the engine, and management's status.
        let got = code(
            storage
                .status(as_role(StatusRequest::default(), name, &secret))
                .await,
        );
        let want = match caller {
            ClusterRole::Engine | ClusterRole::Management => None,
            _ => denied,
        };
        expect(format!("{name} storage status"), got, want);

        // The engine: sessions for the gateway, administration for
        // management.
        let got = code(
            admin
                .list_vhosts(as_role(ListVhostsRequest {}, name, &secret))
                .await,
        );
        let want = match caller {
            ClusterRole::Management => None,
            _ => denied,
        };
        expect(format!("{name} engine_admin list_vhosts"), got, want);
        let commands = futures::stream::pending::<SessionCommand>();
        let got = code(sessions.session(as_role(commands, name, &secret)).await);
        let want = match caller {
            ClusterRole::Gateway => None,
            _ => denied,
        };
        expect(format!("{name} engine session"), got, want);
    }
    Ok(wrong)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_per_role_secrets_each_role_makes_only_its_own_calls() {
    let group = GroupSandbox::start(3).await.expect("group");
    let result = tokio::time::timeout(CASE_DEADLINE, async {
        let wrong = wrong_answers(&group).await?;
        anyhow::ensure!(wrong.is_empty(), "{}", wrong.join("\n"));

        // A secret proves its own role only: the gateway's, presented as
        // the storage or management role, is not theirs.
        let member = group.member_addr(1)?;
        let gateway = group.secrets().text(ClusterRole::Gateway)?;
        let mut members = StorageGroupClient::new(plaintext(member)?);
        for claimed in ["storage", "management"] {
            let got = code(
                members
                    .append_entries(as_role(garbage(), claimed, &gateway))
                    .await,
            );
            anyhow::ensure!(
                got == Some(Code::Unauthenticated),
                "the gateway's secret as {claimed}: {got:?}"
            );
            let add = AddMemberRequest {
                id: 99,
                address: "http://127.0.0.1:9".into(),
            };
            let got = code(members.add_member(as_role(add, claimed, &gateway)).await);
            anyhow::ensure!(
                got == Some(Code::Unauthenticated),
                "the gateway's secret adding a member as {claimed}: {got:?}"
            );
        }
        // The group is as it was: three members, none added.
        let status = group.status_of(1).await?;
        anyhow::ensure!(status.members.len() == 3, "{status:?}");

        // And the roles that make the calls still do: gateway -> engine ->
        // storage group, confirmed.
        let conn = group.connect().await?;
        confirmed_round_trip(&conn, "role-rights", 10).await?;
        conn.close(200, "bye".into()).await?;
        Ok(())
    })
    .await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(error)) => panic!("{error:#}\n{}", group.logs()),
        Err(_) => panic!("timed out\n{}", group.logs()),
    }
}

/// A TLS channel to `addr` trusting `pki`'s CA, presenting `identity`.
fn tls(pki: &Pki, addr: SocketAddr, identity: &Identity) -> anyhow::Result<Channel> {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(&pki.ca_file)?))
        .identity(tonic::transport::Identity::from_pem(
            std::fs::read(&identity.cert)?,
            std::fs::read(&identity.key)?,
        ));
    Ok(Endpoint::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect_lazy())
}

/// A port free now on 127.0.0.1, for a group member that must know its
/// own address before it starts.
fn free_port() -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_cluster_tls_the_role_is_the_one_the_certificate_names() -> anyhow::Result<()> {
    let pki = Pki::new()?;
    let storage_cert = pki.component("storage")?;
    let dir = tempfile::tempdir()?;
    let ready = dir.path().join("storage.ready");
    let addr = free_port()?;
    // A group of one, over cluster TLS with no secret: the group service
    // is served, and callers prove their role by certificate alone.
    let mut child = tokio::process::Command::new(spillway_bin()?)
        .arg("--ready-file")
        .arg(&ready)
        .arg("storage")
        .current_dir(dir.path())
        .env("SPILLWAY_STORAGE__LISTEN", addr.to_string())
        .env("SPILLWAY_STORAGE__NODE_ID", "1")
        .env("SPILLWAY_STORAGE__MEMBERS__1", format!("https://{addr}"))
        .env("SPILLWAY_TELEMETRY__METRICS_LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_STORAGE__DATA_DIR", dir.path().join("data"))
        .env("SPILLWAY_CLUSTER__TLS__CERT_FILE", &storage_cert.cert)
        .env("SPILLWAY_CLUSTER__TLS__KEY_FILE", &storage_cert.key)
        .env("SPILLWAY_CLUSTER__TLS__CA_FILE", &pki.ca_file)
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
        let gateway = pki.component("gateway")?;
        let engine = pki.component("engine")?;
        let management = pki.component("management")?;
        let nameless = pki.component("operator-tool")?;
        let group = |identity: &Identity| -> anyhow::Result<_> {
            Ok(StorageGroupClient::new(tls(&pki, addr, identity)?))
        };
        // Raft from a gateway's or an engine's certificate: refused.
        for (who, identity) in [("gateway", &gateway), ("engine", &engine)] {
            let got = code(group(identity)?.append_entries(garbage()).await);
            anyhow::ensure!(
                got == Some(Code::PermissionDenied),
                "{who} append_entries: {got:?}"
            );
            let add = AddMemberRequest {
                id: 99,
                address: "https://127.0.0.1:9".into(),
            };
            let got = code(group(identity)?.add_member(add).await);
            anyhow::ensure!(
                got == Some(Code::PermissionDenied),
                "{who} add_member: {got:?}"
            );
        }
        // A certificate naming no role: not a role at all.
        let got = code(group(&nameless)?.append_entries(garbage()).await);
        anyhow::ensure!(
            got == Some(Code::Unauthenticated),
            "a certificate naming no role: {got:?}"
        );
        // Naming another role in the call does not change the certificate's.
        let mut claimed = Request::new(garbage());
        claimed
            .metadata_mut()
            .insert(ROLE_METADATA_KEY, "storage".parse()?);
        let got = code(group(&gateway)?.append_entries(claimed).await);
        anyhow::ensure!(
            got == Some(Code::Unauthenticated),
            "a gateway certificate claiming storage: {got:?}"
        );
        // A member's certificate gets through to the message itself.
        let got = code(group(&storage_cert)?.append_entries(garbage()).await);
        anyhow::ensure!(
            got == Some(Code::InvalidArgument),
            "storage append_entries: {got:?}"
        );
        // Management reads the group's status; the engine the store's.
        group(&management)?
            .get_group_status(GroupStatusRequest {})
            .await?;
        StorageClient::new(tls(&pki, addr, &engine)?)
            .status(StatusRequest::default())
            .await?;
        Ok(())
    }
    .await;
    child.kill().await?;
    outcome
}
