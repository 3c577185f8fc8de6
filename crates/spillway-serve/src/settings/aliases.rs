//! The names a setting is also known by: Qpid's section names (`[broker]`,
//! `[store]`, `[connection]`, as the design brief first gave them) and
//! `gateway.users`, read as the section of the component that owns the
//! setting. Each layer (the file, the environment) is rewritten on its own
//! before it is checked, so precedence between layers is unchanged and a
//! layer that sets a key under both names is refused.

use config::{Map, Value, ValueKind};

/// `(also known as, name)`: a whole section (`broker`) or one key
/// (`broker.message_compression_enabled`). Keys come first: they win over
/// their section.
pub const ALIASES: &[(&str, &str)] = &[
    (
        "broker.message_compression_enabled",
        "gateway.message_compression_enabled",
    ),
    (
        "connection.message_compression_threshold_size",
        "gateway.message_compression_threshold_size",
    ),
    ("gateway.users", "engine.users"),
    ("broker", "engine"),
    ("store", "storage"),
];

/// `key`'s own name: `broker.consumer_timeout` → `engine.consumer_timeout`,
/// with the alias that was applied (`("broker", "engine")`). A key that is
/// nobody's alias is its own name.
pub fn resolve(key: &str) -> (String, Option<(&'static str, &'static str)>) {
    for &(alias, name) in ALIASES {
        if let Some(rest) = under(key, alias) {
            return (format!("{name}{rest}"), Some((alias, name)));
        }
    }
    (key.to_string(), None)
}

/// `key` with its prefix `name` written as `alias` (the reverse of
/// [`resolve`]); a key outside `name` is returned as it is.
pub fn written_as(key: &str, name: &str, alias: &str) -> String {
    match under(key, name) {
        Some(rest) => format!("{alias}{rest}"),
        None => key.to_string(),
    }
}

/// What follows `prefix` in `key`, when `key` is `prefix` or lies under it.
fn under<'a>(key: &'a str, prefix: &str) -> Option<&'a str> {
    let rest = key.strip_prefix(prefix)?;
    (rest.is_empty() || rest.starts_with(['.', '['])).then_some(rest)
}

/// A key set under both of its names in one layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetTwice {
    pub alias: String,
    pub name: String,
}

/// One layer with every alias moved to its own name: a `config` source.
#[derive(Clone, Debug)]
pub struct Canonical {
    layer: Map<String, Value>,
    /// The keys it set under both names (the own name's value is kept).
    pub twice: Vec<SetTwice>,
    /// `(as written, own name)` of each key that was moved.
    moved: Vec<(String, String)>,
}

impl Canonical {
    /// The layer as one value, to deserialise.
    pub fn value(&self) -> Value {
        Value::new(None, ValueKind::Table(self.layer.clone()))
    }

    /// A key of this layer (`engine.users[0].nme`) as the layer wrote it
    /// (`gateway.users[0].nme`).
    pub fn as_written(&self, key: &str) -> String {
        self.moved
            .iter()
            .find(|(_, name)| under(key, name).is_some())
            .map_or_else(
                || key.to_string(),
                |(alias, name)| written_as(key, name, alias),
            )
    }
}

impl config::Source for Canonical {
    fn clone_into_box(&self) -> Box<dyn config::Source + Send + Sync> {
        Box::new(self.clone())
    }

    fn collect(&self) -> Result<Map<String, Value>, config::ConfigError> {
        Ok(self.layer.clone())
    }
}

/// `layer` (as a built `config` layer collects it: sections as tables) with
/// every alias moved to its own name.
pub fn canonical(mut layer: Map<String, Value>) -> Canonical {
    let mut twice = Vec::new();
    let mut moved = Vec::new();
    let mut set = |layer: &mut Map<String, Value>, alias: String, name: String, value| {
        if put(layer, &name, value).is_err() {
            twice.push(SetTwice {
                alias: alias.clone(),
                name: name.clone(),
            });
        }
        moved.push((alias, name));
    };
    for (alias, name) in ALIASES {
        let Some(value) = take(&mut layer, alias) else {
            continue;
        };
        match value.kind {
            // A whole section: its keys move one by one, so a key set
            // under the section's own name stays and is reported.
            ValueKind::Table(keys) if !alias.contains('.') => {
                for (key, value) in keys {
                    set(
                        &mut layer,
                        format!("{alias}.{key}"),
                        format!("{name}.{key}"),
                        value,
                    );
                }
            }
            kind => set(
                &mut layer,
                alias.to_string(),
                name.to_string(),
                Value::new(None, kind),
            ),
        }
    }
    Canonical {
        layer,
        twice,
        moved,
    }
}

/// Removes `section` or `section.key` from `layer`; an emptied section goes
/// too.
fn take(layer: &mut Map<String, Value>, path: &str) -> Option<Value> {
    let Some((section, key)) = path.split_once('.') else {
        return layer.remove(path);
    };
    let ValueKind::Table(keys) = &mut layer.get_mut(section)?.kind else {
        return None;
    };
    let value = keys.remove(key)?;
    if keys.is_empty() {
        layer.remove(section);
    }
    Some(value)
}

/// Sets `section.key` in `layer`; `Err` when it is set already (then the
/// layer keeps what it had).
fn put(layer: &mut Map<String, Value>, path: &str, value: Value) -> Result<(), ()> {
    let Some((section, key)) = path.split_once('.') else {
        return Err(());
    };
    let section = layer
        .entry(section.to_string())
        .or_insert_with(|| Value::new(None, ValueKind::Table(Map::new())));
    let ValueKind::Table(keys) = &mut section.kind else {
        // `engine = 3`: not a section; deserialising says so.
        return Err(());
    };
    if keys.contains_key(key) {
        return Err(());
    }
    keys.insert(key.to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(entries: Vec<(&str, Value)>) -> Value {
        Value::new(
            None,
            ValueKind::Table(
                entries
                    .into_iter()
                    .map(|(key, value)| (key.to_string(), value))
                    .collect(),
            ),
        )
    }

    fn int(value: i64) -> Value {
        Value::new(None, ValueKind::I64(value))
    }

    fn own_name(key: &str) -> String {
        resolve(key).0
    }

    #[test]
    fn keys_are_named_by_the_section_that_owns_them() {
        assert_eq!(
            own_name("broker.consumer_timeout"),
            "engine.consumer_timeout"
        );
        assert_eq!(
            own_name("broker.message_compression_enabled"),
            "gateway.message_compression_enabled"
        );
        assert_eq!(
            own_name("connection.message_compression_threshold_size"),
            "gateway.message_compression_threshold_size"
        );
        assert_eq!(own_name("store.overfull_size"), "storage.overfull_size");
        assert_eq!(own_name("gateway.users[1].name"), "engine.users[1].name");
        assert_eq!(own_name("brokers.x"), "brokers.x");
        assert_eq!(own_name("gateway.heartbeat"), "gateway.heartbeat");
        assert_eq!(
            written_as("engine.users[1].name", "engine.users", "gateway.users"),
            "gateway.users[1].name"
        );
    }

    #[test]
    fn a_layer_moves_to_the_owning_sections_and_reports_keys_set_twice() {
        let mut layer = Map::new();
        layer.insert(
            "broker".to_string(),
            table(vec![
                ("consumer_timeout", int(5)),
                ("session_credit", int(7)),
                ("message_compression_enabled", int(1)),
            ]),
        );
        layer.insert(
            "engine".to_string(),
            table(vec![("session_credit", int(9))]),
        );
        layer.insert(
            "store".to_string(),
            table(vec![("overfull_size", int(100))]),
        );
        let canonical = canonical(layer);
        assert_eq!(
            canonical.twice,
            vec![SetTwice {
                alias: "broker.session_credit".into(),
                name: "engine.session_credit".into(),
            }]
        );
        assert_eq!(
            canonical.as_written("engine.consumer_timeout"),
            "broker.consumer_timeout"
        );
        assert_eq!(canonical.as_written("engine.listen"), "engine.listen");
        let layer = canonical.layer;
        let mut sections: Vec<_> = layer.keys().cloned().collect();
        sections.sort();
        assert_eq!(sections, ["engine", "gateway", "storage"]);
        let ValueKind::Table(engine) = &layer["engine"].kind else {
            panic!("engine is not a table: {:?}", layer["engine"]);
        };
        assert_eq!(engine["session_credit"].kind, ValueKind::I64(9));
        assert_eq!(engine["consumer_timeout"].kind, ValueKind::I64(5));
        let ValueKind::Table(gateway) = &layer["gateway"].kind else {
            panic!("gateway is not a table");
        };
        assert_eq!(
            gateway["message_compression_enabled"].kind,
            ValueKind::I64(1)
        );
    }
}
