//! Queues: declared, listed (a chunk at a time, `walk.rs`), looked up alone,
//! deleted, purged, and their flow-control limits changed at runtime.

use std::collections::HashMap;

use amq_protocol_types::{AMQPValue, FieldTable};
use spillway_amqp as amqp;
use spillway_proto::engine as pb;
use spillway_proto::management as m;
use spillway_proto::storage::{self as store, write_op};
use spillway_proto::ServiceError;

use super::common::{argument_map, check_name, encode_arguments, not_found, ok, vhost, CHANNEL};
use crate::broker::{Broker, RUNTIME_ARGUMENTS};
use crate::engine::Engine;
use crate::persistence::store_op;
use crate::queue::Queue;
use crate::walk::walk_queues;

impl Engine {
    /// One queue: one lookup, and its unacknowledged deliveries counted on
    /// the vhost's channels. No other queue is looked at.
    fn queue_info(&self, vhost_name: &str, name: &str) -> Result<m::Queue, ServiceError> {
        let broker = self.shared.broker.lock();
        let queue = vhost(&broker, vhost_name)?
            .queues
            .get(name)
            .ok_or_else(|| not_found("queue", name, vhost_name))?;
        let unacked = unacked_by_queue(&broker, vhost_name, Some(name))
            .get(name)
            .copied()
            .unwrap_or_default();
        Ok(queue_view(vhost_name, queue, unacked))
    }

    pub(crate) async fn create_queue(
        &self,
        request: m::CreateQueueRequest,
    ) -> Result<m::Queue, ServiceError> {
        check_name("queue", &request.name)?;
        let arguments = encode_arguments(&request.arguments)?;
        self.with_session(&request.vhost, |broker, session| {
            ok(broker.declare_queue(
                session,
                &pb::QueueDeclare {
                    request_id: 0,
                    channel: CHANNEL,
                    queue: request.name.clone(),
                    passive: false,
                    durable: request.durable,
                    exclusive: false,
                    auto_delete: request.auto_delete,
                    arguments,
                },
            ))
        })?;
        self.queue_info(&request.vhost, &request.name)
    }

    /// Every queue of the vhost, in name order, built a chunk at a time
    /// ([`walk_queues`]).
    pub(crate) async fn list_queues(
        &self,
        request: m::ListQueuesRequest,
    ) -> Result<m::ListQueuesResponse, ServiceError> {
        let unacked = {
            let broker = self.shared.broker.lock();
            vhost(&broker, &request.vhost)?;
            unacked_by_queue(&broker, &request.vhost, None)
        };
        let mut queues = Vec::new();
        walk_queues(&self.shared, &request.vhost, |_, queue| {
            let unacked = unacked.get(queue.name.as_str()).copied();
            queues.push(queue_view(
                &request.vhost,
                queue,
                unacked.unwrap_or_default(),
            ));
        })
        .await?;
        Ok(m::ListQueuesResponse { queues })
    }

    pub(crate) async fn get_queue(
        &self,
        request: m::GetQueueRequest,
    ) -> Result<m::Queue, ServiceError> {
        self.queue_info(&request.vhost, &request.name)
    }

    pub(crate) async fn delete_queue(
        &self,
        request: m::DeleteQueueRequest,
    ) -> Result<m::DeleteQueueResponse, ServiceError> {
        let deleted = self.with_session(&request.vhost, |broker, session| {
            if !vhost(broker, &request.vhost)?
                .queues
                .contains_key(&request.name)
            {
                return Err(not_found("queue", &request.name, &request.vhost));
            }
            ok(broker.delete_queue(
                session,
                &pb::QueueDelete {
                    request_id: 0,
                    channel: CHANNEL,
                    queue: request.name.clone(),
                    if_unused: request.if_unused,
                    if_empty: request.if_empty,
                },
            ))
        })?;
        Ok(m::DeleteQueueResponse {
            messages_deleted: u64::from(deleted),
        })
    }

    pub(crate) async fn purge_queue(
        &self,
        request: m::PurgeQueueRequest,
    ) -> Result<m::PurgeQueueResponse, ServiceError> {
        let purged = self.with_session(&request.vhost, |broker, session| {
            ok(broker.purge_queue(
                session,
                &pb::QueuePurge {
                    request_id: 0,
                    channel: CHANNEL,
                    queue: request.name.clone(),
                },
            ))
        })?;
        tracing::info!(vhost = %request.vhost, queue = %request.name, purged, "queue purged by management");
        Ok(m::PurgeQueueResponse {
            messages_purged: u64::from(purged),
        })
    }

    /// Changes a queue's producer flow-control limits, in its arguments too
    /// (so a durable queue keeps them across restarts). A queue now under
    /// its resume capacity releases its producers at once; one now over its
    /// capacity blocks them at their next publish.
    pub(crate) async fn update_queue(
        &self,
        request: m::UpdateQueueRequest,
    ) -> Result<m::UpdateQueueResponse, ServiceError> {
        let mut broker = self.shared.broker.lock();
        let queue = broker
            .vhosts
            .get_mut(&request.vhost)
            .ok_or_else(|| not_found("vhost", &request.vhost, &request.vhost))?
            .queues
            .get_mut(&request.name)
            .ok_or_else(|| not_found("queue", &request.name, &request.vhost))?;
        let mut limits = queue.limits;
        if let Some(capacity) = request.capacity {
            limits.capacity = (capacity > 0).then_some(capacity);
            if request.resume_capacity.is_none() {
                limits.resume_capacity = limits.capacity;
            }
        }
        if let Some(resume) = request.resume_capacity {
            limits.resume_capacity = Some(resume);
        }
        if let Some(max_count) = request.max_count {
            limits.max_count = (max_count > 0).then_some(max_count);
        }
        match (limits.capacity, limits.resume_capacity) {
            (Some(capacity), Some(resume)) if resume > capacity => {
                return Err(ServiceError::FailedPrecondition(format!(
                    "resume capacity {resume} exceeds capacity {capacity}"
                )));
            }
            (None, _) => limits.resume_capacity = None,
            _ => {}
        }
        queue.limits = limits;
        let mut table = FieldTable::default();
        for (key, value) in queue.arguments.inner() {
            if !RUNTIME_ARGUMENTS.contains(&key.as_str()) {
                table.insert(key.clone(), value.clone());
            }
        }
        let long = |v: u64| AMQPValue::LongLongInt(i64::try_from(v).unwrap_or(i64::MAX));
        if let Some(capacity) = limits.capacity {
            table.insert("x-qpid-capacity".into(), long(capacity));
        }
        if let (Some(_), Some(resume)) = (limits.capacity, limits.resume_capacity) {
            table.insert("x-qpid-flow-resume-capacity".into(), long(resume));
        }
        if let Some(max_count) = limits.max_count {
            table.insert("qpid.max_count".into(), long(max_count));
        }
        queue.arguments = table;
        if queue.stores_messages() {
            let definition = store::QueueDefinition {
                vhost: request.vhost.clone(),
                name: request.name.clone(),
                auto_delete: queue.auto_delete,
                arguments: amqp::encode_table(&queue.arguments),
            };
            self.shared
                .writer
                .submit_synced(vec![store_op(write_op::Op::PutQueue(definition))], None);
        }
        // A policy's keys combine with the new arguments (an operator
        // policy's capacity stays a ceiling).
        broker.apply_policies_to_queue(&request.vhost, &request.name);
        tracing::info!(
            vhost = %request.vhost,
            queue = %request.name,
            capacity = ?limits.capacity,
            resume_capacity = ?limits.resume_capacity,
            max_count = ?limits.max_count,
            "queue flow-control limits changed"
        );
        broker.check_underfull(&request.vhost, &request.name);
        Ok(m::UpdateQueueResponse {})
    }
}

/// One queue as management shows it, with `unacked` deliveries of it
/// counted by the caller.
fn queue_view(vhost: &str, queue: &Queue, unacked: u64) -> m::Queue {
    #[cfg(test)]
    crate::walk::hooks::count_queue_view();
    m::Queue {
        vhost: vhost.to_string(),
        name: queue.name.clone(),
        durable: queue.durable,
        auto_delete: queue.auto_delete,
        exclusive: queue.exclusive_owner.is_some(),
        arguments: argument_map(&queue.arguments),
        policy: queue.policy.clone().unwrap_or_default(),
        operator_policy: queue.operator_policy.clone().unwrap_or_default(),
        effective_arguments: argument_map(
            queue
                .effective_arguments
                .as_ref()
                .unwrap_or(&queue.arguments),
        ),
        status: Some(m::QueueStatus {
            messages: queue.messages.len() as u64,
            unacked,
            consumers: queue.consumers.len() as u64,
            bytes: queue.ready_bytes,
            resident_bytes: queue.resident_bytes,
            spilled_messages: queue.spilled_count,
            spilled_bytes: queue.spilled_bytes,
            overfull: queue.overfull,
            blocked_channels: queue.blocked_channels.len() as u32,
            recovering: queue.recovering,
            arrived_total: queue.arrived_total,
            delivered_total: queue.delivered_total,
            active_consumer: queue
                .consumers
                .first()
                .filter(|_| queue.single_active_consumer)
                .map(|c| c.tag.clone())
                .unwrap_or_default(),
        }),
    }
}

/// Unacknowledged deliveries per queue of `vhost_name` (of the queue `only`
/// when given), counted on the vhost's channels a run at a time: a pass
/// over deliveries, not over queues.
fn unacked_by_queue(broker: &Broker, vhost_name: &str, only: Option<&str>) -> HashMap<String, u64> {
    let mut counts: HashMap<String, u64> = HashMap::new();
    for session in broker.sessions.values().filter(|s| s.vhost == vhost_name) {
        for channel in session.channels.values() {
            channel.unacked_runs(|queue, count| {
                if only.is_some_and(|only| only != queue) {
                    return;
                }
                match counts.get_mut(queue) {
                    Some(total) => *total += count,
                    None => {
                        counts.insert(queue.to_string(), count);
                    }
                }
            });
        }
    }
    counts
}
