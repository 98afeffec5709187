//! Worker latency and throughput beside their floors, measured in the same
//! process and interleaved round by round, with CPU time beside wall time
//! (cargo feature `io`; `--python` also needs `python`).
//!
//! Each scenario is an operation of the Rust API and its floor: what the
//! same work costs with nothing of callreg in the path, over the same
//! kind of channel to forked child processes ("echo children", forked
//! before any Worker or thread exists):
//!
//! | scenario | operation | floor |
//! |---|---|---|
//! | `round_trip` | one task (16-byte input, echo) on 1 target, submit to result | 16 bytes to an echo child and back |
//! | `register_small/N` | one post-start register of a 64-byte payload into N targets | stage (memfd create, write + SHA-256 in one pass, seal), a 16-byte message to each of N echo children, each hashes the payload again and replies |
//! | `register_1mib/N` | the same with a 1 MiB payload | the same with 1 MiB |
//! | `unregister_small/N`, `unregister_1mib/N` | one unregister of such a handle (the batch's, after all its registers) | a 16-byte message to each of N echo children and their replies |
//! | `unregister_after_register_small/1`, `…_1mib/1` | one unregister right behind its own register (wall time only) | as above |
//! | `in_flight/K/N` | K tasks submitted at once over N targets (round robin), then all waited for | K 16-byte messages over N echo children, written at once, all replies read |
//!
//! Registers are timed in batches of distinct payloads (each is a fresh
//! install), then the batch's unregisters; slot capacity is raised to
//! hold a batch. CPU time per operation is that of the parent process
//! (every thread, `getrusage(RUSAGE_SELF)`) plus every thread of the
//! processes involved (targets, or echo children) from
//! `/proc/PID/task/TID/schedstat` (nanoseconds on CPU).
//!
//! Each round runs every scenario's operation then its floor; the table
//! shows the medians over the rounds and the ratio of the medians.
//!
//! Run: `cargo bench --features io --bench floors` (test runtime: a
//! payload is an instruction, so the figures are the IO layer's own);
//! `cargo bench --features io,python --bench floors -- --python` for
//! Python targets (payloads made by `PYO3_PYTHON` with cloudpickle).
//! Options after `--`: `--rounds N` (default 7), `--respawn-limit N`
//! (the Workers' `respawn_limit`; default: the builder's, replacements
//! on; 0 switches them off), a word to run only the scenarios whose name
//! contains it. Results in `BENCHMARKS.md`, every run in
//! `benchmarks/HISTORY.md`.

mod common;

use std::io::Write as _;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use callreg::envelope::HEADER_LEN;
use callreg::io::staging::StagedPayload;
use callreg::io::Worker;
use callreg::protocol::{Handle, TargetId};
use callreg::runtime::{Runtime, TaskEncoding};
use sha2::{Digest as _, Sha256};

/// Payload sizes of the small and large registers (serializer payload bytes).
const SMALL: usize = 64;
const LARGE: usize = 1 << 20;
/// Target counts of the register scenarios.
const FAN_OUT: [u16; 4] = [1, 2, 4, 8];
/// Registers per timed batch (distinct payloads).
const SMALL_BATCH: usize = 64;
const LARGE_BATCH: usize = 8;
/// Round trips per timed batch.
const ROUND_TRIPS: u64 = 2000;
/// Tasks per timed batch of the in-flight scenarios.
const STREAMED_TASKS: usize = 5000;
/// One echo-child message: bytes of the inherited payload to hash (u64
/// LE), then a tag.
const MESSAGE: usize = 16;

// ---------------------------------------------------------------------
// Echo children (the floors' other side)

/// A forked child that answers each 16-byte message with the same bytes,
/// after hashing as many bytes of its inherited payload as the message
/// asks.
struct EchoChild {
    pid: nix::unistd::Pid,
    to_child: Option<OwnedFd>,
    from_child: OwnedFd,
}

fn echo_loop(input: OwnedFd, output: OwnedFd, payload: &[u8]) -> ! {
    let mut buffer = vec![0u8; 64 * 1024];
    let mut held = 0;
    loop {
        let n = match nix::unistd::read(input.as_fd(), &mut buffer[held..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        held += n;
        let whole = held - held % MESSAGE;
        for message in buffer[..whole].chunks_exact(MESSAGE) {
            let hashed = u64::from_le_bytes(message[..8].try_into().unwrap_or_default());
            let hashed = usize::try_from(hashed)
                .unwrap_or(usize::MAX)
                .min(payload.len());
            if hashed > 0 {
                std::hint::black_box(Sha256::digest(&payload[..hashed]));
            }
        }
        // One `write` per answer, as a target writes each reply.
        for answer in buffer[..whole].chunks_exact(MESSAGE) {
            if nix::unistd::write(&output, answer) != Ok(MESSAGE) {
                // SAFETY: ends the echo child without the parent's destructors.
                unsafe { libc::_exit(1) }
            }
        }
        buffer.copy_within(whole..held, 0);
        held -= whole;
    }
    // SAFETY: ends the echo child without running the parent's destructors.
    unsafe { libc::_exit(0) }
}

impl EchoChild {
    /// Forks one; call before any thread exists.
    fn spawn(payload: &[u8]) -> EchoChild {
        let (child_read, to_child) = nix::unistd::pipe().expect("pipe");
        let (from_child, child_write) = nix::unistd::pipe().expect("pipe");
        // SAFETY: single-threaded here; the child only reads, hashes,
        // writes and `_exit`s.
        match unsafe { nix::unistd::fork() }.expect("fork") {
            nix::unistd::ForkResult::Child => {
                // The parent's ends: the child must not hold them, or its
                // input never reports EOF.
                drop(to_child);
                drop(from_child);
                echo_loop(child_read, child_write, payload)
            }
            nix::unistd::ForkResult::Parent { child } => EchoChild {
                pid: child,
                to_child: Some(to_child),
                from_child,
            },
        }
    }

    fn send(&self, bytes: &[u8]) {
        let to_child = self.to_child.as_ref().expect("open");
        let mut written = 0;
        while written < bytes.len() {
            written += nix::unistd::write(to_child, &bytes[written..]).expect("write");
        }
    }

    fn receive(&self, len: usize, buffer: &mut [u8]) {
        let mut got = 0;
        while got < len {
            let room = (len - got).min(buffer.len());
            let n = nix::unistd::read(self.from_child.as_fd(), &mut buffer[..room]).expect("read");
            assert!(n > 0, "an echo child ended");
            got += n;
        }
    }
}

impl Drop for EchoChild {
    fn drop(&mut self) {
        // Its siblings and the targets forked later hold its input pipe
        // too: no EOF would come.
        let _ = nix::sys::signal::kill(self.pid, nix::sys::signal::Signal::SIGKILL);
        let _ = nix::sys::wait::waitpid(self.pid, None);
    }
}

fn message(hashed: usize) -> [u8; MESSAGE] {
    let mut message = [0u8; MESSAGE];
    message[..8].copy_from_slice(&(hashed as u64).to_le_bytes());
    message
}

struct Pool {
    children: Vec<EchoChild>,
    buffer: Vec<u8>,
}

impl Pool {
    fn pids(&self, n: usize) -> Vec<i32> {
        self.children[..n].iter().map(|c| c.pid.as_raw()).collect()
    }

    /// One message to each of the first `n` children, then every reply.
    fn fan_out(&mut self, n: usize, hashed: usize) {
        let message = message(hashed);
        for child in &self.children[..n] {
            child.send(&message);
        }
        for child in &self.children[..n] {
            child.receive(MESSAGE, &mut self.buffer);
        }
    }

    /// `count` messages spread round robin over the first `n` children,
    /// each by its own `write` (as each task is its own frame), then every
    /// reply (a child answers each message by its own `write`).
    fn stream(&mut self, n: usize, count: usize) {
        let message = message(0);
        let mut expected = vec![0usize; n];
        for i in 0..count {
            self.children[i % n].send(&message);
            expected[i % n] += MESSAGE;
        }
        for (child, len) in self.children.iter().zip(expected) {
            child.receive(len, &mut self.buffer);
        }
    }
}

// ---------------------------------------------------------------------
// CPU time

fn cpu_ns(pids: &[i32]) -> u64 {
    common::rusage_cpu_ns(libc::RUSAGE_SELF)
        + pids.iter().map(|p| common::process_cpu_ns(*p)).sum::<u64>()
}

/// Wall and CPU time per operation of one timed batch.
#[derive(Clone, Copy)]
struct Sample {
    wall_ns: f64,
    cpu_ns: f64,
}

/// Times `batch`, which carries out `ops` operations, with the CPU time
/// of this process and of `pids`.
fn measure(pids: &[i32], ops: usize, batch: impl FnOnce()) -> Sample {
    let cpu_before = cpu_ns(pids);
    let started = Instant::now();
    batch();
    let wall = started.elapsed();
    let cpu = cpu_ns(pids).saturating_sub(cpu_before);
    Sample {
        wall_ns: wall.as_nanos() as f64 / ops as f64,
        cpu_ns: cpu as f64 / ops as f64,
    }
}

/// Per-thread counters of the processes in a round trip.
struct ThreadStats;

impl ThreadStats {
    /// Every thread of `pid`: (path of its `/proc` task directory, a label
    /// "`process` thread N (name)"), with its counters now.
    fn of(pid: i32, process: &str) -> Vec<((String, String), (u64, u64))> {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return Vec::new();
        };
        let mut tasks: Vec<_> = tasks.flatten().map(|t| t.path()).collect();
        tasks.sort();
        tasks
            .into_iter()
            .enumerate()
            .map(|(j, task)| {
                let path = task.to_string_lossy().into_owned();
                let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
                let label = format!("{process} thread {j} ({})", comm.trim());
                let now = ThreadStats::read(&path);
                ((path, label), now)
            })
            .collect()
    }

    /// (nanoseconds on CPU, voluntary context switches) of a thread.
    fn read(task: &str) -> (u64, u64) {
        let cpu = std::fs::read_to_string(format!("{task}/schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        let switches = std::fs::read_to_string(format!("{task}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0);
        (cpu, switches)
    }
}

// ---------------------------------------------------------------------
// Payloads

/// What the Worker side registers and runs.
struct Payloads {
    small: Vec<Vec<u8>>,
    large: Vec<Vec<u8>>,
    task: Vec<u8>,
    input: Vec<u8>,
    expected: Vec<u8>,
}

/// Test runtime: `echo` padded with a comment that makes each distinct.
fn test_payloads() -> Payloads {
    let envelope = |size: usize, i: usize| common::echo_envelope(&format!("{i}#"), size);
    Payloads {
        small: (0..SMALL_BATCH).map(|i| envelope(SMALL, i)).collect(),
        large: (0..LARGE_BATCH).map(|i| envelope(LARGE, i)).collect(),
        task: envelope(SMALL, usize::MAX),
        input: vec![7u8; 16],
        expected: vec![7u8; 16],
    }
}

/// Python: cloudpickled closures (distinct by their constant), closures
/// over 1 MiB of bytes (distinct by their first byte), and `identity`.
#[cfg(feature = "python")]
fn python_payloads() -> Payloads {
    let small = (0..SMALL_BATCH).map(|i| format!("make_adder({i})"));
    let large = (0..LARGE_BATCH)
        .map(|i| format!("make_sized(bytes([{i}]) + bytes(range(256)) * 4095 + bytes(255))"));
    let expressions: Vec<String> = small.chain(large).chain(["identity".to_owned()]).collect();
    let mut envelopes = common::python_envelopes(&expressions).into_iter();
    let small = envelopes.by_ref().take(SMALL_BATCH).collect();
    let large = envelopes.by_ref().take(LARGE_BATCH).collect();
    Payloads {
        small,
        large,
        task: envelopes.next().expect("identity"),
        input: br#"{"args":[7]}"#.to_vec(),
        expected: b"7".to_vec(),
    }
}

// ---------------------------------------------------------------------
// Scenarios

/// One scenario's samples: the operation's and its floor's, per round.
struct Row {
    name: String,
    unit: &'static str,
    op: Vec<Sample>,
    floor: Vec<Sample>,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn shown(ns: f64) -> String {
    if ns.is_nan() {
        "—".to_owned()
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.1} µs", ns / 1e3)
    }
}

struct Bench<'a, R: Runtime> {
    runtime: Arc<R>,
    payloads: &'a Payloads,
    pool: Pool,
    workers: Vec<(u16, Worker<R>)>,
    filter: Option<String>,
    respawn_limit: Option<u16>,
    rows: Vec<Row>,
    /// Round trip, per thread: label, CPU ns per round trip, voluntary
    /// context switches per round trip (one per round).
    threads: Vec<(String, Vec<f64>, Vec<f64>)>,
}

impl<R: Runtime> Bench<'_, R> {
    fn worker(&mut self, targets: u16) -> usize {
        if let Some(i) = self.workers.iter().position(|(n, _)| *n == targets) {
            return i;
        }
        let mut builder = Worker::builder(self.runtime.clone())
            .targets(targets)
            .slot_capacity(256)
            .control_timeout(Duration::from_secs(60))
            .accept_thread_risk();
        if let Some(limit) = self.respawn_limit {
            builder = builder.respawn_limit(limit);
        }
        let worker = builder.build().expect("build");
        worker.start().expect("start");
        self.workers.push((targets, worker));
        self.workers.len() - 1
    }

    fn wanted(&self, name: &str) -> bool {
        self.filter
            .as_ref()
            .is_none_or(|f| name.contains(f.as_str()))
    }

    fn record(&mut self, name: String, unit: &'static str, op: Sample, floor: Sample) {
        match self.rows.iter_mut().find(|r| r.name == name) {
            Some(row) => {
                row.op.push(op);
                row.floor.push(floor);
            }
            None => self.rows.push(Row {
                name,
                unit,
                op: vec![op],
                floor: vec![floor],
            }),
        }
    }

    fn round(&mut self) {
        let nproc = std::thread::available_parallelism().map_or(2, |n| n.get()) as u16;
        if self.wanted("round_trip") {
            let w = self.worker(1);
            let worker = &self.workers[w].1;
            let pids = target_pids(worker);
            let handle = worker.register(&self.payloads.task).expect("register");
            let (input, expected) = (&self.payloads.input, &self.payloads.expected);
            let op = measure(&pids, ROUND_TRIPS as usize, || {
                for _ in 0..ROUND_TRIPS {
                    let result = worker
                        .submit(&handle, TargetId(0), TaskEncoding::Json, input)
                        .expect("task");
                    assert_eq!(&result, expected);
                }
            });
            // The same again, per thread: where a round trip's CPU time and
            // sleeps (voluntary context switches: each is one wake-up) go.
            let mut threads = ThreadStats::of(std::process::id() as i32, "parent");
            for pid in &pids {
                threads.extend(ThreadStats::of(*pid, "target"));
            }
            for _ in 0..ROUND_TRIPS {
                worker
                    .submit(&handle, TargetId(0), TaskEncoding::Json, input)
                    .expect("task");
            }
            for (thread, before) in threads.iter_mut() {
                let after = ThreadStats::read(&thread.0);
                let entry = self
                    .threads
                    .iter_mut()
                    .find(|(name, _, _)| *name == thread.1);
                let cpu = (after.0.saturating_sub(before.0)) as f64 / ROUND_TRIPS as f64;
                let switches = (after.1.saturating_sub(before.1)) as f64 / ROUND_TRIPS as f64;
                match entry {
                    Some((_, cpus, sleeps)) => {
                        cpus.push(cpu);
                        sleeps.push(switches);
                    }
                    None => self
                        .threads
                        .push((thread.1.clone(), vec![cpu], vec![switches])),
                }
            }
            worker.unregister(&handle).expect("unregister");
            let pool = &mut self.pool;
            let floor = measure(&pool.pids(1), ROUND_TRIPS as usize, || {
                for _ in 0..ROUND_TRIPS {
                    pool.fan_out(1, 0);
                }
            });
            self.record("round_trip".into(), "", op, floor);
        }
        for (label, large) in [("small", false), ("1mib", true)] {
            for targets in FAN_OUT {
                if large && targets != 1 && targets != 4 {
                    continue;
                }
                let register = format!("register_{label}/{targets}");
                let unregister = format!("unregister_{label}/{targets}");
                if !self.wanted(&register) && !self.wanted(&unregister) {
                    continue;
                }
                let w = self.worker(targets);
                let worker = &self.workers[w].1;
                let pids = target_pids(worker);
                let envelopes = if large {
                    &self.payloads.large
                } else {
                    &self.payloads.small
                };
                let mut handles: Vec<Handle> = Vec::with_capacity(envelopes.len());
                let op_register = measure(&pids, envelopes.len(), || {
                    for envelope in envelopes {
                        handles.push(worker.register(envelope).expect("register"));
                    }
                });
                let op_unregister = measure(&pids, handles.len(), || {
                    for handle in &handles {
                        worker.unregister(handle).expect("unregister");
                    }
                });
                let n = usize::from(targets);
                let pool = &mut self.pool;
                let pool_pids = pool.pids(n);
                let floor_register = measure(&pool_pids, envelopes.len(), || {
                    for envelope in envelopes {
                        let (staged, _hash) =
                            StagedPayload::create(envelope, HEADER_LEN..envelope.len())
                                .expect("stage");
                        pool.fan_out(n, envelope.len() - HEADER_LEN);
                        drop(staged);
                    }
                });
                let floor_unregister = measure(&pool_pids, envelopes.len(), || {
                    for _ in envelopes {
                        pool.fan_out(n, 0);
                    }
                });
                self.record(register, "", op_register, floor_register);
                self.record(unregister, "", op_unregister, floor_unregister);
                if targets != 1 {
                    continue;
                }
                // Each unregister right behind its own register, as a
                // caller that registers and unregisters at once sees it
                // (anything the register left to do delays it). Wall time
                // only: the register's CPU cannot be told apart.
                let worker = &self.workers[w].1;
                let mut wall = Duration::ZERO;
                for envelope in envelopes {
                    let handle = worker.register(envelope).expect("register");
                    let started = Instant::now();
                    worker.unregister(&handle).expect("unregister");
                    wall += started.elapsed();
                }
                let op = Sample {
                    wall_ns: wall.as_nanos() as f64 / envelopes.len() as f64,
                    cpu_ns: f64::NAN,
                };
                // Its floor likewise: each fan-out right behind a floor
                // register of the same payload (caches are as cold).
                let pool = &mut self.pool;
                let mut floor_wall = Duration::ZERO;
                for envelope in envelopes {
                    let (staged, _hash) =
                        StagedPayload::create(envelope, HEADER_LEN..envelope.len()).expect("stage");
                    pool.fan_out(1, envelope.len() - HEADER_LEN);
                    drop(staged);
                    let started = Instant::now();
                    pool.fan_out(1, 0);
                    floor_wall += started.elapsed();
                }
                let floor = Sample {
                    wall_ns: floor_wall.as_nanos() as f64 / envelopes.len() as f64,
                    cpu_ns: f64::NAN,
                };
                self.record(
                    format!("unregister_after_register_{label}/1"),
                    "",
                    op,
                    floor,
                );
            }
        }
        for in_flight in [100usize, 1000] {
            for targets in [1, nproc] {
                let name = format!("in_flight/{in_flight}/{targets}");
                if !self.wanted(&name) {
                    continue;
                }
                let w = self.worker(targets);
                let worker = &self.workers[w].1;
                let pids = target_pids(worker);
                let handle = worker.register(&self.payloads.task).expect("register");
                let input = &self.payloads.input;
                let batches = STREAMED_TASKS / in_flight;
                let op = measure(&pids, batches * in_flight, || {
                    for _ in 0..batches {
                        let pending: Vec<_> = (0..in_flight)
                            .map(|i| {
                                let target = TargetId((i % usize::from(targets)) as u16);
                                worker.submit_async(&handle, target, TaskEncoding::Json, input)
                            })
                            .collect();
                        for p in pending {
                            p.wait().expect("task");
                        }
                    }
                });
                worker.unregister(&handle).expect("unregister");
                let n = usize::from(targets);
                let pool = &mut self.pool;
                let floor = measure(&pool.pids(n), batches * in_flight, || {
                    for _ in 0..batches {
                        pool.stream(n, in_flight);
                    }
                });
                self.record(name, "tasks/s", op, floor);
            }
        }
    }

    fn table(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "| scenario | wall | floor wall | wall / floor | CPU | floor CPU | CPU / floor |\n",
        );
        out.push_str("|---|---:|---:|---:|---:|---:|---:|\n");
        for row in &self.rows {
            let wall = median(row.op.iter().map(|s| s.wall_ns).collect());
            let floor_wall = median(row.floor.iter().map(|s| s.wall_ns).collect());
            let cpu = median(row.op.iter().map(|s| s.cpu_ns).collect());
            let floor_cpu = median(row.floor.iter().map(|s| s.cpu_ns).collect());
            let (wall_text, floor_text, ratio) = if row.unit == "tasks/s" {
                (
                    format!("{:.0} tasks/s", 1e9 / wall),
                    format!("{:.0} msgs/s", 1e9 / floor_wall),
                    format!("1/{:.2}", wall / floor_wall),
                )
            } else {
                (
                    shown(wall),
                    shown(floor_wall),
                    format!("{:.2}", wall / floor_wall),
                )
            };
            let cpu_ratio = if cpu.is_nan() {
                "—".to_owned()
            } else {
                format!("{:.2}", cpu / floor_cpu)
            };
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                row.name,
                wall_text,
                floor_text,
                ratio,
                shown(cpu),
                shown(floor_cpu),
                cpu_ratio,
            ));
        }
        out
    }
}

fn target_pids<R: Runtime>(worker: &Worker<R>) -> Vec<i32> {
    worker
        .live_targets()
        .into_iter()
        .filter_map(|t| worker.target_pid(t))
        .collect()
}

fn run<R: Runtime>(
    runtime: Arc<R>,
    payloads: &Payloads,
    pool: Pool,
    rounds: usize,
    filter: Option<String>,
    respawn_limit: Option<u16>,
) {
    let mut bench = Bench {
        runtime,
        payloads,
        pool,
        workers: Vec::new(),
        filter,
        respawn_limit,
        rows: Vec::new(),
        threads: Vec::new(),
    };
    // A warm-up round (starts the Workers), not recorded.
    bench.round();
    bench.rows.clear();
    bench.threads.clear();
    for round in 0..rounds {
        let started = Instant::now();
        bench.round();
        eprintln!(
            "round {} of {rounds} done in {:.1} s (load {})",
            round + 1,
            started.elapsed().as_secs_f64(),
            common::load()
        );
    }
    print!("{}", bench.table());
    if !bench.threads.is_empty() {
        println!("\nround trip, per thread (medians over the rounds; threads that did nothing omitted):\n");
        println!(
            "| thread | CPU per round trip | sleeps (voluntary context switches) per round trip |"
        );
        println!("|---|---:|---:|");
        for (label, cpus, sleeps) in &bench.threads {
            let (cpu, sleeps) = (median(cpus.clone()), median(sleeps.clone()));
            if cpu < 50.0 && sleeps < 0.01 {
                continue;
            }
            println!("| {label} | {} | {sleeps:.2} |", shown(cpu));
        }
    }
    // The targets hold copies of the echo children's pipes: Workers first.
    bench.workers.clear();
    let _ = std::io::stdout().flush();
}

fn main() {
    let mut rounds = 7;
    let mut filter = None;
    let mut python = false;
    let mut respawn_limit = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--rounds" => {
                rounds = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("--rounds N")
            }
            "--python" => python = true,
            "--respawn-limit" => {
                respawn_limit = Some(
                    args.next()
                        .and_then(|n| n.parse().ok())
                        .expect("--respawn-limit N"),
                )
            }
            // cargo bench passes `--bench`.
            a if a.starts_with("--") => {}
            a => filter = Some(a.to_owned()),
        }
    }
    // The echo children's payload (they hash a prefix of it on request).
    let hashed: Vec<u8> = (0..LARGE + 64 * 1024).map(|i| (i % 251) as u8).collect();
    let max_children = usize::from(*FAN_OUT.iter().max().unwrap_or(&1));
    // Forked first: no thread exists yet.
    let pool = Pool {
        children: (0..max_children)
            .map(|_| EchoChild::spawn(&hashed))
            .collect(),
        buffer: vec![0u8; 64 * 1024],
    };
    println!(
        "load average at start: {}; {} rounds; runtime: {}",
        common::load(),
        rounds,
        if python { "python" } else { "test" }
    );
    if python {
        #[cfg(feature = "python")]
        {
            let payloads = python_payloads();
            run(
                Arc::new(callreg::runtime::python::PythonRuntime::new()),
                &payloads,
                pool,
                rounds,
                filter,
                respawn_limit,
            );
        }
        #[cfg(not(feature = "python"))]
        panic!("--python needs cargo feature `python`");
    } else {
        let payloads = test_payloads();
        run(
            Arc::new(callreg::runtime::testing::TestRuntime),
            &payloads,
            pool,
            rounds,
            filter,
            respawn_limit,
        );
    }
    println!("load average at end: {}", common::load());
}
