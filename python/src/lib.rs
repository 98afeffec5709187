//! `callreg._callreg`: the extension module under the `callreg` Python
//! package, a thin front over [`callreg::io::Worker`] with an inherited
//! [`PythonRuntime`] (targets keep the calling interpreter).
//!
//! It holds no protocol logic: the Worker and its parent machine decide
//! every outcome. What it adds is the Python edge:
//!
//! * every wait releases the GIL; [`RawWorker::call`] waits in slices of
//!   [`SIGNAL_CHECK_INTERVAL`] and runs `PyErr_CheckSignals` between them,
//!   so Ctrl-C raises `KeyboardInterrupt` in the caller (the task itself
//!   finishes in its target, its result is dropped); registers and
//!   unregisters wait the same way ([`wait_operation`]): an interrupted
//!   register goes on, and the registration it makes is unregistered as
//!   soon as it completes ([`Worker::release_when_registered`]), so
//!   nothing stays installed for a handle nobody holds; an interrupted
//!   unregister goes on (its handle was released when it began);
//! * [`RawWorker::submit`] sends each task from the caller's thread and
//!   returns a [`RawPending`]: the future's first waiter waits on it
//!   inline (it may read every caller's replies, as any waiting caller of
//!   the Worker does), so a result reaches it with no other thread woken;
//!   a future nobody waits on inline (done-callbacks,
//!   `concurrent.futures.wait`) is *armed* ([`RawWorker::arm`]): its
//!   result goes to a channel ([`callreg::io::PendingTask::on_complete`],
//!   never touching the GIL there), which the package's dispatcher thread
//!   reads with [`RawWorker::next_completions`];
//! * errors are raised as `RawError` with one dict argument (`code`,
//!   `operation`, `target`, `hashid`, `seq`, `message`, `full`, `kind`,
//!   `exception`, `outcomes`), which the package maps to its exception
//!   classes.
//!
//! Envelope packing and hashids ([`encode_envelope`], [`envelope_hashid`])
//! are the crate's own ([`callreg::envelope`], [`callreg::descriptor`]).
//!
//! One module per bound type: `worker` ([`RawWorker`]), `pending`
//! ([`RawPending`]), `handle` ([`RawHandle`]), `parent` (`RawParent`),
//! `errors` (`RawError` and its dict), `envelope` (the envelope
//! functions) and `template` (the forkserver template's loop).
//!
//! [`PythonRuntime`]: callreg::runtime::python::PythonRuntime
//! [`encode_envelope`]: envelope::encode_envelope()
//! [`envelope_hashid`]: envelope::envelope_hashid()
//! [`wait_operation`]: worker::wait_operation
//! [`Worker::release_when_registered`]: callreg::io::Worker::release_when_registered

mod envelope;
mod errors;
mod handle;
mod parent;
mod pending;
mod template;
mod worker;

use std::time::Duration;

use callreg::io::staging;
use pyo3::prelude::*;

use envelope::{
    encode_envelope, envelope_hashid, envelope_header, out_of_band_offsets, out_of_band_tail,
    staging_memfd,
};
use errors::RawError;
use handle::RawHandle;
use pending::RawPending;
use template::_template_main;
use worker::RawWorker;

/// How long [`RawWorker::call`] waits between two signal checks.
pub const SIGNAL_CHECK_INTERVAL: Duration = Duration::from_millis(50);

#[pymodule]
fn _callreg(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RawWorker>()?;
    m.add_class::<RawHandle>()?;
    m.add_class::<RawPending>()?;
    m.add_class::<parent::RawParent>()?;
    m.add("RawError", m.py().get_type::<RawError>())?;
    m.add_function(wrap_pyfunction!(encode_envelope, m)?)?;
    m.add_function(wrap_pyfunction!(envelope_hashid, m)?)?;
    m.add_function(wrap_pyfunction!(envelope_header, m)?)?;
    m.add_function(wrap_pyfunction!(out_of_band_offsets, m)?)?;
    m.add_function(wrap_pyfunction!(out_of_band_tail, m)?)?;
    m.add(
        "OUT_OF_BAND_VERSION",
        callreg::envelope::VERSION_OUT_OF_BAND,
    )?;
    m.add_function(wrap_pyfunction!(staging_memfd, m)?)?;
    m.add("SPILL_BYTES", staging::SPILL_BYTES)?;
    m.add(
        "DEFAULT_SPIN",
        callreg::io::spin::DEFAULT_SPIN.as_secs_f64(),
    )?;
    m.add("MAX_SPIN", callreg::io::spin::MAX_SPIN.as_secs_f64())?;
    m.add("MIN_MAX_FRAME_BYTES", callreg::wire::MIN_MAX_FRAME_BYTES)?;
    m.add_function(wrap_pyfunction!(_template_main, m)?)?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "DEFAULT_MAX_FRAME_BYTES",
        callreg::wire::DEFAULT_MAX_FRAME_BYTES,
    )?;
    Ok(())
}
