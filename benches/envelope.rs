//! Validate + digest of a SPYC envelope (specs/design.md §3.1, §3.2) against a
//! raw `sha2` SHA-256 over the same staged bytes, at 1 KiB, 64 KiB, 1 MiB
//! and 16 MiB of payload. Goal: raw/callreg throughput ratio ≥ 0.97 from
//! 64 KiB up (the parse and the 52-byte descriptor hash are the only extra
//! work). Run: `cargo bench --bench envelope`.
//!
//! Two groups measure the same pairs: `envelope` with wall-clock time
//! (criterion's default) and `envelope_cpu` with the benchmark thread's
//! CPU time, which other processes competing for the cores do not inflate.

use std::hint::black_box;
use std::time::Duration;

use callreg::descriptor::python_serialized_digest;
use callreg::envelope::{encode, Envelope};
use criterion::measurement::{Measurement, ValueFormatter};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sha2::Digest as _;

const SIZES: [(usize, &str); 4] = [
    (1 << 10, "1KiB"),
    (64 << 10, "64KiB"),
    (1 << 20, "1MiB"),
    (16 << 20, "16MiB"),
];

fn validate_and_digest<M: Measurement>(c: &mut Criterion<M>, group_name: &str) {
    let mut group = c.benchmark_group(group_name);
    for (size, label) in SIZES {
        // Deterministic, incompressible-looking payload bytes.
        let payload: Vec<u8> = (0..size as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        let staged = encode(&payload);
        group.throughput(Throughput::Bytes(staged.len() as u64));
        if size >= 1 << 20 {
            group.sample_size(20);
            group.measurement_time(Duration::from_secs(8));
        } else {
            group.sample_size(100);
            group.measurement_time(Duration::from_secs(5));
        }
        group.bench_with_input(BenchmarkId::new("callreg", label), &staged, |b, s| {
            b.iter(|| {
                let env = Envelope::parse(black_box(s)).expect("valid envelope");
                black_box(python_serialized_digest(&env))
            })
        });
        group.bench_with_input(BenchmarkId::new("raw_sha2", label), &staged, |b, s| {
            b.iter(|| black_box(sha2::Sha256::digest(black_box(s.as_slice()))))
        });
    }
    group.finish();
}

fn wall_time(c: &mut Criterion) {
    validate_and_digest(c, "envelope");
}

fn cpu_time(c: &mut Criterion<ThreadCpuTime>) {
    validate_and_digest(c, "envelope_cpu");
}

/// Criterion measurement: CPU time of the calling thread in nanoseconds
/// (`CLOCK_THREAD_CPUTIME_ID`).
struct ThreadCpuTime;

fn thread_cpu_nanos() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID
    // is supported on every Linux this crate targets.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Measurement for ThreadCpuTime {
    type Intermediate = u64;
    type Value = u64;

    fn start(&self) -> u64 {
        thread_cpu_nanos()
    }
    fn end(&self, start: u64) -> u64 {
        thread_cpu_nanos().saturating_sub(start)
    }
    fn add(&self, a: &u64, b: &u64) -> u64 {
        a + b
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, value: &u64) -> f64 {
        *value as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        &NanosFormatter
    }
}

/// Formats nanoseconds and bytes per second like criterion's wall time.
struct NanosFormatter;

impl ValueFormatter for NanosFormatter {
    fn scale_values(&self, typical_ns: f64, values: &mut [f64]) -> &'static str {
        let (factor, unit) = if typical_ns < 1e3 {
            (1.0, "ns")
        } else if typical_ns < 1e6 {
            (1e-3, "µs")
        } else if typical_ns < 1e9 {
            (1e-6, "ms")
        } else {
            (1e-9, "s")
        };
        for v in values {
            *v *= factor;
        }
        unit
    }

    fn scale_throughputs(
        &self,
        typical_ns: f64,
        throughput: &Throughput,
        values: &mut [f64],
    ) -> &'static str {
        let Throughput::Bytes(bytes) = *throughput else {
            return self.scale_values(typical_ns, values);
        };
        let per_second = bytes as f64 * 1e9 / typical_ns;
        let (denominator, unit) = if per_second < 1024.0 * 1024.0 * 1024.0 {
            (1024.0 * 1024.0, "MiB/s")
        } else {
            (1024.0 * 1024.0 * 1024.0, "GiB/s")
        };
        for v in values {
            *v = bytes as f64 * 1e9 / *v / denominator;
        }
        unit
    }

    fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
        "ns"
    }
}

criterion_group!(wall, wall_time);
criterion_group! {
    name = cpu;
    config = Criterion::default().with_measurement(ThreadCpuTime);
    targets = cpu_time
}
criterion_main!(wall, cpu);
