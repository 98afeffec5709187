//! The target process: installs its startup snapshot, then serves control
//! frames and runs tasks (specs/design.md §4.2, §5).
//!
//! Threads, each with one job:
//!
//! * **task** (`callreg-task`): runs the tasks, each pinned to its slot in
//!   frame order, and reads the control socket while it waits for a run.
//!   Why: a long task never delays a register into a timeout, and a task
//!   arriving at an idle target wakes only the thread that runs it.
//! * **reader** (`callreg-reader`, no GIL): reads the control socket while
//!   the task thread runs a task (`intake`: both wait on it with
//!   `EPOLLEXCLUSIVE`, the task thread's wait first, so the kernel wakes
//!   the reader only when the task thread does not wait). Why: a control
//!   is read and reported alive while a task runs.
//! * Whichever reads a frame reports every register and unregister
//!   [`Frame::Alive`] on receipt, and queues the frames for the control
//!   thread. Why: an alive report never waits for the interpreter.
//! * **heartbeat** (`callreg-beat`, no GIL): reports every control
//!   received and not yet answered alive again every
//!   [`TargetSetup::heartbeat`], and at once when a register's install
//!   begins, each with its phase: *queued* until the runtime runs its
//!   install (it waits behind other controls, or for the GIL a task
//!   holds), *running* from then on ([`Runtime::install_reporting`]). Why:
//!   a busy target (a slow unpickle, controls queued behind it, a task
//!   holding the GIL) is never taken for a silent one
//!   (`specs/protocol.md` §2.7), and only a probe fenced while running
//!   counts against its digest (§2.8).
//! * **control** (the target's main thread): takes the frames in order
//!   and drives the protocol's [`Target`] machine (through the
//!   [`SlotTable`]), carrying out its effects: it checks a staged
//!   payload's seals, maps it read-only, verifies its digest, installs it
//!   from that mapping through the runtime (checks, then deserialization)
//!   and writes the replies.
//!
//! Where a task is pinned:
//!
//! * by the thread that read it, when no frame is queued for the control
//!   thread or being handled there ([`ControlGate`]: the reading thread
//!   counts the frames it hands over, the control thread counts them
//!   done). Why: a task round trip on an idle target then wakes one
//!   thread (the task thread reads, pins and runs it), not three;
//!   pinning takes only the slot table's lock, never the runtime's.
//! * by the control thread, in its turn, for any other task and for a task
//!   the reading thread could not start (it does not resolve, a hook does
//!   not) (`specs/wire.md`).
//!
//! Every thread writes whole frames to the reply socket under one lock.
//!
//! Callable metadata (`specs/metadata.md`):
//!
//! * a register control carries it as JSON; the target parses it and
//!   installs through [`Runtime::install`], which makes the version,
//!   dependency and executor checks before anything is deserialized;
//! * the hooks of the registration that installed a digest are kept by
//!   digest; around each task of that digest the task thread runs the
//!   `call_before` hooks, the task (a `retval_keyword` result merged into
//!   its JSON kwargs), then the `call_after` hooks;
//! * the thread that pins the task pins every hook with it, like any run,
//!   under target-local run seqs counted down from `u64::MAX` (a parent's
//!   seqs count up from 1 and never reach them).
//!
//! The target ends (with `_exit`, from [`super::process`]):
//!
//! * when the control socket reports EOF (the parent closed it or died);
//! * when a frame cannot be decoded or is out of protocol
//!   ([`FRAME_EXIT_CODE`]);
//! * when the reply pipe is gone ([`REPLY_EXIT_CODE`]);
//! * when one of its threads cannot be spawned, or the task thread's or
//!   the reader's wait cannot be set up or fails later
//!   ([`THREAD_EXIT_CODE`]).
//!
//! A process forked inside the target by user code (during a
//! deserialization or a task) ends with
//! [`super::process::FORKED_EXIT_CODE`] as soon as it is back in this code:
//! before it reads a control, reports an install or a task result, or
//! writes any reply.
//!
//! Layout: this file holds the target's start (runtime, startup snapshot)
//! and what its threads share; `reply` the reply socket's writer;
//! `intake` the reading of the control socket and the reader thread;
//! `control` the heartbeat and control threads; `runs` the pinning of
//! tasks, the run queue and the task thread.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::AtomicU64;
use std::sync::{mpsc, Arc, Mutex};

use super::failpoints::{self, ABRUPT_EXIT_CODE};
use super::process::{exit_unless_target, TargetEnds};
use nix::errno::Errno;

use super::slots::{ControlGate, SlotTable};
use crate::descriptor::Digest;
use crate::envelope::Envelope;
use crate::error::ErrorCode;
use crate::metadata::CallableMetadata;
use crate::protocol::{Failure, Target, TargetConfig, TargetId};
use crate::runtime::{Runtime, RuntimeError, Staged};
use crate::wire::{Frame, ReplyError};

mod control;
mod intake;
mod reply;
mod runs;

use control::{serve, Control, Outstanding};
use intake::Intake;
use reply::{reply_error, ReplyWriter};
use runs::{run_tasks, Hooks, Pinning, RunQueue, TaskSpin};

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
/// Exit status: a thread of the target (task, reader, heartbeat) could
/// not be spawned, or the task thread's or the reader's epoll instance or
/// the task thread's eventfd could not be made (after the startup
/// snapshot's [`Frame::Ready`]), or later failed (a task closed it); the
/// reason goes to stderr.
pub const THREAD_EXIT_CODE: i32 = 108;

/// The name of a target's task thread (its `comm` in `/proc`).
pub const TASK_THREAD: &str = "callreg-task";
/// The name of a target's reader thread.
pub const READER_THREAD: &str = "callreg-reader";
/// The name of a target's heartbeat thread.
pub const HEARTBEAT_THREAD: &str = "callreg-beat";

/// What a target inherits from the parent through `fork`.
pub struct TargetSetup<R: Runtime> {
    /// The runtime, started once in the target.
    pub runtime: Arc<R>,
    /// The startup snapshot: distinct digests with their refcounts, in
    /// digest order (as from the parent machine's `startup_snapshot`).
    pub snapshot: Vec<(Digest, u32)>,
    /// The envelope bytes of every snapshot digest (validated by the parent
    /// when it computed the digest). A target takes them out once it
    /// installed the snapshot and drops them, so that it does not keep a
    /// large pre-start callable's bytes for its life (with the only other
    /// reference gone too, the allocation is freed in that process).
    pub envelopes: Mutex<BTreeMap<Digest, Arc<Vec<u8>>>>,
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
    /// The task thread's spin budget: how long it may spin for its next
    /// run before it sleeps, when its adaptive rule says spinning pays
    /// (zero: never; the Worker's spin budget, `specs/threads.md`, "The
    /// target's spin").
    pub spin: std::time::Duration,
}

/// Ends the target at once: a fault injected after a decision was made
/// (installed, or about to reply) cannot be turned into an error reply
/// without lying to the parent, so any `return(…)` there is a crash.
fn abrupt_exit() -> ! {
    // SAFETY: `_exit` ends the process without destructors: a crash.
    unsafe { libc::_exit(ABRUPT_EXIT_CODE) }
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

/// Installs `staged` with its registration's metadata through the
/// runtime ([`Runtime::install_reporting`]: checks first, then
/// deserializes, calling `begun` once the install runs), honouring the
/// `target.deserialize` fail point; a panic in the runtime is a failure.
fn install<R: Runtime>(
    runtime: &R,
    staged: Staged<'_>,
    metadata: Option<&CallableMetadata>,
    begun: &dyn Fn(),
) -> Result<R::Callable, Failure> {
    if let Err(message) = failpoints::hit(failpoints::TARGET_DESERIALIZE) {
        return Err(Failure::new(ErrorCode::DESERIALIZE_FAILED, message));
    }
    let installed = catch_unwind(AssertUnwindSafe(|| {
        runtime.install_reporting(staged, metadata, begun)
    }));
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

/// Runs in each new target of a Worker right after its fork, before
/// [`run`] (the `before_body` of [`super::process::spawn_targets`] and of
/// a zygote's template): in a build with fail points, configures this
/// target's from its variable ([`failpoints::target_env_var`]), ending the
/// target with [`START_EXIT_CODE`] when they are malformed. Does nothing
/// otherwise.
pub fn before_body(index: usize) {
    if cfg!(feature = "failpoints")
        && failpoints::configure_from_env(&failpoints::target_env_var(index)).is_err()
    {
        // SAFETY: ends the freshly forked target before it runs.
        unsafe { libc::_exit(START_EXIT_CODE) }
    }
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
        // The parent learns why from the target's last frame; the reason
        // also goes to stderr, in one write so that targets failing
        // together do not interleave.
        writer.send(Frame::StartFailed {
            kind: error.kind.clone(),
            message: error.message.clone(),
        });
        let line = format!("callreg target {index}: the runtime did not start: {error}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        return START_EXIT_CODE;
    }
    let Some(table) = install_snapshot(config, setup, &writer) else {
        return SNAPSHOT_EXIT_CODE;
    };
    let table = Arc::new(table);
    // The task thread's wait holds the control socket before the
    // reader's does, so that the kernel wakes it first (`intake`).
    let waits = RunQueue::watching(control.as_fd()).and_then(|runs| {
        let reader = intake::reader_wait(control.as_fd())?;
        Ok((runs, reader))
    });
    let (runs, reader_wait) = match waits {
        Ok(waits) => waits,
        Err(error) => {
            thread_failed(config.id, "the task thread's wait", &error);
            return THREAD_EXIT_CODE;
        }
    };
    let runs = Arc::new(runs);
    let hooks = setup
        .metadata
        .iter()
        .filter_map(|(digest, metadata)| Hooks::of(Some(metadata)).map(|h| (*digest, h)))
        .collect();
    let pinning = Arc::new(Pinning {
        table: table.clone(),
        runs: runs.clone(),
        hooks: Mutex::new(hooks),
        next_hook_seq: AtomicU64::new(u64::MAX),
    });
    let idle = Arc::new(ControlGate::new());
    let outstanding = Arc::new(Outstanding::default());
    let (frames, incoming) = mpsc::channel();
    let Ok(intake) = Intake::new(
        control,
        setup.max_frame_bytes,
        writer.clone(),
        outstanding.clone(),
        (pinning.clone(), idle.clone()),
        frames,
    ) else {
        return FRAME_EXIT_CODE;
    };
    let intake = Arc::new(intake);
    {
        let table = table.clone();
        let writer = writer.clone();
        let runtime = setup.runtime.clone();
        let id = config.id;
        let intake = intake.clone();
        let mut spin = TaskSpin::new(setup.spin);
        let spawned = std::thread::Builder::new()
            .name(TASK_THREAD.to_owned())
            .stack_size(super::process::runtime_thread_stack())
            .spawn(move || run_tasks(&*runtime, id, &table, &writer, (&runs, &intake), &mut spin));
        if let Err(error) = spawned {
            thread_failed(config.id, "the task thread", &error);
            return THREAD_EXIT_CODE;
        }
    }
    let control_thread = Control {
        id: config.id,
        runtime: &*setup.runtime,
        table,
        writer,
        pinning,
        idle,
        outstanding,
        ahead: std::cell::Cell::new(None),
    };
    let status = serve(intake, reader_wait, &incoming, setup, &control_thread);
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
    // Installed once: the bytes go when this returns.
    let envelopes = std::mem::take(&mut *setup.envelopes.lock().unwrap_or_else(|p| p.into_inner()));
    for digest in entries {
        let result = install_one(setup, &envelopes, digest);
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

fn install_one<R: Runtime>(
    setup: &TargetSetup<R>,
    envelopes: &BTreeMap<Digest, Arc<Vec<u8>>>,
    digest: Digest,
) -> Result<R::Callable, Failure> {
    let bytes = envelopes.get(&digest).ok_or_else(|| {
        Failure::new(
            ErrorCode::IO_FAILED,
            format!("no envelope was inherited for {digest}"),
        )
    })?;
    let envelope = Envelope::parse(bytes).map_err(|e| Failure::new(e.code(), e.message()))?;
    failpoints::hit(failpoints::TARGET_BEFORE_INSTALL)
        .map_err(|m| Failure::new(ErrorCode::IO_FAILED, m))?;
    // Before Ready: no control is outstanding to report running.
    let callable = install(
        &*setup.runtime,
        Staged::in_memory(envelope),
        setup.metadata.get(&digest),
        &|| {},
    )?;
    if failpoints::hit(failpoints::TARGET_AFTER_INSTALL).is_err() {
        abrupt_exit();
    }
    Ok(callable)
}

/// Ends the target at once with [`THREAD_EXIT_CODE`] when one of its
/// threads' waits fails for good (its epoll instance or eventfd closed
/// or replaced under it, by a task that closed descriptors it does not
/// own): a thread that cannot wait would otherwise spin on the error, or
/// sleep through the work it is woken for. Says which wait and why on
/// stderr first; the parent reports the target lost with that status.
fn wait_failed(what: &str, error: Errno) -> ! {
    let line = format!(
        "callreg target (pid {}): {what} failed: {error}\n",
        std::process::id()
    );
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
    // SAFETY: `_exit` ends the process without destructors; the target
    // can no longer serve.
    unsafe { libc::_exit(THREAD_EXIT_CODE) }
}

/// Writes on the target's stderr, in one write (targets failing together
/// do not interleave), that `what` could not be set up, before the target
/// exits with [`THREAD_EXIT_CODE`].
fn thread_failed(id: TargetId, what: &str, error: &dyn std::fmt::Display) {
    let line = format!("callreg {id}: {what} could not be set up: {error}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
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
