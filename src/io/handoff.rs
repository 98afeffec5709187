//! The completion hand-off: how the parent's IO thread gives an
//! operation's result to the caller thread waiting for it.
//!
//! One [`Completer`] (kept by the IO thread) and one [`Pending`] (kept by
//! the caller) share a slot guarded by a mutex and a condition variable.
//! Completing twice is impossible (the completer is consumed); a completer
//! dropped without completing (the IO thread ended) wakes the caller with
//! [`Abandoned`] instead of leaving it blocked forever. Checked with loom
//! (`tests/loom_handoff.rs`).

use crate::sync::{lock, Arc, Condvar, Mutex};

/// The completer was dropped without a result (the IO thread ended).
#[derive(Clone, Copy, PartialEq, Eq, Debug, thiserror::Error)]
#[error("the operation was abandoned: the Worker's IO thread ended before completing it")]
pub struct Abandoned;

enum State<T> {
    Waiting,
    Done(T),
    Taken,
    Abandoned,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
}

/// The IO thread's side: completes the operation once.
pub struct Completer<T> {
    shared: Option<Arc<Shared<T>>>,
}

/// The caller's side: waits for the result.
pub struct Pending<T> {
    shared: Arc<Shared<T>>,
}

/// A connected completer and pending pair.
pub fn channel<T>() -> (Completer<T>, Pending<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State::Waiting),
        ready: Condvar::new(),
    });
    (
        Completer {
            shared: Some(shared.clone()),
        },
        Pending { shared },
    )
}

impl<T> Completer<T> {
    /// Stores `value` and wakes the waiting caller.
    pub fn complete(mut self, value: T) {
        if let Some(shared) = self.shared.take() {
            finish(&shared, State::Done(value));
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            finish(&shared, State::Abandoned);
        }
    }
}

fn finish<T>(shared: &Shared<T>, state: State<T>) {
    let mut guard = lock(&shared.state);
    if matches!(*guard, State::Waiting) {
        *guard = state;
    }
    drop(guard);
    shared.ready.notify_all();
}

impl<T> Pending<T> {
    /// Blocks until the operation completes; returns its result.
    ///
    /// # Errors
    /// [`Abandoned`] when the completer was dropped without a result.
    pub fn wait(self) -> Result<T, Abandoned> {
        let mut guard = lock(&self.shared.state);
        loop {
            match std::mem::replace(&mut *guard, State::Taken) {
                State::Waiting => {
                    *guard = State::Waiting;
                    guard = self
                        .shared
                        .ready
                        .wait(guard)
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                }
                State::Done(value) => return Ok(value),
                State::Abandoned | State::Taken => return Err(Abandoned),
            }
        }
    }

    /// Whether the result (or the abandonment) is there: [`Pending::wait`]
    /// would not block.
    pub fn is_complete(&self) -> bool {
        !matches!(*lock(&self.shared.state), State::Waiting)
    }
}
