//! A queue's messages: peek, get (RabbitMQ's "get messages", which may
//! take them), move to another queue, and publish through an exchange.

use spillway_proto::management as m;
use tonic::Status;

use super::answer;
use crate::authorize::{authorize, Need};
use crate::{Caller, ManagementService};

impl ManagementService {
    pub(crate) async fn peek_messages(
        &self,
        caller: &Caller,
        request: m::PeekMessagesRequest,
    ) -> Result<m::PeekMessagesResponse, Status> {
        authorize(caller, &[Need::read_queue(&request.vhost, &request.queue)])?;
        answer(self.engine.peek_messages(request).await)
    }

    pub(crate) async fn get_messages(
        &self,
        caller: &Caller,
        request: m::GetMessagesRequest,
    ) -> Result<m::PeekMessagesResponse, Status> {
        authorize(caller, &[Need::read_queue(&request.vhost, &request.queue)])?;
        answer(self.engine.get_messages(request).await)
    }

    /// Read on the source, write on the destination.
    pub(crate) async fn move_messages(
        &self,
        caller: &Caller,
        request: m::MoveMessagesRequest,
    ) -> Result<m::MoveMessagesResponse, Status> {
        authorize(
            caller,
            &[
                Need::read_queue(&request.vhost, &request.source),
                Need::write_queue(&request.vhost, &request.destination),
            ],
        )?;
        answer(self.engine.move_messages(request).await)
    }

    pub(crate) async fn publish_message(
        &self,
        caller: &Caller,
        request: m::PublishMessageRequest,
    ) -> Result<m::PublishMessageResponse, Status> {
        authorize(
            caller,
            &[Need::write_exchange(&request.vhost, &request.exchange)],
        )?;
        answer(self.engine.publish_message(request).await)
    }
}
