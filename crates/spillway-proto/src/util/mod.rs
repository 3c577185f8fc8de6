//! Utilities the contracts and the components share. None of them names a
//! service: they import nothing of `engine`, `storage` or `management`.
//!
//! - [`backoff`]: exponential waits for retry loops;
//! - [`clock`]: time as the components read it ([`clock::SystemClock`],
//!   [`clock::ManualClock`] in tests);
//! - [`json`]: serde helpers the generated management types name;
//! - [`lean_codec`]: the internal services' gRPC codec (the generated engine
//!   code names it);
//! - [`rotation`]: several servers of which one answers, and which did last;
//! - [`trace`]: trace context across the component boundaries.

pub mod backoff;
pub mod clock;
pub mod json;
pub mod lean_codec;
pub(crate) mod rotation;
pub mod trace;
