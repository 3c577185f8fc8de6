//! `/api/bindings` and the bindings of an exchange or a queue.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use serde_json::Value;
use spillway_proto::management as m;

use super::common::{
    arguments, body, exchange_name, json, list, no_content, text, visible_vhosts, Answer, Api, Who,
};
use super::pages::ListQuery;
use super::shapes;
use super::{ApiError, HttpApi};
use crate::auth::Caller;

/// Its endpoints.
pub(super) fn routes() -> Router<Api> {
    Router::new()
        .route(
            "/api/exchanges/{vhost}/{name}/bindings/source",
            get(exchange_bindings_as_source),
        )
        .route(
            "/api/exchanges/{vhost}/{name}/bindings/destination",
            get(exchange_bindings_as_destination),
        )
        .route("/api/queues/{vhost}/{name}/bindings", get(queue_bindings))
        .route("/api/bindings", get(all_bindings))
        .route("/api/bindings/{vhost}", get(vhost_bindings))
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}",
            get(bindings_between).post(create_binding),
        )
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}/{props}",
            get(get_binding).delete(delete_binding),
        )
}

async fn bindings(
    api: &HttpApi,
    caller: &Caller,
    vhost: String,
    source: String,
    destination: String,
) -> Result<Vec<m::Binding>, ApiError> {
    let list = api
        .service
        .list_bindings(
            caller,
            m::ListBindingsRequest {
                vhost,
                source,
                destination,
            },
        )
        .await?;
    Ok(list.bindings)
}

fn binding_list(bindings: &[m::Binding]) -> Answer {
    json(Value::Array(bindings.iter().map(shapes::binding).collect()))
}

async fn all_bindings(
    State(api): State<Api>,
    Who(caller): Who,
    Query(query): Query<ListQuery>,
) -> Answer {
    // Every binding of every vhost: a list like the queues'.
    let _slot = api.list_slot().await?;
    let mut items = Vec::new();
    for vhost in visible_vhosts(&api, &caller).await? {
        let found = bindings(&api, &caller, vhost.name, String::new(), String::new()).await?;
        items.extend(found.iter().map(shapes::binding));
    }
    list(items, &query)
}

async fn vhost_bindings(
    State(api): State<Api>,
    Who(caller): Who,
    Path(vhost): Path<String>,
    Query(query): Query<ListQuery>,
) -> Answer {
    let _slot = api.list_slot().await?;
    let found = bindings(&api, &caller, vhost, String::new(), String::new()).await?;
    list(found.iter().map(shapes::binding).collect(), &query)
}

async fn exchange_bindings_as_source(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    let found = bindings(&api, &caller, vhost, exchange_name(name), String::new()).await?;
    binding_list(&found)
}

async fn exchange_bindings_as_destination(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    let mut found = bindings(&api, &caller, vhost, String::new(), name).await?;
    found.retain(|binding| binding.destination_is_exchange);
    binding_list(&found)
}

async fn queue_bindings(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    let mut found = bindings(&api, &caller, vhost, String::new(), name).await?;
    found.retain(|binding| !binding.destination_is_exchange);
    binding_list(&found)
}

/// `q` or `e` in a binding URL.
fn destination_is_exchange(kind: &str) -> Result<bool, ApiError> {
    match kind {
        "q" => Ok(false),
        "e" => Ok(true),
        _ => Err(ApiError::not_found()),
    }
}

async fn between(
    api: &HttpApi,
    caller: &Caller,
    (vhost, source, kind, destination): (String, String, String, String),
) -> Result<Vec<m::Binding>, ApiError> {
    let to_exchange = destination_is_exchange(&kind)?;
    let mut found = bindings(api, caller, vhost, exchange_name(source), destination).await?;
    found.retain(|binding| binding.destination_is_exchange == to_exchange);
    Ok(found)
}

async fn bindings_between(
    State(api): State<Api>,
    Who(caller): Who,
    Path(path): Path<(String, String, String, String)>,
) -> Answer {
    binding_list(&between(&api, &caller, path).await?)
}

async fn create_binding(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, source, kind, destination)): Path<(String, String, String, String)>,
    bytes: Bytes,
) -> Answer {
    let body = body(&bytes)?;
    let binding = m::Binding {
        vhost,
        source: exchange_name(source),
        destination,
        destination_is_exchange: destination_is_exchange(&kind)?,
        routing_key: text(&body, "routing_key")?.unwrap_or("").to_string(),
        arguments: arguments(&body)?,
    };
    // Relative, as RabbitMQ's: the destination and the properties key.
    let location = format!(
        "{}/{}",
        shapes::quote(&binding.destination),
        shapes::quote(&shapes::properties_key(
            &binding.routing_key,
            &binding.arguments
        ))
    );
    api.service
        .create_binding(
            &caller,
            m::CreateBindingRequest {
                binding: Some(binding),
            },
        )
        .await?;
    let mut headers = HeaderMap::new();
    if let Ok(value) = location.parse() {
        headers.insert("location", value);
    }
    Ok((StatusCode::CREATED, headers).into_response())
}

async fn find_binding(
    api: &HttpApi,
    caller: &Caller,
    (vhost, source, kind, destination, props): (String, String, String, String, String),
) -> Result<m::Binding, ApiError> {
    between(api, caller, (vhost, source, kind, destination))
        .await?
        .into_iter()
        .find(|binding| shapes::properties_key(&binding.routing_key, &binding.arguments) == props)
        .ok_or_else(ApiError::not_found)
}

async fn get_binding(
    State(api): State<Api>,
    Who(caller): Who,
    Path(path): Path<(String, String, String, String, String)>,
) -> Answer {
    json(shapes::binding(&find_binding(&api, &caller, path).await?))
}

async fn delete_binding(
    State(api): State<Api>,
    Who(caller): Who,
    Path(path): Path<(String, String, String, String, String)>,
) -> Answer {
    let binding = find_binding(&api, &caller, path).await?;
    api.service
        .delete_binding(
            &caller,
            m::DeleteBindingRequest {
                binding: Some(binding),
            },
        )
        .await?;
    no_content()
}
