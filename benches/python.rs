//! Python target benchmarks (criterion; cargo features `io` + `python`),
//! the figures compared with the reference implementation:
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
//! (results in `benchmarks/HISTORY.md`, "Python targets vs the reference
//! implementation").

mod common;

use std::sync::Arc;
use std::time::Duration;

use callreg::io::Worker;
use callreg::protocol::TargetId;
use callreg::runtime::python::PythonRuntime;
use callreg::runtime::TaskEncoding;
use criterion::Criterion;

/// The three envelopes the scenarios register.
struct Envelopes {
    small: Vec<u8>,
    one_mib: Vec<u8>,
    identity: Vec<u8>,
}

/// A small closure, a closure over 1 MiB of bytes, the identity function.
fn envelopes() -> Envelopes {
    let mut envelopes = common::python_envelopes(&[
        "make_adder(1)",
        "make_sized(bytes(range(256)) * 4096)",
        "identity",
    ])
    .into_iter();
    let mut next = || envelopes.next().expect("three envelopes");
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
