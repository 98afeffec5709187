//! Target-side runtimes: what turns a staged serializer payload into a
//! callable and runs tasks on it, inside a target process.
//!
//! The parent never calls a runtime: it holds digests and JSON only
//! (specs/design.md §6). A runtime value is built in the parent, inherited by
//! `fork`, and [`Runtime::start`]ed once in each target.

use std::os::fd::BorrowedFd;

use crate::envelope::Envelope;
use crate::error::ErrorCode;
use crate::metadata::CallableMetadata;
use crate::protocol::TargetId;

#[cfg(feature = "python")]
pub mod python;
pub mod testing;

/// How a task's input and result are encoded; defined with the wire
/// frames that carry it.
pub use crate::wire::TaskEncoding;

/// A failure inside a runtime: deserializing a payload or running a task.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[error("{code}: {kind}: {message}")]
pub struct RuntimeError {
    /// `DESERIALIZE_FAILED` for a payload, `TASK_FAILED` for a task, or a
    /// more specific code (e.g. `PYTHON_VERSION_MISMATCH`).
    pub code: ErrorCode,
    /// The runtime's own name for the failure, e.g. the Python exception
    /// type (`"ZeroDivisionError"`), or `"TypeError"` for a non-callable.
    pub kind: String,
    /// The full message; for a Python task failure it ends with the last
    /// traceback lines.
    pub message: String,
    /// The failure in the runtime's own serialized form, for a caller that
    /// can rebuild it (the Python runtime: the raised exception pickled
    /// with cloudpickle when available, for a task encoded
    /// [`TaskEncoding::Pickle`]); empty when there is none or it could not
    /// be serialized. Carried in the task result frame (`specs/wire.md`).
    pub exception: Vec<u8>,
}

/// An envelope a target installs: validated and digest-checked, and the
/// sealed file its bytes came from when they came as one.
#[derive(Debug, Clone, Copy)]
pub struct Staged<'a> {
    /// The envelope, borrowed from the target's view of the staged bytes
    /// (it must not be retained).
    pub envelope: Envelope<'a>,
    /// The sealed memory file that holds exactly the envelope's bytes from
    /// offset 0 (`specs/staging.md` step 3): a register after start, or a
    /// replay to a replacement. A runtime may map the out-of-band buffers
    /// of the envelope from it for as long as the callable lives
    /// (`specs/formats.md` §1.1): the seals keep those bytes unchanged.
    /// `None` for bytes held in memory (the startup snapshot, inherited
    /// by `fork`), whose buffers a runtime copies.
    pub file: Option<BorrowedFd<'a>>,
}

impl<'a> Staged<'a> {
    /// An envelope held in memory, with no file behind it.
    pub fn in_memory(envelope: Envelope<'a>) -> Self {
        Staged {
            envelope,
            file: None,
        }
    }
}

/// A target-side runtime.
///
/// Called from two threads of a target (the control thread deserializes,
/// the task thread calls), hence `Sync`.
pub trait Runtime: Send + Sync + 'static {
    /// A deserialized callable, held in a target slot.
    type Callable: Send + Sync + 'static;

    /// Starts the runtime in a freshly forked target, before its startup
    /// snapshot is installed (e.g. initialises the Python interpreter).
    ///
    /// # Errors
    /// A [`RuntimeError`] makes the target exit: it is reported lost.
    fn start(&self) -> Result<(), RuntimeError>;

    /// Starts the runtime in the target with id `target`, on the target's
    /// main thread, before the target installs its startup snapshot and
    /// before it starts any thread of its own (so the runtime may fork
    /// here, e.g. a Worker of its own: `specs/python.md`, next-level
    /// targets). The default is [`Runtime::start`].
    ///
    /// # Errors
    /// As [`Runtime::start`]: the target exits and is reported lost.
    fn start_target(&self, target: TargetId) -> Result<(), RuntimeError> {
        let _ = target;
        self.start()
    }

    /// Runs in the target once it stops serving (its control channel reported
    /// EOF, or a control frame was out of protocol), on its main thread,
    /// right before it exits (a task may still be running on the task
    /// thread). Not run when the target is killed or the runtime never
    /// started. The default does nothing.
    fn stop(&self) {}

    /// Runs in the parent right before each target's `fork`, on the
    /// forking thread (`crate::io::process::spawn_targets`). The default
    /// does nothing; a runtime whose parent runs an interpreter takes that
    /// interpreter's pre-fork steps here (`PythonRuntime::inherited`).
    fn before_fork(&self) {}

    /// Runs in the parent right after each `fork` (also when it failed),
    /// undoing [`Runtime::before_fork`]. The default does nothing.
    fn after_fork_parent(&self) {}

    /// Runs in each new target right after `fork`, before anything else
    /// that could touch the runtime (before [`Runtime::start`]). The
    /// default does nothing.
    fn after_fork_child(&self) {}

    /// Whether targets keep the descriptors they inherit from the parent
    /// (other than the Worker's own pipes, which are always closed): true
    /// when the parent's runtime state lives on in the targets (an
    /// inherited interpreter's open files), false (the default) to close
    /// every inherited close-on-exec descriptor.
    fn keeps_inherited_descriptors(&self) -> bool {
        false
    }

    /// Deserializes a serializer payload (the bytes after the SPYC header,
    /// already validated and digest-checked, borrowed straight from the
    /// read-only shared mapping; it must not be retained).
    ///
    /// # Errors
    /// `DESERIALIZE_FAILED` (or a more specific code) with the runtime's
    /// message; the target stays alive and installs nothing.
    fn deserialize(&self, payload: &[u8]) -> Result<Self::Callable, RuntimeError>;

    /// Deserializes a staged envelope of either form (`specs/formats.md`
    /// §1, §1.1). This provided version deserializes the reference form's
    /// payload ([`Runtime::deserialize`]) and refuses the out-of-band form,
    /// which only a runtime that maps buffers can install.
    ///
    /// # Errors
    /// `DESERIALIZE_FAILED` with kind `OutOfBandUnsupported` for an
    /// out-of-band envelope; then as [`Runtime::deserialize`].
    fn deserialize_staged(&self, staged: Staged<'_>) -> Result<Self::Callable, RuntimeError> {
        if staged.envelope.is_out_of_band() {
            return Err(RuntimeError {
                code: ErrorCode::DESERIALIZE_FAILED,
                kind: "OutOfBandUnsupported".to_owned(),
                message: format!(
                    "this runtime installs no envelope with out-of-band buffers (version {})",
                    crate::envelope::VERSION_OUT_OF_BAND
                ),
                exception: Vec::new(),
            });
        }
        self.deserialize(staged.envelope.payload())
    }

    /// Installs a staged envelope with its registration's metadata
    /// (`specs/metadata.md`): makes the checks the metadata asks for, then
    /// deserializes ([`Runtime::deserialize_staged`]). Nothing is
    /// deserialized when a check fails.
    ///
    /// This provided version honours no metadata itself: it deserializes
    /// when `metadata` is `None` or asks for nothing a runtime must do (a
    /// name and hooks only — hooks are run by the target loop), and refuses
    /// the rest ([`refuse_unhonoured_metadata`]). Runtimes that can check
    /// versions, dependencies and executors (`PythonRuntime`) override it.
    ///
    /// # Errors
    /// As [`refuse_unhonoured_metadata`], then as
    /// [`Runtime::deserialize_staged`].
    fn install(
        &self,
        staged: Staged<'_>,
        metadata: Option<&CallableMetadata>,
    ) -> Result<Self::Callable, RuntimeError> {
        if let Some(metadata) = metadata {
            refuse_unhonoured_metadata(metadata)?;
        }
        self.deserialize_staged(staged)
    }

    /// [`Runtime::install`], calling `begun` once the install actually
    /// begins: once this runtime holds what the install needs and runs it
    /// (for Python, once the control thread holds the interpreter lock).
    /// Until then the control is *queued* — for instance behind a task
    /// that holds the lock — and from then on *running* until it is
    /// answered; a target reports which in its alive reports
    /// (`specs/protocol.md` §2.7, §2.8: only a probe fenced while running
    /// is evidence against its digest). `begun` is called at most once,
    /// and not at all when the install fails before it begins (a refused
    /// check).
    ///
    /// This provided version calls `begun`, then [`Runtime::install`]: a
    /// runtime that waits for nothing begins when it is called. A runtime
    /// with a lock a task can hold (`PythonRuntime`) overrides it.
    ///
    /// # Errors
    /// As [`Runtime::install`].
    fn install_reporting(
        &self,
        staged: Staged<'_>,
        metadata: Option<&CallableMetadata>,
        begun: &dyn Fn(),
    ) -> Result<Self::Callable, RuntimeError> {
        begun();
        self.install(staged, metadata)
    }

    /// Runs `release`, which drops callables of this runtime (a slot the
    /// protocol freed: an unregister's last reference, or the end of the
    /// last run of a tombstoned slot), so that their finalizers run now,
    /// inside the operation that freed them, and reports what they did.
    /// The target calls it before it answers that operation: a finalizer
    /// that is slow delays that answer (and is fenced with it at the
    /// control timeout), one that ends the process loses the target during
    /// that operation, never during a later one.
    ///
    /// This provided version just runs `release` (plain Rust drops).
    ///
    /// # Errors
    /// A [`RuntimeError`] describing a failure a finalizer reported (for
    /// Python: an exception raised in `__del__`, with its type and
    /// message); the callables are released all the same.
    fn finalize(&self, release: &mut dyn FnMut()) -> Result<(), RuntimeError> {
        release();
        Ok(())
    }

    /// Runs one task on `callable` with `input` encoded as `encoding`;
    /// returns the result encoded the same way.
    ///
    /// # Errors
    /// `TASK_FAILED` with the failure's kind, message and traceback lines.
    fn call(
        &self,
        callable: &Self::Callable,
        encoding: TaskEncoding,
        input: &[u8],
    ) -> Result<Vec<u8>, RuntimeError>;
}

/// Refuses metadata that a runtime without version, dependency or executor
/// support cannot honour, so that a registration never silently skips a
/// check its producer asked for.
///
/// # Errors
/// In this order: `EXECUTOR_UNKNOWN` (kind `ExecutorUnknown`) when
/// `executor` or `executor_data` is given; `METADATA_INVALID` (kind
/// `MetadataUnsupported`) naming `python` when versions are given, or
/// `deps` when a pip requirement or bash command is.
pub fn refuse_unhonoured_metadata(metadata: &CallableMetadata) -> Result<(), RuntimeError> {
    if metadata.executor.is_some() || metadata.executor_data.is_some() {
        return Err(RuntimeError {
            code: ErrorCode::EXECUTOR_UNKNOWN,
            kind: "ExecutorUnknown".to_owned(),
            message: format!(
                "executor {:?} is unknown: this runtime has no executors",
                metadata.executor_short_name()
            ),
            exception: Vec::new(),
        });
    }
    let unsupported = |field: &str| RuntimeError {
        code: ErrorCode::METADATA_INVALID,
        kind: "MetadataUnsupported".to_owned(),
        message: format!("this runtime cannot honour the metadata field {field:?}"),
        exception: Vec::new(),
    };
    if metadata.python.is_some() {
        return Err(unsupported("python"));
    }
    if !metadata.deps.is_empty() {
        return Err(unsupported("deps"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_provided_install_refuses_what_it_cannot_honour() {
        let parse = |text: &str| CallableMetadata::from_json(text).unwrap();
        let hashid = "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1";
        assert_eq!(
            refuse_unhonoured_metadata(&parse(&format!(
                r#"{{"name": "f", "call_before": [{{"hashid": "{hashid}", "retval_keyword": "c"}}]}}"#
            ))),
            Ok(())
        );
        let refused = |text: &str| refuse_unhonoured_metadata(&parse(text)).unwrap_err();
        assert_eq!(
            refused(r#"{"name": "f", "executor": "python"}"#),
            RuntimeError {
                code: ErrorCode::EXECUTOR_UNKNOWN,
                kind: "ExecutorUnknown".into(),
                message: "executor \"python\" is unknown: this runtime has no executors".into(),
                exception: Vec::new(),
            }
        );
        assert_eq!(
            refused(
                r#"{"name": "f", "python": {"version": "3.11", "serializer": "cloudpickle", "serializer_version": "2"}}"#
            ),
            RuntimeError {
                code: ErrorCode::METADATA_INVALID,
                kind: "MetadataUnsupported".into(),
                message: "this runtime cannot honour the metadata field \"python\"".into(),
                exception: Vec::new(),
            }
        );
        assert_eq!(
            refused(r#"{"name": "f", "deps": {"bash": {"commands": ["true"]}}}"#).message,
            "this runtime cannot honour the metadata field \"deps\""
        );
    }
}
