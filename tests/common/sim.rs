//! An in-memory driver for the real protocol state machines: one
//! [`Parent`], its [`Target`]s, per-target FIFO queues of frames and
//! replies, simulated time, and fault injection (error replies, corrupt
//! payloads, crashes, passed deadlines). Every step drains every effect and
//! checks every invariant predicate.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use callreg::descriptor::Digest;
use callreg::error::{Error, ErrorCode};
use callreg::protocol::invariants::{self, View, Violation};
use callreg::protocol::{
    Completion, ControlFrame, Effect, Failure, Handle, Namespace, OpId, OwnerToken, Parent,
    ParentConfig, Reply, Seq, Slot, StagingId, Target, TargetConfig, TargetEffect, TargetId,
    TargetOutcome, TaskEnd, Time,
};

/// The parent configuration the scenario tests start from: 1 ms control
/// timeout, 10 ms operation bound (in model microseconds), owner
/// `0x5eed`, 64 slots, probe-first and replacements off.
pub fn parent_config(targets: u16, fence_on_timeout: bool) -> ParentConfig {
    ParentConfig {
        targets,
        control_timeout: 1_000,
        operation_timeout: 10_000,
        fence_on_timeout,
        owner: OwnerToken(0x5eed),
        slot_capacity: 64,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
    }
}

/// The test digest number `n` (distinct per `n`).
pub fn digest(n: u8) -> Digest {
    let mut bytes = [0u8; 32];
    bytes[0] = n;
    bytes[31] = 0xa5;
    Digest(bytes)
}

/// Every effect `p` has queued, in order.
pub fn drain(p: &mut Parent) -> Vec<Effect> {
    std::iter::from_fn(|| p.poll_effect()).collect()
}

/// Registers digest `n` at `now` and has `targets` confirm it: the
/// published handle (panics unless it is published).
#[allow(dead_code)]
pub fn registered(p: &mut Parent, n: u8, targets: &[u16], now: u64) -> Handle {
    let op = p
        .register(digest(n), Namespace::LocalPython, Time(now))
        .unwrap();
    drain(p);
    for t in targets {
        p.handle_reply(TargetId(*t), ok(op.0, n), Time(now))
            .unwrap();
    }
    let effects = drain(p);
    match effects.last() {
        Some(Effect::Completed {
            result: Ok(Completion::Registered(handle)),
            ..
        }) => *handle,
        other => panic!("{other:?}"),
    }
}

/// An OK reply to control `seq` about digest `n`.
pub fn ok(seq: u64, n: u8) -> Reply {
    Reply {
        seq: Seq(seq),
        digest: digest(n),
        result: Ok(()),
    }
}

/// The effect of sending `frame` to target `t`.
pub fn send(t: u16, frame: ControlFrame) -> Effect {
    Effect::Send {
        target: TargetId(t),
        frame,
    }
}

/// One finished operation as the parent reported it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completed {
    pub op: OpId,
    pub result: Result<Completion, Error>,
    pub outcomes: Vec<(TargetId, TargetOutcome)>,
}

/// The whole simulated system.
#[derive(Clone, Debug)]
pub struct Sim {
    pub parent: Parent,
    /// `None` once crashed or fenced.
    pub targets: Vec<Option<Target>>,
    /// Frames in transit to each target, FIFO.
    pub frames: Vec<VecDeque<ControlFrame>>,
    /// Replies in transit from each target, FIFO.
    pub replies: Vec<VecDeque<Reply>>,
    /// Deserializations each target asked for, oldest first.
    pub deserializing: Vec<VecDeque<Seq>>,
    /// Runs in progress on each target (task seqs), oldest first.
    pub running: Vec<VecDeque<Seq>>,
    /// Staged payloads: id -> the digest of the staged bytes.
    pub staged: BTreeMap<StagingId, Digest>,
    /// Staged payloads that were ever released.
    pub released: BTreeSet<StagingId>,
    /// Crashed targets the parent has not been told about yet.
    pub unnoticed: BTreeSet<TargetId>,
    /// Targets fenced by the parent.
    pub fenced: BTreeSet<TargetId>,
    /// Operations started and not yet completed.
    pub open_ops: BTreeSet<OpId>,
    /// Every completion, in order.
    pub completed: Vec<Completed>,
    /// Task seq -> the handle it was submitted for.
    pub tasks: BTreeMap<Seq, Handle>,
    /// Operation -> the targets its frames were sent to (its scope).
    pub scopes: BTreeMap<OpId, BTreeSet<TargetId>>,
    /// Digests uncertain after the last settle (to record heals).
    pub uncertain: BTreeSet<Digest>,
    /// Digests that were uncertain and became certain again
    /// (`specs/protocol.md` §2.4, "Uncertainty heals"): invariant 2 then
    /// checks, once quiescent, that every live target agrees on them.
    pub healed: BTreeSet<Digest>,
    /// Replacements the parent asked for and not yet started: target ->
    /// incarnation.
    pub spawning: BTreeMap<TargetId, u32>,
    /// Every join report (`Joined`, `JoinFailed`, `Abandoned`), in order.
    pub joins: Vec<Effect>,
    /// How each task ended (`Effect::TaskDone`), by seq: at most once.
    pub task_ends: BTreeMap<Seq, TaskEnd>,
    pub now: Time,
}

/// How a started [`Sim`] is set up ([`Sim::setup`]): its number of
/// targets, whether the parent fences on timeout, the slots per target,
/// the digests (by number) registered before start and the parent's
/// probe-first policy. Unless set: fencing off, 64 slots, nothing before
/// start, probe-first off.
#[derive(Clone, Copy, Debug)]
pub struct SimSetup<'a> {
    targets: u16,
    fence_on_timeout: bool,
    slot_capacity: u16,
    before_start: &'a [u8],
    probe_first: bool,
}

impl<'a> SimSetup<'a> {
    /// Whether the parent fences a target whose deadline passed.
    pub fn fence_on_timeout(mut self, on: bool) -> Self {
        self.fence_on_timeout = on;
        self
    }

    /// Slots per target.
    pub fn slot_capacity(mut self, slots: u16) -> Self {
        self.slot_capacity = slots;
        self
    }

    /// Digests (by number) registered before start: the targets hold
    /// them as their startup snapshot.
    pub fn before_start(mut self, digests: &'a [u8]) -> Self {
        self.before_start = digests;
        self
    }

    /// The parent's probe-first policy.
    pub fn probe_first(mut self, on: bool) -> Self {
        self.probe_first = on;
        self
    }

    /// The started system.
    pub fn build(self) -> Sim {
        let SimSetup {
            targets,
            fence_on_timeout,
            slot_capacity,
            before_start,
            probe_first,
        } = self;
        let config = ParentConfig {
            targets,
            control_timeout: 1_000,
            operation_timeout: 10_000,
            fence_on_timeout,
            owner: OwnerToken(0x5eed),
            slot_capacity,
            probe_first,
            respawn_limit: 0,
            respawn_backoff: 0,
            unbounded_spawn: false,
            max_tasks_per_target: 0,
        };
        Sim::with_config(config, before_start)
    }
}

impl Sim {
    /// The setup of a started system of `targets` targets (see
    /// [`SimSetup`] for what else can be set).
    pub fn setup<'a>(targets: u16) -> SimSetup<'a> {
        SimSetup {
            targets,
            fence_on_timeout: false,
            slot_capacity: callreg::protocol::DEFAULT_SLOT_CAPACITY,
            before_start: &[],
            probe_first: false,
        }
    }

    /// A system whose parent has `config`, with `before_start` registered
    /// before start (the targets hold that startup snapshot).
    pub fn with_config(config: ParentConfig, before_start: &[u8]) -> Sim {
        let (targets, slot_capacity) = (config.targets, config.slot_capacity);
        let mut parent = Parent::new(config);
        for n in before_start {
            parent
                .register_before_start(digest(*n), Namespace::LocalPython)
                .expect("pre-start register");
        }
        let snapshot = parent.startup_snapshot();
        parent.start().expect("start");
        let n = usize::from(targets);
        let targets = (0..targets)
            .map(|i| {
                let config = TargetConfig {
                    id: TargetId(i),
                    slot_capacity,
                };
                Some(Target::new(config, &snapshot).expect("snapshot fits"))
            })
            .collect();
        Sim {
            parent,
            targets,
            frames: vec![VecDeque::new(); n],
            replies: vec![VecDeque::new(); n],
            deserializing: vec![VecDeque::new(); n],
            running: vec![VecDeque::new(); n],
            staged: BTreeMap::new(),
            released: BTreeSet::new(),
            unnoticed: BTreeSet::new(),
            fenced: BTreeSet::new(),
            open_ops: BTreeSet::new(),
            completed: Vec::new(),
            tasks: BTreeMap::new(),
            scopes: BTreeMap::new(),
            uncertain: BTreeSet::new(),
            healed: BTreeSet::new(),
            spawning: BTreeMap::new(),
            joins: Vec::new(),
            task_ends: BTreeMap::new(),
            now: Time(0),
        }
    }

    pub fn target(&self, t: u16) -> Option<&Target> {
        self.targets[usize::from(t)].as_ref()
    }

    /// Every live handle the parent holds.
    pub fn live_handles(&self) -> Vec<Handle> {
        self.parent.live_handles()
    }

    /// Starts a register of digest number `n`.
    pub fn register(&mut self, n: u8) -> Result<OpId, Error> {
        let r = self
            .parent
            .register(digest(n), Namespace::LocalPython, self.now);
        if let Ok(op) = r {
            self.open_ops.insert(op);
        }
        self.settle();
        r
    }

    /// Starts an unregister of `handle`.
    pub fn unregister(&mut self, handle: &Handle) -> Result<OpId, Error> {
        let r = self.parent.unregister(handle, self.now);
        if let Ok(op) = r {
            self.open_ops.insert(op);
        }
        self.settle();
        r
    }

    /// Submits a task for `handle` to target `t`.
    pub fn submit(&mut self, handle: &Handle, t: u16) -> Result<Seq, Error> {
        let r = self.parent.submit(handle, TargetId(t));
        if let Ok(seq) = r {
            self.tasks.insert(seq, *handle);
        }
        self.settle();
        r
    }

    /// Target `t` applies its next frame; a register sees a payload whose
    /// digest is `corrupt_to` instead of the staged one when given.
    /// Returns whether there was a frame.
    pub fn deliver_frame(&mut self, t: u16, corrupt_to: Option<Digest>) -> bool {
        let i = usize::from(t);
        let Some(frame) = self.frames[i].pop_front() else {
            return false;
        };
        let Some(target) = self.targets[i].as_mut() else {
            return true;
        };
        match frame {
            ControlFrame::Register {
                seq,
                digest,
                staging,
            } => {
                let verified = match self.staged.get(&staging) {
                    Some(content) => Ok(corrupt_to.unwrap_or(*content)),
                    None => Err(Failure::new(ErrorCode::IO_FAILED, "staged payload is gone")),
                };
                target.on_register(seq, digest, verified);
            }
            ControlFrame::Unregister { seq, digest } => target.on_unregister(seq, digest),
            ControlFrame::Cancel { seq, digest } => target.on_cancel(seq, digest),
            ControlFrame::Task { seq, digest } => match target.begin_task(seq, digest) {
                Ok(_slot) => self.running[i].push_back(seq),
                Err(e) => {
                    // Invariant 8 checked directly at delivery.
                    let handle = self.tasks.get(&seq).copied();
                    let live = handle.is_some_and(|h| {
                        self.parent.live_handles().contains(&h)
                            && !self.parent.is_uncertain(h.digest())
                    });
                    assert!(!live, "invariant 8: task {seq:?} for live handle {handle:?} reached {t} lacking it: {e}");
                    assert_eq!(e.code, ErrorCode::DIGEST_NOT_INSTALLED);
                    // The target answers the task with that failure.
                    self.send_result(t, seq);
                }
            },
        }
        self.settle();
        true
    }

    /// Target `t` applies its next frame, but a register cannot open its
    /// staged payload (`IO_FAILED`). Returns whether there was a frame.
    pub fn deliver_frame_failing(&mut self, t: u16) -> bool {
        let i = usize::from(t);
        match (self.frames[i].front().cloned(), self.targets[i].as_mut()) {
            (Some(ControlFrame::Register { seq, digest, .. }), Some(target)) => {
                self.frames[i].pop_front();
                let failure = Failure::new(ErrorCode::IO_FAILED, "cannot map the staged payload");
                target.on_register(seq, digest, Err(failure));
                self.settle();
                true
            }
            _ => self.deliver_frame(t, None),
        }
    }

    /// The parent receives target `t`'s next reply.
    pub fn deliver_reply(&mut self, t: u16) -> bool {
        let i = usize::from(t);
        let Some(reply) = self.replies[i].pop_front() else {
            return false;
        };
        self.parent
            .handle_reply(TargetId(t), reply, self.now)
            .expect("reply accepted");
        self.settle();
        true
    }

    /// Target `t` finishes its oldest deserialization, with `failure` or OK.
    pub fn finish_deserialize(&mut self, t: u16, failure: Option<Failure>) -> bool {
        let i = usize::from(t);
        let Some(seq) = self.deserializing[i].pop_front() else {
            return false;
        };
        if let Some(target) = self.targets[i].as_mut() {
            let result = failure.map_or(Ok(()), Err);
            target
                .on_deserialized(seq, result)
                .expect("deserialization in progress");
        }
        self.settle();
        true
    }

    /// Target `t` finishes its oldest run.
    pub fn end_run(&mut self, t: u16) -> bool {
        let i = usize::from(t);
        let Some(seq) = self.running[i].pop_front() else {
            return false;
        };
        if let Some(target) = self.targets[i].as_mut() {
            let run = target.start_task(seq).expect("run in progress");
            target.end_task(seq).expect("run in progress");
            if run {
                // Its start report, then its result (§2.12).
                let id = TargetId(t);
                let incarnation = self.parent.incarnation(id);
                self.parent
                    .handle_task_started(id, incarnation, seq, self.now)
                    .expect("a start report of a task the parent sent");
                self.send_result(t, seq);
            }
        }
        self.settle();
        true
    }

    /// Target `t`'s result for task `seq` reaches the parent at once (a
    /// result or a failure alike: the machine only ends the task).
    fn send_result(&mut self, t: u16, seq: Seq) {
        let Some(handle) = self.tasks.get(&seq).copied() else {
            return;
        };
        let target = TargetId(t);
        let incarnation = self.parent.incarnation(target);
        let accepted = self
            .parent
            .handle_task_result(target, incarnation, seq, handle.digest(), Time(0))
            .expect("a result of a task the parent sent");
        assert!(accepted, "the result of {seq} on {target} was refused");
    }

    /// Target `t` dies; the parent hears of it with [`Sim::notice`].
    pub fn crash(&mut self, t: u16) {
        let i = usize::from(t);
        if self.targets[i].take().is_some() {
            self.unnoticed.insert(TargetId(t));
        }
        self.frames[i].clear();
        self.replies[i].clear();
        self.deserializing[i].clear();
        self.running[i].clear();
        self.settle();
    }

    /// The parent learns that crashed target `t` is lost.
    pub fn notice(&mut self, t: u16) -> bool {
        if !self.unnoticed.remove(&TargetId(t)) {
            return false;
        }
        let incarnation = self.parent.incarnation(TargetId(t));
        self.parent
            .target_lost(TargetId(t), self.now)
            .expect("target_lost");
        // Read to its end: what it never reported started never ran
        // (§2.15).
        self.parent.process_drained(TargetId(t), incarnation, true);
        self.settle();
        true
    }

    /// Starts the replacement the parent asked for target `t`: a fresh
    /// target holding nothing, with empty queues. Returns `false` if none
    /// was asked for.
    pub fn spawn(&mut self, t: u16) -> bool {
        let Some(incarnation) = self.spawning.remove(&TargetId(t)) else {
            return false;
        };
        let i = usize::from(t);
        self.targets[i] =
            Some(Target::new(TargetConfig::new(TargetId(t)), &[]).expect("an empty target"));
        self.frames[i].clear();
        self.replies[i].clear();
        self.deserializing[i].clear();
        self.running[i].clear();
        self.fenced.remove(&TargetId(t));
        self.parent
            .target_spawned(TargetId(t), incarnation, self.now)
            .expect("target_spawned");
        self.settle();
        true
    }

    /// Time moves on by `micros`; passed deadlines are applied.
    pub fn advance(&mut self, micros: u64) {
        self.now = Time(self.now.0 + micros);
        if self.parent.poll_timeout().is_some_and(|d| d <= self.now) {
            self.parent.handle_timeout(self.now);
        }
        self.settle();
    }

    /// Drains every effect of every machine into the queues.
    pub fn settle(&mut self) {
        loop {
            let mut moved = false;
            while let Some(effect) = self.parent.poll_effect() {
                moved = true;
                self.apply_parent_effect(effect);
            }
            for i in 0..self.targets.len() {
                let Some(target) = self.targets[i].as_mut() else {
                    continue;
                };
                while let Some(effect) = target.poll_effect() {
                    moved = true;
                    match effect {
                        TargetEffect::Reply(reply) => self.replies[i].push_back(reply),
                        TargetEffect::Deserialize {
                            seq, slot: Slot(_), ..
                        } => self.deserializing[i].push_back(seq),
                    }
                }
            }
            if !moved {
                break;
            }
        }
        let now: BTreeSet<Digest> = self.parent.uncertain_digests().into_iter().collect();
        self.healed.extend(self.uncertain.difference(&now));
        self.uncertain = now;
    }

    fn apply_parent_effect(&mut self, effect: Effect) {
        match effect {
            Effect::TaskDone { seq, end, .. } => {
                assert!(
                    self.task_ends.insert(seq, end).is_none(),
                    "task {seq} ended twice"
                );
            }
            // The scenarios never inspect.
            Effect::CancelRefused { .. } | Effect::Inspect { .. } | Effect::InspectDone { .. } => {}
            Effect::Stage { staging, digest } | Effect::Restage { staging, digest } => {
                assert!(
                    self.staged.insert(staging, digest).is_none(),
                    "staged twice"
                );
            }
            Effect::Send { target, frame } => {
                if let ControlFrame::Register { seq, .. } | ControlFrame::Unregister { seq, .. } =
                    frame
                {
                    if self.open_ops.contains(&OpId(seq.0)) {
                        self.scopes.entry(OpId(seq.0)).or_default().insert(target);
                    }
                }
                let i = usize::from(target.0);
                if self.targets[i].is_some() {
                    self.frames[i].push_back(frame);
                }
            }
            // A hint; it names a payload still staged, of its digest.
            Effect::Verify {
                staging, digest, ..
            } => {
                assert_eq!(
                    self.staged.get(&staging),
                    Some(&digest),
                    "a verify hint for a payload not staged"
                );
            }
            Effect::ReleaseStaged { staging } => {
                assert!(
                    self.staged.remove(&staging).is_some(),
                    "released twice or never staged"
                );
                self.released.insert(staging);
            }
            Effect::Retire { .. } => panic!("no scenario bounds the tasks per target"),
            Effect::Fence { target, .. } => {
                let i = usize::from(target.0);
                self.fenced.insert(target);
                self.targets[i] = None;
                self.unnoticed.remove(&target);
                self.frames[i].clear();
                self.replies[i].clear();
                self.deserializing[i].clear();
                self.running[i].clear();
                // Killed and read to its end (its start reports reached
                // the parent as it sent them): what it never reported
                // started is handed over (§2.15).
                for incarnation in self.parent.in_doubt_processes(target) {
                    self.parent.process_drained(target, incarnation, true);
                }
            }
            Effect::Spawn {
                target,
                incarnation,
            } => {
                assert!(
                    self.spawning.insert(target, incarnation).is_none(),
                    "spawned twice"
                );
            }
            Effect::Joined { .. } | Effect::JoinFailed { .. } | Effect::Abandoned { .. } => {
                self.joins.push(effect);
            }
            Effect::Completed {
                op,
                result,
                outcomes,
            } => {
                assert!(
                    self.open_ops.remove(&op),
                    "{op:?} completed twice or never started"
                );
                self.completed.push(Completed {
                    op,
                    result,
                    outcomes,
                });
            }
        }
    }

    /// Calls `f` with the view the invariant predicates read.
    pub fn with_view<R>(&self, f: impl FnOnce(&View<'_>) -> R) -> R {
        let targets: Vec<Option<&Target>> = self.targets.iter().map(Option::as_ref).collect();
        let frames: Vec<(TargetId, &ControlFrame)> = self
            .frames
            .iter()
            .enumerate()
            .flat_map(|(i, q)| q.iter().map(move |f| (TargetId(i as u16), f)))
            .collect();
        let replies: Vec<(TargetId, &Reply)> = self
            .replies
            .iter()
            .enumerate()
            .flat_map(|(i, q)| q.iter().map(move |r| (TargetId(i as u16), r)))
            .collect();
        f(&View {
            parent: &self.parent,
            targets: &targets,
            frames: &frames,
            replies: &replies,
        })
    }

    /// Checks every invariant predicate, and the driver's own records.
    pub fn check(&self) -> Result<(), Violation> {
        self.with_view(invariants::check_all)?;
        // The sim's own record of staged payloads matches the parent's.
        assert_eq!(
            self.staged.keys().copied().collect::<Vec<_>>(),
            self.parent.staged(),
            "staged payloads disagree"
        );
        Ok(())
    }

    /// Whether the whole system is quiescent.
    pub fn is_quiescent(&self) -> bool {
        self.with_view(|view| view.is_quiescent())
    }

    /// Delivers everything (deserializations succeed, runs end, crashed
    /// targets are noticed) until nothing moves, checking the invariants
    /// after each step. Time does not move.
    pub fn run_to_quiet(&mut self) -> Result<(), Violation> {
        loop {
            let mut moved = false;
            for t in 0..self.targets.len() as u16 {
                while self.deliver_frame(t, None) {
                    moved = true;
                    self.check()?;
                }
                while self.finish_deserialize(t, None) {
                    moved = true;
                    self.check()?;
                }
                while self.deliver_reply(t) {
                    moved = true;
                    self.check()?;
                }
                while self.end_run(t) {
                    moved = true;
                    self.check()?;
                }
                if self.notice(t) {
                    moved = true;
                    self.check()?;
                }
            }
            if !moved {
                return Ok(());
            }
        }
    }

    /// The completion of `op`, if it completed.
    pub fn completion(&self, op: OpId) -> Option<&Completed> {
        self.completed.iter().find(|c| c.op == op)
    }

    /// The handle a completed register published.
    pub fn registered(&self, op: OpId) -> Handle {
        match self.completion(op).map(|c| &c.result) {
            Some(Ok(Completion::Registered(h))) => *h,
            other => panic!("{op:?} did not register: {other:?}"),
        }
    }

    /// Registers digest `n` and runs to quiet; returns the handle.
    pub fn register_ok(&mut self, n: u8) -> Handle {
        let op = self.register(n).expect("register accepted");
        self.run_to_quiet().expect("invariants hold");
        self.registered(op)
    }
}

impl Sim {
    /// Like [`Sim::run_to_quiet`] but leaves every run in progress.
    pub fn run_to_quiet_without_runs(&mut self) {
        loop {
            let mut moved = false;
            for t in 0..self.targets.len() as u16 {
                moved |= self.deliver_frame(t, None);
                moved |= self.finish_deserialize(t, None);
                moved |= self.deliver_reply(t);
                moved |= self.notice(t);
                self.check().expect("invariants hold");
            }
            if !moved {
                return;
            }
        }
    }
}

#[cfg(feature = "mutants")]
impl Sim {
    /// Switches `mutant` on in the machine it belongs to (the parent, or
    /// every target).
    pub fn with_mutant(mut self, mutant: callreg::protocol::Mutant) -> Sim {
        use callreg::protocol::Mutant;
        match mutant {
            Mutant::SkipDigestVerification | Mutant::FreeSlotHeldByRun => {
                for entry in self.targets.iter_mut() {
                    *entry = entry.take().map(|t| t.with_mutant(mutant));
                }
            }
            _ => self.parent = self.parent.clone().with_mutant(mutant),
        }
        self
    }
}
