//! `RawHandle`: a handle issued by a [`crate::worker::RawWorker`].

use callreg::protocol::Handle;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A handle issued by a [`RawWorker`] (the protocol's [`Handle`]).
#[pyclass(frozen, module = "callreg._callreg")]
pub(crate) struct RawHandle {
    pub(crate) handle: Handle,
}

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
