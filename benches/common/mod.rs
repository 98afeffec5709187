//! Helpers shared by the Worker benchmarks: payloads (test runtime
//! `echo` envelopes; cloudpickled Python callables), timing loops for
//! criterion's `iter_custom` (`benches/io.rs`, `benches/python.rs`),
//! round-by-round interleaving and percentiles, and CPU time and load
//! readings (`benches/floors.rs`, `benches/probe.rs`,
//! `benches/respawn.rs`).

// Each benchmark is its own crate and uses a part of this module.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use callreg::envelope::encode;
use callreg::io::Worker;
use callreg::runtime::Runtime;

/// A test runtime envelope whose serializer payload is `size` bytes: an
/// `echo` instruction, then a comment that starts with `comment` and is
/// padded with `x` (a distinct `comment` gives a distinct digest).
pub fn echo_envelope(comment: &str, size: usize) -> Vec<u8> {
    let mut payload = format!("echo #{comment}").into_bytes();
    payload.resize(size, b'x');
    encode(&payload)
}

/// Prints, as a hex line each, the SPYC envelope of the value of every
/// Python expression in `sys.argv[2:]`, evaluated where `make_adder(n)`
/// (a closure adding `n`), `make_sized(blob)` (a closure over `blob`,
/// returning its length) and `identity` are defined; `sys.argv[1]` is
/// the folder holding `callreg_envelope`. (Keep the definitions on these
/// lines: their line numbers are in the pickled code.)
pub const PYTHON_PAYLOADS: &str = r#"
import sys
sys.path.insert(0, sys.argv[1])
import callreg_envelope

def make_adder(n):
    def add(x):
        return x + n
    return add

def make_sized(blob):
    def size():
        return len(blob)
    return size

def identity(x):
    return x

for expression in sys.argv[2:]:
    print(callreg_envelope.dumps(eval(expression)).hex())
"#;

/// The envelopes of `expressions` (see [`PYTHON_PAYLOADS`]), one each in
/// order, made by the interpreter `PYO3_PYTHON` names (else `python3`)
/// with cloudpickle. Panics when it does not run or fails.
pub fn python_envelopes<S: AsRef<str>>(expressions: &[S]) -> Vec<Vec<u8>> {
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let output = std::process::Command::new(python)
        .arg("-c")
        .arg(PYTHON_PAYLOADS)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/python/tools"))
        .args(expressions.iter().map(AsRef::as_ref))
        .output()
        .expect("python runs");
    assert!(
        output.status.success(),
        "making payloads failed (is cloudpickle installed?): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let envelopes: Vec<Vec<u8>> = String::from_utf8(output.stdout)
        .expect("hex lines")
        .lines()
        .map(|line| {
            (0..line.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&line[i..i + 2], 16).expect("hex"))
                .collect()
        })
        .collect();
    assert_eq!(envelopes.len(), expressions.len(), "one envelope each");
    envelopes
}

/// Runs `a` then `b` in an even `round`, `b` then `a` in an odd one, so
/// that load swings hit both alike.
pub fn interleaved(round: usize, a: impl FnOnce(), b: impl FnOnce()) {
    if round.is_multiple_of(2) {
        a();
        b();
    } else {
        b();
        a();
    }
}

/// The `p`th percentile (0 to 100) of `values`: the element at
/// `(len - 1) * p / 100` once sorted. Panics when `values` is empty.
pub fn percentile<T: Copy + Ord>(values: &[T], p: usize) -> T {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    sorted[(sorted.len() - 1) * p / 100]
}

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

/// Nanoseconds on CPU (user + system) so far, from `getrusage(who)`:
/// `libc::RUSAGE_SELF`, this process (every thread, ended ones too);
/// `libc::RUSAGE_THREAD`, the calling thread.
pub fn rusage_cpu_ns(who: libc::c_int) -> u64 {
    // SAFETY: getrusage writes one `rusage` into the valid pointer given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut usage);
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
