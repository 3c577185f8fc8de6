//! A queue's ready messages in delivery order: one FIFO per priority level,
//! highest first (a plain queue has one level). Seen from outside it is one
//! sequence: positions count from the head of the highest level, and every
//! message has a **rank** that grows along it — its level above its id, so
//! that a plain queue's ranks are its ids. Flow to disk keeps its marks
//! (where spilling starts, how far read-ahead went) as ranks, and so spills
//! the lowest priorities' newest messages first and reads the highest
//! priorities' oldest back first.
//!
//! A message joins the end of its level (publishes) or its place by id
//! within it (requeues, recovered messages), so no level is ever sorted and
//! an arrival never moves the messages of another level.

use std::collections::VecDeque;
use std::ops::Range;

use crate::model::QueuedMessage;

/// Bits of a rank below the level: ids stay below 2^56.
const LEVEL_SHIFT: u32 = 56;

pub struct ReadyMessages {
    /// Index 0 is the highest priority.
    levels: Vec<VecDeque<QueuedMessage>>,
    len: usize,
}

impl ReadyMessages {
    /// Messages of priority 0 to `max_priority` (0: a plain queue).
    pub fn new(max_priority: u8) -> Self {
        Self {
            levels: (0..=max_priority).map(|_| VecDeque::new()).collect(),
            len: 0,
        }
    }

    pub fn max_priority(&self) -> u8 {
        (self.levels.len() - 1) as u8
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where a message of this priority and id stands in the order.
    pub fn rank_of(&self, priority: u8, id: u64) -> u64 {
        debug_assert!(id < 1 << LEVEL_SHIFT, "message ids stay below 2^56");
        ((self.level(priority) as u64) << LEVEL_SHIFT) | id
    }

    pub fn rank(&self, message: &QueuedMessage) -> u64 {
        self.rank_of(message.priority, message.id)
    }

    fn level(&self, priority: u8) -> usize {
        self.levels.len() - 1 - usize::from(priority.min(self.max_priority()))
    }

    pub fn front(&self) -> Option<&QueuedMessage> {
        self.levels.iter().find_map(|level| level.front())
    }

    pub fn pop_front(&mut self) -> Option<QueuedMessage> {
        let message = self.levels.iter_mut().find_map(|level| level.pop_front())?;
        self.len -= 1;
        Some(message)
    }

    /// A new arrival: the end of its level (its id is the newest).
    pub fn push_back(&mut self, message: QueuedMessage) {
        let level = self.level(message.priority);
        debug_assert!(self.levels[level]
            .back()
            .is_none_or(|last| last.id < message.id));
        self.levels[level].push_back(message);
        self.len += 1;
    }

    /// A message back in its place by id within its level (a requeue).
    pub fn insert_by_id(&mut self, message: QueuedMessage) {
        let level = self.level(message.priority);
        let level = &mut self.levels[level];
        let index = level.partition_point(|m| m.id < message.id);
        level.insert(index, message);
        self.len += 1;
    }

    /// Messages older than every one here in their level, oldest first
    /// (recovered from the store while newer ones arrived).
    pub fn prepend(&mut self, messages: Vec<QueuedMessage>) {
        for message in messages.into_iter().rev() {
            let level = self.level(message.priority);
            debug_assert!(self.levels[level]
                .front()
                .is_none_or(|first| message.id < first.id));
            self.levels[level].push_front(message);
            self.len += 1;
        }
    }

    pub fn drain_all(&mut self) -> Vec<QueuedMessage> {
        self.len = 0;
        self.levels
            .iter_mut()
            .flat_map(|level| level.drain(..))
            .collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = &QueuedMessage> {
        self.levels.iter().flatten()
    }

    /// The level and index within it of `position`.
    fn locate(&self, mut position: usize) -> Option<(usize, usize)> {
        for (level, messages) in self.levels.iter().enumerate() {
            if position < messages.len() {
                return Some((level, position));
            }
            position -= messages.len();
        }
        None
    }

    /// Messages in the levels above `level`.
    fn before(&self, level: usize) -> usize {
        self.levels[..level].iter().map(VecDeque::len).sum()
    }

    pub fn get(&self, position: usize) -> Option<&QueuedMessage> {
        let (level, index) = self.locate(position)?;
        self.levels[level].get(index)
    }

    pub fn get_mut(&mut self, position: usize) -> Option<&mut QueuedMessage> {
        let (level, index) = self.locate(position)?;
        self.levels[level].get_mut(index)
    }

    pub fn remove(&mut self, position: usize) -> Option<QueuedMessage> {
        let (level, index) = self.locate(position)?;
        let message = self.levels[level].remove(index)?;
        self.len -= 1;
        Some(message)
    }

    /// How many messages rank below `rank`: the position of the first that
    /// does not.
    pub fn count_below(&self, rank: u64) -> usize {
        let level = (rank >> LEVEL_SHIFT) as usize;
        if level >= self.levels.len() {
            return self.len;
        }
        let id = rank & ((1 << LEVEL_SHIFT) - 1);
        self.before(level) + self.levels[level].partition_point(|m| m.id < id)
    }

    /// The position of message `id`, if it is here.
    pub fn position_of_id(&self, id: u64) -> Option<usize> {
        let mut before = 0;
        for messages in &self.levels {
            let index = messages.partition_point(|m| m.id < id);
            if messages.get(index).is_some_and(|m| m.id == id) {
                return Some(before + index);
            }
            before += messages.len();
        }
        None
    }

    /// The messages at `range` of positions, in order, each with its rank.
    pub fn range_mut(
        &mut self,
        range: Range<usize>,
    ) -> impl Iterator<Item = (u64, &mut QueuedMessage)> {
        let wanted = range.end.saturating_sub(range.start);
        let (first_level, first_index) = self.locate(range.start).unwrap_or((self.levels.len(), 0));
        self.levels
            .iter_mut()
            .enumerate()
            .skip(first_level)
            .flat_map(move |(level, messages)| {
                let skip = if level == first_level { first_index } else { 0 };
                messages
                    .range_mut(skip.min(messages.len())..)
                    .map(move |m| (((level as u64) << LEVEL_SHIFT) | m.id, m))
            })
            .take(wanted)
    }

    pub fn capacity(&self) -> usize {
        self.levels.iter().map(VecDeque::capacity).sum()
    }

    /// Gives back the allocation of levels that hold far less than they
    /// once did (`budget::shrunk_capacity`'s rule, per level).
    pub fn shrink(&mut self, floor: usize) {
        for level in &mut self.levels {
            if let Some(shrunk) =
                crate::budget::shrunk_capacity(level.len(), level.capacity(), floor)
            {
                level.shrink_to(shrunk);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(id: u64, priority: u8) -> QueuedMessage {
        let mut message = QueuedMessage::stored(id, 1);
        message.priority = priority;
        message
    }

    fn ids(ready: &ReadyMessages) -> Vec<u64> {
        ready.iter().map(|m| m.id).collect()
    }

    #[test]
    fn a_plain_queue_ranks_by_id() {
        let mut ready = ReadyMessages::new(0);
        for id in 1..=3 {
            ready.push_back(message(id, 7));
        }
        assert_eq!(ids(&ready), vec![1, 2, 3]);
        assert_eq!(ready.rank(&message(2, 9)), 2);
        assert_eq!(ready.count_below(3), 2);
        assert_eq!(ready.pop_front().map(|m| m.id), Some(1));
    }

    #[test]
    fn higher_priorities_first_and_fifo_within_one() {
        let mut ready = ReadyMessages::new(5);
        for (id, priority) in [(1, 0), (2, 5), (3, 2), (4, 9), (5, 2), (6, 0)] {
            ready.push_back(message(id, priority));
        }
        // 9 counts as the maximum, 5.
        assert_eq!(ids(&ready), vec![2, 4, 3, 5, 1, 6]);
        let ranks: Vec<u64> = ready.iter().map(|m| ready.rank(m)).collect();
        assert!(
            ranks.windows(2).all(|w| w[0] < w[1]),
            "ranks grow along the order"
        );
        for (position, rank) in ranks.iter().enumerate() {
            assert_eq!(ready.count_below(*rank), position);
        }
        assert_eq!(ready.count_below(u64::MAX), 6);
        assert_eq!(ready.position_of_id(5), Some(3));
        assert_eq!(ready.position_of_id(7), None);
        assert_eq!(ready.get(4).map(|m| m.id), Some(1));
        let window: Vec<(u64, u64)> = ready.range_mut(1..4).map(|(r, m)| (r, m.id)).collect();
        assert_eq!(window, vec![(ranks[1], 4), (ranks[2], 3), (ranks[3], 5)]);
        assert_eq!(ready.remove(2).map(|m| m.id), Some(3));
        ready.insert_by_id(message(3, 2));
        assert_eq!(ids(&ready), vec![2, 4, 3, 5, 1, 6]);
        ready.prepend(vec![message(0, 0), message(0, 5)]);
        assert_eq!(ready.len(), 8);
        assert_eq!(ids(&ready), vec![0, 2, 4, 3, 5, 0, 1, 6]);
        let drained: Vec<u64> = ready.drain_all().iter().map(|m| m.id).collect();
        assert_eq!(drained, vec![0, 2, 4, 3, 5, 0, 1, 6]);
        assert!(ready.is_empty() && ready.front().is_none());
    }
}
