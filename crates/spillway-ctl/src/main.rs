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

use std::collections::HashMap;
use std::process::ExitCode;

use anyhow::{bail, Context};
use base64::Engine as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use serde::Serialize;
use spillway_proto::management::management_client::ManagementClient;
use spillway_proto::management::{self as m, argument_value};
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

mod definitions;
mod policies;
mod users;

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
enum StorageCommand {
    /// Each member's role, how far it applied the log and its lag.
    Status,
    /// Adds a storage node (started with the group's settings and its own
    /// storage.node_id): it catches up as a learner, then votes.
    AddMember {
        /// Its storage.node_id.
        id: u64,
        /// Its storage.listen as the other members reach it
        /// (http://host:port).
        address: String,
    },
    /// Removes a storage node from the group.
    RemoveMember { id: u64 },
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

#[derive(Subcommand)]
enum VhostCommand {
    List,
    Create { name: String },
    Get { name: String },
    Delete { name: String },
}

#[derive(Subcommand)]
enum ExchangeCommand {
    List,
    Create {
        name: String,
        /// direct, fanout, topic or headers.
        #[arg(long = "type", default_value = "direct")]
        kind: String,
        #[arg(long)]
        durable: bool,
        #[arg(long)]
        auto_delete: bool,
        #[arg(long)]
        internal: bool,
        #[command(flatten)]
        arguments: Arguments,
    },
    Get {
        name: String,
    },
    Delete {
        name: String,
        #[arg(long)]
        if_unused: bool,
    },
}

#[derive(Subcommand)]
enum QueueCommand {
    List,
    Create {
        name: String,
        #[arg(long)]
        durable: bool,
        #[arg(long)]
        auto_delete: bool,
        #[command(flatten)]
        arguments: Arguments,
    },
    /// Definition, status, the policies that apply and the arguments in
    /// force.
    #[command(visible_alias = "show")]
    Get {
        name: String,
    },
    Delete {
        name: String,
        #[arg(long)]
        if_unused: bool,
        #[arg(long)]
        if_empty: bool,
    },
    Purge {
        name: String,
    },
    /// Shows the first messages without consuming them.
    Peek {
        name: String,
        #[arg(long, default_value_t = 10)]
        count: u32,
    },
    /// Moves ready messages to the end of another queue (e.g. a DLQ back).
    Move {
        source: String,
        destination: String,
        /// At most this many (default: all).
        #[arg(long, default_value_t = 0)]
        max: u64,
    },
    /// Runtime capacity settings of a queue.
    Update {
        name: String,
        #[arg(long)]
        capacity: Option<u64>,
        #[arg(long)]
        resume_capacity: Option<u64>,
        #[arg(long)]
        max_count: Option<u64>,
    },
}

#[derive(Args, Clone)]
struct BindingArgs {
    /// The source exchange.
    source: String,
    /// The destination queue (or exchange with --to-exchange).
    destination: String,
    #[arg(long, default_value = "")]
    routing_key: String,
    #[arg(long)]
    to_exchange: bool,
    #[command(flatten)]
    arguments: Arguments,
}

#[derive(Subcommand)]
enum BindingCommand {
    List {
        #[arg(long, default_value = "")]
        source: String,
        #[arg(long, default_value = "")]
        destination: String,
    },
    Create(BindingArgs),
    Get(BindingArgs),
    Delete(BindingArgs),
}

#[derive(Subcommand)]
enum ConnectionCommand {
    /// Connections of every vhost (with --only-vhost: of --vhost).
    List {
        /// Only the connections of --vhost.
        #[arg(long)]
        only_vhost: bool,
    },
    /// Closes a connection: the client gets 320 CONNECTION_FORCED and the reason.
    Close {
        id: u64,
        #[arg(long, default_value = "")]
        reason: String,
    },
}

#[derive(Subcommand)]
enum LimitsCommand {
    /// The limits in force for every vhost and user, and what they count.
    List,
    /// Overrides limits of --vhost (default `/`), or of --for-user. A value
    /// is a count, 0 (none allowed) or -1/`unlimited`; a limit not given
    /// keeps its value. Not persisted: after a restart the configuration
    /// applies.
    Set {
        /// The user whose limits to set (instead of --vhost's; --user is the
        /// login).
        #[arg(long = "for-user")]
        for_user: Option<String>,
        /// Connections open at once (vhost or user).
        #[arg(long, value_parser = parse_limit, allow_negative_numbers = true)]
        max_connections: Option<i64>,
        /// Queues in the vhost.
        #[arg(long, value_parser = parse_limit, allow_negative_numbers = true)]
        max_queues: Option<i64>,
        /// Channels open at once over all the user's connections.
        #[arg(long, value_parser = parse_limit, allow_negative_numbers = true)]
        max_channels: Option<i64>,
        /// Exchanges declared in the vhost (built-in ones not counted).
        #[arg(long, value_parser = parse_limit, allow_negative_numbers = true)]
        max_exchanges: Option<i64>,
        /// Bindings in the vhost.
        #[arg(long, value_parser = parse_limit, allow_negative_numbers = true)]
        max_bindings: Option<i64>,
        /// Consumers on the vhost's queues, or on all the user's connections.
        #[arg(long, value_parser = parse_limit, allow_negative_numbers = true)]
        max_consumers: Option<i64>,
    },
    /// Drops the overrides of --vhost (default `/`), or of --for-user: the
    /// configuration's defaults apply again.
    Clear {
        #[arg(long = "for-user")]
        for_user: Option<String>,
    },
}

/// A limit: a count, or -1 / `unlimited` for none.
fn parse_limit(text: &str) -> Result<i64, String> {
    match text {
        "unlimited" | "none" => Ok(-1),
        _ => text
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= -1)
            .ok_or_else(|| format!("'{text}' is not a limit (a count, or -1 / unlimited)")),
    }
}

#[derive(Subcommand)]
enum ChannelCommand {
    List {
        #[arg(long, default_value_t = 0)]
        connection: u64,
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
    fn to_map(&self) -> anyhow::Result<HashMap<String, m::ArgumentValue>> {
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
        Command::Vhost(command) => match command {
            VhostCommand::List => {
                let list = client.list_vhosts(m::ListVhostsRequest {}).await.answer()?;
                out.print(&list, || vhost_table(&list.vhosts))
            }
            VhostCommand::Create { name } => {
                let v = client
                    .create_vhost(m::CreateVhostRequest { name })
                    .await
                    .answer()?;
                out.print(&v, || vhost_table(std::slice::from_ref(&v)))
            }
            VhostCommand::Get { name } => {
                let v = client
                    .get_vhost(m::GetVhostRequest { name })
                    .await
                    .answer()?;
                out.print(&v, || vhost_table(std::slice::from_ref(&v)))
            }
            VhostCommand::Delete { name } => {
                let r = client
                    .delete_vhost(m::DeleteVhostRequest { name: name.clone() })
                    .await
                    .answer()?;
                out.print(&r, || format!("vhost '{name}' deleted"))
            }
        },
        Command::Exchange(command) => match command {
            ExchangeCommand::List => {
                let list = client
                    .list_exchanges(m::ListExchangesRequest { vhost })
                    .await
                    .answer()?;
                out.print(&list, || exchange_table(&list.exchanges))
            }
            ExchangeCommand::Create {
                name,
                kind,
                durable,
                auto_delete,
                internal,
                arguments,
            } => {
                let x = client
                    .create_exchange(m::CreateExchangeRequest {
                        vhost,
                        name,
                        kind,
                        durable,
                        auto_delete,
                        internal,
                        arguments: arguments.to_map()?,
                    })
                    .await
                    .answer()?;
                out.print(&x, || exchange_table(std::slice::from_ref(&x)))
            }
            ExchangeCommand::Get { name } => {
                let x = client
                    .get_exchange(m::GetExchangeRequest { vhost, name })
                    .await
                    .answer()?;
                out.print(&x, || exchange_table(std::slice::from_ref(&x)))
            }
            ExchangeCommand::Delete { name, if_unused } => {
                let r = client
                    .delete_exchange(m::DeleteExchangeRequest {
                        vhost,
                        name: name.clone(),
                        if_unused,
                    })
                    .await
                    .answer()?;
                out.print(&r, || format!("exchange '{name}' deleted"))
            }
        },
        Command::Queue(command) => queue_command(&mut client, &out, vhost, command).await,
        Command::Binding(command) => {
            let binding = |args: BindingArgs, vhost: String| -> anyhow::Result<m::Binding> {
                Ok(m::Binding {
                    vhost,
                    source: args.source,
                    destination: args.destination,
                    destination_is_exchange: args.to_exchange,
                    routing_key: args.routing_key,
                    arguments: args.arguments.to_map()?,
                })
            };
            match command {
                BindingCommand::List {
                    source,
                    destination,
                } => {
                    let list = client
                        .list_bindings(m::ListBindingsRequest {
                            vhost,
                            source,
                            destination,
                        })
                        .await
                        .answer()?;
                    out.print(&list, || binding_table(&list.bindings))
                }
                BindingCommand::Create(args) => {
                    let b = client
                        .create_binding(m::CreateBindingRequest {
                            binding: Some(binding(args, vhost)?),
                        })
                        .await
                        .answer()?;
                    out.print(&b, || binding_table(std::slice::from_ref(&b)))
                }
                BindingCommand::Get(args) => {
                    let b = client
                        .get_binding(m::GetBindingRequest {
                            binding: Some(binding(args, vhost)?),
                        })
                        .await
                        .answer()?;
                    out.print(&b, || binding_table(std::slice::from_ref(&b)))
                }
                BindingCommand::Delete(args) => {
                    let r = client
                        .delete_binding(m::DeleteBindingRequest {
                            binding: Some(binding(args, vhost)?),
                        })
                        .await
                        .answer()?;
                    out.print(&r, || "binding deleted".to_string())
                }
            }
        }
        Command::Connection(command) => match command {
            ConnectionCommand::List { only_vhost } => {
                let list = client
                    .list_connections(m::ListConnectionsRequest {
                        vhost: if only_vhost { vhost } else { String::new() },
                    })
                    .await
                    .answer()?;
                out.print(&list, || connection_table(&list.connections))
            }
            ConnectionCommand::Close { id, reason } => {
                let r = client
                    .close_connection(m::CloseConnectionRequest { id, reason })
                    .await
                    .answer()?;
                out.print(&r, || format!("connection {id} closed"))
            }
        },
        Command::Channel(ChannelCommand::List { connection }) => {
            let list = client
                .list_channels(m::ListChannelsRequest {
                    vhost: String::new(),
                    connection_id: connection,
                })
                .await
                .answer()?;
            out.print(&list, || channel_table(&list.channels))
        }
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
        Command::Limits(command) => limits_command(&mut client, &out, vhost, command).await,
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
        Command::Storage(command) => {
            let group = match command {
                StorageCommand::Status => client
                    .get_storage_group(m::GetStorageGroupRequest {})
                    .await
                    .answer()?,
                StorageCommand::AddMember { id, address } => client
                    .add_storage_member(m::AddStorageMemberRequest { id, address })
                    .await
                    .answer()?,
                StorageCommand::RemoveMember { id } => client
                    .remove_storage_member(m::RemoveStorageMemberRequest { id })
                    .await
                    .answer()?,
            };
            out.print(&group, || {
                let rows = group
                    .members
                    .iter()
                    .map(|member| {
                        vec![
                            member.id.to_string(),
                            member.address.clone(),
                            member.role.clone(),
                            member.applied_index.to_string(),
                            member.lag.to_string(),
                        ]
                    })
                    .collect();
                table(&["id", "address", "role", "applied index", "lag"], rows)
            })
        }
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

/// Vhost limits for `vhost`, or user limits for `user` when given.
async fn limits_command(
    client: &mut Client,
    out: &Printer,
    vhost: String,
    command: LimitsCommand,
) -> anyhow::Result<()> {
    let target = |user: Option<String>| match user {
        Some(user) => (String::new(), user),
        None => (vhost.clone(), String::new()),
    };
    match command {
        LimitsCommand::List => {
            let list = client.list_limits(m::ListLimitsRequest {}).await.answer()?;
            out.print(&list, || {
                let show = |limit: i64| match limit {
                    -1 => "unlimited".to_string(),
                    n => n.to_string(),
                };
                format!(
                    "{}\nper connection: max consumers {}, max queues {}",
                    limits_table(&list.limits),
                    show(list.connection_max_consumers),
                    show(list.connection_max_queues)
                )
            })
        }
        LimitsCommand::Set {
            for_user: user,
            max_connections,
            max_queues,
            max_channels,
            max_exchanges,
            max_bindings,
            max_consumers,
        } => {
            let (vhost, user) = target(user);
            let limits = client
                .set_limits(m::SetLimitsRequest {
                    vhost,
                    user,
                    max_connections,
                    max_queues,
                    max_channels,
                    max_exchanges,
                    max_bindings,
                    max_consumers,
                })
                .await
                .answer()?;
            out.print(&limits, || limits_table(std::slice::from_ref(&limits)))
        }
        LimitsCommand::Clear { for_user: user } => {
            let (vhost, user) = target(user);
            let what = if user.is_empty() {
                format!("vhost '{vhost}'")
            } else {
                format!("user '{user}'")
            };
            let r = client
                .clear_limits(m::ClearLimitsRequest { vhost, user })
                .await
                .answer()?;
            out.print(&r, || format!("limits of {what} cleared"))
        }
    }
}

async fn queue_command(
    client: &mut Client,
    out: &Printer,
    vhost: String,
    command: QueueCommand,
) -> anyhow::Result<()> {
    match command {
        QueueCommand::List => {
            let list = client
                .list_queues(m::ListQueuesRequest { vhost })
                .await
                .answer()?;
            out.print(&list, || queue_table(&list.queues))
        }
        QueueCommand::Create {
            name,
            durable,
            auto_delete,
            arguments,
        } => {
            let q = client
                .create_queue(m::CreateQueueRequest {
                    vhost,
                    name,
                    durable,
                    auto_delete,
                    arguments: arguments.to_map()?,
                })
                .await
                .answer()?;
            out.print(&q, || queue_table(std::slice::from_ref(&q)))
        }
        QueueCommand::Get { name } => {
            let q = client
                .get_queue(m::GetQueueRequest { vhost, name })
                .await
                .answer()?;
            out.print(&q, || {
                let show = |name: &str| match name {
                    "" => "none".to_string(),
                    name => name.to_string(),
                };
                format!(
                    "{}\npolicy: {}\noperator policy: {}\nin force: {}",
                    queue_table(std::slice::from_ref(&q)),
                    show(&q.policy),
                    show(&q.operator_policy),
                    map_text(&q.effective_arguments)
                )
            })
        }
        QueueCommand::Delete {
            name,
            if_unused,
            if_empty,
        } => {
            let r = client
                .delete_queue(m::DeleteQueueRequest {
                    vhost,
                    name: name.clone(),
                    if_unused,
                    if_empty,
                })
                .await
                .answer()?;
            out.print(&r, || {
                format!("queue '{name}' deleted ({} messages)", r.messages_deleted)
            })
        }
        QueueCommand::Purge { name } => {
            let r = client
                .purge_queue(m::PurgeQueueRequest {
                    vhost,
                    name: name.clone(),
                })
                .await
                .answer()?;
            out.print(&r, || {
                format!("queue '{name}' purged ({} messages)", r.messages_purged)
            })
        }
        QueueCommand::Peek { name, count } => {
            let r = client
                .peek_messages(m::PeekMessagesRequest {
                    vhost,
                    queue: name,
                    count,
                })
                .await
                .answer()?;
            out.print(&r, || peek_table(&r.messages))
        }
        QueueCommand::Move {
            source,
            destination,
            max,
        } => {
            let r = client
                .move_messages(m::MoveMessagesRequest {
                    vhost,
                    source: source.clone(),
                    destination: destination.clone(),
                    max_messages: max,
                })
                .await
                .answer()?;
            out.print(&r, || {
                let mut text = format!(
                    "moved {} messages from '{source}' to '{destination}', {} left",
                    r.moved, r.remaining
                );
                if !r.stopped_reason.is_empty() {
                    text.push_str(&format!(" (stopped: {})", r.stopped_reason));
                }
                text
            })
        }
        QueueCommand::Update {
            name,
            capacity,
            resume_capacity,
            max_count,
        } => {
            let r = client
                .update_queue(m::UpdateQueueRequest {
                    vhost,
                    name: name.clone(),
                    capacity,
                    resume_capacity,
                    max_count,
                })
                .await
                .answer()?;
            out.print(&r, || format!("queue '{name}' updated"))
        }
    }
}

// ------------------------------------------------------------------ output

struct Printer(Output);

impl Printer {
    fn print<T: Serialize>(&self, value: &T, table: impl FnOnce() -> String) -> anyhow::Result<()> {
        match self.0 {
            Output::Json => println!("{}", serde_json::to_string_pretty(value)?),
            Output::Table => println!("{}", table()),
        }
        Ok(())
    }
}

fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut table = Table::new();
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_header(header.to_vec());
    for row in rows {
        table.add_row(row);
    }
    table.to_string()
}

fn key_values(pairs: &[(&str, String)]) -> String {
    table(
        &["field", "value"],
        pairs
            .iter()
            .map(|(k, v)| vec![k.to_string(), v.clone()])
            .collect(),
    )
}

fn value_text(value: &m::ArgumentValue) -> String {
    match &value.value {
        Some(argument_value::Value::StringValue(s)) | Some(argument_value::Value::Text(s)) => {
            s.clone()
        }
        Some(argument_value::Value::IntValue(i)) => i.to_string(),
        Some(argument_value::Value::BoolValue(b)) => b.to_string(),
        Some(argument_value::Value::DoubleValue(d)) => d.to_string(),
        None => String::new(),
    }
}

fn map_text(map: &HashMap<String, m::ArgumentValue>) -> String {
    let mut pairs: Vec<String> = map
        .iter()
        .map(|(k, v)| format!("{k}={}", value_text(v)))
        .collect();
    pairs.sort();
    pairs.join(", ")
}

fn flags(pairs: &[(&str, bool)]) -> String {
    pairs
        .iter()
        .filter(|(_, on)| *on)
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .join(",")
}

fn vhost_table(vhosts: &[m::Vhost]) -> String {
    table(
        &["name", "exchanges", "queues", "connections"],
        vhosts
            .iter()
            .map(|v| {
                vec![
                    v.name.clone(),
                    v.exchanges.to_string(),
                    v.queues.to_string(),
                    v.connections.to_string(),
                ]
            })
            .collect(),
    )
}

fn limits_table(limits: &[m::Limits]) -> String {
    // "(set)": overridden through management; otherwise the configuration's.
    let show = |limit: Option<i64>, name: &str, overridden: &[String]| {
        let Some(limit) = limit else {
            return "-".to_string();
        };
        let value = match limit {
            -1 => "unlimited".to_string(),
            n => n.to_string(),
        };
        if overridden.iter().any(|o| o == name) {
            format!("{value} (set)")
        } else {
            value
        }
    };
    table(
        &[
            "kind",
            "name",
            "max connections",
            "max queues",
            "max channels",
            "max exchanges",
            "max bindings",
            "max consumers",
            "connections",
            "queues",
            "channels",
            "exchanges",
            "bindings",
            "consumers",
        ],
        limits
            .iter()
            .map(|l| {
                vec![
                    l.kind.clone(),
                    l.name.clone(),
                    show(l.max_connections, "max_connections", &l.overridden),
                    show(l.max_queues, "max_queues", &l.overridden),
                    show(l.max_channels, "max_channels", &l.overridden),
                    show(l.max_exchanges, "max_exchanges", &l.overridden),
                    show(l.max_bindings, "max_bindings", &l.overridden),
                    show(l.max_consumers, "max_consumers", &l.overridden),
                    l.connections.to_string(),
                    vhost_only(l, l.queues),
                    l.channels.to_string(),
                    vhost_only(l, l.exchanges),
                    vhost_only(l, l.bindings),
                    l.consumers.to_string(),
                ]
            })
            .collect(),
    )
}

/// A count that only a vhost has.
fn vhost_only(limits: &m::Limits, count: u64) -> String {
    if limits.kind == "vhost" {
        count.to_string()
    } else {
        "-".to_string()
    }
}

fn exchange_table(exchanges: &[m::Exchange]) -> String {
    table(
        &["name", "type", "flags", "arguments", "policy", "delayed"],
        exchanges
            .iter()
            .map(|x| {
                let name = if x.name.is_empty() {
                    "(default)".to_string()
                } else {
                    x.name.clone()
                };
                vec![
                    name,
                    x.kind.clone(),
                    flags(&[
                        ("durable", x.durable),
                        ("auto-delete", x.auto_delete),
                        ("internal", x.internal),
                        ("builtin", x.builtin),
                    ]),
                    map_text(&x.arguments),
                    x.policy.clone(),
                    if x.kind == "x-delayed-message" {
                        x.delayed_messages.to_string()
                    } else {
                        String::new()
                    },
                ]
            })
            .collect(),
    )
}

fn queue_table(queues: &[m::Queue]) -> String {
    table(
        &[
            "name",
            "ready",
            "unacked",
            "consumers",
            "bytes",
            "flags",
            "arguments",
            "policy",
        ],
        queues
            .iter()
            .map(|q| {
                let status = q.status.clone().unwrap_or_default();
                let consumers = if status.active_consumer.is_empty() {
                    status.consumers.to_string()
                } else {
                    format!("{} (active: {})", status.consumers, status.active_consumer)
                };
                vec![
                    q.name.clone(),
                    status.messages.to_string(),
                    status.unacked.to_string(),
                    consumers,
                    status.bytes.to_string(),
                    flags(&[
                        ("durable", q.durable),
                        ("auto-delete", q.auto_delete),
                        ("exclusive", q.exclusive),
                    ]),
                    map_text(&q.arguments),
                    match (q.policy.as_str(), q.operator_policy.as_str()) {
                        (policy, "") => policy.to_string(),
                        ("", operator) => format!("operator: {operator}"),
                        (policy, operator) => format!("{policy}, operator: {operator}"),
                    },
                ]
            })
            .collect(),
    )
}

fn binding_table(bindings: &[m::Binding]) -> String {
    table(
        &["source", "destination", "kind", "routing key", "arguments"],
        bindings
            .iter()
            .map(|b| {
                vec![
                    b.source.clone(),
                    b.destination.clone(),
                    if b.destination_is_exchange {
                        "exchange"
                    } else {
                        "queue"
                    }
                    .to_string(),
                    b.routing_key.clone(),
                    map_text(&b.arguments),
                ]
            })
            .collect(),
    )
}

fn connection_table(connections: &[m::Connection]) -> String {
    table(
        &[
            "id",
            "client",
            "user",
            "vhost",
            "channels",
            "published",
            "delivered",
            "client properties",
        ],
        connections
            .iter()
            .map(|c| {
                let mut properties: Vec<String> = c
                    .client_properties
                    .iter()
                    .filter(|(k, _)| k.as_str() != "capabilities")
                    .map(|(k, v)| format!("{k}={}", value_text(v)))
                    .collect();
                properties.sort();
                vec![
                    c.id.to_string(),
                    c.client_address.clone(),
                    c.user.clone(),
                    c.vhost.clone(),
                    c.channels.to_string(),
                    c.messages_published.to_string(),
                    c.messages_delivered.to_string(),
                    properties.join(", "),
                ]
            })
            .collect(),
    )
}

fn channel_table(channels: &[m::Channel]) -> String {
    table(
        &[
            "connection",
            "channel",
            "client",
            "user",
            "vhost",
            "consumers",
            "unacked",
            "prefetch",
            "confirm",
            "amqp 1.0 link",
        ],
        channels
            .iter()
            .map(|c| {
                vec![
                    c.connection_id.to_string(),
                    c.number.to_string(),
                    c.client_address.clone(),
                    c.user.clone(),
                    c.vhost.clone(),
                    c.consumers.to_string(),
                    c.unacked.to_string(),
                    c.prefetch_count.to_string(),
                    c.confirm.to_string(),
                    c.amqp1_link.as_ref().map(link_cell).unwrap_or_default(),
                ]
            })
            .collect(),
    )
}

/// An AMQP 1.0 link in one cell: session, direction, name and address,
/// e.g. `session 0 in 'orders' -> /queues/orders`.
fn link_cell(link: &m::Amqp1Link) -> String {
    let (direction, arrow) = if link.incoming {
        ("in", "->")
    } else {
        ("out", "<-")
    };
    format!(
        "session {} {direction} '{}' {arrow} {}",
        link.session, link.name, link.address
    )
}

/// Bodies longer than this are cut in the table (JSON has them whole).
const BODY_PREVIEW: usize = 80;

fn peek_table(messages: &[m::PeekedMessage]) -> String {
    table(
        &[
            "#",
            "routing key",
            "redelivered",
            "deliveries",
            "persistent",
            "content type",
            "headers",
            "size",
            "body",
        ],
        messages
            .iter()
            .map(|p| {
                let text = String::from_utf8_lossy(&p.body);
                let mut body: String = text.chars().take(BODY_PREVIEW).collect();
                if text.chars().count() > BODY_PREVIEW {
                    body.push('…');
                }
                vec![
                    p.position.to_string(),
                    p.routing_key.clone(),
                    p.redelivered.to_string(),
                    p.delivery_count.to_string(),
                    p.persistent.to_string(),
                    p.content_type.clone(),
                    map_text(&p.headers),
                    p.body_size.to_string(),
                    body,
                ]
            })
            .collect(),
    )
}
