//! The [`Worker`]: the protocol's [`Parent`] machine run over real forked
//! targets, sealed `memfd` staging (`specs/staging.md`), control sockets
//! and reply sockets (specs/design.md §4.1, §5).
//!
//! # Threads
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
//!   IO thread's request.
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
//!    `handle_timeout(now)`; drain effects. Inspections and starting
//!    replacements past their deadline are given up.
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
//! [`SlotEvent`]s; `Send` encodes a wire frame into the target's
//! outbox (a register's carries its metadata as JSON, and its staged
//! payload, one for every target, waits beside it until the frame's first
//! byte is sent with its descriptor); `ReleaseStaged` closes the parent's
//! descriptor of the payload; `Fence` kills and reaps the target; `Completed`
//! hands the result to the waiting caller (a published handle passes
//! `parent.before_publish` first).

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::Read;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use serde::Serialize;

use super::failpoints;
use super::handoff::{self, Completer, Pending};
use super::lead::{Left, Watch};
use super::process::{self, Exit, TargetProcess, ThreadPolicy, TrackedFd};
use super::staging::StagedPayload;
use super::target::{self, TargetSetup};
use super::zygote::Zygote;
use crate::descriptor::{python_serialized_digest, Digest, PythonSerialized};
use crate::envelope::{Envelope, HEADER_LEN};
use crate::error::{Error, ErrorCode, OperationKind};
use crate::metadata::CallableMetadata;
use crate::protocol::{
    Completion, ControlFrame, Effect, FailedRegistration, Failure, Handle, Lifecycle, Namespace,
    OpId, OwnerToken, Parent, ParentConfig, Reply, Seq, SlotPhase, StagingId, TargetId,
    TargetOutcome, Time, DEFAULT_RESPAWN_BACKOFF, DEFAULT_RESPAWN_LIMIT, DEFAULT_SLOT_CAPACITY,
};
use crate::runtime::{Runtime, TaskEncoding};
use crate::wire::{Frame, FrameBuffer, DEFAULT_MAX_FRAME_BYTES, HEADER_BYTES, MIN_MAX_FRAME_BYTES};

/// The default control timeout: 30 seconds.
pub const DEFAULT_CONTROL_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest control timeout, operation timeout or respawn back-off a
/// [`WorkerBuilder`] accepts: 10⁹ seconds (about 31 years).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(1_000_000_000);

/// The default operation timeout, as a multiple of the control timeout
/// ([`WorkerBuilder::operation_timeout`]).
pub const OPERATION_TIMEOUT_FACTOR: u32 = 10;

/// How long [`Worker::close`] lets targets exit on their own (after their
/// control pipe closes) before killing them.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// How long a lost target (its pipe closed or broke the protocol) may take
/// to finish exiting before it is killed.
const LOST_GRACE: Duration = Duration::from_millis(50);

/// Bytes read from a reply socket per `read` call.
const READ_CHUNK_BYTES: usize = 64 * 1024;

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
    fn new(error: Error) -> OperationError {
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

/// Builds a [`Worker`].
pub struct WorkerBuilder<R: Runtime> {
    runtime: Arc<R>,
    targets: u16,
    control_timeout: Duration,
    operation_timeout: Option<Duration>,
    slot_capacity: u16,
    max_frame_bytes: usize,
    fence_on_timeout: bool,
    probe_first: bool,
    respawn_limit: u16,
    respawn_backoff: Duration,
    thread_policy: ThreadPolicy,
}

impl<R: Runtime> WorkerBuilder<R> {
    /// A builder with 1 target, a 30 s control timeout, 64 slots per
    /// target, 16 MiB frames, fencing on, and forking refused in a
    /// multi-threaded process.
    pub fn new(runtime: Arc<R>) -> WorkerBuilder<R> {
        WorkerBuilder {
            runtime,
            targets: 1,
            control_timeout: DEFAULT_CONTROL_TIMEOUT,
            operation_timeout: None,
            slot_capacity: DEFAULT_SLOT_CAPACITY,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            fence_on_timeout: true,
            probe_first: true,
            respawn_limit: DEFAULT_RESPAWN_LIMIT,
            respawn_backoff: Duration::from_micros(DEFAULT_RESPAWN_BACKOFF),
            thread_policy: ThreadPolicy::RefuseIfThreaded,
        }
    }

    /// Number of targets to fork (at least 1).
    pub fn targets(mut self, count: u16) -> Self {
        self.targets = count;
        self
    }

    /// How long a target may stay silent about a register, an unregister
    /// or a cleanup it owes an answer (a target reports alive on receipt
    /// and every quarter of this while the control is queued or running,
    /// `specs/protocol.md`, "Deadlines"), how long it has to answer an
    /// inspection, and how long [`Worker::start`] waits for
    /// every target to be ready, counted from before its first fork (one
    /// deadline for the whole start, not one per target: a target's
    /// runtime start — about 50 ms of CPU for Python — competes with the
    /// others' and with the forks, so allow at least `targets × 50 ms ÷
    /// cores`, with a margin).
    pub fn control_timeout(mut self, timeout: Duration) -> Self {
        self.control_timeout = timeout;
        self
    }

    /// How long a register, an unregister or a cleanup may take in all,
    /// counted from its send, even from a target that keeps reporting
    /// alive (`specs/protocol.md`, "Deadlines"); past it the target is
    /// fenced like a silent one. Default: [`OPERATION_TIMEOUT_FACTOR`]
    /// times the control timeout; at least the control timeout (else
    /// [`WorkerBuilder::build`] refuses it).
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = Some(timeout);
        self
    }

    /// Slots per target (callables a target holds at once).
    pub fn slot_capacity(mut self, slots: u16) -> Self {
        self.slot_capacity = slots;
        self
    }

    /// Maximum frame size in bytes, header included, both directions (at
    /// least [`MIN_MAX_FRAME_BYTES`]). Bounds task inputs and results.
    pub fn max_frame_bytes(mut self, bytes: usize) -> Self {
        self.max_frame_bytes = bytes;
        self
    }

    /// Whether a target that misses a deadline is fenced (killed, reaped,
    /// reported lost: the default) or left running with the digest marked
    /// uncertain.
    pub fn fence_on_timeout(mut self, fence: bool) -> Self {
        self.fence_on_timeout = fence;
        self
    }

    /// Replacement targets (`specs/protocol.md` §2.9): a lost target (it
    /// crashed, was killed or fenced) is replaced by a new process, forked
    /// from a template process made at start, with the same target id and
    /// the next incarnation; it is given every live registration and
    /// serves tasks once it confirmed them all. `limit` replacements of
    /// one slot in a row may be lost before they join (a callable that
    /// kills every new process); then the slot stays lost, and
    /// [`Worker::target_loss`] says so. Default 3; 0 switches replacements
    /// off (and no template process is made).
    pub fn respawn_limit(mut self, limit: u16) -> Self {
        self.respawn_limit = limit;
        self
    }

    /// The back-off before the second replacement in a row of one slot,
    /// doubling for each further one (default 100 ms; `specs/protocol.md`
    /// §2.9). The first replacement after a target that had joined is
    /// lost is started at once.
    pub fn respawn_backoff(mut self, backoff: Duration) -> Self {
        self.respawn_backoff = backoff;
        self
    }

    /// Whether a register of a callable no target has installed since
    /// start goes to one target first and to the others only once that
    /// target confirmed it (the default; `specs/protocol.md` §2.8). Then a
    /// payload whose deserialization kills its target (`os._exit`, a
    /// segfault) costs that one target, and the callable is refused from
    /// then on with `REGISTER_POISONED`. `false`: every register goes to
    /// every live target at once (one round trip less for a new callable;
    /// `BENCHMARKS.md` measures the difference).
    pub fn probe_first(mut self, probe: bool) -> Self {
        self.probe_first = probe;
        self
    }

    /// Forks even if the process already runs other threads (a thread that
    /// holds a lock at fork time leaves it held forever in the targets).
    pub fn accept_thread_risk(mut self) -> Self {
        self.thread_policy = ThreadPolicy::AcceptRisk;
        self
    }

    /// The Worker, not started: registrations go into the startup snapshot.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` for 0 targets, 0 slots, a zero control timeout,
    /// a control timeout, operation timeout or respawn back-off above
    /// [`MAX_TIMEOUT`], an operation timeout shorter than the control
    /// timeout, or a maximum frame size below [`MIN_MAX_FRAME_BYTES`];
    /// `IO_FAILED`
    /// when no random owner token can be drawn.
    pub fn build(self) -> Result<Worker<R>, Error> {
        let invalid = |message: String| {
            Error::new(ErrorCode::LIFECYCLE_INVALID, OperationKind::Start, message)
        };
        if self.targets == 0 || self.slot_capacity == 0 {
            return Err(invalid(
                "a Worker needs at least one target and one slot".to_owned(),
            ));
        }
        // The protocol counts time in whole microseconds: a shorter timeout
        // would become zero there.
        if self.control_timeout < Duration::from_micros(1) {
            return Err(invalid(
                "the control timeout must be at least 1 microsecond".to_owned(),
            ));
        }
        // Deadlines are instants from now: a longer time would overflow.
        for (what, time) in [
            ("the control timeout", Some(self.control_timeout)),
            ("the operation timeout", self.operation_timeout),
            ("the respawn back-off", Some(self.respawn_backoff)),
        ] {
            if time.is_some_and(|t| t > MAX_TIMEOUT) {
                return Err(invalid(format!(
                    "{what} must be at most {} seconds",
                    MAX_TIMEOUT.as_secs()
                )));
            }
        }
        if self.max_frame_bytes < MIN_MAX_FRAME_BYTES {
            return Err(invalid(format!(
                "the maximum frame size must be at least {MIN_MAX_FRAME_BYTES} bytes"
            )));
        }
        // An operation bound shorter than a control timeout would fence a
        // target that reports alive before its silence could ever count,
        // and count that as evidence against a probed digest
        // (specs/protocol.md §2.7, §2.8).
        if let Some(bound) = self.operation_timeout {
            if bound < self.control_timeout {
                return Err(invalid(format!(
                    "the operation timeout ({} s) must be at least the control timeout ({} s)",
                    bound.as_secs_f64(),
                    self.control_timeout.as_secs_f64()
                )));
            }
        }
        let owner = OwnerToken(random_token()?);
        let config = ParentConfig {
            targets: self.targets,
            control_timeout: u64::try_from(self.control_timeout.as_micros()).unwrap_or(u64::MAX),
            operation_timeout: u64::try_from(
                self.operation_timeout
                    .unwrap_or(
                        self.control_timeout
                            .saturating_mul(OPERATION_TIMEOUT_FACTOR),
                    )
                    .as_micros(),
            )
            .unwrap_or(u64::MAX),
            fence_on_timeout: self.fence_on_timeout,
            owner,
            slot_capacity: self.slot_capacity,
            probe_first: self.probe_first,
            respawn_limit: self.respawn_limit,
            respawn_backoff: u64::try_from(self.respawn_backoff.as_micros()).unwrap_or(u64::MAX),
        };
        let machine = Parent::new(config);
        Ok(Worker {
            runtime: self.runtime,
            targets: self.targets,
            control_timeout: self.control_timeout,
            slot_capacity: self.slot_capacity,
            max_frame_bytes: self.max_frame_bytes,
            thread_policy: self.thread_policy,
            respawn: self.respawn_limit > 0,
            clock: Instant::now(),
            config,
            shared: Arc::new(Shared {
                process: std::process::id(),
                core: Mutex::new(Core {
                    machine,
                    envelopes: BTreeMap::new(),
                    metadata: BTreeMap::new(),
                    closing: false,
                    requests: VecDeque::new(),
                    io: None,
                    io_running: false,
                    wake: None,
                    pids: Vec::new(),
                    kept: BTreeMap::new(),
                    events: VecDeque::new(),
                    exits: BTreeMap::new(),
                    losses: BTreeMap::new(),
                }),
            }),
            io_thread: Mutex::new(None),
            forker: Mutex::new(None),
        })
    }
}

fn random_token() -> Result<u64, Error> {
    let mut bytes = [0u8; 8];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| {
            Error::new(
                ErrorCode::IO_FAILED,
                OperationKind::Start,
                format!("/dev/urandom: {e}"),
            )
        })?;
    Ok(u64::from_le_bytes(bytes))
}

/// A result on its way from the targets to one caller: the completion
/// hand-off, and the Worker whose replies the caller reads itself while it
/// waits, when no other thread does ([`super::lead`]).
struct Awaited<T> {
    pending: Option<Pending<T>>,
    /// The Worker, when the result may come from its targets.
    shared: Option<Arc<Shared>>,
    /// Whether the request may have left something for the IO thread to
    /// watch that this caller has not yet settled (it meant to wait next);
    /// settled by waiting (leading settles), else by waking the IO
    /// thread through `wake` (without the state lock: this may be dropped
    /// where the lock is held).
    owed: AtomicBool,
    wake: Option<Arc<TrackedFd>>,
}

impl<T> Awaited<T> {
    fn done(pending: Pending<T>) -> Awaited<T> {
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

    fn wait(self) -> Result<T, handoff::Abandoned> {
        match self.wait_until(None) {
            Ok(result) => result,
            Err(_) => unreachable!("a wait without a deadline ends with the result"),
        }
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

    fn on_complete<F>(mut self, callback: F)
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
    awaited: Awaited<Result<T, OperationError>>,
}

impl<T> PendingOperation<T> {
    /// Waits for the operation to complete. While it waits, this thread
    /// may read the targets' replies itself, for every caller
    /// ([`super::lead`]).
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
        self.awaited.wait().unwrap_or_else(|abandoned| {
            Err(OperationError::new(Error::new(
                ErrorCode::LIFECYCLE_INVALID,
                OperationKind::Close,
                abandoned.to_string(),
            )))
        })
    }

    /// Whether [`PendingOperation::wait`] would return at once.
    pub fn is_complete(&self) -> bool {
        self.awaited.is_complete()
    }
}

/// A task in flight ([`Worker::submit_async`]).
pub struct PendingTask {
    awaited: Awaited<Result<Vec<u8>, TaskError>>,
}

impl PendingTask {
    /// Waits for the task's result (encoded as its input was). While it
    /// waits, this thread may read the targets' replies itself, for every
    /// caller ([`super::lead`]).
    ///
    /// # Errors
    /// The task's [`TaskError`]; `LIFECYCLE_INVALID` if the Worker closed
    /// without an answer, or at once inside a completion callback
    /// ([`PendingTask::on_complete`]).
    pub fn wait(self) -> Result<Vec<u8>, TaskError> {
        if handoff::in_callback() {
            return Err(callback_task_error());
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
        match self.awaited.wait_until(Instant::now().checked_add(timeout)) {
            Ok(result) => Ok(result.unwrap_or_else(task_abandoned)),
            Err(awaited) => Err(PendingTask { awaited }),
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
fn callback_wait_error(operation: OperationKind) -> Error {
    lifecycle_error(
        operation,
        "a completion callback must not wait on the Worker (it runs on the thread that reads the replies, which would wait on itself)",
    )
}

fn callback_task_error() -> TaskError {
    TaskError {
        error: callback_wait_error(OperationKind::Task),
        kind: String::new(),
        exception: Box::default(),
    }
}

/// The error of a task whose completer was dropped unanswered.
fn task_abandoned(abandoned: handoff::Abandoned) -> Result<Vec<u8>, TaskError> {
    Err(TaskError {
        error: Error::new(
            ErrorCode::LIFECYCLE_INVALID,
            OperationKind::Task,
            abandoned.to_string(),
        ),
        kind: String::new(),
        exception: Box::default(),
    })
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
        target: TargetId,
        encoding: TaskEncoding,
        input: Vec<u8>,
        done: Completer<Result<Vec<u8>, TaskError>>,
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
    /// What happened to replaced slots, oldest first (the last
    /// [`SLOT_EVENTS_KEPT`]).
    events: VecDeque<SlotEvent>,
    /// How lost targets ended.
    exits: BTreeMap<TargetId, Exit>,
    /// Why lost targets were given up, with how they ended.
    losses: BTreeMap<TargetId, String>,
}

/// A replacement the template forked for `target`'s slot, as incarnation
/// `incarnation`, or why it could not.
struct Spawned {
    target: TargetId,
    incarnation: u32,
    result: Result<TargetProcess, String>,
}

/// How many slot events a Worker keeps ([`Worker::slot_events`]).
pub const SLOT_EVENTS_KEPT: usize = 1024;

impl Core {
    fn record(&mut self, event: SlotEvent) {
        if self.events.len() == SLOT_EVENTS_KEPT {
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

/// An envelope kept for replays: a startup-snapshot envelope's bytes until
/// a replay first needs it staged, then (like a post-start register's) its
/// sealed staged payload, sent again to each replacement.
struct Kept {
    bytes: Option<Arc<Vec<u8>>>,
    payload: Option<Arc<StagedPayload>>,
    metadata: String,
}

impl Kept {
    fn len(&self) -> usize {
        match (&self.payload, &self.bytes) {
            (Some(payload), _) => usize::try_from(payload.size()).unwrap_or(usize::MAX),
            (None, Some(bytes)) => bytes.len(),
            (None, None) => 0,
        }
    }
}

/// What happened to a replaced target slot (`specs/protocol.md` §2.9), as
/// [`Worker::slot_events`] lists it.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum SlotEvent {
    /// A replacement process was started for `target`.
    Spawned {
        /// The slot.
        target: TargetId,
        /// The new process's incarnation (the original is 0).
        incarnation: u32,
        /// Its process id.
        pid: i32,
    },
    /// A target's process was lost (with replacements on: what starts a
    /// replacement, or counts against the rate limit if it had not
    /// joined).
    Lost {
        /// The slot.
        target: TargetId,
        /// The lost process's incarnation.
        incarnation: u32,
        /// Why it was given up and how it ended, as
        /// [`Worker::target_loss`] says.
        cause: String,
    },
    /// A replacement could not be started (the template process failed
    /// or is gone); it counts as one lost before it joined.
    SpawnFailed {
        /// The slot.
        target: TargetId,
        /// The incarnation that was asked for.
        incarnation: u32,
        /// Why.
        reason: String,
    },
    /// The replacement confirmed every live registration and serves.
    Joined {
        /// The slot.
        target: TargetId,
        /// Its incarnation.
        incarnation: u32,
    },
    /// The replacement refused a replayed registration, or missed a
    /// deadline while joining, and was fenced.
    JoinFailed {
        /// The slot.
        target: TargetId,
        /// Its incarnation.
        incarnation: u32,
        /// Its answer or the passed deadline.
        failure: Failure,
    },
    /// The slot stays lost: `failed_joins` replacements in a row were lost
    /// before they joined.
    Abandoned {
        /// The slot.
        target: TargetId,
        /// Replacements in a row lost before they joined.
        failed_joins: u16,
    },
}

impl std::fmt::Display for SlotEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotEvent::Spawned {
                target,
                incarnation,
                pid,
            } => write!(f, "{target}: incarnation {incarnation} started (pid {pid})"),
            SlotEvent::Lost {
                target,
                incarnation,
                cause,
            } => write!(f, "{target}: incarnation {incarnation} lost ({cause})"),
            SlotEvent::SpawnFailed {
                target,
                incarnation,
                reason,
            } => write!(f, "{target}: incarnation {incarnation} could not be started: {reason}"),
            SlotEvent::Joined {
                target,
                incarnation,
            } => write!(f, "{target}: incarnation {incarnation} joined"),
            SlotEvent::JoinFailed {
                target,
                incarnation,
                failure,
            } => write!(f, "{target}: incarnation {incarnation} failed to join ({failure})"),
            SlotEvent::Abandoned {
                target,
                failed_joins,
            } => write!(
                f,
                "{target}: given up after {failed_joins} replacements in a row were lost before they joined"
            ),
        }
    }
}

struct Shared {
    /// The process that built the Worker: the only one that may use it
    /// (its threads, targets and locks exist there alone).
    process: u32,
    core: Mutex<Core>,
}

impl Shared {
    /// Whether this is another process than the one that built the Worker:
    /// a child forked from it (`os.fork()` in Python, a worker runtime's
    /// fork), holding a copy of its memory. There the Worker's threads do
    /// not exist, its locks may be held forever, and its targets are not
    /// this process's children: nothing of it may be touched, nor dropped
    /// (dropping would kill the owner's targets). See [`Worker`], "Forked
    /// children".
    fn foreign(&self) -> bool {
        std::process::id() != self.process
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands over the completions decided under the lock, then wakes the
    /// leader if one of them may be its result: checked under the lock
    /// after the hand-over, so a leader that began meanwhile sees its
    /// result when it next looks, and one that leads now is woken.
    fn finish(&self, leaving: Leaving) {
        let Leaving {
            handovers,
            freed,
            recheck,
        } = leaving;
        handovers.into_iter().for_each(|handover| handover());
        drop(freed);
        if recheck {
            let core = self.lock();
            if let Some(io) = core.io.as_ref().filter(|io| io.watch.has_leader()) {
                // A full pipe already guarantees a wake-up.
                let _ = nix::unistd::write(&io.leader_wake_write, &[1]);
            }
        }
    }

    /// The leader stops leading, and wakes the IO thread for what it
    /// leaves ([`super::lead`]).
    fn step_down(&self) {
        let mut core = self.lock();
        if let Some(mut io) = core.io.take() {
            io.watch.step_down();
            let leaving = io.leave(&core, true, false);
            core.io = Some(io);
            drop(core);
            self.finish(leaving);
        }
    }

    /// Waits for `pending` as the leader ([`super::lead`]): reads the
    /// replies of every live target and handles the deadlines, for every
    /// caller, until this caller's result is there (`Ok`) or `until`
    /// passes. `Err(pending)`, having settled what it leaves, when the
    /// time is up, when another thread leads (this caller follows: its
    /// result is handed over by whoever reads it), or when no IO thread
    /// runs (the result is decided already).
    fn lead<T>(
        &self,
        pending: Pending<T>,
        until: Option<Instant>,
    ) -> Result<Result<T, handoff::Abandoned>, Pending<T>> {
        let mut replies: Vec<(usize, i32, Arc<TrackedFd>)> = Vec::new();
        let mut ready: Vec<(usize, i32, bool)> = Vec::new();
        let mut woken = false;
        let mut leading = Leading {
            shared: self,
            wake: None,
        };
        // A wait whose time is already up still reads what is there once
        // (one poll without waiting): a zero timeout is a look.
        let mut polled = false;
        loop {
            let mut core = self.lock();
            let Some(mut io) = core.io.take() else {
                return Err(pending);
            };
            if leading.wake.is_none() {
                let passed = polled && until.is_some_and(|until| Instant::now() >= until);
                let live = io.live();
                // Follow while the IO thread reads every reply socket (many
                // results in flight): leading too would wake both threads
                // for every reply.
                if pending.is_complete()
                    || passed
                    || io.watch.io_reads_all(&live)
                    || !io.watch.try_lead(&live)
                {
                    let leaving = io.leave(&core, true, false);
                    core.io = Some(io);
                    drop(core);
                    self.finish(leaving);
                    return Err(pending);
                }
                leading.wake = Some(io.leader_wake.clone());
            } else {
                if std::mem::take(&mut woken) {
                    let mut sink = [0u8; 64];
                    while matches!(nix::unistd::read(io.leader_wake.as_fd(), &mut sink), Ok(n) if n == sink.len())
                    {
                    }
                }
                for (index, pid, hung_up) in ready.drain(..) {
                    if io.pid_at(index) == Some(pid) {
                        io.read_replies(&mut core, index, hung_up);
                    }
                }
                io.handle_deadlines(&mut core);
            }
            let live = io.live();
            if !io.watch.leads_over(&live) || replies.len() != live.len() {
                io.watch.relead(&live);
                replies = live
                    .iter()
                    .filter_map(|&(index, pid)| {
                        io.links[index]
                            .as_ref()
                            .map(|link| (index, pid, link.process.reply_shared()))
                    })
                    .collect();
            }
            let deadline = io.next_deadline(&core).into_iter().chain(until).min();
            io.watch.set_leader_deadline(deadline);
            let leaving = io.leave(&core, true, true);
            core.io = Some(io);
            drop(core);
            self.finish(leaving);
            let passed = polled && until.is_some_and(|until| Instant::now() >= until);
            if pending.is_complete() || passed {
                leading.step_down();
                return if pending.is_complete() {
                    Ok(pending.wait())
                } else {
                    Err(pending)
                };
            }
            let Some(wake) = leading.wake.clone() else {
                return Err(pending);
            };
            let mut fds = vec![PollFd::new(wake.as_fd(), PollFlags::POLLIN)];
            fds.extend(
                replies
                    .iter()
                    .map(|(_, _, fd)| PollFd::new(fd.as_fd(), PollFlags::POLLIN)),
            );
            let (result, events) = poll_events(&mut fds, deadline);
            polled = true;
            drop(fds);
            if matches!(result, Err(errno) if errno != Errno::EINTR) {
                // Unrecoverable here: leave the replies to the IO thread.
                leading.step_down();
                return Err(pending);
            }
            woken = !events[0].is_empty();
            for ((index, pid, _), event) in replies.iter().zip(&events[1..]) {
                if !event.is_empty() {
                    let hung_up = event.intersects(PollFlags::POLLHUP | PollFlags::POLLERR);
                    ready.push((*index, *pid, hung_up));
                }
            }
        }
    }
}

/// A completion decided under the state lock, handed to its caller once
/// the lock is released.
type Handover = Box<dyn FnOnce() + Send>;

/// A caller's leadership, with the leader wake pipe while it leads: it
/// steps down when dropped while still leading (the wait unwound), so the
/// IO thread takes the replies back instead of no one reading them.
struct Leading<'a> {
    shared: &'a Shared,
    wake: Option<Arc<TrackedFd>>,
}

impl Leading<'_> {
    fn step_down(&mut self) {
        if self.wake.take().is_some() {
            self.shared.step_down();
        }
    }
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        self.step_down();
    }
}

/// What a thread leaving the state lock still owes once it released it:
/// the completions decided meanwhile, then, if `recheck` (a result was
/// decided, and this thread does not lead), a wake-up of the leader, who
/// may be waiting for one of them.
struct Leaving {
    handovers: Vec<Handover>,
    /// Kept payloads no registration needs any more, freed after the
    /// hand-over.
    freed: Vec<Kept>,
    recheck: bool,
}

/// Kept payloads up to this size are freed by the thread that released
/// them; larger ones by the IO thread, off the callers' path.
const INLINE_FREE_BYTES: usize = 64 * 1024;

/// Wakes the IO thread (it rebuilds its `poll` set).
fn io_wake(core: &Core) {
    if let Some(wake) = &core.wake {
        // A full wake pipe already guarantees a wake-up.
        let _ = nix::unistd::write(&**wake, &[1]);
    }
}

/// `poll` over `fds` until an event or `deadline`: its result, and the
/// events each descriptor returned.
fn poll_events(
    fds: &mut [PollFd<'_>],
    deadline: Option<Instant>,
) -> (nix::Result<i32>, Vec<PollFlags>) {
    let polled = nix::poll::poll(fds, poll_timeout(deadline));
    let events = fds
        .iter()
        .map(|fd| fd.revents().unwrap_or(PollFlags::empty()))
        .collect();
    (polled, events)
}

/// A `poll` timeout that ends no earlier than `deadline` (`None`: block).
fn poll_timeout(deadline: Option<Instant>) -> PollTimeout {
    match deadline {
        None => PollTimeout::NONE,
        Some(deadline) => {
            let left = deadline.saturating_duration_since(Instant::now());
            let millis = left.as_micros().div_ceil(1000);
            PollTimeout::try_from(u64::try_from(millis).unwrap_or(u64::MAX))
                .unwrap_or(PollTimeout::MAX)
        }
    }
}

/// The IO thread (the run rule in the module docs).
fn io_thread(shared: Arc<Shared>) {
    let mut core = shared.lock();
    loop {
        let Some(mut io) = core.io.take() else {
            return;
        };
        // Step 1: replacements the template forked, the requests left to
        // this thread, and a close.
        let spawned = std::mem::take(&mut *io.spawned.lock().unwrap_or_else(|p| p.into_inner()));
        for spawned in spawned {
            io.link_spawned(&mut core, spawned);
        }
        while let Some(request) = core.requests.pop_front() {
            io.request(&mut core, request);
        }
        if core.closing {
            io.close(&mut core);
            let handovers = std::mem::take(&mut io.handovers);
            drop(core);
            handovers.into_iter().for_each(|handover| handover());
            // A leader finds the Worker closed, its result decided.
            let _ = nix::unistd::write(&io.leader_wake_write, &[1]);
            return;
        }
        // Step 2: deadlines.
        io.handle_deadlines(&mut core);
        // Step 3: the poll set (reply sockets only when a reply is expected
        // and no leader reads them) and its timeout.
        let deadline = io.next_deadline(&core);
        let live = io.live();
        let unsent = io.unsent();
        let expecting = io.expecting(&core);
        io.watch.plan_io(&live, expecting, &unsent, deadline);
        let mut watched: Vec<(Ready, Arc<TrackedFd>, PollFlags)> =
            vec![(Ready::Wake, io.wake.clone(), PollFlags::POLLIN)];
        for &(index, pid) in &live {
            let Some(link) = io.links[index].as_ref() else {
                continue;
            };
            if io.watch.io_reads(index, pid) {
                watched.push((
                    Ready::Reply(index, pid),
                    link.process.reply_shared(),
                    PollFlags::POLLIN,
                ));
            }
            if let Some(pidfd) = link.process.pidfd_shared() {
                watched.push((Ready::Ended(index, pid), pidfd, PollFlags::POLLIN));
            }
            if !link.outbox.is_empty() {
                if let Some(control) = link.process.control_shared() {
                    watched.push((Ready::Control(index, pid), control, PollFlags::POLLOUT));
                }
            }
        }
        // Step 4: hand over, and wait without the lock.
        let leaving = Leaving {
            handovers: std::mem::take(&mut io.handovers),
            freed: std::mem::take(&mut io.graveyard),
            recheck: std::mem::take(&mut io.completed),
        };
        core.io = Some(io);
        drop(core);
        shared.finish(leaving);
        let mut fds: Vec<PollFd> = watched
            .iter()
            .map(|(_, fd, flags)| PollFd::new(fd.as_fd(), *flags))
            .collect();
        let (polled, flags) = poll_events(&mut fds, deadline);
        drop(fds);
        let events: Vec<(Ready, PollFlags)> = watched
            .into_iter()
            .map(|(what, _, _)| what)
            .zip(flags)
            .collect();
        let _ = failpoints::hit(failpoints::PARENT_IO_TURN);
        // Steps 5 and 6: replies, losses, flushes.
        core = shared.lock();
        let Some(mut io) = core.io.take() else {
            return;
        };
        if let Err(errno) = polled {
            if errno != Errno::EINTR {
                // Unrecoverable: fail everything rather than spin.
                core.closing = true;
            }
        } else {
            io.handle_events(&mut core, events);
        }
        core.io = Some(io);
        // Completions decided here are handed over at step 4 of the next
        // turn, after its lock is released, not now: a caller woken now
        // would find the lock taken again for steps 1 to 3.
    }
}

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
/// fails with `LIFECYCLE_INVALID` ("this Worker belongs to process N …"),
/// a pending task or operation copied there completes at once as
/// abandoned, the getters answer as for a closed Worker, and `close` and
/// drop do nothing there: the owner's targets, threads and state are
/// never touched (nor freed) by the child.
pub struct Worker<R: Runtime> {
    runtime: Arc<R>,
    targets: u16,
    control_timeout: Duration,
    slot_capacity: u16,
    max_frame_bytes: usize,
    thread_policy: ThreadPolicy,
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
/// (`specs/protocol.md` §2.10): the SHA-256 of its JSON form.
fn metadata_identity(metadata: &CallableMetadata) -> Digest {
    use sha2::Digest as _;
    Digest(sha2::Sha256::digest(metadata.to_json().as_bytes()).into())
}

/// The `LIFECYCLE_INVALID` of a Worker used in a forked child of its
/// process ([`Worker`], "Forked children").
fn foreign_error(operation: OperationKind, owner: u32) -> Error {
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

    fn envelope_error(e: crate::envelope::EnvelopeError) -> OperationError {
        OperationError::new(
            Error::new(e.code(), OperationKind::Register, e.message())
                .with_namespace(Namespace::LocalPython),
        )
    }

    /// Registers an envelope (SPYC, specs/design.md §3.1) and waits for the
    /// handle. Before start: adds it to the startup snapshot. After start:
    /// stages it and installs it at every live target; the handle is
    /// returned only when every target in scope confirmed (invariant 1).
    ///
    /// # Errors
    /// `ENVELOPE_INVALID` (and the other envelope codes) for bad bytes;
    /// `LOCAL_SLOT_EXHAUSTED` before start for a new digest when the startup
    /// snapshot already fills the slot capacity of a target (the protocol's
    /// `Parent::register_before_start`);
    /// `IO_FAILED` when staging fails; `LIFECYCLE_INVALID` once closed;
    /// `REGISTER_CLEANUP_UNCERTAIN` for an uncertain digest;
    /// `NO_LIVE_TARGET`; `REGISTER_PARTIAL_FAILURE` with every target's
    /// outcome when a target failed (rolled back); `REGISTER_POISONED`
    /// when installing the callable killed the target that tried it first
    /// (`WorkerBuilder::probe_first`), naming that target and how it died,
    /// and for every later register of it (nothing is sent then).
    pub fn register(&self, envelope: &[u8]) -> Result<Handle, OperationError> {
        self.register_async(envelope)?.wait()
    }

    /// Registers an envelope with its callable metadata (/// `specs/metadata.md`) and waits for the handle; `None` is
    /// [`Worker::register`]. The metadata is not part of the hashid: it
    /// travels as JSON in the register control (`specs/wire.md`), and each
    /// target checks it (versions, deps, executor) before it deserializes,
    /// then runs its hooks around each task. Before start it goes into the
    /// startup snapshot with the envelope. The parent only reads its JSON
    /// and the hook hashids; it never deserializes anything.
    ///
    /// A digest is installed once per target; a later registration of a
    /// digest a target already holds only adds a reference. While a digest
    /// is registered it has one metadata: a register of it with other
    /// metadata (or none where it has some) is refused with
    /// `METADATA_CONFLICT` (`specs/protocol.md` §2.10).
    ///
    /// # Errors
    /// As [`Worker::register`]; `METADATA_INVALID` naming the hashid when a
    /// `call_before` / `call_after` hook's hashid has no live handle in
    /// `LOCAL_PYTHON` (checked before the control is broadcast; nothing is
    /// sent then); `FRAME_INVALID` when the metadata's JSON does not fit in
    /// one register control; `REGISTER_PARTIAL_FAILURE` with each target's
    /// outcome when a target refused it (e.g. `PYTHON_VERSION_MISMATCH`,
    /// `DEPS_UNSATISFIED`, `EXECUTOR_UNKNOWN` in the outcome's failure).
    pub fn register_with_metadata(
        &self,
        envelope: &[u8],
        metadata: Option<&CallableMetadata>,
    ) -> Result<Handle, OperationError> {
        self.register_with_metadata_async(envelope, metadata)?
            .wait()
    }

    /// Starts a register with metadata and returns at once with a pending
    /// operation (complete already before start).
    ///
    /// # Errors
    /// As [`Worker::register_with_metadata`], for the failures found before
    /// any target is involved.
    pub fn register_with_metadata_async(
        &self,
        envelope: &[u8],
        metadata: Option<&CallableMetadata>,
    ) -> Result<PendingOperation<Handle>, OperationError> {
        self.register_inner(envelope, metadata)
    }

    /// Starts a register and returns at once with a pending operation
    /// (complete already before start).
    ///
    /// # Errors
    /// As [`Worker::register`], for the failures found before any target is
    /// involved (bad envelope, staging, lifecycle).
    pub fn register_async(
        &self,
        envelope: &[u8],
    ) -> Result<PendingOperation<Handle>, OperationError> {
        self.register_inner(envelope, None)
    }

    fn register_inner(
        &self,
        envelope: &[u8],
        metadata: Option<&CallableMetadata>,
    ) -> Result<PendingOperation<Handle>, OperationError> {
        self.owned(OperationKind::Register)
            .map_err(OperationError::new)?;
        let parsed = Envelope::parse(envelope).map_err(Self::envelope_error)?;
        if let Some(metadata) = metadata {
            // Room for the register control's fixed fields: seq, digest,
            // staged size and the metadata's length.
            let json_bytes = metadata.to_json().len();
            if HEADER_BYTES + 8 + 32 + 8 + 4 + json_bytes > self.max_frame_bytes {
                return Err(OperationError::new(
                    Error::new(
                        ErrorCode::FRAME_INVALID,
                        OperationKind::Register,
                        format!(
                            "the metadata's JSON of {json_bytes} bytes does not fit in a register control of at most {} bytes",
                            self.max_frame_bytes
                        ),
                    )
                    .with_namespace(Namespace::LocalPython),
                ));
            }
        }
        let mut core = self.shared.lock();
        match core.machine.lifecycle() {
            Lifecycle::New => {
                let digest = python_serialized_digest(&parsed);
                if let Some(metadata) = metadata {
                    check_hooks_live(&core.machine, digest, metadata)
                        .map_err(OperationError::new)?;
                }
                let handle = core
                    .machine
                    .register_before_start_with_metadata(
                        digest,
                        Namespace::LocalPython,
                        metadata.map(metadata_identity),
                    )
                    .map_err(OperationError::new)?;
                let bytes = &envelope[..parsed.encoded_len()];
                core.envelopes
                    .entry(digest)
                    .or_insert_with(|| Arc::new(bytes.to_vec()));
                if let Some(metadata) = metadata {
                    core.metadata
                        .entry(digest)
                        .or_insert_with(|| metadata.clone());
                }
                Ok(completed(Ok(handle)))
            }
            Lifecycle::Closed => Err(OperationError::new(lifecycle_error(
                OperationKind::Register,
                "the Worker is closed",
            ))),
            Lifecycle::Started => {
                drop(core);
                let hashed = HEADER_LEN..parsed.encoded_len();
                let (staged, payload_sha256) =
                    StagedPayload::create(&envelope[..parsed.encoded_len()], hashed).map_err(
                        |e| {
                            OperationError::new(
                                Error::new(e.code(), OperationKind::Stage, e.to_string())
                                    .with_namespace(Namespace::LocalPython),
                            )
                        },
                    )?;
                let digest = PythonSerialized {
                    payload_format_version: parsed.version(),
                    serializer_id: parsed.serializer(),
                    payload_sha256: Digest(payload_sha256),
                }
                .digest();
                let (done, pending) = handoff::channel();
                let owed = self.push(
                    Request::Register {
                        digest,
                        staged,
                        metadata: metadata.cloned().map(Box::new),
                        done,
                    },
                    false,
                );
                Ok(PendingOperation {
                    awaited: self.awaited(pending, owed),
                })
            }
        }
    }

    /// Unregisters a handle and waits until every target that holds it
    /// dropped its reference.
    ///
    /// # Errors
    /// The handle resolution errors (`HANDLE_FOREIGN`, `HANDLE_STALE`,
    /// `HANDLE_MUTATED`, `HANDLE_WRONG_NAMESPACE`,
    /// `REGISTER_CLEANUP_UNCERTAIN`); `LIFECYCLE_INVALID` once closed;
    /// `UNREGISTER_PARTIAL_FAILURE` with every target's outcome.
    pub fn unregister(&self, handle: &Handle) -> Result<(), OperationError> {
        self.unregister_async(handle)?.wait()
    }

    /// Starts an unregister and returns at once with a pending operation.
    ///
    /// # Errors
    /// As [`Worker::unregister`], for failures found before start.
    pub fn unregister_async(
        &self,
        handle: &Handle,
    ) -> Result<PendingOperation<()>, OperationError> {
        self.owned(OperationKind::Unregister)
            .map_err(OperationError::new)?;
        let mut core = self.shared.lock();
        match core.machine.lifecycle() {
            Lifecycle::New => {
                core.machine
                    .unregister_before_start(handle)
                    .map_err(OperationError::new)?;
                let digest = handle.digest();
                if !core
                    .machine
                    .startup_snapshot()
                    .iter()
                    .any(|(d, _)| *d == digest)
                {
                    core.envelopes.remove(&digest);
                    core.metadata.remove(&digest);
                }
                Ok(completed(Ok(())))
            }
            _ => {
                drop(core);
                let (done, pending) = handoff::channel();
                let owed = self.push(
                    Request::Unregister {
                        handle: *handle,
                        done,
                    },
                    false,
                );
                Ok(PendingOperation {
                    awaited: self.awaited(pending, owed),
                })
            }
        }
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
            callback(Err(TaskError {
                error,
                kind: String::new(),
                exception: Box::default(),
            }));
            return;
        }
        let (done, pending) = handoff::channel();
        // Given to the hand-off first: it runs in the thread that
        // completes the task, never in this one later.
        pending.on_complete(move |result| callback(result.unwrap_or_else(task_abandoned)));
        if let Err(error) = self.task_frame_fits(handle, target, input) {
            done.complete(Err(error));
        } else {
            let request = Request::Task {
                handle: *handle,
                target,
                encoding,
                input: input.to_vec(),
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

    /// Starts a task and returns at once with a pending task.
    pub fn submit_async(
        &self,
        handle: &Handle,
        target: TargetId,
        encoding: TaskEncoding,
        input: &[u8],
    ) -> PendingTask {
        let (done, pending) = handoff::channel();
        if let Err(error) = self.owned(OperationKind::Task) {
            done.complete(Err(TaskError {
                error,
                kind: String::new(),
                exception: Box::default(),
            }));
            return PendingTask {
                awaited: Awaited::done(pending),
            };
        }
        if let Err(error) = self.task_frame_fits(handle, target, input) {
            done.complete(Err(error));
            return PendingTask {
                awaited: Awaited::done(pending),
            };
        }
        let owed = self.push(
            Request::Task {
                handle: *handle,
                target,
                encoding,
                input: input.to_vec(),
                done,
            },
            false,
        );
        PendingTask {
            awaited: self.awaited(pending, owed),
        }
    }

    /// `FRAME_INVALID` for a task input too large for one frame.
    fn task_frame_fits(
        &self,
        handle: &Handle,
        target: TargetId,
        input: &[u8],
    ) -> Result<(), TaskError> {
        // Task frame: header, seq, digest, encoding, input length, input.
        let size = HEADER_BYTES + 8 + 32 + 1 + 4 + input.len();
        if size <= self.max_frame_bytes {
            return Ok(());
        }
        Err(TaskError {
            error: Error::new(
                ErrorCode::FRAME_INVALID,
                OperationKind::Task,
                format!(
                    "a task input of {} bytes makes a frame of {size} bytes, over the maximum of {} (max_frame_bytes)",
                    input.len(),
                    self.max_frame_bytes
                ),
            )
            .with_target(target)
            .with_digest(handle.digest()),
            kind: String::new(),
            exception: Box::default(),
        })
    }

    /// The waiting side of a request given to [`Worker::push`].
    fn awaited<T>(&self, pending: Pending<T>, wake: Option<Arc<TrackedFd>>) -> Awaited<T> {
        Awaited {
            pending: Some(pending),
            shared: Some(self.shared.clone()),
            owed: AtomicBool::new(wake.is_some()),
            wake,
        }
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

    /// Where `target`'s slot stands: serving (`Joined`), being replaced
    /// (`BackingOff`, `Spawning`, `Joining`) or `Lost` for good (every
    /// slot, once closed).
    pub fn slot_phase(&self, target: TargetId) -> SlotPhase {
        if self.shared.foreign() {
            return SlotPhase::Lost;
        }
        let core = self.shared.lock();
        match core.machine.lifecycle() {
            Lifecycle::Closed => SlotPhase::Lost,
            _ => core.machine.slot_phase(target),
        }
    }

    /// What happened to target slots since start, oldest first (the last
    /// [`SLOT_EVENTS_KEPT`]): with replacements on, every loss, and every
    /// replacement started, joined or failed, and slots given up.
    pub fn slot_events(&self) -> Vec<SlotEvent> {
        if self.shared.foreign() {
            return Vec::new();
        }
        self.shared.lock().events.iter().cloned().collect()
    }

    /// The process id of `target`'s latest process (for supervision and
    /// tests), if started; it may have ended since (see
    /// [`Worker::slot_phase`]).
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
    /// whether it was poisoned (false in a forked child of the Worker's
    /// process, which cannot use it).
    pub fn forgive(&self, hashid: crate::descriptor::HashId) -> bool {
        if self.shared.foreign() {
            return false;
        }
        self.shared.lock().machine.forgive(hashid.0)
    }

    /// Runs `job` (the forks of [`Worker::start`]) on the Worker's forking
    /// thread, started here: a thread of the Worker's own that then waits
    /// until the Worker closes. The targets' and the template's
    /// parent-death signal (`PR_SET_PDEATHSIG`) follows the thread that
    /// forked them, so it fires when the Worker closes or the process
    /// dies, never when the thread that called `start` ends.
    ///
    /// # Errors
    /// `job`'s error; `IO_FAILED` when the thread cannot be spawned or
    /// `job` panicked.
    fn forker_run<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> Result<T, OperationError> + Send + 'static,
    ) -> Result<T, OperationError> {
        let failed = |message: String| {
            OperationError::new(Error::new(
                ErrorCode::IO_FAILED,
                OperationKind::Start,
                message,
            ))
        };
        let (result_tx, result_rx) = std::sync::mpsc::sync_channel(1);
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("callreg-fork".to_owned())
            .spawn(move || {
                let result = job();
                let forked = result.is_ok();
                let _ = result_tx.send(result);
                if forked {
                    // Until the Worker closes: this thread's end is its
                    // targets' parent-death signal.
                    let _ = stop_rx.recv();
                }
            })
            .map_err(|e| failed(format!("spawning the forking thread: {e}")))?;
        let Ok(result) = result_rx.recv() else {
            let _ = thread.join();
            return Err(failed("the forking thread panicked".to_owned()));
        };
        if result.is_ok() {
            *self.forker.lock().unwrap_or_else(|p| p.into_inner()) = Some((stop_tx, thread));
        } else {
            let _ = thread.join();
        }
        result
    }

    /// Ends the forking thread, once every target it forked was reaped.
    fn end_forker(&self) {
        let forker = self.forker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((stop, thread)) = forker {
            drop(stop);
            let _ = thread.join();
        }
    }

    /// `Ok` in the process that built the Worker.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` in any other (a forked child of it).
    fn owned(&self, operation: OperationKind) -> Result<(), Error> {
        if self.shared.foreign() {
            return Err(foreign_error(operation, self.shared.process));
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
        let mut core = self.shared.lock();
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
        self.shared.finish(leaving);
        owed
    }

    /// Forks the targets, waits until each installed the startup snapshot,
    /// and starts the IO thread. Stale staged payloads of dead parents are
    /// swept first; with the `failpoints` feature, fail points are
    /// configured from `FAILPOINTS` (and per target, see
    /// [`super::failpoints`]).
    ///
    /// Any thread may call it: the forks run on a thread of the Worker's
    /// own, which lives until the Worker closes, so the targets' and the
    /// template's parent-death signal (`PR_SET_PDEATHSIG`, which follows
    /// the forking thread) fires when the Worker closes or the process
    /// dies, not when the calling thread ends.
    ///
    /// A snapshot entry that some target cannot install (it fails to
    /// deserialize there, or its checks refuse it) fails that registration
    /// only (`specs/protocol.md` §2.6): its handles are no longer live,
    /// the targets that installed it drop it, and the returned
    /// [`StartReport::failed`] names each with every target's reason. A
    /// target that is not ready (it exited, or missed the deadline) is
    /// stopped and reported; the Worker still starts with the others, and
    /// the returned error lists every target's outcome.
    ///
    /// Deadline: the control timeout bounds the whole start, counted from
    /// before the first fork; a target not ready by then is fenced (killed,
    /// reaped, reported `Fenced`). So `start` returns within the control
    /// timeout plus the time to reap the targets it gave up.
    ///
    /// Limits: at most `u16::MAX` targets; the parent holds three
    /// descriptors per target (its end of the control socket, its end of
    /// the reply socket, a pidfd),
    /// so the soft `RLIMIT_NOFILE` bounds the count (checked first); each
    /// Python target costs about 11.5 MB PSS (19 MB RSS; CPython 3.11 with
    /// cloudpickle, nothing registered; `BENCHMARKS.md`).
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless new; `IO_FAILED` when the process already
    /// runs other threads (unless accepted in the builder), when the
    /// targets' pipes would exceed the soft `RLIMIT_NOFILE`, when `fork`,
    /// `pipe2` fails, or `FAILPOINTS` is malformed;
    /// `REGISTER_PARTIAL_FAILURE` (with a startup snapshot) or
    /// `TARGET_LOST` (without) when some target was not ready (it exited
    /// or broke the protocol before, or missed the deadline), with every
    /// target's outcome and, in the message, every failed registration.
    /// A snapshot entry that a ready target could not install is not an
    /// error: it is in [`StartReport::failed`].
    pub fn start(&self) -> Result<StartReport, OperationError> {
        self.owned(OperationKind::Start)
            .map_err(OperationError::new)?;
        let mut core = self.shared.lock();
        let start_error = |code, message: String| {
            OperationError::new(Error::new(code, OperationKind::Start, message))
        };
        if core.machine.lifecycle() != Lifecycle::New {
            return Err(OperationError::new(lifecycle_error(
                OperationKind::Start,
                "start needs a new Worker",
            )));
        }
        // Only a build with fail points reads their variables: `FAILPOINTS`
        // may be meant for another crate of the embedding process.
        if cfg!(feature = "failpoints") {
            failpoints::configure_from_env("FAILPOINTS")
                .map_err(|m| start_error(ErrorCode::IO_FAILED, m))?;
        }
        ignore_sigpipe();
        check_descriptor_room(self.targets, self.respawn)
            .map_err(|m| start_error(ErrorCode::IO_FAILED, m))?;
        // One deadline for the whole start, from before the first fork:
        // every target must be ready by then (forking under load, and every
        // target starting its runtime at once, all count against it).
        let deadline = Instant::now() + self.control_timeout;
        let snapshot = core.machine.startup_snapshot();
        let setup = TargetSetup {
            runtime: self.runtime.clone(),
            snapshot: snapshot.clone(),
            envelopes: core.envelopes.clone(),
            metadata: core.metadata.clone(),
            slot_capacity: self.slot_capacity,
            max_frame_bytes: self.max_frame_bytes,
            heartbeat: self.control_timeout / 4,
        };
        // The process's threads are counted before the forking thread
        // exists: that thread is the Worker's own.
        process::check_threads(self.thread_policy)
            .map_err(|e| start_error(ErrorCode::IO_FAILED, e.to_string()))?;
        let empty = TargetSetup {
            runtime: self.runtime.clone(),
            snapshot: Vec::new(),
            envelopes: BTreeMap::new(),
            metadata: BTreeMap::new(),
            slot_capacity: self.slot_capacity,
            max_frame_bytes: self.max_frame_bytes,
            heartbeat: self.control_timeout / 4,
        };
        let (targets, respawn, runtime) = (self.targets, self.respawn, self.runtime.clone());
        let forks = move || -> Result<(Vec<TargetProcess>, Option<Zygote>), OperationError> {
            let before_body = |index| {
                if cfg!(feature = "failpoints")
                    && failpoints::configure_from_env(&failpoints::target_env_var(index)).is_err()
                {
                    // SAFETY: ends the freshly forked target before it runs.
                    unsafe { libc::_exit(target::START_EXIT_CODE) }
                }
            };
            let processes = process::spawn_targets(
                usize::from(targets),
                ThreadPolicy::AcceptRisk,
                &*runtime,
                before_body,
                |ends| target::run(ends, &setup),
            )
            .map_err(|e| start_error(ErrorCode::IO_FAILED, e.to_string()))?;
            // Replacements (§2.9) come from a template forked now; each
            // starts holding nothing and is given every live registration
            // by replay.
            let zygote = if respawn {
                match Zygote::fork(ThreadPolicy::AcceptRisk, &*runtime, before_body, |ends| {
                    target::run(ends, &empty)
                }) {
                    Ok(zygote) => Some(zygote),
                    Err(e) => {
                        for mut process in processes {
                            let _ = process.kill();
                            let _ = process.reap(LOST_GRACE);
                        }
                        return Err(start_error(
                            ErrorCode::IO_FAILED,
                            format!("forking the template of replacement targets: {e}"),
                        ));
                    }
                }
            } else {
                None
            };
            Ok((processes, zygote))
        };
        let (processes, zygote) = self.forker_run(forks)?;
        // Every target inherited the snapshot's bytes through `fork`; the
        // parent sends them again only to replacements.
        if self.respawn {
            let envelopes = std::mem::take(&mut core.envelopes);
            for (digest, bytes) in envelopes {
                let metadata = core
                    .metadata
                    .get(&digest)
                    .map(CallableMetadata::to_json)
                    .unwrap_or_default();
                core.kept.insert(
                    digest,
                    Kept {
                        bytes: Some(bytes),
                        payload: None,
                        metadata,
                    },
                );
            }
        }
        core.drop_snapshot_payloads();
        core.machine.start().map_err(OperationError::new)?;
        core.pids = processes.iter().map(|p| p.pid().as_raw()).collect();
        let (mut links, outcomes, snapshot_failures) =
            wait_ready(processes, &snapshot, self.max_frame_bytes, deadline);
        let now = now_since(self.clock);
        for (target, outcome) in &outcomes {
            if *outcome != TargetOutcome::Ok {
                if let Some(mut link) = links[usize::from(target.0)].take() {
                    // A target that exited before it was ready is reaped;
                    // one that was not ready in time is fenced at once.
                    let grace = if *outcome == TargetOutcome::Fenced {
                        Duration::ZERO
                    } else {
                        LOST_GRACE
                    };
                    if let Ok(exit) = link.process.reap(grace) {
                        core.exits.insert(*target, exit);
                    }
                }
                if self.respawn {
                    core.record(SlotEvent::Lost {
                        target: *target,
                        incarnation: 0,
                        cause: format!("at start: {}", outcome_text(outcome)),
                    });
                }
                let _ = core.machine.target_lost(*target, now);
            }
        }
        // What the losses emitted (replacements, §2.9) is carried out by
        // the IO loop's first drain, below.
        // A snapshot entry some target could not install fails its
        // registration; the machine unregisters it where it was installed
        // (its frames are carried out below, by the IO loop's drain).
        let failed = core
            .machine
            .snapshot_failed(&snapshot_failures, now)
            .map_err(OperationError::new)?;
        let (wake_read, wake_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)
            .map_err(|e| start_error(ErrorCode::IO_FAILED, format!("pipe2: {e}")))?;
        core.wake = Some(Arc::new(TrackedFd::new(wake_write)));
        core.io_running = true;
        let (leader_read, leader_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)
            .map_err(|e| start_error(ErrorCode::IO_FAILED, format!("pipe2: {e}")))?;
        let mut io = IoLoop {
            links,
            wake: Arc::new(TrackedFd::new(wake_read)),
            leader_wake: Arc::new(TrackedFd::new(leader_read)),
            leader_wake_write: TrackedFd::new(leader_write),
            watch: Watch::default(),
            completed: false,
            chunk: Vec::new(),
            staged: BTreeMap::new(),
            ops: BTreeMap::new(),
            tasks: BTreeMap::new(),
            inspects: Vec::new(),
            late_tables: std::collections::BTreeSet::new(),
            next_inspect: 1,
            control_timeout: self.control_timeout,
            clock: self.clock,
            max_frame_bytes: self.max_frame_bytes,
            handovers: Vec::new(),
            zygote: zygote.map(Arc::new),
            spawners: Vec::new(),
            spawned: Arc::new(Mutex::new(VecDeque::new())),
            starting: BTreeMap::new(),
            fence_reasons: BTreeMap::new(),
            graveyard: Vec::new(),
        };
        io.drain(&mut core, &mut Context::default());
        core.io = Some(Box::new(io));
        drop(core);
        let shared = self.shared.clone();
        let handle = std::thread::Builder::new()
            .name("callreg-io".to_owned())
            .spawn(move || io_thread(shared))
            .map_err(|e| {
                start_error(ErrorCode::IO_FAILED, format!("spawning the IO thread: {e}"))
            })?;
        *self.io_thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        let report = StartReport { outcomes, failed };
        if report.outcomes.iter().all(|(_, o)| *o == TargetOutcome::Ok) {
            return Ok(report);
        }
        let failed: Vec<String> = report
            .outcomes
            .iter()
            .filter(|(_, o)| *o != TargetOutcome::Ok)
            .map(|(t, _)| t.0.to_string())
            .collect();
        let (subject, verb) = if failed.len() == 1 {
            ("target", "was")
        } else {
            ("targets", "were")
        };
        let (code, what) = if snapshot.is_empty() {
            (ErrorCode::TARGET_LOST, "did not start")
        } else {
            (
                ErrorCode::REGISTER_PARTIAL_FAILURE,
                "could not install the startup snapshot",
            )
        };
        let mut message = format!("{subject} {} {what} and {verb} stopped", failed.join(", "));
        for registration in &report.failed {
            message.push_str(&format!("; {}", registration_failure_text(registration)));
        }
        let mut error =
            Error::new(code, OperationKind::Start, message).with_namespace(Namespace::LocalPython);
        if let Some((target, _)) = report
            .outcomes
            .iter()
            .find(|(_, o)| *o != TargetOutcome::Ok)
        {
            error = error.with_target(*target);
        }
        Err(OperationError {
            error,
            outcomes: report.outcomes,
        })
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

fn completed<T>(value: Result<T, OperationError>) -> PendingOperation<T> {
    let (done, pending) = handoff::channel();
    done.complete(value);
    PendingOperation {
        awaited: Awaited::done(pending),
    }
}

/// Completes a request that no IO thread will ever see.
fn refuse(request: Request, before_start: bool) {
    let message = if before_start {
        "the Worker is not started"
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
        Request::Task { done, .. } => done.complete(Err(TaskError {
            error: lifecycle_error(OperationKind::Task, message),
            kind: String::new(),
            exception: Box::default(),
        })),
        Request::Inspect { done } => drop(done),
        #[cfg(feature = "failpoints")]
        Request::RawControl { .. } => {}
        Request::Close => {}
    }
}

/// Checks that the parent can hold its three descriptors per target (and the
/// IO thread's wake pipe) within the soft `RLIMIT_NOFILE`, counting the
/// descriptors already open.
///
/// # Errors
/// The message naming what is needed and what the limit allows.
fn check_descriptor_room(targets: u16, respawn: bool) -> Result<(), String> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the valid pointer given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0
        || limit.rlim_cur == libc::RLIM_INFINITY
    {
        return Ok(());
    }
    let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    let needed = 3 * u64::from(targets) + 4 + u64::from(respawn);
    // `rlim_t` is `u64` on Linux.
    let room = limit
        .rlim_cur
        .saturating_sub(u64::try_from(open).unwrap_or(u64::MAX));
    if needed > room {
        return Err(format!(
            "{targets} targets need {needed} more file descriptors in the parent (a control socket, a reply socket and a pidfd each{}), but the soft RLIMIT_NOFILE of {} leaves {room} ({open} open); raise it (ulimit -n) or use fewer targets",
            if respawn {
                ", two wake pipes and the replacements' template process"
            } else {
                ", and two wake pipes"
            },
            limit.rlim_cur
        ));
    }
    Ok(())
}

/// Ignores SIGPIPE if it has its default action (ending the process), so a
/// write to a dead target's pipe fails with `EPIPE` instead. Rust programs
/// and CPython already ignore it; this covers other embedders.
fn ignore_sigpipe() {
    // SAFETY: a null new action only queries the current one into `old`.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGPIPE, std::ptr::null(), &mut old) == 0
            && old.sa_sigaction == libc::SIG_DFL
        {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
    }
}

/// One live target as the IO thread sees it.
struct Link {
    process: TargetProcess,
    input: FrameBuffer,
    /// Encoded control bytes not yet written (the socket was full).
    outbox: Vec<u8>,
    /// Staged payloads whose descriptor goes with the outbox byte at
    /// their offset (a register frame's first byte), in offset order. One
    /// staged payload is shared by every target's frame (no descriptor is
    /// duplicated per target); each share is dropped once its frame's
    /// first byte is sent, which is before that target can answer, so the
    /// payload is still released when every target answered.
    outbox_fds: VecDeque<(usize, Arc<StagedPayload>)>,
    /// The slot's incarnation this process is (0: forked at start).
    incarnation: u32,
}

/// The snapshot entries targets reported they could not install.
type SnapshotFailures = Vec<(TargetId, Digest, Failure)>;

/// Waits until every target sent [`Frame::Ready`], exited or the deadline
/// passed; returns the links (`None` for a target that is not usable),
/// each target's outcome (`Ok` once ready, whatever its snapshot entries
/// did) and the snapshot entries each ready target failed.
fn wait_ready(
    processes: Vec<TargetProcess>,
    snapshot: &[(Digest, u32)],
    max_frame_bytes: usize,
    deadline: Instant,
) -> (
    Vec<Option<Link>>,
    Vec<(TargetId, TargetOutcome)>,
    SnapshotFailures,
) {
    let mut links: Vec<Option<Link>> = Vec::with_capacity(processes.len());
    for process in processes {
        match FrameBuffer::new(max_frame_bytes) {
            Ok(input) => links.push(Some(Link {
                process,
                input,
                outbox: Vec::new(),
                outbox_fds: VecDeque::new(),
                incarnation: 0,
            })),
            Err(_) => links.push(None),
        }
    }
    let mut outcomes: Vec<Option<TargetOutcome>> = links
        .iter()
        .map(|l| {
            l.is_none()
                .then(|| failed_outcome(ErrorCode::FRAME_INVALID, "no frame buffer".to_owned()))
        })
        .collect();
    let mut failures = Vec::new();
    let mut chunk = vec![0u8; READ_CHUNK_BYTES];
    while outcomes.iter().any(Option::is_none) {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        let waiting: Vec<usize> = (0..links.len())
            .filter(|i| outcomes[*i].is_none())
            .collect();
        // Each waiting target's reply socket, and its pidfd: a target that
        // ended while a process it forked holds its pipe is seen all the
        // same.
        let mut fds: Vec<PollFd<'_>> = Vec::new();
        let mut owners: Vec<(usize, bool)> = Vec::new();
        for index in &waiting {
            let Some(link) = links[*index].as_ref() else {
                continue;
            };
            fds.push(PollFd::new(link.process.reply(), PollFlags::POLLIN));
            owners.push((*index, false));
            if let Some(pidfd) = link.process.pidfd() {
                fds.push(PollFd::new(pidfd, PollFlags::POLLIN));
                owners.push((*index, true));
            }
        }
        let timeout = PollTimeout::try_from(deadline - now).unwrap_or(PollTimeout::MAX);
        match nix::poll::poll(&mut fds, timeout) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => break,
        }
        let mut ready: BTreeMap<usize, bool> = BTreeMap::new();
        for (fd, (index, is_pidfd)) in fds.iter().zip(owners) {
            if fd.revents().is_some_and(|r| !r.is_empty()) {
                *ready.entry(index).or_default() |= is_pidfd;
            }
        }
        drop(fds);
        for (index, ended) in ready {
            let Some(link) = links[index].as_mut() else {
                continue;
            };
            let closed = matches!(read_available(link, &mut chunk), ReadOutcome::Closed) || ended;
            outcomes[index] = match link.input.next_frame() {
                Ok(Some(Frame::Ready {
                    snapshot: entries, ..
                })) => {
                    let target = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
                    if let Some((digest, _)) = entries
                        .iter()
                        .find(|(d, _)| !snapshot.iter().any(|(s, _)| s == d))
                    {
                        Some(failed_outcome(
                            ErrorCode::FRAME_INVALID,
                            format!("it reported {digest}, which is not in the startup snapshot"),
                        ))
                    } else {
                        failures.extend(entries.into_iter().filter_map(|(digest, result)| {
                            result
                                .err()
                                .map(|e| (target, digest, Failure::new(e.code, e.message)))
                        }));
                        Some(TargetOutcome::Ok)
                    }
                }
                Ok(Some(other)) => Some(failed_outcome(
                    ErrorCode::FRAME_INVALID,
                    format!("sent a {:?} frame before it was ready", other.kind()),
                )),
                Ok(None) if closed => Some(exited_outcome(link)),
                Ok(None) => None,
                Err(e) => Some(failed_outcome(ErrorCode::FRAME_INVALID, e.to_string())),
            };
        }
    }
    let outcomes = outcomes
        .into_iter()
        .enumerate()
        .map(|(i, o)| {
            (
                TargetId(u16::try_from(i).unwrap_or(u16::MAX)),
                o.unwrap_or(TargetOutcome::Fenced),
            )
        })
        .collect();
    (links, outcomes, failures)
}

fn failed_outcome(code: ErrorCode, message: String) -> TargetOutcome {
    TargetOutcome::Failed {
        failure: Failure::new(code, message),
    }
}

fn exited_outcome(link: &mut Link) -> TargetOutcome {
    let how = match link.process.reap(Duration::from_millis(100)) {
        Ok(exit) => exit.to_string(),
        Err(e) => e.to_string(),
    };
    failed_outcome(
        ErrorCode::TARGET_LOST,
        format!("the target {how} before it was ready"),
    )
}

enum ReadOutcome {
    Data,
    Nothing,
    Closed,
}

/// Reads everything available from a link's reply socket into its buffer.
fn read_available(link: &mut Link, chunk: &mut [u8]) -> ReadOutcome {
    let mut got = false;
    loop {
        match nix::unistd::read(link.process.reply().as_fd(), chunk) {
            Ok(0) => return ReadOutcome::Closed,
            Ok(n) => {
                link.input.extend(&chunk[..n]);
                got = true;
                // A short read emptied the pipe: asking again would only
                // return `EAGAIN` (one syscall per reply); later bytes make
                // the next `poll` report the pipe readable. Decode before
                // reading more: the buffer stays bounded.
                if n < chunk.len() || link.input.pending_bytes() > READ_CHUNK_BYTES * 4 {
                    return ReadOutcome::Data;
                }
            }
            Err(Errno::EINTR) => continue,
            Err(Errno::EAGAIN) => {
                return if got {
                    ReadOutcome::Data
                } else {
                    ReadOutcome::Nothing
                };
            }
            Err(_) => return ReadOutcome::Closed,
        }
    }
}

enum OpWaiter {
    Register(Completer<Result<Handle, OperationError>>),
    Unregister(Completer<Result<(), OperationError>>),
}

struct TaskWaiter {
    target: TargetId,
    digest: Digest,
    done: Completer<Result<Vec<u8>, TaskError>>,
}

struct InspectWaiter {
    seq: u64,
    /// When the targets still waited for are given up (`None` in the
    /// answer): the control timeout after the inspect was sent.
    deadline: Instant,
    waiting: Vec<TargetId>,
    tables: BTreeMap<TargetId, Option<TargetTable>>,
    done: Completer<Vec<(TargetId, Option<TargetTable>)>>,
}

/// A register's staged payload with the metadata JSON its control carries
/// (empty for none); dropping it unlinks the payload.
struct Staged {
    payload: Arc<StagedPayload>,
    metadata: String,
}

/// Checks that every hook hashid of `metadata` has a live handle in
/// `LOCAL_PYTHON` (a hook runs in the same namespace, resolved
/// by digest in each target), before a register of `digest` is broadcast.
///
/// # Errors
/// `METADATA_INVALID` naming the first hook that is not live.
fn check_hooks_live(
    machine: &Parent,
    digest: Digest,
    metadata: &CallableMetadata,
) -> Result<(), Error> {
    let hooks = metadata
        .call_before
        .iter()
        .map(|h| ("call_before", h))
        .chain(metadata.call_after.iter().map(|h| ("call_after", h)));
    for (index, (list, hook)) in hooks.enumerate() {
        let hook_digest = hook.hashid.0;
        if !machine.is_live(hook_digest, Namespace::LocalPython) {
            let position = if list == "call_before" {
                index
            } else {
                index - metadata.call_before.len()
            };
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
    Ok(())
}

/// Data a request brings for the effects it causes.
#[derive(Default)]
struct Context {
    staged: Option<(Digest, Staged)>,
    task_input: Option<(TaskEncoding, Vec<u8>)>,
}

/// The IO state: what the IO thread and the leading caller drive, in turn,
/// under the state lock (`Core::io`).
struct IoLoop {
    links: Vec<Option<Link>>,
    /// The read end of the IO thread's wake pipe.
    wake: Arc<TrackedFd>,
    /// The leader's wake pipe: written when a result is decided by another
    /// thread while a caller leads, or at close.
    leader_wake: Arc<TrackedFd>,
    leader_wake_write: TrackedFd,
    /// Who reads the reply sockets ([`super::lead`]).
    watch: Watch,
    /// Whether a result was decided since the last [`IoLoop::leave`] (a
    /// leader waiting for it must be woken).
    completed: bool,
    /// The buffer reply sockets are read into.
    chunk: Vec<u8>,
    staged: BTreeMap<StagingId, Staged>,
    ops: BTreeMap<OpId, OpWaiter>,
    tasks: BTreeMap<u64, TaskWaiter>,
    inspects: Vec<InspectWaiter>,
    /// Inspections a target did not answer before their deadline, by seq
    /// and target: its table, if it comes, is dropped (it is not out of
    /// protocol).
    late_tables: std::collections::BTreeSet<(u64, TargetId)>,
    next_inspect: u64,
    control_timeout: Duration,
    clock: Instant,
    max_frame_bytes: usize,
    /// Completions decided under the state lock, handed to their callers
    /// once it is released: a caller woken while the IO thread still held
    /// the lock would block on it at once (one more sleep and wake-up).
    handovers: Vec<Handover>,
    /// The template process replacements are forked from (`None` with
    /// replacements off).
    zygote: Option<Arc<Zygote>>,
    /// The threads asking the template for replacements (a spawn waits
    /// for the template's answer; the IO thread never does).
    spawners: Vec<JoinHandle<()>>,
    /// Replacements the template forked (or failed to) on a spawning
    /// thread, for the IO thread to link; spawning threads never take the
    /// state lock (a close joins them while holding it).
    spawned: Arc<Mutex<VecDeque<Spawned>>>,
    /// Replacements started and not yet ready, by index: the incarnation
    /// and the time by which its ready report must come.
    starting: BTreeMap<usize, (u32, Instant)>,
    /// Why the machine will fence a target next (a failed join), if not
    /// for a deadline.
    fence_reasons: BTreeMap<TargetId, String>,
    /// Kept envelopes no registration needs any more, dropped after the
    /// completions are handed over (freeing a large one takes time no
    /// caller should wait for).
    graveyard: Vec<Kept>,
}

impl Drop for IoLoop {
    fn drop(&mut self) {
        self.hand_over();
    }
}

/// What a polled descriptor belongs to: the wake pipe, or a link by index
/// and process id (a link replaced earlier in the same turn is not the one
/// that was polled: its events are dropped).
#[derive(Clone, Copy)]
enum Ready {
    Wake,
    Reply(usize, i32),
    Control(usize, i32),
    Ended(usize, i32),
}

impl IoLoop {
    fn now(&self) -> Time {
        now_since(self.clock)
    }

    /// Queues `value` for `done`'s caller; see [`IoLoop::hand_over`].
    fn defer<T: Send + 'static>(&mut self, done: Completer<T>, value: T) {
        self.completed = true;
        self.handovers.push(Box::new(move || done.complete(value)));
    }

    /// Completes the queued operations; called without the state lock.
    fn hand_over(&mut self) {
        for handover in self.handovers.drain(..) {
            handover();
        }
    }

    /// Every live link: (index, pid).
    fn live(&self) -> Vec<(usize, i32)> {
        self.links
            .iter()
            .enumerate()
            .filter_map(|(index, link)| {
                link.as_ref()
                    .map(|link| (index, link.process.pid().as_raw()))
            })
            .collect()
    }

    /// The process id of the link at `index`, if live.
    fn pid_at(&self, index: usize) -> Option<i32> {
        self.links
            .get(index)
            .and_then(Option::as_ref)
            .map(|link| link.process.pid().as_raw())
    }

    /// Whether any target owes a reply: a task's result, a control's
    /// answer (every operation in flight has a deadline), an inspection's
    /// table or a replacement's ready report.
    fn expecting(&self, core: &Core) -> bool {
        !self.tasks.is_empty()
            || !self.inspects.is_empty()
            || !self.starting.is_empty()
            || core.machine.poll_timeout().is_some()
    }

    /// The earliest deadline: the machine's, an inspection's or a starting
    /// replacement's.
    fn next_deadline(&self, core: &Core) -> Option<Instant> {
        let machine = core
            .machine
            .poll_timeout()
            .map(|deadline| self.clock + Duration::from_micros(deadline.0));
        machine
            .into_iter()
            .chain(self.inspects.iter().map(|w| w.deadline))
            .chain(self.starting.values().map(|(_, deadline)| *deadline))
            .min()
    }

    /// Links with control bytes not yet written: (index, pid).
    fn unsent(&self) -> Vec<(usize, i32)> {
        self.links
            .iter()
            .enumerate()
            .filter_map(|(index, link)| match link {
                Some(link) if !link.outbox.is_empty() => Some((index, link.process.pid().as_raw())),
                _ => None,
            })
            .collect()
    }

    /// What a thread other than the IO thread does before it releases the
    /// state lock ([`super::lead`]): wakes the IO thread if what it leaves
    /// needs it (unless `settle` is false: the caller leads next and
    /// settles then), and returns what to do once the lock is released
    /// ([`Shared::finish`]).
    fn leave(&mut self, core: &Core, settle: bool, leader: bool) -> Leaving {
        // Small payloads are freed by this thread once its results are
        // handed over (cheaper than waking the IO thread for them); large
        // ones by the IO thread.
        let (freed, large): (Vec<Kept>, Vec<Kept>) = std::mem::take(&mut self.graveyard)
            .into_iter()
            .partition(|kept| kept.len() <= INLINE_FREE_BYTES);
        self.graveyard = large;
        if settle {
            let live = self.live();
            let unsent = self.unsent();
            let left = Left {
                live: &live,
                expecting: self.expecting(core),
                unsent: &unsent,
                deadline: self.next_deadline(core),
                chores: !self.graveyard.is_empty(),
            };
            if self.watch.io_must_wake(left) {
                io_wake(core);
            }
        }
        Leaving {
            handovers: std::mem::take(&mut self.handovers),
            freed,
            recheck: std::mem::take(&mut self.completed) && !leader,
        }
    }

    /// Handles every deadline that passed: the machine's, the
    /// inspections', the starting replacements'.
    fn handle_deadlines(&mut self, core: &mut Core) {
        let now = self.now();
        if core
            .machine
            .poll_timeout()
            .is_some_and(|deadline| deadline <= now)
        {
            core.machine.handle_timeout(now);
            self.drain(core, &mut Context::default());
        }
        self.expire_inspects();
        self.expire_starting(core);
    }

    /// Reads what the pipes `events` reported ready hold, and handles the
    /// ends they report; a link lost and maybe replaced (§2.9) by an
    /// event handled before is not the one that was polled: its events
    /// are dropped.
    fn handle_events(&mut self, core: &mut Core, events: Vec<(Ready, PollFlags)>) {
        for (what, event) in events {
            if event.is_empty() {
                continue;
            }
            let polled_link = match what {
                Ready::Wake => None,
                Ready::Reply(index, pid)
                | Ready::Control(index, pid)
                | Ready::Ended(index, pid) => Some((index, pid)),
            };
            if let Some((index, pid)) = polled_link {
                if self.pid_at(index) != Some(pid) {
                    continue;
                }
            }
            match what {
                Ready::Wake => {
                    // Until a short read: the pipe is then empty.
                    let mut sink = [0u8; 256];
                    while matches!(nix::unistd::read(self.wake.as_fd(), &mut sink), Ok(n) if n == sink.len())
                    {
                    }
                }
                Ready::Reply(index, _) => {
                    // A hung-up pipe is read to its end in this turn: a
                    // completion decided now must not be handed over
                    // while the target that died is still counted live.
                    let hung_up = event.intersects(PollFlags::POLLHUP | PollFlags::POLLERR);
                    self.read_replies(core, index, hung_up)
                }
                Ready::Control(index, _) => self.flush(core, index),
                Ready::Ended(index, _) => {
                    // Its last replies first (a reply socket that also
                    // closed was handled just before, as `Reply`).
                    self.read_replies(core, index, true);
                    let target = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
                    self.lose(core, target, "its process ended");
                }
            }
        }
    }

    /// Gives one request to the machine, then drains its effects.
    fn request(&mut self, core: &mut Core, request: Request) {
        let now = self.now();
        let mut context = Context::default();
        match request {
            Request::Register {
                digest,
                staged,
                metadata,
                done,
            } => {
                // Checked here, in request order: an unregister of a hook
                // queued before this register has taken effect.
                let checked = match &metadata {
                    Some(metadata) => check_hooks_live(&core.machine, digest, metadata),
                    None => Ok(()),
                };
                let identity = metadata.as_deref().map(metadata_identity);
                match checked.and_then(|()| {
                    core.machine.register_with_metadata(
                        digest,
                        Namespace::LocalPython,
                        identity,
                        now,
                    )
                }) {
                    Ok(op) => {
                        self.ops.insert(op, OpWaiter::Register(done));
                        let metadata = metadata.map(|m| m.to_json()).unwrap_or_default();
                        context.staged = Some((
                            digest,
                            Staged {
                                payload: Arc::new(staged),
                                metadata,
                            },
                        ));
                    }
                    Err(error) => self.defer(done, Err(OperationError::new(error))),
                }
            }
            Request::Unregister { handle, done } => match core.machine.unregister(&handle, now) {
                Ok(op) => {
                    self.ops.insert(op, OpWaiter::Unregister(done));
                }
                Err(error) => self.defer(done, Err(OperationError::new(error))),
            },
            Request::Task {
                handle,
                target,
                encoding,
                input,
                done,
            } => match core.machine.submit(&handle, target) {
                Ok(seq) => {
                    self.tasks.insert(
                        seq.0,
                        TaskWaiter {
                            target,
                            digest: handle.digest(),
                            done,
                        },
                    );
                    context.task_input = Some((encoding, input));
                }
                Err(error) => self.defer(
                    done,
                    Err(TaskError {
                        error,
                        kind: String::new(),
                        exception: Box::default(),
                    }),
                ),
            },
            Request::Inspect { done } => {
                let seq = self.next_inspect;
                self.next_inspect += 1;
                let mut waiting = Vec::new();
                for (index, link) in self.links.iter_mut().enumerate() {
                    let Some(link) = link else { continue };
                    let frame = Frame::Inspect { seq };
                    if frame
                        .encode_into(&mut link.outbox, self.max_frame_bytes)
                        .is_ok()
                    {
                        waiting.push(TargetId(u16::try_from(index).unwrap_or(u16::MAX)));
                    }
                }
                let mut waiter = InspectWaiter {
                    seq,
                    deadline: Instant::now() + self.control_timeout,
                    waiting: waiting.clone(),
                    tables: BTreeMap::new(),
                    done,
                };
                if waiting.is_empty() {
                    finish_inspect(&mut waiter);
                    waiter.done.complete(Vec::new());
                } else {
                    self.inspects.push(waiter);
                    for target in waiting {
                        self.flush(core, usize::from(target.0));
                    }
                }
            }
            #[cfg(feature = "failpoints")]
            Request::RawControl { target, bytes } => {
                if let Some(Some(link)) = self.links.get_mut(usize::from(target.0)) {
                    link.outbox.extend_from_slice(&bytes);
                    self.flush(core, usize::from(target.0));
                }
            }
            // `run` takes a close out of the queue itself (step 1).
            Request::Close => {}
        }
        self.drain(core, &mut context);
    }

    /// Drains the machine's effects and carries each out, in order.
    fn drain(&mut self, core: &mut Core, context: &mut Context) {
        while let Some(effect) = core.machine.poll_effect() {
            match effect {
                Effect::Restage { staging, digest } => self.restage(core, staging, digest),
                Effect::Spawn {
                    target,
                    incarnation,
                } => self.spawn(core, target, incarnation),
                Effect::Joined {
                    target,
                    incarnation,
                } => core.record(SlotEvent::Joined {
                    target,
                    incarnation,
                }),
                Effect::JoinFailed {
                    target,
                    incarnation,
                    failure,
                } => {
                    self.fence_reasons.insert(
                        target,
                        format!("incarnation {incarnation} failed to join ({failure})"),
                    );
                    core.record(SlotEvent::JoinFailed {
                        target,
                        incarnation,
                        failure,
                    });
                }
                Effect::Abandoned {
                    target,
                    failed_joins,
                } => {
                    let event = SlotEvent::Abandoned {
                        target,
                        failed_joins,
                    };
                    let loss = core.losses.entry(target).or_default();
                    if !loss.is_empty() {
                        loss.push_str("; ");
                    }
                    loss.push_str(&format!(
                        "given up after {failed_joins} replacements in a row were lost before they joined"
                    ));
                    core.record(event);
                }
                Effect::Stage { staging, digest } => {
                    let staged = match context.staged.take() {
                        Some((staged_digest, staged)) if staged_digest == digest => staged,
                        _ => {
                            let failure = Failure::new(
                                ErrorCode::IO_FAILED,
                                "no staged payload for this register",
                            );
                            let _ = core.machine.stage_failed(staging, failure);
                            continue;
                        }
                    };
                    if core.machine.keeps_envelope(digest) {
                        core.kept.entry(digest).or_insert_with(|| Kept {
                            bytes: None,
                            payload: Some(staged.payload.clone()),
                            metadata: staged.metadata.clone(),
                        });
                    }
                    self.staged.insert(staging, staged);
                    if let Err(message) = failpoints::hit(failpoints::PARENT_AFTER_STAGE) {
                        self.staged.remove(&staging);
                        let failure = Failure::new(ErrorCode::IO_FAILED, message);
                        let _ = core.machine.stage_failed(staging, failure);
                    }
                }
                Effect::Send { target, frame } => self.send(core, target, frame, context),
                Effect::ReleaseStaged { staging } => {
                    self.staged.remove(&staging);
                    self.prune_kept(core);
                }
                Effect::Fence { target } => {
                    let why = self
                        .fence_reasons
                        .remove(&target)
                        .unwrap_or_else(|| "it missed a deadline and was fenced".to_owned());
                    self.bury(core, target, Duration::ZERO, &why)
                }
                Effect::Completed {
                    op,
                    result,
                    outcomes,
                } => {
                    self.complete(op, result, outcomes, &core.losses);
                    self.prune_kept(core);
                }
            }
        }
    }

    /// Drops the kept envelopes no live registration (or one in flight)
    /// needs any more (`Parent::keeps_envelope`), after the handover.
    fn prune_kept(&mut self, core: &mut Core) {
        if core.kept.is_empty() {
            return;
        }
        let unneeded: Vec<Digest> = core
            .kept
            .keys()
            .filter(|d| !core.machine.keeps_envelope(**d))
            .copied()
            .collect();
        for digest in unneeded {
            if let Some(kept) = core.kept.remove(&digest) {
                self.graveyard.push(kept);
            }
        }
    }

    /// Stages the kept envelope of `digest` for a replay (§2.9): the sealed
    /// payload a register staged is sent again; a startup-snapshot
    /// envelope is staged from its bytes the first time.
    fn restage(&mut self, core: &mut Core, staging: StagingId, digest: Digest) {
        let staged = match core.kept.get_mut(&digest) {
            Some(kept) => match (&kept.payload, &kept.bytes) {
                (Some(payload), _) => Ok(payload.clone()),
                (None, Some(bytes)) => StagedPayload::create(bytes, HEADER_LEN..bytes.len())
                    .map(|(payload, _)| {
                        let payload = Arc::new(payload);
                        kept.payload = Some(payload.clone());
                        kept.bytes = None;
                        payload
                    })
                    .map_err(|e| Failure::new(e.code(), e.to_string())),
                (None, None) => Err(Failure::new(
                    ErrorCode::IO_FAILED,
                    format!("the envelope of {digest} was not kept"),
                )),
            }
            .map(|payload| Staged {
                payload,
                metadata: kept.metadata.clone(),
            }),
            None => Err(Failure::new(
                ErrorCode::IO_FAILED,
                format!("the envelope of {digest} was not kept"),
            )),
        };
        match staged {
            Ok(staged) => {
                self.staged.insert(staging, staged);
            }
            Err(failure) => {
                let _ = core.machine.stage_failed(staging, failure);
            }
        }
    }

    /// Asks the template for incarnation `incarnation` of `target`
    /// (§2.9), on a thread of its own: the answer comes back through
    /// `core.spawned` and the wake pipe ([`IoLoop::link_spawned`]).
    fn spawn(&mut self, core: &mut Core, target: TargetId, incarnation: u32) {
        self.spawners.retain(|spawner| !spawner.is_finished());
        let Some(zygote) = self.zygote.clone() else {
            return self.link_spawned(
                core,
                Spawned {
                    target,
                    incarnation,
                    result: Err("this Worker has no template process".to_owned()),
                },
            );
        };
        let queue = self.spawned.clone();
        // The spawning thread's own end of the wake pipe.
        let wake = core.wake.as_ref().map(|wake| {
            nix::fcntl::fcntl(&**wake, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(0))
                // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that
                // nothing else owns.
                .map(|fd| {
                    TrackedFd::new(unsafe {
                        <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd)
                    })
                })
        });
        let asked = std::thread::Builder::new()
            .name("callreg-spawn".to_owned())
            .spawn(move || {
                let result = zygote
                    .spawn(usize::from(target.0))
                    .map_err(|e| e.to_string());
                queue
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push_back(Spawned {
                        target,
                        incarnation,
                        result,
                    });
                if let Some(Ok(wake)) = &wake {
                    let _ = nix::unistd::write(wake, &[1]);
                }
            });
        match asked {
            Ok(spawner) => self.spawners.push(spawner),
            Err(e) => self.link_spawned(
                core,
                Spawned {
                    target,
                    incarnation,
                    result: Err(format!("starting a spawning thread: {e}")),
                },
            ),
        }
    }

    /// Links a replacement the template forked, or tells the machine it
    /// could not be started; one the machine no longer waits for (closed)
    /// is dropped, which kills and reaps it.
    fn link_spawned(&mut self, core: &mut Core, spawned: Spawned) {
        let Spawned {
            target,
            incarnation,
            result,
        } = spawned;
        let index = usize::from(target.0);
        let awaited = core.machine.lifecycle() == Lifecycle::Started
            && core.machine.slot_phase(target) == SlotPhase::Spawning
            && core.machine.incarnation(target) == incarnation;
        if !awaited {
            return;
        }
        let linked = result.and_then(|process| {
            FrameBuffer::new(self.max_frame_bytes)
                .map(|input| (process, input))
                .map_err(|e| e.to_string())
        });
        match linked {
            Ok((process, input)) => {
                let pid = process.pid().as_raw();
                if let Some(slot) = core.pids.get_mut(index) {
                    *slot = pid;
                }
                if let Some(slot) = self.links.get_mut(index) {
                    *slot = Some(Link {
                        process,
                        input,
                        outbox: Vec::new(),
                        outbox_fds: VecDeque::new(),
                        incarnation,
                    });
                }
                self.starting
                    .insert(index, (incarnation, Instant::now() + self.control_timeout));
                core.record(SlotEvent::Spawned {
                    target,
                    incarnation,
                    pid,
                });
            }
            Err(reason) => {
                core.record(SlotEvent::SpawnFailed {
                    target,
                    incarnation,
                    reason: reason.clone(),
                });
                let cause = format!("its replacement could not be started: {reason}");
                let _ = core.machine.target_died(target, &cause, self.now());
            }
        }
        self.drain(core, &mut Context::default());
    }

    /// Gives up every replacement that did not report ready in time.
    fn expire_starting(&mut self, core: &mut Core) {
        let now = Instant::now();
        let late: Vec<usize> = self
            .starting
            .iter()
            .filter(|(_, (_, deadline))| *deadline <= now)
            .map(|(index, _)| *index)
            .collect();
        for index in late {
            self.starting.remove(&index);
            let target = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
            self.lose(core, target, "its replacement was not ready in time");
        }
    }

    fn send(
        &mut self,
        core: &mut Core,
        target: TargetId,
        frame: ControlFrame,
        context: &mut Context,
    ) {
        let mut attached: Option<Arc<StagedPayload>> = None;
        let wire = match frame {
            ControlFrame::Register {
                seq,
                digest,
                staging,
            } => match self.staged.get(&staging) {
                Some(staged) => {
                    attached = Some(staged.payload.clone());
                    Frame::Register {
                        seq: seq.0,
                        digest,
                        staged_size: staged.payload.size(),
                        metadata: staged.metadata.clone(),
                    }
                }
                // The machine sends a register only while its payload is
                // staged; an unknown staging id means a lost target now.
                None => return self.lose(core, target, "no staged payload for its register"),
            },
            ControlFrame::Unregister { seq, digest } => Frame::Unregister { seq: seq.0, digest },
            ControlFrame::Task { seq, digest } => {
                let (encoding, input) = context
                    .task_input
                    .take()
                    .unwrap_or((TaskEncoding::Json, Vec::new()));
                Frame::Task {
                    seq: seq.0,
                    digest,
                    encoding,
                    input,
                }
            }
        };
        let index = usize::from(target.0);
        let Some(Some(link)) = self.links.get_mut(index) else {
            return;
        };
        let offset = link.outbox.len();
        if wire
            .encode_into(&mut link.outbox, self.max_frame_bytes)
            .is_err()
        {
            // Sizes were checked by the caller; a frame that still does not
            // fit is a broken link, not something to half-send.
            return self.lose(
                core,
                target,
                "a control frame exceeded the maximum frame size",
            );
        }
        if let Some(fd) = attached {
            link.outbox_fds.push_back((offset, fd));
        }
        self.flush(core, index);
    }

    /// Writes as much of a link's outbox as the socket takes now. Each
    /// `sendmsg` stops before the next frame that carries a descriptor, and
    /// a descriptor goes with the first byte of its frame, so a target
    /// receives each register's payload no later than the frame's first
    /// byte and in frame order.
    fn flush(&mut self, core: &mut Core, index: usize) {
        let Some(Some(link)) = self.links.get_mut(index) else {
            return;
        };
        let Some(control) = link.process.control() else {
            return;
        };
        while !link.outbox.is_empty() {
            let (fd, end) = match (link.outbox_fds.front(), link.outbox_fds.get(1)) {
                (Some((0, payload)), next) => (Some(payload.fd()), next.map(|(at, _)| *at)),
                (Some((at, _)), _) => (None, Some(*at)),
                (None, _) => (None, None),
            };
            let end = end.unwrap_or(link.outbox.len());
            let with_fd = fd.is_some();
            match process::send_control(control, &link.outbox[..end], fd) {
                Ok(n) => {
                    link.outbox.drain(..n);
                    if n > 0 && with_fd {
                        link.outbox_fds.pop_front();
                    }
                    for (at, _) in link.outbox_fds.iter_mut() {
                        *at -= n;
                    }
                }
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return,
                Err(_) => {
                    let target = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
                    return self.lose(core, target, "its control socket is closed");
                }
            }
        }
    }

    fn read_replies(&mut self, core: &mut Core, index: usize, hung_up: bool) {
        let target = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
        if self.chunk.len() != READ_CHUNK_BYTES {
            self.chunk = vec![0u8; READ_CHUNK_BYTES];
        }
        let closed = match self.links.get_mut(index) {
            Some(Some(link)) => loop {
                // Its writer is gone: what is left is bounded by the pipe's
                // capacity, then end of file.
                match read_available(link, &mut self.chunk) {
                    ReadOutcome::Closed => break true,
                    ReadOutcome::Data if hung_up => continue,
                    _ => break false,
                }
            },
            _ => return,
        };
        loop {
            let next = match self.links.get_mut(index) {
                Some(Some(link)) => link.input.next_frame(),
                _ => return,
            };
            match next {
                Ok(Some(frame)) => {
                    if let Err(why) = self.reply(core, target, frame) {
                        return self.lose(core, target, &why);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    return self.lose(core, target, &format!("it sent an invalid frame: {e}"))
                }
            }
        }
        if closed {
            self.lose(core, target, "its reply socket closed");
        }
    }

    /// One frame from `target`; `Err` for a frame that is out of protocol.
    fn reply(&mut self, core: &mut Core, target: TargetId, frame: Frame) -> Result<(), String> {
        match frame {
            Frame::Reply {
                seq,
                digest,
                result,
            } => {
                let reply = Reply {
                    seq: Seq(seq),
                    digest,
                    result: result.map_err(|e| Failure::new(e.code, e.message)),
                };
                let handled = core.machine.handle_reply(target, reply, self.now());
                self.drain(core, &mut Context::default());
                handled.map_err(|e| format!("it sent a reply out of protocol: {e}"))
            }
            Frame::TaskResult {
                seq,
                digest,
                result,
            } => {
                // Taken only when it is this target's: another's waiter
                // stays for its own target's result.
                let ours = self
                    .tasks
                    .get(&seq)
                    .is_some_and(|w| w.target == target && w.digest == digest);
                let waiter = if ours { self.tasks.remove(&seq) } else { None };
                let Some(waiter) = waiter else {
                    return Err(format!("it sent a result for unknown task seq {seq}"));
                };
                let result = result.map_err(|failure| TaskError {
                    error: Error::new(failure.code, OperationKind::Task, failure.message)
                        .with_target(target)
                        .with_namespace(Namespace::LocalPython)
                        .with_digest(digest)
                        .with_seq(Seq(seq)),
                    kind: failure.kind,
                    exception: failure.exception.into_boxed_slice(),
                });
                self.defer(waiter.done, result);
                Ok(())
            }
            Frame::Table {
                seq,
                tombstones,
                entries,
            } => {
                let Some(position) = self
                    .inspects
                    .iter()
                    .position(|w| w.seq == seq && w.waiting.contains(&target))
                else {
                    if self.late_tables.remove(&(seq, target)) {
                        return Ok(());
                    }
                    return Err(format!("it sent a table for unknown inspect seq {seq}"));
                };
                let incarnation = self
                    .links
                    .get(usize::from(target.0))
                    .and_then(Option::as_ref)
                    .map_or(0, |link| link.incarnation);
                let waiter = &mut self.inspects[position];
                waiter.waiting.retain(|t| *t != target);
                let installed = entries
                    .into_iter()
                    .map(|e| (e.digest, e.refcount))
                    .collect();
                waiter.tables.insert(
                    target,
                    Some(TargetTable {
                        installed,
                        tombstones,
                        incarnation,
                    }),
                );
                if waiter.waiting.is_empty() {
                    let mut waiter = self.inspects.remove(position);
                    let tables = finish_inspect(&mut waiter);
                    waiter.done.complete(tables);
                }
                Ok(())
            }
            Frame::Alive { seq } => {
                let handled = core.machine.handle_alive(target, Seq(seq), self.now());
                handled.map_err(|e| format!("it sent an alive report out of protocol: {e}"))
            }
            Frame::Ready { snapshot, .. } => {
                let index = usize::from(target.0);
                let Some((incarnation, _)) = self.starting.remove(&index) else {
                    return Err("it sent a second ready report".to_owned());
                };
                if !snapshot.is_empty() {
                    return Err(format!(
                        "its ready report names {} snapshot entries; a replacement starts with none",
                        snapshot.len()
                    ));
                }
                let spawned = core.machine.target_spawned(target, incarnation, self.now());
                self.drain(core, &mut Context::default());
                spawned.map_err(|e| format!("it reported ready out of protocol: {e}"))
            }
            other => Err(format!(
                "it sent a {:?} frame, which only a parent sends",
                other.kind()
            )),
        }
    }

    fn complete(
        &mut self,
        op: OpId,
        result: Result<Completion, Error>,
        outcomes: Vec<(TargetId, TargetOutcome)>,
        losses: &BTreeMap<TargetId, String>,
    ) {
        let Some(waiter) = self.ops.remove(&op) else {
            return;
        };
        match (waiter, result) {
            (OpWaiter::Register(done), Ok(Completion::Registered(handle))) => {
                if failpoints::hit(failpoints::PARENT_BEFORE_PUBLISH).is_err() {
                    // The machine already published; a refusal now would
                    // lie, so the injected fault is a crash.
                    // SAFETY: `_exit` ends the process without destructors.
                    unsafe { libc::_exit(failpoints::ABRUPT_EXIT_CODE) }
                }
                self.defer(done, Ok(handle));
            }
            (OpWaiter::Unregister(done), Ok(Completion::Unregistered(_))) => {
                self.defer(done, Ok(()))
            }
            (OpWaiter::Register(done), result) => {
                self.defer(done, Err(operation_error(result, outcomes, losses)))
            }
            (OpWaiter::Unregister(done), result) => {
                self.defer(done, Err(operation_error(result, outcomes, losses)))
            }
        }
    }

    /// Answers every inspection whose deadline passed: a target that has
    /// not sent its table is `None` in the answer (it stays live; its table
    /// is dropped if it comes later).
    fn expire_inspects(&mut self) {
        let now = Instant::now();
        let mut index = 0;
        while index < self.inspects.len() {
            if self.inspects[index].deadline > now {
                index += 1;
                continue;
            }
            let mut waiter = self.inspects.remove(index);
            for target in &waiter.waiting {
                self.late_tables.insert((waiter.seq, *target));
            }
            let tables = finish_inspect(&mut waiter);
            waiter.done.complete(tables);
        }
    }

    /// Kills and reaps a target, and fails what waits for it (not the
    /// machine's business: tasks and inspections).
    ///
    /// `grace`: how long a target that is ending on its own may take to
    /// exit before SIGKILL (its exit status then says why it ended).
    /// `why`: what the IO thread saw (kept for [`Worker::target_loss`]).
    fn bury(&mut self, core: &mut Core, target: TargetId, grace: Duration, why: &str) {
        let index = usize::from(target.0);
        let Some(mut link) = self.links.get_mut(index).and_then(Option::take) else {
            return;
        };
        self.completed = true;
        self.starting.remove(&index);
        if let Ok(exit) = link.process.reap(grace) {
            core.exits.insert(target, exit);
        }
        let how = core
            .exits
            .get(&target)
            .map_or_else(|| "could not be reaped".to_owned(), |e| e.to_string());
        let reason = format!("{why}; it {how}");
        if self.zygote.is_some() {
            core.record(SlotEvent::Lost {
                target,
                incarnation: link.incarnation,
                cause: reason.clone(),
            });
        }
        let who = match link.incarnation {
            0 => target.to_string(),
            n => format!("{target} (incarnation {n})"),
        };
        core.losses.insert(target, reason.clone());
        self.late_tables.retain(|(_, t)| *t != target);
        let lost: Vec<u64> = self
            .tasks
            .iter()
            .filter(|(_, w)| w.target == target)
            .map(|(seq, _)| *seq)
            .collect();
        for seq in lost {
            if let Some(waiter) = self.tasks.remove(&seq) {
                self.defer(
                    waiter.done,
                    Err(TaskError {
                        error: Error::new(
                            ErrorCode::TARGET_LOST,
                            OperationKind::Task,
                            format!("{who} was lost ({reason}) before the task's result arrived"),
                        )
                        .with_target(target)
                        .with_namespace(Namespace::LocalPython)
                        .with_digest(waiter.digest)
                        .with_seq(Seq(seq)),
                        kind: String::new(),
                        exception: Box::default(),
                    }),
                );
            }
        }
        let mut index = 0;
        while index < self.inspects.len() {
            let waiter = &mut self.inspects[index];
            if waiter.waiting.contains(&target) {
                waiter.waiting.retain(|t| *t != target);
                waiter.tables.insert(target, None);
            }
            if waiter.waiting.is_empty() {
                let mut waiter = self.inspects.remove(index);
                let tables = finish_inspect(&mut waiter);
                waiter.done.complete(tables);
            } else {
                index += 1;
            }
        }
    }

    /// A target died or broke the protocol: kill, reap, tell the machine.
    fn lose(&mut self, core: &mut Core, target: TargetId, why: &str) {
        if self
            .links
            .get(usize::from(target.0))
            .is_none_or(Option::is_none)
        {
            return;
        }

        self.bury(core, target, LOST_GRACE, why);
        let cause = core
            .losses
            .get(&target)
            .cloned()
            .unwrap_or_else(|| why.to_owned());
        let _ = core.machine.target_died(target, &cause, self.now());
        self.drain(core, &mut Context::default());
    }

    fn close(&mut self, core: &mut Core) {
        let _ = core.machine.close();
        self.drain(core, &mut Context::default());
        for link in self.links.iter_mut().flatten() {
            link.process.close_control();
        }
        let deadline = Instant::now() + CLOSE_GRACE;
        for (index, slot) in self.links.iter_mut().enumerate() {
            if let Some(mut link) = slot.take() {
                let left = deadline.saturating_duration_since(Instant::now());
                if let Ok(exit) = link.process.reap(left) {
                    core.exits
                        .insert(TargetId(u16::try_from(index).unwrap_or(u16::MAX)), exit);
                }
            }
        }
        // Every replacement is reaped: the template goes last, once no
        // spawn waits for it (a replacement forked meanwhile is dropped:
        // killed and reaped).
        for spawner in std::mem::take(&mut self.spawners) {
            let _ = spawner.join();
        }
        self.spawned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        if let Some(zygote) = self.zygote.take() {
            if let Ok(mut zygote) = Arc::try_unwrap(zygote) {
                let _ = zygote.close();
            }
        }
        self.starting.clear();
        core.kept.clear();
        for (seq, waiter) in std::mem::take(&mut self.tasks) {
            self.defer(
                waiter.done,
                Err(TaskError {
                    error: lifecycle_error(
                        OperationKind::Task,
                        "the Worker closed before the task's result arrived",
                    )
                    .with_target(waiter.target)
                    .with_digest(waiter.digest)
                    .with_seq(Seq(seq)),
                    kind: String::new(),
                    exception: Box::default(),
                }),
            );
        }
        for mut waiter in std::mem::take(&mut self.inspects) {
            let tables = finish_inspect(&mut waiter);
            waiter.done.complete(tables);
        }
        self.staged.clear();
        // Ops still waiting were completed by the machine's close; any left
        // are dropped here, which wakes their callers as abandoned.
        self.ops.clear();
        core.io_running = false;
        core.wake = None;
        for request in std::mem::take(&mut core.requests) {
            refuse(request, false);
        }
    }
}

fn finish_inspect(waiter: &mut InspectWaiter) -> Vec<(TargetId, Option<TargetTable>)> {
    for target in std::mem::take(&mut waiter.waiting) {
        waiter.tables.insert(target, None);
    }
    std::mem::take(&mut waiter.tables).into_iter().collect()
}

/// The error of a failed operation; its message says why each lost or
/// fenced target in its scope was given up and how it ended (as a task's
/// `TARGET_LOST` does), e.g. `target 1: lost (its reply socket closed; it was
/// killed by signal 9)`.
fn operation_error(
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
