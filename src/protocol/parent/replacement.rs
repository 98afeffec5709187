//! Target loss and replacement (`specs/protocol.md` §2.9): a target lost
//! or dead, its operations' scopes settled, a replacement spawned, its
//! join by replaying every live registration, and a failed join fenced.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

#[cfg(doc)]
use super::ParentConfig;
use super::{Effect, Lifecycle, Op, OpKind, Parent, Poison, Progress, TargetPhase, TargetRecord};
use crate::descriptor::Digest;
use crate::error::{Error, ErrorCode, OperationKind};
#[cfg(feature = "mutants")]
use crate::protocol::Mutant;
use crate::protocol::{ControlFrame, Failure, OpId, Seq, StagingId, TargetId, Time};

impl Parent {
    /// `target` died (or was closed by the IO layer): it holds nothing, it
    /// leaves the scope of later operations, and every operation waiting
    /// for it counts it lost (a register fails; nothing becomes uncertain).
    /// Idempotent; ignored after close.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` before start; `FRAME_INVALID` for a target id out
    /// of range.
    pub fn target_lost(&mut self, target: TargetId, now: Time) -> Result<(), Error> {
        self.target_died(target, "it was lost", now)
    }

    /// [`Parent::target_lost`], saying how the target died (`cause`, e.g.
    /// `its reply socket closed; it was killed by signal 11`): if it was lost
    /// while deserializing a digest it probed (§2.8), that digest is
    /// poisoned and `cause` is named in every `REGISTER_POISONED` about it.
    ///
    /// # Errors
    /// As [`Parent::target_lost`].
    pub fn target_died(&mut self, target: TargetId, cause: &str, now: Time) -> Result<(), Error> {
        if !self.accepts_from(target, OperationKind::Reply)? {
            return Ok(());
        }
        self.lose(target, Progress::Lost, cause, now, true);
        Ok(())
    }

    /// [`Parent::target_died`] for a target that left rather than died
    /// of what it was doing (`specs/protocol.md` §2.8, "A departure"): a
    /// cluster's worker that leaves or is killed, whose callables run in
    /// processes of its own (a poison costs one of those, never the worker
    /// itself). The loss is no evidence against a digest it was probing:
    /// nothing is poisoned, and a later register probes again.
    ///
    /// # Errors
    /// As [`Parent::target_lost`].
    pub fn target_left(&mut self, target: TargetId, cause: &str, now: Time) -> Result<(), Error> {
        if !self.accepts_from(target, OperationKind::Reply)? {
            return Ok(());
        }
        self.lose(target, Progress::Lost, cause, now, false);
        Ok(())
    }

    /// The digest `target` was deserializing for a probe, if any (§2.8):
    /// the probe of a digest not yet proven is the oldest control still
    /// pending at that target (controls are applied in the order sent, and
    /// a probe is sent when issued, so no control pending there was sent
    /// before it).
    fn probing_at(&self, target: TargetId) -> Option<Digest> {
        self.probe_at(target).map(|op| op.digest)
    }

    /// The operation whose probe `target` owes: the oldest control pending
    /// there, if it is the probe of a digest not proven (as
    /// [`Parent::probing_at`]).
    pub(super) fn probe_at(&self, target: TargetId) -> Option<&Op> {
        let pending = |op: &Op| match (op.scope.get(&target), &op.kind) {
            (Some(Progress::Pending), _) => Some(op.seq),
            (
                Some(Progress::CleanupPending),
                OpKind::Register {
                    cleanup: Some((seq, _)),
                    ..
                },
            ) => Some(*seq),
            _ => None,
        };
        let oldest = self
            .ops
            .values()
            .filter_map(|op| pending(op).map(|seq| (seq, op)))
            .min_by_key(|(seq, _)| *seq)?
            .1;
        match oldest.kind {
            OpKind::Register {
                probe: Some(probe),
                cleanup: None,
                ..
            } if probe == target && !self.proven.contains(&oldest.digest) => Some(oldest),
            _ => None,
        }
    }

    /// `target` is lost (`as_progress`: `Lost` or `Fenced`), `cause` saying
    /// how. `evidence`: whether the loss counts against the digest it was
    /// probing, if any (§2.8: a death, or a bound passed while it reported
    /// alive; never silence), which is then poisoned.
    pub(super) fn lose(
        &mut self,
        target: TargetId,
        as_progress: Progress,
        cause: &str,
        now: Time,
        evidence: bool,
    ) {
        if self.lost.contains(&target) {
            // A replacement that could not be started is one lost before
            // it joined.
            if self.target_phase(target) == TargetPhase::Spawning {
                self.after_loss(target, now);
            }
            return;
        }
        if let Some(digest) = self.probing_at(target).filter(|_| evidence) {
            self.poisoned.entry(digest).or_insert_with(|| Poison {
                target,
                cause: cause.to_owned(),
            });
        }
        self.lost.insert(target);
        // A lost target holds nothing: no doubt about it is left (§2.4).
        self.settle_doubts_of(target);
        // Frames queued for it by this same input are withdrawn (§2.9):
        // they would reach a process being fenced, or none.
        self.effects
            .retain(|e| !matches!(e, Effect::Send { target: t, .. } if *t == target));
        self.tasks_lost(target, cause);
        self.inspections_lost(target);
        let mut touched = Vec::new();
        for (id, op) in self.ops.iter_mut() {
            if let Some(progress) = op.scope.get_mut(&target) {
                match progress {
                    Progress::Pending => *progress = as_progress.clone(),
                    Progress::CleanupPending => *progress = Progress::RolledBack,
                    _ => continue,
                }
                touched.push(*id);
            }
        }
        for id in touched {
            self.advance(id, now);
        }
        self.after_loss(target, now);
        // Lost for good: what waited for it goes elsewhere (§2.14).
        self.settle_waiting(cause);
    }

    /// After `target`'s process was lost (§2.9): with replacements on, ask
    /// for the next one at once (the lost process had joined), after the
    /// back-off (it had not), or give the target up (the rate limit).
    fn after_loss(&mut self, target: TargetId, now: Time) {
        let limit = self.config.respawn_limit;
        if limit == 0 || self.lifecycle != Lifecycle::Started {
            return;
        }
        let record = self.target_records.entry(target).or_insert(TargetRecord {
            incarnation: 0,
            failed_joins: 0,
            phase: TargetPhase::Joined,
            ready_by: Time(0),
            first_seq: Seq(0),
        });
        record.failed_joins = match record.phase {
            TargetPhase::Joined => 0,
            _ => record.failed_joins.saturating_add(1),
        };
        let failed_joins = record.failed_joins;
        // At the rate limit, or with no template left to start another.
        if failed_joins >= limit || self.replacements_ended {
            record.phase = TargetPhase::Lost;
            self.effects.push_back(Effect::Abandoned {
                target,
                failed_joins,
            });
            return;
        }
        let delay = match failed_joins {
            0 => 0,
            n => self
                .config
                .respawn_backoff
                .saturating_mul(1u64 << u32::from(n - 1).min(32)),
        };
        if delay == 0 {
            self.spawn(target, now);
        } else {
            record.phase = TargetPhase::BackingOff(now.saturating_add_micros(delay));
        }
    }

    /// No replacement can be started any more: the template process that
    /// forks them is gone (§2.9). Every target backing off is abandoned at
    /// once ([`Effect::Abandoned`]), and so is every target lost from now on,
    /// without a [`Effect::Spawn`]; a target whose replacement is being
    /// spawned or joins meets its own end (a failed spawn, a loss, or the
    /// join). Idempotent; ignored unless started with replacements on.
    pub fn replacements_ended(&mut self) {
        if self.config.respawn_limit == 0
            || self.lifecycle != Lifecycle::Started
            || self.replacements_ended
        {
            return;
        }
        self.replacements_ended = true;
        for (target, record) in self.target_records.iter_mut() {
            if matches!(record.phase, TargetPhase::BackingOff(_)) {
                record.phase = TargetPhase::Lost;
                self.effects.push_back(Effect::Abandoned {
                    target: *target,
                    failed_joins: record.failed_joins,
                });
            }
        }
        // Retirement ends with replacements (§2.14): retiring targets
        // take tasks again, and what waited for a target given up goes
        // elsewhere.
        self.settle_waiting("every target is lost, and no replacement can start");
    }

    pub(super) fn spawn(&mut self, target: TargetId, now: Time) {
        let control_timeout = self.config.control_timeout;
        let Some(record) = self.target_records.get_mut(&target) else {
            return;
        };
        record.incarnation = record.incarnation.saturating_add(1);
        record.phase = TargetPhase::Spawning;
        self.served.remove(&target);
        record.ready_by = now.saturating_add_micros(control_timeout);
        self.effects.push_back(Effect::Spawn {
            target,
            incarnation: record.incarnation,
        });
    }

    /// The process asked for by [`Effect::Spawn`] for `target` runs
    /// and holds nothing (§2.9): it is `incarnation` of the target, and it
    /// joins. Every live handle (uncertain digests' too) is replayed
    /// to it, in handle order ([`Effect::Restage`], then a
    /// [`ControlFrame::Register`] to it alone), and so is every handle
    /// published while it joins. It serves tasks ([`Effect::Joined`]) once
    /// every replay sent to it is confirmed and no register is in flight
    /// (a register in flight does not include it, and is replayed to it if
    /// published; a confirmation the target's earlier process gave it counts
    /// for nothing). Until then it is in the scope of nothing else but the
    /// unregisters of handles replayed to it (whose frame to it waits for
    /// that replay's confirmation: until then it may still be installing
    /// the payload), and refused for tasks. A
    /// replay it refuses or does not answer in time fences it
    /// ([`Effect::JoinFailed`], [`Effect::Fence`]), with or without
    /// [`ParentConfig::fence_on_timeout`]: a joining process serves nobody.
    /// Ignored after close.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` before start; `FRAME_INVALID` for a target out
    /// of range, or a target that is not waiting for incarnation
    /// `incarnation` (nothing changes).
    pub fn target_spawned(
        &mut self,
        target: TargetId,
        incarnation: u32,
        now: Time,
    ) -> Result<(), Error> {
        if !self.accepts_from(target, OperationKind::Start)? {
            return Ok(());
        }
        let waiting = self
            .target_records
            .get(&target)
            .is_some_and(|r| r.phase == TargetPhase::Spawning && r.incarnation == incarnation);
        if !waiting {
            return Err(Error::new(
                ErrorCode::FRAME_INVALID,
                OperationKind::Start,
                format!("{target} is not waiting for incarnation {incarnation}"),
            )
            .with_target(target));
        }
        self.lost.remove(&target);
        let first_seq = Seq(self.next_seq);
        if let Some(record) = self.target_records.get_mut(&target) {
            record.phase = TargetPhase::Joining;
            record.first_seq = first_seq;
        }
        // What the target's earlier processes confirmed died with them.
        for record in self.handles.values_mut() {
            record.scope.remove(&target);
            record.confirmed.remove(&target);
        }
        // Every live handle, of uncertain digests too: a fresh process
        // holds exactly what it is replayed, and an uncertain digest may
        // heal (§2.4) while this target serves.
        let replayed: Vec<u64> = self.handles.keys().copied().collect();
        for handle_id in replayed {
            self.begin_replay(target, handle_id, now);
        }
        self.settle_joins();
        Ok(())
    }

    /// Sends the replay of live handle `handle_id` to joining `target`.
    pub(super) fn begin_replay(&mut self, target: TargetId, handle_id: u64, now: Time) {
        let Some(record) = self.handles.get(&handle_id) else {
            return;
        };
        let (digest, namespace) = (record.digest, record.namespace);
        let seq = self.fresh_seq();
        let staging = StagingId(seq.0);
        self.staged.insert(staging);
        self.effects.push_back(Effect::Restage { staging, digest });
        self.effects.push_back(Effect::Send {
            target,
            frame: ControlFrame::Register {
                seq,
                digest,
                staging,
            },
        });
        self.ops.insert(
            OpId(seq.0),
            Op {
                kind: OpKind::Replay {
                    handle_id,
                    staging: Some(staging),
                    unregister: None,
                },
                digest,
                namespace,
                seq,
                deadline: now.saturating_add_micros(self.config.operation_timeout),
                heard: BTreeMap::from([(target, now)]),
                running: BTreeSet::new(),
                scope: BTreeMap::from([(target, Progress::Pending)]),
            },
        );
    }

    /// Every joining replacement whose replays are all confirmed, while no
    /// register is in flight, joins (§2.9).
    pub(super) fn settle_joins(&mut self) {
        let early = mutant!(self, JoinBeforeReplay);
        let registering = self
            .ops
            .values()
            .any(|op| matches!(op.kind, OpKind::Register { cleanup: None, .. }));
        let joining: Vec<TargetId> = self
            .target_records
            .iter()
            // A joining target being lost is still marked joining until
            // `lose` has settled its operations.
            .filter(|(t, r)| r.phase == TargetPhase::Joining && !self.lost.contains(t))
            .map(|(t, _)| *t)
            .collect();
        for target in joining {
            let replaying = self.ops.values().any(|op| {
                matches!(op.kind, OpKind::Replay { .. }) && op.scope.contains_key(&target)
            });
            if (replaying || registering) && !early {
                continue;
            }
            if let Some(record) = self.target_records.get_mut(&target) {
                record.phase = TargetPhase::Joined;
                record.failed_joins = 0;
                self.effects.push_back(Effect::Joined {
                    target,
                    incarnation: record.incarnation,
                });
            }
        }
        // What waited may go to a target that joined (§2.14).
        self.settle_waiting(super::tasks::NONE_COMING);
    }

    /// A joining replacement refused a replay or did not answer it in
    /// time: it is reported and fenced (then replaced under the limit).
    fn fail_join(&mut self, target: TargetId, failure: Failure, now: Time) {
        if self.lost.contains(&target) {
            return;
        }
        let cause = format!("it failed a replayed registration ({failure})");
        self.effects.push_back(Effect::JoinFailed {
            target,
            incarnation: self.incarnation(target),
            failure,
        });
        self.effects.push_back(Effect::Fence {
            target,
            cause: cause.clone(),
        });
        self.lose(target, Progress::Fenced, &cause, now, true);
    }

    pub(super) fn fence_joining(&mut self, target: TargetId, now: Time) {
        self.fail_join(
            target,
            Failure::new(
                ErrorCode::DEADLINE_EXCEEDED,
                "no answer before its deadline while it joined",
            ),
            now,
        );
    }

    /// [`Parent::stage_failed`] for a replay's [`Effect::Restage`]: the
    /// replay's frame is withdrawn and the join fails (§2.9).
    pub(super) fn replay_stage_failed(&mut self, id: OpId, failure: Failure) -> Result<(), Error> {
        let queued = |effects: &VecDeque<Effect>, seq: Seq| {
            effects.iter().any(|e| matches!(e, Effect::Send { frame: ControlFrame::Register { seq: s, .. }, .. } if *s == seq))
        };
        let Some(op) = self.ops.get(&id) else {
            return Ok(());
        };
        if !queued(&self.effects, op.seq) {
            return Err(Error::new(
                ErrorCode::FRAME_INVALID,
                OperationKind::Stage,
                format!("the replay staged as {} was already sent", id.0),
            ));
        }
        let Some((target, sent)) = op.heard.iter().next().map(|(t, h)| (*t, *h)) else {
            return Ok(());
        };
        self.ops.remove(&id);
        self.staged.remove(&StagingId(id.0));
        // Staging is carried out while the input that sent the replay is
        // drained, so its send time is the time now. The failed join loses
        // the target, which withdraws the replay's frame with every other
        // frame queued for it.
        self.fail_join(target, failure, sent);
        self.settle_joins();
        Ok(())
    }

    /// A replay (§2.9) settles at its one target's answer or loss.
    pub(super) fn advance_replay(
        &mut self,
        id: OpId,
        handle_id: u64,
        staging: Option<StagingId>,
        unregister: Option<Seq>,
        now: Time,
    ) {
        let digest = self.ops.get(&id).map(|op| op.digest);
        let Some((target, progress)) = self
            .ops
            .get(&id)
            .and_then(|op| op.scope.iter().next())
            .map(|(t, p)| (*t, p.clone()))
        else {
            return;
        };
        if progress == Progress::Pending {
            return;
        }
        self.ops.remove(&id);
        if let Some(staging) = staging {
            self.staged.remove(&staging);
            self.effects.push_back(Effect::ReleaseStaged { staging });
        }
        match progress {
            Progress::Confirmed => {
                if let Some(record) = self.handles.get_mut(&handle_id) {
                    record.confirmed.insert(target);
                }
                // The unregister that waited for this replay (the handle
                // is no longer live): its frame goes now, its deadline
                // counts from now.
                if let (Some(seq), Some(digest)) = (unregister, digest) {
                    if let Some(op) = self.ops.get_mut(&OpId(seq.0)) {
                        if op.scope.get(&target) == Some(&Progress::Pending) {
                            op.heard.insert(target, now);
                            self.effects.push_back(Effect::Send {
                                target,
                                frame: ControlFrame::Unregister { seq, digest },
                            });
                        }
                    }
                }
            }
            Progress::Failed(failure) => self.fail_join(target, failure, now),
            // Lost or fenced: already out; nothing else applies to a replay.
            _ => {}
        }
    }
}
