//! A Worker with Python targets: packs `examples/callables.py` into SPYC
//! envelopes with the interpreter the build was made for, registers `add`
//! before start (startup snapshot) and `square` after start (staged and
//! broadcast, with its metadata side-car), runs tasks on one and on every
//! target, shows a Python exception coming back as a task error, and
//! unregisters.
//!
//! Run (with `PYO3_PYTHON` naming an interpreter with cloudpickle; README):
//! `cargo run --features python --example python_worker [PAYLOAD_DIR]`.
//! With `PAYLOAD_DIR` (made by `python/tools/callreg_envelope.py
//! examples/callables.py --out PAYLOAD_DIR`) nothing is packed.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;

use callreg::error::ErrorCode;
use callreg::io::Worker;
use callreg::metadata::CallableMetadata;
use callreg::protocol::TargetId;
use callreg::runtime::python::{PythonRuntime, BUILD_PYTHON};
use callreg::runtime::TaskEncoding;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("python_worker: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (payloads, scratch) = match std::env::args_os().nth(1) {
        Some(dir) => (PathBuf::from(dir), None),
        None => {
            let dir = std::env::temp_dir().join(format!("callreg-example-{}", std::process::id()));
            let packed = Command::new(BUILD_PYTHON)
                .arg(root.join("python/tools/callreg_envelope.py"))
                .arg(root.join("examples/callables.py"))
                .arg("--out")
                .arg(&dir)
                .output()?;
            if !packed.status.success() {
                return Err(format!(
                    "packing with {BUILD_PYTHON} failed ({}; is cloudpickle installed?): {}",
                    packed.status,
                    String::from_utf8_lossy(&packed.stderr)
                )
                .into());
            }
            (dir.clone(), Some(dir))
        }
    };
    let result = run_worker(&payloads);
    if let Some(dir) = scratch {
        std::fs::remove_dir_all(dir)?;
    }
    result
}

fn run_worker(payloads: &Path) -> Result<()> {
    let read = |name: &str| std::fs::read(payloads.join(format!("{name}.spyc")));
    // Forks happen in `start`, before the Worker's IO thread exists; call
    // it from a thread that outlives the Worker (here: main).
    let worker = Worker::builder(Arc::new(PythonRuntime::new()))
        .targets(3)
        .build()?;

    // Before start: into the startup snapshot every target inherits.
    let add = worker.register(&read("add")?)?;
    println!("registered add before start: {}", add.hashid);
    let report = worker.start()?;
    println!("started {} targets", report.outcomes.len());

    // After start: staged in shared memory and confirmed by every target;
    // the side-car metadata is checked by each target before unpickling.
    let sidecar = std::fs::read_to_string(payloads.join("square.spyc.json"))?;
    let metadata = CallableMetadata::from_json(&sidecar)?;
    let square = worker.register_with_metadata(&read("square")?, Some(&metadata))?;
    println!("registered square after start: {}", square.hashid);

    let sum = worker.submit(
        &add,
        TargetId(0),
        TaskEncoding::Json,
        br#"{"args": [40, 2]}"#,
    )?;
    println!(
        "add(40, 2) on target 0 -> {}",
        String::from_utf8_lossy(&sum)
    );
    assert_eq!(sum, b"42");
    for (target, result) in worker.submit_to_every(&square, TaskEncoding::Json, br#"{"args": [7]}"#)
    {
        let result = result?;
        println!(
            "square(7) on {target} -> {}",
            String::from_utf8_lossy(&result)
        );
        assert_eq!(result, b"49");
    }

    // A Python exception is a task error with its type and traceback; the
    // target keeps serving.
    let divide = worker.register(&read("divide")?)?;
    let error = worker
        .submit(
            &divide,
            TargetId(2),
            TaskEncoding::Json,
            br#"{"args": [1, 0]}"#,
        )
        .unwrap_err();
    assert_eq!(
        (error.error.code, error.kind.as_str()),
        (ErrorCode::TASK_FAILED, "ZeroDivisionError")
    );
    println!(
        "divide(1, 0) on target 2 -> {}: {}",
        error.kind,
        error.error.message.lines().next().unwrap_or("")
    );

    worker.unregister(&square)?;
    let gone = worker
        .submit(
            &square,
            TargetId(1),
            TaskEncoding::Json,
            br#"{"args": [7]}"#,
        )
        .unwrap_err();
    println!("square after unregister -> {}", gone.error.code);
    worker.close();
    Ok(())
}
