//! Replacement targets over real processes (`specs/protocol.md` §2.9):
//! a lost target gets a new process from the template, with the
//! same id and the next incarnation, holding exactly the registry once it
//! joined; a callable that kills every new process stops at the rate
//! limit. Every test ends with no staged payload (memfd descriptor or mapping) and
//! no child left (checked by the runner).

mod io_common;

use std::sync::Arc;
use std::time::Duration;

use callreg::io::worker::{TargetEvent, Worker};
use callreg::protocol::{TargetId, TargetPhase};
use callreg::runtime::testing::TestRuntime;
use callreg::runtime::TaskEncoding;
use io_common::{builder, check_invariants, envelope, wait_for_target};

const ADD_INPUT: &[u8] = br#"{"args": [40, 2], "kwargs": {}}"#;

fn main() {
    io_common::run(&[
        (
            "a_killed_target_is_replaced_and_serves_the_registry",
            a_killed_target_is_replaced_and_serves_the_registry,
        ),
        (
            "a_replacement_killed_while_it_joins_is_replaced_after_the_back_off",
            a_replacement_killed_while_it_joins_is_replaced_after_the_back_off,
        ),
        (
            "a_callable_that_kills_every_new_process_stops_at_the_rate_limit",
            a_callable_that_kills_every_new_process_stops_at_the_rate_limit,
        ),
        (
            "the_parent_keeps_one_sealed_payload_per_live_digest_for_replays",
            the_parent_keeps_one_sealed_payload_per_live_digest_for_replays,
        ),
        (
            "a_hundred_kills_under_load_leave_every_target_holding_the_registry",
            a_hundred_kills_under_load_leave_every_target_holding_the_registry,
        ),
        (
            "closing_with_the_template_stopped_takes_no_report_timeouts",
            closing_with_the_template_stopped_takes_no_report_timeouts,
        ),
        (
            "a_killed_template_is_reaped_and_later_losses_are_abandoned_at_once",
            a_killed_template_is_reaped_and_later_losses_are_abandoned_at_once,
        ),
        (
            "targets_and_the_template_drop_a_pre_start_callables_bytes",
            targets_and_the_template_drop_a_pre_start_callables_bytes,
        ),
    ]);
}

fn kill(worker: &Worker<TestRuntime>, target: u16) -> i32 {
    let pid = worker.target_pid(TargetId(target)).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    pid
}

fn a_killed_target_is_replaced_and_serves_the_registry() {
    let worker = builder(2).build().unwrap();
    let pre = worker.register(&envelope("add")).unwrap();
    worker.start().unwrap();
    let post = worker.register(&envelope("echo")).unwrap();
    let old = kill(&worker, 0);
    wait_for_target(&worker, 0, TargetPhase::Joined, 1);
    let new = worker.target_pid(TargetId(0)).unwrap();
    assert_ne!(new, old);
    let events = worker.target_events();
    assert_eq!(
        events,
        [
            TargetEvent::Lost {
                target: TargetId(0),
                incarnation: 0,
                cause: "its reply socket closed; it was killed by signal 9".to_owned()
            },
            TargetEvent::Spawned {
                target: TargetId(0),
                incarnation: 1,
                pid: new
            },
            TargetEvent::Joined {
                target: TargetId(0),
                incarnation: 1
            },
        ]
    );
    for (target, table) in worker.inspect().unwrap() {
        let table = table.unwrap();
        // The replacement of target 0 reports as incarnation 1.
        assert_eq!(table.incarnation, u32::from(target == TargetId(0)));
        let mut installed = table.installed;
        installed.sort();
        let mut expected = vec![(pre.digest(), 1), (post.digest(), 1)];
        expected.sort();
        assert_eq!(installed, expected);
    }
    check_invariants(&worker, 2);
    assert_eq!(
        worker
            .submit(&pre, TargetId(0), TaskEncoding::Json, ADD_INPUT)
            .unwrap(),
        b"42"
    );
    assert_eq!(
        worker
            .submit(&post, TargetId(0), TaskEncoding::Json, b"7")
            .unwrap(),
        b"7"
    );
    // The other target was never touched.
    assert_eq!(worker.target_incarnation(TargetId(1)), 0);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(worker.target_events(), events, "nothing else happened");
    // A task lost with a replacement names its incarnation.
    let sleep = worker.register(&envelope("sleep 5000")).unwrap();
    let pending = worker.submit_async(&sleep, TargetId(0), TaskEncoding::Json, b"1");
    std::thread::sleep(Duration::from_millis(100));
    kill(&worker, 0);
    let lost = pending.wait().unwrap_err();
    assert_eq!(lost.error.code, callreg::error::ErrorCode::TARGET_LOST);
    assert!(
        lost.error
            .message
            .starts_with("target 0 (incarnation 1) was lost (its "),
        "{}",
        lost.error.message
    );
    wait_for_target(&worker, 0, TargetPhase::Joined, 2);
    worker.close();
}

/// A replay slow enough to be killed in: the replacement is lost before it
/// joined, so the next one waits for the back-off; it joins, and the row
/// of failed joins ends.
fn a_replacement_killed_while_it_joins_is_replaced_after_the_back_off() {
    let worker = builder(2)
        .respawn_backoff(Duration::from_millis(50))
        .build()
        .unwrap();
    let slow = worker.register(&envelope("slow 400")).unwrap();
    worker.start().unwrap();
    kill(&worker, 1);
    wait_for_target(&worker, 1, TargetPhase::Joining, 1);
    let first = kill(&worker, 1);
    wait_for_target(&worker, 1, TargetPhase::Joined, 2);
    let second = worker.target_pid(TargetId(1)).unwrap();
    let killed = |incarnation| TargetEvent::Lost {
        target: TargetId(1),
        incarnation,
        cause: "its reply socket closed; it was killed by signal 9".to_owned(),
    };
    let events = worker.target_events();
    assert_eq!(
        events,
        [
            killed(0),
            TargetEvent::Spawned {
                target: TargetId(1),
                incarnation: 1,
                pid: first
            },
            killed(1),
            TargetEvent::Spawned {
                target: TargetId(1),
                incarnation: 2,
                pid: second
            },
            TargetEvent::Joined {
                target: TargetId(1),
                incarnation: 2
            },
        ]
    );
    assert_eq!(worker.parent_state().failed_joins(TargetId(1)), 0);
    assert_eq!(
        worker
            .submit(&slow, TargetId(1), TaskEncoding::Json, b"1")
            .unwrap(),
        b"1"
    );
    check_invariants(&worker, 2);
    worker.close();
}

/// A pre-start callable whose deserialization ends its process: every
/// target dies at start, and every replacement dies replaying it, until
/// `respawn_limit` of them in a row were lost; then each target stays lost,
/// and says why.
fn a_callable_that_kills_every_new_process_stops_at_the_rate_limit() {
    let worker = builder(2)
        .respawn_limit(3)
        .respawn_backoff(Duration::from_millis(10))
        .build()
        .unwrap();
    worker.register(&envelope("crash")).unwrap();
    let error = worker.start().unwrap_err();
    assert_eq!(
        error.code(),
        callreg::error::ErrorCode::REGISTER_PARTIAL_FAILURE
    );
    for target in 0..2 {
        wait_for_target(&worker, target, TargetPhase::Lost, 3);
    }
    let events = worker.target_events();
    for target in [TargetId(0), TargetId(1)] {
        let of_target: Vec<String> = events
            .iter()
            .filter(|e| match e {
                TargetEvent::Spawned { target: t, .. }
                | TargetEvent::Lost { target: t, .. }
                | TargetEvent::Abandoned { target: t, .. } => *t == target,
                other => panic!("{other:?}"),
            })
            .map(|e| match e {
                TargetEvent::Spawned { incarnation, .. } => format!("spawned {incarnation}"),
                other => other.to_string(),
            })
            .collect();
        let status = callreg::runtime::testing::CRASH_EXIT_CODE;
        let died = |incarnation| {
            format!("{target}: incarnation {incarnation} lost (its reply socket closed; it exited with status {status})")
        };
        assert_eq!(
            of_target,
            [
                format!("{target}: incarnation 0 lost (at start: failed (TARGET_LOST: the target exited with status {status} before it was ready))"),
                "spawned 1".to_owned(),
                died(1),
                "spawned 2".to_owned(),
                died(2),
                "spawned 3".to_owned(),
                died(3),
                format!(
                    "{target}: given up after 3 replacements in a row were lost before they joined"
                ),
            ]
        );
        let loss = worker.target_loss(target).unwrap();
        let status = callreg::runtime::testing::CRASH_EXIT_CODE;
        assert_eq!(
            loss,
            format!(
                "its reply socket closed; it exited with status {status}; given up after 3 replacements in a row were lost before they joined"
            )
        );
    }
    assert_eq!(worker.live_targets(), []);
    let refused = worker.register(&envelope("echo")).unwrap_err();
    assert_eq!(refused.code(), callreg::error::ErrorCode::NO_LIVE_TARGET);
    worker.close();
}

/// With replacements on, the parent keeps the sealed staged payload of
/// each live post-start registration (one descriptor per digest, never
/// mapped), and none once unregistered; the targets keep none.
fn the_parent_keeps_one_sealed_payload_per_live_digest_for_replays() {
    let worker = builder(2).build().unwrap();
    worker.start().unwrap();
    let big = envelope(&format!("echo #{}", "x".repeat(256 * 1024)));
    let first = worker.register(&big).unwrap();
    let second = worker.register(&big).unwrap();
    let other = worker.register(&envelope("add")).unwrap();
    let held = callreg::io::staging::open_payloads().unwrap();
    assert_eq!(held.len(), 2, "{held:?}");
    assert_eq!(
        worker.retained_envelope_bytes(),
        big.len() + envelope("add").len()
    );
    for target in 0..2 {
        let pid = worker.target_pid(TargetId(target)).unwrap().to_string();
        assert_eq!(
            callreg::io::staging::payloads_of(&pid).unwrap(),
            Vec::<i32>::new(),
            "target {target}"
        );
    }
    worker.unregister(&first).unwrap();
    assert_eq!(callreg::io::staging::open_payloads().unwrap().len(), 2);
    worker.unregister(&second).unwrap();
    worker.unregister(&other).unwrap();
    assert_eq!(worker.retained_envelope_bytes(), 0);
    // Closed right after the unregister was answered (its caller does
    // not wait for a large payload's freeing).
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while !callreg::io::staging::open_payloads().unwrap().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "a kept payload stayed open"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    worker.close();
}

/// A small deterministic generator for the stress test's choices.
struct Choices(u64);

impl Choices {
    fn below(&mut self, n: u64) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// 100 `kill -9`s of a random serving target (one already dying is not
/// killed twice) while other threads register,
/// unregister and call: every call on a live handle eventually succeeds
/// (retried on another target when its target was lost under it), and
/// once the kills stop every target serves again holding exactly the
/// registry, with every invariant.
fn a_hundred_kills_under_load_leave_every_target_holding_the_registry() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    const TARGETS: u16 = 3;
    let worker = Arc::new(
        builder(TARGETS)
            .respawn_backoff(Duration::from_millis(5))
            .build()
            .unwrap(),
    );
    let add = worker.register(&envelope("add")).unwrap();
    worker.start().unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicUsize::new(0));
    let retries = Arc::new(AtomicUsize::new(0));
    let caller = {
        let (worker, done, calls, retries) =
            (worker.clone(), done.clone(), calls.clone(), retries.clone());
        std::thread::spawn(move || {
            let mut choices = Choices(0x5eed_0001);
            while !done.load(Ordering::SeqCst) {
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                loop {
                    let live = worker.live_targets();
                    if live.is_empty() {
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    }
                    let target = live[choices.below(live.len() as u64) as usize];
                    match worker.submit(&add, target, TaskEncoding::Json, ADD_INPUT) {
                        Ok(result) => {
                            assert_eq!(result, b"42");
                            break;
                        }
                        Err(error) => {
                            assert_eq!(
                                error.error.code,
                                callreg::error::ErrorCode::TARGET_LOST,
                                "{error:?}"
                            );
                            retries.fetch_add(1, Ordering::SeqCst);
                            assert!(
                                std::time::Instant::now() < deadline,
                                "a call never succeeded"
                            );
                        }
                    }
                }
                calls.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    let registrar = {
        let (worker, done) = (worker.clone(), done.clone());
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            let mut n = 0u64;
            while !done.load(Ordering::SeqCst) {
                n += 1;
                match worker.register(&envelope(&format!("echo #{n}"))) {
                    Ok(handle) => kept.push(handle),
                    // A target lost under the register fails it; killed
                    // while it probed the digest, it poisons the digest
                    // (specs/protocol.md §2.8: a death there is taken for
                    // the payload's).
                    Err(error) => assert!(
                        matches!(
                            error.code(),
                            callreg::error::ErrorCode::REGISTER_PARTIAL_FAILURE
                                | callreg::error::ErrorCode::REGISTER_POISONED
                                | callreg::error::ErrorCode::NO_LIVE_TARGET
                        ),
                        "{error}"
                    ),
                }
                if kept.len() > 4 {
                    let handle = kept.remove(0);
                    // A target killed under the unregister holds nothing:
                    // the handle is released, and the unregister says it
                    // lost a target (specs/protocol.md §2.3).
                    if let Err(error) = worker.unregister(&handle) {
                        assert_eq!(
                            error.code(),
                            callreg::error::ErrorCode::TARGET_LOST,
                            "unregister: {error}"
                        );
                        assert_eq!(
                            worker.unregister(&handle).unwrap_err().code(),
                            callreg::error::ErrorCode::HANDLE_STALE
                        );
                    }
                }
            }
            kept
        })
    };
    let mut choices = Choices(0x5eed_0002);
    let mut killed = std::collections::BTreeSet::new();
    for _ in 0..100 {
        // A serving target (a kill during its join would count against
        // the target's rate limit).
        let live = loop {
            let live = worker.live_targets();
            if !live.is_empty() {
                break live;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let target = live[choices.below(live.len() as u64) as usize];
        // It may have died under a kill the Worker has not noticed yet.
        let pid = worker.target_pid(target).unwrap();
        match nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        ) {
            Ok(()) => {
                killed.insert(pid);
            }
            Err(nix::errno::Errno::ESRCH) => {}
            Err(errno) => panic!("kill {pid}: {errno}"),
        }
        std::thread::sleep(Duration::from_millis(choices.below(30)));
    }
    done.store(true, Ordering::SeqCst);
    caller.join().unwrap();
    let kept = registrar.join().unwrap();
    let incarnations: u32 = (0..TARGETS)
        .map(|t| worker.target_incarnation(TargetId(t)))
        .sum();
    // Every process killed was serving: each loss was replaced once, at
    // once (none counted against the rate limit).
    assert_eq!(
        usize::try_from(incarnations).unwrap(),
        killed.len(),
        "replacements for the processes killed"
    );
    assert!(killed.len() >= 50, "only {} processes killed", killed.len());
    for target in 0..TARGETS {
        let incarnation = worker.target_incarnation(TargetId(target));
        wait_for_target(&worker, target, TargetPhase::Joined, incarnation);
    }
    let mut registry: Vec<_> = kept.iter().map(|h| (h.digest(), 1)).collect();
    registry.push((add.digest(), 1));
    registry.sort();
    for (target, table) in worker.inspect().unwrap() {
        let mut installed = table.unwrap().installed;
        installed.sort();
        assert_eq!(installed, registry, "{target}");
    }
    check_invariants(&worker, TARGETS);
    assert!(calls.load(Ordering::SeqCst) > 0);
    eprintln!(
        "{} calls, {} retried after a loss, {incarnations} replacements",
        calls.load(Ordering::SeqCst),
        retries.load(Ordering::SeqCst)
    );
    match Arc::try_unwrap(worker) {
        Ok(worker) => worker.close(),
        Err(_) => panic!("the Worker is still shared"),
    }
}

/// The child processes of this process (any thread's).
/// Resident memory of process `pid`, in bytes.
fn resident(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// A large callable registered before start is inherited by every
/// target (and the template) through `fork`; each drops its bytes once
/// installed (the template at once: replacements get it by replay), so
/// none keeps it for its life. The parent keeps it for replays.
fn targets_and_the_template_drop_a_pre_start_callables_bytes() {
    const BIG: u64 = 48 << 20;
    let worker = builder(2).build().unwrap();
    let handle = worker
        .register(&envelope(&format!("echo #{}", "x".repeat(BIG as usize))))
        .unwrap();
    worker.start().unwrap();
    let targets: Vec<i32> = (0..2)
        .map(|t| worker.target_pid(TargetId(t)).unwrap())
        .collect();
    let template: Vec<i32> = children()
        .into_iter()
        .filter(|pid| !targets.contains(pid))
        .collect();
    assert_eq!(template.len(), 1, "{template:?}");
    for pid in targets.iter().chain(&template) {
        // The template drops them as it starts: give it a moment.
        let dropped = (0..500).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            resident(*pid) < BIG / 2
        });
        assert!(dropped, "process {pid} holds {} bytes", resident(*pid));
    }
    assert!(worker.retained_envelope_bytes() as u64 > BIG);
    // It serves, and a replacement gets it by replay.
    kill(&worker, 0);
    wait_for_target(&worker, 0, TargetPhase::Joined, 1);
    for target in 0..2 {
        let echoed = worker
            .submit(&handle, TargetId(target), TaskEncoding::Json, b"[5]")
            .unwrap();
        assert_eq!(echoed, b"[5]");
    }
    check_invariants(&worker, 2);
    worker.close();
}

fn children() -> Vec<i32> {
    let mut pids = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let path = task.unwrap().path().join("children");
        if let Ok(text) = std::fs::read_to_string(path) {
            pids.extend(text.split_whitespace().map(|p| p.parse::<i32>().unwrap()));
        }
    }
    pids
}

/// A stopped template answers no exit report: the Worker's close kills it
/// at once and counts each ended replacement's report as lost after a
/// short grace, instead of waiting out the report timeout (5 s) for the
/// template and for each replacement.
fn closing_with_the_template_stopped_takes_no_report_timeouts() {
    let worker = builder(3).build().unwrap();
    worker.start().unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    for target in 0..3 {
        kill(&worker, target);
        wait_for_target(&worker, target, TargetPhase::Joined, 1);
    }
    // Every target is now a replacement, a child of the template: the
    // template is this process's only child.
    let template = children();
    assert_eq!(template.len(), 1, "{template:?}");
    let template = nix::unistd::Pid::from_raw(template[0]);
    for target in 0..3 {
        assert_eq!(
            worker
                .submit(&echo, TargetId(target), TaskEncoding::Json, b"1")
                .unwrap(),
            b"1"
        );
    }
    nix::sys::signal::kill(template, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let began = std::time::Instant::now();
    worker.close();
    let took = began.elapsed();
    // Before: 5 s for the template and 5 s more per replacement.
    // Now: the template is killed at once, and each ended replacement's
    // report is given up after `zygote::ENDED_REPORT_GRACE` (250 ms).
    assert!(took < Duration::from_secs(2), "close took {took:?}");
    assert!(children().is_empty(), "{:?}", children());
}

/// A killed template is reaped when its loss is seen (not left a zombie
/// until close), recorded as an event, and every target lost from then on is
/// abandoned at once, without back-offs or spawns that cannot succeed
/// (`specs/protocol.md` §2.9, "Replacements ended").
fn a_killed_template_is_reaped_and_later_losses_are_abandoned_at_once() {
    let worker = builder(3)
        .respawn_backoff(Duration::from_secs(30))
        .build()
        .unwrap();
    worker.start().unwrap();
    kill(&worker, 0);
    wait_for_target(&worker, 0, TargetPhase::Joined, 1);
    // Targets 1 and 2 are this process's children, and so is the
    // template, the parent of target 0's replacement.
    let live: Vec<i32> = (0..3)
        .map(|t| worker.target_pid(TargetId(t)).unwrap())
        .collect();
    let template: Vec<i32> = children()
        .into_iter()
        .filter(|p| !live.contains(p))
        .collect();
    assert_eq!(template.len(), 1, "{template:?} beside {live:?}");
    let template = template[0];
    let before = worker.target_events().len();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(template),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // The replacement dies with its template (its parent-death signal);
    // the next spawn finds the template gone.
    wait_for_target(&worker, 0, TargetPhase::Lost, 2);
    let events: Vec<String> = worker.target_events()[before..]
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        events[events.len() - 3..],
        [
            "replacements ended: template process lost (it was killed by signal 9)".to_owned(),
            "target 0: incarnation 2 could not be started: the template process of replacement targets is gone: no more targets can be forked from it".to_owned(),
            "target 0: given up after 1 replacements in a row were lost before they joined".to_owned(),
        ],
        "{events:?}"
    );
    assert!(!children().contains(&template), "{template} not reaped");
    // A later loss is abandoned at once: no spawn, no back-off.
    let before = worker.target_events().len();
    kill(&worker, 1);
    wait_for_target(&worker, 1, TargetPhase::Lost, 0);
    let events: Vec<String> = worker.target_events()[before..]
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(
        events[0].starts_with("target 1: incarnation 0 lost ("),
        "{events:?}"
    );
    assert_eq!(
        events[1],
        "target 1: given up after 0 replacements in a row were lost before they joined"
    );
    worker.close();
    assert!(children().is_empty(), "{:?}", children());
}
