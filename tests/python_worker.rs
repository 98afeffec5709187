//! The Worker with Python targets ([`PythonRuntime`]) over real forked
//! processes, sealed memfds and pipes.
//!
//! A `harness = false` binary run by the runner of `tests/io_common/mod.rs`:
//! each test runs on the main thread (forking is safe under plain `cargo
//! test`), `cargo nextest` runs each test in its own process, and after
//! every test the runner checks that no staged payload (a
//! sealed memfd open or mapped in this process) and no child process is left. Every test also checks
//! that this process, the parent, never initialised Python.
//!
//! Payloads are made at test time by the interpreter named by `PYO3_PYTHON`
//! (else `python3`), which must have cloudpickle and be the Python the build
//! linked: `examples/callables.py` packed by `python/tools/callreg_envelope.py`,
//! plus a 1 MiB closure and payloads that exit or fail on some targets while
//! unpickling. They are written to a temporary directory, read, and the
//! directory is removed before any test runs.
//!
//! Run: `PYO3_PYTHON=$(python3 -c 'import sys; print(sys.executable)')
//! cargo test --features python --test python_worker [-- FILTER]`.

mod io_common;
mod python_common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use callreg::descriptor::Digest;
use callreg::error::ErrorCode;
use callreg::io::Worker;
use callreg::protocol::invariants::{check_all, View};
use callreg::protocol::{Handle, Target, TargetConfig, TargetId, TargetOutcome};
use callreg::runtime::python::PythonRuntime;
use callreg::runtime::TaskEncoding;
use serde_json::{json, Value};
use sha2::Sha256;

const TARGETS: u16 = 4;

/// Writes the extra payloads into argv[1] as `NAME.spyc` envelopes made by
/// `callreg_envelope.dumps`; argv[2] is the directory of
/// `callreg_envelope.py`, argv[3] a path that must not exist yet (the
/// first target to unpickle `first_target_only` creates it).
const EXTRA_PAYLOADS: &str = r#"
import hashlib, os, sys
sys.path.insert(0, sys.argv[2])
import callreg_envelope

out, marker = sys.argv[1], sys.argv[3]

BLOB = bytes(range(256)) * 4096

def make_checksum(blob):
    def checksum():
        return [len(blob), hashlib.sha256(blob).hexdigest()]
    return checksum

class ExitsWhenUnpickled:
    def __call__(self):
        return None
    def __reduce__(self):
        return (sys.exit, (3,))

def first_only(path):
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        raise RuntimeError("only the first target may unpickle this payload")
    os.close(fd)
    return lambda: "first"

class FirstTargetOnly:
    def __call__(self):
        return None
    def __reduce__(self):
        return (first_only, (marker,))

for name, value in [
    ("checksum_1mib", make_checksum(BLOB)),
    ("exits_when_unpickled", ExitsWhenUnpickled()),
    ("first_target_only", FirstTargetOnly()),
]:
    with open(os.path.join(out, name + ".spyc"), "wb") as f:
        f.write(callreg_envelope.dumps(value))
"#;

fn main() {
    io_common::run(&[
        (
            "every_shape_pre_and_post_start_on_every_target",
            every_shape_pre_and_post_start_on_every_target,
        ),
        ("a_one_mib_closure", a_one_mib_closure),
        (
            "unregister_then_call_names_the_hashid",
            unregister_then_call_names_the_hashid,
        ),
        (
            "a_task_exception_propagates_with_type_and_message",
            a_task_exception_propagates_with_type_and_message,
        ),
        (
            "unpickle_failure_rolls_back_every_target",
            unpickle_failure_rolls_back_every_target,
        ),
        (
            "a_failure_on_some_targets_rolls_back_the_others",
            a_failure_on_some_targets_rolls_back_the_others,
        ),
        ("a_non_callable_payload", a_non_callable_payload),
        (
            "sys_exit_while_unpickling_keeps_targets_alive",
            sys_exit_while_unpickling_keeps_targets_alive,
        ),
        (
            "a_register_completes_during_long_tasks",
            a_register_completes_during_long_tasks,
        ),
        (
            "opaque_pickled_arguments_and_result",
            opaque_pickled_arguments_and_result,
        ),
        (
            "a_target_initializer_gives_callables_a_context",
            a_target_initializer_gives_callables_a_context,
        ),
    ]);
}

/// Envelopes by name (file stem), made once per process.
fn payloads() -> &'static BTreeMap<String, Vec<u8>> {
    static PAYLOADS: OnceLock<BTreeMap<String, Vec<u8>>> = OnceLock::new();
    PAYLOADS.get_or_init(|| make_payloads().unwrap_or_else(|why| panic!("{why}")))
}

fn make_payloads() -> Result<BTreeMap<String, Vec<u8>>, String> {
    let marker = marker_dir().join("first-target-marker");
    // The marker directory is created again by the test that uses it.
    python_common::pack_payloads("worker", EXTRA_PAYLOADS, &[marker.as_os_str()])
}

/// The directory of the file `first_target_only` creates; it exists only
/// during the test that registers that payload.
fn marker_dir() -> PathBuf {
    python_common::scratch_dir("worker")
}

fn envelope(name: &str) -> &'static [u8] {
    python_common::envelope_in(payloads(), name)
}

use python_common::worker;

fn input(args: Value, kwargs: Value) -> Vec<u8> {
    json!({"args": args, "kwargs": kwargs})
        .to_string()
        .into_bytes()
}

/// Runs `handle` on every live target with JSON `args`; returns the
/// results as JSON, in target order.
fn call_everywhere(
    worker: &Worker<PythonRuntime>,
    handle: &Handle,
    args: Value,
) -> Vec<(TargetId, Value)> {
    worker
        .submit_to_every(handle, TaskEncoding::Json, &input(args, json!({})))
        .into_iter()
        .map(|(target, result)| {
            let bytes = result.unwrap_or_else(|e| panic!("{target}: {e}"));
            (
                target,
                serde_json::from_slice(&bytes).expect("a JSON result"),
            )
        })
        .collect()
}

fn assert_everywhere(
    worker: &Worker<PythonRuntime>,
    handle: &Handle,
    args: Value,
    expected: Value,
) {
    let results = call_everywhere(worker, handle, args);
    assert_eq!(results.len(), worker.live_targets().len());
    for (target, result) in results {
        assert_eq!(result, expected, "{target}");
    }
}

/// Every live target's installed digests and refcounts.
fn tables(worker: &Worker<PythonRuntime>) -> Vec<(TargetId, Vec<(Digest, u32)>)> {
    worker
        .inspect()
        .expect("inspect")
        .into_iter()
        .map(|(target, table)| {
            let table = table.unwrap_or_else(|| panic!("{target} did not report its table"));
            assert_eq!(table.tombstones, 0, "{target}");
            (target, table.installed)
        })
        .collect()
}

/// specs/design.md §4.4 invariants 1–9 on the parent state and the reported
/// tables (the Worker must be quiescent), and the parent never ran Python.
fn check(worker: &Worker<PythonRuntime>) {
    let parent = worker.parent_state();
    let mut machines: Vec<Option<Target>> = vec![None; usize::from(parent.config().targets)];
    for (target, installed) in tables(worker) {
        let config = TargetConfig {
            id: target,
            slot_capacity: u16::MAX,
        };
        machines[usize::from(target.0)] =
            Some(Target::new(config, &installed).expect("a reported table fits"));
    }
    let borrowed: Vec<Option<&Target>> = machines.iter().map(Option::as_ref).collect();
    let view = View {
        parent: &parent,
        targets: &borrowed,
        frames: &[],
        replies: &[],
    };
    assert!(view.is_quiescent(), "not quiescent");
    if let Err(violation) = check_all(&view) {
        panic!("invariant violated: {violation:?}");
    }
    assert!(
        !PythonRuntime::interpreter_initialized(),
        "the parent initialised Python"
    );
}

/// The shapes of `examples/callables.py` with an input and its result.
fn shapes() -> Vec<(&'static str, Value, Value)> {
    vec![
        ("add", json!([2, 3]), json!(5)),
        ("square", json!([7]), json!(49)),
        ("scale_by_3", json!([5]), json!(15)),
        ("multiplier", json!([4]), json!(40)),
        ("power_of_2", json!([9]), json!(81)),
        ("divide", json!([1, 4]), json!(0.25)),
        ("sleep_for", json!([0]), json!(0)),
        ("busy_for", json!([0]), json!(0)),
    ]
}

fn every_shape_pre_and_post_start_on_every_target() {
    let worker = worker(TARGETS);
    let early: Vec<(Handle, Value, Value)> = shapes()
        .into_iter()
        .map(|(name, args, result)| (worker.register(envelope(name)).unwrap(), args, result))
        .collect();
    let report = worker.start().unwrap();
    assert!(report.outcomes.iter().all(|(_, o)| *o == TargetOutcome::Ok));
    assert_eq!(worker.live_targets().len(), usize::from(TARGETS));
    let late: Vec<Handle> = shapes()
        .into_iter()
        .map(|(name, _, _)| worker.register(envelope(name)).unwrap())
        .collect();
    for ((first, args, result), second) in early.iter().zip(&late) {
        // Same envelope: one hashid, two handles.
        assert_eq!(first.hashid, second.hashid);
        assert_ne!(first.handle_id, second.handle_id);
        assert_everywhere(&worker, first, args.clone(), result.clone());
        assert_everywhere(&worker, second, args.clone(), result.clone());
    }
    // Keyword arguments reach the callable.
    let add = &early[0].0;
    let sum = worker
        .submit(
            add,
            TargetId(3),
            TaskEncoding::Json,
            &input(json!([]), json!({"a": 40, "b": 2})),
        )
        .unwrap();
    assert_eq!(sum, b"42");
    let mut expected: Vec<(Digest, u32)> = early.iter().map(|(h, _, _)| (h.digest(), 2)).collect();
    expected.sort();
    for (target, installed) in tables(&worker) {
        assert_eq!(installed, expected, "{target}");
    }
    check(&worker);
    for ((first, args, result), second) in early.iter().zip(&late) {
        worker.unregister(first).unwrap();
        // The other handle of the same callable still works.
        assert_everywhere(&worker, second, args.clone(), result.clone());
    }
    check(&worker);
    for handle in &late {
        worker.unregister(handle).unwrap();
    }
    for (target, installed) in tables(&worker) {
        assert_eq!(installed, vec![], "{target}");
    }
    check(&worker);
}

fn a_one_mib_closure() {
    let envelope = envelope("checksum_1mib");
    assert!(envelope.len() > 1 << 20, "{} bytes", envelope.len());
    let blob: Vec<u8> = (0..4096).flat_map(|_| 0..=255u8).collect();
    let expected = json!([1 << 20, hex(&<Sha256 as sha2::Digest>::digest(&blob))]);
    let worker = worker(TARGETS);
    let early = worker.register(envelope).unwrap();
    worker.start().unwrap();
    let late = worker.register(envelope).unwrap();
    assert_eq!(early.hashid, late.hashid);
    assert_everywhere(&worker, &early, json!([]), expected.clone());
    worker.unregister(&early).unwrap();
    assert_everywhere(&worker, &late, json!([]), expected);
    check(&worker);
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unregister_then_call_names_the_hashid() {
    let worker = worker(2);
    worker.start().unwrap();
    let add = worker.register(envelope("add")).unwrap();
    worker.unregister(&add).unwrap();
    for target in [TargetId(0), TargetId(1)] {
        let err = worker
            .submit(
                &add,
                target,
                TaskEncoding::Json,
                &input(json!([1, 1]), json!({})),
            )
            .unwrap_err();
        assert_eq!(err.error.code, ErrorCode::HANDLE_STALE);
        assert_eq!(err.error.hashid, Some(add.hashid));
        assert!(err.to_string().contains(&add.hashid.to_string()), "{err}");
    }
    for (target, installed) in tables(&worker) {
        assert_eq!(installed, vec![], "{target}");
    }
    check(&worker);
}

fn a_task_exception_propagates_with_type_and_message() {
    let worker = worker(2);
    let divide = worker.register(envelope("divide")).unwrap();
    worker.start().unwrap();
    let err = worker
        .submit(
            &divide,
            TargetId(1),
            TaskEncoding::Json,
            &input(json!([1, 0]), json!({})),
        )
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::TASK_FAILED);
    assert_eq!(err.kind, "ZeroDivisionError");
    assert_eq!(err.error.target, Some(TargetId(1)));
    assert_eq!(err.error.hashid, Some(divide.hashid));
    let message = &err.error.message;
    assert!(
        message.starts_with("division by zero\nTraceback (most recent call last):\n"),
        "{message}"
    );
    // The frame names the file cloudpickle gave the code: `callables.py`
    // (where it was defined) or a fixed name (cloudpickle 3.1+), never an
    // absolute path.
    let file = python_common::dynamic_code_filename();
    assert!(message.contains(&format!("File \"{file}\"")), "{message}");
    assert!(message.contains("in divide"), "{message}");
    // The target still serves.
    let ok = worker
        .submit(
            &divide,
            TargetId(1),
            TaskEncoding::Json,
            &input(json!([6, 3]), json!({})),
        )
        .unwrap();
    assert_eq!(ok, b"2.0");
    check(&worker);
}

/// Every target's outcome of a failed register is `Failed` with this code
/// and a message containing `needle`.
fn assert_all_failed(outcomes: &[(TargetId, TargetOutcome)], code: ErrorCode, needle: &str) {
    assert_eq!(outcomes.len(), usize::from(TARGETS));
    for (target, outcome) in outcomes {
        match outcome {
            TargetOutcome::Failed { failure } => {
                assert_eq!(failure.code, code, "{target}");
                assert!(
                    failure.message.contains(needle),
                    "{target}: {}",
                    failure.message
                );
            }
            other => panic!("{target}: {other:?}"),
        }
    }
}

/// The Worker still registers and runs a callable on every target.
fn assert_usable(worker: &Worker<PythonRuntime>) {
    let add = worker.register(envelope("add")).unwrap();
    assert_everywhere(worker, &add, json!([2, 3]), json!(5));
    worker.unregister(&add).unwrap();
}

fn unpickle_failure_rolls_back_every_target() {
    let worker = python_common::broadcasting(TARGETS);
    worker.start().unwrap();
    let square = worker.register(envelope("square")).unwrap();
    let err = worker.register(envelope("fails_to_unpickle")).unwrap_err();
    assert_eq!(err.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_all_failed(
        &err.outcomes,
        ErrorCode::DESERIALIZE_FAILED,
        "RuntimeError: this payload refuses to be unpickled",
    );
    for (target, installed) in tables(&worker) {
        assert_eq!(installed, vec![(square.digest(), 1)], "{target}");
    }
    assert_eq!(worker.live_targets().len(), usize::from(TARGETS));
    assert_usable(&worker);
    check(&worker);
}

fn a_failure_on_some_targets_rolls_back_the_others() {
    let worker = worker(TARGETS);
    worker.start().unwrap();
    let envelope = envelope("first_target_only");
    std::fs::create_dir_all(marker_dir()).unwrap();
    let err = worker.register(envelope);
    let _ = std::fs::remove_dir_all(marker_dir());
    let err = err.unwrap_err();
    assert_eq!(err.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
    let rolled_back = err
        .outcomes
        .iter()
        .filter(|(_, o)| *o == TargetOutcome::RolledBack)
        .count();
    let failed: Vec<&TargetOutcome> = err
        .outcomes
        .iter()
        .map(|(_, o)| o)
        .filter(|o| matches!(o, TargetOutcome::Failed { .. }))
        .collect();
    assert_eq!(
        (rolled_back, failed.len()),
        (1, usize::from(TARGETS) - 1),
        "{err}"
    );
    for outcome in failed {
        let TargetOutcome::Failed { failure } = outcome else {
            unreachable!()
        };
        assert_eq!(failure.code, ErrorCode::DESERIALIZE_FAILED);
        assert_eq!(
            failure.message,
            "RuntimeError: only the first target may unpickle this payload"
        );
    }
    for (target, installed) in tables(&worker) {
        assert_eq!(installed, vec![], "{target}");
    }
    assert_usable(&worker);
    check(&worker);
}

fn a_non_callable_payload() {
    let worker = python_common::broadcasting(TARGETS);
    worker.start().unwrap();
    let err = worker.register(envelope("settings")).unwrap_err();
    assert_eq!(err.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_all_failed(
        &err.outcomes,
        ErrorCode::DESERIALIZE_FAILED,
        "TypeError: the payload unpickled to an object of type 'dict', which is not callable",
    );
    for (target, installed) in tables(&worker) {
        assert_eq!(installed, vec![], "{target}");
    }
    assert_usable(&worker);
    check(&worker);
}

fn sys_exit_while_unpickling_keeps_targets_alive() {
    let worker = python_common::broadcasting(TARGETS);
    worker.start().unwrap();
    let pids: Vec<Option<i32>> = (0..TARGETS)
        .map(|t| worker.target_pid(TargetId(t)))
        .collect();
    let err = worker
        .register(envelope("exits_when_unpickled"))
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_all_failed(
        &err.outcomes,
        ErrorCode::DESERIALIZE_FAILED,
        "SystemExit: 3",
    );
    assert_eq!(worker.live_targets().len(), usize::from(TARGETS));
    let after: Vec<Option<i32>> = (0..TARGETS)
        .map(|t| worker.target_pid(TargetId(t)))
        .collect();
    assert_eq!(pids, after);
    assert_usable(&worker);
    check(&worker);
}

fn a_register_completes_during_long_tasks() {
    let worker = worker(TARGETS);
    let sleep_for = worker.register(envelope("sleep_for")).unwrap();
    let busy_for = worker.register(envelope("busy_for")).unwrap();
    worker.start().unwrap();
    let seconds = json!([1.5]);
    // Targets 0 and 1 sleep (GIL released); 2 and 3 run Python bytecode
    // (GIL taken back every switch interval).
    let tasks: Vec<_> = (0..TARGETS)
        .map(|t| {
            let handle = if t < 2 { &sleep_for } else { &busy_for };
            worker.submit_async(
                handle,
                TargetId(t),
                TaskEncoding::Json,
                &input(seconds.clone(), json!({})),
            )
        })
        .collect();
    let add = worker.register(envelope("add")).unwrap();
    // The register needed every target, while each was still in its task.
    assert!(
        tasks.iter().all(|t| !t.is_complete()),
        "a task ended before the register"
    );
    for task in tasks {
        assert_eq!(task.wait().unwrap(), b"1.5");
    }
    assert_everywhere(&worker, &add, json!([1, 2]), json!(3));
    check(&worker);
}

fn opaque_pickled_arguments_and_result() {
    let worker = worker(2);
    worker.start().unwrap();
    let add = worker.register(envelope("add")).unwrap();
    // `pickle.dumps(((2, 3), {}), 2)`, built by hand: the parent holds
    // pickled arguments and results as opaque bytes and never decodes them.
    let arguments = b"\x80\x02((K\x02K\x03t}t.";
    for target in [TargetId(0), TargetId(1)] {
        let result = worker
            .submit(&add, target, TaskEncoding::Pickle, arguments)
            .unwrap();
        // `pickle.dumps(5, pickle.HIGHEST_PROTOCOL)`.
        assert_eq!(result, b"\x80\x05K\x05.", "{target}");
    }
    let err = worker
        .submit(&add, TargetId(0), TaskEncoding::Pickle, b"not a pickle")
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::TASK_FAILED);
    assert_eq!(err.kind, "TaskInputInvalid");
    check(&worker);
}

/// `PythonRuntime::with_target_initializer_source` (`specs/python.md` §5):
/// the initializer runs in each target with its id; where it returns a
/// context, every callable is called with it first; where it returns
/// `None`, callables are called as usual; where it raises, the target is
/// lost at start; the context's `close()` runs when the target stops.
fn a_target_initializer_gives_callables_a_context() {
    let stopped =
        std::env::temp_dir().join(format!("callreg-python-initializer-{}", std::process::id()));
    let source = format!(
        "\
class Context(int):
    def close(self):
        open({path:?}, 'w').write('closed %d' % self)

def initialize(target):
    if target == 2:
        raise RuntimeError('no start for target 2')
    return Context(100 * target) if target else None
",
        path = stopped.to_str().expect("a UTF-8 path")
    );
    let runtime = PythonRuntime::new()
        .with_target_initializer_source(&source)
        .expect("no NUL");
    let worker = Worker::builder(Arc::new(runtime))
        .targets(3)
        .control_timeout(Duration::from_secs(20))
        .build()
        .expect("a Worker");
    let error = worker.start().expect_err("target 2 does not start");
    assert_eq!(error.error.code, ErrorCode::TARGET_LOST);
    assert_eq!(error.error.target, Some(TargetId(2)));
    assert_eq!(worker.live_targets(), vec![TargetId(0), TargetId(1)]);
    let add = worker.register(envelope("add")).unwrap();
    let run = |target: u16, args: Value| -> Value {
        let bytes = worker
            .submit(
                &add,
                TargetId(target),
                TaskEncoding::Json,
                &input(args, json!({})),
            )
            .unwrap_or_else(|e| panic!("{target}: {e}"));
        serde_json::from_slice(&bytes).expect("a JSON result")
    };
    // Target 0: no context, add(2, 3). Target 1: context 100, add(100, 5).
    assert_eq!(run(0, json!([2, 3])), json!(5));
    assert_eq!(run(1, json!([5])), json!(105));
    let refused = worker
        .submit(
            &add,
            TargetId(1),
            TaskEncoding::Json,
            &input(json!([2, 3]), json!({})),
        )
        .expect_err("add(100, 2, 3) has one argument too many");
    assert_eq!(refused.kind, "TypeError");
    assert!(!stopped.exists());
    // At stop, target 1 closes its context.
    worker.close();
    let closed = std::fs::read_to_string(&stopped).expect("the context was closed");
    std::fs::remove_file(&stopped).expect("remove the marker");
    assert_eq!(closed, "closed 100");
    assert!(
        !PythonRuntime::interpreter_initialized(),
        "the parent initialised Python"
    );
}
