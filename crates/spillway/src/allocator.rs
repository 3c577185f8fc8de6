//! The allocator's own figures on `/metrics`: what the process's heap holds
//! for live allocations, and what jemalloc keeps from the system beyond that
//! (`docs/flow-to-disk.md`, "Memory beyond the budget"). Read on every
//! scrape. [`configure`] sets how soon freed memory goes back to the system.

use spillway_telemetry::prometheus_client::collector::Collector;
use spillway_telemetry::prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use spillway_telemetry::prometheus_client::metrics::gauge::ConstGauge;
use spillway_telemetry::prometheus_client::metrics::MetricType;
use spillway_telemetry::Metrics;
use tikv_jemalloc_ctl::{arenas, background_thread, epoch, stats, Access, AsName};

/// How long freed pages stay with jemalloc before going back to the system.
/// Its default is 10 s, during which the churn of a backlog draining from
/// disk (payloads read back, delivered, freed) stays in the RSS. At 1 s the
/// pages kept above what is live were 65–96 MiB at the peak of a 2 GiB
/// backlog's fill; at 300 ms 50–65 MiB, for no measurable CPU
/// (docs/performance-history.md, case d). At 0 every reuse faults pages in again:
/// half as much broker CPU again.
const DIRTY_DECAY_MS: isize = 300;

/// Freed pages go back to the system after [`DIRTY_DECAY_MS`], straight
/// (`muzzy_decay_ms` 0: pages merely marked free with `MADV_FREE` would
/// still count in the RSS), and a background thread does it even while the
/// process allocates nothing. Set before anything else runs; a failure is
/// printed and changes only how soon memory goes back.
///
/// An operator's `MALLOC_CONF` wins: when it is set, nothing is changed
/// here, so that jemalloc's own options (`narenas`, the decays, `prof` with
/// the `profiling` feature, docs/performance.md) can be tried without a
/// rebuild.
pub fn configure() {
    if std::env::var_os("MALLOC_CONF").is_some() {
        return;
    }
    // The default for arenas made from now on…
    for (name, value) in [
        (&b"arenas.dirty_decay_ms\0"[..], DIRTY_DECAY_MS),
        (&b"arenas.muzzy_decay_ms\0"[..], 0),
    ] {
        if let Err(error) = name.name().write(value) {
            eprintln!("jemalloc default decay not set: {error}");
        }
    }
    // …and the arenas that exist already. Arenas not made yet refuse
    // (EFAULT), and get the default above when they are.
    let arena_count = arenas::narenas::read().unwrap_or(0);
    for arena in 0..arena_count {
        for (setting, value) in [("dirty", DIRTY_DECAY_MS), ("muzzy", 0)] {
            let name = format!("arena.{arena}.{setting}_decay_ms\0");
            let _ = name.as_bytes().name().write(value);
        }
    }
    if let Err(error) = background_thread::write(true) {
        eprintln!("jemalloc background thread not started: {error}");
    }
}

/// Adds `spillway_allocator_bytes{kind}` to `metrics`.
pub fn register(metrics: &Metrics) {
    metrics.register_collector(AllocatorCollector);
}

#[derive(Debug)]
struct AllocatorCollector;

impl Collector for AllocatorCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // jemalloc's statistics are a snapshot taken when the epoch moves.
        if let Err(error) = epoch::advance() {
            tracing::debug!(%error, "jemalloc statistics unavailable");
            return Ok(());
        }
        let figures = [
            ("allocated", stats::allocated::read()),
            ("active", stats::active::read()),
            ("resident", stats::resident::read()),
            ("retained", stats::retained::read()),
        ];
        let mut family = encoder.encode_descriptor(
            "spillway_allocator_bytes",
            "The heap as jemalloc sees it, in bytes: allocated (live allocations), active (their pages), resident (pages it holds in memory, metadata included), retained (address space kept, not resident)",
            None,
            MetricType::Gauge,
        )?;
        for (kind, figure) in figures {
            let Ok(bytes) = figure else { continue };
            ConstGauge::new(bytes as u64).encode(family.encode_family(&[("kind", kind)])?)?;
        }
        Ok(())
    }
}
