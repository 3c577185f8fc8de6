use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::FuturesOrdered;
use futures::StreamExt;
use parking_lot::Mutex;
use spillway_proto::engine::{
    self as pb, reply, session_command::Command, session_event::Event, AmqpError, Reply,
    SessionCommand, SessionEvent,
};
use spillway_proto::{EngineApi, ServiceError, SessionStreams, StorageApi, SESSION_COMMAND_BUFFER};
use tokio::sync::{mpsc, Notify, Semaphore};

use crate::broker::{
    event, recovered, recovered_limits, Broker, BrokerContext, GetOutcome, PublishOutcome,
};
use crate::budget::{self, MemoryBudget};
use crate::errors;
use crate::flow::{FlowStatus, LoadRequest};
use crate::model::{Binding, Destination, Exchange, Queue, SessionId, VHost};
use crate::persistence::StoreWriter;
use crate::routing::ExchangeKind;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Deliveries one gateway session may have in flight (not yet written to
    /// the client's socket) before the engine pauses its consumers.
    pub session_credit: u32,
    /// Message bytes the engine keeps in memory before payloads flow to
    /// disk (`broker.flow_to_disk_threshold`).
    pub flow_to_disk_threshold: u64,
    /// How often flow to disk is re-evaluated (`broker.housekeeping_interval`).
    pub housekeeping_interval: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            session_credit: 2048,
            flow_to_disk_threshold: budget::default_threshold(),
            housekeeping_interval: Duration::from_secs(1),
        }
    }
}

/// Payload reads in flight to the store at once.
const CONCURRENT_LOADS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot recover durable state from the store: {0}")]
    Recovery(#[from] ServiceError),
}

/// The queue engine. Cheap to clone; all clones share one broker.
#[derive(Clone)]
pub struct Engine {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub(crate) broker: Mutex<Broker>,
    pub(crate) next_session: AtomicU64,
    pub(crate) writer: StoreWriter,
    pub(crate) budget: Arc<MemoryBudget>,
    housekeeping_kick: Arc<Notify>,
    /// For reading payloads back; taken at shutdown so the store is
    /// released even while clones of the engine linger.
    store: Mutex<Option<Arc<dyn StorageApi>>>,
}

impl Shared {
    pub(crate) fn store(&self) -> Option<Arc<dyn StorageApi>> {
        self.store.lock().clone()
    }
}

impl Engine {
    /// Starts the engine on a store, recovering durable exchanges, queues,
    /// bindings and persistent messages before it accepts any session.
    pub async fn start(
        store: Arc<dyn StorageApi>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        // Nothing references a payload that flowed to disk before this
        // engine started: the store may delete every record no durable
        // queue entry holds (garbage of a crash).
        let removed = store.remove_orphans().await?;
        if removed > 0 {
            tracing::info!(
                orphaned_messages = removed,
                "payloads left by a previous run removed"
            );
        }
        let definitions = store.load_definitions().await?;
        let budget = Arc::new(MemoryBudget::new(config.flow_to_disk_threshold));
        let writer = StoreWriter::start(store.clone(), budget.clone());
        let (loads, load_requests) = mpsc::unbounded_channel();
        let housekeeping_kick = Arc::new(Notify::new());
        let mut broker = Broker::new(BrokerContext {
            persist: writer.clone(),
            session_credit: config.session_credit,
            budget: budget.clone(),
            loads,
        });
        let mut holders: std::collections::HashMap<u64, u32> = Default::default();
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
            exchange.arguments = def.arguments;
            vhost.exchanges.insert(def.name, exchange);
        }
        for def in definitions.queues {
            let stored = store.load_messages(&def.vhost, &def.name).await?;
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
            let argument_table = errors::decode_table(&def.arguments).unwrap_or_default();
            let mut queue = Queue::new(def.name.clone(), true, def.auto_delete, None);
            queue.limits = recovered_limits(&argument_table);
            queue.argument_table = argument_table;
            queue.arguments = def.arguments;
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
                argument_table: errors::decode_table(&def.arguments).unwrap_or_default(),
                arguments: def.arguments,
            });
        }
        broker.set_next_message_id(next_id);
        tracing::info!(
            vhosts = broker.vhosts.len(),
            messages = recovered_messages,
            "engine recovered durable state"
        );
        let shared = Arc::new(Shared {
            broker: Mutex::new(broker),
            next_session: AtomicU64::new(1),
            writer,
            budget,
            housekeeping_kick,
            store: Mutex::new(Some(store.clone())),
        });
        tokio::spawn(run_quota_watch(Arc::downgrade(&shared)));
        tokio::spawn(run_loader(Arc::downgrade(&shared), load_requests));
        tokio::spawn(run_housekeeping(
            Arc::downgrade(&shared),
            config.housekeeping_interval,
        ));
        Ok(Self { shared })
    }
}

impl Engine {
    /// Flushes pending writes and releases the store. Call after the
    /// gateways have stopped; later writes are refused (and logged).
    pub async fn shutdown(&self) {
        self.shared.writer.stop().await;
        self.shared.store.lock().take();
    }

    /// The channels producer flow control holds back right now.
    pub fn blocked_channels(&self) -> Vec<crate::BlockedChannel> {
        self.shared.broker.lock().blocked_channels()
    }

    /// Flow to disk at this moment: on or off, the threshold, resident and
    /// spilled bytes.
    pub fn flow_status(&self) -> FlowStatus {
        self.shared.broker.lock().flow_status()
    }

    /// Changes the flow-to-disk threshold at once (management's runtime
    /// setting): housekeeping runs straight away with it.
    pub fn set_flow_to_disk_threshold(&self, bytes: u64) {
        let previous = self.shared.budget.threshold();
        self.shared.budget.set_threshold(bytes);
        tracing::info!(
            setting = "broker.flow_to_disk_threshold",
            previous,
            value = bytes,
            "runtime setting changed"
        );
        self.shared.housekeeping_kick.notify_one();
    }
}

/// Follows the storage node's disk quota state for as long as the engine
/// lives, watching again whenever the stream breaks (the storage node
/// restarted): it sends the current state first, so nothing is missed. The
/// last state known holds meanwhile.
async fn run_quota_watch(shared: std::sync::Weak<Shared>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        // The store only for the call: the stream does not keep it open.
        let Some(store) = shared.upgrade().and_then(|engine| engine.store()) else {
            return;
        };
        let watching = store.watch_quota().await;
        drop(store);
        match watching {
            Ok(mut states) => {
                while let Some(state) = states.next().await {
                    let Ok(state) = state else { break };
                    let Some(engine) = shared.upgrade() else {
                        return;
                    };
                    engine.broker.lock().set_store_overfull(state.overfull);
                    backoff = Duration::from_millis(100);
                }
            }
            Err(error) => {
                tracing::debug!(%error, "cannot watch the store quota yet, retrying");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Every `interval`, or when a publish takes memory over the threshold,
/// re-evaluates flow to disk. Ends with the engine.
async fn run_housekeeping(shared: std::sync::Weak<Shared>, interval: Duration) {
    let interval = interval.max(Duration::from_millis(10));
    loop {
        let kick = match shared.upgrade() {
            Some(shared) => shared.housekeeping_kick.clone(),
            None => return,
        };
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = kick.notified() => {}
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        shared.broker.lock().housekeeping();
    }
}

/// Reads payloads back from the store for read-ahead and basic.get, a few
/// batches at a time, and installs them under the broker lock.
async fn run_loader(
    shared: std::sync::Weak<Shared>,
    mut requests: mpsc::UnboundedReceiver<LoadRequest>,
) {
    let permits = Arc::new(Semaphore::new(CONCURRENT_LOADS));
    while let Some(request) = requests.recv().await {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let Some(engine) = shared.upgrade() else {
            return;
        };
        tokio::spawn(async move {
            let records = load(&engine, &request.ids).await;
            engine.broker.lock().install_loaded(
                &request.vhost,
                &request.queue,
                &request.ids,
                records,
            );
            drop(permit);
        });
    }
}

/// The records of `ids`: from the store writer when still on their way to
/// the store, else from the store, retrying until it answers.
pub(crate) async fn load(
    engine: &Shared,
    ids: &[u64],
) -> Vec<spillway_proto::storage::MessageRecord> {
    let Some(store) = engine.store() else {
        // Shutting down: nothing to install the payloads into any more.
        return Vec::new();
    };
    let mut records = Vec::with_capacity(ids.len());
    let mut missing = Vec::new();
    for id in ids {
        match engine.writer.pending_record(*id) {
            Some(record) => records.push(record),
            None => missing.push(*id),
        }
    }
    if missing.is_empty() {
        return records;
    }
    let mut backoff = Duration::from_millis(50);
    loop {
        match store.read_messages(missing.clone()).await {
            Ok(read) => {
                records.extend(read);
                return records;
            }
            Err(error) => {
                tracing::warn!(%error, messages = missing.len(), retry_in_ms = backoff.as_millis() as u64,
                    "reading payloads back from the store failed, retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

#[async_trait]
impl EngineApi for Engine {
    async fn open_session(&self) -> Result<SessionStreams, ServiceError> {
        let (command_tx, command_rx) = mpsc::channel(SESSION_COMMAND_BUFFER);
        let (event_tx, event_rx) = mpsc::unbounded_channel();
        let id = self.shared.next_session.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(run_session(self.shared.clone(), id, command_rx, event_tx));
        Ok(SessionStreams {
            commands: command_tx,
            events: event_rx,
        })
    }
}

/// Applies one connection's commands in order until the gateway hangs up,
/// then releases everything the connection held.
async fn run_session(
    shared: Arc<Shared>,
    id: SessionId,
    mut commands: mpsc::Receiver<SessionCommand>,
    events: mpsc::UnboundedSender<SessionEvent>,
) {
    let mut session = Session {
        shared: shared.clone(),
        id,
        events,
        opened: false,
        confirms: FuturesOrdered::new(),
    };
    loop {
        tokio::select! {
            command = commands.recv() => {
                let Some(command) = command else { break };
                match command.command {
                    Some(Command::Batch(batch)) => {
                        for command in batch.commands {
                            session.apply(command).await;
                        }
                    }
                    _ => session.apply(command).await,
                }
            }
            Some((channel, seq)) = session.confirms.next(), if !session.confirms.is_empty() => {
                session.send(Event::Confirm(pb::Confirm { channel, seq, ack: true }));
            }
        }
    }
    // Confirms still waiting for the disk cannot be delivered any more.
    shared.broker.lock().close_session(id);
    tracing::debug!(session = id, "session closed");
}

type ConfirmFuture = std::pin::Pin<Box<dyn std::future::Future<Output = (u32, u64)> + Send>>;

struct Session {
    shared: Arc<Shared>,
    id: SessionId,
    events: mpsc::UnboundedSender<SessionEvent>,
    opened: bool,
    confirms: FuturesOrdered<ConfirmFuture>,
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
    /// message is being read back.
    async fn apply(&mut self, command: SessionCommand) {
        let Some(command) = command.command else {
            return;
        };
        match command {
            Command::Publish(cmd) => {
                wait_for_spill_room(self.shared.budget.clone()).await;
                self.apply_now(Command::Publish(cmd));
            }
            Command::Get(cmd) => self.get(cmd).await,
            command => self.apply_now(command),
        }
    }

    async fn get(&mut self, cmd: pb::Get) {
        loop {
            let outcome = self.shared.broker.lock().get(self.id, &cmd);
            let result = match outcome {
                Ok(GetOutcome::Got(get_ok)) => Ok(reply::Result::GetOk(get_ok)),
                Ok(GetOutcome::Empty) => Ok(reply::Result::GetEmpty(pb::Empty {})),
                Ok(GetOutcome::Wait(loaded)) => {
                    // Dropped when the queue goes: ask again, and hear why.
                    let _ = loaded.await;
                    continue;
                }
                Err(error) => Err(error),
            };
            self.reply(cmd.request_id, result);
            return;
        }
    }

    fn apply_now(&mut self, command: Command) {
        if let Command::Batch(batch) = command {
            for command in batch.commands.into_iter().filter_map(|c| c.command) {
                self.apply_now(command);
            }
            return;
        }
        let id = self.id;
        if let Command::Open(open) = &command {
            let result = self
                .shared
                .broker
                .lock()
                .open_session(id, open, self.events.clone());
            self.opened = result.is_ok();
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
        let mut broker = self.shared.broker.lock();
        if let Some(state) = broker.sessions.get_mut(&id) {
            match &command {
                Command::Publish(_) => state.published += 1,
                Command::DeliveriesWritten(cmd) => state.delivered += u64::from(cmd.count),
                _ => {}
            }
        }
        match command {
            Command::Open(_) | Command::Batch(_) => {}
            Command::ChannelOpen(cmd) => {
                self.ok(cmd.request_id, broker.open_channel(id, cmd.channel))
            }
            Command::ChannelClose(cmd) => {
                broker.close_channel(id, cmd.channel);
                self.ok(cmd.request_id, Ok(()));
            }
            Command::ExchangeDeclare(cmd) => {
                self.ok(cmd.request_id, broker.declare_exchange(id, &cmd))
            }
            Command::ExchangeDelete(cmd) => {
                self.ok(cmd.request_id, broker.delete_exchange(id, &cmd))
            }
            Command::QueueDeclare(cmd) => {
                let result = broker.declare_queue(id, &cmd);
                self.reply(cmd.request_id, result.map(reply::Result::QueueDeclareOk));
            }
            Command::QueueBind(cmd) => self.ok(cmd.request_id, broker.bind_queue(id, &cmd)),
            Command::QueueUnbind(cmd) => self.ok(cmd.request_id, broker.unbind_queue(id, &cmd)),
            Command::ExchangeBind(cmd) => self.ok(cmd.request_id, broker.bind_exchange(id, &cmd)),
            Command::ExchangeUnbind(cmd) => {
                self.ok(cmd.request_id, broker.unbind_exchange(id, &cmd))
            }
            Command::QueuePurge(cmd) => {
                let result = broker.purge_queue(id, &cmd);
                self.reply(cmd.request_id, result.map(count_ok));
            }
            Command::QueueDelete(cmd) => {
                let result = broker.delete_queue(id, &cmd);
                self.reply(cmd.request_id, result.map(count_ok));
            }
            Command::Publish(mut cmd) => {
                let (channel, seq) = (cmd.channel, cmd.confirm_seq);
                let span = tracing::trace_span!(target: spillway_proto::trace::TARGET, "publish",
                    exchange = %cmd.exchange, routing_key = %cmd.routing_key);
                spillway_proto::trace::set_parent(&span, &std::mem::take(&mut cmd.trace_context));
                let outcome = span.in_scope(|| broker.publish(id, cmd));
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
                            // A dropped writer means the engine is going away;
                            // the confirm is then never sent (at-least-once).
                            let _ = written.await;
                            (channel, seq)
                        }));
                    }
                    Err(error) => self.send_async_error(channel, error, PUBLISH),
                }
            }
            Command::Consume(cmd) => {
                let result = broker.consume(id, &cmd);
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
                    self.send_async_error(cmd.channel, error, ACK);
                }
            }
            Command::Nack(cmd) => {
                if let Err(error) = broker.nack(id, &cmd) {
                    self.send_async_error(cmd.channel, error, NACK);
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
            Command::Get(cmd) => {
                // Only reached inside a nested batch: answer without waiting.
                let result = broker.get(id, &cmd).map(|got| match got {
                    GetOutcome::Got(get_ok) => reply::Result::GetOk(get_ok),
                    GetOutcome::Empty | GetOutcome::Wait(_) => {
                        reply::Result::GetEmpty(pb::Empty {})
                    }
                });
                self.reply(cmd.request_id, result);
            }
            Command::ConfirmSelect(cmd) => {
                self.ok(cmd.request_id, broker.confirm_select(id, cmd.channel))
            }
            Command::DeliveriesWritten(cmd) => broker.deliveries_written(id, cmd.count),
        }
    }

    /// Methods without a reply (publish, ack, nack) report failure as a
    /// channel error: the gateway closes the channel with it.
    fn send_async_error(
        &self,
        channel: u32,
        mut error: AmqpError,
        (class_id, method_id): (u32, u32),
    ) {
        error.class_id = class_id;
        error.method_id = method_id;
        self.send(Event::ChannelError(pb::ChannelError {
            channel,
            error: Some(error),
        }));
    }
}

/// Holds a publisher while the store is behind on spilled payloads.
async fn wait_for_spill_room(budget: Arc<MemoryBudget>) {
    while budget.spill_backlog_full() {
        let drained = budget.drained.notified();
        if !budget.spill_backlog_full() {
            break;
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), drained).await;
    }
}

/// (class, method) ids of the methods that fail without a reply.
const PUBLISH: (u32, u32) = (60, 40);
const ACK: (u32, u32) = (60, 80);
const NACK: (u32, u32) = (60, 120);

fn count_ok(message_count: u32) -> reply::Result {
    reply::Result::CountOk(pb::CountOk { message_count })
}
