//! Key layout. Every key is a one-byte kind followed by length-prefixed
//! components, so names may hold any byte and prefixes never collide:
//!
//! | kind | components | value |
//! |---|---|---|
//! | `v` | vhost | `VhostDefinition` |
//! | `u` | user | `UserDefinition` |
//! | `a` | user, vhost | `PermissionDefinition` (access) |
//! | `o` | vhost, `p` (policy) or `o` (operator policy), name | `PolicyDefinition` |
//! | `d` | due time (ms) and message id, 8 big-endian bytes each | `DelayedMessage` |
//! | `x` | vhost, exchange | `ExchangeDefinition` |
//! | `q` | vhost, queue | `QueueDefinition` |
//! | `b` | vhost, source exchange, destination, routing key, arguments, destination kind | `BindingDefinition` |
//! | `m` | vhost, queue, then the message id as 8 big-endian bytes | `QueueEntry` |
//! | `p` | the message id as 8 big-endian bytes | `MessageRecord` |
//! | `!format` | (none) | the layout version, [`FORMAT_VERSION`] as 4 big-endian bytes |
//! | `!users` | (none) | empty: the store has held a user ([`USERS_MARKER`]) |
//!
//! Message ids increase, so a queue's entries iterate oldest first, and the
//! message records of a backlog that flowed to disk lie close together.

use spillway_proto::storage::BindingDefinition;

pub const VHOST: u8 = b'v';
pub const USER: u8 = b'u';
pub const PERMISSION: u8 = b'a';
pub const POLICY: u8 = b'o';
pub const DELAYED: u8 = b'd';
pub const EXCHANGE: u8 = b'x';
pub const QUEUE: u8 = b'q';
pub const BINDING: u8 = b'b';
pub const ENTRY: u8 = b'm';
pub const MESSAGE: u8 = b'p';
pub const FORMAT: &[u8] = b"!format";
/// Written with every user and kept when users go: a store that has held a
/// user is never seeded with the configuration's users again.
pub const USERS_MARKER: &[u8] = b"!users";
/// 2: messages stored once (`p`), durable queues' holds as entries (`m`).
/// 3: a message record may hold its body compressed (`body_encoding`,
/// `body_size`); a build that reads 2 would deliver such a body as it is
/// stored, so it must not open a store of layout 3.
pub const FORMAT_VERSION: u32 = 3;
/// Layouts this build opens and upgrades to [`FORMAT_VERSION`] in place:
/// a layout-2 record has no encoding fields and reads as stored as
/// published, so only the version key changes.
pub const UPGRADES_FROM: &[u32] = &[2];

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

/// The key a binding is filed under: every field is part of it.
pub fn binding_key(def: &BindingDefinition) -> Vec<u8> {
    key(
        BINDING,
        &[
            def.vhost.as_bytes(),
            def.exchange.as_bytes(),
            def.queue.as_bytes(),
            def.routing_key.as_bytes(),
            &def.arguments,
            &[u8::from(def.to_exchange)],
        ],
    )
}

pub fn entry_key(vhost: &str, queue: &str, id: u64) -> Vec<u8> {
    let mut key = queue_entries_prefix(vhost, queue);
    key.extend_from_slice(&id.to_be_bytes());
    key
}

pub fn queue_entries_prefix(vhost: &str, queue: &str) -> Vec<u8> {
    key(ENTRY, &[vhost.as_bytes(), queue.as_bytes()])
}

pub fn message_key(id: u64) -> [u8; 9] {
    let mut key = [MESSAGE; 9];
    key[1..].copy_from_slice(&id.to_be_bytes());
    key
}

/// The message id of a `p` key.
pub fn message_id(key: &[u8]) -> Option<u64> {
    let bytes: [u8; 8] = key.strip_prefix(&[MESSAGE])?.try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

/// The message id at the end of an `m` key.
pub fn entry_id(key: &[u8]) -> Option<u64> {
    let tail = key.len().checked_sub(8).map(|start| &key[start..])?;
    Some(u64::from_be_bytes(tail.try_into().ok()?))
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

pub fn user_key(name: &str) -> Vec<u8> {
    key(USER, &[name.as_bytes()])
}

/// A user's permissions sort together: deleting a user deletes the range.
pub fn permission_key(user: &str, vhost: &str) -> Vec<u8> {
    key(PERMISSION, &[user.as_bytes(), vhost.as_bytes()])
}

pub fn user_permissions_prefix(user: &str) -> Vec<u8> {
    key(PERMISSION, &[user.as_bytes()])
}

/// A policy or operator policy of a vhost.
pub fn policy_key(vhost: &str, operator: bool, name: &str) -> Vec<u8> {
    let kind: &[u8] = if operator { b"o" } else { b"p" };
    key(POLICY, &[vhost.as_bytes(), kind, name.as_bytes()])
}

/// A delayed message's key: they sort by due time, then id.
pub fn delayed_key(due_ms: u64, id: u64) -> [u8; 17] {
    let mut key = [DELAYED; 17];
    key[1..9].copy_from_slice(&due_ms.to_be_bytes());
    key[9..].copy_from_slice(&id.to_be_bytes());
    key
}

/// The due time and id of a `d` key.
pub fn delayed_due_id(key: &[u8]) -> Option<(u64, u64)> {
    let rest = key.strip_prefix(&[DELAYED])?;
    let due: [u8; 8] = rest.get(..8)?.try_into().ok()?;
    let id: [u8; 8] = rest.get(8..16)?.try_into().ok()?;
    Some((u64::from_be_bytes(due), u64::from_be_bytes(id)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_keys_sort_by_id_within_a_queue() {
        let a = entry_key("/", "q", 2);
        let b = entry_key("/", "q", 256);
        assert!(a < b);
        assert_eq!(entry_id(&b), Some(256));
        let prefix = queue_entries_prefix("/", "q");
        assert!(a.starts_with(&prefix) && b < prefix_end(&prefix));
    }

    #[test]
    fn a_users_permissions_do_not_cover_a_longer_user_name() {
        let prefix = user_permissions_prefix("app");
        assert!(permission_key("app", "/").starts_with(&prefix));
        assert!(permission_key("app", "/") < prefix_end(&prefix));
        let longer = permission_key("apple", "/");
        assert!(!longer.starts_with(&prefix));
        assert!(longer >= prefix_end(&prefix) || longer < prefix);
    }

    #[test]
    fn a_queue_prefix_does_not_cover_a_longer_queue_name() {
        let short = queue_entries_prefix("/", "q");
        let long = entry_key("/", "q2", 1);
        assert!(!long.starts_with(&short));
    }

    #[test]
    fn message_keys_round_trip_and_sort_by_id() {
        assert_eq!(message_id(&message_key(513)), Some(513));
        assert!(message_key(2) < message_key(256));
        assert_eq!(message_id(b"p123"), None);
    }
}
