//! The `StorageGroup` gRPC service: openraft's messages from the other
//! members, and the group's status and membership for operators.

use serde::de::DeserializeOwned;
use serde::Serialize;
use spillway_proto::storage::storage_group_server::StorageGroup as StorageGroupRpc;
use spillway_proto::storage::{
    AddMemberRequest, GroupStatus, GroupStatusRequest, RaftPayload, RemoveMemberRequest,
};
use tonic::{Request, Response, Status};

use super::node::StorageGroup;

/// The group service of one member.
pub struct StorageGroupService {
    group: StorageGroup,
}

impl StorageGroupService {
    pub fn new(group: StorageGroup) -> Self {
        Self { group }
    }

    /// The server, accepting messages of up to `max_message_bytes`.
    pub fn into_server(
        self,
        max_message_bytes: usize,
    ) -> spillway_proto::storage::storage_group_server::StorageGroupServer<Self> {
        spillway_proto::storage::storage_group_server::StorageGroupServer::new(self)
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes)
    }
}

fn decode<T: DeserializeOwned>(request: Request<RaftPayload>) -> Result<T, Status> {
    postcard::from_bytes(&request.into_inner().data)
        .map_err(|error| Status::invalid_argument(format!("not a storage group message: {error}")))
}

fn encode<T: Serialize>(answer: &T) -> Result<Response<RaftPayload>, Status> {
    let data = postcard::to_allocvec(answer)
        .map_err(|error| Status::internal(format!("cannot encode an answer: {error}")))?;
    Ok(Response::new(RaftPayload { data: data.into() }))
}

#[tonic::async_trait]
impl StorageGroupRpc for StorageGroupService {
    async fn append_entries(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let answer = self.group.on_append_entries(decode(request)?).await;
        encode(&answer)
    }

    async fn vote(&self, request: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let answer = self
            .group
            .on_vote(decode(request)?)
            .await
            .map_err(|withheld| Status::unavailable(withheld.to_string()))?;
        encode(&answer)
    }

    async fn install_snapshot(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let answer = self.group.on_install_snapshot(decode(request)?).await;
        encode(&answer)
    }

    async fn get_group_status(
        &self,
        _request: Request<GroupStatusRequest>,
    ) -> Result<Response<GroupStatus>, Status> {
        Ok(Response::new(self.group.status()))
    }

    async fn add_member(
        &self,
        request: Request<AddMemberRequest>,
    ) -> Result<Response<GroupStatus>, Status> {
        let request = request.into_inner();
        let status = self.group.add_member(request.id, &request.address).await?;
        Ok(Response::new(status))
    }

    async fn remove_member(
        &self,
        request: Request<RemoveMemberRequest>,
    ) -> Result<Response<GroupStatus>, Status> {
        let status = self.group.remove_member(request.into_inner().id).await?;
        Ok(Response::new(status))
    }
}
