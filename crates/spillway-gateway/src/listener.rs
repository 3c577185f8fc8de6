//! What every client connection shares, whichever protocol it speaks: its
//! socket ([`ClientStream`], plain or TLS, split in two halves), the
//! gateway's [`ConnectionContext`] (the engine, the configuration, the
//! metrics, the connection slots, the login throttle, the byte counts held
//! against the memory ceiling), its admission ([`Admission`],
//! [`refusal_at_open`]) and the log of refused logins. The protocols
//! (`amqp091/`, `amqp1/`) build on it; it imports neither.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use spillway_amqp::{reply_code, MethodId};
use spillway_proto::engine::AmqpError;
use spillway_proto::engine::EngineApi;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::auth::AuthError;
use crate::body_loans::BodyLoans;
use crate::limits::{ConnectionSlots, Slot};
use crate::metrics::GatewayMetrics;
use crate::GatewayConfig;
use spillway_telemetry::{LoginThrottle, MemoryCeiling, RefusalLog};

/// How long we wait for the client's answer (close-ok, or a 1.0 `close`)
/// after closing its connection; then the socket is cut.
pub(crate) const CLOSE_TIMEOUT: Duration = Duration::from_secs(3);

/// A client's socket, plain or TLS: what the I/O loop reads and writes.
/// Split in two halves, one for the loop and one for the writer task.
pub trait ClientStream: AsyncRead + AsyncWrite + Unpin + Send + std::fmt::Debug + 'static {
    type Reader: AsyncRead + Unpin + Send + 'static;
    type Writer: AsyncWrite + Unpin + Send + 'static;
    fn into_halves(self) -> (Self::Reader, Self::Writer);
    /// The CN of the client's verified TLS certificate (SASL EXTERNAL).
    fn certificate_user(&self) -> Option<String> {
        None
    }
}

impl ClientStream for TcpStream {
    type Reader = OwnedReadHalf;
    type Writer = OwnedWriteHalf;
    fn into_halves(self) -> (OwnedReadHalf, OwnedWriteHalf) {
        self.into_split()
    }
}

pub(crate) type TlsStream = tokio_rustls::server::TlsStream<TcpStream>;

impl ClientStream for TlsStream {
    type Reader = tokio::io::ReadHalf<TlsStream>;
    type Writer = tokio::io::WriteHalf<TlsStream>;
    fn into_halves(self) -> (Self::Reader, Self::Writer) {
        tokio::io::split(self)
    }
    fn certificate_user(&self) -> Option<String> {
        let (_, session) = self.get_ref();
        crate::tls::common_name(session.peer_certificates()?.first()?)
    }
}

/// What every connection of one gateway shares.
#[derive(Clone)]
pub(crate) struct ConnectionContext {
    pub(crate) engine: Arc<dyn EngineApi>,
    pub(crate) config: Arc<GatewayConfig>,
    pub(crate) metrics: GatewayMetrics,
    pub(crate) slots: ConnectionSlots,
    /// Rate-limits the log lines of refused logins.
    pub(crate) login_refusals: Arc<RefusalLog>,
    /// Slows login attempts from an address that keeps failing.
    pub(crate) login_throttle: Arc<LoginThrottle>,
    /// Read-buffer bytes lent as message bodies, over every connection.
    pub(crate) body_loans: Arc<BodyLoans>,
    /// Sockets past `max_connections` being refused in AMQP right now.
    pub(crate) refusing: ConnectionSlots,
    /// Partly received bodies, over every connection.
    pub(crate) unfinished: Arc<AtomicU64>,
    /// Socket read buffers, over every connection.
    pub(crate) read_buffers: Arc<AtomicU64>,
    /// The process's memory ceiling.
    pub(crate) memory: Arc<MemoryCeiling>,
}

impl ConnectionContext {
    pub(crate) fn count_against_memory(&self) {
        let unfinished = self.unfinished.clone();
        self.memory.count("unfinished_content", move || {
            unfinished.load(Ordering::Relaxed)
        });
        let read_buffers = self.read_buffers.clone();
        self.memory
            .count("read_buffers", move || read_buffers.load(Ordering::Relaxed));
        let loans = Arc::downgrade(&self.body_loans);
        self.memory.count("lent_read_buffers", move || {
            loans.upgrade().map_or(0, |loans| loans.lent_bytes() as u64)
        });
    }
}

/// Whether an accepted socket got one of the `max_connections` slots, or is
/// served only to be refused at `connection.open`. Held until the
/// connection's task ends.
pub(crate) enum Admission {
    Admitted { _slot: Slot },
    Refused { _refusal: Slot },
}

/// One connection's share of a gateway-wide byte count: set to what it
/// holds now, taken out when dropped.
pub(crate) struct CountedBytes {
    total: Arc<AtomicU64>,
    bytes: u64,
}

impl CountedBytes {
    pub(crate) fn new(total: Arc<AtomicU64>) -> Self {
        Self { total, bytes: 0 }
    }

    pub(crate) fn set(&mut self, bytes: u64) {
        if bytes >= self.bytes {
            self.total.fetch_add(bytes - self.bytes, Ordering::Relaxed);
        } else {
            self.total.fetch_sub(self.bytes - bytes, Ordering::Relaxed);
        }
        self.bytes = bytes;
    }
}

impl Drop for CountedBytes {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Counts a refused login, and logs it with the peer, the user and the
/// reason (never the password) unless the pair was logged less than
/// [`spillway_telemetry::REFUSAL_LOG_INTERVAL`] ago.
pub(crate) fn log_login_refusal(
    context: &ConnectionContext,
    peer: SocketAddr,
    refusal: &AuthError,
) {
    context.metrics.count_login_refusal(refusal.reason());
    let user = refusal.user().unwrap_or("");
    let now = context.config.clock.now();
    let Some(suppressed) = context.login_refusals.admit(peer.ip(), user, now) else {
        return;
    };
    tracing::warn!(
        code = "CON-1101",
        %peer,
        user,
        reason = refusal.reason(),
        suppressed,
        "CON-1101 : Login refused : {refusal} : from {peer} ({suppressed} more refusals of this user and address not logged in the last minute)"
    );
}

/// Why a client that logged in is refused at `connection.open`: a socket
/// past `gateway.max_connections`, or the memory ceiling passed.
pub(crate) fn refusal_at_open(
    admission: &Admission,
    context: &ConnectionContext,
    peer: SocketAddr,
) -> Option<AmqpError> {
    let metrics = &context.metrics;
    let refusal = match admission {
        Admission::Refused { .. } => {
            let max = context.slots.max();
            tracing::warn!(%peer, limit = max, "connection refused: node connection limit reached");
            metrics.count_refusal(crate::metrics::MAX_CONNECTIONS);
            AmqpError::new(
                reply_code::NOT_ALLOWED,
                format!("connection refused: node connection limit ({max}) is reached"),
            )
        }
        Admission::Admitted { .. } => {
            let over = context.memory.over()?;
            tracing::warn!(%peer, held_bytes = over.held, high_watermark_bytes = over.high_watermark, "connection refused: memory high watermark reached");
            metrics.count_refusal(crate::metrics::MEMORY_HIGH_WATERMARK);
            AmqpError::new(
                reply_code::RESOURCE_ERROR,
                format!("connection refused: {over}"),
            )
        }
    };
    Some(refusal.on(MethodId::CONNECTION_OPEN))
}
