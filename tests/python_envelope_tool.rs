//! Runs the Python unit tests of `python/tools/callreg_envelope.py` (the SPYC
//! envelope and hashid tool, specs/design.md §3.1–§3.2) so that `cargo test`
//! covers them.
//!
//! Needs `python3` (or the interpreter named by `PYO3_PYTHON`) with
//! cloudpickle installed; set `CALLREG_ALLOW_NO_PYTHON=1` to pass without
//! them. Spawns a process but never forks this one, so it runs in the
//! default harness.

use std::path::Path;
use std::process::Command;

/// The interpreter: `PYO3_PYTHON` when set (what the build linked against),
/// else `python3` on `PATH`.
fn python() -> String {
    std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

/// Whether `python` can import cloudpickle.
fn cloudpickle_available(python: &str) -> bool {
    Command::new(python)
        .args(["-c", "import cloudpickle"])
        .output()
        .map(|output| output.status.success())
        .unwrap_or(false)
}

#[test]
fn python_unit_tests_of_the_envelope_tool_pass() {
    let python = python();
    if !cloudpickle_available(&python) {
        assert!(
            std::env::var("CALLREG_ALLOW_NO_PYTHON").as_deref() == Ok("1"),
            "{python} with cloudpickle is required (pip install cloudpickle), \
             or set CALLREG_ALLOW_NO_PYTHON=1 to skip"
        );
        eprintln!("skipped: {python} cannot import cloudpickle and CALLREG_ALLOW_NO_PYTHON=1");
        return;
    }
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tools/test_callreg_envelope.py");
    let output = Command::new(&python)
        .arg(&script)
        .arg("-v")
        .output()
        .expect("spawning the Python interpreter");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "python unit tests failed ({}):\n{stderr}",
        output.status
    );
    // unittest reports on stderr; a run that found no tests must not pass.
    assert!(
        stderr.contains("\nOK"),
        "unexpected unittest output:\n{stderr}"
    );
    assert!(!stderr.contains("Ran 0 tests"), "no test ran:\n{stderr}");
}
