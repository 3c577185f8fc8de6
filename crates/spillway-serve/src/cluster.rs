//! Who may call the internal gRPC services (the engine's `Engine` and
//! `EngineAdmin`, the storage node's `Storage`): only Spillway's own
//! components, which prove it with the cluster secret (`cluster.secret`).
//!
//! [`ClusterAuth`] makes one tonic interceptor per service. Tonic runs an
//! interceptor on the request head of every call, unary and streaming alike
//! (the session stream included), before the handler sees anything. A
//! refusal is `UNAUTHENTICATED`, counted in
//! `spillway_grpc_auth_failures_total{service}` and logged at warn once per
//! peer address and [`WARN_EVERY`], so a flood of bad calls does not flood the
//! log.
//!
//! [`require_protection_off_loopback`] is the start-up rule: a process does
//! not serve internal gRPC beyond loopback without the secret or mutual TLS
//! (`cluster.tls`, which the servers enforce in the TLS handshake). On
//! loopback, a separate role with neither does not trust every local
//! process either: it uses [`local_cluster_secret`], a secret the roles of
//! one machine share through their data directory.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use spillway_proto::cluster::{ClusterSecret, SECRET_METADATA_KEY};
use spillway_telemetry::prometheus_client::metrics::counter::Counter;
use spillway_telemetry::prometheus_client::metrics::family::Family;
use spillway_telemetry::Metrics;
use subtle::ConstantTimeEq;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// The file in `storage.data_dir` that holds the secret the separate roles
/// of one machine share when no secret and no mutual TLS are configured.
pub const LOCAL_SECRET_FILE: &str = "cluster-secret";

/// The secret of `data_dir`'s [`LOCAL_SECRET_FILE`], made if missing by
/// whichever role starts first (43 random alphanumeric characters, about
/// 256 bits, readable by its owner only) and read by the others: without
/// it any local user's process could open an engine session as any user,
/// ask the engine to authenticate anyone, or read the store.
pub fn local_cluster_secret(data_dir: &std::path::Path) -> anyhow::Result<ClusterSecret> {
    use anyhow::Context as _;
    use rand::distr::{Alphanumeric, SampleString};
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = data_dir.join(LOCAL_SECRET_FILE);
    if !path.exists() {
        std::fs::create_dir_all(data_dir)
            .with_context(|| format!("creating {}", data_dir.display()))?;
        // Written whole under another name, then linked into place: a role
        // that starts at the same moment reads either nothing or all of it,
        // and the first link wins.
        let draft = data_dir.join(format!(".{LOCAL_SECRET_FILE}.{}", std::process::id()));
        let secret = Alphanumeric.sample_string(&mut rand::rng(), 43);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&draft)
            .with_context(|| format!("creating {}", draft.display()))?;
        file.write_all(secret.as_bytes())?;
        file.sync_all()?;
        let linked = std::fs::hard_link(&draft, &path);
        let _ = std::fs::remove_file(&draft);
        match linked {
            Ok(()) => tracing::info!(path = %path.display(), "made the local cluster secret"),
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(error) => {
                return Err(error).with_context(|| format!("creating {}", path.display()))
            }
        }
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading the local cluster secret {}", path.display()))?;
    ClusterSecret::new(&text)
        .with_context(|| format!("the local cluster secret {}", path.display()))
}

/// A peer whose calls are refused is logged at warn at most this often.
pub const WARN_EVERY: Duration = Duration::from_secs(60);

/// Peers remembered for [`WARN_EVERY`]; past this, the oldest memory is
/// dropped (a flood from many addresses then logs more, never grows memory).
const REMEMBERED_PEERS: usize = 1024;

type Failures = Family<Vec<(&'static str, &'static str)>, Counter>;

/// The check shared by every internal service of one process.
#[derive(Clone)]
pub struct ClusterAuth {
    inner: Arc<Inner>,
}

struct Inner {
    /// `None`: every call is let in (only allowed on loopback).
    secret: Option<ClusterSecret>,
    failures: Failures,
    /// Peer address → when a refusal of its calls was last logged at warn.
    warned: Mutex<HashMap<IpAddr, Instant>>,
}

impl ClusterAuth {
    pub fn new(secret: Option<ClusterSecret>) -> Self {
        Self {
            inner: Arc::new(Inner {
                secret,
                failures: Failures::default(),
                warned: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Adds `spillway_grpc_auth_failures_total{service}` to `metrics`.
    pub fn register_metrics(&self, metrics: &Metrics) {
        metrics.register(
            "spillway_grpc_auth_failures",
            "Internal gRPC calls refused for a missing or wrong cluster secret, by service",
            self.inner.failures.clone(),
        );
    }

    /// The interceptor for `service` (the label in the metric and the log).
    pub fn interceptor(&self, service: &'static str) -> ClusterInterceptor {
        ClusterInterceptor {
            auth: self.clone(),
            service,
        }
    }

    /// Refusals of `service` so far.
    pub fn failures(&self, service: &'static str) -> u64 {
        self.inner
            .failures
            .get_or_create(&vec![("service", service)])
            .get()
    }

    fn refused(&self, service: &'static str, peer: Option<SocketAddr>, reason: &'static str) {
        self.inner
            .failures
            .get_or_create(&vec![("service", service)])
            .inc();
        let peer_text = peer.map_or_else(|| "unknown".to_string(), |peer| peer.to_string());
        if self.first_in_a_while(peer.map(|peer| peer.ip()), Instant::now()) {
            tracing::warn!(
                peer = %peer_text,
                service,
                reason,
                "internal grpc call refused: the caller did not present the cluster secret \
                 (further refusals from this address are logged at debug for a minute)"
            );
        } else {
            tracing::debug!(peer = %peer_text, service, reason, "internal grpc call refused");
        }
    }

    /// Whether a refusal from `ip` is the first for [`WARN_EVERY`].
    fn first_in_a_while(&self, ip: Option<IpAddr>, now: Instant) -> bool {
        let Some(ip) = ip else { return true };
        let mut warned = self.inner.warned.lock();
        if let Some(last) = warned.get(&ip) {
            if now.duration_since(*last) < WARN_EVERY {
                return false;
            }
        }
        if warned.len() >= REMEMBERED_PEERS {
            warned.retain(|_, last| now.duration_since(*last) < WARN_EVERY);
            if warned.len() >= REMEMBERED_PEERS {
                warned.clear();
            }
        }
        warned.insert(ip, now);
        true
    }

    fn check(&self, request: &Request<()>) -> Result<(), &'static str> {
        let Some(secret) = &self.inner.secret else {
            return Ok(());
        };
        let presented = request
            .metadata()
            .get(SECRET_METADATA_KEY)
            .ok_or("missing cluster secret")?;
        if bool::from(presented.as_bytes().ct_eq(secret.expose())) {
            return Ok(());
        }
        Err("wrong cluster secret")
    }
}

/// The interceptor of one internal service.
#[derive(Clone)]
pub struct ClusterInterceptor {
    auth: ClusterAuth,
    service: &'static str,
}

impl Interceptor for ClusterInterceptor {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        match self.auth.check(&request) {
            Ok(()) => {
                // The handler has no use for it: nothing it logs can show it.
                request.metadata_mut().remove(SECRET_METADATA_KEY);
                Ok(request)
            }
            Err(reason) => {
                self.auth
                    .refused(self.service, request.remote_addr(), reason);
                Err(Status::unauthenticated(format!(
                    "{reason}: the {} service accepts only Spillway components configured \
                     with the same cluster.secret",
                    self.service
                )))
            }
        }
    }
}

/// Refuses to serve internal gRPC on `listen` (the value of the setting
/// `key`) when it is not a loopback address and the process has neither the
/// cluster secret nor cluster TLS (`protected`). An address that does not
/// resolve is left for the bind to report.
pub async fn require_protection_off_loopback(
    component: &str,
    key: &str,
    listen: &str,
    protected: bool,
) -> anyhow::Result<()> {
    if protected {
        return Ok(());
    }
    let Ok(addresses) = tokio::net::lookup_host(listen).await else {
        return Ok(());
    };
    let addresses: Vec<SocketAddr> = addresses.collect();
    if addresses.iter().all(|addr| addr.ip().is_loopback()) {
        return Ok(());
    }
    anyhow::bail!(
        "refusing to serve the {component}'s internal gRPC on {listen} without a cluster \
         secret or cluster TLS: `{key}` is not a loopback address, so anyone who can reach \
         it could use it. Set `cluster.secret_file` (SPILLWAY_CLUSTER__SECRET_FILE) or \
         `cluster.secret` to the same secret on every Spillway process, and/or \
         `cluster.tls.cert_file`, `cluster.tls.key_file` and `cluster.tls.ca_file` \
         (SPILLWAY_CLUSTER__TLS__*) for mutual TLS, or listen on 127.0.0.1"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "0123456789abcdef0123";

    fn auth() -> ClusterAuth {
        ClusterAuth::new(ClusterSecret::new(SECRET).ok())
    }

    fn request(secret: Option<&str>) -> Request<()> {
        let mut request = Request::new(());
        if let Some(secret) = secret {
            if let Ok(value) = secret.parse() {
                request.metadata_mut().insert(SECRET_METADATA_KEY, value);
            }
        }
        request
    }

    #[test]
    fn the_right_secret_passes_and_is_taken_off_the_request() {
        let auth = auth();
        let Ok(request) = auth.interceptor("storage").call(request(Some(SECRET))) else {
            panic!("refused the right secret");
        };
        assert!(request.metadata().get(SECRET_METADATA_KEY).is_none());
        assert_eq!(auth.failures("storage"), 0);
    }

    #[test]
    fn a_missing_or_wrong_secret_is_unauthenticated_and_counted_per_service() {
        let auth = auth();
        let cases = [
            (None, "missing cluster secret"),
            (Some("0123456789abcdef012"), "wrong cluster secret"),
            (Some("0123456789abcdef01234"), "wrong cluster secret"),
            (Some("x"), "wrong cluster secret"),
        ];
        for (presented, reason) in cases {
            let Err(status) = auth.interceptor("engine").call(request(presented)) else {
                panic!("{presented:?} was let in");
            };
            assert_eq!(status.code(), tonic::Code::Unauthenticated);
            assert!(status.message().starts_with(reason), "{}", status.message());
            assert!(!status.message().contains(SECRET));
        }
        assert_eq!(auth.failures("engine"), 4);
        assert_eq!(auth.failures("engine_admin"), 0);
        let metrics = Metrics::new();
        auth.register_metrics(&metrics);
        let text = metrics.encode().unwrap_or_default();
        assert!(
            text.contains("spillway_grpc_auth_failures_total{service=\"engine\"} 4"),
            "{text}"
        );
    }

    #[test]
    fn without_a_secret_every_call_is_let_in() {
        let open = ClusterAuth::new(None);
        assert!(open.interceptor("engine").call(request(None)).is_ok());
        assert!(open.interceptor("engine").call(request(Some("x"))).is_ok());
    }

    #[test]
    fn a_peer_is_warned_about_once_a_minute() {
        let auth = auth();
        let start = Instant::now();
        let peer: IpAddr = [10, 0, 0, 7].into();
        let other: IpAddr = [10, 0, 0, 8].into();
        assert!(auth.first_in_a_while(Some(peer), start));
        assert!(!auth.first_in_a_while(Some(peer), start + Duration::from_secs(1)));
        assert!(auth.first_in_a_while(Some(other), start + Duration::from_secs(1)));
        assert!(auth.first_in_a_while(Some(peer), start + WARN_EVERY));
        // Many addresses: the memory stays bounded.
        for n in 0..(REMEMBERED_PEERS as u32 * 2) {
            auth.first_in_a_while(Some(IpAddr::from(n.to_be_bytes())), start);
        }
        assert!(auth.inner.warned.lock().len() <= REMEMBERED_PEERS);
    }

    #[tokio::test]
    async fn only_loopback_may_go_without_a_secret_or_tls() {
        for listen in ["127.0.0.1:0", "[::1]:0", "localhost:0"] {
            let result =
                require_protection_off_loopback("engine", "engine.listen", listen, false).await;
            assert!(result.is_ok(), "{listen}: {result:?}");
        }
        for listen in ["0.0.0.0:50061", "[::]:50061", "192.0.2.1:50061"] {
            let Err(error) =
                require_protection_off_loopback("engine", "engine.listen", listen, false).await
            else {
                panic!("{listen} allowed without a secret");
            };
            let text = error.to_string();
            assert!(
                text.contains("`engine.listen`")
                    && text.contains("cluster.secret")
                    && text.contains("cluster.tls.cert_file"),
                "{text}"
            );
            let with = require_protection_off_loopback("engine", "engine.listen", listen, true);
            assert!(with.await.is_ok());
        }
    }
}
