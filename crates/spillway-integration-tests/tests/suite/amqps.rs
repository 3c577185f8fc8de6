//! AMQPS (AMQP over TLS): lapin over TLS with certificates the test makes
//! (`pki`), in both wirings (the gateway is the same code in both; the
//! separate wiring shows the gateway process serving AMQPS and the
//! management process serving TLS).
//!
//! - a publish/consume round trip over AMQPS, beside the plain port;
//! - SASL EXTERNAL with a client certificate: offered only over TLS with a
//!   verified certificate, logs in as the certificate's CN; an unknown CN
//!   gets 403 in the same words as a wrong password;
//! - a plaintext AMQP client on the TLS port is closed at once (logged and
//!   counted), a silent one at `gateway.handshake_timeout`;
//! - an expired, a foreign-CA and a missing client certificate are refused
//!   when `verify_peer` is on;
//! - after close-ok, the broker ends the TLS session with close_notify;
//! - `spillctl` over management TLS, with a client certificate.

use std::time::{Duration, Instant};

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{connection, AMQPClass};
use amq_protocol::types::FieldTable as RawTable;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use spillway_integration_tests::pki::{Identity, Pki};
use spillway_integration_tests::raw;
use spillway_integration_tests::{
    both_wirings, eventually, next_delivery, spillctl_bin, Component, Sandbox, Wiring,
    MANAGEMENT_TOKEN,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

both_wirings!(
    own_sandbox, timeout_secs = 120;
    round_trip_over_amqps,
    external_login_with_a_client_certificate,
    plaintext_and_silent_clients_on_the_tls_port,
    bad_client_certificates_are_refused,
    close_ok_is_followed_by_close_notify,
    spillctl_over_management_tls,
);

/// The user a client certificate names (CN), configured with a password
/// nobody uses.
const CERT_USER: &str = "app";

/// The sandbox configuration: AMQPS beside plain AMQP, with `ca_file` and
/// `verify_peer` as given, `guest` and [`CERT_USER`] as users.
fn config(pki: &Pki, verify_peer: bool, extra: &str) -> String {
    format!(
        "[gateway]\n\
         amqps_listen = \"127.0.0.1:0\"\n\
         handshake_timeout = \"3s\"\n\
         {extra}\n\
         [gateway.tls]\n\
         cert_file = {cert:?}\n\
         key_file = {key:?}\n\
         ca_file = {ca:?}\n\
         verify_peer = {verify_peer}\n\
         [[engine.users]]\n\
         name = \"guest\"\n\
         password = \"guest\"\n\
         loopback_only = true\n\
         [[engine.users]]\n\
         name = \"{CERT_USER}\"\n\
         password = \"not-used-by-the-certificate-test\"\n",
        cert = pki.server.cert.display().to_string(),
        key = pki.server.key.display().to_string(),
        ca = pki.ca_file.display().to_string(),
    )
}

/// lapin over AMQPS to the sandbox, trusting the test CA, presenting
/// `identity` if given, with `userinfo_query` (`guest:guest@` or
/// `?auth_mechanism=external`).
async fn connect_tls(
    sandbox: &Sandbox,
    pki: &Pki,
    identity: Option<&Identity>,
    userinfo: &str,
    query: &str,
) -> anyhow::Result<lapin::Connection> {
    // 127.0.0.1: the name the server certificate's IP SAN matches.
    let uri = format!(
        "amqps://{userinfo}127.0.0.1:{}/%2f{query}",
        sandbox.amqps_addr()?.port()
    );
    let connection = lapin::Connection::connect_with_config(
        &uri,
        lapin::ConnectionProperties::default(),
        pki.lapin_tls(identity)?,
        lapin::runtime::default_runtime()?,
    )
    .await?;
    Ok(connection)
}

/// Waits (5 s at most) until the TLS handshake failures counted reach `count`.
async fn failures_reach(sandbox: &Sandbox, count: f64) -> anyhow::Result<f64> {
    eventually(Duration::from_secs(5), || async {
        tls_handshake_failures(sandbox)
            .await
            .ok()
            .filter(|n| *n >= count)
    })
    .await
}

async fn tls_handshake_failures(sandbox: &Sandbox) -> anyhow::Result<f64> {
    sandbox
        .metric(
            Component::Gateway,
            "spillway_tls_handshake_failures_total{listener=\"amqps\"}",
        )
        .await
}

/// Publishes `body` to `queue` with `user_id` (the gateway checks it
/// against the logged-in user, as RabbitMQ does) and consumes it back.
async fn round_trip(
    connection: &lapin::Connection,
    queue: &str,
    body: &[u8],
    user_id: &str,
) -> anyhow::Result<()> {
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default().with_user_id(user_id.into()),
        )
        .await?
        .await?;
    anyhow::ensure!(confirm.is_ack(), "publish not confirmed: {confirm:?}");
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let delivery = next_delivery(&mut consumer, Duration::from_secs(10)).await?;
    anyhow::ensure!(delivery.data == body, "got {:?}", delivery.data);
    delivery.ack(BasicAckOptions::default()).await?;
    channel.close(200, "bye".into()).await?;
    Ok(())
}

async fn round_trip_over_amqps(wiring: Wiring) -> anyhow::Result<()> {
    let pki = Pki::new()?;
    // Client certificates optional: a client without one logs in with PLAIN.
    let sandbox = Sandbox::start_with_config(wiring, &config(&pki, false, "")).await?;
    let tls = connect_tls(&sandbox, &pki, None, "guest:guest@", "").await?;
    // A body bigger than one TLS record (16 KiB) and than one frame.
    let body: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    round_trip(&tls, "over-tls", &body, "guest").await?;
    tls.close(200, "bye".into()).await?;
    // TLS 1.2 clients are served too.
    let mut tls12 = tls_stream(&sandbox, &pki, None, &[&rustls::version::TLS12]).await?;
    offered_mechanisms(&mut tls12).await?;
    anyhow::ensure!(tls12.get_ref().1.protocol_version() == Some(rustls::ProtocolVersion::TLSv1_2));
    drop(tls12);
    // The plain port still serves beside it.
    sandbox.serves_a_fresh_client().await?;
    anyhow::ensure!(tls_handshake_failures(&sandbox).await? == 0.0);
    Ok(())
}

/// connection.start's mechanisms on a raw connection over `stream`.
async fn offered_mechanisms<S>(stream: &mut S) -> anyhow::Result<String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    stream.write_all(raw::HEADER).await?;
    match raw::read_frame(stream).await? {
        AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Start(start))) => {
            Ok(String::from_utf8_lossy(start.mechanisms.as_bytes()).into_owned())
        }
        other => anyhow::bail!("expected connection.start, got {other:?}"),
    }
}

/// A raw TLS connection to the AMQPS port, speaking `versions`.
async fn tls_stream(
    sandbox: &Sandbox,
    pki: &Pki,
    identity: Option<&Identity>,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let connector = tokio_rustls::TlsConnector::from(pki.rustls_client(identity, versions)?);
    let socket = TcpStream::connect(sandbox.amqps_addr()?).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    Ok(connector.connect(name, socket).await?)
}

async fn external_login_with_a_client_certificate(wiring: Wiring) -> anyhow::Result<()> {
    let pki = Pki::new()?;
    let sandbox = Sandbox::start_with_config(wiring, &config(&pki, true, "")).await?;
    let client = pki.client(CERT_USER)?;

    // EXTERNAL is offered with a verified certificate, never on plain TCP.
    let mut tls = tls_stream(&sandbox, &pki, Some(&client), rustls::ALL_VERSIONS).await?;
    let mechanisms = offered_mechanisms(&mut tls).await?;
    anyhow::ensure!(
        mechanisms.split(' ').any(|m| m == "EXTERNAL"),
        "{mechanisms}"
    );
    drop(tls);
    let mut plain = TcpStream::connect(sandbox.amqp_addr()).await?;
    let mechanisms = offered_mechanisms(&mut plain).await?;
    anyhow::ensure!(!mechanisms.contains("EXTERNAL"), "{mechanisms}");
    // Nor accepted there, whatever the client claims.
    let start_ok = connection::StartOk {
        client_properties: RawTable::default(),
        mechanism: "EXTERNAL".into(),
        response: "".into(),
        locale: "en_US".into(),
    };
    plain
        .write_all(&raw::method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
        )?)
        .await?;
    let (code, text) = raw::read_until_connection_close(&mut plain).await?;
    anyhow::ensure!(code == 403 && text.contains("EXTERNAL"), "{code} {text}");

    // Logged in as the CN: a publish with user_id = app is accepted (and one
    // claiming guest would not be).
    let connection = connect_tls(
        &sandbox,
        &pki,
        Some(&client),
        "",
        "?auth_mechanism=external",
    )
    .await?;
    round_trip(&connection, "external", b"by certificate", CERT_USER).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let claimed = tokio::time::timeout(Duration::from_secs(10), async {
        match channel
            .basic_publish(
                "".into(),
                "external".into(),
                BasicPublishOptions::default(),
                b"not me",
                BasicProperties::default().with_user_id("guest".into()),
            )
            .await
        {
            Ok(confirm) => confirm.await.map(|confirm| confirm.is_ack()),
            Err(error) => Err(error),
        }
    })
    .await
    .map_err(|_| anyhow::anyhow!("no answer to a publish claiming another user"))?;
    anyhow::ensure!(
        !matches!(claimed, Ok(true)),
        "a user_id other than the certificate's user was accepted"
    );
    connection.close(200, "bye".into()).await?;

    // A certificate for a user nobody configured: 403, in the words a wrong
    // password gets.
    let nobody = pki.client("nobody")?;
    let by_certificate = connect_tls(
        &sandbox,
        &pki,
        Some(&nobody),
        "",
        "?auth_mechanism=external",
    )
    .await
    .err()
    .map(|e| e.to_string())
    .ok_or_else(|| anyhow::anyhow!("an unknown CN logged in"))?;
    let by_password = connect_tls(&sandbox, &pki, Some(&client), "nobody:wrong@", "")
        .await
        .err()
        .map(|e| e.to_string())
        .ok_or_else(|| anyhow::anyhow!("an unknown user logged in"))?;
    anyhow::ensure!(
        by_certificate
            .contains("ACCESS_REFUSED - Login was refused using authentication mechanism EXTERNAL"),
        "{by_certificate}"
    );
    // The same words, but for the mechanism's name, as RabbitMQ's.
    anyhow::ensure!(
        by_certificate.replace("EXTERNAL", "PLAIN") == by_password,
        "EXTERNAL: {by_certificate}\nPLAIN: {by_password}"
    );
    Ok(())
}

async fn plaintext_and_silent_clients_on_the_tls_port(wiring: Wiring) -> anyhow::Result<()> {
    let pki = Pki::new()?;
    let sandbox = Sandbox::start_with_config(wiring, &config(&pki, false, "")).await?;
    let before = tls_handshake_failures(&sandbox).await?;

    // A plaintext AMQP client: refused at its first bytes, well before the
    // 3 s handshake timeout, and never answered in AMQP.
    let started = Instant::now();
    let mut plain = TcpStream::connect(sandbox.amqps_addr()?).await?;
    plain.write_all(raw::HEADER).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), plain.read_to_end(&mut answer))
        .await
        .map_err(|_| anyhow::anyhow!("a plaintext client was not closed within 2 s"))?
        .ok();
    anyhow::ensure!(!answer.starts_with(b"AMQP"), "answered in AMQP: {answer:?}");
    let plaintext_took = started.elapsed();
    anyhow::ensure!(
        plaintext_took < Duration::from_secs(2),
        "{plaintext_took:?}"
    );
    failures_reach(&sandbox, before + 1.0).await?;

    // A client that connects and says nothing: the TLS handshake is inside
    // gateway.handshake_timeout (3 s).
    let started = Instant::now();
    let mut silent = TcpStream::connect(sandbox.amqps_addr()?).await?;
    raw::closed_within(&mut silent, Duration::from_secs(8)).await?;
    let silent_took = started.elapsed();
    anyhow::ensure!(
        silent_took >= Duration::from_millis(2500),
        "closed after {silent_took:?}, before the handshake timeout"
    );
    failures_reach(&sandbox, before + 2.0).await?;
    eprintln!("plaintext client closed in {plaintext_took:?}, silent one in {silent_took:?}");
    sandbox.serves_a_fresh_client().await?;
    Ok(())
}

async fn bad_client_certificates_are_refused(wiring: Wiring) -> anyhow::Result<()> {
    let pki = Pki::new()?;
    let sandbox = Sandbox::start_with_config(wiring, &config(&pki, true, "")).await?;
    let before = tls_handshake_failures(&sandbox).await?;
    let expired = pki.expired_client(CERT_USER)?;
    let stranger = pki.stranger_client(CERT_USER)?;
    for (what, identity) in [
        ("an expired certificate", Some(&expired)),
        ("a certificate from another CA", Some(&stranger)),
        ("no certificate", None),
    ] {
        let attempt = tokio::time::timeout(
            Duration::from_secs(10),
            connect_tls(&sandbox, &pki, identity, "guest:guest@", ""),
        )
        .await
        .map_err(|_| anyhow::anyhow!("{what}: neither refused nor let in within 10 s"))?;
        match attempt {
            Ok(connection) => {
                let _ = connection.close(200, "bye".into()).await;
                anyhow::bail!("{what} was let in");
            }
            Err(error) => eprintln!("{what}: {error}"),
        }
    }
    failures_reach(&sandbox, before + 3.0).await?;
    // The good certificate still gets in.
    let client = pki.client(CERT_USER)?;
    let connection = connect_tls(
        &sandbox,
        &pki,
        Some(&client),
        "",
        "?auth_mechanism=external",
    )
    .await?;
    connection.close(200, "bye".into()).await?;
    Ok(())
}

/// A raw TLS client completes the handshake as guest, closes, reads
/// close-ok, and then sees a clean end of the TLS session: tokio-rustls
/// reads 0 only after close_notify (a bare TCP close is an error).
async fn close_ok_is_followed_by_close_notify(wiring: Wiring) -> anyhow::Result<()> {
    let pki = Pki::new()?;
    let sandbox = Sandbox::start_with_config(wiring, &config(&pki, false, "")).await?;
    let mut tls = tls_stream(&sandbox, &pki, None, &[&rustls::version::TLS13]).await?;
    offered_mechanisms(&mut tls).await?;
    let start_ok = connection::StartOk {
        client_properties: RawTable::default(),
        mechanism: "PLAIN".into(),
        response: "\0guest\0guest".into(),
        locale: "en_US".into(),
    };
    tls.write_all(&raw::method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
    )?)
    .await?;
    let AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Tune(tune))) =
        raw::read_frame(&mut tls).await?
    else {
        anyhow::bail!("expected connection.tune");
    };
    let mut bytes = raw::method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: tune.channel_max,
            frame_max: tune.frame_max,
            heartbeat: 0,
        })),
    )?;
    bytes.extend(raw::method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    )?);
    tls.write_all(&bytes).await?;
    let AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))) =
        raw::read_frame(&mut tls).await?
    else {
        anyhow::bail!("expected connection.open-ok");
    };
    tls.write_all(&raw::method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )?)
    .await?;
    let AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))) =
        raw::read_frame(&mut tls).await?
    else {
        anyhow::bail!("expected connection.close-ok");
    };
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut rest))
        .await
        .map_err(|_| anyhow::anyhow!("the broker did not end the TLS session"))?
        .map_err(|error| anyhow::anyhow!("the TLS session ended without close_notify: {error}"))?;
    anyhow::ensure!(rest.is_empty(), "bytes after close-ok: {rest:?}");
    let (_, session) = tls.get_ref();
    anyhow::ensure!(
        session.protocol_version() == Some(rustls::ProtocolVersion::TLSv1_3),
        "{:?}",
        session.protocol_version()
    );
    Ok(())
}

/// Runs spillctl's `vhost list` with `flags` before the command;
/// (success, stdout, stderr).
fn spillctl(sandbox: &Sandbox, flags: &[&str]) -> anyhow::Result<(bool, String, String)> {
    let args = [flags, &["--output", "json", "vhost", "list"]].concat();
    sandbox.spillctl_as(MANAGEMENT_TOKEN, &args)
}

async fn spillctl_over_management_tls(wiring: Wiring) -> anyhow::Result<()> {
    let pki = Pki::new()?;
    let operator = pki.client("operator")?;
    let management = format!(
        "[management.tls]\ncert_file = {:?}\nkey_file = {:?}\nca_file = {:?}\nverify_peer = true\n",
        pki.server.cert.display().to_string(),
        pki.server.key.display().to_string(),
        pki.ca_file.display().to_string(),
    );
    let config = format!("{}{management}", config(&pki, false, ""));
    let sandbox = Sandbox::start_with_config(wiring, &config).await?;
    let ca = pki.ca_file.display().to_string();
    let cert = operator.cert.display().to_string();
    let key = operator.key.display().to_string();

    let (ok, stdout, stderr) = spillctl(
        &sandbox,
        &["--tls-ca", &ca, "--tls-cert", &cert, "--tls-key", &key],
    )?;
    anyhow::ensure!(ok && stdout.contains("\"/\""), "{stdout}\n{stderr}");

    // Without a client certificate, without TLS, or trusting another CA: no.
    let other_ca = pki.stranger_ca_file.display().to_string();
    for flags in [
        vec!["--tls-ca", ca.as_str()],
        vec![],
        vec![
            "--tls-ca",
            other_ca.as_str(),
            "--tls-cert",
            cert.as_str(),
            "--tls-key",
            key.as_str(),
        ],
    ] {
        let (ok, stdout, stderr) = spillctl(&sandbox, &flags)?;
        anyhow::ensure!(!ok, "spillctl {flags:?} got in: {stdout}");
        eprintln!("spillctl {flags:?}: {}", stderr.trim());
    }
    // An https address without a CA says what is missing.
    let (ok, _, stderr) = std::process::Command::new(spillctl_bin()?)
        .arg("--addr")
        .arg(format!("https://{}", sandbox.management_addr()))
        .args(["vhost", "list"])
        .output()
        .map(|o| {
            (
                o.status.success(),
                (),
                String::from_utf8_lossy(&o.stderr).into_owned(),
            )
        })?;
    anyhow::ensure!(!ok && stderr.contains("--tls-ca"), "{stderr}");

    // RabbitMQ's HTTP API on the same terms: HTTPS with a client
    // certificate; without one, or in plain text, nothing.
    // (This guest has no management tag: the operator's token.)
    let whoami = format!(
        "GET /api/whoami HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\nauthorization: Bearer {MANAGEMENT_TOKEN}\r\n\r\n"
    );
    let whoami = whoami.as_bytes();
    let answer = https_exchange(&sandbox, &pki, Some(&operator), whoami).await?;
    anyhow::ensure!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("administrator"),
        "{answer}"
    );
    let refused = https_exchange(&sandbox, &pki, None, whoami).await;
    anyhow::ensure!(
        refused.as_ref().map_or(true, |answer| answer.is_empty()),
        "HTTPS without a client certificate got in: {refused:?}"
    );
    let mut plain = TcpStream::connect(sandbox.management_http_addr()).await?;
    plain.write_all(whoami).await?;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), plain.read_to_end(&mut answer)).await;
    anyhow::ensure!(
        !String::from_utf8_lossy(&answer).contains("administrator"),
        "plain HTTP got an answer"
    );
    Ok(())
}

/// `request` over HTTPS to the management HTTP API; the whole answer.
async fn https_exchange(
    sandbox: &Sandbox,
    pki: &Pki,
    identity: Option<&Identity>,
    request: &[u8],
) -> anyhow::Result<String> {
    let versions = [&rustls::version::TLS13];
    let connector = tokio_rustls::TlsConnector::from(pki.rustls_client(identity, &versions)?);
    let socket = TcpStream::connect(sandbox.management_http_addr()).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    let mut stream = connector.connect(name, socket).await?;
    stream.write_all(request).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await??;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}
