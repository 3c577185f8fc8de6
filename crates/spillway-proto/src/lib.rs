//! Spillway's gRPC contracts and what the components share across them.
//!
//! The crate owns the boundaries between Spillway's components: for each
//! service its generated types and gRPC code, the trait a component calls
//! it through, and that trait's remote client (the in-process
//! implementations live in the components' own crates). Callers hold an
//! `Arc<dyn …>` and never know which they have. Besides, it owns the error
//! mapping every service uses, the cluster's internal credentials and
//! channels, and two domain types the components share.
//!
//! One module per service, each holding its generated code and the
//! hand-written code of that boundary:
//! - [`engine`]: gateway↔engine (the session contract [`engine::EngineApi`],
//!   its remote client and server, the session's command queue, the
//!   gateway's [`engine::FailoverEngine`]) and the engine's internal admin
//!   API ([`engine::EngineAdminApi`], [`engine::RemoteEngineAdmin`]);
//! - [`storage`]: engine↔storage ([`storage::StorageApi`],
//!   [`storage::RemoteStorage`], and [`storage::GroupStorage`], the client
//!   that follows a storage group's leader);
//! - [`management`]: the public management API and its descriptor set.
//!
//! Shared by them all:
//! - [`error`]: [`ServiceError`] and its one mapping to gRPC statuses (and,
//!   in `amqp_error.rs`, how the engine's `AmqpError` is built);
//! - [`cluster`]: what every internal call carries (role, secret, mutual
//!   TLS, message limits) and the channels that carry it;
//! - [`body`] (the message body as the broker holds it) and [`permissions`]
//!   (RabbitMQ's permissions): domain types of the engine and management;
//! - [`util`]: backoff, clock, JSON helpers, the internal gRPC codec,
//!   rotation over several servers, trace context. Utilities import
//!   nothing of the services.
//!
//! No service module imports another's hand-written code: `engine` and
//! `storage` name only `management`'s generated messages (the admin API and
//! the store's quota carry them).
//!
//! The generated code is checked in under `src/generated/` so that building
//! Spillway needs no `protoc`; `tests/generated_code_is_fresh.rs` regenerates
//! it from `proto/` and fails on any difference. The internal services use
//! [`util::lean_codec::LeanCodec`]: prost's codec with small starting
//! buffers.
//!
//! The prost message types double as Spillway's domain types on the message
//! path: the in-process wiring moves them through channels as they are, the
//! remote wiring sends them over tonic, so neither pays a conversion.

pub mod engine;
pub mod management;
pub mod storage;

mod amqp_error;
pub mod body;
pub mod cluster;
pub mod error;
pub mod permissions;
pub mod util;

pub use error::ServiceError;
