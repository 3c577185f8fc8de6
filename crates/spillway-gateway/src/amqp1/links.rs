//! One task per link, between the library's link and the link's engine
//! channel.
//!
//! - [`publish_from`]: the client sends (the broker's link is a receiver).
//!   Each message becomes an engine publish in confirm mode; the client
//!   hears `accepted` when the engine confirms it (stored, as a 0-9-1
//!   publisher's confirm), `released` when it routed nowhere, `rejected`
//!   when the engine refused it. Credit is granted from the link's floor
//!   and its connection's pool ([`super::credit`]), and not while the
//!   engine holds this link's channel back (it published to an overfull
//!   queue, or the store or memory holds everyone).
//! - [`deliver_to`]: the client receives (the broker's link is a sender).
//!   A credit-limited consumer on the source queue: the engine hands it
//!   what the client's credit allows ([`super::consumer_credit`]), and at
//!   most [`MAX_UNSETTLED`] unsettled; the client's outcome for each
//!   message becomes an ack or a nack.

use std::time::Duration;

use bytes::Bytes;
use fe2o3_amqp::link::delivery::{DeliveryInfo, Sendable};
use fe2o3_amqp::link::{CreditMode, Receiver, RecvError, Sender};
use fe2o3_amqp_types::definitions::{self, AmqpError, LinkError};
use fe2o3_amqp_types::messaging::{Body, Outcome};
use fe2o3_amqp_types::primitives::Value;
use foldhash::HashMap;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use spillway_proto::body::Body as EngineBody;
use spillway_proto::engine::{self as pb, reply, session_command::Command, session_event::Event};
use spillway_proto::management::Amqp1Link;
use std::sync::Arc;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::address::Destination;
use super::consumer_credit::DeliveryLimit;
use super::credit::{CreditPool, LinkCredit, CONNECTION_POOL, LINK_FLOOR};
use super::engine_session::{EngineSession, LinkChannel};
use super::guard::ClientCredit;
use super::mapping;
use super::Amqp1Error;
use crate::metrics::GatewayMetrics;

/// The error a receiving link is detached with when the library refuses
/// what the client sent on it; None where the library has detached it
/// itself (a message over the link's max-message-size) or the link is gone.
///
/// A client that sends transfers past the credit granted is the case that
/// matters: the library refuses the transfer before it is decoded or put in
/// the link's unsettled map, and the client hears
/// `amqp:link:transfer-limit-exceeded`, so it cannot make the broker hold
/// more than the credit it was given.
fn receive_error_condition(error: &RecvError) -> Option<definitions::Error> {
    let (condition, text): (definitions::ErrorCondition, &str) = match error {
        RecvError::TransferLimitExceeded => (
            LinkError::TransferLimitExceeded.into(),
            "transfer sent with no link credit",
        ),
        RecvError::MessageDecode(_) => (
            AmqpError::DecodeError.into(),
            "the message cannot be decoded",
        ),
        RecvError::DeliveryIdIsNone
        | RecvError::DeliveryTagIsNone
        | RecvError::InconsistentFieldInMultiFrameDelivery => (
            AmqpError::InvalidField.into(),
            "a transfer lacks its delivery-id or tag, or changes them mid-message",
        ),
        RecvError::IllegalRcvSettleModeInTransfer => (
            AmqpError::NotAllowed.into(),
            "rcv-settle-mode second on a link negotiated as first",
        ),
        RecvError::TransactionalAcquisitionIsNotImeplemented => (
            AmqpError::NotImplemented.into(),
            "transactional acquisition",
        ),
        RecvError::LinkStateError(_) | RecvError::MessageSizeExceeded(_) => return None,
    };
    Some(definitions::Error::new(
        condition,
        Some(text.to_string()),
        None,
    ))
}

/// What every link of a connection needs to know.
#[derive(Clone)]
pub struct LinkContext {
    pub session: Arc<EngineSession>,
    /// The user who logged in (a message's `user-id` must name it).
    pub user: String,
    /// The connection's credit beyond its sending links' floors.
    pub credit_pool: Arc<CreditPool>,
    /// Bodies above this many bytes are compressed (`gateway.message_compression_*`).
    pub compress_above: Option<u64>,
    /// Largest body, published or delivered (`gateway.max_message_size`).
    pub max_message_size: u64,
    /// The credit clients grant on the links the broker sends on, and the
    /// messages the client's `close` waits for.
    pub board: super::guard::LinkBoard,
    /// Links, messages and settlements are counted as 0-9-1's channels'.
    pub metrics: GatewayMetrics,
    /// Cancelled once the connection's end is under way: a link whose
    /// engine session went waits for it (see [`LinkEnd::EngineGone`]).
    pub connection_ending: CancellationToken,
}

/// How a link's loop ended.
enum LinkEnd {
    /// The link ends on its own: the broker detaches it, with this error
    /// if any.
    Detach(Option<definitions::Error>),
    /// The engine's session ended (closed by management, the broker
    /// stopping, the engine gone): the connection closes, with the reason.
    /// A detach of the link's own sent first would reach the client ahead
    /// of the connection's `close` and hide that reason, so the link stays
    /// attached until the connection is done with it.
    EngineGone,
}

/// How often a sending link waiting for credit looks whether its client
/// detached it.
const DETACH_CHECK: Duration = Duration::from_millis(250);

/// The client sends to `destination` (None: the null target, each
/// message's `to` says where).
pub async fn publish_from(
    mut receiver: Receiver,
    destination: Option<Destination>,
    shown: Amqp1Link,
    link: LinkContext,
) {
    let LinkChannel {
        channel,
        mut events,
    } = match open_publishing_channel(&link, shown).await {
        Ok(opened) => opened,
        Err(error) => {
            let _ = receiver.close_with_error(error.condition()).await;
            return;
        }
    };
    let _attached = link.metrics.amqp1_link_attached();
    let session = link.session.clone();
    let mut share = LinkCredit::new(
        link.credit_pool.clone(),
        LINK_FLOOR,
        LINK_FLOOR + CONNECTION_POOL,
    );
    let mut flow = session.flow();
    receiver.set_credit_mode(CreditMode::Manual);
    let mut blocked = flow.borrow().holds(channel);
    // What the client may still send without more credit. The floor at
    // attach: a link borrows from the pool only once it has used credit.
    let mut credit: u32 = 0;
    if !blocked && receiver.set_credit(LINK_FLOOR).await.is_ok() {
        credit = LINK_FLOOR;
    }
    let mut unsettled: HashMap<u64, DeliveryInfo> = HashMap::default();
    let mut next_seq: u64 = 0;
    let mut returned = false;
    // The connection stopped: credit and outcomes can no longer be sent,
    // what the client sent before is still published (read on until the
    // library reports the link's end).
    let mut client_gone = false;
    let ended = loop {
        tokio::select! {
            received = receiver.recv::<Body<Value>>() => {
                let delivery = match received {
                    Ok(delivery) => delivery,
                    Err(error) => {
                        tracing::info!(%error, "amqp 1.0 receiving link ended");
                        break LinkEnd::Detach(receive_error_condition(&error));
                    }
                };
                link.board.took_message();
                credit = credit.saturating_sub(1);
                let (info, message) = delivery.into_parts();
                let publish = match publish_command(&link, &destination, message) {
                    Ok(publish) => publish,
                    Err(error) => {
                        let _ = receiver.reject(info, error.condition()).await;
                        continue;
                    }
                };
                next_seq += 1;
                let publish = pb::Publish { channel, confirm_seq: next_seq, ..publish };
                unsettled.insert(next_seq, info);
                if session.send(Command::Publish(publish)).await.is_err() {
                    break LinkEnd::EngineGone;
                }
                link.metrics.count_published();
            }
            event = events.recv() => {
                let Some(event) = event else { break LinkEnd::EngineGone };
                match event {
                    Event::Returned(_) => returned = true,
                    Event::Confirm(confirm) => {
                        let Some(info) = unsettled.remove(&confirm.seq) else { continue };
                        // A return comes just before the confirm of the same
                        // message (the engine sends both as it routes it).
                        let settled = if std::mem::take(&mut returned) {
                            receiver.release(info).await
                        } else if confirm.ack {
                            receiver.accept(info).await
                        } else {
                            let error = definitions::Error::new(
                                AmqpError::ResourceLimitExceeded,
                                Some("the broker could not store the message".to_string()),
                                None,
                            );
                            receiver.reject(info, error).await
                        };
                        client_gone |= settled.is_err();
                    }
                    Event::ChannelError(error) => {
                        break LinkEnd::Detach(Some(Amqp1Error::Engine(error.error.unwrap_or_default()).condition()));
                    }
                    _ => {}
                }
            }
            changed = flow.changed() => {
                if changed.is_err() {
                    break LinkEnd::EngineGone;
                }
                // Held back by granting no more: the client may still use
                // what it has (taking credit back would race transfers
                // already on the wire, which the library counts as a
                // protocol error), so at most what it holds arrives.
                blocked = flow.borrow_and_update().holds(channel);
            }
        }
        // What is confirmed goes back to the pool; more credit once enough
        // is spent (`LinkCredit::top_up`), unless producers are held back.
        let in_flight = unsettled.len() as u32;
        share.settle(in_flight.saturating_add(credit));
        if !blocked && !client_gone {
            if let Some(grant) = share.top_up(credit, in_flight) {
                client_gone |= receiver.set_credit(grant).await.is_err();
                credit = grant;
            }
        }
    };
    let error = match ended {
        LinkEnd::EngineGone => return link.connection_ending.cancelled().await,
        LinkEnd::Detach(error) => error,
    };
    session.close_link(channel).await;
    match error {
        Some(error) => {
            let _ = receiver.close_with_error(error).await;
        }
        None => {
            let _ = receiver.close().await;
        }
    }
}

async fn open_publishing_channel(
    link: &LinkContext,
    shown: Amqp1Link,
) -> Result<LinkChannel, Amqp1Error> {
    let opened = link.session.open_link(shown).await?;
    let confirming = link
        .session
        .request_ok(|request_id| {
            Command::ConfirmSelect(pb::ConfirmSelect {
                request_id,
                channel: opened.channel,
            })
        })
        .await;
    if let Err(error) = confirming {
        link.session.close_link(opened.channel).await;
        return Err(error);
    }
    Ok(opened)
}

/// The engine publish for one message (its channel and confirm number
/// filled in by the caller).
fn publish_command(
    link: &LinkContext,
    destination: &Option<Destination>,
    message: fe2o3_amqp_types::messaging::Message<Body<Value>>,
) -> Result<pb::Publish, Amqp1Error> {
    let published = mapping::from_amqp1(message).map_err(Amqp1Error::Mapping)?;
    if let Some(user) = &published.user_id {
        if *user != link.user {
            return Err(Amqp1Error::UserId(user.clone(), link.user.clone()));
        }
    }
    let (exchange, routing_key) = match destination {
        Some(destination) => destination.route(published.subject.as_deref()),
        None => {
            let to = published.to.as_deref().ok_or(Amqp1Error::NoTo)?;
            super::address::parse_target(to)
                .map_err(Amqp1Error::Address)?
                .route(published.subject.as_deref())
        }
    };
    let (body, body_encoding, body_size) = match link.compress_above {
        Some(threshold) => EngineBody::compress_above(published.body, threshold).wire(),
        None => EngineBody::identity(published.body).wire(),
    };
    Ok(pb::Publish {
        channel: 0,
        exchange,
        routing_key,
        mandatory: true,
        properties: published.properties,
        body,
        confirm_seq: 0,
        persistent: published.persistent,
        trace_context: Default::default(),
        body_encoding,
        body_size,
        expiration_ms: published.expiration_ms,
    })
}

/// The client receives from `queue`. `settled`: the client asked for
/// pre-settled transfers (at-most-once), so the consumer takes no acks.
pub async fn deliver_to(
    mut sender: Sender,
    queue: String,
    settled: bool,
    mut credit: watch::Receiver<ClientCredit>,
    shown: Amqp1Link,
    link: LinkContext,
) {
    let session = link.session.clone();
    let (
        consumer_tag,
        LinkChannel {
            channel,
            mut events,
        },
    ) = match start_consumer(&link, &queue, settled, shown).await {
        Ok(started) => started,
        Err(error) => {
            let _ = sender.close_with_error(error.condition()).await;
            return;
        }
    };
    let _attached = link.metrics.amqp1_link_attached();
    let mut outcomes = FuturesUnordered::new();
    // The engine hands the consumer what the client's credit allows, no
    // more (a delivery beyond it would wait here, unacknowledged).
    let mut limit = DeliveryLimit::default();
    let ended = 'link: loop {
        tokio::select! {
            changed = credit.changed() => {
                if changed.is_err() {
                    // The frame guard went with the socket.
                    break LinkEnd::EngineGone;
                }
                // Outcomes the client sent ahead of its flow go to the
                // engine first, as far as the library has passed them on.
                while let Some(Some((tag, outcome))) = outcomes.next().now_or_never() {
                    settle(&session, &link.metrics, channel, tag, outcome).await;
                }
            }
            event = events.recv() => {
                let Some(event) = event else { break LinkEnd::EngineGone };
                match event {
                    Event::Deliver(deliver) => 'deliver: {
                        let tag = deliver.delivery_tag;
                        let body: Bytes = match deliver.body().decode(link.max_message_size) {
                            Ok(body) => body,
                            Err(error) => {
                                tracing::error!(%error, "a stored body does not decode");
                                session.deliveries_written(1).await;
                                let _ = session.send(Command::Nack(pb::Nack { channel, delivery_tag: tag, multiple: false, requeue: false })).await;
                                // The client's credit is not spent: the
                                // engine may hand over one more.
                                limit.dropped();
                                break 'deliver;
                            }
                        };
                        let message = mapping::to_amqp1(&deliver.properties, body, deliver.redelivered);
                        let sendable = Sendable::builder().message(message).settled(settled).build();
                        // Waits for the client's credit; meanwhile settles
                        // what the client settles and looks for a detach.
                        let sent = loop {
                            tokio::select! {
                                sent = sender.send_batchable_ref(&sendable) => break sent,
                                Some((tag, outcome)) = outcomes.next(), if !outcomes.is_empty() => {
                                    settle(&session, &link.metrics, channel, tag, outcome).await;
                                }
                                () = tokio::time::sleep(DETACH_CHECK) => {
                                    if sender.on_detach().now_or_never().is_some() {
                                        session.deliveries_written(1).await;
                                        break 'link LinkEnd::Detach(None);
                                    }
                                }
                            }
                        };
                        session.deliveries_written(1).await;
                        if sent.is_ok() {
                            limit.sent();
                            link.metrics.count_delivered(1);
                        }
                        match sent {
                            Ok(outcome) if !settled => outcomes.push(outcome.map(move |outcome| (tag, outcome))),
                            Ok(_) => {}
                            Err(error) => {
                                tracing::info!(%error, "amqp 1.0 sending link ended");
                                break 'link LinkEnd::Detach(None);
                            }
                        }
                    }
                    Event::ConsumerCancelled(_) => {
                        break LinkEnd::Detach(Some(definitions::Error::new(
                            AmqpError::ResourceDeleted,
                            Some(format!("queue '{queue}' was deleted")),
                            None,
                        )));
                    }
                    Event::ChannelError(error) => {
                        break LinkEnd::Detach(Some(Amqp1Error::Engine(error.error.unwrap_or_default()).condition()));
                    }
                    _ => {}
                }
            }
            Some((tag, outcome)) = outcomes.next(), if !outcomes.is_empty() => {
                settle(&session, &link.metrics, channel, tag, outcome).await;
            }
            _ = sender.on_detach() => {
                // Outcomes the client sent before it detached count.
                while let Some(Some((tag, outcome))) = outcomes.next().now_or_never() {
                    settle(&session, &link.metrics, channel, tag, outcome).await;
                }
                break LinkEnd::Detach(None);
            }
        }
        let client = *credit.borrow();
        if let Some(delivery_limit) = limit.update(&client) {
            let told = session
                .send(Command::ConsumerCredit(pb::ConsumerCredit {
                    channel,
                    consumer_tag: consumer_tag.clone(),
                    delivery_limit,
                }))
                .await;
            if told.is_err() {
                break LinkEnd::EngineGone;
            }
        }
    };
    let error = match ended {
        LinkEnd::EngineGone => return link.connection_ending.cancelled().await,
        LinkEnd::Detach(error) => error,
    };
    // Unsettled deliveries go back to the queue with the channel.
    session.close_link(channel).await;
    if let Some(error) = error {
        let _ = sender.close_with_error(error).await;
    } else {
        let _ = sender.close().await;
    }
}

/// Most messages a sending link's client may hold unsettled: past it the
/// engine hands the link nothing more until the client settles some,
/// whatever credit it grants (the consumer's prefetch).
pub const MAX_UNSETTLED: u32 = 2000;

/// Starts the link's consumer, credit-limited with [`MAX_UNSETTLED`] as
/// its prefetch; its tag and channel.
async fn start_consumer(
    link: &LinkContext,
    queue: &str,
    settled: bool,
    shown: Amqp1Link,
) -> Result<(String, LinkChannel), Amqp1Error> {
    let session = &link.session;
    let opened = session.open_link(shown).await?;
    let channel = opened.channel;
    let started = async {
        session
            .request_ok(|request_id| {
                Command::Qos(pb::Qos {
                    request_id,
                    channel,
                    prefetch_count: MAX_UNSETTLED,
                    global: false,
                })
            })
            .await?;
        session
            .request_ok(|request_id| {
                Command::Consume(pb::Consume {
                    request_id,
                    channel,
                    queue: queue.to_string(),
                    consumer_tag: String::new(),
                    no_ack: settled,
                    exclusive: false,
                    arguments: Bytes::new(),
                    credit_limited: true,
                })
            })
            .await
    };
    match started.await {
        Ok(reply::Result::ConsumeOk(ok)) => Ok((ok.consumer_tag, opened)),
        Ok(_) => {
            session.close_link(channel).await;
            Err(Amqp1Error::EngineGone)
        }
        Err(error) => {
            session.close_link(channel).await;
            Err(error)
        }
    }
}

/// The engine's part of the client's outcome for one delivery, as RabbitMQ
/// 4 maps them: accepted acks; released requeues; rejected dead-letters
/// (or drops); modified requeues and counts a failed delivery, or, with
/// `undeliverable-here`, dead-letters.
async fn settle(
    session: &EngineSession,
    metrics: &GatewayMetrics,
    channel: u32,
    delivery_tag: u64,
    outcome: Result<Outcome, fe2o3_amqp::link::SendError>,
) {
    let command = match outcome {
        Ok(Outcome::Accepted(_)) => Command::Ack(pb::Ack {
            channel,
            delivery_tag,
            multiple: false,
        }),
        Ok(other) => {
            let requeue = match other {
                Outcome::Released(_) => true,
                Outcome::Modified(modified) => modified.undeliverable_here != Some(true),
                _ => false,
            };
            Command::Nack(pb::Nack {
                channel,
                delivery_tag,
                multiple: false,
                requeue,
            })
        }
        // The link or session went before the client settled: the message
        // is requeued when the channel closes.
        Err(_) => return,
    };
    if session.send(command).await.is_ok() {
        metrics.count_acknowledged();
    }
}
