//! A configuration Spillway cannot mean stops the real binary before it
//! listens: a misspelt key in the `--config` file or in a `SPILLWAY_...`
//! variable, or a value out of range, exits non-zero at once, every role
//! alike, with the key, where it was set and the nearest known key on
//! stderr. Other programs' `SPILLWAY_...` variables do not count. The
//! in-process wiring reads the same file through `Settings::load`: its
//! sandbox refuses to start with the same message.
//!
//! Not `both_wirings!`: the separate-process sandbox waits for ready files,
//! so these start the binary themselves and wait for it to exit.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use spillway_integration_tests::{eventually, spillway_bin, Sandbox, Wiring};
use tokio::process::Command;

/// A refused start takes milliseconds; this is only a bound for a binary
/// that (wrongly) keeps running.
const EXIT_DEADLINE: Duration = Duration::from_secs(20);

const ROLES: [&str; 5] = ["all-in-one", "gateway", "engine", "storage", "management"];

/// How one run of the binary ended.
struct Exit {
    code: Option<i32>,
    stderr: String,
    took: Duration,
    ready_written: bool,
}

/// Runs `spillway [--config FILE] --ready-file … ROLE` with `env` on
/// ephemeral ports in `dir`, and waits for it to exit.
async fn run(
    dir: &Path,
    role: &str,
    config: Option<&Path>,
    env: &[(&str, &str)],
) -> anyhow::Result<Exit> {
    let ready = dir.join(format!("{role}.ready"));
    let mut command = Command::new(spillway_bin()?);
    if let Some(config) = config {
        command.arg("--config").arg(config);
    }
    command
        .arg("--ready-file")
        .arg(&ready)
        .arg(role)
        .current_dir(dir)
        .env("SPILLWAY_GATEWAY__AMQP_LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_ENGINE__LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_STORAGE__LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_MANAGEMENT__LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_MANAGEMENT__HTTP_LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_TELEMETRY__METRICS_LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_STORAGE__DATA_DIR", dir.join("data"))
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let started = Instant::now();
    let child = command.spawn()?;
    let output = tokio::time::timeout(EXIT_DEADLINE, child.wait_with_output())
        .await
        .map_err(|_| anyhow::anyhow!("spillway {role} still running after {EXIT_DEADLINE:?}"))??;
    Ok(Exit {
        code: output.status.code(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        took: started.elapsed(),
        ready_written: ready.exists(),
    })
}

fn assert_refused(exit: &Exit, role: &str, expected: &[&str]) {
    assert!(
        exit.code.is_some_and(|code| code != 0),
        "spillway {role} exited with {:?}:\n{}",
        exit.code,
        exit.stderr
    );
    assert!(!exit.ready_written, "spillway {role} got ready first");
    for text in expected {
        assert!(
            exit.stderr.contains(text),
            "spillway {role}: `{text}` not on stderr:\n{}",
            exit.stderr
        );
    }
    assert!(
        !exit.stderr.contains("spillway ready"),
        "spillway {role} listened:\n{}",
        exit.stderr
    );
}

#[tokio::test]
async fn a_misspelt_key_in_the_config_file_stops_every_role() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("broker.toml");
    std::fs::write(
        &config,
        "[gateway]\nheartbeat_timout = 30\n\n[[engine.users]]\nname = \"app\"\n\
         password = \"p\"\nloopback_onyl = true\n",
    )?;
    for role in ROLES {
        let exit = run(dir.path(), role, Some(&config), &[]).await?;
        assert_refused(
            &exit,
            role,
            &[
                &format!(
                    "unknown key `gateway.heartbeat_timout` in {}; did you mean `gateway.heartbeat`?",
                    config.display()
                ),
                &format!(
                    "unknown key `engine.users[0].loopback_onyl` in {}; did you mean \
                     `engine.users[0].loopback_only`?",
                    config.display()
                ),
            ],
        );
        eprintln!("spillway {role} refused the file in {:?}", exit.took);
    }
    Ok(())
}

#[tokio::test]
async fn a_misspelt_environment_variable_stops_every_role() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    for role in ROLES {
        let exit = run(
            dir.path(),
            role,
            None,
            &[("SPILLWAY_GATEWAY__FRAME_MX", "8192")],
        )
        .await?;
        assert_refused(
            &exit,
            role,
            &["unknown key `gateway.frame_mx` in environment variable \
               SPILLWAY_GATEWAY__FRAME_MX; did you mean SPILLWAY_GATEWAY__FRAME_MAX \
               (`gateway.frame_max`)?"],
        );
        eprintln!("spillway {role} refused the variable in {:?}", exit.took);
    }
    Ok(())
}

#[tokio::test]
async fn out_of_range_values_stop_the_broker() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("spillway.toml");
    std::fs::write(&config, "[gateway]\nchannel_max = 0\n")?;
    // `spillway.toml` in the current directory, no --config.
    let exit = run(
        dir.path(),
        "all-in-one",
        None,
        &[("SPILLWAY_GATEWAY__FRAME_MAX", "1024")],
    )
    .await?;
    assert_refused(
        &exit,
        "all-in-one",
        &[
            "`gateway.frame_max` = 1024 (in environment variable SPILLWAY_GATEWAY__FRAME_MAX) \
             is out of range: at least 4096",
            "`gateway.channel_max` = 0 (in spillway.toml) is out of range: 1 to 65535",
        ],
    );
    Ok(())
}

#[tokio::test]
async fn other_programs_spillway_variables_do_not_stop_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let ready = dir.path().join("all-in-one.ready");
    let mut child = Command::new(spillway_bin()?)
        .arg("--ready-file")
        .arg(&ready)
        .current_dir(dir.path())
        .env("SPILLWAY_GATEWAY__AMQP_LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_MANAGEMENT__LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_MANAGEMENT__HTTP_LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_TELEMETRY__METRICS_LISTEN", "127.0.0.1:0")
        .env("SPILLWAY_STORAGE__DATA_DIR", dir.path().join("data"))
        .env("SPILLWAY_REGENERATE_PROTO", "1")
        .env("SPILLWAY_MANAGEMENT_TOKEN", "not-a-setting")
        .env("SPILLWAY_LOADGEN_URL", "amqp://localhost")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let started = eventually(Duration::from_secs(60), || {
        let outcome = match child.try_wait() {
            Ok(Some(status)) => Err(anyhow::anyhow!("spillway exited with {status}")),
            _ if ready.exists() => Ok(()),
            _ => Err(anyhow::anyhow!("not ready yet")),
        };
        async move { outcome }
    })
    .await;
    child.kill().await?;
    started?;
    Ok(())
}

#[tokio::test]
async fn the_in_process_sandbox_refuses_the_same_file() -> anyhow::Result<()> {
    let refused =
        Sandbox::start_with_config(Wiring::InProcess, "[engine]\nsession_credits = 16\n").await;
    let Err(error) = refused else {
        anyhow::bail!("the in-process sandbox started with an unknown key");
    };
    let message = format!("{error:#}");
    assert!(
        message.contains("unknown key `engine.session_credits`")
            && message.contains("did you mean `engine.session_credit`?"),
        "{message}"
    );
    Ok(())
}

/// TLS files that cannot work stop every role before it listens, naming
/// the key: a certificate without its key, a file that cannot be read, one
/// that holds no certificate, `verify_peer` without a CA, AMQPS without a
/// certificate.
#[tokio::test]
async fn unusable_tls_settings_stop_every_role() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = spillway_integration_tests::pki::Pki::new()?;
    let cert_text = pki.server.cert.display().to_string();
    let key_text = pki.server.key.display().to_string();
    let missing_text = dir.path().join("missing.pem").display().to_string();
    let (cert, key, missing) = (&*cert_text, &*key_text, &*missing_text);
    let cases: [(&[(&str, &str)], String); 5] = [
        (
            &[("SPILLWAY_GATEWAY__TLS__CERT_FILE", cert)],
            "`gateway.tls.key_file` = unset is out of range: the PEM private key of \
             gateway.tls.cert_file"
                .into(),
        ),
        (
            &[
                ("SPILLWAY_MANAGEMENT__TLS__CERT_FILE", missing),
                ("SPILLWAY_MANAGEMENT__TLS__KEY_FILE", key),
            ],
            format!(
                "`management.tls.cert_file` = {missing:?} (in environment variable \
                 SPILLWAY_MANAGEMENT__TLS__CERT_FILE) is out of range: a usable PEM file: \
                 cannot read {missing}"
            ),
        ),
        (
            &[
                ("SPILLWAY_GATEWAY__TLS__CERT_FILE", key),
                ("SPILLWAY_GATEWAY__TLS__KEY_FILE", key),
            ],
            format!("`gateway.tls.cert_file` = {key:?} (in environment variable SPILLWAY_GATEWAY__TLS__CERT_FILE) is out of range: a usable PEM file: {key} holds no PEM certificate"),
        ),
        (
            &[
                ("SPILLWAY_GATEWAY__TLS__CERT_FILE", cert),
                ("SPILLWAY_GATEWAY__TLS__KEY_FILE", key),
                ("SPILLWAY_GATEWAY__TLS__VERIFY_PEER", "true"),
            ],
            "`gateway.tls.verify_peer` = true (in environment variable \
             SPILLWAY_GATEWAY__TLS__VERIFY_PEER) is out of range: false unless \
             gateway.tls.ca_file is set"
                .into(),
        ),
        (
            &[("SPILLWAY_GATEWAY__AMQPS_LISTEN", "127.0.0.1:0")],
            "`gateway.tls.cert_file` = unset is out of range: a PEM certificate file \
             (gateway.amqps_listen is set)"
                .into(),
        ),
    ];
    for (env, expected) in &cases {
        for role in ROLES {
            let exit = run(dir.path(), role, None, env).await?;
            assert_refused(&exit, role, &[expected.as_str()]);
        }
    }
    Ok(())
}

/// A role, its environment, and the line its refusal must hold.
type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], String);

/// An address a role dials without its scheme (`127.0.0.1:5000` for
/// `http://127.0.0.1:5000`) stops start-up, naming the setting and the
/// expected form, rather than failing every second for ever as a transport
/// error; a gRPC listen address that is not host:port stops it too.
#[tokio::test]
async fn an_address_without_its_scheme_stops_start_up() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let dialled = "is out of range: an address with its scheme, http://host:port \
                   (https://host:port with cluster.tls), e.g. \"http://127.0.0.1:50061\"";
    let cases: [Case; 4] = [
        (
            "storage",
            &[
                ("SPILLWAY_STORAGE__NODE_ID", "1"),
                ("SPILLWAY_STORAGE__MEMBERS__1", "127.0.0.1:5000"),
                ("SPILLWAY_STORAGE__MEMBERS__2", "http://127.0.0.1:5001"),
            ],
            format!(
                "`storage.members.1` = \"127.0.0.1:5000\" (in environment variable \
                 SPILLWAY_STORAGE__MEMBERS__1) {dialled}"
            ),
        ),
        (
            "gateway",
            &[("SPILLWAY_GATEWAY__ENGINE_ADDR", "localhost:50061")],
            format!(
                "`gateway.engine_addr` = \"localhost:50061\" (in environment variable \
                 SPILLWAY_GATEWAY__ENGINE_ADDR) {dialled}"
            ),
        ),
        (
            "engine",
            &[(
                "SPILLWAY_ENGINE__STORAGE_ADDRS",
                "http://127.0.0.1:50071,127.0.0.1:50072",
            )],
            format!(
                "`engine.storage_addrs` = \"127.0.0.1:50072\" (in environment variable \
                 SPILLWAY_ENGINE__STORAGE_ADDRS) {dialled}"
            ),
        ),
        (
            "engine",
            &[("SPILLWAY_ENGINE__LISTEN", "http://127.0.0.1:0")],
            "`engine.listen` = \"http://127.0.0.1:0\" (in environment variable \
             SPILLWAY_ENGINE__LISTEN) is out of range: host:port (an IP address or a host \
             name, and a port; no scheme), e.g. \"127.0.0.1:50061\""
                .into(),
        ),
    ];
    for (role, env, expected) in &cases {
        let exit = run(dir.path(), role, None, env).await?;
        assert_refused(&exit, role, &[expected.as_str()]);
        assert!(
            !exit.stderr.contains("transport error"),
            "spillway {role} dialled:\n{}",
            exit.stderr
        );
    }
    Ok(())
}

/// An expected start-up failure is one `error:` line with its causes, and
/// exit status 1: no backtrace, even when the environment asks for one.
#[tokio::test]
async fn a_port_in_use_is_one_line_and_no_backtrace() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?.to_string();
    let exit = run(
        dir.path(),
        "all-in-one",
        None,
        &[
            ("SPILLWAY_GATEWAY__AMQP_LISTEN", addr.as_str()),
            ("RUST_BACKTRACE", "1"),
            ("RUST_LIB_BACKTRACE", "1"),
        ],
    )
    .await?;
    assert_refused(&exit, "all-in-one", &["binding the AMQP port"]);
    assert_eq!(exit.code, Some(1), "{}", exit.stderr);
    let error_lines: Vec<&str> = exit
        .stderr
        .lines()
        .filter(|line| line.starts_with("error: "))
        .collect();
    assert_eq!(error_lines.len(), 1, "{}", exit.stderr);
    assert!(
        error_lines[0].contains(&addr) && error_lines[0].contains("in use"),
        "the one line names the address and why: {}",
        error_lines[0]
    );
    assert!(
        !exit.stderr.to_lowercase().contains("backtrace"),
        "{}",
        exit.stderr
    );
    drop(taken);
    Ok(())
}
