//! The storage node as management changes it: the store's disk quota and
//! the storage group's members. The administrator's.

use spillway_proto::management as m;
use spillway_proto::storage::GroupStatus;
use tonic::Status;

use crate::authorize::{authorize, Need};
use crate::{Caller, ManagementService};

impl ManagementService {
    pub(crate) async fn set_store_quota(
        &self,
        caller: &Caller,
        request: m::SetStoreQuotaRequest,
    ) -> Result<m::SetStoreQuotaResponse, Status> {
        authorize(caller, &[Need::Administrator])?;
        let logged = format!("{request:?}");
        self.storage.set_quota(request).await?;
        tracing::info!(quota = %logged, "store quota changed by management");
        Ok(m::SetStoreQuotaResponse {})
    }

    pub(crate) async fn get_storage_group(
        &self,
        caller: &Caller,
        _request: m::GetStorageGroupRequest,
    ) -> Result<m::StorageGroup, Status> {
        authorize(caller, &[Need::Administrator])?;
        let status = self.storage.group_status().await?;
        Ok(storage_group(status))
    }

    pub(crate) async fn add_storage_member(
        &self,
        caller: &Caller,
        request: m::AddStorageMemberRequest,
    ) -> Result<m::StorageGroup, Status> {
        authorize(caller, &[Need::Administrator])?;
        if request.id == 0 || request.address.is_empty() {
            return Err(Status::invalid_argument(
                "a storage member needs an id above 0 and an address",
            ));
        }
        let status = self
            .storage
            .add_member(request.id, request.address.clone())
            .await?;
        tracing::info!(id = request.id, address = %request.address, "storage member added by management");
        Ok(storage_group(status))
    }

    pub(crate) async fn remove_storage_member(
        &self,
        caller: &Caller,
        request: m::RemoveStorageMemberRequest,
    ) -> Result<m::StorageGroup, Status> {
        authorize(caller, &[Need::Administrator])?;
        let status = self.storage.remove_member(request.id).await?;
        tracing::info!(id = request.id, "storage member removed by management");
        Ok(storage_group(status))
    }
}

/// The storage group as management shows it.
fn storage_group(status: GroupStatus) -> m::StorageGroup {
    m::StorageGroup {
        leader: status.leader,
        term: status.term,
        committed_index: status.committed_index,
        members: status
            .members
            .into_iter()
            .map(|member| m::StorageMember {
                id: member.id,
                address: member.address,
                role: member.role,
                applied_index: member.applied_index,
                lag: member.lag,
            })
            .collect(),
    }
}
