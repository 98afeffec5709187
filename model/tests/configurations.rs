//! The named configuration set (`callreg-model check --all`,
//! `specs/model.md` §7): every configuration passes — complete, no
//! property broken, every witness it must produce found — and has its
//! pinned state count.
//!
//! `verdicts` is the model's oracle in mutation testing
//! (`scripts/mutants --model-only`): it asserts the checker's verdict only,
//! never a state count, so a mutant it catches is caught by a property or
//! a missing witness. `pinned_state_counts` notices any change of the
//! state space. Run in release (`cargo test --release -p callreg-model
//! --test configurations`): about half a minute on one core.

use callreg_model::configs;
use callreg_model::run::{check_named, SearchOptions};

fn options() -> SearchOptions {
    SearchOptions {
        threads: 1,
        ..SearchOptions::default()
    }
}

#[test]
fn verdicts() {
    let mut failed = Vec::new();
    for named in configs::all() {
        // Stops at the first violation: a mutant is caught sooner.
        let outcome = check_named(
            &named,
            &SearchOptions {
                stop_at_first_violation: true,
                ..options()
            },
        )
        .unwrap();
        if !outcome.passed() {
            failed.push(format!(
                "{}: complete {}, violations {:?}, missing witnesses {:?}",
                named.name,
                outcome.complete,
                outcome
                    .violations
                    .iter()
                    .map(|v| (&v.property, v.trace.last()))
                    .collect::<Vec<_>>(),
                outcome.missing_witnesses
            ));
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

#[test]
fn pinned_state_counts() {
    // (name, unique states, max depth): single-threaded, so that the
    // symmetric (depth-first) counts are reproducible.
    let expected = [
        ("forged", 11_021, 15),
        ("refused-unregister", 351, 23),
        ("staging", 4_322, 18),
        ("close", 13_090, 26),
        ("two-deserializations", 19_961, 20),
        ("pre-start", 85_110, 23),
        ("snapshot-failure", 11_584, 16),
        ("heartbeat-no-fence", 14_581, 16),
        ("heartbeat", 37_547, 19),
        ("standard", 48_846, 36),
        ("no-fence", 190_089, 39),
    ];
    let names: Vec<&str> = configs::all().iter().map(|n| n.name).collect();
    assert_eq!(
        names,
        expected.iter().map(|(n, _, _)| *n).collect::<Vec<_>>()
    );
    for (name, unique, depth) in expected {
        let named = configs::named(name).unwrap();
        let outcome = check_named(&named, &options()).unwrap();
        assert!(outcome.passed(), "{name}: {:#?}", outcome.violations);
        assert_eq!(
            (outcome.unique_states, outcome.max_depth),
            (unique, depth),
            "{name}"
        );
        let mut witnessed: Vec<&str> = outcome.witnessed.iter().map(String::as_str).collect();
        witnessed.sort();
        let mut expectations = named.expectations();
        expectations.sort();
        // Each configuration lists every witness it reaches.
        assert_eq!(witnessed, expectations, "{name}");
    }
}
