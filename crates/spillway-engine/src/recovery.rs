//! Start-up recovery: what a previous run left in the store becomes the
//! broker's state, in two steps, so that the broker takes connections at
//! once however large the backlog it recovers.
//!
//! Before the engine serves anyone, [`install_definitions`] fills the broker
//! with the durable exchanges, bindings and queues — the queues empty and
//! marked `recovering` — and fixes the first message id of this run (above
//! every id a previous run gave out, see [`first_message_id`]).
//!
//! Then, in the background, [`run`] deletes the payloads that no durable
//! queue references any more (garbage of a crash, and payloads of transient
//! messages that flowed to disk), and reads each durable queue's entries,
//! one queue at a time, putting them ahead of whatever was published to the
//! queue meanwhile. A recovering queue takes publishes and consumers but
//! delivers nothing, so nothing published now overtakes what it held; a
//! basic.get, purge or delete waits for it. Progress is logged (`MST-1004`,
//! `MST-1005`, `MST-1006`) and shown in management's broker status.
//!
//! A persistent message routed to several durable queues is stored once, so
//! its record may only go when the last of them lets go of it. Until every
//! queue is read, the broker cannot know how many hold a recovered message:
//! each recovered id is counted in `shared_refs` with one extra hold for the
//! queues not read yet, released when recovery completes.

use std::collections::HashSet;
use std::sync::Weak;
use std::time::{Duration, Instant};

use spillway_proto::amqp;
use spillway_proto::backoff::Backoff;
use spillway_proto::storage::{write_op, Durability, MessageId};
use spillway_proto::storage::{Definitions, QueueEntry};
use spillway_proto::ServiceError;

use crate::broker::{recovered_dead_letter, recovered_limits, Broker};
use crate::engine::Shared;
use crate::model::{Binding, Destination, Exchange, Queue, QueuedMessage, VHost};
use crate::routing::ExchangeKind;

/// Message ids of one run start at its lease epoch times 2^40: above every
/// id an earlier run (an earlier epoch) gave out, as long as no run gives
/// out more than 2^40 ids, without reading the store to find the highest.
const IDS_PER_EPOCH_SHIFT: u32 = 40;

/// The first message id the engine holding lease `epoch` gives out.
pub(crate) fn first_message_id(epoch: u64) -> u64 {
    epoch
        .checked_mul(1 << IDS_PER_EPOCH_SHIFT)
        .unwrap_or(u64::MAX / 2)
        .max(1)
}

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
    abandoned: HashSet<(String, String)>,
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

/// Fills a new broker with the stored definitions; returns the durable
/// queues (vhost, name) whose entries [`run`] must read, oldest definition
/// first.
pub(crate) fn install_definitions(
    broker: &mut Broker,
    definitions: Definitions,
    first_id: u64,
) -> Vec<(String, String)> {
    for def in definitions.vhosts {
        broker
            .vhosts
            .entry(def.name.clone())
            .or_insert_with(|| VHost::new(&def.name));
    }
    for def in definitions.exchanges {
        let Some(kind) = ExchangeKind::parse(&def.kind) else {
            tracing::warn!(exchange = %def.name, kind = %def.kind, "stored exchange has an unknown type, skipped");
            continue;
        };
        let vhost = broker
            .vhosts
            .entry(def.vhost.clone())
            .or_insert_with(|| VHost::new(&def.vhost));
        let mut exchange = Exchange::new(&def.name, kind, true);
        exchange.auto_delete = def.auto_delete;
        exchange.internal = def.internal;
        exchange.arguments = amqp::decode_table(&def.arguments).unwrap_or_default();
        vhost.exchanges.insert(def.name, exchange);
    }
    let mut pending = Vec::with_capacity(definitions.queues.len());
    for def in definitions.queues {
        let vhost = broker
            .vhosts
            .entry(def.vhost.clone())
            .or_insert_with(|| VHost::new(&def.vhost));
        let arguments = amqp::decode_table(&def.arguments).unwrap_or_default();
        let mut queue = Queue::new(def.name.clone(), true, def.auto_delete, None);
        queue.limits = recovered_limits(&arguments);
        queue.dead_letter = recovered_dead_letter(&def.name, &arguments);
        queue.arguments = arguments;
        queue.recovering = true;
        pending.push((def.vhost, def.name.clone()));
        vhost.queues.insert(def.name, queue);
    }
    for def in definitions.bindings {
        let Some(vhost) = broker.vhosts.get_mut(&def.vhost) else {
            continue;
        };
        if !def.to_exchange && !vhost.queues.contains_key(&def.queue) {
            continue;
        }
        let destination = if def.to_exchange {
            if !vhost.exchanges.contains_key(&def.queue) {
                continue;
            }
            Destination::Exchange(def.queue)
        } else {
            Destination::Queue(def.queue)
        };
        let Some(exchange) = vhost.exchanges.get_mut(&def.exchange) else {
            continue;
        };
        exchange.bindings.insert(Binding {
            destination,
            routing_key: def.routing_key,
            arguments: amqp::decode_table(&def.arguments).unwrap_or_default(),
        });
    }
    broker.set_next_message_id(first_id);
    broker.recovery = Recovery {
        first_id,
        queues_total: pending.len() as u32,
        queues_loaded: 0,
        messages_recovered: 0,
        started: Instant::now(),
        took: None,
        abandoned: HashSet::new(),
    };
    tracing::info!(
        vhosts = broker.vhosts.len(),
        queues = pending.len(),
        first_message_id = first_id,
        "engine recovered durable definitions"
    );
    pending
}

/// The background half of recovery: orphaned payloads deleted, then each
/// durable queue's entries read and installed. Store errors are retried
/// (with backoff) until the engine goes: a queue is never served half read.
pub(crate) async fn run(shared: Weak<Shared>, epoch: u64, queues: Vec<(String, String)>) {
    let (first_id, total) = {
        let Some(engine) = shared.upgrade() else {
            return;
        };
        let broker = engine.broker.lock();
        (broker.recovery.first_id, broker.recovery.queues_total)
    };
    tracing::info!(
        code = "MST-1004",
        queues = total,
        "MST-1004 : Recovery Start : {total} durable queues"
    );
    // Before any queue is read: while every durable queue is recovering,
    // no message of an earlier run can gain or lose a queue entry.
    let removed = with_retry(&shared, "remove orphaned payloads", |store| async move {
        store.remove_orphans(epoch, first_id).await
    })
    .await;
    match removed {
        Some(removed) if removed > 0 => tracing::info!(
            orphaned_messages = removed,
            "payloads left by a previous run removed"
        ),
        Some(_) => {}
        None => return,
    }
    if queues.is_empty() {
        if let Some(engine) = shared.upgrade() {
            engine.broker.lock().complete_recovery();
        }
        return;
    }
    for (vhost, queue) in queues {
        let read = with_retry(&shared, "read a durable queue", |store| {
            let (vhost, queue) = (vhost.clone(), queue.clone());
            async move { store.load_messages(&vhost, &queue).await }
        })
        .await;
        let Some(entries) = read else {
            return;
        };
        let Some(engine) = shared.upgrade() else {
            return;
        };
        engine
            .broker
            .lock()
            .install_recovered(&vhost, &queue, entries);
    }
}

/// Calls the store until it answers, or the engine is gone (None).
async fn with_retry<T, F, Fut>(shared: &Weak<Shared>, what: &str, mut call: F) -> Option<T>
where
    F: FnMut(std::sync::Arc<dyn spillway_proto::StorageApi>) -> Fut,
    Fut: std::future::Future<Output = Result<T, ServiceError>>,
{
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut failures = 0u32;
    loop {
        let store = shared.upgrade()?.store()?;
        match call(store).await {
            Ok(value) => return Some(value),
            Err(error) => {
                failures += 1;
                // Once, then every tenth time: a storage node that is away
                // for a minute is not 600 lines.
                if failures % 10 == 1 {
                    tracing::warn!(%error, failures, "recovery cannot {what} yet, retrying");
                }
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
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
                crate::flow::discard(&mut self.shared_refs, vhost, name, true, message, &mut ops);
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
    QueuedMessage {
        id: entry.id,
        message: None,
        body_size: entry.body_size,
        delivery_count: entry.delivery_count,
        redelivered: entry.redelivered,
        persistent: true,
        shared: true,
        loading: false,
        expires_at: entry.expires_at_ms,
    }
}
