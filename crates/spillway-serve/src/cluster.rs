//! Who may call the internal gRPC services, and which calls: each role
//! only the calls its component makes (`docs/security.md`).
//!
//! | service | methods | callers |
//! |---|---|---|
//! | engine `Engine` | the session stream | gateway |
//! | engine `EngineAdmin` | all | management |
//! | storage `Storage` | `Status`, `WatchQuota`, `SetQuota` | engine, management |
//! | storage `Storage` | the rest (writes, reads, the lease) | engine |
//! | storage `StorageGroup` | `AppendEntries`, `Vote`, `InstallSnapshot` | storage |
//! | storage `StorageGroup` | `GetGroupStatus` | storage, management |
//! | storage `StorageGroup` | `AddMember`, `RemoveMember` | management |
//!
//! A caller names its role in every call (`spillway-cluster-role`) and proves
//! it one of three ways ([`Callers`]):
//!
//! - **its own secret** (`cluster.verifiers` set): each role has a secret of
//!   its own, held by that role's processes only; every process knows each
//!   role's *verifier*, the SHA-256 of its secret, which proves a caller
//!   without letting the holder pose as it;
//! - **its cluster certificate** (`cluster.tls` without a secret): the role
//!   the certificate names (URI `spillway://role/<role>`);
//! - **one shared secret** (`cluster.secret` alone, or the local secret of
//!   the data directory): it proves only that the caller is one of this
//!   machine's Spillway processes, so the role it names is believed; a
//!   separate role serves this way on loopback only.
//!
//! Where a certificate names a role, the call must name the same. A
//! refusal is `UNAUTHENTICATED` (credentials missing or wrong) or
//! `PERMISSION_DENIED` (a proven role outside the table), counted in
//! `spillway_grpc_auth_failures_total{service}` and logged at warn once per
//! peer address and [`WARN_EVERY`], so a flood of bad calls does not flood
//! the log. [`Guarded`] applies the check to every call of a service,
//! unary and streaming alike, before the handler sees anything.
//!
//! [`require_protection_off_loopback`] is the start-up rule: a process does
//! not serve internal gRPC beyond loopback unless its callers prove their
//! role (per-role secrets, or cluster certificates naming roles).

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use spillway_proto::cluster::{
    ClusterRole, ClusterSecret, ROLE_METADATA_KEY, ROLE_URI_PREFIX, SECRET_METADATA_KEY,
};
use spillway_telemetry::prometheus_client::metrics::counter::Counter;
use spillway_telemetry::prometheus_client::metrics::family::Family;
use spillway_telemetry::Metrics;
use subtle::ConstantTimeEq;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::Status;

/// A role's verifier: the SHA-256 of its secret, as 64 lowercase hex digits
/// (`cluster.verifiers.<role>`; `sha256sum` of the secret without its
/// newline gives the same).
pub fn role_verifier(secret: &ClusterSecret) -> String {
    Sha256::digest(secret.expose())
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// A verifier's 32 bytes, if `text` is 64 hex digits.
pub fn parse_verifier(text: &str) -> Option<[u8; 32]> {
    let text = text.trim();
    if text.len() != 64 || !text.is_ascii() {
        return None;
    }
    let mut bytes = [0u8; 32];
    for (index, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[index * 2..index * 2 + 2], 16).ok()?;
    }
    Some(bytes)
}

/// The roles that may call `path` (`/package.Service/Method`).
pub fn allowed_callers(path: &str) -> &'static [ClusterRole] {
    use ClusterRole::{Engine, Gateway, Management, Storage};
    let Some((service, method)) = path.trim_start_matches('/').split_once('/') else {
        return &[];
    };
    match (service, method) {
        ("spillway.engine.v1.Engine", _) => &[Gateway],
        ("spillway.engine.v1.EngineAdmin", _) => &[Management],
        ("spillway.storage.v1.Storage", "Status" | "WatchQuota" | "SetQuota") => {
            &[Engine, Management]
        }
        ("spillway.storage.v1.Storage", _) => &[Engine],
        ("spillway.storage.v1.StorageGroup", "AppendEntries" | "Vote" | "InstallSnapshot") => {
            &[Storage]
        }
        ("spillway.storage.v1.StorageGroup", "GetGroupStatus") => &[Storage, Management],
        ("spillway.storage.v1.StorageGroup", "AddMember" | "RemoveMember") => &[Management],
        _ => &[],
    }
}

/// The role a cluster certificate names (its subject alternative name URI
/// `spillway://role/<role>`): `Ok(None)` when it names none, `Err` when it
/// cannot be read or names an unknown role or several.
pub fn role_in_certificate(der: &[u8]) -> Result<Option<ClusterRole>, String> {
    use x509_parser::extensions::GeneralName;
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|error| format!("unreadable certificate: {error}"))?;
    let Ok(Some(names)) = cert.subject_alternative_name() else {
        return Ok(None);
    };
    let mut found = None;
    for name in &names.value.general_names {
        let GeneralName::URI(uri) = name else {
            continue;
        };
        let Some(role) = uri.strip_prefix(ROLE_URI_PREFIX) else {
            continue;
        };
        let role = ClusterRole::from_name(role)
            .ok_or_else(|| format!("the certificate names an unknown role `{role}`"))?;
        if found.is_some_and(|found| found != role) {
            return Err("the certificate names more than one role".into());
        }
        found = Some(role);
    }
    Ok(found)
}

/// The role the PEM certificate (the first of `pem`) names.
pub fn role_in_pem(pem: &[u8]) -> Result<Option<ClusterRole>, String> {
    let (_, block) = x509_parser::pem::parse_x509_pem(pem)
        .map_err(|error| format!("no PEM certificate: {error}"))?;
    role_in_certificate(&block.contents)
}

/// How a server's callers prove their role.
#[derive(Clone, Debug)]
pub enum Callers {
    /// Each role's secret, checked against its verifier.
    PerRole(BTreeMap<ClusterRole, [u8; 32]>),
    /// One secret every role holds: it proves the caller is Spillway's,
    /// not which role (loopback only, or certificates that name roles).
    Shared(ClusterSecret),
    /// No secret: the role the caller's cluster certificate names.
    Certificates,
}

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

/// Why a call was refused: its status code and the reason.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: tonic::Code,
    pub reason: String,
}

fn unauthenticated(reason: impl Into<String>) -> Refusal {
    Refusal {
        code: tonic::Code::Unauthenticated,
        reason: reason.into(),
    }
}

/// The check shared by every internal service of one process.
#[derive(Clone)]
pub struct ClusterAuth {
    inner: Arc<Inner>,
}

struct Inner {
    callers: Callers,
    /// The server runs cluster TLS: callers' certificates may name roles.
    tls: bool,
    failures: Failures,
    /// Peer address → when a refusal of its calls was last logged at warn.
    warned: Mutex<HashMap<IpAddr, Instant>>,
}

impl ClusterAuth {
    pub fn new(callers: Callers, tls: bool) -> Self {
        Self {
            inner: Arc::new(Inner {
                callers,
                tls,
                failures: Failures::default(),
                warned: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Adds `spillway_grpc_auth_failures_total{service}` to `metrics`.
    pub fn register_metrics(&self, metrics: &Metrics) {
        metrics.register(
            "spillway_grpc_auth_failures",
            "Internal gRPC calls refused for missing or wrong credentials, or a role not \
             allowed the call, by service",
            self.inner.failures.clone(),
        );
    }

    /// `inner` with every call checked (`service`: the label in the metric
    /// and the log).
    pub fn guard<S>(&self, service: &'static str, inner: S) -> Guarded<S> {
        Guarded {
            inner,
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

    fn refused(&self, service: &'static str, peer: Option<SocketAddr>, refusal: &Refusal) {
        self.inner
            .failures
            .get_or_create(&vec![("service", service)])
            .inc();
        let peer_text = peer.map_or_else(|| "unknown".to_string(), |peer| peer.to_string());
        let reason = &refusal.reason;
        if self.first_in_a_while(peer.map(|peer| peer.ip()), Instant::now()) {
            tracing::warn!(
                peer = %peer_text,
                service,
                reason = %reason,
                "internal grpc call refused: the caller did not prove a role allowed the call \
                 (further refusals from this address are logged at debug for a minute)"
            );
        } else {
            tracing::debug!(peer = %peer_text, service, reason = %reason, "internal grpc call refused");
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

    /// The proven role of the caller of `path`, if it may call it.
    pub fn check(
        &self,
        path: &str,
        headers: &http::HeaderMap,
        certificate: Option<&[u8]>,
    ) -> Result<ClusterRole, Refusal> {
        let claimed = match headers.get(ROLE_METADATA_KEY) {
            None => None,
            Some(value) => Some(
                value
                    .to_str()
                    .ok()
                    .and_then(ClusterRole::from_name)
                    .ok_or_else(|| unauthenticated("unknown cluster role"))?,
            ),
        };
        let certified = match (self.inner.tls, certificate) {
            (true, Some(der)) => role_in_certificate(der).map_err(unauthenticated)?,
            _ => None,
        };
        if let (Some(claimed), Some(certified)) = (claimed, certified) {
            if claimed != certified {
                return Err(unauthenticated(format!(
                    "the call names the {claimed} role, its certificate the {certified} role"
                )));
            }
        }
        let presented = headers
            .get(SECRET_METADATA_KEY)
            .map(|value| value.as_bytes());
        let role = match &self.inner.callers {
            Callers::PerRole(verifiers) => {
                let role = claimed
                    .or(certified)
                    .ok_or_else(|| unauthenticated("missing cluster role"))?;
                let presented =
                    presented.ok_or_else(|| unauthenticated("missing cluster secret"))?;
                let Some(verifier) = verifiers.get(&role) else {
                    return Err(unauthenticated(format!(
                        "no verifier for the {role} role (cluster.verifiers.{role})"
                    )));
                };
                let digest = Sha256::digest(presented);
                if !bool::from(digest.as_slice().ct_eq(verifier)) {
                    return Err(unauthenticated(format!("wrong secret for the {role} role")));
                }
                role
            }
            Callers::Shared(secret) => {
                let presented =
                    presented.ok_or_else(|| unauthenticated("missing cluster secret"))?;
                if !bool::from(presented.ct_eq(secret.expose())) {
                    return Err(unauthenticated("wrong cluster secret"));
                }
                certified
                    .or(claimed)
                    .ok_or_else(|| unauthenticated("missing cluster role"))?
            }
            Callers::Certificates => certified.ok_or_else(|| {
                unauthenticated(format!(
                    "the client certificate names no role (a subject alternative name \
                     URI {ROLE_URI_PREFIX}<role>)"
                ))
            })?,
        };
        if !allowed_callers(path).contains(&role) {
            return Err(Refusal {
                code: tonic::Code::PermissionDenied,
                reason: format!("the {role} role may not call {path}"),
            });
        }
        Ok(role)
    }
}

/// An internal service whose every call is checked by [`ClusterAuth`].
#[derive(Clone)]
pub struct Guarded<S> {
    inner: S,
    auth: ClusterAuth,
    service: &'static str,
}

impl<S: NamedService> NamedService for Guarded<S> {
    const NAME: &'static str = S::NAME;
}

type Answer = http::Response<tonic::body::Body>;

impl<S, B> tonic::codegen::Service<http::Request<B>> for Guarded<S>
where
    S: tonic::codegen::Service<http::Request<B>, Response = Answer, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Answer;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Answer, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let tls = request.extensions().get::<TlsConnectInfo<TcpConnectInfo>>();
        let certificates = tls.and_then(|info| info.peer_certs());
        let peer = tls
            .and_then(|info| info.get_ref().remote_addr())
            .or_else(|| {
                request
                    .extensions()
                    .get::<TcpConnectInfo>()
                    .and_then(|info| info.remote_addr())
            });
        let certificate = certificates
            .as_ref()
            .and_then(|certificates| certificates.first())
            .map(|der| der.as_ref());
        let path = request.uri().path().to_string();
        match self.auth.check(&path, request.headers(), certificate) {
            Ok(_) => {
                // The handler has no use for it: nothing it logs can show it.
                request.headers_mut().remove(SECRET_METADATA_KEY);
                Box::pin(self.inner.call(request))
            }
            Err(refusal) => {
                self.auth.refused(self.service, peer, &refusal);
                let status = Status::new(
                    refusal.code,
                    format!(
                        "{}: the {} service accepts only the Spillway roles that make this \
                         call, proven by their cluster secret or certificate",
                        refusal.reason, self.service
                    ),
                );
                Box::pin(std::future::ready(Ok(status.into_http())))
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
        "refusing to serve the {component}'s internal gRPC on {listen} without per-role \
         credentials: `{key}` is not a loopback address, so anyone who can reach it could \
         use it, and one shared cluster secret would let every role make every call. Set \
         `cluster.secret_file` (SPILLWAY_CLUSTER__SECRET_FILE) to this role's own secret \
         and `cluster.verifiers.gateway`, `.engine`, `.storage` and `.management` \
         (SPILLWAY_CLUSTER__VERIFIERS__*) on every process, and/or `cluster.tls.cert_file`, \
         `cluster.tls.key_file` and `cluster.tls.ca_file` (SPILLWAY_CLUSTER__TLS__*) with \
         certificates that name their role ({ROLE_URI_PREFIX}<role>), or listen on 127.0.0.1"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ClusterRole::{Engine, Gateway, Management, Storage};

    const SECRET: &str = "0123456789abcdef0123";

    fn role_secret(role: ClusterRole) -> String {
        format!("secret-of-the-{role}-role-0123456789")
    }

    fn shared() -> ClusterAuth {
        ClusterAuth::new(Callers::Shared(ClusterSecret::new(SECRET).unwrap()), false)
    }

    fn per_role() -> ClusterAuth {
        let verifiers = ClusterRole::ALL
            .into_iter()
            .map(|role| {
                let secret = ClusterSecret::new(&role_secret(role)).unwrap();
                (role, parse_verifier(&role_verifier(&secret)).unwrap())
            })
            .collect();
        ClusterAuth::new(Callers::PerRole(verifiers), false)
    }

    fn headers(role: Option<&str>, secret: Option<&str>) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        if let Some(role) = role {
            headers.insert(ROLE_METADATA_KEY, role.parse().unwrap());
        }
        if let Some(secret) = secret {
            headers.insert(SECRET_METADATA_KEY, secret.parse().unwrap());
        }
        headers
    }

    const APPEND: &str = "/spillway.storage.v1.StorageGroup/AppendEntries";
    const ADD_MEMBER: &str = "/spillway.storage.v1.StorageGroup/AddMember";
    const WRITE: &str = "/spillway.storage.v1.Storage/Write";
    const STATUS: &str = "/spillway.storage.v1.Storage/Status";
    const SESSION: &str = "/spillway.engine.v1.Engine/Session";
    const ADMIN: &str = "/spillway.engine.v1.EngineAdmin/ListVhosts";

    #[test]
    fn each_role_may_make_only_its_own_calls() {
        let auth = per_role();
        let cases = [
            (Gateway, SESSION, true),
            (Gateway, ADMIN, false),
            (Gateway, WRITE, false),
            (Gateway, APPEND, false),
            (Gateway, ADD_MEMBER, false),
            (Engine, WRITE, true),
            (Engine, STATUS, true),
            (Engine, SESSION, false),
            (Engine, APPEND, false),
            (Engine, ADD_MEMBER, false),
            (Storage, APPEND, true),
            (
                Storage,
                "/spillway.storage.v1.StorageGroup/GetGroupStatus",
                true,
            ),
            (Storage, ADD_MEMBER, false),
            (Storage, WRITE, false),
            (Management, ADMIN, true),
            (Management, STATUS, true),
            (Management, ADD_MEMBER, true),
            (
                Management,
                "/spillway.storage.v1.StorageGroup/RemoveMember",
                true,
            ),
            (Management, WRITE, false),
            (Management, APPEND, false),
            (Management, "/spillway.engine.v1.Unknown/Call", false),
        ];
        for (role, path, allowed) in cases {
            let secret = role_secret(role);
            let answer = auth.check(path, &headers(Some(role.as_str()), Some(&secret)), None);
            match (allowed, answer) {
                (true, Ok(proven)) => assert_eq!(proven, role),
                (false, Err(refusal)) => {
                    assert_eq!(refusal.code, tonic::Code::PermissionDenied, "{role} {path}");
                    assert!(refusal.reason.contains(path), "{}", refusal.reason);
                }
                (allowed, answer) => panic!("{role} {path}: allowed {allowed}, got {answer:?}"),
            }
        }
    }

    #[test]
    fn a_role_proves_itself_with_its_own_secret_only() {
        let auth = per_role();
        let gateway = role_secret(Gateway);
        // The gateway's secret does not make it the storage or management role.
        for role in ["storage", "management"] {
            let refused = auth.check(APPEND, &headers(Some(role), Some(&gateway)), None);
            let refusal = refused.expect_err("let in");
            assert_eq!(refusal.code, tonic::Code::Unauthenticated);
            assert!(
                refusal.reason.starts_with("wrong secret for the"),
                "{refusal:?}"
            );
        }
        let cases = [
            (None, Some(gateway.as_str()), "missing cluster role"),
            (Some("gateway"), None, "missing cluster secret"),
            (
                Some("all-in-one"),
                Some(gateway.as_str()),
                "unknown cluster role",
            ),
        ];
        for (role, secret, reason) in cases {
            let refusal = auth
                .check(SESSION, &headers(role, secret), None)
                .expect_err("let in");
            assert_eq!(refusal.code, tonic::Code::Unauthenticated);
            assert_eq!(refusal.reason, reason);
        }
    }

    #[test]
    fn a_shared_secret_lets_the_named_role_make_its_calls_only() {
        let auth = shared();
        assert_eq!(
            auth.check(APPEND, &headers(Some("storage"), Some(SECRET)), None),
            Ok(Storage)
        );
        let refusal = auth
            .check(APPEND, &headers(Some("gateway"), Some(SECRET)), None)
            .expect_err("let in");
        assert_eq!(refusal.code, tonic::Code::PermissionDenied);
        for (secret, reason) in [
            (None, "missing cluster secret"),
            (Some("0123456789abcdef012"), "wrong cluster secret"),
            (Some("x"), "wrong cluster secret"),
        ] {
            let refusal = auth
                .check(SESSION, &headers(Some("gateway"), secret), None)
                .expect_err("let in");
            assert_eq!(refusal.code, tonic::Code::Unauthenticated);
            assert_eq!(refusal.reason, reason);
        }
    }

    fn certificate(role_uri: Option<&str>) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        if let Some(uri) = role_uri {
            params
                .subject_alt_names
                .push(rcgen::SanType::URI(uri.try_into().unwrap()));
        }
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn with_certificates_the_role_is_the_one_the_certificate_names() {
        let auth = ClusterAuth::new(Callers::Certificates, true);
        let gateway = certificate(Some("spillway://role/gateway"));
        let storage = certificate(Some("spillway://role/storage"));
        let none = certificate(None);
        assert_eq!(
            auth.check(APPEND, &headers(None, None), Some(&storage)),
            Ok(Storage)
        );
        let refusal = auth
            .check(APPEND, &headers(None, None), Some(&gateway))
            .expect_err("let in");
        assert_eq!(refusal.code, tonic::Code::PermissionDenied);
        // Naming another role in the call does not help.
        let refusal = auth
            .check(APPEND, &headers(Some("storage"), None), Some(&gateway))
            .expect_err("let in");
        assert_eq!(refusal.code, tonic::Code::Unauthenticated);
        let refusal = auth
            .check(SESSION, &headers(Some("gateway"), None), Some(&none))
            .expect_err("let in");
        assert!(refusal.reason.contains("names no role"), "{refusal:?}");
        let odd = certificate(Some("spillway://role/root"));
        assert!(role_in_certificate(&odd).is_err());
        // A shared secret with role-naming certificates: the certificate wins.
        let auth = ClusterAuth::new(Callers::Shared(ClusterSecret::new(SECRET).unwrap()), true);
        let refusal = auth
            .check(APPEND, &headers(None, Some(SECRET)), Some(&gateway))
            .expect_err("let in");
        assert_eq!(refusal.code, tonic::Code::PermissionDenied);
    }

    #[test]
    fn verifiers_are_the_sha256_of_the_secret_in_hex() {
        let secret = ClusterSecret::new("0123456789abcdef").unwrap();
        // printf %s 0123456789abcdef | sha256sum
        let hex = role_verifier(&secret);
        assert_eq!(
            hex,
            "9f9f5111f7b27a781f1f1ddde5ebc2dd2b796bfc7365c9c28b548e564176929f"
        );
        assert!(parse_verifier(&hex).is_some());
        assert!(parse_verifier(&hex[1..]).is_none());
        assert!(parse_verifier(&format!("{}g", &hex[1..])).is_none());
    }

    #[test]
    fn refusals_are_counted_per_service() {
        let auth = shared();
        auth.refused("engine", None, &unauthenticated("x"));
        auth.refused("engine", None, &unauthenticated("x"));
        assert_eq!(auth.failures("engine"), 2);
        assert_eq!(auth.failures("engine_admin"), 0);
        let metrics = Metrics::new();
        auth.register_metrics(&metrics);
        let text = metrics.encode().unwrap_or_default();
        assert!(
            text.contains("spillway_grpc_auth_failures_total{service=\"engine\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn a_peer_is_warned_about_once_a_minute() {
        let auth = shared();
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
    async fn only_loopback_may_go_without_per_role_credentials() {
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
                    && text.contains("cluster.verifiers")
                    && text.contains("cluster.secret_file")
                    && text.contains("cluster.tls.cert_file"),
                "{text}"
            );
            let with = require_protection_off_loopback("engine", "engine.listen", listen, true);
            assert!(with.await.is_ok());
        }
    }
}
