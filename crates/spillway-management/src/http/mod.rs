//! RabbitMQ's management HTTP API, the part the common tools call
//! (`rabbitmqadmin`, client libraries of the API, Flower, KEDA), served by
//! the management service on `management.http_listen`.
//!
//! Every request goes through the same code as a gRPC call: HTTP Basic
//! credentials are checked by the same [`Authenticator`] (stored users and
//! their tags, the configured operators), and each endpoint calls the
//! same [`ManagementService`] method as gRPC does, with the caller, so what a
//! user may see and do over HTTP is what it may over gRPC. This module only
//! translates: URLs and JSON bodies in RabbitMQ's shapes to requests, a
//! module per resource, each with its own routes ([`overview`], [`vhosts`],
//! [`users`] and permissions, [`policies`], [`exchanges`], [`queues`],
//! [`bindings`], [`connections`] with channels and consumers,
//! [`definitions`]; what they share in [`common`]), answers to RabbitMQ's
//! JSON ([`shapes`]), lists to pages ([`pages`]), and gRPC statuses to HTTP
//! errors ([`ApiError`]). The console ([`console`]) serves its files only.
//!
//! Limits, as on the AMQP port: request headers ([`MAX_HEADER_BYTES`]) and
//! bodies ([`MAX_BODY_BYTES`]), open connections ([`MAX_CONNECTIONS`]), the
//! time to send the headers and the time a request may take
//! ([`REQUEST_TIMEOUT`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::body::Body;
use axum::extract::DefaultBodyLimit;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;
use tonic::{Code, Status};
use tower::ServiceExt;

use crate::auth::{Authenticator, Caller};
use crate::ManagementService;

mod bindings;
mod common;
mod connections;
mod console;
pub mod definitions;
mod exchanges;
mod guard;
mod overview;
pub mod pages;
mod policies;
mod queues;
pub mod rates;
pub mod shapes;
mod users;
mod vhosts;

/// The largest request head (request line and headers) read.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// The largest request body read.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// Connections served at once; more wait to be accepted.
pub const MAX_CONNECTIONS: usize = 256;

/// The time a client has to send a request's headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The time one request may take, its body read included.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// How long open requests may finish once the server stops.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// What the endpoints share: the service and who checks credentials.
pub struct HttpApi {
    pub(crate) service: Arc<ManagementService>,
    pub(crate) authenticator: Arc<Authenticator>,
    /// This node's name in answers (`spillway@HOST`).
    pub(crate) node: String,
    /// The AMQP listeners to report in `/api/overview` (protocol, address).
    pub(crate) listeners: Vec<(String, SocketAddr)>,
    /// Message rates and recent history, sampled every `sample_every`.
    pub(crate) rates: rates::Rates,
    pub(crate) sample_every: Duration,
    /// Requests that read every queue of the broker at once (queue lists)
    /// take a slot: what they hold in passing (about 1 KB a queue) is so
    /// bounded by the slots, not by the connections.
    pub(crate) list_slots: Semaphore,
}

/// Queue lists built at once ([`HttpApi::list_slots`]).
pub const LIST_SLOTS: usize = 2;

/// How often message rates are sampled unless configured: RabbitMQ's
/// `collect_statistics_interval`.
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_secs(5);

impl HttpApi {
    /// Adds an AMQP listener to what `/api/overview` reports.
    pub fn with_listener(mut self, protocol: &str, addr: SocketAddr) -> Self {
        self.listeners.push((protocol.to_string(), addr));
        self
    }

    /// Samples message rates every `every` (at least 100 ms).
    pub fn with_sample_interval(mut self, every: Duration) -> Self {
        self.sample_every = every.max(Duration::from_millis(100));
        self
    }

    /// A slot for a request that reads every queue; waits for one.
    pub(crate) async fn list_slot(&self) -> Result<tokio::sync::SemaphorePermit<'_>, ApiError> {
        self.list_slots.acquire().await.map_err(|_| ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            error: "service_unavailable",
            reason: "the HTTP API is stopping".into(),
        })
    }

    /// The router of every endpoint.
    fn router(api: Arc<Self>) -> Router {
        Router::new()
            .merge(overview::routes())
            .merge(vhosts::routes())
            .merge(users::routes())
            .merge(policies::routes())
            .merge(exchanges::routes())
            .merge(queues::routes())
            .merge(bindings::routes())
            .merge(connections::routes())
            .merge(definitions::routes())
            .with_state(api)
            .merge(console::router())
            .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
            .layer(axum::middleware::from_fn(guard::refuse_cross_site))
            .fallback(|| async { ApiError::not_found() })
    }
}

/// A refusal in RabbitMQ's JSON: `{"error": ..., "reason": ...}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    error: &'static str,
    reason: String,
}

impl ApiError {
    pub fn bad_request(reason: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            error: "bad_request",
            reason: reason.into(),
        }
    }

    pub fn not_found() -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            error: "Object Not Found",
            reason: "Not Found".into(),
        }
    }

    fn unauthorized(reason: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            error: "not_authorized",
            reason: reason.into(),
        }
    }
}

impl From<Status> for ApiError {
    fn from(status: Status) -> Self {
        let reason = status.message().to_string();
        match status.code() {
            Code::NotFound => Self::not_found(),
            // RabbitMQ answers 401 both for a failed login and for an
            // object the user may not touch.
            Code::Unauthenticated | Code::PermissionDenied => Self::unauthorized(reason),
            Code::InvalidArgument | Code::FailedPrecondition | Code::AlreadyExists => {
                Self::bad_request(reason)
            }
            Code::OutOfRange => Self::bad_request(reason),
            Code::Unavailable | Code::ResourceExhausted | Code::DeadlineExceeded => Self {
                status: StatusCode::SERVICE_UNAVAILABLE,
                error: "service_unavailable",
                reason,
            },
            _ => Self {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                error: "internal_error",
                reason,
            },
        }
    }
}

/// A 401 carries no `WWW-Authenticate: Basic` challenge: a browser would
/// answer it with its own login dialog and then send the credentials it
/// was given with every request to this port, another site's forms
/// included. The console logs in with its own form; tools send their
/// credentials with the request (RabbitMQ's clients, curl `-u`, requests).
impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": self.error, "reason": self.reason});
        (self.status, axum::Json(body)).into_response()
    }
}

/// The peer of a connection, put on each of its requests.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peer(pub SocketAddr);

/// Who sent a request: checked once per request from its headers.
pub(crate) async fn caller_of(
    api: &HttpApi,
    parts: &axum::http::request::Parts,
) -> Result<Caller, ApiError> {
    let peer = parts.extensions.get::<Peer>().map(|peer| peer.0);
    api.authenticator
        .identify(&parts.headers, peer)
        .await
        .map_err(|status| ApiError::unauthorized(status.message().to_string()))
}

/// The running HTTP API. Dropping it stops it too, without waiting.
pub struct HttpApiServer {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    accept_loop: JoinHandle<()>,
    sampler: JoinHandle<()>,
}

impl HttpApiServer {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets requests in progress finish (briefly), and
    /// returns once the server is gone.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        self.sampler.abort();
        let _ = self.accept_loop.await;
    }
}

#[async_trait]
impl spillway_telemetry::Server for HttpApiServer {
    fn name(&self) -> &'static str {
        "http"
    }

    fn bind_addrs(&self) -> Vec<(&'static str, SocketAddr)> {
        vec![("http", self.addr)]
    }

    async fn shutdown(self: Box<Self>) {
        HttpApiServer::shutdown(*self).await;
    }
}

#[derive(Debug, thiserror::Error)]
#[error("binding the management HTTP port {addr}: {source}")]
pub struct BindError {
    addr: SocketAddr,
    source: std::io::Error,
}

/// Binds `addr` and serves `api` until [`HttpApiServer::shutdown`]: over
/// TLS only when `tls` is given (the management API's certificate, and its
/// client-certificate rules).
pub async fn start_http_api(
    addr: SocketAddr,
    api: HttpApi,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> Result<HttpApiServer, BindError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| BindError { addr, source })?;
    let addr = listener
        .local_addr()
        .map_err(|source| BindError { addr, source })?;
    let (stop, stopped) = watch::channel(false);
    tracing::info!(%addr, tls = tls.is_some(), "management HTTP API listening");
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    let api = Arc::new(api);
    let sampler = tokio::spawn(rates::run_sampler(Arc::downgrade(&api), api.sample_every));
    let router = HttpApi::router(api);
    let accept_loop = tokio::spawn(accept_loop(listener, router, tls, stopped));
    Ok(HttpApiServer {
        addr,
        stop,
        accept_loop,
        sampler,
    })
}

async fn accept_loop(
    listener: TcpListener,
    router: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    mut stopped: watch::Receiver<bool>,
) {
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HEADER_BYTES);
    loop {
        // A connection slot before accepting: past the limit, connections
        // wait in the kernel's backlog.
        let slot = tokio::select! {
            _ = stopped.changed() => break,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_closed) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            // A dropped sender (the server was dropped) stops it too.
            _ = stopped.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "management HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let router = router.clone();
        let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
            request.extensions_mut().insert(Peer(peer));
            let router = router.clone();
            async move {
                let request = request.map(Body::new);
                let response =
                    match tokio::time::timeout(REQUEST_TIMEOUT, router.oneshot(request)).await {
                        Ok(Ok(response)) => response,
                        Ok(Err(infallible)) => match infallible {},
                        Err(_elapsed) => ApiError {
                            status: StatusCode::SERVICE_UNAVAILABLE,
                            error: "timeout",
                            reason: "the request took too long".into(),
                        }
                        .into_response(),
                    };
                Ok::<_, Infallible>(response)
            }
        });
        let Some(acceptor) = tls.clone() else {
            let connection =
                graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
            tokio::spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!(%peer, %error, "management HTTP connection failed");
                }
                drop(slot);
            });
            continue;
        };
        // The handshake is bounded like the headers: it runs in the
        // connection's task, within the header timeout.
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let handshake =
                tokio::time::timeout(HEADER_READ_TIMEOUT, acceptor.accept(stream)).await;
            let stream = match handshake {
                Ok(Ok(stream)) => stream,
                Ok(Err(error)) => {
                    tracing::debug!(%peer, %error, "management HTTPS handshake failed");
                    return;
                }
                Err(_elapsed) => {
                    tracing::debug!(%peer, "management HTTPS handshake timed out");
                    return;
                }
            };
            let connection = watcher.watch(builder.serve_connection(TokioIo::new(stream), service));
            if let Err(error) = connection.await {
                tracing::debug!(%peer, %error, "management HTTPS connection failed");
            }
            drop(slot);
        });
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::debug!("management HTTP connections still open after the grace period");
    }
}
