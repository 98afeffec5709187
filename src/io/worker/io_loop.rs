//! The IO state (`IoLoop`) and the IO thread that drives it (the run rule
//! in the [module docs](super)):
//!
//! * requests given to the machine, and its effects carried out as IO;
//! * replies read and decoded, control bytes flushed ([`links`]),
//!   deadlines handled;
//! * targets lost, buried, and the close.

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags};
use nix::unistd::Pid;

use super::leader::{io_wake, poll_events, Handover, Leaving, Shared};
use super::pending::{operation_error, OperationError, TargetTable, TaskError};
use super::respawn::{Kept, Spawned, TargetEvent};
#[cfg(doc)]
use super::Worker;
use super::{metadata_identity, now_since, refuse, Core, Request};
use crate::descriptor::Digest;
use crate::error::{Error, ErrorCode, OperationKind};
use crate::io::failpoints;
use crate::io::handoff::Completer;
use crate::io::lead::{Left, LinkId, Watch};
use crate::io::process::TrackedFd;
use crate::io::staging::StagedPayload;
use crate::io::zygote::Zygote;
use crate::protocol::{
    Completion, Effect, Failure, Handle, Namespace, OpId, Seq, StagingId, TargetId, TargetOutcome,
    TaskEnd, Time,
};
use crate::runtime::TaskEncoding;
use crate::wire::{Frame, TaskFailure};

/// How long [`Worker::close`] lets targets exit on their own (after their
/// control pipe closes) before killing them.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// How long a lost target (its pipe closed or broke the protocol) may take
/// to finish exiting before it is killed.
pub(super) const LOST_GRACE: Duration = Duration::from_millis(50);

/// Kept payloads up to this size are freed by the thread that released
/// them; larger ones by the IO thread, off the callers' path.
const INLINE_FREE_BYTES: usize = 64 * 1024;

mod links;

pub(super) use links::{read_available, Link, Outbox, ReadOutcome, READ_CHUNK_BYTES};

/// The IO thread (the run rule in the module docs).
pub(super) fn io_thread(shared: Arc<Shared>) {
    let mut core = shared.lock();
    loop {
        let Some(mut io) = core.io.take() else {
            return;
        };
        // Step 1: replacements the template forked, the requests left to
        // this thread, and a close.
        let spawned = std::mem::take(&mut *io.spawned.lock().unwrap_or_else(|p| p.into_inner()));
        for spawned in spawned {
            io.link_spawned(&mut core, spawned);
        }
        while let Some(request) = core.requests.pop_front() {
            io.request(&mut core, request);
        }
        if core.closing {
            io.close(&mut core);
            let handovers = std::mem::take(&mut io.handovers);
            drop(core);
            handovers.into_iter().for_each(|handover| handover());
            // A leader finds the Worker closed, its result decided.
            let _ = nix::unistd::write(&io.leader_wake_write, &[1]);
            return;
        }
        // Step 2: deadlines.
        io.handle_deadlines(&mut core);
        // Step 3: the poll set (reply sockets only when a reply is expected
        // and no leader reads them) and its timeout.
        let deadline = io.next_deadline(&core);
        let live = io.live();
        let unsent = io.unsent();
        let expecting = io.expecting(&core);
        io.watch.plan_io(&live, expecting, &unsent, deadline);
        let mut watched: Vec<(Ready, Arc<TrackedFd>, PollFlags)> =
            vec![(Ready::Wake, io.wake.clone(), PollFlags::POLLIN)];
        for &id in &live {
            let Some(link) = io.links[id.index].as_ref() else {
                continue;
            };
            if io.watch.io_reads(id) {
                watched.push((
                    Ready::Reply(id),
                    link.process.reply_shared(),
                    PollFlags::POLLIN,
                ));
            }
            if let Some(pidfd) = link.process.pidfd_shared() {
                watched.push((Ready::Ended(id), pidfd, PollFlags::POLLIN));
            }
            if !link.outbox.is_empty() {
                if let Some(control) = link.process.control_shared() {
                    watched.push((Ready::Control(id), control, PollFlags::POLLOUT));
                }
            }
        }
        // Step 4: hand over, and wait without the lock.
        let leaving = Leaving {
            handovers: std::mem::take(&mut io.handovers),
            freed: std::mem::take(&mut io.graveyard),
            recheck: std::mem::take(&mut io.completed),
        };
        core.io = Some(io);
        drop(core);
        shared.finish(leaving);
        let mut fds: Vec<PollFd> = watched
            .iter()
            .map(|(_, fd, flags)| PollFd::new(fd.as_fd(), *flags))
            .collect();
        let (polled, flags) = poll_events(&mut fds, deadline);
        drop(fds);
        let events: Vec<(Ready, PollFlags)> = watched
            .into_iter()
            .map(|(what, _, _)| what)
            .zip(flags)
            .collect();
        let _ = failpoints::hit(failpoints::PARENT_IO_TURN);
        // Steps 5 and 6: replies, losses, flushes.
        core = shared.lock();
        let Some(mut io) = core.io.take() else {
            return;
        };
        if let Err(errno) = polled {
            if errno != Errno::EINTR {
                // Unrecoverable: fail everything rather than spin.
                core.closing = true;
            }
        } else {
            io.handle_events(&mut core, events);
        }
        core.io = Some(io);
        // Completions decided here are handed over at step 4 of the next
        // turn, after its lock is released, not now: a caller woken now
        // would find the lock taken again for steps 1 to 3.
    }
}

pub(super) enum OpWaiter {
    Register(Completer<Result<Handle, OperationError>>),
    Unregister(Completer<Result<(), OperationError>>),
}

/// Who waits for a task in flight (the machine decides when and how it
/// ends, `specs/protocol.md` §2.11).
pub(super) struct TaskWaiter {
    /// The key the caller may cancel it by ([`super::TaskKey`]).
    key: u64,
    done: Completer<Result<Vec<u8>, TaskError>>,
    /// The task's input until the task ends: its frame is written at its
    /// submit, or when a target takes it (a task may wait in the machine,
    /// `specs/protocol.md` §2.14), and again to another process when the
    /// one it went to was lost before starting it (§2.15).
    pub(super) input: Option<(TaskEncoding, Vec<u8>)>,
}

/// Who waits for an inspection, and the tables that came (the machine
/// decides whom it asks and when it ends, `specs/protocol.md` §2.13).
pub(super) struct InspectWaiter {
    tables: BTreeMap<TargetId, Option<TargetTable>>,
    done: Completer<Vec<(TargetId, Option<TargetTable>)>>,
}

/// A register's staged payload with the metadata JSON its control carries
/// (empty for none); dropping it unlinks the payload.
pub(super) struct Staged {
    pub(super) payload: Arc<StagedPayload>,
    pub(super) metadata: String,
}

/// Data a request brings for the effects it causes.
#[derive(Default)]
pub(super) struct Context {
    staged: Option<(Digest, Staged)>,
    /// The result frame being given to the machine
    /// (`handle_task_result`), for its `TaskDone`.
    task_result: Option<Result<Vec<u8>, TaskFailure>>,
}

/// The IO state: what the IO thread and the leading caller drive, in turn,
/// under the state lock (`Core::io`).
pub(super) struct IoLoop {
    pub(super) links: Vec<Option<Link>>,
    /// The read end of the IO thread's wake pipe.
    pub(super) wake: Arc<TrackedFd>,
    /// The leader's wake pipe: written when a result is decided by another
    /// thread while a caller leads, or at close.
    pub(super) leader_wake: Arc<TrackedFd>,
    pub(super) leader_wake_write: TrackedFd,
    /// Who reads the reply sockets ([`crate::io::lead`]).
    pub(super) watch: Watch,
    /// Whether a result was decided since the last [`IoLoop::leave`] (a
    /// leader waiting for it must be woken).
    pub(super) completed: bool,
    /// The buffer reply sockets are read into.
    pub(super) chunk: Vec<u8>,
    pub(super) staged: BTreeMap<StagingId, Staged>,
    pub(super) ops: BTreeMap<OpId, OpWaiter>,
    /// Waiters of the tasks in flight, by seq.
    pub(super) tasks: BTreeMap<u64, TaskWaiter>,
    /// The seq of each task in flight by its key.
    pub(super) task_keys: BTreeMap<u64, u64>,
    /// Callers waiting for the answer to a cancel, by task seq.
    pub(super) cancels: BTreeMap<u64, Vec<Completer<bool>>>,
    /// Waiters of the inspections in flight, by seq.
    pub(super) inspects: BTreeMap<u64, InspectWaiter>,
    pub(super) clock: Instant,
    pub(super) max_frame_bytes: usize,
    /// Completions decided under the state lock, handed to their callers
    /// once it is released: a caller woken while the IO thread still held
    /// the lock would block on it at once (one more sleep and wake-up).
    pub(super) handovers: Vec<Handover>,
    /// The template process replacements are forked from (`None` with
    /// replacements off, unless the start method is forkserver: then it
    /// forked every target and lives as long as they do).
    pub(super) zygote: Option<Arc<Zygote>>,
    /// Whether replacements are on (target events are recorded).
    pub(super) respawn: bool,
    /// The threads asking the template for replacements (a spawn waits
    /// for the template's answer; the IO thread never does).
    pub(super) spawners: Vec<JoinHandle<()>>,
    /// Replacements the template forked (or failed to) on a spawning
    /// thread, for the IO thread to link; spawning threads never take the
    /// state lock (a close joins them while holding it).
    pub(super) spawned: Arc<Mutex<VecDeque<Spawned>>>,
    /// Replacements started and not yet ready, by index: the incarnation
    /// and the time by which its ready report must come.
    pub(super) starting: BTreeMap<usize, u32>,
    /// Why the machine will fence a target next (a failed join), if not
    /// for a deadline.
    pub(super) fence_reasons: BTreeMap<TargetId, String>,
    /// Kept envelopes no registration needs any more, dropped after the
    /// completions are handed over (freeing a large one takes time no
    /// caller should wait for).
    pub(super) graveyard: Vec<Kept>,
}

impl Drop for IoLoop {
    fn drop(&mut self) {
        self.hand_over();
    }
}

/// What a polled descriptor belongs to: the wake pipe, or a link (a link
/// replaced earlier in the same turn is not the one that was polled: its
/// events are dropped).
#[derive(Clone, Copy)]
enum Ready {
    Wake,
    Reply(LinkId),
    Control(LinkId),
    Ended(LinkId),
}

impl IoLoop {
    pub(super) fn now(&self) -> Time {
        now_since(self.clock)
    }

    /// Queues `value` for `done`'s caller; see [`IoLoop::hand_over`].
    fn defer<T: Send + 'static>(&mut self, done: Completer<T>, value: T) {
        self.completed = true;
        self.handovers.push(Box::new(move || done.complete(value)));
    }

    /// Completes the queued operations; called without the state lock.
    fn hand_over(&mut self) {
        for handover in self.handovers.drain(..) {
            handover();
        }
    }

    /// Every live link.
    pub(super) fn live(&self) -> Vec<LinkId> {
        self.links
            .iter()
            .enumerate()
            .filter_map(|(index, link)| {
                link.as_ref()
                    .map(|link| LinkId::new(index, link.process.pid()))
            })
            .collect()
    }

    /// The process id of the link at `index`, if live.
    pub(super) fn pid_at(&self, index: usize) -> Option<Pid> {
        self.links
            .get(index)
            .and_then(Option::as_ref)
            .map(|link| link.process.pid())
    }

    /// Whether any target owes a reply: a task's result, a control's
    /// answer (every operation in flight has a deadline), a late answer a
    /// doubt awaits (it heals an uncertain digest, `specs/protocol.md`
    /// §2.4), an inspection's table or a replacement's ready report.
    fn expecting(&self, core: &Core) -> bool {
        !self.tasks.is_empty()
            || !self.inspects.is_empty()
            || !self.starting.is_empty()
            || core.machine.poll_timeout().is_some()
            || core.machine.awaits_heals()
    }

    /// The earliest deadline: the machine's, an inspection's or a starting
    /// replacement's.
    pub(super) fn next_deadline(&self, core: &Core) -> Option<Instant> {
        let machine = core
            .machine
            .poll_timeout()
            .map(|deadline| self.clock + Duration::from_micros(deadline.0));
        machine.into_iter().min()
    }

    /// Links with control bytes not yet written.
    fn unsent(&self) -> Vec<LinkId> {
        self.links
            .iter()
            .enumerate()
            .filter_map(|(index, link)| match link {
                Some(link) if !link.outbox.is_empty() => {
                    Some(LinkId::new(index, link.process.pid()))
                }
                _ => None,
            })
            .collect()
    }

    /// What a thread other than the IO thread does before it releases the
    /// state lock ([`crate::io::lead`]): wakes the IO thread if what it leaves
    /// needs it (unless `settle` is false: the caller leads next and
    /// settles then), and returns what to do once the lock is released
    /// ([`Shared::finish`]).
    pub(super) fn leave(&mut self, core: &Core, settle: bool, leader: bool) -> Leaving {
        // Small payloads are freed by this thread once its results are
        // handed over (cheaper than waking the IO thread for them); large
        // ones by the IO thread.
        let (freed, large): (Vec<Kept>, Vec<Kept>) = std::mem::take(&mut self.graveyard)
            .into_iter()
            .partition(|kept| kept.len() <= INLINE_FREE_BYTES);
        self.graveyard = large;
        if settle {
            let live = self.live();
            let unsent = self.unsent();
            let left = Left {
                live: &live,
                expecting: self.expecting(core),
                unsent: &unsent,
                deadline: self.next_deadline(core),
                chores: !self.graveyard.is_empty(),
            };
            if self.watch.io_must_wake(left) {
                io_wake(core);
            }
        }
        Leaving {
            handovers: std::mem::take(&mut self.handovers),
            freed,
            recheck: std::mem::take(&mut self.completed) && !leader,
        }
    }

    /// Handles every deadline that passed: the machine's, the
    /// inspections', the starting replacements'.
    pub(super) fn handle_deadlines(&mut self, core: &mut Core) {
        let now = self.now();
        if core
            .machine
            .poll_timeout()
            .is_some_and(|deadline| deadline <= now)
        {
            core.machine.handle_timeout(now);
            self.drain(core, &mut Context::default());
        }
    }

    /// Reads what the pipes `events` reported ready hold, and handles the
    /// ends they report; a link lost and maybe replaced (§2.9) by an
    /// event handled before is not the one that was polled: its events
    /// are dropped.
    fn handle_events(&mut self, core: &mut Core, events: Vec<(Ready, PollFlags)>) {
        for (what, event) in events {
            if event.is_empty() {
                continue;
            }
            let polled_link = match what {
                Ready::Wake => None,
                Ready::Reply(link) | Ready::Control(link) | Ready::Ended(link) => Some(link),
            };
            if let Some(link) = polled_link {
                if self.pid_at(link.index) != Some(link.pid) {
                    continue;
                }
            }
            match what {
                Ready::Wake => {
                    // Until a short read: the pipe is then empty.
                    let mut sink = [0u8; 256];
                    while matches!(nix::unistd::read(self.wake.as_fd(), &mut sink), Ok(n) if n == sink.len())
                    {
                    }
                }
                Ready::Reply(LinkId { index, .. }) => {
                    // A hung-up pipe is read to its end in this turn: a
                    // completion decided now must not be handed over
                    // while the target that died is still counted live.
                    let hung_up = event.intersects(PollFlags::POLLHUP | PollFlags::POLLERR);
                    self.read_replies(core, index, hung_up)
                }
                Ready::Control(LinkId { index, .. }) => self.flush(core, index),
                Ready::Ended(LinkId { index, .. }) => {
                    // Its last replies first (a reply socket that also
                    // closed was handled just before, as `Reply`).
                    self.read_replies(core, index, true);
                    let target = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
                    self.lose(core, target, "its process ended");
                }
            }
        }
    }

    /// Gives one request to the machine, then drains its effects.
    pub(super) fn request(&mut self, core: &mut Core, request: Request) {
        let now = self.now();
        let mut context = Context::default();
        match request {
            Request::Register {
                digest,
                staged,
                metadata,
                done,
            } => {
                // Checked here, in request order: an unregister of a hook
                // queued before this register has taken effect.
                let checked = match &metadata {
                    Some(metadata) => core.machine.check_hooks(digest, metadata),
                    None => Ok(()),
                };
                let identity = metadata.as_deref().map(metadata_identity);
                match checked.and_then(|()| {
                    core.machine.register_with_metadata(
                        digest,
                        Namespace::LocalPython,
                        identity,
                        now,
                    )
                }) {
                    Ok(op) => {
                        self.ops.insert(op, OpWaiter::Register(done));
                        let metadata = metadata.map(|m| m.to_json()).unwrap_or_default();
                        context.staged = Some((
                            digest,
                            Staged {
                                payload: Arc::new(staged),
                                metadata,
                            },
                        ));
                    }
                    Err(error) => self.defer(done, Err(OperationError::new(error))),
                }
            }
            Request::Unregister { handle, done } => match core.machine.unregister(&handle, now) {
                Ok(op) => {
                    self.ops.insert(op, OpWaiter::Unregister(done));
                }
                Err(error) => self.defer(done, Err(OperationError::new(error))),
            },
            Request::Task {
                handle,
                target,
                encoding,
                input,
                key,
                deadline,
                done,
            } => {
                let timeout = deadline.map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
                let submitted = match target {
                    Some(target) => core
                        .machine
                        .submit_with_timeout(&handle, target, timeout, now),
                    None => core.machine.submit_any(&handle, timeout, now),
                };
                match submitted {
                    Ok(seq) => {
                        let input = Some((encoding, input));
                        self.tasks.insert(seq.0, TaskWaiter { key, done, input });
                        self.task_keys.insert(key, seq.0);
                    }
                    Err(error) => self.defer(done, Err(TaskError::of(error))),
                }
            }
            Request::Cancel { key, done } => {
                let Some(seq) = self.task_keys.get(&key).copied() else {
                    // Refused at submit, or already ended.
                    self.defer(done, false);
                    return self.drain(core, &mut context);
                };
                match core.machine.cancel(Seq(seq), now) {
                    Ok(()) => self.cancels.entry(seq).or_default().push(done),
                    Err(_) => self.defer(done, false),
                }
            }
            Request::Inspect { done } => match core.machine.inspect(now) {
                Ok(seq) => {
                    let waiter = InspectWaiter {
                        tables: BTreeMap::new(),
                        done,
                    };
                    self.inspects.insert(seq.0, waiter);
                }
                Err(_) => self.defer(done, Vec::new()),
            },
            #[cfg(feature = "failpoints")]
            Request::RawControl { target, bytes } => {
                if let Some(Some(link)) = self.links.get_mut(usize::from(target.0)) {
                    link.outbox.tail().extend_from_slice(&bytes);
                    self.flush(core, usize::from(target.0));
                }
            }
            // `run` takes a close out of the queue itself (step 1).
            Request::Close => {}
        }
        self.drain(core, &mut context);
    }

    /// Drains the machine's effects and carries each out, in order.
    pub(super) fn drain(&mut self, core: &mut Core, context: &mut Context) {
        while let Some(effect) = core.machine.poll_effect() {
            match effect {
                Effect::Restage { staging, digest } => self.restage(core, staging, digest),
                Effect::Spawn {
                    target,
                    incarnation,
                } => self.spawn(core, target, incarnation),
                Effect::Joined {
                    target,
                    incarnation,
                } => core.record(TargetEvent::Joined {
                    target,
                    incarnation,
                }),
                Effect::JoinFailed {
                    target,
                    incarnation,
                    failure,
                } => {
                    self.fence_reasons.insert(
                        target,
                        format!("incarnation {incarnation} failed to join ({failure})"),
                    );
                    core.record(TargetEvent::JoinFailed {
                        target,
                        incarnation,
                        failure,
                    });
                }
                Effect::Abandoned {
                    target,
                    failed_joins,
                } => {
                    let event = TargetEvent::Abandoned {
                        target,
                        failed_joins,
                    };
                    let loss = core.losses.entry(target).or_default();
                    if !loss.is_empty() {
                        loss.push_str("; ");
                    }
                    loss.push_str(&format!(
                        "given up after {failed_joins} replacements in a row were lost before they joined"
                    ));
                    core.record(event);
                }
                Effect::Stage { staging, digest } => {
                    let staged = match context.staged.take() {
                        Some((staged_digest, staged)) if staged_digest == digest => staged,
                        _ => {
                            let failure = Failure::new(
                                ErrorCode::IO_FAILED,
                                "no staged payload for this register",
                            );
                            let _ = core.machine.stage_failed(staging, failure);
                            continue;
                        }
                    };
                    if core.machine.keeps_envelope(digest) {
                        core.kept.entry(digest).or_insert_with(|| Kept {
                            bytes: None,
                            payload: Some(staged.payload.clone()),
                            metadata: staged.metadata.clone(),
                        });
                    }
                    self.staged.insert(staging, staged);
                    if let Err(message) = failpoints::hit(failpoints::PARENT_AFTER_STAGE) {
                        self.staged.remove(&staging);
                        let failure = Failure::new(ErrorCode::IO_FAILED, message);
                        let _ = core.machine.stage_failed(staging, failure);
                    }
                }
                Effect::Send { target, frame } => self.send(core, target, frame),
                Effect::Verify {
                    target,
                    staging,
                    digest,
                } => self.verify_ahead(core, target, staging, digest),
                Effect::ReleaseStaged { staging } => {
                    self.staged.remove(&staging);
                    self.prune_kept(core);
                }
                Effect::Retire {
                    target,
                    incarnation,
                    tasks,
                } => {
                    core.record(TargetEvent::Retired {
                        target,
                        incarnation,
                        tasks,
                    });
                    let why = format!("it retired after {tasks} tasks");
                    if let Some((incarnation, complete)) =
                        self.bury(core, target, Duration::ZERO, &why, false)
                    {
                        core.machine.process_drained(target, incarnation, complete);
                    }
                }
                Effect::Fence { target, cause } => {
                    // A failed join's reason names the incarnation and the
                    // failure; else the machine's cause.
                    let why = self.fence_reasons.remove(&target).unwrap_or(cause);
                    if let Some((incarnation, complete)) =
                        self.bury(core, target, Duration::ZERO, &why, true)
                    {
                        // What it never reported started is handed over
                        // (§2.15), by this same drain.
                        core.machine.process_drained(target, incarnation, complete);
                    }
                }
                Effect::Completed {
                    op,
                    result,
                    outcomes,
                } => {
                    self.complete(op, result, outcomes, &core.losses);
                    self.prune_kept(core);
                }
                Effect::TaskDone {
                    seq,
                    target,
                    incarnation,
                    digest,
                    end,
                } => self.task_done(seq, target, incarnation, digest, end, context),
                Effect::Inspect { target, seq } => {
                    let index = usize::from(target.0);
                    if let Some(Some(link)) = self.links.get_mut(index) {
                        let frame = Frame::Inspect { seq: seq.0 };
                        if frame
                            .encode_into(link.outbox.tail(), self.max_frame_bytes)
                            .is_ok()
                        {
                            self.flush(core, index);
                        }
                    }
                }
                Effect::InspectDone { seq, missing } => {
                    if let Some(mut waiter) = self.inspects.remove(&seq.0) {
                        for target in missing {
                            waiter.tables.insert(target, None);
                        }
                        let tables = std::mem::take(&mut waiter.tables).into_iter().collect();
                        self.defer(waiter.done, tables);
                    }
                }
                Effect::CancelRefused { seq, .. } => {
                    for done in self.cancels.remove(&seq.0).unwrap_or_default() {
                        self.defer(done, false);
                    }
                }
            }
        }
    }

    /// Hands task `seq`'s end to its caller (the result frame the machine
    /// accepted, or the error of its end) and answers the cancels that
    /// wait on it.
    fn task_done(
        &mut self,
        seq: Seq,
        target: TargetId,
        incarnation: u32,
        digest: Digest,
        end: TaskEnd,
        context: &mut Context,
    ) {
        for done in self.cancels.remove(&seq.0).unwrap_or_default() {
            self.defer(done, end == TaskEnd::Cancelled);
        }
        let Some(waiter) = self.tasks.remove(&seq.0) else {
            return;
        };
        self.task_keys.remove(&waiter.key);
        let result = match end.error(seq, target, incarnation, digest) {
            Some(error) => Err(TaskError::of(error)),
            None => match context.task_result.take() {
                Some(result) => result.map_err(|failure| TaskError {
                    error: Error::new(failure.code, OperationKind::Task, failure.message)
                        .with_target(target)
                        .with_namespace(Namespace::LocalPython)
                        .with_digest(digest)
                        .with_seq(seq),
                    kind: failure.kind,
                    exception: failure.exception.into_boxed_slice(),
                }),
                // The machine ends a task with a result only for the
                // result frame being given to it.
                None => Err(TaskError::of(
                    Error::new(
                        ErrorCode::FRAME_INVALID,
                        OperationKind::Task,
                        "the task ended with a result that was not read",
                    )
                    .with_target(target)
                    .with_seq(seq),
                )),
            },
        };
        self.defer(waiter.done, result);
    }

    fn complete(
        &mut self,
        op: OpId,
        result: Result<Completion, Error>,
        outcomes: Vec<(TargetId, TargetOutcome)>,
        losses: &BTreeMap<TargetId, String>,
    ) {
        let Some(waiter) = self.ops.remove(&op) else {
            return;
        };
        match (waiter, result) {
            (OpWaiter::Register(done), Ok(Completion::Registered(handle))) => {
                if failpoints::hit(failpoints::PARENT_BEFORE_PUBLISH).is_err() {
                    // The machine already published; a refusal now would
                    // lie, so the injected fault is a crash.
                    // SAFETY: `_exit` ends the process without destructors.
                    unsafe { libc::_exit(failpoints::ABRUPT_EXIT_CODE) }
                }
                self.defer(done, Ok(handle));
            }
            (OpWaiter::Unregister(done), Ok(Completion::Unregistered(_))) => {
                self.defer(done, Ok(()))
            }
            (OpWaiter::Register(done), result) => {
                self.defer(done, Err(operation_error(result, outcomes, losses)))
            }
            (OpWaiter::Unregister(done), result) => {
                self.defer(done, Err(operation_error(result, outcomes, losses)))
            }
        }
    }

    /// Kills and reaps a target, then reads what it wrote and was not read
    /// yet (the machine ends its tasks and the inspections' waits for it
    /// when it is told of the loss). Returns the process's incarnation and
    /// whether everything it wrote was read (`specs/protocol.md` §2.15:
    /// give both to [`Parent::process_drained`] once the machine counts
    /// it lost); `None` when the target has no process.
    ///
    /// `grace`: how long a target that is ending on its own may take to
    /// exit before SIGKILL (its exit status then says why it ended).
    /// `why`: what the IO thread saw (kept for [`Worker::target_loss`]).
    ///
    /// [`Parent::process_drained`]: crate::protocol::Parent::process_drained
    fn bury(
        &mut self,
        core: &mut Core,
        target: TargetId,
        grace: Duration,
        why: &str,
        loss: bool,
    ) -> Option<(u32, bool)> {
        let index = usize::from(target.0);
        let reaped = match self.links.get_mut(index) {
            Some(Some(link)) => link.process.reap(grace),
            _ => return None,
        };
        let reaped = match reaped {
            Ok(exit) => {
                core.exits.insert(target, exit);
                true
            }
            Err(_) => false,
        };
        // Reaped, it writes nothing more: what it wrote is all there.
        let complete = reaped && self.read_buried(core, index);
        let link = self.links.get_mut(index).and_then(Option::take)?;
        self.completed = true;
        self.starting.remove(&index);
        let how = core
            .exits
            .get(&target)
            .map_or_else(|| "could not be reaped".to_owned(), |e| e.to_string());
        let reason = format!("{why}; it {how}");
        if self.respawn && loss {
            core.record(TargetEvent::Lost {
                target,
                incarnation: link.incarnation,
                cause: reason.clone(),
            });
        }
        core.losses.insert(target, reason);
        Some((link.incarnation, complete))
    }

    /// A target died or broke the protocol: kill, reap, tell the machine.
    pub(super) fn lose(&mut self, core: &mut Core, target: TargetId, why: &str) {
        if self
            .links
            .get(usize::from(target.0))
            .is_none_or(Option::is_none)
        {
            return;
        }

        let drained = self.bury(core, target, LOST_GRACE, why, true);
        let cause = core
            .losses
            .get(&target)
            .cloned()
            .unwrap_or_else(|| why.to_owned());
        let _ = core.machine.target_died(target, &cause, self.now());
        if let Some((incarnation, complete)) = drained {
            core.machine.process_drained(target, incarnation, complete);
        }
        self.drain(core, &mut Context::default());
    }

    fn close(&mut self, core: &mut Core) {
        let _ = core.machine.close();
        self.drain(core, &mut Context::default());
        for link in self.links.iter_mut().flatten() {
            link.process.close_control();
        }
        let deadline = Instant::now() + CLOSE_GRACE;
        for (index, entry) in self.links.iter_mut().enumerate() {
            if let Some(mut link) = entry.take() {
                let left = deadline.saturating_duration_since(Instant::now());
                if let Ok(exit) = link.process.reap(left) {
                    core.exits
                        .insert(TargetId(u16::try_from(index).unwrap_or(u16::MAX)), exit);
                }
            }
        }
        // Every replacement is reaped: the template goes last, once no
        // spawn waits for it (a replacement forked meanwhile is dropped:
        // killed and reaped).
        for spawner in std::mem::take(&mut self.spawners) {
            let _ = spawner.join();
        }
        self.spawned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        if let Some(zygote) = self.zygote.take() {
            if let Ok(mut zygote) = Arc::try_unwrap(zygote) {
                let _ = zygote.close();
            }
        }
        self.starting.clear();
        core.kept.clear();
        // The machine's close ended every task in flight (drained above);
        // any waiter left is dropped here, which wakes it as abandoned.
        self.tasks.clear();
        self.task_keys.clear();
        self.cancels.clear();
        // The machine's close ended every inspection (drained above).
        self.inspects.clear();
        self.staged.clear();
        // Ops still waiting were completed by the machine's close; any left
        // are dropped here, which wakes their callers as abandoned.
        self.ops.clear();
        core.io_running = false;
        core.wake = None;
        for request in std::mem::take(&mut core.requests) {
            refuse(request, false);
        }
    }
}
