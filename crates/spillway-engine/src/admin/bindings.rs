//! Bindings: made, listed an exchange at a time, and removed.

use bytes::Bytes;
use spillway_amqp as amqp;
use spillway_proto::engine as pb;
use spillway_proto::management as m;
use spillway_proto::ServiceError;

use super::common::{
    argument_map, check_name, encode_arguments, ok, service_error, vhost, CHANNEL,
};
use crate::engine::Engine;
use crate::model::Destination;

impl Engine {
    pub(crate) async fn create_binding(
        &self,
        request: m::CreateBindingRequest,
    ) -> Result<m::Binding, ServiceError> {
        let (binding, arguments) = binding_request(request.binding)?;
        self.with_session(&binding.vhost, |broker, session| {
            let result = if binding.destination_is_exchange {
                broker.bind_exchange(session, &exchange_bind(&binding, arguments))
            } else {
                broker.bind_queue(session, &queue_bind(&binding, arguments))
            };
            ok(result)
        })?;
        Ok(binding)
    }

    /// The vhost's bindings (of one source, to one destination, when
    /// asked), an exchange at a time: the lock is held for one exchange's
    /// bindings, then let go, so a vhost with 100,000 bindings spread over
    /// its exchanges never holds up publishers for all of them.
    pub(crate) async fn list_bindings(
        &self,
        request: m::ListBindingsRequest,
    ) -> Result<m::ListBindingsResponse, ServiceError> {
        let sources: Vec<String> = {
            let broker = self.shared.broker.lock();
            let vhost = vhost(&broker, &request.vhost)?;
            if request.source.is_empty() {
                let mut names: Vec<String> = vhost.exchanges.keys().cloned().collect();
                names.sort();
                names
            } else {
                vec![request.source.clone()]
            }
        };
        let mut bindings = Vec::new();
        for source in &sources {
            {
                let broker = self.shared.broker.lock();
                // A vhost deleted meanwhile has no bindings left.
                let Some(vhost) = broker.vhosts.get(&request.vhost) else {
                    break;
                };
                if let Some(exchange) = vhost.exchanges.get(source) {
                    let before = bindings.len();
                    binding_views(
                        &request.vhost,
                        exchange,
                        &request.destination,
                        &mut bindings,
                    );
                    bindings[before..].sort_by(|a, b| {
                        (&a.destination, &a.routing_key).cmp(&(&b.destination, &b.routing_key))
                    });
                }
                parking_lot::MutexGuard::unlock_fair(broker);
            }
            if sources.len() > 1 {
                tokio::task::yield_now().await;
            }
        }
        Ok(m::ListBindingsResponse { bindings })
    }

    pub(crate) async fn delete_binding(
        &self,
        request: m::DeleteBindingRequest,
    ) -> Result<m::DeleteBindingResponse, ServiceError> {
        let (binding, arguments) = binding_request(request.binding)?;
        let table = amqp::decode_table(&arguments).map_err(|error| service_error(error.into()))?;
        self.with_session(&binding.vhost, |broker, session| {
            let destination = if binding.destination_is_exchange {
                Destination::Exchange(binding.destination.clone())
            } else {
                Destination::Queue(binding.destination.clone())
            };
            let exists = vhost(broker, &binding.vhost)?
                .exchanges
                .get(&binding.source)
                .is_some_and(|x| {
                    x.bindings.iter().any(|b| {
                        b.destination == destination
                            && b.routing_key == binding.routing_key
                            && b.arguments == table
                    })
                });
            if !exists {
                return Err(ServiceError::NotFound(format!(
                    "no binding from '{}' to '{}' with key '{}' in vhost '{}'",
                    binding.source, binding.destination, binding.routing_key, binding.vhost
                )));
            }
            let result = if binding.destination_is_exchange {
                broker.unbind_exchange(session, &exchange_bind(&binding, arguments))
            } else {
                broker.unbind_queue(session, &queue_bind(&binding, arguments))
            };
            ok(result)
        })?;
        Ok(m::DeleteBindingResponse {})
    }
}

/// `exchange.bind` (or `exchange.unbind`) of `binding`, as a session
/// sends it.
fn exchange_bind(binding: &m::Binding, arguments: Bytes) -> pb::ExchangeBind {
    pb::ExchangeBind {
        request_id: 0,
        channel: CHANNEL,
        destination: binding.destination.clone(),
        source: binding.source.clone(),
        routing_key: binding.routing_key.clone(),
        arguments,
    }
}

/// `queue.bind` (or `queue.unbind`) of `binding`, as a session sends it.
fn queue_bind(binding: &m::Binding, arguments: Bytes) -> pb::QueueBind {
    pb::QueueBind {
        request_id: 0,
        channel: CHANNEL,
        queue: binding.destination.clone(),
        exchange: binding.source.clone(),
        routing_key: binding.routing_key.clone(),
        arguments,
    }
}

/// The bindings of `exchange` (in `vhost_name`) to `destination` (to any
/// when empty), as management shows them. Only those asked for are built.
fn binding_views(
    vhost_name: &str,
    exchange: &crate::exchange::Exchange,
    destination: &str,
    into: &mut Vec<m::Binding>,
) {
    let wanted = exchange
        .bindings
        .iter()
        .filter(|binding| destination.is_empty() || binding.destination.name() == destination);
    into.extend(wanted.map(|binding| m::Binding {
        vhost: vhost_name.to_string(),
        source: exchange.name.clone(),
        destination: binding.destination.name().to_string(),
        destination_is_exchange: matches!(binding.destination, Destination::Exchange(_)),
        routing_key: binding.routing_key.clone(),
        arguments: argument_map(&binding.arguments),
    }));
}

fn binding_request(binding: Option<m::Binding>) -> Result<(m::Binding, Bytes), ServiceError> {
    let binding =
        binding.ok_or_else(|| ServiceError::InvalidArgument("binding is required".into()))?;
    check_name("source exchange", &binding.source)?;
    check_name("destination", &binding.destination)?;
    let arguments = encode_arguments(&binding.arguments)?;
    Ok((binding, arguments))
}
