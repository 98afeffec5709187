//! The operation of each step (start, register, unregister, call,
//! call_all, kill_target) against the Worker, and each target's part in it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use callreg::descriptor::python_serialized_digest;
use callreg::envelope::Envelope;
use callreg::error::{Error, ErrorCode};
use callreg::io::worker::registration_failure_text;
use callreg::io::{OperationError, TaskError, Worker};
use callreg::protocol::{Failure, Handle, TargetId};
use callreg::runtime::python::PythonRuntime;
use callreg::runtime::TaskEncoding;
use serde_json::{json, Value};

use super::super::plan::{CallStep, RegisterStep, Step};
use super::execute::{Label, Runner};
use super::report::{
    micros, one_line, operation_error_text, task_error_text, unmet, unmet_error, StepReport,
    TargetReport,
};

/// How often `kill_target` checks whether the Worker noticed the kill.
const KILL_POLL: Duration = Duration::from_millis(1);

impl Runner<'_> {
    /// Forks the targets; the implicit start (before a plan's first step
    /// when it has no `start` step) has no index.
    pub(super) fn start(&mut self, step: Option<usize>, expect_error: Option<&str>) -> StepReport {
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
        // §2.9): the step waits until each target serves or is given up.
        // A failed start stops the plan unless every target serves now.
        let serving = report.outcome.is_ok() || {
            let _ = self.settle();
            self.worker.live_targets().len() == usize::from(self.plan.targets)
        };
        self.finish_target_events(&mut report, 0);
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
    pub(super) fn settle_pre_start(&mut self, step: &Step, report: &mut StepReport) {
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

    pub(super) fn register(&mut self, index: usize, register: &RegisterStep) -> StepReport {
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

    pub(super) fn unregister(&mut self, index: usize, name: &str) -> StepReport {
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

    pub(super) fn call(&mut self, index: usize, call: &CallStep) -> StepReport {
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

    pub(super) fn call_all(&mut self, index: usize, call: &CallStep) -> StepReport {
        let (mut report, resolved) = self.begin_call(index, "call_all", call);
        let Some((handle, prefix)) = resolved else {
            return report;
        };
        let input = task_input(call);
        let results = self
            .worker
            .submit_to_every(&handle, TaskEncoding::Json, &input);
        if results.is_empty() {
            report.outcome = Err("NO_LIVE_TARGET: no live target to run the call on".to_owned());
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

    pub(super) fn kill_target(&mut self, index: usize, target: u16) -> StepReport {
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
        // Then the step waits for the replacement, in `finish_target_events`.
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

fn not_registered(name: &str, why: &str) -> String {
    format!("{name:?} is not registered ({why})")
}
