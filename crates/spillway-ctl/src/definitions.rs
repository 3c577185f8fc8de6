//! `spillctl definitions export|import`: a topology as RabbitMQ's
//! definitions file (the same JSON as the HTTP API's `/api/definitions`
//! and `rabbitmqctl export_definitions`), over gRPC. An import is checked
//! whole and applied all at once, or not at all.

use std::path::PathBuf;

use super::output::Printer;
use super::{Answer, Client};
use anyhow::Context as _;
use clap::Subcommand;
use spillway_management::http::definitions::{from_json, to_json};
use spillway_proto::management as m;

#[derive(Subcommand)]
pub(crate) enum DefinitionsCommand {
    /// Writes the broker's definitions (users with their password hashes,
    /// vhosts, permissions, policies, exchanges, queues, bindings) to FILE,
    /// or to standard output when FILE is `-` or left out.
    Export {
        file: Option<PathBuf>,
        /// Only this vhost's exchanges, queues, bindings and policies.
        #[arg(long, value_name = "VHOST")]
        only_vhost: Option<String>,
    },
    /// Applies the definitions in FILE (a RabbitMQ or Spillway export):
    /// all of them, or none if any is refused.
    Import {
        file: PathBuf,
        /// The file is one vhost's export: its items go into VHOST.
        #[arg(long, value_name = "VHOST")]
        only_vhost: Option<String>,
    },
}

/// The largest file `import` reads (the HTTP API's bound).
pub(crate) const MAX_FILE_BYTES: u64 =
    spillway_management::http::definitions::MAX_DEFINITIONS_BODY_BYTES as u64;

pub(crate) async fn definitions_command(
    client: &mut Client,
    out: &Printer,
    command: DefinitionsCommand,
) -> anyhow::Result<()> {
    match command {
        DefinitionsCommand::Export { file, only_vhost } => {
            let whole = only_vhost.is_none();
            let definitions = client
                .export_definitions(m::ExportDefinitionsRequest {
                    vhost: only_vhost.unwrap_or_default(),
                })
                .await
                .answer()?;
            let mut body = to_json(&definitions, whole);
            body["product_name"] = serde_json::json!("Spillway");
            let text = serde_json::to_string_pretty(&body)?;
            match file.filter(|f| f.as_os_str() != "-") {
                Some(path) => {
                    std::fs::write(&path, text + "\n")
                        .with_context(|| format!("writing {}", path.display()))?;
                    out.print(&serde_json::json!({ "exported": path }), || {
                        format!(
                            "exported {} vhosts, {} users, {} exchanges, {} queues, {} bindings, {} policies to {}",
                            definitions.vhosts.len(),
                            definitions.users.len(),
                            definitions.exchanges.len(),
                            definitions.queues.len(),
                            definitions.bindings.len(),
                            definitions.policies.len(),
                            path.display()
                        )
                    })
                }
                None => {
                    println!("{text}");
                    Ok(())
                }
            }
        }
        DefinitionsCommand::Import { file, only_vhost } => {
            let size = std::fs::metadata(&file)
                .with_context(|| format!("reading {}", file.display()))?
                .len();
            anyhow::ensure!(
                size <= MAX_FILE_BYTES,
                "{} is {size} bytes, more than one import takes ({MAX_FILE_BYTES}): import it a vhost at a time",
                file.display()
            );
            let text =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let body: serde_json::Value = serde_json::from_slice(&text)
                .with_context(|| format!("{} is not JSON", file.display()))?;
            let definitions = from_json(&body, only_vhost.as_deref())
                .map_err(|reason| anyhow::anyhow!("{}: {reason}", file.display()))?;
            let counts = client
                .import_definitions(m::ImportDefinitionsRequest {
                    definitions: Some(definitions),
                })
                .await
                .answer()?;
            out.print(&counts, || {
                format!(
                    "imported: {} vhosts, {} users, {} permissions, {} policies, {} exchanges, {} queues, {} bindings created or changed",
                    counts.vhosts,
                    counts.users,
                    counts.permissions,
                    counts.policies,
                    counts.exchanges,
                    counts.queues,
                    counts.bindings
                )
            })
        }
    }
}
