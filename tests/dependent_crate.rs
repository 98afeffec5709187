//! A program that depends on callreg with feature `python` (`tests/dependent`,
//! outside this workspace) links the libpython callreg was built for: built
//! with the recipe of its `build.rs` (the RUNPATH from
//! `DEP_CALLREG_PYTHON_LIBDIR`), its targets run the interpreter of
//! `PYO3_PYTHON` and import that interpreter's cloudpickle; run on another
//! copy of libpython, its targets refuse to start and name both.
//!
//! Builds with `cargo` into `target/dependent` (the lock file is this
//! workspace's, so the versions are the same), with the interpreter named by
//! `PYO3_PYTHON` (else `python3`), which needs cloudpickle. Spawns processes
//! but never forks this one, so it runs in the default harness.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn python() -> String {
    std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|dir| {
            if dir.is_absolute() {
                dir
            } else {
                root().join(dir)
            }
        })
        .unwrap_or_else(|| root().join("target"))
        .join("dependent")
}

fn run_ok(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Runs `code` with the interpreter and returns its stdout, trimmed.
fn python_says(code: &str) -> String {
    let output = run_ok(Command::new(python()).arg("-c").arg(code));
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

/// The dependent's binary, built once per process.
fn binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let manifest = root().join("tests/dependent/Cargo.toml");
        // Tests run in parallel processes: copy, then rename into place.
        let lock = root().join("tests/dependent/Cargo.lock");
        let copy = lock.with_extension(format!("lock.{}", std::process::id()));
        std::fs::copy(root().join("Cargo.lock"), &copy).expect("copy Cargo.lock");
        std::fs::rename(&copy, &lock).expect("rename Cargo.lock");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        run_ok(
            Command::new(cargo)
                .arg("build")
                .arg("--quiet")
                .arg("--offline")
                .arg("--manifest-path")
                .arg(&manifest)
                .env("CARGO_TARGET_DIR", target_dir())
                .env("PYO3_PYTHON", python()),
        );
        target_dir().join("debug/callreg-dependent")
    })
}

/// An envelope of a callable returning `[sys.executable,
/// cloudpickle.__version__]` as the target sees them.
fn envelope(dir: &Path) -> PathBuf {
    let path = dir.join("where.spyc");
    let script = "import sys\n\
                  sys.path.insert(0, sys.argv[1])\n\
                  import callreg_envelope\n\
                  def where():\n    \
                      import sys, cloudpickle\n    \
                      return [sys.executable, cloudpickle.__version__]\n\
                  open(sys.argv[2], 'wb').write(callreg_envelope.dumps(where))\n";
    run_ok(
        Command::new(python())
            .arg("-c")
            .arg(script)
            .arg(root().join("python/tools"))
            .arg(&path),
    );
    path
}

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("callreg-dependent-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_dependent_crate_links_the_build_libpython_and_its_targets_import_cloudpickle() {
    let dir = scratch("ok");
    let envelope = envelope(&dir);
    let output = Command::new(binary()).arg(&envelope).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}: {stderr}", output.status);
    let expected = python_says(
        "import json, sys, cloudpickle; print(json.dumps([sys.executable, cloudpickle.__version__]))",
    );
    let got: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&expected).unwrap();
    assert_eq!(got, expected);
}

#[test]
fn a_dependent_on_another_libpython_names_both_and_does_not_start() {
    let dir = scratch("mismatch");
    let envelope = envelope(&dir);
    // A copy of the same libpython in another directory, found first.
    let libdir = python_says("import sysconfig; print(sysconfig.get_config_var('LIBDIR'))");
    let soname = python_says("import sysconfig; print(sysconfig.get_config_var('INSTSONAME'))");
    let copies = dir.join("lib");
    std::fs::create_dir_all(&copies).unwrap();
    std::fs::copy(Path::new(&libdir).join(&soname), copies.join(&soname)).unwrap();
    let output = Command::new(binary())
        .arg(&envelope)
        .env("LD_LIBRARY_PATH", &copies)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    let expected = format!(
        "callreg target 0: the runtime did not start: TARGET_LOST: LibpythonMismatch: this program was built for the Python at {} (libpython in {libdir}) \
         but loaded {}; give the program that directory as its rpath",
        python_says("import sys; print(sys.executable)"),
        copies.join(&soname).display()
    );
    assert!(
        stderr.contains(&expected),
        "expected {expected:?} in:\n{stderr}"
    );
    assert!(
        stderr.contains("TARGET_LOST: targets 0, 1 did not start and were stopped"),
        "{stderr}"
    );
}
