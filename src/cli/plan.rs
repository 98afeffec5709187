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
//!   Worker's): how many replacements of one target in a row may be
//!   lost before they join before the target is given up
//!   (`WorkerBuilder::respawn_limit`, `specs/protocol.md` §2.9); 0: a lost
//!   target is not replaced.
//! * `respawn_backoff_s` (optional, seconds from 0 to 86400, default 0.1,
//!   the Worker's): the wait before the second replacement in a row of one
//!   target, doubling for each further one (`WorkerBuilder::respawn_backoff`).
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
//! (`NAME.spyc.json`, written by `python/tools/callreg_envelope.py`) when it
//! exists next to the envelope, else none. It is parsed strictly
//! (`CallableMetadata::from_json`) when the plan is read. In its hooks
//! (`call_before` / `call_after`) a plan may write `"name": LABEL` instead
//! of `"hashid"`: the label of an earlier, still registered step, replaced
//! by the hashid of that step's envelope (hashids of cloudpickled code
//! depend on the packing interpreter, so a plan should not spell them out).
//!
//! Parsing is strict: the text is decoded into serde types with
//! `deny_unknown_fields` (an unknown field, a field of the wrong type or out
//! of range, a missing required field is refused with its JSON path), then
//! one checking pass refuses a `name` used
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
const MIN_CONTROL_TIMEOUT_MICROS: u64 = 1000;

/// The longest control timeout a plan may set: one day, in seconds.
const MAX_CONTROL_TIMEOUT_S: f64 = 86_400.0;

/// A parsed, checked plan.
#[derive(Clone, PartialEq, Debug)]
pub struct Plan {
    /// Number of targets to fork (1 to [`MAX_TARGETS`]).
    pub targets: u16,
    /// The Worker's control timeout.
    pub control_timeout: Duration,
    /// Replacements of one target in a row that may be lost before they
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
/// The text is decoded into the serde types of [`file`] (strict: unknown
/// fields, wrong types and values out of range are refused with the JSON
/// path of the field), then one pass checks what depends on the order of
/// the steps (labels, the start, target indices) and reads the envelopes
/// and metadata.
///
/// # Errors
/// A [`PlanError`] when the text is not JSON, when a field is unknown,
/// missing or of the wrong type, when names or targets do not check (see
/// the module documentation), or when metadata cannot be read.
pub fn parse(text: &str, plan_dir: &Path) -> Result<Plan, PlanError> {
    let file = file::PlanFile::decode(text)?;
    // Without a start step the Worker starts before the first step.
    let explicit_start = file
        .steps
        .iter()
        .any(|(_, step)| matches!(step, file::StepFile::Start(_)));
    let mut checker = Checker {
        targets: file.targets.0,
        plan_dir,
        labels: BTreeMap::new(),
        started: !explicit_start,
        envelopes: BTreeMap::new(),
        unreadable: BTreeMap::new(),
        hashids: BTreeMap::new(),
    };
    let steps = file
        .steps
        .into_iter()
        .enumerate()
        .map(|(index, (op, step))| checker.step(index, &op, step))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Plan {
        targets: checker.targets,
        control_timeout: file.control_timeout_s.0,
        respawn_limit: file.respawn_limit.0,
        respawn_backoff: file.respawn_backoff_s.0,
        probe_first: file.probe_first,
        steps,
        envelopes: checker.envelopes,
        unreadable: checker.unreadable,
    })
}

/// The plan file as written: serde types that refuse unknown fields, wrong
/// types and values out of range, naming the field's JSON path.
mod file {
    use std::fmt;
    use std::marker::PhantomData;
    use std::time::Duration;

    use serde::de::{self, DeserializeOwned, Deserializer, Unexpected, Visitor};
    use serde::Deserialize;
    use serde_json::{Map, Number, Value};

    use callreg::json::value_type;

    use super::{PlanError, MAX_CONTROL_TIMEOUT_S, MAX_TARGETS, MIN_CONTROL_TIMEOUT_MICROS};

    /// The plan object (`specs/plan.md` §1). `steps` holds each step's
    /// `op` with its decoded fields.
    #[derive(Debug)]
    pub(super) struct PlanFile {
        pub targets: Int<1, { MAX_TARGETS as u64 }, u16>,
        pub control_timeout_s: Seconds<MIN_CONTROL_TIMEOUT_MICROS>,
        pub respawn_limit: Int<0, { u16::MAX as u64 }, u16>,
        pub respawn_backoff_s: Seconds<0>,
        pub probe_first: bool,
        pub steps: Vec<(String, StepFile)>,
    }

    /// The top-level fields; `steps` are decoded one by one afterwards so
    /// that their errors name the step index and its `op`.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct TopFile {
        targets: Int<1, { MAX_TARGETS as u64 }, u16>,
        #[serde(default = "default_control_timeout")]
        control_timeout_s: Seconds<MIN_CONTROL_TIMEOUT_MICROS>,
        #[serde(default = "default_respawn_limit")]
        respawn_limit: Int<0, { u16::MAX as u64 }, u16>,
        #[serde(default = "default_respawn_backoff")]
        respawn_backoff_s: Seconds<0>,
        #[serde(default = "default_probe_first")]
        probe_first: bool,
        steps: Vec<Value>,
    }

    fn default_control_timeout() -> Seconds<MIN_CONTROL_TIMEOUT_MICROS> {
        Seconds(Duration::from_secs_f64(super::DEFAULT_CONTROL_TIMEOUT_S))
    }

    fn default_respawn_limit() -> Int<0, { u16::MAX as u64 }, u16> {
        Int(super::DEFAULT_RESPAWN_LIMIT)
    }

    fn default_respawn_backoff() -> Seconds<0> {
        Seconds(Duration::from_secs_f64(super::DEFAULT_RESPAWN_BACKOFF_S))
    }

    fn default_probe_first() -> bool {
        true
    }

    /// One step: the variant is its `op`, the fields are the variant's
    /// (each refuses the fields of other operations).
    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub(super) enum StepFile {
        Register(RegisterFile),
        Start(StartFile),
        Unregister(UnregisterFile),
        Call(CallFile),
        CallAll(CallAllFile),
        KillTarget(KillTargetFile),
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct RegisterFile {
        pub name: NonEmpty,
        pub envelope: NonEmpty,
        #[serde(default, deserialize_with = "present")]
        pub metadata: Option<MetadataFile>,
        #[serde(default, deserialize_with = "present")]
        pub expect_error: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct StartFile {
        #[serde(default, deserialize_with = "present")]
        pub expect_error: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct UnregisterFile {
        pub name: NonEmpty,
        #[serde(default, deserialize_with = "present")]
        pub expect_error: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct CallFile {
        pub name: NonEmpty,
        #[serde(default, deserialize_with = "present")]
        pub target: Option<TargetIndex>,
        #[serde(default)]
        pub args: Vec<Value>,
        #[serde(default)]
        pub kwargs: Map<String, Value>,
        #[serde(default, deserialize_with = "present")]
        pub expect: Option<Value>,
        #[serde(default, deserialize_with = "present")]
        pub expect_error: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct CallAllFile {
        pub name: NonEmpty,
        #[serde(default)]
        pub args: Vec<Value>,
        #[serde(default)]
        pub kwargs: Map<String, Value>,
        #[serde(default, deserialize_with = "present")]
        pub expect: Option<Value>,
        #[serde(default, deserialize_with = "present")]
        pub expect_error: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct KillTargetFile {
        pub target: TargetIndex,
        #[serde(default, deserialize_with = "present")]
        pub expect_error: Option<String>,
    }

    /// An optional field that, when present, holds a `T` (`null` included:
    /// `"expect": null` expects `None`, and `"expect_error": null` is
    /// refused as not a string).
    fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
    ) -> Result<Option<T>, D::Error> {
        T::deserialize(d).map(Some)
    }

    impl PlanFile {
        /// Decodes the plan text.
        pub fn decode(text: &str) -> Result<PlanFile, PlanError> {
            let value: Value = serde_json::from_str(text)
                .map_err(|e| PlanError::plan(format!("the plan is not valid JSON: {e}")))?;
            callreg::json::unique_keys(text).map_err(|e| {
                PlanError::plan(if e.path == "." {
                    format!("the plan: {}", e.message)
                } else {
                    format!("the plan: at {}: {}", e.path, e.message)
                })
            })?;
            if !value.is_object() {
                return Err(PlanError::plan(format!(
                    "the plan must be a JSON object, got {}",
                    value_type(&value)
                )));
            }
            let top: TopFile = decode(value).map_err(|(path, why)| PlanError {
                message: match &path {
                    Some(path) if !names_its_field(&why) => format!("field {path:?}: {why}"),
                    _ => format!("the plan: {why}"),
                },
                step: None,
                field: path,
            })?;
            let steps = top
                .steps
                .into_iter()
                .enumerate()
                .map(|(index, step)| decode_step(index, step))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(PlanFile {
                targets: top.targets,
                control_timeout_s: top.control_timeout_s,
                respawn_limit: top.respawn_limit,
                respawn_backoff_s: top.respawn_backoff_s,
                probe_first: top.probe_first,
                steps,
            })
        }
    }

    /// Decodes one step: an object whose `op` names the variant.
    fn decode_step(index: usize, step: Value) -> Result<(String, StepFile), PlanError> {
        let at = |op: Option<&str>, field: Option<String>, why: String| PlanError {
            message: match (op, &field) {
                (Some(op), Some(field)) if !names_its_field(&why) => {
                    format!("step {index} ({op}): field {field:?}: {why}")
                }
                (Some(op), _) => format!("step {index} ({op}): {why}"),
                (None, Some(field)) => format!("step {index}: field {field:?}: {why}"),
                (None, None) => format!("step {index}: {why}"),
            },
            step: Some(index),
            field,
        };
        let Value::Object(mut fields) = step else {
            return Err(at(
                None,
                None,
                format!(
                    "expected an object with an \"op\" field, got {}",
                    value_type(&step)
                ),
            ));
        };
        let op = match fields.remove("op") {
            Some(Value::String(op)) => op,
            Some(v) => {
                return Err(at(
                    None,
                    Some("op".into()),
                    format!("expected a string, got {}", value_type(&v)),
                ))
            }
            None => return Err(at(None, Some("op".into()), "missing".into())),
        };
        // The externally tagged form {op: fields} keeps the field paths
        // (an internally tagged enum buffers the fields and loses them).
        let tagged = Value::Object(Map::from_iter([(op.clone(), Value::Object(fields))]));
        match decode::<StepFile>(tagged) {
            Ok(step) => Ok((op, step)),
            // Not a field of the variant: the op itself is unknown.
            Err((None, why)) if why.starts_with("unknown variant") => Err(at(
                Some(&op),
                Some("op".into()),
                format!(
                    "unknown operation {op:?} (expected register, start, unregister, call, call_all or kill_target)"
                ),
            )),
            Err((path, why)) => Err(at(Some(&op), path, why)),
        }
    }

    /// Decodes `value` as `T`: on failure the path of the offending field
    /// (below the variant of a step; `None` for the object itself) and
    /// serde's reason.
    fn decode<T: DeserializeOwned>(value: Value) -> Result<T, (Option<String>, String)> {
        serde_path_to_error::deserialize(value).map_err(|err| {
            let segments: Vec<String> = err
                .path()
                .iter()
                .filter_map(|segment| match segment {
                    serde_path_to_error::Segment::Map { key } => Some(key.clone()),
                    serde_path_to_error::Segment::Seq { index } => Some(format!("[{index}]")),
                    // The step's variant: its op, named apart.
                    serde_path_to_error::Segment::Enum { .. } => None,
                    serde_path_to_error::Segment::Unknown => Some("?".into()),
                })
                .collect();
            let path = segments.iter().fold(String::new(), |mut path, segment| {
                if !path.is_empty() && !segment.starts_with('[') {
                    path.push('.');
                }
                path.push_str(segment);
                path
            });
            let why = err.into_inner().to_string();
            // A missing field is reported at its object: name the field.
            let missing = why
                .strip_prefix("missing field `")
                .and_then(|rest| rest.strip_suffix('`'));
            match missing {
                Some(field) if path.is_empty() => (Some(field.to_owned()), why),
                _ => ((!path.is_empty()).then_some(path), why),
            }
        })
    }

    /// Whether serde's message names the field itself (``unknown field
    /// `colour`, expected ...``, ``missing field `name` ``).
    fn names_its_field(why: &str) -> bool {
        why.starts_with("unknown field `") || why.starts_with("missing field `")
    }

    /// An integer from `MIN` to `MAX`, as a `T`.
    #[derive(Clone, Copy, PartialEq, Debug)]
    pub(super) struct Int<const MIN: u64, const MAX: u64, T>(pub T);

    impl<'de, const MIN: u64, const MAX: u64, T: TryFrom<u64>> Deserialize<'de> for Int<MIN, MAX, T> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct IntVisitor<const MIN: u64, const MAX: u64, T>(PhantomData<T>);
            impl<const MIN: u64, const MAX: u64, T: TryFrom<u64>> Visitor<'_> for IntVisitor<MIN, MAX, T> {
                type Value = Int<MIN, MAX, T>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    write!(f, "an integer from {MIN} to {MAX}")
                }
                fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                    (MIN..=MAX)
                        .contains(&v)
                        .then(|| T::try_from(v).ok())
                        .flatten()
                        .map(Int)
                        .ok_or_else(|| E::invalid_value(Unexpected::Unsigned(v), &self))
                }
                fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                    match u64::try_from(v) {
                        Ok(v) => self.visit_u64(v),
                        Err(_) => Err(E::invalid_value(Unexpected::Signed(v), &self)),
                    }
                }
            }
            d.deserialize_u64(IntVisitor::<MIN, MAX, T>(PhantomData))
        }
    }

    /// A target index: an integer from 0 (the plan's `targets` bounds it).
    #[derive(Clone, Copy, PartialEq, Debug)]
    pub(super) struct TargetIndex(pub u64);

    impl<'de> Deserialize<'de> for TargetIndex {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct IndexVisitor;
            impl Visitor<'_> for IndexVisitor {
                type Value = TargetIndex;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a target index (an integer from 0)")
                }
                fn visit_u64<E: de::Error>(self, v: u64) -> Result<TargetIndex, E> {
                    Ok(TargetIndex(v))
                }
                fn visit_i64<E: de::Error>(self, v: i64) -> Result<TargetIndex, E> {
                    u64::try_from(v)
                        .map(TargetIndex)
                        .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
                }
            }
            d.deserialize_u64(IndexVisitor)
        }
    }

    /// Seconds from `MIN_MICROS` µs to one day, as a [`Duration`] (the
    /// converted duration is checked, not the float: a tiny positive number
    /// such as 1e-10 would become a zero duration).
    #[derive(Clone, Copy, PartialEq, Debug)]
    pub(super) struct Seconds<const MIN_MICROS: u64>(pub Duration);

    impl<'de, const MIN_MICROS: u64> Deserialize<'de> for Seconds<MIN_MICROS> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            #[derive(Clone, Copy)]
            struct SecondsVisitor<const MIN_MICROS: u64>;
            impl<const MIN_MICROS: u64> Visitor<'_> for SecondsVisitor<MIN_MICROS> {
                type Value = Seconds<MIN_MICROS>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    write!(
                        f,
                        "seconds, from {} to {MAX_CONTROL_TIMEOUT_S}",
                        Duration::from_micros(MIN_MICROS).as_secs_f64()
                    )
                }
                fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                    Duration::try_from_secs_f64(v)
                        .ok()
                        .filter(|d| {
                            *d >= Duration::from_micros(MIN_MICROS)
                                && d.as_secs_f64() <= MAX_CONTROL_TIMEOUT_S
                        })
                        .map(Seconds)
                        .ok_or_else(|| {
                            // Written as JSON writes it (1e-10, not 0.0000000001).
                            let shown = Number::from_f64(v)
                                .map_or_else(|| v.to_string(), |n| n.to_string());
                            E::invalid_value(Unexpected::Other(&shown), &self)
                        })
                }
                fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                    // Exact for any number of seconds in range.
                    self.visit_f64::<E>(v as f64)
                        .map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
                }
                fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                    self.visit_f64::<E>(v as f64)
                        .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
                }
            }
            d.deserialize_f64(SecondsVisitor::<MIN_MICROS>)
        }
    }

    /// A string that is not empty (a label or a path).
    #[derive(Clone, PartialEq, Debug)]
    pub(super) struct NonEmpty(pub String);

    impl<'de> Deserialize<'de> for NonEmpty {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let s = String::deserialize(d)?;
            if s.is_empty() {
                return Err(de::Error::invalid_value(
                    Unexpected::Str(""),
                    &"a non-empty string",
                ));
            }
            Ok(NonEmpty(s))
        }
    }

    /// A register's `metadata` field: an inline object, or the path of a
    /// metadata JSON file relative to the plan file.
    #[derive(Clone, PartialEq, Debug)]
    pub(super) enum MetadataFile {
        Inline(Map<String, Value>),
        Path(String),
    }

    impl<'de> Deserialize<'de> for MetadataFile {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct MetadataVisitor;
            impl<'de> Visitor<'de> for MetadataVisitor {
                type Value = MetadataFile;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("an object or a file path")
                }
                fn visit_str<E: de::Error>(self, v: &str) -> Result<MetadataFile, E> {
                    if v.is_empty() {
                        return Err(E::invalid_value(
                            Unexpected::Str(""),
                            &"a non-empty file path",
                        ));
                    }
                    Ok(MetadataFile::Path(v.to_owned()))
                }
                fn visit_map<A: de::MapAccess<'de>>(
                    self,
                    map: A,
                ) -> Result<MetadataFile, A::Error> {
                    Map::deserialize(de::value::MapAccessDeserializer::new(map))
                        .map(MetadataFile::Inline)
                }
            }
            d.deserialize_any(MetadataVisitor)
        }
    }
}

/// Whether a label names a handle at a point of the plan.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Label {
    /// Registered by the step with this index and not unregistered since.
    Registered(usize),
    /// Unregistered by the step with this index.
    Unregistered(usize),
}

/// The checking pass: steps in order, tracking labels and the start.
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
    fn step(&mut self, index: usize, op: &str, step: file::StepFile) -> Result<Step, PlanError> {
        use file::StepFile;
        let at = At { index, op };
        let (op, expect_error) = match step {
            StepFile::Register(register) => {
                let name = register.name.0;
                if let Some(Label::Registered(earlier)) = self.labels.get(&name) {
                    return Err(at.field_error(
                        "name",
                        format!("{name:?} already labels the handle of step {earlier}; unregister it first"),
                    ));
                }
                let envelope = register.envelope.0;
                self.read_envelope(&envelope);
                let (metadata, metadata_source) =
                    match self.read_metadata(&at, register.metadata, &envelope)? {
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
                let op = Op::Register(RegisterStep {
                    name,
                    envelope,
                    metadata,
                    metadata_source,
                });
                (op, register.expect_error)
            }
            StepFile::Start(start) => {
                if self.started {
                    return Err(
                        at.error("the Worker is already started (one start per plan)".into())
                    );
                }
                self.started = true;
                (Op::Start, start.expect_error)
            }
            StepFile::Unregister(unregister) => {
                let name = unregister.name.0;
                // Unregistering a label a second time is a step that fails
                // when it runs (HANDLE_STALE), like killing a target twice.
                match self.labels.get(&name) {
                    Some(Label::Registered(_)) => {
                        self.labels.insert(name.clone(), Label::Unregistered(index));
                    }
                    Some(Label::Unregistered(_)) => {}
                    None => return Err(at.unknown_name(&name)),
                }
                (Op::Unregister { name }, unregister.expect_error)
            }
            StepFile::Call(call) => {
                let target = call.target.map(|t| self.target(&at, t)).transpose()?;
                let step = self.call(
                    &at,
                    call.name,
                    target,
                    (call.args, call.kwargs),
                    call.expect,
                    call.expect_error.as_deref(),
                )?;
                (Op::Call(step), call.expect_error)
            }
            StepFile::CallAll(call) => {
                let step = self.call(
                    &at,
                    call.name,
                    None,
                    (call.args, call.kwargs),
                    call.expect,
                    call.expect_error.as_deref(),
                )?;
                (Op::CallAll(step), call.expect_error)
            }
            StepFile::KillTarget(kill) => {
                let target = self.target(&at, kill.target)?;
                self.require_started(&at)?;
                (Op::KillTarget { target }, kill.expect_error)
            }
        };
        Ok(Step { op, expect_error })
    }

    /// Checks a `call` or `call_all` step.
    fn call(
        &self,
        at: &At<'_>,
        name: file::NonEmpty,
        target: Option<u16>,
        (args, kwargs): (Vec<Value>, Map<String, Value>),
        expect: Option<Value>,
        expect_error: Option<&str>,
    ) -> Result<CallStep, PlanError> {
        let name = name.0;
        if !self.labels.contains_key(&name) {
            return Err(at.unknown_name(&name));
        }
        if expect.is_some() && expect_error.is_some() {
            return Err(at.error("\"expect\" and \"expect_error\" exclude each other".into()));
        }
        self.require_started(at)?;
        Ok(CallStep {
            name,
            target,
            args,
            kwargs,
            expect,
        })
    }

    /// A `target` field inside `0..targets`.
    fn target(&self, at: &At<'_>, target: file::TargetIndex) -> Result<u16, PlanError> {
        u16::try_from(target.0)
            .ok()
            .filter(|t| *t < self.targets)
            .ok_or_else(|| {
                at.field_error(
                    "target",
                    format!(
                        "{} is not a target of this plan (targets: {}, numbered from 0)",
                        target.0, self.targets
                    ),
                )
            })
    }

    /// Refuses a step that needs running targets before the start step.
    fn require_started(&self, at: &At<'_>) -> Result<(), PlanError> {
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
        at: &At<'_>,
        field: Option<file::MetadataFile>,
        envelope: &str,
    ) -> Result<Option<(CallableMetadata, String)>, PlanError> {
        let parse = |text: &str, source: &str| {
            let text = self.resolve_hook_names(at, text, source)?;
            CallableMetadata::from_json(&text)
                .map_err(|e| at.field_error("metadata", format!("{source}: {e}")))
        };
        match field {
            Some(file::MetadataFile::Inline(object)) => {
                let text = Value::Object(object).to_string();
                Ok(Some((parse(&text, "inline")?, "inline".to_owned())))
            }
            Some(file::MetadataFile::Path(path)) => {
                let text = super::input::read_text(self.plan_dir.join(&path)).map_err(|why| {
                    at.field_error("metadata", format!("cannot read {path}: {why}"))
                })?;
                Ok(Some((parse(&text, &path)?, path)))
            }
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
        at: &At<'_>,
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

/// Where a step is, for errors that name its index and op.
struct At<'a> {
    index: usize,
    op: &'a str,
}

impl At<'_> {
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
            r#"step 0 (register): field "metadata": invalid type: integer `3`, expected an object or a file path"#
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
            r#"field "control_timeout_s": invalid value: integer `-1`, expected seconds, from 0.001 to 86400"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "control_timeout_s": 1e-10, "steps": []}"#),
            r#"field "control_timeout_s": invalid value: 1e-10, expected seconds, from 0.001 to 86400"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "control_timeout_s": 86400.5, "steps": []}"#),
            r#"field "control_timeout_s": invalid value: 86400.5, expected seconds, from 0.001 to 86400"#
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
            r#"step 1 (register): field "envelope": invalid type: integer `3`, expected a string"#
        );
        assert_eq!(
            error(
                r#"{"targets": 2, "steps": [{"op": "kill_target", "target": 0}, {"op": "start"}]}"#
            ),
            r#"step 0 (kill_target): the Worker is not started yet (only register and unregister come before the "start" step)"#
        );
        assert_eq!(
            error(r#"{"targets": 2, "steps": [{"op": "start", "name": "x"}]}"#),
            r#"step 0 (start): unknown field `name`, expected `expect_error`"#
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
            r#"field "targets": invalid value: integer `0`, expected an integer from 1 to 1024"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "steps": [], "extra": 1}"#),
            r#"the plan: unknown field `extra`, expected one of `targets`, `control_timeout_s`, `respawn_limit`, `respawn_backoff_s`, `probe_first`, `steps`"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "respawn_limit": 65536, "steps": []}"#),
            r#"field "respawn_limit": invalid value: integer `65536`, expected an integer from 0 to 65535"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "respawn_limit": -1, "steps": []}"#),
            r#"field "respawn_limit": invalid value: integer `-1`, expected an integer from 0 to 65535"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "respawn_limit": 1.5, "steps": []}"#),
            r#"field "respawn_limit": invalid type: floating point `1.5`, expected an integer from 0 to 65535"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "probe_first": "no", "steps": []}"#),
            r#"field "probe_first": invalid type: string "no", expected a boolean"#
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
        for (bad, why) in [
            ("-1", "invalid value: integer `-1`"),
            ("86400.5", "invalid value: 86400.5"),
            ("\"1\"", "invalid type: string \"1\""),
            ("true", "invalid type: boolean `true`"),
        ] {
            assert_eq!(
                error(&format!(
                    r#"{{"targets": 1, "respawn_backoff_s": {bad}, "steps": []}}"#
                )),
                format!(r#"field "respawn_backoff_s": {why}, expected seconds, from 0 to 86400"#)
            );
        }
        assert_eq!(
            error(
                r#"{"targets": 1, "steps": [{"op": "start"}, {"op": "call", "name": "f", "target": "x"}]}"#
            ),
            r#"step 1 (call): field "target": invalid type: string "x", expected a target index (an integer from 0)"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "steps": [{"op": "start"}, {"op": "kill_target"}]}"#),
            "step 1 (kill_target): missing field `target`"
        );
        assert_eq!(
            error(r#"{"targets": 1, "steps": [{"op": "start"}, {"op": "call", "name": ""}]}"#),
            r#"step 1 (call): field "name": invalid value: string "", expected a non-empty string"#
        );
        // Present optional fields hold their type: null is not a string.
        assert_eq!(
            error(r#"{"targets": 1, "steps": [{"op": "start", "expect_error": null}]}"#),
            r#"step 0 (start): field "expect_error": invalid type: null, expected a string"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "steps": [{}]}"#),
            r#"step 0: field "op": missing"#
        );
        assert_eq!(
            error(r#"{"targets": 1, "steps": [3]}"#),
            r#"step 0: expected an object with an "op" field, got a number"#
        );
        assert_eq!(
            error(r#"{"steps": []}"#),
            "the plan: missing field `targets`"
        );
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
        let error = parse(
            r#"{"targets": 1, "steps": [{"op": "start"}, {"op": "kill_target"}]}"#,
            Path::new("."),
        )
        .unwrap_err();
        assert_eq!(
            (error.step, error.field.as_deref()),
            (Some(1), Some("target"))
        );
        let error = parse(r#"{"targets": 0, "steps": []}"#, Path::new(".")).unwrap_err();
        assert_eq!(
            (error.step, error.field.as_deref()),
            (None, Some("targets"))
        );
        let error = parse("[]", Path::new(".")).unwrap_err();
        assert_eq!((error.step, error.field), (None, None));
    }

    #[test]
    fn an_expect_of_null_expects_none() {
        let dir = std::env::temp_dir().join(format!("callreg-plan-null-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plan = parse(
            r#"{"targets": 1, "steps": [{"op": "register", "name": "f", "envelope": "f.spyc"},
                {"op": "call", "name": "f", "expect": null}, {"op": "call", "name": "f"}]}"#,
            &dir,
        );
        let _ = std::fs::remove_dir_all(&dir);
        let expects: Vec<Option<Value>> = plan
            .expect("a valid plan")
            .steps
            .iter()
            .filter_map(|step| match &step.op {
                Op::Call(call) => Some(call.expect.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(expects, vec![Some(Value::Null), None]);
    }
}
