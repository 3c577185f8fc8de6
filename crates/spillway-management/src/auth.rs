//! Who is calling the management API. Every call passes through
//! [`Authenticated`], a tower service in front of the gRPC service, which
//! reads the `authorization` header and puts the [`Caller`] in the request's
//! extensions; each call then checks what that caller may do
//! ([`crate::authorize`]). Accepted:
//!
//! - `Bearer <token>`: `management.token`, an operator with every right;
//! - `Basic base64(user:password)` of a `[[management.users]]` entry: also
//!   an operator;
//! - `Basic` of a user stored in the broker (`spillctl user add`), checked
//!   by the engine: what it may do follows its tags and permissions, as in
//!   RabbitMQ's management plugin.
//!
//! Anything else is UNAUTHENTICATED, with the same words for an unknown
//! user, a wrong password and a loopback-only user from elsewhere. Refusals
//! are counted in `spillway_management_login_refusals_total{reason}` and
//! logged at most once a minute per peer address and user.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use base64::Engine as _;
use futures::future::BoxFuture;
use serde::Deserialize;
use spillway_proto::engine::EngineAdminApi;
use spillway_proto::engine::{AuthenticateUserRequest, LoginResult};
use spillway_proto::permissions::Permissions;
use spillway_telemetry::prometheus_client::metrics::counter::Counter;
use spillway_telemetry::prometheus_client::metrics::family::Family;
use spillway_telemetry::{LoginThrottle, Metrics, RefusalLog};
use tonic::server::NamedService;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::Status;

/// The longest `authorization` header read. A user name and a password of
/// the broker's largest sizes (255 and 4096 bytes) fit in base64 well
/// below it.
const MAX_AUTHORIZATION_LEN: usize = 8192;

/// The words of every refused login (the log has the reason).
pub const INVALID_CREDENTIALS: &str = "invalid user or password";

/// A management user (`[[management.users]]` in the configuration).
#[derive(Clone, Debug, Deserialize)]
pub struct ManagementUser {
    pub name: String,
    pub password: String,
    /// Only accepted from a loopback address (like the built-in guest).
    #[serde(default)]
    pub loopback_only: bool,
}

impl ManagementUser {
    /// `guest`/`guest`, from loopback only: the default, as on the AMQP port.
    pub fn guest() -> Self {
        Self {
            name: "guest".into(),
            password: "guest".into(),
            loopback_only: true,
        }
    }
}

/// The credentials of the configuration.
#[derive(Clone, Debug, Default)]
pub struct AuthConfig {
    /// Accepted as `Bearer <token>`; `None` (or empty): no token accepted.
    pub token: Option<String>,
    pub users: Vec<ManagementUser>,
}

/// Who made a call, as the call's checks need it.
#[derive(Clone, Debug)]
pub enum Caller {
    /// The token or a configured management user: every right.
    Operator { name: String },
    /// A user stored in the broker, with its tags and its permissions as
    /// they were when the call arrived.
    User(Arc<StoredUser>),
}

impl Caller {
    pub fn name(&self) -> &str {
        match self {
            Caller::Operator { name } => name,
            Caller::User(user) => &user.name,
        }
    }
}

/// A stored user calling management.
#[derive(Debug)]
pub struct StoredUser {
    pub name: String,
    pub tags: Vec<String>,
    /// By vhost.
    pub permissions: HashMap<String, Permissions>,
}

impl StoredUser {
    pub fn has_tag(&self, tag: &str) -> bool {
        self.tags.iter().any(|t| t == tag)
    }
}

/// Why a login was refused (the label of the refusal metric).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    Missing,
    Malformed,
    InvalidToken,
    InvalidCredentials,
    LoopbackOnly,
}

impl Refusal {
    /// Wrong credentials (what a guesser sends), as opposed to none or a
    /// malformed header.
    fn is_a_guess(self) -> bool {
        matches!(
            self,
            Refusal::InvalidToken | Refusal::InvalidCredentials | Refusal::LoopbackOnly
        )
    }

    fn reason(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Malformed => "malformed",
            Refusal::InvalidToken => "invalid_token",
            Refusal::InvalidCredentials => "invalid_credentials",
            Refusal::LoopbackOnly => "loopback_only",
        }
    }

    fn status(self) -> Status {
        match self {
            Refusal::Missing => Status::unauthenticated(
                "missing credentials: send `authorization: Bearer <token>` or Basic user:password",
            ),
            Refusal::Malformed => Status::unauthenticated(
                "malformed authorization header (use Bearer <token> or Basic base64(user:password))",
            ),
            Refusal::InvalidToken => Status::unauthenticated("invalid token"),
            Refusal::InvalidCredentials | Refusal::LoopbackOnly => {
                Status::unauthenticated(INVALID_CREDENTIALS)
            }
        }
    }
}

type RefusalCounts = Family<Vec<(&'static str, &'static str)>, Counter>;

/// Checks credentials: the configuration's itself, stored users' through
/// the engine.
pub struct Authenticator {
    config: AuthConfig,
    engine: Arc<dyn EngineAdminApi>,
    refusals: RefusalCounts,
    refusal_log: RefusalLog,
    /// Slows the calls of an address whose credentials keep failing.
    throttle: LoginThrottle,
}

impl Authenticator {
    pub fn new(config: AuthConfig, engine: Arc<dyn EngineAdminApi>) -> Self {
        Self {
            config,
            engine,
            refusals: RefusalCounts::default(),
            refusal_log: RefusalLog::default(),
            throttle: LoginThrottle::default(),
        }
    }

    /// Adds `spillway_management_login_refusals_total{reason}` to `metrics`.
    pub fn register_metrics(&self, metrics: &Metrics) {
        metrics.register(
            "spillway_management_login_refusals",
            "Management calls refused for missing or wrong credentials, by reason",
            self.refusals.clone(),
        );
    }

    /// The caller of a call with these headers from `peer`.
    pub async fn identify(
        &self,
        headers: &http::HeaderMap,
        peer: Option<SocketAddr>,
    ) -> Result<Caller, Status> {
        let address = peer.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |p| p.ip());
        let wait = self.throttle.wait(address, Instant::now());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        let mut user = String::new();
        let result = self.check(headers, peer, &mut user).await;
        match result {
            Ok(caller) => {
                self.throttle.succeeded(address, &user);
                Ok(caller)
            }
            Err(Identify::Refused(refusal)) => {
                let shown = if user == TOKEN_BEARER { "" } else { &user };
                self.log_refusal(refusal, peer, shown);
                if refusal.is_a_guess() && self.throttle.failed(address, &user, Instant::now()) {
                    tracing::warn!(
                        peer = ?peer,
                        "management calls from this address are throttled to one a second after {} refused credentials that no success of the same user forgave",
                        spillway_telemetry::FREE_LOGIN_FAILURES
                    );
                }
                Err(refusal.status())
            }
            Err(Identify::Failed(status)) => Err(status),
        }
    }

    async fn check(
        &self,
        headers: &http::HeaderMap,
        peer: Option<SocketAddr>,
        user_seen: &mut String,
    ) -> Result<Caller, Identify> {
        let loopback = peer.is_some_and(|a| a.ip().is_loopback());
        let offered = credentials(headers)?;
        // Who the throttle counts a failure against, and forgives on a
        // success: the user named, or the bearer of a token (a name no
        // user can have, as it holds a NUL).
        match &offered {
            Credentials::Token(_) => TOKEN_BEARER.clone_into(user_seen),
            Credentials::Basic { name, .. } => name.clone_into(user_seen),
        }
        let (name, password) = match configured_check(&self.config, offered, loopback)? {
            Checked::Operator(caller) => return Ok(caller),
            Checked::Stored { name, password } => (name, password),
        };
        let answer = self
            .engine
            .authenticate_user(AuthenticateUserRequest {
                user: name.clone(),
                password,
                peer_is_loopback: loopback,
            })
            .await
            .map_err(|error| Identify::Failed(Status::from(error)))?;
        match answer.result() {
            LoginResult::Accepted => {}
            LoginResult::LoopbackOnly => return Err(Refusal::LoopbackOnly.into()),
            LoginResult::InvalidCredentials | LoginResult::Unspecified => {
                return Err(Refusal::InvalidCredentials.into())
            }
        }
        let mut permissions = HashMap::new();
        for granted in answer.permissions {
            // The engine compiled these patterns when they were set; one
            // that does not compile here grants nothing.
            if let Ok(compiled) =
                Permissions::new(&granted.configure, &granted.write, &granted.read)
            {
                permissions.insert(granted.vhost, compiled);
            }
        }
        Ok(Caller::User(Arc::new(StoredUser {
            name,
            tags: answer.tags,
            permissions,
        })))
    }

    fn log_refusal(&self, refusal: Refusal, peer: Option<SocketAddr>, user: &str) {
        self.refusals
            .get_or_create(&vec![("reason", refusal.reason())])
            .inc();
        let address = peer.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |p| p.ip());
        let Some(suppressed) = self.refusal_log.admit(address, user, Instant::now()) else {
            return;
        };
        tracing::warn!(
            peer = ?peer,
            user,
            reason = refusal.reason(),
            suppressed,
            "management call refused ({suppressed} more refusals of this user and address not logged in the last minute)"
        );
    }
}

/// The name a bearer token's failures and successes are counted under by
/// the login throttle (and shown in the refusal log).
const TOKEN_BEARER: &str = "\u{0}token";

/// What the `authorization` header offers.
#[derive(Debug, PartialEq, Eq)]
enum Credentials {
    Token(String),
    Basic { name: String, password: String },
}

fn credentials(headers: &http::HeaderMap) -> Result<Credentials, Refusal> {
    let header = headers
        .get(http::header::AUTHORIZATION)
        .ok_or(Refusal::Missing)?;
    if header.len() > MAX_AUTHORIZATION_LEN {
        return Err(Refusal::Malformed);
    }
    let header = header.to_str().map_err(|_| Refusal::Malformed)?;
    let (scheme, value) = header.split_once(' ').ok_or(Refusal::Malformed)?;
    if scheme.eq_ignore_ascii_case("bearer") {
        return Ok(Credentials::Token(value.trim().to_string()));
    }
    if !scheme.eq_ignore_ascii_case("basic") {
        return Err(Refusal::Malformed);
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(value.trim())
        .map_err(|_| Refusal::Malformed)?;
    let decoded = String::from_utf8(decoded).map_err(|_| Refusal::Malformed)?;
    let (name, password) = decoded.split_once(':').ok_or(Refusal::Malformed)?;
    Ok(Credentials::Basic {
        name: name.to_string(),
        password: password.to_string(),
    })
}

/// The token and the configured users, checked here; a Basic login of
/// anyone else is left to the stored users.
fn configured_check(
    config: &AuthConfig,
    credentials: Credentials,
    loopback: bool,
) -> Result<Checked, Refusal> {
    match credentials {
        Credentials::Token(offered) => {
            let token = config.token.as_deref().unwrap_or_default();

            if !token.is_empty() && constant_time_eq(token.as_bytes(), offered.as_bytes()) {
                return Ok(Checked::Operator(Caller::Operator {
                    name: "token".into(),
                }));
            }
            Err(Refusal::InvalidToken)
        }
        Credentials::Basic { name, password } => {
            let configured = config.users.iter().find(|u| {
                u.name == name && constant_time_eq(u.password.as_bytes(), password.as_bytes())
            });
            let Some(user) = configured else {
                return Ok(Checked::Stored { name, password });
            };
            if user.loopback_only && !loopback {
                return Err(Refusal::LoopbackOnly);
            }
            Ok(Checked::Operator(Caller::Operator {
                name: user.name.clone(),
            }))
        }
    }
}

enum Checked {
    Operator(Caller),
    Stored { name: String, password: String },
}

enum Identify {
    Refused(Refusal),
    /// The engine could not be asked.
    Failed(Status),
}

impl From<Refusal> for Identify {
    fn from(refusal: Refusal) -> Self {
        Identify::Refused(refusal)
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The address of the peer, as tonic's server records it (plain TCP or
/// TLS).
fn peer_of<B>(request: &http::Request<B>) -> Option<SocketAddr> {
    let extensions = request.extensions();
    extensions
        .get::<TcpConnectInfo>()
        .and_then(TcpConnectInfo::remote_addr)
        .or_else(|| {
            extensions
                .get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|info| info.get_ref().remote_addr())
        })
}

/// The gRPC service `S`, called only with an identified [`Caller`] in the
/// request's extensions; anything else is answered with the refusal.
#[derive(Clone)]
pub struct Authenticated<S> {
    inner: S,
    authenticator: Arc<Authenticator>,
}

impl<S> Authenticated<S> {
    pub fn new(inner: S, authenticator: Arc<Authenticator>) -> Self {
        Self {
            inner,
            authenticator,
        }
    }
}

impl<S, B> tower::Service<http::Request<B>> for Authenticated<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        // The clone that was made ready is the one that serves (tower's
        // rule for services called from a future).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let authenticator = self.authenticator.clone();
        Box::pin(async move {
            let peer = peer_of(&request);
            match authenticator.identify(request.headers(), peer).await {
                Ok(caller) => {
                    request.extensions_mut().insert(caller);
                    inner.call(request).await
                }
                Err(status) => Ok(status.into_http()),
            }
        })
    }
}

impl<S: NamedService> NamedService for Authenticated<S> {
    const NAME: &'static str = S::NAME;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn headers(header: &str) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::AUTHORIZATION, header.parse().unwrap());
        headers
    }

    fn basic(pair: &str) -> String {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(pair)
        )
    }

    fn config() -> AuthConfig {
        AuthConfig {
            token: Some("s3cret".into()),
            users: vec![
                ManagementUser {
                    name: "ops".into(),
                    password: "pw".into(),
                    loopback_only: false,
                },
                ManagementUser::guest(),
            ],
        }
    }

    fn configured(config: &AuthConfig, header: &str, loopback: bool) -> Result<Checked, Refusal> {
        configured_check(config, credentials(&headers(header))?, loopback)
    }

    #[test]
    fn the_token_and_configured_users_are_operators() {
        let config = config();
        assert!(matches!(
            configured(&config, "Bearer s3cret", false),
            Ok(Checked::Operator(_))
        ));
        assert!(matches!(
            configured(&config, &basic("ops:pw"), false),
            Ok(Checked::Operator(Caller::Operator { name })) if name == "ops"
        ));
        assert!(matches!(
            configured(&config, &basic("guest:guest"), true),
            Ok(Checked::Operator(_))
        ));
    }

    #[test]
    fn others_are_refused_or_left_to_the_stored_users() {
        let config = config();
        assert_eq!(
            configured(&config, "Bearer nope", false).err(),
            Some(Refusal::InvalidToken)
        );
        assert_eq!(
            configured(&config, &basic("guest:guest"), false).err(),
            Some(Refusal::LoopbackOnly)
        );
        for malformed in ["Basic !!", "Digest x", "Bearer", &basic("no-colon")] {
            assert_eq!(
                configured(&config, malformed, false).err(),
                Some(Refusal::Malformed),
                "{malformed}"
            );
        }
        assert!(matches!(
            configured(&config, &basic("ops:wrong"), false),
            Ok(Checked::Stored { name, .. }) if name == "ops"
        ));
        let no_token = AuthConfig::default();
        assert_eq!(
            configured(&no_token, "Bearer ", false).err(),
            Some(Refusal::InvalidToken)
        );
        assert_eq!(
            credentials(&http::HeaderMap::new()).err(),
            Some(Refusal::Missing)
        );
        let long = format!("Bearer {}", "x".repeat(MAX_AUTHORIZATION_LEN));
        assert_eq!(credentials(&headers(&long)).err(), Some(Refusal::Malformed));
    }
}
