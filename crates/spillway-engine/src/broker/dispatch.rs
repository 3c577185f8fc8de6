//! Consumers and deliveries: consume, cancel and qos, handing ready messages
//! to consumers with room (round robin, within the gateway's credit), the
//! gateway's report of deliveries written, and basic.get.

use rand::distr::{Alphanumeric, SampleString};
use spillway_amqp::{self as amqp, reply_code};
use spillway_proto::engine::{self as pb, session_event::Event, AmqpError};
use spillway_proto::storage::Durability;
use tokio::sync::oneshot;

use super::arguments::consumer_priority;
use super::direct_reply;
use super::{check_exclusive, event, find_queue_mut, Broker, OpResult};
use crate::broker::flow_to_disk::discard;
use crate::channels::*;
use crate::model::*;

/// What basic.get found.
pub enum GetOutcome {
    Got(pb::GetOk),
    Empty,
    /// The head's payload is being read back from the store: ask again once
    /// this fires.
    Wait(oneshot::Receiver<()>),
    /// The session's delivery credit is spent: ask again once the gateway
    /// reports deliveries written (this fires then). A get-ok carries a
    /// body to the socket as a delivery does, so it is bounded the same way.
    WaitForCredit(oneshot::Receiver<()>),
}

impl Broker {
    pub fn consume(&mut self, session: SessionId, cmd: &pb::Consume) -> OpResult<String> {
        let vhost_name = self.session_vhost(session)?;
        let arguments = amqp::decode_table(&cmd.arguments)?;
        let priority = consumer_priority(&arguments)?;
        let tag = if cmd.consumer_tag.is_empty() {
            format!(
                "amq.ctag-{}",
                Alphanumeric.sample_string(&mut rand::rng(), 22)
            )
        } else {
            cmd.consumer_tag.clone()
        };
        let channel = self.channel_mut(session, cmd.channel)?;
        let reply_tag = channel.direct_reply.as_ref().map(|c| c.tag.as_str());
        if channel.consumers.contains_key(&tag) || reply_tag == Some(tag.as_str()) {
            return Err(AmqpError::new(
                reply_code::NOT_ALLOWED,
                format!("attempt to reuse consumer tag '{tag}'"),
            ));
        }
        if cmd.queue == direct_reply::PSEUDO_QUEUE {
            return self.consume_direct_reply(session, cmd, tag);
        }
        let prefetch = channel.consumer_prefetch;
        let pacing = self.pacing;
        let vhost = self.vhost_mut(&vhost_name)?;
        let queue = find_queue_mut(vhost, &cmd.queue, &vhost_name)?;
        check_exclusive(queue, session, &vhost_name)?;
        if queue.exclusive_consumer || (cmd.exclusive && !queue.consumers.is_empty()) {
            return Err(AmqpError::new(
                reply_code::ACCESS_REFUSED,
                format!(
                    "queue '{}' in vhost '{}' in exclusive use",
                    cmd.queue, vhost_name
                ),
            ));
        }
        queue.exclusive_consumer = cmd.exclusive;
        if queue.consumers.is_empty() {
            // Pacing starts with a full window, whatever the queue holds.
            queue.pacing.reset(&pacing);
        }
        queue.had_consumers = true;
        let consumer = ConsumerRef {
            session,
            channel: cmd.channel,
            tag: tag.clone(),
            priority,
        };
        // By priority, highest first, arrivals last among equals; a single
        // active consumer queue keeps arrival order (the first is active).
        let position = if queue.single_active_consumer {
            queue.consumers.len()
        } else {
            queue.consumers.partition_point(|c| c.priority >= priority)
        };
        queue.consumers.insert(position, consumer);
        let channel = self.channel_mut(session, cmd.channel)?;
        channel.consumers.insert(
            tag.clone(),
            Consumer {
                queue: cmd.queue.clone(),
                no_ack: cmd.no_ack,
                prefetch,
                unacked: 0,
                credit: cmd.credit_limited.then(CreditWindow::default),
            },
        );
        Ok(tag)
    }

    pub fn cancel(&mut self, session: SessionId, cmd: &pb::Cancel) -> OpResult<()> {
        let vhost_name = self.session_vhost(session)?;
        if self.cancel_direct_reply(session, cmd.channel, &cmd.consumer_tag) {
            return Ok(());
        }
        let channel = self.channel_mut(session, cmd.channel)?;
        let Some(consumer) = channel.consumers.remove(&cmd.consumer_tag) else {
            return Ok(());
        };
        self.detach_consumer(
            &vhost_name,
            &consumer.queue,
            session,
            cmd.channel,
            &cmd.consumer_tag,
        );
        self.auto_delete_if_unused(&vhost_name, &consumer.queue);
        // A waiting single active consumer takes over now.
        self.dispatch(&vhost_name, &consumer.queue);
        Ok(())
    }

    pub(super) fn detach_consumer(
        &mut self,
        vhost: &str,
        queue: &str,
        session: SessionId,
        channel: ChannelId,
        tag: &str,
    ) {
        let mut unused = false;
        if let Some(entry) = self.queue_mut_opt(vhost, queue) {
            entry
                .consumers
                .retain(|c| !(c.session == session && c.channel == channel && c.tag == tag));
            if entry.consumers.is_empty() {
                entry.exclusive_consumer = false;
                unused = true;
                // No consumers, no pacing: its publishers go on.
                entry.pacing.wake_all();
            }
        }
        if unused {
            // `x-expires` counts from when the last consumer left.
            self.touch_queue(vhost, queue);
        }
    }

    pub fn qos(&mut self, session: SessionId, cmd: &pb::Qos) -> OpResult<()> {
        let vhost = self.session_vhost(session)?;
        let channel = self.channel_mut(session, cmd.channel)?;
        if cmd.global {
            channel.channel_prefetch = cmd.prefetch_count;
        } else {
            // RabbitMQ's reading (3.x, `rabbit_channel`): a per-consumer
            // qos also lifts the channel-wide limit. Set per consumer first
            // and then global to have both, as its documentation does.
            channel.consumer_prefetch = cmd.prefetch_count;
            channel.channel_prefetch = 0;
        }
        let queues: Vec<String> = channel
            .consumers
            .values()
            .map(|c| c.queue.clone())
            .collect();
        for queue in queues {
            self.dispatch(&vhost, &queue);
        }
        Ok(())
    }

    /// Sets how many deliveries in all a credit-limited consumer may have
    /// had (an AMQP 1.0 link's credit), and hands it what that allows.
    pub fn consumer_credit(
        &mut self,
        session: SessionId,
        cmd: &pb::ConsumerCredit,
    ) -> OpResult<()> {
        let vhost = self.session_vhost(session)?;
        let channel = self.channel_mut(session, cmd.channel)?;
        // Gone meanwhile (cancelled, its queue deleted): nothing to do.
        let Some(consumer) = channel.consumers.get_mut(&cmd.consumer_tag) else {
            return Ok(());
        };
        let Some(credit) = &mut consumer.credit else {
            return Err(AmqpError::new(
                reply_code::PRECONDITION_FAILED,
                format!(
                    "consumer '{}' was not started credit-limited",
                    cmd.consumer_tag
                ),
            ));
        };
        let raised = cmd.delivery_limit > credit.limit;
        credit.limit = cmd.delivery_limit;
        if raised {
            let queue = consumer.queue.clone();
            self.dispatch(&vhost, &queue);
        }
        Ok(())
    }

    /// basic.get. With `overdraw`, answered even when the session's delivery
    /// credit is spent (the caller has waited long enough for it).
    pub fn get(
        &mut self,
        session: SessionId,
        cmd: &pb::Get,
        overdraw: bool,
    ) -> OpResult<GetOutcome> {
        let (now, delivered_at) = (self.clock.unix_millis(), self.clock.now());
        let vhost_name = self.session_vhost(session)?;
        self.channel_mut(session, cmd.channel)?;
        let vhost = self.vhost_mut(&vhost_name)?;
        let queue = find_queue_mut(vhost, &cmd.queue, &vhost_name)?;
        check_exclusive(queue, session, &vhost_name)?;
        if queue.recovering {
            // Answered once its stored messages are in (woken then).
            let (waiter, wait) = oneshot::channel();
            queue.get_waiters.push(waiter);
            return Ok(GetOutcome::Wait(wait));
        }
        // Never an expired message: those at the head go first. And a
        // basic.get is a use of the queue, for `x-expires`.
        let mut touched = Vec::new();
        let mut expired_any = false;
        while self
            .queue_mut_opt(&vhost_name, &cmd.queue)
            .and_then(|queue| queue.messages.front())
            .is_some_and(|head| head.expired(now))
        {
            expired_any = true;
            touched.extend(self.expire_head(&vhost_name, &cmd.queue, now));
        }
        if expired_any {
            self.reschedule_expiry(&vhost_name, &cmd.queue);
            self.dispatch_all(&vhost_name, touched);
        }
        self.touch_queue(&vhost_name, &cmd.queue);
        let vhost = self.vhost_mut(&vhost_name)?;
        let queue = find_queue_mut(vhost, &cmd.queue, &vhost_name)?;
        let head_resident = match queue.messages.front() {
            None => return Ok(GetOutcome::Empty),
            Some(head) => head.message.is_some(),
        };
        if head_resident && !overdraw {
            if let Some(state) = self.sessions.get_mut(&session) {
                if !state.credit.has_room() {
                    let (waiter, wait) = oneshot::channel();
                    state.credit_waiters.push(waiter);
                    return Ok(GetOutcome::WaitForCredit(wait));
                }
            }
        }
        let vhost = self.vhost_mut(&vhost_name)?;
        let queue = find_queue_mut(vhost, &cmd.queue, &vhost_name)?;
        let Some(head) = queue.messages.front() else {
            return Ok(GetOutcome::Empty);
        };
        if head.message.is_none() {
            let (waiter, wait) = oneshot::channel();
            queue.get_waiters.push(waiter);
            self.read_ahead(&vhost_name, &cmd.queue);
            return Ok(GetOutcome::Wait(wait));
        }
        let Some(mut entry) = queue.dequeue() else {
            return Ok(GetOutcome::Empty);
        };
        queue.delivered_total += 1;
        let Some(message) = entry.message.clone() else {
            return Ok(GetOutcome::Empty);
        };
        let message_count = queue.messages.len() as u32;
        let stores = queue.stores_messages();
        if let Some(state) = self.sessions.get_mut(&session) {
            // The gateway writes the body as published (decoded).
            state.credit.spend(message.body.size() as usize);
        }
        let flow_active = self.flow_active;
        let channel = self.channel_mut(session, cmd.channel)?;
        let delivery_tag = channel.take_delivery_tag();
        let get_ok = pb::GetOk {
            delivery_tag,
            redelivered: entry.redelivered,
            exchange: message.exchange.clone(),
            routing_key: message.routing_key.clone(),
            message_count,
            properties: delivered_properties(&message, entry.delivery_count),
            body: message.body.stored().clone(),
            body_encoding: message.body.encoding().wire(),
            body_size: message.body.size(),
        };
        entry.delivery_count = entry.delivery_count.saturating_add(1);
        if cmd.no_ack {
            let mut ops = Vec::new();
            discard(
                &mut self.shared_refs,
                &vhost_name,
                &cmd.queue,
                stores,
                &entry,
                &mut ops,
            );
            self.persist.submit(ops, Durability::Logged, None);
        } else {
            if flow_active {
                crate::broker::flow_to_disk::release_stored_payload(&mut entry);
            }
            channel.unacked.insert(
                delivery_tag,
                Unacked {
                    queue: cmd.queue.clone(),
                    message: entry,
                    consumer_tag: None,
                    delivered_at,
                },
            );
        }
        self.read_ahead(&vhost_name, &cmd.queue);
        self.check_underfull(&vhost_name, &cmd.queue);
        self.reschedule_expiry(&vhost_name, &cmd.queue);
        Ok(GetOutcome::Got(get_ok))
    }

    /// Dispatches the given queues of the session's vhost.
    pub fn dispatch_queues(&mut self, session: SessionId, queues: Vec<String>) {
        if let Ok(vhost) = self.session_vhost(session) {
            self.dispatch_all(&vhost, queues);
        }
    }

    /// The gateway wrote `count` deliveries to its socket.
    pub fn deliveries_written(&mut self, session: SessionId, count: u32) {
        let Some(state) = self.sessions.get_mut(&session) else {
            return;
        };
        if !state.credit.written(count) {
            return;
        }
        for waiter in state.credit_waiters.drain(..) {
            let _ = waiter.send(());
        }
        let vhost = state.vhost.clone();
        let queues: Vec<String> = state
            .channels
            .values()
            .flat_map(|c| c.consumers.values().map(|consumer| consumer.queue.clone()))
            .collect();
        self.dispatch_all(&vhost, queues);
    }

    pub(super) fn dispatch_all(&mut self, vhost: &str, mut queues: Vec<String>) {
        queues.sort();
        queues.dedup();
        for queue in &queues {
            self.dispatch(vhost, queue);
        }
    }

    /// Hands ready messages to consumers with room, round robin. Stops at a
    /// message whose payload is still in the store: read-ahead brings it
    /// back and dispatches again. A head whose time has passed is expired,
    /// never delivered.
    pub fn dispatch(&mut self, vhost_name: &str, queue_name: &str) {
        self.dispatch_at(vhost_name, queue_name, self.clock.unix_millis());
    }

    /// [`Broker::dispatch`] with the clock at `now` (ms since the epoch):
    /// a publish dispatches as of its own enqueue, so that a message with
    /// TTL 0 goes to a consumer that can take it at once.
    pub(super) fn dispatch_at(&mut self, vhost_name: &str, queue_name: &str, now: u64) {
        let mut expired = Vec::new();
        self.dispatch_ready(vhost_name, queue_name, now, &mut expired);
        if !expired.is_empty() {
            let touched = self.let_expired_go(vhost_name, queue_name, expired);
            self.reschedule_expiry(vhost_name, queue_name);
            self.dispatch_all(vhost_name, touched);
        }
    }

    fn dispatch_ready(
        &mut self,
        vhost_name: &str,
        queue_name: &str,
        now: u64,
        expired: &mut Vec<QueuedMessage>,
    ) {
        let delivered_at = self.clock.now();
        let Self {
            vhosts,
            sessions,
            persist,
            shared_refs,
            flow_active,
            unacked_pressure,
            expiry,
            pacing,
            ..
        } = self;
        let flow_active = *flow_active;
        let unacked_pressure = *unacked_pressure;
        let Some(queue) = vhosts
            .get_mut(vhost_name)
            .and_then(|v| v.queues.get_mut(queue_name))
        else {
            return;
        };
        // A recovering queue delivers nothing until its stored messages are
        // in front of what was published meanwhile.
        if queue.consumers.is_empty() || queue.recovering {
            return;
        }
        let mut ops = Vec::new();
        loop {
            while queue.messages.front().is_some_and(|m| m.expired(now)) {
                if let Some(entry) = queue.dequeue() {
                    expired.push(entry);
                }
            }
            if queue.messages.front().is_none_or(|m| m.message.is_none()) {
                break;
            }
            let can_take = |consumer_ref: &ConsumerRef| {
                let Some(session) = sessions.get(&consumer_ref.session) else {
                    return false;
                };
                if !session.credit.has_room() {
                    return false;
                }
                let Some(channel) = session.channels.get(&consumer_ref.channel) else {
                    return false;
                };
                let Some(consumer) = channel.consumers.get(&consumer_ref.tag) else {
                    return false;
                };
                let held_back = unacked_pressure
                    && !consumer.no_ack
                    && channel.unacked.len()
                        >= crate::broker::flow_to_disk::PRESSURE_UNACKED_PER_CHANNEL;
                channel.has_room(consumer) && !held_back
            };
            let chosen = if queue.single_active_consumer {
                queue.consumers.first().is_some_and(can_take).then_some(0)
            } else {
                next_consumer(&queue.consumers, queue.next_consumer, can_take)
            };
            let Some(index) = chosen else {
                break;
            };
            queue.next_consumer = index + 1;
            let consumer_ref = queue.consumers[index].clone();
            let Some(mut entry) = queue.dequeue() else {
                break;
            };
            queue.delivered_total += 1;
            let Some(message) = entry.message.as_ref() else {
                break;
            };
            let Some(session) = sessions.get_mut(&consumer_ref.session) else {
                break;
            };
            // The gateway writes the body as published (decoded).
            session.credit.spend(message.body.size() as usize);
            let Some(channel) = session.channels.get_mut(&consumer_ref.channel) else {
                break;
            };
            let delivery_tag = channel.take_delivery_tag();
            let no_ack = match channel.consumers.get_mut(&consumer_ref.tag) {
                Some(consumer) => {
                    if let Some(credit) = &mut consumer.credit {
                        credit.delivered += 1;
                    }
                    if !consumer.no_ack {
                        consumer.unacked += 1;
                    }
                    consumer.no_ack
                }
                None => true,
            };
            let trace_context = message
                .trace
                .as_deref()
                .map(deliver_trace_context)
                .unwrap_or_default();
            let deliver = pb::Deliver {
                trace_context,
                channel: consumer_ref.channel,
                consumer_tag: consumer_ref.tag.clone(),
                delivery_tag,
                redelivered: entry.redelivered,
                exchange: message.exchange.clone(),
                routing_key: message.routing_key.clone(),
                properties: delivered_properties(message, entry.delivery_count),
                body: message.body.stored().clone(),
                body_encoding: message.body.encoding().wire(),
                body_size: message.body.size(),
            };
            entry.delivery_count = entry.delivery_count.saturating_add(1);
            queue.pacing.delivered(!entry.redelivered, pacing);
            if no_ack {
                let stores = queue.stores_messages();
                discard(
                    shared_refs,
                    vhost_name,
                    queue_name,
                    stores,
                    &entry,
                    &mut ops,
                );
            } else {
                if flow_active {
                    crate::broker::flow_to_disk::release_stored_payload(&mut entry);
                }
                channel.unacked.insert(
                    delivery_tag,
                    Unacked {
                        queue: queue_name.to_string(),
                        message: entry,
                        consumer_tag: Some(consumer_ref.tag.clone()),
                        delivered_at,
                    },
                );
            }
            let _ = session.events.send(event(Event::Deliver(deliver)));
        }
        queue.pacing.wake_if_room(pacing);
        // The new head's expiry, if it has one, is on the timer.
        if let Some(when) = super::expiry::next_check(queue) {
            expiry.schedule(vhost_name, queue, when);
        }
        persist.submit(ops, Durability::Logged, None);
        self.read_ahead(vhost_name, queue_name);
        self.check_underfull(vhost_name, queue_name);
    }
}

/// Which consumer the next message goes to: the highest priority with
/// room, round robin among equals. `consumers` is sorted by priority,
/// highest first; `next` is where the last choice left off (past it, or out
/// of range after consumers left: its group starts from its beginning).
fn next_consumer(
    consumers: &[ConsumerRef],
    next: usize,
    mut can_take: impl FnMut(&ConsumerRef) -> bool,
) -> Option<usize> {
    debug_assert!(
        consumers.windows(2).all(|w| w[0].priority >= w[1].priority),
        "consumers are kept by priority"
    );
    let mut start = 0;
    while start < consumers.len() {
        let priority = consumers[start].priority;
        let len = consumers[start..]
            .iter()
            .take_while(|c| c.priority == priority)
            .count();
        let end = start + len;
        let first = if (start..end).contains(&next) {
            next - start
        } else {
            0
        };
        for step in 0..len {
            let index = start + (first + step) % len;
            if can_take(&consumers[index]) {
                return Some(index);
            }
        }
        start = end;
    }
    None
}

/// The properties a delivery carries: as published the first time, with
/// `x-delivery-count` (the deliveries before this one) after that.
fn delivered_properties(message: &Message, earlier_deliveries: u32) -> bytes::Bytes {
    if earlier_deliveries == 0 {
        message.properties.clone()
    } else {
        super::dead_letter::with_delivery_count(&message.properties, earlier_deliveries)
    }
}

/// The engine's `deliver` span (in the trace of the message's publish) as it
/// hands a message to a consumer, and its context for the gateway.
fn deliver_trace_context(
    publish: &spillway_proto::util::trace::SpanContext,
) -> spillway_proto::util::trace::Carrier {
    let span = tracing::trace_span!(target: spillway_proto::util::trace::TARGET, "deliver");
    spillway_proto::util::trace::set_parent_and_links(&span, publish, &[]);
    spillway_proto::util::trace::carrier(&span)
}
