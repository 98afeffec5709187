//! Wire frames between the parent and its targets (specs/design.md §3.3).
//!
//! Pure: no IO. Every frame is an 8-byte header followed by a body:
//!
//! | offset | size | field | rule |
//! |---|---|---|---|
//! | 0 | 1 | version (u8) | must be [`WIRE_VERSION`] (9) |
//! | 1 | 1 | kind (u8) | a [`FrameKind`] value |
//! | 2 | 2 | flags (u16) | 0, or [`FLAG_TASK_EXCEPTION`] on a failed task result |
//! | 4 | 4 | body length (u32, bytes) | `8 + body length <= maximum frame size` |
//! | 8 | body length | body | the kind's fields, in order, nothing after |
//!
//! All integers are little-endian. Inside a body, a digest is its 32 raw
//! bytes, a string or a byte array is a `u32` length (bytes) followed by the
//! bytes (strings must be UTF-8), and a status is a `u16`: 0 for OK, else an
//! [`ErrorCode`] wire value. Field lists per kind are documented on
//! [`Frame`]'s variants.
//!
//! Checks, in this order: the header's version, kind and flags; the declared
//! size against the maximum (before any byte of the body is awaited or
//! allocated); then the body's fields, each length against the bytes that
//! remain, and no trailing bytes. Decoding never panics and never allocates
//! more than the frame's own size, which is bounded by the maximum.
//!
//! No frame carries a slot (specs/design.md §4.4 invariant 9): slots stay inside
//! the target; frames name callables by digest only.

use crate::descriptor::Digest;
use crate::error::ErrorCode;
use crate::protocol::ControlPhase;

/// The only wire version this implementation reads and writes. Version 9
/// added the target's [`Frame::Started`] report; version 8
/// added the parent's [`Frame::Verify`] control; version 7
/// added the phase of the control an [`Frame::Alive`] reports (queued or
/// running); version 6
/// added the target's [`Frame::StartFailed`] report; version 5
/// added the parent's [`Frame::Cancel`] control; version 4
/// added the target's [`Frame::Alive`] report; version 3 replaced the register control's staged shm name by a sealed descriptor
/// passed beside the frame (`specs/staging.md`); version 2 added the
/// register control's metadata field. Frames of versions 1 to 8 are
/// refused.
pub const WIRE_VERSION: u8 = 9;

/// Header flag of a [`Frame::TaskResult`] with an error status whose
/// failure carries a serialized exception ([`TaskFailure::exception`]):
/// a byte array after the message. Set exactly when that field is
/// non-empty; every other frame, and a task result without it, has flags 0,
/// so frames without an exception are the same bytes as before the flag
/// existed.
pub const FLAG_TASK_EXCEPTION: u16 = 1;

/// Size of a frame header in bytes.
pub const HEADER_BYTES: usize = 8;

/// The default maximum size of one frame, header included: 16 MiB.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 16 * 1024 * 1024;

/// The smallest maximum frame size a decoder or encoder accepts (bytes): a
/// header plus room for the largest fixed-size body (a register reply with
/// an empty message), so that every kind of frame can be carried.
pub const MIN_MAX_FRAME_BYTES: usize = 256;

/// How a task's input and result are encoded (task and task result frames).
///
/// Its `u8` value is the task frame's encoding field.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[repr(u8)]
pub enum TaskEncoding {
    /// Input: a JSON object `{"args": [...], "kwargs": {...}}` (UTF-8 bytes);
    /// result: the call's return value as JSON.
    Json = 1,
    /// Input: pickled `(args_tuple, kwargs_dict)`; result: the pickled
    /// return value. Decoded only in the target.
    Pickle = 2,
}

impl TaskEncoding {
    /// The encoding for a wire value, or `None` for an unknown value.
    pub fn from_u8(value: u8) -> Option<TaskEncoding> {
        match value {
            1 => Some(TaskEncoding::Json),
            2 => Some(TaskEncoding::Pickle),
            _ => None,
        }
    }
}

/// The kind byte of a frame header.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[repr(u8)]
pub enum FrameKind {
    /// Parent → target: [`Frame::Register`].
    Register = 1,
    /// Parent → target: [`Frame::Unregister`].
    Unregister = 2,
    /// Parent → target: [`Frame::Task`].
    Task = 3,
    /// Parent → target: [`Frame::Inspect`].
    Inspect = 4,
    /// Parent → target: [`Frame::Cancel`].
    Cancel = 5,
    /// Parent → target: [`Frame::Verify`].
    Verify = 6,
    /// Target → parent: [`Frame::Reply`].
    Reply = 16,
    /// Target → parent: [`Frame::TaskResult`].
    TaskResult = 17,
    /// Target → parent: [`Frame::Ready`].
    Ready = 18,
    /// Target → parent: [`Frame::Table`].
    Table = 19,
    /// Target → parent: [`Frame::Alive`].
    Alive = 20,
    /// Target → parent: [`Frame::StartFailed`].
    StartFailed = 21,
    /// Target → parent: [`Frame::Started`].
    Started = 22,
}

impl FrameKind {
    /// The kind for a header byte, or `None` for an unknown byte.
    pub fn from_u8(value: u8) -> Option<FrameKind> {
        Some(match value {
            1 => FrameKind::Register,
            2 => FrameKind::Unregister,
            3 => FrameKind::Task,
            4 => FrameKind::Inspect,
            5 => FrameKind::Cancel,
            6 => FrameKind::Verify,
            16 => FrameKind::Reply,
            17 => FrameKind::TaskResult,
            18 => FrameKind::Ready,
            19 => FrameKind::Table,
            20 => FrameKind::Alive,
            21 => FrameKind::StartFailed,
            22 => FrameKind::Started,
            _ => return None,
        })
    }
}

/// An error reported in a reply: a typed code plus the full UTF-8 message
/// (no length cap other than the maximum frame size).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct ReplyError {
    /// The failure's code.
    pub code: ErrorCode,
    /// The full message.
    pub message: String,
}

/// A task failure reported in a task result.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct TaskFailure {
    /// `TASK_FAILED`, `DIGEST_NOT_INSTALLED` or a more specific code.
    pub code: ErrorCode,
    /// The runtime's name for the failure (e.g. a Python exception type).
    pub kind: String,
    /// The full message (for Python: ending with the traceback's last lines).
    pub message: String,
    /// The runtime's serialized form of the failure (e.g. a pickled
    /// exception), or empty; a non-empty one is flagged in the header
    /// ([`FLAG_TASK_EXCEPTION`]) and carried after the message.
    pub exception: Vec<u8>,
}

/// One row of a target's reported table ([`Frame::Table`]): never a slot.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct TableEntry {
    /// The installed digest.
    pub digest: Digest,
    /// Its refcount (number of registrations the target holds for it).
    pub refcount: u32,
}

/// A frame: a control frame (parent → target) or a reply (target → parent).
///
/// Body fields, in wire order, are listed on each variant.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum Frame {
    /// Register control (specs/design.md §4.2). Body: `u64 seq`, digest,
    /// `u64` staged size in bytes, string metadata (the registration's
    /// callable metadata as JSON, `specs/metadata.md`; empty for none).
    /// The staged payload itself is a sealed descriptor sent with the
    /// frame's first byte (`SCM_RIGHTS`, `specs/wire.md`); the frame does
    /// not name it.
    Register {
        /// The operation's sequence number.
        seq: u64,
        /// The digest the parent computed; the target recomputes it.
        digest: Digest,
        /// The staged payload's exact size in bytes.
        staged_size: u64,
        /// The registration's callable metadata as compact JSON
        /// (`CallableMetadata::to_json`), or empty when it has none. Not
        /// part of the hashid; the wire does not parse it (the target does).
        metadata: String,
    },
    /// Digest-owned unregister control (specs/design.md §4.2). Body: `u64 seq`,
    /// digest.
    Unregister {
        /// The operation's sequence number.
        seq: u64,
        /// The digest whose refcount to decrement.
        digest: Digest,
    },
    /// Task frame. Body: `u64 seq`, digest, `u8` encoding
    /// ([`TaskEncoding`]), byte array input.
    Task {
        /// The task's sequence number.
        seq: u64,
        /// The callable to run, resolved to a slot by the target.
        digest: Digest,
        /// How `input` and the result are encoded.
        encoding: TaskEncoding,
        /// The encoded arguments.
        input: Vec<u8>,
    },
    /// Verify control (`specs/staging.md` step 3, `specs/protocol.md`
    /// §2.8): the staged payload of a register that will come to this target
    /// once its probe has confirmed. The target may check the payload's
    /// seals and size and recompute its digest now, so that the register
    /// finds that work done. It changes nothing else, owes no answer, and a
    /// target that ignores it or fails it is correct. Body: digest (the one
    /// the parent computed), `u64` staged size in bytes; the payload is a
    /// sealed descriptor sent with the frame's first byte, as for
    /// [`Frame::Register`].
    Verify {
        /// The digest the coming register will name.
        digest: Digest,
        /// The staged payload's exact size in bytes.
        staged_size: u64,
    },
    /// Cancel control (`specs/protocol.md` §2.11): cancel task `seq` of
    /// `digest` if it has not started. Answered by a [`Frame::Reply`]
    /// echoing the task's seq and digest: OK (cancelled: it never runs and
    /// sends no result) or `TASK_RUNNING`. Body: `u64 seq`, digest.
    Cancel {
        /// The task's sequence number.
        seq: u64,
        /// The task's digest.
        digest: Digest,
    },
    /// Asks the target for its table (tests and diagnostics). Body:
    /// `u64 seq`.
    Inspect {
        /// The request's sequence number, echoed by [`Frame::Table`].
        seq: u64,
    },
    /// Reply to a register or unregister control. Body: `u64 seq`, digest,
    /// `u16` status, string message (empty when the status is OK).
    Reply {
        /// The control's sequence number.
        seq: u64,
        /// The control's digest.
        digest: Digest,
        /// OK, or the typed error with its full message.
        result: Result<(), ReplyError>,
    },
    /// Result of a task frame. Body: `u64 seq`, digest, `u16` status, then
    /// for OK a byte array output, else a string kind and a string message.
    TaskResult {
        /// The task's sequence number.
        seq: u64,
        /// The task's digest.
        digest: Digest,
        /// The encoded result, or the failure.
        result: Result<Vec<u8>, TaskFailure>,
    },
    /// Sent once by a target after it installed its startup snapshot.
    /// Body: `u32 pid`, `u32 count`, then per snapshot entry: digest,
    /// `u16` status, string message.
    Ready {
        /// The target's process id.
        pid: u32,
        /// One outcome per startup snapshot entry, in snapshot order.
        snapshot: Vec<(Digest, Result<(), ReplyError>)>,
    },
    /// The target's table. Body: `u64 seq`, `u32 tombstones` (slots
    /// tombstoned but still pinned by a run), `u32 count`, then per entry:
    /// digest, `u32 refcount`.
    Table {
        /// The [`Frame::Inspect`] sequence number.
        seq: u64,
        /// Number of tombstoned slots not yet freed.
        tombstones: u32,
        /// Installed digests with their refcounts, in digest order.
        entries: Vec<TableEntry>,
    },
    /// The target is alive and holds the register or unregister control
    /// `seq` (cleanups are unregisters) unanswered: it sends one on
    /// receipt and then periodically while the control is queued or
    /// running (`specs/protocol.md` §2.7), saying which (§2.8: a probe
    /// fenced at its bound is evidence against its digest only if it was
    /// running). Body: `u64 seq`, `u8 phase` ([`ControlPhase`]: 0 queued,
    /// 1 running; any other value is refused).
    Alive {
        /// The control's sequence number.
        seq: u64,
        /// Whether its install has begun.
        phase: ControlPhase,
    },
    /// The target's task thread starts running task `seq`
    /// (`specs/protocol.md` §2.12, §2.15): sent, and written to the
    /// socket, before any of the task's code runs, so a process lost
    /// without having sent one never ran the task. Body: `u64 seq`.
    Started {
        /// The task's sequence number.
        seq: u64,
    },
    /// The target's runtime could not start (an initializer or a setup
    /// raised, say): sent instead of [`Frame::Ready`], as the target's last
    /// frame before it exits. Body: string kind (the runtime's name for
    /// the failure, e.g. a Python exception type), string message (for
    /// Python: with the traceback's lines).
    StartFailed {
        /// The runtime's name for the failure.
        kind: String,
        /// The full message.
        message: String,
    },
}

/// Why bytes are not a valid frame. Every variant is reported as
/// [`ErrorCode::FRAME_INVALID`] ([`WireError::code`]).
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum WireError {
    /// The header's version is not [`WIRE_VERSION`].
    #[error("unsupported wire version {0} (expected {WIRE_VERSION})")]
    Version(u8),
    /// The header's kind byte names no [`FrameKind`].
    #[error("unknown frame kind {0}")]
    Kind(u8),
    /// The header's flags are not 0 (or, for a failed task result, not 0
    /// or [`FLAG_TASK_EXCEPTION`]).
    #[error("frame flags {0:#06x} are not allowed for this frame")]
    Flags(u16),
    /// A task result flagged [`FLAG_TASK_EXCEPTION`] with an empty exception
    /// field (not canonical: an empty one is sent unflagged).
    #[error("a flagged task failure carries an empty exception")]
    EmptyException,
    /// The frame (header included) is larger than the maximum frame size.
    #[error("frame of {size} bytes exceeds the maximum frame size of {max} bytes")]
    TooLarge {
        /// The frame's size in bytes, header included.
        size: u64,
        /// The maximum frame size in bytes.
        max: usize,
    },
    /// A field's declared length runs past the end of the body.
    #[error("frame body truncated: {field} needs {needed} bytes, {available} remain")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Bytes the field needs.
        needed: u64,
        /// Bytes left in the body.
        available: usize,
    },
    /// Bytes remain in the body after its last field.
    #[error("{0} trailing bytes after the frame's last field")]
    Trailing(usize),
    /// A string field is not UTF-8.
    #[error("{0} is not valid UTF-8")]
    Utf8(&'static str),
    /// A status is neither 0 nor an [`ErrorCode`] wire value.
    #[error("unknown status {0}")]
    Status(u16),
    /// A task frame's encoding names no [`TaskEncoding`].
    #[error("unknown task encoding {0}")]
    Encoding(u8),
    /// An alive report's phase names no [`ControlPhase`].
    #[error("unknown control phase {0}")]
    Phase(u8),
    /// An OK status followed by a non-empty message.
    #[error("an OK status carries a message")]
    OkWithMessage,
    /// A maximum frame size below [`MIN_MAX_FRAME_BYTES`] was configured.
    #[error("maximum frame size {0} is below the minimum of {MIN_MAX_FRAME_BYTES} bytes")]
    MaxTooSmall(usize),
}

impl WireError {
    /// The code every wire error is reported with: `FRAME_INVALID`.
    pub fn code(&self) -> ErrorCode {
        ErrorCode::FRAME_INVALID
    }
}

/// Outcome of [`decode`] on a byte prefix.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Decoded {
    /// A whole frame, and how many bytes of the input it used.
    Frame(Frame, usize),
    /// The input holds only the start of a frame; at least this many bytes
    /// in total are needed before a decode can succeed.
    Incomplete(usize),
}

/// Decodes the frame at the start of `bytes`.
///
/// Returns [`Decoded::Incomplete`] while the header or body is partial; the
/// header is checked as soon as it is whole, so an oversized or garbled
/// frame is reported without waiting for its body.
///
/// # Errors
/// A [`WireError`] for a bad header, a size over `max_frame_bytes`, or a
/// malformed body. The stream cannot be resynchronised after an error.
pub fn decode(bytes: &[u8], max_frame_bytes: usize) -> Result<Decoded, WireError> {
    if bytes.len() < HEADER_BYTES {
        return Ok(Decoded::Incomplete(HEADER_BYTES));
    }
    let (kind, flags, body_len) = parse_header(&bytes[..HEADER_BYTES], max_frame_bytes)?;
    let total = HEADER_BYTES + body_len;
    if bytes.len() < total {
        return Ok(Decoded::Incomplete(total));
    }
    let frame = decode_body(kind, flags, &bytes[HEADER_BYTES..total])?;
    Ok(Decoded::Frame(frame, total))
}

fn parse_header(
    header: &[u8],
    max_frame_bytes: usize,
) -> Result<(FrameKind, u16, usize), WireError> {
    let mut r = Reader { rest: header };
    let version = r.u8("version")?;
    let kind = r.u8("kind")?;
    let flags = r.u16("flags")?;
    let body_len = r.u32("body length")?;
    if version != WIRE_VERSION {
        return Err(WireError::Version(version));
    }
    let kind = FrameKind::from_u8(kind).ok_or(WireError::Kind(kind))?;
    // Only a task result may set a flag, and only FLAG_TASK_EXCEPTION (its
    // status is checked with the body).
    let allowed = if kind == FrameKind::TaskResult {
        FLAG_TASK_EXCEPTION
    } else {
        0
    };
    if flags & !allowed != 0 {
        return Err(WireError::Flags(flags));
    }
    let size = HEADER_BYTES as u64 + u64::from(body_len);
    if size > max_frame_bytes as u64 {
        return Err(WireError::TooLarge {
            size,
            max: max_frame_bytes,
        });
    }
    // Fits in usize: it is at most max_frame_bytes.
    Ok((kind, flags, body_len as usize))
}

fn decode_body(kind: FrameKind, flags: u16, body: &[u8]) -> Result<Frame, WireError> {
    let mut r = Reader { rest: body };
    let frame = match kind {
        FrameKind::Register => Frame::Register {
            seq: r.u64("seq")?,
            digest: r.digest()?,
            staged_size: r.u64("staged size")?,
            metadata: r.string("metadata")?,
        },
        FrameKind::Unregister => Frame::Unregister {
            seq: r.u64("seq")?,
            digest: r.digest()?,
        },
        FrameKind::Cancel => Frame::Cancel {
            seq: r.u64("seq")?,
            digest: r.digest()?,
        },
        FrameKind::Verify => Frame::Verify {
            digest: r.digest()?,
            staged_size: r.u64("staged size")?,
        },
        FrameKind::Task => {
            let seq = r.u64("seq")?;
            let digest = r.digest()?;
            let raw = r.u8("encoding")?;
            let encoding = TaskEncoding::from_u8(raw).ok_or(WireError::Encoding(raw))?;
            let input = r.bytes("input")?.to_vec();
            Frame::Task {
                seq,
                digest,
                encoding,
                input,
            }
        }
        FrameKind::Inspect => Frame::Inspect { seq: r.u64("seq")? },
        FrameKind::Reply => Frame::Reply {
            seq: r.u64("seq")?,
            digest: r.digest()?,
            result: r.reply_result()?,
        },
        FrameKind::TaskResult => {
            let seq = r.u64("seq")?;
            let digest = r.digest()?;
            let result = match r.status()? {
                None if flags != 0 => return Err(WireError::Flags(flags)),
                None => Ok(r.bytes("output")?.to_vec()),
                Some(code) => Err(TaskFailure {
                    code,
                    kind: r.string("failure kind")?,
                    message: r.string("message")?,
                    exception: if flags & FLAG_TASK_EXCEPTION != 0 {
                        let exception = r.bytes("exception")?;
                        if exception.is_empty() {
                            return Err(WireError::EmptyException);
                        }
                        exception.to_vec()
                    } else {
                        Vec::new()
                    },
                }),
            };
            Frame::TaskResult {
                seq,
                digest,
                result,
            }
        }
        FrameKind::Ready => {
            let pid = r.u32("pid")?;
            let count = r.u32("snapshot count")?;
            // Each entry needs at least 32 + 2 + 4 bytes: bound the
            // reservation by what the body can hold, not by `count`.
            let mut snapshot = Vec::with_capacity(bounded_capacity(count, r.rest.len(), 38));
            for _ in 0..count {
                snapshot.push((r.digest()?, r.reply_result()?));
            }
            Frame::Ready { pid, snapshot }
        }
        FrameKind::Table => {
            let seq = r.u64("seq")?;
            let tombstones = r.u32("tombstones")?;
            let count = r.u32("entry count")?;
            let mut entries = Vec::with_capacity(bounded_capacity(count, r.rest.len(), 36));
            for _ in 0..count {
                entries.push(TableEntry {
                    digest: r.digest()?,
                    refcount: r.u32("refcount")?,
                });
            }
            Frame::Table {
                seq,
                tombstones,
                entries,
            }
        }
        FrameKind::Alive => {
            let seq = r.u64("seq")?;
            let phase = r.u8("phase")?;
            Frame::Alive {
                seq,
                phase: ControlPhase::from_u8(phase).ok_or(WireError::Phase(phase))?,
            }
        }
        FrameKind::StartFailed => Frame::StartFailed {
            kind: r.string("failure kind")?,
            message: r.string("message")?,
        },
        FrameKind::Started => Frame::Started { seq: r.u64("seq")? },
    };
    if !r.rest.is_empty() {
        return Err(WireError::Trailing(r.rest.len()));
    }
    Ok(frame)
}

fn bounded_capacity(count: u32, remaining: usize, entry_bytes: usize) -> usize {
    (count as usize).min(remaining / entry_bytes)
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, field: &'static str, n: u64) -> Result<&'a [u8], WireError> {
        if n > self.rest.len() as u64 {
            return Err(WireError::Truncated {
                field,
                needed: n,
                available: self.rest.len(),
            });
        }
        let (head, tail) = self.rest.split_at(n as usize);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(field, N as u64)?);
        Ok(out)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(field)?[0])
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    fn digest(&mut self) -> Result<Digest, WireError> {
        Ok(Digest(self.array("digest")?))
    }

    fn bytes(&mut self, field: &'static str) -> Result<&'a [u8], WireError> {
        let len = self.u32(field)?;
        self.take(field, u64::from(len))
    }

    fn string(&mut self, field: &'static str) -> Result<String, WireError> {
        let raw = self.bytes(field)?;
        std::str::from_utf8(raw)
            .map(str::to_owned)
            .map_err(|_| WireError::Utf8(field))
    }

    /// `None` for OK (0), else the error code.
    fn status(&mut self) -> Result<Option<ErrorCode>, WireError> {
        match self.u16("status")? {
            0 => Ok(None),
            v => ErrorCode::from_u16(v).map(Some).ok_or(WireError::Status(v)),
        }
    }

    fn reply_result(&mut self) -> Result<Result<(), ReplyError>, WireError> {
        let status = self.status()?;
        let message = self.string("message")?;
        match status {
            // Keeps the encoding canonical: one byte string per frame.
            None if !message.is_empty() => Err(WireError::OkWithMessage),
            None => Ok(Ok(())),
            Some(code) => Ok(Err(ReplyError { code, message })),
        }
    }
}

impl Frame {
    /// The frame's kind byte.
    pub fn kind(&self) -> FrameKind {
        match self {
            Frame::Register { .. } => FrameKind::Register,
            Frame::Unregister { .. } => FrameKind::Unregister,
            Frame::Cancel { .. } => FrameKind::Cancel,
            Frame::Verify { .. } => FrameKind::Verify,
            Frame::Task { .. } => FrameKind::Task,
            Frame::Inspect { .. } => FrameKind::Inspect,
            Frame::Reply { .. } => FrameKind::Reply,
            Frame::TaskResult { .. } => FrameKind::TaskResult,
            Frame::Ready { .. } => FrameKind::Ready,
            Frame::Table { .. } => FrameKind::Table,
            Frame::Alive { .. } => FrameKind::Alive,
            Frame::StartFailed { .. } => FrameKind::StartFailed,
            Frame::Started { .. } => FrameKind::Started,
        }
    }

    /// Appends the encoded frame (header and body) to `out`.
    ///
    /// # Errors
    /// [`WireError::TooLarge`] when the frame would exceed `max_frame_bytes`
    /// (so a peer with the same maximum never rejects it), or a field longer
    /// than `u32::MAX` bytes; `out` is then left unchanged.
    pub fn encode_into(&self, out: &mut Vec<u8>, max_frame_bytes: usize) -> Result<(), WireError> {
        let start = out.len();
        let flags = match self {
            Frame::TaskResult {
                result: Err(failure),
                ..
            } if !failure.exception.is_empty() => FLAG_TASK_EXCEPTION,
            _ => 0,
        };
        out.extend_from_slice(&[WIRE_VERSION, self.kind() as u8]);
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&[0, 0, 0, 0]);
        let result = self.encode_body(out);
        let body_len = (out.len() - start - HEADER_BYTES) as u64;
        let size = HEADER_BYTES as u64 + body_len;
        if result.is_err() || size > max_frame_bytes as u64 || body_len > u64::from(u32::MAX) {
            out.truncate(start);
            return Err(WireError::TooLarge {
                size,
                max: max_frame_bytes,
            });
        }
        out[start + 4..start + 8].copy_from_slice(&(body_len as u32).to_le_bytes());
        Ok(())
    }

    /// The encoded frame as a new vector.
    ///
    /// # Errors
    /// As [`Frame::encode_into`].
    pub fn encode(&self, max_frame_bytes: usize) -> Result<Vec<u8>, WireError> {
        let mut out = Vec::new();
        self.encode_into(&mut out, max_frame_bytes)?;
        Ok(out)
    }

    fn encode_body(&self, out: &mut Vec<u8>) -> Result<(), ()> {
        match self {
            Frame::Register {
                seq,
                digest,
                staged_size,
                metadata,
            } => {
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&digest.0);
                out.extend_from_slice(&staged_size.to_le_bytes());
                put_bytes(out, metadata.as_bytes())?;
            }
            Frame::Unregister { seq, digest } | Frame::Cancel { seq, digest } => {
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&digest.0);
            }
            Frame::Verify {
                digest,
                staged_size,
            } => {
                out.extend_from_slice(&digest.0);
                out.extend_from_slice(&staged_size.to_le_bytes());
            }
            Frame::Task {
                seq,
                digest,
                encoding,
                input,
            } => {
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&digest.0);
                out.push(*encoding as u8);
                put_bytes(out, input)?;
            }
            Frame::Inspect { seq } | Frame::Started { seq } => {
                out.extend_from_slice(&seq.to_le_bytes())
            }
            Frame::Alive { seq, phase } => {
                out.extend_from_slice(&seq.to_le_bytes());
                out.push(*phase as u8);
            }
            Frame::Reply {
                seq,
                digest,
                result,
            } => {
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&digest.0);
                put_reply_result(out, result)?;
            }
            Frame::TaskResult {
                seq,
                digest,
                result,
            } => {
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&digest.0);
                match result {
                    Ok(output) => {
                        out.extend_from_slice(&0u16.to_le_bytes());
                        put_bytes(out, output)?;
                    }
                    Err(failure) => {
                        out.extend_from_slice(&failure.code.as_u16().to_le_bytes());
                        put_bytes(out, failure.kind.as_bytes())?;
                        put_bytes(out, failure.message.as_bytes())?;
                        if !failure.exception.is_empty() {
                            put_bytes(out, &failure.exception)?;
                        }
                    }
                }
            }
            Frame::StartFailed { kind, message } => {
                put_bytes(out, kind.as_bytes())?;
                put_bytes(out, message.as_bytes())?;
            }
            Frame::Ready { pid, snapshot } => {
                out.extend_from_slice(&pid.to_le_bytes());
                put_count(out, snapshot.len())?;
                for (digest, result) in snapshot {
                    out.extend_from_slice(&digest.0);
                    put_reply_result(out, result)?;
                }
            }
            Frame::Table {
                seq,
                tombstones,
                entries,
            } => {
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&tombstones.to_le_bytes());
                put_count(out, entries.len())?;
                for entry in entries {
                    out.extend_from_slice(&entry.digest.0);
                    out.extend_from_slice(&entry.refcount.to_le_bytes());
                }
            }
        }
        Ok(())
    }
}

fn put_count(out: &mut Vec<u8>, count: usize) -> Result<(), ()> {
    let count = u32::try_from(count).map_err(|_| ())?;
    out.extend_from_slice(&count.to_le_bytes());
    Ok(())
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) -> Result<(), ()> {
    put_count(out, bytes.len())?;
    out.extend_from_slice(bytes);
    Ok(())
}

fn put_reply_result(out: &mut Vec<u8>, result: &Result<(), ReplyError>) -> Result<(), ()> {
    match result {
        Ok(()) => {
            out.extend_from_slice(&0u16.to_le_bytes());
            put_bytes(out, b"")
        }
        Err(e) => {
            out.extend_from_slice(&e.code.as_u16().to_le_bytes());
            put_bytes(out, e.message.as_bytes())
        }
    }
}

/// An incremental decoder over a byte stream (one pipe), for a reader that
/// receives bytes in arbitrary pieces (non-blocking reads).
///
/// Holds at most one partial frame: bytes are appended with
/// [`FrameBuffer::extend`] and whole frames taken with
/// [`FrameBuffer::next_frame`]. After an error the stream is poisoned:
/// every later call returns the same error.
#[derive(Debug)]
pub struct FrameBuffer {
    buffer: Vec<u8>,
    max_frame_bytes: usize,
    poisoned: Option<WireError>,
}

impl FrameBuffer {
    /// A decoder accepting frames up to `max_frame_bytes` (header included).
    ///
    /// # Errors
    /// [`WireError::MaxTooSmall`] for a maximum below [`MIN_MAX_FRAME_BYTES`].
    pub fn new(max_frame_bytes: usize) -> Result<FrameBuffer, WireError> {
        if max_frame_bytes < MIN_MAX_FRAME_BYTES {
            return Err(WireError::MaxTooSmall(max_frame_bytes));
        }
        Ok(FrameBuffer {
            buffer: Vec::new(),
            max_frame_bytes,
            poisoned: None,
        })
    }

    /// Appends received bytes. Callers read in bounded chunks and call
    /// [`FrameBuffer::next_frame`] after each, so the buffer never holds
    /// more than one maximum frame plus one chunk.
    pub fn extend(&mut self, bytes: &[u8]) {
        if self.poisoned.is_none() {
            self.buffer.extend_from_slice(bytes);
        }
    }

    /// Bytes received and not yet consumed by a whole frame.
    pub fn pending_bytes(&self) -> usize {
        self.buffer.len()
    }

    /// Takes the next whole frame, or `Ok(None)` when more bytes are needed.
    ///
    /// # Errors
    /// The [`WireError`] of the first malformed frame, again on every later
    /// call (the stream cannot be resynchronised).
    pub fn next_frame(&mut self) -> Result<Option<Frame>, WireError> {
        if let Some(err) = &self.poisoned {
            return Err(err.clone());
        }
        match decode(&self.buffer, self.max_frame_bytes) {
            Ok(Decoded::Frame(frame, used)) => {
                self.buffer.drain(..used);
                Ok(Some(frame))
            }
            Ok(Decoded::Incomplete(_)) => Ok(None),
            Err(err) => {
                self.buffer = Vec::new();
                self.poisoned = Some(err.clone());
                Err(err)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MAX: usize = 1 << 20;

    fn digest_strategy() -> impl Strategy<Value = Digest> {
        any::<[u8; 32]>().prop_map(Digest)
    }

    fn code_strategy() -> impl Strategy<Value = ErrorCode> {
        proptest::sample::select(ErrorCode::ALL)
    }

    fn reply_result_strategy() -> impl Strategy<Value = Result<(), ReplyError>> {
        prop_oneof![
            Just(Ok(())),
            (code_strategy(), ".{0,300}")
                .prop_map(|(code, message)| Err(ReplyError { code, message })),
        ]
    }

    fn frame_strategy() -> impl Strategy<Value = Frame> {
        let bytes = || proptest::collection::vec(any::<u8>(), 0..600);
        prop_oneof![
            (
                any::<u64>(),
                digest_strategy(),
                any::<u64>(),
                prop_oneof![Just(String::new()), ".{1,200}"]
            )
                .prop_map(|(seq, digest, staged_size, metadata)| {
                    Frame::Register {
                        seq,
                        digest,
                        staged_size,
                        metadata,
                    }
                }),
            (any::<u64>(), digest_strategy())
                .prop_map(|(seq, digest)| Frame::Unregister { seq, digest }),
            (any::<u64>(), digest_strategy())
                .prop_map(|(seq, digest)| Frame::Cancel { seq, digest }),
            (digest_strategy(), any::<u64>()).prop_map(|(digest, staged_size)| Frame::Verify {
                digest,
                staged_size
            }),
            (any::<u64>(), digest_strategy(), any::<bool>(), bytes()).prop_map(
                |(seq, digest, json, input)| Frame::Task {
                    seq,
                    digest,
                    encoding: if json {
                        TaskEncoding::Json
                    } else {
                        TaskEncoding::Pickle
                    },
                    input
                }
            ),
            any::<u64>().prop_map(|seq| Frame::Inspect { seq }),
            (any::<u64>(), digest_strategy(), reply_result_strategy()).prop_map(
                |(seq, digest, result)| Frame::Reply {
                    seq,
                    digest,
                    result
                }
            ),
            (
                any::<u64>(),
                digest_strategy(),
                prop_oneof![
                    bytes().prop_map(Ok),
                    (
                        code_strategy(),
                        ".{0,40}",
                        ".{0,300}",
                        proptest::collection::vec(any::<u8>(), 0..40)
                    )
                        .prop_map(|(code, kind, message, exception)| Err(
                            TaskFailure {
                                code,
                                kind,
                                message,
                                exception,
                            }
                        )),
                ]
            )
                .prop_map(|(seq, digest, result)| Frame::TaskResult {
                    seq,
                    digest,
                    result
                }),
            (
                any::<u32>(),
                proptest::collection::vec((digest_strategy(), reply_result_strategy()), 0..8)
            )
                .prop_map(|(pid, snapshot)| Frame::Ready { pid, snapshot }),
            (
                any::<u64>(),
                any::<u32>(),
                proptest::collection::vec(
                    (digest_strategy(), any::<u32>())
                        .prop_map(|(digest, refcount)| TableEntry { digest, refcount }),
                    0..8
                )
            )
                .prop_map(|(seq, tombstones, entries)| Frame::Table {
                    seq,
                    tombstones,
                    entries
                }),
            (any::<u64>(), any::<bool>()).prop_map(|(seq, running)| Frame::Alive {
                seq,
                phase: if running {
                    ControlPhase::Running
                } else {
                    ControlPhase::Queued
                }
            }),
            (".*", ".*").prop_map(|(kind, message)| Frame::StartFailed { kind, message }),
            any::<u64>().prop_map(|seq| Frame::Started { seq }),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(frame in frame_strategy()) {
            let bytes = frame.encode(MAX).unwrap();
            prop_assert_eq!(decode(&bytes, MAX), Ok(Decoded::Frame(frame, bytes.len())));
        }

        #[test]
        fn round_trip_in_pieces(frames in proptest::collection::vec(frame_strategy(), 1..6), piece in 1usize..50) {
            let mut stream = Vec::new();
            for f in &frames {
                f.encode_into(&mut stream, MAX).unwrap();
            }
            let mut buffer = FrameBuffer::new(MAX).unwrap();
            let mut got = Vec::new();
            for chunk in stream.chunks(piece) {
                buffer.extend(chunk);
                while let Some(f) = buffer.next_frame().unwrap() {
                    got.push(f);
                }
            }
            prop_assert_eq!(got, frames);
            prop_assert_eq!(buffer.pending_bytes(), 0);
        }

        #[test]
        fn every_strict_prefix_is_incomplete(frame in frame_strategy()) {
            let bytes = frame.encode(MAX).unwrap();
            for cut in 0..bytes.len() {
                let expected = if cut < HEADER_BYTES { HEADER_BYTES } else { bytes.len() };
                prop_assert_eq!(decode(&bytes[..cut], MAX), Ok(Decoded::Incomplete(expected)));
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = decode(&bytes, 300);
        }

        #[test]
        fn mutated_frames_never_panic(frame in frame_strategy(), index in any::<usize>(), value in any::<u8>()) {
            let mut bytes = frame.encode(MAX).unwrap();
            let i = index % bytes.len();
            bytes[i] = value;
            let _ = decode(&bytes, MAX);
        }
    }

    fn header(version: u8, kind: u8, flags: u16, body_len: u32) -> Vec<u8> {
        let mut h = vec![version, kind];
        h.extend_from_slice(&flags.to_le_bytes());
        h.extend_from_slice(&body_len.to_le_bytes());
        h
    }

    #[test]
    fn header_errors_in_check_order() {
        assert_eq!(
            decode(&header(1, 99, 1, 0), MAX),
            Err(WireError::Version(1))
        );
        assert_eq!(
            decode(&header(WIRE_VERSION, 99, 1, 0), MAX),
            Err(WireError::Kind(99))
        );
        assert_eq!(
            decode(&header(WIRE_VERSION, 4, 1, 0), MAX),
            Err(WireError::Flags(1))
        );
    }

    #[test]
    fn a_start_report_is_its_seq_alone_and_a_version_8_peer_is_refused() {
        let started = Frame::Started { seq: 0x0102 };
        let mut expected = header(9, 22, 0, 8);
        expected.extend_from_slice(&[2, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(started.encode(MAX).unwrap(), expected);
        assert_eq!(
            decode(&expected, MAX),
            Ok(Decoded::Frame(started, expected.len()))
        );
        expected[0] = 8;
        assert_eq!(decode(&expected, MAX), Err(WireError::Version(8)));
        let mut short = header(9, 22, 0, 4);
        short.extend_from_slice(&[2, 1, 0, 0]);
        assert!(matches!(
            decode(&short, MAX),
            Err(WireError::Truncated { field: "seq", .. })
        ));
    }

    #[test]
    fn an_alive_report_says_whether_its_control_is_queued_or_running() {
        let queued = Frame::Alive {
            seq: 0x0102,
            phase: ControlPhase::Queued,
        };
        let running = Frame::Alive {
            seq: 0x0102,
            phase: ControlPhase::Running,
        };
        let mut expected = header(9, 20, 0, 9);
        expected.extend_from_slice(&[2, 1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(queued.encode(MAX).unwrap(), expected);
        expected[16] = 1;
        assert_eq!(running.encode(MAX).unwrap(), expected);
        assert_eq!(
            decode(&expected, MAX),
            Ok(Decoded::Frame(running, expected.len()))
        );
        // Any other phase byte is refused; a version 6 report (no phase
        // byte) is refused at its header.
        expected[16] = 2;
        assert_eq!(decode(&expected, MAX), Err(WireError::Phase(2)));
        let mut old = header(6, 20, 0, 8);
        old.extend_from_slice(&[2, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(decode(&old, MAX), Err(WireError::Version(6)));
        let mut short = header(9, 20, 0, 8);
        short.extend_from_slice(&[2, 1, 0, 0, 0, 0, 0, 0]);
        assert!(matches!(
            decode(&short, MAX),
            Err(WireError::Truncated { field: "phase", .. })
        ));
    }

    #[test]
    fn a_task_failure_carries_its_exception_behind_the_flag() {
        let failed = |exception: &[u8]| Frame::TaskResult {
            seq: 5,
            digest: Digest([7; 32]),
            result: Err(TaskFailure {
                code: ErrorCode::TASK_FAILED,
                kind: "ValueError".into(),
                message: "bad".into(),
                exception: exception.to_vec(),
            }),
        };
        let plain = failed(b"").encode(MAX).unwrap();
        let with = failed(b"\x80\x05exc").encode(MAX).unwrap();
        // Without an exception: flags 0, the bytes of a frame from before
        // the flag existed. With one: flag 1 and the bytes appended.
        assert_eq!(&plain[2..4], &[0, 0]);
        assert_eq!(&with[2..4], &FLAG_TASK_EXCEPTION.to_le_bytes());
        assert_eq!(with.len(), plain.len() + 4 + 5);
        assert_eq!(&with[8..plain.len()], &plain[8..]);
        assert_eq!(
            decode(&with, MAX),
            Ok(Decoded::Frame(failed(b"\x80\x05exc"), with.len()))
        );
        // The flag with an empty exception is not canonical.
        let mut empty = plain.clone();
        empty[2] = 1;
        empty.extend_from_slice(&0u32.to_le_bytes());
        let body_len = u32::try_from(empty.len() - HEADER_BYTES).unwrap();
        empty[4..8].copy_from_slice(&body_len.to_le_bytes());
        assert_eq!(decode(&empty, MAX), Err(WireError::EmptyException));
        // The flag on an OK task result, or on any other kind, is refused.
        let ok = Frame::TaskResult {
            seq: 5,
            digest: Digest([7; 32]),
            result: Ok(b"1".to_vec()),
        };
        let mut ok = ok.encode(MAX).unwrap();
        ok[2] = 1;
        assert_eq!(decode(&ok, MAX), Err(WireError::Flags(1)));
        let mut reply = Frame::Inspect { seq: 1 }.encode(MAX).unwrap();
        reply[2] = 1;
        assert_eq!(decode(&reply, MAX), Err(WireError::Flags(1)));
        // A flagged frame without the field is truncated.
        let mut cut = plain;
        cut[2] = 1;
        assert!(matches!(
            decode(&cut, MAX),
            Err(WireError::Truncated {
                field: "exception",
                ..
            })
        ));
    }

    #[test]
    fn oversized_frame_rejected_from_its_header_alone() {
        let h = header(WIRE_VERSION, 3, 0, u32::MAX);
        assert_eq!(
            decode(&h, MAX),
            Err(WireError::TooLarge {
                size: 8 + u64::from(u32::MAX),
                max: MAX
            })
        );
        // Exactly at the maximum is allowed (and awaits its body).
        let h = header(WIRE_VERSION, 3, 0, (MAX - 8) as u32);
        assert_eq!(decode(&h, MAX), Ok(Decoded::Incomplete(MAX)));
    }

    #[test]
    fn encode_refuses_frames_over_the_maximum() {
        let frame = Frame::Task {
            seq: 1,
            digest: Digest([7; 32]),
            encoding: TaskEncoding::Json,
            input: vec![0; 300],
        };
        let mut out = vec![9];
        assert_eq!(
            frame.encode_into(&mut out, 256),
            Err(WireError::TooLarge {
                size: 8 + 8 + 32 + 1 + 4 + 300,
                max: 256
            })
        );
        assert_eq!(out, vec![9]);
    }

    #[test]
    fn length_past_the_body_is_truncated_not_allocated() {
        // An unregister body one byte short.
        let mut bytes = header(WIRE_VERSION, 2, 0, 39);
        bytes.extend_from_slice(&[0; 39]);
        assert_eq!(
            decode(&bytes, MAX),
            Err(WireError::Truncated {
                field: "digest",
                needed: 32,
                available: 31
            })
        );
        // A table claiming u32::MAX entries in a 16-byte body.
        let mut bytes = header(WIRE_VERSION, 19, 0, 16);
        bytes.extend_from_slice(&[0; 12]);
        bytes.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            decode(&bytes, MAX),
            Err(WireError::Truncated {
                field: "digest",
                needed: 32,
                available: 0
            })
        );
    }

    #[test]
    fn body_field_errors() {
        let ok = Frame::Reply {
            seq: 5,
            digest: Digest([1; 32]),
            result: Ok(()),
        }
        .encode(MAX)
        .unwrap();
        // Unknown status.
        let mut bad = ok.clone();
        bad[8 + 8 + 32..8 + 8 + 32 + 2].copy_from_slice(&999u16.to_le_bytes());
        assert_eq!(decode(&bad, MAX), Err(WireError::Status(999)));
        // Trailing byte after the last field.
        let mut bad = ok.clone();
        bad.push(0);
        bad[4..8].copy_from_slice(&((ok.len() - 8 + 1) as u32).to_le_bytes());
        assert_eq!(decode(&bad, MAX), Err(WireError::Trailing(1)));
        // Invalid UTF-8 in the message.
        let frame = Frame::Reply {
            seq: 5,
            digest: Digest([1; 32]),
            result: Err(ReplyError {
                code: ErrorCode::DESERIALIZE_FAILED,
                message: "ab".into(),
            }),
        };
        let mut bad = frame.encode(MAX).unwrap();
        let n = bad.len();
        bad[n - 1] = 0xff;
        assert_eq!(decode(&bad, MAX), Err(WireError::Utf8("message")));
        // OK with a message.
        let mut bad = ok.clone();
        bad.push(b'x');
        let n = bad.len();
        bad[n - 5..n - 1].copy_from_slice(&1u32.to_le_bytes());
        bad[4..8].copy_from_slice(&((n - 8) as u32).to_le_bytes());
        assert_eq!(decode(&bad, MAX), Err(WireError::OkWithMessage));
        // Unknown task encoding.
        let mut bad = Frame::Task {
            seq: 1,
            digest: Digest([0; 32]),
            encoding: TaskEncoding::Pickle,
            input: vec![],
        }
        .encode(MAX)
        .unwrap();
        bad[8 + 8 + 32] = 3;
        assert_eq!(decode(&bad, MAX), Err(WireError::Encoding(3)));
    }

    #[test]
    fn long_messages_are_carried_whole() {
        let message = "é".repeat(10_000);
        let frame = Frame::Reply {
            seq: 1,
            digest: Digest([3; 32]),
            result: Err(ReplyError {
                code: ErrorCode::DESERIALIZE_FAILED,
                message: message.clone(),
            }),
        };
        let bytes = frame.encode(MAX).unwrap();
        assert_eq!(decode(&bytes, MAX), Ok(Decoded::Frame(frame, bytes.len())));
    }

    #[test]
    fn frame_buffer_is_poisoned_after_an_error() {
        let mut buffer = FrameBuffer::new(MAX).unwrap();
        buffer.extend(&header(WIRE_VERSION, 200, 0, 0));
        assert_eq!(buffer.next_frame(), Err(WireError::Kind(200)));
        buffer.extend(&Frame::Inspect { seq: 1 }.encode(MAX).unwrap());
        assert_eq!(buffer.next_frame(), Err(WireError::Kind(200)));
        assert_eq!(buffer.pending_bytes(), 0);
    }

    #[test]
    fn frame_buffer_rejects_a_tiny_maximum() {
        assert_eq!(
            FrameBuffer::new(255).unwrap_err(),
            WireError::MaxTooSmall(255)
        );
    }

    #[test]
    fn known_encoding_of_a_register_with_metadata() {
        let bytes = Frame::Register {
            seq: 7,
            digest: Digest([0xcd; 32]),
            staged_size: 9,
            metadata: r#"{"name":"f"}"#.into(),
        }
        .encode(MAX)
        .unwrap();
        let mut expected = vec![9, 1, 0, 0, 64, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0];
        expected.extend_from_slice(&[0xcd; 32]);
        expected.extend_from_slice(&[9, 0, 0, 0, 0, 0, 0, 0]);
        expected.extend_from_slice(&[12, 0, 0, 0]);
        expected.extend_from_slice(br#"{"name":"f"}"#);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn known_encoding_of_a_start_failure() {
        let bytes = Frame::StartFailed {
            kind: "E".to_owned(),
            message: "no".to_owned(),
        }
        .encode(MAX)
        .unwrap();
        let expected = vec![
            9, 21, 0, 0, 11, 0, 0, 0, 1, 0, 0, 0, b'E', 2, 0, 0, 0, b'n', b'o',
        ];
        assert_eq!(bytes, expected);
    }

    #[test]
    fn known_encoding_of_a_verify_and_a_version_7_frame_is_refused() {
        let verify = Frame::Verify {
            digest: Digest([0xef; 32]),
            staged_size: 0x0203,
        };
        let bytes = verify.encode(MAX).unwrap();
        let mut expected = vec![9, 6, 0, 0, 40, 0, 0, 0];
        expected.extend_from_slice(&[0xef; 32]);
        expected.extend_from_slice(&[3, 2, 0, 0, 0, 0, 0, 0]);
        assert_eq!(bytes, expected);
        assert_eq!(
            decode(&expected, MAX),
            Ok(Decoded::Frame(verify, expected.len()))
        );
        expected[0] = 7;
        assert_eq!(decode(&expected, MAX), Err(WireError::Version(7)));
    }

    #[test]
    fn known_encoding_of_an_unregister() {
        let bytes = Frame::Unregister {
            seq: 0x0102,
            digest: Digest([0xab; 32]),
        }
        .encode(MAX)
        .unwrap();
        let mut expected = vec![9, 2, 0, 0, 40, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 0];
        expected.extend_from_slice(&[0xab; 32]);
        assert_eq!(bytes, expected);
    }
}
