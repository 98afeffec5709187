//! Random operation sequences with random faults, driven through the real
//! parent and 1–4 real targets over in-memory FIFO queues (`common::sim`).
//! Every invariant predicate (specs/design.md §4.4, 1–9) is checked after every
//! step, and liveness (10) at the end: once everything in transit is
//! delivered and every crash noticed, no operation is left in flight and
//! the system is quiescent.

mod common;

use callreg::error::ErrorCode;
use callreg::protocol::{Completion, Failure};
use common::sim::{digest, Sim};
use proptest::prelude::*;

/// One thing that can happen next.
#[derive(Clone, Debug)]
enum Step {
    /// Register digest number `0..3`.
    Register(u8),
    /// Unregister the live handle at this index (modulo their number).
    Unregister(usize),
    /// Submit a task for the live handle at this index to a target.
    Submit(usize, u16),
    /// A target applies its next frame; a register may see a corrupt payload.
    Deliver(u16, bool),
    /// A target applies its next frame; a register cannot open its payload.
    DeliverFailing(u16),
    /// The parent receives a target's next reply.
    Reply(u16),
    /// A target finishes a deserialization, failing or not.
    Deserialized(u16, bool),
    /// A target finishes a run.
    EndRun(u16),
    /// A target crashes.
    Crash(u16),
    /// The parent notices a crash.
    Notice(u16),
    /// Time passes (micros; the control timeout is 1000).
    Advance(u64),
}

fn step(targets: u16) -> impl Strategy<Value = Step> {
    let t = 0..targets;
    prop_oneof![
        4 => (0u8..3).prop_map(Step::Register),
        2 => any::<usize>().prop_map(Step::Unregister),
        2 => (any::<usize>(), t.clone()).prop_map(|(h, t)| Step::Submit(h, t)),
        8 => (t.clone(), prop::bool::weighted(0.1)).prop_map(|(t, c)| Step::Deliver(t, c)),
        1 => t.clone().prop_map(Step::DeliverFailing),
        8 => t.clone().prop_map(Step::Reply),
        4 => (t.clone(), prop::bool::weighted(0.15)).prop_map(|(t, f)| Step::Deserialized(t, f)),
        2 => t.clone().prop_map(Step::EndRun),
        1 => t.clone().prop_map(Step::Crash),
        2 => t.prop_map(Step::Notice),
        1 => prop_oneof![Just(300u64), Just(1_200u64)].prop_map(Step::Advance),
    ]
}

fn scenario() -> impl Strategy<Value = (u16, bool, u16, Vec<u8>, Vec<Step>, bool)> {
    (1u16..=4).prop_flat_map(|targets| {
        (
            Just(targets),
            any::<bool>(),
            1u16..=3,
            prop::collection::vec(0u8..3, 0..3),
            prop::collection::vec(step(targets), 1..80),
            any::<bool>(),
        )
    })
}

fn apply(sim: &mut Sim, step: &Step) {
    match *step {
        Step::Register(n) => {
            let uncertain = sim.parent.is_uncertain(digest(n));
            match sim.register(n) {
                Ok(_) => assert!(!uncertain, "register of an uncertain digest accepted"),
                Err(e) => assert!(
                    matches!(
                        e.code,
                        ErrorCode::REGISTER_CLEANUP_UNCERTAIN
                            | ErrorCode::NO_LIVE_TARGET
                            | ErrorCode::REGISTER_POISONED
                    ),
                    "unexpected register error {e}"
                ),
            }
        }
        Step::Unregister(i) => {
            let handles = sim.live_handles();
            if !handles.is_empty() {
                let h = handles[i % handles.len()];
                if let Err(e) = sim.unregister(&h) {
                    assert_eq!(e.code, ErrorCode::REGISTER_CLEANUP_UNCERTAIN, "{e}");
                }
            }
        }
        Step::Submit(i, t) => {
            let handles = sim.live_handles();
            if !handles.is_empty() {
                let h = handles[i % handles.len()];
                if let Err(e) = sim.submit(&h, t) {
                    assert!(
                        matches!(
                            e.code,
                            ErrorCode::REGISTER_CLEANUP_UNCERTAIN | ErrorCode::TARGET_LOST
                        ),
                        "{e}"
                    );
                }
            }
        }
        Step::Deliver(t, corrupt) => {
            sim.deliver_frame(t, corrupt.then(|| digest(200)));
        }
        Step::DeliverFailing(t) => {
            sim.deliver_frame_failing(t);
        }
        Step::Reply(t) => {
            sim.deliver_reply(t);
        }
        Step::Deserialized(t, fail) => {
            let failure =
                fail.then(|| Failure::new(ErrorCode::DESERIALIZE_FAILED, "unpickling failed"));
            sim.finish_deserialize(t, failure);
        }
        Step::EndRun(t) => {
            sim.end_run(t);
        }
        Step::Crash(t) => sim.crash(t),
        Step::Notice(t) => {
            sim.notice(t);
        }
        Step::Advance(micros) => sim.advance(micros),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_and_every_operation_completes(
        (targets, fence, capacity, before, steps, probe) in scenario()
    ) {
        let capacity = capacity.max(before.len() as u16);
        let mut sim = Sim::setup(targets)
            .fence_on_timeout(fence)
            .slot_capacity(capacity)
            .before_start(&before)
            .probe_first(probe)
            .build();
        sim.check().map_err(|v| TestCaseError::fail(v.to_string()))?;
        for s in &steps {
            apply(&mut sim, s);
            sim.check().map_err(|v| TestCaseError::fail(format!("after {s:?}: {v}")))?;
        }
        sim.run_to_quiet().map_err(|v| TestCaseError::fail(format!("draining: {v}")))?;
        // Liveness (invariant 10).
        prop_assert!(sim.open_ops.is_empty(), "operations never completed: {:?}", sim.open_ops);
        prop_assert!(sim.parent.in_flight().is_empty());
        prop_assert!(sim.is_quiescent());
        prop_assert!(sim.parent.staged().is_empty());
        // With fencing, nothing ever becomes uncertain (specs/design.md §4.1: only
        // an embedder that cannot fence reaches the uncertain path).
        if fence {
            for c in &sim.completed {
                if let Err(e) = &c.result {
                    // A probe lost while deserializing poisons its digest.
                    let poisoned = probe && e.code == ErrorCode::REGISTER_POISONED;
                    // An unregister that lost a target says so; the handle
                    // is released all the same.
                    let released = e.code == ErrorCode::TARGET_LOST
                        && e.operation == callreg::error::OperationKind::Unregister;
                    prop_assert!(
                        poisoned || released || e.code == ErrorCode::REGISTER_PARTIAL_FAILURE,
                        "{}",
                        e
                    );
                }
            }
            prop_assert!(
                sim.uncertain.is_empty() && sim.healed.is_empty(),
                "uncertain with fencing: {:?}, healed {:?}",
                sim.uncertain,
                sim.healed
            );
        }
        // A poisoned digest was never published, and only probing poisons.
        for (digest, _) in sim.parent.poisoned_digests() {
            prop_assert!(probe && !sim.parent.is_live(digest, callreg::protocol::Namespace::LocalPython));
        }
        // Every published handle is distinct.
        let mut ids: Vec<u64> = sim
            .completed
            .iter()
            .filter_map(|c| match &c.result {
                Ok(Completion::Registered(h)) => Some(h.handle_id),
                _ => None,
            })
            .collect();
        let n = ids.len();
        ids.sort_unstable();
        ids.dedup();
        prop_assert_eq!(ids.len(), n);
    }
}
