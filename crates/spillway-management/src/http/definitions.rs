//! `/api/definitions`: a topology as RabbitMQ's definitions file holds it
//! (users with their password hashes, vhosts, permissions, policies,
//! exchanges, queues, bindings), exported and imported whole. The JSON is
//! read here into the management API's `Definitions` and checked as far as
//! its shape goes; the engine checks the rest and applies all of it or
//! nothing (`ImportDefinitions`).
//!
//! What a RabbitMQ export holds that Spillway has no place for is refused
//! by name rather than dropped (topic permissions, runtime parameters
//! other than operator policies, hashing algorithms other than SHA-256);
//! the cluster-wide `global_parameters` (the cluster's name and id) are
//! RabbitMQ's own and are skipped.

use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use base64::Engine as _;
use serde_json::{json, Value};
use spillway_proto::management as m;

use super::common::{Answer, Api, Who};
use super::shapes;
use super::ApiError;

/// The largest definitions body taken (a RabbitMQ export of tens of
/// thousands of queues); the engine bounds the import again by items and
/// encoded size.
pub const MAX_DEFINITIONS_BODY_BYTES: usize = 8 * 1024 * 1024;

/// The password hashing algorithm of the hashes Spillway stores and takes.
const SHA256: &str = "rabbit_password_hashing_sha256";

/// The RabbitMQ version the export says it is, for tools that check it.
const EXPORTED_RABBITMQ_VERSION: &str = "3.10.0";

/// Its endpoints: the whole broker's definitions and one vhost's.
pub(super) fn routes() -> Router<Api> {
    Router::new()
        .route(
            "/api/definitions",
            get(export_all)
                .post(import_all)
                .layer(DefaultBodyLimit::max(MAX_DEFINITIONS_BODY_BYTES)),
        )
        .route(
            "/api/definitions/{vhost}",
            get(export_vhost)
                .post(import_vhost)
                .layer(DefaultBodyLimit::max(MAX_DEFINITIONS_BODY_BYTES)),
        )
}

pub(super) async fn export_all(State(api): State<Api>, Who(caller): Who) -> Answer {
    export(api, caller, String::new()).await
}

pub(super) async fn export_vhost(
    State(api): State<Api>,
    Who(caller): Who,
    Path(vhost): Path<String>,
) -> Answer {
    export(api, caller, vhost).await
}

async fn export(api: Api, caller: crate::auth::Caller, vhost: String) -> Answer {
    let whole = vhost.is_empty();
    let request = m::ExportDefinitionsRequest { vhost };
    // It reads every queue, as a list does.
    let definitions = {
        let _slot = api.list_slot().await?;
        api.service.export_definitions(&caller, request).await?
    };
    let mut body = to_json(&definitions, whole);
    if whole {
        body["rabbit_version"] = json!(EXPORTED_RABBITMQ_VERSION);
        body["rabbitmq_version"] = json!(EXPORTED_RABBITMQ_VERSION);
        body["product_name"] = json!("Spillway");
        body["product_version"] = json!(env!("CARGO_PKG_VERSION"));
    } else {
        body["rabbit_version"] = json!(EXPORTED_RABBITMQ_VERSION);
        body["rabbitmq_version"] = json!(EXPORTED_RABBITMQ_VERSION);
    }
    let mut response = axum::Json(body).into_response();
    // As RabbitMQ: `?download=` makes browsers save it; harmless otherwise.
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(response)
}

pub(super) async fn import_all(State(api): State<Api>, Who(caller): Who, bytes: Bytes) -> Answer {
    let body = parse(&bytes)?;
    let definitions = from_json(&body, None).map_err(ApiError::bad_request)?;
    import(api, caller, definitions).await
}

pub(super) async fn import_vhost(
    State(api): State<Api>,
    Who(caller): Who,
    Path(vhost): Path<String>,
    bytes: Bytes,
) -> Answer {
    let body = parse(&bytes)?;
    let definitions = from_json(&body, Some(&vhost)).map_err(ApiError::bad_request)?;
    import(api, caller, definitions).await
}

async fn import(api: Api, caller: crate::auth::Caller, definitions: m::Definitions) -> Answer {
    let request = m::ImportDefinitionsRequest {
        definitions: Some(definitions),
    };
    api.service.import_definitions(&caller, request).await?;
    // RabbitMQ answers an import with 204.
    Ok(StatusCode::NO_CONTENT.into_response())
}

fn parse(bytes: &Bytes) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|error| ApiError::bad_request(format!("the definitions are not JSON: {error}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "the definitions must be a JSON object",
        ));
    }
    Ok(value)
}

// ------------------------------------------------------------------ export

/// Definitions in RabbitMQ's JSON; one vhost's leave out users, vhosts and
/// permissions, and the vhost of each item, as RabbitMQ's per-vhost export.
pub fn to_json(definitions: &m::Definitions, whole: bool) -> Value {
    let with_vhost = |mut value: Value, vhost: &str| {
        if whole {
            value["vhost"] = json!(vhost);
        }
        value
    };
    let (policies, operator_policies): (Vec<&m::Policy>, Vec<&m::Policy>) =
        definitions.policies.iter().partition(|p| !p.operator);
    let policy_json = |policy: &m::Policy| {
        let mut value = shapes::policy(policy);
        if !whole {
            if let Some(object) = value.as_object_mut() {
                object.remove("vhost");
            }
        }
        value
    };
    let mut body = json!({
        "policies": policies.iter().map(|p| policy_json(p)).collect::<Vec<_>>(),
        "queues": definitions.queues.iter().map(|q| with_vhost(json!({
            "name": q.name,
            "durable": q.durable,
            "auto_delete": q.auto_delete,
            "arguments": shapes::arguments(&q.arguments),
        }), &q.vhost)).collect::<Vec<_>>(),
        "exchanges": definitions.exchanges.iter().map(|x| with_vhost(json!({
            "name": x.name,
            "type": x.kind,
            "durable": x.durable,
            "auto_delete": x.auto_delete,
            "internal": x.internal,
            "arguments": shapes::arguments(&x.arguments),
        }), &x.vhost)).collect::<Vec<_>>(),
        "bindings": definitions.bindings.iter().map(|b| with_vhost(json!({
            "source": b.source,
            "destination": b.destination,
            "destination_type": if b.destination_is_exchange { "exchange" } else { "queue" },
            "routing_key": b.routing_key,
            "arguments": shapes::arguments(&b.arguments),
        }), &b.vhost)).collect::<Vec<_>>(),
    });
    if whole {
        body["users"] = definitions
            .users
            .iter()
            .map(|u| {
                json!({
                    "name": u.name,
                    "password_hash": base64::engine::general_purpose::STANDARD.encode(&u.password_hash),
                    "hashing_algorithm": SHA256,
                    "tags": u.tags,
                    "limits": {},
                })
            })
            .collect();
        body["vhosts"] = definitions
            .vhosts
            .iter()
            .map(|name| json!({ "name": name }))
            .collect();
        body["permissions"] = definitions
            .permissions
            .iter()
            .map(|p| {
                json!({
                    "user": p.user,
                    "vhost": p.vhost,
                    "configure": p.configure,
                    "write": p.write,
                    "read": p.read,
                })
            })
            .collect();
        body["topic_permissions"] = json!([]);
        body["global_parameters"] = json!([]);
    }
    // RabbitMQ keeps operator policies among the runtime parameters.
    body["parameters"] = operator_policies
        .iter()
        .map(|p| {
            let policy = shapes::policy(p);
            let mut value = json!({
                "component": OPERATOR_POLICY_COMPONENT,
                "name": p.name,
                "value": {
                    "pattern": policy["pattern"],
                    "apply-to": policy["apply-to"],
                    "definition": policy["definition"],
                    "priority": policy["priority"],
                },
            });
            if whole {
                value["vhost"] = json!(p.vhost);
            }
            value
        })
        .collect();
    body
}

/// The runtime parameter component RabbitMQ stores operator policies as.
const OPERATOR_POLICY_COMPONENT: &str = "operator_policy";

// ------------------------------------------------------------------ import

/// RabbitMQ's definitions JSON as the management API's `Definitions`.
/// `vhost`: a per-vhost import, whose items take that vhost (and which has
/// no users, vhosts or permissions).
pub fn from_json(body: &Value, vhost: Option<&str>) -> Result<m::Definitions, String> {
    let mut definitions = m::Definitions::default();
    let vhost_of = |item: &Value, what: &str| -> Result<String, String> {
        match vhost {
            Some(vhost) => Ok(vhost.to_string()),
            None => required_text(item, "vhost", what).map(str::to_string),
        }
    };
    if vhost.is_none() {
        for item in list(body, "vhosts")? {
            definitions
                .vhosts
                .push(required_text(item, "name", "a vhost")?.to_string());
        }
        for item in list(body, "users")? {
            definitions.users.push(user(item)?);
        }
        for item in list(body, "permissions")? {
            let what = "a permission";
            definitions.permissions.push(m::SetPermissionsRequest {
                user: required_text(item, "user", what)?.to_string(),
                vhost: required_text(item, "vhost", what)?.to_string(),
                configure: required_text(item, "configure", what)?.to_string(),
                write: required_text(item, "write", what)?.to_string(),
                read: required_text(item, "read", what)?.to_string(),
            });
        }
        if !list(body, "topic_permissions")?.is_empty() {
            return Err(bad(
                "topic_permissions are not supported by Spillway: remove them to import the rest",
            ));
        }
    }
    for item in list(body, "policies")? {
        definitions
            .policies
            .push(policy(item, vhost_of(item, "a policy")?, false, item)?);
    }
    for item in list(body, "operator_policies")? {
        definitions.policies.push(policy(
            item,
            vhost_of(item, "an operator policy")?,
            true,
            item,
        )?);
    }
    for item in list(body, "parameters")? {
        let component = required_text(item, "component", "a parameter")?;
        if component != OPERATOR_POLICY_COMPONENT {
            return Err(bad(format!(
                "runtime parameters of component '{component}' are not supported by Spillway: remove them to import the rest"
            )));
        }
        let value = item
            .get("value")
            .filter(|v| v.is_object())
            .ok_or_else(|| bad("an operator policy parameter needs a 'value' object"))?;
        let mut named = value.clone();
        named["name"] = item.get("name").cloned().unwrap_or(Value::Null);
        definitions.policies.push(policy(
            &named,
            vhost_of(item, "an operator policy")?,
            true,
            value,
        )?);
    }
    for item in list(body, "exchanges")? {
        let what = "an exchange";
        definitions.exchanges.push(m::CreateExchangeRequest {
            vhost: vhost_of(item, what)?,
            name: required_text(item, "name", what)?.to_string(),
            kind: required_text(item, "type", what)?.to_string(),
            durable: flag(item, "durable", true)?,
            auto_delete: flag(item, "auto_delete", false)?,
            internal: flag(item, "internal", false)?,
            arguments: arguments(item)?,
        });
    }
    for item in list(body, "queues")? {
        let what = "a queue";
        let mut arguments = arguments(item)?;
        // RabbitMQ 3.10+ writes the queue type beside the arguments too.
        if let Some(kind) = optional_text(item, "type")? {
            if kind != "classic" && !arguments.contains_key("x-queue-type") {
                arguments.insert(
                    "x-queue-type".into(),
                    m::ArgumentValue {
                        value: Some(m::argument_value::Value::StringValue(kind.to_string())),
                    },
                );
            }
        }
        definitions.queues.push(m::CreateQueueRequest {
            vhost: vhost_of(item, what)?,
            name: required_text(item, "name", what)?.to_string(),
            durable: flag(item, "durable", true)?,
            auto_delete: flag(item, "auto_delete", false)?,
            arguments,
        });
    }
    for item in list(body, "bindings")? {
        let what = "a binding";
        let destination_is_exchange = match required_text(item, "destination_type", what)? {
            "queue" => false,
            "exchange" => true,
            other => {
                return Err(bad(format!(
                    "a binding's destination_type is 'queue' or 'exchange', not '{other}'"
                )))
            }
        };
        definitions.bindings.push(m::Binding {
            vhost: vhost_of(item, what)?,
            source: required_text(item, "source", what)?.to_string(),
            destination: required_text(item, "destination", what)?.to_string(),
            destination_is_exchange,
            routing_key: optional_text(item, "routing_key")?
                .unwrap_or_default()
                .to_string(),
            arguments: arguments(item)?,
        });
    }
    Ok(definitions)
}

fn user(item: &Value) -> Result<m::DefinedUser, String> {
    let name = required_text(item, "name", "a user")?;
    if item.get("password").is_some() {
        return Err(bad(format!(
            "user '{name}': give 'password_hash' (as RabbitMQ exports it), not 'password'"
        )));
    }
    if let Some(algorithm) = optional_text(item, "hashing_algorithm")? {
        if algorithm != SHA256 {
            return Err(bad(format!(
                "user '{name}': password hashes of '{algorithm}' are not supported, only '{SHA256}' (RabbitMQ's default since 3.6)"
            )));
        }
    }
    let hash = optional_text(item, "password_hash")?.unwrap_or_default();
    let password_hash = base64::engine::general_purpose::STANDARD
        .decode(hash)
        .map_err(|_| bad(format!("user '{name}': password_hash is not base64")))?;
    // RabbitMQ 3.7+ writes tags as a list, earlier versions as "a,b".
    let tags = match item.get("tags") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(text)) => text
            .split(',')
            .map(str::trim)
            .filter(|tag| !tag.is_empty())
            .map(str::to_string)
            .collect(),
        Some(Value::Array(tags)) => tags
            .iter()
            .map(|tag| {
                tag.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad(format!("user '{name}': tags must be strings")))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(bad(format!(
                "user '{name}': tags must be a list or a comma-separated string"
            )))
        }
    };
    Ok(m::DefinedUser {
        name: name.to_string(),
        password_hash: password_hash.into(),
        tags,
    })
}

/// A policy from `named` (its name) and `fields` (pattern, apply-to,
/// definition, priority).
fn policy(
    named: &Value,
    vhost: String,
    operator: bool,
    fields: &Value,
) -> Result<m::Policy, String> {
    let what = if operator {
        "an operator policy"
    } else {
        "a policy"
    };
    let name = required_text(named, "name", what)?.to_string();
    let definition = match fields.get("definition") {
        Some(Value::Object(object)) => Value::Object(object.clone()).to_string(),
        _ => {
            return Err(bad(format!(
                "policy '{name}': 'definition' must be a JSON object"
            )))
        }
    };
    let priority = match fields.get("priority") {
        None | Some(Value::Null) => 0,
        Some(Value::Number(number)) => number
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| bad(format!("policy '{name}': bad priority")))?,
        Some(_) => return Err(bad(format!("policy '{name}': 'priority' must be a number"))),
    };
    Ok(m::Policy {
        vhost,
        name: name.clone(),
        pattern: required_text(fields, "pattern", what)?.to_string(),
        apply_to: optional_text(fields, "apply-to")?
            .unwrap_or(if operator { "queues" } else { "all" })
            .to_string(),
        priority,
        definition,
        operator,
    })
}

fn bad(text: impl Into<String>) -> String {
    text.into()
}

fn list<'a>(body: &'a Value, key: &str) -> Result<&'a [Value], String> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(items)) => Ok(items),
        Some(_) => Err(bad(format!("'{key}' must be a list"))),
    }
}

fn required_text<'a>(item: &'a Value, key: &str, what: &str) -> Result<&'a str, String> {
    optional_text(item, key)?.ok_or_else(|| bad(format!("{what} needs '{key}'")))
}

fn optional_text<'a>(item: &'a Value, key: &str) -> Result<Option<&'a str>, String> {
    match item.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text)),
        Some(_) => Err(bad(format!("'{key}' must be a string"))),
    }
}

fn flag(item: &Value, key: &str, default: bool) -> Result<bool, String> {
    match item.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(flag)) => Ok(*flag),
        Some(Value::String(text)) if text == "true" => Ok(true),
        Some(Value::String(text)) if text == "false" => Ok(false),
        Some(_) => Err(bad(format!("'{key}' must be a boolean"))),
    }
}

fn arguments(item: &Value) -> Result<std::collections::HashMap<String, m::ArgumentValue>, String> {
    shapes::arguments_from(item.get("arguments"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// What RabbitMQ 3.10's management plugin exports (abridged to one of
    /// each), read and written back the same.
    #[test]
    fn a_rabbitmq_export_reads_and_writes_back() {
        let export = json!({
            "rabbit_version": "3.10.8",
            "users": [{"name": "app", "password_hash": "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR", "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ["management"], "limits": {}}],
            "vhosts": [{"name": "/"}, {"name": "shop"}],
            "permissions": [{"user": "app", "vhost": "shop", "configure": ".*", "write": ".*", "read": "^orders$"}],
            "topic_permissions": [],
            "parameters": [{"vhost": "shop", "component": "operator_policy", "name": "cap", "value": {"pattern": ".*", "apply-to": "queues", "definition": {"max-length": 1000}, "priority": 0}}],
            "global_parameters": [{"name": "internal_cluster_id", "value": "rabbitmq-cluster-id-x"}],
            "policies": [{"vhost": "shop", "name": "dlx", "pattern": "^orders", "apply-to": "queues", "definition": {"dead-letter-exchange": "dead"}, "priority": 1}],
            "queues": [{"name": "orders", "vhost": "shop", "durable": true, "auto_delete": false, "arguments": {"x-max-priority": 5}}],
            "exchanges": [{"name": "shop.events", "vhost": "shop", "type": "topic", "durable": true, "auto_delete": false, "internal": false, "arguments": {}}],
            "bindings": [{"source": "shop.events", "vhost": "shop", "destination": "orders", "destination_type": "queue", "routing_key": "order.*", "arguments": {}}],
        });
        let definitions = from_json(&export, None).unwrap();
        assert_eq!(definitions.vhosts, ["/", "shop"]);
        assert_eq!(definitions.users[0].password_hash.len(), 36);
        assert_eq!(definitions.users[0].tags, ["management"]);
        assert_eq!(definitions.policies.len(), 2);
        assert!(definitions.policies[1].operator);
        assert_eq!(definitions.policies[1].apply_to, "queues");
        let back = to_json(&definitions, true);
        for key in [
            "users",
            "vhosts",
            "permissions",
            "policies",
            "parameters",
            "queues",
            "exchanges",
            "bindings",
        ] {
            assert_eq!(back[key], export[key], "{key}");
        }
    }

    #[test]
    fn what_spillway_has_no_place_for_is_refused_by_name() {
        for (body, words) in [
            (
                json!({"parameters": [{"vhost": "/", "component": "shovel", "name": "s", "value": {}}]}),
                "shovel",
            ),
            (
                json!({"topic_permissions": [{"user": "u"}]}),
                "topic_permissions",
            ),
            (
                json!({"users": [{"name": "u", "password_hash": "", "hashing_algorithm": "rabbit_password_hashing_md5"}]}),
                "md5",
            ),
            (
                json!({"users": [{"name": "u", "password": "secret"}]}),
                "password_hash",
            ),
            (
                json!({"bindings": [{"source": "x", "vhost": "/", "destination": "q", "destination_type": "stream"}]}),
                "destination_type",
            ),
            (json!({"queues": [{"name": "q"}]}), "'vhost'"),
        ] {
            let refusal = from_json(&body, None).unwrap_err();
            assert!(format!("{refusal:?}").contains(words), "{refusal:?}");
        }
    }

    #[test]
    fn a_per_vhost_import_puts_everything_in_that_vhost() {
        let body =
            json!({"queues": [{"name": "q", "durable": true}], "users": [{"name": "ignored"}]});
        let definitions = from_json(&body, Some("shop")).unwrap();
        assert_eq!(definitions.queues[0].vhost, "shop");
        assert!(definitions.users.is_empty());
    }
}
