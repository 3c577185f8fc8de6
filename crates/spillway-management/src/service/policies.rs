//! Policies and operator policies: the policymaker's in vhosts it has
//! permissions in, operator policies the administrator's, as in RabbitMQ.

use spillway_proto::management as m;
use tonic::Status;

use super::answer;
use crate::authorize::{authorize, Need};
use crate::{Caller, ManagementService};

impl ManagementService {
    pub(crate) async fn set_policy(
        &self,
        caller: &Caller,
        request: m::SetPolicyRequest,
    ) -> Result<m::Policy, Status> {
        let policy = request
            .policy
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("policy is required"))?;
        authorize(caller, &[Need::policy(&policy.vhost, policy.operator)])?;
        let response = self.engine.set_policy(request).await?;
        tracing::info!(policy = ?response, "policy set by management");
        Ok(response)
    }

    pub(crate) async fn clear_policy(
        &self,
        caller: &Caller,
        request: m::ClearPolicyRequest,
    ) -> Result<m::ClearPolicyResponse, Status> {
        authorize(caller, &[Need::policy(&request.vhost, request.operator)])?;
        let logged = format!("{request:?}");
        let response = self.engine.clear_policy(request).await?;
        tracing::info!(policy = %logged, "policy cleared by management");
        Ok(response)
    }

    /// Reading policies needs `policymaker` (and sight of the vhost),
    /// reading operator policies `administrator`, as RabbitMQ's
    /// `/api/policies` and `/api/operator-policies`.
    pub(crate) async fn list_policies(
        &self,
        caller: &Caller,
        request: m::ListPoliciesRequest,
    ) -> Result<m::ListPoliciesResponse, Status> {
        if request.operator {
            authorize(caller, &[Need::Administrator])?;
        } else {
            authorize(
                caller,
                &[
                    Need::Policymaker,
                    Need::See {
                        vhost: &request.vhost,
                    },
                ],
            )?;
        }
        answer(self.engine.list_policies(request).await)
    }
}
