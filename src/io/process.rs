//! Target processes: fork, channels, parent-death handling, fencing,
//! reaping.
//!
//! [`spawn_targets`] forks N targets while the process is single-threaded
//! (specs/design.md §5; the note on fork safety). Each target gets two channels:
//! a control socket (a Unix stream `socketpair`: the parent writes control
//! frames and passes each register's sealed staged payload beside its frame
//! with `SCM_RIGHTS`, [`send_control`] / [`receive_control`]; the target
//! reads) and a reply socket (target writes, parent reads). The parent's ends
//! are close-on-exec and non-blocking, for its poll loop; the target's ends
//! are blocking. Each target closes every inherited descriptor above 2 but
//! its own two channel ends, close-on-exec or not (the other targets'
//! channel ends, other Workers' pipes, files and sockets the embedder
//! opened, a saved copy of its stdout): a channel then reports EOF as soon
//! as its only real peer is gone, and nothing a task runs can write to, or
//! keep open, a descriptor of the parent. Standard input, output and error (0, 1, 2) are kept:
//! they are the target's own (what a callable prints goes where the
//! parent's stdout and stderr go at fork time).
//!
//! Death is seen without the channels: the parent opens a pidfd for each
//! target right after forking it ([`TargetProcess::pidfd`], readable once
//! the process has ended), so a process that user code forked inside a
//! target, and that still holds copies of its channel ends, cannot hide
//! the target's death. And such a process cannot use them: each target
//! registers a `pthread_atfork` child handler that points both of its
//! channel descriptors at `/dev/null` in the child of any `fork` made
//! through the C library (Python's `os.fork` included), and the target's
//! code checks [`is_target_process`] before it reads a control or writes a
//! reply, ending any other process that reaches it with
//! [`FORKED_EXIT_CODE`] (a fork made by a raw system call, which runs no
//! handler, is stopped there).
//!
//! The runtime's fork hooks ([`Runtime::before_fork`] and the after-fork
//! ones) run around each `fork`. A runtime whose state lives on in targets
//! ([`Runtime::keeps_inherited_descriptors`], an inherited Python
//! interpreter) keeps the descriptors it inherits: the target then closes
//! only the descriptors callreg itself opened (every Worker's channel
//! ends, pidfds and staged payloads, tracked in a process-wide set,
//! [`TrackedFd`]), not the interpreter's open files.
//!
//! After start the parent runs threads and never forks again: a target
//! forked later comes from the template process
//! ([`super::zygote`]), which forks it with the same per-fork code as
//! [`spawn_targets`] and reaps it; [`TargetProcess`] hides the difference.
//!
//! A target: ignores SIGINT (Ctrl-C in a terminal reaches the parent only);
//! asks the kernel for SIGKILL when the thread that forked it ends
//! (`PR_SET_PDEATHSIG`) and checks `getppid` right after, closing the race
//! with a parent that died before the request; runs its body inside
//! `catch_unwind` and ends with `_exit`, so no destructor of the parent's
//! state ever runs in a target.

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{self, SigHandler, Signal};
use nix::sys::socket::{
    recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags,
    SockFlag, SockType, UnixAddr,
};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{ForkResult, Pid};

use super::sys::{
    clear_process_mark, mark_process, pidfd_open, pidfd_send_signal, process_marked,
    set_nonblocking, tracked,
};
use crate::runtime::Runtime;

pub use super::sys::{Exit, ProcessError, TrackedFd};

/// Exit status of a target whose body panicked.
pub const PANIC_EXIT_CODE: i32 = 101;

/// Exit status of a target that found its parent already gone at start.
pub const ORPHAN_EXIT_CODE: i32 = 102;

/// Exit status of a process forked inside a target (by user code) that
/// reached the target's protocol code: it is not the target, so it never
/// reads a control or writes a reply.
pub const FORKED_EXIT_CODE: i32 = 107;

/// The least stack a target's runtime thread gets: Rust's own default for
/// a spawned thread, 2 MiB.
const MIN_RUNTIME_STACK: usize = 2 << 20;

/// The most stack a target's runtime thread gets: 1 GiB (beyond that, a
/// soft `RLIMIT_STACK` is a "no limit" in all but name).
const MAX_RUNTIME_STACK: usize = 1 << 30;

/// The stack size (bytes) of a target's threads that run the runtime's
/// code: its control thread (the target's main thread, a copy of the
/// Worker's forking thread) and its task thread. It is what
/// `pthread_create` gives a thread of this process by default, so that
/// the runtime's recursion (a deeply nested result being pickled, a
/// recursive task) reaches as deep as in a thread of the parent's own
/// interpreter (`specs/threads.md`, "Roles", target threads): the soft
/// `RLIMIT_STACK` (2 MiB when it is unlimited or cannot be read, as
/// glibc does), at least [`MIN_RUNTIME_STACK`] and at most
/// [`MAX_RUNTIME_STACK`]. Address space only: pages are used as the
/// stack grows into them.
pub(crate) fn runtime_thread_stack() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the valid pointer given.
    let read = unsafe { libc::getrlimit(libc::RLIMIT_STACK, &mut limit) } == 0;
    if !read || limit.rlim_cur == libc::RLIM_INFINITY {
        return MIN_RUNTIME_STACK;
    }
    usize::try_from(limit.rlim_cur)
        .unwrap_or(MAX_RUNTIME_STACK)
        .clamp(MIN_RUNTIME_STACK, MAX_RUNTIME_STACK)
}

/// The target's own pid, set in the target right after fork (0 elsewhere).
static TARGET_PID: AtomicI32 = AtomicI32::new(0);

/// The target's channel descriptors (control, reply), for the at-fork
/// child handler; -1 when unset.
static CHANNEL_FDS: [AtomicI32; 2] = [AtomicI32::new(-1), AtomicI32::new(-1)];

/// Whether this process is a target itself (not its parent, and not a
/// process forked inside it): only then may it use the target's channels.
/// Checked before every control read and reply write, so it makes no
/// system call where the kernel marks pages wiped on fork (the target's
/// mark, `sys::mark_process`); elsewhere it compares process ids.
pub fn is_target_process() -> bool {
    if let Some(marked) = process_marked() {
        return marked;
    }
    let target = TARGET_PID.load(Ordering::Relaxed);
    target != 0 && target == nix::unistd::getpid().as_raw()
}

/// Ends this process with [`FORKED_EXIT_CODE`] unless it is the target.
pub fn exit_unless_target() {
    if !is_target_process() {
        // SAFETY: `_exit` ends a process forked inside a target without
        // running anything of the target's state.
        unsafe { libc::_exit(FORKED_EXIT_CODE) }
    }
}

/// The at-fork child handler: points the target's channel descriptors at
/// `/dev/null` (the child can neither read controls nor write replies
/// through them, and the numbers stay taken, so no file the child opens
/// later can be mistaken for them). Only async-signal-safe calls.
extern "C" fn after_fork_in_child() {
    if TARGET_PID.load(Ordering::Relaxed) == 0 {
        return;
    }
    // SAFETY: open, dup3 and close are async-signal-safe; the path is a
    // NUL-terminated literal.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        for fd in &CHANNEL_FDS {
            let fd = fd.load(Ordering::Relaxed);
            if fd >= 0 {
                if null >= 0 {
                    libc::dup3(null, fd, libc::O_CLOEXEC);
                } else {
                    libc::close(fd);
                }
            }
        }
        if null >= 0 {
            libc::close(null);
        }
    }
}

/// Runs in the template process right after fork: it is no target, so
/// the at-fork handler of a target it was forked from (a Worker built
/// inside a target) must leave alone the descriptors it forks with, which
/// may reuse the numbers of that target's (closed) channels.
pub(crate) fn forget_target() {
    clear_process_mark();
    TARGET_PID.store(0, Ordering::Relaxed);
    for fd in &CHANNEL_FDS {
        fd.store(-1, Ordering::Relaxed);
    }
}

/// Runs in the target right after fork: records its pid and channel
/// descriptors and registers [`after_fork_in_child`].
fn guard_channels(control: RawFd, reply: RawFd) {
    TARGET_PID.store(nix::unistd::getpid().as_raw(), Ordering::Relaxed);
    mark_process();
    CHANNEL_FDS[0].store(control, Ordering::Relaxed);
    CHANNEL_FDS[1].store(reply, Ordering::Relaxed);
    // SAFETY: registers a handler with no prepare or parent part; the
    // handler only makes async-signal-safe calls.
    unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
}

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

/// The number of live threads of this process, from `/proc/self/task`:
/// a thread that ended (joined, or exiting) can stay listed for a moment
/// after `pthread_join` returned, as a zombie or dead task; those are not
/// counted, nor one that vanished while it was read.
///
/// # Errors
/// [`ProcessError::Os`] when the directory cannot be read.
pub fn thread_count() -> Result<usize, ProcessError> {
    let entries = std::fs::read_dir("/proc/self/task").map_err(|e| ProcessError::Os {
        operation: "/proc/self/task",
        errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
    })?;
    Ok(entries
        .filter_map(Result::ok)
        .filter(|entry| {
            std::fs::read_to_string(entry.path().join("stat"))
                .ok()
                .and_then(|stat| task_state(&stat))
                .is_some_and(|state| !matches!(state, 'Z' | 'X' | 'x'))
        })
        .count())
}

/// The state letter of a `/proc/PID/task/TID/stat` line: the first field
/// after the command, which is parenthesised and may hold any byte.
fn task_state(stat: &str) -> Option<char> {
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// The target's ends of its two channels, handed to the target body.
#[derive(Debug)]
pub struct TargetEnds {
    /// The target's index (0-based) among the Worker's targets.
    pub index: usize,
    /// The target's end of the control socket (blocking; read it with
    /// [`receive_control`]).
    pub control: OwnedFd,
    /// Write end of the reply socket (blocking).
    pub reply: OwnedFd,
}

/// The parent's view of one target process: its pid and the parent's
/// channel ends. Dropping it without [`TargetProcess::reap`] kills the target with
/// SIGKILL and reaps it, so no zombie is left.
///
/// A target is either the parent's own child ([`spawn_targets`]) or a
/// replacement ([`super::zygote::Zygote::spawn`]), a child of the
/// template process: the methods mean the same for both (for
/// a replacement, the template reaps it and reports how it ended, see
/// [`super::zygote`]).
#[derive(Debug)]
pub struct TargetProcess {
    index: usize,
    pid: Pid,
    // Shared so that a thread may poll them without the state lock: a
    // descriptor stays open until its last poller is done with it.
    control: Option<Arc<TrackedFd>>,
    reply: Arc<TrackedFd>,
    pidfd: Option<Arc<TrackedFd>>,
    exit: Option<Exit>,
    origin: Origin,
}

/// Who forked a target, hence who reaps it.
#[derive(Debug)]
pub(crate) enum Origin {
    /// This process: it reaps the target with `waitpid`.
    Direct,
    /// The template process: it reaps the target and reports its exit
    /// over its request socket, under this spawn serial.
    Zygote {
        /// The parent's side of the template process's request socket.
        link: std::sync::Arc<super::zygote_link::ZygoteLink>,
        /// The spawn request's serial, which the exit report names.
        serial: u64,
    },
}

impl TargetProcess {
    /// The parent's view of the target `forked`, forked by `origin`.
    pub(crate) fn new(
        index: usize,
        forked: Forked,
        pidfd: Option<TrackedFd>,
        origin: Origin,
    ) -> TargetProcess {
        TargetProcess {
            index,
            pid: forked.pid,
            control: Some(Arc::new(forked.control)),
            reply: Arc::new(forked.reply),
            pidfd: pidfd.map(Arc::new),
            exit: None,
            origin,
        }
    }

    /// The target's index (0-based).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The target's process id.
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// The parent's end of the control socket (non-blocking; write it with
    /// [`send_control`]), or `None` after [`TargetProcess::close_control`].
    pub fn control(&self) -> Option<BorrowedFd<'_>> {
        self.control.as_ref().map(|fd| fd.as_fd())
    }

    /// The parent's read end of the reply socket (non-blocking).
    pub fn reply(&self) -> BorrowedFd<'_> {
        self.reply.as_fd()
    }

    /// A pidfd of the target process, readable once it has ended (whoever
    /// else holds its channels), or `None` where the kernel has none
    /// (always `Some` for a replacement from the template process).
    pub fn pidfd(&self) -> Option<BorrowedFd<'_>> {
        self.pidfd.as_ref().map(|fd| fd.as_fd())
    }

    /// The control socket, shared: it stays open while the returned value
    /// lives, even if the target is closed or lost meanwhile (to `poll` it
    /// without holding the Worker's lock).
    pub fn control_shared(&self) -> Option<Arc<TrackedFd>> {
        self.control.clone()
    }

    /// The reply socket's read end, shared (see
    /// [`TargetProcess::control_shared`]).
    pub fn reply_shared(&self) -> Arc<TrackedFd> {
        self.reply.clone()
    }

    /// The pidfd, shared (see [`TargetProcess::control_shared`]).
    pub fn pidfd_shared(&self) -> Option<Arc<TrackedFd>> {
        self.pidfd.clone()
    }

    /// Closes the control socket: the target reads EOF and exits. The
    /// socket is shut down for writing first, so the EOF comes even while
    /// a copy of this end lives on in a process the parent forked.
    pub fn close_control(&mut self) {
        if let Some(control) = self.control.take() {
            let fd = control.as_fd().as_raw_fd();
            let _ = nix::sys::socket::shutdown(fd, nix::sys::socket::Shutdown::Write);
        }
    }

    /// How the target ended, once reaped.
    pub fn exit(&self) -> Option<Exit> {
        self.exit
    }

    /// Sends SIGKILL (fencing: a killed target is certain to hold nothing).
    /// A target already reaped is left alone (its pid may be reused); a
    /// replacement from the template process is signalled through its pidfd
    /// (`pidfd_send_signal`), which never reaches another process.
    ///
    /// # Errors
    /// [`ProcessError::Os`] when `kill` (or `pidfd_send_signal`) fails
    /// other than with `ESRCH` (the process has ended).
    pub fn kill(&self) -> Result<(), ProcessError> {
        if self.exit.is_some() {
            return Ok(());
        }
        let (operation, sent) = match (&self.origin, &self.pidfd) {
            (Origin::Zygote { .. }, Some(pidfd)) => (
                "pidfd_send_signal",
                pidfd_send_signal(pidfd.as_fd(), Signal::SIGKILL),
            ),
            _ => ("kill", signal::kill(self.pid, Signal::SIGKILL)),
        };
        match sent {
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(errno) => Err(ProcessError::Os { operation, errno }),
        }
    }

    /// Reaps the target if it has ended, without blocking; returns how it
    /// ended, or `None` while it runs (for a replacement from the template
    /// process: until
    /// the template's report of its exit has arrived, a moment after its
    /// pidfd turned readable).
    ///
    /// # Errors
    /// [`ProcessError::Os`] when `waitpid` fails (a replacement: when
    /// reading the template process's socket fails); for a replacement,
    /// [`ProcessError::ExitLost`] when the template died before reporting
    /// the ended target's exit.
    pub fn try_reap(&mut self) -> Result<Option<Exit>, ProcessError> {
        self.wait(Some(WaitPidFlag::WNOHANG))
    }

    /// Waits for the target to end (for at most `timeout`), then kills it
    /// with SIGKILL if it is still running, and reaps it.
    ///
    /// # Errors
    /// [`ProcessError::Os`] when `waitpid` or `kill` fails; for a
    /// replacement from the template process also [`ProcessError::ExitLost`] (as
    /// [`TargetProcess::try_reap`]) and [`ProcessError::ZygoteTimeout`]
    /// when the template has not reported the killed target's exit within
    /// [`super::zygote::REPORT_TIMEOUT`].
    pub fn reap(&mut self, timeout: Duration) -> Result<Exit, ProcessError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(exit) = self.try_reap()? {
                return Ok(exit);
            }
            if self.ended_unreported() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // An ended replacement needs no kill: its report is waited for
        // below, a short grace at most when its template does not send it
        // (`super::zygote::ENDED_REPORT_GRACE`).
        self.kill()?;
        loop {
            if let Some(exit) = self.wait(None)? {
                return Ok(exit);
            }
        }
    }

    /// Whether this is a replacement whose process has ended (its pidfd
    /// is readable) while its template has not reported its exit yet.
    fn ended_unreported(&self) -> bool {
        let (Origin::Zygote { .. }, Some(pidfd)) = (&self.origin, &self.pidfd) else {
            return false;
        };
        let mut fds = [nix::poll::PollFd::new(
            pidfd.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        matches!(nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO), Ok(n) if n > 0)
    }

    fn wait(&mut self, flags: Option<WaitPidFlag>) -> Result<Option<Exit>, ProcessError> {
        if let Some(exit) = self.exit {
            return Ok(Some(exit));
        }
        let exit = match &self.origin {
            Origin::Direct => match waitpid(self.pid, flags) {
                Ok(WaitStatus::Exited(_, code)) => Exit::Code(code),
                Ok(WaitStatus::Signaled(_, sig, _)) => Exit::Signal(sig as i32),
                Ok(_) | Err(Errno::EINTR) => return Ok(None),
                Err(errno) => {
                    return Err(ProcessError::Os {
                        operation: "waitpid",
                        errno,
                    })
                }
            },
            Origin::Zygote { link, serial } => {
                let Some(pidfd) = &self.pidfd else {
                    return Err(ProcessError::ExitLost {
                        pid: self.pid.as_raw(),
                    });
                };
                let blocking = flags.is_none();
                match link.wait_exit(*serial, self.pid, pidfd.as_fd(), blocking)? {
                    Some(exit) => exit,
                    None => return Ok(None),
                }
            }
        };
        self.exit = Some(exit);
        Ok(Some(exit))
    }
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        if self.exit.is_none() {
            // Closing the control socket first lets a healthy target exit on
            // its own; the kill covers a hung one.
            self.control = None;
            let _ = self.kill();
            let _ = self.wait(None);
        }
        if let Origin::Zygote { link, serial } = &self.origin {
            link.forget(*serial);
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
/// `policy` refuses; [`ProcessError::Os`] when counting threads, `shutdown`,
/// `socketpair` or `fork` fails.
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
    check_threads(policy)?;
    flush_std();
    let mut targets = Vec::with_capacity(count);
    for index in 0..count {
        let forked = fork_target(index, runtime, &before_body, &body)?;
        let pidfd = pidfd_open(forked.pid).map(TrackedFd::new);
        targets.push(TargetProcess::new(index, forked, pidfd, Origin::Direct));
    }
    Ok(targets)
}

/// How long [`check_threads`] lets a count above one settle before it
/// refuses: a thread that `pthread_join` already returned for is still
/// listed, as a running task, until the kernel finishes its exit (its
/// thread-id word is cleared, waking the joiner, before it is unlisted).
/// Such a thread vanishes within microseconds; a live one stays.
pub(crate) const THREAD_SETTLE: std::time::Duration = std::time::Duration::from_millis(50);

/// Refuses with [`ProcessError::Threaded`] when `policy` does and this
/// process runs other threads. A count above one is read again (every
/// millisecond, for up to [`THREAD_SETTLE`]) before the refusal, so that a
/// thread just joined does not count.
pub(crate) fn check_threads(policy: ThreadPolicy) -> Result<(), ProcessError> {
    if policy == ThreadPolicy::RefuseIfThreaded {
        let started = std::time::Instant::now();
        loop {
            let threads = thread_count()?;
            if threads <= 1 {
                break;
            }
            if started.elapsed() >= THREAD_SETTLE {
                return Err(ProcessError::Threaded { threads });
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    Ok(())
}

/// Flushes standard output and error, so that no buffered bytes are
/// written twice (once by the parent, once by a child).
pub(crate) fn flush_std() {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
}

/// The forking process's view of one target it just forked: the pid and
/// its ends of the target's two channels (non-blocking, close-on-exec).
#[derive(Debug)]
pub(crate) struct Forked {
    pub(crate) pid: Pid,
    pub(crate) control: TrackedFd,
    pub(crate) reply: TrackedFd,
}

/// Forks one target with index `index`: makes its control socket and
/// reply socket, forks ([`fork_child`]), and in the child records its
/// channels ([`guard_channels`]), runs `before_body(index)` then
/// `body(ends)`. Used by [`spawn_targets`] and by the template process
/// (`super::zygote`), so a target is the same whoever forked it.
pub(crate) fn fork_target<R, F, B>(
    index: usize,
    runtime: &R,
    before_body: &B,
    body: &F,
) -> Result<Forked, ProcessError>
where
    R: Runtime + ?Sized,
    F: Fn(TargetEnds) -> i32,
    B: Fn(usize),
{
    let os = |operation| move |errno| ProcessError::Os { operation, errno };
    let stream_pair = || {
        socketpair(
            AddressFamily::Unix,
            SockType::Stream,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(os("socketpair"))
    };
    let (control_write, control_read) = stream_pair()?;
    // The reply channel is a one-way stream socketpair, not a pipe: a
    // pipe's write end can be opened again through /proc/PID/fd by any
    // process of the same user (a forged reply); `open` refuses a socket.
    let (reply_read, reply_write) = stream_pair()?;
    nix::sys::socket::shutdown(reply_read.as_raw_fd(), nix::sys::socket::Shutdown::Write)
        .map_err(os("shutdown"))?;
    nix::sys::socket::shutdown(reply_write.as_raw_fd(), nix::sys::socket::Shutdown::Read)
        .map_err(os("shutdown"))?;
    set_nonblocking(control_write.as_fd()).map_err(os("fcntl"))?;
    set_nonblocking(reply_read.as_fd()).map_err(os("fcntl"))?;
    let (control, reply) = (TrackedFd::new(control_write), TrackedFd::new(reply_read));
    let keep = [control_read.as_raw_fd(), reply_write.as_raw_fd()];
    let pid = fork_child(runtime, &keep, move || {
        guard_channels(keep[0], keep[1]);
        before_body(index);
        body(TargetEnds {
            index,
            control: control_read,
            reply: reply_write,
        })
    })?;
    Ok(Forked {
        pid,
        control,
        reply,
    })
}

/// Forks a child of this process that keeps, of its descriptors above 2,
/// only `keep`, runs `child` and ends with `_exit` of the status it
/// returns (or [`PANIC_EXIT_CODE`] if it panics). Returns the child's pid
/// in the forking process, where `child` is dropped unrun.
///
/// Around the fork: [`Runtime::before_fork`], then
/// [`Runtime::after_fork_parent`] in the forking process (also when the
/// fork failed); [`Runtime::after_fork_child`] first in the child, then
/// [`prepare_child`] (SIGINT ignored, `PR_SET_PDEATHSIG` relative to the
/// forking thread, an orphan check), then the inherited descriptors are
/// closed ([`close_tracked`] when the runtime keeps inherited descriptors,
/// else [`close_inherited`]); `keep` becomes the child's tracked set.
///
/// The caller makes sure the process is single-threaded (or accepted the
/// risk): see [`ThreadPolicy`].
///
/// # Errors
/// [`ProcessError::Os`] when `fork` fails.
pub(crate) fn fork_child<R, C>(runtime: &R, keep: &[RawFd], child: C) -> Result<Pid, ProcessError>
where
    R: Runtime + ?Sized,
    C: FnOnce() -> i32,
{
    let parent = nix::unistd::getpid();
    runtime.before_fork();
    // Held across the fork: no other thread holds it then, and the
    // child reads the set through this guard (its only thread).
    let mut owned = Some(tracked());
    // SAFETY: the process is single-threaded here (checked by the caller,
    // or the caller accepted the risk, as `os.fork` does); the child only
    // calls async-signal-safe functions and the runtime's after-fork hook
    // until it has closed the inherited descriptors, and it never returns
    // from this function: it ends with `_exit`.
    let forked = unsafe { nix::unistd::fork() };
    if !matches!(forked, Ok(ForkResult::Child)) {
        drop(owned.take());
        runtime.after_fork_parent();
    }
    match forked.map_err(|errno| ProcessError::Os {
        operation: "fork",
        errno,
    })? {
        ForkResult::Parent { child } => Ok(child),
        ForkResult::Child => {
            // The parent's descriptors leave the set (closed below) and
            // this child's own ones join it, so that a process this child
            // forks closes them in turn; the lock is released before
            // `child`, which may fork (a Worker of its own, the targets of
            // a template process).
            let owned: Vec<RawFd> = match owned.take() {
                Some(mut set) => {
                    let parents = set.iter().copied().collect();
                    set.clear();
                    set.extend(keep.iter().copied());
                    parents
                }
                None => Vec::new(),
            };
            runtime.after_fork_child();
            let keeps_inherited = runtime.keeps_inherited_descriptors();
            let code = catch_unwind(AssertUnwindSafe(|| {
                prepare_child(parent);
                if keeps_inherited {
                    close_tracked(&owned, keep);
                } else {
                    close_inherited(keep);
                }
                child()
            }))
            .unwrap_or(PANIC_EXIT_CODE);
            // SAFETY: ends the child without running the parent's
            // destructors (inherited targets, staged payloads).
            unsafe { libc::_exit(code) }
        }
    }
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

/// Closes every descriptor above 2 except `keep`, close-on-exec or not:
/// they belong to the parent (other targets' pipe ends, other Workers,
/// the embedder's files) and would keep those pipes from reporting EOF, or
/// let a task write into the parent's output. The runtime needs none of
/// them: it opens what it uses (staged payloads, its own files) after this.
fn close_inherited(keep: &[RawFd]) {
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
        // SAFETY: the descriptor belongs to the parent's state, which this
        // target never uses (it ends with `_exit`, never dropping it); one
        // closed meanwhile (the directory's own) just fails with EBADF.
        unsafe { libc::close(fd) };
    }
}

/// Descriptors one [`receive_control`] call accepts: more than one message
/// could carry (the parent attaches at most one descriptor per `sendmsg`,
/// and Linux never merges two messages that carry descriptors into one
/// read).
const MAX_FDS_PER_READ: usize = 8;

/// Writes `bytes` (or a prefix of them) to a control socket, with `fd`
/// attached to the first byte written when given (`SCM_RIGHTS`: the
/// receiver gets its own descriptor of the same open file). Never raises
/// `SIGPIPE` (`MSG_NOSIGNAL`). Returns how many bytes were written; `fd`
/// went with them when that is more than 0.
///
/// # Errors
/// The `sendmsg` error (`EAGAIN` when the socket is full, `EPIPE` when the
/// peer is gone).
pub fn send_control(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> Result<usize, Errno> {
    let iov = [IoSlice::new(bytes)];
    let raw = fd.map(|fd| [fd.as_raw_fd()]);
    let cmsgs: Vec<ControlMessage<'_>> = raw
        .as_ref()
        .map(|r| ControlMessage::ScmRights(r))
        .into_iter()
        .collect();
    sendmsg::<UnixAddr>(
        socket.as_raw_fd(),
        &iov,
        &cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
}

/// Reads what a control socket holds into `buffer`, without waiting
/// (`MSG_DONTWAIT`: `EAGAIN` when it holds nothing); descriptors that came with the bytes are appended
/// to `fds` in arrival order, close-on-exec (`MSG_CMSG_CLOEXEC`). Returns
/// the number of bytes read, 0 at EOF.
///
/// # Errors
/// The `recvmsg` error (`EAGAIN`: nothing to read now); `ENOBUFS` when
/// more descriptors came than one read accepts (never sent by a parent: a
/// broken channel).
pub fn receive_control(
    socket: BorrowedFd<'_>,
    buffer: &mut [u8],
    fds: &mut VecDeque<OwnedFd>,
) -> Result<usize, Errno> {
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS_PER_READ]);
    let mut iov = [IoSliceMut::new(buffer)];
    let message = recvmsg::<UnixAddr>(
        socket.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
    )?;
    for cmsg in message.cmsgs()? {
        if let ControlMessageOwned::ScmRights(received) = cmsg {
            for raw in received {
                // SAFETY: the kernel just installed `raw` in this process
                // for this message; nothing else owns it.
                fds.push_back(unsafe { OwnedFd::from_raw_fd(raw) });
            }
        }
    }
    Ok(message.bytes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_task_state_is_read_after_the_command_whatever_it_holds() {
        assert_eq!(super::task_state("12 (callreg) S 1 2 3"), Some('S'));
        assert_eq!(super::task_state("12 (a) b) Z 1 2"), Some('Z'));
        assert_eq!(super::task_state("12 (x"), None);
        assert!(super::thread_count().unwrap() >= 1);
    }
}
