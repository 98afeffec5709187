//! Registering and unregistering through a [`Worker`]: envelopes as
//! bytes, as a writer's output or as a sealed `memfd`, before start (into
//! the startup snapshot) and after (staged, then the machine's register,
//! `specs/protocol.md` §2.3, §2.8), and giving up on a register
//! ([`Worker::release_when_registered`]).

use std::sync::Arc;

use super::pending::{completed, Awaited};
use super::{
    lifecycle_error, metadata_identity, push, OperationError, PendingOperation, Request, Worker,
};
use crate::descriptor::{python_serialized_digest, Digest, PythonSerialized};
use crate::envelope::{Envelope, HEADER_LEN};
use crate::error::{Error, ErrorCode, OperationKind};
use crate::io::handoff;
#[cfg(doc)]
use crate::io::staging::StagingWriter;
use crate::io::staging::{StagedPayload, StagingError, WrittenEnvelope};
use crate::metadata::CallableMetadata;
use crate::protocol::{Handle, Lifecycle, Namespace};
use crate::runtime::Runtime;
use crate::wire::HEADER_BYTES;

impl<R: Runtime> Worker<R> {
    fn envelope_error(e: crate::envelope::EnvelopeError) -> OperationError {
        OperationError::new(
            Error::new(e.code(), OperationKind::Register, e.message())
                .with_namespace(Namespace::LocalPython),
        )
    }

    /// Registers an envelope (SPYC, specs/design.md §3.1) and waits for the
    /// handle. Before start: adds it to the startup snapshot. After start:
    /// stages it and installs it at every live target; the handle is
    /// returned only when every target in scope confirmed (invariant 1).
    ///
    /// # Errors
    /// `ENVELOPE_INVALID` (and the other envelope codes) for bad bytes;
    /// `LOCAL_SLOT_EXHAUSTED` before start for a new digest when the startup
    /// snapshot already fills the slot capacity of a target (the protocol's
    /// `Parent::register_before_start`);
    /// `IO_FAILED` when staging fails; `LIFECYCLE_INVALID` once closed;
    /// `REGISTER_CLEANUP_UNCERTAIN` for an uncertain digest;
    /// `NO_LIVE_TARGET`; `REGISTER_PARTIAL_FAILURE` with every target's
    /// outcome when a target failed (rolled back); `REGISTER_POISONED`
    /// when installing the callable killed the target that tried it first
    /// (`WorkerBuilder::probe_first`), naming that target and how it died,
    /// and for every later register of it (nothing is sent then).
    pub fn register(&self, envelope: &[u8]) -> Result<Handle, OperationError> {
        self.register_async(envelope)?.wait()
    }

    /// Registers an envelope with its callable metadata (/// `specs/metadata.md`) and waits for the handle; `None` is
    /// [`Worker::register`]. The metadata is not part of the hashid: it
    /// travels as JSON in the register control (`specs/wire.md`), and each
    /// target checks it (versions, deps, executor) before it deserializes,
    /// then runs its hooks around each task. Before start it goes into the
    /// startup snapshot with the envelope. The parent only reads its JSON
    /// and the hook hashids; it never deserializes anything.
    ///
    /// A digest is installed once per target; a later registration of a
    /// digest a target already holds only adds a reference. While a digest
    /// is registered it has one metadata: a register of it with other
    /// metadata (or none where it has some) is refused with
    /// `METADATA_CONFLICT` (`specs/protocol.md` §2.10).
    ///
    /// # Errors
    /// As [`Worker::register`]; `METADATA_INVALID` naming the hashid when a
    /// `call_before` / `call_after` hook's hashid has no live handle in
    /// `LOCAL_PYTHON` (checked before the control is broadcast; nothing is
    /// sent then); `FRAME_INVALID` when the metadata's JSON does not fit in
    /// one register control; `REGISTER_PARTIAL_FAILURE` with each target's
    /// outcome when a target refused it (e.g. `PYTHON_VERSION_MISMATCH`,
    /// `DEPS_UNSATISFIED`, `EXECUTOR_UNKNOWN` in the outcome's failure).
    pub fn register_with_metadata(
        &self,
        envelope: &[u8],
        metadata: Option<&CallableMetadata>,
    ) -> Result<Handle, OperationError> {
        self.register_with_metadata_async(envelope, metadata)?
            .wait()
    }

    /// Starts a register with metadata and returns at once with a pending
    /// operation (complete already before start).
    ///
    /// # Errors
    /// As [`Worker::register_with_metadata`], for the failures found before
    /// any target is involved.
    pub fn register_with_metadata_async(
        &self,
        envelope: &[u8],
        metadata: Option<&CallableMetadata>,
    ) -> Result<PendingOperation<Handle>, OperationError> {
        self.register_inner(envelope, metadata)
    }

    /// Starts a register and returns at once with a pending operation
    /// (complete already before start).
    ///
    /// # Errors
    /// As [`Worker::register`], for the failures found before any target is
    /// involved (bad envelope, staging, lifecycle).
    pub fn register_async(
        &self,
        envelope: &[u8],
    ) -> Result<PendingOperation<Handle>, OperationError> {
        self.register_inner(envelope, None)
    }

    fn register_inner(
        &self,
        envelope: &[u8],
        metadata: Option<&CallableMetadata>,
    ) -> Result<PendingOperation<Handle>, OperationError> {
        self.owned(OperationKind::Register)
            .map_err(OperationError::new)?;
        let parsed = Envelope::parse(envelope).map_err(Self::envelope_error)?;
        if let Some(metadata) = metadata {
            self.check_metadata_fits(metadata)?;
        }
        let mut core = self.shared.lock();
        match core.machine.lifecycle() {
            Lifecycle::New => {
                let digest = python_serialized_digest(&parsed);
                if let Some(metadata) = metadata {
                    core.machine
                        .check_hooks(digest, metadata)
                        .map_err(OperationError::new)?;
                }
                let handle = core
                    .machine
                    .register_before_start_with_metadata(
                        digest,
                        Namespace::LocalPython,
                        metadata.map(metadata_identity),
                    )
                    .map_err(OperationError::new)?;
                let bytes = &envelope[..parsed.encoded_len()];
                core.envelopes
                    .entry(digest)
                    .or_insert_with(|| Arc::new(bytes.to_vec()));
                if let Some(metadata) = metadata {
                    core.metadata
                        .entry(digest)
                        .or_insert_with(|| metadata.clone());
                }
                Ok(completed(Ok(handle)))
            }
            Lifecycle::Closed => Err(OperationError::new(lifecycle_error(
                OperationKind::Register,
                "the Worker is closed",
            ))),
            Lifecycle::Started => {
                drop(core);
                let hashed = HEADER_LEN..parsed.encoded_len();
                let (staged, payload_sha256) =
                    StagedPayload::create(&envelope[..parsed.encoded_len()], hashed)
                        .map_err(stage_error)?;
                let descriptor = PythonSerialized {
                    payload_format_version: parsed.version(),
                    serializer_id: parsed.serializer(),
                    payload_sha256: Digest(payload_sha256),
                };
                Ok(self.register_staged(staged, descriptor, metadata))
            }
        }
    }

    /// Registers a staged envelope whose descriptor (its form, serializer
    /// and payload hash) is `descriptor`.
    fn register_staged(
        &self,
        staged: StagedPayload,
        descriptor: PythonSerialized,
        metadata: Option<&CallableMetadata>,
    ) -> PendingOperation<Handle> {
        let digest = descriptor.digest();
        let (done, pending) = handoff::channel();
        let owed = self.push(
            Request::Register {
                digest,
                staged,
                metadata: metadata.cloned().map(Box::new),
                done,
            },
            false,
        );
        PendingOperation {
            awaited: self.awaited(pending, owed),
        }
    }

    /// Registers an envelope a [`StagingWriter`] wrote (a pickler's output,
    /// streamed; [`StagingWriter::finish`]) and waits for the handle, as
    /// [`Worker::register_with_metadata`]. A large one (past
    /// [`crate::io::staging::SPILL_BYTES`]) was written once, into the
    /// `memfd` the targets read, and is registered from there: after
    /// start the parent holds one copy of it, not two. Before start it is
    /// read back into memory (the startup snapshot is inherited as bytes).
    ///
    /// # Errors
    /// As [`Worker::register_with_metadata`]; `IO_FAILED` when reading a
    /// staged envelope back before start fails.
    pub fn register_written(
        &self,
        written: WrittenEnvelope,
        metadata: Option<&CallableMetadata>,
    ) -> Result<Handle, OperationError> {
        match written {
            WrittenEnvelope::Bytes(bytes) => self.register_inner(&bytes, metadata)?.wait(),
            WrittenEnvelope::Staged {
                payload,
                payload_sha256,
            } => {
                // A writer writes the reference form.
                let descriptor = PythonSerialized {
                    payload_format_version: crate::envelope::VERSION,
                    serializer_id: crate::envelope::SERIALIZER_CLOUDPICKLE,
                    payload_sha256: Digest(payload_sha256),
                };
                self.register_adopted(payload, descriptor, metadata)?.wait()
            }
        }
    }

    /// Starts the register of a sealed, hashed envelope: from where it is
    /// after start, read back into memory before (the pending operation is
    /// then complete already).
    fn register_adopted(
        &self,
        payload: StagedPayload,
        descriptor: PythonSerialized,
        metadata: Option<&CallableMetadata>,
    ) -> Result<PendingOperation<Handle>, OperationError> {
        self.owned(OperationKind::Register)
            .map_err(OperationError::new)?;
        let started = self.shared.lock().machine.lifecycle() == Lifecycle::Started;
        if !started {
            let bytes = payload.read_all().map_err(stage_error)?;
            drop(payload);
            return self.register_inner(&bytes, metadata);
        }
        if let Some(metadata) = metadata {
            self.check_metadata_fits(metadata)?;
        }
        Ok(self.register_staged(payload, descriptor, metadata))
    }

    /// Registers the envelope a writer put in `fd` (a
    /// [`crate::io::staging::new_memfd`] written from offset 0, header
    /// included; e.g. the Python package's pickler output) and waits for
    /// the handle, as [`Worker::register_written`]: it is sealed, checked
    /// and hashed where it is ([`StagedPayload::adopt`]), with no copy of
    /// its bytes.
    ///
    /// # Errors
    /// `ENVELOPE_INVALID` (operation `stage`) when its bytes are not an
    /// envelope; `IO_FAILED` when `fd` cannot be sealed or mapped; then as
    /// [`Worker::register_written`].
    pub fn register_memfd(
        &self,
        fd: std::os::fd::OwnedFd,
        metadata: Option<&CallableMetadata>,
    ) -> Result<Handle, OperationError> {
        self.register_memfd_async(fd, metadata)?.wait()
    }

    /// Starts [`Worker::register_memfd`] and returns at once with a
    /// pending operation (complete already before start).
    ///
    /// # Errors
    /// As [`Worker::register_memfd`], for the failures found before any
    /// target is involved.
    pub fn register_memfd_async(
        &self,
        fd: std::os::fd::OwnedFd,
        metadata: Option<&CallableMetadata>,
    ) -> Result<PendingOperation<Handle>, OperationError> {
        let (payload, descriptor) = StagedPayload::adopt(fd).map_err(stage_error)?;
        self.register_adopted(payload, descriptor, metadata)
    }

    /// As [`Worker::register_memfd`], for a writer that hashed the
    /// payload as it wrote it ([`StagedPayload::adopt_hashed`]): the
    /// payload is not read back here. A `payload_sha256` that is not the
    /// payload's makes every target refuse the register
    /// (`HASHID_DESCRIPTOR_MISMATCH`, a `REGISTER_PARTIAL_FAILURE`).
    ///
    /// # Errors
    /// As [`Worker::register_memfd`].
    pub fn register_memfd_hashed(
        &self,
        fd: std::os::fd::OwnedFd,
        payload_sha256: [u8; 32],
        metadata: Option<&CallableMetadata>,
    ) -> Result<Handle, OperationError> {
        self.register_memfd_hashed_async(fd, payload_sha256, metadata)?
            .wait()
    }

    /// Starts [`Worker::register_memfd_hashed`] and returns at once with a
    /// pending operation (complete already before start).
    ///
    /// # Errors
    /// As [`Worker::register_memfd_hashed`], for the failures found before
    /// any target is involved.
    pub fn register_memfd_hashed_async(
        &self,
        fd: std::os::fd::OwnedFd,
        payload_sha256: [u8; 32],
        metadata: Option<&CallableMetadata>,
    ) -> Result<PendingOperation<Handle>, OperationError> {
        let (payload, descriptor) =
            StagedPayload::adopt_hashed(fd, payload_sha256).map_err(stage_error)?;
        self.register_adopted(payload, descriptor, metadata)
    }

    /// Gives up waiting for a register: the registration it makes, if it
    /// succeeds, is unregistered as soon as it completes, so that nothing
    /// stays installed for a handle nobody holds (e.g. the Python package's
    /// register interrupted by Ctrl-C). A failed register needs nothing
    /// more (it was rolled back); a Worker closed meanwhile releases
    /// everything itself. Returns at once.
    pub fn release_when_registered(&self, pending: PendingOperation<Handle>) {
        let shared = Arc::downgrade(&self.shared);
        pending.awaited.on_complete(move |result| {
            let (Some(shared), Ok(Ok(handle))) = (shared.upgrade(), result) else {
                return;
            };
            let (done, pending) = handoff::channel();
            let owed = push(&shared, Request::Unregister { handle, done }, false);
            // Dropped at once: nobody waits for the unregister (the drop
            // settles what the push owes, as any pending operation's).
            drop(Awaited::of(pending, shared, owed));
        });
    }

    /// Refuses metadata whose JSON cannot fit in one register control.
    fn check_metadata_fits(&self, metadata: &CallableMetadata) -> Result<(), OperationError> {
        // Room for the register control's fixed fields: seq, digest,
        // staged size and the metadata's length.
        let json_bytes = metadata.to_json().len();
        if HEADER_BYTES + 8 + 32 + 8 + 4 + json_bytes > self.max_frame_bytes {
            return Err(OperationError::new(
                Error::new(
                    ErrorCode::FRAME_INVALID,
                    OperationKind::Register,
                    format!(
                        "the metadata's JSON of {json_bytes} bytes does not fit in a register control of at most {} bytes",
                        self.max_frame_bytes
                    ),
                )
                .with_namespace(Namespace::LocalPython),
            ));
        }
        Ok(())
    }

    /// Unregisters a handle and waits until every target that holds it
    /// dropped its reference.
    ///
    /// # Errors
    /// The handle resolution errors (`HANDLE_FOREIGN`, `HANDLE_STALE`,
    /// `HANDLE_MUTATED`, `HANDLE_WRONG_NAMESPACE`,
    /// `REGISTER_CLEANUP_UNCERTAIN`); `LIFECYCLE_INVALID` once closed;
    /// `UNREGISTER_PARTIAL_FAILURE` with every target's outcome when a
    /// target refused it or timed out; `TARGET_LOST` when a target was lost
    /// while it was pending there (e.g. a finalizer the release ran ended
    /// the process): the handle is released all the same, and the message
    /// says how each lost target ended (`specs/protocol.md` §2.3).
    pub fn unregister(&self, handle: &Handle) -> Result<(), OperationError> {
        self.unregister_async(handle)?.wait()
    }

    /// Starts an unregister and returns at once with a pending operation.
    ///
    /// # Errors
    /// As [`Worker::unregister`], for failures found before start.
    pub fn unregister_async(
        &self,
        handle: &Handle,
    ) -> Result<PendingOperation<()>, OperationError> {
        self.owned(OperationKind::Unregister)
            .map_err(OperationError::new)?;
        let mut core = self.shared.lock();
        match core.machine.lifecycle() {
            Lifecycle::New => {
                core.machine
                    .unregister_before_start(handle)
                    .map_err(OperationError::new)?;
                let digest = handle.digest();
                if !core
                    .machine
                    .startup_snapshot()
                    .iter()
                    .any(|(d, _)| *d == digest)
                {
                    core.envelopes.remove(&digest);
                    core.metadata.remove(&digest);
                }
                Ok(completed(Ok(())))
            }
            _ => {
                drop(core);
                let (done, pending) = handoff::channel();
                let owed = self.push(
                    Request::Unregister {
                        handle: *handle,
                        done,
                    },
                    false,
                );
                Ok(PendingOperation {
                    awaited: self.awaited(pending, owed),
                })
            }
        }
    }
}

/// A staging failure as the register's error (operation `stage`); one
/// the system refused for want of memory says so first (`out of memory:
/// …`, [`StagingError::is_out_of_memory`]).
fn stage_error(e: StagingError) -> OperationError {
    let message = if e.is_out_of_memory() {
        format!("{STAGING_OUT_OF_MEMORY}: {e}")
    } else {
        e.to_string()
    };
    OperationError::new(
        Error::new(e.code(), OperationKind::Stage, message).with_namespace(Namespace::LocalPython),
    )
}

/// How the message of an `IO_FAILED` register begins when staging its
/// payload found no memory (`ENOMEM`, `ENOSPC`, `EFBIG`): the Python
/// package raises `MemoryError` for it.
pub const STAGING_OUT_OF_MEMORY: &str = "out of memory";
