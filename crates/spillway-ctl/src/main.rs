//! `spillctl`: every call of Spillway's management API from the command
//! line. Readable tables by default, the API's messages as JSON with
//! `--output json`; on failure the server's reason goes to stderr and the
//! exit code is 1.
//!
//! Credentials: `--token` (bearer) wins; otherwise `--user`/`--password`
//! (default `guest`/`guest`, which the broker accepts from localhost only).
//! Every flag has an environment variable, e.g. `SPILLCTL_ADDR`,
//! `SPILLCTL_TOKEN`.
//!
//! TLS (`management.tls`): `--tls-ca FILE` trusts that CA and connects over
//! TLS (`https://`); `--tls-cert`/`--tls-key` present a client certificate
//! when the server requires one (`management.tls.verify_peer`).
//!
//! This file holds the command line (`Cli`, `Command`), the connection and
//! the dispatch; each resource's subcommands, their calls and their tables
//! live in a module of their own (`vhosts`, `exchanges`, `queues`,
//! `bindings`, `connections`, `limits`, `users`, `policies`, `definitions`,
//! `storage`), and the printing in `output`.

use std::collections::HashMap;
use std::process::ExitCode;

use anyhow::{bail, Context};
use base64::Engine as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
use spillway_proto::management::management_client::ManagementClient;
use spillway_proto::management::{self as m, argument_value};
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

mod bindings;
mod connections;
mod definitions;
mod exchanges;
mod limits;
mod output;
mod policies;
mod queues;
mod storage;
mod users;
mod vhosts;

use bindings::BindingCommand;
use connections::{ChannelCommand, ConnectionCommand};
use exchanges::ExchangeCommand;
use limits::LimitsCommand;
use output::{key_values, Printer};
use queues::QueueCommand;
use storage::StorageCommand;
use vhosts::VhostCommand;

#[derive(Parser)]
#[command(
    name = "spillctl",
    version,
    about = "Manage a Spillway broker over its management API"
)]
struct Cli {
    /// The management API's address.
    #[arg(
        long,
        env = "SPILLCTL_ADDR",
        default_value = "http://127.0.0.1:50051",
        global = true
    )]
    addr: String,
    /// A bearer token (`management.token`); wins over --user/--password.
    #[arg(long, env = "SPILLCTL_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    #[arg(long, env = "SPILLCTL_USER", default_value = "guest", global = true)]
    user: String,
    #[arg(
        long,
        env = "SPILLCTL_PASSWORD",
        default_value = "guest",
        global = true,
        hide_env_values = true,
        hide_default_value = true
    )]
    password: String,
    /// Connect over TLS, trusting the CA certificates (PEM) in this file.
    #[arg(long, env = "SPILLCTL_TLS_CA", global = true)]
    tls_ca: Option<std::path::PathBuf>,
    /// A client certificate (PEM) to present over TLS; needs --tls-key.
    #[arg(long, env = "SPILLCTL_TLS_CERT", global = true, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "SPILLCTL_TLS_KEY", global = true, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// The vhost the command applies to.
    #[arg(long, env = "SPILLCTL_VHOST", default_value = "/", global = true)]
    vhost: String,
    #[arg(long, short, env = "SPILLCTL_OUTPUT", value_enum, default_value_t = Output::Table, global = true)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Broker status: version, totals, store.
    Status,
    #[command(subcommand)]
    Vhost(VhostCommand),
    #[command(subcommand)]
    Exchange(ExchangeCommand),
    #[command(subcommand)]
    Queue(QueueCommand),
    #[command(subcommand)]
    Binding(BindingCommand),
    #[command(subcommand)]
    Connection(ConnectionCommand),
    #[command(subcommand)]
    Channel(ChannelCommand),
    /// Runtime broker settings.
    Settings {
        /// Message bytes in memory before messages flow to disk.
        #[arg(long)]
        flow_to_disk_threshold: Option<u64>,
    },
    /// Vhost and user limits (RabbitMQ's set_vhost_limits / set_user_limits).
    #[command(subcommand)]
    Limits(LimitsCommand),
    /// The broker's users (RabbitMQ's add_user, change_password, ...).
    #[command(subcommand)]
    User(users::UserCommand),
    /// What users may configure, write and read in a vhost (--vhost).
    #[command(subcommand)]
    Permissions(users::PermissionsCommand),
    /// Policies of --vhost (RabbitMQ's set_policy, list_policies,
    /// clear_policy): settings applied to queues and exchanges by name.
    #[command(subcommand)]
    Policy(policies::PolicyCommand),
    /// Operator policies of --vhost (RabbitMQ's set_operator_policy, ...):
    /// ceilings on queue settings; the stricter value wins.
    #[command(subcommand)]
    OperatorPolicy(policies::PolicyCommand),
    /// Definitions as a whole, in RabbitMQ's definitions file format
    /// (export_definitions / import_definitions).
    #[command(subcommand)]
    Definitions(definitions::DefinitionsCommand),
    /// The storage group: its members, adding and removing them
    /// (docs/replication.md).
    #[command(subcommand)]
    Storage(StorageCommand),
    /// The store quota.
    StoreQuota {
        #[arg(long)]
        overfull_size: Option<u64>,
        #[arg(long)]
        underfull_size: Option<u64>,
    },
    /// A vhost's producer transaction timeouts, in milliseconds (0 = off);
    /// those not given keep their value (docs/transactions.md).
    TxTimeouts {
        /// The vhost whose timeouts change.
        #[arg(value_name = "VHOST")]
        target: String,
        /// Warn (CHN-1007) while a transaction stays open longer.
        #[arg(long, value_name = "MS")]
        open_warn: Option<u64>,
        /// Close the connection (506) of a transaction open longer.
        #[arg(long, value_name = "MS")]
        open_close: Option<u64>,
        /// Warn (CHN-1008) while a transaction stays idle longer.
        #[arg(long, value_name = "MS")]
        idle_warn: Option<u64>,
        /// Close the connection (506) of a transaction idle longer.
        #[arg(long, value_name = "MS")]
        idle_close: Option<u64>,
    },
}

/// `--arg key=value` (integer, true/false or string) and
/// `--arg-string key=value` (always a string).
#[derive(Args, Clone, Default)]
struct Arguments {
    /// An argument, e.g. x-max-length=1000 or x-overflow=reject-publish.
    #[arg(long = "arg", value_name = "KEY=VALUE")]
    typed: Vec<String>,
    /// An argument whose value stays a string, e.g. x-name=42.
    #[arg(long = "arg-string", value_name = "KEY=VALUE")]
    strings: Vec<String>,
}

impl Arguments {
    pub(crate) fn to_map(&self) -> anyhow::Result<HashMap<String, m::ArgumentValue>> {
        let mut map = HashMap::new();
        for (raw, typed) in self
            .typed
            .iter()
            .map(|a| (a, true))
            .chain(self.strings.iter().map(|a| (a, false)))
        {
            let Some((key, value)) = raw.split_once('=') else {
                bail!("argument '{raw}' is not KEY=VALUE");
            };
            let value = if !typed {
                argument_value::Value::StringValue(value.to_string())
            } else if let Ok(i) = value.parse::<i64>() {
                argument_value::Value::IntValue(i)
            } else if let Ok(b) = value.parse::<bool>() {
                argument_value::Value::BoolValue(b)
            } else {
                argument_value::Value::StringValue(value.to_string())
            };
            map.insert(key.to_string(), m::ArgumentValue { value: Some(value) });
        }
        Ok(map)
    }
}

/// Adds the credentials to every call.
type AddCredentials =
    Box<dyn FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Send>;

type Client = ManagementClient<InterceptedService<Channel, AddCredentials>>;

/// `--addr` as a URI: `https://` with TLS, `http://` without.
fn endpoint_uri(addr: &str, tls: bool) -> anyhow::Result<String> {
    let scheme = if tls { "https" } else { "http" };
    match addr.split_once("://") {
        None => Ok(format!("{scheme}://{addr}")),
        Some(("https", _)) if !tls => {
            bail!(
                "{addr} is https: give --tls-ca FILE, the CA that signed the broker's certificate"
            )
        }
        Some(("http", rest)) if tls => Ok(format!("https://{rest}")),
        Some(_) => Ok(addr.to_string()),
    }
}

fn tls_config(cli: &Cli) -> anyhow::Result<Option<tonic::transport::ClientTlsConfig>> {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let Some(ca) = &cli.tls_ca else {
        if cli.tls_cert.is_some() {
            bail!("--tls-cert needs --tls-ca: the CA that signed the broker's certificate");
        }
        return Ok(None);
    };
    let read = |path: &std::path::Path| {
        std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
    };
    let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca)?));
    if let (Some(cert), Some(key)) = (&cli.tls_cert, &cli.tls_key) {
        config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
    }
    Ok(Some(config))
}

async fn connect(cli: &Cli) -> anyhow::Result<Client> {
    let tls = tls_config(cli)?;
    let addr = endpoint_uri(&cli.addr, tls.is_some())?;
    let mut endpoint =
        Channel::from_shared(addr.clone()).with_context(|| format!("bad address {addr}"))?;
    if let Some(tls) = tls {
        endpoint = endpoint
            .tls_config(tls)
            .with_context(|| format!("TLS settings for {addr}"))?;
    }
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    let header = match cli.token.as_deref().filter(|t| !t.is_empty()) {
        Some(token) => format!("Bearer {token}"),
        None => format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD
                .encode(format!("{}:{}", cli.user, cli.password))
        ),
    };
    let header: MetadataValue<_> = header
        .parse()
        .context("credentials cannot be sent as a header")?;
    let interceptor: AddCredentials = Box::new(move |mut request: tonic::Request<()>| {
        request
            .metadata_mut()
            .insert("authorization", header.clone());
        Ok(request)
    });
    Ok(ManagementClient::with_interceptor(channel, interceptor))
}

/// A failed call: the server's code and reason.
fn failed(status: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", status.code(), status.message())
}

/// A management call's answer, or the error spillctl prints for it.
trait Answer<T> {
    fn answer(self) -> anyhow::Result<T>;
}

impl<T> Answer<T> for Result<tonic::Response<T>, tonic::Status> {
    fn answer(self) -> anyhow::Result<T> {
        self.map(tonic::Response::into_inner).map_err(failed)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("spillctl: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Start-up recovery, in one line: "complete: …" or "in progress: …".
fn recovery_line(recovery: Option<&m::RecoveryStatus>) -> String {
    let Some(r) = recovery else {
        return "-".to_string();
    };
    let state = if r.complete {
        "complete"
    } else {
        "in progress"
    };
    format!(
        "{state}: {}/{} queues, {} messages, {} ms",
        r.queues_recovered, r.queues_total, r.messages_recovered, r.elapsed_ms
    )
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let mut client = connect(&cli).await?;
    let vhost = cli.vhost.clone();
    let out = Printer(cli.output);
    match cli.command {
        Command::Status => {
            let status = client
                .get_broker_status(m::GetBrokerStatusRequest {})
                .await
                .answer()?;
            out.print(&status, || {
                let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
                key_values(&[
                    ("version", status.version.clone()),
                    ("vhosts", status.vhosts.to_string()),
                    ("queues", status.queues.to_string()),
                    ("messages ready", status.messages_ready.to_string()),
                    ("messages unacked", status.messages_unacked.to_string()),
                    ("message bytes", status.message_bytes.to_string()),
                    ("consumers", status.consumers.to_string()),
                    ("connections", status.connections.to_string()),
                    ("channels", status.channels.to_string()),
                    ("store disk bytes", status.store_disk_bytes.to_string()),
                    ("stored messages", status.stored_messages.to_string()),
                    ("flow to disk threshold", opt(status.flow_to_disk_threshold)),
                    (
                        "flow to disk active",
                        status
                            .flow_to_disk_active
                            .map_or("-".to_string(), |v| v.to_string()),
                    ),
                    ("resident message bytes", opt(status.resident_message_bytes)),
                    ("store quota bytes", opt(status.store_quota_bytes)),
                    ("recovery", recovery_line(status.recovery.as_ref())),
                ])
            })
        }
        Command::Vhost(command) => vhosts::vhost_command(&mut client, &out, command).await,
        Command::Exchange(command) => {
            exchanges::exchange_command(&mut client, &out, vhost, command).await
        }
        Command::Queue(command) => queues::queue_command(&mut client, &out, vhost, command).await,
        Command::Binding(command) => {
            bindings::binding_command(&mut client, &out, vhost, command).await
        }
        Command::Connection(command) => {
            connections::connection_command(&mut client, &out, vhost, command).await
        }
        Command::Channel(command) => connections::channel_command(&mut client, &out, command).await,
        Command::Settings {
            flow_to_disk_threshold,
        } => {
            let r = client
                .set_broker_settings(m::SetBrokerSettingsRequest {
                    flow_to_disk_threshold,
                })
                .await
                .answer()?;
            out.print(&r, || "broker settings changed".to_string())
        }
        Command::Limits(command) => limits::limits_command(&mut client, &out, vhost, command).await,
        Command::User(command) => users::user_command(&mut client, &out, command).await,
        Command::Permissions(command) => {
            users::permissions_command(&mut client, &out, vhost, command).await
        }
        Command::Policy(command) => {
            policies::policy_command(&mut client, &out, vhost, false, command).await
        }
        Command::OperatorPolicy(command) => {
            policies::policy_command(&mut client, &out, vhost, true, command).await
        }
        Command::Definitions(command) => {
            definitions::definitions_command(&mut client, &out, command).await
        }
        Command::Storage(command) => storage::storage_command(&mut client, &out, command).await,
        Command::StoreQuota {
            overfull_size,
            underfull_size,
        } => {
            let r = client
                .set_store_quota(m::SetStoreQuotaRequest {
                    overfull_size,
                    underfull_size,
                })
                .await
                .answer()?;
            out.print(&r, || "store quota changed".to_string())
        }
        Command::TxTimeouts {
            target,
            open_warn,
            open_close,
            idle_warn,
            idle_close,
        } => {
            let r = client
                .set_transaction_timeouts(m::SetTransactionTimeoutsRequest {
                    vhost: target,
                    open_warn_ms: open_warn,
                    open_close_ms: open_close,
                    idle_warn_ms: idle_warn,
                    idle_close_ms: idle_close,
                })
                .await
                .answer()?;
            out.print(&r, || {
                let show = |ms: u64| match ms {
                    0 => "off".to_string(),
                    ms => format!("{ms} ms"),
                };
                format!(
                    "transaction timeouts of vhost '{}': open warn {}, open close {}, \
                     idle warn {}, idle close {}",
                    r.vhost,
                    show(r.open_warn_ms),
                    show(r.open_close_ms),
                    show(r.idle_warn_ms),
                    show(r.idle_close_ms)
                )
            })
        }
    }
}
