//! The state lock callers and the IO thread share (`Shared`), and a
//! caller's wait as the leader: reading every live target's replies until
//! its own result is there, stepping down, and handing the results it
//! decided to their callers once the lock is released ([`crate::io::lead`]
//! says who reads which reply socket).

use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::respawn::Kept;
use super::Core;
#[cfg(doc)]
use super::Worker;
use crate::io::handoff::{self, Pending};
use crate::io::process::TrackedFd;

pub(super) struct Shared {
    /// The process that built the Worker: the only one that may use it
    /// (its threads, targets and locks exist there alone).
    pub(super) process: u32,
    pub(super) core: Mutex<Core>,
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
        std::process::id() != self.process
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands over the completions decided under the lock, then wakes the
    /// leader if one of them may be its result: checked under the lock
    /// after the hand-over, so a leader that began meanwhile sees its
    /// result when it next looks, and one that leads now is woken.
    pub(super) fn finish(&self, leaving: Leaving) {
        let Leaving {
            handovers,
            freed,
            recheck,
        } = leaving;
        handovers.into_iter().for_each(|handover| handover());
        drop(freed);
        if recheck {
            let core = self.lock();
            if let Some(io) = core.io.as_ref().filter(|io| io.watch.has_leader()) {
                // A full pipe already guarantees a wake-up.
                let _ = nix::unistd::write(&io.leader_wake_write, &[1]);
            }
        }
    }

    /// The leader stops leading, and wakes the IO thread for what it
    /// leaves ([`crate::io::lead`]).
    fn step_down(&self) {
        let mut core = self.lock();
        if let Some(mut io) = core.io.take() {
            io.watch.step_down();
            let leaving = io.leave(&core, true, false);
            core.io = Some(io);
            drop(core);
            self.finish(leaving);
        }
    }

    /// Waits for `pending` as the leader ([`crate::io::lead`]): reads the
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
        let mut replies: Vec<(usize, i32, Arc<TrackedFd>)> = Vec::new();
        let mut ready: Vec<(usize, i32, bool)> = Vec::new();
        let mut woken = false;
        let mut leading = Leading {
            shared: self,
            wake: None,
        };
        // A wait whose time is already up still reads what is there once
        // (one poll without waiting): a zero timeout is a look.
        let mut polled = false;
        loop {
            let mut core = self.lock();
            let Some(mut io) = core.io.take() else {
                return Err(pending);
            };
            if leading.wake.is_none() {
                let passed = polled && until.is_some_and(|until| Instant::now() >= until);
                let live = io.live();
                // Follow while the IO thread reads every reply socket (many
                // results in flight): leading too would wake both threads
                // for every reply.
                if pending.is_complete()
                    || passed
                    || io.watch.io_reads_all(&live)
                    || !io.watch.try_lead(&live)
                {
                    let leaving = io.leave(&core, true, false);
                    core.io = Some(io);
                    drop(core);
                    self.finish(leaving);
                    return Err(pending);
                }
                leading.wake = Some(io.leader_wake.clone());
            } else {
                if std::mem::take(&mut woken) {
                    let mut sink = [0u8; 64];
                    while matches!(nix::unistd::read(io.leader_wake.as_fd(), &mut sink), Ok(n) if n == sink.len())
                    {
                    }
                }
                for (index, pid, hung_up) in ready.drain(..) {
                    if io.pid_at(index) == Some(pid) {
                        io.read_replies(&mut core, index, hung_up);
                    }
                }
                io.handle_deadlines(&mut core);
            }
            let live = io.live();
            if !io.watch.leads_over(&live) || replies.len() != live.len() {
                io.watch.relead(&live);
                replies = live
                    .iter()
                    .filter_map(|&(index, pid)| {
                        io.links[index]
                            .as_ref()
                            .map(|link| (index, pid, link.process.reply_shared()))
                    })
                    .collect();
            }
            let deadline = io.next_deadline(&core).into_iter().chain(until).min();
            io.watch.set_leader_deadline(deadline);
            let leaving = io.leave(&core, true, true);
            core.io = Some(io);
            drop(core);
            self.finish(leaving);
            let passed = polled && until.is_some_and(|until| Instant::now() >= until);
            if pending.is_complete() || passed {
                leading.step_down();
                return if pending.is_complete() {
                    Ok(pending.wait())
                } else {
                    Err(pending)
                };
            }
            let Some(wake) = leading.wake.clone() else {
                return Err(pending);
            };
            let mut fds = vec![PollFd::new(wake.as_fd(), PollFlags::POLLIN)];
            fds.extend(
                replies
                    .iter()
                    .map(|(_, _, fd)| PollFd::new(fd.as_fd(), PollFlags::POLLIN)),
            );
            let (result, events) = poll_events(&mut fds, deadline);
            polled = true;
            drop(fds);
            if matches!(result, Err(errno) if errno != Errno::EINTR) {
                // Unrecoverable here: leave the replies to the IO thread.
                leading.step_down();
                return Err(pending);
            }
            woken = !events[0].is_empty();
            for ((index, pid, _), event) in replies.iter().zip(&events[1..]) {
                if !event.is_empty() {
                    let hung_up = event.intersects(PollFlags::POLLHUP | PollFlags::POLLERR);
                    ready.push((*index, *pid, hung_up));
                }
            }
        }
    }
}

/// A completion decided under the state lock, handed to its caller once
/// the lock is released.
pub(super) type Handover = Box<dyn FnOnce() + Send>;

/// A caller's leadership, with the leader wake pipe while it leads: it
/// steps down when dropped while still leading (the wait unwound), so the
/// IO thread takes the replies back instead of no one reading them.
struct Leading<'a> {
    shared: &'a Shared,
    wake: Option<Arc<TrackedFd>>,
}

impl Leading<'_> {
    fn step_down(&mut self) {
        if self.wake.take().is_some() {
            self.shared.step_down();
        }
    }
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        self.step_down();
    }
}

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

/// Wakes the IO thread (it rebuilds its `poll` set).
pub(super) fn io_wake(core: &Core) {
    if let Some(wake) = &core.wake {
        // A full wake pipe already guarantees a wake-up.
        let _ = nix::unistd::write(&**wake, &[1]);
    }
}

/// `poll` over `fds` until an event or `deadline`: its result, and the
/// events each descriptor returned.
pub(super) fn poll_events(
    fds: &mut [PollFd<'_>],
    deadline: Option<Instant>,
) -> (nix::Result<i32>, Vec<PollFlags>) {
    let polled = nix::poll::poll(fds, poll_timeout(deadline));
    let events = fds
        .iter()
        .map(|fd| fd.revents().unwrap_or(PollFlags::empty()))
        .collect();
    (polled, events)
}

/// A `poll` timeout that ends no earlier than `deadline` (`None`: block).
fn poll_timeout(deadline: Option<Instant>) -> PollTimeout {
    match deadline {
        None => PollTimeout::NONE,
        Some(deadline) => {
            let left = deadline.saturating_duration_since(Instant::now());
            let millis = left.as_micros().div_ceil(1000);
            PollTimeout::try_from(u64::try_from(millis).unwrap_or(u64::MAX))
                .unwrap_or(PollTimeout::MAX)
        }
    }
}
