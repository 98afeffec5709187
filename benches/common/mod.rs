//! Helpers shared by the Worker benchmarks: timing loops for criterion's
//! `iter_custom` (`benches/io.rs`, `benches/python.rs`) and CPU time and
//! load readings (`benches/floors.rs`, `benches/probe.rs`,
//! `benches/respawn.rs`).

// Each benchmark is its own crate and uses a part of this module.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use callreg::io::Worker;
use callreg::runtime::Runtime;

/// Total time of `iterations` registers of `envelope`; each is unregistered
/// outside the timing, so every register installs afresh.
pub fn time_registers<R: Runtime>(
    worker: &Worker<R>,
    envelope: &[u8],
    iterations: u64,
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iterations {
        let started = Instant::now();
        let handle = worker.register(envelope).expect("register");
        total += started.elapsed();
        worker.unregister(&handle).expect("unregister");
    }
    total
}

/// Total time of `iterations` unregisters; each register of `envelope` is
/// outside the timing.
pub fn time_unregisters<R: Runtime>(
    worker: &Worker<R>,
    envelope: &[u8],
    iterations: u64,
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iterations {
        let handle = worker.register(envelope).expect("register");
        let started = Instant::now();
        worker.unregister(&handle).expect("unregister");
        total += started.elapsed();
    }
    total
}

/// Nanoseconds on CPU of every thread of `pid` so far (the first field of
/// each `/proc/PID/task/TID/schedstat`); 0 once it is gone.
pub fn process_cpu_ns(pid: i32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Nanoseconds on CPU (user + system) of this process (every thread,
/// ended ones too), from `getrusage(RUSAGE_SELF)`.
pub fn self_cpu_ns() -> u64 {
    // SAFETY: getrusage writes one `rusage` into the valid pointer given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let micros = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    (micros(usage.ru_utime) + micros(usage.ru_stime)) * 1000
}

/// The live child processes of this process (every `/proc/PID/stat`
/// whose parent field is our pid): a Worker's targets and its template
/// process.
pub fn child_pids() -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    // Fields after the command name: state, ppid, ...
                    let rest = stat.rsplit(')').next()?;
                    rest.split_whitespace().nth(1)?.parse::<i32>().ok()
                })
                == Some(me)
        })
        .collect()
}

/// The 1, 5 and 15 minute load averages, as `/proc/loadavg` gives them.
pub fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
