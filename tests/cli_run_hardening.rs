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

/// Writes `NAME.spyc` into argv[1] for each callable below.
const PAYLOADS: &str = r#"
import os, sys
sys.path.insert(0, sys.argv[2])
import callreg_envelope

def write_fd_3():
    os.write(3, b'{"injected": true}\n')
    return "wrote"

def spawn_grandchild(pidfile):
    # `sh` inherits every descriptor the target has (no close-on-exec).
    os.system("sh -c 'echo $$ > %s; exec sleep 30' &" % pidfile)
    while not os.path.exists(pidfile) or not open(pidfile).read().strip():
        pass
    return "spawned"

for name, value in [("write_fd_3", write_fd_3), ("spawn_grandchild", spawn_grandchild)]:
    with open(os.path.join(sys.argv[1], name + ".spyc"), "wb") as f:
        f.write(callreg_envelope.dumps(value))
"#;

fn pack(dir: &Path) {
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let output = Command::new(python)
        .arg("-c")
        .arg(PAYLOADS)
        .arg(dir)
        .arg(repo().join("python"))
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
            {"op": "call", "name": "w", "target": 0, "expect_error": "Bad file descriptor"},
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
    let pipe_inode = std::fs::File::from(std::os::fd::OwnedFd::from(stdout.try_clone_fd()))
        .metadata()
        .unwrap()
        .ino();
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

trait TryCloneFd {
    fn try_clone_fd(&self) -> std::os::fd::OwnedFd;
}

impl TryCloneFd for std::process::ChildStdout {
    fn try_clone_fd(&self) -> std::os::fd::OwnedFd {
        use std::os::fd::AsFd;
        self.as_fd().try_clone_to_owned().unwrap()
    }
}
