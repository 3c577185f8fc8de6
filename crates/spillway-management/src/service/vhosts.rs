//! Vhosts: create, delete, list, one, and the message totals of each.

use spillway_proto::engine::{VhostMessageTotals, VhostMessageTotalsRequest};
use spillway_proto::management as m;
use tonic::Status;

use super::answer;
use crate::authorize::{self, authorize, Need};
use crate::{Caller, ManagementService};

impl ManagementService {
    pub(crate) async fn create_vhost(
        &self,
        caller: &Caller,
        request: m::CreateVhostRequest,
    ) -> Result<m::Vhost, Status> {
        authorize(caller, &[Need::Administrator])?;
        answer(self.engine.create_vhost(request).await)
    }

    pub(crate) async fn delete_vhost(
        &self,
        caller: &Caller,
        request: m::DeleteVhostRequest,
    ) -> Result<m::DeleteVhostResponse, Status> {
        authorize(caller, &[Need::Administrator])?;
        answer(self.engine.delete_vhost(request).await)
    }

    /// The vhosts the caller sees.
    pub(crate) async fn list_vhosts(
        &self,
        caller: &Caller,
        request: m::ListVhostsRequest,
    ) -> Result<m::ListVhostsResponse, Status> {
        authorize(caller, &[Need::Overview])?;
        let mut list = self.engine.list_vhosts(request).await?;
        list.vhosts
            .retain(|vhost| authorize::sees_vhost(caller, &vhost.name));
        Ok(list)
    }

    pub(crate) async fn get_vhost(
        &self,
        caller: &Caller,
        request: m::GetVhostRequest,
    ) -> Result<m::Vhost, Status> {
        authorize(
            caller,
            &[Need::See {
                vhost: &request.name,
            }],
        )?;
        answer(self.engine.get_vhost(request).await)
    }

    /// Ready and unacknowledged messages of each vhost the caller sees
    /// (of `vhost` alone when given), for the HTTP API's vhosts. Not a gRPC
    /// method: the public API shows the same figures per queue.
    pub async fn vhost_message_totals(
        &self,
        caller: &Caller,
        vhost: Option<&str>,
    ) -> Result<Vec<VhostMessageTotals>, Status> {
        match vhost {
            Some(vhost) => authorize(caller, &[Need::See { vhost }])?,
            None => authorize(caller, &[Need::Overview])?,
        }
        let request = VhostMessageTotalsRequest {
            vhost: vhost.unwrap_or_default().to_string(),
        };
        let mut totals = self.engine.vhost_message_totals(request).await?.vhosts;
        totals.retain(|totals| authorize::sees_vhost(caller, &totals.vhost));
        Ok(totals)
    }
}
