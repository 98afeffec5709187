//! `RawParent`: the protocol's parent machine ([`Parent`]) for a Python
//! IO layer of its own, such as `callreg.dask`'s cluster registry, whose
//! targets are a cluster's workers and whose transport is the cluster's
//! comms (`specs/python.md` §6).
//!
//! * No IO and no clock here: every input takes `now` (microseconds on
//!   the caller's monotonic clock); every decision is the machine's.
//! * Effects come out as tuples (see [`RawParent::effects`]), errors as
//!   `RawError` with the same dict as a Worker's.

use std::str::FromStr;

use callreg::descriptor::{Digest, HashId};
use callreg::error::ErrorCode;
use callreg::io::worker::outcome_text;
use callreg::metadata::CallableMetadata;
use callreg::protocol::{
    Completion, ControlFrame, ControlPhase, Effect, Failure, Namespace, OwnerToken, Parent,
    ParentConfig, Reply, Seq, StagingId, TargetId, Time,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::errors::{error_dict, plain_err};
use crate::handle::RawHandle;
use crate::worker::phase_name;

/// The parent machine of a registry whose targets arrive on their own
/// (`ParentConfig::unbounded_spawn`); driven from Python, one caller at a
/// time (the package calls it from one event loop).
#[pyclass(module = "callreg._callreg")]
pub(crate) struct RawParent {
    machine: Parent,
}

/// `hashid` (`"sha256:"` + 64 hex digits) as a digest.
///
/// # Errors
/// `ValueError` for any other text.
fn digest_of(hashid: &str) -> PyResult<Digest> {
    HashId::from_str(hashid)
        .map(|h| h.digest())
        .map_err(|e| PyValueError::new_err(format!("{hashid:?} is not a hashid: {e}")))
}

fn micros(name: &str, seconds: f64) -> PyResult<u64> {
    if !(seconds.is_finite() && seconds >= 0.0 && seconds * 1e6 < u64::MAX as f64) {
        return Err(PyValueError::new_err(format!(
            "{name} must be a finite number of seconds, zero or more, got {seconds}"
        )));
    }
    Ok((seconds * 1e6) as u64)
}

fn hashid_text(digest: Digest) -> String {
    HashId::from(digest).to_string()
}

/// One effect as a tuple whose first item names it (`specs/python.md` §6).
fn effect_tuple<'py>(py: Python<'py>, effect: Effect) -> PyResult<Bound<'py, PyTuple>> {
    let tuple = match effect {
        Effect::Stage { staging, digest } => {
            ("stage", staging.0, hashid_text(digest)).into_pyobject(py)?
        }
        Effect::Restage { staging, digest } => {
            ("restage", staging.0, hashid_text(digest)).into_pyobject(py)?
        }
        Effect::Send { target, frame } => {
            let (kind, staging) = match frame {
                ControlFrame::Register { staging, .. } => ("register", Some(staging.0)),
                ControlFrame::Unregister { .. } => ("unregister", None),
                ControlFrame::Task { .. } => ("task", None),
                ControlFrame::Cancel { .. } => ("cancel", None),
            };
            (
                "send",
                target.0,
                kind,
                frame.seq().0,
                hashid_text(frame.digest()),
                staging,
            )
                .into_pyobject(py)?
        }
        Effect::Verify {
            target,
            staging,
            digest,
        } => ("verify", target.0, staging.0, hashid_text(digest)).into_pyobject(py)?,
        Effect::ReleaseStaged { staging } => ("release", staging.0).into_pyobject(py)?,
        Effect::Fence { target, .. } => ("fence", target.0).into_pyobject(py)?,
        Effect::Retire {
            target,
            incarnation,
            tasks,
        } => ("retire", target.0, incarnation, tasks).into_pyobject(py)?,
        Effect::Spawn {
            target,
            incarnation,
        } => ("spawn", target.0, incarnation).into_pyobject(py)?,
        Effect::Joined {
            target,
            incarnation,
        } => ("joined", target.0, incarnation).into_pyobject(py)?,
        Effect::JoinFailed {
            target,
            incarnation,
            failure,
        } => (
            "join_failed",
            target.0,
            incarnation,
            failure.code.as_str(),
            failure.message,
        )
            .into_pyobject(py)?,
        Effect::Abandoned {
            target,
            failed_joins,
        } => ("abandoned", target.0, failed_joins).into_pyobject(py)?,
        Effect::Inspect { target, seq } => ("inspect", target.0, seq.0).into_pyobject(py)?,
        Effect::InspectDone { seq, missing } => (
            "inspect_done",
            seq.0,
            missing.iter().map(|t| t.0).collect::<Vec<u16>>(),
        )
            .into_pyobject(py)?,
        Effect::TaskDone {
            seq,
            target,
            incarnation,
            digest,
            end,
        } => {
            let error = match end.error(seq, target, incarnation, digest) {
                None => py.None(),
                Some(e) => error_dict(py, &e, e.to_string(), "", &[], &[])?
                    .into_any()
                    .unbind(),
            };
            ("task_done", seq.0, target.0, incarnation, error).into_pyobject(py)?
        }
        Effect::CancelRefused { seq, failure } => (
            "cancel_refused",
            seq.0,
            failure.code.as_str(),
            failure.message,
        )
            .into_pyobject(py)?,
        Effect::Completed {
            op,
            result,
            outcomes,
        } => {
            let texts = PyList::empty(py);
            for (target, outcome) in &outcomes {
                texts.append((target.0, outcome_text(outcome)))?;
            }
            let (handle, error) = match result {
                Ok(Completion::Registered(handle) | Completion::Unregistered(handle)) => {
                    (RawHandle { handle }.into_py_any(py)?, py.None())
                }
                Err(e) => (
                    py.None(),
                    error_dict(py, &e, e.to_string(), "", &[], &outcomes)?
                        .into_any()
                        .unbind(),
                ),
            };
            ("completed", op.0, handle, error, texts).into_pyobject(py)?
        }
    };
    Ok(tuple)
}

#[pymethods]
impl RawParent {
    /// A machine of `targets` targets (1..=65535), none started. Seconds
    /// for the timeouts and the back-off; `owner` is stamped on every
    /// handle (a random 64-bit token).
    ///
    /// # Errors
    /// `ValueError` for 0 targets or a negative or non-finite time.
    #[new]
    #[pyo3(signature = (targets, *, owner, control_timeout, operation_timeout, probe_first, respawn_limit, respawn_backoff, slot_capacity))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        targets: u16,
        owner: u64,
        control_timeout: f64,
        operation_timeout: f64,
        probe_first: bool,
        respawn_limit: u16,
        respawn_backoff: f64,
        slot_capacity: u16,
    ) -> PyResult<RawParent> {
        if targets == 0 {
            return Err(PyValueError::new_err("targets must be at least 1"));
        }
        let config = ParentConfig {
            targets,
            control_timeout: micros("control_timeout", control_timeout)?,
            operation_timeout: micros("operation_timeout", operation_timeout)?,
            fence_on_timeout: true,
            owner: OwnerToken(owner),
            slot_capacity,
            probe_first,
            respawn_limit,
            respawn_backoff: micros("respawn_backoff", respawn_backoff)?,
            unbounded_spawn: true,
            max_tasks_per_target: 0,
        };
        Ok(RawParent {
            machine: Parent::new(config),
        })
    }

    /// `Parent::start`: every target is started (and then, for a cluster,
    /// lost at once, which opens it: specs/protocol.md §2.9, "Arrivals").
    fn start(&mut self, py: Python<'_>) -> PyResult<()> {
        self.machine.start().map_err(|e| plain_err(py, &e))
    }

    /// `Parent::close`: every operation in flight completes with
    /// `LIFECYCLE_INVALID` (drain [`RawParent::effects`] after).
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        self.machine.close().map_err(|e| plain_err(py, &e))
    }

    /// `Parent::register_with_metadata` of `hashid`, `metadata` a JSON
    /// text or `None`: the operation's id.
    fn register(
        &mut self,
        py: Python<'_>,
        hashid: &str,
        metadata: Option<&str>,
        now: u64,
    ) -> PyResult<u64> {
        let digest = digest_of(hashid)?;
        let metadata = crate::worker::parse_metadata(py, metadata)?;
        // A register with metadata passes the same checks as a Worker's
        // (specs/metadata.md): the hooks, then one metadata per digest.
        if let Some(m) = &metadata {
            self.machine
                .check_hooks(digest, m)
                .map_err(|e| plain_err(py, &e))?;
        }
        let result = self.machine.register_with_metadata(
            digest,
            Namespace::LocalPython,
            metadata.as_ref().map(CallableMetadata::identity),
            Time(now),
        );
        result.map(|op| op.0).map_err(|e| plain_err(py, &e))
    }

    /// `Parent::unregister`: the operation's id.
    fn unregister(&mut self, py: Python<'_>, handle: &RawHandle, now: u64) -> PyResult<u64> {
        self.machine
            .unregister(&handle.handle, Time(now))
            .map(|op| op.0)
            .map_err(|e| plain_err(py, &e))
    }

    /// `Parent::resolve`: the hashid of a live handle of this machine.
    fn resolve(&self, py: Python<'_>, handle: &RawHandle) -> PyResult<String> {
        self.machine
            .resolve(&handle.handle, Namespace::LocalPython)
            .map(hashid_text)
            .map_err(|e| plain_err(py, &e))
    }

    /// `Parent::handle_reply`: `target` answered frame `seq` about
    /// `hashid`, `failure` `None` (it took effect) or `(code, message)`.
    fn handle_reply(
        &mut self,
        py: Python<'_>,
        target: u16,
        seq: u64,
        hashid: &str,
        failure: Option<(String, String)>,
        now: u64,
    ) -> PyResult<()> {
        let result = match failure {
            None => Ok(()),
            Some((code, message)) => {
                let code = ErrorCode::from_str(&code)
                    .map_err(|e| PyValueError::new_err(format!("{e}")))?;
                Err(Failure::new(code, message))
            }
        };
        let reply = Reply {
            seq: Seq(seq),
            digest: digest_of(hashid)?,
            result,
        };
        self.machine
            .handle_reply(TargetId(target), reply, Time(now))
            .map_err(|e| plain_err(py, &e))
    }

    /// `Parent::handle_alive`: `target` is alive and still busy with
    /// frame `seq` (its silence deadline moves; the operation's bound does
    /// not, `specs/protocol.md` §2.7). `running`: the report says the
    /// frame's install has begun there (`ControlPhase::Running`); the
    /// default, `False`, says nothing of the kind (`Queued`), so a fence of
    /// a probe at its bound is then no evidence against its digest (§2.8).
    #[pyo3(signature = (target, seq, now, running = false))]
    fn handle_alive(
        &mut self,
        py: Python<'_>,
        target: u16,
        seq: u64,
        now: u64,
        running: bool,
    ) -> PyResult<()> {
        let phase = if running {
            ControlPhase::Running
        } else {
            ControlPhase::Queued
        };
        self.machine
            .handle_alive(TargetId(target), Seq(seq), phase, Time(now))
            .map_err(|e| plain_err(py, &e))
    }

    /// `Parent::target_died`: `target`'s process is gone, `cause` how.
    fn target_died(&mut self, py: Python<'_>, target: u16, cause: &str, now: u64) -> PyResult<()> {
        self.machine
            .target_died(TargetId(target), cause, Time(now))
            .map_err(|e| plain_err(py, &e))
    }

    /// `Parent::target_left`: `target` left (a cluster's worker), `cause`
    /// how; no evidence against a digest it was probing.
    fn target_left(&mut self, py: Python<'_>, target: u16, cause: &str, now: u64) -> PyResult<()> {
        self.machine
            .target_left(TargetId(target), cause, Time(now))
            .map_err(|e| plain_err(py, &e))
    }

    /// `Parent::target_spawned`: a process arrived in open `target`
    /// as incarnation `incarnation`.
    fn target_spawned(
        &mut self,
        py: Python<'_>,
        target: u16,
        incarnation: u32,
        now: u64,
    ) -> PyResult<()> {
        self.machine
            .target_spawned(TargetId(target), incarnation, Time(now))
            .map_err(|e| plain_err(py, &e))
    }

    /// `Parent::stage_failed`: the payload of `staging` could not be made
    /// ready to send.
    fn stage_failed(&mut self, py: Python<'_>, staging: u64, message: String) -> PyResult<()> {
        self.machine
            .stage_failed(
                StagingId(staging),
                Failure::new(ErrorCode::IO_FAILED, message),
            )
            .map_err(|e| plain_err(py, &e))
    }

    /// `Parent::handle_timeout`.
    fn handle_timeout(&mut self, now: u64) {
        self.machine.handle_timeout(Time(now));
    }

    /// `Parent::poll_timeout`: microseconds, or `None`.
    fn poll_timeout(&self) -> Option<u64> {
        self.machine.poll_timeout().map(|t| t.0)
    }

    /// Every effect the machine has, oldest first, as tuples:
    /// `("stage" | "restage", staging, hashid)`,
    /// `("send", target, "register" | "unregister" | "task" | "cancel",
    /// seq, hashid, staging | None)`, `("release", staging)`,
    /// `("fence", target)`, `("spawn" | "joined", target, incarnation)`,
    /// `("join_failed", target, incarnation, code, message)`,
    /// `("abandoned", target, failed_joins)`, `("inspect", target, seq)`,
    /// `("inspect_done", seq, [target])`,
    /// `("task_done", seq, target, incarnation, error_dict | None)`,
    /// `("cancel_refused", seq, code, message)`,
    /// `("completed", op, RawHandle | None, error_dict | None, [(target,
    /// outcome)])`.
    fn effects<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        while let Some(effect) = self.machine.poll_effect() {
            list.append(effect_tuple(py, effect)?)?;
        }
        Ok(list)
    }

    /// A target's phase: `"joined"`, `"backing_off"`, `"spawning"` (open,
    /// for a cluster), `"joining"` or `"lost"`.
    fn target_phase(&self, target: u16) -> &'static str {
        phase_name(self.machine.target_phase(TargetId(target)))
    }

    /// The incarnation of `target`'s current (or next) process.
    fn incarnation(&self, target: u16) -> u32 {
        self.machine.incarnation(TargetId(target))
    }

    /// Every live handle, in handle order.
    fn live_handles(&self) -> Vec<RawHandle> {
        self.machine
            .live_handles()
            .into_iter()
            .map(|handle| RawHandle { handle })
            .collect()
    }

    /// Whether `hashid` is poisoned here (`specs/protocol.md` §2.8).
    fn is_poisoned(&self, hashid: &str) -> PyResult<bool> {
        Ok(self.machine.is_poisoned(digest_of(hashid)?))
    }

    /// Whether the envelope of `hashid` must be kept for replays.
    fn keeps_envelope(&self, hashid: &str) -> PyResult<bool> {
        Ok(self.machine.keeps_envelope(digest_of(hashid)?))
    }
}
