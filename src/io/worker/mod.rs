//! The [`Worker`]: the protocol's [`Parent`] machine run over real forked
//! targets, sealed `memfd` staging (`specs/staging.md`), control sockets
//! and reply sockets (specs/design.md §4.1, §5).
//!
//! # Threads
//!
//! Every thread's part in each event, with its locks and wake-ups: `specs/threads.md`.
//!
//! * Caller threads (any number): validate an envelope and stage it (copy
//!   and hash in one pass). Before start, registrations go straight to the
//!   machine's registry and the startup snapshot (with their callable
//!   metadata, which only the targets act on). After start, a caller takes
//!   the state lock, gives its request to the machine and carries out the
//!   effects itself (its frames go out from its own thread), then waits for
//!   its result: as the **leader** when no other caller leads, reading the
//!   reply sockets of every live target and handling the deadlines, for
//!   every caller, until its own result is there; else as a **follower**,
//!   asleep on its completion hand-off ([`super::handoff`]) until whoever
//!   reads its reply hands the result over ([`super::lead`]). A round trip
//!   with one caller so wakes no thread but the caller and the target.
//! * One IO thread per started Worker: it watches what no caller waits
//!   for — every target's pidfd, control sockets with unsent bytes, the
//!   deadlines, the reply sockets when a reply is expected and no leader
//!   reads them (a task whose caller does not wait, a callback, a follower
//!   after its leader stepped down) — links replacements, frees payloads
//!   off the callers' path, and carries out a close.
//! * With replacement targets on (the default, `specs/protocol.md` §2.9),
//!   one template process ([`super::zygote`]), forked at start right after
//!   the targets and before the IO thread: the parent never forks once it
//!   runs threads, so every replacement is forked by the template, on the
//!   IO thread's request. With [`StartMethod::Forkserver`] the template is
//!   a fresh process (`exec`), made first, and forks the targets of the
//!   start too.
//!
//! Whichever thread drives the machine holds the state lock, which guards
//! the machine and the IO state (links, staged payloads, waiters) alike:
//! the machine has one driver at a time, in lock order, so requests reach
//! each target in the order they took the lock (FIFO per target). Every
//! input to the machine is followed by draining its effects (`poll_effect`
//! until `None`), each carried out in order, before the next input (the
//! same rule as `str0m`). A thread releasing the lock first checks whether
//! what it leaves needs the IO thread (an expected reply nobody reads,
//! unsent bytes, an earlier deadline, a payload to free) and writes its
//! wake pipe if so; results it decided are handed to their callers after
//! the lock is released (a caller woken under the lock would block on it
//! at once), then the leader is woken if one of them may be its own.
//!
//! # The IO thread's run rule
//!
//! 1. Link the replacements the template forked; give the machine the
//!    requests left in the queue ([`Worker::submit_then`]), draining
//!    effects after each; carry out a close.
//! 2. Read the clock; if the machine's `poll_timeout` has passed, call
//!    `handle_timeout(now)`; drain effects (a replacement not ready in
//!    time is one the machine fences). Inspections past their deadline are
//!    given up.
//! 3. Build the poll set: the wake pipe, every live target's pidfd, its
//!    reply socket when a reply is expected and no leader reads it, and the
//!    control socket of every target with unsent bytes; the poll timeout
//!    is the earliest deadline (none: block). Record it ([`super::lead`]).
//! 4. Release the state lock, hand the results decided since the last
//!    `poll` to their waiting callers, and `poll`.
//! 5. Take the state lock. For each target whose reply socket is readable,
//!    read what is there, decode whole frames, and give each reply to the
//!    machine (`handle_reply`), draining effects after each; task results
//!    and tables go to their waiting callers. EOF, a hang-up, an
//!    undecodable or out-of-protocol frame: kill and reap the target, then
//!    `target_lost`; drain effects. A readable pidfd (the target process
//!    ended, even if a process it forked still holds its pipes): read what
//!    its reply socket holds, then the same.
//! 6. Flush pending control bytes to writable targets (a full socket never
//!    blocks anyone; a register's sealed payload descriptor goes with
//!    its frame's first byte), then go to 1.
//!
//! A leader does steps 2 and 5 for the reply sockets it reads, with its own
//! `poll` over them and the leader wake pipe (written when another thread
//! decided a result while it leads, and at close).
//!
//! Effects map to IO as follows: `Stage` binds the payload the caller
//! staged (then passes `parent.after_stage`; a failure there is reported
//! with `stage_failed`), and, with replacements on, keeps it by digest for
//! as long as `Parent::keeps_envelope` says (a startup-snapshot envelope is
//! kept as bytes, staged at its first replay); `Restage` binds that kept
//! payload again; `Spawn` asks the template for a new process and links it
//! (`target_died` if it cannot), whose ready report becomes
//! `target_spawned` (one that is not ready within the control timeout is
//! lost); `Joined`, `JoinFailed` and `Abandoned` are recorded as
//! [`TargetEvent`]s; `Send` encodes a wire frame into the target's
//! outbox (a register's carries its metadata as JSON, and its staged
//! payload, one for every target, waits beside it until the frame's first
//! byte is sent with its descriptor); `ReleaseStaged` closes the parent's
//! descriptor of the payload; `Fence` kills and reaps the target; `Completed`
//! hands the result to the waiting caller (a published handle passes
//! `parent.before_publish` first).

use std::collections::{BTreeMap, VecDeque};

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::handoff::{self, Completer, Pending};
use super::process::{Exit, ThreadPolicy, TrackedFd};
use super::staging::StagedPayload;
use crate::descriptor::Digest;
use crate::error::{Error, ErrorCode, OperationKind};
use crate::metadata::CallableMetadata;
use crate::protocol::{Handle, Lifecycle, Parent, ParentConfig, TargetId, TargetPhase, Time};
use crate::runtime::{Runtime, TaskEncoding};
use crate::wire::HEADER_BYTES;
use io_loop::IoLoop;
use leader::{io_wake, Shared};
use pending::{callback_wait_error, task_abandoned, Awaited};
use respawn::Kept;

mod builder;
mod io_loop;
mod leader;
mod pending;
mod register;
mod respawn;
mod start;

pub use builder::{
    StartMethod, WorkerBuilder, DEFAULT_CONTROL_TIMEOUT, MAX_TIMEOUT, OPERATION_TIMEOUT_FACTOR,
};
pub use pending::{
    outcome_text, registration_failure_text, OperationError, PendingOperation, PendingTask,
    StartReport, TargetTable, TaskError, TaskKey,
};
pub use register::STAGING_OUT_OF_MEMORY;
pub use respawn::{TargetEvent, TARGET_EVENTS_KEPT};

/// A parent worker with its forked targets (specs/design.md §4.1).
///
/// `Send + Sync`: share it (e.g. in an `Arc`) and call it from many threads
/// at once; several operations may be in flight. Closing is idempotent and
/// also happens on drop: targets are stopped and reaped, and every staged
/// payload is unlinked.
///
/// # Forked children
///
/// A Worker belongs to the process that built it. In a child forked from
/// that process (a copy of its memory without its threads) every operation
/// fails with `LIFECYCLE_INVALID` ("this Worker belongs to process N …",
/// [`forked_child_error`]), a pending task or operation copied there
/// completes at once with that error, the getters answer as for a closed Worker, and `close` and
/// drop do nothing there: the owner's targets, threads and state are
/// never touched (nor freed) by the child. The Worker tells such a child
/// by a page of its own that the kernel zeroes in every child forked from
/// its process (`MADV_WIPEONFORK`, Linux 4.14), so the check on every call
/// makes no system call; where the kernel refuses that advice it compares
/// process ids instead.
pub struct Worker<R: Runtime> {
    runtime: Arc<R>,
    targets: u16,
    control_timeout: Duration,
    slot_capacity: u16,
    max_frame_bytes: usize,
    /// The spin budget of each target's task thread (the same as the
    /// leader's).
    spin: Duration,
    thread_policy: ThreadPolicy,
    start_method: StartMethod,
    respawn: bool,
    clock: Instant,
    /// The parent machine's configuration (a closed machine of it is the
    /// state a forked child sees).
    config: ParentConfig,
    shared: Arc<Shared>,
    io_thread: Mutex<Option<JoinHandle<()>>>,
    /// The forking thread ([`Worker::forker_run`]) and what ends it.
    forker: Mutex<Option<(std::sync::mpsc::Sender<()>, JoinHandle<()>)>>,
}

// A Worker is shared between threads: fail the build if a field breaks it.
const _: () = {
    fn send_sync<T: Send + Sync>() {}
    #[allow(dead_code)]
    fn worker_is_send_and_sync<R: Runtime>() {
        send_sync::<Worker<R>>();
        send_sync::<PendingOperation<Handle>>();
        send_sync::<PendingTask>();
    }
};

fn now_since(clock: Instant) -> Time {
    Time(u64::try_from(clock.elapsed().as_micros()).unwrap_or(u64::MAX))
}

fn lifecycle_error(operation: OperationKind, message: &str) -> Error {
    Error::new(ErrorCode::LIFECYCLE_INVALID, operation, message)
}

/// The identity the parent machine holds a callable's metadata by
/// (`specs/protocol.md` §2.10).
fn metadata_identity(metadata: &CallableMetadata) -> Digest {
    metadata.identity()
}

/// The `LIFECYCLE_INVALID` of a Worker of process `owner` used in a child
/// forked from it ([`Worker`], "Forked children"): `"this Worker belongs
/// to process 120; process 131 is a child forked from it and cannot use
/// it (build a new Worker there)"`. Also what a binding answers for a
/// copy of a task in flight that it cannot wait on there.
pub fn forked_child_error(operation: OperationKind, owner: u32) -> Error {
    lifecycle_error(
        operation,
        &format!(
            "this Worker belongs to process {owner}; process {} is a child forked from it and cannot use it (build a new Worker there)",
            std::process::id()
        ),
    )
}

impl<R: Runtime> Worker<R> {
    /// A builder for a Worker over `runtime`.
    pub fn builder(runtime: Arc<R>) -> WorkerBuilder<R> {
        WorkerBuilder::new(runtime)
    }

    /// Runs a task on `target` and waits for its result. `input` is encoded
    /// as `encoding` says; the result comes back encoded the same way.
    ///
    /// # Errors
    /// Handle resolution errors; `LIFECYCLE_INVALID` unless started;
    /// `TARGET_LOST` (lost before or during the task); `NO_LIVE_TARGET`
    /// for an unknown target; `DIGEST_NOT_INSTALLED`; `FRAME_INVALID` for
    /// an input too large for one frame; `TASK_FAILED` with the runtime's
    /// kind and message.
    pub fn submit(
        &self,
        handle: &Handle,
        target: TargetId,
        encoding: TaskEncoding,
        input: &[u8],
    ) -> Result<Vec<u8>, TaskError> {
        self.submit_async(handle, target, encoding, input).wait()
    }

    /// Starts a task whose result goes to `callback`, for a caller that
    /// does not wait for it: the request is left to the Worker's IO
    /// thread, which carries out every request queued meanwhile in one
    /// turn (many tasks in flight cost the caller one queue push each, and
    /// no contention with the thread reading their results). The callback
    /// runs as [`PendingTask::on_complete`]'s does (it must not block nor
    /// wait on the Worker), always in the thread that completes the task;
    /// requests reach the targets in the order they were
    /// made, whichever way each was made. Errors as [`Worker::submit`],
    /// given to the callback.
    pub fn submit_then<F>(
        &self,
        handle: &Handle,
        target: TargetId,
        encoding: TaskEncoding,
        input: &[u8],
        callback: F,
    ) where
        F: FnOnce(Result<Vec<u8>, TaskError>) + Send + 'static,
    {
        if let Err(error) = self.owned(OperationKind::Task) {
            callback(Err(TaskError::of(error)));
            return;
        }
        let (done, pending) = handoff::channel();
        // Given to the hand-off first: it runs in the thread that
        // completes the task, never in this one later.
        pending.on_complete(move |result| callback(result.unwrap_or_else(task_abandoned)));
        if let Err(error) = self.task_frame_fits(handle, Some(target), input) {
            done.complete(Err(error));
        } else {
            let request = Request::Task {
                handle: *handle,
                target: Some(target),
                encoding,
                input: input.to_vec(),
                key: TaskKey::fresh().0,
                deadline: None,
                done,
            };
            let mut core = self.shared.lock();
            if core.io_running && !core.closing {
                core.requests.push_back(request);
                io_wake(&core);
            } else {
                let started = core.machine.lifecycle() == Lifecycle::New;
                drop(core);
                refuse(request, started);
            }
        }
    }

    /// Starts a task of `handle` on the target the Worker's machine picks
    /// (`specs/protocol.md` §2.14: of the targets that take tasks, the one
    /// with the fewest in flight; with none, the task waits for a target
    /// being replaced or retiring, and is sent when a process of it
    /// joins), and returns at once with a pending task. Its errors are
    /// those of [`Worker::submit_async_with_deadline`], and
    /// `NO_LIVE_TARGET` when no target takes tasks or will.
    pub fn submit_any_async(
        &self,
        handle: &Handle,
        encoding: TaskEncoding,
        input: &[u8],
        deadline: Option<Duration>,
    ) -> PendingTask {
        self.submit_request(handle, None, encoding, input, deadline)
    }

    /// Starts a task and returns at once with a pending task.
    pub fn submit_async(
        &self,
        handle: &Handle,
        target: TargetId,
        encoding: TaskEncoding,
        input: &[u8],
    ) -> PendingTask {
        self.submit_async_with_deadline(handle, target, encoding, input, None)
    }

    /// [`Worker::submit_async`] with a deadline (`specs/protocol.md`
    /// §2.12): if the task has not ended `deadline` after its target
    /// reported it started (time queued behind other tasks does not
    /// count), it ends with `TASK_DEADLINE` and its target is killed (and
    /// replaced, with replacements on). The tasks queued behind it there
    /// never started: they go to another target (§2.15). `None`: no
    /// deadline. The deadline
    /// is handled by whichever thread drives the Worker (the IO thread
    /// when no caller waits), so it passes within a few milliseconds of
    /// its time, then the kill and reap take their own time.
    pub fn submit_async_with_deadline(
        &self,
        handle: &Handle,
        target: TargetId,
        encoding: TaskEncoding,
        input: &[u8],
        deadline: Option<Duration>,
    ) -> PendingTask {
        self.submit_request(handle, Some(target), encoding, input, deadline)
    }

    /// A task to `target`, or (`None`) to the target the machine picks.
    fn submit_request(
        &self,
        handle: &Handle,
        target: Option<TargetId>,
        encoding: TaskEncoding,
        input: &[u8],
        deadline: Option<Duration>,
    ) -> PendingTask {
        let key = TaskKey::fresh();
        let (done, pending) = handoff::channel();
        if let Err(error) = self.owned(OperationKind::Task) {
            done.complete(Err(TaskError::of(error)));
            return PendingTask {
                awaited: Awaited::done(pending),
                key,
            };
        }
        if let Err(error) = self.task_frame_fits(handle, target, input) {
            done.complete(Err(error));
            return PendingTask {
                awaited: Awaited::done(pending),
                key,
            };
        }
        let owed = self.push(
            Request::Task {
                handle: *handle,
                target,
                encoding,
                input: input.to_vec(),
                key: key.0,
                deadline,
                done,
            },
            false,
        );
        PendingTask {
            awaited: self.awaited(pending, owed),
            key,
        }
    }

    /// Cancels the task `key` names ([`PendingTask::key`]) if it has not
    /// started in its target (`specs/protocol.md` §2.11), and waits for
    /// the target's answer (a round trip; with fencing on, at most about a
    /// control timeout for a target that stops answering, which is then
    /// fenced): `Ok(true)` when it will never run (its result is then
    /// `TASK_CANCELLED`); `Ok(false)` when it had started (it runs to its
    /// end and its result comes as usual), already ended, or was refused
    /// at submit.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` from another process than the Worker's, and at
    /// once inside a completion callback (it would wait on the thread that
    /// must read the answer).
    pub fn cancel(&self, key: TaskKey) -> Result<bool, Error> {
        self.owned(OperationKind::Task)?;
        if handoff::in_callback() {
            return Err(callback_wait_error(OperationKind::Task));
        }
        let (done, pending) = handoff::channel();
        let owed = self.push(Request::Cancel { key: key.0, done }, false);
        Ok(self.awaited(pending, owed).wait().unwrap_or(false))
    }

    /// `FRAME_INVALID` for a task input too large for one frame.
    fn task_frame_fits(
        &self,
        handle: &Handle,
        target: Option<TargetId>,
        input: &[u8],
    ) -> Result<(), TaskError> {
        // Task frame: header, seq, digest, encoding, input length, input.
        let size = HEADER_BYTES + 8 + 32 + 1 + 4 + input.len();
        if size <= self.max_frame_bytes {
            return Ok(());
        }
        let error = Error::new(
            ErrorCode::FRAME_INVALID,
            OperationKind::Task,
            format!(
                "a task input of {} bytes makes a frame of {size} bytes, over the maximum of {} (max_frame_bytes)",
                input.len(),
                self.max_frame_bytes
            ),
        )
        .with_digest(handle.digest());
        Err(TaskError::of(match target {
            Some(target) => error.with_target(target),
            None => error,
        }))
    }

    /// The waiting side of a request given to [`Worker::push`].
    fn awaited<T>(&self, pending: Pending<T>, wake: Option<Arc<TrackedFd>>) -> Awaited<T> {
        Awaited::of(pending, self.shared.clone(), wake)
    }

    /// Runs the task on every live target (those live when it is
    /// submitted) and waits for every result, in target order.
    pub fn submit_to_every(
        &self,
        handle: &Handle,
        encoding: TaskEncoding,
        input: &[u8],
    ) -> Vec<(TargetId, Result<Vec<u8>, TaskError>)> {
        let pending: Vec<_> = self
            .live_targets()
            .into_iter()
            .map(|t| (t, self.submit_async(handle, t, encoding, input)))
            .collect();
        pending.into_iter().map(|(t, p)| (t, p.wait())).collect()
    }

    /// The targets that serve (started, not lost, and, for a replacement,
    /// joined: `specs/protocol.md` §2.9), in order; empty before start and
    /// after close.
    pub fn live_targets(&self) -> Vec<TargetId> {
        if self.shared.foreign() {
            return Vec::new();
        }
        let core = self.shared.lock();
        (0..self.targets)
            .map(TargetId)
            .filter(|t| core.machine.is_target_joined(*t))
            .collect()
    }

    /// The incarnation of `target`'s current (or next) process: 0 for the
    /// one forked at start, one more for each replacement
    /// (`specs/protocol.md` §2.9).
    pub fn target_incarnation(&self, target: TargetId) -> u32 {
        if self.shared.foreign() {
            return 0;
        }
        self.shared.lock().machine.incarnation(target)
    }

    /// [`Worker::target_phase`] and [`Worker::target_incarnation`] read
    /// together, under one lock: the phase is that incarnation's (two
    /// separate calls can pair a lost process's phase with its
    /// replacement's incarnation).
    pub fn target_state(&self, target: TargetId) -> (TargetPhase, u32) {
        if self.shared.foreign() {
            return (TargetPhase::Lost, 0);
        }
        let core = self.shared.lock();
        let phase = match core.machine.lifecycle() {
            Lifecycle::Closed => TargetPhase::Lost,
            _ => core.machine.target_phase(target),
        };
        (phase, core.machine.incarnation(target))
    }

    /// Where `target` stands: serving (`Joined`), being replaced
    /// (`BackingOff`, `Spawning`, `Joining`) or `Lost` for good (every
    /// target, once closed).
    pub fn target_phase(&self, target: TargetId) -> TargetPhase {
        if self.shared.foreign() {
            return TargetPhase::Lost;
        }
        let core = self.shared.lock();
        match core.machine.lifecycle() {
            Lifecycle::Closed => TargetPhase::Lost,
            _ => core.machine.target_phase(target),
        }
    }

    /// What happened to targets since start, oldest first (the last
    /// [`TARGET_EVENTS_KEPT`]): with replacements on, every loss, and every
    /// replacement started, joined or failed, and targets given up.
    pub fn target_events(&self) -> Vec<TargetEvent> {
        if self.shared.foreign() {
            return Vec::new();
        }
        self.shared.lock().events.iter().cloned().collect()
    }

    /// The process id of `target`'s latest process (for supervision and
    /// tests), if started; it may have ended since (see
    /// [`Worker::target_phase`]).
    pub fn target_pid(&self, target: TargetId) -> Option<i32> {
        if self.shared.foreign() {
            return None;
        }
        self.shared.lock().pids.get(usize::from(target.0)).copied()
    }

    /// How a lost target ended, once reaped.
    pub fn target_exit(&self, target: TargetId) -> Option<Exit> {
        if self.shared.foreign() {
            return None;
        }
        self.shared.lock().exits.get(&target).copied()
    }

    /// Why a target was given up after start (its pipe closed, it broke
    /// the protocol, it missed a deadline) and how it ended, e.g. `"its
    /// reply socket closed; it exited with status 9"`.
    pub fn target_loss(&self, target: TargetId) -> Option<String> {
        if self.shared.foreign() {
            return None;
        }
        self.shared.lock().losses.get(&target).cloned()
    }

    /// Bytes of envelopes this parent keeps: before start, the distinct
    /// pre-start envelopes with a live handle (what the targets inherit
    /// through `fork`); after start, with replacements on, the distinct
    /// envelopes that live registrations (or registers in flight) name,
    /// to replay them to replacements (a post-start one as its sealed
    /// staged payload); without replacements, none. Zero after close: the
    /// parent holds only what live registrations need.
    pub fn retained_envelope_bytes(&self) -> usize {
        if self.shared.foreign() {
            return 0;
        }
        let core = self.shared.lock();
        let before_start: usize = core.envelopes.values().map(|e| e.len()).sum();
        before_start + core.kept.values().map(Kept::len).sum::<usize>()
    }

    /// A copy of the parent machine's state (diagnostics and tests: the
    /// protocol's invariant predicates take it).
    pub fn parent_state(&self) -> Parent {
        if self.shared.foreign() {
            // A closed machine: what a forked child may use of it.
            let mut closed = Parent::new(self.config);
            let _ = closed.close();
            return closed;
        }
        self.shared.lock().machine.clone()
    }

    /// Clears the poison of the callable with `hashid` (`specs/protocol.md`
    /// §2.8): its next register probes it again on one target. Returns
    /// whether it was poisoned.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` in a forked child of the Worker's process
    /// ([`forked_child_error`]), which cannot use it.
    pub fn forgive(&self, hashid: crate::descriptor::HashId) -> Result<bool, Error> {
        self.owned(OperationKind::Register)?;
        Ok(self.shared.lock().machine.forgive(hashid.0))
    }

    /// `Ok` in the process that built the Worker.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` in any other (a forked child of it).
    fn owned(&self, operation: OperationKind) -> Result<(), Error> {
        if self.shared.foreign() {
            return Err(forked_child_error(operation, self.shared.process));
        }
        Ok(())
    }

    /// Asks every live target for its table and waits for the answers, in
    /// target order, for at most the control timeout: `None` for a target
    /// lost before it answered, or that did not answer in time (e.g. a
    /// stopped process; it is not fenced for it: an inspection changes
    /// nothing, and its table, if it comes later, is dropped).
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless started.
    pub fn inspect(&self) -> Result<Vec<(TargetId, Option<TargetTable>)>, Error> {
        if handoff::in_callback() {
            return Err(callback_wait_error(OperationKind::Resolve));
        }
        self.owned(OperationKind::Resolve)?;
        let (done, pending) = handoff::channel();
        self.push(Request::Inspect { done }, true);
        pending
            .wait()
            .map_err(|abandoned| lifecycle_error(OperationKind::Resolve, &abandoned.to_string()))
    }

    /// Writes raw bytes into `target`'s control pipe (fault-injection tests:
    /// malformed or oversized frames).
    #[cfg(feature = "failpoints")]
    pub fn inject_control_bytes(&self, target: TargetId, bytes: Vec<u8>) {
        if self.shared.foreign() {
            return;
        }
        self.push(Request::RawControl { target, bytes }, true);
    }

    /// Gives a request to the machine and carries out its effects, in this
    /// thread, under the state lock (a close is left to the IO thread);
    /// completes the request's waiter at once if no IO thread runs.
    ///
    /// `settle`: whether to wake the IO thread now for what the request
    /// leaves to watch ([`super::lead`]); `false` when this caller waits
    /// for the result next, as the leader, and settles when it stops
    /// leading. Returns the IO thread's wake pipe when settling is still
    /// owed.
    fn push(&self, request: Request, settle: bool) -> Option<Arc<TrackedFd>> {
        push(&self.shared, request, settle)
    }

    /// Closes the Worker: operations in flight fail with
    /// `LIFECYCLE_INVALID`, targets get EOF on their control pipe and are
    /// reaped (killed after a grace period), every staged payload is
    /// unlinked. Idempotent. In a forked child of the Worker's process it
    /// does nothing (the owner's targets serve on).
    pub fn close(&self) {
        if self.shared.foreign() {
            return;
        }
        let mut io_thread = self.io_thread.lock().unwrap_or_else(|p| p.into_inner());
        {
            let mut core = self.shared.lock();
            if core.machine.lifecycle() == Lifecycle::New {
                let _ = core.machine.close();
                core.drop_snapshot_payloads();
                return;
            }
        }
        self.push(Request::Close, true);
        if handoff::in_callback() {
            // Its thread may be the IO thread: the close is carried out
            // once the callback returns.
            return;
        }
        if let Some(handle) = io_thread.take() {
            let _ = handle.join();
        }
        drop(io_thread);
        self.end_forker();
    }
}

impl<R: Runtime> Drop for Worker<R> {
    fn drop(&mut self) {
        if self.shared.foreign() {
            // A copy in a forked child: its IO thread does not exist here
            // and its state holds the owner's targets (dropping it would
            // kill them). Both are left as they are, never freed here.
            std::mem::forget(self.shared.clone());
            let io_thread = self.io_thread.get_mut().unwrap_or_else(|p| p.into_inner());
            std::mem::forget(io_thread.take());
            let forker = self.forker.get_mut().unwrap_or_else(|p| p.into_inner());
            std::mem::forget(forker.take());
            return;
        }
        self.close();
    }
}

enum Request {
    Register {
        digest: Digest,
        staged: StagedPayload,
        metadata: Option<Box<CallableMetadata>>,
        done: Completer<Result<Handle, OperationError>>,
    },
    Unregister {
        handle: Handle,
        done: Completer<Result<(), OperationError>>,
    },
    Task {
        handle: Handle,
        /// `None`: the target the machine picks (§2.14).
        target: Option<TargetId>,
        encoding: TaskEncoding,
        input: Vec<u8>,
        /// The caller's key for it ([`TaskKey`]).
        key: u64,
        /// How long it may run from its submit (`specs/protocol.md` §2.12).
        deadline: Option<Duration>,
        done: Completer<Result<Vec<u8>, TaskError>>,
    },
    /// Cancel the task `key` names (§2.11): `true` once it will never run.
    Cancel {
        key: u64,
        done: Completer<bool>,
    },
    Inspect {
        done: Completer<Vec<(TargetId, Option<TargetTable>)>>,
    },
    #[cfg(feature = "failpoints")]
    RawControl {
        target: TargetId,
        bytes: Vec<u8>,
    },
    Close,
}

/// Completes a request that no IO thread will ever see.
fn refuse(request: Request, before_start: bool) {
    let message = if before_start {
        "the Worker is not started: call start() first (leaving its `with` block only closes it)"
    } else {
        "the Worker is closed"
    };
    match request {
        Request::Register { done, .. } => done.complete(Err(OperationError::new(lifecycle_error(
            OperationKind::Register,
            message,
        )))),
        Request::Unregister { done, .. } => done.complete(Err(OperationError::new(
            lifecycle_error(OperationKind::Unregister, message),
        ))),
        Request::Task { done, .. } => done.complete(Err(TaskError::of(lifecycle_error(
            OperationKind::Task,
            message,
        )))),
        Request::Cancel { done, .. } => done.complete(false),
        Request::Inspect { done } => drop(done),
        #[cfg(feature = "failpoints")]
        Request::RawControl { .. } => {}
        Request::Close => {}
    }
}

/// State shared by callers and the IO thread, under one lock.
struct Core {
    machine: Parent,
    /// Envelope bytes of pre-start registrations, by digest (the startup
    /// snapshot's payloads, inherited by the targets); emptied at start and
    /// at close.
    envelopes: BTreeMap<Digest, Arc<Vec<u8>>>,
    /// Callable metadata of pre-start registrations, by digest: the first
    /// registration of a digest that brought metadata (targets install each
    /// digest once, with it).
    metadata: BTreeMap<Digest, CallableMetadata>,
    /// A close was asked for: the IO thread carries it out; requests
    /// after it are refused.
    closing: bool,
    /// Requests left to the IO thread (from callers that do not wait, see
    /// [`Worker::submit_then`]), in the order they came; a caller that
    /// carries out its own request first carries out these.
    requests: VecDeque<Request>,
    /// The IO state (links, staged payloads, waiters), driven by the IO
    /// thread and by callers in turn, under this lock (`None` before start
    /// and after close). Whoever drives it takes it out of `Core` for the
    /// time it holds the lock, and puts it back before releasing it.
    io: Option<Box<IoLoop>>,
    io_running: bool,
    /// Write end of the IO thread's wake pipe.
    wake: Option<Arc<TrackedFd>>,
    pids: Vec<i32>,
    /// With replacements on, after start: the envelope of every digest a
    /// live registration (or one in flight) names, with the metadata JSON
    /// its control carries, kept to replay it to replacements
    /// (`specs/protocol.md` §2.9).
    kept: BTreeMap<Digest, Kept>,
    /// What happened to replaced targets, oldest first (the last
    /// [`TARGET_EVENTS_KEPT`]).
    events: VecDeque<TargetEvent>,
    /// How lost targets ended.
    exits: BTreeMap<TargetId, Exit>,
    /// Why lost targets were given up, with how they ended.
    losses: BTreeMap<TargetId, String>,
}

impl Core {
    fn record(&mut self, event: TargetEvent) {
        if self.events.len() == TARGET_EVENTS_KEPT {
            self.events.pop_front();
        }
        self.events.push_back(event);
    }

    /// Drops the startup snapshot's envelope bytes and metadata: at start
    /// (every target inherited them through `fork`) and at a close before
    /// start.
    fn drop_snapshot_payloads(&mut self) {
        self.envelopes = BTreeMap::new();
        self.metadata = BTreeMap::new();
    }
}

/// Hands `request` to the IO loop (or, when no IO thread runs, refuses it
/// as the lifecycle says). Returns the
/// wake-up the caller owes the IO thread when `settle` is false.
fn push(shared: &Arc<Shared>, request: Request, settle: bool) -> Option<Arc<TrackedFd>> {
    let mut core = shared.lock();
    let io = if core.io_running && !core.closing {
        core.io.take()
    } else {
        None
    };
    let Some(mut io) = io else {
        if core.io_running && matches!(request, Request::Close) {
            core.closing = true;
            io_wake(&core);
            return None;
        }
        let started = core.machine.lifecycle() == Lifecycle::New;
        drop(core);
        refuse(request, started);
        return None;
    };
    if matches!(request, Request::Close) {
        core.closing = true;
        io_wake(&core);
    } else {
        // Requests reach the machine in the order they came.
        while let Some(queued) = core.requests.pop_front() {
            io.request(&mut core, queued);
        }
        io.request(&mut core, request);
    }
    let leaving = io.leave(&core, settle, false);
    core.io = Some(io);
    let owed = if settle { None } else { core.wake.clone() };
    drop(core);
    shared.finish(leaving);
    owed
}
