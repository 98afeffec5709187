//! A small Rust runtime for tests and benchmarks: a serializer payload is a
//! UTF-8 instruction, so every target path (install, failure, crash, slow
//! call) can be exercised without Python.
//!
//! Instructions (anything from the first `#` on is a comment, used to make
//! distinct payloads, hence distinct digests, with the same behaviour):
//!
//! | payload | deserialize | call |
//! |---|---|---|
//! | `echo` | ok | returns the input |
//! | `add` | ok | JSON input `{"args": [a, b], ...}` → `a + b` as JSON |
//! | `sleep MS` | ok | sleeps MS milliseconds, returns the input |
//! | `fail MESSAGE` | ok | fails: `TASK_FAILED`, kind `TestFailure` |
//! | `panic` | ok | panics |
//! | `exit CODE` | ok | ends the target with `_exit(CODE)` |
//! | `bad MESSAGE` | fails: `DESERIALIZE_FAILED` with MESSAGE | — |
//! | `slow MS` | sleeps MS milliseconds, then ok (echo) | returns the input |
//! | `crash` | ends the target with `_exit(`[`CRASH_EXIT_CODE`]`)` | — |
//!
//! Anything else fails to deserialize with `DESERIALIZE_FAILED`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::{Runtime, RuntimeError, TaskEncoding};
use crate::error::ErrorCode;

/// Exit status of a target that deserialized a `crash` payload.
pub const CRASH_EXIT_CODE: i32 = 87;

static DESERIALIZED: AtomicUsize = AtomicUsize::new(0);

/// How many payloads [`TestRuntime::deserialize`] was called for in this
/// process (a parent must keep it at 0: it never deserializes, specs/design.md §6).
pub fn deserialize_count() -> usize {
    DESERIALIZED.load(Ordering::SeqCst)
}

/// A deserialized test callable.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum TestCallable {
    /// Returns its input.
    Echo,
    /// Adds the two JSON numbers in `args`.
    Add,
    /// Sleeps, then returns its input.
    Sleep(Duration),
    /// Fails with this message.
    Fail(String),
    /// Panics.
    Panic,
    /// Ends the process with this status.
    Exit(i32),
}

/// The test runtime (see the module documentation for its instructions).
#[derive(Clone, Copy, Default, Debug)]
pub struct TestRuntime;

fn deserialize_error(message: String) -> RuntimeError {
    RuntimeError {
        code: ErrorCode::DESERIALIZE_FAILED,
        kind: "TestDeserializeError".to_owned(),
        message,
        exception: Vec::new(),
    }
}

fn task_error(kind: &str, message: String) -> RuntimeError {
    RuntimeError {
        code: ErrorCode::TASK_FAILED,
        kind: kind.to_owned(),
        message,
        exception: Vec::new(),
    }
}

fn millis(argument: &str) -> Result<Duration, RuntimeError> {
    argument
        .trim()
        .parse()
        .map(Duration::from_millis)
        .map_err(|_| deserialize_error(format!("{argument:?} is not a number of milliseconds")))
}

impl Runtime for TestRuntime {
    type Callable = TestCallable;

    fn start(&self) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn deserialize(&self, payload: &[u8]) -> Result<TestCallable, RuntimeError> {
        DESERIALIZED.fetch_add(1, Ordering::SeqCst);
        // Only the instruction is read: a large comment (benchmark padding)
        // costs nothing but the search for its `#`.
        let end = payload
            .iter()
            .position(|b| *b == b'#')
            .unwrap_or(payload.len());
        let text = std::str::from_utf8(&payload[..end])
            .map_err(|_| deserialize_error("the payload is not UTF-8".to_owned()))?
            .trim();
        let (word, argument) = text.split_once(' ').unwrap_or((text, ""));
        Ok(match word {
            "echo" => TestCallable::Echo,
            "add" => TestCallable::Add,
            "sleep" => TestCallable::Sleep(millis(argument)?),
            "fail" => TestCallable::Fail(argument.to_owned()),
            "panic" => TestCallable::Panic,
            "exit" => {
                TestCallable::Exit(argument.trim().parse().map_err(|_| {
                    deserialize_error(format!("{argument:?} is not an exit status"))
                })?)
            }
            "bad" => return Err(deserialize_error(argument.to_owned())),
            "slow" => {
                std::thread::sleep(millis(argument)?);
                TestCallable::Echo
            }
            // SAFETY: `_exit` ends the target at once: the crash this
            // instruction stands for.
            "crash" => unsafe { libc::_exit(CRASH_EXIT_CODE) },
            _ => return Err(deserialize_error(format!("unknown instruction {word:?}"))),
        })
    }

    fn call(
        &self,
        callable: &TestCallable,
        encoding: TaskEncoding,
        input: &[u8],
    ) -> Result<Vec<u8>, RuntimeError> {
        match callable {
            TestCallable::Echo => Ok(input.to_vec()),
            TestCallable::Sleep(duration) => {
                std::thread::sleep(*duration);
                Ok(input.to_vec())
            }
            TestCallable::Add => {
                if encoding != TaskEncoding::Json {
                    return Err(task_error("TypeError", "add takes JSON input".to_owned()));
                }
                let value: serde_json::Value = serde_json::from_slice(input)
                    .map_err(|e| task_error("ValueError", format!("input is not JSON: {e}")))?;
                let args = value.get("args").and_then(|a| a.as_array());
                let numbers: Option<Vec<i64>> =
                    args.and_then(|a| a.iter().map(serde_json::Value::as_i64).collect());
                match numbers.as_deref() {
                    Some([a, b]) => Ok(a.wrapping_add(*b).to_string().into_bytes()),
                    _ => Err(task_error(
                        "TypeError",
                        "add takes two integer args".to_owned(),
                    )),
                }
            }
            TestCallable::Fail(message) => Err(task_error("TestFailure", message.clone())),
            TestCallable::Panic => panic!("test callable panicked"),
            // SAFETY: ends the target at once, as the instruction asks.
            TestCallable::Exit(code) => unsafe { libc::_exit(*code) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{encode, encode_out_of_band, Envelope};
    use crate::runtime::Staged;

    #[test]
    fn a_runtime_without_buffers_installs_the_reference_form_only() {
        let rt = TestRuntime;
        let plain = encode(b"echo");
        let staged = Staged::in_memory(Envelope::parse(&plain).unwrap());
        assert_eq!(rt.install(staged, None).unwrap(), TestCallable::Echo);
        let out_of_band = encode_out_of_band(b"echo", &[b"buffer"]);
        let staged = Staged::in_memory(Envelope::parse(&out_of_band).unwrap());
        assert_eq!(
            rt.install(staged, None).unwrap_err(),
            RuntimeError {
                code: ErrorCode::DESERIALIZE_FAILED,
                kind: "OutOfBandUnsupported".to_owned(),
                message: "this runtime installs no envelope with out-of-band buffers (version 129)"
                    .to_owned(),
                exception: Vec::new(),
            }
        );
    }

    #[test]
    fn instructions_deserialize_and_run() {
        let rt = TestRuntime;
        assert_eq!(rt.deserialize(b"echo #1").unwrap(), TestCallable::Echo);
        assert_eq!(
            rt.deserialize(b"sleep 5").unwrap(),
            TestCallable::Sleep(Duration::from_millis(5))
        );
        assert_eq!(rt.deserialize(b"exit 3").unwrap(), TestCallable::Exit(3));
        let add = rt.deserialize(b"add").unwrap();
        assert_eq!(
            rt.call(
                &add,
                TaskEncoding::Json,
                br#"{"args": [2, 40], "kwargs": {}}"#
            )
            .unwrap(),
            b"42"
        );
        let err = rt.call(&add, TaskEncoding::Json, b"[").unwrap_err();
        assert_eq!(
            (err.code, err.kind.as_str()),
            (ErrorCode::TASK_FAILED, "ValueError")
        );
        let fail = rt.deserialize(b"fail boom").unwrap();
        let err = rt.call(&fail, TaskEncoding::Json, b"").unwrap_err();
        assert_eq!(err, task_error("TestFailure", "boom".to_owned()));
        let err = rt.deserialize(b"bad no luck").unwrap_err();
        assert_eq!(err, deserialize_error("no luck".to_owned()));
        let err = rt.deserialize(b"frobnicate").unwrap_err();
        assert_eq!(err.message, "unknown instruction \"frobnicate\"");
    }
}
