//! Executors (`specs/design.md` §6): the [`PythonExecutor`] trait, the
//! built-in [`InterpreterExecutor`], and the lookup and rehydration of a
//! callable's executor from its metadata at install.

use std::fmt;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use serde_json::{Map, Value};

use super::{PythonRuntime, RuntimeError};
use crate::error::ErrorCode;
use crate::metadata::{CallableMetadata, ExecutorSpec, RehydrateError, DEFAULT_EXECUTOR};

/// An executor a Python target can rehydrate from metadata by its short
/// name (specs/design.md §6, the transport-graph `executor` / `executor_data`
/// convention): it decides how a task of an installed callable runs.
///
/// Embedders add their own with [`PythonRuntime::with_executor`]; the
/// built-in one is [`InterpreterExecutor`] (`"python"`).
pub trait PythonExecutor: Send + Sync + 'static {
    /// The registry entry: short name, type name (what `executor_data.type`
    /// must say) and every attribute with its default (the default's JSON
    /// type is the attribute's type).
    fn spec(&self) -> ExecutorSpec;

    /// Runs one task: `callable(*args, **kwargs)` as this executor does it,
    /// with the attributes rehydrated at install ([`ExecutorSpec::rehydrate`]).
    /// The returned object is encoded as the task's result.
    ///
    /// # Errors
    /// A Python exception, reported as `TASK_FAILED` with its type, message
    /// and traceback.
    fn call<'py>(
        &self,
        py: Python<'py>,
        attributes: &Map<String, Value>,
        callable: &Bound<'py, PyAny>,
        args: &Bound<'py, PyTuple>,
        kwargs: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyAny>>;
}

/// The built-in executor `"python"` (type `PythonExecutor`): runs the call
/// in the target's own interpreter, on the task thread.
///
/// Attribute `capture_output` (boolean, default `false`): when true, the
/// task's result is the object
/// `{"result": RESULT, "stdout": "TEXT", "stderr": "TEXT"}`, the text that
/// Python code wrote to `sys.stdout` and `sys.stderr` during the call
/// (`contextlib.redirect_stdout`/`redirect_stderr`; writes to the file
/// descriptors by C code or subprocesses are not captured, and the capture
/// is discarded when the call raises).
#[derive(Debug, Default, Clone, Copy)]
pub struct InterpreterExecutor;

/// Short name of [`InterpreterExecutor`].
pub const INTERPRETER_EXECUTOR: &str = DEFAULT_EXECUTOR;

/// Type name of [`InterpreterExecutor`] in `executor_data.type`.
pub const INTERPRETER_EXECUTOR_TYPE: &str = "PythonExecutor";

impl PythonExecutor for InterpreterExecutor {
    fn spec(&self) -> ExecutorSpec {
        let mut defaults = Map::new();
        defaults.insert("capture_output".to_owned(), Value::Bool(false));
        ExecutorSpec::new(INTERPRETER_EXECUTOR, INTERPRETER_EXECUTOR_TYPE, defaults)
    }

    fn call<'py>(
        &self,
        py: Python<'py>,
        attributes: &Map<String, Value>,
        callable: &Bound<'py, PyAny>,
        args: &Bound<'py, PyTuple>,
        kwargs: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let capture = attributes
            .get("capture_output")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if capture {
            py.import(HELPERS_MODULE)?
                .getattr("call_capturing")?
                .call1((callable, args, kwargs))
        } else {
            callable.call(args, Some(kwargs))
        }
    }
}

/// Name of the helper module compiled at start (`checks::HELPERS_SOURCE`).
const HELPERS_MODULE: &str = "_callreg_metadata";

/// An executor and the attributes rehydrated for one callable.
pub(super) struct InstalledExecutor {
    pub(super) executor: Arc<dyn PythonExecutor>,
    pub(super) attributes: Map<String, Value>,
}

impl fmt::Debug for InstalledExecutor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InstalledExecutor")
            .field("short_name", &self.executor.spec().short_name)
            .field("attributes", &self.attributes)
            .finish()
    }
}
impl PythonRuntime {
    /// Looks up and rehydrates the executor `metadata` names (pure: no Python).
    ///
    /// # Errors
    /// `EXECUTOR_UNKNOWN` with kind `ExecutorUnknown` for a short name not
    /// in the registry; then as [`rehydrate_error`].
    pub(super) fn rehydrate(
        &self,
        metadata: &CallableMetadata,
    ) -> Result<InstalledExecutor, RuntimeError> {
        let short_name = metadata.executor_short_name();
        let executor = self.executors.get(short_name).ok_or_else(|| RuntimeError {
            code: ErrorCode::EXECUTOR_UNKNOWN,
            kind: "ExecutorUnknown".to_owned(),
            message: format!(
                "no executor named {short_name:?} in this target (known: {})",
                self.executor_names().join(", ")
            ),
            exception: Vec::new(),
        })?;
        let attributes = executor
            .spec()
            .rehydrate(metadata.executor_data.as_ref())
            .map_err(rehydrate_error)?;
        Ok(InstalledExecutor {
            executor: Arc::clone(executor),
            attributes,
        })
    }
}

/// The [`RuntimeError`] of a failed rehydration: the code of
/// [`RehydrateError::code`], kind `ExecutorTypeMismatch`,
/// `ExecutorAttributeUnknown` or `ExecutorAttributeInvalid`, and its text.
fn rehydrate_error(error: RehydrateError) -> RuntimeError {
    let kind = match error {
        RehydrateError::TypeMismatch { .. } => "ExecutorTypeMismatch",
        RehydrateError::AttributeUnknown { .. } => "ExecutorAttributeUnknown",
        RehydrateError::AttributeType { .. } => "ExecutorAttributeInvalid",
    };
    RuntimeError {
        code: error.code(),
        kind: kind.to_owned(),
        message: error.to_string(),
        exception: Vec::new(),
    }
}
