//! What every endpoint shares: the caller of a request ([`Who`]), the
//! gRPC call made as that caller, and RabbitMQ's ways of answering (201 for
//! a creation, 204 for a change, lists paged and filtered).

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use spillway_proto::management as m;

use super::pages::{self, ListQuery};
use super::shapes::{self, DEFAULT_EXCHANGE_URL_NAME};
use super::{ApiError, HttpApi};
use crate::auth::Caller;

pub(super) type Api = Arc<HttpApi>;

pub(super) type Answer = Result<Response, ApiError>;

/// The authenticated caller of a request.
pub(super) struct Who(pub Caller);

impl FromRequestParts<Api> for Who {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, api: &Api) -> Result<Self, ApiError> {
        super::caller_of(api, parts).await.map(Who)
    }
}

pub(super) fn json(value: Value) -> Answer {
    Ok(Json(value).into_response())
}

pub(super) fn list(items: Vec<Value>, query: &ListQuery) -> Answer {
    json(pages::answer(items, query)?)
}

pub(super) fn created(was_there: bool) -> Answer {
    Ok(if was_there {
        StatusCode::NO_CONTENT
    } else {
        StatusCode::CREATED
    }
    .into_response())
}

pub(super) fn no_content() -> Answer {
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A request body as JSON; an empty one is `{}`.
pub(super) fn body(bytes: &Bytes) -> Result<Value, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|error| ApiError::bad_request(format!("the body is not JSON: {error}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    Ok(value)
}

pub(super) fn text<'a>(body: &'a Value, key: &str) -> Result<Option<&'a str>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text)),
        Some(_) => Err(ApiError::bad_request(format!("'{key}' must be a string"))),
    }
}

pub(super) fn flag(body: &Value, key: &str, default: bool) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(flag)) => Ok(*flag),
        // rabbitmqadmin sends "true"/"false" as text.
        Some(Value::String(text)) if text == "true" => Ok(true),
        Some(Value::String(text)) if text == "false" => Ok(false),
        Some(_) => Err(ApiError::bad_request(format!("'{key}' must be a boolean"))),
    }
}

pub(super) fn arguments(body: &Value) -> Result<HashMap<String, m::ArgumentValue>, ApiError> {
    shapes::arguments_from(body.get("arguments")).map_err(ApiError::bad_request)
}

/// The exchange a URL names (`amq.default` is the default exchange).
pub(super) fn exchange_name(name: String) -> String {
    if name == DEFAULT_EXCHANGE_URL_NAME {
        String::new()
    } else {
        name
    }
}

/// The vhosts the caller sees.
pub(super) async fn visible_vhosts(
    api: &HttpApi,
    caller: &Caller,
) -> Result<Vec<m::Vhost>, ApiError> {
    let list = api
        .service
        .list_vhosts(caller, m::ListVhostsRequest {})
        .await?;
    Ok(list.vhosts)
}

/// A DELETE's conditions, as RabbitMQ's `?if-unused=true&if-empty=true`.
#[derive(Debug, Default, Deserialize)]
pub(super) struct DeleteQuery {
    #[serde(rename = "if-unused")]
    pub(super) if_unused: Option<String>,
    #[serde(rename = "if-empty")]
    pub(super) if_empty: Option<String>,
}
