//! Running a plan: reading it, the Worker it runs against, the step
//! loop (pre-start registers reported with the start), the wait for
//! replaced targets to settle after each step, and the summary.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use callreg::error::ErrorCode;
use callreg::io::Worker;
use callreg::protocol::{Handle, TargetId, TargetOutcome, TargetPhase, DEFAULT_RESPAWN_BACKOFF};
use callreg::runtime::python::PythonRuntime;
use serde_json::{json, Value};

use super::super::plan::{self, Op, Plan, Step};
use super::super::{write_stdout, CliError, EXIT_INVALID, EXIT_OK};
use super::report::{
    duration_text, json_line, micros, ok_target, one_line, op_name, replacement, target_report,
    text_line, unmet, unmet_error, PlanErrorFields, PlanErrorLine, StepReport, TargetReport,
};
use super::Args;

/// How often a step checks whether the replacements of lost targets
/// joined or were given up.
const SETTLE_POLL: Duration = Duration::from_millis(1);

/// The error of every step after a failed start.
const NOT_RUN: &str = "not run: the Worker did not start";

/// Runs the plan named by `args`; returns the exit status.
///
/// # Errors
/// [`CliError`] (exit status 2) when the plan cannot be read or parsed
/// (naming the step and field), when the Worker cannot be built, or if
/// Python turns out to be initialised in this (parent) process.
pub fn run(args: &Args) -> Result<u8, CliError> {
    // With --json, a plan that cannot be run is also a JSON line on
    // stdout (`{"plan_error": {"plan", "step", "field", "message"}}`);
    // the line on stderr and the exit status are as without --json.
    let plan_error = |message: String, step: Option<usize>, field: Option<&str>| {
        if args.json {
            let line = PlanErrorLine {
                plan_error: PlanErrorFields {
                    plan: &args.plan,
                    step,
                    field,
                    message: &message,
                },
            };
            write_stdout(&format!(
                "{}\n",
                serde_json::to_string(&line).unwrap_or_default()
            ))?;
        }
        Err(CliError(message))
    };
    let text = match super::super::input::read_limited(&args.plan)
        .map_err(|why| CliError::read_because(super::super::shown(&args.plan), &why))
    {
        Ok(text) => text,
        Err(CliError(message)) => return plan_error(message, None, None),
    };
    let Ok(text) = String::from_utf8(text) else {
        return plan_error(format!("{}: the plan is not UTF-8", args.plan), None, None);
    };
    let plan_dir = match Path::new(&args.plan).parent() {
        Some(dir) if !dir.as_os_str().is_empty() && args.plan != "-" => dir,
        _ => Path::new("."),
    };
    let plan = match plan::parse(&text, plan_dir) {
        Ok(plan) => plan,
        Err(e) => return plan_error(format!("{}: {e}", args.plan), e.step, e.field.as_deref()),
    };
    parent_has_no_python("before start")?;
    let mut runner = Runner::new(&plan, args.json)?;
    let total = Instant::now();
    // The implicit start is reported on its own line and in the
    // summary, but it is not one of the plan's steps.
    let mut implicit_start_ok = None;
    if !plan.steps.iter().any(|s| s.op == Op::Start) {
        let report = runner.start(None, None);
        implicit_start_ok = Some(runner.emit(report)?);
    }
    let mut reports = Vec::with_capacity(plan.steps.len());
    // The steps before the start are printed with it: the start tells
    // whether each pre-start register's callable installed everywhere.
    let mut before_start: Vec<(usize, StepReport)> = Vec::new();
    for (index, step) in plan.steps.iter().enumerate() {
        let report = runner.step(index, step);
        if step.op != Op::Start && !runner.started {
            before_start.push((index, report));
            continue;
        }
        if step.op == Op::Start {
            for (register_index, mut register) in before_start.drain(..) {
                runner.settle_pre_start(&plan.steps[register_index], &mut register);
                reports.push(runner.emit(register)?);
            }
        }
        reports.push(runner.emit(report)?);
    }
    for (_, register) in before_start {
        reports.push(runner.emit(register)?);
    }
    runner.worker.close();
    parent_has_no_python("after close")?;
    let failed = reports.iter().filter(|ok| !**ok).count();
    let micros = micros(total.elapsed());
    let summary = if args.json {
        let mut summary = json!({"steps": reports.len(), "ok": reports.len() - failed, "failed": failed, "micros": micros});
        if let Some(ok) = implicit_start_ok {
            summary["implicit_start_ok"] = Value::Bool(ok);
        }
        json!({ "summary": summary }).to_string()
    } else {
        let implicit = match implicit_start_ok {
            None => "",
            Some(true) => "; implicit start ok",
            Some(false) => "; implicit start FAILED",
        };
        format!(
            "summary: {} {}, {} as expected, {failed} not{implicit} ({})",
            reports.len(),
            if reports.len() == 1 { "step" } else { "steps" },
            reports.len() - failed,
            duration_text(micros)
        )
    };
    write_stdout(&format!("{summary}\n"))?;
    let failed = failed + usize::from(implicit_start_ok == Some(false));
    Ok(if failed == 0 { EXIT_OK } else { EXIT_INVALID })
}

/// Refuses to go on if Python runs in this process: the parent must
/// never run it (a bug, reported as one line rather than a panic).
fn parent_has_no_python(when: &str) -> Result<(), CliError> {
    if PythonRuntime::interpreter_initialized() {
        Err(CliError(format!(
            "internal error: the Python interpreter is initialised in the parent process ({when}); the parent must never run Python"
        )))
    } else {
        Ok(())
    }
}

/// What a label stands for while the plan runs.
pub(super) enum Label {
    /// A live handle.
    Live(Handle),
    /// A handle unregistered by an earlier step (calls on it still go
    /// to the Worker, which refuses the stale handle).
    Unregistered(Handle),
    /// The register failed with this code: no handle.
    Failed(ErrorCode),
}

pub(super) struct Runner<'a> {
    pub(super) plan: &'a Plan,
    pub(super) worker: Worker<PythonRuntime>,
    pub(super) labels: BTreeMap<String, Label>,
    /// Where a `call` without a target runs next (round robin over the
    /// live targets).
    pub(super) next_target: usize,
    pub(super) json: bool,
    /// A start failed and left a target not serving (or the Worker not
    /// started), so no later step runs (a register would otherwise go
    /// silently into the startup snapshot of a Worker that never
    /// started, or run on fewer targets than planned).
    pub(super) start_failed: bool,
    /// A start ran (whatever its outcome).
    pub(super) started: bool,
    /// The startup-snapshot registrations that failed at start, by
    /// handle id: the step's error text and each target's report.
    pub(super) failed_at_start: BTreeMap<u64, (String, Vec<TargetReport>)>,
}

impl<'a> Runner<'a> {
    fn new(plan: &'a Plan, json: bool) -> Result<Runner<'a>, CliError> {
        let worker = Worker::builder(Arc::new(PythonRuntime::new()))
            .targets(plan.targets)
            .control_timeout(plan.control_timeout)
            .respawn_limit(plan.respawn_limit)
            .respawn_backoff(plan.respawn_backoff)
            .probe_first(plan.probe_first)
            .build()
            .map_err(|e| CliError(one_line(&e.to_string())))?;
        Ok(Runner {
            plan,
            worker,
            labels: BTreeMap::new(),
            next_target: 0,
            json,
            start_failed: false,
            started: false,
            failed_at_start: BTreeMap::new(),
        })
    }

    fn step(&mut self, index: usize, step: &Step) -> StepReport {
        if self.start_failed {
            let (op, name) = op_name(&step.op);
            let mut report = self.report(Some(index), op);
            report.name = name.map(str::to_owned);
            report.outcome = Err(NOT_RUN.to_owned());
            report.code = Some(ErrorCode::LIFECYCLE_INVALID);
            report.unmet = unmet_error(None, &report.outcome);
            return report;
        }
        let started = Instant::now();
        let events_before = self.worker.target_events().len();
        let mut report = match &step.op {
            Op::Start => self.start(Some(index), step.expect_error.as_deref()),
            Op::Register(register) => self.register(index, register),
            Op::Unregister { name } => self.unregister(index, name),
            Op::Call(call) => self.call(index, call),
            Op::CallAll(call) => self.call_all(index, call),
            Op::KillTarget { target } => self.kill_target(index, *target),
        };
        // The start settles and collects its target events itself.
        if step.op != Op::Start && self.started {
            self.finish_target_events(&mut report, events_before);
        }
        report.micros = micros(started.elapsed());
        report.unmet = unmet(step, &report.outcome);
        report
    }

    /// The outcomes of an operation that succeeded, sampled after it:
    /// each target live before it is `ok` if it still is, else `lost`
    /// with why (a target can die during a step and the operation
    /// still succeed on the others).
    /// `before`: the live targets with their incarnations, from
    /// [`Runner::live`]; a target replaced during the operation was
    /// lost, even if its replacement serves already.
    pub(super) fn after(&self, before: &[(TargetId, u32)]) -> Vec<TargetReport> {
        let live = self.worker.live_targets();
        before
            .iter()
            .map(|(t, incarnation)| {
                if live.contains(t) && self.worker.target_incarnation(*t) == *incarnation {
                    ok_target(*t)
                } else {
                    TargetReport {
                        target: t.0,
                        outcome: "lost",
                        detail: self.worker.target_loss(*t),
                        result: None,
                        replacement: None,
                    }
                }
            })
            .collect()
    }

    /// The live targets with the incarnation of their process.
    pub(super) fn live(&self) -> Vec<(TargetId, u32)> {
        self.worker
            .live_targets()
            .into_iter()
            .map(|t| (t, self.worker.target_incarnation(t)))
            .collect()
    }

    /// Waits until no target is being replaced: each target serves
    /// (`Joined`) or is lost for good (`Lost`), so that the next step
    /// sees the same targets on every run. Each replacement is bounded
    /// by the Worker (its start and each replay by the control
    /// timeout, `specs/protocol.md` §2.9); this waits for at most the
    /// control timeout plus the back-off of the next replacement in a
    /// row after the last target event.
    ///
    /// # Errors
    /// `DEADLINE_EXCEEDED: …` naming the first target still being replaced.
    pub(super) fn settle(&self) -> Result<(), String> {
        let events_at = |worker: &Worker<PythonRuntime>| worker.target_events().len();
        let mut seen = events_at(&self.worker);
        let mut in_a_row: u32 = 0;
        let bound = |in_a_row: u32| {
            let backoff = Duration::from_micros(DEFAULT_RESPAWN_BACKOFF)
                .saturating_mul(1 << in_a_row.min(16));
            self.plan.control_timeout.saturating_add(backoff)
        };
        let mut deadline = Instant::now() + bound(0);
        loop {
            let busy = (0..self.plan.targets).map(TargetId).find_map(|t| {
                match self.worker.target_phase(t) {
                    TargetPhase::Joined | TargetPhase::Lost => None,
                    phase => Some((t, phase)),
                }
            });
            let Some((target, phase)) = busy else {
                return Ok(());
            };
            let now = events_at(&self.worker);
            if now != seen {
                in_a_row = in_a_row.saturating_add(1);
                seen = now;
                deadline = Instant::now() + bound(in_a_row);
            }
            if Instant::now() >= deadline {
                let phase = match phase {
                    TargetPhase::BackingOff(_) => "backing off",
                    TargetPhase::Spawning => "being started",
                    _ => "joining",
                };
                return Err(format!(
                    "DEADLINE_EXCEEDED: the replacement of {target} is still {phase} after {:?}",
                    bound(in_a_row)
                ));
            }
            std::thread::sleep(SETTLE_POLL);
        }
    }

    /// Waits for the replacements to settle ([`Runner::settle`]), then
    /// puts the target events since `events_before` into the report and
    /// says in each target's part what became of a lost target.
    pub(super) fn finish_target_events(&self, report: &mut StepReport, events_before: usize) {
        if let Err(e) = self.settle() {
            if report.outcome.is_ok() {
                report.outcome = Err(e);
                report.code = Some(ErrorCode::DEADLINE_EXCEEDED);
            }
        }
        let events = self.worker.target_events();
        report.target_events = events.get(events_before..).unwrap_or_default().to_vec();
        for target in &mut report.targets {
            if target.outcome != "ok" && target.replacement.is_none() {
                target.replacement = replacement(&report.target_events, TargetId(target.target));
            }
        }
    }

    /// One target's report for an operation's outcome; a lost or
    /// fenced target's detail says why it was given up and how it
    /// ended.
    pub(super) fn target_report(&self, entry: &(TargetId, TargetOutcome)) -> TargetReport {
        let mut report = target_report(entry);
        if matches!(entry.1, TargetOutcome::Lost | TargetOutcome::Fenced) {
            report.detail = self.worker.target_loss(entry.0).or_else(|| {
                self.worker
                    .target_exit(entry.0)
                    .map(|exit| format!("it {exit}"))
            });
        }
        report
    }

    pub(super) fn report(&self, step: Option<usize>, op: &'static str) -> StepReport {
        StepReport {
            step,
            op,
            name: None,
            hashid: None,
            metadata: None,
            targets: Vec::new(),
            outcome: Ok(None),
            code: None,
            unmet: None,
            target_events: Vec::new(),
            micros: 0,
        }
    }

    /// Prints one step's line; returns whether it met its expectation.
    fn emit(&self, report: StepReport) -> Result<bool, CliError> {
        let ok = report.unmet.is_none();
        let line = if self.json {
            json_line(&report, ok)
        } else {
            text_line(&report, ok)
        };
        write_stdout(&format!("{line}\n"))?;
        Ok(ok)
    }
}
