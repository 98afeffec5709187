//! [`Worker::start`]: the descriptor check, the forks (the targets, then the
//! template process) on the Worker's forking thread, the wait until every
//! target is ready with the startup snapshot, and the IO thread's start.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::builder::StartMethod;
use super::io_loop::{
    io_thread, read_available, Context, IoLoop, Link, Outbox, ReadOutcome, LOST_GRACE,
    READ_CHUNK_BYTES,
};
use super::pending::{outcome_text, registration_failure_text, OperationError, StartReport};
use super::respawn::{Kept, TargetEvent};
use super::{lifecycle_error, now_since, Worker};
use crate::descriptor::Digest;
use crate::error::{Error, ErrorCode, OperationKind};
use crate::io::lead::Watch;
use crate::io::process::{ProcessError, TargetProcess, ThreadPolicy, TrackedFd};
use crate::io::target::TargetSetup;
use crate::io::zygote::{TemplateCommand, Zygote};
use crate::io::{failpoints, process, target};
use crate::metadata::CallableMetadata;
use crate::protocol::{Failure, Lifecycle, Namespace, TargetId, TargetOutcome};
use crate::runtime::Runtime;
use crate::wire::{Frame, FrameBuffer};

impl<R: Runtime> Worker<R> {
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
        // The targets' control threads are copies of this thread: their
        // stack is its stack.
        let thread = std::thread::Builder::new()
            .name("callreg-fork".to_owned())
            .stack_size(process::runtime_thread_stack())
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
    pub(super) fn end_forker(&self) {
        let forker = self.forker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((stop, thread)) = forker {
            drop(stop);
            let _ = thread.join();
        }
    }

    /// Forks the targets, waits until each installed the startup snapshot,
    /// and starts the IO thread. Stale staged payloads of dead parents are
    /// swept first; with the `failpoints` feature, fail points are
    /// configured from `FAILPOINTS` (and per target, see
    /// [`crate::io::failpoints`]).
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
    /// cloudpickle, nothing registered; `benchmarks/HISTORY.md`).
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` unless new; `IO_FAILED` when the process already
    /// runs other threads (unless accepted in the builder), when the
    /// targets' pipes would exceed the soft `RLIMIT_NOFILE`, when `fork`,
    /// `socketpair` fails, or `FAILPOINTS` is malformed;
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
        let forkserver = match &self.start_method {
            StartMethod::Fork => None,
            StartMethod::Forkserver(command) => Some(command.clone()),
        };
        check_descriptor_room(self.targets, self.respawn || forkserver.is_some())
            .map_err(|m| start_error(ErrorCode::IO_FAILED, m))?;
        // One deadline for the whole start, from before the first fork:
        // every target must be ready by then (forking under load, and every
        // target starting its runtime at once, all count against it).
        let deadline = Instant::now() + self.control_timeout;
        let snapshot = core.machine.startup_snapshot();
        // The snapshot's bytes move into the setup, so that the forked
        // processes hold the only reference a target drops once installed
        // (and the template at once); the parent takes them back after.
        let setup = Arc::new(TargetSetup {
            runtime: self.runtime.clone(),
            snapshot: snapshot.clone(),
            envelopes: Mutex::new(std::mem::take(&mut core.envelopes)),
            metadata: core.metadata.clone(),
            slot_capacity: self.slot_capacity,
            max_frame_bytes: self.max_frame_bytes,
            heartbeat: self.control_timeout / 4,
            spin: self.spin,
        });
        let inherited = setup.clone();
        // The process's threads are counted before the forking thread
        // exists: that thread is the Worker's own. A forkserver start
        // forks nothing here (the template is a fresh process).
        if forkserver.is_none() {
            process::check_threads(self.thread_policy)
                .map_err(|e| start_error(ErrorCode::IO_FAILED, e.to_string()))?;
        }
        let empty = TargetSetup {
            runtime: self.runtime.clone(),
            snapshot: Vec::new(),
            envelopes: Mutex::new(BTreeMap::new()),
            metadata: BTreeMap::new(),
            slot_capacity: self.slot_capacity,
            max_frame_bytes: self.max_frame_bytes,
            heartbeat: self.control_timeout / 4,
            spin: self.spin,
        };
        let (targets, respawn, runtime) = (self.targets, self.respawn, self.runtime.clone());
        let forks = move || -> Result<(Vec<TargetProcess>, Option<Zygote>), OperationError> {
            if let Some(command) = forkserver {
                return forkserver_start(&command, &setup, targets, deadline)
                    .map(|(processes, zygote)| (processes, Some(zygote)))
                    .map_err(|m| start_error(ErrorCode::IO_FAILED, m));
            }
            let before_body = target::before_body;
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
                // The template serves replacements, which are replayed
                // what they need: it drops the snapshot's bytes at once.
                let forget = || drop(std::mem::take(&mut *lock_envelopes(&setup)));
                match Zygote::fork_with_start(
                    ThreadPolicy::AcceptRisk,
                    &*runtime,
                    forget,
                    before_body,
                    |ends| target::run(ends, &empty),
                ) {
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
        core.envelopes = std::mem::take(&mut *lock_envelopes(&inherited));
        // Every target inherited the snapshot's bytes through `fork` (or
        // its template's setup); the parent sends them again only to
        // replacements.
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
        // Why each target that did not start did not (for the error).
        let mut causes: Vec<String> = Vec::new();
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
                match (outcome, core.exits.get(target)) {
                    (TargetOutcome::Fenced, _) => causes.push(format!(
                        "{target} sent no ready report within the control timeout ({} s): give a longer control_timeout",
                        self.control_timeout.as_secs_f64()
                    )),
                    (TargetOutcome::Lost, Some(exit)) => {
                        causes.push(format!("{target} {exit} before it was ready"))
                    }
                    _ => {}
                }
                if self.respawn {
                    core.record(TargetEvent::Lost {
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
        let (wake_read, wake_write) =
            wake_channel().map_err(|m| start_error(ErrorCode::IO_FAILED, m))?;
        core.wake = Some(Arc::new(TrackedFd::new(wake_write)));
        core.io_running = true;
        let (leader_read, leader_write) =
            wake_channel().map_err(|m| start_error(ErrorCode::IO_FAILED, m))?;
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
            task_keys: BTreeMap::new(),
            cancels: BTreeMap::new(),
            inspects: BTreeMap::new(),
            clock: self.clock,
            max_frame_bytes: self.max_frame_bytes,
            handovers: Vec::new(),
            zygote: zygote.map(Arc::new),
            respawn: self.respawn,
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
        if !causes.is_empty() {
            message.push_str(&format!(" ({})", causes.join("; ")));
        }
        // Which entry a target died installing is not known (it could
        // not say): the error names the snapshot's only entry (its
        // hashid), or the message names them all, in order.
        if snapshot.len() > 1 {
            let names: Vec<String> = snapshot
                .iter()
                .map(|(d, _)| d.hashid().to_string())
                .collect();
            message.push_str(&format!(" (the snapshot held {})", names.join(", ")));
        }
        for registration in &report.failed {
            message.push_str(&format!("; {}", registration_failure_text(registration)));
        }
        let mut error =
            Error::new(code, OperationKind::Start, message).with_namespace(Namespace::LocalPython);
        if let [(digest, _)] = snapshot.as_slice() {
            error = error.with_digest(*digest);
        }
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
}

/// The forks of a forkserver start: runs the template process
/// ([`Zygote::exec`], given the startup `setup`), then asks it for each
/// target of the start. On a failure every target forked so far is
/// killed and reaped, and the template closed.
///
/// # Errors
/// The message saying what failed.
fn forkserver_start<R: Runtime>(
    command: &TemplateCommand,
    setup: &TargetSetup<R>,
    targets: u16,
    deadline: Instant,
) -> Result<(Vec<TargetProcess>, Zygote), String> {
    let zygote = Zygote::exec(command, setup, deadline).map_err(|e| match e {
        ProcessError::TemplateStart { .. } => e.to_string(),
        other => format!("starting the template process: {other}"),
    })?;
    let mut processes = Vec::with_capacity(usize::from(targets));
    for index in 0..usize::from(targets) {
        match zygote.spawn_startup(index, index + 1 == usize::from(targets)) {
            Ok(process) => processes.push(process),
            Err(e) => {
                for mut process in processes {
                    let _ = process.kill();
                    let _ = process.reap(LOST_GRACE);
                }
                return Err(format!(
                    "forking target {index} from the template process: {e}"
                ));
            }
        }
    }
    Ok((processes, zygote))
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
                outbox: Outbox::default(),
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
                Ok(Some(Frame::StartFailed { kind, message })) => Some(failed_outcome(
                    ErrorCode::TARGET_LOST,
                    start_failed_text(&kind, &message),
                )),
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

/// How a target's [`Frame::StartFailed`] is told: the runtime's kind of
/// failure and its message (with the innermost traceback frames, for
/// Python).
pub(super) fn start_failed_text(kind: &str, message: &str) -> String {
    format!("the target could not start: {kind}: {message}")
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

/// The snapshot's bytes in a setup (poisoning cannot leave them half
/// changed: they are only moved in and out whole).
fn lock_envelopes<R: Runtime>(
    setup: &TargetSetup<R>,
) -> std::sync::MutexGuard<'_, BTreeMap<Digest, Arc<Vec<u8>>>> {
    setup.envelopes.lock().unwrap_or_else(|p| p.into_inner())
}

/// A wake-up channel of the IO loop: (read end, write end), non-blocking
/// and close-on-exec. A Unix socket pair, not a pipe: another process of
/// the same user can reopen a pipe through `/proc/PID/fd/N` and steal its
/// bytes (a lost wake-up), a socket it cannot reopen.
///
/// # Errors
/// What `socketpair` said, when it fails.
fn wake_channel() -> Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd), String> {
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
    )
    .map_err(|e| format!("socketpair: {e}"))
}
