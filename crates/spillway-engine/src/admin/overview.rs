//! The broker as a whole: its status and totals (read a chunk of queues at
//! a time) and its runtime settings, which take effect at once and are
//! logged (here, and by management with who asked).

use std::collections::HashMap;

use spillway_proto::management as m;
use spillway_proto::ServiceError;

use crate::broker::Broker;
use crate::engine::Engine;
use crate::queue::Queue;
use crate::walk::walk_queues;

impl Engine {
    pub(crate) async fn get_broker_status(
        &self,
        _request: m::GetBrokerStatusRequest,
    ) -> Result<m::BrokerStatus, ServiceError> {
        // Every queue's figures, a chunk at a time; then the rest at once.
        let names: Vec<String> = self.shared.broker.lock().vhosts.keys().cloned().collect();
        let mut totals = QueueTotals::default();
        for name in &names {
            // A vhost deleted meanwhile adds nothing.
            let _ = walk_queues(&self.shared, name, |_, queue| totals.add(queue)).await;
        }
        let broker = self.shared.broker.lock();
        let connections = broker.sessions.len() as u32;
        let channels: usize = broker.sessions.values().map(|s| s.channels.len()).sum();
        let unacked: u64 = unacked_by_vhost(&broker).values().sum();
        let flow = broker.flow_status();
        Ok(m::BrokerStatus {
            flow_to_disk_threshold: Some(flow.threshold_bytes),
            flow_to_disk_active: Some(flow.active),
            resident_message_bytes: Some(flow.resident_bytes),
            spilled_messages: flow.spilled_messages,
            spilled_bytes: flow.spilled_bytes,
            store_overfull: broker.alarms.store_overfull(),
            blocked_channels: broker.blocked_channels().len() as u32,
            version: env!("CARGO_PKG_VERSION").to_string(),
            vhosts: broker.vhosts.len() as u32,
            queues: totals.queues,
            messages_ready: totals.messages,
            messages_unacked: unacked,
            message_bytes: totals.bytes,
            consumers: totals.consumers,
            connections,
            channels: channels as u32,
            recovery: Some(crate::broker::recovery::status(&broker.recovery)),
            ..Default::default()
        })
    }

    pub(crate) async fn set_broker_settings(
        &self,
        request: m::SetBrokerSettingsRequest,
    ) -> Result<m::SetBrokerSettingsResponse, ServiceError> {
        if let Some(threshold) = request.flow_to_disk_threshold {
            if threshold == 0 {
                return Err(ServiceError::InvalidArgument(
                    "flow_to_disk_threshold must be above 0".into(),
                ));
            }
            self.set_flow_to_disk_threshold(threshold);
        }
        Ok(m::SetBrokerSettingsResponse {})
    }
}

/// Unacknowledged deliveries per vhost, of queues that still exist (a
/// deleted queue's deliveries stay on their channels until settled, and
/// no queue list counts them).
pub(super) fn unacked_by_vhost(broker: &Broker) -> HashMap<String, u64> {
    let mut counts: HashMap<String, u64> = HashMap::new();
    for session in broker.sessions.values() {
        let Some(vhost) = broker.vhosts.get(&session.vhost) else {
            continue;
        };
        let mut held = 0u64;
        for channel in session.channels.values() {
            channel.unacked_runs(|queue, count| {
                if vhost.queues.contains_key(queue) {
                    held += count;
                }
            });
        }
        *counts.entry(session.vhost.clone()).or_default() += held;
    }
    counts
}

/// The broker status's figures summed over queues.
#[derive(Default)]
struct QueueTotals {
    queues: u32,
    messages: u64,
    bytes: u64,
    consumers: u32,
}

impl QueueTotals {
    fn add(&mut self, queue: &Queue) {
        self.queues += 1;
        self.messages += queue.messages.len() as u64;
        self.bytes += queue.ready_bytes;
        self.consumers += queue.consumers.len() as u32;
    }
}
