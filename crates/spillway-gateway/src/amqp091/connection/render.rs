//! Engine event → frames: deliveries, publisher confirms, returned messages,
//! consumer cancellations, and the answers to requests (declare-ok, get-ok,
//! …) as the [`Answer`] recorded when the request was sent says. Events for a
//! channel that is closing are dropped here; errors go back to the
//! connection, which closes the channel or itself.

use amq_protocol::protocol::{
    basic, channel as chan, confirm, connection as conn, exchange, queue, tx, AMQPClass,
};
use bytes::Bytes;
use spillway_amqp::{reply_code, MethodId};
use spillway_proto::body::Body;
use spillway_proto::engine::{self as pb, reply, session_event::Event};
use spillway_proto::engine::{SessionCommand, SessionEvent};

use super::{short, Answer, Connection, ConnectionError};
use spillway_amqp::codec::{BasicDeliver, FrameWriter};

impl Connection {
    /// Handles one engine event. `Err` closes the connection.
    pub fn on_event(
        &mut self,
        event: SessionEvent,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        let Some(event) = event.event else {
            return Ok(());
        };
        match event {
            Event::Reply(reply) => self.on_reply(reply, out, commands),
            Event::FlowControl(flow) => {
                self.on_flow_control(flow, out);
                Ok(())
            }
            // Batches exist only on the gRPC stream between a remote engine
            // and the gateway; `RemoteEngine` unpacks them before they get
            // here, and the in-process engine never makes one.
            Event::Batch(_) => {
                debug_assert!(false, "an event batch reached the connection");
                tracing::error!(peer = %self.peer, "an event batch reached the connection");
                Err(ConnectionError::new(
                    reply_code::CONNECTION_FORCED,
                    "internal error",
                ))
            }
            Event::Deliver(deliver) => {
                let span = tracing::trace_span!(target: spillway_proto::util::trace::TARGET, "deliver",
                    consumer_tag = %deliver.consumer_tag);
                spillway_proto::util::trace::set_parent(&span, &deliver.trace_context);
                let _entered = span.enter();
                let channel_id = deliver.channel as u16;
                // Counted as written even when dropped: the engine's
                // delivery credit frees deliveries in the order it handed
                // them over, so one never reported would hold its place
                // for the rest of the connection.
                self.deliveries += 1;
                if !self.is_live(channel_id) {
                    // The engine requeues it when it releases the channel.
                    return Ok(());
                }
                // Decoded before anything is written: a body that does not
                // decode leaves no half message behind.
                let body = self.published_body(deliver.body())?;
                out.basic_deliver(
                    channel_id,
                    &BasicDeliver {
                        consumer_tag: &deliver.consumer_tag,
                        delivery_tag: deliver.delivery_tag,
                        redelivered: deliver.redelivered,
                        exchange: &deliver.exchange,
                        routing_key: &deliver.routing_key,
                    },
                );
                out.content_shared(
                    channel_id,
                    &deliver.properties,
                    &body,
                    self.negotiated.frame_max as usize,
                );
                Ok(())
            }
            Event::Confirm(confirm) => {
                let channel_id = confirm.channel as u16;
                if !self.is_live(channel_id) {
                    return Ok(());
                }
                if confirm.ack {
                    out.basic_ack(channel_id, confirm.seq, false);
                } else {
                    out.method(
                        channel_id,
                        AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                            delivery_tag: confirm.seq,
                            multiple: false,
                            requeue: false,
                        })),
                    );
                }
                Ok(())
            }
            Event::Returned(returned) => {
                let channel_id = returned.channel as u16;
                if !self.is_live(channel_id) {
                    return Ok(());
                }
                let body = self.published_body(returned.body())?;
                out.method(
                    channel_id,
                    AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                        reply_code: returned.reply_code as u16,
                        reply_text: short(&returned.reply_text),
                        exchange: short(&returned.exchange),
                        routing_key: short(&returned.routing_key),
                    })),
                );
                out.content_shared(
                    channel_id,
                    &returned.properties,
                    &body,
                    self.negotiated.frame_max as usize,
                );
                Ok(())
            }
            Event::ConsumerCancelled(cancelled) => {
                let channel_id = cancelled.channel as u16;
                if self.is_live(channel_id) && self.negotiated.capabilities.consumer_cancel_notify {
                    out.method(
                        channel_id,
                        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                            consumer_tag: short(&cancelled.consumer_tag),
                            nowait: true,
                        })),
                    );
                }
                Ok(())
            }
            Event::ChannelError(channel_error) => {
                let channel_id = channel_error.channel as u16;
                if !self.is_live(channel_id) {
                    return Ok(());
                }
                let error = channel_error.error.unwrap_or_default();
                let method = MethodId::new(
                    u16::try_from(error.class_id).unwrap_or_default(),
                    u16::try_from(error.method_id).unwrap_or_default(),
                );
                self.raise(channel_id, error, method, out, commands)
            }
            // The broker closes the connection (management, vhost deleted,
            // a transaction timed out or published an unroutable mandatory
            // message).
            Event::ConnectionClose(close) => {
                let code = u16::try_from(close.reply_code)
                    .ok()
                    .filter(|code| *code != 0)
                    .unwrap_or(reply_code::CONNECTION_FORCED);
                Err(ConnectionError::new(code, close.reason))
            }
        }
    }

    /// A body as its client published it: a body the gateway compressed at
    /// publish is decoded, within `max_message_size`. One that does not
    /// decode (a corrupt record) closes the connection with 541 rather than
    /// reach the client altered; its message goes back to its queue.
    fn published_body(&self, body: Body) -> Result<Bytes, ConnectionError> {
        body.decode(self.config.settings.max_message_size)
            .map_err(|error| {
                tracing::error!(peer = %self.peer, %error, "a message body does not decode");
                ConnectionError::new(
                    reply_code::INTERNAL_ERROR,
                    format!("message body does not decode: {error}"),
                )
            })
    }

    /// The engine answered a request: reply to the client as recorded when
    /// the request was sent.
    fn on_reply(
        &mut self,
        reply: pb::Reply,
        out: &mut FrameWriter,
        commands: &mut Vec<SessionCommand>,
    ) -> Result<(), ConnectionError> {
        if matches!(reply.result, Some(reply::Result::GetOk(_))) {
            // A get-ok is charged to the engine's delivery credit like a
            // delivery, written or dropped.
            self.deliveries += 1;
        }
        let Some(pending) = self.pending.remove(&reply.request_id) else {
            tracing::warn!(request = reply.request_id, "reply to an unknown request");
            return Ok(());
        };
        let channel_id = pending.channel;
        if matches!(
            pending.answer,
            Answer::ChannelReleased | Answer::ChannelCloseByClient
        ) {
            self.released(channel_id);
        }
        let result = reply.result.unwrap_or(reply::Result::Ok(pb::Empty {}));
        if let reply::Result::Error(error) = result {
            if let Answer::Session = pending.answer {
                return Err(ConnectionError::new(error.reply_code(), error.text).on(pending.method));
            }
            if !self.is_live(channel_id) {
                return Ok(());
            }
            return self.raise(channel_id, error, pending.method, out, commands);
        }
        let answer = match pending.answer {
            Answer::Session => {
                out.method(
                    0,
                    AMQPClass::Connection(conn::AMQPMethod::OpenOk(conn::OpenOk {})),
                );
                return Ok(());
            }
            Answer::ChannelReleased => return Ok(()),
            Answer::ChannelCloseByClient => {
                self.channels.remove(&channel_id);
                out.method(
                    channel_id,
                    AMQPClass::Channel(chan::AMQPMethod::CloseOk(chan::CloseOk {})),
                );
                return Ok(());
            }
            _ if !self.is_live(channel_id) => return Ok(()),
            _ if pending.nowait => return Ok(()),
            answer => answer,
        };
        let method = match (answer, result) {
            (Answer::ChannelOpen, _) => {
                AMQPClass::Channel(chan::AMQPMethod::OpenOk(chan::OpenOk {}))
            }
            (Answer::ExchangeDeclare, _) => {
                AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {}))
            }
            (Answer::ExchangeDelete, _) => {
                AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {}))
            }
            (Answer::ExchangeBind, _) => {
                AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {}))
            }
            (Answer::ExchangeUnbind, _) => {
                AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {}))
            }
            (Answer::QueueDeclare, reply::Result::QueueDeclareOk(ok)) => {
                AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                    queue: short(&ok.queue),
                    message_count: ok.message_count,
                    consumer_count: ok.consumer_count,
                }))
            }
            (Answer::QueueBind, _) => AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
            (Answer::QueueUnbind, _) => {
                AMQPClass::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {}))
            }
            (Answer::QueuePurge, reply::Result::CountOk(ok)) => {
                AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk {
                    message_count: ok.message_count,
                }))
            }
            (Answer::QueueDelete, reply::Result::CountOk(ok)) => {
                AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                    message_count: ok.message_count,
                }))
            }
            (Answer::Consume, reply::Result::ConsumeOk(ok)) => {
                AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                    consumer_tag: short(&ok.consumer_tag),
                }))
            }
            (Answer::Cancel(tag), _) => {
                AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                    consumer_tag: short(&tag),
                }))
            }
            (Answer::Recover, _) => {
                AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {}))
            }
            (Answer::Qos, _) => AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
            (Answer::Get, reply::Result::GetOk(ok)) => {
                let body = self.published_body(ok.body())?;
                out.method(
                    channel_id,
                    AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
                        delivery_tag: ok.delivery_tag,
                        redelivered: ok.redelivered,
                        exchange: short(&ok.exchange),
                        routing_key: short(&ok.routing_key),
                        message_count: ok.message_count,
                    })),
                );
                out.content_shared(
                    channel_id,
                    &ok.properties,
                    &body,
                    self.negotiated.frame_max as usize,
                );
                return Ok(());
            }
            (Answer::Get, _) => AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
            (Answer::ConfirmSelect, _) => {
                AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {}))
            }
            (Answer::TxSelect, _) => AMQPClass::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})),
            (Answer::TxCommit, _) => AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})),
            (Answer::TxRollback, _) => AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})),
            (_, other) => {
                tracing::error!(?other, "engine answered with an unexpected reply");
                return Err(ConnectionError::new(
                    reply_code::CONNECTION_FORCED,
                    "internal error",
                ));
            }
        };
        out.method(channel_id, method);
        Ok(())
    }
}
