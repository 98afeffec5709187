//! Task inputs (`specs/python.md` §3): a JSON object `{"args": [...],
//! "kwargs": {...}}`, or a pickled one call `(args, kwargs)` or chunk
//! `([args, ...],)` of calls run in turn in one task.

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
        loads_borrowed(py, functions.pickle_loads.bind(py), input, None)
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
pub(super) fn json_input<'py>(
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
