use super::*;
use crate::protocol::Reply;

// The helpers below are shared with the unit tests of the machine's other
// files (tasks, inspections).

pub(super) fn digest(n: u8) -> Digest {
    Digest([n; 32])
}

/// A started parent of `targets` targets, without replacements.
pub(super) fn started(targets: u16) -> Parent {
    let mut p = new_parent(targets);
    p.start().unwrap();
    p
}

pub(super) fn drain(p: &mut Parent) -> Vec<Effect> {
    std::iter::from_fn(|| p.poll_effect()).collect()
}

fn ok(seq: u64, n: u8) -> Reply {
    Reply {
        seq: Seq(seq),
        digest: digest(n),
        result: Ok(()),
    }
}

/// A new parent of `targets` targets (control timeout 100, operation
/// timeout 1,000, fencing on, no probe, no replacements).
pub(super) fn new_parent(targets: u16) -> Parent {
    Parent::new(ParentConfig {
        targets,
        control_timeout: 100,
        operation_timeout: 1_000,
        fence_on_timeout: true,
        owner: OwnerToken(9),
        slot_capacity: 64,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
    })
}

#[test]
fn a_snapshot_entry_failed_somewhere_is_unregistered_where_it_was_installed() {
    let mut p = new_parent(3);
    let first = p
        .register_before_start(digest(1), Namespace::LocalPython)
        .unwrap();
    let second = p
        .register_before_start(digest(1), Namespace::LocalPython)
        .unwrap();
    let kept = p
        .register_before_start(digest(2), Namespace::LocalPython)
        .unwrap();
    p.start().unwrap();
    let failure = Failure::new(ErrorCode::DESERIALIZE_FAILED, "UnpicklingError: bad");
    let failed = p
        .snapshot_failed(&[(TargetId(1), digest(1), failure.clone())], Time(5))
        .unwrap();
    assert_eq!(
        failed,
        vec![
            FailedRegistration {
                handle: first,
                failures: vec![(TargetId(1), failure.clone())],
            },
            FailedRegistration {
                handle: second,
                failures: vec![(TargetId(1), failure)],
            },
        ]
    );
    assert!(!p.is_live(digest(1), Namespace::LocalPython));
    assert_eq!(p.live_handles(), vec![kept]);
    let unregister = |seq, target| Effect::Send {
        target: TargetId(target),
        frame: ControlFrame::Unregister {
            seq: Seq(seq),
            digest: digest(1),
        },
    };
    // One unregister per handle, to the targets that installed it.
    assert_eq!(
        drain(&mut p),
        vec![
            unregister(1, 0),
            unregister(1, 2),
            unregister(2, 0),
            unregister(2, 2)
        ]
    );
    for seq in [1, 2] {
        for target in [0, 2] {
            p.handle_reply(TargetId(target), ok(seq, 1), Time(6))
                .unwrap();
        }
    }
    let completed: Vec<_> = drain(&mut p)
        .into_iter()
        .map(|e| match e {
            Effect::Completed { op, result, .. } => (op, result),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        completed,
        vec![
            (OpId(1), Ok(Completion::Unregistered(first))),
            (OpId(2), Ok(Completion::Unregistered(second)))
        ]
    );
    assert!(p.is_idle());
    assert_eq!(
        p.resolve(&first, Namespace::LocalPython).unwrap_err().code,
        ErrorCode::HANDLE_STALE
    );
}

#[test]
fn snapshot_failures_are_settled_once_before_any_operation() {
    let mut p = new_parent(2);
    p.register_before_start(digest(1), Namespace::LocalPython)
        .unwrap();
    let failure = Failure::new(ErrorCode::DESERIALIZE_FAILED, "x");
    let before = p.snapshot_failed(&[(TargetId(0), digest(1), failure.clone())], Time(0));
    assert_eq!(before.unwrap_err().code, ErrorCode::LIFECYCLE_INVALID);
    p.start().unwrap();
    let unknown = p.snapshot_failed(&[(TargetId(0), digest(7), failure.clone())], Time(0));
    assert_eq!(unknown.unwrap_err().code, ErrorCode::FRAME_INVALID);
    let out_of_range = p.snapshot_failed(&[(TargetId(5), digest(1), failure.clone())], Time(0));
    assert_eq!(out_of_range.unwrap_err().code, ErrorCode::FRAME_INVALID);
    assert!(drain(&mut p).is_empty());
    // Failed everywhere: nothing to unregister, the operation is done.
    let all = [
        (TargetId(0), digest(1), failure.clone()),
        (TargetId(1), digest(1), failure.clone()),
    ];
    assert_eq!(p.snapshot_failed(&all, Time(0)).unwrap().len(), 1);
    assert!(matches!(
        drain(&mut p).as_slice(),
        [Effect::Completed { op: OpId(1), result: Ok(Completion::Unregistered(_)), outcomes }] if outcomes.is_empty()
    ));
    let again = p.snapshot_failed(&all, Time(0));
    assert_eq!(again.unwrap_err().code, ErrorCode::LIFECYCLE_INVALID);
}

#[test]
fn the_startup_snapshot_holds_at_most_slot_capacity_digests() {
    let mut p = Parent::new(ParentConfig {
        targets: 1,
        control_timeout: 100,
        operation_timeout: 1_000,
        fence_on_timeout: true,
        owner: OwnerToken(9),
        slot_capacity: 2,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
    });
    p.register_before_start(digest(1), Namespace::LocalPython)
        .unwrap();
    p.register_before_start(digest(2), Namespace::LocalPython)
        .unwrap();
    // A digest already in the snapshot takes no new slot.
    p.register_before_start(digest(1), Namespace::LocalPython)
        .unwrap();
    let err = p
        .register_before_start(digest(3), Namespace::LocalPython)
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::LOCAL_SLOT_EXHAUSTED);
    assert_eq!(err.hashid, Some(digest(3).hashid()));
    assert_eq!(p.startup_snapshot(), vec![(digest(1), 2), (digest(2), 1)]);
}

#[test]
fn a_digest_is_live_from_publication_until_its_last_handle_goes() {
    let mut p = started(1);
    assert!(!p.is_live(digest(1), Namespace::LocalPython));
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    assert!(!p.is_live(digest(1), Namespace::LocalPython), "in flight");
    p.handle_reply(TargetId(0), ok(op.0, 1), Time(1)).unwrap();
    assert!(p.is_live(digest(1), Namespace::LocalPython));
    assert!(!p.is_live(digest(1), Namespace::LocalChip));
    assert!(!p.is_live(digest(2), Namespace::LocalPython));
    let handle = p.live_handles()[0];
    p.unregister(&handle, Time(2)).unwrap();
    assert!(!p.is_live(digest(1), Namespace::LocalPython));
}

#[test]
fn register_in_another_namespace_is_unsupported_and_emits_nothing() {
    let mut p = started(1);
    let e = p
        .register(digest(1), Namespace::LocalChip, Time(0))
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::CALLABLE_KIND_UNSUPPORTED);
    assert_eq!(e.namespace, Some(Namespace::LocalChip));
    assert_eq!(drain(&mut p), vec![]);
}

fn probing(targets: u16) -> Parent {
    let mut p = Parent::new(ParentConfig {
        targets,
        control_timeout: 100,
        operation_timeout: 1_000,
        fence_on_timeout: true,
        owner: OwnerToken(9),
        slot_capacity: 64,
        probe_first: true,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
    });
    p.start().unwrap();
    p
}

/// The targets `effects` send a frame to, in order.
fn sent_to(effects: Vec<Effect>) -> Vec<TargetId> {
    effects
        .into_iter()
        .filter_map(|e| match e {
            Effect::Send { target, .. } => Some(target),
            _ => None,
        })
        .collect()
}

fn register_frame(target: u16, seq: u64, n: u8) -> Effect {
    Effect::Send {
        target: TargetId(target),
        frame: ControlFrame::Register {
            seq: Seq(seq),
            digest: digest(n),
            staging: StagingId(seq),
        },
    }
}

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
            register_frame(0, 1, 1)
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
    assert_eq!(drain(&mut p).len(), 4, "stage and three frames");
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
    let Effect::Completed {
        result: Err(e),
        outcomes,
        ..
    } = &effects[1]
    else {
        panic!("{effects:?}")
    };
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
    let Some(Effect::Completed {
        result: Err(e),
        outcomes,
        ..
    }) = effects.last()
    else {
        panic!("{effects:?}")
    };
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
    let Some(Effect::Completed {
        result: Err(e),
        outcomes,
        ..
    }) = effects.last()
    else {
        panic!("{effects:?}")
    };
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
            target: TargetId(0)
        }
    );
    assert!(!p.is_poisoned(digest(1)));
    let Some(Effect::Completed {
        result: Err(e),
        outcomes,
        ..
    }) = effects.last()
    else {
        panic!("{effects:?}")
    };
    assert_eq!(e.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(outcomes, &vec![(TargetId(0), TargetOutcome::Fenced)]);
    // A retry probes again, on the next live target.
    p.register(digest(1), Namespace::LocalPython, Time(101))
        .unwrap();
    assert_eq!(sent_to(drain(&mut p)), vec![TargetId(1)]);
}

#[test]
fn one_digest_has_one_metadata_while_it_is_held() {
    let ns = Namespace::LocalPython;
    let mut p = Parent::new(ParentConfig {
        probe_first: false,
        ..probing(2).config
    });
    let first = p
        .register_before_start_with_metadata(digest(1), ns, Some(digest(8)))
        .unwrap();
    // The same metadata: a second handle.
    p.register_before_start_with_metadata(digest(1), ns, Some(digest(8)))
        .unwrap();
    for other in [Some(digest(9)), None] {
        let e = p
            .register_before_start_with_metadata(digest(1), ns, other)
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::METADATA_CONFLICT);
        assert!(e.message.contains(&format!(
            "is registered with metadata {}",
            crate::descriptor::HashId(digest(8))
        )));
    }
    p.start().unwrap();
    drain(&mut p);
    // After start, and with nothing emitted for a conflict.
    let e = p
        .register_with_metadata(digest(1), ns, None, Time(0))
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::METADATA_CONFLICT);
    assert!(e.message.ends_with(
        "a register of it with no metadata is refused (one callable has one metadata while it is registered: unregister it first)"
    ));
    assert!(drain(&mut p).is_empty());
    // A register in flight holds its metadata too.
    p.register_with_metadata(digest(2), ns, None, Time(0))
        .unwrap();
    let e = p
        .register_with_metadata(digest(2), ns, Some(digest(8)), Time(0))
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::METADATA_CONFLICT);
    // Once no longer held, a digest may come back with other metadata.
    let _ = first;
    let handles: Vec<Handle> = p
        .live_handles()
        .into_iter()
        .filter(|h| h.digest() == digest(1))
        .collect();
    for h in &handles {
        p.unregister(h, Time(1)).unwrap();
    }
    for (target, frame) in drain(&mut p).into_iter().filter_map(|e| match e {
        Effect::Send { target, frame } => Some((target, frame)),
        _ => None,
    }) {
        let (seq, d) = match frame {
            ControlFrame::Register { seq, digest, .. }
            | ControlFrame::Unregister { seq, digest } => (seq, digest),
            _ => continue,
        };
        p.handle_reply(
            target,
            Reply {
                seq,
                digest: d,
                result: Ok(()),
            },
            Time(2),
        )
        .unwrap();
    }
    assert!(!p.is_live(digest(1), ns));
    // Not held although another digest's register is in flight
    // (digest 4): it comes back with other metadata.
    p.register_with_metadata(digest(4), ns, None, Time(3))
        .unwrap();
    p.register_with_metadata(digest(1), ns, Some(digest(9)), Time(3))
        .unwrap();
    // A first register after start records its metadata: the same
    // again is a second register, other metadata a conflict.
    p.register_with_metadata(digest(3), ns, Some(digest(7)), Time(4))
        .unwrap();
    p.register_with_metadata(digest(3), ns, Some(digest(7)), Time(4))
        .unwrap();
    let e = p
        .register_with_metadata(digest(3), ns, Some(digest(6)), Time(4))
        .unwrap_err();
    assert!(e.message.contains(&format!(
        "is registered with metadata {}",
        crate::descriptor::HashId(digest(7))
    )));
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
        p.handle_alive(TargetId(0), Seq(1), Time(now)).unwrap();
        p.handle_timeout(Time(now));
    }
    let effects = drain(&mut p);
    assert!(effects.contains(&Effect::Fence {
        target: TargetId(0)
    }));
    assert!(p.is_poisoned(digest(1)));
    let poison = &p.poisoned_digests()[0].1;
    assert_eq!(poison.target, TargetId(0));
    assert_eq!(poison.cause, BOUND_FENCE_CAUSE);
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
    let Some(Effect::Completed {
        result: Err(e),
        outcomes,
        ..
    }) = effects.last()
    else {
        panic!("{effects:?}")
    };
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

#[test]
fn snapshot_digests_need_no_probe() {
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
    });
    p.register_before_start(digest(1), Namespace::LocalPython)
        .unwrap();
    p.start().unwrap();
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    assert_eq!(drain(&mut p).len(), 3, "stage and two frames");
}

#[test]
fn register_with_every_target_lost_has_no_live_target() {
    let mut p = started(1);
    p.target_lost(TargetId(0), Time(0)).unwrap();
    let e = p
        .register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::NO_LIVE_TARGET);
    assert_eq!(e.message, "every target is lost");
    assert_eq!(drain(&mut p), vec![]);
    assert_eq!(p.next_seq, 1, "no seq consumed");
}

#[test]
fn register_while_every_target_is_being_replaced_says_so() {
    let mut config = new_parent(1).config;
    config.respawn_limit = 1;
    let mut p = Parent::new(config);
    p.start().unwrap();
    p.target_lost(TargetId(0), Time(0)).unwrap();
    assert_eq!(p.target_phase(TargetId(0)), TargetPhase::Spawning);
    let e = p
        .register(digest(1), Namespace::LocalPython, Time(1))
        .unwrap_err();
    assert_eq!(
        (e.code, e.message.as_str()),
        (
            ErrorCode::NO_LIVE_TARGET,
            "no target serves: every target is lost or a replacement that has not joined yet"
        )
    );
    // Nothing to replay: the replacement joins at once, and serves.
    p.target_spawned(TargetId(0), 1, Time(1)).unwrap();
    assert_eq!(p.target_phase(TargetId(0)), TargetPhase::Joined);
    assert!(p
        .register(digest(1), Namespace::LocalPython, Time(2))
        .is_ok());
}

fn fences(effects: &[Effect]) -> Vec<TargetId> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Fence { target } => Some(*target),
            _ => None,
        })
        .collect()
}

#[test]
fn an_alive_report_moves_the_silence_deadline_but_never_the_bound() {
    let mut p = started(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    assert_eq!(p.poll_timeout(), Some(Time(100)));
    assert_eq!(p.poll_bound(), Some(Time(1_000)));
    p.handle_alive(TargetId(0), Seq(1), Time(80)).unwrap();
    // Target 1 is still only heard from at the send.
    assert_eq!(p.poll_timeout(), Some(Time(100)));
    p.handle_alive(TargetId(1), Seq(1), Time(90)).unwrap();
    assert_eq!(p.poll_timeout(), Some(Time(180)));
    // Both keep reporting: nothing expires before the bound.
    for now in (90..=990).step_by(90) {
        p.handle_alive(TargetId(0), Seq(1), Time(now)).unwrap();
        p.handle_alive(TargetId(1), Seq(1), Time(now)).unwrap();
        p.handle_timeout(Time(now));
        assert_eq!(fences(&drain(&mut p)), Vec::<TargetId>::new(), "at {now}");
    }
    assert_eq!(p.poll_timeout(), Some(Time(1_000)));
    p.handle_timeout(Time(999));
    assert_eq!(fences(&drain(&mut p)), Vec::<TargetId>::new());
    p.handle_timeout(Time(1_000));
    assert_eq!(fences(&drain(&mut p)), vec![TargetId(0), TargetId(1)]);
    assert_eq!(p.poll_timeout(), None);
}

#[test]
fn only_the_silent_target_is_fenced_at_its_silence_deadline() {
    let mut p = started(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_alive(TargetId(0), Seq(1), Time(60)).unwrap();
    p.handle_timeout(Time(100));
    assert_eq!(fences(&drain(&mut p)), vec![TargetId(1)]);
    assert!(p.is_target_live(TargetId(0)));
    assert!(!p.is_target_live(TargetId(1)));
    assert_eq!(p.poll_timeout(), Some(Time(160)));
    // The heard target answers; the register fails (one target was
    // fenced) and rolls it back under a fresh deadline.
    p.handle_reply(TargetId(0), ok(1, 1), Time(120)).unwrap();
    let effects = drain(&mut p);
    assert!(effects.contains(&Effect::Send {
        target: TargetId(0),
        frame: ControlFrame::Unregister {
            seq: Seq(2),
            digest: digest(1)
        }
    }));
    assert_eq!(p.poll_timeout(), Some(Time(220)));
    assert_eq!(p.poll_bound(), Some(Time(1_120)));
    // The cleanup is kept alive the same way.
    p.handle_alive(TargetId(0), Seq(2), Time(200)).unwrap();
    assert_eq!(p.poll_timeout(), Some(Time(300)));
    assert!(p.uncertain_digests().is_empty());
}

#[test]
fn without_fencing_a_silent_target_times_out_alone() {
    let mut p = Parent::new(ParentConfig {
        targets: 2,
        control_timeout: 100,
        operation_timeout: 1_000,
        fence_on_timeout: false,
        owner: OwnerToken(7),
        slot_capacity: 4,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
    });
    p.start().unwrap();
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_alive(TargetId(0), Seq(1), Time(50)).unwrap();
    p.handle_timeout(Time(100));
    assert_eq!(fences(&drain(&mut p)), Vec::<TargetId>::new());
    assert!(p.is_uncertain(digest(1)));
    // Target 0 is still awaited, under its own deadline.
    assert!(p.awaits_reply(TargetId(0), Seq(1)));
    assert!(!p.awaits_reply(TargetId(1), Seq(1)));
    assert_eq!(p.poll_timeout(), Some(Time(150)));
}

#[test]
fn an_alive_report_for_a_control_not_awaited_changes_nothing() {
    let mut p = started(2);
    assert_eq!(
        p.handle_alive(TargetId(0), Seq(1), Time(0))
            .unwrap_err()
            .code,
        ErrorCode::FRAME_INVALID
    );
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(1, 1), Time(10)).unwrap();
    let before = p.clone();
    // It raced the reply: no deadline moves, nothing turns uncertain.
    p.handle_alive(TargetId(0), Seq(1), Time(90)).unwrap();
    assert_eq!(p, before);
    assert_eq!(p.poll_timeout(), Some(Time(100)));
    assert!(p.uncertain_digests().is_empty());
    assert_eq!(
        p.handle_alive(TargetId(1), Seq(2), Time(20))
            .unwrap_err()
            .code,
        ErrorCode::FRAME_INVALID
    );
    assert_eq!(
        p.handle_alive(TargetId(2), Seq(1), Time(20))
            .unwrap_err()
            .code,
        ErrorCode::FRAME_INVALID
    );
    let mut unstarted = new_parent(1);
    assert_eq!(
        unstarted
            .handle_alive(TargetId(0), Seq(1), Time(0))
            .unwrap_err()
            .code,
        ErrorCode::LIFECYCLE_INVALID
    );
}

#[test]
fn several_operations_fly_at_once_each_with_its_own_seq() {
    let mut p = started(1);
    assert_eq!(
        p.register(digest(1), Namespace::LocalPython, Time(0)),
        Ok(OpId(1))
    );
    assert_eq!(
        p.register(digest(2), Namespace::LocalPython, Time(5)),
        Ok(OpId(2))
    );
    assert_eq!(p.in_flight(), vec![OpId(1), OpId(2)]);
    assert_eq!(p.poll_timeout(), Some(Time(100)));
    drain(&mut p);
    // Answers may come for the later one first.
    p.handle_reply(TargetId(0), ok(2, 2), Time(6)).unwrap();
    p.handle_reply(TargetId(0), ok(1, 1), Time(7)).unwrap();
    let handles: Vec<u64> = drain(&mut p)
        .into_iter()
        .filter_map(|e| match e {
            Effect::Completed {
                result: Ok(Completion::Registered(h)),
                ..
            } => Some(h.handle_id),
            _ => None,
        })
        .collect();
    assert_eq!(handles, vec![1, 2]);
    assert_eq!(p.poll_timeout(), None);
}

#[test]
fn a_digest_that_becomes_uncertain_in_flight_is_not_published() {
    let mut p = started(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    p.doubt(digest(1), TargetId(0), Doubt::Disagrees);
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(1, 1), Time(1)).unwrap();
    p.handle_reply(TargetId(1), ok(1, 1), Time(2)).unwrap();
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
            Effect::Send {
                target: TargetId(0),
                frame: cleanup.clone()
            },
            Effect::Send {
                target: TargetId(1),
                frame: cleanup
            },
        ]
    );
    p.handle_reply(TargetId(0), ok(2, 1), Time(3)).unwrap();
    p.handle_reply(TargetId(1), ok(2, 1), Time(4)).unwrap();
    let [Effect::Completed { result: Err(e), .. }] =
        <[Effect; 1]>::try_from(drain(&mut p)).unwrap()
    else {
        panic!("no completion")
    };
    assert_eq!(e.code, ErrorCode::REGISTER_CLEANUP_UNCERTAIN);
    assert!(p.live_handles().is_empty());
}

#[test]
fn a_reply_naming_another_digest_fails_the_target_and_marks_uncertain() {
    let mut p = started(1);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(1, 2), Time(1)).unwrap();
    assert!(p.is_uncertain(digest(1)));
    let effects = drain(&mut p);
    let Some(Effect::Completed { outcomes, .. }) = effects.last() else {
        panic!("{effects:?}")
    };
    let TargetOutcome::Failed { failure } = &outcomes[0].1 else {
        panic!("{outcomes:?}")
    };
    assert_eq!(failure.code, ErrorCode::FRAME_INVALID);
}

#[test]
fn stage_failure_withdraws_the_frames_and_completes_with_its_error() {
    let mut p = started(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    assert_eq!(
        p.poll_effect(),
        Some(Effect::Stage {
            staging: StagingId(1),
            digest: digest(1)
        })
    );
    p.stage_failed(
        StagingId(1),
        Failure::new(ErrorCode::IO_FAILED, "shm_open: ENOSPC"),
    )
    .unwrap();
    let [Effect::Completed {
        op,
        result: Err(e),
        outcomes,
    }] = <[Effect; 1]>::try_from(drain(&mut p)).unwrap()
    else {
        panic!("no completion")
    };
    assert_eq!(
        (op, e.code, e.operation, outcomes),
        (OpId(1), ErrorCode::IO_FAILED, OperationKind::Stage, vec![])
    );
    assert!(p.staged().is_empty() && p.in_flight().is_empty());
    let again = p.stage_failed(StagingId(1), Failure::new(ErrorCode::IO_FAILED, "x"));
    assert_eq!(again.unwrap_err().code, ErrorCode::FRAME_INVALID);
}

#[test]
fn stage_failure_after_frames_were_polled_is_refused() {
    let mut p = started(1);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    let e = p.stage_failed(StagingId(1), Failure::new(ErrorCode::IO_FAILED, "late"));
    assert_eq!(e.unwrap_err().code, ErrorCode::FRAME_INVALID);
    assert_eq!(p.in_flight(), vec![OpId(1)]);
}

#[test]
fn close_completes_every_operation_and_releases_staging() {
    let mut p = started(1);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.close().unwrap();
    let effects = drain(&mut p);
    assert_eq!(
        effects[0],
        Effect::ReleaseStaged {
            staging: StagingId(1)
        }
    );
    let Effect::Completed {
        result: Err(e),
        outcomes,
        ..
    } = &effects[1]
    else {
        panic!("{effects:?}")
    };
    assert_eq!(e.code, ErrorCode::LIFECYCLE_INVALID);
    assert_eq!(outcomes, &vec![(TargetId(0), TargetOutcome::Lost)]);
    assert_eq!(p.lifecycle(), Lifecycle::Closed);
    assert_eq!(p.poll_timeout(), None);
}

#[test]
fn unregister_with_no_live_target_in_scope_completes_at_once() {
    let mut p = Parent::new(ParentConfig {
        targets: 1,
        control_timeout: 100,
        operation_timeout: 1_000,
        fence_on_timeout: true,
        owner: OwnerToken(9),
        slot_capacity: 64,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
    });
    let h = p
        .register_before_start(digest(1), Namespace::LocalPython)
        .unwrap();
    p.start().unwrap();
    p.target_lost(TargetId(0), Time(0)).unwrap();
    assert_eq!(p.unregister(&h, Time(1)), Ok(OpId(1)));
    assert_eq!(
        drain(&mut p),
        vec![Effect::Completed {
            op: OpId(1),
            result: Ok(Completion::Unregistered(h)),
            outcomes: vec![]
        }]
    );
}

#[test]
fn submit_checks_the_target() {
    let mut p = Parent::new(ParentConfig {
        targets: 2,
        control_timeout: 100,
        operation_timeout: 1_000,
        fence_on_timeout: true,
        owner: OwnerToken(9),
        slot_capacity: 64,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
    });
    let h = p
        .register_before_start(digest(1), Namespace::LocalPython)
        .unwrap();
    p.start().unwrap();
    assert_eq!(
        p.submit(&h, TargetId(2)).unwrap_err().code,
        ErrorCode::NO_LIVE_TARGET
    );
    p.target_lost(TargetId(1), Time(0)).unwrap();
    let e = p.submit(&h, TargetId(1)).unwrap_err();
    assert_eq!(
        (e.code, e.target),
        (ErrorCode::TARGET_LOST, Some(TargetId(1)))
    );
    assert_eq!(p.submit(&h, TargetId(0)), Ok(Seq(1)));
    assert_eq!(
        drain(&mut p),
        vec![Effect::Send {
            target: TargetId(0),
            frame: ControlFrame::Task {
                seq: Seq(1),
                digest: digest(1)
            }
        }]
    );
}

#[test]
fn replies_before_start_and_for_unknown_targets_are_refused() {
    let mut p = Parent::new(ParentConfig {
        targets: 1,
        control_timeout: 100,
        operation_timeout: 1_000,
        fence_on_timeout: true,
        owner: OwnerToken(9),
        slot_capacity: 64,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
    });
    assert_eq!(
        p.handle_reply(TargetId(0), ok(1, 1), Time(0))
            .unwrap_err()
            .code,
        ErrorCode::LIFECYCLE_INVALID
    );
    p.start().unwrap();
    assert_eq!(
        p.handle_reply(TargetId(5), ok(1, 1), Time(0))
            .unwrap_err()
            .code,
        ErrorCode::FRAME_INVALID
    );
    assert_eq!(
        p.target_lost(TargetId(5), Time(0)).unwrap_err().code,
        ErrorCode::FRAME_INVALID
    );
}

#[test]
fn every_hook_a_register_names_must_be_live_in_local_python() {
    use crate::descriptor::HashId;
    use crate::metadata::{CallableMetadata, HookCall};
    let hook = |n: u8| HookCall {
        hashid: HashId(digest(n)),
        args: Vec::new(),
        kwargs: serde_json::Map::new(),
        retval_keyword: None,
    };
    let mut p = new_parent(1);
    let ns = Namespace::LocalPython;
    p.register_before_start(digest(1), ns).unwrap();
    let mut metadata = CallableMetadata::named("task");
    metadata.call_before = vec![hook(1)];
    assert_eq!(p.check_hooks(digest(5), &metadata), Ok(()));
    metadata.call_after = vec![hook(1), hook(2)];
    let e = p.check_hooks(digest(5), &metadata).unwrap_err();
    assert_eq!(
        (e.code, e.message),
        (
            ErrorCode::METADATA_INVALID,
            format!(
                "call_after[1] names {}, which has no live registration in LOCAL_PYTHON (register it first)",
                HashId(digest(2))
            )
        )
    );
    assert_eq!(e.hashid, Some(HashId(digest(5))));
}

#[test]
fn a_replacement_not_ready_within_the_control_timeout_is_fenced_and_counts_as_a_failed_join() {
    let mut p = Parent::new(ParentConfig {
        respawn_limit: 2,
        respawn_backoff: 10,
        unbounded_spawn: false,
        ..new_parent(1).config
    });
    p.start().unwrap();
    p.target_died(TargetId(0), "killed", Time(5)).unwrap();
    assert_eq!(
        drain(&mut p),
        vec![Effect::Spawn {
            target: TargetId(0),
            incarnation: 1
        }]
    );
    // control_timeout is 100: ready by 105.
    assert_eq!(p.poll_timeout(), Some(Time(105)));
    // After close no replacement's deadline is awaited.
    let mut closed = p.clone();
    closed.close().unwrap();
    assert_eq!(closed.poll_timeout(), None);
    p.handle_timeout(Time(104));
    assert!(drain(&mut p).is_empty());
    p.handle_timeout(Time(105));
    assert_eq!(
        drain(&mut p),
        vec![Effect::Fence {
            target: TargetId(0)
        }]
    );
    assert_eq!(
        p.target_phase(TargetId(0)),
        TargetPhase::BackingOff(Time(115))
    );
    assert_eq!(p.failed_joins(TargetId(0)), 1);
    assert_eq!(p.poll_timeout(), Some(Time(115)));
    let mut closed = p.clone();
    closed.close().unwrap();
    assert_eq!(closed.poll_timeout(), None);
    // The late report of the fenced incarnation is refused.
    assert_eq!(
        p.target_spawned(TargetId(0), 1, Time(106))
            .unwrap_err()
            .code,
        ErrorCode::FRAME_INVALID
    );
    p.handle_timeout(Time(115));
    assert_eq!(
        drain(&mut p),
        vec![Effect::Spawn {
            target: TargetId(0),
            incarnation: 2
        }]
    );
    p.handle_timeout(Time(215));
    assert_eq!(
        drain(&mut p),
        vec![
            Effect::Fence {
                target: TargetId(0)
            },
            Effect::Abandoned {
                target: TargetId(0),
                failed_joins: 2
            }
        ]
    );
    assert_eq!(p.target_phase(TargetId(0)), TargetPhase::Lost);
    assert_eq!(p.poll_timeout(), None);
}
