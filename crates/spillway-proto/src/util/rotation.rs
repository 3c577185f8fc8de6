//! [`Rotation`]: several servers of which one is expected to answer (the
//! engine that holds the lease, the storage group's leader), which one
//! answered last, and [`Rotation::call`]: the one way a call is tried
//! against them — following the leader a server names, bounding each
//! attempt, waiting between rounds, giving up at a deadline ([`Attempts`]).
//! The gateway's `engine::FailoverEngine`, management's
//! `engine::RemoteEngineAdmin` and the engine's `storage::GroupStorage` each
//! keep one and call through it (a utility: it names none of them).
//!
//! Written here rather than with tonic's `balance_list` or tower's `retry`
//! and `timeout` layers: that balancer keeps routing to endpoints whose
//! connection failed, and below the generated client a unary request is an
//! HTTP body that cannot be replayed. Above it, a call is a trait method,
//! not a tower service, so the policy takes the call as a closure instead.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;

use crate::util::backoff::Backoff;
use crate::ServiceError;

/// How [`Rotation::call`] tries one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Attempts {
    /// How long the call keeps trying, round after round, with a short
    /// backoff between rounds. None: one round of every server.
    pub(crate) deadline: Option<Duration>,
    /// How long one server may take before the next is asked (a server
    /// that died mid-call may leave its connection silent rather than
    /// closed). None: no bound of its own.
    pub(crate) per_server: Option<Duration>,
}

impl Attempts {
    /// Each server asked once, from the one that answered last, without a
    /// bound of its own (the gateway's and management's engines).
    pub(crate) const ONE_ROUND: Self = Self {
        deadline: None,
        per_server: None,
    };

    /// Rounds until `deadline` has passed (a storage group's election
    /// takes one to two seconds).
    pub(crate) const fn until(deadline: Duration) -> Self {
        Self {
            deadline: Some(deadline),
            per_server: None,
        }
    }

    /// The same, each server given at most `limit`.
    pub(crate) const fn each_within(self, limit: Duration) -> Self {
        Self {
            per_server: Some(limit),
            ..self
        }
    }
}

/// The wait between rounds in which no server answered: an election, or
/// servers down.
const ROUND_BACKOFF: (Duration, Duration) = (Duration::from_millis(20), Duration::from_millis(500));

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

    /// `call` against the servers as `attempts` says: first the one that
    /// answered last; on a transient error the server it names as leader
    /// (`ServiceError::NotLeader`), else the next; a refusal that is not
    /// about reaching the server is the answer. When time or rounds are
    /// up, the last error is returned, transient.
    pub(crate) async fn call<'a, T>(
        &'a self,
        attempts: Attempts,
        call: impl Fn(&'a C) -> BoxFuture<'a, Result<T, ServiceError>>,
    ) -> Result<T, ServiceError> {
        let started = Instant::now();
        let first = self.current();
        let mut backoff = Backoff::new(ROUND_BACKOFF.0, ROUND_BACKOFF.1);
        let mut misses = 0;
        loop {
            let index = self.current();
            let (addr, server) = self.get(index);
            let answer = match attempts.per_server {
                None => call(server).await,
                Some(limit) => tokio::time::timeout(limit, call(server))
                    .await
                    .unwrap_or_else(|_| {
                        Err(ServiceError::Unavailable(format!(
                            "{} {addr} did not answer within {limit:?}",
                            self.kind
                        )))
                    }),
            };
            let error = match answer {
                Ok(value) => {
                    if index != first {
                        tracing::info!(kind = self.kind, server = %addr, "a different server answers: calls go there now");
                    }
                    return Ok(value);
                }
                Err(error) if !error.is_transient() => return Err(error),
                Err(error) => error,
            };
            let named = match &error {
                ServiceError::NotLeader(leader) => self.position(leader),
                _ => None,
            };
            let next = named
                .filter(|next| *next != index)
                .unwrap_or((index + 1) % self.servers.len());
            tracing::debug!(kind = self.kind, from = %addr, to = %self.get(next).0, %error, "not answering, trying another");
            self.move_on(index, next);
            misses += 1;
            let round_done = misses % self.servers.len() == 0;
            let out_of_time = match attempts.deadline {
                None => round_done,
                Some(deadline) => started.elapsed() >= deadline,
            };
            if out_of_time {
                return Err(error);
            }
            if round_done {
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
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
            .call(Attempts::ONE_ROUND, |server| {
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
            .call(Attempts::ONE_ROUND, |_| {
                asked.fetch_add(1, Ordering::Relaxed);
                Box::pin(async { Err(ServiceError::PermissionDenied("no".into())) })
            })
            .await;
        assert!(matches!(answer, Err(ServiceError::PermissionDenied(_))));
        assert_eq!(asked.load(Ordering::Relaxed), 1);
        assert_eq!(rotation.current(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_named_leader_is_asked_next_and_rounds_go_on_until_the_deadline() {
        let rotation = rotation();
        // Server 0 names server 2 as its leader; 2 answers.
        let asked = std::sync::Mutex::new(Vec::new());
        let answer = rotation
            .call(Attempts::until(Duration::from_secs(1)), |server| {
                let server = *server;
                asked.lock().map(|mut asked| asked.push(server)).ok();
                Box::pin(async move {
                    match server {
                        0 => Err(ServiceError::NotLeader("http://c:1".into())),
                        2 => Ok(server),
                        _ => Err(ServiceError::Unavailable("down".into())),
                    }
                })
            })
            .await;
        assert_eq!(answer.ok(), Some(2));
        assert_eq!(
            asked.lock().map(|asked| asked.clone()).ok(),
            Some(vec![0, 2])
        );
        assert_eq!(rotation.current(), 2);

        // None answers: rounds with a backoff between them until the
        // deadline, each server bounded by its own limit.
        let started = Instant::now();
        let calls = AtomicUsize::new(0);
        let attempts =
            Attempts::until(Duration::from_secs(2)).each_within(Duration::from_millis(100));
        let answer: Result<u32, _> = rotation
            .call(attempts, |_| {
                calls.fetch_add(1, Ordering::Relaxed);
                Box::pin(std::future::pending())
            })
            .await;
        assert!(
            matches!(answer, Err(ServiceError::Unavailable(reason)) if reason.contains("within 100ms"))
        );
        let waited = started.elapsed();
        assert!(waited >= Duration::from_secs(2), "gave up after {waited:?}");
        assert!(waited < Duration::from_secs(3), "kept on for {waited:?}");
        assert!(calls.load(Ordering::Relaxed) > 3, "more than one round");
    }

    #[tokio::test]
    async fn when_none_answers_the_last_error_is_returned_after_one_round() {
        let rotation = rotation();
        let asked = AtomicUsize::new(0);
        let answer: Result<u32, _> = rotation
            .call(Attempts::ONE_ROUND, |server| {
                asked.fetch_add(1, Ordering::Relaxed);
                let server = *server;
                Box::pin(async move { Err(ServiceError::Unavailable(format!("{server} down"))) })
            })
            .await;
        assert!(matches!(answer, Err(ServiceError::Unavailable(reason)) if reason == "2 down"));
        assert_eq!(asked.load(Ordering::Relaxed), 3);
    }
}
