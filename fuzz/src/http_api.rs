//! What the `http_api` fuzz target asserts: the management HTTP API's own
//! handling of what a client sends, after hyper, axum and serde_json have
//! parsed it (libraries fuzzed upstream). The input is a query string, a
//! NUL byte, and a JSON body.
//!
//! Kept apart from `lib.rs` (which the gateway's tests include): the
//! management crate replays the seeds and saved crashes through this file
//! (`crates/spillway-management/tests/fuzz_regressions.rs`).

use serde_json::{json, Value};
use spillway_management::http::definitions;
use spillway_management::http::pages::{self, ListQuery, MAX_PAGE_SIZE};
use spillway_management::http::shapes;

/// Drives one input through pagination, argument tables, message
/// properties, binding keys and connection names; panics if something
/// that must hold does not.
pub fn check_http_api(data: &[u8]) {
    let (query, body) = match data.iter().position(|byte| *byte == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[][..]),
    };
    if let Ok(query) = std::str::from_utf8(query) {
        check_list_query(query);
        // A connection name read back from a URL.
        let _ = shapes::connection_id(query);
    }
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    if let Ok(table) = shapes::arguments_from(Some(&value)) {
        // Every table the API accepted is written back, and its binding key
        // is stable.
        let written = shapes::arguments(&table);
        assert!(written.is_object());
        let key = shapes::properties_key("k", &table);
        assert_eq!(key, shapes::properties_key("k", &table));
    }
    check_definitions(&value);
    if let Some(object) = value.as_object() {
        let _ = shapes::message_properties(object.get("properties"));
        if let Some(Value::String(routing_key)) = object.get("routing_key") {
            let key = shapes::properties_key(routing_key, &Default::default());
            assert!(key.is_ascii(), "{key:?}");
        }
    }
}

/// A definitions file the API accepts is written back as one it accepts
/// again, the same.
fn check_definitions(value: &Value) {
    for vhost in [None, Some("v")] {
        let Ok(read) = definitions::from_json(value, vhost) else {
            continue;
        };
        let whole = vhost.is_none();
        let written = definitions::to_json(&read, whole);
        let again = definitions::from_json(&written, vhost);
        assert_eq!(again.as_ref().ok(), Some(&read), "{written}");
    }
}

fn check_list_query(query: &str) {
    let Ok(query) = serde_urlencoded::from_str::<ListQuery>(query) else {
        return;
    };
    let items: Vec<Value> = (0..37)
        .map(|i| json!({"name": format!("queue-{i}"), "messages": 37 - i}))
        .collect();
    let Ok(answer) = pages::answer(items, &query) else {
        return;
    };
    if let Some(page) = answer.get("items") {
        let count = page.as_array().map_or(0, Vec::len) as u64;
        assert!(count <= MAX_PAGE_SIZE, "a page of {count}");
        assert_eq!(answer["item_count"], count);
    } else {
        assert_eq!(answer.as_array().map(Vec::len), Some(37));
    }
}

/// Inputs that reach each part, for the corpus and the replay.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let with = |query: &str, body: &str| {
        let mut bytes = query.as_bytes().to_vec();
        bytes.push(0);
        bytes.extend_from_slice(body.as_bytes());
        bytes
    };
    vec![
        ("page", with("page=2&page_size=10&name=queue-1", "{}")),
        (
            "regex",
            with("page=1&use_regex=true&name=%5Equeue-%5B0-4%5D%24", ""),
        ),
        ("sort", with("sort=messages&sort_reverse=true", "")),
        (
            "arguments",
            with(
                "",
                r#"{"x-max-length": 10, "x-queue-type": "classic", "x-flag": true}"#,
            ),
        ),
        (
            "publish",
            with(
                "",
                r#"{"routing_key": "a/b~c", "properties": {"delivery_mode": 2, "headers": {"k": 1}}}"#,
            ),
        ),
        ("connection", with("127.0.0.1:5000 -> spillway #17", "[]")),
        (
            "definitions",
            with(
                "",
                r#"{"vhosts": [{"name": "v"}], "users": [{"name": "u", "password_hash": "", "tags": "a,b"}], "permissions": [{"user": "u", "vhost": "v", "configure": ".*", "write": "", "read": "^q$"}], "policies": [{"vhost": "v", "name": "p", "pattern": "^q", "apply-to": "queues", "definition": {"max-length": 1}, "priority": 2}], "parameters": [{"vhost": "v", "component": "operator_policy", "name": "o", "value": {"pattern": ".*", "definition": {"max-length": 9}}}], "queues": [{"name": "q", "vhost": "v", "durable": true, "type": "quorum", "arguments": {}}], "exchanges": [{"name": "x", "vhost": "v", "type": "topic"}], "bindings": [{"source": "x", "vhost": "v", "destination": "q", "destination_type": "queue", "routing_key": "k", "arguments": {"a": 1}}]}"#,
            ),
        ),
    ]
}
