//! The keys the settings read, found by walking the settings structs'
//! `Deserialize` impls: each struct hands serde its field names, so a new
//! field is a known key without anything else to update.

use std::cell::Cell;
use std::fmt;

use serde::de::value::StrDeserializer;
use serde::de::{self, DeserializeOwned, Visitor};

/// One step of a key: a field, or an entry of a list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segment {
    Key(String),
    /// An entry of a list; `None` is any entry.
    Index(Option<usize>),
}

/// `gateway.users[1].name`.
pub fn render(path: &[Segment]) -> String {
    let mut out = String::new();
    for segment in path {
        match segment {
            Segment::Key(key) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Segment::Index(Some(index)) => out.push_str(&format!("[{index}]")),
            Segment::Index(None) => out.push_str("[]"),
        }
    }
    out
}

/// The steps of a rendered key: the reverse of [`render`].
pub fn parse(key: &str) -> Vec<Segment> {
    let mut out = Vec::new();
    for part in key.split('.') {
        let mut pieces = part.split('[');
        if let Some(name) = pieces.next().filter(|name| !name.is_empty()) {
            out.push(Segment::Key(name.to_string()));
        }
        for index in pieces {
            let index = index.trim_end_matches(']');
            out.push(Segment::Index(index.parse().ok()));
        }
    }
    out
}

/// The steps of a path `serde_ignored` reports.
pub fn segments(path: &serde_ignored::Path<'_>) -> Vec<Segment> {
    let mut out = match path {
        serde_ignored::Path::Root => return Vec::new(),
        serde_ignored::Path::Seq { parent, .. }
        | serde_ignored::Path::Map { parent, .. }
        | serde_ignored::Path::Some { parent }
        | serde_ignored::Path::NewtypeStruct { parent }
        | serde_ignored::Path::NewtypeVariant { parent } => segments(parent),
    };
    match path {
        serde_ignored::Path::Seq { index, .. } => out.push(Segment::Index(Some(*index))),
        serde_ignored::Path::Map { key, .. } => out.push(Segment::Key(key.clone())),
        _ => {}
    }
    out
}

/// The fields of the struct `T` has at `path`, if it has one there.
pub fn fields_at<T: DeserializeOwned>(path: &[Segment]) -> Option<&'static [&'static str]> {
    let found = Cell::new(None);
    let _ = T::deserialize(Walker {
        rest: path,
        found: &found,
    });
    found.get()
}

/// `path` with each unknown step replaced by the closest known one at
/// its place, when every unknown step has a close one.
pub fn suggest<T: DeserializeOwned>(path: &[Segment]) -> Option<Vec<Segment>> {
    let mut known = Vec::new();
    for segment in path {
        match segment {
            Segment::Index(_) => known.push(segment.clone()),
            Segment::Key(key) => {
                let fields = fields_at::<T>(&known)?;
                let nearest = if fields.contains(&key.as_str()) {
                    key.as_str()
                } else {
                    nearest(key, fields)?
                };
                known.push(Segment::Key(nearest.to_string()));
            }
        }
    }
    (known != path).then_some(known)
}

/// The field most like `key`, if it is alike enough to be a slip.
fn nearest<'a>(key: &str, fields: &[&'a str]) -> Option<&'a str> {
    let key = key.to_lowercase();
    fields
        .iter()
        .map(|field| (strsim::jaro_winkler(&key, field), *field))
        .filter(|(likeness, _)| *likeness >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, field)| field)
}

/// Presents `T` a document that holds only `rest`, and notes the fields
/// of the struct found at its end. Every path ends in an error: no value
/// is ever made, so no setting's type or validation matters.
struct Walker<'a> {
    rest: &'a [Segment],
    found: &'a Cell<Option<&'static [&'static str]>>,
}

#[derive(Debug)]
struct Stop;

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("walked")
    }
}

impl std::error::Error for Stop {}

impl de::Error for Stop {
    fn custom<T: fmt::Display>(_: T) -> Self {
        Stop
    }
}

impl<'de> de::Deserializer<'de> for Walker<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Stop> {
        match self.rest.split_first() {
            Some((Segment::Key(key), rest)) => visitor.visit_map(Entry {
                key: Some(key.as_str()),
                value: Some(Walker {
                    rest,
                    found: self.found,
                }),
            }),
            Some((Segment::Index(_), rest)) => visitor.visit_seq(Element(Some(Walker {
                rest,
                found: self.found,
            }))),
            None => Err(Stop),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Stop> {
        if self.rest.is_empty() {
            self.found.set(Some(fields));
            return Err(Stop);
        }
        self.deserialize_any(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Stop> {
        visitor.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Stop> {
        visitor.visit_newtype_struct(self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf unit unit_struct seq tuple tuple_struct map enum
        identifier ignored_any
    }
}

struct Entry<'a> {
    key: Option<&'a str>,
    value: Option<Walker<'a>>,
}

impl<'de> de::MapAccess<'de> for Entry<'_> {
    type Error = Stop;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Stop> {
        match self.key.take() {
            Some(key) => seed
                .deserialize(StrDeserializer::<Stop>::new(key))
                .map(Some),
            None => Ok(None),
        }
    }

    fn next_value_seed<V: de::DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Stop> {
        match self.value.take() {
            Some(walker) => seed.deserialize(walker),
            None => Err(Stop),
        }
    }
}

struct Element<'a>(Option<Walker<'a>>);

impl<'de> de::SeqAccess<'de> for Element<'_> {
    type Error = Stop;

    fn next_element_seed<T: de::DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Stop> {
        match self.0.take() {
            Some(walker) => seed.deserialize(walker).map(Some),
            None => Ok(None),
        }
    }
}
