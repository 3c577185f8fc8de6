//! Vhost and user limits, set, cleared and listed (their rules live in
//! `broker/limits.rs`).

use spillway_proto::management as m;
use spillway_proto::ServiceError;

use crate::engine::Engine;

impl Engine {
    pub(crate) async fn set_limits(
        &self,
        request: m::SetLimitsRequest,
    ) -> Result<m::Limits, ServiceError> {
        crate::broker::limits::set(&mut self.shared.broker.lock(), &request)
    }

    pub(crate) async fn clear_limits(
        &self,
        request: m::ClearLimitsRequest,
    ) -> Result<m::ClearLimitsResponse, ServiceError> {
        crate::broker::limits::clear(&mut self.shared.broker.lock(), &request)?;
        Ok(m::ClearLimitsResponse {})
    }

    pub(crate) async fn list_limits(
        &self,
        _request: m::ListLimitsRequest,
    ) -> Result<m::ListLimitsResponse, ServiceError> {
        Ok(crate::broker::limits::list(&self.shared.broker.lock()))
    }
}
