//! Pickled task inputs (`specs/python.md` §3): one call `(args, kwargs)`
//! or a chunk `([args, ...],)` of calls run in turn in one task.

use super::*;

impl PythonRuntime {
    /// `args` with the target's context (the target initializer's result,
    /// [`PythonRuntime::with_target_initializer`]) first, when it has one.
    pub(super) fn with_context<'py>(
        &self,
        py: Python<'py>,
        args: Bound<'py, PyTuple>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        match self.context.get() {
            None => Ok(args),
            Some(context) => {
                let mut items = Vec::with_capacity(args.len() + 1);
                items.push(context.bind(py).clone());
                items.extend(args.iter());
                PyTuple::new(py, items)
            }
        }
    }

    /// Runs a chunk of calls (`specs/python.md` §3, "Chunks"): `callable(*args)`
    /// for each `args` of `calls`, in order, and returns their results as
    /// one pickled list. The first call that raises fails the whole task
    /// with its exception (the calls after it do not run).
    pub(super) fn call_chunk(
        &self,
        py: Python<'_>,
        functions: &PythonFunctions,
        callable: &PythonCallable,
        calls: &Bound<'_, PyList>,
    ) -> Result<Vec<u8>, RuntimeError> {
        let encoding = TaskEncoding::Pickle;
        let failure = |err: &PyErr| task_failure(py, functions, err, encoding);
        let kwargs = PyDict::new(py);
        let results = PyList::empty(py);
        let object = callable.object.bind(py);
        for args in calls.iter() {
            let args = self
                .with_context(py, chunk_args(&args)?)
                .map_err(|err| failure(&err))?;
            let result = match &callable.executor {
                Some(installed) => {
                    installed
                        .executor
                        .call(py, &installed.attributes, object, &args, &kwargs)
                }
                None => object.call(args, None),
            }
            .map_err(|err| failure(&err))?;
            results.append(result).map_err(|err| failure(&err))?;
        }
        pickle_result(py, functions, results.as_any())
    }
}

/// One call's arguments in a chunk: a tuple, or a list made one.
fn chunk_args<'py>(args: &Bound<'py, PyAny>) -> Result<Bound<'py, PyTuple>, RuntimeError> {
    if let Ok(tuple) = args.cast::<PyTuple>() {
        return Ok(tuple.clone());
    }
    if let Ok(list) = args.cast::<PyList>() {
        return Ok(list.to_tuple());
    }
    Err(RuntimeError {
        code: ErrorCode::TASK_FAILED,
        kind: KIND_INPUT_INVALID.to_owned(),
        message: format!(
            "each call of a chunk must be a tuple or list of arguments, got {}",
            type_name(&args.get_type())
        ),
        exception: Vec::new(),
    })
}

/// A pickled task input, decoded: one call, or a chunk of calls.
pub(super) enum PickleInput<'py> {
    /// `(args, kwargs)`: one call.
    Call(Bound<'py, PyTuple>, Bound<'py, PyDict>),
    /// `([args, ...],)`: one call per `args`, positional only.
    Chunk(Bound<'py, PyList>),
}

/// Decodes a pickled task input: `(args, kwargs)`, or a chunk `([args,
/// ...],)` (`specs/python.md` §3).
pub(super) fn pickle_input<'py>(
    py: Python<'py>,
    functions: &PythonFunctions,
    input: &[u8],
) -> Result<PickleInput<'py>, RuntimeError> {
    let invalid = |message: String| RuntimeError {
        code: ErrorCode::TASK_FAILED,
        kind: KIND_INPUT_INVALID.to_owned(),
        message,
        exception: Vec::new(),
    };
    // A small input is copied into one `bytes` object: cheaper than a
    // memoryview (two objects, and a `release` call) over the frame.
    let decoded = if input.len() <= SMALL_PICKLE_INPUT_BYTES {
        functions
            .pickle_loads
            .bind(py)
            .call1((PyBytes::new(py, input),))
    } else {
        loads_borrowed(py, functions.pickle_loads.bind(py), input)
    };
    let decoded = decoded.map_err(|err| {
        let (kind, message) = describe_exception(py, &err);
        invalid(format!(
            "the pickled task input could not be unpickled: {kind}: {message}"
        ))
    })?;
    let shape_error = || {
        invalid(format!(
            "the pickled task input must be a pair (args: tuple or list, kwargs: dict) or a chunk ([args, ...],), got {}",
            type_name(&decoded.get_type())
        ))
    };
    let pair = decoded.cast::<PyTuple>().map_err(|_| shape_error())?;
    if pair.len() == 1 {
        let calls = pair.get_item(0).map_err(|_| shape_error())?;
        return calls
            .cast_into::<PyList>()
            .map(PickleInput::Chunk)
            .map_err(|_| shape_error());
    }
    if pair.len() != 2 {
        return Err(shape_error());
    }
    let (args, kwargs) = (
        pair.get_item(0).map_err(|_| shape_error())?,
        pair.get_item(1).map_err(|_| shape_error())?,
    );
    let args = if let Ok(tuple) = args.cast::<PyTuple>() {
        tuple.clone()
    } else if let Ok(list) = args.cast::<PyList>() {
        list.to_tuple()
    } else {
        return Err(shape_error());
    };
    let kwargs = kwargs.cast_into::<PyDict>().map_err(|_| shape_error())?;
    Ok(PickleInput::Call(args, kwargs))
}
