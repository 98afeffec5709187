//! The Python runtime: deserializes cloudpickle payloads with `pickle.loads`
//! inside a target and runs tasks on the resulting callables (specs/design.md §5).
//!
//! Rules this module keeps:
//!
//! * Two modes. Embedded ([`PythonRuntime::new`], what `callreg run` and a
//!   Rust embedder use): the interpreter starts only in a target, after
//!   `fork` ([`PythonRuntime::start`] refuses to run where Python is
//!   already initialised), and the parent never calls into Python.
//!   Inherited ([`PythonRuntime::inherited`], what the Python package
//!   uses): the parent is a Python process; targets are forked with the
//!   interpreter's own fork steps (`PyOS_BeforeFork`,
//!   `PyOS_AfterFork_Parent`, `PyOS_AfterFork_Child`, as `os.fork` does,
//!   so `os.register_at_fork` hooks run) and keep the inherited
//!   interpreter; it is never initialised a second time. Even then the
//!   Rust parent never deserializes a payload: only the targets do.
//! * A payload is unpickled from a read-only `memoryview` over the borrowed
//!   bytes (no copy), and the view is released before
//!   [`PythonRuntime::deserialize`] returns, so nothing refers to the mapping
//!   after it is unmapped.
//! * Every Python exception, `BaseException` included (`SystemExit`,
//!   `KeyboardInterrupt`), becomes a [`RuntimeError`] formatted here; the
//!   interpreter's own error printing is never used, because on `SystemExit`
//!   it exits the process.
//! * The GIL is held only inside each call into Python and is released when
//!   the call returns, so the control thread and the task thread of a target
//!   take turns: a task running Python bytecode yields the GIL every switch
//!   interval (5 ms by default).
//! * Each thread that calls the runtime keeps its Python thread state until
//!   it exits, instead of creating and destroying one per call.
//! * [`Runtime::install`] with metadata checks versions and dependencies and
//!   rehydrates the executor before anything is unpickled (//!   `specs/metadata.md`); executors come from a registry by short name
//!   ([`PythonExecutor`], [`PythonRuntime::with_executor`]).

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::c_char;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple, PyType};
use pyo3::{ffi, PyErr};

use serde_json::{Map, Value};

use super::{Runtime, RuntimeError, TaskEncoding};
use crate::error::ErrorCode;
use crate::metadata::{CallableMetadata, ExecutorSpec, RehydrateError, DEFAULT_EXECUTOR};
use crate::protocol::TargetId;

mod checks;
mod input;

use input::{pickle_input, PickleInput};

pub use checks::{BASH_SHELL, BASH_STDERR_TAIL_BYTES, BASH_STDERR_TAIL_LINES};

/// `PyBUF_READ` (CPython's `Include/memoryobject.h`, stable since 3.3;
/// PyO3 does not export it under the limited API, which the extension
/// module's abi3 build uses).
const PYBUF_READ: std::ffi::c_int = 0x100;

/// How many of the innermost traceback frames a task failure's message keeps.
pub const TRACEBACK_FRAMES_KEPT: usize = 6;

/// Runtime kind of the error returned when the runtime is used before
/// [`PythonRuntime::start`] succeeded.
const KIND_NOT_STARTED: &str = "RuntimeNotStarted";

/// Runtime kind of a malformed task input (JSON or pickled).
const KIND_INPUT_INVALID: &str = "TaskInputInvalid";

/// Pickled task inputs up to this size are unpickled from a copy in one
/// `bytes` object, larger ones through a memoryview over the frame.
const SMALL_PICKLE_INPUT_BYTES: usize = 4096;

/// A Python target runtime (cargo feature `python`).
///
/// Built in the parent (no Python is touched there), inherited by `fork`,
/// and [`start`](Runtime::start)ed once in each target. After `start`, the
/// other methods may be called from any thread of the target.
///
/// Interpreter selection: the build links the libpython of `PYO3_PYTHON`
/// (an absolute path to the interpreter, e.g. a virtual environment's
/// `bin/python`; `python3` on `PATH` when unset), and `build.rs` records its
/// library directory as the RUNPATH of callreg's own binaries (a dependent
/// adds it from `DEP_CALLREG_PYTHON_LIBDIR`, see the crate docs). A target
/// starts CPython configured as that interpreter ([`BUILD_PYTHON`]), so its
/// site-packages are the ones cloudpickle was installed into. Payloads must
/// come from the same Python minor version: cloudpickled code objects are
/// version-specific. CPython 3.10–3.13 and cloudpickle 2.2 or newer are
/// tested; tracebacks of code that cloudpickle 3.1+ pickled by value name
/// the file `<dynamic-code>` (older versions: the defining file's name).
pub struct PythonRuntime {
    /// Functions looked up once by [`PythonRuntime::start`]; empty in the
    /// parent and in a target that has not started.
    functions: OnceLock<PythonFunctions>,
    /// The executor registry, by short name; built in the parent, before
    /// the fork, so every target has the same one.
    executors: BTreeMap<String, Arc<dyn PythonExecutor>>,
    /// Inherited mode ([`PythonRuntime::inherited`]): the parent is a
    /// Python process and targets keep its interpreter.
    inherited: bool,
    /// Between [`Runtime::before_fork`] and [`Runtime::after_fork_parent`]:
    /// whether `PyGILState_Ensure` found the GIL released (its state to
    /// give back to `PyGILState_Release`).
    fork_gil_unlocked: AtomicBool,
    /// What runs at each target's start, when set
    /// ([`PythonRuntime::with_target_initializer`],
    /// [`PythonRuntime::with_target_initializer_source`]).
    target_initializer: Option<TargetInitializer>,
    /// What the initializer returned in this target, when not `None`: the
    /// context every task's callable is called with first.
    context: OnceLock<Py<PyAny>>,
}

impl fmt::Debug for PythonRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PythonRuntime")
            .field("started", &self.functions.get().is_some())
            .field("inherited", &self.inherited)
            .field("executors", &self.executors.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Default for PythonRuntime {
    fn default() -> Self {
        Self::new()
    }
}

/// The interpreter this build was configured for: `PYO3_PYTHON` at build
/// time (an absolute path, e.g. a virtual environment's `bin/python`), or
/// the `python3` found on `PATH` then; empty if the build did not know it.
/// [`PythonRuntime::start`] configures the target's interpreter as this one.
pub const BUILD_PYTHON: &str = env!("CALLREG_BUILD_PYTHON");

/// The directory of the shared libpython this build linked (the build
/// interpreter's `LIBDIR`), or empty for a static libpython.
///
/// `callreg`'s own binaries, tests and examples carry it as their RUNPATH; a
/// dependent's build script gets it as `DEP_CALLREG_PYTHON_LIBDIR` and must
/// add it itself (see the crate docs). [`PythonRuntime::start`] refuses to
/// run on a libpython loaded from another directory (while this one exists
/// on the machine).
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
fn ignore_sigint() -> Result<(), RuntimeError> {
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
fn check_libpython() -> Result<(), RuntimeError> {
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
fn initialize_interpreter() -> Result<(), RuntimeError> {
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
fn initialize_interpreter() -> Result<(), RuntimeError> {
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

/// A target initializer: a Python object of the parent's interpreter
/// (inherited mode), or the source of a module defining `initialize`
/// (either mode: compiled in each target).
enum TargetInitializer {
    Object(Py<PyAny>),
    Source(std::ffi::CString),
}

/// Name under which a [`PythonRuntime::with_target_initializer_source`]
/// module is compiled in each target.
const INITIALIZER_MODULE: &std::ffi::CStr = c"_callreg_target_initializer";

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

/// The standard-library functions the runtime calls, imported once per
/// target.
#[derive(Debug)]
struct PythonFunctions {
    /// `pickle.loads`.
    pickle_loads: Py<PyAny>,
    /// The helper `dump_result` (cloudpickle, with `__main__`'s functions
    /// and classes by name) when cloudpickle is installed, else
    /// `pickle.dumps`: pickled task results (a lambda can be a result).
    result_dumps: Py<PyAny>,
    /// `pickle.HIGHEST_PROTOCOL`, the protocol of pickled task results.
    pickle_protocol: Py<PyAny>,
    /// `json.loads`: decodes a task input the fast path refused, for its
    /// exact error.
    json_loads: Py<PyAny>,
    /// `json.JSONDecoder().raw_decode`: the decoder `json.loads` uses,
    /// without its whitespace regular expressions and layers of calls.
    json_raw_decode: Py<PyAny>,
    /// `json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode`:
    /// what `json.dumps` with those options builds on every call.
    json_encode: Py<PyAny>,
    /// `traceback.format_tb`.
    format_tb: Py<PyAny>,
    /// The `_callreg_metadata` helper module (metadata checks, output capture).
    helpers: Py<PyModule>,
    /// This interpreter's and cloudpickle's versions, read once at start.
    versions: TargetVersions,
}

/// The versions a target's version check compares a payload's metadata
/// with (`specs/metadata.md`, "Checks before deserializing"), read once per
/// target process when its runtime starts, never per install: an install
/// then costs no import and no file read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TargetVersions {
    /// `"MAJOR.MINOR.MICRO"` of `sys.version_info`.
    python: String,
    /// `cloudpickle.__version__` of the module imported at start; `None`
    /// when cloudpickle cannot be imported (or has no string version).
    cloudpickle: Option<String>,
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

/// A deserialized Python callable, held in a target slot.
///
/// Dropping it is safe from any thread, attached to the interpreter or not:
/// without the GIL, the reference is queued and released by the next thread
/// that attaches (PyO3's reference pool), so a drop never waits for a
/// running task. A target releases a freed callable through
/// [`Runtime::finalize`] instead, so its finalizer runs with the operation
/// that freed it.
#[derive(Debug)]
pub struct PythonCallable {
    object: Py<PyAny>,
    /// The rehydrated executor, when installed with metadata; `None` calls
    /// the object directly (as [`InterpreterExecutor`] with its defaults).
    executor: Option<InstalledExecutor>,
}

/// An executor and the attributes rehydrated for one callable.
struct InstalledExecutor {
    executor: Arc<dyn PythonExecutor>,
    attributes: Map<String, Value>,
}

impl fmt::Debug for InstalledExecutor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InstalledExecutor")
            .field("short_name", &self.executor.spec().short_name)
            .field("attributes", &self.attributes)
            .finish()
    }
}

impl PythonCallable {
    /// The short name of the executor that runs its tasks (`"python"` for
    /// a callable installed without metadata).
    pub fn executor_short_name(&self) -> String {
        self.executor.as_ref().map_or_else(
            || INTERPRETER_EXECUTOR.to_owned(),
            |e| e.executor.spec().short_name,
        )
    }

    /// The executor's rehydrated attributes (the defaults of
    /// [`InterpreterExecutor`] without metadata).
    pub fn executor_attributes(&self) -> Map<String, Value> {
        self.executor.as_ref().map_or_else(
            || InterpreterExecutor.spec().defaults,
            |e| e.attributes.clone(),
        )
    }
}

impl PythonRuntime {
    /// A runtime that has not started: cheap, touches no Python. Its
    /// executor registry holds the built-in [`InterpreterExecutor`].
    pub fn new() -> Self {
        let mut executors: BTreeMap<String, Arc<dyn PythonExecutor>> = BTreeMap::new();
        executors.insert(
            INTERPRETER_EXECUTOR.to_owned(),
            Arc::new(InterpreterExecutor),
        );
        PythonRuntime {
            functions: OnceLock::new(),
            executors,
            inherited: false,
            fork_gil_unlocked: AtomicBool::new(false),
            target_initializer: None,
            context: OnceLock::new(),
        }
    }

    /// A runtime for a parent that is itself a Python process with an
    /// initialised interpreter (a Python extension module): targets are
    /// forked with the interpreter's fork steps ([`Runtime::before_fork`]
    /// and the after-fork hooks, as `os.fork` does) and keep the
    /// interpreter they inherit; [`Runtime::start`] never initialises
    /// Python. Use it with [`crate::io::WorkerBuilder::accept_thread_risk`]
    /// (a Python process usually runs other threads; `os.fork` forks
    /// anyway, and so does this), and call `Worker::start` from a thread
    /// attached to the interpreter or not, but not inside a PyO3 `attach`
    /// that is still holding the GIL for this thread (detach first): the
    /// hooks take the GIL themselves.
    pub fn inherited() -> Self {
        PythonRuntime {
            inherited: true,
            ..Self::new()
        }
    }

    /// Sets the target initializer (inherited mode only; it is a Python
    /// object of the parent's interpreter, inherited by `fork`): in each
    /// target, once the runtime started and before the startup snapshot is
    /// installed, [`Runtime::start_target`] calls `initializer(target_id)`
    /// on the target's main thread, before the target runs any thread of
    /// its own, so it may fork (build and start a Worker of its own: the
    /// Python package's next-level targets, `specs/python.md`). When it
    /// returns an object other than `None`, that object is the target's
    /// *context*: every callable, hooks included, is called as
    /// `callable(context, *args, **kwargs)`, and at the target's
    /// [`Runtime::stop`] the context's `close()` runs, if it has one.
    ///
    /// An initializer that raises makes the target exit at start (it is
    /// reported lost, `TARGET_LOST`); its traceback is not printed here.
    pub fn with_target_initializer(mut self, initializer: Py<PyAny>) -> Self {
        self.target_initializer = Some(TargetInitializer::Object(initializer));
        self
    }

    /// Sets the target initializer from Python source (either mode; what a
    /// Rust embedder of [`PythonRuntime::new`] uses, whose parent has no
    /// interpreter): `source` is a module defining `initialize(target_id)`,
    /// compiled in each target as `_callreg_target_initializer` and then
    /// called as [`PythonRuntime::with_target_initializer`]'s initializer.
    /// E.g. a module whose `initialize` builds and starts a Worker of the
    /// `callreg` Python package and returns an object holding it makes
    /// each target a next-level target (the package must be importable in
    /// the targets; `specs/python.md` §5).
    ///
    /// Compiling fails the target's start like an initializer that raises.
    ///
    /// # Errors
    /// [`std::ffi::NulError`] when `source` holds a NUL byte.
    pub fn with_target_initializer_source(
        mut self,
        source: &str,
    ) -> Result<Self, std::ffi::NulError> {
        self.target_initializer = Some(TargetInitializer::Source(std::ffi::CString::new(source)?));
        Ok(self)
    }

    /// Whether this runtime is in inherited mode ([`PythonRuntime::inherited`]).
    pub fn is_inherited(&self) -> bool {
        self.inherited
    }

    /// Adds (or replaces, by short name) an executor in the registry. Call
    /// it in the parent, before targets are forked.
    pub fn with_executor(mut self, executor: Arc<dyn PythonExecutor>) -> Self {
        self.executors.insert(executor.spec().short_name, executor);
        self
    }

    /// The short names of the registered executors, sorted.
    pub fn executor_names(&self) -> Vec<String> {
        self.executors.keys().cloned().collect()
    }

    /// Looks up and rehydrates the executor `metadata` names (pure: no Python).
    ///
    /// # Errors
    /// `EXECUTOR_UNKNOWN` with kind `ExecutorUnknown` for a short name not
    /// in the registry; then as [`rehydrate_error`].
    fn rehydrate(&self, metadata: &CallableMetadata) -> Result<InstalledExecutor, RuntimeError> {
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

    /// Whether the Python interpreter is initialised in the calling
    /// process. A parent of embedded-mode targets (the process that owns a
    /// [`crate::io::Worker`] over [`PythonRuntime::new`], e.g. `callreg
    /// run`) must always see `false`: it never runs Python. In inherited
    /// mode the parent is a Python process (`specs/python.md` §1).
    pub fn interpreter_initialized() -> bool {
        // SAFETY: `Py_IsInitialized` only reads a flag and may be called
        // before the interpreter exists.
        unsafe { ffi::Py_IsInitialized() != 0 }
    }

    /// The imported functions, once started; also retains the calling
    /// thread's Python thread state, so call it before attaching.
    fn functions(&self) -> Result<&PythonFunctions, RuntimeError> {
        let functions = self.functions.get();
        if functions.is_some() {
            retain_thread_state();
        }
        functions.ok_or_else(|| RuntimeError {
            code: ErrorCode::LIFECYCLE_INVALID,
            kind: KIND_NOT_STARTED.to_owned(),
            message: "the Python runtime was used before it started in this target".to_owned(),
            exception: Vec::new(),
        })
    }
}

impl PythonRuntime {
    /// [`Runtime::start`] in inherited mode: the interpreter must already
    /// run (inherited through `fork`, after [`Runtime::after_fork_child`]).
    /// Ignores SIGINT, releases the GIL this thread holds since the fork
    /// (so the target's threads can attach), then imports what the runtime
    /// calls.
    fn start_inherited(&self) -> Result<(), RuntimeError> {
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
    fn import_functions(&self) -> Result<(), RuntimeError> {
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

impl Runtime for PythonRuntime {
    type Callable = PythonCallable;

    /// Initialises the interpreter in this freshly forked target and imports
    /// `pickle`, `json` and `traceback` (and, if installed, `cloudpickle`,
    /// so the first payload does not pay for that import).
    ///
    /// SIGINT is ignored first: the target then stays out of the terminal's
    /// Ctrl-C (it is stopped by pipe EOF, SIGTERM or SIGKILL), and Python,
    /// which only installs its SIGINT handler over the default disposition,
    /// never turns a Ctrl-C into a `KeyboardInterrupt` inside a task. Call it
    /// from the target's main thread.
    ///
    /// # Errors
    /// `LIFECYCLE_INVALID` with kind `InterpreterAlreadyInitialized` when
    /// Python already runs in this process (the parent must never run Python,
    /// and a target starts once); `TARGET_LOST` with the Python exception's type
    /// when a standard module cannot be imported; `TARGET_LOST` with kind
    /// `SignalSetupFailed` when SIGINT cannot be ignored; `TARGET_LOST` with
    /// kind `LibpythonMismatch` when the process loaded another libpython than
    /// the one the build linked ([`loaded_libpython`], [`BUILD_LIBPYTHON_DIR`]:
    /// the program lacks an rpath, see the crate docs); `TARGET_LOST` with
    /// kind `InterpreterInitFailed` when CPython refuses its configuration.
    ///
    /// The interpreter is configured as [`BUILD_PYTHON`] would be (its
    /// `sys.executable`, its site-packages, a virtual environment's
    /// included), whatever `python3` is first on `PATH`.
    fn start(&self) -> Result<(), RuntimeError> {
        if self.inherited {
            return self.start_inherited();
        }
        // SAFETY: `Py_IsInitialized` only reads a flag and may be called
        // before the interpreter exists.
        if unsafe { ffi::Py_IsInitialized() } != 0 || self.functions.get().is_some() {
            return Err(RuntimeError {
                code: ErrorCode::LIFECYCLE_INVALID,
                kind: "InterpreterAlreadyInitialized".to_owned(),
                message: "the Python interpreter is already initialised in this process; \
                          it must start only once, in a forked target"
                    .to_owned(),
                exception: Vec::new(),
            });
        }
        ignore_sigint()?;
        check_libpython()?;
        initialize_interpreter()?;
        self.import_functions()
    }

    /// [`Runtime::start`], then the target initializer, if one is set
    /// ([`PythonRuntime::with_target_initializer`]), with `target`'s id.
    ///
    /// # Errors
    /// As [`Runtime::start`]; `TARGET_LOST` with the exception's type when
    /// the initializer raises.
    fn start_target(&self, target: TargetId) -> Result<(), RuntimeError> {
        self.start()?;
        let Some(initializer) = &self.target_initializer else {
            return Ok(());
        };
        Python::attach(|py| {
            let function = match initializer {
                TargetInitializer::Object(object) => Ok(object.bind(py).clone()),
                TargetInitializer::Source(source) => PyModule::from_code(
                    py,
                    source,
                    c"_callreg_target_initializer.py",
                    INITIALIZER_MODULE,
                )
                .and_then(|module| module.getattr("initialize")),
            };
            let context = function.and_then(|f| f.call1((target.0,))).map_err(|err| {
                let (kind, message) = describe_exception(py, &err);
                RuntimeError {
                    code: ErrorCode::TARGET_LOST,
                    kind,
                    message: format!("the target initializer failed: {message}"),
                    exception: Vec::new(),
                }
            })?;
            if !context.is_none() {
                let _ = self.context.set(context.unbind());
            }
            Ok(())
        })
    }

    /// Calls the target context's `close()` (when there is a context and it
    /// has one); an exception it raises is ignored (the target exits next).
    fn stop(&self) {
        let Some(context) = self.context.get() else {
            return;
        };
        if self.functions.get().is_none() {
            return;
        }
        retain_thread_state();
        Python::attach(|py| {
            let context = context.bind(py);
            if let Ok(close) = context.getattr("close") {
                let _ = close.call0();
            }
        });
    }

    /// In inherited mode: takes the GIL for this thread and runs the
    /// interpreter's before-fork steps (`PyOS_BeforeFork`: the
    /// `os.register_at_fork(before=...)` hooks, then the import lock).
    /// No-op in embedded mode.
    fn before_fork(&self) {
        if !self.inherited {
            return;
        }
        // SAFETY: in inherited mode the interpreter is initialised (the
        // parent is a Python process). `PyGILState_Ensure` attaches this
        // thread (creating its thread state if needed) and takes the GIL,
        // which `PyOS_BeforeFork` requires; the matching release is in
        // `after_fork_parent` (and, in the target, `start_inherited`).
        unsafe {
            let state = ffi::PyGILState_Ensure();
            self.fork_gil_unlocked.store(
                matches!(state, ffi::PyGILState_STATE::PyGILState_UNLOCKED),
                Ordering::SeqCst,
            );
            ffi::PyOS_BeforeFork();
        }
    }

    /// In inherited mode: `PyOS_AfterFork_Parent` (the `after_in_parent`
    /// hooks), then gives the GIL back as [`Runtime::before_fork`] found it.
    fn after_fork_parent(&self) {
        if !self.inherited {
            return;
        }
        let state = if self.fork_gil_unlocked.load(Ordering::SeqCst) {
            ffi::PyGILState_STATE::PyGILState_UNLOCKED
        } else {
            ffi::PyGILState_STATE::PyGILState_LOCKED
        };
        // SAFETY: pairs with `before_fork` on this thread, which holds the
        // GIL since then.
        unsafe {
            ffi::PyOS_AfterFork_Parent();
            ffi::PyGILState_Release(state);
        }
    }

    /// In inherited mode, in the new target: `PyOS_AfterFork_Child` (resets
    /// the interpreter's locks and threads to this one, runs the
    /// `after_in_child` hooks). The GIL stays held until
    /// [`Runtime::start`] releases it.
    fn after_fork_child(&self) {
        if !self.inherited {
            return;
        }
        // SAFETY: called once in the child right after `fork`, on the thread
        // that forked, which holds the GIL (taken in `before_fork`).
        unsafe { ffi::PyOS_AfterFork_Child() }
    }

    /// True in inherited mode: the interpreter's open files (its
    /// close-on-exec descriptors, e.g. `sys.stdout` redirected to a file)
    /// stay valid in targets.
    fn keeps_inherited_descriptors(&self) -> bool {
        self.inherited
    }

    /// Unpickles `payload` (cloudpickle bytes, borrowed from the read-only
    /// mapping) with `pickle.loads` over a read-only `memoryview`, without
    /// copying it, and requires the result to be callable.
    ///
    /// # Errors
    /// `DESERIALIZE_FAILED` with:
    /// * the Python exception's type and message for any exception raised
    ///   while unpickling, `SystemExit` and `KeyboardInterrupt` included (the
    ///   target keeps serving);
    /// * kind `TypeError` and a message naming the type it got when the
    ///   unpickled object is not callable;
    /// * kind `BufferError` when the view over the payload could not be
    ///   released (something still exports it).
    ///
    /// `LIFECYCLE_INVALID` with kind `RuntimeNotStarted` before [`Runtime::start`].
    fn deserialize(&self, payload: &[u8]) -> Result<PythonCallable, RuntimeError> {
        let functions = self.functions()?;
        Python::attach(|py| {
            let object =
                loads_borrowed(py, functions.pickle_loads.bind(py), payload).map_err(|err| {
                    let (kind, message) = describe_exception(py, &err);
                    RuntimeError {
                        code: ErrorCode::DESERIALIZE_FAILED,
                        kind,
                        message,
                        exception: Vec::new(),
                    }
                })?;
            if !object.is_callable() {
                return Err(RuntimeError {
                    code: ErrorCode::DESERIALIZE_FAILED,
                    kind: "TypeError".to_owned(),
                    message: format!(
                        "the payload unpickled to an object of type '{}', which is not callable",
                        type_name(&object.get_type())
                    ),
                    exception: Vec::new(),
                });
            }
            Ok(PythonCallable {
                object: object.unbind(),
                executor: None,
            })
        })
    }

    /// Installs a payload with its metadata (`specs/metadata.md`).
    /// The checks run in this order, and the first failure ends the install
    /// before anything is unpickled:
    ///
    /// 1. `python.version` against this interpreter (major.minor), then
    ///    `python.serializer` / `serializer_version` against cloudpickle's
    ///    `__version__` (name and major version), both read once when the
    ///    target started, never per install;
    /// 2. the executor: looked up by short name in the registry, then
    ///    rehydrated (defaults, then a deep copy of `executor_data.attributes`);
    /// 3. each `deps.pip` requirement against the installed distributions
    ///    (`importlib.metadata`; `packaging` when installed, else
    ///    [`crate::metadata::pip`]); never installs anything;
    /// 4. each `deps.bash` command, once per install, with `/bin/sh -c`;
    /// 5. [`Runtime::deserialize`].
    ///
    /// Hooks (`call_before` / `call_after`) are not run here: the target
    /// loop runs them around each task. Without metadata this is
    /// [`Runtime::deserialize`].
    ///
    /// # Errors
    /// `PYTHON_VERSION_MISMATCH` (kinds `PythonVersionMismatch`,
    /// `SerializerMismatch`) naming both versions; `EXECUTOR_UNKNOWN` (kinds
    /// `ExecutorUnknown`, `ExecutorAttributeUnknown`, `ExecutorTypeMismatch`)
    /// naming the executor or attribute; `METADATA_INVALID` (kind
    /// `ExecutorAttributeInvalid`) for an attribute of the wrong JSON type;
    /// `DEPS_UNSATISFIED` (kind `PipRequirementUnsatisfied`) naming every
    /// unsatisfied requirement, or (kind `BashCommandFailed`) naming the
    /// command, its exit status and the tail of its stderr; then as
    /// [`Runtime::deserialize`]. `LIFECYCLE_INVALID` before [`Runtime::start`].
    fn install(
        &self,
        payload: &[u8],
        metadata: Option<&CallableMetadata>,
    ) -> Result<PythonCallable, RuntimeError> {
        let functions = self.functions()?;
        let Some(metadata) = metadata else {
            return self.deserialize(payload);
        };
        if let Some(wanted) = &metadata.python {
            checks::check_versions(functions, wanted)?;
        }
        let executor = self.rehydrate(metadata)?;
        if !metadata.deps.pip.packages.is_empty() {
            Python::attach(|py| checks::check_pip(py, functions, &metadata.deps.pip.packages))?;
        }
        // Without the GIL: a command may take long, and the task thread
        // keeps running Python meanwhile.
        checks::run_bash(&metadata.deps.bash.commands)?;
        let mut callable = self.deserialize(payload)?;
        callable.executor = Some(executor);
        Ok(callable)
    }

    /// Releases callables attached to the interpreter, so each one's
    /// reference is dropped at once (not queued for the next thread that
    /// attaches) and its finalizer (`__del__`, weakref callbacks) runs now.
    /// An exception a finalizer raises, which Python only reports through
    /// `sys.unraisablehook`, is caught for the duration (the hook is
    /// restored after) and returned.
    ///
    /// # Errors
    /// `TASK_FAILED` with the first finalizer exception's type and a
    /// message `a finalizer raised: MESSAGE` (and how many more did, if
    /// any). Before [`Runtime::start`], `release` runs without the
    /// interpreter (nothing Python-owned exists then).
    fn finalize(&self, release: &mut dyn FnMut()) -> Result<(), RuntimeError> {
        if self.functions().is_err() {
            release();
            return Ok(());
        }
        Python::attach(|py| {
            let caught = PyList::empty(py);
            let sys = py.import("sys").ok();
            let previous = sys
                .as_ref()
                .and_then(|sys| sys.getattr("unraisablehook").ok());
            let hooked = match (&sys, caught.getattr("append")) {
                (Some(sys), Ok(append)) => sys.setattr("unraisablehook", append).is_ok(),
                _ => false,
            };
            release();
            if let (true, Some(sys), Some(previous)) = (hooked, &sys, previous) {
                let _ = sys.setattr("unraisablehook", previous);
            }
            let Ok(first) = caught.get_item(0) else {
                return Ok(());
            };
            let kind = first
                .getattr("exc_type")
                .ok()
                .and_then(|t| t.cast_into::<PyType>().ok())
                .map_or_else(|| "BaseException".to_owned(), |t| type_name(&t));
            let text = first
                .getattr("exc_value")
                .and_then(|v| v.str())
                .map(|t| t.to_string_lossy().into_owned())
                .unwrap_or_default();
            let more = match caught.len() {
                0 | 1 => String::new(),
                n => format!(" ({} more finalizers raised)", n - 1),
            };
            Err(RuntimeError {
                code: ErrorCode::TASK_FAILED,
                kind,
                message: format!("a finalizer raised: {text}{more}"),
                exception: Vec::new(),
            })
        })
    }

    /// Runs one task: calls `callable(*args, **kwargs)`.
    ///
    /// * [`TaskEncoding::Json`]: `input` is a UTF-8 JSON object
    ///   `{"args": [...], "kwargs": {...}}` (both keys optional, no other
    ///   keys); the result is the return value as compact JSON (UTF-8,
    ///   non-ASCII escaped; NaN and infinities are refused as not JSON).
    /// * [`TaskEncoding::Pickle`]: `input` is a pickled `(args, kwargs)`
    ///   pair (a tuple or list, and a dict); the result is the return value
    ///   pickled with `pickle.HIGHEST_PROTOCOL`.
    ///
    /// # Errors
    /// `TASK_FAILED` with:
    /// * the exception's type, and a message made of its text and the last
    ///   [`TRACEBACK_FRAMES_KEPT`] traceback frames, when the call raises
    ///   (any `BaseException`);
    /// * kind `TaskInputInvalid` when `input` is not of the shape above;
    /// * the serializer's exception type (`TypeError`, `ValueError`,
    ///   `PicklingError`, ...) and a message naming the result's type when
    ///   the result cannot be encoded.
    ///
    /// `LIFECYCLE_INVALID` with kind `RuntimeNotStarted` before [`Runtime::start`].
    fn call(
        &self,
        callable: &PythonCallable,
        encoding: TaskEncoding,
        input: &[u8],
    ) -> Result<Vec<u8>, RuntimeError> {
        let functions = self.functions()?;
        Python::attach(|py| {
            let (args, kwargs) = match encoding {
                TaskEncoding::Json => json_input(py, functions, input)?,
                TaskEncoding::Pickle => match pickle_input(py, functions, input)? {
                    PickleInput::Call(args, kwargs) => (args, kwargs),
                    PickleInput::Chunk(calls) => {
                        return self.call_chunk(py, functions, callable, &calls);
                    }
                },
            };
            let args = self
                .with_context(py, args)
                .map_err(|err| task_failure(py, functions, &err, encoding))?;
            let object = callable.object.bind(py);
            let result = match &callable.executor {
                Some(installed) => {
                    installed
                        .executor
                        .call(py, &installed.attributes, object, &args, &kwargs)
                }
                None => object.call(args, Some(&kwargs)),
            }
            .map_err(|err| task_failure(py, functions, &err, encoding))?;
            match encoding {
                TaskEncoding::Json => json_result(py, functions, &result),
                TaskEncoding::Pickle => pickle_result(py, functions, &result),
            }
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
fn retain_thread_state() {
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

/// `pickle.loads` over a read-only memoryview of `bytes`, released before
/// returning so that no Python object refers to `bytes` afterwards.
fn loads_borrowed<'py>(
    py: Python<'py>,
    pickle_loads: &Bound<'py, PyAny>,
    bytes: &[u8],
) -> PyResult<Bound<'py, PyAny>> {
    // A slice never exceeds isize::MAX bytes, so the length always fits.
    let len = ffi::Py_ssize_t::try_from(bytes.len())
        .map_err(|_| PyErr::new::<pyo3::exceptions::PyOverflowError, _>("payload too large"))?;
    // SAFETY: the view is created read-only (PyBUF_READ), so Python never
    // writes through the pointer; `bytes` outlives the view because the view
    // is released below before this function returns, and a released view
    // refuses every further access even if unpickling kept a reference.
    let view = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            ffi::PyMemoryView_FromMemory(bytes.as_ptr() as *mut c_char, len, PYBUF_READ),
        )?
    };
    let loaded = pickle_loads.call1((&view,));
    // Released whatever `loads` returned; a failure to release (the buffer
    // is still exported) must fail the whole deserialization, since the
    // caller unmaps the bytes next.
    let released = view.call_method0("release");
    let object = loaded?;
    released?;
    Ok(object)
}

/// Decodes a JSON document as `json.loads(text)` does: the document
/// after the leading JSON whitespace through `raw_decode`, then only
/// JSON whitespace may follow. Whatever that path refuses is decoded
/// again by `json.loads`, so an invalid input fails with its exact error.
fn json_decode<'py>(
    py: Python<'py>,
    functions: &PythonFunctions,
    text: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let is_space = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    // Whitespace is ASCII: its byte counts are character counts.
    let leading = text.bytes().take_while(is_space).count();
    let trailing = text[leading..].bytes().rev().take_while(is_space).count();
    let string = PyString::new(py, text);
    let fast = functions
        .json_raw_decode
        .bind(py)
        .call1((&string, leading))
        .ok()
        .and_then(|pair| {
            let (object, end): (Bound<'py, PyAny>, usize) = pair.extract().ok()?;
            let chars = string.len().ok()?;
            (end + trailing == chars).then_some(object)
        });
    match fast {
        Some(object) => Ok(object),
        None => functions.json_loads.bind(py).call1((string,)),
    }
}

/// Decodes a JSON task input into positional and keyword arguments.
fn json_input<'py>(
    py: Python<'py>,
    functions: &PythonFunctions,
    input: &[u8],
) -> Result<(Bound<'py, PyTuple>, Bound<'py, PyDict>), RuntimeError> {
    let invalid = |message: String| RuntimeError {
        code: ErrorCode::TASK_FAILED,
        kind: KIND_INPUT_INVALID.to_owned(),
        message,
        exception: Vec::new(),
    };
    let text = std::str::from_utf8(input)
        .map_err(|err| invalid(format!("the task input is not UTF-8: {err}")))?;
    let decoded = json_decode(py, functions, text).map_err(|err| {
        let (_, message) = describe_exception(py, &err);
        invalid(format!("the task input is not JSON: {message}"))
    })?;
    let object = decoded.cast::<PyDict>().map_err(|_| {
        invalid(format!(
            "the task input must be a JSON object {{\"args\": [...], \"kwargs\": {{...}}}}, got {}",
            type_name(&decoded.get_type())
        ))
    })?;
    let mut args = PyTuple::empty(py);
    let mut kwargs = None;
    for (key, value) in object.iter() {
        // JSON object keys are always `str`; compared without a copy.
        let key = key.cast_into::<PyString>().ok();
        match key
            .as_ref()
            .and_then(|k| k.to_str().ok())
            .unwrap_or_default()
        {
            "args" => {
                let list = value.cast::<PyList>().map_err(|_| {
                    invalid(format!(
                        "the task input's \"args\" must be a JSON array, got {}",
                        type_name(&value.get_type())
                    ))
                })?;
                args = list.to_tuple();
            }
            "kwargs" => {
                kwargs = Some(value.cast_into::<PyDict>().map_err(|err| {
                    invalid(format!(
                        "the task input's \"kwargs\" must be a JSON object, got {}",
                        type_name(&err.into_inner().get_type())
                    ))
                })?);
            }
            other => {
                return Err(invalid(format!(
                    "the task input has an unknown key {other:?} (expected \"args\" and \"kwargs\")"
                )))
            }
        }
    }
    let kwargs = kwargs.unwrap_or_else(|| PyDict::new(py));
    Ok((args, kwargs))
}

/// Encodes a task's return value as compact JSON bytes.
fn json_result(
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
fn pickle_result(
    py: Python<'_>,
    functions: &PythonFunctions,
    result: &Bound<'_, PyAny>,
) -> Result<Vec<u8>, RuntimeError> {
    let encoded = functions
        .result_dumps
        .bind(py)
        .call1((result, functions.pickle_protocol.bind(py)))
        .map_err(|err| unencodable_result(py, &err, result, "picklable"))?;
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

/// A `TASK_FAILED` error for an exception raised by the task, with the last
/// traceback frames appended to the message and, for a pickle-encoded task,
/// the exception object pickled by the helper `dump_exception`
/// (`specs/python.md` §3, "Task exceptions": with its full formatted
/// traceback and frames in its `__callreg_remote__` attribute, rebuilt
/// without its `__init__` when plain pickling would not unpickle; empty
/// when that fails: the kind and message still say what happened).
fn task_failure(
    py: Python<'_>,
    functions: &PythonFunctions,
    err: &PyErr,
    encoding: TaskEncoding,
) -> RuntimeError {
    let (kind, mut message) = describe_exception(py, err);
    if let Some(frames) = traceback_tail(py, functions, err) {
        message.push('\n');
        message.push_str(&frames);
    }
    let exception = match encoding {
        TaskEncoding::Json => Vec::new(),
        TaskEncoding::Pickle => functions
            .helpers
            .bind(py)
            .getattr("dump_exception")
            .and_then(|dump| {
                dump.call1((
                    err.value(py),
                    functions.pickle_protocol.bind(py),
                    err.traceback(py),
                ))
            })
            .ok()
            .and_then(|b| b.cast::<PyBytes>().ok().map(|b| b.as_bytes().to_vec()))
            .unwrap_or_default(),
    };
    RuntimeError {
        code: ErrorCode::TASK_FAILED,
        kind,
        message,
        exception,
    }
}

/// The last [`TRACEBACK_FRAMES_KEPT`] frames of `err`'s traceback, formatted
/// by `traceback.format_tb` with each file shown by its name only, or `None`
/// when it has none or cannot be formatted.
fn traceback_tail(py: Python<'_>, functions: &PythonFunctions, err: &PyErr) -> Option<String> {
    let traceback = err.traceback(py)?;
    let frames = functions.format_tb.bind(py).call1((traceback,)).ok()?;
    let frames: Vec<String> = frames.extract().ok()?;
    let skipped = frames.len().saturating_sub(TRACEBACK_FRAMES_KEPT);
    let mut text = String::from("Traceback (most recent call last):\n");
    if skipped > 0 {
        text.push_str(&format!("  ... {skipped} earlier frames\n"));
    }
    for frame in &frames[skipped..] {
        text.push_str(&without_directories(frame));
    }
    Some(text.trim_end().to_owned())
}

/// A formatted frame (`  File "/dir/name.py", line 3, in f` then source
/// lines) with the file's directories removed: error messages never carry
/// a user's absolute path (specs/design.md §4.3).
fn without_directories(frame: &str) -> String {
    const START: &str = "  File \"";
    const END: &str = "\", line ";
    let Some(rest) = frame.strip_prefix(START) else {
        return frame.to_owned();
    };
    let Some(end) = rest.find(END) else {
        return frame.to_owned();
    };
    let path = &rest[..end];
    let name = path.rsplit('/').next().unwrap_or(path);
    format!("{START}{name}{}", &rest[end..])
}

/// The exception's type name (module-qualified unless a builtin) and its
/// `str()`, computed without ever printing it.
fn describe_exception(py: Python<'_>, err: &PyErr) -> (String, String) {
    let kind = type_name(&err.get_type(py));
    let message = match err.value(py).str() {
        Ok(text) => text.to_string_lossy().into_owned(),
        Err(_) => format!("<unprintable {kind} object>"),
    };
    (kind, message)
}

/// A type's name as Python's own error messages show it: `module.QualName`,
/// or just `QualName` for builtins.
fn type_name(ty: &Bound<'_, PyType>) -> String {
    ty.fully_qualified_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "<unnamed type>".to_owned())
}

#[cfg(test)]
mod tests {
    use super::without_directories;

    #[test]
    fn frame_files_lose_their_directories() {
        assert_eq!(
            without_directories(
                "  File \"/home/ann/work/job.py\", line 3, in f\n    return 1 / 0\n"
            ),
            "  File \"job.py\", line 3, in f\n    return 1 / 0\n"
        );
        assert_eq!(
            without_directories("  File \"<stdin>\", line 1, in <module>\n"),
            "  File \"<stdin>\", line 1, in <module>\n"
        );
        assert_eq!(without_directories("not a frame"), "not a frame");
    }
}
