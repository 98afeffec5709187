//! Shared by the real-process test binaries (`tests/io_*.rs`): a minimal
//! test runner for `harness = false` binaries, envelope helpers, and the
//! checks every test ends with.
//!
//! Why a runner of its own: these tests fork, and forking is only safe in a
//! single-threaded process. [`run`] runs each test on the main thread, one
//! after the other (libtest-mimic with one test thread), and after each one
//! checks that no staged payload (a sealed memfd: a descriptor of this
//! process or a mapping) and no child process (running or zombie) is left.
//! libtest-mimic speaks libtest's command line, for `cargo test` and for
//! `cargo nextest` (which runs each test in its own process).
#![allow(dead_code)]

use std::panic::catch_unwind;
use std::sync::Arc;
use std::time::Duration;

use callreg::envelope::encode;
use callreg::io::staging;
use callreg::io::{Worker, WorkerBuilder};
use callreg::protocol::invariants::{check_all, View};
use callreg::protocol::{Target, TargetConfig, TargetId};
use callreg::runtime::testing::TestRuntime;
use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// One test: its name and body.
pub type Test = (&'static str, fn());

/// Runs the selected tests with libtest's command line (`cargo test`'s
/// `[FILTER] [--exact] [--skip]`, `cargo nextest`'s `--list --format
/// terse` and `NAME --exact`) and exits with its status.
///
/// Every test runs on the main thread, one after the other, whatever
/// `--test-threads` says: forking is only safe in a single-threaded
/// process, and each test checks that it is on the main thread. After each
/// test (passed or not) the leftover checks of [`leftovers`] run.
pub fn run(tests: &[Test]) -> ! {
    let mut args = libtest_mimic::Arguments::from_args();
    // libtest-mimic runs the tests on the calling thread with one thread.
    args.test_threads = Some(1);
    let trials = tests
        .iter()
        .map(|&(name, body)| {
            libtest_mimic::Trial::test(name, move || {
                if nix::unistd::gettid() != nix::unistd::getpid() {
                    return Err("the test does not run on the main thread".into());
                }
                let outcome = catch_unwind(body).map_err(|p| panic_text(&*p));
                match (outcome, leftovers()) {
                    (Ok(()), Ok(())) => Ok(()),
                    (Err(why), Ok(())) | (Ok(()), Err(why)) => Err(why.into()),
                    (Err(why), Err(left)) => Err(format!("{why}\nand after it: {left}").into()),
                }
            })
        })
        .collect();
    libtest_mimic::run(&args, trials).exit()
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".to_owned())
}

/// What a test left behind in this process: descriptors of staged payloads
/// (sealed memfds named [`staging::MEMFD_NAME`]), mappings of one, and
/// children (running, or exited and not reaped; these are reaped here so
/// that the next test starts clean).
pub fn leftovers() -> Result<(), String> {
    let mut problems = Vec::new();
    let fds = staging::open_payloads().map_err(|e| e.to_string())?;
    if !fds.is_empty() {
        problems.push(format!("staged payload descriptors left open: {fds:?}"));
    }
    let maps = payload_mappings()?;
    if !maps.is_empty() {
        problems.push(format!("staged payloads left mapped: {maps:?}"));
    }
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Err(Errno::ECHILD) => break,
            Ok(WaitStatus::StillAlive) => {
                problems.push("a child process is still running".to_owned());
                break;
            }
            Ok(status) => problems.push(format!("an unreaped child: {status:?}")),
            Err(e) => {
                problems.push(format!("waitpid: {e}"));
                break;
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// The lines of `/proc/self/maps` that map a staged payload (a memfd named
/// [`staging::MEMFD_NAME`]).
pub fn payload_mappings() -> Result<Vec<String>, String> {
    let maps =
        std::fs::read_to_string("/proc/self/maps").map_err(|e| format!("/proc/self/maps: {e}"))?;
    let memfd = format!("/memfd:{}", staging::MEMFD_NAME);
    Ok(maps
        .lines()
        .filter(|line| {
            line.split_whitespace()
                .nth(5)
                .is_some_and(|path| path.starts_with(&memfd))
        })
        .map(str::to_owned)
        .collect())
}

/// The identity (device, inode) of the staged payload open as descriptor
/// `fd` in this process.
pub fn payload_identity(fd: i32) -> (u64, u64) {
    let meta = std::fs::metadata(format!("/proc/self/fd/{fd}")).expect("a staged payload");
    use std::os::unix::fs::MetadataExt;
    (meta.dev(), meta.ino())
}

/// Every process on the machine that still holds the staged payload
/// `identity` (as a descriptor or a mapping), as `PID fd N` / `PID maps`.
pub fn payload_holders(identity: (u64, u64)) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let mut holders = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return holders;
    };
    for entry in procs.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        for fd in staging::payloads_of(&name).unwrap_or_default() {
            if let Ok(meta) = std::fs::metadata(format!("/proc/{name}/fd/{fd}")) {
                if (meta.dev(), meta.ino()) == identity {
                    holders.push(format!("{name} fd {fd}"));
                }
            }
        }
        let maps = std::fs::read_to_string(format!("/proc/{name}/maps")).unwrap_or_default();
        let ino = identity.1.to_string();
        if maps.lines().any(|line| {
            line.contains(staging::MEMFD_NAME) && line.split_whitespace().nth(4) == Some(&ino)
        }) {
            holders.push(format!("{name} maps"));
        }
    }
    holders
}

/// Waits (at most 20 s) until `target` is `phase` at incarnation
/// `incarnation` (`specs/protocol.md` §2.9); panics with the target events
/// otherwise.
pub fn wait_for_target<R: callreg::runtime::Runtime>(
    worker: &Worker<R>,
    target: u16,
    phase: callreg::protocol::TargetPhase,
    incarnation: u32,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let id = TargetId(target);
    // One read of both: separate queries could pair a lost process's
    // phase with its replacement's incarnation.
    while worker.target_state(id) != (phase, incarnation) {
        assert!(
            std::time::Instant::now() < deadline,
            "{id} is {:?} at incarnation {}, not {phase:?} at {incarnation}; events {:?}",
            worker.target_phase(id),
            worker.target_incarnation(id),
            worker.target_events()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// An envelope whose payload is a test-runtime instruction.
pub fn envelope(instruction: &str) -> Vec<u8> {
    encode(instruction.as_bytes())
}

/// The digest of `envelope` (a test envelope from [`envelope`]).
pub fn digest_of(envelope: &[u8]) -> callreg::descriptor::Digest {
    let parsed = callreg::envelope::Envelope::parse(envelope).expect("an envelope");
    callreg::descriptor::python_serialized_digest(&parsed)
}

/// A builder with the test runtime, `targets` targets and a 5 s control
/// timeout (tests that need deadlines set their own).
pub fn builder(targets: u16) -> WorkerBuilder<TestRuntime> {
    Worker::builder(Arc::new(TestRuntime))
        .targets(targets)
        .control_timeout(Duration::from_secs(5))
}

/// Asks every live target for its table and checks specs/design.md §4.4's
/// invariants 1–9 on the parent state and the reported tables (a lost
/// target counts as dead). The Worker must be quiescent.
pub fn check_invariants(worker: &Worker<TestRuntime>, targets: u16) {
    let tables = worker.inspect().expect("inspect");
    let parent = worker.parent_state();
    let mut machines: Vec<Option<Target>> = vec![None; usize::from(targets)];
    for (target, table) in tables {
        let table = table.unwrap_or_else(|| panic!("{target} did not report its table"));
        let config = TargetConfig {
            id: target,
            slot_capacity: u16::MAX,
        };
        machines[usize::from(target.0)] =
            Some(Target::new(config, &table.installed).expect("a reported table fits"));
    }
    let borrowed: Vec<Option<&Target>> = machines.iter().map(Option::as_ref).collect();
    let view = View {
        parent: &parent,
        targets: &borrowed,
        frames: &[],
        replies: &[],
    };
    assert!(
        view.is_quiescent(),
        "not quiescent: {:?}",
        parent.in_flight()
    );
    if let Err(violation) = check_all(&view) {
        panic!("invariant violated: {violation:?}");
    }
}

/// The ids `0..n`.
pub fn all_targets(n: u16) -> Vec<TargetId> {
    (0..n).map(TargetId).collect()
}
