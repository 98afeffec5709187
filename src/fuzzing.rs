//! Entry points shared by the cargo-fuzz targets in `fuzz/` and by the
//! stable corpus replay test (`tests/fuzz_corpus.rs`), so both exercise the
//! same oracle. Not part of the public API.
//!
//! Each function takes arbitrary bytes and panics only when an invariant of
//! the formats is broken (that panic is the finding the fuzzer reports).

use crate::descriptor::{python_serialized_digest, HashId, PythonImport};
use crate::envelope::{encode, Envelope, HEADER_LEN};

/// Envelope oracle: parsing never panics; a parsed envelope's payload lies
/// inside the staged bytes; re-encoding the payload parses back to the same
/// fields and digest.
pub fn envelope(data: &[u8]) {
    let Ok(env) = Envelope::parse(data) else {
        return;
    };
    assert!(env.encoded_len() <= data.len());
    assert_eq!(env.payload(), &data[HEADER_LEN..env.encoded_len()]);
    let digest = python_serialized_digest(&env);
    let again = encode(env.payload());
    assert_eq!(&again[..], &data[..env.encoded_len()]);
    let reparsed = Envelope::parse(&again).expect("re-encoded envelope parses");
    assert_eq!(reparsed.payload(), env.payload());
    assert_eq!(python_serialized_digest(&reparsed), digest);
}

/// Hashid oracle: parsing arbitrary text never panics, and an accepted
/// hashid prints back to exactly the same text (the form is canonical).
/// The same holds for `module:qualname` import paths.
pub fn hashid(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(h) = text.parse::<HashId>() {
        assert_eq!(h.to_string(), text);
    }
    if let Ok(p) = text.parse::<PythonImport>() {
        assert_eq!(p.to_string(), text);
    }
}
