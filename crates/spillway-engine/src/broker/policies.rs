//! Policies in force: which policy and operator policy apply to each queue
//! and exchange of a vhost, the queue limits and dead-letter target that
//! follow, and what a change does to queues that already hold messages
//! (a lower `max-length` drops the head at once, a new `expires` counts
//! from now, a higher capacity releases blocked publishers). The policy
//! itself, its checks and how keys combine are `crate::policy`'s.

use spillway_proto::management as m;
use spillway_proto::ServiceError;

use super::arguments::{dead_letter_target, queue_limits};
use super::Broker;
use crate::model::{DeathReason, Overflow};
use crate::policy::{effective_queue_arguments, Policy, PolicySet, MAX_POLICIES_PER_VHOST};
use crate::queue::Queue;

/// Recomputes one queue's policies and the settings in force; returns the
/// limits it had before.
fn refresh_queue(
    policies: &PolicySet,
    operator_policies: &PolicySet,
    vhost: &str,
    queue: &mut Queue,
) -> crate::model::QueueLimits {
    let before = queue.limits;
    let policy = policies.for_queue(&queue.name);
    let operator = operator_policies.for_queue(&queue.name);
    let unchanged = policy.map(|p| &p.name) == queue.policy.as_ref()
        && operator.map(|p| &p.name) == queue.operator_policy.as_ref()
        && policy.is_none()
        && operator.is_none();
    if unchanged {
        // No policy before or now: the declared arguments are in force.
        return before;
    }
    queue.policy = policy.map(|p| p.name.clone());
    queue.operator_policy = operator.map(|p| p.name.clone());
    let effective = effective_queue_arguments(&queue.arguments, policy, operator);
    let table = effective.as_ref().unwrap_or(&queue.arguments);
    let limits = queue_limits(table, &queue.name, vhost);
    let dead_letter = dead_letter_target(table, &queue.name, vhost);
    match (limits, dead_letter) {
        (Ok(limits), Ok(dead_letter)) => {
            queue.limits = limits;
            queue.dead_letter = dead_letter;
            queue.effective_arguments = effective;
        }
        (limits, dead_letter) => {
            // Policies are checked when set and arguments when declared;
            // should the two still not agree, the declared ones apply.
            let error = limits.err().or(dead_letter.err()).map(|e| e.text);
            tracing::warn!(vhost, queue = %queue.name, ?error, "policy does not apply to queue, its own arguments do");
            queue.limits = queue_limits(&queue.arguments, &queue.name, vhost).unwrap_or_default();
            queue.dead_letter =
                dead_letter_target(&queue.arguments, &queue.name, vhost).unwrap_or_default();
            queue.effective_arguments = None;
        }
    }
    before
}

impl Broker {
    /// Applies the vhost's policies to a queue just declared, or whose
    /// arguments management changed (its capacities): the caller sees to
    /// what the new limits do.
    pub(crate) fn apply_policies_to_queue(&mut self, vhost_name: &str, queue_name: &str) {
        let Some(vhost) = self.vhosts.get_mut(vhost_name) else {
            return;
        };
        let crate::vhost::VHost {
            policies,
            operator_policies,
            queues,
            ..
        } = vhost;
        if let Some(queue) = queues.get_mut(queue_name) {
            refresh_queue(policies, operator_policies, vhost_name, queue);
        }
    }

    /// Applies the vhost's policies to an exchange just declared.
    pub(super) fn apply_policies_to_new_exchange(&mut self, vhost_name: &str, exchange: &str) {
        let Some(vhost) = self.vhosts.get_mut(vhost_name) else {
            return;
        };
        let policy = vhost.policies.for_exchange(exchange).cloned();
        if let Some(exchange) = vhost.exchanges.get_mut(exchange) {
            exchange.set_policy(policy.as_ref());
        }
    }

    /// Applies every policy of the vhost to all its queues and exchanges,
    /// with what a change does to queues holding messages. Returns the
    /// queues to dispatch (those that received dead letters).
    pub(crate) fn apply_policies(&mut self, vhost_name: &str) -> Vec<String> {
        let mut touched = Vec::new();
        for (queue, before) in self.refresh_policies(vhost_name) {
            touched.extend(self.limits_changed(vhost_name, &queue, before));
        }
        touched
    }

    /// Recomputes which policies apply to the vhost's queues and exchanges
    /// and the settings in force; returns the queues whose limits changed,
    /// with the limits they had.
    fn refresh_policies(&mut self, vhost_name: &str) -> Vec<(String, crate::model::QueueLimits)> {
        let Some(vhost) = self.vhosts.get_mut(vhost_name) else {
            return Vec::new();
        };
        let crate::vhost::VHost {
            policies,
            operator_policies,
            queues,
            exchanges,
            ..
        } = vhost;
        for exchange in exchanges.values_mut() {
            exchange.set_policy(policies.for_exchange(&exchange.name));
        }
        let mut changed = Vec::new();
        for queue in queues.values_mut() {
            let before = refresh_queue(policies, operator_policies, vhost_name, queue);
            if before != queue.limits {
                changed.push((queue.name.clone(), before));
            }
        }
        changed
    }

    /// Applies the policies to every vhost (after recovery installed them
    /// with the definitions, before any queue holds a message).
    pub(crate) fn apply_all_policies(&mut self) {
        let vhosts: Vec<String> = self.vhosts.keys().cloned().collect();
        for vhost in vhosts {
            self.refresh_policies(&vhost);
        }
    }

    /// What a queue whose limits changed under its messages must do now.
    fn limits_changed(
        &mut self,
        vhost_name: &str,
        queue_name: &str,
        before: crate::model::QueueLimits,
    ) -> Vec<String> {
        let Some(queue) = self.queue_mut_opt(vhost_name, queue_name) else {
            return Vec::new();
        };
        let limits = queue.limits;
        tracing::info!(
            vhost = vhost_name,
            queue = queue_name,
            ?limits,
            "queue settings changed by policy"
        );
        if limits.expires != before.expires {
            self.touch_queue(vhost_name, queue_name);
        }
        self.check_underfull(vhost_name, queue_name);
        self.trim_to_length(vhost_name, queue_name)
    }

    /// Drops a drop-head queue's oldest messages while it is over its
    /// length limits (dead-lettered, reason `maxlen`, or discarded).
    fn trim_to_length(&mut self, vhost_name: &str, queue_name: &str) -> Vec<String> {
        let Some(queue) = self.queue_mut_opt(vhost_name, queue_name) else {
            return Vec::new();
        };
        if queue.limits.overflow != Overflow::DropHead || queue.recovering {
            return Vec::new();
        }
        let dropped = queue.trim_to_length();
        self.let_go(vhost_name, queue_name, dropped, DeathReason::Maxlen)
    }

    /// Adds or replaces a policy of a vhost and applies it. Returns the
    /// queues to dispatch.
    pub(crate) fn set_policy(
        &mut self,
        vhost_name: &str,
        policy: Policy,
    ) -> Result<Vec<String>, ServiceError> {
        let vhost = self
            .vhosts
            .get_mut(vhost_name)
            .ok_or_else(|| ServiceError::NotFound(format!("no vhost '{vhost_name}'")))?;
        let set = vhost.policy_set_mut(policy.operator);
        if set.get(&policy.name).is_none() && set.len() >= MAX_POLICIES_PER_VHOST {
            return Err(ServiceError::FailedPrecondition(format!(
                "vhost '{vhost_name}' has {MAX_POLICIES_PER_VHOST} policies already"
            )));
        }
        tracing::info!(
            vhost = vhost_name,
            policy = %policy.name,
            operator = policy.operator,
            pattern = %policy.pattern,
            apply_to = policy.apply_to.as_str(),
            priority = policy.priority,
            definition = %policy.definition,
            "policy set"
        );
        set.insert(policy);
        Ok(self.apply_policies(vhost_name))
    }

    /// Removes a policy; what it set stops applying at once. Returns the
    /// removed policy and the queues to dispatch.
    pub(crate) fn clear_policy(
        &mut self,
        vhost_name: &str,
        name: &str,
        operator: bool,
    ) -> Result<(Policy, Vec<String>), ServiceError> {
        let vhost = self
            .vhosts
            .get_mut(vhost_name)
            .ok_or_else(|| ServiceError::NotFound(format!("no vhost '{vhost_name}'")))?;
        let kind = if operator {
            "operator policy"
        } else {
            "policy"
        };
        let removed = vhost.policy_set_mut(operator).remove(name).ok_or_else(|| {
            ServiceError::NotFound(format!("no {kind} '{name}' in vhost '{vhost_name}'"))
        })?;
        tracing::info!(
            vhost = vhost_name,
            policy = name,
            operator,
            "policy cleared"
        );
        Ok((removed, self.apply_policies(vhost_name)))
    }

    /// A vhost's policies or operator policies, by name.
    pub(crate) fn list_policies(
        &self,
        vhost_name: &str,
        operator: bool,
    ) -> Result<Vec<m::Policy>, ServiceError> {
        let vhost = self
            .vhosts
            .get(vhost_name)
            .ok_or_else(|| ServiceError::NotFound(format!("no vhost '{vhost_name}'")))?;
        let set = if operator {
            &vhost.operator_policies
        } else {
            &vhost.policies
        };
        Ok(set.iter().map(|p| policy_view(vhost_name, p)).collect())
    }
}

pub(crate) fn policy_view(vhost: &str, policy: &Policy) -> m::Policy {
    m::Policy {
        vhost: vhost.to_string(),
        name: policy.name.clone(),
        pattern: policy.pattern.clone(),
        apply_to: policy.apply_to.as_str().to_string(),
        priority: policy.priority,
        definition: policy.definition.clone(),
        operator: policy.operator,
    }
}
