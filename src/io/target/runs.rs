//! Runs: a task's slot and its hooks' slots pinned in frame order (by the
//! control thread, or by the thread that read it on an idle target), the
//! queue that
//! hands runs to the task thread, and the task thread, which runs each
//! task between its `call_before` and `call_after` hooks.

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::BorrowedFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use nix::errno::Errno;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};

use super::intake::Intake;
use super::reply::ReplyWriter;
use super::{panic_message, report_finalizers, wait_failed};
use crate::descriptor::Digest;
use crate::error::ErrorCode;
use crate::io::process::exit_unless_target;
use crate::io::slots::SlotTable;
use crate::io::spin::Spin;
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

/// One task handed to the task thread (by the thread that pinned it).
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
/// the control thread, and by the thread reading the control socket (the
/// task thread or the reader) for a task that finds no control queued or
/// running ([`ControlGate`](crate::io::slots::ControlGate)).
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

/// The runs handed to the task thread, in the order they were pinned,
/// and the task thread's wait for them.
///
/// The task thread, finding the queue empty, may first spin for the next
/// run ([`RunQueue::pop`]: bounded and adaptive, `specs/threads.md`, "The
/// target's spin"), then sleeps in its epoll instance, on the queue's
/// eventfd and on the control socket (`EPOLLEXCLUSIVE`, registered before
/// the reader's: [`super::intake`]). Woken by the socket, it reads it
/// itself, so that a task arriving at an idle target is read, pinned and
/// run by this one thread. A run pushed by another thread is followed by
/// a write to the eventfd only when the task thread sleeps: no system
/// call for a run that finds it busy or spinning. Never closed: the task
/// thread runs until the process ends.
pub(super) struct RunQueue<C> {
    state: Mutex<Queued<C>>,
    /// How many runs are queued (written under the lock, read by the
    /// spinning task thread without it).
    queued: AtomicUsize,
    /// Written by a push that finds the task thread asleep.
    wake: EventFd,
    /// The task thread's wait: `wake` ([`WAKE_KEY`]) and the control
    /// socket ([`SOCKET_KEY`]).
    wait: Epoll,
}

/// The epoll key of the run queue's eventfd.
const WAKE_KEY: u64 = 0;
/// The epoll key of the control socket.
const SOCKET_KEY: u64 = 1;

struct Queued<C> {
    runs: VecDeque<Run<C>>,
    /// The task thread sleeps in its epoll instance (set and cleared by
    /// it, under the lock).
    sleeping: bool,
}

/// The longest back-off after spins that found no run: this many pops
/// that do not spin.
const MAX_BACKOFF: u32 = 256;

/// The task thread's spin: the adaptive rule ([`Spin`]: whether spinning
/// pays, in stretches) and a back-off from spins that find nothing. A
/// spin that reaches its budget without a run skips the next 1, 2, 4, …
/// (at most [`MAX_BACKOFF`]) pops' spins; one that finds a run ends the
/// back-off. Why: a target whose next task comes later than the budget
/// (tasks spread over several targets, a caller busy between tasks) only
/// burns CPU spinning, and the rule's spinning stretches would spin in
/// vain at every pop (`specs/threads.md`, "The target's spin").
pub(super) struct TaskSpin {
    rule: Spin,
    backoff: u32,
    skip: u32,
}

impl TaskSpin {
    /// A task thread's spin of at most `budget` per pop (zero: never).
    pub(super) fn new(budget: std::time::Duration) -> TaskSpin {
        TaskSpin {
            rule: Spin::new(budget),
            backoff: 0,
            skip: 0,
        }
    }

    /// Until when the pop beginning at `now` spins, if it does: only with
    /// its queue `empty`. Every pop is one of the rule's waits, a pop that
    /// finds a run queued too (its cycle is measured all the same).
    fn next_wait(&mut self, now: Instant, empty: bool) -> Option<Instant> {
        let until = self.rule.next_wait(now)?;
        if !empty {
            return None;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return None;
        }
        Some(until)
    }

    /// Records whether a spin found a run.
    fn spun(&mut self, found: bool) {
        if found {
            self.backoff = 0;
        } else {
            self.backoff = (self.backoff * 2).clamp(1, MAX_BACKOFF);
            self.skip = self.backoff;
        }
    }
}

/// Spin checks (each a look at the count of queued runs) between two
/// turns at reading the control socket without waiting, each with a look
/// at the clock and followed by a `sched_yield`, so that a spinning task
/// thread gives its CPU to the target's reader (woken by a frame while
/// this thread spins, it may pin the run this one waits for) and to any
/// other thread ready on that CPU. Why not a read at every check: a read
/// is a system call, and spinning on system calls cost a quarter of the
/// rate of 100 tasks in flight (`BENCHMARKS.md`).
const SPINS_PER_YIELD: u32 = 32;

impl<C> RunQueue<C> {
    /// A queue whose task thread waits on its eventfd only.
    ///
    /// # Errors
    /// Creating the eventfd or the epoll instance failed.
    pub(super) fn new() -> Result<RunQueue<C>, Errno> {
        let wake = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        let wait = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        wait.add(&wake, EpollEvent::new(EpollFlags::EPOLLIN, WAKE_KEY))?;
        Ok(RunQueue {
            state: Mutex::new(Queued {
                runs: VecDeque::new(),
                sleeping: false,
            }),
            queued: AtomicUsize::new(0),
            wake,
            wait,
        })
    }

    /// A queue whose task thread also waits on the control socket
    /// `socket`, with `EPOLLEXCLUSIVE`: call before any other thread
    /// waits on it that way, so that the kernel wakes this one first.
    ///
    /// # Errors
    /// Creating the eventfd or the epoll instance, or adding `socket`,
    /// failed.
    pub(super) fn watching(socket: BorrowedFd<'_>) -> Result<RunQueue<C>, Errno> {
        let queue = RunQueue::new()?;
        queue.wait.add(
            socket,
            EpollEvent::new(super::intake::socket_events(), SOCKET_KEY),
        )?;
        Ok(queue)
    }

    /// Queues `run`, waking the task thread if it sleeps; returns whether
    /// it slept.
    fn push(&self, run: Run<C>) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.runs.push_back(run);
        self.queued.store(state.runs.len(), Ordering::Release);
        let wake = state.sleeping;
        drop(state);
        if wake {
            // The sleeper reads the counter down at every wake-up, so it
            // never fills; a write fails only when a task closed the
            // eventfd, and the task thread would then sleep through this
            // run.
            if let Err(error) = self.wake.write(1) {
                wait_failed("waking the task thread", error);
            }
        }
        wake
    }

    /// The next run. When none is queued, the task thread spins for one
    /// first if `spin` says so (at most its budget, yielding its CPU every
    /// [`SPINS_PER_YIELD`] checks), then sleeps until there is one, reading
    /// the control socket through `intake` whenever it is woken by it (a
    /// task it reads is pinned and queued here like any). Every pop is one
    /// of `spin`'s waits, measured from the end of the last (the task, its
    /// reply, and this wait: `specs/threads.md`, "The target's spin").
    /// The next run if one is queued now, without waiting.
    fn try_pop(&self) -> Option<Run<C>> {
        if self.queued.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let run = state.runs.pop_front();
        self.queued.store(state.runs.len(), Ordering::Release);
        run
    }

    fn pop(&self, spin: &mut TaskSpin, intake: Option<&Intake<C>>) -> Run<C> {
        let start = Instant::now();
        let empty = self.queued.load(Ordering::Acquire) == 0;
        if let Some(until) = spin.next_wait(start, empty) {
            spin.spun(self.spin_until(until, intake));
        }
        let mut events = [EpollEvent::empty(); 2];
        let run = loop {
            {
                let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(run) = state.runs.pop_front() {
                    self.queued.store(state.runs.len(), Ordering::Release);
                    break run;
                }
                state.sleeping = true;
            }
            let ready = match self.wait.wait(&mut events, EpollTimeout::NONE) {
                Ok(ready) => ready,
                Err(Errno::EINTR) => 0,
                Err(error) => wait_failed("the task thread's wait", error),
            };
            self.state
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .sleeping = false;
            for event in &events[..ready] {
                match event.data() {
                    // Read down to zero (a stale write from a push that
                    // found this thread asleep just before it woke is
                    // read here too).
                    WAKE_KEY => match self.wake.read() {
                        Ok(_) | Err(Errno::EAGAIN | Errno::EINTR) => {}
                        Err(error) => wait_failed("the task thread's eventfd", error),
                    },
                    _ => {
                        if let Some(intake) = intake {
                            intake.read();
                        }
                    }
                }
            }
        };
        spin.rule.ended(start, Instant::now());
        run
    }

    /// Spins until a run is queued (`true`) or `until` passes (`false`),
    /// taking a turn at reading the control socket through `intake`
    /// without waiting every [`SPINS_PER_YIELD`] checks.
    fn spin_until(&self, until: Instant, intake: Option<&Intake<C>>) -> bool {
        let mut checks = 0u32;
        let intake = intake.filter(|intake| !intake.ended());
        while self.queued.load(Ordering::Acquire) == 0 {
            checks = checks.wrapping_add(1);
            if checks.is_multiple_of(SPINS_PER_YIELD) {
                if let Some(intake) = intake {
                    intake.read();
                    if self.queued.load(Ordering::Acquire) > 0 {
                        break;
                    }
                }
                if Instant::now() >= until {
                    return false;
                }
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        }
        true
    }
}

/// Why a task did not start: its failure, and its input back (the
/// reading thread then hands the frame to the control thread, which fails
/// it in order). Nothing stays pinned.
pub(super) struct Unstarted {
    pub(super) code: ErrorCode,
    pub(super) message: String,
    pub(super) input: Vec<u8>,
}

impl<C> Pinning<C> {
    /// Pins task `seq`'s slot and its hooks' slots, in frame order (the
    /// caller is the control thread, or the thread reading the control
    /// socket while no control is queued or running), and hands the run to the task thread.
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

/// The task thread: takes each run from `queue` (reading the control
/// socket through `intake` while it has none), starts it unless it was
/// cancelled, runs it with its hooks, unpins it and writes its result.
pub(super) fn run_tasks<R: Runtime>(
    runtime: &R,
    id: TargetId,
    table: &SlotTable<R::Callable>,
    writer: &ReplyWriter,
    (queue, intake): (&RunQueue<R::Callable>, &Intake<R::Callable>),
    spin: &mut TaskSpin,
) -> ! {
    // A run already started, its start report sent with the previous
    // run's result.
    let mut next: Option<Run<R::Callable>> = None;
    loop {
        let reported = next.is_some();
        let run = match next.take() {
            Some(run) => run,
            None => queue.pop(spin, Some(intake)),
        };
        let (seq, digest) = (run.seq, run.digest);
        // A run cancelled while it was queued never starts and sends no
        // result: the cancel's reply answered for it (§2.11).
        if !reported && table.start_task(Seq(seq)) != Ok(true) {
            end_run(table, run);
            continue;
        }
        // The start report is in the socket before any of the task's code
        // runs: a process lost without having sent it never ran the task,
        // and its deadline counts from here (§2.12, §2.15).
        if !reported {
            writer.send_started(seq);
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
        // The next run, if one is queued already, starts now (past
        // cancelling), and its start report goes in the same write as
        // this result, still before any of its code runs.
        let mut started = None;
        while let Some(run) = queue.try_pop() {
            if table.start_task(Seq(run.seq)) == Ok(true) {
                started = Some(run.seq);
                next = Some(run);
                break;
            }
            end_run(table, run);
        }
        writer.send_with_start(
            Frame::TaskResult {
                seq,
                digest,
                result,
            },
            started,
        );
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn run(seq: u64) -> Run<()> {
        Run {
            seq,
            digest: Digest([seq as u8; 32]),
            encoding: TaskEncoding::Pickle,
            input: Vec::new(),
            callable: crate::sync::Arc::new(()),
            before: Vec::new(),
            after: Vec::new(),
        }
    }

    impl<C> RunQueue<C> {
        fn sleeps(&self) -> bool {
            self.state.lock().unwrap().sleeping
        }
    }

    /// A task thread's pop from `queue` with `spin`, on a thread of its
    /// own: the run's seq and how long the pop took, at most 5 s later
    /// (`None`: it did not return by then).
    fn popped(
        queue: &Arc<RunQueue<()>>,
        mut spin: TaskSpin,
    ) -> impl FnOnce() -> Option<(u64, Duration)> {
        let (sender, receiver) = std::sync::mpsc::channel();
        let queue = queue.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            let seq = queue.pop(&mut spin, None).seq;
            let _ = sender.send((seq, started.elapsed()));
        });
        move || receiver.recv_timeout(Duration::from_secs(5)).ok()
    }

    /// Waits (at most 5 s) until the task thread sleeps on `queue`.
    fn until_asleep(queue: &RunQueue<()>) -> Duration {
        let started = Instant::now();
        while !queue.sleeps() {
            assert!(started.elapsed() < Duration::from_secs(5), "never slept");
            std::thread::sleep(Duration::from_millis(1));
        }
        started.elapsed()
    }

    #[test]
    fn a_spinning_task_thread_takes_a_run_queued_during_its_spin_without_sleeping() {
        let queue = Arc::new(RunQueue::new().unwrap());
        // A period's first waits spin: this one for up to 10 s.
        let popper = popped(&queue, TaskSpin::new(Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(30));
        assert!(!queue.sleeps());
        assert!(!queue.push(run(7)), "the spinning thread needed no wake-up");
        let (seq, waited) = popper().expect("the pop returned");
        assert_eq!(seq, 7);
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        assert_eq!(queue.queued.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_task_thread_without_a_spin_budget_sleeps_at_once_and_is_woken() {
        let queue = Arc::new(RunQueue::new().unwrap());
        let popper = popped(&queue, TaskSpin::new(Duration::ZERO));
        until_asleep(&queue);
        assert!(queue.push(run(3)), "the sleeping thread was woken");
        assert_eq!(popper().map(|(seq, _)| seq), Some(3));
    }

    #[test]
    fn a_spin_ends_at_its_budget_and_the_task_thread_sleeps() {
        let queue = Arc::new(RunQueue::new().unwrap());
        let popper = popped(&queue, TaskSpin::new(Duration::from_millis(20)));
        let asleep = until_asleep(&queue);
        assert!(asleep >= Duration::from_millis(20), "{asleep:?}");
        assert!(queue.push(run(5)));
        assert_eq!(popper().map(|(seq, _)| seq), Some(5));
    }

    #[test]
    fn spins_that_find_nothing_back_off_doubling_and_one_that_finds_a_run_ends_it() {
        let mut spin = TaskSpin::new(Duration::from_micros(50));
        let now = Instant::now();
        // Which of the next `n` pops spin (a period's first pops: the rule
        // says spin).
        let spins = |spin: &mut TaskSpin, n: usize| -> Vec<bool> {
            (0..n)
                .map(|_| spin.next_wait(now, true).is_some())
                .collect()
        };
        assert_eq!(spins(&mut spin, 1), vec![true]);
        spin.spun(false);
        assert_eq!(spins(&mut spin, 2), vec![false, true]);
        spin.spun(false);
        assert_eq!(spins(&mut spin, 3), vec![false, false, true]);
        spin.spun(false);
        assert_eq!(spins(&mut spin, 5), vec![false, false, false, false, true]);
        spin.spun(true);
        assert_eq!(spins(&mut spin, 2), vec![true, true]);
        // A pop that finds a run queued never spins, and its wait does
        // not count against a back-off.
        spin.spun(false);
        let waits = spin.rule.waits();
        assert!(spin.next_wait(now, false).is_none());
        assert_eq!(spin.skip, 1);
        assert_eq!(spin.rule.waits(), waits + 1);
        // The back-off stops doubling at MAX_BACKOFF.
        for _ in 0..12 {
            spin.spun(false);
        }
        assert_eq!(spin.backoff, MAX_BACKOFF);
        assert_eq!(spin.skip, MAX_BACKOFF);
    }

    #[test]
    fn queued_runs_are_taken_in_order_without_a_wait() {
        let queue = RunQueue::new().unwrap();
        let mut spin = TaskSpin::new(Duration::from_secs(10));
        for seq in 1..=3 {
            assert!(!queue.push(run(seq)));
        }
        assert_eq!(queue.queued.load(Ordering::Relaxed), 3);
        let seqs: Vec<u64> = (0..3).map(|_| queue.pop(&mut spin, None).seq).collect();
        assert_eq!(seqs, vec![1, 2, 3]);
        // Each pop is one of the rule's waits, none of which spun.
        assert_eq!(spin.rule.waits(), 3);
        assert_eq!(spin.backoff, 0);
        assert_eq!(queue.queued.load(Ordering::Relaxed), 0);
    }
}
