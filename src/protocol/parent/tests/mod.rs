use super::*;
use crate::protocol::{ControlPhase, Reply};

mod deadlines;
mod operations;
mod probe;
mod registry;

// The helpers below are shared with the unit tests of the machine's other
// files (tasks, inspections).

pub(super) fn digest(n: u8) -> Digest {
    Digest([n; 32])
}

/// A started parent of `targets` targets, without replacements.
pub(super) fn started(targets: u16) -> Parent {
    let mut p = new_parent(targets);
    p.start().unwrap();
    p
}

pub(super) fn drain(p: &mut Parent) -> Vec<Effect> {
    std::iter::from_fn(|| p.poll_effect()).collect()
}

fn ok(seq: u64, n: u8) -> Reply {
    Reply {
        seq: Seq(seq),
        digest: digest(n),
        result: Ok(()),
    }
}

/// A new parent of `targets` targets (control timeout 100, operation
/// timeout 1,000, fencing on, no probe, no replacements).
pub(super) fn new_parent(targets: u16) -> Parent {
    Parent::new(ParentConfig {
        targets,
        control_timeout: 100,
        operation_timeout: 1_000,
        fence_on_timeout: true,
        owner: OwnerToken(9),
        slot_capacity: 64,
        probe_first: false,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
    })
}

fn probing(targets: u16) -> Parent {
    let mut p = Parent::new(ParentConfig {
        targets,
        control_timeout: 100,
        operation_timeout: 1_000,
        fence_on_timeout: true,
        owner: OwnerToken(9),
        slot_capacity: 64,
        probe_first: true,
        respawn_limit: 0,
        respawn_backoff: 0,
        unbounded_spawn: false,
        max_tasks_per_target: 0,
    });
    p.start().unwrap();
    p
}

/// The targets `effects` send a frame to, in order.
fn sent_to(effects: Vec<Effect>) -> Vec<TargetId> {
    effects
        .into_iter()
        .filter_map(|e| match e {
            Effect::Send { target, .. } => Some(target),
            _ => None,
        })
        .collect()
}

fn register_frame(target: u16, seq: u64, n: u8) -> Effect {
    Effect::Send {
        target: TargetId(target),
        frame: ControlFrame::Register {
            seq: Seq(seq),
            digest: digest(n),
            staging: StagingId(seq),
        },
    }
}

/// The error and the outcomes of `effect`, which must be a failed
/// completion.
fn failure(effect: Option<&Effect>) -> (&Error, &Vec<(TargetId, TargetOutcome)>) {
    match effect {
        Some(Effect::Completed {
            result: Err(e),
            outcomes,
            ..
        }) => (e, outcomes),
        other => panic!("not a failed completion: {other:?}"),
    }
}

fn fences(effects: &[Effect]) -> Vec<TargetId> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Fence { target, .. } => Some(*target),
            _ => None,
        })
        .collect()
}
