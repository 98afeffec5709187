//! A link's frame traffic: control frames encoded into its outbox and
//! flushed (a staged payload's descriptor with its frame's first byte,
//! `specs/wire.md`), and replies read, decoded and handed to the machine.

use std::collections::VecDeque;
use std::os::fd::AsFd;
use std::sync::Arc;

use nix::errno::Errno;

use super::{Context, IoLoop};
use crate::descriptor::Digest;
use crate::io::process::{self, TargetProcess};
use crate::io::staging::StagedPayload;
use crate::io::worker::pending::TargetTable;
use crate::io::worker::Core;
use crate::protocol::{ControlFrame, Failure, Reply, Seq, StagingId, TargetId};
use crate::runtime::TaskEncoding;
use crate::wire::{Frame, FrameBuffer};

/// Bytes read from a reply socket per `read` call.
pub(in crate::io::worker) const READ_CHUNK_BYTES: usize = 64 * 1024;

/// The smallest staged payload sent ahead to the targets a probe's register
/// waits to reach ([`Frame::Verify`]): 1 MiB, where recomputing the digest
/// (about a millisecond here) costs far more than the frame.
const VERIFY_AHEAD_MIN_BYTES: u64 = 1024 * 1024;

/// One live target as the IO thread sees it.
pub(in crate::io::worker) struct Link {
    pub(in crate::io::worker) process: TargetProcess,
    pub(in crate::io::worker) input: FrameBuffer,
    /// Encoded control bytes not yet written (the socket was full).
    pub(in crate::io::worker) outbox: Vec<u8>,
    /// Staged payloads whose descriptor goes with the outbox byte at
    /// their offset (a register frame's first byte), in offset order. One
    /// staged payload is shared by every target's frame (no descriptor is
    /// duplicated per target); each share is dropped once its frame's
    /// first byte is sent, which is before that target can answer, so the
    /// payload is still released when every target answered.
    pub(in crate::io::worker) outbox_fds: VecDeque<(usize, Arc<StagedPayload>)>,
    /// The target's incarnation this process is (0: forked at start).
    pub(in crate::io::worker) incarnation: u32,
}

pub(in crate::io::worker) enum ReadOutcome {
    Data,
    Nothing,
    Closed,
}

/// Reads everything available from a link's reply socket into its buffer.
pub(in crate::io::worker) fn read_available(link: &mut Link, chunk: &mut [u8]) -> ReadOutcome {
    let mut got = false;
    loop {
        match nix::unistd::read(link.process.reply().as_fd(), chunk) {
            Ok(0) => return ReadOutcome::Closed,
            Ok(n) => {
                link.input.extend(&chunk[..n]);
                got = true;
                // A short read emptied the pipe: asking again would only
                // return `EAGAIN` (one syscall per reply); later bytes make
                // the next `poll` report the pipe readable. Decode before
                // reading more: the buffer stays bounded.
                if n < chunk.len() || link.input.pending_bytes() > READ_CHUNK_BYTES * 4 {
                    return ReadOutcome::Data;
                }
            }
            Err(Errno::EINTR) => continue,
            Err(Errno::EAGAIN) => {
                return if got {
                    ReadOutcome::Data
                } else {
                    ReadOutcome::Nothing
                };
            }
            Err(_) => return ReadOutcome::Closed,
        }
    }
}

impl IoLoop {
    pub(super) fn send(
        &mut self,
        core: &mut Core,
        target: TargetId,
        frame: ControlFrame,
        context: &mut Context,
    ) {
        let mut attached: Option<Arc<StagedPayload>> = None;
        let wire = match frame {
            ControlFrame::Register {
                seq,
                digest,
                staging,
            } => match self.staged.get(&staging) {
                Some(staged) => {
                    attached = Some(staged.payload.clone());
                    Frame::Register {
                        seq: seq.0,
                        digest,
                        staged_size: staged.payload.size(),
                        metadata: staged.metadata.clone(),
                    }
                }
                // The machine sends a register only while its payload is
                // staged; an unknown staging id means a lost target now.
                None => return self.lose(core, target, "no staged payload for its register"),
            },
            ControlFrame::Unregister { seq, digest } => Frame::Unregister { seq: seq.0, digest },
            ControlFrame::Cancel { seq, digest } => Frame::Cancel { seq: seq.0, digest },
            ControlFrame::Task { seq, digest } => {
                let (encoding, input) = context
                    .task_input
                    .take()
                    .unwrap_or((TaskEncoding::Json, Vec::new()));
                Frame::Task {
                    seq: seq.0,
                    digest,
                    encoding,
                    input,
                }
            }
        };
        let index = usize::from(target.0);
        let Some(Some(link)) = self.links.get_mut(index) else {
            return;
        };
        let offset = link.outbox.len();
        if wire
            .encode_into(&mut link.outbox, self.max_frame_bytes)
            .is_err()
        {
            // Sizes were checked by the caller; a frame that still does not
            // fit is a broken link, not something to half-send.
            return self.lose(
                core,
                target,
                "a control frame exceeded the maximum frame size",
            );
        }
        if let Some(fd) = attached {
            link.outbox_fds.push_back((offset, fd));
        }
        self.flush(core, index);
    }

    /// Carries out [`crate::protocol::Effect::Verify`]: queues a [`Frame::Verify`] with the
    /// staged payload to `target` when the payload is at least
    /// [`VERIFY_AHEAD_MIN_BYTES`] (below that, recomputing its digest costs
    /// less than the frame). A payload no longer staged or a link that is
    /// gone sends nothing.
    pub(super) fn verify_ahead(
        &mut self,
        core: &mut Core,
        target: TargetId,
        staging: StagingId,
        digest: Digest,
    ) {
        let Some(staged) = self.staged.get(&staging) else {
            return;
        };
        let size = staged.payload.size();
        if size < VERIFY_AHEAD_MIN_BYTES {
            return;
        }
        let index = usize::from(target.0);
        let Some(Some(link)) = self.links.get_mut(index) else {
            return;
        };
        let frame = Frame::Verify {
            digest,
            staged_size: size,
        };
        let offset = link.outbox.len();
        if frame
            .encode_into(&mut link.outbox, self.max_frame_bytes)
            .is_ok()
        {
            link.outbox_fds.push_back((offset, staged.payload.clone()));
            self.flush(core, index);
        }
    }

    /// Writes as much of a link's outbox as the socket takes now. Each
    /// `sendmsg` stops before the next frame that carries a descriptor, and
    /// a descriptor goes with the first byte of its frame, so a target
    /// receives each register's payload no later than the frame's first
    /// byte and in frame order.
    pub(super) fn flush(&mut self, core: &mut Core, index: usize) {
        let Some(Some(link)) = self.links.get_mut(index) else {
            return;
        };
        let Some(control) = link.process.control() else {
            return;
        };
        while !link.outbox.is_empty() {
            let (fd, end) = match (link.outbox_fds.front(), link.outbox_fds.get(1)) {
                (Some((0, payload)), next) => (Some(payload.fd()), next.map(|(at, _)| *at)),
                (Some((at, _)), _) => (None, Some(*at)),
                (None, _) => (None, None),
            };
            let end = end.unwrap_or(link.outbox.len());
            let with_fd = fd.is_some();
            match process::send_control(control, &link.outbox[..end], fd) {
                Ok(n) => {
                    link.outbox.drain(..n);
                    if n > 0 && with_fd {
                        link.outbox_fds.pop_front();
                    }
                    for (at, _) in link.outbox_fds.iter_mut() {
                        *at -= n;
                    }
                }
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return,
                Err(_) => {
                    let target = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
                    return self.lose(core, target, "its control socket is closed");
                }
            }
        }
    }

    pub(in crate::io::worker) fn read_replies(
        &mut self,
        core: &mut Core,
        index: usize,
        hung_up: bool,
    ) {
        let target = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
        if self.chunk.len() != READ_CHUNK_BYTES {
            self.chunk = vec![0u8; READ_CHUNK_BYTES];
        }
        let closed = match self.links.get_mut(index) {
            Some(Some(link)) => loop {
                // Its writer is gone: what is left is bounded by the pipe's
                // capacity, then end of file.
                match read_available(link, &mut self.chunk) {
                    ReadOutcome::Closed => break true,
                    ReadOutcome::Data if hung_up => continue,
                    _ => break false,
                }
            },
            _ => return,
        };
        loop {
            let next = match self.links.get_mut(index) {
                Some(Some(link)) => link.input.next_frame(),
                _ => return,
            };
            match next {
                Ok(Some(frame)) => {
                    if let Err(why) = self.reply(core, target, frame) {
                        return self.lose(core, target, &why);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    return self.lose(core, target, &format!("it sent an invalid frame: {e}"))
                }
            }
        }
        if closed {
            self.lose(core, target, "its reply socket closed");
        }
    }

    /// One frame from `target`; `Err` for a frame that is out of protocol.
    fn reply(&mut self, core: &mut Core, target: TargetId, frame: Frame) -> Result<(), String> {
        match frame {
            Frame::Reply {
                seq,
                digest,
                result,
            } => {
                let reply = Reply {
                    seq: Seq(seq),
                    digest,
                    result: result.map_err(|e| Failure::new(e.code, e.message)),
                };
                let handled = core.machine.handle_reply(target, reply, self.now());
                self.drain(core, &mut Context::default());
                handled.map_err(|e| format!("it sent a reply out of protocol: {e}"))
            }
            Frame::TaskResult {
                seq,
                digest,
                result,
            } => {
                // The machine decides whether it ends its task (§2.11): a
                // result it refuses (its task ended already, or is not this
                // incarnation's) is dropped; one out of protocol ends the
                // target.
                let incarnation = self
                    .links
                    .get(usize::from(target.0))
                    .and_then(Option::as_ref)
                    .map_or(0, |link| link.incarnation);
                let mut context = Context {
                    task_result: Some(result),
                    ..Context::default()
                };
                let accepted =
                    core.machine
                        .handle_task_result(target, incarnation, Seq(seq), digest);
                self.drain(core, &mut context);
                accepted
                    .map(|_| ())
                    .map_err(|e| format!("it sent a task result out of protocol: {e}"))
            }
            Frame::Table {
                seq,
                tombstones,
                entries,
            } => {
                // The machine says whether the inspection waited for it; a
                // late table is dropped (§2.13).
                let waited = match core.machine.handle_table(target, Seq(seq)) {
                    Ok(waited) => waited,
                    Err(e) => return Err(format!("it sent a table out of protocol: {e}")),
                };
                if waited {
                    let incarnation = self
                        .links
                        .get(usize::from(target.0))
                        .and_then(Option::as_ref)
                        .map_or(0, |link| link.incarnation);
                    let installed = entries
                        .into_iter()
                        .map(|e| (e.digest, e.refcount))
                        .collect();
                    if let Some(waiter) = self.inspects.get_mut(&seq) {
                        waiter.tables.insert(
                            target,
                            Some(TargetTable {
                                installed,
                                tombstones,
                                incarnation,
                            }),
                        );
                    }
                }
                self.drain(core, &mut Context::default());
                Ok(())
            }
            Frame::Alive { seq, phase } => {
                let handled = core
                    .machine
                    .handle_alive(target, Seq(seq), phase, self.now());
                handled.map_err(|e| format!("it sent an alive report out of protocol: {e}"))
            }
            Frame::Ready { snapshot, .. } => {
                let index = usize::from(target.0);
                let Some(incarnation) = self.starting.remove(&index) else {
                    return Err("it sent a second ready report".to_owned());
                };
                if !snapshot.is_empty() {
                    return Err(format!(
                        "its ready report names {} snapshot entries; a replacement starts with none",
                        snapshot.len()
                    ));
                }
                let spawned = core.machine.target_spawned(target, incarnation, self.now());
                self.drain(core, &mut Context::default());
                spawned.map_err(|e| format!("it reported ready out of protocol: {e}"))
            }
            Frame::StartFailed { kind, message } => {
                if !self.starting.contains_key(&usize::from(target.0)) {
                    return Err("it reported a failed start after it was ready".to_owned());
                }
                // A replacement that cannot start is lost with the reason
                // it gave (it exits next).
                Err(super::super::start::start_failed_text(&kind, &message))
            }
            other => Err(format!(
                "it sent a {:?} frame, which only a parent sends",
                other.kind()
            )),
        }
    }
}
