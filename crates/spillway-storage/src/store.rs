use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use prost::Message as _;
use rocksdb::{DBCompressionType, Direction, IteratorMode, Options, WriteOptions, DB};
use spillway_proto::storage::{
    write_op, BindingDefinition, Definitions, ExchangeDefinition, QueueDefinition, StoreStatus,
    StoredMessage, WriteBatch,
};
use spillway_proto::{ServiceError, StorageApi};

use crate::keys;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the store at {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: rocksdb::Error,
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
    db: Arc<DB>,
    path: PathBuf,
}

/// A [`RocksStore`] that may have been closed since.
pub(crate) struct WeakStore {
    db: std::sync::Weak<DB>,
    path: PathBuf,
}

impl WeakStore {
    /// The store, while something else still keeps it open.
    pub(crate) fn upgrade(&self) -> Option<RocksStore> {
        Some(RocksStore {
            db: self.db.upgrade()?,
            path: self.path.clone(),
        })
    }
}

impl RocksStore {
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let mut options = Options::default();
        options.create_if_missing(true);
        options.set_compression_type(DBCompressionType::Lz4);
        options.increase_parallelism(2);
        // Group commit: concurrent writers share one WAL write and fsync.
        options.set_enable_pipelined_write(true);
        let db = DB::open(&options, path).map_err(|source| StoreError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        tracing::info!(path = %path.display(), "store opened");
        Ok(Self {
            db: Arc::new(db),
            path: path.to_path_buf(),
        })
    }

    /// Applies every op atomically, then fsyncs the write-ahead log once.
    pub fn write_sync(&self, batch: &WriteBatch) -> Result<(), StoreError> {
        let mut rocks_batch = rocksdb::WriteBatch::default();
        for op in batch.ops.iter().filter_map(|op| op.op.as_ref()) {
            apply(&mut rocks_batch, op);
        }
        let mut options = WriteOptions::default();
        options.set_sync(true);
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

    pub fn messages(&self, vhost: &str, queue: &str) -> Result<Vec<StoredMessage>, StoreError> {
        self.scan(&keys::queue_messages_prefix(vhost, queue))
    }

    /// A handle that does not keep the database open, for readers that must
    /// not outlive the store (scrape-time metrics).
    pub(crate) fn downgrade(&self) -> WeakStore {
        WeakStore {
            db: Arc::downgrade(&self.db),
            path: self.path.clone(),
        }
    }

    pub fn status(&self) -> Result<StoreStatus, StoreError> {
        let message_count = self
            .db
            .property_int_value("rocksdb.estimate-num-keys")?
            .unwrap_or(0);
        Ok(StoreStatus {
            disk_bytes: directory_size(&self.path),
            message_count,
        })
    }

    fn scan<T: prost::Message + Default>(&self, prefix: &[u8]) -> Result<Vec<T>, StoreError> {
        let mut records = Vec::new();
        for entry in self
            .db
            .iterator(IteratorMode::From(prefix, Direction::Forward))
        {
            let (key, value) = entry?;
            if !key.starts_with(prefix) {
                break;
            }
            let record = T::decode(&*value).map_err(|source| StoreError::Corrupt {
                key: key.to_vec(),
                source,
            })?;
            records.push(record);
        }
        Ok(records)
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
            delete_queue_messages(batch, &key.vhost, &key.name);
        }
        Op::PutBinding(def) => batch.put(binding_key(def), def.encode_to_vec()),
        Op::DeleteBinding(def) => batch.delete(binding_key(def)),
        Op::PutMessage(message) => batch.put(
            keys::message_key(&message.vhost, &message.queue, message.id),
            message.encode_to_vec(),
        ),
        Op::DeleteMessage(key) => batch.delete(keys::message_key(&key.vhost, &key.queue, key.id)),
    }
}

fn delete_queue_messages(batch: &mut rocksdb::WriteBatch, vhost: &str, queue: &str) {
    let prefix = keys::queue_messages_prefix(vhost, queue);
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

fn directory_size(path: &Path) -> u64 {
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

#[async_trait]
impl StorageApi for RocksStore {
    async fn write(&self, batch: Arc<WriteBatch>) -> Result<(), ServiceError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || store.write_sync(&batch))
            .await
            .map_err(StoreError::from)??;
        Ok(())
    }

    async fn load_definitions(&self) -> Result<Definitions, ServiceError> {
        let store = self.clone();
        Ok(tokio::task::spawn_blocking(move || store.definitions())
            .await
            .map_err(StoreError::from)??)
    }

    async fn load_messages(
        &self,
        vhost: &str,
        queue: &str,
    ) -> Result<Vec<StoredMessage>, ServiceError> {
        let (store, vhost, queue) = (self.clone(), vhost.to_string(), queue.to_string());
        Ok(
            tokio::task::spawn_blocking(move || store.messages(&vhost, &queue))
                .await
                .map_err(StoreError::from)??,
        )
    }

    async fn status(&self) -> Result<StoreStatus, ServiceError> {
        let store = self.clone();
        Ok(tokio::task::spawn_blocking(move || store.status())
            .await
            .map_err(StoreError::from)??)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spillway_proto::storage::{MessageKey, QueueKey, WriteOp};

    fn put_message(queue: &str, id: u64) -> WriteOp {
        WriteOp {
            op: Some(write_op::Op::PutMessage(StoredMessage {
                vhost: "/".into(),
                queue: queue.into(),
                id,
                body: vec![id as u8; 3].into(),
                ..Default::default()
            })),
        }
    }

    #[test]
    fn messages_survive_reopen_in_id_order_and_deletes_apply() -> Result<(), StoreError> {
        let dir = tempfile::tempdir().expect("temp dir");
        {
            let store = RocksStore::open(dir.path())?;
            let ops = vec![
                put_message("q", 300),
                put_message("q", 2),
                put_message("q2", 1),
            ];
            store.write_sync(&WriteBatch { ops })?;
            let delete = WriteOp {
                op: Some(write_op::Op::DeleteMessage(MessageKey {
                    vhost: "/".into(),
                    queue: "q".into(),
                    id: 300,
                })),
            };
            store.write_sync(&WriteBatch {
                ops: vec![delete, put_message("q", 7)],
            })?;
        }
        let store = RocksStore::open(dir.path())?;
        let ids: Vec<u64> = store.messages("/", "q")?.iter().map(|m| m.id).collect();
        assert_eq!(ids, vec![2, 7]);
        let delete_queue = WriteOp {
            op: Some(write_op::Op::DeleteQueue(QueueKey {
                vhost: "/".into(),
                name: "q".into(),
            })),
        };
        store.write_sync(&WriteBatch {
            ops: vec![delete_queue],
        })?;
        assert!(store.messages("/", "q")?.is_empty());
        assert_eq!(store.messages("/", "q2")?.len(), 1);
        Ok(())
    }
}
