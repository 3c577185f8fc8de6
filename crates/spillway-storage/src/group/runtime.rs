//! openraft's async runtime for the group: tokio, except for the random
//! source of election timeouts, which a simulation can seed.
//!
//! openraft draws each election timeout from its runtime's thread-local
//! random generator. Tokio's own (`rand::thread_rng`) cannot be seeded, so
//! a simulated group would elect differently on every run of one seed.
//! [`GroupRuntime`] is tokio for everything else; its generator is seeded
//! from the OS unless [`seed_this_thread`] was called on the thread (the
//! simulation runs every member on one thread).

use std::cell::RefCell;
use std::future::Future;
use std::time::Duration;

use openraft::{AsyncRuntime, OptionalSend, TokioRuntime};
use rand08::rngs::StdRng;
use rand08::{RngCore, SeedableRng};

thread_local! {
    static RNG: RefCell<Option<StdRng>> = const { RefCell::new(None) };
}

/// Seeds this thread's election-timeout generator: every member run on it
/// from now on draws the same timeouts on every run with `seed`.
pub fn seed_this_thread(seed: u64) {
    RNG.with(|rng| *rng.borrow_mut() = Some(StdRng::seed_from_u64(seed)));
}

fn with_rng<T>(draw: impl FnOnce(&mut StdRng) -> T) -> T {
    RNG.with(|rng| {
        let mut rng = rng.borrow_mut();
        draw(rng.get_or_insert_with(StdRng::from_entropy))
    })
}

/// This thread's generator, as openraft asks for it.
#[derive(Clone, Copy, Debug, Default)]
pub struct GroupRng;

impl RngCore for GroupRng {
    fn next_u32(&mut self) -> u32 {
        with_rng(|rng| rng.next_u32())
    }

    fn next_u64(&mut self) -> u64 {
        with_rng(|rng| rng.next_u64())
    }

    fn fill_bytes(&mut self, dest: &mut [u8]) {
        with_rng(|rng| rng.fill_bytes(dest))
    }

    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand08::Error> {
        with_rng(|rng| rng.try_fill_bytes(dest))
    }
}

/// Tokio, with [`GroupRng`] for randomness.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupRuntime;

type Tokio = TokioRuntime;

impl AsyncRuntime for GroupRuntime {
    type JoinError = <Tokio as AsyncRuntime>::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = <Tokio as AsyncRuntime>::JoinHandle<T>;
    type Sleep = <Tokio as AsyncRuntime>::Sleep;
    type Instant = <Tokio as AsyncRuntime>::Instant;
    type TimeoutError = <Tokio as AsyncRuntime>::TimeoutError;
    type Timeout<R, T: Future<Output = R> + OptionalSend> = <Tokio as AsyncRuntime>::Timeout<R, T>;
    type ThreadLocalRng = GroupRng;
    type OneshotSender<T: OptionalSend> = <Tokio as AsyncRuntime>::OneshotSender<T>;
    type OneshotReceiverError = <Tokio as AsyncRuntime>::OneshotReceiverError;
    type OneshotReceiver<T: OptionalSend> = <Tokio as AsyncRuntime>::OneshotReceiver<T>;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        Tokio::spawn(future)
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        Tokio::sleep(duration)
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        Tokio::sleep_until(deadline)
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(
        duration: Duration,
        future: F,
    ) -> Self::Timeout<R, F> {
        Tokio::timeout(duration, future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(
        deadline: Self::Instant,
        future: F,
    ) -> Self::Timeout<R, F> {
        Tokio::timeout_at(deadline, future)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        Tokio::is_panic(join_error)
    }

    fn thread_rng() -> Self::ThreadLocalRng {
        GroupRng
    }

    fn oneshot<T>() -> (Self::OneshotSender<T>, Self::OneshotReceiver<T>)
    where
        T: OptionalSend,
    {
        Tokio::oneshot()
    }
}

#[cfg(test)]
mod tests {
    use rand08::Rng;

    use super::*;

    #[test]
    fn a_seeded_thread_draws_the_same_timeouts_again() {
        let draw = || {
            (0..8)
                .map(|_| GroupRuntime::thread_rng().gen_range(150..300u64))
                .collect::<Vec<_>>()
        };
        seed_this_thread(7);
        let first = draw();
        seed_this_thread(7);
        assert_eq!(draw(), first);
        seed_this_thread(8);
        assert_ne!(draw(), first);
    }
}
