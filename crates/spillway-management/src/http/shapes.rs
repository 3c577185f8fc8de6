//! Spillway's management answers in the JSON shapes of RabbitMQ's
//! management API (3.10): the field names its tools read. Fields Spillway
//! has no figure for are left out rather than made up, as RabbitMQ leaves
//! out what it has not measured; Spillway's own figures are added under
//! names RabbitMQ does not use (`resident_bytes`, `spilled_*`).

use std::collections::HashMap;

use serde_json::{json, Map, Value};
use spillway_proto::management::{self as m, argument_value::Value as Arg};

/// The name RabbitMQ gives the default exchange in URLs and answers.
pub const DEFAULT_EXCHANGE_URL_NAME: &str = "amq.default";

/// A field table (arguments, headers) as JSON.
pub fn arguments(map: &HashMap<String, m::ArgumentValue>) -> Value {
    let mut sorted: Vec<(&String, &m::ArgumentValue)> = map.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let object: Map<String, Value> = sorted
        .into_iter()
        .map(|(key, value)| (key.clone(), argument(value)))
        .collect();
    Value::Object(object)
}

fn argument(value: &m::ArgumentValue) -> Value {
    match &value.value {
        Some(Arg::StringValue(text)) | Some(Arg::Text(text)) => json!(text),
        Some(Arg::IntValue(number)) => json!(number),
        Some(Arg::BoolValue(flag)) => json!(flag),
        Some(Arg::DoubleValue(number)) => json!(number),
        None => Value::Null,
    }
}

/// JSON arguments (a request body's `arguments`) as a field table. Nested
/// objects and lists are refused: Spillway's arguments are scalars. Absent,
/// `null` and `[]` (what several clients send for "none", and RabbitMQ
/// takes) are no arguments.
pub fn arguments_from(value: Option<&Value>) -> Result<HashMap<String, m::ArgumentValue>, String> {
    let object = match value {
        None | Some(Value::Null) => return Ok(HashMap::new()),
        Some(Value::Array(items)) if items.is_empty() => return Ok(HashMap::new()),
        Some(Value::Object(object)) => object,
        Some(_) => return Err("arguments must be a JSON object".into()),
    };
    object
        .iter()
        .map(|(key, value)| {
            let value = match value {
                Value::String(text) => Arg::StringValue(text.clone()),
                Value::Bool(flag) => Arg::BoolValue(*flag),
                Value::Number(number) => match number.as_i64() {
                    Some(integer) => Arg::IntValue(integer),
                    None => Arg::DoubleValue(number.as_f64().unwrap_or(0.0)),
                },
                Value::Null | Value::Array(_) | Value::Object(_) => {
                    return Err(format!(
                        "argument '{key}' must be a string, a number or a boolean"
                    ))
                }
            };
            Ok((key.clone(), m::ArgumentValue { value: Some(value) }))
        })
        .collect()
}

/// RabbitMQ's `properties` object of a publish.
pub fn message_properties(value: Option<&Value>) -> Result<m::MessageProperties, String> {
    let mut properties = m::MessageProperties::default();
    let object = match value {
        None | Some(Value::Null) => return Ok(properties),
        Some(Value::Array(items)) if items.is_empty() => return Ok(properties),
        Some(Value::Object(object)) => object,
        Some(_) => return Err("'properties' must be a JSON object".into()),
    };
    let small = |key: &str, value: &Value| -> Result<u32, String> {
        value
            .as_u64()
            .and_then(|number| u32::try_from(number).ok())
            .ok_or_else(|| format!("'{key}' must be a small integer"))
    };
    for (key, value) in object {
        let as_text = || -> Result<String, String> {
            value
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("'{key}' must be a string"))
        };
        match key.as_str() {
            "content_type" => properties.content_type = as_text()?,
            "content_encoding" => properties.content_encoding = as_text()?,
            "correlation_id" => properties.correlation_id = as_text()?,
            "reply_to" => properties.reply_to = as_text()?,
            "expiration" => properties.expiration = as_text()?,
            "message_id" => properties.message_id = as_text()?,
            "type" => properties.r#type = as_text()?,
            "user_id" => properties.user_id = as_text()?,
            "app_id" => properties.app_id = as_text()?,
            "delivery_mode" => properties.delivery_mode = small(key, value)?,
            "priority" => properties.priority = Some(small(key, value)?),
            "timestamp" => {
                let timestamp = value.as_u64().ok_or("'timestamp' must be an integer")?;
                properties.timestamp = Some(timestamp);
            }
            "headers" => properties.headers = arguments_from(Some(value))?,
            other => return Err(format!("unknown message property '{other}'")),
        }
    }
    Ok(properties)
}

/// A vhost with its ready and unacknowledged messages.
pub fn vhost(vhost: &m::Vhost, ready: u64, unacked: u64) -> Value {
    json!({
        "name": vhost.name,
        "description": "",
        "tags": [],
        "tracing": false,
        "messages": ready + unacked,
        "messages_ready": ready,
        "messages_unacknowledged": unacked,
    })
}

pub fn exchange(exchange: &m::Exchange) -> Value {
    let mut object = json!({
        "name": exchange.name,
        "vhost": exchange.vhost,
        "type": exchange.kind,
        "durable": exchange.durable,
        "auto_delete": exchange.auto_delete,
        "internal": exchange.internal,
        "arguments": arguments(&exchange.arguments),
        "user_who_performed_action": "",
    });
    if !exchange.policy.is_empty() {
        object["policy"] = json!(exchange.policy);
    }
    if exchange.kind == "x-delayed-message" {
        object["delayed_messages"] = json!(exchange.delayed_messages);
    }
    object
}

pub fn queue(queue: &m::Queue, node: &str) -> Value {
    let status = queue.status.clone().unwrap_or_default();
    let exclusive = queue.exclusive;
    let mut object = json!({
        "name": queue.name,
        "vhost": queue.vhost,
        "durable": queue.durable,
        "auto_delete": queue.auto_delete,
        "exclusive": exclusive,
        "arguments": arguments(&queue.arguments),
        "node": node,
        "type": "classic",
        "state": if status.recovering { "recovering" } else { "running" },
        "messages": status.messages + status.unacked,
        "messages_ready": status.messages,
        "messages_unacknowledged": status.unacked,
        "consumers": status.consumers,
        "message_bytes": status.bytes,
        "message_bytes_ready": status.bytes,
        "message_bytes_ram": status.resident_bytes,
        "message_bytes_paged_out": status.spilled_bytes,
        "messages_paged_out": status.spilled_messages,
        // Spillway's own: flow to disk.
        "resident_bytes": status.resident_bytes,
        "spilled_messages": status.spilled_messages,
        "spilled_bytes": status.spilled_bytes,
        "overfull": status.overfull,
        "effective_arguments": arguments(&queue.effective_arguments),
    });
    if !queue.policy.is_empty() {
        object["policy"] = json!(queue.policy);
    }
    if !queue.operator_policy.is_empty() {
        object["operator_policy"] = json!(queue.operator_policy);
    }
    if !status.active_consumer.is_empty() {
        object["single_active_consumer_tag"] = json!(status.active_consumer);
    }
    object
}

pub fn binding(binding: &m::Binding) -> Value {
    json!({
        "source": binding.source,
        "vhost": binding.vhost,
        "destination": binding.destination,
        "destination_type": if binding.destination_is_exchange { "exchange" } else { "queue" },
        "routing_key": binding.routing_key,
        "arguments": arguments(&binding.arguments),
        "properties_key": properties_key(&binding.routing_key, &binding.arguments),
    })
}

/// The last segment of a binding's URL, as RabbitMQ forms it: `~` for an
/// empty routing key without arguments, else the percent-encoded routing
/// key, then, with arguments, `~` and a digest of them.
pub fn properties_key(routing_key: &str, arguments: &HashMap<String, m::ArgumentValue>) -> String {
    let key = quote(routing_key);
    if arguments.is_empty() {
        return if routing_key.is_empty() {
            "~".into()
        } else {
            key
        };
    }
    format!("{key}~{}", arguments_digest(arguments))
}

/// Percent-encodes what RabbitMQ encodes in a binding's properties key
/// and its URLs (everything but unreserved characters; `~` too, since it
/// separates).
pub fn quote(text: &str) -> String {
    const KEEP: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'_')
        .remove(b'.');
    percent_encoding::utf8_percent_encode(text, KEEP).to_string()
}

/// A short, stable digest of binding arguments (FNV-1a over the sorted
/// keys and values): RabbitMQ's is opaque too, clients only hand it back.
fn arguments_digest(table: &HashMap<String, m::ArgumentValue>) -> String {
    let text = arguments(table).to_string();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in text.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// A connection's name in answers and URLs: its client address and its
/// id, which `DELETE /api/connections/{name}` reads back.
pub fn connection_name(connection_id: u64, client_address: &str) -> String {
    format!("{client_address} -> spillway #{connection_id}")
}

/// The connection id in a name made by [`connection_name`].
pub fn connection_id(name: &str) -> Option<u64> {
    name.rsplit_once(" #")?.1.parse().ok()
}

fn peer(address: &str) -> (String, u16) {
    match address.parse::<std::net::SocketAddr>() {
        Ok(addr) => (addr.ip().to_string(), addr.port()),
        Err(_) => (address.to_string(), 0),
    }
}

/// "AMQP 1.0" for connections the gateway opened for a 1.0 client (it
/// says so in the client properties it passes on), else "AMQP 0-9-1".
pub fn protocol(connection: &m::Connection) -> &'static str {
    let amqp1 = connection
        .client_properties
        .get("protocol")
        .and_then(|value| match &value.value {
            Some(Arg::StringValue(text)) | Some(Arg::Text(text)) => Some(text.as_str()),
            _ => None,
        })
        == Some("AMQP 1.0");
    if amqp1 {
        "AMQP 1.0"
    } else {
        "AMQP 0-9-1"
    }
}

pub fn connection(connection: &m::Connection, node: &str) -> Value {
    let (peer_host, peer_port) = peer(&connection.client_address);
    json!({
        "name": connection_name(connection.id, &connection.client_address),
        "node": node,
        "user": connection.user,
        "vhost": connection.vhost,
        "peer_host": peer_host,
        "peer_port": peer_port,
        "channels": connection.channels,
        "state": "running",
        "type": "network",
        "protocol": protocol(connection),
        "client_properties": arguments(&connection.client_properties),
        "messages_published": connection.messages_published,
        "messages_delivered": connection.messages_delivered,
    })
}

pub fn channel(channel: &m::Channel, node: &str) -> Value {
    let connection = connection_name(channel.connection_id, &channel.client_address);
    let (peer_host, peer_port) = peer(&channel.client_address);
    let mut object = json!({
        "name": format!("{connection} ({})", channel.number),
        "number": channel.number,
        "node": node,
        "user": channel.user,
        "vhost": channel.vhost,
        "connection_details": {
            "name": connection,
            "peer_host": peer_host,
            "peer_port": peer_port,
        },
        "consumer_count": channel.consumers,
        "messages_unacknowledged": channel.unacked,
        "prefetch_count": channel.prefetch_count,
        "confirm": channel.confirm,
        "transactional": false,
        "state": if channel.blocked { "flow" } else { "running" },
    });
    if channel.blocked {
        object["blocked_reason"] = json!(channel.blocked_reason);
    }
    if let Some(link) = &channel.amqp1_link {
        object["amqp1_link"] = json!({
            "session": link.session,
            "link_name": link.name,
            "direction": if link.incoming { "incoming" } else { "outgoing" },
            "address": link.address,
        });
    }
    object
}

/// An AMQP 1.0 connection's sessions with their links, as RabbitMQ 4's
/// `/api/connections/{name}/sessions` lists them (the fields Spillway
/// knows): `channels` are the connection's, one per link.
pub fn amqp1_sessions(channels: &[m::Channel]) -> Value {
    let mut sessions: std::collections::BTreeMap<u32, (Vec<Value>, Vec<Value>)> =
        std::collections::BTreeMap::new();
    for channel in channels {
        let Some(link) = &channel.amqp1_link else {
            continue;
        };
        let (incoming, outgoing) = sessions.entry(link.session).or_default();
        if link.incoming {
            incoming.push(json!({
                "link_name": link.name,
                "target_address": link.address,
                "state": if channel.blocked { "flow" } else { "running" },
            }));
        } else {
            outgoing.push(json!({
                "link_name": link.name,
                "source_address": link.address,
                "queue_name": link.queue,
                "unsettled_messages": channel.unacked,
                "prefetch_count": channel.prefetch_count,
            }));
        }
    }
    Value::Array(
        sessions
            .into_iter()
            .map(|(number, (incoming, outgoing))| {
                json!({
                    "channel_number": number,
                    "incoming_links": incoming,
                    "outgoing_links": outgoing,
                })
            })
            .collect(),
    )
}

/// A consumer as `/api/consumers` lists it.
pub fn consumer(consumer: &m::Consumer, node: &str) -> Value {
    let connection = connection_name(consumer.connection_id, &consumer.client_address);
    let (peer_host, peer_port) = peer(&consumer.client_address);
    let mut arguments = json!({});
    if consumer.priority != 0 {
        arguments["x-priority"] = json!(consumer.priority);
    }
    json!({
        "consumer_tag": consumer.consumer_tag,
        "queue": {"name": consumer.queue, "vhost": consumer.vhost},
        "channel_details": {
            "name": format!("{connection} ({})", consumer.channel),
            "number": consumer.channel,
            "node": node,
            "user": consumer.user,
            "connection_name": connection,
            "peer_host": peer_host,
            "peer_port": peer_port,
        },
        "ack_required": consumer.ack_required,
        "prefetch_count": consumer.prefetch_count,
        "exclusive": consumer.exclusive,
        "arguments": arguments,
        "active": consumer.active,
        "activity_status": if consumer.active { "up" } else { "waiting" },
        "messages_unacknowledged": consumer.unacked,
    })
}

pub fn user(user: &m::User) -> Value {
    json!({
        "name": user.name,
        "tags": user.tags,
        "limits": {},
    })
}

pub fn permission(permission: &m::Permission) -> Value {
    json!({
        "user": permission.user,
        "vhost": permission.vhost,
        "configure": permission.configure,
        "write": permission.write,
        "read": permission.read,
    })
}

pub fn policy(policy: &m::Policy) -> Value {
    let definition: Value = serde_json::from_str(&policy.definition).unwrap_or_else(|_| json!({}));
    json!({
        "vhost": policy.vhost,
        "name": policy.name,
        "pattern": policy.pattern,
        "apply-to": policy.apply_to,
        "definition": definition,
        "priority": policy.priority,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn connection_names_carry_their_id_back() {
        let name = connection_name(17, "127.0.0.1:50000");
        assert_eq!(name, "127.0.0.1:50000 -> spillway #17");
        assert_eq!(connection_id(&name), Some(17));
        assert_eq!(connection_id("127.0.0.1:50000 -> 127.0.0.1:5672"), None);
    }

    #[test]
    fn properties_keys_are_rabbitmqs() {
        let none = HashMap::new();
        assert_eq!(properties_key("", &none), "~");
        assert_eq!(properties_key("a.b", &none), "a.b");
        assert_eq!(properties_key("a/b c~", &none), "a%2Fb%20c%7E");
        let mut args = HashMap::new();
        args.insert(
            "x-match".to_string(),
            m::ArgumentValue {
                value: Some(Arg::StringValue("all".into())),
            },
        );
        let key = properties_key("k", &args);
        assert!(key.starts_with("k~"), "{key}");
        assert_eq!(key, properties_key("k", &args));
    }

    #[test]
    fn json_arguments_become_a_field_table_and_back() {
        let body =
            json!({"x-max-length": 10, "x-queue-mode": "lazy", "x-flag": true, "x-ratio": 0.5});
        let table = arguments_from(Some(&body)).unwrap();
        assert_eq!(arguments(&table), body);
        assert!(arguments_from(Some(&json!({"x": {"nested": 1}}))).is_err());
        assert!(arguments_from(Some(&json!([1]))).is_err());
        assert!(arguments_from(None).unwrap().is_empty());
        assert!(arguments_from(Some(&json!(null))).unwrap().is_empty());
        assert!(arguments_from(Some(&json!([]))).unwrap().is_empty());
    }
}
