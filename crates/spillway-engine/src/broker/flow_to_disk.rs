//! Flow to disk: the broker's side of the memory budget.
//!
//! - [`Broker::housekeeping`] runs every `engine.housekeeping_interval` (and
//!   at once when a publish takes resident bytes over the threshold). Above
//!   the threshold it turns flow to disk on (`BRK-1014`), gives each queue a
//!   target (threshold × its bytes ÷ all queues' bytes) and spills payloads
//!   from the tail of every queue over its target. Flow to disk stays on
//!   until the whole backlog, resident or not, fits under the threshold
//!   again (`BRK-1015`): no flapping while a spilled backlog drains.
//! - While it is on, a message arriving at a queue over its target goes
//!   straight to the store ([`Broker::spill_arrival`]).
//! - A queue with consumers reads its head back ahead of need
//!   ([`Broker::read_ahead`]): payloads come back in batches through the
//!   engine's loader task and [`Broker::install_loaded`].
//! - Every place a message leaves a queue for good calls [`discard`], which
//!   deletes what the store holds for it once nothing references it.
//!
//! Spilling a payload never waits for its write: the store writer keeps the
//! record until it has landed and readers look there first, and its bytes
//! count as in flight meanwhile.

use foldhash::HashMap;
use std::sync::Arc;

use spillway_proto::cluster::BATCH_BYTES;
use spillway_proto::storage::{self as store, write_op, Durability, MessageRecord, WriteOp};

use crate::broker::Broker;
use crate::model::{Message, QueuedMessage};
use crate::persistence::store_op as op;
use crate::queue::Queue;

/// Messages asked of the store in one read.
const LOAD_CHUNK: usize = 256;
/// Read-ahead window, in messages, whatever their size.
const READ_AHEAD_MAX_MESSAGES: u64 = 4096;
const READ_AHEAD_MIN_MESSAGES: u64 = 16;
/// Payload bytes handed to the store writer in one spill write.
const SPILL_CHUNK_BYTES: u64 = 4 << 20;
/// One queue entry, resident or not ([`QueuedMessage`]).
const QUEUE_ENTRY_BYTES: u64 = std::mem::size_of::<QueuedMessage>() as u64;
/// A queue's entries' allocation is given back once it is four times what
/// they need, and above this many entries.
const SHRINK_ABOVE_ENTRIES: usize = 4096;
/// Unacknowledged deliveries may take this fraction (1/N) of the threshold
/// before channels holding many of them are held back.
const UNACKED_SHARE: u64 = 4;
/// Under that pressure, a channel keeps getting deliveries while it holds
/// fewer unacknowledged ones than this (like a prefetch of this size).
pub(crate) const PRESSURE_UNACKED_PER_CHANNEL: usize = 256;

/// A batch of payloads to read back for one queue, or for dead letters.
#[derive(Debug)]
pub struct LoadRequest {
    pub vhost: String,
    pub queue: String,
    pub ids: Vec<u64>,
    /// Not empty: the payloads are those of these dead letters (`ids` are
    /// theirs), to dead-letter once read ([`Broker::dead_letter_loaded`]).
    pub dead_letters: Vec<crate::broker::DeadLetterJob>,
}

/// What the broker's flow-to-disk state looks like from outside.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlowStatus {
    pub active: bool,
    pub threshold_bytes: u64,
    /// Resident message bytes, including payloads on their way to the store.
    pub resident_bytes: u64,
    pub in_flight_bytes: u64,
    /// Queue entries and unacknowledged deliveries (counted against the
    /// threshold beside resident bytes).
    pub bookkeeping_bytes: u64,
    /// Ready messages whose payload is only in the store, and their bytes.
    pub spilled_messages: u64,
    pub spilled_bytes: u64,
}

/// Payloads being moved to the store by one spill pass.
#[derive(Default)]
struct Spill {
    ops: Vec<WriteOp>,
    /// Messages whose record these ops write: marked stored once submitted.
    messages: Vec<Arc<Message>>,
    bytes: u64,
}

impl Broker {
    /// One housekeeping cycle: turns flow to disk on or off and spills.
    pub fn housekeeping(&mut self) {
        let threshold = self.budget.threshold();
        // A queue that drained keeps its entries' allocation unless given
        // back: a spilled backlog of millions would hold it for good.
        for queue in self.vhosts.values_mut().flat_map(|v| v.queues.values_mut()) {
            queue.messages.shrink(SHRINK_ABOVE_ENTRIES);
        }
        let (entries, unacked) = self.bookkeeping();
        self.budget.set_bookkeeping(entries + unacked);
        self.check_memory_ceiling();
        let resident = self.budget.used_bytes();
        let spilled: u64 = self
            .vhosts
            .values()
            .flat_map(|v| v.queues.values())
            .map(|q| q.spilled_bytes)
            .sum();
        self.set_unacked_pressure(unacked > threshold / UNACKED_SHARE);
        if !self.flow_active && resident > threshold {
            self.flow_active = true;
            tracing::info!(
                code = "BRK-1014",
                resident_bytes = resident,
                threshold_bytes = threshold,
                "BRK-1014 : Message flow to disk active : Message memory use {} exceeds threshold {}",
                megabytes(resident),
                megabytes(threshold)
            );
        } else if self.flow_active && resident + spilled <= threshold {
            self.flow_active = false;
            tracing::info!(
                code = "BRK-1015",
                resident_bytes = resident,
                threshold_bytes = threshold,
                "BRK-1015 : Message flow to disk inactive : Message memory use {} within threshold {}",
                megabytes(resident),
                megabytes(threshold)
            );
        }
        if !self.flow_active {
            for queue in self.vhosts.values_mut().flat_map(|v| v.queues.values_mut()) {
                queue.target_bytes = u64::MAX;
            }
            return;
        }
        let total: u64 = self
            .vhosts
            .values()
            .flat_map(|v| v.queues.values())
            .map(queue_weight)
            .sum::<u64>()
            .max(1);
        // The bookkeeping stays in memory whatever flows to disk, and
        // payloads on their way to the store are still resident until their
        // write lands: queued payloads share what is left of the threshold.
        let threshold = threshold.saturating_sub(entries + unacked + self.budget.spill_reserve());
        let mut spill = Spill::default();
        // What this pass may put on its way to the store: payloads in
        // flight are still in memory until their write lands, so a pass
        // that spilled a whole resident set at once would double it.
        let mut write_room = self
            .budget
            .spill_window()
            .saturating_sub(self.budget.in_flight_bytes());
        let now = self.clock.now();
        let Self {
            vhosts,
            persist,
            sessions,
            budget,
            unacked_grace,
            ..
        } = self;
        for queue in vhosts.values_mut().flat_map(|v| v.queues.values_mut()) {
            let share = u128::from(threshold) * u128::from(queue_weight(queue)) / u128::from(total);
            queue.target_bytes = u64::try_from(share).unwrap_or(u64::MAX);
            if queue.max_priority() > 0 {
                // A priority queue keeps only its read-ahead resident: what
                // it would keep besides is its highest priorities' oldest
                // payloads, allocated among every priority's, and the pages
                // they pin once their neighbours are spilled cost the
                // process more than the payloads (performance.md). What
                // read-ahead brings back is allocated afresh, together.
                queue.target_bytes = queue.target_bytes.min(READ_AHEAD_BYTES);
            }
            if queue.resident_bytes <= queue.target_bytes {
                continue;
            }
            spill_tail(queue, &mut spill, &mut write_room);
            if spill.bytes >= SPILL_CHUNK_BYTES {
                submit_spill(persist, &mut spill);
            }
        }
        // Delivered, unacknowledged payloads count in the budget too, and
        // are needed again only if requeued: a consumer that never acks a
        // spilled backlog must not bring it all back into memory. But a
        // delivery acked within the grace period is never written (it would
        // be deleted at once), and one pass writes no more of them than the
        // spill window has room for: a fast consumer taking a resident
        // backlog must not turn it into a burst of writes whose copies
        // nothing bounds.
        let delivered_before = now.checked_sub(*unacked_grace);
        let mut room = budget
            .spill_window()
            .saturating_sub(budget.in_flight_bytes() + spill.bytes);
        for unacked in sessions
            .values_mut()
            .flat_map(|s| s.channels.values_mut())
            .flat_map(|c| c.unacked.values_mut())
        {
            if room == 0 {
                break;
            }
            if delivered_before.is_none_or(|before| unacked.delivered_at > before) {
                continue;
            }
            room = room.saturating_sub(spill_unacked(&mut unacked.message, &mut spill));
            if spill.bytes >= SPILL_CHUNK_BYTES {
                submit_spill(persist, &mut spill);
            }
        }
        submit_spill(persist, &mut spill);
    }

    /// Sends the newest message of `queue` straight to the store when flow to
    /// disk is on and the queue is over its target, unless it sits inside
    /// the read-ahead window (it would only be read back at once).
    pub(crate) fn spill_arrival(&mut self, vhost: &str, queue_name: &str, id: u64) {
        if !self.flow_active {
            return;
        }
        let Self {
            vhosts, persist, ..
        } = self;
        let Some(queue) = vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(queue_name))
        else {
            return;
        };
        if queue.resident_bytes <= queue.target_bytes
            || (queue.messages.len() as u64) <= read_ahead_window(queue)
        {
            return;
        }
        let Some(position) = queue.position(id) else {
            return;
        };
        // A priority queue's arrival may land in the read-ahead region,
        // ahead of what is being read back: it stays.
        let in_read_ahead = queue
            .messages
            .get(position)
            .is_some_and(|entry| queue.messages.rank(entry) < queue.read_ahead_until);
        if in_read_ahead || (position as u64) < read_ahead_window(queue) {
            return;
        }
        let mut spill = Spill::default();
        spill_entry(queue, position, &mut spill);
        submit_spill(persist, &mut spill);
    }

    /// Asks the loader for the payloads of the queue's next messages, up to
    /// the read-ahead window, that are neither resident nor being loaded.
    pub(crate) fn read_ahead(&mut self, vhost: &str, queue_name: &str) {
        // Split borrows: the queue, and the loader's channel.
        let Self { vhosts, loads, .. } = self;
        let Some(queue) = vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(queue_name))
        else {
            return;
        };
        if queue.spilled_count == 0 {
            return;
        }
        let window = read_ahead_window(queue) as usize;
        let start = queue.messages.count_below(queue.read_ahead_until);
        if start >= window {
            return;
        }
        let mut ids = Vec::new();
        // Bodies asked for in one read: the answer is one gRPC message from
        // a remote storage node, so a chunk stops at `BATCH_BYTES` (a larger
        // body goes alone).
        let mut bytes = 0;
        let end = window.min(queue.messages.len());
        for (rank, entry) in queue.messages.range_mut(start..end) {
            queue.read_ahead_until = rank.saturating_add(1);
            if entry.message.is_some() || entry.loading {
                continue;
            }
            if !ids.is_empty() && bytes + entry.body_size() > BATCH_BYTES as u64 {
                let _ = loads.send(LoadRequest {
                    vhost: vhost.to_string(),
                    queue: queue_name.to_string(),
                    ids: std::mem::take(&mut ids),
                    dead_letters: Vec::new(),
                });
                bytes = 0;
            }
            entry.loading = true;
            ids.push(entry.id);
            bytes += entry.body_size();
            if ids.len() == LOAD_CHUNK {
                let _ = loads.send(LoadRequest {
                    vhost: vhost.to_string(),
                    queue: queue_name.to_string(),
                    ids: std::mem::take(&mut ids),
                    dead_letters: Vec::new(),
                });
                bytes = 0;
            }
        }
        if !ids.is_empty() {
            let _ = loads.send(LoadRequest {
                vhost: vhost.to_string(),
                queue: queue_name.to_string(),
                ids,
                dead_letters: Vec::new(),
            });
        }
    }

    /// Puts payloads read back from the store into their messages, then
    /// wakes basic.get callers and dispatches. A message that is gone by now
    /// (acked, purged) just drops its payload again.
    pub fn install_loaded(
        &mut self,
        vhost: &str,
        queue_name: &str,
        asked: &[u64],
        records: Vec<MessageRecord>,
    ) {
        let budget = self.budget.clone();
        let Some(queue) = self.queue_mut_opt(vhost, queue_name) else {
            return;
        };
        let mut found = Vec::with_capacity(records.len());
        for record in records {
            let id = record.id;
            found.push(id);
            queue.install(id, Message::from_record(&budget, record));
        }
        // A record the store does not have is a message that cannot be
        // delivered: say so loudly and take it off the queue rather than
        // wedge the queue behind it.
        let mut lost = Vec::new();
        let mut lost_ops: Vec<WriteOp> = Vec::new();
        for id in asked.iter().filter(|id| !found.contains(id)) {
            let Some(position) = queue.position(*id) else {
                continue;
            };
            if queue
                .messages
                .get(position)
                .is_none_or(|entry| entry.message.is_some())
            {
                continue;
            }
            if let Some(entry) = queue.messages.remove(position) {
                queue.ready_bytes -= entry.body_size();
                queue.spilled_count -= 1;
                queue.spilled_bytes -= entry.body_size();
                lost.push(entry.id);
            }
        }
        if !lost.is_empty() {
            tracing::error!(vhost, queue = queue_name, ids = ?lost,
                "message records missing from the store: messages dropped");
            // Their queue entries go too, so that a restart does not bring
            // back what cannot be delivered (a corrupt record the store
            // skipped and deleted, MST-1103).
            if queue.stores_messages() {
                lost_ops = lost
                    .iter()
                    .map(|id| {
                        op(write_op::Op::DeleteQueueEntry(
                            spillway_proto::storage::QueueEntryKey {
                                vhost: vhost.to_string(),
                                queue: queue_name.to_string(),
                                id: *id,
                            },
                        ))
                    })
                    .collect();
            }
        }
        for waiter in queue.get_waiters.drain(..) {
            let _ = waiter.send(());
        }
        self.persist.submit(lost_ops, Durability::Logged, None);
        self.dispatch(vhost, queue_name);
    }

    /// Bytes of the broker's bookkeeping that stays in memory whatever
    /// flows to disk: every queue's entries (their allocated capacity),
    /// and every unacknowledged delivery's record.
    fn bookkeeping(&self) -> (u64, u64) {
        let entries: u64 = self
            .vhosts
            .values()
            .flat_map(|v| v.queues.values())
            .map(|q| q.messages.capacity() as u64)
            .sum();
        let unacked: u64 = self
            .sessions
            .values()
            .flat_map(|s| s.channels.values())
            .map(|c| c.unacked.len() as u64)
            .sum();
        (
            entries * QUEUE_ENTRY_BYTES,
            unacked * crate::budget::UNACKED_ENTRY_BYTES,
        )
    }

    /// Unacknowledged deliveries cannot flow to disk: past their share of
    /// the threshold, a channel that already holds
    /// [`PRESSURE_UNACKED_PER_CHANNEL`] of them gets no more until it acks,
    /// whatever its prefetch (none, or a large one). When the pressure
    /// ends, every queue with consumers dispatches again.
    fn set_unacked_pressure(&mut self, pressure: bool) {
        if pressure == self.unacked_pressure {
            return;
        }
        self.unacked_pressure = pressure;
        tracing::info!(
            pressure,
            share = format!("1/{UNACKED_SHARE}"),
            per_channel = PRESSURE_UNACKED_PER_CHANNEL,
            "unacknowledged deliveries {} their share of the memory budget",
            if pressure { "exceed" } else { "are within" }
        );
        if pressure {
            return;
        }
        let queues: Vec<(String, String)> = self
            .vhosts
            .iter()
            .flat_map(|(vhost, v)| {
                v.queues
                    .values()
                    .filter(|q| !q.consumers.is_empty())
                    .map(move |q| (vhost.clone(), q.name.clone()))
            })
            .collect();
        for (vhost, queue) in queues {
            self.dispatch(&vhost, &queue);
        }
    }

    pub fn flow_status(&self) -> FlowStatus {
        let (spilled_messages, spilled_bytes) = self
            .vhosts
            .values()
            .flat_map(|v| v.queues.values())
            .fold((0, 0), |(count, bytes), q| {
                (count + q.spilled_count, bytes + q.spilled_bytes)
            });
        FlowStatus {
            active: self.flow_active,
            threshold_bytes: self.budget.threshold(),
            resident_bytes: self.budget.resident_bytes(),
            in_flight_bytes: self.budget.in_flight_bytes(),
            bookkeeping_bytes: self.budget.bookkeeping_bytes(),
            spilled_messages,
            spilled_bytes,
        }
    }
}

/// Takes a message off a queue for good (acked, dropped, purged, deleted):
/// adds the ops that delete what the store holds for it — its queue entry
/// when the queue stores it, its record once no other queue holds it.
pub(crate) fn discard(
    shared_refs: &mut HashMap<u64, u32>,
    vhost: &str,
    queue: &str,
    queue_stores: bool,
    entry: &QueuedMessage,
    ops: &mut Vec<WriteOp>,
) {
    if entry.persistent && queue_stores {
        ops.push(op(write_op::Op::DeleteQueueEntry(store::QueueEntryKey {
            vhost: vhost.to_string(),
            queue: queue.to_string(),
            id: entry.id,
        })));
    }
    if entry.shared {
        if let Some(holders) = shared_refs.get_mut(&entry.id) {
            if *holders > 1 {
                *holders -= 1;
                return;
            }
            shared_refs.remove(&entry.id);
        }
    }
    let stored = entry
        .message
        .as_ref()
        .is_none_or(|message| message.stored_seq() != 0);
    if stored {
        ops.push(op(write_op::Op::DeleteMessage(store::MessageId {
            id: entry.id,
        })));
    }
}

/// What a queue weighs when the threshold is shared out: its ready bytes.
fn queue_weight(queue: &Queue) -> u64 {
    queue.ready_bytes + queue.messages.len() as u64
}

/// What read-ahead keeps resident (or loading) ahead of a queue's consumers.
const READ_AHEAD_BYTES: u64 = 4 << 20;

/// How many messages from the head a queue keeps resident (or loading) for
/// its consumers: `READ_AHEAD_BYTES` worth at the queue's average size.
pub(crate) fn read_ahead_window(queue: &Queue) -> u64 {
    let count = queue.messages.len() as u64;
    if count == 0 {
        return READ_AHEAD_MIN_MESSAGES;
    }
    let average = (queue.ready_bytes / count).max(1);
    (READ_AHEAD_BYTES / average).clamp(READ_AHEAD_MIN_MESSAGES, READ_AHEAD_MAX_MESSAGES)
}

/// Spills from the tail until the queue is within its target, leaving the
/// read-ahead region alone, and writing at most `write_room` bytes (what is
/// left over target goes at the next pass).
fn spill_tail(queue: &mut Queue, spill: &mut Spill, write_room: &mut u64) {
    let mut position = queue.messages.count_below(queue.spilled_from);
    let mut tail_spilled = true;
    while position > 0 && queue.resident_bytes > queue.target_bytes {
        position -= 1;
        let Some(entry) = queue.messages.get(position) else {
            break;
        };
        let rank = queue.messages.rank(entry);
        if rank < queue.read_ahead_until {
            break;
        }
        if let Some(message) = &entry.message {
            if message.stored_seq() == 0 {
                let size = message.accounted_size();
                if size > *write_room {
                    break;
                }
                *write_room -= size;
            }
            spill_entry(queue, position, spill);
        }
        let spilled = queue
            .messages
            .get(position)
            .is_some_and(|entry| entry.message.is_none());
        if spilled && tail_spilled {
            queue.spilled_from = rank;
        } else {
            tail_spilled = false;
        }
    }
}

/// Spills the message at `position`, writing its record first unless the
/// store already has (or is getting) one.
fn spill_entry(queue: &mut Queue, position: usize, spill: &mut Spill) {
    let Some(entry) = queue.messages.get(position) else {
        return;
    };
    let Some(message) = entry.message.clone() else {
        return;
    };
    write_unless_stored(message, entry.id, spill);
    queue.spill_at(position);
}

/// Adds the record of message `id` to the spill unless the store already
/// has (or is getting) one.
fn write_unless_stored(message: Arc<Message>, id: u64, spill: &mut Spill) {
    if message.stored_seq() != 0 {
        return;
    }
    spill
        .ops
        .push(op(write_op::Op::PutMessage(message.record(id))));
    spill.bytes += message.accounted_size();
    // Marked now so a sibling queue spilling the same message in this pass
    // does not write it twice; the real sequence number follows.
    message.mark_stored(u64::MAX);
    spill.messages.push(message);
}

/// Drops a delivered, unacknowledged message's payload from memory when the
/// store has its record already (it flowed to disk before, or is
/// persistent): nothing to write. If it is requeued, read-ahead brings it
/// back like any spilled message.
pub(crate) fn release_stored_payload(entry: &mut QueuedMessage) {
    if entry.message.as_ref().is_some_and(|m| m.stored_seq() != 0) {
        entry.message = None;
    }
}

/// Moves a delivered, unacknowledged message's payload to the store,
/// writing its record first unless the store has (or is getting) one.
/// Returns the bytes that adds to the spill.
fn spill_unacked(entry: &mut QueuedMessage, spill: &mut Spill) -> u64 {
    let before = spill.bytes;
    if let Some(message) = entry.message.take() {
        write_unless_stored(message, entry.id, spill);
    }
    spill.bytes - before
}

fn submit_spill(persist: &crate::persistence::StoreWriter, spill: &mut Spill) {
    if spill.ops.is_empty() {
        return;
    }
    let seq = persist.submit_spill(
        std::mem::take(&mut spill.ops),
        // Logged, not volatile: a storage node that dies under a running
        // engine (separate processes) must give these back when it returns.
        Durability::Logged,
        spill.bytes,
        None,
    );
    for message in spill.messages.drain(..) {
        message.mark_stored(seq);
    }
    spill.bytes = 0;
}

/// "412 MB": the operational log's unit for memory figures.
fn megabytes(bytes: u64) -> String {
    format!("{} MB", bytes / 1_000_000)
}
