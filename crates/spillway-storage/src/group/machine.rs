//! The group's state machine: the store itself. Applying a committed
//! [`Command`] writes it to this member's RocksDB in one atomic batch
//! together with the log id it came from, so that the records and "how far
//! the log was applied" never disagree after a crash.
//!
//! Applies go to the WAL without an fsync: the log entries they come from
//! are fsynced already, and anything a crash takes back is applied again
//! from them. The log is only purged after an fsync of the WAL
//! (`log.rs`), and a snapshot is only taken of what is durable.
//!
//! A snapshot is the whole key space of the store, written to a file when
//! a member needs one (`get_current_snapshot`): building one only records
//! how far it reaches, so a store of many gigabytes is not copied every few
//! thousand entries. Installing one replaces this member's records; a crash
//! in the middle leaves a mark that makes the member start again empty and
//! ask for the snapshot anew.
//!
//! Metadata keys (in the records' key space, never in a snapshot):
//! `!raft_applied`, `!raft_membership`, `!raft_snapshot`, `!installing`.
//! `!write_seq` (the last applied batch number of the current epoch) and
//! `!group_id` are records like any other and travel in snapshots.

use std::io::SeekFrom;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use openraft::storage::RaftStateMachine;
use openraft::{
    EntryPayload, LogId, RaftSnapshotBuilder, Snapshot, SnapshotMeta, StorageError, StorageIOError,
    StoredMembership,
};
use parking_lot::Mutex;
use prost::Message as _;
use rocksdb::{IteratorMode, WriteOptions};
use spillway_proto::storage::WriteBatch;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt, BufReader};
use tokio::time::Instant;

use super::log::GroupLog;
use super::types::{Command, GroupConfig, Outcome};
use crate::lease::LeaseState;
use crate::store::RocksStore;
use crate::store::{EPOCH_KEY, STORE_ID_KEY};

const APPLIED_KEY: &[u8] = b"!raft_applied";
const MEMBERSHIP_KEY: &[u8] = b"!raft_membership";
const SNAPSHOT_KEY: &[u8] = b"!raft_snapshot";
const INSTALLING_KEY: &[u8] = b"!installing";
const WRITE_SEQ_KEY: &[u8] = b"!write_seq";
const GROUP_ID_KEY: &[u8] = b"!group_id";
/// The snapshot file a member serves, beside its `.meta`.
const SNAPSHOT_FILE: &str = "current.snapshot";
/// A snapshot file starts with this, then its meta's length and the meta.
const SNAPSHOT_MAGIC: &[u8; 8] = b"SPWSNAP1";
/// Records written per batch while a snapshot is installed.
const INSTALL_BATCH_BYTES: usize = 4 << 20;

type Error = StorageError<u64>;
type Entry = openraft::Entry<GroupConfig>;
type Membership = StoredMembership<u64, openraft::BasicNode>;
type Meta = SnapshotMeta<u64, openraft::BasicNode>;

/// Keys a snapshot neither carries nor replaces: this member's own.
fn member_own(key: &[u8]) -> bool {
    key == STORE_ID_KEY
        || key == APPLIED_KEY
        || key == MEMBERSHIP_KEY
        || key == SNAPSHOT_KEY
        || key == INSTALLING_KEY
}

/// What the machine keeps in memory between applies.
#[derive(Default)]
struct Applied {
    last: Option<LogId<u64>>,
    membership: Membership,
    /// (epoch, number) of the last numbered batch applied.
    write_seq: (u64, u64),
}

/// One member's state machine. Cheap to clone (the snapshot builder is a
/// clone).
#[derive(Clone)]
pub(crate) struct GroupMachine {
    store: RocksStore,
    snapshots: PathBuf,
    applied: Arc<Mutex<Applied>>,
    /// The group's id (the engine's lease names it as its store): written
    /// by the first entry ever applied, the same on every member.
    group_id: Arc<Mutex<String>>,
}

fn io_read(error: impl std::fmt::Display) -> Error {
    StorageIOError::read_state_machine(anyerror::AnyError::error(error.to_string())).into()
}

fn io_write(error: impl std::fmt::Display) -> Error {
    StorageIOError::write_state_machine(anyerror::AnyError::error(error.to_string())).into()
}

fn decode<T: serde::de::DeserializeOwned>(
    store: &RocksStore,
    key: &[u8],
) -> Result<Option<T>, Error> {
    match store.db.get(key).map_err(io_read)? {
        Some(bytes) => Ok(Some(postcard::from_bytes(&bytes).map_err(io_read)?)),
        None => Ok(None),
    }
}

fn read_write_seq(store: &RocksStore) -> Result<(u64, u64), Error> {
    let Some(bytes) = store.db.get(WRITE_SEQ_KEY).map_err(io_read)? else {
        return Ok((0, 0));
    };
    let epoch = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_be_bytes);
    let seq = bytes
        .get(8..16)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_be_bytes);
    Ok((epoch.unwrap_or(0), seq.unwrap_or(0)))
}

fn write_seq_value(epoch: u64, seq: u64) -> [u8; 16] {
    let mut value = [0; 16];
    value[..8].copy_from_slice(&epoch.to_be_bytes());
    value[8..].copy_from_slice(&seq.to_be_bytes());
    value
}

fn read_epoch(store: &RocksStore) -> Result<u64, Error> {
    Ok(store
        .db
        .get(EPOCH_KEY)
        .map_err(io_read)?
        .and_then(|value| value.as_slice().try_into().ok().map(u64::from_be_bytes))
        .unwrap_or(0))
}

impl GroupMachine {
    /// The machine over `store`, keeping snapshot files in `snapshots`.
    /// A member that crashed while installing a snapshot is emptied here
    /// (records and log; its vote stays) and catches up from the leader.
    pub(crate) fn open(store: RocksStore, snapshots: &Path) -> Result<Self, Error> {
        std::fs::create_dir_all(snapshots).map_err(io_write)?;
        if store.db.get(INSTALLING_KEY).map_err(io_read)?.is_some() {
            tracing::warn!(
                "a snapshot install was cut short: this member starts again empty and \
                 takes the leader's snapshot"
            );
            clear_records(&store)?;
            GroupLog::clear_entries(&store)?;
            let _ = std::fs::remove_file(snapshots.join(SNAPSHOT_FILE));
            store.db.delete(INSTALLING_KEY).map_err(io_write)?;
            *store.meta.lease.write() = LeaseState::new(0);
        }
        let applied = Applied {
            last: decode(&store, APPLIED_KEY)?,
            membership: decode(&store, MEMBERSHIP_KEY)?.unwrap_or_default(),
            write_seq: read_write_seq(&store)?,
        };
        let group_id = store
            .db
            .get(GROUP_ID_KEY)
            .map_err(io_read)?
            .map(|id| String::from_utf8_lossy(&id).into_owned())
            .unwrap_or_default();
        Ok(Self {
            store,
            snapshots: snapshots.to_path_buf(),
            applied: Arc::new(Mutex::new(applied)),
            group_id: Arc::new(Mutex::new(group_id)),
        })
    }

    /// Whether this member has applied nothing yet (no entry, no snapshot).
    pub(crate) fn applied_nothing(&self) -> bool {
        self.applied.lock().last.is_none()
    }

    /// The last log index applied here, as soon as it is (openraft's
    /// metrics say it a moment later).
    pub(crate) fn last_applied(&self) -> Option<u64> {
        self.applied.lock().last.map(|log_id| log_id.index)
    }

    /// The group's id ("" until the first entry is applied here).
    pub(crate) fn group_id(&self) -> String {
        self.group_id.lock().clone()
    }

    /// Applies `entries` in one RocksDB batch; what each decided, in order.
    fn apply_blocking(&self, entries: Vec<Entry>) -> Result<Vec<Outcome>, Error> {
        let now = Instant::now();
        let mut outcomes = Vec::with_capacity(entries.len());
        let mut batch = rocksdb::WriteBatch::default();
        let mut applied = self.applied.lock();
        let mut lease = self.store.meta.lease.write();
        let mut group_id = None;
        for entry in &entries {
            if entry.log_id.index == 0 && self.group_id.lock().is_empty() {
                // The group's first entry: its id is fixed here, the same
                // on every member (the initial membership is the same).
                let id = format!("group-{:x}", fingerprint(&entry.payload));
                batch.put(GROUP_ID_KEY, id.as_bytes());
                group_id = Some(id);
            }
            let outcome = match &entry.payload {
                EntryPayload::Blank => Outcome::default(),
                EntryPayload::Membership(membership) => {
                    applied.membership =
                        StoredMembership::new(Some(entry.log_id), membership.clone());
                    let bytes = postcard::to_allocvec(&applied.membership).map_err(io_write)?;
                    batch.put(MEMBERSHIP_KEY, bytes);
                    Outcome::default()
                }
                EntryPayload::Normal(command) => {
                    apply_command(command, &mut batch, &mut lease, &mut applied.write_seq, now)
                }
            };
            outcomes.push(outcome);
        }
        if let Some(last) = entries.last() {
            applied.last = Some(last.log_id);
            let bytes = postcard::to_allocvec(&last.log_id).map_err(io_write)?;
            batch.put(APPLIED_KEY, bytes);
        }
        // WAL, no fsync: see the module's comment.
        self.store
            .db
            .write_opt(batch, &WriteOptions::default())
            .map_err(io_write)?;
        if let Some(id) = group_id {
            *self.group_id.lock() = id;
        }
        Ok(outcomes)
    }

    /// Writes the whole store as of now to the snapshot file: a RocksDB
    /// snapshot gives one point in time, and how far it reaches is read
    /// from that same point.
    fn dump_blocking(&self) -> Result<Meta, Error> {
        use std::io::Write as _;
        let view = self.store.db.snapshot();
        let last_log_id: Option<LogId<u64>> = match view.get(APPLIED_KEY).map_err(io_read)? {
            Some(bytes) => Some(postcard::from_bytes(&bytes).map_err(io_read)?),
            None => None,
        };
        let membership: Membership = match view.get(MEMBERSHIP_KEY).map_err(io_read)? {
            Some(bytes) => postcard::from_bytes(&bytes).map_err(io_read)?,
            None => Membership::default(),
        };
        let meta = Meta {
            last_log_id,
            last_membership: membership,
            snapshot_id: snapshot_id(last_log_id),
        };
        let partial = self.snapshots.join(format!("{}.partial", meta.snapshot_id));
        let file = std::fs::File::create(&partial).map_err(io_write)?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        let header = postcard::to_allocvec(&meta).map_err(io_write)?;
        out.write_all(SNAPSHOT_MAGIC).map_err(io_write)?;
        out.write_all(&(header.len() as u32).to_be_bytes())
            .map_err(io_write)?;
        out.write_all(&header).map_err(io_write)?;
        for item in view.iterator(IteratorMode::Start) {
            let (key, value) = item.map_err(io_read)?;
            if member_own(&key) {
                continue;
            }
            out.write_all(&(key.len() as u32).to_be_bytes())
                .map_err(io_write)?;
            out.write_all(&key).map_err(io_write)?;
            out.write_all(&(value.len() as u32).to_be_bytes())
                .map_err(io_write)?;
            out.write_all(&value).map_err(io_write)?;
        }
        let file = out.into_inner().map_err(io_write)?;
        file.sync_all().map_err(io_write)?;
        std::fs::rename(&partial, self.snapshots.join(SNAPSHOT_FILE)).map_err(io_write)?;
        Ok(meta)
    }

    /// The snapshot file's meta, if there is a file.
    async fn file_meta(&self) -> Result<Option<Meta>, Error> {
        let path = self.snapshots.join(SNAPSHOT_FILE);
        let Ok(file) = tokio::fs::File::open(&path).await else {
            return Ok(None);
        };
        let mut reader = BufReader::new(file);
        Ok(Some(read_header(&mut reader).await?))
    }

    /// Replaces this member's records with the snapshot in `file`.
    async fn install(&self, meta: &Meta, file: tokio::fs::File) -> Result<(), Error> {
        let mut reader = BufReader::with_capacity(1 << 20, file);
        reader.seek(SeekFrom::Start(0)).await.map_err(io_read)?;
        let header = read_header(&mut reader).await?;
        if header.last_log_id != meta.last_log_id {
            return Err(io_read(format!(
                "the snapshot received reaches {:?}, its meta says {:?}",
                header.last_log_id, meta.last_log_id
            )));
        }
        let mut synced = WriteOptions::default();
        synced.set_sync(true);
        let store = self.store.clone();
        self.store
            .off_runtime(move || -> Result<(), Error> {
                store
                    .db
                    .put_opt(INSTALLING_KEY, [], &synced)
                    .map_err(io_write)?;
                clear_records(&store)
            })
            .await
            .map_err(io_write)??;
        let mut batch = rocksdb::WriteBatch::default();
        loop {
            let Some(key) = read_chunk(&mut reader).await? else {
                break;
            };
            let value = read_chunk(&mut reader)
                .await?
                .ok_or_else(|| io_read("a snapshot ends after a key"))?;
            batch.put(key, value);
            if batch.size_in_bytes() >= INSTALL_BATCH_BYTES {
                let full = std::mem::take(&mut batch);
                let store = self.store.clone();
                self.store
                    .off_runtime(move || store.db.write(full).map_err(io_write))
                    .await
                    .map_err(io_write)??;
            }
        }
        if let Some(last) = meta.last_log_id {
            batch.put(APPLIED_KEY, postcard::to_allocvec(&last).map_err(io_write)?);
        }
        batch.put(
            MEMBERSHIP_KEY,
            postcard::to_allocvec(&meta.last_membership).map_err(io_write)?,
        );
        batch.delete(INSTALLING_KEY);
        let store = self.store.clone();
        let mut options = WriteOptions::default();
        options.set_sync(true);
        self.store
            .off_runtime(move || store.db.write_opt(batch, &options).map_err(io_write))
            .await
            .map_err(io_write)??;
        let epoch = read_epoch(&self.store)?;
        *self.store.meta.lease.write() = LeaseState::new(epoch);
        let group_id = self
            .store
            .db
            .get(GROUP_ID_KEY)
            .map_err(io_read)?
            .map(|id| String::from_utf8_lossy(&id).into_owned())
            .unwrap_or_default();
        *self.group_id.lock() = group_id;
        let mut applied = self.applied.lock();
        applied.last = meta.last_log_id;
        applied.membership = meta.last_membership.clone();
        applied.write_seq = read_write_seq(&self.store)?;
        tracing::info!(
            last_log_id = ?meta.last_log_id,
            snapshot_id = %meta.snapshot_id,
            "storage group snapshot installed"
        );
        Ok(())
    }
}

/// A stable digest of the initial membership (FNV-1a of its encoding).
fn fingerprint(payload: &EntryPayload<GroupConfig>) -> u64 {
    let bytes = postcard::to_allocvec(payload).unwrap_or_default();
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn snapshot_id(last: Option<LogId<u64>>) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    match last {
        Some(last) => format!("{}-{}-{nanos:x}", last.leader_id.term, last.index),
        None => format!("none-{nanos:x}"),
    }
}

/// Deletes every record but this member's own keys.
fn clear_records(store: &RocksStore) -> Result<(), Error> {
    let mut batch = rocksdb::WriteBatch::default();
    let mut own = Vec::new();
    for item in store.db.iterator(IteratorMode::Start) {
        let (key, _) = item.map_err(io_read)?;
        if member_own(&key) {
            own.push(key);
            continue;
        }
        batch.delete(&key);
        if batch.len() >= 10_000 {
            store
                .db
                .write(std::mem::take(&mut batch))
                .map_err(io_write)?;
        }
    }
    store.db.write(batch).map_err(io_write)?;
    Ok(())
}

async fn read_header<R: tokio::io::AsyncRead + Unpin>(reader: &mut R) -> Result<Meta, Error> {
    let mut magic = [0u8; 8];
    reader.read_exact(&mut magic).await.map_err(io_read)?;
    if &magic != SNAPSHOT_MAGIC {
        return Err(io_read("not a Spillway snapshot"));
    }
    let header = read_chunk(reader)
        .await?
        .ok_or_else(|| io_read("a snapshot without its meta"))?;
    postcard::from_bytes(&header).map_err(io_read)
}

/// A length-prefixed chunk; None at the end of the file.
async fn read_chunk<R: tokio::io::AsyncRead + Unpin>(
    reader: &mut R,
) -> Result<Option<Vec<u8>>, Error> {
    let mut len = [0u8; 4];
    match reader.read_exact(&mut len).await {
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(error) => return Err(io_read(error)),
    }
    let len = u32::from_be_bytes(len) as usize;
    // Keys are short and values at most a write batch's record.
    if len > 512 << 20 {
        return Err(io_read(format!("a snapshot record of {len} bytes")));
    }
    let mut chunk = vec![0; len];
    reader.read_exact(&mut chunk).await.map_err(io_read)?;
    Ok(Some(chunk))
}

/// Applies one command to `batch`; what it decided.
fn apply_command(
    command: &Command,
    batch: &mut rocksdb::WriteBatch,
    lease: &mut LeaseState,
    write_seq: &mut (u64, u64),
    now: Instant,
) -> Outcome {
    let epoch_now = lease.epoch();
    let refused = |text: String| Outcome {
        refused: Some(text),
        epoch: epoch_now,
    };
    match command {
        Command::Write(bytes) => {
            let write = match WriteBatch::decode(bytes.as_slice()) {
                Ok(write) => write,
                Err(error) => {
                    return refused(format!("a write batch that does not decode: {error}"))
                }
            };
            if let Err(error) = lease.check(write.epoch, "the storage group") {
                return refused(error.to_string());
            }
            if write.sequence != 0 {
                if write_seq.0 == write.epoch && write.sequence <= write_seq.1 {
                    // Applied before: a retry after its answer was lost.
                    return Outcome {
                        refused: None,
                        epoch: lease.epoch(),
                    };
                }
                *write_seq = (write.epoch, write.sequence);
                batch.put(WRITE_SEQ_KEY, write_seq_value(write.epoch, write.sequence));
            }
            for op in write.ops.iter().filter_map(|op| op.op.as_ref()) {
                crate::store::apply(batch, op);
            }
            Outcome {
                refused: None,
                epoch: lease.epoch(),
            }
        }
        Command::Lease {
            epoch,
            holder,
            ttl_ms,
        } => {
            if *epoch != lease.epoch() + 1 {
                return refused(format!(
                    "lease epoch {epoch} was not granted: the storage group is at epoch {} \
                     (another engine took it meanwhile)",
                    lease.epoch()
                ));
            }
            batch.put(EPOCH_KEY, epoch.to_be_bytes());
            lease.commit(*epoch, holder, Duration::from_millis(*ttl_ms), now);
            tracing::info!(
                code = "MST-1104",
                epoch,
                holder = %holder,
                "MST-1104 : Store leased : Epoch {epoch} : {holder}"
            );
            Outcome {
                refused: None,
                epoch: *epoch,
            }
        }
        Command::Renew { epoch, ttl_ms } => {
            if !lease.renew(*epoch, Duration::from_millis(*ttl_ms), now) {
                return refused(format!(
                    "lease epoch {epoch} is stale: the storage group is at epoch {}",
                    lease.epoch()
                ));
            }
            Outcome {
                refused: None,
                epoch: *epoch,
            }
        }
        Command::Release { epoch } => {
            if lease.release(*epoch) {
                tracing::info!(epoch, "store lease released");
            }
            Outcome {
                refused: None,
                epoch: lease.epoch(),
            }
        }
    }
}

impl RaftSnapshotBuilder<GroupConfig> for GroupMachine {
    /// Records how far a snapshot reaches, once that much is durable; the
    /// file is written when a member needs it.
    async fn build_snapshot(&mut self) -> Result<Snapshot<GroupConfig>, Error> {
        let (last_log_id, membership) = {
            let applied = self.applied.lock();
            (applied.last, applied.membership.clone())
        };
        let store = self.store.clone();
        self.store
            .off_runtime(move || store.sync_wal().map_err(io_write))
            .await
            .map_err(io_write)??;
        let meta = Meta {
            last_log_id,
            last_membership: membership,
            snapshot_id: snapshot_id(last_log_id),
        };
        let bytes = postcard::to_allocvec(&meta).map_err(io_write)?;
        self.store.db.put(SNAPSHOT_KEY, bytes).map_err(io_write)?;
        // openraft keeps only the meta of a snapshot it built.
        let placeholder = unnamed_file(&self.snapshots, "placeholder").await?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(placeholder),
        })
    }
}

/// A file in `dir` with no name left: open handles keep it, and nothing
/// is left behind when they close.
async fn unnamed_file(dir: &Path, prefix: &str) -> Result<tokio::fs::File, Error> {
    let path = dir.join(format!("{prefix}-{}", snapshot_id(None)));
    let file = tokio::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .await
        .map_err(io_write)?;
    let _ = tokio::fs::remove_file(&path).await;
    Ok(file)
}

impl RaftStateMachine<GroupConfig> for GroupMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId<u64>>, Membership), Error> {
        let applied = self.applied.lock();
        Ok((applied.last, applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Outcome>, Error>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        let machine = self.clone();
        self.store
            .off_runtime(move || machine.apply_blocking(entries))
            .await
            .map_err(io_write)?
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<tokio::fs::File>, Error> {
        Ok(Box::new(unnamed_file(&self.snapshots, "incoming").await?))
    }

    async fn install_snapshot(
        &mut self,
        meta: &Meta,
        mut snapshot: Box<tokio::fs::File>,
    ) -> Result<(), Error> {
        snapshot.flush().await.map_err(io_write)?;
        self.install(meta, *snapshot).await
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<GroupConfig>>, Error> {
        let Some(built): Option<Meta> = decode(&self.store, SNAPSHOT_KEY)? else {
            return Ok(None);
        };
        // The file serves while it reaches at least as far as the last
        // snapshot built; else it is written again from the store now.
        let meta = match self.file_meta().await? {
            Some(meta) if meta.last_log_id >= built.last_log_id => meta,
            _ => {
                let machine = self.clone();
                self.store
                    .off_runtime(move || machine.dump_blocking())
                    .await
                    .map_err(io_write)??
            }
        };
        let file = tokio::fs::File::open(self.snapshots.join(SNAPSHOT_FILE))
            .await
            .map_err(io_read)?;
        Ok(Some(Snapshot {
            meta,
            snapshot: Box::new(file),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_ops::put_message;

    fn write(epoch: u64, sequence: u64) -> Command {
        let batch = WriteBatch {
            ops: vec![put_message(sequence)],
            epoch,
            sequence,
            ..Default::default()
        };
        Command::Write(batch.encode_to_vec())
    }

    fn lease(epoch: u64) -> Command {
        Command::Lease {
            epoch,
            holder: format!("engine {epoch}"),
            ttl_ms: 5_000,
        }
    }

    /// Applies `command` to a fresh batch: what it decided, and how many
    /// RocksDB updates it made.
    fn apply(
        command: &Command,
        lease_state: &mut LeaseState,
        write_seq: &mut (u64, u64),
    ) -> (Outcome, usize) {
        let mut batch = rocksdb::WriteBatch::default();
        let outcome = apply_command(command, &mut batch, lease_state, write_seq, Instant::now());
        (outcome, batch.len())
    }

    #[test]
    fn a_retried_batch_is_applied_once_and_later_ones_still_are() {
        let mut lease_state = LeaseState::new(0);
        let mut seq = (0, 0);
        assert_eq!(apply(&lease(1), &mut lease_state, &mut seq).0.refused, None);
        let (first, updates) = apply(&write(1, 5), &mut lease_state, &mut seq);
        assert_eq!(
            (first.refused, updates),
            (None, 2),
            "the record and the number"
        );
        // The same batch again (its leader died before answering): a no-op.
        let (again, updates) = apply(&write(1, 5), &mut lease_state, &mut seq);
        assert_eq!((again.refused, updates), (None, 0));
        // An older one too; a newer one is applied.
        assert_eq!(apply(&write(1, 4), &mut lease_state, &mut seq).1, 0);
        assert_eq!(apply(&write(1, 6), &mut lease_state, &mut seq).1, 2);
        // Unnumbered batches are always applied.
        assert_eq!(apply(&write(1, 0), &mut lease_state, &mut seq).1, 1);
    }

    #[test]
    fn a_deposed_engine_is_refused_and_two_new_leases_cannot_both_win() {
        let mut lease_state = LeaseState::new(0);
        let mut seq = (0, 0);
        assert_eq!(apply(&lease(1), &mut lease_state, &mut seq).0.epoch, 1);
        // Two engines asked for epoch 2 at once: the first applied wins.
        let (won, _) = apply(&lease(2), &mut lease_state, &mut seq);
        let (lost, updates) = apply(&lease(2), &mut lease_state, &mut seq);
        assert_eq!(
            won,
            Outcome {
                refused: None,
                epoch: 2
            }
        );
        assert!(lost.refused.is_some() && updates == 0, "{lost:?}");
        // The engine of epoch 1 can neither write nor renew.
        let (stale, updates) = apply(&write(1, 9), &mut lease_state, &mut seq);
        assert!(stale.refused.is_some_and(|why| why.contains("stale")) && updates == 0);
        let renew = Command::Renew {
            epoch: 1,
            ttl_ms: 5_000,
        };
        assert!(apply(&renew, &mut lease_state, &mut seq)
            .0
            .refused
            .is_some());
        // Numbers start again with the new epoch.
        assert_eq!(apply(&write(2, 1), &mut lease_state, &mut seq).1, 2);
    }

    #[test]
    fn a_batch_that_does_not_decode_is_refused_not_applied() {
        let mut lease_state = LeaseState::new(1);
        let mut seq = (0, 0);
        let garbage = Command::Write(vec![0xff; 7]);
        let (outcome, updates) = apply(&garbage, &mut lease_state, &mut seq);
        assert!(outcome.refused.is_some() && updates == 0);
    }
}
