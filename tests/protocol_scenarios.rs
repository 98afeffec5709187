//! The scenarios of the protocol's specification, each
//! asserting the exact effects, replies and errors. Parent-side scenarios
//! drive a bare [`Parent`] and check every effect; whole-system scenarios
//! use the in-memory driver (`common::sim`) and check every invariant.

mod common;

use callreg::error::ErrorCode;
use callreg::protocol::{
    Completion, ControlFrame, ControlPhase, Effect, Failure, Handle, Namespace, OpId, OwnerToken,
    Parent, ParentConfig, Reply, Seq, StagingId, Target, TargetConfig, TargetEffect, TargetId,
    TargetOutcome, Time,
};
use common::sim::{digest, drain, ok, parent_config, registered, send, Sim};

const OWNER: OwnerToken = OwnerToken(0x5eed);

fn started(targets: u16, fence_on_timeout: bool) -> Parent {
    let mut p = Parent::new(parent_config(targets, fence_on_timeout));
    p.start().unwrap();
    p
}

fn err(seq: u64, n: u8, code: ErrorCode) -> Reply {
    Reply {
        seq: Seq(seq),
        digest: digest(n),
        result: Err(Failure::new(code, "refused")),
    }
}

fn handle(id: u64, n: u8) -> Handle {
    Handle {
        namespace: Namespace::LocalPython,
        hashid: digest(n).hashid(),
        handle_id: id,
        owner: OWNER,
    }
}

#[test]
fn same_callable_twice_gives_two_handles_and_one_unregister_keeps_the_other() {
    let mut sim = Sim::setup(2)
        .fence_on_timeout(true)
        .slot_capacity(4)
        .build();
    let a = sim.register_ok(1);
    let b = sim.register_ok(1);
    assert_ne!(a.handle_id, b.handle_id);
    assert_eq!(a.hashid, b.hashid);
    assert_eq!(sim.target(0).unwrap().installed(), vec![(digest(1), 2)]);
    let op = sim.unregister(&a).unwrap();
    sim.run_to_quiet().unwrap();
    assert_eq!(
        sim.completion(op).unwrap().result,
        Ok(Completion::Unregistered(a))
    );
    assert_eq!(
        sim.parent.resolve(&b, Namespace::LocalPython),
        Ok(digest(1))
    );
    assert_eq!(
        sim.parent
            .resolve(&a, Namespace::LocalPython)
            .unwrap_err()
            .code,
        ErrorCode::HANDLE_STALE
    );
    assert_eq!(sim.target(0).unwrap().installed(), vec![(digest(1), 1)]);
    assert_eq!(sim.target(1).unwrap().installed(), vec![(digest(1), 1)]);
    let seq = sim.submit(&b, 1).unwrap();
    assert!(sim.deliver_frame(1, None));
    assert_eq!(
        sim.running[1].iter().copied().collect::<Vec<_>>(),
        vec![seq]
    );
}

#[test]
fn forged_stale_mutated_foreign_and_wrong_namespace_handles_are_rejected() {
    let mut sim = Sim::setup(1)
        .fence_on_timeout(true)
        .slot_capacity(4)
        .build();
    let live = sim.register_ok(1);
    let gone = sim.register_ok(2);
    sim.unregister(&gone).unwrap();
    sim.run_to_quiet().unwrap();
    let code = |h: &Handle, ns| sim.parent.resolve(h, ns).unwrap_err().code;
    let forged = Handle {
        handle_id: 99,
        ..live
    };
    assert_eq!(
        code(&forged, Namespace::LocalPython),
        ErrorCode::HANDLE_FOREIGN
    );
    assert_eq!(code(&gone, Namespace::LocalPython), ErrorCode::HANDLE_STALE);
    let mutated = Handle {
        hashid: digest(3).hashid(),
        ..live
    };
    assert_eq!(
        code(&mutated, Namespace::LocalPython),
        ErrorCode::HANDLE_MUTATED
    );
    let renamed = Handle {
        namespace: Namespace::LocalChip,
        ..live
    };
    assert_eq!(
        code(&renamed, Namespace::LocalPython),
        ErrorCode::HANDLE_MUTATED
    );
    let foreign = Handle {
        owner: OwnerToken(7),
        ..live
    };
    assert_eq!(
        code(&foreign, Namespace::LocalPython),
        ErrorCode::HANDLE_FOREIGN
    );
    assert_eq!(
        code(&live, Namespace::LocalChip),
        ErrorCode::HANDLE_WRONG_NAMESPACE
    );
    // Each is refused by unregister and submit too, with nothing emitted.
    let e = sim.unregister(&forged).unwrap_err();
    assert_eq!(
        (e.code, e.hashid, e.namespace),
        (
            ErrorCode::HANDLE_FOREIGN,
            Some(digest(1).hashid()),
            Some(Namespace::LocalPython)
        )
    );
    assert_eq!(
        sim.submit(&gone, 0).unwrap_err().code,
        ErrorCode::HANDLE_STALE
    );
    assert!(sim.frames[0].is_empty());
}

#[test]
fn pre_start_registrations_appear_in_the_snapshot_with_counts() {
    let mut p = Parent::new(ParentConfig {
        targets: 2,
        control_timeout: 1_000,
        operation_timeout: 10_000,
        fence_on_timeout: true,
        owner: OWNER,
        slot_capacity: 64,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
    });
    let a = p
        .register_before_start(digest(1), Namespace::LocalPython)
        .unwrap();
    let _b = p
        .register_before_start(digest(1), Namespace::LocalPython)
        .unwrap();
    let c = p
        .register_before_start(digest(2), Namespace::LocalPython)
        .unwrap();
    p.register_before_start(digest(3), Namespace::LocalPython)
        .unwrap();
    p.unregister_before_start(&c).unwrap();
    assert_eq!(p.startup_snapshot(), vec![(digest(1), 2), (digest(3), 1)]);
    assert_eq!(drain(&mut p), vec![]);
    assert_eq!(
        p.unregister_before_start(&c).unwrap_err().code,
        ErrorCode::HANDLE_STALE
    );
    let target = Target::new(TargetConfig::new(TargetId(0)), &p.startup_snapshot()).unwrap();
    assert_eq!(target.installed(), vec![(digest(1), 2), (digest(3), 1)]);
    p.start().unwrap();
    assert_eq!(p.resolve(&a, Namespace::LocalPython), Ok(digest(1)));
}

#[test]
fn target_failing_during_register_rolls_back_with_cleanup_only_to_confirmed_targets() {
    let mut p = started(3, true);
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    assert_eq!(op, OpId(1));
    let reg = ControlFrame::Register {
        seq: Seq(1),
        digest: digest(1),
        staging: StagingId(1),
    };
    assert_eq!(
        drain(&mut p),
        vec![
            Effect::Stage {
                staging: StagingId(1),
                digest: digest(1)
            },
            send(0, reg.clone()),
            send(1, reg.clone()),
            send(2, reg),
        ]
    );
    p.handle_reply(TargetId(0), ok(1, 1), Time(5)).unwrap();
    p.handle_reply(
        TargetId(1),
        err(1, 1, ErrorCode::DESERIALIZE_FAILED),
        Time(6),
    )
    .unwrap();
    assert_eq!(drain(&mut p), vec![]);
    p.handle_reply(TargetId(2), ok(1, 1), Time(7)).unwrap();
    let cleanup = ControlFrame::Unregister {
        seq: Seq(2),
        digest: digest(1),
    };
    assert_eq!(
        drain(&mut p),
        vec![
            Effect::ReleaseStaged {
                staging: StagingId(1)
            },
            send(0, cleanup.clone()),
            send(2, cleanup)
        ]
    );
    assert_eq!(p.poll_timeout(), Some(Time(1_007)));
    p.handle_reply(TargetId(0), ok(2, 1), Time(8)).unwrap();
    p.handle_reply(TargetId(2), ok(2, 1), Time(9)).unwrap();
    let effects = drain(&mut p);
    let [Effect::Completed {
        op: done,
        result: Err(e),
        outcomes,
    }] = effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    assert_eq!(*done, OpId(1));
    assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!((e.seq, e.hashid), (Some(Seq(1)), Some(digest(1).hashid())));
    assert_eq!(
        outcomes,
        &vec![
            (TargetId(0), TargetOutcome::RolledBack),
            (
                TargetId(1),
                TargetOutcome::Failed {
                    failure: Failure::new(ErrorCode::DESERIALIZE_FAILED, "refused")
                }
            ),
            (TargetId(2), TargetOutcome::RolledBack),
        ]
    );
    assert_eq!(p.live_handles(), vec![]);
    assert!(!p.is_uncertain(digest(1)));
    assert!(p.staged().is_empty() && p.in_flight().is_empty());
}

#[test]
fn unconfirmed_cleanup_makes_the_digest_uncertain_and_later_registers_are_rejected() {
    let mut p = started(2, false);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(1, 1), Time(1)).unwrap();
    p.handle_reply(
        TargetId(1),
        err(1, 1, ErrorCode::LOCAL_SLOT_EXHAUSTED),
        Time(2),
    )
    .unwrap();
    drain(&mut p);
    // The cleanup (seq 2) to target 0 gets no answer before its deadline.
    assert_eq!(p.poll_timeout(), Some(Time(1_002)));
    p.handle_timeout(Time(1_001));
    assert!(!p.is_uncertain(digest(1)));
    p.handle_timeout(Time(1_002));
    assert!(p.is_uncertain(digest(1)));
    let effects = drain(&mut p);
    let [Effect::Completed {
        result: Err(e),
        outcomes,
        ..
    }] = effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(
        outcomes[0],
        (
            TargetId(0),
            TargetOutcome::CleanupUnconfirmed {
                failure: Failure::new(
                    ErrorCode::DEADLINE_EXCEEDED,
                    "no answer to the cleanup before its deadline"
                )
            }
        )
    );
    let again = p
        .register(digest(1), Namespace::LocalPython, Time(3_000))
        .unwrap_err();
    assert_eq!(again.code, ErrorCode::REGISTER_CLEANUP_UNCERTAIN);
    assert_eq!(drain(&mut p), vec![]);
    // The late answer to the cleanup settles the doubt (§2.4,
    // "Uncertainty heals"): target 0 rolled back, so the digest is certain
    // again and may be registered.
    assert!(p.awaits_heal(TargetId(0), Seq(2)));
    assert!(!p.awaits_reply(TargetId(0), Seq(2)));
    p.handle_reply(TargetId(0), ok(2, 1), Time(3_001)).unwrap();
    assert!(!p.is_uncertain(digest(1)));
    assert!(!p.awaits_heal(TargetId(0), Seq(2)));
    assert_eq!(drain(&mut p), vec![]);
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(3_002))
        .unwrap();
    assert_eq!(op, OpId(3));
}

#[test]
fn a_refused_late_cleanup_leaves_the_target_disagreeing_until_it_is_lost() {
    let mut p = started(2, false);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    p.handle_reply(TargetId(0), ok(1, 1), Time(1)).unwrap();
    p.handle_reply(
        TargetId(1),
        err(1, 1, ErrorCode::LOCAL_SLOT_EXHAUSTED),
        Time(2),
    )
    .unwrap();
    p.handle_timeout(Time(1_002));
    drain(&mut p);
    // Target 0 refuses the cleanup, late: parent and target disagree.
    p.handle_reply(
        TargetId(0),
        err(2, 1, ErrorCode::DIGEST_NOT_INSTALLED),
        Time(1_003),
    )
    .unwrap();
    assert!(p.is_uncertain(digest(1)));
    assert!(!p.awaits_heal(TargetId(0), Seq(2)));
    assert_eq!(drain(&mut p), vec![]);
    // Target 1's loss settles nothing of target 0's.
    p.target_lost(TargetId(1), Time(1_004)).unwrap();
    assert!(p.is_uncertain(digest(1)));
    // Target 0's loss does: a lost target holds nothing.
    p.target_lost(TargetId(0), Time(1_005)).unwrap();
    assert!(!p.is_uncertain(digest(1)));
}

#[test]
fn cleanup_refused_by_a_target_makes_the_digest_uncertain() {
    let mut p = started(2, true);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    p.handle_reply(TargetId(0), ok(1, 1), Time(1)).unwrap();
    p.target_lost(TargetId(1), Time(2)).unwrap();
    p.handle_reply(
        TargetId(0),
        err(2, 1, ErrorCode::DIGEST_NOT_INSTALLED),
        Time(3),
    )
    .unwrap();
    assert!(p.is_uncertain(digest(1)));
    let last = drain(&mut p).pop().unwrap();
    let Effect::Completed {
        result: Err(e),
        outcomes,
        ..
    } = last
    else {
        panic!("{last:?}")
    };
    assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(outcomes[1], (TargetId(1), TargetOutcome::Lost));
}

#[test]
fn digest_mismatch_installs_nothing() {
    let mut t = Target::new(TargetConfig::new(TargetId(3)), &[]).unwrap();
    t.on_register(Seq(4), digest(1), Ok(digest(2)));
    let effects: Vec<_> = std::iter::from_fn(|| t.poll_effect()).collect();
    let [TargetEffect::Reply(Reply {
        seq: Seq(4),
        digest: d,
        result: Err(f),
    })] = effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    assert_eq!(
        (*d, f.code),
        (digest(1), ErrorCode::HASHID_DESCRIPTOR_MISMATCH)
    );
    assert_eq!(t.installed(), vec![]);
    assert_eq!(t.slots_in_use(), 0);
    // Also when the digest is already installed: no refcount increment.
    let mut t = Target::new(TargetConfig::new(TargetId(3)), &[(digest(1), 1)]).unwrap();
    t.on_register(Seq(5), digest(1), Ok(digest(2)));
    assert_eq!(t.installed(), vec![(digest(1), 1)]);
}

#[test]
fn slot_exhaustion_is_reported_before_any_deserialization() {
    let mut t = Target::new(
        TargetConfig {
            id: TargetId(0),
            slot_capacity: 1,
        },
        &[(digest(1), 1)],
    )
    .unwrap();
    t.on_register(Seq(9), digest(2), Ok(digest(2)));
    let effects: Vec<_> = std::iter::from_fn(|| t.poll_effect()).collect();
    assert_eq!(effects.len(), 1, "{effects:?}");
    let TargetEffect::Reply(Reply { result: Err(f), .. }) = &effects[0] else {
        panic!("{effects:?}")
    };
    assert_eq!(f.code, ErrorCode::LOCAL_SLOT_EXHAUSTED);
    assert_eq!(
        f.message,
        format!("target 0 has no free slot (capacity 1) for {}", digest(2))
    );
}

#[test]
fn unregister_of_an_unknown_digest_is_reported() {
    let mut t = Target::new(TargetConfig::new(TargetId(1)), &[]).unwrap();
    t.on_unregister(Seq(2), digest(7));
    assert_eq!(
        t.poll_effect(),
        Some(TargetEffect::Reply(Reply {
            seq: Seq(2),
            digest: digest(7),
            result: Err(Failure::new(
                ErrorCode::DIGEST_NOT_INSTALLED,
                format!("{} is not installed on target 1", digest(7))
            )),
        }))
    );
    // The parent, told so for a user unregister, marks the digest uncertain.
    let mut p = Parent::new(ParentConfig {
        targets: 1,
        control_timeout: 1_000,
        operation_timeout: 10_000,
        fence_on_timeout: true,
        owner: OWNER,
        slot_capacity: 64,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
    });
    let h = p
        .register_before_start(digest(7), Namespace::LocalPython)
        .unwrap();
    p.start().unwrap();
    assert_eq!(p.unregister(&h, Time(0)), Ok(OpId(1)));
    drain(&mut p);
    p.handle_reply(
        TargetId(0),
        err(1, 7, ErrorCode::DIGEST_NOT_INSTALLED),
        Time(1),
    )
    .unwrap();
    let last = drain(&mut p).pop().unwrap();
    let Effect::Completed { result: Err(e), .. } = last else {
        panic!("{last:?}")
    };
    assert_eq!(e.code, ErrorCode::UNREGISTER_PARTIAL_FAILURE);
    assert!(p.is_uncertain(digest(7)));
}

#[test]
fn final_unregister_while_a_run_holds_the_slot_frees_it_only_when_the_run_completes() {
    let mut sim = Sim::setup(1)
        .fence_on_timeout(true)
        .slot_capacity(1)
        .build();
    let h = sim.register_ok(1);
    let task = sim.submit(&h, 0).unwrap();
    assert!(sim.deliver_frame(0, None));
    sim.unregister(&h).unwrap();
    sim.run_to_quiet_without_runs();
    let t = sim.target(0).unwrap();
    assert_eq!(
        (t.installed(), t.slots_in_use(), t.runs_in_progress()),
        (vec![], 1, 1)
    );
    // The tombstoned slot still counts: a new callable finds no free slot.
    let op = sim.register(2).unwrap();
    sim.deliver_frame(0, None);
    sim.deliver_reply(0);
    let c = sim.completion(op).unwrap();
    assert_eq!(
        c.result.as_ref().unwrap_err().code,
        ErrorCode::REGISTER_PARTIAL_FAILURE
    );
    assert!(
        matches!(&c.outcomes[0].1, TargetOutcome::Failed { failure } if failure.code == ErrorCode::LOCAL_SLOT_EXHAUSTED)
    );
    assert_eq!(sim.running[0].front(), Some(&task));
    assert!(sim.end_run(0));
    assert_eq!(sim.target(0).unwrap().slots_in_use(), 0);
    sim.check().unwrap();
    sim.register_ok(2);
}

#[test]
fn register_and_unregister_of_the_same_digest_in_flight_together() {
    let mut sim = Sim::setup(2)
        .fence_on_timeout(true)
        .slot_capacity(2)
        .before_start(&[1])
        .build();
    let old = sim.live_handles()[0];
    let reg = sim.register(1).unwrap();
    let unreg = sim.unregister(&old).unwrap();
    // Target 0 sees register then unregister; target 1 the same frames, but
    // the parent hears target 1 first.
    assert_eq!(sim.frames[0].len(), 2);
    sim.run_to_quiet().unwrap();
    let new = sim.registered(reg);
    assert_eq!(
        sim.completion(unreg).unwrap().result,
        Ok(Completion::Unregistered(old))
    );
    assert_eq!(sim.live_handles(), vec![new]);
    assert_eq!(sim.target(0).unwrap().installed(), vec![(digest(1), 1)]);
    // Unregister first: the digest goes to zero and the register deserializes again.
    let unreg = sim.unregister(&new).unwrap();
    let reg = sim.register(1).unwrap();
    sim.run_to_quiet().unwrap();
    assert!(sim.completion(unreg).unwrap().result.is_ok());
    let newest = sim.registered(reg);
    assert_eq!(sim.live_handles(), vec![newest]);
    assert_eq!(sim.target(1).unwrap().installed(), vec![(digest(1), 1)]);
}

#[test]
fn a_target_lost_mid_operation_fails_it_and_leaves_later_scopes() {
    let mut p = started(2, true);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.target_lost(TargetId(1), Time(1)).unwrap();
    assert_eq!(drain(&mut p), vec![]);
    p.handle_reply(TargetId(0), ok(1, 1), Time(2)).unwrap();
    let cleanup = ControlFrame::Unregister {
        seq: Seq(2),
        digest: digest(1),
    };
    assert_eq!(
        drain(&mut p),
        vec![
            Effect::ReleaseStaged {
                staging: StagingId(1)
            },
            send(0, cleanup)
        ]
    );
    p.handle_reply(TargetId(0), ok(2, 1), Time(3)).unwrap();
    let last = drain(&mut p).pop().unwrap();
    let Effect::Completed {
        result: Err(e),
        outcomes,
        ..
    } = last
    else {
        panic!("{last:?}")
    };
    assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(
        outcomes,
        vec![
            (TargetId(0), TargetOutcome::RolledBack),
            (TargetId(1), TargetOutcome::Lost)
        ]
    );
    assert!(!p.is_uncertain(digest(1)));
    // The next register reaches target 0 only, and succeeds there.
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(10))
        .unwrap();
    let reg = ControlFrame::Register {
        seq: Seq(3),
        digest: digest(1),
        staging: StagingId(3),
    };
    assert_eq!(
        drain(&mut p),
        vec![
            Effect::Stage {
                staging: StagingId(3),
                digest: digest(1)
            },
            send(0, reg)
        ]
    );
    p.handle_reply(TargetId(0), ok(3, 1), Time(11)).unwrap();
    assert_eq!(
        drain(&mut p),
        vec![
            Effect::ReleaseStaged {
                staging: StagingId(3)
            },
            Effect::Completed {
                op,
                result: Ok(Completion::Registered(handle(1, 1))),
                outcomes: vec![(TargetId(0), TargetOutcome::Ok)],
            },
        ]
    );
    assert_eq!(
        p.submit(&handle(1, 1), TargetId(1)).unwrap_err().code,
        ErrorCode::TARGET_LOST
    );
}

#[test]
fn a_passed_deadline_fences_the_silent_target_and_nothing_becomes_uncertain() {
    let mut p = started(2, true);
    p.register(digest(1), Namespace::LocalPython, Time(100))
        .unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(1, 1), Time(200)).unwrap();
    assert_eq!(p.poll_timeout(), Some(Time(1_100)));
    p.handle_timeout(Time(1_100));
    let effects = drain(&mut p);
    assert_eq!(
        effects[0],
        Effect::Fence {
            target: TargetId(1),
            cause: callreg::protocol::SILENT_FENCE_CAUSE.to_owned()
        }
    );
    assert_eq!(
        effects[1],
        Effect::ReleaseStaged {
            staging: StagingId(1)
        }
    );
    assert_eq!(
        effects[2],
        send(
            0,
            ControlFrame::Unregister {
                seq: Seq(2),
                digest: digest(1)
            }
        )
    );
    assert!(!p.is_target_live(TargetId(1)));
    assert!(!p.is_uncertain(digest(1)));
    // A reply from the fenced target is ignored.
    p.handle_reply(TargetId(1), ok(1, 1), Time(1_200)).unwrap();
    assert!(!p.is_uncertain(digest(1)));
}

#[test]
fn a_passed_deadline_without_fencing_times_out_and_marks_uncertain() {
    let mut p = started(2, false);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(1, 1), Time(1)).unwrap();
    p.handle_timeout(Time(1_000));
    assert!(p.is_uncertain(digest(1)));
    assert!(p.is_target_live(TargetId(1)));
    let effects = drain(&mut p);
    assert_eq!(
        effects,
        vec![
            Effect::ReleaseStaged {
                staging: StagingId(1)
            },
            send(
                0,
                ControlFrame::Unregister {
                    seq: Seq(2),
                    digest: digest(1)
                }
            ),
        ]
    );
    p.handle_reply(TargetId(0), ok(2, 1), Time(2_000)).unwrap();
    let last = drain(&mut p).pop().unwrap();
    let Effect::Completed { outcomes, .. } = last else {
        panic!("{last:?}")
    };
    assert_eq!(
        outcomes,
        vec![
            (TargetId(0), TargetOutcome::RolledBack),
            (TargetId(1), TargetOutcome::TimedOut)
        ]
    );
    // Target 1 answers late that it installed the digest: it holds one
    // reference the registry does not, so a heal unregister (a fresh seq)
    // takes it back (§2.4, "Uncertainty heals"); the digest stays uncertain
    // until that is confirmed.
    assert!(p.awaits_heal(TargetId(1), Seq(1)));
    p.handle_reply(TargetId(1), ok(1, 1), Time(2_001)).unwrap();
    assert_eq!(
        drain(&mut p),
        vec![send(
            1,
            ControlFrame::Unregister {
                seq: Seq(3),
                digest: digest(1)
            }
        )]
    );
    assert!(p.is_uncertain(digest(1)));
    assert!(p.awaits_heal(TargetId(1), Seq(3)) && !p.awaits_heal(TargetId(1), Seq(1)));
    // Its alive reports for the heal move nothing.
    p.handle_alive(TargetId(1), Seq(3), ControlPhase::Running, Time(2_002))
        .unwrap();
    assert_eq!(p.poll_timeout(), None);
    p.handle_reply(TargetId(1), ok(3, 1), Time(2_003)).unwrap();
    assert!(!p.is_uncertain(digest(1)));
    assert_eq!(drain(&mut p), vec![]);
}

#[test]
fn a_late_refusal_of_a_register_heals_at_once() {
    let mut p = started(2, false);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    p.handle_reply(TargetId(0), ok(1, 1), Time(1)).unwrap();
    p.handle_timeout(Time(1_000));
    p.handle_reply(TargetId(0), ok(2, 1), Time(1_001)).unwrap();
    drain(&mut p);
    assert!(p.is_uncertain(digest(1)));
    // Target 1 refuses late: it installed nothing, as the registry says.
    p.handle_reply(
        TargetId(1),
        err(1, 1, ErrorCode::LOCAL_SLOT_EXHAUSTED),
        Time(1_002),
    )
    .unwrap();
    assert!(!p.is_uncertain(digest(1)));
    assert_eq!(drain(&mut p), vec![]);
}

#[test]
fn a_late_unregister_answer_while_its_operation_waits_is_its_outcome() {
    let mut p = started(2, false);
    let handle = registered(&mut p, 1, &[0, 1], 0);
    // Target 0 times out on the unregister while target 1 is heard from.
    let op = p.unregister(&handle, Time(100)).unwrap();
    drain(&mut p);
    p.handle_alive(TargetId(1), Seq(op.0), ControlPhase::Running, Time(1_000))
        .unwrap();
    p.handle_timeout(Time(1_100));
    assert!(p.is_uncertain(digest(1)));
    assert!(drain(&mut p).is_empty(), "still waiting for target 1");
    // Target 0's late OK settles its doubt and becomes its outcome.
    p.handle_reply(TargetId(0), ok(op.0, 1), Time(1_101))
        .unwrap();
    assert!(!p.is_uncertain(digest(1)));
    p.handle_reply(TargetId(1), ok(op.0, 1), Time(1_102))
        .unwrap();
    assert_eq!(
        drain(&mut p),
        vec![Effect::Completed {
            op,
            result: Ok(Completion::Unregistered(handle)),
            outcomes: vec![
                (TargetId(0), TargetOutcome::Ok),
                (TargetId(1), TargetOutcome::Ok)
            ],
        }]
    );
}

// Boundaries the IO layer relies on, each pinned exactly (a reply or loss
// naming the id one past the last target, an unregister that timed out,
// the awaited-reply query, the cleanup's own deadline).

#[test]
fn a_reply_or_loss_naming_the_id_one_past_the_last_target_is_refused() {
    let mut p = started(2, true);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    let before = p.clone();
    let e = p.handle_reply(TargetId(2), ok(1, 1), Time(1)).unwrap_err();
    assert_eq!(
        (e.code, e.target),
        (ErrorCode::FRAME_INVALID, Some(TargetId(2)))
    );
    assert_eq!(e.message, "there is no target 2 (targets 0..2)");
    let e = p.target_lost(TargetId(2), Time(1)).unwrap_err();
    assert_eq!(
        (e.code, e.target),
        (ErrorCode::FRAME_INVALID, Some(TargetId(2)))
    );
    // Nothing changed: in particular the digest is not uncertain.
    assert_eq!(p, before);
    assert!(!p.is_uncertain(digest(1)));
    assert!(!p.is_target_live(TargetId(2)));
    assert!(!p.awaits_reply(TargetId(2), Seq(1)));
    // The last real target is accepted.
    p.handle_reply(TargetId(1), ok(1, 1), Time(2)).unwrap();
    assert!(!p.awaits_reply(TargetId(1), Seq(1)));
}

#[test]
fn replies_for_seq_zero_and_the_next_seq_are_refused() {
    let mut p = started(1, true);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    let before = p.clone();
    for seq in [0, 2] {
        let e = p
            .handle_reply(TargetId(0), ok(seq, 1), Time(1))
            .unwrap_err();
        assert_eq!((e.code, e.seq), (ErrorCode::FRAME_INVALID, Some(Seq(seq))));
    }
    assert_eq!(p, before);
}

#[test]
fn an_unregister_whose_target_timed_out_without_fencing_fails() {
    let mut p = Parent::new(ParentConfig {
        targets: 2,
        control_timeout: 1_000,
        operation_timeout: 10_000,
        fence_on_timeout: false,
        owner: OWNER,
        slot_capacity: 64,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
    });
    let h = p
        .register_before_start(digest(1), Namespace::LocalPython)
        .unwrap();
    p.start().unwrap();
    assert_eq!(p.unregister(&h, Time(0)), Ok(OpId(1)));
    drain(&mut p);
    assert!(p.awaits_reply(TargetId(0), Seq(1)));
    p.handle_reply(TargetId(0), ok(1, 1), Time(1)).unwrap();
    assert_eq!(p.poll_timeout(), Some(Time(1_000)));
    p.handle_timeout(Time(1_000));
    assert!(!p.awaits_reply(TargetId(1), Seq(1)));
    let [Effect::Completed {
        op,
        result: Err(e),
        outcomes,
    }] = <[Effect; 1]>::try_from(drain(&mut p)).unwrap()
    else {
        panic!("no failed completion")
    };
    assert_eq!(op, OpId(1));
    assert_eq!(e.code, ErrorCode::UNREGISTER_PARTIAL_FAILURE);
    assert_eq!(
        outcomes,
        vec![
            (TargetId(0), TargetOutcome::Ok),
            (TargetId(1), TargetOutcome::TimedOut)
        ]
    );
    assert!(p.is_uncertain(digest(1)));
    // Its late OK says it let go as well: the doubt is settled, the digest
    // certain again (§2.4, "Uncertainty heals"), and nothing is sent.
    p.handle_reply(TargetId(1), ok(1, 1), Time(1_001)).unwrap();
    assert!(!p.is_uncertain(digest(1)));
    assert_eq!(drain(&mut p), vec![]);
}

#[test]
fn awaits_reply_follows_each_target_through_the_register_and_its_cleanup() {
    let mut p = started(2, true);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    assert!(p.awaits_reply(TargetId(0), Seq(1)));
    assert!(p.awaits_reply(TargetId(1), Seq(1)));
    assert!(!p.awaits_reply(TargetId(0), Seq(2)), "no seq 2 yet");
    p.handle_reply(TargetId(0), ok(1, 1), Time(10)).unwrap();
    assert!(!p.awaits_reply(TargetId(0), Seq(1)), "answered");
    assert!(p.awaits_reply(TargetId(1), Seq(1)));
    // Target 1 refuses: the cleanup (seq 2) goes to target 0 only, with a
    // deadline of its own, counted from when it began.
    p.handle_reply(
        TargetId(1),
        err(1, 1, ErrorCode::DESERIALIZE_FAILED),
        Time(500),
    )
    .unwrap();
    assert!(!p.awaits_reply(TargetId(1), Seq(1)));
    assert!(p.awaits_reply(TargetId(0), Seq(2)), "the cleanup");
    assert!(!p.awaits_reply(TargetId(1), Seq(2)), "not cleaned");
    assert!(!p.awaits_reply(TargetId(0), Seq(1)));
    assert_eq!(p.poll_timeout(), Some(Time(1_500)));
    // At the register's own deadline nothing expires.
    p.handle_timeout(Time(1_000));
    assert!(p.awaits_reply(TargetId(0), Seq(2)));
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(2, 1), Time(1_100)).unwrap();
    assert!(!p.awaits_reply(TargetId(0), Seq(2)));
    assert_eq!(p.poll_timeout(), None);
    assert!(p.in_flight().is_empty());
}

#[test]
fn every_frame_names_its_seq_and_digest() {
    let frames = [
        ControlFrame::Register {
            seq: Seq(3),
            digest: digest(4),
            staging: StagingId(5),
        },
        ControlFrame::Unregister {
            seq: Seq(6),
            digest: digest(7),
        },
        ControlFrame::Task {
            seq: Seq(8),
            digest: digest(9),
        },
    ];
    let named: Vec<(Seq, callreg::descriptor::Digest)> =
        frames.iter().map(|f| (f.seq(), f.digest())).collect();
    assert_eq!(
        named,
        vec![
            (Seq(3), digest(4)),
            (Seq(6), digest(7)),
            (Seq(8), digest(9))
        ]
    );
}

#[test]
fn ids_namespaces_and_failures_display_as_documented() {
    assert_eq!(TargetId(3).to_string(), "target 3");
    assert_eq!(Seq(12).to_string(), "seq 12");
    assert_eq!(Namespace::LocalPython.to_string(), "LOCAL_PYTHON");
    assert_eq!(Namespace::LocalChip.to_string(), "LOCAL_CHIP");
    assert_eq!(Namespace::LocalChip.as_str(), "LOCAL_CHIP");
    assert_eq!(
        Failure::new(ErrorCode::DESERIALIZE_FAILED, "bad pickle: line 1").to_string(),
        "DESERIALIZE_FAILED: bad pickle: line 1"
    );
    let error = callreg::error::Error::new(
        ErrorCode::IO_FAILED,
        callreg::error::OperationKind::Register,
        "pipe closed",
    );
    assert_eq!(
        Failure::from(error),
        Failure::new(ErrorCode::IO_FAILED, "pipe closed")
    );
    assert_eq!(Time(u64::MAX - 1).saturating_add_micros(5), Time(u64::MAX));
    assert_eq!(Time(7).saturating_add_micros(5), Time(12));
}

/// The seq of the first `Unregister` frame sent to `target` in `effects`.
fn unregister_seq(effects: &[Effect], target: u16) -> u64 {
    effects
        .iter()
        .find_map(|e| match e {
            Effect::Send {
                target: t,
                frame: ControlFrame::Unregister { seq, .. },
            } if *t == TargetId(target) => Some(seq.0),
            _ => None,
        })
        .expect("an unregister frame")
}

#[test]
fn a_late_register_answer_while_its_register_waits_is_not_its_outcome() {
    let mut p = started(2, false);
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    // Target 1 is heard from; target 0 times out.
    p.handle_alive(TargetId(1), Seq(op.0), ControlPhase::Running, Time(900))
        .unwrap();
    assert!(!p.awaits_heals());
    p.handle_timeout(Time(1_000));
    assert!(p.awaits_heals());
    assert!(drain(&mut p).is_empty(), "still waiting for target 1");
    // Target 0 answers late that it installed it: a heal goes to it, and
    // its outcome in the register stays TimedOut.
    p.handle_reply(TargetId(0), ok(op.0, 1), Time(1_001))
        .unwrap();
    let heal = unregister_seq(&drain(&mut p), 0);
    assert!(p.awaits_heal(TargetId(0), Seq(heal)) && p.awaits_heals());
    let refused = p
        .register(digest(1), Namespace::LocalPython, Time(1_002))
        .unwrap_err();
    assert_eq!(
        refused.message,
        format!(
            "{} is uncertain: no target's refcount for it can be trusted until each target in doubt answers or is lost (target 0 owes an answer to seq {heal})",
            digest(1)
        )
    );
    p.handle_reply(TargetId(1), ok(op.0, 1), Time(1_003))
        .unwrap();
    let cleanup = unregister_seq(&drain(&mut p), 1);
    p.handle_reply(TargetId(1), ok(cleanup, 1), Time(1_004))
        .unwrap();
    let effects = drain(&mut p);
    let Some(Effect::Completed {
        result: Err(e),
        outcomes,
        ..
    }) = effects.last()
    else {
        panic!("{effects:?}")
    };
    assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE, "{e}");
    assert_eq!(
        outcomes,
        &vec![
            (TargetId(0), TargetOutcome::TimedOut),
            (TargetId(1), TargetOutcome::RolledBack)
        ]
    );
    // The heal's answer settles the last doubt.
    p.handle_reply(TargetId(0), ok(heal, 1), Time(1_005))
        .unwrap();
    assert!(!p.is_uncertain(digest(1)) && !p.awaits_heals());
}

#[test]
fn a_late_answer_to_one_operation_is_no_outcome_of_another() {
    let mut p = started(3, false);
    let held = registered(&mut p, 2, &[0, 1, 2], 0);
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(op.0, 1), Time(1)).unwrap();
    p.handle_reply(TargetId(1), ok(op.0, 1), Time(1)).unwrap();
    p.handle_reply(
        TargetId(2),
        err(op.0, 1, ErrorCode::LOCAL_SLOT_EXHAUSTED),
        Time(1),
    )
    .unwrap();
    let cleanup = unregister_seq(&drain(&mut p), 0);
    // An unregister of another digest that target 0 will answer late too.
    let unregister = p.unregister(&held, Time(2)).unwrap();
    drain(&mut p);
    for t in [1, 2] {
        p.handle_reply(TargetId(t), ok(unregister.0, 2), Time(3))
            .unwrap();
    }
    p.handle_alive(TargetId(1), Seq(cleanup), ControlPhase::Running, Time(900))
        .unwrap();
    // Target 0 misses both deadlines; the cleanup still waits for target 1.
    p.handle_timeout(Time(1_002));
    drain(&mut p);
    assert!(p.is_uncertain(digest(1)) && p.is_uncertain(digest(2)));
    // Its late answer to the unregister settles that doubt and no other
    // target's or operation's outcome.
    p.handle_reply(TargetId(0), ok(unregister.0, 2), Time(1_003))
        .unwrap();
    assert!(!p.is_uncertain(digest(2)) && p.is_uncertain(digest(1)));
    // The register completes with target 0's cleanup unconfirmed: the
    // other operation's answer was not this one's.
    p.handle_reply(TargetId(1), ok(cleanup, 1), Time(1_004))
        .unwrap();
    let effects = drain(&mut p);
    let Some(Effect::Completed {
        result: Err(e),
        outcomes,
        ..
    }) = effects.last()
    else {
        panic!("{effects:?}")
    };
    assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE, "{e}");
    // Its late answer to the cleanup then settles the last doubt.
    p.handle_reply(TargetId(0), ok(cleanup, 1), Time(1_005))
        .unwrap();
    assert!(!p.is_uncertain(digest(1)));
    assert_eq!(
        outcomes,
        &vec![
            (
                TargetId(0),
                TargetOutcome::CleanupUnconfirmed {
                    failure: Failure::new(
                        ErrorCode::DEADLINE_EXCEEDED,
                        "no answer to the cleanup before its deadline"
                    )
                }
            ),
            (TargetId(1), TargetOutcome::RolledBack),
            (
                TargetId(2),
                TargetOutcome::Failed {
                    failure: Failure::new(ErrorCode::LOCAL_SLOT_EXHAUSTED, "refused")
                }
            )
        ]
    );
}

#[test]
fn a_late_refused_cleanup_while_its_register_waits_is_its_outcome() {
    let mut p = started(3, false);
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(op.0, 1), Time(1)).unwrap();
    p.handle_reply(TargetId(1), ok(op.0, 1), Time(1)).unwrap();
    p.handle_reply(
        TargetId(2),
        err(op.0, 1, ErrorCode::LOCAL_SLOT_EXHAUSTED),
        Time(1),
    )
    .unwrap();
    let cleanup = unregister_seq(&drain(&mut p), 0);
    p.handle_alive(TargetId(1), Seq(cleanup), ControlPhase::Running, Time(900))
        .unwrap();
    p.handle_timeout(Time(1_001));
    p.handle_reply(
        TargetId(0),
        err(cleanup, 1, ErrorCode::DIGEST_NOT_INSTALLED),
        Time(1_002),
    )
    .unwrap();
    p.handle_reply(TargetId(1), ok(cleanup, 1), Time(1_003))
        .unwrap();
    let effects = drain(&mut p);
    let Some(Effect::Completed { outcomes, .. }) = effects.last() else {
        panic!("{effects:?}")
    };
    assert_eq!(
        outcomes[0],
        (
            TargetId(0),
            TargetOutcome::CleanupUnconfirmed {
                failure: Failure::new(ErrorCode::DIGEST_NOT_INSTALLED, "refused")
            }
        )
    );
    assert!(p.is_uncertain(digest(1)) && !p.awaits_heals());
}

#[test]
fn an_unregister_that_loses_a_target_says_so_and_releases_the_handle() {
    let mut p = started(2, true);
    let handle = registered(&mut p, 1, &[0, 1], 0);
    let op = p.unregister(&handle, Time(10)).unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(op.0, 1), Time(11)).unwrap();
    // Target 1 dies while it drops it (e.g. in a finalizer).
    p.target_lost(TargetId(1), Time(12)).unwrap();
    let effects = drain(&mut p);
    assert_eq!(
        effects,
        vec![Effect::Completed {
            op,
            result: Err(callreg::error::Error::new(
                ErrorCode::TARGET_LOST,
                callreg::error::OperationKind::Unregister,
                format!(
                    "handle {} is released (a lost target holds nothing of it), but the unregister lost targets while it was pending there: target 1: lost",
                    handle.handle_id
                ),
            )
            .with_namespace(Namespace::LocalPython)
            .with_digest(digest(1))
            .with_seq(Seq(op.0))),
            outcomes: vec![
                (TargetId(0), TargetOutcome::Ok),
                (TargetId(1), TargetOutcome::Lost)
            ],
        }]
    );
    assert!(p.live_handles().is_empty() && !p.is_uncertain(digest(1)));
    assert_eq!(
        p.unregister(&handle, Time(13)).unwrap_err().code,
        ErrorCode::HANDLE_STALE
    );
}
