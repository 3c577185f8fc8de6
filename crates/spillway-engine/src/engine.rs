//! The [`Engine`]: the state every session shares (the broker behind its
//! lock, the store writer, the memory budget), its start-up (recovery, in
//! `recovery.rs`), and the background tasks that live as long as it does:
//! the store quota watch, housekeeping (flow to disk), and the loader that
//! reads payloads back. Each client connection is a session task
//! (`session.rs`), opened through [`EngineApi`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use parking_lot::Mutex;
use spillway_proto::util::backoff::Backoff;
use spillway_proto::{
    engine::{EngineApi, SessionStreams},
    storage::StorageApi,
    ServiceError,
};
use tokio::sync::{mpsc, Notify, Semaphore};

use crate::access::{AccessControl, LoginRefusal, Permissions};

use crate::broker::flow_to_disk::{FlowStatus, LoadRequest};
use crate::broker::{Broker, BrokerParts};
use crate::budget::MemoryBudget;
use crate::config::EngineConfig;
use crate::persistence::{FailureSource, StoreWriter};
use crate::recovery;
use crate::session::run_session;
use crate::settings::SeedUser;
use crate::shared::{load, LeaseTerms, Shared};
use spillway_proto::engine::LoginResult;

/// Payload reads in flight to the store at once.
const CONCURRENT_LOADS: usize = 4;

/// How long a clean shutdown waits for the store to take what is queued.
const SHUTDOWN_FLUSH_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot recover durable state from the store: {0}")]
    Recovery(#[from] ServiceError),
    /// The store would not lease itself to this engine: another engine
    /// holds it (one engine per store), or the storage node is not there.
    #[error("cannot take the store's lease: {0}")]
    Lease(ServiceError),
}

impl EngineError {
    /// Another engine holds the store's lease (or the lease call was
    /// refused otherwise): waiting longer than the lease lasts will not
    /// help.
    pub fn is_lease_refused(&self) -> bool {
        matches!(self, EngineError::Lease(error) if !error.is_transient())
    }
}

/// The queue engine. Cheap to clone; all clones share one broker.
#[derive(Clone)]
pub struct Engine {
    pub(crate) shared: Arc<Shared>,
}

impl Engine {
    /// Starts the engine on a store: durable exchanges, queues and bindings
    /// are recovered before it returns; the queues' messages are read in the
    /// background while it serves (`recovery.rs`).
    pub async fn start(
        store: Arc<dyn StorageApi>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        let holder = lease_holder();
        let lease = store
            .acquire_lease(spillway_proto::storage::AcquireLeaseRequest {
                epoch: 0,
                ttl_ms: config.lease_ttl.as_millis() as u64,
                holder: holder.clone(),
            })
            .await
            .map_err(EngineError::Lease)?;
        tracing::info!(epoch = lease.epoch, store_id = %lease.store_id, "store leased");
        // Definitions only: queues' messages are read in the background,
        // once the engine serves (`recovery::run`).
        let mut definitions = match store.load_definitions().await {
            Ok(definitions) => definitions,
            Err(error) => {
                // The next attempt must not wait for this lease to expire.
                let _ = store.release_lease(lease.epoch).await;
                return Err(error.into());
            }
        };
        let budget = Arc::new(MemoryBudget::new(config.settings.flow_to_disk_threshold()));
        let writer = StoreWriter::start(
            store.clone(),
            budget.clone(),
            lease.epoch,
            config.settings.writer_limits(),
        );
        let (loads, load_requests) = mpsc::unbounded_channel();
        let housekeeping_kick = Arc::new(Notify::new());
        let mut broker = Broker::new(
            &config,
            BrokerParts {
                persist: writer.clone(),
                budget: budget.clone(),
                loads,
            },
        );
        let mut access = AccessControl::from_definitions(
            std::mem::take(&mut definitions.users),
            std::mem::take(&mut definitions.permissions),
        );
        // Only a store that never held a user is seeded: one whose users
        // were all deleted, or found corrupt, stays without (fails closed,
        // as RabbitMQ seeds its default user on a node's first start only).
        match (access.is_empty(), definitions.had_users) {
            (true, false) => seed_users(&mut access, &config.settings.users, &writer),
            (true, true) => tracing::error!(
                "the store has no users left (deleted, or corrupt records removed): none are seeded \
                 again; add one through management with its token (management.token)"
            ),
            (false, _) => {}
        }
        let first_id = recovery::first_message_id(lease.epoch);
        let recovering = recovery::install_definitions(&mut broker, definitions, first_id);
        broker.schedule_recovered_expiries();
        let expiry_wake = broker.expiry.waker();
        let delayed_wake = broker.delayed.waker();
        let tx_timer = broker.tx.waker();
        let shared = Arc::new(Shared {
            broker: Mutex::new(broker),
            next_session: AtomicU64::new(1),
            writer,
            budget,
            housekeeping_kick,
            tx_timer: tx_timer.clone(),
            store: Mutex::new(Some(store.clone())),
            lease: LeaseTerms {
                store_id: lease.store_id,
                holder,
                ttl: config.lease_ttl,
            },
            lease_lost: tokio::sync::watch::Sender::new(None),
            max_message_size: config.max_message_size,
            access_generation: AtomicU64::new(access.generation()),
            access: parking_lot::RwLock::new(access),
        });
        // Message bytes as the flow-to-disk threshold counts them
        // (transactions' held publishes included); nothing once this
        // engine is gone.
        let counted = Arc::downgrade(&shared.budget);
        config.memory_ceiling.count("messages", move || {
            counted.upgrade().map_or(0, |budget| budget.used_bytes())
        });
        tokio::spawn(run_quota_watch(Arc::downgrade(&shared)));
        tokio::spawn(run_lease_renewal(Arc::downgrade(&shared)));
        tokio::spawn(run_failure_watch(
            Arc::downgrade(&shared),
            shared.writer.watch_failure(),
        ));
        tokio::spawn(run_loader(Arc::downgrade(&shared), load_requests));
        tokio::spawn(recovery::run(
            Arc::downgrade(&shared),
            lease.epoch,
            recovering,
        ));
        tokio::spawn(run_housekeeping(
            Arc::downgrade(&shared),
            config.settings.housekeeping_interval,
        ));
        tokio::spawn(run_expiry(Arc::downgrade(&shared), expiry_wake));
        tokio::spawn(run_delayed(Arc::downgrade(&shared), delayed_wake, first_id));
        tokio::spawn(run_tx_timeouts(Arc::downgrade(&shared), tx_timer));
        Ok(Self { shared })
    }
}

impl Engine {
    /// Flushes pending writes and releases the store. Call after the
    /// gateways have stopped; later writes are refused (and logged).
    pub async fn shutdown(&self) {
        let writer = &self.shared.writer;
        if tokio::time::timeout(SHUTDOWN_FLUSH_TIMEOUT, writer.stop())
            .await
            .is_err()
        {
            tracing::error!("the store did not take the last writes in time, giving up");
            writer.abandon();
            let _ = tokio::time::timeout(SHUTDOWN_FLUSH_TIMEOUT, writer.stop()).await;
        }
        let store = self.shared.store.lock().take();
        if let Some(store) = store {
            // The next engine on this store need not wait for it to expire.
            let epoch = writer.epoch();
            match store.release_lease(epoch).await {
                Ok(()) => tracing::info!(epoch, "store lease released"),
                Err(error) => tracing::warn!(%error, epoch, "cannot release the store lease"),
            }
        }
    }

    /// Resolves, with the reason, once this engine has lost the store's
    /// lease: the store refused to renew it (another engine holds it, or
    /// the storage node serves another store), or it went unrenewed for
    /// three times its TTL (a standby engine may have taken it after one). An
    /// engine among standbys must then stop serving (`engine.standby`:
    /// the process exits and its sessions end with `320`). Never resolves
    /// while the lease is held.
    pub async fn lease_lost(&self) -> String {
        let mut lost = self.shared.lease_lost.subscribe();
        let reason = match lost.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone(),
            Err(_) => None,
        };
        match reason {
            Some(reason) => reason,
            None => std::future::pending().await,
        }
    }

    /// The store writer's queue: writes and their bytes.
    pub fn store_writer_queue(&self) -> (u64, u64) {
        self.shared.writer.queued()
    }

    /// The permanent store failure in force (`MST-1101`), if any.
    pub fn store_failure(&self) -> Option<String> {
        self.shared
            .writer
            .failure()
            .map(|failure| failure.0.to_string())
    }

    /// How start-up recovery of durable queues' messages is going.
    pub fn recovery_progress(&self) -> spillway_proto::management::RecoveryStatus {
        crate::broker::recovery::status(&self.shared.broker.lock().recovery)
    }

    /// Channels whose transaction is open (`broker/tx.rs`).
    pub fn open_transactions(&self) -> u64 {
        self.shared.broker.lock().tx.open_count() as u64
    }

    /// The channels producer flow control holds back right now.
    pub fn blocked_channels(&self) -> Vec<crate::broker::producer_flow::BlockedChannel> {
        self.shared.broker.lock().blocked_channels()
    }

    /// Flow to disk at this moment: on or off, the threshold, resident and
    /// spilled bytes.
    pub fn flow_status(&self) -> FlowStatus {
        self.shared.broker.lock().flow_status()
    }

    /// Changes the flow-to-disk threshold at once (management's runtime
    /// setting): housekeeping runs straight away with it.
    pub fn set_flow_to_disk_threshold(&self, bytes: u64) {
        let previous = self.shared.budget.threshold();
        self.shared.budget.set_threshold(bytes);
        tracing::info!(
            setting = "engine.flow_to_disk_threshold",
            previous,
            value = bytes,
            "runtime setting changed"
        );
        self.shared.housekeeping_kick.notify_one();
    }
}

/// Stores the configuration's users in a store that has none, each with
/// every permission in the default vhost (as RabbitMQ gives its default
/// user). Synced with the store writer's first batch.
fn seed_users(access: &mut AccessControl, seeds: &[SeedUser], writer: &StoreWriter) {
    use spillway_proto::storage::{write_op::Op, WriteOp};
    let mut ops = Vec::new();
    for seed in seeds {
        let user = match access.put_user(
            &seed.name,
            Some(&seed.password),
            seed.tags.clone(),
            seed.loopback_only,
        ) {
            Ok(user) => user,
            Err(error) => {
                tracing::warn!(user = %seed.name, %error, "configured user not stored");
                continue;
            }
        };
        let all = Permissions::all();
        ops.push(WriteOp {
            op: Some(Op::PutUser(user.definition())),
        });
        ops.push(WriteOp {
            op: Some(Op::PutPermission(all.definition(&seed.name, "/"))),
        });
        // The user exists: this cannot fail.
        let _ = access.set_permissions(&seed.name, "/", all);
    }
    tracing::info!(
        users = seeds.len(),
        "the store has no users: the configured ones are stored, with every permission in vhost '/'"
    );
    writer.submit_synced(ops, None);
}

/// Follows the storage node's disk quota state for as long as the engine
/// lives, watching again whenever the stream breaks (the storage node
/// restarted): it sends the current state first, so nothing is missed. The
/// last state known holds meanwhile.
async fn run_quota_watch(shared: std::sync::Weak<Shared>) {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        // The store only for the call: the stream does not keep it open.
        let Some(store) = shared.upgrade().and_then(|engine| engine.store()) else {
            return;
        };
        let watching = store.watch_quota().await;
        drop(store);
        match watching {
            Ok(mut states) => {
                while let Some(state) = states.next().await {
                    let Ok(state) = state else { break };
                    let Some(engine) = shared.upgrade() else {
                        return;
                    };
                    engine.broker.lock().set_store_overfull(state.overfull);
                    backoff.reset();
                }
            }
            Err(error) => {
                tracing::debug!(%error, "cannot watch the store quota yet, retrying");
            }
        }
        backoff.wait().await;
    }
}

/// Who asks for the lease: the host and the process, for the refusal a
/// second engine sees.
fn lease_holder() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|host| host.trim().to_string())
        .filter(|host| !host.is_empty())
        .unwrap_or_else(|| "unknown-host".to_string());
    format!("engine pid {} on {host}", std::process::id())
}

/// Renews the engine's lease every fifth of its TTL for as long as the
/// engine lives. A refusal (the lease went to another engine, or the
/// storage node now serves another store: a wrong or empty data directory)
/// is a permanent store failure (`MST-1101`); a renewal that works again
/// clears it. A storage node that is down is the writer's business.
async fn run_lease_renewal(shared: std::sync::Weak<Shared>) {
    let Some(terms) = shared.upgrade().map(|engine| engine.lease.clone()) else {
        return;
    };
    let every = (terms.ttl / 5).max(Duration::from_millis(50));
    let mut renewed_at = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(every).await;
        let Some(engine) = shared.upgrade() else {
            return;
        };
        let Some(store) = engine.store() else {
            return;
        };
        let writer = engine.writer.clone();
        let lease_lost = engine.lease_lost.clone();
        drop(engine);
        // Three TTLs: an election or a short loss of the store's majority
        // must not move every client to another engine. Safety does not
        // depend on it: a deposed engine's writes are refused by epoch.
        if renewed_at.elapsed() > terms.ttl * 3 {
            record_lease_lost(&lease_lost, || {
                format!(
                    "the lease went unrenewed for {} ms (three times its TTL of {} ms): \
                     the store cannot be reached, and another engine may hold it now",
                    renewed_at.elapsed().as_millis(),
                    terms.ttl.as_millis()
                )
            });
        }
        let request = spillway_proto::storage::AcquireLeaseRequest {
            epoch: writer.epoch(),
            ttl_ms: terms.ttl.as_millis() as u64,
            holder: terms.holder.clone(),
        };
        let renewed = tokio::time::timeout(terms.ttl, store.acquire_lease(request)).await;
        drop(store);
        match renewed {
            Ok(Ok(lease)) if lease.store_id != terms.store_id => writer.set_failed(
                FailureSource::Lease,
                &format!(
                    "the storage node now serves another store (id {}, this engine's is {}): \
                     a wrong or empty data directory?",
                    lease.store_id, terms.store_id
                ),
            ),
            Ok(Ok(_)) => {
                renewed_at = tokio::time::Instant::now();
                writer.clear_failed(FailureSource::Lease)
            }
            Ok(Err(error)) if !error.is_transient() => {
                let reason = format!("lease lost: {error}");
                record_lease_lost(&lease_lost, || reason.clone());
                writer.set_failed(FailureSource::Lease, &reason)
            }
            Ok(Err(error)) => tracing::debug!(%error, "cannot renew the store lease yet"),
            Err(_) => tracing::debug!("renewing the store lease timed out"),
        }
    }
}

/// Records why the lease was lost, the first time only (the first reason
/// is the one [`Engine::lease_lost`] reports).
fn record_lease_lost(
    lost: &tokio::sync::watch::Sender<Option<String>>,
    reason: impl FnOnce() -> String,
) {
    lost.send_if_modified(|lost| {
        if lost.is_some() {
            return false;
        }
        *lost = Some(reason());
        true
    });
}

/// Tells the broker when the store fails or recovers, so that it blocks or
/// releases producers of persistent messages.
async fn run_failure_watch(
    shared: std::sync::Weak<Shared>,
    mut failures: tokio::sync::watch::Receiver<
        Option<(FailureSource, crate::persistence::StoreFailure)>,
    >,
) {
    while failures.changed().await.is_ok() {
        let failure = failures
            .borrow_and_update()
            .as_ref()
            .map(|(_, failure)| failure.0.to_string());
        let Some(engine) = shared.upgrade() else {
            return;
        };
        engine.broker.lock().set_store_failure(failure);
    }
}

/// Every `interval`, or when a publish takes memory over the threshold,
/// re-evaluates flow to disk. Ends with the engine.
async fn run_housekeeping(shared: std::sync::Weak<Shared>, interval: Duration) {
    let interval = interval.max(Duration::from_millis(10));
    loop {
        let kick = match shared.upgrade() {
            Some(shared) => shared.housekeeping_kick.clone(),
            None => return,
        };
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = kick.notified() => {}
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let mut broker = shared.broker.lock();
        broker.housekeeping();
        let now = broker.clock.now();
        broker.expire_unacked(now);
    }
}

/// Message and queue TTL (`broker/expiry.rs`): sleeps until the first
/// queue is due (or an earlier one is scheduled), lets its expired head go
/// or deletes it if unused past `x-expires`. Ends with the engine.
async fn run_expiry(shared: std::sync::Weak<Shared>, wake: Arc<Notify>) {
    // Looked at again at least this often, whatever the clock did.
    const LONGEST_SLEEP: Duration = Duration::from_secs(60);
    loop {
        let Some(engine) = shared.upgrade() else {
            return;
        };
        let clock = engine.broker.lock().clock.clone();
        let next = engine.broker.lock().run_expiry(clock.unix_millis());
        // Not kept while asleep: the engine may go meanwhile.
        drop(engine);
        let sleep = next.map_or(LONGEST_SLEEP, |when| {
            Duration::from_millis(when.saturating_sub(clock.unix_millis())).min(LONGEST_SLEEP)
        });
        if sleep.is_zero() {
            // More is due already (a large backlog expires a batch at a
            // time): let others have the lock in between.
            tokio::task::yield_now().await;
            continue;
        }
        tokio::select! {
            () = tokio::time::sleep(sleep) => {}
            () = wake.notified() => {}
        }
    }
}

/// Delayed messages (`broker/delayed.rs`): counts what the store holds at
/// start-up (below this run's first id), then sleeps until the next one
/// is due (or an earlier one is published), waits until those due are in
/// the store (only when one is still being written), reads the due ones in
/// bounded batches and routes them. Ends with the engine.
async fn run_delayed(shared: std::sync::Weak<Shared>, wake: Arc<Notify>, first_id: u64) {
    use crate::broker::delayed::DelayedDue;
    use spillway_proto::storage::ScanDelayedRequest;
    // Looked at again at least this often, whatever the clock did.
    const LONGEST_SLEEP: Duration = Duration::from_secs(60);
    // One batch: bounded in messages and body bytes (what is routed
    // becomes queued messages, counted in the budget like any).
    const BATCH_MESSAGES: u32 = 2_000;
    const BATCH_BYTES: u64 = 4 << 20;
    const RETRY: Duration = Duration::from_secs(1);
    let store = |engine: &Shared| engine.store.lock().clone();
    loop {
        let Some(engine) = shared.upgrade() else {
            return;
        };
        let Some(storage) = store(&engine) else {
            return;
        };
        drop(engine);
        let counted = storage
            .scan_delayed(ScanDelayedRequest {
                count_below_id: first_id,
                ..Default::default()
            })
            .await;
        drop(storage);
        let Some(engine) = shared.upgrade() else {
            return;
        };
        match counted {
            Ok(batch) => {
                let waiting: u64 = batch.counts.iter().map(|c| c.count).sum();
                if waiting > 0 {
                    tracing::info!(messages = waiting, "delayed messages waiting in the store");
                }
                engine
                    .broker
                    .lock()
                    .delayed
                    .recovered(batch.counts, batch.next_due_ms);
                break;
            }
            Err(error) => {
                tracing::warn!(%error, "could not count the delayed messages; retrying");
                drop(engine);
                tokio::time::sleep(RETRY).await;
            }
        }
    }
    loop {
        let (now, due, wait_for) = {
            let Some(engine) = shared.upgrade() else {
                return;
            };
            let mut broker = engine.broker.lock();
            let now = broker.clock.unix_millis();
            let due = broker.delayed.due(now);
            let writer = &engine.writer;
            let wait_for = match due {
                DelayedDue::Now { .. } => broker
                    .delayed
                    .write_to_wait_for(now, |seq| writer.is_written(seq)),
                _ => None,
            };
            (now, due, wait_for)
        };
        // Neither the engine, its writer nor its store is kept while
        // asleep: the engine may go (and release the store) meanwhile.
        let sleep = match due {
            DelayedDue::Now { from } => {
                let Some(engine) = shared.upgrade() else {
                    return;
                };
                let writer = engine.writer.clone();
                let Some(storage) = store(&engine) else {
                    return;
                };
                drop(engine);
                // What is due by now is in the store before it is looked
                // for there (a write of another kind is not waited for).
                if let Some(seq) = wait_for {
                    let _ = writer.wait_written(seq).await;
                }
                drop(writer);
                let request = ScanDelayedRequest {
                    due_until_ms: now,
                    max_messages: BATCH_MESSAGES,
                    max_bytes: BATCH_BYTES,
                    from_due_ms: from.0,
                    from_id: from.1,
                    ..Default::default()
                };
                let scanned = storage.scan_delayed(request).await;
                drop(storage);
                let Some(engine) = shared.upgrade() else {
                    return;
                };
                let mut broker = engine.broker.lock();
                match scanned {
                    Ok(batch) => {
                        broker.route_delayed(batch.messages, (batch.next_due_ms, batch.next_id));
                        Duration::ZERO
                    }
                    Err(error) => {
                        tracing::warn!(%error, "could not read the delayed messages due; retrying");
                        broker.delayed.note_next(from);
                        RETRY
                    }
                }
            }
            DelayedDue::At(when) => {
                Duration::from_millis(when.saturating_sub(now)).min(LONGEST_SLEEP)
            }
            DelayedDue::Idle => LONGEST_SLEEP,
        };
        if sleep.is_zero() {
            tokio::task::yield_now().await;
            continue;
        }
        tokio::select! {
            () = tokio::time::sleep(sleep) => {}
            () = wake.notified() => {}
        }
    }
}

/// Producer transaction timeouts (`broker/tx.rs`): one timer for the
/// broker. Sleeps until the next warning or close is due among the open
/// transactions, or until a transaction opens or the timeouts change. Ends
/// with the engine.
async fn run_tx_timeouts(shared: std::sync::Weak<Shared>, wake: Arc<Notify>) {
    // Looked at again at least this often, whatever happened.
    const LONGEST_SLEEP: Duration = Duration::from_secs(60);
    loop {
        let Some(engine) = shared.upgrade() else {
            return;
        };
        let clock = engine.broker.lock().clock.clone();
        let next = engine.broker.lock().check_transactions(clock.now());
        drop(engine);
        let sleep = next.map_or(LONGEST_SLEEP, |when| {
            when.saturating_duration_since(clock.now())
                .clamp(Duration::from_millis(1), LONGEST_SLEEP)
        });
        tokio::select! {
            () = tokio::time::sleep(sleep) => {}
            () = wake.notified() => {}
        }
    }
}

/// Reads payloads back from the store for read-ahead and basic.get, a few
/// batches at a time, and installs them under the broker lock.
async fn run_loader(
    shared: std::sync::Weak<Shared>,
    mut requests: mpsc::UnboundedReceiver<LoadRequest>,
) {
    let permits = Arc::new(Semaphore::new(CONCURRENT_LOADS));
    while let Some(request) = requests.recv().await {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let Some(engine) = shared.upgrade() else {
            return;
        };
        tokio::spawn(async move {
            let records = load(&engine, &request.ids).await;
            if request.dead_letters.is_empty() {
                engine.broker.lock().install_loaded(
                    &request.vhost,
                    &request.queue,
                    &request.ids,
                    records,
                );
            } else {
                engine.broker.lock().dead_letter_loaded(
                    &request.vhost,
                    request.dead_letters,
                    records,
                );
            }
            drop(permit);
        });
    }
}

#[async_trait]
impl EngineApi for Engine {
    async fn open_session(&self) -> Result<SessionStreams, ServiceError> {
        let (command_tx, command_rx) = spillway_proto::engine::command_queue();
        let (event_tx, event_rx) = mpsc::unbounded_channel();
        let id = self.shared.next_session.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(run_session(self.shared.clone(), id, command_rx, event_tx));
        Ok(SessionStreams {
            commands: command_tx,
            events: event_rx,
        })
    }

    async fn authenticate(
        &self,
        request: spillway_proto::engine::AuthenticateRequest,
    ) -> Result<LoginResult, ServiceError> {
        let access = self.shared.access.read();
        Ok(
            match access.authenticate(
                &request.user,
                request.password.as_deref(),
                request.peer_is_loopback,
            ) {
                Ok(_) => LoginResult::Accepted,
                Err(LoginRefusal::InvalidCredentials) => LoginResult::InvalidCredentials,
                Err(LoginRefusal::LoopbackOnly) => LoginResult::LoopbackOnly,
            },
        )
    }
}
