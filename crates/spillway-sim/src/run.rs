//! One run of the simulation: its schedule of faults, then the settling,
//! with the oracle after every step.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand08::rngs::StdRng;
use rand08::{Rng, SeedableRng};
use spillway_proto::storage::StorageApi as _;
use spillway_storage::group::{runtime, GroupSettings, LogLevels};
use spillway_storage::{RocksStore, StorageGroup};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::engine::SimEngine;
use crate::history::{Event, History};
use crate::network::{address_of, Host, Network, Weather, ENGINE_HOSTS};
use crate::oracle::{Oracle, Violation};
use crate::transport::SimTransport;

/// The shape of a run.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Storage members the group starts with.
    pub members: u64,
    /// One more member, started waiting to join: the schedule adds it
    /// (`add-member`) and later removes one of the members.
    pub joiner: bool,
    /// Engines running at once (one active, the others waiting for the
    /// lease).
    pub engines: u64,
    /// How long faults happen (simulated time).
    pub faults_for: Duration,
    /// How long the group has, once healed, to bring every member level.
    pub settle_within: Duration,
    /// The oracle looks after every step; a fault may start at each.
    pub step: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            members: 3,
            joiner: true,
            engines: 2,
            faults_for: Duration::from_secs(20),
            settle_within: Duration::from_secs(30),
            step: Duration::from_millis(100),
        }
    }
}

/// A run that kept every guarantee.
#[derive(Clone, Debug)]
pub struct Report {
    pub seed: u64,
    /// Equal for every run of the seed.
    pub digest: u64,
    pub faults: usize,
    pub leases: usize,
    pub confirmed: usize,
    pub refused: usize,
    pub effective_writes: usize,
    pub applied_index: u64,
    /// Membership changes that were answered: the joiner added, a member
    /// removed.
    pub members_added: usize,
    pub members_removed: usize,
    pub weather: String,
}

/// A run that broke a guarantee (or could not run).
#[derive(Debug)]
pub struct Failure {
    pub seed: u64,
    pub violation: Violation,
    /// The history's last events.
    pub tail: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "seed {} failed: {}\nlast events:\n{}\nreplay it: make sim SEED={}",
            self.seed, self.violation, self.tail, self.seed
        )
    }
}

/// Runs seed `seed` on this thread, on a runtime of its own.
pub fn run_seed(seed: u64, settings: &Settings) -> Result<Report, Failure> {
    let fail = |detail: String| Failure {
        seed,
        violation: Violation::Unsettled(detail),
        tail: String::new(),
    };
    runtime::seed_this_thread(seed);
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_time().start_paused(true);
    // tokio's own choices (which branch of a `select!` goes first) from
    // the seed too; without `--cfg tokio_unstable` they vary per run.
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(&seed.to_le_bytes()));
    let runtime = builder
        .build()
        .map_err(|error| fail(format!("no runtime: {error}")))?;
    let dir = tempfile::tempdir().map_err(|error| fail(format!("no temp dir: {error}")))?;
    let result = runtime.block_on(async {
        let mut run = Run::new(seed, settings.clone(), dir.path())?;
        let outcome = run.go().await.map(|()| run.report());
        run.stop().await;
        outcome.map_err(|violation| Failure {
            seed,
            violation,
            tail: run.history.lock().tail(40),
        })
    });
    // Tasks still holding members end with the runtime, before the
    // in-memory stores' directory goes.
    drop(runtime);
    result
}

/// A member's slot: its in-memory RocksDB environment outlives its
/// crashes, as a disk does.
struct Slot {
    env: rocksdb::Env,
    path: PathBuf,
}

/// What the operator has done to the membership, by task.
#[derive(Default)]
struct Membership {
    /// An add or remove is under way.
    busy: bool,
    added: bool,
    /// The member removed (then stopped for good).
    removed: Option<Host>,
}

/// The operator's host (never cut off).
const OPERATOR: Host = ENGINE_HOSTS - 1;

/// A fault undone at a given time.
enum Undo {
    Restart(Host),
    Reconnect(Host),
}

struct Run {
    seed: u64,
    settings: Settings,
    rng: StdRng,
    weather: Weather,
    network: Arc<Network>,
    history: Arc<Mutex<History>>,
    oracle: Oracle,
    slots: BTreeMap<Host, Slot>,
    /// Engines by number.
    engines: BTreeMap<u64, JoinHandle<()>>,
    next_engine: u64,
    /// Engine slots to fill again, and when.
    engine_restarts: Vec<Instant>,
    undo: Vec<(Instant, Undo)>,
    faults: usize,
    membership: Arc<Mutex<Membership>>,
    /// Members stopped for good (removed from the group).
    retired: Vec<Host>,
}

fn unsettled(detail: impl std::fmt::Display) -> Violation {
    Violation::Unsettled(detail.to_string())
}

impl Run {
    fn new(seed: u64, settings: Settings, dir: &Path) -> Result<Self, Failure> {
        let mut rng = StdRng::seed_from_u64(seed);
        let weather = Weather {
            max_delay: Duration::from_millis(rng.gen_range(1..=25)),
            // A third of the runs lose nothing, a third a little, a third
            // up to 3%.
            lost_per_mille: match rng.gen_range(0..3) {
                0 => 0,
                1 => rng.gen_range(1..=5),
                _ => rng.gen_range(6..=30),
            },
        };
        let mut slots = BTreeMap::new();
        let slots_wanted = settings.members + u64::from(settings.joiner);
        for id in 1..=slots_wanted {
            let env = rocksdb::Env::mem_env().map_err(|error| Failure {
                seed,
                violation: unsettled(format!("no in-memory RocksDB environment: {error}")),
                tail: String::new(),
            })?;
            slots.insert(
                id,
                Slot {
                    env,
                    path: dir.join(format!("member-{id}")),
                },
            );
        }
        Ok(Self {
            seed,
            settings,
            rng,
            weather,
            network: Arc::new(Network::new(seed, weather)),
            history: Arc::new(Mutex::new(History::new())),
            oracle: Oracle::default(),
            slots,
            engines: BTreeMap::new(),
            next_engine: 1,
            engine_restarts: Vec::new(),
            undo: Vec::new(),
            faults: 0,
            membership: Arc::new(Mutex::new(Membership::default())),
            retired: Vec::new(),
        })
    }

    fn record(&self, event: Event) {
        self.history.lock().record(event);
    }

    fn fault(&mut self, what: String) {
        self.faults += 1;
        self.record(Event::Fault(what));
    }

    async fn start_member(&self, id: Host) -> Result<(), Violation> {
        let Some(slot) = self.slots.get(&id) else {
            return Err(unsettled(format!("no member {id}")));
        };
        // A crashed member's store closes once the calls it was serving
        // end: wait for that, in simulated time.
        let mut tries = 0;
        let store = loop {
            match RocksStore::open_in_memory(&slot.env, &slot.path) {
                Ok(store) => break store,
                Err(error) if tries >= 500 => {
                    return Err(unsettled(format!("member {id} cannot reopen: {error}")))
                }
                Err(_) => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        // The initial members form the group; the joiner knows it and
        // waits to be added.
        let joins = id > self.settings.members;
        let known = if joins { id } else { self.settings.members };
        let settings = GroupSettings {
            node_id: id,
            members: (1..=known).map(|id| (id, address_of(id))).collect(),
            heartbeat: Duration::from_millis(100),
            // No snapshots: the simulation's members keep their logs (a
            // member that lost its disk is the fault drills' business).
            snapshot_entries: u64::MAX / 2,
            join: joins,
        };
        let transport = SimTransport {
            me: id,
            network: self.network.clone(),
        };
        let member = StorageGroup::start_over(store, settings, transport)
            .await
            .map_err(|error| unsettled(format!("member {id} does not start: {error}")))?;
        self.network.member_up(id, member);
        Ok(())
    }

    async fn crash_member(&mut self, id: Host) -> Result<(), Violation> {
        // What it applied is read before it goes (the oracle's promise).
        self.observe().await?;
        if let Some(member) = self.network.member_down(id) {
            member.shutdown().await;
        }
        Ok(())
    }

    fn start_engine(&mut self) -> Result<(), Violation> {
        let number = self.next_engine;
        self.next_engine += 1;
        let members: Vec<Host> = self.slots.keys().copied().collect();
        let pace = Duration::from_millis(self.rng.gen_range(1..=20));
        let engine = SimEngine::new(
            number,
            &members,
            self.network.clone(),
            self.history.clone(),
            pace,
        )
        .map_err(unsettled)?;
        self.engines.insert(number, tokio::spawn(engine.run()));
        Ok(())
    }

    async fn observe(&mut self) -> Result<(), Violation> {
        let members = self.network.members();
        let confirmed: Vec<_> = self.history.lock().confirmed().collect();
        self.oracle.observe(&members, confirmed.into_iter()).await
    }

    /// The faults of the schedule, then the settling; the oracle after
    /// every step.
    async fn go(&mut self) -> Result<(), Violation> {
        let ids: Vec<Host> = self.slots.keys().copied().collect();
        for id in ids {
            self.start_member(id).await?;
        }
        for _ in 0..self.settings.engines {
            self.start_engine()?;
        }
        let started = Instant::now();
        while started.elapsed() < self.settings.faults_for {
            tokio::time::sleep(self.settings.step).await;
            self.observe().await?;
            self.undo_due().await?;
            self.retire_removed().await;
            self.replace_stopped_engines()?;
            if self.rng.gen_bool(0.12) {
                self.next_fault().await?;
            }
        }
        self.heal().await?;
        self.settle().await
    }

    /// Undoes the faults whose time has come.
    async fn undo_due(&mut self) -> Result<(), Violation> {
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.undo)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.undo = later;
        for (_, undo) in due {
            match undo {
                Undo::Restart(id) if self.retired.contains(&id) => {}
                Undo::Restart(id) => {
                    self.record(Event::Fault(format!("member {id} restarts")));
                    self.start_member(id).await?;
                }
                Undo::Reconnect(host) => {
                    self.record(Event::Fault(format!("host {host} reconnected")));
                    self.network.reconnect(host);
                }
            }
        }
        Ok(())
    }

    /// An engine that stepped down (or was killed) is replaced after a
    /// while, as a restarted container would be.
    fn replace_stopped_engines(&mut self) -> Result<(), Violation> {
        let now = Instant::now();
        let stopped: Vec<u64> = self
            .engines
            .iter()
            .filter(|(_, task)| task.is_finished())
            .map(|(number, _)| *number)
            .collect();
        for number in stopped {
            self.engines.remove(&number);
            let delay = Duration::from_millis(self.rng.gen_range(200..=2_000));
            self.engine_restarts.push(now + delay);
        }
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.engine_restarts)
            .into_iter()
            .partition(|at| *at <= now);
        self.engine_restarts = later;
        for _ in due {
            self.start_engine()?;
        }
        Ok(())
    }

    async fn next_fault(&mut self) -> Result<(), Violation> {
        let now = Instant::now();
        let members: Vec<Host> = self.slots.keys().copied().collect();
        let up: Vec<Host> = self.network.members().keys().copied().collect();
        let for_a_while = |rng: &mut StdRng| Duration::from_millis(rng.gen_range(200..=4_000));
        match self.rng.gen_range(0..6) {
            // Add the joiner, or later remove a member.
            5 => self.change_membership(),
            // Crash a member (never more than all but one at once).
            0 if up.len() > 1 => {
                let id = up[self.rng.gen_range(0..up.len())];
                self.fault(format!("member {id} crashes"));
                self.crash_member(id).await?;
                let back = for_a_while(&mut self.rng);
                self.undo.push((now + back, Undo::Restart(id)));
            }
            // Cut a member off from every other host.
            1 => {
                let id = members[self.rng.gen_range(0..members.len())];
                self.fault(format!("member {id} cut off"));
                self.network.cut(id, self.all_hosts());
                let back = for_a_while(&mut self.rng);
                self.undo.push((now + back, Undo::Reconnect(id)));
            }
            // Cut two members apart (the engines reach both).
            2 => {
                let a = members[self.rng.gen_range(0..members.len())];
                let b = members[self.rng.gen_range(0..members.len())];
                if a != b {
                    self.fault(format!("members {a} and {b} cut apart"));
                    self.network.cut(a, [b]);
                    let back = for_a_while(&mut self.rng);
                    self.undo.push((now + back, Undo::Reconnect(a)));
                }
            }
            // Cut an engine off (longer than its lease, at times).
            3 => {
                if let Some(number) = self.pick_engine() {
                    let host = ENGINE_HOSTS + number;
                    self.fault(format!("engine {number} cut off"));
                    self.network.cut(host, self.all_hosts());
                    let back = Duration::from_millis(self.rng.gen_range(200..=6_000));
                    self.undo.push((now + back, Undo::Reconnect(host)));
                }
            }
            // Kill an engine.
            _ => {
                if let Some(number) = self.pick_engine() {
                    self.fault(format!("engine {number} killed"));
                    if let Some(task) = self.engines.get(&number) {
                        task.abort();
                    }
                }
            }
        }
        Ok(())
    }

    /// Starts the next membership change, as an operator's `spillctl`
    /// would, through the engine's client of the group.
    fn change_membership(&mut self) {
        let joiner = self.settings.members + 1;
        let mut membership = self.membership.lock();
        if !self.settings.joiner || membership.busy || membership.removed.is_some() {
            return;
        }
        let change = if membership.added {
            let removed = self.rng.gen_range(1..=joiner);
            self.history
                .lock()
                .record(Event::Fault(format!("removing member {removed}")));
            Err(removed)
        } else {
            self.history
                .lock()
                .record(Event::Fault(format!("adding member {joiner}")));
            Ok(joiner)
        };
        membership.busy = true;
        drop(membership);
        let links: Vec<Host> = self.slots.keys().copied().collect();
        let operator = match SimEngine::client(OPERATOR, &links, self.network.clone()) {
            Ok(operator) => operator,
            Err(_) => return,
        };
        let (state, history) = (self.membership.clone(), self.history.clone());
        tokio::spawn(async move {
            // As spillctl's call has its deadline (a lost answer may never
            // come).
            let call = async {
                match change {
                    Ok(id) => operator.add_member(id, address_of(id)).await,
                    Err(id) => operator.remove_member(id).await,
                }
            };
            let done = tokio::time::timeout(Duration::from_secs(30), call)
                .await
                .unwrap_or_else(|_| {
                    Err(spillway_proto::ServiceError::Unavailable(
                        "no answer within 30 s".into(),
                    ))
                });
            let mut state = state.lock();
            state.busy = false;
            match (change, done) {
                (Ok(id), Ok(_)) => {
                    state.added = true;
                    history
                        .lock()
                        .record(Event::Fault(format!("member {id} added")));
                }
                (Err(id), Ok(_)) => {
                    state.removed = Some(id);
                    history
                        .lock()
                        .record(Event::Fault(format!("member {id} removed")));
                }
                (_, Err(error)) => history
                    .lock()
                    .record(Event::Fault(format!("membership change failed: {error}"))),
            }
        });
    }

    /// A member removed from the group is stopped for good.
    async fn retire_removed(&mut self) {
        let removed = self.membership.lock().removed;
        let Some(id) = removed else {
            return;
        };
        if self.retired.contains(&id) {
            return;
        }
        self.retired.push(id);
        self.record(Event::Fault(format!("member {id} stopped for good")));
        if let Some(member) = self.network.member_down(id) {
            member.shutdown().await;
        }
    }

    fn pick_engine(&mut self) -> Option<u64> {
        let running: Vec<u64> = self.engines.keys().copied().collect();
        if running.is_empty() {
            return None;
        }
        Some(running[self.rng.gen_range(0..running.len())])
    }

    /// Every host the faults can cut: members and engines.
    fn all_hosts(&self) -> Vec<Host> {
        let engines = (1..self.next_engine).map(|number| ENGINE_HOSTS + number);
        self.slots.keys().copied().chain(engines).collect()
    }

    /// Every fault undone: cuts healed, crashed members restarted.
    async fn heal(&mut self) -> Result<(), Violation> {
        self.record(Event::Fault("every fault healed".into()));
        self.network.heal();
        self.undo.clear();
        let up = self.network.members();
        let ids: Vec<Host> = self.slots.keys().copied().collect();
        for id in ids {
            if !up.contains_key(&id) && !self.retired.contains(&id) {
                self.start_member(id).await?;
            }
        }
        Ok(())
    }

    /// The engines write a little longer on a healed group, then stop;
    /// every member must then reach the leader's last entry.
    async fn settle(&mut self) -> Result<(), Violation> {
        let writing = Instant::now();
        while writing.elapsed() < Duration::from_secs(3) {
            tokio::time::sleep(self.settings.step).await;
            self.observe().await?;
            self.replace_stopped_engines()?;
        }
        for task in self.engines.values() {
            task.abort();
        }
        let started = Instant::now();
        loop {
            tokio::time::sleep(self.settings.step).await;
            self.observe().await?;
            self.retire_removed().await;
            // Every member of the leader's membership runs and has applied
            // the leader's last entry.
            let members = self.network.members();
            let levels: BTreeMap<Host, LogLevels> = members
                .iter()
                .map(|(id, member)| (*id, member.log_levels()))
                .collect();
            let leader = members
                .iter()
                .find(|(id, _)| levels.get(id).is_some_and(|levels| levels.leads));
            let level = leader.is_some_and(|(id, leader)| {
                let last = levels.get(id).and_then(|levels| levels.last_log);
                leader.status().members.iter().all(|member| {
                    levels
                        .get(&member.id)
                        .is_some_and(|levels| levels.applied == last)
                })
            });
            if level && !self.membership.lock().busy {
                break;
            }
            if started.elapsed() > self.settings.settle_within {
                return Err(unsettled(format!(
                    "members not level {} s after healing: {levels:?}",
                    self.settings.settle_within.as_secs()
                )));
            }
        }
        // The records of every member in the group (not of a joiner never
        // added).
        let mut members = self.network.members();
        if let Some((_, leader)) = members.iter().find(|(_, m)| m.log_levels().leads) {
            let ids: Vec<Host> = leader.status().members.iter().map(|m| m.id).collect();
            members.retain(|id, _| ids.contains(id));
        }
        self.oracle.check_records(&members).await
    }

    async fn stop(&mut self) {
        for task in self.engines.values() {
            task.abort();
        }
        for id in self.network.members().keys().copied().collect::<Vec<_>>() {
            if let Some(member) = self.network.member_down(id) {
                member.shutdown().await;
            }
        }
    }

    fn report(&self) -> Report {
        let history = self.history.lock();
        let count = |wanted: fn(&Event) -> bool| {
            history
                .events()
                .iter()
                .filter(|(_, event)| wanted(event))
                .count()
        };
        Report {
            seed: self.seed,
            digest: history.digest(),
            faults: self.faults,
            leases: count(|event| matches!(event, Event::LeaseTaken { .. })),
            confirmed: count(|event| matches!(event, Event::Confirmed(_))),
            refused: count(|event| matches!(event, Event::Refused { .. })),
            effective_writes: self.oracle.effective_writes(),
            members_added: count(
                |event| matches!(event, Event::Fault(what) if what.ends_with(" added")),
            ),
            members_removed: count(
                |event| matches!(event, Event::Fault(what) if what.ends_with(" removed")),
            ),
            applied_index: self.oracle.applied_index(),
            weather: format!(
                "delays up to {} ms, {} of 1000 messages lost",
                self.weather.max_delay.as_millis(),
                self.weather.lost_per_mille
            ),
        }
    }
}
