//! The engine's side of one AMQP 1.0 connection: one engine session, and
//! one engine channel per link. The engine speaks in 0-9-1's terms
//! (channels, consumers, delivery tags, publisher confirms); this module
//! routes its events to the link that owns the channel, and answers the
//! requests links make.
//!
//! What a link may have in flight is bounded by the link, not here: a
//! receiving link by the credit it grants (each message it takes becomes
//! one publish awaiting one confirm), a sending link by its prefetch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use foldhash::HashMap;
use parking_lot::Mutex;
use spillway_proto::engine::CommandSender;
use spillway_proto::engine::{
    self as pb, reply, session_command::Command, session_event::Event, SessionCommand, SessionEvent,
};
use spillway_proto::management::Amqp1Link;
use tokio::sync::{mpsc, oneshot, watch};

use super::Amqp1Error;

/// Producer flow control as the engine reports it for this connection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Flow {
    pub blocked: bool,
    pub reason: String,
    /// The channels that published to an overfull queue.
    pub channels: Vec<u32>,
    /// Every channel is held (store quota or failure, memory ceiling).
    pub all: bool,
}

impl Flow {
    /// Whether the link on `channel` is held back: producer flow control
    /// per link, so only the offending queue's senders wait.
    pub fn holds(&self, channel: u32) -> bool {
        self.blocked && (self.all || self.channels.binary_search(&channel).is_ok())
    }
}

/// Shared by the links of one connection.
pub struct EngineSession {
    commands: CommandSender,
    next_request: AtomicU64,
    replies: Mutex<HashMap<u64, oneshot::Sender<reply::Result>>>,
    links: Mutex<Links>,
    flow: watch::Sender<Flow>,
    /// Set when the engine closes the connection (management's close, the
    /// vhost deleted), with the reason.
    closed: watch::Sender<Option<String>>,
}

/// The engine channels in use, one per link.
struct Links {
    routes: HashMap<u32, mpsc::UnboundedSender<Event>>,
    next_channel: u32,
    max: usize,
}

impl EngineSession {
    /// `max_links`: the most links (engine channels) open at once.
    pub fn new(commands: CommandSender, max_links: usize) -> Arc<Self> {
        Arc::new(Self {
            commands,
            next_request: AtomicU64::new(1),
            replies: Mutex::new(HashMap::default()),
            links: Mutex::new(Links {
                routes: HashMap::default(),
                next_channel: 1,
                max: max_links,
            }),
            flow: watch::Sender::new(Flow::default()),
            closed: watch::Sender::new(None),
        })
    }

    fn request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    pub fn flow(&self) -> watch::Receiver<Flow> {
        self.flow.subscribe()
    }

    pub fn closed(&self) -> watch::Receiver<Option<String>> {
        self.closed.subscribe()
    }

    /// Sends a command without waiting for anything.
    pub async fn send(&self, command: Command) -> Result<(), Amqp1Error> {
        self.commands
            .send(SessionCommand {
                command: Some(command),
            })
            .await
            .map_err(|_| Amqp1Error::EngineGone)
    }

    /// Sends the command `command` makes with a new request id and waits
    /// for its reply.
    pub async fn request(
        &self,
        command: impl FnOnce(u64) -> Command,
    ) -> Result<reply::Result, Amqp1Error> {
        let request_id = self.request_id();
        let command = command(request_id);
        let (answer, answered) = oneshot::channel();
        self.replies.lock().insert(request_id, answer);
        if let Err(error) = self.send(command).await {
            self.replies.lock().remove(&request_id);
            return Err(error);
        }
        answered.await.map_err(|_| Amqp1Error::EngineGone)
    }

    /// Like [`request`](Self::request), with an engine error as an error.
    pub async fn request_ok(
        &self,
        command: impl FnOnce(u64) -> Command,
    ) -> Result<reply::Result, Amqp1Error> {
        match self.request(command).await? {
            reply::Result::Error(error) => Err(Amqp1Error::Engine(error)),
            ok => Ok(ok),
        }
    }

    /// Opens an engine channel for a new link; its events arrive on the
    /// receiver. Refused past the connection's link limit.
    /// `shown`: what management lists of the link.
    pub async fn open_link(&self, shown: Amqp1Link) -> Result<LinkChannel, Amqp1Error> {
        let (channel, events) = {
            let mut links = self.links.lock();
            if links.routes.len() >= links.max {
                return Err(Amqp1Error::TooManyLinks(links.max));
            }
            // Channel numbers are u32 to the engine; wrap within u16 as
            // 0-9-1's would, skipping those in use (at most `max` are).
            let mut channel = links.next_channel;
            while links.routes.contains_key(&channel) || channel == 0 {
                channel = (channel % u32::from(u16::MAX)) + 1;
            }
            links.next_channel = (channel % u32::from(u16::MAX)) + 1;
            let (route, events) = mpsc::unbounded_channel();
            links.routes.insert(channel, route);
            (channel, events)
        };
        let opened = self
            .request_ok(|request_id| {
                Command::ChannelOpen(pb::ChannelOpen {
                    request_id,
                    channel,
                    amqp1_link: Some(shown),
                })
            })
            .await;
        if let Err(error) = opened {
            self.links.lock().routes.remove(&channel);
            return Err(error);
        }
        Ok(LinkChannel { channel, events })
    }

    /// Closes a link's engine channel: its consumer is cancelled and what
    /// it holds unsettled is requeued, as for a 0-9-1 channel.
    pub async fn close_link(&self, channel: u32) {
        let _ = self
            .request(|request_id| {
                Command::ChannelClose(pb::ChannelClose {
                    request_id,
                    channel,
                })
            })
            .await;
        self.links.lock().routes.remove(&channel);
    }

    /// Tells the engine `count` deliveries were handed to the client's
    /// links (its delivery credit, as for 0-9-1's writer).
    pub async fn deliveries_written(&self, count: u32) {
        let _ = self
            .send(Command::DeliveriesWritten(pb::DeliveriesWritten { count }))
            .await;
    }

    /// Routes the engine's events until the session ends, or every link
    /// and the connection have let go of it (dropping its commands is what
    /// ends the engine's session).
    pub async fn route(session: Weak<Self>, mut events: mpsc::UnboundedReceiver<SessionEvent>) {
        while let Some(event) = events.recv().await {
            let Some(session) = session.upgrade() else {
                return;
            };
            let Some(event) = event.event else { continue };
            match event {
                Event::Batch(batch) => {
                    for event in batch.events.into_iter().filter_map(|e| e.event) {
                        session.route_one(event).await;
                    }
                }
                event => session.route_one(event).await,
            }
        }
        if let Some(session) = session.upgrade() {
            session
                .closed
                .send_replace(Some("the engine ended the session".to_string()));
        }
    }

    async fn route_one(&self, event: Event) {
        let channel = match &event {
            Event::Reply(reply) => {
                let answer = self.replies.lock().remove(&reply.request_id);
                if let (Some(answer), Some(result)) = (answer, reply.result.clone()) {
                    let _ = answer.send(result);
                }
                return;
            }
            Event::FlowControl(flow) => {
                self.flow.send_replace(Flow {
                    blocked: flow.blocked,
                    reason: flow.reason.clone(),
                    channels: flow.blocked_channels.clone(),
                    all: flow.all_channels,
                });
                return;
            }
            Event::ConnectionClose(close) => {
                self.closed.send_replace(Some(close.reason.clone()));
                return;
            }
            Event::Batch(_) => return,
            Event::Deliver(deliver) => deliver.channel,
            Event::Confirm(confirm) => confirm.channel,
            Event::Returned(returned) => returned.channel,
            Event::ConsumerCancelled(cancelled) => cancelled.channel,
            Event::ChannelError(error) => error.channel,
        };
        let is_delivery = matches!(event, Event::Deliver(_));
        let route = self.links.lock().routes.get(&channel).cloned();
        let delivered = route.is_some_and(|route| route.send(event).is_ok());
        if is_delivery && !delivered {
            // The link went: counted as written all the same, or the
            // engine's delivery credit would stay spent (it requeues the
            // message when the channel closes).
            self.deliveries_written(1).await;
        }
    }
}

/// A link's engine channel and the events for it.
pub struct LinkChannel {
    pub channel: u32,
    pub events: mpsc::UnboundedReceiver<Event>,
}
