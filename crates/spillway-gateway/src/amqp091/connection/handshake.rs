//! The server side of the handshake, from connection.start to
//! connection.open: offers our properties and SASL mechanisms, authenticates
//! the client (via [`crate::auth`]), negotiates channel-max, frame-max and
//! heartbeat, and reads which notifications the client understands. Its
//! result, [`Negotiated`], is what a [`super::Connection`] starts from.

use std::net::SocketAddr;

use amq_protocol::protocol::{connection as conn, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};
use spillway_amqp::{reply_code, MethodId};
use spillway_proto::engine::{AuthenticateRequest, LoginResult};

use super::ConnectionError;
use crate::auth;
use crate::GatewayConfig;
use spillway_amqp::codec::{self, FrameWriter, RawFrame};

/// What the client said it understands (connection.start-ok capabilities).
#[derive(Debug, Default, Clone, Copy)]
pub struct Capabilities {
    pub consumer_cancel_notify: bool,
    pub connection_blocked: bool,
}

/// The negotiated connection, ready for channels. Produced by the handshake.
pub struct Negotiated {
    pub user: String,
    pub vhost: String,
    pub client_properties: FieldTable,
    pub capabilities: Capabilities,
    pub frame_max: u32,
    pub channel_max: u16,
    pub heartbeat: u16,
}

/// The server side of connection.start … connection.open, one frame at a time.
pub struct Handshake<'a> {
    config: &'a GatewayConfig,
    peer: SocketAddr,
    stage: Stage,
    user: String,
    /// The SASL mechanism the client chose.
    mechanism: String,
    client_properties: FieldTable,
    tuned: Tuned,
    /// The CN of the client's verified TLS certificate: SASL EXTERNAL is
    /// offered and accepted only when this is set.
    certificate_user: Option<String>,
    /// Why the login was refused, for the I/O loop's log and metric.
    refusal: Option<auth::AuthError>,
}

/// Which client method the handshake waits for next.
enum Stage {
    StartOk,
    /// The engine checks the login.
    Login,
    TuneOk,
    Open,
}

/// The limits agreed in tune / tune-ok.
#[derive(Default)]
struct Tuned {
    channel_max: u16,
    frame_max: u32,
    heartbeat: u16,
}

pub enum HandshakeStep {
    Continue,
    /// connection.start-ok received: ask the engine to check this login,
    /// and give its answer to [`Handshake::on_login`].
    Authenticate(AuthenticateRequest),
    /// connection.open received: open the engine session for this vhost.
    Open(Negotiated),
}

/// What the server tells clients it supports, in connection.start.
const SERVER_CAPABILITIES: [&str; 7] = [
    "publisher_confirms",
    "exchange_exchange_bindings",
    "basic.nack",
    "consumer_cancel_notify",
    "connection.blocked",
    "per_consumer_qos",
    "authentication_failure_close",
];

impl<'a> Handshake<'a> {
    pub fn new(config: &'a GatewayConfig, peer: SocketAddr) -> Self {
        Self {
            config,
            peer,
            stage: Stage::StartOk,
            user: String::new(),
            mechanism: String::new(),
            client_properties: FieldTable::default(),
            tuned: Tuned::default(),
            certificate_user: None,
            refusal: None,
        }
    }

    /// Why the client's login was refused, once the handshake failed on it
    /// (the client was only told RabbitMQ's "Login was refused …").
    pub fn take_refusal(&mut self) -> Option<auth::AuthError> {
        self.refusal.take()
    }

    /// A connection whose client presented a verified TLS certificate with
    /// this CN (None: no certificate, or one without a CN): EXTERNAL is
    /// offered, and logs in as that user.
    pub fn with_certificate_user(mut self, user: Option<String>) -> Self {
        self.certificate_user = user;
        self
    }

    pub fn start(&self, out: &mut FrameWriter) {
        let mut capabilities = FieldTable::default();
        for capability in SERVER_CAPABILITIES {
            capabilities.insert(capability.into(), AMQPValue::Boolean(true));
        }
        let mut properties = FieldTable::default();
        properties.insert("product".into(), long_string("Spillway"));
        properties.insert("version".into(), long_string(env!("CARGO_PKG_VERSION")));
        properties.insert("platform".into(), long_string("Rust"));
        properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
        out.method(
            0,
            AMQPClass::Connection(conn::AMQPMethod::Start(conn::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: properties,
                mechanisms: match self.certificate_user {
                    Some(_) => auth::MECHANISMS_WITH_EXTERNAL.into(),
                    None => auth::MECHANISMS.into(),
                },
                locales: "en_US".into(),
            })),
        );
    }

    pub fn on_frame(&mut self, frame: RawFrame) -> Result<HandshakeStep, ConnectionError> {
        match frame.kind {
            codec::FRAME_HEARTBEAT => return Ok(HandshakeStep::Continue),
            codec::FRAME_METHOD if frame.channel == 0 => {}
            _ => {
                return Err(ConnectionError::new(
                    reply_code::UNEXPECTED_FRAME,
                    "expected a connection method on channel 0 during the handshake",
                ))
            }
        }
        let method = match codec::parse_method(&frame.payload) {
            Ok(AMQPClass::Connection(method)) => method,
            Err(codec::MethodError::TooDeep) => return Err(super::too_deep(&frame.payload)),
            _ => {
                return Err(ConnectionError::new(
                    reply_code::COMMAND_INVALID,
                    "expected a connection method during the handshake",
                ))
            }
        };
        match (&self.stage, method) {
            (Stage::StartOk, conn::AMQPMethod::StartOk(start_ok)) => self.on_start_ok(start_ok),
            (Stage::TuneOk, conn::AMQPMethod::TuneOk(tune_ok)) => self.on_tune_ok(tune_ok),
            (Stage::Open, conn::AMQPMethod::Open(open)) => Ok(HandshakeStep::Open(Negotiated {
                user: std::mem::take(&mut self.user),
                vhost: open.virtual_host.as_str().to_string(),
                capabilities: client_capabilities(&self.client_properties),
                client_properties: std::mem::take(&mut self.client_properties),
                frame_max: self.tuned.frame_max,
                channel_max: self.tuned.channel_max,
                heartbeat: self.tuned.heartbeat,
            })),
            _ => Err(ConnectionError::new(
                reply_code::COMMAND_INVALID,
                "connection method out of order during the handshake",
            )),
        }
    }

    /// Reads the client's login, for the engine to check
    /// ([`Handshake::on_login`] takes its answer).
    fn on_start_ok(&mut self, start_ok: conn::StartOk) -> Result<HandshakeStep, ConnectionError> {
        let mechanism = start_ok.mechanism.as_str().to_string();
        let request = auth::login_request(
            &mechanism,
            start_ok.response.as_bytes(),
            self.peer.ip(),
            self.certificate_user.as_deref(),
        )
        .map_err(|error| self.refuse(&mechanism, error))?;
        self.user = request.user.clone();
        self.mechanism = mechanism;
        self.client_properties = start_ok.client_properties;
        self.stage = Stage::Login;
        Ok(HandshakeStep::Authenticate(request))
    }

    /// The engine's answer to the login: offers our limits
    /// (connection.tune), or refuses the client.
    pub fn on_login(
        &mut self,
        answer: Result<LoginResult, spillway_proto::ServiceError>,
        out: &mut FrameWriter,
    ) -> Result<HandshakeStep, ConnectionError> {
        debug_assert!(
            matches!(self.stage, Stage::Login),
            "a login answer without a login"
        );
        let result = answer.map_err(|error| {
            ConnectionError::new(
                reply_code::INTERNAL_ERROR,
                format!("cannot check the login now: {error}"),
            )
            .on(MethodId::CONNECTION_START_OK)
        })?;
        let user = std::mem::take(&mut self.user);
        self.user = auth::login_outcome(user, result).map_err(|error| {
            let mechanism = std::mem::take(&mut self.mechanism);
            self.refuse(&mechanism, error)
        })?;
        self.stage = Stage::TuneOk;
        out.method(
            0,
            AMQPClass::Connection(conn::AMQPMethod::Tune(conn::Tune {
                channel_max: self.config.settings.channel_max,
                frame_max: self.config.settings.frame_max,
                heartbeat: self.config.settings.heartbeat,
            })),
        );
        Ok(HandshakeStep::Continue)
    }

    /// The close for a refused login, whose reason is kept for the I/O
    /// loop's log and metric ([`Handshake::take_refusal`]).
    fn refuse(&mut self, mechanism: &str, error: auth::AuthError) -> ConnectionError {
        // The reply name is added once, when connection.close is written.
        let refused = ConnectionError::new(reply_code::ACCESS_REFUSED, error.reply_text(mechanism))
            .on(MethodId::CONNECTION_START_OK);
        self.refusal = Some(error);
        refused
    }

    /// Takes the client's limits, capped by ours (0 = "no limit" = ours).
    fn on_tune_ok(&mut self, tune_ok: conn::TuneOk) -> Result<HandshakeStep, ConnectionError> {
        let frame_max = match tune_ok.frame_max {
            0 => self.config.settings.frame_max,
            n => n.min(self.config.settings.frame_max),
        };
        if frame_max < codec::MIN_FRAME_MAX {
            return Err(ConnectionError::new(
                reply_code::NOT_ALLOWED,
                format!(
                    "frame_max {frame_max} below the minimum {}",
                    codec::MIN_FRAME_MAX
                ),
            )
            .on(MethodId::CONNECTION_TUNE_OK));
        }
        if let Some(refusal) = self.config.settings.heartbeat_refusal(tune_ok.heartbeat) {
            return Err(ConnectionError::new(reply_code::NOT_ALLOWED, refusal)
                .on(MethodId::CONNECTION_TUNE_OK));
        }
        let channel_max = match tune_ok.channel_max {
            0 => self.config.settings.channel_max,
            n => n.min(self.config.settings.channel_max),
        };
        self.tuned = Tuned {
            channel_max,
            frame_max,
            heartbeat: tune_ok.heartbeat,
        };
        self.stage = Stage::Open;
        Ok(HandshakeStep::Continue)
    }
}

fn client_capabilities(properties: &FieldTable) -> Capabilities {
    let Some(AMQPValue::FieldTable(capabilities)) = properties.inner().get("capabilities") else {
        return Capabilities::default();
    };
    let flag = |name: &str| {
        matches!(
            capabilities.inner().get(name),
            Some(AMQPValue::Boolean(true))
        )
    };
    Capabilities {
        consumer_cancel_notify: flag("consumer_cancel_notify"),
        connection_blocked: flag("connection.blocked"),
    }
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}
