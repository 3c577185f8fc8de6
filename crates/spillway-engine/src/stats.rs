//! Read-only figures about the engine's queues and vhosts, taken under the
//! broker lock at the moment they are asked for, and the `/metrics`
//! collector built on them (with the engine's refusals by limit). Nothing here changes the broker or is kept between scrapes, so a
//! deleted queue is simply absent from the next scrape.

use foldhash::{HashMap, HashMapExt};
use std::sync::{Arc, Weak};

use spillway_telemetry::prometheus_client::collector::Collector;
use spillway_telemetry::prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use spillway_telemetry::prometheus_client::metrics::counter::ConstCounter;
use spillway_telemetry::prometheus_client::metrics::gauge::ConstGauge;
use spillway_telemetry::prometheus_client::metrics::MetricType;
use spillway_telemetry::Metrics;

use crate::broker::flow_to_disk::FlowStatus;
use crate::engine::Engine;
use crate::model::DeathReason;
use crate::shared::Shared;

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
    /// Body bytes of the ready messages, resident or on disk.
    pub bytes: u64,
    /// Accounted bytes of the ready messages whose payload is in memory.
    pub resident_bytes: u64,
    /// Ready messages whose payload is only on disk (flowed), and their
    /// body bytes.
    pub spilled_messages: u64,
    pub spilled_bytes: u64,
    /// Messages dead-lettered from the queue, and dropped for want of a
    /// dead-letter destination, by reason.
    pub dead_letters: crate::model::DeadLetterCounts,
}

impl Engine {
    /// Every queue of every vhost, sorted by vhost then name.
    ///
    /// Holds the broker lock for one pass over the sessions' unacked
    /// deliveries, then for each chunk of queues (`walk.rs`): a scrape of
    /// 100,000 queues does not hold up the message path for all of them.
    pub fn queue_stats(&self) -> Vec<QueueStats> {
        let (vhosts, unacked) = {
            let broker = self.shared.broker.lock();
            let mut vhosts: Vec<String> = broker.vhosts.keys().cloned().collect();
            vhosts.sort();
            (vhosts, unacked_counts(&broker))
        };
        let mut stats = Vec::new();
        for vhost in &vhosts {
            crate::walk::walk_queues_blocking(&self.shared, vhost, |_, queue| {
                stats.push(QueueStats {
                    vhost: vhost.clone(),
                    queue: queue.name.clone(),
                    messages: queue.messages.len() as u64,
                    unacked: unacked.get(vhost, &queue.name),
                    consumers: queue.consumers.len() as u64,
                    bytes: queue.ready_bytes,
                    resident_bytes: queue.resident_bytes,
                    spilled_messages: queue.spilled_count,
                    spilled_bytes: queue.spilled_bytes,
                    dead_letters: queue.dead_letter_counts,
                });
            });
        }
        stats
    }

    /// Publisher pacing's counts since the engine started.
    pub fn pacing_stats(&self) -> crate::pacing::PacingStats {
        self.shared.broker.lock().pacing_stats()
    }

    /// Open client connections per vhost (every vhost, 0 included).
    pub fn vhost_connections(&self) -> Vec<(String, u64)> {
        let broker = self.shared.broker.lock();
        let mut counts: HashMap<&str, u64> =
            broker.vhosts.keys().map(|v| (v.as_str(), 0)).collect();
        for session in broker.sessions.values() {
            *counts.entry(session.vhost.as_str()).or_default() += 1;
        }
        let mut counts: Vec<(String, u64)> = counts
            .into_iter()
            .map(|(vhost, count)| (vhost.to_string(), count))
            .collect();
        counts.sort();
        counts
    }

    /// Adds the per-queue and per-vhost gauges to `metrics`, read on every
    /// scrape, and the engine's refusals by limit. The registry does not
    /// keep the engine alive: once it is gone, so are the gauges.
    pub fn register_metrics(&self, metrics: &Metrics) {
        metrics.register_collector(QueueCollector {
            engine: Arc::downgrade(&self.shared),
        });
        let rabbitmq = |per_object| RabbitQueueCollector {
            engine: Arc::downgrade(&self.shared),
            per_object,
        };
        metrics.register_views(rabbitmq(false), rabbitmq(true));
        metrics.register_limit_refusals(self.shared.broker.lock().limits.refusals());
    }
}

/// Unacknowledged deliveries per (vhost, queue), counted on every channel
/// a run at a time ([`ChannelState::unacked_runs`]). The keys are owned: the
/// counts outlive the lock.
///
/// [`ChannelState::unacked_runs`]: crate::channels::ChannelState::unacked_runs
fn unacked_counts(broker: &crate::broker::Broker) -> UnackedCounts {
    let mut unacked: HashMap<(&str, &str), u64> = HashMap::new();
    for session in broker.sessions.values() {
        let vhost = session.vhost.as_str();
        for channel in session.channels.values() {
            channel.unacked_runs(|queue, count| {
                *unacked.entry((vhost, queue)).or_default() += count;
            });
        }
    }
    let mut owned = UnackedCounts::default();
    for ((vhost, queue), count) in unacked {
        owned
            .0
            .entry(vhost.to_string())
            .or_default()
            .insert(queue.to_string(), count);
    }
    owned
}

/// Unacknowledged deliveries by vhost, then queue.
#[derive(Default)]
struct UnackedCounts(HashMap<String, HashMap<String, u64>>);

impl UnackedCounts {
    fn get(&self, vhost: &str, queue: &str) -> u64 {
        self.0
            .get(vhost)
            .and_then(|queues| queues.get(queue))
            .copied()
            .unwrap_or_default()
    }
}

/// Name, help, and the figure of each per-queue gauge.
type QueueGauge = (&'static str, &'static str, fn(&QueueStats) -> u64);

const QUEUE_GAUGES: [QueueGauge; 7] = [
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
        "Body bytes of the queue's ready messages, in memory or on disk",
        |q| q.bytes,
    ),
    (
        "spillway_queue_resident_bytes",
        "Accounted bytes of the queue's ready messages whose payload is in memory",
        |q| q.resident_bytes,
    ),
    (
        "spillway_queue_spilled_messages",
        "Ready messages of the queue whose payload has flowed to disk",
        |q| q.spilled_messages,
    ),
    (
        "spillway_queue_spilled_bytes",
        "Body bytes of the queue's ready messages whose payload has flowed to disk",
        |q| q.spilled_bytes,
    ),
];

/// Name, help, and the figure of each broker-wide gauge.
type BrokerGauge = (&'static str, &'static str, fn(&FlowStatus) -> u64);

const BROKER_GAUGES: [BrokerGauge; 5] = [
    (
        "spillway_broker_bookkeeping_bytes",
        "Memory of queue entries and unacknowledged deliveries, resident or not, counted against the flow-to-disk threshold beside resident message bytes",
        |f| f.bookkeeping_bytes,
    ),
    (
        "spillway_broker_resident_message_bytes",
        "Message bytes in the engine's memory (payload, properties, per-message overhead), including payloads on their way to disk",
        |f| f.resident_bytes,
    ),
    (
        "spillway_broker_flow_to_disk_threshold_bytes",
        "Resident message bytes above which payloads flow to disk",
        |f| f.threshold_bytes,
    ),
    (
        "spillway_broker_flow_to_disk_active",
        "1 while flow to disk is active",
        |f| u64::from(f.active),
    ),
    (
        "spillway_broker_spill_in_flight_bytes",
        "Payload bytes handed to the storage node and not yet written",
        |f| f.in_flight_bytes,
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
        let engine = Engine { shared };
        let flow = engine.flow_status();
        for (name, help, figure) in BROKER_GAUGES {
            let family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(figure(&flow)).encode(family)?;
        }
        {
            let (writes, bytes) = engine.store_writer_queue();
            let gauges = [
                (
                    "spillway_store_writer_queue_writes",
                    "Writes handed to the store writer and not yet written",
                    writes,
                ),
                (
                    "spillway_store_writer_queue_bytes",
                    "Encoded bytes of the writes handed to the store writer and not yet written",
                    bytes,
                ),
                (
                    "spillway_store_failed",
                    "1 while the store has failed permanently (MST-1101): persistent publishes are refused",
                    u64::from(engine.store_failure().is_some()),
                ),
            ];
            let recovery = engine.recovery_progress();
            let gauges = gauges.into_iter().chain([
                (
                    "spillway_recovery_complete",
                    "1 once every durable queue's stored messages are recovered (MST-1006), 0 while they load",
                    u64::from(recovery.complete),
                ),
                (
                    "spillway_recovery_queues",
                    "Durable queues found in the store at start-up",
                    u64::from(recovery.queues_total),
                ),
                (
                    "spillway_recovery_queues_recovered",
                    "Durable queues whose stored messages are recovered",
                    u64::from(recovery.queues_recovered),
                ),
                (
                    "spillway_recovery_messages_recovered",
                    "Messages recovered from the store at start-up",
                    recovery.messages_recovered,
                ),
                (
                    "spillway_open_transactions",
                    "Channels with an open transaction (work held since its first publish or ack)",
                    engine.open_transactions(),
                ),
            ]);
            for (name, help, value) in gauges {
                let family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
                ConstGauge::new(value).encode(family)?;
            }
        }
        {
            let pacing = engine.pacing_stats();
            let counters = [
                (
                    "spillway_publisher_pacing_waits",
                    "Publishes (or commits) after which the session waited for a queue's publisher pacing credit",
                    pacing.waits,
                ),
                (
                    "spillway_publisher_pacing_stalls",
                    "Times a queue delivered nothing for a stall period while a publisher waited on it, so that its pacing was suspended until its next delivery",
                    pacing.stalls,
                ),
            ];
            for (name, help, value) in counters {
                let family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
                ConstCounter::new(value).encode(family)?;
            }
            let family = encoder.encode_descriptor(
                "spillway_publisher_pacing_seconds",
                "Time sessions spent waiting for publisher pacing credit",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(pacing.waited_micros as f64 / 1e6).encode(family)?;
        }
        {
            let mut family = encoder.encode_descriptor(
                "spillway_vhost_connections",
                "Open client connections per vhost",
                None,
                MetricType::Gauge,
            )?;
            for (vhost, count) in engine.vhost_connections() {
                ConstGauge::new(count)
                    .encode(family.encode_family(&[("vhost", vhost.as_str())])?)?;
            }
        }
        let stats = engine.queue_stats();
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
        type Figure = fn(&crate::model::DeadLetterCounts, DeathReason) -> u64;
        let counters: [(&str, &str, Figure); 2] = [
            (
                "spillway_dead_lettered",
                "Messages republished to the queue's dead-letter exchange, by reason (rejected, delivery_limit, maxlen)",
                |c, r| c.dead_lettered(r),
            ),
            (
                "spillway_discarded",
                "Messages the queue let go of for a dead-letter reason and dropped: no dead-letter exchange, a missing one, a cycle, or no queue bound",
                |c, r| c.discarded(r),
            ),
        ];
        for (name, help, figure) in counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for queue in &stats {
                for reason in DeathReason::ALL {
                    let labels = [
                        ("vhost", queue.vhost.as_str()),
                        ("queue", queue.queue.as_str()),
                        ("reason", reason.as_str()),
                    ];
                    ConstCounter::new(figure(&queue.dead_letters, reason))
                        .encode(family.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
}

/// RabbitMQ's per-queue families, named as its Prometheus plugin names
/// them, so that dashboards made for it (Grafana's "RabbitMQ-Overview")
/// fill in: one sample summed over the queues (`/metrics`), or one per
/// queue labelled `vhost` and `queue` (`/metrics/per-object`).
const RABBITMQ_QUEUE_GAUGES: [QueueGauge; 5] = [
    (
        "rabbitmq_queue_messages_ready",
        "Messages ready to be delivered to consumers",
        |q| q.messages,
    ),
    (
        "rabbitmq_queue_messages_unacked",
        "Messages delivered to consumers but not yet acknowledged",
        |q| q.unacked,
    ),
    (
        "rabbitmq_queue_messages",
        "Sum of ready and unacknowledged messages - total queue depth",
        |q| q.messages + q.unacked,
    ),
    ("rabbitmq_queue_consumers", "Consumers on a queue", |q| {
        q.consumers
    }),
    (
        "rabbitmq_queue_messages_ready_bytes",
        "Size in bytes of ready messages",
        |q| q.bytes,
    ),
];

struct RabbitQueueCollector {
    engine: Weak<Shared>,
    per_object: bool,
}

impl std::fmt::Debug for RabbitQueueCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitQueueCollector")
            .field("per_object", &self.per_object)
            .finish_non_exhaustive()
    }
}

impl Collector for RabbitQueueCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(shared) = self.engine.upgrade() else {
            return Ok(());
        };
        let stats = Engine { shared }.queue_stats();
        let totals = [
            ("rabbitmq_queues", "Queues available", stats.len() as u64),
            (
                "rabbitmq_consumers",
                "Consumers currently connected",
                stats.iter().map(|q| q.consumers).sum(),
            ),
        ];
        for (name, help, value) in totals {
            let family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(value).encode(family)?;
        }
        for (name, help, figure) in RABBITMQ_QUEUE_GAUGES {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            if !self.per_object {
                ConstGauge::new(stats.iter().map(figure).sum::<u64>()).encode(family)?;
                continue;
            }
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

/// Adds a run of `count` unacknowledged deliveries from `queue` of `vhost`.
#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;
    use spillway_proto::engine::{self as pb, session_command::Command, session_event::Event};
    use spillway_proto::engine::{EngineApi, SessionStreams};
    use spillway_storage::MemoryStore;

    use super::*;
    use crate::config::EngineConfig;

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
        let engine = Engine::start(Arc::new(MemoryStore::new()), EngineConfig::default())
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
                amqp1_link: None,
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
                // "two" and "three".
                bytes: 3 + 5,
                // Each with two property bytes, the routing key and the
                // fixed overhead.
                resident_bytes: 3 + 5 + 2 * (2 + 4 + crate::budget::MESSAGE_OVERHEAD_BYTES),
                spilled_messages: 0,
                spilled_bytes: 0,
                dead_letters: Default::default(),
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
            "spillway_queue_bytes{vhost=\"/\",queue=\"work\"} 8\n",
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
