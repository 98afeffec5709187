//! Mixed scopes (`specs/protocol.md` §9): a register over targets of two
//! kinds, SUB targets that install it and next-level targets that fail to
//! deserialize it or die while it is in flight, in any interleaving. The
//! machines see no kind; this drives the real parent and targets
//! (`common::sim`) with faults chosen by kind and checks every invariant
//! (1, 2 and 7 included) after every step: the register fails as a whole,
//! nothing stays installed on either kind, nothing stays staged.

mod common;

use callreg::error::ErrorCode;
use callreg::protocol::{Failure, TargetOutcome};
use common::sim::{digest, Sim};
use proptest::prelude::*;

/// Target `t` does the next thing it can: deliver a frame, finish a
/// deserialization (failing on a next-level target), hand the parent a
/// reply, or have its death noticed. Returns whether anything moved.
fn act(sim: &mut Sim, t: u16, next_level: bool) -> bool {
    if sim.deliver_frame(t, None) {
        return true;
    }
    let failure =
        next_level.then(|| Failure::new(ErrorCode::DESERIALIZE_FAILED, "refused on this kind"));
    sim.finish_deserialize(t, failure) || sim.deliver_reply(t) || sim.notice(t)
}

fn scenario() -> impl Strategy<Value = (u16, u16, Vec<Option<u8>>, Vec<u16>)> {
    (2u16..=5).prop_flat_map(|targets| {
        (
            Just(targets),
            1..targets,
            prop::collection::vec(prop::option::weighted(0.4, 0u8..4), targets as usize),
            prop::collection::vec(0..targets, 0..40),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn a_register_failing_on_one_kind_is_rolled_back_on_both(
        (targets, sub, deaths, order) in scenario()
    ) {
        let mut sim = Sim::setup(targets).fence_on_timeout(true).slot_capacity(2).build();
        let kept = sim.register_ok(0);
        let op = sim.register(1).expect("register starts");
        let is_next_level = |t: u16| t >= sub;
        // A next-level target with a death point dies after that many of
        // its own steps (0: before it reads the register).
        let mut steps = vec![0u8; usize::from(targets)];
        let mut dead = vec![false; usize::from(targets)];
        let mut step = |sim: &mut Sim, t: u16| -> bool {
            let i = usize::from(t);
            if is_next_level(t) && !dead[i] && deaths[i] == Some(steps[i]) {
                dead[i] = true;
                sim.crash(t);
                return true;
            }
            steps[i] = steps[i].saturating_add(1);
            act(sim, t, is_next_level(t))
        };
        for t in order {
            step(&mut sim, t);
            sim.check().map_err(|v| TestCaseError::fail(v.to_string()))?;
        }
        loop {
            let mut moved = false;
            for t in 0..targets {
                while step(&mut sim, t) {
                    moved = true;
                    sim.check().map_err(|v| TestCaseError::fail(v.to_string()))?;
                }
            }
            if !moved {
                break;
            }
        }
        prop_assert!(sim.is_quiescent());
        prop_assert!(sim.open_ops.is_empty());
        prop_assert!(sim.parent.staged().is_empty());
        let done = sim.completion(op).expect("the register completed");
        let error = done.result.as_ref().expect_err("the register failed");
        prop_assert_eq!(error.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
        // Every target of the scope has its outcome, once, in order.
        prop_assert_eq!(
            done.outcomes.iter().map(|(t, _)| t.0).collect::<Vec<_>>(),
            (0..targets).collect::<Vec<_>>()
        );
        for (target, outcome) in &done.outcomes {
            if is_next_level(target.0) {
                prop_assert!(
                    matches!(outcome, TargetOutcome::Failed { .. } | TargetOutcome::Lost),
                    "next-level target {} ended {:?}", target.0, outcome
                );
            } else {
                prop_assert!(
                    matches!(outcome, TargetOutcome::RolledBack),
                    "SUB target {} ended {:?}", target.0, outcome
                );
            }
        }
        for t in 0..targets {
            // Only the targets the scenario killed are gone.
            prop_assert_eq!(sim.target(t).is_some(), !dead[usize::from(t)], "target {}", t);
            if let Some(target) = sim.target(t) {
                prop_assert_eq!(target.installed(), vec![(digest(0), 1)], "target {}", t);
            }
        }
        prop_assert_eq!(sim.live_handles(), vec![kept]);
        prop_assert!(sim.target(0).is_some());
    }
}
