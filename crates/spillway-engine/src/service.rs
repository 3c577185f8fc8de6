//! `EngineService`: the engine's gRPC face for gateways in other processes.
//! Each `Engine.Session` stream is one client connection, served by the same
//! in-process `Engine::open_session` the all-in-one wiring calls directly.
use std::pin::Pin;

use futures::{Stream, StreamExt};
use spillway_proto::engine::engine_server::{Engine as EngineGrpc, EngineServer};
use spillway_proto::engine::{serve_remote_session, EngineApi};
use spillway_proto::engine::{
    AuthenticateRequest, AuthenticateResponse, SessionCommand, SessionEvent,
};
use tonic::{Request, Response, Status, Streaming};

use crate::engine::Engine;

/// The engine's gRPC service, for gateways in other processes.
pub struct EngineService {
    engine: Engine,
    /// Ends every session stream when it turns true: a graceful gRPC
    /// shutdown waits for open streams, and a gateway's session lasts as
    /// long as its client's connection.
    stop: Option<tokio::sync::watch::Receiver<bool>>,
}

impl EngineService {
    pub fn new(engine: Engine) -> Self {
        Self { engine, stop: None }
    }

    /// Session streams end when `stop` turns true; the gateways then close
    /// their clients' connections with `320 CONNECTION_FORCED`.
    pub fn with_shutdown(mut self, stop: tokio::sync::watch::Receiver<bool>) -> Self {
        self.stop = Some(stop);
        self
    }

    /// The server, sending and accepting messages of up to
    /// `max_message_bytes` (`spillway_proto::cluster::grpc_message_limit`).
    pub fn into_server(self, max_message_bytes: usize) -> EngineServer<Self> {
        EngineServer::new(self)
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes)
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<SessionEvent, Status>> + Send>>;

#[tonic::async_trait]
impl EngineGrpc for EngineService {
    type SessionStream = EventStream;

    async fn session(
        &self,
        request: Request<Streaming<SessionCommand>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let session = self.engine.open_session().await?;
        let events = serve_remote_session(request.into_inner(), session);
        let Some(mut stop) = self.stop.clone() else {
            return Ok(Response::new(events));
        };
        let stopped = async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        };
        Ok(Response::new(Box::pin(events.take_until(stopped))))
    }

    async fn authenticate(
        &self,
        request: Request<AuthenticateRequest>,
    ) -> Result<Response<AuthenticateResponse>, Status> {
        let result = self.engine.authenticate(request.into_inner()).await?;
        Ok(Response::new(AuthenticateResponse {
            result: result.into(),
        }))
    }
}
