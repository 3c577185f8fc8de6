//! `spillctl storage …`: the storage group's members, shown, added and
//! removed.

use super::output::{table, Printer};
use super::{Answer, Client};
use clap::Subcommand;
use spillway_proto::management as m;

/// `spillctl storage …`: the storage group's members.
pub(crate) async fn storage_command(
    client: &mut Client,
    out: &Printer,
    command: StorageCommand,
) -> anyhow::Result<()> {
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

#[derive(Subcommand)]
pub(crate) enum StorageCommand {
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
