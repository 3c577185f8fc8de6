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

use std::sync::Arc;
use std::time::Duration;

use spillway_proto::storage::{WriteBatch, WriteOp};
use spillway_proto::StorageApi;
use tokio::sync::{mpsc, oneshot};

/// Requests drained into one storage batch at most.
const MAX_REQUESTS_PER_BATCH: usize = 4096;

struct WriteRequest {
    ops: Vec<WriteOp>,
    done: Option<oneshot::Sender<()>>,
}

#[derive(Clone)]
pub struct StoreWriter {
    requests: mpsc::UnboundedSender<WriteRequest>,
}

impl StoreWriter {
    pub fn start(store: Arc<dyn StorageApi>) -> Self {
        let (requests, receiver) = mpsc::unbounded_channel();
        tokio::spawn(run_writer(store, receiver));
        Self { requests }
    }

    /// Queues ops for the next batch; `done` fires once they are durable.
    pub fn submit(&self, ops: Vec<WriteOp>, done: Option<oneshot::Sender<()>>) {
        if ops.is_empty() {
            if let Some(done) = done {
                let _ = done.send(());
            }
            return;
        }
        if self.requests.send(WriteRequest { ops, done }).is_err() {
            tracing::error!("storage writer stopped: a write was not submitted");
        }
    }
}

async fn run_writer(
    store: Arc<dyn StorageApi>,
    mut requests: mpsc::UnboundedReceiver<WriteRequest>,
) {
    let mut ready = Vec::with_capacity(MAX_REQUESTS_PER_BATCH);
    while requests.recv_many(&mut ready, MAX_REQUESTS_PER_BATCH).await > 0 {
        let mut ops = Vec::new();
        let mut waiters = Vec::new();
        for request in ready.drain(..) {
            ops.extend(request.ops);
            waiters.extend(request.done);
        }
        let batch = Arc::new(WriteBatch { ops });
        let mut backoff = Duration::from_millis(50);
        loop {
            match store.write(batch.clone()).await {
                Ok(()) => break,
                Err(error) => {
                    tracing::warn!(%error, ops = batch.ops.len(), retry_in_ms = backoff.as_millis() as u64,
                        "storage write failed, retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
        for waiter in waiters {
            let _ = waiter.send(());
        }
    }
}
