//! Canonical descriptors, digests and hashids (DESIGN.md §3.2).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The text prefix of every hashid (DESIGN.md §3.2).
pub const HASHID_PREFIX: &str = "sha256:";

/// Length of a hashid in characters: `sha256:` (7) + 64 lowercase hex digits.
pub const HASHID_LEN: usize = 7 + 64;

/// A 32-byte SHA-256 digest of a canonical descriptor: the identity of a
/// callable (DESIGN.md §3.2). Its text form is a [`HashId`].
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
/// hex digits (DESIGN.md §3.2). Parsing is strict: no whitespace, no upper
/// case, no other prefix.
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
        for (i, slot) in out.iter_mut().enumerate() {
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
            *slot = v;
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

#[cfg(test)]
mod tests {
    use super::*;

    const KNOWN: &str = "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1";

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
