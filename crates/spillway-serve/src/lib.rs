//! Wiring: reads the configuration and assembles the components, either all
//! in one process (in-process calls across every boundary, embedded RocksDB)
//! or one role per process (gRPC across the boundaries). The components know
//! nothing of each other's location; this crate is the only place that does.

pub mod cluster;
mod roles;
mod settings;

pub use cluster::{require_protection_off_loopback, ClusterAuth, Guarded};
pub use roles::{run, run_with_metrics, Role, Running};
pub use settings::{Origin, Problem, Settings, SettingsError};

/// The `tracing` target of the message-path spans that are exported over
/// OTLP (the binary enables it only for its OpenTelemetry layer).
pub use spillway_proto::util::trace::TARGET as TRACE_TARGET;
