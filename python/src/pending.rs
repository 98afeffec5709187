//! `RawPending`: a task in flight, waited for inline by one thread at a
//! time or armed for the package's dispatcher thread.

use std::sync::Mutex;
use std::time::Duration;

use crate::errors::task_err_dict;
use crate::SIGNAL_CHECK_INTERVAL;
use callreg::error::OperationKind;
use callreg::io::forked_child_error;
use callreg::io::worker::{PendingTask, TaskError, TaskKey};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pyo3::IntoPyObjectExt;

/// A task in flight ([`RawWorker::submit`]): waited for at most by one
/// thread at a time, inline ([`RawPending::wait`], the caller reading the
/// replies itself as any waiting caller of the Worker does), or handed to
/// the completion channel once ([`RawWorker::arm`]) for a future nobody
/// waits on inline (done-callbacks, `concurrent.futures.wait`).
#[pyclass(frozen, module = "callreg._callreg")]
pub(crate) struct RawPending {
    /// The task's id in the completion channel.
    pub(crate) id: u64,
    /// The key to cancel it by ([`RawWorker::cancel`]).
    pub(crate) key: TaskKey,
    /// `None` while a thread waits on it, or once armed or waited.
    pub(crate) pending: Mutex<Option<PendingTask>>,
    /// The process that submitted it (its Worker's).
    pub(crate) owner: u32,
}

/// What [`RawPending::wait`] returns when it holds no result: another
/// thread waits on the task, or it was armed.
pub(crate) const PENDING_ELSEWHERE: u8 = 0;

/// What [`RawPending::wait`] returns when the time was up (the task is
/// still pending and may be waited for again, or armed).
pub(crate) const PENDING_TIMED_OUT: u8 = 1;

impl RawPending {
    pub(crate) fn take(&self) -> Option<PendingTask> {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    pub(crate) fn put_back(&self, pending: PendingTask) {
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = Some(pending);
    }
}

/// `(output, error)` of a finished task, as the package resolves it:
/// `output` the pickled result (bytes) or `None`, `error` the error dict
/// or `None`.
pub(crate) fn outcome_tuple<'py>(
    py: Python<'py>,
    result: Result<Vec<u8>, TaskError>,
) -> PyResult<Bound<'py, PyAny>> {
    match result {
        Ok(output) => (PyBytes::new(py, &output), py.None()).into_bound_py_any(py),
        Err(error) => (py.None(), task_err_dict(py, &error)?).into_bound_py_any(py),
    }
}

#[pymethods]
impl RawPending {
    /// The task's id (as in [`RawWorker::next_completions`]).
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }

    /// Waits for the result up to `timeout` seconds (`None`: until it is
    /// there), GIL released, checking for signals every
    /// [`SIGNAL_CHECK_INTERVAL`]: returns `(output, error)` once done;
    /// `1` when the time was up; `0` at once when another thread waits on
    /// it or it was armed (that thread, or the completion channel,
    /// resolves the future), except in a child forked from the Worker's
    /// process, where such a copy returns the `LIFECYCLE_INVALID` outcome
    /// at once. A signal handler's exception (Ctrl-C) is raised here with
    /// the task still pending.
    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyAny>> {
        let Some(mut pending) = self.take() else {
            // Copied into a child forked while a thread of the owner held
            // it (or after it was armed): neither that thread nor the
            // dispatcher exists here, and the result never comes.
            if std::process::id() != self.owner {
                let error = TaskError::of(forked_child_error(OperationKind::Task, self.owner));
                return outcome_tuple(py, Err(error));
            }
            return PENDING_ELSEWHERE.into_bound_py_any(py);
        };
        let until = match timeout {
            None => None,
            Some(seconds) if seconds.is_nan() || seconds <= 0.0 => Some(std::time::Instant::now()),
            Some(seconds) => Duration::try_from_secs_f64(seconds)
                .ok()
                .and_then(|d| std::time::Instant::now().checked_add(d)),
        };
        loop {
            let slice = match until {
                None => SIGNAL_CHECK_INTERVAL,
                Some(until) => until
                    .saturating_duration_since(std::time::Instant::now())
                    .min(SIGNAL_CHECK_INTERVAL),
            };
            match py.detach(|| pending.wait_timeout(slice)) {
                Ok(result) => return outcome_tuple(py, result),
                Err(again) => pending = again,
            }
            if let Err(error) = py.check_signals() {
                self.put_back(pending);
                return Err(error);
            }
            if until.is_some_and(|until| std::time::Instant::now() >= until) {
                self.put_back(pending);
                return PENDING_TIMED_OUT.into_bound_py_any(py);
            }
        }
    }

    /// Whether a wait would return the result at once.
    fn is_complete(&self) -> bool {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(PendingTask::is_complete)
    }
}
