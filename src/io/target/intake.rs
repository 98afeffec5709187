//! The control socket's intake: the frames read from the control socket
//! in order and handed on (a task pinned at once when no control is
//! queued, any other frame queued for the control thread, every control
//! reported alive on receipt), by whichever of two threads the kernel
//! wakes (`specs/threads.md`, "Who reads the control socket").
//!
//! Two threads wait on the socket, each through an epoll instance of its
//! own holding it with `EPOLLEXCLUSIVE | EPOLLET`: the task thread while
//! it has no run (its instance registered first), and the reader thread
//! always. A frame's arrival wakes the first of them that waits: the task
//! thread when it is idle, so that a task's round trip on an idle target
//! wakes one thread, which reads the task and runs it; the reader while
//! the task thread runs a task, so that controls are read and answered
//! during long tasks. Whoever is woken takes a turn at the intake
//! ([`Turns`]) and reads what the socket holds without waiting; a thread
//! woken while the other has the turn leaves it to that one, which reads
//! again once its turn is over, and never sleeps on a lock.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use nix::errno::Errno;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

use super::control::{control_seq, Incoming, Outstanding};
use super::reply::ReplyWriter;
use super::runs::Pinning;
use super::{wait_failed, FRAME_EXIT_CODE};
use crate::io::process::{exit_unless_target, receive_control};
use crate::io::slots::ControlGate;
use crate::io::turn::Turns;
use crate::protocol::ControlPhase;
use crate::wire::{Frame, FrameBuffer};

/// Bytes read from the control socket per `recvmsg` call.
const READ_CHUNK_BYTES: usize = 64 * 1024;

/// What the intake reads with, in turns.
struct Reading {
    buffer: FrameBuffer,
    chunk: Vec<u8>,
    /// Staged payloads received with register and verify controls, in
    /// arrival order: each comes with its frame's first byte, so it is
    /// here by the time the frame is whole, and the k-th of those frames
    /// takes the k-th descriptor.
    payloads: VecDeque<OwnedFd>,
}

/// The control socket and what reading it hands frames to; shared by the
/// reader and the task thread.
pub(super) struct Intake<C> {
    /// Never closed before the process ends: a parent that sees the
    /// socket close then always finds an exit status, not a target still
    /// exiting.
    socket: ManuallyDrop<OwnedFd>,
    reading: Turns<Reading>,
    /// The socket reported its end (EOF, an error, a broken frame): the
    /// end went to the control thread and nothing more is read.
    ended: AtomicBool,
    writer: Arc<ReplyWriter>,
    outstanding: Arc<Outstanding>,
    pinning: Arc<Pinning<C>>,
    idle: Arc<ControlGate>,
    frames: mpsc::Sender<Incoming>,
}

/// The events a thread waits for on the control socket: readable, the
/// first waiter only (`EPOLLEXCLUSIVE`), once per arrival (`EPOLLET`: a
/// turn reads until the socket is empty, and whatever arrives after its
/// last read is an arrival of its own, which wakes a thread again).
pub(super) fn socket_events() -> EpollFlags {
    EpollFlags::EPOLLIN | EpollFlags::EPOLLEXCLUSIVE | EpollFlags::EPOLLET
}

/// The reader's epoll instance, holding the control socket
/// ([`socket_events`]); made after the task thread's.
pub(super) fn reader_wait(socket: BorrowedFd<'_>) -> Result<Epoll, Errno> {
    let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
    epoll.add(socket, EpollEvent::new(socket_events(), 0))?;
    Ok(epoll)
}

impl<C> Intake<C> {
    /// An intake of `socket`, whose frames of at most `max_frame_bytes`
    /// go to `pinning` (tasks while `idle` says no control is queued) and
    /// to `frames` (the control thread's queue).
    ///
    /// # Errors
    /// [`crate::wire::WireError::MaxTooSmall`] for a `max_frame_bytes`
    /// no frame buffer accepts.
    pub(super) fn new(
        socket: OwnedFd,
        max_frame_bytes: usize,
        writer: Arc<ReplyWriter>,
        outstanding: Arc<Outstanding>,
        direct: (Arc<Pinning<C>>, Arc<ControlGate>),
        frames: mpsc::Sender<Incoming>,
    ) -> Result<Intake<C>, crate::wire::WireError> {
        let (pinning, idle) = direct;
        Ok(Intake {
            socket: ManuallyDrop::new(socket),
            reading: Turns::new(Reading {
                buffer: FrameBuffer::new(max_frame_bytes)?,
                chunk: vec![0u8; READ_CHUNK_BYTES],
                payloads: VecDeque::new(),
            }),
            ended: AtomicBool::new(false),
            writer,
            outstanding,
            pinning,
            idle,
            frames,
        })
    }

    /// Reads what the socket holds and hands on every whole frame, in a
    /// turn of this thread's or, when the other reading thread has a turn,
    /// in that one's next ([`Turns::take`]); never waits.
    pub(super) fn read(&self) {
        self.reading.take(|reading| self.drain(reading));
    }

    /// Whether the intake ended: the socket's end went to the control
    /// thread, and nothing more is read.
    pub(super) fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Reads without waiting until the socket holds nothing more: until
    /// `EAGAIN`, or a read shorter than the chunk that brought no
    /// descriptor (a stream socket's read stops short only when its queue
    /// is empty or after a message carrying descriptors).
    fn drain(&self, reading: &mut Reading) {
        if self.ended() {
            return;
        }
        loop {
            let before = reading.payloads.len();
            let received = receive_control(
                self.socket.as_fd(),
                &mut reading.chunk,
                &mut reading.payloads,
            );
            // A process forked inside the target never serves its controls.
            exit_unless_target();
            let n = match received {
                Ok(0) => return self.end(0),
                Ok(n) => n,
                Err(Errno::EAGAIN) => return,
                Err(Errno::EINTR) => continue,
                Err(Errno::ENOBUFS) => return self.end(FRAME_EXIT_CODE),
                Err(_) => return self.end(0),
            };
            let descriptors = reading.payloads.len() > before;
            reading.buffer.extend(&reading.chunk[..n]);
            if !self.hand_on(reading) {
                return self.end(FRAME_EXIT_CODE);
            }
            if self.ended() {
                return;
            }
            if n < reading.chunk.len() && !descriptors {
                return;
            }
        }
    }

    /// Hands on every whole frame in the buffer, in order; `false` for a
    /// frame that cannot be decoded.
    fn hand_on(&self, reading: &mut Reading) -> bool {
        loop {
            let frame = match reading.buffer.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => return true,
                Err(_) => return false,
            };
            let frame = match frame {
                Frame::Task {
                    seq,
                    digest,
                    encoding,
                    input,
                } if self.idle.is_idle() => {
                    match self.pinning.begin(seq, digest, encoding, input) {
                        Ok(()) => continue,
                        Err(unstarted) => Frame::Task {
                            seq,
                            digest,
                            encoding,
                            input: unstarted.input,
                        },
                    }
                }
                other => other,
            };
            let payload = match frame {
                Frame::Register { .. } | Frame::Verify { .. } => reading.payloads.pop_front(),
                _ => None,
            };
            if let Some(seq) = control_seq(&frame) {
                self.outstanding.insert(seq);
                // Before the control thread has it: it cannot have begun.
                self.writer.send_alive(seq, ControlPhase::Queued);
            }
            self.idle.hand();
            if self.frames.send(Incoming::Frame(frame, payload)).is_err() {
                // The control thread is gone: the target is ending.
                self.ended.store(true, Ordering::Release);
                return true;
            }
        }
    }

    /// Ends the intake with exit status `code` (once, in a turn: later
    /// turns find it ended).
    fn end(&self, code: i32) {
        if !self.ended.swap(true, Ordering::AcqRel) {
            let _ = self.frames.send(Incoming::End(code));
        }
    }
}

/// The reader thread: waits on the control socket through `wait` (its
/// own epoll instance, registered after the task thread's) and reads it
/// whenever woken, until the intake ends. Never touches the runtime.
pub(super) fn read_controls<C>(intake: &Intake<C>, wait: &Epoll) {
    let mut events = [EpollEvent::empty()];
    loop {
        match wait.wait(&mut events, EpollTimeout::NONE) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(error) => wait_failed("the reader's wait", error),
        }
        intake.read();
        if intake.ended() {
            return;
        }
    }
}
