//! Deadlines (`specs/protocol.md` §2.7): [`Parent::handle_timeout`] and
//! [`Parent::handle_alive`], a silent or late target fenced (and what its
//! fencing proves about a probed digest, §2.8), and the bound
//! [`Parent::poll_bound`] reports.

use std::collections::BTreeSet;

use super::{Doubt, Effect, Lifecycle, Op, OpKind, Parent, Progress, TargetPhase};
use crate::error::{Error, ErrorCode, OperationKind};
#[cfg(feature = "mutants")]
use crate::protocol::Mutant;
use crate::protocol::{ControlPhase, Failure, OpId, Seq, TargetId, Time};

/// The cause [`Parent::handle_timeout`] gives a replacement it fences
/// because it did not report ready within the control timeout of its
/// [`Effect::Spawn`] (`specs/protocol.md` §2.9).
pub const NOT_READY_CAUSE: &str = "its replacement was not ready in time";

/// The cause of a target fenced for silence: no alive report for a whole
/// control timeout (§2.7); no evidence against a digest it probed (§2.8).
pub const SILENT_FENCE_CAUSE: &str = "it sent no alive report for a control timeout and was fenced";

/// The cause of a target fenced at an operation's bound while it still
/// reported alive (§2.7): evidence against a digest it probed if its last
/// report said that probe was running, none if it said queued (§2.8).
pub const BOUND_FENCE_CAUSE: &str = "it did not answer before the operation's bound and was fenced";

impl Parent {
    /// Whether some control pending at `target` has had no alive report
    /// from it for a whole control timeout at `now`: its silence deadline,
    /// not an operation's bound, has passed.
    fn is_silent(&self, target: TargetId, now: Time) -> bool {
        let control_timeout = self.config.control_timeout;
        self.ops.values().any(|op| {
            matches!(
                op.scope.get(&target),
                Some(Progress::Pending | Progress::CleanupPending)
            ) && op
                .heard
                .get(&target)
                .copied()
                .unwrap_or(Time(0))
                .saturating_add_micros(control_timeout)
                <= now
        })
    }

    /// Applies every deadline at or before `now` (`specs/protocol.md`,
    /// "Deadlines"). A target's deadline for an operation waiting for it
    /// is the earlier of its silence deadline (when it was last heard from
    /// about the control, plus `control_timeout`) and the phase's bound
    /// (send plus `operation_timeout`). A target whose deadline passed is,
    /// with `fence_on_timeout`, fenced ([`Effect::Fence`], then lost
    /// everywhere); without, it is timed out for that operation and the
    /// operation's digest becomes uncertain (its effect on the target is
    /// unknown). A retiring target idle then is retired (§2.14). Does
    /// nothing before start or after close.
    pub fn handle_timeout(&mut self, now: Time) {
        if self.lifecycle != Lifecycle::Started {
            return;
        }
        self.apply_deadlines(now);
        self.retire_idle(now);
    }

    fn apply_deadlines(&mut self, now: Time) {
        let due: Vec<TargetId> = self
            .target_records
            .iter()
            .filter(|(_, r)| matches!(r.phase, TargetPhase::BackingOff(until) if until <= now))
            .map(|(t, _)| *t)
            .collect();
        for target in due {
            self.spawn(target, now);
        }
        // A replacement asked for and not ready within the control timeout
        // (§2.9: the template is stopped or gone, the process hangs before
        // its ready report) is fenced: lost before it joined. Arrivals
        // (`unbounded_spawn`) have no such deadline.
        let unready: Vec<TargetId> = self
            .target_records
            .iter()
            .filter(|(_, r)| {
                r.phase == TargetPhase::Spawning
                    && r.ready_by <= now
                    && !self.config.unbounded_spawn
            })
            .map(|(t, _)| *t)
            .collect();
        for target in unready {
            self.effects.push_back(Effect::Fence {
                target,
                cause: NOT_READY_CAUSE.to_owned(),
            });
            self.lose(target, Progress::Fenced, NOT_READY_CAUSE, now, false);
        }
        self.expire_inspections(now);
        // Task deadlines fence whatever `fence_on_timeout` says (§2.12);
        // a deadline is no evidence against a probed digest (§2.8).
        for (target, cause) in self.expire_tasks(now) {
            if !self.lost.contains(&target) {
                self.effects.push_back(Effect::Fence {
                    target,
                    cause: cause.clone(),
                });
                self.lose(target, Progress::Fenced, &cause, now, false);
            }
        }
        let control_timeout = self.config.control_timeout;
        let expired: Vec<(OpId, TargetId)> = self
            .ops
            .iter()
            .flat_map(|(id, op)| {
                op.deadlines(control_timeout)
                    .filter(|(_, deadline)| *deadline <= now)
                    .map(|(t, _)| (*id, t))
                    .collect::<Vec<_>>()
            })
            .collect();
        if self.config.fence_on_timeout {
            let silent: BTreeSet<TargetId> = expired.iter().map(|(_, t)| *t).collect();
            for target in silent {
                if self.is_joining(target) {
                    self.fence_joining(target, now);
                    continue;
                }
                // Silence (no alive report for a control timeout: stopped,
                // stalled, unreachable) is no evidence against what it
                // probed; passing the operation bound while it reported
                // alive is, if its last report said the probe was running
                // (its install had begun), and not if it said queued
                // (behind a task that holds the interpreter, say) (§2.8).
                let silent = self.is_silent(target, now);
                let cause = if silent {
                    SILENT_FENCE_CAUSE
                } else {
                    BOUND_FENCE_CAUSE
                };
                self.effects.push_back(Effect::Fence {
                    target,
                    cause: cause.to_owned(),
                });
                let running = self
                    .probe_at(target)
                    .is_some_and(|op| op.running.contains(&target))
                    || mutant!(self, PoisonQueued);
                let evidence = (!silent && running) || mutant!(self, PoisonSilence);
                self.lose(target, Progress::Fenced, cause, now, evidence);
            }
            return;
        }
        // A joining replacement serves nobody: fenced whatever the setting.
        let joining: BTreeSet<TargetId> = expired
            .iter()
            .map(|(_, t)| *t)
            .filter(|t| self.is_joining(*t))
            .collect();
        for target in &joining {
            self.fence_joining(*target, now);
        }
        let mut touched = BTreeSet::new();
        for (id, target) in expired {
            if joining.contains(&target) {
                continue;
            }
            let Some(op) = self.ops.get_mut(&id) else {
                continue;
            };
            let digest = op.digest;
            // What would settle the doubt: the target's late answer to the
            // control it owes (§2.4, "Uncertainty heals").
            let doubt = match (op.scope.get_mut(&target), &op.kind) {
                (Some(progress @ Progress::Pending), OpKind::Register { .. }) => {
                    *progress = Progress::TimedOut;
                    Doubt::Register(op.seq)
                }
                (Some(progress @ Progress::Pending), _) => {
                    *progress = Progress::TimedOut;
                    Doubt::Unregister(op.seq)
                }
                (
                    Some(progress @ Progress::CleanupPending),
                    OpKind::Register {
                        cleanup: Some((seq, _)),
                        ..
                    },
                ) => {
                    let seq = *seq;
                    *progress = Progress::CleanupUnconfirmed(Failure::new(
                        ErrorCode::DEADLINE_EXCEEDED,
                        "no answer to the cleanup before its deadline",
                    ));
                    Doubt::Unregister(seq)
                }
                _ => Doubt::Disagrees,
            };
            self.doubt(digest, target, doubt);
            touched.insert(id);
        }
        for id in touched {
            self.advance(id, now);
        }
    }

    /// `target` says it is alive and still busy with control `seq` (it
    /// received it, and it is queued or running there, as `phase` says):
    /// the silence deadline of the operation waiting for that answer moves
    /// to `now` plus `control_timeout`; the operation's bound does not
    /// move (`specs/protocol.md` §2.7). The phase is recorded: the latest
    /// report decides whether a fence of a probe at its bound is evidence
    /// against its digest (§2.8). An alive report for a control no
    /// operation awaits from `target` (it raced the reply, or came after
    /// the target's deadline passed) changes nothing: it says nothing about
    /// what the target holds. Ignored from a lost target and after close.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` before start; `FRAME_INVALID` for a target id
    /// out of range or a seq this parent never issued (nothing changes).
    pub fn handle_alive(
        &mut self,
        target: TargetId,
        seq: Seq,
        phase: ControlPhase,
        now: Time,
    ) -> Result<(), Error> {
        if !self.accepts_from(target, OperationKind::Reply)? {
            return Ok(());
        }
        if self.lost.contains(&target) {
            return Ok(());
        }
        if seq.0 == 0 || seq.0 >= self.next_seq {
            return Err(Error::new(
                ErrorCode::FRAME_INVALID,
                OperationKind::Reply,
                format!("alive report for {seq} which this Worker never issued"),
            )
            .with_target(target)
            .with_seq(seq));
        }
        if mutant!(self, IgnoreAlive) {
            return Ok(());
        }
        if self.cancel_alive(target, seq, now) {
            return Ok(());
        }
        for op in self.ops.values_mut() {
            let awaited = match op.scope.get(&target) {
                Some(Progress::Pending) => op.seq == seq,
                Some(Progress::CleanupPending) => matches!(
                    op.kind,
                    OpKind::Register { cleanup: Some((cleanup, _)), .. } if cleanup == seq
                ),
                _ => false,
            };
            if awaited {
                let heard = op.heard.entry(target).or_insert(now);
                *heard = (*heard).max(now);
                match phase {
                    ControlPhase::Running => op.running.insert(target),
                    ControlPhase::Queued => op.running.remove(&target),
                };
            }
        }
        Ok(())
    }

    /// The earliest operation bound among targets some operation still
    /// waits for (send time plus `operation_timeout`), if any: the latest a
    /// target that keeps reporting alive can go unanswered.
    pub fn poll_bound(&self) -> Option<Time> {
        self.ops
            .values()
            .filter(|op| op.waiting())
            .map(Op::phase_bound)
            .min()
    }
}
