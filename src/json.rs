//! Strict JSON decoding shared by every plain-data type with a JSON form
//! (DESIGN.md §6): descriptors, callable metadata, and what the protocol
//! layer adds.
//!
//! A decoding failure names the field where it happened as a path, e.g.
//! `deps.pip.packages[0]` (from `serde_path_to_error`), so that a user can
//! find the mistake in a large document.

use serde::de::DeserializeOwned;

/// Why a JSON text could not be decoded into a value: where and what.
///
/// `path` is the dotted path of the offending field (`call_before[1].hashid`),
/// or `.` for the document itself; `message` is the reason (serde's text, or
/// a validation rule's), e.g. ``unknown field `colour`, expected ...``.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[error("at {path}: {message}")]
pub struct JsonError {
    /// Path of the offending field; `.` for the whole document.
    pub path: String,
    /// What is wrong there.
    pub message: String,
}

impl JsonError {
    /// An error at `path` (a dotted path, `.` for the document).
    pub fn at(path: impl Into<String>, message: impl Into<String>) -> Self {
        JsonError {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Decodes `text` as `T`, naming the offending field's path on failure.
///
/// Unknown fields and wrong types are rejected by `T`'s serde derive
/// (`deny_unknown_fields` and typed fields); this only adds the path.
///
/// # Errors
/// [`JsonError`] with the path of the first offending field and serde's
/// message without its trailing "at line L column C" (the path says where).
pub fn from_str<T: DeserializeOwned>(text: &str) -> Result<T, JsonError> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let value: T = serde_path_to_error::deserialize(&mut deserializer).map_err(|err| {
        let path = err.path().to_string();
        JsonError::at(path, strip_position(&err.into_inner().to_string()))
    })?;
    // Trailing characters after the value are an error, as in
    // `serde_json::from_str`.
    deserializer
        .end()
        .map_err(|err| JsonError::at(".", strip_position(&err.to_string())))?;
    Ok(value)
}

/// serde_json's message without its " at line L column C" suffix.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) if message[i..].contains(" column ") => message[..i].to_owned(),
        _ => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        packages: Vec<u32>,
    }

    #[derive(Debug, PartialEq, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Outer {
        pip: Inner,
    }

    #[test]
    fn errors_name_the_field_path() {
        assert_eq!(
            from_str::<Outer>(r#"{"pip": {"packages": [1, "x"]}}"#),
            Err(JsonError::at(
                "pip.packages[1]",
                "invalid type: string \"x\", expected u32"
            ))
        );
        let unknown = from_str::<Outer>(r#"{"pip": {"packages": [], "extra": 1}}"#).unwrap_err();
        assert_eq!(unknown.path, "pip.extra");
        assert_eq!(
            unknown.message,
            "unknown field `extra`, expected `packages`"
        );
        assert_eq!(
            from_str::<Outer>(r#"{"pip": {"packages": []}} x"#),
            Err(JsonError::at(".", "trailing characters"))
        );
        assert_eq!(
            from_str::<Outer>(r#"{"pip": {"packages": [7]}}"#),
            Ok(Outer {
                pip: Inner { packages: vec![7] }
            })
        );
    }
}
