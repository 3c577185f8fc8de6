//! Exchanges: declared, listed and deleted through the broker's own session
//! operations.

use spillway_proto::engine as pb;
use spillway_proto::management as m;
use spillway_proto::ServiceError;

use super::common::{argument_map, check_name, encode_arguments, not_found, ok, vhost, CHANNEL};
use crate::engine::Engine;

impl Engine {
    pub(crate) async fn create_exchange(
        &self,
        request: m::CreateExchangeRequest,
    ) -> Result<m::Exchange, ServiceError> {
        check_name("exchange", &request.name)?;
        let arguments = encode_arguments(&request.arguments)?;
        self.with_session(&request.vhost, |broker, session| {
            ok(broker.declare_exchange(
                session,
                &pb::ExchangeDeclare {
                    request_id: 0,
                    channel: CHANNEL,
                    exchange: request.name.clone(),
                    kind: request.kind.clone(),
                    passive: false,
                    durable: request.durable,
                    auto_delete: request.auto_delete,
                    internal: request.internal,
                    arguments,
                },
            ))?;
            let vhost = vhost(broker, &request.vhost)?;
            let exchange = vhost
                .exchanges
                .get(&request.name)
                .ok_or_else(|| not_found("exchange", &request.name, &request.vhost))?;
            Ok(exchange_view(&request.vhost, exchange, &broker.delayed))
        })
    }

    pub(crate) async fn list_exchanges(
        &self,
        request: m::ListExchangesRequest,
    ) -> Result<m::ListExchangesResponse, ServiceError> {
        let broker = self.shared.broker.lock();
        let vhost = vhost(&broker, &request.vhost)?;
        let mut exchanges: Vec<m::Exchange> = vhost
            .exchanges
            .values()
            .map(|x| exchange_view(&request.vhost, x, &broker.delayed))
            .collect();
        exchanges.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(m::ListExchangesResponse { exchanges })
    }

    pub(crate) async fn delete_exchange(
        &self,
        request: m::DeleteExchangeRequest,
    ) -> Result<m::DeleteExchangeResponse, ServiceError> {
        self.with_session(&request.vhost, |broker, session| {
            if !vhost(broker, &request.vhost)?
                .exchanges
                .contains_key(&request.name)
            {
                return Err(not_found("exchange", &request.name, &request.vhost));
            }
            ok(broker.delete_exchange(
                session,
                &pb::ExchangeDelete {
                    request_id: 0,
                    channel: CHANNEL,
                    exchange: request.name.clone(),
                    if_unused: request.if_unused,
                },
            ))
        })?;
        Ok(m::DeleteExchangeResponse {})
    }
}

fn exchange_view(
    vhost: &str,
    exchange: &crate::exchange::Exchange,
    delayed: &crate::broker::delayed::DelayedState,
) -> m::Exchange {
    m::Exchange {
        vhost: vhost.to_string(),
        name: exchange.name.clone(),
        kind: exchange.kind_name().to_string(),
        delayed_messages: delayed.count(vhost, &exchange.name),
        durable: exchange.durable,
        auto_delete: exchange.auto_delete,
        internal: exchange.internal,
        arguments: argument_map(&exchange.arguments),
        builtin: exchange.is_builtin(),
        policy: exchange.policy.clone().unwrap_or_default(),
    }
}
