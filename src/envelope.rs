//! SPYC envelope (specs/design.md §3.1): a 16-byte little-endian header followed
//! by the serializer payload (`cloudpickle.dumps(fn)` bytes).
//!
//! ```text
//! offset size field
//!      0    4 magic          b"SPYC"
//!      4    1 version (u8)   must be 1
//!      5    1 serializer (u8) 1 = CLOUDPICKLE, nothing else is supported
//!      6    2 flags (u16 LE) must be 0
//!      8    8 payload_size (u64 LE)  16 + payload_size <= staged bytes
//!     16    payload_size payload
//! ```
//!
//! [`Envelope::parse`] is a zero-copy view over the caller's staged bytes;
//! [`encode`] and [`encode_into`] build an envelope around a payload.
//!
//! ```
//! use callreg::envelope::{encode, Envelope, EnvelopeError, HEADER_LEN};
//!
//! let staged = encode(b"\x80\x05N."); // pickle.dumps(None)
//! assert_eq!(staged.len(), HEADER_LEN + 4);
//! let envelope = Envelope::parse(&staged)?;
//! assert_eq!(envelope.payload(), b"\x80\x05N.");
//!
//! // The checks run in order; the first failure is reported.
//! assert_eq!(
//!     Envelope::parse(b"SPYD\x01\x01\0\0\0\0\0\0\0\0\0\0"),
//!     Err(EnvelopeError::BadMagic { found: *b"SPYD" })
//! );
//! # Ok::<(), EnvelopeError>(())
//! ```

use crate::error::ErrorCode;

/// The four magic bytes every envelope starts with (specs/design.md §3.1).
pub const MAGIC: [u8; 4] = *b"SPYC";

/// Length of the envelope header in bytes (specs/design.md §3.1).
pub const HEADER_LEN: usize = 16;

/// The only envelope format version this crate reads and writes.
pub const VERSION: u8 = 1;

/// Serializer id of cloudpickle, the only supported serializer.
pub const SERIALIZER_CLOUDPICKLE: u8 = 1;

/// Why staged bytes are not a valid SPYC envelope (error code
/// [`ErrorCode::ENVELOPE_INVALID`]). One variant per check of
/// `specs/design.md` §3.1, in the order the checks run; each carries the offending values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// Fewer than [`HEADER_LEN`] staged bytes (check 1).
    #[error(
        "ENVELOPE_INVALID: header truncated: {staged_size} staged bytes, a SPYC header needs 16"
    )]
    HeaderTruncated {
        /// Number of staged bytes (0..=15).
        staged_size: usize,
    },
    /// The first four bytes are not `SPYC` (check 2).
    #[error("ENVELOPE_INVALID: bad magic {} (expected 53505943, \"SPYC\")", hex4(.found))]
    BadMagic {
        /// The four bytes found at offset 0.
        found: [u8; 4],
    },
    /// The version byte is not [`VERSION`] (check 3).
    #[error("ENVELOPE_INVALID: unsupported version {found} (supported: 1)")]
    UnsupportedVersion {
        /// The version byte found at offset 4.
        found: u8,
    },
    /// The serializer byte is not [`SERIALIZER_CLOUDPICKLE`] (check 4).
    #[error("ENVELOPE_INVALID: unsupported serializer {found} (supported: 1 = cloudpickle)")]
    UnsupportedSerializer {
        /// The serializer byte found at offset 5.
        found: u8,
    },
    /// The flags field is not zero (check 5).
    #[error("ENVELOPE_INVALID: non-zero flags {found:#06x} (must be 0)")]
    NonZeroFlags {
        /// The little-endian u16 found at offset 6.
        found: u16,
    },
    /// `16 + payload_size` exceeds the staged bytes, or overflows (check 6).
    #[error("ENVELOPE_INVALID: payload truncated: header declares {payload_size} payload bytes, only {available} staged after the 16-byte header")]
    PayloadTruncated {
        /// The declared payload size in bytes (u64 at offset 8).
        payload_size: u64,
        /// Staged bytes after the header (`staged_size - 16`).
        available: u64,
    },
}

fn hex4(bytes: &[u8; 4]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl EnvelopeError {
    /// The variant's name, e.g. `"BadMagic"`: the `"error"` field of
    /// `callreg inspect --json` and the names used by the shared vectors.
    pub fn variant_name(&self) -> &'static str {
        match self {
            EnvelopeError::HeaderTruncated { .. } => "HeaderTruncated",
            EnvelopeError::BadMagic { .. } => "BadMagic",
            EnvelopeError::UnsupportedVersion { .. } => "UnsupportedVersion",
            EnvelopeError::UnsupportedSerializer { .. } => "UnsupportedSerializer",
            EnvelopeError::NonZeroFlags { .. } => "NonZeroFlags",
            EnvelopeError::PayloadTruncated { .. } => "PayloadTruncated",
        }
    }

    /// The error code of every envelope error: [`ErrorCode::ENVELOPE_INVALID`].
    pub fn code(&self) -> ErrorCode {
        ErrorCode::ENVELOPE_INVALID
    }

    /// The message without the leading `ENVELOPE_INVALID: ` that `Display`
    /// carries, e.g. `bad magic 00000000 (expected 53505943, "SPYC")`: the
    /// text to put in an [`crate::error::Error`] or a failure that shows its
    /// own code, so the code is not printed twice.
    pub fn message(&self) -> String {
        let text = self.to_string();
        let prefix = format!("{}: ", self.code());
        match text.strip_prefix(&prefix) {
            Some(message) => message.to_owned(),
            None => text,
        }
    }
}

impl From<EnvelopeError> for ErrorCode {
    fn from(e: EnvelopeError) -> Self {
        e.code()
    }
}

/// A validated, zero-copy view of a SPYC envelope over staged bytes
/// (specs/design.md §3.1). Trailing bytes after the declared payload (e.g. page
/// rounding of a staged region) are allowed and ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Envelope<'a> {
    version: u8,
    serializer: u8,
    flags: u16,
    payload: &'a [u8],
    staged_size: usize,
}

impl<'a> Envelope<'a> {
    /// Validates `staged` with the six checks of specs/design.md §3.1, in order,
    /// and returns a view borrowing it. No copy, no allocation.
    ///
    /// # Errors
    /// The first failing check, in this order:
    /// [`EnvelopeError::HeaderTruncated`] (fewer than 16 bytes),
    /// [`EnvelopeError::BadMagic`], [`EnvelopeError::UnsupportedVersion`],
    /// [`EnvelopeError::UnsupportedSerializer`], [`EnvelopeError::NonZeroFlags`],
    /// [`EnvelopeError::PayloadTruncated`] (`16 + payload_size` greater than
    /// the staged length, computed without overflow).
    ///
    /// ```
    /// use callreg::envelope::{encode, Envelope, EnvelopeError};
    ///
    /// // Page-rounded staging: the bytes after the payload are ignored.
    /// let mut staged = encode(b"payload");
    /// staged.resize(4096, 0);
    /// let envelope = Envelope::parse(&staged).unwrap();
    /// assert_eq!((envelope.payload_size(), envelope.staged_size()), (7, 4096));
    ///
    /// // A declared size past the staged bytes.
    /// let short = &encode(b"payload")[..20];
    /// assert_eq!(
    ///     Envelope::parse(short).unwrap_err().to_string(),
    ///     "ENVELOPE_INVALID: payload truncated: header declares 7 payload bytes, \
    ///      only 4 staged after the 16-byte header"
    /// );
    /// assert!(matches!(Envelope::parse(short), Err(EnvelopeError::PayloadTruncated { .. })));
    /// ```
    pub fn parse(staged: &'a [u8]) -> Result<Self, EnvelopeError> {
        let Some((header, rest)) = staged.split_first_chunk::<HEADER_LEN>() else {
            return Err(EnvelopeError::HeaderTruncated {
                staged_size: staged.len(),
            });
        };
        let magic = [header[0], header[1], header[2], header[3]];
        if magic != MAGIC {
            return Err(EnvelopeError::BadMagic { found: magic });
        }
        let version = header[4];
        if version != VERSION {
            return Err(EnvelopeError::UnsupportedVersion { found: version });
        }
        let serializer = header[5];
        if serializer != SERIALIZER_CLOUDPICKLE {
            return Err(EnvelopeError::UnsupportedSerializer { found: serializer });
        }
        let flags = u16::from_le_bytes([header[6], header[7]]);
        if flags != 0 {
            return Err(EnvelopeError::NonZeroFlags { found: flags });
        }
        let mut size_bytes = [0u8; 8];
        size_bytes.copy_from_slice(&header[8..16]);
        let payload_size = u64::from_le_bytes(size_bytes);
        // Comparing against the bytes after the header is the overflow-safe
        // form of `16 + payload_size <= staged.len()`.
        let available = rest.len() as u64;
        if payload_size > available {
            return Err(EnvelopeError::PayloadTruncated {
                payload_size,
                available,
            });
        }
        // payload_size <= rest.len(), so it fits in usize.
        let payload = &rest[..payload_size as usize];
        Ok(Envelope {
            version,
            serializer,
            flags,
            payload,
            staged_size: staged.len(),
        })
    }

    /// The format version byte (always [`VERSION`] for a parsed envelope).
    pub fn version(&self) -> u8 {
        self.version
    }

    /// The serializer id byte (always [`SERIALIZER_CLOUDPICKLE`] here).
    pub fn serializer(&self) -> u8 {
        self.serializer
    }

    /// The flags field (always 0 for a parsed envelope).
    pub fn flags(&self) -> u16 {
        self.flags
    }

    /// The serializer payload: exactly `payload_size` bytes after the
    /// header, borrowed from the staged bytes.
    pub fn payload(&self) -> &'a [u8] {
        self.payload
    }

    /// The declared payload size in bytes (the header's u64 at offset 8).
    pub fn payload_size(&self) -> u64 {
        self.payload.len() as u64
    }

    /// Number of staged bytes the envelope was parsed from, in bytes,
    /// including the header and any trailing slack.
    pub fn staged_size(&self) -> usize {
        self.staged_size
    }

    /// Length of the envelope proper in bytes: `16 + payload_size`,
    /// excluding trailing slack.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.payload.len()
    }
}

/// The 16-byte header of a version-1 cloudpickle envelope around a payload
/// of `payload_size` bytes (specs/design.md §3.1).
pub fn header(payload_size: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC);
    h[4] = VERSION;
    h[5] = SERIALIZER_CLOUDPICKLE;
    // flags (h[6..8]) stay zero.
    h[8..16].copy_from_slice(&payload_size.to_le_bytes());
    h
}

/// Encodes `payload` as a version-1 cloudpickle envelope: a new vector of
/// `16 + payload.len()` bytes.
///
/// ```
/// let staged = callreg::envelope::encode(&[0x80, 0x05, 0x4e, 0x2e]);
/// assert_eq!(&staged[..8], b"SPYC\x01\x01\0\0");
/// assert_eq!(&staged[8..16], &4u64.to_le_bytes());
/// ```
pub fn encode(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&header(payload.len() as u64));
    out.extend_from_slice(payload);
    out
}

/// The caller's buffer cannot hold the encoded envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("buffer too small for SPYC envelope: need {needed} bytes, have {available}")]
pub struct BufferTooSmall {
    /// Bytes the envelope needs (`16 + payload.len()`).
    pub needed: usize,
    /// Length of the caller's buffer in bytes.
    pub available: usize,
}

/// Encodes `payload` as a version-1 cloudpickle envelope into the start of
/// `buf` (e.g. a staging mapping) and returns the bytes written
/// (`16 + payload.len()`). Bytes of `buf` past that are left untouched.
///
/// # Errors
/// [`BufferTooSmall`] when `buf.len() < 16 + payload.len()`; `buf` is then
/// not modified.
///
/// ```
/// use callreg::envelope::{encode, encode_into, BufferTooSmall};
///
/// let mut page = [0xffu8; 64];
/// assert_eq!(encode_into(b"abc", &mut page), Ok(19));
/// assert_eq!(&page[..19], encode(b"abc").as_slice());
/// assert_eq!(page[19], 0xff);
/// assert_eq!(
///     encode_into(b"abc", &mut [0u8; 18]),
///     Err(BufferTooSmall { needed: 19, available: 18 })
/// );
/// ```
pub fn encode_into(payload: &[u8], buf: &mut [u8]) -> Result<usize, BufferTooSmall> {
    let needed = payload
        .len()
        .checked_add(HEADER_LEN)
        .ok_or(BufferTooSmall {
            needed: usize::MAX,
            available: buf.len(),
        })?;
    if buf.len() < needed {
        return Err(BufferTooSmall {
            needed,
            available: buf.len(),
        });
    }
    buf[..HEADER_LEN].copy_from_slice(&header(payload.len() as u64));
    buf[HEADER_LEN..needed].copy_from_slice(payload);
    Ok(needed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KNOWN_ENVELOPE: &str = "5350594301010000040000000000000080054e2e";

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn known_vector_encodes_and_parses() {
        let bytes = encode(&[0x80, 0x05, 0x4e, 0x2e]);
        assert_eq!(hex(&bytes), KNOWN_ENVELOPE);
        let env = Envelope::parse(&bytes).unwrap();
        assert_eq!(env.payload(), &[0x80, 0x05, 0x4e, 0x2e]);
        assert_eq!(env.payload_size(), 4);
        assert_eq!(env.staged_size(), 20);
        assert_eq!(env.version(), 1);
        assert_eq!(env.serializer(), 1);
        assert_eq!(env.flags(), 0);
    }

    #[test]
    fn encode_into_checks_buffer() {
        let mut small = [0xaau8; 19];
        assert_eq!(
            encode_into(&[1, 2, 3, 4], &mut small),
            Err(BufferTooSmall {
                needed: 20,
                available: 19
            })
        );
        assert_eq!(small, [0xaau8; 19]);
        let mut page = [0xaau8; 32];
        assert_eq!(encode_into(&[0x80, 0x05, 0x4e, 0x2e], &mut page), Ok(20));
        assert_eq!(hex(&page[..20]), KNOWN_ENVELOPE);
        assert_eq!(&page[20..], &[0xaau8; 12]);
        // Trailing slack is ignored by the parser.
        assert_eq!(Envelope::parse(&page).unwrap().payload_size(), 4);
    }

    #[test]
    fn each_check_reports_its_values() {
        assert_eq!(
            Envelope::parse(&[0u8; 15]),
            Err(EnvelopeError::HeaderTruncated { staged_size: 15 })
        );
        let good = encode(b"abc");
        let mut b = good.clone();
        b[0] = b'X';
        assert_eq!(
            Envelope::parse(&b),
            Err(EnvelopeError::BadMagic { found: *b"XPYC" })
        );
        let mut b = good.clone();
        b[4] = 2;
        assert_eq!(
            Envelope::parse(&b),
            Err(EnvelopeError::UnsupportedVersion { found: 2 })
        );
        let mut b = good.clone();
        b[5] = 7;
        assert_eq!(
            Envelope::parse(&b),
            Err(EnvelopeError::UnsupportedSerializer { found: 7 })
        );
        let mut b = good.clone();
        b[7] = 1;
        assert_eq!(
            Envelope::parse(&b),
            Err(EnvelopeError::NonZeroFlags { found: 0x0100 })
        );
        let mut b = good.clone();
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            Envelope::parse(&b),
            Err(EnvelopeError::PayloadTruncated {
                payload_size: u64::MAX,
                available: 3
            })
        );
        assert_eq!(
            Envelope::parse(&good[..18]),
            Err(EnvelopeError::PayloadTruncated {
                payload_size: 3,
                available: 2
            })
        );
    }

    #[test]
    fn checks_run_in_order() {
        // Every field wrong at once: the magic check comes first.
        let mut b = [0xffu8; 16];
        b[0] = b'Z';
        assert_eq!(Envelope::parse(&b).unwrap_err().variant_name(), "BadMagic");
        b[0..4].copy_from_slice(&MAGIC);
        assert_eq!(
            Envelope::parse(&b).unwrap_err().variant_name(),
            "UnsupportedVersion"
        );
        b[4] = 1;
        assert_eq!(
            Envelope::parse(&b).unwrap_err().variant_name(),
            "UnsupportedSerializer"
        );
        b[5] = 1;
        assert_eq!(
            Envelope::parse(&b).unwrap_err().variant_name(),
            "NonZeroFlags"
        );
        b[6] = 0;
        b[7] = 0;
        assert_eq!(
            Envelope::parse(&b).unwrap_err().variant_name(),
            "PayloadTruncated"
        );
    }

    #[test]
    fn messages_name_the_values() {
        let e = EnvelopeError::BadMagic { found: *b"XPYC" };
        assert_eq!(
            e.to_string(),
            "ENVELOPE_INVALID: bad magic 58505943 (expected 53505943, \"SPYC\")"
        );
        assert_eq!(e.code(), ErrorCode::ENVELOPE_INVALID);
    }
}
