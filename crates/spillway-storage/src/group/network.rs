//! How a member reaches the others: openraft's messages over the
//! `StorageGroup` gRPC service, encoded with postcard, on the cluster's
//! authenticated channels.

use openraft::error::{
    InstallSnapshotError, NetworkError, PayloadTooLarge, RPCError, RaftError, RemoteError,
    Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use serde::de::DeserializeOwned;
use serde::Serialize;
use spillway_proto::cluster::{ClusterChannel, ClusterClient};
use spillway_proto::storage::storage_group_client::StorageGroupClient;
use spillway_proto::storage::RaftPayload;

use super::types::GroupConfig;

/// Makes a [`PeerClient`] per member.
pub struct GroupNetwork {
    cluster: ClusterClient,
}

impl GroupNetwork {
    pub(crate) fn new(cluster: ClusterClient) -> Self {
        Self { cluster }
    }
}

impl RaftNetworkFactory<GroupConfig> for GroupNetwork {
    type Network = PeerClient;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> PeerClient {
        let client = spillway_proto::cluster::lazy_member_channel(&node.addr, &self.cluster).map(
            |channel| {
                StorageGroupClient::new(channel)
                    .max_decoding_message_size(self.cluster.max_message_bytes)
                    .max_encoding_message_size(self.cluster.max_message_bytes)
            },
        );
        PeerClient {
            target,
            address: node.addr.clone(),
            client: client.map_err(|error| error.to_string()),
            max_message_bytes: self.cluster.max_message_bytes,
        }
    }
}

/// One member as the others reach it.
pub struct PeerClient {
    target: u64,
    address: String,
    /// The channel, or why the member's address cannot be dialled.
    client: Result<StorageGroupClient<ClusterChannel>, String>,
    /// The gRPC message limit: entries beyond it go in smaller requests.
    max_message_bytes: usize,
}

#[derive(Debug, thiserror::Error)]
#[error("storage group member {target} at {address}: {reason}")]
struct PeerError {
    target: u64,
    address: String,
    reason: String,
}

type Rpc<E> = RPCError<u64, BasicNode, RaftError<u64, E>>;

impl PeerClient {
    fn error(&self, reason: impl ToString) -> PeerError {
        PeerError {
            target: self.target,
            address: self.address.clone(),
            reason: reason.to_string(),
        }
    }

    /// Sends `request` on `method`; the peer answers with openraft's
    /// `Result<Response, RaftError<E>>`.
    async fn call<Req, Resp, E>(
        &mut self,
        method: Method,
        request: &Req,
        option: &RPCOption,
    ) -> Result<Resp, Rpc<E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let data = postcard::to_allocvec(request)
            .map_err(|error| RPCError::Network(NetworkError::new(&self.error(error))))?;
        let mut client = match &self.client {
            Ok(client) => client.clone(),
            Err(reason) => {
                return Err(RPCError::Unreachable(Unreachable::new(&self.error(reason))))
            }
        };
        let mut call = tonic::Request::new(RaftPayload { data: data.into() });
        call.set_timeout(option.hard_ttl());
        let answer = match method {
            Method::AppendEntries => client.append_entries(call).await,
            Method::Vote => client.vote(call).await,
            Method::InstallSnapshot => client.install_snapshot(call).await,
        };
        let answer = answer.map_err(|status| {
            RPCError::Unreachable(Unreachable::new(&self.error(status.message())))
        })?;
        let result: Result<Resp, RaftError<u64, E>> =
            postcard::from_bytes(&answer.into_inner().data)
                .map_err(|error| RPCError::Network(NetworkError::new(&self.error(error))))?;
        result.map_err(|error| {
            RPCError::RemoteError(RemoteError::new_with_node(
                self.target,
                BasicNode::new(&self.address),
                error,
            ))
        })
    }
}

#[derive(Clone, Copy)]
enum Method {
    AppendEntries,
    Vote,
    InstallSnapshot,
}

impl RaftNetwork<GroupConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<GroupConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, Rpc<openraft::error::Infallible>> {
        // Entries are write batches of up to a few MiB each: a request of
        // many would pass the gRPC limit. openraft sends fewer when told.
        let bytes: usize = rpc
            .entries
            .iter()
            .map(|entry| match &entry.payload {
                openraft::EntryPayload::Normal(super::types::Command::Write(batch)) => batch.len(),
                _ => 64,
            })
            .sum();
        if rpc.entries.len() > 1 && bytes > self.max_message_bytes / 2 {
            let hint = (rpc.entries.len() as u64 / 2).max(1);
            return Err(RPCError::PayloadTooLarge(
                PayloadTooLarge::new_entries_hint(hint),
            ));
        }
        self.call(Method::AppendEntries, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<GroupConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<u64>, Rpc<InstallSnapshotError>> {
        self.call(Method::InstallSnapshot, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        option: RPCOption,
    ) -> Result<VoteResponse<u64>, Rpc<openraft::error::Infallible>> {
        self.call(Method::Vote, &rpc, &option).await
    }
}
