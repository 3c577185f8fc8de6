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

enum WriteRequest {
    Write {
        ops: Vec<WriteOp>,
        done: Option<oneshot::Sender<()>>,
    },
    /// Write what came before, then stop and release the store.
    Stop(oneshot::Sender<()>),
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

    /// Writes everything submitted so far, then stops the writer so the
    /// store is released (engine shutdown).
    pub async fn stop(&self) {
        let (stopped, wait) = oneshot::channel();
        if self.requests.send(WriteRequest::Stop(stopped)).is_ok() {
            let _ = wait.await;
        }
    }

    /// Queues ops for the next batch; `done` fires once they are durable.
    pub fn submit(&self, ops: Vec<WriteOp>, done: Option<oneshot::Sender<()>>) {
        if ops.is_empty() {
            if let Some(done) = done {
                let _ = done.send(());
            }
            return;
        }
        if self
            .requests
            .send(WriteRequest::Write { ops, done })
            .is_err()
        {
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
        let mut stop = None;
        for request in ready.drain(..) {
            match request {
                WriteRequest::Write { ops: more, done } => {
                    ops.extend(more);
                    waiters.extend(done);
                }
                WriteRequest::Stop(stopped) => {
                    stop = Some(stopped);
                    break;
                }
            }
        }
        write_until_stored(store.as_ref(), Arc::new(WriteBatch { ops })).await;
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

async fn write_until_stored(store: &dyn StorageApi, batch: Arc<WriteBatch>) {
    if batch.ops.is_empty() {
        return;
    }
    let mut backoff = Duration::from_millis(50);
    loop {
        match store.write(batch.clone()).await {
            Ok(()) => return,
            Err(error) => {
                tracing::warn!(%error, ops = batch.ops.len(), retry_in_ms = backoff.as_millis() as u64,
                    "storage write failed, retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}
