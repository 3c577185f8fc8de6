//! A sandbox of a storage group: several storage processes replicating one
//! store (`storage.members`), an engine that knows them all
//! (`engine.storage_addrs`) and a gateway, each a `spillway` process on
//! loopback, on ephemeral ports and temporary directories.
//!
//! A group's members must know each other's addresses before they start,
//! so their ports are reserved first: bound all at once to port 0, noted,
//! and let go just before the members take them.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use spillway_proto::cluster::ClusterRole;
use spillway_proto::storage::storage_group_client::StorageGroupClient;
use spillway_proto::storage::{GroupStatus, GroupStatusRequest};

use crate::{eventually, parse_addr, spillway_bin, stop_child, wait_for_ready, RoleSecrets};

/// One storage process of the group.
struct Member {
    addr: SocketAddr,
    data_dir: PathBuf,
    child: Option<Child>,
}

pub struct GroupSandbox {
    dir: tempfile::TempDir,
    /// Every process holds its own role's secret only
    /// (`cluster.verifiers`), as a deployment beyond loopback must.
    secrets: RoleSecrets,
    /// Extra settings for every storage member (`SPILLWAY_STORAGE__…`).
    storage_env: Vec<(String, String)>,
    members: BTreeMap<u64, Member>,
    engine: Option<Child>,
    engine_addr: SocketAddr,
    /// A second engine standing by (`engine.standby`), with its address,
    /// when the sandbox runs one.
    standby: Option<(SocketAddr, Option<Child>)>,
    gateway: Option<Child>,
    amqp: SocketAddr,
    management: Option<Child>,
    management_addr: SocketAddr,
    /// The loopback address the members listen on.
    host: IpAddr,
}

impl GroupSandbox {
    /// A group of `size` storage members, an engine and a gateway.
    pub async fn start(size: u64) -> anyhow::Result<Self> {
        Self::start_with(size, &[]).await
    }

    /// As [`GroupSandbox::start`], with `storage_env` set for every member
    /// (`("SPILLWAY_STORAGE__GROUP_SNAPSHOT_ENTRIES", "20")`).
    pub async fn start_with(size: u64, storage_env: &[(&str, &str)]) -> anyhow::Result<Self> {
        Self::start_full(size, storage_env, false).await
    }

    /// A group of `size` and two engines, both `engine.standby`: the
    /// first takes the lease, the second stands by (not listening) until
    /// it lapses; the gateway knows both (`gateway.engine_addrs`).
    pub async fn start_with_standby(size: u64) -> anyhow::Result<Self> {
        Self::start_full(size, &[], true).await
    }

    async fn start_full(
        size: u64,
        storage_env: &[(&str, &str)],
        standby: bool,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir().context("temp dir")?;
        let secrets = RoleSecrets::new(dir.path())?;
        let host = own_loopback()?;
        let mut ports = reserve_ports(host, size as usize + 2)?;
        let standby = match (standby, ports.pop()) {
            (true, Some(addr)) => Some((addr, None)),
            _ => None,
        };
        let engine_addr = ports.pop().context("no port for the engine")?;
        let members = (1..=size)
            .zip(ports)
            .map(|(id, addr)| {
                let member = Member {
                    addr,
                    data_dir: dir.path().join(format!("storage-{id}")),
                    child: None,
                };
                (id, member)
            })
            .collect();
        let mut sandbox = Self {
            dir,
            secrets,
            storage_env: storage_env
                .iter()
                .map(|(key, value)| (key.to_string(), value.to_string()))
                .collect(),
            members,
            engine: None,
            engine_addr,
            standby,
            gateway: None,
            amqp: SocketAddr::from(([127, 0, 0, 1], 0)),
            management: None,
            management_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            host,
        };
        let booted = sandbox.boot().await;
        booted.with_context(|| sandbox.logs())?;
        Ok(sandbox)
    }

    /// Starts every member, then the engine, gateway and management.
    async fn boot(&mut self) -> anyhow::Result<()> {
        let sandbox = self;
        let ids: Vec<u64> = sandbox.members.keys().copied().collect();
        // Every member at once: a majority must be up for any to be ready.
        let mut starting = Vec::new();
        for id in &ids {
            starting.push(sandbox.spawn_member(*id)?);
        }
        for ready in starting {
            wait_for_ready(&ready, Duration::from_secs(60)).await?;
        }
        sandbox.leader().await?;
        let engine = sandbox.engine_addr;
        let engine_ready = sandbox.spawn_engine("engine", engine)?;
        wait_for_ready(&engine_ready.0, Duration::from_secs(60)).await?;
        sandbox.engine = Some(engine_ready.1);
        let mut engine_addrs = format!("http://{engine}");
        if let Some((addr, _)) = sandbox.standby {
            // It waits for the lease: not ready (nor listening) yet.
            let (_, child) = sandbox.spawn_engine("standby", addr)?;
            sandbox.standby = Some((addr, Some(child)));
            engine_addrs.push_str(&format!(",http://{addr}"));
        }
        let gateway_ready = sandbox.spawn(
            "gateway",
            &[
                ("SPILLWAY_GATEWAY__AMQP_LISTEN", "127.0.0.1:0".into()),
                ("SPILLWAY_GATEWAY__ENGINE_ADDRS", engine_addrs.clone()),
            ],
        )?;
        let gateway = wait_for_ready(&gateway_ready.0, Duration::from_secs(60)).await?;
        sandbox.gateway = Some(gateway_ready.1);
        sandbox.amqp = parse_addr(&gateway, "amqp")?;
        let management_ready = sandbox.spawn(
            "management",
            &[
                ("SPILLWAY_MANAGEMENT__LISTEN", "127.0.0.1:0".into()),
                ("SPILLWAY_MANAGEMENT__HTTP_LISTEN", "127.0.0.1:0".into()),
                ("SPILLWAY_MANAGEMENT__TOKEN", crate::MANAGEMENT_TOKEN.into()),
                (
                    "SPILLWAY_MANAGEMENT__STORAGE_ADDRS",
                    sandbox.storage_addrs(),
                ),
                ("SPILLWAY_MANAGEMENT__ENGINE_ADDRS", engine_addrs.clone()),
            ],
        )?;
        let management = wait_for_ready(&management_ready.0, Duration::from_secs(60)).await?;
        sandbox.management = Some(management_ready.1);
        sandbox.management_addr = parse_addr(&management, "management")?;
        Ok(())
    }

    /// Starts an engine process named `role` listening on `addr`.
    fn spawn_engine(&self, role: &str, addr: SocketAddr) -> anyhow::Result<(PathBuf, Child)> {
        let mut env = vec![
            ("SPILLWAY_ENGINE__LISTEN", addr.to_string()),
            ("SPILLWAY_ENGINE__STORAGE_ADDRS", self.storage_addrs()),
        ];
        if self.standby.is_some() {
            env.push(("SPILLWAY_ENGINE__STANDBY", "true".into()));
        }
        self.spawn(role, &env)
    }

    /// The per-role secrets the processes were given.
    pub fn secrets(&self) -> &RoleSecrets {
        &self.secrets
    }

    /// Member `id`'s address.
    pub fn member_addr(&self, id: u64) -> anyhow::Result<SocketAddr> {
        Ok(self.members.get(&id).context("no such member")?.addr)
    }

    /// The active engine's address.
    pub fn engine_addr(&self) -> SocketAddr {
        self.engine_addr
    }

    /// SIGKILLs the active engine (the first one).
    pub async fn kill_engine(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.engine.take() {
            stop_child(&mut child, "KILL").await;
        }
        Ok(())
    }

    /// Stops (SIGSTOP) or resumes (SIGCONT) the active engine: a process
    /// that neither dies nor answers, as in a long pause or a partition.
    pub fn pause_engine(&self, paused: bool) -> anyhow::Result<()> {
        let child = self.engine.as_ref().context("no active engine")?;
        let signal = if paused { "-STOP" } else { "-CONT" };
        let status = Command::new("kill")
            .arg(signal)
            .arg(child.id().to_string())
            .status()
            .context("kill")?;
        anyhow::ensure!(status.success(), "kill {signal} failed");
        Ok(())
    }

    /// Waits (up to `deadline`) for the active engine's process to exit by
    /// itself; its exit status.
    pub async fn wait_engine_exit(
        &mut self,
        deadline: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        let child = self.engine.as_mut().context("no active engine")?;
        let status = eventually(deadline, || {
            let exited = child.try_wait();
            async move {
                match exited {
                    Ok(Some(status)) => Ok(status),
                    Ok(None) => Err(anyhow::anyhow!("the engine still runs")),
                    Err(error) => Err(error.into()),
                }
            }
        })
        .await?;
        self.engine = None;
        Ok(status)
    }

    /// Waits until the standby engine has taken over (its ready file).
    pub async fn wait_for_standby(&self) -> anyhow::Result<()> {
        let ready = self.dir.path().join("standby.ready");
        wait_for_ready(&ready, Duration::from_secs(60)).await?;
        Ok(())
    }

    /// Every member's address, comma-separated, as the engine is given them.
    fn storage_addrs(&self) -> String {
        self.members
            .values()
            .map(|member| format!("http://{}", member.addr))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Starts `role` with `env`; its ready file and the child.
    fn spawn(&self, role: &str, env: &[(&str, String)]) -> anyhow::Result<(PathBuf, Child)> {
        let ready = self.dir.path().join(format!("{role}.ready"));
        let _ = std::fs::remove_file(&ready);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{role}.log")))?;
        // storage-N are storage nodes; the standby is an engine.
        let process = match role {
            "standby" => "engine",
            role => role.split('-').next().unwrap_or(role),
        };
        let cluster_role =
            ClusterRole::from_name(process).with_context(|| format!("no role {process}"))?;
        let mut command = Command::new(spillway_bin()?);
        command
            .arg("--ready-file")
            .arg(&ready)
            .arg(process)
            .env("SPILLWAY_TELEMETRY__METRICS_LISTEN", "127.0.0.1:0")
            .env("SPILLWAY_STORAGE__DATA_DIR", self.dir.path().join(role))
            .envs(self.secrets.env(cluster_role))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {role}"))?;
        Ok((ready, child))
    }

    /// Starts member `id` (again, on its address and data); its ready file.
    fn spawn_member(&mut self, id: u64) -> anyhow::Result<PathBuf> {
        let member = self.members.get(&id).context("no such member")?;
        let mut env: Vec<(String, String)> = vec![
            ("SPILLWAY_STORAGE__LISTEN".into(), member.addr.to_string()),
            (
                "SPILLWAY_STORAGE__DATA_DIR".into(),
                member.data_dir.display().to_string(),
            ),
            ("SPILLWAY_STORAGE__NODE_ID".into(), id.to_string()),
            // Elections within a second: the tests wait for them.
            ("SPILLWAY_STORAGE__GROUP_HEARTBEAT".into(), "100ms".into()),
        ];
        for (other, member) in &self.members {
            env.push((
                format!("SPILLWAY_STORAGE__MEMBERS__{other}"),
                format!("http://{}", member.addr),
            ));
        }
        env.extend(self.storage_env.iter().cloned());
        let env: Vec<(&str, String)> = env
            .iter()
            .map(|(key, value)| (key.as_str(), value.clone()))
            .collect();
        let (ready, child) = self.spawn(&format!("storage-{id}"), &env)?;
        if let Some(member) = self.members.get_mut(&id) {
            member.child = Some(child);
        }
        Ok(ready)
    }

    /// Starts a new storage node `id` that joins the running group
    /// (`storage.join`): it serves, and waits to be added. Its address.
    pub async fn start_joining_member(&mut self, id: u64) -> anyhow::Result<SocketAddr> {
        anyhow::ensure!(!self.members.contains_key(&id), "member {id} exists");
        let addr = reserve_ports(self.host, 1)?.pop().context("no port")?;
        self.members.insert(
            id,
            Member {
                addr,
                data_dir: self.dir.path().join(format!("storage-{id}")),
                child: None,
            },
        );
        let env = vec![
            ("SPILLWAY_STORAGE__LISTEN", addr.to_string()),
            (
                "SPILLWAY_STORAGE__DATA_DIR",
                self.dir
                    .path()
                    .join(format!("storage-{id}"))
                    .display()
                    .to_string(),
            ),
            ("SPILLWAY_STORAGE__NODE_ID", id.to_string()),
            ("SPILLWAY_STORAGE__JOIN", "true".to_string()),
            ("SPILLWAY_STORAGE__GROUP_HEARTBEAT", "100ms".to_string()),
        ];
        let members_key = format!("SPILLWAY_STORAGE__MEMBERS__{id}");
        let mut env = env;
        env.push((members_key.as_str(), format!("http://{addr}")));
        let (ready, child) = self.spawn(&format!("storage-{id}"), &env)?;
        if let Some(member) = self.members.get_mut(&id) {
            member.child = Some(child);
        }
        wait_for_ready(&ready, Duration::from_secs(60)).await?;
        Ok(addr)
    }

    /// Runs spillctl against the group's management service: whether it
    /// succeeded, its stdout and its stderr.
    pub fn spillctl(&self, args: &[&str]) -> anyhow::Result<(bool, String, String)> {
        crate::run_spillctl(self.management_addr, crate::MANAGEMENT_TOKEN, args)
    }

    /// SIGKILLs the engine and starts it again on its address: it takes
    /// the lease once the dead one's expires, and recovers every durable
    /// queue from the group.
    pub async fn kill_and_restart_engine(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.engine.take() {
            stop_child(&mut child, "KILL").await;
        }
        let (ready, child) = self.spawn_engine("engine", self.engine_addr)?;
        self.engine = Some(child);
        wait_for_ready(&ready, Duration::from_secs(60)).await?;
        Ok(())
    }

    /// Starts member `id` again and waits until it serves.
    pub async fn start_member(&mut self, id: u64) -> anyhow::Result<()> {
        let ready = self.spawn_member(id)?;
        wait_for_ready(&ready, Duration::from_secs(60)).await?;
        Ok(())
    }

    /// SIGKILLs member `id`.
    pub async fn kill_member(&mut self, id: u64) -> anyhow::Result<()> {
        let member = self.members.get_mut(&id).context("no such member")?;
        if let Some(mut child) = member.child.take() {
            stop_child(&mut child, "KILL").await;
        }
        Ok(())
    }

    /// Deletes member `id`'s data (it must be stopped): a lost disk.
    pub fn wipe_member(&self, id: u64) -> anyhow::Result<()> {
        let member = self.members.get(&id).context("no such member")?;
        if member.data_dir.exists() {
            std::fs::remove_dir_all(&member.data_dir)?;
        }
        Ok(())
    }

    /// Member `id`'s view of the group.
    pub async fn status_of(&self, id: u64) -> anyhow::Result<GroupStatus> {
        let member = self.members.get(&id).context("no such member")?;
        let cluster = self.secrets.client(ClusterRole::Management)?;
        let channel =
            spillway_proto::cluster::lazy_channel(&format!("http://{}", member.addr), &cluster)?;
        let mut client = StorageGroupClient::new(channel);
        let mut request = tonic::Request::new(GroupStatusRequest {});
        request.set_timeout(Duration::from_secs(2));
        Ok(client.get_group_status(request).await?.into_inner())
    }

    /// The leader's id, once a running member names a running leader.
    pub async fn leader(&self) -> anyhow::Result<u64> {
        eventually(Duration::from_secs(30), || async {
            for (id, member) in &self.members {
                if member.child.is_none() {
                    continue;
                }
                let Ok(status) = self.status_of(*id).await else {
                    continue;
                };
                let leader_runs = self
                    .members
                    .get(&status.leader)
                    .is_some_and(|leader| leader.child.is_some());
                if status.leader != 0 && status.leader == *id && leader_runs {
                    return Some(status.leader);
                }
            }
            None
        })
        .await
        .context("no storage group leader")
    }

    /// Waits until member `id` has applied at least `index`.
    pub async fn wait_applied(&self, id: u64, index: u64) -> anyhow::Result<()> {
        eventually(Duration::from_secs(60), || async {
            let status = self.status_of(id).await.ok()?;
            let me = status.members.iter().find(|member| member.id == id)?;
            (me.applied_index >= index).then_some(())
        })
        .await
        .with_context(|| format!("member {id} did not apply up to {index}"))
    }

    pub fn amqp_uri(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.amqp)
    }

    pub async fn connect(&self) -> anyhow::Result<lapin::Connection> {
        Ok(
            lapin::Connection::connect(&self.amqp_uri(), lapin::ConnectionProperties::default())
                .await?,
        )
    }

    /// The logs of every process, for failure messages.
    pub fn logs(&self) -> String {
        let mut logs = String::new();
        let mut roles: Vec<String> = self
            .members
            .keys()
            .map(|id| format!("storage-{id}"))
            .collect();
        roles.extend(["engine", "standby", "gateway", "management"].map(String::from));
        for role in roles {
            if let Ok(text) = std::fs::read_to_string(self.dir.path().join(format!("{role}.log"))) {
                let tail: Vec<&str> = text.lines().rev().take(60).collect();
                logs.push_str(&format!("--- {role} (last lines) ---\n"));
                for line in tail.into_iter().rev() {
                    logs.push_str(line);
                    logs.push('\n');
                }
            }
        }
        logs
    }
}

impl Drop for GroupSandbox {
    fn drop(&mut self) {
        let children = [
            self.management.as_mut(),
            self.gateway.as_mut(),
            self.engine.as_mut(),
            self.standby.as_mut().and_then(|(_, child)| child.as_mut()),
        ]
        .into_iter()
        .flatten()
        .chain(self.members.values_mut().filter_map(|m| m.child.as_mut()));
        for child in children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `count` free ports on a loopback address of the sandbox's own
/// (127.X.Y.1, X and Y random), bound together (so they differ) and
/// released for the members to take. Every other process of the suite
/// binds 127.0.0.1, so no other test can take a port meanwhile.
fn reserve_ports(host: IpAddr, count: usize) -> anyhow::Result<Vec<SocketAddr>> {
    let listeners = (0..count)
        .map(|_| TcpListener::bind(SocketAddr::new(host, 0)))
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("reserving ports on {host}"))?;
    listeners
        .iter()
        .map(|listener| Ok(listener.local_addr()?))
        .collect()
}

/// A loopback address no other sandbox is likely to use: 127.X.Y.1.
fn own_loopback() -> anyhow::Result<IpAddr> {
    let mut bytes = [0u8; 2];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut bytes)?;
    Ok(IpAddr::from([
        127,
        bytes[0].clamp(1, 254),
        bytes[1].clamp(1, 254),
        1,
    ]))
}
