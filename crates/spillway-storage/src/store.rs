//! `RocksStore`: the `StorageApi` over RocksDB. One write batch per engine
//! batch (the group commit), with the durability it asks for; the key layout
//! is in `keys.rs`; start-up checks the layout version, and `remove_orphans`
//! deletes records no queue entry holds.
//!
//! The store has an id, created with it, and a lease epoch (`lease.rs`):
//! writes from an engine without the current epoch are refused. RocksDB's
//! errors are told apart by kind ([`StoreError::to_service_error`]): a full
//! or failing disk is `ResourceExhausted`, corruption `DataLoss`, a busy or
//! timed-out call `Unavailable` (worth retrying). A record that does not
//! decode is skipped, logged (`MST-1103`), counted and deleted: it is never
//! read again.
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::RwLock;
use prost::Message as _;
use rocksdb::{
    BlockBasedOptions, Cache, ColumnFamilyDescriptor, DBCompressionType, Direction, IteratorMode,
    Options, WriteOptions, DB,
};
use spillway_proto::storage::{
    write_op, AcquireLeaseRequest, BindingDefinition, Definitions, Durability, ExchangeDefinition,
    Lease, MessageRecord, PermissionDefinition, PolicyDefinition, QueueDefinition, QueueEntry,
    StoreStatus, UserDefinition, VhostDefinition, WriteBatch,
};
use spillway_proto::{storage::StorageApi, ServiceError};

use crate::keys;
use crate::lease::{Grant, LeaseState};
use crate::quota::Quota;

/// Size of one RocksDB memtable; at most two exist at once.
pub const MEMTABLE_BYTES: usize = 16 << 20;
/// The block cache: data blocks read back, and every table file's index
/// and filter blocks.
pub const BLOCK_CACHE_BYTES: usize = 16 << 20;
/// Uncompressed size of a table file's data block (RocksDB's default is
/// 4 KiB). Payloads are read back in id order, hundreds at a time, so a
/// larger block costs nothing per message, and it keeps the index small:
/// with 4 KiB blocks a 2 GiB backlog of 1 KiB messages has about 11 MB of
/// index, more than the block cache's high-priority half (where index and
/// filter blocks live) holds, so read-back batches re-read, checksummed
/// and decompressed index blocks of hundreds of KB (docs/performance-history.md,
/// case d).
pub const DATA_BLOCK_BYTES: usize = 32 << 10;
/// Largest table file a compaction writes. RocksDB's 64 MiB default, with
/// compressible payloads, made the whole spilled backlog one bottom-level
/// file: payloads spilled from a queue's tail have lower ids than arrivals
/// that went straight to the store, so every flush overlapped that file and
/// each compaction rewrote all of it (1.9M records, 27 times in one 2 GiB
/// fill; 44% of the broker's CPU). Smaller files confine a compaction to
/// the key ranges it really overlaps (docs/performance-history.md, case d).
pub const TABLE_FILE_BYTES: u64 = 4 << 20;

/// RocksDB's memory, in bytes ([`RocksStore::memory`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreMemory {
    pub memtables: u64,
    pub block_cache: u64,
    pub table_readers: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the store at {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: rocksdb::Error,
    },
    #[error(
        "the store at {path} has layout version {found}, this build reads {expected}: \
         move the data directory aside (nothing released used another layout)"
    )]
    Format {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error(
        "no store in {path} and storage.create_if_missing is false: \
         is the data directory mounted where it should be?"
    )]
    Missing { path: PathBuf },
    #[error("rocksdb: {0}")]
    Rocks(#[from] rocksdb::Error),
    #[error("{0}")]
    Refused(ServiceError),
    #[error("corrupt record under key {key:?}: {source}")]
    Corrupt {
        key: Vec<u8>,
        #[source]
        source: prost::DecodeError,
    },
    #[error("storage task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl StoreError {
    /// The error as the engine should see it: by kind, so that it knows
    /// whether trying again can help.
    pub fn to_service_error(self) -> ServiceError {
        let text = self.to_string();
        match self {
            StoreError::Refused(error) => error,
            StoreError::Corrupt { .. } => ServiceError::DataLoss(text),
            StoreError::Missing { .. } | StoreError::Format { .. } => {
                ServiceError::FailedPrecondition(text)
            }
            StoreError::Open { source, .. } | StoreError::Rocks(source) => {
                classify(source.kind(), text)
            }
            StoreError::Task(_) => ServiceError::Internal(text),
        }
    }
}

/// A RocksDB error of `kind` as a service error.
fn classify(kind: rocksdb::ErrorKind, text: String) -> ServiceError {
    use rocksdb::ErrorKind;
    match kind {
        // RocksDB reports ENOSPC and every failed file write as an IO error
        // ("IO error: No space left on device…"): the disk refuses what it
        // is given until an operator acts.
        ErrorKind::IOError => ServiceError::ResourceExhausted(text),
        ErrorKind::Corruption => ServiceError::DataLoss(text),
        ErrorKind::Busy
        | ErrorKind::TimedOut
        | ErrorKind::TryAgain
        | ErrorKind::Incomplete
        | ErrorKind::Aborted
        | ErrorKind::Expired
        | ErrorKind::ShutdownInProgress => ServiceError::Unavailable(text),
        ErrorKind::InvalidArgument => ServiceError::InvalidArgument(text),
        ErrorKind::NotFound => ServiceError::NotFound(text),
        _ => ServiceError::Internal(text),
    }
}

impl From<StoreError> for ServiceError {
    fn from(error: StoreError) -> Self {
        error.to_service_error()
    }
}

/// How a store's id and epoch are kept.
pub(crate) const STORE_ID_KEY: &[u8] = b"!store_id";
pub(crate) const EPOCH_KEY: &[u8] = b"!epoch";
/// The column family of the storage group's Raft log (`group/log.rs`).
pub(crate) const RAFT_LOG_FAMILY: &str = "raft_log";

/// The RocksDB database behind the storage node. Cheap to clone.
#[derive(Clone)]
pub struct RocksStore {
    pub(crate) db: Arc<DB>,
    pub(crate) path: PathBuf,
    pub(crate) quota: Arc<Quota>,
    pub(crate) meta: Arc<Meta>,
    /// Held in RocksDB's in-memory environment ([`RocksStore::open_in_memory`]).
    pub(crate) in_memory: bool,
}

/// What a store knows of itself besides its records.
pub(crate) struct Meta {
    /// Created with the store, never changed.
    store_id: String,
    /// Writes hold it shared, so that a new lease waits for the write of
    /// the engine it deposes.
    pub(crate) lease: RwLock<LeaseState>,
    /// Records that did not decode (`spillway_store_corrupt_records_total`).
    pub(crate) corrupt_records: AtomicU64,
}

/// A [`RocksStore`] that may have been closed since.
pub(crate) struct WeakStore {
    db: std::sync::Weak<DB>,
    path: PathBuf,
    quota: Arc<Quota>,
    pub(crate) meta: Arc<Meta>,
    in_memory: bool,
}

impl WeakStore {
    /// The store, while something else still keeps it open.
    pub(crate) fn upgrade(&self) -> Option<RocksStore> {
        Some(RocksStore {
            db: self.db.upgrade()?,
            path: self.path.clone(),
            quota: self.quota.clone(),
            meta: self.meta.clone(),
            in_memory: self.in_memory,
        })
    }
}

/// What the start-up clean-up removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cleanup {
    pub orphaned_messages: u64,
    pub orphaned_bytes: u64,
}

impl RocksStore {
    /// Sets the disk quota: overfull above `overfull_size` bytes (0: no
    /// quota), underfull again below `underfull_size` (0, or above the
    /// overfull size: the overfull size). Takes effect at the next check,
    /// within half a second; logged.
    pub fn set_quota(&self, overfull_size: u64, underfull_size: u64) {
        self.quota.set(overfull_size, underfull_size);
    }

    /// The quota in force: (overfull size, underfull size), 0 = none.
    pub fn quota_limits(&self) -> (u64, u64) {
        self.quota.in_force()
    }

    /// Starts measuring disk usage against the quota (`quota.rs`). The task
    /// ends when the store is closed.
    pub fn start_quota_monitor(&self) {
        crate::quota::start_monitor(
            Arc::downgrade(&self.db),
            self.path.clone(),
            self.quota.clone(),
        );
    }
}

impl RocksStore {
    /// Opens (or creates) the store. Payloads that flowed to disk before a
    /// crash stay until the engine starts and asks for
    /// [`RocksStore::remove_orphans`]: a storage node restarting under a
    /// running engine must keep them.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Self::open_with(path, true)
    }

    /// As [`RocksStore::open`]; with `create_if_missing` false, a directory
    /// that holds no store is refused (`storage.create_if_missing`): a
    /// data volume that is not mounted must not start as an empty broker.
    pub fn open_with(path: &Path, create_if_missing: bool) -> Result<Self, StoreError> {
        Self::open_inner(path, create_if_missing, false, None)
    }

    /// As [`RocksStore::open_with`], for a member of a storage group: the
    /// store also holds the group's Raft log (`group/log.rs`), in a column
    /// family of its own. A store never in a group has none, so that a
    /// build without groups still opens it.
    pub fn open_for_group(path: &Path, create_if_missing: bool) -> Result<Self, StoreError> {
        Self::open_inner(path, create_if_missing, true, None)
    }

    /// A store for a group member held in RocksDB's in-memory environment
    /// `env`, at `path` inside it: what the simulation (`spillway-sim`)
    /// runs its members on. Nothing reaches a disk (snapshot files aside,
    /// under `path` on the real one); opened again over the same `env`, it
    /// finds what was written. Its calls are memory operations and run
    /// where they are made rather than on the blocking pool, so that a
    /// simulation on one thread replays exactly.
    pub fn open_in_memory(env: &rocksdb::Env, path: &Path) -> Result<Self, StoreError> {
        Self::open_inner(path, true, true, Some(env))
    }

    /// Writes the WAL out and fsyncs it. A store in memory has nothing to
    /// sync (RocksDB's memory environment cannot, and keeps every write).
    pub(crate) fn sync_wal(&self) -> Result<(), rocksdb::Error> {
        if self.in_memory {
            return Ok(());
        }
        self.db.flush_wal(true)
    }

    /// Runs `work` off the async runtime, as RocksDB calls block; in
    /// memory, right here.
    pub(crate) async fn off_runtime<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, tokio::task::JoinError> {
        if self.in_memory {
            return Ok(work());
        }
        tokio::task::spawn_blocking(work).await
    }

    fn open_inner(
        path: &Path,
        create_if_missing: bool,
        group: bool,
        env: Option<&rocksdb::Env>,
    ) -> Result<Self, StoreError> {
        if !create_if_missing && !path.join("CURRENT").is_file() {
            return Err(StoreError::Missing {
                path: path.to_path_buf(),
            });
        }
        let mut options = Options::default();
        if let Some(env) = env {
            options.set_env(env);
        }
        options.create_if_missing(true);
        options.set_compression_type(DBCompressionType::Lz4);
        options.increase_parallelism(2);
        // Group commit: concurrent writers share one WAL write and fsync.
        options.set_enable_pipelined_write(true);
        // RocksDB's memory is the process's memory (all-in-one), outside
        // the engine's budget, so it is bounded here (docs/flow-to-disk.md,
        // "Memory beyond the budget"): memtables of 16 MiB, at most two
        // (RocksDB's default is 64 MiB), and one block cache that also
        // holds the table files' index and filter blocks, which RocksDB
        // otherwise keeps outside any bound, one set per open file.
        options.set_write_buffer_size(MEMTABLE_BYTES);
        options.set_max_write_buffer_number(2);
        let mut table = BlockBasedOptions::default();
        table.set_block_size(DATA_BLOCK_BYTES);
        table.set_block_cache(&Cache::new_lru_cache(BLOCK_CACHE_BYTES));
        table.set_cache_index_and_filter_blocks(true);
        table.set_pin_l0_filter_and_index_blocks_in_cache(true);
        options.set_block_based_table_factory(&table);
        options.set_target_file_size_base(TABLE_FILE_BYTES);
        // A storage group's Raft log lives beside the records, in its own
        // column family: one WAL, so a log append's fsync also makes every
        // earlier apply durable. Opened whenever it exists.
        let mut names = DB::list_cf(&options, path)
            .unwrap_or_else(|_| vec![rocksdb::DEFAULT_COLUMN_FAMILY_NAME.to_string()]);
        if group && !names.iter().any(|name| name == RAFT_LOG_FAMILY) {
            names.push(RAFT_LOG_FAMILY.to_string());
            options.create_missing_column_families(true);
        }
        let families: Vec<_> = names
            .into_iter()
            .map(|name| ColumnFamilyDescriptor::new(name, options.clone()))
            .collect();
        let db = DB::open_cf_descriptors(&options, path, families).map_err(|source| {
            StoreError::Open {
                path: path.to_path_buf(),
                source,
            }
        })?;
        let db = Arc::new(db);
        let format_path = path.to_path_buf();
        check_format(&db, &format_path)?;
        let (store_id, epoch) = load_meta(&db)?;
        tracing::info!(path = %path.display(), store_id = %store_id, epoch, "store opened");
        Ok(Self {
            db,
            path: path.to_path_buf(),
            quota: Arc::new(Quota::default()),
            meta: Arc::new(Meta {
                store_id,
                lease: RwLock::new(LeaseState::new(epoch)),
                corrupt_records: AtomicU64::new(0),
            }),
            in_memory: env.is_some(),
        })
    }

    /// The store's id, created with it.
    pub fn store_id(&self) -> &str {
        &self.meta.store_id
    }

    /// Records skipped because they did not decode, since the store opened.
    pub fn corrupt_records(&self) -> u64 {
        self.meta.corrupt_records.load(Ordering::Relaxed)
    }

    fn describe(&self) -> String {
        format!("{} (store id {})", self.path.display(), self.meta.store_id)
    }

    /// Takes (epoch 0) or renews the engine lease (see `lease.rs`).
    pub fn acquire_lease(&self, request: &AcquireLeaseRequest) -> Result<Lease, StoreError> {
        let ttl = Duration::from_millis(request.ttl_ms.clamp(100, 600_000));
        let now = tokio::time::Instant::now();
        let mut lease = self.meta.lease.write();
        let grant = lease
            .acquire(request.epoch, ttl, now, &self.describe())
            .map_err(StoreError::Refused)?;
        let epoch = match grant {
            Grant::Renewed(epoch) => epoch,
            Grant::New(epoch) => {
                let mut options = WriteOptions::default();
                options.set_sync(true);
                self.db.put_opt(EPOCH_KEY, epoch.to_be_bytes(), &options)?;
                lease.commit(epoch, &request.holder, ttl, now);
                tracing::info!(
                    code = "MST-1104",
                    epoch,
                    holder = %request.holder,
                    store_id = %self.meta.store_id,
                    "MST-1104 : Store leased : Epoch {epoch} : {}",
                    request.holder
                );
                epoch
            }
        };
        Ok(Lease {
            epoch,
            store_id: self.meta.store_id.clone(),
            ttl_ms: ttl.as_millis() as u64,
        })
    }

    /// Ends the lease of `epoch` (a clean engine shutdown).
    pub fn release_lease(&self, epoch: u64) {
        if self.meta.lease.write().release(epoch) {
            tracing::info!(epoch, "store lease released");
        }
    }

    /// Writes `batch` if `epoch` is the current lease's.
    pub fn write_leased(&self, batch: &WriteBatch) -> Result<(), StoreError> {
        let lease = self.meta.lease.read();
        lease
            .check(batch.epoch, &self.describe())
            .map_err(StoreError::Refused)?;
        self.write_batch(batch)
    }

    /// [`RocksStore::scan_orphans`] for the engine holding `epoch`.
    /// The lease is checked before the scan and before every batch of
    /// deletes, not held across the scan: a long scan must not hold up the
    /// lease's renewal, nor the writes that wait behind it.
    pub fn remove_orphans_leased(&self, epoch: u64, below_id: u64) -> Result<Cleanup, StoreError> {
        self.check_lease(epoch)?;
        self.scan_orphans(below_id, || self.check_lease(epoch))
    }

    fn check_lease(&self, epoch: u64) -> Result<(), StoreError> {
        self.meta
            .lease
            .read()
            .check(epoch, &self.describe())
            .map_err(StoreError::Refused)
    }

    /// A record under `key` did not decode: log it, count it, and delete it
    /// so that it is not read again. Its queue entry, if any, goes when the
    /// engine finds the record missing.
    fn quarantine(&self, key: &[u8], error: &prost::DecodeError, bytes: usize) {
        self.meta.corrupt_records.fetch_add(1, Ordering::Relaxed);
        let shown = key.escape_ascii().to_string();
        let id = keys::message_id(key).or_else(|| {
            key.first()
                .filter(|kind| **kind == keys::ENTRY)
                .and_then(|_| keys::entry_id(key))
        });
        tracing::error!(
            code = "MST-1103",
            key = %shown,
            message_id = id,
            bytes,
            %error,
            path = %self.path.display(),
            "MST-1103 : Corrupt record skipped : Key {shown} : {error}"
        );
        let mut options = WriteOptions::default();
        options.set_sync(true);
        if let Err(error) = self.db.delete_opt(key, &options) {
            tracing::warn!(key = %shown, %error, "cannot delete a corrupt record");
        }
    }

    /// The ids below `below_id` of the message records no queue entry
    /// references (a storage group deletes them through its log).
    pub(crate) fn orphan_ids(&self, below_id: u64) -> Result<Vec<u64>, StoreError> {
        let entry_prefix = [keys::ENTRY];
        let mut referenced = HashSet::new();
        self.for_each_under(&entry_prefix, |key, _| {
            referenced.extend(keys::entry_id(key).filter(|id| *id < below_id));
            Ok(())
        })?;
        let mut orphans = Vec::new();
        self.for_each_under(&[keys::MESSAGE], |key, _| {
            orphans.extend(
                keys::message_id(key).filter(|id| *id < below_id && !referenced.contains(id)),
            );
            Ok(())
        })?;
        Ok(orphans)
    }

    /// Deletes the message records no queue entry references.
    pub fn remove_orphans(&self) -> Result<Cleanup, StoreError> {
        self.scan_orphans(u64::MAX, || Ok(()))
    }

    /// Deletes the message records with an id below `below_id` that no
    /// queue entry references. A starting engine asks with the first id it
    /// will give out: records at or above it are its own (payloads that
    /// flowed to disk hold no entry), and while it recovers no older id can
    /// gain an entry, so nothing it still needs is taken. `before_write`
    /// runs before each batch of deletes and may stop the scan.
    fn scan_orphans(
        &self,
        below_id: u64,
        before_write: impl Fn() -> Result<(), StoreError>,
    ) -> Result<Cleanup, StoreError> {
        let entry_prefix = [keys::ENTRY];
        let mut referenced = HashSet::new();
        self.for_each_under(&entry_prefix, |key, _| {
            referenced.extend(keys::entry_id(key).filter(|id| *id < below_id));
            Ok(())
        })?;
        let mut cleanup = Cleanup::default();
        let mut batch = rocksdb::WriteBatch::default();
        let message_prefix = [keys::MESSAGE];
        self.for_each_under(&message_prefix, |key, value| {
            let orphan =
                keys::message_id(key).is_some_and(|id| id < below_id && !referenced.contains(&id));
            if !orphan {
                return Ok(());
            }
            batch.delete(key);
            cleanup.orphaned_messages += 1;
            cleanup.orphaned_bytes += value.len() as u64;
            if batch.len() >= 10_000 {
                before_write()?;
                self.db.write(std::mem::take(&mut batch))?;
            }
            Ok(())
        })?;
        if cleanup.orphaned_messages > 0 {
            before_write()?;
            self.db.write(batch)?;
            let end = keys::prefix_end(&message_prefix);
            self.db
                .compact_range(Some(message_prefix.as_slice()), Some(end.as_slice()));
        }
        tracing::info!(
            orphaned_messages = cleanup.orphaned_messages,
            orphaned_bytes = cleanup.orphaned_bytes,
            "unreferenced message records removed"
        );
        Ok(cleanup)
    }

    /// Applies every op atomically, as durably as the batch asks.
    pub fn write_batch(&self, batch: &WriteBatch) -> Result<(), StoreError> {
        // Sized once: grown by doubling, a batch's buffer is up to twice
        // its contents (and three times while it is copied to grow).
        let mut rocks_batch =
            rocksdb::WriteBatch::with_capacity_bytes(batch.encoded_len() + 16 * batch.ops.len());
        for op in batch.ops.iter().filter_map(|op| op.op.as_ref()) {
            apply(&mut rocks_batch, op);
        }
        let mut options = WriteOptions::default();
        match batch.durability() {
            Durability::Volatile => options.disable_wal(true),
            Durability::Logged => {}
            Durability::Synced => options.set_sync(true),
        }
        self.db.write_opt(rocks_batch, &options)?;
        Ok(())
    }

    pub fn definitions(&self) -> Result<Definitions, StoreError> {
        // Counted before the scan, which deletes the user records that do
        // not decode: a store whose only user is corrupt still had users.
        let user_records = self.count(&[keys::USER])?.0;
        let users = self.scan::<UserDefinition>(&[keys::USER])?;
        let had_users = user_records > 0 || self.db.get(keys::USERS_MARKER)?.is_some();
        if user_records > 0 {
            // Stores written before the marker get it now, synced.
            let mut options = WriteOptions::default();
            options.set_sync(true);
            self.db.put_opt(keys::USERS_MARKER, [], &options)?;
        }
        Ok(Definitions {
            exchanges: self.scan::<ExchangeDefinition>(&[keys::EXCHANGE])?,
            queues: self.scan::<QueueDefinition>(&[keys::QUEUE])?,
            bindings: self.scan::<BindingDefinition>(&[keys::BINDING])?,
            vhosts: self.scan::<VhostDefinition>(&[keys::VHOST])?,
            users,
            permissions: self.scan::<PermissionDefinition>(&[keys::PERMISSION])?,
            had_users,
            policies: self.scan::<PolicyDefinition>(&[keys::POLICY])?,
        })
    }

    /// The entries of one durable queue, oldest first.
    pub fn entries(&self, vhost: &str, queue: &str) -> Result<Vec<QueueEntry>, StoreError> {
        self.scan(&keys::queue_entries_prefix(vhost, queue))
    }

    /// The message records of `ids` that exist, in the order asked.
    /// A record that does not decode is left out (and quarantined).
    pub fn read_messages(&self, ids: &[u64]) -> Result<Vec<MessageRecord>, StoreError> {
        let keys: Vec<[u8; 9]> = ids.iter().map(|id| keys::message_key(*id)).collect();
        let mut records = Vec::with_capacity(ids.len());
        // The blocks read fill the block cache: `fill_cache(false)` would
        // also keep out the index blocks of the table files read, and every
        // batch would read, checksum and decompress them again. Index and
        // filter blocks sit in the cache's high-priority pool, so the data
        // blocks of payloads read once push out only each other.
        for (key, value) in keys.iter().zip(self.db.multi_get(&keys)) {
            let Some(value) = value? else {
                continue;
            };
            match MessageRecord::decode(value.as_slice()) {
                Ok(record) => records.push(record),
                Err(error) => self.quarantine(key, &error, value.len()),
            }
        }
        Ok(records)
    }

    /// Delayed messages due by a time, or the count of those waiting
    /// (`crate::delayed`). A record that does not decode is left out (and
    /// quarantined).
    pub fn scan_delayed(
        &self,
        request: &spillway_proto::storage::ScanDelayedRequest,
    ) -> Result<spillway_proto::storage::DelayedBatch, StoreError> {
        let from = keys::delayed_key(request.from_due_ms, request.from_id);
        let entries = self
            .db
            .iterator(IteratorMode::From(&from, Direction::Forward));
        let scanned = crate::delayed::scan(entries, request)?;
        for (key, error, bytes) in scanned.corrupt {
            self.quarantine(&key, &error, bytes);
        }
        Ok(scanned.batch)
    }

    /// A handle that does not keep the database open, for readers that must
    /// not outlive the store (scrape-time metrics).
    pub(crate) fn downgrade(&self) -> WeakStore {
        WeakStore {
            db: Arc::downgrade(&self.db),
            path: self.path.clone(),
            quota: self.quota.clone(),
            meta: self.meta.clone(),
            in_memory: self.in_memory,
        }
    }

    pub fn status(&self, count_records: bool) -> Result<StoreStatus, StoreError> {
        let estimated_keys = self
            .db
            .property_int_value("rocksdb.estimate-num-keys")?
            .unwrap_or(0);
        let mut status = StoreStatus {
            disk_bytes: directory_size(&self.path),
            estimated_keys,
            ..Default::default()
        };
        if count_records {
            let (records, bytes) = self.count(&[keys::MESSAGE])?;
            status.message_records = records;
            status.message_record_bytes = bytes;
            status.queue_entries = self.count(&[keys::ENTRY])?.0;
        }
        Ok(status)
    }

    /// What RocksDB holds in memory now: memtables (active, immutable and
    /// pinned), the block cache, and table readers outside the cache.
    pub fn memory(&self) -> StoreMemory {
        let property = |name: &str| match self.db.property_int_value(name) {
            Ok(value) => value.unwrap_or(0),
            Err(error) => {
                tracing::debug!(property = name, %error, "reading a rocksdb property failed");
                0
            }
        };
        StoreMemory {
            memtables: property("rocksdb.size-all-mem-tables"),
            block_cache: property("rocksdb.block-cache-usage"),
            table_readers: property("rocksdb.estimate-table-readers-mem"),
        }
    }

    /// Keys under `prefix`, and their values' bytes.
    fn count(&self, prefix: &[u8]) -> Result<(u64, u64), StoreError> {
        let (mut keys, mut bytes) = (0, 0);
        self.for_each_under(prefix, |_, value| {
            keys += 1;
            bytes += value.len() as u64;
            Ok(())
        })?;
        Ok((keys, bytes))
    }

    /// The records under `prefix` that decode; the others are quarantined.
    fn scan<T: prost::Message + Default>(&self, prefix: &[u8]) -> Result<Vec<T>, StoreError> {
        let mut records = Vec::new();
        let mut corrupt = Vec::new();
        self.for_each_under(prefix, |key, value| {
            match T::decode(value) {
                Ok(record) => records.push(record),
                Err(error) => corrupt.push((key.to_vec(), error, value.len())),
            }
            Ok(())
        })?;
        for (key, error, bytes) in corrupt {
            self.quarantine(&key, &error, bytes);
        }
        Ok(records)
    }

    /// Visits every key under `prefix`, in order, with its value.
    fn for_each_under(
        &self,
        prefix: &[u8],
        mut visit: impl FnMut(&[u8], &[u8]) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        for entry in self
            .db
            .iterator(IteratorMode::From(prefix, Direction::Forward))
        {
            let (key, value) = entry?;
            if !key.starts_with(prefix) {
                break;
            }
            visit(&key, &value)?;
        }
        Ok(())
    }
}

fn check_format(db: &DB, path: &Path) -> Result<(), StoreError> {
    let found = match db.get(keys::FORMAT)? {
        Some(value) => value
            .as_slice()
            .try_into()
            .map(u32::from_be_bytes)
            .unwrap_or(0),
        None if is_empty(db)? => {
            let mut options = WriteOptions::default();
            options.set_sync(true);
            db.put_opt(keys::FORMAT, keys::FORMAT_VERSION.to_be_bytes(), &options)?;
            keys::FORMAT_VERSION
        }
        None => 1,
    };
    if keys::UPGRADES_FROM.contains(&found) {
        let mut options = WriteOptions::default();
        options.set_sync(true);
        db.put_opt(keys::FORMAT, keys::FORMAT_VERSION.to_be_bytes(), &options)?;
        tracing::info!(
            path = %path.display(),
            from = found,
            to = keys::FORMAT_VERSION,
            "store layout upgraded (records of the older layout read as uncompressed)"
        );
        return Ok(());
    }
    if found != keys::FORMAT_VERSION {
        return Err(StoreError::Format {
            path: path.to_path_buf(),
            found,
            expected: keys::FORMAT_VERSION,
        });
    }
    Ok(())
}

fn is_empty(db: &DB) -> Result<bool, StoreError> {
    match db.iterator(IteratorMode::Start).next() {
        None => Ok(true),
        Some(entry) => entry.map(|_| false).map_err(StoreError::from),
    }
}

/// The store's id and epoch; an id is created for a store that has none
/// (a new one, or one written before ids existed).
fn load_meta(db: &DB) -> Result<(String, u64), StoreError> {
    let epoch = db
        .get(EPOCH_KEY)?
        .and_then(|value| value.as_slice().try_into().ok().map(u64::from_be_bytes))
        .unwrap_or(0);
    if let Some(id) = db.get(STORE_ID_KEY)? {
        return Ok((String::from_utf8_lossy(&id).into_owned(), epoch));
    }
    let id = new_store_id();
    let mut options = WriteOptions::default();
    options.set_sync(true);
    db.put_opt(STORE_ID_KEY, id.as_bytes(), &options)?;
    Ok((id, epoch))
}

/// A store id unique enough to tell two data directories apart: the
/// creation time in nanoseconds, the process and a per-process counter.
fn new_store_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{nanos:x}-{:x}-{count:x}", std::process::id())
}

pub(crate) fn apply(batch: &mut rocksdb::WriteBatch, op: &write_op::Op) {
    use write_op::Op;
    match op {
        Op::PutVhost(def) => batch.put(
            keys::key(keys::VHOST, &[def.name.as_bytes()]),
            def.encode_to_vec(),
        ),
        Op::DeleteVhost(def) => batch.delete(keys::key(keys::VHOST, &[def.name.as_bytes()])),
        Op::PutUser(def) => {
            batch.put(keys::user_key(&def.name), def.encode_to_vec());
            batch.put(keys::USERS_MARKER, []);
        }
        Op::DeleteUser(def) => {
            batch.delete(keys::user_key(&def.name));
            let prefix = keys::user_permissions_prefix(&def.name);
            batch.delete_range(&prefix, &keys::prefix_end(&prefix));
        }
        Op::PutPermission(def) => batch.put(
            keys::permission_key(&def.user, &def.vhost),
            def.encode_to_vec(),
        ),
        Op::DeletePermission(def) => batch.delete(keys::permission_key(&def.user, &def.vhost)),
        Op::PutPolicy(def) => batch.put(
            keys::policy_key(&def.vhost, def.operator, &def.name),
            def.encode_to_vec(),
        ),
        Op::DeletePolicy(def) => {
            batch.delete(keys::policy_key(&def.vhost, def.operator, &def.name))
        }
        Op::PutDelayed(message) => batch.put(
            keys::delayed_key(message.due_ms, message.id),
            message.encode_to_vec(),
        ),
        Op::DeleteDelayed(key) => batch.delete(keys::delayed_key(key.due_ms, key.id)),
        Op::PutExchange(def) => batch.put(
            keys::key(keys::EXCHANGE, &[def.vhost.as_bytes(), def.name.as_bytes()]),
            def.encode_to_vec(),
        ),
        Op::DeleteExchange(key) => batch.delete(keys::key(
            keys::EXCHANGE,
            &[key.vhost.as_bytes(), key.name.as_bytes()],
        )),
        Op::PutQueue(def) => batch.put(
            keys::key(keys::QUEUE, &[def.vhost.as_bytes(), def.name.as_bytes()]),
            def.encode_to_vec(),
        ),
        Op::DeleteQueue(key) => {
            batch.delete(keys::key(
                keys::QUEUE,
                &[key.vhost.as_bytes(), key.name.as_bytes()],
            ));
            delete_queue_entries(batch, &key.vhost, &key.name);
        }
        Op::PutBinding(def) => batch.put(keys::binding_key(def), def.encode_to_vec()),
        Op::DeleteBinding(def) => batch.delete(keys::binding_key(def)),
        Op::PutMessage(message) => {
            batch.put(keys::message_key(message.id), message.encode_to_vec())
        }
        Op::DeleteMessage(key) => batch.delete(keys::message_key(key.id)),
        Op::PutQueueEntry(entry) => batch.put(
            keys::entry_key(&entry.vhost, &entry.queue, entry.id),
            entry.encode_to_vec(),
        ),
        Op::DeleteQueueEntry(key) => batch.delete(keys::entry_key(&key.vhost, &key.queue, key.id)),
    }
}

fn delete_queue_entries(batch: &mut rocksdb::WriteBatch, vhost: &str, queue: &str) {
    let prefix = keys::queue_entries_prefix(vhost, queue);
    batch.delete_range(&prefix, &keys::prefix_end(&prefix));
}

pub(crate) fn directory_size(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.metadata().ok())
        .filter(|meta| meta.is_file())
        .map(|meta| meta.len())
        .sum()
}

impl RocksStore {
    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&RocksStore) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, ServiceError> {
        let store = self.clone();
        Ok(self
            .off_runtime(move || work(&store))
            .await
            .map_err(StoreError::from)??)
    }
}

#[async_trait]
impl StorageApi for RocksStore {
    async fn write(&self, batch: Arc<WriteBatch>) -> Result<(), ServiceError> {
        use tracing::Instrument;
        let span = if spillway_proto::util::trace::in_trace() {
            tracing::trace_span!(target: spillway_proto::util::trace::TARGET, "write", ops = batch.ops.len())
        } else {
            tracing::Span::none()
        };
        self.blocking(move |store| store.write_leased(&batch))
            .instrument(span)
            .await
    }

    async fn load_definitions(&self) -> Result<Definitions, ServiceError> {
        self.blocking(|store| store.definitions()).await
    }

    async fn load_messages(
        &self,
        vhost: &str,
        queue: &str,
    ) -> Result<Vec<QueueEntry>, ServiceError> {
        let (vhost, queue) = (vhost.to_string(), queue.to_string());
        self.blocking(move |store| store.entries(&vhost, &queue))
            .await
    }

    async fn read_messages(&self, ids: Vec<u64>) -> Result<Vec<MessageRecord>, ServiceError> {
        self.blocking(move |store| store.read_messages(&ids)).await
    }

    async fn status(&self, count_records: bool) -> Result<StoreStatus, ServiceError> {
        self.blocking(move |store| store.status(count_records))
            .await
    }

    async fn scan_delayed(
        &self,
        request: spillway_proto::storage::ScanDelayedRequest,
    ) -> Result<spillway_proto::storage::DelayedBatch, ServiceError> {
        self.blocking(move |store| store.scan_delayed(&request))
            .await
    }

    async fn watch_quota(&self) -> Result<spillway_proto::storage::QuotaStream, ServiceError> {
        Ok(self.quota.watch())
    }

    async fn remove_orphans(&self, epoch: u64, below_id: u64) -> Result<u64, ServiceError> {
        self.blocking(move |store| {
            store
                .remove_orphans_leased(epoch, below_id)
                .map(|c| c.orphaned_messages)
        })
        .await
    }

    async fn acquire_lease(&self, request: AcquireLeaseRequest) -> Result<Lease, ServiceError> {
        self.blocking(move |store| store.acquire_lease(&request))
            .await
    }

    async fn release_lease(&self, epoch: u64) -> Result<(), ServiceError> {
        self.release_lease(epoch);
        Ok(())
    }

    async fn set_quota(
        &self,
        request: spillway_proto::management::SetStoreQuotaRequest,
    ) -> Result<(), ServiceError> {
        let (overfull, underfull) = self.quota_limits();
        RocksStore::set_quota(
            self,
            request.overfull_size.unwrap_or(overfull),
            request.underfull_size.unwrap_or(underfull),
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_ops::{op, put_entry, put_message, synced};
    use spillway_proto::storage::{MessageId, QueueEntryKey, QueueKey};

    #[test]
    fn entries_survive_reopen_in_id_order_and_deletes_apply() -> Result<(), StoreError> {
        let dir = tempfile::tempdir().expect("temp dir");
        {
            let store = RocksStore::open(dir.path())?;
            store.write_batch(&synced(vec![
                put_message(300),
                put_entry("q", 300),
                put_message(2),
                put_entry("q", 2),
                put_entry("q2", 2),
            ]))?;
            let delete = op(write_op::Op::DeleteQueueEntry(QueueEntryKey {
                vhost: "/".into(),
                queue: "q".into(),
                id: 300,
            }));
            store.write_batch(&synced(vec![
                delete,
                op(write_op::Op::DeleteMessage(MessageId { id: 300 })),
                put_message(7),
                put_entry("q", 7),
            ]))?;
        }
        let store = RocksStore::open(dir.path())?;
        let ids: Vec<u64> = store.entries("/", "q")?.iter().map(|m| m.id).collect();
        assert_eq!(ids, vec![2, 7]);
        let read: Vec<u64> = store
            .read_messages(&[7, 300, 2])?
            .iter()
            .map(|m| m.id)
            .collect();
        assert_eq!(read, vec![7, 2]);
        let delete_queue = op(write_op::Op::DeleteQueue(QueueKey {
            vhost: "/".into(),
            name: "q".into(),
        }));
        store.write_batch(&synced(vec![delete_queue]))?;
        assert!(store.entries("/", "q")?.is_empty());
        assert_eq!(store.entries("/", "q2")?.len(), 1);
        Ok(())
    }

    #[test]
    fn removing_orphans_keeps_only_referenced_message_records() -> Result<(), StoreError> {
        let dir = tempfile::tempdir().expect("temp dir");
        {
            let store = RocksStore::open(dir.path())?;
            // 1 is held by a durable queue; 2 and 3 flowed to disk and were
            // never deleted (the broker died).
            store.write_batch(&synced(vec![put_message(1), put_entry("q", 1)]))?;
            store.write_batch(&WriteBatch {
                ops: vec![put_message(2), put_message(3)],
                durability: Durability::Logged.into(),
                epoch: 0,
                sequence: 0,
            })?;
            let status = store.status(true)?;
            assert_eq!((status.message_records, status.queue_entries), (3, 1));
        }
        let store = RocksStore::open(dir.path())?;
        // Opening alone keeps them (an engine may still hold them).
        assert_eq!(store.status(true)?.message_records, 3);
        let cleanup = store.remove_orphans()?;
        assert_eq!(cleanup.orphaned_messages, 2);
        let status = store.status(true)?;
        assert_eq!((status.message_records, status.queue_entries), (1, 1));
        assert_eq!(store.read_messages(&[1, 2, 3])?.len(), 1);
        Ok(())
    }

    fn lease(store: &RocksStore, epoch: u64) -> Result<Lease, StoreError> {
        store.acquire_lease(&AcquireLeaseRequest {
            epoch,
            ttl_ms: 5_000,
            holder: "test".into(),
        })
    }

    #[test]
    fn the_store_id_and_epoch_survive_reopen_and_stale_epochs_are_refused() -> Result<(), StoreError>
    {
        let dir = tempfile::tempdir().expect("temp dir");
        let (id, epoch) = {
            let store = RocksStore::open(dir.path())?;
            let first = lease(&store, 0)?;
            assert!(lease(&store, 0).is_err(), "a second engine is refused");
            store.release_lease(first.epoch);
            let second = lease(&store, 0)?;
            assert_eq!(second.epoch, first.epoch + 1);
            let mut batch = synced(vec![put_message(1)]);
            batch.epoch = first.epoch;
            match store.write_leased(&batch) {
                Err(error) => assert!(matches!(
                    error.to_service_error(),
                    ServiceError::FailedPrecondition(_)
                )),
                Ok(()) => panic!("a deposed engine wrote"),
            }
            assert!(store.remove_orphans_leased(first.epoch, u64::MAX).is_err());
            batch.epoch = second.epoch;
            store.write_leased(&batch)?;
            (second.store_id, second.epoch)
        };
        let store = RocksStore::open(dir.path())?;
        assert_eq!(store.store_id(), id);
        // Liveness is not stored: the running engine renews its epoch.
        assert_eq!(lease(&store, epoch)?.epoch, epoch);
        let other = tempfile::tempdir().expect("temp dir");
        assert_ne!(RocksStore::open(other.path())?.store_id(), id);
        Ok(())
    }

    #[test]
    fn a_corrupt_record_is_skipped_counted_and_deleted() -> Result<(), StoreError> {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = RocksStore::open(dir.path())?;
        store.write_batch(&synced(vec![
            put_message(1),
            put_entry("q", 1),
            put_message(2),
            put_entry("q", 2),
        ]))?;
        // Field 1 as a length-delimited field of 200 bytes, then nothing.
        store
            .db
            .put(keys::message_key(1), [0x0a, 0xc8, 0x01, 0x01])?;
        store.db.put(keys::entry_key("/", "q", 2), [0xff, 0xff])?;
        let read: Vec<u64> = store.read_messages(&[1, 2])?.iter().map(|m| m.id).collect();
        assert_eq!(read, vec![2]);
        let entries: Vec<u64> = store.entries("/", "q")?.iter().map(|e| e.id).collect();
        assert_eq!(entries, vec![1]);
        assert_eq!(store.corrupt_records(), 2);
        assert!(store.db.get(keys::message_key(1))?.is_none(), "deleted");
        // Read again: nothing more to skip.
        store.read_messages(&[1, 2])?;
        store.entries("/", "q")?;
        assert_eq!(store.corrupt_records(), 2);
        Ok(())
    }

    #[test]
    fn a_store_that_had_users_says_so_when_they_are_gone_or_corrupt() -> Result<(), StoreError> {
        let user = |name: &str| spillway_proto::storage::WriteOp {
            op: Some(write_op::Op::PutUser(UserDefinition {
                name: name.into(),
                ..Default::default()
            })),
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let store = RocksStore::open(dir.path())?;
        assert!(!store.definitions()?.had_users, "a new store");
        store.write_batch(&synced(vec![user("a")]))?;
        assert!(store.definitions()?.had_users);
        store.write_batch(&synced(vec![spillway_proto::storage::WriteOp {
            op: Some(write_op::Op::DeleteUser(UserDefinition {
                name: "a".into(),
                ..Default::default()
            })),
        }]))?;
        let definitions = store.definitions()?;
        assert!(
            definitions.users.is_empty() && definitions.had_users,
            "all deleted"
        );

        // A store written before the marker, whose one user record is
        // corrupt: the record goes, the store still had users.
        let old = tempfile::tempdir().expect("temp dir");
        let store = RocksStore::open(old.path())?;
        store.db.put(keys::user_key("b"), [0xff, 0xff])?;
        let definitions = store.definitions()?;
        assert!(
            definitions.users.is_empty() && definitions.had_users,
            "corrupt"
        );
        assert!(store.definitions()?.had_users, "and remembered");
        Ok(())
    }

    #[test]
    fn without_create_if_missing_an_empty_directory_is_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        match RocksStore::open_with(dir.path(), false) {
            Err(StoreError::Missing { path }) => assert_eq!(path, dir.path()),
            Err(other) => panic!("unexpected error: {other}"),
            Ok(_) => panic!("an empty directory was opened"),
        }
        drop(RocksStore::open(dir.path()).expect("created"));
        RocksStore::open_with(dir.path(), false).expect("an existing store opens");
    }

    #[test]
    fn rocksdb_errors_are_told_apart_by_kind() {
        use rocksdb::ErrorKind;
        let text = || "IO error: No space left on device".to_string();
        assert!(matches!(
            classify(ErrorKind::IOError, text()),
            ServiceError::ResourceExhausted(_)
        ));
        assert!(matches!(
            classify(ErrorKind::Corruption, text()),
            ServiceError::DataLoss(_)
        ));
        assert!(classify(ErrorKind::Busy, text()).is_transient());
        assert!(classify(ErrorKind::TimedOut, text()).is_transient());
        assert!(!classify(ErrorKind::NotSupported, text()).is_transient());
        assert!(matches!(
            StoreError::Refused(ServiceError::FailedPrecondition("stale".into()))
                .to_service_error(),
            ServiceError::FailedPrecondition(_)
        ));
        let Err(source) = MessageRecord::decode([0xffu8, 0xff].as_slice()) else {
            panic!("garbage decoded");
        };
        let corrupt = StoreError::Corrupt {
            key: b"p".to_vec(),
            source,
        };
        assert!(matches!(
            corrupt.to_service_error(),
            ServiceError::DataLoss(_)
        ));
    }

    #[test]
    fn a_layout_2_store_is_upgraded_and_its_records_read_uncompressed() -> Result<(), StoreError> {
        let dir = tempfile::tempdir().expect("temp dir");
        let old = MessageRecord {
            id: 7,
            body: b"before compression".to_vec().into(),
            persistent: true,
            ..Default::default()
        };
        {
            let db = DB::open_default(dir.path())?;
            db.put(keys::FORMAT, 2u32.to_be_bytes())?;
            db.put(keys::message_key(7), old.encode_to_vec())?;
        }
        {
            let store = RocksStore::open(dir.path())?;
            let records = store.read_messages(&[7])?;
            assert_eq!(records, vec![old.clone()]);
            let body = records[0].body();
            assert!(!body.is_compressed());
            assert_eq!(body.decode(0).ok(), Some(old.body.clone()));
        }
        let db = DB::open_default(dir.path())?;
        assert_eq!(
            db.get(keys::FORMAT)?,
            Some(keys::FORMAT_VERSION.to_be_bytes().to_vec())
        );
        Ok(())
    }

    #[test]
    fn a_store_in_another_layout_is_refused_not_misread() -> Result<(), StoreError> {
        let dir = tempfile::tempdir().expect("temp dir");
        {
            let db = DB::open_default(dir.path())?;
            db.put(keys::entry_key("/", "q", 1), b"old")?;
        }
        match RocksStore::open(dir.path()) {
            Err(StoreError::Format { found: 1, .. }) => Ok(()),
            Err(other) => panic!("unexpected error: {other}"),
            Ok(_) => panic!("an old layout was opened"),
        }
    }
}
