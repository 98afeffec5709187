//! The parent state machine: registry, operations, scopes (specs/design.md §4.1).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

#[cfg(feature = "mutants")]
use super::Mutant;
use super::{
    ControlFrame, Failure, Namespace, OpId, OwnerToken, Reply, Seq, StagingId, TargetId, Time,
};
use crate::descriptor::{Digest, HashId};
use crate::error::{Error, ErrorCode, OperationKind};

use super::tasks::TaskEnd;

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
    /// the usual value is [`DEFAULT_RESPAWN_LIMIT`]): a lost target's slot
    /// is given a new process ([`Effect::Spawn`]), which joins the scope
    /// once it has confirmed every live registration. This many replacements
    /// of one slot in a row may be lost before they join; after that the
    /// slot stays lost ([`Effect::Abandoned`]).
    ///
    /// [`DEFAULT_RESPAWN_LIMIT`]: super::DEFAULT_RESPAWN_LIMIT
    #[serde(default)]
    pub respawn_limit: u16,
    /// The back-off (microseconds) before the second replacement in a row
    /// of one slot; it doubles for each further one. The first replacement
    /// after a joined target is lost is asked for at once.
    #[serde(default)]
    pub respawn_backoff: u64,
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
    /// Unlink the staged payload: every target in scope has answered, been
    /// lost or timed out.
    ReleaseStaged {
        /// The staged payload's id.
        staging: StagingId,
    },
    /// Kill and reap `target`: its deadline passed. The parent already
    /// counts it lost; do not call [`Parent::target_lost`] for it.
    Fence {
        /// The target to kill.
        target: TargetId,
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
    /// Start a new process for `target`'s slot (§2.9): it holds nothing,
    /// and is incarnation `incarnation` of the slot (the original is 0).
    /// Then call [`Parent::target_spawned`], or [`Parent::target_died`] if
    /// it could not be started.
    Spawn {
        /// The slot.
        target: TargetId,
        /// The new process's incarnation.
        incarnation: u32,
    },
    /// The replacement in `target`'s slot confirmed every live
    /// registration: it serves tasks from now on (§2.9).
    Joined {
        /// The slot.
        target: TargetId,
        /// The replacement's incarnation.
        incarnation: u32,
    },
    /// The replacement in `target`'s slot refused a replayed registration
    /// (or did not answer it in time): it is fenced next, and replaced
    /// under the rate limit (§2.9).
    JoinFailed {
        /// The slot.
        target: TargetId,
        /// The replacement's incarnation.
        incarnation: u32,
        /// Its answer, or the passed deadline.
        failure: Failure,
    },
    /// `target`'s slot stays lost for the Worker's life: `failed_joins`
    /// replacements in a row were lost before they joined (the rate limit,
    /// [`ParentConfig::respawn_limit`]).
    Abandoned {
        /// The slot.
        target: TargetId,
        /// Replacements in a row lost before they joined.
        failed_joins: u16,
    },
    /// Task `seq` ended (`specs/protocol.md` §2.11), once: with a result
    /// (hand the result frame the IO layer holds to its caller), or with
    /// the error [`TaskEnd::error`] gives.
    TaskDone {
        /// The task.
        seq: Seq,
        /// Its target.
        target: TargetId,
        /// The incarnation of the target's slot it was sent to.
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
        /// `UNREGISTER_PARTIAL_FAILURE` or `LIFECYCLE_INVALID` (closed).
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

/// Where a slot stands once replacement targets are on (§2.9); see
/// [`Parent::slot_phase`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize)]
#[serde(rename_all = "snake_case", tag = "phase", content = "until")]
pub enum SlotPhase {
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

/// A slot's replacement state.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct SlotRecord {
    /// The incarnation of its current (or next) process; the original is 0.
    pub(crate) incarnation: u32,
    /// Replacements in a row lost before they joined.
    pub(crate) failed_joins: u16,
    pub(crate) phase: SlotPhase,
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
    /// The replacement state of every slot that was lost once while
    /// replacements are on (§2.9); a slot without a record is its original
    /// process, joined unless lost.
    pub(crate) slots: BTreeMap<TargetId, SlotRecord>,
    /// Tasks in flight, by seq (`specs/protocol.md` §2.11).
    pub(crate) tasks: BTreeMap<Seq, super::tasks::TaskRecord>,
    /// Cancels sent and not yet answered, by target and task seq.
    pub(crate) cancels: BTreeMap<(TargetId, Seq), super::tasks::PendingCancel>,
    pub(crate) effects: VecDeque<Effect>,
    #[cfg(feature = "mutants")]
    pub(crate) mutant: Option<Mutant>,
}

impl Parent {
    /// A parent in [`Lifecycle::New`] with an empty registry.
    pub fn new(config: ParentConfig) -> Parent {
        Parent {
            config,
            lifecycle: Lifecycle::New,
            lost: BTreeSet::new(),
            next_seq: 1,
            next_handle_id: 1,
            handles: BTreeMap::new(),
            ops: BTreeMap::new(),
            uncertain: BTreeMap::new(),
            staged: BTreeSet::new(),
            proven: BTreeSet::new(),
            poisoned: BTreeMap::new(),
            metadata: BTreeMap::new(),
            slots: BTreeMap::new(),
            tasks: BTreeMap::new(),
            cancels: BTreeMap::new(),
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
    fn holds(&self, digest: Digest) -> bool {
        self.handles.values().any(|r| r.digest == digest)
            || self
                .ops
                .values()
                .any(|op| op.digest == digest && matches!(op.kind, OpKind::Register { .. }))
    }

    /// `METADATA_CONFLICT` when `digest` is held with another metadata
    /// identity than `metadata` (§2.10).
    fn check_metadata(
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
    fn hold_metadata(&mut self, digest: Digest, metadata: Option<Digest>) {
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
    /// use callreg::protocol::{Effect, Namespace, OwnerToken, Parent, ParentConfig, TargetId, Time};
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
    /// parent.handle_alive(TargetId(0), callreg::protocol::Seq(1), Time(900_000)).unwrap();
    /// parent.handle_timeout(Time(1_000_000));
    /// assert_eq!(parent.poll_effect(), Some(Effect::Fence { target: TargetId(1) }));
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
                format!("{digest} is uncertain: a cleanup of it was never confirmed, so no target's refcount for it can be trusted"),
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
            let message = if self.all_targets().any(|t| self.is_joining(t)) {
                "every target is lost or a replacement that has not joined yet"
            } else {
                "every target is lost"
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
    fn begin_unregister(&mut self, handle: Handle, record: &HandleRecord, now: Time) -> OpId {
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
                scope,
            },
        );
        self.advance(id, now);
        id
    }

    fn stale(&self, handle: &Handle, operation: OperationKind) -> Error {
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

    fn resolve_for(
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
                format!("{digest} is uncertain: a cleanup of it was never confirmed"),
            ));
        }
        Ok(digest)
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

    fn check_target(&self, target: TargetId, operation: OperationKind) -> Result<(), Error> {
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
    /// from a lost target and replies after close are ignored.
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
        if self.cancel_answered(target, &reply) {
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
            // Late or duplicate: the operation already gave up on this target.
            self.mark_uncertain(reply.digest);
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
            self.mark_uncertain(digest);
        }
        if proven {
            self.proven.insert(digest);
        }
        self.advance(id, now);
        Ok(())
    }

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

    /// The digest `target` was deserializing for a probe, if any (§2.8):
    /// the probe of a digest not yet proven is the oldest control still
    /// pending at that target (controls are applied in the order sent, and
    /// a probe is sent when issued, so no control pending there was sent
    /// before it).
    fn probing_at(&self, target: TargetId) -> Option<Digest> {
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
            } if probe == target && !self.proven.contains(&oldest.digest) => Some(oldest.digest),
            _ => None,
        }
    }

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

    /// `target` is lost (`as_progress`: `Lost` or `Fenced`), `cause` saying
    /// how. `evidence`: whether the loss counts against the digest it was
    /// probing, if any (§2.8: a death, or a bound passed while it reported
    /// alive; never silence), which is then poisoned.
    fn lose(
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
            if self.slot_phase(target) == SlotPhase::Spawning {
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
        self.tasks_lost(target, cause);
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
    }

    /// After `target`'s process was lost (§2.9): with replacements on, ask
    /// for the next one at once (the lost process had joined), after the
    /// back-off (it had not), or give the slot up (the rate limit).
    fn after_loss(&mut self, target: TargetId, now: Time) {
        let limit = self.config.respawn_limit;
        if limit == 0 || self.lifecycle != Lifecycle::Started {
            return;
        }
        let record = self.slots.entry(target).or_insert(SlotRecord {
            incarnation: 0,
            failed_joins: 0,
            phase: SlotPhase::Joined,
        });
        record.failed_joins = match record.phase {
            SlotPhase::Joined => 0,
            _ => record.failed_joins.saturating_add(1),
        };
        let failed_joins = record.failed_joins;
        if failed_joins >= limit {
            record.phase = SlotPhase::Lost;
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
            self.spawn(target);
        } else {
            record.phase = SlotPhase::BackingOff(now.saturating_add_micros(delay));
        }
    }

    fn spawn(&mut self, target: TargetId) {
        let Some(record) = self.slots.get_mut(&target) else {
            return;
        };
        record.incarnation = record.incarnation.saturating_add(1);
        record.phase = SlotPhase::Spawning;
        self.effects.push_back(Effect::Spawn {
            target,
            incarnation: record.incarnation,
        });
    }

    /// The process asked for by [`Effect::Spawn`] for `target`'s slot runs
    /// and holds nothing (§2.9): it is `incarnation` of the slot, and it
    /// joins. Every live handle whose digest is not uncertain is replayed
    /// to it, in handle order ([`Effect::Restage`], then a
    /// [`ControlFrame::Register`] to it alone), and so is every handle
    /// published while it joins. It serves tasks ([`Effect::Joined`]) once
    /// every replay sent to it is confirmed and no register is in flight
    /// (a register in flight does not include it, and is replayed to it if
    /// published; a confirmation the slot's earlier process gave it counts
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
    /// of range, or a slot that is not waiting for incarnation
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
            .slots
            .get(&target)
            .is_some_and(|r| r.phase == SlotPhase::Spawning && r.incarnation == incarnation);
        if !waiting {
            return Err(Error::new(
                ErrorCode::FRAME_INVALID,
                OperationKind::Start,
                format!("{target} is not waiting for incarnation {incarnation}"),
            )
            .with_target(target));
        }
        self.lost.remove(&target);
        if let Some(record) = self.slots.get_mut(&target) {
            record.phase = SlotPhase::Joining;
        }
        // What the slot's earlier processes confirmed died with them.
        for record in self.handles.values_mut() {
            record.scope.remove(&target);
            record.confirmed.remove(&target);
        }
        let replayed: Vec<u64> = self
            .handles
            .iter()
            .filter(|(_, r)| !self.uncertain.contains_key(&r.digest))
            .map(|(id, _)| *id)
            .collect();
        for handle_id in replayed {
            self.begin_replay(target, handle_id, now);
        }
        self.settle_joins();
        Ok(())
    }

    /// Sends the replay of live handle `handle_id` to joining `target`.
    fn begin_replay(&mut self, target: TargetId, handle_id: u64, now: Time) {
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
                scope: BTreeMap::from([(target, Progress::Pending)]),
            },
        );
    }

    /// Every joining replacement whose replays are all confirmed, while no
    /// register is in flight, joins (§2.9).
    fn settle_joins(&mut self) {
        let early = mutant!(self, JoinBeforeReplay);
        let registering = self
            .ops
            .values()
            .any(|op| matches!(op.kind, OpKind::Register { cleanup: None, .. }));
        let joining: Vec<TargetId> = self
            .slots
            .iter()
            // A joining target being lost is still marked joining until
            // `lose` has settled its operations.
            .filter(|(t, r)| r.phase == SlotPhase::Joining && !self.lost.contains(t))
            .map(|(t, _)| *t)
            .collect();
        for target in joining {
            let replaying = self.ops.values().any(|op| {
                matches!(op.kind, OpKind::Replay { .. }) && op.scope.contains_key(&target)
            });
            if (replaying || registering) && !early {
                continue;
            }
            if let Some(record) = self.slots.get_mut(&target) {
                record.phase = SlotPhase::Joined;
                record.failed_joins = 0;
                self.effects.push_back(Effect::Joined {
                    target,
                    incarnation: record.incarnation,
                });
            }
        }
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
        self.effects.push_back(Effect::Fence { target });
        self.lose(target, Progress::Fenced, &cause, now, true);
    }

    /// The IO layer could not stage the payload of [`Effect::Stage`]
    /// `staging`; call it before polling the next effect. Withdraws the
    /// register's queued frames (no target has seen them) and completes the
    /// operation with `failure` and no target outcome.
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
        self.effects
            .retain(|e| !matches!(e, Effect::Send { frame: ControlFrame::Register { seq, .. }, .. } if *seq == op.seq));
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

    fn fence_joining(&mut self, target: TargetId, now: Time) {
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
    fn replay_stage_failed(&mut self, id: OpId, failure: Failure) -> Result<(), Error> {
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
        let seq = op.seq;
        let Some((target, sent)) = op.heard.iter().next().map(|(t, h)| (*t, *h)) else {
            return Ok(());
        };
        self.ops.remove(&id);
        self.staged.remove(&StagingId(id.0));
        self.effects.retain(|e| !matches!(e, Effect::Send { frame: ControlFrame::Register { seq: s, .. }, .. } if *s == seq));
        // Staging is carried out while the input that sent the replay is
        // drained, so its send time is the time now.
        self.fail_join(target, failure, sent);
        self.settle_joins();
        Ok(())
    }

    /// Applies every deadline at or before `now` (`specs/protocol.md`,
    /// "Deadlines"). A target's deadline for an operation waiting for it
    /// is the earlier of its silence deadline (when it was last heard from
    /// about the control, plus `control_timeout`) and the phase's bound
    /// (send plus `operation_timeout`). A target whose deadline passed is,
    /// with `fence_on_timeout`, fenced ([`Effect::Fence`], then lost
    /// everywhere); without, it is timed out for that operation and the
    /// operation's digest becomes uncertain (its effect on the target is
    /// unknown). Does nothing before start or after close.
    pub fn handle_timeout(&mut self, now: Time) {
        if self.lifecycle != Lifecycle::Started {
            return;
        }
        let due: Vec<TargetId> = self
            .slots
            .iter()
            .filter(|(_, r)| matches!(r.phase, SlotPhase::BackingOff(until) if until <= now))
            .map(|(t, _)| *t)
            .collect();
        for target in due {
            self.spawn(target);
        }
        // Task deadlines fence whatever `fence_on_timeout` says (§2.12);
        // a deadline is no evidence against a probed digest (§2.8).
        for (target, cause) in self.expire_tasks(now) {
            if !self.lost.contains(&target) {
                self.effects.push_back(Effect::Fence { target });
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
                self.effects.push_back(Effect::Fence { target });
                // Silence (no alive report for a control timeout: stopped,
                // stalled, unreachable) is no evidence against what it
                // probed; passing the operation bound while it reported
                // alive is (§2.8).
                let silent = self.is_silent(target, now);
                let cause = if silent {
                    SILENT_FENCE_CAUSE
                } else {
                    BOUND_FENCE_CAUSE
                };
                let evidence = !silent || mutant!(self, PoisonSilence);
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
            if let Some(progress) = op.scope.get_mut(&target) {
                match progress {
                    Progress::Pending => *progress = Progress::TimedOut,
                    Progress::CleanupPending => {
                        *progress = Progress::CleanupUnconfirmed(Failure::new(
                            ErrorCode::DEADLINE_EXCEEDED,
                            "no answer to the cleanup before its deadline",
                        ))
                    }
                    _ => {}
                }
            }
            self.mark_uncertain(digest);
            touched.insert(id);
        }
        for id in touched {
            self.advance(id, now);
        }
    }

    /// `target` says it is alive and still busy with control `seq` (it
    /// received it, and it is queued or running there): the silence
    /// deadline of the operation waiting for that answer moves to `now`
    /// plus `control_timeout`; the operation's bound does not move
    /// (`specs/protocol.md`, "Deadlines"). An alive report for a control
    /// no operation awaits from `target` (it raced the reply, or came after
    /// the target's deadline passed) changes nothing: it says nothing about
    /// what the target holds. Ignored from a lost target and after close.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` before start; `FRAME_INVALID` for a target id
    /// out of range or a seq this parent never issued (nothing changes).
    pub fn handle_alive(&mut self, target: TargetId, seq: Seq, now: Time) -> Result<(), Error> {
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
            }
        }
        Ok(())
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
        let respawns = self.slots.values().filter_map(|r| match r.phase {
            SlotPhase::BackingOff(until) if self.lifecycle == Lifecycle::Started => Some(until),
            _ => None,
        });
        self.ops
            .values()
            .flat_map(|op| op.deadlines(self.config.control_timeout))
            .map(|(_, deadline)| deadline)
            .chain(respawns)
            .chain(self.task_timeout())
            .min()
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

    /// Whether `target`'s process is live (started and not lost): one that
    /// serves, or a replacement still joining (§2.9).
    pub fn is_target_live(&self, target: TargetId) -> bool {
        self.lifecycle == Lifecycle::Started
            && target.0 < self.config.targets
            && !self.lost.contains(&target)
    }

    /// Whether `target` serves: live and joined, so in the scope of new
    /// operations and open to tasks (§2.9).
    pub fn is_target_joined(&self, target: TargetId) -> bool {
        self.is_target_live(target) && !self.is_joining(target)
    }

    fn is_joining(&self, target: TargetId) -> bool {
        self.slot_phase(target) == SlotPhase::Joining
    }

    fn serves(&self, target: TargetId) -> bool {
        !self.lost.contains(&target) && !self.is_joining(target)
    }

    /// Where `target`'s slot stands (§2.9): [`SlotPhase::Joined`] or
    /// [`SlotPhase::Lost`] for a slot never replaced (whatever the
    /// lifecycle), else its replacement's phase.
    pub fn slot_phase(&self, target: TargetId) -> SlotPhase {
        match self.slots.get(&target) {
            Some(record) => record.phase,
            None if self.lost.contains(&target) => SlotPhase::Lost,
            None => SlotPhase::Joined,
        }
    }

    /// The incarnation of `target`'s current (or next) process: 0 for the
    /// original, one more for each replacement asked for (§2.9).
    pub fn incarnation(&self, target: TargetId) -> u32 {
        self.slots.get(&target).map_or(0, |r| r.incarnation)
    }

    /// Replacements of `target`'s slot in a row that were lost before they
    /// joined (§2.9; reset when one joins).
    pub fn failed_joins(&self, target: TargetId) -> u16 {
        self.slots.get(&target).map_or(0, |r| r.failed_joins)
    }

    /// Whether `digest` is uncertain (sticky for the Worker's life).
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

    /// The operations in flight, in start order.
    pub fn in_flight(&self) -> Vec<OpId> {
        self.ops.keys().copied().collect()
    }

    /// Staged payloads not yet released, in id order.
    pub fn staged(&self) -> Vec<StagingId> {
        self.staged.iter().copied().collect()
    }

    /// Whether no operation is in flight, no effect waits to be polled and
    /// no replacement is being asked for (backing off or spawning). Tasks
    /// in flight do not count ([`Parent::tasks_in_flight`]).
    pub fn is_idle(&self) -> bool {
        self.ops.is_empty()
            && self.effects.is_empty()
            && !self.slots.values().any(|r| {
                self.lifecycle == Lifecycle::Started
                    && matches!(r.phase, SlotPhase::BackingOff(_) | SlotPhase::Spawning)
            })
    }

    /// Whether an operation in flight still waits for `target`'s answer to
    /// `seq` (a register, unregister or cleanup control). A reply for which
    /// this is `false` is late or duplicate: [`Parent::handle_reply`] then
    /// marks its digest uncertain. The model checker uses it to name late
    /// replies in its traces; an IO layer may use it to log them.
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
        copy.slots = std::mem::take(&mut copy.slots)
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
        }
        copy.tasks = std::mem::take(&mut copy.tasks)
            .into_iter()
            .map(|(seq, mut task)| {
                task.target = map(&task.target);
                (seq, task)
            })
            .collect();
        copy.cancels = std::mem::take(&mut copy.cancels)
            .into_iter()
            .map(|((t, seq), c)| ((map(&t), seq), c))
            .collect();
        for effect in copy.effects.iter_mut() {
            match effect {
                Effect::Send { target, .. }
                | Effect::TaskDone { target, .. }
                | Effect::Fence { target }
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
            }
        }
        copy
    }

    fn mark_uncertain(&mut self, digest: Digest) {
        if mutant!(self, ForgetUncertain) || self.uncertain.contains_key(&digest) {
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

    /// Moves operation `id` on after any change to it: releases its staged
    /// payload once every target in scope answered, then publishes, starts
    /// the cleanup, or completes.
    fn advance(&mut self, id: OpId, now: Time) {
        self.advance_op(id, now);
        self.settle_joins();
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
            // timed out, or confirmed for a digest uncertain meanwhile) the
            // register fails as it is: the others never see it.
            let confirmed = op.scope.get(&probe) == Some(&Progress::Confirmed);
            if confirmed && !self.uncertain.contains_key(&digest) {
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
                        if (all_confirmed || early) && !self.uncertain.contains_key(&digest) {
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

    /// A replay (§2.9) settles at its one target's answer or loss.
    fn advance_replay(
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
        // in its slot came from the process it replaced, which took the
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
                .slots
                .iter()
                .filter(|(_, r)| r.phase == SlotPhase::Joining)
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
        // does a replacement now in its slot (§2.9).
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
        let result = if failures.is_empty() {
            Ok(Completion::Unregistered(handle))
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

/// The cause of a target fenced for silence: no alive report for a whole
/// control timeout (§2.7); no evidence against a digest it probed (§2.8).
pub const SILENT_FENCE_CAUSE: &str = "it sent no alive report for a control timeout and was fenced";

/// The cause of a target fenced at an operation's bound while it still
/// reported alive (§2.7): evidence against a digest it probed (§2.8).
pub const BOUND_FENCE_CAUSE: &str = "it did not answer before the operation's bound and was fenced";

fn poisoned_error(digest: Digest, poison: &Poison) -> Error {
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

fn op_waiting(op: Option<&Op>) -> bool {
    op.is_some_and(Op::waiting)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u8) -> Digest {
        Digest([n; 32])
    }

    fn started(targets: u16) -> Parent {
        let mut p = Parent::new(ParentConfig {
            targets,
            control_timeout: 100,
            operation_timeout: 1_000,
            fence_on_timeout: true,
            owner: OwnerToken(9),
            slot_capacity: 64,
            probe_first: false,
            respawn_limit: 0,
            respawn_backoff: 0,
        });
        p.start().unwrap();
        p
    }

    fn drain(p: &mut Parent) -> Vec<Effect> {
        std::iter::from_fn(|| p.poll_effect()).collect()
    }

    fn ok(seq: u64, n: u8) -> Reply {
        Reply {
            seq: Seq(seq),
            digest: digest(n),
            result: Ok(()),
        }
    }

    fn new_parent(targets: u16) -> Parent {
        Parent::new(ParentConfig {
            targets,
            control_timeout: 100,
            operation_timeout: 1_000,
            fence_on_timeout: true,
            owner: OwnerToken(9),
            slot_capacity: 64,
            probe_first: false,
            respawn_limit: 0,
            respawn_backoff: 0,
        })
    }

    #[test]
    fn a_snapshot_entry_failed_somewhere_is_unregistered_where_it_was_installed() {
        let mut p = new_parent(3);
        let first = p
            .register_before_start(digest(1), Namespace::LocalPython)
            .unwrap();
        let second = p
            .register_before_start(digest(1), Namespace::LocalPython)
            .unwrap();
        let kept = p
            .register_before_start(digest(2), Namespace::LocalPython)
            .unwrap();
        p.start().unwrap();
        let failure = Failure::new(ErrorCode::DESERIALIZE_FAILED, "UnpicklingError: bad");
        let failed = p
            .snapshot_failed(&[(TargetId(1), digest(1), failure.clone())], Time(5))
            .unwrap();
        assert_eq!(
            failed,
            vec![
                FailedRegistration {
                    handle: first,
                    failures: vec![(TargetId(1), failure.clone())],
                },
                FailedRegistration {
                    handle: second,
                    failures: vec![(TargetId(1), failure)],
                },
            ]
        );
        assert!(!p.is_live(digest(1), Namespace::LocalPython));
        assert_eq!(p.live_handles(), vec![kept]);
        let unregister = |seq, target| Effect::Send {
            target: TargetId(target),
            frame: ControlFrame::Unregister {
                seq: Seq(seq),
                digest: digest(1),
            },
        };
        // One unregister per handle, to the targets that installed it.
        assert_eq!(
            drain(&mut p),
            vec![
                unregister(1, 0),
                unregister(1, 2),
                unregister(2, 0),
                unregister(2, 2)
            ]
        );
        for seq in [1, 2] {
            for target in [0, 2] {
                p.handle_reply(TargetId(target), ok(seq, 1), Time(6))
                    .unwrap();
            }
        }
        let completed: Vec<_> = drain(&mut p)
            .into_iter()
            .map(|e| match e {
                Effect::Completed { op, result, .. } => (op, result),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            completed,
            vec![
                (OpId(1), Ok(Completion::Unregistered(first))),
                (OpId(2), Ok(Completion::Unregistered(second)))
            ]
        );
        assert!(p.is_idle());
        assert_eq!(
            p.resolve(&first, Namespace::LocalPython).unwrap_err().code,
            ErrorCode::HANDLE_STALE
        );
    }

    #[test]
    fn snapshot_failures_are_settled_once_before_any_operation() {
        let mut p = new_parent(2);
        p.register_before_start(digest(1), Namespace::LocalPython)
            .unwrap();
        let failure = Failure::new(ErrorCode::DESERIALIZE_FAILED, "x");
        let before = p.snapshot_failed(&[(TargetId(0), digest(1), failure.clone())], Time(0));
        assert_eq!(before.unwrap_err().code, ErrorCode::LIFECYCLE_INVALID);
        p.start().unwrap();
        let unknown = p.snapshot_failed(&[(TargetId(0), digest(7), failure.clone())], Time(0));
        assert_eq!(unknown.unwrap_err().code, ErrorCode::FRAME_INVALID);
        let out_of_range = p.snapshot_failed(&[(TargetId(5), digest(1), failure.clone())], Time(0));
        assert_eq!(out_of_range.unwrap_err().code, ErrorCode::FRAME_INVALID);
        assert!(drain(&mut p).is_empty());
        // Failed everywhere: nothing to unregister, the operation is done.
        let all = [
            (TargetId(0), digest(1), failure.clone()),
            (TargetId(1), digest(1), failure.clone()),
        ];
        assert_eq!(p.snapshot_failed(&all, Time(0)).unwrap().len(), 1);
        assert!(matches!(
            drain(&mut p).as_slice(),
            [Effect::Completed { op: OpId(1), result: Ok(Completion::Unregistered(_)), outcomes }] if outcomes.is_empty()
        ));
        let again = p.snapshot_failed(&all, Time(0));
        assert_eq!(again.unwrap_err().code, ErrorCode::LIFECYCLE_INVALID);
    }

    #[test]
    fn the_startup_snapshot_holds_at_most_slot_capacity_digests() {
        let mut p = Parent::new(ParentConfig {
            targets: 1,
            control_timeout: 100,
            operation_timeout: 1_000,
            fence_on_timeout: true,
            owner: OwnerToken(9),
            slot_capacity: 2,
            probe_first: false,
            respawn_limit: 0,
            respawn_backoff: 0,
        });
        p.register_before_start(digest(1), Namespace::LocalPython)
            .unwrap();
        p.register_before_start(digest(2), Namespace::LocalPython)
            .unwrap();
        // A digest already in the snapshot takes no new slot.
        p.register_before_start(digest(1), Namespace::LocalPython)
            .unwrap();
        let err = p
            .register_before_start(digest(3), Namespace::LocalPython)
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::LOCAL_SLOT_EXHAUSTED);
        assert_eq!(err.hashid, Some(digest(3).hashid()));
        assert_eq!(p.startup_snapshot(), vec![(digest(1), 2), (digest(2), 1)]);
    }

    #[test]
    fn a_digest_is_live_from_publication_until_its_last_handle_goes() {
        let mut p = started(1);
        assert!(!p.is_live(digest(1), Namespace::LocalPython));
        let op = p
            .register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        assert!(!p.is_live(digest(1), Namespace::LocalPython), "in flight");
        p.handle_reply(TargetId(0), ok(op.0, 1), Time(1)).unwrap();
        assert!(p.is_live(digest(1), Namespace::LocalPython));
        assert!(!p.is_live(digest(1), Namespace::LocalChip));
        assert!(!p.is_live(digest(2), Namespace::LocalPython));
        let handle = p.live_handles()[0];
        p.unregister(&handle, Time(2)).unwrap();
        assert!(!p.is_live(digest(1), Namespace::LocalPython));
    }

    #[test]
    fn register_in_another_namespace_is_unsupported_and_emits_nothing() {
        let mut p = started(1);
        let e = p
            .register(digest(1), Namespace::LocalChip, Time(0))
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::CALLABLE_KIND_UNSUPPORTED);
        assert_eq!(e.namespace, Some(Namespace::LocalChip));
        assert_eq!(drain(&mut p), vec![]);
    }

    fn probing(targets: u16) -> Parent {
        let mut p = Parent::new(ParentConfig {
            targets,
            control_timeout: 100,
            operation_timeout: 1_000,
            fence_on_timeout: true,
            owner: OwnerToken(9),
            slot_capacity: 64,
            probe_first: true,
            respawn_limit: 0,
            respawn_backoff: 0,
        });
        p.start().unwrap();
        p
    }

    /// The targets `effects` send a frame to, in order.
    fn sent_to(effects: Vec<Effect>) -> Vec<TargetId> {
        effects
            .into_iter()
            .filter_map(|e| match e {
                Effect::Send { target, .. } => Some(target),
                _ => None,
            })
            .collect()
    }

    fn register_frame(target: u16, seq: u64, n: u8) -> Effect {
        Effect::Send {
            target: TargetId(target),
            frame: ControlFrame::Register {
                seq: Seq(seq),
                digest: digest(n),
                staging: StagingId(seq),
            },
        }
    }

    #[test]
    fn a_new_digest_goes_to_one_target_then_to_the_others_once_it_confirmed() {
        let mut p = probing(3);
        let op = p
            .register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        assert_eq!(
            drain(&mut p),
            vec![
                Effect::Stage {
                    staging: StagingId(1),
                    digest: digest(1)
                },
                register_frame(0, 1, 1)
            ]
        );
        assert_eq!(p.poll_timeout(), Some(Time(100)));
        p.handle_reply(TargetId(0), ok(1, 1), Time(40)).unwrap();
        assert!(p.is_proven(digest(1)));
        // The broadcast has its own deadline; the payload stays staged.
        assert_eq!(
            drain(&mut p),
            vec![register_frame(1, 1, 1), register_frame(2, 1, 1)]
        );
        assert_eq!(p.poll_timeout(), Some(Time(140)));
        assert_eq!(p.staged(), vec![StagingId(1)]);
        p.handle_reply(TargetId(1), ok(1, 1), Time(41)).unwrap();
        p.handle_reply(TargetId(2), ok(1, 1), Time(42)).unwrap();
        let effects = drain(&mut p);
        assert_eq!(
            effects[0],
            Effect::ReleaseStaged {
                staging: StagingId(1)
            }
        );
        let Effect::Completed {
            op: done,
            result: Ok(Completion::Registered(handle)),
            outcomes,
        } = &effects[1]
        else {
            panic!("{effects:?}")
        };
        assert_eq!(*done, op);
        assert_eq!(outcomes.len(), 3);
        // A proven digest goes to every target at once.
        p.register(digest(1), Namespace::LocalPython, Time(50))
            .unwrap();
        assert_eq!(drain(&mut p).len(), 4, "stage and three frames");
        assert_eq!(p.live_handles(), vec![*handle]);
    }

    #[test]
    fn a_probe_that_kills_its_target_poisons_the_digest_and_costs_one_target() {
        let mut p = probing(3);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        p.target_died(TargetId(0), "it exited with status 3", Time(5))
            .unwrap();
        let effects = drain(&mut p);
        assert_eq!(
            effects[0],
            Effect::ReleaseStaged {
                staging: StagingId(1)
            }
        );
        let Effect::Completed {
            result: Err(e),
            outcomes,
            ..
        } = &effects[1]
        else {
            panic!("{effects:?}")
        };
        assert_eq!(e.code, ErrorCode::REGISTER_POISONED);
        assert!(
            e.message
                .contains("killed target 0 (it exited with status 3)"),
            "{}",
            e.message
        );
        assert_eq!(outcomes, &vec![(TargetId(0), TargetOutcome::Lost)]);
        assert!(p.is_poisoned(digest(1)));
        assert!(p.is_target_live(TargetId(1)) && p.is_target_live(TargetId(2)));
        // Refused from now on without any effect.
        let again = p
            .register(digest(1), Namespace::LocalPython, Time(6))
            .unwrap_err();
        assert_eq!(
            (again.code, again.target),
            (ErrorCode::REGISTER_POISONED, Some(TargetId(0)))
        );
        assert!(again.message.contains("it exited with status 3"));
        assert!(drain(&mut p).is_empty());
        // Another digest probes on the next live target.
        p.register(digest(2), Namespace::LocalPython, Time(7))
            .unwrap();
        // (Seq 2 went to the failed register's empty cleanup.)
        assert_eq!(drain(&mut p)[1], register_frame(1, 3, 2));
    }

    #[test]
    fn a_probe_target_fenced_for_silence_poisons_nothing() {
        let mut p = probing(2);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        // No alive report for a control timeout (a stopped target): fenced,
        // but silence is no evidence against the digest.
        p.handle_timeout(Time(100));
        let effects = drain(&mut p);
        assert_eq!(
            effects[0],
            Effect::Fence {
                target: TargetId(0)
            }
        );
        assert!(!p.is_poisoned(digest(1)));
        let Some(Effect::Completed {
            result: Err(e),
            outcomes,
            ..
        }) = effects.last()
        else {
            panic!("{effects:?}")
        };
        assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
        assert_eq!(outcomes, &vec![(TargetId(0), TargetOutcome::Fenced)]);
        // A retry probes again, on the next live target.
        p.register(digest(1), Namespace::LocalPython, Time(101))
            .unwrap();
        assert_eq!(sent_to(drain(&mut p)), vec![TargetId(1)]);
    }

    #[test]
    fn one_digest_has_one_metadata_while_it_is_held() {
        let ns = Namespace::LocalPython;
        let mut p = Parent::new(ParentConfig {
            probe_first: false,
            ..probing(2).config
        });
        let first = p
            .register_before_start_with_metadata(digest(1), ns, Some(digest(8)))
            .unwrap();
        // The same metadata: a second handle.
        p.register_before_start_with_metadata(digest(1), ns, Some(digest(8)))
            .unwrap();
        for other in [Some(digest(9)), None] {
            let e = p
                .register_before_start_with_metadata(digest(1), ns, other)
                .unwrap_err();
            assert_eq!(e.code, ErrorCode::METADATA_CONFLICT);
            assert!(e.message.contains(&format!(
                "is registered with metadata {}",
                crate::descriptor::HashId(digest(8))
            )));
        }
        p.start().unwrap();
        drain(&mut p);
        // After start, and with nothing emitted for a conflict.
        let e = p
            .register_with_metadata(digest(1), ns, None, Time(0))
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::METADATA_CONFLICT);
        assert!(e.message.ends_with(
            "a register of it with no metadata is refused (one callable has one metadata while it is registered: unregister it first)"
        ));
        assert!(drain(&mut p).is_empty());
        // A register in flight holds its metadata too.
        p.register_with_metadata(digest(2), ns, None, Time(0))
            .unwrap();
        let e = p
            .register_with_metadata(digest(2), ns, Some(digest(8)), Time(0))
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::METADATA_CONFLICT);
        // Once no longer held, a digest may come back with other metadata.
        let _ = first;
        let handles: Vec<Handle> = p
            .live_handles()
            .into_iter()
            .filter(|h| h.digest() == digest(1))
            .collect();
        for h in &handles {
            p.unregister(h, Time(1)).unwrap();
        }
        for (target, frame) in drain(&mut p).into_iter().filter_map(|e| match e {
            Effect::Send { target, frame } => Some((target, frame)),
            _ => None,
        }) {
            let (seq, d) = match frame {
                ControlFrame::Register { seq, digest, .. }
                | ControlFrame::Unregister { seq, digest } => (seq, digest),
                _ => continue,
            };
            p.handle_reply(
                target,
                Reply {
                    seq,
                    digest: d,
                    result: Ok(()),
                },
                Time(2),
            )
            .unwrap();
        }
        assert!(!p.is_live(digest(1), ns));
        // Not held although another digest's register is in flight
        // (digest 4): it comes back with other metadata.
        p.register_with_metadata(digest(4), ns, None, Time(3))
            .unwrap();
        p.register_with_metadata(digest(1), ns, Some(digest(9)), Time(3))
            .unwrap();
        // A first register after start records its metadata: the same
        // again is a second register, other metadata a conflict.
        p.register_with_metadata(digest(3), ns, Some(digest(7)), Time(4))
            .unwrap();
        p.register_with_metadata(digest(3), ns, Some(digest(7)), Time(4))
            .unwrap();
        let e = p
            .register_with_metadata(digest(3), ns, Some(digest(6)), Time(4))
            .unwrap_err();
        assert!(e.message.contains(&format!(
            "is registered with metadata {}",
            crate::descriptor::HashId(digest(7))
        )));
    }

    #[test]
    fn a_forgiven_digest_probes_again() {
        let mut p = probing(2);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        p.target_died(TargetId(0), "it was killed by signal 9", Time(1))
            .unwrap();
        drain(&mut p);
        assert!(p.is_poisoned(digest(1)));
        assert!(p.forgive(digest(1)));
        assert!(!p.forgive(digest(1)));
        assert!(!p.is_poisoned(digest(1)) && !p.is_proven(digest(1)));
        p.register(digest(1), Namespace::LocalPython, Time(2))
            .unwrap();
        assert_eq!(sent_to(drain(&mut p)), vec![TargetId(1)]);
    }

    #[test]
    fn a_probe_target_past_the_operation_bound_while_alive_poisons_the_digest() {
        let mut p = probing(2);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        // It keeps reporting alive (busy deserializing) past the bound.
        let mut now = 0;
        while now < 1_000 {
            now += 60;
            p.handle_alive(TargetId(0), Seq(1), Time(now)).unwrap();
            p.handle_timeout(Time(now));
        }
        let effects = drain(&mut p);
        assert!(effects.contains(&Effect::Fence {
            target: TargetId(0)
        }));
        assert!(p.is_poisoned(digest(1)));
        let poison = &p.poisoned_digests()[0].1;
        assert_eq!(poison.target, TargetId(0));
        assert_eq!(poison.cause, BOUND_FENCE_CAUSE);
    }

    #[test]
    fn a_loss_while_an_older_control_is_pending_poisons_nothing() {
        let mut p = Parent::new(ParentConfig {
            targets: 2,
            control_timeout: 100,
            operation_timeout: 1_000,
            fence_on_timeout: true,
            owner: OwnerToken(9),
            slot_capacity: 64,
            probe_first: true,
            respawn_limit: 0,
            respawn_backoff: 0,
        });
        let h = p
            .register_before_start(digest(7), Namespace::LocalPython)
            .unwrap();
        p.start().unwrap();
        // The unregister is sent first: the target may have died on it.
        p.unregister(&h, Time(0)).unwrap();
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        p.target_lost(TargetId(0), Time(1)).unwrap();
        assert!(!p.is_poisoned(digest(1)));
        let completed: Vec<ErrorCode> = drain(&mut p)
            .into_iter()
            .filter_map(|e| match e {
                Effect::Completed { result: Err(e), .. } => Some(e.code),
                _ => None,
            })
            .collect();
        assert_eq!(completed, vec![ErrorCode::REGISTER_PARTIAL_FAILURE]);
        // Not poisoned: a retry probes again, on the next target.
        p.register(digest(1), Namespace::LocalPython, Time(2))
            .unwrap();
        assert_eq!(drain(&mut p)[1], register_frame(1, 4, 1));
    }

    #[test]
    fn a_refused_probe_fails_the_register_without_reaching_the_others() {
        let mut p = probing(2);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        let refused = Reply {
            seq: Seq(1),
            digest: digest(1),
            result: Err(Failure::new(ErrorCode::DESERIALIZE_FAILED, "ValueError: x")),
        };
        p.handle_reply(TargetId(0), refused, Time(1)).unwrap();
        let effects = drain(&mut p);
        let Some(Effect::Completed {
            result: Err(e),
            outcomes,
            ..
        }) = effects.last()
        else {
            panic!("{effects:?}")
        };
        assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
        assert_eq!(outcomes.len(), 1);
        assert!(!effects.iter().any(|e| matches!(e, Effect::Send { .. })));
        assert!(!p.is_poisoned(digest(1)) && !p.is_proven(digest(1)));
    }

    #[test]
    fn a_loss_while_a_cleanup_is_older_than_the_probe_poisons_nothing() {
        let mut p = Parent::new(ParentConfig {
            targets: 2,
            control_timeout: 100,
            operation_timeout: 1_000,
            fence_on_timeout: true,
            owner: OwnerToken(9),
            slot_capacity: 64,
            probe_first: true,
            respawn_limit: 0,
            respawn_backoff: 0,
        });
        p.register_before_start(digest(2), Namespace::LocalPython)
            .unwrap();
        p.start().unwrap();
        // A proven digest: to both at once; target 1 refuses, so target 0
        // gets the cleanup (seq 2).
        p.register(digest(2), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        p.handle_reply(TargetId(0), ok(1, 2), Time(1)).unwrap();
        let refused = Reply {
            seq: Seq(1),
            digest: digest(2),
            result: Err(Failure::new(ErrorCode::DESERIALIZE_FAILED, "no")),
        };
        p.handle_reply(TargetId(1), refused, Time(1)).unwrap();
        assert!(p.awaits_reply(TargetId(0), Seq(2)));
        // Then a probe (seq 3) to target 0, behind the cleanup.
        p.register(digest(1), Namespace::LocalPython, Time(2))
            .unwrap();
        drain(&mut p);
        p.target_lost(TargetId(0), Time(3)).unwrap();
        assert!(!p.is_poisoned(digest(1)));
        assert!(p.poisoned_digests().is_empty());
    }

    #[test]
    fn a_loss_during_a_second_probe_of_a_digest_proven_meanwhile_poisons_nothing() {
        let mut p = probing(2);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        // Both probe on target 0; the first confirms (and broadcasts).
        p.handle_reply(TargetId(0), ok(1, 1), Time(1)).unwrap();
        assert!(p.is_proven(digest(1)));
        drain(&mut p);
        p.target_lost(TargetId(0), Time(2)).unwrap();
        assert!(!p.is_poisoned(digest(1)));
    }

    #[test]
    fn a_probe_confirmed_for_a_digest_uncertain_meanwhile_goes_no_further() {
        let mut p = probing(2);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        p.mark_uncertain(digest(1));
        p.handle_reply(TargetId(0), ok(1, 1), Time(1)).unwrap();
        let effects = drain(&mut p);
        assert!(
            !effects.iter().any(|e| matches!(
                e,
                Effect::Send {
                    frame: ControlFrame::Register { .. },
                    ..
                }
            )),
            "{effects:?}"
        );
        assert_eq!(
            effects[..2],
            [
                Effect::ReleaseStaged {
                    staging: StagingId(1)
                },
                Effect::Send {
                    target: TargetId(0),
                    frame: ControlFrame::Unregister {
                        seq: Seq(2),
                        digest: digest(1)
                    }
                }
            ]
        );
    }

    #[test]
    fn snapshot_digests_need_no_probe() {
        let mut p = Parent::new(ParentConfig {
            targets: 2,
            control_timeout: 100,
            operation_timeout: 1_000,
            fence_on_timeout: true,
            owner: OwnerToken(9),
            slot_capacity: 64,
            probe_first: true,
            respawn_limit: 0,
            respawn_backoff: 0,
        });
        p.register_before_start(digest(1), Namespace::LocalPython)
            .unwrap();
        p.start().unwrap();
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        assert_eq!(drain(&mut p).len(), 3, "stage and two frames");
    }

    #[test]
    fn register_with_every_target_lost_has_no_live_target() {
        let mut p = started(1);
        p.target_lost(TargetId(0), Time(0)).unwrap();
        let e = p
            .register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::NO_LIVE_TARGET);
        assert_eq!(drain(&mut p), vec![]);
        assert_eq!(p.next_seq, 1, "no seq consumed");
    }

    fn fences(effects: &[Effect]) -> Vec<TargetId> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Fence { target } => Some(*target),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn an_alive_report_moves_the_silence_deadline_but_never_the_bound() {
        let mut p = started(2);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        assert_eq!(p.poll_timeout(), Some(Time(100)));
        assert_eq!(p.poll_bound(), Some(Time(1_000)));
        p.handle_alive(TargetId(0), Seq(1), Time(80)).unwrap();
        // Target 1 is still only heard from at the send.
        assert_eq!(p.poll_timeout(), Some(Time(100)));
        p.handle_alive(TargetId(1), Seq(1), Time(90)).unwrap();
        assert_eq!(p.poll_timeout(), Some(Time(180)));
        // Both keep reporting: nothing expires before the bound.
        for now in (90..=990).step_by(90) {
            p.handle_alive(TargetId(0), Seq(1), Time(now)).unwrap();
            p.handle_alive(TargetId(1), Seq(1), Time(now)).unwrap();
            p.handle_timeout(Time(now));
            assert_eq!(fences(&drain(&mut p)), Vec::<TargetId>::new(), "at {now}");
        }
        assert_eq!(p.poll_timeout(), Some(Time(1_000)));
        p.handle_timeout(Time(999));
        assert_eq!(fences(&drain(&mut p)), Vec::<TargetId>::new());
        p.handle_timeout(Time(1_000));
        assert_eq!(fences(&drain(&mut p)), vec![TargetId(0), TargetId(1)]);
        assert_eq!(p.poll_timeout(), None);
    }

    #[test]
    fn only_the_silent_target_is_fenced_at_its_silence_deadline() {
        let mut p = started(2);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        p.handle_alive(TargetId(0), Seq(1), Time(60)).unwrap();
        p.handle_timeout(Time(100));
        assert_eq!(fences(&drain(&mut p)), vec![TargetId(1)]);
        assert!(p.is_target_live(TargetId(0)));
        assert!(!p.is_target_live(TargetId(1)));
        assert_eq!(p.poll_timeout(), Some(Time(160)));
        // The heard target answers; the register fails (one target was
        // fenced) and rolls it back under a fresh deadline.
        p.handle_reply(TargetId(0), ok(1, 1), Time(120)).unwrap();
        let effects = drain(&mut p);
        assert!(effects.contains(&Effect::Send {
            target: TargetId(0),
            frame: ControlFrame::Unregister {
                seq: Seq(2),
                digest: digest(1)
            }
        }));
        assert_eq!(p.poll_timeout(), Some(Time(220)));
        assert_eq!(p.poll_bound(), Some(Time(1_120)));
        // The cleanup is kept alive the same way.
        p.handle_alive(TargetId(0), Seq(2), Time(200)).unwrap();
        assert_eq!(p.poll_timeout(), Some(Time(300)));
        assert!(p.uncertain_digests().is_empty());
    }

    #[test]
    fn without_fencing_a_silent_target_times_out_alone() {
        let mut p = Parent::new(ParentConfig {
            targets: 2,
            control_timeout: 100,
            operation_timeout: 1_000,
            fence_on_timeout: false,
            owner: OwnerToken(7),
            slot_capacity: 4,
            probe_first: false,
            respawn_limit: 0,
            respawn_backoff: 0,
        });
        p.start().unwrap();
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        p.handle_alive(TargetId(0), Seq(1), Time(50)).unwrap();
        p.handle_timeout(Time(100));
        assert_eq!(fences(&drain(&mut p)), Vec::<TargetId>::new());
        assert!(p.is_uncertain(digest(1)));
        // Target 0 is still awaited, under its own deadline.
        assert!(p.awaits_reply(TargetId(0), Seq(1)));
        assert!(!p.awaits_reply(TargetId(1), Seq(1)));
        assert_eq!(p.poll_timeout(), Some(Time(150)));
    }

    #[test]
    fn an_alive_report_for_a_control_not_awaited_changes_nothing() {
        let mut p = started(2);
        assert_eq!(
            p.handle_alive(TargetId(0), Seq(1), Time(0))
                .unwrap_err()
                .code,
            ErrorCode::FRAME_INVALID
        );
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        p.handle_reply(TargetId(0), ok(1, 1), Time(10)).unwrap();
        let before = p.clone();
        // It raced the reply: no deadline moves, nothing turns uncertain.
        p.handle_alive(TargetId(0), Seq(1), Time(90)).unwrap();
        assert_eq!(p, before);
        assert_eq!(p.poll_timeout(), Some(Time(100)));
        assert!(p.uncertain_digests().is_empty());
        assert_eq!(
            p.handle_alive(TargetId(1), Seq(2), Time(20))
                .unwrap_err()
                .code,
            ErrorCode::FRAME_INVALID
        );
        assert_eq!(
            p.handle_alive(TargetId(2), Seq(1), Time(20))
                .unwrap_err()
                .code,
            ErrorCode::FRAME_INVALID
        );
        let mut unstarted = new_parent(1);
        assert_eq!(
            unstarted
                .handle_alive(TargetId(0), Seq(1), Time(0))
                .unwrap_err()
                .code,
            ErrorCode::LIFECYCLE_INVALID
        );
    }

    #[test]
    fn several_operations_fly_at_once_each_with_its_own_seq() {
        let mut p = started(1);
        assert_eq!(
            p.register(digest(1), Namespace::LocalPython, Time(0)),
            Ok(OpId(1))
        );
        assert_eq!(
            p.register(digest(2), Namespace::LocalPython, Time(5)),
            Ok(OpId(2))
        );
        assert_eq!(p.in_flight(), vec![OpId(1), OpId(2)]);
        assert_eq!(p.poll_timeout(), Some(Time(100)));
        drain(&mut p);
        // Answers may come for the later one first.
        p.handle_reply(TargetId(0), ok(2, 2), Time(6)).unwrap();
        p.handle_reply(TargetId(0), ok(1, 1), Time(7)).unwrap();
        let handles: Vec<u64> = drain(&mut p)
            .into_iter()
            .filter_map(|e| match e {
                Effect::Completed {
                    result: Ok(Completion::Registered(h)),
                    ..
                } => Some(h.handle_id),
                _ => None,
            })
            .collect();
        assert_eq!(handles, vec![1, 2]);
        assert_eq!(p.poll_timeout(), None);
    }

    #[test]
    fn a_digest_that_becomes_uncertain_in_flight_is_not_published() {
        let mut p = started(2);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        p.mark_uncertain(digest(1));
        drain(&mut p);
        p.handle_reply(TargetId(0), ok(1, 1), Time(1)).unwrap();
        p.handle_reply(TargetId(1), ok(1, 1), Time(2)).unwrap();
        let cleanup = ControlFrame::Unregister {
            seq: Seq(2),
            digest: digest(1),
        };
        assert_eq!(
            drain(&mut p),
            vec![
                Effect::ReleaseStaged {
                    staging: StagingId(1)
                },
                Effect::Send {
                    target: TargetId(0),
                    frame: cleanup.clone()
                },
                Effect::Send {
                    target: TargetId(1),
                    frame: cleanup
                },
            ]
        );
        p.handle_reply(TargetId(0), ok(2, 1), Time(3)).unwrap();
        p.handle_reply(TargetId(1), ok(2, 1), Time(4)).unwrap();
        let [Effect::Completed { result: Err(e), .. }] =
            <[Effect; 1]>::try_from(drain(&mut p)).unwrap()
        else {
            panic!("no completion")
        };
        assert_eq!(e.code, ErrorCode::REGISTER_CLEANUP_UNCERTAIN);
        assert!(p.live_handles().is_empty());
    }

    #[test]
    fn a_reply_naming_another_digest_fails_the_target_and_marks_uncertain() {
        let mut p = started(1);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        p.handle_reply(TargetId(0), ok(1, 2), Time(1)).unwrap();
        assert!(p.is_uncertain(digest(1)));
        let effects = drain(&mut p);
        let Some(Effect::Completed { outcomes, .. }) = effects.last() else {
            panic!("{effects:?}")
        };
        let TargetOutcome::Failed { failure } = &outcomes[0].1 else {
            panic!("{outcomes:?}")
        };
        assert_eq!(failure.code, ErrorCode::FRAME_INVALID);
    }

    #[test]
    fn stage_failure_withdraws_the_frames_and_completes_with_its_error() {
        let mut p = started(2);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        assert_eq!(
            p.poll_effect(),
            Some(Effect::Stage {
                staging: StagingId(1),
                digest: digest(1)
            })
        );
        p.stage_failed(
            StagingId(1),
            Failure::new(ErrorCode::IO_FAILED, "shm_open: ENOSPC"),
        )
        .unwrap();
        let [Effect::Completed {
            op,
            result: Err(e),
            outcomes,
        }] = <[Effect; 1]>::try_from(drain(&mut p)).unwrap()
        else {
            panic!("no completion")
        };
        assert_eq!(
            (op, e.code, e.operation, outcomes),
            (OpId(1), ErrorCode::IO_FAILED, OperationKind::Stage, vec![])
        );
        assert!(p.staged().is_empty() && p.in_flight().is_empty());
        let again = p.stage_failed(StagingId(1), Failure::new(ErrorCode::IO_FAILED, "x"));
        assert_eq!(again.unwrap_err().code, ErrorCode::FRAME_INVALID);
    }

    #[test]
    fn stage_failure_after_frames_were_polled_is_refused() {
        let mut p = started(1);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        let e = p.stage_failed(StagingId(1), Failure::new(ErrorCode::IO_FAILED, "late"));
        assert_eq!(e.unwrap_err().code, ErrorCode::FRAME_INVALID);
        assert_eq!(p.in_flight(), vec![OpId(1)]);
    }

    #[test]
    fn close_completes_every_operation_and_releases_staging() {
        let mut p = started(1);
        p.register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        drain(&mut p);
        p.close().unwrap();
        let effects = drain(&mut p);
        assert_eq!(
            effects[0],
            Effect::ReleaseStaged {
                staging: StagingId(1)
            }
        );
        let Effect::Completed {
            result: Err(e),
            outcomes,
            ..
        } = &effects[1]
        else {
            panic!("{effects:?}")
        };
        assert_eq!(e.code, ErrorCode::LIFECYCLE_INVALID);
        assert_eq!(outcomes, &vec![(TargetId(0), TargetOutcome::Lost)]);
        assert_eq!(p.lifecycle(), Lifecycle::Closed);
        assert_eq!(p.poll_timeout(), None);
    }

    #[test]
    fn unregister_with_no_live_target_in_scope_completes_at_once() {
        let mut p = Parent::new(ParentConfig {
            targets: 1,
            control_timeout: 100,
            operation_timeout: 1_000,
            fence_on_timeout: true,
            owner: OwnerToken(9),
            slot_capacity: 64,
            probe_first: false,
            respawn_limit: 0,
            respawn_backoff: 0,
        });
        let h = p
            .register_before_start(digest(1), Namespace::LocalPython)
            .unwrap();
        p.start().unwrap();
        p.target_lost(TargetId(0), Time(0)).unwrap();
        assert_eq!(p.unregister(&h, Time(1)), Ok(OpId(1)));
        assert_eq!(
            drain(&mut p),
            vec![Effect::Completed {
                op: OpId(1),
                result: Ok(Completion::Unregistered(h)),
                outcomes: vec![]
            }]
        );
    }

    #[test]
    fn submit_checks_the_target() {
        let mut p = Parent::new(ParentConfig {
            targets: 2,
            control_timeout: 100,
            operation_timeout: 1_000,
            fence_on_timeout: true,
            owner: OwnerToken(9),
            slot_capacity: 64,
            probe_first: false,
            respawn_limit: 0,
            respawn_backoff: 0,
        });
        let h = p
            .register_before_start(digest(1), Namespace::LocalPython)
            .unwrap();
        p.start().unwrap();
        assert_eq!(
            p.submit(&h, TargetId(2)).unwrap_err().code,
            ErrorCode::NO_LIVE_TARGET
        );
        p.target_lost(TargetId(1), Time(0)).unwrap();
        let e = p.submit(&h, TargetId(1)).unwrap_err();
        assert_eq!(
            (e.code, e.target),
            (ErrorCode::TARGET_LOST, Some(TargetId(1)))
        );
        assert_eq!(p.submit(&h, TargetId(0)), Ok(Seq(1)));
        assert_eq!(
            drain(&mut p),
            vec![Effect::Send {
                target: TargetId(0),
                frame: ControlFrame::Task {
                    seq: Seq(1),
                    digest: digest(1)
                }
            }]
        );
    }

    #[test]
    fn replies_before_start_and_for_unknown_targets_are_refused() {
        let mut p = Parent::new(ParentConfig {
            targets: 1,
            control_timeout: 100,
            operation_timeout: 1_000,
            fence_on_timeout: true,
            owner: OwnerToken(9),
            slot_capacity: 64,
            probe_first: false,
            respawn_limit: 0,
            respawn_backoff: 0,
        });
        assert_eq!(
            p.handle_reply(TargetId(0), ok(1, 1), Time(0))
                .unwrap_err()
                .code,
            ErrorCode::LIFECYCLE_INVALID
        );
        p.start().unwrap();
        assert_eq!(
            p.handle_reply(TargetId(5), ok(1, 1), Time(0))
                .unwrap_err()
                .code,
            ErrorCode::FRAME_INVALID
        );
        assert_eq!(
            p.target_lost(TargetId(5), Time(0)).unwrap_err().code,
            ErrorCode::FRAME_INVALID
        );
    }
}
