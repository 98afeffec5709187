//! A minimal pip requirement matcher, used by a target only when the
//! `packaging` module is not installed there (with `packaging`, the target
//! uses `packaging.requirements.Requirement` and its specifier set).
//!
//! Supported (a subset of PEP 508 and PEP 440):
//!
//! * requirement: `name[extra,...] SPECIFIERS`, where `name` is
//!   `[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?`, extras are accepted but
//!   their own dependencies are not verified, and `SPECIFIERS` is a
//!   comma-separated list, optionally in parentheses;
//! * operators `==`, `!=`, `>=`, `<=`, `>`, `<`, `~=`; `==` and `!=` accept
//!   a trailing `.*` (prefix match on the release numbers);
//! * versions `[N!]N(.N)*[{a|b|rc}N][.postN][.devN][+local]`, compared as
//!   PEP 440 orders them (dev < pre < final < post; local labels ignored).
//!
//! Not supported (rejected with [`RequirementError`], never guessed):
//! environment markers (`; python_version < "3.12"`), direct references
//! (`name @ url`), the `===` operator. The exclusive-ordering refinements
//! of PEP 440 (`>1.0` excluding `1.0.post1`) are not applied: `>` and `<`
//! compare whole versions.

use std::cmp::Ordering;
use std::fmt;

/// A parsed requirement: a distribution name and the specifiers its
/// installed version must all satisfy.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Requirement {
    /// The distribution name as written (lookup is the installer's job).
    pub name: String,
    /// The specifiers, all of which must hold; empty = any version.
    pub specifiers: Vec<Specifier>,
}

/// One version specifier, e.g. `>=2.1`.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Specifier {
    /// The comparison.
    pub operator: Operator,
    /// The version text after the operator, without a `.*` suffix.
    pub version: String,
    /// `==X.*` / `!=X.*`: compare release-number prefixes.
    pub wildcard: bool,
}

/// A specifier's operator (PEP 440 "version specifiers").
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Operator {
    /// `==`
    Equal,
    /// `!=`
    NotEqual,
    /// `>=`
    GreaterEqual,
    /// `<=`
    LessEqual,
    /// `>`
    Greater,
    /// `<`
    Less,
    /// `~=` (compatible release)
    Compatible,
}

impl Operator {
    fn as_str(self) -> &'static str {
        match self {
            Operator::Equal => "==",
            Operator::NotEqual => "!=",
            Operator::GreaterEqual => ">=",
            Operator::LessEqual => "<=",
            Operator::Greater => ">",
            Operator::Less => "<",
            Operator::Compatible => "~=",
        }
    }
}

impl fmt::Display for Specifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let star = if self.wildcard { ".*" } else { "" };
        write!(f, "{}{}{star}", self.operator.as_str(), self.version)
    }
}

/// Why a requirement or version text is outside the supported subset.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[error("requirement {text:?}: {reason}")]
pub struct RequirementError {
    /// The whole requirement (or version) text.
    pub text: String,
    /// What is wrong or unsupported.
    pub reason: String,
}

/// A PEP 440 version reduced to what ordering needs.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Version {
    epoch: u64,
    release: Vec<u64>,
    /// `(0|1|2, n)` for a, b, rc.
    pre: Option<(u8, u64)>,
    post: Option<u64>,
    dev: Option<u64>,
}

fn take_number(text: &str) -> Option<(u64, &str)> {
    let end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let number = text[..end].parse().ok()?;
    Some((number, &text[end..]))
}

/// Strips one optional separator (`.`, `-`, `_`) then `word`.
fn strip_tag<'a>(text: &'a str, words: &[&str]) -> Option<(usize, &'a str)> {
    let body = text.strip_prefix(['.', '-', '_']).unwrap_or(text);
    words
        .iter()
        .enumerate()
        .find_map(|(i, word)| body.strip_prefix(word).map(|rest| (i, rest)))
}

impl Version {
    /// Parses `[N!]N(.N)*[{a|b|rc}N][.postN][.devN][+local]` (case-insensitive,
    /// an optional leading `v`; `alpha`, `beta`, `c`, `pre` spell a, b, rc, rc).
    ///
    /// # Errors
    /// [`RequirementError`] naming the text when it is not of that form.
    pub fn parse(text: &str) -> Result<Version, RequirementError> {
        let bad = || RequirementError {
            text: text.to_owned(),
            reason: "not a version this check understands".to_owned(),
        };
        let lower = text.trim().to_ascii_lowercase();
        let mut rest = lower.strip_prefix('v').unwrap_or(&lower);
        // Local labels never change the order of a requirement check.
        if let Some(plus) = rest.find('+') {
            rest = &rest[..plus];
        }
        let mut epoch = 0;
        if let Some(bang) = rest.find('!') {
            epoch = rest[..bang].parse().map_err(|_| bad())?;
            rest = &rest[bang + 1..];
        }
        let mut release = Vec::new();
        loop {
            let (number, after) = take_number(rest).ok_or_else(bad)?;
            release.push(number);
            rest = after;
            match rest.strip_prefix('.') {
                Some(after) if after.starts_with(|c: char| c.is_ascii_digit()) => rest = after,
                _ => break,
            }
        }
        let mut version = Version {
            epoch,
            release,
            pre: None,
            post: None,
            dev: None,
        };
        const PRE: [&str; 7] = ["alpha", "beta", "rc", "pre", "a", "b", "c"];
        if let Some((i, after)) = strip_tag(rest, &PRE) {
            let kind = match PRE[i] {
                "alpha" | "a" => 0,
                "beta" | "b" => 1,
                _ => 2,
            };
            let after = after.strip_prefix(['.', '-', '_']).unwrap_or(after);
            let (n, after) = take_number(after).unwrap_or((0, after));
            version.pre = Some((kind, n));
            rest = after;
        }
        if let Some((_, after)) = strip_tag(rest, &["post"]) {
            let after = after.strip_prefix(['.', '-', '_']).unwrap_or(after);
            let (n, after) = take_number(after).unwrap_or((0, after));
            version.post = Some(n);
            rest = after;
        }
        if let Some((_, after)) = strip_tag(rest, &["dev"]) {
            let after = after.strip_prefix(['.', '-', '_']).unwrap_or(after);
            let (n, after) = take_number(after).unwrap_or((0, after));
            version.dev = Some(n);
            rest = after;
        }
        if rest.is_empty() {
            Ok(version)
        } else {
            Err(bad())
        }
    }

    /// The release numbers, e.g. `[2, 1, 0]` for `2.1.0`.
    pub fn release(&self) -> &[u64] {
        &self.release
    }

    /// PEP 440 sort key of the suffixes: `(pre, post, dev)` with sentinels
    /// so that `1.0.dev0 < 1.0a1 < 1.0 < 1.0.post1`.
    fn suffix_key(&self) -> (i128, i128, i128, i128) {
        let (pre_kind, pre_n) = match (self.pre, self.post, self.dev) {
            (Some((kind, n)), _, _) => (i128::from(kind), i128::from(n)),
            // A bare dev release sorts before every pre-release.
            (None, None, Some(_)) => (-1, 0),
            (None, _, _) => (3, 0),
        };
        let post = self.post.map_or(-1, i128::from);
        let dev = self.dev.map_or(i128::MAX, i128::from);
        (pre_kind, pre_n, post, dev)
    }
}

impl Ord for Version {
    fn cmp(&self, other: &Self) -> Ordering {
        let width = self.release.len().max(other.release.len());
        let padded = |v: &Version| -> Vec<u64> {
            let mut r = v.release.clone();
            r.resize(width, 0);
            r
        };
        self.epoch
            .cmp(&other.epoch)
            .then_with(|| padded(self).cmp(&padded(other)))
            .then_with(|| self.suffix_key().cmp(&other.suffix_key()))
    }
}

impl PartialOrd for Version {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// True when `release` starts with `prefix`, padding `release` with zeros.
fn release_has_prefix(release: &[u64], prefix: &[u64]) -> bool {
    prefix
        .iter()
        .enumerate()
        .all(|(i, p)| release.get(i).copied().unwrap_or(0) == *p)
}

impl Specifier {
    /// Whether `installed` satisfies this specifier.
    ///
    /// # Errors
    /// [`RequirementError`] when the specifier's version does not parse.
    pub fn contains(&self, installed: &Version) -> Result<bool, RequirementError> {
        let wanted = Version::parse(&self.version)?;
        Ok(match self.operator {
            Operator::Equal if self.wildcard => {
                release_has_prefix(&installed.release, &wanted.release)
            }
            Operator::NotEqual if self.wildcard => {
                !release_has_prefix(&installed.release, &wanted.release)
            }
            Operator::Equal => installed == &wanted || installed.cmp(&wanted) == Ordering::Equal,
            Operator::NotEqual => installed.cmp(&wanted) != Ordering::Equal,
            Operator::GreaterEqual => installed >= &wanted,
            Operator::LessEqual => installed <= &wanted,
            Operator::Greater => installed > &wanted,
            Operator::Less => installed < &wanted,
            Operator::Compatible => {
                let prefix = &wanted.release[..wanted.release.len() - 1];
                installed >= &wanted && release_has_prefix(&installed.release, prefix)
            }
        })
    }
}

/// True for a character of a distribution name after the first.
fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

impl Requirement {
    /// Parses a requirement in the subset described in the module docs.
    ///
    /// # Errors
    /// [`RequirementError`] naming the text and the reason: no name; an
    /// environment marker (`;`) or direct reference (`@`), which need the
    /// `packaging` module; an unclosed extras list; an unknown operator or
    /// `===`; a specifier without a version; `.*` on another operator than
    /// `==`/`!=`; `~=` with a single release number; a version that does not
    /// parse.
    pub fn parse(text: &str) -> Result<Requirement, RequirementError> {
        let fail = |reason: &str| RequirementError {
            text: text.to_owned(),
            reason: reason.to_owned(),
        };
        if text.contains(';') {
            return Err(fail(
                "environment markers need the `packaging` module, which is not installed",
            ));
        }
        if text.contains('@') {
            return Err(fail(
                "direct references (name @ url) need the `packaging` module, which is not installed",
            ));
        }
        let trimmed = text.trim();
        let name_end = trimmed
            .find(|c: char| !name_char(c))
            .unwrap_or(trimmed.len());
        let name = &trimmed[..name_end];
        let valid_name = name.starts_with(|c: char| c.is_ascii_alphanumeric())
            && name.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !valid_name {
            return Err(fail("does not start with a distribution name"));
        }
        let mut rest = trimmed[name_end..].trim_start();
        if let Some(after) = rest.strip_prefix('[') {
            let close = after
                .find(']')
                .ok_or_else(|| fail("extras list has no closing ']'"))?;
            rest = after[close + 1..].trim_start();
        }
        let rest = match rest.strip_prefix('(') {
            Some(inner) => inner
                .trim_end()
                .strip_suffix(')')
                .ok_or_else(|| fail("specifier list has no closing ')'"))?,
            None => rest,
        };
        let mut specifiers = Vec::new();
        if !rest.trim().is_empty() {
            for part in rest.split(',') {
                specifiers.push(Self::parse_specifier(text, part.trim())?);
            }
        }
        Ok(Requirement {
            name: name.to_owned(),
            specifiers,
        })
    }

    fn parse_specifier(text: &str, part: &str) -> Result<Specifier, RequirementError> {
        let fail = |reason: String| RequirementError {
            text: text.to_owned(),
            reason,
        };
        if part.starts_with("===") {
            return Err(fail(
                "the === operator needs the `packaging` module, which is not installed".to_owned(),
            ));
        }
        const OPERATORS: [(&str, Operator); 7] = [
            ("==", Operator::Equal),
            ("!=", Operator::NotEqual),
            (">=", Operator::GreaterEqual),
            ("<=", Operator::LessEqual),
            ("~=", Operator::Compatible),
            (">", Operator::Greater),
            ("<", Operator::Less),
        ];
        let (operator, version) = OPERATORS
            .iter()
            .find_map(|(token, op)| part.strip_prefix(token).map(|v| (*op, v.trim())))
            .ok_or_else(|| {
                fail(format!(
                    "{part:?} does not start with one of == != >= <= ~= > <"
                ))
            })?;
        if version.is_empty() {
            return Err(fail(format!("{part:?} has no version")));
        }
        let (version, wildcard) = match version.strip_suffix(".*") {
            Some(prefix) => (prefix, true),
            None => (version, false),
        };
        if wildcard && !matches!(operator, Operator::Equal | Operator::NotEqual) {
            return Err(fail(format!("{part:?}: .* is only allowed with == and !=")));
        }
        let parsed = Version::parse(version)?;
        if operator == Operator::Compatible && parsed.release.len() < 2 {
            return Err(fail(format!(
                "{part:?}: ~= needs at least two release numbers"
            )));
        }
        Ok(Specifier {
            operator,
            version: version.to_owned(),
            wildcard,
        })
    }

    /// The specifiers `installed` (a version text) fails, in order; empty
    /// when it satisfies the requirement.
    ///
    /// # Errors
    /// [`RequirementError`] when `installed` does not parse as a version.
    pub fn unmet(&self, installed: &str) -> Result<Vec<&Specifier>, RequirementError> {
        let installed = Version::parse(installed)?;
        let mut failed = Vec::new();
        for specifier in &self.specifiers {
            if !specifier.contains(&installed)? {
                failed.push(specifier);
            }
        }
        Ok(failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holds(requirement: &str, installed: &str) -> bool {
        Requirement::parse(requirement)
            .unwrap()
            .unmet(installed)
            .unwrap()
            .is_empty()
    }

    #[test]
    fn each_operator() {
        assert!(holds("cloudpickle>=2", "2.1.0"));
        assert!(!holds("cloudpickle>=3", "2.1.0"));
        assert!(holds("x==2.1", "2.1.0"));
        assert!(!holds("x==2.1", "2.1.1"));
        assert!(holds("x!=2.1", "2.1.1"));
        assert!(!holds("x!=2.1.0", "2.1"));
        assert!(holds("x<=2.1", "2.1"));
        assert!(!holds("x<=2.1", "2.1.1"));
        assert!(holds("x>2", "2.0.1"));
        assert!(!holds("x>2", "2.0"));
        assert!(holds("x<3", "2.9"));
        assert!(!holds("x<3", "3.0"));
        assert!(holds("x~=2.1", "2.9"));
        assert!(!holds("x~=2.1", "3.0"));
        assert!(!holds("x~=2.1.3", "2.2.0"));
        assert!(holds("x~=2.1.3", "2.1.9"));
        assert!(holds("x==2.*", "2.7.1"));
        assert!(!holds("x==2.*", "3.0"));
        assert!(holds("x!=2.*", "3.0"));
        assert!(holds("x >= 1.0, < 2 ", "1.5"));
        assert!(!holds("x>=1.0,<2", "2.0"));
        assert!(holds("x (>=1.0)", "1.0"));
        assert!(holds("x[extra]>=1", "1.0"));
        assert!(holds("x", "0.0.1"));
    }

    #[test]
    fn pep440_order_of_suffixes() {
        let order = [
            "1.0.dev0",
            "1.0a1",
            "1.0a2.dev1",
            "1.0a2",
            "1.0b1",
            "1.0rc1",
            "1.0",
            "1.0.post1",
            "1.1",
        ];
        for pair in order.windows(2) {
            let (low, high) = (
                Version::parse(pair[0]).unwrap(),
                Version::parse(pair[1]).unwrap(),
            );
            assert_eq!(low.cmp(&high), Ordering::Less, "{} < {}", pair[0], pair[1]);
        }
        assert_eq!(
            Version::parse("1!0.1")
                .unwrap()
                .cmp(&Version::parse("2.0").unwrap()),
            Ordering::Greater
        );
        assert_eq!(Version::parse("2.1.0+local").unwrap().release(), &[2, 1, 0]);
    }

    #[test]
    fn unmet_lists_failing_specifiers() {
        let requirement = Requirement::parse("cloudpickle>=2,<2.1,!=2.0.5").unwrap();
        let unmet: Vec<String> = requirement
            .unmet("2.1.0")
            .unwrap()
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(unmet, vec!["<2.1".to_owned()]);
        assert_eq!(requirement.name, "cloudpickle");
    }

    #[test]
    fn unsupported_forms_are_errors() {
        let reason = |text: &str| Requirement::parse(text).unwrap_err().reason;
        assert_eq!(
            reason("x; python_version<'3'"),
            "environment markers need the `packaging` module, which is not installed"
        );
        assert_eq!(
            reason("x @ https://example.org/x.whl"),
            "direct references (name @ url) need the `packaging` module, which is not installed"
        );
        assert_eq!(reason(">=1"), "does not start with a distribution name");
        assert_eq!(
            reason("x===1"),
            "the === operator needs the `packaging` module, which is not installed"
        );
        assert_eq!(
            reason("x=>1"),
            "\"=>1\" does not start with one of == != >= <= ~= > <"
        );
        assert_eq!(
            reason("x>=1.*"),
            "\">=1.*\": .* is only allowed with == and !="
        );
        assert_eq!(
            reason("x~=1"),
            "\"~=1\": ~= needs at least two release numbers"
        );
        assert_eq!(reason("x>="), "\">=\" has no version");
        assert_eq!(reason("x[a>=1"), "extras list has no closing ']'");
        assert_eq!(
            Requirement::parse("x>=1.0banana").unwrap_err(),
            RequirementError {
                text: "1.0banana".into(),
                reason: "not a version this check understands".into()
            }
        );
    }
}
