//! TLS for AMQPS (and the PEM checks the management port shares): the
//! server's rustls configuration from PEM files, and the identity a verified
//! client certificate gives SASL EXTERNAL (the subject's CN, as RabbitMQ's
//! `rabbitmq_auth_mechanism_ssl` does by default).
//!
//! rustls runs on the `ring` provider, chosen explicitly so that no process
//! depends on which provider some other crate turned on. TLS 1.2 and 1.3.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

/// The TLS files of one listener (`gateway.tls.*` or `management.tls.*`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain, PEM, leaf first.
    pub cert_file: PathBuf,
    /// Its private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// CAs whose client certificates are accepted, PEM. Unset: client
    /// certificates are neither asked for nor accepted.
    pub ca_file: Option<PathBuf>,
    /// Client certificates are required (needs `ca_file`). Without it, a
    /// client may present one (verified against `ca_file`) or none.
    pub verify_peer: bool,
}

/// Which of the [`TlsFiles`] a problem is with: the setting's last key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsKey {
    CertFile,
    KeyFile,
    CaFile,
    VerifyPeer,
}

impl TlsKey {
    pub fn as_str(self) -> &'static str {
        match self {
            TlsKey::CertFile => "cert_file",
            TlsKey::KeyFile => "key_file",
            TlsKey::CaFile => "ca_file",
            TlsKey::VerifyPeer => "verify_peer",
        }
    }
}

/// Why a listener's TLS files cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
pub struct TlsError {
    /// The setting at fault.
    pub key: TlsKey,
    pub reason: String,
}

impl TlsError {
    fn new(key: TlsKey, reason: impl Into<String>) -> Self {
        Self {
            key,
            reason: reason.into(),
        }
    }
}

/// The certificates in a PEM file; at least one.
pub fn read_certificates(
    path: &Path,
    key: TlsKey,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(path, key)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| {
            TlsError::new(key, format!("{} is not valid PEM: {error}", path.display()))
        })?;
    if certs.is_empty() {
        return Err(TlsError::new(
            key,
            format!(
                "{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                path.display()
            ),
        ));
    }
    Ok(certs)
}

/// The private key in a PEM file.
pub fn read_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read(path, TlsKey::KeyFile)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|error| {
        TlsError::new(
            TlsKey::KeyFile,
            format!(
                "{} holds no usable PEM private key ({error})",
                path.display()
            ),
        )
    })
}

fn read(path: &Path, key: TlsKey) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path)
        .map_err(|error| TlsError::new(key, format!("cannot read {}: {error}", path.display())))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The CAs of `ca_file` as a root store (every certificate must parse).
pub fn read_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certificates(path, TlsKey::CaFile)? {
        roots.add(cert).map_err(|error| {
            TlsError::new(
                TlsKey::CaFile,
                format!(
                    "{} holds a certificate rustls cannot use as a CA: {error}",
                    path.display()
                ),
            )
        })?;
    }
    Ok(roots)
}

/// The server configuration for `files`: TLS 1.2 and 1.3, the certificate
/// and key checked to belong together, client certificates as `files` say.
pub fn server_config(files: &TlsFiles) -> Result<ServerConfig, TlsError> {
    let provider = provider();
    let certs = read_certificates(&files.cert_file, TlsKey::CertFile)?;
    let key = read_private_key(&files.key_file)?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|error| TlsError::new(TlsKey::CertFile, error.to_string()))?;
    let builder = match &files.ca_file {
        None if files.verify_peer => {
            return Err(TlsError::new(
                TlsKey::VerifyPeer,
                "verify_peer needs ca_file: the CAs client certificates are checked against",
            ))
        }
        None => builder.with_no_client_auth(),
        Some(ca_file) => {
            let roots = Arc::new(read_roots(ca_file)?);
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider);
            let verifier = if files.verify_peer {
                verifier
            } else {
                verifier.allow_unauthenticated()
            };
            let verifier = verifier.build().map_err(|error| {
                TlsError::new(TlsKey::CaFile, format!("{}: {error}", ca_file.display()))
            })?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder.with_single_cert(certs, key).map_err(|error| {
        TlsError::new(
            TlsKey::KeyFile,
            format!(
                "{} does not go with the certificate in {}: {error}",
                files.key_file.display(),
                files.cert_file.display()
            ),
        )
    })?;
    Ok(config)
}

/// The subject's common name of a (verified) client certificate: the user
/// name SASL EXTERNAL logs in as. None when it has none or cannot be read.
pub fn common_name(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let name = parsed
        .subject()
        .iter_common_name()
        .next()?
        .as_str()
        .ok()?
        .to_string();
    Some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

    struct Pki {
        dir: tempfile::TempDir,
    }

    impl Pki {
        fn write(&self, name: &str, text: &str) -> Result<PathBuf> {
            let path = self.dir.path().join(name);
            std::fs::write(&path, text)?;
            Ok(path)
        }
    }

    /// A CA, a server certificate it signed, and a client certificate
    /// (CN `app`) it signed, as PEM.
    fn pki() -> Result<(Pki, TlsFiles, String)> {
        let pki = Pki {
            dir: tempfile::tempdir()?,
        };
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "test ca");
        let ca_key = rcgen::KeyPair::generate()?;
        let ca = rcgen::CertifiedIssuer::self_signed(ca, ca_key)?;
        let server = rcgen::CertificateParams::new(vec!["localhost".to_string()])?;
        let server_key = rcgen::KeyPair::generate()?;
        let server_cert = server.signed_by(&server_key, &*ca)?;
        let mut client = rcgen::CertificateParams::new(Vec::<String>::new())?;
        client
            .distinguished_name
            .push(rcgen::DnType::CommonName, "app");
        let client_key = rcgen::KeyPair::generate()?;
        let client_cert = client.signed_by(&client_key, &*ca)?;
        let files = TlsFiles {
            cert_file: pki.write("server.pem", &server_cert.pem())?,
            key_file: pki.write("server.key", &server_key.serialize_pem())?,
            ca_file: Some(pki.write("ca.pem", &ca.pem())?),
            verify_peer: true,
        };
        Ok((pki, files, client_cert.pem()))
    }

    #[test]
    fn a_good_set_loads_and_the_client_cn_is_read() -> Result<()> {
        let (_pki, files, client) = pki()?;
        server_config(&files)?;
        let cert = CertificateDer::from_pem_slice(client.as_bytes())?;
        assert_eq!(common_name(&cert).as_deref(), Some("app"));
        Ok(())
    }

    #[test]
    fn each_bad_file_names_its_key() -> Result<()> {
        let (pki, files, _) = pki()?;
        let garbage = pki.write("garbage.pem", "not pem at all\n")?;
        let other_key = pki.write("other.key", &rcgen::KeyPair::generate()?.serialize_pem())?;
        let missing = pki.dir.path().join("missing.pem");
        let cases = [
            (
                TlsFiles {
                    cert_file: missing.clone(),
                    ..files.clone()
                },
                TlsKey::CertFile,
                "cannot read",
            ),
            (
                TlsFiles {
                    cert_file: garbage.clone(),
                    ..files.clone()
                },
                TlsKey::CertFile,
                "holds no PEM certificate",
            ),
            (
                TlsFiles {
                    key_file: garbage.clone(),
                    ..files.clone()
                },
                TlsKey::KeyFile,
                "no usable PEM private key",
            ),
            (
                TlsFiles {
                    // A certificate is no key.
                    key_file: files.cert_file.clone(),
                    ..files.clone()
                },
                TlsKey::KeyFile,
                "no usable PEM private key",
            ),
            (
                TlsFiles {
                    key_file: other_key,
                    ..files.clone()
                },
                TlsKey::KeyFile,
                "does not go with the certificate",
            ),
            (
                TlsFiles {
                    ca_file: Some(garbage),
                    ..files.clone()
                },
                TlsKey::CaFile,
                "holds no PEM certificate",
            ),
            (
                TlsFiles {
                    ca_file: None,
                    ..files.clone()
                },
                TlsKey::VerifyPeer,
                "verify_peer needs ca_file",
            ),
        ];
        for (files, key, text) in cases {
            match server_config(&files) {
                Ok(_) => panic!("{files:?} loaded"),
                Err(error) => {
                    assert_eq!(error.key, key, "{error}");
                    assert!(error.reason.contains(text), "{error}");
                }
            }
        }
        Ok(())
    }
}
