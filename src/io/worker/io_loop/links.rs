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
use crate::wire::{Frame, FrameBuffer};

/// Bytes read from a reply socket per `read` call.
pub(in crate::io::worker) const READ_CHUNK_BYTES: usize = 64 * 1024;

/// The smallest staged payload sent ahead to the targets a probe's register
/// waits to reach ([`Frame::Verify`]): 1 MiB, where recomputing the digest
/// (about a millisecond here) costs far more than the frame.
const VERIFY_AHEAD_MIN_BYTES: u64 = 1024 * 1024;

/// Control bytes queued for a link's socket and sent from the front: a
/// cursor over one buffer. The sent part is dropped (the rest moved to
/// the front) once it is at least as long as the rest, so each byte is
/// moved at most about once: a frame written in many partial `sendmsg`s
/// costs time linear in its size (moving the rest after every write made
/// a large task's send quadratic).
#[derive(Default)]
pub(in crate::io::worker) struct Outbox {
    bytes: Vec<u8>,
    sent: usize,
}

impl Outbox {
    /// Whether every queued byte was sent.
    pub(in crate::io::worker) fn is_empty(&self) -> bool {
        self.sent == self.bytes.len()
    }

    /// The bytes not yet sent.
    pub(in crate::io::worker) fn unsent(&self) -> &[u8] {
        &self.bytes[self.sent..]
    }

    /// How many bytes are not yet sent: the offset, among them, of the
    /// next byte appended.
    pub(in crate::io::worker) fn len(&self) -> usize {
        self.bytes.len() - self.sent
    }

    /// The buffer to append frames to (appends only: what is in it is
    /// owed to the socket).
    pub(in crate::io::worker) fn tail(&mut self) -> &mut Vec<u8> {
        &mut self.bytes
    }

    /// The first `n` unsent bytes were sent.
    pub(in crate::io::worker) fn consume(&mut self, n: usize) {
        self.sent = (self.sent + n).min(self.bytes.len());
        if self.sent == self.bytes.len() {
            self.bytes.clear();
            self.sent = 0;
        } else if self.sent >= self.bytes.len() - self.sent {
            self.bytes.drain(..self.sent);
            self.sent = 0;
        }
    }
}

/// One live target as the IO thread sees it.
pub(in crate::io::worker) struct Link {
    pub(in crate::io::worker) process: TargetProcess,
    pub(in crate::io::worker) input: FrameBuffer,
    /// Encoded control bytes not yet written (the socket was full).
    pub(in crate::io::worker) outbox: Outbox,
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
    pub(super) fn send(&mut self, core: &mut Core, target: TargetId, frame: ControlFrame) {
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
                // The input is put back once encoded: the machine sends a
                // task again when the process it went to was lost before
                // starting it (`specs/protocol.md` §2.15).
                let Some((encoding, input)) =
                    self.tasks.get_mut(&seq.0).and_then(|w| w.input.take())
                else {
                    return self.lose(core, target, "a task frame without its task's input");
                };
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
            .encode_into(link.outbox.tail(), self.max_frame_bytes)
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
        if let Frame::Task {
            seq,
            encoding,
            input,
            ..
        } = wire
        {
            if let Some(waiter) = self.tasks.get_mut(&seq) {
                waiter.input = Some((encoding, input));
            }
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
            .encode_into(link.outbox.tail(), self.max_frame_bytes)
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
            match process::send_control(control, &link.outbox.unsent()[..end], fd) {
                Ok(n) => {
                    link.outbox.consume(n);
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

    /// Reads what the reaped process of link `index` wrote and the parent
    /// has not read yet (nothing more comes from it), giving the machine
    /// its start reports and task results (`specs/protocol.md` §2.15):
    /// `true` when everything it wrote was read and decoded, `false` when
    /// its output broke off (an invalid frame, a frame cut short by the
    /// kill). Other frames of a process being buried are dropped.
    pub(in crate::io::worker) fn read_buried(&mut self, core: &mut Core, index: usize) -> bool {
        let target = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
        if self.chunk.len() != READ_CHUNK_BYTES {
            self.chunk = vec![0u8; READ_CHUNK_BYTES];
        }
        loop {
            let read = match self.links.get_mut(index) {
                Some(Some(link)) => read_available(link, &mut self.chunk),
                _ => return false,
            };
            loop {
                let next = match self.links.get_mut(index) {
                    Some(Some(link)) => link.input.next_frame(),
                    _ => return false,
                };
                match next {
                    Ok(Some(frame @ (Frame::Started { .. } | Frame::TaskResult { .. }))) => {
                        if self.reply(core, target, frame).is_err() {
                            return false;
                        }
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(_) => return false,
                }
            }
            if !matches!(read, ReadOutcome::Data) {
                return match self.links.get(index) {
                    Some(Some(link)) => link.input.pending_bytes() == 0,
                    _ => false,
                };
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
                let now = self.now();
                let accepted =
                    core.machine
                        .handle_task_result(target, incarnation, Seq(seq), digest, now);
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
            Frame::Started { seq } => {
                // The task's clock starts (§2.12); a report the machine
                // refuses (its task ended, or is not this incarnation's)
                // changes nothing.
                let incarnation = self
                    .links
                    .get(usize::from(target.0))
                    .and_then(Option::as_ref)
                    .map_or(0, |link| link.incarnation);
                let started =
                    core.machine
                        .handle_task_started(target, incarnation, Seq(seq), self.now());
                self.drain(core, &mut Context::default());
                started
                    .map(|_| ())
                    .map_err(|e| format!("it sent a start report out of protocol: {e}"))
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

#[cfg(test)]
mod tests {
    use super::Outbox;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    proptest! {
        /// Any sequence of appends and partial sends leaves exactly the
        /// bytes not yet sent, in order (a queue of bytes is the model),
        /// and the buffer never holds more than twice what is unsent plus
        /// the last append.
        #[test]
        fn outbox_is_a_queue_of_bytes(steps in proptest::collection::vec((any::<bool>(), 0usize..300), 0..200)) {
            let mut outbox = Outbox::default();
            let mut model: VecDeque<u8> = VecDeque::new();
            let mut next = 0u8;
            for (append, n) in steps {
                if append {
                    let bytes: Vec<u8> = (0..n).map(|_| { next = next.wrapping_add(1); next }).collect();
                    outbox.tail().extend_from_slice(&bytes);
                    model.extend(bytes);
                } else {
                    let n = n.min(outbox.len());
                    outbox.consume(n);
                    model.drain(..n);
                    prop_assert!(outbox.bytes.len() <= 2 * outbox.len().max(1));
                }
                prop_assert_eq!(outbox.len(), model.len());
                prop_assert_eq!(outbox.is_empty(), model.is_empty());
                let expected: Vec<u8> = model.iter().copied().collect();
                prop_assert_eq!(outbox.unsent(), expected.as_slice());
            }
        }
    }

    #[test]
    fn a_large_frame_sent_in_small_writes_is_moved_about_once() {
        // 1 MiB sent 4 KiB at a time: the sent part is dropped only when
        // it is at least half the buffer, so about 1 MiB is moved in all
        // (counted here as the bytes left at each compaction).
        let mut outbox = Outbox::default();
        outbox.tail().resize(1 << 20, 7);
        let mut moved = 0usize;
        while !outbox.is_empty() {
            let before = outbox.sent;
            outbox.consume(4096);
            if outbox.sent == 0 && before != 0 {
                moved += outbox.bytes.len();
            }
        }
        assert!(moved <= 1 << 20, "moved {moved} bytes");
        assert_eq!(outbox.bytes.len(), 0);
    }
}
