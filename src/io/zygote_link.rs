//! The parent's side of the template process's request socket
//! ([`ZygoteLink`]): spawn
//! requests and their replies, the exit reports of replacements (which a
//! [`TargetProcess`](super::process::TargetProcess) of a replacement reads
//! through it), and the socket's message format (see [`super::zygote`]).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::Signal;
use nix::sys::socket::{recvmsg, sendmsg, ControlMessageOwned, MsgFlags, UnixAddr};
use nix::unistd::Pid;

use super::sys::{pidfd_send_signal, Exit, ProcessError, TrackedFd};

/// How long a blocking wait for a replacement's exit report (the end of
/// [`TargetProcess::reap`](super::process::TargetProcess::reap), dropping
/// a [`TargetProcess`](super::process::TargetProcess)) and
/// [`Zygote::close`](super::zygote::Zygote::close)'s wait for the template
/// to exit last at most.
pub const REPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the exit report of a replacement that has ended (its pidfd is
/// readable) is waited for before it counts as lost: a template that runs
/// reports within milliseconds; one that is stopped (SIGSTOP) or stalled
/// would otherwise cost every replacement the whole [`REPORT_TIMEOUT`].
pub const ENDED_REPORT_GRACE: Duration = Duration::from_millis(250);

/// The operations a template reports a failure of (`b'E'`, field
/// `exit_kind_or_operation`),
/// by index; an operation not listed is reported as the last, `"template"`.
pub const OPERATIONS: [&str; 6] = [
    "socketpair",
    "shutdown",
    "fcntl",
    "fork",
    "pidfd_open",
    "template",
];

/// Length of a request (parent to template).
pub(super) const REQUEST_LEN: usize = 17;

/// Length of a message from the template.
const MESSAGE_LEN: usize = 18;

/// A message from the template (see the module documentation).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct Message {
    /// `b'R'` forked, `b'E'` the fork failed, `b'X'` the target ended.
    pub(super) tag: u8,
    /// The serial of the request it answers.
    pub(super) serial: u64,
    /// The target's pid (`b'R'`, `b'X'`) or the fork's errno (`b'E'`).
    pub(super) pid_or_errno: i32,
    /// How the target ended (`b'X'`: 0 exited, 1 killed, 2 unknown) or
    /// which operation failed (`b'E'`: an [`OPERATIONS`] index); 0 for
    /// `b'R'`.
    pub(super) exit_kind_or_operation: u8,
    /// The exit status or the killing signal (`b'X'`); 0 otherwise.
    pub(super) code_or_signal: i32,
}

impl Message {
    pub(super) fn encode(&self) -> [u8; MESSAGE_LEN] {
        let mut bytes = [0u8; MESSAGE_LEN];
        bytes[0] = self.tag;
        bytes[1..9].copy_from_slice(&self.serial.to_le_bytes());
        bytes[9..13].copy_from_slice(&self.pid_or_errno.to_le_bytes());
        bytes[13] = self.exit_kind_or_operation;
        bytes[14..18].copy_from_slice(&self.code_or_signal.to_le_bytes());
        bytes
    }

    fn decode(bytes: &[u8]) -> Option<Message> {
        let bytes: &[u8; MESSAGE_LEN] = bytes.try_into().ok()?;
        Some(Message {
            tag: bytes[0],
            serial: u64::from_le_bytes(bytes[1..9].try_into().ok()?),
            pid_or_errno: i32::from_le_bytes(bytes[9..13].try_into().ok()?),
            exit_kind_or_operation: bytes[13],
            code_or_signal: i32::from_le_bytes(bytes[14..18].try_into().ok()?),
        })
    }

    /// The exit report of `pid`; `None` when the template could not learn
    /// how it ended (`waitpid` failed).
    pub(super) fn exit(serial: u64, pid: Pid, exit: Option<Exit>) -> Message {
        let (exit_kind, code_or_signal) = match exit {
            Some(Exit::Code(code)) => (0, code),
            Some(Exit::Signal(signal)) => (1, signal),
            None => (2, 0),
        };
        Message {
            tag: b'X',
            serial,
            pid_or_errno: pid.as_raw(),
            exit_kind_or_operation: exit_kind,
            code_or_signal,
        }
    }
}

/// What a spawn request asks the template for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SpawnKind {
    /// A replacement (tag `b'S'`): the empty setup.
    Replacement,
    /// A target of the start (tag `b'I'`): it installs the startup
    /// snapshot.
    Startup,
    /// The start's last target (tag `b'L'`): as [`SpawnKind::Startup`],
    /// then the template drops the startup snapshot's bytes (replacements
    /// get every registration by replay).
    LastStartup,
}

impl SpawnKind {
    fn tag(self) -> u8 {
        match self {
            SpawnKind::Replacement => b'S',
            SpawnKind::Startup => b'I',
            SpawnKind::LastStartup => b'L',
        }
    }

    /// Whether the target installs the startup snapshot.
    pub(super) fn startup(self) -> bool {
        self != SpawnKind::Replacement
    }
}

fn encode_request(serial: u64, index: usize, kind: SpawnKind) -> [u8; REQUEST_LEN] {
    let mut bytes = [0u8; REQUEST_LEN];
    bytes[0] = kind.tag();
    bytes[1..9].copy_from_slice(&serial.to_le_bytes());
    bytes[9..17].copy_from_slice(&(index as u64).to_le_bytes());
    bytes
}

/// A request's serial, target index and kind.
pub(super) fn decode_request(bytes: &[u8]) -> Option<(u64, usize, SpawnKind)> {
    let bytes: &[u8; REQUEST_LEN] = bytes.try_into().ok()?;
    let kind = match bytes[0] {
        b'S' => SpawnKind::Replacement,
        b'I' => SpawnKind::Startup,
        b'L' => SpawnKind::LastStartup,
        _ => return None,
    };
    let serial = u64::from_le_bytes(bytes[1..9].try_into().ok()?);
    let index = usize::try_from(u64::from_le_bytes(bytes[9..17].try_into().ok()?)).ok()?;
    Some((serial, index, kind))
}

/// The parent's side of the template process, shared by the
/// [`Zygote`](super::zygote::Zygote) and the replacements it forked (which
/// read their exit reports through it).
#[derive(Debug)]
pub(crate) struct ZygoteLink {
    pub(super) state: Mutex<LinkState>,
}

/// What one spawn reply carries: the pid and the control, reply and
/// pidfd descriptors.
type Reply = (Pid, [OwnedFd; 3]);

#[derive(Debug)]
pub(super) struct LinkState {
    /// The parent's end of the request socket (non-blocking).
    pub(super) socket: TrackedFd,
    /// The template's end is closed: it has exited or died.
    pub(super) eof: bool,
    /// [`Zygote::close`](super::zygote::Zygote::close) was called: no more
    /// spawns.
    pub(super) closed: bool,
    pub(super) next_serial: u64,
    /// Serials of spawns still waiting for their reply.
    pub(super) awaiting: BTreeSet<u64>,
    /// Replies read for awaited serials, not yet taken.
    pub(super) replies: BTreeMap<u64, Result<Reply, ProcessError>>,
    /// Serials of replacements whose exit report is wanted.
    pub(super) live: BTreeSet<u64>,
    /// Exit reports read for live serials, not yet taken (`None`: the
    /// template could not learn how it ended).
    pub(super) exits: BTreeMap<u64, Option<Exit>>,
}

impl ZygoteLink {
    pub(super) fn lock(&self) -> MutexGuard<'_, LinkState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The exit of the replacement `serial` (`pid`, `pidfd`) once its
    /// report has arrived; with `blocking`, waits for it at most
    /// [`REPORT_TIMEOUT`].
    pub(crate) fn wait_exit(
        &self,
        serial: u64,
        pid: Pid,
        pidfd: BorrowedFd<'_>,
        blocking: bool,
    ) -> Result<Option<Exit>, ProcessError> {
        let mut state = self.lock();
        let deadline = blocking.then(|| Instant::now() + REPORT_TIMEOUT);
        let mut ended_at = None;
        loop {
            state.drain()?;
            if !state.live.contains(&serial) && !state.exits.contains_key(&serial) {
                // Already given up (its exit counted as lost): no report is
                // read for it any more.
                return Err(ProcessError::ExitLost { pid: pid.as_raw() });
            }
            if let Some(exit) = state.exits.remove(&serial) {
                state.live.remove(&serial);
                return exit
                    .map(Some)
                    .ok_or(ProcessError::ExitLost { pid: pid.as_raw() });
            }
            // No report can come any more: it ended (or will, by its
            // parent-death signal) unreported.
            let ended = state.eof && readable(pidfd, PollTimeout::ZERO)?;
            if ended {
                state.live.remove(&serial);
                return Err(ProcessError::ExitLost { pid: pid.as_raw() });
            }
            let Some(deadline) = deadline else {
                return Ok(None);
            };
            let now = Instant::now();
            if ended_at.is_none() && readable(pidfd, PollTimeout::ZERO)? {
                ended_at = Some(now);
            }
            if ended_at.is_some_and(|at| now.duration_since(at) >= ENDED_REPORT_GRACE) {
                // It ended and its template does not say how (stopped or
                // stalled): lost rather than waited for.
                state.live.remove(&serial);
                return Err(ProcessError::ExitLost { pid: pid.as_raw() });
            }
            if now >= deadline {
                return Err(ProcessError::ZygoteTimeout {
                    what: "an exit report",
                    waited: REPORT_TIMEOUT,
                });
            }
            let mut timeout = poll_timeout(deadline - now);
            if let Some(at) = ended_at {
                timeout = poll_timeout((at + ENDED_REPORT_GRACE).saturating_duration_since(now));
            }
            if state.eof {
                readable(pidfd, timeout)?;
            } else {
                readable(state.socket.as_fd(), timeout)?;
            }
        }
    }

    /// Drops what is kept for the replacement `serial` (it is dropped).
    pub(crate) fn forget(&self, serial: u64) {
        let mut state = self.lock();
        state.live.remove(&serial);
        state.exits.remove(&serial);
    }
}

impl LinkState {
    /// The state of a new link over the parent's end `socket`.
    pub(super) fn new(socket: TrackedFd) -> LinkState {
        LinkState {
            socket,
            eof: false,
            closed: false,
            next_serial: 0,
            awaiting: BTreeSet::new(),
            replies: BTreeMap::new(),
            live: BTreeSet::new(),
            exits: BTreeMap::new(),
        }
    }

    /// Sends the request `serial` and waits for its reply until `deadline`.
    pub(super) fn request(
        &mut self,
        serial: u64,
        index: usize,
        kind: SpawnKind,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Reply, ProcessError> {
        let request = encode_request(serial, index, kind);
        let timed_out = || ProcessError::ZygoteTimeout {
            what: "a spawn request",
            waited: timeout,
        };
        loop {
            let sent = sendmsg::<UnixAddr>(
                self.socket.as_fd().as_raw_fd(),
                &[IoSlice::new(&request)],
                &[],
                MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
                None,
            );
            match sent {
                Ok(_) => break,
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => {
                    // The template is busy sending reports: read them.
                    self.drain()?;
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(timed_out());
                    }
                    let mut fds = [PollFd::new(
                        self.socket.as_fd(),
                        PollFlags::POLLOUT | PollFlags::POLLIN,
                    )];
                    poll_retrying(&mut fds, poll_timeout(deadline - now))?;
                }
                Err(Errno::EPIPE | Errno::ECONNRESET) => return Err(ProcessError::ZygoteGone),
                Err(errno) => {
                    return Err(ProcessError::Os {
                        operation: "sendmsg",
                        errno,
                    })
                }
            }
        }
        loop {
            self.drain()?;
            if let Some(reply) = self.replies.remove(&serial) {
                return reply;
            }
            if self.eof {
                return Err(ProcessError::ZygoteGone);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(timed_out());
            }
            readable(self.socket.as_fd(), poll_timeout(deadline - now))?;
        }
    }

    /// Reads every message the socket holds, without blocking: keeps the
    /// replies of awaited spawns and the exit reports of live
    /// replacements; kills the target of a reply no spawn awaits.
    pub(super) fn drain(&mut self) -> Result<(), ProcessError> {
        while !self.eof {
            let mut bytes = [0u8; MESSAGE_LEN + 1];
            let mut space = nix::cmsg_space!([RawFd; 3]);
            let (len, fds) = {
                let mut iov = [IoSliceMut::new(&mut bytes)];
                let received = recvmsg::<UnixAddr>(
                    self.socket.as_fd().as_raw_fd(),
                    &mut iov,
                    Some(&mut space),
                    MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC,
                );
                let message = match received {
                    Ok(message) => message,
                    Err(Errno::EAGAIN) => return Ok(()),
                    Err(Errno::EINTR) => continue,
                    Err(Errno::ECONNRESET) => {
                        self.eof = true;
                        return Ok(());
                    }
                    Err(errno) => {
                        return Err(ProcessError::Os {
                            operation: "recvmsg",
                            errno,
                        })
                    }
                };
                let mut fds = Vec::new();
                if let Ok(cmsgs) = message.cmsgs() {
                    for cmsg in cmsgs {
                        if let ControlMessageOwned::ScmRights(received) = cmsg {
                            for raw in received {
                                // SAFETY: the kernel just installed `raw`
                                // in this process for this message;
                                // nothing else owns it.
                                fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
                            }
                        }
                    }
                }
                (message.bytes, fds)
            };
            if len == 0 {
                self.eof = true;
                return Ok(());
            }
            if let Some(message) = Message::decode(&bytes[..len]) {
                self.accept(message, fds);
            }
        }
        Ok(())
    }

    fn accept(&mut self, message: Message, fds: Vec<OwnedFd>) {
        let serial = message.serial;
        match message.tag {
            b'R' => {
                let Ok(fds) = <[OwnedFd; 3]>::try_from(fds) else {
                    return;
                };
                if self.awaiting.remove(&serial) {
                    // Live from now: its exit report may follow in this
                    // same read.
                    self.live.insert(serial);
                    self.replies
                        .insert(serial, Ok((Pid::from_raw(message.pid_or_errno), fds)));
                } else {
                    // Its spawn gave up: the target is not wanted.
                    let _ = pidfd_send_signal(fds[2].as_fd(), Signal::SIGKILL);
                }
            }
            b'E' if self.awaiting.remove(&serial) => {
                let operation = OPERATIONS
                    .get(usize::from(message.exit_kind_or_operation))
                    .copied()
                    .unwrap_or("template");
                let errno = Errno::from_raw(message.pid_or_errno);
                self.replies
                    .insert(serial, Err(ProcessError::Os { operation, errno }));
            }
            b'X' if self.live.contains(&serial) => {
                let exit = match message.exit_kind_or_operation {
                    0 => Some(Exit::Code(message.code_or_signal)),
                    1 => Some(Exit::Signal(message.code_or_signal)),
                    _ => None,
                };
                self.exits.insert(serial, exit);
            }
            _ => {}
        }
    }
}

/// A poll timeout of `left`, rounded up to whole milliseconds.
fn poll_timeout(left: Duration) -> PollTimeout {
    let millis = left.as_micros().div_ceil(1000);
    PollTimeout::try_from(millis).unwrap_or(PollTimeout::MAX)
}

/// Polls `fds`, retrying on `EINTR`.
fn poll_retrying(fds: &mut [PollFd<'_>], timeout: PollTimeout) -> Result<(), ProcessError> {
    loop {
        match nix::poll::poll(fds, timeout) {
            Ok(_) => return Ok(()),
            Err(Errno::EINTR) => {}
            Err(errno) => {
                return Err(ProcessError::Os {
                    operation: "poll",
                    errno,
                })
            }
        }
    }
}

/// Whether `fd` is readable (or hung up) within `timeout`.
pub(super) fn readable(fd: BorrowedFd<'_>, timeout: PollTimeout) -> Result<bool, ProcessError> {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    poll_retrying(&mut fds, timeout)?;
    Ok(fds[0].revents().is_some_and(|r| !r.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let message = Message::exit(7, Pid::from_raw(1234), Some(Exit::Signal(9)));
        assert_eq!(
            (message.exit_kind_or_operation, message.code_or_signal),
            (1, 9)
        );
        let unknown = Message::exit(8, Pid::from_raw(1), None);
        assert_eq!(Message::decode(&unknown.encode()), Some(unknown));
        assert_eq!(
            (unknown.exit_kind_or_operation, unknown.code_or_signal),
            (2, 0)
        );
        assert_eq!(Message::decode(&message.encode()), Some(message));
        assert_eq!(message.encode()[0], b'X');
        assert_eq!(Message::decode(&message.encode()[..17]), None);
        for (kind, tag, startup) in [
            (SpawnKind::Replacement, b'S', false),
            (SpawnKind::Startup, b'I', true),
            (SpawnKind::LastStartup, b'L', true),
        ] {
            assert_eq!(
                decode_request(&encode_request(u64::MAX, 3, kind)),
                Some((u64::MAX, 3, kind))
            );
            assert_eq!(encode_request(5, 0, kind)[0], tag);
            assert_eq!(kind.startup(), startup);
        }
        let mut wrong = encode_request(1, 2, SpawnKind::Replacement);
        wrong[0] = b'Q';
        assert_eq!(decode_request(&wrong), None);
    }
}
