//! Error codes (specs/design.md §4.3) and the error value with its context.
//!
//! Every failure callreg can produce, in any layer, has one [`ErrorCode`].
//! Codes are stable: their text form is what the command and the JSON show,
//! their numeric form is what reply frames carry.

use serde::{Deserialize, Serialize};

macro_rules! error_codes {
    ($( $(#[$doc:meta])* $name:ident = $num:literal, )*) => {
        /// One code per kind of failure (specs/design.md §4.3 plus the codes this
        /// implementation adds; `specs/protocol.md` lists them all).
        ///
        /// Text form: the `SCREAMING_SNAKE_CASE` name ([`ErrorCode::as_str`]).
        /// Wire form: a `u16` ([`ErrorCode::as_u16`], [`ErrorCode::from_u16`]).
        /// JSON form (serde): the text form as a string; decoding any other
        /// string fails with ``unknown error code "NAME"``.
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
        #[allow(non_camel_case_types)]
        pub enum ErrorCode {
            $( $(#[$doc])* $name = $num, )*
        }

        impl ErrorCode {
            /// Every code, in numeric order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$name,)*];

            /// The code's stable text form, e.g. `"HASHID_FORMAT_INVALID"`.
            pub fn as_str(self) -> &'static str {
                match self { $(ErrorCode::$name => stringify!($name),)* }
            }

            /// The code's stable wire form.
            pub fn as_u16(self) -> u16 {
                self as u16
            }

            /// The code for a wire value, or `None` for a value no code has.
            pub fn from_u16(v: u16) -> Option<ErrorCode> {
                match v { $($num => Some(ErrorCode::$name),)* _ => None }
            }
        }

        impl std::str::FromStr for ErrorCode {
            type Err = UnknownErrorCode;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s { $(stringify!($name) => Ok(ErrorCode::$name),)* _ => Err(UnknownErrorCode(s.to_owned())) }
            }
        }
    };
}

error_codes! {
    /// A hashid text is not `sha256:` + 64 lowercase hex digits.
    HASHID_FORMAT_INVALID = 1,
    /// A staged payload's recomputed digest differs from the requested one.
    HASHID_DESCRIPTOR_MISMATCH = 2,
    /// The callable kind is not supported by this target or operation.
    CALLABLE_KIND_UNSUPPORTED = 3,
    /// The target has no free slot for a new callable.
    LOCAL_SLOT_EXHAUSTED = 4,
    /// A post-start register failed at one or more targets and was rolled back.
    REGISTER_PARTIAL_FAILURE = 5,
    /// The digest is uncertain: a cleanup was not confirmed.
    REGISTER_CLEANUP_UNCERTAIN = 6,
    /// A register found the digest's slot tombstoned and still held by a run.
    REGISTER_TOMBSTONE_ACTIVE = 7,
    /// An unregister found the digest already tombstoned.
    UNREGISTER_TOMBSTONE_ACTIVE = 8,
    /// The staged bytes are not a valid SPYC envelope (specs/design.md §3.1).
    ENVELOPE_INVALID = 9,
    /// A descriptor's fields are invalid (e.g. a bad `module:qualname`).
    DESCRIPTOR_INVALID = 10,
    /// The handle was not issued by this Worker (forged or foreign).
    HANDLE_FOREIGN = 11,
    /// The handle was issued by this Worker but is no longer live.
    HANDLE_STALE = 12,
    /// The handle's fields differ from what this Worker issued.
    HANDLE_MUTATED = 13,
    /// The handle belongs to another target namespace.
    HANDLE_WRONG_NAMESPACE = 14,
    /// An unregister or task named a digest the target does not hold.
    DIGEST_NOT_INSTALLED = 15,
    /// The runtime failed to deserialize a payload.
    DESERIALIZE_FAILED = 16,
    /// A target died or was fenced while the operation needed it.
    TARGET_LOST = 17,
    /// A target did not reply before the operation's deadline.
    DEADLINE_EXCEEDED = 18,
    /// An unregister failed at one or more targets.
    UNREGISTER_PARTIAL_FAILURE = 19,
    /// The operation is not allowed in the Worker's lifecycle state.
    LIFECYCLE_INVALID = 20,
    /// A task raised or otherwise failed inside the target.
    TASK_FAILED = 21,
    /// A frame could not be decoded or was out of protocol.
    FRAME_INVALID = 22,
    /// An OS-level IO operation failed (staging, socket, pipe, fork).
    IO_FAILED = 23,
    /// There is no live target to run the operation on.
    NO_LIVE_TARGET = 24,
    /// The interpreter or serializer version differs from the payload's.
    PYTHON_VERSION_MISMATCH = 25,
    /// A declared dependency is not satisfied in the target.
    DEPS_UNSATISFIED = 26,
    /// The metadata names an executor (or attribute) the target does not know.
    EXECUTOR_UNKNOWN = 27,
    /// Metadata (JSON) is malformed, asks for something the runtime cannot
    /// honour, or names a hook hashid with no live registration in the
    /// namespace (refused by the parent before a register is broadcast).
    METADATA_INVALID = 28,
    /// Installing this callable killed the target that tried it first (it
    /// was lost while deserializing it): the register is refused for the
    /// rest of the Worker's life (`specs/protocol.md` §2.8).
    REGISTER_POISONED = 29,
    /// A register of a callable that is registered (or being registered)
    /// with other metadata: one digest has one metadata for as long as it
    /// is held (`specs/protocol.md` §2.10).
    METADATA_CONFLICT = 30,
    /// A task was cancelled before it started: it never ran
    /// (`specs/protocol.md` §2.11).
    TASK_CANCELLED = 31,
    /// A cancel came too late: the task had already started (or finished)
    /// in its target, so it runs to its end (`specs/protocol.md` §2.11).
    TASK_RUNNING = 32,
    /// A task passed its deadline: it was ended and its target fenced
    /// (killed, then replaced as for any loss; `specs/protocol.md` §2.12).
    TASK_DEADLINE = 33,
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Through [`std::str::FromStr`], so that an unknown name gets one short
/// message rather than the list of every code.
impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A text that names no [`ErrorCode`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown error code {0:?}")]
pub struct UnknownErrorCode(pub String);

/// What a failed call or operation was doing, as named in an [`Error`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum OperationKind {
    /// Registering a callable (before or after start).
    Register,
    /// Unregistering a handle (before or after start).
    Unregister,
    /// The digest-owned unregister that rolls back a failed register.
    Cleanup,
    /// Resolving a handle to its digest.
    Resolve,
    /// Submitting, starting or finishing a task.
    Task,
    /// Starting the Worker or a target (startup snapshot).
    Start,
    /// Closing the Worker.
    Close,
    /// Receiving a reply or a deserialization result.
    Reply,
    /// Staging a payload in shared memory.
    Stage,
    /// Decoding a frame, an envelope or a hashid.
    Decode,
    /// Asking the targets for their tables.
    Inspect,
}

impl OperationKind {
    /// The stable text form, e.g. `"register"`.
    pub fn as_str(self) -> &'static str {
        match self {
            OperationKind::Register => "register",
            OperationKind::Unregister => "unregister",
            OperationKind::Cleanup => "cleanup",
            OperationKind::Resolve => "resolve",
            OperationKind::Task => "task",
            OperationKind::Start => "start",
            OperationKind::Close => "close",
            OperationKind::Reply => "reply",
            OperationKind::Stage => "stage",
            OperationKind::Decode => "decode",
            OperationKind::Inspect => "inspect",
        }
    }
}

impl std::fmt::Display for OperationKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A callreg error: a code with its context (specs/design.md §4.3).
///
/// Names the target, namespace, hashid, operation and seq when they apply
/// (`None` otherwise) and carries the full message. A message never contains
/// a user's absolute path. `Display` gives the facts on one line:
/// `CODE: message (operation register, target 2, namespace LOCAL_PYTHON, hashid sha256:…, seq 7)`.
///
/// JSON form ([`Error::to_json`], strict [`Error::from_json`]): every key,
/// in the order below, always written (`null` for context that does not
/// apply; an absent key reads as `null`):
///
/// ```json
/// {"code": "DIGEST_NOT_INSTALLED", "operation": "task", "target": 2,
///  "namespace": "LOCAL_PYTHON", "hashid": "sha256:…", "seq": 7, "message": "…"}
/// ```
///
/// `code` is the code's text name, `operation` an [`OperationKind`] in
/// `snake_case`, `target` and `seq` integers.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Error {
    /// What went wrong.
    pub code: ErrorCode,
    /// What was being done.
    pub operation: OperationKind,
    /// The target (child) involved, if one is.
    pub target: Option<crate::ids::TargetId>,
    /// The target namespace involved, if known.
    pub namespace: Option<crate::ids::Namespace>,
    /// The callable's hashid, if known.
    pub hashid: Option<crate::descriptor::HashId>,
    /// The sequence number of the operation, cleanup or task, if it has one.
    pub seq: Option<crate::ids::Seq>,
    /// The full human-readable message.
    pub message: String,
}

impl Error {
    /// An error with no context beyond `code`, `operation` and `message`;
    /// add context with the builder methods.
    pub fn new(code: ErrorCode, operation: OperationKind, message: impl Into<String>) -> Error {
        Error {
            code,
            operation,
            target: None,
            namespace: None,
            hashid: None,
            seq: None,
            message: message.into(),
        }
    }

    /// Names the target.
    pub fn with_target(mut self, target: crate::ids::TargetId) -> Error {
        self.target = Some(target);
        self
    }

    /// Names the namespace.
    pub fn with_namespace(mut self, namespace: crate::ids::Namespace) -> Error {
        self.namespace = Some(namespace);
        self
    }

    /// Names the callable by its digest (shown as a hashid).
    pub fn with_digest(mut self, digest: crate::descriptor::Digest) -> Error {
        self.hashid = Some(digest.hashid());
        self
    }

    /// Names the seq.
    pub fn with_seq(mut self, seq: crate::ids::Seq) -> Error {
        self.seq = Some(seq);
        self
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} (operation {}",
            self.code, self.message, self.operation
        )?;
        if let Some(t) = self.target {
            write!(f, ", target {}", t.0)?;
        }
        if let Some(n) = self.namespace {
            write!(f, ", namespace {n}")?;
        }
        if let Some(h) = self.hashid {
            write!(f, ", hashid {h}")?;
        }
        if let Some(s) = self.seq {
            write!(f, ", seq {}", s.0)?;
        }
        f.write_str(")")
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::Digest;
    use crate::ids::{Namespace, Seq, TargetId};

    #[test]
    fn error_codes_round_trip_in_text_and_wire_form() {
        for code in ErrorCode::ALL {
            assert_eq!(code.as_str().parse::<ErrorCode>(), Ok(*code));
            assert_eq!(ErrorCode::from_u16(code.as_u16()), Some(*code));
        }
        assert_eq!(ErrorCode::from_u16(0), None);
        assert_eq!(
            "NOPE".parse::<ErrorCode>(),
            Err(UnknownErrorCode("NOPE".to_owned()))
        );
    }

    #[test]
    fn an_error_names_its_context_in_text_and_json() {
        let e = Error::new(
            ErrorCode::LOCAL_SLOT_EXHAUSTED,
            OperationKind::Register,
            "no free slot",
        )
        .with_target(TargetId(2))
        .with_namespace(Namespace::LocalPython)
        .with_digest(Digest([0xab; 32]))
        .with_seq(Seq(7));
        let hashid = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(
            e.to_string(),
            format!("LOCAL_SLOT_EXHAUSTED: no free slot (operation register, target 2, namespace LOCAL_PYTHON, hashid {hashid}, seq 7)")
        );
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "code": "LOCAL_SLOT_EXHAUSTED",
                "operation": "register",
                "target": 2,
                "namespace": "LOCAL_PYTHON",
                "hashid": hashid,
                "seq": 7,
                "message": "no free slot",
            })
        );
        assert_eq!(serde_json::from_value::<Error>(json).unwrap(), e);
        let bare = Error::new(
            ErrorCode::LIFECYCLE_INVALID,
            OperationKind::Close,
            "closed twice",
        );
        assert_eq!(
            bare.to_string(),
            "LIFECYCLE_INVALID: closed twice (operation close)"
        );
    }
}
