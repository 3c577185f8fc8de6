//! How a member reaches the other members: openraft's messages, and the
//! question "how do you see the group?" that a member starting empty asks
//! (`rejoin.rs`). In a deployment that is gRPC ([`GrpcTransport`]); the
//! simulation (`spillway-sim`) delivers the same calls in memory, through
//! its faulty network.

use std::future::Future;

use openraft::RaftNetworkFactory;
use spillway_proto::cluster::ClusterClient;
use spillway_proto::storage::storage_group_client::StorageGroupClient;
use spillway_proto::storage::{GroupStatus, GroupStatusRequest};

use super::network::GroupNetwork;
use super::types::GroupConfig;

/// How long one status question may take.
const ASK_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// A member's way to the others.
pub trait GroupTransport: Clone + Send + Sync + 'static {
    /// openraft's messages to the member with a given id and address.
    type Network: RaftNetworkFactory<GroupConfig>;

    /// A factory of clients for openraft.
    fn network(&self) -> Self::Network;

    /// The group as the member at `address` sees it (its `GroupStatus`).
    fn status_of(&self, address: &str) -> impl Future<Output = Result<GroupStatus, String>> + Send;
}

/// The `StorageGroup` gRPC service, on the cluster's authenticated channels.
#[derive(Clone)]
pub struct GrpcTransport {
    cluster: ClusterClient,
}

impl GrpcTransport {
    pub fn new(cluster: ClusterClient) -> Self {
        Self { cluster }
    }
}

impl GroupTransport for GrpcTransport {
    type Network = GroupNetwork;

    fn network(&self) -> GroupNetwork {
        GroupNetwork::new(self.cluster.clone())
    }

    async fn status_of(&self, address: &str) -> Result<GroupStatus, String> {
        let channel = spillway_proto::cluster::lazy_member_channel(address, &self.cluster)
            .map_err(|error| error.to_string())?;
        let mut client = StorageGroupClient::new(channel);
        let mut request = tonic::Request::new(GroupStatusRequest {});
        request.set_timeout(ASK_WITHIN);
        let status = client
            .get_group_status(request)
            .await
            .map_err(|status| status.message().to_string())?;
        Ok(status.into_inner())
    }
}
