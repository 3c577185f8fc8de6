//! Refused logins, shared by the AMQP gateway and management:
//! - rate-limited log lines: the first refusal of a peer address and user is
//!   logged, later ones within [`REFUSAL_LOG_INTERVAL`] are only counted,
//!   and the next line says how many were left out ([`RefusalLog`]);
//! - a throttle that slows a password guesser without locking anyone out:
//!   after [`FREE_LOGIN_FAILURES`] failures in a row from one address, each
//!   login attempt from it waits its turn, one per
//!   [`THROTTLED_LOGIN_INTERVAL`] however many connections it opens
//!   ([`LoginThrottle`]). The right password still logs in, after its wait.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often one peer address and user may put a refused login in the log.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(60);
/// The most (peer address, user) pairs [`RefusalLog`] remembers; past it,
/// the oldest windows are forgotten, so a scan over many names or addresses
/// cannot grow it without bound.
const REFUSAL_LOG_PAIRS: usize = 4096;

/// Rate-limits the log line of a refused login: the first refusal of a
/// peer address and user is logged, later ones within
/// [`REFUSAL_LOG_INTERVAL`] are only counted, and the next line says how
/// many were left out. (Hand-written: `governor`'s keyed limiter would
/// bound the rate but not report what it suppressed.)
#[derive(Debug, Default)]
pub struct RefusalLog {
    windows: Mutex<HashMap<(IpAddr, String), Window>>,
}

#[derive(Debug)]
struct Window {
    opened: Instant,
    suppressed: u64,
}

impl RefusalLog {
    /// Whether the refusal of `user` from `peer` at `now` is to be logged;
    /// if so, how many refusals of the pair were left out before it.
    pub fn admit(&self, peer: IpAddr, user: &str, now: Instant) -> Option<u64> {
        let mut windows = self
            .windows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // A user name is a short string (≤ 255 bytes): the key is bounded.
        if let Some(window) = windows.get_mut(&(peer, user.to_string())) {
            if now.duration_since(window.opened) < REFUSAL_LOG_INTERVAL {
                window.suppressed += 1;
                return None;
            }
            let suppressed = window.suppressed;
            *window = Window {
                opened: now,
                suppressed: 0,
            };
            return Some(suppressed);
        }
        if windows.len() >= REFUSAL_LOG_PAIRS {
            windows.retain(|_, window| now.duration_since(window.opened) < REFUSAL_LOG_INTERVAL);
            if windows.len() >= REFUSAL_LOG_PAIRS {
                // Still full inside one interval: a flood. Forget it all
                // rather than grow; the metric still counts every refusal.
                windows.clear();
            }
        }
        windows.insert(
            (peer, user.to_string()),
            Window {
                opened: now,
                suppressed: 0,
            },
        );
        Some(0)
    }
}

/// Failed logins one address may make (within [`LOGIN_FAILURE_MEMORY`] of
/// each other, and not forgiven by the failing user's own success) before
/// its attempts are throttled.
pub const FREE_LOGIN_FAILURES: u32 = 10;
/// A throttled address gets one login attempt per this interval.
pub const THROTTLED_LOGIN_INTERVAL: Duration = Duration::from_secs(1);
/// An address is forgiven its failures after this long without one.
pub const LOGIN_FAILURE_MEMORY: Duration = Duration::from_secs(300);
/// The most addresses [`LoginThrottle`] remembers; past it the oldest are
/// forgotten, so a scan from many addresses cannot grow it without bound.
const THROTTLED_ADDRESSES: usize = 4096;
/// The most user names one address's failures are kept apart for; the
/// failures of further names are counted together, and only time forgives
/// them (a guesser cycling through names gains nothing from it).
const NAMES_PER_ADDRESS: usize = 32;

/// Slows login attempts from an address that keeps failing (hand-written
/// for the same reason as [`RefusalLog`]: `governor` limits a rate from the
/// first attempt, where this one must cost nothing until an address has
/// failed, and must forgive a user who then gets its password right).
///
/// Failures are counted per address and user name. An address is throttled
/// when the failures of all its names add up to [`FREE_LOGIN_FAILURES`]; a
/// successful login forgives only that user's failures at that address. So
/// a guesser who also holds an account gains nothing by logging in with
/// it between guesses, while a user who mistyped its own password is
/// forgiven by getting it right.
#[derive(Debug, Default)]
pub struct LoginThrottle {
    addresses: Mutex<HashMap<IpAddr, Failures>>,
}

#[derive(Debug)]
struct Failures {
    /// Failures per user name, at most [`NAMES_PER_ADDRESS`] names.
    by_user: HashMap<String, u32>,
    /// Failures of the names past [`NAMES_PER_ADDRESS`].
    other_users: u32,
    last: Instant,
    /// When the next throttled attempt may be checked.
    next_turn: Instant,
}

impl Failures {
    fn new(now: Instant) -> Self {
        Self {
            by_user: HashMap::new(),
            other_users: 0,
            last: now,
            next_turn: now,
        }
    }

    fn total(&self) -> u32 {
        self.by_user
            .values()
            .fold(self.other_users, |sum, n| sum.saturating_add(*n))
    }

    fn forgotten(&self, now: Instant) -> bool {
        now.duration_since(self.last) >= LOGIN_FAILURE_MEMORY
    }
}

impl LoginThrottle {
    /// How long a login attempt from `peer` at `now` waits before its
    /// credentials are checked: nothing until the address's failures reach
    /// [`FREE_LOGIN_FAILURES`], then its turn, one attempt per
    /// [`THROTTLED_LOGIN_INTERVAL`] (parallel connections queue up).
    pub fn wait(&self, peer: IpAddr, now: Instant) -> Duration {
        let mut addresses = self.lock();
        let Some(failures) = addresses.get_mut(&peer) else {
            return Duration::ZERO;
        };
        if failures.forgotten(now) {
            addresses.remove(&peer);
            return Duration::ZERO;
        }
        if failures.total() < FREE_LOGIN_FAILURES {
            return Duration::ZERO;
        }
        let turn = failures.next_turn.max(now);
        failures.next_turn = turn + THROTTLED_LOGIN_INTERVAL;
        turn.duration_since(now)
    }

    /// A login of `user` from `peer` was refused; true when this failure is
    /// the one that starts throttling the address (for a log line).
    pub fn failed(&self, peer: IpAddr, user: &str, now: Instant) -> bool {
        let mut addresses = self.lock();
        if addresses.len() >= THROTTLED_ADDRESSES && !addresses.contains_key(&peer) {
            addresses.retain(|_, f| !f.forgotten(now));
            if addresses.len() >= THROTTLED_ADDRESSES {
                // A flood from many addresses: forget the ones that failed
                // least, rather than grow.
                addresses.retain(|_, f| f.total() >= FREE_LOGIN_FAILURES);
                if addresses.len() >= THROTTLED_ADDRESSES {
                    addresses.clear();
                }
            }
        }
        let failures = addresses.entry(peer).or_insert_with(|| Failures::new(now));
        if failures.forgotten(now) {
            *failures = Failures::new(now);
        }
        let before = failures.total();
        if let Some(count) = failures.by_user.get_mut(user) {
            *count = count.saturating_add(1);
        } else if failures.by_user.len() < NAMES_PER_ADDRESS {
            // A user name is a short string (≤ 255 bytes): the key is bounded.
            failures.by_user.insert(user.to_string(), 1);
        } else {
            failures.other_users = failures.other_users.saturating_add(1);
        }
        failures.last = now;
        before < FREE_LOGIN_FAILURES && failures.total() >= FREE_LOGIN_FAILURES
    }

    /// A login of `user` from `peer` succeeded: that user's failures at
    /// that address are forgiven, nobody else's.
    pub fn succeeded(&self, peer: IpAddr, user: &str) {
        let mut addresses = self.lock();
        let Some(failures) = addresses.get_mut(&peer) else {
            return;
        };
        failures.by_user.remove(user);
        if failures.total() == 0 {
            addresses.remove(&peer);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Failures>> {
        self.addresses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
    const REMOTE: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7));

    #[test]
    fn refusals_are_logged_once_a_minute_per_peer_and_user() {
        let log = RefusalLog::default();
        let start = Instant::now();
        assert_eq!(log.admit(LOCAL, "guest", start), Some(0));
        assert_eq!(log.admit(LOCAL, "guest", start), None);
        assert_eq!(
            log.admit(LOCAL, "guest", start + Duration::from_secs(1)),
            None
        );
        // Another user, another address: their own windows.
        assert_eq!(log.admit(LOCAL, "app", start), Some(0));
        assert_eq!(log.admit(REMOTE, "guest", start), Some(0));
        // After the interval: logged again, with what was left out.
        assert_eq!(
            log.admit(LOCAL, "guest", start + REFUSAL_LOG_INTERVAL),
            Some(2)
        );
        assert_eq!(
            log.admit(LOCAL, "guest", start + REFUSAL_LOG_INTERVAL),
            None
        );
    }

    #[test]
    fn a_flood_of_names_does_not_grow_the_refusal_log_without_bound() {
        let log = RefusalLog::default();
        let now = Instant::now();
        for n in 0..3 * REFUSAL_LOG_PAIRS {
            assert_eq!(log.admit(REMOTE, &format!("user-{n}"), now), Some(0));
        }
        let held = log.windows.lock().map(|w| w.len()).unwrap_or(usize::MAX);
        assert!(held <= REFUSAL_LOG_PAIRS, "{held} pairs held");
    }

    #[test]
    fn a_failing_address_waits_its_turn_and_a_success_forgives_it() {
        let throttle = LoginThrottle::default();
        let start = Instant::now();
        for n in 1..FREE_LOGIN_FAILURES {
            assert_eq!(throttle.wait(REMOTE, start), Duration::ZERO);
            assert!(!throttle.failed(REMOTE, "guest", start), "failure {n}");
        }
        assert!(
            throttle.failed(REMOTE, "guest", start),
            "the last free failure starts the throttle"
        );
        // Three parallel attempts queue up, one interval apart; another
        // address is not slowed.
        let waits: Vec<Duration> = (0..3).map(|_| throttle.wait(REMOTE, start)).collect();
        assert_eq!(
            waits,
            [
                Duration::ZERO,
                THROTTLED_LOGIN_INTERVAL,
                THROTTLED_LOGIN_INTERVAL * 2
            ]
        );
        assert_eq!(throttle.wait(LOCAL, start), Duration::ZERO);
        // Later, the turn comes round again.
        let later = start + THROTTLED_LOGIN_INTERVAL * 10;
        assert_eq!(throttle.wait(REMOTE, later), Duration::ZERO);
        assert_eq!(throttle.wait(REMOTE, later), THROTTLED_LOGIN_INTERVAL);
        // A success forgives; so does a long quiet.
        throttle.succeeded(REMOTE, "guest");
        assert_eq!(throttle.wait(REMOTE, later), Duration::ZERO);
        for _ in 0..FREE_LOGIN_FAILURES {
            throttle.failed(REMOTE, "guest", later);
        }
        assert_eq!(throttle.wait(REMOTE, later), Duration::ZERO);
        assert!(throttle.wait(REMOTE, later) > Duration::ZERO);
        let forgiven = later + LOGIN_FAILURE_MEMORY;
        assert_eq!(throttle.wait(REMOTE, forgiven), Duration::ZERO);
        assert_eq!(throttle.wait(REMOTE, forgiven), Duration::ZERO);
    }

    #[test]
    fn another_users_success_forgives_nothing() {
        let throttle = LoginThrottle::default();
        let now = Instant::now();
        // A guesser with an account of its own logs in with it after nine
        // guesses at the administrator's password, then guesses again.
        for _ in 0..FREE_LOGIN_FAILURES - 1 {
            assert_eq!(throttle.wait(REMOTE, now), Duration::ZERO);
            assert!(!throttle.failed(REMOTE, "admin", now));
        }
        throttle.succeeded(REMOTE, "mallory");
        assert_eq!(throttle.wait(REMOTE, now), Duration::ZERO);
        assert!(
            throttle.failed(REMOTE, "admin", now),
            "the tenth failure throttles, whoever logged in between"
        );
        throttle.succeeded(REMOTE, "mallory");
        assert_eq!(throttle.wait(REMOTE, now), Duration::ZERO);
        assert_eq!(throttle.wait(REMOTE, now), THROTTLED_LOGIN_INTERVAL);
        // The administrator's own success forgives the administrator's
        // failures, and so the address.
        throttle.succeeded(REMOTE, "admin");
        assert_eq!(throttle.wait(REMOTE, now), Duration::ZERO);
        assert_eq!(throttle.wait(REMOTE, now), Duration::ZERO);
    }

    #[test]
    fn failures_of_many_names_add_up_and_stay_bounded() {
        let throttle = LoginThrottle::default();
        let now = Instant::now();
        for n in 0..10 * NAMES_PER_ADDRESS {
            throttle.failed(REMOTE, &format!("user-{n}"), now);
        }
        let (names, total) = throttle
            .addresses
            .lock()
            .map(|a| (a[&REMOTE].by_user.len(), a[&REMOTE].total()))
            .unwrap_or_default();
        assert!(names <= NAMES_PER_ADDRESS, "{names} names held");
        assert_eq!(total as usize, 10 * NAMES_PER_ADDRESS);
        // Successes of every name it tried leave the overflow's failures.
        for n in 0..10 * NAMES_PER_ADDRESS {
            throttle.succeeded(REMOTE, &format!("user-{n}"));
        }
        assert_eq!(throttle.wait(REMOTE, now), Duration::ZERO);
        assert_eq!(throttle.wait(REMOTE, now), THROTTLED_LOGIN_INTERVAL);
    }
}
