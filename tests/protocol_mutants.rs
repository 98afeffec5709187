//! Each known-bug switch (`Mutant`, cargo feature `mutants`) is caught by
//! the invariant it targets, in a short scenario driven through the real
//! machines; the same scenario without the mutant keeps every invariant.
//! Run with `cargo test --features mutants --test protocol_mutants`.

#![cfg(feature = "mutants")]

mod common;

use callreg::error::ErrorCode;
use callreg::protocol::invariants::Violation;
use callreg::protocol::{Failure, Mutant};
use common::sim::{digest, Sim};

/// Runs `scenario` on a fresh system (built by `sim`) with and without
/// `mutant`; returns the first violation seen with it, after asserting that
/// none is seen without.
fn caught(
    mutant: Mutant,
    sim: fn() -> Sim,
    scenario: fn(&mut Sim) -> Result<(), Violation>,
) -> Violation {
    let mut honest = sim();
    scenario(&mut honest).expect("no violation without the mutant");
    honest
        .run_to_quiet()
        .expect("no violation without the mutant");
    let mut bad = sim().with_mutant(mutant);
    match scenario(&mut bad).and_then(|()| bad.run_to_quiet()) {
        Err(v) => v,
        Ok(()) => panic!("{mutant:?} was not caught"),
    }
}

#[test]
fn publish_before_all_replies_breaks_invariant_1() {
    let v = caught(
        Mutant::PublishBeforeAllReplies,
        || {
            Sim::setup(2)
                .fence_on_timeout(true)
                .slot_capacity(4)
                .build()
        },
        |sim| {
            sim.register(1).unwrap();
            sim.deliver_frame(0, None);
            sim.finish_deserialize(0, None);
            sim.deliver_reply(0);
            sim.check()
        },
    );
    assert_eq!(v.number, 1, "{v}");
}

#[test]
fn skip_cleanup_breaks_invariant_2() {
    let v = caught(
        Mutant::SkipCleanup,
        || {
            Sim::setup(2)
                .fence_on_timeout(true)
                .slot_capacity(4)
                .build()
        },
        |sim| {
            sim.register(1).unwrap();
            sim.deliver_frame(0, None);
            sim.deliver_frame(1, None);
            sim.finish_deserialize(0, None);
            sim.finish_deserialize(
                1,
                Some(Failure::new(ErrorCode::DESERIALIZE_FAILED, "bad pickle")),
            );
            sim.check()
        },
    );
    assert_eq!(v.number, 2, "{v}");
}

#[test]
fn cleanup_of_unconfirmed_targets_breaks_invariant_8() {
    let v = caught(
        Mutant::CleanupUnconfirmedTargets,
        || {
            Sim::setup(2)
                .fence_on_timeout(true)
                .slot_capacity(4)
                .before_start(&[1])
                .build()
        },
        |sim| {
            sim.register(1).unwrap();
            sim.deliver_frame(0, None);
            sim.deliver_frame(1, Some(digest(200)));
            sim.deliver_reply(0);
            sim.deliver_reply(1);
            sim.check()
        },
    );
    assert_eq!(v.number, 8, "{v}");
}

#[test]
fn forgetting_uncertain_breaks_invariant_2() {
    let v = caught(
        Mutant::ForgetUncertain,
        || {
            Sim::setup(2)
                .fence_on_timeout(false)
                .slot_capacity(4)
                .build()
        },
        |sim| {
            sim.register(1).unwrap();
            sim.deliver_frame(0, None);
            sim.finish_deserialize(0, None);
            sim.deliver_reply(0);
            // Target 1 installs it, but its reply is still in transit at the deadline.
            sim.deliver_frame(1, None);
            sim.finish_deserialize(1, None);
            sim.advance(1_000);
            sim.check()
        },
    );
    assert_eq!(v.number, 2, "{v}");
}

#[test]
fn releasing_the_staged_payload_early_breaks_invariant_7() {
    let v = caught(
        Mutant::ReleaseStagedEarly,
        || {
            Sim::setup(2)
                .fence_on_timeout(true)
                .slot_capacity(4)
                .build()
        },
        |sim| {
            sim.register(1).unwrap();
            sim.deliver_frame(0, None);
            sim.finish_deserialize(0, None);
            sim.deliver_reply(0);
            sim.check()
        },
    );
    assert_eq!(v.number, 7, "{v}");
}

#[test]
fn skipping_digest_verification_breaks_invariant_5() {
    let v = caught(
        Mutant::SkipDigestVerification,
        || {
            Sim::setup(1)
                .fence_on_timeout(true)
                .slot_capacity(4)
                .build()
        },
        |sim| {
            sim.register(1).unwrap();
            sim.deliver_frame(0, Some(digest(200)));
            sim.check()
        },
    );
    assert_eq!(v.number, 5, "{v}");
}

#[test]
fn freeing_a_slot_held_by_a_run_breaks_invariant_4() {
    let v = caught(
        Mutant::FreeSlotHeldByRun,
        || {
            Sim::setup(1)
                .fence_on_timeout(true)
                .slot_capacity(4)
                .before_start(&[1])
                .build()
        },
        |sim| {
            let h = sim.live_handles()[0];
            sim.submit(&h, 0).unwrap();
            sim.deliver_frame(0, None);
            sim.unregister(&h).unwrap();
            sim.deliver_frame(0, None);
            sim.check()
        },
    );
    assert_eq!(v.number, 4, "{v}");
}

/// Not an invariant of §4.4 but the deadline rule (`specs/protocol.md`
/// §2.7): a parent ignoring alive reports fences a target heard from
/// within the control timeout.
#[test]
fn ignoring_alive_reports_fences_a_target_that_was_heard_from() {
    use callreg::protocol::{
        ControlPhase, Effect, Namespace, OwnerToken, Parent, ParentConfig, Seq, TargetId, Time,
    };
    let fenced = |mutant: Option<Mutant>| {
        let mut parent = Parent::new(ParentConfig {
            targets: 1,
            control_timeout: 100,
            operation_timeout: 1_000,
            fence_on_timeout: true,
            owner: OwnerToken(1),
            slot_capacity: 4,
            probe_first: false,
            respawn_limit: 0,
            respawn_backoff: 0,
            unbounded_spawn: false,
            max_tasks_per_target: 0,
        });
        if let Some(mutant) = mutant {
            parent = parent.with_mutant(mutant);
        }
        parent.start().unwrap();
        parent
            .register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        while parent.poll_effect().is_some() {}
        parent
            .handle_alive(TargetId(0), Seq(1), ControlPhase::Running, Time(90))
            .unwrap();
        parent.handle_timeout(Time(150));
        std::iter::from_fn(|| parent.poll_effect()).any(|e| matches!(e, Effect::Fence { .. }))
    };
    assert!(!fenced(None));
    assert!(fenced(Some(Mutant::IgnoreAlive)));
}

/// Not an invariant of §4.4 but the poison rule (`specs/protocol.md` §2.8):
/// a parent that counts a bound fence of a probe reported queued as
/// evidence poisons the digest; the real parent does not.
#[test]
fn poisoning_a_queued_probe_at_its_bound_is_caught() {
    use callreg::protocol::{
        ControlPhase, Namespace, OwnerToken, Parent, ParentConfig, Seq, TargetId, Time,
    };
    let poisoned = |mutant: Option<Mutant>| {
        let mut parent = Parent::new(ParentConfig {
            targets: 2,
            control_timeout: 100,
            operation_timeout: 300,
            fence_on_timeout: true,
            owner: OwnerToken(1),
            slot_capacity: 4,
            probe_first: true,
            respawn_limit: 0,
            respawn_backoff: 0,
            unbounded_spawn: false,
            max_tasks_per_target: 0,
        });
        if let Some(mutant) = mutant {
            parent = parent.with_mutant(mutant);
        }
        parent.start().unwrap();
        parent
            .register(digest(1), Namespace::LocalPython, Time(0))
            .unwrap();
        while parent.poll_effect().is_some() {}
        for now in [90, 180, 270] {
            parent
                .handle_alive(TargetId(0), Seq(1), ControlPhase::Queued, Time(now))
                .unwrap();
        }
        parent.handle_timeout(Time(300));
        while parent.poll_effect().is_some() {}
        assert!(!parent.is_target_live(TargetId(0)), "fenced at the bound");
        parent.is_poisoned(digest(1))
    };
    assert!(!poisoned(None));
    assert!(poisoned(Some(Mutant::PoisonQueued)));
}
