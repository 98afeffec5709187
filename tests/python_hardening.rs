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
//! cargo test --features python --test python_hardening [-- FILTER]`.

mod io_common;
mod python_common;

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use callreg::io::Worker;
use callreg::protocol::TargetId;
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

for name, value in [
    ("open_fds", open_fds),
    ("fstat_fd", fstat_fd),
]:
    with open(os.path.join(out, name + ".spyc"), "wb") as f:
        f.write(callreg_envelope.dumps(value))
"#;

fn main() {
    io_common::run(&[(
        "a_target_holds_no_descriptor_of_the_parent",
        a_target_holds_no_descriptor_of_the_parent,
    )]);
}

fn payloads() -> &'static BTreeMap<String, Vec<u8>> {
    static PAYLOADS_MADE: OnceLock<BTreeMap<String, Vec<u8>>> = OnceLock::new();
    PAYLOADS_MADE.get_or_init(|| {
        python_common::pack_payloads("hardening", PAYLOADS, &[])
            .unwrap_or_else(|why| panic!("{why}"))
    })
}

fn envelope(name: &str) -> &'static [u8] {
    payloads()
        .get(name)
        .unwrap_or_else(|| panic!("no payload {name:?}"))
}

fn worker(targets: u16) -> Worker<PythonRuntime> {
    Worker::builder(Arc::new(PythonRuntime::new()))
        .targets(targets)
        .control_timeout(Duration::from_secs(20))
        .build()
        .expect("a Worker")
}

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

/// A descriptor the parent holds without close-on-exec (like a saved copy
/// of stdout) and one with it: a target has neither, only 0, 1, 2 and its
/// two pipe ends.
fn a_target_holds_no_descriptor_of_the_parent() {
    // Opened before the Worker exists: every target is forked after it.
    let inheritable = nix::unistd::dup(std::io::stdout()).expect("dup");
    let cloexec = std::fs::File::open("/proc/self/stat").expect("a file");
    let worker = worker(2);
    let list = worker.register(envelope("open_fds")).unwrap();
    let fstat = worker.register(envelope("fstat_fd")).unwrap();
    worker.start().unwrap();
    for target in 0..2 {
        let fds = call(&worker, &list, target, json!([]));
        let fds = fds.as_array().expect("a list");
        let numbers: Vec<i64> = fds.iter().map(|e| e[0].as_i64().unwrap()).collect();
        assert_eq!(numbers.len(), 5, "target {target}: {fds:?}");
        assert_eq!(&numbers[..3], &[0, 1, 2], "target {target}: {fds:?}");
        for entry in &fds[3..] {
            assert!(
                entry[1].as_str().unwrap().starts_with("pipe:["),
                "target {target}: {fds:?}"
            );
        }
        for fd in [inheritable.as_raw_fd(), cloexec.as_raw_fd()] {
            assert_eq!(
                call(&worker, &fstat, target, json!([fd])),
                json!("Bad file descriptor"),
                "target {target}, fd {fd}"
            );
        }
    }
    worker.close();
}
