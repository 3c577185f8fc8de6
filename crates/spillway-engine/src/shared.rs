//! What every session and background task of the engine shares: the
//! broker behind its lock, the store writer and the store, the memory
//! budget, users and permissions, and the lease's terms. [`crate::Engine`]
//! is a handle on it.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use spillway_proto::storage::StorageApi;
use spillway_proto::util::backoff::Backoff;
use tokio::sync::Notify;

use crate::access::AccessControl;
use crate::broker::Broker;
use crate::budget::MemoryBudget;
use crate::persistence::StoreWriter;

pub(crate) struct Shared {
    pub(crate) broker: Mutex<Broker>,
    pub(crate) next_session: AtomicU64,
    pub(crate) writer: StoreWriter,
    pub(crate) budget: Arc<MemoryBudget>,
    pub(crate) housekeeping_kick: Arc<Notify>,
    /// Wakes the transaction timer (`run_tx_timeouts`).
    pub(crate) tx_timer: Arc<Notify>,
    /// For reading payloads back; taken at shutdown so the store is
    /// released even while clones of the engine linger.
    pub(crate) store: Mutex<Option<Arc<dyn StorageApi>>>,
    /// The store this engine leased (its id), and the lease's terms.
    pub(crate) lease: LeaseTerms,
    /// Why this engine no longer holds the lease, once it does not: the
    /// store gave it to another engine, or it went unrenewed past its TTL
    /// (so another may have it). See [`crate::Engine::lease_lost`].
    pub(crate) lease_lost: tokio::sync::watch::Sender<Option<String>>,
    /// `EngineConfig::max_message_size`.
    pub(crate) max_message_size: u64,
    /// Users and permissions (`access.rs`). Apart from the broker's lock:
    /// logins do not wait for the message path.
    pub(crate) access: parking_lot::RwLock<AccessControl>,
    /// [`AccessControl::generation`], readable without the lock: sessions
    /// re-read their permissions only when it moved.
    pub(crate) access_generation: AtomicU64,
}

#[derive(Clone, Debug)]
pub(crate) struct LeaseTerms {
    pub(crate) store_id: String,
    pub(crate) holder: String,
    pub(crate) ttl: Duration,
}

impl Shared {
    pub(crate) fn store(&self) -> Option<Arc<dyn StorageApi>> {
        self.store.lock().clone()
    }
}

/// The records of `ids`: from the store writer when still on their way to
/// the store, else from the store, retrying until it answers.
pub(crate) async fn load(
    engine: &Shared,
    ids: &[u64],
) -> Vec<spillway_proto::storage::MessageRecord> {
    let Some(store) = engine.store() else {
        // Shutting down: nothing to install the payloads into any more.
        return Vec::new();
    };
    let mut records = Vec::with_capacity(ids.len());
    let mut missing = Vec::new();
    for id in ids {
        match engine.writer.pending_record(*id) {
            Some(record) => records.push(record),
            None => missing.push(*id),
        }
    }
    if missing.is_empty() {
        return records;
    }
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        match store.read_messages(missing.clone()).await {
            Ok(read) => {
                records.extend(read);
                return records;
            }
            Err(error) => {
                let delay = backoff.next_delay();
                tracing::warn!(%error, messages = missing.len(), retry_in_ms = delay.as_millis() as u64,
                    "reading payloads back from the store failed, retrying");
                tokio::time::sleep(delay).await;
            }
        }
    }
}
