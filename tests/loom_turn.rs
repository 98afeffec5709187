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

/// A socket that `arrivals` items came into; `read` is how many of them
/// the turns have read (a turn reads everything there).
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

#[test]
fn every_arrival_is_read_by_a_turn_that_began_after_it() {
    loom::model(|| {
        let socket = Arc::new(Socket {
            arrived: AtomicUsize::new(0),
        });
        let turns = Arc::new(Turns::new(0usize));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let socket = socket.clone();
                let turns = turns.clone();
                thread::spawn(move || arrive_and_read(&socket, &turns))
            })
            .collect();
        let ran: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert!((1..=3).contains(&ran), "{ran} turns");
        // Both arrivals were read, whoever read them.
        let mut read = 0;
        turns.take(|r| read = *r);
        assert_eq!(read, 2);
    });
}

#[test]
fn a_turn_asked_during_another_runs_in_that_thread_once_it_ends() {
    loom::model(|| {
        let socket = Arc::new(Socket {
            arrived: AtomicUsize::new(0),
        });
        let turns = Arc::new(Turns::new(0usize));
        // Three threads: an ask may come during the turn taken for
        // another ask.
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let socket = socket.clone();
                let turns = turns.clone();
                thread::spawn(move || arrive_and_read(&socket, &turns))
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let mut read = 0;
        turns.take(|r| read = *r);
        assert_eq!(read, 3);
    });
}
