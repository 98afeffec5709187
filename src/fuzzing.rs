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

/// Wire frame oracle (specs/design.md §3.3), with a 4096-byte maximum so that
/// oversized headers are common: decoding never panics and never asks for
/// more than the maximum; an accepted frame re-encodes to exactly the bytes
/// it used (the encoding is canonical); feeding the bytes one at a time to
/// a `FrameBuffer` gives the same first outcome.
pub fn wire(data: &[u8]) {
    use crate::wire::{decode, Decoded, FrameBuffer};
    const MAX: usize = 4096;
    let whole = decode(data, MAX);
    match &whole {
        Ok(Decoded::Frame(frame, used)) => {
            assert!(*used <= data.len() && *used <= MAX);
            assert_eq!(frame.encode(MAX).as_deref(), Ok(&data[..*used]));
        }
        Ok(Decoded::Incomplete(needed)) => assert!(*needed > data.len() && *needed <= MAX),
        Err(_) => {}
    }
    let mut buffer = FrameBuffer::new(MAX).expect("MAX is above the minimum");
    let mut first = None;
    for byte in data {
        buffer.extend(std::slice::from_ref(byte));
        match buffer.next_frame() {
            Ok(None) => continue,
            outcome => {
                first = Some(outcome);
                break;
            }
        }
    }
    match (whole, first) {
        (Ok(Decoded::Frame(frame, _)), Some(Ok(Some(got)))) => assert_eq!(frame, got),
        (Err(err), Some(Err(got))) => assert_eq!(err, got),
        (Ok(Decoded::Incomplete(_)), None) => {}
        (expected, got) => panic!("decode gave {expected:?}, the buffer gave {got:?}"),
    }
}
