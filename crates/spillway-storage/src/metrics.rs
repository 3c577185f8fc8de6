//! The storage node's figures on `/metrics`, read from the store on every
//! scrape.

use spillway_telemetry::prometheus_client::collector::Collector;
use spillway_telemetry::prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use std::sync::atomic::Ordering;

use spillway_telemetry::prometheus_client::metrics::counter::ConstCounter;
use spillway_telemetry::prometheus_client::metrics::gauge::ConstGauge;
use spillway_telemetry::Metrics;

use crate::store::{RocksStore, WeakStore};

impl RocksStore {
    /// Adds `spillway_store_disk_bytes` and
    /// `spillway_store_corrupt_records_total` to `metrics`. The registry does not
    /// keep the store open: once it is closed, the metric is left out.
    pub fn register_metrics(&self, metrics: &Metrics) {
        metrics.register_collector(StoreCollector {
            store: self.downgrade(),
        });
    }
}

struct StoreCollector {
    store: WeakStore,
}

impl std::fmt::Debug for StoreCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreCollector").finish_non_exhaustive()
    }
}

impl Collector for StoreCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let corrupt = ConstCounter::new(self.store.meta.corrupt_records.load(Ordering::Relaxed));
        corrupt.encode(encoder.encode_descriptor(
            "spillway_store_corrupt_records",
            "Records that did not decode, skipped and deleted (MST-1103)",
            None,
            corrupt.metric_type(),
        )?)?;
        let Some(store) = self.store.upgrade() else {
            return Ok(());
        };
        let status = match store.status(false) {
            Ok(status) => status,
            Err(error) => {
                tracing::warn!(%error, "reading the store's status for /metrics failed");
                return Ok(());
            }
        };
        let disk_bytes = ConstGauge::new(status.disk_bytes);
        disk_bytes.encode(encoder.encode_descriptor(
            "spillway_store_disk_bytes",
            "Size of the files in the store's data directory, in bytes",
            None,
            disk_bytes.metric_type(),
        )?)?;
        let memory = store.memory();
        let mut family = encoder.encode_descriptor(
            "spillway_store_memory_bytes",
            "Memory RocksDB holds, by kind (memtables, block_cache, table_readers), in bytes",
            None,
            spillway_telemetry::prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (kind, bytes) in [
            ("memtables", memory.memtables),
            ("block_cache", memory.block_cache),
            ("table_readers", memory.table_readers),
        ] {
            let labels = [("kind", kind)];
            ConstGauge::new(bytes).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_disk_bytes_while_the_store_is_open() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = RocksStore::open(dir.path()).expect("open");
        let metrics = Metrics::new();
        store.register_metrics(&metrics);
        let text = metrics.encode().expect("encode");
        let line = text
            .lines()
            .find(|line| line.starts_with("spillway_store_disk_bytes "))
            .unwrap_or_else(|| panic!("no disk bytes in\n{text}"));
        let bytes: u64 = line["spillway_store_disk_bytes ".len()..]
            .parse()
            .expect("a number");
        assert!(bytes > 0, "{line}");

        // The registry does not hold the database: it can be reopened.
        drop(store);
        assert!(!metrics
            .encode()
            .expect("encode")
            .contains("spillway_store_disk_bytes "));
        RocksStore::open(dir.path()).expect("reopen");
    }
}
