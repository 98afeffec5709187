//! Tasks in the parent machine (`specs/protocol.md` §2.11, §2.12): every
//! task in flight with its target, incarnation and deadline, and the one
//! place each ends — a result, a cancel, a deadline, a loss of its
//! target's process, a close.
//!
//! * A task is in flight from [`Parent::submit_with_deadline`] until its
//!   [`Effect::TaskDone`]; it is done exactly once.
//! * The IO layer holds the task's input and result bytes; the machine
//!   holds ids only, and says when a result may be handed over.
//! * A cancel is a control to the target, which decides against the start
//!   of the run (the target machine's `start_task`), so a task is never
//!   both cancelled and run.
//! * Placement and retirement (§2.14): [`Parent::submit_any`] picks the
//!   target; a task no target can take yet waits in the machine for one;
//!   a target sent its `max_tasks_per_target` tasks is retired once they
//!   ended, and replaced.

use serde::{Deserialize, Serialize};

use super::{Effect, Handle, Lifecycle, Parent, Progress, TargetPhase};
use crate::descriptor::Digest;
use crate::error::{Error, ErrorCode, OperationKind};
#[cfg(feature = "mutants")]
use crate::protocol::Mutant;
use crate::protocol::{ControlFrame, Namespace, Reply, Seq, TargetId, Time};

/// The cause of the end of a task that waited in the machine (§2.14)
/// while its callable was unregistered: no process that joins is given
/// the callable, so the task can never run.
pub const UNREGISTERED_WHILE_WAITING: &str =
    "its callable was unregistered while the task waited for a target";

/// The message of `NO_LIVE_TARGET` when no target serves and none is
/// being replaced (§2.9, §2.14): a register or a task has nowhere to go,
/// now or later.
pub const NONE_COMING: &str = "every target is lost, and none is being replaced";

/// How a task ended ([`Effect::TaskDone`]).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(tag = "end", rename_all = "snake_case")]
pub enum TaskEnd {
    /// Its target's result arrived ([`Parent::handle_task_result`]): hand
    /// the result frame to the caller.
    Result,
    /// Cancelled before it started (§2.11): it never ran
    /// (`TASK_CANCELLED`).
    Cancelled,
    /// Its deadline passed, counted from its start report (§2.12): its
    /// target was fenced (`TASK_DEADLINE`).
    Deadline,
    /// Its target's process was lost after it reported the task started,
    /// or without everything it wrote read (`TARGET_LOST`, §2.15): `cause`
    /// says how, as the IO layer reported it or as the machine fenced it.
    Lost {
        /// How the process ended.
        cause: String,
    },
    /// The Worker closed first (`LIFECYCLE_INVALID`).
    Closed,
}

impl TaskEnd {
    /// The error a caller gets for this end (`None` for a result), for the
    /// task `seq` that ran (or was to run) `digest` on incarnation
    /// `incarnation` of `target`.
    pub fn error(
        &self,
        seq: Seq,
        target: TargetId,
        incarnation: u32,
        digest: Digest,
    ) -> Option<Error> {
        let (code, message) = match self {
            TaskEnd::Result => return None,
            TaskEnd::Cancelled => (
                ErrorCode::TASK_CANCELLED,
                format!("{seq} was cancelled before it started on {target}"),
            ),
            TaskEnd::Deadline => (
                ErrorCode::TASK_DEADLINE,
                format!(
                    "{seq} ran past its deadline on {target} (incarnation {incarnation}), which was fenced"
                ),
            ),
            TaskEnd::Lost { cause } => {
                let who = match incarnation {
                    0 => target.to_string(),
                    n => format!("{target} (incarnation {n})"),
                };
                (
                    ErrorCode::TARGET_LOST,
                    format!("{who} was lost ({cause}) before the task's result arrived"),
                )
            }
            TaskEnd::Closed => (
                ErrorCode::LIFECYCLE_INVALID,
                "the Worker closed before the task's result arrived".to_owned(),
            ),
        };
        Some(
            Error::new(code, OperationKind::Task, message)
                .with_target(target)
                .with_seq(seq)
                .with_digest(digest)
                .with_namespace(Namespace::LocalPython),
        )
    }
}

/// A task in flight.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct TaskRecord {
    pub(crate) handle_id: u64,
    pub(crate) digest: Digest,
    pub(crate) target: TargetId,
    /// The incarnation of `target` that was sent the task.
    pub(crate) incarnation: u32,
    /// How long it may run, in microseconds from its start report
    /// (§2.12).
    pub(crate) timeout: Option<u64>,
    /// When it ends with [`TaskEnd::Deadline`] unless done before: set at
    /// its start report.
    pub(crate) deadline: Option<Time>,
    /// Where it stands.
    pub(crate) stage: Stage,
    /// Its target was named at submit ([`Parent::submit_with_timeout`]):
    /// handed over, it goes to that target's next process only (§2.15).
    pub(crate) pinned: bool,
}

/// Where a task in flight stands (§2.11, §2.14, §2.15).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) enum Stage {
    /// Unsent, waiting in the machine for a process of its target to take
    /// it (§2.14).
    Waiting,
    /// Sent to its target's process, which has not reported it started.
    Sent,
    /// Its target's process reported it started (§2.12): its deadline
    /// runs.
    Started,
    /// Sent to a process that was lost before it reported the task
    /// started, and not everything that process wrote is read yet
    /// (§2.15): it is handed over or ends at [`Parent::process_drained`].
    InDoubt {
        /// How the process was lost.
        cause: String,
        /// Whether a cancel of it was asked for.
        cancel: bool,
    },
}

impl Stage {
    /// Whether it counts as sent in its target's load (it was sent to the
    /// target's current process), or as waiting; `None`: in doubt,
    /// counted in no load.
    fn loads_sent(&self) -> Option<bool> {
        match self {
            Stage::Waiting => Some(false),
            Stage::Sent | Stage::Started => Some(true),
            Stage::InDoubt { .. } => None,
        }
    }
}

/// The tasks in flight naming one target (§2.14).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub(crate) struct TargetLoad {
    /// Sent to its current process.
    pub(crate) sent: u32,
    /// Waiting, unsent, naming it.
    pub(crate) waiting: u32,
}

/// A task in flight, as [`Parent::task`] shows it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize)]
pub struct TaskInfo {
    /// The handle it was submitted for.
    pub handle_id: u64,
    /// The callable it runs.
    pub digest: Digest,
    /// Its target.
    pub target: TargetId,
    /// The incarnation of the target that was sent it.
    pub incarnation: u32,
    /// How long it may run, in microseconds from its start report, if
    /// limited.
    pub timeout: Option<u64>,
    /// Its deadline: set when its target reports it started (§2.12).
    pub deadline: Option<Time>,
    /// Whether a cancel of it awaits the target's answer (or, in doubt,
    /// was asked for).
    pub cancelling: bool,
    /// Whether it was sent; `false` while it waits for a process of its
    /// target to take it (§2.14).
    pub sent: bool,
    /// Whether its target reported it started (§2.12).
    pub started: bool,
    /// Whether its process was lost before it reported the task started
    /// and not everything it wrote is read yet (§2.15).
    pub in_doubt: bool,
}

/// A cancel sent and not yet answered: when its target was last heard
/// from about it (the send, then alive reports).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub(crate) struct PendingCancel {
    pub(crate) heard: Time,
}

impl Parent {
    /// Submits a task for `handle` to `target` with no timeout: see
    /// [`Parent::submit_with_timeout`].
    ///
    /// # Errors
    /// As [`Parent::submit_with_timeout`].
    pub fn submit(&mut self, handle: &Handle, target: TargetId) -> Result<Seq, Error> {
        self.submit_with_timeout(handle, target, None, Time(0))
    }

    /// Submits a task for `handle` to `target` at `now`: emits
    /// [`Effect::Send`] of a [`ControlFrame::Task`] with a fresh seq, which
    /// it returns (the task's input travels beside the frame; the machine
    /// holds ids only). The task is in flight until its
    /// [`Effect::TaskDone`]: a result, a cancel ([`Parent::cancel`]), its
    /// deadline passing — `timeout` microseconds after its target reports
    /// it started ([`Parent::handle_task_started`], §2.12: the task ends
    /// with [`TaskEnd::Deadline`] and its target is fenced) —, a loss of
    /// the target's process after the task started (one that never
    /// started is handed to the target's next process, §2.15), or a
    /// close.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless started; the resolution errors of
    /// [`Parent::resolve`] (for `LOCAL_PYTHON`); `NO_LIVE_TARGET` for a
    /// target id out of range; `TARGET_LOST` for a lost target or a
    /// replacement that has not joined yet (§2.9);
    /// `DIGEST_NOT_INSTALLED` if the target never confirmed the handle.
    pub fn submit_with_timeout(
        &mut self,
        handle: &Handle,
        target: TargetId,
        timeout: Option<u64>,
        now: Time,
    ) -> Result<Seq, Error> {
        self.submit_to(handle, target, timeout, now, true)
    }

    /// [`Parent::submit_with_timeout`], the task `pinned` to `target` (its
    /// target named at submit) or placed by the machine.
    fn submit_to(
        &mut self,
        handle: &Handle,
        target: TargetId,
        timeout: Option<u64>,
        now: Time,
        pinned: bool,
    ) -> Result<Seq, Error> {
        let digest = self.check_submit(handle, target)?;
        let seq = self.record_task(handle, digest, target, (timeout, now), pinned);
        self.send_task(seq, target);
        Ok(seq)
    }

    /// A fresh seq for a task of `handle` (of `digest`) in flight, unsent,
    /// naming `target`, with its timeout, submitted at `now`.
    fn record_task(
        &mut self,
        handle: &Handle,
        digest: Digest,
        target: TargetId,
        (timeout, now): (Option<u64>, Time),
        pinned: bool,
    ) -> Seq {
        let seq = self.fresh_seq();
        // The known bug: the clock starts at the submit.
        let deadline = timeout
            .filter(|_| mutant!(self, DeadlineFromSubmit))
            .map(|t| now.saturating_add_micros(t));
        self.tasks.insert(
            seq,
            TaskRecord {
                handle_id: handle.handle_id,
                digest,
                target,
                incarnation: self.incarnation(target),
                timeout,
                deadline,
                stage: Stage::Waiting,
                pinned,
            },
        );
        self.count_task(target, Some(false), true);
        seq
    }

    /// Counts a task in flight naming `target` (`sent` or waiting; `None`:
    /// in doubt, counted in no load) in or out of its load (`in_flight`).
    fn count_task(&mut self, target: TargetId, sent: Option<bool>, in_flight: bool) {
        let (Some(load), Some(sent)) = (self.loads.get_mut(usize::from(target.0)), sent) else {
            return;
        };
        let count = if sent {
            &mut load.sent
        } else {
            &mut load.waiting
        };
        *count = match in_flight {
            true => count.saturating_add(1),
            false => count.saturating_sub(1),
        };
    }

    /// Names `target` (at its current incarnation) as task `seq`'s, at
    /// `stage`, keeping the loads in step.
    fn place_task(&mut self, seq: Seq, target: TargetId, stage: Stage) {
        let incarnation = self.incarnation(target);
        let Some(task) = self.tasks.get_mut(&seq) else {
            return;
        };
        let was = (task.target, task.stage.loads_sent());
        let now = stage.loads_sent();
        task.target = target;
        task.incarnation = incarnation;
        task.stage = stage;
        self.count_task(was.0, was.1, false);
        self.count_task(target, now, true);
    }

    /// Submits a task for `handle` to the target the machine picks
    /// (`specs/protocol.md` §2.14), and returns its fresh seq: of the
    /// targets that take tasks ([`Parent::takes_tasks`]) and confirmed the
    /// handle, the one with the fewest tasks in flight (the lowest id
    /// among equals), to which it is sent at once ([`Effect::Send`] of a
    /// [`ControlFrame::Task`]). With none, the task waits, unsent
    /// ([`Parent::task`] shows it with `sent` false), naming the target
    /// that will take tasks again (a retiring target, or one being
    /// replaced) with the fewest tasks in flight, and is sent to the first
    /// target that takes tasks (at a join). A waiting task ends as a sent
    /// one does (a cancel ends it at once, a close; its deadline has not
    /// started), never because a process of its target was lost; when no
    /// target will take tasks any more, it ends [`TaskEnd::Lost`]. A task
    /// its lost process never started goes to whichever target placement
    /// picks then (§2.15).
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless started; the resolution errors of
    /// [`Parent::resolve`]; `DIGEST_NOT_INSTALLED` when the only targets
    /// that take tasks never confirmed the handle; `NO_LIVE_TARGET` when
    /// no target takes tasks or will.
    pub fn submit_any(
        &mut self,
        handle: &Handle,
        timeout: Option<u64>,
        now: Time,
    ) -> Result<Seq, Error> {
        if self.lifecycle != Lifecycle::Started {
            return Err(self.lifecycle_error(OperationKind::Task, "started"));
        }
        let digest = self.resolve_for(handle, Namespace::LocalPython, OperationKind::Task)?;
        if let Some(target) = self.pick_target(handle.handle_id, false) {
            return self.submit_to(handle, target, timeout, now, false);
        }
        let Some(target) = self.pick_target(handle.handle_id, true) else {
            // A target that takes tasks without the handle: its refusal.
            if let Some(target) = self.all_targets().find(|t| self.takes_tasks(*t)) {
                return self.submit_to(handle, target, timeout, now, false);
            }
            return Err(
                Error::new(ErrorCode::NO_LIVE_TARGET, OperationKind::Task, NONE_COMING)
                    .with_namespace(handle.namespace)
                    .with_digest(digest),
            );
        };
        Ok(self.record_task(handle, digest, target, (timeout, now), false))
    }

    /// The target a task of handle `handle_id` goes to (§2.14): of the
    /// targets that take tasks and confirmed the handle (`later`: of
    /// those that will take tasks again), the one with the fewest tasks
    /// in flight, the lowest id among equals.
    fn pick_target(&self, handle_id: u64, later: bool) -> Option<TargetId> {
        let load = |t: TargetId| {
            self.loads
                .get(usize::from(t.0))
                .map(|l| u64::from(l.sent) + u64::from(l.waiting))
        };
        self.all_targets()
            .filter(|t| match later {
                false => self.takes_tasks_of(handle_id, *t),
                true => self.will_take_tasks(*t),
            })
            .min_by_key(|t| (load(*t), *t))
    }

    /// Sends task `seq`, in flight and unsent, to `target`'s current
    /// process, which is sent one task more.
    fn send_task(&mut self, seq: Seq, target: TargetId) {
        self.place_task(seq, target, Stage::Sent);
        let Some(digest) = self.tasks.get(&seq).map(|task| task.digest) else {
            return;
        };
        *self.served.entry(target).or_insert(0) += 1;
        self.effects.push_back(Effect::Send {
            target,
            frame: ControlFrame::Task { seq, digest },
        });
    }

    /// Whether `target` takes tasks now (§2.14) and confirmed handle
    /// `handle_id`: a task of it may be sent there.
    fn takes_tasks_of(&self, handle_id: u64, target: TargetId) -> bool {
        self.takes_tasks(target)
            && self
                .handles
                .get(&handle_id)
                .is_some_and(|r| r.confirmed.contains(&target))
    }

    /// Whether `target` takes tasks (§2.14): it serves
    /// ([`Parent::is_target_joined`]) and is not retiring.
    pub fn takes_tasks(&self, target: TargetId) -> bool {
        self.is_target_joined(target) && !self.is_retiring(target)
    }

    /// Whether `target`'s process is retiring (§2.14): it serves, and was
    /// sent its [`ParentConfig::max_tasks_per_target`] tasks while
    /// replacements are on and have not ended. It takes no task more, and
    /// is retired once those ended and it owes no answer.
    ///
    /// [`ParentConfig::max_tasks_per_target`]: crate::protocol::ParentConfig::max_tasks_per_target
    pub fn is_retiring(&self, target: TargetId) -> bool {
        let max = self.config.max_tasks_per_target;
        max > 0
            && self.config.respawn_limit > 0
            && !self.replacements_ended
            && self.is_target_joined(target)
            && self.served.get(&target).is_some_and(|n| *n >= max)
    }

    /// Whether `target` does not take tasks now but will (§2.14): it is
    /// retiring, or being replaced (backing off, spawning or joining).
    pub(crate) fn will_take_tasks(&self, target: TargetId) -> bool {
        self.lifecycle == Lifecycle::Started
            && (self.is_retiring(target)
                || matches!(
                    self.target_phase(target),
                    TargetPhase::BackingOff(_) | TargetPhase::Spawning | TargetPhase::Joining
                ))
    }

    /// The tasks sent to `target`'s current process (§2.14).
    pub fn served(&self, target: TargetId) -> u32 {
        self.served.get(&target).copied().unwrap_or(0)
    }

    /// Settles the tasks waiting in the machine (§2.14), in seq order:
    /// each goes to the target [`Parent::submit_any`] would pick now, if
    /// one takes tasks; one whose handle is no longer live can never run
    /// and ends [`TaskEnd::Lost`] ([`UNREGISTERED_WHILE_WAITING`]); one
    /// whose target neither takes tasks nor will waits for another that
    /// will, or, with none, ends [`TaskEnd::Lost`] with `cause`. Called
    /// wherever a target may start taking tasks or be lost for good.
    pub(super) fn settle_waiting(&mut self, cause: &str) {
        if self.loads.iter().all(|l| l.waiting == 0) {
            return;
        }
        let waiting: Vec<(Seq, u64, Option<TargetId>)> = self
            .tasks
            .iter()
            .filter(|(_, task)| task.stage == Stage::Waiting)
            .map(|(seq, task)| (*seq, task.handle_id, task.pinned.then_some(task.target)))
            .collect();
        for (seq, handle_id, pinned) in waiting {
            if !self.handles.contains_key(&handle_id) {
                let cause = UNREGISTERED_WHILE_WAITING.to_owned();
                self.end_task(seq, TaskEnd::Lost { cause });
            } else if let Some(target) = pinned {
                // Handed over with its target named (§2.15): that
                // target's next process, or none.
                if self.takes_tasks_of(handle_id, target) {
                    self.send_task(seq, target);
                } else if !self.will_take_tasks(target) {
                    let cause = cause.to_owned();
                    self.end_task(seq, TaskEnd::Lost { cause });
                }
            } else if let Some(target) = self.pick_target(handle_id, false) {
                self.send_task(seq, target);
            } else if !self
                .tasks
                .get(&seq)
                .is_some_and(|t| self.will_take_tasks(t.target))
            {
                match self.pick_target(handle_id, true) {
                    Some(target) => self.place_task(seq, target, Stage::Waiting),
                    None => {
                        let cause = cause.to_owned();
                        self.end_task(seq, TaskEnd::Lost { cause });
                    }
                }
            }
        }
    }

    /// Retires every retiring target that is idle at `now` (§2.14): none
    /// of its tasks in flight, no cancel to it unanswered, no control
    /// awaiting its answer. It is retired ([`Effect::Retire`]), lost (it
    /// affects no task and no operation; an inspection counts it missing)
    /// and replaced at once.
    pub(super) fn retire_idle(&mut self, now: Time) {
        if self.config.max_tasks_per_target == 0 {
            return;
        }
        let busy_too = mutant!(self, RetireBusy);
        let due: Vec<TargetId> = self
            .all_targets()
            .filter(|t| {
                let idle = || {
                    self.loads
                        .get(usize::from(t.0))
                        .is_some_and(|l| l.sent == 0)
                        && !self.cancels.keys().any(|(c, _)| c == t)
                        && self.awaited_controls(*t).is_empty()
                };
                self.is_retiring(*t) && (busy_too || idle())
            })
            .collect();
        for target in due {
            let tasks = self.served(target);
            let cause = format!("it retired after {tasks} tasks (max_tasks_per_target)");
            self.effects.push_back(Effect::Retire {
                target,
                incarnation: self.incarnation(target),
                tasks,
            });
            self.lose(target, Progress::Fenced, &cause, now, false);
        }
    }

    /// The result of task `seq` of `digest` arrived from incarnation
    /// `incarnation` of `target` at `now` (§2.11): `Ok(true)` when it ends
    /// the task ([`Effect::TaskDone`] with [`TaskEnd::Result`]: hand the
    /// result over; a retiring target that is then idle is retired,
    /// §2.14); `Ok(false)` when it is refused and changes nothing: the task
    /// is not in flight on that incarnation of that target (it ended, or
    /// was sent to another target or incarnation). Ignored (`Ok(false)`)
    /// after close.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` before start; `FRAME_INVALID` for a target out
    /// of range, a seq this parent never issued, or a result naming
    /// another digest than its task in flight there (nothing changes; a
    /// result out of protocol).
    pub fn handle_task_result(
        &mut self,
        target: TargetId,
        incarnation: u32,
        seq: Seq,
        digest: Digest,
        now: Time,
    ) -> Result<bool, Error> {
        if !self.accepts_task_report(target, seq, "task result")? {
            return Ok(false);
        }
        let ours = self.tasks.get(&seq).is_some_and(|task| {
            task.target == target
                && matches!(task.stage, Stage::Sent | Stage::Started)
                && (task.incarnation == incarnation || mutant!(self, AcceptStaleResult))
        });
        if !ours {
            // A result of a process lost before its start report was read
            // proves the task ran there (§2.15).
            return Ok(self.started_in_doubt(target, incarnation, seq));
        }
        let expected = self.tasks.get(&seq).map(|task| task.digest);
        if expected != Some(digest) {
            return Err(Error::new(
                ErrorCode::FRAME_INVALID,
                OperationKind::Reply,
                format!("the result of {seq} names {digest} instead of its task's digest"),
            )
            .with_target(target)
            .with_seq(seq)
            .with_digest(digest));
        }
        self.end_task(seq, TaskEnd::Result);
        self.retire_idle(now);
        Ok(true)
    }

    /// Asks to cancel task `seq` (§2.11): emits [`Effect::Send`] of a
    /// [`ControlFrame::Cancel`] to its target, which answers whether the
    /// task had started: it then ends with [`TaskEnd::Cancelled`] (it never
    /// runs), or [`Effect::CancelRefused`] says it runs to its end. A
    /// second cancel of a task whose cancel is unanswered emits nothing.
    /// A task waiting unsent (§2.14) ends [`TaskEnd::Cancelled`] at once.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless started; `TASK_RUNNING` when `seq` is not
    /// a task in flight (it already ended, or was never issued).
    pub fn cancel(&mut self, seq: Seq, now: Time) -> Result<(), Error> {
        if self.lifecycle != Lifecycle::Started {
            return Err(self.lifecycle_error(OperationKind::Task, "started"));
        }
        let Some(task) = self.tasks.get(&seq) else {
            return Err(Error::new(
                ErrorCode::TASK_RUNNING,
                OperationKind::Task,
                format!("{seq} is not a task in flight: it already ended"),
            )
            .with_seq(seq));
        };
        let (target, digest) = (task.target, task.digest);
        match &task.stage {
            Stage::Waiting => {
                // Waiting in the machine (§2.14): it will never be sent.
                self.end_task(seq, TaskEnd::Cancelled);
                return Ok(());
            }
            Stage::InDoubt { cause, .. } => {
                // Its process is gone: cancelled at the drain if it never
                // started there (§2.15).
                let cause = cause.clone();
                if let Some(task) = self.tasks.get_mut(&seq) {
                    task.stage = Stage::InDoubt {
                        cause,
                        cancel: true,
                    };
                }
                return Ok(());
            }
            Stage::Sent | Stage::Started => {}
        }
        if self.cancels.contains_key(&(target, seq)) {
            return Ok(());
        }
        self.cancels
            .insert((target, seq), PendingCancel { heard: now });
        self.effects.push_back(Effect::Send {
            target,
            frame: ControlFrame::Cancel { seq, digest },
        });
        Ok(())
    }

    /// The task in flight `seq`, if any.
    pub fn task(&self, seq: Seq) -> Option<TaskInfo> {
        let task = self.tasks.get(&seq)?;
        Some(TaskInfo {
            handle_id: task.handle_id,
            digest: task.digest,
            target: task.target,
            incarnation: task.incarnation,
            timeout: task.timeout,
            deadline: task.deadline,
            cancelling: self.cancels.contains_key(&(task.target, seq))
                || matches!(task.stage, Stage::InDoubt { cancel: true, .. }),
            sent: task.stage != Stage::Waiting,
            started: task.stage == Stage::Started,
            in_doubt: matches!(task.stage, Stage::InDoubt { .. }),
        })
    }

    /// The seqs of every task in flight, in seq order.
    pub fn tasks_in_flight(&self) -> Vec<Seq> {
        self.tasks.keys().copied().collect()
    }

    /// Whether a cancel of task `seq` sent to `target` awaits its answer.
    pub fn awaits_cancel(&self, target: TargetId, seq: Seq) -> bool {
        self.cancels.contains_key(&(target, seq))
    }

    /// Ends task `seq` with `end` (once: it leaves the tasks in flight).
    pub(super) fn end_task(&mut self, seq: Seq, end: TaskEnd) {
        let Some(task) = self.tasks.remove(&seq) else {
            return;
        };
        self.count_task(task.target, task.stage.loads_sent(), false);
        self.effects.push_back(Effect::TaskDone {
            seq,
            target: task.target,
            incarnation: task.incarnation,
            digest: task.digest,
            end,
        });
    }

    /// `reply` from `target` answers a cancel it was sent (§2.11): `true`
    /// when it did (handled here), `false` for any other reply.
    pub(super) fn cancel_answered(&mut self, target: TargetId, reply: &Reply) -> bool {
        if self.cancels.remove(&(target, reply.seq)).is_none() {
            return false;
        }
        let in_flight = self
            .tasks
            .get(&reply.seq)
            .is_some_and(|task| task.target == target);
        if !in_flight {
            // The task ended first (its result raced the answer, or it
            // ended otherwise): its TaskDone already answered the cancel.
            return true;
        }
        match &reply.result {
            Ok(()) => self.end_task(reply.seq, TaskEnd::Cancelled),
            Err(failure) => self.effects.push_back(Effect::CancelRefused {
                seq: reply.seq,
                failure: failure.clone(),
            }),
        }
        true
    }

    /// An alive report from `target` for `seq`: `true` when it is about a
    /// cancel awaiting its answer (its silence deadline moves to `now`).
    pub(super) fn cancel_alive(&mut self, target: TargetId, seq: Seq, now: Time) -> bool {
        match self.cancels.get_mut(&(target, seq)) {
            Some(cancel) => {
                cancel.heard = cancel.heard.max(now);
                true
            }
            None => false,
        }
    }

    /// `target`'s process is lost, `cause` saying how (§2.15): every task
    /// sent to it that it reported started ends with [`TaskEnd::Lost`];
    /// one it did not report is in doubt until the IO layer says whether
    /// it read everything the process wrote ([`Parent::process_drained`]).
    /// A task waiting for the target keeps waiting (§2.14). Its
    /// unanswered cancels are dropped (a task in doubt keeps the wish).
    pub(super) fn tasks_lost(&mut self, target: TargetId, cause: &str) {
        if mutant!(self, AcceptStaleResult) {
            // The known bug: the lost process's tasks stay in flight,
            // awaiting a result from any process of the target.
            self.cancels.retain(|(t, _), _| *t != target);
            return;
        }
        let seqs: Vec<(Seq, Stage)> = self
            .tasks
            .iter()
            .filter(|(_, task)| task.target == target && task.stage.loads_sent() == Some(true))
            .map(|(seq, task)| (*seq, task.stage.clone()))
            .collect();
        for (seq, stage) in seqs {
            let cancel = self.cancels.remove(&(target, seq)).is_some();
            let retried = mutant!(self, RetryStarted);
            let cause = cause.to_owned();
            if stage == Stage::Started && !retried {
                self.end_task(seq, TaskEnd::Lost { cause });
                continue;
            }
            self.count_task(target, Some(true), false);
            if let Some(task) = self.tasks.get_mut(&seq) {
                task.stage = Stage::InDoubt { cause, cancel };
                task.deadline = None;
            }
        }
        self.cancels.retain(|(t, _), _| *t != target);
    }

    /// Target `target`'s process `incarnation` reported task `seq`
    /// started at `now` (§2.12): its deadline, if it has a timeout, is
    /// `now` plus the timeout. `Ok(true)` when the report is about a task
    /// in flight sent to that process (a task in doubt, whose process was
    /// lost, then ends [`TaskEnd::Lost`]: it ran there, §2.15);
    /// `Ok(false)` when it changes nothing (the task ended, or was sent
    /// to another process). Ignored (`Ok(false)`) after close.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` before start; `FRAME_INVALID` for a target out
    /// of range, a seq this parent never issued, or a second start report
    /// of one task from its process (nothing changes; a report out of
    /// protocol).
    pub fn handle_task_started(
        &mut self,
        target: TargetId,
        incarnation: u32,
        seq: Seq,
        now: Time,
    ) -> Result<bool, Error> {
        if !self.accepts_task_report(target, seq, "start report")? {
            return Ok(false);
        }
        let Some(task) = self.tasks.get_mut(&seq) else {
            return Ok(false);
        };
        if task.target != target || task.incarnation != incarnation {
            return Ok(false);
        }
        match task.stage {
            Stage::Sent => {
                task.stage = Stage::Started;
                if !mutant!(self, DeadlineFromSubmit) {
                    task.deadline = task.timeout.map(|t| now.saturating_add_micros(t));
                }
                Ok(true)
            }
            Stage::InDoubt { .. } => Ok(self.started_in_doubt(target, incarnation, seq)),
            Stage::Started => Err(Error::new(
                ErrorCode::FRAME_INVALID,
                OperationKind::Reply,
                format!("a second start report of {seq}"),
            )
            .with_target(target)
            .with_seq(seq)),
            Stage::Waiting => Ok(false),
        }
    }

    /// Whether a task report (`what`: a result or a start report) for
    /// `seq` from `target` is read at all: `Ok(false)` after close.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` before start; `FRAME_INVALID` for a target out
    /// of range or a seq this parent never issued.
    fn accepts_task_report(&self, target: TargetId, seq: Seq, what: &str) -> Result<bool, Error> {
        if !self.accepts_from(target, OperationKind::Task)? {
            return Ok(false);
        }
        self.check_issued(target, seq, what)?;
        Ok(true)
    }

    /// The incarnations of `target` whose lost process holds tasks in
    /// doubt (§2.15): each awaits [`Parent::process_drained`].
    pub fn in_doubt_processes(&self, target: TargetId) -> Vec<u32> {
        let mut incarnations: Vec<u32> = self
            .tasks
            .values()
            .filter(|t| t.target == target && matches!(t.stage, Stage::InDoubt { .. }))
            .map(|t| t.incarnation)
            .collect();
        incarnations.sort_unstable();
        incarnations.dedup();
        incarnations
    }

    /// Task `seq`, in doubt on process `incarnation` of `target`, is known
    /// to have started there (a start report or a result read while that
    /// process's output is drained, §2.15): it ends [`TaskEnd::Lost`] with
    /// the loss's cause. `false` (nothing changes) for any other task.
    fn started_in_doubt(&mut self, target: TargetId, incarnation: u32, seq: Seq) -> bool {
        let cause = match self.tasks.get(&seq) {
            Some(task) if task.target == target && task.incarnation == incarnation => {
                match &task.stage {
                    Stage::InDoubt { cause, .. } => cause.clone(),
                    _ => return false,
                }
            }
            _ => return false,
        };
        self.end_task(seq, TaskEnd::Lost { cause });
        true
    }

    /// The IO layer has read what process `incarnation` of `target`
    /// wrote, after its loss (§2.15): every frame, up to its end
    /// (`complete`), or not (its output broke off unparsed). With
    /// `complete`, each task in doubt there never started: it is handed
    /// over — waiting again (§2.14), it goes to the target placement picks
    /// (a task submitted for a named target: that target's next process),
    /// exactly once — or, if a cancel of it was asked for, ends
    /// [`TaskEnd::Cancelled`]. Without, each ends [`TaskEnd::Lost`] with
    /// the loss's cause: it may have run. Ignored before start and after
    /// close, and for a process with no task in doubt.
    pub fn process_drained(&mut self, target: TargetId, incarnation: u32, complete: bool) {
        if self.lifecycle != Lifecycle::Started {
            return;
        }
        let doubts: Vec<(Seq, String, bool)> = self
            .tasks
            .iter()
            .filter(|(_, task)| task.target == target && task.incarnation == incarnation)
            .filter_map(|(seq, task)| match &task.stage {
                Stage::InDoubt { cause, cancel } => Some((*seq, cause.clone(), *cancel)),
                _ => None,
            })
            .collect();
        let mut handed = None;
        for (seq, cause, cancel) in doubts {
            if !complete {
                self.end_task(seq, TaskEnd::Lost { cause });
            } else if cancel {
                self.end_task(seq, TaskEnd::Cancelled);
            } else {
                // Waiting again, naming the process it was lost with
                // until it is sent (as a waiting task names the
                // incarnation at its submit).
                if let Some(task) = self.tasks.get_mut(&seq) {
                    task.stage = Stage::Waiting;
                }
                self.count_task(target, Some(false), true);
                handed = Some(cause);
            }
        }
        if let Some(cause) = handed {
            self.settle_waiting(&cause);
        }
    }

    /// The targets to fence at `now` for their tasks (§2.11, §2.12), each
    /// with the cause: a task's deadline passed (those tasks end with
    /// [`TaskEnd::Deadline`] here), or, with
    /// [`crate::protocol::ParentConfig::fence_on_timeout`], a cancel went unanswered
    /// with no alive report for a control timeout.
    pub(super) fn expire_tasks(&mut self, now: Time) -> Vec<(TargetId, String)> {
        let expired: Vec<(Seq, TargetId)> = self
            .tasks
            .iter()
            .filter(|(_, task)| task.deadline.is_some_and(|d| d <= now))
            .map(|(seq, task)| (*seq, task.target))
            .collect();
        let mut fence: Vec<(TargetId, String)> = Vec::new();
        for (seq, target) in expired {
            if mutant!(self, DeadlineWithoutCompletion) {
                if let Some(task) = self.tasks.get_mut(&seq) {
                    task.deadline = None;
                }
            } else {
                self.end_task(seq, TaskEnd::Deadline);
            }
            if !fence.iter().any(|(t, _)| *t == target) {
                fence.push((target, format!("{seq} passed its deadline")));
            }
        }
        if self.config.fence_on_timeout {
            let timeout = self.config.control_timeout;
            for ((target, seq), cancel) in &self.cancels {
                let silent = cancel.heard.saturating_add_micros(timeout) <= now;
                if silent && !fence.iter().any(|(t, _)| t == target) {
                    fence.push((*target, format!("no answer to the cancel of {seq}")));
                }
            }
        }
        fence
    }

    /// The earliest task deadline, and with fencing the earliest silence
    /// deadline of an unanswered cancel.
    pub(super) fn task_timeout(&self) -> Option<Time> {
        let deadlines = self.tasks.values().filter_map(|task| task.deadline);
        let timeout = self.config.control_timeout;
        let cancels = self
            .cancels
            .values()
            .filter(|_| self.config.fence_on_timeout)
            .map(|cancel| cancel.heard.saturating_add_micros(timeout));
        deadlines.chain(cancels).min()
    }

    /// At close: every task in flight ends with [`TaskEnd::Closed`].
    pub(super) fn close_tasks(&mut self) {
        self.cancels.clear();
        let seqs: Vec<Seq> = self.tasks.keys().copied().collect();
        for seq in seqs {
            self.end_task(seq, TaskEnd::Closed);
        }
    }

    /// `FRAME_INVALID` unless `seq` was issued by this parent.
    pub(super) fn check_issued(&self, target: TargetId, seq: Seq, what: &str) -> Result<(), Error> {
        if seq.0 == 0 || seq.0 >= self.next_seq {
            return Err(Error::new(
                ErrorCode::FRAME_INVALID,
                OperationKind::Reply,
                format!("{what} for {seq} which this Worker never issued"),
            )
            .with_target(target)
            .with_seq(seq));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{digest, drain, new_parent};
    use super::*;
    use crate::protocol::{ControlPhase, Failure, ParentConfig};

    /// A started parent of `targets` targets (replacements after
    /// `respawn_limit` > 0) holding a handle of digest 1 on every target.
    fn with_handle(targets: u16, respawn_limit: u16) -> (Parent, Handle) {
        started_with(ParentConfig {
            respawn_limit,
            ..*new_parent(targets).config()
        })
    }

    /// A parent of `config`, started, holding a handle of digest 1 on
    /// every target.
    fn started_with(config: ParentConfig) -> (Parent, Handle) {
        let mut p = Parent::new(config);
        let handle = p
            .register_before_start(digest(1), Namespace::LocalPython)
            .unwrap();
        p.start().unwrap();
        drain(&mut p);
        (p, handle)
    }

    fn done(seq: Seq, target: u16, incarnation: u32, end: TaskEnd) -> Effect {
        Effect::TaskDone {
            seq,
            target: TargetId(target),
            incarnation,
            digest: digest(1),
            end,
        }
    }

    fn answer(seq: Seq, result: Result<(), Failure>) -> Reply {
        Reply {
            seq,
            digest: digest(1),
            result,
        }
    }

    /// [`with_handle`] with a bound of `max` tasks per process.
    fn bounded(targets: u16, max: u32) -> (Parent, Handle) {
        started_with(ParentConfig {
            respawn_limit: 1,
            max_tasks_per_target: max,
            ..*new_parent(targets).config()
        })
    }

    fn task_frame(seq: Seq, target: u16) -> Effect {
        Effect::Send {
            target: TargetId(target),
            frame: ControlFrame::Task {
                seq,
                digest: digest(1),
            },
        }
    }

    /// Replays of digest 1 answered OK by `target`'s replacement until it
    /// joins (one live handle: one replay).
    fn join(p: &mut Parent, target: u16, incarnation: u32) -> Vec<Effect> {
        p.target_spawned(TargetId(target), incarnation, Time(1))
            .unwrap();
        let replay = drain(p)
            .into_iter()
            .find_map(|e| match e {
                Effect::Send {
                    frame: ControlFrame::Register { seq, .. },
                    ..
                } => Some(seq),
                _ => None,
            })
            .unwrap();
        p.handle_reply(TargetId(target), answer(replay, Ok(())), Time(2))
            .unwrap();
        drain(p)
    }

    #[test]
    fn a_task_without_a_target_goes_to_the_least_loaded_target_lowest_first() {
        let (mut p, h) = with_handle(3, 0);
        let seqs: Vec<Seq> = (0..4)
            .map(|_| p.submit_any(&h, None, Time(0)).unwrap())
            .collect();
        assert_eq!(
            drain(&mut p),
            vec![
                task_frame(seqs[0], 0),
                task_frame(seqs[1], 1),
                task_frame(seqs[2], 2),
                task_frame(seqs[3], 0)
            ]
        );
        // Target 1's task ends: the next goes there, the least loaded.
        p.handle_task_result(TargetId(1), 0, seqs[1], digest(1), Time(0))
            .unwrap();
        drain(&mut p);
        let next = p.submit_any(&h, None, Time(0)).unwrap();
        assert_eq!(drain(&mut p), vec![task_frame(next, 1)]);
        // Every target lost, none coming: refused, a handle this parent
        // never issued as such first.
        for t in 0..3 {
            p.target_lost(TargetId(t), Time(3)).unwrap();
        }
        drain(&mut p);
        let e = p.submit_any(&h, None, Time(0)).unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (
                ErrorCode::NO_LIVE_TARGET,
                "every target is lost, and none is being replaced"
            )
        );
        let foreign = Handle { handle_id: 99, ..h };
        assert_eq!(
            p.submit_any(&foreign, None, Time(0)).unwrap_err().code,
            ErrorCode::HANDLE_FOREIGN
        );
    }

    #[test]
    fn a_process_sent_its_bound_retires_once_idle_and_the_waiting_task_follows() {
        let (mut p, h) = bounded(1, 1);
        let first = p.submit_any(&h, None, Time(0)).unwrap();
        assert_eq!(drain(&mut p), vec![task_frame(first, 0)]);
        assert!(p.is_retiring(TargetId(0)));
        assert!(!p.takes_tasks(TargetId(0)));
        // Given to the retiring target by name: refused.
        let e = p.submit(&h, TargetId(0)).unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (
                ErrorCode::TARGET_LOST,
                "target 0 is retiring: it was sent its 1 tasks (max_tasks_per_target) and is replaced once they end"
            )
        );
        // Given none: it waits, unsent, for target 0.
        let second = p.submit_any(&h, Some(50), Time(0)).unwrap();
        assert_eq!(drain(&mut p), vec![]);
        let waiting = p.task(second).unwrap();
        assert_eq!((waiting.target, waiting.sent), (TargetId(0), false));
        // The first task's result: retired at once, replaced at once.
        p.handle_task_result(TargetId(0), 0, first, digest(1), Time(10))
            .unwrap();
        assert_eq!(
            drain(&mut p),
            vec![
                done(first, 0, 0, TaskEnd::Result),
                Effect::Retire {
                    target: TargetId(0),
                    incarnation: 0,
                    tasks: 1
                },
                Effect::Spawn {
                    target: TargetId(0),
                    incarnation: 1
                },
            ]
        );
        assert_eq!(p.failed_joins(TargetId(0)), 0);
        assert_eq!(p.task(second).map(|t| t.sent), Some(false));
        // The replacement joins: the waiting task is sent to it.
        let effects = join(&mut p, 0, 1);
        assert_eq!(
            effects[effects.len() - 2..],
            [
                Effect::Joined {
                    target: TargetId(0),
                    incarnation: 1
                },
                task_frame(second, 0)
            ]
        );
        let sent = p.task(second).unwrap();
        assert_eq!((sent.incarnation, sent.sent), (1, true));
        assert_eq!(p.served(TargetId(0)), 1);
    }

    #[test]
    fn a_waiting_task_survives_a_crash_ends_at_a_cancel_and_its_clock_waits() {
        let (mut p, h) = bounded(1, 1);
        let first = p.submit_any(&h, None, Time(0)).unwrap();
        let second = p.submit_any(&h, Some(50), Time(0)).unwrap();
        let third = p.submit_any(&h, None, Time(0)).unwrap();
        drain(&mut p);
        assert!(p
            .handle_task_started(TargetId(0), 0, first, Time(1))
            .unwrap());
        // The process crashes with the first task started: only that one
        // ends.
        p.target_died(TargetId(0), "killed by signal 9", Time(5))
            .unwrap();
        let effects = drain(&mut p);
        assert_eq!(
            effects[0],
            done(
                first,
                0,
                0,
                TaskEnd::Lost {
                    cause: "killed by signal 9".to_owned()
                }
            )
        );
        assert_eq!(p.tasks_in_flight(), vec![second, third]);
        // A cancel ends a waiting task at once, with no frame (it names
        // the incarnation of its target at its submit: it reached none).
        p.cancel(third, Time(6)).unwrap();
        assert_eq!(drain(&mut p), vec![done(third, 0, 0, TaskEnd::Cancelled)]);
        // The other's clock has not started: no deadline while it waits.
        let waiting = p.task(second).unwrap();
        assert_eq!((waiting.deadline, waiting.timeout), (None, Some(50)));
        p.handle_timeout(Time(500));
        assert_eq!(p.tasks_in_flight(), vec![second]);
    }

    #[test]
    fn a_deadline_counts_from_the_start_report_not_the_submit() {
        let (mut p, h) = with_handle(1, 0);
        let first = p
            .submit_with_timeout(&h, TargetId(0), Some(30), Time(0))
            .unwrap();
        let second = p
            .submit_with_timeout(&h, TargetId(0), Some(30), Time(0))
            .unwrap();
        drain(&mut p);
        // Nothing started yet: no clock runs.
        assert_eq!(p.poll_timeout(), None);
        assert_eq!(
            p.handle_task_started(TargetId(0), 0, first, Time(10)),
            Ok(true)
        );
        assert_eq!(
            p.task(first).map(|t| (t.started, t.deadline)),
            Some((true, Some(Time(40))))
        );
        // A second report of one start is out of protocol; another
        // incarnation's report changes nothing.
        let before = p.clone();
        assert_eq!(
            p.handle_task_started(TargetId(0), 0, first, Time(11))
                .unwrap_err()
                .code,
            ErrorCode::FRAME_INVALID
        );
        assert_eq!(
            p.handle_task_started(TargetId(0), 1, second, Time(11)),
            Ok(false)
        );
        assert_eq!(p, before);
        p.handle_task_result(TargetId(0), 0, first, digest(1), Time(35))
            .unwrap();
        drain(&mut p);
        // The second starts at 35, long after its submit: it has until 65.
        p.handle_task_started(TargetId(0), 0, second, Time(35))
            .unwrap();
        assert_eq!(p.poll_timeout(), Some(Time(65)));
        p.handle_timeout(Time(64));
        assert_eq!(drain(&mut p), vec![]);
        p.handle_timeout(Time(65));
        assert_eq!(drain(&mut p)[0], done(second, 0, 0, TaskEnd::Deadline));
    }

    #[test]
    fn a_task_its_lost_process_never_started_is_handed_over_once_drained() {
        let (mut p, h) = with_handle(2, 0);
        let running = p.submit(&h, TargetId(0)).unwrap();
        let elsewhere = p.submit(&h, TargetId(1)).unwrap();
        // Placed by the machine: on target 0, the lowest of equal loads.
        let queued = p.submit_any(&h, Some(20), Time(0)).unwrap();
        let pinned = p.submit(&h, TargetId(0)).unwrap();
        let cancelled = p.submit_any(&h, None, Time(0)).unwrap();
        assert_eq!(p.task(cancelled).map(|t| t.target), Some(TargetId(1)));
        let cancelled_pinned = p.submit(&h, TargetId(0)).unwrap();
        p.cancel(cancelled_pinned, Time(1)).unwrap();
        drain(&mut p);
        p.handle_task_started(TargetId(0), 0, running, Time(2))
            .unwrap();
        p.target_died(TargetId(0), "killed by signal 9", Time(3))
            .unwrap();
        let lost = TaskEnd::Lost {
            cause: "killed by signal 9".to_owned(),
        };
        assert_eq!(drain(&mut p), vec![done(running, 0, 0, lost.clone())]);
        // Until the IO layer read everything the process wrote, the others
        // are in doubt, counted on no target.
        let doubt = p.task(queued).unwrap();
        assert!(doubt.in_doubt && doubt.sent && !doubt.started);
        assert!(p.task(cancelled_pinned).unwrap().cancelling);
        assert_eq!(p.in_doubt_processes(TargetId(0)), vec![0]);
        assert_eq!(p.in_doubt_processes(TargetId(1)), Vec::<u32>::new());
        // A start report read now proves the task ran there: it is lost.
        let mut q = p.clone();
        assert_eq!(
            q.handle_task_started(TargetId(0), 0, queued, Time(4)),
            Ok(true)
        );
        assert_eq!(drain(&mut q), vec![done(queued, 0, 0, lost.clone())]);
        // None of them started: the placed one goes to target 1, exactly
        // once; one named for target 0 has no process of it to go to (no
        // replacements); one a cancel was asked for ends cancelled.
        p.process_drained(TargetId(0), 0, true);
        assert_eq!(
            drain(&mut p),
            vec![
                done(cancelled_pinned, 0, 0, TaskEnd::Cancelled),
                task_frame(queued, 1),
                done(pinned, 0, 0, lost.clone()),
            ]
        );
        let moved = p.task(queued).unwrap();
        assert_eq!(
            (moved.target, moved.sent, moved.in_doubt, moved.deadline),
            (TargetId(1), true, false, None)
        );
        assert_eq!(p.tasks_in_flight(), vec![elsewhere, queued, cancelled]);
        assert_eq!(p.in_doubt_processes(TargetId(0)), Vec::<u32>::new());
        // A second drain changes nothing.
        p.process_drained(TargetId(0), 0, true);
        assert_eq!(drain(&mut p), vec![]);
        // Read to no end: whatever was in doubt may have run, and is lost.
        let (mut p, h) = with_handle(1, 0);
        let queued = p.submit(&h, TargetId(0)).unwrap();
        drain(&mut p);
        p.target_died(TargetId(0), "it sent an invalid frame", Time(1))
            .unwrap();
        drain(&mut p);
        p.process_drained(TargetId(0), 0, false);
        assert_eq!(
            drain(&mut p),
            vec![done(
                queued,
                0,
                0,
                TaskEnd::Lost {
                    cause: "it sent an invalid frame".to_owned()
                }
            )]
        );
    }

    #[test]
    fn a_waiting_task_ends_lost_when_no_target_will_take_it_or_its_callable_goes() {
        let (mut p, h) = bounded(1, 1);
        let first = p.submit_any(&h, None, Time(0)).unwrap();
        let second = p.submit_any(&h, None, Time(0)).unwrap();
        drain(&mut p);
        // Replacements end while target 0 retires: it takes tasks again,
        // and the waiting task is sent to it at once.
        p.replacements_ended();
        assert_eq!(drain(&mut p), vec![task_frame(second, 0)]);
        assert_eq!(p.tasks_in_flight(), vec![first, second]);
        // Bounded again (a fresh parent): the callable is unregistered
        // while a task waits for the replacement.
        let (mut p, h) = bounded(1, 1);
        let first = p.submit_any(&h, None, Time(0)).unwrap();
        let second = p.submit_any(&h, None, Time(0)).unwrap();
        p.handle_task_result(TargetId(0), 0, first, digest(1), Time(1))
            .unwrap();
        drain(&mut p);
        p.unregister(&h, Time(2)).unwrap();
        let effects = drain(&mut p);
        assert!(
            effects.contains(&done(
                second,
                0,
                0,
                TaskEnd::Lost {
                    cause: UNREGISTERED_WHILE_WAITING.to_owned()
                }
            )),
            "{effects:?}"
        );
    }

    #[test]
    fn a_result_ends_its_task_once_and_only_from_its_target_and_incarnation() {
        let (mut p, h) = with_handle(2, 0);
        let seq = p.submit(&h, TargetId(1)).unwrap();
        assert_eq!(
            drain(&mut p),
            vec![Effect::Send {
                target: TargetId(1),
                frame: ControlFrame::Task {
                    seq,
                    digest: digest(1)
                }
            }]
        );
        // Another target, another incarnation: refused, nothing changes.
        let before = p.clone();
        assert_eq!(
            p.handle_task_result(TargetId(0), 0, seq, digest(1), Time(0)),
            Ok(false)
        );
        assert_eq!(
            p.handle_task_result(TargetId(1), 1, seq, digest(1), Time(0)),
            Ok(false)
        );
        assert_eq!(p, before);
        // Its target, naming another digest: out of protocol.
        let e = p
            .handle_task_result(TargetId(1), 0, seq, digest(2), Time(0))
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::FRAME_INVALID);
        assert_eq!(p, before);
        assert_eq!(
            p.handle_task_result(TargetId(1), 0, seq, digest(1), Time(0)),
            Ok(true)
        );
        assert_eq!(drain(&mut p), vec![done(seq, 1, 0, TaskEnd::Result)]);
        // A second result for it: refused.
        assert_eq!(
            p.handle_task_result(TargetId(1), 0, seq, digest(1), Time(0)),
            Ok(false)
        );
        assert_eq!(drain(&mut p), vec![]);
        assert!(p.tasks_in_flight().is_empty());
        // A seq never issued is out of protocol.
        let e = p
            .handle_task_result(TargetId(1), 0, Seq(99), digest(1), Time(0))
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::FRAME_INVALID);
    }

    #[test]
    fn a_cancel_answered_ok_ends_the_task_cancelled_and_a_refusal_lets_it_finish() {
        let (mut p, h) = with_handle(1, 0);
        let first = p.submit(&h, TargetId(0)).unwrap();
        let second = p.submit(&h, TargetId(0)).unwrap();
        drain(&mut p);
        p.cancel(first, Time(5)).unwrap();
        p.cancel(second, Time(5)).unwrap();
        // A second cancel while the first is unanswered sends nothing.
        p.cancel(second, Time(6)).unwrap();
        let cancel = |seq| Effect::Send {
            target: TargetId(0),
            frame: ControlFrame::Cancel {
                seq,
                digest: digest(1),
            },
        };
        assert_eq!(drain(&mut p), vec![cancel(first), cancel(second)]);
        assert_eq!(p.task(first).map(|t| t.cancelling), Some(true));
        let running = Failure::new(ErrorCode::TASK_RUNNING, "running");
        p.handle_reply(TargetId(0), answer(first, Err(running.clone())), Time(7))
            .unwrap();
        p.handle_reply(TargetId(0), answer(second, Ok(())), Time(7))
            .unwrap();
        assert_eq!(
            drain(&mut p),
            vec![
                Effect::CancelRefused {
                    seq: first,
                    failure: running
                },
                done(second, 0, 0, TaskEnd::Cancelled)
            ]
        );
        assert_eq!(p.tasks_in_flight(), vec![first]);
        // Nothing became uncertain: answers to cancels are not registers'.
        assert!(!p.is_uncertain(digest(1)));
        assert_eq!(
            p.handle_task_result(TargetId(0), 0, first, digest(1), Time(0)),
            Ok(true)
        );
        assert_eq!(drain(&mut p), vec![done(first, 0, 0, TaskEnd::Result)]);
        assert_eq!(
            p.cancel(first, Time(8)).unwrap_err().code,
            ErrorCode::TASK_RUNNING
        );
        assert!(p.tasks_in_flight().is_empty());
    }

    #[test]
    fn a_cancel_answer_after_the_result_changes_nothing() {
        let (mut p, h) = with_handle(1, 0);
        let seq = p.submit(&h, TargetId(0)).unwrap();
        p.cancel(seq, Time(1)).unwrap();
        drain(&mut p);
        assert_eq!(
            p.handle_task_result(TargetId(0), 0, seq, digest(1), Time(0)),
            Ok(true)
        );
        assert_eq!(drain(&mut p), vec![done(seq, 0, 0, TaskEnd::Result)]);
        let late = Failure::new(ErrorCode::TASK_RUNNING, "ended");
        let before_uncertain = p.uncertain_digests();
        p.handle_reply(TargetId(0), answer(seq, Err(late)), Time(2))
            .unwrap();
        assert_eq!(drain(&mut p), vec![]);
        assert_eq!(p.uncertain_digests(), before_uncertain);
        assert!(p.tasks_in_flight().is_empty() && !p.awaits_cancel(TargetId(0), seq));
    }

    #[test]
    fn a_deadline_ends_its_task_fences_its_target_and_hands_the_others_over() {
        let (mut p, h) = with_handle(2, 3);
        let late = p
            .submit_with_timeout(&h, TargetId(0), Some(50), Time(0))
            .unwrap();
        let other = p.submit(&h, TargetId(0)).unwrap();
        let elsewhere = p.submit(&h, TargetId(1)).unwrap();
        drain(&mut p);
        p.handle_task_started(TargetId(0), 0, late, Time(0))
            .unwrap();
        assert_eq!(p.poll_timeout(), Some(Time(50)));
        p.handle_timeout(Time(49));
        assert_eq!(drain(&mut p), vec![]);
        p.handle_timeout(Time(50));
        let cause = format!("{late} passed its deadline");
        // The task queued behind it never started: in doubt until the
        // fenced process's output is read, then handed over.
        assert_eq!(
            drain(&mut p),
            vec![
                done(late, 0, 0, TaskEnd::Deadline),
                Effect::Fence {
                    target: TargetId(0),
                    cause: cause.clone()
                },
                Effect::Spawn {
                    target: TargetId(0),
                    incarnation: 1
                },
            ]
        );
        // Named for target 0, it waits for target 0's replacement.
        p.process_drained(TargetId(0), 0, true);
        assert_eq!(drain(&mut p), vec![]);
        let waiting = p.task(other).unwrap();
        assert_eq!((waiting.target, waiting.sent), (TargetId(0), false));
        assert_eq!(p.tasks_in_flight(), vec![other, elsewhere]);
        let error = TaskEnd::Deadline
            .error(late, TargetId(0), 0, digest(1))
            .unwrap();
        assert_eq!(error.code, ErrorCode::TASK_DEADLINE);
    }

    #[test]
    fn a_loss_ends_every_task_of_the_target_naming_the_incarnation_and_close_ends_the_rest() {
        let (mut p, h) = with_handle(2, 0);
        let a = p.submit(&h, TargetId(0)).unwrap();
        let b = p.submit(&h, TargetId(1)).unwrap();
        p.handle_task_started(TargetId(0), 0, a, Time(0)).unwrap();
        p.cancel(a, Time(1)).unwrap();
        drain(&mut p);
        p.target_died(TargetId(0), "killed by signal 9", Time(2))
            .unwrap();
        let lost = TaskEnd::Lost {
            cause: "killed by signal 9".into(),
        };
        assert_eq!(drain(&mut p), vec![done(a, 0, 0, lost.clone())]);
        assert!(!p.awaits_cancel(TargetId(0), a));
        let message = lost.error(a, TargetId(0), 0, digest(1)).unwrap().message;
        assert_eq!(
            message,
            "target 0 was lost (killed by signal 9) before the task's result arrived"
        );
        p.close().unwrap();
        assert_eq!(drain(&mut p), vec![done(b, 1, 0, TaskEnd::Closed)]);
        assert!(p.tasks_in_flight().is_empty());
    }

    #[test]
    fn a_silent_cancel_fences_with_fencing_on_and_an_alive_report_moves_it() {
        let (mut p, h) = with_handle(1, 0);
        let seq = p.submit(&h, TargetId(0)).unwrap();
        p.handle_task_started(TargetId(0), 0, seq, Time(5)).unwrap();
        p.cancel(seq, Time(10)).unwrap();
        drain(&mut p);
        assert_eq!(p.poll_timeout(), Some(Time(110)));
        p.handle_alive(TargetId(0), seq, ControlPhase::Running, Time(60))
            .unwrap();
        assert_eq!(p.poll_timeout(), Some(Time(160)));
        p.handle_timeout(Time(160));
        let effects = drain(&mut p);
        assert_eq!(
            effects[0],
            Effect::Fence {
                target: TargetId(0),
                cause: format!("no answer to the cancel of {seq}")
            }
        );
        assert!(matches!(
            &effects[1],
            Effect::TaskDone { end: TaskEnd::Lost { cause }, .. } if cause == &format!("no answer to the cancel of {seq}")
        ));
    }

    #[test]
    fn one_timeout_fences_every_target_past_a_task_deadline_or_silent_on_a_cancel_once() {
        let (mut p, h) = with_handle(4, 0);
        let a = p
            .submit_with_timeout(&h, TargetId(0), Some(50), Time(0))
            .unwrap();
        let b = p
            .submit_with_timeout(&h, TargetId(1), Some(60), Time(0))
            .unwrap();
        let heard = p.submit(&h, TargetId(2)).unwrap();
        let silent = p.submit(&h, TargetId(3)).unwrap();
        for (t, seq) in [(0, a), (1, b), (3, silent)] {
            p.handle_task_started(TargetId(t), 0, seq, Time(0)).unwrap();
        }
        p.cancel(silent, Time(0)).unwrap();
        p.cancel(heard, Time(150)).unwrap();
        drain(&mut p);
        assert!(p.awaits_cancel(TargetId(2), heard) && p.awaits_cancel(TargetId(3), silent));
        // Past both deadlines and the silent cancel's (100); the other
        // cancel's target was heard from at 150 (silent at 250).
        p.handle_timeout(Time(200));
        let fence = |t, cause: String| Effect::Fence {
            target: TargetId(t),
            cause,
        };
        assert_eq!(
            drain(&mut p),
            vec![
                done(a, 0, 0, TaskEnd::Deadline),
                done(b, 1, 0, TaskEnd::Deadline),
                fence(0, format!("{a} passed its deadline")),
                fence(1, format!("{b} passed its deadline")),
                fence(3, format!("no answer to the cancel of {silent}")),
                done(
                    silent,
                    3,
                    0,
                    TaskEnd::Lost {
                        cause: format!("no answer to the cancel of {silent}")
                    }
                ),
            ]
        );
        assert_eq!(p.tasks_in_flight(), vec![heard]);
        assert!(p.awaits_cancel(TargetId(2), heard) && !p.awaits_cancel(TargetId(3), silent));
        assert_eq!(p.poll_timeout(), Some(Time(250)));
    }

    #[test]
    fn a_task_sent_to_an_earlier_incarnation_is_not_ended_by_the_replacement() {
        let (mut p, h) = with_handle(1, 3);
        let seq = p.submit(&h, TargetId(0)).unwrap();
        drain(&mut p);
        p.target_died(TargetId(0), "gone", Time(1)).unwrap();
        drain(&mut p);
        // The replacement (incarnation 1) may not end a task of 0: it ended.
        assert_eq!(
            p.handle_task_result(TargetId(0), 1, seq, digest(1), Time(0)),
            Ok(false)
        );
        assert_eq!(p.incarnation(TargetId(0)), 1);
    }
}
