//! A virtual host: its exchanges (the built-in ones from the start) and
//! its queues.

use foldhash::{HashMap, HashMapExt};

use crate::exchange::Exchange;
use crate::model::ExchangeKind;
use crate::queue::Queue;

pub struct VHost {
    pub name: String,
    pub exchanges: HashMap<String, Exchange>,
    pub queues: HashMap<String, Queue>,
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
        }
    }
}
