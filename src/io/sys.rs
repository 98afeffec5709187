//! The OS pieces [`super::process`] and [`super::zygote`] share: descriptors
//! tracked for closing in forked children ([`TrackedFd`]), pidfds, how a
//! process ended ([`Exit`]) and the errors of process control
//! ([`ProcessError`]). Re-exported by [`super::process`].

use std::collections::BTreeSet;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// Every descriptor a [`TrackedFd`] owns in this process.
static TRACKED: Mutex<BTreeSet<RawFd>> = Mutex::new(BTreeSet::new());

pub(super) fn tracked() -> MutexGuard<'static, BTreeSet<RawFd>> {
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

/// A pidfd for `pid` (`pidfd_open`, close-on-exec), or `None` where the
/// kernel has none (before Linux 5.3): death is then seen through the
/// channels only.
pub(crate) fn pidfd_open(pid: Pid) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new
    // descriptor, which nothing else owns.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
    let fd = RawFd::try_from(fd).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: `fd` was just returned by the kernel to this process.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
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
    /// An OS call failed (for the template process, in the parent or in
    /// the template:
    /// the template reports its own failures, e.g. `fork`, `socketpair`).
    #[error("{operation} failed: {errno}")]
    Os {
        /// What was attempted (`"socketpair"`, `"fork"`, `"/proc/self/task"`, …).
        operation: &'static str,
        /// The OS error.
        errno: Errno,
    },
    /// The template process is gone: [`super::zygote::Zygote::close`]
    /// ended it, or it died (killed, or its parent thread ended). It forks
    /// no more targets.
    #[error("the template process of replacement targets is gone: no more targets can be forked from it")]
    ZygoteGone,
    /// The template process did not answer in time: no reply to a spawn
    /// request within its spawn timeout, or no exit report of a
    /// killed replacement within [`super::zygote::REPORT_TIMEOUT`] (the
    /// template is stopped or overloaded).
    #[error("the template process of replacement targets did not answer {what} within {waited:?}")]
    ZygoteTimeout {
        /// What was awaited (`"a spawn request"`, `"an exit report"`).
        what: &'static str,
        /// How long it was awaited.
        waited: Duration,
    },
    /// A replacement from the template process has ended but its exit
    /// status is lost: the
    /// template died before it could report it (the replacement itself was
    /// killed by `PR_SET_PDEATHSIG` if it outlived the template), or its
    /// `waitpid` failed.
    /// [`TargetProcess::exit`](super::process::TargetProcess::exit) stays
    /// `None`.
    #[error("target process {pid} ended, but its exit status was lost with the template process that forked it")]
    ExitLost {
        /// The replacement's pid.
        pid: i32,
    },
    /// The template process of [`super::zygote::Zygote::exec`] did not
    /// become ready: it said why (e.g. a module it was to import failed),
    /// or it ended first.
    #[error("the template process did not start: {message}")]
    TemplateStart {
        /// What the template reported, or how it ended.
        message: String,
    },
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

/// `pidfd_send_signal(pidfd, signal)`: signals the process `pidfd` refers
/// to, never another one that reused its pid.
pub(crate) fn pidfd_send_signal(pidfd: BorrowedFd<'_>, signal: Signal) -> Result<(), Errno> {
    // SAFETY: pidfd_send_signal takes a descriptor, a signal number, a null
    // siginfo (the kernel fills in a kill-like one) and flags 0.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal as libc::c_int,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(Errno::last())
    }
}

pub(crate) fn set_nonblocking(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    use nix::fcntl::{fcntl, FcntlArg};
    let flags = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    Ok(())
}
