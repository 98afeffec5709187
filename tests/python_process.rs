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
use std::sync::{Arc, OnceLock};
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

for name, value in [
    ("original_after_a_pause", OriginalAfterAPause()),
    ("returns_other", lambda: "other"),
]:
    with open(os.path.join(out, name + ".spyc"), "wb") as f:
        f.write(callreg_envelope.dumps(value))
"#;

fn main() {
    io_common::run(&[(
        "a_payload_rewritten_during_its_unpickling_installs_what_was_verified",
        a_payload_rewritten_during_its_unpickling_installs_what_was_verified,
    )]);
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
