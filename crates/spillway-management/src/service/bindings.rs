//! Bindings: create, delete, list, one. A binding needs write on its
//! destination and read on its source, as `queue.bind` and
//! `exchange.bind` do over AMQP.

use spillway_proto::management as m;
use spillway_proto::permissions::Access;
use tonic::Status;

use super::answer;
use crate::authorize::{authorize, Need};
use crate::{Caller, ManagementService};

impl ManagementService {
    pub(crate) async fn create_binding(
        &self,
        caller: &Caller,
        request: m::CreateBindingRequest,
    ) -> Result<m::Binding, Status> {
        authorize(caller, &binding_needs(request.binding.as_ref())?)?;
        answer(self.engine.create_binding(request).await)
    }

    pub(crate) async fn delete_binding(
        &self,
        caller: &Caller,
        request: m::DeleteBindingRequest,
    ) -> Result<m::DeleteBindingResponse, Status> {
        authorize(caller, &binding_needs(request.binding.as_ref())?)?;
        answer(self.engine.delete_binding(request).await)
    }

    pub(crate) async fn list_bindings(
        &self,
        caller: &Caller,
        request: m::ListBindingsRequest,
    ) -> Result<m::ListBindingsResponse, Status> {
        authorize(
            caller,
            &[Need::See {
                vhost: &request.vhost,
            }],
        )?;
        answer(self.engine.list_bindings(request).await)
    }

    pub(crate) async fn get_binding(
        &self,
        caller: &Caller,
        request: m::GetBindingRequest,
    ) -> Result<m::Binding, Status> {
        let wanted = request
            .binding
            .ok_or_else(|| Status::invalid_argument("binding is required"))?;
        authorize(
            caller,
            &[Need::See {
                vhost: &wanted.vhost,
            }],
        )?;
        let list = self
            .engine
            .list_bindings(m::ListBindingsRequest {
                vhost: wanted.vhost.clone(),
                source: wanted.source.clone(),
                destination: wanted.destination.clone(),
            })
            .await?;
        list.bindings
            .into_iter()
            .find(|binding| {
                binding.destination_is_exchange == wanted.destination_is_exchange
                    && binding.routing_key == wanted.routing_key
                    && binding.arguments == wanted.arguments
            })
            .ok_or_else(|| {
                Status::not_found(format!(
                    "no binding from '{}' to '{}' with key '{}' in vhost '{}'",
                    wanted.source, wanted.destination, wanted.routing_key, wanted.vhost
                ))
            })
    }
}

/// Write on the destination, read on the source.
fn binding_needs(binding: Option<&m::Binding>) -> Result<[Need<'_>; 2], Status> {
    let binding = binding.ok_or_else(|| Status::invalid_argument("binding is required"))?;
    let destination_kind = if binding.destination_is_exchange {
        "exchange"
    } else {
        "queue"
    };
    Ok([
        Need::Permission {
            vhost: &binding.vhost,
            access: Access::Write,
            kind: destination_kind,
            name: &binding.destination,
        },
        Need::Permission {
            vhost: &binding.vhost,
            access: Access::Read,
            kind: "exchange",
            name: &binding.source,
        },
    ])
}
