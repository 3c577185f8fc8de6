//! `spillctl policy …` and `spillctl operator-policy …`: RabbitMQ's
//! `set_policy`, `list_policies`, `clear_policy` and their operator-policy
//! twins, in --vhost. The definition is the JSON object rabbitmqctl takes.

use super::output::{table, Printer};
use super::{Answer, Client};
use clap::Subcommand;
use spillway_proto::management as m;

#[derive(Subcommand)]
pub(crate) enum PolicyCommand {
    /// The policies of --vhost.
    List,
    /// Adds or replaces a policy: it applies at once to the queues (and
    /// exchanges) whose names PATTERN matches, and survives a restart.
    Set {
        name: String,
        /// A regular expression searched in names (^…$ for whole names).
        pattern: String,
        /// A JSON object, e.g. '{"max-length": 1000, "dead-letter-exchange": "dlx"}'.
        definition: String,
        /// Of the policies that match an object, the highest priority applies.
        #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
        priority: i32,
        /// queues, exchanges or all (operator policies: queues).
        #[arg(long)]
        apply_to: Option<String>,
    },
    /// Removes a policy: what it set stops applying at once.
    Clear { name: String },
}

pub(crate) async fn policy_command(
    client: &mut Client,
    out: &Printer,
    vhost: String,
    operator: bool,
    command: PolicyCommand,
) -> anyhow::Result<()> {
    match command {
        PolicyCommand::List => {
            let list = client
                .list_policies(m::ListPoliciesRequest { vhost, operator })
                .await
                .answer()?;
            out.print(&list, || policy_table(&list.policies))
        }
        PolicyCommand::Set {
            name,
            pattern,
            definition,
            priority,
            apply_to,
        } => {
            let default_apply_to = if operator { "queues" } else { "all" };
            let policy = client
                .set_policy(m::SetPolicyRequest {
                    policy: Some(m::Policy {
                        vhost,
                        name,
                        pattern,
                        apply_to: apply_to.unwrap_or_else(|| default_apply_to.to_string()),
                        priority,
                        definition,
                        operator,
                    }),
                })
                .await
                .answer()?;
            out.print(&policy, || policy_table(std::slice::from_ref(&policy)))
        }
        PolicyCommand::Clear { name } => {
            let r = client
                .clear_policy(m::ClearPolicyRequest {
                    vhost: vhost.clone(),
                    name: name.clone(),
                    operator,
                })
                .await
                .answer()?;
            let what = if operator {
                "operator policy"
            } else {
                "policy"
            };
            out.print(&r, || format!("{what} '{name}' of vhost '{vhost}' cleared"))
        }
    }
}

pub(crate) fn policy_table(policies: &[m::Policy]) -> String {
    table(
        &[
            "vhost",
            "name",
            "pattern",
            "apply to",
            "priority",
            "definition",
        ],
        policies
            .iter()
            .map(|p| {
                vec![
                    p.vhost.clone(),
                    p.name.clone(),
                    p.pattern.clone(),
                    p.apply_to.clone(),
                    p.priority.to_string(),
                    p.definition.clone(),
                ]
            })
            .collect(),
    )
}
