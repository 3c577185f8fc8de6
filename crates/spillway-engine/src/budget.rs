//! The memory budget for message bytes: what is resident, what is on its way
//! to the storage node, and the flow-to-disk threshold they are held under.
//!
//! Accounting is exact by construction: a resident [`Message`] adds its
//! [`Message::accounted_size`] when it is made and takes it away when its last
//! reference drops, whichever path drops it. Payloads handed to the storage
//! node stay counted as in flight until the write has landed.
//!
//! [`Message`]: crate::model::Message
//! [`Message::accounted_size`]: crate::model::Message::accounted_size

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::Notify;

/// Counted for every resident message on top of its payload, properties,
/// exchange and routing key: the `Message` itself, its reference counts and
/// the allocator's headers of its buffers. Measured with `size_of` and
/// rounded up; documented in docs/flow-to-disk.md.
pub const MESSAGE_OVERHEAD_BYTES: u64 = 192;

/// Counted for every unacknowledged delivery: its record in the channel
/// (the queue entry, the queue's name and the consumer tag, the delivery
/// time) and its share of the channel's ordered map. Measured with
/// `size_of` and rounded up; documented in docs/flow-to-disk.md.
pub const UNACKED_ENTRY_BYTES: u64 = 192;

/// Shared by the broker, every resident message and the store writer.
#[derive(Debug)]
pub struct MemoryBudget {
    resident: AtomicU64,
    in_flight: AtomicU64,
    /// The broker's bookkeeping of messages whatever their payload: queue
    /// entries (resident or on disk) and unacknowledged deliveries. Set by
    /// each housekeeping cycle.
    bookkeeping: AtomicU64,
    threshold: AtomicU64,
    /// Fires when in-flight bytes fall (a spill batch landed), for publishers
    /// waiting on [`MemoryBudget::spill_backlog_full`].
    pub(crate) drained: Notify,
}

impl MemoryBudget {
    pub fn new(threshold: u64) -> Self {
        Self {
            resident: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            bookkeeping: AtomicU64::new(0),
            threshold: AtomicU64::new(threshold),
            drained: Notify::new(),
        }
    }

    /// Bytes of messages whose payload is in the engine's memory, plus those
    /// on their way to the storage node.
    pub fn resident_bytes(&self) -> u64 {
        self.resident.load(Ordering::Relaxed) + self.in_flight.load(Ordering::Relaxed)
    }

    /// Payload bytes handed to the storage node and not yet written.
    pub fn in_flight_bytes(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn threshold(&self) -> u64 {
        self.threshold.load(Ordering::Relaxed)
    }

    pub(crate) fn set_threshold(&self, bytes: u64) {
        self.threshold.store(bytes, Ordering::Relaxed);
    }

    /// Bytes of queue entries and unacknowledged deliveries, as the last
    /// housekeeping cycle counted them.
    pub fn bookkeeping_bytes(&self) -> u64 {
        self.bookkeeping.load(Ordering::Relaxed)
    }

    pub(crate) fn set_bookkeeping(&self, bytes: u64) {
        self.bookkeeping.store(bytes, Ordering::Relaxed);
    }

    /// Everything the threshold bounds: resident message bytes and the
    /// bookkeeping of every message, resident or not.
    pub fn used_bytes(&self) -> u64 {
        self.resident_bytes() + self.bookkeeping_bytes()
    }

    pub fn over_threshold(&self) -> bool {
        self.used_bytes() > self.threshold()
    }

    /// Publishers wait while this holds: the storage node is behind on
    /// payloads already handed to it, and taking more would grow memory.
    pub fn spill_backlog_full(&self) -> bool {
        self.in_flight_bytes() > self.spill_window()
    }

    /// Payload bytes that may be on their way to the storage node at once:
    /// an eighth of the threshold, between 1 MiB and 64 MiB.
    pub fn spill_window(&self) -> u64 {
        (self.threshold() / 8).clamp(1 << 20, 64 << 20)
    }

    /// The part of the threshold kept free of queued payloads for those on
    /// their way to the store: the spill window, but never more than an
    /// eighth of the threshold (a tiny threshold's window is larger than
    /// that). Queues share what is left, so resident payloads and those in
    /// flight together stay under the threshold while a fast fill spills.
    pub fn spill_reserve(&self) -> u64 {
        self.spill_window().min(self.threshold() / 8)
    }

    pub(crate) fn add_resident(&self, bytes: u64) {
        self.resident.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn remove_resident(&self, bytes: u64) {
        let previous = self.resident.fetch_sub(bytes, Ordering::Relaxed);
        debug_assert!(previous >= bytes, "resident bytes went negative");
    }

    pub(crate) fn add_in_flight(&self, bytes: u64) {
        self.in_flight.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn remove_in_flight(&self, bytes: u64) {
        let previous = self.in_flight.fetch_sub(bytes, Ordering::Relaxed);
        debug_assert!(previous >= bytes, "in-flight bytes went negative");
        self.drained.notify_waiters();
    }
}

/// The capacity to give a collection of `len` entries in `capacity` slots
/// back to: twice what it holds, once it holds less than a quarter of its
/// room and its room is above `floor`. A drained backlog would otherwise
/// keep its allocation for good. `None` when shrinking is not worth it.
pub(crate) fn shrunk_capacity(len: usize, capacity: usize, floor: usize) -> Option<usize> {
    (capacity > floor && capacity > len.saturating_mul(4)).then(|| len * 2)
}

/// The default flow-to-disk threshold: 40% of the memory this process may
/// use — its cgroup's limit when one is set (a container), else the
/// machine's physical memory. 1 GiB when neither can be read.
pub fn default_threshold() -> u64 {
    available_memory().map_or(1 << 30, |bytes| bytes / 5 * 2)
}

/// The cgroup (v2, then v1) memory limit, else physical memory.
///
/// Read by hand from /sys and /proc: three small files do not justify a
/// system-information crate.
pub fn available_memory() -> Option<u64> {
    let cgroup_limit = cgroup_v2_limit().or_else(cgroup_v1_limit);
    let physical = physical_memory();
    match (cgroup_limit, physical) {
        (Some(limit), Some(physical)) => Some(limit.min(physical)),
        (limit, physical) => limit.or(physical),
    }
}

fn cgroup_v2_limit() -> Option<u64> {
    // The process's own cgroup: "0::/some/path".
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = membership
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .unwrap_or("/");
    let file = format!("/sys/fs/cgroup{}/memory.max", path.trim_end_matches('/'));
    let limit = std::fs::read_to_string(file)
        .or_else(|_| std::fs::read_to_string("/sys/fs/cgroup/memory.max"))
        .ok()?;
    limit.trim().parse().ok()
}

fn cgroup_v1_limit() -> Option<u64> {
    let limit = std::fs::read_to_string("/sys/fs/cgroup/memory/memory.limit_in_bytes").ok()?;
    let bytes: u64 = limit.trim().parse().ok()?;
    // "No limit" reads as a huge number rounded to the page size.
    (bytes < 1 << 60).then_some(bytes)
}

fn physical_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_threshold_is_below_what_the_machine_has() {
        let available = available_memory().expect("/proc/meminfo is readable on Linux");
        let threshold = default_threshold();
        assert!(threshold > 0 && threshold < available);
        assert_eq!(threshold, available / 5 * 2);
    }

    #[test]
    fn the_spill_window_scales_with_the_threshold_within_bounds() {
        assert_eq!(MemoryBudget::new(1 << 20).spill_window(), 1 << 20);
        assert_eq!(MemoryBudget::new(256 << 20).spill_window(), 32 << 20);
        assert_eq!(MemoryBudget::new(16 << 30).spill_window(), 64 << 20);
    }

    #[test]
    fn the_spill_reserve_is_the_window_but_at_most_an_eighth_of_the_threshold() {
        assert_eq!(MemoryBudget::new(1 << 20).spill_reserve(), 128 << 10);
        assert_eq!(MemoryBudget::new(256 << 20).spill_reserve(), 32 << 20);
        assert_eq!(MemoryBudget::new(16 << 30).spill_reserve(), 64 << 20);
    }
}
