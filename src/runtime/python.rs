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
//!   rehydrates the executor before anything is unpickled
//!   (`specs/metadata.md`); executors come from a registry by short name
//!   ([`PythonExecutor`], [`PythonRuntime::with_executor`]).
//!
//! This file holds the runtime itself and its [`Runtime`] methods; its
//! submodules hold, by responsibility: `interpreter`, starting CPython in a
//! target and what is imported once there; `executor`, the executor
//! registry; `checks`, the checks before an install; `input` and `output`,
//! task inputs and results; `exceptions`, Python exceptions as
//! [`RuntimeError`]s.

use std::collections::BTreeMap;
use std::ffi::c_char;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple, PyType};
use pyo3::{ffi, PyErr};

use serde_json::{Map, Value};

use super::{Runtime, RuntimeError, Staged, TaskEncoding};
use crate::error::ErrorCode;
use crate::metadata::CallableMetadata;
use crate::protocol::TargetId;

mod checks;
mod exceptions;
mod executor;
mod input;
mod interpreter;
mod output;

use exceptions::{describe_exception, task_failure, traceback_tail, type_name};
use executor::InstalledExecutor;
use input::{json_input, pickle_input, PickleInput};
use interpreter::{
    check_libpython, ignore_sigint, initialize_interpreter, retain_thread_state, PythonFunctions,
};
use output::{json_result, pickle_result};

pub use checks::{BASH_SHELL, BASH_STDERR_TAIL_BYTES, BASH_STDERR_TAIL_LINES};
pub use exceptions::TRACEBACK_FRAMES_KEPT;
pub use executor::{
    InterpreterExecutor, PythonExecutor, INTERPRETER_EXECUTOR, INTERPRETER_EXECUTOR_TYPE,
};
pub use interpreter::{loaded_libpython, BUILD_LIBPYTHON_DIR, BUILD_PYTHON};

/// `PyBUF_READ` (CPython's `Include/memoryobject.h`, stable since 3.3;
/// PyO3 does not export it under the limited API, which the extension
/// module's abi3 build uses).
const PYBUF_READ: std::ffi::c_int = 0x100;

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

    /// Unpickles `pickle` (with the out-of-band buffers of `staged`, when
    /// it is of that form) and requires a callable: the body of
    /// [`Runtime::deserialize`], [`Runtime::deserialize_staged`] and
    /// [`Runtime::install_reporting`], which passes the `begun` it is
    /// given (the others, nothing); `begun` is called as soon as this
    /// thread holds the interpreter lock, before the unpickle starts.
    fn load(
        &self,
        pickle: &[u8],
        staged: Option<&Staged<'_>>,
        begun: &dyn Fn(),
    ) -> Result<PythonCallable, RuntimeError> {
        let functions = self.functions()?;
        Python::attach(|py| {
            // This thread holds the interpreter lock: the unpickle runs
            // from here (a task holding the lock kept it queued until now).
            begun();
            let failed = |err: PyErr| {
                let (kind, message) = describe_exception(py, &err);
                RuntimeError {
                    code: ErrorCode::DESERIALIZE_FAILED,
                    kind,
                    message,
                    exception: Vec::new(),
                }
            };
            let buffers = match staged {
                Some(staged) => out_of_band_buffers(py, staged).map_err(failed)?,
                None => None,
            };
            let object = loads_borrowed(
                py,
                functions.pickle_loads.bind(py),
                pickle,
                buffers.as_ref(),
            )
            .map_err(|err| {
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
        // A child of multiprocessing's own starts so (the helper
        // `mp_child_start`, `specs/python.md` §2); a failure there is
        // the target's start failing.
        let functions = self.functions()?;
        Python::attach(|py| {
            functions
                .helpers
                .bind(py)
                .getattr("mp_child_start")
                .and_then(|start| start.call0())
                .map(|_| ())
                .map_err(|err| {
                    let (kind, message) = describe_exception(py, &err);
                    RuntimeError {
                        code: ErrorCode::TARGET_LOST,
                        kind,
                        message: format!("multiprocessing's child start failed: {message}"),
                        exception: Vec::new(),
                    }
                })
        })?;
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
                let (kind, mut message) = describe_exception(py, &err);
                // With the innermost frames, as a task failure's: the
                // parent receives it (`Frame::StartFailed`).
                if let Some(frames) = self
                    .functions()
                    .ok()
                    .and_then(|functions| traceback_tail(py, functions, &err))
                {
                    message.push('\n');
                    message.push_str(&frames);
                }
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
    /// has one), then the helper `mp_child_stop` (multiprocessing's end of
    /// a child: its finalizers flush what a task put in a Queue); an
    /// exception either raises is ignored (the target exits next).
    fn stop(&self) {
        let Some(functions) = self.functions.get() else {
            return;
        };
        retain_thread_state();
        Python::attach(|py| {
            if let Some(context) = self.context.get() {
                if let Ok(close) = context.bind(py).getattr("close") {
                    let _ = close.call0();
                }
            }
            if let Ok(stop) = functions.helpers.bind(py).getattr("mp_child_stop") {
                let _ = stop.call0();
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
        self.load(payload, None, &|| {})
    }

    /// Unpickles a staged envelope's pickle (borrowed from the read-only
    /// mapping, as [`Runtime::deserialize`]) with its out-of-band buffers
    /// (`specs/formats.md` §1.1): each buffer is a writable `memoryview`
    /// of one copy-on-write `mmap` of the sealed file per install
    /// (`ACCESS_COPY`: a private writable mapping, which a write-sealed
    /// file allows), so every target shares the file's pages until it
    /// writes one, and a write lands in a page of that target's own: never
    /// in the file, another target, another install or a replacement. The
    /// mapping lives as long as something refers to a buffer of it. From
    /// CPython 3.13 the `mmap` keeps no descriptor (`trackfd=False`);
    /// before, it keeps a duplicate of the file's descriptor open while it
    /// lives. An envelope held in memory (the startup snapshot) gives each
    /// buffer as a writable copy, a `bytearray`. The reference form is
    /// unpickled as [`Runtime::deserialize`] says.
    ///
    /// # Errors
    /// As [`Runtime::deserialize`]; an `OSError` mapping the file is a
    /// `DESERIALIZE_FAILED` with kind `OSError`.
    fn deserialize_staged(&self, staged: Staged<'_>) -> Result<PythonCallable, RuntimeError> {
        self.load(staged.envelope.pickle(), Some(&staged), &|| {})
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
        staged: Staged<'_>,
        metadata: Option<&CallableMetadata>,
    ) -> Result<PythonCallable, RuntimeError> {
        self.install_reporting(staged, metadata, &|| {})
    }

    /// [`Runtime::install`] (above), calling `begun` when the unpickle
    /// begins: once the control thread holds the interpreter lock for it,
    /// after every check. A task holding the lock (a C call that never
    /// releases it) keeps the install queued until then.
    ///
    /// # Errors
    /// As [`Runtime::install`].
    fn install_reporting(
        &self,
        staged: Staged<'_>,
        metadata: Option<&CallableMetadata>,
        begun: &dyn Fn(),
    ) -> Result<PythonCallable, RuntimeError> {
        let functions = self.functions()?;
        let Some(metadata) = metadata else {
            return self.load(staged.envelope.pickle(), Some(&staged), begun);
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
        let mut callable = self.load(staged.envelope.pickle(), Some(&staged), begun)?;
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

/// `pickle.loads` over a read-only memoryview of `bytes`, released before
/// returning so that no Python object refers to `bytes` afterwards.
/// The out-of-band buffers of `staged`, for `pickle.loads(buffers=...)`:
/// `None` for the reference form; writable `memoryview`s of one
/// copy-on-write `mmap` of the sealed file (`specs/formats.md` §1.1);
/// copies (`bytearray`) when there is no file.
fn out_of_band_buffers<'py>(
    py: Python<'py>,
    staged: &Staged<'_>,
) -> PyResult<Option<Bound<'py, PyList>>> {
    if !staged.envelope.is_out_of_band() {
        return Ok(None);
    }
    let list = PyList::empty(py);
    let buffers = staged.envelope.buffers();
    match staged.file {
        Some(file) if buffers.len() > 0 => {
            use std::os::fd::AsRawFd;
            let mmap = py.import("mmap")?;
            let options = PyDict::new(py);
            // Private and writable: a write copies its page for this
            // process alone; the sealed file never changes.
            options.set_item("access", mmap.getattr("ACCESS_COPY")?)?;
            if py.version_info() >= (3, 13) {
                options.set_item("trackfd", false)?;
            }
            // Length 0: the whole file, which is the envelope.
            let map = mmap
                .getattr("mmap")?
                .call((file.as_raw_fd(), 0), Some(&options))?;
            let view = py
                .import("builtins")?
                .getattr("memoryview")?
                .call1((map,))?;
            for (offset, bytes) in buffers {
                let start = offset as isize;
                let slice = pyo3::types::PySlice::new(py, start, start + bytes.len() as isize, 1);
                list.append(view.get_item(slice)?)?;
            }
        }
        _ => {
            for (_, bytes) in buffers {
                list.append(pyo3::types::PyByteArray::new(py, bytes))?;
            }
        }
    }
    Ok(Some(list))
}

fn loads_borrowed<'py>(
    py: Python<'py>,
    pickle_loads: &Bound<'py, PyAny>,
    bytes: &[u8],
    buffers: Option<&Bound<'py, PyList>>,
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
    let loaded = match buffers {
        None => pickle_loads.call1((&view,)),
        Some(buffers) => {
            let options = PyDict::new(py);
            options.set_item("buffers", buffers)?;
            pickle_loads.call((&view,), Some(&options))
        }
    };
    // Released whatever `loads` returned; a failure to release (the buffer
    // is still exported) must fail the whole deserialization, since the
    // caller unmaps the bytes next.
    let released = view.call_method0("release");
    let object = loaded?;
    released?;
    Ok(object)
}
