//! The properties checked on every reachable state (`specs/model.md`).
//!
//! * `always` — specs/design.md §4.4 invariants 1–9, `specs/protocol.md`
//!   §2.9's invariants 11 and 12 and §2.11's invariant 13, each through the library's
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

use std::collections::BTreeMap;

use callreg::descriptor::Digest;
use callreg::protocol::{
    DigestCount, Lifecycle, Namespace, OpId, Seq, Slot, TargetId, TargetPhase, Time,
};

use crate::model::{
    seen, Ended, RegistrationModel, State, StepResult, StepStatus, CONTROL_TIMEOUT,
    OPERATION_TIMEOUT, OWNER, RESPAWN_BACKOFF,
};
use crate::script::{digest_of, name_of, CORRUPTED};

/// Name of the `always` property for invariant 1.
pub const INV1: &str = "1 publish after all";
/// Name of the `always` property for invariant 2.
pub const INV2: &str = "2 no orphan installs";
/// Name of the `always` property for invariant 3.
pub const INV3: &str = "3 nothing published while uncertain";
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
/// Name of the `always` property for invariant 11 (`specs/protocol.md`
/// §2.9).
pub const INV11: &str = "11 joined targets hold the registry";
/// Name of the `always` property for invariant 12 (`specs/protocol.md`
/// §2.9).
pub const INV12: &str = "12 no task before join";
/// Name of the `always` property for invariant 13 (`specs/protocol.md`
/// §2.11).
pub const INV13: &str = "13 tasks run on live incarnations";
/// Name of the `always` property for invariant 10 on terminal states.
pub const INV10_TERMINAL: &str = "10 liveness (terminal states)";
/// Name of the `eventually` property for invariant 10.
pub const INV10_EVENTUALLY: &str = "10 liveness (eventually)";
/// Name of the `always` property that the machines accept every input the
/// driver gives them.
pub const DRIVING_RULE: &str = "driving rule";
/// Name of the `always` property that a target heard from within the
/// control timeout about every control it owes is never fenced (nor timed
/// out) before one of those controls' operation bound
/// (`specs/protocol.md`, "Deadlines").
pub const HEARD_NOT_FENCED: &str = "heard targets wait for the bound";
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
/// Witness: an operation bound ends the wait for a target that reported
/// alive within the control timeout.
pub const SOMETIMES_BOUND: &str = "sometimes: the bound ends the wait for a target heard from";
/// Witness: a passed deadline ended the wait for some target but not for
/// one heard from within the control timeout (what "heard targets wait
/// for the bound" needs to mean anything).
pub const SOMETIMES_SPARED: &str = "sometimes: a passed deadline spares a target heard from";
/// Witness: a target that reported alive and then fell silent is fenced
/// (or times out) at its later silence deadline, before the bound.
pub const SOMETIMES_SILENT_AFTER_HEARD: &str =
    "sometimes: a target heard from and then silent meets its silence deadline";
/// Witness: an uncertain digest becomes certain again (§2.4).
pub const SOMETIMES_HEALED: &str = "sometimes: an uncertain digest heals";
/// Witness: a reply reaches the parent after its operation gave up.
pub const SOMETIMES_LATE_REPLY: &str = "sometimes: a reply arrives after its operation gave up";
/// Witness: one target has two deserializations in progress at once.
pub const SOMETIMES_TWO_DESERIALIZING: &str =
    "sometimes: a target has two deserializations in progress";
/// Witness: the Worker closes with an operation in flight.
pub const SOMETIMES_CLOSED_IN_FLIGHT: &str =
    "sometimes: the Worker closes with an operation in flight";
/// Witness: staging a register's payload fails.
pub const SOMETIMES_STAGE_FAILED: &str = "sometimes: staging a payload fails";
/// Witness: a pre-start step is called after start (and refused).
pub const SOMETIMES_PRE_START_AFTER_START: &str = "sometimes: a pre-start step comes after start";
/// Witness: an unregister fails (a target refused it or timed out).
pub const SOMETIMES_UNREGISTER_FAILED: &str = "sometimes: an unregister fails";
/// Witness: a reply names another digest than its frame.
pub const SOMETIMES_WRONG_DIGEST: &str = "sometimes: a reply names a wrong digest";
/// Witness: a replacement target joined (`specs/protocol.md` §2.9).
pub const SOMETIMES_JOINED: &str = "sometimes: a replacement joins";
/// Witness: a replacement joined while a client operation was in flight.
pub const SOMETIMES_JOINED_IN_FLIGHT: &str =
    "sometimes: a replacement joins with an operation in flight";
/// Witness: a joining replacement refused a replay or did not answer it
/// in time, and was fenced.
pub const SOMETIMES_JOIN_FAILED: &str = "sometimes: a join fails and its replacement is fenced";
/// Witness: a target was given up at the rate limit.
pub const SOMETIMES_ABANDONED: &str = "sometimes: a target is abandoned";
/// Witness: a replacement could not be started.
pub const SOMETIMES_SPAWN_FAILED: &str = "sometimes: a replacement fails to start";
/// Witness: a replay's payload could not be staged again, and the join
/// it was for failed.
pub const SOMETIMES_RESTAGE_FAILED: &str = "sometimes: a replay fails to stage and its join fails";
/// Witness: a target was abandoned after the template process was lost.
pub const SOMETIMES_ABANDONED_WITHOUT_TEMPLATE: &str =
    "sometimes: a target is abandoned after the template is lost";
/// Name of the `always` property that no replacement is asked for once
/// the template process is lost (`specs/protocol.md` §2.9).
pub const ALWAYS_NO_SPAWN_WITHOUT_TEMPLATE: &str =
    "no replacement is asked for after the template is lost";
/// Witness: the back-off before a replacement passed.
pub const SOMETIMES_BACKOFF: &str = "sometimes: a back-off before a replacement passes";
/// Witness: the Worker started (trivial unless start is an action).
pub const SOMETIMES_STARTED: &str = "sometimes: the Worker has started";

/// Name of the `always` property that on a path with no fault every
/// register publishes (or fails only for want of a free slot at some
/// target) and every unregister succeeds.
pub const PROGRESS: &str = "progress without faults";
/// Name of the `always` property that with fencing on (and no target
/// naming a wrong digest) no digest becomes uncertain and no reply is late.
pub const FENCED_CERTAIN: &str = "fencing: nothing uncertain, no late reply";
/// Name of the `always` property that every machine answered every call as
/// documented (completions agree with their outcomes, forged and
/// out-of-lifecycle inputs are refused with their errors).
pub const CONTRACT: &str = "machines answer as documented";
/// Name of the `always` property that a register that must probe first
/// (`specs/protocol.md` §2.8) sends its frame to one target, and to any
/// other only once some target confirmed it.
pub const PROBE_FIRST: &str = "probe first: one target before any other";
/// Name of the `always` property that a poisoned digest has no live
/// handle.
pub const POISON_NOT_PUBLISHED: &str = "a poisoned digest is never published";
/// Name of the `always` property that no register frame of a poisoned
/// digest is sent once it is poisoned.
pub const POISON_NOT_SENT: &str = "a poisoned digest is never sent again";
/// Name of the `always` property that a probe target fenced for silence
/// (no alive report for a control timeout: stopped, stalled) poisons
/// nothing (`specs/protocol.md` §2.8).
pub const SILENCE_POISONS_NOTHING: &str = "silence poisons nothing";
/// Name of the `always` property that a probe target fenced at the
/// operation bound poisons the digest it probed only if its last alive
/// report said the probe was running (`specs/protocol.md` §2.8): a probe
/// queued (behind a task that holds the interpreter, say) poisons nothing.
pub const QUEUED_POISONS_NOTHING: &str = "a queued probe poisons nothing";
/// Witness: a probe target heard from within the control timeout, whose
/// last alive report said the probe was queued, is fenced at the
/// operation bound and the digest is not poisoned.
pub const SOMETIMES_QUEUED_SPARED: &str =
    "sometimes: a probe queued past its bound is fenced and not poisoned";
/// Witness: a digest is poisoned (its probe target died deserializing it).
pub const SOMETIMES_POISONED: &str = "sometimes: a digest is poisoned";
/// Witness: a register is refused with `REGISTER_POISONED`.
pub const SOMETIMES_POISON_REFUSED: &str = "sometimes: a register of a poisoned digest is refused";
/// Name of the `always` property that a digest whose probe a target
/// refused as poisoned (`specs/protocol.md` §2.8 "A nested refusal") is
/// never sent again (by the driver's own record of the refusals).
pub const REFUSED_PROBE_NOT_SENT: &str =
    "a digest whose probe was refused as poisoned is never sent again";
/// Name of the `always` property that a refusal as poisoned from a target
/// that was not probing poisons nothing (§2.8 "A nested refusal").
pub const REFUSAL_OUTSIDE_PROBE_POISONS_NOTHING: &str =
    "a refusal as poisoned outside a probe poisons nothing";
/// Witness: a probe target refuses a register as poisoned.
pub const SOMETIMES_PROBE_REFUSED_POISONED: &str = "sometimes: a probe is refused as poisoned";
/// Witness: a target that was not probing refuses a register as poisoned.
pub const SOMETIMES_REFUSAL_OUTSIDE_PROBE: &str =
    "sometimes: a refusal as poisoned comes from a target that was not probing";
/// Name of the `always` property that with arrivals on
/// (`specs/protocol.md` §2.9 "Arrivals") an open target is never fenced
/// for not being ready: no `Fence` of a target waiting for its arrival,
/// and no passed deadline ends its wait.
pub const ARRIVAL_NOT_FENCED: &str = "an open target is never fenced for not being ready";
/// Name of the `always` property that with departures on
/// (`specs/protocol.md` §2.8 "A departure") a lost target poisons
/// nothing, whatever it was probing.
pub const DEPARTURE_POISONS_NOTHING: &str = "a departure poisons nothing";
/// Witness: with departures on, a target killed while it deserialized (a
/// poison payload) is reported as a departure.
pub const SOMETIMES_POISON_DEPARTED: &str =
    "sometimes: a target killed while deserializing departs";
/// Witness: with arrivals on, a replacement started at or after the time
/// an ordinary one would have been fenced for not being ready joins.
pub const SOMETIMES_LATE_ARRIVAL: &str =
    "sometimes: an arrival joins after its target was open for a control timeout";
/// Witness: a probed register is published with another target still
/// live (the probe confirmed, then the broadcast confirmed).
pub const SOMETIMES_PROBED_THEN_BROADCAST: &str =
    "sometimes: a probed register reaches every target";

/// Name of the `always` property that no task ends twice and, whenever
/// the parent is idle (so at every terminal state), every task submitted
/// has ended (`specs/protocol.md` §2.11).
pub const TASK_ONCE: &str = "every task completes exactly once";
/// Name of the `always` property that a task that ended cancelled never
/// started its run, and no run starts after its target answered a cancel
/// of it OK (§2.11).
pub const TASK_CANCELLED_NOT_RUN: &str = "a task is never both cancelled and run";
/// Name of the `always` property that no task's run starts twice.
pub const TASK_RUN_ONCE: &str = "a task never runs twice";
/// Name of the `always` property that a task ends with a result only when
/// the result came, while the parent counted it live, from the target and
/// incarnation the task was sent to (§2.11).
pub const TASK_RESULT_FROM_RUNNER: &str = "results only from the incarnation that ran the task";
/// Name of the `always` property that at a passed deadline every task in
/// flight past its deadline ends `Deadline` and its target is fenced
/// (§2.12).
pub const TASK_DEADLINE_FENCES: &str =
    "a task past its deadline ends Deadline and its target is fenced";
/// Witness: a task ends with its result.
pub const SOMETIMES_TASK_RESULT: &str = "sometimes: a task ends with its result";
/// Witness: a task is cancelled before it started (it ends cancelled).
pub const SOMETIMES_TASK_CANCELLED: &str = "sometimes: a task is cancelled before it starts";
/// Witness: a cancel is refused because its task started (or ended).
pub const SOMETIMES_CANCEL_REFUSED: &str = "sometimes: a cancel is refused because the task runs";
/// Witness: a run cancelled while queued reaches its start and is
/// skipped.
pub const SOMETIMES_RUN_SKIPPED: &str = "sometimes: a cancelled run is skipped at its start";
/// Witness: a task ends at its deadline.
pub const SOMETIMES_TASK_DEADLINE: &str = "sometimes: a task ends at its deadline";
/// Witness: a target's process retires after its task bound
/// (`specs/protocol.md` §2.14).
pub const SOMETIMES_RETIRED: &str = "sometimes: a target retires after its task bound";
/// Witness: a task that waited in the machine for a target (§2.14) ends
/// with its result.
pub const SOMETIMES_WAITED_RESULT: &str =
    "sometimes: a task that waited for a target ends with its result";
/// Witness: a task whose process was lost before it started is handed
/// to another process and ends with its result (`specs/protocol.md`
/// §2.15).
pub const SOMETIMES_HANDED_OVER: &str =
    "sometimes: a task its lost process never started runs elsewhere and ends with its result";
/// Witness: a stale result (of a lost process) is refused.
pub const SOMETIMES_STALE_REFUSED: &str = "sometimes: a stale result is refused";
/// Name of the `always` property that a control reply of a lost process
/// reaching the parent after the loss (a stale reply) changes nothing,
/// whatever the parent answers.
pub const STALE_REPLY_CHANGES_NOTHING: &str = "a stale reply changes nothing";
/// Witness: a stale reply reaches the parent while a later process of its
/// slot joins (`specs/protocol.md` §2.9).
pub const SOMETIMES_STALE_REPLY_JOINING: &str =
    "sometimes: a stale reply arrives while its target's replacement joins";
/// Witness: a stale reply reaches the parent after a later process of its
/// slot joined.
pub const SOMETIMES_STALE_REPLY_JOINED: &str =
    "sometimes: a stale reply arrives after its target's replacement joined";

/// Name of the `always` property that the machines' pure queries agree
/// with their state and with each other.
pub const QUERIES: &str = "queries agree with the machines";

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
    holds(invariants::inv3_nothing_published_while_uncertain, s)
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
fn inv11(_: &RegistrationModel, s: &State) -> bool {
    holds(invariants::inv11_joined_hold_registry, s)
}
fn inv12(_: &RegistrationModel, s: &State) -> bool {
    holds(invariants::inv12_no_task_before_join, s)
}
fn inv13(_: &RegistrationModel, s: &State) -> bool {
    holds(invariants::inv13_tasks_on_live_incarnations, s)
}

/// No task ended twice, and whenever the parent is idle (quiescence: at
/// every terminal state, by invariant 10) every task submitted has ended.
fn task_once(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::TASK_DONE_TWICE == 0
        && (!s.parent.is_idle() || s.task_log.iter().all(|n| n.ends == 1))
}
fn task_cancelled_not_run(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::CANCELLED_AND_RUN == 0
}
fn task_run_once(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::RUN_TWICE == 0
}
fn task_result_from_runner(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::FOREIGN_RESULT == 0
}
fn task_deadline_fences(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::DEADLINE_MISSED == 0
}
fn ended(s: &State, how: Ended) -> bool {
    s.task_log.iter().any(|n| n.end == Some(how))
}
fn task_result(_: &RegistrationModel, s: &State) -> bool {
    ended(s, Ended::Result)
}
fn task_cancelled(_: &RegistrationModel, s: &State) -> bool {
    ended(s, Ended::Cancelled)
}
fn task_deadline(_: &RegistrationModel, s: &State) -> bool {
    ended(s, Ended::Deadline)
}
fn retired(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::RETIRED != 0
}
fn waited_result(_: &RegistrationModel, s: &State) -> bool {
    s.task_log
        .iter()
        .any(|n| n.waited && n.end == Some(Ended::Result))
}
fn handed_over(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::HANDED_OVER != 0
        && s.task_log
            .iter()
            .any(|n| n.handed_over && n.end == Some(Ended::Result))
}
fn cancel_refused(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::CANCEL_REFUSED != 0
}
fn run_skipped(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::RUN_SKIPPED != 0
}
fn stale_refused(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::STALE_REFUSED != 0
}
fn stale_reply_changes_nothing(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::STALE_REPLY_CHANGED == 0
}
fn stale_reply_joining(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::STALE_REPLY_JOINING != 0
}
fn stale_reply_joined(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::STALE_REPLY_JOINED != 0
}

/// Invariant 10's goal: every script operation finished and the parent
/// is idle: no operation (replays included) in flight, and no replacement
/// being asked for (`specs/protocol.md` §2.9: a target backing off or
/// spawning still has work to do).
fn all_complete(s: &State) -> bool {
    s.script_done() && s.parent.is_idle()
}

fn inv10_terminal(m: &RegistrationModel, s: &State) -> bool {
    // A breached state ends its path: the breach is its violation.
    all_complete(s) || !m.is_terminal(s) || s.seen & seen::CONTRACT != 0
}
fn inv10_eventually(_: &RegistrationModel, s: &State) -> bool {
    all_complete(s) || s.seen & seen::CONTRACT != 0
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
fn heard_not_fenced(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::FENCED_WHILE_HEARD == 0
}
fn bound_ends_heard(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::BOUND_ENDED_HEARD != 0
}
fn spared_heard(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::SPARED_HEARD != 0
}
fn silent_after_heard(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::SILENT_AFTER_HEARD != 0
}
fn healed(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::HEALED != 0
}
fn late_reply(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::LATE_REPLY != 0
}

fn progress(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::UNFORCED_FAILURE == 0
}
fn fenced_certain(m: &RegistrationModel, s: &State) -> bool {
    !m.config.fence_on_timeout
        || s.seen & seen::WRONG_DIGEST != 0
        || (s.parent.uncertain_digests().is_empty() && s.seen & seen::LATE_REPLY == 0)
}
fn contract(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::CONTRACT == 0
}
fn queries(m: &RegistrationModel, s: &State) -> bool {
    queries_agree(m, s).is_ok()
}
fn two_deserializing(_: &RegistrationModel, s: &State) -> bool {
    s.sides.iter().any(|side| side.deserializing.len() >= 2)
}
fn closed_in_flight(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::CLOSED_IN_FLIGHT != 0
}
fn stage_failed(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::STAGE_FAILED != 0
}
fn pre_start_after_start(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::PRE_START_AFTER_START != 0
}
fn unregister_failed(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::UNREGISTER_FAILED != 0
}
fn wrong_digest(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::WRONG_DIGEST != 0
}
fn probe_first(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::PROBE_BROADCAST_EARLY == 0
}
fn poison_not_published(_: &RegistrationModel, s: &State) -> bool {
    s.parent
        .live_handles()
        .iter()
        .all(|h| !s.parent.is_poisoned(h.digest()))
}
fn poison_not_sent(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::POISON_SENT == 0
}
fn silence_poisons_nothing(_: &RegistrationModel, s: &State) -> bool {
    s.parent
        .poisoned_digests()
        .iter()
        .all(|(_, poison)| poison.cause != callreg::protocol::SILENT_FENCE_CAUSE)
}
fn queued_poisons_nothing(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::QUEUED_POISONED == 0
}
fn queued_spared(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::QUEUED_SPARED != 0
}
fn poisoned(_: &RegistrationModel, s: &State) -> bool {
    !s.parent.poisoned_digests().is_empty()
}
fn poison_refused(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::POISON_REFUSED != 0
}
fn refused_probe_not_sent(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::REFUSED_PROBE_SENT == 0
}
fn refusal_outside_probe_poisons_nothing(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::REFUSAL_OUTSIDE_PROBE_POISONED == 0
}
fn probe_refused_poisoned(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::PROBE_REFUSED_POISONED != 0
}
fn refusal_outside_probe(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::REFUSAL_OUTSIDE_PROBE != 0
}
fn arrival_not_fenced(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::ARRIVAL_FENCED == 0
}
fn departure_poisons_nothing(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::DEPARTURE_POISONED == 0
}
fn poison_departed(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::POISON_DEPARTED != 0
}
fn late_arrival(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::LATE_ARRIVAL_JOINED != 0
}
fn probed_then_broadcast(_: &RegistrationModel, s: &State) -> bool {
    s.client.iter().any(|c| {
        matches!(c, StepStatus::InFlight { probing: true, scope, .. } if scope.count_ones() >= 2)
    })
}
fn joined(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::JOINED != 0
}
fn joined_in_flight(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::JOINED_IN_FLIGHT != 0
}
fn join_failed(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::JOIN_FAILED != 0
}
fn abandoned(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::ABANDONED != 0
}
fn spawn_failed(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::SPAWN_FAILED != 0
}
fn restage_failed(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::RESTAGE_FAILED != 0 && s.seen & seen::JOIN_FAILED != 0
}
fn abandoned_without_template(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::ABANDONED_WITHOUT_TEMPLATE != 0
}
fn no_spawn_without_template(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::SPAWN_WITHOUT_TEMPLATE == 0
}
fn backoff_passed(_: &RegistrationModel, s: &State) -> bool {
    s.seen & seen::BACKOFF_PASSED != 0
}
fn started(_: &RegistrationModel, s: &State) -> bool {
    s.parent.lifecycle() != Lifecycle::New
}

/// Whether the machines' pure queries agree with their state, with each
/// other and with what the driver saw; otherwise the first disagreement.
///
/// Parent: the registry snapshot, the startup snapshot, `is_live`,
/// `is_uncertain`, `is_target_live`, `in_flight` (the client's operations
/// in flight), `is_idle`, `staged` (shared memory), `config`, and
/// `awaits_reply` for every reply in transit against what `handle_reply`
/// does with it (an awaited reply is consumed: handling it again is a
/// duplicate; a reply not awaited changes nothing but the uncertain set,
/// and handling it twice is like once). Targets: `tombstones`,
/// `tombstoned_slots`, `is_slot_used`, `slots_in_use`, `is_deserializing`,
/// `runs_in_progress`, `refcount`, `snapshot` and `config` against each
/// other and the slots the driver was given for deserializations and runs.
///
/// # Errors
/// The first query that disagrees, in words.
pub fn queries_agree(m: &RegistrationModel, s: &State) -> Result<(), String> {
    let p = &s.parent;
    let fail = |what: &str| Err(what.to_owned());
    let nobody = TargetId(m.config.targets);
    let lifecycle = p.lifecycle();
    let config = p.config();
    if config.targets != m.config.targets
        || config.slot_capacity != m.config.slot_capacity
        || config.fence_on_timeout != m.config.fence_on_timeout
        || config.probe_first != m.config.probe_first
        || config.respawn_limit != m.config.respawn_limit
        || config.respawn_backoff != RESPAWN_BACKOFF
        || config.unbounded_spawn != m.config.arrivals
        || config.owner != OWNER
        || config.control_timeout != CONTROL_TIMEOUT
        || config.operation_timeout != OPERATION_TIMEOUT
    {
        return fail("Parent::config differs from the configuration it was made with");
    }
    if p.is_target_live(nobody) || p.awaits_reply(nobody, Seq(1)) {
        return fail("the target id one past the last counts as live or awaited");
    }
    let live: Vec<TargetId> = (0..m.config.targets)
        .map(TargetId)
        .filter(|t| p.is_target_live(*t))
        .collect();
    if lifecycle != Lifecycle::Started && !live.is_empty() {
        return fail("a target is live although the Worker is not started");
    }
    if lifecycle == Lifecycle::New && s.targets.iter().any(Option::is_some) {
        return fail("a target runs although the parent is new");
    }
    let handles = p.live_handles();
    // Counted here, not with the library's `RegistrySnapshot::count_digests`
    // (which the snapshot itself uses: comparing the two would check nothing).
    let mut counts: BTreeMap<Digest, u32> = BTreeMap::new();
    for h in &handles {
        *counts.entry(h.digest()).or_insert(0) += 1;
    }
    let mut digests: Vec<DigestCount> = counts
        .iter()
        .map(|(d, n)| DigestCount {
            hashid: d.hashid(),
            live_handles: *n,
        })
        .collect();
    digests.sort();
    let snapshot = p.registry_snapshot();
    if snapshot.lifecycle != lifecycle
        || snapshot.live_targets != live
        || snapshot.handles != handles
        || snapshot.digests != digests
        || snapshot.uncertain
            != p.uncertain_digests()
                .iter()
                .map(|d| d.hashid())
                .collect::<Vec<_>>()
    {
        return fail("Parent::registry_snapshot disagrees with the other queries");
    }
    if p.startup_snapshot() != counts.iter().map(|(d, n)| (*d, *n)).collect::<Vec<_>>() {
        return fail("Parent::startup_snapshot does not count the live handles");
    }
    let uncertain = p.uncertain_digests();
    for c in 'A'..='Z' {
        let Some(d) = digest_of(c) else { continue };
        if p.is_live(d, Namespace::LocalPython) != counts.contains_key(&d)
            || p.is_live(d, Namespace::LocalChip)
        {
            return fail("Parent::is_live disagrees with the live handles");
        }
        if p.is_uncertain(d) != uncertain.contains(&d) {
            return fail("Parent::is_uncertain disagrees with Parent::uncertain_digests");
        }
        let poisoned = p.poisoned_digests();
        if p.is_poisoned(d) != poisoned.iter().any(|(x, _)| *x == d)
            || (p.is_poisoned(d) && p.is_proven(d))
            || p.is_proven(d) != s.proven.contains(&d)
        {
            return fail("Parent::is_poisoned or is_proven disagrees with the poisoned digests or the digests the driver saw installed, or a digest is both");
        }
    }
    let mut in_flight: Vec<OpId> = s
        .client
        .iter()
        .filter_map(|c| match c {
            StepStatus::InFlight { op, .. } => Some(*op),
            _ => None,
        })
        .collect();
    in_flight.sort();
    // A failed snapshot entry's settling unregisters (operations
    // `1..=settling`) are in flight with no client step waiting.
    // So are the replays to joining replacements (§2.9).
    let machine: Vec<OpId> = p
        .in_flight()
        .into_iter()
        .filter(|op| op.0 > s.settling && !s.replays.contains(op))
        .collect();
    let phases: Vec<TargetPhase> = (0..m.config.targets)
        .map(|t| p.target_phase(TargetId(t)))
        .collect();
    let replacing = lifecycle == Lifecycle::Started
        && phases
            .iter()
            .any(|ph| matches!(ph, TargetPhase::Spawning | TargetPhase::BackingOff(_)));
    // The tasks in flight are those the driver saw submitted and not
    // ended, each as it was sent; a cancel awaits its answer only for a
    // task it was sent (§2.11).
    let open_tasks: Vec<Seq> = s
        .task_log
        .iter()
        .filter(|n| n.ends == 0)
        .map(|n| n.seq)
        .collect();
    if lifecycle == Lifecycle::Started && p.tasks_in_flight() != open_tasks {
        return fail("Parent::tasks_in_flight disagrees with the tasks the driver saw submitted and not ended");
    }
    // A task waiting unsent (§2.14) names the target it waits for, which
    // may change; it awaits no cancel.
    for note in &s.task_log {
        let info = p.task(note.seq);
        let cancelling = p.awaits_cancel(note.target, note.seq);
        if info.is_some_and(|t| {
            t.sent != note.sent
                || (note.sent && (t.target, t.incarnation) != (note.target, note.incarnation))
                || t.cancelling != cancelling
                || t.deadline.map(|d| d.0) != note.deadline
        }) || (cancelling && note.cancelled_at.is_none())
        {
            return fail("Parent::task or awaits_cancel disagrees with the task as it was submitted and cancelled");
        }
    }
    let cancels = s.task_log.iter().any(|n| p.awaits_cancel(n.target, n.seq));
    let tasks_idle = p.tasks_in_flight().is_empty() && !cancels;
    if machine != in_flight
        || (p.is_idle() != (p.in_flight().is_empty() && tasks_idle && !replacing))
    {
        return fail(
            "Parent::in_flight or is_idle disagrees with the operations the client has in flight and the replacements asked for",
        );
    }
    for (index, phase) in phases.iter().enumerate() {
        let id = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
        let live = p.is_target_live(id);
        let consistent = match phase {
            TargetPhase::Joined => live || lifecycle != Lifecycle::Started,
            TargetPhase::Joining => live,
            TargetPhase::Spawning | TargetPhase::BackingOff(_) | TargetPhase::Lost => !live,
        };
        let spawning = *phase == TargetPhase::Spawning && lifecycle == Lifecycle::Started;
        let respawn = m.config.respawn_limit;
        if !consistent
            || p.is_target_joined(id) != (live && *phase != TargetPhase::Joining)
            || s.spawns[index].is_some() != spawning
            || s.spawns[index].is_some_and(|i| i != p.incarnation(id))
            || (respawn == 0
                && (p.incarnation(id) != 0
                    || !matches!(phase, TargetPhase::Joined | TargetPhase::Lost)))
            || (*phase != TargetPhase::Lost && p.failed_joins(id) >= respawn.max(1))
            || (*phase == TargetPhase::Lost
                && respawn > 0
                && p.failed_joins(id) != respawn
                && !p.are_replacements_ended()
                && lifecycle == Lifecycle::Started
                && p.incarnation(id) > 0)
            || (*phase == TargetPhase::Lost
                && p.failed_joins(id) > respawn
                && lifecycle == Lifecycle::Started)
        {
            return fail("Parent::target_phase, incarnation, failed_joins or is_target_joined disagree with each other, with is_target_live or with the replacements the driver was asked for");
        }
    }
    if p.staged() != s.staged.keys().copied().collect::<Vec<_>>() {
        return fail("Parent::staged disagrees with shared memory");
    }
    // The earliest back-off before a replacement (§2.9): at most
    // RESPAWN_BACKOFF doubled per failed join before it, still ahead.
    let backoff = phases
        .iter()
        .enumerate()
        .filter_map(|(index, ph)| match ph {
            TargetPhase::BackingOff(until) if lifecycle == Lifecycle::Started => {
                let id = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
                let n = u32::from(p.failed_joins(id)).saturating_sub(1).min(32);
                Some((*until, RESPAWN_BACKOFF << n))
            }
            _ => None,
        })
        .min();
    if backoff.is_some_and(|(until, most)| until.0 <= s.now || until.0 > s.now + most) {
        return fail("a back-off before a replacement is not ahead, or longer than its doubling");
    }
    let backoff = backoff.map(|(until, _)| until);
    // The earliest task deadline and, with fencing, silence deadline of an
    // unanswered cancel (§2.11, §2.12), by the driver's record.
    let tasks_due = s
        .task_log
        .iter()
        .filter_map(|n| {
            let deadline = n.deadline.filter(|_| p.task(n.seq).is_some());
            let silence = n
                .cancelled_at
                .filter(|_| m.config.fence_on_timeout && p.awaits_cancel(n.target, n.seq))
                .map(|at| at + CONTROL_TIMEOUT);
            deadline.into_iter().chain(silence).min()
        })
        .min()
        .map(Time);
    if tasks_due.is_some_and(|due| due.0 <= s.now || p.poll_timeout().is_none_or(|d| d > due)) {
        return fail("a task deadline or a cancel's silence deadline is not ahead, or Parent::poll_timeout is after it");
    }
    // The earliest ready deadline of a replacement asked for and not
    // started (§2.9), by the driver's record.
    let ready_due = s
        .spawn_due
        .iter()
        .enumerate()
        .filter(|(i, _)| phases.get(*i) == Some(&TargetPhase::Spawning))
        // An arrival has none (§2.9 "Arrivals"): `poll_timeout` must not
        // name one.
        .filter(|_| !m.config.arrivals)
        .filter_map(|(_, due)| *due)
        .min()
        .map(Time);
    if ready_due.is_some_and(|due| due.0 <= s.now || p.poll_timeout().is_none_or(|d| d > due)) {
        return fail(
            "a replacement's ready deadline is not ahead, or Parent::poll_timeout is after it",
        );
    }
    let op_deadline = p
        .poll_timeout()
        .filter(|d| Some(*d) != backoff && Some(*d) != tasks_due && Some(*d) != ready_due);
    if let Some(deadline) = p.poll_timeout() {
        if backoff.is_some_and(|b| b < deadline) {
            return fail("Parent::poll_timeout is after a back-off before a replacement");
        }
    }
    if let Some(deadline) = op_deadline {
        if p.in_flight().is_empty() {
            return fail("Parent::poll_timeout names a deadline with no operation in flight");
        }
        // Every deadline is set CONTROL_TIMEOUT after the time its phase
        // began (time 1 at the earliest); once a deadline passed, every
        // phase due by then stopped waiting.
        if deadline.0 <= CONTROL_TIMEOUT
            || deadline.0 > s.now + CONTROL_TIMEOUT
            || deadline.0 <= s.now
        {
            return fail("Parent::poll_timeout is not a deadline still ahead, CONTROL_TIMEOUT after its phase began");
        }
    }
    // The controls awaited from each target, with their bounds, agree
    // with `awaits_reply`, and the earliest bound is `poll_bound`: never
    // before `poll_timeout` (a target's deadline is the earlier of its
    // silence deadline and its bound), and OPERATION_TIMEOUT after its
    // phase began.
    let mut bounds = Vec::new();
    for id in (0..=m.config.targets).map(TargetId) {
        let awaited = p.awaited_controls(id);
        if awaited.windows(2).any(|w| w[0].0 >= w[1].0)
            || awaited.iter().any(|(seq, _)| !p.awaits_reply(id, *seq))
            || (id == nobody && !awaited.is_empty())
        {
            return fail("Parent::awaited_controls is not in seq order, or names a control awaits_reply denies");
        }
        bounds.extend(awaited.iter().map(|(_, bound)| *bound));
    }
    for (t, reply) in &s.replies {
        if p.awaits_reply(*t, reply.seq)
            && !p
                .awaited_controls(*t)
                .iter()
                .any(|(seq, _)| *seq == reply.seq)
        {
            return fail("Parent::awaited_controls misses a control awaits_reply names");
        }
    }
    let bound = p.poll_bound();
    let other = [backoff, tasks_due, ready_due].into_iter().flatten().min();
    if bound != bounds.iter().min().copied()
        || (bound.is_some() && p.poll_timeout().is_none())
        || (bound.is_none() && p.poll_timeout() != other)
        || bound.zip(p.poll_timeout()).is_some_and(|(b, d)| b < d)
        || bounds
            .iter()
            .any(|b| b.0 <= OPERATION_TIMEOUT || b.0 > s.now + OPERATION_TIMEOUT)
    {
        return fail("Parent::poll_bound is not the earliest bound of an awaited control, is before poll_timeout, or is not OPERATION_TIMEOUT after its phase began");
    }
    // A lost process's replies answer nothing the parent awaits from its
    // slot once it counts that process lost (a later process is sent only
    // seqs issued after it was started).
    if s.stale_replies.iter().any(|(t, incarnation, reply)| {
        let lost = !p.is_target_live(*t) || p.incarnation(*t) != *incarnation;
        lost && (p.awaits_reply(*t, reply.seq) || p.awaits_cancel(*t, reply.seq))
    }) {
        return fail("Parent::awaits_reply or awaits_cancel is true for a reply of a process the parent counts lost");
    }
    for (t, reply) in &s.replies {
        let awaited = p.awaits_reply(*t, reply.seq);
        if p.awaits_cancel(*t, reply.seq) {
            // The answer to a cancel: handled by the task rules (§2.11).
            continue;
        }
        if lifecycle != Lifecycle::Started {
            if awaited {
                return fail("Parent::awaits_reply is true after close");
            }
            continue;
        }
        let mut once = p.clone();
        if once.handle_reply(*t, reply.clone(), Time(s.now)).is_err() {
            continue; // the driving rule property reports it
        }
        let mut twice = once.clone();
        let _ = twice.handle_reply(*t, reply.clone(), Time(s.now));
        if awaited {
            if once.awaits_reply(*t, reply.seq) || once == *p {
                return fail("Parent::awaits_reply is true but handle_reply did not take the reply as awaited");
            }
        } else if p.awaits_heal(*t, reply.seq) {
            // Late, and awaited by a doubt (specs/protocol.md §2.4,
            // "Uncertainty heals"): it settles that doubt, and at most a heal
            // unregister to the same target follows.
            let heal = match once.poll_effect() {
                None => true,
                Some(callreg::protocol::Effect::Send {
                    target,
                    frame: ControlFrame::Unregister { seq, .. },
                }) => target == *t && seq != reply.seq && once.awaits_heal(*t, seq),
                Some(_) => false,
            };
            if once.awaits_heal(*t, reply.seq)
                || !heal
                || once.poll_effect().is_some()
                || once.in_flight() != p.in_flight()
                || once.live_handles() != handles
                || once
                    .uncertain_digests()
                    .iter()
                    .any(|d| !uncertain.contains(d) && *d != reply.digest)
            {
                return fail("Parent::awaits_heal is true but handle_reply did not settle the doubt that awaited the reply");
            }
        } else {
            let mut expected = uncertain.clone();
            if p.is_target_live(*t) && !expected.contains(&reply.digest) {
                expected.push(reply.digest);
                expected.sort();
            }
            if once != twice
                || once.in_flight() != p.in_flight()
                || once.live_handles() != handles
                || once.uncertain_digests() != expected
                || once.poll_effect().is_some()
            {
                return fail(
                    "Parent::awaits_reply is false but handle_reply took the reply as awaited",
                );
            }
        }
    }
    for (index, target) in s.targets.iter().enumerate() {
        let Some(target) = target else { continue };
        let side = &s.sides[index];
        let id = TargetId(u16::try_from(index).unwrap_or(u16::MAX));
        let capacity = m.config.slot_capacity;
        if target.config().id != id || target.config().slot_capacity != capacity {
            return fail("Target::config differs from the configuration it was made with");
        }
        let tombstoned = target.tombstoned_slots();
        if target.tombstones() != tombstoned.len() {
            return fail("Target::tombstones disagrees with Target::tombstoned_slots");
        }
        let used = (0..capacity)
            .filter(|i| target.is_slot_used(Slot(*i)))
            .count();
        if used != target.slots_in_use() || target.is_slot_used(Slot(capacity)) {
            return fail("Target::is_slot_used disagrees with Target::slots_in_use");
        }
        let installed = target.installed();
        if target.slots_in_use() != installed.len() + tombstoned.len() + side.deserializing.len() {
            return fail("a used slot is neither installed, tombstoned nor deserializing");
        }
        let run_slots: Vec<Slot> = side.runs.iter().map(|(_, slot, _)| *slot).collect();
        if tombstoned
            .iter()
            .any(|t| !run_slots.contains(t) || !target.is_slot_used(*t))
        {
            return fail("a tombstoned slot is held by no run, or not used");
        }
        let deserializing: Vec<Slot> = side.deserializing.iter().map(|(_, slot)| *slot).collect();
        if deserializing
            .iter()
            .chain(&run_slots)
            .any(|slot| !target.is_slot_used(*slot))
            || deserializing.iter().any(|slot| run_slots.contains(slot))
        {
            return fail("a slot given for a deserialization or a run is not used, or both");
        }
        if target.is_deserializing() == side.deserializing.is_empty()
            || target.runs_in_progress() != side.runs.len()
            || side
                .runs
                .iter()
                .any(|(seq, _, _)| target.is_started(*seq) != side.started.contains(seq))
            || side
                .runs
                .iter()
                .any(|(seq, _, _)| target.is_started(*seq) && target.is_cancelled(*seq))
        {
            return fail("Target::is_deserializing or runs_in_progress disagrees with the driver");
        }
        if installed
            .iter()
            .any(|(d, n)| *n == 0 || target.refcount(*d) != *n)
            || target.refcount(CORRUPTED) != 0
        {
            return fail("Target::refcount disagrees with Target::installed");
        }
        let snapshot = target.snapshot();
        if snapshot.target != id
            || snapshot.installed.len() != installed.len()
            || snapshot
                .installed
                .iter()
                .zip(&installed)
                .any(|(e, (d, n))| e.hashid != d.hashid() || e.refcount != *n)
        {
            return fail("Target::snapshot disagrees with Target::installed");
        }
    }
    Ok(())
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
        Property::always(INV11, inv11),
        Property::always(INV12, inv12),
        Property::always(INV13, inv13),
        Property::always(DRIVING_RULE, driving_rule),
        Property::always(HEARD_NOT_FENCED, heard_not_fenced),
        Property::always(INV10_TERMINAL, inv10_terminal),
        Property::always(PROGRESS, progress),
        Property::always(FENCED_CERTAIN, fenced_certain),
        Property::always(CONTRACT, contract),
        Property::always(QUERIES, queries),
        Property::always(PROBE_FIRST, probe_first),
        Property::always(POISON_NOT_PUBLISHED, poison_not_published),
        Property::always(POISON_NOT_SENT, poison_not_sent),
        Property::always(SILENCE_POISONS_NOTHING, silence_poisons_nothing),
        Property::always(QUEUED_POISONS_NOTHING, queued_poisons_nothing),
        Property::always(REFUSED_PROBE_NOT_SENT, refused_probe_not_sent),
        Property::always(
            REFUSAL_OUTSIDE_PROBE_POISONS_NOTHING,
            refusal_outside_probe_poisons_nothing,
        ),
        Property::always(ARRIVAL_NOT_FENCED, arrival_not_fenced),
        Property::always(DEPARTURE_POISONS_NOTHING, departure_poisons_nothing),
        Property::always(TASK_ONCE, task_once),
        Property::always(TASK_CANCELLED_NOT_RUN, task_cancelled_not_run),
        Property::always(TASK_RUN_ONCE, task_run_once),
        Property::always(TASK_RESULT_FROM_RUNNER, task_result_from_runner),
        Property::always(TASK_DEADLINE_FENCES, task_deadline_fences),
        Property::always(STALE_REPLY_CHANGES_NOTHING, stale_reply_changes_nothing),
        Property::eventually(INV10_EVENTUALLY, inv10_eventually),
        Property::sometimes(SOMETIMES_PUBLISH, publishes),
        Property::sometimes(SOMETIMES_ROLLBACK, rolls_back),
        Property::sometimes(SOMETIMES_UNCERTAIN, uncertain),
        Property::sometimes(SOMETIMES_SLOT_REUSE, slot_reuse),
        Property::sometimes(SOMETIMES_INTERLEAVE, interleave),
        Property::sometimes(SOMETIMES_LATE_REPLY, late_reply),
        Property::sometimes(SOMETIMES_HEALED, healed),
        Property::sometimes(SOMETIMES_TARGET_LOST, target_lost),
        Property::sometimes(SOMETIMES_SLOT_EXHAUSTED, slot_exhausted),
        Property::sometimes(SOMETIMES_TWO_DESERIALIZING, two_deserializing),
        Property::sometimes(SOMETIMES_CLOSED_IN_FLIGHT, closed_in_flight),
        Property::sometimes(SOMETIMES_STAGE_FAILED, stage_failed),
        Property::sometimes(SOMETIMES_PRE_START_AFTER_START, pre_start_after_start),
        Property::sometimes(SOMETIMES_UNREGISTER_FAILED, unregister_failed),
        Property::sometimes(SOMETIMES_WRONG_DIGEST, wrong_digest),
        Property::sometimes(SOMETIMES_STARTED, started),
        Property::sometimes(SOMETIMES_POISONED, poisoned),
        Property::sometimes(SOMETIMES_POISON_REFUSED, poison_refused),
        Property::sometimes(SOMETIMES_PROBED_THEN_BROADCAST, probed_then_broadcast),
        Property::sometimes(SOMETIMES_PROBE_REFUSED_POISONED, probe_refused_poisoned),
        Property::sometimes(SOMETIMES_REFUSAL_OUTSIDE_PROBE, refusal_outside_probe),
        Property::sometimes(SOMETIMES_BOUND, bound_ends_heard),
        Property::sometimes(SOMETIMES_SPARED, spared_heard),
        Property::sometimes(SOMETIMES_SILENT_AFTER_HEARD, silent_after_heard),
        Property::sometimes(SOMETIMES_QUEUED_SPARED, queued_spared),
        Property::sometimes(SOMETIMES_JOINED, joined),
        Property::sometimes(SOMETIMES_JOINED_IN_FLIGHT, joined_in_flight),
        Property::sometimes(SOMETIMES_JOIN_FAILED, join_failed),
        Property::sometimes(SOMETIMES_ABANDONED, abandoned),
        Property::sometimes(SOMETIMES_SPAWN_FAILED, spawn_failed),
        Property::sometimes(SOMETIMES_RESTAGE_FAILED, restage_failed),
        Property::sometimes(
            SOMETIMES_ABANDONED_WITHOUT_TEMPLATE,
            abandoned_without_template,
        ),
        Property::always(ALWAYS_NO_SPAWN_WITHOUT_TEMPLATE, no_spawn_without_template),
        Property::sometimes(SOMETIMES_BACKOFF, backoff_passed),
        Property::sometimes(SOMETIMES_LATE_ARRIVAL, late_arrival),
        Property::sometimes(SOMETIMES_POISON_DEPARTED, poison_departed),
        Property::sometimes(SOMETIMES_TASK_RESULT, task_result),
        Property::sometimes(SOMETIMES_TASK_CANCELLED, task_cancelled),
        Property::sometimes(SOMETIMES_CANCEL_REFUSED, cancel_refused),
        Property::sometimes(SOMETIMES_RUN_SKIPPED, run_skipped),
        Property::sometimes(SOMETIMES_TASK_DEADLINE, task_deadline),
        Property::sometimes(SOMETIMES_RETIRED, retired),
        Property::sometimes(SOMETIMES_WAITED_RESULT, waited_result),
        Property::sometimes(SOMETIMES_HANDED_OVER, handed_over),
        Property::sometimes(SOMETIMES_STALE_REFUSED, stale_refused),
        Property::sometimes(SOMETIMES_STALE_REPLY_JOINING, stale_reply_joining),
        Property::sometimes(SOMETIMES_STALE_REPLY_JOINED, stale_reply_joined),
    ]
}

/// Why `state` breaks property `name`, for a counterexample's last state:
/// the library's violation text for invariants 1–9 and 11–13, a fixed explanation
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
        Some(n @ (1..=9 | 11..=13)) => by_number(n),
        Some(10) => (!all_complete(state)).then(|| {
            let waiting: Vec<String> = (0..model.config.targets)
                .map(TargetId)
                .filter(|t| {
                    matches!(
                        state.parent.target_phase(*t),
                        TargetPhase::Spawning | TargetPhase::BackingOff(_)
                    )
                })
                .map(|t| t.to_string())
                .collect();
            let tasks = state.parent.tasks_in_flight();
            format!(
                "invariant 10 (liveness) violated: no action is possible but operations {:?}{} did not complete{}",
                state.parent.in_flight(),
                if tasks.is_empty() {
                    String::new()
                } else {
                    format!(" and tasks {tasks:?}")
                },
                if waiting.is_empty() {
                    String::new()
                } else {
                    format!(", and targets [{}] wait for a replacement", waiting.join(", "))
                }
            )
        }),
        _ if name == HEARD_NOT_FENCED && !heard_not_fenced(model, state) => Some(
            "invariant \"heard targets wait for the bound\" (specs/protocol.md §2.7) violated: a passed deadline ended the wait for a target heard from within the control timeout, before any operation bound (see the last step)".to_owned(),
        ),
        _ if name == DRIVING_RULE && !driving_rule(model, state) => Some(
            "a machine refused an input the driving rule produced (see the last step)".to_owned(),
        ),
        _ if name == PROGRESS && !progress(model, state) => Some(
            "an operation failed or was refused on a path with no fault (not for want of a free slot)".to_owned(),
        ),
        _ if name == FENCED_CERTAIN && !fenced_certain(model, state) => Some(format!(
            "with fencing on, uncertain digests {:?} / a late reply (see the trace)",
            state.parent.uncertain_digests().iter().map(name_of).collect::<Vec<_>>()
        )),
        _ if name == CONTRACT && !contract(model, state) => Some(state.contract.to_owned()),
        _ if name == QUERIES => queries_agree(model, state).err(),
        _ if name == PROBE_FIRST && !probe_first(model, state) => Some(
            "a register that had to probe first sent its frame to a second target before any target confirmed it".to_owned(),
        ),
        _ if name == POISON_NOT_PUBLISHED && !poison_not_published(model, state) => Some(
            "a poisoned digest has a live handle".to_owned(),
        ),
        _ if name == POISON_NOT_SENT && !poison_not_sent(model, state) => Some(
            "a register frame of a poisoned digest was sent".to_owned(),
        ),
        _ if name == SILENCE_POISONS_NOTHING && !silence_poisons_nothing(model, state) => Some(
            "a probe target fenced for silence (no alive report for a control timeout) poisoned the digest it probed".to_owned(),
        ),
        _ if name == QUEUED_POISONS_NOTHING && !queued_poisons_nothing(model, state) => Some(
            "a probe target fenced at the operation bound poisoned the digest it probed although its last alive report said the probe was queued (see the last step)".to_owned(),
        ),
        _ if name == REFUSED_PROBE_NOT_SENT && !refused_probe_not_sent(model, state) => Some(
            "a register frame of a digest whose probe was refused as poisoned was sent after the refusal reached the parent".to_owned(),
        ),
        _ if name == REFUSAL_OUTSIDE_PROBE_POISONS_NOTHING
            && !refusal_outside_probe_poisons_nothing(model, state) => Some(
            "a refusal as poisoned from a target that was not probing poisoned a digest (see the last step)".to_owned(),
        ),
        _ if name == DEPARTURE_POISONS_NOTHING && !departure_poisons_nothing(model, state) => Some(
            "with departures on, a target that left while probing poisoned the digest it probed (see the last step)".to_owned(),
        ),
        _ if name == ARRIVAL_NOT_FENCED && !arrival_not_fenced(model, state) => Some(
            "with arrivals on, a target waiting for its arrival was fenced, or a passed deadline ended its wait (see the last step)".to_owned(),
        ),
        _ if name == TASK_ONCE && !task_once(model, state) => Some(if state.seen & seen::TASK_DONE_TWICE != 0 {
            "a task ended twice (see the last step)".to_owned()
        } else {
            let open: Vec<String> = state
                .task_log
                .iter()
                .filter(|n| n.ends == 0)
                .map(|n| n.seq.to_string())
                .collect();
            format!("the parent is idle but tasks [{}] never ended", open.join(", "))
        }),
        _ if name == TASK_CANCELLED_NOT_RUN && !task_cancelled_not_run(model, state) => Some(
            "a task ended cancelled although its run started, or its run started after its cancel was answered OK (see the last step)".to_owned(),
        ),
        _ if name == TASK_RUN_ONCE && !task_run_once(model, state) => Some(
            "a task's run started a second time".to_owned(),
        ),
        _ if name == TASK_RESULT_FROM_RUNNER && !task_result_from_runner(model, state) => Some(
            "a task ended with a result that did not come, live, from the target and incarnation it was sent to (see the last step)".to_owned(),
        ),
        _ if name == TASK_DEADLINE_FENCES && !task_deadline_fences(model, state) => Some(
            "at a passed deadline a task past its deadline did not end Deadline, or its target was not fenced".to_owned(),
        ),
        _ if name == STALE_REPLY_CHANGES_NOTHING && !stale_reply_changes_nothing(model, state) => Some(
            "a reply of a lost process, reaching the parent after the loss, changed the parent (see the last step)".to_owned(),
        ),
        _ => None,
    }
}
