//! `/api/queues`: queues declared, listed (a page at a time, `pages.rs`),
//! deleted, purged, and their messages got or moved.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use spillway_proto::management as m;

use super::common::{
    arguments, body, created, flag, json, no_content, text, visible_vhosts, Answer, Api,
    DeleteQuery, Who,
};
use super::pages::{self, ListQuery};
use super::shapes;
use super::{ApiError, HttpApi};
use crate::auth::Caller;

/// Its endpoints.
pub(super) fn routes() -> Router<Api> {
    Router::new()
        .route("/api/queues", get(all_queues))
        .route("/api/queues/{vhost}", get(vhost_queues))
        .route(
            "/api/queues/{vhost}/{name}",
            get(get_queue).put(put_queue).delete(delete_queue),
        )
        .route(
            "/api/queues/{vhost}/{name}/contents",
            axum::routing::delete(purge_queue),
        )
        .route("/api/queues/{vhost}/{name}/get", post(get_messages))
        .route("/api/queues/{vhost}/{name}/move", post(move_messages))
}

/// A queue in RabbitMQ's shape, with its rates once sampled.
fn queue_json(api: &HttpApi, queue: &m::Queue) -> Value {
    let mut value = shapes::queue(queue, &api.node);
    for (key, field) in api.rates.queue_fields(&queue.vhost, &queue.name) {
        value[key] = field;
    }
    value
}

async fn queues_of(api: &HttpApi, caller: &Caller, vhost: &str) -> Result<Vec<m::Queue>, ApiError> {
    let list = api
        .service
        .list_queues(
            caller,
            m::ListQueuesRequest {
                vhost: vhost.to_string(),
            },
        )
        .await?;
    Ok(list.queues)
}

async fn all_queues(
    State(api): State<Api>,
    Who(caller): Who,
    Query(query): Query<ListQuery>,
) -> Answer {
    let _slot = api.list_slot().await?;
    let mut queues = Vec::new();
    for vhost in visible_vhosts(&api, &caller).await? {
        queues.extend(queues_of(&api, &caller, &vhost.name).await?);
    }
    queue_list(&api, queues, &query)
}

/// Queues as a list, each written as JSON only if it is on the page.
fn queue_list(api: &HttpApi, queues: Vec<m::Queue>, query: &ListQuery) -> Answer {
    let answer = pages::answer_lazily(
        queues,
        |queue| queue.name.as_str(),
        |queue| queue_json(api, queue),
        query,
    )?;
    json(answer)
}

async fn vhost_queues(
    State(api): State<Api>,
    Who(caller): Who,
    Path(vhost): Path<String>,
    Query(query): Query<ListQuery>,
) -> Answer {
    let _slot = api.list_slot().await?;
    let queues = queues_of(&api, &caller, &vhost).await?;
    queue_list(&api, queues, &query)
}

async fn get_queue(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    let queue = api
        .service
        .get_queue(&caller, m::GetQueueRequest { vhost, name })
        .await?;
    json(queue_json(&api, &queue))
}

async fn put_queue(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
    bytes: Bytes,
) -> Answer {
    let body = body(&bytes)?;
    let was_there = api
        .service
        .get_queue(
            &caller,
            m::GetQueueRequest {
                vhost: vhost.clone(),
                name: name.clone(),
            },
        )
        .await
        .is_ok();
    let request = m::CreateQueueRequest {
        vhost,
        name,
        durable: flag(&body, "durable", true)?,
        auto_delete: flag(&body, "auto_delete", false)?,
        arguments: arguments(&body)?,
    };
    api.service.create_queue(&caller, request).await?;
    created(was_there)
}

async fn delete_queue(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
    Query(query): Query<DeleteQuery>,
) -> Answer {
    let request = m::DeleteQueueRequest {
        vhost,
        name,
        if_unused: query.if_unused.as_deref() == Some("true"),
        if_empty: query.if_empty.as_deref() == Some("true"),
    };
    api.service.delete_queue(&caller, request).await?;
    no_content()
}

async fn purge_queue(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    api.service
        .purge_queue(&caller, m::PurgeQueueRequest { vhost, name })
        .await?;
    no_content()
}

/// The largest `count` of one get.
const MAX_GET_COUNT: u64 = 1000;

/// `POST /api/queues/{vhost}/{name}/get`: the `*_requeue_true` modes are
/// a look at the head that leaves every message where it was (RabbitMQ's
/// redelivered flag is not set, since nothing is delivered); the
/// `*_requeue_false` modes take the messages as basic.get does, then
/// acknowledge them or reject them (dead-lettering).
async fn get_messages(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
    bytes: Bytes,
) -> Answer {
    let body = body(&bytes)?;
    let count = match body.get("count") {
        None | Some(Value::Null) => 1,
        Some(Value::String(text)) => text
            .parse()
            .map_err(|_| ApiError::bad_request("'count' must be an integer"))?,
        Some(value) => value
            .as_u64()
            .ok_or_else(|| ApiError::bad_request("'count' must be an integer"))?,
    };
    if count == 0 || count > MAX_GET_COUNT {
        return Err(ApiError::bad_request(format!(
            "'count' must be between 1 and {MAX_GET_COUNT}"
        )));
    }
    let ackmode =
        text(&body, "ackmode")?.ok_or_else(|| ApiError::bad_request("'ackmode' is required"))?;
    let take = match ackmode {
        "ack_requeue_true" | "reject_requeue_true" => None,
        "ack_requeue_false" => Some(false),
        "reject_requeue_false" => Some(true),
        other => {
            return Err(ApiError::bad_request(format!(
                "ackmode '{other}' is not one of ack_requeue_true, reject_requeue_true, ack_requeue_false, reject_requeue_false"
            )))
        }
    };
    let truncate = body.get("truncate").and_then(Value::as_u64);
    let peeked = match take {
        None => {
            let request = m::PeekMessagesRequest {
                vhost,
                queue: name,
                count: count as u32,
            };
            api.service.peek_messages(&caller, request).await?
        }
        Some(reject) => {
            let request = m::GetMessagesRequest {
                vhost,
                queue: name,
                count: count as u32,
                reject,
            };
            api.service.get_messages(&caller, request).await?
        }
    };
    let total = peeked.messages.len();
    let items: Vec<Value> = peeked
        .messages
        .iter()
        .enumerate()
        .map(|(index, message)| peeked_message(message, total - index - 1, truncate))
        .collect();
    json(Value::Array(items))
}

fn peeked_message(message: &m::PeekedMessage, remaining: usize, truncate: Option<u64>) -> Value {
    let mut body: &[u8] = &message.body;
    if let Some(limit) = truncate {
        body = &body[..body.len().min(limit as usize)];
    }
    let (payload, encoding) = match std::str::from_utf8(body) {
        Ok(text) => (text.to_string(), "string"),
        Err(_) => {
            use base64::Engine as _;
            (
                base64::engine::general_purpose::STANDARD.encode(body),
                "base64",
            )
        }
    };
    let mut properties = serde_json::Map::new();
    properties.insert(
        "delivery_mode".into(),
        json!(if message.persistent { 2 } else { 1 }),
    );
    for (key, value) in [
        ("content_type", &message.content_type),
        ("content_encoding", &message.content_encoding),
        ("message_id", &message.message_id),
        ("correlation_id", &message.correlation_id),
    ] {
        if !value.is_empty() {
            properties.insert(key.into(), json!(value));
        }
    }
    if !message.headers.is_empty() {
        properties.insert("headers".into(), shapes::arguments(&message.headers));
    }
    json!({
        "payload_bytes": message.body_size,
        "redelivered": message.redelivered,
        "exchange": message.exchange,
        "routing_key": message.routing_key,
        "message_count": remaining,
        "properties": properties,
        "payload": payload,
        "payload_encoding": encoding,
    })
}

/// The body of a move: the destination queue (same vhost) and how many
/// ready messages at most (absent or 0: all of them).
#[derive(Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
struct MoveOrder {
    destination: String,
    #[serde(default)]
    count: Option<u64>,
}

impl MoveOrder {
    fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        let order: MoveOrder = serde_json::from_slice(bytes).map_err(|error| {
            ApiError::bad_request(format!(
                "the body must be {{\"destination\": QUEUE, \"count\": N}}: {error}"
            ))
        })?;
        if order.destination.is_empty() {
            return Err(ApiError::bad_request("'destination' must name a queue"));
        }
        Ok(order)
    }
}

/// `POST /api/queues/{vhost}/{name}/move`: moves ready messages, from the
/// head, to another queue of the vhost through the gRPC `MoveMessages`
/// with the caller attached, so its checks apply (read on the source,
/// write on the destination). Answers `{"moved", "remaining",
/// "stopped_reason"}`.
async fn move_messages(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, source)): Path<(String, String)>,
    bytes: Bytes,
) -> Result<Response, ApiError> {
    let order = MoveOrder::parse(&bytes)?;
    let request = m::MoveMessagesRequest {
        vhost,
        source,
        destination: order.destination,
        max_messages: order.count.unwrap_or(0),
    };
    let answer = api.service.move_messages(&caller, request).await?;
    Ok(Json(json!({
        "moved": answer.moved,
        "remaining": answer.remaining,
        "stopped_reason": answer.stopped_reason,
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_names_its_destination() {
        let order = MoveOrder::parse(br#"{"destination": "b", "count": 5}"#).unwrap();
        assert_eq!(
            order,
            MoveOrder {
                destination: "b".into(),
                count: Some(5)
            }
        );
        assert_eq!(
            MoveOrder::parse(br#"{"destination": "b"}"#).unwrap().count,
            None
        );
        for bad in [
            &br#"{"destination": ""}"#[..],
            br#"{"count": 1}"#,
            br#"{"destination": "b", "count": -1}"#,
            br#"{"destination": "b", "max": 1}"#,
            b"[]",
            b"not json",
        ] {
            assert!(
                MoveOrder::parse(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
