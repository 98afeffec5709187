//! Loom check of the leader/followers rule (`callreg::io::lead`): the
//! library's own generic code, the leader's wait (`lead::lead`), stepping
//! down, leaving the lock (`lead::release`) and what is owed after it
//! (`lead::finish`: hand over, then wake the leader), with the real
//! `Watch`, run by every thread of the protocol: the IO thread, a target,
//! callers that wait for their result (and lead when nobody leads) and a
//! caller that does not wait. The Worker runs the same functions over
//! `poll(2)`; here they run over a model of the OS ([`Pipes`], a
//! `lead::Poller`) and of the IO state ([`Held`], a `lead::Locked`).
//!
//! It checks that no waiting caller is stranded (every reply is read by
//! someone, every waiter completes: loom reports a deadlock otherwise),
//! that at most one leader leads (no two threads poll the leader wake
//! pipe at once), and that the IO thread never plans to read a reply
//! socket the leader reads.
//!
//! `poll` is modelled over level-triggered pipes: a poll registers its
//! thread's doorbell on every pipe of its set and returns when any of them
//! holds data, else sleeps until a write to one of them rings the doorbell
//! and checks again. The pipes' state is the kernel's, with a lock of its
//! own (a write, a read, a poll's check-and-sleep are each atomic, so no
//! ring is lost). The target is a thread that answers each request on its
//! control socket with a reply on its reply socket. The IO thread is its
//! run rule's steps 3 to 5 (`src/io/worker/io_loop.rs`): plan its `poll`
//! under the lock with `Watch::plan_io`, release the lock and
//! `lead::finish`, poll, then read under the lock what was ready.
//!
//! `every_mutation_strands_a_caller` switches on each of the library's
//! known bugs (`lead::Mutation`, selectable under `cfg(loom)` only) and
//! shows loom finding the stranded caller: `finish` waking the leader
//! before handing over (the leader wakes, finds its hand-off incomplete
//! and polls again for a reply already read), or not at all; a leader
//! stepping down, or a caller that does not lead leaving the lock, without
//! the wake the rule asks for. A failing interleaving's trace (what each
//! thread did, in order) is printed with the failure.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --features io
//! --test loom_lead --release`. Without `--cfg loom` this file is empty.
#![cfg(all(loom, feature = "io"))]

use callreg::io::handoff::{channel, Completer, Pending};
use callreg::io::lead::{
    self, Left, LinkId, Locked, Mutation, Owed, PollFailed, Poller, Readiness, StateLock, Watch,
};
use loom::sync::{Condvar, Mutex, MutexGuard};
use loom::thread::{self, ThreadId};
use nix::unistd::Pid;
use std::collections::VecDeque;
use std::time::Instant;
// The world is shared by a std `Arc`: its reference count is not what is
// checked here, and loom's would add a scheduling point to every clone.
use std::sync::Arc;

/// The one target: index 0, process 100.
const LIVE: &[LinkId] = &[LinkId::new(0, Pid::from_raw(100))];

/// A request's result: what the target answers to request `id`.
fn answer(id: u32) -> u32 {
    id * 10 + 1
}

thread_local! {
    /// What the threads did in the interleaving being explored, printed
    /// when it fails (loom runs a model's threads on one thread; this is no
    /// scheduling point of loom's).
    static TRACE: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn note(what: String) {
    let who = thread::current().id();
    TRACE.with(|trace| trace.borrow_mut().push(format!("{who:?}: {what}")));
}

/// `loom::model`, printing the failing interleaving's trace.
fn model(scenario: impl Fn() + Sync + Send + 'static) {
    model_bounded(None, scenario);
}

/// [`model`] with at most `bound` preemptions per interleaving (`None`:
/// `LOOM_MAX_PREEMPTIONS`, as every other model). The scenarios with four
/// threads besides the target run with 2: with 3 each takes about a
/// minute, and every mutation of `every_mutation_strands_a_caller` is
/// also caught with 2.
fn model_bounded(bound: Option<usize>, scenario: impl Fn() + Sync + Send + 'static) {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            TRACE.with(|trace| {
                if let Ok(trace) = trace.try_borrow() {
                    eprintln!("interleaving:\n  {}", trace.join("\n  "));
                }
            });
            default(info);
        }));
    });
    let mut builder = loom::model::Builder::new();
    if bound.is_some() {
        builder.preemption_bound = bound;
    }
    builder.check(move || {
        TRACE.with(|trace| trace.borrow_mut().clear());
        scenario();
    });
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap()
}

/// The pipes (the target's reply socket and control socket, the wake
/// pipes), as the kernel keeps them.
#[derive(Clone, Copy, PartialEq, Debug)]
enum PipeId {
    /// The target's control socket.
    Control,
    /// The target's reply socket.
    Replies,
    /// The IO thread's wake pipe.
    IoWake,
    /// The leader wake pipe.
    LeaderWake,
}

use PipeId::{Control, IoWake, LeaderWake, Replies};

const PIPES: usize = 4;

#[derive(Default)]
struct Kernel {
    /// What each pipe holds.
    data: [VecDeque<u32>; PIPES],
    /// Per thread that ever waited: the pipes its current wait is on
    /// (empty: not waiting) and its doorbell.
    waiting: Vec<(ThreadId, Vec<PipeId>, std::sync::Arc<Condvar>)>,
}

/// Level-triggered pipes, and `poll` over them: the OS pieces of the rule
/// (`lead::Poller`). The kernel's state has a lock of its own (a write, a
/// read and a poll's check-and-sleep are each atomic); every waiting
/// thread has a doorbell a write to a pipe it waits on rings.
#[derive(Default)]
struct Pipes {
    kernel: Mutex<Kernel>,
}

impl Pipes {
    fn write(&self, pipe: PipeId, value: u32) {
        let mut kernel = lock(&self.kernel);
        note(format!("writes {pipe:?}"));
        kernel.data[pipe as usize].push_back(value);
        for (_, pipes, bell) in &kernel.waiting {
            if pipes.contains(&pipe) {
                bell.notify_one();
            }
        }
    }

    /// Reads everything `pipe` holds (non-blocking reads until empty).
    fn take(&self, pipe: PipeId) -> Vec<u32> {
        lock(&self.kernel).data[pipe as usize].drain(..).collect()
    }

    fn is_empty(&self, pipe: PipeId) -> bool {
        lock(&self.kernel).data[pipe as usize].is_empty()
    }

    /// Sleeps until one of `pipes` holds data (`poll` with no timeout):
    /// registers this thread's doorbell on them, then sleeps until one
    /// holds data (a ring with nothing ready is no return). Returns with
    /// the kernel's lock held.
    fn sleep(&self, pipes: &[PipeId]) -> MutexGuard<'_, Kernel> {
        let me = thread::current().id();
        let mut kernel = lock(&self.kernel);
        if pipes.contains(&LeaderWake) {
            assert!(
                !kernel
                    .waiting
                    .iter()
                    .any(|(who, on, _)| *who != me && on.contains(&LeaderWake)),
                "two leaders poll the leader wake pipe"
            );
        }
        let at = match kernel.waiting.iter().position(|(who, _, _)| *who == me) {
            Some(at) => at,
            None => {
                kernel
                    .waiting
                    .push((me, Vec::new(), std::sync::Arc::new(Condvar::new())));
                kernel.waiting.len() - 1
            }
        };
        let bell = kernel.waiting[at].2.clone();
        while pipes
            .iter()
            .all(|&pipe| kernel.data[pipe as usize].is_empty())
        {
            kernel.waiting[at].1 = pipes.to_vec();
            kernel = bell.wait(kernel).unwrap();
        }
        kernel.waiting[at].1.clear();
        kernel
    }

    /// Blocks until `pipe` holds data and reads it all (a blocking read).
    fn recv(&self, pipe: PipeId) -> Vec<u32> {
        self.sleep(&[pipe]).data[pipe as usize].drain(..).collect()
    }
}

impl Poller for Pipes {
    type Fd = PipeId;
    type Pipe = PipeId;

    fn poll(
        &self,
        fds: &[&PipeId],
        deadline: Option<Instant>,
    ) -> Result<Vec<Readiness>, PollFailed> {
        assert_eq!(deadline, None, "no deadline in this model");
        let pipes: Vec<PipeId> = fds.iter().map(|&&pipe| pipe).collect();
        let kernel = self.sleep(&pipes);
        let ready: Vec<Readiness> = pipes
            .iter()
            .map(|&pipe| {
                if kernel.data[pipe as usize].is_empty() {
                    Readiness::Idle
                } else {
                    Readiness::Readable
                }
            })
            .collect();
        drop(kernel);
        note(format!("poll on {pipes:?} returns {ready:?}"));
        Ok(ready)
    }

    fn drain(&self, fd: &PipeId) {
        self.take(*fd);
    }

    fn ring(&self, pipe: &PipeId) {
        self.write(*pipe, 0);
    }
}

/// Everything under the Worker's state lock (the model of its IO state).
struct State {
    watch: Watch,
    /// Requests sent and not yet answered, with their waiter's completer.
    outstanding: Vec<(u32, Completer<u32>)>,
    /// Requests whose reply was read (the completion recorded).
    answered: Vec<u32>,
    /// Results decided under the lock, handed over once it is released.
    handovers: Vec<(Completer<u32>, u32)>,
    /// Whether a result was decided since the lock was last left.
    completed: bool,
    closing: bool,
    /// The IO thread ended: no IO state any more.
    closed: bool,
}

/// What a thread leaving the lock owes (`lead::Owed`).
struct Handovers {
    results: Vec<(Completer<u32>, u32)>,
    recheck: bool,
}

impl Owed for Handovers {
    fn recheck(&self) -> bool {
        self.recheck
    }

    fn hand_over(self) {
        if !self.results.is_empty() {
            note("hands over".into());
        }
        for (completer, value) in self.results {
            completer.complete(value);
        }
    }
}

/// The state lock held (`lead::Locked`).
struct Held<'a> {
    pipes: &'a Pipes,
    state: MutexGuard<'a, State>,
}

impl Locked<Pipes> for Held<'_> {
    type Owed = Handovers;

    fn watch(&self) -> &Watch {
        &self.state.watch
    }

    fn watch_mut(&mut self) -> &mut Watch {
        &mut self.state.watch
    }

    fn live(&self) -> Vec<LinkId> {
        LIVE.to_vec()
    }

    fn pid_at(&self, index: usize) -> Option<Pid> {
        LIVE.iter()
            .find(|link| link.index == index)
            .map(|link| link.pid)
    }

    fn reply_socket(&self, index: usize) -> Option<PipeId> {
        self.pid_at(index).map(|_| Replies)
    }

    fn leader_wake(&self) -> PipeId {
        note("leads".into());
        LeaderWake
    }

    fn leader_wake_write(&self) -> &PipeId {
        &LeaderWake
    }

    fn read_replies(&mut self, _: usize, _: bool) {
        for id in self.pipes.take(Replies) {
            note(format!("reads the reply to {id}"));
            let state = &mut *self.state;
            let at = state
                .outstanding
                .iter()
                .position(|(sent, _)| *sent == id)
                .expect("a reply to a request not outstanding (read twice?)");
            let (_, completer) = state.outstanding.swap_remove(at);
            state.answered.push(id);
            state.handovers.push((completer, answer(id)));
            state.completed = true;
        }
    }

    fn handle_deadlines(&mut self) {}

    fn next_deadline(&self) -> Option<Instant> {
        None
    }

    fn leave(&mut self, settle: bool, leader: bool) -> Handovers {
        note(format!(
            "leaves the lock (settle {settle}, leader {leader})"
        ));
        let left = Left {
            live: LIVE,
            expecting: !self.state.outstanding.is_empty(),
            unsent: &[],
            deadline: None,
            chores: false,
        };
        if settle && self.state.watch.io_must_wake(left) {
            self.pipes.write(IoWake, 0);
        }
        Handovers {
            results: std::mem::take(&mut self.state.handovers),
            recheck: std::mem::take(&mut self.state.completed) && !leader,
        }
    }
}

struct World {
    state: Mutex<State>,
    pipes: Pipes,
    mutation: Option<Mutation>,
}

impl StateLock for World {
    type Poller = Pipes;
    type Owed = Handovers;
    type Locked<'a> = Held<'a>;

    fn poller(&self) -> &Pipes {
        &self.pipes
    }

    fn enter(&self) -> Option<Held<'_>> {
        let held = self.hold();
        (!held.state.closed).then_some(held)
    }

    fn mutation(&self) -> Option<Mutation> {
        self.mutation
    }
}

impl World {
    fn new(mutation: Option<Mutation>) -> Arc<World> {
        Arc::new(World {
            state: Mutex::new(State {
                watch: Watch::default(),
                outstanding: Vec::new(),
                answered: Vec::new(),
                handovers: Vec::new(),
                completed: false,
                closing: false,
                closed: false,
            }),
            pipes: Pipes::default(),
            mutation,
        })
    }

    fn hold(&self) -> Held<'_> {
        Held {
            pipes: &self.pipes,
            state: lock(&self.state),
        }
    }

    /// The IO thread, its run rule's steps 3 to 5: plans its poll under
    /// the lock, releases it and does what it owes (`lead::finish`), polls,
    /// then reads what was ready under the lock.
    fn io_thread(&self) {
        note("is the IO thread".into());
        let mut ready: Vec<Readiness> = Vec::new();
        let mut held = self.hold();
        loop {
            if ready.first().is_some_and(|r| *r != Readiness::Idle) {
                self.pipes.drain(&IoWake);
            }
            if ready.get(1).is_some_and(|r| *r != Readiness::Idle) {
                held.read_replies(0, false);
            }
            if held.state.closing {
                assert!(
                    held.state.handovers.is_empty(),
                    "replies read while closing"
                );
                held.state.closed = true;
                return;
            }
            let expecting = !held.state.outstanding.is_empty();
            let reads = held.state.watch.plan_io(LIVE, expecting, &[], None);
            note(format!("plans (expecting {expecting}) to read {reads:?}"));
            for &link in &reads {
                assert!(
                    !held.state.watch.leader_reads(link),
                    "the IO thread plans to read a pipe the leader reads"
                );
            }
            let owed = Handovers {
                results: std::mem::take(&mut held.state.handovers),
                recheck: std::mem::take(&mut held.state.completed),
            };
            drop(held);
            lead::finish(self, owed);
            let fds: &[&PipeId] = if reads.is_empty() {
                &[&IoWake]
            } else {
                &[&IoWake, &Replies]
            };
            ready = self.pipes.poll(fds, None).unwrap();
            held = self.hold();
        }
    }

    /// A request: its frame goes out under the lock, which the caller
    /// leaves settling or not (`Worker::push`).
    fn send(&self, id: u32, settle: bool) -> Pending<u32> {
        let (completer, pending) = channel();
        let mut held = self.hold();
        held.state.outstanding.push((id, completer));
        note(format!("sends {id}"));
        self.pipes.write(Control, id);
        if settle {
            lead::release(self, held);
        } else {
            let owed = held.leave(false, false);
            drop(held);
            lead::finish(self, owed);
        }
        pending
    }

    /// A caller that does not wait (`submit_async`): it leaves the lock
    /// settling what it leaves.
    fn submit_async(&self, id: u32) -> Pending<u32> {
        self.send(id, true)
    }

    /// A caller that waits for its result (`submit`): it leaves the lock
    /// without settling, then leads when nobody leads (which settles),
    /// else follows.
    fn call(&self, id: u32) -> u32 {
        let pending = self.send(id, false);
        match lead::lead(self, pending, None) {
            Ok(result) => {
                note(format!("led to its result {id}"));
                result.unwrap()
            }
            Err(pending) => {
                note(format!("follows for {id}"));
                pending.wait().unwrap()
            }
        }
    }

    /// Stops the IO thread (the callers are done) and checks that nothing
    /// is left over.
    fn close(&self, io: thread::JoinHandle<()>, target: thread::JoinHandle<()>, sent: &[u32]) {
        lock(&self.state).closing = true;
        self.pipes.write(IoWake, 0);
        io.join().unwrap();
        target.join().unwrap();
        let state = lock(&self.state);
        assert!(state.outstanding.is_empty());
        let mut answered = state.answered.clone();
        answered.sort_unstable();
        assert_eq!(answered, sent);
        assert!(!state.watch.has_leader());
        assert!(self.pipes.is_empty(Replies), "a reply nobody read");
    }
}

/// Starts the IO thread and a target that answers `requests` requests.
fn start(
    requests: usize,
    mutation: Option<Mutation>,
) -> (Arc<World>, thread::JoinHandle<()>, thread::JoinHandle<()>) {
    let world = World::new(mutation);
    let io = {
        let world = world.clone();
        thread::spawn(move || world.io_thread())
    };
    let target = {
        let world = world.clone();
        thread::spawn(move || {
            note("is the target".into());
            let mut answered = 0;
            while answered < requests {
                for id in world.pipes.recv(Control) {
                    world.pipes.write(Replies, id);
                    answered += 1;
                }
            }
        })
    };
    (world, io, target)
}

/// A caller with lead intent and one round trip, the IO thread idle.
fn one_leading_caller(mutation: Option<Mutation>) {
    let (world, io, target) = start(1, mutation);
    assert_eq!(world.call(1), answer(1));
    world.close(io, target, &[1]);
}

/// Two callers with lead intent at once: one leads, one follows.
fn two_leading_callers(mutation: Option<Mutation>) {
    let (world, io, target) = start(2, mutation);
    let other = {
        let world = world.clone();
        thread::spawn(move || world.call(2))
    };
    assert_eq!(world.call(1), answer(1));
    assert_eq!(other.join().unwrap(), answer(2));
    world.close(io, target, &[1, 2]);
}

/// A caller that does not wait, alone.
fn one_async_caller(mutation: Option<Mutation>) {
    let (world, io, target) = start(1, mutation);
    assert_eq!(world.submit_async(1).wait(), Ok(answer(1)));
    world.close(io, target, &[1]);
}

/// A caller that does not wait beside one that leads.
fn async_and_leading_caller(mutation: Option<Mutation>) {
    let (world, io, target) = start(2, mutation);
    let leading = {
        let world = world.clone();
        thread::spawn(move || world.call(2))
    };
    let pending = world.submit_async(1);
    assert_eq!(pending.wait(), Ok(answer(1)));
    assert_eq!(leading.join().unwrap(), answer(2));
    world.close(io, target, &[1, 2]);
}

/// One caller leading twice in a row.
fn leading_twice(mutation: Option<Mutation>) {
    let (world, io, target) = start(2, mutation);
    assert_eq!(world.call(1), answer(1));
    assert_eq!(world.call(2), answer(2));
    world.close(io, target, &[1, 2]);
}

#[test]
fn one_leading_caller_gets_its_reply() {
    model(|| one_leading_caller(None));
}

#[test]
fn of_two_leading_callers_one_leads_and_both_complete() {
    model_bounded(Some(2), || two_leading_callers(None));
}

#[test]
fn an_async_caller_alone_completes() {
    model(|| one_async_caller(None));
}

#[test]
fn an_async_caller_beside_a_leader_completes() {
    model_bounded(Some(2), || async_and_leading_caller(None));
}

#[test]
fn a_caller_leads_twice_in_a_row() {
    model(|| leading_twice(None));
}

// The mutations: each must strand a caller, which loom reports as a
// deadlock. Loom does not always unwind cleanly out of a deadlock (it may
// abort while the model's loom objects drop), so each mutation runs in a
// child process of this test binary and the parent reads its report.

const MUTATION: &str = "CALLREG_LOOM_LEAD_MUTATION";

/// A scenario, run with the rule or with a mutation.
type Scenario = fn(Option<Mutation>);

/// The library's known bugs, each with a scenario in which it strands a
/// caller.
const MUTATIONS: [(Mutation, Scenario); 4] = [
    (Mutation::NoWakeAtStepDown, two_leading_callers),
    (Mutation::WakeLeaderBeforeHandOver, one_leading_caller),
    (Mutation::NeverWakeLeader, one_leading_caller),
    (Mutation::NoWakeAtRelease, one_async_caller),
];

#[test]
fn every_mutation_strands_a_caller() {
    if let Ok(name) = std::env::var(MUTATION) {
        let (mutation, scenario) = MUTATIONS
            .into_iter()
            .find(|(mutation, _)| format!("{mutation:?}") == name)
            .unwrap_or_else(|| panic!("no mutation {name:?}"));
        model(move || scenario(Some(mutation)));
        // Not stranded in any interleaving: the child passes, the parent
        // fails.
        return;
    }
    for (mutation, _) in MUTATIONS {
        let name = format!("{mutation:?}");
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "every_mutation_strands_a_caller",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(MUTATION, &name)
            .output()
            .unwrap();
        let report = String::from_utf8_lossy(&child.stderr);
        assert!(!child.status.success(), "{name}: nobody stranded");
        assert!(report.contains("deadlock; threads"), "{name}: {report}");
    }
}
