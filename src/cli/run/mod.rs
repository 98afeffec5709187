//! `callreg run PLAN.json [--json]`: runs a plan of registrations and tasks
//! against a real Worker with Python targets (the plan
//! format is in [`super::plan`]).
//!
//! This process is the parent: it forks the targets, stages envelopes and
//! sends frames, and never initialises Python or deserializes a payload
//! (specs/design.md §1, §6); it checks that before start and after close.
//!
//! Output: one line per step on stdout, then a summary. Text lines read
//! `step 3 call add [target 0]: ok -> 5 (74 µs)`; with `--json`, each line
//! is an object `{"step", "op", "name", "ok", "hashid", "targets":
//! [{"target", "outcome", "replacement"?}], "target_events"?, "result" | "error",
//! "micros"}` (`"result"` only when the step produced a value, i.e. a call;
//! `"error"` only on error; `"target_events"`: the Worker's target events during the
//! step, when there were any) and
//! the summary is `{"summary": {"steps", "ok", "failed", "micros"}}`, counting
//! the plan's steps only; a plan without a `start` step gets an implicit
//! start first (`"step": null`), reported in the summary as
//! `"implicit_start_ok"` (text: `; implicit start ok` or `FAILED`). Exit status: 0 when
//! every step met its expectation, 1 when a step failed unexpectedly or an
//! expectation was not met, 2 for a usage or plan error (one line on
//! stderr). Targets write what a callable prints to stderr, never among the
//! step lines.
//!
//! Replaced targets (`specs/protocol.md` §2.9, `specs/plan.md` §1): each
//! step from the start on ends only once no target is being replaced
//! (each serves or was given up), so later steps see the same targets on
//! every run; a text line shows what became of a lost target (`[target 0
//! killed (it was killed by signal 9); replaced by incarnation 1]`) and the
//! step's target events (`[target 0: incarnation 1 joined]`; a replacement's
//! start, whose pid differs on every run, only with `--json`). After a
//! start that fails, no later step runs (each fails with `not run: the
//! Worker did not start`) unless every target serves once its
//! replacements settled.
//!
//! Without the `python` cargo feature the subcommand exists but only
//! explains that the build lacks Python support (exit status 2).
//!
//! Layout: this file holds the arguments; with Python support, `execute`
//! runs the plan (the step loop, the Worker, replaced targets settling),
//! `steps` carries out each step's operation, and `report` turns what a
//! step did into its text or `--json` line and checks its expectation.

#[cfg(not(feature = "python"))]
use super::CliError;

/// Arguments of `callreg run`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
The plan format (ops, fields, metadata, expectations, output): specs/plan.md
in the callreg repository; examples/plan.json is a complete plan.

Exit status:
  0  every step met its expectation
  1  a step failed unexpectedly or an expectation was not met (a missing or a
     malformed envelope, a second unregister, a kill of a target given up)
  2  usage or plan error: the plan cannot be read, is not valid JSON, or a
     step has an unknown, missing or wrong field (with --json also a
     {\"plan_error\": ...} line on stdout)")]
pub struct Args {
    /// The plan (JSON); envelope paths in it are relative to its directory.
    #[arg(value_name = "PLAN.json")]
    plan: String,
    /// Print one JSON object per step and for the summary.
    #[arg(long)]
    json: bool,
}

/// Explains that this build cannot run plans.
///
/// # Errors
/// Always a [`CliError`]: plans need Python targets.
#[cfg(not(feature = "python"))]
pub fn run(args: &Args) -> Result<u8, CliError> {
    let _ = args.json;
    Err(CliError(format!(
        "cannot run {}: this build of callreg has no Python support (rebuild with `--features cli,python`)",
        args.plan
    )))
}

#[cfg(feature = "python")]
mod execute;
#[cfg(feature = "python")]
mod report;
#[cfg(feature = "python")]
mod steps;

#[cfg(feature = "python")]
pub use execute::run;
