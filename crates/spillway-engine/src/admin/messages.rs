//! Messages as management handles them: peeked (nothing consumed; payloads
//! that flowed to disk are read back for the answer and stay on disk),
//! got (consumed, as `basic.get`), moved between queues in batches, and
//! published with the path and confirms of a client.

use std::collections::HashMap;

use amq_protocol_types::{AMQPValue, FieldTable, ShortString};
use bytes::Bytes;
use spillway_amqp as amqp;
use spillway_proto::cluster::BATCH_BYTES;
use spillway_proto::engine as pb;
use spillway_proto::management::{self as m, argument_value};
use spillway_proto::storage::{self as store, write_op, WriteOp};
use spillway_proto::ServiceError;
use tokio::sync::oneshot;

use super::common::{argument_map, not_exclusive, not_found, service_error, vhost, CHANNEL};
use crate::broker::{Broker, GetOutcome};
use crate::engine::Engine;
use crate::model::{QueuedMessage, SessionId};
use crate::persistence::{await_written, store_op};

/// Peek's default count.
const DEFAULT_PEEK: u32 = 10;

/// Peek's largest count.
const MAX_PEEK: u32 = 10_000;

impl Engine {
    /// Management's publish: the publish path of a client with confirms, on a
    /// session of its own; answers once routed, and written when persistent.
    pub(crate) async fn publish_message(
        &self,
        request: m::PublishMessageRequest,
    ) -> Result<m::PublishMessageResponse, ServiceError> {
        let properties = request.properties.unwrap_or_default();
        let expiration_ms = match properties.expiration.as_str() {
            "" => None,
            text => Some(
                amqp::properties::parse_expiration(text).map_err(ServiceError::InvalidArgument)?,
            ),
        };
        let persistent = properties.delivery_mode == 2;
        let encoded = crate::broker::dead_letter::encode_properties(&amqp_properties(&properties)?)
            .ok_or_else(|| {
                ServiceError::InvalidArgument("the properties cannot be encoded".into())
            })?;
        let body = request.body;
        let cmd = pb::Publish {
            channel: CHANNEL,
            exchange: request.exchange,
            routing_key: request.routing_key,
            properties: encoded,
            body_size: body.len() as u64,
            body,
            confirm_seq: 1,
            persistent,
            expiration_ms,
            ..Default::default()
        };
        let (routed, outcome) = self.with_session(&request.vhost, |broker, session| {
            let routed = broker
                .routes_anywhere(&request.vhost, &cmd)
                .map_err(service_error)?;
            let outcome = broker.publish(session, cmd).map_err(service_error)?;
            Ok((routed, outcome))
        })?;
        match outcome {
            crate::broker::PublishOutcome::Done => {}
            crate::broker::PublishOutcome::AfterWrite(written) => {
                await_written(written, "the message").await?;
            }
            crate::broker::PublishOutcome::Rejected => return Err(ServiceError::FailedPrecondition(
                "the message was rejected: a queue it routes to is full (x-overflow reject-publish)"
                    .into(),
            )),
        }
        Ok(m::PublishMessageResponse { routed })
    }

    /// The first ready messages of a queue, decoded enough to show; nothing is
    /// consumed. Payloads that flowed to disk are read back for the answer
    /// (they stay on disk).
    pub(crate) async fn peek_messages(
        &self,
        request: m::PeekMessagesRequest,
    ) -> Result<m::PeekMessagesResponse, ServiceError> {
        let count = match request.count {
            0 => DEFAULT_PEEK,
            n => n.min(MAX_PEEK),
        } as usize;
        let taken: Vec<QueuedMessage> = {
            let broker = self.shared.broker.lock();
            let queue = vhost(&broker, &request.vhost)?
                .queues
                .get(&request.queue)
                .ok_or_else(|| not_found("queue", &request.queue, &request.vhost))?;
            not_exclusive(queue, &request.vhost)?;
            queue.messages.iter().take(count).cloned().collect()
        };
        let missing: Vec<u64> = taken
            .iter()
            .filter(|q| q.message.is_none())
            .map(|q| q.id)
            .collect();
        let max_message_size = self.shared.max_message_size;
        let mut records: HashMap<u64, store::MessageRecord> = HashMap::new();
        if !missing.is_empty() {
            for record in crate::shared::load(&self.shared, &missing).await {
                records.insert(record.id, record);
            }
        }
        let messages = taken
            .into_iter()
            .enumerate()
            .filter_map(|(position, queued)| {
                let (exchange, routing_key, properties, body, persistent) = match &queued.message {
                    Some(message) => (
                        message.exchange.clone(),
                        message.routing_key.clone(),
                        message.properties.clone(),
                        message.body.clone(),
                        message.persistent,
                    ),
                    None => {
                        // Acked meanwhile: its record may be gone; leave it out.
                        let record = records.remove(&queued.id)?;
                        let body = record.body();
                        (
                            record.exchange,
                            record.routing_key,
                            record.properties,
                            body,
                            record.persistent,
                        )
                    }
                };
                // Shown as published: a compressed body is decoded here (bounded
                // by the largest message size); one that does not decode is
                // shown empty with its declared size, and logged.
                let body_size = body.size();
                let body = body.decode(max_message_size).unwrap_or_else(|error| {
                    tracing::warn!(
                        vhost = %request.vhost,
                        queue = %request.queue,
                        message_id = queued.id,
                        %error,
                        "peeked message body does not decode"
                    );
                    Bytes::new()
                });
                let mut peeked = m::PeekedMessage {
                    position: position as u64,
                    exchange,
                    routing_key,
                    redelivered: queued.redelivered,
                    delivery_count: queued.delivery_count,
                    persistent,
                    body_size,
                    body,
                    ..Default::default()
                };
                show_properties(&mut peeked, &properties);
                Some(peeked)
            })
            .collect();
        Ok(m::PeekMessagesResponse {
            messages: within_batch_bytes(messages),
        })
    }

    /// Takes messages from the head of a queue as basic.get does, on an
    /// internal session: acknowledged at once, or rejected without requeue
    /// (dead-lettered as the queue says). Stops at `count`, at an empty queue,
    /// or at the answer's batch bound.
    pub(crate) async fn get_messages(
        &self,
        request: m::GetMessagesRequest,
    ) -> Result<m::PeekMessagesResponse, ServiceError> {
        let count = request.count.clamp(1, MAX_PEEK) as usize;
        let session = {
            let mut broker = self.shared.broker.lock();
            let queue = vhost(&broker, &request.vhost)?
                .queues
                .get(&request.queue)
                .ok_or_else(|| not_found("queue", &request.queue, &request.vhost))?;
            not_exclusive(queue, &request.vhost)?;
            self.open_internal_session(&mut broker, &request.vhost)?
        };
        let taken = take_messages(self, session, &request, count).await;
        // Nothing is left unacked: closing requeues nothing.
        self.shared.broker.lock().close_session(session);
        Ok(m::PeekMessagesResponse { messages: taken? })
    }

    /// Moves ready messages from the head of `source` to the tail of
    /// `destination`, in order. Each moved message gets a new id (the
    /// destination is ordered by id) and, when persistent on a durable
    /// destination, a new record: its put into the destination and its removal
    /// from the source go to the store in one batch, so a crash keeps it in
    /// exactly one of the two. A message whose payload flowed to disk is read
    /// back first (the move waits for it, as basic.get does). Returns once the
    /// last batch is durable.
    pub(crate) async fn move_messages(
        &self,
        request: m::MoveMessagesRequest,
    ) -> Result<m::MoveMessagesResponse, ServiceError> {
        let m::MoveMessagesRequest {
            vhost: vhost_name,
            source,
            destination,
            max_messages,
        } = request;
        if source == destination {
            return Err(ServiceError::InvalidArgument(
                "source and destination are the same queue".into(),
            ));
        }
        let mut progress = MoveProgress::default();
        let remaining = loop {
            match move_round(
                self,
                &vhost_name,
                &source,
                &destination,
                max_messages,
                &mut progress,
            )? {
                MoveRound::Done(remaining) => break remaining,
                MoveRound::Again => {}
                // Dropped if the queue goes: the next round says so.
                MoveRound::Wait(payload) => {
                    let _ = payload.await;
                }
            }
        };
        let MoveProgress {
            moved,
            stopped_reason,
            last_write,
            ..
        } = progress;
        tracing::info!(vhost = %vhost_name, %source, %destination, moved, "messages moved by management");
        if let Some(written) = last_write {
            written
                .await
                .map_err(|_| ServiceError::Unavailable("the self is shutting down".into()))?
                .map_err(|failure| ServiceError::ResourceExhausted(failure.to_string()))?;
        }
        Ok(m::MoveMessagesResponse {
            moved,
            remaining,
            stopped_reason,
        })
    }
}

/// AMQP basic properties from management's.
fn amqp_properties(
    properties: &m::MessageProperties,
) -> Result<amq_protocol::protocol::basic::AMQPProperties, ServiceError> {
    use amq_protocol::protocol::basic::AMQPProperties;
    let mut out = AMQPProperties::default();
    let text = |value: &str| ShortString::from(value.to_string());
    if !properties.headers.is_empty() {
        let mut table = FieldTable::default();
        for (key, value) in &properties.headers {
            if key.len() > 255 {
                return Err(ServiceError::InvalidArgument(
                    "a header name is at most 255 bytes".into(),
                ));
            }
            let value = match &value.value {
                Some(argument_value::Value::StringValue(v))
                | Some(argument_value::Value::Text(v)) => AMQPValue::LongString(v.clone().into()),
                Some(argument_value::Value::IntValue(v)) => AMQPValue::LongLongInt(*v),
                Some(argument_value::Value::BoolValue(v)) => AMQPValue::Boolean(*v),
                Some(argument_value::Value::DoubleValue(v)) => AMQPValue::Double(*v),
                None => AMQPValue::Void,
            };
            table.insert(ShortString::from(key.clone()), value);
        }
        out = out.with_headers(table);
    }
    if properties.delivery_mode != 0 {
        let mode = u8::try_from(properties.delivery_mode)
            .ok()
            .filter(|mode| *mode <= 2)
            .ok_or_else(|| ServiceError::InvalidArgument("delivery_mode must be 1 or 2".into()))?;
        out = out.with_delivery_mode(mode);
    }
    if let Some(priority) = properties.priority {
        let priority = u8::try_from(priority)
            .map_err(|_| ServiceError::InvalidArgument("priority must be 0 to 255".into()))?;
        out = out.with_priority(priority);
    }
    for (value, set) in [
        (
            &properties.content_type,
            AMQPProperties::with_content_type as fn(AMQPProperties, ShortString) -> AMQPProperties,
        ),
        (
            &properties.content_encoding,
            AMQPProperties::with_content_encoding,
        ),
        (
            &properties.correlation_id,
            AMQPProperties::with_correlation_id,
        ),
        (&properties.reply_to, AMQPProperties::with_reply_to),
        (&properties.expiration, AMQPProperties::with_expiration),
        (&properties.message_id, AMQPProperties::with_message_id),
        (&properties.r#type, AMQPProperties::with_type),
        (&properties.user_id, AMQPProperties::with_user_id),
        (&properties.app_id, AMQPProperties::with_app_id),
    ] {
        if !value.is_empty() {
            if value.len() > 255 {
                return Err(ServiceError::InvalidArgument(
                    "a property's text is at most 255 bytes".into(),
                ));
            }
            out = set(out, text(value));
        }
    }
    if let Some(timestamp) = properties.timestamp {
        out = out.with_timestamp(timestamp);
    }
    Ok(out)
}

/// The first of `messages` that fit into [`BATCH_BYTES`] encoded (at least
/// one): a peek answer must fit into one gRPC message, so a peek of large
/// messages returns fewer than asked.
/// The properties management shows of a message, from their AMQP
/// encoding; `persistent` from the delivery mode when `set_persistent`.
fn show_properties(peeked: &mut m::PeekedMessage, properties: &[u8]) {
    let Ok((_, properties)) = amq_protocol::protocol::basic::parse_properties(properties) else {
        return;
    };
    let text = |s: &Option<ShortString>| {
        s.as_ref()
            .map(|s| s.as_str().to_string())
            .unwrap_or_default()
    };
    peeked.content_type = text(properties.content_type());
    peeked.content_encoding = text(properties.content_encoding());
    peeked.message_id = text(properties.message_id());
    peeked.correlation_id = text(properties.correlation_id());
    if let Some(headers) = properties.headers() {
        peeked.headers = argument_map(headers);
    }
}

/// The longest a get waits for a message's body to come back from the
/// store before it answers with what it has.
const GET_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

async fn take_messages(
    engine: &Engine,
    session: SessionId,
    request: &m::GetMessagesRequest,
    count: usize,
) -> Result<Vec<m::PeekedMessage>, ServiceError> {
    let get = pb::Get {
        request_id: 0,
        channel: CHANNEL,
        queue: request.queue.clone(),
        no_ack: !request.reject,
    };
    let mut messages = Vec::new();
    let mut bytes = 0usize;
    while messages.len() < count && bytes < BATCH_BYTES / 2 {
        let outcome = {
            let mut broker = engine.shared.broker.lock();
            let outcome = broker.get(session, &get, true).map_err(service_error)?;
            if let (GetOutcome::Got(ok), true) = (&outcome, request.reject) {
                broker
                    .nack(
                        session,
                        &pb::Nack {
                            channel: CHANNEL,
                            delivery_tag: ok.delivery_tag,
                            multiple: false,
                            requeue: false,
                        },
                    )
                    .map_err(service_error)?;
            }
            outcome
        };
        let ok = match outcome {
            GetOutcome::Got(ok) => ok,
            GetOutcome::Empty => break,
            GetOutcome::Wait(wait) | GetOutcome::WaitForCredit(wait) => {
                if tokio::time::timeout(GET_WAIT, wait).await.is_err() {
                    break;
                }
                continue;
            }
        };
        let body_size = ok.body_size;
        let body = ok
            .body()
            .decode(engine.shared.max_message_size)
            .unwrap_or_else(|error| {
                tracing::warn!(vhost = %request.vhost, queue = %request.queue, %error, "taken message body does not decode");
                Bytes::new()
            });
        bytes += body.len();
        let mut taken = m::PeekedMessage {
            position: messages.len() as u64,
            redelivered: ok.redelivered,
            body_size,
            body,
            ..Default::default()
        };
        show_properties(&mut taken, &ok.properties);
        if let Ok((_, properties)) =
            amq_protocol::protocol::basic::parse_properties(&ok.properties[..])
        {
            taken.persistent = *properties.delivery_mode() == Some(2);
        }
        taken.exchange = ok.exchange;
        taken.routing_key = ok.routing_key;
        let last = ok.message_count == 0;
        messages.push(taken);
        if last {
            break;
        }
    }
    Ok(messages)
}

fn within_batch_bytes(mut messages: Vec<m::PeekedMessage>) -> Vec<m::PeekedMessage> {
    let mut bytes = 0;
    let keep = messages
        .iter()
        .position(|message| {
            bytes += prost::Message::encoded_len(message);
            bytes > BATCH_BYTES
        })
        .map_or(messages.len(), |over| over.max(1));
    messages.truncate(keep);
    messages
}

#[derive(Default)]
struct MoveProgress {
    moved: u64,
    wanted: Option<u64>,
    stopped_reason: String,
    last_write: Option<oneshot::Receiver<crate::persistence::WriteOutcome>>,
}

enum MoveRound {
    /// Finished: this many ready messages are left in the source.
    Done(u64),
    /// The source's head is on disk: wait for it, then go on.
    Wait(oneshot::Receiver<()>),
    /// This round's batch is full (`BATCH_BYTES`): go on with the next.
    Again,
}

/// One round of a move, under the lock: moves resident messages from the
/// head until done, full, or the head's payload is on disk.
fn move_round(
    engine: &Engine,
    vhost_name: &str,
    source: &str,
    destination: &str,
    max_messages: u64,
    progress: &mut MoveProgress,
) -> Result<MoveRound, ServiceError> {
    let mut broker = engine.shared.broker.lock();
    let vhost = vhost(&broker, vhost_name)?;
    for name in [source, destination] {
        let queue = vhost
            .queues
            .get(name)
            .ok_or_else(|| not_found("queue", name, vhost_name))?;
        not_exclusive(queue, vhost_name)?;
    }
    // Its head is not in yet: moving would take later messages first.
    if vhost.queues.get(source).is_some_and(|q| q.recovering) {
        return Err(service_error(crate::broker::still_recovering(
            source, vhost_name,
        )));
    }
    let available = vhost
        .queues
        .get(source)
        .map_or(0, |q| q.messages.len() as u64);
    let wanted = *progress.wanted.get_or_insert(if max_messages == 0 {
        available
    } else {
        max_messages.min(available)
    });
    let budget = broker.budget.clone();
    let Broker {
        vhosts,
        shared_refs,
        ..
    } = &mut *broker;
    let queues = &mut vhosts
        .get_mut(vhost_name)
        .ok_or_else(|| not_found("vhost", vhost_name, vhost_name))?
        .queues;
    let mut ops: Vec<WriteOp> = Vec::new();
    let mut wait_for_payload = None;
    let mut batch: Vec<QueuedMessage> = Vec::new();
    let mut batch_full = false;
    // The destination's room, checked as if each moved message were there.
    let mut target = queues
        .remove(destination)
        .ok_or_else(|| not_found("queue", destination, vhost_name))?;
    if let Some(from) = queues.get_mut(source) {
        let source_stores = from.stores_messages();
        while progress.moved + (batch.len() as u64) < wanted {
            let Some(front) = from.messages.front() else {
                break;
            };
            if front.message.is_none() {
                let (waiter, wait) = oneshot::channel();
                from.get_waiters.push(waiter);
                wait_for_payload = Some(wait);
                break;
            }
            let pending_bytes: u64 = batch.iter().map(|m| m.body_size()).sum();
            // One round's write stays within one gRPC message to a remote
            // storage node; the next round moves the rest.
            if !batch.is_empty() && pending_bytes + front.body_size() > BATCH_BYTES as u64 {
                batch_full = true;
                break;
            }
            let fits_count = target
                .limits
                .max_length
                .is_none_or(|max| target.messages.len() as u64 + (batch.len() as u64) < max);
            let fits_bytes = target
                .limits
                .max_bytes
                .is_none_or(|max| target.ready_bytes + pending_bytes + front.body_size() <= max);
            if !(fits_count && fits_bytes) {
                progress.stopped_reason =
                    format!("queue '{destination}' is full (x-max-length / x-max-length-bytes)");
                break;
            }
            let Some(old) = from.dequeue() else { break };
            crate::broker::flow_to_disk::discard(
                shared_refs,
                vhost_name,
                source,
                source_stores,
                &old,
                &mut ops,
            );
            batch.push(old);
        }
    }
    let remaining = queues.get(source).map_or(0, |q| q.messages.len() as u64);
    let target_stores = target.stores_messages();
    let count = batch.len() as u64;
    let first_id = broker.reserve_message_ids(count);
    for (offset, old) in batch.into_iter().enumerate() {
        let body_size = old.body_size();
        let Some(message) = old.message else { continue };
        let id = first_id + offset as u64;
        let copy = crate::model::Message::new(
            &budget,
            message.exchange.clone(),
            message.routing_key.clone(),
            message.properties.clone(),
            message.body.clone(),
            message.persistent,
        );
        let priority = target.priority_of(&copy.properties);
        if copy.persistent && target_stores {
            ops.push(store_op(write_op::Op::PutMessage(copy.record(id))));
            ops.push(store_op(write_op::Op::PutQueueEntry(store::QueueEntry {
                vhost: vhost_name.to_string(),
                queue: destination.to_string(),
                id,
                body_size,
                redelivered: old.redelivered,
                delivery_count: old.delivery_count,
                expires_at_ms: old.expires_at,
                priority: u32::from(priority),
            })));
            copy.mark_stored(u64::MAX);
        }
        let mut entry = QueuedMessage::resident(id, copy);
        entry.priority = priority;
        entry.redelivered = old.redelivered;
        entry.delivery_count = old.delivery_count;
        // A moved message keeps its expiry.
        entry.expires_at = old.expires_at;
        // Within limits (checked above): nothing is dropped.
        target.enqueue(entry);
    }
    if let Some(vhost) = broker.vhosts.get_mut(vhost_name) {
        vhost.insert_queue(target);
    }
    broker.reschedule_expiry(vhost_name, destination);
    progress.moved += count;
    let (done, written) = oneshot::channel();
    engine.shared.writer.submit_synced(ops, Some(done));
    progress.last_write = Some(written);
    broker.dispatch(vhost_name, destination);
    broker.check_underfull(vhost_name, source);
    match wait_for_payload {
        Some(wait) if progress.moved < wanted && progress.stopped_reason.is_empty() => {
            broker.read_ahead(vhost_name, source);
            Ok(MoveRound::Wait(wait))
        }
        _ if batch_full && progress.moved < wanted && progress.stopped_reason.is_empty() => {
            Ok(MoveRound::Again)
        }
        _ => Ok(MoveRound::Done(remaining)),
    }
}

#[cfg(test)]
mod batch_tests {
    use super::*;

    fn peeked(body: usize) -> m::PeekedMessage {
        m::PeekedMessage {
            body: vec![0; body].into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_peek_answer_stops_at_the_batch_budget_but_keeps_one_message() {
        let mb = 1 << 20;
        let kept = within_batch_bytes(vec![peeked(6 * mb), peeked(6 * mb), peeked(6 * mb)]);
        assert_eq!(kept.len(), 2);
        let kept = within_batch_bytes(vec![peeked(20 * mb), peeked(1)]);
        assert_eq!(kept.len(), 1);
        let kept = within_batch_bytes((0..10).map(|_| peeked(10)).collect());
        assert_eq!(kept.len(), 10);
    }
}
