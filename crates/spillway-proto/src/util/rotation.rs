//! [`Rotation`]: several servers of which one is expected to answer (the
//! engine that holds the lease, the storage group's leader), and which one
//! answered last. The gateway's `engine::FailoverEngine`, management's
//! `engine::RemoteEngineAdmin` and the engine's `storage::GroupStorage` each
//! keep one (a utility: it names none of them).
//!
//! Written here rather than with tonic's `balance_list`: that balancer
//! keeps routing to endpoints whose connection failed, and a unary request
//! cannot be replayed below the generated client.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use futures::future::BoxFuture;

use crate::ServiceError;

/// Every server by its configured address, and the one asked first.
/// Clones share which one that is.
#[derive(Clone)]
pub(crate) struct Rotation<C> {
    /// What the servers are, for log lines ("engine", "storage group member").
    kind: &'static str,
    servers: Arc<[(String, C)]>,
    /// The server asked first: the one that answered last.
    current: Arc<AtomicUsize>,
}

impl<C> Rotation<C> {
    /// A rotation over `servers`, which must not be empty; `kind` names
    /// them in errors and log lines.
    pub(crate) fn new(kind: &'static str, servers: Vec<(String, C)>) -> Result<Self, ServiceError> {
        if servers.is_empty() {
            return Err(ServiceError::InvalidArgument(format!(
                "no {kind} address to connect to"
            )));
        }
        Ok(Self {
            kind,
            servers: servers.into(),
            current: Arc::new(AtomicUsize::new(0)),
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.servers.len()
    }

    /// The server at `index` (taken modulo the count) and its address.
    pub(crate) fn get(&self, index: usize) -> (&str, &C) {
        let (addr, server) = &self.servers[index % self.servers.len()];
        (addr, server)
    }

    /// The index of the server asked first.
    pub(crate) fn current(&self) -> usize {
        self.current.load(Ordering::Acquire) % self.servers.len()
    }

    /// The index of the server whose address is `address` (scheme and
    /// trailing slash aside), if one is.
    pub(crate) fn position(&self, address: &str) -> Option<usize> {
        let wanted = normalize(address);
        self.servers
            .iter()
            .position(|(addr, _)| normalize(addr) == wanted)
    }

    /// Makes `to` the server asked first, unless another caller moved the
    /// rotation away from `from` meanwhile.
    pub(crate) fn move_on(&self, from: usize, to: usize) {
        let _ = self
            .current
            .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Server `index` answered: it is asked first from now on.
    pub(crate) fn answered(&self, index: usize) {
        let before = self.current.swap(index, Ordering::AcqRel);
        if before != index {
            tracing::info!(kind = self.kind, server = %self.servers[index].0, "a different server answers: calls go there now");
        }
    }

    /// `call` on each server in turn, from the current one, until one
    /// answers; a refusal that is not about reaching it is the answer.
    /// Each server is asked once.
    pub(crate) async fn first_answering<'a, T>(
        &'a self,
        call: impl Fn(&'a C) -> BoxFuture<'a, Result<T, ServiceError>>,
    ) -> Result<T, ServiceError> {
        let start = self.current();
        let mut last = None;
        for step in 0..self.servers.len() {
            let index = (start + step) % self.servers.len();
            let (addr, server) = &self.servers[index];
            match call(server).await {
                Ok(answer) => {
                    self.answered(index);
                    return Ok(answer);
                }
                Err(error) if error.is_transient() => {
                    tracing::debug!(kind = self.kind, server = %addr, %error, "not answering, trying the next");
                    last = Some(error);
                }
                Err(error) => return Err(error),
            }
        }
        Err(last.unwrap_or_else(|| ServiceError::Unavailable(format!("no {} answers", self.kind))))
    }
}

/// An address without its scheme and trailing slash.
fn normalize(address: &str) -> &str {
    let address = address
        .strip_prefix("http://")
        .or_else(|| address.strip_prefix("https://"))
        .unwrap_or(address);
    address.trim_end_matches('/')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rotation() -> Rotation<u32> {
        let servers = vec![
            ("http://a:1".to_string(), 0),
            ("http://b:1/".to_string(), 1),
            ("c:1".to_string(), 2),
        ];
        match Rotation::new("test server", servers) {
            Ok(rotation) => rotation,
            Err(error) => panic!("{error}"),
        }
    }

    #[test]
    fn an_empty_rotation_is_refused() {
        let refused = Rotation::<u32>::new("engine", Vec::new()).err();
        assert!(matches!(refused, Some(ServiceError::InvalidArgument(_))));
    }

    #[test]
    fn addresses_match_without_scheme_or_trailing_slash() {
        let rotation = rotation();
        assert_eq!(rotation.position("https://b:1"), Some(1));
        assert_eq!(rotation.position("http://c:1/"), Some(2));
        assert_eq!(rotation.position("d:1"), None);
        assert_eq!(normalize("http://10.0.0.1:50071/"), "10.0.0.1:50071");
    }

    #[tokio::test]
    async fn the_first_that_answers_is_asked_first_next_time() {
        let rotation = rotation();
        let answer = rotation
            .first_answering(|server| {
                let server = *server;
                Box::pin(async move {
                    match server {
                        2 => Ok(server),
                        _ => Err(ServiceError::Unavailable("down".into())),
                    }
                })
            })
            .await;
        assert_eq!(answer.ok(), Some(2));
        assert_eq!(rotation.current(), 2);
        // Clones share the current server.
        assert_eq!(rotation.clone().current(), 2);
    }

    #[tokio::test]
    async fn a_refusal_that_is_not_about_reaching_the_server_is_the_answer() {
        let rotation = rotation();
        let asked = AtomicUsize::new(0);
        let answer: Result<u32, _> = rotation
            .first_answering(|_| {
                asked.fetch_add(1, Ordering::Relaxed);
                Box::pin(async { Err(ServiceError::PermissionDenied("no".into())) })
            })
            .await;
        assert!(matches!(answer, Err(ServiceError::PermissionDenied(_))));
        assert_eq!(asked.load(Ordering::Relaxed), 1);
        assert_eq!(rotation.current(), 0);
    }

    #[tokio::test]
    async fn when_none_answers_the_last_error_is_returned_after_one_round() {
        let rotation = rotation();
        let asked = AtomicUsize::new(0);
        let answer: Result<u32, _> = rotation
            .first_answering(|server| {
                asked.fetch_add(1, Ordering::Relaxed);
                let server = *server;
                Box::pin(async move { Err(ServiceError::Unavailable(format!("{server} down"))) })
            })
            .await;
        assert!(matches!(answer, Err(ServiceError::Unavailable(reason)) if reason == "2 down"));
        assert_eq!(asked.load(Ordering::Relaxed), 3);
    }
}
