//! The Worker over real forked targets, sealed staged payloads, control
//! sockets and reply sockets, with the test runtime
//! (`callreg::runtime::testing`).
//!
//! A `harness = false` binary (see `tests/io_common/mod.rs`): each test
//! runs on the main thread, so forking is safe under plain `cargo test`;
//! `cargo nextest` runs each test in its own process. Every test ends with
//! no staged payload left and no child left (checked by the runner).

mod io_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use callreg::error::{ErrorCode, OperationKind};
use callreg::io::process::Exit;
use callreg::io::worker::TargetEvent;
use callreg::io::PendingTask;
use callreg::protocol::{TargetId, TargetOutcome};
use callreg::runtime::testing::{deserialize_count, TestRuntime};
use callreg::runtime::TaskEncoding;
use io_common::{builder, check_invariants, envelope};

const ADD_INPUT: &[u8] = br#"{"args": [40, 2], "kwargs": {}}"#;

/// Set for this binary run as the Worker of [`NAMESPACE_REGISTERS`] inside
/// its own pid namespace.
const NAMESPACE_CHILD_VAR: &str = "CALLREG_TEST_NAMESPACE_WORKER";

/// Registers the pid-namespace Worker makes.
const NAMESPACE_REGISTERS: usize = 33;

fn main() {
    if std::env::var_os(NAMESPACE_CHILD_VAR).is_some() {
        std::process::exit(namespace_worker());
    }
    io_common::run(&[
        (
            "the_leftover_checks_see_payloads_mappings_and_children",
            the_leftover_checks_see_payloads_mappings_and_children,
        ),
        (
            "a_forked_child_cannot_use_nor_close_the_worker",
            a_forked_child_cannot_use_nor_close_the_worker,
        ),
        (
            "pre_start_register_reaches_every_target",
            pre_start_register_reaches_every_target,
        ),
        (
            "post_start_register_task_and_unregister",
            post_start_register_task_and_unregister,
        ),
        (
            "a_returned_register_leaves_its_payload_nowhere",
            a_returned_register_leaves_its_payload_nowhere,
        ),
        (
            "duplicate_register_counts_references",
            duplicate_register_counts_references,
        ),
        (
            "a_register_given_up_is_unregistered_once_it_completes",
            a_register_given_up_is_unregistered_once_it_completes,
        ),
        (
            "deserialize_failure_rolls_back_everywhere",
            deserialize_failure_rolls_back_everywhere,
        ),
        (
            "slot_exhaustion_is_refused_before_deserializing",
            slot_exhaustion_is_refused_before_deserializing,
        ),
        (
            "task_failures_name_the_target_and_keep_it_alive",
            task_failures_name_the_target_and_keep_it_alive,
        ),
        (
            "a_long_task_does_not_delay_a_register",
            a_long_task_does_not_delay_a_register,
        ),
        (
            "kill_9_mid_operation_loses_only_that_target",
            kill_9_mid_operation_loses_only_that_target,
        ),
        (
            "a_target_exiting_in_a_task_is_reaped_and_lost",
            a_target_exiting_in_a_task_is_reaped_and_lost,
        ),
        (
            "tasks_without_a_target_go_to_the_least_loaded_target",
            tasks_without_a_target_go_to_the_least_loaded_target,
        ),
        (
            "a_target_retires_after_its_task_bound_and_the_waiting_tasks_follow",
            a_target_retires_after_its_task_bound_and_the_waiting_tasks_follow,
        ),
        (
            "hung_targets_are_fenced_at_the_deadline",
            hung_targets_are_fenced_at_the_deadline,
        ),
        ("sixty_four_targets", sixty_four_targets),
        (
            "many_threads_many_operations_in_flight",
            many_threads_many_operations_in_flight,
        ),
        (
            "start_refuses_a_threaded_process_unless_accepted",
            start_refuses_a_threaded_process_unless_accepted,
        ),
        (
            "a_worker_in_its_own_pid_namespace_is_untouched_by_host_workers",
            a_worker_in_its_own_pid_namespace_is_untouched_by_host_workers,
        ),
        (
            "lifecycle_errors_and_idempotent_close",
            lifecycle_errors_and_idempotent_close,
        ),
        (
            "the_parent_never_deserializes",
            the_parent_never_deserializes,
        ),
        (
            "oversized_task_input_is_refused_before_sending",
            oversized_task_input_is_refused_before_sending,
        ),
        (
            "close_fails_operations_in_flight",
            close_fails_operations_in_flight,
        ),
        (
            "large_tasks_pass_through_full_pipes",
            large_tasks_pass_through_full_pipes,
        ),
        (
            "a_snapshot_larger_than_the_slots_is_refused_before_start",
            a_snapshot_larger_than_the_slots_is_refused_before_start,
        ),
    ]);
}

/// The runner's checks after each test (`io_common::leftovers`) see what
/// they claim to: a staged payload's descriptor, its mapping once the
/// descriptor is closed, and a child that exited and was not reaped.
fn the_leftover_checks_see_payloads_mappings_and_children() {
    use callreg::io::staging::{StagedPayload, StagedView, COPY_MAX_BYTES};
    use std::os::fd::AsRawFd;
    let bytes = vec![7u8; usize::try_from(COPY_MAX_BYTES).unwrap() + 4096];
    let (payload, _) = StagedPayload::create(&bytes, 0..bytes.len()).unwrap();
    assert_eq!(
        io_common::leftovers(),
        Err(format!(
            "staged payload descriptors left open: [{}]",
            payload.fd().as_raw_fd()
        ))
    );
    // Larger than COPY_MAX_BYTES: mapped; the view keeps its descriptor
    // (a runtime may map out-of-band buffers from it) until dropped.
    let view =
        StagedView::open(payload.fd().try_clone_to_owned().unwrap(), payload.size()).unwrap();
    assert!(view.is_mapped());
    drop(payload);
    let mappings = io_common::payload_mappings().unwrap();
    assert_eq!(mappings.len(), 1, "{mappings:?}");
    assert_eq!(
        io_common::leftovers(),
        Err(format!(
            "staged payload descriptors left open: [{}]; staged payloads left mapped: {mappings:?}",
            view.file().as_raw_fd()
        ))
    );
    drop(view);
    assert_eq!(io_common::leftovers(), Ok(()));
    // SAFETY: the test runs on the main thread of a single-threaded
    // process (the runner checks it); the child only calls _exit.
    let child = match unsafe { nix::unistd::fork() }.unwrap() {
        // SAFETY: _exit is async-signal-safe and ends the child at once.
        nix::unistd::ForkResult::Child => unsafe { nix::libc::_exit(0) },
        nix::unistd::ForkResult::Parent { child } => child,
    };
    // Until the child is a zombie (exited, not reaped).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(format!("/proc/{child}/stat"))
        .unwrap()
        .rsplit(") ")
        .next()
        .unwrap()
        .starts_with('Z')
    {
        assert!(Instant::now() < deadline, "child {child} did not exit");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        io_common::leftovers(),
        Err(format!("an unreaped child: Exited(Pid({child}), 0)"))
    );
    // The check reaped it.
    assert_eq!(io_common::leftovers(), Ok(()));
}

fn pre_start_register_reaches_every_target() {
    let worker = builder(4).build().unwrap();
    let add = worker.register(&envelope("add")).unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    assert_ne!(add.handle_id, echo.handle_id);
    let report = worker.start().unwrap();
    assert_eq!(
        report.outcomes,
        io_common::all_targets(4)
            .into_iter()
            .map(|t| (t, TargetOutcome::Ok))
            .collect::<Vec<_>>()
    );
    assert_eq!(worker.live_targets(), io_common::all_targets(4));
    for (target, result) in worker.submit_to_every(&add, TaskEncoding::Json, ADD_INPUT) {
        assert_eq!(result.unwrap(), b"42", "{target}");
    }
    assert_eq!(
        worker
            .submit(&echo, TargetId(3), TaskEncoding::Pickle, b"raw")
            .unwrap(),
        b"raw"
    );
    check_invariants(&worker, 4);
    worker.unregister(&add).unwrap();
    check_invariants(&worker, 4);
    let err = worker
        .submit(&add, TargetId(0), TaskEncoding::Json, ADD_INPUT)
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::HANDLE_STALE);
}

/// What the forked child of
/// [`a_forked_child_cannot_use_nor_close_the_worker`] checks; its exit
/// status is the number of the first check that failed (0: none).
fn forked_child_checks(
    worker: callreg::io::Worker<TestRuntime>,
    add: &callreg::protocol::Handle,
    pending: callreg::io::PendingTask,
) -> i32 {
    let owner = std::os::unix::process::parent_id();
    let task = worker.submit(add, TargetId(0), TaskEncoding::Json, ADD_INPUT);
    match task {
        Err(e)
            if e.error.code == ErrorCode::LIFECYCLE_INVALID
                && e.error.message.starts_with(&format!(
                    "this Worker belongs to process {owner}; process {} is a child forked from it",
                    std::process::id()
                )) => {}
        _ => return 1,
    }
    match worker.register(&envelope("echo")) {
        Err(e) if e.code() == ErrorCode::LIFECYCLE_INVALID => {}
        _ => return 2,
    }
    if !worker.live_targets().is_empty() || worker.target_pid(TargetId(0)).is_some() {
        return 3;
    }
    if worker.parent_state().lifecycle() != callreg::protocol::Lifecycle::Closed {
        return 4;
    }
    match worker.forgive(add.hashid) {
        Err(e) if e == callreg::io::forked_child_error(OperationKind::Register, owner) => {}
        _ => return 6,
    }
    // A task pending in the owner completes here at once, with the same
    // error.
    let forked = callreg::io::forked_child_error(OperationKind::Task, owner);
    match pending.wait() {
        Err(e) if e.error == forked && e.kind.is_empty() => {}
        _ => return 5,
    }
    worker.close();
    drop(worker);
    0
}

fn a_forked_child_cannot_use_nor_close_the_worker() {
    let worker = builder(2).build().unwrap();
    worker.start().unwrap();
    let add = worker.register(&envelope("add")).unwrap();
    let pids: Vec<_> = (0..2).map(|t| worker.target_pid(TargetId(t))).collect();
    let sleeper = worker.register(&envelope("sleep 300")).unwrap();
    let pending = worker.submit_async(&sleeper, TargetId(1), TaskEncoding::Json, b"slept");
    // SAFETY: the child runs only the checks above (glibc's allocator is
    // usable after fork) and leaves with `_exit`.
    let child = match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => {
            // The child's copies of the Worker and the pending task are
            // used and dropped there; the owner's stay as they are.
            let code = forked_child_checks(worker, &add, pending);
            // SAFETY: `_exit` ends the child without running the owner's
            // exit handlers.
            unsafe { libc::_exit(code) }
        }
        nix::unistd::ForkResult::Parent { child } => child,
    };
    let status = nix::sys::wait::waitpid(child, None).unwrap();
    assert_eq!(status, nix::sys::wait::WaitStatus::Exited(child, 0));
    // The owner's Worker is untouched: same targets, same results.
    assert_eq!(
        (0..2)
            .map(|t| worker.target_pid(TargetId(t)))
            .collect::<Vec<_>>(),
        pids
    );
    assert_eq!(pending.wait().unwrap(), b"slept");
    for target in 0..2 {
        assert_eq!(
            worker
                .submit(&add, TargetId(target), TaskEncoding::Json, ADD_INPUT)
                .unwrap(),
            b"42"
        );
    }
    check_invariants(&worker, 2);
}

/// A register waited for in slices (`PendingOperation::wait_timeout`)
/// and then given up (`Worker::release_when_registered`, as the Python
/// package does on Ctrl-C) leaves nothing installed once it completes; a
/// register of the same callable still held by another handle keeps it.
fn a_register_given_up_is_unregistered_once_it_completes() {
    let worker = builder(2).build().unwrap();
    worker.start().unwrap();
    let slow = envelope("slow 300");
    let pending = worker.register_async(&slow).unwrap();
    let pending = match pending.wait_timeout(Duration::from_millis(20)) {
        Err(pending) => pending,
        Ok(done) => panic!("a 300 ms install completed within 20 ms: {done:?}"),
    };
    worker.release_when_registered(pending);
    let deadline = Instant::now() + Duration::from_secs(10);
    let installed = || -> Vec<_> {
        worker
            .inspect()
            .unwrap()
            .into_iter()
            .map(|(_, table)| table.unwrap().installed)
            .collect()
    };
    // Settled once nothing is in flight and `live` handles are left (the
    // release's unregister drops the handle when it starts).
    let settle = |live: usize| {
        while Instant::now() < deadline {
            let parent = worker.parent_state();
            if parent.in_flight().is_empty() && parent.live_handles().len() == live {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("not settled with {live} live handles");
    };
    settle(0);
    assert_eq!(installed(), vec![vec![], vec![]]);
    check_invariants(&worker, 2);
    // Held by another handle: the given-up one's release leaves it.
    let held = worker.register(&slow).unwrap();
    let pending = worker.register_async(&slow).unwrap();
    worker.release_when_registered(pending);
    settle(1);
    assert_eq!(installed(), vec![vec![(held.digest(), 1)]; 2]);
    assert_eq!(
        worker
            .submit(&held, TargetId(1), TaskEncoding::Json, b"[3]")
            .unwrap(),
        b"[3]"
    );
    // A completed wait in slices returns the handle.
    let mut pending = worker.register_async(&slow).unwrap();
    let handle = loop {
        match pending.wait_timeout(Duration::from_millis(5)) {
            Ok(result) => break result.unwrap(),
            Err(again) => pending = again,
        }
    };
    assert_eq!(handle.digest(), held.digest());
    worker.close();
}

fn post_start_register_task_and_unregister() {
    let worker = builder(2).build().unwrap();
    worker.start().unwrap();
    let add = worker.register(&envelope("add")).unwrap();
    assert_eq!(
        add.hashid.to_string(),
        callreg::descriptor::python_serialized_digest(
            &callreg::envelope::Envelope::parse(&envelope("add")).unwrap()
        )
        .hashid()
        .to_string()
    );
    assert_eq!(
        worker
            .submit(&add, TargetId(1), TaskEncoding::Json, ADD_INPUT)
            .unwrap(),
        b"42"
    );
    let tables = worker.inspect().unwrap();
    for (_, table) in &tables {
        assert_eq!(table.as_ref().unwrap().installed, vec![(add.digest(), 1)]);
    }
    check_invariants(&worker, 2);
    worker.unregister(&add).unwrap();
    for (_, table) in worker.inspect().unwrap() {
        assert_eq!(table.unwrap().installed, vec![]);
    }
    let err = worker.unregister(&add).unwrap_err();
    assert_eq!(err.code(), ErrorCode::HANDLE_STALE);
    check_invariants(&worker, 2);
    // A register after an unregister installs afresh.
    let again = worker.register(&envelope("add")).unwrap();
    assert_eq!(
        worker
            .submit(&again, TargetId(0), TaskEncoding::Json, ADD_INPUT)
            .unwrap(),
        b"42"
    );
}

/// Where a staged payload is still held in process `pid`: its
/// descriptors and the lines of its memory map that map one.
fn payload_held_by(pid: &str) -> Vec<String> {
    let mut held: Vec<String> = callreg::io::staging::payloads_of(pid)
        .unwrap()
        .into_iter()
        .map(|fd| format!("{pid}: fd {fd}"))
        .collect();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    held.extend(
        maps.lines()
            .filter(|line| line.contains(callreg::io::staging::MEMFD_NAME))
            .map(|line| format!("{pid}: maps {line}")),
    );
    held
}

/// When a register returns, neither the parent nor any target holds any
/// of its staged payload (no descriptor, no mapping): every cost of the
/// payload's size was paid inside the register, and an unregister (or
/// anything else queued behind it) waits for none of it
/// (`specs/staging.md`, steps 3 and 4).
fn a_returned_register_leaves_its_payload_nowhere() {
    let worker = builder(3)
        .slot_capacity(64)
        .respawn_limit(0)
        .build()
        .unwrap();
    worker.start().unwrap();
    let pids: Vec<String> = (0..3)
        .map(|t| worker.target_pid(TargetId(t)).unwrap().to_string())
        .collect();
    let mut handles = Vec::new();
    for i in 0..40 {
        // 256 KiB each: unmapping one takes long enough to be seen.
        let mut instruction = format!("echo #{i}#");
        instruction.extend(std::iter::repeat_n('x', 256 * 1024));
        handles.push(worker.register(&envelope(&instruction)).unwrap());
        let mut held = payload_held_by("self");
        for pid in &pids {
            held.extend(payload_held_by(pid));
        }
        assert_eq!(held, Vec::<String>::new(), "after register {i}");
    }
    for handle in &handles {
        worker.unregister(handle).unwrap();
    }
    for (_, table) in worker.inspect().unwrap() {
        assert_eq!(table.unwrap().installed, vec![]);
    }
}

fn duplicate_register_counts_references() {
    let worker = builder(3).build().unwrap();
    let first = worker.register(&envelope("echo")).unwrap();
    worker.start().unwrap();
    let second = worker.register(&envelope("echo")).unwrap();
    let third = worker.register(&envelope("echo")).unwrap();
    assert_eq!(first.hashid, second.hashid);
    assert_ne!(second.handle_id, third.handle_id);
    for (_, table) in worker.inspect().unwrap() {
        assert_eq!(table.unwrap().installed, vec![(first.digest(), 3)]);
    }
    worker.unregister(&second).unwrap();
    // Unregistering one handle never invalidates another.
    assert_eq!(
        worker
            .submit(&first, TargetId(2), TaskEncoding::Json, b"1")
            .unwrap(),
        b"1"
    );
    assert_eq!(
        worker
            .submit(&third, TargetId(0), TaskEncoding::Json, b"3")
            .unwrap(),
        b"3"
    );
    for (_, table) in worker.inspect().unwrap() {
        assert_eq!(table.unwrap().installed, vec![(first.digest(), 2)]);
    }
    check_invariants(&worker, 3);
}

fn deserialize_failure_rolls_back_everywhere() {
    // Every target deserializes it at once (probe-first off).
    let worker = builder(3).probe_first(false).build().unwrap();
    worker.start().unwrap();
    let err = worker.register(&envelope("bad no luck")).unwrap_err();
    assert_eq!(err.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(err.outcomes.len(), 3);
    for (target, outcome) in &err.outcomes {
        match outcome {
            TargetOutcome::Failed { failure } => {
                assert_eq!(failure.code, ErrorCode::DESERIALIZE_FAILED, "{target}");
                assert_eq!(failure.message, "TestDeserializeError: no luck");
            }
            other => panic!("{target}: {other:?}"),
        }
    }
    assert!(
        err.to_string()
            .contains("target 2: failed (DESERIALIZE_FAILED: TestDeserializeError: no luck)"),
        "{err}"
    );
    check_invariants(&worker, 3);
    assert_eq!(worker.live_targets().len(), 3);
    let echo = worker.register(&envelope("echo")).unwrap();
    assert_eq!(
        worker
            .submit(&echo, TargetId(1), TaskEncoding::Json, b"x")
            .unwrap(),
        b"x"
    );
}

fn slot_exhaustion_is_refused_before_deserializing() {
    let worker = builder(2).slot_capacity(1).build().unwrap();
    worker.start().unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    // `crash` would end the target if it were deserialized.
    let err = worker.register(&envelope("crash")).unwrap_err();
    assert_eq!(err.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
    for (_, outcome) in &err.outcomes {
        assert!(
            matches!(outcome, TargetOutcome::Failed { failure } if failure.code == ErrorCode::LOCAL_SLOT_EXHAUSTED),
            "{outcome:?}"
        );
    }
    assert_eq!(worker.live_targets().len(), 2);
    check_invariants(&worker, 2);
    worker.unregister(&echo).unwrap();
    let add = worker.register(&envelope("add")).unwrap();
    assert_eq!(
        worker
            .submit(&add, TargetId(1), TaskEncoding::Json, ADD_INPUT)
            .unwrap(),
        b"42"
    );
}

fn task_failures_name_the_target_and_keep_it_alive() {
    let worker = builder(2).build().unwrap();
    worker.start().unwrap();
    let fail = worker.register(&envelope("fail boom")).unwrap();
    let panic = worker.register(&envelope("panic")).unwrap();
    let add = worker.register(&envelope("add")).unwrap();
    let err = worker
        .submit(&fail, TargetId(1), TaskEncoding::Json, b"")
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::TASK_FAILED);
    assert_eq!(err.kind, "TestFailure");
    assert_eq!(err.error.message, "boom");
    assert_eq!(err.error.target, Some(TargetId(1)));
    assert_eq!(err.error.hashid, Some(fail.hashid));
    let err = worker
        .submit(&panic, TargetId(0), TaskEncoding::Json, b"")
        .unwrap_err();
    assert_eq!(
        (err.error.code, err.kind.as_str()),
        (ErrorCode::TASK_FAILED, "panic")
    );
    assert_eq!(err.error.message, "test callable panicked");
    let err = worker
        .submit(&add, TargetId(0), TaskEncoding::Json, b"not json")
        .unwrap_err();
    assert_eq!(
        (err.error.code, err.kind.as_str()),
        (ErrorCode::TASK_FAILED, "ValueError")
    );
    let err = worker
        .submit(&add, TargetId(7), TaskEncoding::Json, ADD_INPUT)
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::NO_LIVE_TARGET);
    assert_eq!(worker.live_targets().len(), 2);
    assert_eq!(
        worker
            .submit(&add, TargetId(0), TaskEncoding::Json, ADD_INPUT)
            .unwrap(),
        b"42"
    );
    check_invariants(&worker, 2);
}

fn a_long_task_does_not_delay_a_register() {
    let worker = builder(1)
        .control_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    worker.start().unwrap();
    // The task outlives the control timeout threefold; a register and an
    // unregister issued meanwhile must still be answered in time (a target
    // that missed the deadline would be fenced and the register fail).
    let sleep = worker.register(&envelope("sleep 3000")).unwrap();
    let task = worker.submit_async(&sleep, TargetId(0), TaskEncoding::Json, b"slept");
    std::thread::sleep(Duration::from_millis(50));
    let echo = worker.register(&envelope("echo")).unwrap();
    worker.unregister(&sleep).unwrap();
    assert!(!task.is_complete(), "the task was expected to still run");
    // The run pinned its slot: it completes although its digest is gone.
    assert_eq!(task.wait().unwrap(), b"slept");
    assert_eq!(worker.live_targets(), vec![TargetId(0)]);
    assert_eq!(
        worker
            .submit(&echo, TargetId(0), TaskEncoding::Json, b"e")
            .unwrap(),
        b"e"
    );
    check_invariants(&worker, 1);
}

fn kill_9_mid_operation_loses_only_that_target() {
    // Every target deserializes it at once (probe-first off).
    let worker = builder(3)
        .probe_first(false)
        .respawn_limit(0)
        .build()
        .unwrap();
    worker.start().unwrap();
    let pending = worker.register_async(&envelope("slow 2000")).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let pid = worker.target_pid(TargetId(1)).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let err = pending.wait().unwrap_err();
    assert_eq!(err.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(
        err.outcomes,
        vec![
            (TargetId(0), TargetOutcome::RolledBack),
            (TargetId(1), TargetOutcome::Lost),
            (TargetId(2), TargetOutcome::RolledBack),
        ]
    );
    assert_eq!(worker.live_targets(), vec![TargetId(0), TargetId(2)]);
    assert_eq!(worker.target_exit(TargetId(1)), Some(Exit::Signal(9)));
    check_invariants(&worker, 3);
    // The survivors accept a new register and run a task; the lost target
    // is out of scope.
    let add = worker.register(&envelope("add")).unwrap();
    assert_eq!(
        worker
            .submit(&add, TargetId(2), TaskEncoding::Json, ADD_INPUT)
            .unwrap(),
        b"42"
    );
    let err = worker
        .submit(&add, TargetId(1), TaskEncoding::Json, ADD_INPUT)
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::TARGET_LOST);
    check_invariants(&worker, 3);
}

fn a_target_exiting_in_a_task_is_reaped_and_lost() {
    let worker = builder(2).respawn_limit(0).build().unwrap();
    worker.start().unwrap();
    let exit = worker.register(&envelope("exit 9")).unwrap();
    let err = worker
        .submit(&exit, TargetId(0), TaskEncoding::Json, b"")
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::TARGET_LOST);
    assert_eq!(err.error.target, Some(TargetId(0)));
    assert!(
        err.error.message.contains("exited with status 9"),
        "{}",
        err.error.message
    );
    assert_eq!(worker.live_targets(), vec![TargetId(1)]);
    assert_eq!(worker.target_exit(TargetId(0)), Some(Exit::Code(9)));
    check_invariants(&worker, 2);
    // Unregister reaches only the survivor.
    worker.unregister(&exit).unwrap();
    check_invariants(&worker, 2);
}

/// A task given no target goes where the machine places it
/// (`specs/protocol.md` §2.14): the live target with the fewest tasks in
/// flight, so three held tasks land on three targets.
fn tasks_without_a_target_go_to_the_least_loaded_target() {
    let worker = builder(3).respawn_limit(0).build().unwrap();
    let sleep = worker.register(&envelope("sleep 400")).unwrap();
    let err = worker
        .submit_any_async(&sleep, TaskEncoding::Json, b"1", None)
        .wait()
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::LIFECYCLE_INVALID);
    worker.start().unwrap();
    let held: Vec<PendingTask> = (0..3)
        .map(|_| worker.submit_any_async(&sleep, TaskEncoding::Json, b"1", None))
        .collect();
    // Every target holds one: the next goes to the lowest of them,
    // target 0, after its held task (a target runs one task at a time),
    // and ends it.
    let exit = worker.register(&envelope("exit 9")).unwrap();
    let err = worker
        .submit_any_async(&exit, TaskEncoding::Json, b"", None)
        .wait()
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::TARGET_LOST);
    assert_eq!(err.error.target, Some(TargetId(0)));
    let ends: Vec<Option<ErrorCode>> = held
        .into_iter()
        .map(|task| task.wait().err().map(|e| e.error.code))
        .collect();
    assert_eq!(ends, vec![None, None, None]);
    assert_eq!(worker.live_targets(), vec![TargetId(1), TargetId(2)]);
    // None live and none coming: a stale handle is refused as such, a
    // live one with NO_LIVE_TARGET.
    for _ in 0..2 {
        let err = worker
            .submit_any_async(&exit, TaskEncoding::Json, b"", None)
            .wait()
            .unwrap_err();
        assert_eq!(err.error.code, ErrorCode::TARGET_LOST);
    }
    assert_eq!(worker.live_targets(), vec![]);
    worker.unregister(&exit).unwrap();
    let err = worker
        .submit_any_async(&exit, TaskEncoding::Json, b"", None)
        .wait()
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::HANDLE_STALE);
    let err = worker
        .submit_any_async(&sleep, TaskEncoding::Json, b"1", None)
        .wait()
        .unwrap_err();
    assert_eq!(
        (err.error.code, err.error.message.as_str()),
        (
            ErrorCode::NO_LIVE_TARGET,
            "every target is lost, and none is being replaced"
        )
    );
    worker.close();
}

/// `max_tasks_per_target(2)` on one target (`specs/protocol.md` §2.14):
/// five tasks at once all run; each process is sent two, retires once
/// they ended, and its replacement takes the tasks that waited.
fn a_target_retires_after_its_task_bound_and_the_waiting_tasks_follow() {
    let refused = builder(1)
        .respawn_limit(0)
        .max_tasks_per_target(2)
        .build()
        .err()
        .unwrap();
    assert_eq!(
        (refused.code, refused.message.as_str()),
        (
            ErrorCode::LIFECYCLE_INVALID,
            "max_tasks_per_target (2) needs replacement targets: a respawn_limit above 0"
        )
    );
    let worker = builder(1).max_tasks_per_target(2).build().unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    worker.start().unwrap();
    let tasks: Vec<PendingTask> = (0..5)
        .map(|i| {
            let input = format!("{i}");
            worker.submit_any_async(&echo, TaskEncoding::Json, input.as_bytes(), None)
        })
        .collect();
    let results: Vec<Vec<u8>> = tasks.into_iter().map(|t| t.wait().unwrap()).collect();
    assert_eq!(
        results,
        vec![
            b"0".to_vec(),
            b"1".to_vec(),
            b"2".to_vec(),
            b"3".to_vec(),
            b"4".to_vec()
        ]
    );
    assert_eq!(worker.target_incarnation(TargetId(0)), 2);
    let retired: Vec<String> = worker
        .target_events()
        .iter()
        .filter(|e| matches!(e, TargetEvent::Retired { .. } | TargetEvent::Lost { .. }))
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        retired,
        vec![
            "target 0: incarnation 0 retired after 2 tasks",
            "target 0: incarnation 1 retired after 2 tasks",
        ]
    );
    // A task to the retiring target itself is refused, naming the bound.
    let held = worker.submit_any_async(&echo, TaskEncoding::Json, b"5", None);
    let err = worker
        .submit(&echo, TargetId(0), TaskEncoding::Json, b"6")
        .unwrap_err();
    assert_eq!(
        (err.error.code, err.error.message.as_str()),
        (
            ErrorCode::TARGET_LOST,
            "target 0 is retiring: it was sent its 2 tasks (max_tasks_per_target) and is replaced once they end"
        )
    );
    assert_eq!(held.wait().unwrap(), b"5");
    worker.close();
}

/// Targets stuck in a 5 s deserialization keep reporting alive, so the
/// operation timeout (600 ms), not the control timeout, fences them.
fn hung_targets_are_fenced_at_the_deadline() {
    let worker = builder(2)
        .probe_first(false)
        .control_timeout(Duration::from_millis(300))
        .operation_timeout(Duration::from_millis(600))
        .respawn_limit(0)
        .build()
        .unwrap();
    worker.start().unwrap();
    let started = Instant::now();
    let err = worker.register(&envelope("slow 5000")).unwrap_err();
    assert!(
        started.elapsed() >= Duration::from_millis(600)
            && started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(err.code(), ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(
        err.outcomes,
        vec![
            (TargetId(0), TargetOutcome::Fenced),
            (TargetId(1), TargetOutcome::Fenced)
        ]
    );
    assert_eq!(worker.live_targets(), vec![]);
    assert_eq!(worker.target_exit(TargetId(0)), Some(Exit::Signal(9)));
    let parent = worker.parent_state();
    assert!(
        parent.uncertain_digests().is_empty(),
        "fencing makes nothing uncertain"
    );
    let err = worker.register(&envelope("echo")).unwrap_err();
    assert_eq!(err.code(), ErrorCode::NO_LIVE_TARGET);
}

fn sixty_four_targets() {
    let worker = builder(64).build().unwrap();
    let pre = worker.register(&envelope("echo #pre")).unwrap();
    worker.start().unwrap();
    let add = worker.register(&envelope("add")).unwrap();
    let results = worker.submit_to_every(&add, TaskEncoding::Json, ADD_INPUT);
    assert_eq!(results.len(), 64);
    for (target, result) in results {
        assert_eq!(result.unwrap(), b"42", "{target}");
    }
    check_invariants(&worker, 64);
    worker.unregister(&add).unwrap();
    worker.unregister(&pre).unwrap();
    for (_, table) in worker.inspect().unwrap() {
        assert_eq!(table.unwrap().installed, vec![]);
    }
    check_invariants(&worker, 64);
}

fn many_threads_many_operations_in_flight() {
    let worker = Arc::new(builder(4).build().unwrap());
    worker.start().unwrap();
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let worker = worker.clone();
            std::thread::spawn(move || {
                for round in 0..10 {
                    let handle = worker
                        .register(&envelope(&format!("echo #{i}-{round}")))
                        .unwrap();
                    let input = format!("{i}/{round}");
                    let target = TargetId((i + round) % 4);
                    let out = worker
                        .submit(&handle, target, TaskEncoding::Json, input.as_bytes())
                        .unwrap();
                    assert_eq!(out, input.as_bytes());
                    worker.unregister(&handle).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    check_invariants(&worker, 4);
    for (_, table) in worker.inspect().unwrap() {
        assert_eq!(table.unwrap().installed, vec![]);
    }
    // Async operations in flight at once.
    let pending: Vec<_> = (0..16)
        .map(|i| {
            worker
                .register_async(&envelope(&format!("echo #a{i}")))
                .unwrap()
        })
        .collect();
    let handles: Vec<_> = pending.into_iter().map(|p| p.wait().unwrap()).collect();
    for (_, table) in worker.inspect().unwrap() {
        assert_eq!(table.unwrap().installed.len(), 16);
    }
    check_invariants(&worker, 4);
    drop(handles);
}

fn start_refuses_a_threaded_process_unless_accepted() {
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let other = std::thread::spawn(move || stop_rx.recv());
    let worker = builder(1).build().unwrap();
    let err = worker.start().unwrap_err();
    assert_eq!(err.code(), ErrorCode::IO_FAILED);
    assert!(
        err.error
            .message
            .starts_with("refusing to fork targets: this process runs 2 threads"),
        "{}",
        err.error.message
    );
    // Still new: it can start once the caller accepts the risk.
    let risky = builder(1).accept_thread_risk().build().unwrap();
    let echo = risky.register(&envelope("echo")).unwrap();
    risky.start().unwrap();
    assert_eq!(
        risky
            .submit(&echo, TargetId(0), TaskEncoding::Json, b"ok")
            .unwrap(),
        b"ok"
    );
    drop(risky);
    stop_tx.send(()).unwrap();
    other.join().unwrap().unwrap();
}

/// The body of this binary inside a pid namespace: a Worker with one
/// target makes [`NAMESPACE_REGISTERS`] registers of 1 MiB envelopes (so
/// each is staged for a while), printing `N registers ok`; exit status 0
/// when all succeeded, else 1 with the first error.
fn namespace_worker() -> i32 {
    let worker = builder(1).build().unwrap();
    worker.start().unwrap();
    for i in 0..NAMESPACE_REGISTERS {
        let instruction = format!("echo#{i}{}", "x".repeat(1 << 20));
        match worker.register(&envelope(&instruction)) {
            Ok(handle) => worker.unregister(&handle).unwrap(),
            Err(e) => {
                println!("register {i} (pid {}): {e}", std::process::id());
                return 1;
            }
        }
    }
    worker.close();
    println!("{NAMESPACE_REGISTERS} registers ok");
    0
}

/// A Worker whose pid in its own pid namespace names no process on the
/// host (so a pid-based sweep on the host would take its staging for a
/// dead parent's) registers while Workers keep starting on the host: every
/// register succeeds. Skipped, saying why, where unprivileged user and pid
/// namespaces are not allowed.
fn a_worker_in_its_own_pid_namespace_is_untouched_by_host_workers() {
    let probe = std::process::Command::new("unshare")
        .args([
            "--user",
            "--map-root-user",
            "--pid",
            "--fork",
            "--mount-proc",
            "true",
        ])
        .output();
    match probe {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            println!(
                "SKIPPED: unshare cannot make a user and pid namespace here: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return;
        }
        Err(e) => {
            println!("SKIPPED: unshare cannot be run: {e}");
            return;
        }
    }
    // The first pid above 1 that no host process has: the namespace's
    // shell (pid 1) uses up the pids below it, then runs the Worker there.
    let free = (2..1000)
        .find(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
        .unwrap();
    let script =
        format!("i=2; while [ $i -lt {free} ]; do /bin/true; i=$((i+1)); done; \"$0\"; exit $?");
    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new("unshare")
        .args([
            "--user",
            "--map-root-user",
            "--pid",
            "--fork",
            "--mount-proc",
            "sh",
            "-c",
        ])
        .arg(&script)
        .arg(&exe)
        .env(NAMESPACE_CHILD_VAR, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut host_starts = 0;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        let worker = builder(1).build().unwrap();
        worker.start().unwrap();
        worker.close();
        host_starts += 1;
    };
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
    assert!(status.success(), "{status}: {out}");
    assert_eq!(out, format!("{NAMESPACE_REGISTERS} registers ok\n"));
    assert!(host_starts > 0);
}

fn lifecycle_errors_and_idempotent_close() {
    // The protocol counts whole microseconds: a shorter timeout is refused
    // rather than silently becoming zero.
    let err = builder(1)
        .control_timeout(Duration::from_nanos(999))
        .build()
        .err()
        .expect("a 999 ns control timeout is refused");
    assert_eq!(err.code, ErrorCode::LIFECYCLE_INVALID);
    assert!(
        err.to_string()
            .contains("the control timeout must be at least 1 microsecond"),
        "{err}"
    );
    // An operation bound shorter than the control timeout is refused.
    let err = builder(1)
        .control_timeout(Duration::from_secs(2))
        .operation_timeout(Duration::from_millis(500))
        .build()
        .err()
        .expect("refused");
    assert_eq!(
        (err.code, err.message.as_str()),
        (
            ErrorCode::LIFECYCLE_INVALID,
            "the operation timeout (0.5 s) must be at least the control timeout (2 s)"
        )
    );
    // Deadlines are instants from now: a time that would overflow one is
    // refused, each by name.
    let too_long = callreg::io::worker::MAX_TIMEOUT + Duration::from_secs(1);
    for (what, builder) in [
        ("control timeout", builder(1).control_timeout(too_long)),
        ("operation timeout", builder(1).operation_timeout(too_long)),
        ("respawn back-off", builder(1).respawn_backoff(too_long)),
    ] {
        let err = builder.build().err().expect("refused");
        assert_eq!(
            (err.code, err.message),
            (
                ErrorCode::LIFECYCLE_INVALID,
                format!("the {what} must be at most 1000000000 seconds")
            )
        );
    }
    let worker = builder(1).build().unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    let err = worker
        .submit(&echo, TargetId(0), TaskEncoding::Json, b"")
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::LIFECYCLE_INVALID);
    worker.start().unwrap();
    assert_eq!(
        worker.start().unwrap_err().code(),
        ErrorCode::LIFECYCLE_INVALID
    );
    let err = worker.register(b"SPYX").unwrap_err();
    assert_eq!(err.code(), ErrorCode::ENVELOPE_INVALID);
    worker.close();
    worker.close();
    assert_eq!(worker.live_targets(), vec![]);
    assert_eq!(
        worker.register(&envelope("echo")).unwrap_err().code(),
        ErrorCode::LIFECYCLE_INVALID
    );
    assert_eq!(
        worker.unregister(&echo).unwrap_err().code(),
        ErrorCode::LIFECYCLE_INVALID
    );
    let err = worker
        .submit(&echo, TargetId(0), TaskEncoding::Json, b"")
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::LIFECYCLE_INVALID);
    assert_eq!(worker.target_exit(TargetId(0)), Some(Exit::Code(0)));
    // A handle from another Worker is foreign.
    let other = builder(1).build().unwrap();
    let foreign = other.register(&envelope("echo")).unwrap();
    let mine = builder(1).build().unwrap();
    assert_eq!(
        mine.unregister(&foreign).unwrap_err().code(),
        ErrorCode::HANDLE_FOREIGN
    );
    let _ = TestRuntime;
}

fn the_parent_never_deserializes() {
    let worker = builder(2).build().unwrap();
    let pre = worker.register(&envelope("add")).unwrap();
    worker.start().unwrap();
    let post = worker.register(&envelope("echo")).unwrap();
    worker.submit_to_every(&pre, TaskEncoding::Json, ADD_INPUT);
    worker.submit_to_every(&post, TaskEncoding::Json, b"x");
    let _ = worker.register(&envelope("bad x"));
    drop(worker);
    assert_eq!(
        deserialize_count(),
        0,
        "the parent called the runtime's deserialize"
    );
}

fn oversized_task_input_is_refused_before_sending() {
    let worker = builder(1).max_frame_bytes(1024).build().unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    worker.start().unwrap();
    // Header 8 + seq 8 + digest 32 + encoding 1 + length 4 = 53 bytes.
    let largest = vec![b'x'; 1024 - 53];
    // The echoed result needs one byte more (its status is two bytes).
    let err = worker
        .submit(&echo, TargetId(0), TaskEncoding::Json, &largest)
        .unwrap_err();
    assert_eq!(
        (err.error.code, err.kind.as_str()),
        (ErrorCode::TASK_FAILED, "ResultTooLarge")
    );
    assert_eq!(
        err.error.message,
        "the task's result of 971 bytes does not fit in a frame of at most 1024 bytes (max_frame_bytes)"
    );
    let fits = vec![b'x'; 1024 - 54];
    assert_eq!(
        worker
            .submit(&echo, TargetId(0), TaskEncoding::Json, &fits)
            .unwrap(),
        fits
    );
    let err = worker
        .submit(&echo, TargetId(0), TaskEncoding::Json, &[b'x'; 1024 - 52])
        .unwrap_err();
    assert_eq!(err.error.code, ErrorCode::FRAME_INVALID);
    assert_eq!(
        err.error.message,
        "a task input of 972 bytes makes a frame of 1025 bytes, over the maximum of 1024 (max_frame_bytes)"
    );
    assert_eq!(worker.live_targets(), vec![TargetId(0)]);
    check_invariants(&worker, 1);
}

fn close_fails_operations_in_flight() {
    let worker = builder(2).build().unwrap();
    let sleep = worker.register(&envelope("sleep 2000")).unwrap();
    worker.start().unwrap();
    let task = worker.submit_async(&sleep, TargetId(0), TaskEncoding::Json, b"");
    let register = worker.register_async(&envelope("slow 2000")).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    worker.close();
    assert!(task.is_complete() && register.is_complete());
    assert_eq!(
        task.wait().unwrap_err().error.code,
        ErrorCode::LIFECYCLE_INVALID
    );
    let err = register.wait().unwrap_err();
    assert_eq!(err.code(), ErrorCode::LIFECYCLE_INVALID);
    assert_eq!(
        err.error.message,
        "the Worker closed before the operation completed"
    );
}

/// Inputs and results far larger than a pipe's buffer (64 KiB): the IO
/// thread queues what the control pipe does not take and reads results in
/// pieces, while other targets keep working.
fn large_tasks_pass_through_full_pipes() {
    let worker = builder(2).build().unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    worker.start().unwrap();
    let input: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let pending: Vec<_> = (0..4)
        .map(|i| worker.submit_async(&echo, TargetId(i % 2), TaskEncoding::Pickle, &input))
        .collect();
    let small = worker
        .submit(&echo, TargetId(1), TaskEncoding::Json, b"small")
        .unwrap();
    assert_eq!(small, b"small");
    for task in pending {
        assert!(task.wait().unwrap() == input);
    }
    check_invariants(&worker, 2);
}

fn a_snapshot_larger_than_the_slots_is_refused_before_start() {
    let worker = builder(2).slot_capacity(1).build().unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    // The same digest again only adds a reference: it needs no slot.
    worker.register(&envelope("echo")).unwrap();
    let err = worker.register(&envelope("add")).unwrap_err();
    assert_eq!(err.code(), ErrorCode::LOCAL_SLOT_EXHAUSTED);
    assert_eq!(
        err.error.message,
        "the startup snapshot already holds as many distinct callables as a target has slots (1)"
    );
    assert!(err.outcomes.is_empty());
    worker.start().unwrap();
    assert_eq!(worker.live_targets(), vec![TargetId(0), TargetId(1)]);
    assert_eq!(
        worker
            .submit(&echo, TargetId(0), TaskEncoding::Json, b"x")
            .unwrap(),
        b"x"
    );
}
