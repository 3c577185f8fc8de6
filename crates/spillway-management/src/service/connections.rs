//! Connections, their channels and consumers: lists of what the caller
//! sees, and closing a connection.

use spillway_proto::management as m;
use tonic::Status;

use crate::authorize::{self, authorize, Need};
use crate::{Caller, ManagementService};

impl ManagementService {
    /// Every connection to a monitoring user or an administrator, a user's
    /// own to others.
    pub(crate) async fn list_connections(
        &self,
        caller: &Caller,
        request: m::ListConnectionsRequest,
    ) -> Result<m::ListConnectionsResponse, Status> {
        authorize(caller, &[Need::Overview])?;
        let mut list = self.engine.list_connections(request).await?;
        list.connections
            .retain(|connection| authorize::sees_connections_of(caller, &connection.user));
        Ok(list)
    }

    /// An administrator may close any connection, others only their own
    /// (as in RabbitMQ).
    pub(crate) async fn close_connection(
        &self,
        caller: &Caller,
        request: m::CloseConnectionRequest,
    ) -> Result<m::CloseConnectionResponse, Status> {
        if authorize(caller, &[Need::Administrator]).is_err() {
            authorize(caller, &[Need::Overview])?;
            let connections = self
                .engine
                .list_connections(m::ListConnectionsRequest::default())
                .await?;
            let own = connections
                .connections
                .iter()
                .any(|connection| connection.id == request.id && connection.user == caller.name());
            if !own {
                return Err(Status::permission_denied(format!(
                    "user '{}' may only close its own connections",
                    caller.name()
                )));
            }
        }
        let id = request.id;
        let response = self.engine.close_connection(request).await?;
        tracing::info!(
            connection = id,
            by = caller.name(),
            "connection closed by management"
        );
        Ok(response)
    }

    pub(crate) async fn list_channels(
        &self,
        caller: &Caller,
        request: m::ListChannelsRequest,
    ) -> Result<m::ListChannelsResponse, Status> {
        authorize(caller, &[Need::Overview])?;
        let mut list = self.engine.list_channels(request).await?;
        list.channels
            .retain(|channel| authorize::sees_connections_of(caller, &channel.user));
        Ok(list)
    }

    /// Consumers of the vhosts the caller sees.
    pub(crate) async fn list_consumers(
        &self,
        caller: &Caller,
        request: m::ListConsumersRequest,
    ) -> Result<m::ListConsumersResponse, Status> {
        if request.vhost.is_empty() {
            authorize(caller, &[Need::Overview])?;
        } else {
            authorize(
                caller,
                &[Need::See {
                    vhost: &request.vhost,
                }],
            )?;
        }
        let mut list = self.engine.list_consumers(request).await?;
        list.consumers
            .retain(|consumer| authorize::sees_vhost(caller, &consumer.vhost));
        Ok(list)
    }
}
