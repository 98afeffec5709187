//! The state lock callers and the IO thread share (`Shared`), and a
//! caller's wait as the leader: reading every live target's replies until
//! its own result is there, stepping down, and handing the results it
//! decided to their callers once the lock is released. The rule is
//! [`crate::io::lead`]'s generic code ([`lead::lead`], [`lead::finish`]),
//! run here over the Worker's state lock and `poll(2)` ([`Os`]).

use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use nix::unistd::Pid;

use super::io_loop::IoLoop;
use super::respawn::Kept;
use super::Core;
#[cfg(doc)]
use super::Worker;
use crate::io::handoff::{self, Pending};
pub(super) use crate::io::lead::os::poll_events;
use crate::io::lead::os::Os;
use crate::io::lead::{self, LinkId, Locked, Owed, StateLock, Watch};
use crate::io::process::TrackedFd;
use crate::io::sys::ForkMarker;

pub(super) struct Shared {
    /// The process that built the Worker: the only one that may use it
    /// (its threads, targets and locks exist there alone).
    pub(super) process: u32,
    /// Says whether this is a child forked from `process`, without a
    /// system call: the check every call makes ([`Shared::foreign`]).
    pub(super) fork_marker: ForkMarker,
    pub(super) core: std::sync::Mutex<Core>,
    /// `poll(2)`, with the leader's adaptive spin
    /// ([`crate::io::spin::Spin`]).
    pub(super) poller: Os,
}

impl Shared {
    /// Whether this is another process than the one that built the Worker:
    /// a child forked from it (`os.fork()` in Python, a worker runtime's
    /// fork), holding a copy of its memory. There the Worker's threads do
    /// not exist, its locks may be held forever, and its targets are not
    /// this process's children: nothing of it may be touched, nor dropped
    /// (dropping would kill the owner's targets). See [`Worker`], "Forked
    /// children".
    pub(super) fn foreign(&self) -> bool {
        self.fork_marker.forked()
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands over the completions decided under the lock, then wakes the
    /// leader if one of them may be its result ([`lead::finish`]).
    pub(super) fn finish(&self, leaving: Leaving) {
        lead::finish(self, leaving);
    }

    /// Waits for `pending` as the leader ([`lead::lead`]): reads the
    /// replies of every live target and handles the deadlines, for every
    /// caller, until this caller's result is there (`Ok`) or `until`
    /// passes. `Err(pending)`, having settled what it leaves, when the
    /// time is up, when another thread leads (this caller follows: its
    /// result is handed over by whoever reads it), or when no IO thread
    /// runs (the result is decided already).
    pub(super) fn lead<T>(
        &self,
        pending: Pending<T>,
        until: Option<Instant>,
    ) -> Result<Result<T, handoff::Abandoned>, Pending<T>> {
        lead::lead(self, pending, until)
    }
}

impl StateLock for Shared {
    type Poller = Os;
    type Owed = Leaving;
    type Locked<'a> = Held<'a>;

    fn poller(&self) -> &Os {
        &self.poller
    }

    fn enter(&self) -> Option<Held<'_>> {
        let mut core = self.lock();
        let io = core.io.take()?;
        Some(Held { core, io: Some(io) })
    }
}

/// The state lock held with the IO state taken out of it (the IO state's
/// methods take the rest of `Core` beside it); put back before the lock
/// is released.
pub(super) struct Held<'a> {
    core: MutexGuard<'a, Core>,
    /// `Some` until dropped.
    io: Option<Box<IoLoop>>,
}

impl Held<'_> {
    fn io(&self) -> &IoLoop {
        self.io
            .as_deref()
            .unwrap_or_else(|| unreachable!("the IO state is out until dropped"))
    }

    fn parts(&mut self) -> (&mut IoLoop, &mut Core) {
        let io = self
            .io
            .as_deref_mut()
            .unwrap_or_else(|| unreachable!("the IO state is out until dropped"));
        (io, &mut self.core)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        // Back before the guard releases the lock (fields drop after
        // this).
        self.core.io = self.io.take();
    }
}

impl Locked<Os> for Held<'_> {
    type Owed = Leaving;

    fn watch(&self) -> &Watch {
        &self.io().watch
    }

    fn watch_mut(&mut self) -> &mut Watch {
        &mut self.parts().0.watch
    }

    fn live(&self) -> Vec<LinkId> {
        self.io().live()
    }

    fn pid_at(&self, index: usize) -> Option<Pid> {
        self.io().pid_at(index)
    }

    fn reply_socket(&self, index: usize) -> Option<Arc<TrackedFd>> {
        self.io()
            .links
            .get(index)
            .and_then(Option::as_ref)
            .map(|link| link.process.reply_shared())
    }

    fn leader_wake(&self) -> Arc<TrackedFd> {
        self.io().leader_wake.clone()
    }

    fn leader_wake_write(&self) -> &TrackedFd {
        &self.io().leader_wake_write
    }

    fn read_replies(&mut self, index: usize, hung_up: bool) {
        let (io, core) = self.parts();
        io.read_replies(core, index, hung_up);
    }

    fn handle_deadlines(&mut self) {
        let (io, core) = self.parts();
        io.handle_deadlines(core);
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.io().next_deadline(&self.core)
    }

    fn leave(&mut self, settle: bool, leader: bool) -> Leaving {
        let (io, core) = self.parts();
        io.leave(core, settle, leader)
    }
}

/// A completion decided under the state lock, handed to its caller once
/// the lock is released.
pub(super) type Handover = Box<dyn FnOnce() + Send>;

/// What a thread leaving the state lock still owes once it released it:
/// the completions decided meanwhile, then, if `recheck` (a result was
/// decided, and this thread does not lead), a wake-up of the leader, who
/// may be waiting for one of them.
pub(super) struct Leaving {
    pub(super) handovers: Vec<Handover>,
    /// Kept payloads no registration needs any more, freed after the
    /// hand-over.
    pub(super) freed: Vec<Kept>,
    pub(super) recheck: bool,
}

impl Owed for Leaving {
    fn recheck(&self) -> bool {
        self.recheck
    }

    fn hand_over(self) {
        let Leaving {
            handovers,
            freed,
            recheck: _,
        } = self;
        handovers.into_iter().for_each(|handover| handover());
        drop(freed);
    }
}

/// Wakes the IO thread (it rebuilds its `poll` set).
pub(super) fn io_wake(core: &Core) {
    if let Some(wake) = &core.wake {
        crate::io::lead::os::ring(wake);
    }
}
