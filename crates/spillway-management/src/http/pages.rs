//! Lists as RabbitMQ's API returns them: sorted (`sort`, `sort_reverse`),
//! and, when `page` is asked for, filtered by `name` (a case-insensitive
//! substring, or with `use_regex=true` a regular expression) and cut into
//! pages of `page_size` (at most [`MAX_PAGE_SIZE`]) inside
//! `{"items": [...], "page_count": ..., ...}`.

use std::cmp::Ordering;

use serde::Deserialize;
use serde_json::{json, Value};

use super::ApiError;

/// RabbitMQ's limit on `page_size`.
pub const MAX_PAGE_SIZE: u64 = 500;

const DEFAULT_PAGE_SIZE: u64 = 100;

/// The largest compiled `name` regular expression, so that a caller cannot
/// make the API build an enormous automaton.
const MAX_REGEX_BYTES: usize = 1 << 20;

/// The query parameters of a list. Numbers stay text until checked, so
/// that a wrong one gets RabbitMQ's 400 rather than a parse failure.
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    pub page: Option<String>,
    pub page_size: Option<String>,
    pub name: Option<String>,
    pub use_regex: Option<String>,
    pub sort: Option<String>,
    pub sort_reverse: Option<String>,
}

/// `items` sorted and, when asked, filtered and paged.
pub fn answer(mut items: Vec<Value>, query: &ListQuery) -> Result<Value, ApiError> {
    if query.page.is_some() {
        let sort = |items: &mut Vec<Value>, key: &str| sort_values(items, key);
        return paged(items, json_name, sort, std::convert::identity, query);
    }
    if let Some(key) = query.sort.as_deref().filter(|key| !key.is_empty()) {
        sort_values(&mut items, key);
    }
    if query.sort_reverse.as_deref() == Some("true") {
        items.reverse();
    }
    Ok(Value::Array(items))
}

fn json_name(item: &Value) -> &str {
    item.get("name").and_then(Value::as_str).unwrap_or("")
}

fn sort_values(items: &mut [Value], key: &str) {
    items.sort_by(|a, b| compare(lookup(a, key), lookup(b, key)));
}

/// As [`answer`], for lists whose items are costly to write as JSON (a
/// vhost's queues): the name filter reads `name_of`, a sort by anything
/// but the name writes one item at a time to read its key, and only the
/// asked page is written whole. With 100,000 queues a page of 100 so
/// costs the keys and 100 items, not 100,000 JSON objects (about 5 KB
/// each). Without `page` every item is written, as asked.
pub fn answer_lazily<T>(
    items: Vec<T>,
    name_of: impl Fn(&T) -> &str,
    to_json: impl Fn(&T) -> Value,
    query: &ListQuery,
) -> Result<Value, ApiError> {
    if query.page.is_none() {
        return answer(items.iter().map(&to_json).collect(), query);
    }
    let sort = |items: &mut Vec<T>, key: &str| {
        if key == "name" {
            items.sort_by(|a, b| name_of(a).cmp(name_of(b)));
            return;
        }
        let mut keyed: Vec<(Option<Value>, T)> = items
            .drain(..)
            .map(|item| (lookup(&to_json(&item), key).cloned(), item))
            .collect();
        keyed.sort_by(|a, b| compare(a.0.as_ref(), b.0.as_ref()));
        items.extend(keyed.into_iter().map(|(_, item)| item));
    };
    paged(items, &name_of, sort, |item| to_json(&item), query)
}

/// The page `query` asks for: `items` filtered by name, sorted by `sort`
/// (given the key), and the page's items written by `into_json`.
fn paged<T, S>(
    mut items: Vec<T>,
    name_of: impl Fn(&T) -> &str,
    sort: S,
    into_json: impl FnMut(T) -> Value,
    query: &ListQuery,
) -> Result<Value, ApiError>
where
    S: FnOnce(&mut Vec<T>, &str),
{
    let total_count = items.len() as u64;
    let filter = NameFilter::new(query)?;
    items.retain(|item| filter.matches(name_of(item)));
    if let Some(key) = query.sort.as_deref().filter(|key| !key.is_empty()) {
        sort(&mut items, key);
    }
    if query.sort_reverse.as_deref() == Some("true") {
        items.reverse();
    }
    let (page, page_size) = page_of(query)?;
    let filtered_count = items.len() as u64;
    let page_count = filtered_count.div_ceil(page_size);
    if page > page_count.max(1) {
        return Err(ApiError::bad_request("Page out of range"));
    }
    let start = ((page - 1) * page_size) as usize;
    let page_items: Vec<Value> = items
        .into_iter()
        .skip(start)
        .take(page_size as usize)
        .map(into_json)
        .collect();
    Ok(json!({
        "filtered_count": filtered_count,
        "item_count": page_items.len(),
        "items": page_items,
        "page": page,
        "page_count": page_count,
        "page_size": page_size,
        "total_count": total_count,
    }))
}

/// The page asked for and its size, checked as RabbitMQ checks them.
fn page_of(query: &ListQuery) -> Result<(u64, u64), ApiError> {
    let page = query.page.as_deref().unwrap_or("1");
    let invalid = || {
        ApiError::bad_request(format!(
            "Invalid pagination parameters: page number {page}, page size {}",
            query.page_size.as_deref().unwrap_or("undefined")
        ))
    };
    let page: u64 = page.parse().map_err(|_| invalid())?;
    let page_size: u64 = match query.page_size.as_deref() {
        None => DEFAULT_PAGE_SIZE,
        Some(size) => size.parse().map_err(|_| invalid())?,
    };
    if page == 0 || page_size == 0 || page_size > MAX_PAGE_SIZE {
        return Err(invalid());
    }
    Ok((page, page_size))
}

enum NameFilter {
    All,
    Substring(String),
    Regex(regex::Regex),
}

impl NameFilter {
    fn new(query: &ListQuery) -> Result<Self, ApiError> {
        let Some(name) = query.name.as_deref().filter(|name| !name.is_empty()) else {
            return Ok(Self::All);
        };
        if query.use_regex.as_deref() != Some("true") {
            return Ok(Self::Substring(name.to_lowercase()));
        }
        regex::RegexBuilder::new(name)
            .case_insensitive(true)
            .size_limit(MAX_REGEX_BYTES)
            .build()
            .map(Self::Regex)
            .map_err(|error| ApiError::bad_request(format!("invalid regular expression: {error}")))
    }

    fn matches(&self, name: &str) -> bool {
        match self {
            Self::All => true,
            Self::Substring(part) => name.to_lowercase().contains(part.as_str()),
            Self::Regex(regex) => regex.is_match(name),
        }
    }
}

/// The value at a dotted path (`message_stats.publish_details.rate`).
fn lookup<'a>(item: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(item, |value, key| value.get(key))
}

/// Absent first, then numbers by value, then text, then the rest by text.
fn compare(a: Option<&Value>, b: Option<&Value>) -> Ordering {
    match (a, b) {
        (None, None) => Ordering::Equal,
        (None, Some(_)) => Ordering::Less,
        (Some(_), None) => Ordering::Greater,
        (Some(Value::Number(a)), Some(Value::Number(b))) => {
            let (a, b) = (a.as_f64().unwrap_or(0.0), b.as_f64().unwrap_or(0.0));
            a.total_cmp(&b)
        }
        (Some(Value::String(a)), Some(Value::String(b))) => a.cmp(b),
        (Some(a), Some(b)) => a.to_string().cmp(&b.to_string()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn queues(count: usize) -> Vec<Value> {
        (0..count)
            .map(|i| json!({"name": format!("q{i:03}"), "messages": (count - i) as u64}))
            .collect()
    }

    fn query(pairs: &[(&str, &str)]) -> ListQuery {
        let get = |key: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v.to_string())
        };
        ListQuery {
            page: get("page"),
            page_size: get("page_size"),
            name: get("name"),
            use_regex: get("use_regex"),
            sort: get("sort"),
            sort_reverse: get("sort_reverse"),
        }
    }

    #[test]
    fn the_lazy_list_answers_as_the_whole_one() {
        let items: Vec<Value> = (0..40)
            .map(|i| json!({"name": format!("Q{:02}", (i * 7) % 40), "messages": i % 5, "x": {"rate": i % 3}}))
            .collect();
        for pairs in [
            &[("page", "1")][..],
            &[("page", "2"), ("page_size", "7"), ("sort", "messages")],
            &[("page", "1"), ("sort", "name"), ("sort_reverse", "true")],
            &[("page", "1"), ("sort", "x.rate"), ("name", "q1")],
            &[
                ("page", "1"),
                ("name", "^Q[0-2]"),
                ("use_regex", "true"),
                ("sort", "messages"),
            ],
            &[("sort", "messages")],
            &[("page", "9"), ("page_size", "10")],
        ] {
            let query = query(pairs);
            let whole = answer(items.clone(), &query);
            let lazy = answer_lazily(
                items.clone(),
                |item| item["name"].as_str().unwrap(),
                Value::clone,
                &query,
            );
            match (whole, lazy) {
                (Ok(whole), Ok(lazy)) => assert_eq!(whole, lazy, "{pairs:?}"),
                (Err(_), Err(_)) => {}
                (whole, lazy) => panic!("{pairs:?}: {whole:?} / {lazy:?}"),
            }
        }
    }

    #[test]
    fn without_a_page_the_list_is_a_plain_array() {
        let answer = answer(queues(3), &ListQuery::default()).unwrap();
        assert_eq!(answer.as_array().unwrap().len(), 3);
    }

    #[test]
    fn pages_count_and_cut_the_filtered_list() {
        let page = answer(queues(250), &query(&[("page", "3"), ("page_size", "100")])).unwrap();
        assert_eq!(page["page_count"], 3);
        assert_eq!(page["item_count"], 50);
        assert_eq!(page["total_count"], 250);
        assert_eq!(page["items"][0]["name"], "q200");
        let filtered = answer(
            queues(250),
            &query(&[("page", "1"), ("name", "Q1"), ("page_size", "500")]),
        )
        .unwrap();
        assert_eq!(filtered["filtered_count"], 100);
        let regex = answer(
            queues(250),
            &query(&[("page", "1"), ("name", "^q00[0-4]$"), ("use_regex", "true")]),
        )
        .unwrap();
        assert_eq!(regex["filtered_count"], 5);
    }

    #[test]
    fn bad_pages_are_refused_as_rabbitmq_does() {
        for pairs in [
            &[("page", "0")][..],
            &[("page", "x")][..],
            &[("page", "1"), ("page_size", "501")][..],
            &[("page", "9")][..],
            &[("page", "1"), ("name", "("), ("use_regex", "true")][..],
        ] {
            let refused = answer(queues(10), &query(pairs)).unwrap_err();
            assert_eq!(
                refused.status,
                axum::http::StatusCode::BAD_REQUEST,
                "{pairs:?}"
            );
        }
        // An empty list still has its first page.
        assert_eq!(
            answer(vec![], &query(&[("page", "1")])).unwrap()["page_count"],
            0
        );
    }

    #[test]
    fn lists_sort_by_any_field() {
        let sorted = answer(queues(3), &query(&[("sort", "messages")])).unwrap();
        assert_eq!(sorted[0]["name"], "q002");
        let reversed = answer(
            queues(3),
            &query(&[("sort", "name"), ("sort_reverse", "true")]),
        )
        .unwrap();
        assert_eq!(reversed[0]["name"], "q002");
    }
}
