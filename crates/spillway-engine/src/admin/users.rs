//! Users and permissions, and management's login check: each change is made in the
//! engine's [`AccessControl`] and written to the store (synced) before it
//! is answered; sessions see it at their next check through the access
//! generation.

use std::sync::atomic::Ordering;

use spillway_proto::management as m;
use spillway_proto::storage::{write_op, WriteOp};
use spillway_proto::ServiceError;
use tokio::sync::oneshot;

use crate::access::{AccessControl, AccessError, Permissions, User};
use crate::broker::event;
use crate::engine::Engine;
use crate::persistence::{await_written, store_op};
use crate::shared::Shared;
use spillway_proto::engine::{self as pb, session_event::Event};

impl Engine {
    /// Management's login check: the same check as an AMQP login's, and on
    /// success what management needs to authorize the caller's calls.
    pub(crate) async fn authenticate_user(
        &self,
        request: pb::AuthenticateUserRequest,
    ) -> Result<pb::AuthenticateUserResponse, ServiceError> {
        let access = self.shared.access.read();
        let user = match access.authenticate(
            &request.user,
            Some(&request.password),
            request.peer_is_loopback,
        ) {
            Ok(user) => user,
            Err(refusal) => {
                let result = match refusal {
                    crate::access::LoginRefusal::InvalidCredentials => {
                        pb::LoginResult::InvalidCredentials
                    }
                    crate::access::LoginRefusal::LoopbackOnly => pb::LoginResult::LoopbackOnly,
                };
                return Ok(pb::AuthenticateUserResponse {
                    result: result as i32,
                    ..Default::default()
                });
            }
        };
        Ok(pb::AuthenticateUserResponse {
            result: pb::LoginResult::Accepted as i32,
            tags: user.tags.clone(),
            permissions: access
                .list_permissions(Some(&user.name), None)
                .into_iter()
                .map(|(user, vhost, granted)| permission_view(user, vhost, granted))
                .collect(),
        })
    }

    pub(crate) async fn list_users(
        &self,
        _request: m::ListUsersRequest,
    ) -> Result<m::ListUsersResponse, ServiceError> {
        Ok(m::ListUsersResponse {
            users: self
                .shared
                .access
                .read()
                .users()
                .into_iter()
                .map(user_view)
                .collect(),
        })
    }

    pub(crate) async fn put_user(
        &self,
        request: m::PutUserRequest,
    ) -> Result<m::User, ServiceError> {
        change(&self.shared, "the user", |access| {
            let user = access
                .put_user(
                    &request.name,
                    request.password.as_deref(),
                    request.tags,
                    request.loopback_only,
                )
                .map_err(service_error)?;
            let ops = vec![store_op(write_op::Op::PutUser(user.definition()))];
            Ok((user_view(&user), ops))
        })
        .await
    }

    pub(crate) async fn delete_user(
        &self,
        request: m::DeleteUserRequest,
    ) -> Result<m::DeleteUserResponse, ServiceError> {
        let deleted = change(&self.shared, "the user's deletion", |access| {
            let user = access.delete_user(&request.name).map_err(service_error)?;
            let ops = vec![store_op(write_op::Op::DeleteUser(user.definition()))];
            Ok((user, ops))
        })
        .await?;
        // As RabbitMQ does: a deleted user's connections are closed.
        let reason = format!("user '{}' was deleted", deleted.name);
        let broker = self.shared.broker.lock();
        let mut closed = 0;
        for session in broker.sessions.values().filter(|s| s.user == deleted.name) {
            let _ = session
                .events
                .send(event(Event::ConnectionClose(pb::ConnectionClose {
                    reason: reason.clone(),
                    // 320 CONNECTION_FORCED.
                    ..Default::default()
                })));
            closed += 1;
        }
        Ok(m::DeleteUserResponse {
            closed_connections: closed,
        })
    }

    pub(crate) async fn set_permissions(
        &self,
        request: m::SetPermissionsRequest,
    ) -> Result<m::Permission, ServiceError> {
        if !self
            .shared
            .broker
            .lock()
            .vhosts
            .contains_key(&request.vhost)
        {
            return Err(ServiceError::NotFound(format!(
                "no vhost '{}'",
                request.vhost
            )));
        }
        let granted = Permissions::new(&request.configure, &request.write, &request.read)
            .map_err(|invalid| service_error(invalid.into()))?;
        change(&self.shared, "the permissions", |access| {
            let view = permission_view(&request.user, &request.vhost, &granted);
            let def = granted.definition(&request.user, &request.vhost);
            access
                .set_permissions(&request.user, &request.vhost, granted)
                .map_err(service_error)?;
            Ok((view, vec![store_op(write_op::Op::PutPermission(def))]))
        })
        .await
    }

    pub(crate) async fn clear_permissions(
        &self,
        request: m::ClearPermissionsRequest,
    ) -> Result<m::ClearPermissionsResponse, ServiceError> {
        change(&self.shared, "the permissions' removal", |access| {
            if access.user(&request.user).is_none() {
                return Err(ServiceError::NotFound(format!(
                    "no user '{}'",
                    request.user
                )));
            }
            if !access.clear_permissions(&request.user, &request.vhost) {
                return Err(ServiceError::NotFound(format!(
                    "user '{}' has no permissions in vhost '{}'",
                    request.user, request.vhost
                )));
            }
            let def = spillway_proto::storage::PermissionDefinition {
                user: request.user.clone(),
                vhost: request.vhost.clone(),
                ..Default::default()
            };
            Ok((
                m::ClearPermissionsResponse {},
                vec![store_op(write_op::Op::DeletePermission(def))],
            ))
        })
        .await
    }

    pub(crate) async fn list_permissions(
        &self,
        request: m::ListPermissionsRequest,
    ) -> Result<m::ListPermissionsResponse, ServiceError> {
        let access = self.shared.access.read();
        let user = Some(request.user.as_str()).filter(|u| !u.is_empty());
        let vhost = Some(request.vhost.as_str()).filter(|v| !v.is_empty());
        Ok(m::ListPermissionsResponse {
            permissions: access
                .list_permissions(user, vhost)
                .into_iter()
                .map(|(user, vhost, granted)| permission_view(user, vhost, granted))
                .collect(),
        })
    }
}

fn service_error(error: AccessError) -> ServiceError {
    match error {
        AccessError::Invalid(text) => ServiceError::InvalidArgument(text),
        AccessError::NoUser(name) => ServiceError::NotFound(format!("no user '{name}'")),
    }
}

fn user_view(user: &User) -> m::User {
    m::User {
        name: user.name.clone(),
        tags: user.tags.clone(),
        loopback_only: user.loopback_only,
        has_password: !user.password_hash.is_empty(),
    }
}

fn permission_view(user: &str, vhost: &str, granted: &Permissions) -> m::Permission {
    m::Permission {
        user: user.to_string(),
        vhost: vhost.to_string(),
        configure: granted.configure.source().to_string(),
        write: granted.write.source().to_string(),
        read: granted.read.source().to_string(),
    }
}

/// Changes the database under its lock, submits the store write there too
/// (so writes land in the order of the changes), publishes the new
/// generation, and waits for the write.
async fn change<T>(
    shared: &Shared,
    what: &str,
    apply: impl FnOnce(&mut AccessControl) -> Result<(T, Vec<WriteOp>), ServiceError>,
) -> Result<T, ServiceError> {
    let (done, written) = oneshot::channel();
    let answer = {
        let mut access = shared.access.write();
        let (answer, ops) = apply(&mut access)?;
        shared.writer.submit_synced(ops, Some(done));
        shared
            .access_generation
            .store(access.generation(), Ordering::Release);
        answer
    };
    await_written(written, what).await?;
    Ok(answer)
}

/// A deleted vhost's permissions: forgotten, and the store ops that delete
/// them.
pub(crate) fn forget_vhost(shared: &Shared, vhost: &str) -> Vec<WriteOp> {
    let mut access = shared.access.write();
    let gone = access.forget_vhost(vhost);
    shared
        .access_generation
        .store(access.generation(), Ordering::Release);
    gone.into_iter()
        .map(|(user, vhost)| {
            store_op(write_op::Op::DeletePermission(
                spillway_proto::storage::PermissionDefinition {
                    user,
                    vhost,
                    ..Default::default()
                },
            ))
        })
        .collect()
}
