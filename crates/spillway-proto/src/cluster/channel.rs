//! The channels of Spillway's internal gRPC clients: lazily connecting,
//! carrying the cluster's credentials, over its mutual TLS when it has one.

use std::time::Duration;

use tonic::transport::Endpoint;

use super::{ClusterChannel, ClusterClient};
use crate::ServiceError;

/// A lazily connecting channel to `addr` that adds the cluster secret to
/// every call, over mutual TLS when the cluster has it (`http://` is then
/// dialled as `https://`; the server's certificate must name the address's
/// host).
pub fn lazy_channel(addr: &str, cluster: &ClusterClient) -> Result<ClusterChannel, ServiceError> {
    lazy_channel_within(addr, cluster, ChannelTimeouts::DEFAULT)
}

/// A channel to a storage group's member ([`ChannelTimeouts::GROUP_MEMBER`]):
/// for the members' own Raft traffic and for their clients.
pub fn lazy_member_channel(
    addr: &str,
    cluster: &ClusterClient,
) -> Result<ClusterChannel, ServiceError> {
    lazy_channel_within(addr, cluster, ChannelTimeouts::GROUP_MEMBER)
}

/// How long a channel waits to connect, and how soon it finds a connection
/// dead (HTTP/2 PING every `keep_alive`, answered within `keep_alive_timeout`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChannelTimeouts {
    pub(crate) connect: Duration,
    pub(crate) keep_alive: Duration,
    pub(crate) keep_alive_timeout: Duration,
}

impl ChannelTimeouts {
    /// One peer, nothing else to ask: patient.
    pub(crate) const DEFAULT: Self = Self {
        connect: Duration::from_secs(5),
        keep_alive: Duration::from_secs(10),
        keep_alive_timeout: Duration::from_secs(20),
    };
    /// A storage group's member: another can be asked, so one that cannot
    /// be reached is given up on within a second (a dead container's
    /// address answers nothing). A silent connection is found dead within
    /// 12 s: shorter, and a member busy catching up (a snapshot, on two
    /// loaded cores) is cut off in the middle of it, again and again. Calls
    /// that must not wait that long bound their attempts themselves
    /// (`GroupStorage`).
    pub(crate) const GROUP_MEMBER: Self = Self {
        connect: Duration::from_secs(1),
        keep_alive: Duration::from_secs(2),
        keep_alive_timeout: Duration::from_secs(10),
    };
}

/// [`lazy_channel`], with timeouts of its own.
pub(crate) fn lazy_channel_within(
    addr: &str,
    cluster: &ClusterClient,
    timeouts: ChannelTimeouts,
) -> Result<ClusterChannel, ServiceError> {
    let uri =
        super::cluster_uri(addr, cluster.tls.is_some()).map_err(ServiceError::InvalidArgument)?;
    let mut endpoint = Endpoint::from_shared(uri)
        .map_err(|err| ServiceError::InvalidArgument(format!("bad address {addr}: {err}")))?
        .connect_timeout(timeouts.connect)
        .tcp_nodelay(true)
        .max_frame_size(super::HTTP2_MAX_FRAME_BYTES)
        .http2_keep_alive_interval(timeouts.keep_alive)
        .keep_alive_timeout(timeouts.keep_alive_timeout)
        .keep_alive_while_idle(true);
    if let Some(tls) = &cluster.tls {
        endpoint = endpoint.tls_config(tls.client_config()).map_err(|err| {
            ServiceError::InvalidArgument(format!(
                "cluster.tls cannot be used to reach {addr}: {err}"
            ))
        })?;
    }
    Ok(ClusterChannel::new(
        endpoint.connect_lazy(),
        cluster.credentials(),
    ))
}
