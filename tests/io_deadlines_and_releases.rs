//! The Worker over real forked targets with the test runtime: what the
//! parent keeps, deadlines on every wait, and truthful reports.
//!
//! A `harness = false` binary (see `tests/io_common/mod.rs`): each test
//! runs on the main thread; every test ends with no staged payload
//! (memfd descriptor or mapping) and no child left (checked by the runner).

mod io_common;

use std::time::Duration;

use callreg::error::ErrorCode;
use callreg::protocol::{TargetId, TargetOutcome};
use io_common::{builder, digest_of, envelope};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn main() {
    io_common::run(&[
        (
            "pre_start_envelopes_are_released_at_unregister_start_and_close",
            pre_start_envelopes_are_released_at_unregister_start_and_close,
        ),
        (
            "inspect_gives_up_a_stopped_target_at_the_control_timeout",
            inspect_gives_up_a_stopped_target_at_the_control_timeout,
        ),
        (
            "a_register_failure_says_why_each_target_was_lost",
            a_register_failure_says_why_each_target_was_lost,
        ),
        (
            "a_target_never_ready_is_fenced_at_the_start_deadline",
            a_target_never_ready_is_fenced_at_the_start_deadline,
        ),
        (
            "start_refuses_more_targets_than_descriptors_allow",
            start_refuses_more_targets_than_descriptors_allow,
        ),
        (
            "a_late_target_heals_its_uncertain_digest",
            a_late_target_heals_its_uncertain_digest,
        ),
        (
            "a_written_envelope_registers_as_its_bytes_do",
            a_written_envelope_registers_as_its_bytes_do,
        ),
        (
            "a_memfd_hashed_by_its_writer_registers_by_that_digest",
            a_memfd_hashed_by_its_writer_registers_by_that_digest,
        ),
    ]);
}

fn signal(
    worker: &callreg::io::Worker<callreg::runtime::testing::TestRuntime>,
    target: u16,
    sig: Signal,
) {
    let pid = worker.target_pid(TargetId(target)).expect("a pid");
    kill(Pid::from_raw(pid), sig).expect("kill");
}

/// `inspect` on a stopped (SIGSTOP) target answers `None` for it once the
/// control timeout passed, without fencing it; its late table is dropped
/// and the next inspection sees it again.
fn inspect_gives_up_a_stopped_target_at_the_control_timeout() {
    let worker = builder(2)
        .control_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    worker.register(&envelope("echo")).unwrap();
    worker.start().unwrap();
    signal(&worker, 1, Signal::SIGSTOP);
    let tables = worker.inspect().unwrap();
    assert_eq!(tables.len(), 2);
    assert_eq!(tables[0].0, TargetId(0));
    assert_eq!(tables[0].1.as_ref().map(|t| t.installed.len()), Some(1));
    assert_eq!(tables[1], (TargetId(1), None));
    assert_eq!(worker.live_targets(), vec![TargetId(0), TargetId(1)]);
    signal(&worker, 1, Signal::SIGCONT);
    let tables = worker.inspect().unwrap();
    assert!(
        tables
            .iter()
            .all(|(_, t)| t.as_ref().map(|t| t.installed.len()) == Some(1)),
        "{tables:?}"
    );
    assert_eq!(worker.live_targets(), vec![TargetId(0), TargetId(1)]);
    io_common::check_invariants(&worker, 2);
    worker.close();
}

/// With fencing off, a target stopped (SIGSTOP) past the deadline of a
/// register leaves the digest uncertain; once it runs again it answers
/// late, the parent takes its install back with a heal unregister, and the
/// digest is certain again: it registers, serves on both targets, and
/// every target's table agrees with the registry (`specs/protocol.md`
/// §2.4, "Uncertainty heals"). Before the rule it stayed refused for the
/// Worker's life.
fn a_late_target_heals_its_uncertain_digest() {
    let worker = builder(2)
        .control_timeout(Duration::from_millis(200))
        .operation_timeout(Duration::from_millis(400))
        .fence_on_timeout(false)
        .probe_first(false)
        .build()
        .unwrap();
    worker.start().unwrap();
    let echo = envelope("echo");
    let digest = digest_of(&echo);
    signal(&worker, 1, Signal::SIGSTOP);
    let error = worker.register(&echo).unwrap_err();
    assert_eq!(error.code(), ErrorCode::REGISTER_PARTIAL_FAILURE, "{error}");
    assert_eq!(
        error.outcomes,
        vec![
            (TargetId(0), TargetOutcome::RolledBack),
            (TargetId(1), TargetOutcome::TimedOut)
        ]
    );
    assert!(worker.parent_state().is_uncertain(digest));
    let refused = worker.register(&echo).unwrap_err();
    assert_eq!(refused.code(), ErrorCode::REGISTER_CLEANUP_UNCERTAIN);
    assert!(
        refused
            .error
            .message
            .contains("target 1 owes an answer to seq 1"),
        "{refused}"
    );
    signal(&worker, 1, Signal::SIGCONT);
    // Target 1 installs, answers late, is sent the heal and confirms it.
    let healed = (0..250).any(|_| {
        std::thread::sleep(Duration::from_millis(20));
        !worker.parent_state().is_uncertain(digest)
    });
    assert!(
        healed,
        "still uncertain 5 s after the target ran again: {:?}",
        worker.parent_state()
    );
    let handle = worker.register(&echo).unwrap();
    echoes_on_both_targets(&worker, &handle, b"[7]");
    assert_eq!(worker.live_targets(), vec![TargetId(0), TargetId(1)]);
    io_common::check_invariants(&worker, 2);
    worker.close();
}

/// An envelope written in pieces (`StagingWriter`, as a pickler streams
/// its output) registers as its bytes would: the same hashid, before start
/// (read back into the startup snapshot) and after (a large one straight
/// from the `memfd` it was written into), and serves on every target.
fn a_written_envelope_registers_as_its_bytes_do() {
    use callreg::io::staging::{StagingWriter, SPILL_BYTES};
    let big = format!("echo #{}", "x".repeat(SPILL_BYTES + 12_345));
    let written = |payload: &str| {
        let mut writer = StagingWriter::new();
        for piece in payload.as_bytes().chunks(65_536) {
            writer.write(piece).unwrap();
        }
        writer.finish().unwrap()
    };
    let worker = builder(2).build().unwrap();
    let before = worker.register_written(written(&big), None).unwrap();
    assert_eq!(before.hashid, digest_of(&envelope(&big)).hashid());
    assert_eq!(worker.retained_envelope_bytes(), envelope(&big).len());
    worker.start().unwrap();
    let after = worker.register_written(written(&big), None).unwrap();
    let small = worker.register_written(written("echo"), None).unwrap();
    assert_eq!(after.hashid, before.hashid);
    assert_eq!(small.hashid, digest_of(&envelope("echo")).hashid());
    for handle in [&before, &after, &small] {
        echoes_on_both_targets(&worker, handle, b"[3]");
    }
    io_common::check_invariants(&worker, 2);
    worker.close();
}

/// A register whose targets die says, per target, why it was lost and how
/// it ended (as a task's `TARGET_LOST` does).
fn a_register_failure_says_why_each_target_was_lost() {
    let worker = builder(2).probe_first(false).build().unwrap();
    worker.start().unwrap();
    let error = worker.register(&envelope("crash")).unwrap_err();
    assert_eq!(
        error.outcomes,
        vec![
            (TargetId(0), TargetOutcome::Lost),
            (TargetId(1), TargetOutcome::Lost)
        ]
    );
    assert_eq!(error.code(), ErrorCode::REGISTER_PARTIAL_FAILURE, "{error}");
    let status = callreg::runtime::testing::CRASH_EXIT_CODE;
    assert_eq!(
        error.error.message,
        format!(
            "register failed: target 0: lost (its reply socket closed; it exited with status {status}); \
             target 1: lost (its reply socket closed; it exited with status {status})"
        )
    );
    worker.close();
}

/// The parent keeps an envelope's bytes only while a live handle needs
/// them: for the startup snapshot, then for replacements.
fn pre_start_envelopes_are_released_at_unregister_start_and_close() {
    let big = envelope(&format!("echo #{}", "x".repeat(1 << 20)));
    let small = envelope("add");
    let worker = builder(2).build().unwrap();
    let first = worker.register(&big).unwrap();
    let second = worker.register(&big).unwrap();
    let add = worker.register(&small).unwrap();
    assert_eq!(worker.retained_envelope_bytes(), big.len() + small.len());
    worker.unregister(&first).unwrap();
    // Another handle still needs the same bytes.
    assert_eq!(worker.retained_envelope_bytes(), big.len() + small.len());
    worker.unregister(&second).unwrap();
    assert_eq!(worker.retained_envelope_bytes(), small.len());
    worker.start().unwrap();
    // The targets inherited the snapshot; the parent keeps what a
    // replacement would be given (specs/protocol.md §2.9): the live ones.
    assert_eq!(worker.retained_envelope_bytes(), small.len());
    let echo = worker.register(&envelope("echo")).unwrap();
    assert_eq!(
        worker.retained_envelope_bytes(),
        small.len() + envelope("echo").len()
    );
    worker.unregister(&add).unwrap();
    assert_eq!(worker.retained_envelope_bytes(), envelope("echo").len());
    worker.unregister(&echo).unwrap();
    assert_eq!(worker.retained_envelope_bytes(), 0);
    worker.close();
    assert_eq!(worker.retained_envelope_bytes(), 0);

    // Without replacements the targets' inheritance is all there is.
    let unreplaced = builder(1).respawn_limit(0).build().unwrap();
    unreplaced.register(&small).unwrap();
    unreplaced.start().unwrap();
    assert_eq!(unreplaced.retained_envelope_bytes(), 0);
    unreplaced.register(&envelope("echo")).unwrap();
    assert_eq!(unreplaced.retained_envelope_bytes(), 0);
    unreplaced.close();

    let unstarted = builder(1).build().unwrap();
    unstarted.register(&big).unwrap();
    assert_eq!(unstarted.retained_envelope_bytes(), big.len());
    unstarted.close();
    assert_eq!(unstarted.retained_envelope_bytes(), 0);
}

/// A target that never becomes ready (it hangs before installing its
/// snapshot) is fenced when the start's deadline passes; the others start.
fn a_target_never_ready_is_fenced_at_the_start_deadline() {
    let var = callreg::io::failpoints::target_env_var(1);
    std::env::set_var(
        &var,
        format!(
            "{}=sleep(600000)",
            callreg::io::failpoints::TARGET_BEFORE_INSTALL
        ),
    );
    // Replacements off: the fenced target's would inherit the same fail
    // point (this checks the start deadline alone).
    let worker = builder(3)
        .control_timeout(Duration::from_millis(500))
        .respawn_limit(0)
        .build()
        .unwrap();
    let handle = worker.register(&envelope("echo")).unwrap();
    let started = worker.start();
    std::env::remove_var(&var);
    let error = started.unwrap_err();
    assert_eq!(
        error.outcomes,
        vec![
            (TargetId(0), TargetOutcome::Ok),
            (TargetId(1), TargetOutcome::Fenced),
            (TargetId(2), TargetOutcome::Ok),
        ]
    );
    assert_eq!(
        worker.target_exit(TargetId(1)),
        Some(callreg::io::process::Exit::Signal(9))
    );
    assert_eq!(worker.live_targets(), vec![TargetId(0), TargetId(2)]);
    let echoed = worker
        .submit(
            &handle,
            TargetId(2),
            callreg::runtime::TaskEncoding::Json,
            b"[1]",
        )
        .unwrap();
    assert_eq!(echoed, b"[1]");
    worker.close();
}

/// A start that would run out of descriptors (two per target in the
/// parent) is refused before anything is forked, saying what is needed.
fn start_refuses_more_targets_than_descriptors_allow() {
    let mut saved = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write one valid `rlimit`.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut saved) };
    let lowered = libc::rlimit {
        rlim_cur: 64,
        rlim_max: saved.rlim_max,
    };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) }, 0);
    let worker = builder(40).build().unwrap();
    let started = worker.start();
    // SAFETY: as above.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &saved) };
    let error = started.unwrap_err();
    assert_eq!(error.code(), ErrorCode::IO_FAILED);
    assert!(
        error.error.message.starts_with(
            "40 targets need 125 more file descriptors in the parent (a control socket, a reply socket and a pidfd each, two wake pipes and the replacements' template process), but the soft RLIMIT_NOFILE of 64 leaves "
        ),
        "{error}"
    );
    assert_eq!(worker.target_pid(TargetId(0)), None);
    assert_eq!(worker.live_targets(), vec![]);
}

/// A `memfd` whose writer hashed the payload as it wrote it registers by
/// that digest without the parent reading it back; a digest the payload
/// does not have is refused by every target it reaches, and nothing is
/// left installed or staged. The payload is over a MiB, so target 1
/// verifies it ahead of each register while target 0 probes
/// (`specs/staging.md` step 3): the right digest's record is taken, the
/// wrong one's is never used, and no process holds the refused payload.
fn a_memfd_hashed_by_its_writer_registers_by_that_digest() {
    use callreg::descriptor::PythonSerialized;
    use callreg::envelope::Envelope;
    use callreg::io::staging::new_memfd;
    use std::io::Write;
    use std::os::unix::fs::MetadataExt;
    let bytes = envelope(&format!("echo #{}", "y".repeat(2 << 20)));
    let written = || {
        let fd = new_memfd().unwrap();
        std::fs::File::from(fd.try_clone().unwrap())
            .write_all(&bytes)
            .unwrap();
        fd
    };
    let payload_sha256 = PythonSerialized::from_envelope(&Envelope::parse(&bytes).unwrap())
        .payload_sha256
        .0;
    let worker = builder(2).build().unwrap();
    worker.start().unwrap();
    let handle = worker
        .register_memfd_hashed(written(), payload_sha256, None)
        .unwrap();
    assert_eq!(handle.hashid, digest_of(&bytes).hashid());
    echoes_on_both_targets(&worker, &handle, b"[5]");
    worker.unregister(&handle).unwrap();
    let mut wrong = payload_sha256;
    wrong[0] ^= 1;
    let refused = written();
    let identity = std::fs::File::from(refused.try_clone().unwrap())
        .metadata()
        .map(|m| (m.dev(), m.ino()))
        .unwrap();
    let error = worker
        .register_memfd_hashed(refused, wrong, None)
        .unwrap_err();
    assert_eq!(error.code(), ErrorCode::REGISTER_PARTIAL_FAILURE, "{error}");
    assert_eq!(error.outcomes.len(), 1, "the probe alone: {error}");
    let (target, outcome) = &error.outcomes[0];
    assert_eq!(*target, TargetId(0));
    let TargetOutcome::Failed { failure } = outcome else {
        panic!("{outcome:?}");
    };
    assert_eq!(
        failure.code,
        ErrorCode::HASHID_DESCRIPTOR_MISMATCH,
        "{error}"
    );
    io_common::check_invariants(&worker, 2);
    // Target 1 may still be hashing its verify control: it lets go of the
    // payload once done, a few milliseconds later.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !io_common::payload_holders(identity).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(io_common::payload_holders(identity), Vec::<String>::new());
    // The next register of the right digest, in another file, is verified
    // by target 1 again (the refused one's record names another file).
    let handle = worker
        .register_memfd_hashed(written(), payload_sha256, None)
        .unwrap();
    echoes_on_both_targets(&worker, &handle, b"[6]");
    worker.close();
}

/// `handle` (an echo) answers `input` on targets 0 and 1.
fn echoes_on_both_targets<R: callreg::runtime::Runtime>(
    worker: &callreg::io::Worker<R>,
    handle: &callreg::protocol::Handle,
    input: &[u8],
) {
    for target in [0, 1] {
        let echoed = worker
            .submit(
                handle,
                TargetId(target),
                callreg::runtime::TaskEncoding::Json,
                input,
            )
            .unwrap();
        assert_eq!(echoed, input);
    }
}
