//! The target process: installs its startup snapshot, then serves control
//! frames on one thread and runs tasks on another (DESIGN.md §4.2, §5).
//!
//! The control thread reads frames from the control pipe in order and
//! drives the protocol's [`Target`] machine (through the [`SlotTable`]);
//! it carries out the machine's effects: it opens and verifies staged
//! payloads, deserializes through the runtime, and writes replies. A task
//! frame pins its slot on the control thread (frame order) and is handed to
//! the task thread, so a long task never delays a register into a timeout.
//! Both threads write whole frames to the reply pipe under one lock.
//!
//! The target ends (with `_exit`, from [`super::process`]) when the control
//! pipe reports EOF (the parent closed it or died), when a frame cannot be
//! decoded or is out of protocol ([`FRAME_EXIT_CODE`]), or when the reply
//! pipe is gone ([`REPLY_EXIT_CODE`]).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use super::failpoints::{self, ABRUPT_EXIT_CODE};
use super::process::TargetEnds;
use super::slots::{Effects, SlotTable};
use super::staging::StagedView;
use crate::descriptor::{python_serialized_digest, Digest};
use crate::envelope::Envelope;
use crate::error::ErrorCode;
use crate::protocol::{Failure, Seq, Slot, Target, TargetConfig, TargetEffect, TargetId};
use crate::runtime::{Runtime, RuntimeError, TaskEncoding};
use crate::wire::{Frame, FrameBuffer, ReplyError, TaskFailure, HEADER_BYTES};

/// Exit status: the runtime failed to start.
pub const START_EXIT_CODE: i32 = 103;
/// Exit status: the startup snapshot could not be installed (after a
/// [`Frame::Ready`] naming each entry's outcome).
pub const SNAPSHOT_EXIT_CODE: i32 = 104;
/// Exit status: a control frame could not be decoded or was out of protocol.
pub const FRAME_EXIT_CODE: i32 = 105;
/// Exit status: a reply could not be written (the parent is gone).
pub const REPLY_EXIT_CODE: i32 = 106;

/// Bytes read from the control pipe per `read` call.
const READ_CHUNK_BYTES: usize = 64 * 1024;

/// What a target inherits from the parent through `fork`.
pub struct TargetSetup<R: Runtime> {
    /// The runtime, started once in the target.
    pub runtime: Arc<R>,
    /// The startup snapshot: distinct digests with their refcounts, in
    /// digest order (as from the parent machine's `startup_snapshot`).
    pub snapshot: Vec<(Digest, u32)>,
    /// The envelope bytes of every snapshot digest (validated by the parent
    /// when it computed the digest).
    pub envelopes: BTreeMap<Digest, Arc<Vec<u8>>>,
    /// Slots per target.
    pub slot_capacity: u16,
    /// Maximum frame size in bytes, both directions.
    pub max_frame_bytes: usize,
}

/// Ends the target at once: a fault injected after a decision was made
/// (installed, or about to reply) cannot be turned into an error reply
/// without lying to the parent, so any `return(…)` there is a crash.
fn abrupt_exit() -> ! {
    // SAFETY: `_exit` ends the process without destructors: a crash.
    unsafe { libc::_exit(ABRUPT_EXIT_CODE) }
}

/// Writes whole frames to the reply pipe, from either thread.
struct ReplyWriter {
    pipe: Mutex<File>,
    max_frame_bytes: usize,
}

impl ReplyWriter {
    /// Sends `frame`, shortened to fit the maximum frame size if needed (a
    /// message is cut at a character boundary, an oversized task result is
    /// replaced by an error saying so). Ends the target if the pipe is gone.
    fn send(&self, frame: Frame) {
        if failpoints::hit(failpoints::TARGET_REPLY_DELAY).is_err() {
            abrupt_exit();
        }
        let bytes = match frame.encode(self.max_frame_bytes) {
            Ok(bytes) => bytes,
            Err(_) => match fit(frame, self.max_frame_bytes).encode(self.max_frame_bytes) {
                Ok(bytes) => bytes,
                // Unreachable for the frames a target sends: `fit` leaves
                // only fixed-size fields; end rather than send garbage.
                // SAFETY: see `abrupt_exit`.
                Err(_) => unsafe { libc::_exit(REPLY_EXIT_CODE) },
            },
        };
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
                        "the task's result of {} bytes does not fit in a frame of at most {max} bytes",
                        output.len()
                    ),
                },
                Err(failure) => failure,
            };
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

fn reply_error(failure: Failure) -> ReplyError {
    ReplyError {
        code: failure.code,
        message: failure.message,
    }
}

fn runtime_failure(error: RuntimeError) -> Failure {
    Failure::new(error.code, format!("{}: {}", error.kind, error.message))
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Deserializes `payload` through the runtime, honouring the
/// `target.deserialize` fail point; a panic in the runtime is a failure.
fn deserialize<R: Runtime>(runtime: &R, payload: &[u8]) -> Result<R::Callable, Failure> {
    if let Err(message) = failpoints::hit(failpoints::TARGET_DESERIALIZE) {
        return Err(Failure::new(ErrorCode::DESERIALIZE_FAILED, message));
    }
    match catch_unwind(AssertUnwindSafe(|| runtime.deserialize(payload))) {
        Ok(result) => result.map_err(runtime_failure),
        Err(panic) => Err(Failure::new(
            ErrorCode::DESERIALIZE_FAILED,
            format!(
                "the runtime panicked while deserializing: {}",
                panic_message(&*panic)
            ),
        )),
    }
}

/// Opens a staged payload read-only, validates the envelope against the
/// mapped size and recomputes its digest (DESIGN.md §4.2).
fn open_and_verify(name: &str, size: u64) -> Result<(StagedView, Digest), Failure> {
    let view = StagedView::open(name, size).map_err(|e| Failure::new(e.code(), e.to_string()))?;
    let digest = {
        let envelope =
            Envelope::parse(view.bytes()).map_err(|e| Failure::new(e.code(), e.to_string()))?;
        python_serialized_digest(&envelope)
    };
    Ok((view, digest))
}

/// One task handed from the control thread to the task thread.
struct Run<C> {
    seq: u64,
    digest: Digest,
    encoding: TaskEncoding,
    input: Vec<u8>,
    callable: crate::sync::Arc<C>,
}

struct Control<'a, R: Runtime> {
    runtime: &'a R,
    table: Arc<SlotTable<R::Callable>>,
    writer: Arc<ReplyWriter>,
    runs: mpsc::Sender<Run<R::Callable>>,
}

/// Runs a target until its control pipe closes; returns its exit status.
///
/// Order: start the runtime; install the startup snapshot (each entry
/// deserialized from the inherited envelope); send [`Frame::Ready`] with
/// every entry's outcome (and exit with [`SNAPSHOT_EXIT_CODE`] if any
/// failed); then serve frames.
pub fn run<R: Runtime>(ends: TargetEnds, setup: &TargetSetup<R>) -> i32 {
    let TargetEnds {
        index,
        control,
        reply,
    } = ends;
    let writer = Arc::new(ReplyWriter {
        pipe: Mutex::new(File::from(reply)),
        max_frame_bytes: setup.max_frame_bytes,
    });
    if setup.runtime.start().is_err() {
        return START_EXIT_CODE;
    }
    let config = TargetConfig {
        id: TargetId(u16::try_from(index).unwrap_or(u16::MAX)),
        slot_capacity: setup.slot_capacity,
    };
    let Some(table) = install_snapshot(config, setup, &writer) else {
        return SNAPSHOT_EXIT_CODE;
    };
    let table = Arc::new(table);
    let (runs, queue) = mpsc::channel::<Run<R::Callable>>();
    {
        let table = table.clone();
        let writer = writer.clone();
        let runtime = setup.runtime.clone();
        std::thread::spawn(move || run_tasks(&*runtime, &table, &writer, queue));
    }
    let control_thread = Control {
        runtime: &*setup.runtime,
        table,
        writer,
        runs,
    };
    // Never closed before the process ends: a parent that sees the pipe
    // close then always finds an exit status, not a target still exiting.
    let control = std::mem::ManuallyDrop::new(File::from(control));
    serve(&control, setup.max_frame_bytes, &control_thread)
}

fn install_snapshot<R: Runtime>(
    config: TargetConfig,
    setup: &TargetSetup<R>,
    writer: &ReplyWriter,
) -> Option<SlotTable<R::Callable>> {
    let pid = std::process::id();
    let entries: Vec<Digest> = setup
        .snapshot
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(d, _)| *d)
        .collect();
    let machine = match Target::new(config, &setup.snapshot) {
        Ok(machine) => machine,
        Err(error) => {
            let failure = ReplyError {
                code: error.code,
                message: error.message,
            };
            let snapshot = entries.iter().map(|d| (*d, Err(failure.clone()))).collect();
            writer.send(Frame::Ready { pid, snapshot });
            return None;
        }
    };
    let mut callables = Vec::with_capacity(entries.len());
    let mut outcomes = Vec::with_capacity(entries.len());
    for digest in entries {
        let result = install_one(setup, digest);
        outcomes.push((
            digest,
            result
                .as_ref()
                .map(|_| ())
                .map_err(|f| reply_error(f.clone())),
        ));
        if let Ok(callable) = result {
            callables.push(callable);
        }
    }
    let failed = outcomes.iter().any(|(_, r)| r.is_err());
    writer.send(Frame::Ready {
        pid,
        snapshot: outcomes,
    });
    (!failed).then(|| SlotTable::new(machine, callables))
}

fn install_one<R: Runtime>(setup: &TargetSetup<R>, digest: Digest) -> Result<R::Callable, Failure> {
    let bytes = setup.envelopes.get(&digest).ok_or_else(|| {
        Failure::new(
            ErrorCode::IO_FAILED,
            format!("no envelope was inherited for {digest}"),
        )
    })?;
    let envelope = Envelope::parse(bytes).map_err(|e| Failure::new(e.code(), e.to_string()))?;
    failpoints::hit(failpoints::TARGET_BEFORE_INSTALL)
        .map_err(|m| Failure::new(ErrorCode::IO_FAILED, m))?;
    let callable = deserialize(&*setup.runtime, envelope.payload())?;
    if failpoints::hit(failpoints::TARGET_AFTER_INSTALL).is_err() {
        abrupt_exit();
    }
    Ok(callable)
}

fn serve<R: Runtime>(mut control: &File, max_frame_bytes: usize, this: &Control<'_, R>) -> i32 {
    let Ok(mut buffer) = FrameBuffer::new(max_frame_bytes) else {
        return FRAME_EXIT_CODE;
    };
    let mut chunk = vec![0u8; READ_CHUNK_BYTES];
    loop {
        let n = match control.read(&mut chunk) {
            Ok(0) => return 0,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return 0,
        };
        buffer.extend(&chunk[..n]);
        loop {
            match buffer.next_frame() {
                Ok(Some(frame)) => {
                    if !this.handle(frame) {
                        return FRAME_EXIT_CODE;
                    }
                }
                Ok(None) => break,
                Err(_) => return FRAME_EXIT_CODE,
            }
        }
    }
}

impl<R: Runtime> Control<'_, R> {
    /// Handles one frame; `false` for a frame a target never receives.
    fn handle(&self, frame: Frame) -> bool {
        match frame {
            Frame::Register {
                seq,
                digest,
                staged_name,
                staged_size,
            } => {
                let opened = open_and_verify(&staged_name, staged_size);
                let verified = match (&opened, failpoints::hit(failpoints::TARGET_BEFORE_INSTALL)) {
                    (_, Err(message)) => Err(Failure::new(ErrorCode::IO_FAILED, message)),
                    (Ok((_, verified)), Ok(())) => Ok(*verified),
                    (Err(failure), Ok(())) => Err(failure.clone()),
                };
                let effects = self.table.on_register(Seq(seq), digest, verified);
                let view = opened.ok().map(|(view, _)| view);
                self.carry_out(effects, view.as_ref());
            }
            Frame::Unregister { seq, digest } => {
                if let Err(message) = failpoints::hit(failpoints::TARGET_BEFORE_UNREGISTER) {
                    // A target refusing the control changes nothing.
                    let result = Err(ReplyError {
                        code: ErrorCode::IO_FAILED,
                        message,
                    });
                    self.writer.send(Frame::Reply {
                        seq,
                        digest,
                        result,
                    });
                } else {
                    let effects = self.table.on_unregister(Seq(seq), digest);
                    self.carry_out(effects, None);
                }
            }
            Frame::Task {
                seq,
                digest,
                encoding,
                input,
            } => match self.table.begin_task(Seq(seq), digest) {
                Ok(callable) => {
                    let run = Run {
                        seq,
                        digest,
                        encoding,
                        input,
                        callable,
                    };
                    if self.runs.send(run).is_err() {
                        // The task thread is gone (it cannot panic: calls are
                        // caught); unpin and report.
                        let _ = self.table.end_task(Seq(seq));
                        self.task_failed(
                            seq,
                            digest,
                            ErrorCode::TASK_FAILED,
                            "the task thread ended",
                        );
                    }
                }
                Err(error) => self.task_failed(seq, digest, error.code, &error.message),
            },
            Frame::Inspect { seq } => {
                let (installed, tombstones) = self.table.table();
                let entries = installed
                    .into_iter()
                    .map(|(digest, refcount)| crate::wire::TableEntry { digest, refcount })
                    .collect();
                let tombstones = u32::try_from(tombstones).unwrap_or(u32::MAX);
                self.writer.send(Frame::Table {
                    seq,
                    tombstones,
                    entries,
                });
            }
            Frame::Reply { .. }
            | Frame::TaskResult { .. }
            | Frame::Ready { .. }
            | Frame::Table { .. } => {
                return false;
            }
        }
        true
    }

    fn task_failed(&self, seq: u64, digest: Digest, code: ErrorCode, message: &str) {
        self.writer.send(Frame::TaskResult {
            seq,
            digest,
            result: Err(TaskFailure {
                code,
                kind: String::new(),
                message: message.to_owned(),
            }),
        });
    }

    /// Carries out the machine's effects in order: replies are written
    /// (a register's OK passes `target.after_install` first); a
    /// deserialization runs from the staged view and its result goes back
    /// to the machine, whose new effects are carried out in turn.
    fn carry_out(&self, effects: Effects, view: Option<&StagedView>) {
        for effect in effects {
            match effect {
                TargetEffect::Reply(reply) => {
                    if reply.result.is_ok()
                        && view.is_some()
                        && failpoints::hit(failpoints::TARGET_AFTER_INSTALL).is_err()
                    {
                        abrupt_exit();
                    }
                    self.writer.send(Frame::Reply {
                        seq: reply.seq.0,
                        digest: reply.digest,
                        result: reply.result.map_err(reply_error),
                    });
                }
                TargetEffect::Deserialize { seq, slot, .. } => {
                    let more = self.deserialize_into(seq, slot, view);
                    self.carry_out(more, view);
                }
            }
        }
    }

    fn deserialize_into(&self, seq: Seq, slot: Slot, view: Option<&StagedView>) -> Effects {
        let result = match view.map(|v| Envelope::parse(v.bytes())) {
            Some(Ok(envelope)) => deserialize(self.runtime, envelope.payload()),
            // The machine asks to deserialize only after a verified open.
            Some(Err(e)) => Err(Failure::new(e.code(), e.to_string())),
            None => Err(Failure::new(
                ErrorCode::IO_FAILED,
                "no staged payload is open",
            )),
        };
        // Only a deserialization nobody waits for is refused; its callable
        // is dropped by the table and there is nothing to reply.
        self.table
            .on_deserialized(seq, slot, result)
            .unwrap_or_default()
    }
}

fn run_tasks<R: Runtime>(
    runtime: &R,
    table: &SlotTable<R::Callable>,
    writer: &ReplyWriter,
    queue: mpsc::Receiver<Run<R::Callable>>,
) {
    for run in queue {
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            runtime.call(&run.callable, run.encoding, &run.input)
        }));
        let result = match outcome {
            Ok(Ok(output)) => Ok(output),
            Ok(Err(error)) => Err(TaskFailure {
                code: error.code,
                kind: error.kind,
                message: error.message,
            }),
            Err(panic) => Err(TaskFailure {
                code: ErrorCode::TASK_FAILED,
                kind: "panic".to_owned(),
                message: panic_message(&*panic),
            }),
        };
        drop(run.callable);
        // The control thread began this run; ending it cannot fail.
        let _ = table.end_task(Seq(run.seq));
        writer.send(Frame::TaskResult {
            seq: run.seq,
            digest: run.digest,
            result,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
