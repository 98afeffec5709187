//! The template process (zygote) forking replacement targets, over real
//! processes: channels, exit reports, kill, close, a dead template, a
//! template whose fork fails, and spawns from a threaded parent.
//!
//! A `harness = false` binary (see `tests/io_common/mod.rs`): each test
//! runs on the main thread, so forking the template is safe; every test
//! ends with no child of this process left (checked by the runner).

mod io_common;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use callreg::envelope::encode;
use callreg::error::ErrorCode;
use callreg::io::process::{
    send_control, spawn_targets, thread_count, Exit, ProcessError, TargetEnds, TargetProcess,
    ThreadPolicy,
};
use callreg::io::target::{self, TargetSetup};
use callreg::io::zygote::{ExecTemplate, TemplateCommand, Zygote, DEFAULT_SPAWN_TIMEOUT};
use callreg::io::{StartMethod, Worker};
use callreg::protocol::{TargetId, TargetOutcome, TargetPhase};
use callreg::runtime::testing::{TestCallable, TestRuntime};
use callreg::runtime::{Runtime, RuntimeError, TaskEncoding};
use callreg::wire::{Frame, FrameBuffer, DEFAULT_MAX_FRAME_BYTES};
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, signal, SigHandler, Signal};
use nix::unistd::Pid;

/// The argument that makes this binary a template of [`Zygote::exec`]
/// (the forkserver tests run it as their template command).
const TEMPLATE_ARG: &str = "--callreg-exec-template";

fn main() {
    if std::env::args().nth(1).as_deref() == Some(TEMPLATE_ARG) {
        std::process::exit(exec_template_main());
    }
    io_common::run(&[
        (
            "an_exec_template_forks_every_target_and_replacement",
            an_exec_template_forks_every_target_and_replacement,
        ),
        (
            "an_exec_template_that_fails_is_a_start_error",
            an_exec_template_that_fails_is_a_start_error,
        ),
        (
            "an_exec_template_drops_the_startup_snapshot_after_the_start",
            an_exec_template_drops_the_startup_snapshot_after_the_start,
        ),
        (
            "an_exec_template_without_replacements_serves_until_close",
            an_exec_template_without_replacements_serves_until_close,
        ),
        (
            "replacements_exchange_bytes_and_report_their_exits",
            replacements_exchange_bytes_and_report_their_exits,
        ),
        (
            "spawns_from_a_threaded_parent",
            spawns_from_a_threaded_parent,
        ),
        (
            "close_kills_and_reports_running_replacements",
            close_kills_and_reports_running_replacements,
        ),
        (
            "a_dead_template_refuses_spawns_and_loses_unreported_exits",
            a_dead_template_refuses_spawns_and_loses_unreported_exits,
        ),
        (
            "a_failing_fork_in_the_template_is_an_os_error",
            a_failing_fork_in_the_template_is_an_os_error,
        ),
        (
            "a_dropped_replacement_is_killed_and_reaped",
            a_dropped_replacement_is_killed_and_reaped,
        ),
        (
            "a_stopped_template_times_a_spawn_out",
            a_stopped_template_times_a_spawn_out,
        ),
        (
            "a_replacement_runs_the_target_loop_with_an_empty_snapshot",
            a_replacement_runs_the_target_loop_with_an_empty_snapshot,
        ),
        (
            "a_zygote_inside_a_target_gives_working_channels",
            a_zygote_inside_a_target_gives_working_channels,
        ),
        (
            "an_inherited_ignored_sigchld_hides_no_exit",
            an_inherited_ignored_sigchld_hides_no_exit,
        ),
        ("spawn_latency", spawn_latency),
    ]);
}

/// Set in each replacement by `before_body` to its index + 1.
static BEFORE: AtomicUsize = AtomicUsize::new(0);

fn before_body(index: usize) {
    BEFORE.store(index + 1, Ordering::SeqCst);
}

/// Answers each control read with `BEFORE/index:bytes`; `exit N` ends it
/// with status N; EOF with status 0.
fn echo_body(ends: TargetEnds) -> i32 {
    let index = ends.index;
    let mut control = File::from(ends.control);
    let mut reply = File::from(ends.reply);
    let mut buffer = [0u8; 256];
    loop {
        let len = match control.read(&mut buffer) {
            Ok(0) | Err(_) => return 0,
            Ok(len) => len,
        };
        let text = String::from_utf8_lossy(&buffer[..len]).into_owned();
        if let Some(code) = text.strip_prefix("exit ") {
            return code.trim().parse().unwrap_or(-1);
        }
        let line = format!("{}/{index}:{text}", BEFORE.load(Ordering::SeqCst));
        if reply.write_all(line.as_bytes()).is_err() {
            return 1;
        }
    }
}

fn zygote() -> Zygote {
    Zygote::fork(
        ThreadPolicy::RefuseIfThreaded,
        &TestRuntime,
        before_body,
        echo_body,
    )
    .expect("the template forks")
}

fn send(target: &TargetProcess, text: &str) {
    let control = target.control().expect("an open control socket");
    assert_eq!(send_control(control, text.as_bytes(), None), Ok(text.len()));
}

/// The next reply bytes of `target`, waiting at most 5 s.
fn receive(target: &TargetProcess) -> String {
    let mut fds = [PollFd::new(target.reply(), PollFlags::POLLIN)];
    let ready = nix::poll::poll(&mut fds, PollTimeout::from(5000u16)).expect("poll");
    assert_eq!(ready, 1, "no reply within 5 s");
    let mut buffer = [0u8; 256];
    let len = nix::unistd::read(target.reply(), &mut buffer).expect("read the reply");
    String::from_utf8_lossy(&buffer[..len]).into_owned()
}

/// `/proc/<pid>/stat`'s state and parent pid, `None` once the process is
/// gone (reaped).
fn stat(pid: Pid) -> Option<(char, i32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 2..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let parent = fields.next()?.parse().ok()?;
    Some((state, parent))
}

/// The children of `pid` (running or zombie), from
/// `/proc/<pid>/task/*/children`.
fn children_of(pid: Pid) -> Vec<i32> {
    let mut children = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("the template's tasks") {
        let path = task.expect("a task").path().join("children");
        let text = std::fs::read_to_string(path).unwrap_or_default();
        children.extend(
            text.split_whitespace()
                .map(|p| p.parse::<i32>().expect("a pid")),
        );
    }
    children.sort_unstable();
    children
}

fn replacements_exchange_bytes_and_report_their_exits() {
    let mut zygote = zygote();
    let template = zygote.pid();
    let mut targets: Vec<TargetProcess> = (4..7)
        .map(|index| zygote.spawn(index).expect("a replacement"))
        .collect();
    let mut pids: Vec<i32> = targets.iter().map(|t| t.pid().as_raw()).collect();
    pids.sort_unstable();
    assert_eq!(children_of(template), pids);
    for target in &targets {
        assert_eq!(stat(target.pid()).map(|s| s.1), Some(template.as_raw()));
        assert!(target.pidfd().is_some());
    }
    for target in &targets {
        send(target, "ping");
    }
    for target in &targets {
        let index = target.index();
        assert_eq!(receive(target), format!("{}/{index}:ping", index + 1));
    }
    for target in &mut targets {
        assert_eq!(target.try_reap().expect("try_reap"), None);
        assert_eq!(target.exit(), None);
    }

    targets[0].kill().expect("kill");
    assert_eq!(
        targets[0].reap(Duration::from_secs(5)).expect("reap"),
        Exit::Signal(9)
    );
    assert_eq!(targets[0].exit(), Some(Exit::Signal(9)));
    // Killing a reaped target again is a no-op.
    targets[0].kill().expect("a second kill");

    send(&targets[1], "exit 3");
    assert_eq!(
        targets[1].reap(Duration::from_secs(5)).expect("reap"),
        Exit::Code(3)
    );
    targets[2].close_control();
    assert_eq!(
        targets[2].reap(Duration::from_secs(5)).expect("reap"),
        Exit::Code(0)
    );
    assert_eq!(
        targets[2].try_reap().expect("try_reap"),
        Some(Exit::Code(0))
    );
    // The template reaped all three: no zombie, nothing left under it.
    assert_eq!(children_of(template), Vec::<i32>::new());
    for pid in &pids {
        assert_eq!(stat(Pid::from_raw(*pid)), None, "{pid} is gone");
    }
    assert_eq!(zygote.close().expect("close"), Exit::Code(0));
    assert_eq!(stat(template), None, "the template is reaped");
    assert_eq!(zygote.close().expect("a second close"), Exit::Code(0));
    assert!(matches!(zygote.spawn(7), Err(ProcessError::ZygoteGone)));
}

fn spawns_from_a_threaded_parent() {
    let mut zygote = zygote();
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let busy = std::thread::spawn(move || {
        let _ = stopped.recv();
    });
    assert!(thread_count().expect("threads") >= 2);
    // Forking from here is refused; the template process forks instead.
    assert!(matches!(
        spawn_targets(
            1,
            ThreadPolicy::RefuseIfThreaded,
            &TestRuntime,
            before_body,
            echo_body
        ),
        Err(ProcessError::Threaded { .. })
    ));
    let mut target = zygote
        .spawn(0)
        .expect("a replacement from a threaded parent");
    send(&target, "hello");
    assert_eq!(receive(&target), "1/0:hello");
    // A spawn from another thread, while this one holds a replacement.
    let mut other = std::thread::scope(|scope| {
        scope
            .spawn(|| zygote.spawn(1).expect("a spawn from another thread"))
            .join()
            .expect("the spawning thread")
    });
    send(&other, "there");
    assert_eq!(receive(&other), "2/1:there");
    send(&target, "exit 5");
    assert_eq!(
        target.reap(Duration::from_secs(5)).expect("reap"),
        Exit::Code(5)
    );
    other.close_control();
    assert_eq!(
        other.reap(Duration::from_secs(5)).expect("reap"),
        Exit::Code(0)
    );
    assert_eq!(zygote.close().expect("close"), Exit::Code(0));
    stop.send(()).expect("stop the thread");
    busy.join().expect("the busy thread");
}

fn close_kills_and_reports_running_replacements() {
    let mut zygote = zygote();
    let template = zygote.pid();
    let mut targets: Vec<TargetProcess> = (0..3)
        .map(|index| zygote.spawn(index).expect("a replacement"))
        .collect();
    for target in &targets {
        send(target, "up");
        assert!(receive(target).ends_with(":up"));
    }
    assert_eq!(zygote.close().expect("close"), Exit::Code(0));
    assert_eq!(stat(template), None);
    for target in &mut targets {
        // The template killed, reaped and reported each before exiting.
        assert_eq!(target.try_reap().expect("try_reap"), Some(Exit::Signal(9)));
        assert_eq!(stat(target.pid()), None);
    }
    assert!(matches!(zygote.spawn(3), Err(ProcessError::ZygoteGone)));
}

fn a_dead_template_refuses_spawns_and_loses_unreported_exits() {
    let mut zygote = zygote();
    let mut target = zygote.spawn(0).expect("a replacement");
    send(&target, "up");
    assert_eq!(receive(&target), "1/0:up");
    kill(zygote.pid(), Signal::SIGKILL).expect("kill the template");
    // The replacement dies of its parent-death signal; its exit is lost.
    let deadline = Instant::now() + Duration::from_secs(5);
    let lost = loop {
        match target.try_reap() {
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
            other => break other,
        }
    };
    let pid = target.pid().as_raw();
    assert!(
        matches!(lost, Err(ProcessError::ExitLost { pid: p }) if p == pid),
        "{lost:?}"
    );
    assert!(matches!(zygote.spawn(1), Err(ProcessError::ZygoteGone)));
    assert_eq!(zygote.close().expect("close"), Exit::Signal(9));
    drop(target);
}

/// The test runtime, with `RLIMIT_NOFILE` lowered to 4 in every process
/// forked with it: the template then cannot open a replacement's channels.
struct NoRoomRuntime;

impl Runtime for NoRoomRuntime {
    type Callable = TestCallable;

    fn start(&self) -> Result<(), RuntimeError> {
        TestRuntime.start()
    }

    fn after_fork_child(&self) {
        let limit = libc::rlimit {
            rlim_cur: 4,
            rlim_max: 4,
        };
        // SAFETY: setrlimit reads the struct it is given.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    }

    fn deserialize(&self, payload: &[u8]) -> Result<TestCallable, RuntimeError> {
        TestRuntime.deserialize(payload)
    }

    fn call(
        &self,
        callable: &TestCallable,
        encoding: TaskEncoding,
        input: &[u8],
    ) -> Result<Vec<u8>, RuntimeError> {
        TestRuntime.call(callable, encoding, input)
    }
}

fn a_failing_fork_in_the_template_is_an_os_error() {
    let mut zygote = Zygote::fork(
        ThreadPolicy::RefuseIfThreaded,
        &NoRoomRuntime,
        before_body,
        echo_body,
    )
    .expect("the template forks");
    for index in 0..2 {
        match zygote.spawn(index) {
            Err(ProcessError::Os { operation, errno }) => {
                assert_eq!((operation, errno), ("socketpair", Errno::EMFILE))
            }
            other => panic!("expected socketpair EMFILE, got {other:?}"),
        }
    }
    assert_eq!(children_of(zygote.pid()), Vec::<i32>::new());
    assert_eq!(zygote.close().expect("close"), Exit::Code(0));
}

fn a_dropped_replacement_is_killed_and_reaped() {
    let zygote = zygote();
    let template = zygote.pid();
    let target = zygote.spawn(0).expect("a replacement");
    let pid = target.pid();
    send(&target, "up");
    assert_eq!(receive(&target), "1/0:up");
    drop(target);
    assert_eq!(stat(pid), None);
    assert_eq!(children_of(template), Vec::<i32>::new());
    // The template process still serves.
    let mut again = zygote.spawn(1).expect("another replacement");
    send(&again, "exit 0");
    assert_eq!(
        again.reap(DEFAULT_SPAWN_TIMEOUT).expect("reap"),
        Exit::Code(0)
    );
    drop(zygote);
    assert_eq!(stat(template), None);
}

fn a_stopped_template_times_a_spawn_out() {
    let mut zygote = zygote();
    let template = zygote.pid();
    zygote.set_spawn_timeout(Duration::from_millis(100));
    kill(template, Signal::SIGSTOP).expect("stop the template");
    let start = Instant::now();
    let late = zygote.spawn(0);
    let waited = start.elapsed();
    assert!(
        matches!(
            late,
            Err(ProcessError::ZygoteTimeout {
                what: "a spawn request",
                waited
            }) if waited == Duration::from_millis(100)
        ),
        "{late:?}"
    );
    assert!(waited >= Duration::from_millis(100) && waited < Duration::from_secs(2));
    kill(template, Signal::SIGCONT).expect("continue the template");
    // The late reply is read by the next spawn: its target is killed (the
    // template reaps it), and the new spawn gets its own target.
    zygote.set_spawn_timeout(DEFAULT_SPAWN_TIMEOUT);
    let mut target = zygote.spawn(1).expect("a replacement");
    send(&target, "after");
    assert_eq!(receive(&target), "2/1:after");
    let deadline = Instant::now() + Duration::from_secs(5);
    while children_of(template).len() > 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(children_of(template), vec![target.pid().as_raw()]);
    send(&target, "exit 4");
    assert_eq!(
        target.reap(Duration::from_secs(5)).expect("reap"),
        Exit::Code(4)
    );
    assert_eq!(zygote.close().expect("close"), Exit::Code(0));
}

/// The body a Worker gives its replacements: the target loop
/// (`target::run`) over a setup with an empty startup snapshot (the
/// protocol replays what the replacement must hold).
fn a_replacement_runs_the_target_loop_with_an_empty_snapshot() {
    let setup = TargetSetup {
        runtime: Arc::new(TestRuntime),
        snapshot: Vec::new(),
        envelopes: std::sync::Mutex::new(BTreeMap::new()),
        metadata: BTreeMap::new(),
        slot_capacity: 8,
        max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
        heartbeat: Duration::from_secs(1),
        spin: Duration::from_micros(50),
    };
    let mut zygote = Zygote::fork(
        ThreadPolicy::RefuseIfThreaded,
        &TestRuntime,
        |_| {},
        |ends| target::run(ends, &setup),
    )
    .expect("the template forks");
    let mut replacement = zygote.spawn(2).expect("a replacement");
    let mut frames = FrameBuffer::new(DEFAULT_MAX_FRAME_BYTES).expect("a frame buffer");
    let deadline = Instant::now() + Duration::from_secs(5);
    let frame = loop {
        if let Some(frame) = frames.next_frame().expect("a well-formed frame") {
            break frame;
        }
        assert!(Instant::now() < deadline, "no Ready frame within 5 s");
        let mut fds = [PollFd::new(replacement.reply(), PollFlags::POLLIN)];
        nix::poll::poll(&mut fds, PollTimeout::from(100u16)).expect("poll");
        let mut buffer = [0u8; 4096];
        match nix::unistd::read(replacement.reply(), &mut buffer) {
            Ok(len) => frames.extend(&buffer[..len]),
            Err(Errno::EAGAIN) => {}
            Err(e) => panic!("read: {e}"),
        }
    };
    let pid = u32::try_from(replacement.pid().as_raw()).expect("a pid");
    assert_eq!(
        frame,
        Frame::Ready {
            pid,
            snapshot: Vec::new()
        }
    );
    replacement.close_control();
    assert_eq!(
        replacement.reap(Duration::from_secs(5)).expect("reap"),
        Exit::Code(0)
    );
    assert_eq!(zygote.close().expect("close"), Exit::Code(0));
}

/// Inside a target (which guards its channels in every process it forks,
/// `process` module docs), the template process's replacements still get working
/// channels: the template is no target, so the guard leaves the numbers
/// it reuses alone. The target reports through its exit status: 0 when
/// its replacement echoed, 1 when the reply was wrong.
fn a_zygote_inside_a_target_gives_working_channels() {
    let mut targets = spawn_targets(
        1,
        ThreadPolicy::RefuseIfThreaded,
        &TestRuntime,
        |_| {},
        |_ends| {
            // Hold the target's ends open while the template forks, so the
            // template reuses their numbers after closing them.
            let mut zygote = zygote();
            let status = match zygote.spawn(0) {
                Ok(mut replacement) => {
                    send(&replacement, "nested");
                    let echoed = receive(&replacement) == "1/0:nested";
                    replacement.close_control();
                    let exited = replacement.reap(Duration::from_secs(5)).ok();
                    if echoed && exited == Some(Exit::Code(0)) {
                        0
                    } else {
                        1
                    }
                }
                Err(_) => 2,
            };
            let closed = zygote.close().ok();
            if closed == Some(Exit::Code(0)) {
                status
            } else {
                3
            }
        },
    )
    .expect("a target");
    assert_eq!(
        targets[0].reap(Duration::from_secs(10)).expect("reap"),
        Exit::Code(0)
    );
}

/// A parent that ignores SIGCHLD when it forks the template process (inherited by
/// the template) still gets its replacements' exit statuses.
fn an_inherited_ignored_sigchld_hides_no_exit() {
    // SAFETY: SIG_IGN and SIG_DFL have no handler code.
    unsafe { signal(Signal::SIGCHLD, SigHandler::SigIgn) }.expect("ignore SIGCHLD");
    let forked = Zygote::fork(
        ThreadPolicy::RefuseIfThreaded,
        &TestRuntime,
        before_body,
        echo_body,
    );
    // SAFETY: as above.
    unsafe { signal(Signal::SIGCHLD, SigHandler::SigDfl) }.expect("restore SIGCHLD");
    let mut zygote = forked.expect("the template forks");
    let mut target = zygote.spawn(0).expect("a replacement");
    send(&target, "exit 6");
    assert_eq!(
        target.reap(Duration::from_secs(5)).expect("reap"),
        Exit::Code(6)
    );
    assert_eq!(zygote.close().expect("close"), Exit::Code(0));
}

/// Spawns 50 replacements one after the other, each ending at once;
/// prints the mean and the slowest spawn (request to pidfd in hand).
fn spawn_latency() {
    let mut zygote = zygote();
    let mut times = Vec::new();
    for index in 0..50 {
        let start = Instant::now();
        let mut target = zygote.spawn(index).expect("a replacement");
        times.push(start.elapsed());
        target.close_control();
        assert_eq!(
            target.reap(Duration::from_secs(5)).expect("reap"),
            Exit::Code(0)
        );
    }
    let total: Duration = times.iter().sum();
    let slowest = times.iter().max().copied().unwrap_or_default();
    println!(
        "spawn latency over {} spawns: mean {:?}, max {slowest:?}",
        times.len(),
        total / u32::try_from(times.len()).unwrap_or(1)
    );
    let status = std::fs::read_to_string(format!("/proc/{}/status", zygote.pid()))
        .expect("the template's status");
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .unwrap_or("VmRSS: ?");
    println!("template {rss}");
    assert_eq!(zygote.close().expect("close"), Exit::Code(0));
}

/// This binary as a template ([`ExecTemplate`]) with the test runtime; the
/// runtime data `fail` makes it refuse to start.
fn exec_template_main() -> i32 {
    let template = match ExecTemplate::open() {
        Ok(template) => template,
        Err(e) => {
            eprintln!("{e}");
            return 2;
        }
    };
    if template.runtime_data() == b"fail" {
        return template.fail("the runtime data says fail");
    }
    template.serve(Arc::new(TestRuntime))
}

fn template_command() -> TemplateCommand {
    TemplateCommand::new(std::env::current_exe().unwrap()).arg(TEMPLATE_ARG)
}

/// The parent pid of `pid`, from `/proc/PID/stat`.
fn parent_of(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let (_, rest) = stat.rsplit_once(')').unwrap();
    rest.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The forkserver start method: the template is this binary run anew;
/// the targets of the start are its children and install the startup
/// snapshot (one envelope larger than a socket message), and a killed
/// target is replaced from it and given the registry.
fn an_exec_template_forks_every_target_and_replacement() {
    let worker = Worker::builder(Arc::new(TestRuntime))
        .targets(2)
        .control_timeout(Duration::from_secs(10))
        .start_method(StartMethod::Forkserver(template_command()))
        .build()
        .unwrap();
    let add = worker.register(&encode(b"add")).unwrap();
    let mut big = b"echo#".to_vec();
    big.resize(3 << 20, b'x');
    let big = worker.register(&encode(&big)).unwrap();
    let report = worker.start().unwrap();
    assert_eq!(
        report.outcomes,
        vec![
            (TargetId(0), TargetOutcome::Ok),
            (TargetId(1), TargetOutcome::Ok)
        ]
    );
    assert!(report.failed.is_empty());
    let pids: Vec<i32> = (0..2)
        .map(|t| worker.target_pid(TargetId(t)).unwrap())
        .collect();
    let template = parent_of(pids[0]);
    assert_ne!(template, std::process::id() as i32);
    assert_eq!(parent_of(pids[1]), template);
    assert_eq!(parent_of(template), std::process::id() as i32);
    let input = br#"{"args": [40, 2], "kwargs": {}}"#;
    for t in 0..2 {
        let target = TargetId(t);
        assert_eq!(
            worker
                .submit(&add, target, TaskEncoding::Json, input)
                .unwrap(),
            b"42"
        );
        assert_eq!(
            worker
                .submit(&big, target, TaskEncoding::Json, b"3")
                .unwrap(),
            b"3"
        );
    }
    let echo = worker.register(&encode(b"echo")).unwrap();
    kill(Pid::from_raw(pids[0]), Signal::SIGKILL).unwrap();
    io_common::wait_for_target(&worker, 0, TargetPhase::Joined, 1);
    let replacement = worker.target_pid(TargetId(0)).unwrap();
    assert_ne!(replacement, pids[0]);
    assert_eq!(parent_of(replacement), template);
    for handle in [&add, &big] {
        assert!(worker
            .submit(handle, TargetId(0), TaskEncoding::Json, input)
            .is_ok());
    }
    assert_eq!(
        worker
            .submit(&echo, TargetId(0), TaskEncoding::Json, b"5")
            .unwrap(),
        b"5"
    );
    worker.close();
    assert!(worker.live_targets().is_empty());
}

/// Resident memory of process `pid`, in bytes (`VmRSS`).
fn resident(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// The exec'd template holds a pre-start callable's bytes only until the
/// start's last target is forked (`Zygote::spawn_startup`'s `last`): a
/// 48 MiB envelope leaves it, and its targets once they installed it,
/// well below that; a replacement still gets it, by replay.
fn an_exec_template_drops_the_startup_snapshot_after_the_start() {
    const BIG: u64 = 48 << 20;
    let worker = Worker::builder(Arc::new(TestRuntime))
        .targets(2)
        .control_timeout(Duration::from_secs(10))
        .start_method(StartMethod::Forkserver(template_command()))
        .build()
        .unwrap();
    let mut big = b"echo#".to_vec();
    big.resize(BIG as usize, b'x');
    let big = worker.register(&encode(&big)).unwrap();
    worker.start().unwrap();
    let pids: Vec<i32> = (0..2)
        .map(|t| worker.target_pid(TargetId(t)).unwrap())
        .collect();
    let template = parent_of(pids[0]);
    for pid in pids.iter().chain([&template]) {
        let dropped = (0..500).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            resident(*pid) < BIG / 2
        });
        assert!(dropped, "process {pid} holds {} bytes", resident(*pid));
    }
    kill(Pid::from_raw(pids[0]), Signal::SIGKILL).unwrap();
    io_common::wait_for_target(&worker, 0, TargetPhase::Joined, 1);
    for t in 0..2 {
        assert_eq!(
            worker
                .submit(&big, TargetId(t), TaskEncoding::Json, b"3")
                .unwrap(),
            b"3"
        );
    }
    worker.close();
}

/// A template that refuses to start (its runtime could not be built)
/// fails the start with its reason; nothing is left running.
fn an_exec_template_that_fails_is_a_start_error() {
    let worker = Worker::builder(Arc::new(TestRuntime))
        .targets(2)
        .start_method(StartMethod::Forkserver(
            template_command().runtime_data(b"fail".to_vec()),
        ))
        .build()
        .unwrap();
    let failed = worker.start().unwrap_err();
    assert_eq!(failed.error.code, ErrorCode::IO_FAILED);
    assert_eq!(
        failed.error.message,
        "the template process did not start: the runtime data says fail"
    );
    worker.close();
    // A program that is no template ends before it is ready.
    let worker = Worker::builder(Arc::new(TestRuntime))
        .start_method(StartMethod::Forkserver(
            TemplateCommand::new("/bin/sh").arg("-c").arg("exit 7"),
        ))
        .build()
        .unwrap();
    let failed = worker.start().unwrap_err();
    assert_eq!(
        failed.error.message,
        "the template process did not start: it exited with status 7 before it was ready"
    );
    worker.close();
}

/// With replacements off the template is made all the same (it is the
/// targets' parent): the Worker serves, and a lost target stays lost.
fn an_exec_template_without_replacements_serves_until_close() {
    let worker = Worker::builder(Arc::new(TestRuntime))
        .targets(2)
        .respawn_limit(0)
        .start_method(StartMethod::Forkserver(template_command()))
        .build()
        .unwrap();
    worker.start().unwrap();
    let echo = worker.register(&encode(b"echo")).unwrap();
    let results = worker.submit_to_every(&echo, TaskEncoding::Json, b"1");
    assert_eq!(results.len(), 2);
    for (_, result) in results {
        assert_eq!(result.unwrap(), b"1");
    }
    let pid = worker.target_pid(TargetId(1)).unwrap();
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while worker.live_targets() != vec![TargetId(0)] {
        assert!(Instant::now() < deadline, "{:?}", worker.live_targets());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(worker.target_events().is_empty());
    worker.close();
}
