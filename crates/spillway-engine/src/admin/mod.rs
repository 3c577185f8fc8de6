//! The engine's side of the management API, one module per resource:
//! [`vhosts`], [`exchanges`], [`queues`], [`bindings`], [`messages`] (peek,
//! get, move, publish), [`connections`] (with channels and consumers),
//! [`limits`], [`users`] (with permissions and management's login check),
//! [`policies`], [`definitions`] (export and import) and the broker as a
//! whole ([`overview`]: its status and runtime settings). Each call of
//! `EngineAdminApi` is the engine's own method of the same name in its
//! resource's module; this file only hands the trait and the gRPC service
//! to them, from the one list of calls
//! (`spillway_proto::for_each_engine_admin_call!`).
//!
//! Declarations, deletions, bindings and purges go through the broker's own
//! session operations on a short-lived internal session (user `management`)
//! opened and closed under one lock ([`common`]), so validation and
//! persistence live in one place (`broker/`). Peek and move are the only
//! code here that reads or moves messages themselves.
//!
//! What one queue or one vhost is asked about costs one lookup under the
//! broker lock. What looks at every queue of a vhost (lists, consumers,
//! message totals, the broker's status, the export) walks them a chunk at
//! a time, letting the lock go between chunks (`walk.rs`): such answers are
//! not a snapshot, as RabbitMQ's are not.
//!
//! [`EngineAdminService`] serves the same calls over gRPC (`EngineAdmin` in
//! `proto/spillway/engine/v1/admin.proto`).

use async_trait::async_trait;
use spillway_proto::engine as pb;
use spillway_proto::engine::engine_admin_server::{EngineAdmin, EngineAdminServer};
use spillway_proto::management as m;
use spillway_proto::{engine::EngineAdminApi, ServiceError};
use tonic::{Request, Response, Status};

use crate::engine::Engine;

mod bindings;
mod common;
mod connections;
pub(crate) mod definitions;
mod exchanges;
mod limits;
mod messages;
mod overview;
mod policies;
mod queues;
mod users;
mod vhosts;

/// The engine's side of every call of `EngineAdminApi`: each is the
/// engine's own method of that name, in the module of its resource.
macro_rules! engine_calls {
    ($($method:ident($request:ty) -> $response:ty;)*) => {
        #[async_trait]
        impl EngineAdminApi for Engine {
            $(
                async fn $method(&self, request: $request) -> Result<$response, ServiceError> {
                    Engine::$method(self, request).await
                }
            )*
        }
    };
}

spillway_proto::for_each_engine_admin_call!(engine_calls);

/// The engine's admin API over gRPC, for a management service in another
/// process.
pub struct EngineAdminService {
    engine: Engine,
}

impl EngineAdminService {
    pub fn new(engine: Engine) -> Self {
        Self { engine }
    }

    /// The server, sending and accepting messages of up to
    /// `max_message_bytes` (`spillway_proto::cluster::grpc_message_limit`).
    pub fn into_server(self, max_message_bytes: usize) -> EngineAdminServer<Self> {
        EngineAdminServer::new(self)
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes)
    }
}

macro_rules! serve_calls {
    ($($method:ident($request:ty) -> $response:ty;)*) => {
        #[tonic::async_trait]
        impl EngineAdmin for EngineAdminService {
            $(
                async fn $method(
                    &self,
                    request: Request<$request>,
                ) -> Result<Response<$response>, Status> {
                    let answer = EngineAdminApi::$method(&self.engine, request.into_inner()).await?;
                    Ok(Response::new(answer))
                }
            )*
        }
    };
}

spillway_proto::for_each_engine_admin_call!(serve_calls);
