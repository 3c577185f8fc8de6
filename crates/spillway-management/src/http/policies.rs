//! `/api/policies` and `/api/operator-policies` (one set of handlers, told
//! apart by a const parameter).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::routing::get;
use axum::Router;
use serde_json::Value;
use spillway_proto::management as m;

use super::common::{body, created, json, no_content, text, visible_vhosts, Answer, Api, Who};
use super::shapes;
use super::{ApiError, HttpApi};
use crate::auth::Caller;
use crate::authorize::{authorize, Need};

/// Its endpoints.
pub(super) fn routes() -> Router<Api> {
    Router::new()
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
}

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
        let list = api
            .service
            .list_policies(caller, m::ListPoliciesRequest { vhost, operator })
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
    api.service
        .set_policy(
            &caller,
            m::SetPolicyRequest {
                policy: Some(policy),
            },
        )
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
    api.service
        .clear_policy(
            &caller,
            m::ClearPolicyRequest {
                vhost,
                name,
                operator,
            },
        )
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
