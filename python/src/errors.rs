//! `RawError` and the dict of fields it carries: what the package maps
//! to its exception classes (`callreg._raw_errors`).

use callreg::error::Error;
use callreg::io::worker::{outcome_text, TaskError};
use callreg::protocol::{TargetId, TargetOutcome};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

pyo3::create_exception!(
    _callreg,
    RawError,
    PyException,
    "A failed operation: args[0] is a dict with the error's fields."
);

pub(crate) fn error_dict<'py>(
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

pub(crate) fn raw_error(dict: Bound<'_, PyDict>) -> PyErr {
    RawError::new_err(dict.unbind())
}

pub(crate) fn plain_err(py: Python<'_>, e: &Error) -> PyErr {
    match error_dict(py, e, e.to_string(), "", &[], &[]) {
        Ok(dict) => raw_error(dict),
        Err(err) => err,
    }
}

pub(crate) fn task_err_dict<'py>(py: Python<'py>, e: &TaskError) -> PyResult<Bound<'py, PyDict>> {
    error_dict(
        py,
        &e.error,
        e.error.to_string(),
        &e.kind,
        &e.exception,
        &[],
    )
}
