//! The start of an AMQP 1.0 connection, before the library takes over: the
//! SASL layer, and the client's `open` read ahead of the library to learn
//! its vhost.
//!
//! Written here rather than left to `fe2o3-amqp`'s acceptor because its
//! SASL acceptor is synchronous (the login is the engine's, an async call,
//! possibly over gRPC) and its connection handle does not expose the
//! client's `open` (whose `hostname` names the vhost). Both are small: a
//! SASL frame is an 8-byte header and one described list, and the `open`
//! is read whole, decoded, and handed on to the library unchanged
//! ([`Replay`]).
//!
//! Every size here is bounded before anything is allocated: a SASL frame
//! by [`MAX_SASL_FRAME`], the `open` frame by [`MAX_OPEN_FRAME`].

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use fe2o3_amqp_types::performatives::Open;
use fe2o3_amqp_types::primitives::{Array, Binary, Symbol};
use fe2o3_amqp_types::sasl::{SaslCode, SaslInit, SaslMechanisms, SaslOutcome};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

/// `AMQP 3 1 0 0`: the client wants a SASL layer first.
pub const SASL_HEADER: [u8; 8] = *b"AMQP\x03\x01\x00\x00";
/// `AMQP 0 1 0 0`: AMQP 1.0 itself.
pub const AMQP_HEADER: [u8; 8] = *b"AMQP\x00\x01\x00\x00";
/// `AMQP 2 1 0 0`: TLS negotiated inside AMQP (not offered: use AMQPS).
pub const TLS_HEADER: [u8; 8] = *b"AMQP\x02\x01\x00\x00";

/// Largest SASL frame read: a PLAIN response with a long password fits
/// many times over.
pub const MAX_SASL_FRAME: usize = 8 * 1024;
/// Largest `open` frame read ahead (the spec's minimum max-frame-size is
/// 512 bytes, and nothing before `open` has negotiated more; proton sends
/// about 200). Larger is refused.
pub const MAX_OPEN_FRAME: usize = 64 * 1024;

/// SASL frames carry type 1 in their header; AMQP frames type 0.
const SASL_FRAME_TYPE: u8 = 1;
const AMQP_FRAME_TYPE: u8 = 0;

/// Whether the 8 bytes a client opened with are AMQP 1.0's (any of its
/// three layers), so that the listener hands it to this protocol.
pub fn is_amqp1_header(header: &[u8; 8]) -> bool {
    *header == SASL_HEADER || *header == AMQP_HEADER || *header == TLS_HEADER
}

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("frame of {0} bytes is larger than the {1} allowed here")]
    TooLarge(usize, usize),
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("expected protocol header {expected:?}, got {got:?}")]
    Header { expected: [u8; 8], got: [u8; 8] },
}

/// Reads one frame (size, doff, type, channel, body) of the given type,
/// at most `max` bytes long; answers its body, the extended header skipped.
pub async fn read_frame<R: AsyncRead + Unpin>(
    read: &mut R,
    frame_type: u8,
    max: usize,
) -> Result<(Bytes, Bytes), HandshakeError> {
    let mut head = [0u8; 8];
    read.read_exact(&mut head).await?;
    let size = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if size > max {
        return Err(HandshakeError::TooLarge(size, max));
    }
    let doff = usize::from(head[4]) * 4;
    if size < 8 || doff < 8 || doff > size {
        return Err(HandshakeError::Malformed(format!(
            "size {size}, data offset {doff}"
        )));
    }
    if head[5] != frame_type {
        return Err(HandshakeError::Malformed(format!(
            "frame type {} where {frame_type} was expected",
            head[5]
        )));
    }
    let mut rest = BytesMut::zeroed(size - 8);
    read.read_exact(&mut rest).await?;
    let mut whole = BytesMut::with_capacity(size);
    whole.extend_from_slice(&head);
    whole.extend_from_slice(&rest);
    let whole = whole.freeze();
    let body = whole.slice(doff..);
    Ok((whole, body))
}

/// One SASL frame around `body`.
fn sasl_frame(body: &[u8]) -> Vec<u8> {
    let size = (8 + body.len()) as u32;
    let mut frame = Vec::with_capacity(size as usize);
    frame.extend_from_slice(&size.to_be_bytes());
    frame.extend_from_slice(&[2, SASL_FRAME_TYPE, 0, 0]);
    frame.extend_from_slice(body);
    frame
}

/// The `sasl-mechanisms` frame offering `mechanisms`.
pub fn mechanisms_frame(mechanisms: &[&str]) -> Vec<u8> {
    let offered = SaslMechanisms {
        sasl_server_mechanisms: Array(mechanisms.iter().map(|m| Symbol::from(*m)).collect()),
    };
    // Serialising a list of symbols cannot fail.
    let body = serde_amqp::to_vec(&offered).unwrap_or_default();
    sasl_frame(&body)
}

/// The `sasl-outcome` frame.
pub fn outcome_frame(code: SaslCode) -> Vec<u8> {
    let outcome = SaslOutcome {
        code,
        additional_data: None,
    };
    let body = serde_amqp::to_vec(&outcome).unwrap_or_default();
    sasl_frame(&body)
}

/// A client's `sasl-init`: the mechanism it chose and its response.
#[derive(Debug, PartialEq, Eq)]
pub struct ClientInit {
    pub mechanism: String,
    pub response: Vec<u8>,
}

/// Decodes a `sasl-init` frame body.
pub fn decode_init(body: &[u8]) -> Result<ClientInit, HandshakeError> {
    let init: SaslInit = serde_amqp::from_slice(body)
        .map_err(|error| HandshakeError::Malformed(format!("sasl-init: {error}")))?;
    Ok(ClientInit {
        mechanism: init.mechanism.into_inner(),
        response: init
            .initial_response
            .map(Binary::into_vec)
            .unwrap_or_default(),
    })
}

/// Decodes an `open` frame body (the performative; an `open` has no
/// payload after it).
pub fn decode_open(body: &[u8]) -> Result<Open, HandshakeError> {
    serde_amqp::from_slice::<Open>(body)
        .map_err(|error| HandshakeError::Malformed(format!("open: {error}")))
}

/// The vhost an `open`'s hostname names, as RabbitMQ 4 reads it:
/// `vhost:NAME` is vhost NAME, anything else (a DNS name, or nothing) the
/// default vhost `/`.
pub fn vhost_of(hostname: Option<&str>) -> &str {
    match hostname.and_then(|name| name.strip_prefix("vhost:")) {
        Some(vhost) if !vhost.is_empty() => vhost,
        _ => "/",
    }
}

/// Reads the AMQP header, answers it with ours (some clients, fe2o3's
/// among them, send nothing more until they have it), then reads the
/// `open` frame whole. Answers the bytes read (for [`Replay`]) and the
/// decoded `open`.
pub async fn read_open<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
) -> Result<(Bytes, Open), HandshakeError> {
    let mut header = [0u8; 8];
    stream.read_exact(&mut header).await?;
    if header != AMQP_HEADER {
        return Err(HandshakeError::Header {
            expected: AMQP_HEADER,
            got: header,
        });
    }
    answer_header(stream).await?;
    read_open_frame(stream, header).await
}

/// Writes AMQP 1.0's protocol header.
pub async fn answer_header<S: AsyncWrite + Unpin>(stream: &mut S) -> Result<(), HandshakeError> {
    stream.write_all(&AMQP_HEADER).await?;
    stream.flush().await?;
    Ok(())
}

/// The `open` frame after an AMQP header already read.
pub async fn read_open_frame<R: AsyncRead + Unpin>(
    read: &mut R,
    header: [u8; 8],
) -> Result<(Bytes, Open), HandshakeError> {
    let (frame, body) = read_frame(read, AMQP_FRAME_TYPE, MAX_OPEN_FRAME).await?;
    let open = decode_open(&body)?;
    let mut seen = BytesMut::with_capacity(8 + frame.len());
    seen.extend_from_slice(&header);
    seen.extend_from_slice(&frame);
    Ok((seen.freeze(), open))
}

/// Writes the SASL header back and offers `mechanisms`; answers the
/// client's `sasl-init`.
pub async fn sasl_start<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    mechanisms: &[&str],
) -> Result<ClientInit, HandshakeError> {
    let mut hello = SASL_HEADER.to_vec();
    hello.extend_from_slice(&mechanisms_frame(mechanisms));
    stream.write_all(&hello).await?;
    stream.flush().await?;
    let (_, body) = read_frame(stream, SASL_FRAME_TYPE, MAX_SASL_FRAME).await?;
    decode_init(&body)
}

/// Sends the outcome of the SASL exchange.
pub async fn sasl_finish<S: AsyncWrite + Unpin>(
    stream: &mut S,
    code: SaslCode,
) -> Result<(), HandshakeError> {
    stream.write_all(&outcome_frame(code)).await?;
    stream.flush().await?;
    Ok(())
}

/// A stream that first gives back bytes already read from it (the AMQP
/// header and the `open` frame), then reads on. Writes go straight
/// through.
#[derive(Debug)]
pub struct Replay<S> {
    seen: Bytes,
    inner: S,
}

impl<S> Replay<S> {
    pub fn new(seen: Bytes, inner: S) -> Self {
        Self { seen, inner }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Replay<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.seen.is_empty() {
            let n = self.seen.len().min(buf.remaining());
            buf.put_slice(&self.seen[..n]);
            self.seen.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Replay<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vhost_is_read_from_the_hostname_as_rabbitmq_4_does() {
        assert_eq!(vhost_of(Some("vhost:shop")), "shop");
        assert_eq!(vhost_of(Some("vhost:/")), "/");
        assert_eq!(vhost_of(Some("localhost")), "/");
        assert_eq!(vhost_of(Some("vhost:")), "/");
        assert_eq!(vhost_of(None), "/");
    }

    #[tokio::test]
    async fn a_sasl_init_round_trips_and_an_oversized_frame_is_refused_unread() {
        let init = SaslInit {
            mechanism: Symbol::from("PLAIN"),
            initial_response: Some(Binary::from(b"\0guest\0guest".to_vec())),
            hostname: None,
        };
        let frame = sasl_frame(&serde_amqp::to_vec(&init).expect("encodes"));
        let (_, body) = read_frame(&mut &frame[..], SASL_FRAME_TYPE, MAX_SASL_FRAME)
            .await
            .expect("read");
        let decoded = decode_init(&body).expect("decodes");
        assert_eq!(decoded.mechanism, "PLAIN");
        assert_eq!(decoded.response, b"\0guest\0guest");

        let mut huge = (u32::MAX).to_be_bytes().to_vec();
        huge.extend_from_slice(&[2, SASL_FRAME_TYPE, 0, 0]);
        let refused = read_frame(&mut &huge[..], SASL_FRAME_TYPE, MAX_SASL_FRAME).await;
        assert!(matches!(refused, Err(HandshakeError::TooLarge(..))));
    }

    #[tokio::test]
    async fn the_open_is_decoded_and_replayed_byte_for_byte() {
        let open = Open {
            container_id: "client-1".into(),
            hostname: Some("vhost:shop".into()),
            max_frame_size: 65536.into(),
            channel_max: 16.into(),
            idle_time_out: None,
            outgoing_locales: None,
            incoming_locales: None,
            offered_capabilities: None,
            desired_capabilities: None,
            properties: None,
        };
        let body = serde_amqp::to_vec(&open).expect("encodes");
        let mut wire = AMQP_HEADER.to_vec();
        wire.extend_from_slice(&((8 + body.len()) as u32).to_be_bytes());
        wire.extend_from_slice(&[2, AMQP_FRAME_TYPE, 0, 0]);
        wire.extend_from_slice(&body);
        wire.extend_from_slice(b"next frame");
        let mut read = &wire[8..];
        let (seen, decoded) = read_open_frame(&mut read, AMQP_HEADER).await.expect("read");
        assert_eq!(decoded.hostname.as_deref(), Some("vhost:shop"));
        let mut replayed = Vec::new();
        Replay::new(seen, read)
            .read_to_end(&mut replayed)
            .await
            .expect("replays");
        assert_eq!(replayed, wire);
    }
}
