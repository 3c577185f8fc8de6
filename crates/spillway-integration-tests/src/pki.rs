//! Certificates for the TLS tests, made by the test (never committed keys):
//! a CA (basicConstraints critical, keyCertSign), a server certificate it
//! signed for `localhost` and `127.0.0.1`, client certificates it signed
//! (CN = a user name), an expired one, one from another CA, and component
//! certificates for the cluster's mutual TLS (server and client at once).
//! Each is written as PEM into a temporary directory.

use std::path::{Path, PathBuf};

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};

/// A certificate and its key, as PEM files.
#[derive(Clone, Debug)]
pub struct Identity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Identity {
    /// lapin's form: PEM certificate and PEM key.
    pub fn lapin(&self) -> anyhow::Result<lapin::tcp::OwnedIdentity> {
        Ok(lapin::tcp::OwnedIdentity::PKCS8 {
            pem: std::fs::read(&self.cert)?,
            key: std::fs::read(&self.key)?,
        })
    }
}

/// The test's certificate authority and what it signed.
pub struct Pki {
    dir: tempfile::TempDir,
    ca: CertifiedIssuer<'static, KeyPair>,
    /// Another CA, which the broker does not trust.
    stranger: CertifiedIssuer<'static, KeyPair>,
    /// The CA certificate, PEM.
    pub ca_file: PathBuf,
    /// The other CA's certificate, PEM.
    pub stranger_ca_file: PathBuf,
    /// The server's certificate (SANs `localhost`, `127.0.0.1`) and key.
    pub server: Identity,
}

fn ca_params(name: &str) -> anyhow::Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(params)
}

impl Pki {
    pub fn new() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir().context("temp dir for certificates")?;
        let ca =
            CertifiedIssuer::self_signed(ca_params("Spillway test CA")?, KeyPair::generate()?)?;
        let stranger =
            CertifiedIssuer::self_signed(ca_params("Someone else's CA")?, KeyPair::generate()?)?;
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, ca.pem())?;
        let stranger_ca_file = dir.path().join("stranger-ca.pem");
        std::fs::write(&stranger_ca_file, stranger.pem())?;
        let mut pki = Self {
            dir,
            ca,
            stranger,
            ca_file,
            stranger_ca_file,
            server: Identity {
                cert: PathBuf::new(),
                key: PathBuf::new(),
            },
        };
        let mut server =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])?;
        server.distinguished_name = DistinguishedName::new();
        server
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        server.use_authority_key_identifier_extension = true;
        server.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        pki.server = pki.issue("server", server, false)?;
        Ok(pki)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A client certificate with subject CN `user`, signed by the CA.
    pub fn client(&self, user: &str) -> anyhow::Result<Identity> {
        self.issue(&format!("client-{user}"), client_params(user)?, false)
    }

    /// A client certificate for `user` signed by the CA that expired in 2021.
    pub fn expired_client(&self, user: &str) -> anyhow::Result<Identity> {
        let mut params = client_params(user)?;
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        self.issue(&format!("expired-{user}"), params, false)
    }

    /// A component's certificate for the cluster's mutual TLS
    /// (`cluster.tls.cert_file`): CN `name`, SANs `localhost` and
    /// `127.0.0.1`, good as a server's and as a client's. When `name` is a
    /// role (`gateway`, `engine`, `storage`, `management`), it names that
    /// role too (URI `spillway://role/<name>`).
    pub fn component(&self, name: &str) -> anyhow::Result<Identity> {
        self.issue(&format!("component-{name}"), component_params(name)?, false)
    }

    /// The same, signed by a CA the broker does not trust.
    pub fn stranger_component(&self, name: &str) -> anyhow::Result<Identity> {
        self.issue(
            &format!("stranger-component-{name}"),
            component_params(name)?,
            true,
        )
    }

    /// A `[cluster.tls]` section: `identity` and this CA.
    pub fn cluster_tls_toml(&self, identity: &Identity) -> String {
        format!(
            "[cluster.tls]\ncert_file = {:?}\nkey_file = {:?}\nca_file = {:?}\n",
            identity.cert.display().to_string(),
            identity.key.display().to_string(),
            self.ca_file.display().to_string(),
        )
    }

    /// A client certificate for `user` signed by a CA the broker does not
    /// trust.
    pub fn stranger_client(&self, user: &str) -> anyhow::Result<Identity> {
        self.issue(&format!("stranger-{user}"), client_params(user)?, true)
    }

    fn issue(
        &self,
        name: &str,
        params: CertificateParams,
        by_stranger: bool,
    ) -> anyhow::Result<Identity> {
        let key = KeyPair::generate()?;
        let issuer = if by_stranger {
            &self.stranger
        } else {
            &self.ca
        };
        let cert = params.signed_by(&key, &**issuer)?;
        let identity = Identity {
            cert: self.dir.path().join(format!("{name}.pem")),
            key: self.dir.path().join(format!("{name}.key")),
        };
        std::fs::write(&identity.cert, cert.pem())?;
        std::fs::write(&identity.key, key.serialize_pem())?;
        Ok(identity)
    }

    /// The CA certificate as PEM text (what a client trusts).
    pub fn ca_pem(&self) -> anyhow::Result<String> {
        Ok(std::fs::read_to_string(&self.ca_file)?)
    }

    /// lapin's TLS settings: trust this CA, present `identity` if given.
    pub fn lapin_tls(
        &self,
        identity: Option<&Identity>,
    ) -> anyhow::Result<lapin::tcp::OwnedTLSConfig> {
        Ok(lapin::tcp::OwnedTLSConfig {
            identity: identity.map(Identity::lapin).transpose()?,
            cert_chain: Some(self.ca_pem()?),
        })
    }

    /// A tokio-rustls client config trusting this CA, presenting
    /// `identity` if given, speaking only `versions`.
    pub fn rustls_client(
        &self,
        identity: Option<&Identity>,
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> anyhow::Result<std::sync::Arc<rustls::ClientConfig>> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&self.ca_file)? {
            roots.add(cert?)?;
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)?
            .with_root_certificates(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some(identity) => {
                let certs = CertificateDer::pem_file_iter(&identity.cert)?
                    .collect::<Result<Vec<_>, _>>()?;
                let key = PrivateKeyDer::from_pem_file(&identity.key)?;
                builder.with_client_auth_cert(certs, key)?
            }
        };
        Ok(std::sync::Arc::new(config))
    }
}

fn client_params(user: &str) -> anyhow::Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, user);
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    Ok(params)
}

fn component_params(name: &str) -> anyhow::Result<CertificateParams> {
    let mut params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])?;
    // A role's name: the certificate names that role (`spillway://role/…`).
    if let Some(role) = spillway_proto::cluster::ClusterRole::from_name(name) {
        params
            .subject_alt_names
            .push(rcgen::SanType::URI(role.uri().try_into()?));
    }
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, name);
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    Ok(params)
}
