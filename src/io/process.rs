//! Target processes: fork, pipes, parent-death handling, fencing, reaping.
//!
//! [`spawn_targets`] forks N targets while the process is single-threaded
//! (DESIGN.md §5; the note on fork safety). Each target gets two pipes: a
//! control pipe (parent writes, target reads) and a reply pipe (target
//! writes, parent reads). The parent's ends are close-on-exec and
//! non-blocking, for its poll loop; the target's ends are blocking. Each
//! target closes every inherited close-on-exec descriptor (the other
//! targets' pipe ends, other Workers' pipes), so a pipe reports EOF as soon
//! as its only real peer is gone.
//!
//! The runtime's fork hooks ([`Runtime::before_fork`] and the after-fork
//! ones) run around each `fork`. A runtime whose state lives on in targets
//! ([`Runtime::keeps_inherited_descriptors`], an inherited Python
//! interpreter) keeps the descriptors it inherits: the target then closes
//! only the descriptors callreg itself opened (every Worker's pipe ends,
//! tracked in a process-wide set, [`TrackedFd`]), not the interpreter's
//! open files.
//!
//! A target: ignores SIGINT (Ctrl-C in a terminal reaches the parent only);
//! asks the kernel for SIGKILL when the thread that forked it ends
//! (`PR_SET_PDEATHSIG`) and checks `getppid` right after, closing the race
//! with a parent that died before the request; runs its body inside
//! `catch_unwind` and ends with `_exit`, so no destructor of the parent's
//! state ever runs in a target.

use std::collections::BTreeSet;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::signal::{self, SigHandler, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{ForkResult, Pid};

use crate::runtime::Runtime;

/// Every descriptor a [`TrackedFd`] owns in this process.
static TRACKED: Mutex<BTreeSet<RawFd>> = Mutex::new(BTreeSet::new());

fn tracked() -> MutexGuard<'static, BTreeSet<RawFd>> {
    TRACKED.lock().unwrap_or_else(|p| p.into_inner())
}

/// A descriptor callreg opened for a Worker (a pipe end): recorded in a
/// process-wide set while open, so that a target forked by any Worker can
/// close it even when it keeps the other descriptors it inherits.
#[derive(Debug)]
pub struct TrackedFd(OwnedFd);

impl TrackedFd {
    /// Records `fd` until this value is dropped.
    pub fn new(fd: OwnedFd) -> TrackedFd {
        tracked().insert(fd.as_raw_fd());
        TrackedFd(fd)
    }
}

impl AsFd for TrackedFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl Drop for TrackedFd {
    fn drop(&mut self) {
        // Forgotten before it closes (right after, with the field), so a
        // number reused by another open is never in the set.
        tracked().remove(&self.0.as_raw_fd());
    }
}

/// Exit status of a target whose body panicked.
pub const PANIC_EXIT_CODE: i32 = 101;

/// Exit status of a target that found its parent already gone at start.
pub const ORPHAN_EXIT_CODE: i32 = 102;

/// Whether [`spawn_targets`] may fork in a process that already runs other
/// threads.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum ThreadPolicy {
    /// Refuse with [`ProcessError::Threaded`] (the default): a thread that
    /// held a lock (e.g. the allocator's) at fork time leaves it held
    /// forever in the target.
    #[default]
    RefuseIfThreaded,
    /// Fork anyway; the caller accepts the risk of a deadlock in a target.
    AcceptRisk,
}

/// A failure to start or manage target processes.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The process runs other threads and the policy refuses to fork.
    #[error(
        "refusing to fork targets: this process runs {threads} threads (fork is only safe \
         single-threaded; start the Worker before any thread, or accept the risk explicitly)"
    )]
    Threaded {
        /// Threads counted in `/proc/self/task`.
        threads: usize,
    },
    /// An OS call failed.
    #[error("{operation} failed: {errno}")]
    Os {
        /// What was attempted (`"pipe2"`, `"fork"`, `"/proc/self/task"`, …).
        operation: &'static str,
        /// The OS error.
        errno: Errno,
    },
}

/// The number of threads of this process, from `/proc/self/task`.
///
/// # Errors
/// [`ProcessError::Os`] when the directory cannot be read.
pub fn thread_count() -> Result<usize, ProcessError> {
    let entries = std::fs::read_dir("/proc/self/task").map_err(|e| ProcessError::Os {
        operation: "/proc/self/task",
        errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
    })?;
    Ok(entries.count())
}

/// The target's ends of its two pipes, handed to the target body.
#[derive(Debug)]
pub struct TargetEnds {
    /// The target's index (0-based) among the Worker's targets.
    pub index: usize,
    /// Read end of the control pipe (blocking).
    pub control: OwnedFd,
    /// Write end of the reply pipe (blocking).
    pub reply: OwnedFd,
}

/// How a target process ended.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Exit {
    /// It called `exit`/`_exit` with this status.
    Code(i32),
    /// A signal ended it (e.g. `SIGKILL` after fencing).
    Signal(i32),
}

/// A verb phrase whose subject is the target: `exited with status 3`,
/// `was killed by signal 9` (read as "it exited …", "it was killed …").
impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(code) => write!(f, "exited with status {code}"),
            Exit::Signal(sig) => write!(f, "was killed by signal {sig}"),
        }
    }
}

/// The parent's view of one target process: its pid and the parent's pipe
/// ends. Dropping it without [`TargetProcess::reap`] kills the target with
/// SIGKILL and reaps it, so no zombie is left.
#[derive(Debug)]
pub struct TargetProcess {
    index: usize,
    pid: Pid,
    control: Option<TrackedFd>,
    reply: TrackedFd,
    exit: Option<Exit>,
}

impl TargetProcess {
    /// The target's index (0-based).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The target's process id.
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// The parent's write end of the control pipe (non-blocking), or `None`
    /// after [`TargetProcess::close_control`].
    pub fn control(&self) -> Option<BorrowedFd<'_>> {
        self.control.as_ref().map(|fd| fd.as_fd())
    }

    /// The parent's read end of the reply pipe (non-blocking).
    pub fn reply(&self) -> BorrowedFd<'_> {
        self.reply.as_fd()
    }

    /// Closes the control pipe: the target reads EOF and exits.
    pub fn close_control(&mut self) {
        self.control = None;
    }

    /// How the target ended, once reaped.
    pub fn exit(&self) -> Option<Exit> {
        self.exit
    }

    /// Sends SIGKILL (fencing: a killed target is certain to hold nothing).
    /// A target already reaped is left alone (its pid may be reused).
    ///
    /// # Errors
    /// [`ProcessError::Os`] when `kill` fails other than with `ESRCH`.
    pub fn kill(&self) -> Result<(), ProcessError> {
        if self.exit.is_some() {
            return Ok(());
        }
        match signal::kill(self.pid, Signal::SIGKILL) {
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(errno) => Err(ProcessError::Os {
                operation: "kill",
                errno,
            }),
        }
    }

    /// Reaps the target if it has ended, without blocking; returns how it
    /// ended, or `None` while it runs.
    ///
    /// # Errors
    /// [`ProcessError::Os`] when `waitpid` fails.
    pub fn try_reap(&mut self) -> Result<Option<Exit>, ProcessError> {
        self.wait(Some(WaitPidFlag::WNOHANG))
    }

    /// Waits for the target to end (for at most `timeout`), then kills it
    /// with SIGKILL if it is still running, and reaps it.
    ///
    /// # Errors
    /// [`ProcessError::Os`] when `waitpid` or `kill` fails.
    pub fn reap(&mut self, timeout: Duration) -> Result<Exit, ProcessError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(exit) = self.try_reap()? {
                return Ok(exit);
            }
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.kill()?;
        loop {
            if let Some(exit) = self.wait(None)? {
                return Ok(exit);
            }
        }
    }

    fn wait(&mut self, flags: Option<WaitPidFlag>) -> Result<Option<Exit>, ProcessError> {
        if let Some(exit) = self.exit {
            return Ok(Some(exit));
        }
        let status = match waitpid(self.pid, flags) {
            Ok(status) => status,
            Err(Errno::EINTR) => return Ok(None),
            Err(errno) => {
                return Err(ProcessError::Os {
                    operation: "waitpid",
                    errno,
                })
            }
        };
        let exit = match status {
            WaitStatus::Exited(_, code) => Exit::Code(code),
            WaitStatus::Signaled(_, sig, _) => Exit::Signal(sig as i32),
            _ => return Ok(None),
        };
        self.exit = Some(exit);
        Ok(Some(exit))
    }
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        if self.exit.is_none() {
            // Closing the control pipe first lets a healthy target exit on
            // its own; the kill covers a hung one.
            self.control = None;
            let _ = self.kill();
            let _ = self.wait(None);
        }
    }
}

/// Forks `count` targets, each running `body(ends)` and exiting with the
/// status it returns (or [`PANIC_EXIT_CODE`] if it panics).
///
/// `before_body(index)` runs in each target right after fork, before the
/// body (e.g. to configure that target's fail points). Standard output and
/// error are flushed before forking. On an error after some targets were
/// forked, those are killed and reaped before returning.
///
/// `runtime`'s fork hooks run around each fork: [`Runtime::before_fork`]
/// and [`Runtime::after_fork_parent`] in this thread,
/// [`Runtime::after_fork_child`] first thing in the target (before its
/// signals and descriptors are set up).
///
/// The targets receive SIGKILL when the thread that called this function
/// ends (`PR_SET_PDEATHSIG` follows the forking thread, not the process):
/// call it from a thread that lives as long as the targets should.
///
/// # Errors
/// [`ProcessError::Threaded`] when the process runs other threads and
/// `policy` refuses; [`ProcessError::Os`] when counting threads, `pipe2` or
/// `fork` fails.
pub fn spawn_targets<R, F, B>(
    count: usize,
    policy: ThreadPolicy,
    runtime: &R,
    before_body: B,
    body: F,
) -> Result<Vec<TargetProcess>, ProcessError>
where
    R: Runtime + ?Sized,
    F: Fn(TargetEnds) -> i32,
    B: Fn(usize),
{
    if policy == ThreadPolicy::RefuseIfThreaded {
        let threads = thread_count()?;
        if threads > 1 {
            return Err(ProcessError::Threaded { threads });
        }
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    let parent = nix::unistd::getpid();
    let mut targets = Vec::with_capacity(count);
    for index in 0..count {
        let os = |operation| move |errno| ProcessError::Os { operation, errno };
        let (control_read, control_write) =
            nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(os("pipe2"))?;
        let (reply_read, reply_write) =
            nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(os("pipe2"))?;
        set_nonblocking(control_write.as_fd()).map_err(os("fcntl"))?;
        set_nonblocking(reply_read.as_fd()).map_err(os("fcntl"))?;
        let (control_write, reply_read) =
            (TrackedFd::new(control_write), TrackedFd::new(reply_read));
        runtime.before_fork();
        // Held across the fork: no other thread holds it then, and the
        // child reads the set through this guard (its only thread).
        let mut owned = Some(tracked());
        // SAFETY: the process is single-threaded here (checked above, or the
        // caller accepted the risk, as `os.fork` does); the child only calls
        // async-signal-safe functions and the runtime's after-fork hook
        // until it has closed the inherited descriptors, and it never
        // returns from this function: it ends with `_exit`.
        let forked = unsafe { nix::unistd::fork() };
        if !matches!(forked, Ok(ForkResult::Child)) {
            drop(owned.take());
            runtime.after_fork_parent();
        }
        match forked.map_err(os("fork"))? {
            ForkResult::Parent { child } => {
                drop(control_read);
                drop(reply_write);
                targets.push(TargetProcess {
                    index,
                    pid: child,
                    control: Some(control_write),
                    reply: reply_read,
                    exit: None,
                });
            }
            ForkResult::Child => {
                let keep = [control_read.as_raw_fd(), reply_write.as_raw_fd()];
                // The parent's descriptors leave the set (closed below) and
                // this target's own ends join it, so that a Worker this
                // target builds closes them in its own targets; the lock is
                // released before the body, which may build such a Worker.
                let owned: Vec<RawFd> = match owned.take() {
                    Some(mut set) => {
                        let parents = set.iter().copied().collect();
                        set.clear();
                        set.extend(keep);
                        parents
                    }
                    None => Vec::new(),
                };
                runtime.after_fork_child();
                let keeps_inherited = runtime.keeps_inherited_descriptors();
                let code = catch_unwind(AssertUnwindSafe(|| {
                    prepare_child(parent);
                    if keeps_inherited {
                        close_tracked(&owned, &keep);
                    } else {
                        close_inherited_cloexec(&keep);
                    }
                    before_body(index);
                    body(TargetEnds {
                        index,
                        control: control_read,
                        reply: reply_write,
                    })
                }))
                .unwrap_or(PANIC_EXIT_CODE);
                // SAFETY: ends the target without running the parent's
                // destructors (the inherited `targets`, staged payloads).
                unsafe { libc::_exit(code) }
            }
        }
    }
    Ok(targets)
}

fn set_nonblocking(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    use nix::fcntl::{fcntl, FcntlArg};
    let flags = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    Ok(())
}

/// Runs first in every target: signals, parent death.
fn prepare_child(parent: Pid) {
    // SAFETY: installing SIG_IGN has no handler code to be unsafe about.
    let _ = unsafe { signal::signal(Signal::SIGINT, SigHandler::SigIgn) };
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and no pointer.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    if nix::unistd::getppid() != parent {
        // The parent died before the request above took effect.
        // SAFETY: see the `_exit` in `spawn_targets`.
        unsafe { libc::_exit(ORPHAN_EXIT_CODE) }
    }
}

/// Closes the descriptors callreg opened in the parent (`owned`, read from
/// the tracked set at fork) except `keep`.
fn close_tracked(owned: &[RawFd], keep: &[RawFd]) {
    for fd in owned {
        if !keep.contains(fd) {
            // SAFETY: the descriptor belongs to a Worker of the parent, which
            // this target never uses (it ends with `_exit`).
            unsafe { libc::close(*fd) };
        }
    }
}

/// Closes every descriptor marked close-on-exec except `keep`: they belong
/// to the parent (other targets' pipe ends, other Workers) and would keep
/// those pipes from reporting EOF.
fn close_inherited_cloexec(keep: &[RawFd]) {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    // Collect first: the directory's own descriptor is open while iterating.
    let fds: Vec<RawFd> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    for fd in fds {
        if fd <= 2 || keep.contains(&fd) {
            continue;
        }
        // SAFETY: F_GETFD reads a descriptor's flags; an fd closed meanwhile
        // (the directory's own) just returns -1.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if flags >= 0 && flags & libc::FD_CLOEXEC != 0 {
            // SAFETY: the descriptor belongs to the parent's state, which this
            // target never uses (it ends with `_exit`, never dropping it).
            unsafe { libc::close(fd) };
        }
    }
}
