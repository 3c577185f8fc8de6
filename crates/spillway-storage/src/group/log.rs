//! The group's Raft log, in the store's `raft_log` column family.
//!
//! | key | value |
//! |---|---|
//! | `e` + index (8 bytes, big-endian) | the entry (postcard) |
//! | `!vote` | the vote (postcard) |
//! | `!purged` | the last purged log id (postcard) |
//! | `!empty_start` | this member started empty while its group ran (`rejoin.rs`) |
//!
//! An append returns (tells openraft it is flushed) only once RocksDB has
//! fsynced it: an entry a member acknowledged survives the machine dying.

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{LogId, LogState, RaftLogReader, StorageError, StorageIOError, Vote};
use rocksdb::{Direction, IteratorMode, WriteOptions};

use super::types::GroupConfig;
use crate::store::RocksStore;
use crate::store::RAFT_LOG_FAMILY;

const ENTRY: u8 = b'e';
const VOTE_KEY: &[u8] = b"!vote";
const PURGED_KEY: &[u8] = b"!purged";
const EMPTY_START_KEY: &[u8] = b"!empty_start";

type Entry = openraft::Entry<GroupConfig>;
type Error = StorageError<u64>;

fn entry_key(index: u64) -> [u8; 9] {
    let mut key = [ENTRY; 9];
    key[1..].copy_from_slice(&index.to_be_bytes());
    key
}

fn index_of(key: &[u8]) -> Option<u64> {
    let bytes: [u8; 8] = key.get(1..9)?.try_into().ok()?;
    (key.first() == Some(&ENTRY)).then(|| u64::from_be_bytes(bytes))
}

fn synced() -> WriteOptions {
    let mut options = WriteOptions::default();
    options.set_sync(true);
    options
}

/// The log of one member. Cheap to clone: openraft's log reader is a clone.
#[derive(Clone)]
pub(crate) struct GroupLog {
    store: RocksStore,
}

impl GroupLog {
    pub(crate) fn new(store: RocksStore) -> Self {
        Self { store }
    }

    /// Runs `work` on the blocking pool: RocksDB calls block, and an fsync
    /// must not hold up the runtime's two threads.
    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&RocksStore) -> Result<T, Error> + Send + 'static,
    ) -> Result<T, Error> {
        let store = self.store.clone();
        self.store
            .off_runtime(move || work(&store))
            .await
            .map_err(|error| StorageIOError::read_logs(&error))?
    }

    /// Removes every entry and the purge mark, keeping the vote: a member
    /// whose state was lost mid-install starts its log again from the
    /// leader's snapshot (`machine.rs`).
    pub(crate) fn clear_entries(store: &RocksStore) -> Result<(), Error> {
        let family = family(store).map_err(|e| StorageIOError::write_logs(&e))?;
        let mut batch = rocksdb::WriteBatch::default();
        batch.delete_range_cf(family, entry_key(0), entry_key(u64::MAX));
        batch.delete_cf(family, entry_key(u64::MAX));
        batch.delete_cf(family, PURGED_KEY);
        // What it held is gone: it is no longer a member that never held
        // anything.
        batch.delete_cf(family, EMPTY_START_KEY);
        store
            .db
            .write_opt(batch, &synced())
            .map_err(|e| StorageIOError::write_logs(&e))?;
        Ok(())
    }
}

/// Records (synced) that this member started empty while its group ran.
/// The mark lives as long as this store: found again with the log still
/// empty, it says the member never held anything since, so it lost nothing
/// (a lost disk takes the mark with it).
pub(crate) fn mark_empty_start(store: &RocksStore) -> Result<(), Error> {
    let family = family(store).map_err(|e| StorageIOError::write_logs(&e))?;
    store
        .db
        .put_cf_opt(family, EMPTY_START_KEY, [1u8], &synced())
        .map_err(|e| StorageIOError::write_logs(&e))?;
    Ok(())
}

/// Whether [`mark_empty_start`] was recorded in this store.
pub(crate) fn marked_empty_start(store: &RocksStore) -> Result<bool, Error> {
    let family = family(store).map_err(|e| StorageIOError::read_logs(&e))?;
    Ok(store
        .db
        .get_cf(family, EMPTY_START_KEY)
        .map_err(|e| StorageIOError::read_logs(&e))?
        .is_some())
}

/// Whether the log holds nothing at all: no entry and no purge mark (the
/// vote is not looked at). A member that was in a group and holds nothing
/// lost its disk, or was emptied after a cut-short snapshot install.
pub(crate) fn holds_nothing(store: &RocksStore) -> Result<bool, Error> {
    let purged: Option<LogId<u64>> = read_value(store, PURGED_KEY)?;
    if purged.is_some() {
        return Ok(false);
    }
    let family = family(store).map_err(|e| StorageIOError::read_logs(&e))?;
    let first = entry_key(0);
    let entry = store
        .db
        .iterator_cf(family, IteratorMode::From(&first, Direction::Forward))
        .next()
        .transpose()
        .map_err(|e| StorageIOError::read_logs(&e))?;
    Ok(entry.is_none_or(|(key, _)| index_of(&key).is_none()))
}

#[derive(Debug, thiserror::Error)]
#[error("the store has no {RAFT_LOG_FAMILY} column family")]
struct MissingFamily;

fn family(store: &RocksStore) -> Result<&rocksdb::ColumnFamily, MissingFamily> {
    store.db.cf_handle(RAFT_LOG_FAMILY).ok_or(MissingFamily)
}

fn read_value<T: serde::de::DeserializeOwned>(
    store: &RocksStore,
    key: &[u8],
) -> Result<Option<T>, Error> {
    let family = family(store).map_err(|e| StorageIOError::read_logs(&e))?;
    let Some(bytes) = store
        .db
        .get_cf(family, key)
        .map_err(|e| StorageIOError::read_logs(&e))?
    else {
        return Ok(None);
    };
    let value = postcard::from_bytes(&bytes).map_err(|e| StorageIOError::read_logs(&e))?;
    Ok(Some(value))
}

/// The entries from `start` on, below `end`, without a gap: the run stops
/// at the first missing index, and is empty when `start` itself is missing
/// (purged). openraft sends what this returns as the entries that follow
/// `start - 1`: a run with a hole in it would be appended by a follower at
/// the wrong place.
fn entries_in(store: &RocksStore, start: u64, end: Option<u64>) -> Result<Vec<Entry>, Error> {
    let family = family(store).map_err(|e| StorageIOError::read_logs(&e))?;
    let from = entry_key(start);
    let mut entries = Vec::new();
    let mut expected = start;
    for item in store
        .db
        .iterator_cf(family, IteratorMode::From(&from, Direction::Forward))
    {
        let (key, value) = item.map_err(|e| StorageIOError::read_logs(&e))?;
        let Some(index) = index_of(&key) else {
            break;
        };
        if end.is_some_and(|end| index >= end) || index != expected {
            break;
        }
        expected = index.saturating_add(1);
        let entry: Entry = postcard::from_bytes(&value)
            .map_err(|e| StorageIOError::read_log_at_index(index, &e))?;
        entries.push(entry);
    }
    Ok(entries)
}

impl RaftLogReader<GroupConfig> for GroupLog {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, Error> {
        let start = match range.start_bound() {
            Bound::Included(index) => *index,
            Bound::Excluded(index) => index.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(index) => Some(index.saturating_add(1)),
            Bound::Excluded(index) => Some(*index),
            Bound::Unbounded => None,
        };
        self.blocking(move |store| entries_in(store, start, end))
            .await
    }
}

impl RaftLogStorage<GroupConfig> for GroupLog {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<GroupConfig>, Error> {
        self.blocking(|store| {
            let purged: Option<LogId<u64>> = read_value(store, PURGED_KEY)?;
            let family = family(store).map_err(|e| StorageIOError::read_logs(&e))?;
            let last_key = entry_key(u64::MAX);
            let mut last = store
                .db
                .iterator_cf(family, IteratorMode::From(&last_key, Direction::Reverse));
            let last = match last.next() {
                Some(item) => {
                    let (key, value) = item.map_err(|e| StorageIOError::read_logs(&e))?;
                    match index_of(&key) {
                        Some(_) => {
                            let entry: Entry = postcard::from_bytes(&value)
                                .map_err(|e| StorageIOError::read_logs(&e))?;
                            Some(entry.log_id)
                        }
                        None => None,
                    }
                }
                None => None,
            };
            Ok(LogState {
                last_purged_log_id: purged,
                last_log_id: last.or(purged),
            })
        })
        .await
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), Error> {
        let bytes = postcard::to_allocvec(vote).map_err(|e| StorageIOError::write_vote(&e))?;
        self.blocking(move |store| {
            let family = family(store).map_err(|e| StorageIOError::write_vote(&e))?;
            store
                .db
                .put_cf_opt(family, VOTE_KEY, bytes, &synced())
                .map_err(|e| StorageIOError::write_vote(&e))?;
            Ok(())
        })
        .await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, Error> {
        self.blocking(|store| read_value(store, VOTE_KEY)).await
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<GroupConfig>,
    ) -> Result<(), Error>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let mut encoded = Vec::new();
        for entry in entries {
            let bytes = postcard::to_allocvec(&entry)
                .map_err(|e| StorageIOError::write_log_entry(entry.log_id, &e))?;
            encoded.push((entry.log_id.index, bytes));
        }
        let written = self
            .blocking(move |store| {
                let family = family(store).map_err(|e| StorageIOError::write_logs(&e))?;
                let size = encoded.iter().map(|(_, bytes)| bytes.len() + 32).sum();
                let mut batch = rocksdb::WriteBatch::with_capacity_bytes(size);
                for (index, bytes) in &encoded {
                    batch.put_cf(family, entry_key(*index), bytes);
                }
                store
                    .db
                    .write_opt(batch, &synced())
                    .map_err(|e| StorageIOError::write_logs(&e))?;
                Ok(())
            })
            .await;
        match written {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(error) => {
                callback.log_io_completed(Err(std::io::Error::other(error.to_string())));
                Err(error)
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<u64>) -> Result<(), Error> {
        self.blocking(move |store| {
            let family = family(store).map_err(|e| StorageIOError::write_logs(&e))?;
            let mut batch = rocksdb::WriteBatch::default();
            batch.delete_range_cf(family, entry_key(log_id.index), entry_key(u64::MAX));
            batch.delete_cf(family, entry_key(u64::MAX));
            store
                .db
                .write_opt(batch, &synced())
                .map_err(|e| StorageIOError::write_logs(&e))?;
            Ok(())
        })
        .await
    }

    async fn purge(&mut self, log_id: LogId<u64>) -> Result<(), Error> {
        let mark = postcard::to_allocvec(&log_id).map_err(|e| StorageIOError::write_logs(&e))?;
        self.blocking(move |store| {
            // The entries go; what applying them did must not: the applies
            // share the WAL, unsynced until here.
            store
                .sync_wal()
                .map_err(|e| StorageIOError::write_logs(&e))?;
            let family = family(store).map_err(|e| StorageIOError::write_logs(&e))?;
            let mut batch = rocksdb::WriteBatch::default();
            batch.put_cf(family, PURGED_KEY, mark);
            batch.delete_range_cf(
                family,
                entry_key(0),
                entry_key(log_id.index.saturating_add(1)),
            );
            store
                .db
                .write_opt(batch, &synced())
                .map_err(|e| StorageIOError::write_logs(&e))?;
            Ok(())
        })
        .await
    }
}
