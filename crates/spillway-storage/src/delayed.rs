//! Delayed messages (`x-delayed-message` exchanges), kept in due order
//! under the `d` keys: one scan serves the engine's timer (the messages
//! due by a time, bounded, and when the next is due) and its start-up
//! count of what waits per exchange. Shared by the RocksDB and the
//! in-memory store.

use std::collections::BTreeMap;

use prost::Message as _;
use spillway_proto::storage::{DelayedBatch, DelayedCount, DelayedMessage, ScanDelayedRequest};

use crate::keys;

/// The most messages one scan returns, whatever is asked.
pub const MAX_SCAN_MESSAGES: u32 = 10_000;

/// What a scan found: the answer, and the keys whose value did not decode.
pub struct Scanned {
    pub batch: DelayedBatch,
    pub corrupt: Vec<(Vec<u8>, prost::DecodeError, usize)>,
}

/// Scans `entries`, the `d` keys from `keys::delayed_key(request.from_due_ms, request.from_id)`
/// on, in key order, with their values.
pub fn scan<K: AsRef<[u8]>, V: AsRef<[u8]>, E>(
    entries: impl Iterator<Item = Result<(K, V), E>>,
    request: &ScanDelayedRequest,
) -> Result<Scanned, E> {
    let mut batch = DelayedBatch::default();
    let mut corrupt = Vec::new();
    let mut counts: BTreeMap<(String, String), u64> = BTreeMap::new();
    let max_messages = request.max_messages.min(MAX_SCAN_MESSAGES) as usize;
    let mut bytes = 0u64;
    for entry in entries {
        let (key, value) = entry?;
        let (key, value) = (key.as_ref(), value.as_ref());
        let Some((due, id)) = keys::delayed_due_id(key) else {
            break;
        };
        if request.count_below_id > 0 {
            if batch.next_due_ms == 0 {
                batch.next_due_ms = due;
                batch.next_id = id;
            }
            if id >= request.count_below_id {
                continue;
            }
            match DelayedMessage::decode(value) {
                Ok(message) => *counts.entry((message.vhost, message.exchange)).or_default() += 1,
                Err(error) => corrupt.push((key.to_vec(), error, value.len())),
            }
            continue;
        }
        let full = batch.messages.len() >= max_messages
            || (!batch.messages.is_empty() && bytes >= request.max_bytes);
        if due > request.due_until_ms || full {
            batch.next_due_ms = due;
            batch.next_id = id;
            break;
        }
        match DelayedMessage::decode(value) {
            Ok(message) => {
                bytes += message.body.len() as u64;
                batch.messages.push(message);
            }
            Err(error) => corrupt.push((key.to_vec(), error, value.len())),
        }
    }
    batch.counts = counts
        .into_iter()
        .map(|((vhost, exchange), count)| DelayedCount {
            vhost,
            exchange,
            count,
        })
        .collect();
    Ok(Scanned { batch, corrupt })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(due: u64, id: u64, exchange: &str) -> Result<(Vec<u8>, Vec<u8>), ()> {
        let message = DelayedMessage {
            vhost: "/".into(),
            exchange: exchange.into(),
            body: vec![0; 10].into(),
            due_ms: due,
            id,
            ..Default::default()
        };
        Ok((keys::delayed_key(due, id).to_vec(), message.encode_to_vec()))
    }

    #[test]
    fn due_messages_come_in_order_and_the_next_due_is_told() -> Result<(), ()> {
        let entries = || vec![entry(10, 5, "a"), entry(20, 1, "b"), entry(30, 2, "a")];
        let request = ScanDelayedRequest {
            due_until_ms: 20,
            max_messages: 100,
            max_bytes: 1 << 20,
            ..Default::default()
        };
        let scanned = scan(entries().into_iter(), &request)?;
        let ids: Vec<u64> = scanned.batch.messages.iter().map(|m| m.id).collect();
        assert_eq!(ids, [5, 1]);
        assert_eq!(scanned.batch.next_due_ms, 30);
        let one = ScanDelayedRequest {
            max_messages: 1,
            ..request
        };
        let scanned = scan(entries().into_iter(), &one)?;
        assert_eq!(scanned.batch.messages.len(), 1);
        assert_eq!((scanned.batch.next_due_ms, scanned.batch.next_id), (20, 1));
        let counting = ScanDelayedRequest {
            count_below_id: 5,
            ..Default::default()
        };
        let scanned = scan(entries().into_iter(), &counting)?;
        assert!(scanned.batch.messages.is_empty());
        assert_eq!(scanned.batch.next_due_ms, 10);
        let counts: Vec<(String, u64)> = scanned
            .batch
            .counts
            .iter()
            .map(|c| (c.exchange.clone(), c.count))
            .collect();
        assert_eq!(counts, [("a".to_string(), 1), ("b".to_string(), 1)]);
        Ok(())
    }
}
