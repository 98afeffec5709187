//! The model checker on small configurations (`specs/model.md`): pinned
//! state counts (a change in the state space is noticed), witnesses of every
//! `sometimes` property, every mutant caught with a counterexample while the
//! real code passes, symmetry reduction giving the same verdicts as the full
//! state space, and the command's `--json` line.
//!
//! Runs single-threaded so that the counts are reproducible; plain
//! `cargo test -p callreg-model` (no fork, no shared state).

#[cfg(feature = "mutants")]
use callreg::protocol::Mutant;
#[cfg(feature = "mutants")]
use callreg_model::model::{mutant_name, mutant_named};
use callreg_model::model::{ModelConfig, RegistrationModel};
use callreg_model::properties::*;
use callreg_model::run::{check, Outcome, SearchOptions};
use callreg_model::script::Script;

fn script(name: &str) -> Script {
    Script::named(name).unwrap()
}

/// `name` on `targets` targets, no fault, no task, fencing on, 2 slots.
fn quiet(targets: u16, name: &str) -> ModelConfig {
    ModelConfig::fault_free(targets, script(name))
}

fn run(config: ModelConfig, symmetry: bool) -> Outcome {
    let model = RegistrationModel::new(config).unwrap();
    let options = SearchOptions {
        symmetry,
        threads: 1,
        ..SearchOptions::default()
    };
    check(model, &options)
}

fn violated(outcome: &Outcome) -> Vec<&str> {
    let mut names: Vec<&str> = outcome
        .violations
        .iter()
        .map(|v| v.property.as_str())
        .collect();
    names.sort();
    names
}

fn assert_passes(outcome: &Outcome) {
    assert!(outcome.complete, "incomplete run");
    assert_eq!(
        violated(outcome),
        Vec::<&str>::new(),
        "{:#?}",
        outcome.violations
    );
}

#[test]
fn fault_free_scripts_pass_with_pinned_state_counts() {
    let expected = [
        ("single-register", 8),
        ("duplicate-register", 103),
        ("register-unregister-same-digest", 125),
        ("two-digests", 101),
        ("snapshot-then-operations", 68),
    ];
    for (name, unique) in expected {
        let outcome = run(quiet(2, name), false);
        assert_passes(&outcome);
        assert_eq!(outcome.unique_states, unique, "{name} on 2 targets");
        assert!(
            outcome.witnessed.contains(&SOMETIMES_PUBLISH.to_owned()),
            "{name}"
        );
    }
}

/// A small configuration with every fault: 2 targets, 1 crash,
/// 1 deserialization failure, 1 corruption, 1 deadline, 1 task.
fn faulty(name: &str, fence: bool) -> ModelConfig {
    ModelConfig {
        targets: 2,
        fence_on_timeout: fence,
        ..ModelConfig {
            script: script(name),
            ..ModelConfig::standard()
        }
    }
}

#[test]
fn a_staging_failure_fails_the_register_before_any_target_sees_it() {
    let config = ModelConfig {
        stage_failures: 1,
        ..quiet(2, "single-register")
    };
    let outcome = run(config, false);
    assert_passes(&outcome);
    // One more state than without the fault: the register completed with
    // the staging error and nothing in transit.
    assert_eq!(outcome.unique_states, 9);
}

#[test]
fn faulty_configurations_pass_with_pinned_state_counts() {
    let expected = [
        ("single-register", true, 217),
        ("single-register", false, 392),
        ("register-unregister-same-digest", true, 48860),
        ("snapshot-then-operations", true, 37324),
    ];
    let mut counted = Vec::new();
    for (name, fence, _) in expected {
        let outcome = run(faulty(name, fence), false);
        assert_passes(&outcome);
        counted.push((name, fence, outcome.unique_states));
    }
    assert_eq!(counted, expected);
}

#[test]
fn every_sometimes_property_is_witnessed() {
    let fenced = run(faulty("register-unregister-same-digest", true), false);
    let unfenced = run(faulty("single-register", false), false);
    let snapshot = run(faulty("snapshot-then-operations", true), false);
    let witnessed = |o: &Outcome, name: &str| o.witnessed.iter().any(|w| w == name);
    assert!(witnessed(&fenced, SOMETIMES_PUBLISH));
    assert!(witnessed(&fenced, SOMETIMES_ROLLBACK));
    assert!(witnessed(&fenced, SOMETIMES_INTERLEAVE));
    assert!(witnessed(&fenced, SOMETIMES_SLOT_REUSE));
    // With fencing, a silent target is killed: nothing becomes uncertain
    // through a deadline and no reply can arrive late.
    assert!(!witnessed(&fenced, SOMETIMES_UNCERTAIN));
    assert!(!witnessed(&fenced, SOMETIMES_LATE_REPLY));
    assert!(witnessed(&unfenced, SOMETIMES_UNCERTAIN));
    assert!(witnessed(&unfenced, SOMETIMES_LATE_REPLY));
    assert!(witnessed(&snapshot, SOMETIMES_SLOT_REUSE));
    assert!(witnessed(&fenced, SOMETIMES_TARGET_LOST));
    assert!(witnessed(&snapshot, SOMETIMES_SLOT_EXHAUSTED));
    // Heartbeats (2, with 2 deadlines): a target heard from is spared,
    // then meets the bound or, silent again, its silence deadline; with
    // none, nothing of the deadline rule is witnessed. (Probe-first off:
    // with it a single register waits for one target at a time.)
    for fence in [true, false] {
        let beating = run(
            ModelConfig {
                heartbeats: 2,
                deadlines: 2,
                probe_first: false,
                ..faulty("single-register", fence)
            },
            false,
        );
        assert_passes(&beating);
        for name in [
            SOMETIMES_BOUND,
            SOMETIMES_SPARED,
            SOMETIMES_SILENT_AFTER_HEARD,
        ] {
            assert!(witnessed(&beating, name), "{name}, fence {fence}");
            assert!(!witnessed(&fenced, name), "{name} without heartbeats");
        }
    }
    // Fault-free runs lose no target and, with a slot per digest, never
    // run out of slots.
    let calm = run(quiet(2, "two-digests"), false);
    assert!(!witnessed(&calm, SOMETIMES_TARGET_LOST));
    assert!(!witnessed(&calm, SOMETIMES_SLOT_EXHAUSTED));
}

/// 2 targets, `register-unregister-same-digest`, 1 crash, replacement
/// targets (rate limit 1), no other fault.
fn replacing() -> ModelConfig {
    ModelConfig {
        crashes: 1,
        respawn_limit: 1,
        ..quiet(2, "register-unregister-same-digest")
    }
}

#[test]
fn replacement_targets_pass_with_pinned_state_counts() {
    let outcome = run(replacing(), false);
    assert_passes(&outcome);
    assert_eq!(outcome.unique_states, 4_496);
    let witnessed = |name: &str| outcome.witnessed.iter().any(|w| w == name);
    assert!(witnessed(SOMETIMES_JOINED));
    assert!(witnessed(SOMETIMES_JOINED_IN_FLIGHT));
    // No failed deserialization, corruption or deadline: no join fails.
    assert!(!witnessed(SOMETIMES_JOIN_FAILED));
    assert!(!witnessed(SOMETIMES_ABANDONED));
    // Replacements off: the same configuration never replaces a target.
    let off = run(
        ModelConfig {
            respawn_limit: 0,
            ..replacing()
        },
        false,
    );
    assert_passes(&off);
    assert!(!off.witnessed.iter().any(|w| w == SOMETIMES_JOINED));
}

#[cfg(feature = "mutants")]
/// The smallest configuration known to expose `mutant`, and the
/// properties it breaks there.
fn exposing(mutant: Mutant) -> (ModelConfig, Vec<&'static str>) {
    let mut config = match mutant {
        Mutant::PublishBeforeAllReplies | Mutant::ReleaseStagedEarly => quiet(2, "single-register"),
        Mutant::SkipCleanup => ModelConfig {
            corruptions: 1,
            ..quiet(2, "single-register")
        },
        Mutant::CleanupUnconfirmedTargets => ModelConfig {
            corruptions: 1,
            ..quiet(2, "register-unregister-same-digest")
        },
        Mutant::ForgetUncertain => ModelConfig {
            deadlines: 1,
            fence_on_timeout: false,
            ..quiet(2, "single-register")
        },
        Mutant::SkipDigestVerification => ModelConfig {
            corruptions: 1,
            ..quiet(1, "single-register")
        },
        Mutant::FreeSlotHeldByRun => ModelConfig {
            tasks: 1,
            ..quiet(1, "register-unregister-same-digest")
        },
        Mutant::BroadcastBeforeProbe => quiet(2, "single-register"),
        Mutant::RetryPoisoned => ModelConfig {
            poison_kills: 1,
            ..quiet(2, "duplicate-register")
        },
        Mutant::IgnoreNestedPoison => ModelConfig {
            poison_refusals: 1,
            ..quiet(2, "duplicate-register")
        },
        Mutant::IgnoreAlive => ModelConfig {
            deadlines: 1,
            heartbeats: 1,
            ..quiet(1, "single-register")
        },
        Mutant::PoisonSilence => ModelConfig {
            deadlines: 1,
            ..quiet(2, "duplicate-register")
        },
        // Two heartbeats: the second carries the probe past its silence
        // deadline to the bound, queued (its frame not applied yet).
        Mutant::PoisonQueued => ModelConfig {
            deadlines: 1,
            heartbeats: 2,
            ..quiet(2, "single-register")
        },
        Mutant::JoinBeforeReplay | Mutant::SkipReplayOfPublished => replacing(),
        Mutant::CancelStarted => ModelConfig {
            tasks: 1,
            cancels: 1,
            ..quiet(1, "single-register")
        },
        Mutant::DeadlineWithoutCompletion => ModelConfig {
            tasks: 1,
            task_deadline: true,
            deadlines: 1,
            ..quiet(1, "single-register")
        },
        Mutant::AcceptStaleResult => ModelConfig {
            tasks: 2,
            task_deadline: true,
            deadlines: 1,
            stale_results: 1,
            respawn_limit: 1,
            ..quiet(1, "single-register")
        },
        Mutant::RetireBusy => ModelConfig {
            tasks: 2,
            submit_any: true,
            max_tasks_per_target: 1,
            respawn_limit: 1,
            ..quiet(2, "single-register")
        },
        Mutant::DeadlineFromSubmit => ModelConfig {
            tasks: 2,
            task_deadline: true,
            deadlines: 1,
            ..quiet(1, "single-register")
        },
        Mutant::RetryStarted => ModelConfig {
            tasks: 1,
            crashes: 1,
            submit_any: true,
            ..quiet(2, "single-register")
        },
    };
    // In name order, as `violated` lists them.
    let broken = match mutant {
        // A breach ends its path (the model explores nothing after it).
        Mutant::PublishBeforeAllReplies => vec![INV1, INV11, CONTRACT],
        Mutant::SkipCleanup => vec![INV2],
        Mutant::ForgetUncertain => vec![INV2, QUERIES],
        Mutant::CleanupUnconfirmedTargets => vec![INV2, INV8, FENCED_CERTAIN, CONTRACT],
        Mutant::ReleaseStagedEarly => vec![INV7, PROGRESS],
        Mutant::SkipDigestVerification => vec![INV5],
        Mutant::FreeSlotHeldByRun => vec![INV4, QUERIES],
        Mutant::BroadcastBeforeProbe => vec![PROBE_FIRST],
        Mutant::RetryPoisoned => vec![POISON_NOT_SENT],
        Mutant::IgnoreAlive => vec![HEARD_NOT_FENCED],
        Mutant::PoisonSilence => vec![SILENCE_POISONS_NOTHING],
        Mutant::PoisonQueued => vec![QUEUED_POISONS_NOTHING],
        Mutant::IgnoreNestedPoison => vec![REFUSED_PROBE_NOT_SENT],
        // Joined early, a replacement is sent the broadcast of a register
        // issued before it started; its answer, to a seq below its first,
        // is ignored as an earlier process's, and the register never ends.
        Mutant::JoinBeforeReplay => vec![
            INV10_EVENTUALLY,
            INV10_TERMINAL,
            INV11,
            INV2,
            INV8,
            FENCED_CERTAIN,
            QUERIES,
        ],
        Mutant::SkipReplayOfPublished => vec![INV11],
        Mutant::CancelStarted => vec![TASK_CANCELLED_NOT_RUN, QUERIES],
        Mutant::DeadlineWithoutCompletion => vec![TASK_DEADLINE_FENCES],
        Mutant::AcceptStaleResult => vec![INV10_TERMINAL, INV13, QUERIES, TASK_RESULT_FROM_RUNNER],
        Mutant::RetireBusy => vec![CONTRACT],
        Mutant::DeadlineFromSubmit => vec![CONTRACT, QUERIES],
        Mutant::RetryStarted => vec![TASK_RUN_ONCE],
    };
    config.mutant = Some(mutant);
    (config, broken)
}

#[cfg(feature = "mutants")]
#[test]
fn every_mutant_is_caught_with_a_counterexample_and_the_real_code_is_not() {
    for mutant in Mutant::ALL {
        let (config, broken) = exposing(*mutant);
        let caught = run(config.clone(), false);
        assert!(caught.complete, "{mutant:?}");
        assert_eq!(violated(&caught), broken, "{mutant:?}");
        for violation in caught
            .violations
            .iter()
            .filter(|v| v.property.starts_with(|c: char| c.is_ascii_digit()))
        {
            assert!(
                violation
                    .trace
                    .iter()
                    .any(|l| l.starts_with("=> invariant")),
                "{mutant:?}: {:?}",
                violation.trace
            );
        }
        let real = run(
            ModelConfig {
                mutant: None,
                ..config
            },
            false,
        );
        assert_passes(&real);
    }
}

#[cfg(feature = "mutants")]
#[test]
fn mutants_are_also_caught_by_one_shared_fault_rich_configuration() {
    // Not only by the configuration chosen for each: 2 targets, the
    // standard script, every fault and a heartbeat (fencing off for the
    // mutant that only matters without it). Stops at the first violation.
    for mutant in Mutant::ALL {
        let replaces = matches!(
            mutant,
            Mutant::JoinBeforeReplay
                | Mutant::SkipReplayOfPublished
                | Mutant::AcceptStaleResult
                | Mutant::RetireBusy
        );
        // The task mutants need what reaches their code: a cancel, task
        // deadlines, a second task and a stale result.
        let tasks = matches!(
            mutant,
            Mutant::CancelStarted
                | Mutant::DeadlineWithoutCompletion
                | Mutant::AcceptStaleResult
                | Mutant::RetireBusy
                | Mutant::DeadlineFromSubmit
                | Mutant::RetryStarted
        );
        // Retirement needs its bound and tasks placed by the parent.
        let retire = *mutant == Mutant::RetireBusy;
        let config = ModelConfig {
            mutant: Some(*mutant),
            poison_refusals: u8::from(*mutant == Mutant::IgnoreNestedPoison),
            // A probe queued past its bound needs a second heartbeat.
            heartbeats: if *mutant == Mutant::PoisonQueued {
                2
            } else {
                u8::from(!tasks)
            },
            tasks: if tasks { 2 } else { 1 },
            cancels: u8::from(tasks),
            task_deadline: tasks,
            stale_results: u8::from(tasks),
            respawn_limit: u16::from(replaces),
            submit_any: retire || *mutant == Mutant::RetryStarted,
            max_tasks_per_target: u32::from(retire),
            ..faulty(
                "register-unregister-same-digest",
                *mutant != Mutant::ForgetUncertain,
            )
        };
        let model = RegistrationModel::new(config).unwrap();
        let options = SearchOptions {
            threads: 1,
            stop_at_first_violation: true,
            ..SearchOptions::default()
        };
        let outcome = check(model, &options);
        assert!(!outcome.violations.is_empty(), "{mutant:?} not caught");
    }
}

#[cfg(feature = "mutants")]
#[test]
fn a_counterexample_reads_as_the_steps_that_break_the_invariant() {
    let (config, _) = exposing(Mutant::PublishBeforeAllReplies);
    let outcome = run(config, false);
    let trace = &outcome.violations[0].trace;
    assert_eq!(
        trace[..5],
        [
            "client issues operation 0: register A",
            "target 0 applies register A (seq 1)",
            "target 0: deserialization for seq 1 succeeds",
            "parent receives from target 0: reply OK to seq 1 for A",
            "=> invariant 1 (publish after all) violated: handle 1 (sha256:4141414141414141414141414141414141414141414141414141414141414141) published before targets [1] confirmed",
        ]
    );
}

#[cfg(feature = "mutants")]
#[test]
fn symmetry_gives_the_same_verdicts_as_the_full_state_space() {
    let three = |name: &str, fence: bool| ModelConfig {
        targets: 3,
        ..faulty(name, fence)
    };
    let mut configs = vec![
        (
            "single-register, faults, fenced",
            three("single-register", true),
        ),
        (
            "single-register, faults, unfenced",
            three("single-register", false),
        ),
        (
            "register-unregister-same-digest, one crash",
            ModelConfig {
                targets: 3,
                crashes: 1,
                ..quiet(3, "register-unregister-same-digest")
            },
        ),
    ];
    for mutant in Mutant::ALL {
        let (config, _) = exposing(*mutant);
        configs.push((
            "mutant on 3 targets",
            ModelConfig {
                targets: 3,
                ..config
            },
        ));
    }
    let full = run(configs[0].1.clone(), false);
    let reduced = run(configs[0].1.clone(), true);
    assert_eq!((full.unique_states, reduced.unique_states), (1247, 478));
    for (what, config) in configs {
        let full = run(config.clone(), false);
        let reduced = run(config.clone(), true);
        assert!(full.complete && reduced.complete, "{what}");
        assert_eq!(
            violated(&full),
            violated(&reduced),
            "{what} {:?}",
            config.mutant
        );
        assert_eq!(
            full.witnessed, reduced.witnessed,
            "{what} {:?}",
            config.mutant
        );
        // A mutant's breach ends its paths (the model explores nothing
        // after it), which can leave too few states to reduce.
        let mutant = config.mutant.is_some();
        assert!(
            reduced.unique_states < full.unique_states
                || (mutant && reduced.unique_states == full.unique_states),
            "{what}: {} vs {}",
            reduced.unique_states,
            full.unique_states
        );
    }
}

#[cfg(feature = "mutants")]
#[test]
fn mutant_names_round_trip() {
    for mutant in Mutant::ALL {
        assert_eq!(mutant_named(&mutant_name(*mutant)), Some(*mutant));
    }
    assert_eq!(
        mutant_name(Mutant::FreeSlotHeldByRun),
        "free-slot-held-by-run"
    );
    assert_eq!(mutant_named("no-such-bug"), None);
}

#[cfg(feature = "mutants")]
#[test]
fn check_command_prints_a_json_line_and_exits_by_verdict() {
    let bin = env!("CARGO_BIN_EXE_callreg-model");
    let quiet = [
        "--targets",
        "2",
        "--script",
        "single-register",
        "--crashes",
        "0",
        "--deserialize-failures",
        "0",
        "--corruptions",
        "0",
        "--deadlines",
        "0",
        "--tasks",
        "0",
        "--heartbeats",
        "0",
        "--threads",
        "1",
        "--json",
    ];
    // `check` with the quiet configuration and `extra` arguments.
    let check = |extra: &[&str]| {
        std::process::Command::new(bin)
            .arg("check")
            .args(quiet)
            .args(extra)
            .output()
            .unwrap()
    };
    let ok = check(&[]);
    assert_eq!(ok.status.code(), Some(0));
    // With --json, stdout is exactly one JSON document; the report goes
    // to stderr.
    let stdout = String::from_utf8(ok.stdout).unwrap();
    let last: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1);
    assert_eq!(last["complete"], true);
    assert_eq!(last["unique_states"], 8);
    assert_eq!(last["violations"], serde_json::json!([]));
    assert_eq!(last["missing_witnesses"], serde_json::json!([]));
    let stderr = String::from_utf8(ok.stderr).unwrap();
    assert!(
        stderr.ends_with("; 0 violation(s), 0 missing witness(es)\n"),
        "{stderr}"
    );

    let caught = check(&["--mutant", "publish-before-all-replies"]);
    assert_eq!(caught.status.code(), Some(1));
    let stdout = String::from_utf8(caught.stdout).unwrap();
    let last: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(last["violations"][0]["property"], INV1);

    // A script from a JSON file: register B, then unregister it.
    let file =
        std::env::temp_dir().join(format!("callreg-model-script-{}.json", std::process::id()));
    std::fs::write(
        &file,
        r#"{"name": "b-then-drop", "description": "register B, then unregister it",
            "operations": [{"register": "B"}, {"unregister": {"operation": 0}}]}"#,
    )
    .unwrap();
    let from_file = check(&["--script", file.to_str().unwrap()]);
    std::fs::remove_file(&file).unwrap();
    assert_eq!(from_file.status.code(), Some(0));
    let stdout = String::from_utf8(from_file.stdout).unwrap();
    let last: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(last["complete"], true);
    assert_eq!(last["unique_states"], 17);
    assert_eq!(last["violations"], serde_json::json!([]));

    let missing = std::process::Command::new(bin)
        .arg("check")
        .args(["--script", "no-such-script"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));

    let shallow = check(&["--max-depth", "3"]);
    assert_eq!(shallow.status.code(), Some(3));
    let stdout = String::from_utf8(shallow.stdout).unwrap();
    let document: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(document["complete"], false);

    // --first stops only at a failed property: incomplete, and exit 1.
    let first = check(&["--mutant", "publish-before-all-replies", "--first"]);
    assert_eq!(first.status.code(), Some(1));
    let stdout = String::from_utf8(first.stdout).unwrap();
    let document: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(document["violations"][0]["property"], INV1);
}

/// A bad command line exits 2, as in `callreg` (specs/model.md §8);
/// `--help` and `--version` exit 0, and the help lists the exit codes.
#[test]
fn usage_errors_exit_2_and_help_exits_0() {
    let bin = env!("CARGO_BIN_EXE_callreg-model");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin).args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let (code, _, stderr) = run(&["check", "--no-such-flag"]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.starts_with("error: unexpected argument '--no-such-flag' found"),
        "{stderr}"
    );
    let (code, _, stderr) = run(&["check", "--threads", "0"]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.starts_with(
            "error: invalid value '0' for '--threads <THREADS>': 0 is not in 1..18446744073709551615"
        ),
        "{stderr}"
    );
    let (code, _, _) = run(&["check", "--targets", "many"]);
    assert_eq!(code, Some(2));
    let (code, _, _) = run(&[]);
    assert_eq!(code, Some(2));
    // A depth bound of 0 would explore nothing: refused.
    let (code, stdout, stderr) = run(&["check", "--max-depth", "0"]);
    assert_eq!((code, stdout.as_str()), (Some(2), ""));
    assert!(
        stderr.starts_with(
            "error: invalid value '0' for '--max-depth <MAX_DEPTH>': 0 is not in 1..18446744073709551615"
        ),
        "{stderr}"
    );
    // A named configuration replaces the configuration flags.
    let (code, _, stderr) = run(&["check", "--config", "standard", "--targets", "2"]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.starts_with("error: the argument '--config <NAME>' cannot be used with"),
        "{stderr}"
    );
    let (code, stdout, stderr) = run(&["check", "--config", "no-such-config"]);
    assert_eq!((code, stdout.as_str()), (Some(2), ""));
    assert_eq!(
        stderr,
        "callreg-model: unknown configuration \"no-such-config\"; `callreg-model list` shows them\n"
    );
    let exit_codes = "Exit status:\n  0  every run complete, no property failed, every expected witness found\n  1  a property failed, or a witness the configuration must produce is missing\n  2  bad command line, script or configuration; explore: cannot listen on the address\n  3  a run is incomplete (--max-depth was reached) and nothing failed;\n     a run --first stopped at a failed property exits 1\n";
    let (code, stdout, _) = run(&["--help"]);
    assert_eq!(code, Some(0));
    assert!(
        stdout.starts_with("Model-check the callreg registration protocol"),
        "{stdout}"
    );
    assert!(stdout.ends_with(exit_codes), "{stdout}");
    for command in ["check", "explore"] {
        let (code, stdout, _) = run(&[command, "--help"]);
        assert_eq!(code, Some(0));
        assert!(stdout.ends_with(exit_codes), "{command}: {stdout}");
    }
    let (code, stdout, _) = run(&["--version"]);
    assert_eq!(code, Some(0));
    assert_eq!(
        stdout,
        format!("callreg-model {}\n", env!("CARGO_PKG_VERSION"))
    );
}

/// `--mutant forget-uncertain` implies `--no-fence` (with fencing on its
/// code path is unreachable and the check would pass), says so on
/// stderr, and is caught; `list` names the configuration of each mutant.
#[cfg(feature = "mutants")]
#[test]
fn a_mutant_that_needs_no_fence_switches_fencing_off() {
    let bin = env!("CARGO_BIN_EXE_callreg-model");
    let args = [
        "check",
        "--targets",
        "2",
        "--script",
        "single-register",
        "--crashes",
        "0",
        "--deserialize-failures",
        "0",
        "--corruptions",
        "0",
        "--deadlines",
        "1",
        "--tasks",
        "0",
        "--threads",
        "1",
        "--progress-secs",
        "0",
        "--mutant",
        "forget-uncertain",
    ];
    let out = std::process::Command::new(bin).args(args).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8(out.stderr).unwrap(),
        "callreg-model: notice: --mutant forget-uncertain implies --no-fence (a fenced target never leaves a digest uncertain)\n"
    );
    let list = std::process::Command::new(bin)
        .arg("list")
        .output()
        .unwrap();
    let stdout = String::from_utf8(list.stdout).unwrap();
    assert!(stdout.contains(
        "\nmutant forget-uncertain (reachable only with --no-fence and --deadlines 1 or more; --mutant forget-uncertain implies --no-fence)\n"
    ), "{stdout}");
    assert!(
        stdout.contains("\nmutant skip-cleanup (reachable with fencing on or off)\n"),
        "{stdout}"
    );
}

/// `explore` on an address already in use exits 2 (a bad argument) with
/// one line on stderr, instead of stateright's panic.
#[test]
fn explore_on_a_busy_port_exits_2() {
    let bin = env!("CARGO_BIN_EXE_callreg-model");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let out = std::process::Command::new(bin)
        .args([
            "explore",
            "--targets",
            "1",
            "--script",
            "single-register",
            "--addr",
        ])
        .arg(&addr)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.starts_with(&format!("callreg-model: cannot listen on {addr}: ")),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

/// `check --config NAME --json`: one JSON document naming the
/// configuration, its pinned count, every expected witness found.
#[test]
fn check_a_named_configuration_as_one_json_document() {
    let bin = env!("CARGO_BIN_EXE_callreg-model");
    let out = std::process::Command::new(bin)
        .args(["check", "--config", "forged", "--threads", "1", "--json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let document: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(document["name"], "forged");
    assert_eq!(document["unique_states"], 6522);
    assert_eq!(document["complete"], true);
    assert_eq!(document["missing_witnesses"], serde_json::json!([]));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.starts_with("== configuration forged: 2 targets, single-register"),
        "{stderr}"
    );
}

/// A witness the configuration must produce but does not fails the
/// verdict (the run is complete and nothing is violated, yet it is not a
/// pass).
#[test]
fn a_missing_expected_witness_fails_the_verdict() {
    use callreg_model::run::check_expecting;
    let model = RegistrationModel::new(quiet(2, "single-register")).unwrap();
    let outcome = check_expecting(
        model,
        &SearchOptions {
            threads: 1,
            ..SearchOptions::default()
        },
        &[SOMETIMES_PUBLISH, SOMETIMES_UNCERTAIN],
    );
    assert!(outcome.complete);
    assert!(outcome.violations.is_empty());
    assert_eq!(
        outcome.missing_witnesses,
        vec![SOMETIMES_UNCERTAIN.to_owned()]
    );
    assert!(!outcome.passed());
    // The derived expectations of a fault-free configuration: it starts
    // and publishes.
    assert_eq!(
        callreg_model::configs::derived_expectations(&quiet(2, "single-register")),
        vec![
            SOMETIMES_PUBLISH,
            SOMETIMES_STARTED,
            SOMETIMES_PROBED_THEN_BROADCAST
        ]
    );
}
