//! Python target benchmarks (criterion; cargo features `io` + `python`),
//! the figures issue 6 compares with the reference implementation:
//!
//! * `python/register_small/1`: one post-start register of a small
//!   cloudpickled closure into 1 target (stage, the target opens, verifies,
//!   `pickle.loads` from the shared mapping, handle published); the handle
//!   is unregistered outside the timed part, so each register deserializes
//!   afresh;
//! * `python/register_1mib/1`: the same with a closure over 1 MiB of bytes;
//! * `python/unregister/1`: one unregister of the small closure;
//! * `python/task_round_trip/1`: one trivial task (`identity(7)` as JSON) on
//!   a registered handle, submit to result;
//! * `python/register_small/4`: the small register into 4 targets.
//!
//! Payloads are made before criterion starts by the interpreter named by
//! `PYO3_PYTHON` (else `python3`) with cloudpickle.
//!
//! Run: `cargo bench --features io,python --bench python -- --noplot`
//! (results in `BENCHMARKS.md`).

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use callreg::io::Worker;
use callreg::protocol::TargetId;
use callreg::runtime::python::PythonRuntime;
use callreg::runtime::TaskEncoding;
use criterion::Criterion;

/// Prints three SPYC envelopes as hex lines: the small closure, the 1 MiB
/// closure, the identity function.
const PAYLOADS: &str = r#"
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

for value in (make_adder(1), make_sized(bytes(range(256)) * 4096), identity):
    print(callreg_envelope.dumps(value).hex())
"#;

/// The three envelopes of [`PAYLOADS`].
struct Envelopes {
    small: Vec<u8>,
    one_mib: Vec<u8>,
    identity: Vec<u8>,
}

fn envelopes() -> Envelopes {
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let output = Command::new(python)
        .arg("-c")
        .arg(PAYLOADS)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/python"))
        .output()
        .expect("python runs");
    assert!(
        output.status.success(),
        "making payloads failed (is cloudpickle installed?): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).expect("hex lines");
    let mut lines = text.lines().map(|line| {
        (0..line.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&line[i..i + 2], 16).expect("hex"))
            .collect::<Vec<u8>>()
    });
    let mut next = || lines.next().expect("three envelopes");
    Envelopes {
        small: next(),
        one_mib: next(),
        identity: next(),
    }
}

fn worker(targets: u16) -> Worker<PythonRuntime> {
    let worker = Worker::builder(Arc::new(PythonRuntime::new()))
        .targets(targets)
        // Criterion's statistics may have left idle worker threads.
        .accept_thread_risk()
        .build()
        .expect("build");
    worker.start().expect("start");
    worker
}

/// Times `worker.register(envelope)`; unregisters outside the timing.
fn bench_register(c: &mut Criterion, name: &str, worker: &Worker<PythonRuntime>, envelope: &[u8]) {
    c.bench_function(name, |b| {
        b.iter_custom(|iterations| common::time_registers(worker, envelope, iterations))
    });
}

fn python(c: &mut Criterion) {
    let envelopes = envelopes();
    let one = worker(1);
    bench_register(c, "python/register_small/1", &one, &envelopes.small);
    bench_register(c, "python/register_1mib/1", &one, &envelopes.one_mib);
    c.bench_function("python/unregister/1", |b| {
        b.iter_custom(|iterations| common::time_unregisters(&one, &envelopes.small, iterations))
    });
    let identity = one.register(&envelopes.identity).expect("register");
    let input = br#"{"args":[7]}"#;
    c.bench_function("python/task_round_trip/1", |b| {
        b.iter(|| {
            let result = one
                .submit(&identity, TargetId(0), TaskEncoding::Json, input)
                .expect("task");
            assert_eq!(result, b"7");
        })
    });
    drop(one);
    let four = worker(4);
    bench_register(c, "python/register_small/4", &four, &envelopes.small);
}

fn main() {
    let mut criterion = Criterion::default()
        .sample_size(50)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .configure_from_args();
    python(&mut criterion);
    criterion.final_summary();
}
