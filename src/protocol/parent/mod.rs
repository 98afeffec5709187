//! The parent state machine: registry, operations, scopes (specs/design.md §4.1).
//!
//! One machine, its inputs split by what they are about:
//!
//! * here: the machine ([`Parent`]), its configuration, the types it
//!   speaks in ([`Effect`], [`Completion`], [`TargetOutcome`],
//!   [`Lifecycle`], [`Handle`], ...), its construction, queries and close,
//!   and [`Parent::poll_effect`] / [`Parent::poll_timeout`];
//! * `registry`: registrations before start, the startup snapshot, handles
//!   and their resolution, poisoned, uncertain and proven digests and their
//!   metadata;
//! * `operations`: registers and unregisters after start, task submission,
//!   the targets' replies, and how operations complete;
//! * `replacement`: target loss and death, replacements spawned, their join
//!   by replay (`specs/protocol.md` §2.9);
//! * `deadlines`: timeouts, alive reports, fencing, the poll bound.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

#[cfg(feature = "mutants")]
use super::Mutant;
use super::{ControlFrame, Failure, Namespace, OpId, OwnerToken, Seq, StagingId, TargetId, Time};
use crate::descriptor::{Digest, HashId};
use crate::error::{Error, ErrorCode, OperationKind};

/// Whether the mutant `$m` is switched on for `$self` (always `false`
/// without the `mutants` feature, so the deviation compiles away).
macro_rules! mutant {
    ($self:ident, $m:ident) => {{
        #[cfg(feature = "mutants")]
        let on = $self.mutant == Some(Mutant::$m);
        #[cfg(not(feature = "mutants"))]
        let on = false;
        on
    }};
}
pub(crate) use mutant;

mod deadlines;
mod inspect;
mod operations;
mod registry;
mod replacement;
mod tasks;
#[cfg(test)]
mod tests;

pub use deadlines::{BOUND_FENCE_CAUSE, NOT_READY_CAUSE, SILENT_FENCE_CAUSE};
pub(crate) use tasks::Stage;
pub use tasks::{TaskEnd, TaskInfo, NONE_COMING, UNREGISTERED_WHILE_WAITING};

/// How a [`Parent`] is set up. Every field is chosen by the embedder.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct ParentConfig {
    /// Number of targets; they are `TargetId(0)..TargetId(targets)`, all
    /// serving [`Namespace::LocalPython`], all started by [`Parent::start`].
    pub targets: u16,
    /// How long (microseconds) a target may stay silent about a register,
    /// an unregister or a cleanup it owes an answer: its silence deadline
    /// is the last time it was heard from about that control (the send,
    /// or its latest [`Parent::handle_alive`]) plus this
    /// (`specs/protocol.md`, "Deadlines").
    pub control_timeout: u64,
    /// How long (microseconds) an operation phase (the controls, or the
    /// cleanup) may take in all, counted from its send, however often the
    /// target says it is alive: the bound on a control that never finishes
    /// (`specs/protocol.md`, "Deadlines"). At least `control_timeout` to
    /// mean anything; a smaller value makes the bound the earlier deadline.
    pub operation_timeout: u64,
    /// At a passed deadline: `true` fences the silent target (the IO layer
    /// kills and reaps it; it becomes lost and nothing turns uncertain);
    /// `false` leaves it running and marks the digest uncertain
    /// (specs/design.md §4.1, for embedders that cannot fence).
    pub fence_on_timeout: bool,
    /// This Worker's random owner token, stamped on every handle it issues.
    pub owner: OwnerToken,
    /// Slots per target (specs/design.md §4.2; [`DEFAULT_SLOT_CAPACITY`] is the
    /// usual value). Every target installs the whole startup snapshot, one
    /// slot per distinct digest, so the snapshot holds at most this many.
    ///
    /// [`DEFAULT_SLOT_CAPACITY`]: super::DEFAULT_SLOT_CAPACITY
    pub slot_capacity: u16,
    /// Probe first (`specs/protocol.md` §2.8; the usual value is `true`): a
    /// register of a digest no target has installed since start goes to
    /// one target (the lowest live one) first, and to the others only once
    /// that target confirmed it, so a payload whose deserialization kills
    /// its target costs one target; such a digest is then refused
    /// (`REGISTER_POISONED`). `false`: every register goes to every live
    /// target at once.
    pub probe_first: bool,
    /// Replacement targets (`specs/protocol.md` §2.9; 0 switches them off,
    /// the usual value is [`DEFAULT_RESPAWN_LIMIT`]): a lost target
    /// is given a new process ([`Effect::Spawn`]), which joins the scope
    /// once it has confirmed every live registration. This many replacements
    /// of one target in a row may be lost before they join; after that the
    /// target stays lost ([`Effect::Abandoned`]).
    ///
    /// [`DEFAULT_RESPAWN_LIMIT`]: super::DEFAULT_RESPAWN_LIMIT
    #[serde(default)]
    pub respawn_limit: u16,
    /// The back-off (microseconds) before the second replacement in a row
    /// of one target; it doubles for each further one. The first replacement
    /// after a joined target is lost is asked for at once.
    #[serde(default)]
    pub respawn_backoff: u64,
    /// Replacements arrive on their own instead of being started by the
    /// embedder (`specs/protocol.md` §2.9, "Arrivals"; the usual value is
    /// `false`): an [`Effect::Spawn`] only opens the target for the next
    /// process that arrives, and the target waits for
    /// [`Parent::target_spawned`] as long as it takes, with no ready
    /// deadline. For an embedder whose processes join when they please,
    /// such as the workers of a cluster; `false` fences a replacement that
    /// is not ready within the control timeout.
    #[serde(default)]
    pub unbounded_spawn: bool,
    /// Retirement (`specs/protocol.md` §2.14; 0, the usual value, switches
    /// it off): at most this many tasks are sent to one process of a
    /// target. A target sent its last one stops taking tasks; once those
    /// tasks ended and it owes no answer to a control, it is retired
    /// ([`Effect::Retire`]) and replaced at once (§2.9), which costs no
    /// failed join. Takes effect only with replacements on
    /// ([`ParentConfig::respawn_limit`] > 0) and while they last
    /// ([`Parent::replacements_ended`] ends it: the processes then serve
    /// on).
    #[serde(default)]
    pub max_tasks_per_target: u32,
}

/// The parent's lifecycle (specs/design.md §4.1).
///
/// ```text
///   New ──start()──▶ Started ──close()──▶ Closed
///    └──────────────close()───────────────▲
/// ```
///
/// Text form (serde): `"new"`, `"started"`, `"closed"`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lifecycle {
    /// No target exists yet: registrations only touch the registry and
    /// the startup snapshot.
    New,
    /// Targets run: registrations are operations over a scope.
    Started,
    /// Closed: every call fails with `LIFECYCLE_INVALID`.
    Closed,
}

/// A registered callable as the user holds it: plain data, serializable,
/// checked field by field when it comes back (specs/design.md §4.1).
///
/// JSON form ([`Handle::to_json`], strict [`Handle::from_json`]; no other
/// field, and no slot, is part of it):
/// `{"namespace": "LOCAL_PYTHON", "hashid": "sha256:…", "handle_id": 1, "owner": 7}`
/// — `handle_id` and `owner` are unsigned 64-bit integers.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Handle {
    /// The namespace it was registered in.
    pub namespace: Namespace,
    /// The callable's hashid.
    pub hashid: HashId,
    /// Distinct for every successful register of this Worker, even of the
    /// same callable.
    pub handle_id: u64,
    /// The issuing Worker's owner token.
    pub owner: OwnerToken,
}

impl Handle {
    /// The callable's digest (the hashid's 32 bytes).
    pub fn digest(&self) -> Digest {
        self.hashid.digest()
    }
}

/// What one target did for a completed operation (reported in
/// [`Effect::Completed`], one per target in the operation's scope).
///
/// JSON form ([`TargetOutcome::to_json`], strict
/// [`TargetOutcome::from_json`]): `{"outcome": "ok"}`, or for the two
/// variants with a failure `{"outcome": "failed", "failure": {"code":
/// "DESERIALIZE_FAILED", "message": "…"}}`; the names are the variants'
/// in `snake_case`. With the target's id: [`super::TargetOutcomeEntry`].
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum TargetOutcome {
    /// Replied OK.
    Ok,
    /// Replied with an error; the target changed nothing.
    Failed {
        /// The target's reply.
        failure: Failure,
    },
    /// Lost (died or closed) before answering; it holds nothing.
    Lost,
    /// Its deadline passed without an answer and it was not fenced: its
    /// effect is unknown and the digest is uncertain.
    TimedOut,
    /// Its deadline passed and it was fenced (killed); it holds nothing.
    Fenced,
    /// Replied OK to a register that failed elsewhere, and its cleanup was
    /// confirmed (or it was lost before answering the cleanup).
    RolledBack,
    /// Replied OK to a register that failed elsewhere, and its cleanup was
    /// not confirmed (an error reply, or `DEADLINE_EXCEEDED` without
    /// fencing): the digest is uncertain.
    CleanupUnconfirmed {
        /// The cleanup's error reply or the passed deadline.
        failure: Failure,
    },
}

/// What a successful operation produced.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(tag = "completion", content = "handle", rename_all = "snake_case")]
pub enum Completion {
    /// A register published this new handle.
    Registered(Handle),
    /// An unregister dropped this handle at every target in scope.
    Unregistered(Handle),
}

/// An output of the [`Parent`], drained with [`Parent::poll_effect`] and
/// carried out in order.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(tag = "effect", rename_all = "snake_case")]
pub enum Effect {
    /// Put the envelope being registered (the one whose digest is `digest`)
    /// in shared memory as `staging`, before sending the frames that follow.
    /// If that fails, call [`Parent::stage_failed`] before polling again.
    Stage {
        /// The staged payload's id.
        staging: StagingId,
        /// The envelope's digest.
        digest: Digest,
    },
    /// Write `frame` to `target` (FIFO per target).
    Send {
        /// The receiving target.
        target: TargetId,
        /// The frame.
        frame: ControlFrame,
    },
    /// `target` may verify `staging` now (§2.8, `specs/staging.md` step 3):
    /// the payload of a register sent to its probe target only, which goes
    /// to `target` once the probe confirms. Sent for each other serving
    /// target right after the probe's register, while the payload is
    /// staged. A hint that decides nothing: the register that may follow
    /// is verified by its target all the same, and a driver may ignore it
    /// (the model does; the IO layer sends a verify control for a payload
    /// large enough to gain from it).
    Verify {
        /// The target that may verify the payload ahead of its register.
        target: TargetId,
        /// The staged payload's id.
        staging: StagingId,
        /// The envelope's digest (the register's).
        digest: Digest,
    },
    /// Unlink the staged payload: every target in scope has answered, been
    /// lost or timed out.
    ReleaseStaged {
        /// The staged payload's id.
        staging: StagingId,
    },
    /// Kill and reap `target`'s process, which retired (§2.14): it was
    /// sent its [`ParentConfig::max_tasks_per_target`] tasks, they ended,
    /// and it owes no answer. The parent already counts it lost (no task
    /// and no operation is affected) and asks for its replacement with the
    /// [`Effect::Spawn`] that follows; do not call [`Parent::target_lost`]
    /// for it.
    Retire {
        /// The target.
        target: TargetId,
        /// The incarnation that retired.
        incarnation: u32,
        /// The tasks it was sent.
        tasks: u32,
    },
    /// Kill and reap `target`: its deadline passed. The parent already
    /// counts it lost; do not call [`Parent::target_lost`] for it.
    Fence {
        /// The target to kill.
        target: TargetId,
        /// Why, as its lost tasks' [`TaskEnd::Lost`] gives it (e.g.
        /// [`SILENT_FENCE_CAUSE`], [`BOUND_FENCE_CAUSE`],
        /// [`NOT_READY_CAUSE`], `"seq 4 passed its deadline"`): what the
        /// IO layer reports of the loss.
        cause: String,
    },
    /// Put the kept envelope of `digest` (a live registration being
    /// replayed to a joining replacement, §2.9) in shared memory as
    /// `staging`, before sending the frame that follows. If that fails,
    /// call [`Parent::stage_failed`] before polling again.
    Restage {
        /// The staged payload's id.
        staging: StagingId,
        /// The envelope's digest.
        digest: Digest,
    },
    /// Start a new process for `target` (§2.9): it holds nothing,
    /// and is incarnation `incarnation` of the target (the original is 0).
    /// Then call [`Parent::target_spawned`], or [`Parent::target_died`] if
    /// it could not be started.
    Spawn {
        /// The target.
        target: TargetId,
        /// The new process's incarnation.
        incarnation: u32,
    },
    /// The replacement for `target` confirmed every live
    /// registration: it serves tasks from now on (§2.9).
    Joined {
        /// The target.
        target: TargetId,
        /// The replacement's incarnation.
        incarnation: u32,
    },
    /// The replacement for `target` refused a replayed registration
    /// (or did not answer it in time): it is fenced next, and replaced
    /// under the rate limit (§2.9).
    JoinFailed {
        /// The target.
        target: TargetId,
        /// The replacement's incarnation.
        incarnation: u32,
        /// Its answer, or the passed deadline.
        failure: Failure,
    },
    /// `target` stays lost for the Worker's life: `failed_joins`
    /// replacements in a row were lost before they joined (the rate limit,
    /// [`ParentConfig::respawn_limit`]).
    Abandoned {
        /// The target.
        target: TargetId,
        /// Replacements in a row lost before they joined.
        failed_joins: u16,
    },
    /// Ask `target` for its table under `seq` (§2.13); its answer goes to
    /// [`Parent::handle_table`].
    Inspect {
        /// The target to ask.
        target: TargetId,
        /// The inspection's seq.
        seq: Seq,
    },
    /// Inspection `seq` ended (§2.13): every target asked answered, except
    /// `missing` (lost, or silent for the control timeout), in target
    /// order.
    InspectDone {
        /// The inspection.
        seq: Seq,
        /// The targets whose table will not come.
        missing: Vec<TargetId>,
    },
    /// Task `seq` ended (`specs/protocol.md` §2.11), once: with a result
    /// (hand the result frame the IO layer holds to its caller), or with
    /// the error [`TaskEnd::error`] gives.
    TaskDone {
        /// The task.
        seq: Seq,
        /// Its target.
        target: TargetId,
        /// The incarnation of the target it was sent to.
        incarnation: u32,
        /// The callable it ran (or was to run).
        digest: Digest,
        /// How it ended.
        end: TaskEnd,
    },
    /// The target answered a cancel of task `seq` with `failure`
    /// (`TASK_RUNNING`: it had started or ended): the task runs to its end
    /// and its [`Effect::TaskDone`] follows.
    CancelRefused {
        /// The task.
        seq: Seq,
        /// The target's answer.
        failure: Failure,
    },
    /// An operation finished: every target in its scope answered, was lost
    /// or timed out, and any cleanup it needed has settled.
    Completed {
        /// The operation.
        op: OpId,
        /// The handle published or dropped, or the error:
        /// `REGISTER_PARTIAL_FAILURE`, `REGISTER_CLEANUP_UNCERTAIN` (the
        /// digest became uncertain while the register was in flight),
        /// `REGISTER_POISONED`, `UNREGISTER_PARTIAL_FAILURE`, `TARGET_LOST`
        /// (an unregister that lost a target while pending there: the
        /// handle is released all the same, `specs/protocol.md` §2.3) or
        /// `LIFECYCLE_INVALID` (closed).
        result: Result<Completion, Error>,
        /// Every target in the operation's scope with what it did, in
        /// target order.
        outcomes: Vec<(TargetId, TargetOutcome)>,
    },
}

/// A startup-snapshot registration that failed at start
/// ([`Parent::snapshot_failed`]): its handle is no longer live.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize)]
pub struct FailedRegistration {
    /// The handle that was issued before start.
    pub handle: Handle,
    /// Each target that could not install it, with its failure (code and
    /// message: for Python, the exception type and text), in target order.
    pub failures: Vec<(TargetId, Failure)>,
}

/// Why a digest is poisoned: the target its probe killed, and how that
/// target died (as the IO layer told [`Parent::target_died`]).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize)]
pub struct Poison {
    /// The target that was lost while it deserialized the digest.
    pub target: TargetId,
    /// How it died, e.g. `its reply socket closed; it exited with status 3`.
    pub cause: String,
}

/// Where a target stands once replacement targets are on (§2.9); see
/// [`Parent::target_phase`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize)]
#[serde(rename_all = "snake_case", tag = "phase", content = "until")]
pub enum TargetPhase {
    /// Its process serves: the original, or a replacement that joined.
    Joined,
    /// Waiting until this time before asking for the next replacement.
    BackingOff(Time),
    /// [`Effect::Spawn`] was emitted; waiting for [`Parent::target_spawned`].
    Spawning,
    /// Spawned, replaying the live registrations: in the scope of nothing
    /// but its replays and the unregisters of what they installed, and
    /// refused for tasks.
    Joining,
    /// Lost for good (no replacement, or the rate limit stopped them).
    Lost,
}

/// Why a target's holding of an uncertain digest is in doubt, and what
/// settles it (§2.4, "Uncertainty heals").
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub(crate) enum Doubt {
    /// Its answer to this register control is unknown (it timed out): an
    /// OK means it holds one reference more than the registry says, which
    /// a heal unregister takes back; an error means it installed nothing.
    Register(Seq),
    /// Its answer to this unregister control (an unregister, a cleanup or
    /// a heal) is unknown: an OK means it agrees with the registry again.
    Unregister(Seq),
    /// It answered in a way that shows it disagrees with the registry (it
    /// refused an unregister or a cleanup, named another digest, or
    /// answered a control twice): only its loss settles that.
    Disagrees,
}

/// A target's replacement state.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct TargetRecord {
    /// The incarnation of its current (or next) process; the original is 0.
    pub(crate) incarnation: u32,
    /// Replacements in a row lost before they joined.
    pub(crate) failed_joins: u16,
    pub(crate) phase: TargetPhase,
    /// While [`TargetPhase::Spawning`]: when the replacement asked for must
    /// have reported ready (the [`Effect::Spawn`] plus the control
    /// timeout, §2.9); past it, it is fenced and counts as lost before it
    /// joined.
    pub(crate) ready_by: Time,
    /// The next seq to issue when its current process was started
    /// ([`Parent::target_spawned`]; 0 before any replacement): every
    /// control that process is sent has this seq or a later one, and every
    /// control sent to an earlier process of the target an earlier one (one
    /// seq counter, and nothing goes to a lost slot), so a reply to an
    /// earlier seq comes from a process of the target that is gone.
    pub(crate) first_seq: Seq,
}

/// A live handle's record in the registry.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct HandleRecord {
    pub(crate) digest: Digest,
    pub(crate) namespace: Namespace,
    /// The register's scope (every target, for a pre-start register once
    /// started; empty before start).
    pub(crate) scope: BTreeSet<TargetId>,
    /// The targets that had replied OK when the handle was published.
    pub(crate) confirmed: BTreeSet<TargetId>,
}

/// Where one target stands in one operation.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) enum Progress {
    /// The control was sent; no answer yet.
    Pending,
    /// Replied OK.
    Confirmed,
    /// Replied with an error.
    Failed(Failure),
    /// Lost before answering.
    Lost,
    /// Deadline passed, not fenced.
    TimedOut,
    /// Deadline passed, fenced.
    Fenced,
    /// Confirmed a register that is being rolled back; cleanup sent.
    CleanupPending,
    /// Cleanup confirmed (or lost during cleanup).
    RolledBack,
    /// Cleanup not confirmed.
    CleanupUnconfirmed(Failure),
}

impl Progress {
    fn outcome(&self) -> TargetOutcome {
        match self {
            Progress::Confirmed => TargetOutcome::Ok,
            Progress::Failed(f) => TargetOutcome::Failed { failure: f.clone() },
            // Completion waits for every answer; a pending target can only
            // reach an outcome through a mutant (early publish) or close.
            Progress::Pending | Progress::Lost => TargetOutcome::Lost,
            Progress::TimedOut => TargetOutcome::TimedOut,
            Progress::Fenced => TargetOutcome::Fenced,
            Progress::CleanupPending | Progress::RolledBack => TargetOutcome::RolledBack,
            Progress::CleanupUnconfirmed(f) => {
                TargetOutcome::CleanupUnconfirmed { failure: f.clone() }
            }
        }
    }
}

/// What an operation is.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) enum OpKind {
    /// A post-start register: the unpublished entry.
    Register {
        /// While the register is in its probe phase (§2.8): the one target
        /// it was sent to; the others get it once that target confirmed.
        probe: Option<TargetId>,
        /// The staged payload, until released.
        staging: Option<StagingId>,
        /// Once rolling back: the cleanup's seq and its bound (send time
        /// plus the operation timeout).
        cleanup: Option<(Seq, Time)>,
    },
    /// A post-start unregister of `handle` (already out of the registry).
    Unregister { handle: Handle },
    /// The replay of live handle `handle_id` to a joining replacement
    /// (§2.9): its scope is that target alone; no caller waits for it.
    Replay {
        /// The replayed handle.
        handle_id: u64,
        /// The staged payload, until released.
        staging: Option<StagingId>,
        /// The seq of an unregister of the handle issued before this
        /// replay was answered: its frame to the target waits for the
        /// replay's confirmation (until then the target may still be
        /// installing the payload, and would refuse it).
        unregister: Option<Seq>,
    },
}

/// One operation in flight.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct Op {
    pub(crate) kind: OpKind,
    pub(crate) digest: Digest,
    pub(crate) namespace: Namespace,
    pub(crate) seq: Seq,
    /// The bound of the controls phase: send time plus the operation
    /// timeout.
    pub(crate) deadline: Time,
    /// When each target in scope was last heard from about the control it
    /// owes (the phase's send time, then its latest alive report).
    pub(crate) heard: BTreeMap<TargetId, Time>,
    /// The targets whose latest alive report about the control they owe
    /// in this phase said it was running (its install had begun, §2.8);
    /// a target leaves it at a report saying queued and when it is sent
    /// another control of the operation (its cleanup).
    pub(crate) running: BTreeSet<TargetId>,
    /// The scope (live targets at the start) and where each stands.
    pub(crate) scope: BTreeMap<TargetId, Progress>,
}

impl Op {
    /// The bound of the phase the operation is in.
    fn phase_bound(&self) -> Time {
        match self.kind {
            OpKind::Register {
                cleanup: Some((_, deadline)),
                ..
            } => deadline,
            _ => self.deadline,
        }
    }

    /// The deadline of `target` if the operation waits for it: the earlier
    /// of its silence deadline (last heard plus `control_timeout`) and the
    /// phase's bound.
    fn target_deadline(&self, target: TargetId, control_timeout: u64) -> Option<Time> {
        match self.scope.get(&target) {
            Some(Progress::Pending | Progress::CleanupPending) => {}
            _ => return None,
        }
        let heard = self.heard.get(&target).copied().unwrap_or(Time(0));
        Some(
            heard
                .saturating_add_micros(control_timeout)
                .min(self.phase_bound()),
        )
    }

    /// The targets this operation waits for, each with its deadline.
    fn deadlines(&self, control_timeout: u64) -> impl Iterator<Item = (TargetId, Time)> + '_ {
        self.scope
            .keys()
            .filter_map(move |t| Some((*t, self.target_deadline(*t, control_timeout)?)))
    }

    fn waiting(&self) -> bool {
        self.scope
            .values()
            .any(|p| matches!(p, Progress::Pending | Progress::CleanupPending))
    }

    fn operation_kind(&self) -> OperationKind {
        match self.kind {
            OpKind::Register { .. } | OpKind::Replay { .. } => OperationKind::Register,
            OpKind::Unregister { .. } => OperationKind::Unregister,
        }
    }

    fn outcomes(&self) -> Vec<(TargetId, TargetOutcome)> {
        self.scope.iter().map(|(t, p)| (*t, p.outcome())).collect()
    }
}

/// The parent state machine (specs/design.md §4.1): the registry of handles, the
/// startup snapshot, and the register and unregister operations in flight.
///
/// Pure: see the module documentation for the driving rule. The state is
/// small (`BTreeMap`s of ids and digests) and `Clone + Eq + Hash`, so a
/// model checker can explore it.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Parent {
    pub(crate) config: ParentConfig,
    pub(crate) lifecycle: Lifecycle,
    /// Targets declared lost or fenced; they never come back.
    pub(crate) lost: BTreeSet<TargetId>,
    /// The next seq to issue (also names operations and staged payloads).
    pub(crate) next_seq: u64,
    /// The next handle id to issue; every id below it was issued.
    pub(crate) next_handle_id: u64,
    /// Live (published) handles by handle id.
    pub(crate) handles: BTreeMap<u64, HandleRecord>,
    /// Operations in flight.
    pub(crate) ops: BTreeMap<OpId, Op>,
    /// Uncertain digests, each with the ids of the handles that were live
    /// when it became uncertain (invariant 3).
    pub(crate) uncertain: BTreeMap<Digest, BTreeSet<u64>>,
    /// Why each uncertain digest is uncertain: every target whose holding
    /// of it is in doubt, with what would settle it (§2.4, "Uncertainty
    /// heals"). A digest is uncertain exactly while it has a doubt.
    pub(crate) doubts: BTreeMap<Digest, BTreeSet<(TargetId, Doubt)>>,
    /// Staged payloads not yet released.
    pub(crate) staged: BTreeSet<StagingId>,
    /// Digests some target installed since start (a startup-snapshot
    /// digest, or one a target confirmed a register of): a register of any
    /// other digest probes first (§2.8).
    pub(crate) proven: BTreeSet<Digest>,
    /// Digests whose install killed the target that probed them, each with
    /// that target and how it died: refused for the Worker's life.
    pub(crate) poisoned: BTreeMap<Digest, Poison>,
    /// The metadata identity of each held digest registered with metadata
    /// (`register_with_metadata`; a digest held without metadata has no
    /// entry). Stale once the digest is no longer held.
    pub(crate) metadata: BTreeMap<Digest, Digest>,
    /// The replacement state of every target that was lost once while
    /// replacements are on (§2.9); a target without a record is its original
    /// process, joined unless lost.
    pub(crate) target_records: BTreeMap<TargetId, TargetRecord>,
    /// No replacement can be started any more (the template process is
    /// gone, §2.9): a target lost from now on is abandoned at once.
    pub(crate) replacements_ended: bool,
    /// Tasks in flight, by seq (`specs/protocol.md` §2.11), sent or
    /// waiting for their target (§2.14).
    pub(crate) tasks: BTreeMap<Seq, tasks::TaskRecord>,
    /// The tasks sent to each target's current process (§2.14); none
    /// for a target without an entry.
    pub(crate) served: BTreeMap<TargetId, u32>,
    /// The tasks in flight naming each target, by target index: sent to
    /// it, and waiting for it (§2.14); kept in step with `tasks`
    /// (invariant 13) so that placing a task reads no task.
    pub(crate) loads: Vec<tasks::TargetLoad>,
    /// Cancels sent and not yet answered, by target and task seq.
    pub(crate) cancels: BTreeMap<(TargetId, Seq), tasks::PendingCancel>,
    /// Inspections in flight, by seq (§2.13).
    pub(crate) inspections: BTreeMap<Seq, inspect::Inspection>,
    pub(crate) effects: VecDeque<Effect>,
    #[cfg(feature = "mutants")]
    pub(crate) mutant: Option<Mutant>,
}

impl Parent {
    /// A parent in [`Lifecycle::New`] with an empty registry.
    pub fn new(config: ParentConfig) -> Parent {
        let loads = vec![tasks::TargetLoad::default(); usize::from(config.targets)];
        Parent {
            config,
            lifecycle: Lifecycle::New,
            lost: BTreeSet::new(),
            next_seq: 1,
            next_handle_id: 1,
            handles: BTreeMap::new(),
            ops: BTreeMap::new(),
            uncertain: BTreeMap::new(),
            doubts: BTreeMap::new(),
            staged: BTreeSet::new(),
            proven: BTreeSet::new(),
            poisoned: BTreeMap::new(),
            metadata: BTreeMap::new(),
            target_records: BTreeMap::new(),
            replacements_ended: false,
            tasks: BTreeMap::new(),
            served: BTreeMap::new(),
            loads,
            cancels: BTreeMap::new(),
            inspections: BTreeMap::new(),
            effects: VecDeque::new(),
            #[cfg(feature = "mutants")]
            mutant: None,
        }
    }

    /// Switches on one known bug (model mutation tests only).
    #[cfg(feature = "mutants")]
    pub fn with_mutant(mut self, mutant: Mutant) -> Parent {
        self.mutant = Some(mutant);
        self
    }

    /// The configuration.
    pub fn config(&self) -> &ParentConfig {
        &self.config
    }

    /// The lifecycle state.
    pub fn lifecycle(&self) -> Lifecycle {
        self.lifecycle
    }

    fn all_targets(&self) -> impl Iterator<Item = TargetId> {
        (0..self.config.targets).map(TargetId)
    }

    pub(crate) fn lifecycle_error(&self, operation: OperationKind, wanted: &str) -> Error {
        Error::new(
            ErrorCode::LIFECYCLE_INVALID,
            operation,
            format!(
                "{operation} needs a {wanted} Worker; this one is {:?}",
                self.lifecycle
            ),
        )
    }

    fn check_namespace(namespace: Namespace, digest: Digest) -> Result<(), Error> {
        if namespace == Namespace::LocalPython {
            return Ok(());
        }
        Err(Error::new(
            ErrorCode::CALLABLE_KIND_UNSUPPORTED,
            OperationKind::Register,
            format!("no target of this Worker serves namespace {namespace}"),
        )
        .with_namespace(namespace)
        .with_digest(digest))
    }

    fn issue_handle(&mut self, digest: Digest, namespace: Namespace) -> Handle {
        let handle_id = self.next_handle_id;
        self.next_handle_id += 1;
        Handle {
            namespace,
            hashid: digest.hashid(),
            handle_id,
            owner: self.config.owner,
        }
    }

    pub(crate) fn fresh_seq(&mut self) -> Seq {
        let seq = Seq(self.next_seq);
        self.next_seq += 1;
        seq
    }

    /// Closes the Worker: every operation in flight completes with
    /// `LIFECYCLE_INVALID` (targets still pending count as lost), every
    /// staged payload is released. Later calls fail with
    /// `LIFECYCLE_INVALID`; replies and losses are ignored.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` if already closed.
    pub fn close(&mut self) -> Result<(), Error> {
        if self.lifecycle == Lifecycle::Closed {
            return Err(self.lifecycle_error(OperationKind::Close, "new or started"));
        }
        self.lifecycle = Lifecycle::Closed;
        self.close_tasks();
        self.close_inspections();
        for (id, op) in std::mem::take(&mut self.ops) {
            if let OpKind::Register {
                staging: Some(staging),
                ..
            }
            | OpKind::Replay {
                staging: Some(staging),
                ..
            } = op.kind
            {
                self.staged.remove(&staging);
                self.effects.push_back(Effect::ReleaseStaged { staging });
            }
            if matches!(op.kind, OpKind::Replay { .. }) {
                // No caller waits for a replay.
                continue;
            }
            let error = Error::new(
                ErrorCode::LIFECYCLE_INVALID,
                op.operation_kind(),
                "the Worker closed before the operation completed",
            )
            .with_namespace(op.namespace)
            .with_digest(op.digest)
            .with_seq(op.seq);
            self.effects.push_back(Effect::Completed {
                op: id,
                result: Err(error),
                outcomes: op.outcomes(),
            });
        }
        Ok(())
    }

    /// The next effect to carry out, oldest first; `None` when drained.
    pub fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// The earliest deadline of a target some operation still waits for
    /// (the earlier of its silence deadline and the phase's bound, see
    /// [`Parent::handle_timeout`]) or of a replacement's back-off, if any:
    /// call
    /// [`Parent::handle_timeout`] once it has passed.
    pub fn poll_timeout(&self) -> Option<Time> {
        let respawns = self.target_records.values().filter_map(|r| match r.phase {
            TargetPhase::BackingOff(until) if self.lifecycle == Lifecycle::Started => Some(until),
            TargetPhase::Spawning
                if self.lifecycle == Lifecycle::Started && !self.config.unbounded_spawn =>
            {
                Some(r.ready_by)
            }
            _ => None,
        });
        self.ops
            .values()
            .flat_map(|op| op.deadlines(self.config.control_timeout))
            .map(|(_, deadline)| deadline)
            .chain(respawns)
            .chain(self.task_timeout())
            .chain(self.inspection_timeout())
            .min()
    }

    /// Whether `target`'s process is live (started and not lost): one that
    /// serves, or a replacement still joining (§2.9).
    pub fn is_target_live(&self, target: TargetId) -> bool {
        self.lifecycle == Lifecycle::Started
            && target.0 < self.config.targets
            && !self.lost.contains(&target)
    }

    /// Whether `target` serves: live and joined, so in the scope of new
    /// operations and open to tasks (§2.9) unless it is retiring
    /// ([`Parent::takes_tasks`], §2.14).
    pub fn is_target_joined(&self, target: TargetId) -> bool {
        self.is_target_live(target) && !self.is_joining(target)
    }

    fn is_joining(&self, target: TargetId) -> bool {
        self.target_phase(target) == TargetPhase::Joining
    }

    fn serves(&self, target: TargetId) -> bool {
        !self.lost.contains(&target) && !self.is_joining(target)
    }

    /// Where `target` stands (§2.9): [`TargetPhase::Joined`] or
    /// [`TargetPhase::Lost`] for a target never replaced (whatever the
    /// lifecycle), else its replacement's phase.
    pub fn target_phase(&self, target: TargetId) -> TargetPhase {
        match self.target_records.get(&target) {
            Some(record) => record.phase,
            None if self.lost.contains(&target) => TargetPhase::Lost,
            None => TargetPhase::Joined,
        }
    }

    /// The incarnation of `target`'s current (or next) process: 0 for the
    /// original, one more for each replacement asked for (§2.9).
    pub fn incarnation(&self, target: TargetId) -> u32 {
        self.target_records
            .get(&target)
            .map_or(0, |r| r.incarnation)
    }

    /// Whether replacements ended ([`Parent::replacements_ended`]).
    pub fn are_replacements_ended(&self) -> bool {
        self.replacements_ended
    }

    /// Replacements of `target` in a row that were lost before they
    /// joined (§2.9; reset when one joins).
    pub fn failed_joins(&self, target: TargetId) -> u16 {
        self.target_records
            .get(&target)
            .map_or(0, |r| r.failed_joins)
    }

    /// The operations in flight, in start order.
    pub fn in_flight(&self) -> Vec<OpId> {
        self.ops.keys().copied().collect()
    }

    /// Staged payloads not yet released, in id order.
    pub fn staged(&self) -> Vec<StagingId> {
        self.staged.iter().copied().collect()
    }

    /// Whether no operation is in flight, no effect waits to be polled,
    /// no replacement is being asked for (backing off or spawning), no
    /// task is in flight (nor a cancel of one unanswered) and no
    /// inspection waits.
    pub fn is_idle(&self) -> bool {
        self.ops.is_empty()
            && self.tasks.is_empty()
            && self.cancels.is_empty()
            && self.inspections.is_empty()
            && self.effects.is_empty()
            && !self.target_records.values().any(|r| {
                self.lifecycle == Lifecycle::Started
                    && matches!(r.phase, TargetPhase::BackingOff(_) | TargetPhase::Spawning)
            })
    }

    /// Whether a doubt about an uncertain digest awaits `target`'s answer
    /// to `seq`: a control it timed out on, or a heal unregister (§2.4,
    /// "Uncertainty heals"). Its reply is late all the same
    /// ([`Parent::awaits_reply`] is `false`), and settles that doubt.
    pub fn awaits_heal(&self, target: TargetId, seq: Seq) -> bool {
        self.doubt_awaits(target, seq)
    }

    /// Whether any doubt awaits a reply ([`Parent::awaits_heal`] for some
    /// target and seq): an IO layer keeps reading the targets' replies
    /// while it is `true`, even with nothing in flight, so that a late
    /// answer heals its digest as soon as it comes (§2.4).
    pub fn awaits_heals(&self) -> bool {
        self.doubts
            .values()
            .flatten()
            .any(|(_, d)| matches!(d, Doubt::Register(_) | Doubt::Unregister(_)))
    }

    /// Whether an operation in flight still waits for `target`'s answer to
    /// `seq` (a register, unregister or cleanup control). A reply for which
    /// this is `false` is late or duplicate: [`Parent::handle_reply`] then
    /// settles the doubt that awaits it ([`Parent::awaits_heal`]) or marks
    /// its digest uncertain (unless it comes from a lost target or from an
    /// earlier process of the target). The model checker uses it to
    /// name late replies in its traces; an IO layer may use it to log them.
    pub fn awaits_reply(&self, target: TargetId, seq: Seq) -> bool {
        self.ops.values().any(|op| match op.scope.get(&target) {
            Some(Progress::Pending) => op.seq == seq,
            Some(Progress::CleanupPending) => matches!(
                op.kind,
                OpKind::Register { cleanup: Some((cleanup, _)), .. } if cleanup == seq
            ),
            _ => false,
        })
    }

    /// Every control an operation awaits from `target` (a register,
    /// unregister or cleanup seq) with its phase's bound (send time plus
    /// `operation_timeout`), in seq order. The model checker uses it to
    /// check that a target heard from is fenced only at a bound.
    pub fn awaited_controls(&self, target: TargetId) -> Vec<(Seq, Time)> {
        let mut awaited: Vec<(Seq, Time)> = self
            .ops
            .values()
            .filter_map(|op| match (op.scope.get(&target), &op.kind) {
                (Some(Progress::Pending), _) => Some((op.seq, op.phase_bound())),
                (
                    Some(Progress::CleanupPending),
                    OpKind::Register {
                        cleanup: Some((seq, bound)),
                        ..
                    },
                ) => Some((*seq, *bound)),
                _ => None,
            })
            .collect();
        awaited.sort();
        awaited
    }

    /// A copy of this parent with every target id `t` renamed
    /// `permutation[t]` (in the lost set, the scopes and confirmations of
    /// handles and operations, and undrained effects); ids without an entry
    /// keep their value. `permutation` must be a permutation of
    /// `0..targets` for the copy to be a parent this one could have been.
    ///
    /// Targets are interchangeable in the protocol (no decision depends on
    /// a target's id, only messages name it), so the model checker uses
    /// this for symmetry reduction. Messages already written (failures in
    /// replies) keep the id they name.
    pub fn relabel_targets(&self, permutation: &[TargetId]) -> Parent {
        let map = |t: &TargetId| permutation.get(usize::from(t.0)).copied().unwrap_or(*t);
        let mut copy = self.clone();
        copy.lost = self.lost.iter().map(map).collect();
        for record in copy.handles.values_mut() {
            record.scope = record.scope.iter().map(map).collect();
            record.confirmed = record.confirmed.iter().map(map).collect();
        }
        for poison in copy.poisoned.values_mut() {
            poison.target = map(&poison.target);
        }
        copy.target_records = std::mem::take(&mut copy.target_records)
            .into_iter()
            .map(|(t, r)| (map(&t), r))
            .collect();
        for op in copy.ops.values_mut() {
            if let OpKind::Register {
                probe: Some(probe), ..
            } = &mut op.kind
            {
                *probe = map(probe);
            }
            op.scope = std::mem::take(&mut op.scope)
                .into_iter()
                .map(|(t, p)| (map(&t), p))
                .collect();
            op.heard = std::mem::take(&mut op.heard)
                .into_iter()
                .map(|(t, h)| (map(&t), h))
                .collect();
            op.running = op.running.iter().map(map).collect();
        }
        copy.tasks = std::mem::take(&mut copy.tasks)
            .into_iter()
            .map(|(seq, mut task)| {
                task.target = map(&task.target);
                (seq, task)
            })
            .collect();
        for inspection in copy.inspections.values_mut() {
            inspection.waiting = inspection.waiting.iter().map(map).collect();
            inspection.missing = inspection.missing.iter().map(map).collect();
        }
        for (target, load) in self.all_targets().zip(&self.loads) {
            if let Some(slot) = copy.loads.get_mut(usize::from(map(&target).0)) {
                *slot = *load;
            }
        }
        copy.served = std::mem::take(&mut copy.served)
            .into_iter()
            .map(|(t, n)| (map(&t), n))
            .collect();
        copy.cancels = std::mem::take(&mut copy.cancels)
            .into_iter()
            .map(|((t, seq), c)| ((map(&t), seq), c))
            .collect();
        for effect in copy.effects.iter_mut() {
            match effect {
                Effect::Send { target, .. }
                | Effect::Verify { target, .. }
                | Effect::TaskDone { target, .. }
                | Effect::Inspect { target, .. }
                | Effect::Fence { target, .. }
                | Effect::Retire { target, .. }
                | Effect::Spawn { target, .. }
                | Effect::Joined { target, .. }
                | Effect::JoinFailed { target, .. }
                | Effect::Abandoned { target, .. } => *target = map(target),
                Effect::Completed { outcomes, .. } => {
                    for (target, _) in outcomes.iter_mut() {
                        *target = map(target);
                    }
                    outcomes.sort();
                }
                Effect::Stage { .. }
                | Effect::Restage { .. }
                | Effect::ReleaseStaged { .. }
                | Effect::CancelRefused { .. } => {}
                Effect::InspectDone { missing, .. } => {
                    for target in missing.iter_mut() {
                        *target = map(target);
                    }
                    missing.sort();
                }
            }
        }
        copy
    }
}
