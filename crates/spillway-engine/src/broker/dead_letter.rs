//! Dead-lettering: a message a queue lets go of for a reason (rejected
//! without requeue, back after as many deliveries as the queue allows,
//! dropped or refused by a length limit) is republished to the queue's
//! dead-letter exchange with RabbitMQ's `x-death` bookkeeping in its
//! headers, or dropped when the queue has none.
//!
//! A dead letter goes through the same path as a publish
//! ([`Broker::enqueue_routed`]): the target queues' length limits, flow to
//! disk, the store. Its new record and the deletion of the old one are one
//! store batch, so a persistent message moved between durable queues is in
//! one of them whatever happens in between.
//!
//! A dead letter whose payload has flowed to disk is read back first (the
//! loader task calls [`Broker::dead_letter_loaded`]); until then the store
//! keeps its old record.

use foldhash::HashMap;
use std::collections::VecDeque;

use amq_protocol::protocol::basic::{gen_properties, parse_properties, AMQPProperties};
use amq_protocol_types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use bytes::Bytes;
use spillway_proto::engine as pb;
use spillway_proto::storage::{Durability, MessageRecord, WriteOp};

use super::Broker;
use crate::argument_values::as_integer;
use crate::broker::flow_to_disk::{discard, LoadRequest};
use crate::model::*;
use crate::queue::Queue;
use crate::routing::route;

/// A message to dead-letter from `queue`.
#[derive(Debug)]
pub struct DeadLetterJob {
    pub queue: String,
    pub entry: QueuedMessage,
    pub reason: DeathReason,
    /// The entry was `queue`'s (removed from it, or an unacked delivery):
    /// what the store holds for it there goes once it is dead-lettered.
    /// False for a publish that `reject-publish-dlx` refused.
    pub release: bool,
}

impl Broker {
    /// The most deliveries a message of `queue` may have before it is
    /// dead-lettered instead of requeued (None: no limit).
    pub(super) fn max_deliveries(&self, queue: &Queue) -> Option<u64> {
        queue
            .limits
            .max_deliveries
            .or((self.default_max_deliveries > 0).then_some(self.default_max_deliveries))
    }

    /// Lets go of messages taken off a queue for `reason` (expired, over
    /// a length limit): dead-lettered when the queue has a dead-letter
    /// exchange, else discarded (and counted). Returns the queues that
    /// received dead letters, to dispatch.
    pub(crate) fn let_go(
        &mut self,
        vhost: &str,
        queue_name: &str,
        entries: Vec<QueuedMessage>,
        reason: DeathReason,
    ) -> Vec<String> {
        if entries.is_empty() {
            return Vec::new();
        }
        let Self {
            vhosts,
            shared_refs,
            persist,
            ..
        } = self;
        let Some(queue) = vhosts
            .get_mut(vhost)
            .and_then(|v| v.queues.get_mut(queue_name))
        else {
            return Vec::new();
        };
        if queue.dead_letter.is_some() {
            let jobs = entries
                .into_iter()
                .map(|entry| DeadLetterJob {
                    queue: queue_name.to_string(),
                    entry,
                    reason,
                    release: true,
                })
                .collect();
            return self.dead_letter(vhost, jobs);
        }
        let stores = queue.stores_messages();
        let mut ops = Vec::new();
        for entry in &entries {
            queue.dead_letter_counts.count_discarded(reason);
            discard(shared_refs, vhost, queue_name, stores, entry, &mut ops);
        }
        persist.submit(ops, Durability::Logged, None);
        Vec::new()
    }

    /// Dead-letters `jobs` (and whatever the target queues' drop-head limits
    /// push out in turn), writes what the store must know in one batch, and
    /// returns the queues that received messages, to dispatch.
    ///
    /// Dead letters go in the order their messages were published (message
    /// ids increase engine-wide): the callers that return deliveries walk
    /// them newest first (requeueing is cheapest that way), and a `nack`
    /// with `multiple` must not reverse them in the dead-letter queue.
    pub(crate) fn dead_letter(&mut self, vhost: &str, mut jobs: Vec<DeadLetterJob>) -> Vec<String> {
        if jobs.is_empty() {
            return Vec::new();
        }
        jobs.sort_by_key(|job| job.entry.id);
        let mut pending: VecDeque<DeadLetterJob> = jobs.into();
        let mut ops = Vec::new();
        let mut arrivals = Vec::new();
        let mut loads = Vec::new();
        while let Some(job) = pending.pop_front() {
            let mut out = Outputs {
                ops: &mut ops,
                arrivals: &mut arrivals,
                loads: &mut loads,
                pending: &mut pending,
            };
            self.dead_letter_one(vhost, job, &mut out);
        }
        self.persist.submit(ops, Durability::Logged, None);
        if !loads.is_empty() {
            let ids = loads
                .iter()
                .map(|job: &DeadLetterJob| job.entry.id)
                .collect();
            let _ = self.loads.send(LoadRequest {
                vhost: vhost.to_string(),
                queue: String::new(),
                ids,
                dead_letters: loads,
            });
        }
        let mut touched = Vec::with_capacity(arrivals.len());
        for (queue, id) in arrivals {
            self.spill_arrival(vhost, &queue, id);
            touched.push(queue);
        }
        touched
    }

    /// Dead-letters messages whose payloads were read back for it.
    pub fn dead_letter_loaded(
        &mut self,
        vhost: &str,
        jobs: Vec<DeadLetterJob>,
        records: Vec<MessageRecord>,
    ) {
        let records: HashMap<u64, MessageRecord> = records
            .into_iter()
            .map(|record| (record.id, record))
            .collect();
        let mut ready = Vec::with_capacity(jobs.len());
        let mut ops = Vec::new();
        for mut job in jobs {
            match records.get(&job.entry.id) {
                Some(record) => {
                    job.entry.message = Some(Message::from_record(&self.budget, record.clone()));
                    ready.push(job);
                }
                None => {
                    tracing::warn!(
                        code = "QUE-1102",
                        vhost,
                        queue = %job.queue,
                        message_id = job.entry.id,
                        reason = job.reason.as_str(),
                        "QUE-1102 : Dead letter dropped : Message {} of queue {} : its payload is no longer in the store",
                        job.entry.id,
                        job.queue
                    );
                    self.drop_dead_letter(vhost, &job, &mut ops);
                }
            }
        }
        self.persist.submit(ops, Durability::Logged, None);
        let touched = self.dead_letter(vhost, ready);
        self.dispatch_all(vhost, touched);
    }

    fn dead_letter_one(&mut self, vhost_name: &str, job: DeadLetterJob, out: &mut Outputs<'_>) {
        let target = self
            .queue_mut_opt(vhost_name, &job.queue)
            .and_then(|queue| queue.dead_letter.clone());
        let Some(target) = target else {
            if job.reason == DeathReason::DeliveryLimit {
                log_delivery_limit(vhost_name, &job, None);
            }
            self.drop_dead_letter(vhost_name, &job, out.ops);
            return;
        };
        let Some(message) = job.entry.message.clone() else {
            out.loads.push(job);
            return;
        };
        let now_secs = self.clock.unix_millis() / 1000;
        let Some((properties, deaths)) =
            dead_letter_properties(&message, &job.queue, job.reason, now_secs)
        else {
            // Checked when it was published (headers exchanges parse them);
            // a message that got this far with unreadable properties is
            // dropped rather than republished without its history.
            tracing::warn!(
                code = "QUE-1102",
                vhost = vhost_name,
                queue = %job.queue,
                message_id = job.entry.id,
                "QUE-1102 : Dead letter dropped : Message {} of queue {} : malformed properties",
                job.entry.id,
                job.queue
            );
            self.drop_dead_letter(vhost_name, &job, out.ops);
            return;
        };
        let routing_key = target
            .routing_key
            .clone()
            .unwrap_or_else(|| message.routing_key.clone());
        // Routing reads the properties (headers exchanges), never the body:
        // the body goes to the copy as held, compressed or not.
        let cmd = pb::Publish {
            exchange: target.exchange.clone(),
            routing_key,
            properties,
            persistent: message.persistent,
            ..Default::default()
        };
        let routed = self.vhosts.get(vhost_name).map(|vhost| {
            vhost
                .exchanges
                .get(&target.exchange)
                .map(|exchange| route(vhost, exchange, &cmd))
        });
        let mut targets = match routed {
            Some(Some(Ok(targets))) => targets,
            Some(None) => {
                tracing::warn!(
                    code = "QUE-1102",
                    vhost = vhost_name,
                    queue = %job.queue,
                    exchange = %target.exchange,
                    message_id = job.entry.id,
                    reason = job.reason.as_str(),
                    "QUE-1102 : Dead letter dropped : Message {} of queue {} : dead-letter exchange {} does not exist",
                    job.entry.id,
                    job.queue,
                    target.exchange
                );
                self.drop_dead_letter(vhost_name, &job, out.ops);
                return;
            }
            _ => {
                self.drop_dead_letter(vhost_name, &job, out.ops);
                return;
            }
        };
        if job.reason != DeathReason::Rejected {
            let before = targets.len();
            targets.retain(|queue| !is_death_cycle(queue, &deaths));
            if targets.len() < before {
                tracing::warn!(
                    code = "QUE-1102",
                    vhost = vhost_name,
                    queue = %job.queue,
                    message_id = job.entry.id,
                    reason = job.reason.as_str(),
                    "QUE-1102 : Dead letter dropped : Message {} of queue {} : dead-letter cycle without reason 'rejected'",
                    job.entry.id,
                    job.queue
                );
            }
        }
        if targets.is_empty() {
            // As in RabbitMQ, a dead letter nothing is bound for is dropped
            // quietly (counted).
            if job.reason == DeathReason::DeliveryLimit {
                log_delivery_limit(vhost_name, &job, None);
            }
            self.drop_dead_letter(vhost_name, &job, out.ops);
            return;
        }
        let id = self.reserve_message_ids(1);
        let copy = Message::new(
            &self.budget,
            cmd.exchange,
            cmd.routing_key,
            cmd.properties,
            message.body.clone(),
            cmd.persistent,
        );
        // A dead letter has no `expiration` any more; the target queues'
        // `x-message-ttl` applies from now.
        let enqueued = self.enqueue_routed(
            vhost_name,
            &targets,
            &copy,
            id,
            (self.clock.unix_millis(), None),
            out.ops,
            false,
        );
        out.pending.extend(enqueued.dead_letters);
        // After the new record's write, in the same batch.
        self.release_dead_letter(vhost_name, &job, out.ops);
        if let Some(queue) = self.queue_mut_opt(vhost_name, &job.queue) {
            queue.dead_letter_counts.count_dead_lettered(job.reason);
        }
        if job.reason == DeathReason::DeliveryLimit {
            log_delivery_limit(vhost_name, &job, Some(&target.exchange));
        }
        out.arrivals
            .extend(targets.into_iter().map(|queue| (queue, id)));
    }

    /// Lets go of a dead letter that goes nowhere, counting it.
    fn drop_dead_letter(&mut self, vhost: &str, job: &DeadLetterJob, ops: &mut Vec<WriteOp>) {
        self.release_dead_letter(vhost, job, ops);
        if let Some(queue) = self.queue_mut_opt(vhost, &job.queue) {
            queue.dead_letter_counts.count_discarded(job.reason);
        }
    }

    /// Deletes what the store holds for the entry in its old queue (and its
    /// record, once no queue holds it).
    fn release_dead_letter(&mut self, vhost: &str, job: &DeadLetterJob, ops: &mut Vec<WriteOp>) {
        if !job.release {
            return;
        }
        // A queue deleted meanwhile took its stored entries with it.
        let stores = self
            .queue_mut_opt(vhost, &job.queue)
            .is_some_and(|queue| queue.stores_messages());
        discard(
            &mut self.shared_refs,
            vhost,
            &job.queue,
            stores,
            &job.entry,
            ops,
        );
    }
}

/// Where one dead letter's effects go.
struct Outputs<'a> {
    ops: &'a mut Vec<WriteOp>,
    /// (queue, message id) of every copy enqueued: flow to disk looks at
    /// them, and the queues are dispatched.
    arrivals: &'a mut Vec<(String, u64)>,
    /// Dead letters whose payload must be read back first.
    loads: &'a mut Vec<DeadLetterJob>,
    /// Messages the target queues pushed out in turn.
    pending: &'a mut VecDeque<DeadLetterJob>,
}

fn log_delivery_limit(vhost: &str, job: &DeadLetterJob, exchange: Option<&str>) {
    let deliveries = job.entry.delivery_count;
    match exchange {
        Some(exchange) => tracing::info!(
            code = "QUE-1101",
            vhost,
            queue = %job.queue,
            message_id = job.entry.id,
            deliveries,
            exchange,
            "QUE-1101 : Maximum delivery count reached : Message {} of queue {} delivered {} times : dead-lettered to exchange {}",
            job.entry.id,
            job.queue,
            deliveries,
            exchange
        ),
        None => tracing::info!(
            code = "QUE-1101",
            vhost,
            queue = %job.queue,
            message_id = job.entry.id,
            deliveries,
            "QUE-1101 : Maximum delivery count reached : Message {} of queue {} delivered {} times : discarded",
            job.entry.id,
            job.queue,
            deliveries
        ),
    }
}

/// One `x-death` entry's key: (queue, reason).
type DeathKey = (String, String);

/// The properties of `message` dead-lettered from `queue` for `reason`,
/// with RabbitMQ's bookkeeping (as RabbitMQ 3.13 writes it):
///
/// - `x-death`: one table per (queue, reason), most recent first, with
///   `count`, `reason`, `queue`, `time` (of the first such death),
///   `exchange` and `routing-keys` (those the message had then, `CC`
///   included), and `original-expiration` when it had an `expiration`
///   (which is removed, as RabbitMQ does). A repeated death increments its
///   entry's count and moves it to the front;
/// - `x-first-death-{reason,queue,exchange}`, set once;
/// - `x-last-death-{reason,queue,exchange}`, set every time.
///
/// Also returns the death keys, most recent first, for cycle detection.
/// None when the properties do not parse. `now_secs` (Unix seconds) is the
/// `time` of this death.
fn dead_letter_properties(
    message: &Message,
    queue: &str,
    reason: DeathReason,
    now_secs: u64,
) -> Option<(Bytes, Vec<DeathKey>)> {
    let (_, props) = parse_properties(&message.properties[..]).ok()?;
    let mut headers = props.headers().clone().unwrap_or_default();
    let mut deaths: Vec<FieldTable> = match headers.inner().get("x-death") {
        Some(AMQPValue::FieldArray(array)) => array
            .as_slice()
            .iter()
            .filter_map(|value| match value {
                AMQPValue::FieldTable(table) => Some(table.clone()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    let reason_text = reason.as_str();
    let existing = deaths.iter().position(|death| {
        text(death, "queue") == Some(queue) && text(death, "reason") == Some(reason_text)
    });
    let expiration = props.expiration().clone();
    let death = match existing {
        Some(position) => {
            let mut death = deaths.remove(position);
            let count = death
                .inner()
                .get("count")
                .and_then(as_integer)
                .and_then(|count| i64::try_from(count).ok())
                .unwrap_or(0);
            death.insert(
                "count".into(),
                AMQPValue::LongLongInt(count.saturating_add(1)),
            );
            death
        }
        None => {
            let mut routing_keys = vec![AMQPValue::LongString(LongString::from(
                message.routing_key.as_str(),
            ))];
            if let Some(AMQPValue::FieldArray(cc)) = headers.inner().get("CC") {
                routing_keys.extend(
                    cc.as_slice()
                        .iter()
                        .filter(|key| matches!(key, AMQPValue::LongString(_)))
                        .cloned(),
                );
            }
            let now = now_secs;
            let mut death = FieldTable::default();
            death.insert("count".into(), AMQPValue::LongLongInt(1));
            death.insert("reason".into(), AMQPValue::LongString(reason_text.into()));
            death.insert("queue".into(), AMQPValue::LongString(queue.into()));
            death.insert("time".into(), AMQPValue::Timestamp(now));
            death.insert(
                "exchange".into(),
                AMQPValue::LongString(message.exchange.as_str().into()),
            );
            death.insert(
                "routing-keys".into(),
                AMQPValue::FieldArray(FieldArray::from(routing_keys)),
            );
            if let Some(expiration) = &expiration {
                death.insert(
                    "original-expiration".into(),
                    AMQPValue::LongString(expiration.as_str().into()),
                );
            }
            death
        }
    };
    deaths.insert(0, death);
    let keys: Vec<DeathKey> = deaths
        .iter()
        .map(|death| {
            (
                text(death, "queue").unwrap_or_default().to_string(),
                text(death, "reason").unwrap_or_default().to_string(),
            )
        })
        .collect();
    let set = |headers: &mut FieldTable, key: &str, value: &str| {
        headers.insert(ShortString::from(key), AMQPValue::LongString(value.into()));
    };
    if !headers.inner().contains_key("x-first-death-reason") {
        set(&mut headers, "x-first-death-reason", reason_text);
        set(&mut headers, "x-first-death-queue", queue);
        set(&mut headers, "x-first-death-exchange", &message.exchange);
    }
    set(&mut headers, "x-last-death-reason", reason_text);
    set(&mut headers, "x-last-death-queue", queue);
    set(&mut headers, "x-last-death-exchange", &message.exchange);
    headers.insert(
        "x-death".into(),
        AMQPValue::FieldArray(FieldArray::from(
            deaths
                .into_iter()
                .map(AMQPValue::FieldTable)
                .collect::<Vec<_>>(),
        )),
    );
    let rebuilt = without_expiration(&props).with_headers(headers);
    Some((encode_properties(&rebuilt)?, keys))
}

/// RabbitMQ's rule: a dead letter routed back to a queue it already died in
/// is dropped if no death since (that one included) was `rejected` — a
/// client rejecting it somewhere in the cycle keeps it going.
fn is_death_cycle(target: &str, deaths: &[DeathKey]) -> bool {
    let Some(position) = deaths.iter().position(|(queue, _)| queue == target) else {
        return false;
    };
    deaths[..=position]
        .iter()
        .all(|(_, reason)| reason != DeathReason::Rejected.as_str())
}

fn text<'a>(table: &'a FieldTable, key: &str) -> Option<&'a str> {
    match table.inner().get(key)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str()),
        _ => None,
    }
}

/// `props` without `expiration` (a dead letter keeps it in `x-death`).
fn without_expiration(props: &AMQPProperties) -> AMQPProperties {
    let mut out = AMQPProperties::default();
    if let Some(v) = props.content_type() {
        out = out.with_content_type(v.clone());
    }
    if let Some(v) = props.content_encoding() {
        out = out.with_content_encoding(v.clone());
    }
    if let Some(v) = props.delivery_mode() {
        out = out.with_delivery_mode(*v);
    }
    if let Some(v) = props.priority() {
        out = out.with_priority(*v);
    }
    if let Some(v) = props.correlation_id() {
        out = out.with_correlation_id(v.clone());
    }
    if let Some(v) = props.reply_to() {
        out = out.with_reply_to(v.clone());
    }
    if let Some(v) = props.message_id() {
        out = out.with_message_id(v.clone());
    }
    if let Some(v) = props.timestamp() {
        out = out.with_timestamp(*v);
    }
    if let Some(v) = props.kind() {
        out = out.with_type(v.clone());
    }
    if let Some(v) = props.user_id() {
        out = out.with_user_id(v.clone());
    }
    if let Some(v) = props.app_id() {
        out = out.with_app_id(v.clone());
    }
    if let Some(v) = props.cluster_id() {
        out = out.with_cluster_id(v.clone());
    }
    out
}

pub(crate) fn encode_properties(props: &AMQPProperties) -> Option<Bytes> {
    let context = amq_protocol::frame::WriteContext::from(Vec::new());
    match gen_properties(props)(context) {
        Ok(context) => Some(context.write.into()),
        Err(error) => {
            tracing::error!(%error, "could not encode message properties");
            None
        }
    }
}

/// The properties of a redelivery: `x-delivery-count` (deliveries before
/// this one) added to the headers, as RabbitMQ's quorum queues do. The
/// properties as they are when they do not parse.
pub(crate) fn with_delivery_count(properties: &Bytes, count: u32) -> Bytes {
    let Ok((_, props)) = parse_properties(&properties[..]) else {
        return properties.clone();
    };
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(
        "x-delivery-count".into(),
        AMQPValue::LongLongInt(i64::from(count)),
    );
    let props = props.with_headers(headers);
    encode_properties(&props).unwrap_or_else(|| properties.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(list: &[(&str, &str)]) -> Vec<DeathKey> {
        list.iter()
            .map(|(q, r)| (q.to_string(), r.to_string()))
            .collect()
    }

    #[test]
    fn cycles_follow_rabbitmq() {
        // Died in a (maxlen), now in b (maxlen) going back to a: a cycle.
        let deaths = keys(&[("b", "maxlen"), ("a", "maxlen")]);
        assert!(is_death_cycle("a", &deaths));
        assert!(!is_death_cycle("c", &deaths));
        // A rejection on the way breaks it.
        let deaths = keys(&[("b", "rejected"), ("a", "maxlen")]);
        assert!(!is_death_cycle("a", &deaths));
        // ... but only one since the earlier death in the target.
        let deaths = keys(&[("b", "maxlen"), ("a", "delivery_limit"), ("b", "rejected")]);
        assert!(is_death_cycle("a", &deaths));
    }
}
