//! The latency cost of probe-first (`specs/protocol.md` §2.8): a register
//! of a callable no target has installed yet, sent to one target first and
//! to the others once it confirmed, against the same register sent to
//! every target at once (`WorkerBuilder::probe_first(false)`), in the same
//! run.
//!
//! For 2, 4 and 16 targets (test runtime, 64-byte payloads): two started
//! Workers side by side, one per policy; `ROUNDS` rounds, each registering
//! one fresh envelope (a digest never seen before) on each Worker in turn
//! (alternating which goes first, so load swings hit both alike), timing
//! the register; the unregister that frees its slot is outside the timing.
//! Prints, per policy, the median and 90th percentile wall time of one
//! register, and the CPU time (user + system) of the whole process (the
//! callers and the IO thread) and of its targets per register and
//! unregister pair; then the probe / broadcast ratios.
//!
//! Run: `cargo bench --features io --bench probe` (results in
//! `BENCHMARKS.md`, every run in `benchmarks/HISTORY.md`).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use callreg::io::Worker;
use callreg::protocol::TargetId;
use callreg::runtime::testing::TestRuntime;

const ROUNDS: usize = 400;
const TARGET_COUNTS: [u16; 3] = [2, 4, 16];

fn worker(targets: u16, probe_first: bool) -> Worker<TestRuntime> {
    let worker = Worker::builder(Arc::new(TestRuntime))
        .targets(targets)
        .probe_first(probe_first)
        // The other Worker's IO thread runs when this one starts.
        .accept_thread_risk()
        .build()
        .expect("build");
    worker.start().expect("start");
    worker
}

/// A 64-byte `echo` envelope no other round uses (a fresh digest).
fn fresh_envelope(round: usize, policy: &str) -> Vec<u8> {
    common::echo_envelope(&format!("{policy} {round} "), 64)
}

/// User + system CPU of this process (every thread), from getrusage.
fn own_cpu() -> Duration {
    Duration::from_nanos(common::rusage_cpu_ns(libc::RUSAGE_SELF))
}

/// User + system CPU used so far by the live targets of `worker`.
fn targets_cpu(worker: &Worker<TestRuntime>, targets: u16) -> Duration {
    // SAFETY: sysconf reads a constant.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let mut ticks = 0u64;
    for t in 0..targets {
        let Some(pid) = worker.target_pid(TargetId(t)) else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let rest = stat.rsplit(')').next().unwrap_or("");
        let fields: Vec<&str> = rest.split_whitespace().collect();
        for n in [14usize, 15] {
            ticks += fields
                .get(n - 3)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Duration::from_micros(ticks * 1_000_000 / tick)
}

struct Measured {
    walls: Vec<Duration>,
    own_cpu: Duration,
    targets_cpu: Duration,
}

impl Measured {
    fn new() -> Measured {
        Measured {
            walls: Vec::with_capacity(ROUNDS),
            own_cpu: Duration::ZERO,
            targets_cpu: Duration::ZERO,
        }
    }

    fn percentile(&self, p: usize) -> Duration {
        common::percentile(&self.walls, p)
    }
}

fn one(worker: &Worker<TestRuntime>, envelope: &[u8], into: &mut Measured) {
    let cpu_before = own_cpu();
    let started = Instant::now();
    let handle = worker.register(envelope).expect("register");
    into.walls.push(started.elapsed());
    worker.unregister(&handle).expect("unregister");
    into.own_cpu += own_cpu().saturating_sub(cpu_before);
}

fn micros(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is accepted.
    for targets in TARGET_COUNTS {
        let probing = worker(targets, true);
        let broadcasting = worker(targets, false);
        let mut probe = Measured::new();
        let mut broadcast = Measured::new();
        // Warm-up: a few rounds not counted.
        for round in 0..20 {
            one(
                &probing,
                &fresh_envelope(round, "warm-p"),
                &mut Measured::new(),
            );
            one(
                &broadcasting,
                &fresh_envelope(round, "warm-b"),
                &mut Measured::new(),
            );
        }
        // Each Worker's targets are its own processes: their CPU over all
        // rounds (clock ticks, 10 ms each) is theirs alone.
        let probe_targets = targets_cpu(&probing, targets);
        let broadcast_targets = targets_cpu(&broadcasting, targets);
        for round in 0..ROUNDS {
            let p = fresh_envelope(round, "p");
            let b = fresh_envelope(round, "b");
            common::interleaved(
                round,
                || one(&probing, &p, &mut probe),
                || one(&broadcasting, &b, &mut broadcast),
            );
        }
        probe.targets_cpu = targets_cpu(&probing, targets).saturating_sub(probe_targets);
        broadcast.targets_cpu =
            targets_cpu(&broadcasting, targets).saturating_sub(broadcast_targets);
        assert_eq!(probing.live_targets().len(), usize::from(targets));
        let rounds = ROUNDS as u32;
        for (name, m) in [("probe-first", &probe), ("broadcast", &broadcast)] {
            println!(
                "first_register/{targets}/{name}: median {}, p90 {}; CPU per register + unregister: process {}, targets {}",
                micros(m.percentile(50)),
                micros(m.percentile(90)),
                micros(m.own_cpu / rounds),
                micros(m.targets_cpu / rounds),
            );
        }
        let ratio = |a: Duration, b: Duration| {
            if b.is_zero() {
                "n/a".to_owned()
            } else {
                format!("{:.2}", a.as_secs_f64() / b.as_secs_f64())
            }
        };
        println!(
            "first_register/{targets}: probe / broadcast: median {}, p90 {}, process CPU {}, targets CPU {}",
            ratio(probe.percentile(50), broadcast.percentile(50)),
            ratio(probe.percentile(90), broadcast.percentile(90)),
            ratio(probe.own_cpu, broadcast.own_cpu),
            ratio(probe.targets_cpu, broadcast.targets_cpu),
        );
        probing.close();
        broadcasting.close();
    }
}
