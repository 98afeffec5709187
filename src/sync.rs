//! Synchronisation primitives, swapped for `loom`'s under `cfg(loom)` so
//! the loom tests (`tests/loom_*.rs`) explore every interleaving of the
//! code that uses them (the way tokio and crossbeam do it).
//!
//! Only the IO layer's concurrent parts use this module: the completion
//! hand-off ([`crate::io::handoff`]), the target's slot table
//! ([`crate::io::slots`]) and the turns at its intake
//! ([`crate::io::turn`]).

#[cfg(loom)]
pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard};

#[cfg(not(loom))]
pub use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Locks `mutex`, recovering the data if a thread panicked while holding
/// it: every structure guarded here stays consistent between statements
/// (no invariant is broken across an unwinding point), so the poison flag
/// carries no information worth failing on.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
