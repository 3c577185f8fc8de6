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

use spillway_amqp as amqp;
use spillway_proto::storage::Definitions;
use spillway_proto::util::backoff::Backoff;
use spillway_proto::ServiceError;

use crate::broker::{
    recovered_dead_letter, recovered_limits, recovered_max_priority,
    recovered_single_active_consumer, Broker,
};
use crate::exchange::Exchange;
use crate::model::ExchangeKind;
use crate::model::{Binding, Destination};
use crate::policy::Policy;
use crate::queue::Queue;
use crate::shared::Shared;
use crate::vhost::VHost;

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
    for def in definitions.policies {
        let Some(vhost) = broker.vhosts.get_mut(&def.vhost) else {
            tracing::warn!(vhost = %def.vhost, policy = %def.name, "stored policy of a vhost that is gone, skipped");
            continue;
        };
        match Policy::from_definition(&def) {
            Ok(policy) => vhost.policy_set_mut(policy.operator).insert(policy),
            Err(error) => {
                tracing::warn!(vhost = %def.vhost, policy = %def.name, %error, "stored policy no longer valid, skipped")
            }
        }
    }
    for def in definitions.exchanges {
        let arguments = amqp::decode_table(&def.arguments).unwrap_or_default();
        let delayed = def.kind == crate::exchange::DELAYED_MESSAGE;
        let kind = match ExchangeKind::parse(&def.kind) {
            Some(kind) => Some(kind),
            None if delayed => crate::broker::delayed_type(&arguments).ok(),
            None => None,
        };
        let Some(kind) = kind else {
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
        exchange.arguments = arguments;
        exchange.delayed = delayed;
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
        queue.single_active_consumer = recovered_single_active_consumer(&arguments);
        queue.set_max_priority(recovered_max_priority(&arguments));
        queue.arguments = arguments;
        queue.recovering = true;
        pending.push((def.vhost, def.name.clone()));
        vhost.insert_queue(queue);
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
    // Every queue and exchange is there: the policies apply before any
    // queue holds a message.
    broker.apply_all_policies();
    broker.set_next_message_id(first_id);
    broker.recovery = crate::broker::recovery::Recovery {
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
    F: FnMut(std::sync::Arc<dyn spillway_proto::storage::StorageApi>) -> Fut,
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
