//! The members' way to each other in the simulation: the same handlers the
//! `StorageGroup` gRPC service calls (`StorageGroup::on_vote`, …), reached
//! through the simulated [`Network`] instead of a socket.

use std::sync::Arc;

use openraft::error::{InstallSnapshotError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use spillway_proto::storage::GroupStatus;
use spillway_storage::group::{GroupConfig, GroupTransport};

use crate::network::{address_of, member_at, Host, Network, Undelivered};

/// One member's transport.
#[derive(Clone)]
pub struct SimTransport {
    pub me: Host,
    pub network: Arc<Network>,
}

impl GroupTransport for SimTransport {
    type Network = SimTransport;

    fn network(&self) -> SimTransport {
        self.clone()
    }

    async fn status_of(&self, address: &str) -> Result<GroupStatus, String> {
        let to = member_at(address).ok_or_else(|| format!("no member at {address}"))?;
        // As the gRPC question has its deadline (a lost message may never
        // be answered).
        let asked = self
            .network
            .call(self.me, to, |member| async move { member.status() });
        match tokio::time::timeout(std::time::Duration::from_secs(2), asked).await {
            Ok(answer) => answer.map_err(|undelivered| undelivered.to_string()),
            Err(_) => Err(format!("member {to} did not answer within 2 s")),
        }
    }
}

impl RaftNetworkFactory<GroupConfig> for SimTransport {
    type Network = SimPeer;

    async fn new_client(&mut self, target: u64, _node: &BasicNode) -> SimPeer {
        SimPeer {
            me: self.me,
            target,
            network: self.network.clone(),
        }
    }
}

/// One member as another reaches it.
pub struct SimPeer {
    me: Host,
    target: Host,
    network: Arc<Network>,
}

type Rpc<E> = RPCError<u64, BasicNode, RaftError<u64, E>>;

impl SimPeer {
    // openraft's network trait fixes the error type.
    #[allow(clippy::result_large_err)]
    fn answer<T, E: std::error::Error>(
        &self,
        delivered: Result<Result<T, RaftError<u64, E>>, Undelivered>,
    ) -> Result<T, Rpc<E>> {
        match delivered {
            Err(undelivered) => Err(RPCError::Unreachable(Unreachable::new(&undelivered))),
            Ok(Err(error)) => Err(RPCError::RemoteError(RemoteError::new_with_node(
                self.target,
                BasicNode::new(address_of(self.target)),
                error,
            ))),
            Ok(Ok(answer)) => Ok(answer),
        }
    }
}

impl RaftNetwork<GroupConfig> for SimPeer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<GroupConfig>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, Rpc<openraft::error::Infallible>> {
        let delivered = self
            .network
            .call(self.me, self.target, |member| async move {
                member.on_append_entries(rpc).await
            })
            .await;
        self.answer(delivered)
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<GroupConfig>,
        _option: RPCOption,
    ) -> Result<InstallSnapshotResponse<u64>, Rpc<InstallSnapshotError>> {
        let delivered = self
            .network
            .call(self.me, self.target, |member| async move {
                member.on_install_snapshot(rpc).await
            })
            .await;
        self.answer(delivered)
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        _option: RPCOption,
    ) -> Result<VoteResponse<u64>, Rpc<openraft::error::Infallible>> {
        let delivered = self
            .network
            .call(self.me, self.target, |member| async move {
                member.on_vote(rpc).await
            })
            .await;
        // A withheld vote is refused as the gRPC service refuses it
        // (UNAVAILABLE): to the candidate, the member did not answer.
        let delivered = match delivered {
            Ok(Err(withheld)) => Err(Undelivered(withheld.to_string())),
            Ok(Ok(answer)) => Ok(answer),
            Err(undelivered) => Err(undelivered),
        };
        self.answer(delivered)
    }
}
