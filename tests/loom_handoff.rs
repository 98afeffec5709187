//! Loom model of the completion hand-off (`callreg::io::handoff`): every
//! interleaving of the IO thread completing (or dropping) and the caller
//! waiting.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --features io
//! --test loom_handoff --release`. Without `--cfg loom` this file is empty.
#![cfg(all(loom, feature = "io"))]

use callreg::io::handoff::{channel, Abandoned};
use loom::thread;

#[test]
fn the_waiter_gets_the_value_whatever_the_order() {
    loom::model(|| {
        let (completer, pending) = channel::<u32>();
        let io = thread::spawn(move || completer.complete(7));
        assert_eq!(pending.wait(), Ok(7));
        io.join().unwrap();
    });
}

#[test]
fn a_dropped_completer_wakes_the_waiter() {
    loom::model(|| {
        let (completer, pending) = channel::<u32>();
        let io = thread::spawn(move || drop(completer));
        assert_eq!(pending.wait(), Err(Abandoned));
        io.join().unwrap();
    });
}

#[test]
fn the_result_is_visible_once_the_io_thread_is_done() {
    loom::model(|| {
        let (completer, pending) = channel::<u32>();
        let io = thread::spawn(move || completer.complete(1));
        io.join().unwrap();
        // After the join the result is there in every interleaving.
        assert!(pending.is_complete());
        assert_eq!(pending.wait(), Ok(1));
    });
}

#[test]
fn two_operations_complete_independently() {
    loom::model(|| {
        let (c1, p1) = channel::<u32>();
        let (c2, p2) = channel::<u32>();
        let io = thread::spawn(move || {
            c2.complete(2);
            c1.complete(1);
        });
        let waiter = thread::spawn(move || p2.wait());
        assert_eq!(p1.wait(), Ok(1));
        assert_eq!(waiter.join().unwrap(), Ok(2));
        io.join().unwrap();
    });
}
