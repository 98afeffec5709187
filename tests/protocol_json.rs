//! JSON forms of the protocol's plain data (`specs/metadata.md`
//! §7): handles, failures, errors, per-target outcomes and the registry
//! snapshots of the parent and of a target. Golden files byte for byte,
//! round trips by proptest, strict rejection naming the field, and no slot
//! in any form. Pure: no Python, no fork.
//!
//! Golden files live in `tests/golden/`; `CALLREG_BLESS=1 cargo test --test
//! protocol_json` rewrites them from the values below (review the diff).

use std::path::PathBuf;

use callreg::descriptor::{Digest, HashId};
use callreg::error::{Error, ErrorCode, OperationKind};
use callreg::json::JsonError;
use callreg::protocol::{
    Completion, ControlFrame, DigestCount, Effect, Failure, Handle, InstalledDigest, Lifecycle,
    Namespace, OpId, OwnerToken, Parent, ParentConfig, RegistrySnapshot, Reply, Seq, Target,
    TargetConfig, TargetId, TargetOutcome, TargetOutcomeEntry, TargetSnapshot, Time,
};
use proptest::prelude::*;

/// Hashids of real descriptors (the golden descriptors of
/// `tests/metadata_json.rs`: PYTHON_SERIALIZED, PYTHON_IMPORT,
/// CHIP_CALLABLE).
const SERIALIZED: &str = "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1";
const IMPORT: &str = "sha256:6086292cb02d057e8b0de3739e65ba81b361f93368d5ebc4d4fc21865dbee107";
const CHIP: &str = "sha256:f2f0ecc11b4065db0305c15790d1da17d191bb4ee1456848c3b471724d0deeda";

fn hashid(text: &str) -> HashId {
    text.parse().unwrap()
}

fn digest(text: &str) -> Digest {
    hashid(text).digest()
}

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// Compares `text` + newline with the golden file byte for byte (or
/// rewrites it under `CALLREG_BLESS=1`), and returns the file's text.
fn check_golden(name: &str, text: &str) -> String {
    let path = golden_dir().join(name);
    let expected = format!("{text}\n");
    if std::env::var("CALLREG_BLESS").as_deref() == Ok("1") {
        std::fs::write(&path, &expected).unwrap();
    }
    let stored =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(stored, expected, "golden file {name} differs");
    stored
}

fn handle() -> Handle {
    Handle {
        namespace: Namespace::LocalPython,
        hashid: hashid(SERIALIZED),
        handle_id: 3,
        owner: OwnerToken(0x5eed_cafe_f00d_0001),
    }
}

fn failure() -> Failure {
    Failure::new(
        ErrorCode::DESERIALIZE_FAILED,
        "ModuleNotFoundError: No module named 'numpy'",
    )
}

/// A parent with three targets, driven through a register that failed at
/// one target: target 1 lost, target 2 silent past the deadline (not
/// fenced, so the digest became uncertain), target 0 rolled back. Returns
/// the parent, the operation's id and its completion.
fn driven_parent() -> (Parent, OpId, Effect) {
    let mut parent = Parent::new(ParentConfig {
        targets: 3,
        control_timeout: 1_000,
        operation_timeout: 10_000,
        fence_on_timeout: false,
        owner: OwnerToken(7),
        slot_capacity: 64,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
    });
    parent
        .register_before_start(digest(SERIALIZED), Namespace::LocalPython)
        .unwrap();
    parent
        .register_before_start(digest(IMPORT), Namespace::LocalPython)
        .unwrap();
    parent
        .register_before_start(digest(SERIALIZED), Namespace::LocalPython)
        .unwrap();
    parent.start().unwrap();
    parent.target_lost(TargetId(1), Time(0)).unwrap();
    let op = parent
        .register(digest(CHIP), Namespace::LocalPython, Time(0))
        .unwrap();
    let mut frames = Vec::new();
    while let Some(effect) = parent.poll_effect() {
        if let Effect::Send { target, frame } = effect {
            frames.push((target, frame));
        }
    }
    let reply_ok = |frame: &ControlFrame| Reply {
        seq: frame.seq(),
        digest: frame.digest(),
        result: Ok(()),
    };
    assert_eq!(frames.len(), 2, "{frames:?}");
    parent
        .handle_reply(TargetId(0), reply_ok(&frames[0].1), Time(10))
        .unwrap();
    parent.handle_timeout(Time(1_000));
    let mut completed = None;
    while let Some(effect) = parent.poll_effect() {
        match effect {
            Effect::Send {
                target: TargetId(0),
                frame: frame @ ControlFrame::Unregister { .. },
            } => parent
                .handle_reply(TargetId(0), reply_ok(&frame), Time(1_010))
                .unwrap(),
            Effect::Completed { .. } => completed = Some(effect),
            _ => {}
        }
    }
    (parent, op, completed.expect("the register completed"))
}

#[test]
fn handle_golden_file() {
    let h = handle();
    let text = check_golden("handle.json", &h.to_json_pretty());
    assert_eq!(Handle::from_json(&text), Ok(h));
    assert_eq!(
        h.to_json(),
        format!(
            r#"{{"namespace":"LOCAL_PYTHON","hashid":"{SERIALIZED}","handle_id":3,"owner":6840346605343539201}}"#
        )
    );
}

#[test]
fn failure_golden_file() {
    let f = failure();
    let text = check_golden("failure.json", &f.to_json_pretty());
    assert_eq!(Failure::from_json(&text), Ok(f));
}

fn full_error() -> Error {
    Error::new(
        ErrorCode::DIGEST_NOT_INSTALLED,
        OperationKind::Task,
        format!("{SERIALIZED} is not installed on target 2"),
    )
    .with_target(TargetId(2))
    .with_namespace(Namespace::LocalPython)
    .with_digest(digest(SERIALIZED))
    .with_seq(Seq(41))
}

#[test]
fn error_golden_files() {
    let full = full_error();
    let text = check_golden("error_full.json", &full.to_json_pretty());
    assert_eq!(Error::from_json(&text), Ok(full));

    let bare = Error::new(
        ErrorCode::LIFECYCLE_INVALID,
        OperationKind::Close,
        "close needs a started Worker; this one is Closed",
    );
    let text = check_golden("error_bare.json", &bare.to_json_pretty());
    assert_eq!(Error::from_json(&text), Ok(bare.clone()));
    assert_eq!(
        bare.to_json(),
        r#"{"code":"LIFECYCLE_INVALID","operation":"close","target":null,"namespace":null,"hashid":null,"seq":null,"message":"close needs a started Worker; this one is Closed"}"#
    );
    // Absent context keys read as null.
    assert_eq!(
        Error::from_json(
            r#"{"code": "LIFECYCLE_INVALID", "operation": "close", "message": "close needs a started Worker; this one is Closed"}"#
        ),
        Ok(bare)
    );
}

fn every_outcome() -> Vec<TargetOutcomeEntry> {
    let deadline = Failure::new(
        ErrorCode::DEADLINE_EXCEEDED,
        "no answer to the cleanup before its deadline",
    );
    vec![
        TargetOutcomeEntry {
            target: TargetId(0),
            outcome: TargetOutcome::Ok,
        },
        TargetOutcomeEntry {
            target: TargetId(1),
            outcome: TargetOutcome::Failed { failure: failure() },
        },
        TargetOutcomeEntry {
            target: TargetId(2),
            outcome: TargetOutcome::Lost,
        },
        TargetOutcomeEntry {
            target: TargetId(3),
            outcome: TargetOutcome::TimedOut,
        },
        TargetOutcomeEntry {
            target: TargetId(4),
            outcome: TargetOutcome::Fenced,
        },
        TargetOutcomeEntry {
            target: TargetId(5),
            outcome: TargetOutcome::RolledBack,
        },
        TargetOutcomeEntry {
            target: TargetId(6),
            outcome: TargetOutcome::CleanupUnconfirmed { failure: deadline },
        },
    ]
}

/// One entry per outcome, as the list `callreg run --json` writes under
/// `"targets"`.
#[test]
fn target_outcomes_golden_file() {
    let entries = every_outcome();
    let text = check_golden(
        "target_outcomes.json",
        &serde_json::to_string_pretty(&entries).unwrap(),
    );
    assert_eq!(
        callreg::json::from_str::<Vec<TargetOutcomeEntry>>(&text),
        Ok(entries.clone())
    );
    for entry in &entries {
        assert_eq!(
            TargetOutcomeEntry::from_json(&entry.to_json()).as_ref(),
            Ok(entry)
        );
        assert_eq!(
            TargetOutcome::from_json(&entry.outcome.to_json()).as_ref(),
            Ok(&entry.outcome)
        );
    }
    let names: Vec<String> = entries
        .iter()
        .map(|e| e.outcome.to_json())
        .filter(|j| !j.contains("failure"))
        .collect();
    assert_eq!(
        names,
        [
            r#"{"outcome":"ok"}"#,
            r#"{"outcome":"lost"}"#,
            r#"{"outcome":"timed_out"}"#,
            r#"{"outcome":"fenced"}"#,
            r#"{"outcome":"rolled_back"}"#
        ]
    );
    assert_eq!(
        entries[1].to_json(),
        r#"{"target":1,"outcome":"failed","failure":{"code":"DESERIALIZE_FAILED","message":"ModuleNotFoundError: No module named 'numpy'"}}"#
    );
}

/// A real completion's outcomes, in target order, through
/// [`TargetOutcomeEntry::list`].
#[test]
fn a_completed_operation_lists_its_outcomes() {
    let (_, op, completed) = driven_parent();
    let Effect::Completed {
        op: done,
        result,
        outcomes,
    } = completed
    else {
        unreachable!("driven_parent returns a Completed effect")
    };
    assert_eq!(done, op);
    assert_eq!(
        result.map_err(|e| e.code),
        Err(ErrorCode::REGISTER_PARTIAL_FAILURE)
    );
    let entries = TargetOutcomeEntry::list(&outcomes);
    assert_eq!(
        serde_json::to_string(&entries).unwrap(),
        r#"[{"target":0,"outcome":"rolled_back"},{"target":2,"outcome":"timed_out"}]"#
    );
}

fn expected_registry() -> RegistrySnapshot {
    let handle = |handle_id, text| Handle {
        namespace: Namespace::LocalPython,
        hashid: hashid(text),
        handle_id,
        owner: OwnerToken(7),
    };
    RegistrySnapshot {
        lifecycle: Lifecycle::Started,
        live_targets: vec![TargetId(0), TargetId(2)],
        handles: vec![
            handle(1, SERIALIZED),
            handle(2, IMPORT),
            handle(3, SERIALIZED),
        ],
        digests: vec![
            DigestCount {
                hashid: hashid(IMPORT),
                live_handles: 1,
            },
            DigestCount {
                hashid: hashid(SERIALIZED),
                live_handles: 2,
            },
        ],
        uncertain: vec![hashid(CHIP)],
    }
}

#[test]
fn registry_snapshot_of_a_driven_parent() {
    let (parent, _, _) = driven_parent();
    let snapshot = parent.registry_snapshot();
    assert_eq!(snapshot, expected_registry());
    let text = check_golden("registry_snapshot.json", &snapshot.to_json_pretty());
    assert_eq!(RegistrySnapshot::from_json(&text), Ok(snapshot));

    let fresh = Parent::new(ParentConfig {
        targets: 2,
        control_timeout: 1,
        operation_timeout: 10,
        fence_on_timeout: true,
        owner: OwnerToken(1),
        slot_capacity: 64,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
    });
    assert_eq!(
        fresh.registry_snapshot().to_json(),
        r#"{"lifecycle":"new","live_targets":[],"handles":[],"digests":[],"uncertain":[]}"#
    );
}

#[test]
fn target_snapshot_leaves_slots_out() {
    let (parent, _, _) = driven_parent();
    let startup = parent.startup_snapshot();
    let target = Target::new(TargetConfig::new(TargetId(2)), &startup).unwrap();
    assert_eq!(target.slots_in_use(), 2);
    let snapshot = target.snapshot();
    assert_eq!(
        snapshot,
        TargetSnapshot {
            target: TargetId(2),
            installed: vec![
                InstalledDigest {
                    hashid: hashid(IMPORT),
                    refcount: 1,
                },
                InstalledDigest {
                    hashid: hashid(SERIALIZED),
                    refcount: 2,
                },
            ],
        }
    );
    let text = check_golden("target_snapshot.json", &snapshot.to_json_pretty());
    assert_eq!(TargetSnapshot::from_json(&text), Ok(snapshot));
}

/// Invariant 9 for the JSON forms: no golden file, of any form, mentions a
/// slot (the file names are listed so that a new form is scanned too).
#[test]
fn no_golden_file_mentions_a_slot() {
    let mut names: Vec<String> = std::fs::read_dir(golden_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "descriptor_chip_callable.json",
            "descriptor_python_import.json",
            "descriptor_python_serialized.json",
            "error_bare.json",
            "error_full.json",
            "failure.json",
            "handle.json",
            "metadata_full.json",
            "metadata_minimal.json",
            "registry_snapshot.json",
            "target_outcomes.json",
            "target_snapshot.json",
        ]
    );
    for name in names {
        let text = std::fs::read_to_string(golden_dir().join(&name)).unwrap();
        assert!(
            !text.to_ascii_lowercase().contains("slot"),
            "{name} mentions a slot"
        );
    }
}

#[test]
fn handle_json_rejects_each_fault_naming_the_field() {
    let text = |extra: &str| {
        format!(
            r#"{{"namespace": "LOCAL_PYTHON", "hashid": "{SERIALIZED}", "handle_id": 3, "owner": 7{extra}}}"#
        )
    };
    assert_eq!(
        Handle::from_json(&text("")).map(|h| h.owner),
        Ok(OwnerToken(7))
    );
    assert_eq!(
        Handle::from_json(&text(r#", "slot": 0"#)),
        Err(JsonError::at(
            "slot",
            "unknown field `slot`, expected one of `namespace`, `hashid`, `handle_id`, `owner`"
        ))
    );
    assert_eq!(
        Handle::from_json(&text("").replace(r#""handle_id": 3"#, r#""handle_id": "3""#)),
        Err(JsonError::at(
            "handle_id",
            "invalid type: string \"3\", expected u64"
        ))
    );
    assert_eq!(
        Handle::from_json(&text("").replace("LOCAL_PYTHON", "LOCAL_RUST")),
        Err(JsonError::at(
            "namespace",
            "unknown variant `LOCAL_RUST`, expected `LOCAL_PYTHON` or `LOCAL_CHIP`"
        ))
    );
    assert_eq!(
        Handle::from_json(&text("").replace("sha256:", "md5:")),
        Err(JsonError::at(
            "hashid",
            "HASHID_FORMAT_INVALID: hashid must start with \"sha256:\""
        ))
    );
    assert_eq!(
        Handle::from_json(&text("").replace(r#", "owner": 7"#, "")),
        Err(JsonError::at(".", "missing field `owner`"))
    );
    assert_eq!(
        Handle::from_json(&text("").replace(r#""owner": 7"#, r#""owner": -1"#)),
        Err(JsonError::at(
            "owner",
            "invalid value: integer `-1`, expected u64"
        ))
    );
}

#[test]
fn error_json_rejects_each_fault_naming_the_field() {
    let good = full_error().to_json();
    assert_eq!(
        Error::from_json(&good.replace("DIGEST_NOT_INSTALLED", "NOPE")),
        Err(JsonError::at("code", "unknown error code \"NOPE\""))
    );
    assert_eq!(
        Error::from_json(&good.replace(r#""code":"DIGEST_NOT_INSTALLED""#, r#""code":15"#)),
        Err(JsonError::at(
            "code",
            "invalid type: integer `15`, expected a string"
        ))
    );
    assert_eq!(
        Error::from_json(&good.replace(r#""operation":"task""#, r#""operation":"fly""#)),
        Err(JsonError::at(
            "operation",
            "unknown variant `fly`, expected one of `register`, `unregister`, `cleanup`, `resolve`, `task`, `start`, `close`, `reply`, `stage`, `decode`, `inspect`"
        ))
    );
    assert_eq!(
        Error::from_json(&good.replace(r#""target":2"#, r#""target":70000"#)),
        Err(JsonError::at(
            "target",
            "invalid value: integer `70000`, expected u16"
        ))
    );
    assert_eq!(
        Error::from_json(&good.replace(r#""seq":41"#, r#""seq":41,"slot":1"#)),
        Err(JsonError::at(
            "slot",
            "unknown field `slot`, expected one of `code`, `operation`, `target`, `namespace`, `hashid`, `seq`, `message`"
        ))
    );
    assert_eq!(
        Error::from_json(&good.replace(r#","message":"#, r#","mesage":"#)).map_err(|e| e.path),
        Err("mesage".to_owned())
    );
}

#[test]
fn outcome_json_rejects_each_fault_naming_the_field() {
    assert_eq!(
        TargetOutcomeEntry::from_json(r#"{"target": 1, "outcome": "failed"}"#),
        Err(JsonError::at(
            ".",
            "missing field `failure` (required by outcome failed)"
        ))
    );
    assert_eq!(
        TargetOutcomeEntry::from_json(
            r#"{"target": 0, "outcome": "ok", "failure": {"code": "IO_FAILED", "message": "x"}}"#
        ),
        Err(JsonError::at(
            ".",
            "field `failure` does not belong to outcome ok"
        ))
    );
    assert_eq!(
        TargetOutcomeEntry::from_json(r#"{"target": 0, "outcome": "exploded"}"#),
        Err(JsonError::at(
            "outcome",
            "unknown variant `exploded`, expected one of `ok`, `failed`, `lost`, `timed_out`, `fenced`, `rolled_back`, `cleanup_unconfirmed`"
        ))
    );
    assert_eq!(
        TargetOutcomeEntry::from_json(r#"{"target": "0", "outcome": "ok"}"#),
        Err(JsonError::at(
            "target",
            "invalid type: string \"0\", expected u16"
        ))
    );
    assert_eq!(
        TargetOutcomeEntry::from_json(
            r#"{"target": 1, "outcome": "failed", "failure": {"code": "IO_FAILED", "message": "x", "slot": 4}}"#
        ),
        Err(JsonError::at(
            "failure.slot",
            "unknown field `slot`, expected `code` or `message`"
        ))
    );
    assert_eq!(
        TargetOutcome::from_json(r#"{"outcome": "lost", "target": 1}"#),
        Err(JsonError::at(
            "target",
            "unknown field `target`, expected `outcome` or `failure`"
        ))
    );
    // The old, derived form of `TargetOutcome` is still read (same shape).
    assert_eq!(
        TargetOutcome::from_json(
            r#"{"outcome": "cleanup_unconfirmed", "failure": {"code": "DEADLINE_EXCEEDED", "message": "m"}}"#
        ),
        Ok(TargetOutcome::CleanupUnconfirmed {
            failure: Failure::new(ErrorCode::DEADLINE_EXCEEDED, "m")
        })
    );
    // In a list the path names the entry.
    assert_eq!(
        callreg::json::from_str::<Vec<TargetOutcomeEntry>>(
            r#"[{"target": 0, "outcome": "ok"}, {"target": 1, "outcome": "ok", "colour": 1}]"#
        ),
        Err(JsonError::at(
            "[1].colour",
            "unknown field `colour`, expected one of `target`, `outcome`, `failure`"
        ))
    );
}

#[test]
fn snapshot_json_rejects_each_fault_naming_the_field() {
    let good: serde_json::Value = serde_json::from_str(&expected_registry().to_json()).unwrap();
    let with = |pointer: &str, value: serde_json::Value| {
        let mut doc = good.clone();
        *doc.pointer_mut(pointer).unwrap() = value;
        RegistrySnapshot::from_json(&doc.to_string())
    };
    assert_eq!(
        with("/lifecycle", serde_json::json!("Started")),
        Err(JsonError::at(
            "lifecycle",
            "unknown variant `Started`, expected one of `new`, `started`, `closed`"
        ))
    );
    assert_eq!(
        with("/lifecycle", serde_json::json!("closed")),
        Err(JsonError::at(
            "live_targets",
            "must be empty unless lifecycle is started"
        ))
    );
    assert_eq!(
        with("/live_targets", serde_json::json!([2, 0])),
        Err(JsonError::at(
            "live_targets[1]",
            "out of order or repeated: entries are in increasing order without repeats"
        ))
    );
    assert_eq!(
        with("/handles/2/handle_id", serde_json::json!(2)),
        Err(JsonError::at(
            "handles[2].handle_id",
            "out of order or repeated: entries are in increasing order without repeats"
        ))
    );
    assert_eq!(
        with("/digests/1/live_handles", serde_json::json!(3)),
        Err(JsonError::at(
            "digests",
            "must list each hashid of `handles` once, in hashid order, with its number of handles"
        ))
    );
    assert_eq!(
        with("/uncertain", serde_json::json!([CHIP, CHIP])),
        Err(JsonError::at(
            "uncertain[1]",
            "out of order or repeated: entries are in increasing order without repeats"
        ))
    );
    let mut with_slot = good.clone();
    with_slot["handles"][0]["slot"] = serde_json::json!(0);
    assert_eq!(
        RegistrySnapshot::from_json(&with_slot.to_string()).map_err(|e| e.path),
        Err("handles[0].slot".to_owned())
    );
    assert_eq!(
        with("/uncertain/0", serde_json::json!(3)),
        Err(JsonError::at(
            "uncertain[0]",
            "invalid type: integer `3`, expected a string"
        ))
    );

    let target = |installed: &str| {
        TargetSnapshot::from_json(&format!(r#"{{"target": 0, "installed": [{installed}]}}"#))
    };
    assert_eq!(
        target(&format!(r#"{{"hashid": "{SERIALIZED}", "refcount": 0}}"#)),
        Err(JsonError::at("installed[0].refcount", "must be at least 1"))
    );
    assert_eq!(
        target(&format!(
            r#"{{"hashid": "{SERIALIZED}", "refcount": 1}}, {{"hashid": "{IMPORT}", "refcount": 1}}"#
        )),
        Err(JsonError::at(
            "installed[1].hashid",
            "out of order or repeated: entries are in increasing order without repeats"
        ))
    );
    assert_eq!(
        target(&format!(
            r#"{{"hashid": "{SERIALIZED}", "refcount": 1, "slot": 0}}"#
        )),
        Err(JsonError::at(
            "installed[0].slot",
            "unknown field `slot`, expected `hashid` or `refcount`"
        ))
    );
    assert_eq!(
        target(&format!(r#"{{"hashid": "{SERIALIZED}", "refcount": -1}}"#)),
        Err(JsonError::at(
            "installed[0].refcount",
            "invalid value: integer `-1`, expected u32"
        ))
    );
}

fn any_hashid() -> impl Strategy<Value = HashId> {
    any::<[u8; 32]>().prop_map(|b| HashId(Digest(b)))
}

fn any_namespace() -> impl Strategy<Value = Namespace> {
    prop_oneof![Just(Namespace::LocalPython), Just(Namespace::LocalChip)]
}

fn any_handle() -> impl Strategy<Value = Handle> {
    (any_namespace(), any_hashid(), any::<u64>(), any::<u64>()).prop_map(
        |(namespace, hashid, handle_id, owner)| Handle {
            namespace,
            hashid,
            handle_id,
            owner: OwnerToken(owner),
        },
    )
}

fn any_code() -> impl Strategy<Value = ErrorCode> {
    prop::sample::select(ErrorCode::ALL.to_vec())
}

fn any_failure() -> impl Strategy<Value = Failure> {
    (any_code(), ".{0,12}").prop_map(|(code, message)| Failure::new(code, message))
}

fn any_error() -> impl Strategy<Value = Error> {
    let operations = vec![
        OperationKind::Register,
        OperationKind::Unregister,
        OperationKind::Cleanup,
        OperationKind::Resolve,
        OperationKind::Task,
        OperationKind::Start,
        OperationKind::Close,
        OperationKind::Reply,
        OperationKind::Stage,
        OperationKind::Decode,
    ];
    (
        any_code(),
        prop::sample::select(operations),
        prop::option::of(any::<u16>()),
        prop::option::of(any_namespace()),
        prop::option::of(any_hashid()),
        prop::option::of(any::<u64>()),
        ".{0,12}",
    )
        .prop_map(
            |(code, operation, target, namespace, hashid, seq, message)| Error {
                code,
                operation,
                target: target.map(TargetId),
                namespace,
                hashid,
                seq: seq.map(Seq),
                message,
            },
        )
}

fn any_outcome() -> impl Strategy<Value = TargetOutcome> {
    prop_oneof![
        Just(TargetOutcome::Ok),
        any_failure().prop_map(|failure| TargetOutcome::Failed { failure }),
        Just(TargetOutcome::Lost),
        Just(TargetOutcome::TimedOut),
        Just(TargetOutcome::Fenced),
        Just(TargetOutcome::RolledBack),
        any_failure().prop_map(|failure| TargetOutcome::CleanupUnconfirmed { failure }),
    ]
}

/// A consistent registry snapshot: handles in id order, digests counted
/// from them, live targets only when started.
fn any_registry() -> impl Strategy<Value = RegistrySnapshot> {
    (
        prop::sample::select(vec![Lifecycle::New, Lifecycle::Started, Lifecycle::Closed]),
        prop::collection::btree_set(any::<u16>(), 0..4),
        prop::collection::btree_map(any::<u64>(), (any_namespace(), 0usize..3), 0..5),
        prop::collection::vec(any_hashid(), 3),
        prop::collection::btree_set(any_hashid(), 0..3),
        any::<u64>(),
    )
        .prop_map(|(lifecycle, live, handles, pool, uncertain, owner)| {
            let handles: Vec<Handle> = handles
                .into_iter()
                .map(|(handle_id, (namespace, which))| Handle {
                    namespace,
                    hashid: pool[which],
                    handle_id,
                    owner: OwnerToken(owner),
                })
                .collect();
            RegistrySnapshot {
                lifecycle,
                live_targets: if lifecycle == Lifecycle::Started {
                    live.into_iter().map(TargetId).collect()
                } else {
                    Vec::new()
                },
                digests: RegistrySnapshot::count_digests(&handles),
                handles,
                uncertain: uncertain.into_iter().collect(),
            }
        })
}

fn any_target_snapshot() -> impl Strategy<Value = TargetSnapshot> {
    (
        any::<u16>(),
        prop::collection::btree_map(any_hashid(), 1u32.., 0..4),
    )
        .prop_map(|(target, installed)| TargetSnapshot {
            target: TargetId(target),
            installed: installed
                .into_iter()
                .map(|(hashid, refcount)| InstalledDigest { hashid, refcount })
                .collect(),
        })
}

proptest! {
    #[test]
    fn handle_round_trips(h in any_handle()) {
        prop_assert_eq!(Handle::from_json(&h.to_json()), Ok(h));
        prop_assert_eq!(Handle::from_json(&h.to_json_pretty()), Ok(h));
    }

    #[test]
    fn failure_round_trips(f in any_failure()) {
        prop_assert_eq!(Failure::from_json(&f.to_json()), Ok(f));
    }

    #[test]
    fn error_round_trips(e in any_error()) {
        prop_assert_eq!(Error::from_json(&e.to_json()), Ok(e.clone()));
        prop_assert_eq!(Error::from_json(&e.to_json_pretty()), Ok(e));
    }

    #[test]
    fn outcome_round_trips(target in any::<u16>(), outcome in any_outcome()) {
        let entry = TargetOutcomeEntry { target: TargetId(target), outcome: outcome.clone() };
        prop_assert_eq!(TargetOutcomeEntry::from_json(&entry.to_json()), Ok(entry));
        prop_assert_eq!(TargetOutcome::from_json(&outcome.to_json()), Ok(outcome));
    }

    #[test]
    fn registry_snapshot_round_trips(s in any_registry()) {
        prop_assert_eq!(RegistrySnapshot::from_json(&s.to_json()), Ok(s.clone()));
        prop_assert_eq!(RegistrySnapshot::from_json(&s.to_json_pretty()), Ok(s));
    }

    #[test]
    fn target_snapshot_round_trips(s in any_target_snapshot()) {
        prop_assert_eq!(TargetSnapshot::from_json(&s.to_json()), Ok(s.clone()));
        prop_assert_eq!(TargetSnapshot::from_json(&s.to_json_pretty()), Ok(s));
    }
}

/// A completion's handle serializes through the handle's form.
#[test]
fn completion_carries_the_handle_form() {
    let json = serde_json::to_string(&Completion::Registered(handle())).unwrap();
    assert_eq!(
        json,
        format!(
            r#"{{"completion":"registered","handle":{}}}"#,
            handle().to_json()
        )
    );
}
