//! AMQP 1.0, served on the same listeners as 0-9-1 (the protocol header
//! decides, as on RabbitMQ 4's port 5672), over the same engine.
//!
//! - [`handshake`]: SASL (PLAIN, EXTERNAL, ANONYMOUS when configured) and
//!   the client's `open`, read here (its hostname names the vhost);
//! - the connection, session and link state machines are `fe2o3-amqp`'s
//!   acceptors, fed the socket after the handshake;
//! - [`guard`]: only whole, well-formed frames whose values nest at most
//!   32 deep reach the library's decoder (which would otherwise recurse
//!   without limit);
//! - [`engine_session`]: one engine session per connection, one engine
//!   channel per link, the engine's events routed to their link;
//! - [`links`]: a task per link, turning transfers into publishes and
//!   deliveries into transfers, outcomes into acks and nacks;
//! - [`address`] and [`mapping`]: RabbitMQ 4's addresses and its mapping
//!   between 1.0 message sections and 0-9-1 properties.
//!
//! Bounds: the SASL and `open` frames ([`handshake`]), the frame size
//! (`gateway.frame_max`), sessions per connection and links per session
//! ([`MAX_SESSIONS`], [`MAX_LINKS_PER_SESSION`]), links per connection
//! (`gateway.channel_max`, as 0-9-1's channels), unsettled messages per
//! link where the client sends ([`credit::LINK_FLOOR`] each, and together at
//! most [`credit::CONNECTION_POOL`] more borrowed by busy links), the
//! consumer's prefetch of at most 1000 where it receives, message size
//! (`gateway.max_message_size`).

pub mod address;
pub mod consumer_credit;
pub mod credit;
pub mod engine_session;
pub mod guard;
pub mod handshake;
pub mod links;
pub mod mapping;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use fe2o3_amqp::acceptor::{
    ConnectionAcceptor, LinkAcceptor, LinkEndpoint, ListenerConnectionHandle,
    ListenerSessionHandle, SessionAcceptor,
};
use fe2o3_amqp_types::definitions::{self, AmqpError, ConnectionError, Role, SenderSettleMode};
use fe2o3_amqp_types::messaging::TargetArchetype;
use fe2o3_amqp_types::performatives::Attach;
use fe2o3_amqp_types::sasl::SaslCode;
use parking_lot::Mutex;
use spillway_amqp::encode_table;
use spillway_amqp::reply_code;
use spillway_proto::engine::{self as pb, reply, session_command::Command};
use spillway_proto::management::Amqp1Link;
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::auth::{self, AuthError};
use crate::listener::{ClientStream, ConnectionContext, CLOSE_TIMEOUT};

use self::address::{AddressError, Destination};
use self::engine_session::EngineSession;
use self::guard::{FrameGuard, LinkBoard};
use self::handshake::{HandshakeError, Replay, AMQP_HEADER, SASL_HEADER, TLS_HEADER};
use self::links::LinkContext;
use self::mapping::MappingError;

pub use self::handshake::is_amqp1_header;

/// Most sessions a connection may begin.
pub const MAX_SESSIONS: u16 = 64;
/// Most links a session may attach.
pub const MAX_LINKS_PER_SESSION: u32 = 256;
/// What ends a link or a connection, as an AMQP 1.0 error.
#[derive(Debug, thiserror::Error)]
pub enum Amqp1Error {
    #[error("the engine is gone")]
    EngineGone,
    #[error("{}", .0.text)]
    Engine(pb::AmqpError),
    #[error("{0}")]
    Address(AddressError),
    #[error("{0}")]
    Mapping(MappingError),
    #[error("user_id property set to '{0}' but authenticated user was '{1}'")]
    UserId(String, String),
    #[error("a message sent to the null target needs a 'to' address")]
    NoTo,
    #[error("at most {0} links may be open on a connection (gateway.channel_max)")]
    TooManyLinks(usize),
    #[error("{0}")]
    Unsupported(String),
}

impl Amqp1Error {
    /// The 1.0 error condition a client sees, as RabbitMQ 4 names them.
    pub fn condition(&self) -> definitions::Error {
        let condition: definitions::ErrorCondition = match self {
            Amqp1Error::EngineGone => AmqpError::InternalError.into(),
            Amqp1Error::Engine(error) => engine_condition(error.code as u16),
            Amqp1Error::Address(_) => AmqpError::InvalidField.into(),
            Amqp1Error::Mapping(_) => AmqpError::DecodeError.into(),
            Amqp1Error::UserId(..) => AmqpError::UnauthorizedAccess.into(),
            Amqp1Error::NoTo => AmqpError::PreconditionFailed.into(),
            Amqp1Error::TooManyLinks(_) => AmqpError::ResourceLimitExceeded.into(),
            Amqp1Error::Unsupported(_) => AmqpError::NotImplemented.into(),
        };
        definitions::Error::new(condition, Some(self.to_string()), None)
    }
}

/// A 0-9-1 reply code from the engine as a 1.0 error condition.
fn engine_condition(code: u16) -> definitions::ErrorCondition {
    match code {
        reply_code::NOT_FOUND => AmqpError::NotFound.into(),
        reply_code::ACCESS_REFUSED => AmqpError::UnauthorizedAccess.into(),
        reply_code::PRECONDITION_FAILED => AmqpError::PreconditionFailed.into(),
        reply_code::RESOURCE_LOCKED => AmqpError::ResourceLocked.into(),
        reply_code::RESOURCE_ERROR => AmqpError::ResourceLimitExceeded.into(),
        reply_code::NOT_ALLOWED => AmqpError::NotAllowed.into(),
        reply_code::NOT_IMPLEMENTED => AmqpError::NotImplemented.into(),
        reply_code::CONNECTION_FORCED => ConnectionError::ConnectionForced.into(),
        _ => AmqpError::InternalError.into(),
    }
}

/// Serves an AMQP 1.0 client whose first 8 bytes were `header`, within the
/// handshake's `deadline` until its `open`.
pub(crate) async fn serve<S: ClientStream + std::fmt::Debug>(
    mut stream: S,
    header: [u8; 8],
    peer: SocketAddr,
    deadline: Instant,
    refusal: Option<String>,
    context: ConnectionContext,
    mut stopped: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let opening = tokio::time::timeout_at(deadline, open(&mut stream, header, peer, &context));
    let (user, seen, vhost, container) = match opening.await {
        Err(_) => {
            tracing::info!(%peer, "amqp 1.0 handshake not finished in time, closing");
            return Ok(());
        }
        Ok(Err(error)) => {
            tracing::debug!(%peer, %error, "amqp 1.0 handshake failed");
            return Ok(());
        }
        Ok(Ok(None)) => return Ok(()),
        Ok(Ok(Some(opened))) => opened,
    };
    let config = &context.config;
    let mut acceptor = ConnectionAcceptor::builder()
        .container_id("spillway")
        .max_frame_size(config.settings.frame_max.max(512))
        .channel_max(MAX_SESSIONS - 1);
    if config.settings.heartbeat > 0 {
        acceptor = acceptor.idle_time_out(u32::from(config.settings.heartbeat) * 1000);
    }
    let acceptor = acceptor.build();
    // Only frames the guard passed reach the library's decoder.
    let board = LinkBoard::default();
    // Cut when a close is not answered in time (see `close`).
    let hang_up = CancellationToken::new();
    let guarded = FrameGuard::with_board(
        Replay::new(seen, stream),
        config.settings.frame_max.max(512) as usize,
        board.clone(),
    )
    // The protocol header was answered before the `open` was read: the
    // guard drops the library's own.
    .header_already_sent()
    .hang_up_on(hang_up.clone());
    let mut connection = match acceptor.accept(guarded).await {
        Ok(connection) => connection,
        Err(error) => {
            tracing::debug!(%peer, %error, "amqp 1.0 open failed");
            return Ok(());
        }
    };
    if let Some(refusal) = refusal {
        let error = definitions::Error::new(AmqpError::ResourceLimitExceeded, Some(refusal), None);
        close(&mut connection, Some(error), &hang_up).await;
        return Ok(());
    }
    let session = match open_engine_session(&context, peer, &user, &vhost, &container).await {
        Ok(session) => session,
        Err(error) => {
            tracing::info!(%peer, %user, %vhost, %error, "amqp 1.0 connection refused");
            close(&mut connection, Some(error.condition()), &hang_up).await;
            return Ok(());
        }
    };
    // Counted once open in its vhost, as a 0-9-1 connection is.
    let _open = context.metrics.connection_opened();
    let _open_amqp1 = context.metrics.amqp1_connection_opened();
    tracing::debug!(%peer, %user, %vhost, "amqp 1.0 connection open");
    let link = LinkContext {
        session: session.clone(),
        user,
        credit_pool: credit::CreditPool::new(credit::CONNECTION_POOL),
        compress_above: config.settings.compress_above(),
        max_message_size: config.settings.max_message_size,
        board,
        metrics: context.metrics.clone(),
        connection_ending: CancellationToken::new(),
    };
    let tasks = Tasks::default();
    let mut closed = session.closed();
    let reason = loop {
        tokio::select! {
            incoming = connection.next_incoming_session() => {
                let Some(incoming) = incoming else { break None };
                if tasks.sessions() >= usize::from(MAX_SESSIONS) {
                    break Some(definitions::Error::new(
                        AmqpError::ResourceLimitExceeded,
                        Some(format!("at most {MAX_SESSIONS} sessions per connection")),
                        None,
                    ));
                }
                let acceptor = SessionAcceptor::builder()
                    .handle_max(MAX_LINKS_PER_SESSION - 1)
                    .build();
                let channel = incoming.channel;
                match acceptor.accept_incoming_session(incoming, &mut connection).await {
                    Ok(listener) => {
                        let handle = tokio::spawn(serve_session(listener, channel, link.clone(), tasks.clone()));
                        tasks.add_session(handle);
                    }
                    Err(error) => tracing::debug!(%peer, %error, "amqp 1.0 session not begun"),
                }
            }
            changed = closed.changed() => {
                let reason = if changed.is_ok() { closed.borrow().clone() } else { None };
                break Some(definitions::Error::new(
                    ConnectionError::ConnectionForced,
                    Some(reason.unwrap_or_else(|| "closed by the broker".to_string())),
                    None,
                ));
            }
            _ = stopped.changed() => {
                break Some(definitions::Error::new(
                    ConnectionError::ConnectionForced,
                    Some("broker shutting down".to_string()),
                    None,
                ));
            }
        }
    };
    // Links whose engine session went wait for this (see `LinkEnd`).
    let _ending = link.connection_ending.clone().drop_guard();
    match reason {
        // Ended by the client: what it sent before is published first.
        None => {
            link.connection_ending.cancel();
            tasks.finish(CLOSE_TIMEOUT).await;
            close(&mut connection, None, &hang_up).await;
        }
        // Ended by the broker: the `close` and its reason go out first.
        // The library writes no session frame after its `close`, so a
        // link's detach (as the links end, or as their tasks are aborted
        // and the library's link handles dropped) cannot come before it.
        reason @ Some(_) => {
            close(&mut connection, reason, &hang_up).await;
            tasks.abort_all().await;
        }
    }
    tracing::debug!(%peer, "amqp 1.0 connection closed");
    Ok(())
}

/// Sends the broker's `close` and waits for the client's, at most
/// [`CLOSE_TIMEOUT`]: a client that never answers is then cut off (the
/// library would otherwise wait for it, holding the socket, for ever).
async fn close(
    connection: &mut ListenerConnectionHandle,
    error: Option<definitions::Error>,
    hang_up: &CancellationToken,
) {
    let closing = async {
        match error {
            Some(error) => connection.close_with_error(error).await,
            None => connection.close().await,
        }
    };
    if tokio::time::timeout(CLOSE_TIMEOUT, closing).await.is_err() {
        tracing::debug!("amqp 1.0 client did not answer the close in time, cutting it off");
        hang_up.cancel();
    }
}

/// The login and the `open`: the user, the bytes read ahead of the
/// library, the vhost, and the client's container id. None: refused, and
/// told so.
async fn open<S: ClientStream>(
    stream: &mut S,
    header: [u8; 8],
    peer: SocketAddr,
    context: &ConnectionContext,
) -> Result<Option<(String, bytes::Bytes, String, String)>, HandshakeError> {
    let config = &context.config;
    let certificate_user = stream.certificate_user();
    let user = match header {
        SASL_HEADER => {
            let mut mechanisms = Vec::new();
            if certificate_user.is_some() {
                mechanisms.push("EXTERNAL");
            }
            mechanisms.push("PLAIN");
            if config.settings.amqp1_anonymous_user().is_some() {
                mechanisms.push("ANONYMOUS");
            }
            let init = handshake::sasl_start(stream, &mechanisms).await?;
            let login = match (
                init.mechanism.as_str(),
                config.settings.amqp1_anonymous_user(),
            ) {
                ("ANONYMOUS", Some(user)) => Ok(pb::AuthenticateRequest {
                    user: user.to_string(),
                    password: None,
                    peer_is_loopback: peer.ip().is_loopback(),
                }),
                (mechanism, _) => auth::login_request(
                    mechanism,
                    &init.response,
                    peer.ip(),
                    certificate_user.as_deref(),
                ),
            };
            match authenticate(login, peer, context).await {
                Ok(user) => {
                    handshake::sasl_finish(stream, SaslCode::Ok).await?;
                    user
                }
                Err(refusal) => {
                    crate::listener::log_login_refusal(context, peer, &refusal);
                    let user = refusal.user().unwrap_or("");
                    if context
                        .login_throttle
                        .failed(peer.ip(), user, config.clock.now())
                    {
                        tracing::warn!(%peer, "logins from this address are throttled");
                    }
                    handshake::sasl_finish(stream, SaslCode::Auth).await?;
                    return Ok(None);
                }
            }
        }
        AMQP_HEADER if config.settings.amqp1_anonymous_user().is_some() => {
            // No SASL layer: the anonymous user, when one is configured.
            let user = config
                .settings
                .amqp1_anonymous_user()
                .unwrap_or_default()
                .to_string();
            let login = Ok(pb::AuthenticateRequest {
                user,
                password: None,
                peer_is_loopback: peer.ip().is_loopback(),
            });
            match authenticate(login, peer, context).await {
                Ok(user) => {
                    handshake::answer_header(stream).await?;
                    let (seen, open) = handshake::read_open_frame(stream, header).await?;
                    let vhost = handshake::vhost_of(open.hostname.as_deref()).to_string();
                    return Ok(Some((user, seen, vhost, open.container_id)));
                }
                Err(refusal) => {
                    crate::listener::log_login_refusal(context, peer, &refusal);
                    return Ok(None);
                }
            }
        }
        AMQP_HEADER | TLS_HEADER => {
            // Spec 2.2 and 5.3.1: a server that requires SASL answers with
            // the SASL header and closes.
            stream.write_all(&SASL_HEADER).await?;
            stream.shutdown().await?;
            return Ok(None);
        }
        _ => return Ok(None),
    };
    if header == SASL_HEADER {
        context.login_throttle.succeeded(peer.ip(), &user);
    }
    let (seen, open) = handshake::read_open(stream).await?;
    let vhost = handshake::vhost_of(open.hostname.as_deref()).to_string();
    Ok(Some((user, seen, vhost, open.container_id)))
}

/// Checks a login with the engine, after the throttle's wait.
async fn authenticate(
    login: Result<pb::AuthenticateRequest, AuthError>,
    peer: SocketAddr,
    context: &ConnectionContext,
) -> Result<String, AuthError> {
    let request = login?;
    let wait = context
        .login_throttle
        .wait(peer.ip(), context.config.clock.now());
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
    let user = request.user.clone();
    match context.engine.authenticate(request).await {
        Ok(result) => auth::login_outcome(user, result),
        Err(error) => {
            tracing::warn!(%peer, %error, "cannot check an amqp 1.0 login now");
            Err(AuthError::Refused(user))
        }
    }
}

/// Opens the connection's engine session in `vhost`; refused as the engine
/// refuses a 0-9-1 `connection.open` (no such vhost, no access, limits).
async fn open_engine_session(
    context: &ConnectionContext,
    peer: SocketAddr,
    user: &str,
    vhost: &str,
    container: &str,
) -> Result<Arc<EngineSession>, Amqp1Error> {
    let streams = tokio::time::timeout(
        context.config.settings.handshake_timeout,
        context.engine.open_session(),
    )
    .await
    .map_err(|_| Amqp1Error::EngineGone)?
    .map_err(|_| Amqp1Error::EngineGone)?;
    let session = EngineSession::new(
        streams.commands,
        usize::from(context.config.settings.channel_max),
    );
    tokio::spawn(EngineSession::route(
        Arc::downgrade(&session),
        streams.events,
    ));
    let mut properties = FieldTable::default();
    let text = |value: &str| AMQPValue::LongString(LongString::from(value.to_string()));
    properties.insert("product".into(), text(container));
    properties.insert("connection_name".into(), text(container));
    properties.insert("protocol".into(), text("AMQP 1.0"));
    let opened = session
        .request(|request_id| {
            Command::Open(pb::OpenSession {
                request_id,
                vhost: vhost.to_string(),
                user: user.to_string(),
                client_address: peer.to_string(),
                client_properties: encode_table(&properties),
            })
        })
        .await?;
    if let reply::Result::Error(error) = opened {
        return Err(Amqp1Error::Engine(error));
    }
    Ok(session)
}

/// The tasks of one connection's sessions and links, ended together when
/// the connection ends (each holds the engine session open).
#[derive(Clone, Default)]
struct Tasks {
    sessions: Arc<Mutex<Vec<JoinHandle<()>>>>,
    links: Arc<Mutex<Vec<LinkTask>>>,
}

struct LinkTask {
    task: JoinHandle<()>,
    /// Takes the client's messages (the client is the link's sender).
    incoming: bool,
}

impl Tasks {
    fn add_session(&self, task: JoinHandle<()>) {
        let mut sessions = self.sessions.lock();
        sessions.retain(|task| !task.is_finished());
        sessions.push(task);
    }

    fn add_link(&self, task: JoinHandle<()>, incoming: bool) {
        let mut links = self.links.lock();
        links.retain(|link| !link.task.is_finished());
        links.push(LinkTask { task, incoming });
    }

    fn sessions(&self) -> usize {
        let mut sessions = self.sessions.lock();
        sessions.retain(|task| !task.is_finished());
        sessions.len()
    }

    /// The client closed: its incoming links hand the engine what it sent
    /// before (transfers read from the socket, not yet published; settled
    /// ones have no other chance), for at most `within`. Then every task
    /// ends.
    async fn finish(&self, within: Duration) {
        let incoming: Vec<JoinHandle<()>> = {
            let mut links = self.links.lock();
            let (incoming, outgoing) = links.drain(..).partition(|link| link.incoming);
            *links = outgoing;
            incoming.into_iter().map(|link| link.task).collect()
        };
        let deadline = Instant::now() + within;
        for mut task in incoming {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                task.abort();
                let _ = task.await;
            }
        }
        self.abort_all().await;
    }

    /// Ends every task, and returns once each has ended: what they count
    /// (sessions, links) is then no longer counted, before the connection
    /// itself stops counting.
    async fn abort_all(&self) {
        let sessions: Vec<JoinHandle<()>> = self.sessions.lock().drain(..).collect();
        let links: Vec<JoinHandle<()>> =
            self.links.lock().drain(..).map(|link| link.task).collect();
        for task in sessions.iter().chain(&links) {
            task.abort();
        }
        for task in sessions.into_iter().chain(links) {
            let _ = task.await;
        }
    }
}

/// Accepts a session's links until it ends.
/// `channel`: the client's number for the session (its flow frames'
/// channel).
async fn serve_session(
    mut session: ListenerSessionHandle,
    channel: u16,
    link: LinkContext,
    tasks: Tasks,
) {
    let _begun = link.metrics.amqp1_session_begun();
    let acceptor = LinkAcceptor::builder()
        .max_message_size(link.max_message_size)
        .build();
    while let Some(attach) = session.next_incoming_attach().await {
        let plan = plan_link(&attach);
        let shown = shown_link(&attach, channel, plan.as_ref().ok());
        let settled = attach.snd_settle_mode == SenderSettleMode::Settled;
        let handle = attach.handle.0;
        // Watched before the attach is answered: the client's first flow
        // follows at once.
        let credit = (attach.role == Role::Receiver).then(|| link.board.watch(channel, handle));
        let endpoint = match acceptor.accept_incoming_attach(attach, &mut session).await {
            Ok(endpoint) => endpoint,
            Err(error) => {
                tracing::debug!(?error, "amqp 1.0 link not attached");
                continue;
            }
        };
        let link = link.clone();
        let incoming = matches!(endpoint, LinkEndpoint::Receiver(_));
        let task = match (endpoint, plan) {
            (LinkEndpoint::Receiver(receiver), Ok(LinkPlan::Publish(destination))) => {
                tokio::spawn(links::publish_from(receiver, destination, shown, link))
            }
            (LinkEndpoint::Sender(sender), Ok(LinkPlan::Consume(queue))) => {
                let credit = credit.unwrap_or_else(|| link.board.watch(channel, handle));
                let board = link.board.clone();
                tokio::spawn(async move {
                    links::deliver_to(sender, queue, settled, credit, shown, link).await;
                    board.forget(channel, handle);
                })
            }
            (LinkEndpoint::Receiver(receiver), Err(error)) => {
                let _ = receiver.close_with_error(error.condition()).await;
                continue;
            }
            (LinkEndpoint::Sender(sender), Err(error)) => {
                let _ = sender.close_with_error(error.condition()).await;
                continue;
            }
            (LinkEndpoint::Receiver(receiver), Ok(_)) => {
                let _ = receiver.close().await;
                continue;
            }
            (LinkEndpoint::Sender(sender), Ok(_)) => {
                let _ = sender.close().await;
                continue;
            }
        };
        tasks.add_link(task, incoming);
    }
    let _ = session.end().await;
}

/// Longest name or address management is shown of a link, in bytes: the
/// rest is cut (the engine keeps them for as long as the link is open).
const MAX_SHOWN_BYTES: usize = 256;

/// What management lists of an attaching link: `session` is the client's
/// channel number for its session.
fn shown_link(attach: &Attach, session: u16, plan: Option<&LinkPlan>) -> Amqp1Link {
    let incoming = attach.role == Role::Sender;
    let address = if incoming {
        match attach.target.as_deref() {
            Some(TargetArchetype::Target(target)) => target.address.clone(),
            _ => None,
        }
    } else {
        attach
            .source
            .as_deref()
            .and_then(|source| source.address.clone())
    };
    let name = attach
        .name
        .strip_suffix(guard::RECEIVING_SUFFIX)
        .unwrap_or(&attach.name);
    let queue = match plan {
        Some(LinkPlan::Consume(queue)) => queue.as_str(),
        _ => "",
    };
    Amqp1Link {
        session: u32::from(session),
        name: cut(name, MAX_SHOWN_BYTES),
        incoming,
        address: cut(address.as_deref().unwrap_or(""), MAX_SHOWN_BYTES),
        queue: cut(queue, MAX_SHOWN_BYTES),
    }
}

/// `text`'s first `max` bytes at most, cut at a character boundary.
fn cut(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// What an attaching link is for.
enum LinkPlan {
    /// The client sends; None is the null target.
    Publish(Option<Destination>),
    /// The client receives from this queue.
    Consume(String),
}

/// Reads an attach's address: a sending client's target, a receiving
/// client's source.
fn plan_link(attach: &Attach) -> Result<LinkPlan, Amqp1Error> {
    match attach.role {
        // The client is the sender: the broker receives, at the target.
        Role::Sender => {
            let address = match attach.target.as_deref() {
                Some(TargetArchetype::Target(target)) => target.address.clone(),
                Some(_) => {
                    return Err(Amqp1Error::Unsupported(
                        "transactions (coordinator links) are not supported".into(),
                    ))
                }
                None => None,
            };
            match address {
                None => Ok(LinkPlan::Publish(None)),
                Some(address) => address::parse_target(&address)
                    .map(|destination| LinkPlan::Publish(Some(destination)))
                    .map_err(Amqp1Error::Address),
            }
        }
        Role::Receiver => {
            let address = attach
                .source
                .as_deref()
                .and_then(|source| source.address.clone());
            match address {
                Some(address) => address::parse_source(&address)
                    .map(LinkPlan::Consume)
                    .map_err(Amqp1Error::Address),
                None => Err(Amqp1Error::Address(AddressError::Unknown(String::new()))),
            }
        }
    }
}
