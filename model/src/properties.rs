//! The properties checked on every reachable state (`specs/model.md`).
//!
//! * `always` — specs/design.md §4.4 invariants 1–9, each through the library's
//!   own predicate in `callreg::protocol::invariants` (invariant 8 also
//!   through the driver's direct observation of a task arriving at a target
//!   lacking its digest), the driving rule (no machine refuses an input the
//!   driver gives it), and invariant 10 on terminal states.
//! * `eventually` — invariant 10: every operation completes. Stateright
//!   checks `eventually` only along paths that end in a terminal state and
//!   does not tell a revisited state on a cycle from a join, so it can miss a
//!   counterexample that loops forever; the `always` form on terminal states
//!   is the one to trust (the model's state graph has no cycle: every action
//!   consumes a message or a budget, or advances the script or the seq).
//! * `sometimes` — witnesses that the model is not vacuous: each must be
//!   reachable in some configuration (which ones is in `specs/model.md`).

use callreg::protocol::invariants;
use callreg::protocol::ControlFrame;
use stateright::Property;

use crate::model::{seen, RegistrationModel, State, StepResult, StepStatus};

/// Name of the `always` property for invariant 1.
pub const INV1: &str = "1 publish after all";
/// Name of the `always` property for invariant 2.
pub const INV2: &str = "2 no orphan installs";
/// Name of the `always` property for invariant 3.
pub const INV3: &str = "3 uncertain is sticky";
/// Name of the `always` property for invariant 4.
pub const INV4: &str = "4 refcount sanity";
/// Name of the `always` property for invariant 5.
pub const INV5: &str = "5 integrity";
/// Name of the `always` property for invariant 6.
pub const INV6: &str = "6 handle integrity";
/// Name of the `always` property for invariant 7.
pub const INV7: &str = "7 no staging leak";
/// Name of the `always` property for invariant 8.
pub const INV8: &str = "8 dispatch safety";
/// Name of the `always` property for invariant 9.
pub const INV9: &str = "9 slots stay private";
/// Name of the `always` property for invariant 10 on terminal states.
pub const INV10_TERMINAL: &str = "10 liveness (terminal states)";
/// Name of the `eventually` property for invariant 10.
pub const INV10_EVENTUALLY: &str = "10 liveness (eventually)";
/// Name of the `always` property that the machines accept every input the
/// driver gives them.
pub const DRIVING_RULE: &str = "driving rule";
/// Witness: some register publishes its handle.
pub const SOMETIMES_PUBLISH: &str = "sometimes: a register publishes";
/// Witness: some register fails and a confirmed target is rolled back.
pub const SOMETIMES_ROLLBACK: &str = "sometimes: a register fails and rolls back";
/// Witness: some digest becomes uncertain.
pub const SOMETIMES_UNCERTAIN: &str = "sometimes: a digest becomes uncertain";
/// Witness: a slot tombstoned and freed is reserved again.
pub const SOMETIMES_SLOT_REUSE: &str = "sometimes: a slot is reused after a tombstone";
/// Witness: a register frame and an unregister frame of the same digest
/// are in transit to one target at once.
pub const SOMETIMES_INTERLEAVE: &str =
    "sometimes: a register and an unregister of one digest interleave at a target";
/// Witness: the parent counts a target lost (crashed and seen, or fenced).
pub const SOMETIMES_TARGET_LOST: &str = "sometimes: a target is lost";
/// Witness: a target refuses a register for want of a free slot.
pub const SOMETIMES_SLOT_EXHAUSTED: &str = "sometimes: a target has no free slot for a register";
/// Witness: a reply reaches the parent after its operation gave up.
pub const SOMETIMES_LATE_REPLY: &str = "sometimes: a reply arrives after its operation gave up";

fn holds(predicate: invariants::Predicate, state: &State) -> bool {
    state.with_view(|view| predicate(view).is_ok())
}

fn inv1(_: &RegistrationModel, s: &State) -> bool {
    holds(invariants::inv1_publish_after_all, s)
}
fn inv2(_: &RegistrationModel, s: &State) -> bool {
    holds(invariants::inv2_no_orphan_installs, s)
}
fn inv3(_: &RegistrationModel, s: &State) -> bool {
    holds(invariants::inv3_uncertain_is_sticky, s)
}
fn inv4(_: &RegistrationModel, s: &State) -> bool {
    holds(invariants::inv4_refcount_sanity, s)
}
fn inv5(_: &RegistrationModel, s: &State) -> bool {
    holds(invariants::inv5_integrity, s)
}
fn inv6(_: &RegistrationModel, s: &State) -> bool {
    holds(invariants::inv6_handle_integrity, s)
}
fn inv7(_: &RegistrationModel, s: &State) -> bool {
    holds(invariants::inv7_no_staging_leak, s)
}
fn inv8(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::DISPATCH_UNSAFE == 0 && holds(invariants::inv8_dispatch_safety, s)
}
fn inv9(_: &RegistrationModel, s: &State) -> bool {
    holds(invariants::inv9_slots_stay_private, s)
}

/// Invariant 10's goal: every script operation finished and the parent
/// has no operation in flight.
fn all_complete(s: &State) -> bool {
    s.script_done() && s.parent.in_flight().is_empty()
}

fn inv10_terminal(m: &RegistrationModel, s: &State) -> bool {
    all_complete(s) || !m.is_terminal(s)
}
fn inv10_eventually(_: &RegistrationModel, s: &State) -> bool {
    all_complete(s)
}
fn driving_rule(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::DRIVER_ERROR == 0
}

fn publishes(_: &RegistrationModel, s: &State) -> bool {
    s.client
        .iter()
        .any(|c| matches!(c, StepStatus::Done(StepResult::Registered(_))))
}
fn rolls_back(_: &RegistrationModel, s: &State) -> bool {
    s.client.iter().any(|c| {
        matches!(
            c,
            StepStatus::Done(StepResult::Failed {
                rolled_back: true,
                ..
            })
        )
    })
}
fn uncertain(_: &RegistrationModel, s: &State) -> bool {
    !s.parent.uncertain_digests().is_empty()
}
fn slot_reuse(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::SLOT_REUSED_AFTER_TOMBSTONE != 0
}
fn interleave(_: &RegistrationModel, s: &State) -> bool {
    s.frames.iter().any(|(t, f)| {
        let ControlFrame::Register { digest, .. } = f else {
            return false;
        };
        s.frames.iter().any(|(u, g)| {
            u == t && matches!(g, ControlFrame::Unregister { digest: d, .. } if d == digest)
        })
    })
}
fn target_lost(_: &RegistrationModel, s: &State) -> bool {
    (0..s.targets.len())
        .filter_map(|i| u16::try_from(i).ok())
        .any(|i| !s.parent.is_target_live(callreg::protocol::TargetId(i)))
}
fn slot_exhausted(_: &RegistrationModel, s: &State) -> bool {
    s.replies.iter().any(|(_, r)| {
        matches!(&r.result, Err(f) if f.code == callreg::error::ErrorCode::LOCAL_SLOT_EXHAUSTED)
    })
}
fn late_reply(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::LATE_REPLY != 0
}

/// Every property, `always` ones first.
pub fn all() -> Vec<Property<RegistrationModel>> {
    vec![
        Property::always(INV1, inv1),
        Property::always(INV2, inv2),
        Property::always(INV3, inv3),
        Property::always(INV4, inv4),
        Property::always(INV5, inv5),
        Property::always(INV6, inv6),
        Property::always(INV7, inv7),
        Property::always(INV8, inv8),
        Property::always(INV9, inv9),
        Property::always(DRIVING_RULE, driving_rule),
        Property::always(INV10_TERMINAL, inv10_terminal),
        Property::eventually(INV10_EVENTUALLY, inv10_eventually),
        Property::sometimes(SOMETIMES_PUBLISH, publishes),
        Property::sometimes(SOMETIMES_ROLLBACK, rolls_back),
        Property::sometimes(SOMETIMES_UNCERTAIN, uncertain),
        Property::sometimes(SOMETIMES_SLOT_REUSE, slot_reuse),
        Property::sometimes(SOMETIMES_INTERLEAVE, interleave),
        Property::sometimes(SOMETIMES_LATE_REPLY, late_reply),
        Property::sometimes(SOMETIMES_TARGET_LOST, target_lost),
        Property::sometimes(SOMETIMES_SLOT_EXHAUSTED, slot_exhausted),
    ]
}

/// Why `state` breaks property `name`, for a counterexample's last state:
/// the library's violation text for invariants 1–9, a fixed explanation
/// for the others; `None` if it does not break it.
pub fn explain(model: &RegistrationModel, name: &str, state: &State) -> Option<String> {
    let by_number = |n: u8| {
        invariants::ALL
            .iter()
            .find(|(number, _, _)| *number == n)
            .and_then(|(_, _, predicate)| state.with_view(|view| predicate(view).err()))
            .map(|v| v.to_string())
    };
    let number: Option<u8> = name.split(' ').next().and_then(|n| n.parse().ok());
    match number {
        Some(8) if state.seen & seen::DISPATCH_UNSAFE != 0 => Some(
            "invariant 8 (dispatch safety) violated: a task for a live handle reached a live target lacking its digest"
                .to_owned(),
        ),
        Some(n @ 1..=9) => by_number(n),
        Some(10) => (!all_complete(state)).then(|| {
            format!(
                "invariant 10 (liveness) violated: no action is possible but operations {:?} did not complete",
                state.parent.in_flight()
            )
        }),
        _ if name == DRIVING_RULE && !driving_rule(model, state) => Some(
            "a machine refused an input the driving rule produced (see the last step)".to_owned(),
        ),
        _ => None,
    }
}
