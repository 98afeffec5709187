//! The pure protocol driven by hand: one parent machine, two target
//! machines, frames and replies moved by this program (no processes, no
//! shared memory, no clock; `specs/protocol.md` §4 is the loop an IO layer
//! runs). It registers a callable before and after start, runs a task,
//! loses a target during a register (rolled back), unregisters, and checks
//! every invariant (`specs/design.md` §4.4) after each step.
//!
//! Run: `cargo run --example protocol_by_hand` (default features).

use std::collections::VecDeque;

use callreg::descriptor::{python_serialized_digest, Digest};
use callreg::envelope::{encode, Envelope};
use callreg::error::ErrorCode;
use callreg::protocol::invariants::{check_all, View};
use callreg::protocol::{
    Completion, ControlFrame, Effect, Namespace, OwnerToken, Parent, ParentConfig, Reply, Seq,
    Target, TargetConfig, TargetEffect, TargetId, TargetOutcome, Time, DEFAULT_SLOT_CAPACITY,
};

/// The machines and what is in transit between them.
struct World {
    parent: Parent,
    /// `None` once a target has died.
    targets: Vec<Option<Target>>,
    /// Control frames per target, in send order (a pipe is FIFO).
    frames: Vec<VecDeque<ControlFrame>>,
    replies: VecDeque<(TargetId, Reply)>,
    /// Task results in transit: (target, task seq, digest).
    results: VecDeque<(TargetId, Seq, Digest)>,
    completed: Vec<Effect>,
    now: Time,
}

impl World {
    /// Carries out the parent's effects: frames are queued, staging is a
    /// no-op here (the envelope stays in this program), completions kept.
    fn drain_parent(&mut self) {
        while let Some(effect) = self.parent.poll_effect() {
            match effect {
                Effect::Send { target, frame } => {
                    self.frames[usize::from(target.0)].push_back(frame)
                }
                Effect::Stage { .. } | Effect::ReleaseStaged { .. } => {}
                // A hint to verify a payload ahead of its register: nothing
                // here is worth doing early.
                Effect::Verify { .. } => {}
                // This example's parent runs without replacement targets
                // (`respawn_limit: 0`), which alone emit these.
                Effect::Restage { .. }
                | Effect::Retire { .. }
                | Effect::Spawn { .. }
                | Effect::Joined { .. }
                | Effect::JoinFailed { .. }
                | Effect::Abandoned { .. } => {}
                Effect::Fence { target, .. } => self.targets[usize::from(target.0)] = None,
                // The machine ends each task once (specs/protocol.md §2.11).
                Effect::TaskDone { seq, end, .. } => {
                    println!("  parent: task {seq} ended: {end:?}")
                }
                // This example neither cancels nor inspects.
                Effect::CancelRefused { .. }
                | Effect::Inspect { .. }
                | Effect::InspectDone { .. } => {}
                completed @ Effect::Completed { .. } => self.completed.push(completed),
            }
        }
    }

    /// Delivers every frame queued for `target` and collects its replies.
    /// The digest of every staged payload verifies (an IO layer recomputes
    /// it from the mapping), and every deserialization succeeds.
    fn deliver(&mut self, target: TargetId) {
        let index = usize::from(target.0);
        while let Some(frame) = self.frames[index].pop_front() {
            let Some(machine) = self.targets[index].as_mut() else {
                continue; // a dead target reads nothing
            };
            match frame {
                ControlFrame::Register { seq, digest, .. } => {
                    machine.on_register(seq, digest, Ok(digest))
                }
                ControlFrame::Unregister { seq, digest } => machine.on_unregister(seq, digest),
                ControlFrame::Cancel { seq, digest } => machine.on_cancel(seq, digest),
                ControlFrame::Task { seq, digest } => {
                    let slot = machine
                        .begin_task(seq, digest)
                        .expect("the digest is installed");
                    // The task thread starts it (a cancel could have come
                    // first), runs it, ends it and sends its result.
                    assert!(machine.start_task(seq).expect("the run was begun"));
                    println!(
                        "  target {}: task {seq} runs in its private slot {}",
                        target.0, slot.0
                    );
                    machine.end_task(seq).expect("the run was begun");
                    self.results.push_back((target, seq, digest));
                }
            }
            while let Some(effect) = machine.poll_effect() {
                match effect {
                    TargetEffect::Deserialize { seq, .. } => {
                        machine
                            .on_deserialized(seq, Ok(()))
                            .expect("a reserved slot");
                    }
                    TargetEffect::Reply(reply) => self.replies.push_back((target, reply)),
                }
            }
            // `on_deserialized` may have queued the reply.
            while let Some(TargetEffect::Reply(reply)) = machine.poll_effect() {
                self.replies.push_back((target, reply));
            }
        }
    }

    /// Gives every reply in transit to the parent.
    fn answer(&mut self) {
        while let Some((target, seq, digest)) = self.results.pop_front() {
            let accepted = self
                .parent
                .handle_task_result(
                    target,
                    self.parent.incarnation(target),
                    seq,
                    digest,
                    self.now,
                )
                .expect("a result of a task the parent sent");
            assert!(accepted, "the task was in flight on that target");
            self.drain_parent();
        }
        while let Some((target, reply)) = self.replies.pop_front() {
            self.parent
                .handle_reply(target, reply, self.now)
                .expect("a reply to a frame the parent sent");
            self.drain_parent();
        }
    }

    /// Delivers everything, then checks invariants 1-9 on the result.
    fn settle(&mut self) {
        for target in 0..self.targets.len() {
            self.deliver(TargetId(target as u16));
        }
        self.answer();
        self.check();
    }

    fn check(&self) {
        let targets: Vec<Option<&Target>> = self.targets.iter().map(Option::as_ref).collect();
        let frames: Vec<(TargetId, &ControlFrame)> = self
            .frames
            .iter()
            .enumerate()
            .flat_map(|(i, queue)| queue.iter().map(move |f| (TargetId(i as u16), f)))
            .collect();
        let replies: Vec<(TargetId, &Reply)> = self.replies.iter().map(|(t, r)| (*t, r)).collect();
        let view = View {
            parent: &self.parent,
            targets: &targets,
            frames: &frames,
            replies: &replies,
        };
        check_all(&view).expect("every invariant holds");
    }
}

fn main() {
    let config = ParentConfig {
        targets: 2,
        control_timeout: 1_000_000,
        operation_timeout: 10_000_000,
        fence_on_timeout: true,
        owner: OwnerToken(0x5eed),
        slot_capacity: DEFAULT_SLOT_CAPACITY,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
    };
    let mut world = World {
        parent: Parent::new(config),
        targets: Vec::new(),
        frames: vec![VecDeque::new(), VecDeque::new()],
        replies: VecDeque::new(),
        results: VecDeque::new(),
        completed: Vec::new(),
        now: Time(0),
    };

    // Digests come from envelopes; the protocol never sees the bytes.
    let add = encode(b"payload of add");
    let add = python_serialized_digest(&Envelope::parse(&add).expect("a valid envelope"));
    let square = encode(b"payload of square");
    let square = python_serialized_digest(&Envelope::parse(&square).expect("a valid envelope"));

    // Before start: the registry and the startup snapshot only.
    let add_handle = world
        .parent
        .register_before_start(add, Namespace::LocalPython)
        .expect("registered before start");
    println!(
        "before start: {} -> handle {}",
        add_handle.hashid, add_handle.handle_id
    );
    let snapshot = world.parent.startup_snapshot();
    world.parent.start().expect("a new parent starts");
    for id in 0..2 {
        let target =
            Target::new(TargetConfig::new(TargetId(id)), &snapshot).expect("the snapshot fits");
        world.targets.push(Some(target));
    }
    world.check();

    // A task for the pre-start handle.
    let seq = world
        .parent
        .submit(&add_handle, TargetId(1))
        .expect("a live handle");
    world.drain_parent();
    println!("task {seq} for add sent to target 1");
    world.settle();

    // After start: a register is published only when both targets confirm.
    world
        .parent
        .register(square, Namespace::LocalPython, world.now)
        .expect("started");
    world.drain_parent();
    world.deliver(TargetId(0));
    world.answer();
    assert!(
        world.completed.is_empty(),
        "not published before target 1 confirms"
    );
    world.settle();
    let Some(Effect::Completed {
        result: Ok(Completion::Registered(square_handle)),
        outcomes,
        ..
    }) = world.completed.pop()
    else {
        panic!("the register completed with a handle");
    };
    println!(
        "after start: {} -> handle {}, outcomes {outcomes:?}",
        square_handle.hashid, square_handle.handle_id
    );

    // A register during which target 1 dies: target 0 confirmed, so it gets
    // a cleanup; the register fails and nothing becomes uncertain.
    let other = encode(b"payload of other");
    let other = python_serialized_digest(&Envelope::parse(&other).expect("a valid envelope"));
    world
        .parent
        .register(other, Namespace::LocalPython, world.now)
        .expect("started");
    world.drain_parent();
    world.deliver(TargetId(0));
    world.answer();
    world.targets[1] = None;
    world.frames[1].clear();
    world
        .parent
        .target_lost(TargetId(1), world.now)
        .expect("a known target");
    world.drain_parent();
    world.settle();
    let Some(Effect::Completed {
        result: Err(error),
        outcomes,
        ..
    }) = world.completed.pop()
    else {
        panic!("the register completed with an error");
    };
    assert_eq!(error.code, ErrorCode::REGISTER_PARTIAL_FAILURE);
    assert_eq!(
        outcomes,
        vec![
            (TargetId(0), TargetOutcome::RolledBack),
            (TargetId(1), TargetOutcome::Lost)
        ]
    );
    assert!(!world.parent.is_uncertain(other));
    println!("register with a target lost: {}", error.code);

    // Unregister: a digest-owned control to the live target.
    world
        .parent
        .unregister(&square_handle, world.now)
        .expect("a live handle");
    world.drain_parent();
    world.settle();
    let Some(Effect::Completed {
        result: Ok(Completion::Unregistered(_)),
        ..
    }) = world.completed.pop()
    else {
        panic!("the unregister completed");
    };
    let target0 = world.targets[0].as_ref().expect("target 0 lives");
    assert_eq!(target0.installed(), vec![(add, 1)]);
    println!(
        "target 0 now holds {:?}",
        target0
            .installed()
            .iter()
            .map(|(d, n)| (d.to_string(), *n))
            .collect::<Vec<_>>()
    );
    assert!(world.parent.is_idle());
}
