//! The model with a startup-snapshot entry that fails to install on some
//! targets (`specs/model.md` §2.4): every property holds, with crashes,
//! corruptions, deadlines and tasks, fencing on and off, and the state
//! counts are pinned (a change in the state space is noticed).
//!
//! Runs single-threaded so that the counts are reproducible.

use callreg_model::model::{ModelConfig, RegistrationModel};
use callreg_model::run::{check, Outcome, SearchOptions};
use callreg_model::script::Script;

fn run(config: ModelConfig) -> Outcome {
    let model = RegistrationModel::new(config).unwrap();
    let options = SearchOptions {
        symmetry: false,
        threads: 1,
        ..SearchOptions::default()
    };
    check(model, &options)
}

/// `snapshot-then-operations` (snapshot: A and B, refcount 1 each) on
/// `targets` targets, with the standard faults or none, and the first
/// snapshot digest failing on `failing`.
fn config(targets: u16, faults: bool, fence: bool, failing: &[u16]) -> ModelConfig {
    let script = Script::named("snapshot-then-operations").unwrap();
    let base = if faults {
        ModelConfig {
            script,
            ..ModelConfig::standard()
        }
    } else {
        ModelConfig::fault_free(targets, script)
    };
    ModelConfig {
        targets,
        fence_on_timeout: fence,
        snapshot_failures: failing.to_vec(),
        ..base
    }
}

#[test]
fn a_snapshot_entry_failing_on_some_targets_keeps_every_invariant() {
    let expected = [
        (2, false, true, &[1][..], 41),
        (2, true, true, &[1][..], 16581),
        (2, true, true, &[0, 1][..], 12923),
        (2, true, false, &[1][..], 62507),
    ];
    let mut counted = Vec::new();
    for (targets, faults, fence, failing, _) in expected {
        let case =
            format!("{targets} targets, faults {faults}, fence {fence}, failing {failing:?}");
        let outcome = run(config(targets, faults, fence, failing));
        assert!(outcome.complete, "{case}: incomplete");
        assert!(
            outcome.violations.is_empty(),
            "{case}: {:#?}",
            outcome.violations
        );
        counted.push((targets, faults, fence, failing, outcome.unique_states));
    }
    // Every count at once.
    assert_eq!(counted, expected);
}

#[test]
fn snapshot_failures_need_a_snapshot_and_real_targets() {
    let no_snapshot = ModelConfig {
        snapshot_failures: vec![0],
        ..ModelConfig::fault_free(2, Script::named("single-register").unwrap())
    };
    assert_eq!(
        RegistrationModel::new(no_snapshot).unwrap_err().0,
        "snapshot failures need a startup snapshot"
    );
    assert_eq!(
        RegistrationModel::new(config(2, false, true, &[2]))
            .unwrap_err()
            .0,
        "snapshot failure on target 2, which does not exist"
    );
}
