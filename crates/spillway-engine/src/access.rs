//! Who may connect and what they may do, as RabbitMQ's internal user
//! database has it: users with salted password hashes and tags, and per
//! user and vhost three regular expressions — `configure` (declare and
//! delete queues and exchanges), `write` (publish to an exchange, bind to a
//! queue or exchange) and `read` (consume, get and purge a queue, bind from
//! an exchange). Stored in the storage node (`u` and `a` records); the
//! configuration's users are the seed of a store that has none.
//!
//! A user without a permission in a vhost cannot open it. The checks
//! themselves are made per session command by [`SessionAccess`], which
//! caches each name's answer until permissions change.

use foldhash::HashMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use spillway_proto::engine::session_command::Command;
use spillway_proto::permissions::InvalidPattern;
pub use spillway_proto::permissions::{
    Access, Pattern, Permissions, Requirement, Resource, MAX_PATTERN_LEN,
};
use spillway_proto::storage::{PermissionDefinition, UserDefinition};

/// The longest user name and vhost name accepted (user and vhost names are AMQP short strings on the wire anyway).
pub const MAX_NAME_LEN: usize = 255;
/// The longest password accepted.
pub const MAX_PASSWORD_LEN: usize = 4096;
/// A stored password hash: a 4-byte salt, then SHA-256(salt ++ password).
pub const SALTED_HASH_LEN: usize = 4 + 32;
/// How many names one session remembers the answer for, per kind of access.
const CACHED_NAMES: usize = 1024;

/// Why a login was refused (the client hears only "Login was refused").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoginRefusal {
    /// No such user, a wrong password, or a user without a password
    /// logging in with one.
    InvalidCredentials,
    /// A loopback-only user (guest) from another address.
    LoopbackOnly,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AccessError {
    #[error("{0}")]
    Invalid(String),
    #[error("no user '{0}'")]
    NoUser(String),
}

impl From<InvalidPattern> for AccessError {
    fn from(InvalidPattern(text): InvalidPattern) -> Self {
        AccessError::Invalid(text)
    }
}

/// One user as stored (never the password).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct User {
    pub name: String,
    /// A 4-byte salt, then SHA-256(salt ++ password); empty: no password
    /// login (EXTERNAL only).
    pub password_hash: Vec<u8>,
    pub tags: Vec<String>,
    pub loopback_only: bool,
}

impl User {
    pub fn definition(&self) -> UserDefinition {
        UserDefinition {
            name: self.name.clone(),
            password_hash: self.password_hash.clone().into(),
            tags: self.tags.clone(),
            loopback_only: self.loopback_only,
        }
    }

    /// A user as a definitions file gives it: a password hash in RabbitMQ's
    /// `rabbit_password_hashing_sha256` layout (4-byte salt, 32-byte hash)
    /// or none (no password login).
    pub fn with_hash(
        name: &str,
        password_hash: Vec<u8>,
        tags: Vec<String>,
    ) -> Result<Self, AccessError> {
        check_name("user", name)?;
        for tag in &tags {
            check_name("tag", tag)?;
        }
        if !(password_hash.is_empty() || password_hash.len() == SALTED_HASH_LEN) {
            return Err(AccessError::Invalid(format!(
                "user '{name}': a password hash is {SALTED_HASH_LEN} bytes (a 4-byte salt and a SHA-256 hash), not {}",
                password_hash.len()
            )));
        }
        Ok(Self {
            name: name.to_string(),
            password_hash,
            tags,
            loopback_only: false,
        })
    }

    pub fn has_tag(&self, tag: &str) -> bool {
        self.tags.iter().any(|t| t == tag)
    }
}

/// The user database: users, and permissions by (user, vhost).
#[derive(Debug, Default)]
pub struct AccessControl {
    users: HashMap<String, User>,
    permissions: HashMap<(String, String), Arc<Permissions>>,
    /// Bumped by every change, so sessions know to drop their caches.
    generation: u64,
}

impl AccessControl {
    /// The stored users and permissions, as recovery reads them. A record
    /// whose pattern no longer compiles grants nothing (and is logged).
    pub fn from_definitions(
        users: Vec<UserDefinition>,
        permissions: Vec<PermissionDefinition>,
    ) -> Self {
        let mut access = Self::default();
        for def in users {
            access.users.insert(
                def.name.clone(),
                User {
                    name: def.name,
                    password_hash: def.password_hash.to_vec(),
                    tags: def.tags,
                    loopback_only: def.loopback_only,
                },
            );
        }
        for def in permissions {
            match Permissions::new(&def.configure, &def.write, &def.read) {
                Ok(granted) => {
                    access
                        .permissions
                        .insert((def.user, def.vhost), Arc::new(granted));
                }
                Err(error) => {
                    tracing::warn!(user = %def.user, vhost = %def.vhost, %error, "stored permission skipped");
                }
            }
        }
        access
    }

    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Checks a login. `password` is None for EXTERNAL (the TLS layer
    /// vouched for the name).
    pub fn authenticate(
        &self,
        user: &str,
        password: Option<&str>,
        peer_is_loopback: bool,
    ) -> Result<&User, LoginRefusal> {
        let found = self.users.get(user);
        let accepted = match (found, password) {
            (Some(user), Some(password)) => password_matches(&user.password_hash, password),
            (Some(_), None) => true,
            (None, Some(password)) => {
                // As much work as a real check, so that timing does not
                // tell which names exist.
                let _ = password_matches(&[0; 36], password);
                false
            }
            (None, None) => false,
        };
        let user = found
            .filter(|_| accepted)
            .ok_or(LoginRefusal::InvalidCredentials)?;
        if user.loopback_only && !peer_is_loopback {
            return Err(LoginRefusal::LoopbackOnly);
        }
        Ok(user)
    }

    pub fn user(&self, name: &str) -> Option<&User> {
        self.users.get(name)
    }

    /// Every user, by name.
    pub fn users(&self) -> Vec<&User> {
        let mut users: Vec<&User> = self.users.values().collect();
        users.sort_by(|a, b| a.name.cmp(&b.name));
        users
    }

    pub fn permissions(&self, user: &str, vhost: &str) -> Option<Arc<Permissions>> {
        self.permissions
            .get(&(user.to_string(), vhost.to_string()))
            .cloned()
    }

    /// Every permission, by user then vhost, optionally of one user or in
    /// one vhost.
    pub fn list_permissions(
        &self,
        user: Option<&str>,
        vhost: Option<&str>,
    ) -> Vec<(&str, &str, &Permissions)> {
        let mut listed: Vec<(&str, &str, &Permissions)> = self
            .permissions
            .iter()
            .filter(|((u, v), _)| {
                user.is_none_or(|want| want == u) && vhost.is_none_or(|want| want == v)
            })
            .map(|((u, v), p)| (u.as_str(), v.as_str(), p.as_ref()))
            .collect();
        listed.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        listed
    }

    /// Adds or replaces a user. `password`: Some to set it (empty = no
    /// password login), None to keep the stored hash (an update of tags).
    pub fn put_user(
        &mut self,
        name: &str,
        password: Option<&str>,
        tags: Vec<String>,
        loopback_only: bool,
    ) -> Result<User, AccessError> {
        check_name("user", name)?;
        if password.is_some_and(|p| p.len() > MAX_PASSWORD_LEN) {
            return Err(AccessError::Invalid(format!(
                "a password is at most {MAX_PASSWORD_LEN} bytes"
            )));
        }
        for tag in &tags {
            check_name("tag", tag)?;
        }
        let password_hash = match (password, self.users.get(name)) {
            (Some(""), _) => Vec::new(),
            (Some(password), _) => hash_password(password),
            (None, Some(existing)) => existing.password_hash.clone(),
            (None, None) => {
                return Err(AccessError::Invalid(format!(
                    "user '{name}' does not exist: a new user needs a password"
                )))
            }
        };
        let user = User {
            name: name.to_string(),
            password_hash,
            tags,
            loopback_only,
        };
        self.users.insert(name.to_string(), user.clone());
        self.generation += 1;
        Ok(user)
    }

    /// Adds or replaces a user checked by [`User::with_hash`] (a
    /// definitions import). A replaced user keeps its `loopback_only`.
    pub fn insert_user(&mut self, mut user: User) {
        if let Some(existing) = self.users.get(&user.name) {
            user.loopback_only = existing.loopback_only;
        }
        self.users.insert(user.name.clone(), user);
        self.generation += 1;
    }

    /// Whether a user of that name exists.
    pub fn has_user(&self, name: &str) -> bool {
        self.users.contains_key(name)
    }

    /// Removes a user and every permission of theirs.
    pub fn delete_user(&mut self, name: &str) -> Result<User, AccessError> {
        let user = self
            .users
            .remove(name)
            .ok_or_else(|| AccessError::NoUser(name.to_string()))?;
        self.permissions.retain(|(u, _), _| u != name);
        self.generation += 1;
        Ok(user)
    }

    pub fn set_permissions(
        &mut self,
        user: &str,
        vhost: &str,
        granted: Permissions,
    ) -> Result<(), AccessError> {
        if !self.users.contains_key(user) {
            return Err(AccessError::NoUser(user.to_string()));
        }
        self.permissions
            .insert((user.to_string(), vhost.to_string()), Arc::new(granted));
        self.generation += 1;
        Ok(())
    }

    /// Whether the user had a permission in the vhost.
    pub fn clear_permissions(&mut self, user: &str, vhost: &str) -> bool {
        let cleared = self
            .permissions
            .remove(&(user.to_string(), vhost.to_string()))
            .is_some();
        self.generation += 1;
        cleared
    }

    /// Forgets every permission in a deleted vhost; the (user, vhost)
    /// pairs, for the store.
    pub fn forget_vhost(&mut self, vhost: &str) -> Vec<(String, String)> {
        let gone: Vec<(String, String)> = self
            .permissions
            .keys()
            .filter(|(_, v)| v == vhost)
            .cloned()
            .collect();
        for key in &gone {
            self.permissions.remove(key);
        }
        self.generation += 1;
        gone
    }
}

fn check_name(what: &str, name: &str) -> Result<(), AccessError> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(AccessError::Invalid(format!(
            "a {what} name is 1 to {MAX_NAME_LEN} bytes"
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(AccessError::Invalid(format!(
            "a {what} name has no control characters"
        )));
    }
    Ok(())
}

/// RabbitMQ's `rabbit_password_hashing_sha256`: a random 4-byte salt, then
/// SHA-256(salt ++ password). The same layout RabbitMQ's definitions
/// export holds (base64 there).
pub fn hash_password(password: &str) -> Vec<u8> {
    let salt: [u8; 4] = rand::random();
    salted_hash(&salt, password)
}

fn salted_hash(salt: &[u8; 4], password: &str) -> Vec<u8> {
    let mut hasher = Sha256::new();
    hasher.update(salt);
    hasher.update(password.as_bytes());
    let mut hash = salt.to_vec();
    hash.extend_from_slice(&hasher.finalize());
    hash
}

/// Whether `password` hashes to `stored` (constant time in the hash).
pub fn password_matches(stored: &[u8], password: &str) -> bool {
    let Some(salt) = stored.get(..4).and_then(|s| <[u8; 4]>::try_from(s).ok()) else {
        return false;
    };
    let computed = salted_hash(&salt, password);
    computed.len() == stored.len()
        && computed
            .iter()
            .zip(stored)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// One session's view of its user's permissions in its vhost, with each
/// name's answer cached until the database changes.
#[derive(Debug)]
pub struct SessionAccess {
    user: String,
    vhost: String,
    /// None once the permission was cleared: nothing is allowed.
    permissions: Option<Arc<Permissions>>,
    generation: u64,
    cache: [HashMap<String, bool>; 3],
}

impl SessionAccess {
    pub fn new(user: &str, vhost: &str, permissions: Arc<Permissions>, generation: u64) -> Self {
        Self {
            user: user.to_string(),
            vhost: vhost.to_string(),
            permissions: Some(permissions),
            generation,
            cache: Default::default(),
        }
    }

    /// Checks `access` to `name`; the refusal is RabbitMQ's 403 text.
    /// `current` is the database, read only when it changed since the
    /// last check (`generation`).
    pub fn check(
        &mut self,
        access: Access,
        resource: Resource,
        name: &str,
        generation: u64,
        current: impl FnOnce(&str, &str) -> Option<Arc<Permissions>>,
    ) -> Result<(), String> {
        if generation != self.generation {
            self.permissions = current(&self.user, &self.vhost);
            self.generation = generation;
            for cache in &mut self.cache {
                cache.clear();
            }
        }
        let checked = spillway_proto::permissions::checked_name(resource, name);
        let slot = access as usize;
        let allowed = match self.cache[slot].get(checked) {
            Some(allowed) => *allowed,
            None => {
                let allowed = self
                    .permissions
                    .as_ref()
                    .is_some_and(|p| p.pattern(access).allows(checked));
                if self.cache[slot].len() >= CACHED_NAMES {
                    self.cache[slot].clear();
                }
                self.cache[slot].insert(checked.to_string(), allowed);
                allowed
            }
        };
        if allowed {
            return Ok(());
        }
        Err(format!(
            "access to {} '{checked}' in vhost '{}' refused for user '{}'",
            resource.as_str(),
            self.vhost,
            self.user
        ))
    }
}

/// What a session command needs, as RabbitMQ checks it: up to two
/// (access, resource, name) checks. Passive declares need nothing; a queue
/// the server names is checked as `amq.gen-…`.
pub fn required(command: &Command) -> [Option<(Access, Resource, &str)>; 2] {
    use Access::{Configure, Read, Write};
    use Resource::{Exchange, Queue};
    match command {
        Command::Publish(cmd) => [Some((Write, Exchange, cmd.exchange.as_str())), None],
        // The direct reply-to pseudo-queue is every client's own (RabbitMQ
        // checks nothing there either).
        Command::Consume(cmd) if cmd.queue == crate::broker::direct_reply::PSEUDO_QUEUE => {
            [None, None]
        }
        Command::Consume(cmd) => [Some((Read, Queue, cmd.queue.as_str())), None],
        Command::Get(cmd) => [Some((Read, Queue, cmd.queue.as_str())), None],
        Command::QueuePurge(cmd) => [Some((Read, Queue, cmd.queue.as_str())), None],
        Command::QueueDelete(cmd) => [Some((Configure, Queue, cmd.queue.as_str())), None],
        Command::QueueDeclare(cmd) if !cmd.passive => {
            let name = if cmd.queue.is_empty() {
                "amq.gen-"
            } else {
                cmd.queue.as_str()
            };
            [Some((Configure, Queue, name)), None]
        }
        Command::ExchangeDeclare(cmd) if !cmd.passive => {
            [Some((Configure, Exchange, cmd.exchange.as_str())), None]
        }
        Command::ExchangeDelete(cmd) => [Some((Configure, Exchange, cmd.exchange.as_str())), None],
        Command::QueueBind(cmd) | Command::QueueUnbind(cmd) => [
            Some((Write, Queue, cmd.queue.as_str())),
            Some((Read, Exchange, cmd.exchange.as_str())),
        ],
        Command::ExchangeBind(cmd) | Command::ExchangeUnbind(cmd) => [
            Some((Write, Exchange, cmd.destination.as_str())),
            Some((Read, Exchange, cmd.source.as_str())),
        ],
        _ => [None, None],
    }
}

/// What a declare's arguments need beyond [`required`]: write on where a
/// queue dead-letters to, or on an exchange's alternate exchange
/// (RabbitMQ's rules; see [`spillway_proto::permissions`]). Arguments that
/// do not decode need nothing here: the declare itself refuses them.
pub fn argument_requirements(command: &Command) -> Vec<Requirement> {
    use spillway_proto::permissions::{alternate_exchange_requirements, dead_letter_requirements};
    let (arguments, declared) = match command {
        Command::QueueDeclare(cmd) if !cmd.passive => (&cmd.arguments, cmd.queue.as_str()),
        Command::ExchangeDeclare(cmd) if !cmd.passive => (&cmd.arguments, cmd.exchange.as_str()),
        _ => return Vec::new(),
    };
    if arguments.is_empty() {
        return Vec::new();
    }
    let Ok(table) = spillway_amqp::decode_table(arguments) else {
        return Vec::new();
    };
    match command {
        Command::QueueDeclare(_) => {
            let queue = if declared.is_empty() {
                "amq.gen-"
            } else {
                declared
            };
            let exchange = string_argument(&table, "x-dead-letter-exchange");
            let qpid_dlq = crate::broker::dlq_enabled(&table) == Some(true);
            dead_letter_requirements(queue, exchange.as_deref(), qpid_dlq)
        }
        _ => {
            let alternate = string_argument(&table, "alternate-exchange");
            alternate_exchange_requirements(declared, alternate.as_deref())
        }
    }
}

/// A string argument (long or short string); other types are the
/// declare's to refuse.
fn string_argument(table: &amq_protocol_types::FieldTable, key: &str) -> Option<String> {
    match table.inner().get(key)? {
        amq_protocol_types::AMQPValue::LongString(s) => {
            Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        amq_protocol_types::AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn passwords_are_salted_hashes_and_check_in_constant_shape() {
        let hash = hash_password("s3cret");
        assert_eq!(hash.len(), 36);
        assert!(password_matches(&hash, "s3cret"));
        assert!(!password_matches(&hash, "s3cre"));
        assert!(!password_matches(&[], "s3cret"));
        // Two hashes of one password differ by their salt.
        assert_ne!(hash_password("s3cret"), hash);
    }

    #[test]
    fn logins_refuse_unknown_users_wrong_passwords_and_remote_guests_alike() {
        let mut access = AccessControl::default();
        access
            .put_user("guest", Some("guest"), vec![], true)
            .unwrap();
        access.put_user("app", Some("pw"), vec![], false).unwrap();
        assert!(access.authenticate("app", Some("pw"), false).is_ok());
        assert!(access.authenticate("guest", Some("guest"), true).is_ok());
        assert_eq!(
            access.authenticate("app", Some("nope"), true).err(),
            Some(LoginRefusal::InvalidCredentials)
        );
        assert_eq!(
            access.authenticate("nobody", Some("pw"), true).err(),
            Some(LoginRefusal::InvalidCredentials)
        );
        assert_eq!(
            access.authenticate("guest", Some("guest"), false).err(),
            Some(LoginRefusal::LoopbackOnly)
        );
        // EXTERNAL: the name alone, for a known user.
        assert!(access.authenticate("app", None, false).is_ok());
        assert!(access.authenticate("nobody", None, false).is_err());
    }

    #[test]
    fn sessions_see_permission_changes_and_use_rabbitmq_words() {
        let mut access = AccessControl::default();
        access.put_user("app", Some("pw"), vec![], false).unwrap();
        access
            .set_permissions(
                "app",
                "/",
                Permissions::new("^app\\.", "^app\\.", "^app\\.").unwrap(),
            )
            .unwrap();
        let mut session = SessionAccess::new(
            "app",
            "/",
            access.permissions("app", "/").unwrap(),
            access.generation(),
        );
        let check = |session: &mut SessionAccess, access: &AccessControl, name: &str| {
            session.check(
                Access::Configure,
                Resource::Queue,
                name,
                access.generation(),
                |u, v| access.permissions(u, v),
            )
        };
        assert!(check(&mut session, &access, "app.orders").is_ok());
        assert_eq!(
            check(&mut session, &access, "other").unwrap_err(),
            "access to queue 'other' in vhost '/' refused for user 'app'"
        );
        access
            .set_permissions("app", "/", Permissions::all())
            .unwrap();
        assert!(check(&mut session, &access, "other").is_ok());
        access.clear_permissions("app", "/");
        assert!(check(&mut session, &access, "app.orders").is_err());
        // The default exchange is checked as amq.default.
        let refused = session
            .check(
                Access::Write,
                Resource::Exchange,
                "",
                access.generation(),
                |_, _| None,
            )
            .unwrap_err();
        assert!(refused.contains("exchange 'amq.default'"), "{refused}");
    }

    #[test]
    fn deleting_a_user_drops_their_permissions() {
        let mut access = AccessControl::default();
        access.put_user("app", Some("pw"), vec![], false).unwrap();
        access
            .set_permissions("app", "/", Permissions::all())
            .unwrap();
        access.delete_user("app").unwrap();
        assert!(access.permissions("app", "/").is_none());
        assert!(access
            .set_permissions("app", "/", Permissions::all())
            .is_err());
        assert!(access.put_user("app", None, vec![], false).is_err());
    }
}
