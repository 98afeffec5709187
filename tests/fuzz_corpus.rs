//! Replays the committed cargo-fuzz corpus (`fuzz/corpus/<target>/`) on
//! stable through the same oracles the fuzz targets call
//! (`callreg::fuzzing`), so a regression found by fuzzing stays fixed.
//! Crash inputs added under `fuzz/corpus/` are replayed here too.

mod common;

use std::path::{Path, PathBuf};

use callreg::envelope::Envelope;

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut entries: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let path = e.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&path).unwrap())
        })
        .collect();
    entries.sort();
    entries
}

#[test]
fn envelope_corpus_replays() {
    let entries = corpus("envelope");
    for (_, data) in &entries {
        callreg::fuzzing::envelope(data);
    }
    // Every shared vector seeds the corpus, and keeps its expected outcome.
    let vectors = common::load_vectors();
    for v in &vectors {
        let stem = Path::new(&v.file).file_stem().unwrap().to_string_lossy();
        let (_, data) = entries
            .iter()
            .find(|(name, _)| *name == stem)
            .unwrap_or_else(|| panic!("seed {stem} missing from fuzz/corpus/envelope"));
        let expected = std::fs::read(common::vectors_dir().join(&v.file)).unwrap();
        assert!(*data == expected, "seed {stem} differs from the vector");
        assert_eq!(Envelope::parse(data).is_ok(), v.valid, "{stem}");
    }
}

#[test]
fn hashid_corpus_replays() {
    let entries = corpus("hashid");
    assert!(entries.len() >= 9, "hashid seeds missing");
    for (_, data) in &entries {
        callreg::fuzzing::hashid(data);
    }
    let (_, known) = entries
        .iter()
        .find(|(name, _)| name == "known_serialized")
        .expect("known_serialized seed");
    assert_eq!(
        std::str::from_utf8(known)
            .unwrap()
            .parse::<callreg::descriptor::HashId>()
            .unwrap()
            .to_string(),
        "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1"
    );
}
