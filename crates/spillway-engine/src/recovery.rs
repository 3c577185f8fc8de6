//! Start-up recovery: what a previous run left in the store becomes the
//! broker's starting state. First the store is read ([`read`]: orphaned
//! payloads removed, definitions and every durable queue's entries loaded),
//! then the broker is filled from it ([`install`]): durable exchanges, queues
//! with their messages (payloads stay in the store until a consumer needs
//! them), bindings, and the next message id.

use std::collections::HashMap;

use spillway_proto::amqp;
use spillway_proto::storage::{Definitions, QueueEntry};
use spillway_proto::{ServiceError, StorageApi};

use crate::broker::{recovered_dead_letter, recovered_limits, Broker};
use crate::model::{Binding, Destination, Exchange, Queue, QueuedMessage, VHost};
use crate::routing::ExchangeKind;

/// What the store holds for a starting engine.
pub(crate) struct Stored {
    definitions: Definitions,
    /// The entries of each of `definitions.queues`, in the same order.
    entries: Vec<Vec<QueueEntry>>,
}

/// Reads the store for a starting engine.
pub(crate) async fn read(store: &dyn StorageApi, epoch: u64) -> Result<Stored, ServiceError> {
    // Nothing references a payload that flowed to disk before this engine
    // started: the store may delete every record no durable queue entry
    // holds (garbage of a crash).
    let removed = store.remove_orphans(epoch).await?;
    if removed > 0 {
        tracing::info!(
            orphaned_messages = removed,
            "payloads left by a previous run removed"
        );
    }
    let definitions = store.load_definitions().await?;
    let mut entries = Vec::with_capacity(definitions.queues.len());
    for def in &definitions.queues {
        entries.push(store.load_messages(&def.vhost, &def.name).await?);
    }
    Ok(Stored {
        definitions,
        entries,
    })
}

/// Fills a new broker with what the store held.
pub(crate) fn install(broker: &mut Broker, stored: Stored) {
    let Stored {
        definitions,
        entries,
    } = stored;
    let mut holders: HashMap<u64, u32> = HashMap::new();
    let mut next_id = 1;
    let mut recovered_messages = 0usize;
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
    debug_assert_eq!(definitions.queues.len(), entries.len());
    for (def, stored) in definitions.queues.into_iter().zip(entries) {
        recovered_messages += stored.len();
        let vhost = broker
            .vhosts
            .entry(def.vhost.clone())
            .or_insert_with(|| VHost::new(&def.vhost));
        let messages: Vec<_> = stored
            .into_iter()
            .map(|m| {
                next_id = next_id.max(m.id + 1);
                *holders.entry(m.id).or_default() += 1;
                recovered(m)
            })
            .collect();
        let arguments = amqp::decode_table(&def.arguments).unwrap_or_default();
        let mut queue = Queue::new(def.name.clone(), true, def.auto_delete, None);
        queue.limits = recovered_limits(&arguments);
        queue.dead_letter = recovered_dead_letter(&def.name, &arguments);
        queue.arguments = arguments;
        queue.spilled_from = messages.first().map_or(u64::MAX, |m| m.id);
        for message in messages {
            queue.push_recovered(message);
        }
        vhost.queues.insert(def.name, queue);
    }
    // A persistent message on several durable queues is stored once.
    holders.retain(|_, count| *count > 1);
    for queue in broker
        .vhosts
        .values_mut()
        .flat_map(|v| v.queues.values_mut())
    {
        for entry in queue.messages.iter_mut() {
            entry.shared = holders.contains_key(&entry.id);
        }
    }
    broker.shared_refs = holders;
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
        exchange.bindings.push(Binding {
            destination,
            routing_key: def.routing_key,
            arguments: amqp::decode_table(&def.arguments).unwrap_or_default(),
        });
    }
    broker.set_next_message_id(next_id);
    tracing::info!(
        vhosts = broker.vhosts.len(),
        messages = recovered_messages,
        "engine recovered durable state"
    );
}

/// A durable queue's entry as recovered at start-up: its payload stays in
/// the store until a consumer needs it.
fn recovered(entry: QueueEntry) -> QueuedMessage {
    QueuedMessage {
        id: entry.id,
        message: None,
        body_size: entry.body_size,
        delivery_count: entry.delivery_count,
        redelivered: entry.redelivered,
        persistent: true,
        shared: false,
        loading: false,
        expires_at: entry.expires_at_ms,
    }
}
