//! JSON forms of callable metadata and descriptors
//! (`specs/metadata.md`): golden files byte for byte, round trips by
//! proptest, strict rejection naming the field, executor rehydration and
//! the `retval_keyword` merge. Pure: no Python, no fork.
//!
//! Golden files live in `tests/golden/`; `CALLREG_BLESS=1 cargo test --test
//! metadata_json` rewrites them from the values below (review the diff).

use std::path::PathBuf;

use callreg::descriptor::{
    ChipCallable, Descriptor, Digest, Direction, HashId, PythonImport, PythonSerialized,
};
use callreg::error::ErrorCode;
use callreg::json::JsonError;
use callreg::metadata::{
    merge_retval_keyword, BashDeps, CallableMetadata, Deps, ExecutorData, ExecutorSpec, HookCall,
    MergeError, PipDeps, PythonVersions, RehydrateError,
};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

const HOOK_BEFORE: &str = "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1";
const HOOK_AFTER: &str = "sha256:6086292cb02d057e8b0de3739e65ba81b361f93368d5ebc4d4fc21865dbee107";

fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

/// Compares `text` + newline with the golden file byte for byte (or
/// rewrites it under `CALLREG_BLESS=1`), and returns the file's text.
fn check_golden(name: &str, text: &str) -> String {
    let path = golden_path(name);
    let expected = format!("{text}\n");
    if std::env::var("CALLREG_BLESS").as_deref() == Ok("1") {
        std::fs::write(&path, &expected).unwrap();
    }
    let stored =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(stored, expected, "golden file {name} differs");
    stored
}

fn full_metadata() -> CallableMetadata {
    let mut attributes = Map::new();
    attributes.insert("capture_output".into(), Value::Bool(true));
    CallableMetadata {
        name: "add".into(),
        python: Some(PythonVersions::new("3.11.7", "cloudpickle", "2.1.0")),
        executor: Some("python".into()),
        executor_data: Some(ExecutorData {
            type_name: "PythonExecutor".into(),
            short_name: "python".into(),
            attributes,
        }),
        deps: Deps {
            pip: PipDeps {
                packages: vec!["cloudpickle>=2".into()],
            },
            bash: BashDeps {
                commands: vec!["true".into()],
            },
        },
        call_before: vec![HookCall {
            hashid: HOOK_BEFORE.parse().unwrap(),
            args: vec![],
            kwargs: Map::new(),
            retval_keyword: Some("config".into()),
        }],
        call_after: vec![HookCall::new(HOOK_AFTER.parse().unwrap())],
    }
}

#[test]
fn metadata_golden_files() {
    let full = full_metadata();
    let text = check_golden("metadata_full.json", &full.to_json_pretty());
    assert_eq!(CallableMetadata::from_json(&text), Ok(full.clone()));
    assert_eq!(CallableMetadata::from_json(&full.to_json()), Ok(full));

    let minimal = CallableMetadata::named("add");
    let text = check_golden("metadata_minimal.json", &minimal.to_json_pretty());
    assert_eq!(CallableMetadata::from_json(&text), Ok(minimal.clone()));
    // Every key but `name` may be omitted.
    assert_eq!(
        CallableMetadata::from_json(r#"{"name": "add"}"#),
        Ok(minimal)
    );
}

/// The issue's example, verbatim apart from real hashids, parses.
#[test]
fn the_issue_example_parses() {
    let text = format!(
        r#"{{"name": "add",
 "python": {{"version": "3.11.7", "serializer": "cloudpickle", "serializer_version": "2.1.0"}},
 "executor": "python",
 "executor_data": {{"type": "PythonExecutor", "short_name": "python", "attributes": {{"capture_output": true}}}},
 "deps": {{"pip": {{"packages": ["cloudpickle>=2"]}}, "bash": {{"commands": ["true"]}}}},
 "call_before": [{{"hashid": "{HOOK_BEFORE}", "args": [], "kwargs": {{}}, "retval_keyword": "config"}}],
 "call_after": [{{"hashid": "{HOOK_AFTER}", "args": [], "kwargs": {{}}}}]}}"#
    );
    assert_eq!(CallableMetadata::from_json(&text), Ok(full_metadata()));
}

fn descriptor_cases() -> Vec<(&'static str, Descriptor, &'static str, &'static str)> {
    vec![
        (
            "descriptor_python_serialized.json",
            Descriptor::PythonSerialized(PythonSerialized {
                payload_format_version: 1,
                serializer_id: 1,
                payload_sha256: Digest::sha256(&[0x80, 0x05, 0x4e, 0x2e]),
            }),
            "0100000002000000010000000100000020000000\
             6c09635decb8153d3c12e3782a69fd2eb097426f912547d351a8647b27d5580a",
            "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1",
        ),
        (
            "descriptor_python_import.json",
            Descriptor::PythonImport(PythonImport::new("pkg.mod", "Class.method").unwrap()),
            "010000000300000007000000706b672e6d6f640c000000436c6173732e6d6574686f64",
            "sha256:6086292cb02d057e8b0de3739e65ba81b361f93368d5ebc4d4fc21865dbee107",
        ),
        (
            "descriptor_chip_callable.json",
            Descriptor::ChipCallable(ChipCallable {
                target_arch: "arch".into(),
                platform: "plat".into(),
                runtime: "rt".into(),
                blob_sha256: Digest::sha256(b"blob"),
                signature: vec![Direction::In, Direction::Out, Direction::Scalar],
            }),
            "0100000001000000040000006172636804000000706c617402000000727420000000\
             fa2c8cc4f28176bbeed4b736df569a34c79cd3723e9ec42f9674b4d46ac6b8b8\
             20000000\
             79503f00edda36b2de80e680ae737197d02a01a92f89be2ddc3819d3667eca92",
            "sha256:f2f0ecc11b4065db0305c15790d1da17d191bb4ee1456848c3b471724d0deeda",
        ),
    ]
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The JSON form read back gives the same canonical bytes and digest as
/// the binary descriptor (the vectors of `src/descriptor.rs`).
#[test]
fn descriptor_golden_files_give_the_binary_bytes_and_digest() {
    for (file, descriptor, bytes, hashid) in descriptor_cases() {
        let text = check_golden(file, &descriptor.to_json_pretty());
        let parsed = Descriptor::from_json(&text).unwrap();
        assert_eq!(parsed, descriptor, "{file}");
        assert_eq!(hex(&parsed.to_bytes().unwrap()), bytes, "{file}");
        assert_eq!(parsed.digest().unwrap().to_string(), hashid, "{file}");
    }
    assert_eq!(
        descriptor_cases()[0].1.to_json(),
        r#"{"descriptor_schema_version":1,"callable_kind":"PYTHON_SERIALIZED","payload_format_version":1,"serializer_id":"CLOUDPICKLE","payload_sha256":"6c09635decb8153d3c12e3782a69fd2eb097426f912547d351a8647b27d5580a"}"#
    );
    // A serializer id without a name is written as its number.
    let other = Descriptor::PythonSerialized(PythonSerialized {
        payload_format_version: 1,
        serializer_id: 7,
        payload_sha256: Digest([0; 32]),
    });
    assert!(other.to_json().contains(r#""serializer_id":7,"#));
    assert_eq!(Descriptor::from_json(&other.to_json()), Ok(other));
}

#[test]
fn descriptor_json_rejects_each_fault_naming_the_field() {
    let sha = "6c09635decb8153d3c12e3782a69fd2eb097426f912547d351a8647b27d5580a";
    let serialized = |extra: &str| {
        format!(
            r#"{{"descriptor_schema_version": 1, "callable_kind": "PYTHON_SERIALIZED", "payload_format_version": 1, "serializer_id": "CLOUDPICKLE", "payload_sha256": "{sha}"{extra}}}"#
        )
    };
    let err = |text: &str| Descriptor::from_json(text).unwrap_err();
    assert!(Descriptor::from_json(&serialized("")).is_ok());
    let unknown = err(&serialized(r#", "colour": 1"#));
    assert_eq!(unknown.path, "colour");
    assert!(
        unknown.message.starts_with("unknown field `colour`"),
        "{unknown}"
    );
    assert_eq!(
        err(&serialized(r#", "module": "m""#)),
        JsonError::at(
            ".",
            "field `module` does not belong to callable_kind PYTHON_SERIALIZED"
        )
    );
    assert_eq!(
        err(&serialized("").replace(
            r#""payload_format_version": 1"#,
            r#""payload_format_version": "1""#
        )),
        JsonError::at(
            "payload_format_version",
            "invalid type: string \"1\", expected u8"
        )
    );
    assert_eq!(
        err(&serialized("").replace("CLOUDPICKLE", "DILL")),
        JsonError::at(
            "serializer_id",
            "invalid value: string \"DILL\", expected \"CLOUDPICKLE\" or a serializer id 0-255"
        )
    );
    assert_eq!(
        err(&serialized("").replace(sha, &format!("sha256:{sha}"))).path,
        "payload_sha256"
    );
    assert_eq!(
        err(&serialized("").replace(
            r#""descriptor_schema_version": 1"#,
            r#""descriptor_schema_version": 2"#
        )),
        JsonError::at(".", "descriptor_schema_version must be 1, got 2")
    );
    assert_eq!(
        err(r#"{"descriptor_schema_version": 1, "callable_kind": "PYTHON_IMPORT", "module": "m"}"#),
        JsonError::at(
            ".",
            "missing field `qualname` (required by callable_kind PYTHON_IMPORT)"
        )
    );
    assert_eq!(
        err(
            r#"{"descriptor_schema_version": 1, "callable_kind": "PYTHON_IMPORT", "module": ".m", "qualname": "f"}"#
        ),
        JsonError::at(
            ".",
            "DESCRIPTOR_INVALID: module \".m\" is relative; it must be absolute"
        )
    );
    assert_eq!(
        err(r#"{"descriptor_schema_version": 1, "callable_kind": "LAMBDA"}"#).path,
        "callable_kind"
    );
}

#[test]
fn metadata_rejects_each_fault_naming_the_field() {
    let err = |text: &str| CallableMetadata::from_json(text).unwrap_err();
    assert_eq!(
        err(r#"{"name": "f", "deps": {"pip": {"packages": ["ok", 3]}}}"#),
        JsonError::at(
            "deps.pip.packages[1]",
            "invalid type: integer `3`, expected a string"
        )
    );
    let unknown = err(r#"{"name": "f", "deps": {"conda": {}}}"#);
    assert_eq!(
        (unknown.path.as_str(), unknown.message.as_str()),
        (
            "deps.conda",
            "unknown field `conda`, expected `pip` or `bash`"
        )
    );
    assert_eq!(
        err(r#"{"deps": {}}"#),
        JsonError::at(".", "missing field `name`")
    );
    assert_eq!(
        err(r#"{"name": ""}"#),
        JsonError::at("name", "must not be empty")
    );
    assert_eq!(
        err(
            r#"{"name": "f", "python": {"version": "three", "serializer": "cloudpickle", "serializer_version": "2"}}"#
        ),
        JsonError::at(
            "python.version",
            "\"three\" is not a Python version MAJOR.MINOR[.MICRO]"
        )
    );
    assert_eq!(
        err(
            r#"{"name": "f", "python": {"version": "3.11", "serializer": "cloudpickle", "serializer_version": "x"}}"#
        ),
        JsonError::at(
            "python.serializer_version",
            "\"x\" does not start with a major version number"
        )
    );
    assert_eq!(
        err(
            r#"{"name": "f", "executor": "dask", "executor_data": {"type": "T", "short_name": "python"}}"#
        ),
        JsonError::at(
            "executor_data.short_name",
            "\"python\" differs from executor \"dask\"; they must name the same executor"
        )
    );
    assert_eq!(
        err(
            r#"{"name": "f", "executor_data": {"type": "T", "short_name": "python", "attributes": []}}"#
        ),
        JsonError::at(
            "executor_data.attributes",
            "invalid type: sequence, expected a map"
        )
    );
    let bad_hashid = err(r#"{"name": "f", "call_before": [{"hashid": "sha256:00"}]}"#);
    assert_eq!(bad_hashid.path, "call_before[0].hashid");
    assert!(
        bad_hashid.message.contains("HASHID_FORMAT_INVALID"),
        "{bad_hashid}"
    );
    assert_eq!(
        err(&format!(
            r#"{{"name": "f", "call_before": [{{"hashid": "{HOOK_BEFORE}", "retval_keyword": "not ok"}}]}}"#
        )),
        JsonError::at(
            "call_before[0].retval_keyword",
            "\"not ok\" is not a Python identifier"
        )
    );
    assert_eq!(
        err(&format!(
            r#"{{"name": "f", "call_after": [{{"hashid": "{HOOK_AFTER}", "retval_keyword": "x"}}]}}"#
        )),
        JsonError::at(
            "call_after[0].retval_keyword",
            "only call_before hooks may pass their result to the task"
        )
    );
    assert_eq!(
        err(r#"{"name": "f", "deps": {"bash": {"commands": [" "]}}}"#),
        JsonError::at("deps.bash.commands[0]", "must not be blank")
    );
    // A block of the wrong JSON type says what it must be, in JSON's
    // terms (never a Rust type's name).
    for (text, path, message) in [
        (
            r#"{"name": "f", "deps": {"pip": 5}}"#,
            "deps.pip",
            r#"invalid type: integer `5`, expected an object {"packages": [requirement strings]}"#,
        ),
        (
            r#"{"name": "f", "deps": {"bash": "ls"}}"#,
            "deps.bash",
            r#"invalid type: string "ls", expected an object {"commands": [command strings]}"#,
        ),
        (
            r#"{"name": "f", "deps": 1}"#,
            "deps",
            r#"invalid type: integer `1`, expected an object {"pip": {...}, "bash": {...}}"#,
        ),
        (
            r#"{"name": "f", "python": "3.11"}"#,
            "python",
            r#"invalid type: string "3.11", expected an object {"version", "serializer", "serializer_version"} of strings"#,
        ),
        (
            r#"{"name": "f", "executor_data": 1}"#,
            "executor_data",
            r#"invalid type: integer `1`, expected an object {"type", "short_name", "attributes"}"#,
        ),
        (
            r#"{"name": "f", "call_after": [7]}"#,
            "call_after[0]",
            r#"invalid type: integer `7`, expected an object {"hashid", "args", "kwargs", "retval_keyword"}"#,
        ),
        (
            r#"{"name": "f", "call_before": [{"hashid": 1}], "deps": 1}"#,
            "call_before[0].hashid",
            "invalid type: integer `1`, expected a string",
        ),
        // A list where an object belongs is refused, not read field by
        // field (serde's derive alone would read `["numpy>=1"]` as
        // `{"packages": "numpy>=1"}` and then complain about a string).
        (
            r#"{"name": "f", "deps": {"pip": ["numpy>=1"]}}"#,
            "deps.pip",
            r#"invalid type: sequence, expected an object {"packages": [requirement strings]}"#,
        ),
        (
            r#"{"name": "f", "deps": {"pip": [["numpy>=1"]]}}"#,
            "deps.pip",
            r#"invalid type: sequence, expected an object {"packages": [requirement strings]}"#,
        ),
        (
            r#"{"name": "f", "deps": []}"#,
            "deps",
            r#"invalid type: sequence, expected an object {"pip": {...}, "bash": {...}}"#,
        ),
        (
            r#"{"name": "f", "python": ["3.11", "cloudpickle", "3.1"]}"#,
            "python",
            r#"invalid type: sequence, expected an object {"version", "serializer", "serializer_version"} of strings"#,
        ),
        (
            r#"{"name": "f", "call_before": {"hashid": "x"}}"#,
            "call_before",
            r#"invalid type: map, expected a list, each element an object {"hashid", "args", "kwargs", "retval_keyword"}"#,
        ),
        (
            r#"{"name": "f", "call_after": [["sha256:00"]]}"#,
            "call_after[0]",
            r#"invalid type: sequence, expected an object {"hashid", "args", "kwargs", "retval_keyword"}"#,
        ),
    ] {
        assert_eq!(err(text), JsonError::at(path, message), "{text}");
    }
    // Each part has its own strict from_json.
    assert_eq!(
        PipDeps::from_json(r#"{"packages": [""]}"#),
        Err(JsonError::at("packages[0]", "must not be blank"))
    );
    assert_eq!(
        HookCall::from_json(&format!(
            r#"{{"hashid": "{HOOK_AFTER}", "args": [1], "kwargs": {{"k": 2}}}}"#
        ))
        .map(|h| h.task_input()),
        Ok(br#"{"args":[1],"kwargs":{"k":2}}"#.to_vec())
    );
}

#[test]
fn hook_hashids_and_sidecar_path() {
    let hashids: Vec<String> = full_metadata()
        .hook_hashids()
        .map(|h| h.to_string())
        .collect();
    assert_eq!(hashids, vec![HOOK_BEFORE.to_owned(), HOOK_AFTER.to_owned()]);
    assert_eq!(
        callreg::metadata::sidecar_path(std::path::Path::new("out/add.spyc")),
        PathBuf::from("out/add.spyc.json")
    );
}

#[test]
fn executor_short_name_defaults() {
    let mut metadata = CallableMetadata::named("f");
    assert_eq!(metadata.executor_short_name(), "python");
    metadata.executor_data = Some(ExecutorData {
        type_name: "DaskExecutor".into(),
        short_name: "dask".into(),
        attributes: Map::new(),
    });
    assert_eq!(metadata.executor_short_name(), "dask");
    metadata.executor = Some("dask".into());
    assert_eq!(metadata.executor_short_name(), "dask");
}

#[test]
fn rehydration_lays_a_deep_copy_of_the_attributes_over_the_defaults() {
    let mut defaults = Map::new();
    defaults.insert("capture_output".into(), json!(false));
    defaults.insert("options".into(), json!({"a": 1, "b": 2}));
    defaults.insert("anything".into(), Value::Null);
    let spec = ExecutorSpec::new("python", "PythonExecutor", defaults.clone());
    assert_eq!(spec.rehydrate(None), Ok(defaults));
    let data = |attributes: Value| ExecutorData {
        type_name: "PythonExecutor".into(),
        short_name: "python".into(),
        attributes: attributes.as_object().unwrap().clone(),
    };
    let mut given = data(json!({"options": {"a": 9}, "anything": [1]}));
    let rehydrated = spec.rehydrate(Some(&given)).unwrap();
    // Whole values replace defaults; the copy does not alias the metadata.
    given
        .attributes
        .insert("options".into(), json!({"changed": true}));
    assert_eq!(
        Value::Object(rehydrated),
        json!({"capture_output": false, "options": {"a": 9}, "anything": [1]})
    );
    let unknown = spec
        .rehydrate(Some(&data(json!({"colour": "red"}))))
        .unwrap_err();
    assert_eq!(
        unknown,
        RehydrateError::AttributeUnknown {
            short_name: "python".into(),
            attribute: "colour".into(),
            known: "anything, capture_output, options".into(),
        }
    );
    assert_eq!(unknown.code(), ErrorCode::EXECUTOR_UNKNOWN);
    let wrong = spec
        .rehydrate(Some(&data(json!({"capture_output": "yes"}))))
        .unwrap_err();
    assert_eq!(
        wrong.to_string(),
        "executor \"python\" attribute \"capture_output\" must be a boolean, got a string"
    );
    assert_eq!(wrong.code(), ErrorCode::METADATA_INVALID);
    let mut other_type = data(json!({}));
    other_type.type_name = "DaskExecutor".into();
    assert_eq!(
        spec.rehydrate(Some(&other_type)).unwrap_err().code(),
        ErrorCode::EXECUTOR_UNKNOWN
    );
}

#[test]
fn retval_keyword_merges_into_the_task_input() {
    assert_eq!(
        merge_retval_keyword(
            br#"{"args": [1], "kwargs": {"a": 2}}"#,
            "config",
            br#"{"k": [3]}"#
        ),
        Ok(br#"{"args":[1],"kwargs":{"a":2,"config":{"k":[3]}}}"#.to_vec())
    );
    assert_eq!(
        merge_retval_keyword(br#"{"args": [1]}"#, "config", b"null"),
        Ok(br#"{"args":[1],"kwargs":{"config":null}}"#.to_vec())
    );
    assert_eq!(
        merge_retval_keyword(br#"{"kwargs": {"config": 1}}"#, "config", b"2"),
        Err(MergeError::KeywordTaken("config".into()))
    );
    assert_eq!(
        merge_retval_keyword(b"[1]", "config", b"2"),
        Err(MergeError::InputInvalid("got an array".into()))
    );
    assert_eq!(
        merge_retval_keyword(br#"{"kwargs": 3}"#, "config", b"2"),
        Err(MergeError::InputInvalid(
            "\"kwargs\" is not an object".into()
        ))
    );
    assert!(matches!(
        merge_retval_keyword(b"{}", "config", b"{"),
        Err(MergeError::ResultInvalid(_))
    ));
}

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        ".{0,8}".prop_map(Value::String),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    json_leaf().prop_recursive(2, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(".{0,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn json_map() -> impl Strategy<Value = Map<String, Value>> {
    prop::collection::btree_map("[a-z_]{1,8}", json_value(), 0..4)
        .prop_map(|m| m.into_iter().collect())
}

fn hashid() -> impl Strategy<Value = HashId> {
    any::<[u8; 32]>().prop_map(|b| HashId(Digest(b)))
}

fn hook(keyword: bool) -> impl Strategy<Value = HookCall> {
    (
        hashid(),
        prop::collection::vec(json_value(), 0..3),
        json_map(),
        prop::option::of("[a-z_][a-z0-9_]{0,8}").prop_map(move |k| k.filter(|_| keyword)),
    )
        .prop_map(|(hashid, args, kwargs, retval_keyword)| HookCall {
            hashid,
            args,
            kwargs,
            retval_keyword,
        })
}

fn metadata() -> impl Strategy<Value = CallableMetadata> {
    let python = prop::option::of(
        (
            0u32..4,
            0u32..20,
            ".{0,6}",
            "[a-z]{1,8}",
            0u32..5,
            "[0-9.a-z]{0,6}",
        )
            .prop_map(|(major, minor, rest, serializer, smajor, srest)| {
                PythonVersions::new(
                    &format!(
                        "{major}.{minor}{}",
                        if rest.is_empty() {
                            String::new()
                        } else {
                            format!(".{rest}")
                        }
                    ),
                    &serializer,
                    &format!("{smajor}{srest}"),
                )
            }),
    );
    let executor = prop::option::of((
        "[a-z]{1,8}",
        prop::option::of(("[A-Za-z]{1,12}", json_map())),
    ));
    (
        ".{1,12}",
        python,
        executor,
        prop::collection::vec("[a-z]{1,5}(>=[0-9]\\.[0-9])?", 0..3),
        prop::collection::vec("[a-z ]{0,5}[a-z]", 0..3),
        prop::collection::vec(hook(true), 0..3),
        prop::collection::vec(hook(false), 0..3),
    )
        .prop_map(
            |(name, python, executor, packages, commands, call_before, call_after)| {
                let (executor, executor_data) = match executor {
                    None => (None, None),
                    Some((short, None)) => (Some(short), None),
                    Some((short, Some((type_name, attributes)))) => (
                        Some(short.clone()),
                        Some(ExecutorData {
                            type_name,
                            short_name: short,
                            attributes,
                        }),
                    ),
                };
                CallableMetadata {
                    name,
                    python,
                    executor,
                    executor_data,
                    deps: Deps {
                        pip: PipDeps { packages },
                        bash: BashDeps { commands },
                    },
                    call_before,
                    call_after,
                }
            },
        )
}

fn descriptor() -> impl Strategy<Value = Descriptor> {
    prop_oneof![
        (any::<u8>(), any::<u8>(), any::<[u8; 32]>()).prop_map(|(v, s, d)| {
            Descriptor::PythonSerialized(PythonSerialized {
                payload_format_version: v,
                serializer_id: s,
                payload_sha256: Digest(d),
            })
        }),
        (
            "[a-z_][a-z0-9_]{0,5}(\\.[a-z_][a-z0-9_]{0,5}){0,2}",
            "[A-Za-z_][A-Za-z0-9_]{0,5}(\\.[a-z_]{1,5}){0,2}"
        )
            .prop_map(|(m, q)| Descriptor::PythonImport(PythonImport::new(&m, &q).unwrap())),
        (
            ".{0,8}",
            ".{0,8}",
            ".{0,8}",
            any::<[u8; 32]>(),
            prop::collection::vec(0u8..4, 0..5)
        )
            .prop_map(|(target_arch, platform, runtime, blob, signature)| {
                Descriptor::ChipCallable(ChipCallable {
                    target_arch,
                    platform,
                    runtime,
                    blob_sha256: Digest(blob),
                    signature: signature
                        .into_iter()
                        .map(|d| match d {
                            0 => Direction::Scalar,
                            1 => Direction::In,
                            2 => Direction::Out,
                            _ => Direction::InOut,
                        })
                        .collect(),
                })
            }),
    ]
}

proptest! {
    #[test]
    fn metadata_round_trips(m in metadata()) {
        prop_assert_eq!(CallableMetadata::from_json(&m.to_json()), Ok(m.clone()));
        prop_assert_eq!(CallableMetadata::from_json(&m.to_json_pretty()), Ok(m));
    }

    #[test]
    fn descriptor_round_trips_with_the_same_bytes(d in descriptor()) {
        let back = Descriptor::from_json(&d.to_json());
        prop_assert_eq!(back.as_ref(), Ok(&d));
        prop_assert_eq!(back.unwrap().to_bytes().unwrap(), d.to_bytes().unwrap());
    }
}
