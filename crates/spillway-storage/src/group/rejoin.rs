//! A member that starts holding nothing, and what keeps its return safe.
//!
//! A member whose log and records are empty at start either joins a group
//! for the first time, or was in one and lost its disk (or was emptied
//! after a snapshot install was cut short, `machine.rs`). In the second
//! case two things it once promised are gone: entries it acknowledged (a
//! commit may have counted its copy) and the vote it cast in the current
//! term. openraft lets such a member rejoin under its own id (the leader
//! restarts its search, feature `loosen-follower-log-revert`), but were it
//! to vote at once, it and one other member could elect a leader that
//! lacks an entry committed with the lost copy, or it could vote twice in
//! one term.
//!
//! A member tells the two apart at start: it asks the others, and if one
//! answers that the group has a leader or has committed anything, the
//! group ran without this member ([`group_runs_already`]). It then does not
//! form the group again (it would campaign in the group's first term and
//! could depose its leader), and until it has applied as far as the leader
//! had committed when it first heard from one, it refuses its vote to
//! every candidate whose log holds more than the group's first entry. A
//! member that finds no running group is at the group's first start and
//! votes as Raft says; so does one that leads.
//!
//! What this leaves open: a member that lost its disk while none of the
//! others could be reached is taken for a first start.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use openraft::{BasicNode, RaftMetrics};
use tokio::sync::watch;
use tokio::time::Instant;

use super::transport::GroupTransport;

/// How often the leader is asked how far it has committed, until it answers.
const ASK_EVERY: Duration = Duration::from_millis(500);

/// Whether this member still catches up after starting empty. Cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct Rejoin {
    catching_up: Arc<AtomicBool>,
}

impl Rejoin {
    /// A member that started with data: it votes as Raft says.
    pub(crate) fn settled() -> Self {
        Self::default()
    }

    /// A member that started empty: it withholds votes until caught up.
    pub(crate) fn catching_up() -> Self {
        Self {
            catching_up: Arc::new(AtomicBool::new(true)),
        }
    }

    pub(crate) fn is_catching_up(&self) -> bool {
        self.catching_up.load(Ordering::Acquire)
    }

    /// Whether a vote for a candidate whose last log index is
    /// `candidate_last_index` (`None`: an empty log) is withheld.
    pub(crate) fn withholds_vote_for(&self, candidate_last_index: Option<u64>) -> bool {
        self.is_catching_up() && candidate_last_index.is_some_and(|index| index > 0)
    }

    /// Follows this member until it has applied as far as the leader had
    /// committed when it first answered; then it votes again. Ends with
    /// the member (its `metrics` close); holds no handle that keeps it up.
    pub(crate) async fn watch(
        self,
        mut metrics: watch::Receiver<RaftMetrics<u64, BasicNode>>,
        node_id: u64,
        transport: impl GroupTransport,
    ) {
        if !self.is_catching_up() {
            return;
        }
        tracing::info!(
            node_id,
            "storage group member started empty: it votes once it has caught up with the leader"
        );
        let mut target: Option<u64> = None;
        let mut asked: Option<Instant> = None;
        loop {
            let now = metrics.borrow_and_update().clone();
            let applied = now.last_applied.as_ref().map(|log_id| log_id.index);
            let leader = now.current_leader;
            let caught_up = leader == Some(node_id)
                || target.is_some_and(|target| applied.is_some_and(|applied| applied >= target));
            if caught_up {
                self.catching_up.store(false, Ordering::Release);
                tracing::info!(
                    node_id,
                    applied = applied.unwrap_or(0),
                    "storage group member caught up after starting empty: it votes again"
                );
                return;
            }
            let may_ask = asked.is_none_or(|at| at.elapsed() >= ASK_EVERY);
            if let (None, Some(leader), true) = (target, leader, may_ask) {
                asked = Some(Instant::now());
                let address = now
                    .membership_config
                    .membership()
                    .get_node(&leader)
                    .map(|node| node.addr.clone());
                if let Some(address) = address {
                    match transport.status_of(&address).await {
                        Ok(status) => {
                            // On a leader, applied is committed.
                            let committed = status.committed_index;
                            tracing::info!(
                                node_id,
                                leader,
                                committed,
                                "storage group member catches up to the leader's commit"
                            );
                            target = Some(committed);
                            continue;
                        }
                        Err(error) => {
                            tracing::debug!(node_id, leader, %error, "the leader did not say how far it committed");
                        }
                    }
                }
            }
            match tokio::time::timeout(ASK_EVERY, metrics.changed()).await {
                Ok(Ok(())) | Err(_) => {}
                Ok(Err(_closed)) => return,
            }
        }
    }
}

/// Whether one of `others` (addresses of the other members) answers that
/// it is in a group that has a leader or has committed something: the
/// group was formed without this member, which must then not form it
/// again. A member that forms a running group campaigns in the group's
/// first term and can depose its leader (seen: 3.3 s without a leader
/// when the third member of a new group started 0.2 s after the others).
pub(crate) async fn group_runs_already(others: &[String], transport: &impl GroupTransport) -> bool {
    let asks = others.iter().map(|address| async move {
        let answer = transport.status_of(address).await;
        if let Err(error) = &answer {
            tracing::info!(member = %address, %error, "a storage group member did not say whether the group runs");
        }
        answer
    });
    futures::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .any(|status| status.leader != 0 || status.committed_index > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_settled_member_withholds_no_vote() {
        let rejoin = Rejoin::settled();
        assert!(!rejoin.withholds_vote_for(Some(100)));
        assert!(!rejoin.withholds_vote_for(None));
    }

    #[test]
    fn a_member_catching_up_votes_only_for_candidates_that_hold_nothing_more_than_the_start() {
        let rejoin = Rejoin::catching_up();
        assert!(rejoin.withholds_vote_for(Some(1)));
        assert!(rejoin.withholds_vote_for(Some(14_183)));
        assert!(!rejoin.withholds_vote_for(Some(0)));
        assert!(!rejoin.withholds_vote_for(None));
        rejoin.catching_up.store(false, Ordering::Release);
        assert!(!rejoin.withholds_vote_for(Some(14_183)));
    }
}
