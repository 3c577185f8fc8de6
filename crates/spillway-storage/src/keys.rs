//! Key layout. Every key is a one-byte kind followed by length-prefixed
//! components, so names may hold any byte and prefixes never collide:
//!
//! | kind | components | value |
//! |---|---|---|
//! | `x` | vhost, exchange | `ExchangeDefinition` |
//! | `q` | vhost, queue | `QueueDefinition` |
//! | `b` | vhost, source exchange, destination, routing key, arguments, destination kind | `BindingDefinition` |
//! | `m` | vhost, queue, then the message id as 8 big-endian bytes | `StoredMessage` |
//!
//! Message ids increase, so a queue's messages iterate oldest first.

pub const EXCHANGE: u8 = b'x';
pub const QUEUE: u8 = b'q';
pub const BINDING: u8 = b'b';
pub const MESSAGE: u8 = b'm';

pub fn key(kind: u8, components: &[&[u8]]) -> Vec<u8> {
    let len = 1 + components.iter().map(|c| 4 + c.len()).sum::<usize>();
    let mut key = Vec::with_capacity(len + 8);
    key.push(kind);
    for component in components {
        // Names are AMQP short strings (< 256 bytes) and argument tables are
        // bounded by the frame size, so u32 never truncates.
        key.extend_from_slice(&(component.len() as u32).to_be_bytes());
        key.extend_from_slice(component);
    }
    key
}

pub fn message_key(vhost: &str, queue: &str, id: u64) -> Vec<u8> {
    let mut key = queue_messages_prefix(vhost, queue);
    key.extend_from_slice(&id.to_be_bytes());
    key
}

pub fn queue_messages_prefix(vhost: &str, queue: &str) -> Vec<u8> {
    key(MESSAGE, &[vhost.as_bytes(), queue.as_bytes()])
}

/// The first key after every key that starts with `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return end;
        }
    }
    vec![u8::MAX; prefix.len() + 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_keys_sort_by_id_within_a_queue() {
        let a = message_key("/", "q", 2);
        let b = message_key("/", "q", 256);
        assert!(a < b);
        let prefix = queue_messages_prefix("/", "q");
        assert!(a.starts_with(&prefix) && b < prefix_end(&prefix));
    }

    #[test]
    fn a_queue_prefix_does_not_cover_a_longer_queue_name() {
        let short = queue_messages_prefix("/", "q");
        let long = message_key("/", "q2", 1);
        assert!(!long.starts_with(&short));
    }
}
