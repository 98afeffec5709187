//! The checks a Python target makes before deserializing a payload with
//! metadata (`specs/metadata.md` "Checks before deserializing"):
//! interpreter and serializer versions, pip requirements, bash commands.
//! Each returns the [`RuntimeError`] the install reports; none of them
//! deserializes anything.

use std::io::Read;
use std::process::{Command, Stdio};

use pyo3::prelude::*;
use pyo3::types::PyList;

use super::exceptions::describe_exception;
use super::interpreter::PythonFunctions;
use crate::error::ErrorCode;
use crate::metadata::pip::Requirement;
use crate::metadata::{leading_major, python_major_minor, PythonVersions, SERIALIZER_CLOUDPICKLE};
use crate::runtime::RuntimeError;

/// How many trailing lines of a failed bash command's stderr its error keeps.
pub const BASH_STDERR_TAIL_LINES: usize = 10;

/// How many trailing bytes (at most) of a failed bash command's stderr its
/// error keeps, after [`BASH_STDERR_TAIL_LINES`].
pub const BASH_STDERR_TAIL_BYTES: usize = 2048;

/// The shell that runs `deps.bash` commands, as `SHELL -c COMMAND`.
pub const BASH_SHELL: &str = "/bin/sh";

/// The Python source of the helper module `_callreg_metadata`
/// (`checks.py` beside this file), compiled once per target by
/// `PythonRuntime::start`.
pub(super) const HELPERS_SOURCE: &std::ffi::CStr = match std::ffi::CStr::from_bytes_with_nul(
    concat!(include_str!("checks.py"), "\0").as_bytes(),
) {
    Ok(source) => source,
    Err(_) => panic!("checks.py holds a NUL byte"),
};

/// Calls helper `name` with `args` and extracts its result.
fn helper<'py, T: FromPyObjectOwned<'py>>(
    py: Python<'py>,
    functions: &PythonFunctions,
    name: &str,
    args: impl pyo3::call::PyCallArgs<'py>,
    code: ErrorCode,
) -> Result<T, RuntimeError> {
    functions
        .helpers
        .bind(py)
        .getattr(name)
        .and_then(|f| f.call1(args))
        .and_then(|value| value.extract::<T>().map_err(Into::into))
        .map_err(|err| {
            let (kind, message) = describe_exception(py, &err);
            RuntimeError {
                code,
                kind,
                message: format!("checking the metadata failed in {name}: {message}"),
                exception: Vec::new(),
            }
        })
}

/// Checks the producer's interpreter (major.minor) and serializer (name and
/// major version) against this target's, as read once at the target's
/// start ([`TargetVersions`](super::interpreter::TargetVersions); never per install).
///
/// # Errors
/// `PYTHON_VERSION_MISMATCH` naming both sides, then
/// [`SERIALIZE_WHERE_THEY_RUN`]: kind
/// `PythonVersionMismatch` for the interpreter; kind `SerializerMismatch`
/// for another serializer than cloudpickle, a cloudpickle that is not
/// installed here, or another cloudpickle major version.
/// What every version mismatch adds: how to get envelopes the targets
/// can read.
pub const SERIALIZE_WHERE_THEY_RUN: &str = "; serialize with the interpreter the targets run \
     (for the callreg command, the PYO3_PYTHON it was built with)";

pub(super) fn check_versions(
    functions: &PythonFunctions,
    wanted: &PythonVersions,
) -> Result<(), RuntimeError> {
    let mismatch = |kind: &str, message: String| RuntimeError {
        code: ErrorCode::PYTHON_VERSION_MISMATCH,
        kind: kind.to_owned(),
        message: format!("{message}{SERIALIZE_WHERE_THEY_RUN}"),
        exception: Vec::new(),
    };
    let target = &functions.versions.python;
    if python_major_minor(&wanted.version) != python_major_minor(target) {
        return Err(mismatch(
            "PythonVersionMismatch",
            format!(
                "the payload was serialized by Python {} but this target runs Python {target} \
                 (major.minor must match)",
                wanted.version
            ),
        ));
    }
    let serializer = functions.versions.cloudpickle.as_deref();
    let producer = format!("{} {}", wanted.serializer, wanted.serializer_version);
    let Some(serializer) = serializer else {
        return Err(mismatch(
            "SerializerMismatch",
            format!("the payload was serialized with {producer} but this target has no cloudpickle installed"),
        ));
    };
    if wanted.serializer != SERIALIZER_CLOUDPICKLE
        || leading_major(&wanted.serializer_version) != leading_major(serializer)
    {
        return Err(mismatch(
            "SerializerMismatch",
            format!(
                "the payload was serialized with {producer} but this target deserializes with \
                 cloudpickle {serializer} (the serializer and its major version must match)"
            ),
        ));
    }
    Ok(())
}

/// Verifies every `deps.pip` requirement against what is installed (never
/// installs): with `packaging.requirements` when it is installed, else
/// with the minimal matcher of [`crate::metadata::pip`].
///
/// # Errors
/// `DEPS_UNSATISFIED` with kind `PipRequirementUnsatisfied` and a message
/// listing every unsatisfied requirement with its reason (`not installed`,
/// `installed 2.1.0`, or why it cannot be checked).
pub(super) fn check_pip(
    py: Python<'_>,
    functions: &PythonFunctions,
    packages: &[String],
) -> Result<(), RuntimeError> {
    if packages.is_empty() {
        return Ok(());
    }
    let list = PyList::new(py, packages).map_err(|err| {
        let (kind, message) = describe_exception(py, &err);
        RuntimeError {
            code: ErrorCode::DEPS_UNSATISFIED,
            kind,
            message,
            exception: Vec::new(),
        }
    })?;
    let checked: Option<Vec<String>> = helper(
        py,
        functions,
        "check_pip",
        (list,),
        ErrorCode::DEPS_UNSATISFIED,
    )?;
    let problems = match checked {
        Some(problems) => problems,
        None => {
            let mut problems = Vec::new();
            for text in packages {
                match Requirement::parse(text) {
                    Err(error) => {
                        problems.push(format!("{text} (cannot be checked: {})", error.reason))
                    }
                    Ok(requirement) => {
                        let installed: Option<String> = helper(
                            py,
                            functions,
                            "installed_version",
                            (requirement.name.as_str(),),
                            ErrorCode::DEPS_UNSATISFIED,
                        )?;
                        match installed {
                            None => problems.push(format!("{text} (not installed)")),
                            Some(version) => match requirement.unmet(&version) {
                                Ok(unmet) if unmet.is_empty() => {}
                                Ok(_) => problems.push(format!("{text} (installed {version})")),
                                Err(error) => problems.push(format!(
                                    "{text} (installed {version}, which cannot be compared: {})",
                                    error.reason
                                )),
                            },
                        }
                    }
                }
            }
            problems
        }
    };
    if problems.is_empty() {
        Ok(())
    } else {
        Err(RuntimeError {
            code: ErrorCode::DEPS_UNSATISFIED,
            kind: "PipRequirementUnsatisfied".to_owned(),
            message: format!("deps.pip is not satisfied: {}", problems.join("; ")),
            exception: Vec::new(),
        })
    }
}

/// The last [`BASH_STDERR_TAIL_LINES`] lines of `stderr`, at most
/// [`BASH_STDERR_TAIL_BYTES`] bytes (cut at a character boundary), lossily
/// decoded.
pub(super) fn stderr_tail(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let text = text.trim_end();
    let lines: Vec<&str> = text.lines().collect();
    let mut tail = lines[lines.len().saturating_sub(BASH_STDERR_TAIL_LINES)..].join("\n");
    if tail.len() > BASH_STDERR_TAIL_BYTES {
        let mut start = tail.len() - BASH_STDERR_TAIL_BYTES;
        while !tail.is_char_boundary(start) {
            start += 1;
        }
        tail = tail[start..].to_owned();
    }
    tail
}

/// Runs each `deps.bash` command once, in order, as `/bin/sh -c COMMAND`
/// (stdin from /dev/null, stdout discarded, stderr kept for the error),
/// stopping at the first failure. Called without the GIL.
///
/// # Errors
/// `DEPS_UNSATISFIED` with kind `BashCommandFailed` naming the command (its
/// index and text) and its exit status or signal, followed by the tail of
/// its stderr ([`stderr_tail`]); or the reason the shell could not be run.
pub(super) fn run_bash(commands: &[String]) -> Result<(), RuntimeError> {
    let count = commands.len();
    for (index, command) in commands.iter().enumerate() {
        let failed = |what: String| RuntimeError {
            code: ErrorCode::DEPS_UNSATISFIED,
            kind: "BashCommandFailed".to_owned(),
            message: format!(
                "deps.bash command {} of {count} ({command:?}) {what}",
                index + 1
            ),
            exception: Vec::new(),
        };
        let mut child = Command::new(BASH_SHELL)
            .arg("-c")
            .arg(command)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|err| failed(format!("could not be started with {BASH_SHELL}: {err}")))?;
        let mut stderr = Vec::new();
        if let Some(mut pipe) = child.stderr.take() {
            // A read error only shortens the tail shown; the status decides.
            let _ = pipe.read_to_end(&mut stderr);
        }
        let status = child
            .wait()
            .map_err(|err| failed(format!("could not be waited for: {err}")))?;
        if status.success() {
            continue;
        }
        let how = match status.code() {
            Some(code) => format!("exited with status {code}"),
            None => {
                use std::os::unix::process::ExitStatusExt;
                format!("was killed by signal {}", status.signal().unwrap_or(0))
            }
        };
        let tail = stderr_tail(&stderr);
        let what = if tail.is_empty() {
            format!("{how}; its stderr was empty")
        } else {
            format!("{how}; stderr tail:\n{tail}")
        };
        return Err(failed(what));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_tail_keeps_the_last_lines_and_bytes() {
        let many: String = (1..=15).map(|i| format!("line {i}\n")).collect();
        assert_eq!(
            stderr_tail(many.as_bytes()),
            (6..=15)
                .map(|i| format!("line {i}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        let long = "é".repeat(BASH_STDERR_TAIL_BYTES);
        let tail = stderr_tail(long.as_bytes());
        assert_eq!(tail, "é".repeat(BASH_STDERR_TAIL_BYTES / 2));
        assert_eq!(stderr_tail(b"\n\n"), "");
    }
}
