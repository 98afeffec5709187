//! The Worker over real forked targets with the test runtime: what the
//! parent keeps, deadlines on every wait, and truthful reports.
//!
//! A `harness = false` binary (see `tests/io_common/mod.rs`): each test
//! runs on the main thread; every test ends with no staged payload in
//! `/dev/shm` and no child left (checked by the runner).

mod io_common;

use io_common::{builder, envelope};

fn main() {
    io_common::run(&[(
        "pre_start_envelopes_are_released_at_unregister_start_and_close",
        pre_start_envelopes_are_released_at_unregister_start_and_close,
    )]);
}

/// The parent keeps a pre-start envelope's bytes only while a live handle
/// needs them for the startup snapshot.
fn pre_start_envelopes_are_released_at_unregister_start_and_close() {
    let big = envelope(&format!("echo #{}", "x".repeat(1 << 20)));
    let small = envelope("add");
    let worker = builder(2).build().unwrap();
    let first = worker.register(&big).unwrap();
    let second = worker.register(&big).unwrap();
    let add = worker.register(&small).unwrap();
    assert_eq!(worker.retained_envelope_bytes(), big.len() + small.len());
    worker.unregister(&first).unwrap();
    // Another handle still needs the same bytes.
    assert_eq!(worker.retained_envelope_bytes(), big.len() + small.len());
    worker.unregister(&second).unwrap();
    assert_eq!(worker.retained_envelope_bytes(), small.len());
    worker.start().unwrap();
    // The targets inherited the snapshot; the parent keeps none of it.
    assert_eq!(worker.retained_envelope_bytes(), 0);
    worker.unregister(&add).unwrap();
    worker.close();
    assert_eq!(worker.retained_envelope_bytes(), 0);

    let unstarted = builder(1).build().unwrap();
    unstarted.register(&big).unwrap();
    assert_eq!(unstarted.retained_envelope_bytes(), big.len());
    unstarted.close();
    assert_eq!(unstarted.retained_envelope_bytes(), 0);
}
