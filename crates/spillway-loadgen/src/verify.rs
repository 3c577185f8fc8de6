//! Exactly-once / in-order bookkeeping and the latency histogram.
//!
//! Each consumer keeps its own [`Tally`] (no locking on the hot path):
//! - a [`SeenSet`] (one bitmap per producer) catches duplicates seen by that consumer;
//! - an [`OrderCheck`] (last sequence number per producer) catches reordering. A queue
//!   delivers in order, so every consumer sees an increasing *subsequence* of each
//!   producer's sequence numbers, also when several consumers compete on one queue.
//!
//! At the end the tallies are merged: a sequence number seen by two consumers is a
//! duplicate, and every expected sequence number nobody saw is lost.

use std::collections::{BTreeMap, HashMap};

use crate::message::{decode, Header};

/// A growable bitmap of sequence numbers.
#[derive(Debug, Default, Clone)]
pub struct BitSet {
    words: Vec<u64>,
    ones: u64,
}

impl BitSet {
    /// Sets `bit`; returns false when it was already set.
    pub fn insert(&mut self, bit: u64) -> bool {
        let word = (bit / 64) as usize;
        if word >= self.words.len() {
            let want = (word + 1).max(self.words.len() * 2);
            self.words.resize(want, 0);
        }
        let mask = 1u64 << (bit % 64);
        let w = &mut self.words[word];
        if *w & mask != 0 {
            return false;
        }
        *w |= mask;
        self.ones += 1;
        true
    }

    #[cfg(test)]
    pub fn contains(&self, bit: u64) -> bool {
        self.words
            .get((bit / 64) as usize)
            .is_some_and(|w| w & (1u64 << (bit % 64)) != 0)
    }

    pub fn len(&self) -> u64 {
        self.ones
    }

    /// Number of set bits strictly below `n`.
    pub fn count_below(&self, n: u64) -> u64 {
        let full = (n / 64) as usize;
        let mut c: u64 = self
            .words
            .iter()
            .take(full)
            .map(|w| u64::from(w.count_ones()))
            .sum();
        let rem = n % 64;
        if rem != 0 {
            if let Some(w) = self.words.get(full) {
                c += u64::from((w & ((1u64 << rem) - 1)).count_ones());
            }
        }
        c
    }

    /// Highest set bit, if any.
    pub fn max(&self) -> Option<u64> {
        self.words
            .iter()
            .enumerate()
            .rev()
            .find(|(_, w)| **w != 0)
            .map(|(i, w)| i as u64 * 64 + 63 - u64::from(w.leading_zeros()))
    }

    /// Number of bits set here and not in `other` (all of them when `other` is None).
    pub fn count_missing_from(&self, other: Option<&BitSet>) -> u64 {
        let Some(other) = other else {
            return self.ones;
        };
        self.words
            .iter()
            .enumerate()
            .map(|(i, w)| u64::from((w & !other.words.get(i).copied().unwrap_or(0)).count_ones()))
            .sum()
    }

    /// ORs `other` into self; returns how many bits were set in both.
    pub fn merge(&mut self, other: &BitSet) -> u64 {
        if other.words.len() > self.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        let mut both = 0u64;
        for (a, b) in self.words.iter_mut().zip(other.words.iter()) {
            both += u64::from((*a & *b).count_ones());
            *a |= *b;
        }
        self.ones = self.ones + other.ones - both;
        both
    }
}

/// Sequence numbers seen, per producer.
#[derive(Debug, Default, Clone)]
pub struct SeenSet {
    producers: HashMap<u32, BitSet>,
}

impl SeenSet {
    /// Returns false when (producer, seq) was already seen.
    pub fn insert(&mut self, producer: u32, seq: u64) -> bool {
        self.producers.entry(producer).or_default().insert(seq)
    }

    /// Merges another set in; returns the number of (producer, seq) present in both.
    pub fn merge(&mut self, other: &SeenSet) -> u64 {
        let mut both = 0;
        for (p, bits) in &other.producers {
            both += self.producers.entry(*p).or_default().merge(bits);
        }
        both
    }

    pub fn total(&self) -> u64 {
        self.producers.values().map(BitSet::len).sum()
    }

    pub fn get(&self, producer: u32) -> Option<&BitSet> {
        self.producers.get(&producer)
    }

    /// Highest sequence number seen + 1, per producer.
    pub fn inferred_expectation(&self) -> BTreeMap<u32, u64> {
        self.producers
            .iter()
            .filter_map(|(p, b)| b.max().map(|m| (*p, m + 1)))
            .collect()
    }
}

/// Last sequence number seen per producer, on one consumer.
#[derive(Debug, Default, Clone)]
pub struct OrderCheck {
    /// By producer and priority (always 0 without `--priorities`): a priority queue keeps
    /// each priority's messages in order, not the whole sequence.
    last: HashMap<(u32, u8), u64>,
}

impl OrderCheck {
    /// Returns false when `seq` comes after a higher sequence number of the same producer
    /// and priority.
    pub fn observe_at(&mut self, producer: u32, priority: u8, seq: u64) -> bool {
        let producer = (producer, priority);
        match self.last.get_mut(&producer) {
            None => {
                self.last.insert(producer, seq);
                true
            }
            Some(last) if seq > *last => {
                *last = seq;
                true
            }
            Some(_) => false,
        }
    }
}

/// Log-linear histogram of microsecond values: exact below 128 µs, then 64 sub-buckets per
/// power of two (under 1.6 % relative error). Fixed size, so long runs use no more memory.
#[derive(Debug, Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
}

// Index of u64::MAX is 57 * 64 + 127, so 59 * 64 buckets cover every u64.
const HIST_BUCKETS: usize = 59 * 64;

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: vec![0; HIST_BUCKETS],
            total: 0,
            max: 0,
        }
    }
}

impl Histogram {
    fn index(v: u64) -> usize {
        if v < 128 {
            return v as usize;
        }
        let exp = 63 - v.leading_zeros() as u64; // >= 7
        let shift = exp - 6;
        (shift * 64 + (v >> shift)) as usize
    }

    /// Lower bound and width of a bucket.
    fn bucket(idx: usize) -> (u64, u64) {
        if idx < 128 {
            return (idx as u64, 1);
        }
        let shift = (idx / 64 - 1) as u32;
        let mant = (idx % 64 + 64) as u64;
        (mant << shift, 1u64 << shift)
    }

    pub fn record(&mut self, micros: u64) {
        let i = Self::index(micros);
        self.counts[i] += 1;
        self.total += 1;
        self.max = self.max.max(micros);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += *b;
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    /// Value at quantile `q` (0..=1), in microseconds (bucket midpoint); None when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let (lo, width) = Self::bucket(i);
                let mid = lo as f64 + (width as f64 - 1.0) / 2.0;
                return Some(mid.min(self.max as f64));
            }
        }
        Some(self.max as f64)
    }
}

/// What one consumer saw.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    pub seen: SeenSet,
    pub order: OrderCheck,
    pub consumed: u64,
    pub bytes: u64,
    pub duplicated: u64,
    pub out_of_order: u64,
    pub corrupt: u64,
    pub redelivered: u64,
    pub latency_us: Histogram,
    /// `--priorities`: messages carry priorities 0..N (`message::priority_of`).
    pub priorities: u8,
    /// With priorities: deliveries of a higher priority than the one before them at this
    /// consumer. Draining a backlog that was complete before the drain began, a priority
    /// queue has none.
    pub priority_inversions: u64,
    last_priority: Option<u8>,
}

impl Tally {
    /// Records a delivery received at `now_ns` (Unix nanoseconds).
    pub fn record(
        &mut self,
        body: &[u8],
        expected_size: Option<usize>,
        redelivered: bool,
        now_ns: u64,
    ) {
        self.consumed += 1;
        self.bytes += body.len() as u64;
        if redelivered {
            self.redelivered += 1;
        }
        match decode(body, expected_size) {
            Ok(h) => self.record_header(h, now_ns),
            Err(_) => self.corrupt += 1,
        }
    }

    pub fn record_header(&mut self, h: Header, now_ns: u64) {
        let priority = crate::message::priority_of(h.seq, self.priorities);
        if !self.seen.insert(h.producer, h.seq) {
            self.duplicated += 1;
        } else if !self.order.observe_at(h.producer, priority, h.seq) {
            self.out_of_order += 1;
        }
        if self.priorities > 0 {
            if self.last_priority.is_some_and(|last| priority > last) {
                self.priority_inversions += 1;
            }
            self.last_priority = Some(priority);
        }
        self.latency_us
            .record(now_ns.saturating_sub(h.sent_ns) / 1_000);
    }
}

/// What the consumers should have received.
#[derive(Debug, Clone)]
pub enum Expected {
    /// Sequence numbers 0..n for each producer.
    Known(BTreeMap<u32, u64>),
    /// Unknown (draining a backlog of unknown size): 0..=max seen, per producer seen.
    Inferred,
}

#[derive(Debug, Default, Clone)]
pub struct Verdict {
    pub expected: u64,
    pub consumed: u64,
    pub bytes: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub out_of_order: u64,
    pub corrupt: u64,
    /// Valid messages outside the expectation (unknown producer or seq past the end).
    pub unexpected: u64,
    pub redelivered: u64,
    pub latency_us: Histogram,
    pub priority_inversions: u64,
}

impl Verdict {
    pub fn ok(&self) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.out_of_order == 0
            && self.corrupt == 0
            && self.unexpected == 0
    }
}

/// Every (producer, seq) any consumer saw.
pub fn merged_seen(tallies: &[Tally]) -> SeenSet {
    let mut seen = SeenSet::default();
    for t in tallies {
        seen.merge(&t.seen);
    }
    seen
}

/// Confirmed messages (sequence numbers per producer) that no consumer saw.
pub fn confirmed_lost(seen: &SeenSet, confirmed: &BTreeMap<u32, BitSet>) -> u64 {
    confirmed
        .iter()
        .map(|(p, bits)| bits.count_missing_from(seen.get(*p)))
        .sum()
}

/// Merges the consumers' tallies and compares them with the expectation.
pub fn judge(tallies: &[Tally], expected: &Expected) -> Verdict {
    let mut v = Verdict::default();
    let mut seen = SeenSet::default();
    for t in tallies {
        v.consumed += t.consumed;
        v.bytes += t.bytes;
        v.duplicated += t.duplicated + seen.merge(&t.seen);
        v.out_of_order += t.out_of_order;
        v.priority_inversions += t.priority_inversions;
        v.corrupt += t.corrupt;
        v.redelivered += t.redelivered;
        v.latency_us.merge(&t.latency_us);
    }
    let expectation = match expected {
        Expected::Known(m) => m.clone(),
        Expected::Inferred => seen.inferred_expectation(),
    };
    let mut matched = 0u64;
    for (p, n) in &expectation {
        v.expected += n;
        let got = seen.get(*p).map_or(0, |b| b.count_below(*n));
        matched += got;
        v.lost += n - got;
    }
    v.unexpected = seen.total() - matched;
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{encode_into, Header};

    fn h(producer: u32, seq: u64) -> Header {
        Header {
            producer,
            seq,
            sent_ns: 0,
        }
    }

    fn known(pairs: &[(u32, u64)]) -> Expected {
        Expected::Known(pairs.iter().copied().collect())
    }

    fn tally_of(msgs: &[(u32, u64)]) -> Tally {
        let mut t = Tally::default();
        for &(p, s) in msgs {
            t.consumed += 1;
            t.record_header(h(p, s), 0);
        }
        t
    }

    #[test]
    fn bitset_basics() {
        let mut b = BitSet::default();
        assert!(b.insert(0));
        assert!(b.insert(63));
        assert!(b.insert(64));
        assert!(b.insert(1000));
        assert!(!b.insert(64));
        assert_eq!(b.len(), 4);
        assert!(b.contains(1000) && !b.contains(999));
        assert_eq!(b.count_below(0), 0);
        assert_eq!(b.count_below(1), 1);
        assert_eq!(b.count_below(64), 2);
        assert_eq!(b.count_below(65), 3);
        assert_eq!(b.count_below(5000), 4);
        assert_eq!(b.max(), Some(1000));
        let mut other = BitSet::default();
        other.insert(64);
        other.insert(5000);
        assert_eq!(b.merge(&other), 1);
        assert_eq!(b.len(), 5);
        assert_eq!(b.max(), Some(5000));
    }

    #[test]
    fn confirmed_lost_counts_only_confirmed() {
        // Producer 0 confirmed 0..4, the consumers saw 0, 1 and 3 (and an unconfirmed 9).
        let mut confirmed = BitSet::default();
        for s in 0..4 {
            confirmed.insert(s);
        }
        let t = tally_of(&[(0, 0), (0, 1), (0, 3), (0, 9)]);
        let seen = merged_seen(&[t]);
        let mut map = BTreeMap::new();
        map.insert(0, confirmed.clone());
        assert_eq!(confirmed_lost(&seen, &map), 1);
        // A producer nobody heard from loses everything it had confirmed.
        map.insert(7, confirmed);
        assert_eq!(confirmed_lost(&seen, &map), 1 + 4);
    }

    #[test]
    fn all_in_order_once_is_ok() {
        let msgs: Vec<_> = (0..1000).flat_map(|s| [(0, s), (1, s)]).collect();
        let v = judge(&[tally_of(&msgs)], &known(&[(0, 1000), (1, 1000)]));
        assert!(v.ok(), "{v:?}");
        assert_eq!(v.expected, 2000);
        assert_eq!(v.consumed, 2000);
    }

    #[test]
    fn detects_loss() {
        let msgs: Vec<_> = (0..100).filter(|s| s % 10 != 3).map(|s| (0, s)).collect();
        let v = judge(&[tally_of(&msgs)], &known(&[(0, 100)]));
        assert_eq!(v.lost, 10);
        assert_eq!(v.duplicated, 0);
        assert_eq!(v.out_of_order, 0);
        assert!(!v.ok());
        // Tail loss and a producer that delivered nothing at all.
        let v = judge(&[tally_of(&[(0, 0), (0, 1)])], &known(&[(0, 5), (1, 3)]));
        assert_eq!(v.lost, 3 + 3);
    }

    #[test]
    fn detects_duplicates_on_one_consumer() {
        let v = judge(
            &[tally_of(&[(0, 0), (0, 1), (0, 1), (0, 2)])],
            &known(&[(0, 3)]),
        );
        assert_eq!(v.duplicated, 1);
        assert_eq!(
            v.out_of_order, 0,
            "a duplicate is not also counted as reordering"
        );
        assert_eq!(v.lost, 0);
    }

    #[test]
    fn detects_duplicates_across_consumers() {
        let a = tally_of(&[(0, 0), (0, 2), (0, 4)]);
        let b = tally_of(&[(0, 1), (0, 2), (0, 3)]);
        let v = judge(&[a, b], &known(&[(0, 5)]));
        assert_eq!(v.duplicated, 1);
        assert_eq!(v.lost, 0);
        assert_eq!(v.out_of_order, 0);
    }

    #[test]
    fn competing_consumers_interleaved_is_in_order() {
        // Round-robin split of one producer's stream over two consumers.
        let a: Vec<_> = (0..50).map(|s| (0, s * 2)).collect();
        let b: Vec<_> = (0..50).map(|s| (0, s * 2 + 1)).collect();
        let v = judge(&[tally_of(&a), tally_of(&b)], &known(&[(0, 100)]));
        assert!(v.ok(), "{v:?}");
    }

    #[test]
    fn detects_reordering_per_producer() {
        // Interleaving of producers is fine, going backwards within one is not.
        let t = tally_of(&[(0, 0), (1, 0), (0, 2), (1, 1), (0, 1), (0, 3), (1, 2)]);
        let v = judge(&[t], &known(&[(0, 4), (1, 3)]));
        assert_eq!(v.out_of_order, 1);
        assert_eq!(v.lost, 0);
        assert_eq!(v.duplicated, 0);
    }

    #[test]
    fn unexpected_messages_are_flagged() {
        let t = tally_of(&[(0, 0), (0, 1), (0, 7), (9, 0)]);
        let v = judge(&[t], &known(&[(0, 2)]));
        assert_eq!(v.unexpected, 2);
        assert_eq!(v.lost, 0);
        assert!(!v.ok());
    }

    #[test]
    fn inferred_expectation_finds_gaps() {
        let t = tally_of(&[(0, 0), (0, 1), (0, 4), (3, 2)]);
        let v = judge(&[t], &Expected::Inferred);
        assert_eq!(v.expected, 5 + 3);
        assert_eq!(v.lost, 2 + 2);
        assert_eq!(v.unexpected, 0);
    }

    #[test]
    fn corrupt_bodies_counted() {
        let mut t = Tally::default();
        let mut buf = Vec::new();
        encode_into(&mut buf, 64, h(0, 0));
        t.record(&buf, Some(64), false, 0);
        t.record(&buf[..40], Some(64), true, 0);
        let v = judge(&[t], &known(&[(0, 1)]));
        assert_eq!(v.consumed, 2);
        assert_eq!(v.corrupt, 1);
        assert_eq!(v.redelivered, 1);
        assert_eq!(v.lost, 0);
        assert!(!v.ok());
    }

    #[test]
    fn histogram_quantiles() {
        let mut hist = Histogram::default();
        assert_eq!(hist.quantile(0.5), None);
        for v in 1..=10_000u64 {
            hist.record(v);
        }
        let p50 = hist.quantile(0.5).unwrap_or(0.0);
        let p99 = hist.quantile(0.99).unwrap_or(0.0);
        assert!((p50 - 5_000.0).abs() / 5_000.0 < 0.02, "p50 {p50}");
        assert!((p99 - 9_900.0).abs() / 9_900.0 < 0.02, "p99 {p99}");
        assert_eq!(hist.quantile(1.0), Some(10_000.0));
        assert_eq!(hist.count(), 10_000);
        // Bucket boundaries are contiguous and increasing.
        let mut prev_end = 0;
        for i in 0..HIST_BUCKETS {
            let (lo, w) = Histogram::bucket(i);
            assert_eq!(lo, prev_end, "bucket {i}");
            assert_eq!(Histogram::index(lo), i);
            assert_eq!(Histogram::index(lo + (w - 1)), i);
            prev_end = lo.wrapping_add(w);
        }
        hist.record(u64::MAX);
        assert_eq!(hist.max(), u64::MAX);
    }

    #[test]
    fn priorities_are_checked_in_order_per_priority_and_across_them() {
        let priorities = 4;
        let mut in_priority_order: Vec<u64> = (0..100).collect();
        in_priority_order.sort_by_key(|&seq| {
            (
                std::cmp::Reverse(crate::message::priority_of(seq, priorities)),
                seq,
            )
        });
        let mut good = Tally {
            priorities,
            ..Tally::default()
        };
        for &seq in &in_priority_order {
            good.record_header(
                Header {
                    producer: 0,
                    seq,
                    sent_ns: 0,
                },
                0,
            );
        }
        assert_eq!((good.out_of_order, good.priority_inversions), (0, 0));
        let mut fifo = Tally {
            priorities,
            ..Tally::default()
        };
        for seq in 0..100 {
            fifo.record_header(
                Header {
                    producer: 0,
                    seq,
                    sent_ns: 0,
                },
                0,
            );
        }
        assert_eq!(
            fifo.out_of_order, 0,
            "each priority's messages are still in order"
        );
        assert!(
            fifo.priority_inversions > 0,
            "publish order is not priority order"
        );
    }
}
