//! The queue engine's services: the gateway↔engine session (`Engine`) and
//! the engine's internal admin API (`EngineAdmin`, management's way in).
//!
//! Beside the generated types and services, the hand-written code of this
//! boundary:
//! - `session.rs`: [`EngineApi`], the gateway's view of the engine, its
//!   remote client [`RemoteEngine`] and the engine side's
//!   [`serve_remote_session`];
//! - `command_queue.rs`: the session's command channel ([`command_queue()`]),
//!   bounded in count and bytes;
//! - `failover.rs`: [`FailoverEngine`], the gateway's client of several
//!   engines;
//! - `admin.rs`: [`EngineAdminApi`], its remote client [`RemoteEngineAdmin`]
//!   and the call list `for_each_engine_admin_call!` (exported at the crate
//!   root, as macros are).

mod generated {
    #![allow(clippy::all, missing_docs)]
    include!("../generated/spillway.engine.v1.rs");
}
pub use generated::*;

mod admin;
mod command_queue;
mod failover;
mod session;

pub use admin::{EngineAdminApi, RemoteEngineAdmin};
pub use command_queue::{
    command_queue, CommandReceiver, CommandSender, QueuedCommand, SESSION_COMMAND_BUFFER,
    SESSION_COMMAND_BYTES,
};
pub use failover::FailoverEngine;
pub use session::{serve_remote_session, EngineApi, RemoteEngine, SessionStreams};
