//! The target state machine: one child's private `digest -> slot` table
//! with refcounts, tombstones and run pins (specs/design.md §4.2).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use super::parent::mutant;
#[cfg(feature = "mutants")]
use super::Mutant;
use super::{Failure, Reply, Seq, TargetId};
use crate::descriptor::Digest;
use crate::error::{Error, ErrorCode, OperationKind};

/// The default number of slots per target.
pub const DEFAULT_SLOT_CAPACITY: u16 = 64;

/// How a [`Target`] is set up.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct TargetConfig {
    /// This target's id (named in its errors).
    pub id: TargetId,
    /// How many callables it can hold at once, counting tombstoned slots
    /// still held by a run ([`DEFAULT_SLOT_CAPACITY`] unless configured).
    pub slot_capacity: u16,
}

impl TargetConfig {
    /// Target `id` with [`DEFAULT_SLOT_CAPACITY`] slots.
    pub fn new(id: TargetId) -> TargetConfig {
        TargetConfig {
            id,
            slot_capacity: DEFAULT_SLOT_CAPACITY,
        }
    }
}

/// A slot: where a target keeps one deserialized callable,
/// `0..slot_capacity`. Private to the target: it never appears in a frame
/// or a reply (invariant 9); the target's IO layer uses it to index its
/// table of callables.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Slot(pub u16);

/// What a slot holds.
///
/// ```text
///  (free) ──register, slot free──▶ Deserializing ──deserialized ok──▶ Live
///    ▲ ▲                               │                              │
///    │ └──── deserialized failed ──────┘        last unregister       │
///    ├─────────────────── no run holds it ◀───────────────────────────┤
///    │                                                                ▼
///    └──────────── last end_task ◀──────────── Tombstoned ◀── a run holds it
/// ```
/// (Registers and unregisters that leave the refcount above zero keep a
/// slot `Live`.)
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) enum SlotState {
    /// Reserved for a deserialization in progress.
    Deserializing,
    /// Installed and resolvable.
    Live,
    /// Unresolvable (refcount reached zero) but held by at least one run.
    Tombstoned,
}

/// One used slot.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct SlotUse {
    /// The recomputed digest of the payload deserialized into the slot
    /// (invariant 5 compares it with the digest it resolves under).
    pub(crate) content: Digest,
    pub(crate) state: SlotState,
}

/// An installed (resolvable) digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct Installed {
    pub(crate) slot: Slot,
    pub(crate) refcount: u32,
}

/// A deserialization in progress, keyed by the seq of the register that
/// started it.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct PendingInstall {
    pub(crate) digest: Digest,
    pub(crate) slot: Slot,
    /// Later registers of the same digest that wait for this result.
    pub(crate) waiters: Vec<Seq>,
}

/// An output of the [`Target`], drained with [`Target::poll_effect`].
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum TargetEffect {
    /// Write this reply to the parent.
    Reply(Reply),
    /// Deserialize the payload staged for register `seq` (already opened
    /// and digest-checked) into `slot` through the runtime, then report
    /// with [`Target::on_deserialized`].
    Deserialize {
        /// The register's seq.
        seq: Seq,
        /// The digest it installs under.
        digest: Digest,
        /// The reserved slot.
        slot: Slot,
    },
}

/// The target state machine (specs/design.md §4.2).
///
/// Pure: the IO layer opens staged payloads, recomputes digests, runs the
/// runtime and moves frames; this machine decides. Runs must be begun
/// ([`Target::begin_task`]) in frame order, interleaved with controls, so a
/// run pins its slot before any later unregister is applied.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Target {
    pub(crate) config: TargetConfig,
    /// Used slots; absent means free.
    pub(crate) slots: BTreeMap<Slot, SlotUse>,
    /// The public resolution: digest -> slot and refcount.
    pub(crate) installed: BTreeMap<Digest, Installed>,
    /// Deserializations in progress.
    pub(crate) pending: BTreeMap<Seq, PendingInstall>,
    /// Runs in progress: task seq -> the slot it pins, from
    /// [`Target::begin_task`] to [`Target::end_task`].
    pub(crate) runs: BTreeMap<Seq, Slot>,
    /// Runs whose task started ([`Target::start_task`]): a cancel can no
    /// longer stop them (`specs/protocol.md` §2.11).
    pub(crate) started: BTreeSet<Seq>,
    /// Runs cancelled before they started ([`Target::on_cancel`]): they
    /// never start; their slot stays pinned until their `end_task`.
    pub(crate) cancelled: BTreeSet<Seq>,
    effects: VecDeque<TargetEffect>,
    #[cfg(feature = "mutants")]
    mutant: Option<Mutant>,
}

impl Target {
    /// A target holding the parent's startup snapshot (each digest with its
    /// refcount, as from [`super::Parent::startup_snapshot`]) in slots
    /// `0..`, in snapshot order; repeated digests add up, zero counts are
    /// skipped. The IO layer deserializes each inherited payload into its
    /// slot before serving frames.
    ///
    /// # Errors
    /// `LOCAL_SLOT_EXHAUSTED` when the snapshot holds more digests than
    /// `slot_capacity`.
    pub fn new(config: TargetConfig, snapshot: &[(Digest, u32)]) -> Result<Target, Error> {
        let mut target = Target {
            config,
            slots: BTreeMap::new(),
            installed: BTreeMap::new(),
            pending: BTreeMap::new(),
            runs: BTreeMap::new(),
            started: BTreeSet::new(),
            cancelled: BTreeSet::new(),
            effects: VecDeque::new(),
            #[cfg(feature = "mutants")]
            mutant: None,
        };
        for (digest, count) in snapshot {
            if *count == 0 {
                continue;
            }
            if let Some(entry) = target.installed.get_mut(digest) {
                entry.refcount = entry.refcount.saturating_add(*count);
                continue;
            }
            let Some(slot) = target.free_slot() else {
                return Err(Error::new(
                    ErrorCode::LOCAL_SLOT_EXHAUSTED,
                    OperationKind::Start,
                    format!(
                        "the startup snapshot holds more callables than the {} slots of {}",
                        config.slot_capacity, config.id
                    ),
                )
                .with_target(config.id)
                .with_digest(*digest));
            };
            target.slots.insert(
                slot,
                SlotUse {
                    content: *digest,
                    state: SlotState::Live,
                },
            );
            target.installed.insert(
                *digest,
                Installed {
                    slot,
                    refcount: *count,
                },
            );
        }
        Ok(target)
    }

    /// A target that installed the startup snapshot except the entries in
    /// `failed` (those it could not deserialize or whose checks refused
    /// them): it holds nothing of a failed digest, and the others in slots
    /// `0..` in snapshot order, as [`Target::new`] of the snapshot without
    /// them. The parent learns the failures from the target's readiness
    /// report and settles them ([`super::Parent::snapshot_failed`]); the
    /// target keeps serving.
    ///
    /// # Errors
    /// As [`Target::new`].
    pub fn with_snapshot_failures(
        config: TargetConfig,
        snapshot: &[(Digest, u32)],
        failed: &[Digest],
    ) -> Result<Target, Error> {
        let kept: Vec<(Digest, u32)> = snapshot
            .iter()
            .filter(|(digest, _)| !failed.contains(digest))
            .copied()
            .collect();
        Target::new(config, &kept)
    }

    /// Switches on one known bug (model mutation tests only).
    #[cfg(feature = "mutants")]
    pub fn with_mutant(mut self, mutant: Mutant) -> Target {
        self.mutant = Some(mutant);
        self
    }

    /// The configuration.
    pub fn config(&self) -> &TargetConfig {
        &self.config
    }

    /// The public resolution table without slots: every installed digest
    /// with its refcount, in digest order.
    pub fn installed(&self) -> Vec<(Digest, u32)> {
        self.installed
            .iter()
            .map(|(d, e)| (*d, e.refcount))
            .collect()
    }

    /// The refcount of `digest` (0 when not installed).
    pub fn refcount(&self, digest: Digest) -> u32 {
        self.installed.get(&digest).map_or(0, |e| e.refcount)
    }

    /// Number of used slots (deserializing, live or tombstoned).
    pub fn slots_in_use(&self) -> usize {
        self.slots.len()
    }

    /// Whether `slot` is used (deserializing, live or tombstoned). The IO
    /// layer keeps one callable per used slot and drops it once the
    /// machine frees the slot (this turns `false`).
    pub fn is_slot_used(&self, slot: Slot) -> bool {
        self.slots.contains_key(&slot)
    }

    /// Number of tombstoned slots: unresolvable, still pinned by a run.
    pub fn tombstones(&self) -> usize {
        self.slots
            .values()
            .filter(|u| u.state == SlotState::Tombstoned)
            .count()
    }

    /// Number of runs in progress.
    pub fn runs_in_progress(&self) -> usize {
        self.runs.len()
    }

    /// Whether a deserialization is in progress (the target owes replies).
    pub fn is_deserializing(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The tombstoned slots (unresolvable, still held by a run), in slot
    /// order. The model checker watches them to show that a slot is reused
    /// only after its tombstone is freed (invariant 4).
    pub fn tombstoned_slots(&self) -> Vec<Slot> {
        self.slots
            .iter()
            .filter(|(_, u)| u.state == SlotState::Tombstoned)
            .map(|(s, _)| *s)
            .collect()
    }

    /// This target renamed `id` (everything else unchanged). Targets are
    /// interchangeable in the protocol, so the model checker uses this with
    /// [`super::Parent::relabel_targets`] for symmetry reduction.
    pub fn relabeled(&self, id: TargetId) -> Target {
        let mut copy = self.clone();
        copy.config.id = id;
        copy
    }

    /// The next effect, oldest first; `None` when drained.
    pub fn poll_effect(&mut self) -> Option<TargetEffect> {
        self.effects.pop_front()
    }

    fn free_slot(&self) -> Option<Slot> {
        (0..self.config.slot_capacity)
            .map(Slot)
            .find(|s| !self.slots.contains_key(s))
    }

    fn reply(&mut self, seq: Seq, digest: Digest, result: Result<(), Failure>) {
        self.effects.push_back(TargetEffect::Reply(Reply {
            seq,
            digest,
            result,
        }));
    }

    /// A register control for `requested` (seq `seq`), after the IO layer
    /// opened the staged payload read-only, validated the envelope against
    /// the mapped size and recomputed its digest: `verified` is that digest,
    /// or the failure (`IO_FAILED`, `ENVELOPE_INVALID`, ...).
    ///
    /// In order: a failure is replied as is; a digest other than
    /// `requested` is refused with `HASHID_DESCRIPTOR_MISMATCH` (nothing
    /// installed, invariant 5); an installed digest gets refcount + 1 and an
    /// OK reply without deserialization; a digest already being deserialized
    /// waits for that result; with no free slot the reply is
    /// `LOCAL_SLOT_EXHAUSTED` before any deserialization; otherwise a slot is
    /// reserved and [`TargetEffect::Deserialize`] emitted. A tombstoned slot
    /// of the same digest is not revived: the register takes a fresh slot.
    /// A seq already being deserialized is refused with `FRAME_INVALID`.
    pub fn on_register(&mut self, seq: Seq, requested: Digest, verified: Result<Digest, Failure>) {
        let verified = match verified {
            Ok(digest) => digest,
            Err(failure) => return self.reply(seq, requested, Err(failure)),
        };
        if verified != requested && !mutant!(self, SkipDigestVerification) {
            let message = format!(
                "the staged payload's digest is {verified}, the register names {requested}"
            );
            return self.reply(
                seq,
                requested,
                Err(Failure::new(ErrorCode::HASHID_DESCRIPTOR_MISMATCH, message)),
            );
        }
        if self.pending.contains_key(&seq) {
            let message = format!("{seq} is already being deserialized on {}", self.config.id);
            return self.reply(
                seq,
                requested,
                Err(Failure::new(ErrorCode::FRAME_INVALID, message)),
            );
        }
        if let Some(entry) = self.installed.get_mut(&requested) {
            entry.refcount = entry.refcount.saturating_add(1);
            return self.reply(seq, requested, Ok(()));
        }
        if let Some(pending) = self.pending.values_mut().find(|p| p.digest == requested) {
            pending.waiters.push(seq);
            return;
        }
        let Some(slot) = self.free_slot() else {
            let message = format!(
                "{} has no free slot (capacity {}) for {requested}",
                self.config.id, self.config.slot_capacity
            );
            return self.reply(
                seq,
                requested,
                Err(Failure::new(ErrorCode::LOCAL_SLOT_EXHAUSTED, message)),
            );
        };
        self.slots.insert(
            slot,
            SlotUse {
                content: verified,
                state: SlotState::Deserializing,
            },
        );
        self.pending.insert(
            seq,
            PendingInstall {
                digest: requested,
                slot,
                waiters: Vec::new(),
            },
        );
        self.effects.push_back(TargetEffect::Deserialize {
            seq,
            digest: requested,
            slot,
        });
    }

    /// The result of the [`TargetEffect::Deserialize`] for register `seq`.
    /// Success installs the digest with refcount 1 plus one per waiting
    /// register and replies OK to each; failure frees the slot and replies
    /// the failure to each.
    ///
    /// # Errors
    /// `FRAME_INVALID` if no deserialization for `seq` is in progress
    /// (nothing changes).
    pub fn on_deserialized(&mut self, seq: Seq, result: Result<(), Failure>) -> Result<(), Error> {
        let Some(pending) = self.pending.remove(&seq) else {
            return Err(Error::new(
                ErrorCode::FRAME_INVALID,
                OperationKind::Reply,
                format!("no deserialization for {seq} is in progress"),
            )
            .with_target(self.config.id)
            .with_seq(seq));
        };
        let waiting = std::iter::once(seq).chain(pending.waiters.iter().copied());
        match &result {
            Ok(()) => {
                if let Some(used) = self.slots.get_mut(&pending.slot) {
                    used.state = SlotState::Live;
                }
                let refcount = u32::try_from(1 + pending.waiters.len()).unwrap_or(u32::MAX);
                self.installed.insert(
                    pending.digest,
                    Installed {
                        slot: pending.slot,
                        refcount,
                    },
                );
            }
            Err(_) => {
                self.slots.remove(&pending.slot);
            }
        }
        for answered in waiting.collect::<Vec<_>>() {
            self.reply(answered, pending.digest, result.clone());
        }
        Ok(())
    }

    /// An unregister control (user unregister or cleanup) for `digest`:
    /// refcount − 1 and an OK reply; at zero the digest stops resolving and
    /// its slot is freed, or tombstoned while a run holds it. A digest that
    /// is not installed is refused (parent and target disagree):
    /// `UNREGISTER_TOMBSTONE_ACTIVE` if only a tombstoned slot of it
    /// remains, `DIGEST_NOT_INSTALLED` otherwise.
    ///
    /// ```
    /// use callreg::descriptor::Digest;
    /// use callreg::error::ErrorCode;
    /// use callreg::protocol::{Seq, Target, TargetConfig, TargetEffect, TargetId};
    ///
    /// let digest = Digest::sha256(b"descriptor");
    /// // Inherited from the startup snapshot with refcount 1.
    /// let mut target = Target::new(TargetConfig::new(TargetId(0)), &[(digest, 1)]).unwrap();
    /// // A run pins the slot; the unregister then only tombstones it.
    /// target.begin_task(Seq(1), digest).unwrap();
    /// target.on_unregister(Seq(2), digest);
    /// let Some(TargetEffect::Reply(reply)) = target.poll_effect() else { panic!() };
    /// assert_eq!(reply.result, Ok(()));
    /// assert_eq!((target.refcount(digest), target.tombstones()), (0, 1));
    /// target.end_task(Seq(1)).unwrap();
    /// assert_eq!(target.tombstones(), 0);
    ///
    /// // A second unregister: parent and target disagree, refused.
    /// target.on_unregister(Seq(3), digest);
    /// let Some(TargetEffect::Reply(reply)) = target.poll_effect() else { panic!() };
    /// assert_eq!(reply.result.unwrap_err().code, ErrorCode::DIGEST_NOT_INSTALLED);
    /// ```
    pub fn on_unregister(&mut self, seq: Seq, digest: Digest) {
        let Some(entry) = self.installed.get_mut(&digest) else {
            let tombstoned = self
                .slots
                .values()
                .any(|u| u.content == digest && u.state == SlotState::Tombstoned);
            let failure = if tombstoned {
                Failure::new(
                    ErrorCode::UNREGISTER_TOMBSTONE_ACTIVE,
                    format!(
                        "{digest} is already unregistered on {}; its slot waits for a run",
                        self.config.id
                    ),
                )
            } else {
                Failure::new(
                    ErrorCode::DIGEST_NOT_INSTALLED,
                    format!("{digest} is not installed on {}", self.config.id),
                )
            };
            return self.reply(seq, digest, Err(failure));
        };
        entry.refcount = entry.refcount.saturating_sub(1);
        if entry.refcount == 0 {
            let slot = entry.slot;
            self.installed.remove(&digest);
            let held = self.runs.values().any(|s| *s == slot);
            if held && !mutant!(self, FreeSlotHeldByRun) {
                if let Some(used) = self.slots.get_mut(&slot) {
                    used.state = SlotState::Tombstoned;
                }
            } else {
                self.slots.remove(&slot);
            }
        }
        self.reply(seq, digest, Ok(()))
    }

    /// A task frame (seq `seq`) for `digest`: resolves it now and pins its
    /// slot for the run; returns the slot to run from.
    ///
    /// # Errors
    /// `DIGEST_NOT_INSTALLED` naming the hashid when it does not resolve;
    /// `FRAME_INVALID` when a run with this seq is already in progress.
    pub fn begin_task(&mut self, seq: Seq, digest: Digest) -> Result<Slot, Error> {
        let error = |code, message: String| {
            Error::new(code, OperationKind::Task, message)
                .with_target(self.config.id)
                .with_digest(digest)
                .with_seq(seq)
        };
        if self.runs.contains_key(&seq) {
            return Err(error(
                ErrorCode::FRAME_INVALID,
                format!("a run for {seq} is already in progress"),
            ));
        }
        let Some(entry) = self.installed.get(&digest) else {
            return Err(error(
                ErrorCode::DIGEST_NOT_INSTALLED,
                format!("{digest} is not installed on {}", self.config.id),
            ));
        };
        self.runs.insert(seq, entry.slot);
        Ok(entry.slot)
    }

    /// The task thread is about to run task `seq` (pinned by
    /// [`Target::begin_task`]): `Ok(true)` to run it, now past cancelling;
    /// `Ok(false)` when a cancel came first (`specs/protocol.md` §2.11):
    /// it must not run, and is ended with [`Target::end_task`] without a
    /// result (the cancel's reply already answered for it). This and
    /// [`Target::on_cancel`] decide under one machine, so a task is never
    /// both cancelled and run.
    ///
    /// ```
    /// use callreg::descriptor::Digest;
    /// use callreg::protocol::{Seq, Target, TargetConfig, TargetEffect, TargetId};
    ///
    /// let digest = Digest::sha256(b"descriptor");
    /// let mut target = Target::new(TargetConfig::new(TargetId(0)), &[(digest, 1)]).unwrap();
    /// target.begin_task(Seq(1), digest).unwrap();
    /// target.begin_task(Seq(2), digest).unwrap();
    /// assert_eq!(target.start_task(Seq(1)), Ok(true));
    /// target.on_cancel(Seq(2), digest); // still queued: cancelled
    /// let Some(TargetEffect::Reply(reply)) = target.poll_effect() else { panic!() };
    /// assert_eq!(reply.result, Ok(()));
    /// assert_eq!(target.start_task(Seq(2)), Ok(false)); // never runs
    /// target.end_task(Seq(2)).unwrap();
    /// ```
    ///
    /// # Errors
    /// `FRAME_INVALID` when no run with this seq is in progress, or it
    /// already started.
    pub fn start_task(&mut self, seq: Seq) -> Result<bool, Error> {
        let error = |message: String| {
            Error::new(ErrorCode::FRAME_INVALID, OperationKind::Task, message)
                .with_target(self.config.id)
                .with_seq(seq)
        };
        if !self.runs.contains_key(&seq) {
            return Err(error(format!("no run for {seq} is in progress")));
        }
        if self.started.contains(&seq) {
            return Err(error(format!("the run for {seq} already started")));
        }
        if self.cancelled.contains(&seq) {
            return Ok(false);
        }
        self.started.insert(seq);
        Ok(true)
    }

    /// A cancel control for task `seq` of `digest` (`specs/protocol.md`
    /// §2.11): replies (echoing `seq` and `digest`) `Ok` when the task had
    /// not started — it will never run ([`Target::start_task`] says
    /// `false`) —, else `TASK_RUNNING`: it started, or already ended (its
    /// result is on its way or arrived), and runs to its end.
    pub fn on_cancel(&mut self, seq: Seq, digest: Digest) {
        let started = self.started.contains(&seq);
        let queued = self.runs.contains_key(&seq) && !started;
        if queued || (started && mutant!(self, CancelStarted)) {
            self.cancelled.insert(seq);
            return self.reply(seq, digest, Ok(()));
        }
        let message = if started {
            format!("{seq} is already running on {}", self.config.id)
        } else {
            format!("{seq} already ended on {}", self.config.id)
        };
        self.reply(
            seq,
            digest,
            Err(Failure::new(ErrorCode::TASK_RUNNING, message)),
        )
    }

    /// Whether task `seq` was cancelled before it started (it never runs).
    pub fn is_cancelled(&self, seq: Seq) -> bool {
        self.cancelled.contains(&seq)
    }

    /// Whether task `seq` started running.
    pub fn is_started(&self, seq: Seq) -> bool {
        self.started.contains(&seq)
    }

    /// The run of task `seq` finished: unpins its slot, and frees a
    /// tombstoned slot at its last release.
    ///
    /// # Errors
    /// `FRAME_INVALID` when no run with this seq is in progress.
    pub fn end_task(&mut self, seq: Seq) -> Result<(), Error> {
        let Some(slot) = self.runs.remove(&seq) else {
            return Err(Error::new(
                ErrorCode::FRAME_INVALID,
                OperationKind::Task,
                format!("no run for {seq} is in progress"),
            )
            .with_target(self.config.id)
            .with_seq(seq));
        };
        self.started.remove(&seq);
        self.cancelled.remove(&seq);
        let still_held = self.runs.values().any(|s| *s == slot);
        let tombstoned = self
            .slots
            .get(&slot)
            .is_some_and(|u| u.state == SlotState::Tombstoned);
        if tombstoned && !still_held {
            self.slots.remove(&slot);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u8) -> Digest {
        Digest([n; 32])
    }

    fn drain(t: &mut Target) -> Vec<TargetEffect> {
        std::iter::from_fn(|| t.poll_effect()).collect()
    }

    fn reply(seq: u64, n: u8, result: Result<(), Failure>) -> TargetEffect {
        TargetEffect::Reply(Reply {
            seq: Seq(seq),
            digest: digest(n),
            result,
        })
    }

    #[test]
    fn registers_of_a_digest_being_deserialized_wait_for_that_result() {
        let mut t = Target::new(TargetConfig::new(TargetId(0)), &[]).unwrap();
        t.on_register(Seq(1), digest(1), Ok(digest(1)));
        t.on_register(Seq(2), digest(1), Ok(digest(1)));
        assert_eq!(
            drain(&mut t),
            vec![TargetEffect::Deserialize {
                seq: Seq(1),
                digest: digest(1),
                slot: Slot(0)
            }]
        );
        t.on_deserialized(Seq(1), Ok(())).unwrap();
        assert_eq!(
            drain(&mut t),
            vec![reply(1, 1, Ok(())), reply(2, 1, Ok(()))]
        );
        assert_eq!(t.installed(), vec![(digest(1), 2)]);

        let mut t = Target::new(TargetConfig::new(TargetId(0)), &[]).unwrap();
        t.on_register(Seq(1), digest(1), Ok(digest(1)));
        t.on_register(Seq(2), digest(1), Ok(digest(1)));
        drain(&mut t);
        let failure = Failure::new(ErrorCode::DESERIALIZE_FAILED, "EOFError");
        t.on_deserialized(Seq(1), Err(failure.clone())).unwrap();
        assert_eq!(
            drain(&mut t),
            vec![reply(1, 1, Err(failure.clone())), reply(2, 1, Err(failure))]
        );
        assert_eq!((t.installed(), t.slots_in_use()), (vec![], 0));
    }

    #[test]
    fn a_snapshot_larger_than_the_slots_is_refused_and_repeats_add_up() {
        let config = TargetConfig {
            id: TargetId(4),
            slot_capacity: 1,
        };
        let e = Target::new(config, &[(digest(1), 1), (digest(2), 1)]).unwrap_err();
        assert_eq!(
            (e.code, e.target, e.operation),
            (
                ErrorCode::LOCAL_SLOT_EXHAUSTED,
                Some(TargetId(4)),
                OperationKind::Start
            )
        );
        let t = Target::new(config, &[(digest(1), 1), (digest(1), 2), (digest(2), 0)]).unwrap();
        assert_eq!(t.installed(), vec![(digest(1), 3)]);
        assert_eq!(DEFAULT_SLOT_CAPACITY, 64);
        assert_eq!(TargetConfig::new(TargetId(0)).slot_capacity, 64);
    }

    #[test]
    fn a_failed_snapshot_entry_is_not_held_and_the_rest_fill_slots_in_order() {
        let snapshot = [(digest(1), 2), (digest(2), 1), (digest(3), 1)];
        let mut t =
            Target::with_snapshot_failures(TargetConfig::new(TargetId(0)), &snapshot, &[digest(2)])
                .unwrap();
        assert_eq!(t.installed(), vec![(digest(1), 2), (digest(3), 1)]);
        assert_eq!(t.begin_task(Seq(1), digest(3)).unwrap(), Slot(1));
        assert_eq!(
            t.begin_task(Seq(2), digest(2)).unwrap_err().code,
            ErrorCode::DIGEST_NOT_INSTALLED
        );
    }

    #[test]
    fn a_task_for_an_unknown_digest_names_the_hashid() {
        let mut t = Target::new(TargetConfig::new(TargetId(1)), &[(digest(1), 1)]).unwrap();
        let e = t.begin_task(Seq(3), digest(2)).unwrap_err();
        assert_eq!(e.code, ErrorCode::DIGEST_NOT_INSTALLED);
        assert_eq!(
            (e.hashid, e.target, e.seq),
            (Some(digest(2).hashid()), Some(TargetId(1)), Some(Seq(3)))
        );
        assert!(e.message.contains(&digest(2).hashid().to_string()), "{e}");
        assert_eq!(t.begin_task(Seq(4), digest(1)), Ok(Slot(0)));
        assert_eq!(
            t.begin_task(Seq(4), digest(1)).unwrap_err().code,
            ErrorCode::FRAME_INVALID
        );
    }

    #[test]
    fn a_cancel_stops_only_a_run_that_has_not_started() {
        let mut t = Target::new(TargetConfig::new(TargetId(0)), &[(digest(1), 1)]).unwrap();
        for seq in 1..=3 {
            t.begin_task(Seq(seq), digest(1)).unwrap();
        }
        assert_eq!(t.start_task(Seq(1)), Ok(true));
        assert!(t.is_started(Seq(1)) && !t.is_cancelled(Seq(1)));
        t.on_cancel(Seq(1), digest(1)); // running
        t.on_cancel(Seq(2), digest(1)); // queued: cancelled
        t.on_cancel(Seq(2), digest(1)); // again: still cancelled
        t.end_task(Seq(1)).unwrap();
        t.on_cancel(Seq(1), digest(1)); // ended
        let running = |seq: u64, what: &str| {
            reply(
                seq,
                1,
                Err(Failure::new(
                    ErrorCode::TASK_RUNNING,
                    format!("seq {seq} {what} on target 0"),
                )),
            )
        };
        assert_eq!(
            drain(&mut t),
            vec![
                running(1, "is already running"),
                reply(2, 1, Ok(())),
                reply(2, 1, Ok(())),
                running(1, "already ended"),
            ]
        );
        assert!(t.is_cancelled(Seq(2)) && !t.is_started(Seq(2)));
        assert_eq!(t.start_task(Seq(2)), Ok(false));
        assert_eq!(t.start_task(Seq(3)), Ok(true));
        assert_eq!(
            t.start_task(Seq(3)).unwrap_err().code,
            ErrorCode::FRAME_INVALID
        );
        assert_eq!(
            t.start_task(Seq(9)).unwrap_err().code,
            ErrorCode::FRAME_INVALID
        );
        t.end_task(Seq(2)).unwrap();
        t.end_task(Seq(3)).unwrap();
        assert_eq!(t.runs_in_progress(), 0);
        assert!(!t.is_cancelled(Seq(2)));
    }

    #[test]
    fn a_tombstoned_slot_is_freed_at_the_last_run_only() {
        let mut t = Target::new(TargetConfig::new(TargetId(0)), &[(digest(1), 1)]).unwrap();
        t.begin_task(Seq(1), digest(1)).unwrap();
        t.begin_task(Seq(2), digest(1)).unwrap();
        t.on_unregister(Seq(3), digest(1));
        assert_eq!(drain(&mut t), vec![reply(3, 1, Ok(()))]);
        assert_eq!(
            t.slots.get(&Slot(0)).map(|u| u.state),
            Some(SlotState::Tombstoned)
        );
        t.end_task(Seq(1)).unwrap();
        assert_eq!(t.slots_in_use(), 1);
        t.end_task(Seq(2)).unwrap();
        assert_eq!(t.slots_in_use(), 0);
        assert_eq!(
            t.end_task(Seq(2)).unwrap_err().code,
            ErrorCode::FRAME_INVALID
        );
    }

    #[test]
    fn a_register_seq_already_deserializing_is_refused() {
        let mut t = Target::new(TargetConfig::new(TargetId(0)), &[]).unwrap();
        t.on_register(Seq(1), digest(1), Ok(digest(1)));
        t.on_register(Seq(1), digest(2), Ok(digest(2)));
        let effects = drain(&mut t);
        let TargetEffect::Reply(Reply { result: Err(f), .. }) = &effects[1] else {
            panic!("{effects:?}")
        };
        assert_eq!(f.code, ErrorCode::FRAME_INVALID);
        assert_eq!(
            t.on_deserialized(Seq(7), Ok(())).unwrap_err().code,
            ErrorCode::FRAME_INVALID
        );
    }
}
