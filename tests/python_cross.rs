//! Cross-language check against Python (specs/design.md §3.1, §3.2): `python3`
//! cloudpickles fresh callables (a lambda, a closure, a callable object and
//! a closure over ~1 MiB of data), builds each envelope, descriptor and
//! hashid with `struct`/`hashlib` straight from the format description, and
//! callreg (library, `callreg pack` and `callreg hashid`) must agree byte
//! for byte.
//!
//! Needs `python3` with `cloudpickle` on PATH (or the interpreter named by
//! `CALLREG_PYTHON`) and `--features cli`. Without them the test fails,
//! unless `CALLREG_ALLOW_NO_PYTHON=1` is set, in which case it passes
//! after saying it checked nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

use callreg::descriptor::{python_serialized_digest, PythonSerialized};
use callreg::envelope::{encode, Envelope};
use serde::Deserialize;

/// Pickles the callables and writes `<name>.pickle` (payload) and
/// `<name>.spyc` (envelope) into the directory given as argv[1]; prints one
/// JSON line per callable with what Python computed.
const PYTHON: &str = r#"
import hashlib, json, os, struct, sys
import cloudpickle

out = sys.argv[1]

class Scale:
    def __init__(self, k):
        self.k = k
    def __call__(self, x):
        return self.k * x

def make_closure(offset):
    def add_offset(x):
        return x + offset
    return add_offset

def make_big():
    blob = bytes(range(256)) * 4096  # 1 MiB captured by the closure
    def big(x):
        return x + len(blob)
    return big

callables = {
    "lambda": lambda x: x * x,
    "closure": make_closure(41),
    "callable_object": Scale(3),
    "big_closure": make_big(),
}

for name, fn in callables.items():
    payload = cloudpickle.dumps(fn)
    # SPYC header: magic, version 1, serializer 1 (cloudpickle), flags 0, u64 size.
    envelope = struct.pack("<4sBBHQ", b"SPYC", 1, 1, 0, len(payload)) + payload
    # PYTHON_SERIALIZED descriptor: schema 1, kind 2, version, serializer, bytes(sha256).
    descriptor = struct.pack("<IIIII", 1, 2, 1, 1, 32) + hashlib.sha256(payload).digest()
    hashid = "sha256:" + hashlib.sha256(descriptor).hexdigest()
    with open(os.path.join(out, name + ".pickle"), "wb") as f:
        f.write(payload)
    with open(os.path.join(out, name + ".spyc"), "wb") as f:
        f.write(envelope)
    print(json.dumps({"name": name, "payload_size": len(payload),
                      "descriptor_hex": descriptor.hex(), "hashid": hashid}))
"#;

#[derive(Debug, Deserialize)]
struct PythonResult {
    name: String,
    payload_size: u64,
    descriptor_hex: String,
    hashid: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn python() -> String {
    std::env::var("CALLREG_PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

/// True when the interpreter runs and imports cloudpickle; otherwise fails
/// the test unless `CALLREG_ALLOW_NO_PYTHON=1`.
fn python_available() -> bool {
    let probe = Command::new(python())
        .args(["-c", "import cloudpickle"])
        .output();
    let ok = matches!(&probe, Ok(o) if o.status.success());
    if ok {
        return true;
    }
    let why = match probe {
        Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_owned(),
        Err(e) => e.to_string(),
    };
    if std::env::var("CALLREG_ALLOW_NO_PYTHON").as_deref() == Ok("1") {
        eprintln!("python3 with cloudpickle unavailable ({why}); CALLREG_ALLOW_NO_PYTHON=1, checking nothing");
        return false;
    }
    panic!(
        "python3 with cloudpickle is required ({why}); install it (pip install cloudpickle) \
         or set CALLREG_ALLOW_NO_PYTHON=1"
    );
}

fn scratch() -> PathBuf {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("python-cross-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn callreg_agrees_with_python_byte_for_byte() {
    if !python_available() {
        return;
    }
    let dir = scratch();
    let out = Command::new(python())
        .args(["-c", PYTHON, dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results: Vec<PythonResult> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let names: Vec<&str> = results.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        ["lambda", "closure", "callable_object", "big_closure"]
    );

    for r in &results {
        let payload = std::fs::read(dir.join(format!("{}.pickle", r.name))).unwrap();
        let python_envelope = std::fs::read(dir.join(format!("{}.spyc", r.name))).unwrap();
        assert_eq!(payload.len() as u64, r.payload_size, "{}", r.name);
        if r.name == "big_closure" {
            assert!(
                payload.len() > 1 << 20,
                "big closure is {} bytes",
                payload.len()
            );
        }

        // Library: encoder, parser, descriptor and hashid.
        assert!(
            encode(&payload) == python_envelope,
            "{}: envelope bytes",
            r.name
        );
        let env = Envelope::parse(&python_envelope).unwrap();
        assert!(env.payload() == &payload[..], "{}: payload view", r.name);
        let desc = PythonSerialized::from_envelope(&env);
        assert_eq!(hex(&desc.to_bytes()), r.descriptor_hex, "{}", r.name);
        assert_eq!(
            python_serialized_digest(&env).to_string(),
            r.hashid,
            "{}",
            r.name
        );

        // Command: pack reproduces Python's envelope, hashid prints Python's hashid.
        let packed = dir.join(format!("{}.packed.spyc", r.name));
        let status = Command::new(env!("CARGO_BIN_EXE_callreg"))
            .arg("pack")
            .arg("--payload")
            .arg(dir.join(format!("{}.pickle", r.name)))
            .arg("-o")
            .arg(&packed)
            .status()
            .unwrap();
        assert_eq!(status.code(), Some(0), "{}", r.name);
        assert!(
            std::fs::read(&packed).unwrap() == python_envelope,
            "{}: packed bytes",
            r.name
        );
        let hashid = Command::new(env!("CARGO_BIN_EXE_callreg"))
            .arg("hashid")
            .arg(dir.join(format!("{}.spyc", r.name)))
            .output()
            .unwrap();
        assert_eq!(hashid.status.code(), Some(0), "{}", r.name);
        assert_eq!(
            String::from_utf8(hashid.stdout).unwrap(),
            format!("{}\n", r.hashid)
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
