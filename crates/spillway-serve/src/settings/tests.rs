//! The settings as loaded: layers, aliases, unknown keys, ranges, TLS and
//! the cluster secret, through [`Settings::load_with_env`].

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::env::{config_vars, ENV_PREFIX};
use super::*;

#[test]
fn the_engine_section_reads_from_a_file_with_units() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("spillway.toml");
    std::fs::write(
        &file,
        "[engine]\nflow_to_disk_threshold = \"32MiB\"\nhousekeeping_interval = \"250ms\"\n",
    )?;
    let settings = Settings::load(Some(&file))?;
    assert_eq!(settings.engine.flow_to_disk_threshold, Some(32 << 20));
    assert_eq!(
        settings.engine.housekeeping_interval,
        Duration::from_millis(250)
    );
    std::fs::write(
        &file,
        "[engine]\nflow_to_disk_threshold = 1048576\nhousekeeping_interval = 100\n",
    )?;
    let settings = Settings::load(Some(&file))?;
    assert_eq!(settings.engine.flow_to_disk_threshold, Some(1 << 20));
    assert_eq!(
        settings.engine.housekeeping_interval,
        Duration::from_millis(100)
    );
    Ok(())
}

#[test]
fn qpid_section_names_are_read_as_the_owning_sections() -> anyhow::Result<()> {
    let (_, result) = load(
        "[broker]\nflow_to_disk_threshold = \"32MiB\"\nconsumer_timeout = \"5s\"\n\
         [store]\noverfull_size = \"1GiB\"\n\
         [[gateway.users]]\nname = \"app\"\npassword = \"p\"\n",
        &[
            ("SPILLWAY_BROKER__SESSION_CREDIT", "7"),
            ("SPILLWAY_STORE__UNDERFULL_SIZE", "1000"),
        ],
    );
    let settings = result?;
    assert_eq!(settings.engine.flow_to_disk_threshold, Some(32 << 20));
    assert_eq!(settings.engine.consumer_timeout, Duration::from_secs(5));
    assert_eq!(settings.engine.session_credit, 7);
    assert_eq!(settings.storage.overfull_size, Some(1 << 30));
    assert_eq!(settings.storage.underfull_size, Some(1000));
    let users: Vec<_> = settings.engine.users.iter().map(|u| &u.name).collect();
    assert_eq!(users, ["app"]);
    Ok(())
}

#[test]
fn a_key_set_under_both_its_names_in_one_layer_is_refused() {
    let (file, result) = load(
        "[broker]\nconsumer_timeout = 5\n[engine]\nconsumer_timeout = 6\n",
        &[
            ("SPILLWAY_STORE__OVERFULL_SIZE", "1"),
            ("SPILLWAY_STORAGE__OVERFULL_SIZE", "2"),
        ],
    );
    let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
    assert_eq!(
        lines,
        [
            format!(
                "`broker.consumer_timeout` and `engine.consumer_timeout` both set in {}: \
                 `broker.consumer_timeout` is another name of `engine.consumer_timeout`; \
                 set one of them",
                file.display()
            ),
            "environment variables SPILLWAY_STORE__OVERFULL_SIZE and \
             SPILLWAY_STORAGE__OVERFULL_SIZE both set: `store.overfull_size` is another \
             name of `storage.overfull_size`; set one of them"
                .to_string(),
        ]
    );
    // Across layers the environment wins, whichever name each uses.
    let (_, result) = load(
        "[engine]\nconsumer_timeout = 6\n",
        &[("SPILLWAY_BROKER__CONSUMER_TIMEOUT", "5")],
    );
    assert_eq!(
        result.map(|s| s.engine.consumer_timeout).ok(),
        Some(Duration::from_millis(5))
    );
}

#[test]
fn an_unknown_key_under_an_alias_is_named_and_suggested_as_written() {
    let (file, result) = load(
        "[broker]\nconsumer_timout = 5\n\
         [[gateway.users]]\nname = \"a\"\npassword = \"p\"\nnme = \"b\"\n",
        &[("SPILLWAY_STORE__OVERFUL_SIZE", "1")],
    );
    let origin = Origin::File(file);
    assert_eq!(
        problems(result),
        [
            unknown(
                "broker.consumer_timout",
                origin.clone(),
                Some("broker.consumer_timeout")
            ),
            unknown(
                "gateway.users[0].nme",
                origin,
                Some("gateway.users[0].name")
            ),
            unknown(
                "store.overful_size",
                Origin::Env("SPILLWAY_STORE__OVERFUL_SIZE".into()),
                Some("store.overfull_size")
            ),
        ]
    );
}

#[test]
fn publisher_pacing_is_on_by_default_and_can_be_set_or_turned_off() -> anyhow::Result<()> {
    let (_, result) = load("", &[]);
    let pacing = result?.engine.pacing();
    assert_eq!(pacing, spillway_engine::PacingConfig::default());
    assert_eq!(pacing.window, spillway_engine::DEFAULT_PACING_WINDOW);
    let (_, result) = load(
        "[engine]\npublisher_pacing_window = 500\npublisher_pacing_stall = \"250ms\"\n",
        &[("SPILLWAY_ENGINE__PUBLISHER_PACING_WINDOW", "0")],
    );
    let pacing = result?.engine.pacing();
    assert_eq!(pacing.window, 0, "the environment wins");
    assert_eq!(pacing.stall, Duration::from_millis(250));
    let (_, result) = load("[engine]\npublisher_pacing_stall = 0\n", &[]);
    let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("`engine.publisher_pacing_stall` = "),
        "{lines:?}"
    );
    Ok(())
}

#[test]
fn message_compression_is_off_by_default_and_takes_its_threshold() -> anyhow::Result<()> {
    let (_, result) = load("", &[]);
    let settings = result?;
    assert_eq!(settings.gateway.compress_above(), None);
    assert_eq!(
        settings.gateway.message_compression_threshold_size,
        16 * 1024
    );
    let (_, result) = load(
        "[gateway]\nmessage_compression_enabled = true\n\
         message_compression_threshold_size = \"32KiB\"\n",
        &[],
    );
    assert_eq!(result?.gateway.compress_above(), Some(32 * 1024));
    // Qpid's names, as the design brief first gave them.
    let (_, result) = load(
        "",
        &[
            ("SPILLWAY_BROKER__MESSAGE_COMPRESSION_ENABLED", "true"),
            (
                "SPILLWAY_CONNECTION__MESSAGE_COMPRESSION_THRESHOLD_SIZE",
                "1024",
            ),
        ],
    );
    assert_eq!(result?.gateway.compress_above(), Some(1024));
    Ok(())
}

/// Loads `toml` from a file, with `vars` as the environment.
fn load(toml: &str, vars: &[(&str, &str)]) -> (PathBuf, Result<Settings, SettingsError>) {
    let dir = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(error) => panic!("no temp dir: {error}"),
    };
    let file = dir.path().join("spillway.toml");
    if let Err(error) = std::fs::write(&file, toml) {
        panic!("writing {}: {error}", file.display());
    }
    let vars = vars
        .iter()
        .map(|(name, value)| (OsString::from(name), OsString::from(value)));
    let result = Settings::load_with_env(Some(&file), vars);
    (file, result)
}

fn problems(result: Result<Settings, SettingsError>) -> Vec<Problem> {
    match result {
        Err(SettingsError::Invalid(problems)) => problems,
        Err(other) => panic!("expected problems, got {other}"),
        Ok(settings) => panic!("expected problems, loaded {settings:?}"),
    }
}

fn unknown(key: &str, origin: Origin, suggestion: Option<&str>) -> Problem {
    Problem::UnknownKey {
        key: key.into(),
        origin,
        suggestion: suggestion.map(Into::into),
    }
}

#[test]
fn an_unknown_key_in_the_file_names_the_file_and_the_nearest_key() {
    let (file, result) = load("[gateway]\nheartbeat_timout = 30\nfram_max = 8192\n", &[]);
    let problems = problems(result);
    let origin = Origin::File(file.clone());
    assert_eq!(
        problems,
        [
            unknown(
                "gateway.fram_max",
                origin.clone(),
                Some("gateway.frame_max")
            ),
            unknown(
                "gateway.heartbeat_timout",
                origin,
                Some("gateway.heartbeat")
            ),
        ]
    );
    assert_eq!(
        problems[1].to_string(),
        format!(
            "unknown key `gateway.heartbeat_timout` in {}; did you mean `gateway.heartbeat`?",
            file.display()
        )
    );
}

#[test]
fn an_unknown_section_and_a_key_far_from_any_are_refused_too() {
    let (file, result) = load("[gatway]\nheartbeat = 30\n[gateway]\nzzz = 1\n", &[]);
    let origin = Origin::File(file.clone());
    assert_eq!(
        problems(result),
        [
            unknown("gateway.zzz", origin.clone(), None),
            unknown("gatway", origin, Some("gateway")),
        ]
    );
    let (_, result) = load("[gatway]\n", &[]);
    assert!(problems(result)[0]
        .to_string()
        .starts_with("unknown section `gatway` in "));
}

#[test]
fn keys_inside_list_entries_are_checked() {
    let toml = "[[engine.users]]\nname = \"a\"\npassword = \"p\"\n\
                [[engine.users]]\nname = \"b\"\npassword = \"p\"\nloopback_onyl = true\n\
                [[management.users]]\nname = \"m\"\npassword = \"p\"\nrole = \"admin\"\n";
    let (file, result) = load(toml, &[]);
    let origin = Origin::File(file);
    assert_eq!(
        problems(result),
        [
            unknown(
                "engine.users[1].loopback_onyl",
                origin.clone(),
                Some("engine.users[1].loopback_only")
            ),
            unknown("management.users[0].role", origin, None),
        ]
    );
}

#[test]
fn an_unknown_environment_variable_is_named_as_set() {
    let (_, result) = load(
        "",
        &[
            ("SPILLWAY_GATEWAY__HEARTBEAT_TIMOUT", "30"),
            ("spillway_Gatway__Frame_Max", "8192"),
            ("SPILLWAY_TELEMETRY__NOPE", "x"),
        ],
    );
    let problems = problems(result);
    assert_eq!(
        problems,
        [
            unknown(
                "gateway.heartbeat_timout",
                Origin::Env("SPILLWAY_GATEWAY__HEARTBEAT_TIMOUT".into()),
                Some("gateway.heartbeat")
            ),
            unknown(
                "gatway.frame_max",
                Origin::Env("spillway_Gatway__Frame_Max".into()),
                Some("gateway.frame_max")
            ),
            unknown(
                "telemetry.nope",
                Origin::Env("SPILLWAY_TELEMETRY__NOPE".into()),
                None
            ),
        ]
    );
    assert_eq!(
        problems[0].to_string(),
        "unknown key `gateway.heartbeat_timout` in environment variable \
         SPILLWAY_GATEWAY__HEARTBEAT_TIMOUT; did you mean SPILLWAY_GATEWAY__HEARTBEAT \
         (`gateway.heartbeat`)?"
    );
}

#[test]
fn other_programs_spillway_variables_are_not_configuration() -> anyhow::Result<()> {
    // Read by the test scripts, the proto test, compose and the loadgen:
    // no double underscore after the prefix.
    let (_, result) = load(
        "",
        &[
            ("SPILLWAY_REGENERATE_PROTO", "1"),
            ("SPILLWAY_BIN", "/usr/bin/spillway"),
            ("SPILLWAY_MANAGEMENT_TOKEN", "secret"),
            ("SPILLWAY_AMQP_ADDR", "127.0.0.1:5672"),
            ("SPILLWAY_LOADGEN_URL", "amqp://localhost"),
            ("SPILLWAY", "x"),
            ("PATH", "/bin"),
            ("SPILLWAY_GATEWAY__HEARTBEAT", "7"),
        ],
    );
    let settings = result?;
    assert_eq!(settings.gateway.heartbeat, 7);
    assert_eq!(settings.management.token, None);
    Ok(())
}

#[test]
fn a_value_of_the_wrong_type_names_its_variable() {
    let (_, result) = load("", &[("SPILLWAY_GATEWAY__FRAME_MAX", "lots")]);
    let problems = problems(result);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(matches!(
        &problems[0],
        Problem::BadValue { origin: Origin::Env(name), error }
            if name == "SPILLWAY_GATEWAY__FRAME_MAX" && error.contains("lots")
    ));
}

#[test]
fn out_of_range_values_name_key_value_origin_and_range() {
    let toml = "[gateway]\nchannel_max = 0\nhandshake_timeout = 0\nmax_message_size = 0\n\
                amqp_listen = \"localhost:5672\"\n\
                [engine]\nflow_to_disk_threshold = 0\n\
                [[engine.users]]\nname = \"app\"\npassword = \"p\"\n\
                [[engine.users]]\nname = \"app\"\npassword = \"q\"\n\
                [[engine.users]]\nname = \"\"\npassword = \"q\"\n\
                [storage]\ndata_dir = \"\"\n\
                [telemetry]\nlog_format = \"jsno\"\nmetrics_listen = \"metrics:9471\"\n";
    let (file, result) = load(toml, &[("SPILLWAY_GATEWAY__FRAME_MAX", "1024")]);
    let problems = problems(result);
    let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
    let file = file.display();
    assert_eq!(
        lines,
        [
            format!(
                "`gateway.amqp_listen` = \"localhost:5672\" (in {file}) is out of range: \
                 a literal IP:port, e.g. \"0.0.0.0:5672\""
            ),
            "`gateway.frame_max` = 1024 (in environment variable \
             SPILLWAY_GATEWAY__FRAME_MAX) is out of range: at least 4096 (AMQP's \
             smallest frame)"
                .to_string(),
            format!("`gateway.channel_max` = 0 (in {file}) is out of range: 1 to 65535"),
            format!(
                "`gateway.max_message_size` = 0 (in {file}) is out of range: from 1 byte to 512 MiB (RabbitMQ's limit)"
            ),
            format!("`gateway.handshake_timeout` = 0 (in {file}) is out of range: more than 0"),
            format!(
                "`engine.users[1].name` = \"app\" (in {file}) is out of range: a name \
                 not already given to engine.users[0]"
            ),
            format!("`engine.users[2].name` = \"\" (in {file}) is out of range: a name"),
            format!(
                "`engine.flow_to_disk_threshold` = 0 (in {file}) is out of range: at \
                 least 1 byte, or unset for 40% of the memory available"
            ),
            format!("`storage.data_dir` = \"\" (in {file}) is out of range: a directory"),
            format!(
                "`telemetry.log_format` = \"jsno\" (in {file}) is out of range: \"text\" \
                 or \"json\""
            ),
            format!(
                "`telemetry.metrics_listen` = \"metrics:9471\" (in {file}) is out of \
                 range: a literal IP:port, e.g. \"127.0.0.1:9471\""
            ),
        ]
    );
}

#[test]
fn an_address_without_its_scheme_or_port_is_refused_naming_the_key() {
    let toml = "[storage]\nnode_id = 1\nlisten = \"http://0.0.0.0:50071\"\n\
                [storage.members]\n1 = \"127.0.0.1:5000\"\n2 = \"http://127.0.0.1:5001\"\n\
                [management]\nengine_addr = \"http://engine\"\nhttp_listen = \"\"\n\
                listen = \"50051\"\n";
    let vars = [
        ("SPILLWAY_GATEWAY__ENGINE_ADDRS", "http://e1:50061,e2:50061"),
        ("SPILLWAY_ENGINE__STORAGE_ADDR", "storage:50071"),
        ("SPILLWAY_TELEMETRY__OTLP_ENDPOINT", "collector:4317"),
    ];
    let (file, result) = load(toml, &vars);
    let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
    let file = file.display();
    let dialled = "is out of range: an address with its scheme, http://host:port \
                   (https://host:port with cluster.tls), e.g. \"http://127.0.0.1:50061\"";
    let listened = "is out of range: host:port (an IP address or a host name, and a \
                    port; no scheme), e.g. \"127.0.0.1:50061\"";
    assert_eq!(
        lines,
        [
            format!(
                "`gateway.engine_addrs` = \"e2:50061\" (in environment variable \
                 SPILLWAY_GATEWAY__ENGINE_ADDRS) {dialled}"
            ),
            format!(
                "`engine.storage_addr` = \"storage:50071\" (in environment variable \
                 SPILLWAY_ENGINE__STORAGE_ADDR) {dialled}"
            ),
            format!("`management.engine_addr` = \"http://engine\" (in {file}) {dialled}"),
            format!("`storage.members.1` = \"127.0.0.1:5000\" (in {file}) {dialled}"),
            "`telemetry.otlp_endpoint` = \"collector:4317\" (in environment variable \
             SPILLWAY_TELEMETRY__OTLP_ENDPOINT) is out of range: an http:// or https:// \
             URL, e.g. \"http://127.0.0.1:4317\""
                .to_string(),
            format!("`storage.listen` = \"http://0.0.0.0:50071\" (in {file}) {listened}"),
            format!("`management.listen` = \"50051\" (in {file}) {listened}"),
        ]
    );
    // The forms that work: with the scheme; listening on a name.
    let good = "[gateway]\nengine_addrs = [\"https://engine-1:50061\"]\n\
                [engine]\nlisten = \"localhost:0\"\nstorage_addr = \"http://[::1]:50071/\"\n\
                [storage]\nlisten = \"[::]:50071\"\n\
                [telemetry]\notlp_endpoint = \"https://collector.example\"\n";
    let (_, result) = load(good, &[]);
    assert!(result.is_ok(), "{result:?}");
}

#[test]
fn heartbeat_bounds_must_hold_the_offered_heartbeat() {
    let (file, result) = load("[gateway]\nmin_heartbeat = 10\nmax_heartbeat = 5\n", &[]);
    let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
    let file = file.display();
    assert_eq!(
        lines,
        [
            format!(
                "`gateway.min_heartbeat` = 10 (in {file}) is out of range: at most \
                 gateway.max_heartbeat"
            ),
            "`gateway.heartbeat` = 60 is out of range: within \
             gateway.min_heartbeat and gateway.max_heartbeat (0 = off only without a \
             maximum)"
                .to_string(),
        ]
    );
    let (_, result) = load(
        "[gateway]\nheartbeat = 30\nmin_heartbeat = 5\nmax_heartbeat = 120\n",
        &[],
    );
    let settings = result.expect("bounds around the offered heartbeat load");
    assert_eq!(settings.gateway.heartbeat_refusal(30), None);
    assert!(settings.gateway.heartbeat_refusal(0).is_some());
}

/// A CA, and a server certificate and key it signed, as PEM files.
fn tls_files(dir: &Path) -> anyhow::Result<(PathBuf, PathBuf, PathBuf)> {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca, rcgen::KeyPair::generate()?)?;
    let key = rcgen::KeyPair::generate()?;
    let cert =
        rcgen::CertificateParams::new(vec!["localhost".to_string()])?.signed_by(&key, &*ca)?;
    let paths = (
        dir.join("server.pem"),
        dir.join("server.key"),
        dir.join("ca.pem"),
    );
    std::fs::write(&paths.0, cert.pem())?;
    std::fs::write(&paths.1, key.serialize_pem())?;
    std::fs::write(&paths.2, ca.pem())?;
    Ok(paths)
}

#[test]
fn tls_settings_load_from_the_file_and_the_environment() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cert, key, ca) = tls_files(dir.path())?;
    let toml = format!(
        "[gateway]\namqps_listen = \"127.0.0.1:5671\"\namqp_listen = \"\"\n\
         [gateway.tls]\ncert_file = {:?}\nkey_file = {:?}\n",
        cert.display().to_string(),
        key.display().to_string()
    );
    let ca_text = ca.display().to_string();
    let (_, result) = load(
        &toml,
        &[
            ("SPILLWAY_GATEWAY__TLS__CA_FILE", &ca_text),
            ("SPILLWAY_GATEWAY__TLS__VERIFY_PEER", "true"),
            (
                "SPILLWAY_MANAGEMENT__TLS__CERT_FILE",
                &cert.display().to_string(),
            ),
            (
                "SPILLWAY_MANAGEMENT__TLS__KEY_FILE",
                &key.display().to_string(),
            ),
        ],
    );
    let settings = result?;
    let gateway = &settings.gateway;
    assert_eq!(gateway.amqp_listen(), None);
    assert_eq!(gateway.amqps_listen(), Some("127.0.0.1:5671"));
    let files = gateway
        .tls
        .files()
        .ok_or_else(|| anyhow::anyhow!("no TLS"))?;
    assert_eq!(files.ca_file.as_deref(), Some(ca.as_path()));
    assert!(files.verify_peer);
    assert!(settings.management.tls.files().is_some());
    // Unset by default; an empty amqps_listen is unset too.
    let (_, result) = load("", &[("SPILLWAY_GATEWAY__AMQPS_LISTEN", "")]);
    let settings = result?;
    assert_eq!(settings.gateway.amqps_listen(), None);
    assert!(settings.gateway.tls.files().is_none());
    Ok(())
}

#[test]
fn tls_problems_name_their_key() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cert, key, _) = tls_files(dir.path())?;
    let cert = cert.display().to_string();
    let key = key.display().to_string();
    let missing = dir.path().join("missing.pem").display().to_string();
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n")?;
    let garbage = garbage.display().to_string();
    let cases: Vec<(Vec<(&str, &str)>, String)> = vec![
        (
            vec![("SPILLWAY_GATEWAY__TLS__CERT_FILE", cert.as_str())],
            "`gateway.tls.key_file` = unset is out of range: the PEM private key of \
                  gateway.tls.cert_file"
                .into(),
        ),
        (
            vec![("SPILLWAY_GATEWAY__AMQPS_LISTEN", "127.0.0.1:5671")],
            "`gateway.tls.cert_file` = unset is out of range: a PEM certificate file \
                  (gateway.amqps_listen is set)"
                .into(),
        ),
        (
            vec![
                ("SPILLWAY_MANAGEMENT__TLS__CERT_FILE", cert.as_str()),
                ("SPILLWAY_MANAGEMENT__TLS__KEY_FILE", key.as_str()),
                ("SPILLWAY_MANAGEMENT__TLS__VERIFY_PEER", "true"),
            ],
            "`management.tls.verify_peer` = true (in environment variable \
                  SPILLWAY_MANAGEMENT__TLS__VERIFY_PEER) is out of range: false unless \
                  management.tls.ca_file is set (the CAs client certificates are checked \
                  against)"
                .into(),
        ),
        (
            vec![
                ("SPILLWAY_GATEWAY__TLS__CERT_FILE", missing.as_str()),
                ("SPILLWAY_GATEWAY__TLS__KEY_FILE", key.as_str()),
            ],
            format!(
                "`gateway.tls.cert_file` = {missing:?} (in environment variable \
                 SPILLWAY_GATEWAY__TLS__CERT_FILE) is out of range: a usable PEM file: \
                 cannot read {missing}: No such file or directory (os error 2)"
            ),
        ),
        (
            vec![
                ("SPILLWAY_GATEWAY__TLS__CERT_FILE", cert.as_str()),
                ("SPILLWAY_GATEWAY__TLS__KEY_FILE", garbage.as_str()),
            ],
            format!(
                "`gateway.tls.key_file` = {garbage:?} (in environment variable \
                 SPILLWAY_GATEWAY__TLS__KEY_FILE) is out of range: a usable PEM file: \
                 {garbage} holds no usable PEM private key (no items found)"
            ),
        ),
        (
            vec![
                ("SPILLWAY_GATEWAY__TLS__CERT_FILE", cert.as_str()),
                ("SPILLWAY_GATEWAY__TLS__KEY_FILE", key.as_str()),
                ("SPILLWAY_GATEWAY__TLS__CA_FILE", garbage.as_str()),
            ],
            format!(
                "`gateway.tls.ca_file` = {garbage:?} (in environment variable \
                 SPILLWAY_GATEWAY__TLS__CA_FILE) is out of range: a usable PEM file: \
                 {garbage} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
            ),
        ),
        (
            vec![("SPILLWAY_GATEWAY__AMQP_LISTEN", "")],
            "`gateway.amqp_listen` = \"\" (in environment variable \
                  SPILLWAY_GATEWAY__AMQP_LISTEN) is out of range: a literal IP:port, e.g. \
                  \"0.0.0.0:5672\" (empty only with gateway.amqps_listen set)"
                .into(),
        ),
    ];
    for (vars, expected) in cases {
        let (_, result) = load("", &vars);
        let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
        assert_eq!(lines, [expected], "{vars:?}");
    }
    Ok(())
}

#[test]
fn cluster_tls_needs_all_three_files_and_names_a_bad_one() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cert, key, ca) = tls_files(dir.path())?;
    let (cert, key, ca) = (
        cert.display().to_string(),
        key.display().to_string(),
        ca.display().to_string(),
    );
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n")?;
    let garbage = garbage.display().to_string();

    let all = [
        ("SPILLWAY_CLUSTER__TLS__CERT_FILE", cert.as_str()),
        ("SPILLWAY_CLUSTER__TLS__KEY_FILE", key.as_str()),
        ("SPILLWAY_CLUSTER__TLS__CA_FILE", ca.as_str()),
    ];
    let (_, result) = load("", &all);
    let settings = result?;
    assert!(settings.cluster.tls.load()?.is_some());
    assert!(Settings::default().cluster.tls.load()?.is_none());

    let (_, result) = load("", &all[..1]);
    let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
    let needs = "is out of range: a PEM file: cluster.tls needs cert_file, key_file and \
                 ca_file together";
    assert_eq!(
        lines,
        [
            format!("`cluster.tls.key_file` = unset {needs}"),
            format!("`cluster.tls.ca_file` = unset {needs}"),
        ]
    );

    let (_, result) = load(
        &format!(
            "[cluster.tls]\ncert_file = {cert:?}\nkey_file = {key:?}\nca_file = {garbage:?}\n"
        ),
        &[],
    );
    let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with(&format!("`cluster.tls.ca_file` = {garbage:?} (in "))
            && lines[0].ends_with("holds no PEM certificate (-----BEGIN CERTIFICATE-----)"),
        "{lines:?}"
    );
    Ok(())
}

#[test]
fn the_cluster_secret_is_checked_read_from_its_file_and_never_shown() -> anyhow::Result<()> {
    const SECRET: &str = "0123456789abcdef0123";
    let (_, result) = load("[cluster]\nsecret = \"0123456789abcdef0123\"\n", &[]);
    let settings = result?;
    assert_eq!(
        settings.cluster.secret.as_ref().map(|s| s.expose()),
        Some(SECRET.as_bytes())
    );
    assert!(!format!("{settings:?}").contains(SECRET));

    let dir = tempfile::tempdir()?;
    let file = dir.path().join("secret");
    std::fs::write(&file, format!("{SECRET}\n"))?;
    let path = file.display().to_string();
    let (_, result) = load("", &[("SPILLWAY_CLUSTER__SECRET_FILE", &path)]);
    let settings = result?;
    assert_eq!(
        settings.cluster.secret.as_ref().map(|s| s.expose()),
        Some(SECRET.as_bytes())
    );

    // All digits arrive from the environment as a number.
    let (_, result) = load("", &[("SPILLWAY_CLUSTER__SECRET", "12345678901234567")]);
    assert_eq!(
        result?.cluster.secret.as_ref().map(|s| s.expose()),
        Some(&b"12345678901234567"[..])
    );

    let (_, result) = load("", &[]);
    assert!(result?.cluster.secret.is_none());
    Ok(())
}

#[test]
fn a_short_doubled_or_unreadable_secret_is_refused() -> anyhow::Result<()> {
    let (file, result) = load("[cluster]\nsecret = \"short one\"\n", &[]);
    let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
    assert_eq!(
        lines,
        [format!(
            "`cluster.secret` = (not shown, 9 bytes) (in {}) is out of range: at least 16 \
             visible ASCII characters; it may hold only visible ASCII characters (no spaces \
             or control characters)",
            file.display()
        )]
    );
    let (_, result) = load("", &[("SPILLWAY_CLUSTER__SECRET", "")]);
    let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
    assert!(lines[0].ends_with("; it is empty"), "{lines:?}");

    let dir = tempfile::tempdir()?;
    let short = dir.path().join("short");
    std::fs::write(&short, "abc\n")?;
    let missing = dir.path().join("missing");
    for (vars, expected) in [
        (
            vec![("SPILLWAY_CLUSTER__SECRET_FILE", short.display().to_string())],
            "in this one it is 3 bytes long; at least 16 are needed",
        ),
        (
            vec![(
                "SPILLWAY_CLUSTER__SECRET_FILE",
                missing.display().to_string(),
            )],
            "a readable file holding the secret (",
        ),
        (
            vec![
                (
                    "SPILLWAY_CLUSTER__SECRET",
                    "0123456789abcdef0123".to_string(),
                ),
                ("SPILLWAY_CLUSTER__SECRET_FILE", short.display().to_string()),
            ],
            "unset while cluster.secret is set: give one of the two",
        ),
    ] {
        let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (_, result) = load("", &vars);
        let lines: Vec<String> = problems(result).iter().map(ToString::to_string).collect();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].starts_with("`cluster.secret_file` = ")
                && lines[0].contains("(in environment variable SPILLWAY_CLUSTER__SECRET_FILE)")
                && lines[0].contains(expected),
            "{lines:?}"
        );
        assert!(!lines[0].contains("0123456789abcdef0123"));
    }
    Ok(())
}

#[test]
fn the_edges_of_each_range_and_documented_zeros_load() -> anyhow::Result<()> {
    let toml = "[gateway]\nframe_max = 4096\nchannel_max = 1\nheartbeat = 0\n\
                max_message_size = 1\nblocked_overdraft = 0\nhandshake_timeout = 1\n\
                max_connections = 0\n\
                [engine]\nsession_credit = 0\n\
                flow_to_disk_threshold = 1\nhousekeeping_interval = 0\n\
                consumer_timeout = 0\n\
                [storage]\noverfull_size = 0\nunderfull_size = 0\n\
                [telemetry]\nlog_format = \"json\"\n";
    let (_, result) = load(toml, &[("SPILLWAY_GATEWAY__CHANNEL_MAX", "65535")]);
    let settings = result?;
    assert_eq!(settings.gateway.frame_max, 4096);
    assert_eq!(settings.gateway.channel_max, 65535);
    assert_eq!(settings.engine.consumer_timeout, Duration::ZERO);
    Ok(())
}

/// The example in `docs/configuration.md` sets every key: it loads, and
/// so do the files and variables the repository ships.
#[test]
fn the_documented_example_and_the_shipped_configuration_load() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/configuration.md"))?;
    let example = doc
        .split("## Example `spillway.toml`")
        .nth(1)
        .and_then(|rest| rest.split("```toml\n").nth(1))
        .and_then(|rest| rest.split("```").next())
        .ok_or_else(|| anyhow::anyhow!("no example in docs/configuration.md"))?;
    let (_, result) = load(example, &[]);
    let settings = result?;
    assert_eq!(settings.storage.underfull_size, Some(8 << 30));
    assert_eq!(settings.engine.users.len(), 2);

    // deploy/users.toml is made on each machine by
    // deploy/admin-credentials.sh: the file it writes, with a password.
    let script = std::fs::read_to_string(root.join("deploy/admin-credentials.sh"))?;
    let users = script
        .split("users.toml\" <<TOML\n")
        .nth(1)
        .and_then(|rest| rest.split("\nTOML\n").next())
        .ok_or_else(|| anyhow::anyhow!("no users.toml in deploy/admin-credentials.sh"))?
        .replace("$password", "made-on-this-machine")
        .replace("\\`", "`");
    let (_, result) = load(&users, &[]);
    let seeded = result?.engine.users;
    assert_eq!(seeded[0].name, "spillway");
    assert_eq!(seeded[0].password, "made-on-this-machine");
    Ok(())
}

/// Every `SPILLWAY_<SECTION>__<KEY>` the scripts, compose file, image,
/// Python suite, test harness and README set is a key the settings read.
#[test]
fn every_variable_the_repository_sets_is_a_known_key() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = vec![
        root.join("README.md"),
        root.join("docker-compose.yml"),
        root.join("deploy/Dockerfile"),
        root.join("crates/spillway-integration-tests/src/lib.rs"),
    ];
    for dir in ["scripts", "scripts/lib", "tests/python"] {
        for entry in std::fs::read_dir(root.join(dir))? {
            let path = entry?.path();
            if path.is_file() {
                files.push(path);
            }
        }
    }
    // Settings that are tables of free keys.
    const TABLES: &[&str] = &["storage.members"];
    let mut seen = 0;
    for file in files {
        let text = std::fs::read_to_string(&file)?;
        for (at, _) in text.match_indices(ENV_PREFIX) {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let vars = config_vars([(OsString::from(&name), OsString::new())]);
            let Some(var) = vars.first() else { continue };
            // Aliases (`broker.*`) are known keys too.
            let mut path = keys::parse(&aliases::resolve(&var.key).0);
            // A table's own keys (`storage.members.1`): the table is
            // the setting.
            let table = keys::render(&path[..path.len().saturating_sub(1)]);
            if TABLES.contains(&table.as_str()) {
                path.pop();
            }
            let known = (1..=path.len()).all(|len| {
                let (parent, last) = path[..len].split_at(len - 1);
                matches!((keys::fields_at::<Settings>(parent), &last[0]),
                    (Some(fields), keys::Segment::Key(key)) if fields.contains(&key.as_str()))
            });
            assert!(known, "{name} in {} is not a setting", file.display());
            seen += 1;
        }
    }
    assert!(seen > 20, "only {seen} variables found");
    Ok(())
}

#[test]
fn the_known_keys_come_from_the_structs() {
    let sections = keys::fields_at::<Settings>(&[]).unwrap_or_default();
    assert!(sections.contains(&"gateway") && sections.contains(&"telemetry"));
    let gateway = keys::fields_at::<Settings>(&[keys::Segment::Key("gateway".into())]);
    assert!(gateway.unwrap_or_default().contains(&"handshake_timeout"));
    let users = keys::fields_at::<Settings>(&[
        keys::Segment::Key("management".into()),
        keys::Segment::Key("users".into()),
        keys::Segment::Index(None),
    ]);
    assert_eq!(users, Some(&["name", "password", "loopback_only"][..]));
    let leaf = keys::fields_at::<Settings>(&[
        keys::Segment::Key("gateway".into()),
        keys::Segment::Key("frame_max".into()),
    ]);
    assert_eq!(leaf, None);
}
