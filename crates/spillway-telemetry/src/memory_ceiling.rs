//! The process's memory ceiling (`engine.memory_high_watermark`): one high
//! watermark over the bytes the broker holds for its clients, counted by the
//! components that hold them, not sampled from the operating system.
//!
//! Each component that holds client bytes registers a *part*: a name and a
//! function reading its own counter (the engine: message bytes resident, on
//! their way to the store, held by transactions, and the bookkeeping of every
//! message; the gateway: partly received bodies, read buffers and the read
//! buffers lent bodies keep alive). [`MemoryCeiling::held`] sums them, so the
//! figure is exact at the moment it is read, whichever part grew.
//!
//! What the ceiling does is the components' business: above it the engine
//! blocks every connection that publishes and refuses new connections, and a
//! gateway of its own process refuses new connections and stops reading
//! publishers (`docs/limits.md`, "The memory ceiling"). RabbitMQ's memory
//! alarm samples the whole process instead; what is not counted here
//! (RocksDB's caches, the allocator's own overhead, code) is bounded by its
//! own settings.

use std::fmt;
use std::sync::Arc;

use parking_lot::RwLock;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

type Reading = Box<dyn Fn() -> u64 + Send + Sync>;

/// One process's ceiling and the parts counted against it. Shared
/// (`Arc`) by every component of the process.
pub struct MemoryCeiling {
    /// 0: no ceiling.
    high_watermark: u64,
    parts: RwLock<Vec<(&'static str, Reading)>>,
}

impl fmt::Debug for MemoryCeiling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.parts.read().iter().map(|(name, _)| *name).collect();
        f.debug_struct("MemoryCeiling")
            .field("high_watermark", &self.high_watermark)
            .field("parts", &names)
            .finish()
    }
}

/// The ceiling is reached: what is held, and the watermark it passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverCeiling {
    pub held: u64,
    pub high_watermark: u64,
}

impl fmt::Display for OverCeiling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "memory high watermark reached: {} bytes held for clients, watermark {} bytes \
             (engine.memory_high_watermark)",
            self.held, self.high_watermark
        )
    }
}

impl MemoryCeiling {
    /// A ceiling at `high_watermark` bytes; 0 turns it off (nothing is ever
    /// over it, parts are still counted and shown).
    pub fn new(high_watermark: u64) -> Arc<Self> {
        Arc::new(Self {
            high_watermark,
            parts: RwLock::new(Vec::new()),
        })
    }

    /// No ceiling: for components started alone (tests, tools).
    pub fn unlimited() -> Arc<Self> {
        Self::new(0)
    }

    pub fn high_watermark(&self) -> u64 {
        self.high_watermark
    }

    /// Counts `read()` against the ceiling from now on, shown as
    /// `spillway_memory_held_bytes{part="name"}`. A part registered twice
    /// (two gateways in one process) is counted twice, as it should be.
    pub fn count(&self, name: &'static str, read: impl Fn() -> u64 + Send + Sync + 'static) {
        self.parts.write().push((name, Box::new(read)));
    }

    /// Bytes held now, over every part.
    pub fn held(&self) -> u64 {
        self.parts
            .read()
            .iter()
            .fold(0u64, |sum, (_, read)| sum.saturating_add(read()))
    }

    /// `Some` while the bytes held are above the watermark.
    pub fn over(&self) -> Option<OverCeiling> {
        if self.high_watermark == 0 {
            return None;
        }
        let held = self.held();
        (held > self.high_watermark).then_some(OverCeiling {
            held,
            high_watermark: self.high_watermark,
        })
    }

    /// Each part's bytes, summed by name, in the order first registered.
    pub fn parts(&self) -> Vec<(&'static str, u64)> {
        let mut parts: Vec<(&'static str, u64)> = Vec::new();
        for (name, read) in self.parts.read().iter() {
            let bytes = read();
            match parts.iter_mut().find(|(known, _)| known == name) {
                Some((_, sum)) => *sum = sum.saturating_add(bytes),
                None => parts.push((name, bytes)),
            }
        }
        parts
    }

    /// Shows the ceiling on `/metrics`: `spillway_memory_held_bytes{part}`,
    /// `spillway_memory_high_watermark_bytes` and `spillway_memory_alarm`
    /// (1 while over the watermark), read at each scrape.
    pub fn collector(self: &Arc<Self>) -> impl Collector {
        CeilingCollector(self.clone())
    }
}

#[derive(Debug)]
struct CeilingCollector(Arc<MemoryCeiling>);

impl Collector for CeilingCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let ceiling = &self.0;
        let parts = ceiling.parts();
        let mut family = encoder.encode_descriptor(
            "spillway_memory_held_bytes",
            "Bytes held for clients, by the part that holds them, counted against engine.memory_high_watermark",
            None,
            MetricType::Gauge,
        )?;
        for (part, bytes) in &parts {
            let labels = [("part", *part)];
            ConstGauge::new(*bytes as i64).encode(family.encode_family(&labels)?)?;
        }
        let watermark = encoder.encode_descriptor(
            "spillway_memory_high_watermark_bytes",
            "engine.memory_high_watermark in bytes (0: no ceiling)",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(ceiling.high_watermark as i64).encode(watermark)?;
        let held: u64 = parts.iter().map(|(_, bytes)| bytes).sum();
        let alarm = ceiling.high_watermark != 0 && held > ceiling.high_watermark;
        let family = encoder.encode_descriptor(
            "spillway_memory_alarm",
            "1 while the bytes held for clients are above engine.memory_high_watermark",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(i64::from(alarm)).encode(family)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn parts_are_summed_and_compared_with_the_watermark() {
        let ceiling = MemoryCeiling::new(100);
        let messages = Arc::new(AtomicU64::new(60));
        let buffers = Arc::new(AtomicU64::new(30));
        {
            let messages = messages.clone();
            ceiling.count("messages", move || messages.load(Ordering::Relaxed));
        }
        {
            let buffers = buffers.clone();
            ceiling.count("buffers", move || buffers.load(Ordering::Relaxed));
        }
        assert_eq!(ceiling.held(), 90);
        assert_eq!(ceiling.over(), None);
        buffers.store(41, Ordering::Relaxed);
        assert_eq!(
            ceiling.over(),
            Some(OverCeiling {
                held: 101,
                high_watermark: 100
            })
        );
        assert_eq!(ceiling.parts(), vec![("messages", 60), ("buffers", 41)]);
    }

    #[test]
    fn a_zero_watermark_is_no_ceiling() {
        let ceiling = MemoryCeiling::unlimited();
        ceiling.count("messages", || u64::MAX);
        ceiling.count("messages", || 5);
        assert_eq!(ceiling.over(), None);
        assert_eq!(ceiling.held(), u64::MAX);
        assert_eq!(ceiling.parts(), vec![("messages", u64::MAX)]);
    }

    #[test]
    fn metrics_show_each_part_and_the_alarm() {
        let ceiling = MemoryCeiling::new(10);
        ceiling.count("unfinished_content", || 11);
        let metrics = crate::Metrics::new();
        metrics.register_collector(ceiling.collector());
        let text = metrics.encode().expect("encodes");
        assert!(text.contains("spillway_memory_held_bytes{part=\"unfinished_content\"} 11"));
        assert!(text.contains("spillway_memory_high_watermark_bytes 10"));
        assert!(text.contains("spillway_memory_alarm 1"));
    }
}
