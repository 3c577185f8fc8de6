//! The gateway's session with the queue engine, the boundary on the message
//! path between them: [`EngineApi`] with an in-process implementation (the
//! engine's own crate) and a remote one over tonic ([`RemoteEngine`] on the
//! gateway's side, [`serve_remote_session`] on the engine's). Callers hold an
//! `Arc<dyn EngineApi>` and never know which they have.

use std::collections::VecDeque;
use std::pin::Pin;

use async_trait::async_trait;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::command_queue::{command_queue, CommandReceiver, CommandSender};
use crate::cluster::{lazy_channel, ClusterChannel, ClusterClient, BATCH_BYTES};
use crate::engine::{session_command, session_event, CommandBatch, EventBatch};
use crate::engine::{SessionCommand, SessionEvent};
use crate::ServiceError;

/// How many ready messages one gRPC stream message carries at most.
const MAX_STREAM_BATCH: usize = 256;

/// One client connection's conversation with the engine.
pub struct SessionStreams {
    /// Commands, in the order the client sent them (bounded in count and
    /// bytes, see [`super::command_queue()`]).
    pub commands: CommandSender,
    /// Replies and asynchronous events, in order. Ends when the engine ends
    /// the session (or the remote engine is lost).
    pub events: mpsc::UnboundedReceiver<SessionEvent>,
}

/// What the gateway needs from the queue engine.
#[async_trait]
pub trait EngineApi: Send + Sync + 'static {
    async fn open_session(&self) -> Result<SessionStreams, ServiceError>;
    /// Checks a client's login against the engine's users.
    async fn authenticate(
        &self,
        request: crate::engine::AuthenticateRequest,
    ) -> Result<crate::engine::LoginResult, ServiceError>;
}

/// The queue engine over gRPC: one bidirectional stream per session, with
/// whatever is ready packed into one stream message each way.
#[derive(Clone)]
pub struct RemoteEngine {
    client: crate::engine::engine_client::EngineClient<ClusterChannel>,
}

impl RemoteEngine {
    /// `cluster`: the secret sent with every call and the message limit.
    pub fn connect_lazy(addr: &str, cluster: &ClusterClient) -> Result<Self, ServiceError> {
        let channel = lazy_channel(addr, cluster)?;
        let client = crate::engine::engine_client::EngineClient::new(channel)
            .max_decoding_message_size(cluster.max_message_bytes)
            .max_encoding_message_size(cluster.max_message_bytes);
        Ok(Self { client })
    }
}

#[async_trait]
impl EngineApi for RemoteEngine {
    async fn open_session(&self) -> Result<SessionStreams, ServiceError> {
        let (command_tx, command_rx) = command_queue();
        let (outbound_tx, outbound_rx) = mpsc::channel(16);
        tokio::spawn(batch_commands(command_rx, outbound_tx));
        // A batch's commands keep their bytes in the queue's bound until the
        // transport takes the batch.
        let outbound = ReceiverStream::new(outbound_rx).map(|(batch, _bytes)| batch);
        let response = self.client.clone().session(outbound).await?;
        let (event_tx, event_rx) = mpsc::unbounded_channel();
        tokio::spawn(forward_events(response.into_inner(), event_tx));
        Ok(SessionStreams {
            commands: command_tx,
            events: event_rx,
        })
    }

    async fn authenticate(
        &self,
        request: crate::engine::AuthenticateRequest,
    ) -> Result<crate::engine::LoginResult, ServiceError> {
        let response = self.client.clone().authenticate(request).await?;
        Ok(response.into_inner().result())
    }
}

async fn batch_commands(
    mut commands: CommandReceiver,
    outbound: mpsc::Sender<(SessionCommand, Vec<tokio::sync::OwnedSemaphorePermit>)>,
) {
    let mut ready = Vec::with_capacity(MAX_STREAM_BATCH);
    while commands.recv_many(&mut ready, MAX_STREAM_BATCH).await > 0 {
        let (batch, bytes): (Vec<_>, Vec<_>) = ready.drain(..).map(|c| c.into_parts()).unzip();
        if outbound.send((pack_commands(batch), bytes)).await.is_err() {
            return;
        }
    }
}

async fn forward_events(
    mut inbound: tonic::Streaming<SessionEvent>,
    events: mpsc::UnboundedSender<SessionEvent>,
) {
    loop {
        match inbound.message().await {
            Ok(Some(event)) => {
                if !unbatch_event(event, &events) {
                    return;
                }
            }
            Ok(None) => return,
            Err(status) => {
                tracing::warn!(%status, "engine session stream failed");
                return;
            }
        }
    }
}

fn unbatch_event(event: SessionEvent, events: &mpsc::UnboundedSender<SessionEvent>) -> bool {
    match event.event {
        Some(session_event::Event::Batch(batch)) => batch
            .events
            .into_iter()
            .all(|event| events.send(event).is_ok()),
        _ => events.send(event).is_ok(),
    }
}

/// Serves one remote session on the engine side: unpacks command batches into
/// `commands` and packs ready events into batches.
pub fn serve_remote_session(
    mut inbound: tonic::Streaming<SessionCommand>,
    session: SessionStreams,
) -> Pin<Box<dyn Stream<Item = Result<SessionEvent, tonic::Status>> + Send>> {
    let SessionStreams { commands, events } = session;
    tokio::spawn(async move {
        loop {
            let command = match inbound.message().await {
                Ok(Some(command)) => command,
                Ok(None) => return,
                Err(status) => {
                    tracing::debug!(%status, "gateway session stream ended");
                    return;
                }
            };
            let batch = match command.command {
                Some(session_command::Command::Batch(batch)) => batch.commands,
                _ => vec![command],
            };
            for mut command in batch {
                // A decoded body is a slice of the whole gRPC message: kept
                // as it is, one queued message would pin the batch it came in
                // (memory the engine's budget cannot see).
                if let Some(session_command::Command::Publish(publish)) = &mut command.command {
                    publish.properties = bytes::Bytes::copy_from_slice(&publish.properties);
                    publish.body = bytes::Bytes::copy_from_slice(&publish.body);
                }
                if commands.send(command).await.is_err() {
                    return;
                }
            }
        }
    });
    // Events taken from the channel that did not fit into the last stream
    // message wait here for the next one.
    let carried = VecDeque::new();
    let stream =
        futures::stream::unfold((events, carried), |(mut events, mut carried)| async move {
            if carried.is_empty() {
                let mut ready = Vec::with_capacity(MAX_STREAM_BATCH);
                if events.recv_many(&mut ready, MAX_STREAM_BATCH).await == 0 {
                    return None;
                }
                carried.extend(ready);
            }
            let batch = take_batch(&mut carried);
            Some((Ok(pack_events(batch)), (events, carried)))
        });
    Box::pin(stream)
}

/// The first items of `ready` that go into one stream message: at most
/// [`MAX_STREAM_BATCH`] of them and [`BATCH_BYTES`] encoded, except that the
/// first always goes (alone, if need be), so that a stream message stays
/// within the gRPC message limit ([`crate::cluster::grpc_message_limit`]).
fn take_batch<T: prost::Message>(ready: &mut VecDeque<T>) -> Vec<T> {
    let mut batch = Vec::new();
    let mut bytes = 0;
    while let Some(next) = ready.front() {
        let len = next.encoded_len();
        if !batch.is_empty() && (bytes + len > BATCH_BYTES || batch.len() == MAX_STREAM_BATCH) {
            break;
        }
        bytes += len;
        batch.extend(ready.pop_front());
    }
    batch
}

fn pack_events(mut ready: Vec<SessionEvent>) -> SessionEvent {
    match (ready.len(), ready.pop()) {
        (1, Some(event)) => event,
        (_, last) => {
            ready.extend(last);
            SessionEvent {
                event: Some(session_event::Event::Batch(EventBatch { events: ready })),
            }
        }
    }
}

fn pack_commands(mut ready: Vec<SessionCommand>) -> SessionCommand {
    match (ready.len(), ready.pop()) {
        (1, Some(command)) => command,
        (_, last) => {
            ready.extend(last);
            SessionCommand {
                command: Some(session_command::Command::Batch(CommandBatch {
                    commands: ready,
                })),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Deliver;

    fn delivery(body: usize) -> SessionEvent {
        SessionEvent {
            event: Some(session_event::Event::Deliver(Deliver {
                body: vec![0; body].into(),
                ..Default::default()
            })),
        }
    }

    #[test]
    fn a_batch_stops_at_its_byte_budget_but_a_large_event_goes_alone() {
        let mut ready: VecDeque<_> = [
            delivery(BATCH_BYTES / 2),
            delivery(BATCH_BYTES / 2),
            delivery(10),
            delivery(BATCH_BYTES * 2),
            delivery(10),
        ]
        .into();
        let sizes = |batch: Vec<SessionEvent>| batch.len();
        assert_eq!(
            sizes(take_batch(&mut ready)),
            1,
            "two halves plus framing overflow"
        );
        assert_eq!(sizes(take_batch(&mut ready)), 2);
        assert_eq!(sizes(take_batch(&mut ready)), 1, "the large one alone");
        assert_eq!(sizes(take_batch(&mut ready)), 1);
        assert!(ready.is_empty());

        let mut many: VecDeque<_> = (0..MAX_STREAM_BATCH + 1).map(|_| delivery(1)).collect();
        assert_eq!(take_batch(&mut many).len(), MAX_STREAM_BATCH);
        assert_eq!(take_batch(&mut many).len(), 1);
    }
}
