//! The heartbeat and control threads: every register and unregister
//! control reported alive while unanswered, and each frame the intake
//! hands over handled by the control thread through the slot table (a
//! register's staged payload verified and installed, its replies
//! written).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use nix::sys::epoll::Epoll;

use super::intake::{read_controls, Intake};
use super::reply::{reply_error, ReplyWriter};
use super::runs::{Hooks, Pinning};
use super::{
    abrupt_exit, install, report_finalizers, thread_failed, TargetSetup, FRAME_EXIT_CODE,
    HEARTBEAT_THREAD, READER_THREAD, THREAD_EXIT_CODE,
};
use crate::descriptor::{python_serialized_digest, Digest};
use crate::envelope::Envelope;
use crate::error::ErrorCode;
use crate::io::failpoints;
use crate::io::slots::{ControlGate, Effects, SlotTable};
use crate::io::staging::{FileIdentity, StagedView};
use crate::metadata::CallableMetadata;
use crate::protocol::{ControlPhase, Failure, Reply, Seq, Slot, TargetEffect, TargetId};
use crate::runtime::{Runtime, Staged};
use crate::wire::{Frame, ReplyError, TaskFailure};

/// Checks a staged payload's seals and size and maps it read-only
/// ([`StagedView::open`]), validates the envelope against the mapped size
/// and recomputes its digest over that mapping (`specs/staging.md`); the
/// same mapping is what the runtime later deserializes.
///
/// # Errors
/// `IO_FAILED` when no descriptor came with the register control; the
/// view's errors (`ENVELOPE_INVALID` for missing seals or another size);
/// the envelope's errors.
///
/// `ahead` is what a [`Frame::Verify`] found for this register: when it
/// names the same sealed file ([`StagedView::identity`]; the view checked
/// its size) and the same claimed digest, its recomputed digest is taken,
/// not computed again (the file's seals keep its bytes those it hashed).
fn open_and_verify(
    payload: Option<OwnedFd>,
    size: u64,
    claimed: Digest,
    ahead: Option<VerifiedAhead>,
) -> Result<(StagedView, Digest), Failure> {
    let payload = payload.ok_or_else(|| {
        Failure::new(
            ErrorCode::IO_FAILED,
            "no staged payload came with the register control",
        )
    })?;
    let view =
        StagedView::open(payload, size).map_err(|e| Failure::new(e.code(), e.to_string()))?;
    if let Some(ahead) = ahead {
        if ahead.claimed == claimed && view.identity() == Ok(ahead.identity) {
            return Ok((view, ahead.digest));
        }
    }
    let digest = {
        let envelope =
            Envelope::parse(view.bytes()).map_err(|e| Failure::new(e.code(), e.message()))?;
        python_serialized_digest(&envelope)
    };
    Ok((view, digest))
}

/// What a [`Frame::Verify`] found: the payload's sealed file (whose size
/// its seals fix), the digest the parent claimed for it and the digest
/// recomputed over it.
/// Held by the control thread until the next register control takes it
/// (used when it is for the same file, dropped otherwise); it holds no
/// descriptor and no mapping of the payload (`specs/staging.md` step 3).
#[derive(Clone, Copy, Debug)]
pub(super) struct VerifiedAhead {
    identity: FileIdentity,
    claimed: Digest,
    digest: Digest,
}

pub(super) struct Control<'a, R: Runtime> {
    pub(super) id: TargetId,
    pub(super) runtime: &'a R,
    pub(super) table: Arc<SlotTable<R::Callable>>,
    pub(super) writer: Arc<ReplyWriter>,
    pub(super) pinning: Arc<Pinning<R::Callable>>,
    /// Frames handed to this thread and not yet handled (the intake's
    /// [`ControlGate::hand`], this thread's [`ControlGate::done`]).
    pub(super) idle: Arc<ControlGate>,
    /// The controls received and not yet answered, with their phases.
    pub(super) outstanding: Arc<Outstanding>,
    /// The last [`Frame::Verify`]'s result, until a register takes it.
    pub(super) ahead: std::cell::Cell<Option<VerifiedAhead>>,
}

/// Register and unregister controls received and not yet answered, by
/// seq, each with its phase (`specs/wire.md`, the Alive frame): the intake
/// adds one, queued, on receipt; the control thread marks a register
/// running once the runtime begins its install
/// ([`Runtime::install_reporting`]) and removes it once it answered; the
/// heartbeat thread reports each alive meanwhile.
#[derive(Default)]
pub(super) struct Outstanding {
    seqs: Mutex<BTreeMap<u64, ControlPhase>>,
    changed: Condvar,
}

impl Outstanding {
    pub(super) fn insert(&self, seq: u64) {
        self.seqs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(seq, ControlPhase::Queued);
        self.changed.notify_all();
    }

    /// Control `seq`'s install has begun; the heartbeat thread reports it
    /// running at once (woken here), not a heartbeat later.
    fn mark_running(&self, seq: u64) {
        if let Some(phase) = self
            .seqs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&seq)
        {
            *phase = ControlPhase::Running;
        }
        self.changed.notify_all();
    }

    fn remove(&self, seq: u64) {
        self.seqs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&seq);
    }
}

/// What the intake hands the control thread, in arrival order.
pub(super) enum Incoming {
    /// A frame, with the staged payload received with it (registers).
    Frame(Frame, Option<OwnedFd>),
    /// The intake ended: the target ends with this status once every
    /// frame before it was handled.
    End(i32),
}

/// The seq of a frame that owes a [`Frame::Reply`] (a register or an
/// unregister control).
pub(super) fn control_seq(frame: &Frame) -> Option<u64> {
    match frame {
        Frame::Register { seq, .. } | Frame::Unregister { seq, .. } | Frame::Cancel { seq, .. } => {
            Some(*seq)
        }
        _ => None,
    }
}

/// The heartbeat thread: every `every`, and whenever a control is
/// received or begins its install, reports each outstanding control alive
/// with its phase; sleeps while none is outstanding. Never touches the
/// runtime. The reports are written while the phases are locked, so a
/// control's reports never go from running back to queued (a report read
/// before its install began cannot be written after the one saying it
/// did).
fn beat(writer: &ReplyWriter, outstanding: &Outstanding, every: std::time::Duration) {
    let mut seqs = outstanding.seqs.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        seqs = if seqs.is_empty() {
            outstanding
                .changed
                .wait(seqs)
                .unwrap_or_else(|p| p.into_inner())
        } else {
            let (guard, _) = outstanding
                .changed
                .wait_timeout(seqs, every)
                .unwrap_or_else(|p| p.into_inner());
            for (seq, phase) in guard.iter() {
                writer.send_alive(*seq, *phase);
            }
            guard
        };
    }
}

/// Serves the target's frames: starts the reader thread (waiting on the
/// control socket through `wait`, its epoll instance) and the heartbeat
/// thread, then handles the frames the intake hands over on `incoming`, in
/// order, until the intake ends; returns the target's exit status.
pub(super) fn serve<R: Runtime>(
    intake: Arc<Intake<R::Callable>>,
    wait: Epoll,
    incoming: &mpsc::Receiver<Incoming>,
    setup: &TargetSetup<R>,
    this: &Control<'_, R>,
) -> i32 {
    let outstanding = this.outstanding.clone();
    let reader = std::thread::Builder::new()
        .name(READER_THREAD.to_owned())
        .spawn(move || read_controls(&intake, &wait));
    let heartbeat = {
        let writer = this.writer.clone();
        let outstanding = outstanding.clone();
        let every = setup.heartbeat.max(std::time::Duration::from_millis(1));
        std::thread::Builder::new()
            .name(HEARTBEAT_THREAD.to_owned())
            .spawn(move || beat(&writer, &outstanding, every))
    };
    if let Err(error) = reader.and(heartbeat) {
        thread_failed(this.id, "the reader or heartbeat thread", &error);
        return THREAD_EXIT_CODE;
    }
    loop {
        match incoming.recv() {
            Ok(Incoming::Frame(frame, payload)) => {
                let seq = control_seq(&frame);
                if !this.handle(frame, payload) {
                    return FRAME_EXIT_CODE;
                }
                if let Some(seq) = seq {
                    outstanding.remove(seq);
                }
                this.idle.done();
            }
            Ok(Incoming::End(code)) => return code,
            Err(mpsc::RecvError) => return 0,
        }
    }
}

impl<R: Runtime> Control<'_, R> {
    /// Handles one frame (a register with the staged payload received
    /// with it); `false` for a frame a target never receives.
    fn handle(&self, frame: Frame, payload: Option<OwnedFd>) -> bool {
        match frame {
            Frame::Register {
                seq,
                digest,
                staged_size,
                metadata,
            } => {
                let metadata = parse_metadata(&metadata);
                let opened = open_and_verify(payload, staged_size, digest, self.ahead.take());
                let failpoint = failpoints::hit(failpoints::TARGET_BEFORE_INSTALL);
                let verified = match (&opened, failpoint, &metadata) {
                    (_, Err(message), _) => Err(Failure::new(ErrorCode::IO_FAILED, message)),
                    (Err(failure), Ok(()), _) => Err(failure.clone()),
                    (Ok(_), Ok(()), Err(failure)) => Err(failure.clone()),
                    (Ok((_, verified)), Ok(()), Ok(_)) => Ok(*verified),
                };
                let effects = self.table.on_register(Seq(seq), digest, verified);
                let view = opened.ok().map(|(view, _)| view);
                let metadata = metadata.ok().flatten();
                let mut replies = Vec::new();
                self.carry_out(effects, view.as_ref(), metadata.as_ref(), &mut replies);
                // The mapping goes before the answer (`specs/staging.md`):
                // once the parent has every answer, no target holds any of
                // the payload, so nothing that comes later (an unregister
                // behind it in this socket) waits for its unmapping, and the
                // cost of a payload's size stays in its register.
                let staged = view.is_some();
                drop(view);
                self.send_replies(replies, staged);
            }
            Frame::Verify {
                digest,
                staged_size,
            } => {
                // A hint: whatever goes wrong here, the register that may
                // follow verifies the payload itself and reports it. The
                // view (its mapping and descriptor) is dropped here.
                let ahead = open_and_verify(payload, staged_size, digest, None)
                    .ok()
                    .and_then(|(view, recomputed)| {
                        Some(VerifiedAhead {
                            identity: view.identity().ok()?,
                            claimed: digest,
                            digest: recomputed,
                        })
                    });
                self.ahead.set(ahead);
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
                    // The last reference's callable was released (its
                    // finalizer ran) before this unregister is answered.
                    report_finalizers(&self.table, self.id, || {
                        format!("the unregister (seq {seq}) of {}", digest.hashid())
                    });
                    let mut replies = Vec::new();
                    self.carry_out(effects, None, None, &mut replies);
                    self.send_replies(replies, false);
                }
            }
            Frame::Task {
                seq,
                digest,
                encoding,
                input,
            } => {
                if let Err(unstarted) = self.pinning.begin(seq, digest, encoding, input) {
                    self.task_failed(seq, digest, unstarted.code, &unstarted.message);
                }
            }
            Frame::Cancel { seq, digest } => {
                // Decided against the task thread's start under the
                // table's lock (`specs/protocol.md` §2.11): a run
                // cancelled here never starts.
                let effects = self.table.on_cancel(Seq(seq), digest);
                let mut replies = Vec::new();
                self.carry_out(effects, None, None, &mut replies);
                self.send_replies(replies, false);
            }
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
            | Frame::Table { .. }
            | Frame::Alive { .. }
            | Frame::StartFailed { .. }
            | Frame::Started { .. } => {
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
                exception: Vec::new(),
            }),
        });
    }

    /// Carries out the machine's effects in order: replies are collected
    /// into `replies` (sent by [`Control::send_replies`] once the staged
    /// view is gone); a deserialization runs from the staged view and its
    /// result goes back to the machine, whose new effects are carried out
    /// in turn.
    fn carry_out(
        &self,
        effects: Effects,
        view: Option<&StagedView>,
        metadata: Option<&CallableMetadata>,
        replies: &mut Vec<Reply>,
    ) {
        for effect in effects {
            match effect {
                TargetEffect::Reply(reply) => replies.push(reply),
                TargetEffect::Deserialize { seq, digest, slot } => {
                    let more = self.deserialize_into(seq, digest, slot, view, metadata);
                    self.carry_out(more, view, metadata, replies);
                }
            }
        }
    }

    /// Writes the replies in order; an OK reply to a register whose staged
    /// payload was opened (`staged`) passes `target.after_install` first.
    fn send_replies(&self, replies: Vec<Reply>, staged: bool) {
        for reply in replies {
            if reply.result.is_ok()
                && staged
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
    }

    fn deserialize_into(
        &self,
        seq: Seq,
        digest: Digest,
        slot: Slot,
        view: Option<&StagedView>,
        metadata: Option<&CallableMetadata>,
    ) -> Effects {
        let result = match view.map(|v| (v, Envelope::parse(v.bytes()))) {
            Some((view, Ok(envelope))) => install(
                self.runtime,
                Staged {
                    envelope,
                    file: Some(view.file()),
                },
                metadata,
                &|| self.outstanding.mark_running(seq.0),
            ),
            // The machine asks to deserialize only after a verified open.
            Some((_, Err(e))) => Err(Failure::new(e.code(), e.message())),
            None => Err(Failure::new(
                ErrorCode::IO_FAILED,
                "no staged payload is open",
            )),
        };
        // The hooks of the registration that installed the digest apply to
        // its tasks from now on (a reference added later keeps them).
        if result.is_ok() {
            let mut hooks = self.pinning.hooks.lock().unwrap_or_else(|p| p.into_inner());
            match Hooks::of(metadata) {
                Some(found) => hooks.insert(digest, found),
                None => hooks.remove(&digest),
            };
        }
        // Only a deserialization nobody waits for is refused; its callable
        // is dropped by the table and there is nothing to reply.
        self.table
            .on_deserialized(seq, slot, result)
            .unwrap_or_default()
    }
}

/// Parses a register control's metadata field: `Ok(None)` when empty.
///
/// # Errors
/// `METADATA_INVALID` with the decoding error naming the field.
fn parse_metadata(text: &str) -> Result<Option<CallableMetadata>, Failure> {
    if text.is_empty() {
        return Ok(None);
    }
    CallableMetadata::from_json(text)
        .map(Some)
        .map_err(|e| Failure::new(ErrorCode::METADATA_INVALID, format!("metadata: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::staging::StagedPayload;

    /// A staged envelope of a 2 MiB payload, and its digest.
    fn staged() -> (StagedPayload, Digest) {
        let payload: Vec<u8> = (0..2 * 1024 * 1024u32).map(|i| (i % 253) as u8).collect();
        let bytes = crate::envelope::encode(&payload);
        let (staged, _) = StagedPayload::create(&bytes, 0..bytes.len()).unwrap();
        let digest = python_serialized_digest(&Envelope::parse(&bytes).unwrap());
        (staged, digest)
    }

    fn fd(staged: &StagedPayload) -> Option<OwnedFd> {
        Some(staged.fd().try_clone_to_owned().unwrap())
    }

    #[test]
    fn a_register_takes_the_digest_verified_ahead_only_for_the_same_file_and_claim() {
        let (staged, digest) = staged();
        let size = staged.size();
        let (view, recomputed) = open_and_verify(fd(&staged), size, digest, None).unwrap();
        assert_eq!(recomputed, digest);
        let record = VerifiedAhead {
            identity: view.identity().unwrap(),
            claimed: digest,
            // Not the payload's digest: seeing it back proves the record
            // was taken rather than the digest recomputed.
            digest: Digest([7; 32]),
        };
        drop(view);
        let taken = |record: VerifiedAhead| {
            open_and_verify(fd(&staged), size, digest, Some(record))
                .unwrap()
                .1
        };
        assert_eq!(taken(record), Digest([7; 32]));
        // Another claim or another file: recomputed.
        let claim = VerifiedAhead {
            claimed: Digest([1; 32]),
            ..record
        };
        assert_eq!(taken(claim), digest);
        let (other, _) = self::staged();
        let elsewhere = VerifiedAhead {
            identity: StagedView::open(fd(&other).unwrap(), size)
                .unwrap()
                .identity()
                .unwrap(),
            ..record
        };
        assert_ne!(elsewhere.identity, record.identity);
        assert_eq!(taken(elsewhere), digest);
    }

    #[test]
    fn register_metadata_is_parsed_strictly_and_empty_means_none() {
        assert_eq!(parse_metadata(""), Ok(None));
        assert_eq!(
            parse_metadata(r#"{"name":"f"}"#),
            Ok(Some(CallableMetadata::named("f")))
        );
        assert_eq!(
            parse_metadata(r#"{"name":"f","deps":{"pip":{"packages":[1]}}}"#),
            Err(Failure::new(
                ErrorCode::METADATA_INVALID,
                "metadata: at deps.pip.packages[0]: invalid type: integer `1`, expected a string"
            ))
        );
    }
}
