//! Write operations the store tests build, shared by the RocksDB and the
//! in-memory store's tests so both are held to the same inputs.

use spillway_proto::storage::{
    write_op, Durability, MessageRecord, QueueEntry, WriteBatch, WriteOp,
};

pub(crate) fn op(op: write_op::Op) -> WriteOp {
    WriteOp { op: Some(op) }
}

/// A persistent message record whose 3-byte body repeats its id.
pub(crate) fn put_message(id: u64) -> WriteOp {
    op(write_op::Op::PutMessage(MessageRecord {
        id,
        body: vec![id as u8; 3].into(),
        persistent: true,
        ..Default::default()
    }))
}

/// Queue `queue` in vhost `/` holds message `id`.
pub(crate) fn put_entry(queue: &str, id: u64) -> WriteOp {
    op(write_op::Op::PutQueueEntry(QueueEntry {
        vhost: "/".into(),
        queue: queue.into(),
        id,
        body_size: 3,
        redelivered: false,
        delivery_count: 0,
        expires_at_ms: 0,
        priority: 0,
    }))
}

pub(crate) fn synced(ops: Vec<WriteOp>) -> WriteBatch {
    WriteBatch {
        ops,
        durability: Durability::Synced.into(),
        ..Default::default()
    }
}
