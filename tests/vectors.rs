//! Every entry of the SPYC vectors (`tests/data/spyc/vectors.json`)
//! through the library: valid entries give the exact payload size, payload sha256, descriptor bytes and hashid;
//! invalid ones the exact `EnvelopeError` variant (specs/design.md §3).

mod common;

use callreg::descriptor::{python_serialized_digest, HashId, PythonSerialized};
use callreg::envelope::{encode, Envelope};
use common::{hex, load_vectors, vectors_dir};

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

/// The directory holds exactly `vectors.json` and the files it names: no
/// vector file is left untested and none is missing.
#[test]
fn directory_holds_exactly_the_listed_files() {
    let mut listed: Vec<String> = load_vectors().into_iter().map(|v| v.file).collect();
    listed.push("vectors.json".to_owned());
    listed.sort();
    let mut present: Vec<String> = std::fs::read_dir(vectors_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    present.sort();
    assert_eq!(present, listed);
    assert_eq!(present.len(), 18);
}
