//! An engine as the store sees it: it takes the lease, renews it, and
//! writes numbered batches through the engine's own storage client
//! ([`GroupStorage`]), which finds the leader, follows redirections and
//! retries. A batch that fails transiently is sent again with the same
//! number, as the engine's writer does; a refused one (a stale epoch)
//! makes the engine stop, as the engine stops on `MST-1101`.
//!
//! Each batch puts one message record whose id names the engine, its
//! epoch and the batch's number (`MessageTag`, in `history.rs`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use spillway_proto::management::SetStoreQuotaRequest;
use spillway_proto::storage::{
    write_op, AcquireLeaseRequest, Definitions, GroupStatus, Lease, MessageRecord, QueueEntry,
    StoreStatus, WriteBatch, WriteOp,
};
use spillway_proto::{
    storage::{GroupStorage, QuotaStream, StorageApi},
    ServiceError,
};

use crate::history::{Event, History, MessageTag};
use crate::network::{address_of, Host, Network, Undelivered};

/// How long a lease lasts unless renewed.
pub const LEASE_TTL: Duration = Duration::from_secs(2);

/// The lease holder's name of engine `number`.
pub fn holder_name(number: u64) -> String {
    format!("engine-{number}")
}

/// The engine number a holder's name carries.
pub fn holder_number(holder: &str) -> Option<u64> {
    holder.strip_prefix("engine-")?.parse().ok()
}

/// One member as an engine reaches it, through the network.
pub struct Link {
    from: Host,
    to: Host,
    network: Arc<Network>,
}

fn unavailable(undelivered: Undelivered) -> ServiceError {
    ServiceError::Unavailable(undelivered.0)
}

impl Link {
    async fn call<T, F, Fut>(&self, work: F) -> Result<T, ServiceError>
    where
        F: FnOnce(spillway_storage::StorageGroup) -> Fut,
        Fut: std::future::Future<Output = Result<T, ServiceError>>,
    {
        self.network
            .call(self.from, self.to, work)
            .await
            .map_err(unavailable)?
    }
}

#[async_trait]
impl StorageApi for Link {
    async fn write(&self, batch: Arc<WriteBatch>) -> Result<(), ServiceError> {
        self.call(|member| async move { member.write(batch).await })
            .await
    }

    async fn load_definitions(&self) -> Result<Definitions, ServiceError> {
        self.call(|member| async move { member.load_definitions().await })
            .await
    }

    async fn load_messages(
        &self,
        vhost: &str,
        queue: &str,
    ) -> Result<Vec<QueueEntry>, ServiceError> {
        let (vhost, queue) = (vhost.to_string(), queue.to_string());
        self.call(|member| async move { member.load_messages(&vhost, &queue).await })
            .await
    }

    async fn read_messages(&self, ids: Vec<u64>) -> Result<Vec<MessageRecord>, ServiceError> {
        self.call(|member| async move { member.read_messages(ids).await })
            .await
    }

    async fn status(&self, count_records: bool) -> Result<StoreStatus, ServiceError> {
        self.call(|member| async move { StorageApi::status(&member, count_records).await })
            .await
    }

    async fn remove_orphans(&self, epoch: u64, below_id: u64) -> Result<u64, ServiceError> {
        self.call(|member| async move { member.remove_orphans(epoch, below_id).await })
            .await
    }

    async fn acquire_lease(&self, request: AcquireLeaseRequest) -> Result<Lease, ServiceError> {
        self.call(|member| async move { member.acquire_lease(request).await })
            .await
    }

    async fn release_lease(&self, epoch: u64) -> Result<(), ServiceError> {
        self.call(|member| async move { member.release_lease(epoch).await })
            .await
    }

    async fn watch_quota(&self) -> Result<QuotaStream, ServiceError> {
        self.call(|member| async move { member.watch_quota().await })
            .await
    }

    async fn set_quota(&self, request: SetStoreQuotaRequest) -> Result<(), ServiceError> {
        self.call(|member| async move { member.set_quota(request).await })
            .await
    }

    async fn group_status(&self) -> Result<GroupStatus, ServiceError> {
        self.call(|member| async move { member.group_status().await })
            .await
    }

    async fn add_member(&self, id: u64, address: String) -> Result<GroupStatus, ServiceError> {
        self.call(|member| async move { StorageApi::add_member(&member, id, address).await })
            .await
    }

    async fn remove_member(&self, id: u64) -> Result<GroupStatus, ServiceError> {
        self.call(|member| async move { StorageApi::remove_member(&member, id).await })
            .await
    }
}

/// One engine incarnation: `number` is also its host's offset.
pub struct SimEngine {
    pub number: u64,
    pub host: Host,
    storage: GroupStorage<Link>,
    history: Arc<Mutex<History>>,
    /// Time between two batches.
    pace: Duration,
}

impl SimEngine {
    pub fn new(
        number: u64,
        member_ids: &[Host],
        network: Arc<Network>,
        history: Arc<Mutex<History>>,
        pace: Duration,
    ) -> Result<Self, ServiceError> {
        let host = crate::network::ENGINE_HOSTS + number;
        Ok(Self {
            number,
            host,
            storage: Self::client(host, member_ids, network)?,
            history,
            pace,
        })
    }

    /// The engine's client of the group (`GroupStorage`), from `host`.
    pub fn client(
        host: Host,
        member_ids: &[Host],
        network: Arc<Network>,
    ) -> Result<GroupStorage<Link>, ServiceError> {
        let links = member_ids
            .iter()
            .map(|id| {
                (
                    address_of(*id),
                    Link {
                        from: host,
                        to: *id,
                        network: network.clone(),
                    },
                )
            })
            .collect();
        GroupStorage::over(links)
    }

    /// Takes the lease (waiting while another engine holds it), then
    /// writes until refused. Runs until the simulation aborts it.
    pub async fn run(self) {
        let holder = holder_name(self.number);
        let epoch = loop {
            let request = AcquireLeaseRequest {
                epoch: 0,
                ttl_ms: LEASE_TTL.as_millis() as u64,
                holder: holder.clone(),
            };
            match self.storage.acquire_lease(request).await {
                Ok(lease) => break lease.epoch,
                Err(_) => tokio::time::sleep(LEASE_TTL / 4).await,
            }
        };
        self.history.lock().record(Event::LeaseTaken {
            engine: self.number,
            epoch,
        });
        let storage = Arc::new(self.storage);
        let deposed = Arc::new(AtomicBool::new(false));
        let renewal = tokio::spawn(renew(storage.clone(), holder, epoch, deposed.clone()));
        let mut sequence = 0;
        'batches: while !deposed.load(Ordering::Acquire) {
            sequence += 1;
            let tag = MessageTag {
                engine: self.number,
                epoch,
                sequence,
            };
            let batch = Arc::new(WriteBatch {
                ops: vec![WriteOp {
                    op: Some(write_op::Op::PutMessage(MessageRecord {
                        id: tag.id(),
                        body: tag.id().to_be_bytes().to_vec().into(),
                        persistent: true,
                        ..Default::default()
                    })),
                }],
                epoch,
                sequence,
                ..Default::default()
            });
            loop {
                match storage.write(batch.clone()).await {
                    Ok(()) => {
                        self.history.lock().record(Event::Confirmed(tag));
                        break;
                    }
                    Err(error) if !error.is_transient() => {
                        self.history.lock().record(Event::Refused {
                            tag,
                            reason: error.to_string(),
                        });
                        break 'batches;
                    }
                    // The writer keeps its batch and sends it again.
                    Err(_) => {}
                }
            }
            tokio::time::sleep(self.pace).await;
        }
        renewal.abort();
        self.history.lock().record(Event::SteppedDown {
            engine: self.number,
        });
    }
}

/// Renews the lease every fifth of its TTL; a refusal deposes the engine.
async fn renew(
    storage: Arc<GroupStorage<Link>>,
    holder: String,
    epoch: u64,
    deposed: Arc<AtomicBool>,
) {
    loop {
        tokio::time::sleep(LEASE_TTL / 5).await;
        let request = AcquireLeaseRequest {
            epoch,
            ttl_ms: LEASE_TTL.as_millis() as u64,
            holder: holder.clone(),
        };
        match storage.acquire_lease(request).await {
            Err(error) if !error.is_transient() => {
                deposed.store(true, Ordering::Release);
                return;
            }
            _ => {}
        }
    }
}
