//! `spillctl connection …` and `spillctl channel list`.

use super::output::{table, value_text, Printer};
use super::{Answer, Client};
use clap::Subcommand;
use spillway_proto::management as m;

/// `spillctl connection …` (of `vhost` with `--only-vhost`).
pub(crate) async fn connection_command(
    client: &mut Client,
    out: &Printer,
    vhost: String,
    command: ConnectionCommand,
) -> anyhow::Result<()> {
    match command {
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
    }
}

/// `spillctl channel list`.
pub(crate) async fn channel_command(
    client: &mut Client,
    out: &Printer,
    command: ChannelCommand,
) -> anyhow::Result<()> {
    let ChannelCommand::List { connection } = command;
    let list = client
        .list_channels(m::ListChannelsRequest {
            vhost: String::new(),
            connection_id: connection,
        })
        .await
        .answer()?;
    out.print(&list, || channel_table(&list.channels))
}

#[derive(Subcommand)]
pub(crate) enum ConnectionCommand {
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
pub(crate) enum ChannelCommand {
    List {
        #[arg(long, default_value_t = 0)]
        connection: u64,
    },
}

pub(crate) fn connection_table(connections: &[m::Connection]) -> String {
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

pub(crate) fn channel_table(channels: &[m::Channel]) -> String {
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
pub(crate) fn link_cell(link: &m::Amqp1Link) -> String {
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
