//! What the end-to-end test files share beyond the [`Sandbox`]: running one
//! case in both wirings under an overall deadline ([`both_wirings!`],
//! [`run_case`], [`run_wiring_case`]), and waiting for a condition with a
//! deadline instead of sleeping a fixed time before asserting
//! ([`eventually`]).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::{Sandbox, Wiring};

/// How often [`eventually`] asks its probe again.
const POLL_INTERVAL: Duration = Duration::from_millis(25);

/// A case that runs against a sandbox the harness started.
pub type CaseFuture<'a> = Pin<Box<dyn Future<Output = anyhow::Result<()>> + 'a>>;

/// Starts a sandbox in `wiring`, runs `case` against it with an overall
/// `timeout`, and panics with the error and the broker's logs if it fails or
/// does not finish in time.
pub async fn run_case(
    wiring: Wiring,
    timeout: Duration,
    case: impl for<'a> FnOnce(&'a mut Sandbox) -> CaseFuture<'a>,
) {
    let mut sandbox = match Sandbox::start(wiring).await {
        Ok(sandbox) => sandbox,
        Err(error) => panic!("the {wiring:?} sandbox did not start: {error:#}"),
    };
    let result = tokio::time::timeout(timeout, case(&mut sandbox)).await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(error)) => panic!("{error:#}\n{}", sandbox.logs()),
        Err(_) => panic!("timed out after {timeout:?}\n{}", sandbox.logs()),
    }
}

/// Runs `case`, which starts its own sandbox (it needs a configuration), in
/// `wiring` with an overall `timeout`; panics if it fails or does not finish
/// in time.
pub async fn run_wiring_case<F>(wiring: Wiring, timeout: Duration, case: impl FnOnce(Wiring) -> F)
where
    F: Future<Output = anyhow::Result<()>>,
{
    match tokio::time::timeout(timeout, case(wiring)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => panic!("{wiring:?}: {error:#}"),
        Err(_) => panic!("{wiring:?}: timed out after {timeout:?}"),
    }
}

/// Declares each case as two tests, `in_process::<case>` and
/// `separate_processes::<case>`, each under an overall deadline of
/// `timeout_secs` seconds.
///
/// - `both_wirings!(timeout_secs = 60; a, b)`: each case is
///   `async fn(&mut Sandbox) -> anyhow::Result<()>`, run against a default
///   sandbox the harness starts (and whose logs it prints on failure).
/// - `both_wirings!(own_sandbox, timeout_secs = 60; a, b)`: each case is
///   `async fn(Wiring) -> anyhow::Result<()>` and starts its own sandbox
///   (for cases that need a configuration).
///
/// One invocation per test file: it declares the two modules.
#[macro_export]
macro_rules! both_wirings {
    (timeout_secs = $secs:literal; $($case:ident),* $(,)?) => {
        mod in_process {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    $crate::run_case(
                        $crate::Wiring::InProcess,
                        ::std::time::Duration::from_secs($secs),
                        |sandbox| Box::pin(super::$case(sandbox)),
                    )
                    .await;
                }
            )*
        }
        mod separate_processes {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    $crate::run_case(
                        $crate::Wiring::Separate,
                        ::std::time::Duration::from_secs($secs),
                        |sandbox| Box::pin(super::$case(sandbox)),
                    )
                    .await;
                }
            )*
        }
    };
    (own_sandbox, timeout_secs = $secs:literal; $($case:ident),* $(,)?) => {
        mod in_process {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    $crate::run_wiring_case(
                        $crate::Wiring::InProcess,
                        ::std::time::Duration::from_secs($secs),
                        super::$case,
                    )
                    .await;
                }
            )*
        }
        mod separate_processes {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    $crate::run_wiring_case(
                        $crate::Wiring::Separate,
                        ::std::time::Duration::from_secs($secs),
                        super::$case,
                    )
                    .await;
                }
            )*
        }
    };
}

/// What a probe of [`eventually`] answers: `true`, `Some(value)` or
/// `Ok(value)` when the condition holds; `false`, `None` or `Err(why)` when
/// it does not yet.
///
/// Beware: `Ok(false)` and `Ok(None)` are `Ok`, so they count as holding. A
/// probe that can fail and must also meet a condition answers an `Option`
/// (`probe().await.ok().filter(|n| *n == 3)`), not `probe().await.map(|n| n == 3)`.
pub trait ProbeOutcome {
    type Value;
    fn into_result(self) -> anyhow::Result<Self::Value>;
}

impl ProbeOutcome for bool {
    type Value = ();
    fn into_result(self) -> anyhow::Result<()> {
        if self {
            return Ok(());
        }
        Err(anyhow::anyhow!("the condition was false"))
    }
}

impl<T> ProbeOutcome for Option<T> {
    type Value = T;
    fn into_result(self) -> anyhow::Result<T> {
        self.ok_or_else(|| anyhow::anyhow!("the probe found nothing"))
    }
}

impl<T, E: Into<anyhow::Error>> ProbeOutcome for Result<T, E> {
    type Value = T;
    fn into_result(self) -> anyhow::Result<T> {
        self.map_err(Into::into)
    }
}

/// Asks `probe` until it holds (see [`ProbeOutcome`]) and returns its value;
/// after `deadline`, fails with the probe's last answer (a probe that is
/// itself still running at the deadline is cut short and said so).
///
/// This replaces "sleep a while, then assert": the wait is as short as the
/// system allows and as long as the deadline tolerates.
pub async fn eventually<F, Fut, O>(deadline: Duration, mut probe: F) -> anyhow::Result<O::Value>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = O>,
    O: ProbeOutcome,
{
    let until = tokio::time::Instant::now() + deadline;
    let mut tries = 0u32;
    loop {
        tries += 1;
        let last = match tokio::time::timeout_at(until, probe()).await {
            Ok(outcome) => match outcome.into_result() {
                Ok(value) => return Ok(value),
                Err(error) => error,
            },
            Err(_) => anyhow::anyhow!("the probe itself was still running"),
        };
        if tokio::time::Instant::now() + POLL_INTERVAL > until {
            return Err(last.context(format!("not within {deadline:?} ({tries} tries)")));
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}
