//! Start-up recovery, the broker's side: how far it is ([`Recovery`]),
//! putting a recovered queue's entries ahead of what was published to it
//! meanwhile, and letting go of the extra holds once every queue is read.
//! The background task that reads the store is `crate::recovery`.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use spillway_proto::storage::{write_op, Durability, MessageId, QueueEntry};

use super::Broker;
use crate::model::*;

/// How recovery is going, for management and for the broker's own checks.
#[derive(Debug)]
pub(crate) struct Recovery {
    /// The first message id of this run: every stored entry below it was
    /// left by an earlier run.
    pub(crate) first_id: u64,
    pub(crate) queues_total: u32,
    pub(crate) queues_loaded: u32,
    pub(crate) messages_recovered: u64,
    pub(crate) started: Instant,
    /// How long it took, once every queue is read.
    pub(crate) took: Option<Duration>,
    /// Recovering queues deleted before their entries were read: what is
    /// read for them is let go of.
    pub(crate) abandoned: HashSet<(String, String)>,
}

impl Recovery {
    /// Nothing to recover (a broker built without a store, in unit tests).
    pub(crate) fn none() -> Self {
        Self {
            first_id: 1,
            queues_total: 0,
            queues_loaded: 0,
            messages_recovered: 0,
            started: Instant::now(),
            took: Some(Duration::ZERO),
            abandoned: HashSet::new(),
        }
    }

    pub(crate) fn done(&self) -> bool {
        self.took.is_some()
    }
}

/// Recovery's progress as management shows it.
pub(crate) fn status(recovery: &Recovery) -> spillway_proto::management::RecoveryStatus {
    let elapsed = recovery.took.unwrap_or_else(|| recovery.started.elapsed());
    spillway_proto::management::RecoveryStatus {
        complete: recovery.done(),
        queues_recovered: recovery.queues_loaded,
        queues_total: recovery.queues_total,
        messages_recovered: recovery.messages_recovered,
        elapsed_ms: elapsed.as_millis() as u64,
    }
}

impl Broker {
    /// Installs the entries read for one durable queue; the last queue
    /// completes recovery.
    pub(crate) fn install_recovered(&mut self, vhost: &str, name: &str, entries: Vec<QueueEntry>) {
        let first_id = self.recovery.first_id;
        // Entries at or above the first id were written by this run (to the
        // queue as it is now, or to one of the same name declared anew).
        let recovered: Vec<QueuedMessage> = entries
            .into_iter()
            .filter(|entry| entry.id < first_id)
            .map(recovered)
            .collect();
        // One hold per queue entry, plus one for the queues not read yet
        // (see the module's documentation).
        for message in &recovered {
            *self.shared_refs.entry(message.id).or_insert(1) += 1;
        }
        self.recovery.queues_loaded += 1;
        let abandoned = self
            .recovery
            .abandoned
            .remove(&(vhost.to_string(), name.to_string()));
        let live = !abandoned
            && self
                .queue_mut_opt(vhost, name)
                .is_some_and(|q| q.recovering);
        let count = recovered.len() as u64;
        if live {
            if let Some(queue) = self.queue_mut_opt(vhost, name) {
                queue.prepend_recovered(recovered);
                queue.recovering = false;
                // basic.get, purge and delete waiting for it ask again.
                for waiter in queue.get_waiters.drain(..) {
                    let _ = waiter.send(());
                }
            }
            self.recovery.messages_recovered += count;
            tracing::debug!(
                code = "MST-1005",
                vhost,
                queue = name,
                messages = count,
                "MST-1005 : Recovered {count} messages : Queue {name}"
            );
            // Recovered messages keep their expiry (`broker/expiry.rs`).
            self.reschedule_expiry(vhost, name);
            self.read_ahead(vhost, name);
            self.dispatch(vhost, name);
        } else {
            // Deleted while it was being read: what it held goes too.
            let mut ops = Vec::new();
            for message in &recovered {
                crate::broker::flow_to_disk::discard(
                    &mut self.shared_refs,
                    vhost,
                    name,
                    true,
                    message,
                    &mut ops,
                );
            }
            self.persist.submit(ops, Durability::Logged, None);
        }
        if self.recovery.queues_loaded >= self.recovery.queues_total {
            self.complete_recovery();
        }
    }

    /// Every durable queue is read: the extra hold on each recovered
    /// message goes, and the records no queue holds any more with it.
    pub(crate) fn complete_recovery(&mut self) {
        let first_id = self.recovery.first_id;
        let mut ops = Vec::new();
        self.shared_refs.retain(|id, holders| {
            if *id >= first_id {
                return true;
            }
            *holders -= 1;
            if *holders == 0 {
                ops.push(crate::broker::op(write_op::Op::DeleteMessage(MessageId {
                    id: *id,
                })));
            }
            // A message one queue holds is not listed (`shared_refs`).
            *holders > 1
        });
        self.shared_refs.shrink_to_fit();
        self.persist.submit(ops, Durability::Logged, None);
        let took = self.recovery.started.elapsed();
        self.recovery.took = Some(took);
        self.recovery.abandoned.clear();
        let messages = self.recovery.messages_recovered;
        tracing::info!(
            code = "MST-1006",
            queues = self.recovery.queues_total,
            messages,
            took_ms = took.as_millis() as u64,
            "MST-1006 : Recovery Complete : {} messages in {} queues, {} ms",
            messages,
            self.recovery.queues_total,
            took.as_millis()
        );
    }

    /// Woken once the session's queue `name` is recovered; None when it is
    /// not recovering (or not there: the command will say so).
    pub(crate) fn recovery_wait(
        &mut self,
        session: crate::model::SessionId,
        name: &str,
    ) -> Option<tokio::sync::oneshot::Receiver<()>> {
        let vhost = self.sessions.get(&session)?.vhost.clone();
        let queue = self.queue_mut_opt(&vhost, name)?;
        if !queue.recovering {
            return None;
        }
        let (waiter, wait) = tokio::sync::oneshot::channel();
        queue.get_waiters.push(waiter);
        Some(wait)
    }

    /// A recovering queue is being deleted: what is read for it later is
    /// let go of.
    pub(crate) fn abandon_recovery(&mut self, vhost: &str, name: &str) {
        self.recovery
            .abandoned
            .insert((vhost.to_string(), name.to_string()));
    }
}

/// A durable queue's entry as recovered: its payload stays in the store
/// until a consumer needs it. Shared until recovery completes (see the
/// module's documentation).
fn recovered(entry: QueueEntry) -> QueuedMessage {
    let mut queued = QueuedMessage::stored(entry.id, entry.body_size);
    queued.priority = entry.priority.min(u32::from(u8::MAX)) as u8;
    queued.delivery_count = entry.delivery_count;
    queued.redelivered = entry.redelivered;
    queued.shared = true;
    queued.expires_at = entry.expires_at_ms;
    queued
}
