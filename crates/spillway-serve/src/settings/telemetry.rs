//! `[telemetry]`: logs, `/metrics` and traces.

use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct TelemetrySettings {
    /// `text` or `json`.
    pub log_format: String,
    /// A tracing filter, e.g. `info` or `spillway_gateway=debug,info`
    /// (`RUST_LOG` wins when set).
    pub log_level: String,
    /// Where HTTP `/metrics` and `/healthz` are served (`IP:port`; port 0
    /// picks one). Unset: the role's default, `127.0.0.1:9471` for
    /// all-in-one (`Role::default_metrics_listen`).
    pub metrics_listen: Option<String>,
    /// An OpenTelemetry collector's OTLP/gRPC endpoint, e.g.
    /// `http://127.0.0.1:4317`: spans of every publish and delivery are
    /// exported there. Unset (or empty): nothing is exported.
    pub otlp_endpoint: Option<String>,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        Self {
            log_format: "text".into(),
            log_level: "info,openraft=warn".into(),
            metrics_listen: None,
            otlp_endpoint: None,
        }
    }
}

impl TelemetrySettings {
    /// The OTLP endpoint, when one is set and not empty.
    pub fn otlp_endpoint(&self) -> Option<&str> {
        self.otlp_endpoint
            .as_deref()
            .map(str::trim)
            .filter(|endpoint| !endpoint.is_empty())
    }
}
