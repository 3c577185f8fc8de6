//! `gateway.tls` and `management.tls` (the gateway's [`TlsSettings`])
//! checked as their listeners will use them.

use std::path::PathBuf;

use spillway_gateway::TlsSettings;

use super::check::{Quoted, Range};

/// A listener's TLS (`gateway.tls`, `management.tls`) checked as the
/// listener will use it.
pub(super) trait TlsCheck {
    fn check(&self, section: &str, needed_by: Option<&str>) -> Vec<Range>;
}

impl TlsCheck for TlsSettings {
    /// What is wrong with `section.tls` (`needed_by`: the setting that
    /// needs a certificate, if any). Every file is read and checked as the
    /// listener will use it, so a bad one stops start-up in every role.
    fn check(&self, section: &str, needed_by: Option<&str>) -> Vec<Range> {
        let key = |name: &str| format!("{section}.tls.{name}");
        let path = |path: &Option<PathBuf>| {
            path.as_ref().map_or("unset".to_string(), |path| {
                Quoted(&path.display().to_string()).to_string()
            })
        };
        let mut found = Vec::new();
        if !self.is_set() && needed_by.is_none() {
            return found;
        }
        if self.cert_file.is_none() {
            let why = match needed_by {
                Some(setting) => format!("{setting} is set"),
                None => format!("{section}.tls is set"),
            };
            found.push(Range {
                key: key("cert_file"),
                value: "unset".into(),
                allowed: format!("a PEM certificate file ({why})"),
            });
        }
        if self.key_file.is_none() && self.cert_file.is_some() {
            found.push(Range {
                key: key("key_file"),
                value: "unset".into(),
                allowed: format!("the PEM private key of {}", key("cert_file")),
            });
        }
        if self.verify_peer && self.ca_file.is_none() {
            found.push(Range {
                key: key("verify_peer"),
                value: "true".into(),
                allowed: format!(
                    "false unless {} is set (the CAs client certificates are checked against)",
                    key("ca_file")
                ),
            });
        }
        if !found.is_empty() {
            return found;
        }
        if let Some(files) = self.files() {
            if let Err(error) = spillway_gateway::tls::server_config(&files) {
                use spillway_gateway::tls::TlsKey;
                let value = match error.key {
                    TlsKey::CertFile => path(&self.cert_file),
                    TlsKey::KeyFile => path(&self.key_file),
                    TlsKey::CaFile => path(&self.ca_file),
                    TlsKey::VerifyPeer => self.verify_peer.to_string(),
                };
                found.push(Range {
                    key: key(error.key.as_str()),
                    value,
                    allowed: format!("a usable PEM file: {}", error.reason),
                });
            }
        }
        found
    }
}
