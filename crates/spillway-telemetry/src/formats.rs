//! How the configuration writes sizes, durations and lists, for every
//! component's settings (`#[serde(deserialize_with = ...)]`): here because
//! every component depends on this crate and on nothing of the others.

/// A list of strings, or one string of comma-separated items (how an
/// environment variable gives a list).
pub fn list_or_commas<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<String>, D::Error> {
    use serde::Deserialize;

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ListOrText {
        List(Vec<String>),
        Text(String),
    }
    Ok(match ListOrText::deserialize(deserializer)? {
        ListOrText::List(items) => items,
        ListOrText::Text(text) => text
            .split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
            .map(str::to_string)
            .collect(),
    })
}

/// Sizes as plain bytes or with a unit (`256MiB`, `1 GB`).
pub mod sizes {
    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Number(u64),
        Text(String),
    }

    pub fn required<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        match Raw::deserialize(deserializer)? {
            Raw::Number(bytes) => Ok(bytes),
            Raw::Text(text) => parse(&text).map_err(serde::de::Error::custom),
        }
    }

    pub fn optional<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
        match Option::<Raw>::deserialize(deserializer)? {
            None => Ok(None),
            Some(Raw::Number(bytes)) => Ok(Some(bytes)),
            Some(Raw::Text(text)) => parse(&text).map(Some).map_err(serde::de::Error::custom),
        }
    }

    /// `"268435456"`, `"256MiB"`, `"1.5 GB"`, `"64k"` (binary units for
    /// `KiB`/`MiB`/`GiB`/`k`/`m`/`g`, decimal for `KB`/`MB`/`GB`).
    ///
    /// By hand, not bytesize: its serde support does not take the integers
    /// the `config` crate hands over for environment variables.
    pub fn parse(text: &str) -> Result<u64, String> {
        let text = text.trim();
        let split = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let number: f64 = number
            .parse()
            .map_err(|_| format!("'{text}' is not a size (e.g. 268435456 or 256MiB)"))?;
        let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" => 1 << 10,
            "m" | "mib" => 1 << 20,
            "g" | "gib" => 1 << 30,
            "t" | "tib" => 1 << 40,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            other => return Err(format!("unknown size unit '{other}' in '{text}'")),
        };
        Ok((number * multiplier as f64) as u64)
    }
}

/// Durations as plain milliseconds or text (`1s`, `250ms`).
pub mod durations {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Millis(u64),
        Text(String),
    }

    pub fn millis_or_text<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Duration, D::Error> {
        match Raw::deserialize(deserializer)? {
            Raw::Millis(millis) => Ok(Duration::from_millis(millis)),
            Raw::Text(text) => match text.trim().parse::<u64>() {
                Ok(millis) => Ok(Duration::from_millis(millis)),
                Err(_) => humantime::parse_duration(text.trim()).map_err(serde::de::Error::custom),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::sizes;

    #[test]
    fn sizes_take_plain_bytes_and_units() {
        assert_eq!(sizes::parse("268435456"), Ok(268_435_456));
        assert_eq!(sizes::parse("256MiB"), Ok(256 << 20));
        assert_eq!(sizes::parse("256 mib"), Ok(256 << 20));
        assert_eq!(sizes::parse("1GB"), Ok(1_000_000_000));
        assert_eq!(sizes::parse("1.5k"), Ok(1536));
        assert!(sizes::parse("lots").is_err());
        assert!(sizes::parse("12 parsecs").is_err());
    }
}
