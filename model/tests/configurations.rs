//! The named configuration set (`callreg-model check --all`,
//! `specs/model.md` §7): every configuration passes — complete, no
//! property broken, every witness it must produce found — and has its
//! pinned state count.
//!
//! `verdicts` is the model's oracle in mutation testing
//! (`scripts/mutants --model-only`): it asserts the checker's verdict only,
//! never a state count, so a mutant it catches is caught by a property or
//! a missing witness. `pinned_state_counts` notices any change of the
//! state space. Both run in release only (`cargo test --release -p
//! callreg-model --test configurations`, a step of `.ci/run`): a debug
//! build explores the set about twenty times slower, minutes per test.

use callreg_model::configs;
use callreg_model::run::{check_named, SearchOptions};

fn options() -> SearchOptions {
    SearchOptions {
        threads: 1,
        ..SearchOptions::default()
    }
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "release only: cargo test --release -p callreg-model --test configurations"
)]
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
#[cfg_attr(
    debug_assertions,
    ignore = "release only: cargo test --release -p callreg-model --test configurations"
)]
fn pinned_state_counts() {
    // (name, unique states, max depth): single-threaded, so that the
    // symmetric (depth-first) counts are reproducible.
    let expected = [
        ("forged", 6_522, 18),
        ("refused-unregister", 369, 23),
        ("staging", 2_686, 18),
        ("close", 50_419, 30),
        ("two-deserializations", 14_966, 25),
        ("pre-start", 241_722, 26),
        ("snapshot-failure", 16_581, 21),
        ("poison", 1_912, 33),
        ("poison-departures", 1_957, 33),
        ("poison-nested", 1_876, 36),
        ("heartbeat-no-fence", 32_628, 18),
        ("heartbeat", 31_184, 19),
        ("respawn", 187_828, 34),
        ("respawn-no-fence", 206_964, 34),
        ("respawn-spawn-failure", 86_297, 28),
        ("respawn-stale-replies", 90_534, 31),
        ("respawn-arrivals", 27_542, 29),
        ("tasks-cancel", 559, 20),
        ("tasks-deadline", 2_239, 26),
        ("retire", 172_546, 37),
        ("handover", 192_196, 32),
        ("standard", 182_024, 39),
        ("no-probe", 179_785, 39),
        ("no-fence", 1_769_816, 42),
    ];
    let names: Vec<&str> = configs::all().iter().map(|n| n.name).collect();
    assert_eq!(
        names,
        expected.iter().map(|(n, _, _)| *n).collect::<Vec<_>>()
    );
    let mut counted = Vec::new();
    for (name, _, _) in expected {
        let named = configs::named(name).unwrap();
        let outcome = check_named(&named, &options()).unwrap();
        assert!(outcome.passed(), "{name}: {:#?}", outcome.violations);
        counted.push((name, outcome.unique_states, outcome.max_depth));
        let mut witnessed: Vec<&str> = outcome.witnessed.iter().map(String::as_str).collect();
        witnessed.sort();
        let mut expectations = named.expectations();
        expectations.sort();
        // Each configuration lists every witness it reaches.
        assert_eq!(witnessed, expectations, "{name}");
    }
    // Every count at once, so that a change of the state space shows all
    // the counts it moved.
    assert_eq!(counted, expected);
}
