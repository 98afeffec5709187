//! Replays the committed wire fuzz corpus (`fuzz/corpus/wire/`) on stable
//! through the oracle the `wire` fuzz target calls (`callreg::fuzzing::wire`),
//! and checks that each named seed decodes to the kind of frame it is named
//! after.

use std::path::PathBuf;

use callreg::metadata::CallableMetadata;
use callreg::wire::{decode, Decoded, Frame, FrameKind, WireError};

fn seed(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus/wire")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn wire_corpus_replays() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/wire");
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        callreg::fuzzing::wire(&std::fs::read(entry.unwrap().path()).unwrap());
        count += 1;
    }
    assert!(count >= 16, "wire seeds missing: {count}");
}

#[test]
fn named_seeds_decode_to_their_kind() {
    let cases = [
        ("register", FrameKind::Register),
        ("register_without_metadata", FrameKind::Register),
        ("unregister", FrameKind::Unregister),
        ("task", FrameKind::Task),
        ("cancel", FrameKind::Cancel),
        ("verify", FrameKind::Verify),
        ("inspect", FrameKind::Inspect),
        ("alive", FrameKind::Alive),
        ("start_failed", FrameKind::StartFailed),
        ("started", FrameKind::Started),
        ("reply_ok", FrameKind::Reply),
        ("reply_err", FrameKind::Reply),
        ("task_result_ok", FrameKind::TaskResult),
        ("task_result_err", FrameKind::TaskResult),
        ("ready", FrameKind::Ready),
        ("table", FrameKind::Table),
    ];
    for (name, kind) in cases {
        let bytes = seed(name);
        match decode(&bytes, 4096) {
            Ok(Decoded::Frame(frame, used)) => {
                assert_eq!(frame.kind(), kind, "{name}");
                assert_eq!(used, bytes.len(), "{name}");
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    assert_eq!(
        decode(&seed("oversized_header"), 4096),
        Err(WireError::TooLarge {
            size: 8 + u64::from(u32::MAX),
            max: 4096
        })
    );
}

#[test]
fn register_seeds_carry_metadata_json_or_none() {
    let metadata = |name: &str| match decode(&seed(name), 4096) {
        Ok(Decoded::Frame(Frame::Register { metadata, .. }, _)) => metadata,
        other => panic!("{name}: {other:?}"),
    };
    let carried = metadata("register");
    let mut expected = CallableMetadata::named("add");
    expected.executor = Some("python".to_owned());
    assert_eq!(CallableMetadata::from_json(&carried).unwrap(), expected);
    // The seed holds exactly what a parent writes (`to_json`).
    assert_eq!(expected.to_json(), carried);
    assert_eq!(metadata("register_without_metadata"), "");
}
