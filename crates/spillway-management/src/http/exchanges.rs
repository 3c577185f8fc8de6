//! `/api/exchanges`: exchanges declared, listed, deleted, and published to.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use spillway_proto::management as m;

use super::common::{
    arguments, body, created, exchange_name, flag, json, list, no_content, text, visible_vhosts,
    Answer, Api, DeleteQuery, Who,
};
use super::pages::ListQuery;
use super::shapes;
use super::{ApiError, HttpApi};
use crate::auth::Caller;

/// Its endpoints.
pub(super) fn routes() -> Router<Api> {
    Router::new()
        .route("/api/exchanges", get(all_exchanges))
        .route("/api/exchanges/{vhost}", get(vhost_exchanges))
        .route(
            "/api/exchanges/{vhost}/{name}",
            get(get_exchange).put(put_exchange).delete(delete_exchange),
        )
        .route("/api/exchanges/{vhost}/{name}/publish", post(publish))
}

/// The exchange types a declaration may name.
pub(super) const EXCHANGE_TYPES: [&str; 5] =
    ["direct", "fanout", "topic", "headers", "x-delayed-message"];
async fn exchanges_of(
    api: &HttpApi,
    caller: &Caller,
    vhost: String,
) -> Result<Vec<Value>, ApiError> {
    let list = api
        .service
        .list_exchanges(caller, m::ListExchangesRequest { vhost })
        .await?;
    Ok(list.exchanges.iter().map(shapes::exchange).collect())
}

async fn all_exchanges(
    State(api): State<Api>,
    Who(caller): Who,
    Query(query): Query<ListQuery>,
) -> Answer {
    let mut items = Vec::new();
    for vhost in visible_vhosts(&api, &caller).await? {
        items.extend(exchanges_of(&api, &caller, vhost.name).await?);
    }
    list(items, &query)
}

async fn vhost_exchanges(
    State(api): State<Api>,
    Who(caller): Who,
    Path(vhost): Path<String>,
    Query(query): Query<ListQuery>,
) -> Answer {
    list(exchanges_of(&api, &caller, vhost).await?, &query)
}

async fn get_exchange(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    let name = exchange_name(name);
    let exchange = api
        .service
        .get_exchange(&caller, m::GetExchangeRequest { vhost, name })
        .await?;
    json(shapes::exchange(&exchange))
}

async fn put_exchange(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
    bytes: Bytes,
) -> Answer {
    let body = body(&bytes)?;
    let kind = text(&body, "type")?
        .ok_or_else(|| ApiError::bad_request("'type' is required"))?
        .to_string();
    let name = exchange_name(name);
    let was_there = api
        .service
        .get_exchange(
            &caller,
            m::GetExchangeRequest {
                vhost: vhost.clone(),
                name: name.clone(),
            },
        )
        .await
        .is_ok();
    let request = m::CreateExchangeRequest {
        vhost,
        name,
        kind,
        durable: flag(&body, "durable", true)?,
        auto_delete: flag(&body, "auto_delete", false)?,
        internal: flag(&body, "internal", false)?,
        arguments: arguments(&body)?,
    };
    api.service.create_exchange(&caller, request).await?;
    created(was_there)
}

async fn delete_exchange(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
    Query(query): Query<DeleteQuery>,
) -> Answer {
    let request = m::DeleteExchangeRequest {
        vhost,
        name: exchange_name(name),
        if_unused: query.if_unused.as_deref() == Some("true"),
    };
    api.service.delete_exchange(&caller, request).await?;
    no_content()
}

/// `POST /api/exchanges/{vhost}/{name}/publish`: `routing_key`, `payload`
/// with `payload_encoding` `string` or `base64`, `properties` as RabbitMQ
/// takes them; answers `{"routed": bool}` once the message is routed (and
/// written, when persistent).
async fn publish(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
    bytes: Bytes,
) -> Answer {
    let body = body(&bytes)?;
    let routing_key = text(&body, "routing_key")?
        .ok_or_else(|| ApiError::bad_request("'routing_key' is required"))?
        .to_string();
    let payload =
        text(&body, "payload")?.ok_or_else(|| ApiError::bad_request("'payload' is required"))?;
    let payload = match text(&body, "payload_encoding")?.unwrap_or("string") {
        "string" => payload.as_bytes().to_vec(),
        "base64" => {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD
                .decode(payload)
                .map_err(|error| ApiError::bad_request(format!("payload is not base64: {error}")))?
        }
        other => {
            return Err(ApiError::bad_request(format!(
                "payload_encoding '{other}' is neither string nor base64"
            )))
        }
    };
    let properties =
        shapes::message_properties(body.get("properties")).map_err(ApiError::bad_request)?;
    // As over AMQP: a message may only claim its publisher's name.
    if !properties.user_id.is_empty() && properties.user_id != caller.name() {
        return Err(ApiError::bad_request(format!(
            "user_id property set to '{}' but authenticated user was '{}'",
            properties.user_id,
            caller.name()
        )));
    }
    let request = m::PublishMessageRequest {
        vhost,
        exchange: exchange_name(name),
        routing_key,
        properties: Some(properties),
        body: payload.into(),
    };
    let answer = api.service.publish_message(&caller, request).await?;
    json(json!({"routed": answer.routed}))
}
