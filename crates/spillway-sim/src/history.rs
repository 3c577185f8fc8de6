//! What happened in one run, in simulated time: the faults, the leases
//! taken, the writes confirmed and refused. Its digest is what "a seed
//! replays exactly" compares.

use std::hash::{Hash, Hasher};
use std::time::Duration;

use tokio::time::Instant;

/// What a message record's id says of the batch that wrote it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MessageTag {
    pub engine: u64,
    pub epoch: u64,
    pub sequence: u64,
}

impl MessageTag {
    pub fn id(self) -> u64 {
        (self.engine << 48) | ((self.epoch & 0xffff) << 32) | (self.sequence & 0xffff_ffff)
    }

    pub fn of(id: u64) -> Self {
        Self {
            engine: id >> 48,
            epoch: (id >> 32) & 0xffff,
            sequence: id & 0xffff_ffff,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Event {
    /// A fault of the schedule, or its end.
    Fault(String),
    LeaseTaken {
        engine: u64,
        epoch: u64,
    },
    Confirmed(MessageTag),
    Refused {
        tag: MessageTag,
        reason: String,
    },
    SteppedDown {
        engine: u64,
    },
}

pub struct History {
    started: Instant,
    events: Vec<(Duration, Event)>,
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

impl History {
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
            events: Vec::new(),
        }
    }

    pub fn record(&mut self, event: Event) {
        self.events.push((self.started.elapsed(), event));
    }

    pub fn events(&self) -> &[(Duration, Event)] {
        &self.events
    }

    /// The writes confirmed so far.
    pub fn confirmed(&self) -> impl Iterator<Item = MessageTag> + '_ {
        self.events.iter().filter_map(|(_, event)| match event {
            Event::Confirmed(tag) => Some(*tag),
            _ => None,
        })
    }

    /// A digest of every event and its time: equal for two runs of one
    /// seed. (`DefaultHasher::new` has fixed keys.)
    pub fn digest(&self) -> u64 {
        let mut hasher = std::hash::DefaultHasher::new();
        self.events.hash(&mut hasher);
        hasher.finish()
    }

    /// The last `count` events, for a failure's report.
    pub fn tail(&self, count: usize) -> String {
        let skip = self.events.len().saturating_sub(count);
        self.events[skip..]
            .iter()
            .map(|(at, event)| format!("  {:>8.3} s  {event:?}", at.as_secs_f64()))
            .collect::<Vec<_>>()
            .join("\n")
    }
}
