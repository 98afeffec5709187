//! Canonical descriptors, digests and hashids (specs/design.md §3.2).
//!
//! ```
//! use callreg::descriptor::{python_serialized_digest, Descriptor, HashId, PythonImport};
//! use callreg::envelope::{encode, Envelope};
//!
//! // A serialized callable: identified by its envelope's payload.
//! let staged = encode(&[0x80, 0x05, 0x4e, 0x2e]);
//! let digest = python_serialized_digest(&Envelope::parse(&staged).unwrap());
//! assert_eq!(
//!     digest.hashid().to_string(),
//!     "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1"
//! );
//!
//! // An importable callable: identified by `module:qualname`.
//! let import = Descriptor::PythonImport(PythonImport::new("pkg.mod", "Class.method").unwrap());
//! let hashid: HashId = "sha256:6086292cb02d057e8b0de3739e65ba81b361f93368d5ebc4d4fc21865dbee107"
//!     .parse()
//!     .unwrap();
//! assert_eq!(import.digest().unwrap(), hashid.digest());
//! ```

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::envelope::Envelope;

/// The text prefix of every hashid (specs/design.md §3.2).
pub const HASHID_PREFIX: &str = "sha256:";

/// Length of a hashid in characters: `sha256:` (7) + 64 lowercase hex digits.
pub const HASHID_LEN: usize = 7 + 64;

/// A 32-byte SHA-256 digest of a canonical descriptor: the identity of a
/// callable (specs/design.md §3.2). Its text form is a [`HashId`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The hashid (`sha256:` + 64 lowercase hex) of this digest.
    pub fn hashid(&self) -> HashId {
        HashId(*self)
    }

    /// Lowercase hex of the 32 bytes (64 characters), without prefix.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
        s
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Short form keeps model-checker traces readable.
        write!(f, "Digest({}…)", &self.to_hex()[..12])
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{HASHID_PREFIX}{}", self.to_hex())
    }
}

/// The text form of a [`Digest`]: exactly `sha256:` followed by 64 lowercase
/// hex digits (specs/design.md §3.2). Parsing is strict: no whitespace, no upper
/// case, no other prefix.
///
/// ```
/// use callreg::descriptor::{HashId, HashIdError};
///
/// let text = "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1";
/// let hashid: HashId = text.parse().unwrap();
/// assert_eq!(hashid.to_string(), text);
/// assert_eq!(hashid.digest().as_bytes()[0], 0x8d);
///
/// assert_eq!(text.to_uppercase().parse::<HashId>(), Err(HashIdError::MissingPrefix));
/// assert_eq!(
///     format!("{text} ").parse::<HashId>(),
///     Err(HashIdError::WrongLength { len: 72 })
/// );
/// assert_eq!(
///     text.replace("8d96", "8D96").parse::<HashId>(),
///     Err(HashIdError::BadDigit { offset: 8, found: 'D' })
/// );
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HashId(pub Digest);

impl HashId {
    /// The digest this hashid names.
    pub fn digest(&self) -> Digest {
        self.0
    }
}

impl From<Digest> for HashId {
    fn from(d: Digest) -> Self {
        HashId(d)
    }
}

impl fmt::Debug for HashId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HashId({})", self.0)
    }
}

impl fmt::Display for HashId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// Why a text is not a hashid (error code `HASHID_FORMAT_INVALID`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HashIdError {
    /// The text does not start with `sha256:`.
    #[error("HASHID_FORMAT_INVALID: hashid must start with \"sha256:\"")]
    MissingPrefix,
    /// The text is not `sha256:` + 64 characters long.
    #[error("HASHID_FORMAT_INVALID: hashid must be 71 characters (\"sha256:\" + 64 hex digits), got {len}")]
    WrongLength {
        /// Length of the offending text in bytes.
        len: usize,
    },
    /// A character after the prefix is not a lowercase hex digit.
    #[error("HASHID_FORMAT_INVALID: character {found:?} at offset {offset} is not a lowercase hex digit")]
    BadDigit {
        /// Byte offset of the character in the whole text.
        offset: usize,
        /// The offending character.
        found: char,
    },
}

impl FromStr for HashId {
    type Err = HashIdError;

    /// Parses exactly `sha256:` + `[0-9a-f]{64}`.
    ///
    /// # Errors
    /// [`HashIdError::MissingPrefix`], then [`HashIdError::WrongLength`], then
    /// [`HashIdError::BadDigit`] for the first character that is not a
    /// lowercase hex digit.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some(hex) = s.strip_prefix(HASHID_PREFIX) else {
            return Err(HashIdError::MissingPrefix);
        };
        if s.len() != HASHID_LEN {
            return Err(HashIdError::WrongLength { len: s.len() });
        }
        let mut out = [0u8; 32];
        let bytes = hex.as_bytes();
        for (i, byte) in out.iter_mut().enumerate() {
            let mut v = 0u8;
            for k in 0..2 {
                let pos = 2 * i + k;
                let c = bytes[pos];
                let nibble = match c {
                    b'0'..=b'9' => c - b'0',
                    b'a'..=b'f' => c - b'a' + 10,
                    _ => {
                        let offset = HASHID_PREFIX.len() + pos;
                        let found = s[offset..].chars().next().unwrap_or('\u{fffd}');
                        return Err(HashIdError::BadDigit { offset, found });
                    }
                };
                v = (v << 4) | nibble;
            }
            *byte = v;
        }
        Ok(HashId(Digest(out)))
    }
}

impl Serialize for HashId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HashId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        HashId(*self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        HashId::deserialize(d).map(|h| h.0)
    }
}

impl Digest {
    /// SHA-256 of `bytes` (one pass, no copy).
    pub fn sha256(bytes: &[u8]) -> Digest {
        use sha2::Digest as _;
        Digest(sha2::Sha256::digest(bytes).into())
    }

    /// The digest of canonical descriptor bytes: `sha256(descriptor)`
    /// (specs/design.md §3.2). Use [`Descriptor::digest`] to build and hash in one
    /// step.
    pub fn of_descriptor(descriptor_bytes: &[u8]) -> Digest {
        Digest::sha256(descriptor_bytes)
    }
}

/// `schema_version`, the first u32 of every descriptor (specs/design.md §3.2).
pub const SCHEMA_VERSION: u32 = 1;

/// Length in bytes of every PYTHON_SERIALIZED descriptor: five u32 fields
/// (schema, kind, format version, serializer id, digest length) + 32.
pub const PYTHON_SERIALIZED_LEN: usize = 52;

/// `callable_kind`, the second u32 of every descriptor (specs/design.md §3.2).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum CallableKind {
    /// A compiled chip callable (wire value 1).
    ChipCallable = 1,
    /// A serialized Python callable in a SPYC envelope (wire value 2).
    PythonSerialized = 2,
    /// A Python callable named by `module:qualname` (wire value 3).
    PythonImport = 3,
}

impl CallableKind {
    /// The u32 written in descriptors.
    pub fn as_u32(self) -> u32 {
        self as u32
    }
}

/// Direction of one CHIP_CALLABLE argument in the signature schema
/// (specs/design.md §3.2).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Direction {
    /// A by-value scalar (wire value 0).
    Scalar = 0,
    /// A buffer the callable reads (wire value 1).
    In = 1,
    /// A buffer the callable writes (wire value 2).
    Out = 2,
    /// A buffer the callable reads and writes (wire value 3).
    InOut = 3,
}

impl Direction {
    /// The u32 written in the signature schema.
    pub fn as_u32(self) -> u32 {
        self as u32
    }
}

/// Why descriptor fields are invalid (error code
/// [`ErrorCode::DESCRIPTOR_INVALID`](crate::error::ErrorCode::DESCRIPTOR_INVALID)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorError {
    /// A `module:qualname` text does not have exactly one `:`.
    #[error(
        "DESCRIPTOR_INVALID: import path {path:?} must contain exactly one ':' (found {colons})"
    )]
    ImportColonCount {
        /// The offending text.
        path: String,
        /// Number of `:` characters found.
        colons: usize,
    },
    /// The module is relative (starts with `.`); it must be absolute.
    #[error("DESCRIPTOR_INVALID: module {module:?} is relative; it must be absolute")]
    ImportRelativeModule {
        /// The offending module name.
        module: String,
    },
    /// The qualname names a function-local object (`<locals>`), which
    /// cannot be imported.
    #[error("DESCRIPTOR_INVALID: qualname {qualname:?} contains <locals> and cannot be imported")]
    ImportLocals {
        /// The offending qualname.
        qualname: String,
    },
    /// A dotted part of the module or qualname is not an identifier
    /// (empty, or not `[A-Za-z_][A-Za-z0-9_]*` over Unicode letters and digits).
    #[error("DESCRIPTOR_INVALID: {field} {text:?} has part {part:?} that is not an identifier")]
    ImportBadIdentifier {
        /// `"module"` or `"qualname"`.
        field: &'static str,
        /// The whole module or qualname.
        text: String,
        /// The offending dotted part (may be empty).
        part: String,
    },
    /// A string or byte field is longer than a u32 length prefix allows.
    #[error(
        "DESCRIPTOR_INVALID: field {field} is {len} bytes, more than a u32 length prefix allows"
    )]
    FieldTooLong {
        /// The field's name.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
    },
}

impl DescriptorError {
    /// The error code of every descriptor error.
    pub fn code(&self) -> crate::error::ErrorCode {
        crate::error::ErrorCode::DESCRIPTOR_INVALID
    }
}

/// Appends `u32` little-endian.
fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a `u32 length` + bytes field (specs/design.md §3.2 primitives).
fn put_bytes(out: &mut Vec<u8>, field: &'static str, bytes: &[u8]) -> Result<(), DescriptorError> {
    let len = u32::try_from(bytes.len()).map_err(|_| DescriptorError::FieldTooLong {
        field,
        len: bytes.len(),
    })?;
    put_u32(out, len);
    out.extend_from_slice(bytes);
    Ok(())
}

/// The canonical PYTHON_SERIALIZED descriptor (always 52 bytes,
/// specs/design.md §3.2): `u32 1, u32 2, u32 payload_format_version,
/// u32 serializer_id, u32 32, sha256(payload)[32]`.
pub fn python_serialized_descriptor(
    payload_format_version: u8,
    serializer_id: u8,
    payload_sha256: &Digest,
) -> [u8; PYTHON_SERIALIZED_LEN] {
    let mut d = [0u8; PYTHON_SERIALIZED_LEN];
    d[0..4].copy_from_slice(&SCHEMA_VERSION.to_le_bytes());
    d[4..8].copy_from_slice(&CallableKind::PythonSerialized.as_u32().to_le_bytes());
    d[8..12].copy_from_slice(&u32::from(payload_format_version).to_le_bytes());
    d[12..16].copy_from_slice(&u32::from(serializer_id).to_le_bytes());
    d[16..20].copy_from_slice(&32u32.to_le_bytes());
    d[20..52].copy_from_slice(&payload_sha256.0);
    d
}

/// The digest of an envelope's PYTHON_SERIALIZED descriptor: one SHA-256
/// pass over the payload, then one over the 52 descriptor bytes. This is
/// the fast path the parent and targets use (specs/design.md §3.2).
///
/// ```
/// use callreg::descriptor::{python_serialized_digest, Digest, PythonSerialized};
/// use callreg::envelope::{encode, Envelope};
///
/// let staged = encode(b"any payload");
/// let envelope = Envelope::parse(&staged).unwrap();
/// let descriptor = PythonSerialized::from_envelope(&envelope).to_bytes();
/// assert_eq!(descriptor.len(), 52);
/// assert_eq!(python_serialized_digest(&envelope), Digest::of_descriptor(&descriptor));
/// ```
pub fn python_serialized_digest(envelope: &Envelope<'_>) -> Digest {
    PythonSerialized::from_envelope(envelope).digest()
}

/// Fields of a PYTHON_SERIALIZED descriptor (specs/design.md §3.2): the envelope's
/// version and serializer, and the SHA-256 of the serializer payload only
/// (not the header, not trailing slack).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub struct PythonSerialized {
    /// The envelope's version byte.
    pub payload_format_version: u8,
    /// The envelope's serializer byte.
    pub serializer_id: u8,
    /// SHA-256 of the serializer payload (JSON: `sha256:<hex>`).
    pub payload_sha256: Digest,
}

impl PythonSerialized {
    /// Describes a parsed envelope; hashes its payload once.
    pub fn from_envelope(envelope: &Envelope<'_>) -> Self {
        PythonSerialized {
            payload_format_version: envelope.version(),
            serializer_id: envelope.serializer(),
            payload_sha256: Digest::sha256(envelope.payload()),
        }
    }

    /// The 52 canonical descriptor bytes.
    pub fn to_bytes(&self) -> [u8; PYTHON_SERIALIZED_LEN] {
        python_serialized_descriptor(
            self.payload_format_version,
            self.serializer_id,
            &self.payload_sha256,
        )
    }

    /// `sha256` of the canonical descriptor bytes.
    pub fn digest(&self) -> Digest {
        Digest::of_descriptor(&self.to_bytes())
    }
}

/// Fields of a PYTHON_IMPORT descriptor (specs/design.md §3.2): an absolute,
/// dotted module and a dotted qualname without `<locals>`. Constructed only
/// through validation ([`PythonImport::new`], [`FromStr`], serde).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(try_from = "PythonImportFields")]
pub struct PythonImport {
    module: String,
    qualname: String,
}

#[derive(Deserialize)]
struct PythonImportFields {
    module: String,
    qualname: String,
}

impl TryFrom<PythonImportFields> for PythonImport {
    type Error = DescriptorError;
    fn try_from(f: PythonImportFields) -> Result<Self, Self::Error> {
        PythonImport::new(&f.module, &f.qualname)
    }
}

/// True when `part` is a Python identifier: a letter or `_`, then letters,
/// digits or `_` (Unicode letters and digits allowed, as in Python 3).
fn is_identifier(part: &str) -> bool {
    let mut chars = part.chars();
    match chars.next() {
        Some(c) if c == '_' || c.is_alphabetic() => {}
        _ => return false,
    }
    chars.all(|c| c == '_' || c.is_alphanumeric())
}

fn check_dotted(field: &'static str, text: &str) -> Result<(), DescriptorError> {
    for part in text.split('.') {
        if !is_identifier(part) {
            return Err(DescriptorError::ImportBadIdentifier {
                field,
                text: text.to_owned(),
                part: part.to_owned(),
            });
        }
    }
    Ok(())
}

impl PythonImport {
    /// Validates and builds a PYTHON_IMPORT descriptor.
    ///
    /// # Errors
    /// In this order: [`DescriptorError::ImportColonCount`] if either part
    /// contains `:`; [`DescriptorError::ImportRelativeModule`] if `module`
    /// starts with `.`; [`DescriptorError::ImportLocals`] if `qualname`
    /// contains `<locals>`; [`DescriptorError::ImportBadIdentifier`] for the
    /// first dotted part of the module, then of the qualname, that is not an
    /// identifier.
    ///
    /// ```
    /// use callreg::descriptor::{DescriptorError, PythonImport};
    ///
    /// let import = PythonImport::new("os.path", "join").unwrap();
    /// assert_eq!((import.module(), import.qualname()), ("os.path", "join"));
    /// assert!(matches!(
    ///     PythonImport::new("pkg", "outer.<locals>.inner"),
    ///     Err(DescriptorError::ImportLocals { .. })
    /// ));
    /// ```
    pub fn new(module: &str, qualname: &str) -> Result<Self, DescriptorError> {
        let colons = module.matches(':').count() + qualname.matches(':').count();
        if colons != 0 {
            return Err(DescriptorError::ImportColonCount {
                path: format!("{module}:{qualname}"),
                colons: colons + 1,
            });
        }
        if module.starts_with('.') {
            return Err(DescriptorError::ImportRelativeModule {
                module: module.to_owned(),
            });
        }
        if qualname.contains("<locals>") {
            return Err(DescriptorError::ImportLocals {
                qualname: qualname.to_owned(),
            });
        }
        check_dotted("module", module)?;
        check_dotted("qualname", qualname)?;
        Ok(PythonImport {
            module: module.to_owned(),
            qualname: qualname.to_owned(),
        })
    }

    /// The absolute module name, e.g. `pkg.mod`.
    pub fn module(&self) -> &str {
        &self.module
    }

    /// The qualified name inside the module, e.g. `Class.method`.
    pub fn qualname(&self) -> &str {
        &self.qualname
    }

    /// The canonical descriptor bytes: `u32 1, u32 3, string module,
    /// string qualname`.
    ///
    /// # Errors
    /// [`DescriptorError::FieldTooLong`] if a name exceeds `u32::MAX` bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, DescriptorError> {
        let mut out = Vec::with_capacity(16 + self.module.len() + self.qualname.len());
        put_u32(&mut out, SCHEMA_VERSION);
        put_u32(&mut out, CallableKind::PythonImport.as_u32());
        put_bytes(&mut out, "module", self.module.as_bytes())?;
        put_bytes(&mut out, "qualname", self.qualname.as_bytes())?;
        Ok(out)
    }
}

impl FromStr for PythonImport {
    type Err = DescriptorError;

    /// Parses `module:qualname` (exactly one `:`), then validates as
    /// [`PythonImport::new`].
    fn from_str(path: &str) -> Result<Self, Self::Err> {
        let colons = path.matches(':').count();
        let Some((module, qualname)) = path.split_once(':').filter(|_| colons == 1) else {
            return Err(DescriptorError::ImportColonCount {
                path: path.to_owned(),
                colons,
            });
        };
        PythonImport::new(module, qualname)
    }
}

impl fmt::Display for PythonImport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.module, self.qualname)
    }
}

/// Fields of a CHIP_CALLABLE descriptor (specs/design.md §3.2).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub struct ChipCallable {
    /// Target architecture name, as the chip runtime spells it.
    pub target_arch: String,
    /// Platform name.
    pub platform: String,
    /// Runtime name.
    pub runtime: String,
    /// SHA-256 of the compiled callable blob (JSON: `sha256:<hex>`).
    pub blob_sha256: Digest,
    /// Direction of each argument, in order.
    pub signature: Vec<Direction>,
}

impl ChipCallable {
    /// The signature schema bytes: `u32 1, u32 count, u32 direction[count]`
    /// (specs/design.md §3.2).
    ///
    /// # Errors
    /// [`DescriptorError::FieldTooLong`] if there are more than `u32::MAX`
    /// arguments.
    pub fn signature_schema(&self) -> Result<Vec<u8>, DescriptorError> {
        let count =
            u32::try_from(self.signature.len()).map_err(|_| DescriptorError::FieldTooLong {
                field: "signature",
                len: self.signature.len(),
            })?;
        let mut out = Vec::with_capacity(8 + 4 * self.signature.len());
        put_u32(&mut out, 1);
        put_u32(&mut out, count);
        for d in &self.signature {
            put_u32(&mut out, d.as_u32());
        }
        Ok(out)
    }

    /// The canonical descriptor bytes: `u32 1, u32 1, string target_arch,
    /// string platform, string runtime, bytes(blob sha256),
    /// bytes(sha256 of the signature schema)`.
    ///
    /// # Errors
    /// [`DescriptorError::FieldTooLong`] if a string exceeds `u32::MAX`
    /// bytes or the signature `u32::MAX` arguments.
    pub fn to_bytes(&self) -> Result<Vec<u8>, DescriptorError> {
        let schema_digest = Digest::sha256(&self.signature_schema()?);
        let mut out = Vec::with_capacity(
            8 + 12 + self.target_arch.len() + self.platform.len() + self.runtime.len() + 72,
        );
        put_u32(&mut out, SCHEMA_VERSION);
        put_u32(&mut out, CallableKind::ChipCallable.as_u32());
        put_bytes(&mut out, "target_arch", self.target_arch.as_bytes())?;
        put_bytes(&mut out, "platform", self.platform.as_bytes())?;
        put_bytes(&mut out, "runtime", self.runtime.as_bytes())?;
        put_bytes(&mut out, "blob_sha256", &self.blob_sha256.0)?;
        put_bytes(&mut out, "signature_sha256", &schema_digest.0)?;
        Ok(out)
    }
}

/// A canonical descriptor of a callable (specs/design.md §3.2): the plain data
/// its identity is computed from.
///
/// JSON form (serde, [`Descriptor::to_json`], [`Descriptor::from_json`];
/// `specs/metadata.md`): a flat object, fields in this order,
/// `descriptor_schema_version` (always 1), `callable_kind`
/// (`PYTHON_SERIALIZED`, `PYTHON_IMPORT`, `CHIP_CALLABLE`), then the
/// kind's fields in their binary order, digests as 64 lowercase hex digits
/// without prefix:
///
/// ```json
/// {"descriptor_schema_version": 1, "callable_kind": "PYTHON_SERIALIZED",
///  "payload_format_version": 1, "serializer_id": "CLOUDPICKLE",
///  "payload_sha256": "6c09635decb8153d3c12e3782a69fd2eb097426f912547d351a8647b27d5580a"}
/// ```
///
/// The JSON form carries exactly the fields of the binary form, so
/// `Descriptor::from_json(text)?.to_bytes()` is the canonical descriptor
/// and its digest the hashid.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum Descriptor {
    /// A compiled chip callable.
    ChipCallable(ChipCallable),
    /// A serialized Python callable.
    PythonSerialized(PythonSerialized),
    /// A Python callable named by `module:qualname`.
    PythonImport(PythonImport),
}

impl Descriptor {
    /// The callable kind.
    pub fn kind(&self) -> CallableKind {
        match self {
            Descriptor::ChipCallable(_) => CallableKind::ChipCallable,
            Descriptor::PythonSerialized(_) => CallableKind::PythonSerialized,
            Descriptor::PythonImport(_) => CallableKind::PythonImport,
        }
    }

    /// The canonical descriptor bytes of the kind (see each kind's
    /// `to_bytes`).
    ///
    /// # Errors
    /// [`DescriptorError::FieldTooLong`] when a field exceeds its u32 length
    /// prefix (never for PYTHON_SERIALIZED).
    pub fn to_bytes(&self) -> Result<Vec<u8>, DescriptorError> {
        match self {
            Descriptor::ChipCallable(c) => c.to_bytes(),
            Descriptor::PythonSerialized(p) => Ok(p.to_bytes().to_vec()),
            Descriptor::PythonImport(p) => p.to_bytes(),
        }
    }

    /// `sha256` of the canonical descriptor bytes.
    ///
    /// # Errors
    /// As [`Descriptor::to_bytes`].
    pub fn digest(&self) -> Result<Digest, DescriptorError> {
        Ok(Digest::of_descriptor(&self.to_bytes()?))
    }
}

/// The JSON name of serializer id 1 (specs/design.md §3.1).
pub const SERIALIZER_NAME_CLOUDPICKLE: &str = "CLOUDPICKLE";

/// A JSON `serializer_id`: the name `"CLOUDPICKLE"` for id 1, the number
/// (0–255) for an id this build has no name for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct SerializerIdJson(u8);

impl Serialize for SerializerIdJson {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 == crate::envelope::SERIALIZER_CLOUDPICKLE {
            s.serialize_str(SERIALIZER_NAME_CLOUDPICKLE)
        } else {
            s.serialize_u8(self.0)
        }
    }
}

impl<'de> Deserialize<'de> for SerializerIdJson {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = SerializerIdJson;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"CLOUDPICKLE\" or a serializer id 0-255")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                if v == SERIALIZER_NAME_CLOUDPICKLE {
                    Ok(SerializerIdJson(crate::envelope::SERIALIZER_CLOUDPICKLE))
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Str(v), &self))
                }
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u8::try_from(v)
                    .map(SerializerIdJson)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(v), &self))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// A digest written as 64 lowercase hex digits without the `sha256:`
/// prefix (the descriptor JSON form of `payload_sha256` and `blob_sha256`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct HexDigest(Digest);

impl Serialize for HexDigest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0.to_hex())
    }
}

impl<'de> Deserialize<'de> for HexDigest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        let valid = text.len() == 64 && text.bytes().all(|b| HEX.contains(&b));
        if !valid {
            return Err(serde::de::Error::custom(format!(
                "expected 64 lowercase hex digits without prefix, got {text:?}"
            )));
        }
        format!("{HASHID_PREFIX}{text}")
            .parse::<HashId>()
            .map(|h| HexDigest(h.0))
            .map_err(serde::de::Error::custom)
    }
}

/// Every field any descriptor kind has in JSON; which must and may appear
/// depends on `callable_kind` (checked in [`Descriptor::try_from`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptorFields {
    descriptor_schema_version: u32,
    callable_kind: CallableKind,
    payload_format_version: Option<u8>,
    serializer_id: Option<SerializerIdJson>,
    payload_sha256: Option<HexDigest>,
    module: Option<String>,
    qualname: Option<String>,
    target_arch: Option<String>,
    platform: Option<String>,
    runtime: Option<String>,
    blob_sha256: Option<HexDigest>,
    signature: Option<Vec<Direction>>,
}

impl DescriptorFields {
    /// The names of the fields present, in declaration order, with kind.
    fn present(&self) -> [(&'static str, bool); 10] {
        [
            (
                "payload_format_version",
                self.payload_format_version.is_some(),
            ),
            ("serializer_id", self.serializer_id.is_some()),
            ("payload_sha256", self.payload_sha256.is_some()),
            ("module", self.module.is_some()),
            ("qualname", self.qualname.is_some()),
            ("target_arch", self.target_arch.is_some()),
            ("platform", self.platform.is_some()),
            ("runtime", self.runtime.is_some()),
            ("blob_sha256", self.blob_sha256.is_some()),
            ("signature", self.signature.is_some()),
        ]
    }
}

/// The JSON fields of each kind, after the two common ones.
fn kind_fields(kind: CallableKind) -> &'static [&'static str] {
    match kind {
        CallableKind::PythonSerialized => {
            &["payload_format_version", "serializer_id", "payload_sha256"]
        }
        CallableKind::PythonImport => &["module", "qualname"],
        CallableKind::ChipCallable => &[
            "target_arch",
            "platform",
            "runtime",
            "blob_sha256",
            "signature",
        ],
    }
}

fn kind_name(kind: CallableKind) -> &'static str {
    match kind {
        CallableKind::ChipCallable => "CHIP_CALLABLE",
        CallableKind::PythonSerialized => "PYTHON_SERIALIZED",
        CallableKind::PythonImport => "PYTHON_IMPORT",
    }
}

impl TryFrom<DescriptorFields> for Descriptor {
    type Error = String;

    /// Checks the schema version, that every field of the kind is present
    /// and no field of another kind is, then validates as the binary form.
    fn try_from(f: DescriptorFields) -> Result<Self, String> {
        if f.descriptor_schema_version != SCHEMA_VERSION {
            return Err(format!(
                "descriptor_schema_version must be {SCHEMA_VERSION}, got {}",
                f.descriptor_schema_version
            ));
        }
        let kind = f.callable_kind;
        let wanted = kind_fields(kind);
        for (name, present) in f.present() {
            if present && !wanted.contains(&name) {
                return Err(format!(
                    "field `{name}` does not belong to callable_kind {}",
                    kind_name(kind)
                ));
            }
            if !present && wanted.contains(&name) {
                return Err(format!(
                    "missing field `{name}` (required by callable_kind {})",
                    kind_name(kind)
                ));
            }
        }
        // Every field of the kind is present (checked above).
        let missing = |name: &str| format!("missing field `{name}`");
        Ok(match kind {
            CallableKind::PythonSerialized => Descriptor::PythonSerialized(PythonSerialized {
                payload_format_version: f
                    .payload_format_version
                    .ok_or_else(|| missing("payload_format_version"))?,
                serializer_id: f.serializer_id.ok_or_else(|| missing("serializer_id"))?.0,
                payload_sha256: f.payload_sha256.ok_or_else(|| missing("payload_sha256"))?.0,
            }),
            CallableKind::PythonImport => Descriptor::PythonImport(
                PythonImport::new(
                    &f.module.ok_or_else(|| missing("module"))?,
                    &f.qualname.ok_or_else(|| missing("qualname"))?,
                )
                .map_err(|e| e.to_string())?,
            ),
            CallableKind::ChipCallable => Descriptor::ChipCallable(ChipCallable {
                target_arch: f.target_arch.ok_or_else(|| missing("target_arch"))?,
                platform: f.platform.ok_or_else(|| missing("platform"))?,
                runtime: f.runtime.ok_or_else(|| missing("runtime"))?,
                blob_sha256: f.blob_sha256.ok_or_else(|| missing("blob_sha256"))?.0,
                signature: f.signature.ok_or_else(|| missing("signature"))?,
            }),
        })
    }
}

impl Serialize for Descriptor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let kind = self.kind();
        let len = 2 + kind_fields(kind).len();
        let mut map = s.serialize_map(Some(len))?;
        map.serialize_entry("descriptor_schema_version", &SCHEMA_VERSION)?;
        map.serialize_entry("callable_kind", &kind)?;
        match self {
            Descriptor::PythonSerialized(p) => {
                map.serialize_entry("payload_format_version", &p.payload_format_version)?;
                map.serialize_entry("serializer_id", &SerializerIdJson(p.serializer_id))?;
                map.serialize_entry("payload_sha256", &HexDigest(p.payload_sha256))?;
            }
            Descriptor::PythonImport(p) => {
                map.serialize_entry("module", p.module())?;
                map.serialize_entry("qualname", p.qualname())?;
            }
            Descriptor::ChipCallable(c) => {
                map.serialize_entry("target_arch", &c.target_arch)?;
                map.serialize_entry("platform", &c.platform)?;
                map.serialize_entry("runtime", &c.runtime)?;
                map.serialize_entry("blob_sha256", &HexDigest(c.blob_sha256))?;
                map.serialize_entry("signature", &c.signature)?;
            }
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Descriptor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let fields = DescriptorFields::deserialize(d)?;
        Descriptor::try_from(fields).map_err(serde::de::Error::custom)
    }
}

impl Descriptor {
    /// The JSON form (compact, fields in the documented order).
    pub fn to_json(&self) -> String {
        // A descriptor holds only strings, integers and lists of them, all
        // representable in JSON, so serialization cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The JSON form, indented by two spaces (the golden files' layout).
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Parses the JSON form strictly.
    ///
    /// # Errors
    /// [`JsonError`](crate::json::JsonError) (code `DESCRIPTOR_INVALID`)
    /// naming the field: an unknown field; a wrong type; a missing field of
    /// the kind or a field of another kind; `descriptor_schema_version`
    /// other than 1; a digest that is not 64 lowercase hex digits; a
    /// `serializer_id` that is neither `"CLOUDPICKLE"` nor 0–255; a
    /// PYTHON_IMPORT name that [`PythonImport::new`] rejects.
    pub fn from_json(text: &str) -> Result<Descriptor, crate::json::JsonError> {
        crate::json::from_str(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KNOWN: &str = "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1";

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn python_serialized_known_vector() {
        let staged = crate::envelope::encode(&[0x80, 0x05, 0x4e, 0x2e]);
        let env = Envelope::parse(&staged).unwrap();
        let desc = PythonSerialized::from_envelope(&env);
        let bytes = desc.to_bytes();
        assert_eq!(
            hex(&bytes),
            "0100000002000000010000000100000020000000\
             6c09635decb8153d3c12e3782a69fd2eb097426f912547d351a8647b27d5580a"
        );
        assert_eq!(python_serialized_digest(&env).to_string(), KNOWN);
        let whole = Descriptor::PythonSerialized(desc);
        assert_eq!(whole.kind(), CallableKind::PythonSerialized);
        assert_eq!(whole.digest().unwrap().to_string(), KNOWN);
    }

    #[test]
    fn python_import_known_vector() {
        let imp: PythonImport = "pkg.mod:Class.method".parse().unwrap();
        assert_eq!(imp.module(), "pkg.mod");
        assert_eq!(imp.qualname(), "Class.method");
        assert_eq!(imp.to_string(), "pkg.mod:Class.method");
        assert_eq!(
            hex(&imp.to_bytes().unwrap()),
            "010000000300000007000000706b672e6d6f640c000000436c6173732e6d6574686f64"
        );
        assert_eq!(
            Descriptor::PythonImport(imp).digest().unwrap().to_string(),
            "sha256:6086292cb02d057e8b0de3739e65ba81b361f93368d5ebc4d4fc21865dbee107"
        );
    }

    #[test]
    fn python_import_rejects_each_fault() {
        assert_eq!(
            "pkg.mod".parse::<PythonImport>(),
            Err(DescriptorError::ImportColonCount {
                path: "pkg.mod".into(),
                colons: 0
            })
        );
        assert_eq!(
            "a:b:c".parse::<PythonImport>(),
            Err(DescriptorError::ImportColonCount {
                path: "a:b:c".into(),
                colons: 2
            })
        );
        assert_eq!(
            ".mod:f".parse::<PythonImport>(),
            Err(DescriptorError::ImportRelativeModule {
                module: ".mod".into()
            })
        );
        assert_eq!(
            "mod:outer.<locals>.inner".parse::<PythonImport>(),
            Err(DescriptorError::ImportLocals {
                qualname: "outer.<locals>.inner".into()
            })
        );
        assert_eq!(
            "pkg..mod:f".parse::<PythonImport>(),
            Err(DescriptorError::ImportBadIdentifier {
                field: "module",
                text: "pkg..mod".into(),
                part: "".into()
            })
        );
        assert_eq!(
            "pkg:1f".parse::<PythonImport>(),
            Err(DescriptorError::ImportBadIdentifier {
                field: "qualname",
                text: "1f".into(),
                part: "1f".into()
            })
        );
        assert_eq!(
            ":f".parse::<PythonImport>(),
            Err(DescriptorError::ImportBadIdentifier {
                field: "module",
                text: "".into(),
                part: "".into()
            })
        );
        assert_eq!(
            PythonImport::new("m", "a:b"),
            Err(DescriptorError::ImportColonCount {
                path: "m:a:b".into(),
                colons: 2
            })
        );
        // Serde goes through the same validation.
        let bad: Result<PythonImport, _> =
            serde_json::from_str(r#"{"module":".x","qualname":"f"}"#);
        assert!(bad.unwrap_err().to_string().contains("relative"));
        let good: PythonImport =
            serde_json::from_str(r#"{"module":"_x.y2","qualname":"Cls.f"}"#).unwrap();
        assert_eq!(good.to_string(), "_x.y2:Cls.f");
    }

    /// Expected bytes computed independently from specs/design.md §3.2 with Python
    /// `struct`/`hashlib` (arch "arch", platform "plat", runtime "rt",
    /// blob b"blob", signature IN, OUT, SCALAR).
    #[test]
    fn chip_callable_vector() {
        let chip = ChipCallable {
            target_arch: "arch".into(),
            platform: "plat".into(),
            runtime: "rt".into(),
            blob_sha256: Digest::sha256(b"blob"),
            signature: vec![Direction::In, Direction::Out, Direction::Scalar],
        };
        assert_eq!(
            hex(&chip.signature_schema().unwrap()),
            "0100000003000000010000000200000000000000"
        );
        assert_eq!(
            hex(&chip.to_bytes().unwrap()),
            "0100000001000000040000006172636804000000706c617402000000727420000000\
             fa2c8cc4f28176bbeed4b736df569a34c79cd3723e9ec42f9674b4d46ac6b8b8\
             20000000\
             79503f00edda36b2de80e680ae737197d02a01a92f89be2ddc3819d3667eca92"
        );
        let d = Descriptor::ChipCallable(chip);
        assert_eq!(
            d.digest().unwrap().to_string(),
            "sha256:f2f0ecc11b4065db0305c15790d1da17d191bb4ee1456848c3b471724d0deeda"
        );
        let json = d.to_json();
        assert_eq!(
            json,
            r#"{"descriptor_schema_version":1,"callable_kind":"CHIP_CALLABLE","target_arch":"arch","platform":"plat","runtime":"rt","blob_sha256":"fa2c8cc4f28176bbeed4b736df569a34c79cd3723e9ec42f9674b4d46ac6b8b8","signature":["IN","OUT","SCALAR"]}"#
        );
        let back: Descriptor = serde_json::from_str(&json).unwrap();
        assert_eq!(back, d);
        assert_eq!(Direction::InOut.as_u32(), 3);
    }

    #[test]
    fn hashid_round_trips() {
        let h: HashId = KNOWN.parse().unwrap();
        assert_eq!(h.to_string(), KNOWN);
        assert_eq!(h.digest().0[0], 0x8d);
        assert_eq!(serde_json::to_string(&h).unwrap(), format!("\"{KNOWN}\""));
        let back: HashId = serde_json::from_str(&format!("\"{KNOWN}\"")).unwrap();
        assert_eq!(back, h);
    }

    #[test]
    fn hashid_rejects_each_fault() {
        assert_eq!("md5:00".parse::<HashId>(), Err(HashIdError::MissingPrefix));
        assert_eq!(
            format!("{KNOWN} ").parse::<HashId>(),
            Err(HashIdError::WrongLength { len: 72 })
        );
        let upper = KNOWN.replace("8d96", "8D96");
        assert_eq!(
            upper.parse::<HashId>(),
            Err(HashIdError::BadDigit {
                offset: 8,
                found: 'D'
            })
        );
        let spaced = KNOWN.replacen("8d", " d", 1);
        assert_eq!(
            spaced.parse::<HashId>(),
            Err(HashIdError::BadDigit {
                offset: 7,
                found: ' '
            })
        );
    }
}
