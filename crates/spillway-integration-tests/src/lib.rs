//! A sandbox that starts a Spillway broker for a test, in one of its wirings,
//! on ephemeral ports and a temporary data directory, and stops everything it
//! started when dropped.
//!
//! - [`Wiring::InProcess`]: every component in the test's own process, calls
//!   across boundaries in-process (the all-in-one broker).
//! - [`Wiring::Separate`]: storage, engine and gateway as three `spillway`
//!   processes talking gRPC.
//! - [`Wiring::AllInOneProcess`]: the all-in-one broker as one child process,
//!   for tests that SIGKILL it.
//!
//! The management API listens on an ephemeral port in every wiring (in
//! `Separate`, as a fourth process): [`Sandbox::management_addr`], with
//! [`MANAGEMENT_TOKEN`] as its bearer token.
//!
//! In `Separate` the processes share a cluster secret made for the sandbox
//! (random, in a file read through `SPILLWAY_CLUSTER__SECRET_FILE`):
//! [`Sandbox::cluster_client`] is what an internal gRPC client of the
//! sandbox needs. A configuration with `[cluster.tls]` runs them over mutual
//! TLS too ([`pki::Pki::cluster_tls_toml`]).
//!
//! Every process serves `/metrics` and `/healthz` on an ephemeral port too:
//! [`Sandbox::metrics_addr`] tells where, [`http_get`] fetches them.
//!
//! [`harness`] runs a case in both wirings ([`both_wirings!`]) and waits for
//! conditions with a deadline ([`eventually`]).
//!
//! Child processes need the release binary (`cargo build --release -p
//! spillway`; the Makefile builds it before the tests): `SPILLWAY_BIN`
//! overrides where it is looked for.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::sync::Arc;

use anyhow::{bail, Context};
use spillway_proto::cluster::{ClusterClient, ClusterRole, ClusterSecret, ClusterTls};
use spillway_proto::storage::StoreStatus;
use spillway_proto::storage::{RemoteStorage, StorageApi};
use spillway_serve::{Role, Running, Settings};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub mod amqp;
pub mod amqp1_raw;
pub mod group;
pub mod harness;
pub mod pki;
pub mod raw;

pub use harness::{eventually, run_case, run_wiring_case, CaseFuture, ProbeOutcome};

/// The management bearer token every sandbox configures.
pub const MANAGEMENT_TOKEN: &str = "sandbox-management-token";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wiring {
    InProcess,
    Separate,
    AllInOneProcess,
}

/// A component whose process's `/metrics` a test wants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    Gateway,
    Engine,
    Storage,
}

impl Component {
    fn role(self) -> &'static str {
        match self {
            Component::Gateway => "gateway",
            Component::Engine => "engine",
            Component::Storage => "storage",
        }
    }
}

/// The management API's client, as [`Sandbox::management`] makes it.
pub type Management = spillway_proto::management::management_client::ManagementClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Credentials>,
>;

/// Adds an `authorization` header (a bearer token or basic credentials) to
/// every call.
#[derive(Clone)]
pub struct Credentials(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for Credentials {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        request
            .metadata_mut()
            .insert("authorization", self.0.clone());
        Ok(request)
    }
}

pub struct Sandbox {
    wiring: Wiring,
    dir: tempfile::TempDir,
    /// `spillway.toml` for every process, when the test gave one.
    config: Option<PathBuf>,
    /// The storage node's gRPC address (separate wiring).
    storage: Option<SocketAddr>,
    /// The engine's gRPC address (separate wiring).
    engine: Option<SocketAddr>,
    /// The cluster secret the separate processes share.
    secret: ClusterSecret,
    /// The cluster's mutual TLS, when the configuration sets `cluster.tls`.
    cluster_tls: Option<ClusterTls>,
    amqp: SocketAddr,
    /// The AMQPS address, when the configuration sets `gateway.amqps_listen`.
    amqps: Option<SocketAddr>,
    management: SocketAddr,
    /// RabbitMQ's management HTTP API (`management.http_listen`).
    management_http: SocketAddr,
    /// Where the store lives, when not in the sandbox's own directory.
    data_dir: Option<PathBuf>,
    /// Role (`all-in-one`, `storage`, `engine`, `gateway`) → its `/metrics`
    /// address, from the ready files.
    metrics: BTreeMap<&'static str, SocketAddr>,
    in_process: Option<Running>,
    /// Started in dependency order; stopped in reverse.
    children: Vec<(String, Child)>,
    /// Whether booting waits for start-up recovery to complete.
    await_recovery: bool,
}

impl Sandbox {
    pub async fn start(wiring: Wiring) -> anyhow::Result<Self> {
        Self::start_with_config(wiring, "").await
    }

    /// Starts with `config` (TOML, as in `spillway.toml`) for every process.
    pub async fn start_with_config(wiring: Wiring, config: &str) -> anyhow::Result<Self> {
        Self::start_on(wiring, config, None).await
    }

    /// Starts with `config`, the store in `data_dir` (e.g. a small tmpfs)
    /// rather than in the sandbox's own temporary directory.
    pub async fn start_on(
        wiring: Wiring,
        config: &str,
        data_dir: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        Self::start_with(wiring, config, data_dir, true).await
    }

    /// Starts on the store in `data_dir` and returns as soon as the broker
    /// serves, while durable queues may still be loading their messages.
    pub async fn start_recovering(wiring: Wiring, data_dir: PathBuf) -> anyhow::Result<Self> {
        Self::start_with(wiring, "", Some(data_dir), false).await
    }

    async fn start_with(
        wiring: Wiring,
        config: &str,
        data_dir: Option<PathBuf>,
        await_recovery: bool,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir().context("temp dir")?;
        let config = if config.is_empty() {
            None
        } else {
            let path = dir.path().join("spillway.toml");
            std::fs::write(&path, config).context("writing spillway.toml")?;
            Some(path)
        };
        let secret = new_secret(dir.path())?;
        // What the sandbox's own internal clients present when the
        // processes run with `cluster.tls`.
        let cluster_tls = match &config {
            Some(path) => Settings::load(Some(path))?.cluster.tls.load()?,
            None => None,
        };
        let mut sandbox = Self {
            wiring,
            dir,
            config,
            storage: None,
            data_dir,
            engine: None,
            secret,
            cluster_tls,
            amqp: SocketAddr::from(([127, 0, 0, 1], 0)),
            amqps: None,
            management: SocketAddr::from(([127, 0, 0, 1], 0)),
            management_http: SocketAddr::from(([127, 0, 0, 1], 0)),
            metrics: BTreeMap::new(),
            in_process: None,
            children: Vec::new(),
            await_recovery,
        };
        sandbox.boot().await?;
        Ok(sandbox)
    }

    pub fn wiring(&self) -> Wiring {
        self.wiring
    }

    pub fn amqp_addr(&self) -> SocketAddr {
        self.amqp
    }

    /// The AMQPS address (`gateway.amqps_listen` in the sandbox's
    /// configuration, e.g. `127.0.0.1:0`).
    pub fn amqps_addr(&self) -> anyhow::Result<SocketAddr> {
        self.amqps
            .context("no AMQPS listener: the configuration sets no gateway.amqps_listen")
    }

    /// The storage node's internal gRPC address (separate wiring only).
    pub fn storage_addr(&self) -> Option<SocketAddr> {
        self.storage
    }

    /// The engine's internal gRPC address (separate wiring only).
    pub fn engine_addr(&self) -> Option<SocketAddr> {
        self.engine
    }

    /// The cluster secret of the separate processes.
    pub fn cluster_secret(&self) -> &ClusterSecret {
        &self.secret
    }

    /// What an internal gRPC client needs to be let in: the sandbox's
    /// secret, calling as an engine (the store's client), its cluster TLS
    /// (when configured) and the default message limit.
    pub fn cluster_client(&self) -> ClusterClient {
        ClusterClient {
            role: Some(ClusterRole::Engine),
            secret: Some(self.secret.clone()),
            tls: self.cluster_tls.clone(),
            ..ClusterClient::default()
        }
    }

    /// Where the process running `component` serves `/metrics` and
    /// `/healthz` (in the one-process wirings, the same for every component).
    pub fn metrics_addr(&self, component: Component) -> anyhow::Result<SocketAddr> {
        self.metrics
            .get(component.role())
            .or_else(|| self.metrics.get("all-in-one"))
            .copied()
            .with_context(|| format!("no metrics address for {component:?}"))
    }

    /// A client of the management gRPC API, with the sandbox's token.
    pub async fn management(&self) -> anyhow::Result<Management> {
        let channel =
            tonic::transport::Channel::from_shared(format!("http://{}", self.management))?
                .connect()
                .await?;
        let token = format!("Bearer {MANAGEMENT_TOKEN}").parse()?;
        Ok(
            spillway_proto::management::management_client::ManagementClient::with_interceptor(
                channel,
                Credentials(token),
            ),
        )
    }

    /// A client of the management gRPC API that logs in as a stored user
    /// with its password (HTTP basic credentials).
    pub async fn management_as(&self, user: &str, password: &str) -> anyhow::Result<Management> {
        use base64::Engine as _;
        let channel =
            tonic::transport::Channel::from_shared(format!("http://{}", self.management))?
                .connect()
                .await?;
        let pair = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        let basic = format!("Basic {pair}").parse()?;
        Ok(
            spillway_proto::management::management_client::ManagementClient::with_interceptor(
                channel,
                Credentials(basic),
            ),
        )
    }

    /// Runs spillctl against the management API as the operator; its
    /// stdout, or its stderr as the error.
    pub fn spillctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let (ok, stdout, stderr) = self.spillctl_as(MANAGEMENT_TOKEN, args)?;
        anyhow::ensure!(ok, "spillctl {args:?} failed: {stderr}");
        Ok(stdout)
    }

    /// Runs spillctl against the management API with `token`, failing or
    /// not: whether it succeeded, its stdout and its stderr.
    pub fn spillctl_as(
        &self,
        token: &str,
        args: &[&str],
    ) -> anyhow::Result<(bool, String, String)> {
        run_spillctl(self.management_addr(), token, args)
    }

    /// The management gRPC API (bearer token [`MANAGEMENT_TOKEN`]).
    pub fn management_addr(&self) -> SocketAddr {
        self.management
    }

    /// RabbitMQ's management HTTP API (HTTP Basic, or the bearer token).
    pub fn management_http_addr(&self) -> SocketAddr {
        self.management_http
    }

    pub fn amqp_uri(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.amqp)
    }

    pub async fn connect(&self) -> anyhow::Result<lapin::Connection> {
        Ok(
            lapin::Connection::connect(&self.amqp_uri(), lapin::ConnectionProperties::default())
                .await?,
        )
    }

    /// A fresh lapin client gets service: connects, declares a queue,
    /// closes cleanly. What a test of a misbehaving client ends with.
    pub async fn serves_a_fresh_client(&self) -> anyhow::Result<()> {
        let connection = self.connect().await?;
        let channel = connection.create_channel().await?;
        channel
            .queue_declare(
                "alive".into(),
                lapin::options::QueueDeclareOptions::default(),
                lapin::types::FieldTable::default(),
            )
            .await?;
        channel.close(200, "bye".into()).await?;
        connection.close(200, "bye".into()).await?;
        Ok(())
    }

    /// Where the store's files are.
    pub fn data_dir(&self) -> PathBuf {
        self.data_dir
            .clone()
            .unwrap_or_else(|| self.dir.path().join("data"))
    }

    /// The store as the engine sees it: the in-process store, or the
    /// storage process over gRPC.
    pub fn storage_api(&self) -> anyhow::Result<Arc<dyn StorageApi>> {
        Ok(match (&self.in_process, self.storage) {
            (Some(running), _) => running.storage().context("no in-process store")?,
            (None, Some(addr)) => Arc::new(RemoteStorage::connect_lazy(
                &format!("http://{addr}"),
                &self.cluster_client(),
            )?),
            (None, None) => bail!("no storage node reachable in the {:?} wiring", self.wiring),
        })
    }

    /// The value of `name` on the `/metrics` of the process running
    /// `component`.
    pub async fn metric(&self, component: Component, name: &str) -> anyhow::Result<f64> {
        let addr = self.metrics_addr(component)?;
        let (status, text) = http_get(addr, "/metrics").await?;
        if status != 200 {
            bail!("/metrics answered {status}");
        }
        metric_value(&text, name).with_context(|| format!("{name} not in /metrics"))
    }

    /// Stops every broker process gracefully, leaving the store's files
    /// for the test to look at; [`Sandbox::start_again`] boots again.
    pub async fn stop_all(&mut self) {
        self.stop(libc_signal::TERM).await;
    }

    /// Boots again after [`Sandbox::stop_all`], on the same data.
    pub async fn start_again(&mut self) -> anyhow::Result<()> {
        self.boot().await
    }

    /// SIGKILLs the storage process alone (separate wiring), leaving the
    /// engine, gateway and management running.
    pub async fn kill_storage(&mut self) -> anyhow::Result<()> {
        self.stop_role("storage", libc_signal::KILL).await
    }

    /// Starts the storage process again on its old address and data.
    pub async fn start_storage(&mut self) -> anyhow::Result<()> {
        let addr = self.storage.context("no storage process in this wiring")?;
        self.spawn("storage", &[("SPILLWAY_STORAGE__LISTEN", addr.to_string())])
            .await?;
        Ok(())
    }

    /// Starts the storage process again on its old address, on another
    /// data directory (a wrong or empty volume mounted).
    pub async fn start_storage_on(&mut self, data_dir: &Path) -> anyhow::Result<()> {
        let addr = self.storage.context("no storage process in this wiring")?;
        self.spawn(
            "storage",
            &[
                ("SPILLWAY_STORAGE__LISTEN", addr.to_string()),
                ("SPILLWAY_STORAGE__DATA_DIR", data_dir.display().to_string()),
            ],
        )
        .await?;
        Ok(())
    }

    /// Stops the engine process gracefully (SIGTERM) and starts it again on
    /// its old address, with storage left running; returns how long the new
    /// engine took to be ready.
    pub async fn restart_engine(&mut self) -> anyhow::Result<Duration> {
        let engine = self.engine.context("no engine process in this wiring")?;
        let storage = self.storage.context("no storage process in this wiring")?;
        self.stop_role("engine", libc_signal::TERM).await?;
        let started = Instant::now();
        self.spawn(
            "engine",
            &[
                ("SPILLWAY_ENGINE__LISTEN", engine.to_string()),
                ("SPILLWAY_ENGINE__STORAGE_ADDR", format!("http://{storage}")),
            ],
        )
        .await?;
        let ready = started.elapsed();
        if self.await_recovery {
            self.wait_for_recovery().await?;
        }
        Ok(ready)
    }

    /// Runs one more engine process against this sandbox's storage node and
    /// waits (up to `deadline`) for it to exit: its exit status and log.
    /// None for the status if it was still running at the deadline (it is
    /// killed then).
    pub async fn run_extra_engine(
        &self,
        deadline: Duration,
    ) -> anyhow::Result<(Option<std::process::ExitStatus>, String)> {
        let storage = self.storage.context("no storage process in this wiring")?;
        let log_path = self.dir.path().join("extra-engine.log");
        let log = std::fs::File::create(&log_path)?;
        let mut child = Command::new(spillway_bin()?)
            .arg("--ready-file")
            .arg(self.dir.path().join("extra-engine.ready"))
            .arg("engine")
            .env("SPILLWAY_ENGINE__LISTEN", "127.0.0.1:0")
            .env("SPILLWAY_ENGINE__STORAGE_ADDR", format!("http://{storage}"))
            .env("SPILLWAY_TELEMETRY__METRICS_LISTEN", "127.0.0.1:0")
            .env("SPILLWAY_CLUSTER__SECRET_FILE", self.secret_file())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting a second engine")?;
        let until = Instant::now() + deadline;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if Instant::now() > until {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        Ok((
            status,
            std::fs::read_to_string(&log_path).unwrap_or_default(),
        ))
    }

    /// Stops the newest process of `role` with `signal` and waits for it.
    async fn stop_role(&mut self, role: &str, signal: &str) -> anyhow::Result<()> {
        let index = self
            .children
            .iter()
            .rposition(|(name, _)| name == role)
            .with_context(|| format!("no {role} process"))?;
        let (_, mut child) = self.children.remove(index);
        stop_child(&mut child, signal).await;
        Ok(())
    }

    fn secret_file(&self) -> PathBuf {
        self.dir.path().join(SECRET_FILE)
    }

    /// Starts the processes and, unless the test watches recovery itself
    /// ([`Sandbox::start_recovering`]), waits until the durable queues'
    /// stored messages are in: a test that restarts and then counts what a
    /// queue holds must not count a queue still loading.
    async fn boot(&mut self) -> anyhow::Result<()> {
        self.boot_processes().await?;
        if self.await_recovery {
            self.wait_for_recovery().await?;
        }
        Ok(())
    }

    /// Waits until the engine reports start-up recovery complete
    /// (`spillway_recovery_complete`).
    pub async fn wait_for_recovery(&self) -> anyhow::Result<()> {
        eventually(Duration::from_secs(120), || async {
            self.engine_metric("spillway_recovery_complete")
                .await
                .ok()
                .filter(|complete| *complete == 1.0)
        })
        .await
        .context("recovery did not complete")?;
        Ok(())
    }

    async fn boot_processes(&mut self) -> anyhow::Result<()> {
        self.metrics.clear();
        match self.wiring {
            Wiring::InProcess => {
                let mut settings = match &self.config {
                    Some(path) => Settings::load(Some(path))?,
                    None => Settings::default(),
                };
                settings.gateway.amqp_listen = "127.0.0.1:0".into();
                settings.management.listen = "127.0.0.1:0".into();
                settings.management.http_listen = "127.0.0.1:0".into();
                settings.management.http_sample_interval = Duration::from_millis(200);
                settings.management.token = Some(MANAGEMENT_TOKEN.into());
                settings.telemetry.metrics_listen = Some("127.0.0.1:0".into());
                settings.storage.data_dir = self.data_dir();
                let running = spillway_serve::run(Role::AllInOne, &settings).await?;
                self.amqp = *running.addresses.get("amqp").context("no amqp address")?;
                self.amqps = running.addresses.get("amqps").copied();
                self.management = *running
                    .addresses
                    .get("management")
                    .context("no management address")?;
                self.management_http = *running
                    .addresses
                    .get("http")
                    .context("no management HTTP address")?;
                let metrics = running
                    .addresses
                    .get("metrics")
                    .context("no metrics address")?;
                self.metrics.insert("all-in-one", *metrics);
                self.in_process = Some(running);
            }
            Wiring::AllInOneProcess => {
                let ready = self.spawn("all-in-one", &[]).await?;
                self.amqp = parse_addr(&ready, "amqp")?;
                self.amqps = parse_addr(&ready, "amqps").ok();
                self.management = parse_addr(&ready, "management")?;
                self.management_http = parse_addr(&ready, "http")?;
            }
            Wiring::Separate => {
                let storage = self.spawn("storage", &[]).await?;
                let storage = parse_addr(&storage, "storage")?;
                self.storage = Some(storage);
                let engine = self
                    .spawn(
                        "engine",
                        &[("SPILLWAY_ENGINE__STORAGE_ADDR", format!("http://{storage}"))],
                    )
                    .await?;
                let engine = parse_addr(&engine, "engine")?;
                self.engine = Some(engine);
                let management = self
                    .spawn(
                        "management",
                        &[
                            (
                                "SPILLWAY_MANAGEMENT__STORAGE_ADDR",
                                format!("http://{storage}"),
                            ),
                            (
                                "SPILLWAY_MANAGEMENT__ENGINE_ADDR",
                                format!("http://{engine}"),
                            ),
                        ],
                    )
                    .await?;
                self.management = parse_addr(&management, "management")?;
                self.management_http = parse_addr(&management, "http")?;
                let gateway = self
                    .spawn(
                        "gateway",
                        &[("SPILLWAY_GATEWAY__ENGINE_ADDR", format!("http://{engine}"))],
                    )
                    .await?;
                self.amqp = parse_addr(&gateway, "amqp")?;
                self.amqps = parse_addr(&gateway, "amqps").ok();
            }
        }
        Ok(())
    }

    async fn spawn(
        &mut self,
        role: &'static str,
        env: &[(&str, String)],
    ) -> anyhow::Result<BTreeMap<String, String>> {
        let ready = self.dir.path().join(format!("{role}.ready"));
        let _ = std::fs::remove_file(&ready);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{role}.log")))?;
        let mut command = Command::new(spillway_bin()?);
        if let Some(config) = &self.config {
            command.arg("--config").arg(config);
        }
        command
            .arg("--ready-file")
            .arg(&ready)
            .arg(role)
            .env("SPILLWAY_GATEWAY__AMQP_LISTEN", "127.0.0.1:0")
            .env("SPILLWAY_ENGINE__LISTEN", "127.0.0.1:0")
            .env("SPILLWAY_STORAGE__LISTEN", "127.0.0.1:0")
            .env("SPILLWAY_MANAGEMENT__LISTEN", "127.0.0.1:0")
            .env("SPILLWAY_MANAGEMENT__HTTP_LISTEN", "127.0.0.1:0")
            .env("SPILLWAY_MANAGEMENT__HTTP_SAMPLE_INTERVAL", "200ms")
            .env("SPILLWAY_MANAGEMENT__TOKEN", MANAGEMENT_TOKEN)
            .env("SPILLWAY_TELEMETRY__METRICS_LISTEN", "127.0.0.1:0")
            .env("SPILLWAY_STORAGE__DATA_DIR", self.data_dir())
            .env("SPILLWAY_CLUSTER__SECRET_FILE", self.secret_file())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command.spawn().context("starting spillway")?;
        self.children.push((role.to_string(), child));
        let ready = wait_for_ready(&ready, Duration::from_secs(60)).await?;
        self.metrics.insert(role, parse_addr(&ready, "metrics")?);
        Ok(ready)
    }

    /// The peak resident memory (VmHWM) so far of the process running
    /// `role` (`gateway`, `engine`, `storage`) in the separate wiring; None
    /// in the one-process wirings or where /proc cannot tell.
    pub fn peak_rss(&self, role: &str) -> Option<u64> {
        let (_, child) = self.children.iter().rev().find(|(name, _)| name == role)?;
        let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).ok()?;
        let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// Stops the broker gracefully and starts it again on the same data.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.stop(libc_signal::TERM).await;
        self.boot().await
    }

    /// SIGKILLs every broker process (not for the in-process wiring), then
    /// starts them again on the same data.
    pub async fn kill_and_restart(&mut self) -> anyhow::Result<()> {
        if self.wiring == Wiring::InProcess {
            bail!("cannot SIGKILL the test's own process");
        }
        self.stop(libc_signal::KILL).await;
        self.boot().await
    }

    async fn stop(&mut self, signal: &str) {
        if let Some(running) = self.in_process.take() {
            running.shutdown().await;
        }
        while let Some((_, mut child)) = self.children.pop() {
            stop_child(&mut child, signal).await;
        }
    }

    /// The storage node's status; with `count_records`, exact counts of
    /// message records and queue entries. Asked of the in-process store, or
    /// over gRPC of the storage process.
    pub async fn store_status(&self, count_records: bool) -> anyhow::Result<StoreStatus> {
        Ok(self.storage_api()?.status(count_records).await?)
    }

    /// The engine's `/metrics` value of `name` (a metric without labels, or
    /// with its labels written out as in the exposition).
    pub async fn engine_metric(&self, name: &str) -> anyhow::Result<f64> {
        let addr = self.metrics_addr(Component::Engine)?;
        let (status, text) = http_get(addr, "/metrics").await?;
        if status != 200 {
            bail!("/metrics answered {status}");
        }
        metric_value(&text, name).with_context(|| format!("{name} not in /metrics"))
    }

    /// The logs of the child processes, for failure messages.
    pub fn logs(&self) -> String {
        let mut logs = String::new();
        for role in ["storage", "engine", "management", "gateway", "all-in-one"] {
            if let Ok(text) = std::fs::read_to_string(self.dir.path().join(format!("{role}.log"))) {
                logs.push_str(&format!("--- {role} ---\n{text}\n"));
            }
        }
        logs
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        for (_, child) in self.children.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The cluster secret's file in the sandbox's directory.
const SECRET_FILE: &str = "cluster-secret";

/// A new random secret (32 bytes from the kernel, hex), written to the
/// sandbox's secret file.
fn new_secret(dir: &Path) -> anyhow::Result<ClusterSecret> {
    new_secret_in(&dir.join(SECRET_FILE))
}

/// A new random secret (32 bytes from the kernel, hex), written to `path`.
fn new_secret_in(path: &Path) -> anyhow::Result<ClusterSecret> {
    let mut bytes = [0u8; 32];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut bytes)
        .context("reading /dev/urandom")?;
    let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(path, format!("{text}\n")).context("writing the secret")?;
    ClusterSecret::new(&text).map_err(|error| anyhow::anyhow!("the sandbox's secret: {error}"))
}

/// One secret per role, each in its own file (`cluster-secret-<role>`), and
/// every role's verifier: what a deployment with per-role secrets gives its
/// processes (`cluster.secret_file` and `cluster.verifiers`).
pub struct RoleSecrets {
    dir: PathBuf,
    secrets: BTreeMap<ClusterRole, ClusterSecret>,
}

impl RoleSecrets {
    /// Makes a secret for every role in `dir`.
    pub fn new(dir: &Path) -> anyhow::Result<Self> {
        let mut secrets = BTreeMap::new();
        for role in ClusterRole::ALL {
            let path = dir.join(format!("{SECRET_FILE}-{role}"));
            secrets.insert(role, new_secret_in(&path)?);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            secrets,
        })
    }

    /// `role`'s secret.
    pub fn secret(&self, role: ClusterRole) -> anyhow::Result<&ClusterSecret> {
        self.secrets.get(&role).context("a role without a secret")
    }

    /// `role`'s secret as text, for a test's own metadata.
    pub fn text(&self, role: ClusterRole) -> anyhow::Result<String> {
        Ok(String::from_utf8_lossy(self.secret(role)?.expose()).into_owned())
    }

    /// The environment of a process of `role`: its own secret's file and
    /// every role's verifier.
    pub fn env(&self, role: ClusterRole) -> Vec<(String, String)> {
        let mut env = vec![(
            "SPILLWAY_CLUSTER__SECRET_FILE".to_string(),
            self.dir
                .join(format!("{SECRET_FILE}-{role}"))
                .display()
                .to_string(),
        )];
        for (role, secret) in &self.secrets {
            env.push((
                format!(
                    "SPILLWAY_CLUSTER__VERIFIERS__{}",
                    role.as_str().to_ascii_uppercase()
                ),
                spillway_serve::cluster::role_verifier(secret),
            ));
        }
        env
    }

    /// An internal client calling as `role`.
    pub fn client(&self, role: ClusterRole) -> anyhow::Result<ClusterClient> {
        Ok(ClusterClient {
            role: Some(role),
            secret: Some(self.secret(role)?.clone()),
            ..ClusterClient::default()
        })
    }
}

/// Sends `signal` to `child` and waits for it to exit (SIGKILL after 10 s).
async fn stop_child(child: &mut Child, signal: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string())
        .status();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

mod libc_signal {
    pub const TERM: &str = "TERM";
    pub const KILL: &str = "KILL";
}

/// Publishes `body` and waits for the broker's answer: the publisher confirm on a channel
/// in confirm mode, or just the write otherwise.
pub async fn publish(
    channel: &lapin::Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: lapin::BasicProperties,
) -> anyhow::Result<lapin::Confirmation> {
    Ok(channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            lapin::options::BasicPublishOptions::default(),
            body,
            properties,
        )
        .await?
        .await?)
}

/// The consumer's next delivery, failing when none comes `within` or the consumer ends.
pub async fn next_delivery(
    consumer: &mut lapin::Consumer,
    within: Duration,
) -> anyhow::Result<lapin::message::Delivery> {
    use futures::StreamExt;
    let next = tokio::time::timeout(within, consumer.next())
        .await
        .map_err(|_| anyhow::anyhow!("no delivery within {within:?}"))?;
    Ok(next.ok_or_else(|| anyhow::anyhow!("the consumer ended"))??)
}

/// `SPILLWAY_BIN`, or `target/release/spillway` next to this test binary.
pub fn spillway_bin() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("SPILLWAY_BIN") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe()?;
    // target/release/deps/<test> → target/release/spillway
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|dir| dir.join("spillway"))
        .context("cannot locate target dir")?;
    if !bin.exists() {
        bail!(
            "{} not found: run `cargo build --release -p spillway` first",
            bin.display()
        );
    }
    Ok(bin)
}

/// `SPILLCTL_BIN`, or `target/release/spillctl` next to this test binary
/// (`cargo build --release -p spillway-ctl`).
pub fn spillctl_bin() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("SPILLCTL_BIN") {
        return Ok(PathBuf::from(path));
    }
    let bin = spillway_bin()?.with_file_name("spillctl");
    if !bin.exists() {
        bail!(
            "{} not found: run `cargo build --release -p spillway-ctl` first",
            bin.display()
        );
    }
    Ok(bin)
}

/// Runs spillctl against the management API at `addr` with `token`:
/// whether it succeeded, its stdout and its stderr.
pub fn run_spillctl(
    addr: SocketAddr,
    token: &str,
    args: &[&str],
) -> anyhow::Result<(bool, String, String)> {
    let output = std::process::Command::new(spillctl_bin()?)
        .arg("--addr")
        .arg(addr.to_string())
        .args(args)
        .env("SPILLCTL_TOKEN", token)
        .output()?;
    Ok((
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    ))
}

async fn wait_for_ready(
    path: &Path,
    timeout: Duration,
) -> anyhow::Result<BTreeMap<String, String>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return Ok(serde_json::from_str(&text)?);
        }
        if Instant::now() > deadline {
            bail!("{} did not appear in {timeout:?}", path.display());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A plain HTTP/1.1 GET over a fresh connection: the status code and the
/// body (responses are small and sent with a length, then the connection is
/// closed).
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let mut stream =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
            .await
            .with_context(|| format!("connecting to {addr} timed out"))??;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .with_context(|| format!("GET {path} from {addr} timed out"))??;
    let response = String::from_utf8(response).context("response is not UTF-8")?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .with_context(|| format!("no end of headers in {response:?}"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    Ok((status, body.to_string()))
}

/// The value of `name` in Prometheus text.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            (series == name).then(|| value.parse().ok())?
        })
}

fn parse_addr(ready: &BTreeMap<String, String>, key: &str) -> anyhow::Result<SocketAddr> {
    ready
        .get(key)
        .with_context(|| format!("ready file has no '{key}'"))?
        .parse()
        .with_context(|| format!("bad '{key}' address"))
}

/// Waits, at most `limit`, for the consumer timeout to close a lapin
/// consumer's channel: the next thing its stream yields must be RabbitMQ's
/// `406 PRECONDITION_FAILED - delivery acknowledgement … timed out`.
pub async fn consumer_timed_out(
    deliveries: &mut lapin::Consumer,
    limit: Duration,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    let closed = tokio::time::timeout(limit, deliveries.next())
        .await
        .map_err(|_| anyhow::anyhow!("the consumer timeout did not close the channel"))?;
    let error = match closed {
        Some(Err(error)) => error.to_string(),
        other => bail!("expected the channel's close, got {other:?}"),
    };
    anyhow::ensure!(
        error.contains("PRECONDITION_FAILED") && error.contains("delivery acknowledgement"),
        "not the consumer timeout's 406: {error}"
    );
    Ok(())
}
