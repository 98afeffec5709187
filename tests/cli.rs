//! The `callreg` binary on the vectors: `inspect --json` output, the table,
//! exit statuses (0 valid, 1 invalid or unreadable, 2 usage error) and the
//! `--help` that lists them, stdin, `hashid`, `pack` (refusing an envelope,
//! the side-car) and a `pack` → `inspect` round trip.
//! Needs `--features cli` (declared in Cargo.toml).

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{load_vectors, vectors_dir};
use serde_json::Value;

fn callreg() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_callreg"));
    c.current_dir(vectors_dir());
    c
}

fn run(args: &[&str]) -> Output {
    callreg().args(args).output().expect("callreg runs")
}

fn run_stdin(args: &[&str], input: &[u8]) -> Output {
    let mut child = callreg()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("callreg runs");
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("utf-8 output")
}

/// A fresh scratch directory under cargo's per-test-target temp dir.
fn scratch(name: &str) -> PathBuf {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The object's keys in output order (`serde_json::Value` sorts them).
fn key_order(line: &str) -> Vec<String> {
    let obj: Value = serde_json::from_str(line).unwrap();
    let mut keys: Vec<(usize, String)> = obj
        .as_object()
        .unwrap()
        .keys()
        .map(|k| (line.find(&format!("\"{k}\":")).unwrap(), k.clone()))
        .collect();
    keys.sort();
    keys.into_iter().map(|(_, k)| k).collect()
}

#[test]
fn inspect_json_agrees_with_every_vector() {
    let vectors = load_vectors();
    let files: Vec<&str> = vectors.iter().map(|v| v.file.as_str()).collect();
    let mut args = vec!["inspect", "--json"];
    args.extend(&files);
    let out = run(&args);
    assert_eq!(out.status.code(), Some(1), "some vectors are invalid");
    assert_eq!(text(&out.stderr), "");
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), vectors.len());
    for (v, line) in vectors.iter().zip(lines) {
        let obj: Value = serde_json::from_str(line).unwrap();
        let keys = key_order(line);
        if v.valid {
            let expected = serde_json::json!({
                "file": v.file,
                "valid": true,
                "version": 1,
                "serializer": 1,
                "payload_size": v.payload_size.unwrap(),
                "staged_size": v.staged_size,
                "payload_sha256": v.payload_sha256.as_deref().unwrap(),
                "descriptor_hex": v.descriptor_hex.as_deref().unwrap(),
                "hashid": v.hashid.as_deref().unwrap(),
            });
            assert_eq!(obj, expected, "{}", v.name);
            // Key order is part of the output format.
            assert_eq!(
                keys,
                [
                    "file",
                    "valid",
                    "version",
                    "serializer",
                    "payload_size",
                    "staged_size",
                    "payload_sha256",
                    "descriptor_hex",
                    "hashid"
                ]
            );
        } else {
            assert_eq!(keys, ["file", "valid", "error", "message"], "{}", v.name);
            assert_eq!(obj["file"], v.file.as_str());
            assert_eq!(obj["valid"], false);
            assert_eq!(obj["error"], v.error.as_deref().unwrap(), "{}", v.name);
            let message = obj["message"].as_str().unwrap();
            assert!(message.starts_with("ENVELOPE_INVALID: "), "{message}");
        }
    }
}

#[test]
fn exit_status_zero_when_all_valid() {
    let out = run(&["inspect", "--json", "func_add.spyc", "empty_payload.spyc"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(text(&out.stdout).lines().count(), 2);
}

#[test]
fn exit_status_one_for_one_invalid_file() {
    let out = run(&["inspect", "bad_flags.spyc"]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("NonZeroFlags: ENVELOPE_INVALID: non-zero flags 0x0001 (must be 0)"),
        "{stdout}"
    );
}

#[test]
fn missing_file_gets_a_row_and_exit_one() {
    let out = run(&["inspect", "--json", "no_such.spyc", "func_add.spyc"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "callreg: cannot read no_such.spyc: No such file or directory\n"
    );
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert_eq!(
        lines[0],
        r#"{"file":"no_such.spyc","valid":false,"error":"ReadError","message":"cannot read no_such.spyc: No such file or directory"}"#
    );
    // The readable file is still reported.
    let line: Value = serde_json::from_str(lines[1]).unwrap();
    assert_eq!(line["file"], "func_add.spyc");
    assert_eq!(line["valid"], true);

    // The table has its row; a directory is unreadable too.
    let out = run(&["inspect", "no_such.spyc", "."]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stdout),
        "FILE          VALID       PAYLOAD        STAGED  HASHID / ERROR\n\
         no_such.spyc  no                -             -  ReadError: cannot read no_such.spyc: No such file or directory\n\
         .             no                -             -  ReadError: cannot read .: not a regular file (a directory)\n"
    );
    // A missing and a malformed envelope: the same status.
    assert_eq!(run(&["inspect", "bad_magic.spyc"]).status.code(), Some(1));
}

#[test]
fn every_help_lists_the_exit_statuses() {
    let help = |args: &[&str]| {
        let out = run(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        text(&out.stdout)
    };
    assert!(help(&["--help"]).contains(
        "Exit status (every command; `callreg COMMAND --help` says what each means there):\n  0  success\n"
    ));
    assert!(help(&["inspect", "--help"]).contains(
        "Exit status:\n  0  every file is a valid envelope (and every side-car valid metadata)\n  \
         1  a file is not a valid envelope, cannot be read, or has an invalid side-car\n  \
         2  usage error, or stdout cannot be written\n"
    ));
    assert!(help(&["hashid", "--help"]).contains(
        "Exit status:\n  0  the hashid was printed\n  1  the file is not a valid envelope or cannot be read\n"
    ));
    assert!(help(&["pack", "--help"])
        .contains("Exit status:\n  0  the envelope (and side-car) were written\n  2  usage error"));
    let run_help = help(&["run", "--help"]);
    assert!(run_help.contains("specs/plan.md"), "{run_help}");
    assert!(
        run_help.contains("Exit status:\n  0  every step met its expectation\n  1  a step failed"),
        "{run_help}"
    );
    // What the help points to exists.
    assert!(Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("specs/plan.md")
        .is_file());
}

#[test]
fn usage_errors_exit_two() {
    for args in [
        &["inspect"][..],
        &["inspect", "--bogus", "func_add.spyc"],
        &["frobnicate"],
        &[],
        &["hashid"],
        &["pack", "--payload", "x"],
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = text(&out.stderr);
        assert!(stderr.contains("Usage:"), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    assert_eq!(run(&["--help"]).status.code(), Some(0));
}

#[test]
fn inspect_reads_stdin() {
    let bytes = std::fs::read(vectors_dir().join("func_add.spyc")).unwrap();
    let out = run_stdin(&["inspect", "--json", "-"], &bytes);
    assert_eq!(out.status.code(), Some(0));
    let line: Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(line["file"], "-");
    assert_eq!(
        line["hashid"],
        "sha256:51961bef7b98dd7bc6de342d7fb2cb25df63852e6b42345034c18386d1b74b07"
    );
}

#[test]
fn table_lists_each_file() {
    let out = run(&["inspect", "func_add_page_slack.spyc", "short_header.spyc"]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3);
    assert!(lines[0].starts_with("FILE"));
    let valid: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(
        valid,
        [
            "func_add_page_slack.spyc",
            "yes",
            "459",
            "4096",
            "sha256:51961bef7b98dd7bc6de342d7fb2cb25df63852e6b42345034c18386d1b74b07"
        ]
    );
    assert!(lines[2].starts_with("short_header.spyc"));
    assert!(
        lines[2].contains("HeaderTruncated: ENVELOPE_INVALID: header truncated: 15 staged bytes")
    );
}

#[test]
fn hashid_prints_only_the_hashid() {
    for v in load_vectors() {
        let out = run(&["hashid", &v.file]);
        if v.valid {
            assert_eq!(out.status.code(), Some(0), "{}", v.name);
            assert_eq!(text(&out.stdout), format!("{}\n", v.hashid.unwrap()));
        } else {
            assert_eq!(out.status.code(), Some(1), "{}", v.name);
            assert_eq!(text(&out.stdout), "");
            assert!(
                text(&out.stderr).contains(&format!("({})", v.error.unwrap())),
                "{}",
                v.name
            );
        }
    }
    // Unreadable like invalid: status 1.
    let missing = run(&["hashid", "no_such.spyc"]);
    assert_eq!(missing.status.code(), Some(1));
    assert_eq!(
        text(&missing.stderr),
        "callreg: cannot read no_such.spyc: No such file or directory\n"
    );
}

#[test]
fn pack_then_inspect_round_trips() {
    let dir = scratch("pack");
    let raw = dir.join("known.pickle");
    std::fs::write(&raw, [0x80, 0x05, 0x4e, 0x2e]).unwrap();
    let packed = dir.join("known.spyc");
    let out = run(&[
        "pack",
        "--payload",
        raw.to_str().unwrap(),
        "-o",
        packed.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1\n"
    );
    assert_eq!(
        common::hex(&std::fs::read(&packed).unwrap()),
        "5350594301010000040000000000000080054e2e"
    );
    assert!(
        !dir.join("known.spyc.json").exists(),
        "no side-car unless asked"
    );
    let out = run(&["inspect", "--json", packed.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0));
    let line: Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(
        line["hashid"],
        "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1"
    );
    assert_eq!(line["payload_size"], 4);

    // A real cloudpickle payload from a vector, through stdin and stdout.
    let staged = std::fs::read(vectors_dir().join("lambda_square.spyc")).unwrap();
    let out = run_stdin(&["pack", "--payload", "-", "-o", "-"], &staged[16..]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(out.stdout, staged);
    // stdout holds the envelope: the hashid goes to stderr.
    assert_eq!(
        text(&out.stderr),
        "sha256:ce0e9ac2d18b555e6e62cd6e874927b71c258737e673e30b32f8657fe9d6112a\n"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pack_reports_unwritable_output() {
    let out = run_stdin(
        &["pack", "--payload", "-", "-o", "no_such_dir/out.spyc"],
        &[0x80, 0x05, 0x4e, 0x2e],
    );
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "callreg: cannot write no_such_dir/out.spyc: No such file or directory\n"
    );
}

#[test]
fn pack_refuses_an_empty_payload() {
    let out = run_stdin(&["pack", "--payload", "-", "-o", "-"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(text(&out.stdout), "");
    assert_eq!(
        text(&out.stderr),
        "callreg: <stdin> is empty: there is no payload to wrap (a serializer's output is never empty)\n"
    );
}

#[test]
fn pack_refuses_an_envelope_unless_forced() {
    let dir = scratch("pack-envelope");
    let out_path = dir.join("twice.spyc");
    let out_arg = out_path.to_str().unwrap();
    let out = run(&["pack", "--payload", "func_add.spyc", "-o", out_arg]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "callreg: func_add.spyc already is a SPYC envelope \
         (sha256:51961bef7b98dd7bc6de342d7fb2cb25df63852e6b42345034c18386d1b74b07), not raw \
         serializer bytes; wrapping it again would hide the callable inside a second envelope \
         (use --force to do it anyway)\n"
    );
    assert!(!out_path.exists());
    // A malformed envelope is refused too (it is no pickle either).
    let out = run(&["pack", "--payload", "bad_flags.spyc", "-o", out_arg]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains(
        "bad_flags.spyc already is the start of a SPYC envelope (NonZeroFlags), not raw serializer bytes"
    ));
    // --force wraps it.
    let out = run(&[
        "pack",
        "--force",
        "--payload",
        "func_add.spyc",
        "-o",
        out_arg,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let inner = std::fs::read(vectors_dir().join("func_add.spyc")).unwrap();
    let twice = std::fs::read(&out_path).unwrap();
    assert_eq!(&twice[16..], inner.as_slice());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pack_writes_the_side_car_with_given_versions() {
    let dir = scratch("pack-sidecar");
    let out_path = dir.join("square.spyc");
    let staged = std::fs::read(vectors_dir().join("lambda_square.spyc")).unwrap();
    let out = run_stdin(
        &[
            "pack",
            "--payload",
            "-",
            "-o",
            out_path.to_str().unwrap(),
            "--sidecar",
            "--python-version",
            "3.11.7",
            "--cloudpickle-version",
            "2.1.0",
        ],
        &staged[16..],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "sha256:ce0e9ac2d18b555e6e62cd6e874927b71c258737e673e30b32f8657fe9d6112a\n"
    );
    let sidecar = std::fs::read_to_string(dir.join("square.spyc.json")).unwrap();
    let value: Value = serde_json::from_str(&sidecar).unwrap();
    assert_eq!(
        value,
        serde_json::json!({
            "name": "square",
            "python": {"version": "3.11.7", "serializer": "cloudpickle", "serializer_version": "2.1.0"},
            "executor": "python",
            "deps": {"pip": {"packages": []}, "bash": {"commands": []}},
            "call_before": [],
            "call_after": []
        })
    );
    // inspect reads it back as the envelope's metadata.
    let out = run(&["inspect", "--json", out_path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0));
    let report: Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(report["metadata"], value);

    // Bad versions, no output file, options without --sidecar: refused.
    let out = run_stdin(
        &[
            "pack",
            "--payload",
            "-",
            "-o",
            out_path.to_str().unwrap(),
            "--sidecar",
            "--python-version",
            "three",
            "--cloudpickle-version",
            "2.1.0",
        ],
        &staged[16..],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr)
            .starts_with("callreg: the side-car would not be valid metadata: at python.version: "),
        "{}",
        text(&out.stderr)
    );
    let out = run_stdin(
        &["pack", "--payload", "-", "-o", "-", "--sidecar"],
        &staged[16..],
    );
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "callreg: --sidecar needs an output file (-o OUT.spyc), not stdout\n"
    );
    let out = run(&[
        "pack",
        "--payload",
        "-",
        "-o",
        "x.spyc",
        "--python-version",
        "3.11.7",
    ]);
    assert_eq!(out.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pack_detects_the_versions_by_running_the_interpreter() {
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let versions = Command::new(&python)
        .args(["-c", "import platform, cloudpickle; print(platform.python_version(), cloudpickle.__version__)"])
        .output()
        .expect("the interpreter runs");
    assert!(
        versions.status.success(),
        "{python} with cloudpickle is required"
    );
    let versions = text(&versions.stdout);
    let (python_version, cloudpickle_version) = versions.trim().split_once(' ').unwrap();
    let dir = scratch("pack-detect");
    let out_path = dir.join("f.spyc");
    let out = run_stdin(
        &[
            "pack",
            "--payload",
            "-",
            "-o",
            out_path.to_str().unwrap(),
            "--sidecar",
            "--name",
            "doubled",
            "--python",
            &python,
        ],
        &[0x80, 0x05, 0x4e, 0x2e],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let value: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("f.spyc.json")).unwrap()).unwrap();
    assert_eq!(value["name"], "doubled");
    assert_eq!(
        value["python"],
        serde_json::json!({"version": python_version, "serializer": "cloudpickle", "serializer_version": cloudpickle_version})
    );
    // A given version wins over the detected one.
    let out = run_stdin(
        &[
            "pack",
            "--payload",
            "-",
            "-o",
            out_path.to_str().unwrap(),
            "--sidecar",
            "--python",
            &python,
            "--cloudpickle-version",
            "9.9.9",
        ],
        &[0x80, 0x05, 0x4e, 0x2e],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let value: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("f.spyc.json")).unwrap()).unwrap();
    assert_eq!(value["name"], "f");
    assert_eq!(value["python"]["version"], python_version);
    assert_eq!(value["python"]["serializer_version"], "9.9.9");
    // An interpreter that cannot be run.
    let out = run_stdin(
        &[
            "pack",
            "--payload",
            "-",
            "-o",
            out_path.to_str().unwrap(),
            "--sidecar",
            "--python",
            "/no/such/python",
        ],
        &[0x80, 0x05, 0x4e, 0x2e],
    );
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        "callreg: cannot run /no/such/python to detect the versions: No such file or directory \
         (give --python-version and --cloudpickle-version)\n"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `inspect` shows the side-car `FILE.json` next to an envelope: its
/// metadata in `--json` (the JSON form), a line in the table; an invalid
/// side-car is reported with the field's path and exit status 1.
#[test]
fn inspect_shows_the_metadata_side_car() {
    let dir = scratch("sidecar");
    let envelope = dir.join("func_add.spyc");
    std::fs::copy(vectors_dir().join("func_add.spyc"), &envelope).unwrap();
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/metadata_full.json");
    let sidecar = dir.join("func_add.spyc.json");
    std::fs::copy(&golden, &sidecar).unwrap();
    let file = envelope.to_str().unwrap();

    let out = run(&["inspect", "--json", file]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let line = text(&out.stdout);
    let report: Value = serde_json::from_str(line.trim()).unwrap();
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(&golden).unwrap()).unwrap();
    assert_eq!(report["metadata"], expected);
    assert_eq!(
        key_order(line.trim()).last().map(String::as_str),
        Some("metadata")
    );

    let out = run(&["inspect", file]);
    assert_eq!(out.status.code(), Some(0));
    let table = text(&out.stdout);
    assert_eq!(
        table.lines().nth(2),
        Some(
            "  metadata: name \"add\", executor python, python 3.11.7 (cloudpickle 2.1.0), \
             pip [cloudpickle>=2], bash 1, hooks 1 before / 1 after"
        ),
        "{table}"
    );

    std::fs::write(
        &sidecar,
        r#"{"name": "add", "deps": {"pip": {"packages": [1]}}}"#,
    )
    .unwrap();
    let out = run(&["inspect", "--json", file]);
    assert_eq!(out.status.code(), Some(1));
    let report: Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(report["valid"], true);
    assert_eq!(
        report["metadata_error"],
        format!(
            "{}: at deps.pip.packages[0]: invalid type: integer `1`, expected a string",
            sidecar.display()
        )
    );
    assert_eq!(report.get("metadata"), None);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The side-cars the Python tool writes are valid metadata, in exactly the
/// layout `CallableMetadata::to_json_pretty` produces, and `inspect` shows
/// them. Needs the interpreter of `PYO3_PYTHON` (else `python3`) with
/// cloudpickle, unless `CALLREG_ALLOW_NO_PYTHON=1`.
#[test]
fn python_side_cars_are_valid_metadata() {
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = scratch("python-sidecar");
    let packed = Command::new(&python)
        .arg(root.join("python/tools/callreg_envelope.py"))
        .arg(root.join("examples/callables.py"))
        .arg("--out")
        .arg(&dir)
        .output();
    let packed = match packed {
        Ok(output) if output.status.success() => output,
        other => {
            assert!(
                std::env::var("CALLREG_ALLOW_NO_PYTHON").as_deref() == Ok("1"),
                "{python} with cloudpickle is required: {other:?}"
            );
            return;
        }
    };
    assert!(!packed.stdout.is_empty());
    let sidecar = std::fs::read_to_string(dir.join("add.spyc.json")).unwrap();
    let metadata = callreg::metadata::CallableMetadata::from_json(&sidecar).unwrap();
    assert_eq!(metadata.name, "add");
    assert_eq!(metadata.executor_short_name(), "python");
    assert_eq!(
        metadata.python.as_ref().map(|p| p.serializer.as_str()),
        Some("cloudpickle")
    );
    assert_eq!(format!("{}\n", metadata.to_json_pretty()), sidecar);
    let version = Command::new(&python)
        .args(["-c", "import platform; print(platform.python_version())"])
        .output()
        .unwrap();
    assert_eq!(
        metadata.python.as_ref().map(|p| p.version.clone()),
        Some(text(&version.stdout).trim().to_owned())
    );
    let out = run(&["inspect", "--json", dir.join("add.spyc").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0));
    let report: Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(report["metadata"]["name"], "add");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A side-car that is a directory, cut short, or not an object: one
/// message each, naming the document (`.`), with no raw `(os error N)`.
#[test]
fn inspect_names_what_is_wrong_with_a_side_car() {
    let dir = scratch("sidecar-kinds");
    let envelope = dir.join("func_add.spyc");
    std::fs::copy(vectors_dir().join("func_add.spyc"), &envelope).unwrap();
    let sidecar = dir.join("func_add.spyc.json");
    let file = envelope.to_str().unwrap();
    let error = || {
        let out = run(&["inspect", "--json", file]);
        assert_eq!(out.status.code(), Some(1));
        let report: Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
        report["metadata_error"].as_str().unwrap().to_owned()
    };

    std::fs::create_dir(&sidecar).unwrap();
    assert_eq!(
        error(),
        format!(
            "cannot read {}: not a regular file (a directory)",
            sidecar.display()
        )
    );
    std::fs::remove_dir(&sidecar).unwrap();

    std::fs::write(&sidecar, r#"{"name": "add""#).unwrap();
    assert_eq!(
        error(),
        format!(
            "{}: at .: EOF while parsing an object at line 1 column 14",
            sidecar.display()
        )
    );
    std::fs::write(&sidecar, "[]").unwrap();
    assert_eq!(
        error(),
        format!(
            "{}: at .: expected a JSON object, got an array",
            sidecar.display()
        )
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `inspect` reads no more than the header declares: a device such as
/// `/dev/zero` is refused unread, a stream with a bad header is a bad
/// magic, a stream stops after the declared payload, and a regular file's
/// staged size is its length.
#[test]
fn inspect_reads_at_most_what_the_header_declares() {
    let out = run(&["inspect", "--json", "/dev/zero"]);
    assert_eq!(out.status.code(), Some(1));
    let report: Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(report["error"], "ReadError");
    assert_eq!(
        report["message"],
        "cannot read /dev/zero: not a regular file (a character device)"
    );
    let out = run_stdin(&["inspect", "--json", "-"], &[0; 4096]);
    assert_eq!(out.status.code(), Some(1));
    let report: Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(report["error"], "BadMagic");

    let envelope = callreg::envelope::encode(b"payload");
    let mut streamed = envelope.clone();
    streamed.extend_from_slice(&[0; 4096]);
    let out = run_stdin(&["inspect", "--json", "-"], &streamed);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report: Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(report["payload_size"], 7);
    assert_eq!(report["staged_size"], 23);

    let dir = scratch("bounded-read");
    let file = dir.join("slack.spyc");
    std::fs::write(&file, &streamed).unwrap();
    let out = run(&["inspect", "--json", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0));
    let report: Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(report["staged_size"], 23 + 4096);
    std::fs::remove_dir_all(&dir).unwrap();
}
