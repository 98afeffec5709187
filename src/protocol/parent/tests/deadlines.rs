//! Unit tests of the parent machine. Deadlines (`specs/protocol.md` §2.7): alive reports, silence and the
//! bound, and a replacement's ready deadline (§2.9).

use super::*;

#[test]
fn an_alive_report_moves_the_silence_deadline_but_never_the_bound() {
    let mut p = started(2);
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    assert_eq!(p.poll_timeout(), Some(Time(100)));
    assert_eq!(p.poll_bound(), Some(Time(1_000)));
    p.handle_alive(TargetId(0), Seq(1), ControlPhase::Running, Time(80))
        .unwrap();
    // Target 1 is still only heard from at the send.
    assert_eq!(p.poll_timeout(), Some(Time(100)));
    p.handle_alive(TargetId(1), Seq(1), ControlPhase::Running, Time(90))
        .unwrap();
    assert_eq!(p.poll_timeout(), Some(Time(180)));
    // Both keep reporting: nothing expires before the bound.
    for now in (90..=990).step_by(90) {
        p.handle_alive(TargetId(0), Seq(1), ControlPhase::Running, Time(now))
            .unwrap();
        p.handle_alive(TargetId(1), Seq(1), ControlPhase::Running, Time(now))
            .unwrap();
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
    p.handle_alive(TargetId(0), Seq(1), ControlPhase::Running, Time(60))
        .unwrap();
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
    p.handle_alive(TargetId(0), Seq(2), ControlPhase::Running, Time(200))
        .unwrap();
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
        max_tasks_per_target: 0,
    });
    p.start().unwrap();
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    drain(&mut p);
    p.handle_alive(TargetId(0), Seq(1), ControlPhase::Running, Time(50))
        .unwrap();
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
        p.handle_alive(TargetId(0), Seq(1), ControlPhase::Running, Time(0))
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
    p.handle_alive(TargetId(0), Seq(1), ControlPhase::Running, Time(90))
        .unwrap();
    assert_eq!(p, before);
    assert_eq!(p.poll_timeout(), Some(Time(100)));
    assert!(p.uncertain_digests().is_empty());
    assert_eq!(
        p.handle_alive(TargetId(1), Seq(2), ControlPhase::Running, Time(20))
            .unwrap_err()
            .code,
        ErrorCode::FRAME_INVALID
    );
    assert_eq!(
        p.handle_alive(TargetId(2), Seq(1), ControlPhase::Running, Time(20))
            .unwrap_err()
            .code,
        ErrorCode::FRAME_INVALID
    );
    let mut unstarted = new_parent(1);
    assert_eq!(
        unstarted
            .handle_alive(TargetId(0), Seq(1), ControlPhase::Running, Time(0))
            .unwrap_err()
            .code,
        ErrorCode::LIFECYCLE_INVALID
    );
}

#[test]
fn a_replacement_not_ready_within_the_control_timeout_is_fenced_and_counts_as_a_failed_join() {
    let mut p = Parent::new(ParentConfig {
        respawn_limit: 2,
        respawn_backoff: 10,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
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
            target: TargetId(0),
            cause: NOT_READY_CAUSE.to_owned()
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
                target: TargetId(0),
                cause: NOT_READY_CAUSE.to_owned()
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
