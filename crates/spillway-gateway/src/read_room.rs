//! How much room a connection's read buffer offers the socket.
//!
//! `FramedRead` starts with 8 KiB and otherwise grows only to hold one
//! frame, so a client streaming 16 KiB publishes was read two or three
//! syscalls a message, each one waking the connection task. [`ReadRoom`]
//! doubles the room while reads fill it (the socket had more waiting) up to
//! [`MAX_READ_ROOM`], and halves it back while reads use less than a quarter
//! of it: an idle connection keeps the small buffer it had.
//!
//! The buffer is the connection's own and bounded: frames are parsed out of
//! it, and publish bodies are copied out (`amqp091/connection/publish.rs`) unless
//! lent ([`crate::body_loans`]). To lend a body, the gateway must know the
//! allocation it sits in: [`ReadRoom::prepare`] makes every allocation of
//! the buffer itself, exactly sized, and numbers it ([`ReadChunk`]).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, ReadBuf};

/// The room a connection starts with and shrinks back to (`FramedRead`'s
/// own initial capacity).
pub const MIN_READ_ROOM: usize = 8 * 1024;
/// The most room one read is offered.
pub const MAX_READ_ROOM: usize = 256 * 1024;

/// The read half of a connection, remembering how its last read went.
pub struct MeasuredRead<R> {
    inner: R,
    last: Option<LastRead>,
}

/// One read: the room it was offered and what it filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LastRead {
    room: usize,
    read: usize,
}

impl<R> MeasuredRead<R> {
    pub fn new(inner: R) -> Self {
        Self { inner, last: None }
    }

    /// The read since the last call, if one completed.
    pub fn take_last(&mut self) -> Option<LastRead> {
        self.last.take()
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for MeasuredRead<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let room = buf.remaining();
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            let read = buf.filled().len() - before;
            self.last = Some(LastRead { room, read });
        }
        polled
    }
}

/// One allocation of a connection's read buffer, made by [`ReadRoom`]:
/// what a body lent from it keeps alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadChunk {
    /// Numbers the connection's allocations, from 1.
    pub id: u64,
    /// Its size.
    pub bytes: usize,
}

/// The room to offer the next read, adapted to how full reads come back,
/// and the buffer's current allocation.
#[derive(Debug)]
pub struct ReadRoom {
    size: usize,
    chunk: Option<(ReadChunk, Span)>,
    allocations: u64,
}

/// Where an allocation ends: a buffer whose view still ends there is in it.
#[derive(Clone, Copy, Debug)]
struct Span {
    start: usize,
    end: usize,
}

impl Default for ReadRoom {
    fn default() -> Self {
        Self {
            size: MIN_READ_ROOM,
            chunk: None,
            allocations: 0,
        }
    }
}

impl ReadRoom {
    /// Learns from the read since the last call, then makes sure `buffer`
    /// offers the next read at least a quarter of the room (growing it to
    /// the full room when it does not).
    ///
    /// Room is made in the allocation the buffer has when nothing else
    /// holds it, else in a new one of exactly what is kept plus the room.
    /// A buffer in an allocation made elsewhere (the decoder growing it for
    /// a frame) moves to one of ours, so that the next bodies can be lent.
    pub fn prepare(&mut self, last: Option<LastRead>, buffer: &mut BytesMut) {
        if let Some(last) = last {
            self.learn(last);
        }
        let ours = self.chunk_of(buffer).is_some();
        if ours && buffer.capacity() - buffer.len() >= self.size / 4 {
            return;
        }
        if ours && buffer.try_reclaim(self.size) {
            return;
        }
        let mut fresh = BytesMut::with_capacity(buffer.len() + self.size);
        fresh.extend_from_slice(buffer);
        *buffer = fresh;
        self.allocations += 1;
        let start = buffer.as_ptr() as usize;
        let chunk = ReadChunk {
            id: self.allocations,
            bytes: buffer.capacity(),
        };
        self.chunk = Some((
            chunk,
            Span {
                start,
                end: start + buffer.capacity(),
            },
        ));
    }

    /// The allocation `buffer` is in, if [`ReadRoom::prepare`] made it. A
    /// frame just split off the buffer is in the same one.
    pub fn chunk_of(&self, buffer: &BytesMut) -> Option<ReadChunk> {
        let (chunk, span) = self.chunk?;
        let start = buffer.as_ptr() as usize;
        let end = start + buffer.capacity();
        (start >= span.start && end == span.end).then_some(chunk)
    }

    fn learn(&mut self, last: LastRead) {
        if last.read == 0 {
            return;
        }
        if last.read >= last.room {
            self.size = (self.size * 2).min(MAX_READ_ROOM);
        } else if last.read < self.size / 4 {
            self.size = (self.size / 2).max(MIN_READ_ROOM);
        }
        debug_assert!((MIN_READ_ROOM..=MAX_READ_ROOM).contains(&self.size));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn room_grows_while_reads_fill_it_and_shrinks_when_they_do_not() {
        let mut room = ReadRoom::default();
        for _ in 0..10 {
            let size = room.size;
            room.learn(LastRead {
                room: size,
                read: size,
            });
        }
        assert_eq!(room.size, MAX_READ_ROOM);
        // A read that used half the room: the size holds.
        room.learn(LastRead {
            room: MAX_READ_ROOM,
            read: MAX_READ_ROOM / 2,
        });
        assert_eq!(room.size, MAX_READ_ROOM);
        for _ in 0..10 {
            room.learn(LastRead {
                room: room.size,
                read: 100,
            });
        }
        assert_eq!(room.size, MIN_READ_ROOM);
        // End of stream teaches nothing.
        room.learn(LastRead {
            room: 8192,
            read: 0,
        });
        assert_eq!(room.size, MIN_READ_ROOM);
    }

    #[tokio::test]
    async fn a_streaming_peer_is_read_in_larger_reads() {
        let (mut client, server) = tokio::io::duplex(8 * MAX_READ_ROOM);
        let payload = vec![7u8; 4 * MAX_READ_ROOM];
        client.write_all(&payload).await.unwrap();
        drop(client);
        let mut reader = MeasuredRead::new(server);
        let mut room = ReadRoom::default();
        let mut buffer = BytesMut::new();
        let mut reads = Vec::new();
        loop {
            room.prepare(reader.take_last(), &mut buffer);
            let n = reader.read_buf(&mut buffer).await.unwrap();
            if n == 0 {
                break;
            }
            reads.push(n);
            // As the frame decoder does: what was read is split off.
            drop(buffer.split_to(n));
        }
        assert_eq!(reads.iter().sum::<usize>(), payload.len());
        assert_eq!(reads[0], MIN_READ_ROOM);
        assert!(
            reads.contains(&MAX_READ_ROOM),
            "reads never reached the largest room: {reads:?}"
        );
    }

    #[test]
    fn the_buffer_is_known_to_be_in_its_allocation_until_it_moves() {
        let mut room = ReadRoom::default();
        let mut buffer = BytesMut::new();
        assert_eq!(room.chunk_of(&buffer), None, "not an allocation of ours");
        room.prepare(None, &mut buffer);
        let first = room.chunk_of(&buffer).expect("prepared");
        assert_eq!(first.bytes, MIN_READ_ROOM);
        buffer.extend_from_slice(&[5u8; 7000]);
        // A frame split off is in the same allocation, and so is the rest.
        let frame = buffer.split_to(4000).freeze();
        assert_eq!(room.chunk_of(&buffer), Some(first));
        // With the frame alive the room cannot be reclaimed: a new
        // allocation, holding what was left, exactly sized.
        room.prepare(None, &mut buffer);
        let second = room.chunk_of(&buffer).expect("prepared");
        assert_ne!(second.id, first.id);
        assert_eq!(second.bytes, 3000 + MIN_READ_ROOM);
        assert_eq!(&buffer[..], &[5u8; 3000][..]);
        drop(frame);
        // Unshared, the room is made in place: the same allocation.
        buffer.clear();
        buffer.extend_from_slice(&[6u8; 9000]);
        let _ = buffer.split_to(9000);
        room.prepare(None, &mut buffer);
        assert_eq!(room.chunk_of(&buffer), Some(second));
        // A buffer grown elsewhere is not ours until prepared again.
        buffer.reserve(1 << 20);
        assert_eq!(room.chunk_of(&buffer), None);
        room.prepare(None, &mut buffer);
        assert_eq!(room.chunk_of(&buffer).map(|c| c.id), Some(3));
    }
}
