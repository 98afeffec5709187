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
    /// or it ended first, or (for a command with
    /// [`super::zygote::TemplateCommand::before_ready`]) it was not ready
    /// by the deadline; the latter two name what it does before.
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

/// A fresh anonymous page advised `MADV_WIPEONFORK` (Linux 4.14) whose
/// first byte holds a 1: the kernel gives every child whose memory is a
/// copy of this process's (`fork`, `clone` without `CLONE_VM`, however it
/// was called) a zeroed page instead, so [`mark_cleared`] tells a child
/// from the process that marked the page without a system call. `None`
/// where the advice is refused (an older kernel).
fn marked_page() -> Option<memmap2::MmapMut> {
    let mut page = memmap2::MmapMut::map_anon(1).ok()?;
    let addr = std::ptr::NonNull::new(page.as_mut_ptr().cast::<std::ffi::c_void>())?;
    // SAFETY: `addr` and `page.len()` are the mapping `page` owns
    // (page-aligned: a fresh anonymous mapping). The advice changes only
    // what a forked child finds in it, never this process's memory.
    unsafe {
        nix::sys::mman::madvise(
            addr,
            page.len(),
            nix::sys::mman::MmapAdvise::MADV_WIPEONFORK,
        )
    }
    .ok()?;
    page[0] = 1;
    Some(page)
}

/// Whether the mark at `mark` (the first byte of a [`marked_page`]) was
/// cleared: this is a child forked since the page was marked.
///
/// # Safety
/// `mark` points at the first byte of a marked page that is still mapped.
unsafe fn mark_cleared(mark: *const u8) -> bool {
    // SAFETY: the caller's contract. Volatile: the kernel, not this
    // program, clears it in a child.
    unsafe { std::ptr::read_volatile(mark) == 0 }
}

/// Tells whether this process is a child forked from the one that made
/// the marker: a [`marked_page`] read without a system call, or, where
/// the kernel refused the advice, a comparison of process ids (a
/// `getpid(2)` per look). The check the Worker makes on every call
/// ([`crate::io::Worker`], "Forked children").
#[derive(Debug)]
pub(crate) struct ForkMarker {
    /// The marked page; `None` where the advice was refused.
    page: Option<memmap2::MmapMut>,
    /// The process that made the marker.
    pid: u32,
}

impl ForkMarker {
    /// A marker of this process.
    pub(crate) fn new() -> ForkMarker {
        ForkMarker {
            page: marked_page(),
            pid: std::process::id(),
        }
    }

    /// Whether this is another process than the one that made the marker
    /// (a child forked from it).
    pub(crate) fn forked(&self) -> bool {
        match &self.page {
            // SAFETY: the first byte of the marked page `page` owns.
            Some(page) => unsafe { mark_cleared(page.as_ptr()) },
            None => std::process::id() != self.pid,
        }
    }

    /// Whether the marker reads the page (the kernel took the advice)
    /// rather than the process id.
    #[cfg(test)]
    fn wiped_on_fork(&self) -> bool {
        self.page.is_some()
    }
}

/// This process's mark as a target (null: none, or the advice was
/// refused): the first byte of a [`marked_page`] that is never unmapped.
static PROCESS_MARK: std::sync::atomic::AtomicPtr<u8> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// Marks this process (a target right after its fork): until
/// [`clear_process_mark`], [`process_marked`] says `Some(true)` here and
/// `Some(false)` in any child forked from it. The page is never unmapped.
/// `false` where the kernel refused the advice (then `process_marked`
/// says `None`).
pub(crate) fn mark_process() -> bool {
    let Some(page) = marked_page() else {
        clear_process_mark();
        return false;
    };
    let mut page = std::mem::ManuallyDrop::new(page);
    PROCESS_MARK.store(page.as_mut_ptr(), std::sync::atomic::Ordering::Relaxed);
    true
}

/// Forgets this process's mark (a process forked from a target that is
/// not one itself). The page stays mapped.
pub(crate) fn clear_process_mark() {
    PROCESS_MARK.store(std::ptr::null_mut(), std::sync::atomic::Ordering::Relaxed);
}

/// Whether this process is the one [`mark_process`] marked (`None`: no
/// mark to read). Async-signal-safe: one load and one read of memory.
pub(crate) fn process_marked() -> Option<bool> {
    let mark = PROCESS_MARK.load(std::sync::atomic::Ordering::Relaxed);
    if mark.is_null() {
        return None;
    }
    // SAFETY: a non-null mark is the first byte of a marked page that is
    // never unmapped (`mark_process`).
    Some(!unsafe { mark_cleared(mark) })
}

#[cfg(test)]
mod tests {
    use super::{clear_process_mark, mark_process, process_marked, ForkMarker};
    use nix::sys::wait::{waitpid, WaitStatus};
    use nix::unistd::{fork, ForkResult};

    /// Runs `child` in a forked child and returns its exit status.
    fn in_child(child: impl FnOnce() -> i32) -> i32 {
        // SAFETY: each test's child makes only system calls and memory
        // reads (no allocation, no lock), then `_exit`s: safe in a child
        // of a multithreaded process.
        match unsafe { fork() }.expect("fork") {
            ForkResult::Child => {
                let status = child();
                // SAFETY: ends the child without running this process's
                // exit handlers or destructors.
                unsafe { libc::_exit(status) }
            }
            ForkResult::Parent { child } => match waitpid(child, None).expect("waitpid") {
                WaitStatus::Exited(_, status) => status,
                other => panic!("the child ended with {other:?}"),
            },
        }
    }

    #[test]
    fn a_marker_says_forked_in_a_child_and_not_in_its_own_process() {
        let marker = ForkMarker::new();
        // This machine's kernel (Linux 4.14 or later) takes the advice.
        assert!(marker.wiped_on_fork());
        assert!(!marker.forked());
        assert_eq!(in_child(|| if marker.forked() { 7 } else { 8 }), 7);
        assert!(!marker.forked());
    }

    #[test]
    fn the_process_id_fallback_says_the_same() {
        let marker = ForkMarker {
            page: None,
            pid: std::process::id(),
        };
        assert!(!marker.forked());
        assert_eq!(in_child(|| if marker.forked() { 7 } else { 8 }), 7);
    }

    /// A process's mark, in a child standing for a target (the test
    /// process itself is none): marked there, not in a child forked from
    /// it, and gone once cleared.
    #[test]
    fn a_process_mark_holds_in_its_process_only() {
        let status = in_child(|| {
            if process_marked().is_some() || !mark_process() {
                return 1;
            }
            if process_marked() != Some(true) {
                return 2;
            }
            let child_says = in_child(|| i32::from(process_marked() == Some(false)));
            if child_says != 1 {
                return 3;
            }
            clear_process_mark();
            if process_marked().is_some() {
                return 4;
            }
            0
        });
        assert_eq!(status, 0);
        assert_eq!(process_marked(), None);
    }
}
