//! `spillctl binding …`: bindings listed, made, shown and removed.

use super::output::{map_text, table, Printer};
use super::{Answer, Arguments, Client};
use clap::{Args, Subcommand};
use spillway_proto::management as m;

/// `spillctl binding …` in `vhost`.
pub(crate) async fn binding_command(
    client: &mut Client,
    out: &Printer,
    vhost: String,
    command: BindingCommand,
) -> anyhow::Result<()> {
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

#[derive(Args, Clone)]
pub(crate) struct BindingArgs {
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
pub(crate) enum BindingCommand {
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

pub(crate) fn binding_table(bindings: &[m::Binding]) -> String {
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
