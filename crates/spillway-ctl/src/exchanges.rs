//! `spillctl exchange …`: exchanges listed, declared, shown and deleted.

use super::output::{flags, map_text, table, Printer};
use super::{Answer, Arguments, Client};
use clap::Subcommand;
use spillway_proto::management as m;

/// `spillctl exchange …` in `vhost`.
pub(crate) async fn exchange_command(
    client: &mut Client,
    out: &Printer,
    vhost: String,
    command: ExchangeCommand,
) -> anyhow::Result<()> {
    match command {
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
    }
}

#[derive(Subcommand)]
pub(crate) enum ExchangeCommand {
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

pub(crate) fn exchange_table(exchanges: &[m::Exchange]) -> String {
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
