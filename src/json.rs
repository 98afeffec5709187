//! Strict JSON decoding shared by every plain-data type with a JSON form
//! (specs/design.md §6): descriptors, callable metadata, and what the protocol
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
    unique_keys(text)?;
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let value: T = serde_path_to_error::deserialize(&mut deserializer).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        // A syntax error (or a text that ends early) is in the document,
        // not in a field (serde_path_to_error would say `?`): name the
        // document and keep serde's line and column, the only locator.
        if inner.is_syntax() || inner.is_eof() {
            JsonError::at(".", inner.to_string())
        } else {
            JsonError::at(path, strip_position(&inner.to_string()))
        }
    })?;
    // Trailing characters after the value are an error, as in
    // `serde_json::from_str`.
    deserializer
        .end()
        .map_err(|err| JsonError::at(".", strip_position(&err.to_string())))?;
    Ok(value)
}

/// Refuses a JSON text in which an object names a key twice (serde_json
/// keeps the last silently, so a plan's `"targets": 2, ..., "targets": 3`
/// would run on 3). A text that is not JSON passes: the decoding that
/// follows reports it.
///
/// # Errors
/// [`JsonError`] at the object's path: ``duplicate key `targets` ``.
pub fn unique_keys(text: &str) -> Result<(), JsonError> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    match serde_path_to_error::deserialize::<_, UniqueKeys>(&mut deserializer) {
        Ok(UniqueKeys) => Ok(()),
        Err(err) => {
            let path = err.path().to_string();
            let inner = err.into_inner();
            if inner.is_syntax() || inner.is_eof() {
                Ok(())
            } else {
                Err(JsonError::at(path, strip_position(&inner.to_string())))
            }
        }
    }
}

/// Any JSON value whose objects name each key once.
struct UniqueKeys;

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(UniqueKeysVisitor)
    }
}

struct UniqueKeysVisitor;

impl<'de> serde::de::Visitor<'de> for UniqueKeysVisitor {
    type Value = UniqueKeys;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }
    fn visit_i64<E>(self, _: i64) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }
    fn visit_u64<E>(self, _: u64) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }
    fn visit_f64<E>(self, _: f64) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }
    fn visit_str<E>(self, _: &str) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }
    fn visit_unit<E>(self) -> Result<UniqueKeys, E> {
        Ok(UniqueKeys)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<UniqueKeys, A::Error> {
        while seq.next_element::<UniqueKeys>()?.is_some() {}
        Ok(UniqueKeys)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<UniqueKeys, A::Error> {
        let mut seen = std::collections::BTreeSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(serde::de::Error::custom(format!("duplicate key `{key}`")));
            }
            map.next_value::<UniqueKeys>()?;
        }
        Ok(UniqueKeys)
    }
}

/// The JSON type of `value` as an English noun phrase (`"an array"`,
/// `"null"`, ...), for error messages.
pub fn value_type(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Decodes `text` as `T` with [`from_str`], but first refuses a document
/// that is not a JSON object: serde's derive also accepts a struct as an
/// array of its fields in order, which no JSON form of this crate documents.
///
/// # Errors
/// [`JsonError`] at `.`: `expected a JSON object, got an array` (or a
/// string, a number, a boolean, null); otherwise as [`from_str`].
pub fn from_object_str<T: DeserializeOwned>(text: &str) -> Result<T, JsonError> {
    if !text.trim_start().starts_with('{') {
        let value = serde_json::from_str::<serde_json::Value>(text)
            .map_err(|e| JsonError::at(".", e.to_string()))?;
        let got = value_type(&value);
        return Err(JsonError::at(
            ".",
            format!("expected a JSON object, got {got}"),
        ));
    }
    from_str(text)
}

/// What a struct's JSON form is, as an error message says it when given
/// another JSON type (`expected an object {"packages": [...]}`).
pub trait Expects {
    /// The expected JSON, after "expected".
    const EXPECTS: &'static str;
}

/// Reads a struct field's value as `T` from a JSON object only:
/// `#[serde(deserialize_with = "crate::json::object")]`. serde's derive
/// also reads a struct from an array of its fields in order, which no
/// JSON form of this crate documents (a list given where an object
/// belongs would otherwise be read field by field).
///
/// # Errors
/// `invalid type: ..., expected` [`Expects::EXPECTS`] for anything but an
/// object; then `T`'s errors.
pub fn object<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de> + Expects,
{
    deserializer.deserialize_map(ObjectVisitor(std::marker::PhantomData))
}

/// [`object`] for an optional field: `null` is `None`.
///
/// # Errors
/// As [`object`].
pub fn optional_object<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de> + Expects,
{
    struct Optional<T>(std::marker::PhantomData<T>);
    impl<'de, T: serde::Deserialize<'de> + Expects> serde::de::Visitor<'de> for Optional<T> {
        type Value = Option<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "null or {}", T::EXPECTS)
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Option<T>, E> {
            Ok(None)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Option<T>, E> {
            Ok(None)
        }
        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Option<T>, D::Error> {
            object(d).map(Some)
        }
    }
    deserializer.deserialize_option(Optional(std::marker::PhantomData))
}

/// [`object`] for each element of a list field.
///
/// # Errors
/// `invalid type: ..., expected a list, each element ...` for anything but
/// a list; then as [`object`] for each element.
pub fn objects<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de> + Expects,
{
    struct Element<T>(std::marker::PhantomData<T>);
    impl<'de, T: serde::Deserialize<'de> + Expects> serde::de::DeserializeSeed<'de> for Element<T> {
        type Value = T;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
            object(d)
        }
    }
    struct List<T>(std::marker::PhantomData<T>);
    impl<'de, T: serde::Deserialize<'de> + Expects> serde::de::Visitor<'de> for List<T> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a list, each element {}", T::EXPECTS)
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut found = Vec::new();
            while let Some(element) = seq.next_element_seed(Element(std::marker::PhantomData))? {
                found.push(element);
            }
            Ok(found)
        }
    }
    deserializer.deserialize_seq(List(std::marker::PhantomData))
}

struct ObjectVisitor<T>(std::marker::PhantomData<T>);

impl<'de, T: serde::Deserialize<'de> + Expects> serde::de::Visitor<'de> for ObjectVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(T::EXPECTS)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
        T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
    }
}

/// serde_json's message without its " at line L column C" suffix.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) if message[i..].contains(" column ") => message[..i].to_owned(),
        _ => message.to_owned(),
    }
}

/// Implements `to_json` (compact), `to_json_pretty` (two-space indent, the
/// golden files' layout) and a strict `from_json` for plain-data types.
///
/// `decode` is [`from_str`] or [`from_object_str`]; `check` is an
/// expression of type `fn(&Self) -> Result<(), JsonError>` run after
/// decoding (a rule between fields that serde cannot express). Used by
/// `crate::metadata` and `crate::protocol::forms`.
macro_rules! json_forms {
    (decode: $decode:path, check: $check:expr; $($ty:ty),* $(,)?) => {$(
        impl $ty {
            /// The JSON form (compact, keys in declaration order).
            pub fn to_json(&self) -> String {
                // Only strings, numbers, lists and maps: cannot fail.
                serde_json::to_string(self).unwrap_or_default()
            }

            /// The JSON form indented by two spaces (the golden files' layout).
            pub fn to_json_pretty(&self) -> String {
                serde_json::to_string_pretty(self).unwrap_or_default()
            }

            /// Parses the JSON form strictly.
            ///
            /// # Errors
            /// [`JsonError`](crate::json::JsonError) naming the field's
            /// path: a document of the wrong shape, an unknown field, a
            /// wrong type, a missing required field, or a rule of the type
            /// (see its documentation) that the value breaks.
            pub fn from_json(text: &str) -> Result<Self, crate::json::JsonError> {
                let value: Self = $decode(text)?;
                let check: fn(&Self) -> Result<(), crate::json::JsonError> = $check;
                check(&value)?;
                Ok(value)
            }
        }
    )*};
}

pub(crate) use json_forms;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_named_twice_in_any_object_is_refused_where_it_is() {
        assert_eq!(
            unique_keys(r#"{"a": [1, {"b": 2}], "c": {"a": 1}}"#),
            Ok(())
        );
        assert_eq!(
            unique_keys(r#"{"a": 1, "a": 2}"#),
            Err(JsonError::at(".", "duplicate key `a`"))
        );
        assert_eq!(
            unique_keys(r#"{"a": [{"b": 1}, {"b": 1, "c": 2, "b": 3}]}"#),
            Err(JsonError::at("a[1]", "duplicate key `b`"))
        );
        // Not JSON: left for the decoding that follows to report.
        assert_eq!(unique_keys("{\"a\": "), Ok(()));
        let error = from_str::<serde_json::Value>(r#"{"deps": {"pip": 1, "pip": 2}}"#).unwrap_err();
        assert_eq!(error, JsonError::at("deps", "duplicate key `pip`"));
    }

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

    #[derive(Debug, PartialEq, serde::Deserialize, serde::Serialize)]
    #[serde(deny_unknown_fields)]
    struct Even {
        n: u32,
    }

    json_forms!(
        decode: from_object_str,
        check: |value| if value.n % 2 == 0 {
            Ok(())
        } else {
            Err(JsonError::at("n", "must be even"))
        };
        Even
    );

    #[test]
    fn json_forms_decode_then_check() {
        assert_eq!(Even::from_json(r#"{"n": 4}"#), Ok(Even { n: 4 }));
        assert_eq!(
            Even::from_json(r#"{"n": 3}"#),
            Err(JsonError::at("n", "must be even"))
        );
        assert_eq!(
            Even::from_json("[4]"),
            Err(JsonError::at(".", "expected a JSON object, got an array"))
        );
        assert_eq!(Even { n: 4 }.to_json(), r#"{"n":4}"#);
        assert_eq!(Even { n: 4 }.to_json_pretty(), "{\n  \"n\": 4\n}");
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
            from_str::<Outer>(r#"{"pip": {"packages": [7"#),
            Err(JsonError::at(
                ".",
                "EOF while parsing a list at line 1 column 23"
            ))
        );
        assert_eq!(
            from_str::<Outer>(r#"{"pip": {"packages": [7}}"#),
            Err(JsonError::at(
                ".",
                "expected `,` or `]` at line 1 column 24"
            ))
        );
        assert_eq!(
            from_object_str::<Outer>("[]"),
            Err(JsonError::at(".", "expected a JSON object, got an array"))
        );
        assert_eq!(
            from_object_str::<Outer>(" 7"),
            Err(JsonError::at(".", "expected a JSON object, got a number"))
        );
        assert_eq!(
            from_object_str::<Outer>("[1"),
            Err(JsonError::at(
                ".",
                "EOF while parsing a list at line 1 column 2"
            ))
        );
        assert_eq!(
            from_str::<Outer>(r#"{"pip": {"packages": [7]}}"#),
            Ok(Outer {
                pip: Inner { packages: vec![7] }
            })
        );
    }
}
