//! Definitions (RabbitMQ's export and import format): the administrator's.

use spillway_proto::management as m;
use tonic::Status;

use super::answer;
use crate::authorize::{authorize, Need};
use crate::{Caller, ManagementService};

impl ManagementService {
    pub(crate) async fn export_definitions(
        &self,
        caller: &Caller,
        request: m::ExportDefinitionsRequest,
    ) -> Result<m::Definitions, Status> {
        authorize(caller, &[Need::Administrator])?;
        answer(self.engine.export_definitions(request).await)
    }

    pub(crate) async fn import_definitions(
        &self,
        caller: &Caller,
        request: m::ImportDefinitionsRequest,
    ) -> Result<m::ImportDefinitionsResponse, Status> {
        authorize(caller, &[Need::Administrator])?;
        answer(self.engine.import_definitions(request).await)
    }
}
