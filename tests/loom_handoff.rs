//! Loom model of the completion hand-off (`callreg::io::handoff`): every
//! interleaving of the IO thread completing (or dropping) and the caller
//! waiting.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --features io
//! --test loom_handoff --release`. Without `--cfg loom` this file is empty.
#![cfg(all(loom, feature = "io"))]

use callreg::io::handoff::{channel, Abandoned};
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::{mpsc, Arc};
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

#[test]
fn a_callback_gets_the_value_once_whatever_the_order() {
    loom::model(|| {
        let (completer, pending) = channel::<u32>();
        let calls = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = mpsc::channel();
        let io = thread::spawn(move || completer.complete(7));
        let counted = calls.clone();
        pending.on_complete(move |value| {
            counted.fetch_add(1, Ordering::SeqCst);
            tx.send(value).unwrap();
        });
        io.join().unwrap();
        // Run by the IO thread or at once here: either way done by now.
        assert_eq!(rx.recv().unwrap(), Ok(7));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn a_callback_hears_of_a_dropped_completer() {
    loom::model(|| {
        let (completer, pending) = channel::<u32>();
        let (tx, rx) = mpsc::channel();
        let io = thread::spawn(move || drop(completer));
        pending.on_complete(move |value| tx.send(value).unwrap());
        io.join().unwrap();
        assert_eq!(rx.recv().unwrap(), Err(Abandoned));
    });
}

#[test]
fn a_sliced_wait_ends_with_the_value() {
    loom::model(|| {
        let (completer, pending) = channel::<u32>();
        let io = thread::spawn(move || completer.complete(3));
        let mut pending = pending;
        let value = loop {
            match pending.wait_timeout(std::time::Duration::from_millis(1)) {
                Ok(value) => break value,
                Err(again) => {
                    pending = again;
                    thread::yield_now();
                }
            }
        };
        assert_eq!(value, Ok(3));
        io.join().unwrap();
    });
}
