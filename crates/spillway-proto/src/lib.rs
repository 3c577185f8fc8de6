//! Spillway's gRPC contracts: the generated types and services for
//! gateway↔engine (`engine`, with the engine's internal admin API),
//! engine↔storage (`storage`) and the public management API (`management`).
//!
//! The generated code is checked in under `src/generated/` so that building
//! Spillway needs no `protoc`; `tests/generated_code_is_fresh.rs` regenerates
//! it from `proto/` and fails on any difference. The internal services use
//! [`lean_codec::LeanCodec`]: prost's codec with small starting buffers.
//!
//! The prost message types double as Spillway's domain types on the message
//! path: the in-process wiring moves them through channels as they are, the
//! remote wiring sends them over tonic, so neither pays a conversion.

pub mod engine {
    #![allow(clippy::all, missing_docs)]
    include!("generated/spillway.engine.v1.rs");
}

pub mod storage {
    #![allow(clippy::all, missing_docs)]
    include!("generated/spillway.storage.v1.rs");
}

pub mod management {
    #![allow(clippy::all, missing_docs)]
    include!("generated/spillway.management.v1.rs");
}

mod amqp_error;
pub mod backoff;
pub mod body;
mod boundary;
pub mod clock;
pub mod cluster;
pub mod command_queue;
mod engine_failover;
mod group_client;
pub mod lean_codec;
pub mod permissions;
mod rotation;
mod status;

pub use boundary::{
    lazy_channel, lazy_member_channel, serve_remote_session, EngineApi, QuotaStream, RemoteEngine,
    RemoteStorage, SessionStreams, StorageApi,
};
pub use command_queue::{
    command_queue, CommandReceiver, CommandSender, QueuedCommand, SESSION_COMMAND_BUFFER,
    SESSION_COMMAND_BYTES,
};

pub use engine_failover::FailoverEngine;
pub use group_client::GroupStorage;
pub use status::{RemoteError, ServiceError, LEADER_HEADER};

mod admin;
pub mod json;
pub mod trace;

pub use admin::{EngineAdminApi, RemoteEngineAdmin};

/// The encoded file descriptor set of the public management API, for gRPC
/// server reflection (regenerated and checked with the code).
pub const MANAGEMENT_DESCRIPTOR: &[u8] = include_bytes!("generated/management_descriptor.bin");
