//! Fault injection over real processes: every fail point × {pre-start
//! register, post-start register, duplicate register, unregister, task},
//! with an injected error and with an abrupt exit; parent crashes; damaged
//! staged payloads; malformed and oversized control frames; deadlines.
//!
//! Target fail points are set in target 1 of 3 only, through
//! `CALLREG_FAILPOINTS_TARGET_1` (applied right after fork); parent fail
//! points with `fail::cfg` in this process. After every case: the error
//! names target 1 and lists every target's outcome, the protocol's
//! invariants hold on the parent state and the targets' reported tables,
//! and the surviving targets accept a new register and run a task. The
//! runner checks that no staged payload and no child is left.
//!
//! A `harness = false` binary (see `tests/io_common/mod.rs`), run by
//! `cargo test --features failpoints` or `cargo nextest`.

mod io_common;

use std::time::{Duration, Instant};

use callreg::error::ErrorCode;
use callreg::io::failpoints::{self, target_env_var, ABRUPT_EXIT_CODE};
use callreg::io::process::Exit;
use callreg::io::staging;
use callreg::protocol::{Handle, TargetId, TargetOutcome};
use callreg::runtime::testing::TestRuntime;
use callreg::runtime::TaskEncoding;
use callreg::wire::{Frame, DEFAULT_MAX_FRAME_BYTES};
use io_common::{check_invariants, digest_of, envelope};

/// The test Worker builder with replacement targets off: these cases
/// check how a faulty target is lost (its replacement would inherit the
/// same fail points; replacements are tested in `io_respawn`).
fn builder(
    targets: u16,
) -> callreg::io::worker::WorkerBuilder<callreg::runtime::testing::TestRuntime> {
    io_common::builder(targets).respawn_limit(0)
}

const ADD_INPUT: &[u8] = br#"{"args": [40, 2], "kwargs": {}}"#;
const TARGETS: u16 = 3;
const FAULTY: TargetId = TargetId(1);

fn main() {
    io_common::run(&[
        (
            "target_fail_points_inject_errors",
            target_fail_points_inject_errors,
        ),
        (
            "a_start_right_after_a_worker_with_a_crash_closed_forks",
            a_start_right_after_a_worker_with_a_crash_closed_forks,
        ),
        (
            "target_fail_points_end_the_target",
            target_fail_points_end_the_target,
        ),
        (
            "parent_after_stage_fails_the_register_only",
            parent_after_stage_fails_the_register_only,
        ),
        (
            "parent_before_publish_delay_changes_nothing",
            parent_before_publish_delay_changes_nothing,
        ),
        (
            "a_killed_parent_leaves_no_staged_payload",
            a_killed_parent_leaves_no_staged_payload,
        ),
        (
            "parent_crash_before_publish_takes_its_targets_along",
            parent_crash_before_publish_takes_its_targets_along,
        ),
        (
            "a_delayed_reply_past_the_deadline_is_fenced",
            a_delayed_reply_past_the_deadline_is_fenced,
        ),
        (
            "a_staged_payload_cannot_be_changed_after_sealing",
            a_staged_payload_cannot_be_changed_after_sealing,
        ),
        (
            "malformed_and_oversized_control_frames_end_only_that_target",
            malformed_and_oversized_control_frames_end_only_that_target,
        ),
    ]);
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Scenario {
    PreStartRegister,
    PostStartRegister,
    DuplicateRegister,
    Unregister,
    Task,
}

const SCENARIOS: [Scenario; 5] = [
    Scenario::PreStartRegister,
    Scenario::PostStartRegister,
    Scenario::DuplicateRegister,
    Scenario::Unregister,
    Scenario::Task,
];

const TARGET_POINTS: [&str; 5] = [
    failpoints::TARGET_BEFORE_INSTALL,
    failpoints::TARGET_AFTER_INSTALL,
    failpoints::TARGET_BEFORE_UNREGISTER,
    failpoints::TARGET_DESERIALIZE,
    failpoints::TARGET_REPLY_DELAY,
];

/// How often `point` is hit in target 1 while a scenario sets up (before
/// the operation under test), and whether the operation hits it.
fn hits(point: &str, scenario: Scenario) -> (usize, bool) {
    let with_snapshot = matches!(
        scenario,
        Scenario::DuplicateRegister | Scenario::Unregister | Scenario::Task
    );
    let setup = match point {
        failpoints::TARGET_REPLY_DELAY => usize::from(scenario != Scenario::PreStartRegister),
        failpoints::TARGET_BEFORE_UNREGISTER => 0,
        _ => usize::from(with_snapshot),
    };
    let in_op = match point {
        failpoints::TARGET_REPLY_DELAY => true,
        failpoints::TARGET_BEFORE_UNREGISTER => scenario == Scenario::Unregister,
        failpoints::TARGET_DESERIALIZE => {
            matches!(
                scenario,
                Scenario::PreStartRegister | Scenario::PostStartRegister
            )
        }
        _ => matches!(
            scenario,
            Scenario::PreStartRegister | Scenario::PostStartRegister | Scenario::DuplicateRegister
        ),
    };
    (setup, in_op)
}

/// What target 1 does when the point is hit: `None` = it crashes, else
/// the code of its error reply.
fn effect(point: &str, abrupt: bool) -> Option<ErrorCode> {
    match point {
        _ if abrupt => None,
        failpoints::TARGET_AFTER_INSTALL | failpoints::TARGET_REPLY_DELAY => None,
        failpoints::TARGET_DESERIALIZE => Some(ErrorCode::DESERIALIZE_FAILED),
        _ => Some(ErrorCode::IO_FAILED),
    }
}

fn target_fail_points_inject_errors() {
    for point in TARGET_POINTS {
        for scenario in SCENARIOS {
            run_case(point, scenario, false);
        }
    }
}

/// A Worker whose target crashed closes, and the next one starts at once:
/// the closed Worker's threads were joined, though the kernel may list
/// one for a moment longer, which must not count as a running thread.
fn a_start_right_after_a_worker_with_a_crash_closed_forks() {
    for _ in 0..40 {
        run_case(
            failpoints::TARGET_BEFORE_INSTALL,
            Scenario::PreStartRegister,
            true,
        );
    }
}

fn target_fail_points_end_the_target() {
    for point in TARGET_POINTS {
        for scenario in SCENARIOS {
            run_case(point, scenario, true);
        }
    }
}

/// Sets `var` for the next start only.
struct EnvGuard(String);

impl EnvGuard {
    fn set(var: String, value: &str) -> EnvGuard {
        std::env::set_var(&var, value);
        EnvGuard(var)
    }
}

impl Drop for EnvGuard {
    fn drop(&mut self) {
        std::env::remove_var(&self.0);
    }
}

fn run_case(point: &str, scenario: Scenario, abrupt: bool) {
    let case = format!(
        "{point} × {scenario:?} × {}",
        if abrupt { "exit" } else { "error" }
    );
    let (setup_hits, in_op) = hits(point, scenario);
    let action = if abrupt {
        "return(exit)"
    } else {
        "return(injected)"
    };
    // Fires once, at the operation under test; off afterwards, so the
    // survivors' check runs clean.
    let spec = if setup_hits == 0 {
        format!("{point}=1*{action}")
    } else {
        format!("{point}={setup_hits}*off->1*{action}")
    };
    let worker = builder(TARGETS).build().unwrap();
    let _env = EnvGuard::set(target_env_var(usize::from(FAULTY.0)), &spec);
    let hit = if in_op {
        effect(point, abrupt)
    } else {
        Some(ErrorCode::LOCAL_SLOT_EXHAUSTED)
    };
    // `hit`: None = target 1 crashes in the operation; Some(c) = it replies
    // error c; LOCAL_SLOT_EXHAUSTED stands for "not hit" here (never
    // produced by these cases).
    let not_hit = !in_op;
    let others_ok = |outcomes: &[(TargetId, TargetOutcome)], expected: TargetOutcome| {
        for (target, outcome) in outcomes {
            if *target != FAULTY {
                assert_eq!(*outcome, expected, "{case}: {target}");
            }
        }
    };
    let mut crashed = false;
    match scenario {
        Scenario::PreStartRegister => {
            worker.register(&envelope("echo")).unwrap();
            let result = worker.start();
            if not_hit {
                let report = result.unwrap_or_else(|e| panic!("{case}: {e}"));
                assert!(report.is_complete(), "{case}: {report:?}");
            } else if let Some(code) = hit {
                // An entry the target refused fails that registration
                // only: every target starts, and the others drop it.
                let report = result.unwrap_or_else(|e| panic!("{case}: {e}"));
                others_ok(&report.outcomes, TargetOutcome::Ok);
                assert_eq!(report.outcomes[1], (FAULTY, TargetOutcome::Ok), "{case}");
                assert_eq!(report.failed.len(), 1, "{case}: {report:?}");
                let failures = &report.failed[0].failures;
                assert_eq!(failures.len(), 1, "{case}: {report:?}");
                assert_eq!(
                    (failures[0].0, failures[0].1.code),
                    (FAULTY, code),
                    "{case}"
                );
                assert!(worker.parent_state().live_handles().is_empty(), "{case}");
            } else {
                let err = result.unwrap_err();
                assert_eq!(err.code(), ErrorCode::REGISTER_PARTIAL_FAILURE, "{case}");
                assert_eq!(err.error.target, Some(FAULTY), "{case}");
                assert!(err.to_string().contains("target 1"), "{case}: {err}");
                assert_eq!(err.outcomes.len(), usize::from(TARGETS), "{case}");
                others_ok(&err.outcomes, TargetOutcome::Ok);
                let expected = hit.unwrap_or(ErrorCode::TARGET_LOST);
                match &err.outcomes[1].1 {
                    TargetOutcome::Failed { failure } => {
                        assert_eq!(failure.code, expected, "{case}: {failure}")
                    }
                    other => panic!("{case}: {other:?}"),
                }
                crashed = true;
            }
        }
        Scenario::PostStartRegister | Scenario::DuplicateRegister => {
            if scenario == Scenario::DuplicateRegister {
                worker.register(&envelope("echo")).unwrap();
            }
            worker.start().unwrap_or_else(|e| panic!("{case}: {e}"));
            let result = worker.register(&envelope("echo"));
            if not_hit {
                result.unwrap_or_else(|e| panic!("{case}: {e}"));
            } else {
                let err = result.unwrap_err();
                assert_eq!(err.code(), ErrorCode::REGISTER_PARTIAL_FAILURE, "{case}");
                assert!(err.to_string().contains("target 1"), "{case}: {err}");
                assert_eq!(err.outcomes.len(), usize::from(TARGETS), "{case}");
                others_ok(&err.outcomes, TargetOutcome::RolledBack);
                match (hit, &err.outcomes[1].1) {
                    (None, TargetOutcome::Lost) => crashed = true,
                    (Some(code), TargetOutcome::Failed { failure }) => {
                        assert_eq!(failure.code, code, "{case}")
                    }
                    (expected, got) => panic!("{case}: expected {expected:?}, got {got:?}"),
                }
            }
        }
        Scenario::Unregister => {
            let handle = worker.register(&envelope("echo")).unwrap();
            worker.start().unwrap_or_else(|e| panic!("{case}: {e}"));
            let result = worker.unregister(&handle);
            match (not_hit, hit) {
                (true, _) => result.unwrap_or_else(|e| panic!("{case}: {e}")),
                // A target lost during an unregister holds nothing: the
                // handle is released, and the unregister says it lost one.
                (false, None) => {
                    let err = result.unwrap_err();
                    assert_eq!(err.code(), ErrorCode::TARGET_LOST, "{case}: {err}");
                    assert_eq!(
                        err.outcomes.iter().find(|(t, _)| *t == FAULTY),
                        Some(&(FAULTY, TargetOutcome::Lost)),
                        "{case}: {err}"
                    );
                    crashed = true;
                }
                (false, Some(code)) => {
                    let err = result.unwrap_err();
                    assert_eq!(err.code(), ErrorCode::UNREGISTER_PARTIAL_FAILURE, "{case}");
                    assert!(err.to_string().contains("target 1"), "{case}: {err}");
                    others_ok(&err.outcomes, TargetOutcome::Ok);
                    assert!(
                        matches!(&err.outcomes[1].1, TargetOutcome::Failed { failure } if failure.code == code),
                        "{case}: {:?}",
                        err.outcomes
                    );
                    // Parent and target disagree now: the digest is uncertain.
                    assert!(
                        worker.parent_state().is_uncertain(handle.digest()),
                        "{case}"
                    );
                }
            }
        }
        Scenario::Task => {
            let handle = worker.register(&envelope("echo")).unwrap();
            worker.start().unwrap_or_else(|e| panic!("{case}: {e}"));
            let result = worker.submit(&handle, FAULTY, TaskEncoding::Json, b"x");
            match (not_hit, hit) {
                (true, _) | (false, Some(_)) => assert_eq!(result.unwrap(), b"x", "{case}"),
                (false, None) => {
                    let err = result.unwrap_err();
                    assert_eq!(err.error.code, ErrorCode::TARGET_LOST, "{case}");
                    assert_eq!(err.error.target, Some(FAULTY), "{case}");
                    crashed = true;
                }
            }
        }
    }
    check_state(&worker, crashed, &case);
    if !in_op && point != failpoints::TARGET_BEFORE_UNREGISTER {
        // Still armed, since the operation did not pass through it: the
        // next register trips it at target 1 (and only there).
        let err = worker.register(&envelope("add #armed")).unwrap_err();
        assert_eq!(err.code(), ErrorCode::REGISTER_PARTIAL_FAILURE, "{case}");
        others_ok(&err.outcomes, TargetOutcome::RolledBack);
        match (effect(point, abrupt), &err.outcomes[1].1) {
            (None, TargetOutcome::Lost) => crashed = true,
            (Some(code), TargetOutcome::Failed { failure }) if failure.code == code => {}
            (expected, got) => panic!("{case}: armed: expected {expected:?}, got {got:?}"),
        }
        check_state(&worker, crashed, &case);
    }
    survivors_work(&worker, &case);
}

/// Live targets, target 1's exit, and the invariants after a case.
fn check_state(worker: &callreg::io::Worker<TestRuntime>, crashed: bool, case: &str) {
    let expected_live: Vec<TargetId> = (0..TARGETS)
        .map(TargetId)
        .filter(|t| !crashed || *t != FAULTY)
        .collect();
    assert_eq!(worker.live_targets(), expected_live, "{case}");
    if crashed {
        let exit = worker.target_exit(FAULTY);
        assert!(
            matches!(
                exit,
                Some(Exit::Code(ABRUPT_EXIT_CODE)) | Some(Exit::Code(104))
            ),
            "{case}: {exit:?}"
        );
    }
    check_invariants(worker, TARGETS);
}

/// The live targets accept a new register and run a task on it.
fn survivors_work(worker: &callreg::io::Worker<TestRuntime>, case: &str) {
    let add = worker
        .register(&envelope("add #after"))
        .unwrap_or_else(|e| panic!("{case}: register after the fault: {e}"));
    for (target, result) in worker.submit_to_every(&add, TaskEncoding::Json, ADD_INPUT) {
        assert_eq!(
            result.unwrap_or_else(|e| panic!("{case}: {target}: {e}")),
            b"42"
        );
    }
    check_invariants(worker, TARGETS);
}

/// Configures a parent fail point for one test.
struct PointGuard(&'static str);

impl PointGuard {
    fn set(point: &'static str, actions: &str) -> PointGuard {
        fail::cfg(point, actions).unwrap();
        PointGuard(point)
    }
}

impl Drop for PointGuard {
    fn drop(&mut self) {
        fail::remove(self.0);
    }
}

fn parent_after_stage_fails_the_register_only() {
    for scenario in SCENARIOS {
        let case = format!("parent.after_stage × {scenario:?}");
        let worker = builder(TARGETS).build().unwrap();
        let point = PointGuard::set(failpoints::PARENT_AFTER_STAGE, "return(injected)");
        let pre: Handle = worker.register(&envelope("echo")).unwrap();
        worker.start().unwrap_or_else(|e| panic!("{case}: {e}"));
        match scenario {
            Scenario::PreStartRegister => {}
            Scenario::PostStartRegister | Scenario::DuplicateRegister => {
                let instruction = if scenario == Scenario::DuplicateRegister {
                    "echo"
                } else {
                    "add"
                };
                let err = worker.register(&envelope(instruction)).unwrap_err();
                assert_eq!(err.code(), ErrorCode::IO_FAILED, "{case}");
                assert_eq!(
                    err.error.message, "fail point parent.after_stage: injected",
                    "{case}"
                );
                assert_eq!(err.outcomes, vec![], "{case}: no target saw the register");
            }
            Scenario::Unregister => worker.unregister(&pre).unwrap(),
            Scenario::Task => assert_eq!(
                worker
                    .submit(&pre, FAULTY, TaskEncoding::Json, b"t")
                    .unwrap(),
                b"t"
            ),
        }
        assert_eq!(worker.live_targets().len(), usize::from(TARGETS), "{case}");
        check_invariants(&worker, TARGETS);
        drop(point);
        survivors_work(&worker, &case);
    }
}

fn parent_before_publish_delay_changes_nothing() {
    let _point = PointGuard::set(failpoints::PARENT_BEFORE_PUBLISH, "sleep(20)");
    let worker = builder(TARGETS).build().unwrap();
    let pre = worker.register(&envelope("echo")).unwrap();
    worker.start().unwrap();
    let started = Instant::now();
    let dup = worker.register(&envelope("echo")).unwrap();
    assert!(started.elapsed() >= Duration::from_millis(20));
    worker.unregister(&pre).unwrap();
    assert_eq!(
        worker
            .submit(&dup, FAULTY, TaskEncoding::Json, b"d")
            .unwrap(),
        b"d"
    );
    check_invariants(&worker, TARGETS);
    survivors_work(&worker, "parent.before_publish × delay");
}

/// Runs `body` in a forked child acting as a Worker's parent; returns the
/// child's pid and how it ended, plus the target pids it reported.
/// Reports the target pids of a Worker running in a child parent.
/// The child's exit status, or minus the signal that ended it.
type ReportPids<'a> = &'a dyn Fn(&[i64]);

fn in_child_parent(body: fn(ReportPids<'_>)) -> (i32, i32, Vec<i64>) {
    let (read, write) = nix::unistd::pipe().unwrap();
    // SAFETY: this test binary runs tests on its single main thread.
    match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => {
            drop(read);
            let report = move |pids: &[i64]| {
                let text: Vec<String> = pids.iter().map(i64::to_string).collect();
                let _ = nix::unistd::write(&write, format!("{}\n", text.join(" ")).as_bytes());
            };
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&report)));
            // SAFETY: the child never returns into the test runner.
            unsafe { libc::_exit(1) }
        }
        nix::unistd::ForkResult::Parent { child } => {
            drop(write);
            let status = nix::sys::wait::waitpid(child, None).unwrap();
            let code = match status {
                nix::sys::wait::WaitStatus::Exited(_, code) => code,
                nix::sys::wait::WaitStatus::Signaled(_, signal, _) => -(signal as i32),
                other => panic!("child parent ended with {other:?}"),
            };
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::fs::File::from(read), &mut text).unwrap();
            let pids = text
                .split_whitespace()
                .map(|p| p.parse().unwrap())
                .collect();
            (child.as_raw(), code, pids)
        }
    }
}

/// Waits until every pid is gone (killed by PR_SET_PDEATHSIG, reaped by init).
fn assert_all_gone(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    for pid in pids {
        let pid = nix::unistd::Pid::from_raw(*pid);
        while nix::sys::signal::kill(pid, None).is_ok() && !is_zombie(pid.as_raw()) {
            assert!(
                Instant::now() < deadline,
                "target {pid} outlived its parent"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A dead process not yet reaped by its new parent (init) counts as gone.
fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            stat.rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

/// A parent SIGKILLed in the middle of a register (both targets hold the
/// staged payload's mapping, paused before installing it) leaves nothing:
/// its targets die with it, and no process on the machine holds the
/// payload afterwards (no descriptor, no mapping, no name).
fn a_killed_parent_leaves_no_staged_payload() {
    let (_, code, reported) = in_child_parent(|report| {
        for index in 0..2 {
            std::env::set_var(
                target_env_var(index),
                format!("{}=sleep(10000)", failpoints::TARGET_BEFORE_INSTALL),
            );
        }
        // Probe-first off: both targets get the register at once.
        let worker = builder(2).probe_first(false).build().unwrap();
        worker.start().unwrap();
        let pids = [
            worker.target_pid(TargetId(0)).unwrap(),
            worker.target_pid(TargetId(1)).unwrap(),
        ];
        // Over `COPY_MAX_BYTES`: the targets map it rather than copy it.
        let mut instruction = "echo #".to_owned();
        instruction.extend(std::iter::repeat_n('x', staging::COPY_MAX_BYTES as usize));
        let _pending = worker.register_async(&envelope(&instruction)).unwrap();
        let fds = staging::open_payloads().unwrap();
        if fds.len() != 1 {
            // SAFETY: the child never returns into the test runner.
            unsafe { libc::_exit(3) }
        }
        let identity = io_common::payload_identity(fds[0]);
        // Both targets have mapped it before the kill.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let holders = io_common::payload_holders(identity);
            if pids.iter().all(|p| holders.contains(&format!("{p} maps"))) {
                break;
            }
            if Instant::now() > deadline {
                // SAFETY: as above.
                unsafe { libc::_exit(4) }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        report(&[
            i64::from(pids[0]),
            i64::from(pids[1]),
            identity.0 as i64,
            identity.1 as i64,
        ]);
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    });
    assert_eq!(code, -9, "the child parent ended with {code}");
    assert_eq!(reported.len(), 4, "{reported:?}");
    let pids: Vec<i32> = reported[..2].iter().map(|p| *p as i32).collect();
    assert_all_gone(&pids);
    let identity = (reported[2] as u64, reported[3] as u64);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let holders = io_common::payload_holders(identity);
        if holders.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the staged payload outlived its parent: {holders:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn parent_crash_before_publish_takes_its_targets_along() {
    let (_, code, pids) = in_child_parent(|report| {
        let worker = builder(2).build().unwrap();
        worker.start().unwrap();
        report(&[
            i64::from(worker.target_pid(TargetId(0)).unwrap()),
            i64::from(worker.target_pid(TargetId(1)).unwrap()),
        ]);
        fail::cfg(failpoints::PARENT_BEFORE_PUBLISH, "return(exit)").unwrap();
        let _ = worker.register(&envelope("echo"));
    });
    assert_eq!(code, ABRUPT_EXIT_CODE);
    let pids: Vec<i32> = pids.iter().map(|p| *p as i32).collect();
    assert_all_gone(&pids);
}

/// A reply delayed past the operation timeout is fenced at that bound,
/// though its target kept reporting alive meanwhile.
fn a_delayed_reply_past_the_deadline_is_fenced() {
    let _env = EnvGuard::set(
        target_env_var(usize::from(FAULTY.0)),
        &format!("{}=1*off->sleep(3000)", failpoints::TARGET_REPLY_DELAY),
    );
    let worker = builder(TARGETS)
        .control_timeout(Duration::from_millis(300))
        .operation_timeout(Duration::from_millis(900))
        .build()
        .unwrap();
    worker.start().unwrap();
    let err = worker.register(&envelope("echo")).unwrap_err();
    assert_eq!(err.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(
        err.outcomes,
        vec![
            (TargetId(0), TargetOutcome::RolledBack),
            (TargetId(1), TargetOutcome::Fenced),
            (TargetId(2), TargetOutcome::RolledBack),
        ]
    );
    assert_eq!(worker.target_exit(FAULTY), Some(Exit::Signal(9)));
    assert!(worker.parent_state().uncertain_digests().is_empty());
    assert_eq!(worker.live_targets(), vec![TargetId(0), TargetId(2)]);
    check_invariants(&worker, TARGETS);
    survivors_work(&worker, "reply_delay past the deadline");
}

/// A staged payload is sealed before any control names it: paused
/// between staging and the register controls, another open of the same
/// file (read-write, through `/proc`) can neither truncate, grow, rewrite
/// nor map it writable, and the register then installs what was staged.
fn a_staged_payload_cannot_be_changed_after_sealing() {
    let worker = builder(TARGETS).build().unwrap();
    worker.start().unwrap();
    let point = PointGuard::set(failpoints::PARENT_AFTER_STAGE, "pause");
    // A register carries out its effects in the registering thread: it
    // pauses there, right after staging.
    let worker = std::sync::Arc::new(worker);
    let registering = {
        let worker = worker.clone();
        std::thread::spawn(move || worker.register(&envelope("echo")))
    };
    let fds = loop {
        let fds = staging::open_payloads().unwrap();
        if !fds.is_empty() || registering.is_finished() {
            break fds;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    assert_eq!(fds.len(), 1, "{fds:?}");
    let path = format!("/proc/self/fd/{}", fds[0]);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let len = file.metadata().unwrap().len();
    let eperm = Some(libc::EPERM);
    assert_eq!(file.set_len(len - 1).unwrap_err().raw_os_error(), eperm);
    assert_eq!(file.set_len(len + 1).unwrap_err().raw_os_error(), eperm);
    let other = envelope("eval");
    assert_eq!(
        std::io::Write::write(&mut file, &other)
            .unwrap_err()
            .raw_os_error(),
        eperm
    );
    // SAFETY: a writable shared mapping is requested only to see it refused.
    let mapped = unsafe { memmap2::MmapMut::map_mut(&file) };
    assert_eq!(mapped.unwrap_err().raw_os_error(), eperm);
    drop(file);
    drop(point);
    let handle = registering.join().unwrap().unwrap();
    assert_eq!(handle.digest(), digest_of(&envelope("echo")));
    survivors_work(&worker, "sealed staging");
    check_invariants(&worker, TARGETS);
}

fn malformed_and_oversized_control_frames_end_only_that_target() {
    for (what, bytes) in [
        ("garbage", b"\x07not a frame at all".to_vec()),
        ("oversized", {
            let mut header = vec![1u8, 3, 0, 0];
            header.extend_from_slice(&u32::MAX.to_le_bytes());
            header
        }),
        (
            "a parent-bound frame",
            Frame::Table {
                seq: 1,
                tombstones: 0,
                entries: vec![],
            }
            .encode(DEFAULT_MAX_FRAME_BYTES)
            .unwrap(),
        ),
    ] {
        let worker = builder(TARGETS).build().unwrap();
        let echo = worker.register(&envelope("echo")).unwrap();
        worker.start().unwrap();
        worker.inject_control_bytes(FAULTY, bytes);
        let err = worker
            .submit(&echo, FAULTY, TaskEncoding::Json, b"x")
            .unwrap_err();
        assert_eq!(err.error.code, ErrorCode::TARGET_LOST, "{what}");
        assert_eq!(
            worker.target_exit(FAULTY),
            Some(Exit::Code(callreg::io::target::FRAME_EXIT_CODE)),
            "{what}"
        );
        let loss = worker.target_loss(FAULTY).unwrap();
        assert!(
            loss.ends_with("; it exited with status 105"),
            "{what}: {loss}"
        );
        assert_eq!(
            worker.live_targets(),
            vec![TargetId(0), TargetId(2)],
            "{what}"
        );
        check_invariants(&worker, TARGETS);
        survivors_work(&worker, what);
    }
}
