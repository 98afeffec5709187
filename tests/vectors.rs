//! Every entry of the shared SPYC vectors (`tests/data/spyc/vectors.json`,
//! a copy of `../shared/vectors/spyc`) through the library: valid entries
//! give the exact payload size, payload sha256, descriptor bytes and hashid;
//! invalid ones the exact `EnvelopeError` variant (DESIGN.md §3).

mod common;

use callreg::descriptor::{python_serialized_digest, HashId, PythonSerialized};
use callreg::envelope::{encode, Envelope};
use common::{hex, load_vectors, shared_vectors_dir, vectors_dir};

#[test]
fn every_vector_matches() {
    let vectors = load_vectors();
    let mut valid = 0;
    let mut invalid = 0;
    for v in &vectors {
        let staged = std::fs::read(vectors_dir().join(&v.file)).unwrap();
        assert_eq!(staged.len(), v.staged_size, "{}: staged size", v.name);
        let parsed = Envelope::parse(&staged);
        if v.valid {
            valid += 1;
            let env = parsed.unwrap_or_else(|e| panic!("{}: {e}", v.name));
            assert_eq!(Some(env.payload_size()), v.payload_size, "{}", v.name);
            assert_eq!(env.staged_size(), v.staged_size, "{}", v.name);
            let desc = PythonSerialized::from_envelope(&env);
            assert_eq!(
                Some(desc.payload_sha256.to_hex()),
                v.payload_sha256,
                "{}",
                v.name
            );
            assert_eq!(Some(hex(&desc.to_bytes())), v.descriptor_hex, "{}", v.name);
            let hashid = python_serialized_digest(&env).hashid();
            assert_eq!(Some(hashid.to_string()), v.hashid, "{}", v.name);
            // The expected hashid text is itself a strict hashid.
            let parsed_id: HashId = v.hashid.as_deref().unwrap().parse().unwrap();
            assert_eq!(parsed_id, hashid, "{}", v.name);
            // Re-encoding the payload reproduces the envelope minus slack.
            assert_eq!(
                encode(env.payload()),
                &staged[..env.encoded_len()],
                "{}",
                v.name
            );
        } else {
            invalid += 1;
            let err = parsed.expect_err(&v.name);
            assert_eq!(Some(err.variant_name()), v.error.as_deref(), "{}", v.name);
        }
    }
    assert_eq!((valid, invalid), (9, 8));
}

/// The in-repository copy equals `../shared/vectors/spyc` file for file
/// when that directory exists (it does next to the integration checkout).
#[test]
fn copy_equals_shared_vectors() {
    let shared = shared_vectors_dir();
    if !shared.is_dir() {
        eprintln!("{} not present; comparing nothing", shared.display());
        return;
    }
    let mut names: Vec<_> = std::fs::read_dir(&shared)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    let mut ours: Vec<_> = std::fs::read_dir(vectors_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    ours.sort();
    assert_eq!(names, ours);
    for name in &names {
        let a = std::fs::read(shared.join(name)).unwrap();
        let b = std::fs::read(vectors_dir().join(name)).unwrap();
        assert!(a == b, "{name:?} differs from the shared copy");
    }
}
