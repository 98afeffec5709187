//! specs/design.md §4.4's invariants 1–9 as pure predicates over a [`View`] of the
//! parent, the targets and the frames in transit. The model checker and the
//! tests call these same functions. Invariant 10 (liveness) is a property of
//! runs, not of one state: the drivers check it (every operation completes
//! once every target in its scope has answered or been lost).

use std::collections::BTreeSet;
use std::fmt;

use super::parent::{OpKind, Progress, Stage};
use super::target::SlotState;
use super::{
    ControlFrame, Handle, Lifecycle, Namespace, OwnerToken, Parent, Reply, Target, TargetId,
};
use crate::descriptor::Digest;
use crate::error::ErrorCode;

/// One state of the whole system as the predicates see it.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    /// The parent.
    pub parent: &'a Parent,
    /// Every target by id (`targets[i]` is `TargetId(i)`); `None` for a
    /// target that has died (crashed, fenced and killed) or never started.
    pub targets: &'a [Option<&'a Target>],
    /// Frames from the parent not yet applied by their target, each with
    /// its receiver, in send order per target.
    pub frames: &'a [(TargetId, &'a ControlFrame)],
    /// Replies from targets not yet given to the parent, each with its
    /// sender.
    pub replies: &'a [(TargetId, &'a Reply)],
}

impl<'a> View<'a> {
    /// A target that is alive and that the parent counts live.
    fn live_targets(&self) -> impl Iterator<Item = (TargetId, &'a Target)> + '_ {
        self.targets.iter().enumerate().filter_map(|(i, t)| {
            let id = TargetId(u16::try_from(i).ok()?);
            let target = (*t)?;
            self.parent.is_target_live(id).then_some((id, target))
        })
    }

    fn alive_targets(&self) -> impl Iterator<Item = (TargetId, &'a Target)> + '_ {
        self.targets
            .iter()
            .enumerate()
            .filter_map(|(i, t)| Some((TargetId(u16::try_from(i).ok()?), (*t)?)))
    }

    /// Quiescent (specs/design.md §4.4): no operation in flight, no effect
    /// undrained, no control frame or reply in transit, no target owing a
    /// reply. Task frames may still be in transit: they change no refcount.
    pub fn is_quiescent(&self) -> bool {
        self.parent.is_idle()
            && self.replies.is_empty()
            && self
                .frames
                .iter()
                .all(|(_, f)| matches!(f, ControlFrame::Task { .. }))
            && self.alive_targets().all(|(_, t)| !t.is_deserializing())
    }

    /// Number of live handles of `digest` that `target` confirmed.
    fn live_handles_at(&self, digest: Digest, target: TargetId) -> u32 {
        let n = self
            .parent
            .handles
            .values()
            .filter(|r| r.digest == digest && r.confirmed.contains(&target))
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }
}

/// A broken invariant: its number and name as in specs/design.md §4.4 and what
/// was seen.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Violation {
    /// The invariant's number (1–9, 11, 12 or 13).
    pub number: u8,
    /// The invariant's name, e.g. `"publish after all"`.
    pub name: &'static str,
    /// What was seen, with the ids and digests involved.
    pub description: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invariant {} ({}) violated: {}",
            self.number, self.name, self.description
        )
    }
}

impl std::error::Error for Violation {}

fn violation(number: u8, name: &'static str, description: String) -> Result<(), Violation> {
    Err(Violation {
        number,
        name,
        description,
    })
}

/// A named invariant predicate.
pub type Predicate = fn(&View<'_>) -> Result<(), Violation>;

/// Invariants 1–9, 11, 12 and 13 with their numbers and names, in order
/// (10, liveness, is a property of runs).
pub const ALL: [(u8, &str, Predicate); 12] = [
    (1, "publish after all", inv1_publish_after_all),
    (2, "no orphan installs", inv2_no_orphan_installs),
    (
        3,
        "nothing published while uncertain",
        inv3_nothing_published_while_uncertain,
    ),
    (4, "refcount sanity", inv4_refcount_sanity),
    (5, "integrity", inv5_integrity),
    (6, "handle integrity", inv6_handle_integrity),
    (7, "no staging leak", inv7_no_staging_leak),
    (8, "dispatch safety", inv8_dispatch_safety),
    (9, "slots stay private", inv9_slots_stay_private),
    (
        11,
        "joined targets hold the registry",
        inv11_joined_hold_registry,
    ),
    (12, "no task before join", inv12_no_task_before_join),
    (
        13,
        "tasks run on live incarnations",
        inv13_tasks_on_live_incarnations,
    ),
];

/// Every invariant of [`ALL`], stopping at the first violation.
///
/// # Errors
/// The first [`Violation`] found, in invariant order.
pub fn check_all(view: &View<'_>) -> Result<(), Violation> {
    ALL.iter().try_for_each(|(_, _, predicate)| predicate(view))
}

/// Invariant 1, publish after all: every live handle published by a
/// post-start register was confirmed (replied OK to its seq) by every
/// target in that register's scope.
///
/// # Errors
/// A [`Violation`] naming the handle and the targets that had not confirmed.
pub fn inv1_publish_after_all(view: &View<'_>) -> Result<(), Violation> {
    for (id, record) in &view.parent.handles {
        let missing: Vec<u16> = record
            .scope
            .difference(&record.confirmed)
            .map(|t| t.0)
            .collect();
        if !missing.is_empty() {
            return violation(
                1,
                "publish after all",
                format!(
                    "handle {id} ({}) published before targets {missing:?} confirmed",
                    record.digest
                ),
            );
        }
    }
    Ok(())
}

/// Invariant 2, no orphan installs: in a quiescent state, for every live
/// target and every digest that is not uncertain, the target's refcount
/// equals the number of live handles of that digest it confirmed.
///
/// # Errors
/// A [`Violation`] naming the target, the digest and both counts.
pub fn inv2_no_orphan_installs(view: &View<'_>) -> Result<(), Violation> {
    if !view.is_quiescent() {
        return Ok(());
    }
    for (id, target) in view.live_targets() {
        let mut digests: BTreeSet<Digest> = target.installed.keys().copied().collect();
        digests.extend(
            view.parent
                .handles
                .values()
                .filter(|r| r.confirmed.contains(&id))
                .map(|r| r.digest),
        );
        for digest in digests {
            if view.parent.is_uncertain(digest) {
                continue;
            }
            let held = target.refcount(digest);
            let live = view.live_handles_at(digest, id);
            if held != live {
                return violation(
                    2,
                    "no orphan installs",
                    format!(
                        "{id} holds {digest} with refcount {held} but {live} live handles name it"
                    ),
                );
            }
        }
    }
    Ok(())
}

/// Invariant 3, nothing published while uncertain: every live handle of an
/// uncertain digest was already live when the digest became uncertain (no
/// register of it succeeded since; `specs/protocol.md` §2.4, §5).
///
/// # Errors
/// A [`Violation`] naming the digest and the handle published after.
pub fn inv3_nothing_published_while_uncertain(view: &View<'_>) -> Result<(), Violation> {
    for (digest, live_then) in &view.parent.uncertain {
        for (id, record) in &view.parent.handles {
            if record.digest == *digest && !live_then.contains(id) {
                return violation(
                    3,
                    "nothing published while uncertain",
                    format!(
                        "handle {id} of {digest} was published after {digest} became uncertain"
                    ),
                );
            }
        }
    }
    Ok(())
}

/// Invariant 4, refcount sanity, on every living target: every installed
/// digest has refcount ≥ 1 and a live slot of its own; every live slot is
/// installed under exactly one digest; a tombstoned slot is held by a run;
/// every run holds a used (live or tombstoned) slot; a deserializing slot
/// belongs to exactly one deserialization in progress; no slot is beyond
/// the capacity.
///
/// # Errors
/// A [`Violation`] naming the target, the slot and what is wrong.
pub fn inv4_refcount_sanity(view: &View<'_>) -> Result<(), Violation> {
    const NAME: &str = "refcount sanity";
    for (id, target) in view.alive_targets() {
        for (digest, entry) in &target.installed {
            if entry.refcount == 0 {
                return violation(
                    4,
                    NAME,
                    format!("{id} keeps {digest} installed with refcount 0"),
                );
            }
            match target.slots.get(&entry.slot) {
                Some(used) if used.state == SlotState::Live => {}
                other => {
                    return violation(
                        4,
                        NAME,
                        format!(
                            "{id} resolves {digest} to slot {} in state {other:?}",
                            entry.slot.0
                        ),
                    )
                }
            }
        }
        for (slot, used) in &target.slots {
            if slot.0 >= target.config.slot_capacity {
                return violation(
                    4,
                    NAME,
                    format!("{id} uses slot {} beyond its capacity", slot.0),
                );
            }
            let ok = match used.state {
                SlotState::Live => {
                    target
                        .installed
                        .values()
                        .filter(|e| e.slot == *slot)
                        .count()
                        == 1
                }
                SlotState::Tombstoned => target.runs.values().any(|s| s == slot),
                SlotState::Deserializing => {
                    target.pending.values().filter(|p| p.slot == *slot).count() == 1
                }
            };
            if !ok {
                return violation(
                    4,
                    NAME,
                    format!("{id} slot {} is {:?} without its owner", slot.0, used.state),
                );
            }
        }
        for (seq, slot) in &target.runs {
            match target.slots.get(slot) {
                Some(used) if matches!(used.state, SlotState::Live | SlotState::Tombstoned) => {}
                other => {
                    return violation(
                        4,
                        NAME,
                        format!(
                            "{id} run {seq} holds slot {} which is {other:?} (freed or reused)",
                            slot.0
                        ),
                    )
                }
            }
        }
        for (seq, pending) in &target.pending {
            if target.slots.get(&pending.slot).map(|u| u.state) != Some(SlotState::Deserializing) {
                return violation(
                    4,
                    NAME,
                    format!(
                        "{id} deserialization {seq} lost its slot {}",
                        pending.slot.0
                    ),
                );
            }
        }
    }
    Ok(())
}

/// Invariant 5, integrity, on every living target: every installed digest
/// (and every deserialization in progress) sits in a slot whose payload
/// recomputed to that same digest.
///
/// # Errors
/// A [`Violation`] naming the target, the digest and the payload's digest.
pub fn inv5_integrity(view: &View<'_>) -> Result<(), Violation> {
    for (id, target) in view.alive_targets() {
        let resolved = target
            .installed
            .iter()
            .map(|(d, e)| (*d, e.slot))
            .chain(target.pending.values().map(|p| (p.digest, p.slot)));
        for (digest, slot) in resolved {
            if let Some(used) = target.slots.get(&slot) {
                if used.content != digest {
                    return violation(
                        5,
                        "integrity",
                        format!(
                            "{id} installs {digest} from a payload whose digest is {}",
                            used.content
                        ),
                    );
                }
            }
        }
    }
    Ok(())
}

/// Invariant 6, handle integrity: every live handle resolves (to its own
/// digest, or to `REGISTER_CLEANUP_UNCERTAIN` if that is uncertain); every
/// issued id that is not live is `HANDLE_STALE`; the next id, a foreign
/// owner token and a changed hashid are each rejected with their own code.
///
/// # Errors
/// A [`Violation`] naming the handle and the unexpected resolution.
pub fn inv6_handle_integrity(view: &View<'_>) -> Result<(), Violation> {
    const NAME: &str = "handle integrity";
    let parent = view.parent;
    if parent.lifecycle() == Lifecycle::Closed {
        return Ok(());
    }
    let owner = parent.config().owner;
    let code = |h: &Handle| {
        parent
            .resolve(h, Namespace::LocalPython)
            .map_err(|e| e.code)
    };
    for handle in parent.live_handles() {
        let digest = handle.digest();
        let expected = if parent.is_uncertain(digest) {
            Err(ErrorCode::REGISTER_CLEANUP_UNCERTAIN)
        } else {
            Ok(digest)
        };
        if code(&handle) != expected {
            return violation(
                6,
                NAME,
                format!("live handle {handle:?} resolves to {:?}", code(&handle)),
            );
        }
        let foreign = Handle {
            owner: OwnerToken(owner.0 ^ 1),
            ..handle
        };
        if code(&foreign) != Err(ErrorCode::HANDLE_FOREIGN) {
            return violation(
                6,
                NAME,
                format!(
                    "foreign copy of {handle:?} resolves to {:?}",
                    code(&foreign)
                ),
            );
        }
        let mut changed = digest;
        changed.0[0] ^= 1;
        let mutated = Handle {
            hashid: changed.hashid(),
            ..handle
        };
        if code(&mutated) != Err(ErrorCode::HANDLE_MUTATED) {
            return violation(
                6,
                NAME,
                format!(
                    "mutated copy of {handle:?} resolves to {:?}",
                    code(&mutated)
                ),
            );
        }
    }
    let probe = |handle_id| Handle {
        namespace: Namespace::LocalPython,
        hashid: Digest([0; 32]).hashid(),
        handle_id,
        owner,
    };
    for handle_id in 1..parent.next_handle_id {
        if !parent.handles.contains_key(&handle_id)
            && code(&probe(handle_id)) != Err(ErrorCode::HANDLE_STALE)
        {
            return violation(
                6,
                NAME,
                format!(
                    "unregistered handle id {handle_id} resolves to {:?}",
                    code(&probe(handle_id))
                ),
            );
        }
    }
    let forged = probe(parent.next_handle_id);
    if code(&forged) != Err(ErrorCode::HANDLE_FOREIGN) {
        return violation(
            6,
            NAME,
            format!(
                "never-issued handle id {} resolves to {:?}",
                forged.handle_id,
                code(&forged)
            ),
        );
    }
    Ok(())
}

/// Invariant 7, no staging leak: in a quiescent state no staged payload
/// exists; and at any time, a staged payload is never released while a
/// register frame naming it is in transit to a target the operation still
/// waits for (it would find nothing to open).
///
/// # Errors
/// A [`Violation`] naming the staged payload.
pub fn inv7_no_staging_leak(view: &View<'_>) -> Result<(), Violation> {
    const NAME: &str = "no staging leak";
    if view.is_quiescent() && !view.parent.staged.is_empty() {
        return violation(
            7,
            NAME,
            format!(
                "staged payloads {:?} remain while quiescent",
                view.parent.staged()
            ),
        );
    }
    for (target, frame) in view.frames {
        let ControlFrame::Register { seq, staging, .. } = frame else {
            continue;
        };
        let waiting = view.parent.ops.values().any(|op| {
            op.seq == *seq
                && matches!(op.kind, OpKind::Register { cleanup: None, .. })
                && op.scope.get(target) == Some(&Progress::Pending)
        });
        if waiting && !view.parent.staged.contains(staging) {
            return violation(
                7,
                NAME,
                format!(
                    "staged payload {} released while its register {seq} is in transit to {target}",
                    staging.0
                ),
            );
        }
    }
    Ok(())
}

/// Invariant 8, dispatch safety: for every live target and every digest,
/// the target's refcount minus the unregisters of that digest in transit
/// to it is at least the number of live handles of the digest it confirmed.
/// Tasks are only submitted for live handles to targets that confirmed them
/// and frames are FIFO, so this guarantees that a task for a live handle
/// never reaches a live target lacking the digest.
///
/// # Errors
/// A [`Violation`] naming the target, the digest and the counts.
pub fn inv8_dispatch_safety(view: &View<'_>) -> Result<(), Violation> {
    for (id, target) in view.live_targets() {
        let digests: BTreeSet<Digest> = view
            .parent
            .handles
            .values()
            .filter(|r| r.confirmed.contains(&id))
            .map(|r| r.digest)
            .collect();
        for digest in digests {
            let leaving = view
                .frames
                .iter()
                .filter(|(t, f)| {
                    *t == id
                        && matches!(f, ControlFrame::Unregister { digest: d, .. } if *d == digest)
                })
                .count();
            let held =
                i64::from(target.refcount(digest)) - i64::try_from(leaving).unwrap_or(i64::MAX);
            let live = i64::from(view.live_handles_at(digest, id));
            if held < live {
                return violation(
                    8,
                    "dispatch safety",
                    format!(
                        "{id} holds {digest} with refcount {} and {leaving} unregisters in transit, but {live} live handles may send it tasks",
                        target.refcount(digest)
                    ),
                );
            }
        }
    }
    Ok(())
}

/// Invariant 11, joined targets hold the registry (`specs/protocol.md`
/// §2.9): every live target that serves (the original, or a replacement
/// that joined) confirmed every live handle whose digest is not uncertain.
/// With invariant 2 (in a quiescent state a target's refcounts are the
/// live handles it confirmed), a joined target's table is the registry.
///
/// # Errors
/// A [`Violation`] naming the target and the handle it did not confirm.
pub fn inv11_joined_hold_registry(view: &View<'_>) -> Result<(), Violation> {
    for (id, _) in view.live_targets() {
        if !view.parent.is_target_joined(id) {
            continue;
        }
        for (handle_id, record) in &view.parent.handles {
            if view.parent.is_uncertain(record.digest) || record.confirmed.contains(&id) {
                continue;
            }
            return violation(
                11,
                "joined targets hold the registry",
                format!(
                    "{id} (incarnation {}) serves but never confirmed live handle {handle_id} of {}",
                    view.parent.incarnation(id),
                    record.digest
                ),
            );
        }
    }
    Ok(())
}

/// Invariant 12, no task before join (`specs/protocol.md` §2.9): no task
/// frame is in transit to a live target that has not joined.
///
/// # Errors
/// A [`Violation`] naming the target and the task's seq.
pub fn inv12_no_task_before_join(view: &View<'_>) -> Result<(), Violation> {
    for (id, frame) in view.frames {
        if let ControlFrame::Task { seq, .. } = frame {
            if view.parent.is_target_live(*id) && !view.parent.is_target_joined(*id) {
                return violation(
                    12,
                    "no task before join",
                    format!(
                        "task {seq} is in transit to {id}, a replacement (incarnation {}) that has not joined",
                        view.parent.incarnation(*id)
                    ),
                );
            }
        }
    }
    Ok(())
}

/// Invariant 13, tasks run on live incarnations (`specs/protocol.md`
/// §2.11, §2.14, §2.15): while the Worker is started, every task sent and
/// in flight names a target the parent counts live, at the incarnation
/// the parent records for that target now (a task whose target's process
/// was lost ended with it or is in doubt, so a replacement never inherits
/// it and no earlier process's result can end it); a task in doubt names
/// a process that is no longer live; a task waiting unsent names a target
/// that will take tasks, and no target that takes tasks has confirmed its
/// handle (it would have been sent there).
///
/// # Errors
/// A [`Violation`] naming the task, its target and the incarnations.
pub fn inv13_tasks_on_live_incarnations(view: &View<'_>) -> Result<(), Violation> {
    if view.parent.lifecycle != Lifecycle::Started {
        return Ok(());
    }
    // The per-target counts placement reads agree with the tasks.
    let mut loads = vec![(0u32, 0u32); view.parent.loads.len()];
    for task in view.parent.tasks.values() {
        if let Some((sent, waiting)) = loads.get_mut(usize::from(task.target.0)) {
            match task.stage {
                Stage::Waiting => *waiting += 1,
                Stage::Sent | Stage::Started => *sent += 1,
                Stage::InDoubt { .. } => {}
            }
        }
    }
    let kept: Vec<(u32, u32)> = view
        .parent
        .loads
        .iter()
        .map(|l| (l.sent, l.waiting))
        .collect();
    if loads != kept {
        return violation(
            13,
            "tasks run on live incarnations",
            format!("the per-target task counts {kept:?} are not those of the tasks in flight, {loads:?}"),
        );
    }
    for (seq, task) in &view.parent.tasks {
        let live = view.parent.is_target_live(task.target);
        let current = view.parent.incarnation(task.target);
        if matches!(task.stage, Stage::InDoubt { .. }) {
            // In doubt (§2.15): its process was lost.
            if live && current == task.incarnation {
                return violation(
                    13,
                    "tasks run on live incarnations",
                    format!(
                        "task {seq} is in doubt on {} (incarnation {current}), which is live",
                        task.target
                    ),
                );
            }
            continue;
        }
        if task.stage == Stage::Waiting {
            let taker = (0..view.parent.config.targets).map(TargetId).find(|t| {
                (!task.pinned || *t == task.target)
                    && view.parent.takes_tasks(*t)
                    && view
                        .parent
                        .handles
                        .get(&task.handle_id)
                        .is_some_and(|r| r.confirmed.contains(t))
            });
            let waits_for = view.parent.will_take_tasks(task.target);
            if taker.is_some() || !waits_for {
                return violation(
                    13,
                    "tasks run on live incarnations",
                    match taker {
                        Some(t) => format!("task {seq} waits although {t} takes tasks"),
                        None => format!(
                            "task {seq} waits for {}, which will never take tasks",
                            task.target
                        ),
                    },
                );
            }
            continue;
        }
        if !live || current != task.incarnation {
            return violation(
                13,
                "tasks run on live incarnations",
                format!(
                    "task {seq} is in flight on {} (incarnation {}), which is {} at incarnation {current}",
                    task.target,
                    task.incarnation,
                    if live { "live" } else { "lost" }
                ),
            );
        }
    }
    Ok(())
}

/// Invariant 9, slots stay private: no frame or reply in transit carries a
/// slot (checked on their serialized form: no field is named like one).
///
/// # Errors
/// A [`Violation`] naming the frame.
pub fn inv9_slots_stay_private(view: &View<'_>) -> Result<(), Violation> {
    let frames = view
        .frames
        .iter()
        .map(|(t, f)| (t, serde_json::to_value(f)));
    let replies = view
        .replies
        .iter()
        .map(|(t, r)| (t, serde_json::to_value(r)));
    for (target, value) in frames.chain(replies) {
        match value {
            Ok(value) if !has_slot(&value) => {}
            other => {
                return violation(
                    9,
                    "slots stay private",
                    format!("frame for {target} carries a slot: {other:?}"),
                )
            }
        }
    }
    Ok(())
}

/// Whether a key anywhere in `value` (in nested objects and arrays too)
/// names a slot.
fn has_slot(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::Object(map) => {
            map.iter().any(|(k, v)| k.contains("slot") || has_slot(v))
        }
        serde_json::Value::Array(items) => items.iter().any(has_slot),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{OwnerToken, ParentConfig, Reply, Seq, Slot, StagingId, TargetConfig};

    fn digest(n: u8) -> Digest {
        Digest([n; 32])
    }

    /// A started parent over two targets with one pre-start handle (id 1) of
    /// digest 1, and both targets holding it: quiescent and correct.
    fn system() -> (Parent, Vec<Option<Target>>) {
        let mut parent = Parent::new(ParentConfig {
            targets: 2,
            control_timeout: 10,
            operation_timeout: 100,
            fence_on_timeout: true,
            owner: OwnerToken(3),
            slot_capacity: 64,
            probe_first: false,
            respawn_limit: 0,
            respawn_backoff: 0,
            unbounded_spawn: false,
            max_tasks_per_target: 0,
        });
        parent
            .register_before_start(digest(1), Namespace::LocalPython)
            .unwrap();
        let snapshot = parent.startup_snapshot();
        parent.start().unwrap();
        let targets = (0..2)
            .map(|i| Some(Target::new(TargetConfig::new(TargetId(i)), &snapshot).unwrap()))
            .collect();
        (parent, targets)
    }

    fn check(
        number: u8,
        parent: &Parent,
        targets: &[Option<Target>],
        frames: &[(TargetId, ControlFrame)],
    ) -> Result<(), Violation> {
        let targets: Vec<Option<&Target>> = targets.iter().map(Option::as_ref).collect();
        let frames: Vec<(TargetId, &ControlFrame)> = frames.iter().map(|(t, f)| (*t, f)).collect();
        let view = View {
            parent,
            targets: &targets,
            frames: &frames,
            replies: &[],
        };
        let predicate = ALL
            .iter()
            .find(|(n, _, _)| *n == number)
            .map(|(_, _, p)| *p)
            .unwrap_or_else(|| panic!("no invariant {number}"));
        predicate(&view)
    }

    #[test]
    fn a_correct_quiescent_system_keeps_every_invariant() {
        let (parent, targets) = system();
        let targets: Vec<Option<&Target>> = targets.iter().map(Option::as_ref).collect();
        let view = View {
            parent: &parent,
            targets: &targets,
            frames: &[],
            replies: &[],
        };
        assert!(view.is_quiescent());
        assert_eq!(check_all(&view), Ok(()));
    }

    #[test]
    fn inv1_catches_a_handle_published_before_a_target_confirmed() {
        let (mut parent, targets) = system();
        parent
            .handles
            .get_mut(&1)
            .unwrap()
            .confirmed
            .remove(&TargetId(1));
        let v = check(1, &parent, &targets, &[]).unwrap_err();
        assert_eq!(v.number, 1);
        assert!(v.description.contains("targets [1]"), "{v}");
    }

    #[test]
    fn inv2_catches_an_orphan_install_and_exempts_uncertain_digests() {
        let (mut parent, mut targets) = system();
        targets[0]
            .as_mut()
            .unwrap()
            .installed
            .get_mut(&digest(1))
            .unwrap()
            .refcount = 2;
        let v = check(2, &parent, &targets, &[]).unwrap_err();
        assert_eq!(
            v.description,
            format!(
                "target 0 holds {} with refcount 2 but 1 live handles name it",
                digest(1)
            )
        );
        parent.uncertain.insert(digest(1), [1].into());
        assert_eq!(check(2, &parent, &targets, &[]), Ok(()));
    }

    #[test]
    fn inv2_waits_for_quiescence() {
        let (parent, mut targets) = system();
        targets[0]
            .as_mut()
            .unwrap()
            .installed
            .get_mut(&digest(1))
            .unwrap()
            .refcount = 2;
        let frames = [(
            TargetId(0),
            ControlFrame::Unregister {
                seq: Seq(9),
                digest: digest(1),
            },
        )];
        assert_eq!(check(2, &parent, &targets, &frames), Ok(()));
    }

    #[test]
    fn inv3_catches_a_handle_published_after_uncertainty() {
        let (mut parent, targets) = system();
        parent.uncertain.insert(digest(1), BTreeSet::new());
        assert_eq!(check(3, &parent, &targets, &[]).unwrap_err().number, 3);
    }

    #[test]
    fn inv4_catches_a_zero_refcount_and_a_run_on_a_freed_slot() {
        let (parent, mut targets) = system();
        let mut zero = targets.clone();
        zero[0]
            .as_mut()
            .unwrap()
            .installed
            .get_mut(&digest(1))
            .unwrap()
            .refcount = 0;
        assert_eq!(check(4, &parent, &zero, &[]).unwrap_err().number, 4);
        let target = targets[1].as_mut().unwrap();
        target.begin_task(Seq(4), digest(1)).unwrap();
        target.slots.clear();
        target.installed.clear();
        let v = check(4, &parent, &targets, &[]).unwrap_err();
        assert!(v.description.contains("run seq 4 holds slot 0"), "{v}");
    }

    #[test]
    fn inv5_catches_a_slot_whose_payload_has_another_digest() {
        let (parent, mut targets) = system();
        let target = targets[0].as_mut().unwrap();
        target
            .slots
            .values_mut()
            .for_each(|u| u.content = digest(2));
        let v = check(5, &parent, &targets, &[]).unwrap_err();
        assert_eq!(
            v.description,
            format!(
                "target 0 installs {} from a payload whose digest is {}",
                digest(1),
                digest(2)
            )
        );
    }

    #[test]
    fn inv6_catches_a_live_handle_that_does_not_resolve() {
        let (mut parent, targets) = system();
        parent.next_handle_id = 1;
        assert_eq!(check(6, &parent, &targets, &[]).unwrap_err().number, 6);
    }

    #[test]
    fn inv7_catches_a_leaked_staged_payload() {
        let (mut parent, targets) = system();
        parent.staged.insert(StagingId(5));
        assert_eq!(check(7, &parent, &targets, &[]).unwrap_err().number, 7);
    }

    #[test]
    fn inv8_catches_an_unregister_that_would_strand_a_live_handle() {
        let (parent, targets) = system();
        let frames = [(
            TargetId(1),
            ControlFrame::Unregister {
                seq: Seq(9),
                digest: digest(1),
            },
        )];
        let v = check(8, &parent, &targets, &frames).unwrap_err();
        assert_eq!(v.number, 8);
        assert!(v.description.starts_with("target 1 holds"), "{v}");
    }

    /// The frames of every `Send` among the parent's undrained effects, in
    /// order (drains them).
    fn sent(parent: &mut Parent) -> Vec<(TargetId, ControlFrame)> {
        std::iter::from_fn(|| parent.poll_effect())
            .filter_map(|e| match e {
                crate::protocol::Effect::Send { target, frame } => Some((target, frame)),
                _ => None,
            })
            .collect()
    }

    fn view_of<'a>(
        parent: &'a Parent,
        targets: &'a [Option<&'a Target>],
        frames: &'a [(TargetId, &'a ControlFrame)],
        replies: &'a [(TargetId, &'a Reply)],
    ) -> View<'a> {
        View {
            parent,
            targets,
            frames,
            replies,
        }
    }

    #[test]
    fn check_all_reports_the_first_violation_in_invariant_order() {
        let (mut parent, mut targets) = system();
        parent.staged.insert(StagingId(5));
        let targets_view: Vec<Option<&Target>> = targets.iter().map(Option::as_ref).collect();
        let v = check_all(&view_of(&parent, &targets_view, &[], &[])).unwrap_err();
        assert_eq!((v.number, v.name), (7, "no staging leak"));
        targets[0]
            .as_mut()
            .unwrap()
            .installed
            .get_mut(&digest(1))
            .unwrap()
            .refcount = 2;
        let targets_view: Vec<Option<&Target>> = targets.iter().map(Option::as_ref).collect();
        let v = check_all(&view_of(&parent, &targets_view, &[], &[])).unwrap_err();
        assert_eq!((v.number, v.name), (2, "no orphan installs"));
    }

    #[test]
    fn a_violation_displays_its_number_name_and_description() {
        let (mut parent, targets) = system();
        parent.staged.insert(StagingId(5));
        let v = check(7, &parent, &targets, &[]).unwrap_err();
        assert_eq!(
            v.to_string(),
            "invariant 7 (no staging leak) violated: staged payloads [StagingId(5)] remain while quiescent"
        );
    }

    #[test]
    fn quiescence_needs_an_idle_parent_and_nothing_in_transit() {
        let (parent, targets) = system();
        let alive: Vec<Option<&Target>> = targets.iter().map(Option::as_ref).collect();
        // A register whose effects are not drained yet: nothing in transit,
        // but the parent is not idle.
        let mut busy = parent.clone();
        busy.register(digest(2), Namespace::LocalPython, crate::protocol::Time(0))
            .unwrap();
        assert!(!view_of(&busy, &alive, &[], &[]).is_quiescent());
        // An idle parent with a reply in transit.
        let reply = Reply {
            seq: Seq(9),
            digest: digest(1),
            result: Ok(()),
        };
        assert!(!view_of(&parent, &alive, &[], &[(TargetId(0), &reply)]).is_quiescent());
        // An idle parent with a control frame in transit; a task frame is
        // allowed.
        let unregister = ControlFrame::Unregister {
            seq: Seq(9),
            digest: digest(1),
        };
        let task = ControlFrame::Task {
            seq: Seq(9),
            digest: digest(1),
        };
        assert!(!view_of(&parent, &alive, &[(TargetId(0), &unregister)], &[]).is_quiescent());
        assert!(view_of(&parent, &alive, &[(TargetId(0), &task)], &[]).is_quiescent());
        // A target deserializing.
        let mut deserializing = targets.clone();
        deserializing[1]
            .as_mut()
            .unwrap()
            .on_register(Seq(9), digest(2), Ok(digest(2)));
        let alive: Vec<Option<&Target>> = deserializing.iter().map(Option::as_ref).collect();
        assert!(!view_of(&parent, &alive, &[], &[]).is_quiescent());
    }

    #[test]
    fn inv2_counts_the_handles_of_each_digest_apart() {
        // Two digests, one handle each, held once by both targets.
        let mut parent = Parent::new(ParentConfig {
            targets: 2,
            control_timeout: 10,
            operation_timeout: 100,
            fence_on_timeout: true,
            owner: OwnerToken(3),
            slot_capacity: 64,
            probe_first: false,
            respawn_limit: 0,
            respawn_backoff: 0,
            unbounded_spawn: false,
            max_tasks_per_target: 0,
        });
        for n in [1, 2] {
            parent
                .register_before_start(digest(n), Namespace::LocalPython)
                .unwrap();
        }
        let snapshot = parent.startup_snapshot();
        parent.start().unwrap();
        let mut targets: Vec<Option<Target>> = (0..2)
            .map(|i| Some(Target::new(TargetConfig::new(TargetId(i)), &snapshot).unwrap()))
            .collect();
        for number in [2, 8] {
            assert_eq!(check(number, &parent, &targets, &[]), Ok(()), "{number}");
        }
        // Target 0 confirmed the handle of digest 2 only.
        parent
            .handles
            .get_mut(&1)
            .unwrap()
            .confirmed
            .remove(&TargetId(0));
        let v = check(2, &parent, &targets, &[]).unwrap_err();
        assert_eq!(
            v.description,
            format!(
                "target 0 holds {} with refcount 1 but 0 live handles name it",
                digest(1)
            )
        );
        // Target 1 dropped digest 1.
        let mut dropped = parent.clone();
        dropped
            .handles
            .get_mut(&1)
            .unwrap()
            .confirmed
            .insert(TargetId(0));
        targets[1].as_mut().unwrap().installed.remove(&digest(1));
        targets[1]
            .as_mut()
            .unwrap()
            .slots
            .retain(|_, u| u.content != digest(1));
        let v = check(2, &dropped, &targets, &[]).unwrap_err();
        assert_eq!(
            v.description,
            format!(
                "target 1 holds {} with refcount 0 but 1 live handles name it",
                digest(1)
            )
        );
    }

    #[test]
    fn inv3_looks_only_at_handles_of_the_uncertain_digest_published_after() {
        let (mut parent, targets) = system();
        // Another digest is uncertain: handle 1 (digest 1) is not concerned.
        parent.uncertain.insert(digest(2), BTreeSet::new());
        assert_eq!(check(3, &parent, &targets, &[]), Ok(()));
        // Digest 1 became uncertain while handle 1 was live.
        parent.uncertain.insert(digest(1), [1].into());
        assert_eq!(check(3, &parent, &targets, &[]), Ok(()));
        // ... and not while it was live.
        parent.uncertain.insert(digest(1), [2].into());
        let v = check(3, &parent, &targets, &[]).unwrap_err();
        assert_eq!(
            v.description,
            format!(
                "handle 1 of {} was published after {} became uncertain",
                digest(1),
                digest(1)
            )
        );
    }

    #[test]
    fn inv4_accepts_each_slot_state_with_its_owner_only() {
        let (parent, targets) = system();
        // Deserializing: a slot reserved for one deserialization.
        let mut deserializing = targets.clone();
        let target = deserializing[0].as_mut().unwrap();
        target.on_register(Seq(5), digest(2), Ok(digest(2)));
        assert_eq!(check(4, &parent, &deserializing, &[]), Ok(()));
        let mut twice = deserializing.clone();
        let target = twice[0].as_mut().unwrap();
        let pending = target.pending[&Seq(5)].clone();
        target.pending.insert(Seq(6), pending);
        let v = check(4, &parent, &twice, &[]).unwrap_err();
        assert_eq!(
            v.description,
            "target 0 slot 1 is Deserializing without its owner"
        );
        let mut orphan = deserializing.clone();
        let target = orphan[0].as_mut().unwrap();
        target.slots.get_mut(&Slot(1)).unwrap().state = SlotState::Live;
        let v = check(4, &parent, &orphan, &[]).unwrap_err();
        assert_eq!(v.description, "target 0 slot 1 is Live without its owner");
        // Tombstoned: unregistered while a run holds it.
        let mut tombstoned = targets.clone();
        let slot = tombstoned[1]
            .as_mut()
            .unwrap()
            .begin_task(Seq(4), digest(1))
            .unwrap();
        assert_eq!(
            check(4, &parent, &tombstoned, &[]),
            Ok(()),
            "a run on a live slot"
        );
        let target = tombstoned[1].as_mut().unwrap();
        target.on_unregister(Seq(5), digest(1));
        assert_eq!(target.slots[&slot].state, SlotState::Tombstoned);
        assert_eq!(check(4, &parent, &tombstoned, &[]), Ok(()));
        let mut unheld = tombstoned.clone();
        unheld[1].as_mut().unwrap().runs.clear();
        let v = check(4, &parent, &unheld, &[]).unwrap_err();
        assert_eq!(
            v.description,
            "target 1 slot 0 is Tombstoned without its owner"
        );
        // An installed digest in a slot that is not live.
        let mut unresolvable = tombstoned.clone();
        let target = unresolvable[1].as_mut().unwrap();
        target.installed.insert(
            digest(1),
            super::super::target::Installed { slot, refcount: 1 },
        );
        let v = check(4, &parent, &unresolvable, &[]).unwrap_err();
        assert_eq!(
            v.description,
            format!(
                "target 1 resolves {} to slot 0 in state Some(SlotUse {{ content: {:?}, state: Tombstoned }})",
                digest(1),
                digest(1)
            )
        );
        // A run holding a slot that is deserializing again.
        let mut reused = tombstoned.clone();
        let target = reused[1].as_mut().unwrap();
        target.slots.get_mut(&slot).unwrap().state = SlotState::Deserializing;
        target.pending.insert(
            Seq(6),
            super::super::target::PendingInstall {
                digest: digest(1),
                slot,
                waiters: Vec::new(),
            },
        );
        let v = check(4, &parent, &reused, &[]).unwrap_err();
        assert!(
            v.description
                .starts_with("target 1 run seq 4 holds slot 0 which is Some("),
            "{v}"
        );
    }

    #[test]
    fn inv6_probes_with_a_foreign_token_for_every_owner() {
        let (_, targets) = system();
        for owner in [0, 1, 2, u64::MAX] {
            let mut parent = Parent::new(ParentConfig {
                targets: 2,
                control_timeout: 10,
                operation_timeout: 100,
                fence_on_timeout: true,
                owner: OwnerToken(owner),
                slot_capacity: 64,
                probe_first: false,
                respawn_limit: 0,
                respawn_backoff: 0,
                unbounded_spawn: false,
                max_tasks_per_target: 0,
            });
            parent
                .register_before_start(digest(1), Namespace::LocalPython)
                .unwrap();
            parent.start().unwrap();
            assert_eq!(check(6, &parent, &targets, &[]), Ok(()), "owner {owner}");
        }
    }

    #[test]
    fn inv6_accepts_a_stale_handle_id() {
        let (mut parent, targets) = system();
        let handle = parent.live_handles()[0];
        parent
            .unregister(&handle, crate::protocol::Time(0))
            .unwrap();
        let frames = sent(&mut parent);
        assert_eq!(frames.len(), 2);
        assert_eq!(check(6, &parent, &targets, &frames), Ok(()));
        assert_eq!(
            parent
                .resolve(&handle, Namespace::LocalPython)
                .map_err(|e| e.code),
            Err(ErrorCode::HANDLE_STALE)
        );
    }

    #[test]
    fn inv7_catches_a_payload_released_under_a_register_in_transit() {
        let (mut parent, targets) = system();
        parent
            .register(digest(2), Namespace::LocalPython, crate::protocol::Time(0))
            .unwrap();
        let frames = sent(&mut parent);
        assert_eq!(frames.len(), 2);
        assert_eq!(check(7, &parent, &targets, &frames), Ok(()));
        let staging = parent.staged()[0];
        parent.staged.remove(&staging);
        let v = check(7, &parent, &targets, &frames).unwrap_err();
        assert_eq!(
            v.description,
            format!(
                "staged payload {} released while its register seq 1 is in transit to target 0",
                staging.0
            )
        );
    }

    #[test]
    fn inv7_ignores_a_register_in_transit_that_no_operation_waits_for() {
        // Without fencing, a register times out while its frame is still in
        // transit: its payload is released; a later register of another
        // digest waits for the same target.
        let mut parent = Parent::new(ParentConfig {
            targets: 1,
            control_timeout: 1_000,
            operation_timeout: 10_000,
            fence_on_timeout: false,
            owner: OwnerToken(3),
            slot_capacity: 64,
            probe_first: false,
            respawn_limit: 0,
            respawn_backoff: 0,
            unbounded_spawn: false,
            max_tasks_per_target: 0,
        });
        parent.start().unwrap();
        let targets = vec![Some(
            Target::new(TargetConfig::new(TargetId(0)), &parent.startup_snapshot()).unwrap(),
        )];
        parent
            .register(digest(1), Namespace::LocalPython, crate::protocol::Time(0))
            .unwrap();
        let mut frames = sent(&mut parent);
        parent
            .register(
                digest(2),
                Namespace::LocalPython,
                crate::protocol::Time(500),
            )
            .unwrap();
        frames.extend(sent(&mut parent));
        parent.handle_timeout(crate::protocol::Time(1_000));
        std::iter::from_fn(|| parent.poll_effect()).for_each(drop);
        assert_eq!(parent.in_flight().len(), 1);
        assert_eq!(parent.staged().len(), 1);
        assert_eq!(frames.len(), 2);
        assert_eq!(check(7, &parent, &targets, &frames), Ok(()));
    }

    #[test]
    fn inv8_does_not_count_a_task_in_transit_as_leaving() {
        let (parent, targets) = system();
        let frames = [(
            TargetId(0),
            ControlFrame::Task {
                seq: Seq(9),
                digest: digest(1),
            },
        )];
        assert_eq!(check(8, &parent, &targets, &frames), Ok(()));
    }

    #[test]
    fn inv13_catches_a_task_on_a_lost_target_or_an_earlier_incarnation() {
        let (mut parent, targets) = system();
        let handle = parent.live_handles().remove(0);
        let seq = parent.submit(&handle, TargetId(1)).unwrap();
        while parent.poll_effect().is_some() {}
        assert_eq!(check(13, &parent, &targets, &[]), Ok(()));
        // The correct machine holds the unstarted task in doubt at its
        // target's loss, then ends it: it was named for that target, which
        // is not replaced.
        let mut lost = parent.clone();
        lost.target_died(TargetId(1), "gone", crate::protocol::Time(1))
            .unwrap();
        assert_eq!(lost.task(seq).map(|t| t.in_doubt), Some(true));
        assert_eq!(check(13, &lost, &targets, &[]), Ok(()));
        lost.process_drained(TargetId(1), 0, true);
        assert_eq!(lost.tasks_in_flight(), vec![]);
        assert_eq!(check(13, &lost, &targets, &[]), Ok(()));
        // A task left in flight on a lost target.
        let mut kept = parent.clone();
        kept.lost.insert(TargetId(1));
        let v = check(13, &kept, &targets, &[]).unwrap_err();
        assert_eq!(
            v.to_string(),
            format!("invariant 13 (tasks run on live incarnations) violated: task {seq} is in flight on target 1 (incarnation 0), which is lost at incarnation 0")
        );
        // A task of an earlier incarnation of a live target.
        let mut earlier = parent.clone();
        earlier.tasks.get_mut(&seq).unwrap().incarnation = 1;
        let v = check(13, &earlier, &targets, &[]).unwrap_err();
        assert_eq!(
            v.description,
            format!("task {seq} is in flight on target 1 (incarnation 1), which is live at incarnation 0")
        );
        // After close nothing is in flight to check.
        kept.close().unwrap();
        assert_eq!(check(13, &kept, &targets, &[]), Ok(()));
    }

    #[test]
    fn inv9_finds_a_slot_key_at_any_depth() {
        use serde_json::json;
        for carrier in [
            json!({"slot": 0}),
            json!({"frame": "register", "free_slots": [1]}),
            json!({"result": {"Err": {"code": "X", "slot": 2}}}),
            json!({"frame": "task", "items": [1, {"slot": 3}]}),
            json!([{"seq": 1}, {"slot_id": 4}]),
        ] {
            assert!(has_slot(&carrier), "{carrier}");
        }
        for clean in [
            json!({"frame": "task", "seq": 1, "digest": "slot"}),
            json!({"result": {"Err": {"code": "X", "message": "no free slot"}}}),
            json!({"items": [1, "slot", {"seq": 2}]}),
            json!("slot"),
            json!(null),
        ] {
            assert!(!has_slot(&clean), "{clean}");
        }
    }

    #[test]
    fn inv9_accepts_every_frame_and_reply_kind() {
        let (parent, targets) = system();
        let frames = [
            (
                TargetId(0),
                ControlFrame::Register {
                    seq: Seq(1),
                    digest: digest(1),
                    staging: StagingId(1),
                },
            ),
            (
                TargetId(0),
                ControlFrame::Unregister {
                    seq: Seq(2),
                    digest: digest(1),
                },
            ),
            (
                TargetId(0),
                ControlFrame::Task {
                    seq: Seq(3),
                    digest: digest(1),
                },
            ),
        ];
        let replies = [(
            TargetId(0),
            Reply {
                seq: Seq(1),
                digest: digest(1),
                result: Err(crate::protocol::Failure::new(ErrorCode::IO_FAILED, "x")),
            },
        )];
        let targets: Vec<Option<&Target>> = targets.iter().map(Option::as_ref).collect();
        let frames: Vec<(TargetId, &ControlFrame)> = frames.iter().map(|(t, f)| (*t, f)).collect();
        let replies: Vec<(TargetId, &Reply)> = replies.iter().map(|(t, r)| (*t, r)).collect();
        let view = View {
            parent: &parent,
            targets: &targets,
            frames: &frames,
            replies: &replies,
        };
        assert_eq!(inv9_slots_stay_private(&view), Ok(()));
    }
}
