//! A hand-driven AMQP 1.0 client for tests that play a client no library
//! would be: one that sends transfers past the credit it was granted.
//! Performatives are encoded and decoded with fe2o3-amqp-types and
//! serde_amqp (what fe2o3's own client uses); the frames around them are
//! written here.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use fe2o3_amqp_types::definitions::{Handle, Role};
use fe2o3_amqp_types::messaging::DeliveryState;
use fe2o3_amqp_types::performatives::{
    Attach, Begin, ChannelMax, MaxFrameSize, Open, Performative, Transfer,
};
use fe2o3_amqp_types::primitives::Binary;
use fe2o3_amqp_types::sasl::{SaslCode, SaslInit, SaslOutcome};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SASL_HEADER: &[u8; 8] = b"AMQP\x03\x01\x00\x00";
const AMQP_HEADER: &[u8; 8] = b"AMQP\x00\x01\x00\x00";
const SASL_FRAME: u8 = 1;
const AMQP_FRAME: u8 = 0;
/// How long one frame may take to arrive.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest frame this client reads.
const MAX_FRAME: usize = 1 << 20;

/// One connection with one session (channel 0), logged in with PLAIN.
pub struct RawAmqp1 {
    socket: TcpStream,
    next_delivery_id: u32,
}

impl RawAmqp1 {
    /// SASL PLAIN as `user`, `open` for `vhost`, and `begin`.
    pub async fn connect(
        addr: SocketAddr,
        user: &str,
        password: &str,
        vhost: &str,
    ) -> anyhow::Result<Self> {
        let mut socket = TcpStream::connect(addr).await?;
        socket.write_all(SASL_HEADER).await?;
        expect_header(&mut socket, SASL_HEADER).await?;
        let _mechanisms = read_frame(&mut socket, SASL_FRAME).await?;
        let init = SaslInit {
            mechanism: "PLAIN".into(),
            initial_response: Some(Binary::from(format!("\0{user}\0{password}").into_bytes())),
            hostname: None,
        };
        write_frame(&mut socket, SASL_FRAME, &serde_amqp::to_vec(&init)?, &[]).await?;
        let outcome: SaslOutcome =
            serde_amqp::from_slice(&read_frame(&mut socket, SASL_FRAME).await?)
                .context("expected sasl-outcome")?;
        anyhow::ensure!(
            matches!(outcome.code, SaslCode::Ok),
            "login refused: {outcome:?}"
        );
        socket.write_all(AMQP_HEADER).await?;
        expect_header(&mut socket, AMQP_HEADER).await?;
        let mut client = Self {
            socket,
            next_delivery_id: 0,
        };
        client
            .send(
                Performative::Open(Open {
                    container_id: "raw-amqp1".into(),
                    hostname: Some(format!("vhost:{vhost}")),
                    max_frame_size: MaxFrameSize(MAX_FRAME as u32),
                    channel_max: ChannelMax(0),
                    idle_time_out: None,
                    outgoing_locales: None,
                    incoming_locales: None,
                    offered_capabilities: None,
                    desired_capabilities: None,
                    properties: None,
                }),
                &[],
            )
            .await?;
        client
            .send(
                Performative::Begin(Begin {
                    remote_channel: None,
                    next_outgoing_id: 0,
                    incoming_window: 10_000,
                    outgoing_window: 10_000,
                    handle_max: Handle(u32::MAX),
                    offered_capabilities: None,
                    desired_capabilities: None,
                    properties: None,
                }),
                &[],
            )
            .await?;
        client
            .until(|p| matches!(p, Performative::Open(_)))
            .await
            .context("expected open")?;
        client
            .until(|p| matches!(p, Performative::Begin(_)))
            .await
            .context("expected begin")?;
        Ok(client)
    }

    /// Attaches a link on which the client sends (the broker receives) to
    /// `address`, as `handle`, and waits for the broker's attach.
    pub async fn attach_sender(&mut self, handle: u32, address: &str) -> anyhow::Result<()> {
        let target = fe2o3_amqp_types::messaging::Target::builder()
            .address(address.to_string())
            .build();
        self.send(
            Performative::Attach(Attach {
                name: format!("raw-sender-{handle}"),
                handle: Handle(handle),
                role: Role::Sender,
                snd_settle_mode: Default::default(),
                rcv_settle_mode: Default::default(),
                source: Some(Box::new(fe2o3_amqp_types::messaging::Source::default())),
                target: Some(Box::new(target.into())),
                unsettled: None,
                incomplete_unsettled: false,
                initial_delivery_count: Some(0),
                max_message_size: None,
                offered_capabilities: None,
                desired_capabilities: None,
                properties: None,
            }),
            &[],
        )
        .await?;
        self.until(|p| matches!(p, Performative::Attach(a) if a.handle.0 == handle))
            .await
            .context("expected the broker's attach")?;
        Ok(())
    }

    /// Sends one unsettled message of `body` (a data section) on `handle`,
    /// whatever credit it has.
    pub async fn transfer(&mut self, handle: u32, body: &[u8]) -> anyhow::Result<u32> {
        let id = self.next_delivery_id;
        self.next_delivery_id += 1;
        let transfer = Transfer {
            handle: Handle(handle),
            delivery_id: Some(id),
            delivery_tag: Some(Binary::from(id.to_be_bytes().to_vec())),
            message_format: Some(0),
            settled: Some(false),
            more: false,
            rcv_settle_mode: None,
            state: None,
            resume: false,
            aborted: false,
            batchable: false,
        };
        // A data section: descriptor 0x75, then a binary of up to 255 bytes.
        anyhow::ensure!(body.len() <= 255, "a short body only");
        let mut message = vec![0x00, 0x53, 0x75, 0xa0, body.len() as u8];
        message.extend_from_slice(body);
        self.send(Performative::Transfer(transfer), &message)
            .await?;
        Ok(id)
    }

    /// Writes one performative (and its payload) on channel 0.
    pub async fn send(&mut self, performative: Performative, payload: &[u8]) -> anyhow::Result<()> {
        let body = serde_amqp::to_vec(&performative)?;
        write_frame(&mut self.socket, AMQP_FRAME, &body, payload).await
    }

    /// The next performative from the broker (empty frames skipped).
    pub async fn next(&mut self) -> anyhow::Result<Performative> {
        loop {
            let body = read_frame(&mut self.socket, AMQP_FRAME).await?;
            if body.is_empty() {
                continue;
            }
            return serde_amqp::from_slice(&body)
                .map_err(|error| anyhow::anyhow!("undecodable performative: {error}"));
        }
    }

    /// Sends `body` on link `handle` and waits for its outcome: an error
    /// unless the broker settled it `accepted`. Answers its delivery id.
    pub async fn transfer_accepted(&mut self, handle: u32, body: &[u8]) -> anyhow::Result<u32> {
        let sent = self.transfer(handle, body).await?;
        let outcome = self
            .until(|p| {
                matches!(p, Performative::Disposition(d)
                    if d.first <= sent && d.last.unwrap_or(d.first) >= sent)
            })
            .await?;
        let Performative::Disposition(outcome) = outcome else {
            anyhow::bail!("until answered {outcome:?}, which it was not asked for");
        };
        anyhow::ensure!(
            matches!(outcome.state, Some(DeliveryState::Accepted(_))),
            "message {sent} was not accepted: {outcome:?}"
        );
        Ok(sent)
    }

    /// Reads until a performative `wanted` accepts, and answers it.
    pub async fn until(
        &mut self,
        wanted: impl Fn(&Performative) -> bool,
    ) -> anyhow::Result<Performative> {
        loop {
            let performative = self.next().await?;
            if wanted(&performative) {
                return Ok(performative);
            }
        }
    }
}

async fn expect_header(socket: &mut TcpStream, expected: &[u8; 8]) -> anyhow::Result<()> {
    let mut header = [0u8; 8];
    tokio::time::timeout(READ_TIMEOUT, socket.read_exact(&mut header))
        .await
        .context("no protocol header in time")??;
    anyhow::ensure!(&header == expected, "protocol header {header:?}");
    Ok(())
}

async fn write_frame(
    socket: &mut TcpStream,
    frame_type: u8,
    body: &[u8],
    payload: &[u8],
) -> anyhow::Result<()> {
    let size = u32::try_from(8 + body.len() + payload.len())?;
    let mut frame = size.to_be_bytes().to_vec();
    frame.extend_from_slice(&[2, frame_type, 0, 0]);
    frame.extend_from_slice(body);
    frame.extend_from_slice(payload);
    socket.write_all(&frame).await?;
    Ok(())
}

/// One frame of `frame_type`; answers its body (the performative and any
/// payload after it).
async fn read_frame(socket: &mut TcpStream, frame_type: u8) -> anyhow::Result<Vec<u8>> {
    let mut head = [0u8; 8];
    tokio::time::timeout(READ_TIMEOUT, socket.read_exact(&mut head))
        .await
        .context("no frame in time")??;
    let size = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let offset = usize::from(head[4]) * 4;
    anyhow::ensure!(
        (8..=MAX_FRAME).contains(&size) && (8..=size).contains(&offset),
        "frame of {size} bytes, data offset {offset}"
    );
    anyhow::ensure!(
        head[5] == frame_type,
        "frame type {} not {frame_type}",
        head[5]
    );
    let mut rest = vec![0u8; size - 8];
    tokio::time::timeout(READ_TIMEOUT, socket.read_exact(&mut rest))
        .await
        .context("no whole frame in time")??;
    Ok(rest.split_off(offset - 8))
}
