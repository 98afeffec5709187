//! Task results (`specs/python.md` §3): a task's return value encoded as
//! compact JSON or pickled, and the `TASK_FAILED` error of a result the
//! serializer refuses.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};
use pyo3::PyErr;

use super::exceptions::{describe_exception, pickled_exception, type_name};
use super::interpreter::PythonFunctions;
use super::RuntimeError;
use crate::error::ErrorCode;

/// Encodes a task's return value as compact JSON bytes.
pub(super) fn json_result(
    py: Python<'_>,
    functions: &PythonFunctions,
    result: &Bound<'_, PyAny>,
) -> Result<Vec<u8>, RuntimeError> {
    let encoded = functions
        .json_encode
        .bind(py)
        .call1((result,))
        .map_err(|err| unencodable_result(py, &err, result, "JSON-serializable"))?;
    let text = encoded
        .cast::<PyString>()
        .map_err(|_| unencodable_result_text(result, "json.dumps did not return a str"))?;
    // With ensure_ascii (the default) the text is ASCII, so this cannot fail
    // on surrogates.
    let text = text
        .to_str()
        .map_err(|err| unencodable_result(py, &err, result, "JSON-serializable"))?;
    Ok(text.as_bytes().to_vec())
}

/// Encodes a task's return value with pickle.
pub(super) fn pickle_result(
    py: Python<'_>,
    functions: &PythonFunctions,
    result: &Bound<'_, PyAny>,
) -> Result<Vec<u8>, RuntimeError> {
    let encoded = functions
        .result_dumps
        .bind(py)
        .call1((result, functions.pickle_protocol.bind(py)))
        .map_err(|err| {
            let mut failure = unencodable_result(py, &err, result, "picklable");
            // The pickling error itself travels too, as a task's own
            // exception does: the parent raises it as itself, as
            // ProcessPoolExecutor does (specs/python.md §3), with a note
            // saying what failed to pickle (Python 3.11 and later).
            let value = err.value(py);
            if value.hasattr("add_note").unwrap_or(false) {
                let note = format!(
                    "(raised pickling the task's result, of type '{}', in its target)",
                    type_name(&result.get_type())
                );
                let _ = value.call_method1("add_note", (note,));
            }
            failure.exception = pickled_exception(py, functions, &err);
            failure
        })?;
    let bytes = encoded
        .cast::<PyBytes>()
        .map_err(|_| unencodable_result_text(result, "pickle.dumps did not return bytes"))?;
    Ok(bytes.as_bytes().to_vec())
}

/// A `TASK_FAILED` error for a result the serializer refused.
fn unencodable_result(
    py: Python<'_>,
    err: &PyErr,
    result: &Bound<'_, PyAny>,
    what: &str,
) -> RuntimeError {
    let (kind, message) = describe_exception(py, err);
    RuntimeError {
        code: ErrorCode::TASK_FAILED,
        kind,
        message: format!(
            "the task's result of type '{}' is not {what}: {message}",
            type_name(&result.get_type())
        ),
        exception: Vec::new(),
    }
}

fn unencodable_result_text(result: &Bound<'_, PyAny>, reason: &str) -> RuntimeError {
    RuntimeError {
        code: ErrorCode::TASK_FAILED,
        kind: "TypeError".to_owned(),
        message: format!(
            "the task's result of type '{}' could not be encoded: {reason}",
            type_name(&result.get_type())
        ),
        exception: Vec::new(),
    }
}
