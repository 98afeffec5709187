//! Unit tests of the parent machine. The registry: the startup snapshot and its failures, handles and
//! their life, namespaces, one metadata per held digest and hook checks.

use super::*;

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
        max_tasks_per_target: 0,
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
        max_tasks_per_target: 0,
    });
    p.register_before_start(digest(1), Namespace::LocalPython)
        .unwrap();
    p.start().unwrap();
    p.register(digest(1), Namespace::LocalPython, Time(0))
        .unwrap();
    assert_eq!(drain(&mut p).len(), 3, "stage and two frames");
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
