//! Who may call the management API: a bearer token
//! (`authorization: Bearer <token>`) and/or users with passwords
//! (`authorization: Basic base64(user:password)`), checked by a tonic
//! interceptor before any call runs. Anything else is UNAUTHENTICATED.

use std::sync::Arc;

use base64::Engine as _;
use serde::Deserialize;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// A management user (`[[management.users]]` in the configuration).
#[derive(Clone, Debug, Deserialize)]
pub struct ManagementUser {
    pub name: String,
    pub password: String,
    /// Only accepted from a loopback address (like the built-in guest).
    #[serde(default)]
    pub loopback_only: bool,
}

impl ManagementUser {
    /// `guest`/`guest`, from loopback only: the default, as on the AMQP port.
    pub fn guest() -> Self {
        Self {
            name: "guest".into(),
            password: "guest".into(),
            loopback_only: true,
        }
    }
}

/// The credentials the interceptor accepts.
#[derive(Clone, Debug, Default)]
pub struct AuthConfig {
    /// Accepted as `Bearer <token>`; `None` (or empty): no token accepted.
    pub token: Option<String>,
    pub users: Vec<ManagementUser>,
}

/// The tonic interceptor that refuses calls without valid credentials.
#[derive(Clone)]
pub struct Authenticator {
    config: Arc<AuthConfig>,
}

impl Authenticator {
    pub fn new(config: AuthConfig) -> Self {
        Self {
            config: Arc::new(config),
        }
    }

    fn check(&self, request: &Request<()>) -> Result<(), &'static str> {
        let header = request
            .metadata()
            .get("authorization")
            .ok_or("missing credentials")?
            .to_str()
            .map_err(|_| "malformed authorization header")?;
        let (scheme, value) = header
            .split_once(' ')
            .ok_or("malformed authorization header")?;
        if scheme.eq_ignore_ascii_case("bearer") {
            let token = self.config.token.as_deref().unwrap_or_default();
            if !token.is_empty() && constant_time_eq(token.as_bytes(), value.trim().as_bytes()) {
                return Ok(());
            }
            return Err("invalid token");
        }
        if scheme.eq_ignore_ascii_case("basic") {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(value.trim())
                .map_err(|_| "malformed basic credentials")?;
            let decoded = String::from_utf8(decoded).map_err(|_| "malformed basic credentials")?;
            let (name, password) = decoded
                .split_once(':')
                .ok_or("malformed basic credentials")?;
            let loopback = request.remote_addr().is_some_and(|a| a.ip().is_loopback());
            let user = self
                .config
                .users
                .iter()
                .find(|u| {
                    u.name == name && constant_time_eq(u.password.as_bytes(), password.as_bytes())
                })
                .ok_or("invalid user or password")?;
            if user.loopback_only && !loopback {
                return Err("this user may only connect from localhost");
            }
            return Ok(());
        }
        Err("unsupported authorization scheme (use Bearer or Basic)")
    }
}

impl Interceptor for Authenticator {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        match self.check(&request) {
            Ok(()) => Ok(request),
            Err(reason) => {
                tracing::info!(peer = ?request.remote_addr(), reason, "management call refused");
                Err(Status::unauthenticated(reason))
            }
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn request(header: Option<&str>) -> Request<()> {
        let mut request = Request::new(());
        if let Some(header) = header {
            request
                .metadata_mut()
                .insert("authorization", header.parse().unwrap());
        }
        request
    }

    fn auth() -> Authenticator {
        Authenticator::new(AuthConfig {
            token: Some("s3cret".into()),
            users: vec![ManagementUser {
                name: "ops".into(),
                password: "pw".into(),
                loopback_only: false,
            }],
        })
    }

    #[test]
    fn accepts_token_and_basic() {
        assert!(auth().call(request(Some("Bearer s3cret"))).is_ok());
        let basic = base64::engine::general_purpose::STANDARD.encode("ops:pw");
        assert!(auth()
            .call(request(Some(&format!("Basic {basic}"))))
            .is_ok());
    }

    #[test]
    fn refuses_missing_and_wrong() {
        for header in [
            None,
            Some("Bearer nope"),
            Some("Basic !!"),
            Some("Digest x"),
        ] {
            let status = auth().call(request(header)).unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unauthenticated);
        }
        let no_token = Authenticator::new(AuthConfig::default());
        let status = no_token.clone().call(request(Some("Bearer "))).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
    }

    #[test]
    fn loopback_only_user_is_refused_without_a_loopback_peer() {
        let guest = Authenticator::new(AuthConfig {
            token: None,
            users: vec![ManagementUser::guest()],
        });
        let basic = base64::engine::general_purpose::STANDARD.encode("guest:guest");
        // No peer address (not a TCP connection): not loopback.
        let status = guest
            .clone()
            .call(request(Some(&format!("Basic {basic}"))))
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
    }
}
