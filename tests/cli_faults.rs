//! `callreg run` with callables that reach for the parent's descriptors,
//! and with envelope paths that are not regular files.
//!
//! Needs `--features cli,python` (declared in Cargo.toml) and cloudpickle
//! for the interpreter named by `PYO3_PYTHON` (else `python3`).

use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{json, Value};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A fresh temporary directory for one test, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(test: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "callreg-cli-hardening-{}-{test}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `NAME.spyc` into argv[1] for each callable below; argv[2] is
/// the directory of `callreg_envelope.py`, argv[3] the marker file the
/// first target to finalize `first_finalizer_exits` creates.
const PAYLOADS: &str = r#"
import os, sys
sys.path.insert(0, sys.argv[2])
import callreg_envelope

def write_fd_3():
    # In a target, 3 is its own eventfd (the lowest number free once it
    # closed what it inherited), which refuses a write of other than
    # 8 bytes with EINVAL; it is never the parent's stdout.
    os.write(3, b'{"injected": true}\n')
    return "wrote"

def spawn_grandchild(pidfile):
    # `sh` inherits every descriptor the target has (no close-on-exec).
    os.system("sh -c 'echo $$ > %s; exec sleep 30' &" % pidfile)
    while not os.path.exists(pidfile) or not open(pidfile).read().strip():
        pass
    return "spawned"

class FirstFinalizerExits:
    # `__del__` of the first target to finalize it exits (status 9): that
    # target dies during the unregister that frees it, before answering.
    def __init__(self, marker, armed=False):
        self.marker = marker
        self.armed = armed
    def __reduce__(self):
        return (FirstFinalizerExits, (self.marker, True))
    def __call__(self):
        return "alive"
    def __del__(self):
        import os
        if not self.armed:
            return
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os._exit(9)

class DelRaises:
    def __call__(self):
        return "called"
    def __del__(self):
        raise ValueError("boom")

def first_only(marker):
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        raise RuntimeError("only the first target may unpickle this payload")
    return lambda: "first"

class FirstTargetOnly:
    def __call__(self):
        return None
    def __reduce__(self):
        return (first_only, (sys.argv[3] + ".first",))

for name, value in [
    ("first_target_only", FirstTargetOnly()),
    ("del_raises", DelRaises()),
    ("write_fd_3", write_fd_3),
    ("spawn_grandchild", spawn_grandchild),
    ("first_finalizer_exits", FirstFinalizerExits(sys.argv[3])),
]:
    with open(os.path.join(sys.argv[1], name + ".spyc"), "wb") as f:
        f.write(callreg_envelope.dumps(value))
"#;

fn pack(dir: &Path) {
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let output = Command::new(python)
        .arg("-c")
        .arg(PAYLOADS)
        .arg(dir)
        .arg(repo().join("python/tools"))
        .arg(dir.join("first-unpickle-marker"))
        .output()
        .expect("python runs");
    assert!(
        output.status.success(),
        "packing failed (is cloudpickle installed for PYO3_PYTHON?): {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Kills the process whose pid a file names, when dropped.
struct KillOnDrop(PathBuf);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(text) = std::fs::read_to_string(&self.0) {
            if let Ok(pid) = text.trim().parse::<i32>() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

/// A task cannot write into `--json` output through the parent's saved
/// stdout, and a process a task leaves behind holds no copy of the
/// parent's stdout (`callreg run … | cat` ends when `callreg` does).
#[test]
fn tasks_reach_no_descriptor_of_the_parent() {
    let dir = TempDir::new("fds");
    pack(&dir.0);
    let pidfile = dir.0.join("grandchild.pid");
    let _grandchild = KillOnDrop(pidfile.clone());
    let plan = dir.0.join("plan.json");
    std::fs::write(
        &plan,
        json!({"targets": 1, "steps": [
            {"op": "register", "name": "w", "envelope": "write_fd_3.spyc"},
            {"op": "register", "name": "g", "envelope": "spawn_grandchild.spyc"},
            {"op": "start"},
            {"op": "call", "name": "w", "target": 0, "expect_error": "Invalid argument"},
            {"op": "call", "name": "g", "target": 0, "args": [pidfile.to_str().unwrap()],
             "expect": "spawned"}
        ]})
        .to_string(),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_callreg"))
        .arg("run")
        .arg(&plan)
        .arg("--json")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("callreg runs");
    let stdout = child.stdout.take().unwrap();
    let pipe_inode = {
        use std::os::fd::AsFd;
        std::fs::File::from(stdout.as_fd().try_clone_to_owned().unwrap())
            .metadata()
            .unwrap()
            .ino()
    };
    let mut reader = BufReader::new(stdout);
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap() == 0 {
            break;
        }
        let value: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        let done = value.get("summary").is_some();
        lines.push(value);
        if done {
            break;
        }
    }
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{lines:?}");
    assert_eq!(lines.len(), 6, "{lines:?}");
    assert!(lines.iter().all(|l| l["injected"].is_null()), "{lines:?}");
    // The grandchild outlives callreg; it must not hold the stdout pipe.
    let pid = std::fs::read_to_string(&pidfile).unwrap();
    let fd_dir = format!("/proc/{}/fd", pid.trim());
    let held: Vec<String> = std::fs::read_dir(&fd_dir)
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.display().to_string())
        .collect();
    assert!(
        !held.contains(&format!("pipe:[{pipe_inode}]")),
        "the grandchild holds callreg's stdout: {held:?}"
    );
    // And so stdout ends with callreg.
    let mut rest = Vec::new();
    reader.read_to_end(&mut rest).unwrap();
    assert_eq!(rest, b"");
}

/// Runs `callreg ARGS` through `sh -c 'exec "$0" "$@" REDIRECT'` (so a
/// test can close stdin), killed if it has not ended after a minute (a
/// read that blocks would otherwise hang the suite); returns the exit
/// code and stderr.
fn callreg_with(redirect: &str, args: &[&std::ffi::OsStr]) -> (Option<i32>, String) {
    let (code, _, stderr) = callreg_output(redirect, args);
    (code, stderr)
}

/// As [`callreg_with`], with stdout too: `(code, stdout, stderr)`.
fn callreg_output(redirect: &str, args: &[&std::ffi::OsStr]) -> (Option<i32>, String, String) {
    let child = Command::new("sh")
        .arg("-c")
        .arg(format!("exec \"$0\" \"$@\" {redirect}"))
        .arg(env!("CARGO_BIN_EXE_callreg"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sh runs");
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if rx.recv_timeout(std::time::Duration::from_secs(60)).is_err() {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
    });
    let output = child.wait_with_output().unwrap();
    let _ = tx.send(());
    watchdog.join().unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn mkfifo(path: &Path) {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
}

/// `hashid` refuses what is not a regular file, before reading it (a FIFO
/// with no writer does not block), and a closed stdin is a read error
/// (not an invalid envelope); an input that cannot be read exits 1, as an
/// invalid one does.
#[test]
fn hashid_reads_only_regular_files_and_an_open_stdin() {
    let dir = TempDir::new("hashid-inputs");
    let fifo = dir.0.join("fifo");
    mkfifo(&fifo);
    let hashid = |file: &std::ffi::OsStr| callreg_with("", &["hashid".as_ref(), file]);
    assert_eq!(
        hashid("/dev/zero".as_ref()),
        (
            Some(1),
            "callreg: cannot read /dev/zero: not a regular file (a character device)\n".to_owned()
        )
    );
    assert_eq!(
        hashid(fifo.as_os_str()),
        (
            Some(1),
            format!(
                "callreg: cannot read {}: not a regular file (a FIFO)\n",
                fifo.display()
            )
        )
    );
    assert_eq!(
        callreg_with("<&-", &["hashid".as_ref(), "-".as_ref()]),
        (
            Some(1),
            "callreg: cannot read <stdin>: no input (stdin is closed or empty)\n".to_owned()
        )
    );
}

/// `inspect` reads its inputs as every command does: a FIFO with no writer,
/// a device or a directory is refused before anything is read (a row with
/// `ReadError` and a line on stderr, exit 1), and so is a side-car that is
/// not a regular file.
#[test]
fn inspect_reads_only_regular_files() {
    let dir = TempDir::new("inspect-inputs");
    let fifo = dir.0.join("fifo");
    mkfifo(&fifo);
    let subdir = dir.0.join("subdir");
    std::fs::create_dir(&subdir).unwrap();
    for (file, kind) in [
        (fifo.as_os_str(), "a FIFO"),
        ("/dev/null".as_ref(), "a character device"),
        ("/dev/zero".as_ref(), "a character device"),
        (subdir.as_os_str(), "a directory"),
    ] {
        let shown = std::path::Path::new(file).display().to_string();
        let (code, stdout, stderr) =
            callreg_output("", &["inspect".as_ref(), "--json".as_ref(), file]);
        let why = format!("cannot read {shown}: not a regular file ({kind})");
        assert_eq!((code, stderr), (Some(1), format!("callreg: {why}\n")));
        let row: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(row["error"], "ReadError", "{stdout}");
        assert_eq!(row["message"], why.as_str(), "{stdout}");
    }
    // A valid envelope whose side-car is a FIFO: the side-car is refused.
    let envelope = dir.0.join("ok.spyc");
    std::fs::write(&envelope, callreg::envelope::encode(b"payload")).unwrap();
    let sidecar = callreg::metadata::sidecar_path(&envelope);
    mkfifo(&sidecar);
    let (code, stdout, _) = callreg_output(
        "",
        &["inspect".as_ref(), "--json".as_ref(), envelope.as_os_str()],
    );
    assert_eq!(code, Some(1), "{stdout}");
    let row: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        row["metadata_error"],
        format!(
            "cannot read {}: not a regular file (a FIFO)",
            sidecar.display()
        )
        .as_str(),
        "{stdout}"
    );
}

/// `hashid` of a 100 MB file with a bad header reads its 16 header bytes
/// only: the command's peak resident size stays far below the file's.
#[test]
fn hashid_reads_the_header_before_the_rest() {
    let dir = TempDir::new("hashid-big");
    let big = dir.0.join("random.bin");
    {
        use std::io::Write;
        let mut file = std::io::BufWriter::new(std::fs::File::create(&big).unwrap());
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut block = vec![0u8; 1 << 20];
        for _ in 0..100 {
            for chunk in block.chunks_mut(8) {
                // xorshift64: incompressible enough, and no bad-magic luck.
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
            }
            file.write_all(&block).unwrap();
        }
    }
    // The peak resident size of `callreg` alone, in KiB, as its parent
    // (a Python process) sees it once it was reaped.
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let output = Command::new(python)
        .arg("-c")
        .arg(
            "import resource, subprocess, sys\n\
             r = subprocess.run(sys.argv[1:], capture_output=True)\n\
             print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n\
             sys.stderr.write(r.stderr.decode())",
        )
        .arg(env!("CARGO_BIN_EXE_callreg"))
        .arg("hashid")
        .arg(&big)
        .output()
        .expect("python runs");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    let fields: Vec<u64> = stdout
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect();
    assert_eq!(fields[0], 1, "{stderr}");
    assert!(stderr.contains("(BadMagic)"), "{stderr}");
    assert!(
        fields[1] < 40 * 1024,
        "callreg hashid peaked at {} KiB for a 100 MB file with a bad header",
        fields[1]
    );
}

/// A plan's envelope path that is a FIFO or a device is refused while the
/// plan is read (exit status 2, the step and field named), without
/// blocking or reading it.
#[test]
fn run_refuses_envelope_paths_that_are_not_regular_files() {
    let dir = TempDir::new("run-inputs");
    let fifo = dir.0.join("fifo.spyc");
    mkfifo(&fifo);
    for (envelope, kind) in [
        (fifo.to_str().unwrap(), "a FIFO"),
        ("/dev/zero", "a character device"),
    ] {
        let plan = dir.0.join("plan.json");
        std::fs::write(
            &plan,
            json!({"targets": 1, "steps": [
                {"op": "register", "name": "f", "envelope": envelope}
            ]})
            .to_string(),
        )
        .unwrap();
        // Refused before anything is read; the step fails (exit 1), as a
        // malformed envelope's does.
        let (code, stdout, stderr) =
            callreg_output("", &["run".as_ref(), plan.as_os_str(), "--json".as_ref()]);
        assert_eq!((code, stderr.as_str()), (Some(1), ""));
        let step: serde_json::Value = stdout
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
            .find(|line| line["step"] == json!(0))
            .expect("a line for step 0");
        assert_eq!(step["ok"], json!(false));
        assert_eq!(step["code"], json!("IO_FAILED"));
        assert_eq!(
            step["error"],
            json!(format!(
                "IO_FAILED: cannot read {envelope}: not a regular file ({kind}) (operation register)"
            ))
        );
    }
}

/// A target that dies during a step (here: the finalizer of the callable
/// an unregister frees exits on one target) is reported lost, with how it
/// ended, not `ok`, and the unregister fails with `TARGET_LOST` though the
/// handle is released (`specs/protocol.md` §2.3): outcomes are sampled
/// after the operation; the step ends once its replacement joined.
#[test]
fn run_reports_a_target_lost_during_a_step() {
    let dir = TempDir::new("lost-in-step");
    pack(&dir.0);
    let plan = dir.0.join("plan.json");
    std::fs::write(
        &plan,
        json!({"targets": 2, "steps": [
            {"op": "start"},
            {"op": "register", "name": "e", "envelope": "first_finalizer_exits.spyc"},
            {"op": "unregister", "name": "e", "expect_error": "the unregister lost targets while it was pending there"},
            {"op": "register", "name": "again", "envelope": "write_fd_3.spyc"}
        ]})
        .to_string(),
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_callreg"))
        .arg("run")
        .arg(&plan)
        .arg("--json")
        .output()
        .expect("callreg runs");
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert_eq!(output.status.code(), Some(0), "{stdout}");
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[2]["code"], "TARGET_LOST", "{}", lines[2]);
    let targets = lines[2]["targets"].as_array().expect("targets").clone();
    assert_eq!(targets.len(), 2, "{}", lines[2]);
    let lost: Vec<&Value> = targets.iter().filter(|t| t["outcome"] == "lost").collect();
    let ok: Vec<&Value> = targets.iter().filter(|t| t["outcome"] == "ok").collect();
    assert_eq!((lost.len(), ok.len()), (1, 1), "{}", lines[2]);
    assert_eq!(
        lost[0]["detail"], "its reply socket closed; it exited with status 9",
        "{}",
        lines[2]
    );
    // The step waited for its replacement, which joined (it had nothing
    // to replay: the unregister freed the only registration).
    assert_eq!(
        lost[0]["replacement"], "replaced by incarnation 1",
        "{}",
        lines[2]
    );
    let target = &lost[0]["target"];
    assert_eq!(
        lines[2]["target_events"][2],
        json!({"event": "joined", "target": target, "incarnation": 1}),
        "{}",
        lines[2]
    );
    // The next register reaches both targets: the replacement serves.
    assert_eq!(
        lines[3]["targets"],
        json!([{"target": 0, "outcome": "ok"}, {"target": 1, "outcome": "ok"}]),
        "{}",
        lines[3]
    );
}

/// What a finalizer raised at an unregister is reported on stderr, naming
/// the target and the unregister that released the callable; the step
/// itself succeeds (the registration is gone).
#[test]
fn run_reports_a_finalizer_failure_with_its_unregister() {
    let dir = TempDir::new("finalizer");
    pack(&dir.0);
    let plan = dir.0.join("plan.json");
    std::fs::write(
        &plan,
        json!({"targets": 1, "steps": [
            {"op": "register", "name": "d", "envelope": "del_raises.spyc"},
            {"op": "start"},
            {"op": "call", "name": "d", "target": 0, "expect": "called"},
            {"op": "unregister", "name": "d"},
            {"op": "call", "name": "d", "target": 0, "expect_error": "not registered"}
        ]})
        .to_string(),
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_callreg"))
        .arg("run")
        .arg(&plan)
        .output()
        .expect("callreg runs");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(output.status.code(), Some(0), "{stdout}{stderr}");
    let hashid = stdout
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().find(|w| w.starts_with("sha256:")))
        .expect("the register line names the hashid")
        .to_owned();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines,
        vec![format!(
            "callreg target 0: the unregister (seq 2) of {hashid} released a callable whose finalizer failed: ValueError: a finalizer raised: boom"
        )],
        "{stderr}"
    );
}

/// A pre-start register whose callable fails to unpickle on some targets
/// is marked failed (with each target's reason) when the start runs; the
/// Worker starts on every target and the other callables work.
#[test]
fn run_marks_a_pre_start_register_that_failed_at_start() {
    let dir = TempDir::new("snapshot-failure");
    pack(&dir.0);
    let plan = dir.0.join("plan.json");
    std::fs::write(
        &plan,
        json!({"targets": 3, "steps": [
            {"op": "register", "name": "bad", "envelope": "first_target_only.spyc",
             "expect_error": "RuntimeError: only the first target may unpickle this payload"},
            {"op": "register", "name": "w", "envelope": "write_fd_3.spyc"},
            {"op": "start"},
            {"op": "call_all", "name": "w", "expect_error": "Invalid argument"},
            {"op": "call", "name": "bad", "target": 0, "expect_error": "not registered"}
        ]})
        .to_string(),
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_callreg"))
        .arg("run")
        .arg(&plan)
        .arg("--json")
        .output()
        .expect("callreg runs");
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert_eq!(output.status.code(), Some(0), "{stdout}");
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        lines.iter().map(|l| l["step"].clone()).collect::<Vec<_>>(),
        vec![
            json!(0),
            json!(1),
            json!(2),
            json!(3),
            json!(4),
            Value::Null
        ]
    );
    let bad = &lines[0];
    let error = bad["error"].as_str().unwrap();
    assert!(
        error.starts_with(&format!(
            "REGISTER_PARTIAL_FAILURE: at start, registration of {} (handle 1) failed: target ",
            bad["hashid"].as_str().unwrap()
        )),
        "{bad}"
    );
    let outcomes: Vec<&str> = bad["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(
        outcomes.iter().filter(|o| **o == "failed").count(),
        2,
        "{bad}"
    );
    assert_eq!(
        outcomes.iter().filter(|o| **o == "rolled_back").count(),
        1,
        "{bad}"
    );
    assert_eq!(lines[1]["ok"], true, "{}", lines[1]);
    assert_eq!(
        lines[2]["targets"].as_array().unwrap().len(),
        3,
        "{}",
        lines[2]
    );
    assert_eq!(
        lines[3]["targets"].as_array().unwrap().len(),
        3,
        "{}",
        lines[3]
    );
}
