//! The model: the library's parent and target machines, wired by FIFO
//! channels, driven by a client script and by faults (`specs/model.md`).
//!
//! One [`State`] holds the real [`Parent`], one real [`Target`] per child
//! (or `None` once it died), the frames and replies in transit, the
//! shared-memory staging area, the client's progress through its script and
//! the fault budgets left. Each [`Action`] is one input to one machine,
//! after which the driver drains that machine's effects exactly as the IO
//! layer does (the driving rule of `callreg::protocol`).

use std::collections::BTreeMap;
use std::fmt;

use callreg::descriptor::Digest;
use callreg::error::ErrorCode;
use callreg::protocol::invariants::{self, View, Violation};
#[cfg(feature = "mutants")]
use callreg::protocol::Mutant;
use callreg::protocol::{
    Completion, ControlFrame, Effect, Failure, Handle, Namespace, OpId, OwnerToken, Parent,
    ParentConfig, Reply, Seq, StagingId, Target, TargetConfig, TargetEffect, TargetId,
    TargetOutcome, Time,
};

use crate::script::{digest_of, name_of, BeforeStart, HandleRef, Operation, Script, CORRUPTED};

/// How long (model time units) a target has to answer a control. Larger
/// than the number of operations any script issues, so the deadlines of
/// successive operations stay in issue order.
pub const CONTROL_TIMEOUT: u64 = 1_000;

/// The owner token of the modelled Worker.
pub const OWNER: OwnerToken = OwnerToken(0x5eed);

/// What to check: the system's size, the client script, the fault budgets
/// and the parent's timeout policy.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// Number of targets (children), at least 1.
    pub targets: u16,
    /// The client script.
    pub script: Script,
    /// How many targets may crash (each at most once).
    pub crashes: u8,
    /// How many deserializations may fail at install.
    pub deserialize_failures: u8,
    /// How many registers may fail to stage their payload in shared memory
    /// (`Parent::stage_failed`).
    pub stage_failures: u8,
    /// How many register deliveries may find their staged payload corrupted
    /// (its recomputed digest differs from the requested one).
    pub corruptions: u8,
    /// How many times a deadline may pass (each time the earliest pending
    /// deadline passes, with every target still silent for it).
    pub deadlines: u8,
    /// How many tasks the client may dispatch (for live handles, to
    /// targets that confirmed them).
    pub tasks: u8,
    /// The parent's policy at a passed deadline: fence (kill) the silent
    /// target, or leave it running and mark the digest uncertain.
    pub fence_on_timeout: bool,
    /// Slots per target.
    pub slot_capacity: u16,
    /// The targets on which the startup snapshot's first digest (in digest
    /// order) fails to install (`specs/model.md`, §1 "Startup-snapshot failures"): they start without
    /// it, report it, and the parent settles it
    /// (`Parent::snapshot_failed`) before anything else happens. Empty: no
    /// snapshot entry fails.
    pub snapshot_failures: Vec<u16>,
    /// The known bug switched on in both machines, if any.
    #[cfg(feature = "mutants")]
    pub mutant: Option<Mutant>,
}

impl ModelConfig {
    /// The standard configuration (`specs/model.md`): 3 targets,
    /// the `register-unregister-same-digest` script, 1 crash,
    /// 1 deserialization failure, 1 corruption, 1 deadline, 1 task,
    /// no staging failure, fencing on, 2 slots per target.
    pub fn standard() -> ModelConfig {
        ModelConfig {
            targets: 3,
            script: Script::named("register-unregister-same-digest")
                .unwrap_or_else(|| Script::builtin().remove(0)),
            crashes: 1,
            deserialize_failures: 1,
            stage_failures: 0,
            corruptions: 1,
            deadlines: 1,
            tasks: 1,
            fence_on_timeout: true,
            slot_capacity: 2,
            snapshot_failures: Vec::new(),
            #[cfg(feature = "mutants")]
            mutant: None,
        }
    }

    /// `script` on `targets` targets with no fault, no task and fencing on.
    pub fn fault_free(targets: u16, script: Script) -> ModelConfig {
        ModelConfig {
            targets,
            script,
            crashes: 0,
            deserialize_failures: 0,
            stage_failures: 0,
            corruptions: 0,
            deadlines: 0,
            tasks: 0,
            ..ModelConfig::standard()
        }
    }
}

/// Why a configuration cannot be modelled.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid configuration: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

/// Where the client stands with one post-start operation of its script.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum StepStatus {
    /// Not issued yet.
    Waiting,
    /// Issued; the parent has not completed it.
    InFlight(OpId),
    /// Finished.
    Done(StepResult),
}

/// How one post-start operation ended.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum StepResult {
    /// A register published this handle id.
    Registered(u64),
    /// An unregister completed at every target in scope.
    Unregistered,
    /// The operation completed with this error; `rolled_back` when some
    /// target's install was undone by a cleanup.
    Failed {
        /// The error's code.
        code: ErrorCode,
        /// Whether some target reports [`TargetOutcome::RolledBack`].
        rolled_back: bool,
    },
    /// The parent refused the call itself with this error (nothing sent).
    Refused(ErrorCode),
    /// An unregister whose register published no handle: not issued.
    Skipped,
}

/// What the driver keeps about one target beside its machine: what it
/// must still report to it (deserializations, runs) and, for the
/// slot-reuse witness, which slots were freed after a tombstone.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Default)]
pub struct TargetSide {
    /// Register seqs whose deserialization is in progress, oldest first.
    pub deserializing: Vec<Seq>,
    /// Task seqs whose run is in progress, oldest first.
    pub runs: Vec<Seq>,
    /// Bit `s` set: slot `s` was tombstoned and then freed.
    pub freed_tombstones: u64,
}

/// Fault budgets left.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Budgets {
    /// Crashes left.
    pub crashes: u8,
    /// Deserialization failures left.
    pub deserialize_failures: u8,
    /// Staging failures left.
    pub stage_failures: u8,
    /// Corruptions left.
    pub corruptions: u8,
    /// Deadline passings left.
    pub deadlines: u8,
    /// Tasks left.
    pub tasks: u8,
}

/// Something the driver saw happen on this path (history the properties
/// need beyond the current state), as bits of [`State::seen`].
pub mod seen {
    /// A machine refused an input that the driving rule produced (an
    /// `Err` from `handle_reply`, `target_lost`, `on_deserialized`,
    /// `end_task`, or a completion for no known operation).
    pub const DRIVER_ERROR: u8 = 1;
    /// A task for a handle that was live at its arrival reached a live
    /// target lacking its digest (invariant 8 observed directly).
    pub const DISPATCH_UNSAFE: u8 = 2;
    /// A slot was reserved for a deserialization after it had been
    /// tombstoned and freed.
    pub const SLOT_REUSED_AFTER_TOMBSTONE: u8 = 4;
    /// A reply reached the parent after its operation stopped waiting for
    /// that target (a late reply).
    pub const LATE_REPLY: u8 = 8;
}

/// One state of the whole system.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct State {
    /// The parent machine.
    pub parent: Parent,
    /// Target `i`'s machine, `None` once it crashed or was fenced.
    pub targets: Vec<Option<Target>>,
    /// Frames in transit parent → target, ordered by target id and FIFO
    /// within one target (so one system state has one representation).
    pub frames: Vec<(TargetId, ControlFrame)>,
    /// Replies in transit target → parent, ordered like `frames`.
    pub replies: Vec<(TargetId, Reply)>,
    /// `eof[i]`: target `i` crashed; after its queued replies the parent
    /// reads end of file (and calls `target_lost`).
    pub eof: Vec<bool>,
    /// The driver's bookkeeping per target.
    pub sides: Vec<TargetSide>,
    /// Shared memory: each staged payload with the digest its bytes have.
    pub staged: BTreeMap<StagingId, Digest>,
    /// The client's progress, one entry per script operation.
    pub client: Vec<StepStatus>,
    /// Task frames in transit: task seq → handle id it was submitted for.
    pub tasks: Vec<(Seq, u64)>,
    /// Model time (advances by one per issued operation, and to a
    /// deadline when it passes).
    pub now: u64,
    /// Fault budgets left.
    pub budgets: Budgets,
    /// Bits of [`seen`].
    pub seen: u8,
}

impl State {
    /// Calls `f` with the invariant predicates' view of this state.
    pub fn with_view<R>(&self, f: impl FnOnce(&View<'_>) -> R) -> R {
        let targets: Vec<Option<&Target>> = self.targets.iter().map(Option::as_ref).collect();
        let frames: Vec<(TargetId, &ControlFrame)> =
            self.frames.iter().map(|(t, f)| (*t, f)).collect();
        let replies: Vec<(TargetId, &Reply)> = self.replies.iter().map(|(t, r)| (*t, r)).collect();
        f(&View {
            parent: &self.parent,
            targets: &targets,
            frames: &frames,
            replies: &replies,
        })
    }

    /// Whether every script operation finished.
    pub fn script_done(&self) -> bool {
        self.client.iter().all(|s| matches!(s, StepStatus::Done(_)))
    }

    fn has_traffic(&self) -> bool {
        !self.frames.is_empty()
            || !self.replies.is_empty()
            || self.eof.iter().any(|e| *e)
            || self
                .sides
                .iter()
                .any(|s| !s.deserializing.is_empty() || !s.runs.is_empty())
    }

    fn head_frame(&self, target: TargetId) -> Option<&ControlFrame> {
        self.frames
            .iter()
            .find(|(t, _)| *t == target)
            .map(|(_, f)| f)
    }

    fn head_reply(&self, target: TargetId) -> Option<&Reply> {
        self.replies
            .iter()
            .find(|(t, _)| *t == target)
            .map(|(_, r)| r)
    }
}

/// One step of the system.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Action {
    /// The client issues script operation `i`.
    Issue(usize),
    /// The client issues script operation `i`, a register, and staging its
    /// payload in shared memory fails.
    IssueStageFails(usize),
    /// The client dispatches a task for live handle `handle_id` to `target`.
    Submit {
        /// The handle id.
        handle_id: u64,
        /// The target.
        target: TargetId,
    },
    /// The target applies the frame at the head of its channel.
    Deliver(TargetId),
    /// As `Deliver` for a register frame, but the staged payload it opens
    /// is corrupted: its recomputed digest is not the requested one.
    DeliverCorrupted(TargetId),
    /// The target's oldest deserialization finishes, successfully or not.
    Deserialized {
        /// The target.
        target: TargetId,
        /// Whether the runtime deserialized the payload.
        ok: bool,
    },
    /// Task `seq`'s run on `target` ends.
    EndRun {
        /// The target.
        target: TargetId,
        /// The task.
        seq: Seq,
    },
    /// The parent reads the next thing from `target`'s pipe: a reply, or
    /// end of file after a crash.
    Receive(TargetId),
    /// The target crashes: it holds nothing, frames to it are lost, and the
    /// parent will read end of file after its queued replies.
    Crash(TargetId),
    /// The earliest pending deadline passes.
    DeadlinePasses,
}

/// The stateright model of the registration protocol.
#[derive(Clone, Debug)]
pub struct RegistrationModel {
    /// What is checked.
    pub config: ModelConfig,
    init: State,
    /// Handles issued before start, by `before_start` index.
    before_start_handles: Vec<Option<Handle>>,
    /// Operations `1..=snapshot_ops` are the unregisters the parent issued
    /// to settle a failed snapshot entry: no client step waits for them.
    snapshot_ops: u64,
}

fn insert_ordered<T>(queue: &mut Vec<(TargetId, T)>, target: TargetId, item: T) {
    let at = queue.partition_point(|(t, _)| *t <= target);
    queue.insert(at, (target, item));
}

fn take_head<T>(queue: &mut Vec<(TargetId, T)>, target: TargetId) -> Option<T> {
    let at = queue.iter().position(|(t, _)| *t == target)?;
    Some(queue.remove(at).1)
}

fn handle_for(digest: Digest, handle_id: u64) -> Handle {
    Handle {
        namespace: Namespace::LocalPython,
        hashid: digest.hashid(),
        handle_id,
        owner: OWNER,
    }
}

impl RegistrationModel {
    /// The model of `config`: runs the script's pre-start steps on a new
    /// parent, starts it, and gives every target the startup snapshot.
    ///
    /// # Errors
    /// A [`ConfigError`] when there are no targets, the script is invalid,
    /// a pre-start step fails, or the snapshot does not fit the slots.
    pub fn new(config: ModelConfig) -> Result<RegistrationModel, ConfigError> {
        if config.targets == 0 || config.targets > 16 {
            return Err(ConfigError("targets must be 1..=16".into()));
        }
        if config.slot_capacity == 0 || config.slot_capacity > 64 {
            return Err(ConfigError("slots must be 1..=64".into()));
        }
        config
            .script
            .validate()
            .map_err(|e| ConfigError(e.to_string()))?;
        let mut parent = Parent::new(ParentConfig {
            targets: config.targets,
            control_timeout: CONTROL_TIMEOUT,
            fence_on_timeout: config.fence_on_timeout,
            owner: OWNER,
            slot_capacity: config.slot_capacity,
        });
        #[cfg(feature = "mutants")]
        if let Some(mutant) = config.mutant {
            parent = parent.with_mutant(mutant);
        }
        let mut before_start_handles = Vec::new();
        for (i, step) in config.script.before_start.iter().enumerate() {
            let handle = match step {
                BeforeStart::Register(c) => {
                    let digest = digest_of(*c).ok_or_else(|| ConfigError(format!("{c:?}")))?;
                    Some(
                        parent
                            .register_before_start(digest, Namespace::LocalPython)
                            .map_err(|e| ConfigError(format!("before_start[{i}]: {e}")))?,
                    )
                }
                BeforeStart::Unregister(j) => {
                    let handle = before_start_handles
                        .get(*j)
                        .copied()
                        .flatten()
                        .ok_or_else(|| ConfigError(format!("before_start[{i}]: no handle")))?;
                    parent
                        .unregister_before_start(&handle)
                        .map_err(|e| ConfigError(format!("before_start[{i}]: {e}")))?;
                    None
                }
            };
            before_start_handles.push(handle);
        }
        let snapshot = parent.startup_snapshot();
        parent
            .start()
            .map_err(|e| ConfigError(format!("start: {e}")))?;
        // A snapshot entry that fails on some targets: they hold nothing
        // of it, and the parent settles it from their reports.
        let failing = match (config.snapshot_failures.is_empty(), snapshot.first()) {
            (true, _) => None,
            (false, Some((digest, _))) => Some(*digest),
            (false, None) => {
                return Err(ConfigError(
                    "snapshot failures need a startup snapshot".into(),
                ))
            }
        };
        if let Some(bad) = config
            .snapshot_failures
            .iter()
            .find(|t| **t >= config.targets)
        {
            return Err(ConfigError(format!(
                "snapshot failure on target {bad}, which does not exist"
            )));
        }
        let mut snapshot_ops = 0;
        if let Some(digest) = failing {
            let failures: Vec<(TargetId, Digest, Failure)> = config
                .snapshot_failures
                .iter()
                .map(|t| {
                    (
                        TargetId(*t),
                        digest,
                        Failure::new(ErrorCode::DESERIALIZE_FAILED, "the snapshot entry failed"),
                    )
                })
                .collect();
            let failed = parent
                .snapshot_failed(&failures, Time(0))
                .map_err(|e| ConfigError(format!("snapshot_failed: {e}")))?;
            snapshot_ops = u64::try_from(failed.len()).unwrap_or(u64::MAX);
        }
        let mut targets = Vec::new();
        for i in 0..config.targets {
            let failed: Vec<Digest> = failing
                .filter(|_| config.snapshot_failures.contains(&i))
                .into_iter()
                .collect();
            let target = Target::with_snapshot_failures(
                TargetConfig {
                    id: TargetId(i),
                    slot_capacity: config.slot_capacity,
                },
                &snapshot,
                &failed,
            )
            .map_err(|e| ConfigError(format!("target {i}: {e}")))?;
            #[cfg(feature = "mutants")]
            let target = match config.mutant {
                Some(mutant) => target.with_mutant(mutant),
                None => target,
            };
            targets.push(Some(target));
        }
        let n = usize::from(config.targets);
        let init = State {
            parent,
            targets,
            frames: Vec::new(),
            replies: Vec::new(),
            eof: vec![false; n],
            sides: vec![TargetSide::default(); n],
            staged: BTreeMap::new(),
            client: vec![StepStatus::Waiting; config.script.operations.len()],
            tasks: Vec::new(),
            now: 0,
            budgets: Budgets {
                crashes: config.crashes,
                deserialize_failures: config.deserialize_failures,
                stage_failures: config.stage_failures,
                corruptions: config.corruptions,
                deadlines: config.deadlines,
                tasks: config.tasks,
            },
            seen: 0,
        };
        let mut model = RegistrationModel {
            config,
            init: init.clone(),
            before_start_handles,
            snapshot_ops,
        };
        // The settling unregisters are on their way before the first step.
        let mut init = init;
        model.drain_parent(&mut init);
        model.init = init;
        Ok(model)
    }

    fn target_ids(&self) -> impl Iterator<Item = TargetId> {
        (0..self.config.targets).map(TargetId)
    }

    /// Whether script operation `i` may be issued in `state`.
    fn issuable(&self, state: &State, i: usize) -> bool {
        state.client.get(i) == Some(&StepStatus::Waiting)
            && self
                .config
                .script
                .dependencies(i)
                .iter()
                .all(|j| matches!(state.client.get(*j), Some(StepStatus::Done(_))))
    }

    /// Whether no action can change `state` (the checker's terminal states).
    ///
    /// Every listed action but [`Action::Submit`] always has a next state
    /// (`actions` lists only enabled ones); a submit may still be refused by
    /// the parent, so only those are tried.
    pub fn is_terminal(&self, state: &State) -> bool {
        let mut actions = Vec::new();
        stateright::Model::actions(self, state, &mut actions);
        actions.into_iter().all(|a| {
            matches!(a, Action::Submit { .. })
                && stateright::Model::next_state(self, state, a).is_none()
        })
    }

    /// The handle a script reference names in `state`, if it was published.
    fn handle_of(&self, state: &State, reference: HandleRef) -> Option<Handle> {
        match reference {
            HandleRef::BeforeStart(i) => self.before_start_handles.get(i).copied().flatten(),
            HandleRef::Operation(j) => {
                let StepStatus::Done(StepResult::Registered(handle_id)) = state.client.get(j)?
                else {
                    return None;
                };
                let Operation::Register(c) = self.config.script.operations.get(j)?.operation else {
                    return None;
                };
                Some(handle_for(digest_of(c)?, *handle_id))
            }
        }
    }

    /// Carries out the parent's effects, in order (the driving rule).
    fn drain_parent(&self, state: &mut State) {
        while let Some(effect) = state.parent.poll_effect() {
            match effect {
                Effect::Stage { staging, digest } => {
                    state.staged.insert(staging, digest);
                }
                Effect::Send { target, frame } => {
                    // Writing to a dead child's pipe fails; the parent learns
                    // of the death from end of file, not from the write.
                    if state.target(target).is_some() {
                        insert_ordered(&mut state.frames, target, frame);
                    }
                }
                Effect::ReleaseStaged { staging } => {
                    state.staged.remove(&staging);
                }
                Effect::Fence { target } => {
                    // Fencing kills and reaps the child and closes both pipe
                    // ends: nothing more is read from it.
                    state.kill(target);
                    state.replies.retain(|(t, _)| *t != target);
                    if let Some(eof) = state.eof.get_mut(usize::from(target.0)) {
                        *eof = false;
                    }
                }
                Effect::Completed {
                    op,
                    result,
                    outcomes,
                } => {
                    let rolled_back = outcomes
                        .iter()
                        .any(|(_, o)| matches!(o, TargetOutcome::RolledBack));
                    let done = match result {
                        Ok(Completion::Registered(handle)) => {
                            StepResult::Registered(handle.handle_id)
                        }
                        Ok(Completion::Unregistered(_)) => StepResult::Unregistered,
                        Err(error) => StepResult::Failed {
                            code: error.code,
                            rolled_back,
                        },
                    };
                    match state
                        .client
                        .iter_mut()
                        .find(|s| **s == StepStatus::InFlight(op))
                    {
                        Some(step) => *step = StepStatus::Done(done),
                        // A snapshot entry's settling unregister: nobody waits.
                        None if op.0 <= self.snapshot_ops => {}
                        None => state.seen |= seen::DRIVER_ERROR,
                    }
                }
            }
        }
    }

    /// Carries out target `id`'s effects, in order.
    fn drain_target(&self, state: &mut State, id: TargetId) {
        let index = usize::from(id.0);
        while let Some(effect) = state.targets[index].as_mut().and_then(Target::poll_effect) {
            match effect {
                TargetEffect::Reply(reply) => insert_ordered(&mut state.replies, id, reply),
                TargetEffect::Deserialize { seq, slot, .. } => {
                    let side = &mut state.sides[index];
                    if side.freed_tombstones & (1u64 << slot.0) != 0 {
                        state.seen |= seen::SLOT_REUSED_AFTER_TOMBSTONE;
                    }
                    side.deserializing.push(seq);
                }
            }
        }
    }

    /// Issues script operation `i`; with `stage_fails`, a register's
    /// [`Effect::Stage`] fails and the driver reports it with
    /// `Parent::stage_failed` before polling further (the driving rule).
    fn issue(&self, state: &mut State, i: usize, stage_fails: bool) -> Option<()> {
        let step = self.config.script.operations.get(i)?;
        state.now += 1;
        let now = Time(state.now);
        let started = match step.operation {
            Operation::Register(c) => {
                state
                    .parent
                    .register(digest_of(c)?, Namespace::LocalPython, now)
            }
            Operation::Unregister(reference) => match self.handle_of(state, reference) {
                Some(handle) => state.parent.unregister(&handle, now),
                None => {
                    state.client[i] = StepStatus::Done(StepResult::Skipped);
                    return Some(());
                }
            },
        };
        state.client[i] = match started {
            Ok(op) => StepStatus::InFlight(op),
            Err(error) => StepStatus::Done(StepResult::Refused(error.code)),
        };
        if stage_fails {
            // A refused register stages nothing: the fault does not apply.
            if !matches!(state.client[i], StepStatus::InFlight(_)) {
                return None;
            }
            match state.parent.poll_effect() {
                Some(Effect::Stage { staging, .. }) => {
                    let failure = Failure::new(
                        ErrorCode::IO_FAILED,
                        "shared memory for the staged payload could not be created",
                    );
                    if state.parent.stage_failed(staging, failure).is_err() {
                        state.seen |= seen::DRIVER_ERROR;
                    }
                }
                // Only registers are offered a staging failure, and their
                // first effect is always Stage.
                _ => return None,
            }
        }
        self.drain_parent(state);
        Some(())
    }

    fn deliver(&self, state: &mut State, id: TargetId, corrupted: bool) -> Option<()> {
        let index = usize::from(id.0);
        let frame = take_head(&mut state.frames, id)?;
        let target = state.targets.get_mut(index)?.as_mut()?;
        match frame {
            ControlFrame::Register {
                seq,
                digest,
                staging,
            } => {
                let verified = if corrupted {
                    Ok(CORRUPTED)
                } else {
                    state.staged.get(&staging).copied().ok_or_else(|| {
                        Failure::new(
                            ErrorCode::IO_FAILED,
                            format!("staged payload {} does not exist", staging.0),
                        )
                    })
                };
                target.on_register(seq, digest, verified);
            }
            ControlFrame::Unregister { seq, digest } => target.on_unregister(seq, digest),
            ControlFrame::Task { seq, digest } => {
                let handle_id = state
                    .tasks
                    .iter()
                    .position(|(s, _)| *s == seq)
                    .map(|at| state.tasks.remove(at).1);
                match target.begin_task(seq, digest) {
                    Ok(_) => state.sides[index].runs.push(seq),
                    Err(error) => {
                        let live = handle_id.is_some_and(|h| {
                            state.parent.live_handles().iter().any(|l| l.handle_id == h)
                        });
                        if error.code == ErrorCode::DIGEST_NOT_INSTALLED && live {
                            state.seen |= seen::DISPATCH_UNSAFE;
                        }
                    }
                }
            }
        }
        self.drain_target(state, id);
        Some(())
    }
}

impl State {
    fn target(&self, id: TargetId) -> Option<&Target> {
        self.targets.get(usize::from(id.0))?.as_ref()
    }

    /// Target `id` dies: its machine, the frames to it, its deserializations
    /// and runs are gone (replies already written stay readable).
    fn kill(&mut self, id: TargetId) {
        let index = usize::from(id.0);
        if let Some(slot) = self.targets.get_mut(index) {
            *slot = None;
        }
        let frames = &mut self.frames;
        frames.retain(|(t, _)| *t != id);
        self.tasks.retain(|(seq, _)| {
            frames
                .iter()
                .any(|(_, f)| matches!(f, ControlFrame::Task { seq: s, .. } if s == seq))
        });
        if let Some(side) = self.sides.get_mut(index) {
            *side = TargetSide::default();
        }
    }
}

impl stateright::Model for RegistrationModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.init.clone()]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        for i in 0..state.client.len() {
            if self.issuable(state, i) {
                actions.push(Action::Issue(i));
                let register = matches!(
                    self.config.script.operations[i].operation,
                    Operation::Register(_)
                );
                if register && state.budgets.stage_failures > 0 {
                    actions.push(Action::IssueStageFails(i));
                }
            }
        }
        if state.budgets.tasks > 0 {
            for handle in state.parent.live_handles() {
                for target in self.target_ids() {
                    if state.parent.is_target_live(target) && state.target(target).is_some() {
                        actions.push(Action::Submit {
                            handle_id: handle.handle_id,
                            target,
                        });
                    }
                }
            }
        }
        let active = !state.script_done() || state.has_traffic();
        for id in self.target_ids() {
            let index = usize::from(id.0);
            if let Some(frame) = state.head_frame(id) {
                actions.push(Action::Deliver(id));
                if state.budgets.corruptions > 0 && matches!(frame, ControlFrame::Register { .. }) {
                    actions.push(Action::DeliverCorrupted(id));
                }
            }
            let side = &state.sides[index];
            if !side.deserializing.is_empty() {
                actions.push(Action::Deserialized {
                    target: id,
                    ok: true,
                });
                if state.budgets.deserialize_failures > 0 {
                    actions.push(Action::Deserialized {
                        target: id,
                        ok: false,
                    });
                }
            }
            for seq in &side.runs {
                actions.push(Action::EndRun {
                    target: id,
                    seq: *seq,
                });
            }
            if state.head_reply(id).is_some() || state.eof[index] {
                actions.push(Action::Receive(id));
            }
            if state.budgets.crashes > 0 && active && state.target(id).is_some() {
                actions.push(Action::Crash(id));
            }
        }
        if state.budgets.deadlines > 0 && state.parent.poll_timeout().is_some() {
            actions.push(Action::DeadlinePasses);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Issue(i) => self.issue(&mut state, i, false)?,
            Action::IssueStageFails(i) => {
                state.budgets.stage_failures = state.budgets.stage_failures.checked_sub(1)?;
                self.issue(&mut state, i, true)?;
            }
            Action::Submit { handle_id, target } => {
                let digest = state
                    .parent
                    .live_handles()
                    .into_iter()
                    .find(|h| h.handle_id == handle_id)?
                    .digest();
                let seq = state
                    .parent
                    .submit(&handle_for(digest, handle_id), target)
                    .ok()?;
                state.budgets.tasks -= 1;
                state.tasks.push((seq, handle_id));
                self.drain_parent(&mut state);
            }
            Action::Deliver(id) => self.deliver(&mut state, id, false)?,
            Action::DeliverCorrupted(id) => {
                state.budgets.corruptions = state.budgets.corruptions.checked_sub(1)?;
                self.deliver(&mut state, id, true)?;
            }
            Action::Deserialized { target: id, ok } => {
                let index = usize::from(id.0);
                if !ok {
                    state.budgets.deserialize_failures =
                        state.budgets.deserialize_failures.checked_sub(1)?;
                }
                let side = state.sides.get_mut(index)?;
                if side.deserializing.is_empty() {
                    return None;
                }
                let seq = side.deserializing.remove(0);
                let result = if ok {
                    Ok(())
                } else {
                    Err(Failure::new(
                        ErrorCode::DESERIALIZE_FAILED,
                        "the runtime failed to deserialize the payload",
                    ))
                };
                let target = state.targets.get_mut(index)?.as_mut()?;
                if target.on_deserialized(seq, result).is_err() {
                    state.seen |= seen::DRIVER_ERROR;
                }
                self.drain_target(&mut state, id);
            }
            Action::EndRun { target: id, seq } => {
                let index = usize::from(id.0);
                let side = state.sides.get_mut(index)?;
                let at = side.runs.iter().position(|s| *s == seq)?;
                side.runs.remove(at);
                let target = state.targets.get_mut(index)?.as_mut()?;
                let before = target.tombstoned_slots();
                if target.end_task(seq).is_err() {
                    state.seen |= seen::DRIVER_ERROR;
                }
                let after = target.tombstoned_slots();
                for slot in before.iter().filter(|s| !after.contains(s)) {
                    state.sides[index].freed_tombstones |= 1u64 << slot.0;
                }
            }
            Action::Receive(id) => {
                let now = Time(state.now);
                let index = usize::from(id.0);
                if let Some(reply) = take_head(&mut state.replies, id) {
                    if state.parent.is_target_live(id) && !state.parent.awaits_reply(id, reply.seq)
                    {
                        state.seen |= seen::LATE_REPLY;
                    }
                    if state.parent.handle_reply(id, reply, now).is_err() {
                        state.seen |= seen::DRIVER_ERROR;
                    }
                } else if state.eof[index] {
                    state.eof[index] = false;
                    if state.parent.target_lost(id, now).is_err() {
                        state.seen |= seen::DRIVER_ERROR;
                    }
                } else {
                    return None;
                }
                self.drain_parent(&mut state);
            }
            Action::Crash(id) => {
                state.budgets.crashes = state.budgets.crashes.checked_sub(1)?;
                state.target(id)?;
                state.kill(id);
                state.eof[usize::from(id.0)] = true;
            }
            Action::DeadlinePasses => {
                state.budgets.deadlines = state.budgets.deadlines.checked_sub(1)?;
                let deadline = state.parent.poll_timeout()?;
                state.now = state.now.max(deadline.0);
                state.parent.handle_timeout(Time(state.now));
                self.drain_parent(&mut state);
            }
        }
        Some(state)
    }

    fn format_action(&self, action: &Action) -> String {
        format!("{action:?}")
    }

    /// For the Explorer: the step in words, the resulting state in brief,
    /// then in full.
    fn format_step(&self, last: &State, action: Action) -> Option<String> {
        let next = self.next_state(last, action)?;
        Some(format!(
            "{}\n\n{}\n\n{next:#?}",
            self.describe(last, &action),
            self.summarize(&next)
        ))
    }

    fn properties(&self) -> Vec<stateright::Property<Self>> {
        crate::properties::all()
    }
}

impl RegistrationModel {
    /// A one-line description of `action` taken in `state`, for traces:
    /// names the operation, frame or reply involved.
    pub fn describe(&self, state: &State, action: &Action) -> String {
        let frame_text = |f: &ControlFrame| match f {
            ControlFrame::Register { seq, digest, .. } => {
                format!("register {} ({seq})", name_of(digest))
            }
            ControlFrame::Unregister { seq, digest } => {
                format!("unregister {} ({seq})", name_of(digest))
            }
            ControlFrame::Task { seq, digest } => format!("task on {} ({seq})", name_of(digest)),
        };
        match action {
            Action::Issue(i) => {
                let what = match self.config.script.operations.get(*i).map(|s| &s.operation) {
                    Some(Operation::Register(c)) => format!("register {c}"),
                    Some(Operation::Unregister(HandleRef::BeforeStart(j))) => {
                        format!("unregister the handle of before_start[{j}]")
                    }
                    Some(Operation::Unregister(HandleRef::Operation(j))) => {
                        format!("unregister the handle of operation {j}")
                    }
                    None => "nothing".to_owned(),
                };
                format!("client issues operation {i}: {what}")
            }
            Action::IssueStageFails(i) => format!(
                "{}, and staging its payload FAILS",
                self.describe(state, &Action::Issue(*i))
            ),
            Action::Submit { handle_id, target } => {
                format!("client dispatches a task for handle {handle_id} to {target}")
            }
            Action::Deliver(t) => match state.head_frame(*t) {
                Some(f) => format!("{t} applies {}", frame_text(f)),
                None => format!("{t} applies nothing"),
            },
            Action::DeliverCorrupted(t) => match state.head_frame(*t) {
                Some(f) => format!(
                    "{t} applies {} but its staged payload is corrupted",
                    frame_text(f)
                ),
                None => format!("{t} applies nothing"),
            },
            Action::Deserialized { target, ok } => {
                let seq = state
                    .sides
                    .get(usize::from(target.0))
                    .and_then(|s| s.deserializing.first());
                let how = if *ok { "succeeds" } else { "FAILS" };
                match seq {
                    Some(seq) => format!("{target}: deserialization for {seq} {how}"),
                    None => format!("{target}: no deserialization"),
                }
            }
            Action::EndRun { target, seq } => format!("{target}: run of task {seq} ends"),
            Action::Receive(t) => match state.head_reply(*t) {
                Some(r) => {
                    let late = if state.parent.is_target_live(*t)
                        && !state.parent.awaits_reply(*t, r.seq)
                    {
                        " (LATE: its operation gave up on it)"
                    } else {
                        ""
                    };
                    let result = match &r.result {
                        Ok(()) => "OK".to_owned(),
                        Err(f) => f.code.to_string(),
                    };
                    format!(
                        "parent receives from {t}: reply {result} to {} for {}{late}",
                        r.seq,
                        name_of(&r.digest)
                    )
                }
                None => format!("parent reads end of file from {t}: target lost"),
            },
            Action::Crash(t) => format!("{t} CRASHES"),
            Action::DeadlinePasses => match state.parent.poll_timeout() {
                Some(d) => format!("the deadline at time {} passes", d.0),
                None => "no deadline is pending".to_owned(),
            },
        }
    }

    /// A short summary of `state` for the end of a trace: the client's
    /// results, live handles, uncertain digests, staged payloads and each
    /// target's installed digests with refcounts.
    pub fn summarize(&self, state: &State) -> String {
        let mut out = Vec::new();
        out.push(format!("client: {:?}", state.client));
        let handles: Vec<String> = state
            .parent
            .live_handles()
            .iter()
            .map(|h| format!("{}={}", h.handle_id, name_of(&h.digest())))
            .collect();
        out.push(format!("live handles: [{}]", handles.join(", ")));
        let uncertain: Vec<String> = state
            .parent
            .uncertain_digests()
            .iter()
            .map(name_of)
            .collect();
        out.push(format!("uncertain: [{}]", uncertain.join(", ")));
        out.push(format!(
            "staged: {:?}",
            state.staged.keys().map(|s| s.0).collect::<Vec<_>>()
        ));
        for (i, target) in state.targets.iter().enumerate() {
            let text = match target {
                None => "dead".to_owned(),
                Some(t) => {
                    let installed: Vec<String> = t
                        .installed()
                        .iter()
                        .map(|(d, n)| format!("{}x{n}", name_of(d)))
                        .collect();
                    format!(
                        "installed [{}], {} slots used, {} runs",
                        installed.join(", "),
                        t.slots_in_use(),
                        t.runs_in_progress()
                    )
                }
            };
            out.push(format!("target {i}: {text}"));
        }
        out.join("\n")
    }

    /// The first invariant (1–9) `state` breaks, with what was seen.
    ///
    /// # Errors
    /// The [`Violation`] from the library's predicates.
    pub fn check_invariants(&self, state: &State) -> Result<(), Violation> {
        state.with_view(invariants::check_all)
    }
}

/// The command-line name of a mutant: its variant name in kebab case,
/// e.g. `publish-before-all-replies`.
#[cfg(feature = "mutants")]
pub fn mutant_name(mutant: Mutant) -> String {
    let mut name = String::new();
    for (i, c) in format!("{mutant:?}").chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                name.push('-');
            }
            name.push(c.to_ascii_lowercase());
        } else {
            name.push(c);
        }
    }
    name
}

/// The mutant called `name` ([`mutant_name`]), if any.
#[cfg(feature = "mutants")]
pub fn mutant_named(name: &str) -> Option<Mutant> {
    Mutant::ALL
        .iter()
        .copied()
        .find(|m| mutant_name(*m) == name)
}

/// Whether `mutant`'s code path is reachable only with fencing off
/// (`fence_on_timeout: false`, `--no-fence`): `forget-uncertain` skips
/// marking a digest uncertain, which happens only when a silent target is
/// left running instead of fenced (DESIGN.md §4.1).
#[cfg(feature = "mutants")]
pub fn mutant_needs_no_fence(mutant: Mutant) -> bool {
    mutant == Mutant::ForgetUncertain
}

/// Every mutant's command-line name (none without the `mutants` feature).
pub fn mutant_names() -> Vec<String> {
    #[cfg(feature = "mutants")]
    return Mutant::ALL.iter().map(|m| mutant_name(*m)).collect();
    #[cfg(not(feature = "mutants"))]
    Vec::new()
}
