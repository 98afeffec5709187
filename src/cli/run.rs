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
//! [{"target", "outcome", "replacement"?}], "slots"?, "result" | "error",
//! "micros"}` (`"result"` only when the step produced a value, i.e. a call;
//! `"error"` only on error; `"slots"`: the Worker's slot events during the
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
//! step from the start on ends only once no target slot is being replaced
//! (each serves or was given up), so later steps see the same targets on
//! every run; a text line shows what became of a lost target (`[target 0
//! killed (it was killed by signal 9); replaced by incarnation 1]`) and the
//! step's slot events (`[target 0: incarnation 1 joined]`; a replacement's
//! start, whose pid differs on every run, only with `--json`). After a
//! start that fails, no later step runs (each fails with `not run: the
//! Worker did not start`) unless every target serves once its
//! replacements settled.
//!
//! Without the `python` cargo feature the subcommand exists but only
//! explains that the build lacks Python support (exit status 2).

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
pub use with_python::run;

#[cfg(feature = "python")]
mod with_python {
    use std::collections::BTreeMap;
    use std::path::Path;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use callreg::descriptor::python_serialized_digest;
    use callreg::envelope::Envelope;
    use callreg::error::{Error, ErrorCode};
    use callreg::io::worker::{registration_failure_text, SlotEvent};
    use callreg::io::{OperationError, TaskError, Worker};
    use callreg::protocol::{
        Failure, Handle, SlotPhase, TargetId, TargetOutcome, DEFAULT_RESPAWN_BACKOFF,
    };
    use callreg::runtime::python::PythonRuntime;
    use callreg::runtime::TaskEncoding;
    use serde::Serialize;
    use serde_json::{json, Value};

    use super::super::plan::{self, CallStep, Op, Plan, RegisterStep, Step};
    use super::super::{write_stdout, CliError, EXIT_INVALID, EXIT_OK};
    use super::Args;

    /// How often `kill_target` checks whether the Worker noticed the kill.
    const KILL_POLL: Duration = Duration::from_millis(1);

    /// How often a step checks whether the replacements of lost targets
    /// joined or were given up.
    const SETTLE_POLL: Duration = Duration::from_millis(1);

    /// The error of every step after a failed start.
    const NOT_RUN: &str = "not run: the Worker did not start";

    /// Result text longer than this many characters is cut in text output.
    const RESULT_TEXT_CHARS: usize = 200;

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
    enum Label {
        /// A live handle.
        Live(Handle),
        /// A handle unregistered by an earlier step (calls on it still go
        /// to the Worker, which refuses the stale handle).
        Unregistered(Handle),
        /// The register failed with this code: no handle.
        Failed(ErrorCode),
    }

    /// One target's part in a step.
    #[derive(Clone)]
    struct TargetReport {
        target: u16,
        /// `ok`, `failed`, `lost`, `timed_out`, `fenced`, `rolled_back`,
        /// `cleanup_unconfirmed` or `killed`.
        outcome: &'static str,
        /// Why, for an outcome other than `ok`.
        detail: Option<String>,
        /// The call's result on this target (`call_all`).
        result: Option<Value>,
        /// What became of the slot of a target lost during the step:
        /// `replaced by incarnation N`, or `not replaced`.
        replacement: Option<String>,
    }

    /// What a step did.
    struct StepReport {
        /// The step index; `None` for the implicit start.
        step: Option<usize>,
        op: &'static str,
        name: Option<String>,
        hashid: Option<String>,
        /// A register's metadata source (`inline`, a file, a side-car).
        metadata: Option<String>,
        targets: Vec<TargetReport>,
        outcome: Result<Option<Value>, String>,
        /// The error code of a failed step (`None` when it succeeded).
        code: Option<ErrorCode>,
        /// The step's expectation, when it was not met.
        unmet: Option<String>,
        /// What happened to replaced target slots during the step
        /// (`Worker::slot_events`, `specs/protocol.md` §2.9).
        slots: Vec<SlotEvent>,
        micros: u64,
    }

    struct Runner<'a> {
        plan: &'a Plan,
        worker: Worker<PythonRuntime>,
        labels: BTreeMap<String, Label>,
        /// Where a `call` without a target runs next (round robin over the
        /// live targets).
        next_target: usize,
        json: bool,
        /// A start failed and left a target not serving (or the Worker not
        /// started), so no later step runs (a register would otherwise go
        /// silently into the startup snapshot of a Worker that never
        /// started, or run on fewer targets than planned).
        start_failed: bool,
        /// A start ran (whatever its outcome).
        started: bool,
        /// The startup-snapshot registrations that failed at start, by
        /// handle id: the step's error text and each target's report.
        failed_at_start: BTreeMap<u64, (String, Vec<TargetReport>)>,
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
            let events_before = self.worker.slot_events().len();
            let mut report = match &step.op {
                Op::Start => self.start(Some(index), step.expect_error.as_deref()),
                Op::Register(register) => self.register(index, register),
                Op::Unregister { name } => self.unregister(index, name),
                Op::Call(call) => self.call(index, call),
                Op::CallAll(call) => self.call_all(index, call),
                Op::KillTarget { target } => self.kill_target(index, *target),
            };
            // The start settles and collects its slot events itself.
            if step.op != Op::Start && self.started {
                self.finish_slots(&mut report, events_before);
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
        fn after(&self, before: &[(TargetId, u32)]) -> Vec<TargetReport> {
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
        fn live(&self) -> Vec<(TargetId, u32)> {
            self.worker
                .live_targets()
                .into_iter()
                .map(|t| (t, self.worker.target_incarnation(t)))
                .collect()
        }

        /// Waits until no slot is being replaced: each target serves
        /// (`Joined`) or is lost for good (`Lost`), so that the next step
        /// sees the same targets on every run. Each replacement is bounded
        /// by the Worker (its start and each replay by the control
        /// timeout, `specs/protocol.md` §2.9); this waits for at most the
        /// control timeout plus the back-off of the next replacement in a
        /// row after the last slot event.
        ///
        /// # Errors
        /// `DEADLINE_EXCEEDED: …` naming the first slot still being replaced.
        fn settle(&self) -> Result<(), String> {
            let events_at = |worker: &Worker<PythonRuntime>| worker.slot_events().len();
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
                    match self.worker.slot_phase(t) {
                        SlotPhase::Joined | SlotPhase::Lost => None,
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
                        SlotPhase::BackingOff(_) => "backing off",
                        SlotPhase::Spawning => "being started",
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
        /// puts the slot events since `events_before` into the report and
        /// says in each target's part what became of a lost slot.
        fn finish_slots(&self, report: &mut StepReport, events_before: usize) {
            if let Err(e) = self.settle() {
                if report.outcome.is_ok() {
                    report.outcome = Err(e);
                    report.code = Some(ErrorCode::DEADLINE_EXCEEDED);
                }
            }
            let events = self.worker.slot_events();
            report.slots = events.get(events_before..).unwrap_or_default().to_vec();
            for target in &mut report.targets {
                if target.outcome != "ok" && target.replacement.is_none() {
                    target.replacement = replacement(&report.slots, TargetId(target.target));
                }
            }
        }

        /// One target's report for an operation's outcome; a lost or
        /// fenced target's detail says why it was given up and how it
        /// ended.
        fn target_report(&self, entry: &(TargetId, TargetOutcome)) -> TargetReport {
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

        fn report(&self, step: Option<usize>, op: &'static str) -> StepReport {
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
                slots: Vec::new(),
                micros: 0,
            }
        }

        /// Forks the targets; the implicit start (before a plan's first step
        /// when it has no `start` step) has no index.
        fn start(&mut self, step: Option<usize>, expect_error: Option<&str>) -> StepReport {
            let started = Instant::now();
            let mut report = self.report(step, "start");
            self.started = true;
            let outcomes = match start_with_stdout_on_stderr(&self.worker) {
                Ok(start) => {
                    for registration in &start.failed {
                        let failed: BTreeMap<TargetId, &Failure> =
                            registration.failures.iter().map(|(t, f)| (*t, f)).collect();
                        let targets = start
                            .outcomes
                            .iter()
                            .map(|(target, _)| match failed.get(target) {
                                Some(failure) => TargetReport {
                                    target: target.0,
                                    outcome: "failed",
                                    detail: Some(one_line(&failure.to_string())),
                                    result: None,
                                    replacement: None,
                                },
                                // It installed the callable; the Worker
                                // unregisters it there.
                                None => TargetReport {
                                    target: target.0,
                                    outcome: "rolled_back",
                                    detail: None,
                                    result: None,
                                    replacement: None,
                                },
                            })
                            .collect();
                        let text = format!(
                            "REGISTER_PARTIAL_FAILURE: at start, {}",
                            one_line(&registration_failure_text(registration))
                        );
                        self.failed_at_start
                            .insert(registration.handle.handle_id, (text, targets));
                    }
                    start.outcomes
                }
                Err(e) => {
                    report.outcome = Err(operation_error_text(&e));
                    report.code = Some(e.code());
                    e.outcomes
                }
            };
            report.targets = outcomes.iter().map(|o| self.target_report(o)).collect();
            // A target lost at start is replaced (`specs/protocol.md`
            // §2.9): the step waits until each slot serves or is given up.
            // A failed start stops the plan unless every target serves now.
            let serving = report.outcome.is_ok() || {
                let _ = self.settle();
                self.worker.live_targets().len() == usize::from(self.plan.targets)
            };
            self.finish_slots(&mut report, 0);
            self.start_failed = report.outcome.is_err() && !serving;
            if step.is_none() {
                report.micros = micros(started.elapsed());
                report.unmet = unmet_error(expect_error, &report.outcome);
            }
            report
        }

        /// Marks a pre-start register step whose callable some target could
        /// not install at start: it failed (its label names no handle),
        /// with every target's part; its expectation is checked again.
        fn settle_pre_start(&mut self, step: &Step, report: &mut StepReport) {
            let Some(name) = report.name.clone() else {
                return;
            };
            let Some(Label::Live(handle)) = self.labels.get(&name) else {
                return;
            };
            let Some((text, targets)) = self.failed_at_start.get(&handle.handle_id) else {
                return;
            };
            report.outcome = Err(text.clone());
            report.targets = targets.clone();
            report.code = Some(ErrorCode::REGISTER_PARTIAL_FAILURE);
            report.unmet = unmet(step, &report.outcome);
            self.labels
                .insert(name, Label::Failed(ErrorCode::REGISTER_PARTIAL_FAILURE));
        }

        fn register(&mut self, index: usize, register: &RegisterStep) -> StepReport {
            let mut report = self.report(Some(index), "register");
            report.name = Some(register.name.clone());
            if let Some(reason) = self.plan.unreadable.get(&register.envelope) {
                // As a malformed envelope fails the step, not the plan.
                report.outcome = Err(format!(
                    "IO_FAILED: cannot read {}: {reason} (operation register)",
                    register.envelope
                ));
                report.code = Some(ErrorCode::IO_FAILED);
                self.labels
                    .insert(register.name.clone(), Label::Failed(ErrorCode::IO_FAILED));
                return report;
            }
            let bytes = self
                .plan
                .envelopes
                .get(&register.envelope)
                .map_or(&[][..], Vec::as_slice);
            report.hashid = Envelope::parse(bytes)
                .ok()
                .map(|e| python_serialized_digest(&e).hashid().to_string());
            let live = self.live();
            report.metadata = register.metadata_source.clone();
            match self
                .worker
                .register_with_metadata(bytes, register.metadata.as_deref())
            {
                Ok(handle) => {
                    report.hashid = Some(handle.hashid.to_string());
                    report.targets = self.after(&live);
                    self.labels
                        .insert(register.name.clone(), Label::Live(handle));
                }
                Err(e) => {
                    report.targets = e.outcomes.iter().map(|o| self.target_report(o)).collect();
                    report.outcome = Err(operation_error_text(&e));
                    report.code = Some(e.code());
                    self.labels
                        .insert(register.name.clone(), Label::Failed(e.code()));
                }
            }
            report
        }

        fn unregister(&mut self, index: usize, name: &str) -> StepReport {
            let mut report = self.report(Some(index), "unregister");
            report.name = Some(name.to_owned());
            // An unregistered label's stale handle still goes to the
            // Worker, which refuses it (HANDLE_STALE), as for a call.
            let (handle, prefix) = match self.resolve(name) {
                Ok(resolved) => resolved,
                Err((code, why)) => {
                    report.outcome = Err(why);
                    report.code = Some(code);
                    return report;
                }
            };
            report.hashid = Some(handle.hashid.to_string());
            let live = self.live();
            match self.worker.unregister(&handle) {
                Ok(()) => {
                    report.targets = self.after(&live);
                    self.labels
                        .insert(name.to_owned(), Label::Unregistered(handle));
                }
                Err(e) => {
                    report.targets = e.outcomes.iter().map(|o| self.target_report(o)).collect();
                    let text = operation_error_text(&e);
                    report.outcome = Err(match prefix {
                        Some(prefix) => format!("{prefix}: {text}"),
                        None => text,
                    });
                    report.code = Some(e.code());
                }
            }
            report
        }

        /// The handle of a label, and the error prefix for a label that no
        /// longer names a live handle; for a label whose register failed,
        /// that register's code and the error.
        fn resolve(&self, name: &str) -> Result<(Handle, Option<String>), (ErrorCode, String)> {
            match self.labels.get(name) {
                Some(Label::Live(handle)) => Ok((*handle, None)),
                Some(Label::Unregistered(handle)) => {
                    Ok((*handle, Some(not_registered(name, "it was unregistered"))))
                }
                Some(Label::Failed(code)) => Err((
                    *code,
                    not_registered(name, &format!("its register failed: {code}")),
                )),
                None => Err((
                    ErrorCode::LIFECYCLE_INVALID,
                    not_registered(name, "no step registered it"),
                )),
            }
        }

        /// The report of a `call` or `call_all` step with its name and
        /// hashid filled in, with the handle and the error prefix of its label;
        /// without them the report is finished (the label names no handle).
        fn begin_call(
            &self,
            index: usize,
            op: &'static str,
            call: &CallStep,
        ) -> (StepReport, Option<(Handle, Option<String>)>) {
            let mut report = self.report(Some(index), op);
            report.name = Some(call.name.clone());
            match self.resolve(&call.name) {
                Ok((handle, prefix)) => {
                    report.hashid = Some(handle.hashid.to_string());
                    (report, Some((handle, prefix)))
                }
                Err((code, why)) => {
                    report.outcome = Err(why);
                    report.code = Some(code);
                    (report, None)
                }
            }
        }

        fn call(&mut self, index: usize, call: &CallStep) -> StepReport {
            let (mut report, resolved) = self.begin_call(index, "call", call);
            let Some((handle, prefix)) = resolved else {
                return report;
            };
            let target = match call.target {
                Some(target) => TargetId(target),
                None => {
                    let live = self.worker.live_targets();
                    if live.is_empty() {
                        report.outcome =
                            Err("NO_LIVE_TARGET: no live target to run the call on".to_owned());
                        report.code = Some(ErrorCode::NO_LIVE_TARGET);
                        return report;
                    }
                    let target = live[self.next_target % live.len()];
                    self.next_target = self.next_target.wrapping_add(1);
                    target
                }
            };
            let input = task_input(call);
            let result = self
                .worker
                .submit(&handle, target, TaskEncoding::Json, &input);
            report.code = result.as_ref().err().map(|e| e.error.code);
            let (target_report, outcome) = task_outcome(target, result, prefix.as_deref());
            if outcome.is_err() && report.code.is_none() {
                report.code = Some(ErrorCode::FRAME_INVALID); // a result that is not JSON
            }
            report.targets = vec![target_report];
            report.outcome = outcome;
            report
        }

        fn call_all(&mut self, index: usize, call: &CallStep) -> StepReport {
            let (mut report, resolved) = self.begin_call(index, "call_all", call);
            let Some((handle, prefix)) = resolved else {
                return report;
            };
            let input = task_input(call);
            let results = self
                .worker
                .submit_to_every(&handle, TaskEncoding::Json, &input);
            if results.is_empty() {
                report.outcome =
                    Err("NO_LIVE_TARGET: no live target to run the call on".to_owned());
                report.code = Some(ErrorCode::NO_LIVE_TARGET);
                return report;
            }
            let mut values = Vec::new();
            let mut errors = Vec::new();
            for (target, result) in results {
                // The first failing target's code is the step's.
                let code = result.as_ref().err().map(|e| e.error.code);
                let (mut target_report, outcome) = task_outcome(target, result, prefix.as_deref());
                if outcome.is_err() && report.code.is_none() {
                    report.code = Some(code.unwrap_or(ErrorCode::FRAME_INVALID));
                }
                match outcome {
                    Ok(value) => {
                        target_report.result.clone_from(&value);
                        values.push(value.unwrap_or(Value::Null));
                    }
                    Err(error) => errors.push(format!("target {}: {error}", target.0)),
                }
                report.targets.push(target_report);
            }
            report.outcome = if errors.is_empty() {
                Ok(Some(Value::Array(values)))
            } else {
                Err(errors.join("; "))
            };
            report
        }

        fn kill_target(&mut self, index: usize, target: u16) -> StepReport {
            let mut report = self.report(Some(index), "kill_target");
            let id = TargetId(target);
            let incarnation = self.worker.target_incarnation(id);
            let pid = match self.worker.target_pid(id) {
                Some(pid) if self.worker.live_targets().contains(&id) => pid,
                _ => {
                    report.targets = vec![TargetReport {
                        target,
                        outcome: "lost",
                        detail: self.worker.target_exit(id).map(|exit| format!("it {exit}")),
                        result: None,
                        replacement: None,
                    }];
                    report.outcome = Err(format!(
                        "NO_LIVE_TARGET: target {target} is not live, so it cannot be killed"
                    ));
                    report.code = Some(ErrorCode::NO_LIVE_TARGET);
                    return report;
                }
            };
            let killed = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            if let Err(errno) = killed {
                report.outcome = Err(format!("IO_FAILED: cannot kill target {target}: {errno}"));
                report.code = Some(ErrorCode::IO_FAILED);
                return report;
            }
            // The IO thread notices the closed pipe and reaps the target;
            // the Worker noticed when the process it counts live is no
            // longer this one (a replacement may even have joined already).
            // Then the step waits for the replacement, in `finish_slots`.
            let deadline = Instant::now() + self.plan.control_timeout;
            while self.worker.target_incarnation(id) == incarnation
                && self.worker.live_targets().contains(&id)
            {
                if Instant::now() >= deadline {
                    report.outcome = Err(format!(
                        "DEADLINE_EXCEEDED: target {target} was killed but the Worker still counts it live"
                    ));
                    report.code = Some(ErrorCode::DEADLINE_EXCEEDED);
                    return report;
                }
                std::thread::sleep(KILL_POLL);
            }
            report.targets = vec![TargetReport {
                target,
                outcome: "killed",
                detail: self.worker.target_exit(id).map(|exit| format!("it {exit}")),
                result: None,
                replacement: None,
            }];
            report
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

    /// Starts the Worker with this process's stdout pointing at stderr
    /// while it forks, so the targets inherit stderr as their stdout: what a
    /// callable prints never mixes into the step lines (which `--json`
    /// readers parse). Stdout is restored before returning.
    ///
    /// # Errors
    /// The start's [`OperationError`]; `IO_FAILED` when stdout cannot be
    /// redirected or restored.
    fn start_with_stdout_on_stderr(
        worker: &Worker<PythonRuntime>,
    ) -> Result<callreg::io::StartReport, OperationError> {
        let io_failed = |what: &str, errno: nix::errno::Errno| OperationError {
            error: Error::new(
                callreg::error::ErrorCode::IO_FAILED,
                callreg::error::OperationKind::Start,
                format!("cannot {what} stdout around the fork: {errno}"),
            ),
            outcomes: Vec::new(),
        };
        // Lines written so far must reach the real stdout.
        let _ = std::io::Write::flush(&mut std::io::stdout());
        // Close-on-exec: nothing this process starts may inherit the copy
        // (targets close every descriptor of the parent anyway).
        let saved = nix::fcntl::fcntl(std::io::stdout(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(3))
            .map(|fd| {
                // SAFETY: `F_DUPFD_CLOEXEC` returned a new descriptor that
                // nothing else owns.
                unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) }
            })
            .map_err(|e| io_failed("save", e))?;
        nix::unistd::dup2_stdout(std::io::stderr()).map_err(|e| io_failed("redirect", e))?;
        let started = worker.start();
        nix::unistd::dup2_stdout(&saved).map_err(|e| io_failed("restore", e))?;
        started
    }

    /// The task input of a call: `{"args": [...], "kwargs": {...}}`.
    fn task_input(call: &CallStep) -> Vec<u8> {
        json!({"args": call.args, "kwargs": call.kwargs})
            .to_string()
            .into_bytes()
    }

    /// A target's report and the step outcome for one task's result.
    fn task_outcome(
        target: TargetId,
        result: Result<Vec<u8>, TaskError>,
        prefix: Option<&str>,
    ) -> (TargetReport, Result<Option<Value>, String>) {
        let outcome = match result {
            Ok(bytes) => serde_json::from_slice::<Value>(&bytes)
                .map(Some)
                .map_err(|e| format!("FRAME_INVALID: the task's result is not JSON: {e}")),
            Err(e) => {
                let text = task_error_text(&e);
                Err(match prefix {
                    Some(prefix) => format!("{prefix}: {text}"),
                    None => text,
                })
            }
        };
        let report = TargetReport {
            target: target.0,
            outcome: if outcome.is_ok() { "ok" } else { "failed" },
            detail: outcome.as_ref().err().cloned(),
            result: None,
            replacement: None,
        };
        (report, outcome)
    }

    /// What became of `target`'s slot, from the slot events of a step: the
    /// last join (`replaced by incarnation N`) or abandonment (`not
    /// replaced`; the `Abandoned` event says why) of it, if any.
    fn replacement(events: &[SlotEvent], target: TargetId) -> Option<String> {
        events.iter().rev().find_map(|event| match event {
            SlotEvent::Joined {
                target: t,
                incarnation,
            } if *t == target => Some(format!("replaced by incarnation {incarnation}")),
            SlotEvent::Abandoned {
                target: t,
                failed_joins,
            } if *t == target => Some("not replaced".to_owned()),
            _ => None,
        })
    }

    fn ok_target(target: TargetId) -> TargetReport {
        TargetReport {
            target: target.0,
            outcome: "ok",
            detail: None,
            result: None,
            replacement: None,
        }
    }

    fn target_report((target, outcome): &(TargetId, TargetOutcome)) -> TargetReport {
        let (outcome, detail) = match outcome {
            TargetOutcome::Ok => ("ok", None),
            TargetOutcome::Failed { failure } => ("failed", Some(one_line(&failure.to_string()))),
            TargetOutcome::Lost => ("lost", None),
            TargetOutcome::TimedOut => ("timed_out", None),
            TargetOutcome::Fenced => ("fenced", None),
            TargetOutcome::RolledBack => ("rolled_back", None),
            TargetOutcome::CleanupUnconfirmed { failure } => {
                ("cleanup_unconfirmed", Some(one_line(&failure.to_string())))
            }
        };
        TargetReport {
            target: target.0,
            outcome,
            detail,
            result: None,
            replacement: None,
        }
    }

    /// A step's `op` as the plan spells it, and the label it names.
    fn op_name(op: &Op) -> (&'static str, Option<&str>) {
        match op {
            Op::Start => ("start", None),
            Op::Register(register) => ("register", Some(&register.name)),
            Op::Unregister { name } => ("unregister", Some(name)),
            Op::Call(call) => ("call", Some(&call.name)),
            Op::CallAll(call) => ("call_all", Some(&call.name)),
            Op::KillTarget { .. } => ("kill_target", None),
        }
    }

    fn not_registered(name: &str, why: &str) -> String {
        format!("{name:?} is not registered ({why})")
    }

    /// Whether a step's outcome met its expectation; `Some(why)` if not.
    fn unmet(step: &Step, outcome: &Result<Option<Value>, String>) -> Option<String> {
        let expect = match &step.op {
            Op::Call(call) | Op::CallAll(call) => call.expect.as_ref(),
            _ => None,
        };
        if step.expect_error.is_some() {
            return unmet_error(step.expect_error.as_deref(), outcome);
        }
        match (outcome, expect) {
            (Err(_), _) => Some("the step failed".to_owned()),
            (Ok(_), None) => None,
            (Ok(result), Some(expected)) => {
                let matches = match (&step.op, result) {
                    (Op::CallAll(_), Some(Value::Array(values))) => {
                        values.iter().all(|v| json_equal(v, expected))
                    }
                    (_, Some(value)) => json_equal(value, expected),
                    (_, None) => false,
                };
                (!matches).then(|| format!("expected {expected}"))
            }
        }
    }

    /// Whether an outcome is the expected error (a substring of its line).
    fn unmet_error(
        expect_error: Option<&str>,
        outcome: &Result<Option<Value>, String>,
    ) -> Option<String> {
        match (expect_error, outcome) {
            (None, Ok(_)) => None,
            (None, Err(_)) => Some("the step failed".to_owned()),
            (Some(expected), Ok(_)) => Some(format!(
                "expected an error containing {expected:?}, but the step succeeded"
            )),
            (Some(expected), Err(error)) => (!error.contains(expected))
                .then(|| format!("expected an error containing {expected:?}")),
        }
    }

    /// JSON equality with numbers compared by value (`49` equals `49.0`).
    fn json_equal(a: &Value, b: &Value) -> bool {
        match (a, b) {
            (Value::Number(x), Value::Number(y)) => match (x.as_i64(), y.as_i64()) {
                (Some(x), Some(y)) => x == y,
                _ => match (x.as_u64(), y.as_u64()) {
                    (Some(x), Some(y)) => x == y,
                    _ => x.as_f64() == y.as_f64(),
                },
            },
            (Value::Array(x), Value::Array(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|(x, y)| json_equal(x, y))
            }
            (Value::Object(x), Value::Object(y)) => {
                x.len() == y.len()
                    && x.iter()
                        .all(|(k, v)| y.get(k).is_some_and(|w| json_equal(v, w)))
            }
            _ => a == b,
        }
    }

    /// An error on one line: newlines (e.g. a Python traceback) become ` | `.
    fn one_line(text: &str) -> String {
        text.lines()
            .map(str::trim_end)
            .filter(|line| !line.is_empty())
            .collect::<Vec<_>>()
            .join(" | ")
    }

    /// A failed register, unregister or start, on one line; the targets'
    /// outcomes are reported beside it.
    fn operation_error_text(error: &OperationError) -> String {
        one_line(&error.error.to_string())
    }

    /// A failed task: `CODE: Kind: message | traceback (context)`.
    fn task_error_text(error: &TaskError) -> String {
        let mut shown: Error = error.error.clone();
        if !error.kind.is_empty() {
            shown.message = format!("{}: {}", error.kind, shown.message);
        }
        one_line(&shown.to_string())
    }

    fn micros(elapsed: Duration) -> u64 {
        u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
    }

    fn duration_text(micros: u64) -> String {
        if micros >= 10_000 {
            format!("{:.1} ms", micros as f64 / 1000.0)
        } else {
            format!("{micros} µs")
        }
    }

    /// The `--json` line of a plan that cannot run.
    #[derive(Serialize)]
    struct PlanErrorLine<'r> {
        plan_error: PlanErrorFields<'r>,
    }

    /// What a plan error names: the plan file as given, the step index and
    /// field when the error is in one, and the message (as on stderr).
    #[derive(Serialize)]
    struct PlanErrorFields<'r> {
        plan: &'r str,
        step: Option<usize>,
        field: Option<&'r str>,
        message: &'r str,
    }

    /// One `--json` step line, keys in the documented order.
    #[derive(Serialize)]
    struct JsonLine<'r> {
        step: Option<usize>,
        op: &'r str,
        name: Option<&'r str>,
        ok: bool,
        hashid: Option<&'r str>,
        /// A register's metadata source, when it had metadata.
        #[serde(skip_serializing_if = "Option::is_none")]
        metadata: Option<&'r str>,
        targets: Vec<JsonTarget<'r>>,
        /// The slot events of the step (`Worker::slot_events`), if any.
        #[serde(skip_serializing_if = "<[_]>::is_empty")]
        slots: &'r [SlotEvent],
        #[serde(skip_serializing_if = "Option::is_none")]
        result: Option<&'r Value>,
        /// The failed step's error code, e.g. `"HANDLE_STALE"`.
        #[serde(skip_serializing_if = "Option::is_none")]
        code: Option<&'r str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<&'r str>,
        /// Why the step did not meet its expectation.
        #[serde(skip_serializing_if = "Option::is_none")]
        unmet: Option<&'r str>,
        micros: u64,
    }

    /// One target of a `--json` step line.
    #[derive(Serialize)]
    struct JsonTarget<'r> {
        target: u16,
        outcome: &'r str,
        #[serde(skip_serializing_if = "Option::is_none")]
        detail: Option<&'r str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        result: Option<&'r Value>,
        /// What became of the slot of a target lost during the step.
        #[serde(skip_serializing_if = "Option::is_none")]
        replacement: Option<&'r str>,
    }

    fn json_line(report: &StepReport, ok: bool) -> String {
        let line = JsonLine {
            step: report.step,
            op: report.op,
            name: report.name.as_deref(),
            ok,
            hashid: report.hashid.as_deref(),
            metadata: report.metadata.as_deref(),
            targets: report
                .targets
                .iter()
                .map(|t| JsonTarget {
                    target: t.target,
                    outcome: t.outcome,
                    detail: t.detail.as_deref(),
                    result: t.result.as_ref(),
                    replacement: t.replacement.as_deref(),
                })
                .collect(),
            slots: &report.slots,
            // Only a step that produced a value has a result (a call's
            // `None` is the JSON `null` it returned); register, unregister,
            // start and kill_target have none.
            result: report.outcome.as_ref().ok().and_then(Option::as_ref),
            code: report
                .outcome
                .as_ref()
                .err()
                .and(report.code)
                .map(ErrorCode::as_str),
            error: report.outcome.as_ref().err().map(String::as_str),
            unmet: report.unmet.as_deref(),
            micros: report.micros,
        };
        // Serializing plain strings, numbers and JSON values cannot fail.
        serde_json::to_string(&line).unwrap_or_default()
    }

    fn text_line(report: &StepReport, ok: bool) -> String {
        let mut line = match report.step {
            Some(step) => format!("step {step} {}", report.op),
            None => format!("step - {} (implicit)", report.op),
        };
        if let Some(name) = &report.name {
            line.push_str(&format!(" {name}"));
        }
        if let [only] = report.targets.as_slice() {
            if report.op == "call" || report.op == "kill_target" {
                line.push_str(&format!(" [target {}]", only.target));
            }
        }
        let status = if ok { "ok" } else { "FAILED" };
        match &report.outcome {
            Ok(Some(result)) => {
                line.push_str(&format!(": {status} -> {}", cut(&result.to_string())))
            }
            Ok(None) => line.push_str(&format!(": {status}")),
            Err(error) if ok => line.push_str(&format!(": {status}, failed as expected: {error}")),
            Err(error) => line.push_str(&format!(": {status}: {error}")),
        }
        if let Some(hashid) = &report.hashid {
            // A failed register's error names the hashid already, if known.
            if report.op == "register" && !line.contains(hashid.as_str()) {
                line.push_str(&format!(" {hashid}"));
            }
        }
        if let Some(source) = &report.metadata {
            line.push_str(&format!(" (metadata: {source})"));
        }
        let lost: Vec<String> = report
            .targets
            .iter()
            // A failed call or register names each target's failure in its
            // error already.
            .filter(|t| t.outcome != "ok" && (t.outcome != "failed" || report.op == "start"))
            .map(|t| {
                let mut part = match &t.detail {
                    Some(detail) => format!("target {} {} ({detail})", t.target, t.outcome),
                    None => format!("target {} {}", t.target, t.outcome),
                };
                if let Some(replacement) = &t.replacement {
                    part.push_str(&format!("; {replacement}"));
                }
                part
            })
            .collect();
        if !lost.is_empty() {
            line.push_str(&format!(" [{}]", lost.join(", ")));
        }
        // A replacement's start is left out: its pid differs on every run
        // (the `--json` line has it); its join or failure says enough. So
        // is the first loss of each target the line already names lost or
        // killed: the bracket above says why.
        let mut named: Vec<u16> = report
            .targets
            .iter()
            .filter(|t| t.outcome != "ok")
            .map(|t| t.target)
            .collect();
        let slots: Vec<String> = report
            .slots
            .iter()
            .filter(|event| match event {
                SlotEvent::Spawned { .. } => false,
                SlotEvent::Lost { target, .. } => match named.iter().position(|t| *t == target.0) {
                    Some(at) => {
                        named.remove(at);
                        false
                    }
                    None => true,
                },
                _ => true,
            })
            .map(|event| one_line(&event.to_string()))
            .collect();
        if !slots.is_empty() {
            line.push_str(&format!(" [{}]", slots.join("; ")));
        }
        if let Some(unmet) = &report.unmet {
            line.push_str(&format!(" -- {unmet}"));
        }
        line.push_str(&format!(" ({})", duration_text(report.micros)));
        line
    }

    /// `text`, cut to [`RESULT_TEXT_CHARS`] characters.
    fn cut(text: &str) -> String {
        match text.char_indices().nth(RESULT_TEXT_CHARS) {
            Some((end, _)) => format!("{}…", &text[..end]),
            None => text.to_owned(),
        }
    }
}
