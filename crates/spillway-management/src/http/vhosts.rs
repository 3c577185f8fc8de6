//! `/api/vhosts`: vhosts with their message totals, created and deleted.

use axum::extract::{Path, Query, State};
use axum::routing::get;
use axum::Router;
use serde_json::Value;
use spillway_proto::management as m;

use super::common::{created, json, list, no_content, visible_vhosts, Answer, Api, Who};
use super::pages::ListQuery;
use super::shapes;
use super::HttpApi;
use crate::auth::Caller;
use crate::authorize::{authorize, Need};

/// Its endpoints.
pub(super) fn routes() -> Router<Api> {
    Router::new().route("/api/vhosts", get(list_vhosts)).route(
        "/api/vhosts/{vhost}",
        get(get_vhost).put(put_vhost).delete(delete_vhost),
    )
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
    let vhost = api
        .service
        .get_vhost(&caller, m::GetVhostRequest { name })
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
    if api.service.get_vhost(&caller, existing).await.is_ok() {
        return created(true);
    }
    let request = m::CreateVhostRequest { name: name.clone() };
    api.service.create_vhost(&caller, request).await?;
    if let Caller::User(user) = &caller {
        let grant = m::SetPermissionsRequest {
            user: user.name.clone(),
            vhost: name,
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        };
        api.service.set_permissions(&caller, grant).await?;
    }
    created(false)
}

async fn delete_vhost(
    State(api): State<Api>,
    Who(caller): Who,
    Path(name): Path<String>,
) -> Answer {
    api.service
        .delete_vhost(&caller, m::DeleteVhostRequest { name })
        .await?;
    no_content()
}
