//! Replacement targets (`specs/protocol.md` §2.9) on a bare [`Parent`]:
//! the spawn, the replay of every live registration, the join, what
//! operations in flight do meanwhile, and the rate limit. Every effect is
//! asserted exactly.

mod common;

use callreg::error::{Error, ErrorCode, OperationKind};
use callreg::protocol::{
    Completion, ControlFrame, Effect, Failure, Namespace, Parent, ParentConfig, Reply, Seq,
    StagingId, TargetId, TargetOutcome, TargetPhase, Time,
};
use common::sim::{digest, drain, ok, parent_config, registered, send};

const BACKOFF: u64 = 500;

fn started(targets: u16, fence_on_timeout: bool, respawn_limit: u16) -> Parent {
    let mut p = Parent::new(ParentConfig {
        respawn_limit,
        respawn_backoff: BACKOFF,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
        ..parent_config(targets, fence_on_timeout)
    });
    p.start().unwrap();
    p
}

/// Target `t` is lost at `lost` and its first replacement spawned at
/// `spawned`; the effects of both are drained (the replays are sent).
fn respawned(p: &mut Parent, t: u16, lost: u64, spawned: u64) {
    p.target_lost(TargetId(t), Time(lost)).unwrap();
    drain(p);
    p.target_spawned(TargetId(t), 1, Time(spawned)).unwrap();
    drain(p);
}

fn register_frame(seq: u64, n: u8) -> ControlFrame {
    ControlFrame::Register {
        seq: Seq(seq),
        digest: digest(n),
        staging: StagingId(seq),
    }
}

#[test]
fn a_lost_target_is_replaced_replayed_and_joins() {
    let mut p = started(2, true, 3);
    let h = registered(&mut p, 1, &[0, 1], 0);
    p.target_lost(TargetId(1), Time(10)).unwrap();
    assert_eq!(
        drain(&mut p),
        [Effect::Spawn {
            target: TargetId(1),
            incarnation: 1
        }]
    );
    assert_eq!(p.target_phase(TargetId(1)), TargetPhase::Spawning);
    assert!(!p.is_target_live(TargetId(1)));
    assert!(!p.is_idle(), "a replacement is being asked for");

    p.target_spawned(TargetId(1), 1, Time(20)).unwrap();
    assert_eq!(
        drain(&mut p),
        [
            Effect::Restage {
                staging: StagingId(2),
                digest: digest(1)
            },
            send(1, register_frame(2, 1)),
        ]
    );
    assert_eq!(p.target_phase(TargetId(1)), TargetPhase::Joining);
    assert!(p.is_target_live(TargetId(1)) && !p.is_target_joined(TargetId(1)));
    let refused = p.submit(&h, TargetId(1)).unwrap_err();
    assert_eq!(refused.code, ErrorCode::TARGET_LOST);
    assert_eq!(
        refused.message,
        "target 1 is a replacement (incarnation 1) that has not joined yet"
    );

    p.handle_reply(TargetId(1), ok(2, 1), Time(30)).unwrap();
    assert_eq!(
        drain(&mut p),
        [
            Effect::ReleaseStaged {
                staging: StagingId(2)
            },
            Effect::Joined {
                target: TargetId(1),
                incarnation: 1
            },
        ]
    );
    assert_eq!(p.target_phase(TargetId(1)), TargetPhase::Joined);
    assert_eq!(
        (p.incarnation(TargetId(1)), p.failed_joins(TargetId(1))),
        (1, 0)
    );
    assert_eq!(p.submit(&h, TargetId(1)), Ok(Seq(3)));
    assert_eq!(
        drain(&mut p),
        [send(
            1,
            ControlFrame::Task {
                seq: Seq(3),
                digest: digest(1)
            }
        )]
    );
    // The task is in flight until its result comes.
    assert!(!p.is_idle() && p.in_flight().is_empty());
    assert_eq!(
        p.handle_task_result(TargetId(1), 1, Seq(3), digest(1), Time(0)),
        Ok(true)
    );
    drain(&mut p);
    assert!(p.is_idle());
}

#[test]
fn a_replacement_with_nothing_to_replay_joins_at_once() {
    let mut p = started(1, true, 3);
    p.target_lost(TargetId(0), Time(0)).unwrap();
    drain(&mut p);
    p.target_spawned(TargetId(0), 1, Time(1)).unwrap();
    assert_eq!(
        drain(&mut p),
        [Effect::Joined {
            target: TargetId(0),
            incarnation: 1
        }]
    );
}

#[test]
fn a_register_in_flight_skips_the_joining_target_and_is_replayed_to_it_when_published() {
    let mut p = started(2, true, 3);
    p.target_lost(TargetId(1), Time(0)).unwrap();
    drain(&mut p);
    // In flight before the spawn: its scope is target 0 alone.
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(1))
        .unwrap();
    assert_eq!(
        drain(&mut p),
        [
            Effect::Stage {
                staging: StagingId(1),
                digest: digest(1)
            },
            send(0, register_frame(1, 1)),
        ]
    );
    p.target_spawned(TargetId(1), 1, Time(2)).unwrap();
    // Nothing live to replay, but a register is in flight: no join yet.
    assert_eq!(drain(&mut p), []);
    assert_eq!(p.target_phase(TargetId(1)), TargetPhase::Joining);
    // A register issued while it joins does not include it either.
    let op2 = p
        .register(digest(2), Namespace::LocalPython, Time(3))
        .unwrap();
    assert_eq!(drain(&mut p)[1..], [send(0, register_frame(2, 2))]);

    p.handle_reply(TargetId(0), ok(op.0, 1), Time(4)).unwrap();
    let effects = drain(&mut p);
    let Effect::Completed {
        result: Ok(Completion::Registered(h1)),
        outcomes,
        ..
    } = &effects[1]
    else {
        panic!("{effects:?}")
    };
    assert_eq!(outcomes, &[(TargetId(0), TargetOutcome::Ok)]);
    assert_eq!(
        effects[2..],
        [
            Effect::Restage {
                staging: StagingId(3),
                digest: digest(1)
            },
            send(1, register_frame(3, 1)),
        ]
    );
    p.handle_reply(TargetId(1), ok(3, 1), Time(5)).unwrap();
    assert_eq!(
        drain(&mut p),
        [Effect::ReleaseStaged {
            staging: StagingId(3)
        }],
        "the second register is still in flight"
    );

    p.handle_reply(TargetId(0), ok(op2.0, 2), Time(6)).unwrap();
    let effects = drain(&mut p);
    assert!(matches!(
        effects[1],
        Effect::Completed {
            op,
            result: Ok(Completion::Registered(_)),
            ..
        } if op == op2
    ));
    assert_eq!(
        effects[2..],
        [
            Effect::Restage {
                staging: StagingId(4),
                digest: digest(2)
            },
            send(1, register_frame(4, 2)),
        ]
    );
    p.handle_reply(TargetId(1), ok(4, 2), Time(7)).unwrap();
    assert_eq!(
        drain(&mut p),
        [
            Effect::ReleaseStaged {
                staging: StagingId(4)
            },
            Effect::Joined {
                target: TargetId(1),
                incarnation: 1
            },
        ]
    );
    assert_eq!(p.submit(h1, TargetId(1)), Ok(Seq(5)));
}

#[test]
fn an_unregister_waits_for_the_replay_of_its_handle_to_a_replacement() {
    let mut p = started(2, true, 3);
    let h = registered(&mut p, 1, &[0, 1], 0);
    respawned(&mut p, 1, 1, 2);
    let op = p.unregister(&h, Time(3)).unwrap();
    let frame = ControlFrame::Unregister {
        seq: Seq(3),
        digest: digest(1),
    };
    // The replacement is in the scope, but its frame waits for the
    // replay's confirmation: until then the replacement may still be
    // deserializing the payload, and would refuse the unregister
    // (DIGEST_NOT_INSTALLED, and the digest would become uncertain).
    assert_eq!(drain(&mut p), [send(0, frame.clone())]);
    assert!(p.awaits_reply(TargetId(1), Seq(3)));
    p.handle_reply(TargetId(0), ok(3, 1), Time(4)).unwrap();
    assert_eq!(drain(&mut p), []);
    p.handle_reply(TargetId(1), ok(2, 1), Time(5)).unwrap();
    assert_eq!(
        drain(&mut p),
        [
            Effect::ReleaseStaged {
                staging: StagingId(2)
            },
            send(1, frame),
            Effect::Joined {
                target: TargetId(1),
                incarnation: 1
            },
        ]
    );
    // Its deadline counts from the send.
    assert_eq!(
        p.awaited_controls(TargetId(1)),
        [(Seq(3), Time(3 + 10_000))]
    );
    assert_eq!(p.poll_timeout(), Some(Time(5 + 1_000)));
    p.handle_reply(TargetId(1), ok(3, 1), Time(6)).unwrap();
    assert_eq!(
        drain(&mut p),
        [Effect::Completed {
            op,
            result: Ok(Completion::Unregistered(h)),
            outcomes: vec![
                (TargetId(0), TargetOutcome::Ok),
                (TargetId(1), TargetOutcome::Ok)
            ],
        }]
    );
    assert!(p.live_handles().is_empty() && p.is_idle());
}

#[test]
fn an_unregister_waiting_for_a_replay_that_fails_counts_the_replacement_fenced() {
    let mut p = started(2, true, 3);
    let h = registered(&mut p, 1, &[0, 1], 0);
    respawned(&mut p, 1, 1, 2);
    let op = p.unregister(&h, Time(3)).unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(3, 1), Time(4)).unwrap();
    let failure = Failure::new(ErrorCode::DESERIALIZE_FAILED, "no");
    p.handle_reply(
        TargetId(1),
        Reply {
            seq: Seq(2),
            digest: digest(1),
            result: Err(failure.clone()),
        },
        Time(5),
    )
    .unwrap();
    let effects = drain(&mut p);
    // No unregister frame ever goes to the fenced replacement.
    assert!(
        !effects.iter().any(|e| matches!(
            e,
            Effect::Send {
                target: TargetId(1),
                ..
            }
        )),
        "{effects:?}"
    );
    // The handle is released everywhere (a fenced target holds nothing),
    // and the unregister says which target it lost.
    let released = Error::new(
        ErrorCode::TARGET_LOST,
        OperationKind::Unregister,
        format!(
            "handle {} is released (a lost target holds nothing of it), but the unregister lost targets while it was pending there: target 1: fenced after its deadline",
            h.handle_id
        ),
    )
    .with_namespace(Namespace::LocalPython)
    .with_digest(digest(1))
    .with_seq(Seq(op.0));
    assert!(effects.contains(&Effect::Completed {
        op,
        result: Err(released),
        outcomes: vec![
            (TargetId(0), TargetOutcome::Ok),
            (TargetId(1), TargetOutcome::Fenced)
        ],
    }));
    assert!(effects.contains(&Effect::Fence {
        target: TargetId(1),
        cause: format!("it failed a replayed registration ({failure})")
    }));
}

/// A register in flight that the target's previous process confirmed before
/// it was lost: the confirmation went with that process.
fn confirmed_then_replaced(p: &mut Parent) -> callreg::protocol::OpId {
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(1))
        .unwrap();
    drain(p);
    p.handle_reply(TargetId(1), ok(1, 1), Time(2)).unwrap();
    p.target_lost(TargetId(1), Time(3)).unwrap();
    assert_eq!(
        drain(p),
        [Effect::Spawn {
            target: TargetId(1),
            incarnation: 1
        }]
    );
    p.target_spawned(TargetId(1), 1, Time(4)).unwrap();
    // Nothing live to replay, but a register is in flight: no join yet.
    assert_eq!(drain(p), []);
    assert_eq!(p.target_phase(TargetId(1)), TargetPhase::Joining);
    op
}

#[test]
fn a_confirmation_by_a_replaced_process_does_not_count_for_its_replacement() {
    use callreg::protocol::invariants;
    use callreg::protocol::{Target, TargetConfig};
    let mut p = started(2, true, 3);
    let op = confirmed_then_replaced(&mut p);
    p.handle_reply(TargetId(0), ok(1, 1), Time(5)).unwrap();
    let effects = drain(&mut p);
    let Some(Effect::Completed {
        result: Ok(Completion::Registered(h)),
        ..
    }) = effects.get(1)
    else {
        panic!("{effects:?}")
    };
    assert_eq!(
        effects,
        [
            Effect::ReleaseStaged {
                staging: StagingId(1)
            },
            Effect::Completed {
                op,
                result: Ok(Completion::Registered(*h)),
                outcomes: vec![
                    (TargetId(0), TargetOutcome::Ok),
                    (TargetId(1), TargetOutcome::Ok)
                ],
            },
            Effect::Restage {
                staging: StagingId(2),
                digest: digest(1)
            },
            send(1, register_frame(2, 1)),
        ]
    );
    // The replacement holds nothing yet, its replay in transit: no
    // invariant may count it as holding the new handle (before, the
    // registry said it had confirmed it: dispatch safety failed).
    let config = |t| TargetConfig {
        id: TargetId(t),
        slot_capacity: 64,
    };
    let t0 = Target::new(config(0), &[(digest(1), 1)]).unwrap();
    let t1 = Target::new(config(1), &[]).unwrap();
    let frame = register_frame(2, 1);
    let view = invariants::View {
        parent: &p,
        targets: &[Some(&t0), Some(&t1)],
        frames: &[(TargetId(1), &frame)],
        replies: &[],
    };
    assert_eq!(invariants::check_all(&view), Ok(()));
    // The unregister of the handle waits for the replay at the replacement.
    p.unregister(h, Time(6)).unwrap();
    assert_eq!(
        drain(&mut p),
        [send(
            0,
            ControlFrame::Unregister {
                seq: Seq(3),
                digest: digest(1)
            }
        )]
    );
}

#[test]
fn a_reply_of_a_replaced_process_changes_nothing_for_its_replacement() {
    let mut p = started(2, true, 3);
    registered(&mut p, 1, &[0, 1], 0);
    respawned(&mut p, 1, 10, 20);
    assert_eq!(p.target_phase(TargetId(1)), TargetPhase::Joining);
    // The lost process's replies to seq 1 (issued before the replacement
    // was started), delivered late by the transport, OK or refused: the
    // replacement is still joining, its replay (seq 2) still awaited, and
    // nothing turns uncertain (before, such a reply was taken for a late
    // answer of the replacement and marked the digest uncertain).
    let refused = Reply {
        result: Err(Failure::new(ErrorCode::DESERIALIZE_FAILED, "late")),
        ..ok(1, 1)
    };
    for stale in [ok(1, 1), refused.clone()] {
        let before = p.clone();
        assert_eq!(p.handle_reply(TargetId(1), stale, Time(21)), Ok(()));
        assert_eq!(drain(&mut p), []);
        assert_eq!(p, before);
    }
    assert!(p.awaits_reply(TargetId(1), Seq(2)));
    assert_eq!(p.uncertain_digests(), []);
    p.handle_reply(TargetId(1), ok(2, 1), Time(30)).unwrap();
    assert_eq!(
        drain(&mut p),
        [
            Effect::ReleaseStaged {
                staging: StagingId(2)
            },
            Effect::Joined {
                target: TargetId(1),
                incarnation: 1
            },
        ]
    );
    // Once it joined, the same.
    let before = p.clone();
    assert_eq!(p.handle_reply(TargetId(1), refused, Time(31)), Ok(()));
    assert_eq!(p, before);
    // A duplicate answer of the replacement itself is still a late reply:
    // its digest is uncertain.
    assert_eq!(p.handle_reply(TargetId(1), ok(2, 1), Time(32)), Ok(()));
    assert_eq!(drain(&mut p), []);
    assert_eq!(p.uncertain_digests(), [digest(1)]);
}

#[test]
fn a_failed_register_sends_no_cleanup_to_the_replacement_of_a_target_that_confirmed_it() {
    let mut p = started(2, true, 3);
    let op = confirmed_then_replaced(&mut p);
    let failure = Failure::new(ErrorCode::DESERIALIZE_FAILED, "no");
    p.handle_reply(
        TargetId(0),
        Reply {
            seq: Seq(1),
            digest: digest(1),
            result: Err(failure.clone()),
        },
        Time(5),
    )
    .unwrap();
    // The replacement never installed it: nothing to roll back there
    // (before, it was sent a cleanup, refused it, and the digest became
    // uncertain although every target was fenced or answered).
    let effects = drain(&mut p);
    assert_eq!(effects.len(), 3, "{effects:?}");
    assert_eq!(
        effects[0],
        Effect::ReleaseStaged {
            staging: StagingId(1)
        }
    );
    assert_eq!(
        effects[2],
        Effect::Joined {
            target: TargetId(1),
            incarnation: 1
        }
    );
    let Effect::Completed {
        op: done,
        result: Err(error),
        outcomes,
    } = &effects[1]
    else {
        panic!("{effects:?}")
    };
    assert_eq!(
        (*done, error.code),
        (op, ErrorCode::REGISTER_PARTIAL_FAILURE)
    );
    assert_eq!(
        *outcomes,
        vec![
            (TargetId(0), TargetOutcome::Failed { failure }),
            (TargetId(1), TargetOutcome::RolledBack)
        ]
    );
    assert!(p.uncertain_digests().is_empty() && p.is_idle());
}

#[test]
fn a_refused_replay_fences_the_replacement_and_the_rate_limit_gives_the_target_up() {
    let mut p = started(2, true, 2);
    let h = registered(&mut p, 1, &[0, 1], 0);
    respawned(&mut p, 1, 100, 100);
    let refusal = Failure::new(ErrorCode::DESERIALIZE_FAILED, "ModuleNotFoundError: x");
    p.handle_reply(
        TargetId(1),
        Reply {
            seq: Seq(2),
            digest: digest(1),
            result: Err(refusal.clone()),
        },
        Time(110),
    )
    .unwrap();
    assert_eq!(
        drain(&mut p),
        [
            Effect::ReleaseStaged {
                staging: StagingId(2)
            },
            Effect::JoinFailed {
                target: TargetId(1),
                incarnation: 1,
                failure: refusal.clone(),
            },
            Effect::Fence {
                target: TargetId(1),
                cause: format!("it failed a replayed registration ({refusal})")
            },
        ]
    );
    // Lost before it joined: the next one waits for the back-off.
    assert_eq!(p.failed_joins(TargetId(1)), 1);
    assert_eq!(
        p.target_phase(TargetId(1)),
        TargetPhase::BackingOff(Time(110 + BACKOFF))
    );
    assert_eq!(p.poll_timeout(), Some(Time(110 + BACKOFF)));
    p.handle_timeout(Time(109 + BACKOFF));
    assert_eq!(drain(&mut p), []);
    p.handle_timeout(Time(110 + BACKOFF));
    assert_eq!(
        drain(&mut p),
        [Effect::Spawn {
            target: TargetId(1),
            incarnation: 2
        }]
    );
    // It cannot be started: the second in a row, which is the limit.
    p.target_died(TargetId(1), "fork failed", Time(700))
        .unwrap();
    assert_eq!(
        drain(&mut p),
        [Effect::Abandoned {
            target: TargetId(1),
            failed_joins: 2
        }]
    );
    assert_eq!(p.target_phase(TargetId(1)), TargetPhase::Lost);
    assert_eq!(p.poll_timeout(), None);
    assert!(p.is_idle());
    // The other target serves on.
    assert_eq!(p.submit(&h, TargetId(0)), Ok(Seq(3)));
}

#[test]
fn the_back_off_doubles_for_each_replacement_lost_before_it_joined() {
    let mut p = started(1, true, 4);
    registered(&mut p, 1, &[0], 0);
    p.target_lost(TargetId(0), Time(0)).unwrap();
    let mut now = 0;
    for (incarnation, backoff) in [(1, BACKOFF), (2, 2 * BACKOFF), (3, 4 * BACKOFF)] {
        assert_eq!(
            drain(&mut p),
            [Effect::Spawn {
                target: TargetId(0),
                incarnation
            }]
        );
        p.target_spawned(TargetId(0), incarnation, Time(now))
            .unwrap();
        drain(&mut p);
        p.target_lost(TargetId(0), Time(now)).unwrap();
        // Its replay is released; the next one waits.
        assert_eq!(
            drain(&mut p),
            [Effect::ReleaseStaged {
                staging: StagingId(u64::from(incarnation) + 1)
            }]
        );
        assert_eq!(
            p.target_phase(TargetId(0)),
            TargetPhase::BackingOff(Time(now + backoff))
        );
        now += backoff;
        p.handle_timeout(Time(now));
    }
    assert_eq!(
        drain(&mut p),
        [Effect::Spawn {
            target: TargetId(0),
            incarnation: 4
        }]
    );
    p.target_spawned(TargetId(0), 4, Time(now)).unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(5, 1), Time(now)).unwrap();
    assert!(drain(&mut p).contains(&Effect::Joined {
        target: TargetId(0),
        incarnation: 4
    }));
    // Joined: the row ends, and the next loss is replaced at once.
    assert_eq!(p.failed_joins(TargetId(0)), 0);
    p.target_lost(TargetId(0), Time(now)).unwrap();
    assert_eq!(
        drain(&mut p),
        [Effect::Spawn {
            target: TargetId(0),
            incarnation: 5
        }]
    );
}

#[test]
fn a_silent_replacement_is_fenced_even_without_fencing() {
    let mut p = started(2, false, 3);
    registered(&mut p, 1, &[0, 1], 0);
    respawned(&mut p, 1, 0, 0);
    assert_eq!(p.poll_timeout(), Some(Time(1_000)));
    p.handle_timeout(Time(1_000));
    assert_eq!(
        drain(&mut p),
        [
            Effect::JoinFailed {
                target: TargetId(1),
                incarnation: 1,
                failure: Failure::new(
                    ErrorCode::DEADLINE_EXCEEDED,
                    "no answer before its deadline while it joined"
                ),
            },
            Effect::Fence {
                target: TargetId(1),
                cause: "it failed a replayed registration (DEADLINE_EXCEEDED: no answer before its deadline while it joined)".to_owned()
            },
            Effect::ReleaseStaged {
                staging: StagingId(2)
            },
        ]
    );
    assert!(p.uncertain_digests().is_empty(), "nothing became uncertain");
    assert_eq!(
        p.target_phase(TargetId(1)),
        TargetPhase::BackingOff(Time(1_000 + BACKOFF))
    );
}

#[test]
fn uncertain_registrations_are_replayed_too() {
    let mut p = started(2, false, 3);
    let op = p
        .register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_reply(TargetId(0), ok(op.0, 1), Time(0)).unwrap();
    p.handle_reply(TargetId(1), ok(op.0, 1), Time(0)).unwrap();
    drain(&mut p);
    // A duplicate reply from target 0 makes the digest uncertain there.
    p.handle_reply(TargetId(0), ok(op.0, 1), Time(0)).unwrap();
    assert_eq!(p.uncertain_digests(), [digest(1)]);
    registered(&mut p, 2, &[0, 1], 0);
    p.target_lost(TargetId(1), Time(1)).unwrap();
    drain(&mut p);
    assert_eq!(
        p.uncertain_digests(),
        [digest(1)],
        "the doubt is target 0's"
    );
    // The fresh process holds exactly what it is replayed, the uncertain
    // digest too: if the doubt about target 0 is settled, every joined
    // target holds the registry (invariant 11).
    p.target_spawned(TargetId(1), 1, Time(1)).unwrap();
    assert_eq!(
        drain(&mut p),
        [
            Effect::Restage {
                staging: StagingId(3),
                digest: digest(1)
            },
            send(1, register_frame(3, 1)),
            Effect::Restage {
                staging: StagingId(4),
                digest: digest(2)
            },
            send(1, register_frame(4, 2)),
        ]
    );
}

#[test]
fn a_spawn_report_for_no_replacement_is_refused() {
    let mut p = started(2, true, 3);
    let error = p.target_spawned(TargetId(1), 1, Time(0)).unwrap_err();
    assert_eq!(
        (error.code, error.message.as_str()),
        (
            ErrorCode::FRAME_INVALID,
            "target 1 is not waiting for incarnation 1"
        )
    );
    p.target_lost(TargetId(1), Time(0)).unwrap();
    drain(&mut p);
    let error = p.target_spawned(TargetId(1), 2, Time(0)).unwrap_err();
    assert_eq!(error.code, ErrorCode::FRAME_INVALID);
    let error = p.target_spawned(TargetId(2), 1, Time(0)).unwrap_err();
    assert_eq!(error.code, ErrorCode::FRAME_INVALID);
    assert_eq!(drain(&mut p), []);
    let mut new = Parent::new(*p.config());
    let error = new.target_spawned(TargetId(0), 1, Time(0)).unwrap_err();
    assert_eq!(error.code, ErrorCode::LIFECYCLE_INVALID);
}

#[test]
fn closing_while_a_replacement_joins_releases_its_replays_and_completes_nothing_for_them() {
    let mut p = started(2, true, 3);
    registered(&mut p, 1, &[0, 1], 0);
    respawned(&mut p, 1, 0, 0);
    p.close().unwrap();
    assert_eq!(
        drain(&mut p),
        [Effect::ReleaseStaged {
            staging: StagingId(2)
        }]
    );
    assert!(p.staged().is_empty() && p.in_flight().is_empty());
    // A loss after close asks for nothing.
    p.target_lost(TargetId(0), Time(1)).unwrap();
    assert_eq!(drain(&mut p), []);
}

#[test]
fn without_replacements_a_lost_target_stays_lost() {
    let mut p = started(2, true, 0);
    p.target_lost(TargetId(1), Time(0)).unwrap();
    assert_eq!(drain(&mut p), []);
    assert_eq!(p.target_phase(TargetId(1)), TargetPhase::Lost);
    assert_eq!(p.incarnation(TargetId(1)), 0);
}

#[test]
fn a_failed_replay_staging_fails_the_join_and_withdraws_every_frame_queued_for_the_target() {
    let mut p = started(2, true, 3);
    registered(&mut p, 1, &[0, 1], 0);
    registered(&mut p, 2, &[0, 1], 0);
    p.target_lost(TargetId(1), Time(0)).unwrap();
    drain(&mut p);
    p.target_spawned(TargetId(1), 1, Time(5)).unwrap();
    assert_eq!(
        p.poll_effect(),
        Some(Effect::Restage {
            staging: StagingId(3),
            digest: digest(1)
        })
    );
    let failure = Failure::new(ErrorCode::IO_FAILED, "memfd_create: ENOMEM");
    p.stage_failed(StagingId(3), failure.clone()).unwrap();
    // Neither replay's frame goes: the second replay's payload, already
    // asked for, is staged and released at once.
    assert_eq!(
        drain(&mut p),
        [
            Effect::Restage {
                staging: StagingId(4),
                digest: digest(2)
            },
            Effect::JoinFailed {
                target: TargetId(1),
                incarnation: 1,
                failure: failure.clone()
            },
            Effect::Fence {
                target: TargetId(1),
                cause: format!("it failed a replayed registration ({failure})")
            },
            Effect::ReleaseStaged {
                staging: StagingId(4)
            },
        ]
    );
    assert_eq!(
        p.target_phase(TargetId(1)),
        TargetPhase::BackingOff(Time(5 + BACKOFF))
    );
    assert!(p.staged().is_empty());
    assert!(p.in_flight().is_empty());
}

#[test]
fn once_replacements_ended_every_target_lost_or_backing_off_is_abandoned() {
    let mut p = started(3, true, 3);
    // Target 1 backs off after a replacement that could not be started.
    p.target_lost(TargetId(1), Time(0)).unwrap();
    drain(&mut p);
    p.target_died(TargetId(1), "the template process is gone", Time(1))
        .unwrap();
    assert_eq!(drain(&mut p), []);
    assert_eq!(
        p.target_phase(TargetId(1)),
        TargetPhase::BackingOff(Time(1 + BACKOFF))
    );
    // Target 2 waits for its replacement.
    p.target_lost(TargetId(2), Time(2)).unwrap();
    drain(&mut p);
    assert_eq!(p.target_phase(TargetId(2)), TargetPhase::Spawning);
    p.replacements_ended();
    assert!(p.are_replacements_ended());
    assert_eq!(
        drain(&mut p),
        [Effect::Abandoned {
            target: TargetId(1),
            failed_joins: 1
        }]
    );
    assert_eq!(p.target_phase(TargetId(1)), TargetPhase::Lost);
    // The replacement being spawned fails: abandoned, no back-off.
    p.target_died(TargetId(2), "the template process is gone", Time(3))
        .unwrap();
    assert_eq!(
        drain(&mut p),
        [Effect::Abandoned {
            target: TargetId(2),
            failed_joins: 1
        }]
    );
    // A later loss asks for no replacement.
    p.target_lost(TargetId(0), Time(4)).unwrap();
    assert_eq!(
        drain(&mut p),
        [Effect::Abandoned {
            target: TargetId(0),
            failed_joins: 0
        }]
    );
    assert!(p.is_idle());
    assert_eq!(p.poll_timeout(), None);
    // Idempotent.
    p.replacements_ended();
    assert_eq!(drain(&mut p), []);
}

/// A whole system (`common::sim`, every invariant checked at every step)
/// with replacements on.
fn system(targets: u16, before_start: &[u8]) -> common::sim::Sim {
    common::sim::Sim::with_config(
        ParentConfig {
            probe_first: true,
            respawn_limit: 3,
            respawn_backoff: BACKOFF,
            unbounded_spawn: false,
            max_tasks_per_target: 0,
            ..parent_config(targets, true)
        },
        before_start,
    )
}

/// A crash of target 1 while a register is in flight; the replacement
/// joins holding exactly the registry, and serves.
fn crash_and_join(
    sim: &mut common::sim::Sim,
) -> Result<(), callreg::protocol::invariants::Violation> {
    let op = sim.register(2).unwrap();
    sim.crash(1);
    sim.notice(1);
    sim.check()?;
    assert!(sim.spawn(1), "a replacement was asked for");
    sim.check()?;
    sim.run_to_quiet()?;
    sim.check()?;
    assert!(matches!(
        sim.completion(op).map(|c| &c.result),
        Some(Ok(Completion::Registered(_)))
    ));
    Ok(())
}

#[test]
fn a_replacement_joins_holding_exactly_the_registry() {
    let mut sim = system(2, &[1, 1]);
    crash_and_join(&mut sim).unwrap();
    assert_eq!(
        sim.joins,
        [Effect::Joined {
            target: TargetId(1),
            incarnation: 1
        }]
    );
    let table = sim.target(1).unwrap().installed();
    assert_eq!(table, [(digest(1), 2), (digest(2), 1)]);
    assert_eq!(table, sim.target(0).unwrap().installed());
    for handle in sim.live_handles() {
        sim.submit(&handle, 1).unwrap();
    }
    sim.run_to_quiet().unwrap();
    sim.check().unwrap();
}

#[cfg(feature = "mutants")]
mod mutants {
    use super::*;
    use callreg::protocol::Mutant;

    /// Runs the crash-and-join scenario under `mutant`; returns the
    /// invariant it breaks.
    fn broken_by(mutant: Mutant) -> u8 {
        let mut sim = system(2, &[1, 1]).with_mutant(mutant);
        match crash_and_join(&mut sim) {
            Err(violation) => violation.number,
            Ok(()) => panic!("{mutant:?} broke nothing"),
        }
    }

    #[test]
    fn joining_before_the_replays_are_confirmed_is_caught() {
        assert_eq!(broken_by(Mutant::JoinBeforeReplay), 11);
    }

    #[test]
    fn skipping_the_replay_of_a_registration_published_during_the_join_is_caught() {
        assert_eq!(broken_by(Mutant::SkipReplayOfPublished), 11);
    }
}

/// Arrivals (§2.9, `unbounded_spawn`): an open target has no ready deadline,
/// waits for as long as it takes without a failed join, and the process
/// that arrives is replayed the registry and joins as a spawned one does.
#[test]
fn an_open_target_waits_for_an_arrival_without_a_deadline() {
    let mut p = Parent::new(ParentConfig {
        respawn_limit: 3,
        respawn_backoff: BACKOFF,
        unbounded_spawn: true,
        max_tasks_per_target: 0,
        ..parent_config(2, true)
    });
    p.start().unwrap();
    let handle = registered(&mut p, 1, &[0, 1], 10);
    p.target_lost(TargetId(1), Time(20)).unwrap();
    assert_eq!(
        drain(&mut p),
        vec![Effect::Spawn {
            target: TargetId(1),
            incarnation: 1
        }]
    );
    assert_eq!(p.target_phase(TargetId(1)), TargetPhase::Spawning);
    assert_eq!(p.poll_timeout(), None);
    // Far past any control timeout: nothing is fenced, nothing counted.
    p.handle_timeout(Time(u64::MAX / 2));
    assert_eq!(drain(&mut p), vec![]);
    assert_eq!(p.target_phase(TargetId(1)), TargetPhase::Spawning);
    assert_eq!(p.failed_joins(TargetId(1)), 0);
    let now = u64::MAX / 2 + 1;
    p.target_spawned(TargetId(1), 1, Time(now)).unwrap();
    let seq = match drain(&mut p).as_slice() {
        [Effect::Restage { staging, digest: d }, Effect::Send { target, frame }]
            if *d == digest(1)
                && *target == TargetId(1)
                && *frame == register_frame(staging.0, 1) =>
        {
            staging.0
        }
        other => panic!("expected one replay of digest 1 to target 1, got {other:?}"),
    };
    p.handle_reply(TargetId(1), ok(seq, 1), Time(now)).unwrap();
    assert_eq!(
        drain(&mut p),
        vec![
            Effect::ReleaseStaged {
                staging: StagingId(seq)
            },
            Effect::Joined {
                target: TargetId(1),
                incarnation: 1
            }
        ]
    );
    assert_eq!(p.target_phase(TargetId(1)), TargetPhase::Joined);
    assert_eq!(p.live_handles(), vec![handle]);
}

/// Arrivals: a process that arrives and refuses a replay is fenced and
/// counts a failed join; the target opens again after the back-off, and the
/// rate limit still ends it.
#[test]
fn an_arrival_that_refuses_its_replay_reopens_the_target_after_the_back_off() {
    let mut p = Parent::new(ParentConfig {
        respawn_limit: 2,
        respawn_backoff: BACKOFF,
        unbounded_spawn: true,
        max_tasks_per_target: 0,
        ..parent_config(1, true)
    });
    p.start().unwrap();
    registered(&mut p, 1, &[0], 10);
    p.target_lost(TargetId(0), Time(20)).unwrap();
    drain(&mut p);
    p.target_spawned(TargetId(0), 1, Time(30)).unwrap();
    let seq = match drain(&mut p).as_slice() {
        [Effect::Restage { staging, .. }, Effect::Send { .. }] => staging.0,
        other => panic!("expected one replay, got {other:?}"),
    };
    let refused = Failure::new(ErrorCode::DESERIALIZE_FAILED, "no module named x");
    p.handle_reply(
        TargetId(0),
        Reply {
            seq: Seq(seq),
            digest: digest(1),
            result: Err(refused.clone()),
        },
        Time(40),
    )
    .unwrap();
    let effects = drain(&mut p);
    assert!(
        effects.contains(&Effect::JoinFailed {
            target: TargetId(0),
            incarnation: 1,
            failure: refused.clone()
        }) && effects.contains(&Effect::Fence {
            target: TargetId(0),
            cause: format!("it failed a replayed registration ({refused})")
        }),
        "{effects:?}"
    );
    assert_eq!(
        p.target_phase(TargetId(0)),
        TargetPhase::BackingOff(Time(40 + BACKOFF))
    );
    assert_eq!(p.poll_timeout(), Some(Time(40 + BACKOFF)));
    p.handle_timeout(Time(40 + BACKOFF));
    assert_eq!(
        drain(&mut p),
        vec![Effect::Spawn {
            target: TargetId(0),
            incarnation: 2
        }]
    );
    // The second arrival is lost before it joins: the limit of 2 ends the target.
    p.target_spawned(TargetId(0), 2, Time(50 + BACKOFF))
        .unwrap();
    drain(&mut p);
    p.target_lost(TargetId(0), Time(60 + BACKOFF)).unwrap();
    assert_eq!(
        drain(&mut p).last(),
        Some(&Effect::Abandoned {
            target: TargetId(0),
            failed_joins: 2
        })
    );
}
