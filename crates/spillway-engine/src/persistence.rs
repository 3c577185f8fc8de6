//! The engine's ordered, group-committed pipe to the storage node.
//!
//! Every state change that must survive a restart becomes `WriteOp`s, handed
//! to [`StoreWriter::submit`] while the broker lock is still held, so the
//! storage node applies them in the order the engine made the changes (a
//! message's put always lands before its delete). One task drains whatever
//! has queued into a single batch, writes it (one fsync on the storage node),
//! then wakes the publishers waiting for their confirms: group commit, one
//! batch in flight at a time. Every batch carries the engine's lease epoch
//! (`Engine::start` takes the lease): a deposed engine cannot write.
//!
//! Failures are told apart ([`ServiceError::is_transient`]):
//!
//! - **Transient** (storage node unreachable, timeouts): the batch is
//!   retried with backoff until it lands; confirms wait, nothing is dropped.
//! - **Permanent** (disk full, corruption, a stale lease, a store with
//!   another id): `MST-1101 : Store failure : <reason>`. The waiters of the
//!   failed batch are answered at once with the failure (their publishers
//!   get basic.nack); the engine blocks producers of persistent messages and
//!   refuses new ones (`Broker::set_store_failure`). The failed batch is
//!   kept, in order, and retried with backoff as the store's probe: later
//!   writes queue behind it (so a delete never lands before its put). When
//!   it lands, `MST-1102 : Store failure cleared` and everything resumes. A
//!   nacked message may so still be stored and delivered later: nack means
//!   "not known to be stored", as in RabbitMQ. Nothing confirmed is ever
//!   dropped: a confirm is only sent for a batch that landed.
//!
//! The queue is bounded ([`WriterLimits`]): past its bound, publishing
//! sessions wait before their next publish (the gateway then stops reading
//! their sockets); the other writes (acks, spills, definitions) are bounded
//! by what the publishes brought in.

use foldhash::{HashMap, HashMapExt};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prost::Message as _;
use spillway_proto::storage::{write_op, Durability, MessageRecord, WriteBatch, WriteOp};
use spillway_proto::util::backoff::Backoff;
use spillway_proto::util::trace::SpanContext;
use spillway_proto::{storage::StorageApi, ServiceError};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tracing::Instrument;

use crate::budget::{shrunk_capacity, MemoryBudget};

/// Requests drained into one storage batch at most.
const MAX_REQUESTS_PER_BATCH: usize = 4096;

/// Encoded bytes one storage batch stops at, below the gRPC bound
/// (`BATCH_BYTES`, 16 MiB). A batch is memory twice over while it is
/// written (its ops here, RocksDB's own batch on the storage node), and 4
/// MiB already shares one fsync among thousands of messages: a 16 MiB
/// batch was 20 MiB of RocksDB's `WriteBatch` alone at the peak of case
/// d's heap profile (docs/performance-history.md).
const STORE_BATCH_BYTES: u64 = 4 << 20;

/// Sequence numbers start above [`crate::model::STORED_EARLIER`].
const FIRST_SEQ: u64 = 2;

/// Writes held back by [`StoreWriter::capture`] on this thread.
#[derive(Default)]
struct Capture {
    ops: Vec<WriteOp>,
    done: Vec<oneshot::Sender<WriteOutcome>>,
}

thread_local! {
    static CAPTURE: std::cell::RefCell<Option<Capture>> = const { std::cell::RefCell::new(None) };
}

/// Restores the thread's capture slot to what it held before a capture,
/// on the normal path (`restore`) or when unwinding (`Drop`).
struct CaptureGuard {
    outer: Option<Option<Capture>>,
}

impl CaptureGuard {
    /// Puts the outer slot back and answers what the capture held.
    fn restore(&mut self) -> Option<Capture> {
        let outer = self.outer.take().flatten();
        CAPTURE.with_borrow_mut(|capture| std::mem::replace(capture, outer))
    }
}

impl Drop for CaptureGuard {
    fn drop(&mut self) {
        if self.outer.is_some() {
            // Unwinding out of `apply`: what it captured is dropped, so its
            // waiters hear the sender is gone.
            drop(self.restore());
        }
    }
}

/// What a capture held back, to submit as one request, or to drop.
pub struct CapturedWrite {
    ops: Vec<WriteOp>,
    waiters: Vec<oneshot::Sender<WriteOutcome>>,
}

/// Default bound of the writer's queue in writes (`engine.store_writer_max_writes`).
pub const DEFAULT_MAX_QUEUED_WRITES: u64 = 16_384;
/// Default bound of the writer's queue in bytes (`engine.store_writer_max_bytes`).
pub const DEFAULT_MAX_QUEUED_BYTES: u64 = 64 * 1024 * 1024;

/// The bound of the writer's queue: writes submitted and not yet written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriterLimits {
    pub max_writes: u64,
    pub max_bytes: u64,
}

impl Default for WriterLimits {
    fn default() -> Self {
        Self {
            max_writes: DEFAULT_MAX_QUEUED_WRITES,
            max_bytes: DEFAULT_MAX_QUEUED_BYTES,
        }
    }
}

/// Why the store does not take writes: a permanent failure (`MST-1101`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("store failure: {0}")]
pub struct StoreFailure(pub Arc<str>);

/// What a write's waiter hears: written, or the store failed it.
pub type WriteOutcome = Result<(), StoreFailure>;

/// Which part of the engine found the store failed: each clears only its
/// own finding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FailureSource {
    Write,
    Lease,
}

enum WriteRequest {
    Write {
        seq: u64,
        ops: Vec<WriteOp>,
        /// The encoded bytes of `ops`, counted in the queue's bound.
        bytes: u64,
        durability: Durability,
        /// Payload bytes this write takes out of memory (flow to disk):
        /// counted as in flight until it lands.
        spilled_bytes: u64,
        done: Vec<oneshot::Sender<WriteOutcome>>,
        /// The span that submitted it (a publish), when traces are exported.
        trace: Option<SpanContext>,
    },
    /// Write what came before, then stop and release the store.
    Stop(oneshot::Sender<()>),
}

#[derive(Clone)]
pub struct StoreWriter {
    requests: mpsc::UnboundedSender<WriteRequest>,
    state: Arc<WriterState>,
}

struct WriterState {
    next_seq: AtomicU64,
    /// Every write with a sequence number up to this one has landed.
    completed: AtomicU64,
    /// Message records submitted and not yet written, by id: a read that
    /// finds its record here needs no trip to the store, and one that does
    /// not is sure the store has it.
    pending: Mutex<HashMap<u64, (u64, MessageRecord)>>,
    budget: Arc<MemoryBudget>,
    /// The lease epoch every batch carries.
    epoch: AtomicU64,
    limits: WriterLimits,
    queued_writes: AtomicU64,
    queued_bytes: AtomicU64,
    /// Woken whenever a batch lands or the failure state changes.
    progress: Notify,
    /// The permanent failure in force, if any.
    failure: watch::Sender<Option<(FailureSource, StoreFailure)>>,
    /// Set by [`StoreWriter::stop`]: retries give up.
    stopping: AtomicBool,
    stop_kick: Notify,
}

impl StoreWriter {
    pub fn start(
        store: Arc<dyn StorageApi>,
        budget: Arc<MemoryBudget>,
        epoch: u64,
        limits: WriterLimits,
    ) -> Self {
        let (requests, receiver) = mpsc::unbounded_channel();
        let state = Arc::new(WriterState {
            next_seq: AtomicU64::new(FIRST_SEQ),
            completed: AtomicU64::new(FIRST_SEQ - 1),
            pending: Mutex::new(HashMap::new()),
            budget,
            epoch: AtomicU64::new(epoch),
            limits,
            queued_writes: AtomicU64::new(0),
            queued_bytes: AtomicU64::new(0),
            progress: Notify::new(),
            failure: watch::Sender::new(None),
            stopping: AtomicBool::new(false),
            stop_kick: Notify::new(),
        });
        tokio::spawn(run_writer(store, receiver, state.clone()));
        Self { requests, state }
    }

    /// Writes everything submitted so far, then stops the writer so the
    /// store is released (engine shutdown). A store that is failing is not
    /// waited for: what it refuses is logged as not written.
    pub async fn stop(&self) {
        let (stopped, wait) = oneshot::channel();
        if self.requests.send(WriteRequest::Stop(stopped)).is_ok() {
            if self.failure().is_some() {
                self.state.stopping.store(true, Ordering::Release);
                self.state.stop_kick.notify_waiters();
            }
            let _ = wait.await;
        }
    }

    /// Gives up retrying (shutdown with a store that does not answer).
    pub fn abandon(&self) {
        self.state.stopping.store(true, Ordering::Release);
        self.state.stop_kick.notify_waiters();
    }

    /// Queues ops for the next batch; `done` fires once they are written as
    /// durably as asked (or the store failed them). Returns the write's
    /// sequence number.
    pub fn submit(
        &self,
        ops: Vec<WriteOp>,
        durability: Durability,
        done: Option<oneshot::Sender<WriteOutcome>>,
    ) -> u64 {
        self.submit_spill(ops, durability, 0, done)
    }

    /// Definitions and other writes that must be on disk before anyone is
    /// told they happened.
    pub fn submit_synced(
        &self,
        ops: Vec<WriteOp>,
        done: Option<oneshot::Sender<WriteOutcome>>,
    ) -> u64 {
        self.submit(ops, Durability::Synced, done)
    }

    /// As [`StoreWriter::submit`], for writes that take `spilled_bytes` of
    /// payloads out of memory.
    pub fn submit_spill(
        &self,
        mut ops: Vec<WriteOp>,
        durability: Durability,
        spilled_bytes: u64,
        mut done: Option<oneshot::Sender<WriteOutcome>>,
    ) -> u64 {
        if ops.is_empty() {
            if let Some(done) = done {
                let _ = done.send(Ok(()));
            }
            return self.state.completed.load(Ordering::Acquire);
        }
        let captured = CAPTURE.with_borrow_mut(|capture| match capture {
            Some(capture) => {
                debug_assert_eq!(spilled_bytes, 0, "nothing spills inside a capture");
                capture.ops.append(&mut ops);
                capture.done.extend(done.take());
                true
            }
            None => false,
        });
        if captured {
            // The capture's write takes the next number when it is submitted.
            return self.state.next_seq.load(Ordering::Acquire);
        }
        self.submit_request(ops, durability, spilled_bytes, done.into_iter().collect())
    }

    fn submit_request(
        &self,
        ops: Vec<WriteOp>,
        durability: Durability,
        spilled_bytes: u64,
        done: Vec<oneshot::Sender<WriteOutcome>>,
    ) -> u64 {
        let seq = self.state.next_seq.fetch_add(1, Ordering::AcqRel);
        let bytes = held_bytes(&ops);
        {
            let mut pending = self.state.pending.lock();
            for op in &ops {
                if let Some(write_op::Op::PutMessage(record)) = &op.op {
                    pending.insert(record.id, (seq, record.clone()));
                }
            }
        }
        self.state.queued_writes.fetch_add(1, Ordering::AcqRel);
        self.state.queued_bytes.fetch_add(bytes, Ordering::AcqRel);
        self.state.budget.add_in_flight(spilled_bytes);
        let request = WriteRequest::Write {
            seq,
            ops,
            bytes,
            durability,
            spilled_bytes,
            done,
            trace: spillway_proto::util::trace::current(),
        };
        if self.requests.send(request).is_err() {
            tracing::error!("storage writer stopped: a write was not submitted");
        }
        seq
    }

    /// Runs `apply` with every write this thread submits to any writer
    /// held back; `apply` answers whether to keep them. Kept, they go to
    /// the store as one synced request, so one batch: all of them land, or
    /// none (a definitions import, `crate::admin::definitions`). Dropped,
    /// they are never written (their waiters hear the sender is gone).
    /// The capture is per thread, so writes of other threads go their own
    /// way meanwhile; `apply` must not await.
    pub fn capture<T, E>(
        &self,
        apply: impl FnOnce() -> Result<T, E>,
        done: oneshot::Sender<WriteOutcome>,
    ) -> Result<(T, CapturedWrite), E> {
        let outer = CAPTURE.with_borrow_mut(|capture| capture.replace(Capture::default()));
        debug_assert!(outer.is_none(), "captures do not nest");
        // Puts the outer slot back however `apply` ends: a panic in it must
        // not leave this worker thread holding back every later write.
        let mut guard = CaptureGuard { outer: Some(outer) };
        let result = apply();
        let captured = guard.restore().unwrap_or_default();
        let answer = result?;
        let mut waiters = captured.done;
        waiters.push(done);
        let write = CapturedWrite {
            ops: captured.ops,
            waiters,
        };
        Ok((answer, write))
    }

    /// Submits a captured write as one request.
    pub fn submit_captured(&self, write: CapturedWrite) -> u64 {
        if write.ops.is_empty() {
            for done in write.waiters {
                let _ = done.send(Ok(()));
            }
            return self.state.completed.load(Ordering::Acquire);
        }
        self.submit_request(write.ops, Durability::Synced, 0, write.waiters)
    }

    /// Whether the write numbered `seq` has landed.
    pub fn is_written(&self, seq: u64) -> bool {
        seq <= self.state.completed.load(Ordering::Acquire)
    }

    /// The sequence number of the last write submitted.
    pub fn last_submitted(&self) -> u64 {
        self.state.next_seq.load(Ordering::Acquire) - 1
    }

    /// Waits until the write numbered `seq` has landed; fails at once while
    /// the store is failed (a write queued behind the failed batch does not
    /// land before the failure clears).
    pub async fn wait_written(&self, seq: u64) -> WriteOutcome {
        loop {
            let progress = self.state.progress.notified();
            tokio::pin!(progress);
            progress.as_mut().enable();
            if self.is_written(seq) {
                return Ok(());
            }
            if let Some(failure) = self.failure() {
                return Err(failure);
            }
            if self.state.stopping.load(Ordering::Acquire) {
                return Err(StoreFailure("the engine is shutting down".into()));
            }
            // A bounded wait: a missed wake-up costs 100 ms, not a hang.
            let _ = tokio::time::timeout(Duration::from_millis(100), progress).await;
        }
    }

    /// The record of message `id` if it is still on its way to the store.
    pub fn pending_record(&self, id: u64) -> Option<MessageRecord> {
        self.state
            .pending
            .lock()
            .get(&id)
            .map(|(_, record)| record.clone())
    }

    /// The lease epoch batches carry.
    pub fn epoch(&self) -> u64 {
        self.state.epoch.load(Ordering::Acquire)
    }

    /// Writes submitted and not yet written, and their encoded bytes.
    pub fn queued(&self) -> (u64, u64) {
        (
            self.state.queued_writes.load(Ordering::Acquire),
            self.state.queued_bytes.load(Ordering::Acquire),
        )
    }

    /// Whether the queue is at its bound: publishers wait.
    pub fn is_full(&self) -> bool {
        let (writes, bytes) = self.queued();
        writes >= self.state.limits.max_writes || bytes >= self.state.limits.max_bytes
    }

    /// Waits (bounded per round) until the queue is below its bound.
    pub async fn wait_for_room(&self) {
        while self.is_full() {
            let progress = self.state.progress.notified();
            tokio::pin!(progress);
            progress.as_mut().enable();
            if !self.is_full() {
                return;
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), progress).await;
        }
    }

    /// The permanent store failure in force, if any.
    pub fn failure(&self) -> Option<StoreFailure> {
        self.state
            .failure
            .borrow()
            .as_ref()
            .map(|(_, failure)| failure.clone())
    }

    /// Follows the failure state (for the broker's producer blocking).
    pub(crate) fn watch_failure(&self) -> watch::Receiver<Option<(FailureSource, StoreFailure)>> {
        self.state.failure.subscribe()
    }

    /// Marks the store failed (`MST-1101`), unless it already is.
    pub(crate) fn set_failed(&self, source: FailureSource, reason: &str) {
        self.state.set_failed(source, reason);
    }

    /// Clears a failure `source` found (`MST-1102`).
    pub(crate) fn clear_failed(&self, source: FailureSource) {
        self.state.clear_failed(source);
    }
}

impl WriterState {
    fn set_failed(&self, source: FailureSource, reason: &str) {
        let changed = self.failure.send_if_modified(|failure| {
            if failure.is_some() {
                return false;
            }
            *failure = Some((source, StoreFailure(reason.into())));
            true
        });
        if changed {
            tracing::error!(
                code = "MST-1101",
                reason,
                source = ?source,
                "MST-1101 : Store failure : {reason}"
            );
            self.progress.notify_waiters();
        }
    }

    fn clear_failed(&self, source: FailureSource) {
        let changed = self.failure.send_if_modified(|failure| {
            if failure.as_ref().is_none_or(|(by, _)| *by != source) {
                return false;
            }
            *failure = None;
            true
        });
        if changed {
            tracing::info!(code = "MST-1102", "MST-1102 : Store failure cleared");
            self.progress.notify_waiters();
        }
    }
}

async fn run_writer(
    store: Arc<dyn StorageApi>,
    mut requests: mpsc::UnboundedReceiver<WriteRequest>,
    state: Arc<WriterState>,
) {
    let mut ready = Vec::with_capacity(MAX_REQUESTS_PER_BATCH);
    // Requests taken off the channel that did not fit into the last batch.
    let mut carried = VecDeque::with_capacity(MAX_REQUESTS_PER_BATCH);
    loop {
        if carried.is_empty() {
            if requests.recv_many(&mut ready, MAX_REQUESTS_PER_BATCH).await == 0 {
                return;
            }
            carried.extend(ready.drain(..));
        }
        let mut ops = Vec::new();
        let mut waiters = Vec::new();
        let mut durability = Durability::Volatile;
        let mut spilled = 0;
        let mut last_seq = None;
        let mut stop = None;
        let mut traces = Vec::new();
        let (mut writes, mut bytes) = (0u64, 0u64);
        for request in next_batch(&mut carried) {
            match request {
                WriteRequest::Write {
                    seq,
                    ops: more,
                    bytes: size,
                    durability: asked,
                    spilled_bytes,
                    done,
                    trace,
                } => {
                    ops.extend(more);
                    traces.extend(trace);
                    waiters.extend(done);
                    durability = durability.max(asked);
                    spilled += spilled_bytes;
                    last_seq = Some(seq);
                    writes += 1;
                    bytes += size;
                }
                WriteRequest::Stop(stopped) => {
                    stop = Some(stopped);
                    break;
                }
            }
        }
        let batch = Arc::new(WriteBatch {
            ops,
            durability: durability.into(),
            epoch: state.epoch.load(Ordering::Acquire),
            // The last request's number: increasing from batch to batch,
            // and the same on every retry of this one, so that a storage
            // group applies a retried batch once.
            sequence: last_seq.unwrap_or(0),
        });
        let started = std::time::Instant::now();
        let landed = write_until_stored(store.as_ref(), batch.clone(), &state, &mut waiters)
            .instrument(batch_span(&traces, batch.ops.len()))
            .await;
        tracing::debug!(
            ops = batch.ops.len(),
            writes,
            landed,
            elapsed_us = started.elapsed().as_micros() as u64,
            "store batch written"
        );
        state.queued_writes.fetch_sub(writes, Ordering::AcqRel);
        state.queued_bytes.fetch_sub(bytes, Ordering::AcqRel);
        if let (Some(seq), true) = (last_seq, landed) {
            state.completed.store(seq, Ordering::Release);
            let mut pending = state.pending.lock();
            for op in &batch.ops {
                if let Some(write_op::Op::PutMessage(record)) = &op.op {
                    if pending.get(&record.id).is_some_and(|(at, _)| *at <= seq) {
                        pending.remove(&record.id);
                    }
                }
            }
            shrink_when_mostly_empty(&mut pending);
        }
        state.budget.remove_in_flight(spilled);
        let outcome = if landed {
            Ok(())
        } else {
            Err(StoreFailure("not written: the engine stopped first".into()))
        };
        for waiter in waiters {
            let _ = waiter.send(outcome.clone());
        }
        state.progress.notify_waiters();
        if let Some(stopped) = stop {
            drop(store);
            let _ = stopped.send(());
            return;
        }
    }
}

/// What a write's ops hold in memory until they land, as the queue's bound
/// counts it: their encoded bytes (the names, keys and bodies they carry)
/// plus each op's own record. A delete is 12 bytes encoded and a few
/// hundred as a `WriteOp`, so counting encoded bytes alone let the acks of
/// a fast consumer queue 100 MiB and more behind a 64 MiB bound (case d,
/// docs/performance-history.md).
fn held_bytes(ops: &[WriteOp]) -> u64 {
    let encoded = ops.iter().map(|op| op.encoded_len() as u64).sum::<u64>();
    encoded + std::mem::size_of_val(ops) as u64
}

/// The requests of the next storage batch, taken from the front of
/// `carried`. It stops before the request that would take its ops past
/// [`STORE_BATCH_BYTES`] (one request larger than that goes alone, and the
/// largest, `BATCH_BYTES`, still fits one gRPC message to a remote storage
/// node). A request is never split, so
/// its ops land together or not at all. A stop request ends its batch.
fn next_batch(carried: &mut VecDeque<WriteRequest>) -> Vec<WriteRequest> {
    let mut batch = Vec::new();
    let mut total = 0u64;
    while let Some(request) = carried.front() {
        if let WriteRequest::Write { bytes, .. } = request {
            if !batch.is_empty() && total + bytes > STORE_BATCH_BYTES {
                break;
            }
            total += bytes;
        }
        let Some(request) = carried.pop_front() else {
            break;
        };
        let stop = matches!(request, WriteRequest::Stop(_));
        batch.push(request);
        if stop {
            break;
        }
    }
    batch
}

/// The span of one storage batch, when it holds traced writes: in the trace
/// of the first, linked to the others (a batch serves many publishes).
fn batch_span(traces: &[SpanContext], ops: usize) -> tracing::Span {
    let Some((first, others)) = traces.split_first() else {
        return tracing::Span::none();
    };
    let span = tracing::trace_span!(target: spillway_proto::util::trace::TARGET, "write_batch", ops, writes = traces.len());
    spillway_proto::util::trace::set_parent_and_links(&span, first, others);
    span
}

/// Writes `batch`, retrying with backoff until it lands (true) or the
/// engine stops (false). A permanent failure marks the store failed and
/// answers `waiters` with it at once; the batch is still retried, as the
/// probe that finds the store working again.
async fn write_until_stored(
    store: &dyn StorageApi,
    batch: Arc<WriteBatch>,
    state: &WriterState,
    waiters: &mut Vec<oneshot::Sender<WriteOutcome>>,
) -> bool {
    if batch.ops.is_empty() {
        return true;
    }
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        let error = match store.write(batch.clone()).await {
            Ok(()) => {
                state.clear_failed(FailureSource::Write);
                return true;
            }
            Err(error) => error,
        };
        let delay = backoff.next_delay();
        if error.is_transient() {
            tracing::warn!(%error, ops = batch.ops.len(), retry_in_ms = delay.as_millis() as u64,
                "storage write failed, retrying");
        } else {
            fail_batch(state, &error, waiters);
            tracing::debug!(%error, ops = batch.ops.len(), retry_in_ms = delay.as_millis() as u64,
                "storage write refused, probing again");
        }
        if state.stopping.load(Ordering::Acquire) {
            tracing::error!(
                ops = batch.ops.len(),
                %error,
                "engine stopping: a storage batch was not written (its confirms were not sent; \
                 acks in it are redelivered after a restart)"
            );
            return false;
        }
        let kicked = state.stop_kick.notified();
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = kicked => {}
        }
    }
}

fn fail_batch(
    state: &WriterState,
    error: &ServiceError,
    waiters: &mut Vec<oneshot::Sender<WriteOutcome>>,
) {
    state.set_failed(FailureSource::Write, &error.to_string());
    let failure = StoreFailure(error.to_string().into());
    for waiter in waiters.drain(..) {
        let _ = waiter.send(Err(failure.clone()));
    }
}

/// Entries the map of records in flight keeps room for however empty it is.
const PENDING_KEPT_CAPACITY: usize = 1024;

/// Gives back the table of the map of records in flight once it holds a
/// small part of what it has room for: a burst of spills (a fill past the
/// threshold) grows it to tens of MiB, and a hash map never shrinks by
/// itself. Rehashing what is left costs less than the writes that emptied it.
fn shrink_when_mostly_empty(pending: &mut HashMap<u64, (u64, MessageRecord)>) {
    if let Some(shrunk) = shrunk_capacity(pending.len(), pending.capacity(), PENDING_KEPT_CAPACITY)
    {
        pending.shrink_to(shrunk);
    }
}

/// One write of a batch.
pub(crate) fn store_op(op: write_op::Op) -> WriteOp {
    WriteOp { op: Some(op) }
}

/// Waits for a definition's synced write; a store that failed it is
/// UNAVAILABLE to the caller (the engine keeps the write and retries it,
/// `MST-1101`).
pub(crate) async fn await_written(
    written: oneshot::Receiver<WriteOutcome>,
    what: &str,
) -> Result<(), ServiceError> {
    match written.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(failure)) => Err(ServiceError::Unavailable(format!(
            "{what} is not yet on disk: {failure}"
        ))),
        Err(_) => Err(ServiceError::Unavailable(format!(
            "{what} is not yet on disk: the engine is stopping"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use spillway_proto::storage::{
        AcquireLeaseRequest, Definitions, Lease, MessageId, QueueEntry, StoreStatus,
    };

    /// A store whose writes fail with `error` until it is told to work:
    /// the classification is what is tested, not a store.
    struct Failing {
        error: Mutex<Option<ServiceError>>,
        written: Mutex<Vec<Arc<WriteBatch>>>,
    }

    #[async_trait]
    impl StorageApi for Failing {
        async fn write(&self, batch: Arc<WriteBatch>) -> Result<(), ServiceError> {
            if let Some(error) = self.error.lock().clone() {
                return Err(error);
            }
            self.written.lock().push(batch);
            Ok(())
        }
        async fn load_definitions(&self) -> Result<Definitions, ServiceError> {
            Ok(Definitions::default())
        }
        async fn load_messages(&self, _: &str, _: &str) -> Result<Vec<QueueEntry>, ServiceError> {
            Ok(Vec::new())
        }
        async fn read_messages(&self, _: Vec<u64>) -> Result<Vec<MessageRecord>, ServiceError> {
            Ok(Vec::new())
        }
        async fn status(&self, _: bool) -> Result<StoreStatus, ServiceError> {
            Ok(StoreStatus::default())
        }
        async fn remove_orphans(&self, _: u64, _: u64) -> Result<u64, ServiceError> {
            Ok(0)
        }
        async fn acquire_lease(&self, _: AcquireLeaseRequest) -> Result<Lease, ServiceError> {
            Ok(Lease::default())
        }
        async fn release_lease(&self, _: u64) -> Result<(), ServiceError> {
            Ok(())
        }
        async fn watch_quota(&self) -> Result<spillway_proto::storage::QuotaStream, ServiceError> {
            Ok(Box::pin(futures::stream::pending()))
        }
        async fn set_quota(
            &self,
            _: spillway_proto::management::SetStoreQuotaRequest,
        ) -> Result<(), ServiceError> {
            Ok(())
        }
    }

    fn delete(id: u64) -> Vec<WriteOp> {
        vec![WriteOp {
            op: Some(write_op::Op::DeleteMessage(MessageId { id })),
        }]
    }

    fn writer(error: Option<ServiceError>) -> (Arc<Failing>, StoreWriter) {
        let store = Arc::new(Failing {
            error: Mutex::new(error),
            written: Mutex::new(Vec::new()),
        });
        let budget = Arc::new(MemoryBudget::new(1 << 30));
        let writer = StoreWriter::start(store.clone(), budget, 7, WriterLimits::default());
        (store, writer)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_capture_that_panics_leaves_later_writes_of_its_thread_alone() {
        let (store, writer) = writer(None);
        let (done, _unanswered) = oneshot::channel();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = writer.capture(
                || -> Result<(), ()> {
                    writer.submit(delete(1), Durability::Synced, None);
                    panic!("an import's declaration failed");
                },
                done,
            );
        }));
        assert!(panicked.is_err());
        assert!(CAPTURE.with_borrow(Option::is_none), "the slot is restored");
        // A write on the same thread goes to the store, not to a dead capture.
        let later = writer.submit(delete(2), Durability::Synced, None);
        tokio::time::timeout(Duration::from_secs(5), writer.wait_written(later))
            .await
            .expect("written, not held back")
            .expect("landed");
        let written = store.written.lock().clone();
        let ops: Vec<_> = written.iter().flat_map(|batch| batch.ops.clone()).collect();
        assert_eq!(ops, delete(2), "the panicked capture's write was dropped");
    }

    #[tokio::test]
    async fn a_permanent_failure_answers_the_waiters_then_clears_when_the_probe_lands() {
        let (store, writer) = writer(Some(ServiceError::ResourceExhausted("disk full".into())));
        let (done, outcome) = oneshot::channel();
        let seq = writer.submit(delete(1), Durability::Synced, Some(done));
        let outcome = tokio::time::timeout(Duration::from_secs(5), outcome)
            .await
            .expect("answered without waiting for the store")
            .expect("sent");
        assert!(outcome.is_err(), "nacked, not confirmed");
        assert!(writer.failure().is_some());
        assert!(!writer.is_written(seq));
        assert!(writer.wait_written(seq).await.is_err());
        // A later write waits behind the failed batch, in order.
        let later = writer.submit(delete(2), Durability::Logged, None);
        store.error.lock().take();
        tokio::time::timeout(Duration::from_secs(10), async {
            while !writer.is_written(later) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the probe landed");
        assert!(writer.failure().is_none(), "cleared");
        let written = store.written.lock().clone();
        assert!(
            written.iter().all(|batch| batch.epoch == 7),
            "epoch carried"
        );
        let first = written.first().map(|batch| batch.ops.clone());
        assert_eq!(first, Some(delete(1)), "the failed batch landed first");
        assert_eq!(writer.queued(), (0, 0));
    }

    #[tokio::test]
    async fn a_transient_failure_is_retried_without_failing_the_store() {
        let (store, writer) = writer(Some(ServiceError::Unavailable("down".into())));
        let (done, outcome) = oneshot::channel();
        writer.submit(delete(1), Durability::Synced, Some(done));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(writer.failure().is_none(), "not a store failure");
        store.error.lock().take();
        let outcome = tokio::time::timeout(Duration::from_secs(5), outcome)
            .await
            .expect("landed")
            .expect("sent");
        assert_eq!(outcome, Ok(()));
    }

    /// A writer with `limits` whose store is down until its error is taken.
    fn stuck_writer(limits: WriterLimits) -> (Arc<Failing>, StoreWriter) {
        let store = Arc::new(Failing {
            error: Mutex::new(Some(ServiceError::Unavailable("down".into()))),
            written: Mutex::new(Vec::new()),
        });
        let budget = Arc::new(MemoryBudget::new(1 << 30));
        let writer = StoreWriter::start(store.clone(), budget, 1, limits);
        (store, writer)
    }

    #[tokio::test]
    async fn the_queue_reports_full_at_its_bound() {
        let (store, writer) = stuck_writer(WriterLimits {
            max_writes: 3,
            max_bytes: 1 << 20,
        });
        for id in 0..3 {
            writer.submit(delete(id), Durability::Logged, None);
        }
        assert!(writer.is_full());
        store.error.lock().take();
        tokio::time::timeout(Duration::from_secs(5), writer.wait_for_room())
            .await
            .expect("room again once the store answers");
    }

    #[tokio::test]
    async fn the_byte_bound_counts_what_queued_deletes_hold() {
        // The records of 1,000 deletes, which encode to about 12 KiB.
        let record = std::mem::size_of::<WriteOp>() as u64;
        let (store, writer) = stuck_writer(WriterLimits {
            max_writes: 1_000_000,
            max_bytes: 1_000 * record,
        });
        let deletes = |from: u64| (from..from + 100).flat_map(delete).collect::<Vec<_>>();
        for round in 0..9 {
            writer.submit(deletes(round * 100), Durability::Logged, None);
        }
        assert!(!writer.is_full(), "900 deletes are below the bound");
        writer.submit(deletes(900), Durability::Logged, None);
        assert!(writer.is_full(), "1,000 deletes hold the bound");
        store.error.lock().take();
        tokio::time::timeout(Duration::from_secs(5), writer.wait_for_room())
            .await
            .expect("room again once the store answers");
    }

    #[tokio::test]
    async fn the_map_of_records_in_flight_gives_its_room_back_once_written() {
        let (store, writer) = stuck_writer(WriterLimits::default());
        let put = |id: u64| WriteOp {
            op: Some(write_op::Op::PutMessage(MessageRecord {
                id,
                ..Default::default()
            })),
        };
        let mut last = 0;
        for chunk in 0..100u64 {
            let ops = (chunk * 1_000..(chunk + 1) * 1_000).map(put).collect();
            last = writer.submit(ops, Durability::Logged, None);
        }
        let grown = writer.state.pending.lock().capacity();
        assert!(grown >= 100_000, "holds the 100,000 records: {grown}");
        assert!(
            writer.pending_record(99_999).is_some(),
            "readable in flight"
        );
        store.error.lock().take();
        tokio::time::timeout(Duration::from_secs(10), writer.wait_written(last))
            .await
            .expect("landed")
            .expect("written");
        let pending = writer.state.pending.lock();
        assert!(pending.is_empty());
        assert!(
            pending.capacity() <= PENDING_KEPT_CAPACITY * 2,
            "room given back: {} entries",
            pending.capacity()
        );
    }

    #[tokio::test]
    async fn stopping_gives_up_on_a_failed_store() {
        let (_store, writer) = writer(Some(ServiceError::DataLoss("corrupt".into())));
        writer.submit(delete(1), Durability::Synced, None);
        tokio::time::timeout(Duration::from_secs(5), async {
            while writer.failure().is_none() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("failed");
        tokio::time::timeout(Duration::from_secs(5), writer.stop())
            .await
            .expect("stop does not hang on a failed store");
    }

    fn write_of(body: usize) -> WriteRequest {
        let record = MessageRecord {
            body: vec![0; body].into(),
            ..Default::default()
        };
        let ops = vec![WriteOp {
            op: Some(write_op::Op::PutMessage(record)),
        }];
        WriteRequest::Write {
            seq: 0,
            bytes: held_bytes(&ops),
            ops,
            durability: Durability::Synced,
            spilled_bytes: 0,
            done: Vec::new(),
            trace: None,
        }
    }

    fn batch_sizes(carried: &mut VecDeque<WriteRequest>) -> Vec<usize> {
        let mut sizes = Vec::new();
        while !carried.is_empty() {
            sizes.push(next_batch(carried).len());
        }
        sizes
    }

    #[test]
    fn a_batch_stops_at_its_byte_budget_and_never_splits_a_request() {
        let mb = 1 << 20;
        // 10 + 10 MiB is over the 4 MiB budget: one each; a 20 MiB request alone.
        let mut carried: VecDeque<_> =
            [write_of(10 * mb), write_of(10 * mb), write_of(20 * mb)].into();
        assert_eq!(batch_sizes(&mut carried), [1, 1, 1]);
        // Small requests share a batch up to the budget: three of a little
        // over 1 MiB fit into 4 MiB, four do not.
        assert_eq!(STORE_BATCH_BYTES, 4 * mb as u64);
        let mut carried: VecDeque<_> = (0..20).map(|_| write_of(mb)).collect();
        assert_eq!(batch_sizes(&mut carried), [3, 3, 3, 3, 3, 3, 2]);
        // Nothing after a stop goes into its batch.
        let (stopped, _wait) = oneshot::channel();
        let mut carried: VecDeque<_> =
            [write_of(10), WriteRequest::Stop(stopped), write_of(10)].into();
        assert_eq!(batch_sizes(&mut carried), [2, 1]);
    }
}
