//! The named configuration set (`callreg-model check --config NAME`,
//! `check --all`; `specs/model.md` §7): configurations that together reach
//! every code path of the machines, each with the `sometimes` witnesses it
//! must produce. A new protocol rule gets its configuration here (a row of
//! [`all`]) with its expected witnesses, and its pinned state count in
//! `model/tests/configurations.rs`.

use crate::model::ModelConfig;
use crate::properties::*;
use crate::script::Script;

/// One named configuration of the set.
#[derive(Clone, Debug)]
pub struct Named {
    /// Its name (`--config NAME`).
    pub name: &'static str,
    /// What it reaches that the others do not.
    pub description: &'static str,
    /// The configuration.
    pub config: ModelConfig,
    /// Whether it is checked with symmetry reduction (depth first).
    pub symmetry: bool,
    /// The `sometimes` properties it must witness beyond those
    /// [`derived_expectations`] gives for any configuration.
    pub expected: &'static [&'static str],
}

impl Named {
    /// Every `sometimes` property this configuration must witness: the
    /// derived ones and its own, without repeats, in property order.
    pub fn expectations(&self) -> Vec<&'static str> {
        let mut all = derived_expectations(&self.config);
        all.extend(self.expected.iter().copied());
        order(all)
    }
}

fn order(mut names: Vec<&'static str>) -> Vec<&'static str> {
    let rank = |name: &str| {
        crate::properties::all()
            .iter()
            .position(|p| p.name == name)
            .unwrap_or(usize::MAX)
    };
    names.sort_by_key(|n| rank(n));
    names.dedup();
    names
}

/// The `sometimes` properties any configuration must witness, from its
/// fault budgets and options alone: the Worker starts and (with a register
/// in the script) a register publishes; a crash loses a target; fencing
/// off with a deadline makes a digest uncertain and a reply late; a
/// staging failure, a close with a register in the script, a wrong-digest
/// reply and, with `interleave_start`, a pre-start step after start are
/// each witnessed when their budget allows them; with probe-first on, a
/// register on more than one target probes then broadcasts, and a way to
/// lose the probe target (a poison kill, a crash, fencing at a bound while
/// heartbeats report it running, a refusal as poisoned) poisons a digest, and a later register of that digest is refused;
/// a refusal as poisoned comes from the probe and, with more than one
/// target, from a target that was not probing; with
/// replacement targets on, a way to lose a target makes a replacement
/// join, and a spawn failure in the budget happens.
pub fn derived_expectations(config: &ModelConfig) -> Vec<&'static str> {
    use crate::script::Operation;
    let registers = config
        .script
        .operations
        .iter()
        .any(|s| matches!(s.operation, Operation::Register(_)));
    let mut expected = vec![SOMETIMES_STARTED];
    if registers {
        expected.push(SOMETIMES_PUBLISH);
    }
    if (config.crashes > 0 || config.poison_kills > 0) && registers {
        expected.push(SOMETIMES_TARGET_LOST);
    }
    if !config.fence_on_timeout && config.deadlines > 0 && registers {
        expected.push(SOMETIMES_UNCERTAIN);
        expected.push(SOMETIMES_LATE_REPLY);
        expected.push(SOMETIMES_HEALED);
    }
    if config.stage_failures > 0 && registers {
        expected.push(SOMETIMES_STAGE_FAILED);
    }
    if config.closes > 0 && registers {
        expected.push(SOMETIMES_CLOSED_IN_FLIGHT);
    }
    if config.wrong_digests > 0 && registers {
        expected.push(SOMETIMES_WRONG_DIGEST);
    }
    if config.interleave_start && !config.script.before_start.is_empty() {
        expected.push(SOMETIMES_PRE_START_AFTER_START);
    }
    if config.probe_first && registers && config.targets > 1 {
        expected.push(SOMETIMES_PROBED_THEN_BROADCAST);
    }
    // A probe target lost while it deserializes poisons the digest: a
    // poison payload, a crash, or fencing at an operation's bound while it
    // reported the probe running (heartbeats); fencing for silence, or at
    // the bound while it reported the probe queued, poisons nothing
    // (specs/protocol.md §2.8).
    // A probe refused as poisoned by a target that is itself a registry
    // poisons it too (§2.8 "A nested refusal").
    // A departure is no evidence (§2.8 "A departure"): with every loss one,
    // only a nested refusal or a bound fence poisons.
    let deaths = !config.departures && (config.poison_kills > 0 || config.crashes > 0);
    let kills = deaths
        || config.poison_refusals > 0
        || (config.fence_on_timeout && config.deadlines > 0 && config.heartbeats > 0);
    if config.poison_refusals > 0 && registers {
        if config.probe_first {
            expected.push(SOMETIMES_PROBE_REFUSED_POISONED);
        }
        if config.targets > 1 || !config.probe_first {
            expected.push(SOMETIMES_REFUSAL_OUTSIDE_PROBE);
        }
    }
    if config.probe_first && registers && kills {
        expected.push(SOMETIMES_POISONED);
        // A later register of the same digest is then refused.
        let mut names: Vec<char> = config
            .script
            .operations
            .iter()
            .filter_map(|s| match s.operation {
                Operation::Register(c) => Some(c),
                Operation::Unregister(_) => None,
            })
            .collect();
        let all = names.len();
        names.sort_unstable();
        names.dedup();
        if names.len() < all {
            expected.push(SOMETIMES_POISON_REFUSED);
        }
    }
    // Tasks (specs/protocol.md §2.11, §2.12): a task submitted for a live
    // handle ends with its result; with cancels, one is cancelled before
    // it starts (its run then skipped) and one refused once it runs; with
    // task deadlines and a deadline to pass, one ends at its deadline, and
    // with stale results the fenced process's result is refused.
    let handles = registers
        || config
            .script
            .before_start
            .iter()
            .any(|s| matches!(s, crate::script::BeforeStart::Register(_)));
    if config.tasks > 0 && handles {
        expected.push(SOMETIMES_TASK_RESULT);
        if config.cancels > 0 {
            expected.push(SOMETIMES_TASK_CANCELLED);
            expected.push(SOMETIMES_CANCEL_REFUSED);
            expected.push(SOMETIMES_RUN_SKIPPED);
        }
        if config.task_deadline && config.deadlines > 0 {
            expected.push(SOMETIMES_TASK_DEADLINE);
            if config.stale_results > 0 {
                expected.push(SOMETIMES_STALE_REFUSED);
            }
        }
    }
    let loses = config.crashes > 0 || config.poison_kills > 0;
    if config.respawn_limit > 0 && registers && loses {
        expected.push(SOMETIMES_JOINED);
        // Once the template is lost, every spawn fails.
        if config.spawn_failures > 0 || config.template_losses > 0 {
            expected.push(SOMETIMES_SPAWN_FAILED);
        }
        if config.restage_failures > 0 {
            expected.push(SOMETIMES_RESTAGE_FAILED);
        }
        if config.template_losses > 0 {
            expected.push(SOMETIMES_ABANDONED_WITHOUT_TEMPLATE);
        }
    }
    order(expected)
}

fn script(name: &str) -> Script {
    Script::named(name).unwrap_or_else(|| Script::builtin().remove(0))
}

/// The `poison` configuration: 3 targets, the poison script, one
/// install that kills its target, one deadline, no other fault.
fn poison_config() -> ModelConfig {
    ModelConfig {
        targets: 3,
        script: poison_script(),
        crashes: 0,
        deserialize_failures: 0,
        corruptions: 0,
        deadlines: 1,
        tasks: 0,
        poison_kills: 1,
        ..ModelConfig::standard()
    }
}

/// The poison configuration's script: two concurrent registers of `A`
/// (the second waits on the first's deserialization at the probe target),
/// then, once both finished, a third.
pub fn poison_script() -> Script {
    use crate::script::{Operation, Step};
    let register = |after: &[usize]| Step {
        operation: Operation::Register('A'),
        after: after.to_vec(),
    };
    Script {
        name: "poison-retry".into(),
        description: "two concurrent registers of A, then a third once both finished".into(),
        before_start: vec![],
        operations: vec![register(&[]), register(&[]), register(&[0, 1])],
    }
}

/// Every named configuration, in the order `check --all` runs them
/// (cheapest first, so that a broken property is found soon).
pub fn all() -> Vec<Named> {
    let standard = ModelConfig::standard();
    let two = |name: &str| ModelConfig {
        targets: 2,
        script: script(name),
        ..ModelConfig::standard()
    };
    vec![
        Named {
            name: "forged",
            description: "2 targets, single-register, fencing off: forged and out-of-range inputs in every state (alive reports too), a reply naming a wrong digest, a deadline, a heartbeat, a close",
            config: ModelConfig {
                forged: true,
                heartbeats: 1,
                wrong_digests: 1,
                closes: 1,
                fence_on_timeout: false,
                corruptions: 0,
                ..two("single-register")
            },
            symmetry: false,
            // With probe-first one target waits at a time: no deadline
            // spares another (the heartbeat configurations witness it).
            expected: &[SOMETIMES_ROLLBACK, SOMETIMES_SILENT_AFTER_HEARD],
        },
        Named {
            name: "refused-unregister",
            description: "2 targets, register-unregister-same-digest, a reply naming a wrong digest and no other fault: a refused register and a refused unregister",
            config: ModelConfig {
                wrong_digests: 1,
                crashes: 0,
                deserialize_failures: 0,
                corruptions: 0,
                deadlines: 0,
                tasks: 0,
                ..two("register-unregister-same-digest")
            },
            symmetry: false,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_UNCERTAIN,
                SOMETIMES_INTERLEAVE,
                SOMETIMES_UNREGISTER_FAILED,
            ],
        },
        Named {
            name: "staging",
            description: "2 targets, duplicate-register, a staging failure, a crash, a failed deserialization, a deadline",
            config: ModelConfig {
                stage_failures: 1,
                corruptions: 0,
                tasks: 0,
                ..two("duplicate-register")
            },
            symmetry: false,
            expected: &[SOMETIMES_ROLLBACK, SOMETIMES_INTERLEAVE],
        },
        Named {
            name: "close",
            description: "2 targets, register-unregister-same-digest, close with operations in flight, a crash, a deadline, a task, forged inputs",
            config: ModelConfig {
                closes: 1,
                forged: true,
                corruptions: 0,
                deserialize_failures: 0,
                ..two("register-unregister-same-digest")
            },
            symmetry: false,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_SLOT_REUSE,
                SOMETIMES_INTERLEAVE,
            ],
        },
        Named {
            name: "two-deserializations",
            description: "2 targets, two-digests: two deserializations in flight on one target, every fault",
            config: two("two-digests"),
            symmetry: false,
            expected: &[SOMETIMES_TWO_DESERIALIZING, SOMETIMES_ROLLBACK],
        },
        Named {
            name: "pre-start",
            description: "2 targets, snapshot-then-operations with pre-start steps and start as actions (steps after start are refused), a crash, a deadline, a task, forged inputs",
            config: ModelConfig {
                interleave_start: true,
                forged: true,
                corruptions: 0,
                deserialize_failures: 0,
                ..two("snapshot-then-operations")
            },
            symmetry: false,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_SLOT_REUSE,
                SOMETIMES_SLOT_EXHAUSTED,
            ],
        },
        Named {
            name: "snapshot-failure",
            description: "2 targets, snapshot-then-operations, the startup snapshot's first digest failing on target 1 (settled at start, specs/protocol.md §2.6), every fault",
            config: ModelConfig {
                snapshot_failures: vec![1],
                ..two("snapshot-then-operations")
            },
            symmetry: false,
            expected: &[SOMETIMES_ROLLBACK],
        },
        Named {
            name: "poison",
            description: "3 targets, two concurrent registers of A then a third, the first install of A killing its target (a poison payload, specs/protocol.md §2.8), a deadline",
            config: poison_config(),
            symmetry: true,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_INTERLEAVE,
            ],
        },
        Named {
            name: "poison-departures",
            description: "poison with every loss a departure (specs/protocol.md §2.8 \"A departure\", as a cluster's registry reports a worker that left or was killed): the probe target killed while deserializing A poisons nothing, and A is probed again",
            config: ModelConfig {
                departures: true,
                ..poison_config()
            },
            symmetry: true,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_INTERLEAVE,
                SOMETIMES_POISON_DEPARTED,
            ],
        },
        Named {
            name: "poison-nested",
            description: "3 targets, two concurrent registers of A then a third, the first install of A refused as poisoned by its target, itself a registry whose own probe lost a process (a nested refusal, specs/protocol.md §2.8), no other fault: a probe's refusal poisons the digest, a broadcast target's poisons nothing",
            config: ModelConfig {
                targets: 3,
                script: poison_script(),
                crashes: 0,
                deserialize_failures: 0,
                corruptions: 0,
                deadlines: 0,
                tasks: 0,
                poison_refusals: 1,
                ..ModelConfig::standard()
            },
            symmetry: true,
            expected: &[SOMETIMES_ROLLBACK, SOMETIMES_INTERLEAVE],
        },
        Named {
            name: "heartbeat-no-fence",
            description: "2 targets, single-register, every fault, fencing off, 2 heartbeats and 2 deadlines (specs/protocol.md §2.7), probe-first off so that both targets wait at once: a target heard from outlives the others' timeouts, then meets its silence deadline or the bound",
            config: ModelConfig {
                heartbeats: 2,
                deadlines: 2,
                fence_on_timeout: false,
                probe_first: false,
                ..two("single-register")
            },
            symmetry: false,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_BOUND,
                SOMETIMES_SPARED,
                SOMETIMES_SILENT_AFTER_HEARD,
            ],
        },
        Named {
            name: "heartbeat",
            description: "2 targets, duplicate-register (controls queued behind each other), a failed deserialization, 2 heartbeats and 2 deadlines, fencing on (specs/protocol.md §2.7): a target heard from is spared while silent ones are fenced, then meets its silence deadline or the bound; a probe fenced at the bound poisons its digest only if reported running (§2.8)",
            config: ModelConfig {
                heartbeats: 2,
                deadlines: 2,
                crashes: 0,
                corruptions: 0,
                tasks: 0,
                ..two("duplicate-register")
            },
            symmetry: false,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_INTERLEAVE,
                SOMETIMES_TARGET_LOST,
                SOMETIMES_BOUND,
                SOMETIMES_SPARED,
                SOMETIMES_SILENT_AFTER_HEARD,
                SOMETIMES_QUEUED_SPARED,
            ],
        },
        Named {
            name: "respawn",
            description: "2 targets, register-unregister-same-digest, replacement targets with a rate limit of 1 (specs/protocol.md §2.9), a crash, a failed deserialization, a task, fencing on: a replacement joins with operations in flight, or its replay fails and the slot is abandoned",
            config: ModelConfig {
                respawn_limit: 1,
                corruptions: 0,
                deadlines: 0,
                ..two("register-unregister-same-digest")
            },
            symmetry: false,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_SLOT_REUSE,
                SOMETIMES_INTERLEAVE,
                SOMETIMES_JOINED_IN_FLIGHT,
                SOMETIMES_JOIN_FAILED,
                SOMETIMES_ABANDONED,
                SOMETIMES_HANDED_OVER,
            ],
        },
        Named {
            name: "respawn-no-fence",
            description: "2 targets, register-unregister-same-digest, replacement targets with a rate limit of 2, a crash, a failed deserialization, a deadline, a lost template, fencing off (a joining replacement is fenced all the same): a failed join backs off, its successor joins or the slot is abandoned, at once when the template is gone",
            config: ModelConfig {
                respawn_limit: 2,
                template_losses: 1,
                fence_on_timeout: false,
                corruptions: 0,
                tasks: 0,
                ..two("register-unregister-same-digest")
            },
            symmetry: false,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_INTERLEAVE,
                SOMETIMES_UNREGISTER_FAILED,
                SOMETIMES_JOINED_IN_FLIGHT,
                SOMETIMES_JOIN_FAILED,
                SOMETIMES_ABANDONED,
                SOMETIMES_BACKOFF,
            ],
        },
        Named {
            name: "respawn-spawn-failure",
            description: "2 targets, duplicate-register, replacement targets with a rate limit of 2, a replacement that fails to start, a replay that fails to stage, a crash, a deadline, fencing on: registers issued while a replacement joins, a silent replacement fenced, a replay withdrawn, back-offs, abandoned slots",
            config: ModelConfig {
                respawn_limit: 2,
                spawn_failures: 1,
                restage_failures: 1,
                corruptions: 0,
                deserialize_failures: 0,
                tasks: 0,
                ..two("duplicate-register")
            },
            symmetry: false,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_INTERLEAVE,
                SOMETIMES_JOINED_IN_FLIGHT,
                SOMETIMES_JOIN_FAILED,
                SOMETIMES_ABANDONED,
                SOMETIMES_BACKOFF,
            ],
        },
        Named {
            name: "respawn-stale-replies",
            description: "2 targets, register-unregister-same-digest, replacement targets with a rate limit of 1, a stale reply, a crash, a deadline, fencing on, no task: a reply a lost process wrote (or would have written) reaches the parent after the loss, before its target's replacement started, while it joins or after it joined, and changes nothing",
            config: ModelConfig {
                respawn_limit: 1,
                stale_replies: 1,
                corruptions: 0,
                deserialize_failures: 0,
                tasks: 0,
                ..two("register-unregister-same-digest")
            },
            symmetry: false,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_INTERLEAVE,
                SOMETIMES_JOINED_IN_FLIGHT,
                SOMETIMES_JOIN_FAILED,
                SOMETIMES_ABANDONED,
                SOMETIMES_STALE_REPLY_JOINING,
                SOMETIMES_STALE_REPLY_JOINED,
            ],
        },
        Named {
            name: "respawn-arrivals",
            description: "2 targets, register-unregister-same-digest, replacement targets that are arrivals (no ready deadline, specs/protocol.md §2.9 \"Arrivals\") with a rate limit of 2, a crash, a deadline, fencing on, no other fault: an open target waits for its arrival while a deadline passes far beyond a control timeout, is never fenced for it, and joins",
            config: ModelConfig {
                respawn_limit: 2,
                arrivals: true,
                deserialize_failures: 0,
                corruptions: 0,
                tasks: 0,
                ..two("register-unregister-same-digest")
            },
            symmetry: false,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_INTERLEAVE,
                SOMETIMES_JOINED_IN_FLIGHT,
                SOMETIMES_JOIN_FAILED,
                SOMETIMES_BACKOFF,
                SOMETIMES_LATE_ARRIVAL,
            ],
        },
        Named {
            name: "tasks-cancel",
            description: "1 target, single-register, 2 tasks, 1 cancel, no fault (specs/protocol.md §2.11): a cancel races the start of a run (cancelled while queued and skipped, or refused once running or ended), the answer races the result",
            config: ModelConfig {
                tasks: 2,
                cancels: 1,
                ..ModelConfig::fault_free(1, script("single-register"))
            },
            symmetry: false,
            expected: &[],
        },
        Named {
            name: "tasks-deadline",
            description: "1 target, single-register, 2 tasks with deadlines, a cancel, a deadline, a stale result, replacement targets with a rate limit of 1 (specs/protocol.md §2.11, §2.12): the first deadline ends its task and fences the target (the other task ends lost), a replacement joins, the fenced process's result arrives late and is refused",
            config: ModelConfig {
                tasks: 2,
                cancels: 1,
                task_deadline: true,
                deadlines: 1,
                stale_results: 1,
                respawn_limit: 1,
                ..ModelConfig::fault_free(1, script("single-register"))
            },
            symmetry: false,
            expected: &[
                SOMETIMES_TARGET_LOST,
                SOMETIMES_JOINED,
                SOMETIMES_HANDED_OVER,
            ],
        },
        Named {
            name: "retire",
            description: "2 targets, single-register, 2 tasks submitted with no target, a bound of 1 task per process, replacement targets with a rate limit of 1, a crash, a cancel (specs/protocol.md §2.14): the parent places each task, a process retires once its task ended and a process that joins takes the task that waited; a crash while a task waits costs that task nothing; a cancel ends a waiting task at once",
            config: ModelConfig {
                tasks: 2,
                cancels: 1,
                crashes: 1,
                submit_any: true,
                max_tasks_per_target: 1,
                respawn_limit: 1,
                ..ModelConfig::fault_free(2, script("single-register"))
            },
            symmetry: false,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_TARGET_LOST,
                SOMETIMES_JOINED,
                SOMETIMES_JOINED_IN_FLIGHT,
                SOMETIMES_ABANDONED,
                SOMETIMES_RETIRED,
                SOMETIMES_WAITED_RESULT,
                SOMETIMES_HANDED_OVER,
            ],
        },
        Named {
            name: "handover",
            description: "2 targets, single-register, 3 tasks with deadlines submitted with no target, a crash, a deadline, a cancel (specs/protocol.md §2.12, §2.15): a deadline runs from the task's start report; a task its lost process never reported started goes to the other target and runs there once, one it started ends lost",
            config: ModelConfig {
                tasks: 3,
                cancels: 1,
                crashes: 1,
                task_deadline: true,
                deadlines: 1,
                submit_any: true,
                ..ModelConfig::fault_free(2, script("single-register"))
            },
            symmetry: false,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_TARGET_LOST,
                SOMETIMES_HANDED_OVER,
            ],
        },
        Named {
            name: "standard",
            description: "3 targets, register-unregister-same-digest, every fault, fencing on",
            config: standard.clone(),
            symmetry: true,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_SLOT_REUSE,
                SOMETIMES_INTERLEAVE,
            ],
        },
        Named {
            name: "no-probe",
            description: "the standard configuration with probe-first off: every register goes to every live target at once",
            config: ModelConfig {
                probe_first: false,
                ..standard.clone()
            },
            symmetry: true,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_SLOT_REUSE,
                SOMETIMES_INTERLEAVE,
            ],
        },
        Named {
            name: "no-fence",
            description: "the standard configuration with fencing off: timed-out targets, uncertain digests, late replies, failed unregisters",
            config: ModelConfig {
                fence_on_timeout: false,
                ..standard.clone()
            },
            symmetry: true,
            expected: &[
                SOMETIMES_ROLLBACK,
                SOMETIMES_SLOT_REUSE,
                SOMETIMES_INTERLEAVE,
                SOMETIMES_UNREGISTER_FAILED,
            ],
        },
    ]
}

/// The named configuration called `name`, if any.
pub fn named(name: &str) -> Option<Named> {
    all().into_iter().find(|n| n.name == name)
}
