//! Connections, channels and consumers as management lists them, and a
//! connection closed on request.

use std::collections::HashMap;

use spillway_proto::engine::{self as pb, session_event::Event};
use spillway_proto::management as m;
use spillway_proto::ServiceError;

use super::common::{decoded_map, vhost};
use crate::broker::{event, Broker};
use crate::engine::Engine;
use crate::model::SessionId;
use crate::walk::walk_queues;

impl Engine {
    /// Closes every client connection of `vhost` with `reason`.
    pub(super) fn close_connections(
        broker: &Broker,
        vhost: Option<&str>,
        id: Option<SessionId>,
        reason: &str,
    ) -> usize {
        let mut closed = 0;
        for (session_id, session) in &broker.sessions {
            let matches =
                vhost.is_none_or(|v| session.vhost == v) && id.is_none_or(|i| i == *session_id);
            if matches {
                let _ = session
                    .events
                    .send(event(Event::ConnectionClose(pb::ConnectionClose {
                        reason: reason.to_string(),
                        reply_code: 0,
                    })));
                closed += 1;
            }
        }
        closed
    }

    pub(crate) async fn list_connections(
        &self,
        request: m::ListConnectionsRequest,
    ) -> Result<m::ListConnectionsResponse, ServiceError> {
        let broker = self.shared.broker.lock();
        let mut connections: Vec<m::Connection> = broker
            .sessions
            .iter()
            .filter(|(_, s)| request.vhost.is_empty() || s.vhost == request.vhost)
            .map(|(id, s)| m::Connection {
                id: *id,
                client_address: s.client_address.clone(),
                user: s.user.clone(),
                vhost: s.vhost.clone(),
                client_properties: decoded_map(&s.client_properties),
                channels: s.channels.len() as u32,
                messages_published: s.published,
                messages_delivered: s.delivered,
            })
            .collect();
        connections.sort_by_key(|c| c.id);
        Ok(m::ListConnectionsResponse { connections })
    }

    pub(crate) async fn list_channels(
        &self,
        request: m::ListChannelsRequest,
    ) -> Result<m::ListChannelsResponse, ServiceError> {
        let broker = self.shared.broker.lock();
        let blocked: HashMap<(u64, u32), crate::broker::producer_flow::BlockedChannel> = broker
            .blocked_channels()
            .into_iter()
            .map(|b| ((b.session, b.channel), b))
            .collect();
        let blocked = &blocked;
        let mut channels: Vec<m::Channel> = broker
            .sessions
            .iter()
            .filter(|(_, s)| request.vhost.is_empty() || s.vhost == request.vhost)
            .filter(|(id, _)| request.connection_id == 0 || **id == request.connection_id)
            .flat_map(|(id, s)| {
                s.channels.iter().map(move |(number, channel)| {
                    let held = blocked.get(&(*id, *number));
                    m::Channel {
                        connection_id: *id,
                        number: *number,
                        client_address: s.client_address.clone(),
                        user: s.user.clone(),
                        vhost: s.vhost.clone(),
                        consumers: channel.consumers.len() as u32,
                        unacked: channel.unacked.len() as u64,
                        prefetch_count: channel.consumer_prefetch.max(channel.channel_prefetch),
                        confirm: channel.confirm,
                        blocked: held.is_some(),
                        blocked_reason: held.map(blocked_reason).unwrap_or_default(),
                        blocked_ms: held.map_or(0, |b| b.blocked_for.as_millis() as u64),
                        amqp1_link: channel.amqp1_link.clone(),
                    }
                })
            })
            .collect();
        channels.sort_by_key(|c| (c.connection_id, c.number));
        Ok(m::ListChannelsResponse { channels })
    }

    pub(crate) async fn list_consumers(
        &self,
        request: m::ListConsumersRequest,
    ) -> Result<m::ListConsumersResponse, ServiceError> {
        let names: Vec<String> = {
            let broker = self.shared.broker.lock();
            if request.vhost.is_empty() {
                broker.vhosts.keys().cloned().collect()
            } else {
                vec![vhost(&broker, &request.vhost)?.name.clone()]
            }
        };
        let mut consumers = Vec::new();
        for vhost_name in &names {
            // Every queue is looked at, a chunk at a time; a vhost deleted
            // meanwhile has none left.
            let _ = walk_queues(&self.shared, vhost_name, |broker, queue| {
                for (position, consumer) in queue.consumers.iter().enumerate() {
                    let Some(session) = broker.sessions.get(&consumer.session) else {
                        continue;
                    };
                    let Some(on_channel) = session
                        .channels
                        .get(&consumer.channel)
                        .and_then(|channel| channel.consumers.get(&consumer.tag))
                    else {
                        continue;
                    };
                    consumers.push(m::Consumer {
                        vhost: vhost_name.clone(),
                        queue: queue.name.clone(),
                        consumer_tag: consumer.tag.clone(),
                        connection_id: consumer.session,
                        channel: consumer.channel,
                        client_address: session.client_address.clone(),
                        user: session.user.clone(),
                        ack_required: !on_channel.no_ack,
                        prefetch_count: on_channel.prefetch,
                        unacked: on_channel.unacked,
                        priority: consumer.priority,
                        // A single-active-consumer queue delivers to its first.
                        active: !queue.single_active_consumer || position == 0,
                        exclusive: queue.exclusive_consumer,
                    });
                }
            })
            .await;
        }
        consumers.sort_by(|a, b| (&a.vhost, &a.queue).cmp(&(&b.vhost, &b.queue)));
        Ok(m::ListConsumersResponse { consumers })
    }

    pub(crate) async fn close_connection(
        &self,
        request: m::CloseConnectionRequest,
    ) -> Result<m::CloseConnectionResponse, ServiceError> {
        let reason = if request.reason.is_empty() {
            "closed by management".to_string()
        } else {
            request.reason
        };
        let broker = self.shared.broker.lock();
        if Engine::close_connections(&broker, None, Some(request.id), &reason) == 0 {
            return Err(ServiceError::NotFound(format!(
                "no connection {}",
                request.id
            )));
        }
        tracing::info!(connection = request.id, %reason, "connection closed by management");
        Ok(m::CloseConnectionResponse {})
    }
}

fn blocked_reason(blocked: &crate::broker::producer_flow::BlockedChannel) -> String {
    let mut reasons: Vec<String> = blocked
        .queues
        .iter()
        .map(|q| format!("queue '{q}' is overfull"))
        .collect();
    if blocked.store_overfull {
        reasons.push("store overfull".to_string());
    }
    if blocked.memory_alarm {
        reasons.push("memory high watermark reached".to_string());
    }
    reasons.join(", ")
}
