//! The completion hand-off: how the thread that reads an operation's
//! reply (the parent's IO thread, or a caller leading the reads, see
//! [`super::lead`]) gives its result to the caller thread waiting for it.
//!
//! One [`Completer`] (kept with the IO state) and one [`Pending`] (kept by
//! the caller) share a state guarded by a mutex and a condition variable.
//! Completing twice is impossible (the completer is consumed); a completer
//! dropped without completing (the Worker closed) wakes the caller with
//! [`Abandoned`] instead of leaving it blocked forever.
//!
//! A caller may also wait in slices ([`Pending::wait_timeout`], e.g. to
//! check for signals between them) or hand the result to a callback
//! ([`Pending::on_complete`]) instead of waiting: the callback runs exactly
//! once, in the completing thread, or at once in the registering thread
//! when the result is already there. Checked with loom
//! (`tests/loom_handoff.rs`).

use crate::sync::{lock, Arc, Condvar, Mutex};

std::thread_local! {
    /// Whether this thread runs a callback for a completion it decided
    /// (not one registered after the fact, which runs in its own caller).
    static IN_CALLBACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is running a completion callback
/// ([`Pending::on_complete`]) on behalf of the thread that completed it:
/// that thread (in a Worker, the one reading replies) waits for the
/// callback, so the callback must not wait for anything it would do.
pub fn in_callback() -> bool {
    IN_CALLBACK.with(std::cell::Cell::get)
}

/// The completer was dropped without a result (the Worker closed).
#[derive(Clone, Copy, PartialEq, Eq, Debug, thiserror::Error)]
#[error("the operation was abandoned: the Worker's IO thread ended before completing it")]
pub struct Abandoned;

/// A callback waiting for the result ([`Pending::on_complete`]).
type Callback<T> = Box<dyn FnOnce(Result<T, Abandoned>) + Send>;

enum State<T> {
    Waiting,
    /// Waiting, with the caller asleep on the condition variable (only
    /// then does completing wake it: a caller that reads its own reply is
    /// never asleep, and costs no wake-up).
    Sleeping,
    /// Waiting, and the result goes to this callback.
    Callback(Callback<T>),
    Done(T),
    Taken,
    Abandoned,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
}

/// The completing side: completes the operation once.
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
    /// Stores `value` and wakes the waiting caller (or runs its callback,
    /// in this thread, after the shared state's lock is released).
    pub fn complete(mut self, value: T) {
        if let Some(shared) = self.shared.take() {
            finish(&shared, Ok(value));
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            finish(&shared, Err(Abandoned));
        }
    }
}

fn finish<T>(shared: &Shared<T>, value: Result<T, Abandoned>) {
    let mut guard = lock(&shared.state);
    match std::mem::replace(&mut *guard, State::Taken) {
        state @ (State::Waiting | State::Sleeping) => {
            *guard = match value {
                Ok(value) => State::Done(value),
                Err(Abandoned) => State::Abandoned,
            };
            if matches!(state, State::Waiting) {
                return;
            }
        }
        State::Callback(callback) => {
            drop(guard);
            // A callback that panics is contained (the panic hook has
            // reported it): the completing thread reads other callers'
            // replies, and must go on.
            let outer = IN_CALLBACK.with(|flag| flag.replace(true));
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| callback(value)));
            IN_CALLBACK.with(|flag| flag.set(outer));
            return;
        }
        // Completed already: impossible (the completer is consumed).
        other => *guard = other,
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
                State::Waiting | State::Sleeping => {
                    *guard = State::Sleeping;
                    guard = self
                        .shared
                        .ready
                        .wait(guard)
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                }
                State::Done(value) => return Ok(value),
                State::Abandoned | State::Taken | State::Callback(_) => return Err(Abandoned),
            }
        }
    }

    /// Waits at most `timeout` for the result: `Ok` with what
    /// [`Pending::wait`] would return, or `Err(self)` when the time is up
    /// (wait again, or drop it to stop waiting).
    pub fn wait_timeout(self, timeout: std::time::Duration) -> Result<Result<T, Abandoned>, Self> {
        let mut guard = lock(&self.shared.state);
        let mut guard = if matches!(*guard, State::Waiting) {
            *guard = State::Sleeping;
            self.shared
                .ready
                .wait_timeout(guard, timeout)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0)
        } else {
            guard
        };
        match std::mem::replace(&mut *guard, State::Taken) {
            State::Waiting | State::Sleeping => {
                *guard = State::Waiting;
                drop(guard);
                Err(self)
            }
            State::Done(value) => Ok(Ok(value)),
            State::Abandoned | State::Taken | State::Callback(_) => Ok(Err(Abandoned)),
        }
    }

    /// Hands the result to `callback` instead of waiting for it: the
    /// callback runs exactly once, with the result or [`Abandoned`], in the
    /// thread that completes (or abandons) the operation, or at once in
    /// this thread when that already happened. It runs without the shared
    /// state's lock held; it must not block for long (in a Worker it runs on the
    /// thread that read the reply: hand the value on, e.g. into a channel).
    /// A panic in it is contained when another thread runs it (the panic
    /// hook reports it; that thread goes on), and unwinds this thread's
    /// call when it runs here at once.
    pub fn on_complete<F>(self, callback: F)
    where
        F: FnOnce(Result<T, Abandoned>) + Send + 'static,
    {
        let mut guard = lock(&self.shared.state);
        let value = match std::mem::replace(&mut *guard, State::Taken) {
            // Nobody sleeps: this `Pending` is the only one, and it is here.
            State::Waiting | State::Sleeping => {
                *guard = State::Callback(Box::new(callback));
                return;
            }
            State::Done(value) => Ok(value),
            State::Abandoned | State::Taken | State::Callback(_) => Err(Abandoned),
        };
        drop(guard);
        callback(value);
    }

    /// Whether the result (or the abandonment) is there: [`Pending::wait`]
    /// would not block.
    pub fn is_complete(&self) -> bool {
        !matches!(
            *lock(&self.shared.state),
            State::Waiting | State::Sleeping | State::Callback(_)
        )
    }
}
