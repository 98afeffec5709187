//! The template process of a forkserver Worker (`callreg._forkserver`).

use std::sync::Arc;

use callreg::io::zygote::ExecTemplate;
use callreg::runtime::python::PythonRuntime;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

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
pub(crate) fn _template_main(py: Python<'_>, prepare: Bound<'_, PyAny>) -> PyResult<i32> {
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
