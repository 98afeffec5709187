//! Leader/followers over real targets (`src/io/lead.rs`): a caller that
//! waits reads the replies itself when no other caller does, so a round
//! trip wakes no thread of the parent but the caller; a follower is served
//! by its leader, or by the IO thread once its leader stepped down; a
//! result nobody waits for (a callback, a dropped or polled pending) is
//! still read. Every test ends with no staged payload (memfd descriptor or mapping)
//! and no child left (checked by the runner).

mod io_common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use callreg::io::worker::Worker;
use callreg::protocol::TargetId;
use callreg::runtime::testing::TestRuntime;
use callreg::runtime::TaskEncoding;
use io_common::{builder, check_invariants, envelope};

fn main() {
    io_common::run(&[
        (
            "a_round_trip_wakes_no_parent_thread_but_the_caller",
            a_round_trip_wakes_no_parent_thread_but_the_caller,
        ),
        (
            "a_follower_is_served_while_its_leader_waits",
            a_follower_is_served_while_its_leader_waits,
        ),
        (
            "a_follower_is_served_after_its_leader_stepped_down",
            a_follower_is_served_after_its_leader_stepped_down,
        ),
        (
            "results_nobody_waits_for_are_read",
            results_nobody_waits_for_are_read,
        ),
        (
            "many_callers_callbacks_and_pollers_at_once",
            many_callers_callbacks_and_pollers_at_once,
        ),
        (
            "a_leader_whose_target_is_killed_gets_target_lost",
            a_leader_whose_target_is_killed_gets_target_lost,
        ),
        ("a_close_ends_a_leaders_wait", a_close_ends_a_leaders_wait),
        (
            "tasks_left_to_the_io_thread_keep_their_place",
            tasks_left_to_the_io_thread_keep_their_place,
        ),
        (
            "a_callback_that_panics_strands_no_one",
            a_callback_that_panics_strands_no_one,
        ),
        (
            "a_callback_may_start_tasks_but_not_wait",
            a_callback_may_start_tasks_but_not_wait,
        ),
    ]);
}

/// The voluntary context switches of this process's `callreg-io` thread:
/// how often it slept and was woken.
fn io_thread_sleeps() -> u64 {
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = task.unwrap().path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim() != "callreg-io" {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap();
        let line = status
            .lines()
            .find(|l| l.starts_with("voluntary_ctxt_switches:"))
            .unwrap();
        return line.split_whitespace().nth(1).unwrap().parse().unwrap();
    }
    panic!("no callreg-io thread");
}

/// A thread running one task on `worker`, waiting for its result.
fn submitting(
    worker: &Arc<Worker<TestRuntime>>,
    handle: callreg::protocol::Handle,
    target: TargetId,
    input: &'static [u8],
) -> std::thread::JoinHandle<Result<Vec<u8>, callreg::io::worker::TaskError>> {
    let worker = worker.clone();
    std::thread::spawn(move || worker.submit(&handle, target, TaskEncoding::Json, input))
}

/// Joins `thread`, failing if it is still waiting after 20 s (a stranded
/// waiter).
fn join_within<T>(thread: std::thread::JoinHandle<T>, what: &str) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !thread.is_finished() {
        assert!(
            Instant::now() < deadline,
            "{what}: still waiting after 20 s"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    thread.join().unwrap()
}

fn a_round_trip_wakes_no_parent_thread_but_the_caller() {
    // A control timeout past the test's length: no deadline of the
    // register wakes the IO thread meanwhile.
    let worker = builder(1)
        .respawn_limit(0)
        .control_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    worker.start().unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    // Let the IO thread settle after start and the register.
    std::thread::sleep(Duration::from_millis(50));
    let before = io_thread_sleeps();
    for i in 0..200u32 {
        let input = format!("[{i}]");
        let output = worker
            .submit(&echo, TargetId(0), TaskEncoding::Json, input.as_bytes())
            .unwrap();
        assert_eq!(output, input.as_bytes());
    }
    let woken = io_thread_sleeps() - before;
    // The IO thread used to be woken twice per round trip (the request,
    // then the reply); now only the caller reads the reply.
    assert_eq!(woken, 0, "the IO thread was woken {woken} times");
    check_invariants(&worker, 1);
}

fn a_follower_is_served_while_its_leader_waits() {
    let worker = Arc::new(builder(2).respawn_limit(0).build().unwrap());
    worker.start().unwrap();
    let slow = worker.register(&envelope("sleep 1500")).unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    let order = Arc::new(AtomicUsize::new(0));
    let leader = {
        let (worker, order) = (worker.clone(), order.clone());
        std::thread::spawn(move || {
            let output = worker.submit(&slow, TargetId(0), TaskEncoding::Json, b"[1]");
            (output, order.fetch_add(1, Ordering::SeqCst))
        })
    };
    // The slow task's caller leads while it waits; this one follows (or
    // leads, if it comes first) and is served long before the slow task
    // ends.
    std::thread::sleep(Duration::from_millis(100));
    for i in 0..20u32 {
        let input = format!("[{i}]");
        let output = worker
            .submit(&echo, TargetId(1), TaskEncoding::Json, input.as_bytes())
            .unwrap();
        assert_eq!(output, input.as_bytes());
    }
    let quick_done = order.fetch_add(1, Ordering::SeqCst);
    let (output, slow_done) = join_within(leader, "the slow task's caller");
    assert_eq!(output.unwrap(), b"[1]");
    assert_eq!((quick_done, slow_done), (0, 1));
    check_invariants(&worker, 2);
}

fn a_follower_is_served_after_its_leader_stepped_down() {
    // A control timeout past the test's own limit: no deadline of the
    // registers below wakes the IO thread while the follower waits.
    let worker = Arc::new(
        builder(2)
            .respawn_limit(0)
            .control_timeout(Duration::from_secs(60))
            .build()
            .unwrap(),
    );
    worker.start().unwrap();
    let short = worker.register(&envelope("sleep 200")).unwrap();
    let long = worker.register(&envelope("sleep 800")).unwrap();
    // The short task's caller leads (it waits first), the long one's
    // follows; the leader steps down at 200 ms, and the follower's reply,
    // at 800 ms, must still be read.
    let leader = submitting(&worker, short, TargetId(0), b"[1]");
    std::thread::sleep(Duration::from_millis(50));
    let follower = submitting(&worker, long, TargetId(1), b"[2]");
    assert_eq!(join_within(leader, "the leader").unwrap(), b"[1]");
    assert_eq!(join_within(follower, "the follower").unwrap(), b"[2]");
    check_invariants(&worker, 2);
}

fn results_nobody_waits_for_are_read() {
    let worker = builder(1).respawn_limit(0).build().unwrap();
    worker.start().unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    // A callback: nobody waits, the IO thread reads the result.
    let (sender, results) = mpsc::channel();
    worker
        .submit_async(&echo, TargetId(0), TaskEncoding::Json, b"[7]")
        .on_complete(move |result| sender.send(result).unwrap());
    let result = results.recv_timeout(Duration::from_secs(20)).unwrap();
    assert_eq!(result.unwrap(), b"[7]");
    // A pending polled, never waited on.
    let polled = worker.submit_async(&echo, TargetId(0), TaskEncoding::Json, b"[8]");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !polled.is_complete() {
        assert!(Instant::now() < deadline, "the polled task never completed");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(polled.wait().unwrap(), b"[8]");
    // A register whose pending is dropped still completes: its handle is
    // published and it serves.
    let other = envelope("add");
    drop(worker.register_async(&other).unwrap());
    let deadline = Instant::now() + Duration::from_secs(20);
    let digest = {
        let parsed = callreg::envelope::Envelope::parse(&other).unwrap();
        callreg::descriptor::python_serialized_digest(&parsed)
    };
    while !worker
        .parent_state()
        .is_live(digest, callreg::protocol::Namespace::LocalPython)
    {
        assert!(
            Instant::now() < deadline,
            "the dropped register never completed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Registering it again gives a second handle to what is installed.
    let add = worker.register(&other).unwrap();
    assert_eq!(
        worker
            .submit(
                &add,
                TargetId(0),
                TaskEncoding::Json,
                br#"{"args": [40, 2], "kwargs": {}}"#
            )
            .unwrap(),
        b"42"
    );
    // The dropped register's handle is gone with its pending; unregister
    // the one we hold and the registry still has the other.
    worker.unregister(&add).unwrap();
    check_invariants(&worker, 1);
}

fn many_callers_callbacks_and_pollers_at_once() {
    const TARGETS: u16 = 3;
    const CALLS: u32 = 150;
    let worker = Arc::new(builder(TARGETS).respawn_limit(0).build().unwrap());
    worker.start().unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    let mut threads = Vec::new();
    for caller in 0..4u32 {
        let worker = worker.clone();
        threads.push(std::thread::spawn(move || {
            for i in 0..CALLS {
                let input = format!("[{caller}, {i}]");
                let target = TargetId(u16::try_from((caller + i) % 3).unwrap());
                let output = match i % 3 {
                    // Waiting: leads or follows.
                    0 => worker.submit(&echo, target, TaskEncoding::Json, input.as_bytes()),
                    // Waiting in slices, as the Python package does.
                    1 => {
                        let mut pending = worker.submit_async(
                            &echo,
                            target,
                            TaskEncoding::Json,
                            input.as_bytes(),
                        );
                        loop {
                            match pending.wait_timeout(Duration::from_micros(50)) {
                                Ok(result) => break result,
                                Err(again) => pending = again,
                            }
                        }
                    }
                    // A callback, read by whichever thread reads replies.
                    _ => {
                        let (sender, result) = mpsc::channel();
                        worker
                            .submit_async(&echo, target, TaskEncoding::Json, input.as_bytes())
                            .on_complete(move |r| sender.send(r).unwrap());
                        result.recv_timeout(Duration::from_secs(20)).unwrap()
                    }
                };
                assert_eq!(
                    output.unwrap(),
                    input.as_bytes(),
                    "caller {caller}, call {i}"
                );
            }
        }));
    }
    // Registers and unregisters meanwhile, from one more thread.
    {
        let worker = worker.clone();
        threads.push(std::thread::spawn(move || {
            for i in 0..30 {
                let handle = worker.register(&envelope(&format!("echo {i}"))).unwrap();
                worker.unregister(&handle).unwrap();
            }
        }));
    }
    for (n, thread) in threads.into_iter().enumerate() {
        join_within(thread, &format!("thread {n}"));
    }
    check_invariants(&worker, TARGETS);
}

fn a_leader_whose_target_is_killed_gets_target_lost() {
    let worker = builder(2).respawn_limit(0).build().unwrap();
    worker.start().unwrap();
    let slow = worker.register(&envelope("sleep 5000")).unwrap();
    let pid = worker.target_pid(TargetId(0)).unwrap();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    });
    let error = worker
        .submit(&slow, TargetId(0), TaskEncoding::Json, b"[1]")
        .unwrap_err();
    killer.join().unwrap();
    assert_eq!(error.error.code, callreg::error::ErrorCode::TARGET_LOST);
    assert_eq!(worker.live_targets(), vec![TargetId(1)]);
    check_invariants(&worker, 2);
}

fn a_close_ends_a_leaders_wait() {
    let worker: Arc<Worker<TestRuntime>> = Arc::new(builder(1).respawn_limit(0).build().unwrap());
    worker.start().unwrap();
    let slow = worker.register(&envelope("sleep 10000")).unwrap();
    let leader = submitting(&worker, slow, TargetId(0), b"[1]");
    std::thread::sleep(Duration::from_millis(100));
    worker.close();
    let error = join_within(leader, "the leader").unwrap_err();
    assert_eq!(
        error.error.code,
        callreg::error::ErrorCode::LIFECYCLE_INVALID
    );
    assert_eq!(
        error.error.message,
        "the Worker closed before the task's result arrived"
    );
}

fn tasks_left_to_the_io_thread_keep_their_place() {
    let worker = builder(2).respawn_limit(0).build().unwrap();
    worker.start().unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    // The IO thread held after its next wake-up: the tasks below stay in
    // its queue until the unregister carries them out.
    #[cfg(feature = "failpoints")]
    fail::cfg(callreg::io::failpoints::PARENT_IO_TURN, "pause").unwrap();
    let (sender, results) = mpsc::channel();
    for i in 0..50u32 {
        let sender = sender.clone();
        let target = TargetId(u16::try_from(i % 2).unwrap());
        let input = format!("[{i}]");
        worker.submit_then(
            &echo,
            target,
            TaskEncoding::Json,
            input.as_bytes(),
            move |r| sender.send((i, r)).unwrap(),
        );
    }
    // Carried out by this thread at once, after the queued tasks: had it
    // overtaken them, they would find the handle unregistered.
    worker.unregister(&echo).unwrap();
    #[cfg(feature = "failpoints")]
    fail::remove(callreg::io::failpoints::PARENT_IO_TURN);
    let mut seen = Vec::new();
    for _ in 0..50 {
        let (i, result) = results.recv_timeout(Duration::from_secs(20)).unwrap();
        assert_eq!(result.unwrap(), format!("[{i}]").as_bytes(), "task {i}");
        seen.push(i);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..50).collect::<Vec<_>>());
    // After the unregister, a task left to the IO thread is refused there.
    let (sender, result) = mpsc::channel();
    worker.submit_then(&echo, TargetId(0), TaskEncoding::Json, b"[1]", move |r| {
        sender.send(r).unwrap()
    });
    let error = result
        .recv_timeout(Duration::from_secs(20))
        .unwrap()
        .unwrap_err();
    assert_eq!(error.error.code, callreg::error::ErrorCode::HANDLE_STALE);
    check_invariants(&worker, 2);
    // Closed: the callback hears why at once.
    worker.close();
    let (sender, result) = mpsc::channel();
    worker.submit_then(&echo, TargetId(0), TaskEncoding::Json, b"[1]", move |r| {
        sender.send(r).unwrap()
    });
    let error = result.try_recv().unwrap().unwrap_err();
    assert_eq!(
        error.error.code,
        callreg::error::ErrorCode::LIFECYCLE_INVALID
    );
    assert_eq!(error.error.message, "the Worker is closed");
}

fn a_callback_that_panics_strands_no_one() {
    let worker = Arc::new(builder(2).respawn_limit(0).build().unwrap());
    worker.start().unwrap();
    let slow = worker.register(&envelope("sleep 300")).unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    // This caller leads while its slow task runs, so it reads the quick
    // task's result below and runs its callback, which panics: contained,
    // the leader goes on to its own result.
    let leader = submitting(&worker, slow, TargetId(0), b"[1]");
    std::thread::sleep(Duration::from_millis(50));
    // `submit_then`: the callback runs where the result is read.
    worker.submit_then(&echo, TargetId(1), TaskEncoding::Json, b"[2]", |_| {
        panic!("a callback that panics")
    });
    assert_eq!(join_within(leader, "the leader").unwrap(), b"[1]");
    // Nobody leads now: the IO thread runs the callbacks, a panicking one
    // too, and goes on.
    // `submit_then`: the callback runs where the result is read.
    worker.submit_then(&echo, TargetId(0), TaskEncoding::Json, b"[3]", |_| {
        panic!("another callback that panics")
    });
    let (sender, result) = mpsc::channel();
    worker
        .submit_async(&echo, TargetId(0), TaskEncoding::Json, b"[4]")
        .on_complete(move |r| sender.send(r).unwrap());
    let output = result.recv_timeout(Duration::from_secs(20)).unwrap();
    assert_eq!(output.unwrap(), b"[4]");
    assert_eq!(
        worker
            .submit(&echo, TargetId(1), TaskEncoding::Json, b"[5]")
            .unwrap(),
        b"[5]"
    );
    check_invariants(&worker, 2);
}

fn a_callback_may_start_tasks_but_not_wait() {
    let worker = Arc::new(builder(2).respawn_limit(0).build().unwrap());
    worker.start().unwrap();
    let echo = worker.register(&envelope("echo")).unwrap();
    let slow = worker.register(&envelope("sleep 300")).unwrap();
    for leader in [false, true] {
        // With a leader, the leader runs the callback; without, the IO
        // thread does.
        let leading = leader.then(|| {
            let worker = worker.clone();
            std::thread::spawn(move || {
                worker.submit(&slow, TargetId(0), TaskEncoding::Json, b"[0]")
            })
        });
        std::thread::sleep(Duration::from_millis(50));
        let (sender, results) = mpsc::channel();
        let inner = worker.clone();
        // `submit_then`: the callback runs where the result is read, never
        // at once in this thread (where waiting would be fine).
        worker.submit_then(
            &echo,
            TargetId(1),
            TaskEncoding::Json,
            b"[1]",
            move |first| {
                let waited = inner.submit(&echo, TargetId(1), TaskEncoding::Json, b"[2]");
                let live = inner.live_targets();
                let sender2 = sender.clone();
                inner.submit_then(&echo, TargetId(1), TaskEncoding::Json, b"[3]", move |r| {
                    sender2.send(("then", r)).unwrap()
                });
                sender.send(("first", first)).unwrap();
                sender.send(("waited", waited)).unwrap();
                assert_eq!(live, vec![TargetId(0), TargetId(1)]);
            },
        );
        let mut got = std::collections::BTreeMap::new();
        for _ in 0..3 {
            let (what, result) = results.recv_timeout(Duration::from_secs(20)).unwrap();
            got.insert(what, result);
        }
        assert_eq!(got["first"].as_deref().unwrap(), b"[1]");
        assert_eq!(got["then"].as_deref().unwrap(), b"[3]");
        let error = got["waited"].as_ref().unwrap_err();
        assert_eq!(
            error.error.code,
            callreg::error::ErrorCode::LIFECYCLE_INVALID
        );
        assert_eq!(
            error.error.message,
            "a completion callback must not wait on the Worker (it runs on the thread that reads the replies, which would wait on itself)"
        );
        if let Some(leading) = leading {
            assert_eq!(join_within(leading, "the leader").unwrap(), b"[0]");
        }
    }
    check_invariants(&worker, 2);
}
