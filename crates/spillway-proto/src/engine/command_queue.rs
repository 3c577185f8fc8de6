//! The queue of one session's commands from the gateway to the engine,
//! bounded twice: in commands ([`SESSION_COMMAND_BUFFER`]) and in bytes
//! ([`SESSION_COMMAND_BYTES`], publish bodies mostly). A sender waits while
//! either bound is reached, so a client that publishes faster than the
//! engine takes its messages is slowed by TCP back-pressure on its own
//! socket, and holds at most that many bytes (plus one message) in the queue,
//! however large its messages.
//!
//! The bytes of a command are released when the engine takes it off the
//! queue; from then on a published message is in a queue and counted in the
//! engine's memory budget. Over gRPC the gateway side keeps the bytes of the
//! commands it has batched until the transport takes them, so the batches
//! waiting for the stream are bounded too.

use std::sync::Arc;

use prost::Message;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::engine::{session_command::Command, SessionCommand};

/// Commands a gateway session may have queued towards the engine before
/// sending waits (back-pressure reaches the client's socket).
pub const SESSION_COMMAND_BUFFER: usize = 1024;

/// Bytes of commands one session may have queued towards the engine before
/// sending waits: 8 MiB. A single larger message still goes, alone.
pub const SESSION_COMMAND_BYTES: u32 = 8 * 1024 * 1024;

/// What a command is charged beyond the bytes it carries.
const COMMAND_OVERHEAD: usize = 64;

/// A new command queue with the default bounds.
pub fn command_queue() -> (CommandSender, CommandReceiver) {
    command_queue_with(SESSION_COMMAND_BUFFER, SESSION_COMMAND_BYTES)
}

/// A new command queue holding at most `commands` commands and `bytes`
/// bytes (one command larger than `bytes` is let through alone).
pub fn command_queue_with(commands: usize, bytes: u32) -> (CommandSender, CommandReceiver) {
    let (tx, rx) = mpsc::channel(commands.max(1));
    let bytes = bytes.max(1);
    let sender = CommandSender {
        tx,
        bytes: Arc::new(Semaphore::new(bytes as usize)),
        max_bytes: bytes,
    };
    (sender, CommandReceiver { rx })
}

/// The engine side is gone: the session ended.
#[derive(Debug, thiserror::Error)]
#[error("the engine session has ended")]
pub struct SessionEnded;

/// The gateway's end of a session's command queue. Cheap to clone; clones
/// share the bounds.
#[derive(Clone, Debug)]
pub struct CommandSender {
    tx: mpsc::Sender<QueuedCommand>,
    bytes: Arc<Semaphore>,
    max_bytes: u32,
}

impl CommandSender {
    /// Queues `command`, waiting while the queue is full in commands or in
    /// bytes.
    pub async fn send(&self, command: SessionCommand) -> Result<(), SessionEnded> {
        let cost = command_cost(&command).min(self.max_bytes);
        let permit = self
            .bytes
            .clone()
            .acquire_many_owned(cost)
            .await
            .map_err(|_| SessionEnded)?;
        self.tx
            .send(QueuedCommand {
                command,
                bytes: permit,
            })
            .await
            .map_err(|_| SessionEnded)
    }

    /// Bytes queued now (for tests and metrics).
    pub fn queued_bytes(&self) -> u64 {
        u64::from(self.max_bytes) - self.bytes.available_permits() as u64
    }

    /// Resolves when the receiving side is gone.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// A command with the bytes it holds in its queue's bound.
#[derive(Debug)]
pub struct QueuedCommand {
    command: SessionCommand,
    bytes: OwnedSemaphorePermit,
}

impl QueuedCommand {
    pub fn command(&self) -> &SessionCommand {
        &self.command
    }

    /// The command, and what keeps its bytes counted until dropped.
    pub fn into_parts(self) -> (SessionCommand, OwnedSemaphorePermit) {
        (self.command, self.bytes)
    }
}

/// The engine's end of a session's command queue.
#[derive(Debug)]
pub struct CommandReceiver {
    rx: mpsc::Receiver<QueuedCommand>,
}

impl CommandReceiver {
    /// The next command; its bytes leave the bound. None once every sender
    /// is gone.
    pub async fn recv(&mut self) -> Option<SessionCommand> {
        self.rx.recv().await.map(|queued| queued.command)
    }

    /// The next command, still holding its bytes. None once every sender
    /// is gone.
    pub async fn recv_queued(&mut self) -> Option<QueuedCommand> {
        self.rx.recv().await
    }

    /// Up to `limit` commands that are ready (waiting for the first), still
    /// holding their bytes.
    pub async fn recv_many(&mut self, ready: &mut Vec<QueuedCommand>, limit: usize) -> usize {
        self.rx.recv_many(ready, limit).await
    }
}

/// The bytes a command holds while queued: a publish by what it carries, any
/// other command by its encoded size.
fn command_cost(command: &SessionCommand) -> u32 {
    let bytes = match &command.command {
        Some(Command::Publish(publish)) => {
            publish.body.len()
                + publish.properties.len()
                + publish.exchange.len()
                + publish.routing_key.len()
        }
        _ => command.encoded_len(),
    };
    u32::try_from(bytes + COMMAND_OVERHEAD).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine as pb;
    use std::time::Duration;

    fn publish(body: usize) -> SessionCommand {
        SessionCommand {
            command: Some(Command::Publish(pb::Publish {
                body: vec![0u8; body].into(),
                ..Default::default()
            })),
        }
    }

    #[tokio::test]
    async fn a_sender_waits_at_the_byte_bound_and_goes_on_when_the_engine_takes() {
        let (sender, mut receiver) = command_queue_with(1024, 10_000);
        for _ in 0..3 {
            sender.send(publish(3000)).await.unwrap();
        }
        let fourth = tokio::time::timeout(Duration::from_millis(50), sender.send(publish(3000)));
        assert!(
            fourth.await.is_err(),
            "a fourth 3 KB publish passes a 10 KB bound"
        );
        assert!(sender.queued_bytes() <= 10_000);
        receiver.recv().await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), sender.send(publish(3000)))
            .await
            .expect("room was made")
            .unwrap();
    }

    #[tokio::test]
    async fn one_command_larger_than_the_bound_goes_alone() {
        let (sender, mut receiver) = command_queue_with(1024, 1000);
        sender.send(publish(1 << 20)).await.unwrap();
        assert_eq!(sender.queued_bytes(), 1000);
        let second = tokio::time::timeout(Duration::from_millis(50), sender.send(publish(1)));
        assert!(second.await.is_err(), "the queue is full");
        receiver.recv().await.unwrap();
        assert_eq!(sender.queued_bytes(), 0);
    }

    #[tokio::test]
    async fn batched_commands_keep_their_bytes_until_dropped() {
        let (sender, mut receiver) = command_queue_with(1024, 10_000);
        sender.send(publish(4000)).await.unwrap();
        sender.send(publish(4000)).await.unwrap();
        let mut ready = Vec::new();
        assert_eq!(receiver.recv_many(&mut ready, 10).await, 2);
        assert!(sender.queued_bytes() >= 8000);
        drop(ready);
        assert_eq!(sender.queued_bytes(), 0);
    }

    #[tokio::test]
    async fn sending_fails_once_the_engine_side_is_gone() {
        let (sender, receiver) = command_queue();
        drop(receiver);
        assert!(sender.send(publish(1)).await.is_err());
    }
}
