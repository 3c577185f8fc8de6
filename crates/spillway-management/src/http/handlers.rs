//! The endpoints: each reads RabbitMQ's URL and JSON body, calls the
//! management service's gRPC method as the caller, and answers in
//! RabbitMQ's shapes. Creation answers 201, a change of what exists 204,
//! as RabbitMQ does.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use spillway_proto::management::management_server::Management;
use spillway_proto::management::{self as m};
use tonic::Status;

use super::definitions;
use super::pages::{self, ListQuery};
use super::shapes::{self, DEFAULT_EXCHANGE_URL_NAME};
use super::{ApiError, HttpApi};
use crate::auth::Caller;
use crate::authorize::{authorize, Need};

pub(super) type Api = Arc<HttpApi>;
pub(super) type Answer = Result<Response, ApiError>;

/// The version of RabbitMQ's API these endpoints follow, reported as
/// `rabbitmq_version` for tools that check it.
const RABBITMQ_API_VERSION: &str = "3.10.0";

/// The exchange types a declaration may name.
const EXCHANGE_TYPES: [&str; 5] = ["direct", "fanout", "topic", "headers", "x-delayed-message"];

pub(super) fn router(api: Api) -> Router {
    Router::new()
        .route("/api/overview", get(overview))
        .route(
            "/api/definitions",
            get(definitions::export_all)
                .post(definitions::import_all)
                .layer(DefaultBodyLimit::max(
                    definitions::MAX_DEFINITIONS_BODY_BYTES,
                )),
        )
        .route(
            "/api/definitions/{vhost}",
            get(definitions::export_vhost)
                .post(definitions::import_vhost)
                .layer(DefaultBodyLimit::max(
                    definitions::MAX_DEFINITIONS_BODY_BYTES,
                )),
        )
        .route("/api/whoami", get(whoami))
        .route("/api/nodes", get(nodes))
        .route("/api/nodes/{node}", get(node))
        .route("/api/aliveness-test/{vhost}", get(aliveness_test))
        .route("/api/health/checks/alarms", get(alarms))
        .route("/api/health/checks/local-alarms", get(alarms))
        .route("/api/vhosts", get(list_vhosts))
        .route(
            "/api/vhosts/{vhost}",
            get(get_vhost).put(put_vhost).delete(delete_vhost),
        )
        .route("/api/vhosts/{vhost}/permissions", get(vhost_permissions))
        .route("/api/vhosts/{vhost}/connections", get(vhost_connections))
        .route("/api/vhosts/{vhost}/channels", get(vhost_channels))
        .route("/api/users", get(list_users))
        .route(
            "/api/users/{user}",
            get(get_user).put(put_user).delete(delete_user),
        )
        .route("/api/users/{user}/permissions", get(user_permissions))
        .route("/api/permissions", get(list_permissions))
        .route(
            "/api/permissions/{vhost}/{user}",
            get(get_permission)
                .put(put_permission)
                .delete(delete_permission),
        )
        .route("/api/policies", get(all_policies::<false>))
        .route("/api/policies/{vhost}", get(vhost_policies::<false>))
        .route(
            "/api/policies/{vhost}/{name}",
            get(get_policy::<false>)
                .put(put_policy::<false>)
                .delete(delete_policy::<false>),
        )
        .route("/api/operator-policies", get(all_policies::<true>))
        .route(
            "/api/operator-policies/{vhost}",
            get(vhost_policies::<true>),
        )
        .route(
            "/api/operator-policies/{vhost}/{name}",
            get(get_policy::<true>)
                .put(put_policy::<true>)
                .delete(delete_policy::<true>),
        )
        .route("/api/exchanges", get(all_exchanges))
        .route("/api/exchanges/{vhost}", get(vhost_exchanges))
        .route(
            "/api/exchanges/{vhost}/{name}",
            get(get_exchange).put(put_exchange).delete(delete_exchange),
        )
        .route("/api/exchanges/{vhost}/{name}/publish", post(publish))
        .route(
            "/api/exchanges/{vhost}/{name}/bindings/source",
            get(exchange_bindings_as_source),
        )
        .route(
            "/api/exchanges/{vhost}/{name}/bindings/destination",
            get(exchange_bindings_as_destination),
        )
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
        .route("/api/queues/{vhost}/{name}/bindings", get(queue_bindings))
        .route("/api/queues/{vhost}/{name}/get", post(get_messages))
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
        .with_state(api)
}

/// The authenticated caller of a request.
pub(super) struct Who(pub Caller);

impl FromRequestParts<Api> for Who {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, api: &Api) -> Result<Self, ApiError> {
        super::caller_of(api, parts).await.map(Who)
    }
}

/// A gRPC request of `caller`, as the authenticating service makes it.
pub(super) fn call<T>(caller: &Caller, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.extensions_mut().insert(caller.clone());
    request
}

/// The answer of one gRPC method.
pub(super) async fn ask<T, F>(future: F) -> Result<T, ApiError>
where
    F: Future<Output = Result<tonic::Response<T>, Status>>,
{
    Ok(future.await?.into_inner())
}

/// A vhost in RabbitMQ's shape, with its message totals (none when it
/// went meanwhile) and its rates once sampled.
fn vhost_json(
    api: &HttpApi,
    vhost: &m::Vhost,
    totals: Option<&spillway_proto::engine::VhostMessageTotals>,
) -> Value {
    let (ready, unacked) = totals.map_or((0, 0), |t| (t.messages_ready, t.messages_unacked));
    let mut value = shapes::vhost(vhost, ready, unacked);
    if let Some(stats) = api.rates.vhost_stats(&vhost.name) {
        value["message_stats"] = stats;
    }
    value
}

/// A queue in RabbitMQ's shape, with its rates once sampled.
fn queue_json(api: &HttpApi, queue: &m::Queue) -> Value {
    let mut value = shapes::queue(queue, &api.node);
    for (key, field) in api.rates.queue_fields(&queue.vhost, &queue.name) {
        value[key] = field;
    }
    value
}

fn json(value: Value) -> Answer {
    Ok(Json(value).into_response())
}

fn list(items: Vec<Value>, query: &ListQuery) -> Answer {
    json(pages::answer(items, query)?)
}

fn created(was_there: bool) -> Answer {
    Ok(if was_there {
        StatusCode::NO_CONTENT
    } else {
        StatusCode::CREATED
    }
    .into_response())
}

fn no_content() -> Answer {
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A request body as JSON; an empty one is `{}`.
fn body(bytes: &Bytes) -> Result<Value, ApiError> {
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

fn text<'a>(body: &'a Value, key: &str) -> Result<Option<&'a str>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text)),
        Some(_) => Err(ApiError::bad_request(format!("'{key}' must be a string"))),
    }
}

fn flag(body: &Value, key: &str, default: bool) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(flag)) => Ok(*flag),
        // rabbitmqadmin sends "true"/"false" as text.
        Some(Value::String(text)) if text == "true" => Ok(true),
        Some(Value::String(text)) if text == "false" => Ok(false),
        Some(_) => Err(ApiError::bad_request(format!("'{key}' must be a boolean"))),
    }
}

fn arguments(body: &Value) -> Result<HashMap<String, m::ArgumentValue>, ApiError> {
    shapes::arguments_from(body.get("arguments")).map_err(ApiError::bad_request)
}

/// The exchange a URL names (`amq.default` is the default exchange).
fn exchange_name(name: String) -> String {
    if name == DEFAULT_EXCHANGE_URL_NAME {
        String::new()
    } else {
        name
    }
}

/// The vhosts the caller sees.
async fn visible_vhosts(api: &HttpApi, caller: &Caller) -> Result<Vec<m::Vhost>, ApiError> {
    let list = ask(api
        .service
        .list_vhosts(call(caller, m::ListVhostsRequest {})))
    .await?;
    Ok(list.vhosts)
}

// ---------------------------------------------------------------- overview

/// The broker's figures; a caller without `monitoring` gets the totals of
/// its vhosts only (the gRPC `GetBrokerStatus` counts them, reading their
/// queues: hence the list slot).
async fn overview(State(api): State<Api>, Who(caller): Who) -> Answer {
    // Its totals read every queue (all of them, or the caller's vhosts').
    let _slot = api.list_slot().await?;
    let status = ask(api
        .service
        .get_broker_status(call(&caller, m::GetBrokerStatusRequest {})))
    .await?;
    let vhosts = visible_vhosts(&api, &caller).await?;
    let exchanges: u32 = vhosts.iter().map(|vhost| vhost.exchanges).sum();
    let names: Vec<&str> = vhosts.iter().map(|vhost| vhost.name.as_str()).collect();
    let message_stats = api.rates.overview_stats(&names);
    let listeners: Vec<Value> = api
        .listeners
        .iter()
        .map(|(protocol, addr)| {
            json!({
                "node": api.node,
                "protocol": protocol,
                "ip_address": addr.ip().to_string(),
                "port": addr.port(),
            })
        })
        .collect();
    let exchange_types: Vec<Value> = EXCHANGE_TYPES
        .iter()
        .map(|name| json!({"name": name, "enabled": true}))
        .collect();
    json(json!({
        "management_version": RABBITMQ_API_VERSION,
        "rabbitmq_version": RABBITMQ_API_VERSION,
        "product_name": "Spillway",
        "product_version": status.version,
        "cluster_name": api.node,
        "node": api.node,
        "rates_mode": "basic",
        "message_stats": message_stats,
        "exchange_types": exchange_types,
        "queue_totals": {
            "messages": status.messages_ready + status.messages_unacked,
            "messages_ready": status.messages_ready,
            "messages_unacknowledged": status.messages_unacked,
        },
        "object_totals": {
            "channels": status.channels,
            "connections": status.connections,
            "consumers": status.consumers,
            "exchanges": exchanges,
            "queues": status.queues,
        },
        "listeners": listeners,
        // Spillway's own: flow to disk and the store.
        "flow_to_disk": {
            "threshold_bytes": status.flow_to_disk_threshold,
            "active": status.flow_to_disk_active,
            "resident_message_bytes": status.resident_message_bytes,
            "spilled_messages": status.spilled_messages,
            "spilled_bytes": status.spilled_bytes,
        },
        "store": {
            "disk_bytes": status.store_disk_bytes,
            "quota_bytes": status.store_quota_bytes,
            "overfull": status.store_overfull,
        },
    }))
}

async fn whoami(State(_api): State<Api>, Who(caller): Who) -> Answer {
    authorize(&caller, &[Need::Overview])?;
    let tags: Vec<String> = match &caller {
        Caller::Operator { .. } => vec!["administrator".into()],
        Caller::User(user) => user.tags.clone(),
    };
    json(json!({"name": caller.name(), "tags": tags}))
}

async fn node_view(api: &HttpApi, caller: &Caller) -> Result<Value, ApiError> {
    // The broker's status reads every queue.
    let _slot = api.list_slot().await?;
    let status = ask(api
        .service
        .get_broker_status(call(caller, m::GetBrokerStatusRequest {})))
    .await?;
    Ok(json!({
        "name": api.node,
        "type": "disc",
        "running": true,
        "disk_free_alarm": status.store_overfull,
        "applications": [{"name": "spillway", "version": status.version}],
    }))
}

/// Nodes are the monitoring user's, as in RabbitMQ.
async fn nodes(State(api): State<Api>, Who(caller): Who) -> Answer {
    authorize(&caller, &[Need::Monitoring])?;
    json(json!([node_view(&api, &caller).await?]))
}

async fn node(State(api): State<Api>, Who(caller): Who, Path(name): Path<String>) -> Answer {
    authorize(&caller, &[Need::Monitoring])?;
    if name != api.node {
        return Err(ApiError::not_found());
    }
    json(node_view(&api, &caller).await?)
}

/// The vhost exists and the engine answers for it: one lookup under the
/// engine's lock, none of its queues read.
async fn aliveness_test(
    State(api): State<Api>,
    Who(caller): Who,
    Path(vhost): Path<String>,
) -> Answer {
    ask(api
        .service
        .get_vhost(call(&caller, m::GetVhostRequest { name: vhost })))
    .await?;
    json(json!({"status": "ok"}))
}

/// The store's disk quota is Spillway's resource alarm: while it is
/// reached, publishers are blocked, as under RabbitMQ's disk alarm.
async fn alarms(State(api): State<Api>, Who(caller): Who) -> Answer {
    // The broker's status reads every queue.
    let _slot = api.list_slot().await?;
    let status = ask(api
        .service
        .get_broker_status(call(&caller, m::GetBrokerStatusRequest {})))
    .await?;
    if !status.store_overfull {
        return json(json!({"status": "ok"}));
    }
    let body = json!({
        "status": "failed",
        "reason": "resource alarm(s) in effect in the cluster",
        "alarms": [{"node": api.node, "resource": "disk"}],
    });
    Ok((StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response())
}

// ------------------------------------------------------------------ vhosts

async fn queues_of(api: &HttpApi, caller: &Caller, vhost: &str) -> Result<Vec<m::Queue>, ApiError> {
    let list = ask(api.service.list_queues(call(
        caller,
        m::ListQueuesRequest {
            vhost: vhost.to_string(),
        },
    )))
    .await?;
    Ok(list.queues)
}

/// Each vhost with its message totals: the engine sums every queue's, a
/// chunk at a time, under a list slot.
async fn list_vhosts(
    State(api): State<Api>,
    Who(caller): Who,
    Query(query): Query<ListQuery>,
) -> Answer {
    let vhosts = visible_vhosts(&api, &caller).await?;
    let totals = {
        let _slot = api.list_slot().await?;
        api.service.vhost_message_totals(&caller, None).await?
    };
    let items = vhosts
        .iter()
        .map(|vhost| {
            let totals = totals.iter().find(|t| t.vhost == vhost.name);
            vhost_json(&api, vhost, totals)
        })
        .collect();
    list(items, &query)
}

async fn get_vhost(State(api): State<Api>, Who(caller): Who, Path(name): Path<String>) -> Answer {
    let vhost = ask(api
        .service
        .get_vhost(call(&caller, m::GetVhostRequest { name })))
    .await?;
    let totals = {
        let _slot = api.list_slot().await?;
        api.service
            .vhost_message_totals(&caller, Some(&vhost.name))
            .await?
    };
    json(vhost_json(&api, &vhost, totals.first()))
}

/// As RabbitMQ's management plugin, the stored user who creates a vhost
/// gets every permission in it.
async fn put_vhost(State(api): State<Api>, Who(caller): Who, Path(name): Path<String>) -> Answer {
    authorize(&caller, &[Need::Administrator])?;
    let existing = m::GetVhostRequest { name: name.clone() };
    if ask(api.service.get_vhost(call(&caller, existing)))
        .await
        .is_ok()
    {
        return created(true);
    }
    let request = m::CreateVhostRequest { name: name.clone() };
    ask(api.service.create_vhost(call(&caller, request))).await?;
    if let Caller::User(user) = &caller {
        let grant = m::SetPermissionsRequest {
            user: user.name.clone(),
            vhost: name,
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        };
        ask(api.service.set_permissions(call(&caller, grant))).await?;
    }
    created(false)
}

async fn delete_vhost(
    State(api): State<Api>,
    Who(caller): Who,
    Path(name): Path<String>,
) -> Answer {
    ask(api
        .service
        .delete_vhost(call(&caller, m::DeleteVhostRequest { name })))
    .await?;
    no_content()
}

// ------------------------------------------------------- users, permissions

async fn users(api: &HttpApi, caller: &Caller) -> Result<Vec<m::User>, ApiError> {
    let list = ask(api.service.list_users(call(caller, m::ListUsersRequest {}))).await?;
    Ok(list.users)
}

async fn list_users(
    State(api): State<Api>,
    Who(caller): Who,
    Query(query): Query<ListQuery>,
) -> Answer {
    let items = users(&api, &caller)
        .await?
        .iter()
        .map(shapes::user)
        .collect();
    list(items, &query)
}

async fn get_user(State(api): State<Api>, Who(caller): Who, Path(name): Path<String>) -> Answer {
    let found = users(&api, &caller)
        .await?
        .into_iter()
        .find(|user| user.name == name)
        .ok_or_else(ApiError::not_found)?;
    json(shapes::user(&found))
}

/// RabbitMQ's tags: a comma-separated text, or (3.9+) a list.
fn tags(body: &Value) -> Result<Vec<String>, ApiError> {
    match body.get("tags") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(text)) => Ok(text
            .split(',')
            .map(str::trim)
            .filter(|tag| !tag.is_empty())
            .map(str::to_string)
            .collect()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                item.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::bad_request("'tags' must hold strings"))
            })
            .collect(),
        Some(_) => Err(ApiError::bad_request("'tags' must be a string or a list")),
    }
}

async fn put_user(
    State(api): State<Api>,
    Who(caller): Who,
    Path(name): Path<String>,
    bytes: Bytes,
) -> Answer {
    let body = body(&bytes)?;
    if body.get("password_hash").is_some() {
        return Err(ApiError::bad_request(
            "password_hash is not accepted yet: send password",
        ));
    }
    let password = text(&body, "password")?.map(str::to_string);
    let tags = tags(&body)?;
    let was_there = users(&api, &caller)
        .await?
        .iter()
        .any(|user| user.name == name);
    ask(api.service.put_user(call(
        &caller,
        m::PutUserRequest {
            name,
            password,
            tags,
            loopback_only: false,
        },
    )))
    .await?;
    created(was_there)
}

async fn delete_user(State(api): State<Api>, Who(caller): Who, Path(name): Path<String>) -> Answer {
    ask(api
        .service
        .delete_user(call(&caller, m::DeleteUserRequest { name })))
    .await?;
    no_content()
}

async fn permissions(
    api: &HttpApi,
    caller: &Caller,
    user: String,
    vhost: String,
) -> Result<Vec<m::Permission>, ApiError> {
    let list = ask(api
        .service
        .list_permissions(call(caller, m::ListPermissionsRequest { user, vhost })))
    .await?;
    Ok(list.permissions)
}

async fn list_permissions(
    State(api): State<Api>,
    Who(caller): Who,
    Query(query): Query<ListQuery>,
) -> Answer {
    let items = permissions(&api, &caller, String::new(), String::new())
        .await?
        .iter()
        .map(shapes::permission)
        .collect();
    list(items, &query)
}

async fn user_permissions(
    State(api): State<Api>,
    Who(caller): Who,
    Path(user): Path<String>,
) -> Answer {
    let items = permissions(&api, &caller, user, String::new())
        .await?
        .iter()
        .map(shapes::permission)
        .collect();
    json(Value::Array(items))
}

async fn vhost_permissions(
    State(api): State<Api>,
    Who(caller): Who,
    Path(vhost): Path<String>,
) -> Answer {
    let items = permissions(&api, &caller, String::new(), vhost)
        .await?
        .iter()
        .map(shapes::permission)
        .collect();
    json(Value::Array(items))
}

async fn get_permission(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, user)): Path<(String, String)>,
) -> Answer {
    let found = permissions(&api, &caller, user, vhost)
        .await?
        .into_iter()
        .next()
        .ok_or_else(ApiError::not_found)?;
    json(shapes::permission(&found))
}

async fn put_permission(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, user)): Path<(String, String)>,
    bytes: Bytes,
) -> Answer {
    let body = body(&bytes)?;
    let pattern = |key: &str| -> Result<String, ApiError> {
        text(&body, key)?
            .map(str::to_string)
            .ok_or_else(|| ApiError::bad_request(format!("'{key}' is required")))
    };
    let request = m::SetPermissionsRequest {
        configure: pattern("configure")?,
        write: pattern("write")?,
        read: pattern("read")?,
        user: user.clone(),
        vhost: vhost.clone(),
    };
    let was_there = !permissions(&api, &caller, user, vhost).await?.is_empty();
    ask(api.service.set_permissions(call(&caller, request))).await?;
    created(was_there)
}

async fn delete_permission(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, user)): Path<(String, String)>,
) -> Answer {
    if permissions(&api, &caller, user.clone(), vhost.clone())
        .await?
        .is_empty()
    {
        return Err(ApiError::not_found());
    }
    ask(api
        .service
        .clear_permissions(call(&caller, m::ClearPermissionsRequest { user, vhost })))
    .await?;
    no_content()
}

// ---------------------------------------------------------------- policies

async fn policies(
    api: &HttpApi,
    caller: &Caller,
    vhost: Option<String>,
    operator: bool,
) -> Result<Vec<Value>, ApiError> {
    // The tag first: without it the answer is 401, not an empty list.
    let tag = if operator {
        Need::Administrator
    } else {
        Need::Policymaker
    };
    authorize(caller, &[tag])?;
    let vhosts = match vhost {
        Some(vhost) => vec![vhost],
        None => visible_vhosts(api, caller)
            .await?
            .into_iter()
            .map(|vhost| vhost.name)
            .collect(),
    };
    let mut items = Vec::new();
    for vhost in vhosts {
        let list = ask(api
            .service
            .list_policies(call(caller, m::ListPoliciesRequest { vhost, operator })))
        .await?;
        items.extend(list.policies.iter().map(shapes::policy));
    }
    Ok(items)
}

async fn all_policies<const OPERATOR: bool>(State(api): State<Api>, Who(caller): Who) -> Answer {
    json(Value::Array(policies(&api, &caller, None, OPERATOR).await?))
}

async fn vhost_policies<const OPERATOR: bool>(
    State(api): State<Api>,
    Who(caller): Who,
    Path(vhost): Path<String>,
) -> Answer {
    json(Value::Array(
        policies(&api, &caller, Some(vhost), OPERATOR).await?,
    ))
}

async fn find_policy(
    api: &HttpApi,
    caller: &Caller,
    vhost: String,
    name: &str,
    operator: bool,
) -> Result<Option<Value>, ApiError> {
    Ok(policies(api, caller, Some(vhost), operator)
        .await?
        .into_iter()
        .find(|policy| policy["name"] == name))
}

async fn policy_answer(
    api: Api,
    caller: Caller,
    vhost: String,
    name: String,
    operator: bool,
) -> Answer {
    json(
        find_policy(&api, &caller, vhost, &name, operator)
            .await?
            .ok_or_else(ApiError::not_found)?,
    )
}

async fn set_policy(
    api: Api,
    caller: Caller,
    vhost: String,
    name: String,
    bytes: Bytes,
    operator: bool,
) -> Answer {
    let body = body(&bytes)?;
    let pattern = text(&body, "pattern")?
        .ok_or_else(|| ApiError::bad_request("'pattern' is required"))?
        .to_string();
    let definition = match body.get("definition") {
        Some(definition @ Value::Object(_)) => definition.to_string(),
        _ => return Err(ApiError::bad_request("'definition' must be a JSON object")),
    };
    let priority = match body.get("priority") {
        None | Some(Value::Null) => 0,
        Some(value) => value
            .as_i64()
            .and_then(|priority| i32::try_from(priority).ok())
            .ok_or_else(|| ApiError::bad_request("'priority' must be an integer"))?,
    };
    let apply_to = text(&body, "apply-to")?.unwrap_or("all").to_string();
    let was_there = find_policy(&api, &caller, vhost.clone(), &name, operator)
        .await?
        .is_some();
    let policy = m::Policy {
        vhost,
        name,
        pattern,
        apply_to,
        priority,
        definition,
        operator,
    };
    ask(api.service.set_policy(call(
        &caller,
        m::SetPolicyRequest {
            policy: Some(policy),
        },
    )))
    .await?;
    created(was_there)
}

async fn clear_policy(
    api: Api,
    caller: Caller,
    vhost: String,
    name: String,
    operator: bool,
) -> Answer {
    ask(api.service.clear_policy(call(
        &caller,
        m::ClearPolicyRequest {
            vhost,
            name,
            operator,
        },
    )))
    .await?;
    no_content()
}

/// `OPERATOR`: the operator policy of that name (`/api/operator-policies`).
async fn get_policy<const OPERATOR: bool>(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    policy_answer(api, caller, vhost, name, OPERATOR).await
}

async fn put_policy<const OPERATOR: bool>(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
    bytes: Bytes,
) -> Answer {
    set_policy(api, caller, vhost, name, bytes, OPERATOR).await
}

async fn delete_policy<const OPERATOR: bool>(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    clear_policy(api, caller, vhost, name, OPERATOR).await
}

// --------------------------------------------------------------- exchanges

async fn exchanges_of(
    api: &HttpApi,
    caller: &Caller,
    vhost: String,
) -> Result<Vec<Value>, ApiError> {
    let list = ask(api
        .service
        .list_exchanges(call(caller, m::ListExchangesRequest { vhost })))
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
    let exchange = ask(api
        .service
        .get_exchange(call(&caller, m::GetExchangeRequest { vhost, name })))
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
    let was_there = ask(api.service.get_exchange(call(
        &caller,
        m::GetExchangeRequest {
            vhost: vhost.clone(),
            name: name.clone(),
        },
    )))
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
    ask(api.service.create_exchange(call(&caller, request))).await?;
    created(was_there)
}

#[derive(Debug, Default, Deserialize)]
struct DeleteQuery {
    #[serde(rename = "if-unused")]
    if_unused: Option<String>,
    #[serde(rename = "if-empty")]
    if_empty: Option<String>,
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
    ask(api.service.delete_exchange(call(&caller, request))).await?;
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
    let answer = ask(api.service.publish_message(call(&caller, request))).await?;
    json(json!({"routed": answer.routed}))
}

// ------------------------------------------------------------------ queues

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
    let queue = ask(api
        .service
        .get_queue(call(&caller, m::GetQueueRequest { vhost, name })))
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
    let was_there = ask(api.service.get_queue(call(
        &caller,
        m::GetQueueRequest {
            vhost: vhost.clone(),
            name: name.clone(),
        },
    )))
    .await
    .is_ok();
    let request = m::CreateQueueRequest {
        vhost,
        name,
        durable: flag(&body, "durable", true)?,
        auto_delete: flag(&body, "auto_delete", false)?,
        arguments: arguments(&body)?,
    };
    ask(api.service.create_queue(call(&caller, request))).await?;
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
    ask(api.service.delete_queue(call(&caller, request))).await?;
    no_content()
}

async fn purge_queue(
    State(api): State<Api>,
    Who(caller): Who,
    Path((vhost, name)): Path<(String, String)>,
) -> Answer {
    ask(api
        .service
        .purge_queue(call(&caller, m::PurgeQueueRequest { vhost, name })))
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
            ask(api.service.peek_messages(call(&caller, request))).await?
        }
        Some(reject) => {
            let request = m::GetMessagesRequest {
                vhost,
                queue: name,
                count: count as u32,
                reject,
            };
            ask(api.service.get_messages(call(&caller, request))).await?
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

// ---------------------------------------------------------------- bindings

async fn bindings(
    api: &HttpApi,
    caller: &Caller,
    vhost: String,
    source: String,
    destination: String,
) -> Result<Vec<m::Binding>, ApiError> {
    let list = ask(api.service.list_bindings(call(
        caller,
        m::ListBindingsRequest {
            vhost,
            source,
            destination,
        },
    )))
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
    ask(api.service.create_binding(call(
        &caller,
        m::CreateBindingRequest {
            binding: Some(binding),
        },
    )))
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
    ask(api.service.delete_binding(call(
        &caller,
        m::DeleteBindingRequest {
            binding: Some(binding),
        },
    )))
    .await?;
    no_content()
}

// ---------------------------------------------------- connections, channels

async fn connections(
    api: &HttpApi,
    caller: &Caller,
    vhost: String,
) -> Result<Vec<m::Connection>, ApiError> {
    let list = ask(api
        .service
        .list_connections(call(caller, m::ListConnectionsRequest { vhost })))
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
    ask(api.service.close_connection(call(
        &caller,
        m::CloseConnectionRequest {
            id: connection.id,
            reason,
        },
    )))
    .await?;
    no_content()
}

async fn channels(
    api: &HttpApi,
    caller: &Caller,
    vhost: String,
    connection_id: u64,
) -> Result<Vec<Value>, ApiError> {
    let list = ask(api.service.list_channels(call(
        caller,
        m::ListChannelsRequest {
            vhost,
            connection_id,
        },
    )))
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
    let list = ask(api.service.list_channels(call(
        &caller,
        m::ListChannelsRequest {
            vhost: String::new(),
            connection_id: connection.id,
        },
    )))
    .await?;
    json(shapes::amqp1_sessions(&list.channels))
}

// --------------------------------------------------------------- consumers

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
    let listed = ask(api
        .service
        .list_consumers(call(caller, m::ListConsumersRequest { vhost })))
    .await?;
    let items = listed
        .consumers
        .iter()
        .map(|consumer| shapes::consumer(consumer, &api.node))
        .collect();
    list(items, query)
}
