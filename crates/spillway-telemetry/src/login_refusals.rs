//! Rate-limited log lines for refused logins, shared by the AMQP gateway
//! and management: the first refusal of a peer address and user is logged,
//! later ones within [`REFUSAL_LOG_INTERVAL`] are only counted, and the next
//! line says how many were left out.

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
}
