//! One client connection's session task: applies the gateway's commands in
//! order against the broker and sends replies, deliveries and confirms back
//! as events. Client sessions are admitted against the vhost, user and
//! per-connection limits (`limits.rs`) at connection.open, channel.open and
//! basic.consume; management's internal sessions are not. A session waits
//! (holding up its later commands, and so its client's socket) only where
//! memory is at stake.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesOrdered;
use futures::StreamExt;
use spillway_amqp::{reply_code, MethodId};
use spillway_proto::engine::{
    self as pb, reply, session_command::Command, session_event::Event, AmqpError, Reply,
    SessionCommand, SessionEvent,
};
use spillway_proto::engine::{CommandReceiver, QueuedCommand};
use tokio::sync::{mpsc, oneshot};

use crate::access::{self, SessionAccess};
use crate::broker::{event, GetOutcome, PublishOutcome};
use crate::budget::MemoryBudget;
use crate::model::SessionId;
use crate::shared::Shared;

/// Applies one connection's commands in order until the gateway hangs up,
/// then releases everything the connection held.
pub(crate) async fn run_session(
    shared: Arc<Shared>,
    id: SessionId,
    mut commands: CommandReceiver,
    events: mpsc::UnboundedSender<SessionEvent>,
) {
    let mut session = Session {
        shared: shared.clone(),
        id,
        events,
        opened: false,
        confirms: FuturesOrdered::new(),
        deferred: VecDeque::new(),
        synced_reply: None,
        access: None,
        paced_on: None,
    };
    loop {
        if let Some(queued) = session.deferred.pop_front() {
            // Its bytes stay counted in the command queue's bound until now.
            let (command, _bytes) = queued.into_parts();
            session.apply(command, &mut commands).await;
            continue;
        }
        tokio::select! {
            command = commands.recv() => {
                let Some(command) = command else { break };
                session.apply(command, &mut commands).await;
            }
            Some((channel, seq, ack)) = session.confirms.next(), if !session.confirms.is_empty() => {
                session.send(Event::Confirm(pb::Confirm { channel, seq, ack }));
            }
        }
    }
    // Confirms still waiting for the disk cannot be delivered any more.
    shared.broker.lock().close_session(id);
    tracing::debug!(session = id, "session closed");
}

/// A publisher confirm once its write is settled: channel, sequence number,
/// and ack (written) or nack (the store failed it).
type ConfirmFuture = std::pin::Pin<Box<dyn std::future::Future<Output = (u32, u64, bool)> + Send>>;

/// A reply held back until the write it reports is on disk (durable
/// declare-ok, bind-ok, commit-ok).
struct SyncedReply {
    request_id: u64,
    result: Result<reply::Result, AmqpError>,
    seq: u64,
    /// What the client is told the store failed, after the failure.
    unsure: &'static str,
}

struct Session {
    shared: Arc<Shared>,
    id: SessionId,
    events: mpsc::UnboundedSender<SessionEvent>,
    opened: bool,
    confirms: FuturesOrdered<ConfirmFuture>,
    /// Commands received while a basic.get waited for delivery credit, to
    /// apply in order once it is answered. They keep their bytes in the
    /// command queue's bound, so the gateway stops reading the client.
    deferred: VecDeque<QueuedCommand>,
    /// A durable definition's reply, held until its write is synced.
    synced_reply: Option<SyncedReply>,
    /// The user's permissions in the session's vhost, once opened.
    access: Option<SessionAccess>,
    /// The queue whose publisher pacing credit the last command spent:
    /// waited on before the next command (`broker/pacing.rs`).
    paced_on: Option<String>,
}

/// How long a basic.get waits for delivery credit before it is answered
/// beyond it. A client that reads nothing gets one answer per second this
/// way at most; one that reads but queues commands behind its get is not
/// stalled for good.
const GET_CREDIT_WAIT: Duration = Duration::from_secs(1);

/// What a basic.get waits for before it can be answered.
enum GetWait {
    /// The head message's payload, being read back from the store.
    Loaded(oneshot::Receiver<()>),
    /// Room in the delivery credit.
    Credit(oneshot::Receiver<()>),
}

impl Session {
    fn send(&self, body: Event) {
        let _ = self.events.send(event(body));
    }

    fn reply(&self, request_id: u64, result: Result<reply::Result, AmqpError>) {
        let result = match result {
            Ok(result) => result,
            Err(error) => reply::Result::Error(error),
        };
        self.send(Event::Reply(Reply {
            request_id,
            result: Some(result),
        }));
    }

    fn ok(&self, request_id: u64, result: Result<(), AmqpError>) {
        self.reply(request_id, result.map(|()| reply::Result::Ok(pb::Empty {})));
    }

    /// Applies one command. Waits (holding up this session's later
    /// commands, and so its socket) only where memory is at stake: a publish
    /// while the store is behind on spilled payloads, a basic.get whose
    /// message is being read back; and after a publish (or commit) that
    /// spent a queue's publisher pacing credit.
    async fn apply(&mut self, command: SessionCommand, commands: &mut CommandReceiver) {
        self.apply_command(command, commands).await;
        if let Some(queue) = self.paced_on.take() {
            self.wait_for_pacing(queue, commands).await;
        }
    }

    async fn apply_command(&mut self, command: SessionCommand, commands: &mut CommandReceiver) {
        let Some(command) = command.command else {
            return;
        };
        if let Err(refusal) = self.check_access(&command) {
            self.refuse(&command, refusal);
            return;
        }
        match command {
            // The remote boundary unpacks the gateway's batches
            // (`serve_remote_session`) and the in-process gateway sends none:
            // a batch here came inside another one.
            Command::Batch(_) => {
                tracing::warn!(session = self.id, "nested command batch, ignored");
            }
            Command::Publish(cmd) => {
                wait_for_spill_room(self.shared.budget.clone()).await;
                // The store writer's queue is bounded: a publisher waits
                // for room (and its socket with it).
                self.shared.writer.wait_for_room().await;
                self.apply_now(Command::Publish(cmd));
            }
            Command::Get(cmd) => self.get(cmd, commands).await,
            // Both count (or need) every message the queue holds.
            Command::QueuePurge(cmd) => {
                wait_for_recovery(&self.shared, self.id, &cmd.queue).await;
                self.apply_now(Command::QueuePurge(cmd));
                self.send_synced_reply().await;
            }
            Command::QueueDelete(cmd) => {
                wait_for_recovery(&self.shared, self.id, &cmd.queue).await;
                self.apply_now(Command::QueueDelete(cmd));
                self.send_synced_reply().await;
            }
            command => {
                self.apply_now(command);
                self.send_synced_reply().await;
            }
        }
    }

    /// A durable definition's reply goes out once the definition is synced;
    /// a store that refuses it gets the client a 506 naming the failure.
    async fn send_synced_reply(&mut self) {
        let Some(deferred) = self.synced_reply.take() else {
            return;
        };
        let result = match self.shared.writer.wait_written(deferred.seq).await {
            Ok(()) => deferred.result,
            Err(failure) => Err(AmqpError::new(
                reply_code::RESOURCE_ERROR,
                format!("{failure}: {}", deferred.unsure),
            )),
        };
        self.reply(deferred.request_id, result);
    }

    /// Replies to a definition command, or defers the reply until the store
    /// has what it wrote (a write submitted since `before`).
    fn reply_synced(
        &mut self,
        request_id: u64,
        result: Result<reply::Result, AmqpError>,
        before: u64,
    ) {
        self.reply_when_written(
            request_id,
            result,
            before,
            "the durable definition may not be stored",
        );
    }

    /// Replies, or defers the reply until the store has what was submitted
    /// since `before`; `unsure` says what a store failure leaves uncertain.
    fn reply_when_written(
        &mut self,
        request_id: u64,
        result: Result<reply::Result, AmqpError>,
        before: u64,
        unsure: &'static str,
    ) {
        let seq = self.shared.writer.last_submitted();
        if result.is_err() || seq == before {
            self.reply(request_id, result);
            return;
        }
        debug_assert!(self.synced_reply.is_none(), "one deferred reply at a time");
        self.synced_reply = Some(SyncedReply {
            request_id,
            result,
            seq,
            unsure,
        });
    }

    /// A durable definition cannot be stored while the store is failed.
    fn refuse_durable(&self, durable: bool) -> Result<(), AmqpError> {
        match self.shared.writer.failure() {
            Some(failure) if durable => Err(AmqpError::new(
                reply_code::RESOURCE_ERROR,
                format!("{failure}: durable definitions are refused until it clears"),
            )),
            _ => Ok(()),
        }
    }

    async fn get(&mut self, cmd: pb::Get, commands: &mut CommandReceiver) {
        let mut overdraw = false;
        loop {
            match self.try_get(&cmd, overdraw) {
                None => return,
                // Dropped when the queue goes: ask again, and hear why.
                Some(GetWait::Loaded(loaded)) => {
                    let _ = loaded.await;
                }
                Some(GetWait::Credit(room)) => {
                    match tokio::time::timeout(
                        GET_CREDIT_WAIT,
                        self.wait_for_credit(room, commands),
                    )
                    .await
                    {
                        Ok(true) => {}
                        Ok(false) => return,
                        // The reports that would make room may be queued
                        // behind this client's own later commands, held in
                        // `deferred` and blocking the queue: answer anyway
                        // rather than stall the connection.
                        Err(_) => overdraw = true,
                    }
                }
            }
        }
    }

    /// Answers a basic.get, or says what it must wait for.
    fn try_get(&self, cmd: &pb::Get, overdraw: bool) -> Option<GetWait> {
        let mut broker = self.shared.broker.lock();
        let result = match broker.get(self.id, cmd, overdraw) {
            Ok(GetOutcome::Got(get_ok)) => Ok(reply::Result::GetOk(get_ok)),
            Ok(GetOutcome::Empty) => Ok(reply::Result::GetEmpty(pb::Empty {})),
            Ok(GetOutcome::Wait(loaded)) => return Some(GetWait::Loaded(loaded)),
            Ok(GetOutcome::WaitForCredit(room)) => return Some(GetWait::Credit(room)),
            Err(error) => Err(error),
        };
        // Answered under the lock: a get-ok is charged to the delivery
        // credit, whose sizes must be in the order the gateway receives
        // deliveries, and consumers' deliveries are sent under the lock too.
        self.reply(cmd.request_id, result);
        None
    }

    /// Waits for delivery credit. The gateway reports deliveries written
    /// on the same command queue, so those are applied meanwhile; anything
    /// else waits its turn in `deferred`. False when the gateway is gone.
    async fn wait_for_credit(
        &mut self,
        mut room: oneshot::Receiver<()>,
        commands: &mut CommandReceiver,
    ) -> bool {
        loop {
            tokio::select! {
                woken = &mut room => return woken.is_ok(),
                queued = commands.recv_queued() => {
                    let Some(queued) = queued else { return false };
                    self.take_while_waiting(queued, false);
                }
            }
        }
    }

    /// A command that arrived while this session waits: the gateway's
    /// report of deliveries written is applied at once (it is not the
    /// client's, and it is what frees delivery credit); with `settles`,
    /// so are acks, nacks, rejects and an AMQP 1.0 consumer's credit (the
    /// client's receiving side) as long as nothing was deferred
    /// before them (a paced publisher's consumers must go on acking, and
    /// the client's order is kept). Anything else waits in `deferred`.
    fn take_while_waiting(&mut self, queued: QueuedCommand, settles: bool) {
        let now = match queued.command().command {
            Some(Command::DeliveriesWritten(_)) => true,
            Some(Command::Ack(_) | Command::Nack(_) | Command::ConsumerCredit(_)) => {
                settles && self.deferred.is_empty()
            }
            _ => false,
        };
        if !now {
            self.deferred.push_back(queued);
            return;
        }
        let (command, _bytes) = queued.into_parts();
        if let Some(command) = command.command {
            self.apply_now(command);
        }
    }

    /// Publisher pacing: the last publish (or commit) spent the last of
    /// `queue`'s credit. Waits until its deliveries earned enough back, it
    /// lost its consumers, or it delivered nothing for a stall period (then
    /// pacing is suspended for it). Meanwhile confirms go out, and acks and
    /// delivery reports are applied (`take_while_waiting`), so a connection
    /// that publishes and consumes goes on acking.
    async fn wait_for_pacing(&mut self, queue: String, commands: &mut CommandReceiver) {
        let started = std::time::Instant::now();
        let mut waited = false;
        let mut stalled = false;
        'wait: loop {
            let wait = self.shared.broker.lock().pacing_wait(self.id, &queue);
            let Some(wait) = wait else { break };
            waited = true;
            let mut room = wait.room;
            let timer = tokio::time::sleep(wait.stall);
            tokio::pin!(timer);
            loop {
                tokio::select! {
                    // Woken (or the queue went): look again.
                    _ = &mut room => continue 'wait,
                    () = &mut timer => {
                        let gone = self
                            .shared
                            .broker
                            .lock()
                            .pacing_stalled(self.id, &queue, wait.deliveries);
                        if gone {
                            stalled = true;
                            break 'wait;
                        }
                        // It delivered, slowly: wait on.
                        continue 'wait;
                    }
                    Some((channel, seq, ack)) = self.confirms.next(), if !self.confirms.is_empty() => {
                        self.send(Event::Confirm(pb::Confirm { channel, seq, ack }));
                    }
                    queued = commands.recv_queued() => {
                        // The gateway is gone: the session ends next.
                        let Some(queued) = queued else { break 'wait };
                        self.take_while_waiting(queued, true);
                    }
                }
            }
        }
        if waited {
            let elapsed = started.elapsed();
            self.shared.broker.lock().pacing_waited(elapsed);
            tracing::debug!(
                session = self.id,
                queue = %queue,
                waited_us = elapsed.as_micros() as u64,
                stalled,
                "publisher paced"
            );
        }
    }

    /// Applies a command that never waits, under the broker lock.
    fn apply_now(&mut self, command: Command) {
        let id = self.id;
        if let Command::Open(open) = &command {
            let (permissions, generation) = {
                let access = self.shared.access.read();
                (
                    access.permissions(&open.user, &open.vhost),
                    access.generation(),
                )
            };
            let mut broker = self.shared.broker.lock();
            let result = match &permissions {
                // RabbitMQ's answer to a user without permissions there.
                None if broker.vhosts.contains_key(&open.vhost) => Err(AmqpError::new(
                    reply_code::NOT_ALLOWED,
                    format!(
                        "access to vhost '{}' refused for user '{}'",
                        open.vhost, open.user
                    ),
                )),
                _ => broker
                    .admit_session(open)
                    .and_then(|()| broker.open_session(id, open, self.events.clone())),
            };
            drop(broker);
            self.opened = result.is_ok();
            if let (true, Some(permissions)) = (self.opened, permissions) {
                self.access = Some(SessionAccess::new(
                    &open.user,
                    &open.vhost,
                    permissions,
                    generation,
                ));
            }
            self.ok(open.request_id, result);
            return;
        }
        if !self.opened {
            tracing::warn!(
                session = id,
                "command before the session was opened, ignored"
            );
            return;
        }
        // A handle of its own: the reply to a durable definition is kept
        // on `self` while the lock is held.
        let shared = self.shared.clone();
        let mut broker = shared.broker.lock();
        if let Some(state) = broker.sessions.get_mut(&id) {
            match &command {
                Command::Publish(_) => state.published += 1,
                Command::DeliveriesWritten(cmd) => state.delivered += u64::from(cmd.count),
                _ => {}
            }
        }
        match command {
            Command::Open(_) | Command::Batch(_) | Command::Get(_) => {
                debug_assert!(false, "handled by Session::apply");
            }
            Command::ChannelOpen(cmd) => {
                let result = broker
                    .admit_channel(id)
                    .and_then(|()| broker.open_channel(id, cmd.channel, cmd.amqp1_link));
                self.ok(cmd.request_id, result)
            }
            Command::ChannelClose(cmd) => {
                broker.close_channel(id, cmd.channel);
                self.ok(cmd.request_id, Ok(()));
            }
            Command::ExchangeDeclare(cmd) => {
                let before = self.shared.writer.last_submitted();
                let result = self
                    .refuse_durable(cmd.durable && !cmd.passive)
                    .and_then(|()| broker.declare_exchange(id, &cmd))
                    .map(|()| reply::Result::Ok(pb::Empty {}));
                self.reply_synced(cmd.request_id, result, before);
            }
            Command::ExchangeDelete(cmd) => {
                let before = self.shared.writer.last_submitted();
                let result = broker
                    .delete_exchange(id, &cmd)
                    .map(|()| reply::Result::Ok(pb::Empty {}));
                self.reply_synced(cmd.request_id, result, before);
            }
            Command::QueueDeclare(cmd) => {
                let before = self.shared.writer.last_submitted();
                let result = self
                    .refuse_durable(cmd.durable && !cmd.passive)
                    .and_then(|()| broker.declare_queue(id, &cmd))
                    .map(reply::Result::QueueDeclareOk);
                self.reply_synced(cmd.request_id, result, before);
            }
            Command::QueueBind(cmd) => {
                let before = self.shared.writer.last_submitted();
                let result = broker
                    .bind_queue(id, &cmd)
                    .map(|()| reply::Result::Ok(pb::Empty {}));
                self.reply_synced(cmd.request_id, result, before);
            }
            Command::QueueUnbind(cmd) => {
                let before = self.shared.writer.last_submitted();
                let result = broker
                    .unbind_queue(id, &cmd)
                    .map(|()| reply::Result::Ok(pb::Empty {}));
                self.reply_synced(cmd.request_id, result, before);
            }
            Command::ExchangeBind(cmd) => {
                let before = self.shared.writer.last_submitted();
                let result = broker
                    .bind_exchange(id, &cmd)
                    .map(|()| reply::Result::Ok(pb::Empty {}));
                self.reply_synced(cmd.request_id, result, before);
            }
            Command::ExchangeUnbind(cmd) => {
                let before = self.shared.writer.last_submitted();
                let result = broker
                    .unbind_exchange(id, &cmd)
                    .map(|()| reply::Result::Ok(pb::Empty {}));
                self.reply_synced(cmd.request_id, result, before);
            }
            // A deleted, unbound or purged durable definition stays so
            // after a crash: the answer waits for the synced write.
            Command::QueuePurge(cmd) => {
                let before = self.shared.writer.last_submitted();
                let result = broker.purge_queue(id, &cmd).map(count_ok);
                self.reply_synced(cmd.request_id, result, before);
            }
            Command::QueueDelete(cmd) => {
                let before = self.shared.writer.last_submitted();
                let result = broker.delete_queue(id, &cmd).map(count_ok);
                self.reply_synced(cmd.request_id, result, before);
            }
            Command::Publish(mut cmd) => {
                let (channel, seq) = (cmd.channel, cmd.confirm_seq);
                let span = tracing::trace_span!(target: spillway_proto::util::trace::TARGET, "publish",
                    exchange = %cmd.exchange, routing_key = %cmd.routing_key);
                spillway_proto::util::trace::set_parent(
                    &span,
                    &std::mem::take(&mut cmd.trace_context),
                );
                let outcome = span.in_scope(|| broker.publish(id, cmd));
                broker.check_memory_ceiling();
                self.paced_on = broker.take_paced(id);
                match outcome {
                    Ok(PublishOutcome::Done) if seq > 0 => {
                        self.send(Event::Confirm(pb::Confirm {
                            channel,
                            seq,
                            ack: true,
                        }));
                    }
                    Ok(PublishOutcome::Done) => {}
                    Ok(PublishOutcome::Rejected) => {
                        self.send(Event::Confirm(pb::Confirm {
                            channel,
                            seq,
                            ack: false,
                        }));
                    }
                    Ok(PublishOutcome::AfterWrite(written)) => {
                        self.confirms.push_back(Box::pin(async move {
                            // A dropped writer means the engine is going
                            // away: nack, the message may not be stored.
                            let ack = matches!(written.await, Ok(Ok(())));
                            (channel, seq, ack)
                        }));
                    }
                    Err(error) => self.send_async_error(channel, error, MethodId::BASIC_PUBLISH),
                }
            }
            Command::Consume(cmd) => {
                let result = broker
                    .admit_consumer(id)
                    .and_then(|()| broker.consume(id, &cmd));
                let started = result.is_ok();
                self.reply(
                    cmd.request_id,
                    result.map(|consumer_tag| {
                        reply::Result::ConsumeOk(pb::ConsumeOk { consumer_tag })
                    }),
                );
                if started {
                    // Deliveries only after consume-ok, as clients expect.
                    broker.dispatch_queues(id, vec![cmd.queue]);
                }
            }
            Command::Cancel(cmd) => self.ok(cmd.request_id, broker.cancel(id, &cmd)),
            Command::Ack(cmd) => {
                if let Err(error) = broker.ack(id, &cmd) {
                    self.send_async_error(cmd.channel, error, MethodId::BASIC_ACK);
                }
            }
            Command::Nack(cmd) => {
                if let Err(error) = broker.nack(id, &cmd) {
                    self.send_async_error(cmd.channel, error, MethodId::BASIC_NACK);
                }
            }
            Command::Recover(cmd) => match broker.recover(id, &cmd) {
                Ok(queues) => {
                    self.ok(cmd.request_id, Ok(()));
                    broker.dispatch_queues(id, queues);
                }
                Err(error) => self.ok(cmd.request_id, Err(error)),
            },
            Command::Qos(cmd) => self.ok(cmd.request_id, broker.qos(id, &cmd)),
            Command::ConsumerCredit(cmd) => {
                if let Err(error) = broker.consumer_credit(id, &cmd) {
                    self.send_async_error(cmd.channel, error, MethodId::BASIC_CONSUME);
                }
            }
            Command::ConfirmSelect(cmd) => {
                self.ok(cmd.request_id, broker.confirm_select(id, cmd.channel))
            }
            Command::DeliveriesWritten(cmd) => broker.deliveries_written(id, cmd.count),
            Command::TxSelect(cmd) => self.ok(cmd.request_id, broker.tx_select(id, cmd.channel)),
            Command::TxCommit(cmd) => {
                // commit-ok once the transaction's one synced batch landed.
                let before = self.shared.writer.last_submitted();
                let result = broker
                    .tx_commit(id, cmd.channel)
                    .map(|()| reply::Result::Ok(pb::Empty {}));
                self.paced_on = broker.take_paced(id);
                self.reply_when_written(
                    cmd.request_id,
                    result,
                    before,
                    "the transaction may not be stored",
                );
            }
            Command::TxRollback(cmd) => match broker.tx_rollback(id, cmd.channel) {
                Ok(queues) => {
                    self.ok(cmd.request_id, Ok(()));
                    // After rollback-ok, as for recover-ok.
                    broker.dispatch_queues(id, queues);
                }
                Err(error) => self.ok(cmd.request_id, Err(error)),
            },
        }
    }

    /// Whether the session's user may do what `command` does (RabbitMQ's
    /// configure/write/read permissions); the refusal is a 403.
    fn check_access(&mut self, command: &Command) -> Result<(), AmqpError> {
        let checks = access::required(command);
        if checks.iter().all(Option::is_none) {
            return Ok(());
        }
        let Some(session_access) = self.access.as_mut() else {
            return Ok(());
        };
        let generation = self
            .shared
            .access_generation
            .load(std::sync::atomic::Ordering::Acquire);
        let shared = &self.shared;
        let mut check = |kind, resource, name: &str| {
            session_access
                .check(kind, resource, name, generation, |user, vhost| {
                    shared.access.read().permissions(user, vhost)
                })
                .map_err(|text| AmqpError::new(reply_code::ACCESS_REFUSED, text))
        };
        for (kind, resource, name) in checks.into_iter().flatten() {
            check(kind, resource, name)?;
        }
        for need in access::argument_requirements(command) {
            check(need.access, need.resource, &need.name)?;
        }
        Ok(())
    }

    /// Answers a command the user may not run: its reply is the error, or
    /// (publish) the channel is closed with it.
    fn refuse(&self, command: &Command, error: AmqpError) {
        let request_id = match command {
            Command::Publish(cmd) => {
                self.send_async_error(cmd.channel, error, MethodId::BASIC_PUBLISH);
                return;
            }
            Command::Consume(cmd) => cmd.request_id,
            Command::Get(cmd) => cmd.request_id,
            Command::QueuePurge(cmd) => cmd.request_id,
            Command::QueueDelete(cmd) => cmd.request_id,
            Command::QueueDeclare(cmd) => cmd.request_id,
            Command::ExchangeDeclare(cmd) => cmd.request_id,
            Command::ExchangeDelete(cmd) => cmd.request_id,
            Command::QueueBind(cmd) | Command::QueueUnbind(cmd) => cmd.request_id,
            Command::ExchangeBind(cmd) | Command::ExchangeUnbind(cmd) => cmd.request_id,
            _ => {
                debug_assert!(false, "a refused command without a reply: {command:?}");
                return;
            }
        };
        self.reply(request_id, Err(error));
    }

    /// Methods without a reply (publish, ack, nack) report failure as a
    /// channel error: the gateway closes the channel with it.
    fn send_async_error(&self, channel: u32, error: AmqpError, method: MethodId) {
        self.send(Event::ChannelError(pb::ChannelError {
            channel,
            error: Some(error.on(method)),
        }));
    }
}

/// Holds a publisher while the store is behind on spilled payloads.
/// Waits while the session's queue is still loading its stored messages at
/// start-up (`crate::recovery`).
async fn wait_for_recovery(shared: &Shared, session: SessionId, queue: &str) {
    loop {
        // The lock's guard must not live across the await below.
        let wait = shared.broker.lock().recovery_wait(session, queue);
        let Some(recovered) = wait else {
            return;
        };
        // Dropped if the queue goes meanwhile: look again.
        let _ = recovered.await;
    }
}

async fn wait_for_spill_room(budget: Arc<MemoryBudget>) {
    while budget.spill_backlog_full() {
        let drained = budget.drained.notified();
        if !budget.spill_backlog_full() {
            break;
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), drained).await;
    }
}

fn count_ok(message_count: u32) -> reply::Result {
    reply::Result::CountOk(pb::CountOk { message_count })
}
