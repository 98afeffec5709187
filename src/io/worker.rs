//! The [`Worker`]: the protocol's [`Parent`] machine run over real forked
//! targets, POSIX shm staging and pipes (specs/design.md §4.1, §5).
//!
//! # Threads
//!
//! * Caller threads (any number): validate an envelope and stage it (copy
//!   and hash in one pass), then queue a request and wait on its
//!   completion hand-off ([`super::handoff`]). Before start, registrations
//!   go straight to the machine's registry and the startup snapshot (with
//!   their callable metadata, which only the targets act on).
//! * One IO thread per started Worker: the only place the machine is
//!   driven after start and the only place its effects are carried out.
//!
//! # The IO thread's run rule
//!
//! Every input to the machine is followed by draining its effects
//! (`poll_effect` until `None`), each carried out in order, before the next
//! input (the same rule as `str0m`):
//!
//! 1. Take every queued request (register, unregister, task, inspect,
//!    close) and give each to the machine; drain effects after each.
//! 2. Read the clock; if the machine's `poll_timeout` has passed, call
//!    `handle_timeout(now)`; drain effects.
//! 3. Build the poll set: the wake pipe, every live target's reply pipe,
//!    and the control pipe of every target with unsent bytes; the poll
//!    timeout is the machine's next deadline (none: block).
//! 4. Release the state lock, hand the results decided since the last
//!    `poll` to their waiting callers (a caller woken under the lock would
//!    block on it at once), and `poll`.
//! 5. Take the state lock. For each target whose reply pipe is readable,
//!    read what is there, decode whole frames, and give each reply to the
//!    machine (`handle_reply`), draining effects after each; task results
//!    and tables go to their waiting callers. EOF, a hang-up, an
//!    undecodable or out-of-protocol frame: kill and reap the target, then
//!    `target_lost`; drain effects.
//! 6. Flush pending control bytes to writable targets (a full pipe never
//!    blocks the loop), then go to 1.
//!
//! Effects map to IO as follows: `Stage` binds the payload the caller
//! staged (then passes `parent.after_stage`; a failure there is reported
//! with `stage_failed`); `Send` encodes a wire frame into the target's
//! outbox (a register's carries its metadata as JSON); `ReleaseStaged`
//! unlinks the shm object; `Fence` kills and reaps the target; `Completed`
//! hands the result to the waiting caller (a published handle passes
//! `parent.before_publish` first).

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use serde::Serialize;

use super::failpoints;
use super::handoff::{self, Completer, Pending};
use super::process::{self, Exit, TargetProcess, ThreadPolicy};
use super::staging::{self, StagedPayload};
use super::target::{self, TargetSetup};
use crate::descriptor::{python_serialized_digest, Digest, PythonSerialized};
use crate::envelope::{Envelope, HEADER_LEN};
use crate::error::{Error, ErrorCode, OperationKind};
use crate::metadata::CallableMetadata;
use crate::protocol::{
    Completion, ControlFrame, Effect, Failure, Handle, Lifecycle, Namespace, OpId, OwnerToken,
    Parent, ParentConfig, Reply, Seq, StagingId, TargetId, TargetOutcome, Time,
    DEFAULT_SLOT_CAPACITY,
};
use crate::runtime::{Runtime, TaskEncoding};
use crate::wire::{Frame, FrameBuffer, DEFAULT_MAX_FRAME_BYTES, HEADER_BYTES, MIN_MAX_FRAME_BYTES};

/// The default control timeout: 30 seconds.
pub const DEFAULT_CONTROL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long [`Worker::close`] lets targets exit on their own (after their
/// control pipe closes) before killing them.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// How long a lost target (its pipe closed or broke the protocol) may take
/// to finish exiting before it is killed.
const LOST_GRACE: Duration = Duration::from_millis(50);

/// Bytes read from a reply pipe per `read` call.
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
            write!(f, "{sep}{target}: ")?;
            match outcome {
                TargetOutcome::Ok => f.write_str("ok")?,
                TargetOutcome::Failed { failure } => write!(f, "failed ({failure})")?,
                TargetOutcome::Lost => f.write_str("lost")?,
                TargetOutcome::TimedOut => f.write_str("timed out")?,
                TargetOutcome::Fenced => f.write_str("fenced")?,
                TargetOutcome::RolledBack => f.write_str("rolled back")?,
                TargetOutcome::CleanupUnconfirmed { failure } => {
                    write!(f, "cleanup unconfirmed ({failure})")?
                }
            }
        }
        Ok(())
    }
}

impl std::error::Error for OperationError {}

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
}

/// What [`Worker::start`] did at each target.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct StartReport {
    /// Every target with its outcome: `Ok` (live, snapshot installed),
    /// `Failed` (it reported a snapshot entry it could not install, or it
    /// exited before it was ready; it was stopped), `Fenced` (not ready
    /// before the control timeout; killed).
    pub outcomes: Vec<(TargetId, TargetOutcome)>,
}

/// One target's reported table ([`Worker::inspect`]): never a slot.
#[derive(Clone, PartialEq, Eq, Debug, Serialize)]
pub struct TargetTable {
    /// Installed digests with their refcounts, in digest order.
    pub installed: Vec<(Digest, u32)>,
    /// Slots tombstoned but still pinned by a run.
    pub tombstones: u32,
}

/// Builds a [`Worker`].
pub struct WorkerBuilder<R: Runtime> {
    runtime: Arc<R>,
    targets: u16,
    control_timeout: Duration,
    slot_capacity: u16,
    max_frame_bytes: usize,
    fence_on_timeout: bool,
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
            slot_capacity: DEFAULT_SLOT_CAPACITY,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            fence_on_timeout: true,
            thread_policy: ThreadPolicy::RefuseIfThreaded,
        }
    }

    /// Number of targets to fork (at least 1).
    pub fn targets(mut self, count: u16) -> Self {
        self.targets = count;
        self
    }

    /// How long a target has to answer a register, an unregister or a
    /// cleanup, and to be ready at start.
    pub fn control_timeout(mut self, timeout: Duration) -> Self {
        self.control_timeout = timeout;
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

    /// Forks even if the process already runs other threads (a thread that
    /// holds a lock at fork time leaves it held forever in the targets).
    pub fn accept_thread_risk(mut self) -> Self {
        self.thread_policy = ThreadPolicy::AcceptRisk;
        self
    }

    /// The Worker, not started: registrations go into the startup snapshot.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` for 0 targets, 0 slots, a zero control timeout
    /// or a maximum frame size below [`MIN_MAX_FRAME_BYTES`]; `IO_FAILED`
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
        if self.max_frame_bytes < MIN_MAX_FRAME_BYTES {
            return Err(invalid(format!(
                "the maximum frame size must be at least {MIN_MAX_FRAME_BYTES} bytes"
            )));
        }
        let owner = OwnerToken(random_token()?);
        let machine = Parent::new(ParentConfig {
            targets: self.targets,
            control_timeout: u64::try_from(self.control_timeout.as_micros()).unwrap_or(u64::MAX),
            fence_on_timeout: self.fence_on_timeout,
            owner,
            slot_capacity: self.slot_capacity,
        });
        Ok(Worker {
            runtime: self.runtime,
            targets: self.targets,
            control_timeout: self.control_timeout,
            slot_capacity: self.slot_capacity,
            max_frame_bytes: self.max_frame_bytes,
            thread_policy: self.thread_policy,
            clock: Instant::now(),
            shared: Arc::new(Shared {
                core: Mutex::new(Core {
                    machine,
                    envelopes: BTreeMap::new(),
                    metadata: BTreeMap::new(),
                    requests: VecDeque::new(),
                    io_running: false,
                    wake: None,
                    pids: Vec::new(),
                    exits: BTreeMap::new(),
                    losses: BTreeMap::new(),
                    next_staging: 1,
                }),
            }),
            io_thread: Mutex::new(None),
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

/// A register or unregister in flight ([`Worker::register_async`]).
pub struct PendingOperation<T> {
    pending: Pending<Result<T, OperationError>>,
}

impl<T> PendingOperation<T> {
    /// Waits for the operation to complete.
    ///
    /// # Errors
    /// The operation's [`OperationError`]; `LIFECYCLE_INVALID` if the
    /// Worker's IO thread ended without completing it.
    pub fn wait(self) -> Result<T, OperationError> {
        self.pending.wait().unwrap_or_else(|abandoned| {
            Err(OperationError::new(Error::new(
                ErrorCode::LIFECYCLE_INVALID,
                OperationKind::Close,
                abandoned.to_string(),
            )))
        })
    }

    /// Whether [`PendingOperation::wait`] would return at once.
    pub fn is_complete(&self) -> bool {
        self.pending.is_complete()
    }
}

/// A task in flight ([`Worker::submit_async`]).
pub struct PendingTask {
    pending: Pending<Result<Vec<u8>, TaskError>>,
}

impl PendingTask {
    /// Waits for the task's result (encoded as its input was).
    ///
    /// # Errors
    /// The task's [`TaskError`]; `LIFECYCLE_INVALID` if the Worker's IO
    /// thread ended without an answer.
    pub fn wait(self) -> Result<Vec<u8>, TaskError> {
        self.pending.wait().unwrap_or_else(|abandoned| {
            Err(TaskError {
                error: Error::new(
                    ErrorCode::LIFECYCLE_INVALID,
                    OperationKind::Task,
                    abandoned.to_string(),
                ),
                kind: String::new(),
            })
        })
    }

    /// Whether [`PendingTask::wait`] would return at once.
    pub fn is_complete(&self) -> bool {
        self.pending.is_complete()
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
    /// snapshot's payloads, inherited by the targets).
    envelopes: BTreeMap<Digest, Arc<Vec<u8>>>,
    /// Callable metadata of pre-start registrations, by digest: the first
    /// registration of a digest that brought metadata (targets install each
    /// digest once, with it).
    metadata: BTreeMap<Digest, CallableMetadata>,
    requests: VecDeque<Request>,
    io_running: bool,
    /// Write end of the IO thread's wake pipe.
    wake: Option<OwnedFd>,
    pids: Vec<i32>,
    /// How lost targets ended.
    exits: BTreeMap<TargetId, Exit>,
    /// Why lost targets were given up, with how they ended.
    losses: BTreeMap<TargetId, String>,
    /// Numbers staged payload names (`callreg-<pid>-<n>-<random>`).
    next_staging: u64,
}

struct Shared {
    core: Mutex<Core>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A parent worker with its forked targets (specs/design.md §4.1).
///
/// `Send + Sync`: share it (e.g. in an `Arc`) and call it from many threads
/// at once; several operations may be in flight. Closing is idempotent and
/// also happens on drop: targets are stopped and reaped, and every staged
/// payload is unlinked.
pub struct Worker<R: Runtime> {
    runtime: Arc<R>,
    targets: u16,
    control_timeout: Duration,
    slot_capacity: u16,
    max_frame_bytes: usize,
    thread_policy: ThreadPolicy,
    clock: Instant,
    shared: Arc<Shared>,
    io_thread: Mutex<Option<JoinHandle<()>>>,
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
    /// outcome when a target failed (rolled back).
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
    /// digest a target already holds only adds a reference, and the
    /// metadata of the registration that installed it stays in force.
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
        let parsed = Envelope::parse(envelope).map_err(Self::envelope_error)?;
        if let Some(metadata) = metadata {
            // Room for the register control's fixed fields and a staged
            // name (`/callreg-<pid>-<n>-<16 hex>`, well under 128 bytes).
            let json_bytes = metadata.to_json().len();
            if HEADER_BYTES + 8 + 32 + 4 + 128 + 8 + 4 + json_bytes > self.max_frame_bytes {
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
                    .register_before_start(digest, Namespace::LocalPython)
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
                let number = core.next_staging;
                core.next_staging += 1;
                drop(core);
                let hashed = HEADER_LEN..parsed.encoded_len();
                let (staged, payload_sha256) =
                    StagedPayload::create(number, &envelope[..parsed.encoded_len()], hashed)
                        .map_err(|e| {
                            OperationError::new(
                                Error::new(e.code(), OperationKind::Stage, e.to_string())
                                    .with_namespace(Namespace::LocalPython),
                            )
                        })?;
                let digest = PythonSerialized {
                    payload_format_version: parsed.version(),
                    serializer_id: parsed.serializer(),
                    payload_sha256: Digest(payload_sha256),
                }
                .digest();
                let (done, pending) = handoff::channel();
                self.push(Request::Register {
                    digest,
                    staged,
                    metadata: metadata.cloned().map(Box::new),
                    done,
                });
                Ok(PendingOperation { pending })
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
                self.push(Request::Unregister {
                    handle: *handle,
                    done,
                });
                Ok(PendingOperation { pending })
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

    /// Starts a task and returns at once with a pending task.
    pub fn submit_async(
        &self,
        handle: &Handle,
        target: TargetId,
        encoding: TaskEncoding,
        input: &[u8],
    ) -> PendingTask {
        let (done, pending) = handoff::channel();
        // Task frame: header, seq, digest, encoding, input length, input.
        let size = HEADER_BYTES + 8 + 32 + 1 + 4 + input.len();
        if size > self.max_frame_bytes {
            done.complete(Err(TaskError {
                error: Error::new(
                    ErrorCode::FRAME_INVALID,
                    OperationKind::Task,
                    format!(
                        "a task input of {} bytes makes a frame of {size} bytes, over the maximum of {}",
                        input.len(),
                        self.max_frame_bytes
                    ),
                )
                .with_target(target)
                .with_digest(handle.digest()),
                kind: String::new(),
            }));
        } else {
            self.push(Request::Task {
                handle: *handle,
                target,
                encoding,
                input: input.to_vec(),
                done,
            });
        }
        PendingTask { pending }
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

    /// The targets that are live (started and not lost), in order; empty
    /// before start and after close.
    pub fn live_targets(&self) -> Vec<TargetId> {
        let core = self.shared.lock();
        (0..self.targets)
            .map(TargetId)
            .filter(|t| core.machine.is_target_live(*t))
            .collect()
    }

    /// The process id of `target` (for supervision and tests), if started.
    pub fn target_pid(&self, target: TargetId) -> Option<i32> {
        self.shared.lock().pids.get(usize::from(target.0)).copied()
    }

    /// How a lost target ended, once reaped.
    pub fn target_exit(&self, target: TargetId) -> Option<Exit> {
        self.shared.lock().exits.get(&target).copied()
    }

    /// Why a target was given up after start (its pipe closed, it broke
    /// the protocol, it missed a deadline) and how it ended, e.g. `"its
    /// reply pipe closed; it exited with status 9"`.
    pub fn target_loss(&self, target: TargetId) -> Option<String> {
        self.shared.lock().losses.get(&target).cloned()
    }

    /// A copy of the parent machine's state (diagnostics and tests: the
    /// protocol's invariant predicates take it).
    pub fn parent_state(&self) -> Parent {
        self.shared.lock().machine.clone()
    }

    /// Asks every live target for its table and waits for the answers, in
    /// target order; `None` for a target lost before it answered.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless started.
    pub fn inspect(&self) -> Result<Vec<(TargetId, Option<TargetTable>)>, Error> {
        let (done, pending) = handoff::channel();
        self.push(Request::Inspect { done });
        pending
            .wait()
            .map_err(|abandoned| lifecycle_error(OperationKind::Resolve, &abandoned.to_string()))
    }

    /// Writes raw bytes into `target`'s control pipe (fault-injection tests:
    /// malformed or oversized frames).
    #[cfg(feature = "failpoints")]
    pub fn inject_control_bytes(&self, target: TargetId, bytes: Vec<u8>) {
        self.push(Request::RawControl { target, bytes });
    }

    /// Queues a request for the IO thread and wakes it; completes the
    /// request's waiter at once if no IO thread runs.
    fn push(&self, request: Request) {
        let mut core = self.shared.lock();
        if !core.io_running {
            let started = core.machine.lifecycle() == Lifecycle::New;
            drop(core);
            refuse(request, started);
            return;
        }
        core.requests.push_back(request);
        if let Some(wake) = &core.wake {
            // A full wake pipe already guarantees a wake-up.
            let _ = nix::unistd::write(wake, &[1]);
        }
    }

    /// Forks the targets, waits until each installed the startup snapshot,
    /// and starts the IO thread. Stale staged payloads of dead parents are
    /// swept first; with the `failpoints` feature, fail points are
    /// configured from `FAILPOINTS` (and per target, see
    /// [`super::failpoints`]).
    ///
    /// Call it from a thread that outlives the Worker: targets are killed
    /// when the thread that forked them ends (`PR_SET_PDEATHSIG`).
    ///
    /// A target that cannot install the snapshot (or is not ready in time)
    /// is stopped and reported; the Worker still starts with the others,
    /// and the returned error lists every target's outcome.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless new; `IO_FAILED` when the process already
    /// runs other threads (unless accepted in the builder), when `fork`,
    /// `pipe2` fails, or `FAILPOINTS` is malformed;
    /// `REGISTER_PARTIAL_FAILURE` (a startup snapshot was not installed
    /// everywhere) or `TARGET_LOST` (no snapshot; a target did not start),
    /// with every target's outcome.
    pub fn start(&self) -> Result<StartReport, OperationError> {
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
        let _ = staging::sweep_stale();
        // Only a build with fail points reads their variables: `FAILPOINTS`
        // may be meant for another crate of the embedding process.
        if cfg!(feature = "failpoints") {
            failpoints::configure_from_env("FAILPOINTS")
                .map_err(|m| start_error(ErrorCode::IO_FAILED, m))?;
        }
        ignore_sigpipe();
        let snapshot = core.machine.startup_snapshot();
        let setup = TargetSetup {
            runtime: self.runtime.clone(),
            snapshot: snapshot.clone(),
            envelopes: core.envelopes.clone(),
            metadata: core.metadata.clone(),
            slot_capacity: self.slot_capacity,
            max_frame_bytes: self.max_frame_bytes,
        };
        let processes = process::spawn_targets(
            usize::from(self.targets),
            self.thread_policy,
            |index| {
                if cfg!(feature = "failpoints")
                    && failpoints::configure_from_env(&failpoints::target_env_var(index)).is_err()
                {
                    // SAFETY: ends the freshly forked target before it runs.
                    unsafe { libc::_exit(target::START_EXIT_CODE) }
                }
            },
            |ends| target::run(ends, &setup),
        )
        .map_err(|e| start_error(ErrorCode::IO_FAILED, e.to_string()))?;
        drop(setup);
        core.machine.start().map_err(OperationError::new)?;
        core.pids = processes.iter().map(|p| p.pid().as_raw()).collect();
        let deadline = Instant::now() + self.control_timeout;
        let (mut links, outcomes) = wait_ready(processes, self.max_frame_bytes, deadline);
        let now = now_since(self.clock);
        for (target, outcome) in &outcomes {
            if *outcome != TargetOutcome::Ok {
                if let Some(mut link) = links[usize::from(target.0)].take() {
                    // A target that failed its snapshot exits on its own; one
                    // that was not ready in time is fenced at once.
                    let grace = if *outcome == TargetOutcome::Fenced {
                        Duration::ZERO
                    } else {
                        LOST_GRACE
                    };
                    if let Ok(exit) = link.process.reap(grace) {
                        core.exits.insert(*target, exit);
                    }
                }
                let _ = core.machine.target_lost(*target, now);
            }
        }
        while core.machine.poll_effect().is_some() {}
        let (wake_read, wake_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)
            .map_err(|e| start_error(ErrorCode::IO_FAILED, format!("pipe2: {e}")))?;
        core.wake = Some(wake_write);
        core.io_running = true;
        let io = IoLoop {
            shared: self.shared.clone(),
            links,
            wake: wake_read,
            staged: BTreeMap::new(),
            ops: BTreeMap::new(),
            tasks: BTreeMap::new(),
            inspects: Vec::new(),
            next_inspect: 1,
            clock: self.clock,
            max_frame_bytes: self.max_frame_bytes,
            handovers: Vec::new(),
        };
        drop(core);
        let handle = std::thread::Builder::new()
            .name("callreg-io".to_owned())
            .spawn(move || io.run())
            .map_err(|e| {
                start_error(ErrorCode::IO_FAILED, format!("spawning the IO thread: {e}"))
            })?;
        *self.io_thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        let report = StartReport { outcomes };
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
        let mut error = Error::new(
            code,
            OperationKind::Start,
            format!("{subject} {} {what} and {verb} stopped", failed.join(", ")),
        )
        .with_namespace(Namespace::LocalPython);
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
    /// unlinked. Idempotent.
    pub fn close(&self) {
        let mut io_thread = self.io_thread.lock().unwrap_or_else(|p| p.into_inner());
        {
            let mut core = self.shared.lock();
            if core.machine.lifecycle() == Lifecycle::New {
                let _ = core.machine.close();
                return;
            }
        }
        self.push(Request::Close);
        if let Some(handle) = io_thread.take() {
            let _ = handle.join();
        }
    }
}

impl<R: Runtime> Drop for Worker<R> {
    fn drop(&mut self) {
        self.close();
    }
}

fn completed<T>(value: Result<T, OperationError>) -> PendingOperation<T> {
    let (done, pending) = handoff::channel();
    done.complete(value);
    PendingOperation { pending }
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
        })),
        Request::Inspect { done } => drop(done),
        #[cfg(feature = "failpoints")]
        Request::RawControl { .. } => {}
        Request::Close => {}
    }
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
    /// Encoded control bytes not yet written (the pipe was full).
    outbox: Vec<u8>,
}

/// Waits until every target sent [`Frame::Ready`], exited or the deadline
/// passed; returns the links (`None` for a target that is not usable) and
/// each target's outcome.
fn wait_ready(
    processes: Vec<TargetProcess>,
    max_frame_bytes: usize,
    deadline: Instant,
) -> (Vec<Option<Link>>, Vec<(TargetId, TargetOutcome)>) {
    let mut links: Vec<Option<Link>> = Vec::with_capacity(processes.len());
    for process in processes {
        match FrameBuffer::new(max_frame_bytes) {
            Ok(input) => links.push(Some(Link {
                process,
                input,
                outbox: Vec::new(),
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
    let mut chunk = vec![0u8; READ_CHUNK_BYTES];
    while outcomes.iter().any(Option::is_none) {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        let waiting: Vec<usize> = (0..links.len())
            .filter(|i| outcomes[*i].is_none())
            .collect();
        let mut fds: Vec<PollFd<'_>> = waiting
            .iter()
            .filter_map(|i| links[*i].as_ref())
            .map(|l| PollFd::new(l.process.reply(), PollFlags::POLLIN))
            .collect();
        let timeout = PollTimeout::try_from(deadline - now).unwrap_or(PollTimeout::MAX);
        match nix::poll::poll(&mut fds, timeout) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => break,
        }
        let ready: Vec<bool> = fds
            .iter()
            .map(|fd| fd.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        for (index, is_ready) in waiting.into_iter().zip(ready) {
            if !is_ready {
                continue;
            }
            let Some(link) = links[index].as_mut() else {
                continue;
            };
            let closed = matches!(read_available(link, &mut chunk), ReadOutcome::Closed);
            outcomes[index] = match link.input.next_frame() {
                Ok(Some(Frame::Ready { snapshot, .. })) => Some(ready_outcome(snapshot)),
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
    (links, outcomes)
}

fn failed_outcome(code: ErrorCode, message: String) -> TargetOutcome {
    TargetOutcome::Failed {
        failure: Failure::new(code, message),
    }
}

fn ready_outcome(snapshot: Vec<(Digest, Result<(), crate::wire::ReplyError>)>) -> TargetOutcome {
    let failures: Vec<_> = snapshot
        .into_iter()
        .filter_map(|(digest, result)| result.err().map(|e| (digest, e)))
        .collect();
    match failures.first() {
        None => TargetOutcome::Ok,
        Some((_, first)) => {
            // The outcome shows the first failure's code: repeat a code only
            // where it differs from that one.
            let text: Vec<String> = failures
                .iter()
                .map(|(digest, e)| {
                    if e.code == first.code {
                        format!("{digest}: {}", e.message)
                    } else {
                        format!("{digest}: {}: {}", e.code, e.message)
                    }
                })
                .collect();
            failed_outcome(first.code, format!("startup snapshot: {}", text.join("; ")))
        }
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

/// Reads everything available from a link's reply pipe into its buffer.
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
    waiting: Vec<TargetId>,
    tables: BTreeMap<TargetId, Option<TargetTable>>,
    done: Completer<Vec<(TargetId, Option<TargetTable>)>>,
}

/// A register's staged payload with the metadata JSON its control carries
/// (empty for none); dropping it unlinks the payload.
struct Staged {
    payload: StagedPayload,
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

/// The IO thread.
struct IoLoop {
    shared: Arc<Shared>,
    links: Vec<Option<Link>>,
    wake: OwnedFd,
    staged: BTreeMap<StagingId, Staged>,
    ops: BTreeMap<OpId, OpWaiter>,
    tasks: BTreeMap<u64, TaskWaiter>,
    inspects: Vec<InspectWaiter>,
    next_inspect: u64,
    clock: Instant,
    max_frame_bytes: usize,
    /// Completions decided under the state lock, handed to their callers
    /// once it is released: a caller woken while the IO thread still held
    /// the lock would block on it at once (one more sleep and wake-up).
    handovers: Vec<Box<dyn FnOnce() + Send>>,
}

impl Drop for IoLoop {
    fn drop(&mut self) {
        self.hand_over();
    }
}

enum Ready {
    Wake,
    Reply(usize),
    Control(usize),
}

impl IoLoop {
    fn now(&self) -> Time {
        now_since(self.clock)
    }

    /// Queues `value` for `done`'s caller; see [`IoLoop::hand_over`].
    fn defer<T: Send + 'static>(&mut self, done: Completer<T>, value: T) {
        self.handovers.push(Box::new(move || done.complete(value)));
    }

    /// Completes the queued operations; called without the state lock.
    fn hand_over(&mut self) {
        for handover in self.handovers.drain(..) {
            handover();
        }
    }

    fn run(mut self) {
        let shared = self.shared.clone();
        let mut chunk = vec![0u8; READ_CHUNK_BYTES];
        loop {
            let mut core = shared.lock();
            // Step 1: requests.
            let mut closing = false;
            while let Some(request) = core.requests.pop_front() {
                if matches!(request, Request::Close) {
                    closing = true;
                    continue;
                }
                self.request(&mut core, request);
            }
            if closing {
                self.close(&mut core);
                return;
            }
            // Step 2: deadlines.
            let now = self.now();
            if core
                .machine
                .poll_timeout()
                .is_some_and(|deadline| deadline <= now)
            {
                core.machine.handle_timeout(now);
                self.drain(&mut core, &mut Context::default());
            }
            // Step 3: poll set and timeout.
            let timeout = match core.machine.poll_timeout() {
                None => PollTimeout::NONE,
                Some(deadline) => {
                    let micros = deadline.0.saturating_sub(self.now().0);
                    PollTimeout::try_from(micros.div_ceil(1000)).unwrap_or(PollTimeout::MAX)
                }
            };
            let mut watched = vec![Ready::Wake];
            let mut fds = vec![PollFd::new(self.wake.as_fd(), PollFlags::POLLIN)];
            for (index, link) in self.links.iter().enumerate() {
                let Some(link) = link else { continue };
                fds.push(PollFd::new(link.process.reply(), PollFlags::POLLIN));
                watched.push(Ready::Reply(index));
                if let (false, Some(control)) = (link.outbox.is_empty(), link.process.control()) {
                    fds.push(PollFd::new(control, PollFlags::POLLOUT));
                    watched.push(Ready::Control(index));
                }
            }
            // Step 4: wait without the lock.
            let handovers = std::mem::take(&mut self.handovers);
            drop(core);
            handovers.into_iter().for_each(|handover| handover());
            let polled = nix::poll::poll(&mut fds, timeout);
            let events: Vec<bool> = fds
                .iter()
                .map(|fd| fd.revents().is_some_and(|r| !r.is_empty()))
                .collect();
            drop(fds);
            if let Err(errno) = polled {
                if errno != Errno::EINTR {
                    // Unrecoverable: fail everything rather than spin.
                    let mut core = shared.lock();
                    self.close(&mut core);
                    return;
                }
                continue;
            }
            // Steps 5 and 6: replies, losses, flushes.
            let mut core = shared.lock();
            for (what, event) in watched.into_iter().zip(events) {
                if !event {
                    continue;
                }
                match what {
                    Ready::Wake => {
                        // Until a short read: the pipe is then empty.
                        let mut sink = [0u8; 256];
                        while matches!(nix::unistd::read(self.wake.as_fd(), &mut sink), Ok(n) if n == sink.len())
                        {
                        }
                    }
                    Ready::Reply(index) => self.read_replies(&mut core, index, &mut chunk),
                    Ready::Control(index) => self.flush(&mut core, index),
                }
            }
            // Completions decided here are handed over at step 4 of the
            // next turn, after its lock is released, not now: a caller woken
            // now would find the lock taken again for steps 1 to 3.
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
                match checked
                    .and_then(|()| core.machine.register(digest, Namespace::LocalPython, now))
                {
                    Ok(op) => {
                        self.ops.insert(op, OpWaiter::Register(done));
                        let metadata = metadata.map(|m| m.to_json()).unwrap_or_default();
                        context.staged = Some((
                            digest,
                            Staged {
                                payload: staged,
                                metadata,
                            },
                        ));
                    }
                    Err(error) => done.complete(Err(OperationError::new(error))),
                }
            }
            Request::Unregister { handle, done } => match core.machine.unregister(&handle, now) {
                Ok(op) => {
                    self.ops.insert(op, OpWaiter::Unregister(done));
                }
                Err(error) => done.complete(Err(OperationError::new(error))),
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
                Err(error) => done.complete(Err(TaskError {
                    error,
                    kind: String::new(),
                })),
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
                }
                Effect::Fence { target } => self.bury(
                    core,
                    target,
                    Duration::ZERO,
                    "it missed a deadline and was fenced",
                ),
                Effect::Completed {
                    op,
                    result,
                    outcomes,
                } => self.complete(op, result, outcomes),
            }
        }
    }

    fn send(
        &mut self,
        core: &mut Core,
        target: TargetId,
        frame: ControlFrame,
        context: &mut Context,
    ) {
        let wire = match frame {
            ControlFrame::Register {
                seq,
                digest,
                staging,
            } => match self.staged.get(&staging) {
                Some(staged) => Frame::Register {
                    seq: seq.0,
                    digest,
                    staged_name: staged.payload.name().to_owned(),
                    staged_size: staged.payload.size(),
                    metadata: staged.metadata.clone(),
                },
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
        self.flush(core, index);
    }

    /// Writes as much of a link's outbox as the pipe takes now.
    fn flush(&mut self, core: &mut Core, index: usize) {
        let Some(Some(link)) = self.links.get_mut(index) else {
            return;
        };
        let Some(control) = link.process.control() else {
            return;
        };
        while !link.outbox.is_empty() {
            match nix::unistd::write(control, &link.outbox) {
                Ok(n) => {
                    link.outbox.drain(..n);
                }
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return,
                Err(_) => {
                    let target = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
                    return self.lose(core, target, "its control pipe is closed");
                }
            }
        }
    }

    fn read_replies(&mut self, core: &mut Core, index: usize, chunk: &mut [u8]) {
        let target = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
        let closed = match self.links.get_mut(index) {
            Some(Some(link)) => matches!(read_available(link, chunk), ReadOutcome::Closed),
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
            self.lose(core, target, "its reply pipe closed");
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
                let waiter = self
                    .tasks
                    .remove(&seq)
                    .filter(|w| w.target == target && w.digest == digest);
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
                    return Err(format!("it sent a table for unknown inspect seq {seq}"));
                };
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
                    }),
                );
                if waiter.waiting.is_empty() {
                    let mut waiter = self.inspects.remove(position);
                    let tables = finish_inspect(&mut waiter);
                    waiter.done.complete(tables);
                }
                Ok(())
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
                self.defer(done, Err(operation_error(result, outcomes)))
            }
            (OpWaiter::Unregister(done), result) => {
                self.defer(done, Err(operation_error(result, outcomes)))
            }
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
        if let Ok(exit) = link.process.reap(grace) {
            core.exits.insert(target, exit);
        }
        let how = core
            .exits
            .get(&target)
            .map_or_else(|| "could not be reaped".to_owned(), |e| e.to_string());
        let reason = format!("{why}; it {how}");
        core.losses.insert(target, reason.clone());
        let lost: Vec<u64> = self
            .tasks
            .iter()
            .filter(|(_, w)| w.target == target)
            .map(|(seq, _)| *seq)
            .collect();
        for seq in lost {
            if let Some(waiter) = self.tasks.remove(&seq) {
                waiter.done.complete(Err(TaskError {
                    error: Error::new(
                        ErrorCode::TARGET_LOST,
                        OperationKind::Task,
                        format!("{target} was lost ({reason}) before the task's result arrived"),
                    )
                    .with_target(target)
                    .with_namespace(Namespace::LocalPython)
                    .with_digest(waiter.digest)
                    .with_seq(Seq(seq)),
                    kind: String::new(),
                }));
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
        let _ = core.machine.target_lost(target, self.now());
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
        for (seq, waiter) in std::mem::take(&mut self.tasks) {
            waiter.done.complete(Err(TaskError {
                error: lifecycle_error(
                    OperationKind::Task,
                    "the Worker closed before the task's result arrived",
                )
                .with_target(waiter.target)
                .with_digest(waiter.digest)
                .with_seq(Seq(seq)),
                kind: String::new(),
            }));
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

fn operation_error(
    result: Result<Completion, Error>,
    outcomes: Vec<(TargetId, TargetOutcome)>,
) -> OperationError {
    let error = match result {
        Err(error) => error,
        Ok(completion) => Error::new(
            ErrorCode::FRAME_INVALID,
            OperationKind::Reply,
            format!("the operation completed as {completion:?}, which does not match its kind"),
        ),
    };
    OperationError { error, outcomes }
}
