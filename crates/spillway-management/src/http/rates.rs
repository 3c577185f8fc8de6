//! Message rates for the HTTP API, as RabbitMQ's management plugin reports
//! them (`message_stats.publish_details.rate`, what KEDA's message-rate
//! mode reads) and `idle_since`.
//!
//! A sampler reads every queue's arrival and delivery counts (the engine's
//! `QueueStatus.arrived_total`, `delivered_total`) every sample interval,
//! through the same gRPC method as `GET /api/queues`, and keeps per queue
//! only its last sample and the rates it gives (RabbitMQ's `basic` rates
//! mode does the same): memory grows with the queues that exist, a few
//! dozen bytes each, and a deleted queue is dropped at the next sample. Per
//! vhost it keeps a ring of the last [`HISTORY`] samples, summed over the
//! vhost's queues, for the overview.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde_json::{json, Value};
use spillway_proto::management as m;
use tokio::time::Instant;

use super::HttpApi;
use crate::auth::Caller;

/// Samples kept per vhost.
pub const HISTORY: usize = 120;

/// What one queue's last sample says.
#[derive(Clone, Copy, Debug)]
struct QueueRates {
    at: Instant,
    arrived: u64,
    delivered: u64,
    publish_rate: f64,
    deliver_rate: f64,
    /// Since when nothing arrived or was delivered (seconds since the
    /// epoch); None while it moves.
    idle_since: Option<u64>,
}

/// One vhost's totals at one sample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VhostSample {
    pub at_unix_ms: u64,
    pub arrived: u64,
    pub delivered: u64,
    pub ready: u64,
    pub unacked: u64,
}

/// The rates of every queue and the recent history of every vhost.
#[derive(Debug, Default)]
pub struct Rates {
    /// By vhost, then queue name.
    queues: Mutex<HashMap<String, HashMap<String, QueueRates>>>,
    vhosts: Mutex<HashMap<String, VecDeque<VhostSample>>>,
}

impl Rates {
    /// Takes one sample of `queues` (every queue of `vhost`) at `at`.
    pub fn sample(&self, vhost: &str, queues: &[m::Queue], at: Instant, now: SystemTime) {
        let now_secs = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        let mut totals = VhostSample {
            at_unix_ms: now
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis() as u64,
            arrived: 0,
            delivered: 0,
            ready: 0,
            unacked: 0,
        };
        let mut known = self.queues.lock();
        let previous = known.remove(vhost).unwrap_or_default();
        // Only the queues of this sample: deleted ones are forgotten.
        let mut current = HashMap::with_capacity(queues.len());
        for queue in queues {
            let status = queue.status.clone().unwrap_or_default();
            totals.arrived += status.arrived_total;
            totals.delivered += status.delivered_total;
            totals.ready += status.messages;
            totals.unacked += status.unacked;
            let rates = next_rates(previous.get(&queue.name), &status, at, now_secs);
            current.insert(queue.name.clone(), rates);
        }
        known.insert(vhost.to_string(), current);
        drop(known);
        let mut vhosts = self.vhosts.lock();
        let ring = vhosts.entry(vhost.to_string()).or_default();
        if ring.len() == HISTORY {
            ring.pop_front();
        }
        ring.push_back(totals);
    }

    /// Forgets the vhosts not in `alive`.
    pub fn keep_vhosts(&self, alive: &[String]) {
        self.vhosts.lock().retain(|vhost, _| alive.contains(vhost));
        self.queues.lock().retain(|vhost, _| alive.contains(vhost));
    }

    /// RabbitMQ's `message_stats` and `idle_since` of a queue (empty
    /// before its first sample).
    pub fn queue_fields(&self, vhost: &str, queue: &str) -> Vec<(&'static str, Value)> {
        let known = self.queues.lock();
        let Some(rates) = known.get(vhost).and_then(|queues| queues.get(queue)) else {
            return Vec::new();
        };
        let mut fields = vec![(
            "message_stats",
            message_stats(
                rates.arrived,
                rates.publish_rate,
                rates.delivered,
                rates.deliver_rate,
            ),
        )];
        if let Some(since) = rates.idle_since {
            fields.push(("idle_since", json!(rabbitmq_time(since))));
        }
        fields
    }

    /// A vhost's `message_stats` from its last two samples.
    pub fn vhost_stats(&self, vhost: &str) -> Option<Value> {
        let vhosts = self.vhosts.lock();
        let ring = vhosts.get(vhost)?;
        let last = ring.back()?;
        let (publish_rate, deliver_rate) = match ring.len().checked_sub(2).map(|i| ring[i]) {
            Some(before) => (
                per_second(
                    before.arrived,
                    last.arrived,
                    before.at_unix_ms,
                    last.at_unix_ms,
                ),
                per_second(
                    before.delivered,
                    last.delivered,
                    before.at_unix_ms,
                    last.at_unix_ms,
                ),
            ),
            None => (0.0, 0.0),
        };
        Some(message_stats(
            last.arrived,
            publish_rate,
            last.delivered,
            deliver_rate,
        ))
    }

    /// The overview's `message_stats`: the vhosts' last two samples,
    /// summed over `vhosts`.
    pub fn overview_stats(&self, vhosts: &[&str]) -> Value {
        let rings = self.vhosts.lock();
        let (mut published, mut delivered, mut publish_rate, mut deliver_rate) = (0, 0, 0.0, 0.0);
        for ring in vhosts.iter().filter_map(|vhost| rings.get(*vhost)) {
            let Some(last) = ring.back() else { continue };
            published += last.arrived;
            delivered += last.delivered;
            if let Some(before) = ring.len().checked_sub(2).map(|i| ring[i]) {
                publish_rate += per_second(
                    before.arrived,
                    last.arrived,
                    before.at_unix_ms,
                    last.at_unix_ms,
                );
                deliver_rate += per_second(
                    before.delivered,
                    last.delivered,
                    before.at_unix_ms,
                    last.at_unix_ms,
                );
            }
        }
        message_stats(published, publish_rate, delivered, deliver_rate)
    }

    /// Every vhost's history, oldest first.
    pub fn history(&self, vhost: &str) -> Vec<VhostSample> {
        self.vhosts
            .lock()
            .get(vhost)
            .map(|ring| ring.iter().copied().collect())
            .unwrap_or_default()
    }
}

fn next_rates(
    previous: Option<&QueueRates>,
    status: &m::QueueStatus,
    at: Instant,
    now_secs: u64,
) -> QueueRates {
    let Some(before) = previous else {
        return QueueRates {
            at,
            arrived: status.arrived_total,
            delivered: status.delivered_total,
            publish_rate: 0.0,
            deliver_rate: 0.0,
            idle_since: None,
        };
    };
    let elapsed = at.saturating_duration_since(before.at).as_secs_f64();
    // A queue deleted and declared again between samples starts over.
    let arrived = status.arrived_total.saturating_sub(before.arrived);
    let delivered = status.delivered_total.saturating_sub(before.delivered);
    let rate = |count: u64| {
        if elapsed > 0.0 {
            count as f64 / elapsed
        } else {
            0.0
        }
    };
    let moved = arrived > 0 || delivered > 0;
    QueueRates {
        at,
        arrived: status.arrived_total,
        delivered: status.delivered_total,
        publish_rate: rate(arrived),
        deliver_rate: rate(delivered),
        idle_since: match (moved, before.idle_since) {
            (true, _) => None,
            (false, Some(since)) => Some(since),
            (false, None) => Some(now_secs),
        },
    }
}

fn per_second(before: u64, after: u64, before_ms: u64, after_ms: u64) -> f64 {
    let elapsed = after_ms.saturating_sub(before_ms) as f64 / 1000.0;
    if elapsed <= 0.0 {
        return 0.0;
    }
    after.saturating_sub(before) as f64 / elapsed
}

fn message_stats(published: u64, publish_rate: f64, delivered: u64, deliver_rate: f64) -> Value {
    json!({
        "publish": published,
        "publish_details": {"rate": round(publish_rate)},
        "deliver_get": delivered,
        "deliver_get_details": {"rate": round(deliver_rate)},
    })
}

fn round(rate: f64) -> f64 {
    (rate * 10.0).round() / 10.0
}

/// `2026-12-05 05:30:00`, UTC, as RabbitMQ 3.10 writes `idle_since`.
/// (A dozen lines rather than a date crate: the civil-from-days algorithm
/// of Howard Hinnant's date library.)
pub fn rabbitmq_time(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let secs = unix_secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        secs / 3_600,
        secs % 3_600 / 60,
        secs % 60
    )
}

/// Samples every queue every `every` until the API is dropped.
pub(super) async fn run_sampler(api: std::sync::Weak<HttpApi>, every: Duration) {
    let sampler = Caller::Operator {
        name: "rate sampler".into(),
    };
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(api) = api.upgrade() else { return };
        if let Err(error) = sample_all(&api, &sampler).await {
            tracing::debug!(%error, "rate sample skipped");
        }
    }
}

async fn sample_all(api: &Arc<HttpApi>, sampler: &Caller) -> Result<(), tonic::Status> {
    let vhosts = api
        .service
        .list_vhosts(sampler, m::ListVhostsRequest {})
        .await?
        .vhosts;
    let names: Vec<String> = vhosts.into_iter().map(|vhost| vhost.name).collect();
    for vhost in &names {
        // A vhost's queues read at once, as a queue list does.
        let Ok(_slot) = api.list_slot().await else {
            return Ok(());
        };
        let request = m::ListQueuesRequest {
            vhost: vhost.clone(),
        };
        let queues = match api.service.list_queues(sampler, request).await {
            Ok(queues) => queues.queues,
            // Deleted meanwhile.
            Err(_) => continue,
        };
        api.rates
            .sample(vhost, &queues, Instant::now(), SystemTime::now());
    }
    api.rates.keep_vhosts(&names);
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn queue(name: &str, arrived: u64, delivered: u64) -> m::Queue {
        m::Queue {
            name: name.into(),
            status: Some(m::QueueStatus {
                arrived_total: arrived,
                delivered_total: delivered,
                messages: arrived - delivered,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn rates_come_from_the_counts_between_two_samples() {
        let rates = Rates::default();
        let start = Instant::now();
        let wall = SystemTime::now();
        rates.sample("/", &[queue("q", 100, 0)], start, wall);
        let fields = rates.queue_fields("/", "q");
        assert_eq!(fields[0].1["publish_details"]["rate"], 0.0);
        rates.sample(
            "/",
            &[queue("q", 150, 20)],
            start + Duration::from_secs(5),
            wall + Duration::from_secs(5),
        );
        let fields = rates.queue_fields("/", "q");
        assert_eq!(fields[0].1["publish"], 150);
        assert_eq!(fields[0].1["publish_details"]["rate"], 10.0);
        assert_eq!(fields[0].1["deliver_get_details"]["rate"], 4.0);
        assert_eq!(fields.len(), 1, "not idle");
        // Nothing moves: idle since then.
        rates.sample(
            "/",
            &[queue("q", 150, 20)],
            start + Duration::from_secs(10),
            wall + Duration::from_secs(10),
        );
        let fields = rates.queue_fields("/", "q");
        assert_eq!(fields[0].1["publish_details"]["rate"], 0.0);
        assert_eq!(fields[1].0, "idle_since");
        let stats = rates.vhost_stats("/").unwrap();
        assert_eq!(stats["publish"], 150);
        let overview = rates.overview_stats(&["/", "gone"]);
        assert_eq!(overview["publish"], 150);
        assert_eq!(overview["deliver_get"], 20);
    }

    #[test]
    fn deleted_queues_and_vhosts_are_forgotten_and_history_is_bounded() {
        let rates = Rates::default();
        let start = Instant::now();
        for i in 0..(HISTORY as u64 + 10) {
            let queues = if i == 0 {
                vec![queue("gone", 1, 0), queue("q", i, 0)]
            } else {
                vec![queue("q", i, 0)]
            };
            rates.sample(
                "/",
                &queues,
                start + Duration::from_secs(i),
                SystemTime::now(),
            );
        }
        assert!(rates.queue_fields("/", "gone").is_empty());
        assert_eq!(rates.history("/").len(), HISTORY);
        rates.keep_vhosts(&[]);
        assert!(rates.history("/").is_empty());
        assert!(rates.queue_fields("/", "q").is_empty());
    }

    #[test]
    fn idle_since_is_written_as_rabbitmq_writes_it() {
        assert_eq!(rabbitmq_time(0), "1970-01-01 00:00:00");
        assert_eq!(rabbitmq_time(1_796_448_600), "2026-12-05 05:30:00");
        assert_eq!(rabbitmq_time(951_782_400), "2000-02-29 00:00:00");
    }
}
