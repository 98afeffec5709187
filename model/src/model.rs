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
    Completion, ControlFrame, ControlPhase, Effect, Failure, Handle, Lifecycle, Namespace, OpId,
    OwnerToken, Parent, ParentConfig, Reply, Seq, Slot, StagingId, Target, TargetConfig,
    TargetEffect, TargetId, TargetOutcome, TargetPhase, TaskEnd, Time, BOUND_FENCE_CAUSE,
};

use crate::script::{digest_of, name_of, BeforeStart, HandleRef, Operation, Script, CORRUPTED};

/// How long (model time units) a target has to answer a control. Larger
/// than the number of operations any script issues, so the deadlines of
/// successive operations stay in issue order.
pub const CONTROL_TIMEOUT: u64 = 1_000;

/// How the driver says a target died (`Parent::target_died`).
pub const LOSS_CAUSE: &str = "its reply socket closed";
/// The parent's operation timeout in the model (model time units): a
/// heartbeat just before a silence deadline moves it to almost twice the
/// control timeout after the send, still before the bound (so a target
/// heard once and then silent is fenced at its new silence deadline); a
/// second one moves it past the bound (so the bound ends the wait).
pub const OPERATION_TIMEOUT: u64 = 2 * CONTROL_TIMEOUT + CONTROL_TIMEOUT / 2;

/// The back-off (model time units) before the second replacement in a
/// row of one target (`ParentConfig::respawn_backoff`; it doubles for each
/// further one): well below [`CONTROL_TIMEOUT`], so a back-off after a
/// loss ends before the deadlines of the operations then in flight.
pub const RESPAWN_BACKOFF: u64 = 100;

/// How the driver says a replacement could not be started
/// (`Parent::target_died` for a target waiting for `Parent::target_spawned`).
pub const SPAWN_FAILURE_CAUSE: &str = "its process could not be started";

/// The message of a nested refusal ([`Action::PoisonRefused`]): a
/// target that is itself a registry refuses a register with
/// `REGISTER_POISONED` because its own probe lost a process.
pub const NESTED_POISON_CAUSE: &str =
    "installing it killed a process of this target's own registry, which refuses it";

/// How long after its submit a task's deadline is, with
/// [`ModelConfig::task_deadline`] (model time units): as a control's, so
/// that deadlines stay in issue order.
pub const TASK_DEADLINE: u64 = CONTROL_TIMEOUT;

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
    /// How many times the client may cancel a task in flight
    /// (`Parent::cancel`, `specs/protocol.md` §2.11).
    pub cancels: u8,
    /// Whether every task is submitted with a timeout of
    /// [`TASK_DEADLINE`] (`Parent::submit_with_timeout`, §2.12): its
    /// deadline is that long after its start report is read, and passes
    /// like any deadline ([`Action::DeadlinePasses`], from the `deadlines`
    /// budget).
    pub task_deadline: bool,
    /// How many task results of a lost process may still reach the parent
    /// after the loss, tagged with that process's incarnation (a stale
    /// result: the channel fault of [`Action::ReceiveStale`]).
    pub stale_results: u8,
    /// How many control replies of a lost process may still reach the
    /// parent after the loss (a stale reply: the channel fault of
    /// [`Action::ReceiveStaleReply`]): at each loss, while this budget
    /// lasts, the replies the process had written and the parent had not
    /// read are kept, with those its deserializations in progress would
    /// have written, to arrive later, before or after the slot's
    /// replacement was started or joined.
    pub stale_replies: u8,
    /// How many heartbeats targets may send, each an alive report for every
    /// control the parent awaits from the target, just before the earliest
    /// pending deadline (`specs/protocol.md` §2.7). Not a fault: every real
    /// target sends them; 0 in [`ModelConfig::standard`], where they would
    /// multiply the space without reaching a new path of the other rules,
    /// and set in the configurations that check the deadline rule.
    pub heartbeats: u8,
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
    /// Whether the pre-start steps of the script and `Parent::start` are
    /// actions (any pre-start step may then come after start and must be
    /// refused), instead of running in order before the first state.
    pub interleave_start: bool,
    /// How many times the client may close the Worker (0 or 1): `Parent::close`
    /// as an action, with operations possibly in flight.
    pub closes: u8,
    /// Whether forged and out-of-range inputs are offered as actions (target
    /// ids one past the last, seqs never issued, staging ids with no waiting
    /// register, unknown deserializations and runs, a second start or close):
    /// each must be refused with its documented error and change nothing.
    pub forged: bool,
    /// How many replies may reach the parent naming another digest than the
    /// frame they answer (a misbehaving target).
    pub wrong_digests: u8,
    /// The parent's probe-first policy (`ParentConfig::probe_first`).
    pub probe_first: bool,
    /// How many deserializations may kill their target instead of ending
    /// (a poison payload: the target dies while deserializing).
    pub poison_kills: u8,
    /// How many deserializations may end with a refusal as poisoned
    /// ([`Action::PoisonRefused`]: a target that is itself a registry,
    /// whose own probe lost a process; `specs/protocol.md` §2.8 "A nested
    /// refusal"); the target stays alive.
    pub poison_refusals: u8,
    /// Replacement targets (`ParentConfig::respawn_limit`,
    /// `specs/protocol.md` §2.9): 0 switches them off; otherwise a lost
    /// target gets a new process ([`Action::Spawn`]), and this many
    /// replacements of one target in a row may be lost before they join.
    pub respawn_limit: u16,
    /// How many replacements may fail to start ([`Action::SpawnFails`]).
    pub spawn_failures: u8,
    /// How many replays may fail to stage their payload again for a
    /// joining replacement ([`Action::SpawnRestageFails`]).
    pub restage_failures: u8,
    /// How many times the template process may be lost
    /// ([`Action::TemplateLost`]; once ends replacements for good).
    pub template_losses: u8,
    /// Replacements are arrivals (`ParentConfig::unbounded_spawn`,
    /// `specs/protocol.md` §2.9 "Arrivals"): a target asked for by an
    /// `Effect::Spawn` is open, with no ready deadline, until
    /// [`Action::Spawn`] starts it, however late.
    pub arrivals: bool,
    /// Every loss is a departure (`Parent::target_left`,
    /// `specs/protocol.md` §2.8 "A departure"): the driver reports end of
    /// file as a target that left, as a cluster's registry reports a
    /// worker that left or was killed; no loss is evidence against a
    /// digest being probed.
    pub departures: bool,
    /// The client submits tasks with no target ([`Action::SubmitAny`],
    /// `Parent::submit_any`, `specs/protocol.md` §2.14): the machine picks
    /// the target, or keeps the task waiting for one.
    pub submit_any: bool,
    /// At most this many tasks per target process
    /// (`ParentConfig::max_tasks_per_target`, §2.14; 0: no bound): a
    /// process sent them is retired once they ended, and replaced.
    pub max_tasks_per_target: u32,
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
            cancels: 0,
            task_deadline: false,
            stale_results: 0,
            stale_replies: 0,
            heartbeats: 0,
            fence_on_timeout: true,
            slot_capacity: 2,
            snapshot_failures: Vec::new(),
            interleave_start: false,
            closes: 0,
            forged: false,
            wrong_digests: 0,
            probe_first: true,
            poison_kills: 0,
            poison_refusals: 0,
            respawn_limit: 0,
            spawn_failures: 0,
            restage_failures: 0,
            template_losses: 0,
            arrivals: false,
            departures: false,
            submit_any: false,
            max_tasks_per_target: 0,
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
            heartbeats: 0,
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
    InFlight {
        /// The operation.
        op: OpId,
        /// Its scope as the driver saw it at issue: bit `t` set when a
        /// frame of the operation was sent to target `t` (the targets its
        /// completion must report on).
        scope: u32,
        /// The model time it was issued at: no target of it may time out
        /// before `issued + CONTROL_TIMEOUT`.
        issued: u64,
        /// Bit `t` set when target `t`'s awaited reply to the operation's
        /// own frame refused it (or named a wrong digest): its outcome must
        /// be `Failed` (or, for a register, never `Ok`).
        refused: u32,
        /// A register that must probe first (`specs/protocol.md` §2.8): with
        /// probe-first on, its digest had not been confirmed by any target
        /// when it was issued (by the driver's own record, [`State::proven`]).
        probing: bool,
        /// Some target's OK reply to its frame has reached the parent.
        confirmed: bool,
    },
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

/// Where the client stands with one pre-start step of its script.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum PreStatus {
    /// Not called yet.
    Waiting,
    /// Called and accepted: the handle id a register got (`None` for an
    /// unregister).
    Done(Option<u64>),
    /// Called and refused with this error (e.g. after start), or skipped
    /// (an unregister of a refused register: `None`).
    Refused(Option<ErrorCode>),
}

/// What the driver keeps about one target beside its machine: what it
/// must still report to it (deserializations, runs) and, for the
/// slot-reuse witness, which slots were freed after a tombstone.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Default)]
pub struct TargetSide {
    /// Register seqs whose deserialization is in progress, oldest first,
    /// with the slot the machine reserved for each.
    pub deserializing: Vec<(Seq, Slot)>,
    /// Task seqs whose run is in progress, oldest first, with the slot
    /// `begin_task` returned and the digest the task named.
    pub runs: Vec<(Seq, Slot, Digest)>,
    /// The runs of `runs` whose task started (`Target::start_task` said
    /// `true`), in start order.
    pub started: Vec<Seq>,
    /// The incarnation of the target this process is (0 for the original).
    pub incarnation: u32,
    /// Bit `s` set: slot `s` was tombstoned and then freed.
    pub freed_tombstones: u64,
    /// The alive reports this target sent: control seq and model time of
    /// the latest report for it.
    pub alive: Vec<(Seq, u64)>,
    /// The controls whose latest alive report said *running*
    /// (`ControlPhase::Running`: their deserialization was in progress
    /// when it was sent), in seq order; the others reported said *queued*.
    pub running: Vec<Seq>,
    /// With [`ModelConfig::arrivals`]: this process arrived (was started)
    /// at or after the time an ordinary replacement's ready deadline would
    /// have fenced it.
    pub late_arrival: bool,
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
    /// Closes left.
    pub closes: u8,
    /// Replies naming a wrong digest left.
    pub wrong_digests: u8,
    /// Deadline passings left.
    pub deadlines: u8,
    /// Tasks left.
    pub tasks: u8,
    /// Cancels left.
    pub cancels: u8,
    /// Stale results that may still be kept and delivered.
    pub stale_results: u8,
    /// Stale replies that may still be kept and delivered.
    pub stale_replies: u8,
    /// Deserializations that may still kill their target.
    pub poison_kills: u8,
    /// Deserializations that may still end refused as poisoned.
    pub poison_refusals: u8,
    /// Alive reports left.
    pub heartbeats: u8,
    /// Replacements that may still fail to start.
    pub spawn_failures: u8,
    /// Replays whose payload may still fail to stage again.
    pub restage_failures: u8,
    /// Template losses left.
    pub template_losses: u8,
}

/// Something the driver saw happen on this path (history the properties
/// need beyond the current state), as bits of [`State::seen`].
pub mod seen {
    /// A machine refused an input that the driving rule produced (an
    /// `Err` from `handle_reply`, `target_lost`, `on_deserialized`,
    /// `end_task`, or a completion for no known operation).
    pub const DRIVER_ERROR: u64 = 1;
    /// A task for a handle that was live at its arrival reached a live
    /// target lacking its digest (invariant 8 observed directly).
    pub const DISPATCH_UNSAFE: u64 = 2;
    /// A slot was reserved for a deserialization after it had been
    /// tombstoned and freed.
    pub const SLOT_REUSED_AFTER_TOMBSTONE: u64 = 4;
    /// A reply reached the parent after its operation stopped waiting for
    /// that target (a late reply).
    pub const LATE_REPLY: u64 = 8;
    /// A fault happened on this path: a crash, a corrupted payload, a
    /// failed deserialization or staging, a passed deadline, a close or a
    /// reply naming a wrong digest.
    pub const FAULT: u64 = 16;
    /// An operation failed, or was refused, on a path with no fault, other
    /// than a register some target refused for want of a free slot.
    pub const UNFORCED_FAILURE: u64 = 32;
    /// A machine answered a call otherwise than its documentation says:
    /// a forged or out-of-range input accepted or answered with another
    /// error, a call after close or before start not refused, a completion
    /// whose result disagrees with its outcomes or whose outcomes do not
    /// cover its scope. [`crate::properties::explain`] names which.
    pub const CONTRACT: u64 = 64;
    /// A reply naming a wrong digest reached the parent (a misbehaving
    /// target: with it even a fenced Worker has an uncertain digest).
    pub const WRONG_DIGEST: u64 = 128;
    /// The Worker closed with an operation in flight.
    pub const CLOSED_IN_FLIGHT: u64 = 256;
    /// Staging a register's payload failed.
    pub const STAGE_FAILED: u64 = 512;
    /// A pre-start step was refused because the Worker had started.
    pub const PRE_START_AFTER_START: u64 = 1024;
    /// A completed unregister failed (some target refused it or timed out).
    pub const UNREGISTER_FAILED: u64 = 4096;
    /// A passed deadline ended the wait for a target that had reported
    /// alive for every control it owed within the control timeout, before
    /// any of those controls' operation bound.
    pub const FENCED_WHILE_HEARD: u64 = 2048;
    /// A passed operation bound ended the wait for a target that had
    /// reported alive within the control timeout.
    pub const BOUND_ENDED_HEARD: u64 = 8192;
    /// A passed deadline ended the wait for some target while a target
    /// heard from within the control timeout about every control it owed
    /// stayed awaited.
    pub const SPARED_HEARD: u64 = 16384;
    /// A silence deadline (before any bound) ended the wait for a target
    /// that had reported alive for a control it owed, but not within the
    /// control timeout: a target that stops reporting is still fenced.
    pub const SILENT_AFTER_HEARD: u64 = 32768;
    /// A register that must probe first sent its frame to a second target
    /// before any target confirmed it.
    pub const PROBE_BROADCAST_EARLY: u64 = 1 << 16;
    /// A register frame of a poisoned digest was sent.
    pub const POISON_SENT: u64 = 1 << 17;
    /// A register was refused with `REGISTER_POISONED`.
    pub const POISON_REFUSED: u64 = 1 << 18;
    /// A replacement joined (`Effect::Joined`, `specs/protocol.md` §2.9).
    pub const JOINED: u64 = 1 << 19;
    /// A replacement joined while a client operation was in flight.
    pub const JOINED_IN_FLIGHT: u64 = 1 << 20;
    /// A joining replacement refused a replay or did not answer it in time
    /// (`Effect::JoinFailed`, then its fence).
    pub const JOIN_FAILED: u64 = 1 << 21;
    /// A target was given up (`Effect::Abandoned`: the rate limit).
    pub const ABANDONED: u64 = 1 << 22;
    /// A replacement could not be started ([`super::Action::SpawnFails`]).
    pub const SPAWN_FAILED: u64 = 1 << 23;
    /// A back-off before a replacement passed (`Parent::handle_timeout`
    /// with no operation's deadline due).
    pub const BACKOFF_PASSED: u64 = 1 << 24;
    /// A task ended ([`callreg::protocol::Effect::TaskDone`]) a second time.
    pub const TASK_DONE_TWICE: u64 = 1 << 25;
    /// A task ended cancelled although its run had started, or a run
    /// started after the target answered a cancel of it OK.
    pub const CANCELLED_AND_RUN: u64 = 1 << 26;
    /// A task's run started twice (on any target or incarnation).
    pub const RUN_TWICE: u64 = 1 << 27;
    /// A task ended with a result that did not come, live, from the
    /// incarnation of its target that ran it (a stale result, or none).
    pub const FOREIGN_RESULT: u64 = 1 << 28;
    /// A task past its deadline at a passed deadline did not end
    /// `Deadline`, or its target was not fenced.
    pub const DEADLINE_MISSED: u64 = 1 << 29;
    /// The parent reported a cancel refused (`Effect::CancelRefused`).
    pub const CANCEL_REFUSED: u64 = 1 << 30;
    /// A stale result (from a lost process) was delivered and refused.
    pub const STALE_REFUSED: u64 = 1 << 31;
    /// A run cancelled while queued reached its start and was skipped
    /// (`Target::start_task` said `false`).
    pub const RUN_SKIPPED: u64 = 1 << 32;
    /// A replay's payload could not be staged again for its joining
    /// replacement ([`super::Action::SpawnRestageFails`]).
    pub const RESTAGE_FAILED: u64 = 1 << 33;
    /// The template process was lost ([`super::Action::TemplateLost`]).
    pub const TEMPLATE_LOST: u64 = 1 << 34;
    /// A target was abandoned after the template was lost.
    pub const ABANDONED_WITHOUT_TEMPLATE: u64 = 1 << 35;
    /// A replacement was asked for after the template was lost.
    pub const SPAWN_WITHOUT_TEMPLATE: u64 = 1 << 36;
    /// A stale reply (of a lost process) changed the parent.
    pub const STALE_REPLY_CHANGED: u64 = 1 << 37;
    /// A stale reply reached the parent while a later process of its slot
    /// was joining.
    pub const STALE_REPLY_JOINING: u64 = 1 << 38;
    /// A stale reply reached the parent after a later process of its slot
    /// joined.
    pub const STALE_REPLY_JOINED: u64 = 1 << 39;
    /// With arrivals on, an open target (waiting for its arrival) was
    /// fenced, or left its wait at a passed deadline.
    pub const ARRIVAL_FENCED: u64 = 1 << 40;
    /// An arrival that came at or after the time an ordinary
    /// replacement's ready deadline would have fenced it joined.
    pub const LATE_ARRIVAL_JOINED: u64 = 1 << 41;
    /// A register frame of a digest whose probe was refused as poisoned
    /// ([`super::State::refused_probes`]) was sent after the refusal.
    pub const REFUSED_PROBE_SENT: u64 = 1 << 42;
    /// A probe's refusal as poisoned reached the parent.
    pub const PROBE_REFUSED_POISONED: u64 = 1 << 43;
    /// A refusal as poisoned from a target that was not probing reached
    /// the parent and poisoned nothing.
    pub const REFUSAL_OUTSIDE_PROBE: u64 = 1 << 44;
    /// A refusal as poisoned from a target that was not probing poisoned
    /// a digest.
    pub const REFUSAL_OUTSIDE_PROBE_POISONED: u64 = 1 << 45;
    /// With departures on, a target killed while deserializing departed
    /// (a witness).
    pub const POISON_DEPARTED: u64 = 1 << 46;
    /// With departures on, a departure poisoned a digest (a violation).
    pub const DEPARTURE_POISONED: u64 = 1 << 47;
    /// An uncertain digest became certain again: every doubt about it was
    /// settled (`specs/protocol.md` §2.4, "Uncertainty heals"; a witness).
    pub const HEALED: u64 = 1 << 48;
    /// A probe target fenced at the operation bound whose last alive
    /// report said the probe was queued (or never reported it) poisoned
    /// the digest (a violation, `specs/protocol.md` §2.8).
    pub const QUEUED_POISONED: u64 = 1 << 49;
    /// A probe target heard from within the control timeout, whose last
    /// alive report said the probe was queued, was fenced at the
    /// operation bound and the digest stayed unpoisoned (a witness).
    pub const QUEUED_SPARED: u64 = 1 << 50;
    /// A target's process retired after its task bound
    /// (`Effect::Retire`, `specs/protocol.md` §2.14; a witness).
    pub const RETIRED: u64 = 1 << 51;
    /// A task whose process was lost before it started was sent to
    /// another process (`specs/protocol.md` §2.15).
    pub const HANDED_OVER: u64 = 1 << 52;
}

/// A task's start report or result in transit target → parent: the task
/// and the incarnation of the process that ran it (how the IO layer tags
/// it).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct TaskResult {
    /// The task.
    pub seq: Seq,
    /// The callable it ran (the result frame names it).
    pub digest: Digest,
    /// The incarnation of the target whose process sent it.
    pub incarnation: u32,
    /// A start report (`specs/protocol.md` §2.12), sent when the run
    /// starts, not a result.
    pub start: bool,
}

/// How a task ended, as the driver records it (`TaskEnd` without the
/// loss's cause).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Ended {
    /// With its result.
    Result,
    /// Cancelled before it started.
    Cancelled,
    /// At its deadline.
    Deadline,
    /// With its target's process.
    Lost,
    /// At close.
    Closed,
}

/// What the driver recorded about one submitted task (its history, for the
/// task properties).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct TaskNote {
    /// The task.
    pub seq: Seq,
    /// The target it was sent to (while unsent: the target it waits
    /// for).
    pub target: TargetId,
    /// The incarnation of that target it was sent to (while unsent: at
    /// submit).
    pub incarnation: u32,
    /// Its frame was sent (a task submitted with no target may wait in
    /// the machine first, §2.14).
    pub sent: bool,
    /// It was not sent at its submit: it waited in the machine (§2.14).
    pub waited: bool,
    /// Its deadline (model time), if any.
    pub deadline: Option<u64>,
    /// When the last cancel of it was sent (model time), if any.
    pub cancelled_at: Option<u64>,
    /// Its run started (`Target::start_task` said `true`).
    pub started: bool,
    /// Its process was lost before it started, and it was handed over
    /// (§2.15).
    pub handed_over: bool,
    /// Its target answered a cancel of it OK.
    pub cancel_ok: bool,
    /// How many `TaskDone` effects named it.
    pub ends: u8,
    /// How the first of them ended it.
    pub end: Option<Ended>,
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
    /// The client's progress through the pre-start steps.
    pub pre: Vec<PreStatus>,
    /// The client's progress, one entry per script operation.
    pub client: Vec<StepStatus>,
    /// Task frames in transit: task seq → handle id it was submitted for.
    pub tasks: Vec<(Seq, u64)>,
    /// Task results in transit target → parent, ordered like `frames`
    /// (one FIFO per target, read beside the replies).
    pub results: Vec<(TargetId, TaskResult)>,
    /// Task results that were in transit when their process was fenced,
    /// kept (while the `stale_results` budget lasts) to reach the parent
    /// late, tagged with the lost process's incarnation.
    pub stale: Vec<(TargetId, TaskResult)>,
    /// Control replies of lost processes, kept (while the `stale_replies`
    /// budget lasts) to reach the parent after the loss: the slot, the
    /// incarnation of the process that wrote (or would have written) the
    /// reply, and the reply; ordered by slot, incarnation and seq.
    pub stale_replies: Vec<(TargetId, u32, Reply)>,
    /// Every task submitted, in seq order, with its history.
    pub task_log: Vec<TaskNote>,
    /// While a task result is handed to the parent: its seq and whether it
    /// comes, live, from the incarnation that ran it (always `None` between
    /// actions).
    pub delivering: Option<(Seq, bool)>,
    /// Model time (advances by one per issued operation, and to a
    /// deadline when it passes).
    pub now: u64,
    /// Fault budgets left.
    pub budgets: Budgets,
    /// Bits of [`seen`].
    pub seen: u64,
    /// Why the first [`seen::CONTRACT`] bit was set (for the
    /// counterexample), empty otherwise.
    pub contract: &'static str,
    /// Operations `1..=settling` are the unregisters the parent issued at
    /// start to settle a failed startup-snapshot entry
    /// (`Parent::snapshot_failed`): no client step waits for them.
    pub settling: u64,
    /// The digests the driver saw installed since start: the startup
    /// snapshot's, and each one an OK reply to a register of it brought
    /// to the parent (the driver's own record of what needs no probe).
    pub proven: Vec<Digest>,
    /// `spawns[i]`: the incarnation an `Effect::Spawn` asked for target
    /// *i* that the driver has not started yet (`specs/protocol.md` §2.9).
    pub spawns: Vec<Option<u32>>,
    /// `spawn_due[i]`: while a replacement asked for target *i* is not
    /// started, the time by which it must be (its `Effect::Spawn` plus
    /// [`CONTROL_TIMEOUT`]): past it the parent fences it (§2.9).
    pub spawn_due: Vec<Option<u64>>,
    /// The replays (`Effect::Restage`, then a register frame to a joining
    /// replacement) still in flight: operations no client step waits for.
    pub replays: Vec<OpId>,
    /// The digests whose probe a target refused as poisoned
    /// (`REGISTER_POISONED`, `specs/protocol.md` §2.8 "A nested refusal"),
    /// by the driver's own record: none may be sent again.
    pub refused_probes: Vec<Digest>,
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
            || !self.results.is_empty()
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

    /// Target `id`'s process `incarnation` writes the start report
    /// (`start`) or the result of task `seq` of `digest` to the parent.
    fn report(&mut self, id: TargetId, seq: Seq, digest: Digest, incarnation: u32, start: bool) {
        let report = TaskResult {
            seq,
            digest,
            incarnation,
            start,
        };
        insert_ordered(&mut self.results, id, report);
    }

    fn head_reply(&self, target: TargetId) -> Option<&Reply> {
        self.replies
            .iter()
            .find(|(t, _)| *t == target)
            .map(|(_, r)| r)
    }

    fn head_result(&self, target: TargetId) -> Option<TaskResult> {
        self.results
            .iter()
            .find(|(t, _)| *t == target)
            .map(|(_, r)| *r)
    }

    /// The record of task `seq`, if it was submitted.
    pub fn note(&self, seq: Seq) -> Option<&TaskNote> {
        self.task_log.iter().find(|n| n.seq == seq)
    }

    fn note_mut(&mut self, seq: Seq) -> Option<&mut TaskNote> {
        self.task_log.iter_mut().find(|n| n.seq == seq)
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
    /// The client dispatches a task for live handle `handle_id` with no
    /// target (`Parent::submit_any`, `specs/protocol.md` §2.14): the
    /// parent picks the target, or keeps the task until one takes tasks.
    SubmitAny {
        /// The handle id.
        handle_id: u64,
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
    /// The task thread of `target` is about to run task `seq`
    /// (`Target::start_task`): it runs, or (cancelled while queued) it is
    /// ended at once without a result.
    StartRun {
        /// The target.
        target: TargetId,
        /// The task.
        seq: Seq,
    },
    /// Task `seq`'s run on `target`, which started, ends (`end_task`) and
    /// its result is sent to the parent.
    EndRun {
        /// The target.
        target: TargetId,
        /// The task.
        seq: Seq,
    },
    /// The parent reads the next thing from `target`'s pipe: a reply, or
    /// end of file after a crash (once no result is left either).
    Receive(TargetId),
    /// The parent reads the next task result from `target`
    /// (`Parent::handle_task_result`).
    ReceiveResult(TargetId),
    /// A kept result of task `seq` from a lost process of `target`
    /// reaches the parent after the loss, with that process's incarnation
    /// (bounded: `stale_results`).
    ReceiveStale {
        /// The target.
        target: TargetId,
        /// The task.
        seq: Seq,
    },
    /// A kept control reply to `seq` from a lost process of `target`'s
    /// slot reaches the parent once it counts that process lost
    /// (`Parent::handle_reply`; bounded: `stale_replies`), before or after
    /// the target's replacement was started or joined.
    ReceiveStaleReply {
        /// The slot.
        target: TargetId,
        /// The control the reply answers.
        seq: Seq,
    },
    /// The client cancels task `seq`, in flight (`Parent::cancel`;
    /// bounded: `cancels`).
    Cancel(Seq),
    /// The target crashes: it holds nothing, frames to it are lost, and the
    /// parent will read end of file after its queued replies.
    Crash(TargetId),
    /// The target's oldest deserialization kills it (a poison payload): it
    /// dies as in `Crash`, while deserializing.
    PoisonKills(TargetId),
    /// The target's oldest deserialization ends with a failure of code
    /// `REGISTER_POISONED` instead of `DESERIALIZE_FAILED` (bounded:
    /// `poison_refusals`): a target that is itself a registry whose own
    /// probe lost a process (`specs/protocol.md` §2.8 "A nested
    /// refusal"). The target stays alive.
    PoisonRefused(TargetId),
    /// The earliest pending deadline (a target's silence deadline or an
    /// operation's bound) passes.
    DeadlinePasses,
    /// The client calls pre-start step `i` (only with
    /// [`ModelConfig::interleave_start`]; steps are called in order).
    PreStart(usize),
    /// The client starts the Worker: `Parent::start`, then every target is
    /// created holding the startup snapshot (only with
    /// [`ModelConfig::interleave_start`]).
    Start,
    /// The client closes the Worker (`Parent::close`).
    Close,
    /// As `Receive` for a reply, but the reply names another digest than
    /// the frame it answers (a misbehaving target).
    ReceiveWrongDigest(TargetId),
    /// A forged or out-of-range input (only with [`ModelConfig::forged`]).
    /// The machine must refuse it with its documented error and change
    /// nothing: then the action has no next state; otherwise the next
    /// state records the breach ([`seen::CONTRACT`]).
    Forge(Forged),
    /// `target` reports alive for every control the parent awaits from it
    /// (one heartbeat of its reader thread, which reads every control on
    /// arrival), just before the earliest pending deadline (model time
    /// moves there).
    Heartbeat(TargetId),
    /// The driver starts the replacement an `Effect::Spawn` asked for
    /// `target`: a fresh target holding nothing, with empty
    /// channels; then `Parent::target_spawned` (`specs/protocol.md` §2.9).
    Spawn(TargetId),
    /// The replacement asked for `target` cannot be started
    /// (bounded): `Parent::target_died`.
    SpawnFails(TargetId),
    /// As [`Action::Spawn`], but the first replay's payload cannot be
    /// staged again (bounded; only when the replacement has a registration
    /// to replay): the driver answers its `Effect::Restage` with
    /// `Parent::stage_failed` while draining, before the replay's frame is
    /// sent (§2.9: the replay is withdrawn and the join fails).
    SpawnRestageFails(TargetId),
    /// The template process that forks replacements is lost (bounded):
    /// the driver calls `Parent::replacements_ended`; a replacement asked
    /// for but not yet started will not start (its next `Spawn`/
    /// `SpawnFails` choice is only `SpawnFails`).
    TemplateLost,
}

/// The forged and out-of-range inputs of [`Action::Forge`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Forged {
    /// `handle_reply` from the target id one past the last, answering the
    /// newest seq issued: `FRAME_INVALID` once started.
    ReplyFromNoTarget,
    /// `handle_reply` from target 0 for seq 0 (never issued).
    ReplySeqZero,
    /// `handle_reply` from target 0 for the seq after the last issued.
    ReplySeqUnissued,
    /// `target_lost` of the target id one past the last.
    LostNoTarget,
    /// `stage_failed` for every register in flight (its frames were sent)
    /// and for the staging id after the last seq: `FRAME_INVALID`.
    StageFailedLate,
    /// `submit` of each live handle to the target id one past the last
    /// (`NO_LIVE_TARGET`), to each lost target (`TARGET_LOST`) and to each
    /// live target that never confirmed it (`DIGEST_NOT_INSTALLED`).
    SubmitOutOfScope,
    /// `on_deserialized` and `end_task` of a seq with no deserialization or
    /// run on each live target (`FRAME_INVALID`), and `on_register` of a
    /// seq being deserialized (a `FRAME_INVALID` reply, nothing else).
    TargetUnknownSeq,
    /// `start` again once started or closed, `close` again once closed,
    /// pre-start calls once started (`LIFECYCLE_INVALID`).
    LifecycleAgain,
    /// Registers in `LOCAL_CHIP`, which no target serves
    /// (`CALLABLE_KIND_UNSUPPORTED`), and resolving each live handle for it
    /// (`HANDLE_WRONG_NAMESPACE`).
    WrongNamespace,
    /// Before start: `register_before_start` of a digest not in the startup
    /// snapshot (refused with `LOCAL_SLOT_EXHAUSTED` exactly when the
    /// snapshot already holds as many digests as a target has slots) and
    /// of each digest in it (accepted: it takes no new slot).
    PreStartCapacity,
    /// `handle_alive` from the target id one past the last, and from each
    /// target for seq 0 and for the seq after the last issued
    /// (`FRAME_INVALID` once started, ignored from a lost target), and for
    /// every issued seq the parent does not await from it (accepted,
    /// nothing changes: `specs/protocol.md` §2.7).
    AliveNotAwaited,
}

impl Forged {
    /// Every forged input.
    pub const ALL: [Forged; 11] = [
        Forged::ReplyFromNoTarget,
        Forged::ReplySeqZero,
        Forged::ReplySeqUnissued,
        Forged::LostNoTarget,
        Forged::StageFailedLate,
        Forged::SubmitOutOfScope,
        Forged::TargetUnknownSeq,
        Forged::LifecycleAgain,
        Forged::WrongNamespace,
        Forged::PreStartCapacity,
        Forged::AliveNotAwaited,
    ];
}

/// The stateright model of the registration protocol.
#[derive(Clone, Debug)]
pub struct RegistrationModel {
    /// What is checked.
    pub config: ModelConfig,
    init: State,
}

/// The controls (register, unregister, cleanup seqs) the parent awaits
/// from live target `id`, in seq order: what one heartbeat of its reader
/// thread reports alive (every control it received and has not answered;
/// one whose answer is still in transit may be reported too, since the
/// report then precedes the answer in the pipe). Empty for a dead target.
fn heartbeat_seqs(state: &State, id: TargetId) -> Vec<Seq> {
    if state.target(id).is_none() || !state.parent.is_target_live(id) {
        return Vec::new();
    }
    state
        .parent
        .awaited_controls(id)
        .into_iter()
        .map(|(seq, _)| seq)
        .collect()
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
    /// The model of `config`. Unless [`ModelConfig::interleave_start`], the
    /// script's pre-start steps run in order on a new parent, which then
    /// starts and gives every target the startup snapshot, before the
    /// first state; with it, the first state is the new parent and those
    /// calls are actions.
    ///
    /// # Errors
    /// A [`ConfigError`] when there are no targets or more than 16, the
    /// slots are not 1..=64, the script is invalid, or (without
    /// `interleave_start`) a pre-start step is refused or the snapshot
    /// does not fit the slots.
    pub fn new(config: ModelConfig) -> Result<RegistrationModel, ConfigError> {
        if config.targets == 0 || config.targets > 16 {
            return Err(ConfigError("targets must be 1..=16".into()));
        }
        if config.slot_capacity == 0 || config.slot_capacity > 64 {
            return Err(ConfigError("slots must be 1..=64".into()));
        }
        if config.closes > 1 {
            return Err(ConfigError("closes must be 0 or 1".into()));
        }
        if !config.snapshot_failures.is_empty()
            && !config
                .script
                .before_start
                .iter()
                .any(|step| matches!(step, BeforeStart::Register(_)))
        {
            return Err(ConfigError(
                "snapshot failures need a startup snapshot".into(),
            ));
        }
        if let Some(bad) = config
            .snapshot_failures
            .iter()
            .find(|t| **t >= config.targets)
        {
            return Err(ConfigError(format!(
                "snapshot failure on target {bad}, which does not exist"
            )));
        }
        config
            .script
            .validate()
            .map_err(|e| ConfigError(e.to_string()))?;
        #[cfg_attr(not(feature = "mutants"), allow(unused_mut))]
        let mut parent = Parent::new(ParentConfig {
            targets: config.targets,
            control_timeout: CONTROL_TIMEOUT,
            operation_timeout: OPERATION_TIMEOUT,
            fence_on_timeout: config.fence_on_timeout,
            owner: OWNER,
            slot_capacity: config.slot_capacity,
            probe_first: config.probe_first,
            respawn_limit: config.respawn_limit,
            respawn_backoff: RESPAWN_BACKOFF,
            unbounded_spawn: config.arrivals,
            max_tasks_per_target: config.max_tasks_per_target,
        });
        #[cfg(feature = "mutants")]
        if let Some(mutant) = config.mutant {
            parent = parent.with_mutant(mutant);
        }
        let n = usize::from(config.targets);
        let init = State {
            parent,
            targets: vec![None; n],
            frames: Vec::new(),
            replies: Vec::new(),
            eof: vec![false; n],
            sides: vec![TargetSide::default(); n],
            staged: BTreeMap::new(),
            pre: vec![PreStatus::Waiting; config.script.before_start.len()],
            client: vec![StepStatus::Waiting; config.script.operations.len()],
            tasks: Vec::new(),
            results: Vec::new(),
            stale: Vec::new(),
            stale_replies: Vec::new(),
            task_log: Vec::new(),
            delivering: None,
            now: 0,
            budgets: Budgets {
                crashes: config.crashes,
                deserialize_failures: config.deserialize_failures,
                stage_failures: config.stage_failures,
                corruptions: config.corruptions,
                closes: config.closes,
                wrong_digests: config.wrong_digests,
                deadlines: config.deadlines,
                tasks: config.tasks,
                cancels: config.cancels,
                stale_results: config.stale_results,
                stale_replies: config.stale_replies,
                poison_kills: config.poison_kills,
                poison_refusals: config.poison_refusals,
                heartbeats: config.heartbeats,
                spawn_failures: config.spawn_failures,
                restage_failures: config.restage_failures,
                template_losses: config.template_losses,
            },
            seen: 0,
            contract: "",
            settling: 0,
            proven: Vec::new(),
            spawns: vec![None; n],
            spawn_due: vec![None; n],
            replays: Vec::new(),
            refused_probes: Vec::new(),
        };
        let mut model = RegistrationModel { config, init };
        if !model.config.interleave_start {
            let mut state = model.init.clone();
            for i in 0..state.pre.len() {
                model.pre_start(&mut state, i);
                if let PreStatus::Refused(code) = state.pre[i] {
                    return Err(ConfigError(format!(
                        "before_start[{i}] was refused ({})",
                        code.map_or_else(
                            || "its register was refused".to_owned(),
                            |c| c.to_string()
                        )
                    )));
                }
            }
            model.start(&mut state);
            if state.seen & seen::CONTRACT != 0 {
                return Err(ConfigError(format!("start: {}", state.contract)));
            }
            model.init = state;
        }
        Ok(model)
    }

    /// Calls pre-start step `i`: `register_before_start` or
    /// `unregister_before_start`, checking the answer against the
    /// lifecycle (refused with `LIFECYCLE_INVALID` once started).
    fn pre_start(&self, state: &mut State, i: usize) -> Option<()> {
        let step = self.config.script.before_start.get(i)?;
        let new = state.parent.lifecycle() == Lifecycle::New;
        let before = state.parent.clone();
        let result = match step {
            BeforeStart::Register(c) => state
                .parent
                .register_before_start(digest_of(*c)?, Namespace::LocalPython)
                .map(|h| Some(h.handle_id)),
            BeforeStart::Unregister(j) => match state.pre.get(*j) {
                Some(PreStatus::Done(Some(handle_id))) => {
                    let BeforeStart::Register(c) = self.config.script.before_start[*j] else {
                        return None;
                    };
                    let handle = handle_for(digest_of(c)?, *handle_id);
                    state.parent.unregister_before_start(&handle).map(|()| None)
                }
                _ => {
                    state.pre[i] = PreStatus::Refused(None);
                    return Some(());
                }
            },
        };
        state.pre[i] = match result {
            Ok(handle_id) => {
                if !new {
                    state.breach("a pre-start call was accepted after start");
                }
                PreStatus::Done(handle_id)
            }
            Err(error) => {
                if !new {
                    state.seen |= seen::PRE_START_AFTER_START;
                    if error.code != ErrorCode::LIFECYCLE_INVALID || state.parent != before {
                        state.breach("a pre-start call after start was not refused with LIFECYCLE_INVALID, or changed the parent");
                    }
                }
                PreStatus::Refused(Some(error.code))
            }
        };
        Some(())
    }

    /// Starts the Worker: `Parent::start`, then every target is created
    /// from the startup snapshot, which must count the live handles.
    fn start(&self, state: &mut State) {
        let snapshot = state.parent.startup_snapshot();
        if state.parent.start().is_err() {
            state.breach("start of a new parent was refused");
            return;
        }
        let mut counts: BTreeMap<Digest, u32> = BTreeMap::new();
        for handle in state.parent.live_handles() {
            *counts.entry(handle.digest()).or_insert(0) += 1;
        }
        if snapshot != counts.into_iter().collect::<Vec<_>>() {
            state.breach("the startup snapshot does not count the live handles");
        }
        state.proven = snapshot.iter().map(|(d, _)| *d).collect();
        // A snapshot entry (the first digest) that fails on some targets
        // (`specs/model.md` §1 "Startup-snapshot failures"): they start
        // without it and report it, and the parent settles it before
        // anything else happens (`Parent::snapshot_failed`).
        let failing = if self.config.snapshot_failures.is_empty() {
            None
        } else {
            snapshot.first().map(|(digest, _)| *digest)
        };
        if let Some(digest) = failing {
            // A failed install is a fault: the progress properties then
            // expect nothing of this path.
            state.seen |= seen::FAULT;
            let failures: Vec<(TargetId, Digest, Failure)> = self
                .config
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
            // Settling is issuing operations: time advances as for any.
            state.now += 1;
            match state.parent.snapshot_failed(&failures, Time(state.now)) {
                Ok(failed) => state.settling = u64::try_from(failed.len()).unwrap_or(u64::MAX),
                Err(_) => state.breach("the parent refused the targets' snapshot failures"),
            }
        }
        for i in 0..self.config.targets {
            let failed: Vec<Digest> = failing
                .filter(|_| self.config.snapshot_failures.contains(&i))
                .into_iter()
                .collect();
            match Target::with_snapshot_failures(
                TargetConfig {
                    id: TargetId(i),
                    slot_capacity: self.config.slot_capacity,
                },
                &snapshot,
                &failed,
            ) {
                Ok(target) => {
                    #[cfg(feature = "mutants")]
                    let target = match self.config.mutant {
                        Some(mutant) => target.with_mutant(mutant),
                        None => target,
                    };
                    state.targets[usize::from(i)] = Some(target);
                }
                Err(_) => state.breach("a target refused the startup snapshot the parent accepted"),
            }
        }
        if failing.is_some() {
            // The settling unregisters are on their way before the next step.
            self.drain_parent(state);
        }
    }

    fn target_ids(&self) -> impl Iterator<Item = TargetId> {
        (0..self.config.targets).map(TargetId)
    }

    /// Whether script operation `i` may be issued in `state`.
    fn issuable(&self, state: &State, i: usize) -> bool {
        let pre_done = match self.config.script.operations[i].operation {
            Operation::Unregister(HandleRef::BeforeStart(j)) => {
                state.pre.get(j).is_some_and(|p| *p != PreStatus::Waiting)
            }
            _ => true,
        };
        pre_done
            && state.client.get(i) == Some(&StepStatus::Waiting)
            && self
                .config
                .script
                .dependencies(i)
                .iter()
                .all(|j| matches!(state.client.get(*j), Some(StepStatus::Done(_))))
    }

    /// Whether a run's start is an action of its own, apart from its end:
    /// with cancels (a cancel meets a queued or a running run) or a way to
    /// lose a target (a loss between a start and its end is what tells a
    /// task that ran from one that never started, §2.15).
    fn splits_runs(&self) -> bool {
        let c = &self.config;
        c.cancels > 0 || c.crashes > 0 || c.poison_kills > 0 || c.deadlines > 0
    }

    /// Whether no action can change `state` (the checker's terminal states).
    ///
    /// Every listed action but [`Action::Submit`], [`Action::SubmitAny`]
    /// and [`Action::Forge`]
    /// always has a next state (`actions` lists only enabled ones); a
    /// submit may still be refused by the parent, and a forged input has a
    /// next state only when a machine mishandles it, so those are tried.
    pub fn is_terminal(&self, state: &State) -> bool {
        let mut actions = Vec::new();
        stateright::Model::actions(self, state, &mut actions);
        actions.into_iter().all(|a| {
            matches!(
                a,
                Action::Submit { .. } | Action::SubmitAny { .. } | Action::Forge(_)
            ) && stateright::Model::next_state(self, state, a).is_none()
        })
    }

    /// The handle a script reference names in `state`, if it was published.
    fn handle_of(&self, state: &State, reference: HandleRef) -> Option<Handle> {
        match reference {
            HandleRef::BeforeStart(i) => {
                let PreStatus::Done(Some(handle_id)) = state.pre.get(i)? else {
                    return None;
                };
                let BeforeStart::Register(c) = self.config.script.before_start.get(i)? else {
                    return None;
                };
                Some(handle_for(digest_of(*c)?, *handle_id))
            }
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

    /// Fencing (or retiring) kills and reaps the child and closes both
    /// pipe ends: nothing more is read from it (its replies are dropped,
    /// or, the channel fault, kept to arrive late).
    fn fence_side(state: &mut State, target: TargetId) {
        state.keep_stale_replies(target, true);
        state.kill(target);
        state.replies.retain(|(t, _)| *t != target);
        // Its start reports in transit are read once it is reaped
        // (§2.15); its results are dropped, or (the channel fault, while
        // its budget lasts) kept to arrive late.
        let keep = state.budgets.stale_results > 0;
        let (gone, rest): (Vec<_>, Vec<_>) =
            state.results.drain(..).partition(|(t, _)| *t == target);
        state.results = rest;
        let (starts, gone): (Vec<_>, Vec<_>) = gone.into_iter().partition(|(_, r)| r.start);
        let now = Time(state.now);
        for (_, report) in starts {
            let accepted =
                state
                    .parent
                    .handle_task_started(target, report.incarnation, report.seq, now);
            if accepted.is_err() {
                state.seen |= seen::DRIVER_ERROR;
            }
        }
        if keep {
            state.stale.extend(gone);
            state.stale.sort();
        }
        if let Some(eof) = state.eof.get_mut(usize::from(target.0)) {
            *eof = false;
        }
        Self::drained(state, target);
    }

    /// Everything `target`'s lost process wrote was read (§2.15): the
    /// driver says so for the process of each task in doubt there, and
    /// records the tasks handed back to waiting.
    fn drained(state: &mut State, target: TargetId) {
        for incarnation in state.parent.in_doubt_processes(target) {
            state.parent.process_drained(target, incarnation, true);
        }
        for note in &mut state.task_log {
            let Some(info) = state.parent.task(note.seq) else {
                continue;
            };
            if note.sent && !info.sent {
                note.sent = false;
                note.handed_over = true;
                note.target = info.target;
                note.deadline = None;
            }
        }
    }

    /// Whether retiring `target` now would cost something (§2.14): a
    /// control or a task not cancelled in transit to it, a deserialization
    /// or a run not cancelled in progress there, or a result in transit
    /// from it.
    fn retirement_costs(&self, state: &State, target: TargetId) -> bool {
        let cancelled = |seq: Seq| {
            state
                .note(seq)
                .is_some_and(|n| n.end == Some(Ended::Cancelled))
        };
        let side = &state.sides[usize::from(target.0)];
        state.frames.iter().any(|(t, frame)| {
            *t == target
                && match frame {
                    ControlFrame::Task { seq, .. } => !cancelled(*seq),
                    // A cancel whose answer no longer matters: its task
                    // ended (the machine waits for unanswered ones).
                    ControlFrame::Cancel { seq, .. } => state.parent.task(*seq).is_some(),
                    _ => true,
                }
        }) || !side.deserializing.is_empty()
            || side.runs.iter().any(|(seq, _, _)| !cancelled(*seq))
            || state.results.iter().any(|(t, _)| *t == target)
    }

    /// The client submits a task for live handle `handle_id`: to
    /// `target`, or (`None`) to the target the machine picks (§2.14).
    /// `None` when the parent refuses it (the action is then not taken).
    fn submit(&self, state: &mut State, handle_id: u64, target: Option<TargetId>) -> Option<()> {
        let digest = state
            .parent
            .live_handles()
            .into_iter()
            .find(|h| h.handle_id == handle_id)?
            .digest();
        // With task deadlines every task has a timeout, whose clock starts
        // at its start report (§2.12): the submit's time is read by
        // nothing but the known bug that counts from it.
        let timeout = self.config.task_deadline.then_some(TASK_DEADLINE);
        let handle = handle_for(digest, handle_id);
        let now = Time(state.now);
        let seq = match target {
            Some(target) => state
                .parent
                .submit_with_timeout(&handle, target, timeout, now),
            None => state.parent.submit_any(&handle, timeout, now),
        }
        .ok()?;
        let info = state.parent.task(seq)?;
        state.budgets.tasks -= 1;
        state.task_log.push(TaskNote {
            seq,
            target: info.target,
            incarnation: info.incarnation,
            sent: false,
            waited: false,
            deadline: None,
            cancelled_at: None,
            started: false,
            handed_over: false,
            cancel_ok: false,
            ends: 0,
            end: None,
        });
        self.drain_parent(state);
        if let Some(note) = state.note_mut(seq) {
            note.waited = !note.sent;
        }
        Some(())
    }

    /// Carries out the parent's effects, in order (the driving rule).
    fn drain_parent(&self, state: &mut State) {
        self.drain(state, false);
    }

    /// [`Self::drain_parent`]; with `fail_restage`, the first
    /// `Effect::Restage` cannot be carried out and is answered with
    /// `Parent::stage_failed`. Whether that happened.
    fn drain(&self, state: &mut State, mut fail_restage: bool) -> bool {
        let mut restage_failed = false;
        // A failed join is followed by its target's fence (§2.9).
        let mut fence_due: Option<TargetId> = None;
        while let Some(effect) = state.parent.poll_effect() {
            if let Some(due) = fence_due.take() {
                if !matches!(effect, Effect::Fence { target, .. } if target == due) {
                    state.breach("a failed join was not followed by its target's fence");
                }
            }
            match effect {
                Effect::Stage { staging, digest } => {
                    state.staged.insert(staging, digest);
                }
                Effect::Restage { staging, .. } if fail_restage => {
                    fail_restage = false;
                    restage_failed = true;
                    let failure = Failure::new(
                        ErrorCode::IO_FAILED,
                        "shared memory for the replayed payload could not be created",
                    );
                    if state.parent.stage_failed(staging, failure).is_err() {
                        state.seen |= seen::DRIVER_ERROR;
                    }
                }
                Effect::Restage { staging, digest } => {
                    // The kept envelope of a live registration, staged
                    // again for a joining replacement.
                    if !state
                        .parent
                        .live_handles()
                        .iter()
                        .any(|h| h.digest() == digest)
                        || state.staged.contains_key(&staging)
                    {
                        state.breach("a replay restaged a digest with no live handle, or over a staged payload");
                    }
                    state.staged.insert(staging, digest);
                    state.replays.push(OpId(staging.0));
                }
                Effect::Spawn {
                    target,
                    incarnation,
                } => {
                    if state.seen & seen::TEMPLATE_LOST != 0 {
                        state.seen |= seen::SPAWN_WITHOUT_TEMPLATE;
                    }
                    let index = usize::from(target.0);
                    // The target's old process is gone with everything it
                    // had: no frame, reply, end of file or pending work.
                    let clean = state.targets.get(index).is_some_and(Option::is_none)
                        && !state.frames.iter().any(|(t, _)| *t == target)
                        && !state.replies.iter().any(|(t, _)| *t == target)
                        && !state.results.iter().any(|(t, _)| *t == target)
                        && !state.eof[index]
                        && state.sides[index] == TargetSide::default()
                        && state.spawns[index].is_none();
                    if !clean
                        || state.parent.is_target_live(target)
                        || incarnation != state.parent.incarnation(target)
                        || incarnation == 0
                    {
                        state.breach("a replacement was asked for a target whose process is not gone, or with another incarnation than the parent's");
                    }
                    state.spawns[index] = Some(incarnation);
                    state.spawn_due[index] = Some(state.now + CONTROL_TIMEOUT);
                }
                Effect::Joined {
                    target,
                    incarnation,
                } => {
                    state.seen |= seen::JOINED;
                    if state
                        .sides
                        .get(usize::from(target.0))
                        .is_some_and(|side| side.late_arrival)
                    {
                        state.seen |= seen::LATE_ARRIVAL_JOINED;
                    }
                    if state
                        .client
                        .iter()
                        .any(|c| matches!(c, StepStatus::InFlight { .. }))
                    {
                        state.seen |= seen::JOINED_IN_FLIGHT;
                    }
                    // (The same input may have lost it again since: the
                    // parent's state is the one after the whole input.)
                    if incarnation == 0 || incarnation > state.parent.incarnation(target) {
                        state.breach(
                            "a replacement joined with an incarnation the target never had",
                        );
                    }
                }
                Effect::JoinFailed {
                    target,
                    incarnation,
                    ..
                } => {
                    state.seen |= seen::JOIN_FAILED;
                    if incarnation == 0 || incarnation > state.parent.incarnation(target) {
                        state.breach("a failed join names another incarnation than the target's");
                    }
                    fence_due = Some(target);
                }
                Effect::Abandoned {
                    target,
                    failed_joins,
                } => {
                    state.seen |= seen::ABANDONED;
                    // At the rate limit, or at any count once the template
                    // is gone (§2.9, "Replacements ended").
                    let template_gone = state.seen & seen::TEMPLATE_LOST != 0;
                    if template_gone {
                        state.seen |= seen::ABANDONED_WITHOUT_TEMPLATE;
                    }
                    if (failed_joins != self.config.respawn_limit && !template_gone)
                        || failed_joins > self.config.respawn_limit
                        || state.parent.failed_joins(target) != failed_joins
                        || state.parent.is_target_live(target)
                    {
                        state.breach("a target was given up before its rate limit, or while live");
                    }
                }
                Effect::Send { target, frame } => {
                    // A task's frame is sent once, to the process of its
                    // target that takes it (at submit, or at a join after
                    // it waited, §2.14).
                    if let ControlFrame::Task { seq, .. } = frame {
                        let incarnation = state.parent.incarnation(target);
                        let handle = state.parent.task(seq).map(|info| info.handle_id);
                        // Sent again only once the process it was sent to
                        // is lost (a hand-over, §2.15).
                        let again = state.note(seq).is_some_and(|n| {
                            n.sent
                                && !(state.parent.is_target_live(n.target)
                                    && state.parent.incarnation(n.target) == n.incarnation)
                        });
                        match (state.note_mut(seq), handle) {
                            (Some(note), Some(handle)) if !note.sent || again => {
                                if again {
                                    note.handed_over = true;
                                    note.deadline = None;
                                }
                                if note.handed_over {
                                    state.seen |= seen::HANDED_OVER;
                                }
                                let Some(note) = state.note_mut(seq) else {
                                    continue;
                                };
                                note.sent = true;
                                note.target = target;
                                note.incarnation = incarnation;
                                state.tasks.push((seq, handle));
                                let max = self.config.max_tasks_per_target as usize;
                                let sent = state
                                    .task_log
                                    .iter()
                                    .filter(|n| {
                                        n.sent && (n.target, n.incarnation) == (target, incarnation)
                                    })
                                    .count();
                                if max > 0 && sent > max {
                                    state.breach(
                                        "a process was sent more tasks than max_tasks_per_target",
                                    );
                                }
                            }
                            _ => state
                                .breach("a task frame was sent twice, or for a task not in flight"),
                        }
                    }
                    // A register or unregister frame is sent only for an
                    // operation that awaits its reply: a withdrawn one
                    // (a staging failure, an operation ended in the same
                    // input) never reaches a target.
                    if matches!(
                        frame,
                        ControlFrame::Register { .. } | ControlFrame::Unregister { .. }
                    ) && !state.parent.awaits_reply(target, frame.seq())
                        && !state.parent.awaits_heal(target, frame.seq())
                    {
                        state.breach(
                            "a register or unregister frame was sent that no operation or doubt awaits",
                        );
                    }
                    // The operation's scope, as the driver sees it.
                    if !matches!(
                        frame,
                        ControlFrame::Task { .. } | ControlFrame::Cancel { .. }
                    ) {
                        let seq = frame.seq().0;
                        let mut early = false;
                        for step in &mut state.client {
                            if let StepStatus::InFlight {
                                op,
                                scope,
                                probing,
                                confirmed,
                                ..
                            } = step
                            {
                                if op.0 == seq && target.0 < 32 {
                                    // §2.8: one target first, the others only
                                    // once some target confirmed.
                                    early |= *probing
                                        && !*confirmed
                                        && *scope & !(1u32 << target.0) != 0;
                                    *scope |= 1u32 << target.0;
                                }
                            }
                        }
                        if early {
                            state.seen |= seen::PROBE_BROADCAST_EARLY;
                        }
                    }
                    if let ControlFrame::Register { digest, .. } = frame {
                        if state.parent.is_poisoned(digest) {
                            state.seen |= seen::POISON_SENT;
                        }
                        if state.refused_probes.contains(&digest) {
                            state.seen |= seen::REFUSED_PROBE_SENT;
                        }
                    }
                    // Writing to a dead child's pipe fails; the parent learns
                    // of the death from end of file, not from the write.
                    if state.target(target).is_some() {
                        insert_ordered(&mut state.frames, target, frame);
                    }
                }
                // A hint the driver may ignore (the IO layer's verify
                // control changes no target's state); it must name a
                // payload still staged.
                Effect::Verify { staging, .. } => {
                    if !state.staged.contains_key(&staging) {
                        state.breach("a verify hint named a payload that is not staged");
                    }
                }
                Effect::ReleaseStaged { staging } => {
                    if state.staged.remove(&staging).is_none() {
                        state.breach("a payload was released that was not staged");
                    }
                }
                Effect::Retire {
                    target,
                    incarnation,
                    tasks,
                } => {
                    // §2.14: retired at its bound, idle, so that the
                    // retirement costs no task and no operation.
                    state.seen |= seen::RETIRED;
                    let at_bound = tasks == self.config.max_tasks_per_target
                        && state
                            .task_log
                            .iter()
                            .filter(|n| {
                                n.sent && (n.target, n.incarnation) == (target, incarnation)
                            })
                            .count()
                            == tasks as usize;
                    if !at_bound || self.retirement_costs(state, target) {
                        state.breach("a target retired before its task bound, or with work in progress or in transit");
                    }
                    Self::fence_side(state, target);
                }
                Effect::Fence { target, .. } => {
                    // A replacement not ready in time (§2.9): the driver
                    // will not start it.
                    let index = usize::from(target.0);
                    if state.spawns.get_mut(index).and_then(Option::take).is_some() {
                        // An arrival has no ready deadline (§2.9
                        // "Arrivals"): nothing fences an open target.
                        if self.config.arrivals {
                            state.seen |= seen::ARRIVAL_FENCED;
                        }
                        state.spawn_due[index] = None;
                        continue;
                    }
                    Self::fence_side(state, target);
                }
                Effect::Completed {
                    op,
                    result,
                    outcomes,
                } => self.complete(state, op, result, &outcomes),
                Effect::TaskDone {
                    seq,
                    target,
                    incarnation,
                    end,
                    ..
                } => {
                    let delivering = state.delivering;
                    let Some(note) = state.note_mut(seq) else {
                        state.breach("a task that was never submitted ended");
                        continue;
                    };
                    note.ends = note.ends.saturating_add(1);
                    let (sent_to, started) = ((note.target, note.incarnation), note.started);
                    let note_sent = note.sent;
                    let ended = match end {
                        TaskEnd::Result => Ended::Result,
                        TaskEnd::Cancelled => Ended::Cancelled,
                        TaskEnd::Deadline => Ended::Deadline,
                        TaskEnd::Lost { .. } => Ended::Lost,
                        TaskEnd::Closed => Ended::Closed,
                    };
                    note.end.get_or_insert(ended);
                    if note.ends > 1 {
                        state.seen |= seen::TASK_DONE_TWICE;
                    }
                    if ended == Ended::Cancelled && started {
                        state.seen |= seen::CANCELLED_AND_RUN;
                    }
                    if ended == Ended::Result && delivering != Some((seq, true)) {
                        state.seen |= seen::FOREIGN_RESULT;
                    }
                    if ended == Ended::Deadline && !started {
                        state.breach("a task ended at its deadline before it started");
                    }
                    if note_sent && (target, incarnation) != sent_to {
                        state.breach(
                            "a task ended naming another target or incarnation than it was sent to",
                        );
                    }
                }
                Effect::CancelRefused { seq, failure } => {
                    state.seen |= seen::CANCEL_REFUSED;
                    if failure.code != ErrorCode::TASK_RUNNING || state.parent.task(seq).is_none() {
                        state.breach("a cancel was refused with another error than TASK_RUNNING, or for a task not in flight");
                    }
                }
                // The client never inspects (a diagnostic that changes no
                // state the properties read): none is ever emitted.
                Effect::Inspect { .. } | Effect::InspectDone { .. } => {
                    state.breach("an inspection nobody asked for");
                }
            }
        }
        if fence_due.is_some() {
            state.breach("a failed join was not followed by its target's fence");
        }
        if !state.replays.is_empty() {
            let in_flight = state.parent.in_flight();
            state.replays.retain(|op| in_flight.contains(op));
        }
        restage_failed
    }

    /// Whether the earliest pending deadline is only a replacement's
    /// back-off: passing it ends no operation's wait (time passing, not a
    /// fault, so it needs no deadline budget).
    fn backoff_only(&self, state: &State) -> bool {
        let Some(deadline) = state.parent.poll_timeout() else {
            return false;
        };
        if !self
            .target_ids()
            .any(|t| state.parent.target_phase(t) == TargetPhase::BackingOff(deadline))
        {
            return false;
        }
        let mut passed = state.parent.clone();
        passed.handle_timeout(deadline);
        self.target_ids().all(|t| {
            state
                .parent
                .awaited_controls(t)
                .iter()
                .all(|(seq, _)| passed.awaits_reply(t, *seq))
        })
    }

    /// Starts the replacement asked for target `id` (`spawn`), or reports
    /// that it could not be started; with `restage_fails`, the first replay
    /// to it fails to stage its payload (no next state when it has nothing
    /// to replay).
    fn spawn(
        &self,
        state: &mut State,
        id: TargetId,
        starts: bool,
        restage_fails: bool,
    ) -> Option<()> {
        let index = usize::from(id.0);
        let incarnation = state.spawns.get_mut(index)?.take()?;
        let due = state.spawn_due[index].take();
        // Starting a process and replaying to it is issuing operations:
        // time advances as for an issue, never onto a pending deadline.
        let next = state.now + 1;
        if state.parent.poll_timeout().is_none_or(|d| next < d.0) {
            state.now = next;
        }
        let now = Time(state.now);
        if starts {
            let target = Target::new(
                TargetConfig {
                    id,
                    slot_capacity: self.config.slot_capacity,
                },
                &[],
            )
            .ok()?;
            #[cfg(feature = "mutants")]
            let target = match self.config.mutant {
                Some(mutant) => target.with_mutant(mutant),
                None => target,
            };
            state.targets[index] = Some(target);
            state.sides[index].incarnation = incarnation;
            // An arrival at or after the time an ordinary replacement
            // would have been fenced for not being ready (§2.9).
            state.sides[index].late_arrival =
                self.config.arrivals && due.is_some_and(|due| due <= state.now);
            if state.parent.target_spawned(id, incarnation, now).is_err() {
                state.seen |= seen::DRIVER_ERROR;
            }
        } else {
            state.seen |= seen::FAULT | seen::SPAWN_FAILED;
            if state
                .parent
                .target_died(id, SPAWN_FAILURE_CAUSE, now)
                .is_err()
            {
                state.seen |= seen::DRIVER_ERROR;
            }
        }
        let restage_failed = self.drain(state, restage_fails);
        if restage_fails {
            // The fault applies only where a replay is staged.
            if !restage_failed {
                return None;
            }
            state.seen |= seen::FAULT | seen::RESTAGE_FAILED;
        }
        Some(())
    }

    /// The client records a completion, after checking it against the
    /// parent's documented rules: the outcomes name every target of the
    /// scope once, in target order; a success has only `Ok` outcomes; a
    /// failed unregister names a target that refused or timed out (and the
    /// digest is then uncertain); a failed register kept no confirmed
    /// install; `LIFECYCLE_INVALID` only from close. On a path with no
    /// fault yet, an operation may fail only as a register some target
    /// refused for want of a free slot ([`seen::UNFORCED_FAILURE`]).
    fn complete(
        &self,
        state: &mut State,
        op: OpId,
        result: Result<Completion, callreg::error::Error>,
        outcomes: &[(TargetId, TargetOutcome)],
    ) {
        let Some(index) = state
            .client
            .iter()
            .position(|s| matches!(s, StepStatus::InFlight { op: o, .. } if *o == op))
        else {
            // A snapshot entry's settling unregister: nobody waits for it.
            if op.0 > state.settling {
                state.seen |= seen::DRIVER_ERROR;
            }
            return;
        };
        let StepStatus::InFlight {
            scope,
            issued,
            refused,
            ..
        } = state.client[index]
        else {
            return;
        };
        let register = matches!(
            self.config.script.operations[index].operation,
            Operation::Register(_)
        );
        let mask = outcomes.iter().fold(0u32, |m, (t, _)| {
            m | 1u32.checked_shl(u32::from(t.0)).unwrap_or(0)
        });
        let ordered = outcomes.windows(2).all(|w| w[0].0 < w[1].0);
        // An unregister's frame to a replacement whose replay of the
        // handle is unanswered waits for that replay (`specs/protocol.md`
        // §2.9): if the replacement is lost first, the frame never goes,
        // yet the target is in the scope.
        let unsent = outcomes.iter().fold(0u32, |m, (t, o)| {
            let waited = !register
                && state.parent.incarnation(*t) > 0
                && matches!(o, TargetOutcome::Lost | TargetOutcome::Fenced);
            if waited {
                m | 1u32.checked_shl(u32::from(t.0)).unwrap_or(0)
            } else {
                m
            }
        });
        if !ordered || mask & !unsent != scope & !unsent || scope & !mask != 0 {
            state.breach("a completion's outcomes do not name each target of its scope once, in target order");
        }
        let misreported = outcomes.iter().any(|(t, o)| {
            let was_refused = t.0 < 32 && refused & (1u32 << t.0) != 0;
            was_refused != matches!(o, TargetOutcome::Failed { .. })
        });
        if misreported {
            state.breach("a completion's outcomes do not report as Failed exactly the targets that refused the operation");
        }
        let timed_out = outcomes.iter().any(|(_, o)| match o {
            TargetOutcome::TimedOut => true,
            TargetOutcome::CleanupUnconfirmed { failure } => {
                failure.code == ErrorCode::DEADLINE_EXCEEDED
            }
            _ => false,
        });
        if timed_out && state.now < issued + CONTROL_TIMEOUT {
            state.breach("a target of an operation timed out before the operation's deadline");
        }
        let all_ok = outcomes.iter().all(|(_, o)| *o == TargetOutcome::Ok);
        let digest = match self.config.script.operations[index].operation {
            Operation::Register(c) => digest_of(c),
            Operation::Unregister(r) => self.handle_of(state, r).map(|h| h.digest()),
        };
        let closed = state.parent.lifecycle() == Lifecycle::Closed;
        match &result {
            Ok(Completion::Registered(handle)) => {
                if !register || !all_ok || outcomes.is_empty() || Some(handle.digest()) != digest {
                    state.breach("a register published a handle without an Ok outcome from every target of its scope");
                }
            }
            Ok(Completion::Unregistered(handle)) => {
                if register || !all_ok || Some(handle.digest()) != digest {
                    state.breach("an unregister succeeded although a target of its scope refused it, timed out or was lost");
                }
            }
            Err(error) if !register && error.code == ErrorCode::TARGET_LOST => {
                // A lost or fenced target holds nothing: the handle is
                // released, and the unregister says which it lost.
                let lost = outcomes
                    .iter()
                    .any(|(_, o)| matches!(o, TargetOutcome::Lost | TargetOutcome::Fenced));
                let dropped = outcomes.iter().all(|(_, o)| {
                    matches!(
                        o,
                        TargetOutcome::Ok | TargetOutcome::Lost | TargetOutcome::Fenced
                    )
                });
                if !lost || !dropped {
                    state.breach("an unregister failed with TARGET_LOST although no target of its scope was lost, or one refused it or timed out");
                }
            }
            Err(error) if error.code == ErrorCode::LIFECYCLE_INVALID => {
                if !closed {
                    state.breach(
                        "an operation failed with LIFECYCLE_INVALID while the Worker was open",
                    );
                }
            }
            Err(error) if register => {
                let stage = error.operation == callreg::error::OperationKind::Stage;
                let kept = outcomes.iter().any(|(_, o)| *o == TargetOutcome::Ok);
                let unconfirmed = outcomes
                    .iter()
                    .any(|(_, o)| matches!(o, TargetOutcome::CleanupUnconfirmed { .. }));
                let uncertain = digest.is_some_and(|d| state.parent.is_uncertain(d));
                // REGISTER_CLEANUP_UNCERTAIN exactly when every target of
                // the scope confirmed (and was then rolled back) but the
                // digest became uncertain in flight.
                let confirmed_everywhere = outcomes.iter().all(|(_, o)| {
                    matches!(
                        o,
                        TargetOutcome::RolledBack | TargetOutcome::CleanupUnconfirmed { .. }
                    )
                });
                let poisoned = digest.is_some_and(|d| state.parent.is_poisoned(d));
                let code_ok = if stage {
                    outcomes.is_empty()
                } else if poisoned {
                    // The probe target was lost, or refused it as poisoned
                    // (§2.8 "A nested refusal"), or confirmed it after
                    // another register's probe was refused as poisoned and
                    // was rolled back: no target kept it.
                    error.code == ErrorCode::REGISTER_POISONED
                        && outcomes.iter().all(|(_, o)| match o {
                            TargetOutcome::Lost
                            | TargetOutcome::Fenced
                            | TargetOutcome::RolledBack
                            | TargetOutcome::CleanupUnconfirmed { .. } => true,
                            TargetOutcome::Failed { failure } => {
                                failure.code == ErrorCode::REGISTER_POISONED
                            }
                            _ => false,
                        })
                } else if confirmed_everywhere && uncertain {
                    error.code == ErrorCode::REGISTER_CLEANUP_UNCERTAIN
                } else {
                    error.code == ErrorCode::REGISTER_PARTIAL_FAILURE
                };
                if kept || !code_ok || (unconfirmed && !uncertain) {
                    state.breach("a failed register kept a confirmed install, has an undocumented error, or left an unconfirmed cleanup without marking the digest uncertain");
                }
            }
            Err(error) => {
                let refused = outcomes.iter().any(|(_, o)| {
                    matches!(o, TargetOutcome::Failed { .. } | TargetOutcome::TimedOut)
                });
                let uncertain = digest.is_some_and(|d| state.parent.is_uncertain(d));
                if error.code != ErrorCode::UNREGISTER_PARTIAL_FAILURE || !refused || !uncertain {
                    state.breach("an unregister failed although no target refused it or timed out, or without marking the digest uncertain");
                }
                state.seen |= seen::UNREGISTER_FAILED;
            }
        }
        if state.seen & seen::FAULT == 0 {
            let forced = match &result {
                Ok(_) => true,
                Err(error) => {
                    register
                        && error.code == ErrorCode::REGISTER_PARTIAL_FAILURE
                        && outcomes.iter().all(|(_, o)| match o {
                            TargetOutcome::Failed { failure } => {
                                failure.code == ErrorCode::LOCAL_SLOT_EXHAUSTED
                            }
                            TargetOutcome::RolledBack => true,
                            _ => false,
                        })
                }
            };
            if !forced {
                state.seen |= seen::UNFORCED_FAILURE;
            }
        }
        let rolled_back = outcomes
            .iter()
            .any(|(_, o)| matches!(o, TargetOutcome::RolledBack));
        state.client[index] = StepStatus::Done(match result {
            Ok(Completion::Registered(handle)) => StepResult::Registered(handle.handle_id),
            Ok(Completion::Unregistered(_)) => StepResult::Unregistered,
            Err(error) => StepResult::Failed {
                code: error.code,
                rolled_back,
            },
        });
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
                    side.deserializing.push((seq, slot));
                }
            }
        }
    }

    /// Issues script operation `i`; with `stage_fails`, a register's
    /// [`Effect::Stage`] fails and the driver reports it with
    /// `Parent::stage_failed` before polling further (the driving rule).
    /// Before start and after close the call must be refused with
    /// `LIFECYCLE_INVALID` and change nothing.
    fn issue(&self, state: &mut State, i: usize, stage_fails: bool) -> Option<()> {
        let step = self.config.script.operations.get(i)?;
        // Time advances by one per issued operation, but never onto a
        // pending deadline: that is the deadline passing (its own action).
        let next = state.now + 1;
        if state.parent.poll_timeout().is_none_or(|d| next < d.0) {
            state.now = next;
        }
        let now = Time(state.now);
        let open = state.parent.lifecycle() == Lifecycle::Started;
        let before = state.parent.clone();
        let probing = match step.operation {
            Operation::Register(c) => {
                self.config.probe_first && digest_of(c).is_some_and(|d| !state.proven.contains(&d))
            }
            Operation::Unregister(_) => false,
        };
        let poisoned = match step.operation {
            Operation::Register(c) => digest_of(c).is_some_and(|d| before.is_poisoned(d)),
            Operation::Unregister(_) => false,
        };
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
            Ok(op) => {
                if !open {
                    state.breach(
                        "a register or unregister was accepted before start or after close",
                    );
                }
                StepStatus::InFlight {
                    op,
                    scope: 0,
                    issued: state.now,
                    refused: 0,
                    probing,
                    confirmed: false,
                }
            }
            Err(error) => {
                if error.code == ErrorCode::REGISTER_POISONED {
                    state.seen |= seen::POISON_REFUSED;
                }
                if open && (error.code == ErrorCode::REGISTER_POISONED) != poisoned {
                    state.breach("a register was refused with REGISTER_POISONED although its digest is not poisoned, or a poisoned one with another error");
                }
                if !open && (error.code != ErrorCode::LIFECYCLE_INVALID || state.parent != before) {
                    state.breach("a register or unregister before start or after close was not refused with LIFECYCLE_INVALID, or changed the parent");
                }
                if open && state.seen & seen::FAULT == 0 {
                    state.seen |= seen::UNFORCED_FAILURE;
                }
                StepStatus::Done(StepResult::Refused(error.code))
            }
        };
        if stage_fails {
            // A refused register stages nothing: the fault does not apply.
            if !matches!(state.client[i], StepStatus::InFlight { .. }) {
                return None;
            }
            state.seen |= seen::FAULT | seen::STAGE_FAILED;
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
                    Ok(slot) => state.sides[index].runs.push((seq, slot, digest)),
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
            ControlFrame::Cancel { seq, digest } => {
                target.on_cancel(seq, digest);
                self.drain_target(state, id);
                // The answer is the last reply from this target.
                let ok = state
                    .replies
                    .iter()
                    .rev()
                    .find(|(t, _)| *t == id)
                    .is_some_and(|(_, r)| r.seq == seq && r.result.is_ok());
                if let Some(note) = state.note_mut(seq) {
                    note.cancel_ok |= ok;
                }
                return Some(());
            }
        }
        self.drain_target(state, id);
        Some(())
    }

    /// Target `id`'s oldest deserialization ends with `result`
    /// (`Target::on_deserialized`); `None` when none is in progress.
    fn deserialized(
        &self,
        state: &mut State,
        id: TargetId,
        result: Result<(), Failure>,
    ) -> Option<()> {
        let index = usize::from(id.0);
        let side = state.sides.get_mut(index)?;
        if side.deserializing.is_empty() {
            return None;
        }
        let (seq, _) = side.deserializing.remove(0);
        let target = state.targets.get_mut(index)?.as_mut()?;
        if target.on_deserialized(seq, result).is_err() {
            state.seen |= seen::DRIVER_ERROR;
        }
        self.drain_target(state, id);
        Some(())
    }

    /// The task thread of target `id` reaches task `seq`
    /// (`Target::start_task`): it runs, or, cancelled while queued, it is
    /// ended at once without a result.
    fn start_run(&self, state: &mut State, id: TargetId, seq: Seq) -> Option<()> {
        let index = usize::from(id.0);
        let side = state.sides.get(index)?;
        if !side.runs.iter().any(|(s, _, _)| *s == seq) || side.started.contains(&seq) {
            return None;
        }
        let digest = side.runs.iter().find(|(s, _, _)| *s == seq)?.2;
        let incarnation = side.incarnation;
        let target = state.targets.get_mut(index)?.as_mut()?;
        match target.start_task(seq) {
            Ok(true) => {
                state.sides[index].started.push(seq);
                state.report(id, seq, digest, incarnation, true);
                let note = state.note_mut(seq)?;
                let (twice, after_cancel) = (note.started, note.cancel_ok);
                note.started = true;
                if twice {
                    state.seen |= seen::RUN_TWICE;
                }
                if after_cancel {
                    state.seen |= seen::CANCELLED_AND_RUN;
                }
            }
            Ok(false) => {
                state.seen |= seen::RUN_SKIPPED;
                if !state.note(seq).is_some_and(|n| n.cancel_ok) {
                    state.breach(
                        "a run was skipped at its start although no cancel of it was answered OK",
                    );
                }
                self.end_run(state, id, seq)?;
            }
            Err(_) => state.seen |= seen::DRIVER_ERROR,
        }
        Some(())
    }

    /// Run `seq` on target `id` ends (`end_task`): its slot is unpinned,
    /// a tombstoned slot freed at its last run.
    fn end_run(&self, state: &mut State, id: TargetId, seq: Seq) -> Option<()> {
        let index = usize::from(id.0);
        let side = state.sides.get_mut(index)?;
        let at = side.runs.iter().position(|(s, _, _)| *s == seq)?;
        side.runs.remove(at);
        side.started.retain(|s| *s != seq);
        let target = state.targets.get_mut(index)?.as_mut()?;
        let before = target.tombstoned_slots();
        if target.end_task(seq).is_err() {
            state.seen |= seen::DRIVER_ERROR;
        }
        let after = target.tombstoned_slots();
        let mut freed_but_used = false;
        for slot in before.iter().filter(|s| !after.contains(s)) {
            freed_but_used |= target.is_slot_used(*slot);
            state.sides[index].freed_tombstones |= 1u64 << slot.0;
        }
        if freed_but_used {
            // The IO layer drops a callable when its slot turns free.
            state.breach(
                "a tombstoned slot left the tombstones at its last run's end but is still used",
            );
        }
        Some(())
    }

    /// The parent gets a task result from `id`: the head of its results
    /// (`stale`: `None`), or the kept result of task `stale` of a lost
    /// process of the target. A result refused changes nothing; one from the
    /// process that ran a task in flight must end it.
    fn receive_result(&self, state: &mut State, id: TargetId, stale: Option<Seq>) -> Option<()> {
        let result = match stale {
            None => take_head(&mut state.results, id)?,
            Some(seq) => {
                let at = state
                    .stale
                    .iter()
                    .position(|(t, r)| *t == id && r.seq == seq)?;
                state.stale.remove(at).1
            }
        };
        let before = state.parent.clone();
        let open = before.lifecycle() == Lifecycle::Started;
        let sent_to = state.note(result.seq).map(|n| (n.target, n.incarnation));
        let genuine = stale.is_none() && sent_to == Some((id, result.incarnation));
        let in_flight = before.task(result.seq).is_some();
        if result.start {
            let now = Time(state.now);
            match state
                .parent
                .handle_task_started(id, result.incarnation, result.seq, now)
            {
                Ok(true) => {
                    let deadline = state.parent.task(result.seq).and_then(|t| t.deadline);
                    if let Some(note) = state.note_mut(result.seq) {
                        note.deadline = deadline.map(|d| d.0);
                    }
                    if self.config.task_deadline
                        && deadline != Some(now.saturating_add_micros(TASK_DEADLINE))
                    {
                        state.breach(
                            "a started task's deadline is not its timeout after its start report",
                        );
                    }
                }
                Ok(false) => {
                    if state.parent != before || (open && genuine && in_flight) {
                        state.breach("a start report was refused but changed the parent, or the report of a task in flight from its process was refused");
                    }
                }
                Err(_) => state.seen |= seen::DRIVER_ERROR,
            }
            self.drain_parent(state);
            return Some(());
        }
        state.delivering = Some((result.seq, genuine));
        match state.parent.handle_task_result(
            id,
            result.incarnation,
            result.seq,
            result.digest,
            Time(state.now),
        ) {
            Ok(true) => {}
            Ok(false) => {
                if stale.is_some() {
                    state.seen |= seen::STALE_REFUSED;
                }
                if state.parent != before || (open && genuine && in_flight) {
                    state.breach("a task result was refused but changed the parent, or the result of a task in flight from the process that ran it was refused");
                }
            }
            Err(_) => state.seen |= seen::DRIVER_ERROR,
        }
        self.drain_parent(state);
        state.delivering = None;
        Some(())
    }

    /// The parent gets the kept reply to `seq` of a lost process of slot
    /// `id` (`Parent::handle_reply`). That process is gone and the parent
    /// already settled everything it owed: whatever the parent answers (an
    /// error, or ignoring it), the reply must change nothing.
    fn receive_stale_reply(&self, state: &mut State, id: TargetId, seq: Seq) -> Option<()> {
        let at = state
            .stale_replies
            .iter()
            .position(|(t, _, r)| *t == id && r.seq == seq)?;
        let (_, incarnation, reply) = state.stale_replies.remove(at);
        if !state.loss_known(id, incarnation) {
            return None;
        }
        let before = state.parent.clone();
        if before.is_target_live(id) && before.incarnation(id) != incarnation {
            state.seen |= match before.target_phase(id) {
                TargetPhase::Joining => seen::STALE_REPLY_JOINING,
                _ => seen::STALE_REPLY_JOINED,
            };
        }
        // An error is an answer too: only a change is wrong.
        let _ = state.parent.handle_reply(id, reply, Time(state.now));
        if state.parent != before {
            state.seen |= seen::STALE_REPLY_CHANGED;
        }
        self.drain_parent(state);
        Some(())
    }

    /// The client cancels task `seq` (in flight, no cancel of it awaiting
    /// its answer).
    fn cancel(&self, state: &mut State, seq: Seq) -> Option<()> {
        state.budgets.cancels = state.budgets.cancels.checked_sub(1)?;
        let now = state.now;
        if state.parent.cancel(seq, Time(now)).is_err() {
            state.breach("a cancel of a task in flight was refused");
        }
        state.note_mut(seq)?.cancelled_at = Some(now);
        self.drain_parent(state);
        Some(())
    }

    /// The parent reads target `id`'s pipe: the head reply (its digest
    /// replaced by [`CORRUPTED`] when `wrong_digest`) or end of file. After
    /// close the parent must ignore both.
    fn receive(&self, state: &mut State, id: TargetId, wrong_digest: bool) -> Option<()> {
        let now = Time(state.now);
        let index = usize::from(id.0);
        let before = state.parent.clone();
        let closed = before.lifecycle() == Lifecycle::Closed;
        if let Some(mut reply) = take_head(&mut state.replies, id) {
            if wrong_digest {
                reply.digest = CORRUPTED;
            }
            let awaited = state.parent.awaits_reply(id, reply.seq);
            let cancel = state.parent.awaits_cancel(id, reply.seq);
            if state.parent.is_target_live(id) && !awaited && !cancel {
                state.seen |= seen::LATE_REPLY;
            }
            let refusal = reply.result.is_err() || wrong_digest;
            if awaited && refusal && id.0 < 32 {
                for step in &mut state.client {
                    if let StepStatus::InFlight { op, refused, .. } = step {
                        if op.0 == reply.seq.0 {
                            *refused |= 1u32 << id.0;
                        }
                    }
                }
            }
            // A refusal as poisoned (§2.8 "A nested refusal"): from the
            // probe of a client register (probing, nothing confirmed yet:
            // its frame went to the probe target alone) it must poison the
            // digest; from any other target it must poison nothing.
            let nested = awaited
                && !wrong_digest
                && matches!(&reply.result, Err(f) if f.code == ErrorCode::REGISTER_POISONED);
            let probe_refused = nested
                && state.client.iter().any(|step| {
                    matches!(step, StepStatus::InFlight { op, probing: true, confirmed: false, .. } if op.0 == reply.seq.0)
                });
            let poisoned_before = state.parent.poisoned_digests().len();
            let refused_digest = reply.digest;
            if awaited && !refusal {
                let mut register = false;
                for (i, step) in state.client.iter_mut().enumerate() {
                    if let StepStatus::InFlight { op, confirmed, .. } = step {
                        if op.0 == reply.seq.0 {
                            *confirmed = true;
                            register = matches!(
                                self.config.script.operations[i].operation,
                                Operation::Register(_)
                            );
                        }
                    }
                }
                // A poisoned digest is never proven (§2.8).
                if register
                    && !state.proven.contains(&reply.digest)
                    && !state.parent.is_poisoned(reply.digest)
                {
                    state.proven.push(reply.digest);
                    state.proven.sort();
                }
            }
            if state.parent.handle_reply(id, reply, now).is_err() {
                state.seen |= seen::DRIVER_ERROR;
            }
            if probe_refused {
                state.seen |= seen::PROBE_REFUSED_POISONED;
                if !state.refused_probes.contains(&refused_digest) {
                    state.refused_probes.push(refused_digest);
                    state.refused_probes.sort();
                }
            } else if nested {
                state.seen |= seen::REFUSAL_OUTSIDE_PROBE;
                if state.parent.poisoned_digests().len() != poisoned_before {
                    state.seen |= seen::REFUSAL_OUTSIDE_PROBE_POISONED;
                }
            }
        } else if state.eof[index] && !wrong_digest && state.head_result(id).is_none() {
            state.eof[index] = false;
            if self.config.departures {
                let poisoned = state.parent.poisoned_digests().len();
                if state.parent.target_left(id, LOSS_CAUSE, now).is_err() {
                    state.seen |= seen::DRIVER_ERROR;
                }
                if state.parent.poisoned_digests().len() != poisoned {
                    state.seen |= seen::DEPARTURE_POISONED;
                }
            } else if state.parent.target_died(id, LOSS_CAUSE, now).is_err() {
                state.seen |= seen::DRIVER_ERROR;
            }
            // Read to its end of file: what it never reported started
            // never ran (§2.15).
            Self::drained(state, id);
        } else {
            return None;
        }
        if closed && state.parent != before {
            state.breach("a reply or end of file after close changed the parent");
        }
        self.drain_parent(state);
        Some(())
    }

    /// The client closes the Worker: every operation in flight completes
    /// with `LIFECYCLE_INVALID`, every staged payload is released, nothing
    /// is left to wait for. The targets keep running until the driver
    /// stops them: frames in transit are still applied and their replies
    /// read (and ignored).
    fn close(&self, state: &mut State) -> Option<()> {
        state.budgets.closes = state.budgets.closes.checked_sub(1)?;
        if state.parent.lifecycle() != Lifecycle::Started {
            return None;
        }
        state.seen |= seen::FAULT;
        let in_flight = state.parent.in_flight();
        if !in_flight.is_empty() {
            state.seen |= seen::CLOSED_IN_FLIGHT;
        }
        if state.parent.close().is_err() {
            state.breach("close of a started Worker was refused");
        }
        // No replacement is started for a closed Worker.
        state.spawns.iter_mut().for_each(|s| *s = None);
        self.drain_parent(state);
        let all_failed = in_flight.iter().all(|op| {
            state.client.iter().any(|s| {
                matches!(s, StepStatus::Done(StepResult::Failed { code, .. }) if *code == ErrorCode::LIFECYCLE_INVALID)
            }) && !state
                .client
                .iter()
                .any(|s| matches!(s, StepStatus::InFlight { op: o, .. } if o == op))
        });
        if state.parent.lifecycle() != Lifecycle::Closed
            || !state.parent.in_flight().is_empty()
            || !state.parent.staged().is_empty()
            || !state.staged.is_empty()
            || state.parent.poll_timeout().is_some()
            || !all_failed
        {
            state.breach("close left an operation, a staged payload or a deadline behind");
        }
        Some(())
    }

    /// Applies a forged or out-of-range input to copies of the machines;
    /// `None` when every answer is the documented one and nothing changed,
    /// otherwise `state` with the breach recorded.
    fn forge(&self, state: &State, forged: Forged) -> Option<State> {
        use ErrorCode as E;
        let lifecycle = state.parent.lifecycle();
        let now = Time(state.now);
        let nobody = TargetId(self.config.targets);
        let a = digest_of('A')?;
        // What a parent input that checks its target answers: refused
        // before start, ignored after close, `code` while started.
        let expect = |result: Result<(), callreg::error::Error>, code: ErrorCode| match lifecycle {
            Lifecycle::New => matches!(result, Err(e) if e.code == E::LIFECYCLE_INVALID),
            Lifecycle::Closed => result.is_ok(),
            Lifecycle::Started => matches!(result, Err(e) if e.code == code),
        };
        let refused = |result: Result<(), callreg::error::Error>, code: ErrorCode| matches!(result, Err(e) if e.code == code);
        // The seq the parent issues next, from a register on a copy.
        let next_seq = {
            let mut probe = state.parent.clone();
            probe
                .register(digest_of('Z')?, Namespace::LocalPython, now)
                .ok()
                .map(|op| op.0)
        };
        let reply = |seq: u64| Reply {
            seq: Seq(seq),
            digest: a,
            result: Ok(()),
        };
        let mut ok = true;
        let mut parent = state.parent.clone();
        let why: &'static str = match forged {
            Forged::ReplyFromNoTarget => {
                let seq = state.parent.in_flight().first().map_or(1, |op| op.0);
                ok &= expect(
                    parent.handle_reply(nobody, reply(seq), now),
                    E::FRAME_INVALID,
                );
                ok &= expect(parent.target_lost(nobody, now), E::FRAME_INVALID);
                "a reply from the target id one past the last was not refused with FRAME_INVALID, or changed the parent"
            }
            Forged::ReplySeqZero | Forged::ReplySeqUnissued => {
                let seq = match forged {
                    Forged::ReplySeqZero => Some(0),
                    _ => next_seq,
                };
                for id in self.target_ids() {
                    let Some(seq) = seq else { break };
                    let result = parent.handle_reply(id, reply(seq), now);
                    ok &= match (lifecycle, state.parent.is_target_live(id)) {
                        (Lifecycle::Started, true) => refused(result, E::FRAME_INVALID),
                        // Replies from a lost target are ignored.
                        (Lifecycle::Started, false) => result.is_ok(),
                        _ => expect(result, E::FRAME_INVALID),
                    };
                }
                "a reply for a seq never issued was not refused with FRAME_INVALID, or changed the parent"
            }
            Forged::LostNoTarget => {
                ok &= expect(parent.target_lost(nobody, now), E::FRAME_INVALID);
                ok &= !parent.is_target_live(nobody);
                "target_lost of the target id one past the last was not refused with FRAME_INVALID, or changed the parent"
            }
            Forged::StageFailedLate => {
                let failure = Failure::new(E::IO_FAILED, "forged");
                let mut ids: Vec<u64> = state.parent.in_flight().iter().map(|op| op.0).collect();
                ids.push(0);
                ids.extend(next_seq);
                for id in ids {
                    ok &= refused(
                        parent.stage_failed(StagingId(id), failure.clone()),
                        E::FRAME_INVALID,
                    );
                }
                "stage_failed for a register whose frames were sent, or for no register, was not refused with FRAME_INVALID, or changed the parent"
            }
            Forged::SubmitOutOfScope => {
                for handle in state.parent.live_handles() {
                    let uncertain = state.parent.is_uncertain(handle.digest());
                    let mut targets = vec![nobody];
                    targets.extend(
                        self.target_ids()
                            .filter(|t| !state.parent.is_target_live(*t)),
                    );
                    for target in targets {
                        let code = if lifecycle != Lifecycle::Started {
                            E::LIFECYCLE_INVALID
                        } else if uncertain {
                            E::REGISTER_CLEANUP_UNCERTAIN
                        } else if target == nobody {
                            E::NO_LIVE_TARGET
                        } else {
                            E::TARGET_LOST
                        };
                        ok &= refused(parent.submit(&handle, target).map(|_| ()), code);
                    }
                }
                "a task for the target id one past the last, or for a lost target, was not refused with its documented error, or changed the parent"
            }
            Forged::TargetUnknownSeq => {
                for (index, target) in state.targets.iter().enumerate() {
                    let Some(target) = target else { continue };
                    let side = &state.sides[index];
                    let mut copy = target.clone();
                    let mut unknown = vec![Seq(0)];
                    unknown.extend(side.runs.iter().map(|(s, _, _)| *s));
                    for seq in &unknown {
                        ok &= refused(copy.on_deserialized(*seq, Ok(())), E::FRAME_INVALID);
                    }
                    let mut not_running = vec![Seq(0)];
                    not_running.extend(side.deserializing.iter().map(|(s, _)| *s));
                    for seq in &not_running {
                        ok &= refused(copy.end_task(*seq), E::FRAME_INVALID);
                    }
                    ok &= copy.poll_effect().is_none() && copy == *target;
                    // Unregisters of digests not installed: refused, with
                    // UNREGISTER_TOMBSTONE_ACTIVE when a run still holds a
                    // tombstoned slot of it; tasks for them and second runs
                    // of a seq in progress are refused.
                    let tombstoned = target.tombstoned_slots();
                    for c in ['A', 'B', 'C', 'D'] {
                        let d = digest_of(c)?;
                        if target.refcount(d) > 0 {
                            continue;
                        }
                        let expected = if side
                            .runs
                            .iter()
                            .any(|(_, slot, run)| *run == d && tombstoned.contains(slot))
                        {
                            E::UNREGISTER_TOMBSTONE_ACTIVE
                        } else {
                            E::DIGEST_NOT_INSTALLED
                        };
                        copy.on_unregister(Seq(0), d);
                        ok &= matches!(
                            copy.poll_effect(),
                            Some(TargetEffect::Reply(Reply { seq: Seq(0), digest, result: Err(f) }))
                                if digest == d && f.code == expected
                        );
                        ok &= refused(
                            copy.begin_task(Seq(0), d).map(|_| ()),
                            E::DIGEST_NOT_INSTALLED,
                        );
                        ok &= copy.poll_effect().is_none() && copy == *target;
                    }
                    for (seq, _, d) in &side.runs {
                        ok &= refused(copy.begin_task(*seq, *d).map(|_| ()), E::FRAME_INVALID);
                    }
                    ok &= copy == *target;
                    for (seq, _) in &side.deserializing {
                        copy.on_register(*seq, a, Ok(a));
                        ok &= matches!(
                            copy.poll_effect(),
                            Some(TargetEffect::Reply(Reply { seq: s, digest, result: Err(f) }))
                                if s == *seq && digest == a && f.code == E::FRAME_INVALID
                        );
                        ok &= copy.poll_effect().is_none() && copy == *target;
                    }
                }
                "a target accepted a deserialization or run end it never started, or a second register of a seq being deserialized"
            }
            Forged::LifecycleAgain => {
                let lifecycle_error =
                    |r: Result<(), callreg::error::Error>| refused(r, E::LIFECYCLE_INVALID);
                if lifecycle != Lifecycle::New {
                    ok &= lifecycle_error(parent.start());
                    ok &= lifecycle_error(
                        parent
                            .register_before_start(a, Namespace::LocalPython)
                            .map(|_| ()),
                    );
                    for handle in state.parent.live_handles() {
                        ok &= lifecycle_error(parent.unregister_before_start(&handle));
                    }
                }
                if lifecycle != Lifecycle::Started {
                    ok &= lifecycle_error(
                        parent.register(a, Namespace::LocalPython, now).map(|_| ()),
                    );
                    let forged = handle_for(a, 1);
                    ok &= lifecycle_error(parent.unregister(&forged, now).map(|_| ()));
                    ok &= lifecycle_error(parent.submit(&forged, TargetId(0)).map(|_| ()));
                    parent.handle_timeout(Time(u64::MAX));
                }
                if lifecycle == Lifecycle::Closed {
                    ok &= lifecycle_error(parent.close());
                    for handle in state.parent.live_handles() {
                        ok &= lifecycle_error(
                            parent.resolve(&handle, Namespace::LocalPython).map(|_| ()),
                        );
                    }
                }
                "a call out of lifecycle order was not refused with LIFECYCLE_INVALID, or changed the parent"
            }
            Forged::WrongNamespace => {
                let chip = Namespace::LocalChip;
                match lifecycle {
                    Lifecycle::New => {
                        ok &= refused(
                            parent.register_before_start(a, chip).map(|_| ()),
                            E::CALLABLE_KIND_UNSUPPORTED,
                        )
                    }
                    Lifecycle::Started => {
                        ok &= refused(
                            parent.register(a, chip, now).map(|_| ()),
                            E::CALLABLE_KIND_UNSUPPORTED,
                        )
                    }
                    Lifecycle::Closed => {}
                }
                if lifecycle != Lifecycle::Closed {
                    for handle in state.parent.live_handles() {
                        ok &= refused(
                            parent.resolve(&handle, chip).map(|_| ()),
                            E::HANDLE_WRONG_NAMESPACE,
                        );
                    }
                }
                "a register in a namespace no target serves, or a resolve for another namespace, was not refused with its documented error, or changed the parent"
            }
            Forged::PreStartCapacity => {
                if lifecycle == Lifecycle::New {
                    let snapshot = state.parent.startup_snapshot();
                    let full = snapshot.len() >= usize::from(self.config.slot_capacity);
                    let mut copy = state.parent.clone();
                    let fresh = copy.register_before_start(digest_of('Y')?, Namespace::LocalPython);
                    ok &= if full {
                        refused(fresh.map(|_| ()), E::LOCAL_SLOT_EXHAUSTED)
                    } else {
                        fresh.is_ok()
                    };
                    for (digest, _) in &snapshot {
                        let mut copy = state.parent.clone();
                        ok &= copy
                            .register_before_start(*digest, Namespace::LocalPython)
                            .is_ok();
                    }
                }
                "register_before_start refused a digest with room in the startup snapshot, or accepted one beyond the slots"
            }
            Forged::AliveNotAwaited => {
                let newest = next_seq.map_or(1, |n| n.saturating_sub(1).max(1));
                ok &= expect(
                    parent.handle_alive(nobody, Seq(newest), ControlPhase::Running, now),
                    E::FRAME_INVALID,
                );
                for id in self.target_ids() {
                    for seq in [Some(0), next_seq].into_iter().flatten() {
                        let result = parent.handle_alive(id, Seq(seq), ControlPhase::Running, now);
                        ok &= match (lifecycle, state.parent.is_target_live(id)) {
                            (Lifecycle::Started, true) => refused(result, E::FRAME_INVALID),
                            // Reports from a lost target are ignored.
                            (Lifecycle::Started, false) => result.is_ok(),
                            _ => expect(result, E::FRAME_INVALID),
                        };
                    }
                    for seq in (1..next_seq.unwrap_or(1)).map(Seq) {
                        if !state.parent.awaits_reply(id, seq) {
                            ok &= parent
                                .handle_alive(id, seq, ControlPhase::Running, now)
                                .is_ok();
                        }
                    }
                }
                "an alive report from no target or for a seq never issued was not refused with FRAME_INVALID, or one for a control not awaited changed the parent"
            }
        };
        ok &= parent == state.parent;
        if ok {
            return None;
        }
        let mut next = state.clone();
        next.breach(why);
        Some(next)
    }
}

impl State {
    fn target(&self, id: TargetId) -> Option<&Target> {
        self.targets.get(usize::from(id.0))?.as_ref()
    }

    /// Records that a machine broke its documented contract (`why` is kept
    /// for the counterexample: the first one on the path).
    fn breach(&mut self, why: &'static str) {
        if self.seen & seen::CONTRACT == 0 {
            self.contract = why;
        }
        self.seen |= seen::CONTRACT;
    }

    /// Whether the parent counts the process `incarnation` of slot `id`
    /// lost: the slot is not live, or a later process holds it.
    fn loss_known(&self, id: TargetId, incarnation: u32) -> bool {
        !self.parent.is_target_live(id) || self.parent.incarnation(id) != incarnation
    }

    /// Target `id`'s process is about to be lost: while the
    /// `stale_replies` budget lasts, the replies it wrote that the parent
    /// has not read are kept as stale replies (taken out of its reply
    /// FIFO) and, with `finishing`, so are the replies its deserializations
    /// in progress would write, had they finished (a process whose
    /// connection dropped may still have answered).
    fn keep_stale_replies(&mut self, id: TargetId, finishing: bool) {
        let index = usize::from(id.0);
        if self.budgets.stale_replies == 0 {
            return;
        }
        let Some(mut target) = self.targets.get(index).cloned().flatten() else {
            return;
        };
        let incarnation = self.sides[index].incarnation;
        let (gone, rest): (Vec<_>, Vec<_>) = self.replies.drain(..).partition(|(t, _)| *t == id);
        self.replies = rest;
        let mut kept: Vec<Reply> = gone.into_iter().map(|(_, r)| r).collect();
        if finishing {
            for (seq, _) in &self.sides[index].deserializing {
                if target.on_deserialized(*seq, Ok(())).is_ok() {
                    while let Some(effect) = target.poll_effect() {
                        if let TargetEffect::Reply(reply) = effect {
                            kept.push(reply);
                        }
                    }
                }
            }
        }
        self.stale_replies
            .extend(kept.into_iter().map(|r| (id, incarnation, r)));
        self.stale_replies
            .sort_by_key(|(t, incarnation, r)| (*t, *incarnation, r.seq));
    }

    /// Target `id` dies: its machine, the frames to it, its deserializations
    /// and runs are gone (replies already written stay readable).
    fn kill(&mut self, id: TargetId) {
        let index = usize::from(id.0);
        if let Some(entry) = self.targets.get_mut(index) {
            *entry = None;
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
        // A breach of the machines' contract ends its path: the
        // counterexample stops there (a known bug may otherwise loop
        // without bound, as a retirement of a busy target handing its
        // tasks over again and again).
        if state.seen & seen::CONTRACT != 0 {
            return;
        }
        let lifecycle = state.parent.lifecycle();
        if self.config.interleave_start {
            if let Some(i) = state.pre.iter().position(|p| *p == PreStatus::Waiting) {
                actions.push(Action::PreStart(i));
            }
            if lifecycle == Lifecycle::New {
                actions.push(Action::Start);
            }
        }
        for i in 0..state.client.len() {
            if self.issuable(state, i) {
                actions.push(Action::Issue(i));
                let register = matches!(
                    self.config.script.operations[i].operation,
                    Operation::Register(_)
                );
                if register && state.budgets.stage_failures > 0 && lifecycle == Lifecycle::Started {
                    actions.push(Action::IssueStageFails(i));
                }
            }
        }
        if state.budgets.tasks > 0 && self.config.submit_any {
            for handle in state.parent.live_handles() {
                actions.push(Action::SubmitAny {
                    handle_id: handle.handle_id,
                });
            }
        } else if state.budgets.tasks > 0 {
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
                if state.budgets.poison_kills > 0 {
                    actions.push(Action::PoisonKills(id));
                }
                if state.budgets.poison_refusals > 0 {
                    actions.push(Action::PoisonRefused(id));
                }
                if state.budgets.deserialize_failures > 0 {
                    actions.push(Action::Deserialized {
                        target: id,
                        ok: false,
                    });
                }
            }
            for (seq, _, _) in &side.runs {
                // Without cancels or a way to lose the target a start
                // decides nothing (it always runs, and is reported): the
                // run starts and ends in one step.
                let action = if side.started.contains(seq) || !self.splits_runs() {
                    Action::EndRun {
                        target: id,
                        seq: *seq,
                    }
                } else {
                    Action::StartRun {
                        target: id,
                        seq: *seq,
                    }
                };
                actions.push(action);
            }
            let results = state.head_result(id).is_some();
            if state.head_reply(id).is_some() || (state.eof[index] && !results) {
                actions.push(Action::Receive(id));
            }
            if results {
                actions.push(Action::ReceiveResult(id));
            }
            if state.budgets.wrong_digests > 0 && state.head_reply(id).is_some() {
                actions.push(Action::ReceiveWrongDigest(id));
            }
            if state.budgets.crashes > 0 && active && state.target(id).is_some() {
                actions.push(Action::Crash(id));
            }
        }
        if state.budgets.stale_results > 0 {
            for (target, result) in &state.stale {
                actions.push(Action::ReceiveStale {
                    target: *target,
                    seq: result.seq,
                });
            }
        }
        if state.budgets.stale_replies > 0 {
            for (target, incarnation, reply) in &state.stale_replies {
                if state.loss_known(*target, *incarnation) {
                    actions.push(Action::ReceiveStaleReply {
                        target: *target,
                        seq: reply.seq,
                    });
                }
            }
        }
        if state.budgets.cancels > 0 && lifecycle == Lifecycle::Started {
            for seq in state.parent.tasks_in_flight() {
                let target = state.parent.task(seq).map(|t| t.target);
                if target.is_some_and(|t| !state.parent.awaits_cancel(t, seq)) {
                    actions.push(Action::Cancel(seq));
                }
            }
        }
        if state.budgets.template_losses > 0
            && self.config.respawn_limit > 0
            && lifecycle == Lifecycle::Started
        {
            actions.push(Action::TemplateLost);
        }
        let template_gone = state.seen & seen::TEMPLATE_LOST != 0;
        for id in self.target_ids() {
            if state.spawns[usize::from(id.0)].is_some() && template_gone {
                // Nothing can start it now: its spawn fails.
                actions.push(Action::SpawnFails(id));
            } else if state.spawns[usize::from(id.0)].is_some() {
                actions.push(Action::Spawn(id));
                if state.budgets.spawn_failures > 0 {
                    actions.push(Action::SpawnFails(id));
                }
                if state.budgets.restage_failures > 0 {
                    actions.push(Action::SpawnRestageFails(id));
                }
            }
        }
        if state.parent.poll_timeout().is_some()
            && (state.budgets.deadlines > 0 || self.backoff_only(state))
        {
            actions.push(Action::DeadlinePasses);
        }
        if state.budgets.closes > 0 && lifecycle == Lifecycle::Started {
            actions.push(Action::Close);
        }
        if self.config.forged {
            actions.extend(Forged::ALL.iter().map(|f| Action::Forge(*f)));
        }
        // A heartbeat only moves deadlines: with no deadline left to pass it
        // cannot change what happens (only model time and the parent's
        // record of when it heard from the target), so it is not offered.
        if state.budgets.heartbeats > 0 && state.budgets.deadlines > 0 {
            for id in self.target_ids() {
                if state.target(id).is_some() && !heartbeat_seqs(state, id).is_empty() {
                    actions.push(Action::Heartbeat(id));
                }
            }
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
                self.submit(&mut state, handle_id, Some(target))?
            }
            Action::SubmitAny { handle_id } => self.submit(&mut state, handle_id, None)?,
            Action::Deliver(id) => self.deliver(&mut state, id, false)?,
            Action::DeliverCorrupted(id) => {
                state.budgets.corruptions = state.budgets.corruptions.checked_sub(1)?;
                state.seen |= seen::FAULT;
                self.deliver(&mut state, id, true)?;
            }
            Action::Deserialized { target: id, ok } => {
                let result = if ok {
                    Ok(())
                } else {
                    state.budgets.deserialize_failures =
                        state.budgets.deserialize_failures.checked_sub(1)?;
                    state.seen |= seen::FAULT;
                    Err(Failure::new(
                        ErrorCode::DESERIALIZE_FAILED,
                        "the runtime failed to deserialize the payload",
                    ))
                };
                self.deserialized(&mut state, id, result)?;
            }
            Action::PoisonRefused(id) => {
                state.budgets.poison_refusals = state.budgets.poison_refusals.checked_sub(1)?;
                state.seen |= seen::FAULT;
                let refusal = Failure::new(ErrorCode::REGISTER_POISONED, NESTED_POISON_CAUSE);
                self.deserialized(&mut state, id, Err(refusal))?;
            }
            Action::StartRun { target: id, seq } => self.start_run(&mut state, id, seq)?,
            Action::EndRun { target: id, seq } => {
                let index = usize::from(id.0);
                if !state.sides.get(index)?.started.contains(&seq) {
                    if self.splits_runs() {
                        return None;
                    }
                    self.start_run(&mut state, id, seq)?;
                    if !state.sides[index].started.contains(&seq) {
                        return None;
                    }
                }
                let incarnation = state.sides[index].incarnation;
                let digest = state.sides[index]
                    .runs
                    .iter()
                    .find(|(s, _, _)| *s == seq)
                    .map(|(_, _, d)| *d)?;
                self.end_run(&mut state, id, seq)?;
                state.report(id, seq, digest, incarnation, false);
            }
            Action::ReceiveResult(id) => self.receive_result(&mut state, id, None)?,
            Action::ReceiveStale { target, seq } => {
                state.budgets.stale_results = state.budgets.stale_results.checked_sub(1)?;
                state.seen |= seen::FAULT;
                self.receive_result(&mut state, target, Some(seq))?;
                if state.budgets.stale_results == 0 {
                    state.stale.clear();
                }
            }
            Action::ReceiveStaleReply { target, seq } => {
                state.budgets.stale_replies = state.budgets.stale_replies.checked_sub(1)?;
                state.seen |= seen::FAULT;
                self.receive_stale_reply(&mut state, target, seq)?;
                if state.budgets.stale_replies == 0 {
                    state.stale_replies.clear();
                }
            }
            Action::Cancel(seq) => self.cancel(&mut state, seq)?,
            Action::Receive(id) => self.receive(&mut state, id, false)?,
            Action::ReceiveWrongDigest(id) => {
                state.budgets.wrong_digests = state.budgets.wrong_digests.checked_sub(1)?;
                state.seen |= seen::FAULT | seen::WRONG_DIGEST;
                self.receive(&mut state, id, true)?;
            }
            Action::Crash(id) => {
                state.budgets.crashes = state.budgets.crashes.checked_sub(1)?;
                state.target(id)?;
                state.seen |= seen::FAULT;
                state.keep_stale_replies(id, true);
                state.kill(id);
                state.eof[usize::from(id.0)] = true;
            }
            Action::PoisonKills(id) => {
                state.budgets.poison_kills = state.budgets.poison_kills.checked_sub(1)?;
                if state.sides.get(usize::from(id.0))?.deserializing.is_empty() {
                    return None;
                }
                state.seen |= seen::FAULT;
                if self.config.departures {
                    state.seen |= seen::POISON_DEPARTED;
                }
                // The deserialization that kills it answers nothing.
                state.keep_stale_replies(id, false);
                state.kill(id);
                state.eof[usize::from(id.0)] = true;
            }
            Action::DeadlinePasses => {
                if self.backoff_only(&state) {
                    state.seen |= seen::BACKOFF_PASSED;
                } else {
                    state.budgets.deadlines = state.budgets.deadlines.checked_sub(1)?;
                    state.seen |= seen::FAULT;
                }
                let deadline = state.parent.poll_timeout()?;
                state.now = state.now.max(deadline.0);
                let now = state.now;
                // Tasks in flight past their deadline (by the driver's
                // record): each must end `Deadline` here, its target
                // fenced (§2.12).
                let due: Vec<(Seq, TargetId, u32)> = state
                    .task_log
                    .iter()
                    .filter(|n| n.ends == 0 && n.deadline.is_some_and(|d| d <= now))
                    .map(|n| (n.seq, n.target, n.incarnation))
                    .collect();
                // Targets a task deadline or an unanswered cancel may fence:
                // the rule for heard targets is about controls.
                let exempt: Vec<TargetId> = state
                    .task_log
                    .iter()
                    .filter(|n| {
                        (n.ends == 0 && n.deadline.is_some())
                            || state.parent.awaits_cancel(n.target, n.seq)
                    })
                    .map(|n| n.target)
                    .collect();
                // Targets heard from within the control timeout about every
                // control they owe, with whether one of those controls'
                // bounds has passed (`specs/protocol.md` §2.7): only a bound
                // may end the wait for them.
                let heard: Vec<(TargetId, Vec<Seq>, bool)> = self
                    .target_ids()
                    .filter(|id| !exempt.contains(id))
                    .filter_map(|id| {
                        let awaited = state.parent.awaited_controls(id);
                        let alive = &state.sides[usize::from(id.0)].alive;
                        let all_heard = !awaited.is_empty()
                            && awaited.iter().all(|(seq, _)| {
                                alive
                                    .iter()
                                    .any(|(s, at)| s == seq && at + CONTROL_TIMEOUT > now)
                            });
                        let bounded = awaited.iter().any(|(_, bound)| bound.0 <= now);
                        all_heard.then(|| (id, awaited.iter().map(|(s, _)| *s).collect(), bounded))
                    })
                    .collect();
                // Targets that reported alive for a control they owe, but
                // not within the control timeout, before any bound.
                let lapsed: Vec<(TargetId, Vec<Seq>)> = self
                    .target_ids()
                    .filter(|id| !exempt.contains(id))
                    .filter_map(|id| {
                        let awaited = state.parent.awaited_controls(id);
                        let alive = &state.sides[usize::from(id.0)].alive;
                        let reported = awaited
                            .iter()
                            .any(|(seq, _)| alive.iter().any(|(s, _)| s == seq));
                        let bounded = awaited.iter().any(|(_, bound)| bound.0 <= now);
                        let heard = heard.iter().any(|(t, _, _)| *t == id);
                        (reported && !bounded && !heard)
                            .then(|| (id, awaited.iter().map(|(s, _)| *s).collect()))
                    })
                    .collect();
                let awaited_before: Vec<(TargetId, Seq)> = self
                    .target_ids()
                    .flat_map(|id| {
                        state
                            .parent
                            .awaited_controls(id)
                            .into_iter()
                            .map(move |(seq, _)| (id, seq))
                    })
                    .collect();
                // Arrivals (§2.9): a target open before the deadline is
                // still open after it, its failed joins unchanged.
                let open: Vec<(TargetId, u32, u16)> = self
                    .target_ids()
                    .filter(|t| state.parent.target_phase(*t) == TargetPhase::Spawning)
                    .map(|t| (t, state.parent.incarnation(t), state.parent.failed_joins(t)))
                    .collect();
                // Probes (`specs/protocol.md` §2.8), by the driver's own
                // record: each live target whose oldest awaited control is
                // a client register that probes and that no target
                // confirmed, with its digest and whether the target's last
                // alive report about it said running.
                let probes: Vec<(TargetId, Digest, bool)> = self
                    .target_ids()
                    .filter(|t| state.parent.is_target_live(*t))
                    .filter_map(|t| {
                        let (oldest, _) = *state.parent.awaited_controls(t).first()?;
                        let i = state.client.iter().position(|step| {
                            matches!(step, StepStatus::InFlight { op, probing: true, confirmed: false, .. } if op.0 == oldest.0)
                        })?;
                        let Operation::Register(c) = self.config.script.operations[i].operation
                        else {
                            return None;
                        };
                        let running = state.sides[usize::from(t.0)].running.contains(&oldest);
                        Some((t, digest_of(c)?, running))
                    })
                    .collect();
                let poisoned_before = state.parent.poisoned_digests();
                state.parent.handle_timeout(Time(now));
                for (target, digest, running) in probes {
                    let poison = state
                        .parent
                        .poisoned_digests()
                        .into_iter()
                        .find(|(d, _)| *d == digest)
                        .filter(|entry| !poisoned_before.contains(entry));
                    let bound_fenced = heard.iter().any(|(t, _, bounded)| *t == target && *bounded)
                        && !state.parent.is_target_live(target);
                    match poison {
                        Some((_, poison))
                            if poison.target == target
                                && poison.cause == BOUND_FENCE_CAUSE
                                && !running =>
                        {
                            state.seen |= seen::QUEUED_POISONED;
                        }
                        None if bound_fenced && !running => state.seen |= seen::QUEUED_SPARED,
                        _ => {}
                    }
                }
                if self.config.arrivals
                    && state.parent.lifecycle() == Lifecycle::Started
                    && open.iter().any(|(t, incarnation, failed)| {
                        state.parent.target_phase(*t) != TargetPhase::Spawning
                            || state.parent.incarnation(*t) != *incarnation
                            || state.parent.failed_joins(*t) != *failed
                    })
                {
                    state.seen |= seen::ARRIVAL_FENCED;
                }
                let some_ended = awaited_before
                    .iter()
                    .any(|(id, seq)| !state.parent.awaits_reply(*id, *seq));
                for (id, seqs, bounded) in heard {
                    let ended = seqs.iter().any(|s| !state.parent.awaits_reply(id, *s));
                    if ended && !bounded {
                        state.seen |= seen::FENCED_WHILE_HEARD;
                    }
                    if ended && bounded {
                        state.seen |= seen::BOUND_ENDED_HEARD;
                    }
                    if !ended && some_ended {
                        state.seen |= seen::SPARED_HEARD;
                    }
                }
                for (id, seqs) in lapsed {
                    if seqs.iter().any(|s| !state.parent.awaits_reply(id, *s)) {
                        state.seen |= seen::SILENT_AFTER_HEARD;
                    }
                }
                self.drain_parent(&mut state);
                for (seq, target, incarnation) in due {
                    let ended = state
                        .note(seq)
                        .is_some_and(|n| n.end == Some(Ended::Deadline));
                    let fenced = state.target(target).is_none()
                        && (!state.parent.is_target_live(target)
                            || state.parent.incarnation(target) != incarnation);
                    if !ended || !fenced {
                        state.seen |= seen::DEADLINE_MISSED;
                    }
                }
            }
            Action::PreStart(i) => self.pre_start(&mut state, i)?,
            Action::Start => {
                if state.parent.lifecycle() != Lifecycle::New {
                    return None;
                }
                self.start(&mut state);
            }
            Action::Close => self.close(&mut state)?,
            Action::Forge(forged) => return self.forge(last, forged),
            Action::Spawn(id) => self.spawn(&mut state, id, true, false)?,
            Action::SpawnFails(id) => {
                // Without a template every spawn fails, at no budget.
                if state.seen & seen::TEMPLATE_LOST == 0 {
                    state.budgets.spawn_failures = state.budgets.spawn_failures.checked_sub(1)?;
                }
                self.spawn(&mut state, id, false, false)?;
            }
            Action::TemplateLost => {
                state.budgets.template_losses = state.budgets.template_losses.checked_sub(1)?;
                state.seen |= seen::FAULT | seen::TEMPLATE_LOST;
                state.parent.replacements_ended();
                if !state.parent.are_replacements_ended() {
                    state.breach("replacements_ended did not end replacements");
                }
                self.drain_parent(&mut state);
            }
            Action::SpawnRestageFails(id) => {
                state.budgets.restage_failures = state.budgets.restage_failures.checked_sub(1)?;
                self.spawn(&mut state, id, true, true)?;
            }
            Action::Heartbeat(id) => {
                state.budgets.heartbeats = state.budgets.heartbeats.checked_sub(1)?;
                let seqs = heartbeat_seqs(&state, id);
                if seqs.is_empty() {
                    return None;
                }
                let deadline = state.parent.poll_timeout()?;
                state.now = state.now.max(deadline.0.saturating_sub(1));
                let now = state.now;
                let side = &mut state.sides[usize::from(id.0)];
                // Running exactly while its deserialization is in progress
                // here (the real target: once the runtime began its
                // install); queued before (its frame not applied yet).
                let phases: Vec<(Seq, ControlPhase)> = seqs
                    .iter()
                    .map(|seq| {
                        let running = side.deserializing.iter().any(|(s, _)| s == seq);
                        let phase = if running {
                            ControlPhase::Running
                        } else {
                            ControlPhase::Queued
                        };
                        (*seq, phase)
                    })
                    .collect();
                for (seq, phase) in &phases {
                    side.alive.retain(|(s, _)| s != seq);
                    side.alive.push((*seq, now));
                    side.running.retain(|s| s != seq);
                    if *phase == ControlPhase::Running {
                        side.running.push(*seq);
                    }
                }
                side.alive.sort();
                side.running.sort();
                for (seq, phase) in phases {
                    if state
                        .parent
                        .handle_alive(id, seq, phase, Time(now))
                        .is_err()
                    {
                        state.seen |= seen::DRIVER_ERROR;
                    }
                }
            }
        }
        // An uncertain digest that is certain now healed (§2.4).
        let now_uncertain = state.parent.uncertain_digests();
        if last
            .parent
            .uncertain_digests()
            .iter()
            .any(|d| !now_uncertain.contains(d))
        {
            state.seen |= seen::HEALED;
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
            ControlFrame::Cancel { seq, digest } => {
                format!("cancel of the task on {} ({seq})", name_of(digest))
            }
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
            Action::SubmitAny { handle_id } => {
                format!("client dispatches a task for handle {handle_id} to the target the parent picks")
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
                    Some((seq, _)) => format!("{target}: deserialization for {seq} {how}"),
                    None => format!("{target}: no deserialization"),
                }
            }
            Action::StartRun { target, seq } => {
                let cancelled = state.target(*target).is_some_and(|t| t.is_cancelled(*seq));
                if cancelled {
                    format!("{target}: task {seq} reaches its start, CANCELLED: it is skipped")
                } else {
                    format!("{target}: run of task {seq} starts")
                }
            }
            Action::EndRun { target, seq } => {
                format!("{target}: run of task {seq} ends and sends its result")
            }
            Action::ReceiveResult(t) => match state.head_result(*t) {
                Some(r) => format!(
                    "parent receives from {t}: {} of task {} (incarnation {})",
                    if r.start { "start report" } else { "result" },
                    r.seq,
                    r.incarnation
                ),
                None => format!("parent reads no result from {t}"),
            },
            Action::ReceiveStale { target, seq } => {
                let incarnation = state
                    .stale
                    .iter()
                    .find(|(t, r)| t == target && r.seq == *seq)
                    .map_or(0, |(_, r)| r.incarnation);
                format!("a STALE result of task {seq} from {target} (incarnation {incarnation}, lost) reaches the parent")
            }
            Action::ReceiveStaleReply { target, seq } => {
                let (incarnation, result) = state
                    .stale_replies
                    .iter()
                    .find(|(t, _, r)| t == target && r.seq == *seq)
                    .map_or((0, String::new()), |(_, i, r)| {
                        let result = match &r.result {
                            Ok(()) => "OK".to_owned(),
                            Err(f) => f.code.to_string(),
                        };
                        (*i, format!(" {result} for {}", name_of(&r.digest)))
                    });
                format!("a STALE reply{result} to {seq} from {target} (incarnation {incarnation}, lost) reaches the parent")
            }
            Action::Cancel(seq) => format!("client cancels task {seq}"),
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
            Action::PoisonKills(t) => match state
                .sides
                .get(usize::from(t.0))
                .and_then(|s| s.deserializing.first())
            {
                Some((seq, _)) => format!("{t} DIES while deserializing for {seq} (a poison payload)"),
                None => format!("{t}: no deserialization"),
            },
            Action::PoisonRefused(t) => match state
                .sides
                .get(usize::from(t.0))
                .and_then(|s| s.deserializing.first())
            {
                Some((seq, _)) => format!("{t}: deserialization for {seq} is REFUSED as poisoned (a nested registry's own probe lost a process)"),
                None => format!("{t}: no deserialization"),
            },
            Action::ReceiveWrongDigest(t) => match state.head_reply(*t) {
                Some(r) => format!(
                    "parent receives from {t}: reply to {} naming a WRONG digest (the frame named {})",
                    r.seq,
                    name_of(&r.digest)
                ),
                None => format!("parent reads nothing from {t}"),
            },
            Action::PreStart(i) => {
                let what = match self.config.script.before_start.get(*i) {
                    Some(BeforeStart::Register(c)) => format!("register {c}"),
                    Some(BeforeStart::Unregister(j)) => {
                        format!("unregister the handle of before_start[{j}]")
                    }
                    None => "nothing".to_owned(),
                };
                let when = if state.parent.lifecycle() == Lifecycle::New {
                    ""
                } else {
                    " (after start)"
                };
                format!("client calls pre-start step {i}: {what}{when}")
            }
            Action::Start => "client starts the Worker".to_owned(),
            Action::Close => format!(
                "client CLOSES the Worker with {} operation(s) in flight",
                state.parent.in_flight().len()
            ),
            Action::Forge(f) => format!("a forged input is given to the machines: {f:?}"),
            Action::Spawn(t) => format!(
                "the driver starts replacement incarnation {} of {t}",
                state.spawns[usize::from(t.0)].unwrap_or_default()
            ),
            Action::SpawnFails(t) => format!(
                "replacement incarnation {} of {t} FAILS to start",
                state.spawns[usize::from(t.0)].unwrap_or_default()
            ),
            Action::TemplateLost => "the template process is LOST: no replacement can start".to_owned(),
            Action::SpawnRestageFails(t) => format!(
                "the driver starts replacement incarnation {} of {t}; staging its first replay's payload again FAILS",
                state.spawns[usize::from(t.0)].unwrap_or_default()
            ),
            Action::DeadlinePasses => match state.parent.poll_timeout() {
                Some(d) if self.backoff_only(state) => {
                    format!("the back-off before a replacement ends at time {}", d.0)
                }
                Some(d) if state.parent.poll_bound() == Some(d) => {
                    format!("the operation bound at time {} passes", d.0)
                }
                Some(d) => format!("the silence deadline at time {} passes", d.0),
                None => "no deadline is pending".to_owned(),
            },
            Action::Heartbeat(t) => {
                let seqs = heartbeat_seqs(state, *t);
                let at = state
                    .parent
                    .poll_timeout()
                    .map_or(state.now, |d| state.now.max(d.0.saturating_sub(1)));
                if seqs.is_empty() {
                    format!("{t} has nothing to report alive")
                } else {
                    let deserializing = &state.sides[usize::from(t.0)].deserializing;
                    let names: Vec<String> = seqs
                        .iter()
                        .map(|seq| {
                            if deserializing.iter().any(|(s, _)| s == seq) {
                                format!("{seq} (running)")
                            } else {
                                format!("{seq} (queued)")
                            }
                        })
                        .collect();
                    format!("{t} reports alive for {} at time {at}", names.join(", "))
                }
            }
        }
    }

    /// A short summary of `state` for the end of a trace: the client's
    /// results, live handles, uncertain digests, staged payloads and each
    /// target's installed digests with refcounts.
    pub fn summarize(&self, state: &State) -> String {
        let mut out = Vec::new();
        if !state.pre.is_empty() {
            out.push(format!("pre-start: {:?}", state.pre));
        }
        out.push(format!("lifecycle: {:?}", state.parent.lifecycle()));
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
            let id = TargetId(u16::try_from(i).unwrap_or(u16::MAX));
            let phase = match state.parent.target_phase(id) {
                _ if self.config.respawn_limit == 0 => String::new(),
                phase => format!(" (incarnation {}, {phase:?})", state.parent.incarnation(id)),
            };
            out.push(format!("target {i}{phase}: {text}"));
        }
        out.join("\n")
    }

    /// The first invariant (1–9, 11–13) `state` breaks, with what was seen.
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
/// left running instead of fenced (specs/design.md §4.1).
#[cfg(feature = "mutants")]
pub fn mutant_needs_no_fence(mutant: Mutant) -> bool {
    mutant == Mutant::ForgetUncertain
}

/// Whether `mutant`'s code path is reachable only with replacement targets
/// on (`respawn_limit` 1 or more, `--respawn-limit`): the join
/// (`specs/protocol.md` §2.9).
#[cfg(feature = "mutants")]
pub fn mutant_needs_respawn(mutant: Mutant) -> bool {
    matches!(
        mutant,
        Mutant::JoinBeforeReplay | Mutant::SkipReplayOfPublished | Mutant::RetireBusy
    )
}

/// Whether `mutant`'s code path is reachable only with refusals as
/// poisoned (`poison_refusals` 1 or more, `--poison-refusals`): a probe's
/// nested refusal (`specs/protocol.md` §2.8).
#[cfg(feature = "mutants")]
pub fn mutant_needs_poison_refusals(mutant: Mutant) -> bool {
    mutant == Mutant::IgnoreNestedPoison
}

/// Every mutant's command-line name (none without the `mutants` feature).
pub fn mutant_names() -> Vec<String> {
    #[cfg(feature = "mutants")]
    return Mutant::ALL.iter().map(|m| mutant_name(*m)).collect();
    #[cfg(not(feature = "mutants"))]
    Vec::new()
}
