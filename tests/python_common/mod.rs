//! Shared by the Python real-process test binaries (`tests/python_worker.rs`,
//! `tests/python_metadata.rs`, `tests/no_parent_deserialize.rs`): payloads
//! packed at test time by the interpreter named by `PYO3_PYTHON` (else
//! `python3`; it must have cloudpickle and be the Python the build linked),
//! and helpers for JSON tasks.
//!
//! Payloads: every name of `examples/callables.py` (packed by
//! `python/tools/callreg_envelope.py`, side-cars included), plus the hooks of
//! [`EXTRA_PAYLOADS`]. They are written to a temporary directory, read, and
//! the directory is removed before any test runs.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use callreg::descriptor::python_serialized_digest;
use callreg::envelope::Envelope;
use callreg::metadata::{CallableMetadata, HookCall};
use serde_json::{json, Value};

/// Writes hook payloads into argv[1] as `NAME.spyc` envelopes made by
/// `callreg_envelope.dumps`; argv[2] is the directory of
/// `callreg_envelope.py`.
///
/// * `append_line(path, text)`: appends `text` and a newline to `path`
///   (a `call_after` hook whose run a test can observe); returns `text`.
/// * `refusing_hook()`: raises `ValueError("this hook refuses")`.
/// * `writes_marker_when_unpickled`: unpickling it creates the file named
///   by the environment variable `CALLREG_TEST_MARKER` (a test asserts a
///   refused install never unpickled it).
pub const EXTRA_PAYLOADS: &str = r#"
import os, sys
sys.path.insert(0, sys.argv[2])
import callreg_envelope

out = sys.argv[1]

def append_line(path, text):
    with open(path, "a") as f:
        f.write(text + "\n")
    return text

def refusing_hook():
    raise ValueError("this hook refuses")

def _write_marker():
    with open(os.environ["CALLREG_TEST_MARKER"], "w") as f:
        f.write("unpickled")
    return lambda: "unpickled"

class WritesMarkerWhenUnpickled:
    def __call__(self):
        return None
    def __reduce__(self):
        return (_write_marker, ())

for name, value in [
    ("append_line", append_line),
    ("refusing_hook", refusing_hook),
    ("writes_marker_when_unpickled", WritesMarkerWhenUnpickled()),
]:
    with open(os.path.join(out, name + ".spyc"), "wb") as f:
        f.write(callreg_envelope.dumps(value))
"#;

/// Envelopes by name, made once per process.
pub fn payloads() -> &'static BTreeMap<String, Vec<u8>> {
    static PAYLOADS: OnceLock<BTreeMap<String, Vec<u8>>> = OnceLock::new();
    PAYLOADS.get_or_init(|| make_payloads().unwrap_or_else(|why| panic!("{why}")))
}

fn make_payloads() -> Result<BTreeMap<String, Vec<u8>>, String> {
    pack_payloads("meta", EXTRA_PAYLOADS, &[])
}

/// Packs every name of `examples/callables.py`, then runs `extra_script`
/// with arguments `OUT_DIR REPO/python EXTRA_ARGS...` to write more `.spyc`
/// files into `OUT_DIR`; returns every envelope by file stem. The scratch
/// directory `$TMPDIR/callreg-python-<tag>-<pid>` is removed afterwards.
pub fn pack_payloads(
    tag: &str,
    extra_script: &str,
    extra_args: &[&std::ffi::OsStr],
) -> Result<BTreeMap<String, Vec<u8>>, String> {
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = scratch_dir(tag);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let result = (|| {
        let out = dir.join("payloads");
        run_python(
            Command::new(&python)
                .arg(repo.join("python/tools/callreg_envelope.py"))
                .arg(repo.join("examples/callables.py"))
                .arg("--out")
                .arg(&out),
        )?;
        run_python(
            Command::new(&python)
                .arg("-c")
                .arg(extra_script)
                .arg(&out)
                .arg(repo.join("python/tools"))
                .args(extra_args),
        )?;
        let mut envelopes = BTreeMap::new();
        for entry in std::fs::read_dir(&out).map_err(|e| e.to_string())? {
            let path: PathBuf = entry.map_err(|e| e.to_string())?.path();
            if path.extension().and_then(|e| e.to_str()) != Some("spyc") {
                continue;
            }
            let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
            envelopes.insert(
                name.to_owned(),
                std::fs::read(&path).map_err(|e| e.to_string())?,
            );
        }
        Ok(envelopes)
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// `$TMPDIR/callreg-python-<tag>-<pid>`: the scratch directory of
/// [`pack_payloads`].
pub fn scratch_dir(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("callreg-python-{tag}-{}", std::process::id()))
}

fn run_python(command: &mut Command) -> Result<(), String> {
    let output = command
        .output()
        .map_err(|e| format!("cannot run {command:?}: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{command:?} failed ({}): {} (cloudpickle must be installed for PYO3_PYTHON)",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// The file name (no directory) that the cloudpickle of `PYO3_PYTHON`
/// gives the code of a function it pickles by value and which `callables.py`
/// defines: `callables.py` before cloudpickle 3.1, a fixed name such as
/// `<dynamic-code>` from 3.1 on (its payloads no longer depend on where the
/// function was defined). Tracebacks of tasks show this name.
pub fn dynamic_code_filename() -> String {
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let output = Command::new(&python)
        .arg("-c")
        .arg(
            "import os, sys, cloudpickle\n\
             sys.path.insert(0, sys.argv[1])\n\
             import callables\n\
             cloudpickle.register_pickle_by_value(callables)\n\
             code = cloudpickle.loads(cloudpickle.dumps(callables.divide)).__code__\n\
             print(os.path.basename(code.co_filename))",
        )
        .arg(&examples)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    assert!(
        output.status.success(),
        "{python}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

/// The envelope packed for `name`.
pub fn envelope(name: &str) -> &'static [u8] {
    envelope_in(payloads(), name)
}

/// The envelope of `name` in a test binary's own payload set.
pub fn envelope_in<'a>(payloads: &'a BTreeMap<String, Vec<u8>>, name: &str) -> &'a [u8] {
    payloads
        .get(name)
        .unwrap_or_else(|| panic!("no payload {name:?}"))
}

/// A Worker of `targets` embedded-mode Python targets with a 20 s control
/// timeout (not started).
pub fn worker(targets: u16) -> callreg::io::Worker<callreg::runtime::python::PythonRuntime> {
    builder(targets).build().expect("a Worker")
}

/// As [`worker`], with every register sent to every target at once
/// (probe-first off): for tests of what each target does with one.
#[allow(dead_code)]
pub fn broadcasting(targets: u16) -> callreg::io::Worker<callreg::runtime::python::PythonRuntime> {
    builder(targets)
        .probe_first(false)
        .build()
        .expect("a Worker")
}

fn builder(targets: u16) -> callreg::io::WorkerBuilder<callreg::runtime::python::PythonRuntime> {
    callreg::io::Worker::builder(std::sync::Arc::new(
        callreg::runtime::python::PythonRuntime::new(),
    ))
    .targets(targets)
    .control_timeout(std::time::Duration::from_secs(20))
}

/// The hashid of `name`'s envelope, as text (`sha256:…`).
pub fn hashid(name: &str) -> String {
    let parsed = Envelope::parse(envelope(name)).expect("a valid envelope");
    python_serialized_digest(&parsed).hashid().to_string()
}

/// A hook call of `name`'s envelope with JSON `args` and `kwargs`.
pub fn hook(name: &str, args: Value, kwargs: Value, retval_keyword: Option<&str>) -> HookCall {
    let mut call = HookCall::new(hashid(name).parse().expect("a hashid"));
    call.args = args.as_array().cloned().unwrap_or_default();
    call.kwargs = kwargs.as_object().cloned().unwrap_or_default();
    call.retval_keyword = retval_keyword.map(str::to_owned);
    call
}

/// Metadata parsed from JSON text (strict, `CallableMetadata::from_json`).
pub fn metadata(value: Value) -> CallableMetadata {
    CallableMetadata::from_json(&value.to_string()).expect("valid metadata")
}

/// A JSON task input.
pub fn input(args: Value, kwargs: Value) -> Vec<u8> {
    json!({"args": args, "kwargs": kwargs})
        .to_string()
        .into_bytes()
}
