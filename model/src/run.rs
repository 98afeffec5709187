//! Running the checker and reporting its result (`callreg-model check`).

use std::time::{Duration, Instant};

use serde::Serialize;
use std::collections::BTreeSet;

use stateright::{Checker, Expectation, HasDiscoveries, Model};

use crate::model::{Action, RegistrationModel, State};
use crate::properties;

/// How to search.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SearchOptions {
    /// Merge states that differ only by a renumbering of targets (depth
    /// first: stateright applies symmetry in that checker only).
    pub symmetry: bool,
    /// Depth first instead of breadth first (breadth first finds the
    /// shortest counterexample when single-threaded).
    pub dfs: bool,
    /// Worker threads.
    pub threads: usize,
    /// Stop exploring below this depth (the run is then incomplete).
    pub max_depth: Option<usize>,
    /// Print progress to stderr every this often.
    pub progress_every: Option<Duration>,
    /// Stop at the first broken `always` or `eventually` property (the run
    /// is then incomplete unless nothing broke).
    pub stop_at_first_violation: bool,
}

impl Default for SearchOptions {
    fn default() -> SearchOptions {
        SearchOptions {
            symmetry: false,
            dfs: false,
            threads: 1,
            max_depth: None,
            progress_every: None,
            stop_at_first_violation: false,
        }
    }
}

/// A property that failed, with the path that shows it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Violation {
    /// The property's name (as in `specs/model.md`).
    pub property: String,
    /// The steps from the initial state, one line each, then why the last
    /// state breaks the property, then a summary of that state.
    pub trace: Vec<String>,
}

/// What a check found. Serializes to the `--json` line of
/// `callreg-model check`.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    /// Whether every reachable state was explored.
    pub complete: bool,
    /// Distinct states explored (after symmetry reduction, if on).
    pub unique_states: usize,
    /// States generated, counting revisits.
    pub states: usize,
    /// The longest path explored (actions from the initial state, plus 1).
    pub max_depth: usize,
    /// Wall-clock seconds.
    pub secs: f64,
    /// Broken `always` and `eventually` properties.
    pub violations: Vec<Violation>,
    /// `sometimes` properties witnessed.
    pub witnessed: Vec<String>,
    /// `sometimes` properties never witnessed in this configuration.
    pub not_witnessed: Vec<String>,
    /// `sometimes` properties this configuration must witness
    /// ([`crate::configs`]) that it did not: the verdict fails, since a
    /// check that never reaches a path cannot catch a bug on it. Empty for
    /// an incomplete run (which is reported as such).
    pub missing_witnesses: Vec<String>,
}

impl Outcome {
    /// Unique states per second.
    pub fn states_per_sec(&self) -> f64 {
        if self.secs > 0.0 {
            self.unique_states as f64 / self.secs
        } else {
            0.0
        }
    }

    /// Whether the run is complete, no property failed and every expected
    /// witness was found.
    pub fn passed(&self) -> bool {
        self.complete && self.violations.is_empty() && self.missing_witnesses.is_empty()
    }
}

/// The readable trace of a path ending in a state that breaks `property`.
pub fn trace(
    model: &RegistrationModel,
    property: &str,
    path: &[(State, Option<Action>)],
) -> Vec<String> {
    let mut lines = Vec::new();
    for (state, action) in path {
        if let Some(action) = action {
            lines.push(model.describe(state, action));
        }
    }
    if let Some((last, _)) = path.last() {
        if let Some(why) = properties::explain(model, property, last) {
            lines.push(format!("=> {why}"));
        }
        lines.extend(model.summarize(last).lines().map(|l| format!("   {l}")));
    }
    lines
}

/// A shortest path to a state breaking `property`, given that `found` is
/// one: breadth-first searches on one thread, bounded in depth, bisecting
/// on the bound. (Stateright keeps the last path found for a property,
/// which in a full run is often far from the shortest.)
fn short_counterexample(
    model: &RegistrationModel,
    property: &'static str,
    found: Vec<(State, Option<Action>)>,
) -> Vec<(State, Option<Action>)> {
    let within = |depth: usize| {
        model
            .clone()
            .checker()
            .target_max_depth(depth)
            .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
            .spawn_bfs()
            .join()
            .discovery(property)
            .map(|p| p.into_vec())
    };
    // A path of n states ends at depth n; states at the bound are not
    // checked, so bound n + 1 finds it.
    let (mut low, mut high) = (1, found.len() + 1);
    let mut best = found;
    while low + 1 < high {
        let middle = (low + high) / 2;
        match within(middle) {
            Some(path) => {
                high = middle.min(path.len() + 1);
                best = path;
            }
            None => low = middle,
        }
    }
    best
}

fn collect<C: Checker<RegistrationModel>>(
    checker: &C,
    started: Instant,
    options: &SearchOptions,
    expected: &[&str],
) -> Outcome {
    let model = checker.model();
    let props = model.properties();
    let discoveries = checker.discoveries();
    let depth = checker.max_depth();
    let unique_states = checker.unique_state_count();
    let states = checker.state_count();
    let secs = started.elapsed().as_secs_f64();
    let mut violations = Vec::new();
    let mut witnessed = Vec::new();
    let mut not_witnessed = Vec::new();
    for property in &props {
        let found = discoveries.get(property.name);
        match (&property.expectation, found) {
            (Expectation::Sometimes, Some(_)) => witnessed.push(property.name.to_owned()),
            (Expectation::Sometimes, None) => not_witnessed.push(property.name.to_owned()),
            (_, Some(path)) => {
                let path = short_counterexample(model, property.name, path.clone().into_vec());
                violations.push(Violation {
                    property: property.name.to_owned(),
                    trace: trace(model, property.name, &path),
                })
            }
            (_, None) => {}
        }
    }
    // Stateright stops early only when the finish condition holds (every
    // property has a discovery, or the first violation when asked), or at
    // the depth bound.
    let stopped_early = discoveries.len() == props.len()
        || (options.stop_at_first_violation && !violations.is_empty());
    let truncated = options.max_depth.is_some_and(|m| depth >= m);
    let complete = !stopped_early && !truncated;
    let missing_witnesses = if complete {
        expected
            .iter()
            .filter(|name| !witnessed.iter().any(|w| w == *name))
            .map(|name| (*name).to_owned())
            .collect()
    } else {
        Vec::new()
    };
    Outcome {
        complete,
        missing_witnesses,
        unique_states,
        states,
        max_depth: depth,
        secs,
        violations,
        witnessed,
        not_witnessed,
    }
}

fn wait<C: Checker<RegistrationModel>>(
    mut checker: C,
    started: Instant,
    options: &SearchOptions,
    expected: &[&str],
) -> Outcome {
    if let Some(every) = options.progress_every {
        let mut next = every;
        while !checker.is_done() {
            std::thread::sleep(Duration::from_millis(50));
            let elapsed = started.elapsed();
            if elapsed >= next && !checker.is_done() {
                next += every;
                let secs = elapsed.as_secs_f64();
                eprintln!(
                    "progress: {} unique states, {} states, depth {}, {:.0} s, {:.0} unique states/s",
                    checker.unique_state_count(),
                    checker.state_count(),
                    checker.max_depth(),
                    secs,
                    checker.unique_state_count() as f64 / secs
                );
            }
        }
    }
    checker = checker.join();
    collect(&checker, started, options, expected)
}

/// Checks every property of `model` exhaustively (or to `max_depth`); the
/// `sometimes` properties its configuration must witness are those of
/// [`crate::configs::derived_expectations`].
pub fn check(model: RegistrationModel, options: &SearchOptions) -> Outcome {
    let expected = crate::configs::derived_expectations(&model.config);
    check_expecting(model, options, &expected)
}

/// Checks the named configuration `named` (its own search mode, threads
/// from `options`) with its expected witnesses.
///
/// # Errors
/// A [`crate::model::ConfigError`] if the configuration cannot be modelled.
pub fn check_named(
    named: &crate::configs::Named,
    options: &SearchOptions,
) -> Result<Outcome, crate::model::ConfigError> {
    let model = RegistrationModel::new(named.config.clone())?;
    let options = SearchOptions {
        symmetry: named.symmetry || options.symmetry,
        ..*options
    };
    Ok(check_expecting(model, &options, &named.expectations()))
}

/// As [`check`], with `expected` as the `sometimes` properties that must be
/// witnessed.
pub fn check_expecting(
    model: RegistrationModel,
    options: &SearchOptions,
    expected: &[&str],
) -> Outcome {
    let started = Instant::now();
    let mut builder = model.checker().threads(options.threads.max(1));
    if let Some(depth) = options.max_depth {
        builder = builder.target_max_depth(depth);
    }
    if options.symmetry {
        builder = builder.symmetry();
    }
    if options.stop_at_first_violation {
        builder = builder.finish_when(HasDiscoveries::AnyFailures);
    }
    if options.dfs || options.symmetry {
        wait(builder.spawn_dfs(), started, options, expected)
    } else {
        wait(builder.spawn_bfs(), started, options, expected)
    }
}
