//! Client scripts: what the user of the Worker does, step by step.
//!
//! A script has two parts. `before_start` runs synchronously before the
//! targets exist (pre-start registers and unregisters only touch the
//! registry and the startup snapshot, specs/design.md §4.1), then the parent
//! starts. `operations` are post-start registers and unregisters that the
//! client issues in any order its dependencies allow: an operation may be
//! issued once every operation listed in its `after`, and the register
//! whose handle it unregisters, have completed. Several operations may
//! therefore be in flight at once (multi-flight, specs/design.md §4.1).
//!
//! Payload bytes are abstracted to digests: a callable is named by one
//! capital letter (`"A"`, `"B"`, ...), which stands for one envelope and
//! its digest (see [`digest_of`]).
//!
//! Scripts are JSON (the `--script FILE` form of `callreg-model check`):
//!
//! ```json
//! {
//!   "name": "my-script",
//!   "description": "what it exercises",
//!   "before_start": [{"register": "A"}, {"unregister": 0}],
//!   "operations": [
//!     {"register": "A"},
//!     {"unregister": {"operation": 0}},
//!     {"register": "B", "after": [0]}
//!   ]
//! }
//! ```
//!
//! `{"unregister": i}` in `before_start` names the `i`-th entry of
//! `before_start` (which must be a register); in `operations`,
//! `{"unregister": {"before_start": i}}` or `{"unregister": {"operation": j}}`
//! names the handle of that register.

use std::fmt;

use callreg::descriptor::Digest;
use serde::{Deserialize, Serialize};

/// The digest standing for the callable named `name` (a capital letter):
/// 32 bytes all equal to the letter's ASCII code. `None` for any other name.
pub fn digest_of(name: char) -> Option<Digest> {
    name.is_ascii_uppercase()
        .then_some(Digest([name as u8; 32]))
}

/// The digest a corrupted staged payload recomputes to: equal to no
/// callable name's digest (all bytes `0xEE`), so a target comparing it with
/// the requested digest always finds a mismatch (invariant 5).
pub const CORRUPTED: Digest = Digest([0xEE; 32]);

/// The name of `digest` for traces: its letter for a callable's digest,
/// `corrupted` for [`CORRUPTED`], the hashid otherwise.
pub fn name_of(digest: &Digest) -> String {
    let first = digest.0[0];
    if digest.0.iter().all(|b| *b == first) {
        if first.is_ascii_uppercase() {
            return char::from(first).to_string();
        }
        if *digest == CORRUPTED {
            return "corrupted".to_owned();
        }
    }
    digest.hashid().to_string()
}

/// A pre-start step (runs before the targets start, synchronously).
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BeforeStart {
    /// `register_before_start` of the callable named by the letter.
    Register(char),
    /// `unregister_before_start` of the handle of the `i`-th pre-start step
    /// (a register).
    Unregister(usize),
}

/// Which handle an unregister drops.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HandleRef {
    /// The handle of the `i`-th `before_start` step (a register).
    BeforeStart(usize),
    /// The handle published by the `j`-th operation (a register).
    Operation(usize),
}

/// A post-start operation.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Operation {
    /// `register` of the callable named by the letter.
    Register(char),
    /// `unregister` of a handle.
    Unregister(HandleRef),
}

/// One post-start step: an operation and what must complete first.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Step {
    /// The operation.
    #[serde(flatten)]
    pub operation: Operation,
    /// Indices of operations that must have completed before this one is
    /// issued (besides the register an unregister names).
    #[serde(default)]
    pub after: Vec<usize>,
}

/// A named client script (see the module documentation for its JSON form).
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Script {
    /// Its name (`--script NAME`).
    pub name: String,
    /// What it exercises.
    pub description: String,
    /// Pre-start steps, run in order before start.
    #[serde(default)]
    pub before_start: Vec<BeforeStart>,
    /// Post-start operations.
    pub operations: Vec<Step>,
}

/// Why a script is not usable.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ScriptError(pub String);

impl fmt::Display for ScriptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid script: {}", self.0)
    }
}

impl std::error::Error for ScriptError {}

fn step(operation: Operation, after: &[usize]) -> Step {
    Step {
        operation,
        after: after.to_vec(),
    }
}

impl Script {
    /// The built-in scripts, by name:
    ///
    /// * `single-register` — one register of `A`.
    /// * `duplicate-register` — two concurrent registers of `A` (two handles,
    ///   one hashid; the second may wait for the first's deserialization).
    /// * `register-unregister-same-digest` — register `A`; once published,
    ///   a second register of `A` and the unregister of the first handle,
    ///   concurrently (the standard configuration's script).
    /// * `two-digests` — concurrent registers of `A` and `B`.
    /// * `snapshot-then-operations` — before start: register `A`, register
    ///   `B` twice, unregister the second `B` handle (snapshot: `A` and `B`,
    ///   refcount 1 each); after start, concurrently: unregister the `A`
    ///   handle and register `C` (with 2 slots, `C` fits only once `A`'s slot
    ///   is freed, so a task on `A` makes it wait for a tombstone).
    pub fn builtin() -> Vec<Script> {
        use HandleRef::{BeforeStart as Pre, Operation as Op};
        use Operation::{Register, Unregister};
        vec![
            Script {
                name: "single-register".into(),
                description: "one register of A".into(),
                before_start: vec![],
                operations: vec![step(Register('A'), &[])],
            },
            Script {
                name: "duplicate-register".into(),
                description: "two concurrent registers of A: distinct handles, one hashid".into(),
                before_start: vec![],
                operations: vec![step(Register('A'), &[]), step(Register('A'), &[])],
            },
            Script {
                name: "register-unregister-same-digest".into(),
                description: "register A; then, concurrently, register A again and unregister the first handle".into(),
                before_start: vec![],
                operations: vec![
                    step(Register('A'), &[]),
                    step(Register('A'), &[0]),
                    step(Unregister(Op(0)), &[]),
                ],
            },
            Script {
                name: "two-digests".into(),
                description: "concurrent registers of A and B".into(),
                before_start: vec![],
                operations: vec![step(Register('A'), &[]), step(Register('B'), &[])],
            },
            Script {
                name: "snapshot-then-operations".into(),
                description: "before start: register A, register B twice, unregister the second B (snapshot A x1, B x1); after start, concurrently: unregister A and register C".into(),
                before_start: vec![
                    BeforeStart::Register('A'),
                    BeforeStart::Register('B'),
                    BeforeStart::Register('B'),
                    BeforeStart::Unregister(2),
                ],
                operations: vec![step(Unregister(Pre(0)), &[]), step(Register('C'), &[])],
            },
        ]
    }

    /// The built-in script called `name`, if any.
    pub fn named(name: &str) -> Option<Script> {
        Script::builtin().into_iter().find(|s| s.name == name)
    }

    /// Parses a script from its JSON text and checks it ([`Script::validate`]).
    ///
    /// # Errors
    /// A [`ScriptError`] for malformed JSON or an invalid script.
    pub fn from_json(text: &str) -> Result<Script, ScriptError> {
        let script: Script =
            serde_json::from_str(text).map_err(|e| ScriptError(format!("JSON: {e}")))?;
        script.validate()?;
        Ok(script)
    }

    /// The register steps an operation must wait for: its `after` list plus
    /// the register whose handle it unregisters.
    pub fn dependencies(&self, index: usize) -> Vec<usize> {
        let Some(step) = self.operations.get(index) else {
            return Vec::new();
        };
        let mut deps = step.after.clone();
        if let Operation::Unregister(HandleRef::Operation(j)) = step.operation {
            deps.push(j);
        }
        deps
    }

    /// Checks that every name is a capital letter, every reference points
    /// to an earlier register of the right part, and dependencies point
    /// backwards (so the script cannot deadlock).
    ///
    /// # Errors
    /// A [`ScriptError`] naming the first bad step.
    pub fn validate(&self) -> Result<(), ScriptError> {
        let letter = |c: char, at: String| {
            digest_of(c)
                .map(|_| ())
                .ok_or_else(|| ScriptError(format!("{at}: {c:?} is not a capital letter")))
        };
        for (i, pre) in self.before_start.iter().enumerate() {
            match pre {
                BeforeStart::Register(c) => letter(*c, format!("before_start[{i}]"))?,
                BeforeStart::Unregister(j) => {
                    if *j >= i || !matches!(self.before_start[*j], BeforeStart::Register(_)) {
                        return Err(ScriptError(format!(
                            "before_start[{i}] unregisters {j}, which is not an earlier register"
                        )));
                    }
                }
            }
        }
        for (i, step) in self.operations.iter().enumerate() {
            match step.operation {
                Operation::Register(c) => letter(c, format!("operations[{i}]"))?,
                Operation::Unregister(HandleRef::BeforeStart(j)) => {
                    if !matches!(self.before_start.get(j), Some(BeforeStart::Register(_))) {
                        return Err(ScriptError(format!(
                            "operations[{i}] unregisters before_start[{j}], which is not a register"
                        )));
                    }
                }
                Operation::Unregister(HandleRef::Operation(j)) => {
                    if j >= i || !matches!(self.operations[j].operation, Operation::Register(_)) {
                        return Err(ScriptError(format!(
                            "operations[{i}] unregisters operations[{j}], which is not an earlier register"
                        )));
                    }
                }
            }
            if let Some(bad) = step.after.iter().find(|j| **j >= i) {
                return Err(ScriptError(format!(
                    "operations[{i}] waits for operations[{bad}], which is not earlier"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_scripts_are_valid_and_round_trip_through_json() {
        for script in Script::builtin() {
            assert_eq!(script.validate(), Ok(()), "{}", script.name);
            let text = serde_json::to_string(&script).unwrap();
            assert_eq!(Script::from_json(&text), Ok(script));
        }
    }

    #[test]
    fn documented_json_form_parses() {
        let text = r#"{
          "name": "my-script",
          "description": "what it exercises",
          "before_start": [{"register": "A"}, {"unregister": 0}],
          "operations": [
            {"register": "A"},
            {"unregister": {"operation": 0}},
            {"register": "B", "after": [0]}
          ]
        }"#;
        let script = Script::from_json(text).unwrap();
        assert_eq!(
            script.before_start,
            vec![BeforeStart::Register('A'), BeforeStart::Unregister(0)]
        );
        assert_eq!(script.dependencies(1), vec![0]);
        assert_eq!(script.dependencies(2), vec![0]);
    }

    #[test]
    fn bad_scripts_are_refused() {
        let forward = r#"{"name":"x","description":"","operations":[{"unregister":{"operation":1}},{"register":"A"}]}"#;
        assert_eq!(
            Script::from_json(forward),
            Err(ScriptError(
                "operations[0] unregisters operations[1], which is not an earlier register".into()
            ))
        );
        let lower = r#"{"name":"x","description":"","operations":[{"register":"a"}]}"#;
        assert_eq!(
            Script::from_json(lower),
            Err(ScriptError(
                "operations[0]: 'a' is not a capital letter".into()
            ))
        );
    }

    #[test]
    fn digest_names_round_trip() {
        assert_eq!(name_of(&digest_of('A').unwrap()), "A");
        assert_eq!(name_of(&CORRUPTED), "corrupted");
        assert_eq!(digest_of('a'), None);
    }
}
