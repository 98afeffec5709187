//! Inspections (`specs/protocol.md` §2.13): who is asked for its table,
//! under which seq, until when, and which tables are late.
//!
//! * An inspection asks every live target's process once, under a seq of
//!   the parent's, and ends once each answered, was lost, or the control
//!   timeout passed: [`Effect::InspectDone`] names the targets that did
//!   not answer.
//! * A table for an inspection that no longer waits for that target is
//!   refused and changes nothing (late, or a duplicate); it never ends the
//!   target. It changes nothing in the registry either way.

use std::collections::BTreeSet;

use super::{Effect, Lifecycle, Parent};
use crate::error::{Error, OperationKind};
use crate::protocol::{Seq, TargetId, Time};

/// An inspection in flight.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct Inspection {
    /// The targets whose table it still waits for.
    pub(crate) waiting: BTreeSet<TargetId>,
    /// The targets that will not answer (lost while it waited).
    pub(crate) missing: BTreeSet<TargetId>,
    /// When it gives up on the targets it still waits for.
    pub(crate) deadline: Time,
}

impl Parent {
    /// Asks every live target's process (serving, or a replacement still
    /// joining) for its table (§2.13): emits [`Effect::Inspect`] for each,
    /// under one fresh seq, which it returns; [`Effect::InspectDone`]
    /// follows once each answered ([`Parent::handle_table`]), was lost, or
    /// `now` plus the control timeout passed (at once when no target is
    /// live). It changes nothing else.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless started.
    pub fn inspect(&mut self, now: Time) -> Result<Seq, Error> {
        if self.lifecycle != Lifecycle::Started {
            return Err(self.lifecycle_error(OperationKind::Inspect, "started"));
        }
        let seq = self.fresh_seq();
        let waiting: BTreeSet<TargetId> = self
            .all_targets()
            .filter(|t| self.is_target_live(*t))
            .collect();
        for target in &waiting {
            self.effects.push_back(Effect::Inspect {
                target: *target,
                seq,
            });
        }
        let inspection = Inspection {
            waiting,
            missing: BTreeSet::new(),
            deadline: now.saturating_add_micros(self.config.control_timeout),
        };
        self.inspections.insert(seq, inspection);
        self.settle_inspection(seq);
        Ok(seq)
    }

    /// `target`'s table for inspection `seq` arrived: `Ok(true)` when the
    /// inspection waited for it (hand the table over; an
    /// [`Effect::InspectDone`] follows once it was the last), `Ok(false)`
    /// when it is refused and changes nothing (late, a duplicate, or
    /// after close).
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` before start; `FRAME_INVALID` for a target out
    /// of range or a seq this parent never issued.
    pub fn handle_table(&mut self, target: TargetId, seq: Seq) -> Result<bool, Error> {
        if !self.accepts_from(target, OperationKind::Inspect)? {
            return Ok(false);
        }
        self.check_issued(target, seq, "table")?;
        let waited = self
            .inspections
            .get_mut(&seq)
            .is_some_and(|inspection| inspection.waiting.remove(&target));
        if waited {
            self.settle_inspection(seq);
        }
        Ok(waited)
    }

    /// The seqs of the inspections in flight, in seq order.
    pub fn inspections_in_flight(&self) -> Vec<Seq> {
        self.inspections.keys().copied().collect()
    }

    /// `target`'s process is lost: no inspection waits for it any more.
    pub(super) fn inspections_lost(&mut self, target: TargetId) {
        let seqs: Vec<Seq> = self
            .inspections
            .iter_mut()
            .filter_map(|(seq, inspection)| {
                inspection.waiting.remove(&target).then(|| {
                    inspection.missing.insert(target);
                    *seq
                })
            })
            .collect();
        for seq in seqs {
            self.settle_inspection(seq);
        }
    }

    /// Gives up, at `now`, on the targets of inspections past their
    /// deadline.
    pub(super) fn expire_inspections(&mut self, now: Time) {
        let due: Vec<Seq> = self
            .inspections
            .iter()
            .filter(|(_, inspection)| inspection.deadline <= now)
            .map(|(seq, _)| *seq)
            .collect();
        for seq in due {
            if let Some(inspection) = self.inspections.get_mut(&seq) {
                let waiting = std::mem::take(&mut inspection.waiting);
                inspection.missing.extend(waiting);
            }
            self.settle_inspection(seq);
        }
    }

    /// The earliest deadline of an inspection in flight.
    pub(super) fn inspection_timeout(&self) -> Option<Time> {
        self.inspections.values().map(|i| i.deadline).min()
    }

    /// At close: every inspection ends, without the tables not yet there.
    pub(super) fn close_inspections(&mut self) {
        for inspection in self.inspections.values_mut() {
            let waiting = std::mem::take(&mut inspection.waiting);
            inspection.missing.extend(waiting);
        }
        let seqs: Vec<Seq> = self.inspections.keys().copied().collect();
        for seq in seqs {
            self.settle_inspection(seq);
        }
    }

    /// Ends inspection `seq` once it waits for nobody.
    fn settle_inspection(&mut self, seq: Seq) {
        if self
            .inspections
            .get(&seq)
            .is_some_and(|inspection| inspection.waiting.is_empty())
        {
            if let Some(inspection) = self.inspections.remove(&seq) {
                self.effects.push_back(Effect::InspectDone {
                    seq,
                    missing: inspection.missing.into_iter().collect(),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{drain, started};
    use crate::error::ErrorCode;
    use crate::protocol::{Effect, Parent, Seq, TargetId, Time};

    #[test]
    fn an_inspection_asks_every_live_target_and_ends_with_the_missing_ones() {
        let mut p = started(3);
        p.target_died(TargetId(2), "gone", Time(0)).unwrap();
        drain(&mut p);
        let seq = p.inspect(Time(10)).unwrap();
        let ask = |t| Effect::Inspect {
            target: TargetId(t),
            seq,
        };
        assert_eq!(drain(&mut p), vec![ask(0), ask(1)]);
        assert_eq!(p.inspections_in_flight(), vec![seq]);
        assert_eq!(p.poll_timeout(), Some(Time(110)));
        assert_eq!(p.handle_table(TargetId(0), seq), Ok(true));
        // A duplicate, and a target never asked: refused, nothing changes.
        let before = p.clone();
        assert_eq!(p.handle_table(TargetId(0), seq), Ok(false));
        assert_eq!(p.handle_table(TargetId(2), seq), Ok(false));
        assert_eq!(p, before);
        assert_eq!(drain(&mut p), vec![]);
        p.handle_timeout(Time(110));
        assert_eq!(
            drain(&mut p),
            vec![Effect::InspectDone {
                seq,
                missing: vec![TargetId(1)]
            }]
        );
        // The late table is refused; a seq never issued is out of protocol.
        assert_eq!(p.handle_table(TargetId(1), seq), Ok(false));
        assert_eq!(
            p.handle_table(TargetId(1), Seq(99)).unwrap_err().code,
            ErrorCode::FRAME_INVALID
        );
        assert!(p.inspections_in_flight().is_empty());
    }

    #[test]
    fn a_loss_or_a_close_ends_what_waits_for_it() {
        let mut p = started(2);
        let first = p.inspect(Time(0)).unwrap();
        let second = p.inspect(Time(0)).unwrap();
        drain(&mut p);
        p.handle_table(TargetId(1), first).unwrap();
        p.target_died(TargetId(0), "killed", Time(1)).unwrap();
        assert_eq!(
            drain(&mut p),
            vec![Effect::InspectDone {
                seq: first,
                missing: vec![TargetId(0)]
            }]
        );
        p.close().unwrap();
        assert_eq!(
            drain(&mut p),
            vec![Effect::InspectDone {
                seq: second,
                missing: vec![TargetId(0), TargetId(1)]
            }]
        );
        // Nothing live: done at once; before start: refused.
        let mut none = started(1);
        none.target_died(TargetId(0), "gone", Time(0)).unwrap();
        drain(&mut none);
        let seq = none.inspect(Time(1)).unwrap();
        assert_eq!(
            drain(&mut none),
            vec![Effect::InspectDone {
                seq,
                missing: vec![]
            }]
        );
        let mut new = Parent::new(*started(1).config());
        assert_eq!(
            new.inspect(Time(0)).unwrap_err().code,
            ErrorCode::LIFECYCLE_INVALID
        );
    }
}
