//! The reply socket's writer: whole frames under one lock, from any
//! thread of the target, with a frame that exceeds the maximum frame size
//! shortened to fit (a message cut at a character boundary, an oversized
//! task result replaced by an error saying so).

use std::fs::File;
use std::io::Write;
use std::sync::Mutex;

use super::{abrupt_exit, REPLY_EXIT_CODE};
use crate::error::ErrorCode;
use crate::io::failpoints;
use crate::io::process::exit_unless_target;
use crate::protocol::{ControlPhase, Failure};
use crate::wire::{Frame, ReplyError, TaskFailure, HEADER_BYTES};

/// Writes whole frames to the reply socket, from either thread.
pub(super) struct ReplyWriter {
    pub(super) pipe: Mutex<File>,
    pub(super) max_frame_bytes: usize,
}

impl ReplyWriter {
    /// Sends [`Frame::Alive`] for control `seq` in `phase`. Ends the
    /// target if the pipe is gone.
    pub(super) fn send_alive(&self, seq: u64, phase: ControlPhase) {
        self.send_report(Frame::Alive { seq, phase });
    }

    /// Sends [`Frame::Started`] for task `seq`: returns once the report is
    /// in the socket. Ends the target if the pipe is gone.
    pub(super) fn send_started(&self, seq: u64) {
        self.send_report(Frame::Started { seq });
    }

    /// Sends a fixed-size report (never delayed by the reply failpoint: it
    /// is not a reply). Ends the target if the pipe is gone.
    fn send_report(&self, frame: Frame) {
        exit_unless_target();
        let Ok(bytes) = frame.encode(self.max_frame_bytes) else {
            // SAFETY: see `abrupt_exit`; a report of at most 17 bytes
            // always fits.
            unsafe { libc::_exit(REPLY_EXIT_CODE) }
        };
        let mut pipe = self.pipe.lock().unwrap_or_else(|p| p.into_inner());
        if pipe.write_all(&bytes).is_err() {
            // SAFETY: see `abrupt_exit`; the parent is gone, nobody listens.
            unsafe { libc::_exit(REPLY_EXIT_CODE) }
        }
    }

    /// Sends `frame`, shortened to fit the maximum frame size if needed (a
    /// message is cut at a character boundary, an oversized task result is
    /// replaced by an error saying so). Ends the target if the pipe is gone.
    pub(super) fn send(&self, frame: Frame) {
        self.send_with_start(frame, None);
    }

    /// [`ReplyWriter::send`], followed in the same write by the start
    /// report of task `started` when given (one system call, one wake-up
    /// of the parent, for a task result and the next task's start).
    pub(super) fn send_with_start(&self, frame: Frame, started: Option<u64>) {
        // A process forked inside the target never writes a reply.
        exit_unless_target();
        if failpoints::hit(failpoints::TARGET_REPLY_DELAY).is_err() {
            abrupt_exit();
        }
        let mut bytes = match frame.encode(self.max_frame_bytes) {
            Ok(bytes) => bytes,
            Err(_) => match fit(frame, self.max_frame_bytes).encode(self.max_frame_bytes) {
                Ok(bytes) => bytes,
                // Unreachable for the frames a target sends: `fit` leaves
                // only fixed-size fields; end rather than send garbage.
                // SAFETY: see `abrupt_exit`.
                Err(_) => unsafe { libc::_exit(REPLY_EXIT_CODE) },
            },
        };
        if let Some(seq) = started {
            // A 16-byte frame always fits.
            let _ = Frame::Started { seq }.encode_into(&mut bytes, self.max_frame_bytes);
        }
        let mut pipe = self.pipe.lock().unwrap_or_else(|p| p.into_inner());
        if pipe.write_all(&bytes).is_err() {
            // SAFETY: see `abrupt_exit`; the parent is gone, nobody listens.
            unsafe { libc::_exit(REPLY_EXIT_CODE) }
        }
    }
}

/// Room left for variable text in a frame of `max` bytes after `fixed`.
fn room(max: usize, fixed: usize) -> usize {
    max.saturating_sub(HEADER_BYTES + fixed)
}

fn truncate(text: &mut String, bytes: usize) {
    if text.len() > bytes {
        let mut end = bytes;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

/// Shrinks a reply or task result that exceeds the maximum frame size.
fn fit(frame: Frame, max: usize) -> Frame {
    // Fixed parts: seq 8 + digest 32 + status 2 + length prefixes.
    match frame {
        Frame::Reply {
            seq,
            digest,
            result: Err(mut error),
        } => {
            truncate(&mut error.message, room(max, 8 + 32 + 2 + 4));
            Frame::Reply {
                seq,
                digest,
                result: Err(error),
            }
        }
        Frame::TaskResult {
            seq,
            digest,
            result,
        } => {
            let mut failure = match result {
                Ok(output) => TaskFailure {
                    code: ErrorCode::TASK_FAILED,
                    kind: "ResultTooLarge".to_owned(),
                    message: format!(
                        "the task's result of {} bytes does not fit in a frame of at most {max} bytes (max_frame_bytes)",
                        output.len()
                    ),
                    exception: Vec::new(),
                },
                Err(failure) => failure,
            };
            // An oversized failure loses its serialized exception first
            // (the caller still gets the kind and message).
            failure.exception.clear();
            truncate(&mut failure.kind, 64);
            truncate(
                &mut failure.message,
                room(max, 8 + 32 + 2 + 4 + 4 + failure.kind.len()),
            );
            Frame::TaskResult {
                seq,
                digest,
                result: Err(failure),
            }
        }
        Frame::StartFailed {
            mut kind,
            mut message,
        } => {
            truncate(&mut kind, 64);
            truncate(&mut message, room(max, 4 + kind.len() + 4));
            Frame::StartFailed { kind, message }
        }
        Frame::Ready { pid, snapshot } => Frame::Ready {
            pid,
            snapshot: snapshot
                .into_iter()
                .map(|(digest, result)| {
                    let result = result.map_err(|mut e| {
                        truncate(&mut e.message, 200);
                        e
                    });
                    (digest, result)
                })
                .collect(),
        },
        other => other,
    }
}

pub(super) fn reply_error(failure: Failure) -> ReplyError {
    ReplyError {
        code: failure.code,
        message: failure.message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::Digest;
    use crate::wire::MIN_MAX_FRAME_BYTES;

    #[test]
    fn an_oversized_task_result_becomes_a_failure_that_fits() {
        let frame = Frame::TaskResult {
            seq: 3,
            digest: Digest([4; 32]),
            result: Ok(vec![0; 10_000]),
        };
        let fitted = fit(frame, MIN_MAX_FRAME_BYTES);
        let bytes = fitted.encode(MIN_MAX_FRAME_BYTES).unwrap();
        assert!(bytes.len() <= MIN_MAX_FRAME_BYTES);
        match fitted {
            Frame::TaskResult {
                seq: 3,
                result: Err(failure),
                ..
            } => {
                assert_eq!(failure.code, ErrorCode::TASK_FAILED);
                assert_eq!(failure.kind, "ResultTooLarge");
                assert!(failure
                    .message
                    .starts_with("the task's result of 10000 bytes"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_long_start_failure_is_cut_to_fit() {
        let frame = Frame::StartFailed {
            kind: "K".repeat(100),
            message: "m".repeat(10_000),
        };
        let fitted = fit(frame, MIN_MAX_FRAME_BYTES);
        let bytes = fitted.encode(MIN_MAX_FRAME_BYTES).unwrap();
        assert_eq!(bytes.len(), MIN_MAX_FRAME_BYTES);
        match fitted {
            Frame::StartFailed { kind, message } => {
                assert_eq!(kind, "K".repeat(64));
                // 256 - 8 (header) - 4 - 64 - 4.
                assert_eq!(message, "m".repeat(176));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_long_reply_message_is_cut_at_a_character_boundary() {
        let frame = Frame::Reply {
            seq: 1,
            digest: Digest([1; 32]),
            result: Err(ReplyError {
                code: ErrorCode::DESERIALIZE_FAILED,
                // One ASCII byte first: the 202 bytes of room end inside
                // a two-byte character.
                message: format!("x{}", "é".repeat(1000)),
            }),
        };
        let fitted = fit(frame, MIN_MAX_FRAME_BYTES);
        let bytes = fitted.encode(MIN_MAX_FRAME_BYTES).unwrap();
        assert_eq!(bytes.len(), MIN_MAX_FRAME_BYTES - 1);
        match fitted {
            Frame::Reply {
                result: Err(error), ..
            } => assert_eq!(error.message, format!("x{}", "é".repeat(100))),
            other => panic!("{other:?}"),
        }
    }
}
