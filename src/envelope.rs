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
//! The out-of-band form (version [`VERSION_OUT_OF_BAND`], `specs/formats.md`
//! §1.1) has the same header; its payload is a pickle stream, the large
//! buffers the pickle refers to (pickle protocol 5's out-of-band buffers),
//! each at a page-aligned offset so a target maps it where it is, a table
//! of their offsets and lengths, and a footer. The digest covers the whole
//! payload, as in the reference form. [`encode_out_of_band`] builds one,
//! [`Envelope::pickle`] and [`Envelope::buffers`] read one.
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

/// The envelope format version of the reference form: header and
/// serializer payload, nothing else (`specs/formats.md` §1).
pub const VERSION: u8 = 1;

/// The envelope format version of the out-of-band form: the serializer's
/// pickle stream, then the large buffers it refers to, each at an aligned
/// offset, then their table and a footer (`specs/formats.md` §1.1). 129
/// rather than 2: versions 128 to 255 are the ones callreg keeps for forms
/// of its own, so no version the reference form may define later (nor its
/// vectors, which use 2 as an unsupported version) can mean another layout.
pub const VERSION_OUT_OF_BAND: u8 = 129;

/// Every out-of-band buffer starts at an offset from the envelope's first
/// byte that is a multiple of this many bytes (a page), so that a target
/// maps it where it is (`specs/formats.md` §1.1).
pub const BUFFER_ALIGN: u64 = 4096;

/// Length in bytes of the out-of-band form's footer: `u64 pickle_size`,
/// `u64 buffer_count` (`specs/formats.md` §1.1).
pub const FOOTER_LEN: usize = 16;

/// Length in bytes of one entry of the out-of-band buffer table:
/// `u64 offset`, `u64 length` (`specs/formats.md` §1.1).
pub const TABLE_ENTRY_LEN: usize = 16;

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
    /// The version byte is neither [`VERSION`] nor [`VERSION_OUT_OF_BAND`]
    /// (check 3).
    #[error("ENVELOPE_INVALID: unsupported version {found} (supported: 1, and 129 for out-of-band buffers)")]
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
    /// An out-of-band envelope whose payload is shorter than its
    /// [`FOOTER_LEN`]-byte footer (check 7, `specs/formats.md` §1.1).
    #[error("ENVELOPE_INVALID: out-of-band footer truncated: {payload_size} payload bytes, the footer needs 16")]
    FooterTruncated {
        /// The declared payload size in bytes.
        payload_size: u64,
    },
    /// An out-of-band envelope whose pickle and buffer table, as its footer
    /// declares them, do not fit before the footer (check 8).
    #[error("ENVELOPE_INVALID: out-of-band table truncated: a pickle of {pickle_size} bytes and a table of {buffer_count} buffers do not fit in {payload_size} payload bytes")]
    TableTruncated {
        /// The footer's pickle size in bytes.
        pickle_size: u64,
        /// The footer's buffer count.
        buffer_count: u64,
        /// The declared payload size in bytes.
        payload_size: u64,
    },
    /// An out-of-band buffer that does not start at a multiple of
    /// [`BUFFER_ALIGN`] after the pickle and the buffer before it, or does
    /// not end before the table (check 9; offsets count from the
    /// envelope's first byte).
    #[error("ENVELOPE_INVALID: out-of-band buffer {index} misplaced: offset {offset}, {length} bytes (a buffer starts at a multiple of 4096 after the pickle and the buffer before it, and ends before the table at {table_offset})")]
    BufferMisplaced {
        /// The buffer's index in the table, from 0.
        index: u64,
        /// Its offset from the envelope's first byte.
        offset: u64,
        /// Its length in bytes.
        length: u64,
        /// Where the table starts, from the envelope's first byte.
        table_offset: u64,
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
            EnvelopeError::FooterTruncated { .. } => "FooterTruncated",
            EnvelopeError::TableTruncated { .. } => "TableTruncated",
            EnvelopeError::BufferMisplaced { .. } => "BufferMisplaced",
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
    /// The pickle stream's length: the whole payload in the reference form.
    pickle_len: usize,
    /// The out-of-band buffer table's bytes (empty in the reference form).
    table: &'a [u8],
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

/// Checks 7 to 9 (`specs/formats.md` §1.1) of an out-of-band payload;
/// returns the pickle's length and the table's bytes.
fn out_of_band_layout(payload: &[u8]) -> Result<(usize, &[u8]), EnvelopeError> {
    let payload_size = payload.len() as u64;
    let Some(before_footer) = payload.len().checked_sub(FOOTER_LEN) else {
        return Err(EnvelopeError::FooterTruncated { payload_size });
    };
    let pickle_size = u64_at(payload, before_footer);
    let buffer_count = u64_at(payload, before_footer + 8);
    let truncated = EnvelopeError::TableTruncated {
        pickle_size,
        buffer_count,
        payload_size,
    };
    // pickle_size + buffer_count * 16 <= before_footer, without overflow.
    let table_len = buffer_count
        .checked_mul(TABLE_ENTRY_LEN as u64)
        .ok_or(truncated)?;
    let room = (before_footer as u64)
        .checked_sub(table_len)
        .ok_or(truncated)?;
    if pickle_size > room {
        return Err(truncated);
    }
    // Both fit in usize: they are at most the payload's length.
    let table_start = before_footer - table_len as usize;
    let table = &payload[table_start..before_footer];
    let table_offset = (HEADER_LEN + table_start) as u64;
    let mut free_from = HEADER_LEN as u64 + pickle_size;
    for index in 0..buffer_count {
        let at = index as usize * TABLE_ENTRY_LEN;
        let (offset, length) = (u64_at(table, at), u64_at(table, at + 8));
        let end = offset.checked_add(length);
        if offset % BUFFER_ALIGN != 0 || offset < free_from || end.is_none_or(|e| e > table_offset)
        {
            return Err(EnvelopeError::BufferMisplaced {
                index,
                offset,
                length,
                table_offset,
            });
        }
        free_from = offset + length;
    }
    Ok((pickle_size as usize, table))
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
        if version != VERSION && version != VERSION_OUT_OF_BAND {
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
        let (pickle_len, table) = if version == VERSION_OUT_OF_BAND {
            out_of_band_layout(payload)?
        } else {
            (payload.len(), &payload[..0])
        };
        Ok(Envelope {
            version,
            serializer,
            flags,
            payload,
            staged_size: staged.len(),
            pickle_len,
            table,
        })
    }

    /// The serializer's pickle stream: the whole payload in the reference
    /// form, its first `pickle_size` bytes in the out-of-band form.
    pub fn pickle(&self) -> &'a [u8] {
        &self.payload[..self.pickle_len]
    }

    /// True for the out-of-band form ([`VERSION_OUT_OF_BAND`]).
    pub fn is_out_of_band(&self) -> bool {
        self.version == VERSION_OUT_OF_BAND
    }

    /// The out-of-band buffers, in table order (the order the pickle
    /// refers to them): none in the reference form.
    pub fn buffers(&self) -> Buffers<'a> {
        Buffers {
            payload: self.payload,
            table: self.table,
        }
    }

    /// The format version byte ([`VERSION`] or [`VERSION_OUT_OF_BAND`]).
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

/// The out-of-band buffers of an envelope ([`Envelope::buffers`]): each
/// item is the buffer's offset from the envelope's first byte (a multiple
/// of [`BUFFER_ALIGN`]) and its bytes, borrowed from the staged bytes.
#[derive(Debug, Clone)]
pub struct Buffers<'a> {
    payload: &'a [u8],
    table: &'a [u8],
}

impl<'a> Iterator for Buffers<'a> {
    type Item = (u64, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let (entry, rest) = self.table.split_first_chunk::<TABLE_ENTRY_LEN>()?;
        self.table = rest;
        let (offset, length) = (u64_at(entry, 0), u64_at(entry, 8));
        // Checked by `Envelope::parse`: offset >= 16 and the buffer ends
        // inside the payload.
        let start = offset as usize - HEADER_LEN;
        Some((offset, &self.payload[start..start + length as usize]))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.table.len() / TABLE_ENTRY_LEN;
        (n, Some(n))
    }
}

impl ExactSizeIterator for Buffers<'_> {}

/// The offsets from an envelope's first byte at which the out-of-band
/// form places buffers of `lengths` bytes after a pickle of `pickle_size`
/// bytes (each at the first multiple of [`BUFFER_ALIGN`] after what
/// precedes it), and the offset of the table that follows the last one
/// (`specs/formats.md` §1.1).
///
/// ```
/// use callreg::envelope::out_of_band_offsets;
///
/// assert_eq!(out_of_band_offsets(100, &[5000, 10]), (vec![4096, 12288], 12298));
/// assert_eq!(out_of_band_offsets(100, &[]), (vec![], 116));
/// ```
pub fn out_of_band_offsets(pickle_size: u64, lengths: &[u64]) -> (Vec<u64>, u64) {
    let mut at = HEADER_LEN as u64 + pickle_size;
    let offsets = lengths
        .iter()
        .map(|length| {
            let offset = at.next_multiple_of(BUFFER_ALIGN);
            at = offset + length;
            offset
        })
        .collect();
    (offsets, at)
}

/// The buffer table and footer that end an out-of-band envelope whose
/// pickle is `pickle_size` bytes and whose buffers are at `placed`
/// (`(offset, length)` pairs, from [`out_of_band_offsets`]).
pub fn out_of_band_tail(pickle_size: u64, placed: &[(u64, u64)]) -> Vec<u8> {
    let mut tail = Vec::with_capacity(placed.len() * TABLE_ENTRY_LEN + FOOTER_LEN);
    for (offset, length) in placed {
        tail.extend_from_slice(&offset.to_le_bytes());
        tail.extend_from_slice(&length.to_le_bytes());
    }
    tail.extend_from_slice(&pickle_size.to_le_bytes());
    tail.extend_from_slice(&(placed.len() as u64).to_le_bytes());
    tail
}

/// The 16-byte header of an envelope of format `version` ([`VERSION`] or
/// [`VERSION_OUT_OF_BAND`]) with a cloudpickle payload of `payload_size`
/// bytes (`specs/formats.md` §1, §1.1).
pub fn header_of(version: u8, payload_size: u64) -> [u8; HEADER_LEN] {
    let mut h = header(payload_size);
    h[4] = version;
    h
}

/// Encodes `pickle` and the out-of-band `buffers` it refers to (in the
/// order it refers to them) as an envelope of the out-of-band form
/// (`specs/formats.md` §1.1): the header, the pickle, each buffer at its
/// aligned offset with zero bytes before it, the table, the footer.
///
/// ```
/// use callreg::envelope::{encode_out_of_band, Envelope, VERSION_OUT_OF_BAND};
///
/// let staged = encode_out_of_band(b"pickle", &[b"first", b"second"]);
/// let envelope = Envelope::parse(&staged).unwrap();
/// assert_eq!(envelope.version(), VERSION_OUT_OF_BAND);
/// assert_eq!(envelope.pickle(), b"pickle");
/// let buffers: Vec<_> = envelope.buffers().collect();
/// assert_eq!(buffers, [(4096, &b"first"[..]), (8192, &b"second"[..])]);
/// ```
pub fn encode_out_of_band(pickle: &[u8], buffers: &[&[u8]]) -> Vec<u8> {
    let lengths: Vec<u64> = buffers.iter().map(|b| b.len() as u64).collect();
    let (offsets, table_offset) = out_of_band_offsets(pickle.len() as u64, &lengths);
    let placed: Vec<(u64, u64)> = offsets.iter().copied().zip(lengths).collect();
    let tail = out_of_band_tail(pickle.len() as u64, &placed);
    let total = table_offset as usize + tail.len();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&header_of(VERSION_OUT_OF_BAND, (total - HEADER_LEN) as u64));
    out.extend_from_slice(pickle);
    for (buffer, offset) in buffers.iter().zip(offsets) {
        out.resize(offset as usize, 0);
        out.extend_from_slice(buffer);
    }
    out.extend_from_slice(&tail);
    out
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

    /// An out-of-band envelope with its footer's and table's u64s patched.
    fn patched(pickle: &[u8], buffers: &[&[u8]], patch: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut b = encode_out_of_band(pickle, buffers);
        patch(&mut b);
        b
    }

    fn put(b: &mut [u8], at: usize, value: u64) {
        b[at..at + 8].copy_from_slice(&value.to_le_bytes());
    }

    #[test]
    fn out_of_band_form_round_trips_and_checks_its_layout() {
        let staged = encode_out_of_band(b"\x80\x05N.", &[&[7u8; 5000], b"", b"xy"]);
        // header, pickle, zeros to 4096, 5000 bytes, zeros to 12288, the
        // empty buffer, the 2-byte one at 12288, 3 entries, the footer.
        assert_eq!(staged.len(), 12288 + 2 + 3 * 16 + 16);
        assert_eq!(&staged[..8], b"SPYC\x81\x01\0\0");
        let env = Envelope::parse(&staged).unwrap();
        assert!(env.is_out_of_band());
        assert_eq!(env.pickle(), b"\x80\x05N.");
        assert_eq!(env.payload().len(), staged.len() - 16);
        let buffers: Vec<(u64, Vec<u8>)> = env.buffers().map(|(o, b)| (o, b.to_vec())).collect();
        assert_eq!(
            buffers,
            vec![
                (4096, vec![7u8; 5000]),
                (12288, vec![]),
                (12288, b"xy".to_vec())
            ]
        );
        assert_eq!(env.buffers().len(), 3);
        // The reference form has no buffers and its pickle is its payload.
        let plain = encode(b"abc");
        let env = Envelope::parse(&plain).unwrap();
        assert!(!env.is_out_of_band());
        assert_eq!((env.pickle(), env.buffers().len()), (&b"abc"[..], 0));

        let end = staged.len();
        // 7: no room for the footer.
        let mut short = header_of(VERSION_OUT_OF_BAND, 15).to_vec();
        short.extend_from_slice(&[0u8; 15]);
        assert_eq!(
            Envelope::parse(&short),
            Err(EnvelopeError::FooterTruncated { payload_size: 15 })
        );
        // 8: a pickle, or a buffer count, the payload cannot hold.
        let payload_size = (end - 16) as u64;
        for (pickle_size, buffer_count) in [(payload_size, 3), (4, 1 << 60), (4, u64::MAX)] {
            let b = patched(b"\x80\x05N.", &[&[7u8; 5000], b"", b"xy"], |b| {
                put(b, end - 16, pickle_size);
                put(b, end - 8, buffer_count);
            });
            assert_eq!(
                Envelope::parse(&b),
                Err(EnvelopeError::TableTruncated {
                    pickle_size,
                    buffer_count,
                    payload_size
                }),
                "{pickle_size} {buffer_count}"
            );
        }
        // 9: misaligned, overlapping the pickle or the previous buffer,
        // running into the table, overflowing.
        let table = end - 16 - 3 * 16;
        for (index, offset, length) in [
            (0u64, 4097u64, 5000u64),
            (0, 0, 4),
            (1, 8192, 0),
            (2, 12288, 3),
            (2, 12288, u64::MAX),
        ] {
            let b = patched(b"\x80\x05N.", &[&[7u8; 5000], b"", b"xy"], |b| {
                put(b, table + index as usize * 16, offset);
                put(b, table + index as usize * 16 + 8, length);
            });
            assert_eq!(
                Envelope::parse(&b),
                Err(EnvelopeError::BufferMisplaced {
                    index,
                    offset,
                    length,
                    table_offset: table as u64
                }),
                "{index} {offset} {length}"
            );
        }
        // A pickle that runs into the first buffer.
        let b = patched(b"\x80\x05N.", &[&[7u8; 5000]], |b| {
            let at = b.len() - 16;
            put(b, at, 4081)
        });
        assert_eq!(
            Envelope::parse(&b).unwrap_err().variant_name(),
            "BufferMisplaced"
        );
        // The digest covers every payload byte, padding included.
        let mut b = staged.clone();
        b[200] = 1;
        let (one, other) = (
            Envelope::parse(&staged).unwrap(),
            Envelope::parse(&b).unwrap(),
        );
        assert_ne!(
            crate::descriptor::python_serialized_digest(&one),
            crate::descriptor::python_serialized_digest(&other)
        );
        assert_eq!(
            crate::descriptor::PythonSerialized::from_envelope(&one).payload_format_version,
            129
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
