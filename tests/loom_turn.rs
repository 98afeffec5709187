//! Loom model of the turns at a target's intake (`callreg::io::turn`):
//! the task thread and the reader each ask for a turn when something
//! arrives on the control socket; neither ever waits for the other, and
//! whatever arrived before an ask is read by a turn that begins after it
//! (by the asker, or by the thread that had the turn). A lost ask would
//! leave a frame unread until the next one arrives.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --features io
//! --test loom_turn --release`. Without `--cfg loom` this file is empty.
#![cfg(all(loom, feature = "io"))]

use callreg::io::turn::Turns;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

/// A socket `arrived` items came into; the turns' state is how many of
/// them the last turn read (a turn reads everything there).
struct Socket {
    arrived: AtomicUsize,
}

/// One thread's arrival and its ask for a turn: what a wake-up for a
/// frame does. Returns how many turns ran in this thread.
fn arrive_and_read(socket: &Socket, turns: &Turns<usize>) -> usize {
    socket.arrived.fetch_add(1, Ordering::SeqCst);
    let mut ran = 0;
    turns.take(|read| {
        ran += 1;
        *read = socket.arrived.load(Ordering::SeqCst);
    });
    ran
}

/// `threads` threads, each with one arrival and its ask, run together:
/// how many turns they ran, and how many arrivals the last turn read.
fn arrivals(threads: usize) -> (usize, usize) {
    let socket = Arc::new(Socket {
        arrived: AtomicUsize::new(0),
    });
    let turns = Arc::new(Turns::new(0usize));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let socket = socket.clone();
            let turns = turns.clone();
            thread::spawn(move || arrive_and_read(&socket, &turns))
        })
        .collect();
    let ran = handles.into_iter().map(|t| t.join().unwrap()).sum();
    let mut read = 0;
    turns.take(|r| read = *r);
    (ran, read)
}

#[test]
fn every_arrival_is_read_by_a_turn_that_began_after_it() {
    loom::model(|| {
        let (ran, read) = arrivals(2);
        assert!((1..=2).contains(&ran), "{ran} turns");
        assert_eq!(read, 2);
    });
}

#[test]
fn a_turn_asked_during_another_runs_in_that_thread_once_it_ends() {
    // Three threads: an ask may come during the turn taken for another
    // ask.
    loom::model(|| {
        let (ran, read) = arrivals(3);
        assert!((1..=3).contains(&ran), "{ran} turns");
        assert_eq!(read, 3);
    });
}
