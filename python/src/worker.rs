//! `RawWorker`: a [`Worker`] with Python targets forked from this
//! interpreter, and what its methods share (waits that run the signal
//! handlers, option conversions).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use crate::errors::{error_dict, plain_err, raw_error, task_err_dict};
use crate::handle::RawHandle;
use crate::pending::RawPending;
use crate::SIGNAL_CHECK_INTERVAL;
use callreg::error::{Error, ErrorCode, OperationKind};
use callreg::io::worker::{
    outcome_text, registration_failure_text, OperationError, PendingOperation, PendingTask,
    TaskError,
};
use callreg::io::zygote::TemplateCommand;
use callreg::io::{StartMethod, Worker};
use callreg::metadata::CallableMetadata;
use callreg::protocol::{Handle, TargetId, TargetOutcome};
use callreg::runtime::python::PythonRuntime;
use callreg::runtime::TaskEncoding;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// At most this many completions are returned by one
/// [`RawWorker::next_completions`].
pub(crate) const COMPLETION_BATCH: usize = 4096;

/// One finished task, from the IO thread to the dispatcher: its id and result.
pub(crate) type Completion = (u64, Result<Vec<u8>, TaskError>);

/// Waits for `pending` with the GIL released, in slices of
/// [`SIGNAL_CHECK_INTERVAL`], running the signal handlers between them. A
/// handler's exception (Ctrl-C's `KeyboardInterrupt`) is returned at once,
/// after `pending` is handed to `interrupted`.
pub(crate) fn wait_operation<T: Send>(
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
pub(crate) struct RawWorker {
    pub(crate) worker: Worker<PythonRuntime>,
    pub(crate) next_task: AtomicU64,
    /// Cloned into each submitted task's completion callback; dropped at
    /// close, so the channel disconnects once every task completed.
    pub(crate) sender: Mutex<Option<mpsc::Sender<Completion>>>,
    pub(crate) receiver: Mutex<mpsc::Receiver<Completion>>,
    /// The process that built it.
    pub(crate) process: u32,
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
pub(crate) fn duration(name: &str, seconds: f64, zero_ok: bool) -> PyResult<Duration> {
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
pub(crate) fn parse_metadata(
    py: Python<'_>,
    metadata: Option<&str>,
) -> PyResult<Option<CallableMetadata>> {
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

/// The forkserver template as Python gives it: `(program, args,
/// runtime_data, before_ready)`.
type TemplateArgs = (String, Vec<String>, Vec<u8>, Option<String>);

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
    /// ([`StartMethod::Forkserver`]): `(program, args, runtime_data,
    /// before_ready)` of the template process
    /// ([`TemplateCommand::before_ready`]: what it does first, named in its
    /// start errors), which forks every target (the program runs
    /// [`_template_main`]; `runtime_data` is its `prepare`'s, and carries
    /// the target initializer: `target_initializer` must then be `None`).
    /// `max_tasks_per_target` (0: no bound): how many tasks one target
    /// process is sent before it retires and is replaced
    /// ([`WorkerBuilder::max_tasks_per_target`], `specs/protocol.md`
    /// §2.14).
    /// `spin` (seconds, at most 0.001; 0: never): how long a caller waiting
    /// for its own result polls before it sleeps, and a target's task
    /// thread looks for its next task before it sleeps
    /// ([`callreg::io::WorkerBuilder::spin`]).
    ///
    /// [`WorkerBuilder::probe_first`]: callreg::io::WorkerBuilder::probe_first
    /// [`WorkerBuilder::respawn_limit`]: callreg::io::WorkerBuilder::respawn_limit
    /// [`WorkerBuilder::max_tasks_per_target`]: callreg::io::WorkerBuilder::max_tasks_per_target
    #[new]
    #[pyo3(signature = (targets, control_timeout, slot_capacity, max_frame_bytes, target_initializer=None, operation_timeout=None, probe_first=true, respawn_limit=callreg::protocol::DEFAULT_RESPAWN_LIMIT, respawn_backoff=0.1, template=None, spin=5e-5, max_tasks_per_target=0))]
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
        template: Option<TemplateArgs>,
        spin: f64,
        max_tasks_per_target: u32,
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
        if let Some((program, args, data, preload_note)) = template {
            let command = args
                .into_iter()
                .fold(TemplateCommand::new(program), TemplateCommand::arg)
                .runtime_data(data);
            let command = match preload_note {
                Some(note) => command.before_ready(note),
                None => command,
            };
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
            .max_tasks_per_target(max_tasks_per_target)
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

/// The Python name of a target phase.
pub(crate) fn phase_name(phase: callreg::protocol::TargetPhase) -> &'static str {
    match phase {
        callreg::protocol::TargetPhase::Joined => "joined",
        callreg::protocol::TargetPhase::BackingOff(_) => "backing_off",
        callreg::protocol::TargetPhase::Spawning => "spawning",
        callreg::protocol::TargetPhase::Joining => "joining",
        callreg::protocol::TargetPhase::Lost => "lost",
    }
}
