//! The listener: binds the AMQP and AMQPS ports, accepts connections
//! (counted against `gateway.max_connections` from accept), runs the TLS
//! handshake, reads the protocol header and hands each client to the
//! protocol it names, [`crate::amqp091`] or [`crate::amqp1`], peers that
//! share only the listener's base ([`crate::listener`]). [`AmqpServer`] is
//! the gateway's `Server`.
//!
//! One gateway may listen twice: plain AMQP and AMQPS (TLS, see
//! [`crate::tls`]). Both listeners share one connection count.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use spillway_proto::engine::EngineApi;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::task::TaskTracker;

use crate::body_loans::{BodyLoans, MAX_LENT_READ_BYTES};
use crate::limits::{ConnectionSlots, REFUSALS_AT_ONCE};
use crate::listener::{refusal_at_open, Admission, ClientStream, ConnectionContext, CLOSE_TIMEOUT};
use crate::metrics::GatewayMetrics;
use crate::GatewayConfig;
use spillway_telemetry::{LoginThrottle, MemoryCeiling, RefusalLog, Server};

/// TCP keepalive on client sockets: a peer that vanished without a FIN (a
/// cable pulled, a host gone) is found after about 60 s of silence plus six
/// unanswered probes 10 s apart, even with heartbeats off or suspended.
fn keepalive() -> socket2::TcpKeepalive {
    socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(60))
        .with_interval(Duration::from_secs(10))
        .with_retries(6)
}

/// Where a gateway listens: plain AMQP, AMQPS, or both.
#[derive(Clone, Default)]
pub struct Listeners {
    pub amqp: Option<SocketAddr>,
    /// The AMQPS address and its TLS configuration ([`crate::tls::server_config`]).
    pub amqps: Option<(SocketAddr, Arc<rustls::ServerConfig>)>,
}

/// The label of the AMQPS listener in `spillway_tls_handshake_failures_total`.
pub const AMQPS_LISTENER: &str = "amqps";

struct Bound {
    addr: SocketAddr,
    transport: &'static str,
}

pub struct AmqpServer {
    amqp: Option<SocketAddr>,
    amqps: Option<SocketAddr>,
    bound: Vec<Bound>,
    stop: watch::Sender<bool>,
    accept_loops: Vec<JoinHandle<()>>,
    connections: TaskTracker,
}

impl AmqpServer {
    /// Binds `addr` and starts accepting AMQP clients, counting into
    /// `metrics`.
    pub async fn start(
        addr: SocketAddr,
        engine: Arc<dyn EngineApi>,
        config: GatewayConfig,
        metrics: GatewayMetrics,
    ) -> std::io::Result<Self> {
        let listeners = Listeners {
            amqp: Some(addr),
            amqps: None,
        };
        Self::start_listeners(
            listeners,
            engine,
            config,
            metrics,
            MemoryCeiling::unlimited(),
        )
        .await
    }

    /// Binds each of `listeners` and starts accepting AMQP clients on them,
    /// counting into `metrics`. `gateway.max_connections` counts the
    /// connections of both. What the gateway holds for clients (partly
    /// received bodies, read buffers, lent ones) is counted against
    /// `memory`; above it new connections are refused and publishers are
    /// not read.
    pub async fn start_listeners(
        listeners: Listeners,
        engine: Arc<dyn EngineApi>,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        memory: Arc<MemoryCeiling>,
    ) -> std::io::Result<Self> {
        // Bind both before accepting on either: a port in use fails start-up.
        let plain = match listeners.amqp {
            Some(addr) => Some(TcpListener::bind(addr).await?),
            None => None,
        };
        let tls = match listeners.amqps {
            Some((addr, tls)) => Some((TcpListener::bind(addr).await?, TlsAcceptor::from(tls))),
            None => None,
        };
        let (stop, stopped) = watch::channel(false);
        let config = Arc::new(config);
        let connections = TaskTracker::new();
        let context = ConnectionContext {
            engine,
            slots: ConnectionSlots::new(config.settings.max_connections),
            refusing: ConnectionSlots::new(REFUSALS_AT_ONCE),
            config,
            body_loans: BodyLoans::new(MAX_LENT_READ_BYTES, metrics.lent_read_bytes()),
            metrics,
            login_refusals: Arc::new(RefusalLog::default()),
            login_throttle: Arc::new(LoginThrottle::default()),
            unfinished: Arc::default(),
            read_buffers: Arc::default(),
            memory,
        };
        context.count_against_memory();
        let mut server = Self {
            amqp: None,
            amqps: None,
            bound: Vec::new(),
            stop,
            accept_loops: Vec::new(),
            connections,
        };
        if let Some(listener) = plain {
            let addr = listener.local_addr()?;
            server.amqp = Some(addr);
            server.bound.push(Bound {
                addr,
                transport: "TCP",
            });
            tracing::info!(code = "BRK-1002", %addr, "BRK-1002 : Starting : Listening on TCP port {}", addr.port());
            server.accept_loops.push(tokio::spawn(accept_loop(
                listener,
                None,
                context.clone(),
                stopped.clone(),
                server.connections.clone(),
            )));
        }
        if let Some((listener, acceptor)) = tls {
            let addr = listener.local_addr()?;
            server.amqps = Some(addr);
            server.bound.push(Bound {
                addr,
                transport: "TCP/SSL",
            });
            context.metrics.declare_tls_listener(AMQPS_LISTENER);
            tracing::info!(code = "BRK-1002", %addr, "BRK-1002 : Starting : Listening on TCP/SSL port {}", addr.port());
            server.accept_loops.push(tokio::spawn(accept_loop(
                listener,
                Some(acceptor),
                context,
                stopped,
                server.connections.clone(),
            )));
        }
        Ok(server)
    }
}

impl AmqpServer {
    /// The plain AMQP address (the real port when configured with 0), when
    /// it listens for plain AMQP.
    pub fn bind_addr(&self) -> Option<SocketAddr> {
        self.amqp
    }

    /// The AMQPS address, when it listens for AMQP over TLS.
    pub fn tls_bind_addr(&self) -> Option<SocketAddr> {
        self.amqps
    }
}

#[async_trait]
impl Server for AmqpServer {
    fn name(&self) -> &'static str {
        "amqp"
    }

    fn bind_addrs(&self) -> Vec<(&'static str, SocketAddr)> {
        let amqp = self.amqp.map(|addr| ("amqp", addr));
        let amqps = self.amqps.map(|addr| ("amqps", addr));
        amqp.into_iter().chain(amqps).collect()
    }

    async fn shutdown(self: Box<Self>) {
        let _ = self.stop.send(true);
        for accept_loop in self.accept_loops {
            let _ = accept_loop.await;
        }
        // Open connections were told to close (320); wait for them to go.
        self.connections.close();
        let _ = tokio::time::timeout(CLOSE_TIMEOUT * 2, self.connections.wait()).await;
        for bound in &self.bound {
            tracing::info!(code = "BRK-1003", addr = %bound.addr, "BRK-1003 : Shutting down : {} port {}", bound.transport, bound.addr.port());
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    context: ConnectionContext,
    mut stopped: watch::Receiver<bool>,
    connections: TaskTracker,
) {
    loop {
        tokio::select! {
            _ = stopped.changed() => return,
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // Counted from here, logged in or not (`limits.rs`).
                let admission = match context.slots.take() {
                    Some(slot) => Admission::Admitted { _slot: slot },
                    None => match context.refusing.take() {
                        Some(refusal) => Admission::Refused { _refusal: refusal },
                        None => {
                            tracing::warn!(%peer, limit = context.slots.max(), "connection refused: node connection limit reached, closed unanswered");
                            context.metrics.count_refusal(crate::metrics::MAX_CONNECTIONS);
                            drop(stream);
                            continue;
                        }
                    },
                };
                let _ = stream.set_nodelay(true);
                if let Err(error) = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive()) {
                    tracing::debug!(%peer, %error, "could not turn on tcp keepalive");
                }
                let context = context.clone();
                let stopped = stopped.clone();
                let accepted_at = Instant::now();
                let tls = tls.clone();
                connections.spawn(async move {
                    tracing::debug!(%peer, "connection accepted");
                    let served = match tls {
                        None => serve_client(stream, peer, accepted_at, admission, context, stopped).await,
                        Some(tls) => serve_tls(tls, stream, peer, accepted_at, admission, context, stopped).await,
                    };
                    if let Err(error) = served {
                        tracing::debug!(%peer, %error, "connection ended with an i/o error");
                    }
                });
            }
        }
    }
}

/// The TLS handshake, within the same `gateway.handshake_timeout` as the
/// AMQP handshake after it, then the connection. A client that does not
/// speak TLS (a plain AMQP client on the AMQPS port) fails at its first
/// bytes: logged once and counted, never answered in AMQP.
async fn serve_tls(
    tls: TlsAcceptor,
    stream: TcpStream,
    peer: SocketAddr,
    accepted_at: Instant,
    admission: Admission,
    context: ConnectionContext,
    mut stopped: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let deadline = accepted_at + context.config.settings.handshake_timeout;
    let handshake = tokio::select! {
        _ = stopped.changed() => return Ok(()),
        handshake = tokio::time::timeout_at(deadline, tls.accept(stream)) => handshake,
    };
    let reason = match handshake {
        Ok(Ok(stream)) => {
            return serve_client(stream, peer, accepted_at, admission, context, stopped).await
        }
        Ok(Err(error)) => error.to_string(),
        Err(_) => "not finished before gateway.handshake_timeout".to_string(),
    };
    tracing::info!(%peer, listener = AMQPS_LISTENER, %reason, "TLS handshake failed, closing");
    context.metrics.count_tls_handshake_failure(AMQPS_LISTENER);
    Ok(())
}

/// Reads a client's protocol header (one deadline from accept, whichever
/// protocol it speaks) and hands the client to the protocol it names:
/// AMQP 1.0 ([`crate::amqp1`]) or 0-9-1 ([`crate::amqp091`], which also
/// answers a header it does not know).
async fn serve_client<S: ClientStream>(
    stream: S,
    peer: SocketAddr,
    accepted_at: Instant,
    admission: Admission,
    context: ConnectionContext,
    stopped: watch::Receiver<bool>,
) -> std::io::Result<()> {
    // One deadline from accept to open, whichever protocol the client
    // speaks (RabbitMQ's handshake_timeout).
    let deadline = accepted_at + context.config.settings.handshake_timeout;
    let mut stream = stream;
    let mut header = [0u8; 8];
    match tokio::time::timeout_at(deadline, stream.read_exact(&mut header)).await {
        Err(_) => {
            tracing::debug!(%peer, "no protocol header before the handshake timeout");
            return Ok(());
        }
        Ok(read) => {
            read?;
        }
    }
    if crate::amqp1::is_amqp1_header(&header) {
        let refusal = refusal_at_open(&admission, &context, peer).map(|error| error.text);
        return crate::amqp1::serve(stream, header, peer, deadline, refusal, context, stopped)
            .await;
    }
    crate::amqp091::serve(stream, header, peer, deadline, admission, context, stopped).await
}
