//! `spillctl queue …`: queues listed, declared, shown, deleted and purged,
//! their messages peeked and moved, their flow-control limits changed.

use super::output::{flags, map_text, table, Printer};
use super::{Answer, Arguments, Client};
use clap::Subcommand;
use spillway_proto::management as m;

#[derive(Subcommand)]
pub(crate) enum QueueCommand {
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

pub(crate) async fn queue_command(
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

pub(crate) fn queue_table(queues: &[m::Queue]) -> String {
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

/// Bodies longer than this are cut in the table (JSON has them whole).
pub(crate) const BODY_PREVIEW: usize = 80;

pub(crate) fn peek_table(messages: &[m::PeekedMessage]) -> String {
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
