//! Callable metadata: what a registration carries beside its envelope, as
//! plain JSON, never as objects (specs/design.md §6; the
//! transport-graph convention of an `executor` short name plus
//! `executor_data`, `deps`, `call_before` and `call_after`).
//!
//! The parent only ever holds and forwards this JSON; a target reads it
//! *before* deserializing the payload, so that an interpreter or dependency
//! mismatch is refused cleanly instead of crashing inside the unpickler.
//! Metadata is not part of the hashid. `specs/metadata.md` is the
//! reference for every form and check.
//!
//! JSON form of [`CallableMetadata`] (every key; only `name` is required):
//!
//! ```json
//! {"name": "add",
//!  "python": {"version": "3.11.7", "serializer": "cloudpickle", "serializer_version": "2.1.0"},
//!  "executor": "python",
//!  "executor_data": {"type": "PythonExecutor", "short_name": "python", "attributes": {"capture_output": true}},
//!  "deps": {"pip": {"packages": ["cloudpickle>=2"]}, "bash": {"commands": ["true"]}},
//!  "call_before": [{"hashid": "sha256:…", "args": [], "kwargs": {}, "retval_keyword": "config"}],
//!  "call_after": [{"hashid": "sha256:…", "args": [], "kwargs": {}}]}
//! ```
//!
//! Pure: no IO, no Python. The target-side checks live in the runtimes
//! (`crate::runtime`, feature `io`); this module gives them the pure parts: parsed
//! versions ([`python_major_minor`], [`leading_major`]), executor
//! rehydration ([`ExecutorSpec::rehydrate`]), pip requirement matching
//! without the `packaging` module ([`pip`]) and the hook input merge
//! ([`merge_retval_keyword`]).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::descriptor::HashId;
use crate::json::{value_type, JsonError};

pub mod pip;

/// What a metadata side-car's name adds to its envelope's: `NAME.spyc` →
/// `NAME.spyc.json` (written by `python/tools/callreg_envelope.py`, read by
/// `callreg inspect`).
pub const SIDECAR_SUFFIX: &str = ".json";

/// The side-car path of an envelope path: the envelope's path + `.json`.
pub fn sidecar_path(envelope: &std::path::Path) -> std::path::PathBuf {
    let mut path = envelope.as_os_str().to_owned();
    path.push(SIDECAR_SUFFIX);
    path.into()
}

/// The executor short name used when metadata names none (specs/design.md §6):
/// run in the target's own interpreter.
pub const DEFAULT_EXECUTOR: &str = "python";

/// The only serializer name a Python target knows (the SPYC serializer id 1,
/// specs/design.md §3.1), as `python.serializer` spells it.
pub const SERIALIZER_CLOUDPICKLE: &str = "cloudpickle";

/// The metadata of one registration.
///
/// Fields and defaults (an absent key takes the default; [`to_json`]
/// writes every key except absent optional blocks):
///
/// * `name` (required, non-empty): a display name; not checked by targets.
/// * `python` (optional; absent = no version check): see [`PythonVersions`].
/// * `executor` (optional): the executor short name; absent = the short
///   name of `executor_data`, else [`DEFAULT_EXECUTOR`]. When both are
///   given they must agree.
/// * `executor_data` (optional): see [`ExecutorData`].
/// * `deps` (default: no pip packages, no bash commands): see [`Deps`].
/// * `call_before`, `call_after` (default `[]`): hooks, see [`HookCall`];
///   `retval_keyword` is only allowed in `call_before`.
///
/// [`to_json`]: CallableMetadata::to_json
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallableMetadata {
    /// Display name of the callable, e.g. `"add"`.
    pub name: String,
    /// Interpreter and serializer versions of the producer.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::json::optional_object"
    )]
    pub python: Option<PythonVersions>,
    /// Executor short name, e.g. `"python"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor: Option<String>,
    /// Data to rehydrate the executor from.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::json::optional_object"
    )]
    pub executor_data: Option<ExecutorData>,
    /// Dependencies verified (pip) or run (bash) at install.
    #[serde(default, deserialize_with = "crate::json::object")]
    pub deps: Deps,
    /// Hooks run before each task of the callable, in order.
    #[serde(default, deserialize_with = "crate::json::objects")]
    pub call_before: Vec<HookCall>,
    /// Hooks run after each task of the callable, in order.
    #[serde(default, deserialize_with = "crate::json::objects")]
    pub call_after: Vec<HookCall>,
}

/// The producer's interpreter and serializer, e.g.
/// `{"version": "3.11.7", "serializer": "cloudpickle", "serializer_version": "2.1.0"}`.
/// All three keys are required when the block is present.
///
/// A target compares `version` by major.minor and `serializer_version` by
/// major version only (code objects change between Python minors;
/// cloudpickle's format between its majors).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PythonVersions {
    /// `platform.python_version()` of the producer, `MAJOR.MINOR[.…]`.
    pub version: String,
    /// The serializer's name; only [`SERIALIZER_CLOUDPICKLE`] is known.
    pub serializer: String,
    /// The serializer's version, starting with its major number, e.g. `"2.1.0"`.
    pub serializer_version: String,
}

/// How to rehydrate the executor (transport-graph `executor_data`):
/// `{"type": "PythonExecutor", "short_name": "python", "attributes": {...}}`.
/// `type` and `short_name` are required, `attributes` defaults to `{}`.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutorData {
    /// The executor's type name as its registry states it, e.g. `"PythonExecutor"`.
    #[serde(rename = "type")]
    pub type_name: String,
    /// The executor's short name, e.g. `"python"`.
    pub short_name: String,
    /// Attributes laid over the executor's defaults (a JSON object).
    #[serde(default)]
    pub attributes: Map<String, Value>,
}

/// Declared dependencies: `{"pip": {"packages": [...]}, "bash": {"commands": [...]}}`;
/// each block defaults to empty.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deps {
    /// pip requirements verified against what is installed (never installed).
    #[serde(default, deserialize_with = "crate::json::object")]
    pub pip: PipDeps,
    /// Shell commands run once per install, before deserializing.
    #[serde(default, deserialize_with = "crate::json::object")]
    pub bash: BashDeps,
}

/// `{"packages": ["cloudpickle>=2", ...]}`: PEP 508 requirement strings.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipDeps {
    /// Requirement strings, e.g. `"numpy>=1.20,<2"`; `packages` is required.
    pub packages: Vec<String>,
}

/// `{"commands": ["true", ...]}`: each run as `/bin/sh -c COMMAND`.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BashDeps {
    /// Shell commands, run in order; `commands` is required.
    pub commands: Vec<String>,
}

/// One hook: a call of another live registration, by hashid, with fixed
/// arguments: `{"hashid": "sha256:…", "args": [], "kwargs": {}, "retval_keyword": "config"}`.
/// `hashid` is required; `args` defaults to `[]`, `kwargs` to `{}`;
/// `retval_keyword` is optional and, when present, a Python identifier.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookCall {
    /// The hook callable's hashid (it must be live in the same namespace).
    pub hashid: HashId,
    /// Positional arguments (JSON values).
    #[serde(default)]
    pub args: Vec<Value>,
    /// Keyword arguments (JSON values).
    #[serde(default)]
    pub kwargs: Map<String, Value>,
    /// In `call_before`: the hook's result is passed to the task as this
    /// keyword argument ([`merge_retval_keyword`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retval_keyword: Option<String>,
}

impl crate::json::Expects for PythonVersions {
    const EXPECTS: &'static str =
        "an object {\"version\", \"serializer\", \"serializer_version\"} of strings";
}

impl crate::json::Expects for ExecutorData {
    const EXPECTS: &'static str = "an object {\"type\", \"short_name\", \"attributes\"}";
}

impl crate::json::Expects for Deps {
    const EXPECTS: &'static str = "an object {\"pip\": {...}, \"bash\": {...}}";
}

impl crate::json::Expects for PipDeps {
    const EXPECTS: &'static str = "an object {\"packages\": [requirement strings]}";
}

impl crate::json::Expects for BashDeps {
    const EXPECTS: &'static str = "an object {\"commands\": [command strings]}";
}

impl crate::json::Expects for HookCall {
    const EXPECTS: &'static str =
        "an object {\"hashid\", \"args\", \"kwargs\", \"retval_keyword\"}";
}

crate::json::json_forms!(
    decode: crate::json::from_object_str,
    check: |value| value.validate_at("");
    CallableMetadata,
    PythonVersions,
    ExecutorData,
    Deps,
    PipDeps,
    BashDeps,
    HookCall
);

/// `prefix` joined with `field` as a dotted path (`""` + `a` = `a`).
fn join(prefix: &str, field: &str) -> String {
    if prefix.is_empty() {
        field.to_owned()
    } else if field.starts_with('[') {
        format!("{prefix}{field}")
    } else {
        format!("{prefix}.{field}")
    }
}

/// True for a Python identifier (ASCII letter or `_`, then letters, digits,
/// `_`; Unicode letters allowed as in Python 3).
fn is_identifier(text: &str) -> bool {
    let mut chars = text.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_alphabetic())
        && chars.all(|c| c == '_' || c.is_alphanumeric())
}

impl CallableMetadata {
    /// The identity a parent machine holds this metadata by
    /// (`specs/protocol.md` §2.10): the SHA-256 of its JSON form
    /// ([`CallableMetadata::to_json`]).
    pub fn identity(&self) -> crate::descriptor::Digest {
        use sha2::Digest as _;
        crate::descriptor::Digest(sha2::Sha256::digest(self.to_json().as_bytes()).into())
    }

    /// Metadata with only a name: no version check, the default executor,
    /// no deps, no hooks.
    pub fn named(name: &str) -> Self {
        CallableMetadata {
            name: name.to_owned(),
            python: None,
            executor: None,
            executor_data: None,
            deps: Deps::default(),
            call_before: Vec::new(),
            call_after: Vec::new(),
        }
    }

    /// The executor short name the target rehydrates: `executor`, else
    /// `executor_data.short_name`, else [`DEFAULT_EXECUTOR`].
    pub fn executor_short_name(&self) -> &str {
        self.executor
            .as_deref()
            .or(self.executor_data.as_ref().map(|d| d.short_name.as_str()))
            .unwrap_or(DEFAULT_EXECUTOR)
    }

    /// Every hook's hashid, `call_before` then `call_after`, in order
    /// (duplicates kept): what the parent checks is live in the target
    /// namespace before it broadcasts the registration.
    pub fn hook_hashids(&self) -> impl Iterator<Item = HashId> + '_ {
        self.call_before
            .iter()
            .chain(&self.call_after)
            .map(|hook| hook.hashid)
    }

    /// The attributes to lay over the executor's defaults (`{}` when there
    /// is no `executor_data`).
    pub fn executor_attributes(&self) -> Map<String, Value> {
        self.executor_data
            .as_ref()
            .map(|d| d.attributes.clone())
            .unwrap_or_default()
    }

    /// Checks the rules serde cannot express; `prefix` is this value's path.
    ///
    /// # Errors
    /// [`JsonError`] at: `name` when empty; any rule of [`PythonVersions`],
    /// [`ExecutorData`], [`Deps`] or [`HookCall`] below; `executor` when
    /// empty or different from `executor_data.short_name`;
    /// `call_after[i].retval_keyword` when present (only `call_before`
    /// results are passed on).
    pub fn validate_at(&self, prefix: &str) -> Result<(), JsonError> {
        if self.name.is_empty() {
            return Err(JsonError::at(join(prefix, "name"), "must not be empty"));
        }
        if let Some(python) = &self.python {
            python.validate_at(&join(prefix, "python"))?;
        }
        if let Some(executor) = &self.executor {
            if executor.is_empty() {
                return Err(JsonError::at(join(prefix, "executor"), "must not be empty"));
            }
        }
        if let Some(data) = &self.executor_data {
            data.validate_at(&join(prefix, "executor_data"))?;
            if let Some(executor) = &self.executor {
                if *executor != data.short_name {
                    return Err(JsonError::at(
                        join(prefix, "executor_data.short_name"),
                        format!(
                            "{:?} differs from executor {executor:?}; they must name the same executor",
                            data.short_name
                        ),
                    ));
                }
            }
        }
        self.deps.validate_at(&join(prefix, "deps"))?;
        for (i, hook) in self.call_before.iter().enumerate() {
            hook.validate_at(&join(prefix, &format!("call_before[{i}]")))?;
        }
        for (i, hook) in self.call_after.iter().enumerate() {
            let path = join(prefix, &format!("call_after[{i}]"));
            hook.validate_at(&path)?;
            if hook.retval_keyword.is_some() {
                return Err(JsonError::at(
                    join(&path, "retval_keyword"),
                    "only call_before hooks may pass their result to the task",
                ));
            }
        }
        Ok(())
    }
}

impl PythonVersions {
    /// The producer's versions as given.
    pub fn new(version: &str, serializer: &str, serializer_version: &str) -> Self {
        PythonVersions {
            version: version.to_owned(),
            serializer: serializer.to_owned(),
            serializer_version: serializer_version.to_owned(),
        }
    }

    /// Checks the version texts; `prefix` is this value's path.
    ///
    /// # Errors
    /// [`JsonError`] at `version` unless it starts `MAJOR.MINOR`
    /// ([`python_major_minor`]); at `serializer` when empty; at
    /// `serializer_version` unless it starts with a major number
    /// ([`leading_major`]).
    pub fn validate_at(&self, prefix: &str) -> Result<(), JsonError> {
        if python_major_minor(&self.version).is_none() {
            return Err(JsonError::at(
                join(prefix, "version"),
                format!(
                    "{:?} is not a Python version MAJOR.MINOR[.MICRO]",
                    self.version
                ),
            ));
        }
        if self.serializer.is_empty() {
            return Err(JsonError::at(
                join(prefix, "serializer"),
                "must not be empty",
            ));
        }
        if leading_major(&self.serializer_version).is_none() {
            return Err(JsonError::at(
                join(prefix, "serializer_version"),
                format!(
                    "{:?} does not start with a major version number",
                    self.serializer_version
                ),
            ));
        }
        Ok(())
    }
}

impl ExecutorData {
    /// Checks the names; `prefix` is this value's path.
    ///
    /// # Errors
    /// [`JsonError`] at `type` or `short_name` when empty.
    pub fn validate_at(&self, prefix: &str) -> Result<(), JsonError> {
        if self.type_name.is_empty() {
            return Err(JsonError::at(join(prefix, "type"), "must not be empty"));
        }
        if self.short_name.is_empty() {
            return Err(JsonError::at(
                join(prefix, "short_name"),
                "must not be empty",
            ));
        }
        Ok(())
    }
}

impl Deps {
    /// Checks both blocks; `prefix` is this value's path.
    ///
    /// # Errors
    /// As [`PipDeps::validate_at`] and [`BashDeps::validate_at`].
    pub fn validate_at(&self, prefix: &str) -> Result<(), JsonError> {
        self.pip.validate_at(&join(prefix, "pip"))?;
        self.bash.validate_at(&join(prefix, "bash"))
    }

    /// True when there is nothing to verify or run.
    pub fn is_empty(&self) -> bool {
        self.pip.packages.is_empty() && self.bash.commands.is_empty()
    }
}

impl PipDeps {
    /// Checks each requirement is a non-blank string (its syntax is checked
    /// by the target, which may have a fuller parser than this crate).
    ///
    /// # Errors
    /// [`JsonError`] at `packages[i]` for a blank requirement.
    pub fn validate_at(&self, prefix: &str) -> Result<(), JsonError> {
        for (i, package) in self.packages.iter().enumerate() {
            if package.trim().is_empty() {
                return Err(JsonError::at(
                    join(prefix, &format!("packages[{i}]")),
                    "must not be blank",
                ));
            }
        }
        Ok(())
    }
}

impl BashDeps {
    /// Checks each command is non-blank.
    ///
    /// # Errors
    /// [`JsonError`] at `commands[i]` for a blank command.
    pub fn validate_at(&self, prefix: &str) -> Result<(), JsonError> {
        for (i, command) in self.commands.iter().enumerate() {
            if command.trim().is_empty() {
                return Err(JsonError::at(
                    join(prefix, &format!("commands[{i}]")),
                    "must not be blank",
                ));
            }
        }
        Ok(())
    }
}

impl HookCall {
    /// A hook calling `hashid` with no arguments.
    pub fn new(hashid: HashId) -> Self {
        HookCall {
            hashid,
            args: Vec::new(),
            kwargs: Map::new(),
            retval_keyword: None,
        }
    }

    /// Checks `retval_keyword`; `prefix` is this value's path.
    ///
    /// # Errors
    /// [`JsonError`] at `retval_keyword` unless it is a Python identifier.
    pub fn validate_at(&self, prefix: &str) -> Result<(), JsonError> {
        if let Some(keyword) = &self.retval_keyword {
            if !is_identifier(keyword) {
                return Err(JsonError::at(
                    join(prefix, "retval_keyword"),
                    format!("{keyword:?} is not a Python identifier"),
                ));
            }
        }
        Ok(())
    }

    /// The hook's task input in the JSON task encoding:
    /// `{"args": [...], "kwargs": {...}}` (UTF-8 bytes), ready for
    /// `Runtime::call` with `TaskEncoding::Json`.
    pub fn task_input(&self) -> Vec<u8> {
        let mut input = Map::new();
        input.insert("args".to_owned(), Value::Array(self.args.clone()));
        input.insert("kwargs".to_owned(), Value::Object(self.kwargs.clone()));
        Value::Object(input).to_string().into_bytes()
    }
}

/// `(major, minor)` of a Python version text `MAJOR.MINOR[.anything]`
/// (e.g. `"3.11.7"` → `(3, 11)`, `"3.12.0rc1"` → `(3, 12)`); `None` when it
/// does not start with two dot-separated decimal numbers.
pub fn python_major_minor(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.splitn(3, '.');
    let major = parts.next()?.parse().ok()?;
    let minor_text = parts.next()?;
    let digits = minor_text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(minor_text.len());
    // A minor like "11rc1" only appears without a micro part.
    if digits != minor_text.len() && parts.next().is_some() {
        return None;
    }
    let minor = minor_text[..digits].parse().ok()?;
    Some((major, minor))
}

/// The major number a version text starts with (`"2.1.0"` → 2, `"3"` → 3,
/// `"10rc1"` → 10); `None` when it does not start with a decimal digit.
pub fn leading_major(version: &str) -> Option<u64> {
    let digits = version
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(version.len());
    version[..digits].parse().ok()
}

/// An executor's registry entry, as far as rehydration needs it: its
/// short name, type name and default attributes (specs/design.md §6).
#[derive(Clone, PartialEq, Debug)]
pub struct ExecutorSpec {
    /// The short name metadata uses, e.g. `"python"`.
    pub short_name: String,
    /// The type name `executor_data.type` must equal, e.g. `"PythonExecutor"`.
    pub type_name: String,
    /// Every attribute the executor knows, with its default value; the
    /// default's JSON type is the attribute's type (`null` accepts any).
    pub defaults: Map<String, Value>,
}

/// Why an executor could not be rehydrated from metadata.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum RehydrateError {
    /// `executor_data.type` names another type than the registry's entry
    /// for that short name (code `EXECUTOR_UNKNOWN`).
    #[error(
        "executor_data.type {got:?} does not match executor {short_name:?} (type {expected:?})"
    )]
    TypeMismatch {
        /// The short name looked up.
        short_name: String,
        /// The registry's type name.
        expected: String,
        /// The metadata's type name.
        got: String,
    },
    /// An attribute the executor has no default for (code `EXECUTOR_UNKNOWN`).
    #[error("executor {short_name:?} has no attribute {attribute:?} (known: {known})")]
    AttributeUnknown {
        /// The executor's short name.
        short_name: String,
        /// The unknown attribute.
        attribute: String,
        /// The known attributes, comma-separated.
        known: String,
    },
    /// An attribute whose JSON type differs from its default's (code
    /// `METADATA_INVALID`).
    #[error("executor {short_name:?} attribute {attribute:?} must be {expected}, got {got}")]
    AttributeType {
        /// The executor's short name.
        short_name: String,
        /// The attribute.
        attribute: String,
        /// The default's JSON type, e.g. `a boolean`.
        expected: &'static str,
        /// The given value's JSON type.
        got: &'static str,
    },
}

impl RehydrateError {
    /// The error code: `EXECUTOR_UNKNOWN` for an unknown type or attribute,
    /// `METADATA_INVALID` for an attribute of the wrong type.
    pub fn code(&self) -> crate::error::ErrorCode {
        match self {
            RehydrateError::TypeMismatch { .. } | RehydrateError::AttributeUnknown { .. } => {
                crate::error::ErrorCode::EXECUTOR_UNKNOWN
            }
            RehydrateError::AttributeType { .. } => crate::error::ErrorCode::METADATA_INVALID,
        }
    }
}

impl ExecutorSpec {
    /// An entry with these names and defaults.
    pub fn new(short_name: &str, type_name: &str, defaults: Map<String, Value>) -> Self {
        ExecutorSpec {
            short_name: short_name.to_owned(),
            type_name: type_name.to_owned(),
            defaults,
        }
    }

    /// Rehydrates the executor's attributes (specs/design.md §6): a copy of the
    /// defaults, then a deep copy of each of `data.attributes` over them
    /// (whole values replace defaults; objects are not merged key by key).
    /// With no `data`, the defaults.
    ///
    /// # Errors
    /// [`RehydrateError::TypeMismatch`] when `data.type` is not this
    /// executor's type name; [`RehydrateError::AttributeUnknown`] for the
    /// first attribute (in key order) with no default;
    /// [`RehydrateError::AttributeType`] for one whose JSON type differs from
    /// its non-null default's.
    pub fn rehydrate(
        &self,
        data: Option<&ExecutorData>,
    ) -> Result<Map<String, Value>, RehydrateError> {
        let mut attributes = self.defaults.clone();
        let Some(data) = data else {
            return Ok(attributes);
        };
        if data.type_name != self.type_name {
            return Err(RehydrateError::TypeMismatch {
                short_name: self.short_name.clone(),
                expected: self.type_name.clone(),
                got: data.type_name.clone(),
            });
        }
        for (name, value) in &data.attributes {
            let Some(default) = self.defaults.get(name) else {
                return Err(RehydrateError::AttributeUnknown {
                    short_name: self.short_name.clone(),
                    attribute: name.clone(),
                    known: self.defaults.keys().cloned().collect::<Vec<_>>().join(", "),
                });
            };
            if !default.is_null() && value_type(default) != value_type(value) {
                return Err(RehydrateError::AttributeType {
                    short_name: self.short_name.clone(),
                    attribute: name.clone(),
                    expected: value_type(default),
                    got: value_type(value),
                });
            }
            attributes.insert(name.clone(), value.clone());
        }
        Ok(attributes)
    }
}

/// Why a `call_before` result could not be merged into a task input.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum MergeError {
    /// The task input is not a JSON object `{"args": [...], "kwargs": {...}}`.
    #[error("the task input is not a JSON object with \"args\" and \"kwargs\": {0}")]
    InputInvalid(String),
    /// The hook's result is not JSON.
    #[error("the hook's result is not JSON: {0}")]
    ResultInvalid(String),
    /// The task input already passes this keyword argument.
    #[error("the task input already has keyword argument {0:?}, which a call_before hook's retval_keyword would replace")]
    KeywordTaken(String),
}

/// Passes a `call_before` hook's result to the task: returns the
/// JSON task input `input` (`{"args": [...], "kwargs": {...}}`, both keys
/// optional, UTF-8 bytes) with `kwargs[keyword] = result` (`result`: the
/// hook's JSON result bytes). Keys other than `args` and `kwargs` are kept
/// for the runtime to refuse.
///
/// # Errors
/// [`MergeError::InputInvalid`] when `input` is not a JSON object or its
/// `kwargs` is not an object; [`MergeError::ResultInvalid`] when `result`
/// is not JSON; [`MergeError::KeywordTaken`] when the input already has the
/// keyword (a silent replacement would hide a caller's argument).
pub fn merge_retval_keyword(
    input: &[u8],
    keyword: &str,
    result: &[u8],
) -> Result<Vec<u8>, MergeError> {
    let mut task: Value =
        serde_json::from_slice(input).map_err(|e| MergeError::InputInvalid(e.to_string()))?;
    let result: Value =
        serde_json::from_slice(result).map_err(|e| MergeError::ResultInvalid(e.to_string()))?;
    let input_type = value_type(&task);
    let object = task
        .as_object_mut()
        .ok_or_else(|| MergeError::InputInvalid(format!("got {input_type}")))?;
    let kwargs = object
        .entry("kwargs")
        .or_insert_with(|| Value::Object(Map::new()))
        .as_object_mut()
        .ok_or_else(|| MergeError::InputInvalid("\"kwargs\" is not an object".to_owned()))?;
    if kwargs.contains_key(keyword) {
        return Err(MergeError::KeywordTaken(keyword.to_owned()));
    }
    kwargs.insert(keyword.to_owned(), result);
    Ok(task.to_string().into_bytes())
}
