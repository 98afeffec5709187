//! The process model with Python targets over real forked processes:
//! staged payloads that no other process can change, and (below) targets
//! whose user code forks.
//!
//! A `harness = false` binary run by the runner of `tests/io_common/mod.rs`
//! (each test on the main thread; no staged payload and no child is left).
//! Payloads are packed at test time by the interpreter named by
//! `PYO3_PYTHON` (else `python3`), which must have cloudpickle.
//!
//! Run: `PYO3_PYTHON=$(python3 -c 'import sys; print(sys.executable)')
//! cargo nextest run --features python --test python_process`.

mod io_common;
mod python_common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use callreg::io::{staging, Worker};
use callreg::protocol::{Handle, TargetId};
use callreg::runtime::python::PythonRuntime;
use callreg::runtime::TaskEncoding;
use serde_json::{json, Value};

/// Writes the payloads into argv[1] as `NAME.spyc` envelopes made by
/// `callreg_envelope.dumps`; argv[2] is the directory of
/// `callreg_envelope.py`.
///
/// * `original_after_a_pause`: unpickling it writes `unpickling` to the
///   file named by `CALLREG_TEST_MARKER`, sleeps 1 s, and gives a callable
///   returning `"original"`.
/// * `returns_other`: a callable returning `"other"`.
/// * `forks_a_sleeper`, `forks_a_sleeper_raw`: unpickling forks a child
///   that blocks (holding the target's channel ends as forked, and the
///   interpreter lock, until killed), appends the child's pid to the
///   `CALLREG_TEST_MARKER` file, and gives a callable returning
///   `"forked"`; the `_raw` one forks with the `fork` system call itself
///   (x86-64; `clone` elsewhere), so no at-fork handler runs.
/// * `fork_and_return`: a callable that forks; the child returns
///   `"grandchild"` from the call, the target waits for it and returns
///   `"target; the grandchild exited with status N"`.
const PAYLOADS: &str = r#"
import os, sys
sys.path.insert(0, sys.argv[2])
import callreg_envelope

out = sys.argv[1]

def _original_after_a_pause():
    import os, time
    with open(os.environ["CALLREG_TEST_MARKER"], "w") as f:
        f.write("unpickling")
    time.sleep(1.0)
    return lambda: "original"

class OriginalAfterAPause:
    def __reduce__(self):
        return (_original_after_a_pause, ())

def _forks_a_sleeper(raw):
    import ctypes, os
    libc = ctypes.PyDLL(None)
    if raw:
        if os.uname().machine == "x86_64":
            pid = libc.syscall(57)  # fork
        else:
            pid = libc.syscall(220, 17, 0, 0, 0, 0)  # clone(SIGCHLD)
    else:
        pid = os.fork()
    if pid == 0:
        while True:
            libc.pause()  # PyDLL: the interpreter lock stays held
    with open(os.environ["CALLREG_TEST_MARKER"], "a") as f:
        f.write("%d\n" % pid)
    return lambda: "forked"

class ForksASleeper:
    def __init__(self, raw):
        self.raw = raw
    def __reduce__(self):
        return (_forks_a_sleeper, (self.raw,))

def fork_and_return():
    import os
    pid = os.fork()
    if pid == 0:
        return "grandchild"
    _, status = os.waitpid(pid, 0)
    return "target; the grandchild exited with status %d" % os.waitstatus_to_exitcode(status)

for name, value in [
    ("original_after_a_pause", OriginalAfterAPause()),
    ("returns_other", lambda: "other"),
    ("forks_a_sleeper", ForksASleeper(False)),
    ("forks_a_sleeper_raw", ForksASleeper(True)),
    ("fork_and_return", fork_and_return),
]:
    with open(os.path.join(out, name + ".spyc"), "wb") as f:
        f.write(callreg_envelope.dumps(value))
"#;

fn main() {
    io_common::run(&[
        (
            "a_payload_rewritten_during_its_unpickling_installs_what_was_verified",
            a_payload_rewritten_during_its_unpickling_installs_what_was_verified,
        ),
        (
            "a_killed_target_whose_unpickling_forked_is_seen_dead_at_once",
            a_killed_target_whose_unpickling_forked_is_seen_dead_at_once,
        ),
        (
            "a_task_that_forks_returns_the_targets_value",
            a_task_that_forks_returns_the_targets_value,
        ),
    ]);
}

/// A payload whose unpickling forks a sleeper that keeps copies of the
/// target's channels (through `os.fork`, and through the raw system call
/// that runs no at-fork handler): killing the target is seen within a
/// second (its pidfd), the target is lost with why, the next task on it
/// fails at once instead of hanging, and the other target still serves.
fn a_killed_target_whose_unpickling_forked_is_seen_dead_at_once() {
    for payload in ["forks_a_sleeper", "forks_a_sleeper_raw"] {
        let marker = marker_file(payload);
        let worker = worker(2);
        worker.start().unwrap();
        let handle = worker.register(envelope(payload)).unwrap();
        let sleepers: Vec<i32> = std::fs::read_to_string(&marker)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        assert_eq!(sleepers.len(), 2, "{payload}: {sleepers:?}");
        let pid = worker.target_pid(TargetId(0)).unwrap();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let killed = Instant::now();
        while worker.live_targets() != vec![TargetId(1)] {
            assert!(
                killed.elapsed() < Duration::from_secs(1),
                "{payload}: the Worker did not see target 0 die: {:?}",
                worker.live_targets()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let loss = worker.target_loss(TargetId(0)).unwrap();
        assert!(
            loss == "its process ended; it was killed by signal 9"
                || loss == "its reply socket closed; it was killed by signal 9",
            "{payload}: {loss}"
        );
        let asked = Instant::now();
        let err = worker
            .submit(
                &handle,
                TargetId(0),
                TaskEncoding::Json,
                &python_common::input(json!([]), json!({})),
            )
            .unwrap_err();
        assert_eq!(
            err.error.code,
            callreg::error::ErrorCode::TARGET_LOST,
            "{err}"
        );
        assert!(asked.elapsed() < Duration::from_secs(1));
        assert_eq!(call(&worker, &handle, 1), json!("forked"));
        worker.close();
        for sleeper in sleepers {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(sleeper),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = std::fs::remove_file(&marker);
    }
}

/// A task that forks, returning in both processes: the caller gets the
/// target's value, the forked copy ends with `FORKED_EXIT_CODE` as soon as
/// it is back in the target's code (it sends nothing), and the target is
/// not lost.
fn a_task_that_forks_returns_the_targets_value() {
    let worker = worker(1);
    worker.start().unwrap();
    let handle = worker.register(envelope("fork_and_return")).unwrap();
    for _ in 0..2 {
        assert_eq!(
            call(&worker, &handle, 0),
            json!(format!(
                "target; the grandchild exited with status {}",
                callreg::io::process::FORKED_EXIT_CODE
            ))
        );
    }
    assert_eq!(worker.live_targets(), vec![TargetId(0)]);
    assert_eq!(worker.target_loss(TargetId(0)), None);
    worker.close();
}

/// While a target unpickles a staged payload, another open of the same
/// file (read-write, through `/proc`) can neither rewrite, truncate, grow
/// nor map it writable: the register succeeds with the verified hashid and
/// the installed callable is the one that was staged.
fn a_payload_rewritten_during_its_unpickling_installs_what_was_verified() {
    let marker = marker_file("rewrite");
    let worker = worker(1);
    worker.start().unwrap();
    let original = envelope("original_after_a_pause");
    let pending = worker.register_async(original).unwrap();
    wait_for_file(&marker);
    // The target is unpickling now; the parent still holds the payload.
    let fds = staging::open_payloads().unwrap();
    assert_eq!(fds.len(), 1, "{fds:?}");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", fds[0]))
        .unwrap();
    let eperm = Some(libc::EPERM);
    let other = envelope("returns_other");
    assert_eq!(
        std::io::Write::write(&mut file, other)
            .unwrap_err()
            .raw_os_error(),
        eperm
    );
    let len = file.metadata().unwrap().len();
    assert_eq!(len, original.len() as u64);
    assert_eq!(file.set_len(len - 1).unwrap_err().raw_os_error(), eperm);
    assert_eq!(file.set_len(len + 1).unwrap_err().raw_os_error(), eperm);
    // SAFETY: a writable shared mapping is requested only to see it refused.
    let mapped = unsafe { memmap2::MmapMut::map_mut(&file) };
    assert_eq!(mapped.unwrap_err().raw_os_error(), eperm);
    drop(file);
    let handle = pending.wait().unwrap();
    assert_eq!(handle.digest(), digest_of(original));
    assert_eq!(call(&worker, &handle, 0), json!("original"));
    worker.close();
    let _ = std::fs::remove_file(&marker);
}

/// A fresh file name for `CALLREG_TEST_MARKER` (set for the targets, which
/// inherit the environment); removed by the caller.
fn marker_file(test: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("callreg-marker-{}-{test}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    std::env::set_var("CALLREG_TEST_MARKER", &path);
    path
}

/// Waits (at most 20 s) until `path` exists and is not empty.
fn wait_for_file(path: &std::path::Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            if !text.is_empty() {
                return text;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn digest_of(envelope: &[u8]) -> callreg::descriptor::Digest {
    let parsed = callreg::envelope::Envelope::parse(envelope).unwrap();
    callreg::descriptor::python_serialized_digest(&parsed)
}

fn payloads() -> &'static BTreeMap<String, Vec<u8>> {
    static PAYLOADS_MADE: OnceLock<BTreeMap<String, Vec<u8>>> = OnceLock::new();
    PAYLOADS_MADE.get_or_init(|| {
        python_common::pack_payloads("process", PAYLOADS, &[]).unwrap_or_else(|why| panic!("{why}"))
    })
}

fn envelope(name: &str) -> &'static [u8] {
    python_common::envelope_in(payloads(), name)
}

use python_common::worker;

fn call(worker: &Worker<PythonRuntime>, handle: &Handle, target: u16) -> Value {
    let bytes = worker
        .submit(
            handle,
            TargetId(target),
            TaskEncoding::Json,
            &python_common::input(json!([]), json!({})),
        )
        .unwrap_or_else(|e| panic!("target {target}: {e}"));
    serde_json::from_slice(&bytes).expect("a JSON result")
}
