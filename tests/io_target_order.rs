//! A target driven frame by frame over its own control socket and reply
//! pipe (no Worker in between), to pin down the order in which it applies
//! frames that arrive together: a task pins its slot in frame order
//! relative to unregisters, whichever of the target's threads pins it
//! (the thread that read it, for a task that finds the control thread
//! idle, or the control thread behind the controls queued before it). And
//! which of its threads reads the control socket: the task thread while
//! it waits for a run, the reader while it runs one.
//!
//! A `harness = false` binary run by the runner of `tests/io_common/mod.rs`
//! (it forks: each test on the main thread; no staged payload and no child
//! is left).

mod io_common;

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use callreg::descriptor::{python_serialized_digest, Digest};
use callreg::envelope::{encode, Envelope};
use callreg::error::ErrorCode;
use callreg::io::process::{send_control, spawn_targets, Exit, TargetProcess, ThreadPolicy};
use callreg::io::target::{run, TargetSetup};
use callreg::runtime::testing::TestRuntime;
use callreg::runtime::TaskEncoding;
use callreg::wire::{Frame, FrameBuffer, TaskFailure};
use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

fn main() {
    io_common::run(&[
        (
            "a_task_behind_the_last_unregister_of_its_digest_finds_it_gone",
            a_task_behind_the_last_unregister_of_its_digest_finds_it_gone,
        ),
        (
            "a_task_before_the_last_unregister_of_its_digest_runs",
            a_task_before_the_last_unregister_of_its_digest_runs,
        ),
        (
            "tasks_on_an_idle_target_are_answered_in_order",
            tasks_on_an_idle_target_are_answered_in_order,
        ),
        (
            "a_round_trip_on_an_idle_target_wakes_only_its_task_thread",
            a_round_trip_on_an_idle_target_wakes_only_its_task_thread,
        ),
        (
            "a_control_sent_during_a_task_is_read_and_answered_by_the_reader",
            a_control_sent_during_a_task_is_read_and_answered_by_the_reader,
        ),
        (
            "frames_sent_one_per_write_are_each_answered_once_in_order",
            frames_sent_one_per_write_are_each_answered_once_in_order,
        ),
    ]);
}

const MAX_FRAME: usize = 1 << 16;

/// A forked target serving a snapshot of one `instruction` callable; this
/// side holds the other ends of its control socket and reply socket (both
/// non-blocking).
struct RawTarget {
    process: TargetProcess,
    buffer: FrameBuffer,
    digest: Digest,
}

impl RawTarget {
    fn start(instruction: &str) -> RawTarget {
        let bytes = encode(instruction.as_bytes());
        let digest = python_serialized_digest(&Envelope::parse(&bytes).unwrap());
        let setup = TargetSetup {
            runtime: Arc::new(TestRuntime),
            snapshot: vec![(digest, 1)],
            envelopes: std::sync::Mutex::new(BTreeMap::from([(digest, Arc::new(bytes))])),
            metadata: BTreeMap::new(),
            slot_capacity: 4,
            max_frame_bytes: MAX_FRAME,
            heartbeat: Duration::from_secs(60),
            spin: Duration::ZERO,
        };
        // The test harness runs other threads; the target only runs its
        // own code.
        let mut processes = spawn_targets(
            1,
            ThreadPolicy::AcceptRisk,
            &TestRuntime,
            |_| {},
            |ends| run(ends, &setup),
        )
        .unwrap();
        let mut target = RawTarget {
            process: processes.remove(0),
            buffer: FrameBuffer::new(MAX_FRAME).unwrap(),
            digest,
        };
        match target.next() {
            Frame::Ready { snapshot, .. } => assert_eq!(snapshot, vec![(digest, Ok(()))]),
            other => panic!("expected Ready, got {other:?}"),
        }
        target
    }

    /// Writes `frames` to the control socket, in one write when it fits.
    fn send(&mut self, frames: &[Frame]) {
        let mut bytes = Vec::new();
        for frame in frames {
            bytes.extend(frame.encode(MAX_FRAME).unwrap());
        }
        let mut written = 0;
        while written < bytes.len() {
            let socket = self.process.control().unwrap();
            match send_control(socket, &bytes[written..], None) {
                Ok(n) => written += n,
                Err(Errno::EAGAIN) => {
                    let mut fds = [PollFd::new(socket, PollFlags::POLLOUT)];
                    poll(&mut fds, PollTimeout::from(5000u16)).unwrap();
                }
                Err(e) => panic!("writing controls: {e}"),
            }
        }
    }

    /// The next frame from the reply socket (within 5 s).
    fn next(&mut self) -> Frame {
        loop {
            if let Some(frame) = self.buffer.next_frame().unwrap() {
                return frame;
            }
            let reply = self.process.reply();
            let mut fds = [PollFd::new(reply, PollFlags::POLLIN)];
            assert_eq!(
                poll(&mut fds, PollTimeout::from(5000u16)).unwrap(),
                1,
                "no reply in 5 s"
            );
            let mut chunk = [0u8; 4096];
            match nix::unistd::read(reply.as_fd(), &mut chunk) {
                Ok(0) => panic!("the target closed its reply socket"),
                Ok(n) => self.buffer.extend(&chunk[..n]),
                Err(Errno::EAGAIN) => {}
                Err(e) => panic!("reading replies: {e}"),
            }
        }
    }

    /// The next `n` frames other than [`Frame::Alive`] and
    /// [`Frame::Started`]; each task's successful result must follow its
    /// start report (`specs/protocol.md` §2.12), sent once.
    fn answers(&mut self, n: usize) -> Vec<Frame> {
        let mut answers = Vec::new();
        let mut started = std::collections::BTreeSet::new();
        while answers.len() < n {
            match self.next() {
                Frame::Alive { .. } => {}
                Frame::Started { seq } => assert!(started.insert(seq), "started twice: {seq}"),
                frame => {
                    // A task that never began (its digest gone) fails
                    // without a start.
                    if let Frame::TaskResult { seq, result, .. } = &frame {
                        assert!(
                            started.remove(seq) || result.is_err(),
                            "a result before its start: {seq}"
                        );
                    }
                    answers.push(frame)
                }
            }
        }
        answers
    }

    /// Closes the control socket and reaps the target (exit status 0).
    fn end(mut self) {
        self.process.close_control();
        assert_eq!(
            self.process.reap(Duration::from_secs(5)).unwrap(),
            Exit::Code(0)
        );
    }
}

fn task(seq: u64, digest: Digest, input: &[u8]) -> Frame {
    Frame::Task {
        seq,
        digest,
        encoding: TaskEncoding::Json,
        input: input.to_vec(),
    }
}

fn a_task_behind_the_last_unregister_of_its_digest_finds_it_gone() {
    let mut target = RawTarget::start("echo");
    let digest = target.digest;
    // Together: the unregister is queued for the control thread when the
    // reader reads the task, which therefore waits its turn there.
    target.send(&[Frame::Unregister { seq: 1, digest }, task(2, digest, b"x")]);
    let answers = target.answers(2);
    assert_eq!(
        answers[0],
        Frame::Reply {
            seq: 1,
            digest,
            result: Ok(())
        }
    );
    match &answers[1] {
        Frame::TaskResult {
            seq: 2,
            digest: d,
            result: Err(TaskFailure { code, .. }),
        } => {
            assert_eq!(*d, digest);
            assert_eq!(*code, ErrorCode::DIGEST_NOT_INSTALLED);
        }
        other => panic!("expected the task to fail DIGEST_NOT_INSTALLED, got {other:?}"),
    }
    target.end();
}

fn a_task_before_the_last_unregister_of_its_digest_runs() {
    let mut target = RawTarget::start("sleep 200");
    let digest = target.digest;
    // The task finds the target idle (pinned by the reader); the
    // unregister behind it is answered while it runs, and the run keeps
    // its callable.
    target.send(&[
        task(1, digest, b"ran"),
        Frame::Unregister { seq: 2, digest },
    ]);
    let answers = target.answers(2);
    assert_eq!(
        answers,
        vec![
            Frame::Reply {
                seq: 2,
                digest,
                result: Ok(())
            },
            Frame::TaskResult {
                seq: 1,
                digest,
                result: Ok(b"ran".to_vec())
            },
        ]
    );
    // Behind both, in a later write: the digest is gone.
    target.send(&[task(3, digest, b"x")]);
    match target.answers(1).as_slice() {
        [Frame::TaskResult {
            seq: 3,
            result: Err(TaskFailure { code, .. }),
            ..
        }] => assert_eq!(*code, ErrorCode::DIGEST_NOT_INSTALLED),
        other => panic!("expected the task to fail DIGEST_NOT_INSTALLED, got {other:?}"),
    }
    target.end();
}

fn tasks_on_an_idle_target_are_answered_in_order() {
    let mut target = RawTarget::start("echo");
    let digest = target.digest;
    let frames: Vec<Frame> = (1..=50)
        .map(|seq| task(seq, digest, format!("{seq}").as_bytes()))
        .collect();
    target.send(&frames);
    let answers = target.answers(50);
    for (seq, answer) in (1..=50u64).zip(answers) {
        assert_eq!(
            answer,
            Frame::TaskResult {
                seq,
                digest,
                result: Ok(format!("{seq}").into_bytes())
            }
        );
    }
    target.end();
}

/// How often each named thread of process `pid` slept and was woken so
/// far (its voluntary context switches), by thread name.
fn sleeps_by_thread(pid: i32) -> BTreeMap<String, u64> {
    let mut sleeps = BTreeMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = task.unwrap().path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let Ok(status) = std::fs::read_to_string(dir.join("status")) else {
            continue;
        };
        let count: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        *sleeps.entry(name.trim().to_owned()).or_default() += count;
    }
    sleeps
}

fn a_round_trip_on_an_idle_target_wakes_only_its_task_thread() {
    let mut target = RawTarget::start("echo");
    let digest = target.digest;
    let pid = target.process.pid().as_raw();
    // Settled: every thread waits.
    std::thread::sleep(Duration::from_millis(50));
    let before = sleeps_by_thread(pid);
    for seq in 1..=40u64 {
        target.send(&[task(seq, digest, b"x")]);
        assert_eq!(
            target.answers(1),
            vec![Frame::TaskResult {
                seq,
                digest,
                result: Ok(b"x".to_vec())
            }]
        );
        // The task thread is back in its wait before the next task (with
        // time to spare on a busy machine).
        std::thread::sleep(Duration::from_millis(20));
    }
    let after = sleeps_by_thread(pid);
    let woken = |name: &str| after[name] - before[name];
    // The task thread slept once per task, in its wait on the socket.
    assert!(woken("callreg-task") >= 40, "{before:?} -> {after:?}");
    assert_eq!(woken("callreg-reader"), 0, "{before:?} -> {after:?}");
    assert_eq!(woken("callreg-beat"), 0, "{before:?} -> {after:?}");
    target.end();
}

fn a_control_sent_during_a_task_is_read_and_answered_by_the_reader() {
    let mut target = RawTarget::start("sleep 300");
    let digest = target.digest;
    let pid = target.process.pid().as_raw();
    std::thread::sleep(Duration::from_millis(50));
    let before = sleeps_by_thread(pid);
    target.send(&[task(1, digest, b"ran")]);
    // The task thread read the task and runs it: the unregister comes in
    // a later write, which only the reader is there to read.
    std::thread::sleep(Duration::from_millis(100));
    target.send(&[Frame::Unregister { seq: 2, digest }]);
    assert_eq!(
        target.answers(2),
        vec![
            Frame::Reply {
                seq: 2,
                digest,
                result: Ok(())
            },
            Frame::TaskResult {
                seq: 1,
                digest,
                result: Ok(b"ran".to_vec())
            },
        ]
    );
    let after = sleeps_by_thread(pid);
    assert!(
        after["callreg-reader"] > before["callreg-reader"],
        "{before:?} -> {after:?}"
    );
    target.end();
}

fn frames_sent_one_per_write_are_each_answered_once_in_order() {
    // Tasks and inspections, each in its own write, sent while earlier
    // tasks run: the task thread and the reader take turns reading them.
    let mut target = RawTarget::start("echo");
    let digest = target.digest;
    let mut tasks = 0u64;
    for seq in 1..=400u64 {
        let frame = if seq % 5 == 0 {
            Frame::Inspect { seq }
        } else {
            tasks += 1;
            task(seq, digest, format!("{seq}").as_bytes())
        };
        target.send(&[frame]);
    }
    let answers = target.answers(400);
    let results: Vec<u64> = answers
        .iter()
        .filter_map(|a| match a {
            Frame::TaskResult {
                seq,
                result: Ok(output),
                ..
            } => {
                assert_eq!(output, format!("{seq}").as_bytes());
                Some(*seq)
            }
            Frame::Table { .. } => None,
            other => panic!("expected a result or a table, got {other:?}"),
        })
        .collect();
    let expected: Vec<u64> = (1..=400u64).filter(|s| s % 5 != 0).collect();
    assert_eq!(results.len() as u64, tasks);
    assert_eq!(results, expected, "task results in frame order, each once");
    let mut tables: Vec<u64> = answers
        .iter()
        .filter_map(|a| match a {
            Frame::Table { seq, entries, .. } => {
                assert_eq!(entries.len(), 1);
                Some(*seq)
            }
            _ => None,
        })
        .collect();
    tables.sort_unstable();
    assert_eq!(tables, (1..=80u64).map(|k| k * 5).collect::<Vec<_>>());
    target.end();
}
