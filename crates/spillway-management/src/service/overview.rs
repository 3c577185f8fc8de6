//! The broker as a whole: its status (with the store's figures and
//! quota) and its runtime settings.

use spillway_proto::management as m;
use tonic::Status;

use crate::authorize::{self, authorize, Need};
use crate::{Caller, ManagementService};

impl ManagementService {
    /// The broker's figures; a caller without `monitoring` sees the totals
    /// of the vhosts it sees only.
    pub(crate) async fn get_broker_status(
        &self,
        caller: &Caller,
        request: m::GetBrokerStatusRequest,
    ) -> Result<m::BrokerStatus, Status> {
        authorize(caller, &[Need::Overview])?;
        let mut status = self.engine.get_broker_status(request).await?;
        if authorize(caller, &[Need::Monitoring]).is_err() {
            self.count_visible_vhosts_only(caller, &mut status).await?;
        }
        let store = self.storage.status(false).await?;
        status.store_disk_bytes = store.disk_bytes;
        status.stored_messages = store.estimated_keys;
        // The first state of the quota stream is the one in force.
        let mut quota = self.storage.watch_quota().await?;
        if let Some(Ok(state)) = futures::StreamExt::next(&mut quota).await {
            status.store_quota_bytes = Some(state.overfull_size);
            status.store_underfull_bytes = state.underfull_size;
            status.store_overfull = state.overfull;
        }
        Ok(status)
    }

    pub(crate) async fn set_broker_settings(
        &self,
        caller: &Caller,
        request: m::SetBrokerSettingsRequest,
    ) -> Result<m::SetBrokerSettingsResponse, Status> {
        authorize(caller, &[Need::Administrator])?;
        let logged = format!("{request:?}");
        let response = self.engine.set_broker_settings(request).await?;
        tracing::info!(settings = %logged, "broker settings changed by management");
        Ok(response)
    }

    pub(crate) async fn set_transaction_timeouts(
        &self,
        caller: &Caller,
        request: m::SetTransactionTimeoutsRequest,
    ) -> Result<m::TransactionTimeouts, Status> {
        authorize(caller, &[Need::Administrator])?;
        let response = self.engine.set_transaction_timeouts(request).await?;
        tracing::info!(timeouts = ?response, "transaction timeouts changed by management");
        Ok(response)
    }

    /// Replaces the broker's totals with those of the vhosts `caller` sees,
    /// for a caller without `monitoring` (RabbitMQ's overview sums only the
    /// vhosts such a user may access): vhosts, queues, connections,
    /// channels, consumers, messages and their bytes, spilled messages,
    /// blocked channels. Flow to disk's threshold, state and resident bytes
    /// and the store's figures stay the broker's: they are the broker's
    /// health, not what is in a vhost.
    async fn count_visible_vhosts_only(
        &self,
        caller: &Caller,
        status: &mut m::BrokerStatus,
    ) -> Result<(), Status> {
        let vhosts: Vec<m::Vhost> = self
            .engine
            .list_vhosts(m::ListVhostsRequest {})
            .await?
            .vhosts
            .into_iter()
            .filter(|vhost| authorize::sees_vhost(caller, &vhost.name))
            .collect();
        status.vhosts = vhosts.len() as u32;
        status.queues = vhosts.iter().map(|vhost| vhost.queues).sum();
        status.connections = vhosts.iter().map(|vhost| vhost.connections).sum();
        status.messages_ready = 0;
        status.messages_unacked = 0;
        status.message_bytes = 0;
        status.consumers = 0;
        status.spilled_messages = 0;
        status.spilled_bytes = 0;
        for vhost in &vhosts {
            let queues = self
                .engine
                .list_queues(m::ListQueuesRequest {
                    vhost: vhost.name.clone(),
                })
                .await?
                .queues;
            for queue in queues.iter().filter_map(|queue| queue.status.as_ref()) {
                status.messages_ready += queue.messages;
                status.messages_unacked += queue.unacked;
                status.message_bytes += queue.bytes;
                status.consumers += queue.consumers as u32;
                status.spilled_messages += queue.spilled_messages;
                status.spilled_bytes += queue.spilled_bytes;
            }
        }
        let channels = self
            .engine
            .list_channels(m::ListChannelsRequest::default())
            .await?
            .channels;
        let visible = channels
            .iter()
            .filter(|channel| vhosts.iter().any(|vhost| vhost.name == channel.vhost));
        status.channels = visible.clone().count() as u32;
        status.blocked_channels = visible.filter(|channel| channel.blocked).count() as u32;
        Ok(())
    }
}
