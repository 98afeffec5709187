//! What replacement targets (`specs/protocol.md` §2.9,
//! `WorkerBuilder::respawn_limit`) cost, measured in one run against
//! same-run peers and floors (test runtime, so the figures are the IO
//! layer's own; `--python` adds `replace/K` with Python targets):
//!
//! | scenario | operation | peer / floor |
//! |---|---|---|
//! | `steady/N/SIZE` | one post-start register, then its unregister, of a fresh SIZE (64 B or 1 MiB) payload on a started N-target Worker with replacements on (default limit: template process, kept staged payloads) | the same on a Worker with `respawn_limit(0)`, side by side, alternating which goes first each round |
//! | `start/N` | `start()` of a fresh N-target Worker with replacements on (forks the template process too) | `start()` of one with replacements off |
//! | `replace/K` | `kill -9` of the only target of a started 1-target Worker holding K live registrations (64 B payloads) until it is `Joined` again (a new incarnation that was replayed all K) | `start()` of a fresh 1-target Worker with replacements off |
//!
//! Wall time is per operation; CPU time (user + system) is that of this
//! process (`getrusage`; for `replace/K`, less the polling thread's own,
//! `RUSAGE_THREAD`) and of the Worker's child processes (targets and
//! template; for `replace/K`, the new target and the template) from
//! `/proc/PID/task/TID/schedstat`. `replace/K` polls the target every
//! `POLL` (its wall time is late by up to that); it also reports when
//! the target was first seen replaying (`Joining`). Tables: median and
//! 90th percentile over the rounds, and the ratio of the medians to the
//! peer / floor.
//!
//! Run: `cargo bench --features io --bench respawn` (results in
//! `BENCHMARKS.md`, every run in `benchmarks/HISTORY.md`). Options after
//! `--`: `--steady N` (rounds per steady-state row, default 400),
//! `--starts N` (default 40), `--replacements N` (default 100);
//! `--python` (cargo feature `python` too) runs `replace/K` only, for the
//! test runtime and then with Python targets (live registrations: distinct
//! cloudpickled closures made by `PYO3_PYTHON`; the floor a 1-target
//! Python start).

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use callreg::io::Worker;
use callreg::protocol::{TargetId, TargetPhase};
use callreg::runtime::testing::TestRuntime;
use callreg::runtime::Runtime;

const SMALL: usize = 64;
const LARGE: usize = 1 << 20;
const STEADY_TARGETS: [u16; 2] = [1, 4];
const START_TARGETS: [u16; 3] = [1, 4, 16];
const LIVE_REGISTRATIONS: [usize; 3] = [0, 10, 100];
const POLL: Duration = Duration::from_micros(50);
const REPLACEMENT_DEADLINE: Duration = Duration::from_secs(20);

fn builder<R: Runtime>(
    runtime: &Arc<R>,
    targets: u16,
    respawn: bool,
) -> callreg::io::WorkerBuilder<R> {
    Worker::builder(runtime.clone())
        .targets(targets)
        .respawn_limit(if respawn { 3 } else { 0 })
        .slot_capacity(256)
        .control_timeout(Duration::from_secs(60))
        // Other Workers' IO threads run when this one starts.
        .accept_thread_risk()
}

/// A `echo` envelope of a `size`-byte payload no other call makes (a
/// fresh digest).
fn fresh_envelope(size: usize, tag: &str, n: usize) -> Vec<u8> {
    common::echo_envelope(&format!("{tag} {n}#"), size)
}

/// CPU nanoseconds so far of `pids` (every thread).
fn cpu_of(pids: &[i32]) -> u64 {
    pids.iter().map(|p| common::process_cpu_ns(*p)).sum()
}

/// One operation's wall time and CPU time (ns).
#[derive(Clone, Copy, Default)]
struct Sample {
    wall: u64,
    process: u64,
    children: u64,
}

#[derive(Default)]
struct Series(Vec<Sample>);

impl Series {
    fn pick(&self, p: usize, field: impl Fn(&Sample) -> u64) -> f64 {
        let values: Vec<u64> = self.0.iter().map(field).collect();
        common::percentile(&values, p) as f64
    }

    fn median(&self, field: impl Fn(&Sample) -> u64) -> f64 {
        self.pick(50, field)
    }

    /// `| median | p90 |` for wall, process CPU and children CPU.
    fn cells(&self) -> String {
        let wall = |s: &Sample| s.wall;
        let process = |s: &Sample| s.process;
        let children = |s: &Sample| s.children;
        format!(
            "{} / {} | {} / {} | {} / {}",
            shown(self.median(wall)),
            shown(self.pick(90, wall)),
            shown(self.median(process)),
            shown(self.pick(90, process)),
            shown(self.median(children)),
            shown(self.pick(90, children)),
        )
    }

    /// Ratios of the medians (wall, process CPU, children CPU) to `peer`.
    fn ratios(&self, peer: &Series) -> String {
        let ratio = |f: fn(&Sample) -> u64| {
            let b = peer.median(f);
            if b == 0.0 {
                "n/a".to_owned()
            } else {
                format!("{:.2}", self.median(f) / b)
            }
        };
        format!(
            "{} | {} | {}",
            ratio(|s| s.wall),
            ratio(|s| s.process),
            ratio(|s| s.children)
        )
    }
}

fn shown(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.1} µs", ns / 1e3)
    }
}

/// Times `op` with this process's CPU and that of `children`.
fn measure<T>(children: &[i32], op: impl FnOnce() -> T) -> (T, Sample) {
    let children_before = cpu_of(children);
    let process_before = common::rusage_cpu_ns(libc::RUSAGE_SELF);
    let started = Instant::now();
    let out = op();
    let wall = started.elapsed().as_nanos() as u64;
    let process = common::rusage_cpu_ns(libc::RUSAGE_SELF).saturating_sub(process_before);
    let children = cpu_of(children).saturating_sub(children_before);
    (
        out,
        Sample {
            wall,
            process,
            children,
        },
    )
}

/// A started Worker and its child processes (targets, template).
struct Started<R: Runtime> {
    worker: Worker<R>,
    children: Vec<i32>,
}

fn started<R: Runtime>(runtime: &Arc<R>, targets: u16, respawn: bool) -> Started<R> {
    let before: BTreeSet<i32> = common::child_pids().into_iter().collect();
    let worker = builder(runtime, targets, respawn).build().expect("build");
    worker.start().expect("start");
    let children: Vec<i32> = common::child_pids()
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    // The targets, and the template process when replacements are on.
    assert_eq!(children.len(), usize::from(targets) + usize::from(respawn));
    Started { worker, children }
}

// ---------------------------------------------------------------------
// 1. steady state

#[derive(Default)]
struct Pair {
    register: Series,
    unregister: Series,
}

fn register_unregister(w: &Started<TestRuntime>, envelope: &[u8], into: &mut Pair) {
    let (handle, register) = measure(&w.children, || w.worker.register(envelope));
    let handle = handle.expect("register");
    let (done, unregister) = measure(&w.children, || w.worker.unregister(&handle));
    done.expect("unregister");
    into.register.0.push(register);
    into.unregister.0.push(unregister);
}

fn steady(rounds: usize) {
    println!("\n### steady state: register + unregister, replacements on vs off\n");
    println!(
        "Per operation, median / p90: wall | process CPU | children CPU (targets + template).\n"
    );
    println!("| scenario | op | on: wall | on: process CPU | on: children CPU | off: wall | off: process CPU | off: children CPU | on/off wall | on/off process CPU | on/off children CPU |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut unregisters_on = Vec::new();
    for targets in STEADY_TARGETS {
        let runtime = Arc::new(TestRuntime);
        let on = started(&runtime, targets, true);
        let off = started(&runtime, targets, false);
        for (size, name) in [(SMALL, "64B"), (LARGE, "1MiB")] {
            for round in 0..10 {
                register_unregister(
                    &on,
                    &fresh_envelope(size, "warm-on", round),
                    &mut Pair::default(),
                );
                register_unregister(
                    &off,
                    &fresh_envelope(size, "warm-off", round),
                    &mut Pair::default(),
                );
            }
            let (mut p_on, mut p_off) = (Pair::default(), Pair::default());
            for round in 0..rounds {
                let e_on = fresh_envelope(size, "on", round);
                let e_off = fresh_envelope(size, "off", round);
                common::interleaved(
                    round,
                    || register_unregister(&on, &e_on, &mut p_on),
                    || register_unregister(&off, &e_off, &mut p_off),
                );
            }
            // Nothing kept once the last registration went; every target serves.
            assert_eq!(on.worker.retained_envelope_bytes(), 0);
            assert_eq!(off.worker.retained_envelope_bytes(), 0);
            assert_eq!(on.worker.live_targets().len(), usize::from(targets));
            assert_eq!(off.worker.live_targets().len(), usize::from(targets));
            for (op, s_on, s_off) in [
                ("register", &p_on.register, &p_off.register),
                ("unregister", &p_on.unregister, &p_off.unregister),
            ] {
                println!(
                    "| steady/{targets}/{name} | {op} | {} | {} | {} |",
                    s_on.cells(),
                    s_off.cells(),
                    s_on.ratios(s_off)
                );
            }
            unregisters_on.push((targets, name, p_on.unregister, p_off.unregister));
        }
        on.worker.close();
        off.worker.close();
    }
    println!("\nUnregister of a 1 MiB callable / of a 64 B one (same Worker), median: wall | process CPU | children CPU\n");
    println!("| targets | replacements | 1MiB / 64B wall | 1MiB / 64B process CPU | 1MiB / 64B children CPU |");
    println!("|---:|---|---:|---:|---:|");
    for targets in STEADY_TARGETS {
        let of = |name: &str| {
            unregisters_on
                .iter()
                .find(|(t, n, _, _)| *t == targets && *n == name)
                .expect("measured")
        };
        let (small, large) = (of("64B"), of("1MiB"));
        println!("| {targets} | on | {} |", large.2.ratios(&small.2));
        println!("| {targets} | off | {} |", large.3.ratios(&small.3));
    }
}

// ---------------------------------------------------------------------
// 2. start

/// `start()` of a fresh Worker: wall, this process's CPU, and the whole
/// CPU so far of its child processes (their lives began in it).
fn one_start<R: Runtime>(runtime: &Arc<R>, targets: u16, respawn: bool, into: &mut Series) {
    // Finding the template means reading every process's `/proc` entry,
    // the replacement section's targets too: only with replacements on,
    // which that section's floor is not.
    let before: BTreeSet<i32> = if respawn {
        common::child_pids().into_iter().collect()
    } else {
        BTreeSet::new()
    };
    let worker = builder(runtime, targets, respawn).build().expect("build");
    let process_before = common::rusage_cpu_ns(libc::RUSAGE_SELF);
    let started = Instant::now();
    worker.start().expect("start");
    let wall = started.elapsed().as_nanos() as u64;
    let process = common::rusage_cpu_ns(libc::RUSAGE_SELF).saturating_sub(process_before);
    let mut children: Vec<i32> = (0..targets)
        .filter_map(|t| worker.target_pid(TargetId(t)))
        .collect();
    if respawn {
        let template: Vec<i32> = common::child_pids()
            .into_iter()
            .filter(|p| !before.contains(p) && !children.contains(p))
            .collect();
        assert_eq!(template.len(), 1, "one template process");
        children.extend(template);
    }
    assert_eq!(children.len(), usize::from(targets) + usize::from(respawn));
    into.0.push(Sample {
        wall,
        process,
        children: cpu_of(&children),
    });
    worker.close();
    assert!(
        children
            .iter()
            .all(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()),
        "close reaps every child"
    );
}

fn starts(rounds: usize) {
    println!("\n### start: with the template process vs without\n");
    println!("Per `start()`, median / p90: wall | process CPU | children CPU (targets + template, their whole life so far).\n");
    println!("| scenario | on: wall | on: process CPU | on: children CPU | off: wall | off: process CPU | off: children CPU | on/off wall | on/off process CPU | on/off children CPU |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let runtime = Arc::new(TestRuntime);
    for targets in START_TARGETS {
        let (mut on, mut off) = (Series::default(), Series::default());
        one_start(&runtime, targets, true, &mut Series::default());
        one_start(&runtime, targets, false, &mut Series::default());
        for round in 0..rounds {
            common::interleaved(
                round,
                || one_start(&runtime, targets, true, &mut on),
                || one_start(&runtime, targets, false, &mut off),
            );
        }
        println!(
            "| start/{targets} | {} | {} | {} |",
            on.cells(),
            off.cells(),
            on.ratios(&off)
        );
    }
}

// ---------------------------------------------------------------------
// 3. replacement latency

/// A started 1-target Worker with replacements on, holding `live`
/// registrations.
struct Replaced<R: Runtime> {
    w: Started<R>,
    template: i32,
    _handles: Vec<callreg::protocol::Handle>,
}

fn replaced<R: Runtime>(runtime: &Arc<R>, envelopes: &[Vec<u8>]) -> Replaced<R> {
    let w = started(runtime, 1, true);
    let target = w.worker.target_pid(TargetId(0)).expect("started");
    let template = *w.children.iter().find(|p| **p != target).expect("template");
    let handles = envelopes
        .iter()
        .map(|e| w.worker.register(e).expect("register"))
        .collect();
    Replaced {
        w,
        template,
        _handles: handles,
    }
}

/// Kills the target and polls until it joined again; with `record`,
/// adds the sample, reading the new target's CPU from `/proc` (which
/// makes its reap, in the next round, cost the template milliseconds of
/// kernel time: `d_invalidate` of its `/proc` entries; so that next round
/// is run with `record` off).
fn one_replacement<R: Runtime>(
    r: &Replaced<R>,
    record: bool,
    into: &mut Series,
    extra: &mut Extra,
) {
    let worker = &r.w.worker;
    let t = TargetId(0);
    let pid = worker.target_pid(t).expect("pid");
    let incarnation = worker.target_incarnation(t);
    let template_before = common::process_cpu_ns(r.template);
    let process_before = common::rusage_cpu_ns(libc::RUSAGE_SELF);
    let poller_before = common::rusage_cpu_ns(libc::RUSAGE_THREAD);
    let started = Instant::now();
    // SAFETY: kill sends a signal to a process id; it touches no memory.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let mut seen_joining = None;
    let wall = loop {
        // The incarnation first: a `Joined` read after it saw the new
        // one is the new one's (read the other way round, it could be
        // the old one's, before its loss was noticed).
        let replaced = worker.target_incarnation(t) > incarnation;
        let phase = worker.target_phase(t);
        let now = started.elapsed();
        if replaced {
            if phase == TargetPhase::Joined {
                break now;
            }
            if phase == TargetPhase::Joining && seen_joining.is_none() {
                seen_joining = Some(now);
            }
        }
        assert!(
            phase != TargetPhase::Lost && now < REPLACEMENT_DEADLINE,
            "no replacement: {:?}; events {:?}",
            phase,
            worker.target_events()
        );
        std::thread::sleep(POLL);
    };
    let poller = common::rusage_cpu_ns(libc::RUSAGE_THREAD).saturating_sub(poller_before);
    let process = common::rusage_cpu_ns(libc::RUSAGE_SELF)
        .saturating_sub(process_before)
        .saturating_sub(poller);
    let new_pid = worker.target_pid(t).expect("replacement pid");
    assert_ne!(new_pid, pid);
    assert_eq!(worker.target_incarnation(t), incarnation + 1);
    assert_eq!(worker.live_targets(), vec![t]);
    if !record {
        return;
    }
    let template = common::process_cpu_ns(r.template).saturating_sub(template_before);
    into.0.push(Sample {
        wall: wall.as_nanos() as u64,
        process,
        children: common::process_cpu_ns(new_pid) + template,
    });
    extra
        .joining
        .push(seen_joining.unwrap_or(wall).as_nanos() as u64);
    extra.template.push(template);
}

/// Per replacement: when `Joining` was first seen (the wall time to
/// `Joined` when it never was), and the template's CPU.
#[derive(Default)]
struct Extra {
    joining: Vec<u64>,
    template: Vec<u64>,
}

/// `median / p90` of `values`.
fn spread(values: &[u64]) -> String {
    format!(
        "{} / {}",
        shown(common::percentile(values, 50) as f64),
        shown(common::percentile(values, 90) as f64)
    )
}

/// `envelope(i)`: the `i`th of distinct callables, the live registrations.
fn replacements<R: Runtime>(
    runtime: &Arc<R>,
    label: &str,
    envelope: impl Fn(usize) -> Vec<u8>,
    rounds: usize,
) {
    println!(
        "\n### replacement latency ({label} targets): kill -9 to `Joined`, vs a 1-target start\n"
    );
    let workers: Vec<(usize, Replaced<R>)> = LIVE_REGISTRATIONS
        .iter()
        .map(|live| {
            let envelopes: Vec<Vec<u8>> = (0..*live).map(&envelope).collect();
            (*live, replaced(runtime, &envelopes))
        })
        .collect();
    let mut series: Vec<(Series, Extra)> = workers
        .iter()
        .map(|_| (Series::default(), Extra::default()))
        .collect();
    let mut floor = Series::default();
    // Warm-up.
    one_start(runtime, 1, false, &mut Series::default());
    for (_, r) in &workers {
        one_replacement(r, false, &mut Series::default(), &mut Extra::default());
    }
    for round in 0..rounds {
        one_start(runtime, 1, false, &mut floor);
        let n = workers.len();
        for i in 0..n {
            let k = (i + round) % n;
            let (s, j) = &mut series[k];
            // A recorded replacement, whose victim's `/proc` entries were
            // never read, then one that is not (its victim's were).
            one_replacement(&workers[k].1, true, s, j);
            one_replacement(&workers[k].1, false, s, j);
        }
    }
    for (_, r) in &workers {
        // Two replacements per round and the warm-up's, each joined.
        let incarnation = r.w.worker.target_incarnation(TargetId(0));
        assert_eq!(incarnation as usize, 2 * rounds + 1);
    }
    println!(
        "Per operation, median / p90: wall | process CPU (less the polling thread) | children CPU (new target + template). Polled every {} µs.\n",
        POLL.as_micros()
    );
    println!("| scenario | wall | process CPU | children CPU | of which template | kill to `Joining` seen | / floor: wall | / floor: process CPU | / floor: children CPU |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for ((live, _), (s, extra)) in workers.iter().zip(&series) {
        println!(
            "| replace/{live} | {} | {} | {} | {} |",
            s.cells(),
            spread(&extra.template),
            spread(&extra.joining),
            s.ratios(&floor)
        );
    }
    println!(
        "| floor: start/1, replacements off | {} | | | | | |",
        floor.cells()
    );
    for (_, r) in workers {
        r.w.worker.close();
    }
}

fn main() {
    let (mut steady_rounds, mut start_rounds, mut replacement_rounds) = (400, 40, 100);
    let mut python = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = || {
            args.next()
                .and_then(|n| n.parse::<usize>().ok())
                .expect("a number")
        };
        match arg.as_str() {
            "--steady" => steady_rounds = number(),
            "--starts" => start_rounds = number(),
            "--replacements" => replacement_rounds = number(),
            "--python" => python = true,
            // cargo bench passes `--bench`.
            _ => {}
        }
    }
    println!(
        "load average at start: {}; rounds: steady {steady_rounds}, starts {start_rounds}, replacements {replacement_rounds}",
        common::load()
    );
    if !python {
        steady(steady_rounds);
        eprintln!("steady done (load {})", common::load());
        starts(start_rounds);
        eprintln!("starts done (load {})", common::load());
    }
    replacements(
        &Arc::new(TestRuntime),
        "test runtime",
        |i| fresh_envelope(SMALL, "live", i),
        replacement_rounds,
    );
    if python {
        #[cfg(feature = "python")]
        {
            // Distinct cloudpickled closures, as many as the most live.
            let count = *LIVE_REGISTRATIONS.iter().max().unwrap_or(&0);
            let adders: Vec<String> = (0..count).map(|i| format!("make_adder({i})")).collect();
            let envelopes = common::python_envelopes(&adders);
            replacements(
                &Arc::new(callreg::runtime::python::PythonRuntime::new()),
                "Python",
                |i| envelopes[i].clone(),
                replacement_rounds,
            );
        }
        #[cfg(not(feature = "python"))]
        panic!("--python needs cargo feature `python`");
    }
    println!("\nload average at end: {}", common::load());
    assert!(common::child_pids().is_empty(), "every child reaped");
}
