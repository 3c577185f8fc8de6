//! An exchange's bindings, indexed so that routing one message costs what
//! its routing key costs, not what the number of bindings costs: a direct
//! exchange finds its bindings in a map by routing key, a topic exchange
//! walks a trie of its patterns word by word (as RabbitMQ's topic exchange
//! does). Fanout and headers exchanges still look at every binding (every
//! binding of a fanout matches; a headers binding's match is its arguments),
//! which the vhost's binding limit bounds.
//!
//! One user's thousands of long `#`/`*` patterns used to make every publish
//! to that exchange scan and re-split all of them under the engine's lock,
//! stalling every client of the broker.

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};

use crate::model::Binding;
use crate::model::ExchangeKind;

/// The bindings of one exchange.
pub struct Bindings {
    /// By routing key (for a topic exchange: the pattern); each list holds
    /// distinct bindings (destination, key and arguments).
    by_key: HashMap<String, Vec<Binding>>,
    /// A topic exchange's patterns; None for other kinds.
    topics: Option<TopicTrie>,
    len: usize,
}

impl Bindings {
    pub fn new(kind: ExchangeKind) -> Self {
        Self {
            by_key: HashMap::new(),
            topics: (kind == ExchangeKind::Topic).then(TopicTrie::default),
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every binding, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &Binding> {
        self.by_key.values().flatten()
    }

    /// Whether a binding with the same destination, key and arguments
    /// exists.
    pub fn contains(&self, binding: &Binding) -> bool {
        self.by_key
            .get(&binding.routing_key)
            .is_some_and(|same_key| same_key.iter().any(|b| same_binding(b, binding)))
    }

    /// Adds `binding`; false (and nothing changes) if it exists already.
    pub fn insert(&mut self, binding: Binding) -> bool {
        if self.contains(&binding) {
            return false;
        }
        if let Some(topics) = &mut self.topics {
            if !self.by_key.contains_key(&binding.routing_key) {
                topics.insert(&binding.routing_key);
            }
        }
        self.by_key
            .entry(binding.routing_key.clone())
            .or_default()
            .push(binding);
        self.len += 1;
        true
    }

    /// Removes the binding equal to `probe` (destination, key, arguments).
    pub fn remove(&mut self, probe: &Binding) -> Option<Binding> {
        let same_key = self.by_key.get_mut(&probe.routing_key)?;
        let position = same_key.iter().position(|b| same_binding(b, probe))?;
        let removed = same_key.swap_remove(position);
        if same_key.is_empty() {
            self.forget_key(&probe.routing_key);
        }
        self.len -= 1;
        Some(removed)
    }

    /// Keeps the bindings for which `keep` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&Binding) -> bool) {
        let mut emptied = Vec::new();
        for (key, same_key) in &mut self.by_key {
            let before = same_key.len();
            same_key.retain(&mut keep);
            self.len -= before - same_key.len();
            if same_key.is_empty() {
                emptied.push(key.clone());
            }
        }
        for key in emptied {
            self.forget_key(&key);
        }
    }

    /// The bindings a message with `routing_key` can match: for a direct
    /// exchange those with that key, for a topic exchange those whose
    /// pattern matches it, otherwise all (the caller matches headers).
    pub fn candidates(&self, kind: ExchangeKind, routing_key: &str) -> Candidates<'_> {
        match (kind, &self.topics) {
            (ExchangeKind::Direct, _) => Candidates::Listed(
                self.by_key
                    .get(routing_key)
                    .map_or([].iter(), |same_key| same_key.iter()),
            ),
            (ExchangeKind::Topic, Some(topics)) => Candidates::Patterns {
                patterns: topics.matches(routing_key).into_iter(),
                by_key: &self.by_key,
                current: [].iter(),
            },
            _ => Candidates::All(self.by_key.values().flatten()),
        }
    }

    fn forget_key(&mut self, key: &str) {
        self.by_key.remove(key);
        if let Some(topics) = &mut self.topics {
            topics.remove(key);
        }
    }
}

/// What [`Bindings::candidates`] yields, without a box per message.
pub enum Candidates<'a> {
    Listed(std::slice::Iter<'a, Binding>),
    Patterns {
        patterns: std::vec::IntoIter<&'a str>,
        by_key: &'a HashMap<String, Vec<Binding>>,
        current: std::slice::Iter<'a, Binding>,
    },
    All(std::iter::Flatten<std::collections::hash_map::Values<'a, String, Vec<Binding>>>),
}

impl<'a> Iterator for Candidates<'a> {
    type Item = &'a Binding;

    fn next(&mut self) -> Option<&'a Binding> {
        match self {
            Candidates::Listed(listed) => listed.next(),
            Candidates::All(all) => all.next(),
            Candidates::Patterns {
                patterns,
                by_key,
                current,
            } => loop {
                if let Some(binding) = current.next() {
                    return Some(binding);
                }
                let pattern = patterns.next()?;
                if let Some(same_key) = by_key.get(pattern) {
                    *current = same_key.iter();
                }
            },
        }
    }
}

fn same_binding(a: &Binding, b: &Binding) -> bool {
    a.destination == b.destination && a.routing_key == b.routing_key && a.arguments == b.arguments
}

/// The words of a routing key or pattern. As in RabbitMQ, an empty key has
/// no words (but `a..b` has an empty one).
fn words(text: &str) -> impl Iterator<Item = &str> {
    let mut split = (!text.is_empty()).then(|| text.split('.'));
    std::iter::from_fn(move || split.as_mut()?.next())
}

/// Topic patterns, one node per word, shared by patterns with the same
/// first words. `*` and `#` are words like any other in the tree; matching
/// gives them their meaning.
#[derive(Default)]
struct TopicTrie {
    root: TrieNode,
}

#[derive(Default)]
struct TrieNode {
    children: HashMap<Box<str>, TrieNode>,
    /// The whole pattern, when one ends at this node.
    pattern: Option<Box<str>>,
}

impl TopicTrie {
    fn insert(&mut self, pattern: &str) {
        let mut node = &mut self.root;
        for word in words(pattern) {
            node = node.children.entry(word.into()).or_default();
        }
        node.pattern = Some(pattern.into());
    }

    /// Removes `pattern` and the nodes no other pattern needs.
    fn remove(&mut self, pattern: &str) {
        let path: Vec<&str> = words(pattern).collect();
        remove_path(&mut self.root, &path);
    }

    /// The patterns that match `routing_key`, each once. Each (node, words
    /// consumed) state is visited at most once, so the work is bounded by
    /// the nodes the key's words lead to times the key's words, however the
    /// patterns combine `#`.
    fn matches(&self, routing_key: &str) -> Vec<&str> {
        let key: Vec<&str> = words(routing_key).collect();
        let mut matched = Vec::new();
        let mut seen: HashSet<(*const TrieNode, usize)> = HashSet::new();
        // (node, words of the key consumed, whether the node is a `#`).
        let mut pending = vec![(&self.root, 0usize, false)];
        while let Some((node, at, is_hash)) = pending.pop() {
            if !seen.insert((std::ptr::from_ref(node), at)) {
                continue;
            }
            if at == key.len() {
                if let Some(pattern) = &node.pattern {
                    matched.push(&**pattern);
                }
            }
            // A `#` takes one more word and stays.
            if is_hash && at < key.len() {
                pending.push((node, at + 1, true));
            }
            // A `#` child takes no word yet (then any number).
            if let Some(hash) = node.children.get("#") {
                pending.push((hash, at, true));
            }
            let Some(word) = key.get(at) else {
                continue;
            };
            if let Some(star) = node.children.get("*") {
                pending.push((star, at + 1, false));
            }
            if *word != "*" && *word != "#" {
                if let Some(exact) = node.children.get(*word) {
                    pending.push((exact, at + 1, false));
                }
            }
        }
        matched
    }
}

/// Unmarks the pattern at the end of `path` below `node`; true when `node`
/// is left with nothing (and its parent should drop it).
fn remove_path(node: &mut TrieNode, path: &[&str]) -> bool {
    match path.split_first() {
        None => node.pattern = None,
        Some((word, rest)) => {
            if let Some(child) = node.children.get_mut(*word) {
                if remove_path(child, rest) {
                    node.children.remove(*word);
                }
            }
        }
    }
    node.pattern.is_none() && node.children.is_empty()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::model::Destination;

    /// Does a topic binding pattern (`*` = one word, `#` = zero or more words)
    /// match a routing key? Words are separated by dots. The trie above is
    /// tested against this plain statement of the rule.
    fn topic_matches(pattern: &str, routing_key: &str) -> bool {
        // As in RabbitMQ, an empty key has no words (but "a..b" has an empty one).
        fn words(s: &str) -> Vec<&str> {
            if s.is_empty() {
                Vec::new()
            } else {
                s.split('.').collect()
            }
        }
        let (pattern, key) = (words(pattern), words(routing_key));
        // matches[i][j]: pattern[i..] matches key[j..]; computed backwards.
        let (p, k) = (pattern.len(), key.len());
        let mut next = vec![false; k + 1];
        next[k] = true;
        for i in (0..p).rev() {
            let mut current = vec![false; k + 1];
            for j in (0..=k).rev() {
                current[j] = match pattern[i] {
                    "#" => next[j] || (j < k && current[j + 1]),
                    "*" => j < k && next[j + 1],
                    word => j < k && key[j] == word && next[j + 1],
                };
            }
            next = current;
        }
        next[0]
    }

    #[test]
    fn topic_patterns() {
        assert!(topic_matches("a.b", "a.b"));
        assert!(!topic_matches("a.b", "a.b.c"));
        assert!(topic_matches("a.*", "a.b"));
        assert!(!topic_matches("a.*", "a"));
        assert!(!topic_matches("a.*", "a.b.c"));
        assert!(topic_matches("#", ""));
        assert!(topic_matches("#", "a.b.c"));
        assert!(topic_matches("a.#", "a"));
        assert!(topic_matches("a.#", "a.b.c"));
        assert!(topic_matches("a.#.b", "a.b"));
        assert!(topic_matches("a.#.b", "a.x.y.b"));
        assert!(!topic_matches("a.#.b", "a.x.y.c"));
        assert!(topic_matches("*.*.c", "a.b.c"));
        assert!(topic_matches("#.c", "c"));
        assert!(!topic_matches("*", ""));
        assert!(topic_matches("", ""));
        assert!(!topic_matches("", "a"));
    }

    fn binding(queue: &str, key: &str) -> Binding {
        Binding {
            destination: Destination::Queue(queue.into()),
            routing_key: key.into(),
            arguments: Default::default(),
        }
    }

    fn routed(bindings: &Bindings, kind: ExchangeKind, key: &str) -> Vec<String> {
        let mut queues: Vec<String> = bindings
            .candidates(kind, key)
            .map(|b| b.destination.name().to_string())
            .collect();
        queues.sort();
        queues
    }

    #[test]
    fn direct_bindings_are_found_by_key_and_kept_distinct() {
        let mut bindings = Bindings::new(ExchangeKind::Direct);
        assert!(bindings.insert(binding("a", "k")));
        assert!(!bindings.insert(binding("a", "k")));
        assert!(bindings.insert(binding("b", "k")));
        assert!(bindings.insert(binding("c", "other")));
        assert_eq!(bindings.len(), 3);
        assert_eq!(routed(&bindings, ExchangeKind::Direct, "k"), ["a", "b"]);
        assert!(routed(&bindings, ExchangeKind::Direct, "none").is_empty());
        assert!(bindings.remove(&binding("a", "k")).is_some());
        assert!(bindings.remove(&binding("a", "k")).is_none());
        bindings.retain(|b| b.destination.name() != "c");
        assert_eq!(bindings.len(), 1);
        assert_eq!(routed(&bindings, ExchangeKind::Direct, "k"), ["b"]);
        assert!(!bindings.by_key.contains_key("other"));
    }

    /// A small deterministic generator (xorshift), so that the comparison
    /// below covers many shapes and fails the same way every time.
    struct Words(u64);

    impl Words {
        fn next(&mut self, below: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % below
        }

        fn text(&mut self, vocabulary: &[&str]) -> String {
            let count = self.next(6);
            (0..count)
                .map(|_| vocabulary[self.next(vocabulary.len() as u64) as usize])
                .collect::<Vec<_>>()
                .join(".")
        }
    }

    /// The trie routes exactly as the word-by-word matcher it replaced, for
    /// thousands of random patterns and keys (empty words, `*`, `#`, and
    /// patterns added and removed again).
    #[test]
    fn the_trie_agrees_with_the_pattern_matcher() {
        let mut rng = Words(0x5eed_1234_abcd_0001);
        let pattern_words = ["a", "b", "", "*", "#", "c"];
        let key_words = ["a", "b", "", "c", "d"];
        for _round in 0..200 {
            let mut bindings = Bindings::new(ExchangeKind::Topic);
            let patterns: Vec<String> = (0..12).map(|_| rng.text(&pattern_words)).collect();
            for (i, pattern) in patterns.iter().enumerate() {
                bindings.insert(binding(&format!("q{i}"), pattern));
            }
            // Some go again, so removal and pruning are covered.
            for (i, pattern) in patterns.iter().enumerate().filter(|(i, _)| i % 3 == 0) {
                bindings.remove(&binding(&format!("q{i}"), pattern));
            }
            for _ in 0..20 {
                let key = rng.text(&key_words);
                let mut expected: Vec<String> = bindings
                    .iter()
                    .filter(|b| topic_matches(&b.routing_key, &key))
                    .map(|b| b.destination.name().to_string())
                    .collect();
                expected.sort();
                assert_eq!(
                    routed(&bindings, ExchangeKind::Topic, &key),
                    expected,
                    "key '{key}', patterns {patterns:?}"
                );
            }
        }
    }

    #[test]
    fn removing_every_pattern_leaves_an_empty_trie() {
        let mut bindings = Bindings::new(ExchangeKind::Topic);
        let patterns = ["a.#.b", "a.*", "#", "a.#.b.#", ""];
        for pattern in patterns {
            bindings.insert(binding("q", pattern));
        }
        for pattern in patterns {
            assert!(bindings.remove(&binding("q", pattern)).is_some());
        }
        let trie = bindings.topics.as_ref().unwrap();
        assert!(trie.root.children.is_empty() && trie.root.pattern.is_none());
        assert!(bindings.is_empty());
    }

    /// Patterns that are all `#` cost states, not combinations: a key of
    /// 100 words against `#.#.#.#.#.#.#.#` answers at once.
    #[test]
    fn many_hashes_do_not_explode() {
        let mut bindings = Bindings::new(ExchangeKind::Topic);
        bindings.insert(binding("q", &["#"; 8].join(".")));
        let key = ["w"; 100].join(".");
        assert_eq!(routed(&bindings, ExchangeKind::Topic, &key), ["q"]);
    }
}
