//! Starting CPython in a target (embedded mode: configured as the build's
//! interpreter, after checking which libpython was loaded; inherited mode:
//! the interpreter forked from the parent), the functions and versions the
//! runtime reads once there, and each thread's retained Python thread state.

use std::cell::Cell;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::checks;
use super::exceptions::describe_exception;
use super::{PythonRuntime, RuntimeError};
use crate::error::ErrorCode;

/// The interpreter this build was configured for: `PYO3_PYTHON` at build
/// time (an absolute path, e.g. a virtual environment's `bin/python`), or
/// the `python3` found on `PATH` then; empty if the build did not know it.
/// [`PythonRuntime::start`](crate::runtime::Runtime::start) configures the
/// target's interpreter as this one.
pub const BUILD_PYTHON: &str = env!("CALLREG_BUILD_PYTHON");

/// The directory of the shared libpython this build linked (the build
/// interpreter's `LIBDIR`), or empty for a static libpython.
///
/// `callreg`'s own binaries, tests and examples carry it as their RUNPATH; a
/// dependent's build script gets it as `DEP_CALLREG_PYTHON_LIBDIR` and must
/// add it itself (see the crate docs).
/// [`PythonRuntime::start`](crate::runtime::Runtime::start) refuses to run
/// on a libpython loaded from another directory (while this one exists on
/// the machine).
pub const BUILD_LIBPYTHON_DIR: &str = env!("CALLREG_BUILD_LIBPYTHON_DIR");

/// The file the dynamic loader loaded libpython from in this process
/// (found with `dlsym` and `dladdr` on `Py_IsInitialized`); `None` when the
/// loader cannot tell (e.g. a static libpython, or a program that never
/// references libpython and so did not load it). `tests/dependent_crate.rs`
/// checks what it reports in a target.
pub fn loaded_libpython() -> Option<std::path::PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: `dlsym` with RTLD_DEFAULT only looks a NUL-terminated name up
    // in the loaded objects; `dladdr` only fills `info` (zero-initialised,
    // plain data) for that address; `dli_fname` is then either null or a
    // NUL-terminated string owned by the loader for as long as the object
    // stays loaded (libpython is never unloaded).
    unsafe {
        let address = libc::dlsym(libc::RTLD_DEFAULT, c"Py_IsInitialized".as_ptr());
        if address.is_null() {
            return None;
        }
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(address, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let name = std::ffi::CStr::from_ptr(info.dli_fname);
        Some(std::path::PathBuf::from(std::ffi::OsStr::from_bytes(
            name.to_bytes(),
        )))
    }
}

/// Ignores SIGINT in this target before its Python runtime starts: the
/// target stays out of the terminal's Ctrl-C, and Python never turns one
/// into a `KeyboardInterrupt` inside a task (both modes).
///
/// # Errors
/// `TARGET_LOST` with kind `SignalSetupFailed` when `signal` fails.
pub(super) fn ignore_sigint() -> Result<(), RuntimeError> {
    // SAFETY: installing SIG_IGN sets no handler function, so no
    // async-signal-safety requirement applies.
    unsafe {
        nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGINT,
            nix::sys::signal::SigHandler::SigIgn,
        )
    }
    .map(|_| ())
    .map_err(|errno| RuntimeError {
        code: ErrorCode::TARGET_LOST,
        kind: "SignalSetupFailed".to_owned(),
        message: format!("could not ignore SIGINT before starting Python: {errno}"),
        exception: Vec::new(),
    })
}

/// Refuses a libpython loaded from elsewhere than [`BUILD_LIBPYTHON_DIR`]:
/// another copy of the same minor version has other site-packages (the
/// symptom would be `ModuleNotFoundError: cloudpickle` on the first
/// payload). Accepts when the build directory does not exist on this
/// machine (a program moved elsewhere) or when nothing can be compared.
pub(super) fn check_libpython() -> Result<(), RuntimeError> {
    if BUILD_LIBPYTHON_DIR.is_empty() {
        return Ok(());
    }
    let Ok(expected) = std::fs::canonicalize(BUILD_LIBPYTHON_DIR) else {
        return Ok(());
    };
    let Some(loaded) = loaded_libpython() else {
        return Ok(());
    };
    let loaded_dir = std::fs::canonicalize(&loaded)
        .ok()
        .and_then(|path| path.parent().map(std::path::Path::to_path_buf));
    if loaded_dir.as_deref() == Some(expected.as_path()) {
        return Ok(());
    }
    Err(RuntimeError {
        code: ErrorCode::TARGET_LOST,
        kind: "LibpythonMismatch".to_owned(),
        message: format!(
            "this program was built for the Python at {BUILD_PYTHON} (libpython in \
             {BUILD_LIBPYTHON_DIR}) but loaded {}; give the program that directory as its \
             rpath (a dependent's build script: DEP_CALLREG_PYTHON_LIBDIR, see the callreg \
             crate docs) or put it first in LD_LIBRARY_PATH",
            loaded.display()
        ),
        exception: Vec::new(),
    })
}

/// Starts CPython configured as [`BUILD_PYTHON`] (program name; no signal
/// handlers, as `Py_InitializeEx(0)`), then releases the GIL for
/// `Python::attach`.
#[cfg(not(Py_LIMITED_API))]
pub(super) fn initialize_interpreter() -> Result<(), RuntimeError> {
    let failed = |message: String| RuntimeError {
        code: ErrorCode::TARGET_LOST,
        kind: "InterpreterInitFailed".to_owned(),
        message: format!("starting the Python interpreter failed: {message}"),
        exception: Vec::new(),
    };
    let program = std::ffi::CString::new(BUILD_PYTHON)
        .ok()
        .filter(|_| std::path::Path::new(BUILD_PYTHON).is_absolute())
        .filter(|_| std::path::Path::new(BUILD_PYTHON).exists());
    // SAFETY: the config is initialised by `PyConfig_InitPythonConfig`
    // before any field is read or written, set only through the C API (or
    // plain int fields), passed to `Py_InitializeFromConfig` once and
    // cleared once. Python is not initialised yet (checked by the caller),
    // and this runs on the target's main thread before any other thread
    // touches Python. `err_msg` of a failed status is a static C string.
    unsafe {
        let mut config: ffi::PyConfig = std::mem::zeroed();
        ffi::PyConfig_InitPythonConfig(&mut config);
        config.install_signal_handlers = 0;
        if let Some(program) = &program {
            let status = ffi::PyConfig_SetBytesString(
                &mut config,
                &mut config.program_name,
                program.as_ptr(),
            );
            if ffi::PyStatus_Exception(status) != 0 {
                ffi::PyConfig_Clear(&mut config);
                return Err(failed(status_message(status)));
            }
        }
        let status = ffi::Py_InitializeFromConfig(&config);
        ffi::PyConfig_Clear(&mut config);
        if ffi::PyStatus_Exception(status) != 0 {
            return Err(failed(status_message(status)));
        }
        ffi::PyEval_SaveThread();
    }
    Ok(())
}

/// In a build for the stable ABI (the Python package's extension module,
/// whose targets use the inherited interpreter instead), the configuration
/// API is not available: starts CPython with `Py_InitializeEx(0)` (no
/// signal handlers) and its default configuration, then releases the GIL.
#[cfg(Py_LIMITED_API)]
pub(super) fn initialize_interpreter() -> Result<(), RuntimeError> {
    // SAFETY: Python is not initialised yet (checked by the caller), and
    // this runs on the target's main thread before any other thread
    // touches Python; saving the thread state releases the GIL it took.
    unsafe {
        ffi::Py_InitializeEx(0);
        ffi::PyEval_SaveThread();
    }
    Ok(())
}

/// The message of a failed `PyStatus`.
///
/// # Safety
/// `status.err_msg` is null or a NUL-terminated string (CPython's are static).
#[cfg(not(Py_LIMITED_API))]
unsafe fn status_message(status: ffi::PyStatus) -> String {
    if status.err_msg.is_null() {
        format!("status {}", status.exitcode)
    } else {
        // SAFETY: non-null, NUL-terminated per this function's contract.
        unsafe { std::ffi::CStr::from_ptr(status.err_msg) }
            .to_string_lossy()
            .into_owned()
    }
}

/// The standard-library functions the runtime calls, imported once per
/// target.
#[derive(Debug)]
pub(super) struct PythonFunctions {
    /// `pickle.loads`.
    pub(super) pickle_loads: Py<PyAny>,
    /// The helper `dump_result` (cloudpickle, with `__main__`'s functions
    /// and classes by name) when cloudpickle is installed, else
    /// `pickle.dumps`: pickled task results (a lambda can be a result).
    pub(super) result_dumps: Py<PyAny>,
    /// `pickle.HIGHEST_PROTOCOL`, the protocol of pickled task results.
    pub(super) pickle_protocol: Py<PyAny>,
    /// `json.loads`: decodes a task input the fast path refused, for its
    /// exact error.
    pub(super) json_loads: Py<PyAny>,
    /// `json.JSONDecoder().raw_decode`: the decoder `json.loads` uses,
    /// without its whitespace regular expressions and layers of calls.
    pub(super) json_raw_decode: Py<PyAny>,
    /// `json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode`:
    /// what `json.dumps` with those options builds on every call.
    pub(super) json_encode: Py<PyAny>,
    /// `traceback.format_tb`.
    pub(super) format_tb: Py<PyAny>,
    /// The `_callreg_metadata` helper module (metadata checks, output capture).
    pub(super) helpers: Py<PyModule>,
    /// This interpreter's and cloudpickle's versions, read once at start.
    pub(super) versions: TargetVersions,
}

/// The versions a target's version check compares a payload's metadata
/// with (`specs/metadata.md`, "Checks before deserializing"), read once per
/// target process when its runtime starts, never per install: an install
/// then costs no import and no file read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct TargetVersions {
    /// `"MAJOR.MINOR.MICRO"` of `sys.version_info`.
    pub(super) python: String,
    /// `cloudpickle.__version__` of the module imported at start; `None`
    /// when cloudpickle cannot be imported (or has no string version).
    pub(super) cloudpickle: Option<String>,
}

impl TargetVersions {
    /// Reads both versions: attribute reads only (`sys.version_info`, the
    /// already imported `cloudpickle` module), no `importlib.metadata`.
    fn read(py: Python<'_>, cloudpickle: Option<&Bound<'_, PyModule>>) -> PyResult<Self> {
        let (major, minor, micro): (u32, u32, u32) = py
            .import("sys")?
            .getattr("version_info")?
            .get_item(pyo3::types::PySlice::new(py, 0, 3, 1))?
            .extract()?;
        let cloudpickle = match cloudpickle {
            None => None,
            Some(module) => module
                .getattr("__version__")
                .ok()
                .and_then(|version| version.extract::<String>().ok()),
        };
        Ok(TargetVersions {
            python: format!("{major}.{minor}.{micro}"),
            cloudpickle,
        })
    }
}

impl PythonRuntime {
    /// [`Runtime::start`](crate::runtime::Runtime::start) in inherited
    /// mode: the interpreter must already run (inherited through `fork`,
    /// after [`Runtime::after_fork_child`](crate::runtime::Runtime::after_fork_child)).
    /// Ignores SIGINT, releases the GIL this thread holds since the fork
    /// (so the target's threads can attach), then imports what the runtime
    /// calls.
    pub(super) fn start_inherited(&self) -> Result<(), RuntimeError> {
        // SAFETY: `Py_IsInitialized` only reads a flag.
        if unsafe { ffi::Py_IsInitialized() } == 0 || self.functions.get().is_some() {
            return Err(RuntimeError {
                code: ErrorCode::LIFECYCLE_INVALID,
                kind: "InterpreterNotInherited".to_owned(),
                message: "an inherited Python runtime starts once, in a target forked from \
                          a Python process"
                    .to_owned(),
                exception: Vec::new(),
            });
        }
        ignore_sigint()?;
        // SAFETY: this thread holds the GIL since `before_fork` (kept by
        // `after_fork_child`); saving its thread state releases the GIL, and
        // later attaches on this thread restore it (`PyGILState_Ensure`
        // finds the thread's state).
        unsafe {
            ffi::PyEval_SaveThread();
        }
        self.import_functions()
    }

    /// Imports the standard-library functions the runtime calls and
    /// compiles the helper module; the runtime is started once they are set.
    pub(super) fn import_functions(&self) -> Result<(), RuntimeError> {
        let functions = Python::attach(|py| {
            let import = || -> PyResult<PythonFunctions> {
                let pickle = py.import("pickle")?;
                let json = py.import("json")?;
                let traceback = py.import("traceback")?;
                // Optional: a plain-pickle payload does not need it, and a
                // cloudpickle payload without it fails with a clear
                // `ModuleNotFoundError` when deserialized.
                let cloudpickle = py.import("cloudpickle").ok();
                let helpers = PyModule::from_code(
                    py,
                    checks::HELPERS_SOURCE,
                    c"_callreg_metadata.py",
                    c"_callreg_metadata",
                )?;
                Ok(PythonFunctions {
                    pickle_loads: pickle.getattr("loads")?.unbind(),
                    result_dumps: match &cloudpickle {
                        Some(_) => helpers.getattr("dump_result")?.unbind(),
                        None => pickle.getattr("dumps")?.unbind(),
                    },
                    pickle_protocol: pickle.getattr("HIGHEST_PROTOCOL")?.unbind(),
                    json_loads: json.getattr("loads")?.unbind(),
                    json_raw_decode: json
                        .getattr("JSONDecoder")?
                        .call0()?
                        .getattr("raw_decode")?
                        .unbind(),
                    json_encode: {
                        let options = PyDict::new(py);
                        options.set_item("allow_nan", false)?;
                        options.set_item("separators", (",", ":"))?;
                        json.getattr("JSONEncoder")?
                            .call((), Some(&options))?
                            .getattr("encode")?
                            .unbind()
                    },
                    format_tb: traceback.getattr("format_tb")?.unbind(),
                    helpers: helpers.unbind(),
                    versions: TargetVersions::read(py, cloudpickle.as_ref())?,
                })
            };
            import().map_err(|err| {
                let (kind, message) = describe_exception(py, &err);
                RuntimeError {
                    code: ErrorCode::TARGET_LOST,
                    kind,
                    message: format!("starting the Python runtime failed: {message}"),
                    exception: Vec::new(),
                }
            })
        })?;
        // `start` runs once per target; a concurrent second call lost the
        // race above only if the caller broke that contract.
        let _ = self.functions.set(functions);
        Ok(())
    }
}

/// Whether this thread created the Python thread state it keeps; released
/// when the thread exits.
struct RetainedThreadState {
    retained: Cell<bool>,
}

thread_local! {
    static THREAD_STATE: RetainedThreadState = const {
        RetainedThreadState { retained: Cell::new(false) }
    };
}

/// Gives the calling thread a Python thread state that outlives each
/// attach: without one, every attach from a thread other than the one that
/// initialised Python creates and destroys a thread state. Must be called
/// while this thread is not attached, after the interpreter started; a
/// thread that already has a thread state (the main thread, or one attached
/// further up its stack) is left alone.
pub(super) fn retain_thread_state() {
    let _ = THREAD_STATE.try_with(|state| {
        if state.retained.get() {
            return;
        }
        // SAFETY: the interpreter is initialised (the caller checked) and
        // this thread holds no thread state, so `PyGILState_Ensure` creates
        // one and takes the GIL, which `PyEval_SaveThread` gives back; the
        // thread state stays registered for this thread (count 1).
        unsafe {
            if ffi::PyGILState_GetThisThreadState().is_null() {
                let _ = ffi::PyGILState_Ensure();
                ffi::PyEval_SaveThread();
                state.retained.set(true);
            }
        }
    });
}

impl Drop for RetainedThreadState {
    fn drop(&mut self) {
        if !self.retained.get() {
            return;
        }
        // SAFETY: runs at thread exit, when this thread is not attached; its
        // thread state is the one `retain_thread_state` registered. Taking
        // the GIL with it and releasing the last `PyGILState` count deletes
        // the thread state and releases the GIL.
        unsafe {
            let thread_state = ffi::PyGILState_GetThisThreadState();
            if !thread_state.is_null() {
                ffi::PyEval_RestoreThread(thread_state);
                ffi::PyGILState_Release(ffi::PyGILState_STATE::PyGILState_UNLOCKED);
            }
        }
    }
}
