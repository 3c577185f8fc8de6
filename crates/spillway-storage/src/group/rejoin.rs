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
//! group ran without this member ([`running_group`]). It then does not
//! form the group again (it would campaign in the group's first term and
//! could depose its leader), and until it has applied as far as the leader
//! had committed when it first heard from one, it votes only for a
//! candidate that holds what the leader held: a candidate in a later term
//! than the leader's whose last log id is at least the leader's last log id
//! when this member asked (its [`Floor`]). That is the vote Raft would let
//! it cast had it kept its log up to there, so the lost copy cannot elect a
//! leader that lacks a committed entry, and the term rule keeps it from
//! voting again in a term it may have voted in before. While it knows no
//! floor (no leader answered yet) it votes only for candidates whose log
//! holds nothing more than the group's first entry. A member that finds no
//! running group is at the group's first start and votes as Raft says; so
//! does one that leads.
//!
//! Without the floor, a member that started a little after the others at
//! the group's first start withheld every vote until it had caught up, and
//! a leader that died before then left the survivors without a majority
//! (seen in CI: the leader killed a second after the group formed, the
//! survivor campaigned for a minute).
//!
//! What this leaves open: a member that lost its disk while none of the
//! others could be reached is taken for a first start; one that voted in a
//! term above the leader's just before losing its disk (a campaign the
//! leader never heard of) may vote once more in that term.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use openraft::{BasicNode, RaftMetrics};
use parking_lot::Mutex;
use spillway_proto::storage::GroupStatus;
use tokio::sync::watch;
use tokio::time::Instant;

use super::transport::GroupTransport;

/// How often the leader is asked how far it has committed, until it answers.
const ASK_EVERY: Duration = Duration::from_millis(500);

/// What a member that started empty requires of a candidate: the leader's
/// term and last log id (term, index) when it answered this member.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Floor {
    /// The leader's last log id as (term, index): on a leader, its last
    /// entry is of its own term.
    pub last_log: (u64, u64),
}

impl Floor {
    /// The floor a leader's status sets; `None` from a member that does not
    /// lead (its log may lack what the leader committed).
    pub(crate) fn from_leader(status: &GroupStatus) -> Option<Self> {
        let leads = status.leader != 0 && status.leader == status.node_id;
        leads.then_some(Self {
            last_log: (status.term, status.last_log_index),
        })
    }
}

/// Whether this member still catches up after starting empty, and what it
/// requires of a candidate meanwhile. Cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct Rejoin {
    catching_up: Arc<AtomicBool>,
    floor: Arc<Mutex<Option<Floor>>>,
}

impl Rejoin {
    /// A member that started with data: it votes as Raft says.
    pub(crate) fn settled() -> Self {
        Self::default()
    }

    /// A member that started empty: it votes only for candidates at or
    /// past `floor` (none known: only for candidates that hold nothing)
    /// until caught up.
    pub(crate) fn catching_up(floor: Option<Floor>) -> Self {
        Self {
            catching_up: Arc::new(AtomicBool::new(true)),
            floor: Arc::new(Mutex::new(floor)),
        }
    }

    pub(crate) fn is_catching_up(&self) -> bool {
        self.catching_up.load(Ordering::Acquire)
    }

    /// Raises the floor to what a later answer of a leader says.
    fn raise_floor(&self, floor: Floor) {
        let mut known = self.floor.lock();
        if known.is_none_or(|known| known < floor) {
            *known = Some(floor);
        }
    }

    /// Whether a vote for a candidate campaigning in `candidate_term` whose
    /// last log id is `candidate_last_log` (term, index; `None`: an empty
    /// log) is withheld.
    pub(crate) fn withholds_vote_for(
        &self,
        candidate_term: u64,
        candidate_last_log: Option<(u64, u64)>,
    ) -> bool {
        if !self.is_catching_up() {
            return false;
        }
        match *self.floor.lock() {
            None => candidate_last_log.is_some_and(|(_, index)| index > 0),
            Some(floor) => {
                let holds_what_the_leader_held =
                    candidate_last_log.is_some_and(|last_log| last_log >= floor.last_log);
                let later_term = candidate_term > floor.last_log.0;
                !(holds_what_the_leader_held && later_term)
            }
        }
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
                            if let Some(floor) = Floor::from_leader(&status) {
                                self.raise_floor(floor);
                            }
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

/// What the other members say of their group when this member starts.
#[derive(Debug, Default)]
pub(crate) struct RunningGroup {
    /// One of them is in a group that has a leader or has committed
    /// something: the group was formed without this member, which must
    /// then not form it again. A member that forms a running group
    /// campaigns in the group's first term and can depose its leader
    /// (seen: 3.3 s without a leader when the third member of a new group
    /// started 0.2 s after the others).
    pub runs: bool,
    /// The highest floor a leader among them answered with.
    pub floor: Option<Floor>,
}

/// Asks `others` (addresses of the other members) how their group stands.
pub(crate) async fn running_group(
    others: &[String],
    transport: &impl GroupTransport,
) -> RunningGroup {
    let asks = others.iter().map(|address| async move {
        let answer = transport.status_of(address).await;
        if let Err(error) = &answer {
            tracing::info!(member = %address, %error, "a storage group member did not say whether the group runs");
        }
        answer
    });
    let answers = futures::future::join_all(asks).await;
    let answered = answers.iter().flatten();
    RunningGroup {
        runs: answered
            .clone()
            .any(|status| status.leader != 0 || status.committed_index > 0),
        floor: answered.filter_map(Floor::from_leader).max(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_settled_member_withholds_no_vote() {
        let rejoin = Rejoin::settled();
        assert!(!rejoin.withholds_vote_for(9, Some((8, 100))));
        assert!(!rejoin.withholds_vote_for(1, None));
    }

    #[test]
    fn without_a_floor_a_member_catching_up_votes_only_for_candidates_that_hold_nothing_more_than_the_start(
    ) {
        let rejoin = Rejoin::catching_up(None);
        assert!(rejoin.withholds_vote_for(2, Some((1, 1))));
        assert!(rejoin.withholds_vote_for(9, Some((8, 14_183))));
        assert!(!rejoin.withholds_vote_for(1, Some((0, 0))));
        assert!(!rejoin.withholds_vote_for(1, None));
        rejoin.catching_up.store(false, Ordering::Release);
        assert!(!rejoin.withholds_vote_for(9, Some((8, 14_183))));
    }

    #[test]
    fn with_a_floor_a_member_catching_up_votes_for_candidates_that_hold_what_the_leader_held_in_a_later_term(
    ) {
        let rejoin = Rejoin::catching_up(Some(Floor { last_log: (3, 100) }));
        // What the leader held, campaigning in a later term: the vote Raft
        // would give.
        assert!(!rejoin.withholds_vote_for(4, Some((3, 100))));
        assert!(!rejoin.withholds_vote_for(5, Some((3, 250))));
        assert!(!rejoin.withholds_vote_for(5, Some((4, 101))));
        // A log shorter than the leader's, or of an older term.
        assert!(rejoin.withholds_vote_for(4, Some((3, 99))));
        assert!(rejoin.withholds_vote_for(4, Some((2, 500))));
        assert!(rejoin.withholds_vote_for(4, None));
        // The leader's own term: this member may have voted in it.
        assert!(rejoin.withholds_vote_for(3, Some((3, 100))));
        // A later leader's answer raises the floor; an older one does not
        // lower it.
        rejoin.raise_floor(Floor { last_log: (5, 300) });
        rejoin.raise_floor(Floor { last_log: (3, 100) });
        assert!(rejoin.withholds_vote_for(5, Some((3, 250))));
        assert!(!rejoin.withholds_vote_for(6, Some((5, 300))));
    }

    #[test]
    fn only_a_leader_sets_a_floor() {
        let leader = GroupStatus {
            leader: 3,
            node_id: 3,
            term: 2,
            last_log_index: 40,
            ..Default::default()
        };
        assert_eq!(
            Floor::from_leader(&leader),
            Some(Floor { last_log: (2, 40) })
        );
        let follower = GroupStatus {
            node_id: 1,
            ..leader.clone()
        };
        assert_eq!(Floor::from_leader(&follower), None);
        let leaderless = GroupStatus {
            leader: 0,
            node_id: 0,
            ..leader
        };
        assert_eq!(Floor::from_leader(&leaderless), None);
    }
}
