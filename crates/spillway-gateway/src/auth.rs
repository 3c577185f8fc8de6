//! SASL PLAIN, AMQPLAIN and EXTERNAL (the user named by a verified TLS
//! client certificate's CN): the client's response is read here, the login
//! itself is checked by the engine, which holds the users
//! ([`spillway_proto::engine::EngineApi::authenticate`]).
//!
//! A refused login tells the client only RabbitMQ's "Login was refused …"
//! (an unknown user, a wrong password and a loopback-only user read the
//! same); the reason goes to the log, at most once a minute per peer address
//! and user (`spillway_telemetry::RefusalLog`), and to `spillway_login_refusals_total`.

use std::net::IpAddr;

use spillway_proto::engine::{AuthenticateRequest, LoginResult};

/// The mechanisms offered on a connection without a verified client
/// certificate (plain TCP, or TLS without one).
pub const MECHANISMS: &str = "PLAIN AMQPLAIN";
/// The mechanisms offered on a TLS connection whose client presented a
/// certificate the CA vouched for.
pub const MECHANISMS_WITH_EXTERNAL: &str = "EXTERNAL PLAIN AMQPLAIN";

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum AuthError {
    #[error("unsupported mechanism '{0}'")]
    Mechanism(String),
    #[error("malformed {0} response")]
    Malformed(&'static str),
    #[error("user '{0}' - invalid credentials")]
    Refused(String),
    #[error("user '{0}' can only connect via localhost")]
    LoopbackOnly(String),
}

impl AuthError {
    /// What the client is told in connection.close. For a refused login,
    /// RabbitMQ's words: the same whether the user is unknown, the password
    /// wrong, or the user limited to loopback, so that a stranger learns
    /// nothing about which names exist.
    pub fn reply_text(&self, mechanism: &str) -> String {
        match self {
            AuthError::Refused(_) | AuthError::LoopbackOnly(_) => format!(
                "Login was refused using authentication mechanism {mechanism}. \
                 For details see the broker logfile."
            ),
            other => other.to_string(),
        }
    }

    /// The label of `spillway_login_refusals_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            AuthError::Mechanism(_) => "mechanism",
            AuthError::Malformed(_) => "malformed",
            AuthError::Refused(_) => "invalid_credentials",
            AuthError::LoopbackOnly(_) => "loopback_only",
        }
    }

    /// The user the client named, when its response could be read.
    pub fn user(&self) -> Option<&str> {
        match self {
            AuthError::Refused(user) | AuthError::LoopbackOnly(user) => Some(user),
            AuthError::Mechanism(_) | AuthError::Malformed(_) => None,
        }
    }
}

/// Reads the client's SASL response into the login the engine checks.
/// `certificate_user` is the CN of the connection's verified client
/// certificate, if it has one: only then is EXTERNAL accepted, as that user
/// (the response is ignored, as RabbitMQ does).
pub fn login_request(
    mechanism: &str,
    response: &[u8],
    peer: IpAddr,
    certificate_user: Option<&str>,
) -> Result<AuthenticateRequest, AuthError> {
    let (user, password) = match (mechanism, certificate_user) {
        ("EXTERNAL", Some(name)) => (name.to_string(), None),
        ("PLAIN", _) => {
            let (user, password) = parse_plain(response)?;
            (user, Some(password))
        }
        ("AMQPLAIN", _) => {
            let (user, password) = parse_amqplain(response)?;
            (user, Some(password))
        }
        (other, _) => return Err(AuthError::Mechanism(other.to_string())),
    };
    Ok(AuthenticateRequest {
        user,
        password,
        peer_is_loopback: peer.is_loopback(),
    })
}

/// The engine's answer as the handshake needs it: the user, or why not.
pub fn login_outcome(user: String, result: LoginResult) -> Result<String, AuthError> {
    match result {
        LoginResult::Accepted => Ok(user),
        LoginResult::LoopbackOnly => Err(AuthError::LoopbackOnly(user)),
        LoginResult::InvalidCredentials | LoginResult::Unspecified => Err(AuthError::Refused(user)),
    }
}

/// `authzid \0 authcid \0 password`.
fn parse_plain(response: &[u8]) -> Result<(String, String), AuthError> {
    let mut parts = response.split(|b| *b == 0);
    let (Some(_authzid), Some(user), Some(password), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(AuthError::Malformed("PLAIN"));
    };
    let user = String::from_utf8(user.to_vec()).map_err(|_| AuthError::Malformed("PLAIN"))?;
    let password =
        String::from_utf8(password.to_vec()).map_err(|_| AuthError::Malformed("PLAIN"))?;
    Ok((user, password))
}

/// A field table without its length prefix, holding LOGIN and PASSWORD.
fn parse_amqplain(response: &[u8]) -> Result<(String, String), AuthError> {
    use amq_protocol::types::AMQPValue;
    use spillway_amqp::nesting;
    // The table parser recurses: refuse deep nesting before it runs.
    if nesting::check_table_entries(response, nesting::MAX_NESTING).is_err() {
        return Err(AuthError::Malformed("AMQPLAIN"));
    }
    let mut framed = (response.len() as u32).to_be_bytes().to_vec();
    framed.extend_from_slice(response);
    let Ok((_, table)) = amq_protocol::types::parsing::parse_field_table(&framed[..]) else {
        return Err(AuthError::Malformed("AMQPLAIN"));
    };
    let text = |key: &str| match table.inner().get(key) {
        Some(AMQPValue::LongString(s)) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        Some(AMQPValue::ShortString(s)) => Some(s.as_str().to_string()),
        _ => None,
    };
    match (text("LOGIN"), text("PASSWORD")) {
        (Some(user), Some(password)) => Ok((user, password)),
        _ => Err(AuthError::Malformed("AMQPLAIN")),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::net::Ipv4Addr;

    const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
    const REMOTE: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));

    #[test]
    fn plain_and_amqplain_responses_are_read() {
        let plain = login_request("PLAIN", b"\0guest\0secret", LOCAL, None).unwrap();
        assert_eq!(
            (plain.user.as_str(), plain.password.as_deref()),
            ("guest", Some("secret"))
        );
        assert!(plain.peer_is_loopback);
        assert!(
            !login_request("PLAIN", b"\0guest\0secret", REMOTE, None)
                .unwrap()
                .peer_is_loopback
        );
        assert_eq!(
            login_request("PLAIN", b"garbage", LOCAL, None),
            Err(AuthError::Malformed("PLAIN"))
        );
        assert_eq!(
            login_request("CRAM-MD5", b"", LOCAL, None),
            Err(AuthError::Mechanism("CRAM-MD5".into()))
        );
    }

    #[test]
    fn external_only_with_a_certificate_and_then_as_its_name() {
        assert_eq!(
            login_request("EXTERNAL", b"", LOCAL, None),
            Err(AuthError::Mechanism("EXTERNAL".into()))
        );
        // Whatever the response says, the certificate decides.
        let external = login_request("EXTERNAL", b"guest", REMOTE, Some("app")).unwrap();
        assert_eq!((external.user.as_str(), external.password), ("app", None));
        // PLAIN still works on a connection with a certificate.
        let plain = login_request("PLAIN", b"\0app\0secret", REMOTE, Some("guest")).unwrap();
        assert_eq!(plain.user, "app");
    }

    #[test]
    fn the_engines_answer_becomes_the_refusal() {
        assert_eq!(
            login_outcome("a".into(), LoginResult::Accepted),
            Ok("a".into())
        );
        assert_eq!(
            login_outcome("a".into(), LoginResult::InvalidCredentials),
            Err(AuthError::Refused("a".into()))
        );
        assert_eq!(
            login_outcome("a".into(), LoginResult::LoopbackOnly),
            Err(AuthError::LoopbackOnly("a".into()))
        );
    }

    #[test]
    fn a_wrong_password_and_a_loopback_only_user_read_the_same() {
        let wrong = AuthError::Refused("guest".into()).reply_text("PLAIN");
        let remote = AuthError::LoopbackOnly("guest".into()).reply_text("PLAIN");
        assert_eq!(wrong, remote);
        assert_eq!(
            wrong,
            "Login was refused using authentication mechanism PLAIN. \
             For details see the broker logfile."
        );
    }
}
