//! A template started by `exec` ([`Zygote::exec`]): a fresh process, not a
//! fork of the parent, so none of the parent's threads, locks or memory
//! reaches it or the targets it forks (the forkserver start method).
//!
//! The parent runs a [`TemplateCommand`] (a program of the embedding
//! runtime, e.g. the Python interpreter with a bootstrap) with two known
//! descriptors:
//!
//! * [`TEMPLATE_SOCKET_FD`] (3): the template's end of the request socket
//!   (`SOCK_SEQPACKET`, as for [`Zygote::fork`]);
//! * [`TEMPLATE_SETUP_FD`] (4): a `memfd` holding what a forked template
//!   would have inherited: the target setup (slots, frame bound,
//!   heartbeat, the startup snapshot with its envelopes and metadata) and
//!   the command's runtime data, in the setup format below. A file has no
//!   message size limit: large envelopes need no chunking.
//!
//! The program calls [`ExecTemplate::open`], rebuilds its runtime from
//! [`ExecTemplate::runtime_data`] (the Python package imports its preload
//! modules there), then either [`ExecTemplate::serve`]s (it sends `b'H'`,
//! ready, and runs the same template loop as a forked template until EOF)
//! or [`ExecTemplate::fail`]s (it sends `b'F'` followed by its reason in
//! UTF-8, which [`Zygote::exec`] returns as
//! [`ProcessError::TemplateStart`]). Targets of the start are requested
//! with [`Zygote::spawn_startup`] and install the startup snapshot as a
//! forked target does; replacements ([`Zygote::spawn`]) start with an
//! empty snapshot and are given every live registration by replay.
//!
//! The template inherits the parent's environment, working directory and
//! standard streams, and no other descriptor but the two above (the
//! parent's are close-on-exec). It gets `PR_SET_PDEATHSIG` (SIGKILL)
//! relative to the thread that called [`Zygote::exec`], as a forked
//! template does.
//!
//! # The setup format
//!
//! Integers little-endian; `bytes` is a u64 length then that many bytes.
//!
//! | field | form |
//! |---|---|
//! | magic | the 8 bytes `CRTMPL02` |
//! | slot capacity | u16 |
//! | maximum frame size | u64 |
//! | heartbeat | u64, microseconds |
//! | task thread's spin budget | u64, microseconds |
//! | runtime data | bytes |
//! | entries | u32 count, then each: digest (32 bytes), refcount (u32), envelope (bytes), metadata (u8 0: none; 1: then its JSON as bytes) |

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::File;
use std::io::{IoSlice, Read, Seek, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::signal::{self, Signal};
use nix::sys::socket::{
    sendmsg, socketpair, AddressFamily, MsgFlags, SockFlag, SockType, UnixAddr,
};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::{Template, Zygote, DEFAULT_SPAWN_TIMEOUT};
use crate::descriptor::Digest;
use crate::io::process::forget_target;
use crate::io::sys::{set_nonblocking, Exit, ProcessError, TrackedFd};
use crate::io::target::{self, TargetSetup};
use crate::io::zygote_link::{readable, LinkState, ZygoteLink};
use crate::metadata::CallableMetadata;
use crate::runtime::Runtime;

/// The descriptor number of the template's request socket in the
/// program [`Zygote::exec`] runs.
pub const TEMPLATE_SOCKET_FD: RawFd = 3;

/// The descriptor number of the setup `memfd` in the program
/// [`Zygote::exec`] runs.
pub const TEMPLATE_SETUP_FD: RawFd = 4;

const MAGIC: &[u8; 8] = b"CRTMPL02";

/// The longest reason an [`ExecTemplate::fail`] sends (longer ones are
/// cut at a character boundary).
const MAX_REASON_BYTES: usize = 16 * 1024;

/// Exit status of a template that failed to start ([`ExecTemplate::fail`],
/// or [`ExecTemplate::open`] refused its descriptors).
pub const TEMPLATE_START_EXIT_CODE: i32 = 2;

/// The program [`Zygote::exec`] runs as the template, with its arguments
/// and the runtime data it is given (opaque to callreg: what the
/// program's runtime needs to start, e.g. modules to import).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateCommand {
    program: PathBuf,
    args: Vec<OsString>,
    runtime_data: Vec<u8>,
    before_ready: Option<String>,
}

impl TemplateCommand {
    /// A command running `program` (a path, or a name looked up in
    /// `PATH`) with no arguments and empty runtime data.
    pub fn new(program: impl Into<PathBuf>) -> TemplateCommand {
        TemplateCommand {
            program: program.into(),
            args: Vec::new(),
            runtime_data: Vec::new(),
            before_ready: None,
        }
    }

    /// Adds an argument.
    pub fn arg(mut self, arg: impl Into<OsString>) -> TemplateCommand {
        self.args.push(arg.into());
        self
    }

    /// Sets the runtime data ([`ExecTemplate::runtime_data`] in the
    /// template).
    pub fn runtime_data(mut self, data: Vec<u8>) -> TemplateCommand {
        self.runtime_data = data;
        self
    }

    /// What the program does before it reports ready, in words (e.g.
    /// `it imports the preload modules ['app.models'] first`): named in
    /// the start error when the template ends, or says nothing, before it
    /// is ready ([`ProcessError::TemplateStart`]).
    pub fn before_ready(mut self, what: impl Into<String>) -> TemplateCommand {
        self.before_ready = Some(what.into());
        self
    }

    /// The program.
    pub fn program(&self) -> &Path {
        &self.program
    }

    /// The arguments.
    pub fn args(&self) -> &[OsString] {
        &self.args
    }
}

/// The setup a template of [`Zygote::exec`] reads (see the module
/// documentation): the target setup but its runtime, and the runtime data.
#[derive(Clone, Debug, PartialEq)]
struct Setup {
    slot_capacity: u16,
    max_frame_bytes: usize,
    heartbeat: Duration,
    spin: Duration,
    runtime_data: Vec<u8>,
    snapshot: Vec<(Digest, u32)>,
    envelopes: BTreeMap<Digest, Arc<Vec<u8>>>,
    metadata: BTreeMap<Digest, CallableMetadata>,
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

impl Setup {
    fn of<R: Runtime>(setup: &TargetSetup<R>, runtime_data: &[u8]) -> Setup {
        Setup {
            slot_capacity: setup.slot_capacity,
            max_frame_bytes: setup.max_frame_bytes,
            heartbeat: setup.heartbeat,
            spin: setup.spin,
            runtime_data: runtime_data.to_vec(),
            snapshot: setup.snapshot.clone(),
            envelopes: setup
                .envelopes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            metadata: setup.metadata.clone(),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.slot_capacity.to_le_bytes());
        out.extend_from_slice(&(self.max_frame_bytes as u64).to_le_bytes());
        let heartbeat = u64::try_from(self.heartbeat.as_micros()).unwrap_or(u64::MAX);
        out.extend_from_slice(&heartbeat.to_le_bytes());
        let spin = u64::try_from(self.spin.as_micros()).unwrap_or(u64::MAX);
        out.extend_from_slice(&spin.to_le_bytes());
        put_bytes(&mut out, &self.runtime_data);
        let count = u32::try_from(self.snapshot.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&count.to_le_bytes());
        for (digest, refcount) in self.snapshot.iter().take(count as usize) {
            out.extend_from_slice(digest.as_bytes());
            out.extend_from_slice(&refcount.to_le_bytes());
            put_bytes(
                &mut out,
                self.envelopes.get(digest).map_or(&[][..], |e| e.as_slice()),
            );
            match self.metadata.get(digest) {
                Some(metadata) => {
                    out.push(1);
                    put_bytes(&mut out, metadata.to_json().as_bytes());
                }
                None => out.push(0),
            }
        }
        out
    }

    fn decode(bytes: &[u8]) -> Result<Setup, String> {
        let mut input = Reader { bytes, at: 0 };
        if input.take(MAGIC.len())? != MAGIC {
            return Err("the setup does not start with its magic".to_owned());
        }
        let slot_capacity = u16::from_le_bytes(input.array()?);
        let max_frame_bytes = usize::try_from(input.u64()?)
            .map_err(|_| "the maximum frame size does not fit".to_owned())?;
        let heartbeat = Duration::from_micros(input.u64()?);
        let spin = Duration::from_micros(input.u64()?);
        let runtime_data = input.bytes()?.to_vec();
        let count = u32::from_le_bytes(input.array()?);
        let mut setup = Setup {
            slot_capacity,
            max_frame_bytes,
            heartbeat,
            spin,
            runtime_data,
            snapshot: Vec::new(),
            envelopes: BTreeMap::new(),
            metadata: BTreeMap::new(),
        };
        for _ in 0..count {
            let digest = Digest(input.array()?);
            let refcount = u32::from_le_bytes(input.array()?);
            setup.snapshot.push((digest, refcount));
            let envelope = input.bytes()?;
            if !envelope.is_empty() {
                setup.envelopes.insert(digest, Arc::new(envelope.to_vec()));
            }
            match input.take(1)?[0] {
                0 => {}
                1 => {
                    let text = std::str::from_utf8(input.bytes()?)
                        .map_err(|e| format!("metadata of {digest}: {e}"))?;
                    let metadata = CallableMetadata::from_json(text)
                        .map_err(|e| format!("metadata of {digest}: {e}"))?;
                    setup.metadata.insert(digest, metadata);
                }
                other => return Err(format!("metadata flag {other} of {digest}")),
            }
        }
        if input.at != bytes.len() {
            return Err(format!("{} bytes follow the setup", bytes.len() - input.at));
        }
        Ok(setup)
    }

    fn target_setup<R: Runtime>(&self, runtime: Arc<R>, startup: bool) -> TargetSetup<R> {
        TargetSetup {
            runtime,
            snapshot: if startup {
                self.snapshot.clone()
            } else {
                Vec::new()
            },
            envelopes: Mutex::new(if startup {
                self.envelopes.clone()
            } else {
                BTreeMap::new()
            }),
            metadata: if startup {
                self.metadata.clone()
            } else {
                BTreeMap::new()
            },
            slot_capacity: self.slot_capacity,
            max_frame_bytes: self.max_frame_bytes,
            heartbeat: self.heartbeat,
            spin: self.spin,
        }
    }
}

/// Reads the setup format.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(len)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| format!("the setup ends early (at byte {})", self.at))?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let len = usize::try_from(self.u64()?).map_err(|_| "a length does not fit".to_owned())?;
        self.take(len)
    }
}

/// Waits for `pid` (a child of this process) to end, at most `timeout`,
/// then kills it and waits; `None` when `waitpid` fails.
fn reap_child(pid: Pid, timeout: Duration) -> Option<Exit> {
    let deadline = Instant::now() + timeout;
    let mut killed = false;
    loop {
        let flags = (!killed).then_some(WaitPidFlag::WNOHANG);
        match waitpid(pid, flags) {
            Ok(WaitStatus::Exited(_, code)) => return Some(Exit::Code(code)),
            Ok(WaitStatus::Signaled(_, sig, _)) => return Some(Exit::Signal(sig as i32)),
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => return None,
        }
        if !killed && Instant::now() >= deadline {
            // Our unreaped child: its pid is its own.
            let _ = signal::kill(pid, Signal::SIGKILL);
            killed = true;
        } else if !killed {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The setup as a sealed-size `memfd` (close-on-exec; the child gets a
/// copy at [`TEMPLATE_SETUP_FD`]).
fn setup_memfd(bytes: &[u8]) -> Result<OwnedFd, ProcessError> {
    let fd = memfd_create(c"callreg-template-setup", MFdFlags::MFD_CLOEXEC).map_err(|errno| {
        ProcessError::Os {
            operation: "memfd_create",
            errno,
        }
    })?;
    let mut file = File::from(fd);
    file.write_all(bytes).map_err(|e| ProcessError::Os {
        operation: "write",
        errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
    })?;
    Ok(OwnedFd::from(file))
}

impl Zygote {
    /// Starts the template process by running `command` (see the module
    /// documentation) instead of forking this process, hands it `setup`
    /// (but its runtime: the template builds its own from the command's
    /// runtime data) and waits until it is ready, at most until
    /// `deadline`. Safe in a threaded process: this process forks only to
    /// `exec` at once.
    ///
    /// The targets of the start are then asked for with
    /// [`Zygote::spawn_startup`] (they install `setup`'s snapshot),
    /// replacements with [`Zygote::spawn`] (an empty snapshot).
    ///
    /// # Errors
    /// [`ProcessError::TemplateStart`] when the template reported a
    /// failure (its reason) or ended before it was ready (how);
    /// [`ProcessError::ZygoteTimeout`] when it was not ready by
    /// `deadline` (it is killed); [`ProcessError::Os`] when `socketpair`,
    /// `memfd_create`, `write`, `fcntl`, the `exec` (`spawn`) or `poll`
    /// fails.
    pub fn exec<R: Runtime>(
        command: &TemplateCommand,
        setup: &TargetSetup<R>,
        deadline: Instant,
    ) -> Result<Zygote, ProcessError> {
        let started = Instant::now();
        let os = |operation| move |errno| ProcessError::Os { operation, errno };
        let (parent_end, template_end) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(os("socketpair"))?;
        let memfd = setup_memfd(&Setup::of(setup, &command.runtime_data).encode())?;
        let parent = nix::unistd::getpid();
        let (socket_fd, setup_fd) = (template_end.as_raw_fd(), memfd.as_raw_fd());
        let mut child = std::process::Command::new(&command.program);
        child.args(&command.args);
        // SAFETY: the closure runs in the forked child before `exec` and
        // makes only async-signal-safe calls (fcntl, dup2, close, prctl,
        // getppid, _exit) on descriptors this process owns.
        unsafe {
            child.pre_exec(move || {
                // Out of the way of 3 and 4 first, then into place
                // (dup2 clears close-on-exec).
                let socket = libc::fcntl(socket_fd, libc::F_DUPFD_CLOEXEC, 10);
                let setup = libc::fcntl(setup_fd, libc::F_DUPFD_CLOEXEC, 10);
                if socket < 0
                    || setup < 0
                    || libc::dup2(socket, TEMPLATE_SOCKET_FD) < 0
                    || libc::dup2(setup, TEMPLATE_SETUP_FD) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(socket);
                libc::close(setup);
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
                if libc::getppid() != parent.as_raw() {
                    // The parent died before the request above took effect.
                    libc::_exit(crate::io::process::ORPHAN_EXIT_CODE);
                }
                Ok(())
            });
        }
        let spawned = child.spawn().map_err(|e| ProcessError::Os {
            operation: "spawn",
            errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
        })?;
        // Reaped by pid from here on (waitpid), not through `spawned`.
        let pid = Pid::from_raw(i32::try_from(spawned.id()).unwrap_or(i32::MAX));
        drop(spawned);
        drop(template_end);
        drop(memfd);
        let fail = |error: ProcessError| {
            let _ = reap_child(pid, Duration::ZERO);
            error
        };
        set_nonblocking(parent_end.as_fd())
            .map_err(os("fcntl"))
            .map_err(fail)?;
        let parent_end = TrackedFd::new(parent_end);
        let mut buffer = vec![0u8; MAX_REASON_BYTES + 2];
        let len = loop {
            match nix::sys::socket::recv(
                parent_end.as_fd().as_raw_fd(),
                &mut buffer,
                MsgFlags::MSG_DONTWAIT,
            ) {
                Ok(len) => break len,
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => {
                    let now = Instant::now();
                    if now >= deadline {
                        let waited = now.duration_since(started);
                        return Err(fail(match &command.before_ready {
                            None => ProcessError::ZygoteTimeout {
                                what: "its start",
                                waited,
                            },
                            Some(what) => ProcessError::TemplateStart {
                                message: format!(
                                    "it was not ready after {waited:.1?} ({what}: one of them may hang)"
                                ),
                            },
                        }));
                    }
                    let timeout = nix::poll::PollTimeout::try_from(deadline - now)
                        .unwrap_or(nix::poll::PollTimeout::MAX);
                    readable(parent_end.as_fd(), timeout).map_err(fail)?;
                }
                Err(Errno::ECONNRESET) => break 0,
                Err(errno) => return Err(fail(os("recv")(errno))),
            }
        };
        match buffer[..len] {
            [b'H'] => {}
            [b'F', ref reason @ ..] => {
                let message = String::from_utf8_lossy(reason).into_owned();
                let _ = reap_child(pid, super::REPORT_TIMEOUT);
                return Err(ProcessError::TemplateStart { message });
            }
            [] => {
                let how = reap_child(pid, super::REPORT_TIMEOUT)
                    .map_or_else(|| "could not be reaped".to_owned(), |e| e.to_string());
                let what = command
                    .before_ready
                    .as_ref()
                    .map_or_else(String::new, |what| format!(" ({what})"));
                return Err(ProcessError::TemplateStart {
                    message: format!("it {how} before it was ready{what}"),
                });
            }
            _ => {
                return Err(fail(ProcessError::TemplateStart {
                    message: "it sent something other than ready".to_owned(),
                }))
            }
        }
        Ok(Zygote {
            pid,
            link: Arc::new(ZygoteLink {
                state: Mutex::new(LinkState::new(parent_end)),
            }),
            spawn_timeout: DEFAULT_SPAWN_TIMEOUT,
            exit: std::sync::Mutex::new(None),
        })
    }
}

/// The template's side of [`Zygote::exec`], in the program it runs: the
/// request socket and the setup, read from their known descriptors.
#[derive(Debug)]
pub struct ExecTemplate {
    socket: TrackedFd,
    setup: Setup,
}

impl ExecTemplate {
    /// Takes the descriptors [`TEMPLATE_SOCKET_FD`] and
    /// [`TEMPLATE_SETUP_FD`] (both made close-on-exec here), reads the
    /// setup and closes its `memfd`. Call it once, early, in a process
    /// [`Zygote::exec`] started.
    ///
    /// # Errors
    /// A message when the descriptors are not a socket and a file (the
    /// process was not started by [`Zygote::exec`]) or the setup cannot
    /// be read or decoded.
    pub fn open() -> Result<ExecTemplate, String> {
        let kind = |fd: RawFd| {
            // SAFETY: fstat writes one `stat` into the valid pointer given;
            // a descriptor that is not open fails with EBADF.
            unsafe {
                let mut stat: libc::stat = std::mem::zeroed();
                (libc::fstat(fd, &mut stat) == 0).then_some(stat.st_mode & libc::S_IFMT)
            }
        };
        if kind(TEMPLATE_SOCKET_FD) != Some(libc::S_IFSOCK)
            || kind(TEMPLATE_SETUP_FD) != Some(libc::S_IFREG)
        {
            return Err(format!(
                "descriptors {TEMPLATE_SOCKET_FD} and {TEMPLATE_SETUP_FD} are not a template's socket and setup: this process was not started as a template"
            ));
        }
        // SAFETY: checked just above to be open; by the convention of
        // `Zygote::exec` they are this process's, owned by nothing else,
        // and this is the one place that takes them.
        let (socket, setup) = unsafe {
            (
                OwnedFd::from_raw_fd(TEMPLATE_SOCKET_FD),
                OwnedFd::from_raw_fd(TEMPLATE_SETUP_FD),
            )
        };
        for fd in [&socket, &setup] {
            nix::fcntl::fcntl(
                fd,
                nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
            )
            .map_err(|e| format!("fcntl: {e}"))?;
        }
        let mut file = File::from(setup);
        let mut bytes = Vec::new();
        file.rewind()
            .and_then(|()| file.read_to_end(&mut bytes))
            .map_err(|e| format!("reading the setup: {e}"))?;
        drop(file);
        let setup = Setup::decode(&bytes)?;
        Ok(ExecTemplate {
            socket: TrackedFd::new(socket),
            setup,
        })
    }

    /// The command's runtime data ([`TemplateCommand::runtime_data`]).
    pub fn runtime_data(&self) -> &[u8] {
        &self.setup.runtime_data
    }

    /// Tells the parent the template cannot start (`reason`, cut at 16 KiB,
    /// is the [`ProcessError::TemplateStart`] message there); returns the
    /// exit status to end with, [`TEMPLATE_START_EXIT_CODE`].
    pub fn fail(self, reason: &str) -> i32 {
        let mut end = reason.len().min(MAX_REASON_BYTES);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        let mut message = Vec::with_capacity(end + 1);
        message.push(b'F');
        message.extend_from_slice(&reason.as_bytes()[..end]);
        let _ = self.send(&message);
        TEMPLATE_START_EXIT_CODE
    }

    /// Tells the parent the template is ready and serves its requests as a
    /// forked template does, with `runtime`: each target of the start
    /// installs the setup's snapshot, each replacement starts empty.
    /// Returns when the parent closes the socket (or it fails), with the
    /// exit status to end with. Call it on a thread that lives as long as
    /// the template (the targets' parent-death signal follows it), with
    /// the process otherwise single-threaded.
    pub fn serve<R: Runtime>(mut self, runtime: Arc<R>) -> i32 {
        if self.send(b"H").is_err() {
            return super::TEMPLATE_ERROR_EXIT_CODE;
        }
        forget_target();
        // Reaping needs the default disposition (see `Zygote::fork`).
        // SAFETY: installing SIG_DFL has no handler code to be unsafe
        // about.
        let _ = unsafe { signal::signal(Signal::SIGCHLD, signal::SigHandler::SigDfl) };
        let startup = self.setup.target_setup(runtime.clone(), true);
        let empty = self.setup.target_setup(runtime.clone(), false);
        // The startup setup holds the only copy of the snapshot's bytes
        // from here, until the start's last target is forked.
        self.setup.envelopes.clear();
        let drop_snapshot = || {
            startup
                .envelopes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
        };
        Template {
            socket: self.socket,
            runtime: &*runtime,
            before_body: &target::before_body,
            body: &|ends, is_startup| target::run(ends, if is_startup { &startup } else { &empty }),
            after_start: &drop_snapshot,
            children: Vec::new(),
        }
        .run()
    }

    fn send(&self, bytes: &[u8]) -> Result<(), Errno> {
        loop {
            match sendmsg::<UnixAddr>(
                self.socket.as_fd().as_raw_fd(),
                &[IoSlice::new(bytes)],
                &[],
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::testing::TestRuntime;

    #[test]
    fn setups_round_trip() {
        let (a, b) = (Digest([1; 32]), Digest([2; 32]));
        let metadata = CallableMetadata::from_json(r#"{"name": "f"}"#).unwrap();
        let target_setup = TargetSetup {
            runtime: Arc::new(TestRuntime),
            snapshot: vec![(a, 2), (b, 1)],
            envelopes: Mutex::new(BTreeMap::from([
                (a, Arc::new(vec![7u8; 300_000])),
                (b, Arc::new(b"small".to_vec())),
            ])),
            metadata: BTreeMap::from([(b, metadata)]),
            slot_capacity: 9,
            max_frame_bytes: 1 << 20,
            heartbeat: Duration::from_millis(250),
            spin: Duration::from_micros(30),
        };
        let setup = Setup::of(&target_setup, b"runtime");
        let bytes = setup.encode();
        assert_eq!(Setup::decode(&bytes), Ok(setup.clone()));
        assert!(Setup::decode(&bytes[..bytes.len() - 1])
            .is_err_and(|e| e.starts_with("the setup ends early")));
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(
            Setup::decode(&longer).map(|_| ()),
            Err("1 bytes follow the setup".to_owned())
        );
        let replacement = setup.target_setup(Arc::new(TestRuntime), false);
        assert!(
            replacement.snapshot.is_empty() && replacement.envelopes.lock().unwrap().is_empty()
        );
        assert_eq!(replacement.slot_capacity, 9);
        let startup = setup.target_setup(Arc::new(TestRuntime), true);
        assert_eq!(startup.snapshot, vec![(a, 2), (b, 1)]);
        assert_eq!(startup.envelopes.lock().unwrap()[&a].len(), 300_000);
    }
}
