//! The broker as a whole: `/api/overview`, `/api/whoami`, `/api/nodes`, the
//! aliveness test and the health checks.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use spillway_proto::management as m;

use super::common::{json, visible_vhosts, Answer, Api, Who};
use super::exchanges::EXCHANGE_TYPES;
use super::{ApiError, HttpApi};
use crate::auth::Caller;
use crate::authorize::{authorize, Need};

/// Its endpoints.
pub(super) fn routes() -> Router<Api> {
    Router::new()
        .route("/api/overview", get(overview))
        .route("/api/whoami", get(whoami))
        .route("/api/nodes", get(nodes))
        .route("/api/nodes/{node}", get(node))
        .route("/api/aliveness-test/{vhost}", get(aliveness_test))
        .route("/api/health/checks/alarms", get(alarms))
        .route("/api/health/checks/local-alarms", get(alarms))
}

/// The version of RabbitMQ's API these endpoints follow, reported as
/// `rabbitmq_version` for tools that check it.
const RABBITMQ_API_VERSION: &str = "3.10.0";

/// The broker's figures; a caller without `monitoring` gets the totals of
/// its vhosts only (the gRPC `GetBrokerStatus` counts them, reading their
/// queues: hence the list slot).
async fn overview(State(api): State<Api>, Who(caller): Who) -> Answer {
    // Its totals read every queue (all of them, or the caller's vhosts').
    let _slot = api.list_slot().await?;
    let status = api
        .service
        .get_broker_status(&caller, m::GetBrokerStatusRequest {})
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
    let status = api
        .service
        .get_broker_status(caller, m::GetBrokerStatusRequest {})
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
    api.service
        .get_vhost(&caller, m::GetVhostRequest { name: vhost })
        .await?;
    json(json!({"status": "ok"}))
}

/// The store's disk quota is Spillway's resource alarm: while it is
/// reached, publishers are blocked, as under RabbitMQ's disk alarm.
async fn alarms(State(api): State<Api>, Who(caller): Who) -> Answer {
    // The broker's status reads every queue.
    let _slot = api.list_slot().await?;
    let status = api
        .service
        .get_broker_status(&caller, m::GetBrokerStatusRequest {})
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
