//! Policies and operator policies: set (stored, then applied to the vhost's
//! queues and exchanges), listed and cleared.

use spillway_proto::management as m;
use spillway_proto::storage::write_op;
use spillway_proto::ServiceError;
use tokio::sync::oneshot;

use crate::broker::policy_view;
use crate::engine::Engine;
use crate::persistence::{await_written, store_op};
use crate::policy::Policy;

impl Engine {
    pub(crate) async fn set_policy(
        &self,
        request: m::SetPolicyRequest,
    ) -> Result<m::Policy, ServiceError> {
        let wanted = request
            .policy
            .ok_or_else(|| ServiceError::InvalidArgument("policy is required".into()))?;
        let policy = Policy::new(
            &wanted.name,
            wanted.operator,
            &wanted.pattern,
            &wanted.apply_to,
            wanted.priority,
            &wanted.definition,
        )
        .map_err(|invalid| ServiceError::InvalidArgument(invalid.0))?;
        let (done, written) = oneshot::channel();
        let view = {
            let mut broker = self.shared.broker.lock();
            let view = policy_view(&wanted.vhost, &policy);
            let definition = policy.definition(&wanted.vhost);
            let touched = broker.set_policy(&wanted.vhost, policy)?;
            // Under the lock: stored in the order of the changes.
            self.shared.writer.submit_synced(
                vec![store_op(write_op::Op::PutPolicy(definition))],
                Some(done),
            );
            for queue in touched {
                broker.dispatch(&wanted.vhost, &queue);
            }
            view
        };
        await_written(written, "the policy").await?;
        Ok(view)
    }

    pub(crate) async fn list_policies(
        &self,
        request: m::ListPoliciesRequest,
    ) -> Result<m::ListPoliciesResponse, ServiceError> {
        let broker = self.shared.broker.lock();
        Ok(m::ListPoliciesResponse {
            policies: broker.list_policies(&request.vhost, request.operator)?,
        })
    }

    pub(crate) async fn clear_policy(
        &self,
        request: m::ClearPolicyRequest,
    ) -> Result<m::ClearPolicyResponse, ServiceError> {
        let (done, written) = oneshot::channel();
        {
            let mut broker = self.shared.broker.lock();
            let (removed, touched) =
                broker.clear_policy(&request.vhost, &request.name, request.operator)?;
            self.shared.writer.submit_synced(
                vec![store_op(write_op::Op::DeletePolicy(
                    removed.definition(&request.vhost),
                ))],
                Some(done),
            );
            for queue in touched {
                broker.dispatch(&request.vhost, &queue);
            }
        }
        await_written(written, "the policy's removal").await?;
        Ok(m::ClearPolicyResponse {})
    }
}
