//! Target-side runtimes: what turns a staged serializer payload into a
//! callable and runs tasks on it, inside a target process.
//!
//! The parent never calls a runtime: it holds digests and JSON only
//! (DESIGN.md §6). A runtime value is built in the parent, inherited by
//! `fork`, and [`Runtime::start`]ed once in each target.

use crate::error::ErrorCode;

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

    /// Deserializes a serializer payload (the bytes after the SPYC header,
    /// already validated and digest-checked, borrowed straight from the
    /// read-only shared mapping; it must not be retained).
    ///
    /// # Errors
    /// `DESERIALIZE_FAILED` (or a more specific code) with the runtime's
    /// message; the target stays alive and installs nothing.
    fn deserialize(&self, payload: &[u8]) -> Result<Self::Callable, RuntimeError>;

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
