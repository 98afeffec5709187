//! The Worker with Python targets over real forked processes: what a
//! target inherits, when finalizers run, and a startup snapshot with a
//! callable that fails on some targets.
//!
//! A `harness = false` binary run by the runner of `tests/io_common/mod.rs`
//! (each test on the main thread; no staged payload and no child is left).
//! Payloads are packed at test time by the interpreter named by
//! `PYO3_PYTHON` (else `python3`), which must have cloudpickle.
//!
//! Run: `PYO3_PYTHON=$(python3 -c 'import sys; print(sys.executable)')
//! cargo test --features python --test python_target_faults [-- FILTER]`.

mod io_common;
mod python_common;

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use callreg::error::ErrorCode;
use callreg::io::process::Exit;
use callreg::io::Worker;
use callreg::protocol::{TargetId, TargetOutcome, TargetPhase};
use callreg::runtime::python::PythonRuntime;
use callreg::runtime::TaskEncoding;
use serde_json::{json, Value};

/// Writes the payloads into argv[1] as `NAME.spyc` envelopes made by
/// `callreg_envelope.dumps`; argv[2] is the directory of
/// `callreg_envelope.py`.
///
/// * `open_fds()`: every open descriptor of the target with what it is
///   (`[[fd, readlink], …]`, without the one listing them).
/// * `fstat_fd(fd)`: `"open"`, or the `OSError` text for a closed `fd`.
/// * `first_target_only`: unpickles on the first target that tries
///   (it creates `$CALLREG_TEST_FIRST_MARKER`), raises `RuntimeError` on
///   the others.
/// * `del_raises`, `del_exits`, `del_sleeps`: callable objects whose
///   `__del__` appends a line to `$CALLREG_TEST_FINALIZED`, then raises
///   `ValueError`, calls `os._exit(7)`, or sleeps 3 s.
/// * `exits_at_unpickle`, `segfaults_at_unpickle`: unpickling them ends
///   the process (`os._exit(5)`; a read of address 0).
/// * `slow_a`, `slow_b`: callables (returning `"a"`, `"b"`) whose
///   unpickling sleeps 2 s.
/// * `hold_gil(seconds, marker)`: creates the file `marker`, then calls
///   C `sleep(seconds)` through `ctypes.PyDLL` (C code that keeps the GIL
///   throughout), and returns the seconds it took.
const PAYLOADS: &str = r#"
import os, sys
sys.path.insert(0, sys.argv[2])
import callreg_envelope

out = sys.argv[1]

def open_fds():
    names = os.listdir("/proc/self/fd")
    found = []
    for name in names:
        try:
            found.append([int(name), os.readlink("/proc/self/fd/" + name)])
        except OSError:
            pass  # the directory's own descriptor, closed by now
    return sorted(found)

def fstat_fd(fd):
    try:
        os.fstat(fd)
        return "open"
    except OSError as e:
        return e.strerror

class Finalized:
    """Calls return "called"; `__del__` appends "finalized" to the file
    named by `CALLREG_TEST_FINALIZED`, then does what `then` says."""
    def __init__(self, then, armed=False):
        self.then = then
        self.armed = armed
    def __reduce__(self):
        # Only an unpickled copy (in a target) acts when finalized.
        return (Finalized, (self.then, True))
    def __call__(self):
        return "called"
    def __del__(self):
        import os, time
        if not self.armed:
            return
        with open(os.environ["CALLREG_TEST_FINALIZED"], "a") as f:
            f.write("finalized\n")
        if self.then == "raise":
            raise ValueError("the finalizer refuses")
        if self.then == "exit":
            os._exit(7)
        if self.then == "sleep":
            time.sleep(3)

def first_only():
    try:
        fd = os.open(os.environ["CALLREG_TEST_FIRST_MARKER"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        raise RuntimeError("only the first target may unpickle this payload")
    os.close(fd)
    return lambda: "first"

class ExitsAtUnpickle:
    """Unpickling it ends the process: `os._exit(5)`."""
    def __call__(self):
        return None
    def __reduce__(self):
        return (os._exit, (5,))

def crash():
    import ctypes
    ctypes.string_at(0)

class SegfaultsAtUnpickle:
    """Unpickling it reads address 0 (SIGSEGV)."""
    def __call__(self):
        return None
    def __reduce__(self):
        return (crash, ())

class FirstTargetOnly:
    def __call__(self):
        return None
    def __reduce__(self):
        return (first_only, ())

def slow_install(tag):
    import time
    time.sleep(2.0)
    return lambda: tag

class SlowInstall:
    def __init__(self, tag):
        self.tag = tag
    def __call__(self):
        return self.tag
    def __reduce__(self):
        return (slow_install, (self.tag,))

def hold_gil(seconds, marker):
    import ctypes, time
    open(marker, "w").close()
    start = time.perf_counter()
    # A PyDLL call keeps the GIL for the whole C call.
    ctypes.PyDLL(None).sleep(seconds)
    return time.perf_counter() - start

for name, value in [
    ("slow_a", SlowInstall("a")),
    ("slow_b", SlowInstall("b")),
    ("hold_gil", hold_gil),
    ("first_target_only", FirstTargetOnly()),
    ("exits_at_unpickle", ExitsAtUnpickle()),
    ("segfaults_at_unpickle", SegfaultsAtUnpickle()),
    ("open_fds", open_fds),
    ("fstat_fd", fstat_fd),
    ("del_raises", Finalized("raise")),
    ("del_exits", Finalized("exit")),
    ("del_sleeps", Finalized("sleep")),
]:
    with open(os.path.join(out, name + ".spyc"), "wb") as f:
        f.write(callreg_envelope.dumps(value))
"#;

fn main() {
    io_common::run(&[
        (
            "a_target_holds_no_descriptor_of_the_parent",
            a_target_holds_no_descriptor_of_the_parent,
        ),
        (
            "a_finalizer_runs_at_the_unregister_that_frees_it",
            a_finalizer_runs_at_the_unregister_that_frees_it,
        ),
        (
            "a_finalizer_that_exits_loses_the_target_in_its_unregister",
            a_finalizer_that_exits_loses_the_target_in_its_unregister,
        ),
        (
            "a_slow_finalizer_is_fenced_in_its_unregister",
            a_slow_finalizer_is_fenced_in_its_unregister,
        ),
        (
            "a_bad_startup_callable_fails_its_registration_not_the_worker",
            a_bad_startup_callable_fails_its_registration_not_the_worker,
        ),
        (
            "a_payload_that_exits_at_unpickle_costs_one_target",
            a_payload_that_exits_at_unpickle_costs_one_target,
        ),
        (
            "a_payload_that_segfaults_at_unpickle_costs_one_target",
            a_payload_that_segfaults_at_unpickle_costs_one_target,
        ),
        (
            "registers_queued_behind_a_slow_unpickle_are_not_fenced",
            registers_queued_behind_a_slow_unpickle_are_not_fenced,
        ),
        (
            "a_task_holding_the_gil_does_not_fence_its_target",
            a_task_holding_the_gil_does_not_fence_its_target,
        ),
        (
            "a_stopped_target_is_fenced_at_the_control_timeout",
            a_stopped_target_is_fenced_at_the_control_timeout,
        ),
        (
            "a_register_queued_behind_a_task_holding_the_gil_past_the_bound_is_not_poisoned",
            a_register_queued_behind_a_task_holding_the_gil_past_the_bound_is_not_poisoned,
        ),
        (
            "a_probe_still_unpickling_at_the_bound_is_poisoned",
            a_probe_still_unpickling_at_the_bound_is_poisoned,
        ),
    ]);
}

/// The file the finalizers of `del_*` append to (set for the targets,
/// which inherit the environment), emptied; removed by the caller.
fn finalized_file(test: &str) -> std::path::PathBuf {
    let path =
        std::env::temp_dir().join(format!("callreg-finalized-{}-{test}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    std::env::set_var("CALLREG_TEST_FINALIZED", &path);
    path
}

fn finalized_lines(path: &std::path::Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |text| text.lines().count())
}

/// A callable's `__del__` runs when the unregister that frees it is
/// applied, on every target, before the unregister returns; one that
/// raises leaves the target serving.
fn a_finalizer_runs_at_the_unregister_that_frees_it() {
    let file = finalized_file("raises");
    let worker = worker(2);
    let early = worker.register(envelope("del_raises")).unwrap();
    let fds = worker.register(envelope("open_fds")).unwrap();
    worker.start().unwrap();
    assert_eq!(call(&worker, &early, 0, json!([])), json!("called"));
    let late = worker.register(envelope("del_raises")).unwrap();
    worker.unregister(&early).unwrap();
    // Another handle still holds the digest: nothing is released.
    assert_eq!(finalized_lines(&file), 0);
    worker.unregister(&late).unwrap();
    assert_eq!(finalized_lines(&file), 2, "one finalizer per target");
    assert_eq!(worker.live_targets(), vec![TargetId(0), TargetId(1)]);
    for target in 0..2 {
        assert_eq!(
            call(&worker, &fds, target, json!([]))
                .as_array()
                .unwrap()
                .len(),
            TARGET_FDS
        );
    }
    worker.close();
    let _ = std::fs::remove_file(&file);
}

/// A `__del__` calling `os._exit` ends its target during the unregister
/// that freed it: the target is lost there, with its exit status, and
/// never during a later, unrelated operation; the unregister says so
/// (`TARGET_LOST`) instead of succeeding, though the handle is released.
fn a_finalizer_that_exits_loses_the_target_in_its_unregister() {
    let file = finalized_file("exits");
    let worker = worker(1);
    let handle = worker.register(envelope("del_exits")).unwrap();
    worker.start().unwrap();
    let error = worker.unregister(&handle).unwrap_err();
    assert_eq!(error.code(), ErrorCode::TARGET_LOST, "{error}");
    assert_eq!(error.outcomes, vec![(TargetId(0), TargetOutcome::Lost)]);
    assert_eq!(
        error.error.message,
        format!(
            "handle {} is released (a lost target holds nothing of it), but the unregister lost targets while it was pending there: \
             target 0: lost (its reply socket closed; it exited with status 7)",
            handle.handle_id
        )
    );
    assert_eq!(
        worker.unregister(&handle).unwrap_err().code(),
        ErrorCode::HANDLE_STALE
    );
    assert_eq!(finalized_lines(&file), 1);
    assert_eq!(worker.live_targets(), vec![]);
    assert_eq!(worker.target_exit(TargetId(0)), Some(Exit::Code(7)));
    worker.close();
    let _ = std::fs::remove_file(&file);
}

/// A `__del__` slower than the operation timeout delays the answer of the
/// unregister that freed it, which fences the target at that unregister's
/// bound (not at a later operation's), though it kept reporting alive.
fn a_slow_finalizer_is_fenced_in_its_unregister() {
    let file = finalized_file("sleeps");
    let worker = Worker::builder(Arc::new(PythonRuntime::new()))
        .targets(2)
        // Not shorter: the control timeout also bounds the start, which a
        // loaded machine can slow past half a second.
        .control_timeout(Duration::from_secs(1))
        .operation_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let slow = worker.register(envelope("del_sleeps")).unwrap();
    worker.start().unwrap();
    let error = worker.unregister(&slow).unwrap_err();
    assert_eq!(error.code(), ErrorCode::TARGET_LOST, "{error}");
    assert_eq!(
        error.outcomes,
        vec![
            (TargetId(0), TargetOutcome::Fenced),
            (TargetId(1), TargetOutcome::Fenced)
        ]
    );
    assert_eq!(worker.live_targets(), vec![]);
    for target in 0..2 {
        // At the bound, alive all along: the machine's cause, then how
        // the fence ended it.
        assert_eq!(
            worker.target_loss(TargetId(target)),
            Some(format!(
                "{}; it was killed by signal 9",
                callreg::protocol::BOUND_FENCE_CAUSE
            ))
        );
    }
    worker.close();
    let _ = std::fs::remove_file(&file);
}

fn payloads() -> &'static BTreeMap<String, Vec<u8>> {
    static PAYLOADS_MADE: OnceLock<BTreeMap<String, Vec<u8>>> = OnceLock::new();
    PAYLOADS_MADE.get_or_init(|| {
        python_common::pack_payloads("hardening", PAYLOADS, &[])
            .unwrap_or_else(|why| panic!("{why}"))
    })
}

fn envelope(name: &str) -> &'static [u8] {
    python_common::envelope_in(payloads(), name)
}

use python_common::worker;

fn call(
    worker: &Worker<PythonRuntime>,
    name: &callreg::protocol::Handle,
    target: u16,
    args: Value,
) -> Value {
    let bytes = worker
        .submit(
            name,
            TargetId(target),
            TaskEncoding::Json,
            &python_common::input(args, json!({})),
        )
        .unwrap_or_else(|e| panic!("target {target}: {e}"));
    serde_json::from_slice(&bytes).expect("a JSON result")
}

/// How many descriptors a serving target holds: 0, 1, 2, its control
/// and reply sockets, the task thread's eventfd and the two epoll
/// instances its task and reader threads wait in.
const TARGET_FDS: usize = 8;

/// A descriptor the parent holds without close-on-exec (like a saved copy
/// of stdout) and one with it: a target has neither, only 0, 1, 2, its
/// two channel ends (control socket, reply socket) and the three its
/// threads wait with (the task thread's eventfd, the task thread's and the
/// reader's epoll instances).
fn a_target_holds_no_descriptor_of_the_parent() {
    // Opened before the Worker exists: every target is forked after it.
    let inheritable = nix::unistd::dup(std::io::stdout()).expect("dup");
    let cloexec = std::fs::File::open("/proc/self/stat").expect("a file");
    let parents: Vec<String> = [inheritable.as_raw_fd(), cloexec.as_raw_fd()]
        .iter()
        .map(|fd| {
            std::fs::read_link(format!("/proc/self/fd/{fd}"))
                .unwrap()
                .display()
                .to_string()
        })
        .collect();
    let worker = worker(2);
    let list = worker.register(envelope("open_fds")).unwrap();
    worker.start().unwrap();
    for target in 0..2 {
        let fds = call(&worker, &list, target, json!([]));
        let fds = fds.as_array().expect("a list");
        let numbers: Vec<i64> = fds.iter().map(|e| e[0].as_i64().unwrap()).collect();
        assert_eq!(numbers.len(), TARGET_FDS, "target {target}: {fds:?}");
        assert_eq!(&numbers[..3], &[0, 1, 2], "target {target}: {fds:?}");
        let mut kinds: Vec<&str> = fds[3..]
            .iter()
            .map(|e| {
                let link = e[1].as_str().unwrap();
                if link.starts_with("socket:") {
                    "socket"
                } else {
                    link
                }
            })
            .collect();
        kinds.sort_unstable();
        assert_eq!(
            kinds,
            [
                "anon_inode:[eventfd]",
                "anon_inode:[eventpoll]",
                "anon_inode:[eventpoll]",
                "socket",
                "socket"
            ],
            "target {target}: {fds:?}"
        );
        for parent in &parents {
            assert!(
                fds[3..].iter().all(|e| e[1].as_str() != Some(parent)),
                "target {target} holds the parent's {parent}: {fds:?}"
            );
        }
    }
    worker.close();
}

/// A startup-snapshot callable that fails on some targets (unpickling
/// raises there) and one refused everywhere by its version check fail
/// their registrations only: the Worker starts on every target, reports
/// each failed handle with every target's reason, and the target that
/// installed the first one drops it.
fn a_bad_startup_callable_fails_its_registration_not_the_worker() {
    let marker = std::env::temp_dir().join(format!("callreg-first-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    std::env::set_var("CALLREG_TEST_FIRST_MARKER", &marker);
    let worker = worker(3);
    let good = worker.register(envelope("open_fds")).unwrap();
    let some = worker.register(envelope("first_target_only")).unwrap();
    let wrong_python = python_common::metadata(json!({
        "name": "f",
        "python": {"version": "2.7", "serializer": "cloudpickle", "serializer_version": "2"}
    }));
    let everywhere = worker
        .register_with_metadata(envelope("fstat_fd"), Some(&wrong_python))
        .unwrap();
    let report = worker.start().unwrap();
    let _ = std::fs::remove_file(&marker);
    assert_eq!(
        report.outcomes,
        (0..3)
            .map(|t| (TargetId(t), TargetOutcome::Ok))
            .collect::<Vec<_>>()
    );
    assert!(!report.is_complete());
    let mut failed = report.failed.clone();
    failed.sort_by_key(|f| f.handle.handle_id);
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert_eq!(failed[0].handle, some);
    assert_eq!(failed[0].failures.len(), 2, "{failed:?}");
    for (_, failure) in &failed[0].failures {
        assert_eq!(failure.code, ErrorCode::DESERIALIZE_FAILED);
        assert_eq!(
            failure.message,
            "RuntimeError: only the first target may unpickle this payload"
        );
    }
    assert_eq!(failed[1].handle, everywhere);
    assert_eq!(
        failed[1]
            .failures
            .iter()
            .map(|(t, _)| *t)
            .collect::<Vec<_>>(),
        vec![TargetId(0), TargetId(1), TargetId(2)]
    );
    for (_, failure) in &failed[1].failures {
        assert_eq!(
            failure.code,
            ErrorCode::PYTHON_VERSION_MISMATCH,
            "{failure}"
        );
        assert!(
            failure.message.starts_with("PythonVersionMismatch: "),
            "{failure}"
        );
    }
    let text = callreg::io::worker::registration_failure_text(&failed[0]);
    assert!(
        text.starts_with(&format!(
            "registration of {} (handle {}) failed: target ",
            some.hashid, some.handle_id
        )),
        "{text}"
    );
    // Every target holds only the good callable (inspections queue behind
    // the unregisters of the failed one).
    for (target, table) in worker.inspect().unwrap() {
        let table = table.unwrap_or_else(|| panic!("{target}: no table"));
        assert_eq!(table.installed, vec![(good.digest(), 1)], "{target}");
    }
    for target in 0..3 {
        assert_eq!(
            call(&worker, &good, target, json!([]))
                .as_array()
                .unwrap()
                .len(),
            TARGET_FDS
        );
        let stale = worker
            .submit(
                &some,
                TargetId(target),
                TaskEncoding::Json,
                &python_common::input(json!([]), json!({})),
            )
            .unwrap_err();
        assert_eq!(stale.error.code, ErrorCode::HANDLE_STALE);
    }
    assert!(worker.parent_state().is_idle());
    assert!(worker.parent_state().uncertain_digests().is_empty());
    worker.close();
}

/// A callable whose unpickling ends its process (`os._exit(5)` from
/// `__reduce__`) registered after start: it is tried on one target first
/// (specs/protocol.md §2.8), which dies; the register fails with
/// `REGISTER_POISONED` naming that target and its exit status, the other
/// targets keep their processes, the lost one is replaced (§2.9) and
/// every target serves old and new callables, and a second register of it
/// is refused without reaching any target.
fn a_payload_that_exits_at_unpickle_costs_one_target() {
    poison_costs_one_target("exits_at_unpickle", Exit::Code(5));
}

/// As above with a segmentation fault at unpickle.
fn a_payload_that_segfaults_at_unpickle_costs_one_target() {
    poison_costs_one_target("segfaults_at_unpickle", Exit::Signal(11));
}

fn poison_costs_one_target(payload: &str, exit: Exit) {
    let death = exit.to_string();
    let death = death.as_str();
    let worker = worker(3);
    let fstat = worker.register(envelope("fstat_fd")).unwrap();
    worker.start().unwrap();
    let pids: Vec<Option<i32>> = (0..3).map(|t| worker.target_pid(TargetId(t))).collect();
    let error = worker.register(envelope(payload)).unwrap_err();
    assert_eq!(error.code(), ErrorCode::REGISTER_POISONED, "{error}");
    assert_eq!(error.error.target, Some(TargetId(0)));
    let parsed = callreg::envelope::Envelope::parse(envelope(payload)).unwrap();
    let digest = callreg::descriptor::python_serialized_digest(&parsed);
    assert_eq!(error.error.hashid, Some(digest.hashid()));
    // Named once (the poisoning says how its target died).
    assert_eq!(error.error.message.matches(death).count(), 1, "{error}");
    assert_eq!(error.outcomes, vec![(TargetId(0), TargetOutcome::Lost)]);
    assert_eq!(worker.target_exit(TargetId(0)), Some(exit));
    // Refused at once: no target is touched.
    let again = worker.register(envelope(payload)).unwrap_err();
    assert_eq!(again.code(), ErrorCode::REGISTER_POISONED, "{again}");
    assert!(again.error.message.contains(death), "{again}");
    assert_eq!(again.outcomes, vec![]);
    // The lost target is replaced (specs/protocol.md §2.9): a new process
    // for target 0, given what is live (never the poisoned digest), and the
    // Worker keeps all its targets.
    io_common::wait_for_target(&worker, 0, TargetPhase::Joined, 1);
    assert_eq!(
        worker.live_targets(),
        vec![TargetId(0), TargetId(1), TargetId(2)]
    );
    assert_ne!(worker.target_pid(TargetId(0)), pids[0]);
    for target in 1..3 {
        assert_eq!(
            worker.target_pid(TargetId(target)),
            pids[usize::from(target)]
        );
    }
    // Every target serves what it held and what comes next.
    let list = worker.register(envelope("open_fds")).unwrap();
    for target in 0..3 {
        assert_eq!(call(&worker, &fstat, target, json!([0])), json!("open"));
        assert_eq!(
            call(&worker, &list, target, json!([]))
                .as_array()
                .map(Vec::len),
            Some(TARGET_FDS)
        );
    }
    let tables = worker.inspect().unwrap();
    let inspected: Vec<TargetId> = tables.iter().map(|(t, _)| *t).collect();
    assert_eq!(inspected, vec![TargetId(0), TargetId(1), TargetId(2)]);
    for (target, table) in &tables {
        let mut installed: Vec<String> = table
            .as_ref()
            .expect("a target's table")
            .installed
            .iter()
            .map(|(d, n)| format!("{}x{n}", d.hashid()))
            .collect();
        installed.sort();
        let mut expected = vec![format!("{}x1", fstat.hashid), format!("{}x1", list.hashid)];
        expected.sort();
        assert_eq!(installed, expected, "{target}");
    }
    worker.close();
}

/// Two registers whose unpickling takes 2 s each, under a 3 s control
/// timeout: each target serves them one after the other (the second
/// answers at about 4 s), reporting alive meanwhile, so both succeed and
/// no target is fenced.
fn registers_queued_behind_a_slow_unpickle_are_not_fenced() {
    let worker = Worker::builder(Arc::new(PythonRuntime::new()))
        .targets(2)
        .control_timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    worker.start().unwrap();
    let started = std::time::Instant::now();
    let a = worker.register_async(envelope("slow_a")).unwrap();
    let b = worker.register_async(envelope("slow_b")).unwrap();
    let a = a.wait().unwrap();
    let b = b.wait().unwrap();
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(3900),
        "the second register answered before the first unpickle ended: {elapsed:?}"
    );
    assert_eq!(worker.live_targets(), vec![TargetId(0), TargetId(1)]);
    for target in 0..2 {
        assert_eq!(call(&worker, &a, target, json!([])), json!("a"));
        assert_eq!(call(&worker, &b, target, json!([])), json!("b"));
    }
    worker.close();
}

/// A task holding the GIL in C code for 3 s, with a 1 s control timeout:
/// a register sent meanwhile waits for the GIL to unpickle, its target
/// reports alive without it, and both the task and the register succeed.
fn a_task_holding_the_gil_does_not_fence_its_target() {
    let marker = std::env::temp_dir().join(format!("callreg-gil-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let worker = Worker::builder(Arc::new(PythonRuntime::new()))
        .targets(1)
        .control_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let hold = worker.register(envelope("hold_gil")).unwrap();
    worker.start().unwrap();
    let held = std::thread::scope(|scope| {
        let task = scope.spawn(|| call(&worker, &hold, 0, json!([3, marker.to_str().unwrap()])));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !marker.exists() {
            assert!(std::time::Instant::now() < deadline, "the task never ran");
            std::thread::sleep(Duration::from_millis(5));
        }
        let registered = worker.register(envelope("slow_a"));
        let held = task.join().unwrap();
        let handle = registered.unwrap_or_else(|e| panic!("the register failed: {e}"));
        assert_eq!(call(&worker, &handle, 0, json!([])), json!("a"));
        held
    });
    let held = held.as_f64().unwrap();
    // The test means something only if the GIL was held past the timeout.
    assert!(held > 2.9, "the task held the GIL only {held} s");
    assert_eq!(worker.live_targets(), vec![TargetId(0)]);
    worker.close();
    let _ = std::fs::remove_file(&marker);
}

/// A new callable registered while its probe target runs a task that
/// holds the GIL (a C call that never releases it) longer than the
/// operation timeout: the control thread waits for the GIL, so the probe
/// never begins its unpickle, and the target keeps reporting it alive,
/// queued. It is fenced at the operation's bound, which is no evidence
/// against the callable (`specs/protocol.md` §2.8): the register fails
/// with `REGISTER_PARTIAL_FAILURE` (not `REGISTER_POISONED`), the digest is
/// neither poisoned nor proven, and the next register of it probes again,
/// on the other target, and serves. (Before the alive reports said queued
/// or running, this poisoned the callable for the Worker's life.)
fn a_register_queued_behind_a_task_holding_the_gil_past_the_bound_is_not_poisoned() {
    let marker = std::env::temp_dir().join(format!("callreg-gil-queued-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let worker = Worker::builder(Arc::new(PythonRuntime::new()))
        .targets(2)
        // Not shorter: the control timeout also bounds the start.
        .control_timeout(Duration::from_secs(1))
        .operation_timeout(Duration::from_millis(2_500))
        // Without replacements the next register's probe goes to target 1.
        .respawn_limit(0)
        .build()
        .unwrap();
    let hold = worker.register(envelope("hold_gil")).unwrap();
    worker.start().unwrap();
    let fresh = envelope("open_fds");
    let parsed = callreg::envelope::Envelope::parse(fresh).unwrap();
    let digest = callreg::descriptor::python_serialized_digest(&parsed);
    let task = worker.submit_async(
        &hold,
        TargetId(0),
        TaskEncoding::Json,
        &python_common::input(json!([8, marker.to_str().unwrap()]), json!({})),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !marker.exists() {
        assert!(std::time::Instant::now() < deadline, "the task never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The task is in its C call (it created the marker just before).
    std::thread::sleep(Duration::from_millis(50));
    let started = std::time::Instant::now();
    let error = worker.register(fresh).unwrap_err();
    let elapsed = started.elapsed();
    assert_eq!(error.code(), ErrorCode::REGISTER_PARTIAL_FAILURE, "{error}");
    assert_eq!(error.outcomes, vec![(TargetId(0), TargetOutcome::Fenced)]);
    // Fenced at the bound (heard from all along), while the task still
    // held the GIL: not at the control timeout, not after the task.
    assert!(
        elapsed >= Duration::from_millis(2_400) && elapsed < Duration::from_secs(7),
        "fenced after {elapsed:?}"
    );
    let parent = worker.parent_state();
    assert!(!parent.is_poisoned(digest) && !parent.is_proven(digest));
    assert_eq!(parent.poisoned_digests(), vec![]);
    // The task's target is gone: the task ends with it.
    assert_eq!(
        task.wait().unwrap_err().error.code,
        ErrorCode::TARGET_LOST,
        "the task outlived its fenced target"
    );
    assert_eq!(worker.live_targets(), vec![TargetId(1)]);
    // Probed again, on target 1, and served.
    let handle = worker
        .register(fresh)
        .unwrap_or_else(|e| panic!("the second register failed: {e}"));
    assert!(worker.parent_state().is_proven(digest));
    assert_eq!(
        call(&worker, &handle, 1, json!([]))
            .as_array()
            .map(Vec::len),
        Some(TARGET_FDS)
    );
    worker.close();
    let _ = std::fs::remove_file(&marker);
}

/// The counterpart of the test above: a probe whose unpickle has begun
/// (the target reports it running) and outlasts the operation timeout is
/// fenced at the bound, and that is evidence (`specs/protocol.md` §2.8):
/// `REGISTER_POISONED`, naming the probe target and the bound's cause.
fn a_probe_still_unpickling_at_the_bound_is_poisoned() {
    let worker = Worker::builder(Arc::new(PythonRuntime::new()))
        .targets(2)
        .control_timeout(Duration::from_secs(1))
        // The unpickle of `slow_a` sleeps 2 s.
        .operation_timeout(Duration::from_millis(1_200))
        .respawn_limit(0)
        .build()
        .unwrap();
    worker.start().unwrap();
    let slow = envelope("slow_a");
    let parsed = callreg::envelope::Envelope::parse(slow).unwrap();
    let digest = callreg::descriptor::python_serialized_digest(&parsed);
    let started = std::time::Instant::now();
    let error = worker.register(slow).unwrap_err();
    let elapsed = started.elapsed();
    assert_eq!(error.code(), ErrorCode::REGISTER_POISONED, "{error}");
    assert_eq!(error.error.target, Some(TargetId(0)));
    assert_eq!(error.outcomes, vec![(TargetId(0), TargetOutcome::Fenced)]);
    assert!(
        elapsed >= Duration::from_millis(1_100) && elapsed < Duration::from_millis(1_900),
        "fenced after {elapsed:?}"
    );
    assert_eq!(
        worker.parent_state().poisoned_digests(),
        vec![(
            digest,
            callreg::protocol::Poison {
                target: TargetId(0),
                cause: callreg::protocol::BOUND_FENCE_CAUSE.to_owned(),
            }
        )]
    );
    assert_eq!(worker.live_targets(), vec![TargetId(1)]);
    worker.close();
}

/// A target that goes truly silent (SIGSTOP: no thread runs, no alive
/// report) is fenced at the control timeout, long before the operation
/// timeout; the other target's install is rolled back.
fn a_stopped_target_is_fenced_at_the_control_timeout() {
    let worker = Worker::builder(Arc::new(PythonRuntime::new()))
        .targets(2)
        // Not shorter: the control timeout also bounds the start.
        .control_timeout(Duration::from_secs(2))
        .operation_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    worker.start().unwrap();
    let pid = worker.target_pid(TargetId(1)).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    let started = std::time::Instant::now();
    let error = worker.register(envelope("open_fds")).unwrap_err();
    let elapsed = started.elapsed();
    assert_eq!(error.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(
        error.outcomes,
        vec![
            (TargetId(0), TargetOutcome::RolledBack),
            (TargetId(1), TargetOutcome::Fenced),
        ]
    );
    assert!(
        elapsed >= Duration::from_secs(2) && elapsed < Duration::from_secs(10),
        "fenced after {elapsed:?}"
    );
    assert_eq!(worker.live_targets(), vec![TargetId(0)]);
    worker.close();
}
