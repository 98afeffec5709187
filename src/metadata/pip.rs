//! A pip requirement matcher, used by a target only when the `packaging`
//! module is not installed there (with `packaging`, the target uses
//! `packaging.requirements.Requirement` and its specifier set).
//!
//! Versions and specifiers are PEP 440's, as [`pep440_rs`] implements
//! them, so that a check agrees with pip:
//!
//! * the ordering (dev < pre < final < post, epochs, local labels);
//! * operators `==`, `!=`, `>=`, `<=`, `>`, `<`, `~=`, `===`, and
//!   `==X.*` / `!=X.*` prefix matches;
//! * the exclusive orderings (`>1.0` excludes `1.0.post1`, `<2.0` excludes
//!   `2.0a1`).
//!
//! One known difference from pip (`packaging`): `<V` where `V` is itself a
//! pre-release excludes the earlier pre-releases of `V`'s release too
//! (`<2.0a2` refuses `2.0a1`, which pip accepts).
//!
//! The requirement around them is a subset of PEP 508:
//! `name[extra,...] SPECIFIERS`, where `name` is
//! `[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?`, extras are accepted but
//! their own dependencies are not verified, and `SPECIFIERS` is a
//! comma-separated list, optionally in parentheses. Environment markers
//! (`; python_version < "3.12"`) and direct references (`name @ url`) are
//! refused with [`RequirementError`], never guessed: they need the
//! target's environment, which `packaging` reads.

use std::str::FromStr;

pub use pep440_rs::{Version, VersionSpecifier, VersionSpecifiers};

/// A parsed requirement: a distribution name and the specifiers its
/// installed version must all satisfy.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Requirement {
    /// The distribution name as written (lookup is the installer's job).
    pub name: String,
    /// The specifiers, all of which must hold; empty = any version.
    pub specifiers: VersionSpecifiers,
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

fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

impl Requirement {
    /// Parses a requirement of the supported subset.
    ///
    /// # Errors
    /// [`RequirementError`] naming the text and the reason: no name; an
    /// environment marker (`;`) or direct reference (`@`), which need the
    /// `packaging` module; an unclosed extras or specifier list; a
    /// specifier list PEP 440 refuses (its parser's message: an unknown
    /// operator, a missing version, `.*` on an ordering operator, `~=`
    /// with a single release number, a version that does not parse).
    pub fn parse(text: &str) -> Result<Requirement, RequirementError> {
        let fail = |reason: String| RequirementError {
            text: text.to_owned(),
            reason,
        };
        if text.contains(';') {
            return Err(fail(
                "environment markers need the `packaging` module, which is not installed"
                    .to_owned(),
            ));
        }
        if text.contains('@') {
            return Err(fail(
                "direct references (name @ url) need the `packaging` module, which is not installed"
                    .to_owned(),
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
            return Err(fail("does not start with a distribution name".to_owned()));
        }
        let mut rest = trimmed[name_end..].trim_start();
        if let Some(after) = rest.strip_prefix('[') {
            let close = after
                .find(']')
                .ok_or_else(|| fail("extras list has no closing ']'".to_owned()))?;
            rest = after[close + 1..].trim_start();
        }
        let rest = match rest.strip_prefix('(') {
            Some(inner) => inner
                .trim_end()
                .strip_suffix(')')
                .ok_or_else(|| fail("specifier list has no closing ')'".to_owned()))?,
            None => rest,
        };
        let specifiers =
            VersionSpecifiers::from_str(rest.trim()).map_err(|e| fail(e.to_string()))?;
        Ok(Requirement {
            name: name.to_owned(),
            specifiers,
        })
    }

    /// The specifiers `installed` (a version text) fails, in order; empty
    /// when it satisfies the requirement.
    ///
    /// # Errors
    /// [`RequirementError`] naming `installed` when it does not parse as a
    /// PEP 440 version (the parser's message).
    pub fn unmet(&self, installed: &str) -> Result<Vec<&VersionSpecifier>, RequirementError> {
        let version = Version::from_str(installed).map_err(|e| RequirementError {
            text: installed.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(self
            .specifiers
            .iter()
            .filter(|specifier| !specifier.contains(&version))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cmp::Ordering;

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
        assert!(holds("x===1.0+abc", "1.0+abc"));
        assert!(!holds("x===1.0", "1.0.0"));
    }

    /// Where pip differs from comparing whole versions: the exclusive
    /// orderings and local labels.
    #[test]
    fn exclusive_orderings_and_local_labels_agree_with_pip() {
        assert!(!holds("x>1.0", "1.0.post1"));
        assert!(holds("x>1.0.post1", "1.0.post2"));
        assert!(!holds("x<2.0", "2.0a1"));
        assert!(holds("x<2.0", "1.9a1"));
        assert!(holds("x==2.1", "2.1+local"));
        assert!(holds("x<=2.1", "2.1+local"));
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
                Version::from_str(pair[0]).unwrap(),
                Version::from_str(pair[1]).unwrap(),
            );
            assert_eq!(low.cmp(&high), Ordering::Less, "{} < {}", pair[0], pair[1]);
        }
        assert_eq!(
            Version::from_str("1!0.1")
                .unwrap()
                .cmp(&Version::from_str("2.0").unwrap()),
            Ordering::Greater
        );
        assert_eq!(
            Version::from_str("2.1.0+local").unwrap().release(),
            &[2, 1, 0]
        );
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
        assert_eq!(reason("x[a>=1"), "extras list has no closing ']'");
        assert_eq!(reason("x (>=1"), "specifier list has no closing ')'");
        for bad in ["x=>1", "x>=1.*", "x~=1", "x>=", "x>=1.0banana"] {
            let error = Requirement::parse(bad).unwrap_err();
            assert_eq!(error.text, bad);
            assert!(!error.reason.is_empty(), "{bad}");
        }
        let error = Requirement::parse("x>=1")
            .unwrap()
            .unmet("banana")
            .unwrap_err();
        assert_eq!(error.text, "banana");
    }
}
