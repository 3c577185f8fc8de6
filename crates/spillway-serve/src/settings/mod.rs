//! Configuration: built-in defaults ← `spillway.toml` (or `--config FILE`) ←
//! environment (`SPILLWAY_<SECTION>__<KEY>`, e.g.
//! `SPILLWAY_GATEWAY__AMQP_LISTEN=127.0.0.1:5672`). Every key is documented
//! in `docs/configuration.md`.
//!
//! Loading also refuses a configuration that cannot be meant: a key no
//! setting reads (named with where it was set and the nearest known key) and
//! a value out of its range. The known keys are the settings structs' own
//! fields, found through their `Deserialize` impls ([`keys`]), never a list.
//!
//! A section per file, beside the components that declare their own:
//! `[engine]` is `spillway_engine::EngineSettings`, `[gateway]` is
//! `spillway_gateway::GatewaySettings` and `[storage]` is
//! `spillway_storage::StorageSettings`, held here as read and handed to
//! their components as is. Here: `management.rs`,
//! `telemetry.rs`, `cluster.rs`; the checks of `gateway.tls` and
//! `management.tls` (with the other checks, `check.rs`); loading (`load.rs`, the environment layer in
//! `env.rs`, Qpid's names in `aliases.rs`), the known keys (`keys.rs`), the
//! ranges (`check.rs`) and what a refusal says (`error.rs`).

use serde::Deserialize;
use spillway_engine::EngineSettings;
use spillway_gateway::GatewaySettings;
use spillway_storage::StorageSettings;

pub mod aliases;
mod check;
mod cluster;
mod env;
mod error;
pub mod keys;
mod load;
mod management;
mod telemetry;
#[cfg(test)]
mod tests;

pub use cluster::ClusterSettings;
pub use error::{Origin, Problem, SettingsError};
pub use management::ManagementSettings;
pub use telemetry::TelemetrySettings;

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct Settings {
    pub gateway: GatewaySettings,
    pub engine: EngineSettings,
    pub storage: StorageSettings,
    pub management: ManagementSettings,
    pub telemetry: TelemetrySettings,
    pub cluster: ClusterSettings,
}
