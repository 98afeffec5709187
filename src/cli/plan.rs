//! The plan file of `callreg run` (`specs/plan.md` is the reference for
//! users; this is how it is read and checked): a JSON object
//!
//! ```json
//! {"targets": 4, "control_timeout_s": 30,
//!  "steps": [
//!    {"op": "register", "name": "add", "envelope": "payloads/add.spyc"},
//!    {"op": "start"},
//!    {"op": "call", "name": "add", "args": [2, 3], "target": 0, "expect": 5},
//!    {"op": "call_all", "name": "add", "args": [1, 1], "expect": 2},
//!    {"op": "unregister", "name": "add"},
//!    {"op": "call", "name": "add", "args": [1, 1], "expect_error": "not registered"},
//!    {"op": "kill_target", "target": 3}
//!  ]}
//! ```
//!
//! * `targets` (required): how many targets to fork, 1 to [`MAX_TARGETS`].
//! * `control_timeout_s` (optional, seconds from 0.001 to 86400, default
//!   30): how long a target
//!   has to answer a register or unregister, and to be ready at start.
//! * `respawn_limit` (optional, an integer from 0 to 65535, default 3, the
//!   Worker's): how many replacements of one target slot in a row may be
//!   lost before they join before the slot is given up
//!   (`WorkerBuilder::respawn_limit`, `specs/protocol.md` §2.9); 0: a lost
//!   target is not replaced.
//! * `respawn_backoff_s` (optional, seconds from 0 to 86400, default 0.1,
//!   the Worker's): the wait before the second replacement in a row of one
//!   slot, doubling for each further one (`WorkerBuilder::respawn_backoff`).
//! * `probe_first` (optional, a boolean, default true): whether a register
//!   of a callable no target has installed goes to one target first
//!   (`WorkerBuilder::probe_first`, `specs/protocol.md` §2.8).
//! * `steps` (required): run in order. Fields by `op`:
//!
//! | op | fields (`?` optional) |
//! |---|---|
//! | `register` | `name`, `envelope` (a SPYC file, relative to the plan file), `metadata?`, `expect_error?` |
//! | `start` | `expect_error?` |
//! | `unregister` | `name`, `expect_error?` |
//! | `call` | `name`, `target?`, `args?`, `kwargs?`, `expect?` or `expect_error?` |
//! | `call_all` | `name`, `args?`, `kwargs?`, `expect?` or `expect_error?` |
//! | `kill_target` | `target`, `expect_error?` |
//!
//! A register's callable metadata (`specs/metadata.md`) is its `metadata`
//! field — an inline JSON object, or a string: the path of a metadata JSON
//! file relative to the plan file — else the side-car `ENVELOPE.json`
//! (`NAME.spyc.json`, written by `python/callreg_envelope.py`) when it
//! exists next to the envelope, else none. It is parsed strictly
//! (`CallableMetadata::from_json`) when the plan is read. In its hooks
//! (`call_before` / `call_after`) a plan may write `"name": LABEL` instead
//! of `"hashid"`: the label of an earlier, still registered step, replaced
//! by the hashid of that step's envelope (hashids of cloudpickled code
//! depend on the packing interpreter, so a plan should not spell them out).
//!
//! Parsing is strict, like serde's `deny_unknown_fields`: an unknown field,
//! a field of the wrong type, a missing required field, a `name` used
//! before it is registered (or registered again while it labels a handle),
//! a `target` outside `0..targets`, a call before the Worker can be started
//! or a second `start` is a [`PlanError`] naming the step index and field.
//! What only running can tell (an envelope file that cannot be read, a
//! second unregister of a label) fails its step instead (`specs/plan.md`
//! §3).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde_json::{Map, Value};

use callreg::descriptor::python_serialized_digest;
use callreg::envelope::Envelope;
use callreg::json::value_type;
use callreg::metadata::{sidecar_path, CallableMetadata};

/// The most targets a plan may ask for.
pub const MAX_TARGETS: u16 = 1024;

/// The control timeout of a plan without `control_timeout_s`: 30 seconds.
pub const DEFAULT_CONTROL_TIMEOUT_S: f64 = 30.0;

/// The replacement limit of a plan without `respawn_limit`: the Worker's.
pub const DEFAULT_RESPAWN_LIMIT: u16 = callreg::protocol::DEFAULT_RESPAWN_LIMIT;

/// The respawn back-off of a plan without `respawn_backoff_s`: the
/// Worker's, in seconds.
pub const DEFAULT_RESPAWN_BACKOFF_S: f64 =
    callreg::protocol::DEFAULT_RESPAWN_BACKOFF as f64 / 1_000_000.0;

/// The shortest control timeout a plan may set: 1 ms (a zero timeout
/// would fail every operation; the Worker refuses it).
const MIN_CONTROL_TIMEOUT: Duration = Duration::from_millis(1);

/// The longest control timeout a plan may set: one day, in seconds.
const MAX_CONTROL_TIMEOUT_S: f64 = 86_400.0;

/// A parsed, checked plan.
#[derive(Clone, PartialEq, Debug)]
pub struct Plan {
    /// Number of targets to fork (1 to [`MAX_TARGETS`]).
    pub targets: u16,
    /// The Worker's control timeout.
    pub control_timeout: Duration,
    /// Replacements of one slot in a row that may be lost before they
    /// join (0: no replacements); passed to `WorkerBuilder::respawn_limit`.
    pub respawn_limit: u16,
    /// Passed to `WorkerBuilder::respawn_backoff`.
    pub respawn_backoff: Duration,
    /// Passed to `WorkerBuilder::probe_first`.
    pub probe_first: bool,
    /// The steps, in plan order.
    pub steps: Vec<Step>,
    /// The envelope files' bytes, by the path written in the plan.
    pub envelopes: BTreeMap<String, Vec<u8>>,
    /// Why an envelope file could not be read, by the path written in the
    /// plan: its register step fails with `IO_FAILED` when it runs, as a
    /// malformed envelope's fails with `ENVELOPE_INVALID`.
    pub unreadable: BTreeMap<String, String>,
}

/// One step of a plan.
#[derive(Clone, PartialEq, Debug)]
pub struct Step {
    /// What to do.
    pub op: Op,
    /// The error the step must fail with (a substring of the error line,
    /// which holds the error code and message), if any.
    pub expect_error: Option<String>,
}

/// The operation of a step, with its fields.
#[derive(Clone, PartialEq, Debug)]
pub enum Op {
    /// Register an envelope (before `start`: into the startup snapshot).
    Register(RegisterStep),
    /// Fork the targets (installs the startup snapshot).
    Start,
    /// Unregister the handle labelled `name`.
    Unregister {
        /// The handle's label.
        name: String,
    },
    /// Run one task on one target.
    Call(CallStep),
    /// Run one task on every live target.
    CallAll(CallStep),
    /// Kill a target with SIGKILL and wait until the Worker lost it, then
    /// until its replacement joined or it was given up.
    KillTarget {
        /// The target's index.
        target: u16,
    },
}

/// The fields of a `register` step.
#[derive(Clone, PartialEq, Debug)]
pub struct RegisterStep {
    /// The label of the handle the register returns.
    pub name: String,
    /// The envelope path as written in the plan (relative to the plan
    /// file); its bytes are in [`Plan::envelopes`].
    pub envelope: String,
    /// The callable metadata registered with it (inline, from a file, or
    /// from the envelope's side-car), if any.
    pub metadata: Option<Box<CallableMetadata>>,
    /// Where the metadata came from: `"inline"`, the file path as written
    /// in the plan, or the side-car's path relative to the plan file.
    pub metadata_source: Option<String>,
}

/// The fields of a `call` or `call_all` step.
#[derive(Clone, PartialEq, Debug)]
pub struct CallStep {
    /// The label of the handle to call.
    pub name: String,
    /// `call` only: the target to run on; `None` means any live target.
    pub target: Option<u16>,
    /// Positional arguments (a JSON array; empty when absent).
    pub args: Vec<Value>,
    /// Keyword arguments (a JSON object; empty when absent).
    pub kwargs: Map<String, Value>,
    /// The result the call must return (on every target for `call_all`).
    pub expect: Option<Value>,
}

/// Why a plan cannot run: one line, naming the step index and field when
/// the problem is in a step (e.g. `step 3 (call): field "target": 7 is not
/// a target of this plan (targets: 4)`).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct PlanError {
    /// The whole line, as [`std::fmt::Display`] prints it.
    pub message: String,
    /// The step's index, when the problem is in a step.
    pub step: Option<usize>,
    /// The field named, when the problem is in one field.
    pub field: Option<String>,
}

impl PlanError {
    /// An error about the plan as a whole.
    fn plan(message: String) -> PlanError {
        PlanError {
            message,
            step: None,
            field: None,
        }
    }
}

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Parses and checks the plan text `text`; envelope paths are read relative
/// to `plan_dir` (the plan file's directory).
///
/// # Errors
/// A [`PlanError`] when the text is not JSON, when a field is unknown,
/// missing or of the wrong type, when names or targets do not check (see
/// the module documentation), or when an envelope file cannot be read.
pub fn parse(text: &str, plan_dir: &Path) -> Result<Plan, PlanError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| PlanError::plan(format!("the plan is not valid JSON: {e}")))?;
    let Value::Object(mut top) = value else {
        return Err(PlanError::plan(format!(
            "the plan must be a JSON object, got {}",
            value_type(&value)
        )));
    };
    refuse_unknown(
        &top,
        &[
            "targets",
            "control_timeout_s",
            "respawn_limit",
            "respawn_backoff_s",
            "probe_first",
            "steps",
        ],
        "the plan",
    )?;
    let top_field = |field: &str, why: String| PlanError {
        message: format!("field {field:?}: {why}"),
        step: None,
        field: Some(field.to_owned()),
    };
    let targets = match top.get("targets") {
        None => {
            return Err(top_field(
                "targets",
                "missing (the number of targets to fork)".into(),
            ))
        }
        Some(v) => v
            .as_u64()
            .filter(|n| (1..=u64::from(MAX_TARGETS)).contains(n))
            .and_then(|n| u16::try_from(n).ok())
            .ok_or_else(|| {
                top_field(
                    "targets",
                    format!("expected an integer from 1 to {MAX_TARGETS}, got {v}"),
                )
            })?,
    };
    // The converted Duration is checked, not the float: a tiny positive
    // number such as 1e-10 would become a zero timeout.
    let control_timeout = match top.get("control_timeout_s") {
        None => Duration::from_secs_f64(DEFAULT_CONTROL_TIMEOUT_S),
        Some(v) => v
            .as_f64()
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .filter(|d| *d >= MIN_CONTROL_TIMEOUT && d.as_secs_f64() <= MAX_CONTROL_TIMEOUT_S)
            .ok_or_else(|| {
                top_field(
                    "control_timeout_s",
                    format!(
                        "expected seconds, from {} to {MAX_CONTROL_TIMEOUT_S}, got {v}",
                        MIN_CONTROL_TIMEOUT.as_secs_f64()
                    ),
                )
            })?,
    };
    let respawn_limit = match top.get("respawn_limit") {
        None => DEFAULT_RESPAWN_LIMIT,
        Some(v) => v
            .as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .ok_or_else(|| {
                top_field(
                    "respawn_limit",
                    format!("expected an integer from 0 to {}, got {v}", u16::MAX),
                )
            })?,
    };
    let respawn_backoff = match top.get("respawn_backoff_s") {
        None => Duration::from_secs_f64(DEFAULT_RESPAWN_BACKOFF_S),
        Some(v) => v
            .as_f64()
            .filter(|s| (0.0..=MAX_CONTROL_TIMEOUT_S).contains(s))
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .ok_or_else(|| {
                top_field(
                    "respawn_backoff_s",
                    format!("expected seconds, from 0 to {MAX_CONTROL_TIMEOUT_S}, got {v}"),
                )
            })?,
    };
    let probe_first = match top.get("probe_first") {
        None => true,
        Some(Value::Bool(probe)) => *probe,
        Some(v) => {
            return Err(top_field(
                "probe_first",
                format!("expected true or false, got {}", value_type(v)),
            ))
        }
    };
    let steps = match top.remove("steps") {
        None => return Err(top_field("steps", "missing (a list of steps)".into())),
        Some(Value::Array(steps)) => steps,
        Some(v) => {
            return Err(top_field(
                "steps",
                format!("expected an array, got {}", value_type(&v)),
            ))
        }
    };
    // Without a start step the Worker starts before the first step.
    let explicit_start = steps
        .iter()
        .any(|step| step.get("op").and_then(Value::as_str) == Some("start"));
    let mut checker = Checker {
        targets,
        plan_dir,
        labels: BTreeMap::new(),
        started: !explicit_start,
        envelopes: BTreeMap::new(),
        unreadable: BTreeMap::new(),
        hashids: BTreeMap::new(),
    };
    let steps = steps
        .into_iter()
        .enumerate()
        .map(|(index, step)| checker.step(index, step))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Plan {
        targets,
        control_timeout,
        respawn_limit,
        respawn_backoff,
        probe_first,
        steps,
        envelopes: checker.envelopes,
        unreadable: checker.unreadable,
    })
}

/// Whether a label names a handle at a point of the plan.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Label {
    /// Registered by the step with this index and not unregistered since.
    Registered(usize),
    /// Unregistered by the step with this index.
    Unregistered(usize),
}

/// Checks steps in order, tracking labels and the start.
struct Checker<'a> {
    targets: u16,
    plan_dir: &'a Path,
    labels: BTreeMap<String, Label>,
    started: bool,
    envelopes: BTreeMap<String, Vec<u8>>,
    unreadable: BTreeMap<String, String>,
    /// The hashid of each label's envelope (for hooks named by label).
    hashids: BTreeMap<String, String>,
}

impl Checker<'_> {
    fn step(&mut self, index: usize, step: Value) -> Result<Step, PlanError> {
        let Value::Object(fields) = step else {
            return Err(PlanError {
                message: format!(
                    "step {index}: expected an object with an \"op\" field, got {}",
                    value_type(&step)
                ),
                step: Some(index),
                field: None,
            });
        };
        let op = match fields.get("op") {
            Some(Value::String(op)) => op.clone(),
            Some(v) => {
                return Err(PlanError {
                    message: format!(
                        "step {index}: field \"op\": expected a string, got {}",
                        value_type(v)
                    ),
                    step: Some(index),
                    field: Some("op".to_owned()),
                })
            }
            None => {
                return Err(PlanError {
                    message: format!("step {index}: field \"op\" is missing"),
                    step: Some(index),
                    field: Some("op".to_owned()),
                })
            }
        };
        let at = StepFields {
            index,
            op: &op,
            fields: &fields,
        };
        let expect_error = at.optional_string("expect_error")?;
        let op = match op.as_str() {
            "register" => {
                at.allow(&["name", "envelope", "metadata", "expect_error"])?;
                let name = at.name()?;
                if let Some(Label::Registered(earlier)) = self.labels.get(&name) {
                    return Err(at.field_error(
                        "name",
                        format!("{name:?} already labels the handle of step {earlier}; unregister it first"),
                    ));
                }
                let envelope = at.required_string("envelope")?;
                self.read_envelope(&envelope);
                let (metadata, metadata_source) = match self.read_metadata(&at, &envelope)? {
                    Some((metadata, source)) => (Some(Box::new(metadata)), Some(source)),
                    None => (None, None),
                };
                self.labels.insert(name.clone(), Label::Registered(index));
                if let Some(hashid) = self
                    .envelopes
                    .get(&envelope)
                    .and_then(|bytes| Envelope::parse(bytes).ok())
                    .map(|e| python_serialized_digest(&e).hashid().to_string())
                {
                    self.hashids.insert(name.clone(), hashid);
                }
                Op::Register(RegisterStep {
                    name,
                    envelope,
                    metadata,
                    metadata_source,
                })
            }
            "start" => {
                at.allow(&["expect_error"])?;
                if self.started {
                    return Err(at.error("the Worker is already started (one start per plan)".into()));
                }
                self.started = true;
                Op::Start
            }
            "unregister" => {
                at.allow(&["name", "expect_error"])?;
                let name = at.name()?;
                // Unregistering a label a second time is a step that fails
                // when it runs (HANDLE_STALE), like killing a target twice.
                match self.labels.get(&name) {
                    Some(Label::Registered(_)) => {
                        self.labels.insert(name.clone(), Label::Unregistered(index));
                    }
                    Some(Label::Unregistered(_)) => {}
                    None => return Err(at.unknown_name(&name)),
                }
                Op::Unregister { name }
            }
            "call" | "call_all" => {
                let all = op == "call_all";
                if all {
                    at.allow(&["name", "args", "kwargs", "expect", "expect_error"])?;
                } else {
                    at.allow(&["name", "target", "args", "kwargs", "expect", "expect_error"])?;
                }
                let name = at.name()?;
                if !self.labels.contains_key(&name) {
                    return Err(at.unknown_name(&name));
                }
                let target = if all { None } else { at.optional_target(self.targets)? };
                let args = match fields.get("args") {
                    None => Vec::new(),
                    Some(Value::Array(args)) => args.clone(),
                    Some(v) => {
                        return Err(at.field_error(
                            "args",
                            format!("expected an array, got {}", value_type(v)),
                        ))
                    }
                };
                let kwargs = match fields.get("kwargs") {
                    None => Map::new(),
                    Some(Value::Object(kwargs)) => kwargs.clone(),
                    Some(v) => {
                        return Err(at.field_error(
                            "kwargs",
                            format!("expected an object, got {}", value_type(v)),
                        ))
                    }
                };
                let expect = fields.get("expect").cloned();
                if expect.is_some() && expect_error.is_some() {
                    return Err(at.error(
                        "\"expect\" and \"expect_error\" exclude each other".into(),
                    ));
                }
                self.require_started(&at)?;
                let step = CallStep {
                    name,
                    target,
                    args,
                    kwargs,
                    expect,
                };
                if all {
                    Op::CallAll(step)
                } else {
                    Op::Call(step)
                }
            }
            "kill_target" => {
                at.allow(&["target", "expect_error"])?;
                let target = at
                    .optional_target(self.targets)?
                    .ok_or_else(|| at.field_error("target", "missing (the target to kill)".into()))?;
                self.require_started(&at)?;
                Op::KillTarget { target }
            }
            other => {
                return Err(at.field_error(
                    "op",
                    format!(
                        "unknown operation {other:?} (expected register, start, unregister, call, call_all or kill_target)"
                    ),
                ))
            }
        };
        Ok(Step { op, expect_error })
    }

    /// Refuses a step that needs running targets before the start step.
    fn require_started(&self, at: &StepFields<'_>) -> Result<(), PlanError> {
        if self.started {
            Ok(())
        } else {
            Err(at.error(
                "the Worker is not started yet (only register and unregister come before the \"start\" step)"
                    .into(),
            ))
        }
    }

    /// A register step's metadata with its source: the `metadata` field
    /// (inline object, or a file path relative to the plan), else the
    /// envelope's side-car when it exists.
    fn read_metadata(
        &self,
        at: &StepFields<'_>,
        envelope: &str,
    ) -> Result<Option<(CallableMetadata, String)>, PlanError> {
        let parse = |text: &str, source: &str| {
            let text = self.resolve_hook_names(at, text, source)?;
            CallableMetadata::from_json(&text)
                .map_err(|e| at.field_error("metadata", format!("{source}: {e}")))
        };
        match at.fields.get("metadata") {
            Some(Value::Object(object)) => {
                let text = Value::Object(object.clone()).to_string();
                Ok(Some((parse(&text, "inline")?, "inline".to_owned())))
            }
            Some(Value::String(path)) if !path.is_empty() => {
                let text = super::input::read_text(self.plan_dir.join(path)).map_err(|why| {
                    at.field_error("metadata", format!("cannot read {path}: {why}"))
                })?;
                Ok(Some((parse(&text, path)?, path.clone())))
            }
            Some(Value::String(_)) => Err(at.field_error("metadata", "must not be empty".into())),
            Some(v) => Err(at.field_error(
                "metadata",
                format!("expected an object or a file path, got {}", value_type(v)),
            )),
            None => {
                let relative = sidecar_path(Path::new(envelope));
                let full = self.plan_dir.join(&relative);
                if !full.exists() {
                    return Ok(None);
                }
                let source = relative.display().to_string();
                let text = super::input::read_text(&full).map_err(|why| {
                    at.field_error("metadata", format!("cannot read side-car {source}: {why}"))
                })?;
                Ok(Some((parse(&text, &source)?, source)))
            }
        }
    }

    /// Replaces, in a metadata document's `call_before` / `call_after`
    /// entries, a `"name": LABEL` (a plan-only shorthand) by the `"hashid"`
    /// of the envelope that label's register step names, so a plan need not
    /// spell out hashids that depend on the packing interpreter. Anything
    /// else is left for strict parsing.
    fn resolve_hook_names(
        &self,
        at: &StepFields<'_>,
        text: &str,
        source: &str,
    ) -> Result<String, PlanError> {
        let Ok(mut document) = serde_json::from_str::<Value>(text) else {
            return Ok(text.to_owned());
        };
        for list in ["call_before", "call_after"] {
            let Some(Value::Array(hooks)) = document.get_mut(list) else {
                continue;
            };
            for (position, hook) in hooks.iter_mut().enumerate() {
                let Some(hook) = hook.as_object_mut() else {
                    continue;
                };
                let Some(label) = hook.get("name").cloned() else {
                    continue;
                };
                let field = format!("{source}: at {list}[{position}].name");
                let Value::String(label) = label else {
                    return Err(at.field_error("metadata", format!("{field}: expected a string")));
                };
                let Some(Label::Registered(_)) = self.labels.get(&label) else {
                    return Err(at.field_error(
                        "metadata",
                        format!("{field}: {label:?} does not label a registered handle here"),
                    ));
                };
                let Some(hashid) = self.hashids.get(&label) else {
                    return Err(at.field_error(
                        "metadata",
                        format!("{field}: the envelope of {label:?} is not a valid SPYC envelope"),
                    ));
                };
                if hook.contains_key("hashid") {
                    return Err(at.field_error(
                        "metadata",
                        format!("{field}: give \"name\" or \"hashid\", not both"),
                    ));
                }
                hook.remove("name");
                hook.insert("hashid".to_owned(), Value::String(hashid.clone()));
            }
        }
        Ok(document.to_string())
    }

    /// Reads an envelope file once, relative to the plan's directory.
    /// One that cannot be read is recorded in [`Plan::unreadable`].
    fn read_envelope(&mut self, envelope: &str) {
        if self.envelopes.contains_key(envelope) || self.unreadable.contains_key(envelope) {
            return;
        }
        // The header first, then at most the payload it declares; a FIFO
        // or a device is refused before anything is read.
        match super::input::read_envelope(self.plan_dir.join(envelope)) {
            Ok(bytes) => {
                self.envelopes.insert(envelope.to_owned(), bytes);
            }
            Err(why) => {
                self.unreadable.insert(envelope.to_owned(), why);
            }
        }
    }
}

/// One step's fields, for reading them with errors that name the step.
struct StepFields<'a> {
    index: usize,
    op: &'a str,
    fields: &'a Map<String, Value>,
}

impl StepFields<'_> {
    fn error(&self, why: String) -> PlanError {
        PlanError {
            message: format!("step {} ({}): {why}", self.index, self.op),
            step: Some(self.index),
            field: None,
        }
    }

    fn field_error(&self, field: &str, why: String) -> PlanError {
        PlanError {
            field: Some(field.to_owned()),
            ..self.error(format!("field {field:?}: {why}"))
        }
    }

    fn unknown_name(&self, name: &str) -> PlanError {
        self.field_error(
            "name",
            format!("{name:?} is not the name of any earlier register step"),
        )
    }

    /// Refuses fields other than `op` and `allowed`.
    fn allow(&self, allowed: &[&str]) -> Result<(), PlanError> {
        let mut known = vec!["op"];
        known.extend_from_slice(allowed);
        refuse_unknown(
            self.fields,
            &known,
            &format!("step {} ({})", self.index, self.op),
        )
        .map_err(|e| PlanError {
            step: Some(self.index),
            ..e
        })
    }

    fn optional_string(&self, field: &str) -> Result<Option<String>, PlanError> {
        match self.fields.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => {
                Err(self.field_error(field, format!("expected a string, got {}", value_type(v))))
            }
        }
    }

    fn required_string(&self, field: &str) -> Result<String, PlanError> {
        match self.optional_string(field)? {
            Some(s) if !s.is_empty() => Ok(s),
            Some(_) => Err(self.field_error(field, "must not be empty".into())),
            None => Err(self.field_error(field, "missing".into())),
        }
    }

    fn name(&self) -> Result<String, PlanError> {
        self.required_string("name")
    }

    fn optional_target(&self, targets: u16) -> Result<Option<u16>, PlanError> {
        match self.fields.get("target") {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(t) if t < u64::from(targets) => Ok(u16::try_from(t).ok()),
                Some(t) => Err(self.field_error(
                    "target",
                    format!(
                        "{t} is not a target of this plan (targets: {targets}, numbered from 0)"
                    ),
                )),
                None => Err(self.field_error(
                    "target",
                    format!("expected a target index (an integer from 0), got {v}"),
                )),
            },
        }
    }
}

/// Refuses any key of `object` not in `known`.
fn refuse_unknown(
    object: &Map<String, Value>,
    known: &[&str],
    what: &str,
) -> Result<(), PlanError> {
    match object.keys().find(|k| !known.contains(&k.as_str())) {
        None => Ok(()),
        Some(unknown) => Err(PlanError {
            message: format!(
                "{what}: unknown field {unknown:?} (expected one of {})",
                known
                    .iter()
                    .map(|k| format!("{k:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            step: None,
            field: Some(unknown.clone()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_text(text: &str) -> Result<Plan, PlanError> {
        parse(text, Path::new("."))
    }

    fn error(text: &str) -> String {
        parse_text(text).expect_err("the plan is refused").message
    }

    #[test]
    fn a_plan_without_registers_parses_with_defaults() {
        let plan = parse_text(
            r#"{"targets": 2, "steps": [{"op": "start"}, {"op": "kill_target", "target": 1, "expect_error": "x"}]}"#,
        )
        .expect("valid plan");
        assert_eq!(plan.targets, 2);
        assert_eq!(plan.control_timeout, Duration::from_secs(30));
        assert_eq!((plan.respawn_limit, plan.probe_first), (3, true));
        assert_eq!(
            plan.steps,
            vec![
                Step {
                    op: Op::Start,
                    expect_error: None
                },
                Step {
                    op: Op::KillTarget { target: 1 },
                    expect_error: Some("x".to_owned())
                },
            ]
        );
    }

    #[test]
    fn register_metadata_comes_from_the_step_a_file_or_the_side_car() {
        let dir = std::env::temp_dir().join(format!("callreg-plan-meta-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let hook_envelope = callreg::envelope::encode(b"hook payload");
        std::fs::write(dir.join("hook.spyc"), &hook_envelope).unwrap();
        std::fs::write(dir.join("f.spyc"), b"bytes").unwrap();
        std::fs::write(dir.join("g.spyc"), b"bytes").unwrap();
        std::fs::write(dir.join("g.spyc.json"), r#"{"name": "from side-car"}"#).unwrap();
        std::fs::write(dir.join("m.json"), r#"{"name": "from file"}"#).unwrap();
        let plan = r#"{"targets": 1, "steps": [
            {"op": "register", "name": "hook", "envelope": "hook.spyc"},
            {"op": "register", "name": "a", "envelope": "f.spyc",
             "metadata": {"name": "inline", "call_before": [{"name": "hook", "retval_keyword": "c"}]}},
            {"op": "register", "name": "b", "envelope": "f.spyc", "metadata": "m.json"},
            {"op": "register", "name": "c", "envelope": "g.spyc"},
            {"op": "register", "name": "d", "envelope": "g.spyc", "metadata": "m.json"}]}"#;
        let unknown_hook = r#"{"targets": 1, "steps": [
            {"op": "register", "name": "a", "envelope": "f.spyc",
             "metadata": {"name": "x", "call_after": [{"name": "nope"}]}}]}"#;
        let invalid = r#"{"targets": 1, "steps": [
            {"op": "register", "name": "a", "envelope": "f.spyc", "metadata": {"name": "x", "colour": 1}}]}"#;
        let wrong_type = r#"{"targets": 1, "steps": [
            {"op": "register", "name": "a", "envelope": "f.spyc", "metadata": 3}]}"#;
        let results = (
            parse(plan, &dir),
            parse(unknown_hook, &dir),
            parse(invalid, &dir),
            parse(wrong_type, &dir),
        );
        let _ = std::fs::remove_dir_all(&dir);
        let plan = results.0.expect("valid plan");
        let registered: Vec<(Option<String>, Option<String>)> = plan
            .steps
            .iter()
            .map(|step| match &step.op {
                Op::Register(r) => (
                    r.metadata.as_ref().map(|m| m.name.clone()),
                    r.metadata_source.clone(),
                ),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            registered,
            vec![
                (None, None),
                (Some("inline".into()), Some("inline".into())),
                (Some("from file".into()), Some("m.json".into())),
                (Some("from side-car".into()), Some("g.spyc.json".into())),
                (Some("from file".into()), Some("m.json".into())),
            ]
        );
        let Op::Register(inline) = &plan.steps[1].op else {
            panic!("a register");
        };
        let hook = &inline.metadata.as_ref().unwrap().call_before[0];
        let expected = python_serialized_digest(&Envelope::parse(&hook_envelope).unwrap()).hashid();
        assert_eq!(hook.hashid, expected);
        assert_eq!(hook.retval_keyword.as_deref(), Some("c"));
        assert_eq!(
            results.1.unwrap_err().message,
            r#"step 0 (register): field "metadata": inline: at call_after[0].name: "nope" does not label a registered handle here"#
        );
        assert_eq!(
            results.2.unwrap_err().message,
            r#"step 0 (register): field "metadata": inline: at colour: unknown field `colour`, expected one of `name`, `python`, `executor`, `executor_data`, `deps`, `call_before`, `call_after`"#
        );
        assert_eq!(
            results.3.unwrap_err().message,
            r#"step 0 (register): field "metadata": expected an object or a file path, got a number"#
        );
    }

    #[test]
    fn labels_follow_register_and_unregister() {
        let dir = std::env::temp_dir().join(format!("callreg-plan-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("f.spyc"), b"bytes").unwrap();
        let reuse = r#"{"targets": 1, "steps": [
            {"op": "register", "name": "f", "envelope": "f.spyc"},
            {"op": "register", "name": "f", "envelope": "f.spyc"}]}"#;
        let again = r#"{"targets": 1, "steps": [
            {"op": "register", "name": "f", "envelope": "f.spyc"},
            {"op": "unregister", "name": "f"},
            {"op": "unregister", "name": "f"}]}"#;
        let cycle = r#"{"targets": 1, "steps": [
            {"op": "register", "name": "f", "envelope": "f.spyc"},
            {"op": "unregister", "name": "f"},
            {"op": "register", "name": "f", "envelope": "f.spyc"},
            {"op": "call_all", "name": "f", "args": [1], "kwargs": {"k": 2}, "expect": 3}]}"#;
        let both = r#"{"targets": 1, "steps": [
            {"op": "register", "name": "f", "envelope": "f.spyc"},
            {"op": "call", "name": "f", "expect": 1, "expect_error": "x"}]}"#;
        let results = (
            parse(reuse, &dir),
            parse(again, &dir),
            parse(cycle, &dir),
            parse(both, &dir),
        );
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            results.0.unwrap_err().message,
            r#"step 1 (register): field "name": "f" already labels the handle of step 0; unregister it first"#
        );
        // A second unregister is a step that fails when it runs.
        let again = results.1.expect("a valid plan");
        assert_eq!(
            again.steps[1..]
                .iter()
                .map(|step| step.op.clone())
                .collect::<Vec<_>>(),
            vec![
                Op::Unregister {
                    name: "f".to_owned()
                },
                Op::Unregister {
                    name: "f".to_owned()
                }
            ]
        );
        let plan = results.2.expect("a valid plan");
        assert_eq!(
            plan.envelopes.get("f.spyc").map(Vec::as_slice),
            Some(&b"bytes"[..])
        );
        let mut kwargs = Map::new();
        kwargs.insert("k".to_owned(), Value::from(2));
        assert_eq!(
            plan.steps[3],
            Step {
                op: Op::CallAll(CallStep {
                    name: "f".to_owned(),
                    target: None,
                    args: vec![Value::from(1)],
                    kwargs,
                    expect: Some(Value::from(3)),
                }),
                expect_error: None,
            }
        );
        assert_eq!(
            results.3.unwrap_err().message,
            r#"step 1 (call): "expect" and "expect_error" exclude each other"#
        );
    }

    #[test]
    fn errors_name_the_step_and_field() {
        assert_eq!(
            error(r#"{"targets": 1, "control_timeout_s": -1, "steps": []}"#),
            r#"field "control_timeout_s": expected seconds, from 0.001 to 86400, got -1"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "control_timeout_s": 1e-10, "steps": []}"#),
            r#"field "control_timeout_s": expected seconds, from 0.001 to 86400, got 1e-10"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "control_timeout_s": 86400.5, "steps": []}"#),
            r#"field "control_timeout_s": expected seconds, from 0.001 to 86400, got 86400.5"#
        );
        assert_eq!(
            parse(
                r#"{"targets": 1, "control_timeout_s": 0.001, "steps": []}"#,
                Path::new(".")
            )
            .unwrap()
            .control_timeout,
            Duration::from_millis(1)
        );
        assert_eq!(
            error(
                r#"{"targets": 1, "steps": [{"op": "start"}, {"op": "register", "name": "f", "envelope": 3}]}"#
            ),
            r#"step 1 (register): field "envelope": expected a string, got a number"#
        );
        assert_eq!(
            error(
                r#"{"targets": 2, "steps": [{"op": "kill_target", "target": 0}, {"op": "start"}]}"#
            ),
            r#"step 0 (kill_target): the Worker is not started yet (only register and unregister come before the "start" step)"#
        );
        assert_eq!(
            error(r#"{"targets": 2, "steps": [{"op": "start", "name": "x"}]}"#),
            r#"step 0 (start): unknown field "name" (expected one of "op", "expect_error")"#
        );
        assert_eq!(
            error(r#"{"targets": 2, "steps": [{"op": "kill_target", "target": 2}]}"#),
            r#"step 0 (kill_target): field "target": 2 is not a target of this plan (targets: 2, numbered from 0)"#
        );
        assert_eq!(
            error(r#"{"targets": 2, "steps": [{"op": "start"}, {"op": "call", "name": "f"}]}"#),
            r#"step 1 (call): field "name": "f" is not the name of any earlier register step"#
        );
        assert_eq!(
            error(r#"{"targets": 2, "steps": [{"op": "start"}, {"op": "start"}]}"#),
            r#"step 1 (start): the Worker is already started (one start per plan)"#
        );
        assert_eq!(
            error(r#"{"targets": 2, "steps": [{"op": "jump"}]}"#),
            r#"step 0 (jump): field "op": unknown operation "jump" (expected register, start, unregister, call, call_all or kill_target)"#
        );
        assert_eq!(
            error(r#"{"targets": 0, "steps": []}"#),
            r#"field "targets": expected an integer from 1 to 1024, got 0"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "steps": [], "extra": 1}"#),
            r#"the plan: unknown field "extra" (expected one of "targets", "control_timeout_s", "respawn_limit", "respawn_backoff_s", "probe_first", "steps")"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "respawn_limit": 65536, "steps": []}"#),
            r#"field "respawn_limit": expected an integer from 0 to 65535, got 65536"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "respawn_limit": -1, "steps": []}"#),
            r#"field "respawn_limit": expected an integer from 0 to 65535, got -1"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "respawn_limit": 1.5, "steps": []}"#),
            r#"field "respawn_limit": expected an integer from 0 to 65535, got 1.5"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "probe_first": "no", "steps": []}"#),
            r#"field "probe_first": expected true or false, got a string"#
        );
        let plan =
            parse_text(r#"{"targets": 1, "respawn_limit": 0, "probe_first": false, "steps": []}"#)
                .expect("a valid plan");
        assert_eq!((plan.respawn_limit, plan.probe_first), (0, false));
        assert_eq!(
            parse_text(r#"{"targets": 1, "respawn_backoff_s": 0, "steps": []}"#)
                .unwrap()
                .respawn_backoff,
            Duration::ZERO
        );
        for bad in ["-1", "86400.5", "\"1\"", "true"] {
            assert_eq!(
                error(&format!(
                    r#"{{"targets": 1, "respawn_backoff_s": {bad}, "steps": []}}"#
                )),
                format!(
                    r#"field "respawn_backoff_s": expected seconds, from 0 to 86400, got {bad}"#
                )
            );
        }
        let plan = parse_text(r#"{"targets": 1, "respawn_limit": 65535, "steps": []}"#)
            .expect("a valid plan");
        assert_eq!(plan.respawn_limit, 65535);
        // A missing envelope is no plan error: its step fails when it runs.
        let plan = parse(
            r#"{"targets": 1, "steps": [{"op": "register", "name": "f", "envelope": "missing.spyc"}]}"#,
            Path::new("."),
        )
        .expect("a valid plan");
        assert_eq!(
            plan.unreadable.get("missing.spyc").map(String::as_str),
            Some("No such file or directory")
        );
        assert!(plan.envelopes.is_empty());
    }

    #[test]
    fn errors_name_their_step_and_field() {
        let error = parse(
            r#"{"targets": 1, "steps": [{"op": "start"}, {"op": "call", "name": "f", "colour": 1}]}"#,
            Path::new("."),
        )
        .unwrap_err();
        assert_eq!(
            (error.step, error.field.as_deref()),
            (Some(1), Some("colour"))
        );
        let error = parse(
            r#"{"targets": 1, "steps": [{"op": "start"}, {"op": "call", "name": "g"}]}"#,
            Path::new("."),
        )
        .unwrap_err();
        assert_eq!(
            (error.step, error.field.as_deref()),
            (Some(1), Some("name"))
        );
        let error = parse(r#"{"targets": 0, "steps": []}"#, Path::new(".")).unwrap_err();
        assert_eq!(
            (error.step, error.field.as_deref()),
            (None, Some("targets"))
        );
        let error = parse("[]", Path::new(".")).unwrap_err();
        assert_eq!((error.step, error.field), (None, None));
    }
}
