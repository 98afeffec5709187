//! `callreg._callreg`: the extension module under the `callreg` Python
//! package, a thin front over [`callreg::io::Worker`] with an inherited
//! [`PythonRuntime`] (targets keep the calling interpreter).
//!
//! It holds no protocol logic: the Worker and its parent machine decide
//! every outcome. What it adds is the Python edge:
//!
//! * every wait releases the GIL; [`RawWorker::call`] waits in slices of
//!   [`SIGNAL_CHECK_INTERVAL`] and runs `PyErr_CheckSignals` between them,
//!   so Ctrl-C raises `KeyboardInterrupt` in the caller (the task itself
//!   finishes in its target, its result is dropped); registers and
//!   unregisters wait the same way ([`wait_operation`]): an interrupted
//!   register goes on, and the registration it makes is unregistered as
//!   soon as it completes ([`Worker::release_when_registered`]), so
//!   nothing stays installed for a handle nobody holds; an interrupted
//!   unregister goes on (its handle was released when it began);
//! * [`RawWorker::submit`] sends each task from the caller's thread and
//!   returns a [`RawPending`]: the future's first waiter waits on it
//!   inline (it may read every caller's replies, as any waiting caller of
//!   the Worker does), so a result reaches it with no other thread woken;
//!   a future nobody waits on inline (done-callbacks,
//!   `concurrent.futures.wait`) is *armed* ([`RawWorker::arm`]): its
//!   result goes to a channel ([`callreg::io::PendingTask::on_complete`],
//!   never touching the GIL there), which the package's dispatcher thread
//!   reads with [`RawWorker::next_completions`];
//! * errors are raised as `RawError` with one dict argument (`code`,
//!   `operation`, `target`, `hashid`, `seq`, `message`, `full`, `kind`,
//!   `exception`, `outcomes`), which the package maps to its exception
//!   classes.
//!
//! Envelope packing and hashids ([`encode_envelope`], [`envelope_hashid`])
//! are the crate's own ([`callreg::envelope`], [`callreg::descriptor`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use callreg::descriptor::python_serialized_digest;
use callreg::envelope::Envelope;
use callreg::error::{Error, ErrorCode, OperationKind};
use callreg::io::staging;
use callreg::io::worker::{
    outcome_text, registration_failure_text, OperationError, PendingOperation, PendingTask,
    TaskError, TaskKey,
};
use callreg::io::zygote::{ExecTemplate, TemplateCommand};
use callreg::io::{forked_child_error, StartMethod, Worker};
use callreg::metadata::CallableMetadata;
use callreg::protocol::{Handle, TargetId, TargetOutcome};
use callreg::runtime::python::PythonRuntime;
use callreg::runtime::TaskEncoding;
use pyo3::exceptions::{PyException, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use pyo3::IntoPyObjectExt;

pyo3::create_exception!(
    _callreg,
    RawError,
    PyException,
    "A failed operation: args[0] is a dict with the error's fields."
);

/// How long [`RawWorker::call`] waits between two signal checks.
pub const SIGNAL_CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// At most this many completions are returned by one
/// [`RawWorker::next_completions`].
const COMPLETION_BATCH: usize = 4096;

/// One finished task, from the IO thread to the dispatcher: its id and result.
type Completion = (u64, Result<Vec<u8>, TaskError>);

/// A handle issued by a [`RawWorker`] (the protocol's [`Handle`]).
#[pyclass(frozen, module = "callreg._callreg")]
struct RawHandle {
    handle: Handle,
}

mod parent;

#[pymethods]
impl RawHandle {
    /// `"sha256:"` and 64 lowercase hex digits.
    #[getter]
    fn hashid(&self) -> String {
        self.handle.hashid.to_string()
    }

    /// The hashid's 32 bytes.
    #[getter]
    fn digest<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.handle.digest().0)
    }

    /// The namespace's name (`"LOCAL_PYTHON"`).
    #[getter]
    fn namespace(&self) -> &'static str {
        self.handle.namespace.as_str()
    }

    /// Distinct for every register of the issuing Worker.
    #[getter]
    fn handle_id(&self) -> u64 {
        self.handle.handle_id
    }

    /// The handle's JSON form (`specs/design.md` §4.1: namespace, hashid,
    /// handle id, owner), to carry it between processes of one registry.
    fn to_json(&self) -> String {
        self.handle.to_json()
    }

    /// The handle of a JSON form made by [`RawHandle::to_json`].
    ///
    /// # Errors
    /// `ValueError` for any other text.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<RawHandle> {
        Handle::from_json(text)
            .map(|handle| RawHandle { handle })
            .map_err(|e| PyValueError::new_err(format!("not a handle: {e}")))
    }
}

/// A task in flight ([`RawWorker::submit`]): waited for at most by one
/// thread at a time, inline ([`RawPending::wait`], the caller reading the
/// replies itself as any waiting caller of the Worker does), or handed to
/// the completion channel once ([`RawWorker::arm`]) for a future nobody
/// waits on inline (done-callbacks, `concurrent.futures.wait`).
#[pyclass(frozen, module = "callreg._callreg")]
struct RawPending {
    /// The task's id in the completion channel.
    id: u64,
    /// The key to cancel it by ([`RawWorker::cancel`]).
    key: TaskKey,
    /// `None` while a thread waits on it, or once armed or waited.
    pending: Mutex<Option<PendingTask>>,
    /// The process that submitted it (its Worker's).
    owner: u32,
}

/// What [`RawPending::wait`] returns when it holds no result: another
/// thread waits on the task, or it was armed.
const PENDING_ELSEWHERE: u8 = 0;

/// What [`RawPending::wait`] returns when the time was up (the task is
/// still pending and may be waited for again, or armed).
const PENDING_TIMED_OUT: u8 = 1;

impl RawPending {
    fn take(&self) -> Option<PendingTask> {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    fn put_back(&self, pending: PendingTask) {
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = Some(pending);
    }
}

/// `(output, error)` of a finished task, as the package resolves it:
/// `output` the pickled result (bytes) or `None`, `error` the error dict
/// or `None`.
fn outcome_tuple<'py>(
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

/// Waits for `pending` with the GIL released, in slices of
/// [`SIGNAL_CHECK_INTERVAL`], running the signal handlers between them. A
/// handler's exception (Ctrl-C's `KeyboardInterrupt`) is returned at once,
/// after `pending` is handed to `interrupted`.
fn wait_operation<T: Send>(
    py: Python<'_>,
    mut pending: PendingOperation<T>,
    interrupted: impl FnOnce(PendingOperation<T>),
) -> PyResult<Result<T, OperationError>> {
    loop {
        match py.detach(|| pending.wait_timeout(SIGNAL_CHECK_INTERVAL)) {
            Ok(result) => return Ok(result),
            Err(again) => pending = again,
        }
        if let Err(error) = py.check_signals() {
            interrupted(pending);
            return Err(error);
        }
    }
}

/// A [`Worker`] with Python targets forked from this interpreter.
#[pyclass(frozen, module = "callreg._callreg")]
struct RawWorker {
    worker: Worker<PythonRuntime>,
    next_task: AtomicU64,
    /// Cloned into each submitted task's completion callback; dropped at
    /// close, so the channel disconnects once every task completed.
    sender: Mutex<Option<mpsc::Sender<Completion>>>,
    receiver: Mutex<mpsc::Receiver<Completion>>,
    /// The process that built it.
    process: u32,
}

fn error_dict<'py>(
    py: Python<'py>,
    error: &Error,
    full: String,
    kind: &str,
    exception: &[u8],
    outcomes: &[(TargetId, TargetOutcome)],
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("code", error.code.as_str())?;
    dict.set_item("operation", error.operation.as_str())?;
    dict.set_item("target", error.target.map(|t| t.0))?;
    dict.set_item("hashid", error.hashid.map(|h| h.to_string()))?;
    dict.set_item("seq", error.seq.map(|s| s.0))?;
    dict.set_item("message", &error.message)?;
    dict.set_item("full", full)?;
    dict.set_item("kind", kind)?;
    if exception.is_empty() {
        dict.set_item("exception", py.None())?;
    } else {
        dict.set_item("exception", PyBytes::new(py, exception))?;
    }
    let list = PyList::empty(py);
    for (target, outcome) in outcomes {
        list.append((target.0, outcome_text(outcome)))?;
    }
    dict.set_item("outcomes", list)?;
    // Each failed reply's code, by target: what the package decides by
    // (never the outcome's text).
    let codes = PyList::empty(py);
    for (target, outcome) in outcomes {
        if let TargetOutcome::Failed { failure } | TargetOutcome::CleanupUnconfirmed { failure } =
            outcome
        {
            codes.append((target.0, failure.code.as_str()))?;
        }
    }
    dict.set_item("outcome_codes", codes)?;
    Ok(dict)
}

fn raw_error(dict: Bound<'_, PyDict>) -> PyErr {
    RawError::new_err(dict.unbind())
}

impl RawWorker {
    /// The handle of a register `started` (its `_async` call's result),
    /// waited for by [`wait_operation`]: interrupted, the register goes on
    /// and the registration it makes is released once it completes.
    fn registered(
        &self,
        py: Python<'_>,
        started: Result<PendingOperation<Handle>, OperationError>,
    ) -> PyResult<RawHandle> {
        let pending = started.map_err(|e| self.operation_err(py, &e))?;
        let result = wait_operation(py, pending, |pending| {
            self.worker.release_when_registered(pending)
        })?;
        result
            .map(|handle| RawHandle { handle })
            .map_err(|e| self.operation_err(py, &e))
    }

    /// The `RawError` of a failed operation, each lost or fenced target's
    /// outcome saying how (`"lost (its reply socket closed; it exited with status 5)"`,
    /// `"fenced (it sent no alive report for a control timeout and was fenced; it was killed by signal 9)"`,
    /// from [`Worker::target_loss`]).
    fn operation_err(&self, py: Python<'_>, e: &OperationError) -> PyErr {
        let full = e.to_string();
        let dict = match error_dict(py, &e.error, full, "", &[], &e.outcomes) {
            Ok(dict) => dict,
            Err(err) => return err,
        };
        let lost: Vec<(u16, String)> = e
            .outcomes
            .iter()
            .filter(|(_, o)| matches!(o, TargetOutcome::Lost | TargetOutcome::Fenced))
            .filter_map(|(t, _)| Some((t.0, self.worker.target_loss(*t)?)))
            .collect();
        if !lost.is_empty() {
            let list = PyList::empty(py);
            for (target, outcome) in &e.outcomes {
                let text = match lost.iter().find(|(t, _)| *t == target.0) {
                    Some((_, cause)) => format!("{} ({cause})", outcome_text(outcome)),
                    None => outcome_text(outcome),
                };
                if let Err(err) = list.append((target.0, text)) {
                    return err;
                }
            }
            if let Err(err) = dict.set_item("outcomes", list) {
                return err;
            }
        }
        raw_error(dict)
    }
}

/// `seconds` as a [`Duration`]: finite, positive (or zero when
/// `zero_ok`), and no more than a `Duration` holds.
///
/// # Errors
/// `ValueError` naming `name` otherwise.
fn duration(name: &str, seconds: f64, zero_ok: bool) -> PyResult<Duration> {
    let least = if zero_ok {
        "zero or positive"
    } else {
        "positive"
    };
    if !(seconds.is_finite() && (seconds > 0.0 || (zero_ok && seconds == 0.0))) {
        return Err(PyValueError::new_err(format!(
            "{name} must be {least}, got {seconds:?}"
        )));
    }
    let max = callreg::io::worker::MAX_TIMEOUT;
    match Duration::try_from_secs_f64(seconds) {
        Ok(duration) if duration <= max => Ok(duration),
        _ => Err(PyValueError::new_err(format!(
            "{name} must be at most {} seconds, got {seconds:?}",
            max.as_secs()
        ))),
    }
}

/// A register's metadata JSON, parsed; `METADATA_INVALID` (a `RawError`)
/// when it is not metadata.
fn parse_metadata(py: Python<'_>, metadata: Option<&str>) -> PyResult<Option<CallableMetadata>> {
    metadata
        .map(|text| {
            CallableMetadata::from_json(text).map_err(|e| {
                plain_err(
                    py,
                    &Error::new(
                        ErrorCode::METADATA_INVALID,
                        OperationKind::Register,
                        format!("metadata: {e}"),
                    ),
                )
            })
        })
        .transpose()
}

fn plain_err(py: Python<'_>, e: &Error) -> PyErr {
    match error_dict(py, e, e.to_string(), "", &[], &[]) {
        Ok(dict) => raw_error(dict),
        Err(err) => err,
    }
}

fn task_err_dict<'py>(py: Python<'py>, e: &TaskError) -> PyResult<Bound<'py, PyDict>> {
    error_dict(
        py,
        &e.error,
        e.error.to_string(),
        &e.kind,
        &e.exception,
        &[],
    )
}

impl RawWorker {
    /// Starts a task on `target`, or, given none, on the target the
    /// crate's Worker picks ([`Worker::submit_any_async`]: the live
    /// targets in turn; a refusal of the pick is the pending task's
    /// error).
    fn start_task(
        &self,
        handle: &RawHandle,
        target: Option<u16>,
        input: &[u8],
        deadline: Option<Duration>,
    ) -> Result<PendingTask, Error> {
        Ok(match target {
            Some(target) => self.worker.submit_async_with_deadline(
                &handle.handle,
                TargetId(target),
                TaskEncoding::Pickle,
                input,
                deadline,
            ),
            None => {
                self.worker
                    .submit_any_async(&handle.handle, TaskEncoding::Pickle, input, deadline)
            }
        })
    }
}

#[pymethods]
impl RawWorker {
    /// A Worker, not started. `control_timeout` in seconds (positive): how
    /// long a target may stay silent about a control (it reports alive
    /// meanwhile); `operation_timeout` in seconds (positive; `None`: 10x
    /// the control timeout): how long a control may take in all
    /// ([`callreg::io::WorkerBuilder::operation_timeout`],
    /// `specs/protocol.md` §2.7). `max_frame_bytes` bounds one task's
    /// pickled input and result.
    /// `target_initializer`, when given, runs in each target at its start
    /// with the target's id ([`PythonRuntime::with_target_initializer`]:
    /// a result other than `None` is the context every callable there is
    /// called with first). `probe_first`: a callable no target installed
    /// yet goes to one target first ([`WorkerBuilder::probe_first`]).
    /// `respawn_limit` and `respawn_backoff` (seconds): replacement targets
    /// ([`WorkerBuilder::respawn_limit`], `specs/protocol.md` §2.9).
    /// `template`, when given, is the forkserver start method
    /// ([`StartMethod::Forkserver`]): `(program, args, runtime_data)` of
    /// the template process, which forks every target (the program runs
    /// [`_template_main`]; `runtime_data` is its `prepare`'s, and carries
    /// the target initializer: `target_initializer` must then be `None`).
    /// `spin` (seconds, at most 0.001; 0: never): how long a caller waiting
    /// for its own result polls before it sleeps, and a target's task
    /// thread looks for its next task before it sleeps
    /// ([`callreg::io::WorkerBuilder::spin`]).
    ///
    /// [`WorkerBuilder::probe_first`]: callreg::io::WorkerBuilder::probe_first
    /// [`WorkerBuilder::respawn_limit`]: callreg::io::WorkerBuilder::respawn_limit
    #[new]
    #[pyo3(signature = (targets, control_timeout, slot_capacity, max_frame_bytes, target_initializer=None, operation_timeout=None, probe_first=true, respawn_limit=callreg::protocol::DEFAULT_RESPAWN_LIMIT, respawn_backoff=0.1, template=None, spin=5e-5))]
    // One argument per keyword of the Python constructor.
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        targets: u16,
        control_timeout: f64,
        slot_capacity: u16,
        max_frame_bytes: usize,
        target_initializer: Option<Py<PyAny>>,
        operation_timeout: Option<f64>,
        probe_first: bool,
        respawn_limit: u16,
        respawn_backoff: f64,
        template: Option<(String, Vec<String>, Vec<u8>)>,
        spin: f64,
    ) -> PyResult<RawWorker> {
        let respawn_backoff = duration("respawn_backoff", respawn_backoff, true)?;
        let spin = duration("spin", spin, true)?;
        let control_timeout = duration("control_timeout", control_timeout, false)?;
        let operation_timeout = operation_timeout
            .map(|seconds| duration("operation_timeout", seconds, false))
            .transpose()?;
        if template.is_some() && target_initializer.is_some() {
            return Err(PyValueError::new_err(
                "a forkserver Worker's target initializer is in its template's runtime data",
            ));
        }
        let mut runtime = PythonRuntime::inherited();
        if let Some(initializer) = target_initializer {
            runtime = runtime.with_target_initializer(initializer);
        }
        let mut builder = Worker::builder(Arc::new(runtime))
            .targets(targets)
            .control_timeout(control_timeout);
        if let Some((program, args, data)) = template {
            let command = args
                .into_iter()
                .fold(TemplateCommand::new(program), TemplateCommand::arg)
                .runtime_data(data);
            builder = builder.start_method(StartMethod::Forkserver(command));
        }
        if let Some(timeout) = operation_timeout {
            builder = builder.operation_timeout(timeout);
        }
        let worker = builder
            .slot_capacity(slot_capacity)
            .max_frame_bytes(max_frame_bytes)
            .probe_first(probe_first)
            .respawn_limit(respawn_limit)
            .respawn_backoff(respawn_backoff)
            .spin(spin)
            // A Python process usually runs other threads; os.fork forks
            // anyway (with its before/after-fork steps), and so does this.
            .accept_thread_risk()
            .build()
            .map_err(|e| plain_err(py, &e))?;
        let (sender, receiver) = mpsc::channel();
        Ok(RawWorker {
            worker,
            next_task: AtomicU64::new(1),
            sender: Mutex::new(Some(sender)),
            receiver: Mutex::new(receiver),
            process: std::process::id(),
        })
    }

    /// Registers an envelope (with optional metadata JSON) and waits, GIL
    /// released, until every live target confirmed (before start: joins
    /// the startup snapshot at once).
    #[pyo3(signature = (envelope, metadata=None))]
    fn register(
        &self,
        py: Python<'_>,
        envelope: &[u8],
        metadata: Option<&str>,
    ) -> PyResult<RawHandle> {
        let metadata = parse_metadata(py, metadata)?;
        let started = py.detach(|| {
            self.worker
                .register_with_metadata_async(envelope, metadata.as_ref())
        });
        self.registered(py, started)
    }

    /// Registers the envelope written into `fd` (a `staging_memfd()`,
    /// header included) and waits (GIL released): it is sealed and staged
    /// as it is, with no copy of its bytes (`specs/staging.md` step 1).
    /// The caller keeps (and closes) its own descriptor. `payload_sha256`
    /// (32 bytes), when given, is the SHA-256 the writer took of the
    /// payload as it wrote it: the payload is then not read back
    /// ([`Worker::register_memfd_hashed`]). `ValueError` for another
    /// length.
    #[pyo3(signature = (fd, metadata, payload_sha256=None))]
    fn register_memfd(
        &self,
        py: Python<'_>,
        fd: i32,
        metadata: Option<&str>,
        payload_sha256: Option<&[u8]>,
    ) -> PyResult<RawHandle> {
        let payload_sha256 = payload_sha256
            .map(|bytes| {
                <[u8; 32]>::try_from(bytes).map_err(|_| {
                    PyValueError::new_err(format!(
                        "payload_sha256 must be 32 bytes, got {}",
                        bytes.len()
                    ))
                })
            })
            .transpose()?;
        let metadata = parse_metadata(py, metadata)?;
        // SAFETY: `fd` is the caller's open descriptor for the whole call
        // (the package's envelope writer holds it until this returns); it
        // is only duplicated here, never closed.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let owned = borrowed
            .try_clone_to_owned()
            .map_err(|e| PyValueError::new_err(format!("descriptor {fd}: {e}")))?;
        let started = py.detach(|| match payload_sha256 {
            Some(sha256) => {
                self.worker
                    .register_memfd_hashed_async(owned, sha256, metadata.as_ref())
            }
            None => self.worker.register_memfd_async(owned, metadata.as_ref()),
        });
        self.registered(py, started)
    }

    /// Unregisters and waits (GIL released, in slices: Ctrl-C raises
    /// `KeyboardInterrupt` here, and the unregister goes on).
    fn unregister(&self, py: Python<'_>, handle: &RawHandle) -> PyResult<()> {
        let started = py.detach(|| self.worker.unregister_async(&handle.handle));
        let pending = started.map_err(|e| self.operation_err(py, &e))?;
        wait_operation(py, pending, drop)?.map_err(|e| self.operation_err(py, &e))
    }

    /// Forks the targets (GIL released; the runtime's fork hooks take it
    /// around each fork) and waits until each is ready. Returns the
    /// startup-snapshot registrations that failed (`specs/protocol.md`,
    /// §2.6) as `[(handle_id, error dict)]`, each error a
    /// `REGISTER_PARTIAL_FAILURE` of operation `start` with every failing
    /// target's outcome.
    fn start<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let report = py
            .detach(|| self.worker.start())
            .map_err(|e| self.operation_err(py, &e))?;
        let failed = PyList::empty(py);
        for registration in &report.failed {
            let handle = &registration.handle;
            let error = Error::new(
                ErrorCode::REGISTER_PARTIAL_FAILURE,
                OperationKind::Start,
                registration_failure_text(registration),
            )
            .with_digest(handle.digest());
            let outcomes: Vec<(TargetId, TargetOutcome)> = registration
                .failures
                .iter()
                .map(|(target, failure)| {
                    (
                        *target,
                        TargetOutcome::Failed {
                            failure: failure.clone(),
                        },
                    )
                })
                .collect();
            let dict = error_dict(py, &error, error.to_string(), "", &[], &outcomes)?;
            failed.append((handle.handle_id, dict))?;
        }
        Ok(failed)
    }

    /// Starts a task (the caller sends its frame itself) and returns it
    /// pending; `input` is pickled `(args, kwargs)`; `timeout`: its
    /// deadline in seconds from now (`specs/protocol.md` §2.12), `None`
    /// for none. Refusals (a bad handle, no live target, a closed Worker,
    /// an input too large) are the pending's result, not raised; a bad
    /// `timeout` raises `ValueError`.
    #[pyo3(signature = (handle, target, input, timeout=None))]
    fn submit(
        &self,
        py: Python<'_>,
        handle: &RawHandle,
        target: Option<u16>,
        input: &[u8],
        timeout: Option<f64>,
    ) -> PyResult<RawPending> {
        let deadline = timeout.map(|t| duration("timeout", t, false)).transpose()?;
        let id = self.next_task.fetch_add(1, Ordering::Relaxed);
        let pending = py.detach(|| self.start_task(handle, target, input, deadline));
        match pending {
            Ok(pending) => Ok(RawPending {
                id,
                key: pending.key(),
                pending: Mutex::new(Some(pending)),
                owner: self.process,
            }),
            Err(error) => Err(plain_err(py, &error)),
        }
    }

    /// Cancels the task of `pending` if it has not started in its target
    /// (`specs/protocol.md` §2.11), waiting (GIL released) for the
    /// target's answer: `True` when it will never run (its result is then
    /// the `TASK_CANCELLED` error); `False` when it started, ended, or was
    /// refused at submit. Raises `LIFECYCLE_INVALID` (as an error dict)
    /// from another process or inside a completion callback.
    fn cancel(&self, py: Python<'_>, pending: &RawPending) -> PyResult<bool> {
        let key = pending.key;
        py.detach(|| self.worker.cancel(key))
            .map_err(|e| plain_err(py, &e))
    }

    /// Hands `pending`'s result to the completion channel
    /// ([`RawWorker::next_completions`]) instead of an inline wait: `True`
    /// once armed; `False` when another thread waits on it (that thread
    /// resolves it) or it was armed before. After close (the channel is
    /// gone) the pending is left for an inline wait, which returns the
    /// close's `LIFECYCLE_INVALID` at once.
    fn arm(&self, pending: &RawPending) -> bool {
        let sender = self
            .sender
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(sender) = sender else {
            return false;
        };
        let Some(task) = pending.take() else {
            return false;
        };
        let id = pending.id;
        task.on_complete(move |result| {
            // The dispatcher may be gone (interpreter exit): nothing waits.
            let _ = sender.send((id, result));
        });
        true
    }

    /// Runs a task and waits for its pickled result, GIL released, checking
    /// for signals every [`SIGNAL_CHECK_INTERVAL`] (a `KeyboardInterrupt`
    /// abandons the wait, not the Worker).
    #[pyo3(signature = (handle, target, input, timeout=None))]
    fn call<'py>(
        &self,
        py: Python<'py>,
        handle: &RawHandle,
        target: Option<u16>,
        input: &[u8],
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let deadline = timeout.map(|t| duration("timeout", t, false)).transpose()?;
        let mut pending = py
            .detach(|| self.start_task(handle, target, input, deadline))
            .map_err(|e| plain_err(py, &e))?;
        loop {
            match py.detach(|| pending.wait_timeout(SIGNAL_CHECK_INTERVAL)) {
                Ok(Ok(output)) => return Ok(PyBytes::new(py, &output)),
                Ok(Err(error)) => return Err(raw_error(task_err_dict(py, &error)?)),
                Err(again) => {
                    pending = again;
                    py.check_signals()?;
                }
            }
        }
    }

    /// Waits up to `timeout` seconds (GIL released) for finished tasks and
    /// returns them: a list of `(id, output, error)` with `output` the
    /// pickled result (bytes) or `None`, `error` the error dict or `None`.
    /// An empty list when none finished in time; `None` once the Worker is
    /// closed and every task was returned.
    fn next_completions<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        // Negative or NaN: do not wait; beyond what a Duration holds: wait
        // as long as one can.
        let timeout = if timeout.is_nan() || timeout <= 0.0 {
            Duration::ZERO
        } else {
            Duration::try_from_secs_f64(timeout).unwrap_or(Duration::MAX)
        };
        let received = py.detach(|| {
            let receiver = self.receiver.lock().unwrap_or_else(|p| p.into_inner());
            let mut batch = Vec::new();
            match receiver.recv_timeout(timeout) {
                Ok(first) => batch.push(first),
                Err(mpsc::RecvTimeoutError::Timeout) => return Some(batch),
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            }
            while batch.len() < COMPLETION_BATCH {
                match receiver.try_recv() {
                    Ok(next) => batch.push(next),
                    Err(_) => break,
                }
            }
            Some(batch)
        });
        let Some(batch) = received else {
            return Ok(None);
        };
        let list = PyList::empty(py);
        for (id, result) in batch {
            match result {
                Ok(output) => list.append((id, PyBytes::new(py, &output), py.None()))?,
                Err(error) => list.append((id, py.None(), task_err_dict(py, &error)?))?,
            }
        }
        Ok(Some(list))
    }

    /// Clears the poison of the callable named by `hashid`
    /// ([`callreg::io::Worker::forgive`]); whether it was poisoned.
    /// `ValueError` for a malformed hashid; `LIFECYCLE_INVALID` (as an
    /// error dict) in a forked child of the Worker's process.
    fn forgive(&self, py: Python<'_>, hashid: &str) -> PyResult<bool> {
        let parsed: callreg::descriptor::HashId = hashid
            .parse()
            .map_err(|e| PyValueError::new_err(format!("{hashid:?} is not a hashid: {e}")))?;
        self.worker.forgive(parsed).map_err(|e| plain_err(py, &e))
    }

    /// The live target ids, sorted.
    fn live_targets(&self) -> Vec<u16> {
        self.worker
            .live_targets()
            .into_iter()
            .map(|t| t.0)
            .collect()
    }

    /// A target's process id, once started.
    fn target_pid(&self, target: u16) -> Option<i32> {
        self.worker.target_pid(TargetId(target))
    }

    /// Why a target was lost, if it was.
    fn target_loss(&self, target: u16) -> Option<String> {
        self.worker.target_loss(TargetId(target))
    }

    /// The incarnation of a target's current (or next) process: 0
    /// for the one forked at start, one more per replacement.
    fn target_incarnation(&self, target: u16) -> u32 {
        self.worker.target_incarnation(TargetId(target))
    }

    /// Where a target stands: `"joined"`, `"backing_off"`,
    /// `"spawning"`, `"joining"` or `"lost"`.
    fn target_phase(&self, target: u16) -> &'static str {
        phase_name(self.worker.target_phase(TargetId(target)))
    }

    /// `(target_phase, target_incarnation)` of a target, read together.
    fn target_state(&self, target: u16) -> (&'static str, u32) {
        let (phase, incarnation) = self.worker.target_state(TargetId(target));
        (phase_name(phase), incarnation)
    }

    /// What happened to replaced targets, oldest first, as JSON (a list of
    /// `{"event": …, "target": …, …}`).
    fn target_events_json(&self) -> String {
        serde_json::to_string(&self.worker.target_events()).unwrap_or_else(|_| "[]".to_owned())
    }

    /// The parent's registry snapshot, JSON (`specs/metadata.md` §7).
    fn registry_json(&self) -> String {
        self.worker.parent_state().registry_snapshot().to_json()
    }

    /// Every live target's table as JSON (GIL released while waiting): a
    /// list of `{"target", "table": {"installed": [{"hashid", "refcount"}],
    /// "tombstones"}}`, `"table": null` for a target lost before it
    /// answered.
    fn tables_json(&self, py: Python<'_>) -> PyResult<String> {
        let tables = py
            .detach(|| self.worker.inspect())
            .map_err(|e| plain_err(py, &e))?;
        let list: Vec<serde_json::Value> = tables
            .into_iter()
            .map(|(target, table)| match table {
                None => serde_json::json!({"target": target.0, "table": null}),
                Some(table) => serde_json::json!({
                    "target": target.0,
                    "table": {
                        "incarnation": table.incarnation,
                        "installed": table.installed.iter().map(|(digest, refcount)| {
                            serde_json::json!({
                                "hashid": callreg::descriptor::HashId(*digest).to_string(),
                                "refcount": refcount,
                            })
                        }).collect::<Vec<_>>(),
                        "tombstones": table.tombstones,
                    },
                }),
            })
            .collect();
        Ok(serde_json::Value::Array(list).to_string())
    }

    /// Closes (GIL released): tasks in flight fail with
    /// `LIFECYCLE_INVALID`, targets are reaped, staged payloads unlinked.
    /// Idempotent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            self.worker.close();
            self.sender.lock().unwrap_or_else(|p| p.into_inner()).take();
        });
    }
}

/// The SPYC envelope around serializer payload `payload` (the crate's
/// [`callreg::envelope::encode`]).
#[pyfunction]
fn encode_envelope<'py>(py: Python<'py>, payload: &[u8]) -> Bound<'py, PyBytes> {
    let envelope = py.detach(|| callreg::envelope::encode(payload));
    PyBytes::new(py, &envelope)
}

/// The 16-byte SPYC envelope header for a payload of `payload_size`
/// bytes of format `version` (1, or 129 for the out-of-band form; the
/// crate's [`callreg::envelope::header_of`]): the package writes it before
/// a payload it pickles straight into the envelope's buffer. Raises
/// `ValueError` for another version.
#[pyfunction]
#[pyo3(signature = (payload_size, version = 1))]
fn envelope_header(py: Python<'_>, payload_size: u64, version: u8) -> PyResult<Bound<'_, PyBytes>> {
    if version != callreg::envelope::VERSION && version != callreg::envelope::VERSION_OUT_OF_BAND {
        return Err(PyValueError::new_err(format!(
            "no envelope form has version {version} (1, or 129 for out-of-band buffers)"
        )));
    }
    Ok(PyBytes::new(
        py,
        &callreg::envelope::header_of(version, payload_size),
    ))
}

/// Where the out-of-band form (`specs/formats.md` §1.1) places buffers of
/// `lengths` bytes after a pickle of `pickle_size` bytes: `(offsets,
/// table_offset)`, offsets from the envelope's first byte (the crate's
/// [`callreg::envelope::out_of_band_offsets`]).
#[pyfunction]
fn out_of_band_offsets(pickle_size: u64, lengths: Vec<u64>) -> (Vec<u64>, u64) {
    callreg::envelope::out_of_band_offsets(pickle_size, &lengths)
}

/// The buffer table and footer that end an out-of-band envelope
/// (`specs/formats.md` §1.1) with a pickle of `pickle_size` bytes and
/// buffers at `placed` (`(offset, length)` pairs).
#[pyfunction]
fn out_of_band_tail(
    py: Python<'_>,
    pickle_size: u64,
    placed: Vec<(u64, u64)>,
) -> Bound<'_, PyBytes> {
    PyBytes::new(
        py,
        &callreg::envelope::out_of_band_tail(pickle_size, &placed),
    )
}

/// A new sealable `memfd` for an envelope writer (`callreg._envelope`):
/// its descriptor, which the caller owns (close it), with `CLOEXEC`.
#[pyfunction]
fn staging_memfd() -> PyResult<i32> {
    use std::os::fd::IntoRawFd;
    staging::new_memfd()
        .map(IntoRawFd::into_raw_fd)
        .map_err(|e| PyOSError::new_err(e.to_string()))
}

/// The hashid of a SPYC envelope; raises `RawError` (`ENVELOPE_INVALID` and
/// the other envelope codes) for invalid bytes.
#[pyfunction]
fn envelope_hashid(py: Python<'_>, envelope: &[u8]) -> PyResult<String> {
    let parsed = py.detach(|| {
        Envelope::parse(envelope)
            .map(|parsed| python_serialized_digest(&parsed))
            .map_err(|e| Error::new(e.code(), OperationKind::Decode, e.message()))
    });
    parsed
        .map(|digest| callreg::descriptor::HashId(digest).to_string())
        .map_err(|e| plain_err(py, &e))
}

/// The template process of a forkserver Worker (run by
/// `callreg._forkserver`, in a fresh interpreter the parent started with
/// the template's descriptors, [`ExecTemplate`]): reads its setup, calls
/// `prepare(runtime_data)` (it imports the preload modules and returns the
/// target initializer, or `None`), then serves the parent, GIL released,
/// forking every target until the parent closes; returns the exit status.
/// When `prepare` raises, the parent's start fails with the exception's
/// message (its `str()`) and this returns at once.
///
/// # Errors
/// `RuntimeError` when this process was not started as a template.
#[pyfunction]
fn _template_main(py: Python<'_>, prepare: Bound<'_, PyAny>) -> PyResult<i32> {
    let template = ExecTemplate::open().map_err(PyRuntimeError::new_err)?;
    let data = PyBytes::new(py, template.runtime_data());
    let initializer = match prepare.call1((data,)) {
        Ok(initializer) => initializer,
        Err(error) => {
            let reason = error
                .value(py)
                .str()
                .map(|text| text.to_string())
                .unwrap_or_else(|_| error.to_string());
            return Ok(py.detach(|| template.fail(&reason)));
        }
    };
    let mut runtime = PythonRuntime::inherited();
    if !initializer.is_none() {
        runtime = runtime.with_target_initializer(initializer.unbind());
    }
    let runtime = Arc::new(runtime);
    Ok(py.detach(|| template.serve(runtime)))
}

#[pymodule]
fn _callreg(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RawWorker>()?;
    m.add_class::<RawHandle>()?;
    m.add_class::<RawPending>()?;
    m.add_class::<parent::RawParent>()?;
    m.add("RawError", m.py().get_type::<RawError>())?;
    m.add_function(wrap_pyfunction!(encode_envelope, m)?)?;
    m.add_function(wrap_pyfunction!(envelope_hashid, m)?)?;
    m.add_function(wrap_pyfunction!(envelope_header, m)?)?;
    m.add_function(wrap_pyfunction!(out_of_band_offsets, m)?)?;
    m.add_function(wrap_pyfunction!(out_of_band_tail, m)?)?;
    m.add(
        "OUT_OF_BAND_VERSION",
        callreg::envelope::VERSION_OUT_OF_BAND,
    )?;
    m.add_function(wrap_pyfunction!(staging_memfd, m)?)?;
    m.add("SPILL_BYTES", staging::SPILL_BYTES)?;
    m.add(
        "DEFAULT_SPIN",
        callreg::io::spin::DEFAULT_SPIN.as_secs_f64(),
    )?;
    m.add("MAX_SPIN", callreg::io::spin::MAX_SPIN.as_secs_f64())?;
    m.add("MIN_MAX_FRAME_BYTES", callreg::wire::MIN_MAX_FRAME_BYTES)?;
    m.add_function(wrap_pyfunction!(_template_main, m)?)?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "DEFAULT_MAX_FRAME_BYTES",
        callreg::wire::DEFAULT_MAX_FRAME_BYTES,
    )?;
    Ok(())
}

/// The Python name of a target phase.
fn phase_name(phase: callreg::protocol::TargetPhase) -> &'static str {
    match phase {
        callreg::protocol::TargetPhase::Joined => "joined",
        callreg::protocol::TargetPhase::BackingOff(_) => "backing_off",
        callreg::protocol::TargetPhase::Spawning => "spawning",
        callreg::protocol::TargetPhase::Joining => "joining",
        callreg::protocol::TargetPhase::Lost => "lost",
    }
}
