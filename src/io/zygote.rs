//! The template process (zygote): a thread-free process that forks
//! replacement targets for a parent that now runs threads; the parent
//! holds it by a [`Zygote`].
//!
//! Why: `fork` is only safe in a single-threaded process (a thread that
//! held a lock at fork time, the allocator's say, leaves it held forever
//! in the child; specs/design.md §5). [`super::process::spawn_targets`]
//! forks the targets at start, before the parent starts its IO thread;
//! after that the parent must never fork again. A target lost later is
//! replaced by a [`Zygote`]: at start, while still single-threaded, the
//! parent forks one template process ([`Zygote::fork`]), which stays
//! single-threaded for its whole life and forks each replacement on
//! request ([`Zygote::spawn`]). A replacement is forked exactly as a
//! target of `spawn_targets` is (the same function: channels, the
//! runtime's fork hooks, parent-death signal, descriptor hygiene, the
//! at-fork guard of its channels, `before_body(index)` then `body(ends)`,
//! `_exit` with its status), only from the template.
//!
//! What a replacement inherits: the template's memory, which is the
//! parent's memory at the time of [`Zygote::fork`] (whatever `body`
//! captured then, e.g. a startup snapshot), and none of the parent's
//! descriptors but its own two channel ends and 0, 1, 2. The template
//! closes every descriptor it inherits but its request socket, the way a
//! target does ([`super::process`]: all above 2, or only callreg's tracked
//! ones for a runtime that keeps inherited descriptors). The template sets
//! SIGCHLD to its default disposition (it must reap), so replacements
//! start with the default too, whatever the parent had.
//!
//! # The request socket
//!
//! One `SOCK_SEQPACKET` socket pair links the parent and the template (one
//! `sendmsg` is one message; a read returns one whole message, or 0 at
//! EOF). Integers are little-endian. The parent's end is non-blocking and
//! close-on-exec; the template's is blocking.
//!
//! Parent to template, 17 bytes:
//!
//! | bytes | field |
//! |---|---|
//! | 0 | `b'S'`: fork a replacement; `b'I'`: fork a target of the start, `b'L'` its last one ([`Zygote::spawn_startup`]) |
//! | 1..9 | serial (u64), unique per request to this template process |
//! | 9..17 | the target's index (u64), passed to `before_body` and in [`TargetEnds`] |
//!
//! Template to parent, 18 bytes each: a tag, the request's serial (u64,
//! bytes 1..9), then three fields `pid_or_errno` (i32, 9..13),
//! `exit_kind_or_operation` (u8, 13), `code_or_signal` (i32, 14..18):
//!
//! | tag | meaning | `pid_or_errno` | `exit_kind_or_operation` | `code_or_signal` | descriptors (`SCM_RIGHTS`) |
//! |---|---|---|---|---|---|
//! | `b'R'` | forked | pid | 0 | 0 | control socket end, reply socket read end, pidfd |
//! | `b'E'` | the fork failed | errno | operation ([`OPERATIONS`] index) | 0 | none |
//! | `b'X'` | the target ended | pid | 0: exited, 1: killed, 2: unknown (`waitpid` failed) | status or signal | none |
//!
//! Every `b'R'` or `b'E'` answers one request, in request order; the
//! `b'X'` of a serial always follows its `b'R'`. The template opens the
//! replacement's pidfd itself, right after the fork: it alone reaps the
//! replacement, so the pid cannot be reused before the pidfd exists (the
//! parent opening it after the reply arrived could race with the reap).
//! Replacements therefore need pidfds (Linux 5.3); without them a spawn
//! fails with [`ProcessError::Os`] `pidfd_open`.
//!
//! # Reaping and exit reports
//!
//! A replacement is the template's child, so only the template can
//! `waitpid` it. The template polls its request socket and the pidfd of
//! every live child; when a pidfd turns readable it reaps that child
//! (`waitpid`, so no zombie stays) and sends its `b'X'` report. The parent
//! reads the socket whenever a [`Zygote::spawn`] waits for its reply or a
//! replacement's [`TargetProcess::try_reap`]/`reap` looks for its report,
//! keeping the reports of the replacements still held (by serial) until
//! each is asked for. So for a replacement `try_reap` answers `None` until
//! the report has arrived, a moment after its pidfd turned readable;
//! `kill` signals through the pidfd (`pidfd_send_signal`), never a reused
//! pid.
//!
//! # Lifetime
//!
//! * The template gets `PR_SET_PDEATHSIG` (SIGKILL) relative to the thread
//!   that called [`Zygote::fork`] (checked against a parent that died
//!   first), and ends when its request socket reports EOF.
//! * Replacements get `PR_SET_PDEATHSIG` (SIGKILL) relative to the
//!   template: a replacement lives no longer than its template.
//!   [`Zygote::close`] (or dropping the [`Zygote`]) ends the template,
//!   which first kills every replacement still running (SIGKILL), reaps
//!   them and reports each (`Exit::Signal(9)` for those it killed), then
//!   exits; the parent reaps the template (its own child). Keep the
//!   [`Zygote`] for as long as its replacements should serve.
//! * A template that dies abruptly (killed) reports nothing more: its
//!   replacements are killed by their parent-death signal, and a held
//!   replacement whose report never came answers `try_reap` with
//!   [`ProcessError::ExitLost`] once its pidfd shows it ended.
//! * A spawn waits at most the spawn timeout
//!   ([`Zygote::set_spawn_timeout`], [`DEFAULT_SPAWN_TIMEOUT`]); a reply
//!   that arrives after its spawn gave up is discarded, its target killed
//!   through the pidfd that came with it.

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{self, Signal};
use nix::sys::socket::{
    sendmsg, shutdown, socketpair, AddressFamily, ControlMessage, MsgFlags, Shutdown, SockFlag,
    SockType, UnixAddr,
};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::process::{
    check_threads, flush_std, forget_target, fork_child, fork_target, Forked, Origin, TargetEnds,
    TargetProcess, ThreadPolicy,
};
use super::sys::{pidfd_open, set_nonblocking, Exit, ProcessError, TrackedFd};
use super::zygote_link::{decode_request, LinkState, Message, SpawnKind, ZygoteLink, REQUEST_LEN};
use crate::runtime::Runtime;

pub use super::zygote_link::{ENDED_REPORT_GRACE, OPERATIONS, REPORT_TIMEOUT};

pub mod exec;

pub use exec::{ExecTemplate, TemplateCommand};

/// How long [`Zygote::spawn`] waits for the template's reply unless set
/// otherwise ([`Zygote::set_spawn_timeout`]).
pub const DEFAULT_SPAWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether process `pid` is stopped (state `T` or `t` in
/// `/proc/PID/stat`): a stopped template answers nothing until continued.
fn is_stopped(pid: Pid) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw())) else {
        return false;
    };
    // The state follows the parenthesised command name, which may hold
    // spaces and parentheses itself.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .is_some_and(|state| state == "T" || state == "t")
}

/// Exit status of a template whose request socket failed other than by EOF.
const TEMPLATE_ERROR_EXIT_CODE: i32 = 1;

/// A forked template process that forks replacement targets on request
/// (see the module documentation). Dropping it is [`Zygote::close`].
#[derive(Debug)]
pub struct Zygote {
    pid: Pid,
    link: Arc<ZygoteLink>,
    spawn_timeout: Duration,
    /// How the template ended, once reaped ([`Zygote::reap_if_ended`] or
    /// [`Zygote::close`]).
    exit: Mutex<Option<Exit>>,
}

impl Zygote {
    /// Forks the template process; call it while the process is
    /// single-threaded (at start, as [`super::process::spawn_targets`]).
    ///
    /// Each later [`Zygote::spawn`]`(index)` forks, from the template, a
    /// target that runs `before_body(index)` then `body(ends)` and exits
    /// with the status `body` returns ([`super::process::PANIC_EXIT_CODE`]
    /// if either panics). Both closures, and whatever they capture, are
    /// the template's copy, made now: state the parent changes later is
    /// not seen by replacements.
    ///
    /// `runtime`'s fork hooks run around this fork (as for a target:
    /// [`Runtime::after_fork_child`] first in the template) and, in the
    /// template, around each replacement's fork. Standard output and error
    /// are flushed first. The template receives SIGKILL when the calling
    /// thread ends (`PR_SET_PDEATHSIG`): call it from a thread that lives
    /// as long as the template process should.
    ///
    /// # Errors
    /// [`ProcessError::Threaded`] when the process runs other threads and
    /// `policy` refuses; [`ProcessError::Os`] when counting threads,
    /// `socketpair`, `fcntl` or `fork` fails.
    pub fn fork<R, F, B>(
        policy: ThreadPolicy,
        runtime: &R,
        before_body: B,
        body: F,
    ) -> Result<Zygote, ProcessError>
    where
        R: Runtime + ?Sized,
        F: Fn(TargetEnds) -> i32,
        B: Fn(usize),
    {
        Zygote::fork_with_start(policy, runtime, || {}, before_body, body)
    }

    /// As [`Zygote::fork`], running `at_start` once in the template before
    /// it serves: e.g. to drop what the template inherited and does not
    /// need (the startup snapshot's bytes, which replacements get by
    /// replay), so that it does not hold them for its life.
    ///
    /// # Errors
    /// As [`Zygote::fork`].
    pub fn fork_with_start<R, S, F, B>(
        policy: ThreadPolicy,
        runtime: &R,
        at_start: S,
        before_body: B,
        body: F,
    ) -> Result<Zygote, ProcessError>
    where
        R: Runtime + ?Sized,
        S: FnOnce(),
        F: Fn(TargetEnds) -> i32,
        B: Fn(usize),
    {
        check_threads(policy)?;
        flush_std();
        let os = |operation| move |errno| ProcessError::Os { operation, errno };
        let (parent_end, template_end) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(os("socketpair"))?;
        set_nonblocking(parent_end.as_fd()).map_err(os("fcntl"))?;
        let parent_end = TrackedFd::new(parent_end);
        let keep = [template_end.as_raw_fd()];
        let pid = fork_child(runtime, &keep, move || {
            forget_target();
            // Reaping needs the default disposition: an inherited SIG_IGN
            // would have the kernel reap the replacements unseen.
            // SAFETY: installing SIG_DFL has no handler code to be unsafe
            // about.
            let _ = unsafe { signal::signal(Signal::SIGCHLD, signal::SigHandler::SigDfl) };
            at_start();
            Template {
                socket: TrackedFd::new(template_end),
                runtime,
                before_body: &before_body,
                body: &|ends, _startup| body(ends),
                after_start: &|| {},
                children: Vec::new(),
            }
            .run()
        })?;
        Ok(Zygote {
            pid,
            link: Arc::new(ZygoteLink {
                state: Mutex::new(LinkState::new(parent_end)),
            }),
            spawn_timeout: DEFAULT_SPAWN_TIMEOUT,
            exit: Mutex::new(None),
        })
    }

    /// The template's process id.
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// Sets how long each [`Zygote::spawn`] waits for the template's reply.
    pub fn set_spawn_timeout(&mut self, timeout: Duration) {
        self.spawn_timeout = timeout;
    }

    /// Asks the template to fork a target with index `index` and waits
    /// (at most the spawn timeout) for its channels; returns the parent's
    /// view of it, with a pidfd, as [`super::process::spawn_targets`]
    /// returns its targets. Safe to call from any thread of a threaded
    /// process (the parent does not fork). Calls are serialized, with each
    /// other and with the replacements' `try_reap`/`reap`, which wait for
    /// a spawn in progress (one fork in the template; at most the spawn
    /// timeout).
    ///
    /// # Errors
    /// [`ProcessError::ZygoteGone`] after [`Zygote::close`] or when the
    /// template has died; [`ProcessError::Os`] when the template's
    /// `socketpair`, `pipe2`, `fcntl`, `fork` or `pidfd_open` failed (the
    /// operation it names), or the parent's `sendmsg`/`recvmsg`/`poll` on
    /// the request socket failed; [`ProcessError::ZygoteTimeout`] when no
    /// reply came within the spawn timeout.
    pub fn spawn(&self, index: usize) -> Result<TargetProcess, ProcessError> {
        self.request(index, SpawnKind::Replacement)
    }

    /// As [`Zygote::spawn`], for a target of the start: the template of
    /// [`Zygote::exec`] forks it with the startup setup it was given (the
    /// snapshot installed at once) instead of the empty one of
    /// replacements. `last`: this is the start's last target, after which
    /// the template drops the startup snapshot's bytes (replacements get
    /// every registration by replay), so that it does not hold them for
    /// its life. The template of [`Zygote::fork`] has one body only, and
    /// dropped what it inherited as it started: this is [`Zygote::spawn`]
    /// there.
    ///
    /// # Errors
    /// As [`Zygote::spawn`].
    pub fn spawn_startup(&self, index: usize, last: bool) -> Result<TargetProcess, ProcessError> {
        self.request(
            index,
            if last {
                SpawnKind::LastStartup
            } else {
                SpawnKind::Startup
            },
        )
    }

    fn request(&self, index: usize, kind: SpawnKind) -> Result<TargetProcess, ProcessError> {
        let mut state = self.link.lock();
        if state.closed || state.eof {
            return Err(ProcessError::ZygoteGone);
        }
        let serial = state.next_serial;
        state.next_serial += 1;
        state.awaiting.insert(serial);
        let deadline = Instant::now() + self.spawn_timeout;
        let outcome = state.request(serial, index, kind, deadline, self.spawn_timeout);
        state.awaiting.remove(&serial);
        let (pid, [control, reply, pidfd]) = outcome?;
        let forked = Forked {
            pid,
            control: TrackedFd::new(control),
            reply: TrackedFd::new(reply),
        };
        let origin = Origin::Zygote {
            link: self.link.clone(),
            serial,
        };
        Ok(TargetProcess::new(
            index,
            forked,
            Some(TrackedFd::new(pidfd)),
            origin,
        ))
    }

    /// Reaps the template if it ends within `within` (checked every
    /// millisecond; it is not killed), so that a template that died is not
    /// left a zombie until [`Zygote::close`]: how it ended, or `None` while
    /// it runs (or when `waitpid` fails). Its request socket reads end of
    /// file a moment before it can be reaped: give it a few milliseconds.
    pub fn reap_if_ended(&self, within: Duration) -> Option<Exit> {
        let deadline = Instant::now() + within;
        let mut exit = self.exit.lock().unwrap_or_else(|p| p.into_inner());
        while exit.is_none() {
            match waitpid(self.pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(_, code)) => *exit = Some(Exit::Code(code)),
                Ok(WaitStatus::Signaled(_, sig, _)) => *exit = Some(Exit::Signal(sig as i32)),
                Ok(_) | Err(Errno::EINTR) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                _ => break,
            }
        }
        *exit
    }

    fn ended(&self, exit: Exit) -> Exit {
        *self
            .exit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(exit)
    }

    /// Ends the template: shuts the parent's sending side of the request
    /// socket (the template reads EOF), which kills, reaps and reports
    /// every replacement still running, then exits; waits (at most
    /// [`REPORT_TIMEOUT`], reading the reports meanwhile) and reaps it,
    /// killing it first if it is still running then. Returns how the
    /// template ended (`Exit::Code(0)` normally); a second call returns the
    /// same. Reports of replacements stay readable by their
    /// [`TargetProcess`]es.
    ///
    /// # Errors
    /// [`ProcessError::Os`] when `waitpid` or `kill` of the template fails.
    pub fn close(&mut self) -> Result<Exit, ProcessError> {
        if let Some(exit) = *self.exit.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(exit);
        }
        {
            let mut state = self.link.lock();
            state.closed = true;
            let _ = shutdown(state.socket.as_fd().as_raw_fd(), Shutdown::Write);
        }
        // A stopped template would sit out the whole timeout: killed at once.
        let deadline = if is_stopped(self.pid) {
            Instant::now()
        } else {
            Instant::now() + REPORT_TIMEOUT
        };
        let mut killed = false;
        loop {
            // Reading the reports keeps a template with many of them to
            // send from blocking on a full socket.
            let _ = self.link.lock().drain();
            let flags = (!killed).then_some(WaitPidFlag::WNOHANG);
            match waitpid(self.pid, flags) {
                Ok(WaitStatus::Exited(_, code)) => return Ok(self.ended(Exit::Code(code))),
                Ok(WaitStatus::Signaled(_, sig, _)) => {
                    return Ok(self.ended(Exit::Signal(sig as i32)))
                }
                Ok(_) | Err(Errno::EINTR) => {}
                Err(errno) => {
                    return Err(ProcessError::Os {
                        operation: "waitpid",
                        errno,
                    })
                }
            }
            if !killed && Instant::now() >= deadline {
                // The template is our unreaped child: its pid is its own.
                match signal::kill(self.pid, Signal::SIGKILL) {
                    Ok(()) | Err(Errno::ESRCH) => killed = true,
                    Err(errno) => {
                        return Err(ProcessError::Os {
                            operation: "kill",
                            errno,
                        })
                    }
                }
            } else if !killed {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// A replacement the template forked and has not reaped yet.
struct Child {
    serial: u64,
    pid: Pid,
    pidfd: TrackedFd,
}

/// The template process's state (it runs only in the template). `body`
/// is given whether the target is one of the start (`b'I'`).
struct Template<'a, R: ?Sized, B, F> {
    socket: TrackedFd,
    runtime: &'a R,
    before_body: &'a B,
    body: &'a F,
    /// Runs once the start's last target is forked (a `b'L'` request).
    after_start: &'a dyn Fn(),
    children: Vec<Child>,
}

impl<R, B, F> Template<'_, R, B, F>
where
    R: Runtime + ?Sized,
    F: Fn(TargetEnds, bool) -> i32,
    B: Fn(usize),
{
    /// Serves requests until EOF of the request socket (or a failure of
    /// it), reaping and reporting children as they end; then kills, reaps
    /// and reports the rest. Returns the template's exit status.
    fn run(mut self) -> i32 {
        let status = self.serve();
        for child in std::mem::take(&mut self.children) {
            // An unreaped child of this process: its pid is its own.
            let _ = signal::kill(child.pid, Signal::SIGKILL);
            if let Some(exit) = reap(child.pid, None) {
                let _ = self.send(&Message::exit(child.serial, child.pid, exit), &[]);
            }
        }
        status
    }

    fn serve(&mut self) -> i32 {
        loop {
            let mut fds = Vec::with_capacity(self.children.len() + 1);
            fds.push(PollFd::new(self.socket.as_fd(), PollFlags::POLLIN));
            fds.extend(
                self.children
                    .iter()
                    .map(|c| PollFd::new(c.pidfd.as_fd(), PollFlags::POLLIN)),
            );
            match nix::poll::poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(_) => return TEMPLATE_ERROR_EXIT_CODE,
            }
            let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
            let request = ready(&fds[0]);
            let ended: Vec<usize> = (1..fds.len()).filter(|i| ready(&fds[*i])).collect();
            drop(fds);
            for i in ended.into_iter().rev() {
                let child = &self.children[i - 1];
                if let Some(exit) = reap(child.pid, Some(WaitPidFlag::WNOHANG)) {
                    let child = self.children.remove(i - 1);
                    if self
                        .send(&Message::exit(child.serial, child.pid, exit), &[])
                        .is_err()
                    {
                        return TEMPLATE_ERROR_EXIT_CODE;
                    }
                }
            }
            if request {
                let mut bytes = [0u8; REQUEST_LEN + 1];
                let len = match nix::sys::socket::recv(
                    self.socket.as_fd().as_raw_fd(),
                    &mut bytes,
                    MsgFlags::empty(),
                ) {
                    Ok(0) => return 0,
                    Ok(len) => len,
                    Err(Errno::EINTR | Errno::EAGAIN) => continue,
                    Err(_) => return TEMPLATE_ERROR_EXIT_CODE,
                };
                let Some((serial, index, kind)) = decode_request(&bytes[..len]) else {
                    return TEMPLATE_ERROR_EXIT_CODE;
                };
                if self.spawn(serial, index, kind.startup()).is_err() {
                    return TEMPLATE_ERROR_EXIT_CODE;
                }
                if kind == SpawnKind::LastStartup {
                    (self.after_start)();
                }
            }
        }
    }

    /// Forks the target `index` and answers the request `serial`; fails
    /// only when the answer cannot be sent.
    fn spawn(&mut self, serial: u64, index: usize, startup: bool) -> Result<(), Errno> {
        match self.fork(index, startup) {
            Ok((forked, pidfd)) => {
                let reply = Message {
                    tag: b'R',
                    serial,
                    pid_or_errno: forked.pid.as_raw(),
                    exit_kind_or_operation: 0,
                    code_or_signal: 0,
                };
                let fds = [
                    forked.control.as_fd().as_raw_fd(),
                    forked.reply.as_fd().as_raw_fd(),
                    pidfd.as_fd().as_raw_fd(),
                ];
                let sent = self.send(&reply, &fds);
                // The template's copies of the channel ends close here;
                // it keeps the pidfd to see the child end.
                drop(forked);
                self.children.push(Child {
                    serial,
                    pid: Pid::from_raw(reply.pid_or_errno),
                    pidfd,
                });
                sent
            }
            Err(error) => {
                let (operation, errno) = match error {
                    ProcessError::Os { operation, errno } => (operation, errno),
                    _ => ("template", Errno::EINVAL),
                };
                let operation = OPERATIONS
                    .iter()
                    .position(|o| *o == operation)
                    .unwrap_or(OPERATIONS.len() - 1);
                let message = Message {
                    tag: b'E',
                    serial,
                    pid_or_errno: errno as i32,
                    exit_kind_or_operation: u8::try_from(operation).unwrap_or(u8::MAX),
                    code_or_signal: 0,
                };
                self.send(&message, &[])
            }
        }
    }

    /// Forks one target and opens its pidfd (before anything can reap it).
    fn fork(&mut self, index: usize, startup: bool) -> Result<(Forked, TrackedFd), ProcessError> {
        let body = |ends| (self.body)(ends, startup);
        let forked = fork_target(index, self.runtime, self.before_body, &body)?;
        match pidfd_open(forked.pid) {
            Some(pidfd) => Ok((forked, TrackedFd::new(pidfd))),
            None => {
                let errno = Errno::last();
                // Unreaped child of this process: its pid is its own.
                let _ = signal::kill(forked.pid, Signal::SIGKILL);
                let _ = reap(forked.pid, None);
                Err(ProcessError::Os {
                    operation: "pidfd_open",
                    errno,
                })
            }
        }
    }

    /// Sends `message` with `fds` (blocking; never raises SIGPIPE).
    fn send(&self, message: &Message, fds: &[RawFd]) -> Result<(), Errno> {
        let bytes = message.encode();
        let cmsgs: Vec<ControlMessage<'_>> = if fds.is_empty() {
            Vec::new()
        } else {
            vec![ControlMessage::ScmRights(fds)]
        };
        loop {
            match sendmsg::<UnixAddr>(
                self.socket.as_fd().as_raw_fd(),
                &[IoSlice::new(&bytes)],
                &cmsgs,
                MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                Ok(_) => return Ok(()),
                Err(Errno::EINTR) => {}
                Err(errno) => return Err(errno),
            }
        }
    }
}

/// Reaps `pid` (a child of this process) if it has ended; blocking
/// without `flags`. `None` while it runs; `Some(None)` when `waitpid`
/// fails (the child is not waitable: how it ended is unknown).
fn reap(pid: Pid, flags: Option<WaitPidFlag>) -> Option<Option<Exit>> {
    loop {
        match waitpid(pid, flags) {
            Ok(WaitStatus::Exited(_, code)) => return Some(Some(Exit::Code(code))),
            Ok(WaitStatus::Signaled(_, sig, _)) => return Some(Some(Exit::Signal(sig as i32))),
            Err(Errno::EINTR) => {}
            Err(_) => return Some(None),
            Ok(_) if flags.is_none() => {}
            Ok(_) => return None,
        }
    }
}
