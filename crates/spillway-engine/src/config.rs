//! What the wiring hands the engine: [`EngineConfig`], the `[engine]`
//! settings as read ([`EngineSettings`], declared in `settings.rs`) and
//! what is not configuration of the engine's own: the process's memory
//! ceiling and clock, the lease's TTL, and the gateway's largest message.
//! A leaf: it imports none of the engine's state.

use std::sync::Arc;
use std::time::Duration;

use spillway_proto::util::clock::{SharedClock, SystemClock};
use spillway_telemetry::MemoryCeiling;

use crate::settings::EngineSettings;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The configuration's `[engine]` section, as read.
    pub settings: EngineSettings,
    /// The largest message body (the gateway's `gateway.max_message_size`):
    /// a compressed body that declares more is not decoded (management's
    /// peek).
    pub max_message_size: u64,
    /// How long the engine's lease on the store lasts unless renewed; it is
    /// renewed every fifth of that.
    pub lease_ttl: Duration,
    /// The process's memory ceiling (`engine.memory_high_watermark`): the
    /// engine counts its message bytes against it, and above it blocks
    /// publishers and refuses new connections.
    pub memory_ceiling: Arc<MemoryCeiling>,
    /// Time as the broker reads it: TTLs, timeouts, blocked durations
    /// (the system's; a manual one in tests).
    pub clock: SharedClock,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            settings: EngineSettings::default(),
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            lease_ttl: DEFAULT_LEASE_TTL,
            memory_ceiling: MemoryCeiling::unlimited(),
            clock: SystemClock::shared(),
        }
    }
}

/// The largest message body by default, as the gateway's: 128 MiB.
pub const DEFAULT_MAX_MESSAGE_SIZE: u64 = 128 * 1024 * 1024;

/// How long an engine's lease on its store lasts unless renewed.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);
