//! A bounded, adaptive spin before a caller blocks for its own reply
//! (`specs/threads.md`, "The leader's spin").
//!
//! A caller waiting for its result as the leader polls the reply sockets.
//! Blocking in `poll` costs a sleep and a wake-up, and on a machine whose
//! idle CPUs halt, waking one costs tens of microseconds, more than a
//! short task's whole round trip. Polling without blocking for a few tens
//! of microseconds first keeps the caller's CPU awake for a reply that is
//! about to come. It does not always pay: a long task's reply comes after
//! any spin, and when the CPUs are busy the spin takes time from the
//! processes it waits for. So the choice is measured, per Worker:
//!
//! * every wait that ends in an event, begun within [`CYCLE_GAP`] of the
//!   previous one's end, records the caller's whole cycle (from the end of
//!   its previous wait to the end of this one: its own work, the target's
//!   and the wait, so that CPU a spin takes from either shows), in one of
//!   two moving averages (weight 1/8 for the newest): cycles whose wait
//!   spun and the others;
//! * a wait spins when spinning is the better mode: when no spun wait was
//!   measured yet, or the spun waits' average is at most 7/8 of the
//!   others' (spinning must clearly pay for the CPU it burns);
//! * every [`EXPLORE_EVERY`]-th wait takes the other mode, so each
//!   average follows the machine as its load changes;
//! * a spin lasts at most the budget ([`DEFAULT_SPIN`] unless configured;
//!   zero turns spinning off), and only while a caller waits: an idle
//!   Worker polls nothing and uses no CPU.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The default spin budget: 50 µs, chosen by `python/benchmarks/round_trip.py`
/// (`BENCHMARKS.md`, "Round trip and the leader's spin").
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// The longest spin budget a Worker accepts: 1 ms.
pub const MAX_SPIN: Duration = Duration::from_millis(1);

/// A wait is measured with the caller's work before it only when it began
/// within this long of the caller's previous wait ([`Spin::ended`]).
pub const CYCLE_GAP: Duration = Duration::from_millis(1);

/// One wait in this many takes the mode the averages do not prefer.
pub const EXPLORE_EVERY: u64 = 16;

/// The adaptive spin of one Worker's leaders (module docs).
#[derive(Debug)]
pub struct Spin {
    budget: Duration,
    /// Waits decided so far.
    waits: AtomicU64,
    /// Moving averages, in nanoseconds, of the cycles whose wait spun and
    /// of the others; 0 until one is measured.
    spun: AtomicU64,
    blocked: AtomicU64,
    /// When the last wait ended, in nanoseconds after `epoch` (0: none).
    last_end: AtomicU64,
    epoch: Instant,
}

impl Default for Spin {
    fn default() -> Self {
        Spin::new(DEFAULT_SPIN)
    }
}

impl Spin {
    /// A spin of at most `budget` per wait (zero: never spin).
    pub fn new(budget: Duration) -> Spin {
        Spin {
            budget,
            waits: AtomicU64::new(0),
            spun: AtomicU64::new(0),
            blocked: AtomicU64::new(0),
            last_end: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Records the end, at `end`, of a wait that began at `start` and
    /// spun or not. What is measured is the caller's whole cycle, from
    /// the end of its previous wait to the end of this one (its own work,
    /// its request, the target's, the wait), so that a spin that takes CPU
    /// time from the caller or its target later shows too; only when the
    /// caller began this wait within [`CYCLE_GAP`] of its previous one (a
    /// caller waiting back to back: anything else is idle time).
    pub fn ended(&self, spun: bool, start: Instant, end: Instant) {
        let last = self.last_end.swap(self.nanos(end), Ordering::Relaxed);
        if last == 0 {
            return;
        }
        let (start, end) = (self.nanos(start), self.nanos(end));
        if start.saturating_sub(last) <= CYCLE_GAP.as_nanos() as u64 {
            self.record(spun, Duration::from_nanos(end.saturating_sub(last)));
        }
    }

    /// The spin budget.
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// Whether the wait starting at `now` spins, and until when.
    pub fn next_wait(&self, now: Instant) -> Option<Instant> {
        if self.budget.is_zero() {
            return None;
        }
        let wait = self.waits.fetch_add(1, Ordering::Relaxed);
        let explore = wait % EXPLORE_EVERY == EXPLORE_EVERY - 1;
        (self.prefers_spinning() != explore).then(|| now + self.budget)
    }

    /// Whether spun waits are the better mode now (module docs).
    pub fn prefers_spinning(&self) -> bool {
        let spun = self.spun.load(Ordering::Relaxed);
        let blocked = self.blocked.load(Ordering::Relaxed);
        spun == 0 || (blocked != 0 && u128::from(spun) * 8 <= u128::from(blocked) * 7)
    }

    /// Records a cycle of `waited` whose wait spun or not.
    pub fn record(&self, spun: bool, waited: Duration) {
        let average = if spun { &self.spun } else { &self.blocked };
        // At least 1 ns: 0 means "none measured yet".
        let sample = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX).max(1);
        let old = average.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            old - old / 8 + sample / 8
        };
        average.store(new.max(1), Ordering::Relaxed);
    }

    /// The moving averages of spun and of other waits (`None` before the
    /// first of each).
    pub fn averages(&self) -> (Option<Duration>, Option<Duration>) {
        let read = |average: &AtomicU64| match average.load(Ordering::Relaxed) {
            0 => None,
            nanos => Some(Duration::from_nanos(nanos)),
        };
        (read(&self.spun), read(&self.blocked))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn modes(spin: &Spin, waits: usize) -> Vec<bool> {
        let now = Instant::now();
        (0..waits).map(|_| spin.next_wait(now).is_some()).collect()
    }

    #[test]
    fn a_zero_budget_never_spins() {
        let spin = Spin::new(Duration::ZERO);
        assert_eq!(modes(&spin, 40), vec![false; 40]);
    }

    #[test]
    fn it_spins_until_blocking_is_measured_then_follows_the_faster_mode() {
        let spin = Spin::new(Duration::from_micros(50));
        let now = Instant::now();
        assert_eq!(spin.next_wait(now), Some(now + Duration::from_micros(50)));
        // Nothing measured: spin, but every 16th wait blocks.
        let first = modes(&spin, 31);
        assert_eq!(first.iter().filter(|spun| !**spun).count(), 2);
        assert!(!first[14] && !first[30], "{first:?}");
        // Spun waits of 20 µs against blocked ones of 40 µs: spinning.
        spin.record(true, Duration::from_micros(20));
        spin.record(false, Duration::from_micros(40));
        assert!(spin.prefers_spinning());
        // Spinning must beat blocking by an eighth: 36 µs against 40 does
        // not.
        let spin = Spin::new(Duration::from_micros(50));
        spin.record(true, Duration::from_micros(36));
        spin.record(false, Duration::from_micros(40));
        assert!(!spin.prefers_spinning());
        let blocked: Vec<bool> = modes(&spin, 32);
        // Blocking now, every 16th wait spins.
        assert_eq!(
            blocked
                .iter()
                .enumerate()
                .filter(|(_, s)| **s)
                .map(|(i, _)| i)
                .collect::<Vec<_>>(),
            vec![15, 31]
        );
        spin.record(true, Duration::from_micros(20));
        // 36 - 36/8 + 20/8 = 34 µs, within 7/8 of 40 (35): spinning.
        assert_eq!(spin.averages().0, Some(Duration::from_nanos(34_000)));
        assert!(spin.prefers_spinning());
    }

    #[test]
    fn a_cycle_counts_from_the_previous_end_when_the_caller_was_busy() {
        let spin = Spin::new(Duration::from_micros(50));
        let t0 = Instant::now();
        let at = |micros: u64| t0 + Duration::from_micros(micros);
        // The first end only starts the clock.
        spin.ended(true, at(0), at(10));
        assert_eq!(spin.averages(), (None, None));
        // Began 5 µs after the last end, ended 30 µs after it.
        spin.ended(true, at(15), at(40));
        assert_eq!(spin.averages(), (Some(Duration::from_micros(30)), None));
        spin.ended(false, at(60), at(100));
        assert_eq!(spin.averages().1, Some(Duration::from_micros(60)));
        // Began 2 ms after the last end: idle time, not measured.
        spin.ended(false, at(2_100), at(2_150));
        assert_eq!(spin.averages().1, Some(Duration::from_micros(60)));
        // ... but it is the last end for the next one.
        spin.ended(false, at(2_160), at(2_190));
        assert_eq!(
            spin.averages().1,
            Some(Duration::from_nanos(60_000 - 7_500 + 5_000))
        );
    }

    #[test]
    fn the_averages_move_by_an_eighth() {
        let spin = Spin::new(Duration::from_micros(50));
        assert_eq!(spin.averages(), (None, None));
        spin.record(false, Duration::from_nanos(800));
        spin.record(false, Duration::from_nanos(1_600));
        assert_eq!(spin.averages(), (None, Some(Duration::from_nanos(900))));
        spin.record(true, Duration::ZERO);
        assert_eq!(spin.averages().0, Some(Duration::from_nanos(1)));
    }
}
