//! `engine.consumer_timeout` (RabbitMQ's `consumer_timeout`): a delivery left
//! unacknowledged longer than the timeout closes its channel with 406
//! PRECONDITION_FAILED, which returns the channel's unacked messages to their
//! queues (redelivered), so a stuck consumer cannot hold them for ever.
//!
//! Checked by the housekeeping task. Delivery tags grow with time on a
//! channel, so only each channel's oldest unacked delivery is looked at.

use std::time::Instant;

use spillway_amqp::reply_code;
use spillway_proto::engine::{self as pb, session_event::Event, AmqpError};

use super::Broker;

impl Broker {
    /// Tells every channel whose oldest unacked delivery is older than the
    /// consumer timeout to close; each channel is told once.
    pub fn expire_unacked(&mut self, now: Instant) {
        let Some(timeout) = self.consumer_timeout else {
            return;
        };
        let mut expired = Vec::new();
        for (session_id, session) in &mut self.sessions {
            for (channel_id, channel) in &mut session.channels {
                if channel.ack_timed_out {
                    continue;
                }
                let Some((_, oldest)) = channel.unacked.first_key_value() else {
                    continue;
                };
                if now.saturating_duration_since(oldest.delivered_at) < timeout {
                    continue;
                }
                channel.ack_timed_out = true;
                expired.push((*session_id, *channel_id, session.user.clone()));
            }
        }
        let millis = timeout.as_millis();
        for (session, channel, user) in expired {
            tracing::warn!(
                session,
                channel,
                %user,
                timeout_ms = millis as u64,
                "consumer timeout: closing the channel, its unacked deliveries go back to their queues"
            );
            let text = format!(
                "delivery acknowledgement on channel {channel} timed out. Timeout value used: {millis} ms"
            );
            self.send(
                session,
                Event::ChannelError(pb::ChannelError {
                    channel,
                    error: Some(AmqpError::new(reply_code::PRECONDITION_FAILED, text)),
                }),
            );
        }
    }
}
