//! Loom model of the leader/followers hand-off of the parent's reply
//! pipes (`callreg::io::lead`): the real `Watch` under one state lock,
//! driven by every thread of the protocol: the IO thread, a target, callers
//! that wait for their result (and lead when nobody leads) and a caller
//! that does not wait. It checks that no waiting caller is stranded (every
//! reply is read by someone, every waiter completes: loom reports a
//! deadlock otherwise), that at most one leader leads, and that the IO
//! thread never plans to read a reply socket the leader reads.
//!
//! `poll` is modelled over level-triggered pipes: a poll registers its
//! thread's doorbell on every pipe of its set and returns when any of them
//! holds data, else sleeps until a write to one of them rings the doorbell
//! and checks again. The pipes' state is the kernel's, with a lock of its
//! own (a write, a read, a poll's check-and-sleep are each atomic, so no
//! ring is lost); the parent's threads consume pipe data under the state
//! lock. The target is a thread that answers each request on its control
//! socket with a reply on its reply socket.
//!
//! The reader of a reply records the result under the state lock but
//! hands it over after leaving the lock; a caller tells that its result is
//! there by its hand-off. So a thread that read replies while not leading
//! (the IO thread) hands them over first and then, under the lock again,
//! wakes the leader if one leads (`Shared::finish` in the Worker): a
//! leader that began before that check is woken and finds its hand-off
//! complete; one that began after it finds its hand-off complete before
//! its first poll. `every_mutation_strands_a_caller` shows loom finding
//! the stranded caller when the IO thread wakes the leader under the lock
//! before handing over (the leader wakes, finds its hand-off incomplete
//! and polls again for a reply already read), or not at all, or when a
//! leader steps down or a caller that does not wait leaves without the
//! wake the protocol asks for. A failing interleaving's trace (what each
//! thread did, in order) is printed with the failure.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test --features io
//! --test loom_lead --release`. Without `--cfg loom` this file is empty.
#![cfg(all(loom, feature = "io"))]

use callreg::io::handoff::{channel, Completer, Pending};
use callreg::io::lead::{Left, Watch};
use loom::sync::{Condvar, Mutex, MutexGuard};
use loom::thread;
use std::collections::VecDeque;
// The world is shared by a std `Arc`: its reference count is not what is
// checked here, and loom's would add a scheduling point to every clone.
use std::sync::Arc;

/// The one target: index 0, process 100.
const LIVE: &[(usize, i32)] = &[(0, 100)];

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
    TRACE.with(|trace| trace.borrow_mut().push(what));
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

/// The pipes (the targets' reply sockets and control sockets, the wake
/// pipes), as the kernel keeps them.
#[derive(Clone, Copy, PartialEq, Debug)]
enum PipeId {
    /// The target's control socket.
    Control,
    /// The target's reply socket.
    Replies,
    /// The IO thread's wake pipe.
    IoWake,
    /// The leader-wake pipe.
    LeaderWake,
}

use PipeId::{Control, IoWake, LeaderWake, Replies};

const PIPES: usize = 4;

/// The threads that poll, each with its doorbell: the IO thread, the
/// callers (a waiting caller polls as its request's id, 1 or 2) and the
/// target.
const IO_POLLER: usize = 0;
const TARGET_POLLER: usize = 3;
const POLLERS: usize = 4;

#[derive(Default)]
struct Kernel {
    /// What each pipe holds.
    data: [VecDeque<u32>; PIPES],
    /// Per poller: the pipes its current `poll` waits on.
    polling: [Vec<PipeId>; POLLERS],
}

/// Level-triggered pipes. The kernel's state has a lock of its own (a
/// write, a read and a poll's check-and-sleep are each atomic); every
/// poller has a doorbell a write to a pipe it polls rings.
#[derive(Default)]
struct Pipes {
    kernel: Mutex<Kernel>,
    bells: [Condvar; POLLERS],
}

impl Pipes {
    fn write(&self, pipe: PipeId, value: u32) {
        let mut kernel = lock(&self.kernel);
        kernel.data[pipe as usize].push_back(value);
        for (poller, polled) in kernel.polling.iter().enumerate() {
            if polled.contains(&pipe) {
                self.bells[poller].notify_one();
            }
        }
    }

    /// Empties the wake pipe `wake` and, when `replies`, reads everything
    /// the reply socket holds (two non-blocking reads; one step, for a
    /// smaller state space: a write between them changes nothing).
    fn read(&self, wake: PipeId, replies: bool) -> Vec<u32> {
        let mut kernel = lock(&self.kernel);
        kernel.data[wake as usize].clear();
        if replies {
            kernel.data[Replies as usize].drain(..).collect()
        } else {
            Vec::new()
        }
    }

    fn is_empty(&self, pipe: PipeId) -> bool {
        lock(&self.kernel).data[pipe as usize].is_empty()
    }

    /// Returns when any of `pipes` holds data (`poll` with no timeout):
    /// registers `poller`'s doorbell on them, then sleeps until one holds
    /// data (a ring with nothing ready is no return).
    fn poll(&self, poller: usize, pipes: &[PipeId]) {
        let mut kernel = lock(&self.kernel);
        while pipes
            .iter()
            .all(|&pipe| kernel.data[pipe as usize].is_empty())
        {
            kernel.polling[poller] = pipes.to_vec();
            kernel = self.bells[poller].wait(kernel).unwrap();
        }
        kernel.polling[poller].clear();
    }

    /// Blocks until `pipe` holds data and reads it all (a blocking read).
    fn recv(&self, poller: usize, pipe: PipeId) -> Vec<u32> {
        let mut kernel = lock(&self.kernel);
        while kernel.data[pipe as usize].is_empty() {
            kernel.polling[poller] = vec![pipe];
            kernel = self.bells[poller].wait(kernel).unwrap();
        }
        kernel.polling[poller].clear();
        kernel.data[pipe as usize].drain(..).collect()
    }
}

/// Everything under the Worker's state lock.
struct State {
    watch: Watch,
    /// Requests sent and not yet answered, with their waiter's completer.
    outstanding: Vec<(u32, Completer<u32>)>,
    /// Requests whose reply was read (the completion recorded).
    answered: Vec<u32>,
    /// Threads that believe they lead.
    leaders: usize,
    closing: bool,
}

impl State {
    fn left(&self) -> Left<'static> {
        Left {
            live: LIVE,
            expecting: !self.outstanding.is_empty(),
            unsent: &[],
            deadline: None,
            chores: false,
        }
    }

    /// Records the reply to `id`; its hand-off runs after the lock is left.
    fn complete(&mut self, id: u32, handovers: &mut Vec<(Completer<u32>, u32)>) {
        let at = self
            .outstanding
            .iter()
            .position(|(sent, _)| *sent == id)
            .expect("a reply to a request not outstanding (read twice?)");
        let (_, completer) = self.outstanding.swap_remove(at);
        self.answered.push(id);
        handovers.push((completer, answer(id)));
    }
}

fn hand_over(handovers: Vec<(Completer<u32>, u32)>) {
    for (completer, value) in handovers {
        completer.complete(value);
    }
}

/// When the IO thread, having read replies, wakes the leader.
#[derive(Clone, Copy, PartialEq)]
enum LeaderWakeUp {
    /// After handing the results over, under the lock again, if a leader
    /// leads (the protocol).
    AfterHandOver,
    /// Under the lock, before handing over, if a leader leads (a mutation).
    BeforeHandOver,
    /// Never (a mutation).
    Never,
}

/// How the threads follow the protocol (the correct one, or a mutation).
#[derive(Clone, Copy)]
struct Rules {
    /// A leader that steps down checks `io_must_wake` (the mutation: not).
    wake_at_step_down: bool,
    io_wakes_leader: LeaderWakeUp,
    /// A caller that does not wait checks `io_must_wake` (the mutation:
    /// not).
    wake_after_async_send: bool,
}

const RULES: Rules = Rules {
    wake_at_step_down: true,
    io_wakes_leader: LeaderWakeUp::AfterHandOver,
    wake_after_async_send: true,
};

struct World {
    state: Mutex<State>,
    pipes: Pipes,
    rules: Rules,
}

impl World {
    fn new(rules: Rules) -> Arc<World> {
        Arc::new(World {
            state: Mutex::new(State {
                watch: Watch::default(),
                outstanding: Vec::new(),
                answered: Vec::new(),
                leaders: 0,
                closing: false,
            }),
            pipes: Pipes::default(),
            rules,
        })
    }

    /// The IO thread: reads the reply sockets it polled, plans its next poll
    /// under the lock, hands results over outside it, polls.
    fn io_thread(&self) {
        let mut reads: Vec<(usize, i32)> = Vec::new();
        loop {
            let mut handovers = Vec::new();
            let mut state = lock(&self.state);
            for id in self.pipes.read(IoWake, !reads.is_empty()) {
                note(format!("io: reads the reply to {id}"));
                state.complete(id, &mut handovers);
            }
            if state.closing {
                assert!(handovers.is_empty(), "replies read while closing");
                return;
            }
            let expecting = !state.outstanding.is_empty();
            reads = state.watch.plan_io(LIVE, expecting, &[], None);
            note(format!(
                "io: plans (expecting {expecting}) to read {reads:?}"
            ));
            for &(index, pid) in &reads {
                assert!(
                    !state.watch.leader_reads(index, pid),
                    "the IO thread plans to read a pipe the leader reads"
                );
            }
            let read = !handovers.is_empty();
            if self.rules.io_wakes_leader == LeaderWakeUp::BeforeHandOver
                && read
                && state.watch.has_leader()
            {
                note("io: writes the leader-wake pipe".into());
                self.pipes.write(LeaderWake, 0);
            }
            drop(state);
            if read {
                note("io: hands over".into());
            }
            hand_over(handovers);
            if self.rules.io_wakes_leader == LeaderWakeUp::AfterHandOver && read {
                let state = lock(&self.state);
                if state.watch.has_leader() {
                    note("io: writes the leader-wake pipe".into());
                    self.pipes.write(LeaderWake, 0);
                }
            }
            if reads.is_empty() {
                self.pipes.poll(IO_POLLER, &[IoWake]);
            } else {
                self.pipes.poll(IO_POLLER, &[IoWake, Replies]);
            }
            note("io: poll returns".into());
        }
    }

    fn send(&self, id: u32) -> (MutexGuard<'_, State>, Pending<u32>) {
        let (completer, pending) = channel();
        let mut state = lock(&self.state);
        state.outstanding.push((id, completer));
        self.pipes.write(Control, id);
        note(format!("caller {id}: sends"));
        (state, pending)
    }

    /// A caller that does not wait (`submit_async`).
    fn submit_async(&self, id: u32) -> Pending<u32> {
        let (state, pending) = self.send(id);
        if self.rules.wake_after_async_send && state.watch.io_must_wake(state.left()) {
            note(format!("caller {id} (async): writes the IO wake pipe"));
            self.pipes.write(IoWake, 0);
        }
        pending
    }

    /// A caller that waits for its result, leading when nobody leads.
    fn call(&self, id: u32) -> u32 {
        assert!(id > IO_POLLER as u32 && id < TARGET_POLLER as u32);
        let rules = self.rules;
        let (state, pending) = self.send(id);
        drop(state);
        if pending.is_complete() {
            note(format!("caller {id}: hand-off complete"));
            return pending.wait().unwrap();
        }
        note(format!("caller {id}: hand-off not complete"));
        let mut state = lock(&self.state);
        if state.watch.io_reads_all(LIVE) || !state.watch.try_lead(LIVE) {
            note(format!("caller {id}: follows"));
            if state.watch.io_must_wake(state.left()) {
                note(format!("caller {id}: writes the IO wake pipe"));
                self.pipes.write(IoWake, 0);
            }
            drop(state);
            return pending.wait().unwrap();
        }
        note(format!("caller {id}: leads"));
        state.leaders += 1;
        assert_eq!(state.leaders, 1, "two leaders");
        drop(state);
        loop {
            // Its hand-off, checked after every section under the lock.
            if pending.is_complete() {
                let mut state = lock(&self.state);
                note(format!("caller {id}: steps down"));
                state.watch.step_down();
                state.leaders -= 1;
                if rules.wake_at_step_down && state.watch.io_must_wake(state.left()) {
                    note(format!("caller {id}: writes the IO wake pipe"));
                    self.pipes.write(IoWake, 0);
                }
                drop(state);
                return pending.wait().unwrap();
            }
            self.pipes.poll(id as usize, &[LeaderWake, Replies]);
            note(format!("caller {id}: poll returns"));
            let mut handovers = Vec::new();
            let mut state = lock(&self.state);
            for reply in self.pipes.read(LeaderWake, true) {
                note(format!("caller {id}: reads the reply to {reply}"));
                state.complete(reply, &mut handovers);
            }
            drop(state);
            hand_over(handovers);
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
        assert_eq!(state.leaders, 0);
        assert!(!state.watch.has_leader());
        assert!(self.pipes.is_empty(Replies), "a reply nobody read");
    }
}

/// Starts the IO thread and a target that answers `requests` requests.
fn start(
    requests: usize,
    rules: Rules,
) -> (Arc<World>, thread::JoinHandle<()>, thread::JoinHandle<()>) {
    let world = World::new(rules);
    let io = {
        let world = world.clone();
        thread::spawn(move || world.io_thread())
    };
    let target = {
        let world = world.clone();
        thread::spawn(move || {
            let mut answered = 0;
            while answered < requests {
                for id in world.pipes.recv(TARGET_POLLER, Control) {
                    note(format!("target: replies to {id}"));
                    world.pipes.write(Replies, id);
                    answered += 1;
                }
            }
        })
    };
    (world, io, target)
}

/// A caller with lead intent and one round trip, the IO thread idle.
fn one_leading_caller(rules: Rules) {
    let (world, io, target) = start(1, rules);
    assert_eq!(world.call(1), answer(1));
    world.close(io, target, &[1]);
}

/// Two callers with lead intent at once: one leads, one follows.
fn two_leading_callers(rules: Rules) {
    let (world, io, target) = start(2, rules);
    let other = {
        let world = world.clone();
        thread::spawn(move || world.call(2))
    };
    assert_eq!(world.call(1), answer(1));
    assert_eq!(other.join().unwrap(), answer(2));
    world.close(io, target, &[1, 2]);
}

/// A caller that does not wait, alone.
fn one_async_caller(rules: Rules) {
    let (world, io, target) = start(1, rules);
    assert_eq!(world.submit_async(1).wait(), Ok(answer(1)));
    world.close(io, target, &[1]);
}

/// A caller that does not wait beside one that leads.
fn async_and_leading_caller(rules: Rules) {
    let (world, io, target) = start(2, rules);
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
fn leading_twice(rules: Rules) {
    let (world, io, target) = start(2, rules);
    assert_eq!(world.call(1), answer(1));
    assert_eq!(world.call(2), answer(2));
    world.close(io, target, &[1, 2]);
}

#[test]
fn one_leading_caller_gets_its_reply() {
    model(|| one_leading_caller(RULES));
}

#[test]
fn of_two_leading_callers_one_leads_and_both_complete() {
    model_bounded(Some(2), || two_leading_callers(RULES));
}

#[test]
fn an_async_caller_alone_completes() {
    model(|| one_async_caller(RULES));
}

#[test]
fn an_async_caller_beside_a_leader_completes() {
    model_bounded(Some(2), || async_and_leading_caller(RULES));
}

#[test]
fn a_caller_leads_twice_in_a_row() {
    model(|| leading_twice(RULES));
}

// The mutations: each must strand a caller, which loom reports as a
// deadlock. Loom does not always unwind cleanly out of a deadlock (it may
// abort while the model's loom objects drop), so each mutation runs in a
// child process of this test binary and the parent reads its report.

const MUTATION: &str = "CALLREG_LOOM_LEAD_MUTATION";

/// A mutation of the protocol and a scenario in which it strands a caller.
fn mutation(name: &str) -> (Rules, fn(Rules)) {
    match name {
        "no-wake-at-step-down" => (
            Rules {
                wake_at_step_down: false,
                ..RULES
            },
            two_leading_callers,
        ),
        "io-wakes-the-leader-before-handing-over" => (
            Rules {
                io_wakes_leader: LeaderWakeUp::BeforeHandOver,
                ..RULES
            },
            one_leading_caller,
        ),
        "io-does-not-wake-the-leader" => (
            Rules {
                io_wakes_leader: LeaderWakeUp::Never,
                ..RULES
            },
            one_leading_caller,
        ),
        "no-wake-after-async-send" => (
            Rules {
                wake_after_async_send: false,
                ..RULES
            },
            one_async_caller,
        ),
        other => panic!("no mutation {other:?}"),
    }
}

#[test]
fn every_mutation_strands_a_caller() {
    if let Ok(name) = std::env::var(MUTATION) {
        let (rules, scenario) = mutation(&name);
        model(move || scenario(rules));
        // Not stranded in any interleaving: the child passes, the parent
        // fails.
        return;
    }
    for name in [
        "no-wake-at-step-down",
        "io-wakes-the-leader-before-handing-over",
        "io-does-not-wake-the-leader",
        "no-wake-after-async-send",
    ] {
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "every_mutation_strands_a_caller",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(MUTATION, name)
            .output()
            .unwrap();
        let report = String::from_utf8_lossy(&child.stderr);
        assert!(!child.status.success(), "{name}: nobody stranded");
        assert!(report.contains("deadlock; threads"), "{name}: {report}");
    }
}
