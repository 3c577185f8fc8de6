//! Users and their permissions: the administrator's.

use spillway_proto::management as m;
use tonic::Status;

use super::answer;
use crate::authorize::{authorize, Need};
use crate::{Caller, ManagementService};

impl ManagementService {
    pub(crate) async fn put_user(
        &self,
        caller: &Caller,
        request: m::PutUserRequest,
    ) -> Result<m::User, Status> {
        authorize(caller, &[Need::Administrator])?;
        // Never the password in the log.
        let (user, password_set, tags) = (
            request.name.clone(),
            request.password.is_some(),
            request.tags.join(","),
        );
        let response = self.engine.put_user(request).await?;
        tracing::info!(user, password_set, tags, "user stored by management");
        Ok(response)
    }

    pub(crate) async fn delete_user(
        &self,
        caller: &Caller,
        request: m::DeleteUserRequest,
    ) -> Result<m::DeleteUserResponse, Status> {
        authorize(caller, &[Need::Administrator])?;
        let user = request.name.clone();
        let response = self.engine.delete_user(request).await?;
        tracing::info!(
            user,
            closed_connections = response.closed_connections,
            "user deleted by management"
        );
        Ok(response)
    }

    pub(crate) async fn list_users(
        &self,
        caller: &Caller,
        request: m::ListUsersRequest,
    ) -> Result<m::ListUsersResponse, Status> {
        authorize(caller, &[Need::Administrator])?;
        answer(self.engine.list_users(request).await)
    }

    pub(crate) async fn set_permissions(
        &self,
        caller: &Caller,
        request: m::SetPermissionsRequest,
    ) -> Result<m::Permission, Status> {
        authorize(caller, &[Need::Administrator])?;
        let logged = format!("{request:?}");
        let response = self.engine.set_permissions(request).await?;
        tracing::info!(permissions = %logged, "permissions set by management");
        Ok(response)
    }

    pub(crate) async fn clear_permissions(
        &self,
        caller: &Caller,
        request: m::ClearPermissionsRequest,
    ) -> Result<m::ClearPermissionsResponse, Status> {
        authorize(caller, &[Need::Administrator])?;
        let logged = format!("{request:?}");
        let response = self.engine.clear_permissions(request).await?;
        tracing::info!(permissions = %logged, "permissions cleared by management");
        Ok(response)
    }

    pub(crate) async fn list_permissions(
        &self,
        caller: &Caller,
        request: m::ListPermissionsRequest,
    ) -> Result<m::ListPermissionsResponse, Status> {
        authorize(caller, &[Need::Administrator])?;
        answer(self.engine.list_permissions(request).await)
    }
}
