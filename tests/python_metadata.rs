//! Callable metadata through the Worker with Python targets over real
//! forked processes, sealed memfds and pipes: every check a target
//! makes before deserializing, the executor attribute `capture_output`,
//! hooks (`retval_keyword`, `call_after`, failures) and the parent's
//! refusal of a hook that is not live.
//!
//! A `harness = false` binary run by the runner of `tests/io_common/mod.rs`:
//! each test runs on the main thread (forking is safe under plain `cargo
//! test`), `cargo nextest` runs each test in its own process, and after
//! every test the runner checks that no staged payload (a
//! sealed memfd open or mapped in this process) and no child process is left. Every test also checks
//! that the parent never initialised Python. Payloads: see
//! `tests/python_common/mod.rs`.
//!
//! Run: `PYO3_PYTHON=$(python3 -c 'import sys; print(sys.executable)')
//! cargo test --features python --test python_metadata [-- FILTER]`.

mod io_common;
mod python_common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use callreg::error::ErrorCode;
use callreg::io::{OperationError, Worker};
use callreg::metadata::CallableMetadata;
use callreg::protocol::{Failure, TargetId, TargetOutcome};
use callreg::runtime::python::PythonRuntime;
use callreg::runtime::TaskEncoding;
use python_common::{envelope, hashid, hook, input, metadata};
use serde_json::{json, Value};

const TARGETS: u16 = 3;

fn main() {
    io_common::run(&[
        (
            "a_version_mismatch_is_refused_before_unpickling",
            a_version_mismatch_is_refused_before_unpickling,
        ),
        (
            "a_version_mismatch_in_the_startup_snapshot_fails_its_registration",
            a_version_mismatch_in_the_startup_snapshot_fails_its_registration,
        ),
        ("a_missing_pip_dependency", a_missing_pip_dependency),
        ("a_failing_bash_dependency", a_failing_bash_dependency),
        ("an_unknown_executor", an_unknown_executor),
        (
            "capture_output_returns_the_calls_output",
            capture_output_returns_the_calls_output,
        ),
        (
            "a_call_before_result_becomes_a_keyword_argument",
            a_call_before_result_becomes_a_keyword_argument,
        ),
        (
            "call_after_runs_after_each_successful_task",
            call_after_runs_after_each_successful_task,
        ),
        (
            "a_hook_failure_is_reported_with_the_task",
            a_hook_failure_is_reported_with_the_task,
        ),
        (
            "retval_keyword_is_refused_for_a_pickled_task",
            retval_keyword_is_refused_for_a_pickled_task,
        ),
        (
            "a_hook_that_is_not_live_is_refused_before_broadcast",
            a_hook_that_is_not_live_is_refused_before_broadcast,
        ),
        (
            "metadata_is_not_part_of_the_hashid",
            metadata_is_not_part_of_the_hashid,
        ),
    ]);
}

/// Every register goes to every target at once (probe-first off): these
/// tests check each target's own refusal.
fn worker() -> Worker<PythonRuntime> {
    Worker::builder(Arc::new(PythonRuntime::new()))
        .targets(TARGETS)
        .probe_first(false)
        .control_timeout(Duration::from_secs(20))
        .build()
        .expect("a Worker")
}

fn started() -> Worker<PythonRuntime> {
    let worker = worker();
    worker.start().expect("start");
    worker
}

/// The targets' interpreter version (`platform.python_version()`), asked of
/// a separate interpreter process: the parent never runs Python.
fn target_python_version() -> String {
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let output = Command::new(python)
        .args(["-c", "import platform; print(platform.python_version())"])
        .output()
        .expect("python runs");
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

/// A path in the temporary directory for this test process, removed first.
fn scratch(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("callreg-meta-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path
}

/// Every target failed with exactly `failure`; the parent never ran Python.
fn assert_every_target_failed(error: &OperationError, failure: &Failure) {
    assert_eq!(error.code(), ErrorCode::REGISTER_PARTIAL_FAILURE, "{error}");
    assert_eq!(error.outcomes.len(), usize::from(TARGETS));
    for (target, outcome) in &error.outcomes {
        assert_eq!(
            *outcome,
            TargetOutcome::Failed {
                failure: failure.clone()
            },
            "{target}"
        );
    }
    assert!(!PythonRuntime::interpreter_initialized());
}

/// No target holds anything but `expected` (digest, refcount) entries.
fn assert_tables(worker: &Worker<PythonRuntime>, expected: &[(&str, u32)]) {
    let expected: Vec<_> = expected
        .iter()
        .map(|(name, count)| {
            let hashid: callreg::descriptor::HashId = hashid(name).parse().unwrap();
            (hashid.0, *count)
        })
        .collect();
    let mut expected = expected;
    expected.sort();
    for (target, table) in worker.inspect().expect("inspect") {
        let table = table.unwrap_or_else(|| panic!("{target} did not report its table"));
        assert_eq!(table.installed, expected, "{target}");
    }
}

fn json_everywhere(
    worker: &Worker<PythonRuntime>,
    handle: &callreg::protocol::Handle,
    args: Value,
    kwargs: Value,
) -> Vec<Value> {
    worker
        .submit_to_every(handle, TaskEncoding::Json, &input(args, kwargs))
        .into_iter()
        .map(|(target, result)| {
            let bytes = result.unwrap_or_else(|e| panic!("{target}: {e}"));
            serde_json::from_slice(&bytes).expect("a JSON result")
        })
        .collect()
}

fn a_version_mismatch_is_refused_before_unpickling() {
    let marker = scratch("version-marker");
    // Inherited by the targets at fork.
    std::env::set_var("CALLREG_TEST_MARKER", &marker);
    let worker = started();
    let wanted = metadata(json!({"name": "marker",
        "python": {"version": "2.7.18", "serializer": "cloudpickle", "serializer_version": "1.6.0"}}));
    let error = worker
        .register_with_metadata(envelope("writes_marker_when_unpickled"), Some(&wanted))
        .unwrap_err();
    assert_every_target_failed(
        &error,
        &Failure::new(
            ErrorCode::PYTHON_VERSION_MISMATCH,
            format!(
                "PythonVersionMismatch: the payload was serialized by Python 2.7.18 but this target runs Python {} (major.minor must match); serialize with the interpreter the targets run (for the callreg command, the PYO3_PYTHON it was built with)",
                target_python_version()
            ),
        ),
    );
    assert!(!marker.exists(), "the payload was unpickled");
    assert_tables(&worker, &[]);
    // The same payload without the mismatch installs (and is unpickled).
    worker
        .register(envelope("writes_marker_when_unpickled"))
        .unwrap();
    assert!(marker.exists());
    let _ = std::fs::remove_file(&marker);
}

/// A startup-snapshot entry every target refuses (its version check)
/// fails that registration only: the Worker starts on every target, the
/// report names the handle and each target's reason, nothing is installed.
fn a_version_mismatch_in_the_startup_snapshot_fails_its_registration() {
    let worker = worker();
    let wanted = metadata(json!({"name": "add",
        "python": {"version": "2.7.18", "serializer": "cloudpickle", "serializer_version": "1.6.0"}}));
    let handle = worker
        .register_with_metadata(envelope("add"), Some(&wanted))
        .unwrap();
    let report = worker.start().unwrap();
    assert_eq!(report.outcomes.len(), usize::from(TARGETS));
    assert!(report
        .outcomes
        .iter()
        .all(|(_, outcome)| *outcome == TargetOutcome::Ok));
    assert_eq!(report.failed.len(), 1);
    assert_eq!(report.failed[0].handle, handle);
    assert_eq!(report.failed[0].failures.len(), usize::from(TARGETS));
    for (target, failure) in &report.failed[0].failures {
        assert_eq!(failure.code, ErrorCode::PYTHON_VERSION_MISMATCH, "{target}");
        assert_eq!(
            failure.message,
            format!(
                "PythonVersionMismatch: the payload was serialized by Python 2.7.18 but this target runs Python {} (major.minor must match); serialize with the interpreter the targets run (for the callreg command, the PYO3_PYTHON it was built with)",
                target_python_version()
            ),
            "{target}"
        );
    }
    assert_eq!(worker.live_targets().len(), usize::from(TARGETS));
    assert_tables(&worker, &[]);
    assert!(!PythonRuntime::interpreter_initialized());
}

fn a_missing_pip_dependency() {
    let worker = started();
    let wanted = metadata(json!({"name": "add",
        "deps": {"pip": {"packages": ["callreg-no-such-distribution>=1.0", "cloudpickle>=1"]}}}));
    let error = worker
        .register_with_metadata(envelope("add"), Some(&wanted))
        .unwrap_err();
    assert_every_target_failed(
        &error,
        &Failure::new(
            ErrorCode::DEPS_UNSATISFIED,
            "PipRequirementUnsatisfied: deps.pip is not satisfied: callreg-no-such-distribution>=1.0 (not installed)",
        ),
    );
    assert_tables(&worker, &[]);
}

fn a_failing_bash_dependency() {
    let worker = started();
    let wanted = metadata(json!({"name": "add",
        "deps": {"bash": {"commands": ["true", "echo first >&2; echo last words >&2; exit 3"]}}}));
    let error = worker
        .register_with_metadata(envelope("add"), Some(&wanted))
        .unwrap_err();
    assert_every_target_failed(
        &error,
        &Failure::new(
            ErrorCode::DEPS_UNSATISFIED,
            "BashCommandFailed: deps.bash command 2 of 2 (\"echo first >&2; echo last words >&2; exit 3\") exited with status 3; stderr tail:\nfirst\nlast words",
        ),
    );
    assert_tables(&worker, &[]);
}

fn an_unknown_executor() {
    let worker = started();
    let wanted = metadata(json!({"name": "add", "executor": "dask"}));
    let error = worker
        .register_with_metadata(envelope("add"), Some(&wanted))
        .unwrap_err();
    assert_every_target_failed(
        &error,
        &Failure::new(
            ErrorCode::EXECUTOR_UNKNOWN,
            "ExecutorUnknown: no executor named \"dask\" in this target (known: python)",
        ),
    );
    assert_tables(&worker, &[]);
}

fn capture_output_returns_the_calls_output() {
    let worker = worker();
    let capture = metadata(json!({"name": "greet", "executor": "python",
        "executor_data": {"type": "PythonExecutor", "short_name": "python",
                          "attributes": {"capture_output": true}}}));
    // Before start (startup snapshot) and after: the same attribute applies.
    let early = worker
        .register_with_metadata(envelope("greet"), Some(&capture))
        .unwrap();
    worker.start().unwrap();
    let expected = json!({"result": "hello world", "stdout": "greeting world\n", "stderr": ""});
    for result in json_everywhere(&worker, &early, json!(["world"]), json!({})) {
        assert_eq!(result, expected);
    }
    let late = worker
        .register_with_metadata(envelope("divide"), Some(&capture))
        .unwrap();
    for result in json_everywhere(&worker, &late, json!([1, 4]), json!({})) {
        assert_eq!(result, json!({"result": 0.25, "stdout": "", "stderr": ""}));
    }
    assert!(!PythonRuntime::interpreter_initialized());
}

fn a_call_before_result_becomes_a_keyword_argument() {
    let worker = worker();
    // Pre-start: the hook and its user in the startup snapshot.
    worker.register(envelope("load_config")).unwrap();
    let mut with_hook = CallableMetadata::named("scaled");
    with_hook.call_before = vec![hook("load_config", json!([]), json!({}), Some("config"))];
    let early = worker
        .register_with_metadata(envelope("scaled"), Some(&with_hook))
        .unwrap();
    worker.start().unwrap();
    assert_eq!(
        json_everywhere(&worker, &early, json!([5]), json!({})),
        vec![json!(15); usize::from(TARGETS)]
    );
    // Post-start: a hook with arguments (`append_line` returns its text).
    let path = scratch("retval");
    let mut late_meta = CallableMetadata::named("add");
    late_meta.call_before = vec![hook(
        "append_line",
        json!([path.to_str().unwrap(), "hook"]),
        json!({}),
        Some("b"),
    )];
    worker.register(envelope("append_line")).unwrap();
    let late = worker
        .register_with_metadata(envelope("add"), Some(&late_meta))
        .unwrap();
    assert_eq!(
        json_everywhere(&worker, &late, json!(["from "]), json!({})),
        vec![json!("from hook"); usize::from(TARGETS)]
    );
    // A task that passes the keyword itself is refused, not overwritten.
    let error = worker
        .submit(
            &early,
            TargetId(0),
            TaskEncoding::Json,
            &input(json!([5]), json!({"config": {"factor": 9}})),
        )
        .unwrap_err();
    assert_eq!(error.error.code, ErrorCode::TASK_FAILED);
    assert_eq!(error.kind, "HookFailed");
    assert_eq!(
        error.error.message,
        format!(
            "call_before hook {} failed: RetvalKeywordInvalid: the task input already has keyword argument \"config\", which a call_before hook's retval_keyword would replace",
            hashid("load_config")
        )
    );
    let _ = std::fs::remove_file(&path);
    assert!(!PythonRuntime::interpreter_initialized());
}

fn call_after_runs_after_each_successful_task() {
    let worker = started();
    let path = scratch("after");
    worker.register(envelope("append_line")).unwrap();
    let mut after = CallableMetadata::named("add");
    after.call_after = vec![hook(
        "append_line",
        json!([]),
        json!({"path": path.to_str().unwrap(), "text": "after"}),
        None,
    )];
    let add = worker
        .register_with_metadata(envelope("add"), Some(&after))
        .unwrap();
    // The task's own result is returned, not the hook's.
    assert_eq!(
        json_everywhere(&worker, &add, json!([2, 3]), json!({})),
        vec![json!(5); usize::from(TARGETS)]
    );
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "after\n".repeat(usize::from(TARGETS))
    );
    // A failing task: no call_after.
    let error = worker
        .submit(
            &add,
            TargetId(1),
            TaskEncoding::Json,
            &input(json!([1, "x"]), json!({})),
        )
        .unwrap_err();
    assert_eq!(error.kind, "TypeError");
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "after\n".repeat(usize::from(TARGETS))
    );
    let _ = std::fs::remove_file(&path);
    assert!(!PythonRuntime::interpreter_initialized());
}

fn a_hook_failure_is_reported_with_the_task() {
    let worker = started();
    worker.register(envelope("refusing_hook")).unwrap();
    let mut before = CallableMetadata::named("add");
    before.call_before = vec![hook("refusing_hook", json!([]), json!({}), None)];
    let add = worker
        .register_with_metadata(envelope("add"), Some(&before))
        .unwrap();
    let error = worker
        .submit(
            &add,
            TargetId(2),
            TaskEncoding::Json,
            &input(json!([2, 3]), json!({})),
        )
        .unwrap_err();
    assert_eq!(error.error.code, ErrorCode::TASK_FAILED);
    assert_eq!(error.kind, "HookFailed");
    assert_eq!(error.error.target, Some(TargetId(2)));
    assert_eq!(error.error.hashid, Some(add.hashid));
    let prefix = format!(
        "call_before hook {} failed: ValueError: this hook refuses\nTraceback",
        hashid("refusing_hook")
    );
    assert!(
        error.error.message.starts_with(&prefix),
        "{}",
        error.error.message
    );
    // A failing call_after is reported although the task succeeded.
    let mut after = CallableMetadata::named("square");
    after.call_after = vec![hook("refusing_hook", json!([]), json!({}), None)];
    let square = worker
        .register_with_metadata(envelope("square"), Some(&after))
        .unwrap();
    let error = worker
        .submit(
            &square,
            TargetId(0),
            TaskEncoding::Json,
            &input(json!([3]), json!({})),
        )
        .unwrap_err();
    assert_eq!(error.kind, "HookFailed");
    let prefix = format!(
        "call_after hook {} failed after the task succeeded: ValueError: this hook refuses",
        hashid("refusing_hook")
    );
    assert!(
        error.error.message.starts_with(&prefix),
        "{}",
        error.error.message
    );
    // The target keeps serving.
    assert_eq!(
        worker
            .submit(
                &add,
                TargetId(2),
                TaskEncoding::Json,
                &input(json!([]), json!({}))
            )
            .unwrap_err()
            .kind,
        "HookFailed"
    );
    assert!(!PythonRuntime::interpreter_initialized());
}

fn retval_keyword_is_refused_for_a_pickled_task() {
    let worker = started();
    worker.register(envelope("load_config")).unwrap();
    let mut with_hook = CallableMetadata::named("scaled");
    with_hook.call_before = vec![hook("load_config", json!([]), json!({}), Some("config"))];
    let scaled = worker
        .register_with_metadata(envelope("scaled"), Some(&with_hook))
        .unwrap();
    // The input is never looked at: the refusal comes first.
    let error = worker
        .submit(&scaled, TargetId(0), TaskEncoding::Pickle, b"opaque")
        .unwrap_err();
    assert_eq!(error.error.code, ErrorCode::TASK_FAILED);
    assert_eq!(
        error.error.message,
        format!(
            "call_before hook {} passes its result as keyword argument \"config\", which needs a JSON-encoded task; this task is pickle-encoded",
            hashid("load_config")
        )
    );
    // Nothing stays pinned: the hook's digest unregisters cleanly.
    let table = worker.inspect().unwrap();
    for (target, table) in table {
        assert_eq!(table.unwrap().tombstones, 0, "{target}");
    }
    assert!(!PythonRuntime::interpreter_initialized());
}

fn a_hook_that_is_not_live_is_refused_before_broadcast() {
    // Before start.
    let worker = worker();
    let mut before = CallableMetadata::named("scaled");
    before.call_before = vec![hook("load_config", json!([]), json!({}), Some("config"))];
    let error = worker
        .register_with_metadata(envelope("scaled"), Some(&before))
        .unwrap_err();
    let expected = format!(
        "call_before[0] names {}, which has no live registration in LOCAL_PYTHON (register it first)",
        hashid("load_config")
    );
    assert_eq!(error.code(), ErrorCode::METADATA_INVALID);
    assert_eq!(error.error.message, expected);
    assert_eq!(error.outcomes, vec![]);
    assert!(worker.parent_state().live_handles().is_empty());
    worker.start().unwrap();
    // After start: refused before any control is sent; no target holds it.
    let mut after = CallableMetadata::named("add");
    after.call_after = vec![hook("refusing_hook", json!([]), json!({}), None)];
    let error = worker
        .register_with_metadata(envelope("add"), Some(&after))
        .unwrap_err();
    assert_eq!(error.code(), ErrorCode::METADATA_INVALID);
    assert_eq!(
        error.error.message,
        format!(
            "call_after[0] names {}, which has no live registration in LOCAL_PYTHON (register it first)",
            hashid("refusing_hook")
        )
    );
    assert_eq!(
        error.error.hashid.map(|h| h.to_string()),
        Some(hashid("add"))
    );
    assert_eq!(error.outcomes, vec![]);
    assert_tables(&worker, &[]);
    // Once the hook was unregistered, it is refused again.
    let hook_handle = worker.register(envelope("refusing_hook")).unwrap();
    worker
        .register_with_metadata(envelope("add"), Some(&after))
        .unwrap();
    worker.unregister(&hook_handle).unwrap();
    let error = worker
        .register_with_metadata(envelope("square"), Some(&after))
        .unwrap_err();
    assert_eq!(error.code(), ErrorCode::METADATA_INVALID);
    assert_tables(&worker, &[("add", 1)]);
    assert!(!PythonRuntime::interpreter_initialized());
}

fn metadata_is_not_part_of_the_hashid() {
    let worker = started();
    let described_metadata = metadata(json!({"name": "another name", "executor": "python"}));
    let plain = worker.register(envelope("add")).unwrap();
    // While it is registered without metadata, a register of it with some
    // is refused (specs/protocol.md §2.10), before anything is sent.
    let conflict = worker
        .register_with_metadata(envelope("add"), Some(&described_metadata))
        .unwrap_err();
    assert_eq!(
        conflict.code(),
        callreg::error::ErrorCode::METADATA_CONFLICT,
        "{conflict}"
    );
    assert_tables(&worker, &[("add", 1)]);
    worker.unregister(&plain).unwrap();
    let described = worker
        .register_with_metadata(envelope("add"), Some(&described_metadata))
        .unwrap();
    assert_eq!(plain.hashid, described.hashid);
    assert_ne!(plain.handle_id, described.handle_id);
    assert_tables(&worker, &[("add", 1)]);
}
