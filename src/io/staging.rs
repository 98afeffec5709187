//! Staged payloads: envelopes in sealed anonymous memory files
//! (`memfd`s), passed to targets as descriptors (`specs/staging.md`).
//!
//! The parent creates one `memfd` per register operation
//! (`memfd_create` with `MFD_CLOEXEC | MFD_ALLOW_SEALING`, named
//! [`MEMFD_NAME`], which is only a label: nothing appears in any
//! directory), writes the envelope into it while hashing it (one pass),
//! then seals it with [`REQUIRED_SEALS`]: from then on no process can
//! write, grow, shrink or unseal it, whatever descriptor it holds. The
//! descriptor travels to each target with its Register control
//! (`SCM_RIGHTS`, `specs/wire.md`). A target checks the seals and the size
//! before it maps the file read-only ([`StagedView`]; a payload of at most
//! [`COPY_MAX_BYTES`] is read into the target's own memory instead),
//! verifies the digest over those bytes and deserializes from the same
//! bytes: the bytes it verified are the bytes it deserializes.
//!
//! The kernel frees the memory when the last descriptor and mapping are
//! gone: the parent's ([`StagedPayload`], dropped when every target in
//! scope answered or was lost), the targets' (dropped after the register),
//! and any still in flight in a socket (freed with the socket). No name
//! exists, so nothing can outlive its Worker by a crash, in any pid
//! namespace, and there is nothing to sweep.

use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use memmap2::Mmap;
use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use sha2::{Digest as _, Sha256};

use super::process::TrackedFd;
use crate::envelope::{header, HEADER_LEN};
use crate::error::ErrorCode;

/// The label of every staged payload's `memfd` (seen as
/// `/memfd:callreg-staged (deleted)` in `/proc/PID/fd`; not a name anyone
/// can open).
pub const MEMFD_NAME: &str = "callreg-staged";

/// The seals a staged payload carries before it leaves the parent, and that
/// a target requires before it trusts the bytes: no write (by `write` or a
/// writable shared mapping), no growing, no shrinking, no further change
/// of the seals.
pub const REQUIRED_SEALS: SealFlag = SealFlag::F_SEAL_SHRINK
    .union(SealFlag::F_SEAL_GROW)
    .union(SealFlag::F_SEAL_WRITE)
    .union(SealFlag::F_SEAL_SEAL);

/// Bytes copied (and hashed) per step while staging: large enough to
/// amortise the write call, small enough to stay in cache for the hash.
const CHUNK_BYTES: usize = 64 * 1024;

/// A failure to create, seal, check or map a staged payload.
#[derive(Debug, thiserror::Error)]
pub enum StagingError {
    /// An OS call failed.
    #[error("{operation} of a staged payload failed: {errno}")]
    Os {
        /// What was attempted (`"memfd_create"`, `"write"`, `"F_ADD_SEALS"`,
        /// `"F_GET_SEALS"`, `"pread"`, `"fstat"`, `"mmap"`).
        operation: &'static str,
        /// The OS error.
        errno: Errno,
    },
    /// The staged file's real size differs from the size the register
    /// control announced.
    #[error("the staged payload holds {actual} bytes, the control announced {expected}")]
    SizeMismatch {
        /// The size in the register control (bytes).
        expected: u64,
        /// The file's real size (bytes).
        actual: u64,
    },
    /// The descriptor does not carry every seal of [`REQUIRED_SEALS`]
    /// (another process could still change the bytes), or is not a sealable
    /// file at all.
    #[error("the staged payload is not sealed against change (seals {seals:#x}, need {:#x})", REQUIRED_SEALS.bits())]
    Unsealed {
        /// The seals found (`F_GET_SEALS`), or -1 for a file without seals.
        seals: i32,
    },
    /// The hashed range lies outside the bytes to stage.
    #[error("hashed range {start}..{end} is outside the {len} staged bytes")]
    BadRange {
        /// Range start (bytes).
        start: usize,
        /// Range end (bytes).
        end: usize,
        /// Length of the bytes to stage.
        len: usize,
    },
    /// The staged bytes are not a SPYC envelope ([`StagedPayload::adopt`]).
    #[error("the staged bytes are not an envelope: {0}")]
    Envelope(String),
}

impl StagingError {
    /// `ENVELOPE_INVALID` for a size mismatch, missing seals or bytes that
    /// are not an envelope (the bytes cannot be trusted to be the envelope
    /// that was staged), `IO_FAILED` otherwise.
    pub fn code(&self) -> ErrorCode {
        match self {
            StagingError::SizeMismatch { .. }
            | StagingError::Unsealed { .. }
            | StagingError::Envelope(_) => ErrorCode::ENVELOPE_INVALID,
            _ => ErrorCode::IO_FAILED,
        }
    }
}

fn os_error(operation: &'static str) -> impl FnOnce(Errno) -> StagingError {
    move |errno| StagingError::Os { operation, errno }
}

/// Adds the required seals from each CPU this thread may run on, in turn,
/// until one call succeeds or fails otherwise than `EBUSY`; the thread's
/// CPU affinity is restored after.
///
/// Why: `F_SEAL_WRITE` is refused with `EBUSY` while a page of the file
/// holds a reference other than the file's. A page just written holds one
/// while it waits in a per-CPU batch of the CPU that wrote it, and the
/// kernel drains only the batch of the CPU that asks to seal (then waits a
/// little, and gives up). A thread moved to another CPU between its writes
/// and its seal can so be refused; asking from every CPU drains every
/// batch.
fn seal_from_every_cpu(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    let this = nix::unistd::Pid::from_raw(0);
    let saved = sched_getaffinity(this)?;
    let mut sealed = Err(Errno::EBUSY);
    for cpu in 0..CpuSet::count() {
        if !saved.is_set(cpu).unwrap_or(false) {
            continue;
        }
        let mut only = CpuSet::new();
        if only.set(cpu).is_err() || sched_setaffinity(this, &only).is_err() {
            continue;
        }
        sealed = fcntl(fd, FcntlArg::F_ADD_SEALS(REQUIRED_SEALS)).map(drop);
        if sealed != Err(Errno::EBUSY) {
            break;
        }
    }
    let _ = sched_setaffinity(this, &saved);
    sealed
}

fn io_errno(e: &std::io::Error) -> Errno {
    Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}

/// A staged payload owned by the parent: a sealed `memfd` (a
/// [`TrackedFd`], so that a target forked meanwhile by any Worker closes
/// it even when its runtime keeps inherited descriptors). Dropping it
/// closes the parent's descriptor; the memory goes with the last one.
#[derive(Debug)]
pub struct StagedPayload {
    fd: TrackedFd,
    size: u64,
}

impl StagedPayload {
    /// Creates a sealed `memfd` holding exactly `bytes`, and returns it with
    /// the SHA-256 of `bytes[hashed]`, computed while copying (one pass over
    /// the bytes).
    ///
    /// `hashed` is the part of the envelope that identifies it: the
    /// serializer payload after the SPYC header (`specs/formats.md`).
    ///
    /// # Errors
    /// [`StagingError::BadRange`] for a range outside `bytes`;
    /// [`StagingError::Os`] when `memfd_create`, `write` or `F_ADD_SEALS`
    /// fails (nothing is left behind: the descriptor is closed).
    pub fn create(
        bytes: &[u8],
        hashed: Range<usize>,
    ) -> Result<(StagedPayload, [u8; 32]), StagingError> {
        if hashed.start > hashed.end || hashed.end > bytes.len() {
            return Err(StagingError::BadRange {
                start: hashed.start,
                end: hashed.end,
                len: bytes.len(),
            });
        }
        let fd = memfd_create(
            MEMFD_NAME,
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(os_error("memfd_create"))?;
        let mut file = File::from(fd);
        let mut hasher = Sha256::new();
        let mut offset = 0;
        for chunk in bytes.chunks(CHUNK_BYTES) {
            file.write_all(chunk)
                .map_err(|e| os_error("write")(io_errno(&e)))?;
            let chunk_range = offset..offset + chunk.len();
            let start = hashed.start.clamp(chunk_range.start, chunk_range.end);
            let end = hashed.end.clamp(chunk_range.start, chunk_range.end);
            hasher.update(&chunk[start - offset..end - offset]);
            offset += chunk.len();
        }
        Ok((
            StagedPayload::seal(file, bytes.len() as u64)?,
            hasher.finalize().into(),
        ))
    }

    /// Seals `file` (a `memfd` of `size` bytes made with
    /// `MFD_ALLOW_SEALING`) with [`REQUIRED_SEALS`].
    fn seal(file: File, size: u64) -> Result<StagedPayload, StagingError> {
        let fd = OwnedFd::from(file);
        match fcntl(&fd, FcntlArg::F_ADD_SEALS(REQUIRED_SEALS)) {
            Err(Errno::EBUSY) => seal_from_every_cpu(fd.as_fd()),
            sealed => sealed.map(drop),
        }
        .map_err(os_error("F_ADD_SEALS"))?;
        Ok(StagedPayload {
            fd: TrackedFd::new(fd),
            size,
        })
    }

    /// The sealed descriptor (sent with a register control).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The staged size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// A [`StagingWriter`] keeps at most this many bytes in its own memory;
/// past them it moves to a `memfd`, so that a large envelope is written
/// once, straight where targets read it (`specs/staging.md` step 1).
pub const SPILL_BYTES: usize = 1 << 20;

/// An envelope written in pieces, as a pickler writes its output: the
/// caller writes the serializer payload ([`StagingWriter::write`]), and
/// [`StagingWriter::finish`] puts the SPYC header before it. Up to
/// [`SPILL_BYTES`] the bytes stay in a buffer; past them they go to a
/// `memfd` (created then, the buffer moved into it once) and every later
/// write goes there directly, hashed on the way, so that a payload of
/// S bytes costs S bytes of memory in the parent, not two or three copies
/// (`specs/staging.md` step 1).
#[derive(Debug)]
pub struct StagingWriter {
    /// Header room and the payload so far, while no `memfd` exists.
    buffer: Vec<u8>,
    /// The `memfd` once the payload passed [`SPILL_BYTES`].
    file: Option<File>,
    /// SHA-256 of the payload so far.
    hasher: Sha256,
    payload_len: u64,
}

/// What a [`StagingWriter`] made.
#[derive(Debug)]
pub enum WrittenEnvelope {
    /// An envelope of at most [`SPILL_BYTES`] payload bytes: its bytes
    /// (header and payload).
    Bytes(Vec<u8>),
    /// A larger one, staged and sealed, with its payload's SHA-256.
    Staged {
        /// The sealed `memfd` holding the whole envelope.
        payload: StagedPayload,
        /// SHA-256 of the payload (after the header).
        payload_sha256: [u8; 32],
    },
}

impl Default for StagingWriter {
    fn default() -> Self {
        StagingWriter::new()
    }
}

impl StagingWriter {
    /// An empty writer: no `memfd` yet.
    pub fn new() -> StagingWriter {
        StagingWriter {
            buffer: vec![0; HEADER_LEN],
            file: None,
            hasher: Sha256::new(),
            payload_len: 0,
        }
    }

    /// Payload bytes written so far.
    pub fn payload_len(&self) -> u64 {
        self.payload_len
    }

    /// Appends `bytes` to the payload.
    ///
    /// # Errors
    /// [`StagingError::Os`] when `memfd_create` or `write` fails (e.g.
    /// `ENOMEM`, `ENOSPC` when memory runs out, [`StagingError::is_out_of_memory`]);
    /// the writer is then unusable (a later `finish` fails the same way).
    pub fn write(&mut self, bytes: &[u8]) -> Result<(), StagingError> {
        if self.file.is_none() && self.buffer.len() + bytes.len() > HEADER_LEN + SPILL_BYTES {
            let mut file = File::from(new_memfd()?);
            file.write_all(&self.buffer)
                .map_err(|e| os_error("write")(io_errno(&e)))?;
            self.buffer = Vec::new();
            self.file = Some(file);
        }
        match &mut self.file {
            Some(file) => file
                .write_all(bytes)
                .map_err(|e| os_error("write")(io_errno(&e)))?,
            None => self.buffer.extend_from_slice(bytes),
        }
        self.hasher.update(bytes);
        self.payload_len += bytes.len() as u64;
        Ok(())
    }

    /// Puts the header before the payload, and seals the `memfd` if there
    /// is one.
    ///
    /// # Errors
    /// [`StagingError::Os`] when writing the header or sealing fails.
    pub fn finish(mut self) -> Result<WrittenEnvelope, StagingError> {
        let header = header(self.payload_len);
        match self.file.take() {
            None => {
                self.buffer[..HEADER_LEN].copy_from_slice(&header);
                Ok(WrittenEnvelope::Bytes(self.buffer))
            }
            Some(file) => {
                use std::os::unix::fs::FileExt;
                file.write_all_at(&header, 0)
                    .map_err(|e| os_error("write")(io_errno(&e)))?;
                let size = HEADER_LEN as u64 + self.payload_len;
                Ok(WrittenEnvelope::Staged {
                    payload: StagedPayload::seal(file, size)?,
                    payload_sha256: self.hasher.finalize().into(),
                })
            }
        }
    }
}

/// A new, empty `memfd` that can be sealed (`MFD_CLOEXEC |
/// MFD_ALLOW_SEALING`, labelled [`MEMFD_NAME`]): where an envelope is
/// written to be staged ([`StagingWriter`], or a writer of another
/// language that hands it to [`StagedPayload::adopt`]).
///
/// # Errors
/// [`StagingError::Os`] when `memfd_create` fails.
pub fn new_memfd() -> Result<OwnedFd, StagingError> {
    memfd_create(
        MEMFD_NAME,
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .map_err(os_error("memfd_create"))
}

impl StagingError {
    /// Whether the OS refused memory for it (`ENOMEM`, `ENOSPC`, `EFBIG`):
    /// the caller may report it as out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            StagingError::Os {
                errno: Errno::ENOMEM | Errno::ENOSPC | Errno::EFBIG,
                ..
            }
        )
    }
}

impl StagedPayload {
    /// Stages the envelope a writer put in `fd` (a [`new_memfd`], written
    /// from offset 0, header included): seals it, then checks the envelope
    /// (`Envelope::parse`) and hashes its payload from a read-only mapping
    /// of the sealed bytes, so that what is hashed is what targets read.
    /// No copy of the bytes is made.
    ///
    /// # Errors
    /// Returns the staged payload and its envelope's descriptor (of either
    /// form, `specs/formats.md` §1, §1.1).
    ///
    /// # Errors
    /// [`StagingError::Os`] when `fstat`, sealing or mapping fails (e.g.
    /// `fd` is not a sealable `memfd`); [`StagingError::Envelope`] when
    /// the bytes are not an envelope.
    pub fn adopt(
        fd: OwnedFd,
    ) -> Result<(StagedPayload, crate::descriptor::PythonSerialized), StagingError> {
        StagedPayload::adopt_with(fd, None)
    }

    /// As [`StagedPayload::adopt`], for a writer that hashed the payload
    /// as it wrote it: `payload_sha256` is taken as the SHA-256 of the
    /// bytes after the header, and the payload is not read back (only
    /// the envelope's header, and an out-of-band envelope's table and
    /// footer, are checked). A wrong one names a digest the payload does
    /// not have: every target then refuses the register with
    /// `HASHID_DESCRIPTOR_MISMATCH` (`specs/staging.md` step 1).
    ///
    /// # Errors
    /// As [`StagedPayload::adopt`].
    pub fn adopt_hashed(
        fd: OwnedFd,
        payload_sha256: [u8; 32],
    ) -> Result<(StagedPayload, crate::descriptor::PythonSerialized), StagingError> {
        StagedPayload::adopt_with(fd, Some(payload_sha256))
    }

    fn adopt_with(
        fd: OwnedFd,
        payload_sha256: Option<[u8; 32]>,
    ) -> Result<(StagedPayload, crate::descriptor::PythonSerialized), StagingError> {
        let size = nix::sys::stat::fstat(&fd)
            .map_err(os_error("fstat"))?
            .st_size as u64;
        let staged = StagedPayload::seal(File::from(fd), size)?;
        // SAFETY: the file is sealed against writing, growing and
        // shrinking (just above): its bytes cannot change while mapped.
        let map =
            unsafe { Mmap::map(&staged.fd.as_fd()) }.map_err(|e| os_error("mmap")(io_errno(&e)))?;
        let envelope = crate::envelope::Envelope::parse(&map)
            .map_err(|e| StagingError::Envelope(e.to_string()))?;
        let descriptor = match payload_sha256 {
            Some(sha256) => crate::descriptor::PythonSerialized {
                payload_format_version: envelope.version(),
                serializer_id: envelope.serializer(),
                payload_sha256: crate::descriptor::Digest(sha256),
            },
            None => crate::descriptor::PythonSerialized::from_envelope(&envelope),
        };
        Ok((staged, descriptor))
    }

    /// The whole staged file read back into memory (the startup snapshot
    /// keeps an envelope registered before start as bytes, which every
    /// target inherits through `fork`).
    ///
    /// # Errors
    /// [`StagingError::Os`] when `pread` fails.
    pub fn read_all(&self) -> Result<Vec<u8>, StagingError> {
        use std::os::unix::fs::FileExt;
        let file = File::from(
            self.fd
                .as_fd()
                .try_clone_to_owned()
                .map_err(|e| os_error("dup")(io_errno(&e)))?,
        );
        let mut bytes = vec![0; usize::try_from(self.size).unwrap_or(usize::MAX)];
        file.read_exact_at(&mut bytes, 0)
            .map_err(|e| os_error("pread")(io_errno(&e)))?;
        Ok(bytes)
    }
}

/// Payloads of at most this many bytes are read into the target's own
/// memory rather than mapped: one `pread` costs less than `fstat`, `mmap`
/// (populating the pages) and `munmap`, and the copy is small.
pub const COPY_MAX_BYTES: u64 = 64 * 1024;

/// A target's view of a staged payload, taken only after the seals were
/// checked: a read-only mapping, or for at most [`COPY_MAX_BYTES`] a copy
/// read from the sealed file.
#[derive(Debug)]
pub struct StagedView {
    bytes: ViewBytes,
    /// The sealed file, kept open with the view: a runtime may map an
    /// out-of-band envelope's buffers from it (`specs/formats.md` §1.1).
    file: File,
}

/// Which file a [`StagedView`] is of: its device and inode numbers and its
/// status change time (seconds, nanoseconds). Two views with one identity
/// are of one sealed file, so of the same bytes: the inode numbers name
/// one file while it exists, and the time tells a file made after an
/// earlier one with that number was freed.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct FileIdentity {
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
    /// `st_ctime`, `st_ctime_nsec`.
    pub ctime: (i64, i64),
}

#[derive(Debug)]
enum ViewBytes {
    Empty,
    Copied(Vec<u8>),
    Mapped(Mmap),
}

impl StagedView {
    /// Checks that `fd` carries every seal of [`REQUIRED_SEALS`] and holds
    /// exactly `expected_size` bytes, then maps it read-only (or, for at
    /// most [`COPY_MAX_BYTES`], reads it). The descriptor is kept with the
    /// view ([`StagedView::file`]) and closed when it is dropped.
    ///
    /// # Errors
    /// [`StagingError::Unsealed`] when a seal is missing or `fd` is not a
    /// sealable file; [`StagingError::SizeMismatch`] when its size differs
    /// from `expected_size`; [`StagingError::Os`] when `pread`, `fstat` or
    /// `mmap` fails.
    pub fn open(fd: OwnedFd, expected_size: u64) -> Result<StagedView, StagingError> {
        let seals = match fcntl(&fd, FcntlArg::F_GET_SEALS) {
            Ok(seals) => seals,
            Err(Errno::EINVAL) => return Err(StagingError::Unsealed { seals: -1 }),
            Err(errno) => return Err(os_error("F_GET_SEALS")(errno)),
        };
        if !SealFlag::from_bits_truncate(seals).contains(REQUIRED_SEALS) {
            return Err(StagingError::Unsealed { seals });
        }
        let file = File::from(fd);
        if expected_size <= COPY_MAX_BYTES {
            return Self::read_small(file, expected_size);
        }
        let actual = file
            .metadata()
            .map_err(|e| os_error("fstat")(io_errno(&e)))?
            .len();
        if actual != expected_size {
            return Err(StagingError::SizeMismatch {
                expected: expected_size,
                actual,
            });
        }
        if actual == 0 {
            // mmap of zero bytes is EINVAL; an empty view is the same bytes.
            return Ok(StagedView {
                bytes: ViewBytes::Empty,
                file,
            });
        }
        let len = usize::try_from(actual).map_err(|_| os_error("mmap")(Errno::EFBIG))?;
        // SAFETY: the file is sealed against writes, growing and shrinking
        // (checked above; `F_SEAL_SEAL` forbids removing a seal), so the
        // mapped bytes cannot change and no access can fault for as long as
        // the mapping lives. It is mapped read-only. MAP_POPULATE: the
        // target reads every byte (digest, then the runtime).
        let map = unsafe { memmap2::MmapOptions::new().len(len).populate().map(&file) }
            .map_err(|e| os_error("mmap")(io_errno(&e)))?;
        Ok(StagedView {
            bytes: ViewBytes::Mapped(map),
            file,
        })
    }

    /// Reads a sealed file expected to hold `expected_size` bytes (at most
    /// [`COPY_MAX_BYTES`]): one byte more is asked for, so a longer file
    /// shows as one; a file that ends early shows by its short total.
    fn read_small(file: File, expected_size: u64) -> Result<StagedView, StagingError> {
        use std::os::unix::fs::FileExt;
        let expected = usize::try_from(expected_size).unwrap_or(usize::MAX);
        let mut bytes = vec![0u8; expected + 1];
        let mut got = 0;
        while got < bytes.len() {
            match file.read_at(&mut bytes[got..], got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(os_error("pread")(io_errno(&e))),
            }
        }
        if got != expected {
            let actual = match file.metadata() {
                Ok(meta) => meta.len(),
                Err(_) => got as u64,
            };
            return Err(StagingError::SizeMismatch {
                expected: expected_size,
                actual,
            });
        }
        bytes.truncate(expected);
        Ok(StagedView {
            bytes: if expected == 0 {
                ViewBytes::Empty
            } else {
                ViewBytes::Copied(bytes)
            },
            file,
        })
    }

    /// The staged bytes (exactly the staged size).
    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            ViewBytes::Empty => &[],
            ViewBytes::Copied(bytes) => bytes,
            ViewBytes::Mapped(map) => map,
        }
    }

    /// The sealed file the view was opened from (every seal checked).
    pub fn file(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.file.as_fd()
    }

    /// The staged file's identity ([`FileIdentity`]).
    ///
    /// # Errors
    /// The errno of `fstat`.
    pub fn identity(&self) -> Result<FileIdentity, Errno> {
        use std::os::unix::fs::MetadataExt;
        let meta = self.file.metadata().map_err(|e| io_errno(&e))?;
        Ok(FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        })
    }

    /// Whether the bytes are a mapping of the staged file (payloads over
    /// [`COPY_MAX_BYTES`]) rather than a copy.
    pub fn is_mapped(&self) -> bool {
        matches!(self.bytes, ViewBytes::Mapped(_))
    }
}

/// The descriptors of this process that are staged payloads (their
/// `/proc/self/fd` link names [`MEMFD_NAME`]), as numbers: tests check that
/// none is left after an operation.
///
/// # Errors
/// The IO error of reading `/proc/self/fd`.
pub fn open_payloads() -> std::io::Result<Vec<i32>> {
    payloads_of("self")
}

/// The descriptors of process `pid` (`"self"` or a number) that are staged
/// payloads; a process that is gone has none.
///
/// # Errors
/// The IO error of reading `/proc/PID/fd`, other than its absence.
pub fn payloads_of(pid: &str) -> std::io::Result<Vec<i32>> {
    let dir = match std::fs::read_dir(format!("/proc/{pid}/fd")) {
        Ok(dir) => dir,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let label = format!("/memfd:{MEMFD_NAME}");
    let mut found = Vec::new();
    for entry in dir.flatten() {
        let Ok(link) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if link.to_string_lossy().starts_with(&label) {
            if let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse().ok()) {
                found.push(fd);
            }
        }
    }
    found.sort_unstable();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn dup(staged: &StagedPayload) -> OwnedFd {
        staged.fd().try_clone_to_owned().unwrap()
    }

    #[test]
    fn a_small_written_envelope_is_its_encoded_bytes() {
        let mut writer = StagingWriter::new();
        writer.write(b"ab").unwrap();
        writer.write(b"").unwrap();
        writer.write(b"cde").unwrap();
        assert_eq!(writer.payload_len(), 5);
        let WrittenEnvelope::Bytes(bytes) = writer.finish().unwrap() else {
            panic!("staged although small")
        };
        assert_eq!(bytes, crate::envelope::encode(b"abcde"));
        // Exactly SPILL_BYTES stays in memory.
        let mut writer = StagingWriter::new();
        writer.write(&vec![1u8; SPILL_BYTES]).unwrap();
        assert!(
            matches!(writer.finish().unwrap(), WrittenEnvelope::Bytes(b) if b.len() == HEADER_LEN + SPILL_BYTES)
        );
    }

    #[test]
    fn a_large_written_envelope_is_staged_sealed_and_hashed_once() {
        let payload: Vec<u8> = (0..SPILL_BYTES + 70_001).map(|i| (i % 251) as u8).collect();
        let mut writer = StagingWriter::new();
        // In pieces that cross the spill point.
        for piece in payload.chunks(300_007) {
            writer.write(piece).unwrap();
        }
        let WrittenEnvelope::Staged {
            payload: staged,
            payload_sha256,
        } = writer.finish().unwrap()
        else {
            panic!("kept in memory although large")
        };
        let expected: [u8; 32] = Sha256::digest(&payload).into();
        assert_eq!(payload_sha256, expected);
        assert_eq!(staged.size(), (HEADER_LEN + payload.len()) as u64);
        assert_eq!(
            staged.read_all().unwrap(),
            crate::envelope::encode(&payload)
        );
        let seals = fcntl(staged.fd(), FcntlArg::F_GET_SEALS).unwrap();
        assert_eq!(
            SealFlag::from_bits_truncate(seals) & REQUIRED_SEALS,
            REQUIRED_SEALS
        );
        // The same bytes staged at once give the same staged file.
        let (again, sha) = StagedPayload::create(
            &crate::envelope::encode(&payload),
            HEADER_LEN..HEADER_LEN + payload.len(),
        )
        .unwrap();
        assert_eq!(
            (again.read_all().unwrap(), sha),
            (staged.read_all().unwrap(), expected)
        );
    }

    #[test]
    fn an_adopted_memfd_is_sealed_checked_and_hashed() {
        let payload = vec![9u8; 100_000];
        let mut file = File::from(new_memfd().unwrap());
        file.write_all(&crate::envelope::encode(&payload)).unwrap();
        let (staged, descriptor) = StagedPayload::adopt(OwnedFd::from(file)).unwrap();
        assert_eq!(
            descriptor.payload_sha256.0,
            <[u8; 32]>::from(Sha256::digest(&payload))
        );
        assert_eq!(descriptor.payload_format_version, 1);
        assert_eq!(staged.size(), (HEADER_LEN + payload.len()) as u64);
        let seals = fcntl(staged.fd(), FcntlArg::F_GET_SEALS).unwrap();
        assert_eq!(
            SealFlag::from_bits_truncate(seals) & REQUIRED_SEALS,
            REQUIRED_SEALS
        );
        // Not an envelope.
        let mut file = File::from(new_memfd().unwrap());
        file.write_all(b"not an envelope at all").unwrap();
        let e = StagedPayload::adopt(OwnedFd::from(file)).unwrap_err();
        assert_eq!(e.code(), ErrorCode::ENVELOPE_INVALID);
        assert_eq!(
            e.to_string(),
            "the staged bytes are not an envelope: ENVELOPE_INVALID: bad magic 6e6f7420 (expected 53505943, \"SPYC\")"
        );
        // Not a sealable file.
        let (read, _write) = nix::unistd::pipe().unwrap();
        let e = StagedPayload::adopt(read).unwrap_err();
        assert_eq!(e.code(), ErrorCode::IO_FAILED, "{e}");
    }

    #[test]
    fn out_of_memory_errors_are_told_apart() {
        for (errno, oom) in [
            (Errno::ENOMEM, true),
            (Errno::ENOSPC, true),
            (Errno::EFBIG, true),
            (Errno::EBADF, false),
        ] {
            let e = StagingError::Os {
                operation: "write",
                errno,
            };
            assert_eq!(e.is_out_of_memory(), oom, "{errno}");
        }
    }

    #[test]
    fn sealing_from_every_cpu_seals_and_restores_the_affinity() {
        use nix::sched::sched_getaffinity;
        let this = nix::unistd::Pid::from_raw(0);
        let before = sched_getaffinity(this).unwrap();
        let fd = memfd_create(
            MEMFD_NAME,
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .unwrap();
        let mut file = File::from(fd);
        file.write_all(&[7u8; 8192]).unwrap();
        let fd = OwnedFd::from(file);
        seal_from_every_cpu(fd.as_fd()).unwrap();
        let seals = fcntl(&fd, FcntlArg::F_GET_SEALS).unwrap();
        assert_eq!(
            SealFlag::from_bits_truncate(seals) & REQUIRED_SEALS,
            REQUIRED_SEALS
        );
        let after = sched_getaffinity(this).unwrap();
        let cpus = |set: &nix::sched::CpuSet| -> Vec<usize> {
            (0..nix::sched::CpuSet::count())
                .filter(|c| set.is_set(*c).unwrap())
                .collect()
        };
        assert_eq!(cpus(&after), cpus(&before));
        // Sealed already: a second attempt is refused for the seal seal,
        // not retried forever.
        assert_eq!(seal_from_every_cpu(fd.as_fd()), Err(Errno::EPERM));
        assert_eq!(cpus(&sched_getaffinity(this).unwrap()), cpus(&before));
    }

    #[test]
    fn create_sizes_exactly_hashes_the_range_and_seals() {
        let bytes: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let (staged, hash) = StagedPayload::create(&bytes, 16..bytes.len()).unwrap();
        let expected: [u8; 32] = Sha256::digest(&bytes[16..]).into();
        assert_eq!(hash, expected);
        assert_eq!(staged.size(), 200_000);
        let seals = fcntl(staged.fd(), FcntlArg::F_GET_SEALS).unwrap();
        assert_eq!(seals, REQUIRED_SEALS.bits());
        let view = StagedView::open(dup(&staged), 200_000).unwrap();
        assert_eq!(view.bytes(), &bytes[..]);
        assert!(view.is_mapped());
        assert!(open_payloads().unwrap().contains(&staged.fd().as_raw_fd()));
        drop(staged);
        // The view outlives every descriptor: the mapping stays valid.
        assert_eq!(view.bytes()[1000], bytes[1000]);
    }

    #[test]
    fn a_sealed_payload_refuses_every_change() {
        let (staged, _) = StagedPayload::create(b"0123456789", 0..10).unwrap();
        // Even through a new read-write open of the same file.
        let path = format!("/proc/self/fd/{}", staged.fd().as_raw_fd());
        let mut rw = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        assert_eq!(
            rw.write(b"x").unwrap_err().raw_os_error(),
            Some(libc::EPERM)
        );
        assert_eq!(rw.set_len(5).unwrap_err().raw_os_error(), Some(libc::EPERM));
        assert_eq!(
            rw.set_len(20).unwrap_err().raw_os_error(),
            Some(libc::EPERM)
        );
        // SAFETY: a writable shared mapping is requested only to see it
        // refused; nothing is written.
        let mapped = unsafe { memmap2::MmapMut::map_mut(&rw) };
        assert_eq!(mapped.unwrap_err().raw_os_error(), Some(libc::EPERM));
        assert_eq!(
            fcntl(staged.fd(), FcntlArg::F_ADD_SEALS(SealFlag::empty())),
            Err(Errno::EPERM)
        );
        let view = StagedView::open(dup(&staged), 10).unwrap();
        assert_eq!(view.bytes(), b"0123456789");
    }

    #[test]
    fn empty_range_and_empty_bytes() {
        let (staged, hash) = StagedPayload::create(b"", 0..0).unwrap();
        let expected: [u8; 32] = Sha256::digest(b"").into();
        assert_eq!(hash, expected);
        assert_eq!(StagedView::open(dup(&staged), 0).unwrap().bytes(), b"");
    }

    #[test]
    fn bad_range_is_refused_before_anything_is_created() {
        let err = StagedPayload::create(b"abc", 2..4).unwrap_err();
        assert!(matches!(
            err,
            StagingError::BadRange {
                start: 2,
                end: 4,
                len: 3
            }
        ));
    }

    #[test]
    fn open_checks_size_and_seals() {
        let (staged, _) = StagedPayload::create(b"0123456789", 0..10).unwrap();
        let err = StagedView::open(dup(&staged), 11).unwrap_err();
        assert!(matches!(
            err,
            StagingError::SizeMismatch {
                expected: 11,
                actual: 10,
            }
        ));
        assert_eq!(err.code(), ErrorCode::ENVELOPE_INVALID);
        // A file longer than announced, read (small) or mapped (large).
        assert!(matches!(
            StagedView::open(dup(&staged), 9).unwrap_err(),
            StagingError::SizeMismatch {
                expected: 9,
                actual: 10,
            }
        ));
        let big = vec![3u8; COPY_MAX_BYTES as usize + 1];
        let (large, _) = StagedPayload::create(&big, 0..big.len()).unwrap();
        let announced = COPY_MAX_BYTES;
        assert!(matches!(
            StagedView::open(dup(&large), announced).unwrap_err(),
            StagingError::SizeMismatch { expected, actual }
                if expected == announced && actual == announced + 1
        ));
        // At the limit the bytes are copied; one byte more, mapped.
        let (limit, _) = StagedPayload::create(&big[1..], 0..big.len() - 1).unwrap();
        let view = StagedView::open(dup(&limit), COPY_MAX_BYTES).unwrap();
        assert!(!view.is_mapped());
        assert_eq!(view.bytes(), &big[1..]);
        let view = StagedView::open(dup(&large), COPY_MAX_BYTES + 1).unwrap();
        assert!(view.is_mapped());
        assert_eq!(view.bytes(), &big[..]);
        // An unsealed memfd and a plain file are refused before mapping.
        let open = memfd_create("x", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING).unwrap();
        let err = StagedView::open(open, 0).unwrap_err();
        assert!(matches!(err, StagingError::Unsealed { seals: 0 }), "{err}");
        assert_eq!(err.code(), ErrorCode::ENVELOPE_INVALID);
        let plain = OwnedFd::from(File::open("/proc/self/stat").unwrap());
        assert!(matches!(
            StagedView::open(plain, 0),
            Err(StagingError::Unsealed { seals: -1 })
        ));
    }
}
