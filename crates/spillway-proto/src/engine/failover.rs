//! [`FailoverEngine`]: the gateway's client of several engines
//! (`gateway.engine_addrs`), of which one is active (it holds the store's
//! lease) and the others wait without listening.
//!
//! A session or a login goes to the engine that answered last; one that
//! cannot be reached is passed over for the next, once round the list. A
//! session whose engine dies ends, and the gateway closes its client
//! connection with `320 CONNECTION_FORCED`; the client's reconnection then
//! finds the engine that took over.

use async_trait::async_trait;

use super::session::{EngineApi, RemoteEngine, SessionStreams};
use crate::cluster::ClusterClient;
use crate::util::rotation::{Attempts, Rotation};
use crate::ServiceError;

/// Every engine, as the gateway reaches them.
pub struct FailoverEngine {
    /// The engines; the one that answered last is asked first.
    engines: Rotation<RemoteEngine>,
}

impl FailoverEngine {
    /// Clients of every address in `addrs` (connected lazily).
    pub fn connect_lazy(addrs: &[String], cluster: &ClusterClient) -> Result<Self, ServiceError> {
        let engines = addrs
            .iter()
            .map(|addr| Ok((addr.clone(), RemoteEngine::connect_lazy(addr, cluster)?)))
            .collect::<Result<Vec<_>, ServiceError>>()?;
        Ok(Self {
            engines: Rotation::new("engine", engines)?,
        })
    }
}

#[async_trait]
impl EngineApi for FailoverEngine {
    async fn open_session(&self) -> Result<SessionStreams, ServiceError> {
        self.engines
            .call(Attempts::ONE_ROUND, |engine| {
                Box::pin(engine.open_session())
            })
            .await
    }

    async fn authenticate(
        &self,
        request: crate::engine::AuthenticateRequest,
    ) -> Result<crate::engine::LoginResult, ServiceError> {
        self.engines
            .call(Attempts::ONE_ROUND, |engine| {
                Box::pin(engine.authenticate(request.clone()))
            })
            .await
    }
}
