use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use spillway_engine::{Engine, EngineAdminService, EngineConfig, EngineService};
use spillway_gateway::{AmqpServer, GatewayMetrics, Listeners};
use spillway_management::ManagementService;
use spillway_proto::cluster::{grpc_message_limit, ClusterClient};
use spillway_proto::util::backoff::Backoff;
use spillway_proto::util::clock::{SharedClock, SystemClock};
use spillway_proto::{
    engine::{EngineAdminApi, EngineApi, FailoverEngine, RemoteEngine, RemoteEngineAdmin},
    storage::{GroupStorage, RemoteStorage, StorageApi},
};
use spillway_storage::{RocksStore, StorageGroup, StorageGroupService, StorageService};
use spillway_telemetry::prometheus_client::metrics::family::Family;
use spillway_telemetry::prometheus_client::metrics::gauge::Gauge;
use spillway_telemetry::{Health, MemoryCeiling, Metrics, Server};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt;

use crate::cluster::{local_cluster_secret, require_protection_off_loopback, Callers, ClusterAuth};
use crate::Settings;

/// Which components this process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Every component, in-process, on an embedded store.
    AllInOne,
    Gateway,
    Engine,
    Storage,
    Management,
}

impl Role {
    /// The role this process calls the internal services as (all-in-one
    /// calls none).
    pub fn cluster_role(self) -> Option<spillway_proto::cluster::ClusterRole> {
        use spillway_proto::cluster::ClusterRole;
        match self {
            Role::AllInOne => None,
            Role::Gateway => Some(ClusterRole::Gateway),
            Role::Engine => Some(ClusterRole::Engine),
            Role::Storage => Some(ClusterRole::Storage),
            Role::Management => Some(ClusterRole::Management),
        }
    }

    /// Where the role serves `/metrics` and `/healthz` when
    /// `telemetry.metrics_listen` is not set: one port per role, so that
    /// separate processes on one host do not collide. Not 9090: that is
    /// Prometheus's own port, often on the same host.
    pub fn default_metrics_listen(self) -> &'static str {
        match self {
            Role::AllInOne => "127.0.0.1:9471",
            Role::Gateway => "127.0.0.1:9472",
            Role::Engine => "127.0.0.1:9473",
            Role::Storage => "127.0.0.1:9474",
            Role::Management => "127.0.0.1:9475",
        }
    }
}

/// A started process: its bound addresses, and how to stop it.
pub struct Running {
    /// Component name → bound address (`amqp`, `amqps`, `engine`,
    /// `storage`, `management`, and `metrics` for the HTTP `/metrics` and
    /// `/healthz`).
    pub addresses: BTreeMap<&'static str, SocketAddr>,
    /// `/healthz`: ready once every listener is bound, not ready again from
    /// the start of shutdown.
    health: Health,
    /// The servers, in the order they started: `/metrics` and `/healthz`
    /// first, then the role's own.
    servers: Vec<Box<dyn Server>>,
    engine: Option<Engine>,
    storage: Option<Arc<dyn StorageApi>>,
    /// The storage group member this process is (storage, with
    /// `storage.members`): it leaves the group last on shutdown.
    group: Option<StorageGroup>,
    /// `engine.standby`: an engine among others, which steps down when it
    /// loses the store's lease ([`Running::stepped_down`]).
    standby: bool,
}

impl Running {
    /// The store this process opened (all-in-one, storage), for tests and
    /// tools that ask it for its status.
    pub fn storage(&self) -> Option<Arc<dyn StorageApi>> {
        self.storage.clone()
    }

    /// The engine this process runs (all-in-one, engine).
    pub fn engine(&self) -> Option<&Engine> {
        self.engine.as_ref()
    }

    /// Resolves, with the reason, when this process must stop serving on
    /// its own: an engine started with `engine.standby` that lost the
    /// store's lease (another engine took it, or it went unrenewed past
    /// its TTL). The caller shuts down and exits non-zero: the sessions
    /// end, gateways close their clients' connections with `320`, and the
    /// process, restarted by its supervisor, stands by. Never resolves
    /// otherwise.
    pub async fn stepped_down(&self) -> String {
        match (&self.engine, self.standby) {
            (Some(engine), true) => engine.lease_lost().await,
            _ => std::future::pending().await,
        }
    }

    /// Stops the servers in the reverse order of their start, then the
    /// engine (its pending writes reach the store, which is then released),
    /// and last the endpoint that has said "not ready" since the start of
    /// shutdown.
    pub async fn shutdown(self) {
        self.health.set_ready(false);
        let mut servers = self.servers.into_iter();
        let health_endpoint = servers.next();
        for server in servers.rev() {
            server.shutdown().await;
        }
        if let Some(engine) = self.engine {
            engine.shutdown().await;
        }
        if let Some(group) = self.group {
            group.shutdown().await;
        }
        if let Some(server) = health_endpoint {
            server.shutdown().await;
        }
    }

    /// Keeps a started server, and its addresses for the ready file.
    fn add(&mut self, server: Box<dyn Server>) {
        for (name, addr) in server.bind_addrs() {
            self.addresses.insert(name, addr);
        }
        self.servers.push(server);
    }

    /// The ready file's content: the bound addresses as a JSON object.
    pub fn addresses_json(&self) -> String {
        let map: BTreeMap<&str, String> = self
            .addresses
            .iter()
            .map(|(name, addr)| (*name, addr.to_string()))
            .collect();
        serde_json::to_string(&map).unwrap_or_default()
    }
}

/// Starts `role` as configured; returns once every listener is bound.
///
/// The metrics HTTP endpoint comes first, so `/healthz` answers 503 while
/// the rest starts (for the engine: while it waits for storage and
/// recovers), then 200.
pub async fn run(role: Role, settings: &Settings) -> anyhow::Result<Running> {
    run_with_metrics(role, settings, Metrics::new()).await
}

/// As [`run`], into a registry the caller may already have added to (the
/// binary registers its allocator's figures, which only it knows).
pub async fn run_with_metrics(
    role: Role,
    settings: &Settings,
    metrics: Metrics,
) -> anyhow::Result<Running> {
    let mut running = Running {
        addresses: BTreeMap::new(),
        health: Health::new(),
        servers: Vec::new(),
        engine: None,
        storage: None,
        group: None,
        standby: settings.engine.standby && role == Role::Engine,
    };
    // Mutual TLS: read for the separate roles only (all-in-one has no
    // internal connection to protect).
    let cluster_tls = match role {
        Role::AllInOne => None,
        _ => settings.cluster.tls.load()?,
    };
    let own_role = role.cluster_role();
    let per_role = settings.cluster.verifiers.any();
    // A role that proves itself by its certificate: the certificate must say
    // which role it is, or every call would be refused.
    let certified = match (&settings.cluster.tls.cert_file, role) {
        (_, Role::AllInOne) | (None, _) => None,
        (Some(path), _) => {
            let pem = std::fs::read(path).with_context(|| {
                format!("cluster.tls.cert_file: cannot read {}", path.display())
            })?;
            crate::cluster::role_in_pem(&pem).map_err(|error| {
                anyhow::anyhow!("cluster.tls.cert_file {}: {error}", path.display())
            })?
        }
    };
    if let (Some(own), Some(certified)) = (own_role, certified) {
        anyhow::ensure!(
            own == certified,
            "cluster.tls.cert_file names the {certified} role, and this process is the {own} role"
        );
    }
    // Before anything listens: no internal gRPC beyond loopback unless the
    // callers prove their roles.
    let protected = per_role || (cluster_tls.is_some() && certified.is_some());
    match role {
        Role::Engine => {
            let listen = &settings.engine.listen;
            require_protection_off_loopback("engine", "engine.listen", listen, protected).await?;
        }
        Role::Storage => {
            let listen = &settings.storage.listen;
            require_protection_off_loopback("storage node", "storage.listen", listen, protected)
                .await?;
        }
        Role::AllInOne | Role::Gateway | Role::Management => {}
    }
    let secret = match (role, &settings.cluster.secret) {
        (Role::AllInOne, _) => None,
        (_, Some(secret)) => Some(secret.clone()),
        (_, None) if cluster_tls.is_some() => None,
        (_, None) => Some(local_cluster_secret(&settings.storage.data_dir)?),
    };
    // How callers prove their role (`cluster.rs`): per-role secrets when
    // verifiers are set; else one shared secret (configured, or the local
    // one of the data directory when there is no cluster TLS either); else
    // the role their cluster certificate names.
    let callers = match &secret {
        _ if per_role => Callers::PerRole(settings.cluster.verifiers.table()),
        Some(secret) => Callers::Shared(secret.clone()),
        None => Callers::Certificates,
    };
    if let (Some(own), Callers::Certificates, None) = (own_role, &callers, certified) {
        anyhow::bail!(
            "cluster.tls.cert_file names no role, and with cluster TLS alone (no cluster \
             secret) a component proves its role by its certificate: issue the {own} \
             certificate with the subject alternative name URI {}",
            own.uri()
        );
    }
    // This role's secret must be the one its verifier is of: a mix-up would
    // otherwise only show as every call refused.
    if let (Some(own), true, Some(secret)) = (own_role, per_role, &secret) {
        let table = settings.cluster.verifiers.table();
        let Some(verifier) = table.get(&own) else {
            anyhow::bail!(
                "cluster.verifiers.{own} is not set: the other verifiers are, so this \
                 {own} process's secret cannot be checked"
            );
        };
        anyhow::ensure!(
            crate::cluster::parse_verifier(&crate::cluster::role_verifier(secret))
                .is_some_and(|mine| mine == *verifier),
            "cluster.secret (or cluster.secret_file) is not the {own} role's secret: its \
             SHA-256 is not cluster.verifiers.{own}"
        );
    }
    // Internal gRPC (separate roles only): the role and secret every client
    // sends, and the message limit both ends keep to.
    let cluster = ClusterClient {
        role: own_role,
        secret: secret.clone(),
        tls: cluster_tls.clone(),
        max_message_bytes: grpc_message_limit(
            settings.gateway.max_message_size,
            settings.gateway.frame_max,
        ),
    };
    let auth = ClusterAuth::new(callers, cluster_tls.is_some());
    // One ceiling per process, over what its components hold for clients,
    // and one clock.
    let memory = MemoryCeiling::new(settings.engine.memory_high_watermark());
    let clock = SystemClock::shared();
    if matches!(role, Role::AllInOne | Role::Engine | Role::Gateway) {
        metrics.register_collector(memory.collector());
    }
    start_http(&mut running, role, settings, &metrics).await?;
    match role {
        Role::AllInOne => {
            let store = open_store(settings)?;
            store.register_metrics(&metrics);
            let storage: Arc<dyn StorageApi> = Arc::new(store);
            running.storage = Some(storage.clone());
            let engine = start_engine(
                storage.clone(),
                settings,
                memory.clone(),
                clock.clone(),
                &running.health,
            )
            .await?;
            engine.register_metrics(&metrics);
            running.engine = Some(engine.clone());
            let admin: Arc<dyn EngineAdminApi> = Arc::new(engine.clone());
            start_amqp(
                &mut running,
                Arc::new(engine),
                settings,
                &metrics,
                memory,
                clock,
            )
            .await?;
            start_management(&mut running, admin, storage, settings, &metrics).await?;
        }
        Role::Storage => {
            let store = open_store(settings)?;
            store.register_metrics(&metrics);
            auth.register_metrics(&metrics);
            let (stop, stopped) = watch::channel(false);
            let group = settings
                .storage
                .group()
                .map_err(|problem| anyhow::anyhow!(problem))?;
            let mut router = internal_server(cluster_tls.as_ref())?;
            let router = match group {
                None => {
                    let storage = StorageService::new(store)
                        .with_shutdown(stopped.clone())
                        .into_server(cluster.max_message_bytes);
                    router.add_service(auth.guard("storage", storage))
                }
                Some(group) => {
                    let group = StorageGroup::start(store, group, cluster.clone()).await?;
                    running.group = Some(group.clone());
                    let storage = StorageService::grouped(group.clone())
                        .with_shutdown(stopped.clone())
                        .into_server(cluster.max_message_bytes);
                    let members =
                        StorageGroupService::new(group).into_server(cluster.max_message_bytes);
                    router
                        .add_service(auth.guard("storage", storage))
                        .add_service(auth.guard("storage_group", members))
                }
            };
            start_grpc(
                &mut running,
                "storage",
                &settings.storage.listen,
                router,
                cluster_tls.is_some(),
                (stop, stopped),
            )
            .await?;
        }
        Role::Engine => {
            let storage = remote_storage(
                &settings.engine.storage_addrs,
                &settings.engine.storage_addr,
                &cluster,
            )
            .context("engine.storage_addr(s)")?;
            let engine = start_engine(storage, settings, memory, clock, &running.health).await?;
            engine.register_metrics(&metrics);
            auth.register_metrics(&metrics);
            running.engine = Some(engine.clone());
            let limit = cluster.max_message_bytes;
            let (stop, stopped) = watch::channel(false);
            let sessions = EngineService::new(engine.clone())
                .with_shutdown(stopped.clone())
                .into_server(limit);
            let admin = EngineAdminService::new(engine).into_server(limit);
            let router = internal_server(cluster_tls.as_ref())?
                .add_service(auth.guard("engine", sessions))
                .add_service(auth.guard("engine_admin", admin));
            start_grpc(
                &mut running,
                "engine",
                &settings.engine.listen,
                router,
                cluster_tls.is_some(),
                (stop, stopped),
            )
            .await?;
        }
        Role::Gateway => {
            let engine: Arc<dyn EngineApi> = if settings.gateway.engine_addrs.is_empty() {
                Arc::new(
                    RemoteEngine::connect_lazy(&settings.gateway.engine_addr, &cluster)
                        .context("gateway.engine_addr")?,
                )
            } else {
                Arc::new(
                    FailoverEngine::connect_lazy(&settings.gateway.engine_addrs, &cluster)
                        .context("gateway.engine_addrs")?,
                )
            };
            start_amqp(&mut running, engine, settings, &metrics, memory, clock).await?;
        }
        Role::Management => {
            let storage = remote_storage(
                &settings.management.storage_addrs,
                &settings.management.storage_addr,
                &cluster,
            )
            .context("management.storage_addr(s)")?;
            let management = &settings.management;
            let engine_addrs = if management.engine_addrs.is_empty() {
                std::slice::from_ref(&management.engine_addr)
            } else {
                management.engine_addrs.as_slice()
            };
            let admin: Arc<dyn EngineAdminApi> = Arc::new(
                RemoteEngineAdmin::connect_lazy_all(engine_addrs, &cluster)
                    .context("management.engine_addr(s)")?,
            );
            start_management(&mut running, admin, storage, settings, &metrics).await?;
        }
    }
    running.health.set_ready(true);
    Ok(running)
}

/// The engine's (or management's) client of storage: a storage group's
/// members when `addrs` lists them, else the one node at `addr`.
fn remote_storage(
    addrs: &[String],
    addr: &str,
    cluster: &ClusterClient,
) -> anyhow::Result<Arc<dyn StorageApi>> {
    if addrs.is_empty() {
        return Ok(Arc::new(RemoteStorage::connect_lazy(addr, cluster)?));
    }
    Ok(Arc::new(GroupStorage::connect_lazy(addrs, cluster)?))
}

/// Serves the management API over `admin` (the engine, in-process or
/// remote) and `storage`, on `management.listen`.
async fn start_management(
    running: &mut Running,
    admin: Arc<dyn EngineAdminApi>,
    storage: Arc<dyn StorageApi>,
    settings: &Settings,
    metrics: &Metrics,
) -> anyhow::Result<()> {
    let served = ManagementService::new(admin, storage).routes(
        settings.management.auth(),
        metrics,
        &node_name(),
    )?;
    let router = management_server(settings)?.add_routes(served.grpc);
    start_grpc(
        running,
        "management",
        &settings.management.listen,
        router,
        settings.management.tls.files().is_some(),
        watch::channel(false),
    )
    .await?;
    let listen = settings.management.http_listen.trim();
    if listen.is_empty() {
        return Ok(());
    }
    let addr: SocketAddr = listen.parse().with_context(|| {
        format!("management.http_listen '{listen}' is not an address (host:port)")
    })?;
    let mut api = served
        .http
        .with_sample_interval(settings.management.http_sample_interval);
    // The AMQP listeners of this process (all-in-one), for /api/overview.
    for (name, protocol) in [("amqp", "amqp"), ("amqps", "amqp/ssl")] {
        if let Some(amqp) = running.addresses.get(name) {
            api = api.with_listener(protocol, *amqp);
        }
    }
    // The management API's TLS: HTTPS only, as its gRPC port.
    let tls = match settings.management.tls.files() {
        Some(files) => Some(Arc::new(
            spillway_gateway::tls::server_config(&files)
                .context("management.tls: the certificate, key or CA cannot be used")?,
        )),
        None => None,
    };
    let server = spillway_management::http::start_http_api(addr, api, tls).await?;
    running.add(Box::new(server));
    Ok(())
}

/// This node's name in RabbitMQ's API answers: `spillway@HOST`.
fn node_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|host| host.trim().to_string())
        .filter(|host| !host.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!("spillway@{host}")
}

/// Serves `/metrics` from `metrics` and `/healthz` from the role's health.
async fn start_http(
    running: &mut Running,
    role: Role,
    settings: &Settings,
    metrics: &Metrics,
) -> anyhow::Result<()> {
    let listen = settings
        .telemetry
        .metrics_listen
        .as_deref()
        .unwrap_or(role.default_metrics_listen());
    let addr: SocketAddr = listen
        .parse()
        .with_context(|| format!("telemetry.metrics_listen '{listen}' is not an address"))?;
    // RabbitMQ's identity series, which its dashboards join every other
    // series on for the node and cluster names.
    let identity = Family::<Vec<(&'static str, String)>, Gauge>::default();
    let node = node_name();
    identity
        .get_or_create(&vec![
            ("rabbitmq_node", node.clone()),
            ("rabbitmq_cluster", node.clone()),
            ("rabbitmq_cluster_permanent_id", node),
        ])
        .set(1);
    metrics.register(
        "rabbitmq_identity_info",
        "RabbitMQ node & cluster identity info",
        identity,
    );
    let server =
        spillway_telemetry::start_http(addr, metrics.clone(), running.health.clone()).await?;
    running.add(Box::new(server));
    Ok(())
}

fn open_store(settings: &Settings) -> anyhow::Result<RocksStore> {
    let data_dir = &settings.storage.data_dir;
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating the data directory {}", data_dir.display()))?;
    let store = if settings.storage.members.is_empty() {
        RocksStore::open_with(data_dir, settings.storage.create_if_missing)?
    } else {
        RocksStore::open_for_group(data_dir, settings.storage.create_if_missing)?
    };
    store.set_quota(
        settings.storage.overfull_size.unwrap_or(0),
        settings.storage.underfull_size.unwrap_or(0),
    );
    store.start_quota_monitor();
    Ok(store)
}

/// Starts the engine; a storage node that is not up yet is waited for. A
/// standby engine says so on `/healthz` while it waits for the lease.
async fn start_engine(
    storage: Arc<dyn StorageApi>,
    settings: &Settings,
    memory_ceiling: Arc<MemoryCeiling>,
    clock: SharedClock,
    health: &Health,
) -> anyhow::Result<Engine> {
    let config = EngineConfig {
        settings: settings.engine.clone(),
        // The gateway's bound, which management's peek decodes within.
        max_message_size: settings.gateway.max_message_size,
        lease_ttl: spillway_engine::DEFAULT_LEASE_TTL,
        memory_ceiling: memory_ceiling.clone(),
        clock,
    };
    tracing::info!(
        flow_to_disk_threshold = config.settings.flow_to_disk_threshold(),
        memory_high_watermark = memory_ceiling.high_watermark(),
        housekeeping_interval_ms = config.settings.housekeeping_interval.as_millis() as u64,
        "engine memory budget"
    );
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut waited = Duration::ZERO;
    // Another engine's lease is waited out once (it may be this engine's
    // previous run, killed without releasing it); past that, the store is
    // someone else's: one engine per store.
    let lease_wait = config.lease_ttl * 2;
    let mut standing_by = false;
    loop {
        match Engine::start(storage.clone(), config.clone()).await {
            Ok(engine) => {
                health.set_standby(false);
                return Ok(engine);
            }
            Err(error) if error.is_lease_refused() && settings.engine.standby => {
                if !standing_by {
                    tracing::info!(%error, "standing by: another engine holds the store's lease");
                    standing_by = true;
                    health.set_standby(true);
                }
                tokio::time::sleep(backoff.next_delay()).await;
            }
            Err(error) if error.is_lease_refused() && waited >= lease_wait => {
                return Err(anyhow::Error::new(error).context(
                    "another engine holds this store: stop it first, or point \
                     engine.storage_addr at this engine's own storage node",
                ));
            }
            Err(error) if error.is_lease_refused() => {
                tracing::warn!(%error, "store leased to another engine, waiting for the lease to expire");
                let delay = backoff.next_delay();
                tokio::time::sleep(delay).await;
                waited += delay;
            }
            Err(error) if waited < Duration::from_secs(120) => {
                tracing::warn!(%error, "storage not ready, retrying");
                let delay = backoff.next_delay();
                tokio::time::sleep(delay).await;
                waited += delay;
            }
            Err(error) => return Err(error.into()),
        }
    }
}

/// An internal gRPC server's builder (engine, storage): TLS only, with a
/// client certificate from the cluster CA required, when `cluster.tls` is
/// set; plaintext HTTP/2 otherwise.
fn internal_server(
    tls: Option<&spillway_proto::cluster::ClusterTls>,
) -> anyhow::Result<tonic::transport::Server> {
    let builder = tonic::transport::Server::builder()
        .max_frame_size(spillway_proto::cluster::HTTP2_MAX_FRAME_BYTES);
    let Some(tls) = tls else {
        return Ok(builder);
    };
    builder
        .tls_config(tls.server_config())
        .context("cluster.tls: the certificate, key or CA cannot be used")
}

/// The management server's builder: TLS on when `management.tls` has a
/// certificate and key (client certificates as `ca_file`/`verify_peer` say).
fn management_server(settings: &Settings) -> anyhow::Result<tonic::transport::Server> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let builder = tonic::transport::Server::builder();
    let Some(files) = settings.management.tls.files() else {
        return Ok(builder);
    };
    let read = |key: &str, path: &std::path::Path| {
        std::fs::read(path)
            .with_context(|| format!("management.tls.{key}: cannot read {}", path.display()))
    };
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(
        read("cert_file", &files.cert_file)?,
        read("key_file", &files.key_file)?,
    ));
    if let Some(ca_file) = &files.ca_file {
        tls = tls
            .client_ca_root(Certificate::from_pem(read("ca_file", ca_file)?))
            .client_auth_optional(!files.verify_peer);
    }
    builder
        .tls_config(tls)
        .context("management.tls: the certificate, key or CA cannot be used")
}

async fn start_amqp(
    running: &mut Running,
    engine: Arc<dyn EngineApi>,
    settings: &Settings,
    metrics: &Metrics,
    memory: Arc<MemoryCeiling>,
    clock: SharedClock,
) -> anyhow::Result<()> {
    let gateway = &settings.gateway;
    let parse = |key: &str, listen: &str| -> anyhow::Result<SocketAddr> {
        listen
            .parse()
            .with_context(|| format!("gateway.{key} '{listen}' is not an address"))
    };
    let mut listeners = Listeners::default();
    if let Some(listen) = gateway.amqp_listen() {
        listeners.amqp = Some(parse("amqp_listen", listen)?);
    }
    if let Some(listen) = gateway.amqps_listen() {
        let addr = parse("amqps_listen", listen)?;
        let files = gateway
            .tls
            .files()
            .context("gateway.amqps_listen is set without gateway.tls.cert_file and key_file")?;
        let tls = spillway_gateway::tls::server_config(&files).map_err(|error| {
            anyhow::anyhow!("gateway.tls.{}: {}", error.key.as_str(), error.reason)
        })?;
        listeners.amqps = Some((addr, Arc::new(tls)));
    }
    let gateway_metrics = GatewayMetrics::new();
    gateway_metrics.register(metrics);
    let wanted: Vec<String> = [
        listeners.amqp,
        listeners.amqps.as_ref().map(|(addr, _)| *addr),
    ]
    .into_iter()
    .flatten()
    .map(|addr| addr.to_string())
    .collect();
    let server = AmqpServer::start_listeners(
        listeners,
        engine,
        spillway_gateway::GatewayConfig {
            settings: settings.gateway.clone(),
            clock,
        },
        gateway_metrics,
        memory,
    )
    .await
    .with_context(|| format!("binding the AMQP port {}", wanted.join(" and ")))?;
    running.add(Box::new(server));
    Ok(())
}

/// An internal or management gRPC server, started by [`start_grpc`].
struct GrpcServer {
    name: &'static str,
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

#[async_trait::async_trait]
impl Server for GrpcServer {
    fn name(&self) -> &'static str {
        self.name
    }

    fn bind_addrs(&self) -> Vec<(&'static str, SocketAddr)> {
        vec![(self.name, self.addr)]
    }

    async fn shutdown(self: Box<Self>) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Binds `listen` and serves `router` until `stop` says so (`stop.1` is
/// also what a service that streams watches, to end its streams).
async fn start_grpc(
    running: &mut Running,
    name: &'static str,
    listen: &str,
    router: tonic::transport::server::Router,
    tls: bool,
    (stop, mut stopped): (watch::Sender<bool>, watch::Receiver<bool>),
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the {name} gRPC port {listen}"))?;
    let addr = listener.local_addr()?;
    // tls: the management API's TLS, or the internal services' mutual TLS.
    tracing::info!(component = name, %addr, tls, "grpc listening");
    let task = tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopped.changed().await;
        };
        // Small gRPC messages (one confirm's write, one delivery) must not
        // wait for Nagle's algorithm: without this the remote wiring stalls
        // ~40 ms per round trip against delayed acks.
        let incoming = TcpListenerStream::new(listener).map(|stream| {
            if let Ok(stream) = &stream {
                let _ = stream.set_nodelay(true);
            }
            stream
        });
        if let Err(error) = router
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
        {
            tracing::error!(component = name, %error, "grpc server failed");
        }
    });
    running.add(Box::new(GrpcServer {
        name,
        addr,
        stop,
        task,
    }));
    Ok(())
}
