//! IO layer benchmarks (criterion; cargo feature `io`):
//!
//! * `register/<targets>/<payload bytes>` and `unregister/…`: latency of one
//!   post-start register (stage, every target opens, verifies and
//!   deserializes, handle published) and of one unregister, for 1, 4, 16
//!   and 64 targets and 64 B, 4 KiB and 1 MiB serializer payloads, with the
//!   test runtime;
//! * `floor/<payload bytes>`: in the same run, the work a register cannot
//!   avoid: one pipe round trip to a child process, creating, writing and
//!   unlinking a shm object of the same size, and two SHA-256 passes over
//!   the payload (the parent's and the target's);
//! * `task/round_trip` against `floor/pipe_round_trip`: one task (16-byte
//!   input, echo) against a bare 16-byte pipe round trip;
//! * after criterion: CPU ticks used by 4 idle targets and the IO thread
//!   over one second (must be 0: once idle they block; a target's spin
//!   ends within its budget after its last task).
//!
//! Run: `cargo bench --features io --bench io` (results in `BENCHMARKS.md`,
//! every run in `benchmarks/HISTORY.md`).

mod common;

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use callreg::descriptor::Digest;
use callreg::envelope::HEADER_LEN;
use callreg::io::staging::StagedPayload;
use callreg::io::Worker;
use callreg::protocol::TargetId;
use callreg::runtime::testing::TestRuntime;
use callreg::runtime::TaskEncoding;
use criterion::{BenchmarkId, Criterion};

const TARGET_COUNTS: [u16; 4] = [1, 4, 16, 64];
const PAYLOAD_SIZES: [usize; 3] = [64, 4096, 1 << 20];

/// An envelope whose serializer payload is `size` bytes: an `echo`
/// instruction padded with a comment.
fn envelope_of(size: usize) -> Vec<u8> {
    common::echo_envelope("", size)
}

fn worker(targets: u16) -> Worker<TestRuntime> {
    let worker = Worker::builder(Arc::new(TestRuntime))
        .targets(targets)
        // Criterion's statistics may have left idle worker threads.
        .accept_thread_risk()
        .build()
        .expect("build");
    worker.start().expect("start");
    worker
}

fn register_and_unregister(c: &mut Criterion) {
    for targets in TARGET_COUNTS {
        let worker = worker(targets);
        let mut group = c.benchmark_group(format!("register/{targets}"));
        for size in PAYLOAD_SIZES {
            let envelope = envelope_of(size);
            group.bench_with_input(
                BenchmarkId::from_parameter(size),
                &envelope,
                |b, envelope| {
                    b.iter_custom(|iterations| {
                        common::time_registers(&worker, envelope, iterations)
                    })
                },
            );
        }
        group.finish();
        let mut group = c.benchmark_group(format!("unregister/{targets}"));
        for size in PAYLOAD_SIZES {
            let envelope = envelope_of(size);
            group.bench_with_input(
                BenchmarkId::from_parameter(size),
                &envelope,
                |b, envelope| {
                    b.iter_custom(|iterations| {
                        common::time_unregisters(&worker, envelope, iterations)
                    })
                },
            );
        }
        group.finish();
        if targets == 1 {
            let handle = worker.register(&envelope_of(64)).expect("register");
            c.bench_function("task/round_trip", |b| {
                b.iter(|| {
                    worker
                        .submit(&handle, TargetId(0), TaskEncoding::Json, &[7u8; 16])
                        .expect("task")
                })
            });
        }
    }
}

/// A forked child that echoes whatever arrives on its pipe, for the pipe
/// round-trip floor.
struct EchoChild {
    pid: nix::unistd::Pid,
    to_child: Option<OwnedFd>,
    from_child: OwnedFd,
}

impl EchoChild {
    fn spawn() -> EchoChild {
        let (child_read, to_child) = nix::unistd::pipe().expect("pipe");
        let (from_child, child_write) = nix::unistd::pipe().expect("pipe");
        // SAFETY: the child only reads and writes its pipes, then `_exit`s.
        match unsafe { nix::unistd::fork() }.expect("fork") {
            nix::unistd::ForkResult::Child => {
                // The parent's ends: the child must not hold them, or its
                // input never reports EOF.
                drop(to_child);
                drop(from_child);
                let mut buffer = [0u8; 4096];
                loop {
                    match nix::unistd::read(child_read.as_fd(), &mut buffer) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if nix::unistd::write(&child_write, &buffer[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                // SAFETY: ends the echo child without the parent's destructors.
                unsafe { libc::_exit(0) }
            }
            nix::unistd::ForkResult::Parent { child } => EchoChild {
                pid: child,
                to_child: Some(to_child),
                from_child,
            },
        }
    }

    fn round_trip(&self, message: &[u8]) {
        let to_child = self.to_child.as_ref().expect("open");
        nix::unistd::write(to_child, message).expect("write");
        let mut buffer = [0u8; 4096];
        let mut got = 0;
        while got < message.len() {
            got += nix::unistd::read(self.from_child.as_fd(), &mut buffer[got..]).expect("read");
        }
    }
}

impl Drop for EchoChild {
    fn drop(&mut self) {
        self.to_child = None;
        let _ = nix::sys::wait::waitpid(self.pid, None);
    }
}

fn floors(c: &mut Criterion) {
    let echo = EchoChild::spawn();
    let mut group = c.benchmark_group("floor");
    for size in PAYLOAD_SIZES {
        let envelope = envelope_of(size);
        group.bench_with_input(
            BenchmarkId::from_parameter(size),
            &envelope,
            |b, envelope| {
                b.iter(|| {
                    // Parent: create, write, hash and seal in one pass
                    // (pass 1).
                    let (staged, hash) =
                        StagedPayload::create(envelope, HEADER_LEN..envelope.len()).expect("stage");
                    // One control frame out, one reply back (about their sizes).
                    echo.round_trip(&[0u8; 96]);
                    // Target: the second hash pass over the payload.
                    let again = Digest::sha256(&envelope[HEADER_LEN..]);
                    assert_eq!(again.0, hash);
                    drop(staged);
                })
            },
        );
    }
    group.bench_function("pipe_round_trip", |b| {
        b.iter(|| echo.round_trip(&[7u8; 16]))
    });
    group.finish();
}

/// Clock ticks (user + system) used so far by thread or process `stat`.
fn ticks(stat_path: &str) -> u64 {
    let stat = std::fs::read_to_string(stat_path).unwrap_or_default();
    // Fields after the `(comm)`: state is field 3; utime 14, stime 15.
    let rest = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| {
        fields
            .get(n - 3)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(14) + field(15)
}

fn io_thread_stat() -> Option<String> {
    for entry in std::fs::read_dir("/proc/self/task").ok()? {
        let path = entry.ok()?.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if comm.trim() == "callreg-io" {
            return Some(path.join("stat").to_string_lossy().into_owned());
        }
    }
    None
}

fn idle_cpu() {
    let worker = worker(4);
    let handle = worker.register(&envelope_of(64)).expect("register");
    worker
        .submit(&handle, TargetId(0), TaskEncoding::Json, b"warm")
        .expect("task");
    let mut paths: Vec<String> = (0..4)
        .filter_map(|t| worker.target_pid(TargetId(t)))
        .map(|pid| format!("/proc/{pid}/stat"))
        .collect();
    paths.extend(io_thread_stat());
    let before: Vec<u64> = paths.iter().map(|p| ticks(p)).collect();
    std::thread::sleep(Duration::from_secs(1));
    let after: Vec<u64> = paths.iter().map(|p| ticks(p)).collect();
    let used: Vec<u64> = before.iter().zip(&after).map(|(b, a)| a - b).collect();
    println!(
        "idle/cpu_ticks_per_second: 4 targets and the IO thread used {used:?} clock ticks \
         (1 tick = 1/{} s) while idle for 1 s",
        // SAFETY: sysconf reads a constant.
        unsafe { libc::sysconf(libc::_SC_CLK_TCK) }
    );
    assert!(
        used.iter().all(|t| *t == 0),
        "idle targets or the IO thread used CPU: {used:?}"
    );
}

fn main() {
    let mut criterion = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    floors(&mut criterion);
    register_and_unregister(&mut criterion);
    criterion.final_summary();
    idle_cpu();
}
