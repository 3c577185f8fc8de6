//! What a 1.0 client sends, checked before `fe2o3-amqp` decodes it.
//!
//! The library's decoder (`serde_amqp`) recurses once per level of nested
//! lists, maps and described values, with no limit: a frame of a few
//! kilobytes nested a thousand levels deep would overflow a worker thread's
//! stack and abort the whole broker. Its frame decoder also panics on a
//! frame shorter than its 8-byte header. [`FrameGuard`] sits between the
//! socket and the library: it passes on only whole frames whose header is
//! sound and whose encoded values nest at most [`MAX_NESTING`] deep, and
//! fails the connection otherwise. A message split over several transfer
//! frames is scanned as one stream per link ([`Scanner`] keeps its place),
//! so splitting does not hide depth.
//!
//! The guard also works around one limit of the library: it keys a
//! session's links by name alone, while the spec lets a sending and a
//! receiving link share a name (Qpid Proton's blocking client names both
//! links to one address alike). Attaches of links the client receives on
//! get [`RECEIVING_SUFFIX`] added to their name on the way in, and taken
//! off again in the broker's attaches on the way out.
//!
//! On the way out it saves writes: the library flushes after every frame,
//! so transfers, dispositions and flows wait until the library next reads
//! (its connection task reads before it waits) or [`COALESCE_OUTBOUND`]
//! bytes are waiting, and go in one write; any other frame is written at
//! its flush.
//!
//! [`Scanner`] reads AMQP 1.0's type encoding (spec part 1) only far enough
//! to know where each value starts and ends; it decodes nothing. Arrays of
//! lists, maps, arrays or described values are refused outright: clients
//! send arrays of symbols, and an array element has no constructor of its
//! own to scan. Written here because no maintained crate checks AMQP 1.0
//! encodings without decoding them.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{ready, Context, Poll};

use bytes::{Buf, BytesMut};
use fe2o3_amqp_types::definitions::Role;
use fe2o3_amqp_types::performatives::{Attach, Flow, Transfer};
use foldhash::HashMap;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// Deepest nesting of lists, maps, arrays and described values accepted.
/// A performative is 2–4 deep; a message's sections a few more.
pub const MAX_NESTING: usize = 32;

/// Added to the names of links the client receives on, for the library
/// (see the module docs); never seen by the client.
pub const RECEIVING_SUFFIX: &str = "\u{0}spillway-receiving";

/// Bytes waiting to be written to the client before the library is made
/// to wait.
const MAX_OUTBOUND: usize = 256 * 1024;

/// Transfers, dispositions and flows waiting to be written are held until
/// this many bytes are waiting, or until the library next reads: the
/// library flushes after every frame, and one write per frame was a fifth
/// of a 1.0 connection's CPU. Any other frame is written at its flush.
const COALESCE_OUTBOUND: usize = 16 * 1024;

/// Descriptors of the frames that may wait for the next read: flow,
/// transfer, disposition (small ulongs 0x13-0x15).
fn may_wait(body: &[u8]) -> bool {
    matches!(body, [0x00, 0x53, 0x13..=0x15, ..])
}

/// Longest the client's `close` waits for the links to take what it sent
/// before, and how often that is looked at.
const CLOSE_HOLD: std::time::Duration = std::time::Duration::from_secs(3);
const CLOSE_RECHECK: std::time::Duration = std::time::Duration::from_millis(5);

/// An attach's descriptor: the small ulong 0x12; a flow's 0x13; a
/// close's 0x18.
const ATTACH: [u8; 3] = [0x00, 0x53, 0x12];
const FLOW: [u8; 3] = [0x00, 0x53, 0x13];
const CLOSE: [u8; 3] = [0x00, 0x53, 0x18];

type CreditByLink = HashMap<(u16, u32), tokio::sync::watch::Sender<ClientCredit>>;

/// What a client's flow frames said of one link the broker sends on, in
/// the link's delivery-count numbering (serial numbers, from the broker's
/// initial delivery-count, 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientCredit {
    /// The client takes transfers up to this delivery-count: its last
    /// flow's delivery-count plus its link-credit.
    pub limit: u32,
    /// Flows that asked to drain, so far. On each the library advances the
    /// link's delivery-count to that flow's limit, spending the credit.
    pub drains: u64,
    /// The limit of the last flow that asked to drain.
    pub drained_to: u32,
}

/// What the frame guard sees of a connection's links, for the link tasks:
/// - the link credit clients grant, as their flow frames say, for the
///   links the broker sends on, keyed by the client's channel and link
///   handle (the library keeps credit to itself; the link tasks need it to
///   take no more from a queue than the client asked for);
/// - how many messages the guard passed to the library and how many the
///   publishing links took (the client's `close` is held until they meet).
#[derive(Clone, Debug, Default)]
pub struct LinkBoard {
    links: std::sync::Arc<parking_lot::Mutex<CreditByLink>>,
    /// Messages the guard passed to the library, and messages the
    /// publishing links took from it: the client's `close` waits until
    /// they are equal (see [`FrameGuard`]).
    passed: std::sync::Arc<AtomicU64>,
    taken: std::sync::Arc<AtomicU64>,
}

impl LinkBoard {
    /// Watches the credit of the client's link `handle` on `channel`
    /// (none until its first flow).
    pub fn watch(&self, channel: u16, handle: u32) -> tokio::sync::watch::Receiver<ClientCredit> {
        let (credit, watched) = tokio::sync::watch::channel(ClientCredit::default());
        self.links.lock().insert((channel, handle), credit);
        watched
    }

    /// Forgets a link that ended.
    pub fn forget(&self, channel: u16, handle: u32) {
        self.links.lock().remove(&(channel, handle));
    }

    /// A publishing link took one message from the library.
    pub fn took_message(&self) {
        self.taken.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether every message the client sent has reached a link.
    fn all_taken(&self) -> bool {
        self.taken.load(Ordering::Acquire) >= self.passed.load(Ordering::Acquire)
    }

    /// A flow for the client's link `handle` on `channel`. A flow without
    /// a delivery-count comes from a client that has not seen the broker's
    /// attach: it counts from the initial delivery-count.
    fn granted(&self, channel: u16, handle: u32, flow: &Flow) {
        let Some(link_credit) = flow.link_credit else {
            return;
        };
        let limit = flow.delivery_count.unwrap_or(0).wrapping_add(link_credit);
        if let Some(link) = self.links.lock().get(&(channel, handle)) {
            link.send_modify(|credit| {
                credit.limit = limit;
                if flow.drain {
                    credit.drains += 1;
                    credit.drained_to = limit;
                }
            });
        }
    }
}

/// Most messages being received in several frames at once, per connection
/// (one per link: 64 sessions of 256 links).
const MAX_PARTIAL_DELIVERIES: usize = 64 * 256;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GuardError {
    #[error("values nest deeper than {MAX_NESTING} levels")]
    TooDeep,
    #[error("malformed encoding: {0}")]
    Malformed(&'static str),
    #[error("{0} are not accepted")]
    Unsupported(&'static str),
    #[error("frame of {0} bytes: {1}")]
    Frame(usize, &'static str),
}

impl From<GuardError> for io::Error {
    fn from(error: GuardError) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, error)
    }
}

/// The innermost open value: a list, map or array (until a byte offset;
/// a list or map also until its count of elements), or a described value
/// (until two more values).
#[derive(Clone, Copy, Debug)]
enum Level {
    Compound {
        end: u64,
        /// Elements still to come (None until the count is read).
        left: Option<u64>,
        /// An array's element constructor, which its elements share.
        implied: Option<u8>,
    },
    Described {
        left: u8,
    },
}

/// What comes after a value's size field.
#[derive(Clone, Copy, Debug)]
enum Sized {
    Variable,
    Compound { count_width: u8, map: bool },
    Array { count_width: u8 },
}

/// What a big-endian number being read is.
#[derive(Clone, Copy, Debug)]
enum Number {
    /// A value's size, and what the value is.
    Size(Sized),
    /// The count of elements of the list, map or array just opened.
    Count { map: bool, array: bool },
}

#[derive(Clone, Copy, Debug, Default)]
enum State {
    #[default]
    Constructor,
    /// A big-endian number of `width` bytes, `read` of them so far.
    Number {
        width: u8,
        read: u8,
        value: u64,
        what: Number,
    },
    /// A value's data: the value is complete after it.
    Skip {
        left: u64,
    },
    ArrayConstructor,
}

/// A streaming scanner of encoded AMQP 1.0 values (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct Scanner {
    offset: u64,
    stack: Vec<Level>,
    state: State,
    /// Top-level values completed so far.
    values: u64,
    deepest: usize,
}

impl Scanner {
    /// Whether the bytes so far end exactly after a whole value.
    pub fn at_boundary(&self) -> bool {
        self.stack.is_empty() && matches!(self.state, State::Constructor)
    }

    /// The deepest nesting seen.
    pub fn deepest(&self) -> usize {
        self.deepest
    }

    /// Scans `bytes`; answers how many were read, which is fewer than all
    /// only when `stop_after` top-level values completed first.
    pub fn feed(&mut self, bytes: &[u8], stop_after: Option<u64>) -> Result<usize, GuardError> {
        let mut at = 0;
        while at < bytes.len() {
            if stop_after.is_some_and(|values| self.values >= values) {
                break;
            }
            match self.state {
                State::Skip { left } => {
                    let n = left.min((bytes.len() - at) as u64);
                    at += n as usize;
                    self.offset += n;
                    if n < left {
                        self.state = State::Skip { left: left - n };
                        continue;
                    }
                    self.state = State::Constructor;
                    self.complete()?;
                }
                State::Number {
                    width,
                    read,
                    value,
                    what,
                } => {
                    let value = (value << 8) | u64::from(bytes[at]);
                    at += 1;
                    self.offset += 1;
                    if read + 1 < width {
                        self.state = State::Number {
                            width,
                            read: read + 1,
                            value,
                            what,
                        };
                        continue;
                    }
                    self.state = State::Constructor;
                    match what {
                        Number::Size(sized) => self.sized(value, sized)?,
                        Number::Count { map, array } => self.counted(value, map, array)?,
                    }
                }
                State::Constructor => {
                    // An array element: its constructor is the array's.
                    if let Some(Level::Compound {
                        implied: Some(code),
                        ..
                    }) = self.stack.last()
                    {
                        let code = *code;
                        self.constructor(code)?;
                        continue;
                    }
                    let code = bytes[at];
                    at += 1;
                    self.offset += 1;
                    self.constructor(code)?;
                }
                State::ArrayConstructor => {
                    let code = bytes[at];
                    at += 1;
                    self.offset += 1;
                    self.state = State::Constructor;
                    self.array_constructor(code)?;
                }
            }
        }
        Ok(at)
    }

    fn constructor(&mut self, code: u8) -> Result<(), GuardError> {
        let fixed = |width: u64| State::Skip { left: width };
        let size = |width: u8, sized: Sized| State::Number {
            width,
            read: 0,
            value: 0,
            what: Number::Size(sized),
        };
        match code {
            0x00 => self.push(Level::Described { left: 2 })?,
            0x40..=0x45 => self.complete()?,
            0x50..=0x56 => self.state = fixed(1),
            0x60 | 0x61 => self.state = fixed(2),
            0x70..=0x74 => self.state = fixed(4),
            0x80..=0x84 => self.state = fixed(8),
            0x94 | 0x98 => self.state = fixed(16),
            0xa0..=0xa3 => self.state = size(1, Sized::Variable),
            0xb0..=0xb3 => self.state = size(4, Sized::Variable),
            0xc0 | 0xc1 => {
                let map = code == 0xc1;
                self.state = size(
                    1,
                    Sized::Compound {
                        count_width: 1,
                        map,
                    },
                );
            }
            0xd0 | 0xd1 => {
                let map = code == 0xd1;
                self.state = size(
                    4,
                    Sized::Compound {
                        count_width: 4,
                        map,
                    },
                );
            }
            0xe0 => self.state = size(1, Sized::Array { count_width: 1 }),
            0xf0 => self.state = size(4, Sized::Array { count_width: 4 }),
            _ => return Err(GuardError::Malformed("unknown type constructor")),
        }
        Ok(())
    }

    fn sized(&mut self, size: u64, then: Sized) -> Result<(), GuardError> {
        let end = self.offset + size;
        if self.enclosing_end().is_some_and(|outer| end > outer) {
            return Err(GuardError::Malformed("a value runs past its list"));
        }
        match then {
            Sized::Variable if size == 0 => self.complete(),
            Sized::Variable => {
                self.state = State::Skip { left: size };
                Ok(())
            }
            Sized::Compound { count_width, map } => self.open(end, size, count_width, map, false),
            Sized::Array { count_width } => self.open(end, size, count_width, false, true),
        }
    }

    /// A list, map or array of `size` bytes (its count included) begins.
    fn open(
        &mut self,
        end: u64,
        size: u64,
        count_width: u8,
        map: bool,
        array: bool,
    ) -> Result<(), GuardError> {
        let least = u64::from(count_width) + u64::from(array);
        if size < least {
            return Err(GuardError::Malformed("a list shorter than its count"));
        }
        self.push(Level::Compound {
            end,
            left: None,
            implied: None,
        })?;
        self.state = State::Number {
            width: count_width,
            read: 0,
            value: 0,
            what: Number::Count { map, array },
        };
        Ok(())
    }

    /// The count of the list, map or array just opened.
    fn counted(&mut self, count: u64, map: bool, array: bool) -> Result<(), GuardError> {
        let Some(Level::Compound { end, left, .. }) = self.stack.last_mut() else {
            return Err(GuardError::Malformed("a count outside a list"));
        };
        if map && !count.is_multiple_of(2) {
            return Err(GuardError::Malformed("a map with a key and no value"));
        }
        // Every element takes at least one byte (an array's element
        // constructor is read next, and zero-width elements are refused).
        if count > *end - self.offset {
            return Err(GuardError::Malformed("more elements than bytes"));
        }
        *left = Some(count);
        if array {
            self.state = State::ArrayConstructor;
            return Ok(());
        }
        self.close_ended()
    }

    fn array_constructor(&mut self, code: u8) -> Result<(), GuardError> {
        if matches!(
            code,
            0x00 | 0x40..=0x45 | 0xc0 | 0xc1 | 0xd0 | 0xd1 | 0xe0 | 0xf0
        ) {
            return Err(GuardError::Unsupported(
                "arrays of lists, maps, arrays, described values or zero-width values",
            ));
        }
        let Some(Level::Compound { implied, .. }) = self.stack.last_mut() else {
            return Err(GuardError::Malformed("an array outside a list"));
        };
        // Each element is read as a value with this constructor, so that
        // the elements must fill the array exactly, as a decoder reads it.
        *implied = Some(code);
        self.close_ended()
    }

    fn push(&mut self, level: Level) -> Result<(), GuardError> {
        if self.stack.len() >= MAX_NESTING {
            return Err(GuardError::TooDeep);
        }
        self.stack.push(level);
        self.deepest = self.deepest.max(self.stack.len());
        Ok(())
    }

    fn enclosing_end(&self) -> Option<u64> {
        self.stack.iter().rev().find_map(|level| match level {
            Level::Compound { end, .. } => Some(*end),
            Level::Described { .. } => None,
        })
    }

    /// A list whose elements may all be read: closed if it ends here.
    fn close_ended(&mut self) -> Result<(), GuardError> {
        match self.stack.last() {
            Some(Level::Compound { end, left, .. }) if self.offset >= *end => {
                if self.offset > *end {
                    return Err(GuardError::Malformed("a value runs past its list"));
                }
                if left.is_some_and(|left| left > 0) {
                    return Err(GuardError::Malformed("fewer elements than its count"));
                }
                self.stack.pop();
                self.complete()
            }
            _ => Ok(()),
        }
    }

    /// A value just ended at `offset`: it may end the values around it.
    fn complete(&mut self) -> Result<(), GuardError> {
        loop {
            match self.stack.last_mut() {
                None => {
                    self.values += 1;
                    return Ok(());
                }
                Some(Level::Described { left }) => {
                    *left -= 1;
                    if *left > 0 {
                        return Ok(());
                    }
                    self.stack.pop();
                }
                Some(Level::Compound { end, left, .. }) => {
                    if let Some(left) = left.as_mut() {
                        if *left == 0 {
                            return Err(GuardError::Malformed("more elements than its count"));
                        }
                        *left -= 1;
                    }
                    let (end, left) = (*end, *left);
                    if self.offset < end {
                        return Ok(());
                    }
                    if self.offset > end {
                        return Err(GuardError::Malformed("a value runs past its list"));
                    }
                    if left.is_some_and(|left| left > 0) {
                        return Err(GuardError::Malformed("fewer elements than its count"));
                    }
                    self.stack.pop();
                }
            }
        }
    }
}

/// How deeply the values in `bytes` nest; an error past [`MAX_NESTING`],
/// for an encoding the scanner refuses, or for bytes that end inside a
/// value (as the guard refuses a frame or message cut short).
pub fn nesting_depth(bytes: &[u8]) -> Result<usize, GuardError> {
    let mut scanner = Scanner::default();
    scanner.feed(bytes, None)?;
    if !scanner.at_boundary() {
        return Err(GuardError::Malformed("a value cut short"));
    }
    Ok(scanner.deepest())
}

/// Cuts one direction's bytes into the 8-byte protocol header, passed on
/// as it comes, then frames by the 4-byte size each begins with.
#[derive(Debug)]
struct FrameSplitter {
    /// Protocol header bytes still to pass on.
    header_left: usize,
    /// Of those, how many to drop instead of passing on.
    header_dropped: usize,
    /// Bytes taken in but not yet a whole frame.
    pending: BytesMut,
}

impl FrameSplitter {
    fn new() -> Self {
        Self {
            header_left: 8,
            header_dropped: 0,
            pending: BytesMut::new(),
        }
    }

    /// Takes in `bytes`; the part of them that is the protocol header goes
    /// to `header` (less what is to be dropped).
    fn push(&mut self, mut bytes: &[u8], header: &mut BytesMut) {
        if self.header_left > 0 {
            let n = self.header_left.min(bytes.len());
            let dropped = self.header_dropped.min(n);
            self.header_dropped -= dropped;
            header.extend_from_slice(&bytes[dropped..n]);
            self.header_left -= n;
            bytes = &bytes[n..];
        }
        self.pending.extend_from_slice(bytes);
    }

    /// The size the next frame says it has, once its first 4 bytes are in.
    fn next_size(&self) -> Option<usize> {
        let size: [u8; 4] = self.pending.get(..4)?.try_into().ok()?;
        Some(u32::from_be_bytes(size) as usize)
    }

    /// The next `size` bytes, once they are all in.
    fn take(&mut self, size: usize) -> Option<BytesMut> {
        (self.pending.len() >= size).then(|| self.pending.split_to(size))
    }
}

/// The socket as the library reads it: the protocol header, then only
/// whole frames that passed the checks above (see the module docs).
#[derive(Debug)]
pub struct FrameGuard<S> {
    inner: S,
    max_frame: usize,
    /// The client's bytes.
    inbound: FrameSplitter,
    /// Checked frames, for the library.
    ready: BytesMut,
    /// Messages arriving in several transfers, by channel and link handle.
    partial: HashMap<(u16, u32), Scanner>,
    /// Where the credit of the client's flow frames goes.
    board: LinkBoard,
    /// The library's bytes.
    outbound: FrameSplitter,
    /// Frames for the socket.
    outbound_ready: BytesMut,
    /// `outbound_ready` holds a frame that is written at its flush (see
    /// [`COALESCE_OUTBOUND`]).
    write_at_flush: bool,
    /// Once this resolves, the socket reads as ended and refuses writes:
    /// the library's connection then stops and drops it.
    hang_up: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    /// The client sent its `close`: it and what follows wait in `held`.
    closing: bool,
    held: BytesMut,
    /// Until when the close is held, and the timer that looks again.
    close_held_until: Option<tokio::time::Instant>,
    recheck: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> FrameGuard<S> {
    /// `max_frame`: the largest frame accepted (what the broker's `open`
    /// offers).
    pub fn new(inner: S, max_frame: usize) -> Self {
        Self::with_board(inner, max_frame, LinkBoard::default())
    }

    /// As [`new`](Self::new), reporting to `board` the credit of flow
    /// frames and the messages passed to the library.
    pub fn with_board(inner: S, max_frame: usize, board: LinkBoard) -> Self {
        Self {
            board,
            inner,
            max_frame,
            inbound: FrameSplitter::new(),
            ready: BytesMut::new(),
            partial: HashMap::default(),
            outbound: FrameSplitter::new(),
            outbound_ready: BytesMut::new(),
            write_at_flush: false,
            hang_up: None,
            closing: false,
            held: BytesMut::new(),
            close_held_until: None,
            recheck: None,
        }
    }

    /// Hangs up when `token` is cancelled, whatever the client does: how a
    /// client that never answers the broker's `close` is cut off.
    pub fn hang_up_on(mut self, token: CancellationToken) -> Self {
        self.hang_up = Some(Box::pin(token.cancelled_owned()));
        self
    }

    /// Whether the socket was hung up; registers `cx` to hear of it.
    fn hung_up(&mut self, cx: &mut Context<'_>) -> bool {
        self.hang_up
            .as_mut()
            .is_some_and(|hang_up| hang_up.as_mut().poll(cx).is_ready())
    }

    /// Whether the client's held `close` may reach the library: once the
    /// publishing links took every message sent before it, or after
    /// [`CLOSE_HOLD`]. The library stops the connection on a `close`, and
    /// a session of it that then has a frame to send (a flow, an outcome)
    /// ends, dropping the transfers it has not handed to its links yet:
    /// pre-settled messages the client sent just before closing were lost.
    fn close_may_pass(&mut self, cx: &mut Context<'_>) -> bool {
        let now = tokio::time::Instant::now();
        let until = *self.close_held_until.get_or_insert(now + CLOSE_HOLD);
        if self.board.all_taken() || now >= until {
            return true;
        }
        let recheck = self
            .recheck
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(CLOSE_RECHECK)));
        if recheck.as_mut().poll(cx).is_ready() {
            recheck.as_mut().reset(now + CLOSE_RECHECK);
            // Registers the waker for the new deadline.
            let _ = recheck.as_mut().poll(cx);
        }
        false
    }

    /// The broker's protocol header went to the client already: the one
    /// the library writes is dropped.
    pub fn header_already_sent(mut self) -> Self {
        self.outbound.header_dropped = 8;
        self
    }

    /// Takes in bytes read from the socket; whole frames that pass go to
    /// `ready`.
    pub fn absorb(&mut self, bytes: &[u8]) -> Result<(), GuardError> {
        self.inbound.push(bytes, &mut self.ready);
        while let Some(size) = self.inbound.next_size() {
            if size < 8 {
                return Err(GuardError::Frame(size, "shorter than a frame header"));
            }
            if size > self.max_frame {
                return Err(GuardError::Frame(
                    size,
                    "larger than the max-frame-size offered",
                ));
            }
            let Some(frame) = self.inbound.take(size) else {
                break;
            };
            self.check(&frame)?;
            let passed = if self.closing {
                &mut self.held
            } else {
                &mut self.ready
            };
            match renamed(&frame, Direction::Inbound) {
                Some(frame) => passed.extend_from_slice(&frame),
                None => passed.extend_from_slice(&frame),
            }
        }
        Ok(())
    }

    /// Takes in bytes the library writes; whole frames go to
    /// `outbound_ready`, the broker's attaches with their names restored.
    fn take_outbound(&mut self, bytes: &[u8]) {
        let before = self.outbound_ready.len();
        self.outbound.push(bytes, &mut self.outbound_ready);
        // The protocol header goes at once.
        self.write_at_flush |= self.outbound_ready.len() > before;
        while let Some(size) = self.outbound.next_size() {
            let Some(frame) = self.outbound.take(size.max(8)) else {
                break;
            };
            self.write_at_flush |= !body_of(&frame).is_some_and(may_wait);
            match renamed(&frame, Direction::Outbound) {
                Some(frame) => self.outbound_ready.extend_from_slice(&frame),
                None => self.outbound_ready.extend_from_slice(&frame),
            }
        }
    }

    fn check(&mut self, frame: &[u8]) -> Result<(), GuardError> {
        let size = frame.len();
        let doff = usize::from(frame[4]) * 4;
        if doff < 8 || doff > size {
            return Err(GuardError::Frame(size, "data offset outside the frame"));
        }
        if frame[5] != 0 {
            return Err(GuardError::Frame(size, "not an AMQP frame"));
        }
        let channel = u16::from_be_bytes([frame[6], frame[7]]);
        let body = &frame[doff..];
        if body.is_empty() {
            return Ok(()); // a heartbeat
        }
        let mut performative = Scanner::default();
        let read = performative.feed(body, Some(1))?;
        if !performative.at_boundary() {
            return Err(GuardError::Malformed("a performative cut short"));
        }
        // A transfer's descriptor is the small ulong 0x14.
        let transfer = body.starts_with(&[0x00, 0x53, 0x14]);
        let payload = &body[read..];
        if body.starts_with(&CLOSE) {
            self.closing = true;
        }
        if body.starts_with(&FLOW) {
            if let Ok(flow) = serde_amqp::from_slice::<Flow>(&body[..read]) {
                if let Some(handle) = &flow.handle {
                    self.board.granted(channel, handle.0, &flow);
                }
            }
        }
        if !transfer {
            if !payload.is_empty() {
                return Err(GuardError::Malformed("bytes after a performative"));
            }
            return Ok(());
        }
        let Ok(transfer) = serde_amqp::from_slice::<Transfer>(&body[..read]) else {
            // The library refuses it in its own words.
            return Ok(());
        };
        let key = (channel, transfer.handle.0);
        if transfer.aborted {
            self.partial.remove(&key);
            return Ok(());
        }
        if !self.partial.contains_key(&key) && self.partial.len() >= MAX_PARTIAL_DELIVERIES {
            return Err(GuardError::Unsupported(
                "so many messages in pieces at once",
            ));
        }
        let scanner = self.partial.entry(key).or_default();
        scanner.feed(payload, None)?;
        if !transfer.more {
            let whole = scanner.at_boundary();
            self.partial.remove(&key);
            if !whole {
                return Err(GuardError::Malformed("a message cut short"));
            }
            self.board.passed.fetch_add(1, Ordering::AcqRel);
        }
        Ok(())
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// From the client: its receiving links' names get the suffix.
    Inbound,
    /// To the client: the suffix comes off again.
    Outbound,
}

/// What follows a frame's header (its data offset says where).
fn body_of(frame: &[u8]) -> Option<&[u8]> {
    let doff = usize::from(*frame.get(4)?) * 4;
    frame.get(doff..)
}

/// The frame with its attach renamed, when it is an attach to rename.
fn renamed(frame: &[u8], direction: Direction) -> Option<Vec<u8>> {
    let body = body_of(frame)?;
    if !body.starts_with(&ATTACH) {
        return None;
    }
    let mut attach: Attach = serde_amqp::from_slice(body).ok()?;
    match direction {
        // The client's role `receiver` is `true` on the wire.
        Direction::Inbound if attach.role == Role::Receiver => {
            attach.name.push_str(RECEIVING_SUFFIX);
        }
        Direction::Outbound => {
            attach.name = attach.name.strip_suffix(RECEIVING_SUFFIX)?.to_string();
        }
        Direction::Inbound => return None,
    }
    let body = serde_amqp::to_vec(&attach).ok()?;
    let size = u32::try_from(8 + body.len()).ok()?;
    let mut out = Vec::with_capacity(8 + body.len());
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&[2, 0]);
    out.extend_from_slice(frame.get(6..8)?);
    out.extend_from_slice(&body);
    Some(out)
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for FrameGuard<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.hung_up(cx) {
            return Poll::Ready(Ok(())); // read as the end of the stream
        }
        // The library reads before its connection task waits: frames held
        // back at their flush go now, as far as the socket takes them (if
        // not all, the socket wakes the task when it takes more).
        if let Poll::Ready(Err(error)) = self.poll_drain(cx) {
            return Poll::Ready(Err(error));
        }
        loop {
            if !self.ready.is_empty() {
                let n = self.ready.len().min(buf.remaining());
                buf.put_slice(&self.ready[..n]);
                self.ready.advance(n);
                return Poll::Ready(Ok(()));
            }
            if !self.held.is_empty() {
                if !self.close_may_pass(cx) {
                    return Poll::Pending; // the recheck timer wakes this
                }
                let held = self.held.split();
                self.ready = held;
                continue;
            }
            let mut scratch = [0u8; 8192];
            let mut read = ReadBuf::new(&mut scratch);
            ready!(Pin::new(&mut self.inner).poll_read(cx, &mut read))?;
            let filled = read.filled();
            if filled.is_empty() {
                return Poll::Ready(Ok(())); // end of stream
            }
            let filled = filled.to_vec();
            if let Err(error) = self.absorb(&filled) {
                tracing::info!(%error, "amqp 1.0 client sent a frame the broker refuses, closing");
                return Poll::Ready(Err(error.into()));
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> FrameGuard<S> {
    /// Whether what waits to be written goes now rather than at the
    /// library's next read.
    fn must_write(&self) -> bool {
        self.write_at_flush || self.outbound_ready.len() >= COALESCE_OUTBOUND
    }

    /// Writes what is ready to the socket, as far as it takes it.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.outbound_ready.is_empty() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.outbound_ready))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.outbound_ready.advance(n);
        }
        self.write_at_flush = false;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FrameGuard<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.hung_up(cx) {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        if self.outbound_ready.len() >= MAX_OUTBOUND {
            // The client reads slowly: the library waits with it.
            ready!(self.poll_drain(cx))?;
        }
        self.take_outbound(buf);
        // Written on as far as the socket takes it now; the rest at flush
        // or at the next read.
        if self.must_write() {
            if let Poll::Ready(Err(error)) = self.poll_drain(cx) {
                return Poll::Ready(Err(error));
            }
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.hung_up(cx) {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        if !self.must_write() {
            return Poll::Ready(Ok(())); // written at the next read
        }
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.hung_up(cx) {
            return Poll::Ready(Ok(())); // nothing more is sent
        }
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fe2o3_amqp_types::messaging::message::__private::Serializable;
    use fe2o3_amqp_types::messaging::{Body, Message};
    use fe2o3_amqp_types::performatives::{Attach, Open};
    use fe2o3_amqp_types::primitives::Value;
    use std::time::Duration;

    /// `depth` lists, each holding the next (list8).
    fn nested_lists(depth: usize) -> Vec<u8> {
        let mut bytes = vec![0x45]; // list0
        for _ in 0..depth {
            let mut outer = vec![0xc0, (bytes.len() + 1) as u8, 1];
            if bytes.len() + 1 > 255 {
                let size = (bytes.len() + 4) as u32;
                outer = vec![0xd0];
                outer.extend_from_slice(&size.to_be_bytes());
                outer.extend_from_slice(&1u32.to_be_bytes());
            }
            outer.extend_from_slice(&bytes);
            bytes = outer;
        }
        bytes
    }

    #[test]
    fn what_clients_send_passes_with_its_depth() {
        let value = Value::List(vec![
            Value::Map(Default::default()),
            Value::String("x".into()),
            Value::Array(vec![Value::Symbol("a".into()), Value::Symbol("b".into())].into()),
        ]);
        let bytes = serde_amqp::to_vec(&value).expect("encodes");
        assert_eq!(nesting_depth(&bytes), Ok(2));
        let message = Message::builder()
            .body(Body::<Value>::Value(
                fe2o3_amqp_types::messaging::AmqpValue(value),
            ))
            .build();
        let bytes = serde_amqp::to_vec(&Serializable(message)).expect("encodes");
        assert!(nesting_depth(&bytes).is_ok());
        let open = Open {
            container_id: "c".into(),
            hostname: Some("vhost:/".into()),
            max_frame_size: 1024.into(),
            channel_max: 8.into(),
            idle_time_out: Some(1000),
            outgoing_locales: None,
            incoming_locales: None,
            offered_capabilities: Some(vec!["x".into(), "y".into()].into()),
            desired_capabilities: None,
            properties: None,
        };
        assert!(nesting_depth(&serde_amqp::to_vec(&open).expect("encodes")).is_ok());
    }

    #[test]
    fn deep_nesting_is_refused_before_the_decoder_sees_it() {
        assert!(nesting_depth(&nested_lists(MAX_NESTING - 1)).is_ok());
        assert_eq!(
            nesting_depth(&nested_lists(MAX_NESTING + 1)),
            Err(GuardError::TooDeep)
        );
        assert_eq!(
            nesting_depth(&nested_lists(2_000)),
            Err(GuardError::TooDeep)
        );
        // Described values nest too: a descriptor that is itself described.
        assert_eq!(nesting_depth(&[0x00; 1000]), Err(GuardError::TooDeep));
    }

    #[test]
    fn lies_about_sizes_are_malformed() {
        // A list of 2 bytes holding a string of 10.
        let bytes = [0xc0, 2, 1, 0xa1, 10, b'x'];
        assert!(matches!(
            nesting_depth(&bytes),
            Err(GuardError::Malformed(_))
        ));
        assert!(matches!(
            nesting_depth(&[0xff]),
            Err(GuardError::Malformed(_))
        ));
        // A map of three entries: a key without a value.
        let bytes = [0xc1, 4, 3, 0x40, 0x40, 0x40];
        assert!(matches!(
            nesting_depth(&bytes),
            Err(GuardError::Malformed(_))
        ));
        // Counts that do not match the elements.
        let bytes = [0xc0, 3, 1, 0x40, 0x40];
        assert!(matches!(
            nesting_depth(&bytes),
            Err(GuardError::Malformed(_))
        ));
        let bytes = [0xc0, 2, 2, 0x40];
        assert!(matches!(
            nesting_depth(&bytes),
            Err(GuardError::Malformed(_))
        ));
        // An array whose elements do not fill it: a decoder would read the
        // rest as values the scan skipped.
        let bytes = [0xe0, 6, 2, 0x50, 1, 2, 0xc1, 0];
        assert!(matches!(
            nesting_depth(&bytes),
            Err(GuardError::Malformed(_))
        ));
        // An array of lists.
        let bytes = [0xe0, 3, 1, 0xc0, 0];
        assert!(matches!(
            nesting_depth(&bytes),
            Err(GuardError::Unsupported(_))
        ));
    }

    fn frame(channel: u16, body: &[u8]) -> Vec<u8> {
        let mut frame = ((8 + body.len()) as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(&[2, 0]);
        frame.extend_from_slice(&channel.to_be_bytes());
        frame.extend_from_slice(body);
        frame
    }

    fn transfer(handle: u32, more: bool) -> Vec<u8> {
        let transfer = Transfer {
            handle: handle.into(),
            delivery_id: Some(0),
            delivery_tag: Some(vec![0].into()),
            message_format: Some(0),
            settled: None,
            more,
            rcv_settle_mode: None,
            state: None,
            resume: false,
            aborted: false,
            batchable: false,
        };
        serde_amqp::to_vec(&transfer).expect("encodes")
    }

    #[test]
    fn whole_frames_pass_in_any_pieces_and_bad_ones_fail_the_stream() {
        let attach: Attach = Attach {
            name: "l".into(),
            handle: 0.into(),
            role: fe2o3_amqp_types::definitions::Role::Sender,
            snd_settle_mode: Default::default(),
            rcv_settle_mode: Default::default(),
            source: None,
            target: None,
            unsettled: None,
            incomplete_unsettled: false,
            initial_delivery_count: Some(0),
            max_message_size: None,
            offered_capabilities: None,
            desired_capabilities: None,
            properties: None,
        };
        let mut stream = b"AMQP\x00\x01\x00\x00".to_vec();
        stream.extend(frame(0, &serde_amqp::to_vec(&attach).expect("encodes")));
        stream.extend(frame(0, &[])); // heartbeat
        let mut guard = FrameGuard::new(tokio::io::empty(), 65536);
        for piece in stream.chunks(3) {
            guard.absorb(piece).expect("passes");
        }
        assert_eq!(&guard.ready[..], &stream[..], "passed on unchanged");

        let mut short = FrameGuard::new(tokio::io::empty(), 65536);
        let refused = short.absorb(b"AMQP\x00\x01\x00\x00\x00\x00\x00\x04");
        assert!(matches!(refused, Err(GuardError::Frame(4, _))));
        let mut huge = FrameGuard::new(tokio::io::empty(), 65536);
        let refused = huge.absorb(b"AMQP\x00\x01\x00\x00\x00\x10\x00\x00");
        assert!(matches!(refused, Err(GuardError::Frame(..))));
    }

    #[test]
    fn a_receiving_links_name_is_made_unique_for_the_library_and_restored_for_the_client() {
        let attach = |role| Attach {
            name: "same-name".into(),
            handle: 1.into(),
            role,
            snd_settle_mode: Default::default(),
            rcv_settle_mode: Default::default(),
            source: None,
            target: None,
            unsettled: None,
            incomplete_unsettled: false,
            initial_delivery_count: None,
            max_message_size: None,
            offered_capabilities: None,
            desired_capabilities: None,
            properties: None,
        };
        let name_of = |bytes: &[u8]| -> String {
            let attach: Attach = serde_amqp::from_slice(&bytes[8..]).expect("an attach");
            attach.name
        };
        let inbound = frame(
            3,
            &serde_amqp::to_vec(&attach(Role::Receiver)).expect("encodes"),
        );
        let mut guard = FrameGuard::new(tokio::io::empty(), 65536);
        guard.absorb(b"AMQP\x00\x01\x00\x00").expect("header");
        guard.absorb(&inbound).expect("passes");
        let seen = guard.ready.split_off(8);
        assert_eq!(name_of(&seen), format!("same-name{RECEIVING_SUFFIX}"));
        assert_eq!(&seen[6..8], &[0, 3], "channel kept");
        // A sending link of the same name is left alone.
        guard.ready.clear();
        let sending = frame(
            3,
            &serde_amqp::to_vec(&attach(Role::Sender)).expect("encodes"),
        );
        guard.absorb(&sending).expect("passes");
        assert_eq!(&guard.ready[..], &sending[..]);

        // The broker's answer, written by the library in pieces.
        let mut answer = attach(Role::Sender);
        answer.name = format!("same-name{RECEIVING_SUFFIX}");
        let written = [
            &b"AMQP\x00\x01\x00\x00"[..],
            &frame(3, &serde_amqp::to_vec(&answer).expect("encodes")),
        ]
        .concat();
        let mut guard = FrameGuard::new(tokio::io::empty(), 65536);
        for piece in written.chunks(5) {
            guard.take_outbound(piece);
        }
        let sent = guard.outbound_ready.split_off(8);
        assert_eq!(name_of(&sent), "same-name");
    }

    #[test]
    fn depth_split_over_transfers_is_still_seen() {
        let deep = nested_lists(MAX_NESTING + 4);
        let (first, second) = deep.split_at(deep.len() / 2);
        let mut guard = FrameGuard::new(tokio::io::empty(), 1 << 20);
        guard.absorb(b"AMQP\x00\x01\x00\x00").expect("header");
        let mut piece = transfer(3, true);
        piece.extend_from_slice(first);
        let result = guard.absorb(&frame(1, &piece));
        let mut rest = transfer(3, false);
        rest.extend_from_slice(second);
        let result = result.and_then(|()| guard.absorb(&frame(1, &rest)));
        assert_eq!(result, Err(GuardError::TooDeep));

        // The same split of a shallow message passes, and must end whole.
        let shallow = nested_lists(4);
        let (first, second) = shallow.split_at(3);
        let mut guard = FrameGuard::new(tokio::io::empty(), 1 << 20);
        guard.absorb(b"AMQP\x00\x01\x00\x00").expect("header");
        let mut piece = transfer(3, true);
        piece.extend_from_slice(first);
        guard.absorb(&frame(1, &piece)).expect("first half");
        let mut rest = transfer(3, false);
        rest.extend_from_slice(second);
        guard.absorb(&frame(1, &rest)).expect("second half");
        let mut cut = transfer(4, false);
        cut.extend_from_slice(first);
        assert!(
            guard.absorb(&frame(1, &cut)).is_err(),
            "a message cut short"
        );
    }

    /// A hung-up guard reads as ended and refuses writes, even while a read
    /// waits on a client that sends nothing: how the library's connection
    /// is made to drop a client that never answers the broker's `close`.
    #[tokio::test]
    async fn a_hung_up_socket_reads_as_ended_and_refuses_writes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (_client, broker_side) = tokio::io::duplex(1024);
        let token = CancellationToken::new();
        let mut guard = FrameGuard::new(broker_side, 1 << 20).hang_up_on(token.clone());
        let mut buf = [0u8; 16];
        let waiting = tokio::time::timeout(Duration::from_millis(50), guard.read(&mut buf)).await;
        assert!(waiting.is_err(), "a silent client: the read waits");
        let cancel = token.clone();
        tokio::spawn(async move { cancel.cancel() });
        let read = tokio::time::timeout(Duration::from_secs(5), guard.read(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(0))),
            "the hang-up wakes the read as an end: {read:?}"
        );
        let written = guard.write(b"AMQP").await;
        assert_eq!(
            written.map_err(|error| error.kind()),
            Err(io::ErrorKind::BrokenPipe)
        );
    }

    /// Transfers the library flushes one by one wait for its next read
    /// and go in one write; any other frame goes at its flush.
    #[tokio::test]
    async fn transfers_wait_for_the_next_read_and_other_frames_go_at_their_flush() {
        use futures::FutureExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, broker_side) = tokio::io::duplex(1 << 16);
        let mut guard = FrameGuard::new(broker_side, 1 << 20).header_already_sent();
        let mut buf = vec![0u8; 1 << 16];
        let written_now = |client: &mut tokio::io::DuplexStream, buf: &mut [u8]| {
            client
                .read(buf)
                .now_or_never()
                .map(|read| read.expect("reads"))
        };
        // The library's protocol header, which the handshake sent already.
        guard
            .write_all(b"AMQP\x00\x01\x00\x00")
            .await
            .expect("takes it");
        guard.flush().await.expect("flushes");

        let transfer = frame(1, &transfer(0, false));
        for _ in 0..3 {
            guard.write_all(&transfer).await.expect("takes it");
            guard.flush().await.expect("flushes");
        }
        assert_eq!(written_now(&mut client, &mut buf), None, "held back");
        // The library's read: nothing from the client, the transfers go.
        assert!(guard.read(&mut [0u8; 16]).now_or_never().is_none());
        assert_eq!(written_now(&mut client, &mut buf), Some(3 * transfer.len()));

        let close = frame(0, &CLOSE);
        guard.write_all(&transfer).await.expect("takes it");
        guard.write_all(&close).await.expect("takes it");
        guard.flush().await.expect("flushes");
        assert_eq!(
            written_now(&mut client, &mut buf),
            Some(transfer.len() + close.len()),
            "a close goes at its flush, with what waited before it"
        );
    }
}
