//! Values out of range: what each setting allows beyond its type, checked
//! once the layers are merged. `0` stays valid where it means "off".

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use spillway_gateway::TlsSettings;

use super::Settings;

/// The largest `gateway.max_message_size`: RabbitMQ's own limit (512 MiB).
/// The engine keeps a queued body's size in 32 bits.
const MAX_MESSAGE_SIZE_LIMIT: u64 = 512 * 1024 * 1024;

impl Settings {
    /// Every value outside what its setting allows. Only what the
    /// documentation gives no meaning: `0` stays valid where it means "off".
    pub(super) fn out_of_range(&self) -> Vec<Range> {
        let mut found = Vec::new();
        let mut check = |ok: bool, key: &str, value: &dyn fmt::Display, allowed: &str| {
            if !ok {
                found.push(Range {
                    key: key.to_string(),
                    value: value.to_string(),
                    allowed: allowed.to_string(),
                });
            }
        };
        let gateway = &self.gateway;
        match (gateway.amqp_listen(), gateway.amqps_listen()) {
            (None, None) => check(
                false,
                "gateway.amqp_listen",
                &Quoted(&gateway.amqp_listen),
                "a literal IP:port, e.g. \"0.0.0.0:5672\" (empty only with \
                 gateway.amqps_listen set)",
            ),
            (None, Some(_)) => {}
            (Some(listen), _) => check(
                listen.parse::<SocketAddr>().is_ok(),
                "gateway.amqp_listen",
                &Quoted(&gateway.amqp_listen),
                "a literal IP:port, e.g. \"0.0.0.0:5672\"",
            ),
        }
        if let Some(listen) = gateway.amqps_listen() {
            check(
                listen.parse::<SocketAddr>().is_ok(),
                "gateway.amqps_listen",
                &Quoted(listen),
                "a literal IP:port, e.g. \"0.0.0.0:5671\"",
            );
        }
        check(
            gateway.frame_max >= spillway_amqp::codec::MIN_FRAME_MAX,
            "gateway.frame_max",
            &gateway.frame_max,
            "at least 4096 (AMQP's smallest frame)",
        );
        check(
            gateway.channel_max >= 1,
            "gateway.channel_max",
            &gateway.channel_max,
            "1 to 65535",
        );
        check(
            gateway.max_heartbeat == 0 || gateway.min_heartbeat <= gateway.max_heartbeat,
            "gateway.min_heartbeat",
            &gateway.min_heartbeat,
            "at most gateway.max_heartbeat",
        );
        check(
            gateway.heartbeat_refusal(gateway.heartbeat).is_none(),
            "gateway.heartbeat",
            &gateway.heartbeat,
            "within gateway.min_heartbeat and gateway.max_heartbeat (0 = off only without a maximum)",
        );
        check(
            (1..=MAX_MESSAGE_SIZE_LIMIT).contains(&gateway.max_message_size),
            "gateway.max_message_size",
            &gateway.max_message_size,
            "from 1 byte to 512 MiB (RabbitMQ's limit)",
        );
        check(
            !gateway.handshake_timeout.is_zero(),
            "gateway.handshake_timeout",
            &Millis(gateway.handshake_timeout),
            "more than 0",
        );
        check_users(
            "engine.users",
            self.engine.users.iter().map(|user| user.name.as_str()),
            &mut check,
        );
        check(
            self.engine.flow_to_disk_threshold != Some(0),
            "engine.flow_to_disk_threshold",
            &0,
            "at least 1 byte, or unset for 40% of the memory available",
        );
        if let Some(watermark) = self.engine.memory_high_watermark.filter(|w| *w != 0) {
            let threshold = self.engine.flow_to_disk_threshold();
            check(
                watermark > threshold,
                "engine.memory_high_watermark",
                &watermark,
                &format!(
                    "above engine.flow_to_disk_threshold ({threshold} bytes), so that \
                     payloads flow to disk before publishers are blocked; 0 turns it off"
                ),
            );
        }
        check(
            !self.engine.publisher_pacing_stall.is_zero(),
            "engine.publisher_pacing_stall",
            &Millis(self.engine.publisher_pacing_stall),
            "more than 0",
        );
        check(
            self.engine.store_writer_max_writes >= 1,
            "engine.store_writer_max_writes",
            &self.engine.store_writer_max_writes,
            "at least 1",
        );
        check(
            self.engine.store_writer_max_bytes >= 1024,
            "engine.store_writer_max_bytes",
            &self.engine.store_writer_max_bytes,
            "at least 1024 bytes",
        );
        check(
            !self.storage.data_dir.as_os_str().is_empty(),
            "storage.data_dir",
            &"\"\"",
            "a directory",
        );
        check_users(
            "management.users",
            self.management.users.iter().map(|user| user.name.as_str()),
            &mut check,
        );
        let telemetry = &self.telemetry;
        check(
            ["text", "json"].contains(&telemetry.log_format.as_str()),
            "telemetry.log_format",
            &Quoted(&telemetry.log_format),
            "\"text\" or \"json\"",
        );
        if let Some(listen) = &telemetry.metrics_listen {
            check(
                listen.parse::<SocketAddr>().is_ok(),
                "telemetry.metrics_listen",
                &Quoted(listen),
                "a literal IP:port, e.g. \"127.0.0.1:9471\"",
            );
        }
        found.extend(self.addresses_out_of_range());
        let needed_by = gateway.amqps_listen().map(|_| "gateway.amqps_listen");
        found.extend(gateway.tls.check("gateway", needed_by));
        found.extend(self.management.tls.check("management", None));
        found.extend(self.cluster.tls.check());
        found
    }
}

/// What a dialled address must look like, for the refusal's text.
const DIALLED: &str = "an address with its scheme, http://host:port (https://host:port with \
                       cluster.tls), e.g. \"http://127.0.0.1:50061\"";

/// What a gRPC listen address must look like, for the refusal's text.
const LISTENED: &str = "host:port (an IP address or a host name, and a port; no scheme), \
                        e.g. \"127.0.0.1:50061\"";

impl Settings {
    /// Every address a role dials (another component, a storage group
    /// member, the OTLP collector) and every gRPC listen address, checked
    /// for its form before anything starts: an address without its scheme
    /// (`127.0.0.1:5000` for `http://127.0.0.1:5000`) would otherwise be
    /// accepted and fail every second for ever as a transport error.
    fn addresses_out_of_range(&self) -> Vec<Range> {
        let mut found = Vec::new();
        let mut dialled = |key: String, addr: &str, needs_port: bool| {
            if dialled_address_is_usable(addr, needs_port) {
                return;
            }
            let allowed = if needs_port {
                DIALLED
            } else {
                "an http:// or https:// URL, e.g. \"http://127.0.0.1:4317\""
            };
            found.push(Range {
                key,
                value: Quoted(addr).to_string(),
                allowed: allowed.to_string(),
            });
        };
        // One address, or a list that replaces it when not empty.
        let one_or_list = [
            (
                "gateway.engine_addr",
                &self.gateway.engine_addr,
                "gateway.engine_addrs",
                &self.gateway.engine_addrs,
            ),
            (
                "engine.storage_addr",
                &self.engine.storage_addr,
                "engine.storage_addrs",
                &self.engine.storage_addrs,
            ),
            (
                "management.storage_addr",
                &self.management.storage_addr,
                "management.storage_addrs",
                &self.management.storage_addrs,
            ),
            (
                "management.engine_addr",
                &self.management.engine_addr,
                "management.engine_addrs",
                &self.management.engine_addrs,
            ),
        ];
        for (one_key, one, list_key, list) in one_or_list {
            if list.is_empty() {
                dialled(one_key.to_string(), one, true);
            }
            for addr in list {
                dialled(list_key.to_string(), addr, true);
            }
        }
        for (id, addr) in &self.storage.members {
            dialled(format!("storage.members.{id}"), addr, true);
        }
        if let Some(endpoint) = self.telemetry.otlp_endpoint() {
            dialled("telemetry.otlp_endpoint".to_string(), endpoint, false);
        }
        for (key, listen) in [
            ("engine.listen", &self.engine.listen),
            ("storage.listen", &self.storage.listen),
            ("management.listen", &self.management.listen),
        ] {
            if !listen_address_is_usable(listen) {
                found.push(Range {
                    key: key.to_string(),
                    value: Quoted(listen).to_string(),
                    allowed: LISTENED.to_string(),
                });
            }
        }
        let http_listen = self.management.http_listen.trim();
        if !http_listen.is_empty() && http_listen.parse::<SocketAddr>().is_err() {
            found.push(Range {
                key: "management.http_listen".to_string(),
                value: Quoted(&self.management.http_listen).to_string(),
                allowed: "a literal IP:port, e.g. \"127.0.0.1:15672\", or empty for none"
                    .to_string(),
            });
        }
        found
    }
}

/// Whether `addr` is a URI a gRPC client can dial: scheme `http` or
/// `https`, a host, (with `needs_port`) a port, and no path beyond `/`.
fn dialled_address_is_usable(addr: &str, needs_port: bool) -> bool {
    let Ok(uri) = addr.trim().parse::<tonic::codegen::http::Uri>() else {
        return false;
    };
    let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
    let Some(authority) = uri.authority() else {
        return false;
    };
    let host_ok = !authority.host().is_empty() && !authority.as_str().contains('@');
    let port_ok = !needs_port || authority.port_u16().is_some_and(|port| port != 0);
    let path_ok = matches!(uri.path(), "" | "/") && uri.query().is_none();
    scheme_ok && host_ok && port_ok && path_ok
}

/// Whether `listen` is `host:port` as a listener binds it (the host an IP
/// address, `[v6]`, or a name to resolve; port 0 picks one).
fn listen_address_is_usable(listen: &str) -> bool {
    if listen.parse::<SocketAddr>().is_ok() {
        return true;
    }
    let Some((host, port)) = listen.rsplit_once(':') else {
        return false;
    };
    let host_ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'));
    host_ok && port.parse::<u16>().is_ok()
}

/// Each user's name must be set and used once.
fn check_users<'a>(
    list: &str,
    names: impl Iterator<Item = &'a str>,
    check: &mut impl FnMut(bool, &str, &dyn fmt::Display, &str),
) {
    let mut seen: Vec<&str> = Vec::new();
    for (index, name) in names.enumerate() {
        let key = format!("{list}[{index}].name");
        check(!name.is_empty(), &key, &Quoted(name), "a name");
        if let Some(first) = seen.iter().position(|seen| *seen == name) {
            check(
                false,
                &key,
                &Quoted(name),
                &format!("a name not already given to {list}[{first}]"),
            );
        }
        seen.push(name);
    }
}

/// An out-of-range value, before its origin is looked up.
pub(super) struct Range {
    pub(super) key: String,
    pub(super) value: String,
    pub(super) allowed: String,
}

pub(super) struct Quoted<'a>(pub(super) &'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

pub(super) struct Millis(pub(super) Duration);

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.as_millis())
    }
}

/// A listener's TLS (`gateway.tls`, `management.tls`) checked as the
/// listener will use it.
trait TlsCheck {
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
