//! A virtual host: its exchanges (the built-in ones from the start), its
//! queues and its policies.

use foldhash::{HashMap, HashMapExt};

use crate::exchange::Exchange;
use crate::model::ExchangeKind;
use crate::policy::PolicySet;
use crate::queue::Queue;

pub struct VHost {
    pub name: String,
    pub exchanges: HashMap<String, Exchange>,
    pub queues: HashMap<String, Queue>,
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
            policies: PolicySet::default(),
            operator_policies: PolicySet::default(),
        }
    }

    pub fn policy_set_mut(&mut self, operator: bool) -> &mut PolicySet {
        if operator {
            &mut self.operator_policies
        } else {
            &mut self.policies
        }
    }
}
