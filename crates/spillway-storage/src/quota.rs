//! The store's disk quota (`storage.overfull_size` / `storage.underfull_size`).
//!
//! A monitor task measures the store's files every half second. Above the
//! overfull size the store is overfull (`MST-1008`) until it falls below the
//! underfull size (`MST-1009`). While overfull it flushes and compacts now
//! and then: RocksDB frees the space of deleted messages only then, and a
//! purge should release blocked producers. Best effort, as in Qpid: writes
//! already under way may overshoot. Subscribers (the engine) get the state
//! at once and on every change.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rocksdb::DB;
use spillway_proto::storage::QuotaState;
use spillway_proto::storage::QuotaStream;
use tokio::sync::watch;

const CHECK_EVERY: Duration = Duration::from_millis(500);
/// While overfull, at most this often: flush the memtables and compact.
const RECLAIM_EVERY: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub struct Quota {
    limits: Mutex<Limits>,
    state: watch::Sender<QuotaState>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Limits {
    overfull: u64,
    underfull: u64,
}

impl Default for Quota {
    fn default() -> Self {
        Self {
            limits: Mutex::new(Limits::default()),
            state: watch::Sender::new(QuotaState::default()),
        }
    }
}

impl Quota {
    /// The state now, then each change.
    pub(crate) fn watch(&self) -> QuotaStream {
        let receiver = self.state.subscribe();
        Box::pin(futures::stream::unfold(
            (receiver, true),
            |(mut receiver, first)| async move {
                if !first {
                    receiver.changed().await.ok()?;
                }
                let state = *receiver.borrow_and_update();
                Some((Ok(state), (receiver, false)))
            },
        ))
    }

    fn limits(&self) -> Limits {
        *self.limits.lock()
    }
}

impl Quota {
    /// Sets the disk quota: overfull above `overfull_size` bytes (0: no
    /// quota), underfull again below `underfull_size` (0, or above the
    /// overfull size: the overfull size). Takes effect at the next check,
    /// within half a second; logged.
    pub(crate) fn set(&self, overfull_size: u64, underfull_size: u64) {
        let underfull = if underfull_size == 0 || underfull_size > overfull_size {
            overfull_size
        } else {
            underfull_size
        };
        let limits = Limits {
            overfull: overfull_size,
            underfull,
        };
        let previous = std::mem::replace(&mut *self.limits.lock(), limits);
        // Readers see the new limits at once; the state follows at the next
        // measurement.
        self.state.send_if_modified(|state| {
            let changed =
                state.overfull_size != limits.overfull || state.underfull_size != limits.underfull;
            state.overfull_size = limits.overfull;
            state.underfull_size = limits.underfull;
            changed
        });
        if previous != limits {
            tracing::info!(overfull_size, underfull_size = underfull, "store quota set");
        }
    }

    /// The quota in force: (overfull size, underfull size), 0 = none.
    pub(crate) fn in_force(&self) -> (u64, u64) {
        let limits = self.limits();
        (limits.overfull, limits.underfull)
    }
}

/// Measures the disk usage of the store at `path` against `quota` every
/// half second, until the store (`db`) is closed.
pub(crate) fn start_monitor(db: Weak<DB>, path: PathBuf, quota: Arc<Quota>) {
    tokio::spawn(async move {
        let mut last_reclaim = Instant::now();
        loop {
            tokio::time::sleep(CHECK_EVERY).await;
            let Some(open) = db.upgrade() else {
                return;
            };
            let (path, quota) = (path.clone(), quota.clone());
            let reclaim = last_reclaim.elapsed() >= RECLAIM_EVERY;
            let checked =
                tokio::task::spawn_blocking(move || check(&open, &path, &quota, reclaim)).await;
            if matches!(checked, Ok(true)) {
                last_reclaim = Instant::now();
            }
        }
    });
}

/// One measurement; returns whether it flushed and compacted.
fn check(db: &DB, path: &Path, quota: &Quota, may_reclaim: bool) -> bool {
    let limits = quota.limits();
    let mut reclaimed = false;
    let was_overfull = quota.state.borrow().overfull;
    if was_overfull && may_reclaim {
        if let Err(error) = db.flush() {
            tracing::warn!(%error, "flush while overfull failed");
        }
        db.compact_range::<&[u8], &[u8]>(None, None);
        reclaimed = true;
    }
    let disk_bytes = store_bytes(path);
    let overfull = if limits.overfull == 0 {
        false
    } else if was_overfull {
        disk_bytes >= limits.underfull
    } else {
        disk_bytes > limits.overfull
    };
    if overfull && !was_overfull {
        tracing::warn!(
            code = "MST-1008",
            disk_bytes,
            overfull_size = limits.overfull,
            "MST-1008 : Store overfull, flow control will be enforced"
        );
    } else if !overfull && was_overfull {
        tracing::info!(
            code = "MST-1009",
            disk_bytes,
            underfull_size = limits.underfull,
            "MST-1009 : Store overfull condition cleared"
        );
    }
    let state = QuotaState {
        overfull,
        disk_bytes,
        overfull_size: limits.overfull,
        underfull_size: limits.underfull,
    };
    // Subscribers hear of changes to the state, not of every byte.
    quota.state.send_if_modified(|current| {
        let changed = current.overfull != state.overfull
            || current.overfull_size != state.overfull_size
            || current.underfull_size != state.underfull_size;
        *current = state;
        changed
    });
    reclaimed
}

/// The store's data on disk: tables, write-ahead logs, manifests. RocksDB's
/// own info logs (`LOG`, `LOG.old.*`) are not messages and do not count.
fn store_bytes(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|entry| !entry.file_name().to_string_lossy().starts_with("LOG"))
        .filter_map(|entry| entry.metadata().ok())
        .filter(|meta| meta.is_file())
        .map(|meta| meta.len())
        .sum()
}
