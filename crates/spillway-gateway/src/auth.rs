//! SASL PLAIN and AMQPLAIN against the users from configuration, and
//! EXTERNAL: the user named by a verified TLS client certificate's CN.

use std::net::IpAddr;

use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
pub struct User {
    pub name: String,
    pub password: String,
    /// Like RabbitMQ's guest: only accepted from a loopback address.
    #[serde(default)]
    pub loopback_only: bool,
}

impl User {
    pub fn guest() -> Self {
        Self {
            name: "guest".into(),
            password: "guest".into(),
            loopback_only: true,
        }
    }
}

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

/// Returns the authenticated user name. `certificate_user` is the CN of
/// the connection's verified client certificate, if it has one: only then
/// is EXTERNAL accepted, as that user (who must be configured; the response
/// is ignored, as RabbitMQ does).
pub fn authenticate(
    users: &[User],
    mechanism: &str,
    response: &[u8],
    peer: IpAddr,
    certificate_user: Option<&str>,
) -> Result<String, AuthError> {
    let (user, name) = match (mechanism, certificate_user) {
        ("EXTERNAL", Some(name)) => (users.iter().find(|u| u.name == name), name.to_string()),
        ("PLAIN" | "AMQPLAIN", _) => {
            let (name, password) = if mechanism == "PLAIN" {
                parse_plain(response)?
            } else {
                parse_amqplain(response)?
            };
            let user = users
                .iter()
                .find(|u| u.name == name)
                .filter(|user| constant_time_eq(user.password.as_bytes(), password.as_bytes()));
            (user, name)
        }
        (other, _) => return Err(AuthError::Mechanism(other.to_string())),
    };
    // An unknown user and a wrong password get the same answer.
    let Some(user) = user else {
        return Err(AuthError::Refused(name));
    };
    if user.loopback_only && !peer.is_loopback() {
        return Err(AuthError::LoopbackOnly(name));
    }
    Ok(name)
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
    use spillway_proto::amqp::nesting;
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

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
    const REMOTE: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));

    #[test]
    fn plain_guest_only_from_loopback() {
        let users = [User::guest()];
        assert_eq!(
            authenticate(&users, "PLAIN", b"\0guest\0guest", LOCAL, None),
            Ok("guest".into())
        );
        assert_eq!(
            authenticate(&users, "PLAIN", b"\0guest\0guest", REMOTE, None),
            Err(AuthError::LoopbackOnly("guest".into()))
        );
        assert_eq!(
            authenticate(&users, "PLAIN", b"\0guest\0nope", LOCAL, None),
            Err(AuthError::Refused("guest".into()))
        );
        assert!(authenticate(&users, "PLAIN", b"garbage", LOCAL, None).is_err());
    }

    #[test]
    fn external_only_with_a_certificate_and_only_for_a_known_user() {
        let users = [
            User::guest(),
            User {
                name: "app".into(),
                password: "secret".into(),
                loopback_only: false,
            },
        ];
        assert_eq!(
            authenticate(&users, "EXTERNAL", b"", LOCAL, None),
            Err(AuthError::Mechanism("EXTERNAL".into()))
        );
        assert_eq!(
            authenticate(&users, "EXTERNAL", b"", REMOTE, Some("app")),
            Ok("app".into())
        );
        // Whatever the response says, the certificate decides.
        assert_eq!(
            authenticate(&users, "EXTERNAL", b"guest", REMOTE, Some("app")),
            Ok("app".into())
        );
        assert_eq!(
            authenticate(&users, "EXTERNAL", b"", REMOTE, Some("mallory")),
            Err(AuthError::Refused("mallory".into()))
        );
        assert_eq!(
            authenticate(&users, "EXTERNAL", b"", REMOTE, Some("guest")),
            Err(AuthError::LoopbackOnly("guest".into()))
        );
        // PLAIN still works on a connection with a certificate.
        assert_eq!(
            authenticate(&users, "PLAIN", b"\0app\0secret", REMOTE, Some("guest")),
            Ok("app".into())
        );
    }
}
