//! Envelope packing and hashids for the package (`callreg._envelope`):
//! the crate's own [`callreg::envelope`] and [`callreg::descriptor`].

use crate::errors::plain_err;
use callreg::descriptor::python_serialized_digest;
use callreg::envelope::Envelope;
use callreg::error::{Error, OperationKind};
use callreg::io::staging;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The SPYC envelope around serializer payload `payload` (the crate's
/// [`callreg::envelope::encode`]).
#[pyfunction]
pub(crate) fn encode_envelope<'py>(py: Python<'py>, payload: &[u8]) -> Bound<'py, PyBytes> {
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
pub(crate) fn envelope_header(
    py: Python<'_>,
    payload_size: u64,
    version: u8,
) -> PyResult<Bound<'_, PyBytes>> {
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
pub(crate) fn out_of_band_offsets(pickle_size: u64, lengths: Vec<u64>) -> (Vec<u64>, u64) {
    callreg::envelope::out_of_band_offsets(pickle_size, &lengths)
}

/// The buffer table and footer that end an out-of-band envelope
/// (`specs/formats.md` §1.1) with a pickle of `pickle_size` bytes and
/// buffers at `placed` (`(offset, length)` pairs).
#[pyfunction]
pub(crate) fn out_of_band_tail(
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
pub(crate) fn staging_memfd() -> PyResult<i32> {
    use std::os::fd::IntoRawFd;
    staging::new_memfd()
        .map(IntoRawFd::into_raw_fd)
        .map_err(|e| PyOSError::new_err(e.to_string()))
}

/// The hashid of a SPYC envelope; raises `RawError` (`ENVELOPE_INVALID` and
/// the other envelope codes) for invalid bytes.
#[pyfunction]
pub(crate) fn envelope_hashid(py: Python<'_>, envelope: &[u8]) -> PyResult<String> {
    let parsed = py.detach(|| {
        Envelope::parse(envelope)
            .map(|parsed| python_serialized_digest(&parsed))
            .map_err(|e| Error::new(e.code(), OperationKind::Decode, e.message()))
    });
    parsed
        .map(|digest| callreg::descriptor::HashId(digest).to_string())
        .map_err(|e| plain_err(py, &e))
}
