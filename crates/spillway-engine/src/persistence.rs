//! The engine's ordered, group-committed pipe to the storage node.
//!
//! Every state change that must survive a restart becomes `WriteOp`s, handed
//! to [`StoreWriter::submit`] while the broker lock is still held, so the
//! storage node applies them in the order the engine made the changes (a
//! message's put always lands before its delete). One task drains whatever
//! has queued into a single batch, writes it (one fsync on the storage node),
//! then wakes the publishers waiting for their confirms: group commit, one
//! batch in flight at a time.
//!
//! If the storage node is unreachable the batch is retried until it lands:
//! confirms wait (publishers see their confirms stall), nothing is dropped.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prost::Message;
use spillway_proto::backoff::Backoff;
use spillway_proto::cluster::BATCH_BYTES;
use spillway_proto::storage::{write_op, Durability, MessageRecord, WriteBatch, WriteOp};
use spillway_proto::trace::SpanContext;
use spillway_proto::StorageApi;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::budget::MemoryBudget;

/// Requests drained into one storage batch at most.
const MAX_REQUESTS_PER_BATCH: usize = 4096;

/// Sequence numbers start above [`crate::model::STORED_EARLIER`].
const FIRST_SEQ: u64 = 2;

enum WriteRequest {
    Write {
        seq: u64,
        ops: Vec<WriteOp>,
        durability: Durability,
        /// Payload bytes this write takes out of memory (flow to disk):
        /// counted as in flight until it lands.
        spilled_bytes: u64,
        done: Option<oneshot::Sender<()>>,
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
}

impl StoreWriter {
    pub fn start(store: Arc<dyn StorageApi>, budget: Arc<MemoryBudget>) -> Self {
        let (requests, receiver) = mpsc::unbounded_channel();
        let state = Arc::new(WriterState {
            next_seq: AtomicU64::new(FIRST_SEQ),
            completed: AtomicU64::new(FIRST_SEQ - 1),
            pending: Mutex::new(HashMap::new()),
            budget,
        });
        tokio::spawn(run_writer(store, receiver, state.clone()));
        Self { requests, state }
    }

    /// Writes everything submitted so far, then stops the writer so the
    /// store is released (engine shutdown).
    pub async fn stop(&self) {
        let (stopped, wait) = oneshot::channel();
        if self.requests.send(WriteRequest::Stop(stopped)).is_ok() {
            let _ = wait.await;
        }
    }

    /// Queues ops for the next batch; `done` fires once they are written as
    /// durably as asked. Returns the write's sequence number.
    pub fn submit(
        &self,
        ops: Vec<WriteOp>,
        durability: Durability,
        done: Option<oneshot::Sender<()>>,
    ) -> u64 {
        self.submit_spill(ops, durability, 0, done)
    }

    /// Definitions and other writes that must be on disk before anyone is
    /// told they happened.
    pub fn submit_synced(&self, ops: Vec<WriteOp>, done: Option<oneshot::Sender<()>>) -> u64 {
        self.submit(ops, Durability::Synced, done)
    }

    /// As [`StoreWriter::submit`], for writes that take `spilled_bytes` of
    /// payloads out of memory.
    pub fn submit_spill(
        &self,
        ops: Vec<WriteOp>,
        durability: Durability,
        spilled_bytes: u64,
        done: Option<oneshot::Sender<()>>,
    ) -> u64 {
        if ops.is_empty() {
            if let Some(done) = done {
                let _ = done.send(());
            }
            return self.state.completed.load(Ordering::Acquire);
        }
        let seq = self.state.next_seq.fetch_add(1, Ordering::AcqRel);
        {
            let mut pending = self.state.pending.lock();
            for op in &ops {
                if let Some(write_op::Op::PutMessage(record)) = &op.op {
                    pending.insert(record.id, (seq, record.clone()));
                }
            }
        }
        self.state.budget.add_in_flight(spilled_bytes);
        let request = WriteRequest::Write {
            seq,
            ops,
            durability,
            spilled_bytes,
            done,
            trace: spillway_proto::trace::current(),
        };
        if self.requests.send(request).is_err() {
            tracing::error!("storage writer stopped: a write was not submitted");
        }
        seq
    }

    /// Whether the write numbered `seq` has landed.
    pub fn is_written(&self, seq: u64) -> bool {
        seq <= self.state.completed.load(Ordering::Acquire)
    }

    /// The record of message `id` if it is still on its way to the store.
    pub fn pending_record(&self, id: u64) -> Option<MessageRecord> {
        self.state
            .pending
            .lock()
            .get(&id)
            .map(|(_, record)| record.clone())
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
        for request in next_batch(&mut carried) {
            match request {
                WriteRequest::Write {
                    seq,
                    ops: more,
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
        });
        write_until_stored(store.as_ref(), batch.clone())
            .instrument(batch_span(&traces, batch.ops.len()))
            .await;
        if let Some(seq) = last_seq {
            state.completed.store(seq, Ordering::Release);
            let mut pending = state.pending.lock();
            for op in &batch.ops {
                if let Some(write_op::Op::PutMessage(record)) = &op.op {
                    if pending.get(&record.id).is_some_and(|(at, _)| *at <= seq) {
                        pending.remove(&record.id);
                    }
                }
            }
        }
        state.budget.remove_in_flight(spilled);
        for waiter in waiters {
            let _ = waiter.send(());
        }
        if let Some(stopped) = stop {
            drop(store);
            let _ = stopped.send(());
            return;
        }
    }
}

/// The requests of the next storage batch, taken from the front of
/// `carried`. A batch stays within one gRPC message to a remote storage node:
/// it stops before the request that would take its ops past `BATCH_BYTES`
/// (one request larger than that goes alone). A request is never split, so
/// its ops land together or not at all. A stop request ends its batch.
fn next_batch(carried: &mut VecDeque<WriteRequest>) -> Vec<WriteRequest> {
    let mut batch = Vec::new();
    let mut bytes = 0;
    while let Some(request) = carried.front() {
        if let WriteRequest::Write { ops, .. } = request {
            let size: usize = ops.iter().map(Message::encoded_len).sum();
            if !batch.is_empty() && bytes + size > BATCH_BYTES {
                break;
            }
            bytes += size;
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
    let span = tracing::trace_span!(target: spillway_proto::trace::TARGET, "write_batch", ops, writes = traces.len());
    spillway_proto::trace::set_parent_and_links(&span, first, others);
    span
}

async fn write_until_stored(store: &dyn StorageApi, batch: Arc<WriteBatch>) {
    if batch.ops.is_empty() {
        return;
    }
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        match store.write(batch.clone()).await {
            Ok(()) => return,
            Err(error) => {
                let delay = backoff.next_delay();
                tracing::warn!(%error, ops = batch.ops.len(), retry_in_ms = delay.as_millis() as u64,
                    "storage write failed, retrying");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(body: usize) -> WriteRequest {
        let record = MessageRecord {
            body: vec![0; body].into(),
            ..Default::default()
        };
        WriteRequest::Write {
            seq: 0,
            ops: vec![WriteOp {
                op: Some(write_op::Op::PutMessage(record)),
            }],
            durability: Durability::Synced,
            spilled_bytes: 0,
            done: None,
            trace: None,
        }
    }

    fn sizes(carried: &mut VecDeque<WriteRequest>) -> Vec<usize> {
        let mut sizes = Vec::new();
        while !carried.is_empty() {
            sizes.push(next_batch(carried).len());
        }
        sizes
    }

    #[test]
    fn a_batch_stops_at_its_byte_budget_and_never_splits_a_request() {
        let mb = 1 << 20;
        // 10 + 10 MiB is over 16 MiB: one each; a 20 MiB request alone.
        let mut carried: VecDeque<_> = [write(10 * mb), write(10 * mb), write(20 * mb)].into();
        assert_eq!(sizes(&mut carried), [1, 1, 1]);
        // Small requests share a batch up to the budget.
        let mut carried: VecDeque<_> = (0..20).map(|_| write(mb)).collect();
        assert_eq!(sizes(&mut carried), [15, 5]);
        // Nothing after a stop goes into its batch.
        let (stopped, _wait) = oneshot::channel();
        let mut carried: VecDeque<_> = [write(10), WriteRequest::Stop(stopped), write(10)].into();
        assert_eq!(sizes(&mut carried), [2, 1]);
    }
}
