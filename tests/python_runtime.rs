//! The Python runtime ([`PythonRuntime`]) in real forked targets, including
//! `install` with metadata: every check before deserializing
//! (`specs/metadata.md` §5), each failing case asserting that the payload
//! (which writes a marker file when unpickled) was not deserialized.
//!
//! `harness = false`: this file is its own `main`, single-threaded when it
//! forks. Each case runs in a fresh child forked from this process (which
//! never initialises Python), because the runtime must start only once per
//! process and only in a target. The child reports failure through a pipe
//! and its exit status; a watchdog alarm kills a child that hangs.
//!
//! Payloads are produced at test time by the interpreter named by
//! `PYO3_PYTHON` (else `python3`) with cloudpickle, which must be the same
//! Python minor version the build linked. Without cloudpickle the test
//! fails, unless `CALLREG_ALLOW_NO_PYTHON=1`.
//!
//! Run: `PYO3_PYTHON=$(python3 -c 'import sys; print(sys.executable)')
//! cargo test --features python --test python_runtime [-- FILTER...]`
//! (`cargo nextest run --features python --test python_runtime` works too:
//! libtest-mimic speaks libtest's command line, and runs the cases on the
//! main thread).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use callreg::envelope::{encode, Envelope};
use callreg::error::ErrorCode;
use callreg::metadata::{merge_retval_keyword, CallableMetadata, ExecutorSpec};
use callreg::runtime::python::{PythonExecutor, PythonRuntime};
use callreg::runtime::{Runtime, RuntimeError, Staged, TaskEncoding};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, pipe, ForkResult};
use sha2::{Digest, Sha256};

/// Seconds a child may run before its watchdog alarm (SIGALRM) kills it.
const CHILD_WATCHDOG_SECONDS: u32 = 60;

/// Writes every payload the cases use into the directory given as argv[1]:
/// `NAME.pickle` holds `cloudpickle.dumps(value)`; functions defined here
/// live in `__main__`, so cloudpickle pickles them by value.
const PAYLOAD_GENERATOR: &str = r#"
import functools, hashlib, os, pickle, platform, sys, time
import cloudpickle

out = sys.argv[1]

def save(name, value, raw=False):
    data = value if raw else cloudpickle.dumps(value)
    with open(os.path.join(out, name + ".pickle"), "wb") as f:
        f.write(data)

def make_adder(n):
    def add(x):
        return x + n
    return add

class Multiplier:
    def __init__(self, factor):
        self.factor = factor
    def __call__(self, x):
        return self.factor * x

def greet(name, greeting="hello", punctuation="."):
    return greeting + " " + name + punctuation

def outer():
    def twice(x):
        return [x, x]
    def inner(x):
        return {"pair": twice(x)}
    return inner

BLOB = bytes(range(256)) * 4096
def make_checksum(blob):
    def checksum():
        return [len(blob), hashlib.sha256(blob).hexdigest()]
    return checksum

def refuse(message):
    raise ValueError(message)

class FailsToUnpickle:
    def __call__(self):
        return None
    def __reduce__(self):
        return (refuse, ("unpickle refused",))

class ExitsWhenUnpickled:
    def __call__(self):
        return None
    def __reduce__(self):
        return (sys.exit, (3,))

def interrupt():
    raise KeyboardInterrupt("interrupted while unpickling")

class InterruptsWhenUnpickled:
    def __call__(self):
        return None
    def __reduce__(self):
        return (interrupt, ())

def divide(a, b):
    return a / b

def compute(a, b):
    return divide(a, b) + 1

def exits(code):
    sys.exit(code)

def power(a, b=2):
    return (a ** b, "done")

def scaled(a, *, scale=1, offset=0):
    return a * scale + offset

def thread_state_count():
    import ctypes
    api = ctypes.pythonapi
    api.PyInterpreterState_Get.restype = ctypes.c_void_p
    api.PyInterpreterState_ThreadHead.restype = ctypes.c_void_p
    api.PyInterpreterState_ThreadHead.argtypes = [ctypes.c_void_p]
    api.PyThreadState_Next.restype = ctypes.c_void_p
    api.PyThreadState_Next.argtypes = [ctypes.c_void_p]
    count = 0
    state = api.PyInterpreterState_ThreadHead(api.PyInterpreterState_Get())
    while state:
        count += 1
        state = api.PyThreadState_Next(state)
    return count

class Finalized:
    """Callable; writes OUT/finalized-<pid> when it is collected."""
    def __call__(self):
        return "alive"
    def __del__(self):
        with open(os.path.join(out, "finalized-%d" % os.getpid()), "w"):
            pass

def spin_until(path):
    spins = 0
    while not os.path.exists(path):
        spins += 1
    return "released"

save("python_version", platform.python_version)
save("lambda_square", lambda x: x * x)
save("closure_add_10", make_adder(10))
save("callable_object", Multiplier(3))
save("partial_greet", functools.partial(greet, greeting="hi"))
save("nested_inner", outer())
save("big_closure", make_checksum(BLOB))
save("raises_on_unpickle", FailsToUnpickle())
save("exits_on_unpickle", ExitsWhenUnpickled())
save("interrupts_on_unpickle", InterruptsWhenUnpickled())
save("non_callable_dict", {"a": 1})
save("task_raises", compute)
save("task_exits", exits)
save("returns_set", lambda: {1, 2})
save("returns_nan", lambda: float("nan"))
save("returns_lambda", lambda: (lambda: 0))
save("power", power)
save("scaled", scaled)
save("spin_until", spin_until)
save("thread_state_count", thread_state_count)
save("finalized", Finalized())
save("identity", lambda x: x)
save("sigint_ignored", lambda: (lambda s: s.getsignal(s.SIGINT) == s.SIG_IGN)(__import__("signal")))
save("pickle_input", pickle.dumps(((2,), {"b": 5})), raw=True)
save("pickle_expected", pickle.dumps((32, "done"), protocol=pickle.HIGHEST_PROTOCOL), raw=True)
save("pickle_input_empty", pickle.dumps(((), {})), raw=True)
save("pickle_input_not_pair", pickle.dumps([1, 2, 3]), raw=True)
save("length", lambda s: len(s))
save("pickle_input_len_100", pickle.dumps((("x" * 100,), {})), raw=True)
save("pickle_input_len_10000", pickle.dumps((("x" * 10000,), {})), raw=True)
save("pickle_expected_100", pickle.dumps(100, protocol=pickle.HIGHEST_PROTOCOL), raw=True)
save("pickle_expected_10000", pickle.dumps(10000, protocol=pickle.HIGHEST_PROTOCOL), raw=True)
# Results of a plain type, and small tuples, lists and dicts of them (and
# one too long to be looked at): their pickle is the same from pickle and
# from cloudpickle, which the target's fast path relies on.
PLAIN_RESULTS = [
    7, 2**100, -1.5, complex(1, 2), "h\u00e9llo", b"\x00\xff", True, None,
    (1, "a"), [1.5, None], {"k": b"v", 2: 3.0}, list(range(32)), list(range(33)), (), {},
]
for k, value in enumerate(PLAIN_RESULTS):
    expected = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    assert cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) == expected, value
    save("plain_input_%d" % k, pickle.dumps(((value,), {})), raw=True)
    save("plain_expected_%d" % k, expected, raw=True)

def mark_unpickled(directory):
    with open(os.path.join(directory, "unpickled-%d" % os.getpid()), "w"):
        pass
    return lambda x: x + 1

class MarksWhenUnpickled:
    """Unpickling it writes OUT/unpickled-<pid>: proof of a deserialization."""
    def __call__(self, x):
        return x + 1
    def __reduce__(self):
        return (mark_unpickled, (out,))

def chatty(x):
    print("to stdout", x)
    print("to stderr", file=sys.stderr)
    return x * 2

save("marks_on_unpickle", MarksWhenUnpickled())
save("chatty", chatty)
save("make_config", lambda factor: {"scale": factor})
save("uses_config", lambda x, config: x * config["scale"])
with open(os.path.join(out, "cloudpickle_version.txt"), "w") as f:
    f.write(cloudpickle.__version__)
# The file name this cloudpickle gives the code of a function it pickles by
# value: the defining file (before 3.1) or a fixed name such as
# "<dynamic-code>" (3.1 and later, for deterministic payloads).
with open(os.path.join(out, "dynamic_code_filename.txt"), "w") as f:
    f.write(os.path.basename(cloudpickle.loads(cloudpickle.dumps(divide)).__code__.co_filename))
with open(os.path.join(out, "python_version.txt"), "w") as f:
    f.write(platform.python_version())
"#;

/// What every case gets: the payload directory and its files' bytes.
struct Payloads {
    directory: PathBuf,
    files: BTreeMap<String, Vec<u8>>,
    /// Each file's bytes as a reference-form envelope.
    envelopes: BTreeMap<String, Vec<u8>>,
}

impl Payloads {
    /// The bytes of `NAME.pickle`.
    fn get(&self, name: &str) -> Result<&[u8], String> {
        self.files
            .get(name)
            .map(Vec::as_slice)
            .ok_or_else(|| format!("no payload {name}.pickle was generated"))
    }

    /// `NAME.pickle` as a staged envelope held in memory, for
    /// [`Runtime::install`].
    fn staged(&self, name: &str) -> Result<Staged<'_>, String> {
        let bytes = self
            .envelopes
            .get(name)
            .ok_or_else(|| format!("no payload {name}.pickle was generated"))?;
        Envelope::parse(bytes)
            .map(Staged::in_memory)
            .map_err(|e| e.to_string())
    }
}

type CaseResult = Result<(), String>;

/// One case: runs in a fresh child after `PythonRuntime::start` unless
/// `started` is false.
struct Case {
    name: &'static str,
    started: bool,
    run: fn(&PythonRuntime, &Payloads) -> CaseResult,
}

fn main() -> ExitCode {
    let mut args = libtest_mimic::Arguments::from_args();
    // Each case forks its child from the main thread: libtest-mimic runs
    // the trials on the calling thread when it has one test thread.
    args.test_threads = Some(1);
    let cases = cases();
    let payloads = if args.list {
        None
    } else {
        let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
        let has_cloudpickle = Command::new(&python)
            .args(["-c", "import cloudpickle"])
            .output()
            .map(|output| output.status.success())
            .unwrap_or(false);
        if !has_cloudpickle {
            if std::env::var("CALLREG_ALLOW_NO_PYTHON").as_deref() == Ok("1") {
                println!("python_runtime: skipped: {python} cannot import cloudpickle (CALLREG_ALLOW_NO_PYTHON=1)");
                return ExitCode::SUCCESS;
            }
            eprintln!(
                "python_runtime: {python} with cloudpickle is required (pip install cloudpickle), \
                 or set CALLREG_ALLOW_NO_PYTHON=1 to skip"
            );
            return ExitCode::FAILURE;
        }
        match generate_payloads(&python) {
            Ok(payloads) => Some(Arc::new(payloads)),
            Err(message) => {
                eprintln!("python_runtime: generating payloads failed: {message}");
                return ExitCode::FAILURE;
            }
        }
    };
    let trials = cases
        .into_iter()
        .map(|case| {
            let payloads = payloads.clone();
            libtest_mimic::Trial::test(case.name, move || {
                if nix::unistd::gettid() != nix::unistd::getpid() {
                    return Err("the case does not run on the main thread".into());
                }
                let payloads = payloads.ok_or("no payloads")?;
                run_in_child(&case, &payloads).map_err(Into::into)
            })
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    if let Some(payloads) = &payloads {
        let _ = std::fs::remove_dir_all(&payloads.directory);
    }
    conclusion.exit_code()
}

/// Runs the generator and the envelope tool's pack command on
/// `examples/callables.py`, then reads every produced file.
fn generate_payloads(python: &str) -> Result<Payloads, String> {
    let directory =
        std::env::temp_dir().join(format!("callreg-python-runtime-{}", std::process::id()));
    let examples = directory.join("examples");
    std::fs::create_dir_all(&examples).map_err(|e| format!("{}: {e}", directory.display()))?;
    let run = |command: &mut Command| -> Result<(), String> {
        let output = command
            .output()
            .map_err(|e| format!("spawning {python}: {e}"))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{command:?} failed ({}):\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ))
        }
    };
    // Run from a file, not `-c`, so that tracebacks in the target can show
    // the source lines of the generated functions.
    let generator = directory.join("generate_payloads.py");
    std::fs::write(&generator, PAYLOAD_GENERATOR)
        .map_err(|e| format!("{}: {e}", generator.display()))?;
    run(Command::new(python).arg(&generator).arg(&directory))?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    run(Command::new(python)
        .arg(root.join("python/tools/callreg_envelope.py"))
        .arg(root.join("examples/callables.py"))
        .arg("--out")
        .arg(&examples))?;

    let mut files = BTreeMap::new();
    for (dir, extension, prefix) in [(&directory, "pickle", ""), (&examples, "spyc", "examples/")] {
        for entry in std::fs::read_dir(dir).map_err(|e| e.to_string())? {
            let path = entry.map_err(|e| e.to_string())?.path();
            if path.extension().and_then(|e| e.to_str()) != Some(extension) {
                continue;
            }
            let stem = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default();
            let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            files.insert(format!("{prefix}{stem}"), bytes);
        }
    }
    let envelopes = files
        .iter()
        .map(|(name, pickle)| (name.clone(), encode(pickle)))
        .collect();
    Ok(Payloads {
        directory,
        files,
        envelopes,
    })
}

/// Forks a child that runs `case` and reports through a pipe; returns the
/// case's failure message, or how the child died.
fn run_in_child(case: &Case, payloads: &Payloads) -> CaseResult {
    // SAFETY: `Py_IsInitialized` only reads a flag; it is valid before the
    // interpreter exists.
    let python_in_parent = unsafe { pyo3::ffi::Py_IsInitialized() } != 0;
    assert!(!python_in_parent, "Python was initialised in the parent");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let (read_end, write_end) = pipe().map_err(|e| format!("pipe: {e}"))?;
    // SAFETY: this process is single-threaded here (harness = false, no
    // thread was spawned), so the child may run arbitrary code.
    match unsafe { fork() }.map_err(|e| format!("fork: {e}"))? {
        ForkResult::Child => {
            drop(read_end);
            nix::unistd::alarm::set(CHILD_WATCHDOG_SECONDS);
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let runtime = PythonRuntime::new();
                if case.started {
                    runtime.start().map_err(|e| format!("start: {e}"))?;
                }
                (case.run)(&runtime, payloads)
            }));
            let status = match outcome {
                Ok(Ok(())) => 0,
                Ok(Err(message)) => {
                    let _ = File::from(write_end).write_all(message.as_bytes());
                    1
                }
                Err(_) => {
                    let _ = File::from(write_end).write_all(b"the case panicked");
                    2
                }
            };
            let _ = std::io::stdout().flush();
            // SAFETY: `_exit` ends the child without running the parent's
            // destructors or atexit handlers, which belong to the parent.
            unsafe { libc::_exit(status) }
        }
        ForkResult::Parent { child } => {
            drop(write_end);
            let mut report = String::new();
            let read = File::from(read_end).read_to_string(&mut report);
            let status = waitpid(child, None).map_err(|e| format!("waitpid: {e}"))?;
            read.map_err(|e| format!("reading the child's report: {e}"))?;
            match status {
                WaitStatus::Exited(_, 0) if report.is_empty() => Ok(()),
                WaitStatus::Exited(_, code) => Err(format!("  child exited {code}: {report}")),
                other => Err(format!("  child ended abnormally: {other:?} {report}")),
            }
        }
    }
}

/// Checks `actual == expected`, with both in the failure message.
fn expect_eq<T: PartialEq + std::fmt::Debug>(what: &str, actual: T, expected: T) -> CaseResult {
    if actual == expected {
        Ok(())
    } else {
        Err(format!(
            "{what}:\n  expected {expected:?}\n  got      {actual:?}"
        ))
    }
}

/// Checks that `result` is the error with exactly this code, kind and
/// message.
fn expect_error<T>(
    what: &str,
    result: Result<T, RuntimeError>,
    code: ErrorCode,
    kind: &str,
    message: &str,
) -> CaseResult {
    let error = result
        .err()
        .ok_or_else(|| format!("{what}: expected {code}: {kind}: {message}, got success"))?;
    expect_eq(
        what,
        (error.code, error.kind.as_str(), error.message.as_str()),
        (code, kind, message),
    )
}

/// Deserializes the payload `name` and calls it with JSON `input`; returns
/// the JSON result as text.
fn call_json(
    runtime: &PythonRuntime,
    payloads: &Payloads,
    name: &str,
    input: &str,
) -> Result<String, String> {
    let callable = runtime
        .deserialize(payloads.get(name)?)
        .map_err(|e| format!("deserialize {name}: {e}"))?;
    let result = runtime
        .call(&callable, TaskEncoding::Json, input.as_bytes())
        .map_err(|e| format!("call {name}: {e}"))?;
    String::from_utf8(result).map_err(|e| format!("{name}: result not UTF-8: {e}"))
}

/// The serializer payload of a SPYC envelope (specs/design.md §3.1): checks the
/// magic, version 1, serializer 1, flags 0 and the declared size.
fn envelope_payload(envelope: &[u8]) -> Result<&[u8], String> {
    let header: [u8; 16] = envelope
        .get(..16)
        .and_then(|h| h.try_into().ok())
        .ok_or("envelope shorter than 16 bytes")?;
    if header[..8] != *b"SPYC\x01\x01\x00\x00" {
        return Err(format!("unexpected envelope header {header:?}"));
    }
    let size = u64::from_le_bytes(header[8..].try_into().map_err(|_| "size field")?);
    let size = usize::try_from(size).map_err(|e| e.to_string())?;
    envelope
        .get(16..16 + size)
        .ok_or_else(|| format!("envelope declares {size} payload bytes it does not hold"))
}

/// Whether the payload `marks_on_unpickle` was unpickled in this process.
fn unpickled_here(payloads: &Payloads) -> bool {
    payloads
        .directory
        .join(format!("unpickled-{}", std::process::id()))
        .exists()
}

/// Installs `marks_on_unpickle` with `metadata` (JSON) and checks the
/// exact error, and that the payload was not unpickled.
fn expect_refused(
    runtime: &PythonRuntime,
    payloads: &Payloads,
    metadata: serde_json::Value,
    code: ErrorCode,
    kind: &str,
    message: &str,
) -> CaseResult {
    let metadata = CallableMetadata::from_json(&metadata.to_string()).map_err(|e| e.to_string())?;
    expect_error(
        "install",
        runtime.install(payloads.staged("marks_on_unpickle")?, Some(&metadata)),
        code,
        kind,
        message,
    )?;
    expect_eq("the payload was unpickled", unpickled_here(payloads), false)
}

/// A file of the payload directory, trimmed.
fn read_text(payloads: &Payloads, name: &str) -> Result<String, String> {
    std::fs::read_to_string(payloads.directory.join(name))
        .map(|text| text.trim().to_owned())
        .map_err(|e| format!("{name}: {e}"))
}

/// The major number of a cloudpickle version text (`"3.1.3"` → `"3"`).
fn serializer_major(version: &str) -> Result<&str, String> {
    version
        .split('.')
        .next()
        .filter(|major| !major.is_empty() && major.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| format!("{version:?} does not start with a major version"))
}

/// The producer's Python version, and the same with the minor version + 1.
fn python_versions(payloads: &Payloads) -> Result<(String, String), String> {
    let producer = read_text(payloads, "python_version.txt")?;
    let mut parts = producer.split('.');
    let (major, minor) = (parts.next().unwrap_or("3"), parts.next().unwrap_or("0"));
    let minor: u32 = minor.parse().map_err(|e| format!("{producer}: {e}"))?;
    Ok((producer.clone(), format!("{major}.{}.0", minor + 1)))
}

/// An embedder's executor: calls the callable `times` times (attribute,
/// default 2) and returns the list of results.
#[derive(Debug)]
struct RepeatExecutor;

impl PythonExecutor for RepeatExecutor {
    fn spec(&self) -> ExecutorSpec {
        let mut defaults = serde_json::Map::new();
        defaults.insert("times".into(), serde_json::json!(2));
        ExecutorSpec::new("repeat", "RepeatExecutor", defaults)
    }

    fn call<'py>(
        &self,
        py: pyo3::Python<'py>,
        attributes: &serde_json::Map<String, serde_json::Value>,
        callable: &pyo3::Bound<'py, pyo3::PyAny>,
        args: &pyo3::Bound<'py, pyo3::types::PyTuple>,
        kwargs: &pyo3::Bound<'py, pyo3::types::PyDict>,
    ) -> pyo3::PyResult<pyo3::Bound<'py, pyo3::PyAny>> {
        use pyo3::types::{PyAnyMethods, PyListMethods};
        let times = attributes
            .get("times")
            .and_then(|v| v.as_u64())
            .unwrap_or(2);
        let results = pyo3::types::PyList::empty(py);
        for _ in 0..times {
            results.append(callable.call(args, Some(kwargs))?)?;
        }
        Ok(results.into_any())
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "metadata_matching_the_target_installs",
            started: true,
            run: |runtime, payloads| {
                let (producer, _) = python_versions(payloads)?;
                let serializer = read_text(payloads, "cloudpickle_version.txt")?;
                let same_major = format!("cloudpickle=={}.*", serializer_major(&serializer)?);
                let metadata = CallableMetadata::from_json(
                    &serde_json::json!({
                        "name": "marks",
                        "python": {"version": producer, "serializer": "cloudpickle", "serializer_version": serializer},
                        "executor": "python",
                        "deps": {"pip": {"packages": ["cloudpickle>=2", same_major]}, "bash": {"commands": ["true"]}},
                    })
                    .to_string(),
                )
                .map_err(|e| e.to_string())?;
                let callable = runtime
                    .install(payloads.staged("marks_on_unpickle")?, Some(&metadata))
                    .map_err(|e| e.to_string())?;
                expect_eq("unpickled after the checks", unpickled_here(payloads), true)?;
                expect_eq(
                    "executor",
                    callable.executor_short_name().as_str(),
                    "python",
                )?;
                expect_eq(
                    "attributes",
                    serde_json::Value::Object(callable.executor_attributes()),
                    serde_json::json!({"capture_output": false}),
                )?;
                let result = runtime
                    .call(&callable, TaskEncoding::Json, br#"{"args": [41]}"#)
                    .map_err(|e| e.to_string())?;
                expect_eq("result", result.as_slice(), b"42")
            },
        },
        Case {
            name: "metadata_python_version_mismatch_names_both_sides",
            started: true,
            run: |runtime, payloads| {
                let (target, faked) = python_versions(payloads)?;
                expect_refused(
                    runtime,
                    payloads,
                    serde_json::json!({"name": "marks", "python": {"version": faked, "serializer": "cloudpickle", "serializer_version": "2.1.0"}}),
                    ErrorCode::PYTHON_VERSION_MISMATCH,
                    "PythonVersionMismatch",
                    &format!(
                        "the payload was serialized by Python {faked} but this target runs Python {target} \
                         (major.minor must match); serialize with the interpreter the targets run \
                         (for the callreg command, the PYO3_PYTHON it was built with)"
                    ),
                )
            },
        },
        Case {
            name: "metadata_serializer_major_mismatch_names_both_sides",
            started: true,
            run: |runtime, payloads| {
                let (target, _) = python_versions(payloads)?;
                let serializer = read_text(payloads, "cloudpickle_version.txt")?;
                expect_refused(
                    runtime,
                    payloads,
                    serde_json::json!({"name": "marks", "python": {"version": target, "serializer": "cloudpickle", "serializer_version": "99.0.1"}}),
                    ErrorCode::PYTHON_VERSION_MISMATCH,
                    "SerializerMismatch",
                    &format!(
                        "the payload was serialized with cloudpickle 99.0.1 but this target deserializes with \
                         cloudpickle {serializer} (the serializer and its major version must match); serialize with the interpreter \
                         the targets run (for the callreg command, the PYO3_PYTHON it was built with)"
                    ),
                )?;
                expect_refused(
                    runtime,
                    payloads,
                    serde_json::json!({"name": "marks", "python": {"version": target, "serializer": "dill", "serializer_version": serializer}}),
                    ErrorCode::PYTHON_VERSION_MISMATCH,
                    "SerializerMismatch",
                    &format!(
                        "the payload was serialized with dill {serializer} but this target deserializes with \
                         cloudpickle {serializer} (the serializer and its major version must match); serialize with the interpreter \
                         the targets run (for the callreg command, the PYO3_PYTHON it was built with)"
                    ),
                )
            },
        },
        Case {
            name: "metadata_missing_pip_package_is_named",
            started: true,
            run: |runtime, payloads| {
                expect_refused(
                    runtime,
                    payloads,
                    serde_json::json!({"name": "marks", "deps": {"pip": {"packages": ["cloudpickle", "callreg-no-such-distribution>=1.0"]}}}),
                    ErrorCode::DEPS_UNSATISFIED,
                    "PipRequirementUnsatisfied",
                    "deps.pip is not satisfied: callreg-no-such-distribution>=1.0 (not installed)",
                )
            },
        },
        Case {
            name: "metadata_unsatisfied_version_spec_is_named",
            started: true,
            run: |runtime, payloads| {
                let serializer = read_text(payloads, "cloudpickle_version.txt")?;
                let other_major = format!("cloudpickle!={}.*", serializer_major(&serializer)?);
                expect_refused(
                    runtime,
                    payloads,
                    serde_json::json!({"name": "marks", "deps": {"pip": {"packages": ["cloudpickle>=2", "cloudpickle>=99", other_major]}}}),
                    ErrorCode::DEPS_UNSATISFIED,
                    "PipRequirementUnsatisfied",
                    &format!(
                        "deps.pip is not satisfied: cloudpickle>=99 (installed {serializer}); \
                         {other_major} (installed {serializer})"
                    ),
                )
            },
        },
        Case {
            name: "metadata_pip_marker_needs_packaging",
            started: true,
            run: |runtime, payloads| {
                // With `packaging` in the target the marker is evaluated
                // (false on Python 3, so the requirement does not apply);
                // without it the requirement cannot be checked and is
                // refused, never guessed.
                let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
                let has_packaging = Command::new(python)
                    .args(["-c", "import packaging.requirements"])
                    .output()
                    .map(|output| output.status.success())
                    .map_err(|e| e.to_string())?;
                let requirement = "cloudpickle>=99; python_version < \"3\"";
                let metadata = serde_json::json!({"name": "marks", "deps": {"pip": {"packages": [requirement]}}});
                if has_packaging {
                    let metadata = CallableMetadata::from_json(&metadata.to_string())
                        .map_err(|e| e.to_string())?;
                    runtime
                        .install(payloads.staged("marks_on_unpickle")?, Some(&metadata))
                        .map_err(|e| e.to_string())?;
                    let unpickled = unpickled_here(payloads);
                    let _ = std::fs::remove_file(
                        payloads
                            .directory
                            .join(format!("unpickled-{}", std::process::id())),
                    );
                    expect_eq("installed with packaging", unpickled, true)
                } else {
                    expect_refused(
                        runtime,
                        payloads,
                        metadata,
                        ErrorCode::DEPS_UNSATISFIED,
                        "PipRequirementUnsatisfied",
                        &format!(
                            "deps.pip is not satisfied: {requirement} (cannot be checked: environment markers \
                             need the `packaging` module, which is not installed)"
                        ),
                    )
                }
            },
        },
        Case {
            name: "metadata_failing_bash_command_reports_status_and_stderr_tail",
            started: true,
            run: |runtime, payloads| {
                let failing =
                    "for i in 1 2 3 4 5 6 7 8 9 10 11 12; do echo \"line $i\" >&2; done; exit 3";
                let tail: Vec<String> = (3..=12).map(|i| format!("line {i}")).collect();
                expect_refused(
                    runtime,
                    payloads,
                    serde_json::json!({"name": "marks", "deps": {"bash": {"commands": ["true", failing, "touch never"]}}}),
                    ErrorCode::DEPS_UNSATISFIED,
                    "BashCommandFailed",
                    &format!(
                        "deps.bash command 2 of 3 ({failing:?}) exited with status 3; stderr tail:\n{}",
                        tail.join("\n")
                    ),
                )?;
                expect_refused(
                    runtime,
                    payloads,
                    serde_json::json!({"name": "marks", "deps": {"bash": {"commands": ["kill -9 $$"]}}}),
                    ErrorCode::DEPS_UNSATISFIED,
                    "BashCommandFailed",
                    "deps.bash command 1 of 1 (\"kill -9 $$\") was killed by signal 9; its stderr was empty",
                )
            },
        },
        Case {
            name: "metadata_bash_runs_once_per_install_before_deserializing",
            started: true,
            run: |runtime, payloads| {
                let log = payloads
                    .directory
                    .join(format!("bash-{}", std::process::id()));
                let marker = payloads
                    .directory
                    .join(format!("unpickled-{}", std::process::id()));
                // Logs whether the payload had been unpickled when it ran.
                let command = format!(
                    "if [ -e '{}' ]; then echo after >> '{}'; else echo before >> '{}'; fi",
                    marker.display(),
                    log.display(),
                    log.display()
                );
                let metadata = CallableMetadata::from_json(
                    &serde_json::json!({"name": "marks", "deps": {"bash": {"commands": [command]}}}).to_string(),
                )
                .map_err(|e| e.to_string())?;
                let callable = runtime
                    .install(payloads.staged("marks_on_unpickle")?, Some(&metadata))
                    .map_err(|e| e.to_string())?;
                for _ in 0..3 {
                    runtime
                        .call(&callable, TaskEncoding::Json, br#"{"args": [1]}"#)
                        .map_err(|e| e.to_string())?;
                }
                expect_eq(
                    "log after one install and 3 tasks",
                    read_text(payloads, &format!("bash-{}", std::process::id()))?,
                    "before".to_owned(),
                )?;
                runtime
                    .install(payloads.staged("marks_on_unpickle")?, Some(&metadata))
                    .map_err(|e| e.to_string())?;
                let log_text = read_text(payloads, &format!("bash-{}", std::process::id()))?;
                let _ = std::fs::remove_file(&log);
                let _ = std::fs::remove_file(&marker);
                expect_eq(
                    "log after a second install",
                    log_text.as_str(),
                    "before\nafter",
                )
            },
        },
        Case {
            name: "metadata_unknown_executor_is_refused",
            started: true,
            run: |runtime, payloads| {
                expect_refused(
                    runtime,
                    payloads,
                    serde_json::json!({"name": "marks", "executor": "dask", "deps": {"bash": {"commands": ["touch never-run"]}}}),
                    ErrorCode::EXECUTOR_UNKNOWN,
                    "ExecutorUnknown",
                    "no executor named \"dask\" in this target (known: python)",
                )?;
                expect_refused(
                    runtime,
                    payloads,
                    serde_json::json!({"name": "marks", "executor_data": {"type": "DaskExecutor", "short_name": "python"}}),
                    ErrorCode::EXECUTOR_UNKNOWN,
                    "ExecutorTypeMismatch",
                    "executor_data.type \"DaskExecutor\" does not match executor \"python\" (type \"PythonExecutor\")",
                )
            },
        },
        Case {
            name: "metadata_unknown_executor_attribute_is_refused",
            started: true,
            run: |runtime, payloads| {
                expect_refused(
                    runtime,
                    payloads,
                    serde_json::json!({"name": "marks", "executor_data": {"type": "PythonExecutor", "short_name": "python", "attributes": {"capture_output": true, "colour": "red"}}}),
                    ErrorCode::EXECUTOR_UNKNOWN,
                    "ExecutorAttributeUnknown",
                    "executor \"python\" has no attribute \"colour\" (known: capture_output)",
                )?;
                expect_refused(
                    runtime,
                    payloads,
                    serde_json::json!({"name": "marks", "executor_data": {"type": "PythonExecutor", "short_name": "python", "attributes": {"capture_output": "yes"}}}),
                    ErrorCode::METADATA_INVALID,
                    "ExecutorAttributeInvalid",
                    "executor \"python\" attribute \"capture_output\" must be a boolean, got a string",
                )
            },
        },
        Case {
            name: "metadata_capture_output_returns_stdout_and_stderr",
            started: true,
            run: |runtime, payloads| {
                let metadata = CallableMetadata::from_json(
                    r#"{"name": "chatty", "executor": "python", "executor_data": {"type": "PythonExecutor", "short_name": "python", "attributes": {"capture_output": true}}}"#,
                )
                .map_err(|e| e.to_string())?;
                let callable = runtime
                    .install(payloads.staged("chatty")?, Some(&metadata))
                    .map_err(|e| e.to_string())?;
                let result = runtime
                    .call(&callable, TaskEncoding::Json, br#"{"args": [21]}"#)
                    .map_err(|e| e.to_string())?;
                expect_eq(
                    "captured",
                    String::from_utf8_lossy(&result).as_ref(),
                    r#"{"result":42,"stdout":"to stdout 21\n","stderr":"to stderr\n"}"#,
                )
            },
        },
        Case {
            name: "metadata_embedder_executor_with_attributes",
            started: false,
            run: |_, payloads| {
                let runtime = PythonRuntime::new().with_executor(Arc::new(RepeatExecutor));
                expect_eq(
                    "executors",
                    runtime.executor_names(),
                    vec!["python".to_owned(), "repeat".to_owned()],
                )?;
                runtime.start().map_err(|e| e.to_string())?;
                let metadata = CallableMetadata::from_json(
                    r#"{"name": "square", "executor": "repeat", "executor_data": {"type": "RepeatExecutor", "short_name": "repeat", "attributes": {"times": 3}}}"#,
                )
                .map_err(|e| e.to_string())?;
                let callable = runtime
                    .install(payloads.staged("lambda_square")?, Some(&metadata))
                    .map_err(|e| e.to_string())?;
                let result = runtime
                    .call(&callable, TaskEncoding::Json, br#"{"args": [4]}"#)
                    .map_err(|e| e.to_string())?;
                expect_eq("repeated", result.as_slice(), b"[16,16,16]")
            },
        },
        Case {
            name: "metadata_call_before_result_passed_as_keyword",
            started: true,
            run: |runtime, payloads| {
                // What the target loop does around a task: run the hook,
                // merge its result under retval_keyword, run the task.
                let hook = runtime
                    .install(payloads.staged("make_config")?, None)
                    .map_err(|e| e.to_string())?;
                let task = runtime
                    .install(payloads.staged("uses_config")?, None)
                    .map_err(|e| e.to_string())?;
                let hook_result = runtime
                    .call(&hook, TaskEncoding::Json, br#"{"args": [5]}"#)
                    .map_err(|e| e.to_string())?;
                let input = merge_retval_keyword(br#"{"args": [7]}"#, "config", &hook_result)
                    .map_err(|e| e.to_string())?;
                let result = runtime
                    .call(&task, TaskEncoding::Json, &input)
                    .map_err(|e| e.to_string())?;
                expect_eq("task with the hook's config", result.as_slice(), b"35")
            },
        },
        Case {
            name: "target_runs_the_producers_python_version",
            started: true,
            run: |runtime, payloads| {
                let producer =
                    std::fs::read_to_string(payloads.directory.join("python_version.txt"))
                        .map_err(|e| e.to_string())?;
                let target = call_json(runtime, payloads, "python_version", "{}")?;
                expect_eq(
                    "the target's Python version",
                    target,
                    format!("\"{producer}\""),
                )
            },
        },
        Case {
            name: "lambda",
            started: true,
            run: |runtime, payloads| {
                let result = call_json(runtime, payloads, "lambda_square", r#"{"args": [7]}"#)?;
                expect_eq("lambda_square(7)", result.as_str(), "49")
            },
        },
        Case {
            name: "closure",
            started: true,
            run: |runtime, payloads| {
                let result = call_json(runtime, payloads, "closure_add_10", r#"{"args": [5]}"#)?;
                expect_eq("closure_add_10(5)", result.as_str(), "15")
            },
        },
        Case {
            name: "callable_object",
            started: true,
            run: |runtime, payloads| {
                let result = call_json(runtime, payloads, "callable_object", r#"{"args": [4]}"#)?;
                expect_eq("Multiplier(3)(4)", result.as_str(), "12")
            },
        },
        Case {
            name: "functools_partial_with_kwargs",
            started: true,
            run: |runtime, payloads| {
                let result = call_json(
                    runtime,
                    payloads,
                    "partial_greet",
                    r#"{"args": ["ann"], "kwargs": {"punctuation": "!"}}"#,
                )?;
                expect_eq(
                    "partial(greet, greeting='hi')('ann', punctuation='!')",
                    result.as_str(),
                    "\"hi ann!\"",
                )
            },
        },
        Case {
            name: "nested_function",
            started: true,
            run: |runtime, payloads| {
                let result = call_json(runtime, payloads, "nested_inner", r#"{"args": ["x"]}"#)?;
                expect_eq("outer()('x')", result.as_str(), r#"{"pair":["x","x"]}"#)
            },
        },
        Case {
            name: "one_mebibyte_closure",
            started: true,
            run: |runtime, payloads| {
                let payload = payloads.get("big_closure")?;
                if payload.len() < 1 << 20 {
                    return Err(format!("the payload is only {} bytes", payload.len()));
                }
                // Deserialize from a copy, then overwrite it: the callable
                // must not refer to the payload's bytes after deserialize.
                let mut staged = payload.to_vec();
                let callable = runtime.deserialize(&staged).map_err(|e| e.to_string())?;
                staged.fill(0);
                drop(staged);
                let result = runtime
                    .call(&callable, TaskEncoding::Json, b"{}")
                    .map_err(|e| e.to_string())?;
                let blob: Vec<u8> = (0..4096).flat_map(|_| 0..=255u8).collect();
                let digest: String = Sha256::digest(&blob)
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                expect_eq(
                    "checksum()",
                    String::from_utf8_lossy(&result).into_owned(),
                    format!("[1048576,\"{digest}\"]"),
                )
            },
        },
        Case {
            name: "kwargs_without_args",
            started: true,
            run: |runtime, payloads| {
                let result = call_json(
                    runtime,
                    payloads,
                    "scaled",
                    r#"{"kwargs": {"a": 4, "scale": 3, "offset": 2}}"#,
                )?;
                expect_eq("scaled(a=4, scale=3, offset=2)", result.as_str(), "14")?;
                let result = call_json(
                    runtime,
                    payloads,
                    "scaled",
                    r#"{"args": [4], "kwargs": {"offset": 1}}"#,
                )?;
                expect_eq("scaled(4, offset=1)", result.as_str(), "5")
            },
        },
        Case {
            name: "unpickling_raises",
            started: true,
            run: |runtime, payloads| {
                expect_error(
                    "deserialize raises_on_unpickle",
                    runtime.deserialize(payloads.get("raises_on_unpickle")?),
                    ErrorCode::DESERIALIZE_FAILED,
                    "ValueError",
                    "unpickle refused",
                )?;
                let result = call_json(runtime, payloads, "lambda_square", r#"{"args": [3]}"#)?;
                expect_eq(
                    "lambda_square(3) after a failed deserialize",
                    result.as_str(),
                    "9",
                )
            },
        },
        Case {
            name: "non_callable_payload",
            started: true,
            run: |runtime, payloads| {
                expect_error(
                    "deserialize non_callable_dict",
                    runtime.deserialize(payloads.get("non_callable_dict")?),
                    ErrorCode::DESERIALIZE_FAILED,
                    "TypeError",
                    "the payload unpickled to an object of type 'dict', which is not callable",
                )
            },
        },
        Case {
            name: "sys_exit_while_unpickling_keeps_the_target_alive",
            started: true,
            run: |runtime, payloads| {
                expect_error(
                    "deserialize exits_on_unpickle",
                    runtime.deserialize(payloads.get("exits_on_unpickle")?),
                    ErrorCode::DESERIALIZE_FAILED,
                    "SystemExit",
                    "3",
                )?;
                expect_error(
                    "deserialize interrupts_on_unpickle",
                    runtime.deserialize(payloads.get("interrupts_on_unpickle")?),
                    ErrorCode::DESERIALIZE_FAILED,
                    "KeyboardInterrupt",
                    "interrupted while unpickling",
                )?;
                let result = call_json(runtime, payloads, "closure_add_10", r#"{"args": [1]}"#)?;
                expect_eq("closure_add_10(1) after SystemExit", result.as_str(), "11")
            },
        },
        Case {
            name: "malformed_payloads",
            started: true,
            run: |runtime, _| {
                expect_error(
                    "deserialize of 0 bytes",
                    runtime.deserialize(b""),
                    ErrorCode::DESERIALIZE_FAILED,
                    "EOFError",
                    "Ran out of input",
                )?;
                expect_error(
                    "deserialize of garbage",
                    runtime.deserialize(b"x"),
                    ErrorCode::DESERIALIZE_FAILED,
                    "_pickle.UnpicklingError",
                    "invalid load key, 'x'.",
                )
            },
        },
        Case {
            name: "task_exception_has_type_message_and_traceback",
            started: true,
            run: |runtime, payloads| {
                let callable = runtime
                    .deserialize(payloads.get("task_raises")?)
                    .map_err(|e| e.to_string())?;
                let error = runtime
                    .call(&callable, TaskEncoding::Json, br#"{"args": [1, 0]}"#)
                    .err()
                    .ok_or("compute(1, 0) succeeded")?;
                expect_eq("code", error.code, ErrorCode::TASK_FAILED)?;
                expect_eq("kind", error.kind.as_str(), "ZeroDivisionError")?;
                let lines: Vec<&str> = error.message.lines().collect();
                expect_eq(
                    "first two lines",
                    &lines[..2.min(lines.len())],
                    &["division by zero", "Traceback (most recent call last):"],
                )?;
                let frames: Vec<&str> = lines
                    .iter()
                    .copied()
                    .filter(|l| l.starts_with("  File "))
                    .collect();
                // The frames carry the file name cloudpickle gave the code
                // (the generator's, or a fixed one in cloudpickle 3.1+),
                // never an absolute path.
                let file = read_text(payloads, "dynamic_code_filename.txt")?;
                expect_eq(
                    "frames",
                    frames.iter().map(|l| l.to_string()).collect::<Vec<_>>(),
                    vec![
                        format!("  File \"{file}\", line 67, in compute"),
                        format!("  File \"{file}\", line 64, in divide"),
                    ],
                )?;
                // The innermost frame's source line follows its `File` line
                // (Python 3.11+ may add a caret line after it) when the file
                // can be read, i.e. the code kept the generator's name.
                let divide_frame = lines
                    .iter()
                    .position(|l| l.ends_with(", in divide"))
                    .ok_or("no divide frame")?;
                let source_line = (file == "generate_payloads.py").then_some("return a / b");
                expect_eq(
                    "source line of the innermost frame",
                    lines.get(divide_frame + 1).map(|l| l.trim()),
                    source_line,
                )?;
                // The target keeps running tasks.
                let result = runtime
                    .call(&callable, TaskEncoding::Json, br#"{"args": [6, 3]}"#)
                    .map_err(|e| e.to_string())?;
                expect_eq("compute(6, 3)", result.as_slice(), b"3.0")
            },
        },
        Case {
            name: "task_calling_sys_exit_is_a_task_error",
            started: true,
            run: |runtime, payloads| {
                let callable = runtime
                    .deserialize(payloads.get("task_exits")?)
                    .map_err(|e| e.to_string())?;
                let error = runtime
                    .call(&callable, TaskEncoding::Json, br#"{"args": [5]}"#)
                    .err()
                    .ok_or("exits(5) succeeded")?;
                expect_eq(
                    "code and kind",
                    (error.code, error.kind.as_str()),
                    (ErrorCode::TASK_FAILED, "SystemExit"),
                )?;
                expect_eq(
                    "message's first line",
                    error.message.lines().next(),
                    Some("5"),
                )?;
                let result = call_json(runtime, payloads, "lambda_square", r#"{"args": [2]}"#)?;
                expect_eq("lambda_square(2) after SystemExit", result.as_str(), "4")
            },
        },
        Case {
            name: "result_not_json_serializable",
            started: true,
            run: |runtime, payloads| {
                let set = runtime
                    .deserialize(payloads.get("returns_set")?)
                    .map_err(|e| e.to_string())?;
                expect_error(
                    "returns_set()",
                    runtime.call(&set, TaskEncoding::Json, b"{}"),
                    ErrorCode::TASK_FAILED,
                    "TypeError",
                    "the task's result of type 'set' is not JSON-serializable: \
                     Object of type set is not JSON serializable",
                )?;
                let nan = runtime
                    .deserialize(payloads.get("returns_nan")?)
                    .map_err(|e| e.to_string())?;
                let error = runtime
                    .call(&nan, TaskEncoding::Json, b"{}")
                    .err()
                    .ok_or("returns_nan() gave JSON")?;
                expect_eq(
                    "NaN code and kind",
                    (error.code, error.kind.as_str()),
                    (ErrorCode::TASK_FAILED, "ValueError"),
                )?;
                let prefix = "the task's result of type 'float' is not JSON-serializable: \
                              Out of range float values are not JSON compliant";
                if !error.message.starts_with(prefix) {
                    return Err(format!("NaN message: {:?}", error.message));
                }
                Ok(())
            },
        },
        Case {
            name: "invalid_json_task_input",
            started: true,
            run: |runtime, payloads| {
                let callable = runtime
                    .deserialize(payloads.get("identity")?)
                    .map_err(|e| e.to_string())?;
                let kind = "TaskInputInvalid";
                expect_error(
                    "args not an array",
                    runtime.call(&callable, TaskEncoding::Json, br#"{"args": 1}"#),
                    ErrorCode::TASK_FAILED,
                    kind,
                    "the task input's \"args\" must be a JSON array, got int",
                )?;
                expect_error(
                    "kwargs not an object",
                    runtime.call(&callable, TaskEncoding::Json, br#"{"kwargs": []}"#),
                    ErrorCode::TASK_FAILED,
                    kind,
                    "the task input's \"kwargs\" must be a JSON object, got list",
                )?;
                expect_error(
                    "unknown key",
                    runtime.call(&callable, TaskEncoding::Json, br#"{"arg": [1]}"#),
                    ErrorCode::TASK_FAILED,
                    kind,
                    "the task input has an unknown key \"arg\" (expected \"args\" and \"kwargs\")",
                )?;
                expect_error(
                    "not an object",
                    runtime.call(&callable, TaskEncoding::Json, b"[1]"),
                    ErrorCode::TASK_FAILED,
                    kind,
                    "the task input must be a JSON object {\"args\": [...], \"kwargs\": {...}}, got list",
                )?;
                expect_error(
                    "not JSON",
                    runtime.call(&callable, TaskEncoding::Json, b"{args"),
                    ErrorCode::TASK_FAILED,
                    kind,
                    "the task input is not JSON: Expecting property name enclosed in double quotes: \
                     line 1 column 2 (char 1)",
                )?;
                expect_error(
                    "not UTF-8",
                    runtime.call(&callable, TaskEncoding::Json, b"\xff"),
                    ErrorCode::TASK_FAILED,
                    kind,
                    "the task input is not UTF-8: invalid utf-8 sequence of 1 bytes from index 0",
                )?;
                let result = runtime
                    .call(
                        &callable,
                        TaskEncoding::Json,
                        br#"{"args": [{"k": [1, 2.5, null, true, "\u00e9"]}]}"#,
                    )
                    .map_err(|e| e.to_string())?;
                expect_eq(
                    "identity round trip",
                    String::from_utf8_lossy(&result).as_ref(),
                    r#"{"k":[1,2.5,null,true,"\u00e9"]}"#,
                )
            },
        },
        Case {
            name: "json_input_decodes_as_json_loads",
            started: true,
            run: |runtime, payloads| {
                let callable = runtime
                    .deserialize(payloads.get("identity")?)
                    .map_err(|e| e.to_string())?;
                // JSON whitespace around the document, non-ASCII text
                // inside it (characters, not bytes, count its end).
                let result = runtime
                    .call(
                        &callable,
                        TaskEncoding::Json,
                        " \n\t{\"args\": [\"é€\"], \"kwargs\": {}}\t \r\n".as_bytes(),
                    )
                    .map_err(|e| e.to_string())?;
                expect_eq(
                    "identity of a non-ASCII string amid whitespace",
                    String::from_utf8_lossy(&result).as_ref(),
                    r#""\u00e9\u20ac""#,
                )?;
                let kind = "TaskInputInvalid";
                for (name, input, message) in [
                    (
                        "data after the document",
                        r#"{"args": ["é"]} x"#,
                        "the task input is not JSON: Extra data: line 1 column 17 (char 16)",
                    ),
                    (
                        "a byte order mark",
                        "\u{feff}{}",
                        "the task input is not JSON: Unexpected UTF-8 BOM (decode using utf-8-sig): \
                         line 1 column 1 (char 0)",
                    ),
                    (
                        "whitespace only",
                        "  ",
                        "the task input is not JSON: Expecting value: line 1 column 3 (char 2)",
                    ),
                ] {
                    expect_error(
                        name,
                        runtime.call(&callable, TaskEncoding::Json, input.as_bytes()),
                        ErrorCode::TASK_FAILED,
                        kind,
                        message,
                    )?;
                }
                Ok(())
            },
        },
        Case {
            name: "pickle_inputs_small_and_large",
            started: true,
            run: |runtime, payloads| {
                let callable = runtime
                    .deserialize(payloads.get("length")?)
                    .map_err(|e| e.to_string())?;
                // 100 characters: copied into one bytes object; 10000:
                // unpickled through a memoryview over the input.
                for n in ["100", "10000"] {
                    let result = runtime
                        .call(
                            &callable,
                            TaskEncoding::Pickle,
                            payloads.get(&format!("pickle_input_len_{n}"))?,
                        )
                        .map_err(|e| e.to_string())?;
                    expect_eq(
                        &format!("len of {n} characters"),
                        result.as_slice(),
                        payloads.get(&format!("pickle_expected_{n}"))?,
                    )?;
                }
                Ok(())
            },
        },
        Case {
            name: "pickle_plain_results",
            started: true,
            run: |runtime, payloads| {
                let identity = runtime
                    .deserialize(payloads.get("identity")?)
                    .map_err(|e| e.to_string())?;
                for k in 0..15 {
                    let result = runtime
                        .call(
                            &identity,
                            TaskEncoding::Pickle,
                            payloads.get(&format!("plain_input_{k}"))?,
                        )
                        .map_err(|e| e.to_string())?;
                    expect_eq(
                        &format!("plain result {k}"),
                        result.as_slice(),
                        payloads.get(&format!("plain_expected_{k}"))?,
                    )?;
                }
                Ok(())
            },
        },
        Case {
            name: "pickle_mode_call",
            started: true,
            run: |runtime, payloads| {
                let callable = runtime
                    .deserialize(payloads.get("power")?)
                    .map_err(|e| e.to_string())?;
                let result = runtime
                    .call(
                        &callable,
                        TaskEncoding::Pickle,
                        payloads.get("pickle_input")?,
                    )
                    .map_err(|e| e.to_string())?;
                expect_eq(
                    "pickled power(2, b=5)",
                    result.as_slice(),
                    payloads.get("pickle_expected")?,
                )?;
                expect_error(
                    "pickled input not a pair",
                    runtime.call(&callable, TaskEncoding::Pickle, payloads.get("pickle_input_not_pair")?),
                    ErrorCode::TASK_FAILED,
                    "TaskInputInvalid",
                    "the pickled task input must be a pair (args: tuple or list, kwargs: dict) or a chunk ([args, ...],), got list",
                )?;
                expect_error(
                    "pickled input truncated",
                    runtime.call(&callable, TaskEncoding::Pickle, b""),
                    ErrorCode::TASK_FAILED,
                    "TaskInputInvalid",
                    "the pickled task input could not be unpickled: EOFError: Ran out of input",
                )?;
                let lambda = runtime
                    .deserialize(payloads.get("returns_lambda")?)
                    .map_err(|e| e.to_string())?;
                // Results are pickled with cloudpickle: a lambda is a
                // result, and it comes back as a callable.
                let output = runtime
                    .call(
                        &lambda,
                        TaskEncoding::Pickle,
                        payloads.get("pickle_input_empty")?,
                    )
                    .map_err(|e| format!("a lambda result was refused: {e}"))?;
                let returned = runtime
                    .deserialize(&output)
                    .map_err(|e| format!("the lambda result did not unpickle: {e}"))?;
                expect_eq(
                    "the returned lambda's result",
                    runtime
                        .call(&returned, TaskEncoding::Json, b"{}")
                        .map_err(|e| e.to_string())?,
                    b"0".to_vec(),
                )?;
                Ok(())
            },
        },
        Case {
            name: "control_progresses_during_a_long_python_task",
            started: true,
            run: |runtime, payloads| {
                let release = payloads
                    .directory
                    .join(format!("release-{}", std::process::id()));
                let spin = runtime
                    .deserialize(payloads.get("spin_until")?)
                    .map_err(|e| e.to_string())?;
                let input = serde_json::json!({"args": [release.to_string_lossy()]}).to_string();
                let finished = Arc::new(AtomicBool::new(false));
                let outcome = std::thread::scope(|scope| {
                    let task = scope.spawn(|| {
                        let result = runtime.call(&spin, TaskEncoding::Json, input.as_bytes());
                        finished.store(true, Ordering::SeqCst);
                        result
                    });
                    // The task spins (holding the GIL between switch
                    // intervals) until the release file exists, which only
                    // this thread creates after its control work: a control
                    // that could not take the GIL would hang until the
                    // watchdog fires.
                    let control = (|| -> CaseResult {
                        let callable = runtime
                            .deserialize(payloads.get("closure_add_10")?)
                            .map_err(|e| e.to_string())?;
                        let result = runtime
                            .call(&callable, TaskEncoding::Json, br#"{"args": [32]}"#)
                            .map_err(|e| e.to_string())?;
                        // Dropped without the GIL while the task holds it.
                        drop(callable);
                        expect_eq("control result", result.as_slice(), b"42")?;
                        expect_eq(
                            "task still running during the control",
                            finished.load(Ordering::SeqCst),
                            false,
                        )
                    })();
                    let created = File::create(&release).map_err(|e| e.to_string());
                    let task = task
                        .join()
                        .map_err(|_| "the task thread panicked".to_owned());
                    control?;
                    created?;
                    let result = task?.map_err(|e| e.to_string())?;
                    expect_eq("task result", result.as_slice(), b"\"released\"")
                });
                let _ = std::fs::remove_file(&release);
                outcome
            },
        },
        Case {
            name: "callable_dropped_on_another_thread",
            started: true,
            run: |runtime, payloads| {
                let callable = runtime
                    .deserialize(payloads.get("finalized")?)
                    .map_err(|e| e.to_string())?;
                let result = runtime
                    .call(&callable, TaskEncoding::Json, b"{}")
                    .map_err(|e| e.to_string())?;
                expect_eq("finalized()", result.as_slice(), b"\"alive\"")?;
                let marker = payloads
                    .directory
                    .join(format!("finalized-{}", std::process::id()));
                // Dropped on a thread that never attached: the release is
                // deferred to the next attach, which runs `__del__`.
                std::thread::spawn(move || drop(callable))
                    .join()
                    .map_err(|_| "dropping panicked".to_owned())?;
                let result = call_json(runtime, payloads, "callable_object", r#"{"args": [5]}"#)?;
                expect_eq(
                    "Multiplier(3)(5) after a drop elsewhere",
                    result.as_str(),
                    "15",
                )?;
                let finalized = marker.exists();
                let _ = std::fs::remove_file(&marker);
                expect_eq("the dropped callable was finalized", finalized, true)
            },
        },
        Case {
            name: "short_lived_threads_release_their_python_thread_state",
            started: true,
            run: |runtime, payloads| {
                // Each thread keeps a Python thread state while it lives and
                // deletes it at exit (taking the GIL to do so); none of that
                // may deadlock or disturb later calls.
                let count = runtime
                    .deserialize(payloads.get("thread_state_count")?)
                    .map_err(|e| e.to_string())?;
                let count_now = || -> Result<String, String> {
                    runtime
                        .call(&count, TaskEncoding::Json, b"{}")
                        .map(|json| String::from_utf8_lossy(&json).into_owned())
                        .map_err(|e| e.to_string())
                };
                let before = count_now()?;
                expect_eq("thread states before", before.as_str(), "1")?;
                for round in 0..50 {
                    let during = std::thread::scope(|scope| scope.spawn(count_now).join())
                        .map_err(|_| format!("thread {round} panicked"))??;
                    expect_eq(
                        "thread states seen from a second thread",
                        during.as_str(),
                        "2",
                    )?;
                }
                expect_eq(
                    "thread states after 50 threads exited",
                    count_now()?,
                    before,
                )?;
                let result = call_json(runtime, payloads, "lambda_square", r#"{"args": [9]}"#)?;
                expect_eq("lambda_square(9) on the main thread", result.as_str(), "81")
            },
        },
        Case {
            name: "examples_from_the_pack_command",
            started: true,
            run: |runtime, payloads| {
                let example = |name: &str| -> Result<&[u8], String> {
                    envelope_payload(payloads.get(&format!("examples/{name}"))?)
                };
                for (name, input, expected) in [
                    ("add", r#"{"args": [2, 3]}"#, "5"),
                    ("square", r#"{"args": [7]}"#, "49"),
                    ("scale_by_3", r#"{"args": [5]}"#, "15"),
                    ("multiplier", r#"{"args": [4]}"#, "40"),
                    ("power_of_2", r#"{"args": [9]}"#, "81"),
                    ("divide", r#"{"args": [1, 4]}"#, "0.25"),
                    ("sleep_for", r#"{"args": [0.01]}"#, "0.01"),
                    ("busy_for", r#"{"args": [0.01]}"#, "0.01"),
                ] {
                    let callable = runtime
                        .deserialize(example(name)?)
                        .map_err(|e| format!("{name}: {e}"))?;
                    let result = runtime
                        .call(&callable, TaskEncoding::Json, input.as_bytes())
                        .map_err(|e| format!("{name}: {e}"))?;
                    expect_eq(name, String::from_utf8_lossy(&result).as_ref(), expected)?;
                }
                let divide = runtime
                    .deserialize(example("divide")?)
                    .map_err(|e| e.to_string())?;
                let error = runtime
                    .call(&divide, TaskEncoding::Json, br#"{"args": [1, 0]}"#)
                    .err()
                    .ok_or("divide(1, 0) succeeded")?;
                expect_eq(
                    "divide(1, 0)",
                    (error.code, error.kind.as_str()),
                    (ErrorCode::TASK_FAILED, "ZeroDivisionError"),
                )?;
                expect_error(
                    "fails_to_unpickle",
                    runtime.deserialize(example("fails_to_unpickle")?),
                    ErrorCode::DESERIALIZE_FAILED,
                    "RuntimeError",
                    "this payload refuses to be unpickled",
                )?;
                expect_error(
                    "settings",
                    runtime.deserialize(example("settings")?),
                    ErrorCode::DESERIALIZE_FAILED,
                    "TypeError",
                    "the payload unpickled to an object of type 'dict', which is not callable",
                )
            },
        },
        Case {
            name: "start_twice_is_refused",
            started: true,
            run: |runtime, _| {
                expect_error(
                    "second start",
                    runtime.start(),
                    ErrorCode::LIFECYCLE_INVALID,
                    "InterpreterAlreadyInitialized",
                    "the Python interpreter is already initialised in this process; \
                     it must start only once, in a forked target",
                )?;
                expect_error(
                    "start of another runtime in the same process",
                    PythonRuntime::new().start(),
                    ErrorCode::LIFECYCLE_INVALID,
                    "InterpreterAlreadyInitialized",
                    "the Python interpreter is already initialised in this process; \
                     it must start only once, in a forked target",
                )
            },
        },
        Case {
            name: "use_before_start_is_an_error",
            started: false,
            run: |runtime, payloads| {
                expect_error(
                    "deserialize before start",
                    runtime.deserialize(payloads.get("lambda_square")?),
                    ErrorCode::LIFECYCLE_INVALID,
                    "RuntimeNotStarted",
                    "the Python runtime was used before it started in this target",
                )?;
                // SAFETY: only reads a flag.
                expect_eq(
                    "Python initialised",
                    unsafe { pyo3::ffi::Py_IsInitialized() },
                    0,
                )
            },
        },
        Case {
            name: "sigint_is_ignored_in_a_started_target",
            started: true,
            run: |runtime, payloads| {
                // Importing `signal` must not install Python's SIGINT handler
                // over the ignored disposition.
                let ignored = call_json(runtime, payloads, "sigint_ignored", "{}")?;
                expect_eq(
                    "SIGINT ignored, as Python sees it",
                    ignored.as_str(),
                    "true",
                )?;
                nix::sys::signal::raise(nix::sys::signal::Signal::SIGINT)
                    .map_err(|e| e.to_string())?;
                let result = call_json(runtime, payloads, "lambda_square", r#"{"args": [6]}"#)?;
                expect_eq("lambda_square(6) after SIGINT", result.as_str(), "36")
            },
        },
    ]
}
