//! Unit tests of the parent machine. Probe first and poisoned digests (`specs/protocol.md` §2.8): a new
//! digest on one target first, what is evidence and what is not, forgive.

use super::*;

#[test]
fn a_new_digest_goes_to_one_target_then_to_the_others_once_it_confirmed() {
    let mut p = probing(3);
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    assert_eq!(
        drain(&mut p),
        vec![
            Effect::Stage {
                staging: StagingId(1),
                digest: digest(1)
            },
            register_frame(0, 1, 1),
            // The others may verify the payload while the probe installs it.
            Effect::Verify {
                target: TargetId(1),
                staging: StagingId(1),
                digest: digest(1)
            },
            Effect::Verify {
                target: TargetId(2),
                staging: StagingId(1),
                digest: digest(1)
            },
        ]
    );
    assert_eq!(p.poll_timeout(), Some(Time(100)));
    p.handle_reply(TargetId(0), ok(1, 1), Time(40)).unwrap();
    assert!(p.is_proven(digest(1)));
    // The broadcast has its own deadline; the payload stays staged.
    assert_eq!(
        drain(&mut p),
        vec![register_frame(1, 1, 1), register_frame(2, 1, 1)]
    );
    assert_eq!(p.poll_timeout(), Some(Time(140)));
    assert_eq!(p.staged(), vec![StagingId(1)]);
    p.handle_reply(TargetId(1), ok(1, 1), Time(41)).unwrap();
    p.handle_reply(TargetId(2), ok(1, 1), Time(42)).unwrap();
    let effects = drain(&mut p);
    assert_eq!(
        effects[0],
        Effect::ReleaseStaged {
            staging: StagingId(1)
        }
    );
    let Effect::Completed {
        op: done,
        result: Ok(Completion::Registered(handle)),
        outcomes,
    } = &effects[1]
    else {
        panic!("{effects:?}")
    };
    assert_eq!(*done, op);
    assert_eq!(outcomes.len(), 3);
    // A proven digest goes to every target at once.
    p.register(digest(1), Namespace::LocalPython, Time(50))
        .unwrap();
    let effects = drain(&mut p);
    assert_eq!(
        effects.len(),
        4,
        "stage and three frames, no hint: {effects:?}"
    );
    assert_eq!(p.live_handles(), vec![*handle]);
}

#[test]
fn a_probe_that_kills_its_target_poisons_the_digest_and_costs_one_target() {
    let mut p = probing(3);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.target_died(TargetId(0), "it exited with status 3", Time(5))
        .unwrap();
    let effects = drain(&mut p);
    assert_eq!(
        effects[0],
        Effect::ReleaseStaged {
            staging: StagingId(1)
        }
    );
    let (e, outcomes) = failure(effects.get(1));
    assert_eq!(e.code, ErrorCode::REGISTER_POISONED);
    assert!(
        e.message
            .contains("killed target 0 (it exited with status 3)"),
        "{}",
        e.message
    );
    assert_eq!(outcomes, &vec![(TargetId(0), TargetOutcome::Lost)]);
    assert!(p.is_poisoned(digest(1)));
    assert!(p.is_target_live(TargetId(1)) && p.is_target_live(TargetId(2)));
    // Refused from now on without any effect.
    let again = p
        .register(digest(1), Namespace::LocalPython, Time(6))
        .unwrap_err();
    assert_eq!(
        (again.code, again.target),
        (ErrorCode::REGISTER_POISONED, Some(TargetId(0)))
    );
    assert!(again.message.contains("it exited with status 3"));
    assert!(drain(&mut p).is_empty());
    // Another digest probes on the next live target.
    p.register(digest(2), Namespace::LocalPython, Time(7))
        .unwrap();
    // (Seq 2 went to the failed register's empty cleanup.)
    assert_eq!(drain(&mut p)[1], register_frame(1, 3, 2));
}

/// §2.8, "A nested refusal": a probe target that is itself a registry
/// answers `REGISTER_POISONED` (its own probe lost a process); the digest
/// is poisoned here too, and the target stays live.
#[test]
fn a_probe_refused_as_poisoned_poisons_the_digest_here_too() {
    let mut p = probing(2);
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    let inner = "installing it killed target 0 (it exited with status 3)";
    p.handle_reply(
        TargetId(0),
        Reply {
            seq: Seq(op.0),
            digest: digest(1),
            result: Err(Failure::new(ErrorCode::REGISTER_POISONED, inner)),
        },
        Time(5),
    )
    .unwrap();
    let effects = drain(&mut p);
    let (e, outcomes) = failure(effects.last());
    assert_eq!(
        (e.code, e.target),
        (ErrorCode::REGISTER_POISONED, Some(TargetId(0)))
    );
    assert!(e.message.contains(inner), "{}", e.message);
    assert_eq!(
        outcomes,
        &vec![(
            TargetId(0),
            TargetOutcome::Failed {
                failure: Failure::new(ErrorCode::REGISTER_POISONED, inner)
            }
        )]
    );
    assert!(p.is_poisoned(digest(1)));
    assert!(p.is_target_live(TargetId(0)) && p.is_target_live(TargetId(1)));
    let again = p
        .register(digest(1), Namespace::LocalPython, Time(6))
        .unwrap_err();
    assert_eq!(again.code, ErrorCode::REGISTER_POISONED);
    assert!(drain(&mut p).is_empty());
}

/// A register of the same digest in flight when a probe's refusal
/// poisoned it (both probing the same target, which stays live) and then
/// confirmed by that target is neither proven, broadcast nor published: it
/// is rolled back and fails `REGISTER_POISONED` (§2.8).
#[test]
fn a_probe_confirmed_after_a_nested_refusal_poisoned_its_digest_is_rolled_back() {
    let mut p = probing(2);
    let first = p
        .register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    let second = p
        .register(digest(1), Namespace::LocalPython, Time(1))
        .unwrap();
    drain(&mut p);
    p.handle_reply(
        TargetId(0),
        Reply {
            seq: Seq(first.0),
            digest: digest(1),
            result: Err(Failure::new(ErrorCode::REGISTER_POISONED, "inner")),
        },
        Time(2),
    )
    .unwrap();
    drain(&mut p);
    assert!(p.is_poisoned(digest(1)));
    p.handle_reply(TargetId(0), ok(second.0, 1), Time(3))
        .unwrap();
    let effects = drain(&mut p);
    assert!(!p.is_proven(digest(1)));
    let [Effect::ReleaseStaged { .. }, Effect::Send {
        target: TargetId(0),
        frame: ControlFrame::Unregister { seq, digest: d },
    }] = effects.as_slice()
    else {
        panic!("only the probe target's cleanup is sent: {effects:?}")
    };
    assert_eq!(*d, digest(1));
    let cleanup = seq.0;
    p.handle_reply(TargetId(0), ok(cleanup, 1), Time(4))
        .unwrap();
    let effects = drain(&mut p);
    let Some(Effect::Completed {
        op,
        result: Err(e),
        outcomes,
    }) = effects.last()
    else {
        panic!("{effects:?}")
    };
    assert_eq!((*op, e.code), (second, ErrorCode::REGISTER_POISONED));
    assert_eq!(outcomes, &vec![(TargetId(0), TargetOutcome::RolledBack)]);
    assert!(p.live_handles().is_empty());
}

/// Only a probe's refusal poisons: `REGISTER_POISONED` from a target that
/// was not probing (probe first off) fails the register and poisons
/// nothing.
#[test]
fn a_poisoned_refusal_outside_a_probe_poisons_nothing() {
    let mut p = started(2);
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(op.0, 1), Time(1)).unwrap();
    p.handle_reply(
        TargetId(1),
        Reply {
            seq: Seq(op.0),
            digest: digest(1),
            result: Err(Failure::new(ErrorCode::REGISTER_POISONED, "inner")),
        },
        Time(2),
    )
    .unwrap();
    let effects = drain(&mut p);
    assert!(!p.is_poisoned(digest(1)));
    assert!(
        effects
            .iter()
            .all(|e| !matches!(e, Effect::Completed { .. })),
        "the rollback of target 0 is awaited first: {effects:?}"
    );
}

/// §2.8, "A departure": a probe target that left (`target_left`) is lost
/// like one that died, but poisons nothing; a retry probes again.
#[test]
fn a_probe_target_that_left_poisons_nothing() {
    let mut p = probing(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.target_left(TargetId(0), "the Dask worker left the cluster", Time(5))
        .unwrap();
    let effects = drain(&mut p);
    let (e, outcomes) = failure(effects.last());
    assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(outcomes, &vec![(TargetId(0), TargetOutcome::Lost)]);
    assert!(!p.is_poisoned(digest(1)));
    assert!(!p.is_target_live(TargetId(0)));
    p.register(digest(1), Namespace::LocalPython, Time(6))
        .unwrap();
    assert_eq!(sent_to(drain(&mut p)), vec![TargetId(1)]);
}

#[test]
fn a_probe_target_fenced_for_silence_poisons_nothing() {
    let mut p = probing(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    // No alive report for a control timeout (a stopped target): fenced,
    // but silence is no evidence against the digest.
    p.handle_timeout(Time(100));
    let effects = drain(&mut p);
    assert_eq!(
        effects[0],
        Effect::Fence {
            target: TargetId(0),
            cause: SILENT_FENCE_CAUSE.to_owned()
        }
    );
    assert!(!p.is_poisoned(digest(1)));
    let (e, outcomes) = failure(effects.last());
    assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(outcomes, &vec![(TargetId(0), TargetOutcome::Fenced)]);
    // A retry probes again, on the next live target.
    p.register(digest(1), Namespace::LocalPython, Time(101))
        .unwrap();
    assert_eq!(sent_to(drain(&mut p)), vec![TargetId(1)]);
}

#[test]
fn a_forgiven_digest_probes_again() {
    let mut p = probing(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.target_died(TargetId(0), "it was killed by signal 9", Time(1))
        .unwrap();
    drain(&mut p);
    assert!(p.is_poisoned(digest(1)));
    assert!(p.forgive(digest(1)));
    assert!(!p.forgive(digest(1)));
    assert!(!p.is_poisoned(digest(1)) && !p.is_proven(digest(1)));
    p.register(digest(1), Namespace::LocalPython, Time(2))
        .unwrap();
    assert_eq!(sent_to(drain(&mut p)), vec![TargetId(1)]);
}

#[test]
fn a_probe_target_past_the_operation_bound_while_alive_poisons_the_digest() {
    let mut p = probing(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    // It keeps reporting alive (busy deserializing) past the bound.
    let mut now = 0;
    while now < 1_000 {
        now += 60;
        p.handle_alive(TargetId(0), Seq(1), ControlPhase::Running, Time(now))
            .unwrap();
        p.handle_timeout(Time(now));
    }
    let effects = drain(&mut p);
    assert!(effects.contains(&Effect::Fence {
        target: TargetId(0),
        cause: BOUND_FENCE_CAUSE.to_owned()
    }));
    assert!(p.is_poisoned(digest(1)));
    let poison = &p.poisoned_digests()[0].1;
    assert_eq!(poison.target, TargetId(0));
    assert_eq!(poison.cause, BOUND_FENCE_CAUSE);
}

/// Registers digest 1 on `probing(2)` (the probe to target 0), has
/// target 0 report it alive in `phases` (one report every 60, cycling
/// through the list) until the operation's bound fences it, and returns
/// the effects since the register.
fn fenced_at_the_bound_after(p: &mut Parent, phases: &[ControlPhase]) -> Vec<Effect> {
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    let mut effects = drain(p);
    let mut now = 0;
    for phase in phases.iter().cycle() {
        now += 60;
        if now >= 1_000 {
            break;
        }
        p.handle_alive(TargetId(0), Seq(1), *phase, Time(now))
            .unwrap();
        p.handle_timeout(Time(now));
        assert!(fences(&drain(p)).is_empty(), "fenced before the bound");
    }
    p.handle_timeout(Time(1_000));
    effects.extend(drain(p));
    effects
}

#[test]
fn a_probe_fenced_at_the_bound_while_queued_poisons_nothing() {
    let mut p = probing(2);
    // Queued the whole time (behind a task that holds the interpreter):
    // alive, not silent, so fenced at the bound, not before.
    let effects = fenced_at_the_bound_after(&mut p, &[ControlPhase::Queued]);
    assert_eq!(fences(&effects), vec![TargetId(0)]);
    assert!(!p.is_poisoned(digest(1)) && !p.is_proven(digest(1)));
    assert_eq!(p.poisoned_digests(), vec![]);
    let (e, outcomes) = failure(effects.last());
    assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(outcomes, &vec![(TargetId(0), TargetOutcome::Fenced)]);
    // No evidence: a later register probes again, on the next live target.
    p.register(digest(1), Namespace::LocalPython, Time(1_001))
        .unwrap();
    assert_eq!(drain(&mut p)[1], register_frame(1, 3, 1));
}

#[test]
fn the_last_alive_report_before_the_bound_decides_whether_a_bound_fence_is_evidence() {
    // Queued, then running (the task released the interpreter and the
    // unpickle began): poisoned, with the bound's cause.
    let mut p = probing(2);
    let phases = [ControlPhase::Queued; 15]
        .into_iter()
        .chain([ControlPhase::Running; 2])
        .collect::<Vec<_>>();
    let effects = fenced_at_the_bound_after(&mut p, &phases);
    assert_eq!(fences(&effects), vec![TargetId(0)]);
    assert_eq!(
        p.poisoned_digests(),
        vec![(
            digest(1),
            Poison {
                target: TargetId(0),
                cause: BOUND_FENCE_CAUSE.to_owned()
            }
        )]
    );
    // Running, then a last report saying queued: no evidence.
    let mut p = probing(2);
    let phases = [ControlPhase::Running; 15]
        .into_iter()
        .chain([ControlPhase::Queued; 2])
        .collect::<Vec<_>>();
    let effects = fenced_at_the_bound_after(&mut p, &phases);
    assert_eq!(fences(&effects), vec![TargetId(0)]);
    assert_eq!(p.poisoned_digests(), vec![]);
    // A report about another target's control, or one no operation awaits,
    // marks nothing running.
    let mut p = probing(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_alive(TargetId(1), Seq(1), ControlPhase::Running, Time(60))
        .unwrap();
    for now in [
        60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 660, 720, 780, 840, 900, 960,
    ] {
        p.handle_alive(TargetId(0), Seq(1), ControlPhase::Queued, Time(now))
            .unwrap();
    }
    p.handle_timeout(Time(1_000));
    assert_eq!(fences(&drain(&mut p)), vec![TargetId(0)]);
    assert_eq!(p.poisoned_digests(), vec![]);
}

#[test]
fn a_probe_reported_running_and_then_silent_poisons_nothing() {
    // Running, then no report for a control timeout (stopped mid-unpickle):
    // fenced for silence, which is no evidence whatever the phase.
    let mut p = probing(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_alive(TargetId(0), Seq(1), ControlPhase::Running, Time(50))
        .unwrap();
    assert_eq!(p.poll_timeout(), Some(Time(150)));
    p.handle_timeout(Time(150));
    assert_eq!(fences(&drain(&mut p)), vec![TargetId(0)]);
    assert_eq!(p.poisoned_digests(), vec![]);
    assert!(!p.is_target_live(TargetId(0)));
}

#[test]
fn a_loss_while_an_older_control_is_pending_poisons_nothing() {
    let mut p = Parent::new(ParentConfig {
        targets: 2,
        control_timeout: 100,
        operation_timeout: 1_000,
        fence_on_timeout: true,
        owner: OwnerToken(9),
        slot_capacity: 64,
        probe_first: true,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
    });
    let h = p
        .register_before_start(digest(7), Namespace::LocalPython)
        .unwrap();
    p.start().unwrap();
    // The unregister is sent first: the target may have died on it.
    p.unregister(&h, Time(0)).unwrap();
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.target_lost(TargetId(0), Time(1)).unwrap();
    assert!(!p.is_poisoned(digest(1)));
    let completed: Vec<ErrorCode> = drain(&mut p)
        .into_iter()
        .filter_map(|e| match e {
            Effect::Completed { result: Err(e), .. } => Some(e.code),
            _ => None,
        })
        .collect();
    assert_eq!(completed, vec![ErrorCode::REGISTER_PARTIAL_FAILURE]);
    // Not poisoned: a retry probes again, on the next target.
    p.register(digest(1), Namespace::LocalPython, Time(2))
        .unwrap();
    assert_eq!(drain(&mut p)[1], register_frame(1, 4, 1));
}

#[test]
fn a_refused_probe_fails_the_register_without_reaching_the_others() {
    let mut p = probing(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    let refused = Reply {
        seq: Seq(1),
        digest: digest(1),
        result: Err(Failure::new(ErrorCode::DESERIALIZE_FAILED, "ValueError: x")),
    };
    p.handle_reply(TargetId(0), refused, Time(1)).unwrap();
    let effects = drain(&mut p);
    let (e, outcomes) = failure(effects.last());
    assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(outcomes.len(), 1);
    assert!(!effects.iter().any(|e| matches!(e, Effect::Send { .. })));
    assert!(!p.is_poisoned(digest(1)) && !p.is_proven(digest(1)));
}

#[test]
fn a_loss_while_a_cleanup_is_older_than_the_probe_poisons_nothing() {
    let mut p = Parent::new(ParentConfig {
        targets: 2,
        control_timeout: 100,
        operation_timeout: 1_000,
        fence_on_timeout: true,
        owner: OwnerToken(9),
        slot_capacity: 64,
        probe_first: true,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
    });
    p.register_before_start(digest(2), Namespace::LocalPython)
        .unwrap();
    p.start().unwrap();
    // A proven digest: to both at once; target 1 refuses, so target 0
    // gets the cleanup (seq 2).
    p.register(digest(2), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(1, 2), Time(1)).unwrap();
    let refused = Reply {
        seq: Seq(1),
        digest: digest(2),
        result: Err(Failure::new(ErrorCode::DESERIALIZE_FAILED, "no")),
    };
    p.handle_reply(TargetId(1), refused, Time(1)).unwrap();
    assert!(p.awaits_reply(TargetId(0), Seq(2)));
    // Then a probe (seq 3) to target 0, behind the cleanup.
    p.register(digest(1), Namespace::LocalPython, Time(2))
        .unwrap();
    drain(&mut p);
    p.target_lost(TargetId(0), Time(3)).unwrap();
    assert!(!p.is_poisoned(digest(1)));
    assert!(p.poisoned_digests().is_empty());
}

#[test]
fn a_loss_during_a_second_probe_of_a_digest_proven_meanwhile_poisons_nothing() {
    let mut p = probing(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    // Both probe on target 0; the first confirms (and broadcasts).
    p.handle_reply(TargetId(0), ok(1, 1), Time(1)).unwrap();
    assert!(p.is_proven(digest(1)));
    drain(&mut p);
    p.target_lost(TargetId(0), Time(2)).unwrap();
    assert!(!p.is_poisoned(digest(1)));
}

#[test]
fn a_probe_confirmed_for_a_digest_uncertain_meanwhile_goes_no_further() {
    let mut p = probing(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.doubt(digest(1), TargetId(0), Doubt::Disagrees);
    p.handle_reply(TargetId(0), ok(1, 1), Time(1)).unwrap();
    let effects = drain(&mut p);
    assert!(
        !effects.iter().any(|e| matches!(
            e,
            Effect::Send {
                frame: ControlFrame::Register { .. },
                ..
            }
        )),
        "{effects:?}"
    );
    assert_eq!(
        effects[..2],
        [
            Effect::ReleaseStaged {
                staging: StagingId(1)
            },
            Effect::Send {
                target: TargetId(0),
                frame: ControlFrame::Unregister {
                    seq: Seq(2),
                    digest: digest(1)
                }
            }
        ]
    );
}
