//! The oracle: after every step of a run it reads what each running member
//! has applied and checks that
//!
//! - **replicas never diverge**: every member applied the same entry (term
//!   and command) at every log index (the first member seen at an index
//!   fixes it), and in every member's log, applied or not, the terms never
//!   go down from one index to the next (a leftover of a deposed leader
//!   after a newer leader's entries is how a log goes wrong before it is
//!   ever applied);
//! - **at most one engine writes**: walking the applied log with the rule
//!   the group states (a lease of epoch e+1 takes over; a batch takes
//!   effect only under the epoch in force, once per number), every batch
//!   that takes effect comes from the holder of its epoch, and epochs only
//!   go up;
//! - **no confirmed write is lost**: every write an engine was told is
//!   done is in the applied log, taking effect. (The member that answered
//!   had applied it; the oracle reads a member just before it is crashed.)
//!
//! At the end of a run (faults healed, every member caught up) it also
//! reads every member's records: each write that took effect is there,
//! each refused one is not.

use std::collections::{BTreeMap, BTreeSet};

use prost::Message as _;
use spillway_proto::storage::StorageApi;
use spillway_proto::storage::{write_op, WriteBatch};
use spillway_storage::group::{Command, LoggedEntry};
use spillway_storage::StorageGroup;

use crate::engine::holder_number;
use crate::history::MessageTag;
use crate::network::Host;

/// A broken guarantee, with what shows it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Violation {
    #[error("replicas diverge at log index {index}: member {member} applied {found}, another applied {expected}")]
    Diverged {
        index: u64,
        member: Host,
        found: String,
        expected: String,
    },
    #[error("member {member}'s log goes back from term {before} to term {term} at index {index}")]
    TermsGoBack {
        member: Host,
        index: u64,
        before: u64,
        term: u64,
    },
    #[error("member {member}'s log has a hole before index {index}")]
    Hole { member: Host, index: u64 },
    #[error("two engines write: batch {tag:?} took effect at log index {index} under epoch {epoch}, which engine {holder} holds")]
    TwoWriters {
        tag: MessageTag,
        index: u64,
        epoch: u64,
        holder: u64,
    },
    #[error("a confirmed write is lost: {tag:?} is not in the applied log, taking effect")]
    Lost { tag: MessageTag },
    #[error("member {member}'s records disagree with its log: {detail}")]
    Records { member: Host, detail: String },
    #[error("the member {member} cannot be read: {detail}")]
    Unreadable { member: Host, detail: String },
    #[error("the group did not settle: {0}")]
    Unsettled(String),
}

#[derive(Default)]
pub struct Oracle {
    /// Every applied entry by log index (its term and command), as first
    /// seen.
    applied: BTreeMap<u64, (u64, Option<Command>)>,
    /// Per member, the next log index to read of it.
    read_from: BTreeMap<Host, u64>,
    /// How far the applied log was walked through the lease rule.
    walked: u64,
    /// The epoch in force and its holder's number, as walked.
    epoch: u64,
    holder: u64,
    /// Per epoch, the last batch number that took effect.
    last_sequence: BTreeMap<u64, u64>,
    /// The batches that took effect, and those that did not.
    effective: BTreeSet<MessageTag>,
    ineffective: BTreeSet<MessageTag>,
}

/// A member's log, from the entries read this time on: no holes, and
/// terms that never go down.
fn check_terms(
    member: Host,
    before: Option<(u64, u64)>,
    applied: &[LoggedEntry],
    unapplied: &[LoggedEntry],
) -> Result<(), Violation> {
    let mut last = before;
    for entry in applied.iter().chain(unapplied) {
        if let Some((index, term)) = last {
            if entry.index != index + 1 && entry.index > index {
                return Err(Violation::Hole {
                    member,
                    index: entry.index,
                });
            }
            if entry.index == index + 1 && entry.term < term {
                return Err(Violation::TermsGoBack {
                    member,
                    index: entry.index,
                    before: term,
                    term: entry.term,
                });
            }
        }
        last = Some((entry.index, entry.term));
    }
    Ok(())
}

fn tag_of(batch: &WriteBatch) -> Option<MessageTag> {
    batch.ops.iter().find_map(|op| match &op.op {
        Some(write_op::Op::PutMessage(record)) => Some(MessageTag::of(record.id)),
        _ => None,
    })
}

impl Oracle {
    /// Reads what every member in `members` applied since last time and
    /// checks the guarantees against every write confirmed so far.
    pub async fn observe(
        &mut self,
        members: &BTreeMap<Host, StorageGroup>,
        confirmed: impl Iterator<Item = MessageTag>,
    ) -> Result<(), Violation> {
        for (id, member) in members {
            let from = self.read_from.get(id).copied().unwrap_or(0);
            let unreadable = |error: spillway_storage::group::GroupError| Violation::Unreadable {
                member: *id,
                detail: error.to_string(),
            };
            let applied = member.applied_entries(from).await.map_err(unreadable)?;
            for entry in &applied {
                let seen = (entry.term, entry.command.clone());
                match self.applied.get(&entry.index) {
                    Some(expected) if *expected != seen => {
                        return Err(Violation::Diverged {
                            index: entry.index,
                            member: *id,
                            found: format!("{seen:?}"),
                            expected: format!("{expected:?}"),
                        })
                    }
                    Some(_) => {}
                    None => {
                        self.applied.insert(entry.index, seen);
                    }
                }
                self.read_from.insert(*id, entry.index + 1);
            }
            // Its whole log, from its last applied entry on.
            let read_to = self.read_from.get(id).copied().unwrap_or(0);
            let last_applied = read_to
                .checked_sub(1)
                .and_then(|index| self.applied.get(&index).map(|(term, _)| (index, *term)));
            let unapplied = member.unapplied_entries().await.map_err(unreadable)?;
            check_terms(*id, last_applied, &applied, &unapplied)?;
        }
        self.walk()?;
        for tag in confirmed {
            if !self.effective.contains(&tag) {
                return Err(Violation::Lost { tag });
            }
        }
        Ok(())
    }

    /// Walks the applied log from where it stopped, as far as some member
    /// has applied every entry (each member's entries are read in order,
    /// so up to the furthest reader the log has no holes).
    fn walk(&mut self) -> Result<(), Violation> {
        let complete = self.read_from.values().copied().max().unwrap_or(0);
        let range: Vec<(u64, (u64, Option<Command>))> = self
            .applied
            .range(self.walked..complete)
            .map(|(index, command)| (*index, command.clone()))
            .collect();
        for (index, (_, command)) in range {
            let Some(command) = command else {
                continue;
            };
            match command {
                Command::Lease { epoch, holder, .. } if epoch == self.epoch + 1 => {
                    self.epoch = epoch;
                    self.holder = holder_number(&holder).unwrap_or(0);
                }
                Command::Write(bytes) => {
                    let Ok(batch) = WriteBatch::decode(bytes.as_slice()) else {
                        continue;
                    };
                    let Some(tag) = tag_of(&batch) else {
                        continue;
                    };
                    let last = self.last_sequence.get(&batch.epoch).copied().unwrap_or(0);
                    if batch.epoch != self.epoch || batch.epoch == 0 {
                        self.ineffective.insert(tag);
                        continue;
                    }
                    if batch.sequence <= last {
                        // A retry of a batch applied before: a no-op.
                        continue;
                    }
                    self.last_sequence.insert(batch.epoch, batch.sequence);
                    if tag.engine != self.holder || tag.epoch != batch.epoch {
                        return Err(Violation::TwoWriters {
                            tag,
                            index,
                            epoch: self.epoch,
                            holder: self.holder,
                        });
                    }
                    self.effective.insert(tag);
                }
                _ => {}
            }
        }
        self.walked = self.walked.max(complete);
        Ok(())
    }

    /// How many batches took effect.
    pub fn effective_writes(&self) -> usize {
        self.effective.len()
    }

    /// The highest log index some member applied.
    pub fn applied_index(&self) -> u64 {
        self.read_from
            .values()
            .copied()
            .max()
            .unwrap_or(0)
            .saturating_sub(1)
    }

    /// Every member's records hold exactly the batches that took effect.
    pub async fn check_records(
        &self,
        members: &BTreeMap<Host, StorageGroup>,
    ) -> Result<(), Violation> {
        for (id, member) in members {
            let store = member.store();
            let effective: Vec<u64> = self.effective.iter().map(|tag| tag.id()).collect();
            let found = StorageApi::read_messages(store, effective.clone())
                .await
                .map_err(|error| Violation::Unreadable {
                    member: *id,
                    detail: error.to_string(),
                })?;
            if found.len() != effective.len() {
                let found: BTreeSet<u64> = found.iter().map(|record| record.id).collect();
                let missing = effective
                    .iter()
                    .filter(|id| !found.contains(id))
                    .map(|id| MessageTag::of(*id))
                    .take(3)
                    .collect::<Vec<_>>();
                return Err(Violation::Records {
                    member: *id,
                    detail: format!("writes that took effect are missing, such as {missing:?}"),
                });
            }
            // A batch refused everywhere must have left nothing (one that
            // took effect under a retry counts as effective).
            let refused: Vec<u64> = self
                .ineffective
                .difference(&self.effective)
                .map(|tag| tag.id())
                .collect();
            let leaked = StorageApi::read_messages(store, refused)
                .await
                .map_err(|error| Violation::Unreadable {
                    member: *id,
                    detail: error.to_string(),
                })?;
            if let Some(record) = leaked.first() {
                return Err(Violation::Records {
                    member: *id,
                    detail: format!(
                        "a refused write left its record: {:?}",
                        MessageTag::of(record.id)
                    ),
                });
            }
        }
        Ok(())
    }
}
