//! JSON forms of the protocol's plain data (`specs/metadata.md`
//! §7): handles, failures, errors ([`crate::error::Error`]), per-target
//! outcomes and the registry snapshots of the parent and of a target.
//!
//! Every form has `to_json` (compact), `to_json_pretty` (two-space indent,
//! the golden files' layout) and a strict `from_json` (unknown fields and
//! wrong types rejected, the error naming the field's path, through
//! [`crate::json`]). No form holds a slot: slots are private to a target
//! (invariant 9).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{Failure, Handle, Lifecycle, Parent, Target, TargetId, TargetOutcome};
use crate::descriptor::HashId;
use crate::error::Error;
use crate::json::JsonError;

// `from_json` runs the type's `Rules::validate` after decoding.
crate::json::json_forms!(
    decode: crate::json::from_str,
    check: |value| Rules::validate(value);
    Handle,
    Failure,
    Error,
    TargetOutcome,
    TargetOutcomeEntry,
    RegistrySnapshot,
    TargetSnapshot
);

/// The rules between fields that a form checks after its types; none by
/// default.
trait Rules {
    /// `Ok` when the decoded value keeps the type's rules.
    fn validate(&self) -> Result<(), JsonError> {
        Ok(())
    }
}

impl Rules for Handle {}
impl Rules for Failure {}
impl Rules for Error {}
// The `failure` rule of outcomes is checked while decoding.
impl Rules for TargetOutcome {}
impl Rules for TargetOutcomeEntry {}

/// The text names of the [`TargetOutcome`] variants (the `outcome` key).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum OutcomeName {
    Ok,
    Failed,
    Lost,
    TimedOut,
    Fenced,
    RolledBack,
    CleanupUnconfirmed,
}

impl OutcomeName {
    fn as_str(self) -> &'static str {
        match self {
            OutcomeName::Ok => "ok",
            OutcomeName::Failed => "failed",
            OutcomeName::Lost => "lost",
            OutcomeName::TimedOut => "timed_out",
            OutcomeName::Fenced => "fenced",
            OutcomeName::RolledBack => "rolled_back",
            OutcomeName::CleanupUnconfirmed => "cleanup_unconfirmed",
        }
    }
}

impl TargetOutcome {
    /// The outcome's name and its failure, if it carries one.
    fn parts(&self) -> (OutcomeName, Option<Failure>) {
        match self {
            TargetOutcome::Ok => (OutcomeName::Ok, None),
            TargetOutcome::Failed { failure } => (OutcomeName::Failed, Some(failure.clone())),
            TargetOutcome::Lost => (OutcomeName::Lost, None),
            TargetOutcome::TimedOut => (OutcomeName::TimedOut, None),
            TargetOutcome::Fenced => (OutcomeName::Fenced, None),
            TargetOutcome::RolledBack => (OutcomeName::RolledBack, None),
            TargetOutcome::CleanupUnconfirmed { failure } => {
                (OutcomeName::CleanupUnconfirmed, Some(failure.clone()))
            }
        }
    }

    /// The outcome from its name and failure.
    ///
    /// # Errors
    /// A message when `failure` is absent for `failed` or
    /// `cleanup_unconfirmed`, or present for any other outcome.
    fn from_parts(name: OutcomeName, failure: Option<Failure>) -> Result<TargetOutcome, String> {
        match (name, failure) {
            (OutcomeName::Failed, Some(failure)) => Ok(TargetOutcome::Failed { failure }),
            (OutcomeName::CleanupUnconfirmed, Some(failure)) => {
                Ok(TargetOutcome::CleanupUnconfirmed { failure })
            }
            (OutcomeName::Failed | OutcomeName::CleanupUnconfirmed, None) => Err(format!(
                "missing field `failure` (required by outcome {})",
                name.as_str()
            )),
            (_, Some(_)) => Err(format!(
                "field `failure` does not belong to outcome {}",
                name.as_str()
            )),
            (OutcomeName::Ok, None) => Ok(TargetOutcome::Ok),
            (OutcomeName::Lost, None) => Ok(TargetOutcome::Lost),
            (OutcomeName::TimedOut, None) => Ok(TargetOutcome::TimedOut),
            (OutcomeName::Fenced, None) => Ok(TargetOutcome::Fenced),
            (OutcomeName::RolledBack, None) => Ok(TargetOutcome::RolledBack),
        }
    }
}

/// The wire shape of a [`TargetOutcome`]: the name, then the failure when
/// the outcome carries one.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct OutcomeFields {
    outcome: OutcomeName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    failure: Option<Failure>,
}

/// `{"outcome": "ok"}` or `{"outcome": "failed", "failure": {...}}`: the
/// same shape the derived internally tagged form had, now strict.
impl Serialize for TargetOutcome {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (outcome, failure) = self.parts();
        OutcomeFields { outcome, failure }.serialize(s)
    }
}

impl<'de> Deserialize<'de> for TargetOutcome {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let fields = OutcomeFields::deserialize(d)?;
        TargetOutcome::from_parts(fields.outcome, fields.failure).map_err(serde::de::Error::custom)
    }
}

/// What one target did for an operation, with the target's id: one entry
/// of an operation's outcomes ([`super::Effect::Completed`]`.outcomes`,
/// and the `"targets"` list of `callreg run --json`).
///
/// JSON form, flat (`failure` only for `failed` and `cleanup_unconfirmed`):
///
/// ```json
/// {"target": 0, "outcome": "ok"}
/// {"target": 1, "outcome": "failed", "failure": {"code": "DESERIALIZE_FAILED", "message": "..."}}
/// ```
///
/// `outcome` is one of `ok`, `failed`, `lost`, `timed_out`, `fenced`,
/// `rolled_back`, `cleanup_unconfirmed` ([`TargetOutcome`]'s variants).
/// Decoding rejects a missing `failure` where one is required (``missing
/// field `failure` (required by outcome failed)``) and a `failure` on any
/// other outcome (``field `failure` does not belong to outcome ok``).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct TargetOutcomeEntry {
    /// The target.
    pub target: TargetId,
    /// What it did.
    pub outcome: TargetOutcome,
}

impl TargetOutcomeEntry {
    /// One entry per `(target, outcome)` pair, in the given order (e.g.
    /// the `outcomes` of [`super::Effect::Completed`]).
    pub fn list(outcomes: &[(TargetId, TargetOutcome)]) -> Vec<TargetOutcomeEntry> {
        outcomes
            .iter()
            .map(|(target, outcome)| TargetOutcomeEntry {
                target: *target,
                outcome: outcome.clone(),
            })
            .collect()
    }
}

/// The wire shape of a [`TargetOutcomeEntry`] (flat: a `flatten`ed field
/// would not work with `deny_unknown_fields`).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct OutcomeEntryFields {
    target: TargetId,
    outcome: OutcomeName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    failure: Option<Failure>,
}

impl Serialize for TargetOutcomeEntry {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (outcome, failure) = self.outcome.parts();
        OutcomeEntryFields {
            target: self.target,
            outcome,
            failure,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for TargetOutcomeEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let fields = OutcomeEntryFields::deserialize(d)?;
        let outcome = TargetOutcome::from_parts(fields.outcome, fields.failure)
            .map_err(serde::de::Error::custom)?;
        Ok(TargetOutcomeEntry {
            target: fields.target,
            outcome,
        })
    }
}

/// A digest of the parent's registry with its number of live handles —
/// the refcount a target started now would install for it (one entry of
/// [`Parent::startup_snapshot`]).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DigestCount {
    /// The callable's hashid.
    pub hashid: HashId,
    /// How many live handles name it (at least 1).
    pub live_handles: u32,
}

/// The parent's registry as plain data ([`Parent::registry_snapshot`]):
/// what is registered, where it can run and what cannot be trusted. It
/// holds no slot and no operation in flight.
///
/// JSON form (keys in this order):
///
/// ```json
/// {
///   "lifecycle": "started",
///   "live_targets": [0, 2],
///   "handles": [{"namespace": "LOCAL_PYTHON", "hashid": "sha256:…", "handle_id": 1, "owner": 7}],
///   "digests": [{"hashid": "sha256:…", "live_handles": 1}],
///   "uncertain": ["sha256:…"]
/// }
/// ```
///
/// Rules [`RegistrySnapshot::from_json`] checks beyond the types (each
/// error names its field): `live_targets` is empty unless `lifecycle` is
/// `started`, and in increasing order without repeats; `handles` are in
/// increasing `handle_id` order without repeats; `digests` lists each
/// hashid of `handles` once, in hashid order, with its number of handles;
/// `uncertain` is in hashid order without repeats.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistrySnapshot {
    /// The parent's lifecycle state (`"new"`, `"started"` or `"closed"`).
    pub lifecycle: Lifecycle,
    /// The live targets (started and not lost), in id order; empty unless
    /// started.
    pub live_targets: Vec<TargetId>,
    /// Every live (published) handle, in handle id order.
    pub handles: Vec<Handle>,
    /// Every digest of `handles` with its number of live handles, in
    /// hashid order (the startup snapshot).
    pub digests: Vec<DigestCount>,
    /// The uncertain digests (some target's holding of each is in doubt,
    /// until it answers or is lost: `specs/protocol.md` §2.4), in hashid
    /// order.
    pub uncertain: Vec<HashId>,
}

impl Rules for RegistrySnapshot {
    /// The rules between fields listed on the type.
    fn validate(&self) -> Result<(), JsonError> {
        if self.lifecycle != Lifecycle::Started && !self.live_targets.is_empty() {
            return Err(JsonError::at(
                "live_targets",
                "must be empty unless lifecycle is started",
            ));
        }
        increasing(&self.live_targets, |t| *t, "live_targets", "")?;
        increasing(&self.handles, |h| h.handle_id, "handles", ".handle_id")?;
        if self.digests != Self::count_digests(&self.handles) {
            return Err(JsonError::at(
                "digests",
                "must list each hashid of `handles` once, in hashid order, with its number of handles",
            ));
        }
        increasing(&self.uncertain, |h| *h, "uncertain", "")
    }
}

impl RegistrySnapshot {
    /// The per-digest counts of `handles`, in hashid order.
    pub fn count_digests(handles: &[Handle]) -> Vec<DigestCount> {
        let mut counts: std::collections::BTreeMap<HashId, u32> = Default::default();
        for handle in handles {
            let count = counts.entry(handle.hashid).or_insert(0);
            *count = count.saturating_add(1);
        }
        counts
            .into_iter()
            .map(|(hashid, live_handles)| DigestCount {
                hashid,
                live_handles,
            })
            .collect()
    }
}

/// `Ok` when `key` strictly increases along `items`; otherwise an error at
/// `{list}[i]{field}` for the first item that does not.
fn increasing<T, K: Ord>(
    items: &[T],
    key: impl Fn(&T) -> K,
    list: &str,
    field: &str,
) -> Result<(), JsonError> {
    for (i, pair) in items.windows(2).enumerate() {
        if key(&pair[0]) >= key(&pair[1]) {
            return Err(JsonError::at(
                format!("{list}[{}]{field}", i + 1),
                "out of order or repeated: entries are in increasing order without repeats",
            ));
        }
    }
    Ok(())
}

/// A digest a target holds, with its refcount (one entry of
/// [`Target::installed`]).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstalledDigest {
    /// The callable's hashid.
    pub hashid: HashId,
    /// Its refcount on the target (at least 1; a digest whose refcount
    /// reaches 0 is no longer installed).
    pub refcount: u32,
}

/// One target's registry as plain data ([`Target::snapshot`]): every
/// installed (resolvable) digest with its refcount. The slots that hold
/// them are private to the target and do not appear (invariant 9).
///
/// JSON form:
///
/// ```json
/// {"target": 0, "installed": [{"hashid": "sha256:…", "refcount": 2}]}
/// ```
///
/// Rules [`TargetSnapshot::from_json`] checks beyond the types:
/// `installed` is in hashid order without repeats
/// (`installed[i].hashid`), and every refcount is at least 1
/// (`installed[i].refcount`).
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetSnapshot {
    /// The target.
    pub target: TargetId,
    /// Its installed digests, in hashid order.
    pub installed: Vec<InstalledDigest>,
}

impl Rules for TargetSnapshot {
    /// The rules listed on the type.
    fn validate(&self) -> Result<(), JsonError> {
        increasing(&self.installed, |e| e.hashid, "installed", ".hashid")?;
        match self.installed.iter().position(|e| e.refcount == 0) {
            Some(i) => Err(JsonError::at(
                format!("installed[{i}].refcount"),
                "must be at least 1",
            )),
            None => Ok(()),
        }
    }
}

impl Parent {
    /// The registry as plain data: lifecycle, live targets, live handles,
    /// per-digest live handle counts (the startup snapshot) and uncertain
    /// digests. Pure; holds no slot and no operation in flight.
    pub fn registry_snapshot(&self) -> RegistrySnapshot {
        let live_targets = (0..self.config.targets)
            .map(TargetId)
            .filter(|t| self.is_target_live(*t))
            .collect();
        let handles = self.live_handles();
        let digests = RegistrySnapshot::count_digests(&handles);
        RegistrySnapshot {
            lifecycle: self.lifecycle,
            live_targets,
            handles,
            digests,
            uncertain: self
                .uncertain_digests()
                .into_iter()
                .map(|d| d.hashid())
                .collect(),
        }
    }
}

impl Target {
    /// The target's registry as plain data: its id and every installed
    /// digest with its refcount, in hashid order. Slots are left out.
    pub fn snapshot(&self) -> TargetSnapshot {
        TargetSnapshot {
            target: self.config.id,
            installed: self
                .installed()
                .into_iter()
                .map(|(digest, refcount)| InstalledDigest {
                    hashid: digest.hashid(),
                    refcount,
                })
                .collect(),
        }
    }
}
