//! The formats alone, with no IO and no Python: a SPYC envelope and its
//! checks, descriptors, digests and hashids, a wire frame, and callable
//! metadata as JSON (`specs/formats.md`, `specs/wire.md`,
//! `specs/metadata.md`).
//!
//! Run: `cargo run --example formats` (default features).

use callreg::descriptor::{python_serialized_digest, Descriptor, HashId, PythonImport};
use callreg::envelope::{encode, Envelope, EnvelopeError};
use callreg::metadata::CallableMetadata;
use callreg::wire::{decode, Decoded, Frame, TaskEncoding, DEFAULT_MAX_FRAME_BYTES};

fn main() {
    // An envelope: a 16-byte header, then the serializer payload (here the
    // known-vector payload `pickle.dumps(None)`, 80 05 4e 2e).
    let staged = encode(&[0x80, 0x05, 0x4e, 0x2e]);
    let hex: String = staged.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, "5350594301010000040000000000000080054e2e");
    let envelope = Envelope::parse(&staged).expect("a valid envelope");
    assert_eq!(
        (
            envelope.version(),
            envelope.serializer(),
            envelope.payload_size()
        ),
        (1, 1, 4)
    );

    // Its identity: the SHA-256 of its 52-byte PYTHON_SERIALIZED descriptor.
    let digest = python_serialized_digest(&envelope);
    let hashid = digest.hashid();
    assert_eq!(
        hashid.to_string(),
        "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1"
    );
    println!("envelope {hex}\n  hashid {hashid}");

    // Trailing bytes (a page-rounded staged region) are ignored; the checks
    // run in order and the first failure is reported.
    let mut page = staged.clone();
    page.resize(4096, 0);
    assert_eq!(
        python_serialized_digest(&Envelope::parse(&page).unwrap()),
        digest
    );
    let mut bad = staged.clone();
    bad[4] = 2;
    let error = Envelope::parse(&bad).unwrap_err();
    assert_eq!(error, EnvelopeError::UnsupportedVersion { found: 2 });
    println!("version 2: {error}");

    // Hashid text is strict: exactly `sha256:` and 64 lowercase hex digits.
    assert_eq!(hashid.to_string().parse::<HashId>(), Ok(hashid));
    let spaced = format!(" {hashid}");
    let refused = spaced.parse::<HashId>().unwrap_err();
    println!("{spaced:?}: {refused}");

    // An importable callable has its own descriptor kind.
    let import = Descriptor::PythonImport(PythonImport::new("pkg.mod", "Class.method").unwrap());
    assert_eq!(
        import.digest().unwrap().hashid().to_string(),
        "sha256:6086292cb02d057e8b0de3739e65ba81b361f93368d5ebc4d4fc21865dbee107"
    );
    println!("descriptor as JSON: {}", import.to_json());

    // A task frame as it travels over a pipe, and back.
    let frame = Frame::Task {
        seq: 7,
        digest,
        encoding: TaskEncoding::Json,
        input: br#"{"args": [2, 3]}"#.to_vec(),
    };
    let bytes = frame
        .encode(DEFAULT_MAX_FRAME_BYTES)
        .expect("fits in a frame");
    assert_eq!(
        decode(&bytes[..5], DEFAULT_MAX_FRAME_BYTES),
        Ok(Decoded::Incomplete(8))
    );
    assert_eq!(
        decode(&bytes, DEFAULT_MAX_FRAME_BYTES),
        Ok(Decoded::Frame(frame, bytes.len()))
    );
    println!("task frame: {} bytes", bytes.len());

    // Callable metadata travels as JSON beside the envelope (not part of
    // the hashid); decoding is strict and names the offending field.
    let metadata = CallableMetadata::from_json(
        r#"{"name": "add", "python": {"version": "3.11.7", "serializer": "cloudpickle", "serializer_version": "3.1.1"}}"#,
    )
    .expect("valid metadata");
    assert_eq!(metadata.executor_short_name(), "python");
    let error = CallableMetadata::from_json(r#"{"name": "add", "color": "red"}"#).unwrap_err();
    println!("metadata {}\n  unknown key: {error}", metadata.to_json());
}
