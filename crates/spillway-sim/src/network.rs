//! The simulated network: every message between two hosts (a member's
//! openraft message, an engine's call to a member, and each answer) is
//! delayed by a seeded draw, may be lost, and is refused while the two
//! hosts are cut apart or the target is down.
//!
//! A call runs its work at the target only once the request arrives, so a
//! lost answer still leaves the work done (the case a retried write must
//! survive). Independent delays reorder messages. A lost message fails
//! after its delay (a reset connection), or, one time in four, never
//! answers (the caller's own timeout ends it).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::Duration;

use parking_lot::Mutex;
use rand08::rngs::StdRng;
use rand08::{Rng, SeedableRng};
use spillway_storage::StorageGroup;
use tokio::sync::watch;

/// A host of the simulation: storage members are 1..=N, engines above
/// [`ENGINE_HOSTS`].
pub type Host = u64;

/// Engine hosts are numbered from here (one per engine incarnation).
pub const ENGINE_HOSTS: Host = 100;

/// How the network misbehaves in one run (drawn from its seed).
#[derive(Clone, Copy, Debug)]
pub struct Weather {
    /// Each message takes 0 to this long.
    pub max_delay: Duration,
    /// Of each thousand messages, this many are lost.
    pub lost_per_mille: u32,
}

struct State {
    rng: StdRng,
    weather: Weather,
    /// Pairs of hosts that cannot reach each other (smaller host first).
    cut: BTreeSet<(Host, Host)>,
    /// The members that run, by id, each with a sender whose drop (the
    /// member's crash) ends the calls it is serving.
    members: BTreeMap<Host, (StorageGroup, watch::Sender<()>)>,
}

/// The network and the members on it. Shared by every task of one run.
pub struct Network {
    state: Mutex<State>,
}

/// Why a message did not get through.
#[derive(Debug, Clone)]
pub struct Undelivered(pub String);

impl std::fmt::Display for Undelivered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Undelivered {}

fn pair(a: Host, b: Host) -> (Host, Host) {
    (a.min(b), a.max(b))
}

impl Network {
    pub fn new(seed: u64, weather: Weather) -> Self {
        Self {
            state: Mutex::new(State {
                // Its own stream: the schedule draws from another.
                rng: StdRng::seed_from_u64(seed ^ 0x6e65_7477_6f72_6b21),
                weather,
                cut: BTreeSet::new(),
                members: BTreeMap::new(),
            }),
        }
    }

    /// Cuts `host` off from every host in `others`.
    pub fn cut(&self, host: Host, others: impl IntoIterator<Item = Host>) {
        let mut state = self.state.lock();
        for other in others {
            if other != host {
                state.cut.insert(pair(host, other));
            }
        }
    }

    /// Every cut of `host` healed.
    pub fn reconnect(&self, host: Host) {
        self.state
            .lock()
            .cut
            .retain(|(a, b)| *a != host && *b != host);
    }

    /// Every cut healed.
    pub fn heal(&self) {
        self.state.lock().cut.clear();
    }

    pub fn is_cut(&self, a: Host, b: Host) -> bool {
        self.state.lock().cut.contains(&pair(a, b))
    }

    /// `member` runs (from now on reachable).
    pub fn member_up(&self, id: Host, member: StorageGroup) {
        let (alive, _) = watch::channel(());
        self.state.lock().members.insert(id, (member, alive));
    }

    /// `member` is down: messages to it are refused. Its handle, to stop.
    pub fn member_down(&self, id: Host) -> Option<StorageGroup> {
        self.state
            .lock()
            .members
            .remove(&id)
            .map(|(member, _alive)| member)
    }

    /// The members that run.
    pub fn members(&self) -> BTreeMap<Host, StorageGroup> {
        self.state
            .lock()
            .members
            .iter()
            .map(|(id, (member, _))| (*id, member.clone()))
            .collect()
    }

    /// (delay, lost, hangs if lost)
    fn draw(&self) -> (Duration, bool, bool) {
        let mut state = self.state.lock();
        let max = state.weather.max_delay.as_micros() as u64;
        let delay = Duration::from_micros(state.rng.gen_range(0..=max));
        let lost = state.rng.gen_range(0..1000) < state.weather.lost_per_mille;
        let hangs = state.rng.gen_bool(0.25);
        (delay, lost, hangs)
    }

    /// One leg of a message from `from` to `to`: its delay, then whether it
    /// got through.
    async fn leg(&self, from: Host, to: Host, what: &str) -> Result<(), Undelivered> {
        let (delay, lost, hangs) = self.draw();
        tokio::time::sleep(delay).await;
        if lost && hangs {
            std::future::pending::<()>().await;
        }
        if lost {
            return Err(Undelivered(format!("{what} from {from} to {to} lost")));
        }
        if self.is_cut(from, to) {
            return Err(Undelivered(format!(
                "{what} from {from} to {to}: the hosts are cut apart"
            )));
        }
        Ok(())
    }

    /// Sends a request from `from` to member `to`, runs `work` on the member
    /// as it runs when the request arrives, and brings the answer back.
    pub async fn call<T, F, Fut>(&self, from: Host, to: Host, work: F) -> Result<T, Undelivered>
    where
        F: FnOnce(StorageGroup) -> Fut,
        Fut: Future<Output = T>,
    {
        self.leg(from, to, "request").await?;
        let member = self
            .state
            .lock()
            .members
            .get(&to)
            .map(|(member, alive)| (member.clone(), alive.subscribe()));
        let Some((member, mut alive)) = member else {
            return Err(Undelivered(format!("member {to} is down")));
        };
        // A crash ends what the member was doing for the caller, as the
        // process's end does (and lets its store close).
        let answer = tokio::select! {
            biased;
            _ = alive.changed() => {
                return Err(Undelivered(format!("member {to} crashed while serving")));
            }
            answer = work(member) => answer,
        };
        self.leg(to, from, "answer").await?;
        Ok(answer)
    }
}

/// The address a member is known by (in the membership and in a
/// redirection to the leader).
pub fn address_of(id: Host) -> String {
    format!("sim://{id}")
}

/// The member an address names.
pub fn member_at(address: &str) -> Option<Host> {
    address.strip_prefix("sim://")?.parse().ok()
}
