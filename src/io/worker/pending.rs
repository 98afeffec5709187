//! What callers hold and get back:
//!
//! * the results they wait on, [`PendingOperation`] and [`PendingTask`]
//!   (both over `Awaited`, which leads or follows while it waits);
//! * the errors and reports, [`OperationError`], [`TaskError`],
//!   [`StartReport`], [`TargetTable`], with their texts.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::leader::Shared;
use super::lifecycle_error;
#[cfg(doc)]
use super::Worker;
use crate::descriptor::Digest;
use crate::error::{Error, ErrorCode, OperationKind};
use crate::io::handoff::{self, Pending};
use crate::io::process::TrackedFd;
use crate::protocol::{Completion, FailedRegistration, TargetId, TargetOutcome};

/// A failed operation: the error (code, operation, target, namespace,
/// hashid, seq, message) and what every target in its scope did.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct OperationError {
    /// The error.
    pub error: Error,
    /// Every target in the operation's scope with its outcome, in target
    /// order; empty when the operation failed before reaching any target.
    pub outcomes: Vec<(TargetId, TargetOutcome)>,
}

impl OperationError {
    pub(super) fn new(error: Error) -> OperationError {
        OperationError {
            error,
            outcomes: Vec::new(),
        }
    }

    /// The error's code.
    pub fn code(&self) -> ErrorCode {
        self.error.code
    }
}

impl std::fmt::Display for OperationError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.error)?;
        for (i, (target, outcome)) in self.outcomes.iter().enumerate() {
            let sep = if i == 0 { "; outcomes: " } else { ", " };
            write!(f, "{sep}{target}: {}", outcome_text(outcome))?;
        }
        Ok(())
    }
}

impl std::error::Error for OperationError {}

/// One target's outcome as [`OperationError`]'s message shows it: `ok`,
/// `failed (CODE: message)`, `lost`, `timed out`, `fenced`, `rolled back`
/// or `cleanup unconfirmed (CODE: message)`.
pub fn outcome_text(outcome: &TargetOutcome) -> String {
    match outcome {
        TargetOutcome::Ok => "ok".to_owned(),
        TargetOutcome::Failed { failure } => format!("failed ({failure})"),
        TargetOutcome::Lost => "lost".to_owned(),
        TargetOutcome::TimedOut => "timed out".to_owned(),
        TargetOutcome::Fenced => "fenced".to_owned(),
        TargetOutcome::RolledBack => "rolled back".to_owned(),
        TargetOutcome::CleanupUnconfirmed { failure } => {
            format!("cleanup unconfirmed ({failure})")
        }
    }
}

/// A failed task: the error (code `TASK_FAILED` for a failure inside the
/// callable, else e.g. `TARGET_LOST`, `DIGEST_NOT_INSTALLED`) naming the
/// target, hashid and seq, and the runtime's kind of failure (a Python
/// exception type; empty when the failure is not the callable's).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, thiserror::Error)]
#[error("{error} [kind {kind:?}]")]
pub struct TaskError {
    /// The error.
    pub error: Error,
    /// The runtime's kind of failure, or empty.
    pub kind: String,
    /// The runtime's serialized form of the failure, or empty (see
    /// [`crate::runtime::RuntimeError::exception`]); the parent never
    /// decodes it.
    #[serde(skip)]
    pub exception: Box<[u8]>,
}

impl TaskError {
    /// A failure of the Worker, not of the task's code: `error` with no
    /// runtime kind or serialized exception.
    pub fn of(error: Error) -> TaskError {
        TaskError {
            error,
            kind: String::new(),
            exception: Box::default(),
        }
    }
}

/// What [`Worker::start`] did at each target, and the startup-snapshot
/// registrations that failed.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct StartReport {
    /// Every target with its outcome: `Ok` (live, ready: it installed
    /// every snapshot entry but those in `failed` that name it), `Failed`
    /// (it exited before it was ready; it was stopped), `Fenced` (not ready
    /// before the start's deadline; killed).
    pub outcomes: Vec<(TargetId, TargetOutcome)>,
    /// The pre-start registrations whose callable some target could not
    /// install (it failed to deserialize, or its version or dependency
    /// check refused it), in handle order, each with every such target's
    /// failure (code, and a message made of the Python exception type and
    /// text): their handles are no longer live, and the targets that did
    /// install the callable drop it (`specs/protocol.md`, §2.6).
    pub failed: Vec<FailedRegistration>,
}

impl StartReport {
    /// Whether every target is live and every pre-start registration
    /// stayed live.
    pub fn is_complete(&self) -> bool {
        self.failed.is_empty() && self.outcomes.iter().all(|(_, o)| *o == TargetOutcome::Ok)
    }
}

/// One line for a failed startup-snapshot registration: `registration of
/// sha256:… (handle 3) failed: target 0: DESERIALIZE_FAILED: TypeError: …`.
pub fn registration_failure_text(registration: &FailedRegistration) -> String {
    let reasons: Vec<String> = registration
        .failures
        .iter()
        .map(|(target, failure)| format!("{target}: {failure}"))
        .collect();
    format!(
        "registration of {} (handle {}) failed: {}",
        registration.handle.hashid,
        registration.handle.handle_id,
        reasons.join("; ")
    )
}

/// One target's reported table ([`Worker::inspect`]): never a slot.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct TargetTable {
    /// Installed digests with their refcounts, in digest order.
    pub installed: Vec<(Digest, u32)>,
    /// Slots tombstoned but still pinned by a run.
    pub tombstones: u32,
    /// The incarnation of the process that reported it (0: forked at
    /// start; `specs/protocol.md` §2.9).
    pub incarnation: u32,
}

/// A result on its way from the targets to one caller: the completion
/// hand-off, and the Worker whose replies the caller reads itself while it
/// waits, when no other thread does ([`crate::io::lead`]).
pub(super) struct Awaited<T> {
    pub(super) pending: Option<Pending<T>>,
    /// The Worker, when the result may come from its targets.
    pub(super) shared: Option<Arc<Shared>>,
    /// Whether the request may have left something for the IO thread to
    /// watch that this caller has not yet settled (it meant to wait next);
    /// settled by waiting (leading settles), else by waking the IO
    /// thread through `wake` (without the state lock: this may be dropped
    /// where the lock is held).
    pub(super) owed: AtomicBool,
    pub(super) wake: Option<Arc<TrackedFd>>,
}

impl<T> Awaited<T> {
    /// The result of a request just pushed to the Worker of `shared`;
    /// `wake`, when the push left one owed, wakes its IO thread unless
    /// this caller settles by waiting.
    pub(super) fn of(
        pending: Pending<T>,
        shared: Arc<Shared>,
        wake: Option<Arc<TrackedFd>>,
    ) -> Awaited<T> {
        Awaited {
            pending: Some(pending),
            shared: Some(shared),
            owed: AtomicBool::new(wake.is_some()),
            wake,
        }
    }

    pub(super) fn done(pending: Pending<T>) -> Awaited<T> {
        Awaited {
            pending: Some(pending),
            shared: None,
            owed: AtomicBool::new(false),
            wake: None,
        }
    }

    fn take(&mut self) -> Pending<T> {
        self.pending
            .take()
            .unwrap_or_else(|| unreachable!("an awaited result is taken once"))
    }

    /// Waits until the result is there or `until` passes: as the leader
    /// when no one leads, else as a follower on the hand-off. `Err` when
    /// the time is up (the wait may be resumed).
    fn wait_until(
        mut self,
        until: Option<Instant>,
    ) -> Result<Result<T, handoff::Abandoned>, Awaited<T>> {
        if self.foreign() {
            return Ok(Err(handoff::Abandoned));
        }
        let pending = self.take();
        // Leading settles what the request left, in every case.
        self.owed.store(false, Ordering::Relaxed);
        let shared = self.shared.clone();
        let pending = match &shared {
            Some(shared) => match shared.lead(pending, until) {
                Ok(result) => return Ok(result),
                Err(pending) => pending,
            },
            None => pending,
        };
        let waited = match until {
            None => Ok(pending.wait()),
            Some(until) => pending.wait_timeout(until.saturating_duration_since(Instant::now())),
        };
        waited.map_err(|pending| Awaited {
            pending: Some(pending),
            shared,
            owed: AtomicBool::new(false),
            wake: None,
        })
    }

    pub(super) fn wait(self) -> Result<T, handoff::Abandoned> {
        match self.wait_until(None) {
            Ok(result) => result,
            Err(_) => unreachable!("a wait without a deadline ends with the result"),
        }
    }

    /// In a forked child of the Worker's process, the error a copy of this
    /// request answers with there ([`super::forked_child_error`]).
    fn forked_error(&self, operation: OperationKind) -> Option<Error> {
        self.shared
            .as_ref()
            .filter(|shared| shared.foreign())
            .map(|shared| super::forked_child_error(operation, shared.process))
    }

    /// Whether this is a copy in a forked child of the Worker's process
    /// ([`Shared::foreign`]): the result never comes there.
    fn foreign(&self) -> bool {
        self.shared.as_ref().is_some_and(|shared| shared.foreign())
    }

    /// Wakes the IO thread for what the request left, if this caller still
    /// owes it.
    fn settle(&self) {
        if self.foreign() {
            return;
        }
        if self.owed.swap(false, Ordering::Relaxed) {
            if let Some(wake) = &self.wake {
                // A full wake pipe already guarantees a wake-up.
                let _ = nix::unistd::write(&**wake, &[1]);
            }
        }
    }

    pub(super) fn on_complete<F>(mut self, callback: F)
    where
        F: FnOnce(Result<T, handoff::Abandoned>) + Send + 'static,
        T: Send + 'static,
    {
        if self.foreign() {
            callback(Err(handoff::Abandoned));
            return;
        }
        self.settle();
        self.take().on_complete(callback);
    }

    fn is_complete(&self) -> bool {
        if self.foreign() {
            return true;
        }
        self.settle();
        self.pending.as_ref().is_none_or(Pending::is_complete)
    }
}

impl<T> Drop for Awaited<T> {
    fn drop(&mut self) {
        if self.foreign() {
            // A copy in a forked child: its hand-off's lock may be held
            // forever, and the Worker's state must never be dropped here.
            std::mem::forget(self.pending.take());
            std::mem::forget(self.shared.take());
            return;
        }
        self.settle();
    }
}

/// A register or unregister in flight ([`Worker::register_async`]).
pub struct PendingOperation<T> {
    pub(super) awaited: Awaited<Result<T, OperationError>>,
}

impl<T> PendingOperation<T> {
    /// Waits for the operation to complete. While it waits, this thread
    /// may read the targets' replies itself, for every caller
    /// ([`crate::io::lead`]).
    ///
    /// # Errors
    /// The operation's [`OperationError`]; `LIFECYCLE_INVALID` if the
    /// Worker closed without completing it, or at once inside a
    /// completion callback ([`PendingTask::on_complete`]).
    pub fn wait(self) -> Result<T, OperationError> {
        if handoff::in_callback() {
            return Err(OperationError::new(callback_wait_error(
                OperationKind::Register,
            )));
        }
        if let Some(error) = self.awaited.forked_error(OperationKind::Register) {
            return Err(OperationError::new(error));
        }
        self.awaited.wait().unwrap_or_else(operation_abandoned)
    }

    /// Waits at most `timeout`: `Ok` with what [`PendingOperation::wait`]
    /// would return, or `Err(self)` when the time is up (e.g. to check for
    /// signals between slices, then wait again).
    pub fn wait_timeout(self, timeout: Duration) -> Result<Result<T, OperationError>, Self> {
        if handoff::in_callback() {
            return Ok(Err(OperationError::new(callback_wait_error(
                OperationKind::Register,
            ))));
        }
        if let Some(error) = self.awaited.forked_error(OperationKind::Register) {
            return Ok(Err(OperationError::new(error)));
        }
        match self.awaited.wait_until(Instant::now().checked_add(timeout)) {
            Ok(result) => Ok(result.unwrap_or_else(operation_abandoned)),
            Err(awaited) => Err(PendingOperation { awaited }),
        }
    }

    /// Whether [`PendingOperation::wait`] would return at once.
    pub fn is_complete(&self) -> bool {
        self.awaited.is_complete()
    }
}

/// The error of an operation the Worker closed without completing
/// (`LIFECYCLE_INVALID`).
fn operation_abandoned<T>(abandoned: handoff::Abandoned) -> Result<T, OperationError> {
    Err(OperationError::new(Error::new(
        ErrorCode::LIFECYCLE_INVALID,
        OperationKind::Close,
        abandoned.to_string(),
    )))
}

/// A task in flight ([`Worker::submit_async`]).
pub struct PendingTask {
    pub(super) awaited: Awaited<Result<Vec<u8>, TaskError>>,
    pub(super) key: TaskKey,
}

/// Names one task for [`Worker::cancel`]: unique in the process, never
/// reused, valid after its [`PendingTask`] is waited for or dropped (a
/// cancel of an ended task answers `false`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct TaskKey(pub(super) u64);

impl TaskKey {
    /// A key no task of this process had.
    pub(super) fn fresh() -> TaskKey {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        TaskKey(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl PendingTask {
    /// The key to cancel this task by ([`Worker::cancel`]).
    pub fn key(&self) -> TaskKey {
        self.key
    }

    /// Waits for the task's result (encoded as its input was). While it
    /// waits, this thread may read the targets' replies itself, for every
    /// caller ([`crate::io::lead`]).
    ///
    /// # Errors
    /// The task's [`TaskError`]; `LIFECYCLE_INVALID` if the Worker closed
    /// without an answer, or at once inside a completion callback
    /// ([`PendingTask::on_complete`]).
    pub fn wait(self) -> Result<Vec<u8>, TaskError> {
        if handoff::in_callback() {
            return Err(callback_task_error());
        }
        if let Some(error) = self.awaited.forked_error(OperationKind::Task) {
            return Err(TaskError::of(error));
        }
        self.awaited.wait().unwrap_or_else(task_abandoned)
    }

    /// Waits at most `timeout`: `Ok` with what [`PendingTask::wait`] would
    /// return, or `Err(self)` when the time is up (e.g. to check for
    /// signals between slices, then wait again).
    pub fn wait_timeout(
        self,
        timeout: Duration,
    ) -> Result<Result<Vec<u8>, TaskError>, PendingTask> {
        if handoff::in_callback() {
            return Ok(Err(callback_task_error()));
        }
        if let Some(error) = self.awaited.forked_error(OperationKind::Task) {
            return Ok(Err(TaskError::of(error)));
        }
        match self.awaited.wait_until(Instant::now().checked_add(timeout)) {
            Ok(result) => Ok(result.unwrap_or_else(task_abandoned)),
            Err(awaited) => Err(PendingTask {
                awaited,
                key: self.key,
            }),
        }
    }

    /// Hands the result to `callback` instead of waiting: it runs exactly
    /// once, in the thread that reads the result (the Worker's IO thread,
    /// or another caller's thread that waits on this Worker), or at once in
    /// this thread when the task is already complete; never with the
    /// Worker's state lock held. It must not block: hand the result on (e.g. push
    /// it into a channel) and return; above all it must not wait for
    /// anything the Worker's progress depends on (an interpreter lock held
    /// by a thread that waits on this Worker). It may start operations
    /// ([`Worker::submit_then`], the `_async` calls) and read the Worker's
    /// state; a wait inside it ([`PendingTask::wait`], the synchronous
    /// calls, [`Worker::inspect`]) fails at once with `LIFECYCLE_INVALID`
    /// (it would wait on the thread running it), and [`Worker::close`]
    /// inside it only asks for the close, carried out once it returns. A callback that
    /// panics in another thread is contained there (the panic hook reports
    /// it, and that thread, the IO thread or a waiting caller, goes on);
    /// one that runs here at once unwinds this call.
    pub fn on_complete<F>(self, callback: F)
    where
        F: FnOnce(Result<Vec<u8>, TaskError>) + Send + 'static,
    {
        if let Some(error) = self.awaited.forked_error(OperationKind::Task) {
            callback(Err(TaskError::of(error)));
            return;
        }
        self.awaited
            .on_complete(move |result| callback(result.unwrap_or_else(task_abandoned)));
    }

    /// Whether [`PendingTask::wait`] would return at once.
    pub fn is_complete(&self) -> bool {
        self.awaited.is_complete()
    }
}

/// The error of a wait inside a completion callback (`LIFECYCLE_INVALID`):
/// the callback runs on the thread that reads the replies, which would
/// wait on itself.
pub(super) fn callback_wait_error(operation: OperationKind) -> Error {
    lifecycle_error(
        operation,
        "a completion callback must not wait on the Worker (it runs on the thread that reads the replies, which would wait on itself)",
    )
}

fn callback_task_error() -> TaskError {
    TaskError::of(callback_wait_error(OperationKind::Task))
}

/// The error of a task whose completer was dropped unanswered.
pub(super) fn task_abandoned(abandoned: handoff::Abandoned) -> Result<Vec<u8>, TaskError> {
    Err(TaskError::of(Error::new(
        ErrorCode::LIFECYCLE_INVALID,
        OperationKind::Task,
        abandoned.to_string(),
    )))
}

pub(super) fn completed<T>(value: Result<T, OperationError>) -> PendingOperation<T> {
    let (done, pending) = handoff::channel();
    done.complete(value);
    PendingOperation {
        awaited: Awaited::done(pending),
    }
}

/// The error of a failed operation; its message says why each lost or
/// fenced target in its scope was given up and how it ended (as a task's
/// `TARGET_LOST` does), e.g. `target 1: lost (its reply socket closed; it was
/// killed by signal 9)`.
pub(super) fn operation_error(
    result: Result<Completion, Error>,
    outcomes: Vec<(TargetId, TargetOutcome)>,
    losses: &BTreeMap<TargetId, String>,
) -> OperationError {
    let mut error = match result {
        Err(error) => error,
        Ok(completion) => Error::new(
            ErrorCode::FRAME_INVALID,
            OperationKind::Reply,
            format!("the operation completed as {completion:?}, which does not match its kind"),
        ),
    };
    // The machine's message names a lost target `target N: lost` (a
    // fenced one `target N: fenced after its deadline`): say why there, or
    // at the end when the message does not name it.
    let mut appended = Vec::new();
    for (target, outcome) in &outcomes {
        let needle = match outcome {
            TargetOutcome::Lost => format!("{target}: lost"),
            TargetOutcome::Fenced => format!("{target}: fenced after its deadline"),
            _ => continue,
        };
        let Some(reason) = losses.get(target) else {
            continue;
        };
        // A poisoning names its target's death itself.
        if error.code == ErrorCode::REGISTER_POISONED && error.target == Some(*target) {
            continue;
        }
        let ends = |at: usize| {
            let rest = &error.message[at + needle.len()..];
            rest.is_empty() || rest.starts_with(';') || rest.starts_with(',')
        };
        match error
            .message
            .match_indices(&needle)
            .map(|(at, _)| at)
            .find(|at| ends(*at))
        {
            Some(at) => error
                .message
                .insert_str(at + needle.len(), &format!(" ({reason})")),
            None => appended.push(format!("{needle} ({reason})")),
        }
    }
    if !appended.is_empty() {
        error.message = format!("{}; {}", error.message, appended.join("; "));
    }
    OperationError { error, outcomes }
}
