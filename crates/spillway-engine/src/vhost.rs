//! A virtual host: its exchanges (the built-in ones from the start), its
//! queues and its policies.
//!
//! Its queues are kept twice: by name in a hash map (what the message path
//! looks up) and their names in order (`queue_names`), so that a walk over
//! every queue can stop after a chunk, let the broker lock go, and resume
//! after the last name it saw ([`VHost::queue_names_after`]). Queues come
//! and go only through [`VHost::insert_queue`] and [`VHost::remove_queue`],
//! which keep the two together.

use std::collections::BTreeSet;
use std::ops::Bound;

use foldhash::{HashMap, HashMapExt};

use crate::exchange::Exchange;
use crate::model::ExchangeKind;
use crate::policy::PolicySet;
use crate::queue::Queue;

pub struct VHost {
    pub name: String,
    pub exchanges: HashMap<String, Exchange>,
    pub queues: HashMap<String, Queue>,
    /// The names of `queues`, in order: where a chunked walk resumes.
    queue_names: BTreeSet<String>,
    /// Its policies and operator policies (`policy.rs`).
    pub policies: PolicySet,
    pub operator_policies: PolicySet,
}

impl VHost {
    pub fn new(name: &str) -> Self {
        let mut exchanges = HashMap::new();
        for (exchange_name, kind) in [
            ("", ExchangeKind::Direct),
            ("amq.direct", ExchangeKind::Direct),
            ("amq.fanout", ExchangeKind::Fanout),
            ("amq.topic", ExchangeKind::Topic),
            ("amq.headers", ExchangeKind::Headers),
            ("amq.match", ExchangeKind::Headers),
        ] {
            exchanges.insert(
                exchange_name.to_string(),
                Exchange::new(exchange_name, kind, true),
            );
        }
        Self {
            name: name.to_string(),
            exchanges,
            queues: HashMap::new(),
            queue_names: BTreeSet::new(),
            policies: PolicySet::default(),
            operator_policies: PolicySet::default(),
        }
    }

    /// Adds `queue` (or replaces the one of its name), returning the one
    /// it replaced.
    pub fn insert_queue(&mut self, queue: Queue) -> Option<Queue> {
        self.queue_names.insert(queue.name.clone());
        self.queues.insert(queue.name.clone(), queue)
    }

    /// Takes the queue `name` out of the vhost.
    pub fn remove_queue(&mut self, name: &str) -> Option<Queue> {
        self.queue_names.remove(name);
        self.queues.remove(name)
    }

    /// The names of the queues after `after` (all of them for `None`), in
    /// order.
    pub fn queue_names_after<'a>(
        &'a self,
        after: Option<&'a str>,
    ) -> impl Iterator<Item = &'a String> + 'a {
        debug_assert_eq!(self.queue_names.len(), self.queues.len());
        let start = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.queue_names
            .range::<str, (Bound<&str>, Bound<&str>)>((start, Bound::Unbounded))
    }

    pub fn policy_set_mut(&mut self, operator: bool) -> &mut PolicySet {
        if operator {
            &mut self.operator_policies
        } else {
            &mut self.policies
        }
    }
}
