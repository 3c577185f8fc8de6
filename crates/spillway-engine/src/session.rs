use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use futures::stream::FuturesOrdered;
use futures::StreamExt;
use parking_lot::Mutex;
use spillway_proto::engine::{
    self as pb, reply, session_command::Command, session_event::Event, AmqpError, Reply,
    SessionCommand, SessionEvent,
};
use spillway_proto::{EngineApi, ServiceError, SessionStreams, StorageApi, SESSION_COMMAND_BUFFER};
use tokio::sync::mpsc;

use crate::broker::{event, recovered, recovered_limits, Broker, PublishOutcome};
use crate::errors;
use crate::model::{Binding, Destination, Exchange, Queue, SessionId, VHost};
use crate::persistence::StoreWriter;
use crate::routing::ExchangeKind;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Deliveries one gateway session may have in flight (not yet written to
    /// the client's socket) before the engine pauses its consumers.
    pub session_credit: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            session_credit: 2048,
        }
    }
}

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
}

impl Engine {
    /// Starts the engine on a store, recovering durable exchanges, queues,
    /// bindings and persistent messages before it accepts any session.
    pub async fn start(
        store: Arc<dyn StorageApi>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        let definitions = store.load_definitions().await?;
        let writer = StoreWriter::start(store.clone());
        let mut broker = Broker::new(writer.clone(), config.session_credit);
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
                    recovered(m)
                })
                .collect();
            let argument_table = errors::decode_table(&def.arguments).unwrap_or_default();
            let mut queue = Queue::new(def.name.clone(), true, def.auto_delete, None);
            queue.limits = recovered_limits(&argument_table);
            queue.argument_table = argument_table;
            queue.arguments = def.arguments;
            for message in messages {
                queue.push_recovered(message);
            }
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
        Ok(Self {
            shared: Arc::new(Shared {
                broker: Mutex::new(broker),
                next_session: AtomicU64::new(1),
                writer,
            }),
        })
    }
}

impl Engine {
    /// Flushes pending writes and releases the store. Call after the
    /// gateways have stopped; later writes are refused (and logged).
    pub async fn shutdown(&self) {
        self.shared.writer.stop().await;
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
                session.apply(command);
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

    fn apply(&mut self, command: SessionCommand) {
        let Some(command) = command.command else {
            return;
        };
        if let Command::Batch(batch) = command {
            for command in batch.commands {
                self.apply(command);
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
            Command::Publish(cmd) => {
                let (channel, seq) = (cmd.channel, cmd.confirm_seq);
                match broker.publish(id, cmd) {
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
                let result = broker.get(id, &cmd).map(|got| match got {
                    Some(get_ok) => reply::Result::GetOk(get_ok),
                    None => reply::Result::GetEmpty(pb::Empty {}),
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

/// (class, method) ids of the methods that fail without a reply.
const PUBLISH: (u32, u32) = (60, 40);
const ACK: (u32, u32) = (60, 80);
const NACK: (u32, u32) = (60, 120);

fn count_ok(message_count: u32) -> reply::Result {
    reply::Result::CountOk(pb::CountOk { message_count })
}
