//! "Every event applied in every state" tables (the s2n-quic practice): no
//! transition is left unspecified. Each table is computed by driving the
//! real machines and compared, line by line, with the expected table
//! written here; `specs/protocol.md` gives the same tables in prose.

mod common;

use callreg::error::{Error, ErrorCode};
use callreg::protocol::{
    Completion, ControlFrame, Effect, Failure, Handle, Namespace, OwnerToken, Parent, ParentConfig,
    Reply, Seq, StagingId, Target, TargetConfig, TargetEffect, TargetId, TargetOutcome, Time,
};
use common::sim::digest;

fn config(fence_on_timeout: bool) -> ParentConfig {
    ParentConfig {
        targets: 2,
        control_timeout: 1_000,
        operation_timeout: 10_000,
        fence_on_timeout,
        owner: OwnerToken(1),
        slot_capacity: 64,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
    }
}

fn effect(e: &Effect) -> String {
    match e {
        Effect::Stage { staging, .. } => format!("stage {}", staging.0),
        Effect::Send { target, frame } => match frame {
            ControlFrame::Register { seq, .. } => format!("register {} to {}", seq.0, target.0),
            ControlFrame::Unregister { seq, .. } => format!("unregister {} to {}", seq.0, target.0),
            ControlFrame::Task { seq, .. } => format!("task {} to {}", seq.0, target.0),
            ControlFrame::Cancel { seq, .. } => format!("cancel {} to {}", seq.0, target.0),
        },
        Effect::TaskDone { seq, end, .. } => format!("task {} done {end:?}", seq.0),
        Effect::CancelRefused { seq, .. } => format!("cancel {} refused", seq.0),
        Effect::Inspect { target, seq } => format!("inspect {} to {}", seq.0, target.0),
        Effect::InspectDone { seq, .. } => format!("inspect {} done", seq.0),
        Effect::Verify {
            target, staging, ..
        } => format!("verify {} to {}", staging.0, target.0),
        Effect::ReleaseStaged { staging } => format!("release {}", staging.0),
        Effect::Fence { target, .. } => format!("fence {}", target.0),
        Effect::Retire {
            target,
            incarnation,
            tasks,
        } => format!(
            "retire {} incarnation {incarnation} after {tasks}",
            target.0
        ),
        Effect::Restage { staging, .. } => format!("restage {}", staging.0),
        Effect::Spawn {
            target,
            incarnation,
        } => format!("spawn {} incarnation {incarnation}", target.0),
        Effect::Joined {
            target,
            incarnation,
        } => format!("joined {} incarnation {incarnation}", target.0),
        Effect::JoinFailed { target, .. } => format!("join failed {}", target.0),
        Effect::Abandoned { target, .. } => format!("abandoned {}", target.0),
        Effect::Completed {
            result, outcomes, ..
        } => {
            let result = match result {
                Ok(Completion::Registered(_)) => "registered".to_owned(),
                Ok(Completion::Unregistered(_)) => "unregistered".to_owned(),
                Err(e) => e.code.to_string(),
            };
            let outcomes: Vec<String> = outcomes
                .iter()
                .map(|(t, o)| format!("{}={}", t.0, outcome(o)))
                .collect();
            format!("completed {result} [{}]", outcomes.join(" "))
        }
    }
}

fn outcome(o: &TargetOutcome) -> &'static str {
    match o {
        TargetOutcome::Ok => "ok",
        TargetOutcome::Failed { .. } => "failed",
        TargetOutcome::Lost => "lost",
        TargetOutcome::TimedOut => "timed-out",
        TargetOutcome::Fenced => "fenced",
        TargetOutcome::RolledBack => "rolled-back",
        TargetOutcome::CleanupUnconfirmed { .. } => "cleanup-unconfirmed",
    }
}

fn describe<T>(result: Result<T, Error>, parent: &mut Parent) -> String {
    let effects: Vec<String> = std::iter::from_fn(|| parent.poll_effect())
        .map(|e| effect(&e))
        .collect();
    let head = match result {
        Ok(_) => "ok".to_owned(),
        Err(e) => e.code.to_string(),
    };
    let uncertain = if parent.is_uncertain(digest(1)) {
        " uncertain"
    } else {
        ""
    };
    if effects.is_empty() {
        format!("{head}{uncertain}")
    } else {
        format!("{head}{uncertain}: {}", effects.join(", "))
    }
}

fn handle(id: u64, n: u8) -> Handle {
    Handle {
        namespace: Namespace::LocalPython,
        hashid: digest(n).hashid(),
        handle_id: id,
        owner: OwnerToken(1),
    }
}

/// Lifecycle × every parent input.
#[test]
fn parent_lifecycle_by_event() {
    let lifecycles = ["new", "started", "closed"];
    let events = [
        "register_before_start",
        "unregister_before_start",
        "start",
        "register",
        "unregister",
        "resolve",
        "submit",
        "handle_reply",
        "target_lost",
        "stage_failed",
        "handle_timeout",
        "close",
    ];
    let mut table = Vec::new();
    for lifecycle in lifecycles {
        for event in events {
            let mut p = Parent::new(config(true));
            p.register_before_start(digest(1), Namespace::LocalPython)
                .unwrap();
            if lifecycle != "new" {
                p.start().unwrap();
            }
            if lifecycle == "closed" {
                p.close().unwrap();
            }
            let now = Time(10);
            let h = handle(1, 1);
            let row = match event {
                "register_before_start" => {
                    let r = p.register_before_start(digest(2), Namespace::LocalPython);
                    describe(r, &mut p)
                }
                "unregister_before_start" => describe(p.unregister_before_start(&h), &mut p),
                "start" => describe(p.start(), &mut p),
                "register" => describe(p.register(digest(2), Namespace::LocalPython, now), &mut p),
                "unregister" => describe(p.unregister(&h, now), &mut p),
                "resolve" => {
                    let r = p.resolve(&h, Namespace::LocalPython);
                    describe(r, &mut p)
                }
                "submit" => describe(p.submit(&h, TargetId(0)), &mut p),
                "handle_reply" => {
                    let reply = Reply {
                        seq: Seq(1),
                        digest: digest(1),
                        result: Ok(()),
                    };
                    describe(p.handle_reply(TargetId(0), reply, now), &mut p)
                }
                "target_lost" => describe(p.target_lost(TargetId(0), now), &mut p),
                "stage_failed" => {
                    let failure = Failure::new(ErrorCode::IO_FAILED, "no space");
                    describe(p.stage_failed(StagingId(1), failure), &mut p)
                }
                "handle_timeout" => {
                    p.handle_timeout(now);
                    describe(Ok(()), &mut p)
                }
                "close" => describe(p.close(), &mut p),
                _ => unreachable!(),
            };
            table.push(format!("{lifecycle:8} {event:24} {row}"));
        }
    }
    let expected = [
        "new      register_before_start    ok",
        "new      unregister_before_start  ok",
        "new      start                    ok",
        "new      register                 LIFECYCLE_INVALID",
        "new      unregister               LIFECYCLE_INVALID",
        "new      resolve                  ok",
        "new      submit                   LIFECYCLE_INVALID",
        "new      handle_reply             LIFECYCLE_INVALID",
        "new      target_lost              LIFECYCLE_INVALID",
        "new      stage_failed             FRAME_INVALID",
        "new      handle_timeout           ok",
        "new      close                    ok",
        "started  register_before_start    LIFECYCLE_INVALID",
        "started  unregister_before_start  LIFECYCLE_INVALID",
        "started  start                    LIFECYCLE_INVALID",
        "started  register                 ok: stage 1, register 1 to 0, register 1 to 1",
        "started  unregister               ok: unregister 1 to 0, unregister 1 to 1",
        "started  resolve                  ok",
        "started  submit                   ok: task 1 to 0",
        "started  handle_reply             FRAME_INVALID",
        "started  target_lost              ok",
        "started  stage_failed             FRAME_INVALID",
        "started  handle_timeout           ok",
        "started  close                    ok",
        "closed   register_before_start    LIFECYCLE_INVALID",
        "closed   unregister_before_start  LIFECYCLE_INVALID",
        "closed   start                    LIFECYCLE_INVALID",
        "closed   register                 LIFECYCLE_INVALID",
        "closed   unregister               LIFECYCLE_INVALID",
        "closed   resolve                  LIFECYCLE_INVALID",
        "closed   submit                   LIFECYCLE_INVALID",
        "closed   handle_reply             ok",
        "closed   target_lost              ok",
        "closed   stage_failed             FRAME_INVALID",
        "closed   handle_timeout           ok",
        "closed   close                    LIFECYCLE_INVALID",
    ]
    .join("\n");
    assert_eq!(table.join("\n"), expected, "\n{}", table.join("\n"));
}

/// Where target 0 stands in a register of digest 1 over targets {0, 1}
/// (target 1 has not answered, or refused in the cleanup row) × every
/// event that can reach it, with and without fencing.
#[test]
fn register_progress_by_event() {
    let states = ["pending", "confirmed", "failed", "lost", "cleanup-pending"];
    let events = ["reply ok", "reply error", "target lost", "deadline"];
    let mut table = Vec::new();
    for fence in [true, false] {
        for state in states {
            for event in events {
                let mut p = Parent::new(config(fence));
                p.start().unwrap();
                p.register(digest(1), Namespace::LocalPython, Time(0))
                    .unwrap();
                let ok = |seq| Reply {
                    seq: Seq(seq),
                    digest: digest(1),
                    result: Ok(()),
                };
                let refused = |seq| Reply {
                    seq: Seq(seq),
                    digest: digest(1),
                    result: Err(Failure::new(ErrorCode::DESERIALIZE_FAILED, "bad pickle")),
                };
                match state {
                    "pending" => {}
                    "confirmed" => p.handle_reply(TargetId(0), ok(1), Time(1)).unwrap(),
                    "failed" => p.handle_reply(TargetId(0), refused(1), Time(1)).unwrap(),
                    "lost" => p.target_lost(TargetId(0), Time(1)).unwrap(),
                    "cleanup-pending" => {
                        p.handle_reply(TargetId(0), ok(1), Time(1)).unwrap();
                        p.handle_reply(TargetId(1), refused(1), Time(2)).unwrap();
                    }
                    _ => unreachable!(),
                }
                std::iter::from_fn(|| p.poll_effect()).for_each(drop);
                // The seq target 0 would answer now: the register's, or the cleanup's.
                let seq = if state == "cleanup-pending" { 2 } else { 1 };
                let row = match event {
                    "reply ok" => describe(p.handle_reply(TargetId(0), ok(seq), Time(3)), &mut p),
                    "reply error" => {
                        describe(p.handle_reply(TargetId(0), refused(seq), Time(3)), &mut p)
                    }
                    "target lost" => describe(p.target_lost(TargetId(0), Time(3)), &mut p),
                    "deadline" => {
                        let at = p.poll_timeout().unwrap_or(Time(0));
                        p.handle_timeout(at);
                        format!("at {}: {}", at.0, describe(Ok(()), &mut p))
                    }
                    _ => unreachable!(),
                };
                let fencing = if fence { "fence" } else { "no-fence" };
                table.push(format!("{fencing:8} {state:15} {event:11} {row}"));
            }
        }
    }
    let expected = [
        "fence    pending         reply ok    ok",
        "fence    pending         reply error ok",
        "fence    pending         target lost ok",
        "fence    pending         deadline    at 1000: ok: fence 0, fence 1, release 1, completed REGISTER_PARTIAL_FAILURE [0=fenced 1=fenced]",
        "fence    confirmed       reply ok    ok uncertain",
        "fence    confirmed       reply error ok uncertain",
        "fence    confirmed       target lost ok",
        "fence    confirmed       deadline    at 1000: ok: fence 1, release 1, unregister 2 to 0",
        "fence    failed          reply ok    ok uncertain",
        "fence    failed          reply error ok uncertain",
        "fence    failed          target lost ok",
        "fence    failed          deadline    at 1000: ok: fence 1, release 1, completed REGISTER_PARTIAL_FAILURE [0=failed 1=fenced]",
        "fence    lost            reply ok    ok",
        "fence    lost            reply error ok",
        "fence    lost            target lost ok",
        "fence    lost            deadline    at 1000: ok: fence 1, release 1, completed REGISTER_PARTIAL_FAILURE [0=lost 1=fenced]",
        "fence    cleanup-pending reply ok    ok: completed REGISTER_PARTIAL_FAILURE [0=rolled-back 1=failed]",
        "fence    cleanup-pending reply error ok uncertain: completed REGISTER_PARTIAL_FAILURE [0=cleanup-unconfirmed 1=failed]",
        "fence    cleanup-pending target lost ok: completed REGISTER_PARTIAL_FAILURE [0=rolled-back 1=failed]",
        "fence    cleanup-pending deadline    at 1002: ok: fence 0, completed REGISTER_PARTIAL_FAILURE [0=rolled-back 1=failed]",
        "no-fence pending         reply ok    ok",
        "no-fence pending         reply error ok",
        "no-fence pending         target lost ok",
        "no-fence pending         deadline    at 1000: ok uncertain: release 1, completed REGISTER_PARTIAL_FAILURE [0=timed-out 1=timed-out]",
        "no-fence confirmed       reply ok    ok uncertain",
        "no-fence confirmed       reply error ok uncertain",
        "no-fence confirmed       target lost ok",
        "no-fence confirmed       deadline    at 1000: ok uncertain: release 1, unregister 2 to 0",
        "no-fence failed          reply ok    ok uncertain",
        "no-fence failed          reply error ok uncertain",
        "no-fence failed          target lost ok",
        "no-fence failed          deadline    at 1000: ok uncertain: release 1, completed REGISTER_PARTIAL_FAILURE [0=failed 1=timed-out]",
        "no-fence lost            reply ok    ok",
        "no-fence lost            reply error ok",
        "no-fence lost            target lost ok",
        "no-fence lost            deadline    at 1000: ok uncertain: release 1, completed REGISTER_PARTIAL_FAILURE [0=lost 1=timed-out]",
        "no-fence cleanup-pending reply ok    ok: completed REGISTER_PARTIAL_FAILURE [0=rolled-back 1=failed]",
        "no-fence cleanup-pending reply error ok uncertain: completed REGISTER_PARTIAL_FAILURE [0=cleanup-unconfirmed 1=failed]",
        "no-fence cleanup-pending target lost ok: completed REGISTER_PARTIAL_FAILURE [0=rolled-back 1=failed]",
        "no-fence cleanup-pending deadline    at 1002: ok uncertain: completed REGISTER_PARTIAL_FAILURE [0=cleanup-unconfirmed 1=failed]",
    ]
    .join("\n");
    assert_eq!(table.join("\n"), expected, "\n{}", table.join("\n"));
}

fn target_effects(t: &mut Target) -> Vec<String> {
    std::iter::from_fn(|| t.poll_effect())
        .map(|e| match e {
            TargetEffect::Reply(Reply {
                seq,
                result: Ok(()),
                ..
            }) => format!("reply {} ok", seq.0),
            TargetEffect::Reply(Reply {
                seq,
                result: Err(f),
                ..
            }) => format!("reply {} {}", seq.0, f.code),
            TargetEffect::Deserialize { seq, slot, .. } => {
                format!("deserialize {} into slot {}", seq.0, slot.0)
            }
        })
        .collect()
}

fn target_state(t: &Target) -> String {
    format!(
        "refcount {} slots {} runs {}{}",
        t.refcount(digest(1)),
        t.slots_in_use(),
        t.runs_in_progress(),
        if t.is_deserializing() {
            " deserializing"
        } else {
            ""
        }
    )
}

/// The slot of digest 1 on a target with 2 slots × every target input.
#[test]
fn target_slot_state_by_event() {
    let states = [
        "free",
        "deserializing",
        "live 1",
        "live 2",
        "tombstoned",
        "full",
    ];
    let events = [
        "register",
        "register mismatch",
        "register io failure",
        "deserialized ok",
        "deserialized failed",
        "unregister",
        "begin task",
        "end task",
    ];
    let mut table = Vec::new();
    for state in states {
        for event in events {
            let mut t = Target::new(
                TargetConfig {
                    id: TargetId(0),
                    slot_capacity: 2,
                },
                &[],
            )
            .unwrap();
            match state {
                "free" => {}
                "deserializing" => t.on_register(Seq(1), digest(1), Ok(digest(1))),
                "live 1" | "live 2" | "tombstoned" => {
                    let count = if state == "live 2" { 2 } else { 1 };
                    t = Target::new(
                        TargetConfig {
                            id: TargetId(0),
                            slot_capacity: 2,
                        },
                        &[(digest(1), count)],
                    )
                    .unwrap();
                    if state == "tombstoned" {
                        t.begin_task(Seq(5), digest(1)).unwrap();
                        t.on_unregister(Seq(6), digest(1));
                    }
                }
                "full" => {
                    t = Target::new(
                        TargetConfig {
                            id: TargetId(0),
                            slot_capacity: 2,
                        },
                        &[(digest(2), 1), (digest(3), 1)],
                    )
                    .unwrap()
                }
                _ => unreachable!(),
            }
            t.poll_effect();
            let result = match event {
                "register" => {
                    t.on_register(Seq(10), digest(1), Ok(digest(1)));
                    Ok(())
                }
                "register mismatch" => {
                    t.on_register(Seq(10), digest(1), Ok(digest(9)));
                    Ok(())
                }
                "register io failure" => {
                    t.on_register(
                        Seq(10),
                        digest(1),
                        Err(Failure::new(ErrorCode::IO_FAILED, "no such shm")),
                    );
                    Ok(())
                }
                "deserialized ok" => t.on_deserialized(Seq(1), Ok(())),
                "deserialized failed" => t.on_deserialized(
                    Seq(1),
                    Err(Failure::new(ErrorCode::DESERIALIZE_FAILED, "bad pickle")),
                ),
                "unregister" => {
                    t.on_unregister(Seq(10), digest(1));
                    Ok(())
                }
                "begin task" => t.begin_task(Seq(10), digest(1)).map(|_| ()),
                "end task" => t.end_task(Seq(5)),
                _ => unreachable!(),
            };
            let head = match result {
                Ok(()) => "ok".to_owned(),
                Err(e) => e.code.to_string(),
            };
            let effects = target_effects(&mut t);
            table.push(format!(
                "{state:13} {event:19} {head} [{}] -> {}",
                effects.join(", "),
                target_state(&t)
            ));
        }
    }
    let expected = [
        "free          register            ok [deserialize 10 into slot 0] -> refcount 0 slots 1 runs 0 deserializing",
        "free          register mismatch   ok [reply 10 HASHID_DESCRIPTOR_MISMATCH] -> refcount 0 slots 0 runs 0",
        "free          register io failure ok [reply 10 IO_FAILED] -> refcount 0 slots 0 runs 0",
        "free          deserialized ok     FRAME_INVALID [] -> refcount 0 slots 0 runs 0",
        "free          deserialized failed FRAME_INVALID [] -> refcount 0 slots 0 runs 0",
        "free          unregister          ok [reply 10 DIGEST_NOT_INSTALLED] -> refcount 0 slots 0 runs 0",
        "free          begin task          DIGEST_NOT_INSTALLED [] -> refcount 0 slots 0 runs 0",
        "free          end task            FRAME_INVALID [] -> refcount 0 slots 0 runs 0",
        "deserializing register            ok [] -> refcount 0 slots 1 runs 0 deserializing",
        "deserializing register mismatch   ok [reply 10 HASHID_DESCRIPTOR_MISMATCH] -> refcount 0 slots 1 runs 0 deserializing",
        "deserializing register io failure ok [reply 10 IO_FAILED] -> refcount 0 slots 1 runs 0 deserializing",
        "deserializing deserialized ok     ok [reply 1 ok] -> refcount 1 slots 1 runs 0",
        "deserializing deserialized failed ok [reply 1 DESERIALIZE_FAILED] -> refcount 0 slots 0 runs 0",
        "deserializing unregister          ok [reply 10 DIGEST_NOT_INSTALLED] -> refcount 0 slots 1 runs 0 deserializing",
        "deserializing begin task          DIGEST_NOT_INSTALLED [] -> refcount 0 slots 1 runs 0 deserializing",
        "deserializing end task            FRAME_INVALID [] -> refcount 0 slots 1 runs 0 deserializing",
        "live 1        register            ok [reply 10 ok] -> refcount 2 slots 1 runs 0",
        "live 1        register mismatch   ok [reply 10 HASHID_DESCRIPTOR_MISMATCH] -> refcount 1 slots 1 runs 0",
        "live 1        register io failure ok [reply 10 IO_FAILED] -> refcount 1 slots 1 runs 0",
        "live 1        deserialized ok     FRAME_INVALID [] -> refcount 1 slots 1 runs 0",
        "live 1        deserialized failed FRAME_INVALID [] -> refcount 1 slots 1 runs 0",
        "live 1        unregister          ok [reply 10 ok] -> refcount 0 slots 0 runs 0",
        "live 1        begin task          ok [] -> refcount 1 slots 1 runs 1",
        "live 1        end task            FRAME_INVALID [] -> refcount 1 slots 1 runs 0",
        "live 2        register            ok [reply 10 ok] -> refcount 3 slots 1 runs 0",
        "live 2        register mismatch   ok [reply 10 HASHID_DESCRIPTOR_MISMATCH] -> refcount 2 slots 1 runs 0",
        "live 2        register io failure ok [reply 10 IO_FAILED] -> refcount 2 slots 1 runs 0",
        "live 2        deserialized ok     FRAME_INVALID [] -> refcount 2 slots 1 runs 0",
        "live 2        deserialized failed FRAME_INVALID [] -> refcount 2 slots 1 runs 0",
        "live 2        unregister          ok [reply 10 ok] -> refcount 1 slots 1 runs 0",
        "live 2        begin task          ok [] -> refcount 2 slots 1 runs 1",
        "live 2        end task            FRAME_INVALID [] -> refcount 2 slots 1 runs 0",
        "tombstoned    register            ok [deserialize 10 into slot 1] -> refcount 0 slots 2 runs 1 deserializing",
        "tombstoned    register mismatch   ok [reply 10 HASHID_DESCRIPTOR_MISMATCH] -> refcount 0 slots 1 runs 1",
        "tombstoned    register io failure ok [reply 10 IO_FAILED] -> refcount 0 slots 1 runs 1",
        "tombstoned    deserialized ok     FRAME_INVALID [] -> refcount 0 slots 1 runs 1",
        "tombstoned    deserialized failed FRAME_INVALID [] -> refcount 0 slots 1 runs 1",
        "tombstoned    unregister          ok [reply 10 UNREGISTER_TOMBSTONE_ACTIVE] -> refcount 0 slots 1 runs 1",
        "tombstoned    begin task          DIGEST_NOT_INSTALLED [] -> refcount 0 slots 1 runs 1",
        "tombstoned    end task            ok [] -> refcount 0 slots 0 runs 0",
        "full          register            ok [reply 10 LOCAL_SLOT_EXHAUSTED] -> refcount 0 slots 2 runs 0",
        "full          register mismatch   ok [reply 10 HASHID_DESCRIPTOR_MISMATCH] -> refcount 0 slots 2 runs 0",
        "full          register io failure ok [reply 10 IO_FAILED] -> refcount 0 slots 2 runs 0",
        "full          deserialized ok     FRAME_INVALID [] -> refcount 0 slots 2 runs 0",
        "full          deserialized failed FRAME_INVALID [] -> refcount 0 slots 2 runs 0",
        "full          unregister          ok [reply 10 DIGEST_NOT_INSTALLED] -> refcount 0 slots 2 runs 0",
        "full          begin task          DIGEST_NOT_INSTALLED [] -> refcount 0 slots 2 runs 0",
        "full          end task            FRAME_INVALID [] -> refcount 0 slots 2 runs 0",
    ]
    .join("\n");
    assert_eq!(table.join("\n"), expected, "\n{}", table.join("\n"));
}
