//! Runs: a task's slot and its hooks' slots pinned in frame order (by the
//! control thread, or by the reader on an idle target), the queue that
//! hands runs to the task thread, and the task thread, which runs each
//! task between its `call_before` and `call_after` hooks.

use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::reply::ReplyWriter;
use super::{panic_message, report_finalizers};
use crate::descriptor::Digest;
use crate::error::ErrorCode;
use crate::io::process::exit_unless_target;
use crate::io::slots::SlotTable;
use crate::metadata::{merge_retval_keyword, CallableMetadata, HookCall};
use crate::protocol::{Seq, TargetId};
use crate::runtime::{Runtime, TaskEncoding};
use crate::wire::{Frame, TaskFailure};

/// The hooks of an installed digest (its registration's `call_before` and
/// `call_after`).
#[derive(Default)]
pub(super) struct Hooks {
    before: Vec<HookCall>,
    after: Vec<HookCall>,
}

impl Hooks {
    pub(super) fn of(metadata: Option<&CallableMetadata>) -> Option<Arc<Hooks>> {
        let metadata = metadata?;
        if metadata.call_before.is_empty() && metadata.call_after.is_empty() {
            return None;
        }
        Some(Arc::new(Hooks {
            before: metadata.call_before.clone(),
            after: metadata.call_after.clone(),
        }))
    }
}

/// A hook resolved and pinned for one run: the call, the run seq its pin
/// is held under, and the hook's callable.
struct PinnedHook<C> {
    call: HookCall,
    seq: Seq,
    callable: crate::sync::Arc<C>,
}

/// One task handed from the control thread to the task thread.
struct Run<C> {
    seq: u64,
    digest: Digest,
    encoding: TaskEncoding,
    input: Vec<u8>,
    callable: crate::sync::Arc<C>,
    before: Vec<PinnedHook<C>>,
    after: Vec<PinnedHook<C>>,
}

/// What pins a task's slot and hands the run to the task thread: used by
/// the control thread, and by the reader thread for a task that finds no
/// control queued or running ([`ControlGate`](crate::io::slots::ControlGate)).
/// Pinning never takes the GIL: it only clones callables' references and
/// updates the machine.
pub(super) struct Pinning<C> {
    pub(super) table: Arc<SlotTable<C>>,
    pub(super) runs: Arc<RunQueue<C>>,
    /// Hooks by installed digest, from the metadata of the registration
    /// that installed it (written by the control thread only).
    pub(super) hooks: Mutex<BTreeMap<Digest, Arc<Hooks>>>,
    /// The next target-local run seq for a hook's pin (counts down).
    pub(super) next_hook_seq: AtomicU64,
}

/// The runs handed to the task thread, in the order they were pinned.
/// The task thread sleeps on it only once it is empty, and a run is
/// followed by a wake-up only when the task thread sleeps there: no futex
/// call for a run that finds it busy, and no spinning or yielding before
/// it sleeps (a channel's receiver spins and yields first, which costs a
/// round trip CPU time and context switches when tasks come one at a
/// time). Never closed: the task thread runs until the process ends.
pub(super) struct RunQueue<C> {
    state: Mutex<Queued<C>>,
    ready: Condvar,
}

struct Queued<C> {
    runs: VecDeque<Run<C>>,
    /// The task thread sleeps on `ready` (set and cleared by it, under
    /// the lock).
    sleeping: bool,
}

impl<C> RunQueue<C> {
    pub(super) fn new() -> RunQueue<C> {
        RunQueue {
            state: Mutex::new(Queued {
                runs: VecDeque::new(),
                sleeping: false,
            }),
            ready: Condvar::new(),
        }
    }

    /// Queues `run`, waking the task thread if it sleeps.
    fn push(&self, run: Run<C>) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.runs.push_back(run);
        let wake = state.sleeping;
        drop(state);
        if wake {
            self.ready.notify_one();
        }
    }

    /// The next run, sleeping until there is one.
    fn pop(&self) -> Run<C> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(run) = state.runs.pop_front() {
                return run;
            }
            state.sleeping = true;
            state = self.ready.wait(state).unwrap_or_else(|p| p.into_inner());
            state.sleeping = false;
        }
    }
}

/// Why a task did not start: its failure, and its input back (the
/// reader then hands the frame to the control thread, which fails it in
/// order). Nothing stays pinned.
pub(super) struct Unstarted {
    pub(super) code: ErrorCode,
    pub(super) message: String,
    pub(super) input: Vec<u8>,
}

impl<C> Pinning<C> {
    /// Pins task `seq`'s slot and its hooks' slots, in frame order (the
    /// caller is the control thread, or the reader while no control is
    /// queued or running), and hands the run to the task thread.
    ///
    /// # Errors
    /// The machine's error when `digest` does not resolve; a hook's
    /// ([`Pinning::pin_hooks`]).
    /// Nothing stays pinned, and no slot is freed on the way out: every
    /// pin undone here was made just now on a resolved slot, so undoing
    /// it never releases a callable (no finalizer, no GIL).
    pub(super) fn begin(
        &self,
        seq: u64,
        digest: Digest,
        encoding: TaskEncoding,
        input: Vec<u8>,
    ) -> Result<(), Unstarted> {
        let callable = match self.table.begin_task(Seq(seq), digest) {
            Ok(callable) => callable,
            Err(error) => {
                return Err(Unstarted {
                    code: error.code,
                    message: error.message,
                    input,
                })
            }
        };
        let (before, after) = match self.pin_hooks(digest, encoding) {
            Ok(pinned) => pinned,
            Err((code, message)) => {
                drop(callable);
                let _ = self.table.end_task(Seq(seq));
                return Err(Unstarted {
                    code,
                    message,
                    input,
                });
            }
        };
        let run = Run {
            seq,
            digest,
            encoding,
            input,
            callable,
            before,
            after,
        };
        self.runs.push(run);
        Ok(())
    }

    /// Resolves and pins the hooks of `digest` for one run, in the
    /// target's own table.
    ///
    /// # Errors
    /// `TASK_FAILED` naming the hook's hashid when a `call_before` hook
    /// has a `retval_keyword` and the task is pickle-encoded (its kwargs
    /// are opaque to the target), or `DIGEST_NOT_INSTALLED` naming the
    /// hook's hashid when a hook does not resolve; nothing stays pinned.
    #[allow(clippy::type_complexity)]
    fn pin_hooks(
        &self,
        digest: Digest,
        encoding: TaskEncoding,
    ) -> Result<(Vec<PinnedHook<C>>, Vec<PinnedHook<C>>), (ErrorCode, String)> {
        let hooks = self
            .hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&digest)
            .cloned();
        let Some(hooks) = hooks else {
            return Ok((Vec::new(), Vec::new()));
        };
        if encoding == TaskEncoding::Pickle {
            if let Some(hook) = hooks.before.iter().find(|h| h.retval_keyword.is_some()) {
                return Err((
                    ErrorCode::TASK_FAILED,
                    format!(
                        "call_before hook {} passes its result as keyword argument {:?}, which needs a JSON-encoded task; this task is pickle-encoded",
                        hook.hashid,
                        hook.retval_keyword.as_deref().unwrap_or_default()
                    ),
                ));
            }
        }
        let mut pinned: Vec<PinnedHook<C>> = Vec::new();
        let mut before_count = 0;
        for (list, call) in hooks
            .before
            .iter()
            .map(|h| ("call_before", h))
            .chain(hooks.after.iter().map(|h| ("call_after", h)))
        {
            let seq = Seq(self.next_hook_seq.fetch_sub(1, Ordering::Relaxed));
            match self.table.begin_task(seq, call.hashid.0) {
                Ok(callable) => {
                    pinned.push(PinnedHook {
                        call: call.clone(),
                        seq,
                        callable,
                    });
                    if list == "call_before" {
                        before_count += 1;
                    }
                }
                Err(error) => {
                    for hook in pinned {
                        drop(hook.callable);
                        let _ = self.table.end_task(hook.seq);
                    }
                    return Err((
                        error.code,
                        format!("{list} hook {} cannot run: {}", call.hashid, error.message),
                    ));
                }
            }
        }
        let after = pinned.split_off(before_count);
        Ok((pinned, after))
    }
}

pub(super) fn run_tasks<R: Runtime>(
    runtime: &R,
    id: TargetId,
    table: &SlotTable<R::Callable>,
    writer: &ReplyWriter,
    queue: &RunQueue<R::Callable>,
) -> ! {
    loop {
        let run = queue.pop();
        let (seq, digest) = (run.seq, run.digest);
        // A run cancelled while it was queued never starts and sends no
        // result: the cancel's reply answered for it (§2.11).
        if table.start_task(Seq(seq)) != Ok(true) {
            end_run(table, run);
            continue;
        }
        let result = run_with_hooks(runtime, &run);
        end_run(table, run);
        // A slot unregistered during the run is freed at its end.
        report_finalizers(table, id, || {
            format!(
                "the end of task seq {seq} of {} (unregistered while it ran)",
                digest.hashid()
            )
        });
        writer.send(Frame::TaskResult {
            seq,
            digest,
            result,
        });
    }
}

/// Drops a run's callables and unpins its slot and its hooks' slots (they
/// were pinned when the run began; ending them cannot fail).
fn end_run<C>(table: &SlotTable<C>, run: Run<C>) {
    let Run {
        seq,
        callable,
        before,
        after,
        ..
    } = run;
    drop(callable);
    let _ = table.end_task(Seq(seq));
    for hook in before.into_iter().chain(after) {
        drop(hook.callable);
        let _ = table.end_task(hook.seq);
    }
}

/// Calls the runtime, turning a panic into a `TASK_FAILED` failure.
fn call_caught<R: Runtime>(
    runtime: &R,
    callable: &R::Callable,
    encoding: TaskEncoding,
    input: &[u8],
) -> Result<Vec<u8>, TaskFailure> {
    let called = catch_unwind(AssertUnwindSafe(|| runtime.call(callable, encoding, input)));
    // The call ran user code, which may have forked: only the target goes
    // on (a forked copy returning here never reports a result).
    exit_unless_target();
    match called {
        Ok(Ok(output)) => Ok(output),
        Ok(Err(error)) => Err(TaskFailure {
            code: error.code,
            kind: error.kind,
            message: error.message,
            exception: error.exception,
        }),
        Err(panic) => Err(TaskFailure {
            code: ErrorCode::TASK_FAILED,
            kind: "panic".to_owned(),
            message: panic_message(&*panic),
            exception: Vec::new(),
        }),
    }
}

/// The failure reported for a task whose hook failed: kind `HookFailed`,
/// the hook's own code, and a message naming the hook and its failure.
fn hook_failure(list: &str, hook: &HookCall, when: &str, failure: TaskFailure) -> TaskFailure {
    TaskFailure {
        code: failure.code,
        kind: "HookFailed".to_owned(),
        message: format!(
            "{list} hook {} failed{when}: {}: {}",
            hook.hashid, failure.kind, failure.message
        ),
        exception: Vec::new(),
    }
}

/// Runs one task with its hooks: each `call_before` hook with its
/// JSON args and kwargs (a `retval_keyword` result merged into the task's
/// kwargs), the task, then each `call_after` hook, which run only when the
/// task succeeded. The first failure ends the run and is its outcome; a
/// failed hook is reported with kind `HookFailed`.
fn run_with_hooks<R: Runtime>(runtime: &R, run: &Run<R::Callable>) -> Result<Vec<u8>, TaskFailure> {
    let mut input = std::borrow::Cow::Borrowed(run.input.as_slice());
    for hook in &run.before {
        let result = call_caught(
            runtime,
            &hook.callable,
            TaskEncoding::Json,
            &hook.call.task_input(),
        )
        .map_err(|f| hook_failure("call_before", &hook.call, "", f))?;
        if let Some(keyword) = &hook.call.retval_keyword {
            let merged = merge_retval_keyword(&input, keyword, &result).map_err(|e| {
                hook_failure(
                    "call_before",
                    &hook.call,
                    "",
                    TaskFailure {
                        code: ErrorCode::TASK_FAILED,
                        kind: "RetvalKeywordInvalid".to_owned(),
                        message: e.to_string(),
                        exception: Vec::new(),
                    },
                )
            })?;
            input = std::borrow::Cow::Owned(merged);
        }
    }
    let output = call_caught(runtime, &run.callable, run.encoding, &input)?;
    for hook in &run.after {
        call_caught(
            runtime,
            &hook.callable,
            TaskEncoding::Json,
            &hook.call.task_input(),
        )
        .map_err(|f| hook_failure("call_after", &hook.call, " after the task succeeded", f))?;
    }
    Ok(output)
}
