//! The rule that the parent never deserializes, proven: the parent reads nothing but JSON and
//! digests. A whole plan — pre- and post-start registrations with metadata
//! and hooks, tasks, failing registers — runs over real forked Python
//! targets while every deserialization entry point of the runtime
//! (`start`, `deserialize`, `install`, `call`) aborts the process if it runs
//! in the parent ([`Guarded`]); and the Python interpreter is asserted never
//! initialised in the parent. What the parent holds at the end (the
//! registry snapshot, the failed registers' per-target outcomes, the errors)
//! is checked to be exactly the JSON forms of `specs/metadata.md` over the
//! digests computed from the envelopes' bytes.
//!
//! A `harness = false` binary run by the runner of `tests/io_common/mod.rs`
//! (each test on the main thread; `cargo nextest` runs each in its own
//! process; no staged payload or child may be left). Payloads: see
//! `tests/python_common/mod.rs`.
//!
//! Run: `PYO3_PYTHON=$(python3 -c 'import sys; print(sys.executable)')
//! cargo test --features python --test no_parent_deserialize`.

mod io_common;
mod python_common;

use std::os::unix::process::ExitStatusExt;
use std::sync::Arc;
use std::time::Duration;

use callreg::error::ErrorCode;
use callreg::io::Worker;
use callreg::metadata::{CallableMetadata, DEFAULT_EXECUTOR};
use callreg::protocol::{RegistrySnapshot, TargetId, TargetOutcomeEntry};
use callreg::runtime::python::{PythonCallable, PythonRuntime};
use callreg::runtime::{Runtime, RuntimeError, Staged, TaskEncoding};
use python_common::{envelope, hashid, hook, input, metadata};
use serde_json::{json, Value};

const TARGETS: u16 = 3;

/// Set in a child of this binary to check that the guard aborts.
const SELF_TEST_VAR: &str = "CALLREG_GUARD_SELF_TEST";

/// A [`PythonRuntime`] whose every entry point aborts the process when it
/// runs in the process that built it (the parent): targets are forked
/// children with another pid, so only a parent-side call can trip it.
struct Guarded {
    inner: PythonRuntime,
    parent: u32,
}

impl Guarded {
    fn new() -> Guarded {
        Guarded {
            inner: PythonRuntime::new(),
            parent: std::process::id(),
        }
    }

    fn guard(&self, entry: &str) {
        if std::process::id() == self.parent {
            eprintln!("Runtime::{entry} ran in the parent process");
            std::process::abort();
        }
    }
}

impl Runtime for Guarded {
    type Callable = PythonCallable;

    fn start(&self) -> Result<(), RuntimeError> {
        self.guard("start");
        self.inner.start()
    }

    fn deserialize(&self, payload: &[u8]) -> Result<PythonCallable, RuntimeError> {
        self.guard("deserialize");
        self.inner.deserialize(payload)
    }

    fn deserialize_staged(&self, staged: Staged<'_>) -> Result<PythonCallable, RuntimeError> {
        self.guard("deserialize_staged");
        self.inner.deserialize_staged(staged)
    }

    fn install(
        &self,
        staged: Staged<'_>,
        metadata: Option<&CallableMetadata>,
    ) -> Result<PythonCallable, RuntimeError> {
        self.guard("install");
        self.inner.install(staged, metadata)
    }

    fn call(
        &self,
        callable: &PythonCallable,
        encoding: TaskEncoding,
        input: &[u8],
    ) -> Result<Vec<u8>, RuntimeError> {
        self.guard("call");
        self.inner.call(callable, encoding, input)
    }
}

fn main() {
    if std::env::var_os(SELF_TEST_VAR).is_some() {
        // The child of `the_guard_aborts_in_the_parent`: must not return.
        let _ = Guarded::new().deserialize(b"");
        std::process::exit(0);
    }
    io_common::run(&[
        (
            "the_guard_aborts_in_the_parent",
            the_guard_aborts_in_the_parent,
        ),
        (
            "a_whole_plan_never_deserializes_in_the_parent",
            a_whole_plan_never_deserializes_in_the_parent,
        ),
    ]);
}

/// The guard is live: an entry point called in its own process aborts it.
fn the_guard_aborts_in_the_parent() {
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .env(SELF_TEST_VAR, "1")
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("the test binary runs");
    assert_eq!(status.status.signal(), Some(libc::SIGABRT), "{status:?}");
    assert_eq!(
        String::from_utf8_lossy(&status.stderr),
        "Runtime::deserialize ran in the parent process\n"
    );
}

fn assert_no_python_in_parent(when: &str) {
    assert!(
        !PythonRuntime::interpreter_initialized(),
        "the parent initialised Python ({when})"
    );
}

fn json_results(
    worker: &Worker<Guarded>,
    name: &str,
    handle: &callreg::protocol::Handle,
    args: Value,
) -> Vec<Value> {
    worker
        .submit_to_every(handle, TaskEncoding::Json, &input(args, json!({})))
        .into_iter()
        .map(|(target, result)| {
            let bytes = result.unwrap_or_else(|e| panic!("{name} on {target}: {e}"));
            serde_json::from_slice(&bytes).expect("a JSON result")
        })
        .collect()
}

fn a_whole_plan_never_deserializes_in_the_parent() {
    assert_no_python_in_parent("before the plan");
    // Probe-first off: every target reports each failing register.
    let worker = Worker::builder(Arc::new(Guarded::new()))
        .targets(TARGETS)
        .probe_first(false)
        .control_timeout(Duration::from_secs(20))
        .build()
        .expect("a Worker");

    // Pre-start registrations with metadata and hooks (startup snapshot).
    let load_config = worker.register(envelope("load_config")).unwrap();
    let mut scaled_meta = CallableMetadata::named("scaled");
    scaled_meta.call_before = vec![hook("load_config", json!([]), json!({}), Some("config"))];
    let scaled = worker
        .register_with_metadata(envelope("scaled"), Some(&scaled_meta))
        .unwrap();
    let greet_meta = metadata(json!({"name": "greet", "executor": DEFAULT_EXECUTOR,
        "executor_data": {"type": "PythonExecutor", "short_name": "python",
                          "attributes": {"capture_output": true}}}));
    let greet = worker
        .register_with_metadata(envelope("greet"), Some(&greet_meta))
        .unwrap();
    assert_no_python_in_parent("after pre-start registers");

    worker.start().expect("every target installs the snapshot");
    assert_no_python_in_parent("after start");

    // Tasks, through hooks and an executor attribute.
    let targets = usize::from(TARGETS);
    assert_eq!(
        json_results(&worker, "scaled", &scaled, json!([5])),
        vec![json!(15); targets]
    );
    assert_eq!(
        json_results(&worker, "greet", &greet, json!(["x"])),
        vec![json!({"result": "hello x", "stdout": "greeting x\n", "stderr": ""}); targets]
    );

    // Post-start registrations with metadata and hooks.
    let append_line = worker.register(envelope("append_line")).unwrap();
    let path = std::env::temp_dir().join(format!("callreg-nopd-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let mut add_meta = CallableMetadata::named("add");
    add_meta.call_after = vec![hook(
        "append_line",
        json!([path.to_str().unwrap(), "after add"]),
        json!({}),
        None,
    )];
    add_meta.call_before = vec![hook("load_config", json!([]), json!({}), None)];
    let add = worker
        .register_with_metadata(envelope("add"), Some(&add_meta))
        .unwrap();
    assert_eq!(
        json_results(&worker, "add", &add, json!([40, 2])),
        vec![json!(42); targets]
    );
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "after add\n".repeat(targets)
    );
    let _ = std::fs::remove_file(&path);

    // Failing registers: a check refused before deserializing, and a
    // payload whose unpickling raises. Their outcomes are JSON forms only.
    let missing = metadata(json!({"name": "busy_for",
        "deps": {"pip": {"packages": ["callreg-no-such-distribution>=1.0"]}}}));
    let refused = worker
        .register_with_metadata(envelope("busy_for"), Some(&missing))
        .unwrap_err();
    assert_eq!(refused.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
    let failure = json!({"code": "DEPS_UNSATISFIED",
        "message": "PipRequirementUnsatisfied: deps.pip is not satisfied: callreg-no-such-distribution>=1.0 (not installed)"});
    let outcomes: Vec<Value> = TargetOutcomeEntry::list(&refused.outcomes)
        .iter()
        .map(|entry| {
            let text = entry.to_json();
            assert_eq!(&TargetOutcomeEntry::from_json(&text).unwrap(), entry);
            serde_json::from_str(&text).unwrap()
        })
        .collect();
    assert_eq!(
        outcomes,
        (0..TARGETS)
            .map(|t| json!({"target": t, "outcome": "failed", "failure": failure}))
            .collect::<Vec<_>>()
    );
    let broken = worker.register(envelope("fails_to_unpickle")).unwrap_err();
    assert_eq!(broken.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
    for (target, outcome) in &broken.outcomes {
        let callreg::protocol::TargetOutcome::Failed { failure } = outcome else {
            panic!("{target}: {outcome:?}");
        };
        assert_eq!(failure.code, ErrorCode::DESERIALIZE_FAILED, "{target}");
    }
    // A hook that is not live: refused by the parent, before any broadcast.
    let mut dangling = CallableMetadata::named("square");
    dangling.call_before = vec![hook("refusing_hook", json!([]), json!({}), None)];
    let not_live = worker
        .register_with_metadata(envelope("square"), Some(&dangling))
        .unwrap_err();
    assert_eq!(not_live.code(), ErrorCode::METADATA_INVALID);
    assert!(not_live.outcomes.is_empty());
    worker.unregister(&append_line).unwrap();
    assert_no_python_in_parent("after post-start operations");

    // What the parent holds: the registry snapshot is its JSON form over
    // the digests computed from the envelope bytes, and nothing else.
    let snapshot = worker.parent_state().registry_snapshot();
    let text = snapshot.to_json();
    assert_eq!(RegistrySnapshot::from_json(&text).unwrap(), snapshot);
    let held: Value = serde_json::from_str(&text).unwrap();
    let handle = |h: &callreg::protocol::Handle, name: &str| {
        assert_eq!(h.hashid.to_string(), hashid(name));
        json!({"namespace": "LOCAL_PYTHON", "hashid": hashid(name),
               "handle_id": h.handle_id, "owner": h.owner})
    };
    let mut digests = vec![
        json!({"hashid": hashid("add"), "live_handles": 1}),
        json!({"hashid": hashid("greet"), "live_handles": 1}),
        json!({"hashid": hashid("load_config"), "live_handles": 1}),
        json!({"hashid": hashid("scaled"), "live_handles": 1}),
    ];
    digests.sort_by_key(|d| d["hashid"].as_str().unwrap().to_owned());
    assert_eq!(
        held,
        json!({
            "lifecycle": "started",
            "live_targets": [0, 1, 2],
            "handles": [
                handle(&load_config, "load_config"),
                handle(&scaled, "scaled"),
                handle(&greet, "greet"),
                handle(&add, "add"),
            ],
            "digests": digests,
            "uncertain": [],
        })
    );
    for target in 0..TARGETS {
        assert!(worker.target_pid(TargetId(target)).is_some());
    }
    worker.close();
    assert_no_python_in_parent("after close");
}
