//! The OS pieces of the rule as the Worker runs it: `poll(2)` over its
//! reply sockets and pipes, after a bounded adaptive spin ([`Spin`]), and
//! its wake pipes.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Instant;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::run::{PollFailed, Poller, Readiness};
use crate::io::process::TrackedFd;
use crate::io::spin::Spin;

/// `poll(2)` and pipes; a leader's poll first spins as its [`Spin`]
/// decides.
#[derive(Debug, Default)]
pub struct Os {
    spin: Spin,
}

impl Os {
    /// `poll(2)` whose waits spin as `spin` decides.
    pub fn new(spin: Spin) -> Os {
        Os { spin }
    }

    /// Polls `polled` without blocking until one is ready, `until` or
    /// `deadline` (the earlier): whether one is.
    fn spin_until(polled: &mut [PollFd<'_>], until: Instant, deadline: Option<Instant>) -> bool {
        let until = deadline.map_or(until, |deadline| deadline.min(until));
        loop {
            if matches!(nix::poll::poll(polled, PollTimeout::ZERO), Ok(n) if n > 0) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::hint::spin_loop();
        }
    }
}

impl Poller for Os {
    type Fd = Arc<TrackedFd>;
    type Pipe = TrackedFd;

    /// Spins first when the [`Spin`] says this wait should (polling
    /// without blocking, for its budget at most), then polls until an
    /// event or `deadline`; tells the [`Spin`] when a wait ended in an
    /// event, for its measures.
    fn poll(
        &self,
        fds: &[&Arc<TrackedFd>],
        deadline: Option<Instant>,
    ) -> Result<Vec<Readiness>, PollFailed> {
        let mut polled: Vec<PollFd<'_>> = fds
            .iter()
            .map(|fd| PollFd::new(fd.as_fd(), PollFlags::POLLIN))
            .collect();
        let start = Instant::now();
        if let Some(until) = self.spin.next_wait(start) {
            if deadline.is_none_or(|deadline| deadline > start) {
                Self::spin_until(&mut polled, until, deadline);
            }
        }
        let (result, events) = poll_events(&mut polled, deadline);
        if matches!(result, Err(errno) if errno != Errno::EINTR) {
            return Err(PollFailed);
        }
        if events.iter().any(|event| !event.is_empty()) {
            self.spin.ended(start, Instant::now());
        }
        Ok(events
            .into_iter()
            .map(|event| {
                if event.is_empty() {
                    Readiness::Idle
                } else if event.intersects(PollFlags::POLLHUP | PollFlags::POLLERR) {
                    Readiness::HungUp
                } else {
                    Readiness::Readable
                }
            })
            .collect())
    }

    fn drain(&self, fd: &Arc<TrackedFd>) {
        // Until a short read: the pipe is then empty.
        let mut sink = [0u8; 64];
        while matches!(nix::unistd::read(fd.as_fd(), &mut sink), Ok(n) if n == sink.len()) {}
    }

    fn ring(&self, pipe: &TrackedFd) {
        ring(pipe);
    }
}

/// Writes a byte into a wake pipe (a full pipe already guarantees a
/// wake-up).
pub fn ring(pipe: &TrackedFd) {
    let _ = nix::unistd::write(pipe, &[1]);
}

/// `poll` over `fds` until an event or `deadline`: its result, and the
/// events each descriptor returned.
pub fn poll_events(
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
