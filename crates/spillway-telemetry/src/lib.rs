//! Telemetry: the process's metrics registry and its HTTP endpoint.
//!
//! It owns two things every Spillway process has, whatever role it runs:
//!
//! - [`Metrics`]: a handle to one `prometheus-client` registry. Components
//!   register their counters, gauges and scrape-time collectors into it; the
//!   wiring crate creates it and hands it to each component it starts.
//! - [`start_http`]: a small hyper server answering `GET /metrics` (the
//!   registry in the Prometheus text format, version 0.0.4) and `GET /healthz`
//!   (`200 ok` once [`Health`] says the process is ready, `503` before and
//!   while shutting down). Anything else is `404`.
//!
//! - [`LimitRefusals`] (`refusals.rs`): refusals by limit, counted by the
//!   gateway and the engine and summed into one metric family.
//! - [`MemoryCeiling`] (`memory_ceiling.rs`): the process's high watermark
//!   over the bytes its components hold for clients.
//! - [`Server`] (`server.rs`): the shape every network server of a process
//!   has (name, bound addresses, shutdown), so the wiring holds one list.
//! - [`formats`]: how the configuration writes sizes (`256MiB`), durations
//!   (`30s`) and lists, for the settings each component declares.
//!
//! It knows nothing of AMQP or of the other components: they depend on it, not
//! the other way round. [`prometheus_client`] is re-exported so components
//! use the same version as the registry.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use parking_lot::RwLock;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::{Metric, Registry};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use login_refusals::{
    LoginThrottle, RefusalLog, FREE_LOGIN_FAILURES, REFUSAL_LOG_INTERVAL, THROTTLED_LOGIN_INTERVAL,
};
pub use memory_ceiling::{MemoryCeiling, OverCeiling};
pub use prometheus_client;
pub use refusals::{LimitRefusals, LIMIT_REFUSALS};
pub use server::Server;

pub mod formats;
mod login_refusals;
mod memory_ceiling;
mod refusals;
mod server;

/// The `Content-Type` of `/metrics`: the Prometheus text format 0.0.4.
pub const METRICS_CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// A client has this long to send its request headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// On shutdown, requests in progress get this long to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// The process's metrics registry. Cheap to clone; all clones share it.
///
/// Names are registered in full (`spillway_…`), with no prefix added.
/// Counters get their `_total` suffix from the encoder: register
/// `spillway_messages_published` and scrape `spillway_messages_published_total`.
/// The encoder also ends every help text with a full stop, so help texts are
/// given without one.
#[derive(Clone, Default)]
pub struct Metrics {
    registry: Arc<RwLock<Registry>>,
    /// RabbitMQ's per-queue families as its Prometheus plugin serves them
    /// on `/metrics`: one sample per node, summed over the queues.
    aggregated: Arc<RwLock<Registry>>,
    /// The same families with a sample per queue, on `/metrics/per-object`.
    per_object: Arc<RwLock<Registry>>,
    /// The components' refusal counts, summed into one family.
    refusals: refusals::RefusalCollector,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a metric the component keeps up to date itself (a counter or
    /// gauge it holds a clone of).
    pub fn register(&self, name: &str, help: &str, metric: impl Metric) {
        self.registry.write().register(name, help, metric);
    }

    /// Registers a collector, asked for its metrics on every scrape: for
    /// figures read from a component's state at scrape time, so that what no
    /// longer exists (a deleted queue) no longer appears.
    pub fn register_collector(&self, collector: impl Collector) {
        self.registry
            .write()
            .register_collector(Box::new(collector));
    }

    /// Adds a component's refusal counts to `spillway_limit_refusals_total`
    /// (the family is registered with the first).
    pub fn register_limit_refusals(&self, source: LimitRefusals) {
        let first = {
            let mut sources = self.refusals.sources.lock();
            sources.push(source);
            sources.len() == 1
        };
        if first {
            self.register_collector(self.refusals.clone());
        }
    }

    /// Registers a family that RabbitMQ's Prometheus plugin serves summed
    /// on `/metrics` (`aggregated`) and per object on `/metrics/per-object`
    /// (`per_object`): the two collectors must name the same families.
    pub fn register_views(&self, aggregated: impl Collector, per_object: impl Collector) {
        self.aggregated
            .write()
            .register_collector(Box::new(aggregated));
        self.per_object
            .write()
            .register_collector(Box::new(per_object));
    }

    /// What `/metrics` serves, in the Prometheus text format 0.0.4:
    /// everything registered, RabbitMQ's per-object families summed.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        self.encode_view(&self.aggregated)
    }

    /// What `/metrics/per-object` serves: everything registered, RabbitMQ's
    /// per-object families with a sample per object.
    pub fn encode_per_object(&self) -> Result<String, std::fmt::Error> {
        self.encode_view(&self.per_object)
    }

    /// What `/metrics/detailed?family=F&vhost=V` serves, as RabbitMQ's
    /// plugin: only the asked families of the per-object view (none when
    /// none is asked), named `rabbitmq_detailed_*`, only the asked vhosts'
    /// samples when some are asked.
    pub fn encode_detailed(
        &self,
        families: &[String],
        vhosts: &[String],
    ) -> Result<String, std::fmt::Error> {
        let mut per_object = String::new();
        prometheus_text::encode(&mut per_object, &self.per_object.read())?;
        Ok(detailed(&per_object, families, vhosts))
    }

    fn encode_view(&self, view: &RwLock<Registry>) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_text::encode(&mut text, &self.registry.read())?;
        prometheus_text::encode(&mut text, &view.read())?;
        Ok(text)
    }
}

/// RabbitMQ's `/metrics/detailed` families, each with the per-object
/// families Spillway has of it.
const DETAILED_FAMILIES: [(&str, &[&str]); 3] = [
    (
        "queue_coarse_metrics",
        &[
            "rabbitmq_queue_messages_ready",
            "rabbitmq_queue_messages_unacked",
            "rabbitmq_queue_messages",
        ],
    ),
    ("queue_consumer_count", &["rabbitmq_queue_consumers"]),
    ("queue_metrics", &["rabbitmq_queue_messages_ready_bytes"]),
];

/// The lines of the per-object text that `/metrics/detailed` serves for
/// these families and vhosts, renamed as RabbitMQ names them there.
fn detailed(per_object: &str, families: &[String], vhosts: &[String]) -> String {
    let wanted: Vec<&str> = DETAILED_FAMILIES
        .iter()
        .filter(|(family, _)| families.iter().any(|f| f == family))
        .flat_map(|(_, names)| names.iter().copied())
        .collect();
    // A sample's labels start with its vhost (`{vhost="..."`), escaped as
    // the text format escapes label values.
    let vhost_labels: Vec<String> = vhosts
        .iter()
        .map(|vhost| {
            let escaped = vhost
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            format!("{{vhost=\"{escaped}\"")
        })
        .collect();
    let mut text = String::new();
    for line in per_object.lines() {
        let (name, sample) = match line
            .strip_prefix("# HELP ")
            .or_else(|| line.strip_prefix("# TYPE "))
        {
            Some(rest) => (rest.split(' ').next().unwrap_or_default(), false),
            None if line.starts_with('#') => continue,
            None => (line.split(['{', ' ']).next().unwrap_or_default(), true),
        };
        if !wanted.contains(&name) {
            continue;
        }
        if sample
            && !vhost_labels.is_empty()
            && !vhost_labels
                .iter()
                .any(|label| line.contains(label.as_str()))
        {
            continue;
        }
        text.push_str(&line.replacen("rabbitmq_", "rabbitmq_detailed_", 1));
        text.push('\n');
    }
    text
}

/// The values of `key` in a query string, percent-decoded.
fn query_values(query: Option<&str>, key: &str) -> Vec<String> {
    query
        .unwrap_or_default()
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(k, _)| *k == key)
        .map(|(_, value)| {
            percent_encoding::percent_decode_str(&value.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        })
        .collect()
}

/// Whether the process is ready: `/healthz` answers 200 `ok` while it is,
/// 200 `standby` while it is a standby engine waiting for the store's lease
/// (healthy, but not the one serving), and 503 otherwise. Cheap to clone;
/// all clones share the flags. Starts not ready.
#[derive(Clone, Debug, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
    standby: Arc<AtomicBool>,
}

impl Health {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// A standby engine: up and waiting for the lease.
    pub fn set_standby(&self, standby: bool) {
        self.standby.store(standby, Ordering::Release);
    }

    pub fn is_standby(&self) -> bool {
        self.standby.load(Ordering::Acquire)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("binding the metrics HTTP port {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// The running HTTP endpoint. Dropping it stops it too, without waiting.
pub struct HttpServer {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    accept_loop: JoinHandle<()>,
}

impl HttpServer {
    /// The bound address (the real port when started on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets requests in progress finish (briefly), and
    /// returns once the server is gone.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.accept_loop.await;
    }
}

/// Binds `addr` and serves `/metrics` from `metrics` and `/healthz` from
/// `health` until [`HttpServer::shutdown`].
pub async fn start_http(
    addr: SocketAddr,
    metrics: Metrics,
    health: Health,
) -> Result<HttpServer, TelemetryError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| TelemetryError::Bind { addr, source })?;
    let addr = listener
        .local_addr()
        .map_err(|source| TelemetryError::Bind { addr, source })?;
    let (stop, stopped) = watch::channel(false);
    tracing::info!(%addr, "metrics and health HTTP listening");
    let accept_loop = tokio::spawn(accept_loop(listener, metrics, health, stopped));
    Ok(HttpServer {
        addr,
        stop,
        accept_loop,
    })
}

async fn accept_loop(
    listener: TcpListener,
    metrics: Metrics,
    health: Health,
    mut stopped: watch::Receiver<bool>,
) {
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    loop {
        let (stream, peer) = tokio::select! {
            // A dropped sender (the server was dropped) stops it too.
            _ = stopped.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "metrics HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let metrics = metrics.clone();
        let health = health.clone();
        let service = service_fn(move |request| {
            let response = respond(&request, &metrics, &health);
            async move { Ok::<_, Infallible>(response) }
        });
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%peer, %error, "metrics HTTP connection failed");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::debug!("metrics HTTP connections still open after the grace period");
    }
}

fn respond(
    request: &Request<Incoming>,
    metrics: &Metrics,
    health: &Health,
) -> Response<Full<Bytes>> {
    let path = request.uri().path();
    if !matches!(
        path,
        "/metrics" | "/metrics/per-object" | "/metrics/detailed" | "/healthz"
    ) {
        return plain(StatusCode::NOT_FOUND, "not found\n");
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut response = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    if path == "/healthz" {
        return if health.is_ready() {
            plain(StatusCode::OK, "ok\n")
        } else if health.is_standby() {
            plain(StatusCode::OK, "standby\n")
        } else {
            plain(StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
        };
    }
    let encoded = match path {
        "/metrics/per-object" => metrics.encode_per_object(),
        "/metrics/detailed" => {
            let query = request.uri().query();
            metrics.encode_detailed(
                &query_values(query, "family"),
                &query_values(query, "vhost"),
            )
        }
        _ => metrics.encode(),
    };
    match encoded {
        Ok(text) => {
            let mut response = Response::new(Full::new(Bytes::from(text)));
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static(METRICS_CONTENT_TYPE));
            response
        }
        Err(error) => {
            tracing::warn!(%error, "encoding metrics failed");
            plain(
                StatusCode::INTERNAL_SERVER_ERROR,
                "encoding metrics failed\n",
            )
        }
    }
}

fn plain(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: SocketAddr, method: &str, path: &str) -> (u16, String, String) {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request =
            format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, head.to_string(), body.to_string())
    }

    #[test]
    fn detailed_serves_the_asked_families_and_vhosts_renamed() {
        let per_object = "\
# HELP rabbitmq_queue_messages_ready Messages ready to be delivered to consumers.
# TYPE rabbitmq_queue_messages_ready gauge
rabbitmq_queue_messages_ready{vhost=\"/\",queue=\"a\"} 3
rabbitmq_queue_messages_ready{vhost=\"shop\",queue=\"rabbitmq_b\"} 4
# HELP rabbitmq_queue_consumers Consumers on a queue.
# TYPE rabbitmq_queue_consumers gauge
rabbitmq_queue_consumers{vhost=\"/\",queue=\"a\"} 1
# EOF
";
        let families = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(detailed(per_object, &[], &[]), "");
        let coarse = detailed(per_object, &families(&["queue_coarse_metrics"]), &[]);
        assert_eq!(
            coarse,
            "# HELP rabbitmq_detailed_queue_messages_ready Messages ready to be delivered to consumers.\n\
             # TYPE rabbitmq_detailed_queue_messages_ready gauge\n\
             rabbitmq_detailed_queue_messages_ready{vhost=\"/\",queue=\"a\"} 3\n\
             rabbitmq_detailed_queue_messages_ready{vhost=\"shop\",queue=\"rabbitmq_b\"} 4\n"
        );
        let shop = detailed(
            per_object,
            &families(&["queue_coarse_metrics", "queue_consumer_count"]),
            &families(&["shop"]),
        );
        assert!(shop.contains("queue=\"rabbitmq_b\"} 4"), "{shop}");
        assert!(!shop.contains("vhost=\"/\""), "{shop}");
        assert!(
            shop.contains("# TYPE rabbitmq_detailed_queue_consumers gauge"),
            "{shop}"
        );
        assert_eq!(
            query_values(Some("family=queue_coarse_metrics&vhost=%2F&x=1"), "vhost"),
            ["/"]
        );
    }

    #[tokio::test]
    async fn serves_metrics_health_and_404() {
        let metrics = Metrics::new();
        let counter: Counter = Counter::default();
        let gauge: Gauge = Gauge::default();
        metrics.register("spillway_things", "Things seen", counter.clone());
        metrics.register("spillway_open_things", "Things open", gauge.clone());
        counter.inc_by(3);
        gauge.set(2);
        let health = Health::new();
        let server = start_http(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            metrics,
            health.clone(),
        )
        .await
        .unwrap();
        let addr = server.local_addr();
        assert_ne!(addr.port(), 0);

        let (status, head, body) = get(addr, "GET", "/metrics").await;
        assert_eq!(status, 200);
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: text/plain; version=0.0.4"),
            "{head}"
        );
        assert!(
            body.contains("# HELP spillway_things_total Things seen.\n"),
            "{body}"
        );
        assert!(
            body.contains("# TYPE spillway_things_total counter\n"),
            "{body}"
        );
        assert!(body.contains("\nspillway_things_total 3\n"), "{body}");
        assert!(body.contains("\nspillway_open_things 2\n"), "{body}");

        assert_eq!(get(addr, "GET", "/healthz").await.0, 503);
        health.set_standby(true);
        let (status, _, body) = get(addr, "GET", "/healthz").await;
        assert_eq!((status, body.as_str()), (200, "standby\n"));
        health.set_standby(false);
        health.set_ready(true);
        let (status, _, body) = get(addr, "GET", "/healthz").await;
        assert_eq!((status, body.as_str()), (200, "ok\n"));
        assert_eq!(get(addr, "GET", "/healthz?verbose=1").await.0, 200);
        assert_eq!(get(addr, "GET", "/").await.0, 404);
        assert_eq!(get(addr, "GET", "/metrics/x").await.0, 404);
        assert_eq!(get(addr, "POST", "/metrics").await.0, 405);

        server.shutdown().await;
        assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    }
}
