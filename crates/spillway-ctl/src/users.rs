//! `spillctl user …` and `spillctl permissions …`: the broker's users and
//! what each may do in a vhost, as `rabbitmqctl add_user`,
//! `set_permissions` and friends do it. Passwords are positional, as in
//! rabbitmqctl, because `--password` is spillctl's own credential (and the
//! positional user and password have ids of their own: clap would otherwise
//! take them for spillctl's global `--user` / `--password`).

use super::output::{table, Printer};
use super::{Answer, Client};
use clap::Subcommand;
use spillway_proto::management as m;

#[derive(Subcommand)]
pub(crate) enum UserCommand {
    /// Every user, their tags and whether they may log in with a password.
    List,
    /// Adds a user (stored: it survives a restart). An empty password
    /// allows only EXTERNAL (a TLS client certificate).
    Add {
        name: String,
        /// The new user's password (not spillctl's own --password).
        #[arg(id = "new_password", value_name = "PASSWORD")]
        password: String,
        /// Comma-separated tags: administrator, monitoring, management.
        #[arg(long, value_delimiter = ',')]
        tags: Vec<String>,
        /// Accept the user from loopback addresses only (like guest).
        #[arg(long)]
        loopback_only: bool,
    },
    /// Changes a user's password.
    Passwd {
        name: String,
        #[arg(id = "new_password", value_name = "PASSWORD")]
        password: String,
    },
    /// Replaces a user's tags (none: no tags).
    Tags {
        name: String,
        #[arg(value_delimiter = ',')]
        tags: Vec<String>,
    },
    /// Deletes a user and their permissions; their connections are closed.
    Delete { name: String },
}

#[derive(Subcommand)]
pub(crate) enum PermissionsCommand {
    /// Permissions of every user in every vhost (or of one user).
    List {
        /// Only this user's (not spillctl's own --user).
        #[arg(id = "of_user", value_name = "USER")]
        user: Option<String>,
    },
    /// Sets what USER may do in --vhost: regular expressions searched in
    /// queue and exchange names ("" allows nothing, ".*" everything).
    Set {
        #[arg(id = "of_user", value_name = "USER")]
        user: String,
        #[arg(long)]
        configure: String,
        #[arg(long)]
        write: String,
        #[arg(long)]
        read: String,
    },
    /// Takes away USER's permissions in --vhost.
    Clear {
        #[arg(id = "of_user", value_name = "USER")]
        user: String,
    },
}

pub(crate) async fn user_command(
    client: &mut Client,
    out: &Printer,
    command: UserCommand,
) -> anyhow::Result<()> {
    match command {
        UserCommand::List => {
            let list = client.list_users(m::ListUsersRequest {}).await.answer()?;
            out.print(&list, || user_table(&list.users))
        }
        UserCommand::Add {
            name,
            password,
            tags,
            loopback_only,
        } => {
            let user = put(client, name, Some(password), tags, loopback_only).await?;
            out.print(&user, || user_table(std::slice::from_ref(&user)))
        }
        UserCommand::Passwd { name, password } => {
            let current = find(client, &name).await?;
            let user = put(
                client,
                name,
                Some(password),
                current.tags,
                current.loopback_only,
            )
            .await?;
            out.print(&user, || {
                format!("password of user '{}' changed", user.name)
            })
        }
        UserCommand::Tags { name, tags } => {
            let current = find(client, &name).await?;
            let user = put(client, name, None, tags, current.loopback_only).await?;
            out.print(&user, || user_table(std::slice::from_ref(&user)))
        }
        UserCommand::Delete { name } => {
            let r = client
                .delete_user(m::DeleteUserRequest { name: name.clone() })
                .await
                .answer()?;
            out.print(&r, || {
                format!(
                    "user '{name}' deleted ({} connections closed)",
                    r.closed_connections
                )
            })
        }
    }
}

pub(crate) async fn permissions_command(
    client: &mut Client,
    out: &Printer,
    vhost: String,
    command: PermissionsCommand,
) -> anyhow::Result<()> {
    match command {
        PermissionsCommand::List { user } => {
            let list = client
                .list_permissions(m::ListPermissionsRequest {
                    user: user.unwrap_or_default(),
                    vhost: String::new(),
                })
                .await
                .answer()?;
            out.print(&list, || permission_table(&list.permissions))
        }
        PermissionsCommand::Set {
            user,
            configure,
            write,
            read,
        } => {
            let p = client
                .set_permissions(m::SetPermissionsRequest {
                    user,
                    vhost,
                    configure,
                    write,
                    read,
                })
                .await
                .answer()?;
            out.print(&p, || permission_table(std::slice::from_ref(&p)))
        }
        PermissionsCommand::Clear { user } => {
            let r = client
                .clear_permissions(m::ClearPermissionsRequest {
                    user: user.clone(),
                    vhost: vhost.clone(),
                })
                .await
                .answer()?;
            out.print(&r, || {
                format!("permissions of user '{user}' in vhost '{vhost}' cleared")
            })
        }
    }
}

pub(crate) async fn put(
    client: &mut Client,
    name: String,
    password: Option<String>,
    tags: Vec<String>,
    loopback_only: bool,
) -> anyhow::Result<m::User> {
    client
        .put_user(m::PutUserRequest {
            name,
            password,
            tags,
            loopback_only,
        })
        .await
        .answer()
}

pub(crate) async fn find(client: &mut Client, name: &str) -> anyhow::Result<m::User> {
    let users = client
        .list_users(m::ListUsersRequest {})
        .await
        .answer()?
        .users;
    users
        .into_iter()
        .find(|user| user.name == name)
        .ok_or_else(|| anyhow::anyhow!("NotFound: no user '{name}'"))
}

pub(crate) fn user_table(users: &[m::User]) -> String {
    table(
        &["name", "tags", "password", "loopback only"],
        users
            .iter()
            .map(|u| {
                vec![
                    u.name.clone(),
                    u.tags.join(","),
                    if u.has_password {
                        "yes"
                    } else {
                        "no (EXTERNAL)"
                    }
                    .to_string(),
                    u.loopback_only.to_string(),
                ]
            })
            .collect(),
    )
}

pub(crate) fn permission_table(permissions: &[m::Permission]) -> String {
    table(
        &["user", "vhost", "configure", "write", "read"],
        permissions
            .iter()
            .map(|p| {
                vec![
                    p.user.clone(),
                    p.vhost.clone(),
                    p.configure.clone(),
                    p.write.clone(),
                    p.read.clone(),
                ]
            })
            .collect(),
    )
}
