//! Operations after start: register and unregister (scopes, probes,
//! broadcast, cleanup, publication), task submission, the targets'
//! replies, staging failures, and how each operation completes.

use std::collections::{BTreeMap, BTreeSet};

use super::registry::poisoned_error;
use super::tasks::NONE_COMING;
use super::{
    Completion, Doubt, Effect, Handle, HandleRecord, Lifecycle, Op, OpKind, Parent, Poison,
    Progress, TargetPhase,
};
use crate::descriptor::Digest;
use crate::error::{Error, ErrorCode, OperationKind};
#[cfg(feature = "mutants")]
use crate::protocol::Mutant;
use crate::protocol::{ControlFrame, Failure, Namespace, OpId, Reply, StagingId, TargetId, Time};

impl Parent {
    /// Begins a post-start register of the envelope whose digest is
    /// `digest`: emits [`Effect::Stage`], then a
    /// [`ControlFrame::Register`] (one fresh seq) to every live target,
    /// which form the operation's scope. The operation later completes with
    /// [`Effect::Completed`]; its handle is published only after every
    /// target in scope replied OK (invariant 1).
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless [`Lifecycle::Started`];
    /// `CALLABLE_KIND_UNSUPPORTED` for a namespace other than `LOCAL_PYTHON`;
    /// `REGISTER_CLEANUP_UNCERTAIN` for an uncertain digest (invariant 3);
    /// `NO_LIVE_TARGET` when every target is lost. Nothing is emitted then.
    ///
    /// ```
    /// use callreg::descriptor::Digest;
    /// use callreg::error::ErrorCode;
    /// use callreg::protocol::{
    ///     ControlPhase, Effect, Namespace, OwnerToken, Parent, ParentConfig, Seq, TargetId, Time,
    ///     SILENT_FENCE_CAUSE,
    /// };
    ///
    /// let config = ParentConfig {
    ///     targets: 2,
    ///     control_timeout: 1_000_000,
    ///     operation_timeout: 10_000_000,
    ///     fence_on_timeout: true,
    ///     owner: OwnerToken(1),
    ///     slot_capacity: 64,
    ///     probe_first: false,
    ///     respawn_limit: 0,
    ///     respawn_backoff: 0,
    ///     unbounded_spawn: false,
    ///     max_tasks_per_target: 0,
    /// };
    /// let mut parent = Parent::new(config);
    /// let digest = Digest::sha256(b"descriptor");
    /// // Not started yet: refused, nothing emitted.
    /// let refused = parent.register(digest, Namespace::LocalPython, Time(0)).unwrap_err();
    /// assert_eq!(refused.code, ErrorCode::LIFECYCLE_INVALID);
    /// assert_eq!(parent.poll_effect(), None);
    ///
    /// parent.start().unwrap();
    /// parent.register(digest, Namespace::LocalPython, Time(0)).unwrap();
    /// let effects: Vec<Effect> = std::iter::from_fn(|| parent.poll_effect()).collect();
    /// // Stage, then one register frame per live target.
    /// assert!(matches!(effects[0], Effect::Stage { .. }));
    /// let receivers: Vec<TargetId> = effects[1..]
    ///     .iter()
    ///     .map(|e| match e {
    ///         Effect::Send { target, .. } => *target,
    ///         other => panic!("{other:?}"),
    ///     })
    ///     .collect();
    /// assert_eq!(receivers, [TargetId(0), TargetId(1)]);
    /// // Its deadline is the control timeout after `now` (the targets'
    /// // silence deadline), its bound the operation timeout after it.
    /// assert_eq!(parent.poll_timeout(), Some(Time(1_000_000)));
    /// assert_eq!(parent.poll_bound(), Some(Time(10_000_000)));
    /// // Target 0 reports alive at 0.9 s: only target 1 is still due at 1 s.
    /// parent.handle_alive(TargetId(0), Seq(1), ControlPhase::Running, Time(900_000)).unwrap();
    /// parent.handle_timeout(Time(1_000_000));
    /// assert_eq!(
    ///     parent.poll_effect(),
    ///     Some(Effect::Fence { target: TargetId(1), cause: SILENT_FENCE_CAUSE.to_owned() })
    /// );
    /// assert_eq!(parent.poll_timeout(), Some(Time(1_900_000)));
    /// ```
    pub fn register(
        &mut self,
        digest: Digest,
        namespace: Namespace,
        now: Time,
    ) -> Result<OpId, Error> {
        self.register_with_metadata(digest, namespace, None, now)
    }

    /// [`Parent::register`] of a callable with metadata of identity
    /// `metadata` (a digest of its JSON; `None`: no metadata).
    ///
    /// # Errors
    /// As [`Parent::register`]; `METADATA_CONFLICT` when the digest is
    /// held (a live handle or a register in flight names it) with another
    /// metadata identity (§2.10); nothing is emitted then.
    pub fn register_with_metadata(
        &mut self,
        digest: Digest,
        namespace: Namespace,
        metadata: Option<Digest>,
        now: Time,
    ) -> Result<OpId, Error> {
        if self.lifecycle != Lifecycle::Started {
            return Err(self.lifecycle_error(OperationKind::Register, "started"));
        }
        Self::check_namespace(namespace, digest)?;
        self.check_metadata(digest, namespace, metadata)?;
        if let Some(poison) = self.poisoned.get(&digest) {
            if !mutant!(self, RetryPoisoned) {
                return Err(poisoned_error(digest, poison)
                    .with_namespace(namespace)
                    .with_digest(digest));
            }
        }
        if self.uncertain.contains_key(&digest) {
            return Err(Error::new(
                ErrorCode::REGISTER_CLEANUP_UNCERTAIN,
                OperationKind::Register,
                self.uncertainty(digest),
            )
            .with_namespace(namespace)
            .with_digest(digest));
        }
        let live: Vec<TargetId> = self.all_targets().filter(|t| self.serves(*t)).collect();
        // §2.8: a digest no target installed since start goes to one target
        // first (under the mutant, to every target at once all the same).
        let probe = (self.config.probe_first && !self.proven.contains(&digest))
            .then(|| live.first().copied())
            .flatten();
        let scope: BTreeMap<TargetId, Progress> = live
            .iter()
            .filter(|t| probe.is_none_or(|p| p == **t) || mutant!(self, BroadcastBeforeProbe))
            .map(|t| (*t, Progress::Pending))
            .collect();
        if scope.is_empty() {
            let replacing = self.all_targets().any(|t| {
                matches!(
                    self.target_phase(t),
                    TargetPhase::BackingOff(_) | TargetPhase::Spawning | TargetPhase::Joining
                )
            });
            let message = if replacing {
                "no target serves: every target is lost or a replacement that has not joined yet"
            } else {
                NONE_COMING
            };
            return Err(
                Error::new(ErrorCode::NO_LIVE_TARGET, OperationKind::Register, message)
                    .with_namespace(namespace)
                    .with_digest(digest),
            );
        }
        let seq = self.fresh_seq();
        let staging = StagingId(seq.0);
        self.staged.insert(staging);
        self.effects.push_back(Effect::Stage { staging, digest });
        for target in scope.keys() {
            self.effects.push_back(Effect::Send {
                target: *target,
                frame: ControlFrame::Register {
                    seq,
                    digest,
                    staging,
                },
            });
        }
        // §2.8: the targets the register waits to reach may verify its
        // payload while the probe installs it.
        for target in live.iter().filter(|t| !scope.contains_key(t)) {
            self.effects.push_back(Effect::Verify {
                target: *target,
                staging,
                digest,
            });
        }
        let op = Op {
            kind: OpKind::Register {
                probe,
                staging: Some(staging),
                cleanup: None,
            },
            digest,
            namespace,
            seq,
            deadline: now.saturating_add_micros(self.config.operation_timeout),
            heard: scope.keys().map(|t| (*t, now)).collect(),
            running: BTreeSet::new(),
            scope,
        };
        let id = OpId(seq.0);
        if !self.holds(digest) {
            self.hold_metadata(digest, metadata);
        }
        self.ops.insert(id, op);
        Ok(id)
    }

    /// Begins a post-start unregister: resolves `handle`, drops it from the
    /// registry at once (it is stale from now on), and sends a digest-owned
    /// [`ControlFrame::Unregister`] (one fresh seq) to every live target
    /// that confirmed it. Completes with [`Effect::Completed`]; with no such
    /// target it completes at once.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless [`Lifecycle::Started`]; otherwise the
    /// resolution errors of [`Parent::resolve`] (nothing changes then).
    pub fn unregister(&mut self, handle: &Handle, now: Time) -> Result<OpId, Error> {
        if self.lifecycle != Lifecycle::Started {
            return Err(self.lifecycle_error(OperationKind::Unregister, "started"));
        }
        let digest = self.resolve_for(handle, Namespace::LocalPython, OperationKind::Unregister)?;
        let Some(record) = self.handles.remove(&handle.handle_id) else {
            // resolve_for just found it; keep the error path rather than panic.
            return Err(self.stale(handle, OperationKind::Unregister));
        };
        debug_assert_eq!(record.digest, digest);
        Ok(self.begin_unregister(*handle, &record, now))
    }

    /// Sends the unregister of `handle` (out of the registry already) to
    /// the live targets that confirmed it, and tracks it as an operation.
    pub(super) fn begin_unregister(
        &mut self,
        handle: Handle,
        record: &HandleRecord,
        now: Time,
    ) -> OpId {
        let digest = record.digest;
        let seq = self.fresh_seq();
        // The live targets that confirmed it, and every joining replacement
        // its replay was sent to. A replay not yet answered sends this
        // unregister's frame once it is confirmed: before, the target may
        // still be installing the payload (§2.9).
        let mut deferred = BTreeSet::new();
        for op in self.ops.values_mut() {
            if let OpKind::Replay {
                handle_id,
                unregister,
                ..
            } = &mut op.kind
            {
                if *handle_id == handle.handle_id {
                    *unregister = Some(seq);
                    deferred.extend(op.scope.keys().copied());
                }
            }
        }
        let scope: BTreeMap<TargetId, Progress> = record
            .confirmed
            .iter()
            .chain(&deferred)
            .copied()
            .filter(|t| !self.lost.contains(t))
            .map(|t| (t, Progress::Pending))
            .collect();
        for target in scope.keys().filter(|t| !deferred.contains(t)) {
            self.effects.push_back(Effect::Send {
                target: *target,
                frame: ControlFrame::Unregister { seq, digest },
            });
        }
        let id = OpId(seq.0);
        self.ops.insert(
            id,
            Op {
                kind: OpKind::Unregister { handle },
                digest,
                namespace: record.namespace,
                seq,
                deadline: now.saturating_add_micros(self.config.operation_timeout),
                heard: scope.keys().map(|t| (*t, now)).collect(),
                running: BTreeSet::new(),
                scope,
            },
        );
        self.advance(id, now);
        id
    }

    /// The checks of a submit (§2.5, §2.11): the digest `handle` names,
    /// installed on `target`, which serves tasks.
    pub(crate) fn check_submit(&self, handle: &Handle, target: TargetId) -> Result<Digest, Error> {
        if self.lifecycle != Lifecycle::Started {
            return Err(self.lifecycle_error(OperationKind::Task, "started"));
        }
        let digest = self.resolve_for(handle, Namespace::LocalPython, OperationKind::Task)?;
        let error = |code, message: String| {
            Error::new(code, OperationKind::Task, message)
                .with_target(target)
                .with_namespace(handle.namespace)
                .with_digest(digest)
        };
        if target.0 >= self.config.targets {
            return Err(error(
                ErrorCode::NO_LIVE_TARGET,
                format!(
                    "there is no target {} (targets 0..{})",
                    target.0, self.config.targets
                ),
            ));
        }
        if self.lost.contains(&target) {
            return Err(error(ErrorCode::TARGET_LOST, format!("{target} is lost")));
        }
        if self.is_joining(target) {
            return Err(error(
                ErrorCode::TARGET_LOST,
                format!(
                    "{target} is a replacement (incarnation {}) that has not joined yet",
                    self.incarnation(target)
                ),
            ));
        }
        if self.is_retiring(target) {
            return Err(error(
                ErrorCode::TARGET_LOST,
                format!(
                    "{target} is retiring: it was sent its {} tasks (max_tasks_per_target) and is replaced once they end",
                    self.served(target)
                ),
            ));
        }
        let confirmed = self
            .handles
            .get(&handle.handle_id)
            .is_some_and(|r| r.confirmed.contains(&target));
        if !confirmed {
            return Err(error(
                ErrorCode::DIGEST_NOT_INSTALLED,
                format!("{target} never confirmed handle {}", handle.handle_id),
            ));
        }
        Ok(digest)
    }

    /// The checks every input about one target makes first: refused
    /// before start (`LIFECYCLE_INVALID`) and for a target out of range
    /// (`FRAME_INVALID`); `false` (ignore it) once closed.
    pub(crate) fn accepts_from(
        &self,
        target: TargetId,
        operation: OperationKind,
    ) -> Result<bool, Error> {
        match self.lifecycle {
            Lifecycle::New => Err(self.lifecycle_error(operation, "started")),
            Lifecycle::Closed => Ok(false),
            Lifecycle::Started => self.check_target(target, operation).map(|()| true),
        }
    }

    pub(super) fn check_target(
        &self,
        target: TargetId,
        operation: OperationKind,
    ) -> Result<(), Error> {
        if target.0 < self.config.targets {
            return Ok(());
        }
        Err(Error::new(
            ErrorCode::FRAME_INVALID,
            operation,
            format!(
                "there is no target {} (targets 0..{})",
                target.0, self.config.targets
            ),
        )
        .with_target(target))
    }

    /// A target's reply to a register, unregister or cleanup.
    ///
    /// A reply that answers nothing pending (a late answer after the
    /// target's deadline passed, or a duplicate) marks its digest uncertain,
    /// since the target's state is then unknown (specs/design.md §4.1). Replies
    /// from a lost target and replies after close are ignored, and so are
    /// replies from an earlier process of a replaced target (§2.9: a reply to
    /// a seq issued before the target's current process was started, which
    /// a transport may deliver after the loss): that process is gone, and
    /// its reply says nothing about the one serving now.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` before start; `FRAME_INVALID` for a target id
    /// out of range or a seq this parent never issued (nothing changes).
    pub fn handle_reply(&mut self, target: TargetId, reply: Reply, now: Time) -> Result<(), Error> {
        if !self.accepts_from(target, OperationKind::Reply)? {
            return Ok(());
        }
        if self.lost.contains(&target) {
            return Ok(());
        }
        if reply.seq.0 == 0 || reply.seq.0 >= self.next_seq {
            return Err(Error::new(
                ErrorCode::FRAME_INVALID,
                OperationKind::Reply,
                format!("reply for {} which this Worker never issued", reply.seq),
            )
            .with_target(target)
            .with_seq(reply.seq)
            .with_digest(reply.digest));
        }
        // A cancel awaiting its answer was sent to this process (a loss
        // drops them), whatever its seq: a task that waited (§2.14) is
        // sent after the replacement's first seq.
        if self.cancel_answered(target, &reply) {
            self.retire_idle(now);
            return Ok(());
        }
        if self
            .target_records
            .get(&target)
            .is_some_and(|r| reply.seq < r.first_seq)
        {
            return Ok(());
        }
        let found = self.ops.iter().find_map(|(id, op)| {
            let progress = op.scope.get(&target)?;
            let cleanup_seq = match op.kind {
                OpKind::Register {
                    cleanup: Some((seq, _)),
                    ..
                } => Some(seq),
                _ => None,
            };
            if op.seq == reply.seq && *progress == Progress::Pending {
                Some((*id, false))
            } else if cleanup_seq == Some(reply.seq) && *progress == Progress::CleanupPending {
                Some((*id, true))
            } else {
                None
            }
        });
        let Some((id, is_cleanup)) = found else {
            // Late or duplicate: the operation already gave up on this
            // target; a doubt may await it (§2.4, "Uncertainty heals").
            self.late_reply(target, &reply);
            return Ok(());
        };
        let Some(op) = self.ops.get_mut(&id) else {
            return Ok(());
        };
        let digest = op.digest;
        let is_unregister = matches!(op.kind, OpKind::Unregister { .. });
        let mut proven = false;
        let result = if reply.digest == digest {
            reply.result
        } else {
            Err(Failure::new(
                ErrorCode::FRAME_INVALID,
                format!(
                    "reply for {} names {} instead of {digest}",
                    reply.seq, reply.digest
                ),
            ))
        };
        let mut uncertain = reply.digest != digest;
        // A probe refused as poisoned by a target that is itself a registry
        // (a cluster's worker whose own probe lost a process, §2.8 "A
        // nested refusal") poisons the digest here too.
        let nested_poison = match (&op.kind, &result) {
            (
                OpKind::Register {
                    probe: Some(probe),
                    cleanup: None,
                    ..
                },
                Err(failure),
            ) if !is_cleanup
                && *probe == target
                && failure.code == ErrorCode::REGISTER_POISONED
                && !mutant!(self, IgnoreNestedPoison) =>
            {
                Some(failure.message.clone())
            }
            _ => None,
        };
        if let Some(progress) = op.scope.get_mut(&target) {
            *progress = match (is_cleanup, result) {
                (false, Ok(())) => {
                    // The target holds the digest now (an OK result here
                    // names the operation's digest): it deserialized it.
                    proven = !is_unregister;
                    Progress::Confirmed
                }
                (false, Err(failure)) => {
                    // An unregister the target refused means parent and
                    // target disagree on its refcount.
                    uncertain |= is_unregister;
                    Progress::Failed(failure)
                }
                (true, Ok(())) => Progress::RolledBack,
                (true, Err(failure)) => {
                    uncertain = true;
                    Progress::CleanupUnconfirmed(failure)
                }
            };
        }
        if uncertain {
            self.doubt(digest, target, Doubt::Disagrees);
        }
        // Poisoned is never proven (§2.8): a register of it still in
        // flight, confirmed after another one's probe was refused as
        // poisoned, is rolled back.
        if proven && !self.poisoned.contains_key(&digest) {
            self.proven.insert(digest);
        }
        if let Some(cause) = nested_poison {
            self.poisoned
                .entry(digest)
                .or_insert(Poison { target, cause });
        }
        self.advance(id, now);
        Ok(())
    }

    /// The IO layer could not stage the payload of [`Effect::Stage`]
    /// `staging`; call it before polling the next effect. Withdraws the
    /// register's queued frames (no target has seen them) and completes the
    /// operation with `failure` and no target outcome. Its queued
    /// [`Effect::Verify`] hints go too.
    ///
    /// # Errors
    /// `FRAME_INVALID` if no register waits for `staging` or some of its
    /// frames were already polled (nothing changes).
    pub fn stage_failed(&mut self, staging: StagingId, failure: Failure) -> Result<(), Error> {
        let id = OpId(staging.0);
        if let Some(op) = self.ops.get(&id) {
            if matches!(op.kind, OpKind::Replay { staging: Some(s), .. } if s == staging) {
                return self.replay_stage_failed(id, failure);
            }
        }
        let withdrawable = self.ops.get(&id).is_some_and(|op| {
            let queued = self
                .effects
                .iter()
                .filter(|e| matches!(e, Effect::Send { frame: ControlFrame::Register { seq, .. }, .. } if *seq == op.seq))
                .count();
            matches!(op.kind, OpKind::Register { staging: Some(s), cleanup: None, .. } if s == staging)
                && queued == op.scope.len()
        });
        if !withdrawable {
            return Err(Error::new(
                ErrorCode::FRAME_INVALID,
                OperationKind::Stage,
                format!(
                    "no register waits for staged payload {} with all its frames unsent",
                    staging.0
                ),
            ));
        }
        let Some(op) = self.ops.remove(&id) else {
            return Ok(());
        };
        self.effects.retain(|e| {
            !matches!(e, Effect::Send { frame: ControlFrame::Register { seq, .. }, .. } if *seq == op.seq)
                && !matches!(e, Effect::Verify { staging: s, .. } if *s == staging)
        });
        self.staged.remove(&staging);
        let error = Error::new(failure.code, OperationKind::Stage, failure.message)
            .with_namespace(op.namespace)
            .with_digest(op.digest)
            .with_seq(op.seq);
        self.effects.push_back(Effect::Completed {
            op: id,
            result: Err(error),
            outcomes: Vec::new(),
        });
        Ok(())
    }

    /// Moves operation `id` on after any change to it: releases its staged
    /// payload once every target in scope answered, then publishes, starts
    /// the cleanup, or completes.
    pub(super) fn advance(&mut self, id: OpId, now: Time) {
        self.advance_op(id, now);
        self.settle_joins();
        self.retire_idle(now);
    }

    fn advance_op(&mut self, id: OpId, now: Time) {
        let Some(op) = self.ops.get(&id) else { return };
        if let OpKind::Replay {
            handle_id,
            staging,
            unregister,
        } = op.kind
        {
            return self.advance_replay(id, handle_id, staging, unregister, now);
        }
        let answered = !op.scope.values().any(|p| *p == Progress::Pending);
        let any_answered = op.scope.values().any(|p| *p != Progress::Pending);
        let any_confirmed = op.scope.values().any(|p| *p == Progress::Confirmed);
        let all_confirmed = op.scope.values().all(|p| *p == Progress::Confirmed);
        let any_failed = op
            .scope
            .values()
            .any(|p| !matches!(p, Progress::Pending | Progress::Confirmed));
        let kind = op.kind.clone();
        let digest = op.digest;
        if let OpKind::Register {
            probe: Some(probe),
            cleanup: None,
            ..
        } = kind
        {
            // Confirmed: on to the others. Otherwise (refused, lost, fenced,
            // timed out, or confirmed for a digest uncertain or poisoned
            // meanwhile) the register fails as it is: the others never see
            // it.
            let confirmed = op.scope.get(&probe) == Some(&Progress::Confirmed);
            if confirmed
                && !self.uncertain.contains_key(&digest)
                && !self.poisoned.contains_key(&digest)
            {
                return self.broadcast(id, now);
            }
        }
        let release_now = answered || (mutant!(self, ReleaseStagedEarly) && any_answered);
        match kind {
            OpKind::Register {
                staging, cleanup, ..
            } => {
                if let (Some(staging), true) = (staging, release_now) {
                    self.release(id, staging);
                }
                match cleanup {
                    None => {
                        let early =
                            mutant!(self, PublishBeforeAllReplies) && any_confirmed && !any_failed;
                        if !answered && !early {
                            return;
                        }
                        if (all_confirmed || early)
                            && !self.uncertain.contains_key(&digest)
                            && !self.poisoned.contains_key(&digest)
                        {
                            self.publish(id, now);
                        } else {
                            self.start_cleanup(id, now);
                        }
                    }
                    Some(_) => {
                        if !op_waiting(self.ops.get(&id)) {
                            self.complete_register_failure(id);
                        }
                    }
                }
            }
            OpKind::Unregister { handle } => {
                if answered {
                    self.complete_unregister(id, handle);
                }
            } // Settled by `advance_replay`.
            OpKind::Replay { .. } => {}
        }
    }

    fn end_probe(&mut self, id: OpId) {
        if let Some(Op {
            kind: OpKind::Register { probe, .. },
            ..
        }) = self.ops.get_mut(&id)
        {
            *probe = None;
        }
    }

    /// The probe target confirmed (§2.8): the register goes to every other
    /// live target, with a fresh bound (each heard from now), then moves on
    /// as any register.
    fn broadcast(&mut self, id: OpId, now: Time) {
        self.end_probe(id);
        let live: Vec<TargetId> = self.all_targets().filter(|t| self.serves(*t)).collect();
        // A fresh phase: a fresh bound, every new target heard from now.
        let bound = now.saturating_add_micros(self.config.operation_timeout);
        let Some(op) = self.ops.get_mut(&id) else {
            return;
        };
        let OpKind::Register {
            staging: Some(staging),
            ..
        } = op.kind
        else {
            return;
        };
        op.deadline = bound;
        for target in live {
            if op.scope.contains_key(&target) {
                continue;
            }
            op.scope.insert(target, Progress::Pending);
            op.heard.insert(target, now);
            self.effects.push_back(Effect::Send {
                target,
                frame: ControlFrame::Register {
                    seq: op.seq,
                    digest: op.digest,
                    staging,
                },
            });
        }
        self.advance(id, now);
    }

    fn release(&mut self, id: OpId, staging: StagingId) {
        if let Some(Op {
            kind: OpKind::Register { staging: held, .. },
            ..
        }) = self.ops.get_mut(&id)
        {
            *held = None;
        }
        self.staged.remove(&staging);
        self.effects.push_back(Effect::ReleaseStaged { staging });
    }

    fn publish(&mut self, id: OpId, now: Time) {
        let Some(op) = self.ops.remove(&id) else {
            return;
        };
        if let OpKind::Register {
            staging: Some(staging),
            ..
        } = op.kind
        {
            self.staged.remove(&staging);
            self.effects.push_back(Effect::ReleaseStaged { staging });
        }
        let handle = self.issue_handle(op.digest, op.namespace);
        // A joining replacement is in no register's scope: a confirmation
        // for its target came from the process it replaced, which took the
        // install with it (§2.9; it gets the handle as a replay below).
        let confirmed = op
            .scope
            .iter()
            .filter(|(t, p)| **p == Progress::Confirmed && !self.is_joining(**t))
            .map(|(t, _)| *t)
            .collect();
        let record = HandleRecord {
            digest: op.digest,
            namespace: op.namespace,
            scope: op
                .scope
                .keys()
                .copied()
                .filter(|t| !self.is_joining(*t))
                .collect(),
            confirmed,
        };
        self.handles.insert(handle.handle_id, record);
        self.effects.push_back(Effect::Completed {
            op: id,
            result: Ok(Completion::Registered(handle)),
            outcomes: op.outcomes(),
        });
        // §2.9: a replacement joining now was not in the scope; it gets the
        // new registration as a replay.
        if !mutant!(self, SkipReplayOfPublished) {
            let joining: Vec<TargetId> = self
                .target_records
                .iter()
                .filter(|(_, r)| r.phase == TargetPhase::Joining)
                .map(|(t, _)| *t)
                .collect();
            for target in joining {
                self.begin_replay(target, handle.handle_id, now);
            }
        }
    }

    fn start_cleanup(&mut self, id: OpId, now: Time) {
        let seq = self.fresh_seq();
        let skip = mutant!(self, SkipCleanup);
        let unconfirmed_too = mutant!(self, CleanupUnconfirmedTargets);
        let deadline = now.saturating_add_micros(self.config.operation_timeout);
        // A target lost since it confirmed holds nothing any more, nor
        // does its replacement (§2.9).
        let lost: BTreeSet<TargetId> = self
            .lost
            .iter()
            .copied()
            .chain(self.all_targets().filter(|t| self.is_joining(*t)))
            .collect();
        let Some(op) = self.ops.get_mut(&id) else {
            return;
        };
        let digest = op.digest;
        let mut frames = Vec::new();
        for (target, progress) in op.scope.iter_mut() {
            let clean = match progress {
                // A target lost since it confirmed holds nothing any more.
                Progress::Confirmed if lost.contains(target) => {
                    *progress = Progress::RolledBack;
                    false
                }
                Progress::Confirmed => !skip,
                Progress::Failed(_) | Progress::TimedOut => {
                    unconfirmed_too && !lost.contains(target)
                }
                _ => false,
            };
            if clean {
                *progress = Progress::CleanupPending;
                op.heard.insert(*target, now);
                op.running.remove(target);
                frames.push(Effect::Send {
                    target: *target,
                    frame: ControlFrame::Unregister { seq, digest },
                });
            } else if *progress == Progress::Confirmed {
                // Only under SkipCleanup: the install is left in place.
                *progress = Progress::RolledBack;
            }
        }
        if let OpKind::Register { cleanup, .. } = &mut op.kind {
            *cleanup = Some((seq, deadline));
        }
        self.effects.extend(frames);
        self.advance(id, now);
    }

    fn complete_register_failure(&mut self, id: OpId) {
        let Some(op) = self.ops.remove(&id) else {
            return;
        };
        let uncertain = self.uncertain.contains_key(&op.digest);
        let confirmed_everywhere = op
            .scope
            .values()
            .all(|p| matches!(p, Progress::RolledBack | Progress::CleanupUnconfirmed(_)));
        let mut parts = Vec::new();
        for (target, progress) in &op.scope {
            let text = match progress {
                Progress::Failed(f) => format!("{target}: {f}"),
                Progress::Lost | Progress::Pending => format!("{target}: lost"),
                Progress::TimedOut => format!("{target}: no answer before the deadline"),
                Progress::Fenced => format!("{target}: fenced after its deadline"),
                Progress::RolledBack | Progress::CleanupPending => format!("{target}: rolled back"),
                Progress::CleanupUnconfirmed(f) => format!("{target}: cleanup not confirmed ({f})"),
                Progress::Confirmed => format!("{target}: confirmed"),
            };
            parts.push(text);
        }
        let (code, lead) = if let Some(poison) = self.poisoned.get(&op.digest) {
            (
                ErrorCode::REGISTER_POISONED,
                format!(
                    "installing it killed {} ({}), the target that tried it first; it is refused for the rest of this Worker's life",
                    poison.target, poison.cause
                ),
            )
        } else if confirmed_everywhere && uncertain {
            (
                ErrorCode::REGISTER_CLEANUP_UNCERTAIN,
                // The hashid is in the error's context; not repeated here.
                "the digest became uncertain while its register was in flight".to_owned(),
            )
        } else {
            (
                ErrorCode::REGISTER_PARTIAL_FAILURE,
                "register failed".to_owned(),
            )
        };
        let tail = if uncertain {
            "; the digest is uncertain".to_owned()
        } else {
            String::new()
        };
        let mut error = Error::new(
            code,
            OperationKind::Register,
            format!("{lead}: {}{tail}", parts.join("; ")),
        )
        .with_namespace(op.namespace)
        .with_digest(op.digest)
        .with_seq(op.seq);
        if let Some(poison) = self.poisoned.get(&op.digest) {
            error = error.with_target(poison.target);
        }
        self.effects.push_back(Effect::Completed {
            op: id,
            result: Err(error),
            outcomes: op.outcomes(),
        });
    }

    fn complete_unregister(&mut self, id: OpId, handle: Handle) {
        let Some(op) = self.ops.remove(&id) else {
            return;
        };
        let failures: Vec<String> = op
            .scope
            .iter()
            .filter_map(|(target, p)| match p {
                Progress::Failed(f) => Some(format!("{target}: {f}")),
                Progress::TimedOut => Some(format!("{target}: no answer before the deadline")),
                _ => None,
            })
            .collect();
        // A target lost while the unregister was pending there (its
        // process died, e.g. in a finalizer the release ran, or was fenced)
        // holds nothing, so the handle is released everywhere; the
        // unregister says so rather than succeed silently (§2.4, "Target
        // lost").
        let lost: Vec<String> = op
            .scope
            .iter()
            .filter_map(|(target, p)| match p {
                Progress::Lost => Some(format!("{target}: lost")),
                Progress::Fenced => Some(format!("{target}: fenced after its deadline")),
                _ => None,
            })
            .collect();
        let result = if failures.is_empty() && lost.is_empty() {
            Ok(Completion::Unregistered(handle))
        } else if failures.is_empty() {
            Err(Error::new(
                ErrorCode::TARGET_LOST,
                OperationKind::Unregister,
                format!(
                    "handle {} is released (a lost target holds nothing of it), but the unregister lost targets while it was pending there: {}",
                    handle.handle_id,
                    lost.join("; ")
                ),
            )
            .with_namespace(op.namespace)
            .with_digest(op.digest)
            .with_seq(op.seq))
        } else {
            Err(Error::new(
                ErrorCode::UNREGISTER_PARTIAL_FAILURE,
                OperationKind::Unregister,
                format!(
                    "unregister of handle {} failed at {}; {} is uncertain",
                    handle.handle_id,
                    failures.join("; "),
                    op.digest
                ),
            )
            .with_namespace(op.namespace)
            .with_digest(op.digest)
            .with_seq(op.seq))
        };
        self.effects.push_back(Effect::Completed {
            op: id,
            result,
            outcomes: op.outcomes(),
        });
    }
}

fn op_waiting(op: Option<&Op>) -> bool {
    op.is_some_and(Op::waiting)
}
