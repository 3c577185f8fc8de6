//! Definitions as a whole: the export of a topology (what RabbitMQ's
//! definitions file holds, users' password hashes included) and its
//! import, all of it or nothing.
//!
//! An import is checked in two steps before anything changes, then applied:
//!
//! 1. each item alone, without a lock: names, arguments, permission
//!    patterns, password hashes, policy definitions;
//! 2. against what exists, under the broker and access locks (taken in
//!    that order, as everywhere): a permission's user and vhost, a
//!    policy's vhost, the policy count per vhost;
//! 3. applied under the same locks through the broker operations a
//!    client's declarations take (so the same equivalence rules and
//!    limits), with every store write held back
//!    ([`crate::persistence::StoreWriter::capture`]). The first refusal
//!    (an inequivalent declaration, a vhost's queue limit) undoes what
//!    this import made in memory and drops the held writes: nothing
//!    changed, and the refusal is the answer. Otherwise the writes go to
//!    the store as one batch (they all land, or none), and the caller
//!    hears once it has.
//!
//! Users, permissions and policies come after the topology: step 2 checked
//! all that could refuse them. A policy's effect on queues that exist (a
//! `max-length` that drops messages) is applied after the batch is
//! submitted, so it happens only when everything else did.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;

use bytes::Bytes;
use prost::Message as _;
use spillway_amqp as amqp;
use spillway_proto::cluster::BATCH_BYTES;
use spillway_proto::engine as pb;
use spillway_proto::management as m;
use spillway_proto::permissions::{qpid_dead_letter_exchange, qpid_dead_letter_queue};
use spillway_proto::storage::{self as store, write_op};
use spillway_proto::ServiceError;
use tokio::sync::oneshot;

use super::common::{argument_map, check_name, encode_arguments, service_error, CHANNEL};
use crate::access::{AccessControl, AccessError, Permissions, User};
use crate::broker::Broker;
use crate::engine::Engine;
use crate::model::{Binding, Destination, SessionId};
use crate::persistence::{await_written, store_op};
use crate::policy::{Policy, MAX_POLICIES_PER_VHOST};
use crate::shared::Shared;
use crate::walk::walk_queues;

/// Items (vhosts, users, permissions, policies, exchanges, queues and
/// bindings together) one import may hold.
pub const MAX_IMPORTED_ITEMS: usize = 100_000;

/// The encoded size of one import: its store writes go in one batch, which
/// must fit one gRPC message to a remote storage node with room to spare.
const MAX_IMPORT_BYTES: usize = BATCH_BYTES / 2;

fn invalid(text: impl Into<String>) -> ServiceError {
    ServiceError::InvalidArgument(text.into())
}

fn access_error(error: AccessError) -> ServiceError {
    ServiceError::InvalidArgument(error.to_string())
}

// ----------------------------------------------------------------- export

/// The broker's definitions, or one vhost's (its exchanges, queues,
/// bindings and policies), as they are stored: durable exchanges and
/// queues, the bindings between durable ends. Built-in exchanges are left
/// out, as RabbitMQ does.
///
/// Read as the lists are (`walk.rs`): a vhost's policies and exchanges
/// under one hold of the broker lock, its queues 1,000 at a time, its
/// bindings an exchange at a time, the lock let go in between. So an
/// export of 100,000 queues does not hold up publishers for all of them,
/// and is not a snapshot: what is declared or deleted meanwhile may or may
/// not be in it (a binding is in it only if both its ends are when it is
/// read).
pub(crate) async fn export(
    shared: &Shared,
    request: &m::ExportDefinitionsRequest,
) -> Result<m::Definitions, ServiceError> {
    let whole = request.vhost.is_empty();
    let vhost_names: Vec<String> = {
        let broker = shared.broker.lock();
        if !whole && !broker.vhosts.contains_key(&request.vhost) {
            return Err(ServiceError::NotFound(format!(
                "no vhost '{}'",
                request.vhost
            )));
        }
        let mut names: Vec<String> = broker
            .vhosts
            .keys()
            .filter(|name| whole || **name == request.vhost)
            .cloned()
            .collect();
        names.sort();
        names
    };
    let mut definitions = m::Definitions::default();
    for name in vhost_names {
        let Some(sources) = export_vhost_head(shared, &name, &mut definitions) else {
            // Deleted meanwhile.
            continue;
        };
        if whole {
            definitions.vhosts.push(name.clone());
        }
        // The queues exported: the only ones a binding may lead to, so
        // that the file imports whatever was declared meanwhile.
        let mut exported: HashSet<String> = HashSet::new();
        let walked = walk_queues(shared, &name, |_, queue| {
            if queue.stores_messages() {
                exported.insert(queue.name.clone());
                definitions.queues.push(m::CreateQueueRequest {
                    vhost: name.clone(),
                    name: queue.name.clone(),
                    durable: queue.durable,
                    auto_delete: queue.auto_delete,
                    arguments: argument_map(&queue.arguments),
                });
            }
        })
        .await;
        if walked.is_err() {
            continue;
        }
        for source in &sources {
            let ends = ExportedEnds {
                queues: &exported,
                exchanges: &sources,
            };
            export_bindings(shared, &name, source, ends, &mut definitions.bindings);
            tokio::task::yield_now().await;
        }
    }
    if whole {
        let access = shared.access.read();
        let mut users: Vec<&User> = access.users();
        users.sort_by(|a, b| a.name.cmp(&b.name));
        definitions
            .users
            .extend(users.into_iter().map(|user| m::DefinedUser {
                name: user.name.clone(),
                password_hash: user.password_hash.clone().into(),
                tags: user.tags.clone(),
            }));
        definitions
            .permissions
            .extend(access.list_permissions(None, None).into_iter().map(
                |(user, vhost, granted)| m::SetPermissionsRequest {
                    user: user.to_string(),
                    vhost: vhost.to_string(),
                    configure: granted.configure.source().to_string(),
                    write: granted.write.source().to_string(),
                    read: granted.read.source().to_string(),
                },
            ));
        definitions
            .permissions
            .sort_by(|a, b| (&a.user, &a.vhost).cmp(&(&b.user, &b.vhost)));
    }
    Ok(definitions)
}

/// A vhost's policies and durable exchanges, under one hold of the lock;
/// the names of those exchanges, whose bindings come next. `None` when the
/// vhost is gone.
fn export_vhost_head(
    shared: &Shared,
    name: &str,
    definitions: &mut m::Definitions,
) -> Option<Vec<String>> {
    let broker = shared.broker.lock();
    let vhost = broker.vhosts.get(name)?;
    for operator in [false, true] {
        definitions
            .policies
            .extend(broker.list_policies(name, operator).unwrap_or_default());
    }
    let mut exchanges: Vec<_> = vhost
        .exchanges
        .values()
        .filter(|x| x.durable && !x.is_builtin())
        .collect();
    exchanges.sort_by(|a, b| a.name.cmp(&b.name));
    definitions
        .exchanges
        .extend(exchanges.iter().map(|x| m::CreateExchangeRequest {
            vhost: name.to_string(),
            name: x.name.clone(),
            kind: x.kind_name().to_string(),
            durable: x.durable,
            auto_delete: x.auto_delete,
            internal: x.internal,
            arguments: argument_map(&x.arguments),
        }));
    Some(exchanges.into_iter().map(|x| x.name.clone()).collect())
}

/// What a vhost's export holds so far: its queues and its (durable, not
/// built-in) exchanges, sorted.
#[derive(Clone, Copy)]
struct ExportedEnds<'a> {
    queues: &'a HashSet<String>,
    exchanges: &'a [String],
}

/// The bindings of the exchange `source` between durable ends that the
/// export holds (or built-in exchanges), under one hold of the lock.
fn export_bindings(
    shared: &Shared,
    vhost_name: &str,
    source: &str,
    ends: ExportedEnds<'_>,
    into: &mut Vec<m::Binding>,
) {
    let broker = shared.broker.lock();
    let Some(vhost) = broker.vhosts.get(vhost_name) else {
        return;
    };
    let Some(exchange) = vhost.exchanges.get(source) else {
        return;
    };
    let durable_end = |destination: &Destination| match destination {
        Destination::Queue(queue) => {
            ends.queues.contains(queue)
                && vhost.queues.get(queue).is_some_and(|q| q.stores_messages())
        }
        Destination::Exchange(name) => vhost.exchanges.get(name).is_some_and(|x| {
            x.durable && (x.is_builtin() || ends.exchanges.binary_search(name).is_ok())
        }),
    };
    let mut bindings: Vec<&Binding> = exchange
        .bindings
        .iter()
        .filter(|b| durable_end(&b.destination))
        .collect();
    bindings.sort_by(|a, b| {
        (a.destination.name(), &a.routing_key).cmp(&(b.destination.name(), &b.routing_key))
    });
    into.extend(bindings.into_iter().map(|b| m::Binding {
        vhost: vhost_name.to_string(),
        source: exchange.name.clone(),
        destination: b.destination.name().to_string(),
        destination_is_exchange: matches!(b.destination, Destination::Exchange(_)),
        routing_key: b.routing_key.clone(),
        arguments: argument_map(&b.arguments),
    }));
    parking_lot::MutexGuard::unlock_fair(broker);
}

// ----------------------------------------------------------------- import

/// An import after step 1: every item checked alone.
struct Checked {
    vhosts: Vec<String>,
    users: Vec<User>,
    permissions: Vec<(String, String, Permissions)>,
    policies: Vec<(String, Policy)>,
    exchanges: Vec<(m::CreateExchangeRequest, Bytes)>,
    queues: Vec<(m::CreateQueueRequest, Bytes)>,
    bindings: Vec<(m::Binding, Bytes)>,
}

/// Step 1: each item alone.
fn check_items(definitions: m::Definitions) -> Result<Checked, ServiceError> {
    let size = definitions.encoded_len();
    if size > MAX_IMPORT_BYTES {
        return Err(invalid(format!(
            "definitions of {size} bytes are more than one import takes ({MAX_IMPORT_BYTES}): import them a vhost at a time"
        )));
    }
    let items = definitions.vhosts.len()
        + definitions.users.len()
        + definitions.permissions.len()
        + definitions.policies.len()
        + definitions.exchanges.len()
        + definitions.queues.len()
        + definitions.bindings.len();
    if items > MAX_IMPORTED_ITEMS {
        return Err(invalid(format!(
            "{items} definitions are more than one import takes ({MAX_IMPORTED_ITEMS}): import them a vhost at a time"
        )));
    }
    for vhost in &definitions.vhosts {
        check_name("vhost", vhost)?;
    }
    let users = definitions
        .users
        .into_iter()
        .map(|u| User::with_hash(&u.name, u.password_hash.to_vec(), u.tags).map_err(access_error))
        .collect::<Result<Vec<_>, _>>()?;
    let permissions = definitions
        .permissions
        .into_iter()
        .map(|p| {
            let granted = Permissions::new(&p.configure, &p.write, &p.read).map_err(|error| {
                invalid(format!(
                    "permissions of user '{}' in vhost '{}': {}",
                    p.user,
                    p.vhost,
                    AccessError::from(error)
                ))
            })?;
            Ok((p.user, p.vhost, granted))
        })
        .collect::<Result<Vec<_>, ServiceError>>()?;
    let policies = definitions
        .policies
        .into_iter()
        .map(|p| {
            let policy = Policy::new(
                &p.name,
                p.operator,
                &p.pattern,
                &p.apply_to,
                p.priority,
                &p.definition,
            )
            .map_err(|error| {
                invalid(format!(
                    "policy '{}' in vhost '{}': {}",
                    p.name, p.vhost, error.0
                ))
            })?;
            Ok((p.vhost, policy))
        })
        .collect::<Result<Vec<_>, ServiceError>>()?;
    let exchanges = definitions
        .exchanges
        .into_iter()
        .map(|x| {
            check_name("exchange", &x.name)?;
            let arguments = encode_arguments(&x.arguments)?;
            Ok((x, arguments))
        })
        .collect::<Result<Vec<_>, ServiceError>>()?;
    let queues = definitions
        .queues
        .into_iter()
        .map(|q| {
            check_name("queue", &q.name)?;
            let arguments = encode_arguments(&q.arguments)?;
            Ok((q, arguments))
        })
        .collect::<Result<Vec<_>, ServiceError>>()?;
    let bindings = definitions
        .bindings
        .into_iter()
        .map(|b| {
            check_name("source exchange", &b.source)?;
            check_name("destination", &b.destination)?;
            let arguments = encode_arguments(&b.arguments)?;
            Ok((b, arguments))
        })
        .collect::<Result<Vec<_>, ServiceError>>()?;
    Ok(Checked {
        vhosts: definitions.vhosts,
        users,
        permissions,
        policies,
        exchanges,
        queues,
        bindings,
    })
}

/// Step 2: against what exists.
fn check_against(
    broker: &Broker,
    access: &AccessControl,
    checked: &Checked,
) -> Result<(), ServiceError> {
    let new_vhosts: HashSet<&str> = checked.vhosts.iter().map(String::as_str).collect();
    let vhost_known = |vhost: &str, what: &dyn Fn() -> String| {
        if broker.vhosts.contains_key(vhost) || new_vhosts.contains(vhost) {
            Ok(())
        } else {
            Err(invalid(format!(
                "{}: no vhost '{vhost}' (neither on the broker nor in the definitions)",
                what()
            )))
        }
    };
    for (x, _) in &checked.exchanges {
        vhost_known(&x.vhost, &|| format!("exchange '{}'", x.name))?;
    }
    for (q, _) in &checked.queues {
        vhost_known(&q.vhost, &|| format!("queue '{}'", q.name))?;
    }
    for (b, _) in &checked.bindings {
        vhost_known(&b.vhost, &|| {
            format!("binding of '{}' to '{}'", b.source, b.destination)
        })?;
    }
    let new_users: HashSet<&str> = checked.users.iter().map(|u| u.name.as_str()).collect();
    for (user, vhost, _) in &checked.permissions {
        vhost_known(vhost, &|| format!("permissions of user '{user}'"))?;
        if !access.has_user(user) && !new_users.contains(user.as_str()) {
            return Err(invalid(format!(
                "permissions in vhost '{vhost}': no user '{user}' (neither on the broker nor in the definitions)"
            )));
        }
    }
    let mut added: HashMap<(&str, bool), HashSet<&str>> = HashMap::new();
    for (vhost, policy) in &checked.policies {
        vhost_known(vhost, &|| format!("policy '{}'", policy.name))?;
        let exists = broker.vhosts.get(vhost).is_some_and(|v| {
            let set = if policy.operator {
                &v.operator_policies
            } else {
                &v.policies
            };
            set.get(&policy.name).is_some()
        });
        if !exists {
            added
                .entry((vhost.as_str(), policy.operator))
                .or_default()
                .insert(policy.name.as_str());
        }
    }
    for ((vhost, operator), names) in added {
        let present = broker.vhosts.get(vhost).map_or(0, |v| {
            if operator {
                v.operator_policies.len()
            } else {
                v.policies.len()
            }
        });
        if present + names.len() > MAX_POLICIES_PER_VHOST {
            return Err(ServiceError::FailedPrecondition(format!(
                "vhost '{vhost}' would have more than {MAX_POLICIES_PER_VHOST} policies"
            )));
        }
    }
    Ok(())
}

/// What this import made, to undo if a later item is refused.
enum Made {
    Vhost(String),
    Exchange {
        vhost: String,
        name: String,
    },
    Queue {
        vhost: String,
        name: String,
    },
    Binding {
        vhost: String,
        source: String,
        binding: Binding,
    },
}

/// The internal sessions an import declares through, one per vhost.
#[derive(Default)]
struct Sessions(HashMap<String, SessionId>);

impl Sessions {
    fn of(
        &mut self,
        broker: &mut Broker,
        engine: &Engine,
        vhost: &str,
    ) -> Result<SessionId, ServiceError> {
        if let Some(id) = self.0.get(vhost) {
            return Ok(*id);
        }
        let id = engine.open_internal_session(broker, vhost)?;
        self.0.insert(vhost.to_string(), id);
        Ok(id)
    }

    fn close(self, broker: &mut Broker) {
        for id in self.0.into_values() {
            broker.close_session(id);
        }
    }
}

/// Step 3, the part that may be refused: vhosts, exchanges, queues and
/// bindings, each through the broker's own declaration. Returns what was
/// made; on a refusal, what was made is undone first.
fn apply_topology(
    broker: &mut Broker,
    engine: &Engine,
    sessions: &mut Sessions,
    checked: &Checked,
) -> Result<Vec<Made>, ServiceError> {
    let mut made = Vec::new();
    let result = declare_all(broker, engine, sessions, checked, &mut made);
    if let Err(refusal) = result {
        undo(broker, made);
        return Err(refusal);
    }
    Ok(made)
}

fn declare_all(
    broker: &mut Broker,
    engine: &Engine,
    sessions: &mut Sessions,
    checked: &Checked,
    made: &mut Vec<Made>,
) -> Result<(), ServiceError> {
    for name in &checked.vhosts {
        if broker.vhosts.contains_key(name) {
            continue;
        }
        broker
            .vhosts
            .insert(name.clone(), crate::vhost::VHost::new(name));
        engine.shared.writer.submit_synced(
            vec![store_op(write_op::Op::PutVhost(store::VhostDefinition {
                name: name.clone(),
            }))],
            None,
        );
        made.push(Made::Vhost(name.clone()));
    }
    let exchange_exists = |broker: &Broker, vhost: &str, name: &str| {
        broker
            .vhosts
            .get(vhost)
            .is_some_and(|v| v.exchanges.contains_key(name))
    };
    let queue_exists = |broker: &Broker, vhost: &str, name: &str| {
        broker
            .vhosts
            .get(vhost)
            .is_some_and(|v| v.queues.contains_key(name))
    };
    for (x, arguments) in &checked.exchanges {
        let session = sessions.of(broker, engine, &x.vhost)?;
        let existed = exchange_exists(broker, &x.vhost, &x.name);
        broker
            .declare_exchange(
                session,
                &pb::ExchangeDeclare {
                    request_id: 0,
                    channel: CHANNEL,
                    exchange: x.name.clone(),
                    kind: x.kind.clone(),
                    passive: false,
                    durable: x.durable,
                    auto_delete: x.auto_delete,
                    internal: x.internal,
                    arguments: arguments.clone(),
                },
            )
            .map_err(|error| refused("exchange", &x.name, &x.vhost, error))?;
        if !existed {
            made.push(Made::Exchange {
                vhost: x.vhost.clone(),
                name: x.name.clone(),
            });
        }
    }
    for (q, arguments) in &checked.queues {
        let session = sessions.of(broker, engine, &q.vhost)?;
        // `x-qpid-dlq-enabled` may make a dead-letter queue and exchange
        // beside the queue: undone with it.
        let side_queue = qpid_dead_letter_queue(&q.name);
        let side_exchange = qpid_dead_letter_exchange(&q.name);
        let existed = [
            queue_exists(broker, &q.vhost, &q.name),
            queue_exists(broker, &q.vhost, &side_queue),
            exchange_exists(broker, &q.vhost, &side_exchange),
        ];
        broker
            .declare_queue(
                session,
                &pb::QueueDeclare {
                    request_id: 0,
                    channel: CHANNEL,
                    queue: q.name.clone(),
                    passive: false,
                    durable: q.durable,
                    exclusive: false,
                    auto_delete: q.auto_delete,
                    arguments: arguments.clone(),
                },
            )
            .map_err(|error| refused("queue", &q.name, &q.vhost, error))?;
        for (existed, name, is_queue) in [
            (existed[0], &q.name, true),
            (existed[1], &side_queue, true),
            (existed[2], &side_exchange, false),
        ] {
            let now = if is_queue {
                queue_exists(broker, &q.vhost, name)
            } else {
                exchange_exists(broker, &q.vhost, name)
            };
            if existed || !now {
                continue;
            }
            let (vhost, name) = (q.vhost.clone(), name.clone());
            made.push(if is_queue {
                Made::Queue { vhost, name }
            } else {
                Made::Exchange { vhost, name }
            });
        }
    }
    for (b, arguments) in &checked.bindings {
        let session = sessions.of(broker, engine, &b.vhost)?;
        let destination = if b.destination_is_exchange {
            Destination::Exchange(b.destination.clone())
        } else {
            Destination::Queue(b.destination.clone())
        };
        let probe = Binding {
            destination,
            routing_key: b.routing_key.clone(),
            arguments: amqp::decode_table(arguments)
                .map_err(|error| invalid(format!("binding arguments: {error}")))?,
        };
        let existed = broker
            .vhosts
            .get(&b.vhost)
            .and_then(|v| v.exchanges.get(&b.source))
            .is_some_and(|x| x.bindings.contains(&probe));
        let result = if b.destination_is_exchange {
            broker.bind_exchange(
                session,
                &pb::ExchangeBind {
                    request_id: 0,
                    channel: CHANNEL,
                    destination: b.destination.clone(),
                    source: b.source.clone(),
                    routing_key: b.routing_key.clone(),
                    arguments: arguments.clone(),
                },
            )
        } else {
            broker.bind_queue(
                session,
                &pb::QueueBind {
                    request_id: 0,
                    channel: CHANNEL,
                    queue: b.destination.clone(),
                    exchange: b.source.clone(),
                    routing_key: b.routing_key.clone(),
                    arguments: arguments.clone(),
                },
            )
        };
        result.map_err(|error| {
            refused(
                "binding",
                &format!("{} -> {}", b.source, b.destination),
                &b.vhost,
                error,
            )
        })?;
        if !existed {
            made.push(Made::Binding {
                vhost: b.vhost.clone(),
                source: b.source.clone(),
                binding: probe,
            });
        }
    }
    Ok(())
}

/// A declaration's refusal, naming the item (the AMQP words stay: a
/// RabbitMQ user knows `PRECONDITION_FAILED - inequivalent arg ...`).
fn refused(kind: &str, name: &str, vhost: &str, error: pb::AmqpError) -> ServiceError {
    match service_error(error) {
        ServiceError::InvalidArgument(text) => invalid(naming(kind, name, vhost, &text)),
        ServiceError::FailedPrecondition(text) => {
            ServiceError::FailedPrecondition(naming(kind, name, vhost, &text))
        }
        // What an item needs and does not find (a binding's queue) is a
        // fault of the definitions, not a missing URL.
        ServiceError::NotFound(text) | ServiceError::PermissionDenied(text) => {
            invalid(naming(kind, name, vhost, &text))
        }
        other => other,
    }
}

/// `text` after the item it is about; the vhost is named once, where the
/// AMQP text does not already name it.
fn naming(kind: &str, name: &str, vhost: &str, text: &str) -> String {
    if text.contains(&format!("in vhost '{vhost}'")) {
        format!("{kind} '{name}': {text}")
    } else {
        format!("{kind} '{name}' in vhost '{vhost}': {text}")
    }
}

/// Takes back, newest first, what an import made in memory. Its store
/// writes are dropped with the capture, so nothing here reaches the store.
fn undo(broker: &mut Broker, made: Vec<Made>) {
    for item in made.into_iter().rev() {
        match item {
            Made::Binding {
                vhost,
                source,
                binding,
            } => {
                if let Some(exchange) = broker
                    .vhosts
                    .get_mut(&vhost)
                    .and_then(|v| v.exchanges.get_mut(&source))
                {
                    exchange.bindings.remove(&binding);
                }
            }
            Made::Queue { vhost, name } => broker.remove_queue(&vhost, &name),
            Made::Exchange { vhost, name } => broker.remove_exchange(&vhost, &name),
            Made::Vhost(name) => {
                broker.vhosts.remove(&name);
                broker.limits.forget_vhost(&name);
            }
        }
    }
}

/// Step 3, the part that cannot be refused once step 2 passed: users,
/// permissions, and the policies put in their vhosts' sets (applied by the
/// caller after the batch). Returns the vhosts whose policies changed.
fn apply_access_and_policies(
    broker: &mut Broker,
    access: &mut AccessControl,
    shared: &Shared,
    checked: Checked,
) -> Result<HashSet<String>, ServiceError> {
    for user in checked.users {
        let definition = user.definition();
        access.insert_user(user);
        shared
            .writer
            .submit_synced(vec![store_op(write_op::Op::PutUser(definition))], None);
    }
    for (user, vhost, granted) in checked.permissions {
        let definition = granted.definition(&user, &vhost);
        access
            .set_permissions(&user, &vhost, granted)
            .map_err(access_error)?;
        shared.writer.submit_synced(
            vec![store_op(write_op::Op::PutPermission(definition))],
            None,
        );
    }
    let mut changed = HashSet::new();
    for (vhost_name, policy) in checked.policies {
        let definition = policy.definition(&vhost_name);
        let vhost = broker
            .vhosts
            .get_mut(&vhost_name)
            .ok_or_else(|| ServiceError::NotFound(format!("no vhost '{vhost_name}'")))?;
        vhost.policy_set_mut(policy.operator).insert(policy);
        shared
            .writer
            .submit_synced(vec![store_op(write_op::Op::PutPolicy(definition))], None);
        changed.insert(vhost_name);
    }
    Ok(changed)
}

pub(crate) async fn import(
    engine: &Engine,
    request: m::ImportDefinitionsRequest,
) -> Result<m::ImportDefinitionsResponse, ServiceError> {
    let shared = &engine.shared;
    let checked = check_items(request.definitions.unwrap_or_default())?;
    let mut counts = m::ImportDefinitionsResponse {
        users: checked.users.len() as u32,
        permissions: checked.permissions.len() as u32,
        policies: checked.policies.len() as u32,
        ..Default::default()
    };
    let (done, written) = oneshot::channel();
    {
        let mut broker = shared.broker.lock();
        let mut access = shared.access.write();
        check_against(&broker, &access, &checked)?;
        let mut sessions = Sessions::default();
        let applied = shared.writer.capture(
            || {
                let made = apply_topology(&mut broker, engine, &mut sessions, &checked)?;
                let policies =
                    apply_access_and_policies(&mut broker, &mut access, shared, checked)?;
                Ok::<_, ServiceError>((made, policies))
            },
            done,
        );
        sessions.close(&mut broker);
        let ((made, policy_vhosts), write) = applied?;
        for item in &made {
            match item {
                Made::Vhost(_) => counts.vhosts += 1,
                Made::Exchange { .. } => counts.exchanges += 1,
                Made::Queue { .. } => counts.queues += 1,
                Made::Binding { .. } => counts.bindings += 1,
            }
        }
        shared.writer.submit_captured(write);
        shared
            .access_generation
            .store(access.generation(), Ordering::Release);
        drop(access);
        // The policies' effect on what exists, in store order after the
        // batch (a max-length trims, a TTL expires).
        for vhost in policy_vhosts {
            for queue in broker.apply_policies(&vhost) {
                broker.dispatch(&vhost, &queue);
            }
        }
    }
    await_written(written, "the definitions").await?;
    tracing::info!(
        vhosts = counts.vhosts,
        users = counts.users,
        permissions = counts.permissions,
        policies = counts.policies,
        exchanges = counts.exchanges,
        queues = counts.queues,
        bindings = counts.bindings,
        "definitions imported by management"
    );
    Ok(counts)
}

impl Engine {
    /// The broker's definitions (or one vhost's): [`export`].
    pub(crate) async fn export_definitions(
        &self,
        request: m::ExportDefinitionsRequest,
    ) -> Result<m::Definitions, ServiceError> {
        export(&self.shared, &request).await
    }

    /// Definitions applied all at once, or not at all: [`import`].
    pub(crate) async fn import_definitions(
        &self,
        request: m::ImportDefinitionsRequest,
    ) -> Result<m::ImportDefinitionsResponse, ServiceError> {
        import(self, request).await
    }
}

#[cfg(test)]
mod tests {
    use super::naming;

    #[test]
    fn a_refusal_names_the_vhost_once() {
        assert_eq!(
            naming("binding", "q", "/", "NOT_FOUND - no queue 'q' in vhost '/'"),
            "binding 'q': NOT_FOUND - no queue 'q' in vhost '/'"
        );
        assert_eq!(
            naming(
                "queue",
                "q",
                "v1",
                "PRECONDITION_FAILED - inequivalent arg 'durable'"
            ),
            "queue 'q' in vhost 'v1': PRECONDITION_FAILED - inequivalent arg 'durable'"
        );
    }
}
