//! `callreg run` end to end: the binary runs `examples/plan.json` on real
//! Python targets with every expectation met (exit 0), a plan with a wrong
//! expectation exits 1, and a malformed plan exits 2 with a one-line error
//! (and a JSON line with `--json`); mistakes of one kind (a missing or a
//! malformed envelope, a second unregister or kill) fail their step alike,
//! and `--json` gives each failed step's code in its own field.
//!
//! Needs `--features cli,python` (declared in Cargo.toml) and cloudpickle
//! for the interpreter named by `PYO3_PYTHON` (else `python3`). These
//! tests do not fork: they spawn the binary, which is single-threaded when
//! it forks its targets, so the default test harness is fine. Envelopes
//! are packed into a temporary directory, never into the source tree.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A fresh temporary directory for one test, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(test: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("callreg-cli-run-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Packs `examples/callables.py` into `DIR/payloads` (the layout
/// `examples/plan.json` expects beside it).
fn pack_examples(dir: &Path) {
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let output = Command::new(python)
        .arg(repo().join("python/tools/callreg_envelope.py"))
        .arg(repo().join("examples/callables.py"))
        .arg("--out")
        .arg(dir.join("payloads"))
        .output()
        .expect("python runs");
    assert!(
        output.status.success(),
        "packing failed (is cloudpickle installed for PYO3_PYTHON?): {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

fn callreg(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_callreg"))
        .arg("run")
        .args(args)
        .output()
        .expect("callreg runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("UTF-8 output")
}

/// The example plan copied next to freshly packed payloads.
fn example_plan(dir: &TempDir) -> PathBuf {
    pack_examples(&dir.0);
    let plan = dir.0.join("plan.json");
    std::fs::copy(repo().join("examples/plan.json"), &plan).expect("copy the plan");
    plan
}

#[test]
fn the_example_plan_meets_every_expectation() {
    let dir = TempDir::new("example-json");
    let plan = example_plan(&dir);
    let steps = serde_json::from_str::<Value>(&std::fs::read_to_string(&plan).unwrap()).unwrap()
        ["steps"]
        .as_array()
        .unwrap()
        .len();
    let output = callreg(&[plan.as_os_str(), "--json".as_ref()]);
    let stdout = text(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{stdout}{}",
        text(&output.stderr)
    );
    assert_eq!(text(&output.stderr), "");
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), steps + 1);
    for (index, line) in lines[..steps].iter().enumerate() {
        assert_eq!(line["step"], index, "{line}");
        assert_eq!(line["ok"], true, "{line}");
        assert!(line["micros"].is_u64(), "{line}");
    }
    assert_eq!(lines[steps]["summary"]["failed"], 0, "{}", lines[steps]);
    assert_eq!(lines[steps]["summary"]["ok"], steps);
    // The killed target is replaced before the next step: the
    // replacement serves the callables registered before the kill, and a
    // register after it reaches every target.
    let kill = lines
        .iter()
        .find(|l| l["op"] == "kill_target")
        .expect("the kill");
    assert_eq!(
        kill["targets"],
        serde_json::json!([{"target": 3, "outcome": "killed",
            "detail": "it was killed by signal 9", "replacement": "replaced by incarnation 1"}]),
        "{kill}"
    );
    assert_eq!(
        kill["target_events"][0],
        serde_json::json!({"event": "lost", "target": 3, "incarnation": 0,
            "cause": "its reply socket closed; it was killed by signal 9"})
    );
    assert_eq!(
        kill["target_events"][2],
        serde_json::json!({"event": "joined", "target": 3, "incarnation": 1})
    );
    let after_kill = lines
        .iter()
        .find(|l| l["name"] == "add_after_kill" && l["op"] == "register")
        .expect("the register after the kill");
    assert_eq!(
        after_kill["targets"],
        serde_json::json!([
            {"target": 0, "outcome": "ok"},
            {"target": 1, "outcome": "ok"},
            {"target": 2, "outcome": "ok"},
            {"target": 3, "outcome": "ok"}
        ])
    );
    // Same envelope under two names: two handles, one hashid.
    let hashid = |name: &str| {
        lines
            .iter()
            .find(|l| l["name"] == name && l["op"] == "register")
            .map(|l| l["hashid"].clone())
    };
    assert_eq!(hashid("add"), hashid("add_again"));
    // Metadata: side-cars by default, inline where the plan gives it; the
    // refused registers name the code of the target that tried them first
    // (the others never receive a register no target has installed yet).
    let register = |name: &str| {
        lines
            .iter()
            .find(|l| l["name"] == name && l["op"] == "register")
            .unwrap_or_else(|| panic!("register {name}"))
            .clone()
    };
    assert_eq!(register("add")["metadata"], "payloads/add.spyc.json");
    assert_eq!(register("scaled")["metadata"], "inline");
    for (name, code) in [
        ("needs_missing_dep", "DEPS_UNSATISFIED"),
        ("from_python_2", "PYTHON_VERSION_MISMATCH"),
    ] {
        let line = register(name);
        let error = line["error"].as_str().unwrap();
        assert!(error.starts_with("REGISTER_PARTIAL_FAILURE: "), "{line}");
        assert_eq!(error.matches(&format!(": {code}: ")).count(), 1, "{line}");
        let targets = line["targets"].as_array().unwrap();
        assert_eq!(targets.len(), 1, "{line}");
        for (index, target) in targets.iter().enumerate() {
            assert_eq!(target["target"], index, "{line}");
            assert_eq!(target["outcome"], "failed", "{line}");
            let detail = target["detail"].as_str().unwrap();
            assert!(detail.starts_with(&format!("{code}: ")), "{line}");
        }
    }
    assert!(hashid("add")
        .unwrap()
        .as_str()
        .unwrap()
        .starts_with("sha256:"));
}

#[test]
fn the_example_plan_as_text() {
    let dir = TempDir::new("example-text");
    let plan = example_plan(&dir);
    let output = callreg(&[plan.as_os_str()]);
    let stdout = text(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{stdout}{}",
        text(&output.stderr)
    );
    assert!(
        stdout.starts_with("step 0 register add: ok sha256:"),
        "{stdout}"
    );
    assert!(
        stdout.contains("step 10 call_all square: ok -> [49,49,49,49] ("),
        "{stdout}"
    );
    assert!(
        stdout.contains(": ok, failed as expected: \"add\" is not registered (it was unregistered): HANDLE_STALE: "),
        "{stdout}"
    );
    let last = stdout.lines().last().unwrap();
    assert!(
        last.starts_with("summary: 55 steps, 55 as expected, 0 not ("),
        "{last}"
    );
}

#[test]
fn a_wrong_expectation_exits_1() {
    let dir = TempDir::new("wrong");
    pack_examples(&dir.0);
    let plan = dir.0.join("wrong.json");
    std::fs::write(
        &plan,
        r#"{"targets": 1, "steps": [
            {"op": "register", "name": "add", "envelope": "payloads/add.spyc"},
            {"op": "call", "name": "add", "args": [2, 3], "expect": 6},
            {"op": "call", "name": "add", "args": [2, 3], "expect_error": "TypeError"},
            {"op": "call", "name": "add", "args": [2, 3], "expect": 5}
        ]}"#,
    )
    .unwrap();
    let output = callreg(&[plan.as_os_str(), "--json".as_ref()]);
    let stdout = text(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The implicit start, four steps, the summary.
    assert_eq!(lines.len(), 6, "{stdout}");
    assert_eq!(lines[0]["step"], Value::Null);
    assert_eq!(lines[0]["op"], "start");
    assert_eq!(lines[2]["result"], 5);
    assert_eq!(lines[2]["ok"], false);
    assert_eq!(lines[2]["unmet"], "expected 6");
    assert_eq!(lines[3]["ok"], false);
    assert_eq!(
        lines[3]["unmet"],
        "expected an error containing \"TypeError\", but the step succeeded"
    );
    assert_eq!(lines[4]["ok"], true);
    assert_eq!(
        lines[5]["summary"],
        serde_json::json!({"steps": 4, "ok": 2, "failed": 2, "implicit_start_ok": true,
            "micros": lines[5]["summary"]["micros"]})
    );
    // `"result"` only where a step produced a value, `"error"` only on error.
    for line in &lines[..2] {
        assert!(line.get("result").is_none(), "{line}");
        assert!(line.get("error").is_none(), "{line}");
    }
}

#[test]
fn a_malformed_plan_exits_2_with_one_line() {
    let dir = TempDir::new("malformed");
    let cases = [
        (
            r#"{"targets": 2, "steps": [{"op": "start"}, {"op": "call", "name": "f", "colour": 1}]}"#,
            r#"step 1 (call): unknown field `colour`, expected one of `name`, `target`, `args`, `kwargs`, `expect`, `expect_error`"#,
        ),
        (
            r#"{"targets": 2, "steps": [{"op": "call", "name": "f", "args": 3}]}"#,
            r#"step 0 (call): field "args": invalid type: integer `3`, expected a sequence"#,
        ),
        (
            r#"{"targets": 2, "steps": [{"op": "call", "name": "f", "args": [3]}]}"#,
            r#"step 0 (call): field "name": "f" is not the name of any earlier register step"#,
        ),
        (
            "{\"targets\": 2,",
            "the plan is not valid JSON: EOF while parsing a value at line 1 column 14",
        ),
        (
            r#"{"targets": 2, "respawn_limit": 65536, "steps": []}"#,
            r#"field "respawn_limit": invalid value: integer `65536`, expected an integer from 0 to 65535"#,
        ),
        (
            r#"{"targets": 2, "respawn_limit": "3", "steps": []}"#,
            r#"field "respawn_limit": invalid type: string "3", expected an integer from 0 to 65535"#,
        ),
        (
            r#"{"targets": 2, "probe_first": 1, "steps": []}"#,
            r#"field "probe_first": invalid type: integer `1`, expected a boolean"#,
        ),
        (
            r#"{"targets": 2, "steps": [], "targets": 3}"#,
            "the plan: duplicate key `targets`",
        ),
        (
            r#"{"targets": 1, "steps": [{"op": "call", "name": "f", "args": [1], "args": [2]}]}"#,
            "the plan: at steps[0]: duplicate key `args`",
        ),
        (
            r#"{"targets": 1, "steps": [{"op": "register", "name": "f", "envelope": "f.spyc", "metadata": {"name": "a", "name": "b"}}]}"#,
            "the plan: at steps[0].metadata: duplicate key `name`",
        ),
    ];
    for (index, (plan_text, error)) in cases.iter().enumerate() {
        let plan = dir.0.join(format!("plan{index}.json"));
        std::fs::write(&plan, plan_text).unwrap();
        let output = callreg(&[plan.as_os_str()]);
        assert_eq!(output.status.code(), Some(2), "{plan_text}");
        assert_eq!(text(&output.stdout), "");
        assert_eq!(
            text(&output.stderr),
            format!("callreg: {}: {error}\n", plan.display())
        );
    }
    let output = callreg(&["no-such-plan.json".as_ref()]);
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(
        text(&output.stderr),
        "callreg: cannot read no-such-plan.json: No such file or directory\n"
    );
}

#[test]
fn a_plan_error_is_a_json_line_with_json() {
    let dir = TempDir::new("plan-error-json");
    let plan = dir.0.join("plan.json");
    std::fs::write(
        &plan,
        r#"{"targets": 2, "steps": [{"op": "start"}, {"op": "call", "name": "f", "colour": 1}]}"#,
    )
    .unwrap();
    let output = callreg(&[plan.as_os_str(), "--json".as_ref()]);
    assert_eq!(output.status.code(), Some(2));
    let message = format!(
        r#"{}: step 1 (call): unknown field `colour`, expected one of `name`, `target`, `args`, `kwargs`, `expect`, `expect_error`"#,
        plan.display()
    );
    assert_eq!(text(&output.stderr), format!("callreg: {message}\n"));
    let line: Value = serde_json::from_str(text(&output.stdout).trim_end()).unwrap();
    assert_eq!(
        line,
        serde_json::json!({"plan_error": {"plan": plan.to_str().unwrap(), "step": 1, "field": "colour", "message": message}})
    );
    // Not a step's: step and field are null.
    std::fs::write(&plan, "[1]").unwrap();
    let output = callreg(&[plan.as_os_str(), "--json".as_ref()]);
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(
        text(&output.stdout),
        format!(
            "{{\"plan_error\":{{\"plan\":{:?},\"step\":null,\"field\":null,\"message\":\"{}: the plan must be a JSON object, got an array\"}}}}\n",
            plan.to_str().unwrap(),
            plan.display()
        )
    );
    let output = callreg(&["no-such-plan.json".as_ref(), "--json".as_ref()]);
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(
        text(&output.stdout),
        "{\"plan_error\":{\"plan\":\"no-such-plan.json\",\"step\":null,\"field\":null,\"message\":\"cannot read no-such-plan.json: No such file or directory\"}}\n"
    );
}

/// The lines of a `--json` run without `micros` (timings vary).
fn json_steps(stdout: &str) -> Vec<Value> {
    stdout
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).expect("one JSON object per line");
            if let Some(o) = v.as_object_mut() {
                o.remove("micros");
                if let Some(s) = o.get_mut("summary").and_then(Value::as_object_mut) {
                    s.remove("micros");
                }
            }
            v
        })
        .collect()
}

#[test]
fn mistakes_of_one_kind_fail_their_step_alike() {
    let dir = TempDir::new("same-kind");
    pack_examples(&dir.0);
    std::fs::write(dir.0.join("bad.spyc"), b"not an envelope").unwrap();
    let plan = dir.0.join("plan.json");
    std::fs::write(
        &plan,
        r#"{"targets": 2, "respawn_limit": 0, "steps": [
            {"op": "register", "name": "missing", "envelope": "absent.spyc"},
            {"op": "register", "name": "bad", "envelope": "bad.spyc"},
            {"op": "register", "name": "add", "envelope": "payloads/add.spyc"},
            {"op": "start"},
            {"op": "unregister", "name": "add"},
            {"op": "unregister", "name": "add"},
            {"op": "kill_target", "target": 1},
            {"op": "kill_target", "target": 1},
            {"op": "call", "name": "missing", "expect_error": "IO_FAILED"}
        ]}"#,
    )
    .unwrap();
    let output = callreg(&[plan.as_os_str(), "--json".as_ref()]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output.stderr));
    let lines = json_steps(&text(&output.stdout));
    assert_eq!(lines.len(), 10);
    let failed = |step: usize| (lines[step]["ok"].clone(), lines[step]["code"].clone());
    let no = Value::Bool(false);
    assert_eq!(failed(0), (no.clone(), "IO_FAILED".into()));
    assert_eq!(
        lines[0]["error"],
        "IO_FAILED: cannot read absent.spyc: No such file or directory (operation register)"
    );
    assert_eq!(failed(1), (no.clone(), "ENVELOPE_INVALID".into()));
    assert_eq!(
        lines[1]["error"],
        "ENVELOPE_INVALID: header truncated: 15 staged bytes, a SPYC header needs 16 (operation register, namespace LOCAL_PYTHON)"
    );
    assert_eq!(lines[2]["ok"], true);
    assert_eq!(lines[2].get("code"), None);
    assert_eq!(lines[4]["ok"], true);
    assert_eq!(failed(5), (no.clone(), "HANDLE_STALE".into()));
    let hashid = lines[2]["hashid"].as_str().unwrap();
    assert!(
        lines[5]["error"]
            .as_str()
            .unwrap()
            .starts_with("\"add\" is not registered (it was unregistered): HANDLE_STALE: "),
        "{}",
        lines[5]
    );
    assert_eq!(lines[5]["hashid"], hashid);
    assert_eq!(lines[6]["ok"], true);
    assert_eq!(failed(7), (no.clone(), "NO_LIVE_TARGET".into()));
    assert_eq!(
        lines[7]["error"],
        "NO_LIVE_TARGET: target 1 is not live, so it cannot be killed"
    );
    // The call of a label whose register failed carries that register's code.
    assert_eq!(lines[8]["ok"], true);
    assert_eq!(lines[8]["code"], "IO_FAILED");
    assert_eq!(
        lines[8]["error"],
        "\"missing\" is not registered (its register failed: IO_FAILED)"
    );
    assert_eq!(
        lines[9],
        serde_json::json!({"summary": {"steps": 9, "ok": 5, "failed": 4}})
    );
}

#[test]
fn what_a_callable_prints_goes_to_stderr() {
    let dir = TempDir::new("prints");
    std::fs::write(
        dir.0.join("shout.py"),
        // One write per line: two targets print at once.
        "import sys\n\ndef shout(text):\n    sys.stdout.write('printed by the target: ' + text + '\\n')\n    sys.stdout.flush()\n    return text.upper()\n",
    )
    .unwrap();
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let packed = Command::new(python)
        .arg(repo().join("python/tools/callreg_envelope.py"))
        .arg(dir.0.join("shout.py"))
        .arg("--out")
        .arg(dir.0.join("payloads"))
        .output()
        .expect("python runs");
    assert!(packed.status.success(), "{}", text(&packed.stderr));
    let plan = dir.0.join("plan.json");
    std::fs::write(
        &plan,
        r#"{"targets": 2, "steps": [
            {"op": "register", "name": "shout", "envelope": "payloads/shout.spyc"},
            {"op": "call_all", "name": "shout", "args": ["hi"], "expect": "HI"}
        ]}"#,
    )
    .unwrap();
    let output = callreg(&[plan.as_os_str(), "--json".as_ref()]);
    let stdout = text(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}");
    // Every stdout line is a step or the summary.
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    assert_eq!(lines.len(), 4, "{stdout}");
    assert_eq!(lines[2]["result"], serde_json::json!(["HI", "HI"]));
    assert_eq!(
        text(&output.stderr),
        "printed by the target: hi\nprinted by the target: hi\n"
    );
}

/// Drops the trailing ` (N µs)` / ` (N.N ms)` duration of a text step line.
fn without_duration(line: &str) -> &str {
    line.rsplit_once(" (").map_or(line, |(head, _)| head)
}

/// A start that fails (the startup snapshot holds a pickle whose loading
/// ends the target: `os._exit(3)`) and leaves no target serving stops the
/// plan: every later step fails as not run, exit 1.
#[test]
fn steps_after_a_failed_start_are_not_run() {
    let dir = TempDir::new("failed-start");
    std::fs::write(
        dir.0.join("bad.spyc"),
        callreg::envelope::encode(b"cos\n_exit\n(I3\ntR."),
    )
    .unwrap();
    let plan = dir.0.join("plan.json");
    std::fs::write(
        &plan,
        r#"{"targets": 1, "steps": [
            {"op": "register", "name": "bad", "envelope": "bad.spyc"},
            {"op": "start"},
            {"op": "register", "name": "later", "envelope": "bad.spyc"},
            {"op": "call", "name": "later", "args": []}]}"#,
    )
    .unwrap();
    let output = callreg(&[plan.as_os_str()]);
    assert_eq!(output.status.code(), Some(1));
    let stdout = text(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 5, "{stdout}");
    // The error names the snapshot's only entry: the target died
    // installing it.
    let bad = hashid_of(&callreg::envelope::encode(b"cos\n_exit\n(I3\ntR."));
    assert!(
        lines[1].starts_with(&format!("step 1 start: FAILED: REGISTER_PARTIAL_FAILURE: target 0 could not install the startup snapshot and was stopped (operation start, target 0, namespace LOCAL_PYTHON, hashid {bad}) [target 0 failed (")),
        "{stdout}"
    );
    // Its replacements load the snapshot by replay and die too: after
    // three in a row the target is given up, and no target serves.
    assert!(
        without_duration(lines[1]).ends_with(
            "; not replaced] [target 0: incarnation 1 lost (its reply socket closed; it exited with status 3); \
             target 0: incarnation 2 lost (its reply socket closed; it exited with status 3); \
             target 0: incarnation 3 lost (its reply socket closed; it exited with status 3); \
             target 0: given up after 3 replacements in a row were lost before they joined] -- the step failed"
        ),
        "{stdout}"
    );
    assert_eq!(
        without_duration(lines[2]),
        "step 2 register later: FAILED: not run: the Worker did not start -- the step failed"
    );
    assert_eq!(
        without_duration(lines[3]),
        "step 3 call later: FAILED: not run: the Worker did not start -- the step failed"
    );
    assert!(
        lines[4].starts_with("summary: 4 steps, 1 as expected, 3 not ("),
        "{stdout}"
    );
}

/// Runs `plan` (JSON text) in a fresh directory holding `files`, with
/// `--json`; returns the exit status and the parsed lines.
fn run_json(test: &str, files: &[(&str, Vec<u8>)], plan: &str) -> (Option<i32>, Vec<Value>) {
    let dir = TempDir::new(test);
    for (name, bytes) in files {
        std::fs::write(dir.0.join(name), bytes).unwrap();
    }
    let path = dir.0.join("plan.json");
    std::fs::write(&path, plan).unwrap();
    let output = callreg(&[path.as_os_str(), "--json".as_ref()]);
    let lines = text(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    (output.status.code(), lines)
}

/// An error code is printed once: an envelope error in a register, and a
/// target's failure to install the startup snapshot.
#[test]
fn error_codes_are_not_repeated() {
    let bad = callreg::envelope::encode(b"not a pickle");
    let hashid = format!(
        "sha256:{}",
        "6300e66e3be7096f2cbbd5545f828a04cf162372a3c891c8483c3480704be91d"
    );
    let (code, lines) = run_json(
        "codes-once",
        &[
            ("junk.spyc", b"XXXXXXXXXXXXXXXXXXXX".to_vec()),
            ("bad.spyc", bad),
        ],
        r#"{"targets": 1, "steps": [
            {"op": "register", "name": "junk", "envelope": "junk.spyc"},
            {"op": "register", "name": "bad", "envelope": "bad.spyc"},
            {"op": "start"}]}"#,
    );
    assert_eq!(code, Some(1));
    assert_eq!(
        lines[0]["error"],
        "ENVELOPE_INVALID: bad magic 58585858 (expected 53505943, \"SPYC\") (operation register, namespace LOCAL_PYTHON)"
    );
    assert_eq!(lines[1]["hashid"], hashid.as_str());
    // The pre-start register is marked failed at start, each code once.
    assert_eq!(
        lines[1]["error"],
        format!(
            "REGISTER_PARTIAL_FAILURE: at start, registration of {hashid} (handle 1) failed: target 0: DESERIALIZE_FAILED: _pickle.UnpicklingError: invalid load key, 'n'."
        )
    );
    assert_eq!(
        lines[1]["targets"][0]["detail"],
        "DESERIALIZE_FAILED: _pickle.UnpicklingError: invalid load key, 'n'."
    );
    assert_eq!(lines[2]["op"], "start");
    assert_eq!(lines[2]["targets"][0]["outcome"], "ok");
}

/// Runs `plan` (JSON text) in a fresh directory holding `files`, as text;
/// returns the exit status and the lines without their durations.
fn run_text(test: &str, files: &[(&str, Vec<u8>)], plan: &str) -> (Option<i32>, Vec<String>) {
    let dir = TempDir::new(test);
    for (name, bytes) in files {
        std::fs::write(dir.0.join(name), bytes).unwrap();
    }
    let path = dir.0.join("plan.json");
    std::fs::write(&path, plan).unwrap();
    let output = callreg(&[path.as_os_str()]);
    let lines = text(&output.stdout)
        .lines()
        .map(|l| without_duration(l).to_owned())
        .collect();
    (output.status.code(), lines)
}

/// Singular and plural agree: one or two targets stopped at start, one
/// step in the summary, and a target's exit reads "it was killed by signal 9".
#[test]
fn messages_agree_in_number_and_voice() {
    // Loading it ends the target (`os._exit(3)`): it is never ready.
    let bad = || {
        (
            "bad.spyc",
            callreg::envelope::encode(b"cos\n_exit\n(I3\ntR."),
        )
    };
    for (targets, stopped) in [
        (
            1,
            "target 0 could not install the startup snapshot and was stopped",
        ),
        (
            2,
            "targets 0, 1 could not install the startup snapshot and were stopped",
        ),
    ] {
        let (code, lines) = run_text(
            &format!("stopped-{targets}"),
            &[bad()],
            &format!(
                r#"{{"targets": {targets}, "steps": [
                    {{"op": "register", "name": "bad", "envelope": "bad.spyc"}},
                    {{"op": "start"}}]}}"#
            ),
        );
        assert_eq!(code, Some(1));
        let hashid = hashid_of(&bad().1);
        assert!(
            lines[1].starts_with(&format!(
                "step 1 start: FAILED: REGISTER_PARTIAL_FAILURE: {stopped} (operation start, target 0, namespace LOCAL_PYTHON, hashid {hashid}) [target 0 failed ("
            )),
            "{lines:?}"
        );
    }
    let (code, lines) = run_text(
        "one-step",
        &[],
        r#"{"targets": 1, "steps": [{"op": "start"}]}"#,
    );
    assert_eq!(code, Some(0));
    assert_eq!(
        lines,
        ["step 0 start: ok", "summary: 1 step, 1 as expected, 0 not"]
    );
    let (code, lines) = run_text(
        "killed",
        &[],
        r#"{"targets": 1, "respawn_limit": 0, "steps": [{"op": "start"}, {"op": "kill_target", "target": 0},
            {"op": "kill_target", "target": 0}]}"#,
    );
    assert_eq!(code, Some(1));
    assert_eq!(
        lines,
        [
            "step 0 start: ok",
            "step 1 kill_target [target 0]: ok [target 0 killed (it was killed by signal 9)]",
            "step 2 kill_target [target 0]: FAILED: NO_LIVE_TARGET: target 0 is not live, so it cannot be killed [target 0 lost (it was killed by signal 9)] -- the step failed",
            "summary: 3 steps, 2 as expected, 1 not",
        ]
    );
}

/// A startup snapshot cannot outgrow a target's slots: with the default 64
/// slots, the 65th distinct pre-start register fails with
/// `LOCAL_SLOT_EXHAUSTED`, while a repeated digest still only adds a
/// reference.
#[test]
fn a_pre_start_register_beyond_the_slot_capacity_is_refused() {
    let mut files = Vec::new();
    let mut steps = Vec::new();
    for i in 0..65 {
        files.push((
            format!("f{i}.spyc"),
            callreg::envelope::encode(format!("payload {i}").as_bytes()),
        ));
        steps.push(format!(
            r#"{{"op": "register", "name": "f{i}", "envelope": "f{i}.spyc"}}"#
        ));
    }
    steps.push(r#"{"op": "register", "name": "again", "envelope": "f0.spyc"}"#.to_owned());
    let files: Vec<(&str, Vec<u8>)> = files
        .iter()
        .map(|(name, bytes)| (name.as_str(), bytes.clone()))
        .collect();
    let (code, lines) = run_json(
        "slots",
        &files,
        &format!(
            r#"{{"targets": 2, "control_timeout_s": 30, "steps": [{}, {{"op": "start"}}]}}"#,
            steps.join(", ")
        ),
    );
    assert_eq!(code, Some(1));
    // The 64 that fit were registered, then failed to unpickle at start
    // (they are not pickles): each is marked failed there.
    for line in &lines[..64] {
        assert_eq!(line["ok"], false, "{line}");
        let error = line["error"].as_str().unwrap();
        assert!(
            error.starts_with("REGISTER_PARTIAL_FAILURE: at start, registration of "),
            "{line}"
        );
    }
    let hashid = lines[64]["hashid"].as_str().unwrap().to_owned();
    assert_eq!(
        lines[64]["error"],
        format!(
            "LOCAL_SLOT_EXHAUSTED: the startup snapshot already holds as many distinct callables as a target has slots (64) (operation register, namespace LOCAL_PYTHON, hashid {hashid})"
        )
    );
    // A second handle of f0's callable fails with it.
    assert_eq!(lines[65]["ok"], false, "{}", lines[65]);
    assert_eq!(lines[66]["op"], "start", "{}", lines[66]);
    assert_eq!(lines[66]["ok"], true, "{}", lines[66]);
}

/// A failed register's line names its hashid once (the error carries it).
#[test]
fn a_failed_register_names_its_hashid_once() {
    let (code, lines) = run_text(
        "hashid-once",
        &[("bad.spyc", callreg::envelope::encode(b"not a pickle"))],
        r#"{"targets": 1, "steps": [{"op": "register", "name": "bad", "envelope": "bad.spyc"}]}"#,
    );
    assert_eq!(code, Some(1));
    let hashid = "sha256:6300e66e3be7096f2cbbd5545f828a04cf162372a3c891c8483c3480704be91d";
    assert_eq!(
        lines[1..],
        [
            format!("step 0 register bad: FAILED: REGISTER_PARTIAL_FAILURE: register failed: target 0: DESERIALIZE_FAILED: _pickle.UnpicklingError: invalid load key, 'n'. (operation register, namespace LOCAL_PYTHON, hashid {hashid}, seq 1) -- the step failed"),
            "summary: 1 step, 0 as expected, 1 not; implicit start ok".to_owned(),
        ]
    );
    assert_eq!(lines[0], "step - start (implicit): ok");
}

/// The hashid of the envelope of `payload`.
fn hashid_of(envelope: &[u8]) -> String {
    let envelope = callreg::envelope::Envelope::parse(envelope).expect("a valid envelope");
    callreg::descriptor::python_serialized_digest(&envelope)
        .hashid()
        .to_string()
}

/// A pickle of the builtin `abs` (a callable that needs nothing).
const ABS: &[u8] = b"cbuiltins\nabs\n.";

/// `line` (a `--json` step line) with its duration and the pids of its
/// target events set to 0: the rest is the same on every run.
fn stable(mut line: Value) -> Value {
    if line.get("micros").is_some() {
        line["micros"] = 0.into();
    }
    if let Some(Value::Array(events)) = line.get_mut("target_events") {
        for event in events {
            if event.get("pid").is_some() {
                event["pid"] = 0.into();
            }
        }
    }
    line
}

/// A killed target is replaced (same target id, the next incarnation)
/// before the next step runs: the step waits until the replacement
/// joined, says so, and the replacement serves what was registered before
/// the kill. `--json` lists the target events (with the replacement's pid).
#[test]
fn a_killed_target_is_replaced_before_the_next_step() {
    let abs = callreg::envelope::encode(ABS);
    let hashid = hashid_of(&abs);
    let plan = r#"{"targets": 2, "steps": [
        {"op": "start"},
        {"op": "register", "name": "abs", "envelope": "abs.spyc"},
        {"op": "kill_target", "target": 0},
        {"op": "call", "name": "abs", "args": [-3], "target": 0, "expect": 3},
        {"op": "kill_target", "target": 0},
        {"op": "call_all", "name": "abs", "args": [-5], "expect": 5}]}"#;
    let (code, lines) = run_text("replaced-text", &[("abs.spyc", abs.clone())], plan);
    assert_eq!(code, Some(0), "{lines:?}");
    assert_eq!(
        lines,
        [
            "step 0 start: ok".to_owned(),
            format!("step 1 register abs: ok {hashid}"),
            "step 2 kill_target [target 0]: ok [target 0 killed (it was killed by signal 9); replaced by incarnation 1] [target 0: incarnation 1 joined]".to_owned(),
            "step 3 call abs [target 0]: ok -> 3".to_owned(),
            "step 4 kill_target [target 0]: ok [target 0 killed (it was killed by signal 9); replaced by incarnation 2] [target 0: incarnation 2 joined]".to_owned(),
            "step 5 call_all abs: ok -> [5,5]".to_owned(),
            "summary: 6 steps, 6 as expected, 0 not".to_owned(),
        ]
    );
    let (code, lines) = run_json("replaced-json", &[("abs.spyc", abs)], plan);
    assert_eq!(code, Some(0), "{lines:?}");
    let killed = |incarnation: u32| {
        serde_json::json!({"step": if incarnation == 1 { 2 } else { 4 }, "op": "kill_target",
            "name": null, "ok": true, "hashid": null,
            "targets": [{"target": 0, "outcome": "killed", "detail": "it was killed by signal 9",
                "replacement": format!("replaced by incarnation {incarnation}")}],
            "target_events": [
                {"event": "lost", "target": 0, "incarnation": incarnation - 1,
                    "cause": "its reply socket closed; it was killed by signal 9"},
                {"event": "spawned", "target": 0, "incarnation": incarnation, "pid": 0},
                {"event": "joined", "target": 0, "incarnation": incarnation}],
            "micros": 0})
    };
    assert_eq!(stable(lines[2].clone()), killed(1));
    assert_eq!(stable(lines[4].clone()), killed(2));
    // The pid is the replacement's: a new process each time.
    let pid = |line: &Value| line["target_events"][1]["pid"].as_i64().expect("a pid");
    assert_ne!(pid(&lines[2]), pid(&lines[4]));
    // No other step had target events.
    for line in [&lines[0], &lines[1], &lines[3], &lines[5]] {
        assert_eq!(line.get("target_events"), None, "{line}");
    }
}

/// A pickle that gives `abs`, but whose first load (`first: true`) or
/// whose every load but the first (`first: false`) ends its process
/// (`os._exit(3)`); the file `marker` tells them apart.
fn loader_killer(marker: &Path, first: bool) -> Vec<u8> {
    let marker = marker.display().to_string();
    assert!(!marker.contains(['"', '\'', '\\']), "{marker}");
    let (first_load, later_loads) = if first {
        ("os._exit(3)", "pass")
    } else {
        ("pass", "os._exit(3)")
    };
    let pickle = format!(
        "cbuiltins\nexec\n(S'import os\\nif not os.path.exists(\"{marker}\"):\\n open(\"{marker}\", \"w\").close()\\n {first_load}\\nelse:\\n {later_loads}'\n(dtR0cbuiltins\nabs\n."
    );
    callreg::envelope::encode(pickle.as_bytes())
}

/// A target whose replacements all die (they load, by replay, a callable
/// that ends every process but the first to load it) is given up after
/// `respawn_limit` of them in a row: the kill says so, and the target
/// cannot be killed again.
#[test]
fn a_target_whose_replacements_die_is_given_up() {
    let dir = TempDir::new("given-up");
    std::fs::write(
        dir.0.join("later.spyc"),
        loader_killer(&dir.0.join("loaded-once"), false),
    )
    .unwrap();
    let plan = dir.0.join("plan.json");
    std::fs::write(
        &plan,
        r#"{"targets": 1, "respawn_limit": 2, "steps": [
            {"op": "register", "name": "later", "envelope": "later.spyc"},
            {"op": "start"},
            {"op": "call", "name": "later", "args": [-2], "expect": 2},
            {"op": "kill_target", "target": 0},
            {"op": "kill_target", "target": 0, "expect_error": "NO_LIVE_TARGET"}]}"#,
    )
    .unwrap();
    let output = callreg(&[plan.as_os_str()]);
    let stdout = text(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}");
    let lines: Vec<&str> = stdout.lines().map(without_duration).collect();
    assert_eq!(
        lines[1..],
        [
            "step 1 start: ok",
            "step 2 call later [target 0]: ok -> 2",
            "step 3 kill_target [target 0]: ok [target 0 killed (it was killed by signal 9); not replaced] [target 0: incarnation 1 lost (its reply socket closed; it exited with status 3); target 0: incarnation 2 lost (its reply socket closed; it exited with status 3); target 0: given up after 2 replacements in a row were lost before they joined]",
            "step 4 kill_target [target 0]: ok, failed as expected: NO_LIVE_TARGET: target 0 is not live, so it cannot be killed [target 0 lost (it exited with status 3)]",
            "summary: 5 steps, 5 as expected, 0 not",
        ]
    );
}

/// A target lost at start is replaced: the start fails (the Worker's
/// error), the step waits for the replacement, which is given the startup
/// snapshot by replay and joins; every target serves, so the plan goes on.
#[test]
fn a_target_lost_at_start_is_replaced() {
    for json in [false, true] {
        let dir = TempDir::new(if json {
            "start-loss-json"
        } else {
            "start-loss"
        });
        let envelope = loader_killer(&dir.0.join("loaded-once"), true);
        let hashid = hashid_of(&envelope);
        std::fs::write(dir.0.join("once.spyc"), &envelope).unwrap();
        let plan = dir.0.join("plan.json");
        std::fs::write(
            &plan,
            r#"{"targets": 1, "steps": [
                {"op": "register", "name": "once", "envelope": "once.spyc"},
                {"op": "start", "expect_error": "could not install the startup snapshot"},
                {"op": "call", "name": "once", "args": [-4], "expect": 4}]}"#,
        )
        .unwrap();
        let mut args = vec![plan.as_os_str()];
        if json {
            args.push("--json".as_ref());
        }
        let output = callreg(&args);
        let stdout = text(&output.stdout);
        assert_eq!(output.status.code(), Some(0), "{stdout}");
        let error = format!("REGISTER_PARTIAL_FAILURE: target 0 could not install the startup snapshot and was stopped (operation start, target 0, namespace LOCAL_PYTHON, hashid {hashid})");
        let lost = "TARGET_LOST: the target exited with status 3 before it was ready";
        if !json {
            let lines: Vec<&str> = stdout.lines().map(without_duration).collect();
            assert_eq!(
                lines,
                [
                    format!("step 0 register once: ok {hashid}").as_str(),
                    &format!("step 1 start: ok, failed as expected: {error} [target 0 failed ({lost}); replaced by incarnation 1] [target 0: incarnation 1 joined]"),
                    "step 2 call once [target 0]: ok -> 4",
                    "summary: 3 steps, 3 as expected, 0 not",
                ]
            );
            continue;
        }
        let lines = json_steps(&stdout);
        assert_eq!(
            stable(lines[1].clone()),
            serde_json::json!({"step": 1, "op": "start", "name": null, "ok": true, "hashid": null,
                "targets": [{"target": 0, "outcome": "failed", "detail": lost,
                    "replacement": "replaced by incarnation 1"}],
                "target_events": [
                    {"event": "lost", "target": 0, "incarnation": 0,
                        "cause": format!("at start: failed ({lost})")},
                    {"event": "spawned", "target": 0, "incarnation": 1, "pid": 0},
                    {"event": "joined", "target": 0, "incarnation": 1}],
                "code": "REGISTER_PARTIAL_FAILURE", "error": error})
        );
        assert_eq!(lines[2]["result"], 4, "{}", lines[2]);
    }
}

/// `probe_first` goes to the Worker: a register after start of a payload
/// whose loading ends its process (`os._exit(3)`) costs one target with
/// probing (the default; the callable is refused from then on) and every
/// target without. Replacements are off here, so the losses stay.
#[test]
fn probe_first_decides_how_many_targets_a_deadly_register_costs() {
    let deadly = callreg::envelope::encode(b"cos\n_exit\n(I3\ntR.");
    let hashid = hashid_of(&deadly);
    let files = [
        ("deadly.spyc", deadly),
        ("abs.spyc", callreg::envelope::encode(ABS)),
    ];
    let abs_hashid = hashid_of(&files[1].1);
    let lost = "its reply socket closed; it exited with status 3";
    for (probe_first, later) in [
        (
            "true",
            [
                r#"{"op": "register", "name": "abs", "envelope": "abs.spyc"}"#,
                r#"{"op": "call_all", "name": "abs", "args": [-1], "expect": 1}"#,
            ],
        ),
        (
            "false",
            [
                r#"{"op": "register", "name": "abs", "envelope": "abs.spyc", "expect_error": "NO_LIVE_TARGET"}"#,
                r#"{"op": "call_all", "name": "abs", "args": [-1], "expect_error": "not registered"}"#,
            ],
        ),
    ] {
        let (code, lines) = run_text(
            &format!("probe-{probe_first}"),
            &files,
            &format!(
                r#"{{"targets": 2, "respawn_limit": 0, "probe_first": {probe_first}, "steps": [
                    {{"op": "start"}},
                    {{"op": "register", "name": "deadly", "envelope": "deadly.spyc", "expect_error": "lost"}},
                    {}, {}]}}"#,
                later[0], later[1]
            ),
        );
        assert_eq!(code, Some(0), "{lines:?}");
        let expected = if probe_first == "true" {
            [
                format!("step 1 register deadly: ok, failed as expected: REGISTER_POISONED: installing it killed target 0 ({lost}), the target that tried it first; it is refused for the rest of this Worker's life: target 0: lost (operation register, target 0, namespace LOCAL_PYTHON, hashid {hashid}, seq 1) [target 0 lost ({lost})]"),
                format!("step 2 register abs: ok {abs_hashid}"),
                "step 3 call_all abs: ok -> [1]".to_owned(),
            ]
        } else {
            [
                format!("step 1 register deadly: ok, failed as expected: REGISTER_PARTIAL_FAILURE: register failed: target 0: lost ({lost}); target 1: lost ({lost}) (operation register, namespace LOCAL_PYTHON, hashid {hashid}, seq 1) [target 0 lost ({lost}), target 1 lost ({lost})]"),
                format!("step 2 register abs: ok, failed as expected: NO_LIVE_TARGET: every target is lost, and none is being replaced (operation register, namespace LOCAL_PYTHON, hashid {abs_hashid})"),
                "step 3 call_all abs: ok, failed as expected: \"abs\" is not registered (its register failed: NO_LIVE_TARGET)".to_owned(),
            ]
        };
        assert_eq!(lines[0], "step 0 start: ok");
        assert_eq!(lines[1..4], expected, "probe_first {probe_first}");
        assert_eq!(lines[4], "summary: 4 steps, 4 as expected, 0 not");
    }
}
