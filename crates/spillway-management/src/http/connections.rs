//! `/api/connections`, `/api/channels` and `/api/consumers`.

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::routing::get;
use axum::Router;
use serde_json::Value;
use spillway_proto::management as m;

use super::common::{json, list, no_content, Answer, Api, Who};
use super::pages::ListQuery;
use super::shapes;
use super::{ApiError, HttpApi};
use crate::auth::Caller;

/// Its endpoints.
pub(super) fn routes() -> Router<Api> {
    Router::new()
        .route("/api/vhosts/{vhost}/connections", get(vhost_connections))
        .route("/api/vhosts/{vhost}/channels", get(vhost_channels))
        .route("/api/connections", get(all_connections))
        .route(
            "/api/connections/{name}",
            get(get_connection).delete(close_connection),
        )
        .route("/api/connections/{name}/channels", get(connection_channels))
        .route("/api/connections/{name}/sessions", get(connection_sessions))
        .route("/api/channels", get(all_channels))
        .route("/api/consumers", get(all_consumers))
        .route("/api/consumers/{vhost}", get(vhost_consumers))
}

async fn connections(
    api: &HttpApi,
    caller: &Caller,
    vhost: String,
) -> Result<Vec<m::Connection>, ApiError> {
    let list = api
        .service
        .list_connections(caller, m::ListConnectionsRequest { vhost })
        .await?;
    Ok(list.connections)
}

async fn all_connections(
    State(api): State<Api>,
    Who(caller): Who,
    Query(query): Query<ListQuery>,
) -> Answer {
    let items = connections(&api, &caller, String::new())
        .await?
        .iter()
        .map(|connection| shapes::connection(connection, &api.node))
        .collect();
    list(items, &query)
}

async fn vhost_connections(
    State(api): State<Api>,
    Who(caller): Who,
    Path(vhost): Path<String>,
) -> Answer {
    let items = connections(&api, &caller, vhost)
        .await?
        .iter()
        .map(|connection| shapes::connection(connection, &api.node))
        .collect();
    json(Value::Array(items))
}

async fn named_connection(
    api: &HttpApi,
    caller: &Caller,
    name: &str,
) -> Result<m::Connection, ApiError> {
    let id = shapes::connection_id(name).ok_or_else(ApiError::not_found)?;
    connections(api, caller, String::new())
        .await?
        .into_iter()
        .find(|connection| connection.id == id)
        .ok_or_else(ApiError::not_found)
}

async fn get_connection(
    State(api): State<Api>,
    Who(caller): Who,
    Path(name): Path<String>,
) -> Answer {
    let connection = named_connection(&api, &caller, &name).await?;
    json(shapes::connection(&connection, &api.node))
}

async fn close_connection(
    State(api): State<Api>,
    Who(caller): Who,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Answer {
    let connection = named_connection(&api, &caller, &name).await?;
    // RabbitMQ takes the reason from the X-Reason header.
    let reason = headers
        .get("x-reason")
        .and_then(|value| value.to_str().ok())
        .unwrap_or("Closed via management plugin")
        .chars()
        .take(255)
        .collect();
    api.service
        .close_connection(
            &caller,
            m::CloseConnectionRequest {
                id: connection.id,
                reason,
            },
        )
        .await?;
    no_content()
}

async fn channels(
    api: &HttpApi,
    caller: &Caller,
    vhost: String,
    connection_id: u64,
) -> Result<Vec<Value>, ApiError> {
    let list = api
        .service
        .list_channels(
            caller,
            m::ListChannelsRequest {
                vhost,
                connection_id,
            },
        )
        .await?;
    Ok(list
        .channels
        .iter()
        .map(|channel| shapes::channel(channel, &api.node))
        .collect())
}

async fn all_channels(
    State(api): State<Api>,
    Who(caller): Who,
    Query(query): Query<ListQuery>,
) -> Answer {
    list(channels(&api, &caller, String::new(), 0).await?, &query)
}

async fn vhost_channels(
    State(api): State<Api>,
    Who(caller): Who,
    Path(vhost): Path<String>,
) -> Answer {
    json(Value::Array(channels(&api, &caller, vhost, 0).await?))
}

async fn connection_channels(
    State(api): State<Api>,
    Who(caller): Who,
    Path(name): Path<String>,
) -> Answer {
    let connection = named_connection(&api, &caller, &name).await?;
    json(Value::Array(
        channels(&api, &caller, String::new(), connection.id).await?,
    ))
}

/// An AMQP 1.0 connection's sessions and links (RabbitMQ 4's endpoint);
/// a 0-9-1 connection has none: 400, as RabbitMQ answers.
async fn connection_sessions(
    State(api): State<Api>,
    Who(caller): Who,
    Path(name): Path<String>,
) -> Answer {
    let connection = named_connection(&api, &caller, &name).await?;
    if shapes::protocol(&connection) != "AMQP 1.0" {
        return Err(ApiError::bad_request(format!(
            "connection '{name}' is not an AMQP 1.0 connection"
        )));
    }
    let list = api
        .service
        .list_channels(
            &caller,
            m::ListChannelsRequest {
                vhost: String::new(),
                connection_id: connection.id,
            },
        )
        .await?;
    json(shapes::amqp1_sessions(&list.channels))
}

async fn all_consumers(
    State(api): State<Api>,
    Who(caller): Who,
    Query(query): Query<ListQuery>,
) -> Answer {
    consumer_list(&api, &caller, String::new(), &query).await
}

async fn vhost_consumers(
    State(api): State<Api>,
    Who(caller): Who,
    Path(vhost): Path<String>,
    Query(query): Query<ListQuery>,
) -> Answer {
    consumer_list(&api, &caller, vhost, &query).await
}

async fn consumer_list(api: &HttpApi, caller: &Caller, vhost: String, query: &ListQuery) -> Answer {
    // The engine reads every queue of the vhost (or of all) for them.
    let _slot = api.list_slot().await?;
    let listed = api
        .service
        .list_consumers(caller, m::ListConsumersRequest { vhost })
        .await?;
    let items = listed
        .consumers
        .iter()
        .map(|consumer| shapes::consumer(consumer, &api.node))
        .collect();
    list(items, query)
}
