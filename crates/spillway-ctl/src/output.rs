//! How spillctl prints: readable tables by default, the API's messages as
//! JSON with `--output json`.

use std::collections::HashMap;

use super::Output;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use serde::Serialize;
use spillway_proto::management::{self as m, argument_value};

pub(crate) struct Printer(pub(crate) Output);

impl Printer {
    pub(crate) fn print<T: Serialize>(
        &self,
        value: &T,
        table: impl FnOnce() -> String,
    ) -> anyhow::Result<()> {
        match self.0 {
            Output::Json => println!("{}", serde_json::to_string_pretty(value)?),
            Output::Table => println!("{}", table()),
        }
        Ok(())
    }
}

pub(crate) fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut table = Table::new();
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_header(header.to_vec());
    for row in rows {
        table.add_row(row);
    }
    table.to_string()
}

pub(crate) fn key_values(pairs: &[(&str, String)]) -> String {
    table(
        &["field", "value"],
        pairs
            .iter()
            .map(|(k, v)| vec![k.to_string(), v.clone()])
            .collect(),
    )
}

pub(crate) fn value_text(value: &m::ArgumentValue) -> String {
    match &value.value {
        Some(argument_value::Value::StringValue(s)) | Some(argument_value::Value::Text(s)) => {
            s.clone()
        }
        Some(argument_value::Value::IntValue(i)) => i.to_string(),
        Some(argument_value::Value::BoolValue(b)) => b.to_string(),
        Some(argument_value::Value::DoubleValue(d)) => d.to_string(),
        None => String::new(),
    }
}

pub(crate) fn map_text(map: &HashMap<String, m::ArgumentValue>) -> String {
    let mut pairs: Vec<String> = map
        .iter()
        .map(|(k, v)| format!("{k}={}", value_text(v)))
        .collect();
    pairs.sort();
    pairs.join(", ")
}

pub(crate) fn flags(pairs: &[(&str, bool)]) -> String {
    pairs
        .iter()
        .filter(|(_, on)| *on)
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .join(",")
}
