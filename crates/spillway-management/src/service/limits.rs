//! Vhost and user limits: the administrator's to set and clear, the
//! monitoring user's to read.

use spillway_proto::management as m;
use tonic::Status;

use super::answer;
use crate::authorize::{authorize, Need};
use crate::{Caller, ManagementService};

impl ManagementService {
    pub(crate) async fn set_limits(
        &self,
        caller: &Caller,
        request: m::SetLimitsRequest,
    ) -> Result<m::Limits, Status> {
        authorize(caller, &[Need::Administrator])?;
        let logged = format!("{request:?}");
        let response = self.engine.set_limits(request).await?;
        tracing::info!(limits = %logged, "limits changed by management");
        Ok(response)
    }

    pub(crate) async fn clear_limits(
        &self,
        caller: &Caller,
        request: m::ClearLimitsRequest,
    ) -> Result<m::ClearLimitsResponse, Status> {
        authorize(caller, &[Need::Administrator])?;
        let logged = format!("{request:?}");
        let response = self.engine.clear_limits(request).await?;
        tracing::info!(limits = %logged, "limits cleared by management");
        Ok(response)
    }

    pub(crate) async fn list_limits(
        &self,
        caller: &Caller,
        request: m::ListLimitsRequest,
    ) -> Result<m::ListLimitsResponse, Status> {
        authorize(caller, &[Need::Monitoring])?;
        answer(self.engine.list_limits(request).await)
    }
}
