//! Unit tests of the parent machine. Operations in flight: several at once, uncertainty reached in flight,
//! staging failures, close, no live target, submit and reply checks.

use super::*;

#[test]
fn register_with_every_target_lost_has_no_live_target() {
    let mut p = started(1);
    p.target_lost(TargetId(0), Time(0)).unwrap();
    let e = p
        .register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::NO_LIVE_TARGET);
    assert_eq!(
        e.message,
        "every target is lost, and none is being replaced"
    );
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
fn stage_failure_of_a_probe_withdraws_its_verify_hints_too() {
    let mut p = probing(3);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    assert!(matches!(p.poll_effect(), Some(Effect::Stage { .. })));
    p.stage_failed(StagingId(1), Failure::new(ErrorCode::IO_FAILED, "ENOSPC"))
        .unwrap();
    let effects = drain(&mut p);
    assert!(
        matches!(effects.as_slice(), [Effect::Completed { result: Err(e), .. }] if e.code == ErrorCode::IO_FAILED),
        "{effects:?}"
    );
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
    let (e, outcomes) = failure(effects.get(1));
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
        max_tasks_per_target: 0,
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
        max_tasks_per_target: 0,
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
        max_tasks_per_target: 0,
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
