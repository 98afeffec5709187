//! A bounded, adaptive spin before a caller blocks for its own reply
//! (`specs/threads.md`, "The leader's spin"), and before a target's task
//! thread sleeps on its empty queue (the same rule, per target: "The
//! target's spin").
//!
//! A caller waiting for its result as the leader polls the reply sockets.
//! Blocking in `poll` costs a sleep and a wake-up, and on a machine whose
//! idle CPUs halt, waking one costs tens of microseconds, more than a
//! short task's whole round trip. Polling without blocking for a few tens
//! of microseconds first keeps the caller's CPU awake for a reply that is
//! about to come. It does not always pay: a long task's reply comes after
//! any spin, and when the CPUs are busy a spinning caller takes time from
//! the processes it waits for and is itself scheduled later. So the choice
//! is measured, per Worker, in periods of [`PERIOD`] waits:
//!
//! * the first [`TRIAL`] waits of a period spin, the next [`TRIAL`] do
//!   not (each mode is measured over a stretch of its own, since how the
//!   scheduler treats the caller depends on what it did for the last few
//!   milliseconds); the first [`SETTLE`] waits of each stretch are not
//!   measured;
//! * a measured wait is the caller's whole cycle, from the end of its
//!   previous wait to the end of this one (its own work, its request, the
//!   target's work and the wait, so that CPU a spin takes from either
//!   shows), when it began within [`CYCLE_GAP`] of that end (a caller
//!   waiting back to back: anything else is idle time);
//! * the rest of the period spins if the spinning stretch's mean cycle was
//!   at most 7/8 of the other's (spinning must clearly pay for the CPU it
//!   burns), and blocks otherwise (also when a stretch measured nothing);
//! * while the rest of the period spins, its waits are measured too, in
//!   windows of [`TRIAL`] measured waits: a window whose mean cycle is not
//!   at most 7/8 of the blocking stretch's ends the spinning for the rest
//!   of the period. Why: a short spinning stretch borrows from the
//!   scheduler (a thread that slept before it is owed CPU time), and on
//!   busy CPUs a long run of spinning pays that back, so a stretch that
//!   paid can be followed by spinning that does not;
//! * a spin lasts at most the budget ([`DEFAULT_SPIN`] unless configured;
//!   zero turns spinning off), and only while a caller waits: an idle
//!   Worker polls nothing and uses no CPU.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The default spin budget: 50 µs, chosen by `python/benchmarks/round_trip.py`
/// (`BENCHMARKS.md`, "Round trip and the leader's spin").
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// The longest spin budget a Worker accepts: 1 ms.
pub const MAX_SPIN: Duration = Duration::from_millis(1);

/// A wait is measured with the caller's work before it only when it began
/// within this long of the caller's previous wait ([`Spin::ended`]).
pub const CYCLE_GAP: Duration = Duration::from_millis(1);

/// Waits in a period: two trial stretches, then the choice they made.
pub const PERIOD: u64 = 4096;

/// Waits in each trial stretch (spinning, then not).
pub const TRIAL: u64 = 256;

/// The first waits of a trial stretch that are not measured.
pub const SETTLE: u64 = 96;

/// Which part of a period a wait is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    /// The spinning trial (measured after [`SETTLE`] waits).
    TrySpinning { measured: bool },
    /// The blocking trial.
    TryBlocking { measured: bool },
    /// The rest: the trials' choice.
    Chosen,
}

fn part(wait: u64) -> Part {
    match wait % PERIOD {
        w if w < TRIAL => Part::TrySpinning {
            measured: w >= SETTLE,
        },
        w if w < 2 * TRIAL => Part::TryBlocking {
            measured: w - TRIAL >= SETTLE,
        },
        _ => Part::Chosen,
    }
}

/// The adaptive spin of one Worker's leaders (module docs).
#[derive(Debug)]
pub struct Spin {
    budget: Duration,
    /// Waits begun so far.
    waits: AtomicU64,
    /// The wait last begun, for [`Spin::ended`] (a leader's waits do not
    /// overlap; two leaders one after the other do not either).
    current: AtomicU64,
    /// This period's trials: summed cycles (ns) and their counts.
    spun_ns: AtomicU64,
    spun_n: AtomicU64,
    blocked_ns: AtomicU64,
    blocked_n: AtomicU64,
    /// The current window of the chosen spinning: summed cycles (ns) and
    /// their count.
    window_ns: AtomicU64,
    window_n: AtomicU64,
    /// The choice for the rest of the period.
    spinning: AtomicBool,
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
            current: AtomicU64::new(0),
            spun_ns: AtomicU64::new(0),
            spun_n: AtomicU64::new(0),
            blocked_ns: AtomicU64::new(0),
            blocked_n: AtomicU64::new(0),
            window_ns: AtomicU64::new(0),
            window_n: AtomicU64::new(0),
            spinning: AtomicBool::new(false),
            last_end: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Whether the wait starting at `now` spins, and until when.
    pub fn next_wait(&self, now: Instant) -> Option<Instant> {
        if self.budget.is_zero() {
            return None;
        }
        let wait = self.waits.fetch_add(1, Ordering::Relaxed);
        self.current.store(wait, Ordering::Relaxed);
        let spins = match part(wait) {
            Part::TrySpinning { .. } => {
                if wait.is_multiple_of(PERIOD) {
                    for sum in [
                        &self.spun_ns,
                        &self.spun_n,
                        &self.blocked_ns,
                        &self.blocked_n,
                        &self.window_ns,
                        &self.window_n,
                    ] {
                        sum.store(0, Ordering::Relaxed);
                    }
                }
                true
            }
            Part::TryBlocking { .. } => false,
            Part::Chosen => {
                if wait % PERIOD == 2 * TRIAL {
                    self.choose();
                }
                self.spinning.load(Ordering::Relaxed)
            }
        };
        spins.then(|| now + self.budget)
    }

    /// Decides the rest of the period from its trials (module docs).
    fn choose(&self) {
        let spun = mean_ns(&self.spun_ns, &self.spun_n);
        let blocked = mean_ns(&self.blocked_ns, &self.blocked_n);
        self.spinning.store(pays(spun, blocked), Ordering::Relaxed);
    }

    /// Adds a cycle of the chosen spinning to its window; a full window
    /// that did not pay against the blocking stretch ends the spinning
    /// for the rest of the period (module docs).
    fn check_window(&self, cycle: u64) {
        self.window_ns.fetch_add(cycle, Ordering::Relaxed);
        if self.window_n.fetch_add(1, Ordering::Relaxed) + 1 < TRIAL {
            return;
        }
        let window = mean_ns(&self.window_ns, &self.window_n);
        let blocked = mean_ns(&self.blocked_ns, &self.blocked_n);
        self.window_ns.store(0, Ordering::Relaxed);
        self.window_n.store(0, Ordering::Relaxed);
        if !pays(window, blocked) {
            self.spinning.store(false, Ordering::Relaxed);
        }
    }

    /// How many waits began so far.
    #[cfg(test)]
    pub(crate) fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }

    /// Whether the waits after this period's trials spin.
    pub fn prefers_spinning(&self) -> bool {
        self.spinning.load(Ordering::Relaxed)
    }

    /// Records the end, at `end`, of the wait that began at `start` (the
    /// last one [`Spin::next_wait`] decided). What is measured is the
    /// caller's whole cycle (module docs), in its trial's sum.
    pub fn ended(&self, start: Instant, end: Instant) {
        let last = self.last_end.swap(self.nanos(end), Ordering::Relaxed);
        if last == 0 || self.budget.is_zero() {
            return;
        }
        let (start, end) = (self.nanos(start), self.nanos(end));
        if start.saturating_sub(last) > CYCLE_GAP.as_nanos() as u64 {
            return;
        }
        let cycle = end.saturating_sub(last);
        let (sum, n) = match part(self.current.load(Ordering::Relaxed)) {
            Part::TrySpinning { measured: true } => (&self.spun_ns, &self.spun_n),
            Part::TryBlocking { measured: true } => (&self.blocked_ns, &self.blocked_n),
            // While blocking is chosen a window can only confirm it.
            Part::Chosen => {
                self.check_window(cycle);
                return;
            }
            _ => return,
        };
        sum.fetch_add(cycle, Ordering::Relaxed);
        n.fetch_add(1, Ordering::Relaxed);
    }

    /// The mean measured cycle of this period's spinning and blocking
    /// trials so far (`None` before one is measured).
    pub fn trials(&self) -> (Option<Duration>, Option<Duration>) {
        // A mean of u64 nanoseconds fits a u64.
        let mean = |sum, n| mean_ns(sum, n).map(|ns| Duration::from_nanos(ns as u64));
        (
            mean(&self.spun_ns, &self.spun_n),
            mean(&self.blocked_ns, &self.blocked_n),
        )
    }
}

/// The mean of summed nanoseconds `sum` over `n` samples (`None`: none).
fn mean_ns(sum: &AtomicU64, n: &AtomicU64) -> Option<u128> {
    let n = n.load(Ordering::Relaxed);
    (n > 0).then(|| u128::from(sum.load(Ordering::Relaxed)) / u128::from(n))
}

/// Whether a spinning mean cycle `spun` pays against a blocking one:
/// both measured, and the spinning one at most 7/8 of the other.
fn pays(spun: Option<u128>, blocked: Option<u128>) -> bool {
    matches!((spun, blocked), (Some(s), Some(b)) if s * 8 <= b * 7)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `waits` waits of `spin`, each beginning 1 µs after the last
    /// ended and lasting `spinning` or `blocking` µs as it spins or not;
    /// returns whether each spun.
    fn run(
        spin: &Spin,
        waits: u64,
        spinning: u64,
        blocking: u64,
        clock: &mut Instant,
    ) -> Vec<bool> {
        (0..waits)
            .map(|_| {
                let start = *clock + Duration::from_micros(1);
                let spun = spin.next_wait(start).is_some();
                let end = start + Duration::from_micros(if spun { spinning } else { blocking });
                spin.ended(start, end);
                *clock = end;
                spun
            })
            .collect()
    }

    #[test]
    fn a_zero_budget_never_spins() {
        let spin = Spin::new(Duration::ZERO);
        let mut clock = Instant::now();
        assert_eq!(run(&spin, 300, 10, 10, &mut clock), vec![false; 300]);
    }

    #[test]
    fn each_period_tries_both_modes_then_keeps_the_faster() {
        let spin = Spin::new(Duration::from_micros(50));
        let now = Instant::now();
        assert_eq!(spin.next_wait(now), Some(now + Duration::from_micros(50)));
        let spin = Spin::new(Duration::from_micros(50));
        let mut clock = Instant::now();
        // Spinning takes 20 µs a cycle, blocking 40: the trials, then spin.
        let first = run(&spin, PERIOD, 19, 39, &mut clock);
        let trial = TRIAL as usize;
        assert_eq!(first[..trial], vec![true; trial]);
        assert_eq!(first[trial..2 * trial], vec![false; trial]);
        assert_eq!(first[2 * trial..], vec![true; PERIOD as usize - 2 * trial]);
        assert_eq!(
            spin.trials(),
            (
                Some(Duration::from_micros(20)),
                Some(Duration::from_micros(40))
            )
        );
        // The next period: the machine got busy, spinning now costs more.
        let second = run(&spin, PERIOD, 30, 25, &mut clock);
        assert_eq!(second[..trial], vec![true; trial]);
        assert_eq!(
            second[2 * trial..],
            vec![false; PERIOD as usize - 2 * trial]
        );
        assert!(!spin.prefers_spinning());
        // Spinning must beat blocking by an eighth: 36 µs against 40 does not.
        let third = run(&spin, PERIOD, 35, 39, &mut clock);
        assert!(!third[2 * trial]);
        // 35 against 40 does.
        let fourth = run(&spin, PERIOD, 34, 39, &mut clock);
        assert!(fourth[2 * trial]);
    }

    #[test]
    fn chosen_spinning_that_stops_paying_ends_after_one_window() {
        let spin = Spin::new(Duration::from_micros(50));
        let mut clock = Instant::now();
        let trial = TRIAL as usize;
        // The trials: spinning 20 µs a cycle against blocking 40.
        let trials = run(&spin, 2 * TRIAL, 19, 39, &mut clock);
        assert_eq!(trials[..trial], vec![true; trial]);
        assert_eq!(trials[trial..], vec![false; trial]);
        // The chosen spinning now costs 45 µs a cycle: one window of it...
        let window = run(&spin, TRIAL, 44, 39, &mut clock);
        assert_eq!(window, vec![true; trial]);
        assert!(!spin.prefers_spinning());
        // ...then the rest of the period blocks.
        let rest = run(&spin, PERIOD - 3 * TRIAL, 44, 39, &mut clock);
        assert_eq!(rest, vec![false; (PERIOD - 3 * TRIAL) as usize]);
        // The next period tries both modes again.
        let next = run(&spin, 2 * TRIAL + 1, 19, 39, &mut clock);
        assert_eq!(next[..trial], vec![true; trial]);
        assert!(next[2 * trial]);
    }

    #[test]
    fn chosen_spinning_that_still_pays_keeps_spinning() {
        let spin = Spin::new(Duration::from_micros(50));
        let mut clock = Instant::now();
        run(&spin, 2 * TRIAL, 19, 39, &mut clock);
        // 35 µs a cycle against the blocking stretch's 40: still pays.
        let chosen = run(&spin, PERIOD - 2 * TRIAL, 34, 39, &mut clock);
        assert_eq!(chosen, vec![true; (PERIOD - 2 * TRIAL) as usize]);
    }

    #[test]
    fn the_settling_waits_and_idle_gaps_are_not_measured() {
        let spin = Spin::new(Duration::from_micros(50));
        let t0 = Instant::now();
        let at = |micros: u64| t0 + Duration::from_micros(micros);
        // The first end only starts the clock.
        spin.next_wait(at(0));
        spin.ended(at(0), at(10));
        assert_eq!(spin.trials(), (None, None));
        let mut clock = at(10);
        // The rest of the settling waits: still nothing measured.
        run(&spin, SETTLE - 1, 20, 20, &mut clock);
        assert_eq!(spin.trials(), (None, None));
        // Measured: from the last end (1 µs before the start) to this end.
        run(&spin, 1, 29, 29, &mut clock);
        assert_eq!(spin.trials(), (Some(Duration::from_micros(30)), None));
        // A wait begun 2 ms after the last end: idle time, not measured,
        // but it is the last end for the next one.
        let start = clock + Duration::from_millis(2);
        spin.next_wait(start);
        spin.ended(start, start + Duration::from_micros(500));
        assert_eq!(spin.trials(), (Some(Duration::from_micros(30)), None));
        let mut clock = start + Duration::from_micros(500);
        run(&spin, 1, 9, 9, &mut clock);
        assert_eq!(spin.trials(), (Some(Duration::from_micros(20)), None));
    }

    #[test]
    fn a_period_whose_trials_measured_nothing_blocks() {
        let spin = Spin::new(Duration::from_micros(50));
        let mut clock = Instant::now();
        // Every wait begins long after the last: nothing is measured.
        let waits: Vec<bool> = (0..2 * TRIAL + 1)
            .map(|_| {
                clock += Duration::from_millis(5);
                let spun = spin.next_wait(clock).is_some();
                spin.ended(clock, clock + Duration::from_micros(10));
                spun
            })
            .collect();
        assert_eq!(spin.trials(), (None, None));
        assert!(!waits[2 * TRIAL as usize]);
    }
}
