//! Exchanges: declare (with what an alternate exchange needs), delete,
//! list, one.

use spillway_proto::management as m;
use spillway_proto::permissions::alternate_exchange_requirements;
use tonic::Status;

use super::queues::string_argument;
use super::{answer, not_found};
use crate::authorize::{authorize, Need};
use crate::{Caller, ManagementService};

impl ManagementService {
    /// Configure on the exchange, and what its alternate exchange needs
    /// (as `exchange.declare` over AMQP).
    pub(crate) async fn create_exchange(
        &self,
        caller: &Caller,
        request: m::CreateExchangeRequest,
    ) -> Result<m::Exchange, Status> {
        let extra = alternate_exchange_requirements(
            &request.name,
            string_argument(&request.arguments, "alternate-exchange"),
        );
        authorize(
            caller,
            &Need::declare(&request.vhost, "exchange", &request.name, &extra),
        )?;
        answer(self.engine.create_exchange(request).await)
    }

    pub(crate) async fn delete_exchange(
        &self,
        caller: &Caller,
        request: m::DeleteExchangeRequest,
    ) -> Result<m::DeleteExchangeResponse, Status> {
        authorize(
            caller,
            &[Need::configure(&request.vhost, "exchange", &request.name)],
        )?;
        answer(self.engine.delete_exchange(request).await)
    }

    pub(crate) async fn list_exchanges(
        &self,
        caller: &Caller,
        request: m::ListExchangesRequest,
    ) -> Result<m::ListExchangesResponse, Status> {
        authorize(
            caller,
            &[Need::See {
                vhost: &request.vhost,
            }],
        )?;
        answer(self.engine.list_exchanges(request).await)
    }

    pub(crate) async fn get_exchange(
        &self,
        caller: &Caller,
        request: m::GetExchangeRequest,
    ) -> Result<m::Exchange, Status> {
        let m::GetExchangeRequest { vhost, name } = request;
        authorize(caller, &[Need::See { vhost: &vhost }])?;
        let list = self
            .engine
            .list_exchanges(m::ListExchangesRequest {
                vhost: vhost.clone(),
            })
            .await?;
        list.exchanges
            .into_iter()
            .find(|exchange| exchange.name == name)
            .ok_or_else(|| not_found("exchange", &name, &vhost))
    }
}
