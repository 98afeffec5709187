//! The registry: registrations before start, the startup snapshot and its
//! failures, handles and their resolution, and what the machine holds about
//! digests (poisoned, forgiven, uncertain, proven, their metadata).

use std::collections::{BTreeMap, BTreeSet};

#[cfg(doc)]
use super::ParentConfig;
use super::{
    Doubt, Effect, FailedRegistration, Handle, HandleRecord, Lifecycle, OpKind, Parent, Poison,
    Progress,
};
use crate::descriptor::Digest;
use crate::error::{Error, ErrorCode, OperationKind};
use crate::metadata::CallableMetadata;
use crate::protocol::ControlFrame;
#[cfg(feature = "mutants")]
use crate::protocol::Mutant;
use crate::protocol::{Failure, Namespace, Reply, Seq, TargetId, Time};

impl Parent {
    /// Registers a callable before start: adds a handle to the registry and
    /// one reference to `digest` in the startup snapshot. No effect.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless [`Lifecycle::New`];
    /// `CALLABLE_KIND_UNSUPPORTED` for a namespace other than `LOCAL_PYTHON`;
    /// `LOCAL_SLOT_EXHAUSTED` for a digest not yet in the snapshot when it
    /// already holds [`ParentConfig::slot_capacity`] distinct digests (every
    /// target would refuse the snapshot at start).
    pub fn register_before_start(
        &mut self,
        digest: Digest,
        namespace: Namespace,
    ) -> Result<Handle, Error> {
        self.register_before_start_with_metadata(digest, namespace, None)
    }

    /// [`Parent::register_before_start`] of a callable with metadata of
    /// identity `metadata` (a digest of its JSON; `None`: no metadata).
    ///
    /// # Errors
    /// As [`Parent::register_before_start`]; `METADATA_CONFLICT` when the
    /// digest is held with another metadata identity (§2.10).
    pub fn register_before_start_with_metadata(
        &mut self,
        digest: Digest,
        namespace: Namespace,
        metadata: Option<Digest>,
    ) -> Result<Handle, Error> {
        if self.lifecycle != Lifecycle::New {
            return Err(self.lifecycle_error(OperationKind::Register, "new (not started)"));
        }
        Self::check_namespace(namespace, digest)?;
        self.check_metadata(digest, namespace, metadata)?;
        let distinct: BTreeSet<Digest> = self.handles.values().map(|r| r.digest).collect();
        if !distinct.contains(&digest) && distinct.len() >= usize::from(self.config.slot_capacity) {
            return Err(Error::new(
                ErrorCode::LOCAL_SLOT_EXHAUSTED,
                OperationKind::Register,
                format!(
                    "the startup snapshot already holds as many distinct callables as a target has slots ({})",
                    self.config.slot_capacity
                ),
            )
            .with_namespace(namespace)
            .with_digest(digest));
        }
        let handle = self.issue_handle(digest, namespace);
        let record = HandleRecord {
            digest,
            namespace,
            scope: BTreeSet::new(),
            confirmed: BTreeSet::new(),
        };
        self.handles.insert(handle.handle_id, record);
        self.hold_metadata(digest, metadata);
        Ok(handle)
    }

    /// Whether `digest` is held: a live handle or a register in flight
    /// names it (§2.10).
    pub(super) fn holds(&self, digest: Digest) -> bool {
        self.handles.values().any(|r| r.digest == digest)
            || self
                .ops
                .values()
                .any(|op| op.digest == digest && matches!(op.kind, OpKind::Register { .. }))
    }

    /// The hook rule (`specs/protocol.md` §2.10): every hook `metadata`
    /// names (`call_before`, then `call_after`) must be a live handle in
    /// `LOCAL_PYTHON` when a register of `digest` with that metadata is
    /// given to the machine (a hook runs in the callable's namespace,
    /// resolved by digest in each target). Called by the IO layer in
    /// request order, right before `register_with_metadata` or
    /// `register_before_start_with_metadata`, so an unregister of a hook
    /// requested before the register has taken effect.
    ///
    /// # Errors
    /// `METADATA_INVALID` naming the first hook that is not live, by its
    /// list and position (`call_before[0]`), with `digest`.
    pub fn check_hooks(&self, digest: Digest, metadata: &CallableMetadata) -> Result<(), Error> {
        let lists = [
            ("call_before", &metadata.call_before),
            ("call_after", &metadata.call_after),
        ];
        for (list, hooks) in lists {
            for (position, hook) in hooks.iter().enumerate() {
                if !self.is_live(hook.hashid.0, Namespace::LocalPython) {
                    return Err(Error::new(
                        ErrorCode::METADATA_INVALID,
                        OperationKind::Register,
                        format!(
                            "{list}[{position}] names {}, which has no live registration in LOCAL_PYTHON (register it first)",
                            hook.hashid
                        ),
                    )
                    .with_namespace(Namespace::LocalPython)
                    .with_digest(digest));
                }
            }
        }
        Ok(())
    }

    /// `METADATA_CONFLICT` when `digest` is held with another metadata
    /// identity than `metadata` (§2.10).
    pub(super) fn check_metadata(
        &self,
        digest: Digest,
        namespace: Namespace,
        metadata: Option<Digest>,
    ) -> Result<(), Error> {
        if !self.holds(digest) {
            return Ok(());
        }
        let held = self.metadata.get(&digest).copied();
        if held == metadata {
            return Ok(());
        }
        let name = |m: Option<Digest>| match m {
            Some(m) => format!("metadata {}", crate::descriptor::HashId(m)),
            None => "no metadata".to_owned(),
        };
        Err(Error::new(
            ErrorCode::METADATA_CONFLICT,
            OperationKind::Register,
            format!(
                "{digest} is registered with {}; a register of it with {} is refused (one callable has one metadata while it is registered: unregister it first)",
                name(held),
                name(metadata)
            ),
        )
        .with_namespace(namespace)
        .with_digest(digest))
    }

    /// Records the metadata identity `digest` is held with.
    pub(super) fn hold_metadata(&mut self, digest: Digest, metadata: Option<Digest>) {
        match metadata {
            Some(m) => {
                self.metadata.insert(digest, m);
            }
            None => {
                self.metadata.remove(&digest);
            }
        }
    }

    /// Unregisters a handle before start: drops it from the registry and one
    /// reference from the startup snapshot. No effect.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless [`Lifecycle::New`]; otherwise the
    /// resolution errors of [`Parent::resolve`].
    pub fn unregister_before_start(&mut self, handle: &Handle) -> Result<(), Error> {
        if self.lifecycle != Lifecycle::New {
            return Err(self.lifecycle_error(OperationKind::Unregister, "new (not started)"));
        }
        self.resolve_for(handle, Namespace::LocalPython, OperationKind::Unregister)?;
        self.handles.remove(&handle.handle_id);
        Ok(())
    }

    /// The startup snapshot: every digest with a live handle and its number
    /// of live handles (the refcount a newly started target installs), in
    /// digest order. Before start this is exactly what the targets inherit.
    pub fn startup_snapshot(&self) -> Vec<(Digest, u32)> {
        let mut counts: BTreeMap<Digest, u32> = BTreeMap::new();
        for record in self.handles.values() {
            *counts.entry(record.digest).or_insert(0) += 1;
        }
        counts.into_iter().collect()
    }

    /// Starts: every target `0..targets` is live and holds the startup
    /// snapshot, so every pre-start handle counts as confirmed by all.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless [`Lifecycle::New`].
    pub fn start(&mut self) -> Result<(), Error> {
        if self.lifecycle != Lifecycle::New {
            return Err(self.lifecycle_error(OperationKind::Start, "new (not started)"));
        }
        self.lifecycle = Lifecycle::Started;
        let all: BTreeSet<TargetId> = self.all_targets().collect();
        for record in self.handles.values_mut() {
            record.scope = all.clone();
            record.confirmed = all.clone();
            // Every target installed the snapshot before it served.
            self.proven.insert(record.digest);
        }
        Ok(())
    }

    /// Settles the startup snapshot after [`Parent::start`], from the
    /// targets' readiness reports: each `(target, digest, failure)` says
    /// that `target` could not install snapshot entry `digest` (it failed
    /// to deserialize, or its version or dependency check refused it) and
    /// holds nothing of it. Every handle of a failed digest stops being
    /// live (its registration failed), and each is unregistered, as by
    /// [`Parent::unregister`], at the live targets that did install it:
    /// one [`ControlFrame::Unregister`] per handle (so a target's refcount
    /// of the digest goes to zero), under the usual deadlines, fencing and
    /// uncertainty rules; its [`Effect::Completed`] completes an operation
    /// no caller waits for. The other handles stay live; a target that
    /// failed an entry stays live. Call it once, right after start and
    /// before any other post-start input; with no failure it changes
    /// nothing.
    ///
    /// Returns the failed registrations, in handle order, each with the
    /// failures reported for it, in target order.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless [`Lifecycle::Started`] with no
    /// post-start operation or task issued yet; `FRAME_INVALID` for a target
    /// out of range or a digest that is not in the startup snapshot
    /// (nothing changes then).
    pub fn snapshot_failed(
        &mut self,
        failures: &[(TargetId, Digest, Failure)],
        now: Time,
    ) -> Result<Vec<FailedRegistration>, Error> {
        if failures.is_empty() {
            return Ok(Vec::new());
        }
        if self.lifecycle != Lifecycle::Started || self.next_seq != 1 {
            return Err(self.lifecycle_error(
                OperationKind::Start,
                "just started (no post-start operation yet)",
            ));
        }
        let mut by_digest: BTreeMap<Digest, BTreeMap<TargetId, Failure>> = BTreeMap::new();
        for (target, digest, failure) in failures {
            self.check_target(*target, OperationKind::Start)?;
            if !self.handles.values().any(|r| r.digest == *digest) {
                return Err(Error::new(
                    ErrorCode::FRAME_INVALID,
                    OperationKind::Start,
                    format!("{digest} is not in the startup snapshot"),
                )
                .with_target(*target)
                .with_digest(*digest));
            }
            by_digest
                .entry(*digest)
                .or_default()
                .entry(*target)
                .or_insert_with(|| failure.clone());
        }
        let mut failed = Vec::new();
        for (digest, reasons) in by_digest {
            let ids: Vec<u64> = self
                .handles
                .iter()
                .filter(|(_, r)| r.digest == digest)
                .map(|(id, _)| *id)
                .collect();
            for handle_id in ids {
                let Some(mut record) = self.handles.remove(&handle_id) else {
                    continue;
                };
                let handle = Handle {
                    namespace: record.namespace,
                    hashid: digest.hashid(),
                    handle_id,
                    owner: self.config.owner,
                };
                // Only the targets that installed the entry hold it.
                record.confirmed.retain(|t| !reasons.contains_key(t));
                self.begin_unregister(handle, &record, now);
                failed.push(FailedRegistration {
                    handle,
                    failures: reasons.iter().map(|(t, f)| (*t, f.clone())).collect(),
                });
            }
        }
        Ok(failed)
    }

    pub(super) fn stale(&self, handle: &Handle, operation: OperationKind) -> Error {
        Error::new(
            ErrorCode::HANDLE_STALE,
            operation,
            format!(
                "handle {} is no longer live (unregistered)",
                handle.handle_id
            ),
        )
        .with_namespace(handle.namespace)
        .with_digest(handle.digest())
    }

    /// Resolves a handle to its digest for use in `namespace`
    /// (specs/design.md §4.1, invariant 6). Checks in this order, each with its
    /// own error:
    ///
    /// # Errors
    /// * `LIFECYCLE_INVALID` once closed;
    /// * `HANDLE_FOREIGN`: another owner token, or a handle id this Worker
    ///   never issued (forged);
    /// * `HANDLE_STALE`: issued here but no longer live;
    /// * `HANDLE_MUTATED`: live, but its namespace or hashid differ from
    ///   what was issued;
    /// * `HANDLE_WRONG_NAMESPACE`: intact but of another namespace;
    /// * `REGISTER_CLEANUP_UNCERTAIN`: its digest is uncertain.
    pub fn resolve(&self, handle: &Handle, namespace: Namespace) -> Result<Digest, Error> {
        self.resolve_for(handle, namespace, OperationKind::Resolve)
    }

    pub(super) fn resolve_for(
        &self,
        handle: &Handle,
        namespace: Namespace,
        operation: OperationKind,
    ) -> Result<Digest, Error> {
        let digest = handle.digest();
        let error = |code, message: String| {
            Error::new(code, operation, message)
                .with_namespace(handle.namespace)
                .with_digest(digest)
        };
        if self.lifecycle == Lifecycle::Closed {
            return Err(self.lifecycle_error(operation, "new or started"));
        }
        if handle.owner != self.config.owner {
            return Err(error(
                ErrorCode::HANDLE_FOREIGN,
                format!("handle {} was issued by another Worker", handle.handle_id),
            ));
        }
        if handle.handle_id == 0 || handle.handle_id >= self.next_handle_id {
            return Err(error(
                ErrorCode::HANDLE_FOREIGN,
                format!(
                    "handle id {} was never issued by this Worker (forged)",
                    handle.handle_id
                ),
            ));
        }
        let Some(record) = self.handles.get(&handle.handle_id) else {
            return Err(self.stale(handle, operation));
        };
        if record.digest != digest || record.namespace != handle.namespace {
            return Err(error(
                ErrorCode::HANDLE_MUTATED,
                format!(
                    "handle {} was issued for {} in {}; its fields were changed",
                    handle.handle_id, record.digest, record.namespace
                ),
            ));
        }
        if record.namespace != namespace {
            return Err(error(
                ErrorCode::HANDLE_WRONG_NAMESPACE,
                format!(
                    "handle {} belongs to {}, not {namespace}",
                    handle.handle_id, record.namespace
                ),
            ));
        }
        if self.uncertain.contains_key(&digest) {
            return Err(error(
                ErrorCode::REGISTER_CLEANUP_UNCERTAIN,
                self.uncertainty(digest),
            ));
        }
        Ok(digest)
    }

    /// Whether `digest` is uncertain: some target's holding of it is in
    /// doubt, until that target answers what it owes or is lost (§2.4).
    pub fn is_uncertain(&self, digest: Digest) -> bool {
        self.uncertain.contains_key(&digest)
    }

    /// Whether `digest` is poisoned (§2.8; sticky for the Worker's life):
    /// installing it killed the target that probed it, and a register of
    /// it is refused with `REGISTER_POISONED`.
    pub fn is_poisoned(&self, digest: Digest) -> bool {
        self.poisoned.contains_key(&digest)
    }

    /// Clears the poison of `digest` (§2.8): a user's decision that the
    /// evidence was not the callable's fault (an external kill, a machine
    /// under memory pressure). The digest stays unproven: its next
    /// register probes again, on one target. Returns whether it was
    /// poisoned; in any lifecycle.
    pub fn forgive(&mut self, digest: Digest) -> bool {
        self.poisoned.remove(&digest).is_some()
    }

    /// Every poisoned digest with the target its install killed and how,
    /// in digest order.
    pub fn poisoned_digests(&self) -> Vec<(Digest, Poison)> {
        self.poisoned.iter().map(|(d, p)| (*d, p.clone())).collect()
    }

    /// Whether some target installed `digest` since start (a snapshot
    /// digest, or one a target confirmed a register of): a register of a
    /// digest that is not probes first when [`ParentConfig::probe_first`].
    pub fn is_proven(&self, digest: Digest) -> bool {
        self.proven.contains(&digest)
    }

    /// Every uncertain digest, in digest order.
    pub fn uncertain_digests(&self) -> Vec<Digest> {
        self.uncertain.keys().copied().collect()
    }

    /// Whether `digest` has a live (published) handle in `namespace`: the
    /// check a register makes, before it broadcasts, for each hook hashid
    /// its metadata names (`call_before` / `call_after`). A
    /// published handle was confirmed by every live target, so such a
    /// digest resolves in each target a new register reaches. Pure query.
    pub fn is_live(&self, digest: Digest, namespace: Namespace) -> bool {
        self.handles
            .values()
            .any(|r| r.digest == digest && r.namespace == namespace)
    }

    /// Whether the IO layer must keep the envelope of `digest` to replay
    /// it to replacements (§2.9): replacements are on and a live handle,
    /// or a register or replay in flight, names it. Pure query.
    pub fn keeps_envelope(&self, digest: Digest) -> bool {
        self.config.respawn_limit > 0
            && self.lifecycle != Lifecycle::Closed
            && (self.handles.values().any(|r| r.digest == digest)
                || self.ops.values().any(|op| {
                    op.digest == digest
                        && matches!(
                            op.kind,
                            OpKind::Register { cleanup: None, .. } | OpKind::Replay { .. }
                        )
                }))
    }

    /// Every live (published) handle, in handle id order.
    pub fn live_handles(&self) -> Vec<Handle> {
        self.handles
            .iter()
            .map(|(id, r)| Handle {
                namespace: r.namespace,
                hashid: r.digest.hashid(),
                handle_id: *id,
                owner: self.config.owner,
            })
            .collect()
    }

    /// Why `digest` is uncertain, for an error message: the targets in
    /// doubt and what each owes (§2.4, "Uncertainty heals").
    pub(super) fn uncertainty(&self, digest: Digest) -> String {
        let doubts: Vec<String> = self
            .doubts
            .get(&digest)
            .into_iter()
            .flatten()
            .map(|(target, doubt)| match doubt {
                Doubt::Register(seq) | Doubt::Unregister(seq) => {
                    format!("{target} owes an answer to {seq}")
                }
                Doubt::Disagrees => format!("{target} disagrees with the registry"),
            })
            .collect();
        format!(
            "{digest} is uncertain: no target's refcount for it can be trusted until each target in doubt answers or is lost ({})",
            doubts.join("; ")
        )
    }

    /// Records a doubt about `target`'s holding of `digest`, which makes
    /// the digest uncertain until every doubt about it is settled (§2.4).
    pub(super) fn doubt(&mut self, digest: Digest, target: TargetId, doubt: Doubt) {
        if mutant!(self, ForgetUncertain) {
            return;
        }
        self.doubts
            .entry(digest)
            .or_default()
            .insert((target, doubt));
        if self.uncertain.contains_key(&digest) {
            return;
        }
        let live = self
            .handles
            .iter()
            .filter(|(_, r)| r.digest == digest)
            .map(|(id, _)| *id)
            .collect();
        self.uncertain.insert(digest, live);
    }

    /// Settles one doubt; a digest left without any is certain again.
    pub(super) fn settle_doubt(&mut self, digest: Digest, target: TargetId, doubt: Doubt) {
        let Some(doubts) = self.doubts.get_mut(&digest) else {
            return;
        };
        doubts.remove(&(target, doubt));
        if doubts.is_empty() {
            self.doubts.remove(&digest);
            self.uncertain.remove(&digest);
        }
    }

    /// A reply to `seq` from `target` that no operation waits for: if a
    /// doubt awaits it, the reply settles that doubt (§2.4, "Uncertainty
    /// heals"): a register's OK is taken back by a heal unregister (a
    /// fresh seq, awaited the same way), a register's refusal and an
    /// unregister's OK settle it, an unregister's refusal or a reply naming
    /// another digest leave the target disagreeing. A reply no doubt awaits
    /// (a duplicate) makes its digest uncertain at that target for good.
    pub(super) fn late_reply(&mut self, target: TargetId, reply: &Reply) {
        let awaited = self.doubts.iter().find_map(|(digest, doubts)| {
            doubts
                .iter()
                .find(|(t, d)| {
                    *t == target
                        && matches!(d, Doubt::Register(s) | Doubt::Unregister(s) if *s == reply.seq)
                })
                .map(|(_, d)| (*digest, *d))
        });
        let Some((digest, doubt)) = awaited else {
            self.doubt(reply.digest, target, Doubt::Disagrees);
            return;
        };
        if reply.digest != digest {
            self.doubt(digest, target, Doubt::Disagrees);
            self.doubt(reply.digest, target, Doubt::Disagrees);
            self.settle_doubt(digest, target, doubt);
            return;
        }
        self.answer_in_flight(target, reply);
        match (doubt, &reply.result) {
            (Doubt::Register(_), Ok(())) => {
                let seq = self.fresh_seq();
                self.doubt(digest, target, Doubt::Unregister(seq));
                self.effects.push_back(Effect::Send {
                    target,
                    frame: ControlFrame::Unregister { seq, digest },
                });
            }
            (Doubt::Unregister(_), Err(_)) => self.doubt(digest, target, Doubt::Disagrees),
            _ => {}
        }
        self.settle_doubt(digest, target, doubt);
    }

    /// A late answer to a control of an operation still in flight (it
    /// waits for other targets) becomes that target's outcome, so that the
    /// operation reports what the target did: an unregister's answer
    /// replaces `TimedOut`, a cleanup's `CleanupUnconfirmed`. A register's
    /// late answer leaves `TimedOut` (the register fails; a heal takes an
    /// install back).
    fn answer_in_flight(&mut self, target: TargetId, reply: &Reply) {
        for op in self.ops.values_mut() {
            let cleanup_seq = match op.kind {
                OpKind::Register {
                    cleanup: Some((seq, _)),
                    ..
                } => Some(seq),
                _ => None,
            };
            let Some(progress) = op.scope.get_mut(&target) else {
                continue;
            };
            match progress {
                Progress::TimedOut
                    if op.seq == reply.seq && matches!(op.kind, OpKind::Unregister { .. }) =>
                {
                    *progress = match &reply.result {
                        Ok(()) => Progress::Confirmed,
                        Err(failure) => Progress::Failed(failure.clone()),
                    };
                }
                Progress::CleanupUnconfirmed(_) if cleanup_seq == Some(reply.seq) => {
                    *progress = match &reply.result {
                        Ok(()) => Progress::RolledBack,
                        Err(failure) => Progress::CleanupUnconfirmed(failure.clone()),
                    };
                }
                _ => {}
            }
        }
    }

    /// `target` was lost: it holds nothing, so every doubt about it is
    /// settled (§2.4).
    pub(super) fn settle_doubts_of(&mut self, target: TargetId) {
        let doubted: Vec<(Digest, Doubt)> = self
            .doubts
            .iter()
            .flat_map(|(digest, doubts)| {
                doubts
                    .iter()
                    .filter(|(t, _)| *t == target)
                    .map(|(_, d)| (*digest, *d))
            })
            .collect();
        for (digest, doubt) in doubted {
            self.settle_doubt(digest, target, doubt);
        }
    }

    /// Whether a doubt about `target` awaits its answer to `seq` (a
    /// timed-out control, or a heal unregister).
    pub(super) fn doubt_awaits(&self, target: TargetId, seq: Seq) -> bool {
        self.doubts.values().flatten().any(|(t, d)| {
            *t == target && matches!(d, Doubt::Register(s) | Doubt::Unregister(s) if *s == seq)
        })
    }
}

pub(super) fn poisoned_error(digest: Digest, poison: &Poison) -> Error {
    Error::new(
        ErrorCode::REGISTER_POISONED,
        OperationKind::Register,
        format!(
            "{digest} is poisoned: installing it killed {} ({}), the target that tried it first; it is refused for the rest of this Worker's life",
            poison.target, poison.cause
        ),
    )
    .with_target(poison.target)
}
