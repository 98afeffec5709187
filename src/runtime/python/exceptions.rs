//! Python exceptions as [`RuntimeError`]s: type names, messages, the
//! trimmed traceback of a task failure (never a user's directories) and
//! its pickled exception, all computed without letting Python print.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};
use pyo3::PyErr;

use super::interpreter::PythonFunctions;
use super::{RuntimeError, TaskEncoding};
use crate::error::ErrorCode;

/// How many of the innermost traceback frames a task failure's message keeps.
pub const TRACEBACK_FRAMES_KEPT: usize = 6;

/// A `TASK_FAILED` error for an exception raised by the task, with the last
/// traceback frames appended to the message and, for a pickle-encoded task,
/// the exception object pickled by the helper `dump_exception`
/// (`specs/python.md` §3, "Task exceptions": with its full formatted
/// traceback and frames in its `__callreg_remote__` attribute, rebuilt
/// without its `__init__` when plain pickling would not unpickle; empty
/// when that fails: the kind and message still say what happened).
pub(super) fn task_failure(
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
        TaskEncoding::Pickle => pickled_exception(py, functions, err),
    };
    RuntimeError {
        code: ErrorCode::TASK_FAILED,
        kind,
        message,
        exception,
    }
}

/// `err`'s exception pickled by the helper `dump_exception` (with its
/// traceback), or empty when that fails.
pub(super) fn pickled_exception(
    py: Python<'_>,
    functions: &PythonFunctions,
    err: &PyErr,
) -> Vec<u8> {
    functions
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
        .unwrap_or_default()
}

/// The last [`TRACEBACK_FRAMES_KEPT`] frames of `err`'s traceback, formatted
/// by `traceback.format_tb` with each file shown by its name only, or `None`
/// when it has none or cannot be formatted.
pub(super) fn traceback_tail(
    py: Python<'_>,
    functions: &PythonFunctions,
    err: &PyErr,
) -> Option<String> {
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
pub(super) fn describe_exception(py: Python<'_>, err: &PyErr) -> (String, String) {
    let kind = type_name(&err.get_type(py));
    let message = match err.value(py).str() {
        Ok(text) => text.to_string_lossy().into_owned(),
        Err(_) => format!("<unprintable {kind} object>"),
    };
    (kind, message)
}

/// A type's name as Python's own error messages show it: `module.QualName`,
/// or just `QualName` for builtins.
pub(super) fn type_name(ty: &Bound<'_, PyType>) -> String {
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
