//! The leader/followers rule as code, generic over the state lock
//! ([`StateLock`], [`Locked`]) and the OS pieces ([`Poller`]): a caller's
//! wait as the leader ([`lead`]), stepping down ([`step_down`]), leaving
//! the state lock ([`release`]) and what is owed after it ([`finish`]:
//! hand the results over, then wake the leader).
//!
//! The Worker runs it with `poll(2)` over its pipes and sockets
//! (`super::os`) and its state lock (`crate::io::worker`); the loom
//! model (`tests/loom_lead.rs`) runs the same functions with a model of
//! level-triggered pipes, so what loom checks is this code.

use std::time::Instant;

use nix::unistd::Pid;

use super::{LinkId, Watch};
use crate::io::handoff::{Abandoned, Pending};

/// What `poll` reported for one descriptor.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Readiness {
    /// Nothing to read.
    Idle,
    /// Bytes to read.
    Readable,
    /// Hung up or failed (the writer is gone): read what is left, then
    /// the end.
    HungUp,
}

/// `poll` failed for a reason retrying would not cure.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PollFailed;

/// The OS pieces of the rule: waiting on descriptors, and the wake pipes.
pub trait Poller {
    /// A descriptor polled for reading (a reply socket, a wake pipe's read
    /// end), kept by a leader across its polls.
    type Fd: Clone;
    /// A wake pipe's write end.
    type Pipe: ?Sized;
    /// Waits until one of `fds` is readable or hung up, or `deadline`
    /// passes (`None`: no deadline): what each reported, in order. An
    /// interrupted wait reports what it saw (maybe nothing).
    ///
    /// # Errors
    /// [`PollFailed`] when waiting failed otherwise.
    fn poll(
        &self,
        fds: &[&Self::Fd],
        deadline: Option<Instant>,
    ) -> Result<Vec<Readiness>, PollFailed>;
    /// Empties the wake pipe whose read end is `fd`.
    fn drain(&self, fd: &Self::Fd);
    /// Writes the wake pipe `pipe` (a full pipe already wakes its reader).
    fn ring(&self, pipe: &Self::Pipe);
}

/// What a thread leaving the state lock still owes once it released it
/// ([`finish`]).
pub trait Owed {
    /// Whether the leader must be woken after the hand-over: a result was
    /// decided by a thread that does not lead.
    fn recheck(&self) -> bool;
    /// Hands the results decided under the lock to their callers (and
    /// frees what was left to free after them).
    fn hand_over(self);
}

/// The state lock of a started Worker (callers and the IO thread take
/// it in turn) and what the rule needs of the OS.
pub trait StateLock {
    /// The OS pieces.
    type Poller: Poller;
    /// What a thread leaving the lock owes.
    type Owed: Owed;
    /// The lock held, with the IO state.
    type Locked<'a>: Locked<Self::Poller, Owed = Self::Owed>
    where
        Self: 'a;

    /// The OS pieces.
    fn poller(&self) -> &Self::Poller;

    /// Takes the state lock: `None` when no IO thread runs (not started,
    /// or closed: every result is decided already).
    fn enter(&self) -> Option<Self::Locked<'_>>;

    /// A known bug to run instead of the rule (the loom model's mutations;
    /// `None`: the rule).
    #[cfg(loom)]
    fn mutation(&self) -> Option<Mutation> {
        None
    }
}

/// The state lock held, with the IO state: what the rule reads and does
/// under it. Links are named by index and process id ([`LinkId`]).
pub trait Locked<P: Poller> {
    /// What leaving the lock owes ([`StateLock::Owed`]).
    type Owed;
    /// Who reads which reply socket.
    fn watch(&self) -> &Watch;
    /// Who reads which reply socket, to change.
    fn watch_mut(&mut self) -> &mut Watch;
    /// Every live link.
    fn live(&self) -> Vec<LinkId>;
    /// The process id of the link at `index`, if live.
    fn pid_at(&self, index: usize) -> Option<Pid>;
    /// The reply socket of the link at `index`, if live.
    fn reply_socket(&self, index: usize) -> Option<P::Fd>;
    /// The read end of the leader wake pipe.
    fn leader_wake(&self) -> P::Fd;
    /// The write end of the leader wake pipe.
    fn leader_wake_write(&self) -> &P::Pipe;
    /// Reads what the reply socket of the link at `index` holds (to its
    /// end when `hung_up`) and decides the results it brings.
    fn read_replies(&mut self, index: usize, hung_up: bool);
    /// Handles every deadline that passed.
    fn handle_deadlines(&mut self);
    /// The earliest deadline anything waits on.
    fn next_deadline(&self) -> Option<Instant>;
    /// Leaves the lock: if `settle`, wakes the IO thread when what is left
    /// needs it ([`Watch::io_must_wake`]); returns what is owed once the
    /// lock is released, whose recheck is due when a result was decided
    /// and the leaving thread is not the `leader`.
    fn leave(&mut self, settle: bool, leader: bool) -> Self::Owed;
}

/// Known bugs of the rule, each a switch in this code, for the loom model
/// to show that it catches them (`tests/loom_lead.rs`). Only a loom build
/// can select one (`StateLock::mutation` exists under `cfg(loom)`
/// alone): every other build runs the rule.
#[doc(hidden)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mutation {
    /// [`finish`] wakes the leader (under the lock) before handing over.
    WakeLeaderBeforeHandOver,
    /// [`finish`] never wakes the leader.
    NeverWakeLeader,
    /// A leader steps down without waking the IO thread for what it
    /// leaves.
    NoWakeAtStepDown,
    /// A thread that does not lead leaves the lock ([`release`]) without
    /// waking the IO thread for what it leaves.
    NoWakeAtRelease,
}

/// Whether `state` runs `mutation` instead of the rule (never outside
/// loom).
fn mutated<S: StateLock>(state: &S, mutation: Mutation) -> bool {
    #[cfg(loom)]
    {
        state.mutation() == Some(mutation)
    }
    #[cfg(not(loom))]
    {
        let _ = (state, mutation);
        false
    }
}

/// Does what a thread leaving the state lock owes once it released it:
/// hands the results over, then, if one of them may be the leader's
/// (`recheck`), wakes the leader if one leads, checked under the lock
/// after the hand-over: a leader that began before that check is woken
/// and finds its hand-off complete; one that began after it finds its
/// hand-off complete before it first polls.
pub fn finish<S: StateLock>(state: &S, owed: S::Owed) {
    let recheck = owed.recheck();
    if mutated(state, Mutation::WakeLeaderBeforeHandOver) {
        if recheck {
            wake_leader(state);
        }
        owed.hand_over();
        return;
    }
    owed.hand_over();
    if recheck && !mutated(state, Mutation::NeverWakeLeader) {
        wake_leader(state);
    }
}

/// Writes the leader wake pipe if a leader leads (under the lock).
fn wake_leader<S: StateLock>(state: &S) {
    if let Some(locked) = state.enter() {
        if locked.watch().has_leader() {
            state.poller().ring(locked.leader_wake_write());
        }
    }
}

/// A thread that does not lead leaves the state lock: wakes the IO thread
/// if what it leaves needs it, releases the lock, then [`finish`]es.
pub fn release<S: StateLock>(state: &S, mut locked: S::Locked<'_>) {
    let settle = !mutated(state, Mutation::NoWakeAtRelease);
    let owed = locked.leave(settle, false);
    drop(locked);
    finish(state, owed);
}

/// The leader stops leading, and wakes the IO thread for what it leaves
/// (the reply sockets it read, the deadlines it watched).
pub fn step_down<S: StateLock>(state: &S) {
    if let Some(mut locked) = state.enter() {
        locked.watch_mut().step_down();
        let settle = !mutated(state, Mutation::NoWakeAtStepDown);
        let owed = locked.leave(settle, false);
        drop(locked);
        finish(state, owed);
    }
}

/// A caller's leadership, with the leader wake pipe while it leads: it
/// steps down when dropped while still leading (the wait unwound), so the
/// IO thread takes the replies back instead of no one reading them.
struct Leading<'a, S: StateLock> {
    state: &'a S,
    wake: Option<<S::Poller as Poller>::Fd>,
}

impl<S: StateLock> Leading<'_, S> {
    fn step_down(&mut self) {
        if self.wake.take().is_some() {
            step_down(self.state);
        }
    }
}

impl<S: StateLock> Drop for Leading<'_, S> {
    fn drop(&mut self) {
        self.step_down();
    }
}

/// Waits for `pending` as the leader: reads the replies of every live
/// link and handles the deadlines, for every caller, until this caller's
/// result is there (`Ok`) or `until` passes. `Err(pending)`, having
/// settled what it leaves, when the time is up, when another thread leads
/// or the IO thread reads every reply socket (this caller follows: its
/// result is handed over by whoever reads it), or when no IO thread runs
/// (the result is decided already).
///
/// # Errors
/// `Err(pending)` as said: the caller then waits on its hand-off.
pub fn lead<S: StateLock, T>(
    state: &S,
    pending: Pending<T>,
    until: Option<Instant>,
) -> Result<Result<T, Abandoned>, Pending<T>> {
    let mut replies: Vec<(LinkId, <S::Poller as Poller>::Fd)> = Vec::new();
    // The links whose reply socket the last poll found ready, and whether
    // it hung up.
    let mut ready: Vec<(LinkId, bool)> = Vec::new();
    let mut woken = false;
    let mut leading = Leading::<S> { state, wake: None };
    // A wait whose time is already up still reads what is there once
    // (one poll without waiting): a zero timeout is a look.
    let mut polled = false;
    let passed = |polled: bool| polled && until.is_some_and(|until| Instant::now() >= until);
    loop {
        let Some(mut locked) = state.enter() else {
            return Err(pending);
        };
        if let Some(wake) = &leading.wake {
            if std::mem::take(&mut woken) {
                state.poller().drain(wake);
            }
            for (link, hung_up) in ready.drain(..) {
                if locked.pid_at(link.index) == Some(link.pid) {
                    locked.read_replies(link.index, hung_up);
                }
            }
            locked.handle_deadlines();
        } else {
            let live = locked.live();
            // Follow while the IO thread reads every reply socket (many
            // results in flight): leading too would wake both threads for
            // every reply.
            if pending.is_complete()
                || passed(polled)
                || locked.watch().io_reads_all(&live)
                || !locked.watch_mut().try_lead(&live)
            {
                release(state, locked);
                return Err(pending);
            }
            leading.wake = Some(locked.leader_wake());
        }
        let live = locked.live();
        if !locked.watch().leads_over(&live) || replies.len() != live.len() {
            locked.watch_mut().relead(&live);
            replies = live
                .iter()
                .filter_map(|&link| locked.reply_socket(link.index).map(|fd| (link, fd)))
                .collect();
        }
        let deadline = locked.next_deadline().into_iter().chain(until).min();
        locked.watch_mut().set_leader_deadline(deadline);
        let owed = locked.leave(true, true);
        drop(locked);
        finish(state, owed);
        if pending.is_complete() || passed(polled) {
            leading.step_down();
            return if pending.is_complete() {
                Ok(pending.wait())
            } else {
                Err(pending)
            };
        }
        let Some(wake) = &leading.wake else {
            return Err(pending);
        };
        let fds: Vec<&<S::Poller as Poller>::Fd> = std::iter::once(wake)
            .chain(replies.iter().map(|(_, fd)| fd))
            .collect();
        let polled_now = state.poller().poll(&fds, deadline);
        drop(fds);
        polled = true;
        let Ok(events) = polled_now else {
            // Unrecoverable here: leave the replies to the IO thread.
            leading.step_down();
            return Err(pending);
        };
        woken = events.first().is_some_and(|e| *e != Readiness::Idle);
        for ((link, _), event) in replies.iter().zip(events.iter().skip(1)) {
            if *event != Readiness::Idle {
                ready.push((*link, *event == Readiness::HungUp));
            }
        }
    }
}
