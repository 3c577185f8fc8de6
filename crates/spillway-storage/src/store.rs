//! `RocksStore`: the `StorageApi` over RocksDB. One write batch per engine
//! batch (the group commit), with the durability it asks for; the key layout
//! is in `keys.rs`; start-up checks the layout version, and `remove_orphans`
//! deletes records no queue entry holds.
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use prost::Message as _;
use rocksdb::{DBCompressionType, Direction, IteratorMode, Options, WriteOptions, DB};
use spillway_proto::storage::{
    write_op, BindingDefinition, Definitions, Durability, ExchangeDefinition, MessageRecord,
    QueueDefinition, QueueEntry, StoreStatus, WriteBatch,
};
use spillway_proto::{ServiceError, StorageApi};

use crate::keys;
use crate::quota::Quota;

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
    #[error("rocksdb: {0}")]
    Rocks(#[from] rocksdb::Error),
    #[error("corrupt record under key {key:?}: {source}")]
    Corrupt {
        key: Vec<u8>,
        #[source]
        source: prost::DecodeError,
    },
    #[error("storage task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl From<StoreError> for ServiceError {
    fn from(error: StoreError) -> Self {
        ServiceError::Internal(error.to_string())
    }
}

/// The RocksDB database behind the storage node. Cheap to clone.
#[derive(Clone)]
pub struct RocksStore {
    pub(crate) db: Arc<DB>,
    pub(crate) path: PathBuf,
    pub(crate) quota: Arc<Quota>,
}

/// A [`RocksStore`] that may have been closed since.
pub(crate) struct WeakStore {
    db: std::sync::Weak<DB>,
    path: PathBuf,
    quota: Arc<Quota>,
}

impl WeakStore {
    /// The store, while something else still keeps it open.
    pub(crate) fn upgrade(&self) -> Option<RocksStore> {
        Some(RocksStore {
            db: self.db.upgrade()?,
            path: self.path.clone(),
            quota: self.quota.clone(),
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
    /// Opens (or creates) the store. Payloads that flowed to disk before a
    /// crash stay until the engine starts and asks for
    /// [`RocksStore::remove_orphans`]: a storage node restarting under a
    /// running engine must keep them.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let mut options = Options::default();
        options.create_if_missing(true);
        options.set_compression_type(DBCompressionType::Lz4);
        options.increase_parallelism(2);
        // Group commit: concurrent writers share one WAL write and fsync.
        options.set_enable_pipelined_write(true);
        // Memtables count against the process's memory (all-in-one): 16 MiB
        // each, at most two, rather than RocksDB's 64 MiB. Spilled payloads
        // reach table files sooner; the flow-to-disk benchmark measures RSS.
        options.set_write_buffer_size(16 << 20);
        options.set_max_write_buffer_number(2);
        let db = DB::open(&options, path).map_err(|source| StoreError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let store = Self {
            db: Arc::new(db),
            path: path.to_path_buf(),
            quota: Arc::new(Quota::default()),
        };
        store.check_format()?;
        tracing::info!(path = %path.display(), "store opened");
        Ok(store)
    }

    fn check_format(&self) -> Result<(), StoreError> {
        let found = match self.db.get(keys::FORMAT)? {
            Some(value) => value
                .as_slice()
                .try_into()
                .map(u32::from_be_bytes)
                .unwrap_or(0),
            None if self.is_empty()? => {
                let mut options = WriteOptions::default();
                options.set_sync(true);
                self.db
                    .put_opt(keys::FORMAT, keys::FORMAT_VERSION.to_be_bytes(), &options)?;
                keys::FORMAT_VERSION
            }
            None => 1,
        };
        if found != keys::FORMAT_VERSION {
            return Err(StoreError::Format {
                path: self.path.clone(),
                found,
                expected: keys::FORMAT_VERSION,
            });
        }
        Ok(())
    }

    fn is_empty(&self) -> Result<bool, StoreError> {
        match self.db.iterator(IteratorMode::Start).next() {
            None => Ok(true),
            Some(entry) => entry.map(|_| false).map_err(StoreError::from),
        }
    }

    /// Deletes the message records no queue entry references. Run before the
    /// engine connects, so nothing can reference them any more.
    pub fn remove_orphans(&self) -> Result<Cleanup, StoreError> {
        let entry_prefix = [keys::ENTRY];
        let mut referenced = HashSet::new();
        self.for_each_under(&entry_prefix, |key, _| {
            referenced.extend(keys::entry_id(key));
            Ok(())
        })?;
        let mut cleanup = Cleanup::default();
        let mut batch = rocksdb::WriteBatch::default();
        let message_prefix = [keys::MESSAGE];
        self.for_each_under(&message_prefix, |key, value| {
            let orphan = keys::message_id(key).is_some_and(|id| !referenced.contains(&id));
            if !orphan {
                return Ok(());
            }
            batch.delete(key);
            cleanup.orphaned_messages += 1;
            cleanup.orphaned_bytes += value.len() as u64;
            if batch.len() >= 10_000 {
                self.db.write(std::mem::take(&mut batch))?;
            }
            Ok(())
        })?;
        if cleanup.orphaned_messages > 0 {
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
        let mut rocks_batch = rocksdb::WriteBatch::default();
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
        Ok(Definitions {
            exchanges: self.scan::<ExchangeDefinition>(&[keys::EXCHANGE])?,
            queues: self.scan::<QueueDefinition>(&[keys::QUEUE])?,
            bindings: self.scan::<BindingDefinition>(&[keys::BINDING])?,
        })
    }

    /// The entries of one durable queue, oldest first.
    pub fn entries(&self, vhost: &str, queue: &str) -> Result<Vec<QueueEntry>, StoreError> {
        self.scan(&keys::queue_entries_prefix(vhost, queue))
    }

    /// The message records of `ids` that exist, in the order asked.
    pub fn read_messages(&self, ids: &[u64]) -> Result<Vec<MessageRecord>, StoreError> {
        let keys: Vec<[u8; 9]> = ids.iter().map(|id| keys::message_key(*id)).collect();
        let mut records = Vec::with_capacity(ids.len());
        for (key, value) in keys.iter().zip(self.db.multi_get(&keys)) {
            let Some(value) = value? else {
                continue;
            };
            let record =
                MessageRecord::decode(value.as_slice()).map_err(|source| StoreError::Corrupt {
                    key: key.to_vec(),
                    source,
                })?;
            records.push(record);
        }
        Ok(records)
    }

    /// A handle that does not keep the database open, for readers that must
    /// not outlive the store (scrape-time metrics).
    pub(crate) fn downgrade(&self) -> WeakStore {
        WeakStore {
            db: Arc::downgrade(&self.db),
            path: self.path.clone(),
            quota: self.quota.clone(),
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

    fn scan<T: prost::Message + Default>(&self, prefix: &[u8]) -> Result<Vec<T>, StoreError> {
        let mut records = Vec::new();
        self.for_each_under(prefix, |key, value| {
            let record = T::decode(value).map_err(|source| StoreError::Corrupt {
                key: key.to_vec(),
                source,
            })?;
            records.push(record);
            Ok(())
        })?;
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

fn apply(batch: &mut rocksdb::WriteBatch, op: &write_op::Op) {
    use write_op::Op;
    match op {
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
        Op::PutBinding(def) => batch.put(binding_key(def), def.encode_to_vec()),
        Op::DeleteBinding(def) => batch.delete(binding_key(def)),
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

fn binding_key(def: &BindingDefinition) -> Vec<u8> {
    keys::key(
        keys::BINDING,
        &[
            def.vhost.as_bytes(),
            def.exchange.as_bytes(),
            def.queue.as_bytes(),
            def.routing_key.as_bytes(),
            &def.arguments,
            &[u8::from(def.to_exchange)],
        ],
    )
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
        Ok(tokio::task::spawn_blocking(move || work(&store))
            .await
            .map_err(StoreError::from)??)
    }
}

#[async_trait]
impl StorageApi for RocksStore {
    async fn write(&self, batch: Arc<WriteBatch>) -> Result<(), ServiceError> {
        use tracing::Instrument;
        let span = if spillway_proto::trace::in_trace() {
            tracing::trace_span!(target: spillway_proto::trace::TARGET, "write", ops = batch.ops.len())
        } else {
            tracing::Span::none()
        };
        self.blocking(move |store| store.write_batch(&batch))
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

    async fn watch_quota(&self) -> Result<spillway_proto::QuotaStream, ServiceError> {
        Ok(self.quota.watch())
    }

    async fn remove_orphans(&self) -> Result<u64, ServiceError> {
        self.blocking(|store| store.remove_orphans().map(|c| c.orphaned_messages))
            .await
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
