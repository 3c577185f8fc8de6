//! `spillctl vhost …`: vhosts listed, created, shown and deleted.

use super::output::{table, Printer};
use super::{Answer, Client};
use clap::Subcommand;
use spillway_proto::management as m;

/// `spillctl vhost …`.
pub(crate) async fn vhost_command(
    client: &mut Client,
    out: &Printer,
    command: VhostCommand,
) -> anyhow::Result<()> {
    match command {
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
    }
}

#[derive(Subcommand)]
pub(crate) enum VhostCommand {
    List,
    Create { name: String },
    Get { name: String },
    Delete { name: String },
}

pub(crate) fn vhost_table(vhosts: &[m::Vhost]) -> String {
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
