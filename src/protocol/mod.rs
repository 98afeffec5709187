//! The registration protocol as pure state machines (specs/design.md §4).
//!
//! This module is deterministic protocol logic: it performs no IO, reads no
//! clock, draws no random numbers and starts no threads. Time arrives as a
//! [`Time`] argument, randomness (the [`OwnerToken`]) as configuration.
//! Payload bytes never enter it: it holds digests and ids only.
//!
//! Two machines, each driven the same way (the shape of `quinn-proto` and
//! `str0m`):
//!
//! * [`Parent`] — the registry, the operations in flight and their scopes.
//!   Inputs are method calls ([`Parent::register`], [`Parent::unregister`],
//!   [`Parent::handle_reply`], [`Parent::target_lost`],
//!   [`Parent::handle_timeout`], ...); outputs are [`Effect`]s drained with
//!   [`Parent::poll_effect`], plus the next deadline from
//!   [`Parent::poll_timeout`].
//! * [`Target`] — one child's private `digest -> slot` table. Inputs are
//!   [`Target::on_register`], [`Target::on_unregister`],
//!   [`Target::on_deserialized`], [`Target::begin_task`],
//!   [`Target::end_task`]; outputs are [`TargetEffect`]s drained with
//!   [`Target::poll_effect`].
//!
//! # The driving rule
//!
//! After every input, drain the machine's effects (`poll_effect` until
//! `None`) and carry each out in order before giving it the next input.
//! Frames to one target must be delivered in the order they were emitted
//! (a pipe is FIFO); frames to different targets may interleave freely.
//! The exact loop an IO layer runs, step by step, is in `specs/protocol.md`.
//!
//! One register after start, with one target, moved by hand (the IO layer
//! would stage the envelope, write the frame to a pipe and read the reply;
//! `examples/protocol_by_hand.rs` goes further):
//!
//! ```
//! use callreg::descriptor::Digest;
//! use callreg::protocol::{
//!     Completion, ControlFrame, Effect, Namespace, OwnerToken, Parent, ParentConfig, Target,
//!     TargetConfig, TargetEffect, TargetId, TargetOutcome, Time, DEFAULT_SLOT_CAPACITY,
//! };
//!
//! let mut parent = Parent::new(ParentConfig {
//!     targets: 1,
//!     control_timeout: 1_000_000,
//!     operation_timeout: 10_000_000,
//!     fence_on_timeout: true,
//!     owner: OwnerToken(7),
//!     slot_capacity: DEFAULT_SLOT_CAPACITY,
//!     probe_first: true,
//!     respawn_limit: 0,
//!     respawn_backoff: 0,
//!     unbounded_spawn: false,
//!     max_tasks_per_target: 0,
//! });
//! parent.start()?;
//! let mut target = Target::new(TargetConfig::new(TargetId(0)), &parent.startup_snapshot())?;
//!
//! let digest = Digest::sha256(b"a descriptor");
//! let op = parent.register(digest, Namespace::LocalPython, Time(0))?;
//! let staging = match parent.poll_effect() {
//!     Some(Effect::Stage { staging, digest: d }) if d == digest => staging,
//!     other => panic!("{other:?}"),
//! };
//! let Some(Effect::Send { target: TargetId(0), frame }) = parent.poll_effect() else {
//!     panic!("a frame for target 0")
//! };
//! assert_eq!(frame, ControlFrame::Register { seq: frame.seq(), digest, staging });
//! assert_eq!(parent.poll_effect(), None);
//!
//! // The target: the IO layer verified the staged payload's digest.
//! target.on_register(frame.seq(), digest, Ok(digest));
//! let Some(TargetEffect::Deserialize { seq, .. }) = target.poll_effect() else {
//!     panic!("deserialize first")
//! };
//! target.on_deserialized(seq, Ok(()))?;
//! let Some(TargetEffect::Reply(reply)) = target.poll_effect() else {
//!     panic!("then reply")
//! };
//! assert_eq!(reply.result, Ok(()));
//! assert_eq!(target.installed(), vec![(digest, 1)]);
//!
//! // The parent publishes the handle only now (invariant 1).
//! parent.handle_reply(TargetId(0), reply, Time(10))?;
//! assert_eq!(parent.poll_effect(), Some(Effect::ReleaseStaged { staging }));
//! let Some(Effect::Completed { op: done, result: Ok(Completion::Registered(handle)), outcomes }) =
//!     parent.poll_effect()
//! else {
//!     panic!("completed")
//! };
//! assert_eq!((done, handle.hashid, outcomes), (op, digest.hashid(), vec![(TargetId(0), TargetOutcome::Ok)]));
//! assert!(parent.is_idle());
//! # Ok::<(), callreg::error::Error>(())
//! ```
//!
//! # Plain data as JSON
//!
//! [`Handle`], [`Failure`], [`TargetOutcome`], [`TargetOutcomeEntry`],
//! [`RegistrySnapshot`] ([`Parent::registry_snapshot`]) and
//! [`TargetSnapshot`] ([`Target::snapshot`]), like [`crate::error::Error`],
//! have `to_json`, `to_json_pretty` and a strict `from_json` naming the
//! offending field (`specs/metadata.md` §7). None of them holds a slot.
//!
//! [`invariants`] holds specs/design.md §4.4's invariants as pure predicates over
//! a [`invariants::View`] of both machines and the frames in transit; the
//! model checker and the tests call the same functions.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::descriptor::Digest;
use crate::error::{Error, ErrorCode};

mod forms;
pub mod invariants;
mod parent;
mod target;

pub use forms::{
    DigestCount, InstalledDigest, RegistrySnapshot, TargetOutcomeEntry, TargetSnapshot,
};
pub use parent::{
    Completion, Effect, FailedRegistration, Handle, Lifecycle, Parent, ParentConfig, Poison,
    TargetOutcome, TargetPhase, TaskEnd, TaskInfo, BOUND_FENCE_CAUSE, NONE_COMING, NOT_READY_CAUSE,
    SILENT_FENCE_CAUSE, UNREGISTERED_WHILE_WAITING,
};
pub use target::{Slot, Target, TargetConfig, TargetEffect, DEFAULT_SLOT_CAPACITY};

// The ids every layer names (`crate::ids`, below the formats): the protocol
// is where they are used most, so they are re-exported here.
pub use crate::ids::{Namespace, OpId, OwnerToken, Seq, StagingId, TargetId, Time};

/// The usual [`ParentConfig::respawn_limit`]: up to 3 replacements of one
/// target in a row may be lost before they join.
pub const DEFAULT_RESPAWN_LIMIT: u16 = 3;

/// The usual [`ParentConfig::respawn_backoff`]: 100 ms before the second
/// replacement in a row (then 200 ms, 400 ms, …).
pub const DEFAULT_RESPAWN_BACKOFF: u64 = 100_000;

/// A frame the parent sends to one target (specs/design.md §3.3 gives its wire
/// form). No frame carries a slot (invariant 9).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(tag = "frame", rename_all = "snake_case")]
pub enum ControlFrame {
    /// Install (or add a reference to) the callable whose staged payload is
    /// `staging` and whose digest must recompute to `digest`.
    Register {
        /// The register operation's seq.
        seq: Seq,
        /// The digest the payload must have.
        digest: Digest,
        /// The staged payload to open (read-only).
        staging: StagingId,
    },
    /// Drop one reference to `digest` (a user unregister or a rollback
    /// cleanup; digest-owned, never slot-owned).
    Unregister {
        /// The unregister operation's or the cleanup's seq.
        seq: Seq,
        /// The digest to release.
        digest: Digest,
    },
    /// Run one task on `digest` (its input travels beside the frame; the
    /// protocol does not hold it).
    Task {
        /// The task's seq.
        seq: Seq,
        /// The callable to run.
        digest: Digest,
    },
    /// Cancel task `seq` of `digest` if it has not started
    /// (`specs/protocol.md` §2.11); the target answers with a [`Reply`]
    /// echoing the task's seq: `Ok` (cancelled, it never runs) or
    /// `TASK_RUNNING`.
    Cancel {
        /// The task's seq.
        seq: Seq,
        /// The task's callable.
        digest: Digest,
    },
}

impl ControlFrame {
    /// The frame's seq.
    pub fn seq(&self) -> Seq {
        match self {
            ControlFrame::Register { seq, .. }
            | ControlFrame::Unregister { seq, .. }
            | ControlFrame::Task { seq, .. }
            | ControlFrame::Cancel { seq, .. } => *seq,
        }
    }

    /// The digest the frame names.
    pub fn digest(&self) -> Digest {
        match self {
            ControlFrame::Register { digest, .. }
            | ControlFrame::Unregister { digest, .. }
            | ControlFrame::Task { digest, .. }
            | ControlFrame::Cancel { digest, .. } => *digest,
        }
    }
}

/// Where a control a target reports alive stands there
/// (`specs/protocol.md` §2.7, §2.8; `specs/wire.md`, the Alive frame):
/// received and waiting for its turn, or being installed.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum ControlPhase {
    /// Received, its work not begun: queued behind other controls, or
    /// taken by the control thread but waiting for the runtime (a task
    /// holds the interpreter lock). Wire value 0.
    Queued = 0,
    /// Its install has begun: the runtime holds what it needs (for Python,
    /// the interpreter lock) and runs it, until the control is answered.
    /// Wire value 1.
    Running = 1,
}

impl ControlPhase {
    /// The phase for a wire value, or `None` for an unknown value.
    pub fn from_u8(value: u8) -> Option<ControlPhase> {
        match value {
            0 => Some(ControlPhase::Queued),
            1 => Some(ControlPhase::Running),
            _ => None,
        }
    }
}

/// A failure as it travels in a reply, or as the IO layer reports it to a
/// machine (e.g. the staged payload could not be opened): a code and the
/// full UTF-8 message (never truncated).
///
/// JSON form ([`Failure::to_json`], strict [`Failure::from_json`]):
/// `{"code": "DIGEST_NOT_INSTALLED", "message": "…"}`, the code by its
/// text name.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Failure {
    /// What kind of failure.
    pub code: ErrorCode,
    /// The whole message.
    pub message: String,
}

impl Failure {
    /// A failure with `code` and `message`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure {
            code: e.code,
            message: e.message,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

/// A target's answer to a [`ControlFrame::Register`],
/// [`ControlFrame::Unregister`] or [`ControlFrame::Cancel`]: echoes the
/// frame's seq and digest.
/// Replies carry no slot (invariant 9).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub struct Reply {
    /// The seq of the frame answered.
    pub seq: Seq,
    /// The digest of the frame answered.
    pub digest: Digest,
    /// `Ok(())` when the control took effect; otherwise why it did not (the
    /// target changed nothing).
    pub result: Result<(), Failure>,
}

/// Known-bug switches for the model checker's mutation tests: each turns
/// on one small, real deviation in the machines' code paths, which the
/// invariants must catch. Only with the `mutants` cargo feature; never
/// enable in production.
#[cfg(feature = "mutants")]
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum Mutant {
    /// Parent: publish the handle when the first target confirms (caught by
    /// invariant 1).
    PublishBeforeAllReplies,
    /// Parent: roll back a failed register without any cleanup (caught by
    /// invariant 2).
    SkipCleanup,
    /// Parent: send cleanup also to targets that did not confirm (caught by
    /// invariants 2 and 8).
    CleanupUnconfirmedTargets,
    /// Parent: never mark a digest uncertain (caught by invariant 2).
    ForgetUncertain,
    /// Parent: release the staged payload on the first answer instead of
    /// the last (caught by invariant 7).
    ReleaseStagedEarly,
    /// Parent: send a probing register (`specs/protocol.md` §2.8) to every
    /// live target at once instead of to the probe target alone (caught by
    /// the model's `probe first` property).
    BroadcastBeforeProbe,
    /// Parent: accept a register of a poisoned digest (caught by the
    /// model's `poisoned never sent again` property).
    RetryPoisoned,
    /// Parent: a probe target fenced for silence (stopped, stalled)
    /// poisons the digest it probed (caught by the model's `silence
    /// poisons nothing` property).
    PoisonSilence,
    /// Parent: a probe target fenced at the operation bound while its last
    /// alive report said the probe was queued (behind a task, say) poisons
    /// the digest it probed (caught by the model's "a queued probe poisons
    /// nothing").
    PoisonQueued,
    /// Parent: a probe target's refusal with `REGISTER_POISONED` (a target
    /// that is itself a registry, §2.8 "A nested refusal") fails the
    /// register but poisons nothing here (caught by the model's "a digest
    /// whose probe was refused as poisoned is never sent again").
    IgnoreNestedPoison,
    /// Target: install or add a reference without comparing the recomputed
    /// digest with the requested one (caught by invariant 5).
    SkipDigestVerification,
    /// Target: free a slot at its last unregister even while a run holds it
    /// (caught by invariant 4).
    FreeSlotHeldByRun,
    /// Parent: ignore alive reports, so a deadline counts from the send
    /// (caught by the model's "heard targets wait for the bound").
    IgnoreAlive,
    /// Target: a cancel that arrives after its task started reports it
    /// cancelled anyway (caught by the model's "a task is never both
    /// cancelled and run").
    CancelStarted,
    /// Parent: a task's deadline fences its target without completing the
    /// task there (the fence then ends it `lost`; caught by the model's
    /// "a task past its deadline ends Deadline and its target is fenced").
    DeadlineWithoutCompletion,
    /// Parent: a task result from a previous incarnation of the task's
    /// target is accepted: a lost target's tasks stay in flight, and a
    /// result from any incarnation ends them (caught by the model's
    /// "results only from the incarnation that ran the task", "every task
    /// completes exactly once" and invariant 13).
    AcceptStaleResult,
    /// Parent: a replacement joins as soon as it is spawned, before its
    /// replayed registrations are confirmed (caught by invariant 11).
    JoinBeforeReplay,
    /// Parent: a registration published while a replacement joins is not
    /// replayed to it (caught by invariant 11).
    SkipReplayOfPublished,
    /// Parent: a target sent its `max_tasks_per_target` tasks is retired
    /// at the next input, with its tasks still in flight (§2.14; caught by
    /// the model's "machines answer as documented": a retirement that
    /// costs a task).
    RetireBusy,
    /// Parent: a task's deadline counts from its submit, not from its
    /// target's start report (§2.12; caught by the model's "a task ends
    /// at its deadline only once it started").
    DeadlineFromSubmit,
    /// Parent: a task that its lost process had reported started is
    /// handed over like one that never started (§2.15; caught by the
    /// model's "a task runs at most once").
    RetryStarted,
}

#[cfg(feature = "mutants")]
impl Mutant {
    /// Every mutant.
    pub const ALL: &'static [Mutant] = &[
        Mutant::PublishBeforeAllReplies,
        Mutant::SkipCleanup,
        Mutant::CleanupUnconfirmedTargets,
        Mutant::ForgetUncertain,
        Mutant::ReleaseStagedEarly,
        Mutant::BroadcastBeforeProbe,
        Mutant::RetryPoisoned,
        Mutant::PoisonSilence,
        Mutant::PoisonQueued,
        Mutant::IgnoreNestedPoison,
        Mutant::SkipDigestVerification,
        Mutant::FreeSlotHeldByRun,
        Mutant::IgnoreAlive,
        Mutant::JoinBeforeReplay,
        Mutant::SkipReplayOfPublished,
        Mutant::DeadlineWithoutCompletion,
        Mutant::AcceptStaleResult,
        Mutant::CancelStarted,
        Mutant::RetireBusy,
        Mutant::DeadlineFromSubmit,
        Mutant::RetryStarted,
    ];
}
