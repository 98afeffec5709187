//! What a step did and how it is shown: the step and target reports,
//! whether a step met its expectation, and its text or `--json` line.

use std::time::Duration;

use callreg::error::{Error, ErrorCode};
use callreg::io::worker::TargetEvent;
use callreg::io::{OperationError, TaskError};
use callreg::protocol::{TargetId, TargetOutcome};
use serde::Serialize;
use serde_json::Value;

use super::super::plan::{Op, Step};

/// Result text longer than this many characters is cut in text output.
const RESULT_TEXT_CHARS: usize = 200;

/// One target's part in a step.
#[derive(Clone)]
pub(super) struct TargetReport {
    pub(super) target: u16,
    /// `ok`, `failed`, `lost`, `timed_out`, `fenced`, `rolled_back`,
    /// `cleanup_unconfirmed` or `killed`.
    pub(super) outcome: &'static str,
    /// Why, for an outcome other than `ok`.
    pub(super) detail: Option<String>,
    /// The call's result on this target (`call_all`).
    pub(super) result: Option<Value>,
    /// What became of a target lost during the step:
    /// `replaced by incarnation N`, or `not replaced`.
    pub(super) replacement: Option<String>,
}

/// What a step did.
pub(super) struct StepReport {
    /// The step index; `None` for the implicit start.
    pub(super) step: Option<usize>,
    pub(super) op: &'static str,
    pub(super) name: Option<String>,
    pub(super) hashid: Option<String>,
    /// A register's metadata source (`inline`, a file, a side-car).
    pub(super) metadata: Option<String>,
    pub(super) targets: Vec<TargetReport>,
    pub(super) outcome: Result<Option<Value>, String>,
    /// The error code of a failed step (`None` when it succeeded).
    pub(super) code: Option<ErrorCode>,
    /// The step's expectation, when it was not met.
    pub(super) unmet: Option<String>,
    /// What happened to replaced targets during the step
    /// (`Worker::target_events`, `specs/protocol.md` §2.9).
    pub(super) target_events: Vec<TargetEvent>,
    pub(super) micros: u64,
}

/// What became of `target`, from the target events of a step: the
/// last join (`replaced by incarnation N`) or abandonment (`not
/// replaced`; the `Abandoned` event says why) of it, if any.
pub(super) fn replacement(events: &[TargetEvent], target: TargetId) -> Option<String> {
    events.iter().rev().find_map(|event| match event {
        TargetEvent::Joined {
            target: t,
            incarnation,
        } if *t == target => Some(format!("replaced by incarnation {incarnation}")),
        TargetEvent::Abandoned {
            target: t,
            failed_joins,
        } if *t == target => Some("not replaced".to_owned()),
        _ => None,
    })
}

pub(super) fn ok_target(target: TargetId) -> TargetReport {
    TargetReport {
        target: target.0,
        outcome: "ok",
        detail: None,
        result: None,
        replacement: None,
    }
}

pub(super) fn target_report((target, outcome): &(TargetId, TargetOutcome)) -> TargetReport {
    let (outcome, detail) = match outcome {
        TargetOutcome::Ok => ("ok", None),
        TargetOutcome::Failed { failure } => ("failed", Some(one_line(&failure.to_string()))),
        TargetOutcome::Lost => ("lost", None),
        TargetOutcome::TimedOut => ("timed_out", None),
        TargetOutcome::Fenced => ("fenced", None),
        TargetOutcome::RolledBack => ("rolled_back", None),
        TargetOutcome::CleanupUnconfirmed { failure } => {
            ("cleanup_unconfirmed", Some(one_line(&failure.to_string())))
        }
    };
    TargetReport {
        target: target.0,
        outcome,
        detail,
        result: None,
        replacement: None,
    }
}

/// A step's `op` as the plan spells it, and the label it names.
pub(super) fn op_name(op: &Op) -> (&'static str, Option<&str>) {
    match op {
        Op::Start => ("start", None),
        Op::Register(register) => ("register", Some(&register.name)),
        Op::Unregister { name } => ("unregister", Some(name)),
        Op::Call(call) => ("call", Some(&call.name)),
        Op::CallAll(call) => ("call_all", Some(&call.name)),
        Op::KillTarget { .. } => ("kill_target", None),
    }
}

/// Whether a step's outcome met its expectation; `Some(why)` if not.
pub(super) fn unmet(step: &Step, outcome: &Result<Option<Value>, String>) -> Option<String> {
    let expect = match &step.op {
        Op::Call(call) | Op::CallAll(call) => call.expect.as_ref(),
        _ => None,
    };
    if step.expect_error.is_some() {
        return unmet_error(step.expect_error.as_deref(), outcome);
    }
    match (outcome, expect) {
        (Err(_), _) => Some("the step failed".to_owned()),
        (Ok(_), None) => None,
        (Ok(result), Some(expected)) => {
            let matches = match (&step.op, result) {
                (Op::CallAll(_), Some(Value::Array(values))) => {
                    values.iter().all(|v| json_equal(v, expected))
                }
                (_, Some(value)) => json_equal(value, expected),
                (_, None) => false,
            };
            (!matches).then(|| format!("expected {expected}"))
        }
    }
}

/// Whether an outcome is the expected error (a substring of its line).
pub(super) fn unmet_error(
    expect_error: Option<&str>,
    outcome: &Result<Option<Value>, String>,
) -> Option<String> {
    match (expect_error, outcome) {
        (None, Ok(_)) => None,
        (None, Err(_)) => Some("the step failed".to_owned()),
        (Some(expected), Ok(_)) => Some(format!(
            "expected an error containing {expected:?}, but the step succeeded"
        )),
        (Some(expected), Err(error)) => (!error.contains(expected))
            .then(|| format!("expected an error containing {expected:?}")),
    }
}

/// JSON equality with numbers compared by value (`49` equals `49.0`).
fn json_equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_i64(), y.as_i64()) {
            (Some(x), Some(y)) => x == y,
            _ => match (x.as_u64(), y.as_u64()) {
                (Some(x), Some(y)) => x == y,
                _ => x.as_f64() == y.as_f64(),
            },
        },
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| json_equal(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_equal(v, w)))
        }
        _ => a == b,
    }
}

/// An error on one line: newlines (e.g. a Python traceback) become ` | `.
pub(super) fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim_end)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" | ")
}

/// A failed register, unregister or start, on one line; the targets'
/// outcomes are reported beside it.
pub(super) fn operation_error_text(error: &OperationError) -> String {
    one_line(&error.error.to_string())
}

/// A failed task: `CODE: Kind: message | traceback (context)`.
pub(super) fn task_error_text(error: &TaskError) -> String {
    let mut shown: Error = error.error.clone();
    if !error.kind.is_empty() {
        shown.message = format!("{}: {}", error.kind, shown.message);
    }
    one_line(&shown.to_string())
}

pub(super) fn micros(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
}

pub(super) fn duration_text(micros: u64) -> String {
    if micros >= 10_000 {
        format!("{:.1} ms", micros as f64 / 1000.0)
    } else {
        format!("{micros} µs")
    }
}

/// The `--json` line of a plan that cannot run.
#[derive(Serialize)]
pub(super) struct PlanErrorLine<'r> {
    pub(super) plan_error: PlanErrorFields<'r>,
}

/// What a plan error names: the plan file as given, the step index and
/// field when the error is in one, and the message (as on stderr).
#[derive(Serialize)]
pub(super) struct PlanErrorFields<'r> {
    pub(super) plan: &'r str,
    pub(super) step: Option<usize>,
    pub(super) field: Option<&'r str>,
    pub(super) message: &'r str,
}

/// One `--json` step line, keys in the documented order.
#[derive(Serialize)]
struct JsonLine<'r> {
    step: Option<usize>,
    op: &'r str,
    name: Option<&'r str>,
    ok: bool,
    hashid: Option<&'r str>,
    /// A register's metadata source, when it had metadata.
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata: Option<&'r str>,
    targets: Vec<JsonTarget<'r>>,
    /// The target events of the step (`Worker::target_events`), if any.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    target_events: &'r [TargetEvent],
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<&'r Value>,
    /// The failed step's error code, e.g. `"HANDLE_STALE"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    code: Option<&'r str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'r str>,
    /// Why the step did not meet its expectation.
    #[serde(skip_serializing_if = "Option::is_none")]
    unmet: Option<&'r str>,
    micros: u64,
}

/// One target of a `--json` step line.
#[derive(Serialize)]
struct JsonTarget<'r> {
    target: u16,
    outcome: &'r str,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'r str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<&'r Value>,
    /// What became of a target lost during the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    replacement: Option<&'r str>,
}

pub(super) fn json_line(report: &StepReport, ok: bool) -> String {
    let line = JsonLine {
        step: report.step,
        op: report.op,
        name: report.name.as_deref(),
        ok,
        hashid: report.hashid.as_deref(),
        metadata: report.metadata.as_deref(),
        targets: report
            .targets
            .iter()
            .map(|t| JsonTarget {
                target: t.target,
                outcome: t.outcome,
                detail: t.detail.as_deref(),
                result: t.result.as_ref(),
                replacement: t.replacement.as_deref(),
            })
            .collect(),
        target_events: &report.target_events,
        // Only a step that produced a value has a result (a call's
        // `None` is the JSON `null` it returned); register, unregister,
        // start and kill_target have none.
        result: report.outcome.as_ref().ok().and_then(Option::as_ref),
        code: report
            .outcome
            .as_ref()
            .err()
            .and(report.code)
            .map(ErrorCode::as_str),
        error: report.outcome.as_ref().err().map(String::as_str),
        unmet: report.unmet.as_deref(),
        micros: report.micros,
    };
    // Serializing plain strings, numbers and JSON values cannot fail.
    serde_json::to_string(&line).unwrap_or_default()
}

pub(super) fn text_line(report: &StepReport, ok: bool) -> String {
    let mut line = match report.step {
        Some(step) => format!("step {step} {}", report.op),
        None => format!("step - {} (implicit)", report.op),
    };
    if let Some(name) = &report.name {
        line.push_str(&format!(" {name}"));
    }
    if let [only] = report.targets.as_slice() {
        if report.op == "call" || report.op == "kill_target" {
            line.push_str(&format!(" [target {}]", only.target));
        }
    }
    let status = if ok { "ok" } else { "FAILED" };
    match &report.outcome {
        Ok(Some(result)) => line.push_str(&format!(": {status} -> {}", cut(&result.to_string()))),
        Ok(None) => line.push_str(&format!(": {status}")),
        Err(error) if ok => line.push_str(&format!(": {status}, failed as expected: {error}")),
        Err(error) => line.push_str(&format!(": {status}: {error}")),
    }
    if let Some(hashid) = &report.hashid {
        // A failed register's error names the hashid already, if known.
        if report.op == "register" && !line.contains(hashid.as_str()) {
            line.push_str(&format!(" {hashid}"));
        }
    }
    if let Some(source) = &report.metadata {
        line.push_str(&format!(" (metadata: {source})"));
    }
    let lost: Vec<String> = report
        .targets
        .iter()
        // A failed call or register names each target's failure in its
        // error already.
        .filter(|t| t.outcome != "ok" && (t.outcome != "failed" || report.op == "start"))
        .map(|t| {
            let mut part = match &t.detail {
                Some(detail) => format!("target {} {} ({detail})", t.target, t.outcome),
                None => format!("target {} {}", t.target, t.outcome),
            };
            if let Some(replacement) = &t.replacement {
                part.push_str(&format!("; {replacement}"));
            }
            part
        })
        .collect();
    if !lost.is_empty() {
        line.push_str(&format!(" [{}]", lost.join(", ")));
    }
    // A replacement's start is left out: its pid differs on every run
    // (the `--json` line has it); its join or failure says enough. So
    // is the first loss of each target the line already names lost or
    // killed: the bracket above says why.
    let mut named: Vec<u16> = report
        .targets
        .iter()
        .filter(|t| t.outcome != "ok")
        .map(|t| t.target)
        .collect();
    let events: Vec<String> = report
        .target_events
        .iter()
        .filter(|event| match event {
            TargetEvent::Spawned { .. } => false,
            TargetEvent::Lost { target, .. } => match named.iter().position(|t| *t == target.0) {
                Some(at) => {
                    named.remove(at);
                    false
                }
                None => true,
            },
            _ => true,
        })
        .map(|event| one_line(&event.to_string()))
        .collect();
    if !events.is_empty() {
        line.push_str(&format!(" [{}]", events.join("; ")));
    }
    if let Some(unmet) = &report.unmet {
        line.push_str(&format!(" -- {unmet}"));
    }
    line.push_str(&format!(" ({})", duration_text(report.micros)));
    line
}

/// `text`, cut to [`RESULT_TEXT_CHARS`] characters.
fn cut(text: &str) -> String {
    match text.char_indices().nth(RESULT_TEXT_CHARS) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}
