//! SASL PLAIN and AMQPLAIN against the users from configuration.

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

pub const MECHANISMS: &str = "PLAIN AMQPLAIN";

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

/// Returns the authenticated user name.
pub fn authenticate(
    users: &[User],
    mechanism: &str,
    response: &[u8],
    peer: IpAddr,
) -> Result<String, AuthError> {
    let (name, password) = match mechanism {
        "PLAIN" => parse_plain(response)?,
        "AMQPLAIN" => parse_amqplain(response)?,
        other => return Err(AuthError::Mechanism(other.to_string())),
    };
    let Some(user) = users.iter().find(|u| u.name == name) else {
        return Err(AuthError::Refused(name));
    };
    if !constant_time_eq(user.password.as_bytes(), password.as_bytes()) {
        return Err(AuthError::Refused(name));
    }
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
            authenticate(&users, "PLAIN", b"\0guest\0guest", LOCAL),
            Ok("guest".into())
        );
        assert_eq!(
            authenticate(&users, "PLAIN", b"\0guest\0guest", REMOTE),
            Err(AuthError::LoopbackOnly("guest".into()))
        );
        assert_eq!(
            authenticate(&users, "PLAIN", b"\0guest\0nope", LOCAL),
            Err(AuthError::Refused("guest".into()))
        );
        assert!(authenticate(&users, "PLAIN", b"garbage", LOCAL).is_err());
        assert!(authenticate(&users, "EXTERNAL", b"", LOCAL).is_err());
    }
}
