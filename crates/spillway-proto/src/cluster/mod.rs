//! What every internal gRPC call between Spillway's own components carries:
//! the caller's role ([`ClusterRole`]) and its secret (`cluster.secret`), as
//! request metadata, the cluster's mutual TLS (`cluster.tls`), and the
//! message-size limit both ends enforce.
//!
//! The server side (the guard that checks who calls what) lives with the
//! wiring (`spillway-serve`); this module holds what clients and servers
//! share: [`ClusterRole`], [`ClusterSecret`], the metadata keys, the client
//! interceptor [`ClusterCredentials`], [`ClusterTls`] and
//! [`grpc_message_limit`], and the clients' channels ([`lazy_channel`],
//! [`lazy_member_channel`], in `channel.rs`).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity, ServerTlsConfig};
use tonic::{Request, Status};

mod channel;

pub use channel::{lazy_channel, lazy_member_channel};
pub(crate) use channel::{lazy_channel_within, ChannelTimeouts};

/// The request metadata key that carries the cluster secret.
pub const SECRET_METADATA_KEY: &str = "spillway-cluster-secret";

/// The request metadata key that carries the caller's role.
pub const ROLE_METADATA_KEY: &str = "spillway-cluster-role";

/// The prefix of the URI a cluster certificate names its role with (a
/// subject alternative name `spillway://role/gateway`).
pub const ROLE_URI_PREFIX: &str = "spillway://role/";

/// Which component calls: each role may make only the internal calls its
/// component makes (`docs/security.md`), proven by a secret of its own or
/// by the role its cluster certificate names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ClusterRole {
    Gateway,
    Engine,
    Storage,
    Management,
}

impl ClusterRole {
    pub const ALL: [ClusterRole; 4] = [
        ClusterRole::Gateway,
        ClusterRole::Engine,
        ClusterRole::Storage,
        ClusterRole::Management,
    ];

    /// The role's name: in metadata, settings and certificates.
    pub fn as_str(self) -> &'static str {
        match self {
            ClusterRole::Gateway => "gateway",
            ClusterRole::Engine => "engine",
            ClusterRole::Storage => "storage",
            ClusterRole::Management => "management",
        }
    }

    /// The role named `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|role| role.as_str() == name)
    }

    /// The URI a cluster certificate names this role with.
    pub fn uri(self) -> String {
        format!("{ROLE_URI_PREFIX}{}", self.as_str())
    }
}

impl fmt::Display for ClusterRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The shortest secret accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 16;

/// The largest HTTP/2 frame the internal gRPC servers and clients accept.
/// HTTP/2's default, 16 KiB, cut every stream message larger than that
/// (a batch of commands or events, a storage write) into frames of 16 KiB,
/// each a turn of the peer's frame loop; flow control (the windows, not
/// this) bounds what a peer may have in flight.
pub const HTTP2_MAX_FRAME_BYTES: u32 = 1 << 20;

/// Batches that carry several messages (a session's events, a storage write
/// batch, a read-ahead, a peek) stop growing at this many encoded bytes; one
/// item larger than this still goes, alone.
pub const BATCH_BYTES: usize = 16 << 20;

/// Beyond the largest body and the batch size: message names, routing keys,
/// queue entries of a message routed to many durable queues, and protobuf
/// framing.
const FRAMING_OVERHEAD: u64 = 4 << 20;

/// The largest gRPC message an internal client or server sends or accepts:
/// the larger of `max_message_size` (the largest AMQP body) and
/// [`BATCH_BYTES`], plus `frame_max` (AMQP properties travel in one frame, so
/// they are never longer) plus 4 MiB of framing. With the defaults (128 MiB
/// bodies, 128 KiB frames) that is 132 MiB + 128 KiB. gRPC frames a message
/// with a 32-bit length, so the result never exceeds `u32::MAX`.
pub fn grpc_message_limit(max_message_size: u64, frame_max: u32) -> usize {
    let limit = max_message_size
        .max(BATCH_BYTES as u64)
        .saturating_add(u64::from(frame_max))
        .saturating_add(FRAMING_OVERHEAD)
        .min(u64::from(u32::MAX));
    usize::try_from(limit).unwrap_or(usize::MAX)
}

/// Why a secret was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    #[error("it is empty")]
    Empty,
    #[error("it is {0} bytes long; at least {MIN_SECRET_LEN} are needed")]
    TooShort(usize),
    #[error("it may hold only visible ASCII characters (no spaces or control characters)")]
    NotPrintable,
}

/// The cluster secret. Never printed: `Debug` shows `ClusterSecret(..)`, and
/// there is no `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Arc<str>);

impl ClusterSecret {
    /// Checks `text` (surrounding whitespace, such as a file's final newline,
    /// removed): at least [`MIN_SECRET_LEN`] visible ASCII characters, since
    /// it travels as an HTTP/2 header value.
    pub fn new(text: &str) -> Result<Self, SecretError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(SecretError::Empty);
        }
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(SecretError::NotPrintable);
        }
        if text.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort(text.len()));
        }
        Ok(Self(text.into()))
    }

    /// The secret's bytes, for a comparison in constant time.
    pub fn expose(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

/// As text, unchecked: the settings check it and say where it was set. An
/// environment variable that looks like a number arrives as one.
impl<'de> Deserialize<'de> for ClusterSecret {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Unsigned(u64),
            Signed(i64),
        }
        let text = match Raw::deserialize(deserializer)? {
            Raw::Text(text) => text,
            Raw::Unsigned(number) => number.to_string(),
            Raw::Signed(number) => number.to_string(),
        };
        Ok(Self(text.trim().into()))
    }
}

/// How long an internal server waits for a TLS handshake to complete.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The cluster's mutual TLS (`cluster.tls`): the CA every component's
/// certificate is signed by, and this process's own certificate and key, as
/// PEM. An internal server serves TLS only and requires a client certificate
/// signed by the CA; an internal client presents its certificate and checks
/// the server's against the CA, for the host name of the address it dials.
///
/// The files are read and checked by the settings; `Debug` shows no key.
#[derive(Clone)]
pub struct ClusterTls {
    ca_pem: Arc<[u8]>,
    cert_pem: Arc<[u8]>,
    key_pem: Arc<[u8]>,
}

impl ClusterTls {
    pub fn new(ca_pem: Vec<u8>, cert_pem: Vec<u8>, key_pem: Vec<u8>) -> Self {
        Self {
            ca_pem: ca_pem.into(),
            cert_pem: cert_pem.into(),
            key_pem: key_pem.into(),
        }
    }

    fn identity(&self) -> Identity {
        Identity::from_pem(&*self.cert_pem, &*self.key_pem)
    }

    /// An internal client's TLS: trust the cluster CA only (no system
    /// roots), present this process's certificate.
    pub fn client_config(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&*self.ca_pem))
            .identity(self.identity())
    }

    /// An internal server's TLS: this process's certificate, and a client
    /// certificate signed by the cluster CA required of every caller.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(Certificate::from_pem(&*self.ca_pem))
            .client_auth_optional(false)
            .timeout(TLS_HANDSHAKE_TIMEOUT)
    }
}

impl fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterTls(..)")
    }
}

/// The URI an internal client dials for the configured `addr`: with cluster
/// TLS, `http://` becomes `https://` (tonic speaks TLS to `https` URIs only),
/// so the same addresses serve both set-ups; without it, an `https://`
/// address is refused, since nothing would be there to speak TLS with.
pub fn cluster_uri(addr: &str, tls: bool) -> Result<String, String> {
    match (
        addr.strip_prefix("http://"),
        addr.starts_with("https://"),
        tls,
    ) {
        (Some(rest), _, true) => Ok(format!("https://{rest}")),
        (_, true, false) => Err(format!(
            "{addr} is https:// but cluster.tls is not set: set cluster.tls.cert_file, \
             key_file and ca_file, or use http://"
        )),
        _ => Ok(addr.to_string()),
    }
}

/// What an internal gRPC client needs to be let in and to size its messages.
#[derive(Clone, Debug)]
pub struct ClusterClient {
    /// The role this process calls as, sent with every call.
    pub role: Option<ClusterRole>,
    /// Sent with every call: the secret of this process's role (or the one
    /// secret of a loopback set-up); `None`: nothing is sent.
    pub secret: Option<ClusterSecret>,
    /// Mutual TLS to every internal server; `None`: plaintext HTTP/2.
    pub tls: Option<ClusterTls>,
    /// [`grpc_message_limit`], for encoding and decoding.
    pub max_message_bytes: usize,
}

impl Default for ClusterClient {
    /// No secret, the limit of the default settings.
    fn default() -> Self {
        Self {
            role: None,
            secret: None,
            tls: None,
            max_message_bytes: grpc_message_limit(128 << 20, 131_072),
        }
    }
}

impl ClusterClient {
    pub fn credentials(&self) -> ClusterCredentials {
        ClusterCredentials::new(self.role, self.secret.as_ref())
    }
}

/// The client interceptor: adds the role and the secret to every call
/// (unary and streaming alike: tonic runs it on each call's request head).
#[derive(Clone, Debug, Default)]
pub struct ClusterCredentials {
    role: Option<ClusterRole>,
    value: Option<AsciiMetadataValue>,
}

impl ClusterCredentials {
    pub fn new(role: Option<ClusterRole>, secret: Option<&ClusterSecret>) -> Self {
        let value = secret
            .and_then(|secret| AsciiMetadataValue::try_from(secret.expose()).ok())
            .map(|mut value| {
                // Kept out of hyper's and h2's debug output and HPACK tables.
                value.set_sensitive(true);
                value
            });
        Self { role, value }
    }
}

impl Interceptor for ClusterCredentials {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(role) = self.role {
            request.metadata_mut().insert(
                ROLE_METADATA_KEY,
                AsciiMetadataValue::from_static(role.as_str()),
            );
        }
        if let Some(value) = &self.value {
            request
                .metadata_mut()
                .insert(SECRET_METADATA_KEY, value.clone());
        }
        Ok(request)
    }
}

/// The channel every internal client uses: the secret added to each call.
pub type ClusterChannel = InterceptedService<Channel, ClusterCredentials>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_must_be_long_printable_and_are_never_printed() {
        assert_eq!(ClusterSecret::new("  \n"), Err(SecretError::Empty));
        assert_eq!(ClusterSecret::new("short"), Err(SecretError::TooShort(5)));
        assert_eq!(
            ClusterSecret::new("sixteen bytes with spaces"),
            Err(SecretError::NotPrintable)
        );
        let secret = ClusterSecret::new("0123456789abcdef\n");
        assert!(matches!(&secret, Ok(s) if s.expose() == b"0123456789abcdef"));
        let shown = format!("{secret:?}");
        assert!(!shown.contains("0123"), "{shown}");
    }

    #[test]
    fn credentials_are_added_to_every_request_and_marked_sensitive() {
        let secret = ClusterSecret::new("0123456789abcdef").ok();
        let mut credentials = ClusterCredentials::new(Some(ClusterRole::Engine), secret.as_ref());
        let request = credentials.call(Request::new(()));
        let Ok(request) = request else {
            panic!("refused")
        };
        let value = request.metadata().get(SECRET_METADATA_KEY);
        assert_eq!(
            value.and_then(|v| v.to_str().ok()),
            Some("0123456789abcdef")
        );
        assert!(value.is_some_and(|v| v.is_sensitive()));
        let role = request.metadata().get(ROLE_METADATA_KEY);
        assert_eq!(role.and_then(|v| v.to_str().ok()), Some("engine"));

        let mut none = ClusterCredentials::new(None, None);
        let Ok(request) = none.call(Request::new(())) else {
            panic!("refused")
        };
        assert!(request.metadata().get(SECRET_METADATA_KEY).is_none());
        assert!(request.metadata().get(ROLE_METADATA_KEY).is_none());
        for role in ClusterRole::ALL {
            assert_eq!(ClusterRole::from_name(role.as_str()), Some(role));
        }
        assert_eq!(ClusterRole::from_name("all-in-one"), None);
    }

    #[test]
    fn cluster_tls_turns_http_into_https_and_https_needs_it() {
        assert_eq!(
            cluster_uri("http://engine:50061", true).as_deref(),
            Ok("https://engine:50061")
        );
        assert_eq!(
            cluster_uri("https://engine:50061", true).as_deref(),
            Ok("https://engine:50061")
        );
        assert_eq!(
            cluster_uri("http://engine:50061", false).as_deref(),
            Ok("http://engine:50061")
        );
        let refused = cluster_uri("https://engine:50061", false);
        assert!(
            refused.as_ref().is_err_and(|e| e.contains("cluster.tls")),
            "{refused:?}"
        );
        let tls = ClusterTls::new(b"ca".to_vec(), b"cert".to_vec(), b"secret key".to_vec());
        assert!(!format!("{tls:?}").contains("secret key"));
    }

    #[test]
    fn the_message_limit_covers_the_largest_body_or_a_batch() {
        let default = grpc_message_limit(128 << 20, 131_072);
        assert_eq!(default, (128 << 20) + 131_072 + (4 << 20));
        // Small bodies: still room for a whole batch.
        assert_eq!(
            grpc_message_limit(1024, 4096),
            BATCH_BYTES + 4096 + (4 << 20)
        );
        // Never beyond what gRPC's 32-bit length can frame.
        assert_eq!(grpc_message_limit(u64::MAX, u32::MAX), u32::MAX as usize);
    }
}
