//! `/api/users`, `/api/permissions` and a vhost's permissions.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::routing::get;
use axum::Router;
use serde_json::Value;
use spillway_proto::management as m;

use super::common::{body, created, json, list, no_content, text, Answer, Api, Who};
use super::pages::ListQuery;
use super::shapes;
use super::{ApiError, HttpApi};
use crate::auth::Caller;

/// Its endpoints.
pub(super) fn routes() -> Router<Api> {
    Router::new()
        .route("/api/vhosts/{vhost}/permissions", get(vhost_permissions))
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
}

async fn users(api: &HttpApi, caller: &Caller) -> Result<Vec<m::User>, ApiError> {
    let list = api
        .service
        .list_users(caller, m::ListUsersRequest {})
        .await?;
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
    api.service
        .put_user(
            &caller,
            m::PutUserRequest {
                name,
                password,
                tags,
                loopback_only: false,
            },
        )
        .await?;
    created(was_there)
}

async fn delete_user(State(api): State<Api>, Who(caller): Who, Path(name): Path<String>) -> Answer {
    api.service
        .delete_user(&caller, m::DeleteUserRequest { name })
        .await?;
    no_content()
}

async fn permissions(
    api: &HttpApi,
    caller: &Caller,
    user: String,
    vhost: String,
) -> Result<Vec<m::Permission>, ApiError> {
    let list = api
        .service
        .list_permissions(caller, m::ListPermissionsRequest { user, vhost })
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
    api.service.set_permissions(&caller, request).await?;
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
    api.service
        .clear_permissions(&caller, m::ClearPermissionsRequest { user, vhost })
        .await?;
    no_content()
}
