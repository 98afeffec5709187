//! Timing loops shared by the Worker benchmarks (`benches/io.rs`,
//! `benches/python.rs`), for criterion's `iter_custom`.

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
