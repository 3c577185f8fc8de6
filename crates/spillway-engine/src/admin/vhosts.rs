//! Vhosts: created, listed, looked up, deleted (with everything in them),
//! their message totals, and their producer transaction timeouts.

use spillway_proto::engine as pb;
use spillway_proto::management as m;
use spillway_proto::storage::{self as store, write_op, WriteOp};
use spillway_proto::ServiceError;
use tokio::sync::oneshot;

use super::common::{check_name, ok, vhost, CHANNEL};
use super::overview::unacked_by_vhost;
use crate::broker::Broker;
use crate::engine::Engine;
use crate::persistence::{await_written, store_op};
use crate::vhost::VHost;
use crate::walk::walk_queues;

impl Engine {
    pub(crate) async fn create_vhost(
        &self,
        request: m::CreateVhostRequest,
    ) -> Result<m::Vhost, ServiceError> {
        check_name("vhost", &request.name)?;
        let (done, written) = oneshot::channel();
        let view = {
            let mut broker = self.shared.broker.lock();
            if broker.vhosts.contains_key(&request.name) {
                return Err(ServiceError::AlreadyExists(format!(
                    "vhost '{}' already exists",
                    request.name
                )));
            }
            broker
                .vhosts
                .insert(request.name.clone(), VHost::new(&request.name));
            // On disk before the caller hears of it: the vhost survives a
            // restart.
            self.shared.writer.submit_synced(
                vec![store_op(write_op::Op::PutVhost(store::VhostDefinition {
                    name: request.name.clone(),
                }))],
                Some(done),
            );
            vhost_view(&broker, vhost(&broker, &request.name)?)
        };
        await_written(written, "the vhost").await?;
        tracing::info!(vhost = %request.name, "vhost created by management");
        Ok(view)
    }

    pub(crate) async fn list_vhosts(
        &self,
        _request: m::ListVhostsRequest,
    ) -> Result<m::ListVhostsResponse, ServiceError> {
        let broker = self.shared.broker.lock();
        let mut vhosts: Vec<m::Vhost> = broker
            .vhosts
            .values()
            .map(|v| vhost_view(&broker, v))
            .collect();
        vhosts.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(m::ListVhostsResponse { vhosts })
    }

    pub(crate) async fn get_vhost(
        &self,
        request: m::GetVhostRequest,
    ) -> Result<m::Vhost, ServiceError> {
        let broker = self.shared.broker.lock();
        Ok(vhost_view(&broker, vhost(&broker, &request.name)?))
    }

    pub(crate) async fn delete_vhost(
        &self,
        request: m::DeleteVhostRequest,
    ) -> Result<m::DeleteVhostResponse, ServiceError> {
        if request.name == "/" {
            return Err(ServiceError::FailedPrecondition(
                "the default vhost '/' cannot be deleted".into(),
            ));
        }
        let name = request.name.clone();
        self.with_session(&request.name, |broker, session| {
            let reason = format!("vhost '{name}' deleted");
            Engine::close_connections(broker, Some(&name), None, &reason);
            let Some(vhost) = broker.vhosts.get(&name) else {
                return Ok(());
            };
            let queues: Vec<String> = vhost.queues.keys().cloned().collect();
            let exchanges: Vec<String> = vhost
                .exchanges
                .values()
                .filter(|x| !x.is_builtin())
                .map(|x| x.name.clone())
                .collect();
            for queue in queues {
                // Exclusive queues belong to connections being closed.
                let _ = broker.delete_queue(
                    session,
                    &pb::QueueDelete {
                        channel: CHANNEL,
                        queue,
                        ..Default::default()
                    },
                );
            }
            for exchange in exchanges {
                ok(broker.delete_exchange(
                    session,
                    &pb::ExchangeDelete {
                        channel: CHANNEL,
                        exchange,
                        ..Default::default()
                    },
                ))?;
            }
            Ok(())
        })?;
        let (done, written) = oneshot::channel();
        {
            let mut broker = self.shared.broker.lock();
            // Its policies go with it.
            let policies: Vec<WriteOp> = broker
                .vhosts
                .get(&request.name)
                .map(|vhost| {
                    vhost
                        .policies
                        .iter()
                        .chain(vhost.operator_policies.iter())
                        .map(|policy| {
                            store_op(write_op::Op::DeletePolicy(policy.definition(&request.name)))
                        })
                        .collect()
                })
                .unwrap_or_default();
            broker.vhosts.remove(&request.name);
            broker.limits.forget_vhost(&request.name);
            broker.delayed.forget(&request.name, None);
            let mut ops = vec![store_op(write_op::Op::DeleteVhost(
                store::VhostDefinition {
                    name: request.name.clone(),
                },
            ))];
            ops.extend(policies);
            // Nobody keeps permissions in a vhost that is gone.
            ops.extend(super::users::forget_vhost(&self.shared, &request.name));
            self.shared.writer.submit_synced(ops, Some(done));
        }
        await_written(written, "the vhost's deletion").await?;
        tracing::info!(vhost = %request.name, "vhost deleted by management");
        Ok(m::DeleteVhostResponse {})
    }

    /// Ready messages summed over each vhost's queues a chunk at a time;
    /// unacknowledged ones counted on its channels.
    pub(crate) async fn vhost_message_totals(
        &self,
        request: pb::VhostMessageTotalsRequest,
    ) -> Result<pb::VhostMessageTotalsResponse, ServiceError> {
        let (names, mut unacked) = {
            let broker = self.shared.broker.lock();
            let names: Vec<String> = if request.vhost.is_empty() {
                broker.vhosts.keys().cloned().collect()
            } else {
                vec![vhost(&broker, &request.vhost)?.name.clone()]
            };
            (names, unacked_by_vhost(&broker))
        };
        let mut vhosts = Vec::with_capacity(names.len());
        for name in names {
            let mut ready = 0u64;
            let walked = walk_queues(&self.shared, &name, |_, queue| {
                ready += queue.messages.len() as u64;
            })
            .await;
            // Deleted meanwhile: not in the answer, unless it was the one asked.
            if let Err(error) = walked {
                if request.vhost.is_empty() {
                    continue;
                }
                return Err(error);
            }
            vhosts.push(pb::VhostMessageTotals {
                messages_unacked: unacked.remove(&name).unwrap_or_default(),
                vhost: name,
                messages_ready: ready,
            });
        }
        vhosts.sort_by(|a, b| a.vhost.cmp(&b.vhost));
        Ok(pb::VhostMessageTotalsResponse { vhosts })
    }

    pub(crate) async fn set_transaction_timeouts(
        &self,
        request: m::SetTransactionTimeoutsRequest,
    ) -> Result<m::TransactionTimeouts, ServiceError> {
        let answer = ok(self.shared.broker.lock().set_transaction_timeouts(&request))?;
        // Shorter timeouts may be due at once.
        self.shared.tx_timer.notify_one();
        Ok(answer)
    }
}

fn vhost_view(broker: &Broker, vhost: &VHost) -> m::Vhost {
    m::Vhost {
        name: vhost.name.clone(),
        exchanges: vhost.exchanges.len() as u32,
        queues: vhost.queues.len() as u32,
        connections: broker
            .sessions
            .values()
            .filter(|s| s.vhost == vhost.name)
            .count() as u32,
    }
}
