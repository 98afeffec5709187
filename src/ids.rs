//! The ids and the time every layer names: targets, seqs, operations,
//! staged payloads, owners, namespaces and the machines' clock. A bottom
//! layer (it imports nothing of the crate), so that [`crate::error`] and the
//! formats name a target or a seq without reaching up into
//! [`crate::protocol`], which re-exports them all.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A point in time: opaque microseconds on a monotonic clock chosen by the
/// caller (the machines only compare and add them).
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct Time(pub u64);

impl Time {
    /// `self + micros`, saturating at `u64::MAX` (a deadline never wraps).
    pub fn saturating_add_micros(self, micros: u64) -> Time {
        Time(self.0.saturating_add(micros))
    }
}

/// A target's index, `0..ParentConfig::targets` (one child endpoint).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TargetId(pub u16);

impl fmt::Display for TargetId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "target {}", self.0)
    }
}

/// A sequence number: every operation, cleanup and task gets a fresh one
/// from its parent, and every reply echoes the one it answers.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Seq(pub u64);

impl fmt::Display for Seq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq {}", self.0)
    }
}

/// Identifies a post-start operation (a register or an unregister) from its
/// start to its [`crate::protocol::Effect::Completed`]. Its value is the operation's [`Seq`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OpId(pub u64);

/// Identifies one staged payload (the envelope the IO layer stages for one
/// register operation: a sealed `memfd` there, `specs/staging.md`). The IO
/// layer keeps the payload under this id until `ReleaseStaged`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StagingId(pub u64);

/// The random token that identifies one parent (one Worker) for its whole
/// life. The caller draws it; handles carry it so that a handle from another
/// Worker is recognised as foreign.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OwnerToken(pub u64);

/// A target namespace (specs/design.md §2). Python callables live in
/// `LOCAL_PYTHON`; every target of this crate serves it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub enum Namespace {
    /// Serialized and imported Python callables (text form `LOCAL_PYTHON`).
    #[serde(rename = "LOCAL_PYTHON")]
    LocalPython,
    /// Chip callables (text form `LOCAL_CHIP`); no target here serves it.
    #[serde(rename = "LOCAL_CHIP")]
    LocalChip,
}

impl Namespace {
    /// The stable text form: `LOCAL_PYTHON` or `LOCAL_CHIP`.
    pub fn as_str(self) -> &'static str {
        match self {
            Namespace::LocalPython => "LOCAL_PYTHON",
            Namespace::LocalChip => "LOCAL_CHIP",
        }
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
