//! Read-only figures about the engine's queues, taken under the broker lock
//! at the moment they are asked for, and the `/metrics` collector built on
//! them. Nothing here changes the broker or is kept between scrapes, so a
//! deleted queue is simply absent from the next scrape.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use spillway_telemetry::prometheus_client::collector::Collector;
use spillway_telemetry::prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use spillway_telemetry::prometheus_client::metrics::gauge::ConstGauge;
use spillway_telemetry::prometheus_client::metrics::MetricType;
use spillway_telemetry::Metrics;

use crate::session::{Engine, Shared};

/// One queue's figures at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    pub vhost: String,
    pub queue: String,
    /// Ready messages: queued, not delivered to anyone.
    pub messages: u64,
    /// Messages delivered (to a consumer or basic.get) and not yet settled.
    pub unacked: u64,
    pub consumers: u64,
    /// Body plus encoded properties of the ready messages, in bytes.
    pub bytes: u64,
}

impl Engine {
    /// Every queue of every vhost, sorted by vhost then name.
    ///
    /// Holds the broker lock for one pass over the sessions' unacked
    /// deliveries and the queues' ready messages.
    pub fn queue_stats(&self) -> Vec<QueueStats> {
        let broker = self.shared.broker.lock();
        let mut unacked: HashMap<(&str, &str), u64> = HashMap::new();
        for session in broker.sessions.values() {
            for channel in session.channels.values() {
                for delivery in channel.unacked.values() {
                    *unacked
                        .entry((session.vhost.as_str(), delivery.queue.as_str()))
                        .or_default() += 1;
                }
            }
        }
        let mut stats: Vec<QueueStats> = broker
            .vhosts
            .values()
            .flat_map(|vhost| {
                let unacked = &unacked;
                vhost.queues.values().map(move |queue| QueueStats {
                    vhost: vhost.name.clone(),
                    queue: queue.name.clone(),
                    messages: queue.messages.len() as u64,
                    unacked: unacked
                        .get(&(vhost.name.as_str(), queue.name.as_str()))
                        .copied()
                        .unwrap_or_default(),
                    consumers: queue.consumers.len() as u64,
                    bytes: queue
                        .messages
                        .iter()
                        .map(|m| (m.message.body.len() + m.message.properties.len()) as u64)
                        .sum(),
                })
            })
            .collect();
        drop(broker);
        stats.sort_by(|a, b| (&a.vhost, &a.queue).cmp(&(&b.vhost, &b.queue)));
        stats
    }

    /// Adds the per-queue gauges to `metrics`, read on every scrape. The
    /// registry does not keep the engine alive: once it is gone, so are they.
    pub fn register_metrics(&self, metrics: &Metrics) {
        metrics.register_collector(QueueCollector {
            engine: Arc::downgrade(&self.shared),
        });
    }
}

/// Name, help, and the figure of each per-queue gauge.
type QueueGauge = (&'static str, &'static str, fn(&QueueStats) -> u64);

const QUEUE_GAUGES: [QueueGauge; 4] = [
    (
        "spillway_queue_messages",
        "Ready messages in the queue (not delivered to anyone)",
        |q| q.messages,
    ),
    (
        "spillway_queue_unacked_messages",
        "Messages delivered from the queue and not yet acknowledged",
        |q| q.unacked,
    ),
    ("spillway_queue_consumers", "Consumers on the queue", |q| {
        q.consumers
    }),
    (
        "spillway_queue_bytes",
        "Body plus property bytes of the queue's ready messages",
        |q| q.bytes,
    ),
];

struct QueueCollector {
    engine: Weak<Shared>,
}

impl std::fmt::Debug for QueueCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueCollector").finish_non_exhaustive()
    }
}

impl Collector for QueueCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(shared) = self.engine.upgrade() else {
            return Ok(());
        };
        let stats = Engine { shared }.queue_stats();
        for (name, help, figure) in QUEUE_GAUGES {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for queue in &stats {
                let labels = [
                    ("vhost", queue.vhost.as_str()),
                    ("queue", queue.queue.as_str()),
                ];
                ConstGauge::new(figure(queue)).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use async_trait::async_trait;
    use bytes::Bytes;
    use spillway_proto::engine::{self as pb, session_command::Command, session_event::Event};
    use spillway_proto::storage::{Definitions, StoreStatus, StoredMessage, WriteBatch};
    use spillway_proto::{EngineApi, ServiceError, SessionStreams, StorageApi};

    use super::*;
    use crate::EngineConfig;

    /// A store with nothing in it that accepts every write.
    struct EmptyStore;

    #[async_trait]
    impl StorageApi for EmptyStore {
        async fn write(&self, _batch: Arc<WriteBatch>) -> Result<(), ServiceError> {
            Ok(())
        }
        async fn load_definitions(&self) -> Result<Definitions, ServiceError> {
            Ok(Definitions::default())
        }
        async fn load_messages(
            &self,
            _vhost: &str,
            _queue: &str,
        ) -> Result<Vec<StoredMessage>, ServiceError> {
            Ok(Vec::new())
        }
        async fn status(&self) -> Result<StoreStatus, ServiceError> {
            Ok(StoreStatus::default())
        }
    }

    async fn send(session: &SessionStreams, command: Command) {
        let command = pb::SessionCommand {
            command: Some(command),
        };
        session.commands.send(command).await.unwrap();
    }

    /// Sends a request and waits for its reply: everything sent before it
    /// has been applied by then.
    async fn round_trip(session: &mut SessionStreams, request_id: u64) {
        send(
            session,
            Command::QueueDeclare(pb::QueueDeclare {
                request_id,
                channel: 1,
                queue: "sync".into(),
                ..Default::default()
            }),
        )
        .await;
        while let Some(event) = session.events.recv().await {
            if let Some(Event::Reply(reply)) = event.event {
                if reply.request_id == request_id {
                    return;
                }
            }
        }
        panic!("session ended");
    }

    fn publish(queue: &str, body: &'static [u8]) -> Command {
        Command::Publish(pb::Publish {
            channel: 1,
            routing_key: queue.into(),
            properties: Bytes::from_static(&[0, 0]),
            body: Bytes::from_static(body),
            ..Default::default()
        })
    }

    fn find<'a>(stats: &'a [QueueStats], queue: &str) -> Option<&'a QueueStats> {
        stats.iter().find(|s| s.vhost == "/" && s.queue == queue)
    }

    #[tokio::test]
    async fn counts_ready_unacked_consumers_and_bytes() {
        let engine = Engine::start(Arc::new(EmptyStore), EngineConfig::default())
            .await
            .unwrap();
        let mut session = engine.open_session().await.unwrap();
        send(
            &session,
            Command::Open(pb::OpenSession {
                request_id: 1,
                vhost: "/".into(),
                user: "guest".into(),
                ..Default::default()
            }),
        )
        .await;
        send(
            &session,
            Command::ChannelOpen(pb::ChannelOpen {
                request_id: 2,
                channel: 1,
            }),
        )
        .await;
        for (request_id, queue) in [(3, "work"), (4, "idle")] {
            send(
                &session,
                Command::QueueDeclare(pb::QueueDeclare {
                    request_id,
                    channel: 1,
                    queue: queue.into(),
                    ..Default::default()
                }),
            )
            .await;
        }
        for body in [&b"one"[..], b"two", b"three"] {
            send(&session, publish("work", body)).await;
        }
        send(
            &session,
            Command::Get(pb::Get {
                request_id: 5,
                channel: 1,
                queue: "work".into(),
                no_ack: false,
            }),
        )
        .await;
        send(
            &session,
            Command::Consume(pb::Consume {
                request_id: 6,
                channel: 1,
                queue: "idle".into(),
                ..Default::default()
            }),
        )
        .await;
        round_trip(&mut session, 7).await;

        let stats = engine.queue_stats();
        assert_eq!(
            find(&stats, "work"),
            Some(&QueueStats {
                vhost: "/".into(),
                queue: "work".into(),
                messages: 2,
                unacked: 1,
                consumers: 0,
                // "two" and "three", each with two property bytes.
                bytes: 3 + 5 + 2 * 2,
            })
        );
        let idle = find(&stats, "idle").unwrap();
        assert_eq!((idle.messages, idle.unacked, idle.consumers), (0, 0, 1));

        let metrics = Metrics::new();
        engine.register_metrics(&metrics);
        let text = metrics.encode().unwrap();
        for line in [
            "spillway_queue_messages{vhost=\"/\",queue=\"work\"} 2\n",
            "spillway_queue_unacked_messages{vhost=\"/\",queue=\"work\"} 1\n",
            "spillway_queue_consumers{vhost=\"/\",queue=\"idle\"} 1\n",
            "spillway_queue_bytes{vhost=\"/\",queue=\"work\"} 12\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }

        send(
            &session,
            Command::QueueDelete(pb::QueueDelete {
                request_id: 8,
                channel: 1,
                queue: "work".into(),
                ..Default::default()
            }),
        )
        .await;
        round_trip(&mut session, 9).await;
        assert_eq!(find(&engine.queue_stats(), "work"), None);
        assert!(!metrics.encode().unwrap().contains("queue=\"work\""));
    }
}
