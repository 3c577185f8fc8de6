//! `spillctl limits …`: vhost and user limits.

use super::output::{table, Printer};
use super::{Answer, Client};
use clap::Subcommand;
use spillway_proto::management as m;

#[derive(Subcommand)]
pub(crate) enum LimitsCommand {
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
pub(crate) fn parse_limit(text: &str) -> Result<i64, String> {
    match text {
        "unlimited" | "none" => Ok(-1),
        _ => text
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= -1)
            .ok_or_else(|| format!("'{text}' is not a limit (a count, or -1 / unlimited)")),
    }
}

/// Vhost limits for `vhost`, or user limits for `user` when given.
pub(crate) async fn limits_command(
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

pub(crate) fn limits_table(limits: &[m::Limits]) -> String {
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
pub(crate) fn vhost_only(limits: &m::Limits, count: u64) -> String {
    if limits.kind == "vhost" {
        count.to_string()
    } else {
        "-".to_string()
    }
}
