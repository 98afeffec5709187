//! Shared helpers of the integration tests: the SPYC test vectors, and the
//! in-memory driver of the protocol state machines (`sim`).

#![allow(dead_code)] // Each test crate uses a different subset.

pub mod sim;

use std::path::PathBuf;

use serde::Deserialize;

/// `tests/data/spyc`: the SPYC test vectors.
pub fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/spyc")
}

/// `vectors.json`.
#[derive(Debug, Deserialize)]
pub struct VectorFile {
    pub vectors: Vec<Vector>,
}

/// One entry of `vectors.json`: the expected values of a valid envelope, or
/// the expected error variant of an invalid one.
#[derive(Debug, Deserialize)]
pub struct Vector {
    pub name: String,
    pub file: String,
    pub valid: bool,
    pub staged_size: usize,
    pub payload_size: Option<u64>,
    pub payload_sha256: Option<String>,
    pub descriptor_hex: Option<String>,
    pub hashid: Option<String>,
    pub error: Option<String>,
}

/// All vectors of the in-repository copy.
pub fn load_vectors() -> Vec<Vector> {
    let path = vectors_dir().join("vectors.json");
    let text = std::fs::read_to_string(&path).expect("tests/data/spyc/vectors.json is readable");
    let file: VectorFile = serde_json::from_str(&text).expect("vectors.json parses");
    assert!(file.vectors.len() >= 17, "vectors.json lost entries");
    file.vectors
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
