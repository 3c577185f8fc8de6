//! Refusals by limit: how often a connection, channel, queue or consumer was
//! refused because a limit was reached (`spillway_limit_refusals_total`,
//! labelled `limit`).
//!
//! Both the gateway (the connection maximum, `channel_max`) and the engine
//! (vhost, user and per-connection limits) refuse things, and in one process
//! they share one registry: each keeps its own [`LimitRefusals`] and hands it
//! to [`crate::Metrics::register_limit_refusals`]; one collector sums them
//! into a single metric family at scrape time.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;

/// The metric's name as registered; scraped with its `_total` suffix.
pub const LIMIT_REFUSALS: &str = "spillway_limit_refusals";

/// One component's refusal counts, by limit name. Cheap to clone; clones
/// share the counts. Refusals are rare, so one small lock is enough.
#[derive(Clone, Debug, Default)]
pub struct LimitRefusals {
    counts: Arc<Mutex<BTreeMap<&'static str, u64>>>,
}

impl LimitRefusals {
    /// Counts for `limits`, each shown (at 0) from the start so that a
    /// rate over them is defined before the first refusal.
    pub fn new(limits: &[&'static str]) -> Self {
        let counts = limits.iter().map(|limit| (*limit, 0)).collect();
        Self {
            counts: Arc::new(Mutex::new(counts)),
        }
    }

    /// Shows `limits` (at 0 until their first refusal).
    pub fn declare(&self, limits: &[&'static str]) {
        let mut counts = self.counts.lock();
        for limit in limits {
            counts.entry(limit).or_default();
        }
    }

    /// One more refusal by `limit`.
    pub fn count(&self, limit: &'static str) {
        *self.counts.lock().entry(limit).or_default() += 1;
    }

    /// Refusals by `limit` so far.
    pub fn get(&self, limit: &str) -> u64 {
        self.counts.lock().get(limit).copied().unwrap_or_default()
    }

    fn snapshot(&self) -> Vec<(&'static str, u64)> {
        self.counts.lock().iter().map(|(k, v)| (*k, *v)).collect()
    }
}

/// Sums every registered [`LimitRefusals`] into one family at scrape time.
#[derive(Debug, Default, Clone)]
pub(crate) struct RefusalCollector {
    pub(crate) sources: Arc<Mutex<Vec<LimitRefusals>>>,
}

impl Collector for RefusalCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut sums: BTreeMap<&'static str, u64> = BTreeMap::new();
        for source in self.sources.lock().iter() {
            for (limit, count) in source.snapshot() {
                *sums.entry(limit).or_default() += count;
            }
        }
        if sums.is_empty() {
            return Ok(());
        }
        let mut family = encoder.encode_descriptor(
            LIMIT_REFUSALS,
            "Connections, channels, queues and consumers refused because a limit was reached, by limit (see docs/limits.md)",
            None,
            MetricType::Counter,
        )?;
        for (limit, count) in sums {
            ConstCounter::new(count).encode(family.encode_family(&[("limit", limit)])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Metrics;

    #[test]
    fn refusals_of_two_components_are_one_family() {
        let metrics = Metrics::new();
        assert!(!metrics.encode().unwrap().contains(LIMIT_REFUSALS));
        let gateway = LimitRefusals::new(&["max_connections", "channel_max"]);
        let engine = LimitRefusals::new(&["vhost_max_queues"]);
        metrics.register_limit_refusals(gateway.clone());
        metrics.register_limit_refusals(engine.clone());
        gateway.count("channel_max");
        engine.count("vhost_max_queues");
        engine.count("vhost_max_queues");
        let text = metrics.encode().unwrap();
        assert_eq!(
            text.matches("# TYPE spillway_limit_refusals_total counter")
                .count(),
            1,
            "{text}"
        );
        for line in [
            "spillway_limit_refusals_total{limit=\"channel_max\"} 1\n",
            "spillway_limit_refusals_total{limit=\"max_connections\"} 0\n",
            "spillway_limit_refusals_total{limit=\"vhost_max_queues\"} 2\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
