//! [`FailoverEngine`]: the gateway's client of several engines
//! (`gateway.engine_addrs`), of which one is active (it holds the store's
//! lease) and the others wait without listening.
//!
//! A session or a login goes to the engine that answered last; one that
//! cannot be reached is passed over for the next, once round the list. A
//! session whose engine dies ends, and the gateway closes its client
//! connection with `320 CONNECTION_FORCED`; the client's reconnection then
//! finds the engine that took over.

use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use futures::future::BoxFuture;

use crate::cluster::ClusterClient;
use crate::{EngineApi, RemoteEngine, ServiceError, SessionStreams};

/// Every engine, as the gateway reaches them.
pub struct FailoverEngine {
    engines: Vec<(String, RemoteEngine)>,
    /// The engine tried first: the one that answered last.
    current: AtomicUsize,
}

impl FailoverEngine {
    /// Clients of every address in `addrs` (connected lazily).
    pub fn connect_lazy(addrs: &[String], cluster: &ClusterClient) -> Result<Self, ServiceError> {
        if addrs.is_empty() {
            return Err(ServiceError::InvalidArgument(
                "no engine address to connect to".into(),
            ));
        }
        let engines = addrs
            .iter()
            .map(|addr| Ok((addr.clone(), RemoteEngine::connect_lazy(addr, cluster)?)))
            .collect::<Result<Vec<_>, ServiceError>>()?;
        Ok(Self {
            engines,
            current: AtomicUsize::new(0),
        })
    }

    /// The engines in the order to try them: the current one first.
    fn in_order(&self) -> impl Iterator<Item = (usize, &(String, RemoteEngine))> {
        let start = self.current.load(Ordering::Acquire) % self.engines.len();
        (0..self.engines.len()).map(move |step| {
            let index = (start + step) % self.engines.len();
            (index, &self.engines[index])
        })
    }

    fn answered(&self, index: usize) {
        let before = self.current.swap(index, Ordering::AcqRel);
        if before != index {
            tracing::info!(engine = %self.engines[index].0, "engine answering: sessions go there now");
        }
    }
}

impl FailoverEngine {
    /// `call` on each engine in turn, from the current one, until one
    /// answers; a refusal that is not about reaching it is the answer.
    async fn first_answering<'a, T>(
        &'a self,
        call: impl Fn(&'a RemoteEngine) -> BoxFuture<'a, Result<T, ServiceError>>,
    ) -> Result<T, ServiceError> {
        let mut last = None;
        for (index, (addr, engine)) in self.in_order() {
            match call(engine).await {
                Ok(answer) => {
                    self.answered(index);
                    return Ok(answer);
                }
                Err(error) if error.is_transient() => {
                    tracing::debug!(engine = %addr, %error, "engine not answering, trying the next");
                    last = Some(error);
                }
                Err(error) => return Err(error),
            }
        }
        Err(last.unwrap_or_else(|| ServiceError::Unavailable("no engine answers".into())))
    }
}

#[async_trait]
impl EngineApi for FailoverEngine {
    async fn open_session(&self) -> Result<SessionStreams, ServiceError> {
        self.first_answering(|engine| Box::pin(engine.open_session()))
            .await
    }

    async fn authenticate(
        &self,
        request: crate::engine::AuthenticateRequest,
    ) -> Result<crate::engine::LoginResult, ServiceError> {
        self.first_answering(|engine| Box::pin(engine.authenticate(request.clone())))
            .await
    }
}
