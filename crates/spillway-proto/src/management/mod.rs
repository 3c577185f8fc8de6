//! The public management API (`Management`): what `spillctl` and the
//! management HTTP API call, and what the engine's admin API carries
//! (`engine::admin`).

mod generated {
    #![allow(clippy::all, missing_docs)]
    include!("../generated/spillway.management.v1.rs");
}
pub use generated::*;

/// The encoded file descriptor set of the public management API, for gRPC
/// server reflection (regenerated and checked with the code).
pub const MANAGEMENT_DESCRIPTOR: &[u8] = include_bytes!("../generated/management_descriptor.bin");
