//! [`MemoryStore`]: a [`StorageApi`] kept in memory, for tests of the
//! components above the store (the engine) where RocksDB is not what is
//! being tested.
//!
//! It is a real implementation, not a mock: one `BTreeMap` in the same key
//! layout as [`RocksStore`](crate::RocksStore) (`keys.rs`), values
//! protobuf-encoded, every batch applied atomically under one lock, deleting
//! a queue deleting its entries, orphans found as RocksDB's store finds
//! them. What it does not have: durability (every write lands in memory,
//! whatever the batch asks), a disk (sizes are the bytes of keys and values)
//! and a quota monitor (tests set the quota state with
//! [`MemoryStore::set_overfull`]).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use prost::Message as _;
use spillway_proto::storage::{
    write_op, BindingDefinition, Definitions, ExchangeDefinition, MessageRecord,
    PermissionDefinition, PolicyDefinition, QueueDefinition, QueueEntry, QuotaState, StoreStatus,
    UserDefinition, VhostDefinition, WriteBatch,
};
use spillway_proto::{
    storage::{QuotaStream, StorageApi},
    ServiceError,
};
use tokio::sync::watch;

use crate::keys;

/// The store in memory. Cheap to clone; clones share one map.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    map: Mutex<BTreeMap<Vec<u8>, Vec<u8>>>,
    /// The engine lease, as `RocksStore` keeps it (epoch not stored).
    lease: Mutex<crate::lease::LeaseState>,
    quota: watch::Sender<QuotaState>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                map: Mutex::new(BTreeMap::new()),
                lease: Mutex::new(crate::lease::LeaseState::new(0)),
                quota: watch::Sender::new(QuotaState::default()),
            }),
        }
    }

    /// Applies every op of the batch at once.
    pub fn write_batch(&self, batch: &WriteBatch) {
        let mut map = self.inner.map.lock();
        for op in batch.ops.iter().filter_map(|op| op.op.as_ref()) {
            apply(&mut map, op);
        }
    }

    pub fn definitions(&self) -> Result<Definitions, ServiceError> {
        let map = self.inner.map.lock();
        Ok(Definitions {
            exchanges: scan::<ExchangeDefinition>(&map, &[keys::EXCHANGE])?,
            queues: scan::<QueueDefinition>(&map, &[keys::QUEUE])?,
            bindings: scan::<BindingDefinition>(&map, &[keys::BINDING])?,
            vhosts: scan::<VhostDefinition>(&map, &[keys::VHOST])?,
            users: scan::<UserDefinition>(&map, &[keys::USER])?,
            permissions: scan::<PermissionDefinition>(&map, &[keys::PERMISSION])?,
            had_users: map.contains_key(keys::USERS_MARKER),
            policies: scan::<PolicyDefinition>(&map, &[keys::POLICY])?,
        })
    }

    /// The entries of one durable queue, oldest first.
    pub fn entries(&self, vhost: &str, queue: &str) -> Result<Vec<QueueEntry>, ServiceError> {
        scan(
            &self.inner.map.lock(),
            &keys::queue_entries_prefix(vhost, queue),
        )
    }

    /// The message records of `ids` that exist, in the order asked.
    pub fn read(&self, ids: &[u64]) -> Result<Vec<MessageRecord>, ServiceError> {
        let map = self.inner.map.lock();
        let mut records = Vec::with_capacity(ids.len());
        for id in ids {
            let key = keys::message_key(*id);
            if let Some(value) = map.get(key.as_slice()) {
                records.push(decode(&key, value)?);
            }
        }
        Ok(records)
    }

    /// Deletes the message records no queue entry references; returns how
    /// many.
    /// Deletes the records with an id below `below_id` that no queue entry
    /// references (see `RocksStore::remove_orphans_leased`).
    pub fn remove_orphaned_records(&self, below_id: u64) -> u64 {
        let mut map = self.inner.map.lock();
        let referenced: HashSet<u64> = under(&map, &[keys::ENTRY])
            .filter_map(|(key, _)| keys::entry_id(key))
            .collect();
        let orphans: Vec<Vec<u8>> = under(&map, &[keys::MESSAGE])
            .filter(|(key, _)| {
                keys::message_id(key).is_some_and(|id| id < below_id && !referenced.contains(&id))
            })
            .map(|(key, _)| key.clone())
            .collect();
        for key in &orphans {
            map.remove(key);
        }
        orphans.len() as u64
    }

    /// Sets the quota state the engine watches (overfull: producers blocked).
    pub fn set_overfull(&self, overfull: bool) {
        self.inner.quota.send_if_modified(|state| {
            let changed = state.overfull != overfull;
            state.overfull = overfull;
            changed
        });
    }

    fn status_now(&self, count_records: bool) -> StoreStatus {
        let map = self.inner.map.lock();
        let mut status = StoreStatus {
            disk_bytes: map.iter().map(|(k, v)| (k.len() + v.len()) as u64).sum(),
            estimated_keys: map.len() as u64,
            ..Default::default()
        };
        if count_records {
            for (_, value) in under(&map, &[keys::MESSAGE]) {
                status.message_records += 1;
                status.message_record_bytes += value.len() as u64;
            }
            status.queue_entries = under(&map, &[keys::ENTRY]).count() as u64;
        }
        status
    }
}

fn apply(map: &mut BTreeMap<Vec<u8>, Vec<u8>>, op: &write_op::Op) {
    use write_op::Op;
    match op {
        Op::PutVhost(def) => {
            map.insert(
                keys::key(keys::VHOST, &[def.name.as_bytes()]),
                def.encode_to_vec(),
            );
        }
        Op::DeleteVhost(def) => {
            map.remove(&keys::key(keys::VHOST, &[def.name.as_bytes()]));
        }
        Op::PutUser(def) => {
            map.insert(keys::user_key(&def.name), def.encode_to_vec());
            map.insert(keys::USERS_MARKER.to_vec(), Vec::new());
        }
        Op::DeleteUser(def) => {
            map.remove(&keys::user_key(&def.name));
            let prefix = keys::user_permissions_prefix(&def.name);
            let doomed: Vec<Vec<u8>> = under(map, &prefix).map(|(k, _)| k.clone()).collect();
            for key in doomed {
                map.remove(&key);
            }
        }
        Op::PutPermission(def) => {
            map.insert(
                keys::permission_key(&def.user, &def.vhost),
                def.encode_to_vec(),
            );
        }
        Op::DeletePermission(def) => {
            map.remove(&keys::permission_key(&def.user, &def.vhost));
        }
        Op::PutPolicy(def) => {
            map.insert(
                keys::policy_key(&def.vhost, def.operator, &def.name),
                def.encode_to_vec(),
            );
        }
        Op::DeletePolicy(def) => {
            map.remove(&keys::policy_key(&def.vhost, def.operator, &def.name));
        }
        Op::PutDelayed(message) => {
            map.insert(
                keys::delayed_key(message.due_ms, message.id).to_vec(),
                message.encode_to_vec(),
            );
        }
        Op::DeleteDelayed(key) => {
            map.remove(keys::delayed_key(key.due_ms, key.id).as_slice());
        }
        Op::PutExchange(def) => {
            let key = keys::key(keys::EXCHANGE, &[def.vhost.as_bytes(), def.name.as_bytes()]);
            map.insert(key, def.encode_to_vec());
        }
        Op::DeleteExchange(key) => {
            map.remove(&keys::key(
                keys::EXCHANGE,
                &[key.vhost.as_bytes(), key.name.as_bytes()],
            ));
        }
        Op::PutQueue(def) => {
            let key = keys::key(keys::QUEUE, &[def.vhost.as_bytes(), def.name.as_bytes()]);
            map.insert(key, def.encode_to_vec());
        }
        Op::DeleteQueue(key) => {
            map.remove(&keys::key(
                keys::QUEUE,
                &[key.vhost.as_bytes(), key.name.as_bytes()],
            ));
            let prefix = keys::queue_entries_prefix(&key.vhost, &key.name);
            let doomed: Vec<Vec<u8>> = under(map, &prefix).map(|(k, _)| k.clone()).collect();
            for key in doomed {
                map.remove(&key);
            }
        }
        Op::PutBinding(def) => {
            map.insert(keys::binding_key(def), def.encode_to_vec());
        }
        Op::DeleteBinding(def) => {
            map.remove(&keys::binding_key(def));
        }
        Op::PutMessage(message) => {
            map.insert(
                keys::message_key(message.id).to_vec(),
                message.encode_to_vec(),
            );
        }
        Op::DeleteMessage(key) => {
            map.remove(keys::message_key(key.id).as_slice());
        }
        Op::PutQueueEntry(entry) => {
            map.insert(
                keys::entry_key(&entry.vhost, &entry.queue, entry.id),
                entry.encode_to_vec(),
            );
        }
        Op::DeleteQueueEntry(key) => {
            map.remove(&keys::entry_key(&key.vhost, &key.queue, key.id));
        }
    }
}

/// Every key under `prefix`, in order, with its value.
fn under<'a>(
    map: &'a BTreeMap<Vec<u8>, Vec<u8>>,
    prefix: &'a [u8],
) -> impl Iterator<Item = (&'a Vec<u8>, &'a Vec<u8>)> + 'a {
    map.range(prefix.to_vec()..)
        .take_while(move |(key, _)| key.starts_with(prefix))
}

fn scan<T: prost::Message + Default>(
    map: &BTreeMap<Vec<u8>, Vec<u8>>,
    prefix: &[u8],
) -> Result<Vec<T>, ServiceError> {
    under(map, prefix)
        .map(|(key, value)| decode(key, value))
        .collect()
}

fn decode<T: prost::Message + Default>(key: &[u8], value: &[u8]) -> Result<T, ServiceError> {
    T::decode(value).map_err(|error| {
        ServiceError::Internal(format!("corrupt record under key {key:?}: {error}"))
    })
}

#[async_trait]
impl StorageApi for MemoryStore {
    async fn write(&self, batch: Arc<WriteBatch>) -> Result<(), ServiceError> {
        self.inner.lease.lock().check(batch.epoch, "in memory")?;
        self.write_batch(&batch);
        Ok(())
    }

    async fn load_definitions(&self) -> Result<Definitions, ServiceError> {
        self.definitions()
    }

    async fn load_messages(
        &self,
        vhost: &str,
        queue: &str,
    ) -> Result<Vec<QueueEntry>, ServiceError> {
        self.entries(vhost, queue)
    }

    async fn read_messages(&self, ids: Vec<u64>) -> Result<Vec<MessageRecord>, ServiceError> {
        self.read(&ids)
    }

    async fn status(&self, count_records: bool) -> Result<StoreStatus, ServiceError> {
        Ok(self.status_now(count_records))
    }

    async fn scan_delayed(
        &self,
        request: spillway_proto::storage::ScanDelayedRequest,
    ) -> Result<spillway_proto::storage::DelayedBatch, ServiceError> {
        let map = self.inner.map.lock();
        let from = keys::delayed_key(request.from_due_ms, request.from_id).to_vec();
        let entries = map
            .range(from..)
            .map(|(key, value)| Ok::<_, ServiceError>((key, value)));
        Ok(crate::delayed::scan(entries, &request)?.batch)
    }

    async fn remove_orphans(&self, epoch: u64, below_id: u64) -> Result<u64, ServiceError> {
        self.inner.lease.lock().check(epoch, "in memory")?;
        Ok(self.remove_orphaned_records(below_id))
    }

    async fn acquire_lease(
        &self,
        request: spillway_proto::storage::AcquireLeaseRequest,
    ) -> Result<spillway_proto::storage::Lease, ServiceError> {
        let ttl = std::time::Duration::from_millis(request.ttl_ms.max(100));
        let now = tokio::time::Instant::now();
        let mut lease = self.inner.lease.lock();
        let epoch = match lease.acquire(request.epoch, ttl, now, "in memory")? {
            crate::lease::Grant::Renewed(epoch) => epoch,
            crate::lease::Grant::New(epoch) => {
                lease.commit(epoch, &request.holder, ttl, now);
                epoch
            }
        };
        Ok(spillway_proto::storage::Lease {
            epoch,
            store_id: "in-memory".into(),
            ttl_ms: request.ttl_ms,
        })
    }

    async fn release_lease(&self, epoch: u64) -> Result<(), ServiceError> {
        self.inner.lease.lock().release(epoch);
        Ok(())
    }

    async fn watch_quota(&self) -> Result<QuotaStream, ServiceError> {
        let receiver = self.inner.quota.subscribe();
        Ok(Box::pin(futures::stream::unfold(
            (receiver, true),
            |(mut receiver, first)| async move {
                if !first {
                    receiver.changed().await.ok()?;
                }
                let state = *receiver.borrow_and_update();
                Some((Ok(state), (receiver, false)))
            },
        )))
    }

    /// Records the sizes (the state the engine watches reports them); with
    /// no disk to measure, overfull changes only through
    /// [`MemoryStore::set_overfull`].
    async fn set_quota(
        &self,
        request: spillway_proto::management::SetStoreQuotaRequest,
    ) -> Result<(), ServiceError> {
        self.inner.quota.send_modify(|state| {
            if let Some(overfull) = request.overfull_size {
                state.overfull_size = overfull;
            }
            if let Some(underfull) = request.underfull_size {
                state.underfull_size = underfull;
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_ops::{op, put_entry, put_message, synced};
    use spillway_proto::storage::{MessageId, QueueEntryKey, QueueKey};

    #[test]
    fn entries_in_id_order_deletes_apply_and_a_deleted_queue_takes_its_entries(
    ) -> Result<(), ServiceError> {
        let store = MemoryStore::new();
        store.write_batch(&synced(vec![
            put_message(300),
            put_entry("q", 300),
            put_message(2),
            put_entry("q", 2),
            put_entry("q2", 2),
        ]));
        store.write_batch(&synced(vec![
            op(write_op::Op::DeleteQueueEntry(QueueEntryKey {
                vhost: "/".into(),
                queue: "q".into(),
                id: 300,
            })),
            op(write_op::Op::DeleteMessage(MessageId { id: 300 })),
            put_message(7),
            put_entry("q", 7),
        ]));
        let ids: Vec<u64> = store.entries("/", "q")?.iter().map(|m| m.id).collect();
        assert_eq!(ids, vec![2, 7]);
        let read: Vec<u64> = store.read(&[7, 300, 2])?.iter().map(|m| m.id).collect();
        assert_eq!(read, vec![7, 2]);
        store.write_batch(&synced(vec![op(write_op::Op::DeleteQueue(QueueKey {
            vhost: "/".into(),
            name: "q".into(),
        }))]));
        assert!(store.entries("/", "q")?.is_empty());
        assert_eq!(store.entries("/", "q2")?.len(), 1);
        Ok(())
    }

    #[test]
    fn orphans_are_the_records_no_entry_holds() -> Result<(), ServiceError> {
        let store = MemoryStore::new();
        store.write_batch(&synced(vec![
            put_message(1),
            put_entry("q", 1),
            put_message(2),
            put_message(3),
        ]));
        let status = store.status_now(true);
        assert_eq!((status.message_records, status.queue_entries), (3, 1));
        assert_eq!(store.remove_orphaned_records(u64::MAX), 2);
        assert_eq!(store.read(&[1, 2, 3])?.len(), 1);
        Ok(())
    }

    #[test]
    fn definitions_come_back_as_written() -> Result<(), ServiceError> {
        let store = MemoryStore::new();
        let queue = QueueDefinition {
            vhost: "/".into(),
            name: "q".into(),
            auto_delete: false,
            arguments: Default::default(),
        };
        let binding = BindingDefinition {
            vhost: "/".into(),
            exchange: "amq.direct".into(),
            queue: "q".into(),
            routing_key: "k".into(),
            arguments: Default::default(),
            to_exchange: false,
        };
        store.write_batch(&synced(vec![
            op(write_op::Op::PutQueue(queue.clone())),
            op(write_op::Op::PutBinding(binding.clone())),
        ]));
        let definitions = store.definitions()?;
        assert_eq!(definitions.queues, vec![queue]);
        assert_eq!(definitions.bindings, vec![binding.clone()]);
        store.write_batch(&synced(vec![op(write_op::Op::DeleteBinding(binding))]));
        assert!(store.definitions()?.bindings.is_empty());
        Ok(())
    }
}
