//! The target process: installs its startup snapshot, then serves control
//! frames on one thread and runs tasks on another (specs/design.md §4.2, §5).
//!
//! A reader thread, which never touches the runtime (no GIL), reads
//! frames from the control socket in order, reports every register and
//! unregister control [`Frame::Alive`] on receipt, and queues the frames
//! for the control thread; a heartbeat thread (no GIL either) reports
//! every control received and not yet answered alive again every
//! [`TargetSetup::heartbeat`], so a target that is busy (a slow unpickle,
//! controls queued behind it, a task holding the GIL) is never taken for
//! a silent one (`specs/protocol.md`, "Deadlines"). The control thread
//! takes the frames in order and drives the protocol's [`Target`] machine
//! (through the [`SlotTable`]);
//! it carries out the machine's effects: it checks the seals of each
//! staged payload received with a register, maps it read-only, verifies
//! its digest, installs it from that same mapping through the runtime (checks, then
//! deserialization), and writes replies. A task frame pins its slot in
//! frame order and is handed to the task thread, so a long task never
//! delays a register into a timeout. Where it is pinned: a task that finds
//! no frame queued for the control thread or being handled there
//! ([`ControlGate`]: the reader counts the frames it hands over, the control
//! thread counts them done) is pinned by the reader itself and goes
//! straight to the task thread, so a task round trip on an idle target
//! wakes two threads (reader, task thread) instead of three; pinning only
//! takes the slot table's lock, never the runtime's. Any other task, and
//! a task the reader could not start (it does not resolve, a hook does
//! not), is queued behind the frames before it, and the control thread
//! pins it (or fails it) in its turn (`specs/wire.md`).
//! Every thread writes whole frames to the reply socket under one lock.
//!
//! Callable metadata (`specs/metadata.md`): a register control
//! carries it as JSON; the target parses it and installs through
//! [`Runtime::install`], which makes the version, dependency and executor
//! checks before anything is deserialized. The hooks of the registration
//! that installed a digest are kept by digest; around each task of that
//! digest the task thread runs the `call_before` hooks, the task (with a
//! `retval_keyword` result merged into its JSON kwargs), then the
//! `call_after` hooks. The thread that pins the task resolves and pins
//! every hook with
//! the task, like any run, under target-local run seqs counted down from
//! `u64::MAX` (a parent's seqs count up from 1 and never reach them).
//!
//! The target ends (with `_exit`, from [`super::process`]) when the control
//! socket reports EOF (the parent closed it or died), when a frame cannot be
//! decoded or is out of protocol ([`FRAME_EXIT_CODE`]), or when the reply
//! pipe is gone ([`REPLY_EXIT_CODE`]). A process forked inside the target
//! by user code (during a deserialization or a task) ends with
//! [`super::process::FORKED_EXIT_CODE`] as soon as it is back in this
//! code: before it reads a control, reports an install or a task result,
//! or writes any reply.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use super::failpoints::{self, ABRUPT_EXIT_CODE};
use super::process::{exit_unless_target, receive_control, TargetEnds};
use super::slots::{ControlGate, Effects, SlotTable};
use super::staging::StagedView;
use crate::descriptor::{python_serialized_digest, Digest};
use crate::envelope::Envelope;
use crate::error::ErrorCode;
use crate::metadata::{merge_retval_keyword, CallableMetadata, HookCall};
use crate::protocol::{Failure, Reply, Seq, Slot, Target, TargetConfig, TargetEffect, TargetId};
use crate::runtime::{Runtime, RuntimeError, TaskEncoding};
use crate::wire::{Frame, FrameBuffer, ReplyError, TaskFailure, HEADER_BYTES};
use nix::errno::Errno;

/// Exit status: the runtime failed to start.
pub const START_EXIT_CODE: i32 = 103;
/// Exit status: the startup snapshot does not fit the target's slots
/// (after a [`Frame::Ready`] failing every entry). An entry that fails to
/// install does not end the target: it reports it and serves without it.
pub const SNAPSHOT_EXIT_CODE: i32 = 104;
/// Exit status: a control frame could not be decoded or was out of protocol.
pub const FRAME_EXIT_CODE: i32 = 105;
/// Exit status: a reply could not be written (the parent is gone).
pub const REPLY_EXIT_CODE: i32 = 106;

/// Bytes read from the control socket per `recvmsg` call.
const READ_CHUNK_BYTES: usize = 64 * 1024;

/// What a target inherits from the parent through `fork`.
pub struct TargetSetup<R: Runtime> {
    /// The runtime, started once in the target.
    pub runtime: Arc<R>,
    /// The startup snapshot: distinct digests with their refcounts, in
    /// digest order (as from the parent machine's `startup_snapshot`).
    pub snapshot: Vec<(Digest, u32)>,
    /// The envelope bytes of every snapshot digest (validated by the parent
    /// when it computed the digest).
    pub envelopes: BTreeMap<Digest, Arc<Vec<u8>>>,
    /// The callable metadata of snapshot digests registered with metadata,
    /// installed with them ([`Runtime::install`]).
    pub metadata: BTreeMap<Digest, CallableMetadata>,
    /// Slots per target.
    pub slot_capacity: u16,
    /// Maximum frame size in bytes, both directions.
    pub max_frame_bytes: usize,
    /// How often the heartbeat thread reports each control received and
    /// not yet answered alive ([`Frame::Alive`]); the parent uses a
    /// quarter of its control timeout.
    pub heartbeat: std::time::Duration,
}

/// Ends the target at once: a fault injected after a decision was made
/// (installed, or about to reply) cannot be turned into an error reply
/// without lying to the parent, so any `return(…)` there is a crash.
fn abrupt_exit() -> ! {
    // SAFETY: `_exit` ends the process without destructors: a crash.
    unsafe { libc::_exit(ABRUPT_EXIT_CODE) }
}

/// Writes whole frames to the reply socket, from either thread.
struct ReplyWriter {
    pipe: Mutex<File>,
    max_frame_bytes: usize,
}

impl ReplyWriter {
    /// Sends [`Frame::Alive`] for control `seq` (never delayed by the reply
    /// failpoint: it is not a reply). Ends the target if the pipe is gone.
    fn send_alive(&self, seq: u64) {
        exit_unless_target();
        let Ok(bytes) = (Frame::Alive { seq }).encode(self.max_frame_bytes) else {
            // SAFETY: see `abrupt_exit`; an 16-byte frame always fits.
            unsafe { libc::_exit(REPLY_EXIT_CODE) }
        };
        let mut pipe = self.pipe.lock().unwrap_or_else(|p| p.into_inner());
        if pipe.write_all(&bytes).is_err() {
            // SAFETY: see `abrupt_exit`; the parent is gone, nobody listens.
            unsafe { libc::_exit(REPLY_EXIT_CODE) }
        }
    }

    /// Sends `frame`, shortened to fit the maximum frame size if needed (a
    /// message is cut at a character boundary, an oversized task result is
    /// replaced by an error saying so). Ends the target if the pipe is gone.
    fn send(&self, frame: Frame) {
        // A process forked inside the target never writes a reply.
        exit_unless_target();
        if failpoints::hit(failpoints::TARGET_REPLY_DELAY).is_err() {
            abrupt_exit();
        }
        let bytes = match frame.encode(self.max_frame_bytes) {
            Ok(bytes) => bytes,
            Err(_) => match fit(frame, self.max_frame_bytes).encode(self.max_frame_bytes) {
                Ok(bytes) => bytes,
                // Unreachable for the frames a target sends: `fit` leaves
                // only fixed-size fields; end rather than send garbage.
                // SAFETY: see `abrupt_exit`.
                Err(_) => unsafe { libc::_exit(REPLY_EXIT_CODE) },
            },
        };
        let mut pipe = self.pipe.lock().unwrap_or_else(|p| p.into_inner());
        if pipe.write_all(&bytes).is_err() {
            // SAFETY: see `abrupt_exit`; the parent is gone, nobody listens.
            unsafe { libc::_exit(REPLY_EXIT_CODE) }
        }
    }
}

/// Room left for variable text in a frame of `max` bytes after `fixed`.
fn room(max: usize, fixed: usize) -> usize {
    max.saturating_sub(HEADER_BYTES + fixed)
}

fn truncate(text: &mut String, bytes: usize) {
    if text.len() > bytes {
        let mut end = bytes;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

/// Shrinks a reply or task result that exceeds the maximum frame size.
fn fit(frame: Frame, max: usize) -> Frame {
    // Fixed parts: seq 8 + digest 32 + status 2 + length prefixes.
    match frame {
        Frame::Reply {
            seq,
            digest,
            result: Err(mut error),
        } => {
            truncate(&mut error.message, room(max, 8 + 32 + 2 + 4));
            Frame::Reply {
                seq,
                digest,
                result: Err(error),
            }
        }
        Frame::TaskResult {
            seq,
            digest,
            result,
        } => {
            let mut failure = match result {
                Ok(output) => TaskFailure {
                    code: ErrorCode::TASK_FAILED,
                    kind: "ResultTooLarge".to_owned(),
                    message: format!(
                        "the task's result of {} bytes does not fit in a frame of at most {max} bytes (max_frame_bytes)",
                        output.len()
                    ),
                    exception: Vec::new(),
                },
                Err(failure) => failure,
            };
            // An oversized failure loses its serialized exception first
            // (the caller still gets the kind and message).
            failure.exception.clear();
            truncate(&mut failure.kind, 64);
            truncate(
                &mut failure.message,
                room(max, 8 + 32 + 2 + 4 + 4 + failure.kind.len()),
            );
            Frame::TaskResult {
                seq,
                digest,
                result: Err(failure),
            }
        }
        Frame::Ready { pid, snapshot } => Frame::Ready {
            pid,
            snapshot: snapshot
                .into_iter()
                .map(|(digest, result)| {
                    let result = result.map_err(|mut e| {
                        truncate(&mut e.message, 200);
                        e
                    });
                    (digest, result)
                })
                .collect(),
        },
        other => other,
    }
}

fn reply_error(failure: Failure) -> ReplyError {
    ReplyError {
        code: failure.code,
        message: failure.message,
    }
}

fn runtime_failure(error: RuntimeError) -> Failure {
    Failure::new(error.code, format!("{}: {}", error.kind, error.message))
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Installs `payload` with its registration's metadata through the
/// runtime ([`Runtime::install`]: checks first, then deserializes),
/// honouring the `target.deserialize` fail point; a panic in the runtime is
/// a failure.
fn install<R: Runtime>(
    runtime: &R,
    payload: &[u8],
    metadata: Option<&CallableMetadata>,
) -> Result<R::Callable, Failure> {
    if let Err(message) = failpoints::hit(failpoints::TARGET_DESERIALIZE) {
        return Err(Failure::new(ErrorCode::DESERIALIZE_FAILED, message));
    }
    let installed = catch_unwind(AssertUnwindSafe(|| runtime.install(payload, metadata)));
    // Deserializing ran user code, which may have forked: only the target
    // goes on.
    exit_unless_target();
    match installed {
        Ok(result) => result.map_err(runtime_failure),
        Err(panic) => Err(Failure::new(
            ErrorCode::DESERIALIZE_FAILED,
            format!(
                "the runtime panicked while deserializing: {}",
                panic_message(&*panic)
            ),
        )),
    }
}

/// Checks a staged payload's seals and size and maps it read-only
/// ([`StagedView::open`]), validates the envelope against the mapped size
/// and recomputes its digest over that mapping (`specs/staging.md`); the
/// same mapping is what the runtime later deserializes.
///
/// # Errors
/// `IO_FAILED` when no descriptor came with the register control; the
/// view's errors (`ENVELOPE_INVALID` for missing seals or another size);
/// the envelope's errors.
fn open_and_verify(payload: Option<OwnedFd>, size: u64) -> Result<(StagedView, Digest), Failure> {
    let payload = payload.ok_or_else(|| {
        Failure::new(
            ErrorCode::IO_FAILED,
            "no staged payload came with the register control",
        )
    })?;
    let view =
        StagedView::open(payload, size).map_err(|e| Failure::new(e.code(), e.to_string()))?;
    let digest = {
        let envelope =
            Envelope::parse(view.bytes()).map_err(|e| Failure::new(e.code(), e.message()))?;
        python_serialized_digest(&envelope)
    };
    Ok((view, digest))
}

/// The hooks of an installed digest (its registration's `call_before` and
/// `call_after`).
#[derive(Default)]
struct Hooks {
    before: Vec<HookCall>,
    after: Vec<HookCall>,
}

impl Hooks {
    fn of(metadata: Option<&CallableMetadata>) -> Option<Arc<Hooks>> {
        let metadata = metadata?;
        if metadata.call_before.is_empty() && metadata.call_after.is_empty() {
            return None;
        }
        Some(Arc::new(Hooks {
            before: metadata.call_before.clone(),
            after: metadata.call_after.clone(),
        }))
    }
}

/// A hook resolved and pinned for one run: the call, the run seq its pin
/// is held under, and the hook's callable.
struct PinnedHook<C> {
    call: HookCall,
    seq: Seq,
    callable: crate::sync::Arc<C>,
}

/// One task handed from the control thread to the task thread.
struct Run<C> {
    seq: u64,
    digest: Digest,
    encoding: TaskEncoding,
    input: Vec<u8>,
    callable: crate::sync::Arc<C>,
    before: Vec<PinnedHook<C>>,
    after: Vec<PinnedHook<C>>,
}

/// What pins a task's slot and hands the run to the task thread: used by
/// the control thread, and by the reader thread for a task that finds no
/// control queued or running ([`ControlGate`]). Pinning never takes the GIL:
/// it only clones callables' references and updates the machine.
struct Pinning<C> {
    table: Arc<SlotTable<C>>,
    runs: Arc<RunQueue<C>>,
    /// Hooks by installed digest, from the metadata of the registration
    /// that installed it (written by the control thread only).
    hooks: Mutex<BTreeMap<Digest, Arc<Hooks>>>,
    /// The next target-local run seq for a hook's pin (counts down).
    next_hook_seq: AtomicU64,
}

/// The runs handed to the task thread, in the order they were pinned.
/// The task thread sleeps on it only once it is empty, and a run is
/// followed by a wake-up only when the task thread sleeps there: no futex
/// call for a run that finds it busy, and no spinning or yielding before
/// it sleeps (a channel's receiver spins and yields first, which costs a
/// round trip CPU time and context switches when tasks come one at a
/// time). Never closed: the task thread runs until the process ends.
struct RunQueue<C> {
    state: Mutex<Queued<C>>,
    ready: Condvar,
}

struct Queued<C> {
    runs: VecDeque<Run<C>>,
    /// The task thread sleeps on `ready` (set and cleared by it, under
    /// the lock).
    sleeping: bool,
}

impl<C> RunQueue<C> {
    fn new() -> RunQueue<C> {
        RunQueue {
            state: Mutex::new(Queued {
                runs: VecDeque::new(),
                sleeping: false,
            }),
            ready: Condvar::new(),
        }
    }

    /// Queues `run`, waking the task thread if it sleeps.
    fn push(&self, run: Run<C>) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.runs.push_back(run);
        let wake = state.sleeping;
        drop(state);
        if wake {
            self.ready.notify_one();
        }
    }

    /// The next run, sleeping until there is one.
    fn pop(&self) -> Run<C> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(run) = state.runs.pop_front() {
                return run;
            }
            state.sleeping = true;
            state = self.ready.wait(state).unwrap_or_else(|p| p.into_inner());
            state.sleeping = false;
        }
    }
}

struct Control<'a, R: Runtime> {
    id: TargetId,
    runtime: &'a R,
    table: Arc<SlotTable<R::Callable>>,
    writer: Arc<ReplyWriter>,
    pinning: Arc<Pinning<R::Callable>>,
    /// Frames handed to this thread and not yet handled (the reader's
    /// [`ControlGate::hand`], this thread's [`ControlGate::done`]).
    idle: Arc<ControlGate>,
}

/// Runs a target until its control socket closes; returns its exit status.
///
/// Order: start the runtime ([`Runtime::start_target`] with this
/// target's id); install the startup snapshot (each entry from the
/// inherited envelope, with its metadata); send [`Frame::Ready`] with
/// every entry's outcome; then serve frames, holding the entries that
/// installed (`Target::with_snapshot_failures`: the parent unregisters a
/// failed entry's digest where it was installed, `specs/protocol.md`);
/// when serving ends, [`Runtime::stop`]. Exits with [`SNAPSHOT_EXIT_CODE`]
/// only when the snapshot does not fit the slots.
pub fn run<R: Runtime>(ends: TargetEnds, setup: &TargetSetup<R>) -> i32 {
    let TargetEnds {
        index,
        control,
        reply,
    } = ends;
    let writer = Arc::new(ReplyWriter {
        pipe: Mutex::new(File::from(reply)),
        max_frame_bytes: setup.max_frame_bytes,
    });
    let config = TargetConfig {
        id: TargetId(u16::try_from(index).unwrap_or(u16::MAX)),
        slot_capacity: setup.slot_capacity,
    };
    if let Err(error) = setup.runtime.start_target(config.id) {
        // The parent sees only the exit status: the reason goes to stderr,
        // in one write so that targets failing together do not interleave.
        let line = format!("callreg target {index}: the runtime did not start: {error}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        return START_EXIT_CODE;
    }
    let Some(table) = install_snapshot(config, setup, &writer) else {
        return SNAPSHOT_EXIT_CODE;
    };
    let table = Arc::new(table);
    let runs = Arc::new(RunQueue::new());
    {
        let table = table.clone();
        let writer = writer.clone();
        let runtime = setup.runtime.clone();
        let id = config.id;
        let queue = runs.clone();
        std::thread::spawn(move || run_tasks(&*runtime, id, &table, &writer, &queue));
    }
    let hooks = setup
        .metadata
        .iter()
        .filter_map(|(digest, metadata)| Hooks::of(Some(metadata)).map(|h| (*digest, h)))
        .collect();
    let pinning = Arc::new(Pinning {
        table: table.clone(),
        runs,
        hooks: Mutex::new(hooks),
        next_hook_seq: AtomicU64::new(u64::MAX),
    });
    let control_thread = Control {
        id: config.id,
        runtime: &*setup.runtime,
        table,
        writer: writer.clone(),
        pinning,
        idle: Arc::new(ControlGate::new()),
    };
    let status = serve(control, setup, &writer, &control_thread);
    setup.runtime.stop();
    status
}

fn install_snapshot<R: Runtime>(
    config: TargetConfig,
    setup: &TargetSetup<R>,
    writer: &ReplyWriter,
) -> Option<SlotTable<R::Callable>> {
    let pid = std::process::id();
    let entries: Vec<Digest> = setup
        .snapshot
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(d, _)| *d)
        .collect();
    if let Err(error) = Target::new(config, &setup.snapshot) {
        let failure = ReplyError {
            code: error.code,
            message: error.message,
        };
        let snapshot = entries.iter().map(|d| (*d, Err(failure.clone()))).collect();
        writer.send(Frame::Ready { pid, snapshot });
        return None;
    }
    let mut callables = Vec::with_capacity(entries.len());
    let mut outcomes = Vec::with_capacity(entries.len());
    let mut failed = Vec::new();
    for digest in entries {
        let result = install_one(setup, digest);
        outcomes.push((
            digest,
            result
                .as_ref()
                .map(|_| ())
                .map_err(|f| reply_error(f.clone())),
        ));
        match result {
            Ok(callable) => callables.push(callable),
            Err(_) => failed.push(digest),
        }
    }
    // The failed entries' slots stay free: the callables fill slots `0..`
    // in snapshot order, as the machine does.
    let machine = Target::with_snapshot_failures(config, &setup.snapshot, &failed).ok()?;
    writer.send(Frame::Ready {
        pid,
        snapshot: outcomes,
    });
    let runtime = setup.runtime.clone();
    Some(
        SlotTable::new(machine, callables).with_finalizer(Box::new(move |release| {
            runtime
                .finalize(release)
                .map_err(|e| format!("{}: {}", e.kind, e.message))
        })),
    )
}

fn install_one<R: Runtime>(setup: &TargetSetup<R>, digest: Digest) -> Result<R::Callable, Failure> {
    let bytes = setup.envelopes.get(&digest).ok_or_else(|| {
        Failure::new(
            ErrorCode::IO_FAILED,
            format!("no envelope was inherited for {digest}"),
        )
    })?;
    let envelope = Envelope::parse(bytes).map_err(|e| Failure::new(e.code(), e.message()))?;
    failpoints::hit(failpoints::TARGET_BEFORE_INSTALL)
        .map_err(|m| Failure::new(ErrorCode::IO_FAILED, m))?;
    let callable = install(
        &*setup.runtime,
        envelope.payload(),
        setup.metadata.get(&digest),
    )?;
    if failpoints::hit(failpoints::TARGET_AFTER_INSTALL).is_err() {
        abrupt_exit();
    }
    Ok(callable)
}

/// Register and unregister controls received and not yet answered, by
/// seq: the reader adds one on receipt, the control thread removes it once
/// it answered, and the heartbeat thread reports each alive meanwhile.
#[derive(Default)]
struct Outstanding {
    seqs: Mutex<BTreeSet<u64>>,
    changed: Condvar,
}

impl Outstanding {
    fn insert(&self, seq: u64) {
        self.seqs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(seq);
        self.changed.notify_all();
    }

    fn remove(&self, seq: u64) {
        self.seqs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&seq);
    }
}

/// What the reader hands the control thread, in arrival order.
enum Incoming {
    /// A frame, with the staged payload received with it (registers).
    Frame(Frame, Option<OwnedFd>),
    /// The reader stopped: the target ends with this status once every
    /// frame before it was handled.
    End(i32),
}

/// The seq of a frame that owes a [`Frame::Reply`] (a register or an
/// unregister control).
fn control_seq(frame: &Frame) -> Option<u64> {
    match frame {
        Frame::Register { seq, .. } | Frame::Unregister { seq, .. } | Frame::Cancel { seq, .. } => {
            Some(*seq)
        }
        _ => None,
    }
}

/// The reader thread: reads frames from the control socket, reports each
/// control alive on receipt and queues it for the control thread; never
/// touches the runtime. A task that finds no frame queued for the control
/// thread or being handled there is pinned here and handed to the task
/// thread directly (one thread fewer to wake); a task that cannot start
/// goes to the control thread like any frame, which fails it.
fn read_controls<C>(
    control: &OwnedFd,
    max_frame_bytes: usize,
    writer: &ReplyWriter,
    outstanding: &Outstanding,
    direct: (&Pinning<C>, &ControlGate),
    frames: &mpsc::Sender<Incoming>,
) -> i32 {
    let (pinning, idle) = direct;
    let Ok(mut buffer) = FrameBuffer::new(max_frame_bytes) else {
        return FRAME_EXIT_CODE;
    };
    let mut chunk = vec![0u8; READ_CHUNK_BYTES];
    // Staged payloads received with register controls, in arrival order:
    // each comes with its frame's first byte, so it is here by the time
    // the frame is whole, and the k-th register takes the k-th descriptor.
    let mut payloads = VecDeque::new();
    loop {
        let received = receive_control(control.as_fd(), &mut chunk, &mut payloads);
        // A process forked inside the target never serves its controls.
        exit_unless_target();
        let n = match received {
            Ok(0) => return 0,
            Ok(n) => n,
            Err(Errno::EINTR) => continue,
            Err(Errno::ENOBUFS) => return FRAME_EXIT_CODE,
            Err(_) => return 0,
        };
        buffer.extend(&chunk[..n]);
        loop {
            match buffer.next_frame() {
                Ok(Some(frame)) => {
                    let frame = match frame {
                        Frame::Task {
                            seq,
                            digest,
                            encoding,
                            input,
                        } if idle.is_idle() => match pinning.begin(seq, digest, encoding, input) {
                            Ok(()) => continue,
                            Err(unstarted) => Frame::Task {
                                seq,
                                digest,
                                encoding,
                                input: unstarted.input,
                            },
                        },
                        other => other,
                    };
                    let payload = match frame {
                        Frame::Register { .. } => payloads.pop_front(),
                        _ => None,
                    };
                    if let Some(seq) = control_seq(&frame) {
                        outstanding.insert(seq);
                        writer.send_alive(seq);
                    }
                    idle.hand();
                    if frames.send(Incoming::Frame(frame, payload)).is_err() {
                        return 0;
                    }
                }
                Ok(None) => break,
                Err(_) => return FRAME_EXIT_CODE,
            }
        }
    }
}

/// The heartbeat thread: every `every`, reports each outstanding control
/// alive; sleeps while none is outstanding. Never touches the runtime.
fn beat(writer: &ReplyWriter, outstanding: &Outstanding, every: std::time::Duration) {
    let mut seqs = outstanding.seqs.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        seqs = if seqs.is_empty() {
            outstanding
                .changed
                .wait(seqs)
                .unwrap_or_else(|p| p.into_inner())
        } else {
            let (guard, _) = outstanding
                .changed
                .wait_timeout(seqs, every)
                .unwrap_or_else(|p| p.into_inner());
            let due: Vec<u64> = guard.iter().copied().collect();
            drop(guard);
            for seq in due {
                writer.send_alive(seq);
            }
            outstanding.seqs.lock().unwrap_or_else(|p| p.into_inner())
        };
    }
}

fn serve<R: Runtime>(
    control: OwnedFd,
    setup: &TargetSetup<R>,
    writer: &Arc<ReplyWriter>,
    this: &Control<'_, R>,
) -> i32 {
    let outstanding = Arc::new(Outstanding::default());
    let (frames, incoming) = mpsc::channel::<Incoming>();
    {
        let writer = writer.clone();
        let outstanding = outstanding.clone();
        let pinning = this.pinning.clone();
        let idle = this.idle.clone();
        let max_frame_bytes = setup.max_frame_bytes;
        std::thread::spawn(move || {
            // Never closed before the process ends: a parent that sees the
            // channel close then always finds an exit status, not a target
            // still exiting.
            let control = std::mem::ManuallyDrop::new(control);
            let end = read_controls(
                &control,
                max_frame_bytes,
                &writer,
                &outstanding,
                (&pinning, &idle),
                &frames,
            );
            let _ = frames.send(Incoming::End(end));
        });
    }
    {
        let writer = writer.clone();
        let outstanding = outstanding.clone();
        let every = setup.heartbeat.max(std::time::Duration::from_millis(1));
        std::thread::spawn(move || beat(&writer, &outstanding, every));
    }
    loop {
        match incoming.recv() {
            Ok(Incoming::Frame(frame, payload)) => {
                let seq = control_seq(&frame);
                if !this.handle(frame, payload) {
                    return FRAME_EXIT_CODE;
                }
                if let Some(seq) = seq {
                    outstanding.remove(seq);
                }
                this.idle.done();
            }
            Ok(Incoming::End(code)) => return code,
            Err(mpsc::RecvError) => return 0,
        }
    }
}

/// Why a task did not start: its failure, and its input back (the
/// reader then hands the frame to the control thread, which fails it in
/// order). Nothing stays pinned.
struct Unstarted {
    code: ErrorCode,
    message: String,
    input: Vec<u8>,
}

impl<C> Pinning<C> {
    /// Pins task `seq`'s slot and its hooks' slots, in frame order (the
    /// caller is the control thread, or the reader while no control is
    /// queued or running), and hands the run to the task thread.
    ///
    /// # Errors
    /// The machine's error when `digest` does not resolve; a hook's
    /// ([`Pinning::pin_hooks`]).
    /// Nothing stays pinned, and no slot is freed on the way out: every
    /// pin undone here was made just now on a resolved slot, so undoing
    /// it never releases a callable (no finalizer, no GIL).
    fn begin(
        &self,
        seq: u64,
        digest: Digest,
        encoding: TaskEncoding,
        input: Vec<u8>,
    ) -> Result<(), Unstarted> {
        let callable = match self.table.begin_task(Seq(seq), digest) {
            Ok(callable) => callable,
            Err(error) => {
                return Err(Unstarted {
                    code: error.code,
                    message: error.message,
                    input,
                })
            }
        };
        let (before, after) = match self.pin_hooks(digest, encoding) {
            Ok(pinned) => pinned,
            Err((code, message)) => {
                drop(callable);
                let _ = self.table.end_task(Seq(seq));
                return Err(Unstarted {
                    code,
                    message,
                    input,
                });
            }
        };
        let run = Run {
            seq,
            digest,
            encoding,
            input,
            callable,
            before,
            after,
        };
        self.runs.push(run);
        Ok(())
    }

    /// Resolves and pins the hooks of `digest` for one run, in the
    /// target's own table.
    ///
    /// # Errors
    /// `TASK_FAILED` naming the hook's hashid when a `call_before` hook
    /// has a `retval_keyword` and the task is pickle-encoded (its kwargs
    /// are opaque to the target), or `DIGEST_NOT_INSTALLED` naming the
    /// hook's hashid when a hook does not resolve; nothing stays pinned.
    #[allow(clippy::type_complexity)]
    fn pin_hooks(
        &self,
        digest: Digest,
        encoding: TaskEncoding,
    ) -> Result<(Vec<PinnedHook<C>>, Vec<PinnedHook<C>>), (ErrorCode, String)> {
        let hooks = self
            .hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&digest)
            .cloned();
        let Some(hooks) = hooks else {
            return Ok((Vec::new(), Vec::new()));
        };
        if encoding == TaskEncoding::Pickle {
            if let Some(hook) = hooks.before.iter().find(|h| h.retval_keyword.is_some()) {
                return Err((
                    ErrorCode::TASK_FAILED,
                    format!(
                        "call_before hook {} passes its result as keyword argument {:?}, which needs a JSON-encoded task; this task is pickle-encoded",
                        hook.hashid,
                        hook.retval_keyword.as_deref().unwrap_or_default()
                    ),
                ));
            }
        }
        let mut pinned: Vec<PinnedHook<C>> = Vec::new();
        let mut before_count = 0;
        for (list, call) in hooks
            .before
            .iter()
            .map(|h| ("call_before", h))
            .chain(hooks.after.iter().map(|h| ("call_after", h)))
        {
            let seq = Seq(self.next_hook_seq.fetch_sub(1, Ordering::Relaxed));
            match self.table.begin_task(seq, call.hashid.0) {
                Ok(callable) => {
                    pinned.push(PinnedHook {
                        call: call.clone(),
                        seq,
                        callable,
                    });
                    if list == "call_before" {
                        before_count += 1;
                    }
                }
                Err(error) => {
                    for hook in pinned {
                        drop(hook.callable);
                        let _ = self.table.end_task(hook.seq);
                    }
                    return Err((
                        error.code,
                        format!("{list} hook {} cannot run: {}", call.hashid, error.message),
                    ));
                }
            }
        }
        let after = pinned.split_off(before_count);
        Ok((pinned, after))
    }
}

impl<R: Runtime> Control<'_, R> {
    /// Handles one frame (a register with the staged payload received
    /// with it); `false` for a frame a target never receives.
    fn handle(&self, frame: Frame, payload: Option<OwnedFd>) -> bool {
        match frame {
            Frame::Register {
                seq,
                digest,
                staged_size,
                metadata,
            } => {
                let metadata = parse_metadata(&metadata);
                let opened = open_and_verify(payload, staged_size);
                let failpoint = failpoints::hit(failpoints::TARGET_BEFORE_INSTALL);
                let verified = match (&opened, failpoint, &metadata) {
                    (_, Err(message), _) => Err(Failure::new(ErrorCode::IO_FAILED, message)),
                    (Err(failure), Ok(()), _) => Err(failure.clone()),
                    (Ok(_), Ok(()), Err(failure)) => Err(failure.clone()),
                    (Ok((_, verified)), Ok(()), Ok(_)) => Ok(*verified),
                };
                let effects = self.table.on_register(Seq(seq), digest, verified);
                let view = opened.ok().map(|(view, _)| view);
                let metadata = metadata.ok().flatten();
                let mut replies = Vec::new();
                self.carry_out(effects, view.as_ref(), metadata.as_ref(), &mut replies);
                // The mapping goes before the answer (`specs/staging.md`):
                // once the parent has every answer, no target holds any of
                // the payload, so nothing that comes later (an unregister
                // behind it in this socket) waits for its unmapping, and the
                // cost of a payload's size stays in its register.
                let staged = view.is_some();
                drop(view);
                self.send_replies(replies, staged);
            }
            Frame::Unregister { seq, digest } => {
                if let Err(message) = failpoints::hit(failpoints::TARGET_BEFORE_UNREGISTER) {
                    // A target refusing the control changes nothing.
                    let result = Err(ReplyError {
                        code: ErrorCode::IO_FAILED,
                        message,
                    });
                    self.writer.send(Frame::Reply {
                        seq,
                        digest,
                        result,
                    });
                } else {
                    let effects = self.table.on_unregister(Seq(seq), digest);
                    // The last reference's callable was released (its
                    // finalizer ran) before this unregister is answered.
                    report_finalizers(&self.table, self.id, || {
                        format!("the unregister (seq {seq}) of {}", digest.hashid())
                    });
                    let mut replies = Vec::new();
                    self.carry_out(effects, None, None, &mut replies);
                    self.send_replies(replies, false);
                }
            }
            Frame::Task {
                seq,
                digest,
                encoding,
                input,
            } => {
                if let Err(unstarted) = self.pinning.begin(seq, digest, encoding, input) {
                    self.task_failed(seq, digest, unstarted.code, &unstarted.message);
                }
            }
            Frame::Cancel { seq, digest } => {
                // Decided against the task thread's start under the
                // table's lock (`specs/protocol.md` §2.11): a run
                // cancelled here never starts.
                let effects = self.table.on_cancel(Seq(seq), digest);
                let mut replies = Vec::new();
                self.carry_out(effects, None, None, &mut replies);
                self.send_replies(replies, false);
            }
            Frame::Inspect { seq } => {
                let (installed, tombstones) = self.table.table();
                let entries = installed
                    .into_iter()
                    .map(|(digest, refcount)| crate::wire::TableEntry { digest, refcount })
                    .collect();
                let tombstones = u32::try_from(tombstones).unwrap_or(u32::MAX);
                self.writer.send(Frame::Table {
                    seq,
                    tombstones,
                    entries,
                });
            }
            Frame::Reply { .. }
            | Frame::TaskResult { .. }
            | Frame::Ready { .. }
            | Frame::Table { .. }
            | Frame::Alive { .. } => {
                return false;
            }
        }
        true
    }

    fn task_failed(&self, seq: u64, digest: Digest, code: ErrorCode, message: &str) {
        self.writer.send(Frame::TaskResult {
            seq,
            digest,
            result: Err(TaskFailure {
                code,
                kind: String::new(),
                message: message.to_owned(),
                exception: Vec::new(),
            }),
        });
    }

    /// Carries out the machine's effects in order: replies are collected
    /// into `replies` (sent by [`Control::send_replies`] once the staged
    /// view is gone); a deserialization runs from the staged view and its
    /// result goes back to the machine, whose new effects are carried out
    /// in turn.
    fn carry_out(
        &self,
        effects: Effects,
        view: Option<&StagedView>,
        metadata: Option<&CallableMetadata>,
        replies: &mut Vec<Reply>,
    ) {
        for effect in effects {
            match effect {
                TargetEffect::Reply(reply) => replies.push(reply),
                TargetEffect::Deserialize { seq, digest, slot } => {
                    let more = self.deserialize_into(seq, digest, slot, view, metadata);
                    self.carry_out(more, view, metadata, replies);
                }
            }
        }
    }

    /// Writes the replies in order; an OK reply to a register whose staged
    /// payload was opened (`staged`) passes `target.after_install` first.
    fn send_replies(&self, replies: Vec<Reply>, staged: bool) {
        for reply in replies {
            if reply.result.is_ok()
                && staged
                && failpoints::hit(failpoints::TARGET_AFTER_INSTALL).is_err()
            {
                abrupt_exit();
            }
            self.writer.send(Frame::Reply {
                seq: reply.seq.0,
                digest: reply.digest,
                result: reply.result.map_err(reply_error),
            });
        }
    }

    fn deserialize_into(
        &self,
        seq: Seq,
        digest: Digest,
        slot: Slot,
        view: Option<&StagedView>,
        metadata: Option<&CallableMetadata>,
    ) -> Effects {
        let result = match view.map(|v| Envelope::parse(v.bytes())) {
            Some(Ok(envelope)) => install(self.runtime, envelope.payload(), metadata),
            // The machine asks to deserialize only after a verified open.
            Some(Err(e)) => Err(Failure::new(e.code(), e.message())),
            None => Err(Failure::new(
                ErrorCode::IO_FAILED,
                "no staged payload is open",
            )),
        };
        // The hooks of the registration that installed the digest apply to
        // its tasks from now on (a reference added later keeps them).
        if result.is_ok() {
            let mut hooks = self.pinning.hooks.lock().unwrap_or_else(|p| p.into_inner());
            match Hooks::of(metadata) {
                Some(found) => hooks.insert(digest, found),
                None => hooks.remove(&digest),
            };
        }
        // Only a deserialization nobody waits for is refused; its callable
        // is dropped by the table and there is nothing to reply.
        self.table
            .on_deserialized(seq, slot, result)
            .unwrap_or_default()
    }
}

/// Writes one line on the target's stderr for each failure a finalizer
/// reported since the last call, naming the target and `what` freed the
/// callable (the operation it belongs to); nothing else in the target's
/// protocol changes: the slot is free all the same.
fn report_finalizers<C>(table: &SlotTable<C>, id: TargetId, what: impl FnOnce() -> String) {
    let failures = table.take_finalizer_failures();
    if failures.is_empty() {
        return;
    }
    let what = what();
    for failure in failures {
        let _ = writeln!(
            std::io::stderr().lock(),
            "callreg {id}: {what} released a callable whose finalizer failed: {failure}"
        );
    }
}

fn run_tasks<R: Runtime>(
    runtime: &R,
    id: TargetId,
    table: &SlotTable<R::Callable>,
    writer: &ReplyWriter,
    queue: &RunQueue<R::Callable>,
) -> ! {
    loop {
        let run = queue.pop();
        let (seq, digest) = (run.seq, run.digest);
        // A run cancelled while it was queued never starts and sends no
        // result: the cancel's reply answered for it (§2.11).
        if table.start_task(Seq(seq)) != Ok(true) {
            end_run(table, run);
            continue;
        }
        let result = run_with_hooks(runtime, &run);
        end_run(table, run);
        // A slot unregistered during the run is freed at its end.
        report_finalizers(table, id, || {
            format!(
                "the end of task seq {seq} of {} (unregistered while it ran)",
                digest.hashid()
            )
        });
        writer.send(Frame::TaskResult {
            seq,
            digest,
            result,
        });
    }
}

/// Drops a run's callables and unpins its slot and its hooks' slots (they
/// were pinned when the run began; ending them cannot fail).
fn end_run<C>(table: &SlotTable<C>, run: Run<C>) {
    let Run {
        seq,
        callable,
        before,
        after,
        ..
    } = run;
    drop(callable);
    let _ = table.end_task(Seq(seq));
    for hook in before.into_iter().chain(after) {
        drop(hook.callable);
        let _ = table.end_task(hook.seq);
    }
}

/// Calls the runtime, turning a panic into a `TASK_FAILED` failure.
fn call_caught<R: Runtime>(
    runtime: &R,
    callable: &R::Callable,
    encoding: TaskEncoding,
    input: &[u8],
) -> Result<Vec<u8>, TaskFailure> {
    let called = catch_unwind(AssertUnwindSafe(|| runtime.call(callable, encoding, input)));
    // The call ran user code, which may have forked: only the target goes
    // on (a forked copy returning here never reports a result).
    exit_unless_target();
    match called {
        Ok(Ok(output)) => Ok(output),
        Ok(Err(error)) => Err(TaskFailure {
            code: error.code,
            kind: error.kind,
            message: error.message,
            exception: error.exception,
        }),
        Err(panic) => Err(TaskFailure {
            code: ErrorCode::TASK_FAILED,
            kind: "panic".to_owned(),
            message: panic_message(&*panic),
            exception: Vec::new(),
        }),
    }
}

/// The failure reported for a task whose hook failed: kind `HookFailed`,
/// the hook's own code, and a message naming the hook and its failure.
fn hook_failure(list: &str, hook: &HookCall, when: &str, failure: TaskFailure) -> TaskFailure {
    TaskFailure {
        code: failure.code,
        kind: "HookFailed".to_owned(),
        message: format!(
            "{list} hook {} failed{when}: {}: {}",
            hook.hashid, failure.kind, failure.message
        ),
        exception: Vec::new(),
    }
}

/// Runs one task with its hooks: each `call_before` hook with its
/// JSON args and kwargs (a `retval_keyword` result merged into the task's
/// kwargs), the task, then each `call_after` hook, which run only when the
/// task succeeded. The first failure ends the run and is its outcome; a
/// failed hook is reported with kind `HookFailed`.
fn run_with_hooks<R: Runtime>(runtime: &R, run: &Run<R::Callable>) -> Result<Vec<u8>, TaskFailure> {
    let mut input = std::borrow::Cow::Borrowed(run.input.as_slice());
    for hook in &run.before {
        let result = call_caught(
            runtime,
            &hook.callable,
            TaskEncoding::Json,
            &hook.call.task_input(),
        )
        .map_err(|f| hook_failure("call_before", &hook.call, "", f))?;
        if let Some(keyword) = &hook.call.retval_keyword {
            let merged = merge_retval_keyword(&input, keyword, &result).map_err(|e| {
                hook_failure(
                    "call_before",
                    &hook.call,
                    "",
                    TaskFailure {
                        code: ErrorCode::TASK_FAILED,
                        kind: "RetvalKeywordInvalid".to_owned(),
                        message: e.to_string(),
                        exception: Vec::new(),
                    },
                )
            })?;
            input = std::borrow::Cow::Owned(merged);
        }
    }
    let output = call_caught(runtime, &run.callable, run.encoding, &input)?;
    for hook in &run.after {
        call_caught(
            runtime,
            &hook.callable,
            TaskEncoding::Json,
            &hook.call.task_input(),
        )
        .map_err(|f| hook_failure("call_after", &hook.call, " after the task succeeded", f))?;
    }
    Ok(output)
}

/// Parses a register control's metadata field: `Ok(None)` when empty.
///
/// # Errors
/// `METADATA_INVALID` with the decoding error naming the field.
fn parse_metadata(text: &str) -> Result<Option<CallableMetadata>, Failure> {
    if text.is_empty() {
        return Ok(None);
    }
    CallableMetadata::from_json(text)
        .map(Some)
        .map_err(|e| Failure::new(ErrorCode::METADATA_INVALID, format!("metadata: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::MIN_MAX_FRAME_BYTES;

    #[test]
    fn register_metadata_is_parsed_strictly_and_empty_means_none() {
        assert_eq!(parse_metadata(""), Ok(None));
        assert_eq!(
            parse_metadata(r#"{"name":"f"}"#),
            Ok(Some(CallableMetadata::named("f")))
        );
        assert_eq!(
            parse_metadata(r#"{"name":"f","deps":{"pip":{"packages":[1]}}}"#),
            Err(Failure::new(
                ErrorCode::METADATA_INVALID,
                "metadata: at deps.pip.packages[0]: invalid type: integer `1`, expected a string"
            ))
        );
    }

    #[test]
    fn an_oversized_task_result_becomes_a_failure_that_fits() {
        let frame = Frame::TaskResult {
            seq: 3,
            digest: Digest([4; 32]),
            result: Ok(vec![0; 10_000]),
        };
        let fitted = fit(frame, MIN_MAX_FRAME_BYTES);
        let bytes = fitted.encode(MIN_MAX_FRAME_BYTES).unwrap();
        assert!(bytes.len() <= MIN_MAX_FRAME_BYTES);
        match fitted {
            Frame::TaskResult {
                seq: 3,
                result: Err(failure),
                ..
            } => {
                assert_eq!(failure.code, ErrorCode::TASK_FAILED);
                assert_eq!(failure.kind, "ResultTooLarge");
                assert!(failure
                    .message
                    .starts_with("the task's result of 10000 bytes"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_long_reply_message_is_cut_at_a_character_boundary() {
        let frame = Frame::Reply {
            seq: 1,
            digest: Digest([1; 32]),
            result: Err(ReplyError {
                code: ErrorCode::DESERIALIZE_FAILED,
                // One ASCII byte first: the 202 bytes of room end inside
                // a two-byte character.
                message: format!("x{}", "é".repeat(1000)),
            }),
        };
        let fitted = fit(frame, MIN_MAX_FRAME_BYTES);
        let bytes = fitted.encode(MIN_MAX_FRAME_BYTES).unwrap();
        assert_eq!(bytes.len(), MIN_MAX_FRAME_BYTES - 1);
        match fitted {
            Frame::Reply {
                result: Err(error), ..
            } => assert_eq!(error.message, format!("x{}", "é".repeat(100))),
            other => panic!("{other:?}"),
        }
    }
}
