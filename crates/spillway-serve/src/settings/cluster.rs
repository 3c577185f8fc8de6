//! `[cluster]`: how the separate processes recognise each other (the
//! secret, each role's verifier, mutual TLS), and its checks.

use std::path::PathBuf;

use serde::Deserialize;

use super::check::{Quoted, Range};

/// How the separate processes of one broker recognise each other on the
/// internal gRPC services (`docs/security.md`). Not read by all-in-one.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ClusterSettings {
    /// Sent by every internal client: with `verifiers` set, the secret of
    /// this process's role; without, one secret every process shares (its
    /// role is then believed, so a separate role serves so on loopback
    /// only). After loading, this holds the secret read from `secret_file`
    /// too.
    pub secret: Option<spillway_proto::cluster::ClusterSecret>,
    /// A file holding the secret (surrounding whitespace ignored): what
    /// compose uses, so the secret appears in no environment.
    pub secret_file: Option<PathBuf>,
    /// Each role's verifier: the SHA-256 of its secret, in hex. Set on
    /// every process (they are not secret); a server checks each caller's
    /// secret against its role's.
    pub verifiers: ClusterVerifiers,
    /// Mutual TLS on every internal gRPC connection.
    pub tls: ClusterTlsSettings,
}

/// `cluster.verifiers`: per role, the SHA-256 of its secret (64 hex
/// digits). Unset: the role is proven another way, or not at all.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ClusterVerifiers {
    pub gateway: Option<String>,
    pub engine: Option<String>,
    pub storage: Option<String>,
    pub management: Option<String>,
}

impl ClusterVerifiers {
    fn get(&self, role: spillway_proto::cluster::ClusterRole) -> Option<&String> {
        use spillway_proto::cluster::ClusterRole;
        match role {
            ClusterRole::Gateway => self.gateway.as_ref(),
            ClusterRole::Engine => self.engine.as_ref(),
            ClusterRole::Storage => self.storage.as_ref(),
            ClusterRole::Management => self.management.as_ref(),
        }
    }

    /// The verifiers set, by role (values checked by the settings).
    pub fn table(
        &self,
    ) -> std::collections::BTreeMap<spillway_proto::cluster::ClusterRole, [u8; 32]> {
        spillway_proto::cluster::ClusterRole::ALL
            .into_iter()
            .filter_map(|role| {
                let verifier = crate::cluster::parse_verifier(self.get(role)?)?;
                Some((role, verifier))
            })
            .collect()
    }

    /// Whether any is set: per-role secrets are in force.
    pub fn any(&self) -> bool {
        spillway_proto::cluster::ClusterRole::ALL
            .into_iter()
            .any(|role| self.get(role).is_some())
    }
}

/// Mutual TLS between the separate processes (`cluster.tls`): PEM files, all
/// three or none. With them, the engine and storage serve internal gRPC over
/// TLS only and require a client certificate signed by `ca_file`; every
/// internal client presents `cert_file` and checks the server's certificate
/// against `ca_file`. Not read by all-in-one (it has no internal port).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ClusterTlsSettings {
    /// This process's certificate chain, leaf first: presented as a server
    /// and as a client, so it needs both extended key usages (serverAuth,
    /// clientAuth) and, as SANs, the host names the others dial it by.
    pub cert_file: Option<PathBuf>,
    /// Its private key.
    pub key_file: Option<PathBuf>,
    /// The cluster CA: every peer's certificate must chain to it.
    pub ca_file: Option<PathBuf>,
}

impl ClusterTlsSettings {
    /// Whether any of the three is set (then all three must be).
    pub fn is_set(&self) -> bool {
        self.cert_file.is_some() || self.key_file.is_some() || self.ca_file.is_some()
    }

    /// What is wrong with `cluster.tls`: a missing file, or one that cannot
    /// be used (each is read and checked as the servers will use it).
    pub(super) fn check(&self) -> Vec<Range> {
        let mut found = Vec::new();
        if !self.is_set() {
            return found;
        }
        for (name, path) in [
            ("cert_file", &self.cert_file),
            ("key_file", &self.key_file),
            ("ca_file", &self.ca_file),
        ] {
            if path.is_none() {
                found.push(Range {
                    key: format!("cluster.tls.{name}"),
                    value: "unset".into(),
                    allowed: "a PEM file: cluster.tls needs cert_file, key_file and ca_file \
                              together"
                        .into(),
                });
            }
        }
        let (Some(cert_file), Some(key_file), Some(ca_file)) =
            (&self.cert_file, &self.key_file, &self.ca_file)
        else {
            return found;
        };
        let files = spillway_gateway::tls::TlsFiles {
            cert_file: cert_file.clone(),
            key_file: key_file.clone(),
            ca_file: Some(ca_file.clone()),
            verify_peer: true,
        };
        if let Err(error) = spillway_gateway::tls::server_config(&files) {
            use spillway_gateway::tls::TlsKey;
            let path = match error.key {
                TlsKey::CertFile | TlsKey::VerifyPeer => cert_file,
                TlsKey::KeyFile => key_file,
                TlsKey::CaFile => ca_file,
            };
            let name = match error.key {
                TlsKey::VerifyPeer => "cert_file",
                key => key.as_str(),
            };
            found.push(Range {
                key: format!("cluster.tls.{name}"),
                value: Quoted(&path.display().to_string()).to_string(),
                allowed: format!("a usable PEM file: {}", error.reason),
            });
        }
        found
    }

    /// The files' contents, for the internal servers and clients; `None`
    /// when `cluster.tls` is not set.
    pub fn load(&self) -> anyhow::Result<Option<spillway_proto::cluster::ClusterTls>> {
        use anyhow::Context;
        if !self.is_set() {
            return Ok(None);
        }
        let read = |name: &str, path: &Option<PathBuf>| -> anyhow::Result<Vec<u8>> {
            let path = path
                .as_ref()
                .with_context(|| format!("cluster.tls.{name} is not set"))?;
            std::fs::read(path)
                .with_context(|| format!("cluster.tls.{name}: cannot read {}", path.display()))
        };
        Ok(Some(spillway_proto::cluster::ClusterTls::new(
            read("ca_file", &self.ca_file)?,
            read("cert_file", &self.cert_file)?,
            read("key_file", &self.key_file)?,
        )))
    }
}

impl ClusterSettings {
    /// Checks the secret, reads it from `secret_file` when that is set, and
    /// returns what is wrong. Never shows the secret.
    pub(super) fn resolve(&mut self) -> Vec<Range> {
        use spillway_proto::cluster::{ClusterSecret, MIN_SECRET_LEN};
        let allowed = format!("at least {MIN_SECRET_LEN} visible ASCII characters");
        let mut found = Vec::new();
        match (self.secret.clone(), self.secret_file.clone()) {
            (Some(_), Some(path)) => found.push(Range {
                key: "cluster.secret_file".into(),
                value: Quoted(&path.display().to_string()).to_string(),
                allowed: "unset while cluster.secret is set: give one of the two".into(),
            }),
            (Some(secret), None) => {
                let text = String::from_utf8_lossy(secret.expose()).into_owned();
                if let Err(error) = ClusterSecret::new(&text) {
                    found.push(Range {
                        key: "cluster.secret".into(),
                        value: format!("(not shown, {} bytes)", text.len()),
                        allowed: format!("{allowed}; {error}"),
                    });
                }
            }
            (None, Some(path)) => {
                let value = Quoted(&path.display().to_string()).to_string();
                match std::fs::read_to_string(path) {
                    Err(error) => found.push(Range {
                        key: "cluster.secret_file".into(),
                        value,
                        allowed: format!("a readable file holding the secret ({error})"),
                    }),
                    Ok(text) => match ClusterSecret::new(&text) {
                        Ok(secret) => self.secret = Some(secret),
                        Err(error) => found.push(Range {
                            key: "cluster.secret_file".into(),
                            value,
                            allowed: format!("a file holding {allowed}; in this one {error}"),
                        }),
                    },
                }
            }
            (None, None) => {}
        }
        for role in spillway_proto::cluster::ClusterRole::ALL {
            let Some(verifier) = self.verifiers.get(role) else {
                continue;
            };
            if crate::cluster::parse_verifier(verifier).is_none() {
                found.push(Range {
                    key: format!("cluster.verifiers.{role}"),
                    value: Quoted(verifier).to_string(),
                    allowed: format!(
                        "64 hex digits: the SHA-256 of the {role} role's secret \
                         (`tr -d '[:space:]' < SECRET_FILE | sha256sum`)"
                    ),
                });
            }
        }
        if self.verifiers.any() && self.secret.is_none() && self.secret_file.is_none() {
            found.push(Range {
                key: "cluster.secret_file".into(),
                value: "unset".into(),
                allowed: "this role's own secret, since cluster.verifiers is set".into(),
            });
        }
        found
    }
}
