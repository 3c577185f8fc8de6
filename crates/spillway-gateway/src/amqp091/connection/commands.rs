//! Method → engine command: what each client method on an open channel asks
//! of the engine, and how its reply is to be answered. One arm per method;
//! the connection (`mod.rs`) does the bookkeeping every request shares
//! (request id, pending answer, nowait) so that adding a method here is one
//! arm.

use amq_protocol::protocol::{
    access, basic, channel as chan, confirm, exchange, queue, tx, AMQPClass,
};
use spillway_amqp::{encode_table, reply_code, MethodId};
use spillway_proto::engine::{self as pb, session_command::Command};

use super::{Answer, ConnectionError};

/// What a client method on an open channel turns into.
pub(super) enum Translation {
    /// A request to the engine; its reply is answered as `answer`, or not at
    /// all when the client asked for `nowait`.
    Request {
        command: Command,
        answer: Answer,
        nowait: bool,
    },
    /// A command the engine does not answer (ack, nack, reject).
    Notify(Command),
    /// Answered by the gateway at once, without the engine.
    Reply(AMQPClass),
    /// basic.publish: the content header and body frames follow.
    Publish(basic::Publish),
    /// Nothing to do (a late close-ok or flow-ok).
    Ignore,
}

fn request(answer: Answer, nowait: bool, command: Command) -> Translation {
    Translation::Request {
        command,
        answer,
        nowait,
    }
}

/// Translates `method`, received on open channel `channel`. `request_id` is
/// the id the command carries if it turns out to be a request.
pub(super) fn translate(
    method: AMQPClass,
    channel: u16,
    request_id: u64,
) -> Result<Translation, ConnectionError> {
    let id = MethodId::new(method.get_amqp_class_id(), method.get_amqp_method_id());
    let ch = u32::from(channel);
    // Bind and unbind carry the same fields (amq-protocol has a type for each).
    let exchange_binding =
        |destination: &str, source: &str, routing_key: &str, arguments| pb::ExchangeBind {
            request_id,
            channel: ch,
            destination: destination.to_string(),
            source: source.to_string(),
            routing_key: routing_key.to_string(),
            arguments: encode_table(arguments),
        };
    let queue_binding = |queue: &str, exchange: &str, routing_key: &str, arguments| pb::QueueBind {
        request_id,
        channel: ch,
        queue: queue.to_string(),
        exchange: exchange.to_string(),
        routing_key: routing_key.to_string(),
        arguments: encode_table(arguments),
    };
    let translation = match method {
        AMQPClass::Channel(chan::AMQPMethod::Open(_)) => {
            return Err(ConnectionError::new(
                reply_code::CHANNEL_ERROR,
                format!("channel {channel} is already open"),
            )
            .on(id));
        }
        AMQPClass::Channel(chan::AMQPMethod::Close(_)) => request(
            Answer::ChannelCloseByClient,
            false,
            Command::ChannelClose(pb::ChannelClose {
                request_id,
                channel: ch,
            }),
        ),
        AMQPClass::Channel(chan::AMQPMethod::CloseOk(_) | chan::AMQPMethod::FlowOk(_)) => {
            Translation::Ignore
        }
        // Client-initiated flow control: `active=true` is what a channel
        // already is; `active=false` is refused as RabbitMQ refuses it
        // (540). Answering flow-ok and delivering on would promise a pause
        // that never happens; deliveries are paced by prefetch and TCP
        // back-pressure instead.
        AMQPClass::Channel(chan::AMQPMethod::Flow(flow)) => {
            if !flow.active {
                return Err(
                    ConnectionError::new(reply_code::NOT_IMPLEMENTED, "active=false").on(id),
                );
            }
            Translation::Reply(AMQPClass::Channel(chan::AMQPMethod::FlowOk(chan::FlowOk {
                active: true,
            })))
        }
        AMQPClass::Access(access::AMQPMethod::Request(_)) => Translation::Reply(AMQPClass::Access(
            access::AMQPMethod::RequestOk(access::RequestOk {}),
        )),
        AMQPClass::Exchange(exchange::AMQPMethod::Declare(m)) => request(
            Answer::ExchangeDeclare,
            m.nowait,
            Command::ExchangeDeclare(pb::ExchangeDeclare {
                request_id,
                channel: ch,
                exchange: m.exchange.to_string(),
                kind: m.kind.to_string(),
                passive: m.passive,
                durable: m.durable,
                auto_delete: m.auto_delete,
                internal: m.internal,
                arguments: encode_table(&m.arguments),
            }),
        ),
        AMQPClass::Exchange(exchange::AMQPMethod::Delete(m)) => request(
            Answer::ExchangeDelete,
            m.nowait,
            Command::ExchangeDelete(pb::ExchangeDelete {
                request_id,
                channel: ch,
                exchange: m.exchange.to_string(),
                if_unused: m.if_unused,
            }),
        ),
        AMQPClass::Exchange(exchange::AMQPMethod::Bind(m)) => request(
            Answer::ExchangeBind,
            m.nowait,
            Command::ExchangeBind(exchange_binding(
                m.destination.as_str(),
                m.source.as_str(),
                m.routing_key.as_str(),
                &m.arguments,
            )),
        ),
        AMQPClass::Exchange(exchange::AMQPMethod::Unbind(m)) => request(
            Answer::ExchangeUnbind,
            m.nowait,
            Command::ExchangeUnbind(exchange_binding(
                m.destination.as_str(),
                m.source.as_str(),
                m.routing_key.as_str(),
                &m.arguments,
            )),
        ),
        AMQPClass::Queue(queue::AMQPMethod::Declare(m)) => request(
            Answer::QueueDeclare,
            m.nowait,
            Command::QueueDeclare(pb::QueueDeclare {
                request_id,
                channel: ch,
                queue: m.queue.to_string(),
                passive: m.passive,
                durable: m.durable,
                exclusive: m.exclusive,
                auto_delete: m.auto_delete,
                arguments: encode_table(&m.arguments),
            }),
        ),
        AMQPClass::Queue(queue::AMQPMethod::Bind(m)) => request(
            Answer::QueueBind,
            m.nowait,
            Command::QueueBind(queue_binding(
                m.queue.as_str(),
                m.exchange.as_str(),
                m.routing_key.as_str(),
                &m.arguments,
            )),
        ),
        // queue.unbind has no nowait flag.
        AMQPClass::Queue(queue::AMQPMethod::Unbind(m)) => request(
            Answer::QueueUnbind,
            false,
            Command::QueueUnbind(queue_binding(
                m.queue.as_str(),
                m.exchange.as_str(),
                m.routing_key.as_str(),
                &m.arguments,
            )),
        ),
        AMQPClass::Queue(queue::AMQPMethod::Purge(m)) => request(
            Answer::QueuePurge,
            m.nowait,
            Command::QueuePurge(pb::QueuePurge {
                request_id,
                channel: ch,
                queue: m.queue.to_string(),
            }),
        ),
        AMQPClass::Queue(queue::AMQPMethod::Delete(m)) => request(
            Answer::QueueDelete,
            m.nowait,
            Command::QueueDelete(pb::QueueDelete {
                request_id,
                channel: ch,
                queue: m.queue.to_string(),
                if_unused: m.if_unused,
                if_empty: m.if_empty,
            }),
        ),
        // RabbitMQ implements no recover that redelivers to the same
        // consumer and refuses it with 540; accepting it would promise what
        // is not done.
        AMQPClass::Basic(basic::AMQPMethod::Recover(basic::Recover { requeue: false }))
        | AMQPClass::Basic(basic::AMQPMethod::RecoverAsync(basic::RecoverAsync {
            requeue: false,
        })) => {
            return Err(ConnectionError::new(reply_code::NOT_IMPLEMENTED, "requeue=false").on(id));
        }
        AMQPClass::Basic(basic::AMQPMethod::Qos(m)) => request(
            Answer::Qos,
            false,
            Command::Qos(pb::Qos {
                request_id,
                channel: ch,
                prefetch_count: u32::from(m.prefetch_count),
                global: m.global,
            }),
        ),
        AMQPClass::Basic(basic::AMQPMethod::Consume(m)) => request(
            Answer::Consume,
            m.nowait,
            Command::Consume(pb::Consume {
                request_id,
                channel: ch,
                queue: m.queue.to_string(),
                consumer_tag: m.consumer_tag.to_string(),
                no_ack: m.no_ack,
                exclusive: m.exclusive,
                arguments: encode_table(&m.arguments),
                credit_limited: false,
            }),
        ),
        AMQPClass::Basic(basic::AMQPMethod::Cancel(m)) => {
            let consumer_tag = m.consumer_tag.to_string();
            request(
                Answer::Cancel(consumer_tag.clone()),
                m.nowait,
                Command::Cancel(pb::Cancel {
                    request_id,
                    channel: ch,
                    consumer_tag,
                }),
            )
        }
        AMQPClass::Basic(basic::AMQPMethod::Publish(m)) => Translation::Publish(m),
        AMQPClass::Basic(basic::AMQPMethod::Get(m)) => request(
            Answer::Get,
            false,
            Command::Get(pb::Get {
                request_id,
                channel: ch,
                queue: m.queue.to_string(),
                no_ack: m.no_ack,
            }),
        ),
        AMQPClass::Basic(basic::AMQPMethod::Ack(m)) => Translation::Notify(Command::Ack(pb::Ack {
            channel: ch,
            delivery_tag: m.delivery_tag,
            multiple: m.multiple,
        })),
        AMQPClass::Basic(basic::AMQPMethod::Nack(m)) => {
            Translation::Notify(Command::Nack(pb::Nack {
                channel: ch,
                delivery_tag: m.delivery_tag,
                multiple: m.multiple,
                requeue: m.requeue,
            }))
        }
        AMQPClass::Basic(basic::AMQPMethod::Reject(m)) => {
            Translation::Notify(Command::Nack(pb::Nack {
                channel: ch,
                delivery_tag: m.delivery_tag,
                multiple: false,
                requeue: m.requeue,
            }))
        }
        AMQPClass::Basic(basic::AMQPMethod::Recover(m)) => request(
            Answer::Recover,
            false,
            Command::Recover(pb::Recover {
                request_id,
                channel: ch,
                requeue: m.requeue,
            }),
        ),
        // recover-async has no answer.
        AMQPClass::Basic(basic::AMQPMethod::RecoverAsync(m)) => request(
            Answer::Recover,
            true,
            Command::Recover(pb::Recover {
                request_id,
                channel: ch,
                requeue: m.requeue,
            }),
        ),
        AMQPClass::Confirm(confirm::AMQPMethod::Select(m)) => request(
            Answer::ConfirmSelect,
            m.nowait,
            Command::ConfirmSelect(pb::ConfirmSelect {
                request_id,
                channel: ch,
            }),
        ),
        // Transactions: the engine holds the channel's work until commit
        // (docs/transactions.md).
        AMQPClass::Tx(tx::AMQPMethod::Select(_)) => request(
            Answer::TxSelect,
            false,
            Command::TxSelect(pb::TxMethod {
                request_id,
                channel: ch,
            }),
        ),
        AMQPClass::Tx(tx::AMQPMethod::Commit(_)) => request(
            Answer::TxCommit,
            false,
            Command::TxCommit(pb::TxMethod {
                request_id,
                channel: ch,
            }),
        ),
        AMQPClass::Tx(tx::AMQPMethod::Rollback(_)) => request(
            Answer::TxRollback,
            false,
            Command::TxRollback(pb::TxMethod {
                request_id,
                channel: ch,
            }),
        ),
        _ => {
            return Err(ConnectionError::new(
                reply_code::COMMAND_INVALID,
                "method not valid from a client",
            )
            .on(id));
        }
    };
    Ok(translation)
}
