//! Replacement targets over real processes (`specs/protocol.md` §2.9):
//! a lost target's slot gets a new process from the template, with the
//! same id and the next incarnation, holding exactly the registry once it
//! joined; a callable that kills every new process stops at the rate
//! limit. Every test ends with no staged payload, no `/dev/shm` name and
//! no child left (checked by the runner).

mod io_common;

use std::time::Duration;

use callreg::io::worker::{SlotEvent, Worker};
use callreg::protocol::{SlotPhase, TargetId};
use callreg::runtime::testing::TestRuntime;
use callreg::runtime::TaskEncoding;
use io_common::{builder, check_invariants, envelope, wait_for_slot};

const ADD_INPUT: &[u8] = br#"{"args": [40, 2], "kwargs": {}}"#;

fn main() {
    io_common::run(&[(
        "a_killed_target_is_replaced_and_serves_the_registry",
        a_killed_target_is_replaced_and_serves_the_registry,
    )]);
}

fn kill(worker: &Worker<TestRuntime>, target: u16) -> i32 {
    let pid = worker.target_pid(TargetId(target)).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    pid
}

fn a_killed_target_is_replaced_and_serves_the_registry() {
    let worker = builder(2).build().unwrap();
    let pre = worker.register(&envelope("add")).unwrap();
    worker.start().unwrap();
    let post = worker.register(&envelope("echo")).unwrap();
    let old = kill(&worker, 0);
    wait_for_slot(&worker, 0, SlotPhase::Joined, 1);
    let new = worker.target_pid(TargetId(0)).unwrap();
    assert_ne!(new, old);
    let events = worker.slot_events();
    assert_eq!(
        events,
        [
            SlotEvent::Spawned {
                target: TargetId(0),
                incarnation: 1,
                pid: new
            },
            SlotEvent::Joined {
                target: TargetId(0),
                incarnation: 1
            },
        ]
    );
    for (_, table) in worker.inspect().unwrap() {
        let mut installed = table.unwrap().installed;
        installed.sort();
        let mut expected = vec![(pre.digest(), 1), (post.digest(), 1)];
        expected.sort();
        assert_eq!(installed, expected);
    }
    check_invariants(&worker, 2);
    assert_eq!(
        worker
            .submit(&pre, TargetId(0), TaskEncoding::Json, ADD_INPUT)
            .unwrap(),
        b"42"
    );
    assert_eq!(
        worker
            .submit(&post, TargetId(0), TaskEncoding::Json, b"7")
            .unwrap(),
        b"7"
    );
    // The other target was never touched.
    assert_eq!(worker.target_incarnation(TargetId(1)), 0);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(worker.slot_events(), events, "nothing else happened");
    worker.close();
}
