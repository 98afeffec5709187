//! Validate + digest of a SPYC envelope (DESIGN.md §3.1, §3.2) against a
//! raw `sha2` SHA-256 over the same staged bytes, at 1 KiB, 64 KiB, 1 MiB
//! and 16 MiB of payload. Goal: raw/callreg throughput ratio ≥ 0.97 from
//! 64 KiB up (the parse and the 52-byte descriptor hash are the only extra
//! work). Run: `cargo bench --bench envelope`.

use std::hint::black_box;
use std::time::Duration;

use callreg::descriptor::python_serialized_digest;
use callreg::envelope::{encode, Envelope};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sha2::Digest as _;

const SIZES: [(usize, &str); 4] = [
    (1 << 10, "1KiB"),
    (64 << 10, "64KiB"),
    (1 << 20, "1MiB"),
    (16 << 20, "16MiB"),
];

fn validate_and_digest(c: &mut Criterion) {
    let mut group = c.benchmark_group("envelope");
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

criterion_group!(benches, validate_and_digest);
criterion_main!(benches);
