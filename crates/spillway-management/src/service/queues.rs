//! Queues: declare (with what its dead-letter arguments need), delete,
//! purge, list, one, and a queue's settings changed in place.

use std::collections::HashMap;

use spillway_proto::management as m;
use spillway_proto::permissions::dead_letter_requirements;
use tonic::Status;

use super::answer;
use crate::authorize::{authorize, Need};
use crate::{Caller, ManagementService};

impl ManagementService {
    /// Configure on the queue, and what its dead-letter arguments need (as
    /// `queue.declare` over AMQP).
    pub(crate) async fn create_queue(
        &self,
        caller: &Caller,
        request: m::CreateQueueRequest,
    ) -> Result<m::Queue, Status> {
        let extra = dead_letter_requirements(
            &request.name,
            string_argument(&request.arguments, "x-dead-letter-exchange"),
            qpid_dlq_enabled(&request.arguments),
        );
        authorize(
            caller,
            &Need::declare(&request.vhost, "queue", &request.name, &extra),
        )?;
        answer(self.engine.create_queue(request).await)
    }

    pub(crate) async fn delete_queue(
        &self,
        caller: &Caller,
        request: m::DeleteQueueRequest,
    ) -> Result<m::DeleteQueueResponse, Status> {
        authorize(
            caller,
            &[Need::configure(&request.vhost, "queue", &request.name)],
        )?;
        answer(self.engine.delete_queue(request).await)
    }

    pub(crate) async fn purge_queue(
        &self,
        caller: &Caller,
        request: m::PurgeQueueRequest,
    ) -> Result<m::PurgeQueueResponse, Status> {
        authorize(caller, &[Need::read_queue(&request.vhost, &request.name)])?;
        answer(self.engine.purge_queue(request).await)
    }

    pub(crate) async fn list_queues(
        &self,
        caller: &Caller,
        request: m::ListQueuesRequest,
    ) -> Result<m::ListQueuesResponse, Status> {
        authorize(
            caller,
            &[Need::See {
                vhost: &request.vhost,
            }],
        )?;
        answer(self.engine.list_queues(request).await)
    }

    /// One lookup in the engine, not a list of the vhost's queues.
    pub(crate) async fn get_queue(
        &self,
        caller: &Caller,
        request: m::GetQueueRequest,
    ) -> Result<m::Queue, Status> {
        authorize(
            caller,
            &[Need::See {
                vhost: &request.vhost,
            }],
        )?;
        answer(self.engine.get_queue(request).await)
    }

    /// A queue's settings (RabbitMQ's policies): the policymaker's.
    pub(crate) async fn update_queue(
        &self,
        caller: &Caller,
        request: m::UpdateQueueRequest,
    ) -> Result<m::UpdateQueueResponse, Status> {
        authorize(
            caller,
            &[Need::Policy {
                vhost: &request.vhost,
            }],
        )?;
        let logged = format!("{request:?}");
        let response = self.engine.update_queue(request).await?;
        tracing::info!(settings = %logged, "queue settings changed by management");
        Ok(response)
    }
}

/// A string argument of a management declare; other types are the
/// engine's to refuse.
pub(super) fn string_argument<'a>(
    arguments: &'a HashMap<String, m::ArgumentValue>,
    key: &str,
) -> Option<&'a str> {
    match arguments.get(key)?.value.as_ref()? {
        m::argument_value::Value::StringValue(text) | m::argument_value::Value::Text(text) => {
            Some(text)
        }
        _ => None,
    }
}

/// `x-qpid-dlq-enabled` as the engine reads it: true, or the string `true`.
fn qpid_dlq_enabled(arguments: &HashMap<String, m::ArgumentValue>) -> bool {
    match arguments
        .get("x-qpid-dlq-enabled")
        .and_then(|value| value.value.as_ref())
    {
        Some(m::argument_value::Value::BoolValue(enabled)) => *enabled,
        Some(m::argument_value::Value::StringValue(text)) => text == "true",
        _ => false,
    }
}
